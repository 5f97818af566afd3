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
 * Memory traffic: batch-1 decode is bound by weight bytes. Rows are processed
 * in chunks so a weight row is read from memory once and reused from L1 for
 * all T tokens (what makes verifying k+1 tokens cost about one decode).
 * Quantized weights are used in their packed blocks with f32 activations
 * (dequantize-in-register), so results match a f32 reference that dequantizes
 * the same weights up to f32 rounding of the reduction order.
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

static inline float fp16_to_f32(uint16_t h) {
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
static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Dequantizes one row of any format to f32 (reference path, embed, tests). */
void bk_weight_row_f32(const bk_weight *w, int64_t row, float *out) {
    const uint8_t *p = (const uint8_t *)w->data + (size_t)row * w->row_bytes;
    int64_t n = w->cols;
    switch (w->type) {
    case BK_W_F32: memcpy(out, p, (size_t)n * 4); break;
    case BK_W_BF16: for (int64_t i = 0; i < n; i++) { uint16_t h; memcpy(&h, p + 2 * i, 2); out[i] = bf16_to_f32(h); } break;
    case BK_W_F16: for (int64_t i = 0; i < n; i++) { uint16_t h; memcpy(&h, p + 2 * i, 2); out[i] = fp16_to_f32(h); } break;
    case BK_W_Q8_0:
        for (int64_t b = 0; b < n / 32; b++, p += 34) {
            uint16_t d16; memcpy(&d16, p, 2);
            float d = fp16_to_f32(d16);
            for (int i = 0; i < 32; i++) out[b * 32 + i] = d * (float)(int8_t)p[2 + i];
        }
        break;
    case BK_W_Q4_0:
        for (int64_t b = 0; b < n / 32; b++, p += 18) {
            uint16_t d16; memcpy(&d16, p, 2);
            float d = fp16_to_f32(d16);
            for (int i = 0; i < 16; i++) {
                out[b * 32 + i] = d * (float)((p[2 + i] & 0xf) - 8);
                out[b * 32 + i + 16] = d * (float)((p[2 + i] >> 4) - 8);
            }
        }
        break;
    case BK_W_Q4_1:
        for (int64_t b = 0; b < n / 32; b++, p += 20) {
            uint16_t d16, m16; memcpy(&d16, p, 2); memcpy(&m16, p + 2, 2);
            float d = fp16_to_f32(d16), m = fp16_to_f32(m16);
            for (int i = 0; i < 16; i++) {
                out[b * 32 + i] = d * (float)(p[4 + i] & 0xf) + m;
                out[b * 32 + i + 16] = d * (float)(p[4 + i] >> 4) + m;
            }
        }
        break;
    case BK_W_I4G32: {
        /* int32 word j holds 8 signed 4-bit values for columns 8j..8j+7, lowest nibble first,
         * stored offset by +8 (compressed-tensors pack_to_int32 of value+8). */
        const uint8_t *sc = (const uint8_t *)w->scales + (size_t)row * (size_t)(n / 32) * 2;
        for (int64_t j = 0; j < n / 8; j++) {
            uint32_t word; memcpy(&word, p + 4 * j, 4);
            uint16_t s16; memcpy(&s16, sc + 2 * ((8 * j) / 32), 2);
            float s = bf16_to_f32(s16);
            for (int i = 0; i < 8; i++) out[8 * j + i] = s * (float)((int)((word >> (4 * i)) & 0xf) - 8);
        }
        break;
    }
    }
}

/* Horizontal sum in a fixed order. */
__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    lo = _mm_add_ss(lo, sh);
    return _mm_cvtss_f32(lo);
}

/* ------------------------------------------------------------- row dots */
/* Each returns dot(row, x) for one weight row and one activation row of n. */

static float dot_f32_scalar(const uint8_t *w, const float *x, int64_t n) {
    float acc[8] = {0};
    const float *wf = (const float *)(const void *)w;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) for (int l = 0; l < 8; l++) acc[l] += wf[i + l] * x[i + l];
    float s = 0;
    for (int l = 0; l < 8; l++) s += acc[l];
    for (; i < n; i++) s += wf[i] * x[i];
    return s;
}

__attribute__((target("avx2,fma"))) static float dot_f32_avx2(const uint8_t *w, const float *x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    const float *wf = (const float *)(const void *)w;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i), _mm256_loadu_ps(x + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += wf[i] * x[i];
    return s;
}

__attribute__((target("avx2,fma"))) static float dot_bf16_avx2(const uint8_t *w, const float *x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(w + 2 * i));
        __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), acc);
    }
    float s = hsum8(acc);
    for (; i < n; i++) { uint16_t h; memcpy(&h, w + 2 * i, 2); s += bf16_to_f32(h) * x[i]; }
    return s;
}

__attribute__((target("avx2,fma,f16c"))) static float dot_f16_avx2(const uint8_t *w, const float *x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(w + 2 * i));
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(x + i), acc);
    }
    float s = hsum8(acc);
    for (; i < n; i++) { uint16_t h; memcpy(&h, w + 2 * i, 2); s += fp16_to_f32(h) * x[i]; }
    return s;
}

/* Q8_0: sum_b d_b * sum_i q_i x_i. */
__attribute__((target("avx2,fma,f16c"))) static float dot_q8_0_avx2(const uint8_t *w, const float *x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / 32; b++, w += 34, x += 32) {
        uint16_t d16; memcpy(&d16, w, 2);
        __m256 d = _mm256_set1_ps(fp16_to_f32(d16));
        __m256 s = _mm256_setzero_ps();
        for (int g = 0; g < 4; g++) {
            __m128i q8 = _mm_loadl_epi64((const __m128i *)(const void *)(w + 2 + 8 * g));
            __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
            s = _mm256_fmadd_ps(qf, _mm256_loadu_ps(x + 8 * g), s);
        }
        acc = _mm256_fmadd_ps(d, s, acc);
    }
    return hsum8(acc);
}

static float dot_q8_0_scalar(const uint8_t *w, const float *x, int64_t n) {
    float acc = 0;
    for (int64_t b = 0; b < n / 32; b++, w += 34, x += 32) {
        uint16_t d16; memcpy(&d16, w, 2);
        float s = 0;
        for (int i = 0; i < 32; i++) s += (float)(int8_t)w[2 + i] * x[i];
        acc += fp16_to_f32(d16) * s;
    }
    return acc;
}

/* Q4_1: sum_b (d_b * sum_i q_i x_i + m_b * sum_i x_i). xs[b] = sum of x over block b
 * (precomputed once per activation row: depends only on that row). */
__attribute__((target("avx2,fma,f16c"))) static float dot_q4_1_avx2(const uint8_t *w, const float *x, const float *xs, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    float accm = 0;
    const __m128i lomask = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < n / 32; b++, w += 20, x += 32) {
        uint16_t d16, m16; memcpy(&d16, w, 2); memcpy(&m16, w + 2, 2);
        __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)(w + 4));
        __m128i lo = _mm_and_si128(raw, lomask);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), lomask);
        __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(x));
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + 8), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(x + 16), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + 24), s);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(d16)), s, acc);
        accm += fp16_to_f32(m16) * xs[b];
    }
    return hsum8(acc) + accm;
}

static float dot_q4_1_scalar(const uint8_t *w, const float *x, const float *xs, int64_t n) {
    float acc = 0;
    for (int64_t b = 0; b < n / 32; b++, w += 20, x += 32) {
        uint16_t d16, m16; memcpy(&d16, w, 2); memcpy(&m16, w + 2, 2);
        float s = 0;
        for (int i = 0; i < 16; i++) s += (float)(w[4 + i] & 0xf) * x[i] + (float)(w[4 + i] >> 4) * x[i + 16];
        acc += fp16_to_f32(d16) * s + fp16_to_f32(m16) * xs[b];
    }
    return acc;
}

/* Q4_0: sum_b d_b * sum_i (q_i - 8) x_i = sum_b d_b * (sum q_i x_i - 8 xs_b). */
__attribute__((target("avx2,fma,f16c"))) static float dot_q4_0_avx2(const uint8_t *w, const float *x, const float *xs, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    float accm = 0;
    const __m128i lomask = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < n / 32; b++, w += 18, x += 32) {
        uint16_t d16; memcpy(&d16, w, 2);
        float d = fp16_to_f32(d16);
        __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)(w + 2));
        __m128i lo = _mm_and_si128(raw, lomask);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), lomask);
        __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(x));
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + 8), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(x + 16), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + 24), s);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
        accm -= 8.0f * d * xs[b];
    }
    return hsum8(acc) + accm;
}

static float dot_q4_0_scalar(const uint8_t *w, const float *x, const float *xs, int64_t n) {
    float acc = 0;
    for (int64_t b = 0; b < n / 32; b++, w += 18, x += 32) {
        uint16_t d16; memcpy(&d16, w, 2);
        float d = fp16_to_f32(d16), s = 0;
        for (int i = 0; i < 16; i++) s += (float)(w[2 + i] & 0xf) * x[i] + (float)(w[2 + i] >> 4) * x[i + 16];
        acc += d * s - 8.0f * d * xs[b];
    }
    return acc;
}

/* Generic: dequantize the row then f32 dot (bf16/f16 scalar, I4G32). */
static float dot_generic(const bk_weight *w, int64_t r, const float *x, float *tmp) {
    bk_weight_row_f32(w, r, tmp);
    return dot_f32_scalar((const uint8_t *)tmp, x, w->cols);
}

/* ---------------------------------------------------------------- matmul */

int cpu_matmul(void *vctx, const bk_weight *w, const float *x, int32_t T, float *y) {
    cpu_ctx *ctx = vctx;
    const int64_t rows = w->rows, cols = w->cols;
    const int avx2 = ctx->avx2;
    const int need_xs = w->type == BK_W_Q4_1 || w->type == BK_W_Q4_0;
    float *xs = NULL;
    if (need_xs) {
        /* Per-token block sums of x: a function of each activation row alone. */
        xs = malloc(sizeof(float) * (size_t)T * (size_t)(cols / 32));
        if (!xs) return -1;
        for (int32_t t = 0; t < T; t++)
            for (int64_t b = 0; b < cols / 32; b++) {
                float s = 0;
                for (int i = 0; i < 32; i++) s += x[(size_t)t * cols + b * 32 + i];
                xs[(size_t)t * (cols / 32) + b] = s;
            }
    }
    int fail = 0;
#pragma omp parallel num_threads(ctx->n_threads)
    {
        float *tmp = NULL;
        if (w->type == BK_W_I4G32 || (!avx2 && (w->type == BK_W_BF16 || w->type == BK_W_F16))) {
            tmp = malloc(sizeof(float) * (size_t)cols);
            if (!tmp) {
#pragma omp atomic write
                fail = 1;
            }
        }
        /* Chunks of 16 rows: each row is read once and reused for all T tokens. */
#pragma omp for schedule(static)
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
            if (fail) continue;
            int64_t r1 = r0 + 16 < rows ? r0 + 16 : rows;
            for (int64_t r = r0; r < r1; r++) {
                const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
                for (int32_t t = 0; t < T; t++) {
                    const float *xt = x + (size_t)t * cols;
                    const float *xst = need_xs ? xs + (size_t)t * (cols / 32) : NULL;
                    float v;
                    switch (w->type) {
                    case BK_W_F32: v = avx2 ? dot_f32_avx2(wr, xt, cols) : dot_f32_scalar(wr, xt, cols); break;
                    case BK_W_BF16: v = avx2 ? dot_bf16_avx2(wr, xt, cols) : dot_generic(w, r, xt, tmp); break;
                    case BK_W_F16: v = avx2 ? dot_f16_avx2(wr, xt, cols) : dot_generic(w, r, xt, tmp); break;
                    case BK_W_Q8_0: v = avx2 ? dot_q8_0_avx2(wr, xt, cols) : dot_q8_0_scalar(wr, xt, cols); break;
                    case BK_W_Q4_1: v = avx2 ? dot_q4_1_avx2(wr, xt, xst, cols) : dot_q4_1_scalar(wr, xt, xst, cols); break;
                    case BK_W_Q4_0: v = avx2 ? dot_q4_0_avx2(wr, xt, xst, cols) : dot_q4_0_scalar(wr, xt, xst, cols); break;
                    default: v = dot_generic(w, r, xt, tmp); break;
                    }
                    y[(size_t)t * rows + r] = v;
                }
            }
        }
        free(tmp);
    }
    free(xs);
    return fail ? -1 : 0;
}
