/*
 * test_matmul.c: bk_ops.matmul for every weight format against a double-
 * precision reference that dequantizes the blocks itself, from the format
 * specs (ggml-quants.h block layouts: Q8_0 v = d*q, Q4_0 v = d*(q-8), Q4_1
 * v = d*q + m, low nibbles = columns 0..15; compressed-tensors pack_to_int32
 * for I4G32: 8 nibbles per int32, lowest first, value + 8, v = bf16(q * s)).
 * It does not call bk_weight_row_f32.
 *
 * Tolerances are the analytic error bounds of each path:
 *   plain rows (f32/bf16/f16) and I4G32: f32 accumulation,
 *     |y - ref| <= 1e-5 * sum|w x| + 1e-30;
 *   block rows (Q8_0/Q4_x) on the AVX2 path: int16 activations (rounding
 *     error <= max|x| of the 32-block / 65534 per element) plus f32
 *     accumulation, |y - ref| <= sum_i |w_i| * bmax(i) / 65534 + 1e-5 * sum|w x|.
 * A wrong nibble order, scale or offset misses these by orders of magnitude.
 * Batch invariance: y of a token is bit-identical alone (also over 34..36
 * rows, so the one-token kernels' 4-row groups end in every size), inside a
 * batch of 11 at any index, and with 1 or 3 threads. On a CPU with AVX-512
 * the AVX-512 kernels' outputs equal the AVX2 kernels' bit for bit, with
 * (avx512, where the CPU has VBMI + VNNI) and without (avx512base) the
 * extended one-token kernels (elsewhere those cases are skipped, saying so). Non-finite activations give
 * non-finite outputs, zero activations exact zeros.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/backend/backend.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}
static float frand(void) { return (float)((rnd() & 0xffffff) / 16777216.0 * 2.0 - 1.0); }

/* normal fp16 numbers only (the generator makes no others) */
static double half_val(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = ldexp(1.0 + m / 1024.0, e - 15);
    return (h & 0x8000) ? -v : v;
}
static uint16_t rand_half(int sign) { /* |v| in [2^-8, 2^-1) */
    return (uint16_t)((sign && (rnd() & 1) ? 0x8000 : 0) | ((uint16_t)(7 + rnd() % 7) << 10) | (rnd() & 0x3ff));
}
static double bf16_val(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static float round_bf16(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &b, 4);
    return x;
}

typedef struct wmat {
    bk_weight w;
    uint8_t *data, *scales;
    double *deq; /* [rows][cols] reference values */
} wmat;

static void make_weight(wmat *m, bk_wtype type, int64_t rows, int64_t cols) {
    memset(m, 0, sizeof *m);
    size_t rb = 0;
    switch (type) {
    case BK_W_F32: rb = 4 * (size_t)cols; break;
    case BK_W_BF16: case BK_W_F16: rb = 2 * (size_t)cols; break;
    case BK_W_Q8_0: rb = 34 * (size_t)(cols / 32); break;
    case BK_W_Q4_0: rb = 18 * (size_t)(cols / 32); break;
    case BK_W_Q4_1: rb = 20 * (size_t)(cols / 32); break;
    case BK_W_I4G32: rb = 4 * (size_t)(cols / 8); break;
    }
    m->data = malloc(rb * (size_t)rows);
    m->deq = malloc(sizeof(double) * (size_t)(rows * cols));
    if (type == BK_W_I4G32) m->scales = malloc(2 * (size_t)(rows * cols / 32));
    assert_non_null(m->data);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *p = m->data + (size_t)r * rb;
        double *v = m->deq + r * cols;
        for (int64_t c = 0; c < cols; c++) {
            if (type == BK_W_F32) { float f = frand(); memcpy(p + 4 * c, &f, 4); v[c] = f; }
            else if (type == BK_W_BF16) { uint16_t h = (uint16_t)(0x3c00 + (rnd() % 0x400)) | (rnd() & 1 ? 0x8000 : 0); memcpy(p + 2 * c, &h, 2); v[c] = bf16_val(h); }
            else if (type == BK_W_F16) { uint16_t h = rand_half(1); memcpy(p + 2 * c, &h, 2); v[c] = half_val(h); }
        }
        if (type == BK_W_Q8_0 || type == BK_W_Q4_0 || type == BK_W_Q4_1)
            for (int64_t b = 0; b < cols / 32; b++) {
                const size_t bs = type == BK_W_Q8_0 ? 34 : type == BK_W_Q4_0 ? 18 : 20;
                uint8_t *blk = p + b * bs;
                uint16_t d = rand_half(0), mn = rand_half(1);
                memcpy(blk, &d, 2);
                if (type == BK_W_Q4_1) memcpy(blk + 2, &mn, 2);
                if (type == BK_W_Q8_0) {
                    for (int i = 0; i < 32; i++) {
                        int8_t q = (int8_t)(rnd() % 255 - 127);
                        if (r == 0 && b == 0 && i == 0) q = -128; /* the format allows it */
                        blk[2 + i] = (uint8_t)q;
                        v[b * 32 + i] = half_val(d) * q;
                    }
                } else {
                    uint8_t *qs = blk + (type == BK_W_Q4_1 ? 4 : 2);
                    for (int i = 0; i < 16; i++) {
                        qs[i] = (uint8_t)rnd();
                        int lo = qs[i] & 0xf, hi = qs[i] >> 4;
                        if (type == BK_W_Q4_0) {
                            v[b * 32 + i] = half_val(d) * (lo - 8);
                            v[b * 32 + 16 + i] = half_val(d) * (hi - 8);
                        } else {
                            v[b * 32 + i] = half_val(d) * lo + half_val(mn);
                            v[b * 32 + 16 + i] = half_val(d) * hi + half_val(mn);
                        }
                    }
                }
            }
        if (type == BK_W_I4G32) {
            uint8_t *sc = m->scales + (size_t)r * (size_t)(cols / 32) * 2;
            for (int64_t g = 0; g < cols / 32; g++) {
                uint16_t s = (uint16_t)(0x3b80 + rnd() % 0x200); /* bf16 ~ 2^-8 .. 2^-6 */
                memcpy(sc + 2 * g, &s, 2);
            }
            for (int64_t j = 0; j < cols / 8; j++) {
                uint32_t word = rnd() ^ (rnd() << 16);
                memcpy(p + 4 * j, &word, 4);
                for (int i = 0; i < 8; i++) {
                    int64_t c = 8 * j + i;
                    uint16_t s16;
                    memcpy(&s16, sc + 2 * (c / 32), 2);
                    int q = (int)((word >> (4 * i)) & 0xf) - 8;
                    v[c] = round_bf16((float)bf16_val(s16) * (float)q);
                }
            }
        }
    }
    m->w = (bk_weight){.type = type, .rows = rows, .cols = cols, .data = m->data, .row_bytes = rb,
                       .scales = m->scales};
}
static void free_weight(wmat *m) { free(m->data); free(m->scales); free(m->deq); }

static int is_block(bk_wtype t) { return t == BK_W_Q8_0 || t == BK_W_Q4_0 || t == BK_W_Q4_1; }

/* y[T][rows] vs the reference with the path's analytic bound. */
static void check_close(const wmat *m, const float *x, int32_t T, const float *y, int int_act) {
    const int64_t rows = m->w.rows, cols = m->w.cols;
    for (int32_t t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * cols;
        for (int64_t r = 0; r < rows; r++) {
            double ref = 0, mag = 0, qerr = 0;
            for (int64_t c = 0; c < cols; c++) {
                const double wv = m->deq[r * cols + c];
                ref += wv * xt[c];
                mag += fabs(wv * xt[c]);
                if (int_act) {
                    double bmax = 0;
                    for (int64_t i = c / 32 * 32; i < c / 32 * 32 + 32; i++) bmax = fmax(bmax, fabs(xt[i]));
                    qerr += fabs(wv) * bmax / 65534.0;
                }
            }
            const double tol = qerr + 1e-5 * mag + 1e-30, got = y[(size_t)t * rows + r];
            if (!(fabs(got - ref) <= tol))
                fail_msg("type %d T %d t %d row %lld: got %.9g ref %.9g |diff| %.3g > tol %.3g", (int)m->w.type,
                         T, t, (long long)r, got, ref, fabs(got - ref), tol);
        }
    }
}

/* avx512base: AVX-512 F/BW/VL/DQ without the VBMI + VNNI one-token kernels (avx512 uses them where the
 * CPU has them) */
typedef enum { ISA_PORTABLE, ISA_AVX2, ISA_AVX512BASE, ISA_AVX512 } isa_level;
static const char *const ISA_NAME[] = {"portable", "avx2", "avx512base", "avx512"};

static backend *create_isa(isa_level isa, int threads) {
    setenv("SPECD_CPU_ISA", ISA_NAME[isa], 1);
    backend *b = bk_cpu_create(threads);
    unsetenv("SPECD_CPU_ISA");
    assert_non_null(b);
    return b;
}

static void run_format(bk_wtype type, isa_level isa) {
    backend *b1 = create_isa(isa, 1), *b3 = create_isa(isa, 3);
    const char *desc = bk_cpu_describe(b1);
    const int avx2 = strstr(desc, "avx2") != NULL, avx512 = strstr(desc, "avx512") != NULL;
    if ((isa == ISA_AVX2 && !avx2) || (isa >= ISA_AVX512BASE && !avx512)) {
        print_message("this CPU has no %s (backend: %s): the %s kernels are not tested here\n", ISA_NAME[isa], desc,
                      ISA_NAME[isa]);
        bk_cpu_destroy(b1);
        bk_cpu_destroy(b3);
        skip();
    }
    if (isa < ISA_AVX512BASE) assert_null(strstr(desc, "avx512")); /* the cap holds */
    if (isa == ISA_AVX512BASE) assert_null(strstr(desc, "vbmi"));
    if (isa == ISA_AVX512 && !strstr(desc, "vbmi"))
        print_message("this CPU has no AVX-512 VBMI + VNNI (backend: %s): avx512 runs the avx512base kernels\n", desc);
    if (isa == ISA_PORTABLE) assert_null(strstr(desc, "avx2"));
    /* the AVX2 backend the AVX-512 results must equal bit for bit */
    backend *ref2 = isa >= ISA_AVX512BASE ? create_isa(ISA_AVX2, 1) : NULL;
    /* 10 blocks (even count), 11 (odd: a tail block), 71 (more than one 64-block chunk, odd), 128 (two
     * full chunks, no tail), 137 (a third chunk of 9 blocks with a tail), and for plain rows 100 columns
     * (a 4-column scalar tail) */
    const int64_t rows = 37, ncols[6] = {320, 352, 2272, 4096, 4384, 100};
    const int npass = (type == BK_W_F32 || type == BK_W_BF16 || type == BK_W_F16) ? 6 : 5;
    for (int pass = 0; pass < npass; pass++) {
        const int64_t C = ncols[pass];
        wmat m;
        make_weight(&m, type, rows, C);
        enum { T = 11 }; /* > 8: a full 8-token AVX-512 group plus a partial one */
        float *x = malloc(sizeof(float) * T * (size_t)C), *y = malloc(sizeof(float) * T * (size_t)rows),
              *y1 = malloc(sizeof(float) * (size_t)rows), *y3 = malloc(sizeof(float) * T * (size_t)rows);
        for (int64_t i = 0; i < T * C; i++) x[i] = frand();
        for (int64_t i = 0; i < C; i += 32) x[2 * C + i + 5] = 300.0f; /* token 2: an outlier per block */
        for (int64_t i = 0; i < C; i++) x[4 * C + i] *= 1e-6f;           /* token 4: tiny activations */
        assert_int_equal(bk_matmul_f32(b1, &m.w, x, T, y), 0);
        check_close(&m, x, T, y, is_block(type) && isa != ISA_PORTABLE);
        if (ref2) { /* AVX-512 == AVX2, every token, bit for bit */
            assert_int_equal(bk_matmul_f32(ref2, &m.w, x, T, y3), 0);
            for (int64_t i = 0; i < T * rows; i++)
                if (memcmp(&y[i], &y3[i], sizeof(float)))
                    fail_msg("type %d cols %lld token %lld row %lld: avx512 %.9g != avx2 %.9g", (int)type,
                             (long long)C, (long long)(i / rows), (long long)(i % rows), y[i], y3[i]);
        }
        /* batch invariance: alone, 3 threads, every batch size */
        for (int32_t t = 0; t < T; t++) {
            assert_int_equal(bk_matmul_f32(b1, &m.w, x + (size_t)t * C, 1, y1), 0);
            assert_memory_equal(y1, y + (size_t)t * rows, sizeof(float) * (size_t)rows);
        }
        /* one token over 34..36 rows: the one-token kernels' groups of 4 rows end in 2, 3 and 4 rows too */
        for (int64_t nr = rows - 3; nr < rows; nr++) {
            bk_weight sub = m.w;
            sub.rows = nr;
            assert_int_equal(bk_matmul_f32(b1, &sub, x + 3 * (size_t)C, 1, y1), 0);
            assert_memory_equal(y1, y + 3 * (size_t)rows, sizeof(float) * (size_t)nr);
        }
        assert_int_equal(bk_matmul_f32(b3, &m.w, x, T, y3), 0);
        assert_memory_equal(y3, y, sizeof(float) * T * (size_t)rows);
        for (int32_t n = 2; n <= T; n++) {
            assert_int_equal(bk_matmul_f32(b1, &m.w, x + (size_t)(T - n) * C, n, y3), 0);
            assert_memory_equal(y3, y + (size_t)(T - n) * rows, sizeof(float) * (size_t)n * (size_t)rows);
        }
        /* zeros give exact zeros; a NaN or an Inf in a token makes its outputs non-finite */
        memset(x, 0, sizeof(float) * (size_t)C);
        x[C + 7] = NAN;
        x[2 * C + C - 1] = INFINITY;
        assert_int_equal(bk_matmul_f32(b1, &m.w, x, 3, y), 0);
        if (ref2) { /* the same bits for zero / NaN / Inf inputs too */
            assert_int_equal(bk_matmul_f32(ref2, &m.w, x, 3, y3), 0);
            assert_memory_equal(y, y3, sizeof(float) * 3 * (size_t)rows);
        }
        for (int64_t r = 0; r < rows; r++) {
            assert_true(y[r] == 0.0f);
            assert_false(isfinite(y[rows + r]));
            assert_false(isfinite(y[2 * rows + r]));
        }
        free(x); free(y); free(y1); free(y3);
        free_weight(&m);
    }
    bk_cpu_destroy(b1);
    bk_cpu_destroy(b3);
    bk_cpu_destroy(ref2);
}

/* bk_matmul_n (q/k/v and gate/up in one call) == one matmul per weight, bit for bit: three weights of
 * 37, 16 and 5 rows (pool chunks of 16 rows spanning two weights), 1 and 3 tokens, 1 and 3 threads, and
 * a mix of formats with different activation paths (Q4_1 with F32: the per-weight fallback). */
static void run_matmul_n(isa_level isa) {
    const bk_wtype types[][3] = {{BK_W_Q4_1, BK_W_Q4_1, BK_W_Q4_1}, {BK_W_Q8_0, BK_W_Q8_0, BK_W_Q8_0},
                                 {BK_W_Q4_0, BK_W_Q4_0, BK_W_Q4_0}, {BK_W_F32, BK_W_F32, BK_W_F32},
                                 {BK_W_Q4_1, BK_W_F32, BK_W_Q8_0}};
    const int64_t rows[3] = {37, 16, 5}, C = 2272;
    for (int threads = 1; threads <= 3; threads += 2) {
        backend *b = create_isa(isa, threads);
        if (isa != ISA_PORTABLE && !strstr(bk_cpu_describe(b), isa == ISA_AVX2 ? "avx2" : "avx512")) {
            print_message("this CPU has no %s: skipped\n", ISA_NAME[isa]);
            bk_cpu_destroy(b);
            skip();
        }
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
            wmat m[3];
            float *x = malloc(sizeof(float) * 3 * (size_t)C), *y[3], *ref = malloc(sizeof(float) * 3 * 37);
            for (int64_t i = 0; i < 3 * C; i++) x[i] = frand();
            for (int k = 0; k < 3; k++) {
                make_weight(&m[k], types[ti][k], rows[k], C);
                y[k] = malloc(sizeof(float) * 3 * (size_t)rows[k]);
            }
            for (int32_t T = 1; T <= 3; T += 2) {
                const bk_weight *w[3] = {&m[0].w, &m[1].w, &m[2].w};
                bk_tensor xt = bk_wrap_f32(x, T, C), yt[3], *yp[3];
                for (int k = 0; k < 3; k++) yt[k] = bk_wrap_f32(y[k], T, rows[k]), yp[k] = &yt[k];
                assert_int_equal(bk_matmul_n(b, 3, w, &xt, yp), 0);
                for (int k = 0; k < 3; k++) {
                    assert_int_equal(bk_matmul_f32(b, w[k], x, T, ref), 0);
                    assert_memory_equal(ref, y[k], sizeof(float) * (size_t)T * (size_t)rows[k]);
                }
            }
            for (int k = 0; k < 3; k++) { free_weight(&m[k]); free(y[k]); }
            free(x); free(ref);
        }
        bk_cpu_destroy(b);
    }
}
static void test_matmul_n_avx512(void **s) { (void)s; run_matmul_n(ISA_AVX512); }
static void test_matmul_n_avx2(void **s) { (void)s; run_matmul_n(ISA_AVX2); }
static void test_matmul_n_portable(void **s) { (void)s; run_matmul_n(ISA_PORTABLE); }

/* Small M (a verify step of k + 1 tokens, a small batch): every row count 1..10 (so each rows-per-pass
 * group of the several-token kernels ends in every remainder) and M = 2..9 tokens (the 8-token groups,
 * 8k + 1 with a one-token last group), 1 and 2 threads: each token's outputs equal, bit for bit, the
 * same token alone (M = 1, the decode kernels), the AVX2 level's (the AVX-512 levels), and the
 * reference within the path's bound (check_close). The block formats and f32 rows. */
static void run_small_m(isa_level isa) {
    const bk_wtype types[] = {BK_W_Q4_1, BK_W_Q8_0, BK_W_Q4_0, BK_W_F32};
    /* SmolLM2's hidden size (18 blocks), 11 blocks (an odd tail), 65 blocks (a second IDOT_CHUNK of one odd
     * block: the chunk's m-terms and the tail after a full chunk) */
    const int64_t ncols[3] = {576, 352, 2080};
    backend *b[2] = {create_isa(isa, 1), create_isa(isa, 2)};
    if (isa != ISA_PORTABLE && !strstr(bk_cpu_describe(b[0]), isa == ISA_AVX2 ? "avx2" : "avx512")) {
        print_message("this CPU has no %s: skipped\n", ISA_NAME[isa]);
        bk_cpu_destroy(b[0]);
        bk_cpu_destroy(b[1]);
        skip();
    }
    backend *ref2 = isa >= ISA_AVX512BASE ? create_isa(ISA_AVX2, 1) : NULL;
    enum { MAXT = 9, MAXR = 10 };
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (int ci = 0; ci < 3; ci++) {
            const int64_t C = ncols[ci];
            wmat m;
            make_weight(&m, types[ti], MAXR, C);
            float *x = malloc(sizeof(float) * MAXT * (size_t)C), *y1 = malloc(sizeof(float) * MAXT * MAXR),
                  *y = malloc(sizeof(float) * MAXT * MAXR), *y2 = malloc(sizeof(float) * MAXT * MAXR);
            for (int64_t i = 0; i < MAXT * C; i++) x[i] = frand();
            for (int64_t i = 0; i < C; i += 32) x[3 * C + i + 9] = -250.0f; /* token 3: an outlier per block */
            for (int64_t rows = 1; rows <= MAXR; rows++) {
                bk_weight sub = m.w;
                sub.rows = rows;
                for (int32_t t = 0; t < MAXT; t++) /* M = 1: the decode kernels */
                    assert_int_equal(bk_matmul_f32(b[0], &sub, x + (size_t)t * C, 1, y1 + (size_t)t * rows), 0);
                for (int32_t M = 2; M <= MAXT; M++)
                    for (int th = 0; th < 2; th++) {
                        assert_int_equal(bk_matmul_f32(b[th], &sub, x, M, y), 0);
                        for (int64_t i = 0; i < M * rows; i++)
                            if (memcmp(&y[i], &y1[i], sizeof(float)))
                                fail_msg("%s type %d cols %lld rows %lld M %d threads %d token %lld row %lld: %.9g "
                                         "!= M = 1 %.9g",
                                         ISA_NAME[isa], (int)types[ti], (long long)C, (long long)rows, M, th + 1,
                                         (long long)(i / rows), (long long)(i % rows), y[i], y1[i]);
                    }
                if (ref2) { /* the AVX2 level at M = 4 (verify of 3 drafts) */
                    assert_int_equal(bk_matmul_f32(ref2, &sub, x, 4, y2), 0);
                    assert_memory_equal(y2, y1, sizeof(float) * 4 * (size_t)rows);
                }
            }
            /* the full 10 rows at M = 5 against the reference */
            assert_int_equal(bk_matmul_f32(b[0], &m.w, x, 5, y), 0);
            check_close(&m, x, 5, y, is_block(types[ti]) && isa != ISA_PORTABLE);
            free(x); free(y1); free(y); free(y2);
            free_weight(&m);
        }
    bk_cpu_destroy(b[0]);
    bk_cpu_destroy(b[1]);
    bk_cpu_destroy(ref2);
}
static void test_small_m_avx512(void **s) { (void)s; run_small_m(ISA_AVX512); }
static void test_small_m_avx512base(void **s) { (void)s; run_small_m(ISA_AVX512BASE); }
static void test_small_m_avx2(void **s) { (void)s; run_small_m(ISA_AVX2); }
static void test_small_m_portable(void **s) { (void)s; run_small_m(ISA_PORTABLE); }

#define FORMAT_TESTS(T)                                                                      \
    static void test_##T##_avx512(void **s) { (void)s; run_format(BK_W_##T, ISA_AVX512); }   \
    static void test_##T##_avx512base(void **s) { (void)s; run_format(BK_W_##T, ISA_AVX512BASE); } \
    static void test_##T##_avx2(void **s) { (void)s; run_format(BK_W_##T, ISA_AVX2); }       \
    static void test_##T##_portable(void **s) { (void)s; run_format(BK_W_##T, ISA_PORTABLE); }
FORMAT_TESTS(F32)
FORMAT_TESTS(BF16)
FORMAT_TESTS(F16)
FORMAT_TESTS(Q8_0)
FORMAT_TESTS(Q4_0)
FORMAT_TESTS(Q4_1)
FORMAT_TESTS(I4G32)

int main(void) {
    const struct CMUnitTest tests[] = {
#define T2(T)                                                                                                      \
    cmocka_unit_test(test_##T##_avx512), cmocka_unit_test(test_##T##_avx512base), cmocka_unit_test(test_##T##_avx2), \
        cmocka_unit_test(test_##T##_portable)
        T2(F32), T2(BF16), T2(F16), T2(Q8_0), T2(Q4_0), T2(Q4_1), T2(I4G32),
        cmocka_unit_test(test_matmul_n_avx512), cmocka_unit_test(test_matmul_n_avx2),
        cmocka_unit_test(test_matmul_n_portable),
        cmocka_unit_test(test_small_m_avx512), cmocka_unit_test(test_small_m_avx512base),
        cmocka_unit_test(test_small_m_avx2), cmocka_unit_test(test_small_m_portable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
