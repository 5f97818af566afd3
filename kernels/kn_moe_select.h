/*
 * kn_moe_select.h: the order every selection of the MoE router uses
 * (kernels/kn_moe.cu: groups, then experts), shared by the CUDA kernel and
 * the host test that checks it reproduces dsv3_route's sequential loop
 * (tests/kimi_c/test_route_select.c). Header-only; C and CUDA.
 *
 * A candidate is (value, id, valid). `better` is a TOTAL order: valid before
 * invalid; a number before NaN; the larger value; on equal values (and
 * between NaNs) the lower id. dsv3_route picks, scanning ids upward, the
 * first candidate with `best < 0 || v > v[best]`: the largest value, the
 * lowest id among equals, which is the maximum of this order whenever no
 * value is NaN. Because the order is total, the maximum does not depend on
 * how the candidates are visited, so lane-strided scans combined by an xor
 * butterfly give the sequential loop's answer.
 */
#ifndef SPECD_KERNELS_KN_MOE_SELECT_H
#define SPECD_KERNELS_KN_MOE_SELECT_H

#ifdef __CUDACC__
#define KN_SEL_FN __host__ __device__ __forceinline__
#else
#define KN_SEL_FN static inline
#endif

typedef struct kn_cand {
    float v;
    int id;
    int valid; /* 0: "no candidate" (a lane with nothing left to offer) */
} kn_cand;

/* 1 when a comes before b in the order above */
KN_SEL_FN int kn_cand_better(kn_cand a, kn_cand b) {
    if (a.valid != b.valid) return a.valid > b.valid;
    const int an = a.v != a.v, bn = b.v != b.v;
    if (an != bn) return bn;
    if (!an && a.v != b.v) return a.v > b.v;
    return a.id < b.id;
}

#endif
