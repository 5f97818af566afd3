/*
 * cpu_matmul_avx512.c: the AVX-512 (F/BW/VL/DQ) row dots of the CPU matmul,
 * bit-identical to the AVX2 ones in cpu_matmul.c.
 *
 * Owns nothing; pure functions over caller buffers, called from mm_rows when
 * the backend chose the AVX-512 level (cpu_backend.c, CPUID + XGETBV).
 *
 * Why bit-identical, and how. Every AVX2 dot keeps two 8-lane f32
 * accumulators per token and updates them in a fixed alternation: plain and
 * I4G32 rows a += v0*x0, b += v1*x1, a += v2*x2, b += v3*x3 per 32 columns;
 * block rows a0 for even blocks, a1 for odd blocks. Here one zmm holds
 * [a | b] (or [a0 | a1]) and each 16-lane operation performs the two 8-lane
 * updates the AVX2 code performs one after the other on independent
 * accumulators, with the same f32 operands (same products, same scales), so
 * every lane sees the same sequence of roundings. The final sum is the AVX2
 * one, cpu_hsum8(lo + hi), plus the same scalar terms. The integer part
 * (vpmaddwd pair sums of int16 weights x int16 activations) is exact in
 * int32, so computing it over 32 columns at once changes nothing; to feed a
 * block pair's [P_even | P_odd] straight from two vpmaddwd, the activations
 * of a pair are stored [lo(even) | lo(odd) | hi(even) | hi(odd)]
 * (cpu512_pair_layout). tests/backend/test_matmul.c checks the identity for
 * every format, shape class and token count on an AVX-512 machine.
 *
 * Speed: per block pair and token the AVX2 integer dot issues 4 vpmaddwd,
 * 2 adds, 2 conversions, 2 scale multiplies and 2 FMAs; this one issues half
 * of each, and up to 8 tokens share one unpacked weight block (verify,
 * prefill) against 4 in AVX2.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "engine/backend/cpu_internal.h"

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define T512I __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"), always_inline))

void cpu512_pair_layout(int16_t *X, int64_t cols) {
    const int64_t nb = cols / 32;
    int16_t tmp[16];
    for (int64_t b = 0; b + 1 < nb; b += 2) {
        int16_t *p = X + b * 32; /* [lo(b) hi(b) lo(b+1) hi(b+1)] -> [lo(b) lo(b+1) hi(b) hi(b+1)] */
        memcpy(tmp, p + 16, sizeof tmp);
        memcpy(p + 16, p + 32, sizeof tmp);
        memcpy(p + 32, tmp, sizeof tmp);
    }
}

/* ------------------------------------------------ integer-activation dots */

/* Weights of blocks b and b+1 widened to int16: *wl = [lo(b) | lo(b+1)],
 * *wh = [hi(b) | hi(b+1)] (32 lanes each); *dv = [d(b) x 8 | d(b+1) x 8]
 * broadcast from cpu_fp16_f32 (loads, no shuffle-port conversions) and the
 * mins as the AVX2 iq_load computes them (Q4_0: m = -8 d). */
T512I static inline void iq_load_pair(fused_kind k, const uint8_t *w, int64_t b, __m512i *wl, __m512i *wh,
                                      __m512 *dv, float *m) {
    const int q41 = k == FK_Q4_1;
    const size_t bs = k == FK_Q8_0 ? 34 : q41 ? 20 : 18;
    const uint8_t *b0 = w + (size_t)b * bs, *b1 = b0 + bs;
    uint16_t h0, h1;
    memcpy(&h0, b0, 2);
    memcpy(&h1, b1, 2);
    const float *d0 = &cpu_fp16_f32[h0], *d1 = &cpu_fp16_f32[h1];
    *dv = _mm512_mask_blend_ps(0xff00, _mm512_broadcastss_ps(_mm_load_ss(d0)), _mm512_broadcastss_ps(_mm_load_ss(d1)));
    if (k == FK_Q8_0) {
        m[0] = m[1] = 0.0f;
        const __m256i lo = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(b0 + 2))),
            _mm_loadu_si128((const __m128i *)(const void *)(b1 + 2)), 1);
        const __m256i hi = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(b0 + 18))),
            _mm_loadu_si128((const __m128i *)(const void *)(b1 + 18)), 1);
        *wl = _mm512_cvtepi8_epi16(lo);
        *wh = _mm512_cvtepi8_epi16(hi);
        return;
    }
    if (q41) {
        memcpy(&h0, b0 + 2, 2);
        memcpy(&h1, b1 + 2, 2);
        m[0] = cpu_fp16_f32[h0];
        m[1] = cpu_fp16_f32[h1];
    } else {
        m[0] = -8.0f * *d0;
        m[1] = -8.0f * *d1;
    }
    const size_t qo = q41 ? 4 : 2;
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(b0 + qo))),
        _mm_loadu_si128((const __m128i *)(const void *)(b1 + qo)), 1);
    const __m256i mask = _mm256_set1_epi8(0x0f);
    *wl = _mm512_cvtepu8_epi16(_mm256_and_si256(raw, mask));
    *wh = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), mask));
}

/* The last block of a row with an odd block count, exactly the AVX2
 * IDOT_BLOCK on its even accumulator (standard [lo | hi] activation layout). */
T512I static inline __m256 idot_tail(fused_kind k, const uint8_t *w, int64_t b, const int16_t *xb, const float *s,
                                     __m256 acc, float *m) {
    __m256i w0, w1;
    const float *d;
    cpu_iq_load(k, w, b, &w0, &w1, &d, m);
    return cpu_iq_fma(w0, w1, _mm256_broadcast_ss(d), xb, s, acc);
}

/* The extended variant (AVX-512 VBMI + VNNI: Ice Lake, Zen 4 and later; used
 * when ctx->avx512x) widens a Q4_0 / Q4_1 block pair from one masked 64-byte
 * load: one vpermb spreads the 32 nibble bytes to 16-bit lanes (low nibble =
 * column i, high nibble = column 16 + i, as iq_load_pair's vectors), another
 * gathers the fp16 d (and m) into a vector converted exactly by vcvtph2ps
 * (the same f32 values as the cpu_fp16_f32 table), and vpdpwssd adds the
 * second half's pair sums (exact int32, as vpmaddwd + vpaddd). Q8_0 keeps
 * iq_load_pair. */
#define T512X __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512vnni,avx2,fma,f16c")))
#define T512XI                                                                                                     \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512vnni,avx2,fma,f16c"), always_inline))

/* iq_load_pair for Q4_0 / Q4_1 with VBMI; the same *wl, *wh, *dv and m[0..1]. */
T512XI static inline void iq_load_pair_x(fused_kind k, const uint8_t *w, int64_t b, __m512i *wl, __m512i *wh,
                                         __m512 *dv, float *m) {
    if (k == FK_Q8_0) { iq_load_pair(k, w, b, wl, wh, dv, m); return; }
    const int q41 = k == FK_Q4_1;
    const int bs = q41 ? 20 : 18; /* block bytes; the nibbles start at byte 4 (Q4_1) or 2 (Q4_0) */
    /* the pair's 2 * bs bytes; masked so the last pair of a matrix reads nothing past it */
    const __m512i raw = _mm512_maskz_loadu_epi8((1ull << (2 * bs)) - 1, w + (size_t)b * (size_t)bs);
    /* byte 2i of the result <- nibble byte i of the pair (i < 16: block b, else block b + 1), odd bytes 0 */
    const __m512i spread_idx =
        q41 ? _mm512_set_epi8(0, 39, 0, 38, 0, 37, 0, 36, 0, 35, 0, 34, 0, 33, 0, 32, 0, 31, 0, 30, 0, 29, 0, 28, 0,
                              27, 0, 26, 0, 25, 0, 24, 0, 19, 0, 18, 0, 17, 0, 16, 0, 15, 0, 14, 0, 13, 0, 12, 0, 11,
                              0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4)
            : _mm512_set_epi8(0, 35, 0, 34, 0, 33, 0, 32, 0, 31, 0, 30, 0, 29, 0, 28, 0, 27, 0, 26, 0, 25, 0, 24, 0,
                              23, 0, 22, 0, 21, 0, 20, 0, 17, 0, 16, 0, 15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9,
                              0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2);
    const __m512i spread = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, spread_idx, raw);
    *wl = _mm512_and_si512(spread, _mm512_set1_epi16(0x0f));
    *wh = _mm512_srli_epi16(spread, 4);
    /* fp16 words [d(b), d(b+1), m(b), m(b+1)] (Q4_0: the two d twice) -> f32 */
    const __m512i dm_idx = _mm512_castsi128_si512(
        q41 ? _mm_setr_epi8(0, 1, 20, 21, 2, 3, 22, 23, 0, 0, 0, 0, 0, 0, 0, 0)
            : _mm_setr_epi8(0, 1, 18, 19, 0, 1, 18, 19, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m128 dm = _mm_cvtph_ps(_mm512_castsi512_si128(_mm512_maskz_permutexvar_epi8(0xff, dm_idx, raw)));
    *dv = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                _mm512_castps128_ps512(dm));
    if (q41) _mm_storeh_pi((__m64 *)(void *)m, dm);
    else _mm_storel_pi((__m64 *)(void *)m, _mm_mul_ps(_mm_set1_ps(-8.0f), dm)); /* -8 * d, as iq_load_pair */
}

/* The pair sums of a block pair: standard (vpmaddwd + vpaddd) and VNNI. */
T512I static inline __m512i psum_std(__m512i wl, __m512i wh, __m512i xl, __m512i xh) {
    return _mm512_add_epi32(_mm512_madd_epi16(wl, xl), _mm512_madd_epi16(wh, xh));
}
T512XI static inline __m512i psum_x(__m512i wl, __m512i wh, __m512i xl, __m512i xh) {
    return _mm512_dpwssd_epi32(_mm512_madd_epi16(wl, xl), wh, xh);
}

/* One row, NT tokens. Per chunk of IDOT_CHUNK blocks: the block pairs into
 * acc = [a0 | a1], an odd last block into a0 (after every pair, as in AVX2,
 * where it is also the row's last block), then the chunk's m-terms into the
 * 8-lane am and the scalar mt exactly as AVX2 does. LOAD_PAIR / PSUM pick the
 * standard or the VBMI + VNNI variant (same values). */
#define DEF_IDOT_N(NAME, ATTR, LOAD_PAIR, PSUM)                                                                    \
    ATTR static inline void NAME(fused_kind K, const int NT, const uint8_t *w, int64_t cols, const xq_rows *xq,   \
                                 int32_t t0, float *out) {                                                         \
        const int64_t nb = cols / 32;                                                                              \
        __m512 acc[CPU512_MAX_NT];                                                                                 \
        __m256 am[CPU512_MAX_NT], tail[CPU512_MAX_NT];                                                             \
        float mt[CPU512_MAX_NT], mb[IDOT_CHUNK];                                                                   \
        int has_tail = 0;                                                                                          \
        CPU_UNROLL for (int u = 0; u < NT; u++) {                                                                             \
            acc[u] = _mm512_setzero_ps();                                                                          \
            am[u] = tail[u] = _mm256_setzero_ps();                                                                 \
            mt[u] = 0.0f;                                                                                          \
        }                                                                                                          \
        for (int64_t c0 = 0; c0 < nb; c0 += IDOT_CHUNK) {                                                          \
            const int64_t c1 = nb - c0 < IDOT_CHUNK ? nb : c0 + IDOT_CHUNK;                                       \
            int64_t b = c0;                                                                                        \
            for (; b + 1 < c1; b += 2) {                                                                           \
                __m512i wl, wh;                                                                                    \
                __m512 dv;                                                                                         \
                LOAD_PAIR(K, w, b, &wl, &wh, &dv, &mb[b - c0]);                                                    \
                CPU_UNROLL for (int u = 0; u < NT; u++) {                                                                     \
                    const int16_t *xb = xq->X + (size_t)(t0 + u) * (size_t)cols + b * 32;                          \
                    const size_t sb = (size_t)(t0 + u) * (size_t)nb + (size_t)b;                                   \
                    const __m512i p = PSUM(wl, wh, _mm512_loadu_si512((const void *)xb),                           \
                                           _mm512_loadu_si512((const void *)(xb + 32)));                           \
                    const __m512 sc = _mm512_mul_ps(dv, _mm512_loadu_ps(xq->s + 8 * sb));                          \
                    acc[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[u]);                                   \
                }                                                                                                  \
            }                                                                                                      \
            if (b < c1) { /* only at the row's end: c1 == nb, nb odd */                                            \
                has_tail = 1;                                                                                      \
                CPU_UNROLL for (int u = 0; u < NT; u++) {                                                                     \
                    const int16_t *xb = xq->X + (size_t)(t0 + u) * (size_t)cols + b * 32;                          \
                    const size_t sb = (size_t)(t0 + u) * (size_t)nb + (size_t)b;                                   \
                    /* a0 is complete here except for this block: fold it in last */                               \
                    tail[u] = idot_tail(K, w, b, xb, xq->s + 8 * sb, _mm512_castps512_ps256(acc[u]), &mb[b - c0]); \
                }                                                                                                  \
            }                                                                                                      \
            if (K == FK_Q8_0) continue;                                                                            \
            CPU_UNROLL for (int u = 0; u < NT; u++) {                                                                         \
                const float *xsum = xq->sum + (size_t)(t0 + u) * (size_t)nb + c0;                                  \
                int64_t i = 0;                                                                                     \
                for (; i + 8 <= c1 - c0; i += 8)                                                                   \
                    am[u] = _mm256_fmadd_ps(_mm256_loadu_ps(mb + i), _mm256_loadu_ps(xsum + i), am[u]);            \
                for (; i < c1 - c0; i++) mt[u] += mb[i] * xsum[i];                                                 \
            }                                                                                                      \
        }                                                                                                          \
        CPU_UNROLL for (int u = 0; u < NT; u++) {                                                                             \
            const __m256 a0 = has_tail ? tail[u] : _mm512_castps512_ps256(acc[u]);                                 \
            const __m256 a1 = _mm512_extractf32x8_ps(acc[u], 1);                                                   \
            out[u] = cpu_hsum8(_mm256_add_ps(a0, a1)) + (cpu_hsum8(am[u]) + mt[u]);                                \
        }                                                                                                          \
    }
DEF_IDOT_N(idot_n_std, T512I, iq_load_pair, psum_std)
DEF_IDOT_N(idot_n_x, T512XI, iq_load_pair_x, psum_x)

#define DEF_IDOT512(NT, K)                                                                                         \
    T512 static void idot512_##NT##_##K(const uint8_t *w, int64_t cols, const xq_rows *xq, int32_t t0, float *o) { \
        idot_n_std(K, NT, w, cols, xq, t0, o);                                                                     \
    }                                                                                                              \
    T512X static void idotx_##NT##_##K(const uint8_t *w, int64_t cols, const xq_rows *xq, int32_t t0, float *o) {  \
        idot_n_x(K, NT, w, cols, xq, t0, o);                                                                       \
    }
#define DEF_IDOT512_K(K)                                                                                           \
    DEF_IDOT512(1, K) DEF_IDOT512(2, K) DEF_IDOT512(3, K) DEF_IDOT512(4, K) DEF_IDOT512(5, K) DEF_IDOT512(6, K)   \
        DEF_IDOT512(7, K) DEF_IDOT512(8, K)
DEF_IDOT512_K(FK_Q8_0)
DEF_IDOT512_K(FK_Q4_0)
DEF_IDOT512_K(FK_Q4_1)

typedef void (*idot512_fn)(const uint8_t *w, int64_t cols, const xq_rows *xq, int32_t t0, float *o);
#define IDOT512_ROW(P, K) {P##_1_##K, P##_2_##K, P##_3_##K, P##_4_##K, P##_5_##K, P##_6_##K, P##_7_##K, P##_8_##K}
static const idot512_fn IDOT512[2][3][CPU512_MAX_NT] = {
    {IDOT512_ROW(idot512, FK_Q8_0), IDOT512_ROW(idot512, FK_Q4_0), IDOT512_ROW(idot512, FK_Q4_1)},
    {IDOT512_ROW(idotx, FK_Q8_0), IDOT512_ROW(idotx, FK_Q4_0), IDOT512_ROW(idotx, FK_Q4_1)}};

void cpu512_idot(int ext, fused_kind kind, int nt, const uint8_t *w, int64_t cols, const xq_rows *xq, int32_t t0,
                 float *out) {
    IDOT512[ext != 0][kind][nt - 1](w, cols, xq, t0, out);
}

/* ------------------------------------------- several rows, several tokens
 * A verify step (k + 1 tokens of one sequence) or a small batch runs idot_n
 * once per row: each row's pass has a single weight stream with nothing to
 * overlap its loads (perf: ~20% of the 4-token kernel's samples sat on the
 * weight load), reloads every token's activations and scales for every row,
 * and pays the row's prologue and epilogue (four horizontal sums, the
 * m-terms) over only 9 block pairs (576 columns). These kernels take NR rows
 * x NT tokens per pass: per (row, token) exactly idot_n's operations in
 * idot_n's order on the same values (so the same bits as NT = 1, NR = 1),
 * the NR rows' weights unpacked once per block pair, each token's
 * activations and scales loaded once per block pair for the NR rows, and the
 * next row group's weights prefetched. out[u * ldo + r]: token t0 + u, row r.
 */
#define DEF_IDOT_RN(NAME, ATTR, LOAD_PAIR, PSUM)                                                                   \
    ATTR static inline void NAME(fused_kind K, const int NR, const int NT, const uint8_t *w, size_t row_bytes,     \
                                 int64_t cols, const xq_rows *xq, int32_t t0, float *out, size_t ldo) {           \
        const int64_t nb = cols / 32;                                                                              \
        const size_t bs = K == FK_Q8_0 ? 34 : K == FK_Q4_1 ? 20 : 18;                                             \
        __m512 acc[CPU512_RN_MAX_NR][CPU512_MAX_NT];                                                               \
        __m256 am[CPU512_RN_MAX_NR][CPU512_MAX_NT], tail[CPU512_RN_MAX_NR][CPU512_MAX_NT];                         \
        float mt[CPU512_RN_MAX_NR][CPU512_MAX_NT], mb[CPU512_RN_MAX_NR][IDOT_CHUNK];                               \
        int has_tail = 0;                                                                                          \
        CPU_UNROLL for (int r = 0; r < NR; r++) CPU_UNROLL for (int u = 0; u < NT; u++) {                          \
                acc[r][u] = _mm512_setzero_ps();                                                                   \
                am[r][u] = tail[r][u] = _mm256_setzero_ps();                                                       \
                mt[r][u] = 0.0f;                                                                                   \
            }                                                                                                      \
        for (int64_t c0 = 0; c0 < nb; c0 += IDOT_CHUNK) {                                                          \
            const int64_t c1 = nb - c0 < IDOT_CHUNK ? nb : c0 + IDOT_CHUNK;                                       \
            int64_t b = c0;                                                                                        \
            for (; b + 1 < c1; b += 2) {                                                                           \
                __m512i wl[CPU512_RN_MAX_NR], wh[CPU512_RN_MAX_NR];                                                \
                __m512 dv[CPU512_RN_MAX_NR];                                                                       \
                CPU_UNROLL for (int r = 0; r < NR; r++) {                                                          \
                    const uint8_t *wr = w + (size_t)r * row_bytes;                                                 \
                    _mm_prefetch((const char *)(wr + (size_t)NR * row_bytes + (size_t)b * bs), _MM_HINT_T0);       \
                    LOAD_PAIR(K, wr, b, &wl[r], &wh[r], &dv[r], &mb[r][b - c0]);                                   \
                }                                                                                                  \
                CPU_UNROLL for (int u = 0; u < NT; u++) {                                                          \
                    const int16_t *xb = xq->X + (size_t)(t0 + u) * (size_t)cols + b * 32;                          \
                    const size_t sb = (size_t)(t0 + u) * (size_t)nb + (size_t)b;                                   \
                    const __m512i xl = _mm512_loadu_si512((const void *)xb),                                       \
                                  xh = _mm512_loadu_si512((const void *)(xb + 32));                                \
                    const __m512 sv = _mm512_loadu_ps(xq->s + 8 * sb);                                             \
                    CPU_UNROLL for (int r = 0; r < NR; r++) {                                                      \
                        const __m512i p = PSUM(wl[r], wh[r], xl, xh);                                              \
                        acc[r][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dv[r], sv), acc[r][u]);  \
                    }                                                                                              \
                }                                                                                                  \
            }                                                                                                      \
            if (b < c1) { /* only at the row's end: c1 == nb, nb odd */                                            \
                has_tail = 1;                                                                                      \
                CPU_UNROLL for (int r = 0; r < NR; r++) CPU_UNROLL for (int u = 0; u < NT; u++) {                  \
                        const int16_t *xb = xq->X + (size_t)(t0 + u) * (size_t)cols + b * 32;                      \
                        const size_t sb = (size_t)(t0 + u) * (size_t)nb + (size_t)b;                               \
                        tail[r][u] = idot_tail(K, w + (size_t)r * row_bytes, b, xb, xq->s + 8 * sb,               \
                                               _mm512_castps512_ps256(acc[r][u]), &mb[r][b - c0]);                 \
                    }                                                                                              \
            }                                                                                                      \
            if (K == FK_Q8_0) continue;                                                                            \
            CPU_UNROLL for (int r = 0; r < NR; r++) CPU_UNROLL for (int u = 0; u < NT; u++) {                      \
                    const float *xsum = xq->sum + (size_t)(t0 + u) * (size_t)nb + c0;                              \
                    int64_t i = 0;                                                                                 \
                    for (; i + 8 <= c1 - c0; i += 8)                                                               \
                        am[r][u] = _mm256_fmadd_ps(_mm256_loadu_ps(mb[r] + i), _mm256_loadu_ps(xsum + i), am[r][u]); \
                    for (; i < c1 - c0; i++) mt[r][u] += mb[r][i] * xsum[i];                                       \
                }                                                                                                  \
        }                                                                                                          \
        CPU_UNROLL for (int r = 0; r < NR; r++) CPU_UNROLL for (int u = 0; u < NT; u++) {                          \
                const __m256 a0 = has_tail ? tail[r][u] : _mm512_castps512_ps256(acc[r][u]);                       \
                const __m256 a1 = _mm512_extractf32x8_ps(acc[r][u], 1);                                            \
                out[(size_t)u * ldo + (size_t)r] = cpu_hsum8(_mm256_add_ps(a0, a1)) + (cpu_hsum8(am[r][u]) + mt[r][u]); \
            }                                                                                                      \
    }
DEF_IDOT_RN(idot_rn_std, T512I, iq_load_pair, psum_std)
DEF_IDOT_RN(idot_rn_x, T512XI, iq_load_pair_x, psum_x)

#define DEF_IDOTRN512(NR, NT, K)                                                                                   \
    T512 static void idotrn512_##NR##_##NT##_##K(const uint8_t *w, size_t rb, int64_t cols, const xq_rows *xq,     \
                                                 int32_t t0, float *o, size_t ldo) {                               \
        idot_rn_std(K, NR, NT, w, rb, cols, xq, t0, o, ldo);                                                       \
    }                                                                                                              \
    T512X static void idotrnx_##NR##_##NT##_##K(const uint8_t *w, size_t rb, int64_t cols, const xq_rows *xq,      \
                                                int32_t t0, float *o, size_t ldo) {                                \
        idot_rn_x(K, NR, NT, w, rb, cols, xq, t0, o, ldo);                                                         \
    }
#define DEF_IDOTRN512_NT(NR, K)                                                                                    \
    DEF_IDOTRN512(NR, 2, K) DEF_IDOTRN512(NR, 3, K) DEF_IDOTRN512(NR, 4, K) DEF_IDOTRN512(NR, 5, K)               \
        DEF_IDOTRN512(NR, 6, K) DEF_IDOTRN512(NR, 7, K) DEF_IDOTRN512(NR, 8, K)
DEF_IDOTRN512_NT(2, FK_Q8_0)
DEF_IDOTRN512_NT(2, FK_Q4_0)
DEF_IDOTRN512_NT(2, FK_Q4_1)
DEF_IDOTRN512(3, 2, FK_Q8_0) DEF_IDOTRN512(3, 3, FK_Q8_0)
DEF_IDOTRN512(3, 2, FK_Q4_0) DEF_IDOTRN512(3, 3, FK_Q4_0)
DEF_IDOTRN512(3, 2, FK_Q4_1) DEF_IDOTRN512(3, 3, FK_Q4_1)

typedef void (*idotrn512_fn)(const uint8_t *w, size_t rb, int64_t cols, const xq_rows *xq, int32_t t0, float *o,
                             size_t ldo);
#define IDOTRN_ROW2(P, K)                                                                                          \
    {NULL, P##_2_2_##K, P##_2_3_##K, P##_2_4_##K, P##_2_5_##K, P##_2_6_##K, P##_2_7_##K, P##_2_8_##K}
#define IDOTRN_ROW3(P, K) {NULL, P##_3_2_##K, P##_3_3_##K, NULL, NULL, NULL, NULL, NULL}
static const idotrn512_fn IDOTRN512[2][2][3][CPU512_MAX_NT] = {
    {{IDOTRN_ROW2(idotrn512, FK_Q8_0), IDOTRN_ROW2(idotrn512, FK_Q4_0), IDOTRN_ROW2(idotrn512, FK_Q4_1)},
     {IDOTRN_ROW2(idotrnx, FK_Q8_0), IDOTRN_ROW2(idotrnx, FK_Q4_0), IDOTRN_ROW2(idotrnx, FK_Q4_1)}},
    {{IDOTRN_ROW3(idotrn512, FK_Q8_0), IDOTRN_ROW3(idotrn512, FK_Q4_0), IDOTRN_ROW3(idotrn512, FK_Q4_1)},
     {IDOTRN_ROW3(idotrnx, FK_Q8_0), IDOTRN_ROW3(idotrnx, FK_Q4_0), IDOTRN_ROW3(idotrnx, FK_Q4_1)}}};

void cpu512_idot_rn(int ext, fused_kind kind, int nr, int nt, const uint8_t *w, size_t row_bytes, int64_t cols,
                    const xq_rows *xq, int32_t t0, float *out, size_t ldo) {
    IDOTRN512[nr - 2][ext != 0][kind][nt - 1](w, row_bytes, cols, xq, t0, out, ldo);
}

/* ------------------------------------------------ one token, several rows
 * A decode step (and the LM head of any step with one output) has one
 * token: idot_n then runs a single FMA chain per row and waits on each
 * row's first weight load. These kernels dot NR (1..4) consecutive rows
 * with one token instead: per row the operations of idot_n for NT = 1, in
 * the same order on the same values (so the same bits), the rows
 * interleaved so their chains and loads overlap, the token's activations
 * and scales loaded once per block pair for all rows, and the next row
 * group's weights prefetched (NR rows ahead, same column).
 */
/* NR rows w + r * row_bytes of one token t (see above); LOAD_PAIR / PSUM pick the variant. */
#define DEF_IDOT_ROWS(NAME, ATTR, LOAD_PAIR, PSUM)                                                                 \
    ATTR static inline void NAME(fused_kind K, const int NR, const uint8_t *w, size_t row_bytes, int64_t cols,    \
                                 const xq_rows *xq, int32_t t, float *out) {                                       \
        const int64_t nb = cols / 32;                                                                              \
        const size_t bs = K == FK_Q8_0 ? 34 : K == FK_Q4_1 ? 20 : 18;                                             \
        __m512 acc[4];                                                                                             \
        __m256 am[4], tail[4];                                                                                     \
        float mt[4], mb[4][IDOT_CHUNK];                                                                            \
        int has_tail = 0;                                                                                          \
        const int16_t *X = xq->X + (size_t)t * (size_t)cols;                                                       \
        const float *S = xq->s + (size_t)t * (size_t)nb * 8;                                                       \
        CPU_UNROLL for (int r = 0; r < NR; r++) {                                                                  \
            acc[r] = _mm512_setzero_ps();                                                                          \
            am[r] = tail[r] = _mm256_setzero_ps();                                                                 \
            mt[r] = 0.0f;                                                                                          \
        }                                                                                                          \
        for (int64_t c0 = 0; c0 < nb; c0 += IDOT_CHUNK) {                                                          \
            const int64_t c1 = nb - c0 < IDOT_CHUNK ? nb : c0 + IDOT_CHUNK;                                       \
            int64_t b = c0;                                                                                        \
            for (; b + 1 < c1; b += 2) {                                                                           \
                const __m512i xl = _mm512_loadu_si512((const void *)(X + b * 32)),                                 \
                              xh = _mm512_loadu_si512((const void *)(X + b * 32 + 32));                            \
                const __m512 sv = _mm512_loadu_ps(S + 8 * b);                                                      \
                CPU_UNROLL for (int r = 0; r < NR; r++) {                                                          \
                    const uint8_t *wr = w + (size_t)r * row_bytes;                                                 \
                    _mm_prefetch((const char *)(wr + (size_t)NR * row_bytes + (size_t)b * bs), _MM_HINT_T0);       \
                    __m512i wl, wh;                                                                                \
                    __m512 dv;                                                                                     \
                    LOAD_PAIR(K, wr, b, &wl, &wh, &dv, &mb[r][b - c0]);                                            \
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(PSUM(wl, wh, xl, xh)), _mm512_mul_ps(dv, sv),      \
                                             acc[r]);                                                              \
                }                                                                                                  \
            }                                                                                                      \
            if (b < c1) { /* only at the row's end: c1 == nb, nb odd */                                            \
                has_tail = 1;                                                                                      \
                CPU_UNROLL for (int r = 0; r < NR; r++)                                                            \
                    tail[r] = idot_tail(K, w + (size_t)r * row_bytes, b, X + b * 32, S + 8 * b,                    \
                                        _mm512_castps512_ps256(acc[r]), &mb[r][b - c0]);                           \
            }                                                                                                      \
            if (K == FK_Q8_0) continue;                                                                            \
            const float *xsum = xq->sum + (size_t)t * (size_t)nb + c0;                                             \
            CPU_UNROLL for (int r = 0; r < NR; r++) {                                                              \
                int64_t i = 0;                                                                                     \
                for (; i + 8 <= c1 - c0; i += 8)                                                                   \
                    am[r] = _mm256_fmadd_ps(_mm256_loadu_ps(mb[r] + i), _mm256_loadu_ps(xsum + i), am[r]);         \
                for (; i < c1 - c0; i++) mt[r] += mb[r][i] * xsum[i];                                              \
            }                                                                                                      \
        }                                                                                                          \
        CPU_UNROLL for (int r = 0; r < NR; r++) {                                                                  \
            const __m256 a0 = has_tail ? tail[r] : _mm512_castps512_ps256(acc[r]);                                 \
            const __m256 a1 = _mm512_extractf32x8_ps(acc[r], 1);                                                   \
            out[r] = cpu_hsum8(_mm256_add_ps(a0, a1)) + (cpu_hsum8(am[r]) + mt[r]);                                \
        }                                                                                                          \
    }
DEF_IDOT_ROWS(idot_rows_std, T512I, iq_load_pair, psum_std)
DEF_IDOT_ROWS(idot_rows_x, T512XI, iq_load_pair_x, psum_x)

#define DEF_IDOTR512(NR, K)                                                                                        \
    T512 static void idotr512_##NR##_##K(const uint8_t *w, size_t rb, int64_t cols, const xq_rows *xq, int32_t t, \
                                         float *o) {                                                               \
        idot_rows_std(K, NR, w, rb, cols, xq, t, o);                                                               \
    }                                                                                                              \
    T512X static void idotrx_##NR##_##K(const uint8_t *w, size_t rb, int64_t cols, const xq_rows *xq, int32_t t,  \
                                        float *o) {                                                                \
        idot_rows_x(K, NR, w, rb, cols, xq, t, o);                                                                 \
    }
#define DEF_IDOTR512_K(K) DEF_IDOTR512(1, K) DEF_IDOTR512(2, K) DEF_IDOTR512(3, K) DEF_IDOTR512(4, K)
DEF_IDOTR512_K(FK_Q8_0)
DEF_IDOTR512_K(FK_Q4_0)
DEF_IDOTR512_K(FK_Q4_1)

typedef void (*idotr512_fn)(const uint8_t *w, size_t rb, int64_t cols, const xq_rows *xq, int32_t t, float *o);
#define IDOTR_ROW(P, K) {P##_1_##K, P##_2_##K, P##_3_##K, P##_4_##K}
static const idotr512_fn IDOTR512[2][3][4] = {
    {IDOTR_ROW(idotr512, FK_Q8_0), IDOTR_ROW(idotr512, FK_Q4_0), IDOTR_ROW(idotr512, FK_Q4_1)},
    {IDOTR_ROW(idotrx, FK_Q8_0), IDOTR_ROW(idotrx, FK_Q4_0), IDOTR_ROW(idotrx, FK_Q4_1)}};

void cpu512_idot_rows(int ext, fused_kind kind, int nr, const uint8_t *w, size_t row_bytes, int64_t cols,
                      const xq_rows *xq, int32_t t, float *out) {
    IDOTR512[ext != 0][kind][nr - 1](w, row_bytes, cols, xq, t, out);
}

/* ------------------------------------------------------ plain-row dots */

/* 16 values of a plain row from column c, converted to f32 in registers. */
T512I static inline __m512 plain_load16(fused_kind k, const uint8_t *w, int64_t c) {
    switch (k) {
    case FK_F32: return _mm512_loadu_ps((const float *)(const void *)w + c);
    case FK_BF16: {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)(w + 2 * (size_t)c));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    default: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(w + 2 * (size_t)c)));
    }
}

T512I static inline void fdot_n(fused_kind K, const int NT, const uint8_t *w, int64_t n, const float *x, size_t ldx,
                                float *out) {
    __m512 acc[CPU512_MAX_NT];
    for (int u = 0; u < NT; u++) acc[u] = _mm512_setzero_ps();
    const int64_t nb = n / 32;
    for (int64_t b = 0; b < nb; b++) {
        const __m512 v01 = plain_load16(K, w, b * 32), v23 = plain_load16(K, w, b * 32 + 16);
        for (int u = 0; u < NT; u++) {
            const float *xb = x + (size_t)u * ldx + b * 32;
            acc[u] = _mm512_fmadd_ps(v01, _mm512_loadu_ps(xb), acc[u]);
            acc[u] = _mm512_fmadd_ps(v23, _mm512_loadu_ps(xb + 16), acc[u]);
        }
    }
    for (int u = 0; u < NT; u++) {
        float s = cpu_hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[u]), _mm512_extractf32x8_ps(acc[u], 1)));
        for (int64_t i = nb * 32; i < n; i++) s += cpu_plain_at(K, w, i) * x[(size_t)u * ldx + i];
        out[u] = s;
    }
}

#define DEF_FDOT512(NT, K)                                                                                         \
    T512 static void fdot512_##NT##_##K(const uint8_t *w, int64_t n, const float *x, size_t ldx, float *o) {       \
        fdot_n(K, NT, w, n, x, ldx, o);                                                                            \
    }
#define DEF_FDOT512_K(K)                                                                                           \
    DEF_FDOT512(1, K) DEF_FDOT512(2, K) DEF_FDOT512(3, K) DEF_FDOT512(4, K) DEF_FDOT512(5, K) DEF_FDOT512(6, K)   \
        DEF_FDOT512(7, K) DEF_FDOT512(8, K)
DEF_FDOT512_K(FK_F32)
DEF_FDOT512_K(FK_BF16)
DEF_FDOT512_K(FK_F16)

typedef void (*fdot512_fn)(const uint8_t *w, int64_t n, const float *x, size_t ldx, float *o);
#define FDOT512_ROW(K)                                                                                             \
    {fdot512_1_##K, fdot512_2_##K, fdot512_3_##K, fdot512_4_##K,                                                   \
     fdot512_5_##K, fdot512_6_##K, fdot512_7_##K, fdot512_8_##K}
static const fdot512_fn FDOT512[3][CPU512_MAX_NT] = {FDOT512_ROW(FK_F32), FDOT512_ROW(FK_BF16),
                                                     FDOT512_ROW(FK_F16)};

void cpu512_fdot(fused_kind kind, int nt, const uint8_t *w, int64_t n, const float *x, size_t ldx, float *out) {
    FDOT512[kind - FK_F32][nt - 1](w, n, x, ldx, out);
}

/* ---------------------------------------------------------- I4G32 dots
 * Per group: the 16 weights bf16((q) * s), q = -8..7, in one zmm (the AVX2
 * kernel's two 8-lane tables side by side: the same products, the same
 * round-to-nearest-even on the bits), indexed directly by the stored nibble
 * (value + 8). Words 0,1 and 2,3 of the group give [v0 | v1] and [v2 | v3]. */

T512I static inline __m512 bf16_round16(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u)));
}

T512I static inline __m512 i4_words16(uint32_t w0, uint32_t w1, __m512 lut) {
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i words = _mm512_inserti64x4(_mm512_set1_epi32((int)w0), _mm256_set1_epi32((int)w1), 1);
    const __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(0xf));
    return _mm512_permutexvar_ps(idx, lut);
}

T512I static inline void i4dot_n(const int NT, const uint8_t *w, const uint8_t *sc, int64_t n, const float *x,
                                 size_t ldx, float *out) {
    __m512 acc[CPU512_MAX_NT];
    for (int u = 0; u < NT; u++) acc[u] = _mm512_setzero_ps();
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g = 0; g < n / 32; g++) {
        uint16_t s16;
        memcpy(&s16, sc + 2 * g, 2);
        const __m512 lut = bf16_round16(_mm512_mul_ps(q, _mm512_set1_ps(cpu_bf16_to_f32(s16))));
        uint32_t word[4];
        memcpy(word, w + 16 * g, 16);
        const __m512 v01 = i4_words16(word[0], word[1], lut), v23 = i4_words16(word[2], word[3], lut);
        for (int u = 0; u < NT; u++) {
            const float *xb = x + (size_t)u * ldx + g * 32;
            acc[u] = _mm512_fmadd_ps(v01, _mm512_loadu_ps(xb), acc[u]);
            acc[u] = _mm512_fmadd_ps(v23, _mm512_loadu_ps(xb + 16), acc[u]);
        }
    }
    for (int u = 0; u < NT; u++)
        out[u] = cpu_hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[u]), _mm512_extractf32x8_ps(acc[u], 1)));
}

#define DEF_I4DOT512(NT)                                                                                           \
    T512 static void i4dot512_##NT(const uint8_t *w, const uint8_t *sc, int64_t n, const float *x, size_t ldx,     \
                                   float *o) {                                                                     \
        i4dot_n(NT, w, sc, n, x, ldx, o);                                                                          \
    }
DEF_I4DOT512(1)
DEF_I4DOT512(2)
DEF_I4DOT512(3)
DEF_I4DOT512(4)
DEF_I4DOT512(5)
DEF_I4DOT512(6)
DEF_I4DOT512(7)
DEF_I4DOT512(8)

typedef void (*i4dot512_fn)(const uint8_t *w, const uint8_t *sc, int64_t n, const float *x, size_t ldx, float *o);
static const i4dot512_fn I4DOT512[CPU512_MAX_NT] = {i4dot512_1, i4dot512_2, i4dot512_3, i4dot512_4,
                                                    i4dot512_5, i4dot512_6, i4dot512_7, i4dot512_8};

void cpu512_i4dot(int nt, const uint8_t *w, const uint8_t *sc, int64_t n, const float *x, size_t ldx, float *out) {
    I4DOT512[nt - 1](w, sc, n, x, ldx, out);
}
