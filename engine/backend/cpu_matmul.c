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
         * stored offset by +8 (compressed-tensors pack_to_int32 of value+8). The value is
         * bf16(q * scale): compressed-tensors multiplies in the scale's dtype (bf16), so the
         * exact f32 product is rounded to bf16, nearest-even (docs/kimi-k2.5.md, int4). */
        const uint8_t *sc = (const uint8_t *)w->scales + (size_t)row * (size_t)(n / 32) * 2;
        for (int64_t j = 0; j < n / 8; j++) {
            uint32_t word; memcpy(&word, p + 4 * j, 4);
            uint16_t s16; memcpy(&s16, sc + 2 * ((8 * j) / 32), 2);
            float s = bf16_to_f32(s16);
            for (int i = 0; i < 8; i++) out[8 * j + i] = f32_round_bf16(s * (float)((int)((word >> (4 * i)) & 0xf) - 8));
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

/* ------------------------------------------------------------- row dots
 *
 * A weight row is first unpacked (exactly: small integers or bf16/f16 values
 * are representable in f32) into qf[cols] plus per-block scales d[] and mins
 * m[]; then dotted with one or four activation rows. The arithmetic applied to
 * one token is identical in dot1 and dot4 (same operations, same order), so
 * y[t][r] does not depend on how many tokens share the step.
 *   plain rows (f32/bf16/f16):  sum over 8-lane FMA chain, fixed hsum.
 *   block rows (Q8_0/Q4_0/Q4_1): per 32-block s_b = q.x (4 x 8-lane FMA),
 *     acc = fma(d_b, s_b, acc); accm += m_b * xs_b (Q4_1: m_b = min;
 *     Q4_0: m_b = -8 d_b, i.e. d(q-8)); y = hsum(acc) + accm.
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
            rb->d[b] = fp16_to_f32(d16);
            if (q41) { uint16_t m16; memcpy(&m16, p + 2, 2); rb->m[b] = fp16_to_f32(m16); }
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
            rb->d[b] = fp16_to_f32(d16);
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

/* NT = 1 or 4 tokens at once; per-token arithmetic identical for both. */
#define DEF_DOT_AVX2(NT)                                                                                           \
    __attribute__((target("avx2,fma"))) static void dot##NT##_avx2(const row_buf *rb, int64_t n, const float *x, \
                                                                     size_t ldx, const float *xs, size_t ldxs,     \
                                                                     float *out) {                                 \
        __m256 acc[NT];                                                                                            \
        float accm[NT];                                                                                            \
        for (int u = 0; u < NT; u++) { acc[u] = _mm256_setzero_ps(); accm[u] = 0; }                              \
        if (rb->blocked) {                                                                                         \
            for (int64_t b = 0; b < n / 32; b++) {                                                                 \
                const float *q = rb->qf + b * 32;                                                                  \
                __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8), q2 = _mm256_loadu_ps(q + 16),         \
                       q3 = _mm256_loadu_ps(q + 24), d = _mm256_set1_ps(rb->d[b]);                                 \
                for (int u = 0; u < NT; u++) {                                                                     \
                    const float *xb = x + (size_t)u * ldx + b * 32;                                                \
                    __m256 s = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));                                             \
                    s = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), s);                                           \
                    s = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), s);                                          \
                    s = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), s);                                          \
                    acc[u] = _mm256_fmadd_ps(d, s, acc[u]);                                                        \
                    if (rb->has_m) accm[u] += rb->m[b] * xs[(size_t)u * ldxs + b];                                 \
                }                                                                                                  \
            }                                                                                                      \
            for (int u = 0; u < NT; u++) out[u] = hsum8(acc[u]) + accm[u];                                         \
        } else {                                                                                                   \
            int64_t i = 0;                                                                                         \
            for (; i + 8 <= n; i += 8) {                                                                           \
                __m256 wv = _mm256_loadu_ps(rb->qf + i);                                                           \
                for (int u = 0; u < NT; u++)                                                                       \
                    acc[u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)u * ldx + i), acc[u]);                \
            }                                                                                                      \
            for (int u = 0; u < NT; u++) {                                                                         \
                float s = hsum8(acc[u]);                                                                           \
                for (int64_t j = i; j < n; j++) s += rb->qf[j] * x[(size_t)u * ldx + j];                           \
                out[u] = s;                                                                                        \
            }                                                                                                      \
        }                                                                                                          \
    }
DEF_DOT_AVX2(1)
DEF_DOT_AVX2(4)

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

/* ------------------------------------------------------ fused dots (AVX2)
 * The weight row is dequantized in registers, 32 values at a time, to the f32
 * weights w = d*q + m (Q4_1), d*(q-8) (Q4_0), d*q (Q8_0), or the bf16 / f16 /
 * f32 values themselves, and dotted with 1 or 4 activation rows. Per token the
 * sequence is always: for each 32-block, a = fma(w0,x0,a); b = fma(w1,x1,b);
 * a = fma(w2,x2,a); b = fma(w3,x3,b); then y = hsum(a + b) (+ a scalar tail
 * for plain rows whose length is not a multiple of 32). The 1- and 4-token
 * (and 2-, 3-token) variants execute exactly this sequence per token, so y does not depend on
 * how many tokens share the step (batch invariance), and the 4-token variant
 * decodes each weight block once for four tokens (verify / prefill).
 * Two accumulators per token break the FMA latency chain. */

typedef enum { FK_Q8_0, FK_Q4_0, FK_Q4_1, FK_F32, FK_BF16, FK_F16 } fused_kind;

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void fused_load(fused_kind k, const uint8_t *w, int64_t b,
                                                                        __m256 *v) {
    const __m128i lomask = _mm_set1_epi8(0x0f);
    switch (k) {
    case FK_Q4_0:
    case FK_Q4_1: {
        const uint8_t *blk = w + (size_t)b * (k == FK_Q4_1 ? 20 : 18);
        uint16_t d16, m16 = 0;
        memcpy(&d16, blk, 2);
        if (k == FK_Q4_1) memcpy(&m16, blk + 2, 2);
        __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)(blk + (k == FK_Q4_1 ? 4 : 2)));
        __m128i lo = _mm_and_si128(raw, lomask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), lomask);
        __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(d16));
        if (k == FK_Q4_1) {
            const __m256 m = _mm256_set1_ps(_cvtsh_ss(m16));
            for (int i = 0; i < 4; i++) v[i] = _mm256_fmadd_ps(d, q[i], m);
        } else {
            const __m256 eight = _mm256_set1_ps(8.0f);
            for (int i = 0; i < 4; i++) v[i] = _mm256_mul_ps(d, _mm256_sub_ps(q[i], eight));
        }
        return;
    }
    case FK_Q8_0: {
        const uint8_t *blk = w + (size_t)b * 34;
        uint16_t d16;
        memcpy(&d16, blk, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(d16));
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                        _mm_loadl_epi64((const __m128i *)(const void *)(blk + 2 + 8 * i)))));
        return;
    }
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
    }
}

static inline float plain_at(fused_kind k, const uint8_t *w, int64_t i) {
    uint16_t h;
    switch (k) {
    case FK_F32: { float f; memcpy(&f, w + 4 * i, 4); return f; }
    case FK_BF16: memcpy(&h, w + 2 * i, 2); return bf16_to_f32(h);
    default: memcpy(&h, w + 2 * i, 2); return fp16_to_f32(h);
    }
}

/* One function per (format, token count): the format is a compile-time
 * constant so fused_load's switch folds away. */
#define DEF_DOT_FUSED(NT, K)                                                                                       \
    __attribute__((target("avx2,fma,f16c"))) static void fdot##NT##_##K(const uint8_t *w, int64_t n,             \
                                                                     const float *x, size_t ldx, float *out) {    \
        __m256 a[NT], bb[NT];                                                                                      \
        for (int u = 0; u < NT; u++) { a[u] = _mm256_setzero_ps(); bb[u] = _mm256_setzero_ps(); }                \
        const int64_t nb = n / 32;                                                                                 \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            __m256 v[4];                                                                                           \
            fused_load(K, w, b, v);                                                                                \
            for (int u = 0; u < NT; u++) {                                                                         \
                const float *xb = x + (size_t)u * ldx + b * 32;                                                    \
                a[u] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xb), a[u]);                                           \
                bb[u] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), bb[u]);                                     \
                a[u] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), a[u]);                                      \
                bb[u] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), bb[u]);                                    \
            }                                                                                                      \
        }                                                                                                          \
        for (int u = 0; u < NT; u++) {                                                                             \
            float s = hsum8(_mm256_add_ps(a[u], bb[u]));                                                           \
            for (int64_t i = nb * 32; i < n; i++) s += plain_at(K, w, i) * x[(size_t)u * ldx + i];                 \
            out[u] = s;                                                                                            \
        }                                                                                                          \
    }
#define DEF_DOT_KIND(K) DEF_DOT_FUSED(1, K) DEF_DOT_FUSED(2, K) DEF_DOT_FUSED(3, K) DEF_DOT_FUSED(4, K)
DEF_DOT_KIND(FK_Q8_0)
DEF_DOT_KIND(FK_Q4_0)
DEF_DOT_KIND(FK_Q4_1)
DEF_DOT_KIND(FK_F32)
DEF_DOT_KIND(FK_BF16)
DEF_DOT_KIND(FK_F16)

typedef void (*fdot_fn)(const uint8_t *w, int64_t n, const float *x, size_t ldx, float *out);
static const fdot_fn FDOT1[] = {fdot1_FK_Q8_0, fdot1_FK_Q4_0, fdot1_FK_Q4_1, fdot1_FK_F32, fdot1_FK_BF16, fdot1_FK_F16};
static const fdot_fn FDOT2[] = {fdot2_FK_Q8_0, fdot2_FK_Q4_0, fdot2_FK_Q4_1, fdot2_FK_F32, fdot2_FK_BF16, fdot2_FK_F16};
static const fdot_fn FDOT3[] = {fdot3_FK_Q8_0, fdot3_FK_Q4_0, fdot3_FK_Q4_1, fdot3_FK_F32, fdot3_FK_BF16, fdot3_FK_F16};
static const fdot_fn FDOT4[] = {fdot4_FK_Q8_0, fdot4_FK_Q4_0, fdot4_FK_Q4_1, fdot4_FK_F32, fdot4_FK_BF16, fdot4_FK_F16};

/* ---------------------------------------------------------------- matmul */

typedef struct mm_job {
    cpu_ctx *ctx;
    const bk_weight *w;
    const float *x, *xs;
    float *y;
    int32_t T;
    int fail;
} mm_job;

/* Rows [r0, r1) for every token: each row unpacked once, then dotted with the
 * tokens four at a time. */
static void mm_rows(void *va, int64_t r0, int64_t r1, int tid) {
    mm_job *j = va;
    const bk_weight *w = j->w;
    const int64_t rows = w->rows, cols = w->cols, nb = cols / 32;
    float *s = cpu_scratch_get(j->ctx, tid, (size_t)cols + 2 * (size_t)(nb + 1));
    if (!s) { j->fail = 1; return; }
    row_buf rb = {.qf = s, .d = s + cols, .m = s + cols + nb + 1};
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
    if (avx2 && kind >= 0) {
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
            int32_t t = 0;
            float o4[4];
            for (; t + 4 <= j->T; t += 4) {
                FDOT4[kind](wr, cols, x + (size_t)t * cols, (size_t)cols, o4);
                for (int u = 0; u < 4; u++) y[(size_t)(t + u) * rows + r] = o4[u];
            }
            const int32_t rest = j->T - t; /* 0..3 tokens left: one pass over the row */
            if (rest > 0) {
                const fdot_fn f = rest == 1 ? FDOT1[kind] : rest == 2 ? FDOT2[kind] : FDOT3[kind];
                f(wr, cols, x + (size_t)t * cols, (size_t)cols, o4);
                for (int32_t u = 0; u < rest; u++) y[(size_t)(t + u) * rows + r] = o4[u];
            }
        }
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        /* portable path, or a format without a fused kernel (I4G32) */
        unpack_row_scalar(w, r, &rb);
        int32_t t = 0;
        float o4[4];
        if (avx2)
            for (; t + 4 <= j->T; t += 4) {
                dot4_avx2(&rb, cols, x + (size_t)t * cols, (size_t)cols, xs + (size_t)t * nb, (size_t)nb, o4);
                for (int u = 0; u < 4; u++) y[(size_t)(t + u) * rows + r] = o4[u];
            }
        for (; t < j->T; t++) {
            if (avx2) dot1_avx2(&rb, cols, x + (size_t)t * cols, (size_t)cols, xs + (size_t)t * nb, (size_t)nb, o4);
            else o4[0] = dot1_scalar(&rb, cols, x + (size_t)t * cols, xs + (size_t)t * nb);
            y[(size_t)t * rows + r] = o4[0];
        }
    }
}

int cpu_matmul(void *vctx, const bk_weight *w, const float *x, int32_t T, float *y) {
    cpu_ctx *ctx = vctx;
    const int64_t cols = w->cols, nb = cols / 32;
    /* Per-token block sums of x (a function of each activation row alone). */
    float *xs = malloc(sizeof(float) * (size_t)T * (size_t)(nb ? nb : 1));
    if (!xs) return -1;
    const int fused = ctx->avx2 && w->type != BK_W_I4G32; /* fused dots need no block sums */
    for (int32_t t = 0; t < T && !fused; t++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0;
            for (int i = 0; i < 32; i++) s += x[(size_t)t * cols + b * 32 + i];
            xs[(size_t)t * nb + b] = s;
        }
    mm_job j = {ctx, w, x, xs, y, T, 0};
    tpool_run(ctx->pool, mm_rows, &j, w->rows, 16);
    free(xs);
    return j.fail ? -1 : 0;
}
