/*
 * cpu_matmul.c: y[T, rows] = x[T, cols] @ W^T for every bk_wtype, on the CPU.
 *
 * Owns nothing; pure functions over caller buffers.
 *
 * Batch invariance: y[t][r] is computed by exactly one thread with one fixed
 * reduction order over the row's blocks (8-lane FMA accumulators, combined by
 * a fixed horizontal sum), whatever T is, whatever t is, however many threads
 * run. Threads split the output rows; no split-K.
 *
 * Memory traffic: rows are processed in chunks so a weight row is read from
 * memory once and reused from L1 for all T tokens (and, on AVX-512, a token's
 * activations once for 2-4 rows). On the 2-vCPU Zen 4 development VM a
 * one-thread decode step streams ~7.5 GB/s of the ~19.5 GB/s one core can,
 * and each token added to a pass costs ~0.27 decode steps of arithmetic that
 * the numerics fix (docs/engine.md, "Verify steps: where the extra tokens
 * go").
 * Block-quantized weights (Q8_0, Q4_0, Q4_1) are used in their packed blocks
 * and dotted in integers with activations quantized to int16 with one scale
 * per group of 4 columns (x ~= s * X, s = max|x| / 32767 over the group,
 * X = round-to-nearest-even(x / s)): the dot q.X is exact in int32, then
 * scaled by d * s in f32. The error per element is <= 1.5e-5 of its group's
 * max|x|; measured on SmolLM2 (tests/model/test_model_logits.c), logits stay
 * within 2e-4 * max|logit| of a f32 transformers reference, where llama.cpp's
 * int8 activations (Q8_0/Q8_1 per 32) land 1-4e-2 away on the same model. Plain rows (f32,
 * bf16, f16) and I4G32 keep f32 activations (dequantize-in-register).
 * The activation quantization is a function of each token's row alone, so
 * batch invariance holds as before.
 *
 * Block formats: ggml-quants.h (Q8_0, Q4_0, Q4_1); compressed-tensors
 * pack_to_int32 for I4G32 (verified by the Kimi tests against the package).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/backend.h"
#include "engine/backend/cpu_internal.h"

/* ---------------------------------------------------------------- scalar */


/* f32 -> nearest bf16 (ties to even), returned as f32. |q * scale| with q in
 * [-8, 7] and a bf16 scale is exact in f32, so this is the one rounding. */
static inline float f32_round_bf16(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    if ((b & 0x7f800000u) != 0x7f800000u) b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &b, 4);
    return x;
}

/* Dequantizes one row of any format to f32 (reference path, embed, tests). */
void bk_weight_row_f32(const bk_weight *w, int64_t row, float *out) {
    const uint8_t *p = (const uint8_t *)w->data + (size_t)row * w->row_bytes;
    int64_t n = w->cols;
    switch (w->type) {
    case BK_W_F32: memcpy(out, p, (size_t)n * 4); break;
    case BK_W_BF16: for (int64_t i = 0; i < n; i++) { uint16_t h; memcpy(&h, p + 2 * i, 2); out[i] = cpu_bf16_to_f32(h); } break;
    case BK_W_F16: for (int64_t i = 0; i < n; i++) { uint16_t h; memcpy(&h, p + 2 * i, 2); out[i] = cpu_fp16_to_f32(h); } break;
    case BK_W_Q8_0:
        for (int64_t b = 0; b < n / 32; b++, p += 34) {
            uint16_t d16; memcpy(&d16, p, 2);
            float d = cpu_fp16_to_f32(d16);
            for (int i = 0; i < 32; i++) out[b * 32 + i] = d * (float)(int8_t)p[2 + i];
        }
        break;
    case BK_W_Q4_0:
        for (int64_t b = 0; b < n / 32; b++, p += 18) {
            uint16_t d16; memcpy(&d16, p, 2);
            float d = cpu_fp16_to_f32(d16);
            for (int i = 0; i < 16; i++) {
                out[b * 32 + i] = d * (float)((p[2 + i] & 0xf) - 8);
                out[b * 32 + i + 16] = d * (float)((p[2 + i] >> 4) - 8);
            }
        }
        break;
    case BK_W_Q4_1:
        for (int64_t b = 0; b < n / 32; b++, p += 20) {
            uint16_t d16, m16; memcpy(&d16, p, 2); memcpy(&m16, p + 2, 2);
            float d = cpu_fp16_to_f32(d16), m = cpu_fp16_to_f32(m16);
            for (int i = 0; i < 16; i++) {
                out[b * 32 + i] = d * (float)(p[4 + i] & 0xf) + m;
                out[b * 32 + i + 16] = d * (float)(p[4 + i] >> 4) + m;
            }
        }
        break;
    case BK_W_I4G32: {
        /* int32 word j holds 8 signed 4-bit values for columns 8j..8j+7, lowest nibble first,
         * stored offset by +8 (compressed-tensors pack_to_int32 of value+8). The value is
         * bf16(q * scale): compressed-tensors multiplies in the scale's dtype (bf16), so the
         * exact f32 product is rounded to bf16, nearest-even (docs/kimi-k2.5.md, int4). */
        const uint8_t *sc = (const uint8_t *)w->scales + (size_t)row * (size_t)(n / 32) * 2;
        for (int64_t j = 0; j < n / 8; j++) {
            uint32_t word; memcpy(&word, p + 4 * j, 4);
            uint16_t s16; memcpy(&s16, sc + 2 * ((8 * j) / 32), 2);
            float s = cpu_bf16_to_f32(s16);
            for (int i = 0; i < 8; i++) out[8 * j + i] = f32_round_bf16(s * (float)((int)((word >> (4 * i)) & 0xf) - 8));
        }
        break;
    }
    }
}


/* ------------------------------------------------ portable row dots
 * The path without AVX2 (or with SPECD_CPU_PORTABLE=1). A weight row is first
 * unpacked (exactly: small integers or bf16/f16 values are representable in
 * f32) into qf[cols] plus per-block scales d[] and mins m[]; then dotted with
 * each token's activation row by dot1_scalar, the same code for every token:
 *   plain rows (f32/bf16/f16/I4G32): 8 interleaved partial sums, fixed order.
 *   block rows (Q8_0/Q4_0/Q4_1): per 32-block s_b = q.x, acc += d_b * s_b,
 *     accm += m_b * xs_b (Q4_1: m_b = min; Q4_0: m_b = -8 d_b, i.e. d(q-8));
 *     y = acc + accm.
 */

typedef struct row_buf {
    float *qf;   /* [cols] */
    float *d;    /* [cols/32] */
    float *m;    /* [cols/32] */
    int blocked; /* 1: block formula, 0: plain dot */
    int has_m;
} row_buf;

static void unpack_row_scalar(const bk_weight *w, int64_t r, row_buf *rb) {
    const uint8_t *p = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
    const int64_t nb = w->cols / 32;
    rb->blocked = 1;
    rb->has_m = w->type != BK_W_Q8_0;
    switch (w->type) {
    case BK_W_Q4_1:
    case BK_W_Q4_0: {
        const int q41 = w->type == BK_W_Q4_1;
        const size_t bs = q41 ? 20 : 18, qo = q41 ? 4 : 2;
        for (int64_t b = 0; b < nb; b++, p += bs) {
            uint16_t d16; memcpy(&d16, p, 2);
            rb->d[b] = cpu_fp16_to_f32(d16);
            if (q41) { uint16_t m16; memcpy(&m16, p + 2, 2); rb->m[b] = cpu_fp16_to_f32(m16); }
            else rb->m[b] = -8.0f * rb->d[b];
            for (int i = 0; i < 16; i++) {
                rb->qf[b * 32 + i] = (float)(p[qo + i] & 0xf);
                rb->qf[b * 32 + i + 16] = (float)(p[qo + i] >> 4);
            }
        }
        return;
    }
    case BK_W_Q8_0:
        for (int64_t b = 0; b < nb; b++, p += 34) {
            uint16_t d16; memcpy(&d16, p, 2);
            rb->d[b] = cpu_fp16_to_f32(d16);
            for (int i = 0; i < 32; i++) rb->qf[b * 32 + i] = (float)(int8_t)p[2 + i];
        }
        return;
    default:
        bk_weight_row_f32(w, r, rb->qf);
        rb->blocked = 0;
        rb->has_m = 0;
        return;
    }
}

static float dot1_scalar(const row_buf *rb, int64_t n, const float *x, const float *xs) {
    if (!rb->blocked) {
        float acc[8] = {0}, s = 0;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) for (int l = 0; l < 8; l++) acc[l] += rb->qf[i + l] * x[i + l];
        for (int l = 0; l < 8; l++) s += acc[l];
        for (; i < n; i++) s += rb->qf[i] * x[i];
        return s;
    }
    float acc = 0, accm = 0;
    for (int64_t b = 0; b < n / 32; b++) {
        float s = 0;
        for (int i = 0; i < 32; i++) s += rb->qf[b * 32 + i] * x[b * 32 + i];
        acc += rb->d[b] * s;
        if (rb->has_m) accm += rb->m[b] * xs[b];
    }
    return acc + accm;
}

/* ------------------------------------------------ plain-row dots (AVX2)
 * f32 / bf16 / f16 weight rows are loaded (converted in registers to f32) 32
 * values at a time and dotted with 1..4 activation rows. Per token the
 * sequence is always: for each 32-block, a = fma(w0,x0,a); b = fma(w1,x1,b);
 * a = fma(w2,x2,a); b = fma(w3,x3,b); then y = hsum(a + b) + a scalar tail
 * for rows whose length is not a multiple of 32. The 1- to 4-token variants
 * execute exactly this sequence per token, so y does not depend on how many
 * tokens share the step (batch invariance), and the 4-token variant reads
 * each weight block once for four tokens (verify / prefill). Two accumulators
 * per token break the FMA latency chain. */

/* The per-token FMA sequence of one 32-value block (plain rows and I4G32):
 * a += v0*x0; b += v1*x1; a += v2*x2; b += v3*x3 (8 lanes each). */
__attribute__((target("avx2,fma"), always_inline)) static inline void fma_block32(const __m256 v[4], const float *xb,
                                                                                  __m256 *a, __m256 *b) {
    *a = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xb), *a);
    *b = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), *b);
    *a = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), *a);
    *b = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), *b);
}


__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void fused_load(fused_kind k, const uint8_t *w, int64_t b,
                                                                        __m256 *v) {
    switch (k) {
    case FK_F32:
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps((const float *)(const void *)w + b * 32 + 8 * i);
        return;
    case FK_BF16:
        for (int i = 0; i < 4; i++) {
            __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(w + 2 * (size_t)(b * 32 + 8 * i)));
            v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        return;
    case FK_F16:
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(w + 2 * (size_t)(b * 32 + 8 * i))));
        return;
    default: /* block formats never come here (integer-activation path) */
        return;
    }
}


/* One function per (format, token count): the format is a compile-time
 * constant so fused_load's switch folds away. */
#define DEF_DOT_FUSED(NT, K)                                                                                       \
    __attribute__((target("avx2,fma,f16c"))) static void fdot##NT##_##K(const uint8_t *w, int64_t n,             \
                                                                     const float *x, size_t ldx, float *out) {    \
        __m256 a[NT], bb[NT];                                                                                      \
        CPU_UNROLL for (int u = 0; u < NT; u++) { a[u] = _mm256_setzero_ps(); bb[u] = _mm256_setzero_ps(); }                \
        const int64_t nb = n / 32;                                                                                 \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            __m256 v[4];                                                                                           \
            fused_load(K, w, b, v);                                                                                \
            CPU_UNROLL for (int u = 0; u < NT; u++) {                                                                         \
                const float *xb = x + (size_t)u * ldx + b * 32;                                                    \
                fma_block32(v, xb, &a[u], &bb[u]);                                                                 \
            }                                                                                                      \
        }                                                                                                          \
        CPU_UNROLL for (int u = 0; u < NT; u++) {                                                                             \
            float s = cpu_hsum8(_mm256_add_ps(a[u], bb[u]));                                                           \
            for (int64_t i = nb * 32; i < n; i++) s += cpu_plain_at(K, w, i) * x[(size_t)u * ldx + i];                 \
            out[u] = s;                                                                                            \
        }                                                                                                          \
    }
#define DEF_DOT_KIND(K) DEF_DOT_FUSED(1, K) DEF_DOT_FUSED(2, K) DEF_DOT_FUSED(3, K) DEF_DOT_FUSED(4, K)
DEF_DOT_KIND(FK_F32)
DEF_DOT_KIND(FK_BF16)
DEF_DOT_KIND(FK_F16)

typedef void (*fdot_fn)(const uint8_t *w, int64_t n, const float *x, size_t ldx, float *out);
static const fdot_fn FDOT1[] = {fdot1_FK_F32, fdot1_FK_BF16, fdot1_FK_F16};
static const fdot_fn FDOT2[] = {fdot2_FK_F32, fdot2_FK_BF16, fdot2_FK_F16};
static const fdot_fn FDOT3[] = {fdot3_FK_F32, fdot3_FK_BF16, fdot3_FK_F16};
static const fdot_fn FDOT4[] = {fdot4_FK_F32, fdot4_FK_BF16, fdot4_FK_F16};

/* ---------------------------------------------------- I4G32 dots (AVX2)
 * compressed-tensors int4 rows with f32 activations. Per group of 32 columns
 * (one bf16 scale s) the 16 possible weights bf16(q * s), q = -8..7, are
 * computed once into two 8-lane tables (q*s is exact in f32; the bf16
 * rounding is round-to-nearest-even on the bits, as f32_round_bf16), and
 * each int32 word's 8 nibbles select their weights with two permutes and a
 * blend on the nibble's bit 3. The values are those of bk_weight_row_f32;
 * per token the FMA sequence is the plain rows' (a/b accumulators over the
 * group's 4 words, y = hsum(a + b)), identical in the 1..4-token variants. */

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 bf16_round8(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xffff0000u)));
}

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 i4_word8(uint32_t word, __m256 lut_neg,
                                                                                 __m256 lut_pos) {
    const __m256i n = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word),
                                                         _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                       _mm256_set1_epi32(0xf));
    const __m256 lo = _mm256_permutevar8x32_ps(lut_neg, n), hi = _mm256_permutevar8x32_ps(lut_pos, n);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(n, 28)));
}

#define DEF_DOT_I4(NT)                                                                                             \
    __attribute__((target("avx2,fma"))) static void i4dot##NT(const uint8_t *w, const uint8_t *sc, int64_t n,     \
                                                              const float *x, size_t ldx, float *out) {            \
        __m256 a[NT], bb[NT];                                                                                      \
        CPU_UNROLL for (int u = 0; u < NT; u++) { a[u] = _mm256_setzero_ps(); bb[u] = _mm256_setzero_ps(); }                \
        const __m256 qneg = _mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1), qpos = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); \
        for (int64_t g = 0; g < n / 32; g++) {                                                                     \
            uint16_t s16;                                                                                          \
            memcpy(&s16, sc + 2 * g, 2);                                                                           \
            const __m256 s = _mm256_set1_ps(cpu_bf16_to_f32(s16));                                                     \
            const __m256 lneg = bf16_round8(_mm256_mul_ps(qneg, s)), lpos = bf16_round8(_mm256_mul_ps(qpos, s));  \
            __m256 v[4];                                                                                           \
            for (int i = 0; i < 4; i++) {                                                                          \
                uint32_t word;                                                                                     \
                memcpy(&word, w + 16 * g + 4 * i, 4);                                                              \
                v[i] = i4_word8(word, lneg, lpos);                                                                 \
            }                                                                                                      \
            CPU_UNROLL for (int u = 0; u < NT; u++) {                                                                         \
                const float *xb = x + (size_t)u * ldx + g * 32;                                                    \
                fma_block32(v, xb, &a[u], &bb[u]);                                                                 \
            }                                                                                                      \
        }                                                                                                          \
        CPU_UNROLL for (int u = 0; u < NT; u++) out[u] = cpu_hsum8(_mm256_add_ps(a[u], bb[u]));                                   \
    }
DEF_DOT_I4(1)
DEF_DOT_I4(2)
DEF_DOT_I4(3)
DEF_DOT_I4(4)
typedef void (*i4dot_fn)(const uint8_t *w, const uint8_t *sc, int64_t n, const float *x, size_t ldx, float *out);
static const i4dot_fn I4DOT[4] = {i4dot1, i4dot2, i4dot3, i4dot4};

/* --------------------------------------------- integer-activation dots
 * Per 32-block b of a Q8_0 / Q4_0 / Q4_1 row: the 32 weight integers q (Q8_0:
 * int8; Q4_x: the unsigned nibbles 0..15, low nibbles = columns 0..15) are
 * widened to int16 and multiplied with the token's int16 activations X by
 * vpmaddwd: lane l of P sums the 4 products of columns 2l, 2l+1, 16+2l and
 * 17+2l, exact in int32 (|P lane| <=
 * 4 * 128 * 32767 < 2^24, so its f32 conversion is exact too). Then
 *   acc = fma(f32(P), d_b * s_b, acc)        (8 lanes; s_b[l] the scale of
 *                                             lane l's 4 columns)
 *   accm = fma(m_b, xsum_b, accm)            (8 blocks per lane, see below;
 *                                             Q4_1: m = min; Q4_0: m = -8 d)
 * with w = d*q + m the block's dequantized weights and xsum_b the f32 sum of
 * the token's original activations in block b. Even blocks go to acc0, odd
 * blocks to acc1, which breaks the FMA latency chain; y = hsum(acc0 + acc1)
 * + (hsum(accm) + the scalar m-terms of chunk tails). The 1..4-token variants
 * execute exactly this per token (batch invariance).
 * Speed: a 4-bit block is widened to int16 with one in-lane byte shuffle of
 * a 128-bit broadcast (cpu_iq_load), and the AVX2 path quantizes a group of
 * up to 4 tokens interleaved per block (xq_rows), so the kernel walks one
 * activation pointer and keeps every token's accumulators in registers:
 * about 1.4 ns per 32-column block and token at 4 tokens against 2.3 before
 * (1536 x 576 Q4_1, one thread; tests/perf has the model-level figures). */


/* One block, scalar: the definition. */
static void quant_block_i16(const float *xb, int16_t *X, float *s) {
    for (int l = 0; l < 8; l++) { /* lane l: columns 2l, 2l+1, 16+2l, 16+2l+1 of the block */
        const int c[4] = {2 * l, 2 * l + 1, 16 + 2 * l, 17 + 2 * l};
        float amax = 0;
        int bad = 0;
        for (int i = 0; i < 4; i++) {
            const float a = fabsf(xb[c[i]]);
            bad |= !isfinite(xb[c[i]]);
            if (a > amax) amax = a;
        }
        if (bad || amax == 0.0f) {
            for (int i = 0; i < 4; i++) X[c[i]] = 0;
            s[l] = bad ? NAN : 0.0f;
            continue;
        }
        const float inv = 32767.0f / amax;
        s[l] = amax / 32767.0f;
        for (int i = 0; i < 4; i++) {
            long q = lrintf(xb[c[i]] * inv);
            X[c[i]] = (int16_t)(q > 32767 ? 32767 : q < -32767 ? -32767 : q);
        }
    }
}

/* One block, AVX2, the same values as quant_block_i16 (max is exact, the
 * divisions and the product are the same IEEE operations, cvtps rounds to
 * nearest-even as lrintf does in the default mode); a block with a
 * non-finite value or an all-zero lane group goes to the scalar code. */
__attribute__((target("avx2,fma"))) static void quant_block_i16_avx2(const float *xb, int16_t *X, float *s) {
    const __m256 A = _mm256_loadu_ps(xb), B = _mm256_loadu_ps(xb + 8), C = _mm256_loadu_ps(xb + 16),
                 D = _mm256_loadu_ps(xb + 24);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(INFINITY);
    const __m256 aA = _mm256_and_ps(A, absm), aB = _mm256_and_ps(B, absm), aC = _mm256_and_ps(C, absm),
                 aD = _mm256_and_ps(D, absm);
    const __m256 fin = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(aA, inf, _CMP_LT_OQ), _mm256_cmp_ps(aB, inf, _CMP_LT_OQ)),
                                     _mm256_and_ps(_mm256_cmp_ps(aC, inf, _CMP_LT_OQ), _mm256_cmp_ps(aD, inf, _CMP_LT_OQ)));
    if (_mm256_movemask_ps(fin) != 0xff) { quant_block_i16(xb, X, s); return; }
    /* E[i] = max(|x_i|, |x_16+i|), F[i] = max(|x_8+i|, |x_24+i|); group l < 4 is max(E[2l], E[2l+1]),
     * group l >= 4 is max(F[2l-8], F[2l-7]) */
    __m256 E = _mm256_max_ps(aA, aC), F = _mm256_max_ps(aB, aD);
    E = _mm256_max_ps(E, _mm256_permute_ps(E, 0xb1));
    F = _mm256_max_ps(F, _mm256_permute_ps(F, 0xb1));
    const __m256 G = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(E, F, 0x88)), 0xd8));
    if (_mm256_movemask_ps(_mm256_cmp_ps(G, _mm256_setzero_ps(), _CMP_EQ_OQ)) != 0) { quant_block_i16(xb, X, s); return; }
    const __m256 k = _mm256_set1_ps(32767.0f), inv = _mm256_div_ps(k, G);
    _mm256_storeu_ps(s, _mm256_div_ps(G, k));
    const __m256 invlo = _mm256_permutevar8x32_ps(inv, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
                 invhi = _mm256_permutevar8x32_ps(inv, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
    const __m256i lo = _mm256_set1_epi32(-32767), hi = _mm256_set1_epi32(32767);
#define QCLAMP(v, iv) _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, iv)), lo), hi)
    const __m256i qA = QCLAMP(A, invlo), qB = QCLAMP(B, invhi), qC = QCLAMP(C, invlo), qD = QCLAMP(D, invhi);
#undef QCLAMP
    _mm256_storeu_si256((__m256i *)(void *)X, _mm256_permute4x64_epi64(_mm256_packs_epi32(qA, qB), 0xd8));
    _mm256_storeu_si256((__m256i *)(void *)(X + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(qC, qD), 0xd8));
}

/* Quantizes one activation row x[cols] (cols % 32 == 0): block b's 32 int16
 * values go to X + b * ldX, its 8 lane-group scales to s + b * lds, its sum
 * to sum[b]. A group holding Inf/NaN gets s = NaN so the dot is NaN, as the
 * f32 dot would be. Strides (32, 8) give the per-token layout; the AVX2 dots
 * use the token-group layout (see xq_rows). */
static void quant_row_i16(const float *x, int64_t cols, int16_t *X, size_t ldX, float *s, size_t lds, float *sum) {
    const int64_t nb = cols / 32;
    /* block sums, each in column order (the m-term's definition), eight blocks' chains interleaved */
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int n = nb - b0 < 8 ? (int)(nb - b0) : 8;
        float acc[8] = {0};
        for (int i = 0; i < 32; i++)
            for (int j = 0; j < n; j++) acc[j] += x[(b0 + j) * 32 + i];
        for (int j = 0; j < n; j++) sum[b0 + j] = acc[j];
    }
    for (int64_t b = 0; b < nb; b++, X += ldX, s += lds) quant_block_i16_avx2(x + b * 32, X, s);
}

#define IDOT_BLOCK(K, NT, b, acc)                                                                                  \
    do {                                                                                                           \
        __m256i w0, w1;                                                                                            \
        const float *d;                                                                                            \
        cpu_iq_load(K, w, b, &w0, &w1, &d, &mb[(b) - c0]);                                                        \
        const __m256 dv = _mm256_broadcast_ss(d);                                                                  \
        const int16_t *xb = Xg + (size_t)(b) * (NT * 32);                                                          \
        const float *sb = sg + (size_t)(b) * (NT * 8);                                                             \
        CPU_UNROLL for (int u = 0; u < NT; u++) acc[u] = cpu_iq_fma(w0, w1, dv, xb + 32 * u, sb + 8 * u, acc[u]);  \
    } while (0)

#define DEF_DOT_INT(NT, K)                                                                                         \
    __attribute__((target("avx2,fma,f16c"))) static void idot##NT##_##K(const uint8_t *w, int64_t cols,          \
                                                                     const int16_t *Xg, const float *sg,         \
                                                                     const float *xsum0, float *out) { \
        const int64_t nb = cols / 32;                                                                              \
        __m256 a0[NT], a1[NT], am[NT];                                                                             \
        float mt[NT], mb[IDOT_CHUNK];                                                                              \
        CPU_UNROLL for (int u = 0; u < NT; u++) {                                                                             \
            a0[u] = a1[u] = am[u] = _mm256_setzero_ps();                                                           \
            mt[u] = 0.0f;                                                                                          \
        }                                                                                                          \
        for (int64_t c0 = 0; c0 < nb; c0 += IDOT_CHUNK) {                                                          \
            const int64_t c1 = nb - c0 < IDOT_CHUNK ? nb : c0 + IDOT_CHUNK;                                       \
            int64_t b = c0;                                                                                        \
            for (; b + 1 < c1; b += 2) {                                                                           \
                IDOT_BLOCK(K, NT, b, a0);                                                                          \
                IDOT_BLOCK(K, NT, b + 1, a1);                                                                      \
            }                                                                                                      \
            if (b < c1) IDOT_BLOCK(K, NT, b, a0);                                                                  \
            if (K == FK_Q8_0) continue;                                                                            \
            CPU_UNROLL for (int u = 0; u < NT; u++) {                                                                         \
                const float *xsum = xsum0 + (size_t)u * (size_t)nb + c0;                                               \
                int64_t i = 0;                                                                                     \
                for (; i + 8 <= c1 - c0; i += 8)                                                                   \
                    am[u] = _mm256_fmadd_ps(_mm256_loadu_ps(mb + i), _mm256_loadu_ps(xsum + i), am[u]);            \
                for (; i < c1 - c0; i++) mt[u] += mb[i] * xsum[i];                                                 \
            }                                                                                                      \
        }                                                                                                          \
        CPU_UNROLL for (int u = 0; u < NT; u++)                                                                               \
            out[u] = cpu_hsum8(_mm256_add_ps(a0[u], a1[u])) + (cpu_hsum8(am[u]) + mt[u]);                                  \
    }
#define DEF_DOT_INT_KIND(K) DEF_DOT_INT(1, K) DEF_DOT_INT(2, K) DEF_DOT_INT(3, K) DEF_DOT_INT(4, K)
DEF_DOT_INT_KIND(FK_Q8_0)
DEF_DOT_INT_KIND(FK_Q4_0)
DEF_DOT_INT_KIND(FK_Q4_1)

typedef void (*idot_fn)(const uint8_t *w, int64_t cols, const int16_t *Xg, const float *sg, const float *xsum0,
                        float *out);
static const idot_fn IDOT[3][4] = {{idot1_FK_Q8_0, idot2_FK_Q8_0, idot3_FK_Q8_0, idot4_FK_Q8_0},
                                   {idot1_FK_Q4_0, idot2_FK_Q4_0, idot3_FK_Q4_0, idot4_FK_Q4_0},
                                   {idot1_FK_Q4_1, idot2_FK_Q4_1, idot3_FK_Q4_1, idot4_FK_Q4_1}};

/* ---------------------------------------------------------------- matmul */

typedef struct mm_job {
    cpu_ctx *ctx;
    const bk_weight *w;
    const float *x, *xs;
    const xq_rows *xq; /* non-NULL: integer-activation path (Q8_0 / Q4_0 / Q4_1 with AVX2 or AVX-512) */
    float *y;
    int32_t T;
    int fail;
} mm_job;

/* Rows [r0, r1) for every token: each row unpacked once, then dotted with the
 * tokens four (AVX2) or eight (AVX-512) at a time; one token on AVX-512: four
 * rows at a time (cpu512_idot_rows: independent chains, the token's
 * activations loaded once for the four); several tokens on AVX-512 (verify,
 * prefill, small batches): two or three rows per pass (cpu512_idot_rn), the
 * rows left over one at a time. Every path gives a (row, token) the same
 * operations in the same order, so the grouping never changes a bit. */
static void mm_rows(void *va, int64_t r0, int64_t r1, int tid) {
    mm_job *j = va;
    const bk_weight *w = j->w;
    const int64_t rows = w->rows, cols = w->cols, nb = cols / 32;
    const int avx2 = j->ctx->avx2;
    const float *x = j->x, *xs = j->xs;
    float *y = j->y;
    const int kind = w->type == BK_W_Q8_0   ? FK_Q8_0
                     : w->type == BK_W_Q4_0 ? FK_Q4_0
                     : w->type == BK_W_Q4_1 ? FK_Q4_1
                     : w->type == BK_W_F32  ? FK_F32
                     : w->type == BK_W_BF16 ? FK_BF16
                     : w->type == BK_W_F16  ? FK_F16
                                            : -1;
    if (j->ctx->avx512 && (j->xq || w->type == BK_W_I4G32 || kind >= FK_F32)) {
        /* AVX-512: up to 8 tokens per pass over a row; same values as AVX2 */
        const size_t sc_row = (size_t)nb * 2;
        float o8[CPU512_MAX_NT];
        if (j->xq && j->T == 1) { /* one token (decode, a one-output LM head) */
            /* Q4_x: four rows per pass. Q8_0 (the LM head): one; on Zen 4 two or four interleaved Q8_0
             * rows (612-byte rows, 34-byte blocks) stream 1.5x slower than one (measured: SmolLM2's
             * 49152 x 576 head, 4.6 ms vs 3.0 ms per pass at 1 thread), Q4_1 rows 1.2-1.5x faster */
            const int g = kind == FK_Q8_0 ? 1 : 4;
            for (int64_t r = r0; r < r1; r += g)
                cpu512_idot_rows(j->ctx->avx512x, (fused_kind)kind, r1 - r < g ? (int)(r1 - r) : g,
                                 (const uint8_t *)w->data + (size_t)r * w->row_bytes, w->row_bytes, cols, j->xq, 0,
                                 y + r);
            return;
        }
        int64_t r = r0;
        /* several tokens: NR rows per pass (cpu512_idot_rn); three rows where the tokens are few enough for
         * their accumulators to stay in registers (measured: 2-3 tokens 1.1-1.2x faster with 3 rows than
         * with 2; 4-5 tokens faster with 2) */
        const int NR = j->T <= 3 ? 3 : 2;
        if (j->xq)
            for (; r + NR <= r1; r += NR) {
                const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
                for (int32_t t = 0; t < j->T; t += CPU512_MAX_NT) {
                    const int32_t n = j->T - t < CPU512_MAX_NT ? j->T - t : CPU512_MAX_NT;
                    if (n == 1) { /* the last of 8k + 1 tokens */
                        cpu512_idot_rows(j->ctx->avx512x, (fused_kind)kind, NR, wr, w->row_bytes,
                                         cols, j->xq, t, y + (size_t)t * rows + r);
                        continue;
                    }
                    cpu512_idot_rn(j->ctx->avx512x, (fused_kind)kind, NR, n, wr, w->row_bytes, cols, j->xq, t,
                                   y + (size_t)t * rows + r, (size_t)rows);
                }
            }
        for (; r < r1; r++) {
            const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
            for (int32_t t = 0; t < j->T; t += CPU512_MAX_NT) {
                const int32_t n = j->T - t < CPU512_MAX_NT ? j->T - t : CPU512_MAX_NT;
                if (j->xq) cpu512_idot(j->ctx->avx512x, (fused_kind)kind, n, wr, cols, j->xq, t, o8);
                else if (w->type == BK_W_I4G32)
                    cpu512_i4dot(n, wr, (const uint8_t *)w->scales + (size_t)r * sc_row, cols, x + (size_t)t * cols,
                                 (size_t)cols, o8);
                else cpu512_fdot((fused_kind)kind, n, wr, cols, x + (size_t)t * cols, (size_t)cols, o8);
                for (int32_t u = 0; u < n; u++) y[(size_t)(t + u) * rows + r] = o8[u];
            }
        }
        return;
    }
    if (j->xq) { /* kind is FK_Q8_0, FK_Q4_0 or FK_Q4_1 */
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
            int32_t t = 0;
            float o4[4];
            for (; t < j->T; t += 4) { /* token group t/4: its n tokens interleaved per block */
                const int32_t n = j->T - t < 4 ? j->T - t : 4;
                IDOT[kind][n - 1](wr, cols, j->xq->X + (size_t)t * (size_t)cols, j->xq->s + (size_t)t * (size_t)nb * 8,
                                  j->xq->sum + (size_t)t * (size_t)nb, o4);
                for (int32_t u = 0; u < n; u++) y[(size_t)(t + u) * rows + r] = o4[u];
            }
        }
        return;
    }
    if (avx2 && w->type == BK_W_I4G32) {
        const size_t sc_row = (size_t)nb * 2;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
            const uint8_t *sr = (const uint8_t *)w->scales + (size_t)r * sc_row;
            float o4[4];
            for (int32_t t = 0; t < j->T; t += 4) {
                const int32_t n = j->T - t < 4 ? j->T - t : 4;
                I4DOT[n - 1](wr, sr, cols, x + (size_t)t * cols, (size_t)cols, o4);
                for (int32_t u = 0; u < n; u++) y[(size_t)(t + u) * rows + r] = o4[u];
            }
        }
        return;
    }
    if (avx2 && kind >= FK_F32) {
        const int pk = kind - FK_F32; /* index into the plain-row tables */
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
            int32_t t = 0;
            float o4[4];
            for (; t + 4 <= j->T; t += 4) {
                FDOT4[pk](wr, cols, x + (size_t)t * cols, (size_t)cols, o4);
                for (int u = 0; u < 4; u++) y[(size_t)(t + u) * rows + r] = o4[u];
            }
            const int32_t rest = j->T - t; /* 0..3 tokens left: one pass over the row */
            if (rest > 0) {
                const fdot_fn f = rest == 1 ? FDOT1[pk] : rest == 2 ? FDOT2[pk] : FDOT3[pk];
                f(wr, cols, x + (size_t)t * cols, (size_t)cols, o4);
                for (int32_t u = 0; u < rest; u++) y[(size_t)(t + u) * rows + r] = o4[u];
            }
        }
        return;
    }
    /* portable path (no AVX2): unpack the row once, then one scalar dot per token */
    float *sbuf = cpu_scratch_get(j->ctx, tid, (size_t)cols + 2 * (size_t)(nb + 1));
    if (!sbuf) { j->fail = 1; return; }
    row_buf rb = {.qf = sbuf, .d = sbuf + cols, .m = sbuf + cols + nb + 1};
    for (int64_t r = r0; r < r1; r++) {
        unpack_row_scalar(w, r, &rb);
        for (int32_t t = 0; t < j->T; t++)
            y[(size_t)t * rows + r] = dot1_scalar(&rb, cols, x + (size_t)t * cols, xs + (size_t)t * nb);
    }
}

/* The activations of T tokens prepared once for any weights of `cols`
 * columns on one path: int16-quantized rows for the integer path (Q8_0 /
 * Q4_0 / Q4_1 with AVX2 or AVX-512), per-block sums for the portable path. */
typedef struct mm_act {
    float *xs;       /* [T][nb] block sums (filled on the portable path only) */
    int16_t *X;      /* integer path: quantized rows (xq_rows layout) */
    float *xsc;      /* integer path: [T][nb][8] scales then [T][nb] sums */
    xq_rows xq;
    int integer;
} mm_act;

static int mm_integer(const cpu_ctx *ctx, const bk_weight *w) {
    return ctx->avx2 && (w->type == BK_W_Q8_0 || w->type == BK_W_Q4_0 || w->type == BK_W_Q4_1) && w->cols % 32 == 0;
}

static void mm_act_free(mm_act *a) {
    free(a->X);
    free(a->xsc);
    free(a->xs);
}

static int mm_act_prepare(cpu_ctx *ctx, const bk_weight *w, const float *x, int32_t T, mm_act *a) {
    const int64_t cols = w->cols, nb = cols / 32;
    memset(a, 0, sizeof *a);
    /* Per-token block sums of x (a function of each activation row alone). */
    a->xs = malloc(sizeof(float) * (size_t)T * (size_t)(nb ? nb : 1));
    if (!a->xs) return -1;
    float *xs = a->xs;
    for (int32_t t = 0; t < T && !ctx->avx2; t++) /* only the portable path uses them */
        for (int64_t b = 0; b < nb; b++) {
            float s = 0;
            for (int i = 0; i < 32; i++) s += x[(size_t)t * cols + b * 32 + i];
            xs[(size_t)t * nb + b] = s;
        }
    a->integer = mm_integer(ctx, w);
    if (!a->integer) return 0;
    int16_t *X = a->X = malloc(sizeof(int16_t) * (size_t)T * (size_t)cols);
    float *xsc = a->xsc = malloc(sizeof(float) * 9 * (size_t)T * (size_t)(nb ? nb : 1));
    if (!X || !xsc) { mm_act_free(a); return -1; }
    for (int32_t t = 0; t < T; t++) {
        /* AVX-512: per-token rows (then the pair layout); AVX2: groups of 4 tokens, within a group
         * block b of token u at X + g0 * cols + (b * n + u) * 32 (n = the group's size) */
        const int32_t g0 = ctx->avx512 ? t : t - t % 4, n = ctx->avx512 ? 1 : (T - g0 < 4 ? T - g0 : 4), u = t - g0;
        quant_row_i16(x + (size_t)t * cols, cols, X + (size_t)g0 * cols + (size_t)u * 32, (size_t)n * 32,
                      xsc + ((size_t)g0 * nb + (size_t)u) * 8, (size_t)n * 8, xsc + (size_t)T * nb * 8 + (size_t)t * nb);
        if (ctx->avx512) cpu512_pair_layout(X + (size_t)t * cols, cols);
    }
    a->xq = (xq_rows){X, xsc, xsc + (size_t)T * nb * 8};
    return 0;
}

int cpu_matmul(void *vctx, const bk_weight *w, const float *x, int32_t T, float *y) {
    cpu_ctx *ctx = vctx;
    mm_act a;
    if (mm_act_prepare(ctx, w, x, T, &a) < 0) return -1;
    mm_job j = {ctx, w, x, a.xs, a.integer ? &a.xq : NULL, y, T, 0};
    tpool_run(ctx->pool, mm_rows, &j, w->rows, 16);
    mm_act_free(&a);
    return j.fail ? -1 : 0;
}

/* Several weights' rows as one job: item i is row i of the weights' rows
 * concatenated; a chunk may span two weights. */
typedef struct mm_multi {
    int n;
    mm_job j[CPU_MATMUL_N_MAX];
    int64_t off[CPU_MATMUL_N_MAX + 1]; /* off[k]: first item of weight k; off[n]: all rows */
} mm_multi;

static void mm_multi_rows(void *va, int64_t i0, int64_t i1, int tid) {
    mm_multi *mj = va;
    for (int k = 0; k < mj->n; k++) {
        const int64_t b = i0 > mj->off[k] ? i0 : mj->off[k], e = i1 < mj->off[k + 1] ? i1 : mj->off[k + 1];
        if (b < e) mm_rows(&mj->j[k], b - mj->off[k], e - mj->off[k], tid);
    }
}

int cpu_matmul_n(void *vctx, int n, const bk_weight *const *w, const float *x, int32_t T, float *const *y) {
    cpu_ctx *ctx = vctx;
    int same = n >= 1 && n <= CPU_MATMUL_N_MAX;
    for (int k = 1; k < n && same; k++) same = w[k]->cols == w[0]->cols && mm_integer(ctx, w[k]) == mm_integer(ctx, w[0]);
    if (!same) { /* different activation preparations: one matmul each */
        for (int k = 0; k < n; k++)
            if (cpu_matmul(vctx, w[k], x, T, y[k]) < 0) return -1;
        return 0;
    }
    mm_act a;
    if (mm_act_prepare(ctx, w[0], x, T, &a) < 0) return -1;
    mm_multi mj = {.n = n};
    for (int k = 0; k < n; k++) {
        mj.j[k] = (mm_job){ctx, w[k], x, a.xs, a.integer ? &a.xq : NULL, y[k], T, 0};
        mj.off[k + 1] = mj.off[k] + w[k]->rows;
    }
    tpool_run(ctx->pool, mm_multi_rows, &mj, mj.off[n], 16);
    mm_act_free(&a);
    int fail = 0;
    for (int k = 0; k < n; k++) fail |= mj.j[k].fail;
    return fail ? -1 : 0;
}
