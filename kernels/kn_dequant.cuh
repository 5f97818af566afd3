/*
 * kn_dequant.cuh: device-side reading of the weight formats of kn_linear.h
 * (shared by the matmul and the embedding lookup). Header-only, CUDA only.
 *
 * Every value is the one bk_weight_row_f32 (engine/backend/cpu_matmul.c)
 * produces, bit for bit: bf16/f16 -> f32 exact; Q8_0 d*q, Q4_0 d*(q-8) (one
 * rounded product), Q4_1 (d*q) + m (product and sum each rounded: the CPU is
 * built with -ffp-contract=off). Explicit _rn intrinsics keep nvcc from
 * contracting them into an FMA differently in different instantiations.
 */
#ifndef SPECD_KERNELS_KN_DEQUANT_CUH
#define SPECD_KERNELS_KN_DEQUANT_CUH

#include <cuda_fp16.h>
#include <cstdint>

#include "kernels/kn_linear.h"

namespace kn {

/* bytes of one 32-value block (block formats) */
template <int FMT> struct block_bytes;
template <> struct block_bytes<KN_W_Q8_0> { static constexpr int value = 34; };
template <> struct block_bytes<KN_W_Q4_0> { static constexpr int value = 18; };
template <> struct block_bytes<KN_W_Q4_1> { static constexpr int value = 20; };

__host__ __device__ constexpr bool is_block_format(int fmt) {
    return fmt == KN_W_Q8_0 || fmt == KN_W_Q4_0 || fmt == KN_W_Q4_1;
}

__device__ __forceinline__ float bf16_f32(uint32_t h16) { return __uint_as_float(h16 << 16); }
__device__ __forceinline__ float f16_f32(uint32_t h16) { return __half2float(__ushort_as_half((unsigned short)h16)); }
__device__ __forceinline__ uint32_t ld_u16(const uint8_t *p) {
    return __ldg(reinterpret_cast<const unsigned short *>(p));
}

/* Q formats: dequantized value of quant q (already offset-free integer) */
__device__ __forceinline__ float q8_val(float d, int q) { return __fmul_rn(d, (float)q); }
__device__ __forceinline__ float q40_val(float d, int nib) { return __fmul_rn(d, (float)(nib - 8)); }
__device__ __forceinline__ float q41_val(float d, float m, int nib) { return __fadd_rn(__fmul_rn(d, (float)nib), m); }

/* Element j of a row (scalar path: tails, odd layouts, the embedding). */
template <int FMT>
__device__ __forceinline__ float elem(const uint8_t *row, int64_t j) {
    if constexpr (FMT == KN_W_F32) {
        return __ldg(reinterpret_cast<const float *>(row) + j);
    } else if constexpr (FMT == KN_W_BF16) {
        return bf16_f32(ld_u16(row + 2 * j));
    } else if constexpr (FMT == KN_W_F16) {
        return f16_f32(ld_u16(row + 2 * j));
    } else {
        constexpr int BB = block_bytes<FMT>::value;
        const uint8_t *blk = row + (j >> 5) * BB;
        const int i = (int)(j & 31);
        const float d = f16_f32(ld_u16(blk));
        if constexpr (FMT == KN_W_Q8_0) {
            const uint32_t w2 = ld_u16(blk + 2 + (i & ~1));
            return q8_val(d, (int)(int8_t)(uint8_t)(w2 >> (8 * (i & 1))));
        } else {
            constexpr int QO = FMT == KN_W_Q4_1 ? 4 : 2;
            const int bi = i & 15; /* byte holding the nibble: low = value bi, high = value bi + 16 */
            const uint32_t w2 = ld_u16(blk + QO + (bi & ~1));
            const int byte = (int)((w2 >> (8 * (bi & 1))) & 0xff);
            const int nib = i < 16 ? (byte & 0xf) : (byte >> 4);
            if constexpr (FMT == KN_W_Q4_0) return q40_val(d, nib);
            else return q41_val(d, f16_f32(ld_u16(blk + 2)), nib);
        }
    }
}

}  // namespace kn

#endif
