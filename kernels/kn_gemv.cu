/*
 * kn_gemv.cu: the batch-invariant small-M matmul (kn_matmul) and the
 * embedding lookup (kn_embed) for every kn_wtype. No state.
 *
 * Matmul layout: one warp per output row, KN_MM_WARPS rows per block. A warp
 * walks its row in "units": a unit is one lane's 16-byte weight chunk (f32:
 * 4 values, bf16/f16: 8) or, for the block formats, one lane's 8 values of a
 * 32-block (4 lanes per block, 8 blocks per warp step). Unit u of a plain
 * row belongs to lane u % 32; block b's sub-slice s (0..3) to lane 4*(b % 8)
 * + s. Consecutive lanes read consecutive bytes, so a warp step reads 512
 * (plain) or 8 blocks (Q) of contiguous weight bytes; KN_MM_UNROLL steps are
 * loaded before any is consumed to keep enough bytes in flight at T = 1.
 * Plain chunks bypass L1 (ld.global.nc.L1::no_allocate) so that L1 keeps the
 * activation rows, which every warp of the SM reads. Registers: the T = 1
 * kernels are held to 64 (8 blocks of 128 threads per SM), the T > 1 ones to
 * 255 (2 blocks); tests/kernels kn_spill_check fails on any spill.
 *
 * Tokens: the warp handles all T tokens of the step, NT <= 8 at a time in
 * registers (acc[NT]); each unit is dequantized once per tile and multiplied
 * into every token of the tile. The weight row is re-read (mostly from L1/L2)
 * once per tile of 8 tokens.
 *
 * BATCH INVARIANCE: for token t the lane performs acc = fma(w_e, x_t[c_e],
 * acc) over its units in increasing order, elements in a fixed order inside
 * a unit, then its share of the scalar tail; the 32 lane sums are combined
 * by the xor butterfly 16, 8, 4, 2, 1 (each level adds two equal-order
 * values, so all lanes agree). Nothing of that depends on T, on t or on the
 * tile size NT: the tile loop only changes how many tokens share a weight
 * load. kn_mm_kernel<FMT, 1> (T == 1) and <FMT, 8> (T > 1) run the same
 * per-token operations. All arithmetic is explicit (__fmaf_rn, __fadd_rn):
 * nvcc cannot contract it differently per instantiation.
 */
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/kn.h"
#include "kernels/kn_dequant.cuh"
#include "kernels/kn_linear.h"

namespace {

constexpr int KN_MM_WARPS = 4;  /* output rows per block (one warp each) */
constexpr int KN_MM_TILE = 8;   /* tokens per register tile */
constexpr int KN_MM_UNROLL = 4; /* warp steps loaded ahead at T == 1 (1 with tiles of 8 tokens) */

/* One lane's raw unit: up to 16 bytes of weights + block scales. */
struct raw_unit {
    uint4 q;        /* plain: the 16-byte chunk; Q8_0: q.x, q.y = 8 int8; Q4: q.x = 4 nibble bytes */
    float d, m;     /* block formats: scale, min (Q4_1) */
};

/* Values per unit and units per warp step. */
template <int FMT> struct fmt_info {
    static constexpr bool block = kn::is_block_format(FMT);
    static constexpr int per_unit = FMT == KN_W_F32 ? 4 : 8;
    static constexpr int units_per_step = block ? 8 : 32;
};

/* A 16-byte weight chunk, read once per token tile: not kept in L1, which
 * then holds the activation rows every warp of the SM re-reads. */
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

/* Loads unit u of row wr for a lane (sub = lane % 4 for block formats). */
template <int FMT>
__device__ __forceinline__ raw_unit load_unit(const uint8_t *wr, int64_t u, int sub) {
    raw_unit r;
    if constexpr (!fmt_info<FMT>::block) {
        r.q = ld_stream16(wr + 16 * u);
        r.d = r.m = 0.f;
    } else {
        constexpr int BB = kn::block_bytes<FMT>::value;
        const uint8_t *blk = wr + u * BB;
        r.d = kn::f16_f32(kn::ld_u16(blk));
        r.m = 0.f;
        r.q = make_uint4(0, 0, 0, 0);
        if constexpr (FMT == KN_W_Q8_0) {
            const uint8_t *p = blk + 2 + 8 * sub;
            r.q.x = kn::ld_u16(p) | (kn::ld_u16(p + 2) << 16);
            r.q.y = kn::ld_u16(p + 4) | (kn::ld_u16(p + 6) << 16);
        } else {
            constexpr int QO = FMT == KN_W_Q4_1 ? 4 : 2;
            if constexpr (FMT == KN_W_Q4_1) r.m = kn::f16_f32(kn::ld_u16(blk + 2));
            const uint8_t *p = blk + QO + 4 * sub;
            r.q.x = kn::ld_u16(p) | (kn::ld_u16(p + 2) << 16);
        }
    }
    return r;
}

/* The unit's values w[0..per_unit) and the columns they multiply: w[e] goes
 * with column c0 + e for e < 4 and c1 + (e - 4) for e >= 4. */
template <int FMT>
__device__ __forceinline__ void dequant_unit(const raw_unit &r, int64_t u, int sub, float *w, int64_t *c0,
                                             int64_t *c1) {
    const uint32_t q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
    if constexpr (FMT == KN_W_F32) {
        for (int e = 0; e < 4; e++) w[e] = __uint_as_float(q[e]);
        *c0 = u * 4;
        *c1 = 0;
    } else if constexpr (FMT == KN_W_BF16 || FMT == KN_W_F16) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            w[2 * k] = FMT == KN_W_BF16 ? kn::bf16_f32(q[k] & 0xffffu) : kn::f16_f32(q[k] & 0xffffu);
            w[2 * k + 1] = FMT == KN_W_BF16 ? kn::bf16_f32(q[k] >> 16) : kn::f16_f32(q[k] >> 16);
        }
        *c0 = u * 8;
        *c1 = u * 8 + 4;
    } else if constexpr (FMT == KN_W_Q8_0) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            w[e] = kn::q8_val(r.d, (int)(int8_t)(uint8_t)(r.q.x >> (8 * e)));
            w[e + 4] = kn::q8_val(r.d, (int)(int8_t)(uint8_t)(r.q.y >> (8 * e)));
        }
        *c0 = u * 32 + 8 * sub;
        *c1 = *c0 + 4;
    } else {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int byte = (int)((q[0] >> (8 * e)) & 0xff);
            if constexpr (FMT == KN_W_Q4_0) {
                w[e] = kn::q40_val(r.d, byte & 0xf);
                w[e + 4] = kn::q40_val(r.d, byte >> 4);
            } else {
                w[e] = kn::q41_val(r.d, r.m, byte & 0xf);
                w[e + 4] = kn::q41_val(r.d, r.m, byte >> 4);
            }
        }
        *c0 = u * 32 + 4 * sub;
        *c1 = *c0 + 16;
    }
}

__device__ __forceinline__ float4 ld_f4(const float *p) { return __ldg(reinterpret_cast<const float4 *>(p)); }

__device__ __forceinline__ float fma4(float4 w, float4 x, float acc) {
    acc = __fmaf_rn(w.x, x.x, acc);
    acc = __fmaf_rn(w.y, x.y, acc);
    acc = __fmaf_rn(w.z, x.z, acc);
    return __fmaf_rn(w.w, x.w, acc);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

/* y[t * ldy] for t < NT = row wr . x[t * ldx + .] (one warp; all lanes call it).
 * VEC: 16-byte units (plain formats with aligned rows, all block formats);
 * otherwise one element per lane per step. */
template <int FMT, int NT, bool VEC, int UNROLL>
__device__ __forceinline__ void row_dot(const uint8_t *__restrict__ wr, int64_t cols, const float *__restrict__ x,
                                        int64_t ldx, float *__restrict__ y, int64_t ldy, int lane) {
    using info = fmt_info<FMT>;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    int64_t tail0 = 0; /* first column of the scalar tail */
    if constexpr (VEC) {
        const int64_t nunits = info::block ? cols / 32 : cols / info::per_unit;
        const int sub = info::block ? (lane & 3) : 0;
        const int64_t first = info::block ? (lane >> 2) : lane;
        constexpr int64_t STEP = info::units_per_step;
        for (int64_t u0 = first; u0 < nunits; u0 += STEP * UNROLL) {
            raw_unit raw[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; k++)
                if (u0 + k * STEP < nunits) raw[k] = load_unit<FMT>(wr, u0 + k * STEP, sub);
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                const int64_t u = u0 + k * STEP;
                if (u >= nunits) break;
                float w[8];
                int64_t c0, c1;
                dequant_unit<FMT>(raw[k], u, sub, w, &c0, &c1);
                const float4 wa = make_float4(w[0], w[1], w[2], w[3]);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    acc[t] = fma4(wa, ld_f4(x + t * ldx + c0), acc[t]);
                    if constexpr (info::per_unit == 8)
                        acc[t] = fma4(make_float4(w[4], w[5], w[6], w[7]), ld_f4(x + t * ldx + c1), acc[t]);
                }
            }
        }
        tail0 = info::block ? cols : nunits * info::per_unit;
    }
    /* scalar part: the whole row (!VEC) or the < per_unit tail columns; element j to lane j % 32 */
    for (int64_t j = tail0 + lane; j < cols; j += 32) {
        const float wv = kn::elem<FMT>(wr, j);
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] = __fmaf_rn(wv, __ldg(x + t * ldx + j), acc[t]);
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const float v = warp_sum(acc[t]);
        if (lane == 0) y[t * ldy] = v;
    }
}

/* grid.x = ceil(rows / KN_MM_WARPS), block = 32 * KN_MM_WARPS. TILE = 1 for
 * T == 1 (smallest register footprint for decode), KN_MM_TILE otherwise. */
template <int FMT, int TILE, bool VEC>
__global__ void __launch_bounds__(32 * KN_MM_WARPS, TILE == 1 ? 8 : 2) kn_mm_kernel(const uint8_t *__restrict__ W, size_t row_bytes,
                                                                  int64_t rows, int64_t cols,
                                                                  const float *__restrict__ x, int32_t T,
                                                                  float *__restrict__ y) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * KN_MM_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return; /* warp-uniform: no partial-warp shuffles */
    const uint8_t *wr = W + (size_t)r * row_bytes;
    constexpr int U = TILE == 1 ? KN_MM_UNROLL : 1; /* a tile's activation loads keep enough bytes in flight */
    for (int32_t t0 = 0; t0 < T; t0 += TILE) {
        const float *xt = x + (int64_t)t0 * cols;
        float *yt = y + (int64_t)t0 * rows + r;
        if constexpr (TILE == 1) {
            row_dot<FMT, 1, VEC, U>(wr, cols, xt, cols, yt, rows, lane);
        } else {
            switch (T - t0 < TILE ? T - t0 : TILE) {
            case 1: row_dot<FMT, 1, VEC, U>(wr, cols, xt, cols, yt, rows, lane); break;
            case 2: row_dot<FMT, 2, VEC, U>(wr, cols, xt, cols, yt, rows, lane); break;
            case 3: row_dot<FMT, 3, VEC, U>(wr, cols, xt, cols, yt, rows, lane); break;
            case 4: row_dot<FMT, 4, VEC, U>(wr, cols, xt, cols, yt, rows, lane); break;
            case 5: row_dot<FMT, 5, VEC, U>(wr, cols, xt, cols, yt, rows, lane); break;
            case 6: row_dot<FMT, 6, VEC, U>(wr, cols, xt, cols, yt, rows, lane); break;
            case 7: row_dot<FMT, 7, VEC, U>(wr, cols, xt, cols, yt, rows, lane); break;
            default: row_dot<FMT, 8, VEC, U>(wr, cols, xt, cols, yt, rows, lane); break;
            }
        }
    }
}

template <int FMT, bool VEC>
cudaError_t mm_launch(const kn_weight *w, const float *x, int32_t T, float *y, cudaStream_t s) {
    const dim3 grid((unsigned)((w->rows + KN_MM_WARPS - 1) / KN_MM_WARPS)), block(32 * KN_MM_WARPS);
    const uint8_t *W = static_cast<const uint8_t *>(w->data);
    if (T == 1) kn_mm_kernel<FMT, 1, VEC><<<grid, block, 0, s>>>(W, w->row_bytes, w->rows, w->cols, x, T, y);
    else kn_mm_kernel<FMT, KN_MM_TILE, VEC><<<grid, block, 0, s>>>(W, w->row_bytes, w->rows, w->cols, x, T, y);
    return cudaGetLastError();
}

bool aligned(const void *p, size_t a) { return ((uintptr_t)p % a) == 0; }

size_t elem_bytes(int type) { return type == KN_W_F32 ? 4 : 2; }

/* 0 when w is a weight these kernels can read (kn_weight's contract). */
int weight_check(const kn_weight *w) {
    if (!w || !w->data || w->rows <= 0 || w->cols <= 0 || w->rows > (int64_t)INT32_MAX * KN_MM_WARPS) return 1;
    switch (w->type) {
    case KN_W_F32: case KN_W_BF16: case KN_W_F16:
        return w->row_bytes < (size_t)w->cols * elem_bytes(w->type) || !aligned(w->data, elem_bytes(w->type)) ||
               w->row_bytes % elem_bytes(w->type) != 0;
    case KN_W_Q8_0: case KN_W_Q4_0: case KN_W_Q4_1: {
        const size_t bb = w->type == KN_W_Q8_0 ? 34 : w->type == KN_W_Q4_0 ? 18 : 20;
        return w->cols % 32 != 0 || w->row_bytes < (size_t)(w->cols / 32) * bb || !aligned(w->data, 2) ||
               w->row_bytes % 2 != 0;
    }
    }
    return 1;
}

/* -------------------------------------------------------------- embed */

template <int FMT>
__global__ void __launch_bounds__(256) kn_embed_kernel(const uint8_t *__restrict__ W, size_t row_bytes, int64_t rows,
                                                        int64_t cols, const int32_t *__restrict__ tokens,
                                                        float *__restrict__ out, int32_t *bad_flag) {
    const int32_t t = (int32_t)blockIdx.x;
    const int32_t id = tokens[t];
    float *o = out + (int64_t)t * cols;
    if (id < 0 || id >= rows) {
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) o[j] = __int_as_float(0x7fc00000);
        if (bad_flag && threadIdx.x == 0) *bad_flag = 1;
        return;
    }
    const uint8_t *wr = W + (size_t)id * row_bytes;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) o[j] = kn::elem<FMT>(wr, j);
}

}  // namespace

extern "C" int kn_matmul(const kn_weight *w, const float *x, int32_t T, float *y, void *stream) {
    if (weight_check(w) || !x || !y || T <= 0 || !aligned(x, 4)) return (int)cudaErrorInvalidValue;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    /* 16-byte loads when every weight row starts 16-byte aligned and cols % 4
     * == 0 (block formats: always); the choice depends on the weight alone, so
     * the order of a token's sum does not depend on where its x row lies. Then
     * every x row is 16-byte aligned if x is: required. */
    const bool vec = kn::is_block_format(w->type) ||
                     (aligned(w->data, 16) && w->row_bytes % 16 == 0 && w->cols % 4 == 0);
    if (vec && !aligned(x, 16)) return (int)cudaErrorInvalidValue;
    switch (w->type) {
    case KN_W_F32: return (int)(vec ? mm_launch<KN_W_F32, true>(w, x, T, y, s) : mm_launch<KN_W_F32, false>(w, x, T, y, s));
    case KN_W_BF16: return (int)(vec ? mm_launch<KN_W_BF16, true>(w, x, T, y, s) : mm_launch<KN_W_BF16, false>(w, x, T, y, s));
    case KN_W_F16: return (int)(vec ? mm_launch<KN_W_F16, true>(w, x, T, y, s) : mm_launch<KN_W_F16, false>(w, x, T, y, s));
    case KN_W_Q8_0: return (int)mm_launch<KN_W_Q8_0, true>(w, x, T, y, s);
    case KN_W_Q4_0: return (int)mm_launch<KN_W_Q4_0, true>(w, x, T, y, s);
    case KN_W_Q4_1: return (int)mm_launch<KN_W_Q4_1, true>(w, x, T, y, s);
    }
    return (int)cudaErrorInvalidValue;
}

extern "C" int kn_embed(const kn_weight *w, const int32_t *tokens, int32_t T, float *out, int32_t *bad_flag,
                        void *stream) {
    if (weight_check(w) || !tokens || !out || T <= 0) return (int)cudaErrorInvalidValue;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const uint8_t *W = static_cast<const uint8_t *>(w->data);
    const dim3 grid((unsigned)T), block(256);
    switch (w->type) {
    case KN_W_F32: kn_embed_kernel<KN_W_F32><<<grid, block, 0, s>>>(W, w->row_bytes, w->rows, w->cols, tokens, out, bad_flag); break;
    case KN_W_BF16: kn_embed_kernel<KN_W_BF16><<<grid, block, 0, s>>>(W, w->row_bytes, w->rows, w->cols, tokens, out, bad_flag); break;
    case KN_W_F16: kn_embed_kernel<KN_W_F16><<<grid, block, 0, s>>>(W, w->row_bytes, w->rows, w->cols, tokens, out, bad_flag); break;
    case KN_W_Q8_0: kn_embed_kernel<KN_W_Q8_0><<<grid, block, 0, s>>>(W, w->row_bytes, w->rows, w->cols, tokens, out, bad_flag); break;
    case KN_W_Q4_0: kn_embed_kernel<KN_W_Q4_0><<<grid, block, 0, s>>>(W, w->row_bytes, w->rows, w->cols, tokens, out, bad_flag); break;
    case KN_W_Q4_1: kn_embed_kernel<KN_W_Q4_1><<<grid, block, 0, s>>>(W, w->row_bytes, w->rows, w->cols, tokens, out, bad_flag); break;
    default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}
