/*
 * kn_bench_util.h: what the GPU benchmarks (kn_bench, kn_mla_bench,
 * kn_moe_bench, kimi_step_bench) share: the copy bandwidth every "fraction
 * of bandwidth" figure is measured against.
 *
 * Needs the CUDA runtime API and a usable GPU (the caller has called
 * kn_harness_require_gpu()). Errors exit 1 through KN_CK.
 */
#ifndef SPECD_TESTS_KN_BENCH_UTIL_H
#define SPECD_TESTS_KN_BENCH_UTIL_H

#include <cuda_runtime_api.h>

#include "tests/kernels/kn_harness.h"

/* Device-to-device copy bandwidth in GB/s (1e9 B/s), counted as bytes read
 * + bytes written (2 x size / time: the usual "copy bandwidth" of a GPU):
 * one warm-up copy, then `iters` (>= 1) cudaMemcpyAsync of a 1 GiB buffer
 * on `st`, timed with CUDA events. Allocates and frees 2 GiB of device
 * memory (call it before the benchmark's own allocations). */
static inline double kn_bench_copy_gbps(cudaStream_t st, int iters) {
    if (iters < 1) iters = 1;
    const size_t bytes = (size_t)1 << 30;
    void *a, *b;
    cudaEvent_t e0, e1;
    KN_CK(cudaMalloc(&a, bytes));
    KN_CK(cudaMalloc(&b, bytes));
    KN_CK(cudaEventCreate(&e0));
    KN_CK(cudaEventCreate(&e1));
    KN_CK(cudaMemsetAsync(a, 1, bytes, st));
    KN_CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st));
    KN_CK(cudaEventRecord(e0, st));
    for (int i = 0; i < iters; i++) KN_CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st));
    KN_CK(cudaEventRecord(e1, st));
    KN_CK(cudaEventSynchronize(e1));
    float ms = 0;
    KN_CK(cudaEventElapsedTime(&ms, e0, e1));
    KN_CK(cudaEventDestroy(e0));
    KN_CK(cudaEventDestroy(e1));
    KN_CK(cudaFree(a));
    KN_CK(cudaFree(b));
    return 2.0 * (double)bytes * iters / (ms * 1e-3) / 1e9;
}

#endif
