/*
 * kn_moe.cu: the MoE block of DeepSeek-V3 / Kimi-K2.5 on the device
 * (kernels/kn_moe.h): noaux_tc routing, per-expert token lists, the grouped
 * int4 group-32 GEMMs on KN_I4IL experts (gate/up + SiLU x up, then down)
 * and the fixed-order combine. No state.
 *
 * Routing (kn_moe_route_kernel): one warp per token, the token's scores and
 * choices in shared memory. Every selection (groups, then experts) is an
 * argmax under one total order -- larger value first, equal values: lower
 * id; NaN below everything -- computed as lane-strided scans and an xor
 * butterfly; a total order makes the result independent of the scan order,
 * hence equal to dsv3_route's sequential `best < 0 || v > v[best]` loop on
 * every input without NaN. The sigmoid takes e^-x = (float)exp((double)-x)
 * (CUDA's double exp is within 1 double ulp, so this is the correctly
 * rounded expf up to a 2^-29-ulp window); weights are summed by one lane in
 * selection order and scaled with the CPU's f32 operations.
 *
 * Grouped GEMM (kn_moe_gemm_kernel<L, GU>): grid.y = expert slot a (the a-th
 * expert with tokens, ascending id; a slot past the count exits), grid.x =
 * tiles of output rows. L lanes per output row (32 when the row has >= 32
 * groups of 32 values, else 8: Kimi TP-8 down rows of 256 values are 8
 * groups), 32/L rows per warp, 4 warps per block. Lane `sub` of a row reads
 * groups sub, sub + L, ... (16 bytes of nibbles + one bf16 scale each; the
 * next group is loaded before the current one is used), dequantises a word
 * (8 values) at a time with two bf16x2 fmas per pair (kn_moe.h layout) and
 * multiplies it into every token of the expert, NT <= 4 tokens per register
 * tile (T == 1: a one-token variant held to 64 registers, 8 blocks per SM;
 * otherwise 128, 4 blocks; no spills, tests/kernels kn_spill_check). GU: the
 * gate row r and the up row I + r are read by the same lanes and out =
 * silu(g) * u.
 *
 * BATCH INVARIANCE: for one token and one output, lane `sub` computes
 * acc = fma(w_c, x_c, acc) over its groups in increasing order and the 32
 * columns of a group in increasing order, from acc = 0; the L lane sums are
 * added by the xor butterfly L/2, ..., 1. That depends on the weight's shape
 * only: not on T, on how many tokens an expert got, on the tile, on the
 * token's index. The combine adds a token's k expert outputs in ascending
 * expert id (y = 0; y += ye * w, each op rounded; then y += shared), as
 * engine/model/deepseek_v3_fwd.c moe_forward. All arithmetic is explicit
 * (__fmaf_rn, __fadd_rn, ...): nvcc cannot contract it differently per
 * instantiation.
 *
 * Not measured or run on a GPU yet (this machine has none): see
 * docs/kimi-k2.5.md "MoE kernels".
 */
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/kn.h"
#include "kernels/kn_moe.h"
#include "kernels/kn_moe_select.h"

namespace {

constexpr int KN_MOE_WARPS = 4;     /* warps per GEMM block */
constexpr int KN_MOE_TILE = 4;      /* tokens per register tile */
constexpr int KN_MOE_MAX_K = 64;    /* experts per token */
constexpr int KN_MOE_MAX_E = 4096;  /* routed experts */
constexpr int KN_MOE_MAX_G = 1024;  /* expert groups (dsv3_route's bound) */
constexpr int KN_ALIGN_THREADS = 1024;

/* ------------------------------------------------------------ helpers */

/* e^-x as the correctly rounded expf (see the header comment) */
__device__ __forceinline__ float exp_neg(float x) { return (float)exp(-(double)x); }

/* silu(g) * u with the CPU's operations: g / (1 + e^-g) * u */
__device__ __forceinline__ float silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, exp_neg(g))), u);
}

/* A candidate of an argmax and the total order of every selection (kn_moe_select.h). */
typedef kn_cand cand;
__device__ __forceinline__ bool better(const cand &a, const cand &b) { return kn_cand_better(a, b) != 0; }

__device__ __forceinline__ cand warp_best(cand c) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        cand o;
        o.v = __shfl_xor_sync(0xffffffffu, c.v, off);
        o.id = __shfl_xor_sync(0xffffffffu, c.id, off);
        o.valid = __shfl_xor_sync(0xffffffffu, c.valid, off);
        if (better(o, c)) c = o;
    }
    return c;
}

/* bf16x2 d = a * b + c, one round-to-nearest-even per half (sm_80+). */
__device__ __forceinline__ uint32_t bf2_fma(uint32_t a, uint32_t b, uint32_t c) {
#if defined(KN_EMU_DEVICE_HPP) /* tools/kn_emu only (never nvcc): the same instruction, one rounding per half */
    return kn_emu_bf16x2_fma_rn(a, b, c);
#else
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#endif
}

constexpr uint32_t BF2_MAGIC = 0x43004300u;   /* (128, 128) */
constexpr uint32_t BF2_ONE = 0x3f803f80u;     /* (1, 1) */
constexpr uint32_t BF2_M136 = 0xc308c308u;    /* (-136, -136) */
constexpr uint32_t BF2_MZERO = 0x80008000u;   /* (-0, -0): a*b + -0 == a*b, also for a*b == +0 */

/* The 8 values of a KN_I4IL word, bf16(q x scale) as f32 (v[e] = element e):
 * pair p = elements 2p, 2p+1 at bits 4p and 16 + 4p. s2 = the scale in both halves. */
__device__ __forceinline__ void dequant_word(uint32_t w, uint32_t s2, float v[8]) {
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const uint32_t t = ((w >> (4 * p)) & 0x000f000fu) | BF2_MAGIC; /* (128 + u_lo, 128 + u_hi), exact */
        const uint32_t q = bf2_fma(t, BF2_ONE, BF2_M136);              /* q = u - 8, exact */
        const uint32_t d = bf2_fma(q, s2, BF2_MZERO);                  /* bf16(q x scale), one rounding */
        v[2 * p] = __uint_as_float(d << 16);
        v[2 * p + 1] = __uint_as_float(d & 0xffff0000u);
    }
}

/* 16 bytes of weights read once: not kept in L1 (which then holds the activations). */
__device__ __forceinline__ uint4 ld_stream16(const void *p) {
#if defined(KN_EMU_DEVICE_HPP) /* tools/kn_emu only (never nvcc): a plain 16-byte load, alignment checked */
    return kn_emu_ld_stream16(p);
#else
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
#endif
}

__device__ __forceinline__ uint32_t scale_pair(const uint16_t *s, int g) {
    const uint32_t h = __ldg(reinterpret_cast<const unsigned short *>(s) + g);
    return h | (h << 16);
}

__device__ __forceinline__ float fma8(const float w[8], const float *x, float acc) {
    const float4 a = __ldg(reinterpret_cast<const float4 *>(x)), b = __ldg(reinterpret_cast<const float4 *>(x) + 1);
    acc = __fmaf_rn(w[0], a.x, acc);
    acc = __fmaf_rn(w[1], a.y, acc);
    acc = __fmaf_rn(w[2], a.z, acc);
    acc = __fmaf_rn(w[3], a.w, acc);
    acc = __fmaf_rn(w[4], b.x, acc);
    acc = __fmaf_rn(w[5], b.y, acc);
    acc = __fmaf_rn(w[6], b.z, acc);
    return __fmaf_rn(w[7], b.w, acc);
}

/* ------------------------------------------------------------ routing */

/* Shared memory of one warp (one token), 16-byte aligned parts. */
struct route_smem {
    size_t sc, ch, gs, used, keep, sel, bytes;
};

__host__ __device__ inline size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }

__host__ __device__ inline route_smem route_layout(int E, int G, int k) {
    route_smem m;
    m.sc = 0;
    m.ch = al16((size_t)E * 4);
    m.gs = m.ch + al16((size_t)E * 4);
    m.used = m.gs + al16((size_t)G * 4);
    m.keep = m.used + al16((size_t)E);
    m.sel = m.keep + al16((size_t)G);
    m.bytes = m.sel + al16((size_t)k * 4);
    return m;
}

__global__ void __launch_bounds__(32 * KN_MOE_WARPS) kn_moe_route_kernel(const float *__restrict__ logits,
                                                                         const float *__restrict__ bias, int32_t T,
                                                                         kn_moe_route_cfg c, int32_t *__restrict__ ids,
                                                                         float *__restrict__ wout) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    const int32_t t = (int32_t)blockIdx.x * wpb + warp;
    if (t >= T) return; /* warp-uniform */
    const int E = c.E, G = c.n_group, k = c.k, per = E / G;
    const route_smem L = route_layout(E, G, k);
    unsigned char *base = smem + (size_t)warp * L.bytes;
    float *sc = reinterpret_cast<float *>(base + L.sc), *ch = reinterpret_cast<float *>(base + L.ch);
    float *gs = reinterpret_cast<float *>(base + L.gs);
    unsigned char *used = base + L.used, *keep = base + L.keep;
    int *sel = reinterpret_cast<int *>(base + L.sel);
    const float *lg = logits + (size_t)t * E;
    for (int e = lane; e < E; e += 32) {
        const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_neg(lg[e])));
        sc[e] = s;
        ch[e] = __fadd_rn(s, bias[e]);
        used[e] = 0;
    }
    for (int g = lane; g < G; g += 32) keep[g] = 0;
    __syncwarp();
    if (G > 1 && c.topk_group < G) {
        /* group score: the sum of its two best choices (values only: order-free) */
        for (int g = lane; g < G; g += 32) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++) {
                const float v = ch[e];
                if (v > b1) {
                    b2 = b1;
                    b1 = v;
                } else if (v > b2) {
                    b2 = v;
                }
            }
            gs[g] = __fadd_rn(b1, b2);
        }
        __syncwarp();
        for (int j = 0; j < c.topk_group; j++) {
            cand b = {0.f, 0x7fffffff, 0};
            for (int g = lane; g < G; g += 32) {
                const cand x = {gs[g], g, !keep[g]};
                if (better(x, b)) b = x;
            }
            b = warp_best(b);
            if (lane == 0) keep[b.id] = 1; /* G >= topk_group: a valid group always remains */
            __syncwarp();
        }
        for (int e = lane; e < E; e += 32)
            if (!keep[e / per]) ch[e] = -INFINITY;
        __syncwarp();
    }
    for (int j = 0; j < k; j++) {
        cand b = {0.f, 0x7fffffff, 0};
        for (int e = lane; e < E; e += 32) {
            const cand x = {ch[e], e, !used[e]};
            if (better(x, b)) b = x;
        }
        b = warp_best(b);
        if (lane == 0) {
            used[b.id] = 1; /* k <= E: a valid expert always remains */
            sel[j] = b.id;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float sum = 0.f;
        for (int j = 0; j < k; j++) sum = __fadd_rn(sum, sc[sel[j]]);
        const float den = __fadd_rn(sum, 1e-20f);
        for (int j = 0; j < k; j++) {
            float w = sc[sel[j]];
            if (c.norm_topk_prob) w = __fdiv_rn(w, den);
            ids[(size_t)t * k + j] = sel[j];
            wout[(size_t)t * k + j] = __fmul_rn(w, c.routed_scaling);
        }
    }
}

/* ------------------------------------------------ workspace and align */

struct ws_layout {
    size_t off, active, nact, slot_of, bad, act, yd, bytes;
};

size_t al256(size_t n) { return (n + 255) & ~(size_t)255; }

ws_layout ws_layout_of(int32_t T, int32_t k, int32_t E, int32_t H, int32_t I) {
    ws_layout w;
    const size_t S = (size_t)T * (size_t)k;
    w.off = 0;                                         /* int32 [E + 1] slot offsets per expert */
    w.active = w.off + al256(((size_t)E + 1) * 4);     /* int32 [E] experts with tokens, ascending */
    w.nact = w.active + al256((size_t)E * 4);          /* int32 [1] their number */
    w.slot_of = w.nact + 256;                          /* int32 [T*k] slots (t*k + j) grouped by expert */
    w.bad = w.slot_of + al256(S * 4);                  /* int32 [T] 1: the token's ids are invalid */
    w.act = w.bad + al256((size_t)T * 4);              /* f32 [T*k, I] silu(gate) * up per slot */
    w.yd = w.act + al256(S * (size_t)I * 4);           /* f32 [T*k, H] down output per slot */
    w.bytes = w.yd + al256(S * (size_t)H * 4);
    return w;
}

/* One block. Per expert (thread-strided): its slots t*k + j in ascending
 * order of slot (so of token); offsets and the list of active experts by a
 * one-warp scan. Per token: bad = an id outside [0, E) or twice. */
__global__ void __launch_bounds__(KN_ALIGN_THREADS) kn_moe_align_kernel(const int32_t *__restrict__ ids, int32_t T,
                                                                        int32_t k, int32_t E, int32_t e0,
                                                                        int32_t E_route, int32_t *off,
                                                                        int32_t *active, int32_t *nact,
                                                                        int32_t *slot_of, int32_t *bad,
                                                                        int32_t *bad_flag) {
    const int S = T * k;
    for (int e = threadIdx.x; e < E; e += blockDim.x) { /* local expert e = routed expert e0 + e */
        int n = 0;
        for (int i = 0; i < S; i++) n += ids[i] == e0 + e;
        off[e] = n; /* counts first */
    }
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        int b = 0;
        for (int j = 0; j < k; j++) {
            const int32_t id = ids[(size_t)t * k + j];
            b |= id < 0 || id >= E_route;
            for (int u = 0; u < j; u++) b |= ids[(size_t)t * k + u] == id;
        }
        bad[t] = b;
        if (b && bad_flag) *bad_flag = 1;
    }
    __syncthreads();
    if (threadIdx.x < 32) { /* exclusive scan of the counts and of "has tokens", lane chunks of E/32 */
        const int lane = threadIdx.x, chunk = (E + 31) / 32, e0 = lane * chunk, e1 = min(E, e0 + chunk);
        int cs = 0, as = 0;
        for (int e = e0; e < e1; e++) {
            cs += off[e];
            as += off[e] > 0;
        }
        int ci = cs, ai = as; /* inclusive warp scans */
        for (int d = 1; d < 32; d <<= 1) {
            const int c2 = __shfl_up_sync(0xffffffffu, ci, d), a2 = __shfl_up_sync(0xffffffffu, ai, d);
            if (lane >= d) {
                ci += c2;
                ai += a2;
            }
        }
        int run = ci - cs, arun = ai - as;
        for (int e = e0; e < e1; e++) {
            const int n = off[e];
            off[e] = run;
            run += n;
            if (n > 0) active[arun++] = e;
        }
        if (lane == 31) {
            off[E] = ci;
            *nact = ai;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int p = off[e];
        for (int i = 0; i < S; i++)
            if (ids[i] == e0 + e) slot_of[p++] = i;
    }
}

/* ------------------------------------------------------- grouped GEMM */

struct gemm_args {
    const uint32_t *w;   /* expert 0's first row; expert e at + e * w_stride words */
    const uint16_t *s;   /* its scales; + e * s_stride */
    size_t w_stride, s_stride;
    int32_t rows, cols;  /* output rows (I for gate/up, H for down), input columns */
    const int32_t *off, *active, *nact, *slot_of;
    const float *x;      /* GU: x [T, cols] by token (slot / k); down: act [T*k, cols] by slot */
    int32_t k;
    float *out;          /* [T*k, rows] by slot */
};

/* acc[j] (+ accu[j] for GU) over the row's groups sub, sub + L, ... for the
 * NT tokens whose activation rows are xr[j]. */
template <int L, bool GU, int NT>
__device__ __forceinline__ void dot_tile(const uint32_t *__restrict__ wg, const uint16_t *__restrict__ sg,
                                         const uint32_t *__restrict__ wu, const uint16_t *__restrict__ su, int ng,
                                         int sub, const float *const xr[NT], float acc[NT], float accu[NT]) {
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = accu[j] = 0.f;
    int g = sub;
    uint4 qg = make_uint4(0, 0, 0, 0), qu = make_uint4(0, 0, 0, 0);
    uint32_t s2g = 0, s2u = 0;
    if (g < ng) {
        qg = ld_stream16(wg + 4 * g);
        s2g = scale_pair(sg, g);
        if constexpr (GU) {
            qu = ld_stream16(wu + 4 * g);
            s2u = scale_pair(su, g);
        }
    }
    for (; g < ng; g += L) {
        const uint4 cg = qg, cu = qu;
        const uint32_t c2g = s2g, c2u = s2u;
        if (g + L < ng) { /* the next group in flight while this one is used */
            qg = ld_stream16(wg + 4 * (g + L));
            s2g = scale_pair(sg, g + L);
            if constexpr (GU) {
                qu = ld_stream16(wu + 4 * (g + L));
                s2u = scale_pair(su, g + L);
            }
        }
        const uint32_t wdg[4] = {cg.x, cg.y, cg.z, cg.w}, wdu[4] = {cu.x, cu.y, cu.z, cu.w};
#pragma unroll
        for (int m = 0; m < 4; m++) {
            float vg[8], vu[8];
            dequant_word(wdg[m], c2g, vg);
            if constexpr (GU) dequant_word(wdu[m], c2u, vu);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const float *xc = xr[j] + 32 * g + 8 * m;
                acc[j] = fma8(vg, xc, acc[j]);
                if constexpr (GU) accu[j] = fma8(vu, xc, accu[j]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int o = L / 2; o > 0; o >>= 1) {
            acc[j] = __fadd_rn(acc[j], __shfl_xor_sync(0xffffffffu, acc[j], o));
            if constexpr (GU) accu[j] = __fadd_rn(accu[j], __shfl_xor_sync(0xffffffffu, accu[j], o));
        }
    }
}

template <int L, bool GU, int NT>
__device__ __forceinline__ void run_tile(const gemm_args &a, const uint32_t *wg, const uint16_t *sg,
                                         const uint32_t *wu, const uint16_t *su, int ng, int sub, int p, bool store,
                                         int r) {
    const float *xr[NT];
    int slot[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        slot[j] = a.slot_of[p + j];
        xr[j] = a.x + (size_t)(GU ? slot[j] / a.k : slot[j]) * a.cols;
    }
    float acc[NT], accu[NT];
    dot_tile<L, GU, NT>(wg, sg, wu, su, ng, sub, xr, acc, accu);
    if (store && sub == 0) {
#pragma unroll
        for (int j = 0; j < NT; j++)
            a.out[(size_t)slot[j] * a.rows + r] = GU ? silu_mul(acc[j], accu[j]) : acc[j];
    }
}

/* TILE = 1 when T == 1 (decode: at most one token per expert; fewer
 * registers, twice the resident warps), KN_MOE_TILE otherwise. Both run
 * dot_tile<.., 1> on a lone token: the same operations. */
template <int L, bool GU, int TILE>
__global__ void __launch_bounds__(32 * KN_MOE_WARPS, TILE == 1 ? 8 : 4) kn_moe_gemm_kernel(gemm_args a) {
    const int slot_a = (int)blockIdx.y;
    if (slot_a >= *a.nact) return; /* block-uniform */
    const int e = a.active[slot_a], p0 = a.off[e], n = a.off[e + 1] - p0;
    constexpr int RPW = 32 / L; /* rows per warp */
    const int lane = threadIdx.x & 31, sub = lane % L;
    const int r0 = ((int)blockIdx.x * KN_MOE_WARPS + (threadIdx.x >> 5)) * RPW + lane / L;
    const bool store = r0 < a.rows;
    const int r = store ? r0 : a.rows - 1; /* idle rows compute a real row (for the shuffles), never store */
    const size_t rw = (size_t)a.cols / 8, rs = (size_t)a.cols / 32;
    const uint32_t *wg = a.w + (size_t)e * a.w_stride + (size_t)r * rw;
    const uint16_t *sg = a.s + (size_t)e * a.s_stride + (size_t)r * rs;
    const uint32_t *wu = GU ? wg + (size_t)a.rows * rw : wg; /* up row I + r */
    const uint16_t *su = GU ? sg + (size_t)a.rows * rs : sg;
    const int ng = a.cols / 32;
    for (int t0 = 0; t0 < n; t0 += TILE) {
        if constexpr (TILE == 1) {
            run_tile<L, GU, 1>(a, wg, sg, wu, su, ng, sub, p0 + t0, store, r);
        } else {
            switch (min(TILE, n - t0)) {
            case 1: run_tile<L, GU, 1>(a, wg, sg, wu, su, ng, sub, p0 + t0, store, r); break;
            case 2: run_tile<L, GU, 2>(a, wg, sg, wu, su, ng, sub, p0 + t0, store, r); break;
            case 3: run_tile<L, GU, 3>(a, wg, sg, wu, su, ng, sub, p0 + t0, store, r); break;
            default: run_tile<L, GU, 4>(a, wg, sg, wu, su, ng, sub, p0 + t0, store, r); break;
            }
        }
    }
}

/* ------------------------------------------------------------ combine */

/* grid (ceil(H / 256), T): y[t, d] = sum over the token's slots in ascending
 * expert id of yd * w, then + shared; NaN for a token with invalid ids. Slots
 * whose id is outside [e0, e0 + E) (another rank's expert: expert
 * parallelism) were not computed and add nothing. */
__global__ void __launch_bounds__(256) kn_moe_combine_kernel(const float *__restrict__ yd,
                                                             const int32_t *__restrict__ ids,
                                                             const float *__restrict__ wts,
                                                             const int32_t *__restrict__ bad, int32_t k, int32_t H,
                                                             int32_t e0, int32_t E,
                                                             const float *__restrict__ shared, float *__restrict__ y) {
    __shared__ int order[KN_MOE_MAX_K];
    const int t = (int)blockIdx.y;
    if (threadIdx.x == 0) { /* insertion sort of the token's slots by expert id (k <= 64) */
        for (int j = 0; j < k; j++) {
            const int32_t id = ids[(size_t)t * k + j];
            int i = j;
            while (i > 0 && ids[(size_t)t * k + order[i - 1]] > id) {
                order[i] = order[i - 1];
                i--;
            }
            order[i] = j;
        }
    }
    __syncthreads();
    const int d = (int)blockIdx.x * 256 + (int)threadIdx.x;
    if (d >= H) return;
    float acc = 0.f;
    for (int i = 0; i < k; i++) {
        const int s = t * k + order[i];
        if (ids[s] < e0 || ids[s] >= e0 + E) continue; /* block-uniform */
        acc = __fadd_rn(acc, __fmul_rn(yd[(size_t)s * H + d], wts[s]));
    }
    if (shared) acc = __fadd_rn(acc, shared[(size_t)t * H + d]);
    y[(size_t)t * H + d] = bad[t] ? __int_as_float(0x7fc00000) : acc;
}

/* ------------------------------------------------------------ dequant */

/* thread per word: out[8i .. 8i+7] = the word's values as bf16 bits */
__global__ void __launch_bounds__(256) kn_moe_dequant_kernel(const uint32_t *__restrict__ w,
                                                             const uint16_t *__restrict__ s, int64_t words,
                                                             int32_t cols, uint16_t *__restrict__ out) {
    const int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x;
    if (i >= words) return;
    const int64_t c = (i * 8) % cols, r = (i * 8) / cols;
    float v[8];
    dequant_word(w[i], scale_pair(s + r * (cols / 32), (int)(c / 32)), v);
#pragma unroll
    for (int e = 0; e < 8; e++) out[i * 8 + e] = (uint16_t)(__float_as_uint(v[e]) >> 16);
}

bool aligned(const void *p, size_t a) { return ((uintptr_t)p % a) == 0; }

/* the routed experts (kn_moe_weights.E_route; 0: E) */
int32_t e_route(const kn_moe_weights *w) { return w->E_route > 0 ? w->E_route : w->E; }

bool weights_ok(const kn_moe_weights *w) {
    return w && w->w13 && w->s13 && w->w2 && w->s2 && w->E >= 1 && w->E <= KN_MOE_MAX_E && w->H >= 32 &&
           w->H % 32 == 0 && w->I >= 32 && w->I % 32 == 0 && aligned(w->w13, 16) && aligned(w->w2, 16) &&
           aligned(w->s13, 2) && aligned(w->s2, 2) && w->e0 >= 0 && w->E_route >= 0 &&
           e_route(w) <= KN_MOE_MAX_E && (int64_t)w->e0 + w->E <= e_route(w);
}

template <int L, bool GU>
cudaError_t gemm_launch(const gemm_args &a, int32_t T, int32_t slots, cudaStream_t s) {
    constexpr int RB = KN_MOE_WARPS * (32 / L);
    const dim3 grid((unsigned)((a.rows + RB - 1) / RB), (unsigned)slots), block(32 * KN_MOE_WARPS);
    if (T == 1) kn_moe_gemm_kernel<L, GU, 1><<<grid, block, 0, s>>>(a);
    else kn_moe_gemm_kernel<L, GU, KN_MOE_TILE><<<grid, block, 0, s>>>(a);
    return cudaGetLastError();
}

/* lanes per row: 32 when a row has >= 32 groups, else 8 (a function of the weight shape) */
template <bool GU>
cudaError_t gemm_dispatch(const gemm_args &a, int32_t T, int32_t slots, cudaStream_t s) {
    return a.cols / 32 >= 32 ? gemm_launch<32, GU>(a, T, slots, s) : gemm_launch<8, GU>(a, T, slots, s);
}

}  // namespace

extern "C" int kn_moe_route(const float *logits, const float *bias, int32_t T, const kn_moe_route_cfg *cfg,
                            int32_t *ids, float *w, void *stream) {
    if (!logits || !bias || !cfg || !ids || !w || T <= 0) return (int)cudaErrorInvalidValue;
    const kn_moe_route_cfg c = *cfg;
    if (c.E < 1 || c.E > KN_MOE_MAX_E || c.k < 1 || c.k > KN_MOE_MAX_K || c.k > c.E || c.n_group < 1 ||
        c.n_group > KN_MOE_MAX_G || c.E % c.n_group || c.topk_group < 1 || c.topk_group > c.n_group)
        return (int)cudaErrorInvalidValue;
    const size_t per_warp = route_layout(c.E, c.n_group, c.k).bytes;
    int wpb = (int)(48 * 1024 / per_warp);
    wpb = wpb > KN_MOE_WARPS ? KN_MOE_WARPS : wpb < 1 ? 1 : wpb;
    if (per_warp > 48 * 1024) return (int)cudaErrorInvalidValue; /* E = 4096 needs 37 KiB: never */
    const dim3 grid((unsigned)((T + wpb - 1) / wpb)), block((unsigned)(32 * wpb));
    kn_moe_route_kernel<<<grid, block, per_warp * (size_t)wpb, static_cast<cudaStream_t>(stream)>>>(logits, bias, T,
                                                                                                   c, ids, w);
    return (int)cudaGetLastError();
}

extern "C" size_t kn_moe_workspace_bytes(int32_t T, int32_t k, int32_t E, int32_t H, int32_t I) {
    if (T <= 0 || k <= 0 || E <= 0 || H <= 0 || I <= 0) return 0;
    return ws_layout_of(T, k, E, H, I).bytes;
}

extern "C" int kn_moe_experts(const kn_moe_weights *wt, const float *x, const int32_t *ids, const float *wts,
                              int32_t T, int32_t k, const float *shared, void *ws, size_t ws_bytes, float *y,
                              int32_t *bad_flag, void *stream) {
    if (!weights_ok(wt) || !x || !ids || !wts || !ws || !y || T <= 0 || k < 1 || k > KN_MOE_MAX_K || k > e_route(wt) ||
        !aligned(x, 16) || !aligned(ws, 256) || T > 65535 || y == x || y == shared) /* T: combine grid.y */
        return (int)cudaErrorInvalidValue;
    const int32_t E = wt->E, H = wt->H, I = wt->I;
    const ws_layout L = ws_layout_of(T, k, E, H, I);
    if (ws_bytes < L.bytes) return (int)cudaErrorInvalidValue;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    unsigned char *b = static_cast<unsigned char *>(ws);
    int32_t *off = reinterpret_cast<int32_t *>(b + L.off), *active = reinterpret_cast<int32_t *>(b + L.active);
    int32_t *nact = reinterpret_cast<int32_t *>(b + L.nact), *slot_of = reinterpret_cast<int32_t *>(b + L.slot_of);
    int32_t *bad = reinterpret_cast<int32_t *>(b + L.bad);
    float *act = reinterpret_cast<float *>(b + L.act), *yd = reinterpret_cast<float *>(b + L.yd);
    kn_moe_align_kernel<<<1, KN_ALIGN_THREADS, 0, s>>>(ids, T, k, E, wt->e0, e_route(wt), off, active, nact, slot_of,
                                                        bad, bad_flag);
    cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) return (int)rc;
    const int32_t slots = T * k < E ? T * k : E; /* at most this many experts have tokens */
    gemm_args gu = {wt->w13, wt->s13, (size_t)2 * I * (H / 8), (size_t)2 * I * (H / 32), I, H,
                    off, active, nact, slot_of, x, k, act};
    if ((rc = gemm_dispatch<true>(gu, T, slots, s)) != cudaSuccess) return (int)rc;
    gemm_args dn = {wt->w2, wt->s2, (size_t)H * (I / 8), (size_t)H * (I / 32), H, I,
                    off, active, nact, slot_of, act, k, yd};
    if ((rc = gemm_dispatch<false>(dn, T, slots, s)) != cudaSuccess) return (int)rc;
    const dim3 cgrid((unsigned)((H + 255) / 256), (unsigned)T);
    kn_moe_combine_kernel<<<cgrid, 256, 0, s>>>(yd, ids, wts, bad, k, H, wt->e0, E, shared, y);
    return (int)cudaGetLastError();
}

extern "C" int kn_moe_dequant(const kn_moe_weights *wt, int32_t e, int which, uint16_t *out, void *stream) {
    if (!weights_ok(wt) || !out || e < 0 || e >= wt->E || (which != 0 && which != 1)) return (int)cudaErrorInvalidValue;
    const int32_t H = wt->H, I = wt->I;
    const int64_t rows = which == 0 ? 2 * (int64_t)I : H, cols = which == 0 ? H : I;
    const uint32_t *w = which == 0 ? wt->w13 + (size_t)e * 2 * I * (H / 8) : wt->w2 + (size_t)e * H * (I / 8);
    const uint16_t *s = which == 0 ? wt->s13 + (size_t)e * 2 * I * (H / 32) : wt->s2 + (size_t)e * H * (I / 32);
    const int64_t words = rows * cols / 8;
    kn_moe_dequant_kernel<<<(unsigned)((words + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        w, s, words, (int32_t)cols, out);
    return (int)cudaGetLastError();
}
