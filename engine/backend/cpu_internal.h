/*
 * cpu_internal.h: private state of the CPU backend shared by its files, and
 * the pieces the AVX2 (cpu_matmul.c) and AVX-512 (cpu_matmul_avx512.c)
 * matmul kernels share: the activation-quantization layout, the block-format
 * kinds and the scalar conversions used by both for row tails.
 *
 * ISA levels: the backend picks the highest level the CPU and OS support at
 * bk_cpu_create, capped by SPECD_CPU_ISA=portable|avx2|avx512 (and the older
 * SPECD_CPU_PORTABLE=1). The AVX-512 kernels compute exactly the AVX2
 * kernels' f32 operations in the same order per output (their accumulators
 * are the two AVX2 accumulators side by side in one zmm), so the two paths
 * give bit-identical results; the portable path differs (f32 activations).
 */
#ifndef SPECD_BACKEND_CPU_INTERNAL_H
#define SPECD_BACKEND_CPU_INTERNAL_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "engine/backend/backend.h"

#include "engine/backend/threadpool.h"

#define CPU_MAX_THREADS 256

/* Grow-only per-thread scratch (tid-indexed), reused across ops. */
typedef struct cpu_scratch {
    float *buf;
    size_t cap; /* floats */
} cpu_scratch;

typedef struct cpu_ctx {
    int n_threads; /* pool threads per op, caller included */
    tpool *pool;
    cpu_scratch scratch[CPU_MAX_THREADS];
    int avx2;      /* AVX2 + FMA + F16C kernels in use */
    int avx512;    /* AVX-512 F/BW/VL/DQ kernels in use (implies avx2) */
    int avx512x;   /* and the VBMI + VNNI variants of the one-token kernels (implies avx512) */
    char desc[96];
} cpu_ctx;

/* Scratch of at least n floats for thread tid (NULL on allocation failure). */
float *cpu_scratch_get(cpu_ctx *ctx, int tid, size_t n);

int cpu_matmul(void *ctx, const bk_weight *w, const float *x, int32_t T, float *y);
/* y[k] = x @ w[k]^T for k < n (n <= CPU_MATMUL_N_MAX): the same bits as n cpu_matmul calls, with the
 * activations prepared once and all the weights' rows in one pool job. */
#define CPU_MATMUL_N_MAX 4
int cpu_matmul_n(void *ctx, int n, const bk_weight *const *w, const float *x, int32_t T, float *const *y);

/* ------------------------------------------------ shared by the kernels */

static inline float cpu_fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            man &= 0x3ff;
            bits = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline float cpu_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* f32 value of every fp16 bit pattern (exact: fp16 -> f32 is exact), for
 * the block scales of Q8_0 / Q4_x. Filled once by cpu_fp16_table_init
 * (bk_cpu_create calls it; thread-safe) before any matmul reads it. */
extern float cpu_fp16_f32[65536];
void cpu_fp16_table_init(void);

/* Block formats (integer-activation dots) and plain formats (f32 dots). */
typedef enum { FK_Q8_0, FK_Q4_0, FK_Q4_1, FK_F32, FK_BF16, FK_F16 } fused_kind;

/* Element i of a plain row (the scalar tail of rows whose length is not a
 * multiple of 32). */
static inline float cpu_plain_at(fused_kind k, const uint8_t *w, int64_t i) {
    uint16_t h;
    switch (k) {
    case FK_F32: { float f; memcpy(&f, w + 4 * i, 4); return f; }
    case FK_BF16: memcpy(&h, w + 2 * i, 2); return cpu_bf16_to_f32(h);
    default: memcpy(&h, w + 2 * i, 2); return cpu_fp16_to_f32(h);
    }
}

/* Horizontal sum of 8 lanes in a fixed order. */
__attribute__((target("avx2,fma"))) static inline float cpu_hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    lo = _mm_add_ss(lo, sh);
    return _mm_cvtss_f32(lo);
}

/* Int16-quantized activations of T tokens for the integer-activation dots
 * (cpu_matmul.c: quant_block_i16 states the quantization). */
typedef struct xq_rows {
    const int16_t *X; /* AVX-512: [T][cols] in the pair layout (cpu512_pair_layout). AVX2: token groups of
                         4 (the last may be smaller, n tokens): group g = tokens 4g..4g+n-1 at
                         X + 4g * cols, holding [nb][n][32], so one pointer walks all of a group's tokens */
    const float *s;   /* lane-group scales (0 for all-zero columns, NaN if one is not finite): AVX-512
                         [T][nb][8]; AVX2 [group][nb][n][8] at s + 4g * nb * 8 */
    const float *sum; /* [T][nb] f32 block sums of x */
} xq_rows;

/* Blocks per m-term chunk of the integer dots (even: block parity, hence the
 * even/odd accumulator of a block, does not depend on the chunking). */
#define IDOT_CHUNK 64

/* Fully unrolls a loop over the NT tokens of a kernel so each token's
 * accumulators live in registers (without it GCC -O2 keeps them in a stack
 * array and every FMA waits on a store-to-load round trip: ~2x slower). */
#if defined(__clang__)
#define CPU_UNROLL _Pragma("unroll")
#else
#define CPU_UNROLL _Pragma("GCC unroll 8")
#endif

/* Block b's int16 weights; *d points at its f32 scale in cpu_fp16_f32 (a
 * table load instead of a scalar F16C conversion, which competes with the
 * vector shuffles for one port), *m is its min term (Q4_0: -8 d). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void cpu_iq_load(fused_kind k, const uint8_t *w,
                                                                                      int64_t b, __m256i *w0,
                                                                                      __m256i *w1, const float **d,
                                                                                      float *m) {
    uint16_t d16, m16;
    if (k == FK_Q8_0) {
        const uint8_t *blk = w + (size_t)b * 34;
        memcpy(&d16, blk, 2);
        *d = &cpu_fp16_f32[d16];
        *m = 0.0f;
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(blk + 2)));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(blk + 18)));
        return;
    }
    const int q41 = k == FK_Q4_1;
    const uint8_t *blk = w + (size_t)b * (q41 ? 20 : 18);
    memcpy(&d16, blk, 2);
    *d = &cpu_fp16_f32[d16];
    if (q41) { memcpy(&m16, blk + 2, 2); *m = cpu_fp16_f32[m16]; }
    else *m = -8.0f * **d;
    /* int16 lane i of the broadcast, byte-shuffled within each 128-bit half, holds byte i of the
     * 16 (zero-extended): its low nibble is column i, its high nibble column 16 + i. One in-lane
     * shuffle, an AND and a shift (no cross-lane widening); the same vectors as cvtepu8 of the
     * masked nibbles. */
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(blk + (q41 ? 4 : 2))));
    const __m256i spread = _mm256_shuffle_epi8(
        raw, _mm256_setr_epi8(0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7, -1, 8, -1, 9, -1, 10, -1, 11, -1, 12,
                              -1, 13, -1, 14, -1, 15, -1));
    *w0 = _mm256_and_si256(spread, _mm256_set1_epi16(0x0f));
    *w1 = _mm256_srli_epi16(spread, 4);
}

/* One block of one token on the integer path (AVX2 lanes): acc + f32(w0 .
 * X[0:16] + w1 . X[16:32], vpmaddwd lane sums, exact) * (d * s[0:8]), with
 * xb the token's 32 int16 activations of the block in the standard layout and
 * s its 8 lane-group scales. The AVX2 dots run this per block; the AVX-512
 * dots run it for an odd last block. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 cpu_iq_fma(__m256i w0, __m256i w1, __m256 dv,
                                                                               const int16_t *xb, const float *s,
                                                                               __m256 acc) {
    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)(const void *)xb)),
                                       _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(const void *)(xb + 16))));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dv, _mm256_loadu_ps(s)), acc);
}


/* ------------------------------------------- AVX-512 (cpu_matmul_avx512.c)
 * Each computes out[u], u < nt (1..CPU512_MAX_NT), bit-identical to the AVX2
 * kernel of the same format for the same token. Call only when ctx->avx512. */
#define CPU512_MAX_NT 8

/* Rearranges one token's int16 activations X[cols] (cols % 32 == 0, the
 * layout quant_row_i16 writes) in place into the AVX-512 pair layout: for
 * every block pair (2i, 2i+1) the 64 values become [lo(2i) | lo(2i+1) |
 * hi(2i) | hi(2i+1)], lo/hi = columns 0..15 / 16..31 of a block; an odd last
 * block stays as it is. */
void cpu512_pair_layout(int16_t *X, int64_t cols);

/* Integer-activation dot of one Q8_0 / Q4_0 / Q4_1 row (kind FK_Q8_0..FK_Q4_1)
 * with tokens t0..t0+nt-1 of xq (pair layout). */
void cpu512_idot(int ext, fused_kind kind, int nt, const uint8_t *w, int64_t cols, const xq_rows *xq, int32_t t0,
                 float *out);

/* The same dot for nr (1..4) consecutive rows w, w + row_bytes, ... and one
 * token t of xq: out[r] bit-identical to cpu512_idot of row r alone. ext:
 * use the VBMI + VNNI variant (only when ctx->avx512x). */
void cpu512_idot_rows(int ext, fused_kind kind, int nr, const uint8_t *w, size_t row_bytes, int64_t cols,
                      const xq_rows *xq, int32_t t, float *out);

/* Most rows per pass of cpu512_idot_rn. */
#define CPU512_RN_MAX_NR 3

/* The same dot for nr consecutive rows w, w + row_bytes, ... and nt tokens
 * t0..t0+nt-1 (nr = 2: nt = 2..CPU512_MAX_NT; nr = 3: nt = 2 or 3):
 * out[u * ldo + r] bit-identical to cpu512_idot of row r alone, token t0 + u
 * alone. */
void cpu512_idot_rn(int ext, fused_kind kind, int nr, int nt, const uint8_t *w, size_t row_bytes, int64_t cols,
                    const xq_rows *xq, int32_t t0, float *out, size_t ldo);

/* f32 dot of one plain row (FK_F32 / FK_BF16 / FK_F16) of n values with nt
 * activation rows x + u * ldx. */
void cpu512_fdot(fused_kind kind, int nt, const uint8_t *w, int64_t n, const float *x, size_t ldx, float *out);

/* f32 dot of one I4G32 row (n % 32 == 0; sc: its n/32 bf16 scales) with nt
 * activation rows. */
void cpu512_i4dot(int nt, const uint8_t *w, const uint8_t *sc, int64_t n, const float *x, size_t ldx, float *out);

#endif
