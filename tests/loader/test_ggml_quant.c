/*
 * test_ggml_quant.c: ggml_dequantize and the fp16/bf16 conversions against
 * the `gguf` Python package (fixtures from tools/gen_loader_fixtures.py).
 *
 * deq_cases.txt lists blocks of F16, BF16, Q4_0, Q4_1, Q8_0 (quantized from
 * seeded random data by gguf.quants.quantize) and Q4_K, Q6_K (random block
 * bytes with finite scales) together with gguf.quants.dequantize's float32
 * output; ours must match bit for bit (same float operations in the same
 * order). conv_*.bin: f32 inputs (edge cases, exact ties, random bit
 * patterns) with numpy's float16 cast and gguf's bf16 rounding as reference.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/loader/gguf.h"
#include "loader/loader_test_util.h"

static int bits_equal(float a, float b) { return memcmp(&a, &b, 4) == 0; }

static void test_geometry(void **state) {
    (void)state;
    struct { ggml_type t; uint32_t e, b; const char *name; } g[] = {
        {GGML_TYPE_F32, 1, 4, "F32"}, {GGML_TYPE_F16, 1, 2, "F16"}, {GGML_TYPE_BF16, 1, 2, "BF16"},
        {GGML_TYPE_Q4_0, 32, 18, "Q4_0"}, {GGML_TYPE_Q4_1, 32, 20, "Q4_1"}, {GGML_TYPE_Q8_0, 32, 34, "Q8_0"},
        {GGML_TYPE_Q4_K, 256, 144, "Q4_K"}, {GGML_TYPE_Q6_K, 256, 210, "Q6_K"},
    };
    for (size_t i = 0; i < sizeof g / sizeof g[0]; i++) {
        uint32_t e = 0, b = 0;
        assert_int_equal(ggml_type_block(g[i].t, &e, &b), 0);
        assert_int_equal(e, g[i].e);
        assert_int_equal(b, g[i].b);
        assert_string_equal(ggml_type_name(g[i].t), g[i].name);
    }
    assert_int_equal(ggml_type_block((ggml_type)6, NULL, NULL), -1);
    float out[32];
    uint8_t blk[34] = {0};
    assert_int_equal(ggml_dequantize(GGML_TYPE_Q8_0, blk, out, 31), -1);
    assert_int_equal(ggml_dequantize((ggml_type)99, blk, out, 32), -1);
}

static void test_dequant_vs_gguf_py(void **state) {
    (void)state;
    char *cases = fixture_read("deq_cases.txt", NULL);
    assert_non_null(cases);
    int n_cases = 0;
    char name[64];
    int type;
    unsigned long n;
    const char *p = cases;
    int used;
    while (sscanf(p, "%63s %d %lu%n", name, &type, &n, &used) == 3) {
        p += used;
        char fq[128], ff[128];
        snprintf(fq, sizeof fq, "deq_%s.q", name);
        snprintf(ff, sizeof ff, "deq_%s.f32", name);
        size_t lq, lf;
        uint8_t *q = fixture_read(fq, &lq);
        float *exp = fixture_read(ff, &lf);
        assert_non_null(q);
        assert_non_null(exp);
        assert_int_equal(lf, n * 4);
        uint32_t be, bb;
        assert_int_equal(ggml_type_block((ggml_type)type, &be, &bb), 0);
        assert_int_equal(lq, n / be * bb);
        float *got = malloc(n * 4);
        assert_int_equal(ggml_dequantize((ggml_type)type, q, got, n), 0);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) {
            if (!bits_equal(got[i], exp[i])) {
                if (bad++ < 5) print_error("%s[%zu]: got %.9g want %.9g\n", name, i, got[i], exp[i]);
            }
        }
        assert_int_equal(bad, 0);
        free(got);
        free(q);
        free(exp);
        n_cases++;
    }
    assert_int_equal(n_cases, 7); /* f16 bf16 q4_0 q4_1 q8_0 q4_k q6_k */
    free(cases);
}

static void test_conversions_vs_numpy(void **state) {
    (void)state;
    size_t nx, nh, nb;
    float *x = fixture_read("conv_f32.bin", &nx);
    uint16_t *h = fixture_read("conv_f16.bin", &nh);
    uint16_t *bf = fixture_read("conv_bf16.bin", &nb);
    assert_non_null(x);
    assert_non_null(h);
    assert_non_null(bf);
    nx /= 4;
    assert_int_equal(nh / 2, nx);
    assert_int_equal(nb / 2, nx);
    size_t bad = 0;
    for (size_t i = 0; i < nx; i++) {
        uint16_t g = specd_f32_to_fp16(x[i]);
        if (g != h[i] && bad++ < 5) print_error("fp16(%.9g): got 0x%04x want 0x%04x\n", x[i], g, h[i]);
        uint16_t gb = specd_f32_to_bf16(x[i]);
        if (gb != bf[i] && bad++ < 5) print_error("bf16(%.9g): got 0x%04x want 0x%04x\n", x[i], gb, bf[i]);
    }
    assert_int_equal(bad, 0);
    free(x);
    free(h);
    free(bf);
}

/* Every one of the 65536 half values: fp16 -> f32 -> fp16 is the identity
 * (NaNs stay NaN), and the f32 value is the IEEE one (checked against the
 * formula (-1)^s * 2^(e-15) * (1 + m/1024), computed in double). */
static void test_fp16_exhaustive(void **state) {
    (void)state;
    for (uint32_t u = 0; u < 65536; u++) {
        float f = specd_fp16_to_f32((uint16_t)u);
        uint32_t e = (u >> 10) & 31, m = u & 1023;
        double s = (u & 0x8000) ? -1.0 : 1.0;
        if (e == 31) {
            if (m == 0) assert_true(isinf(f) && (f < 0) == (s < 0));
            else assert_true(isnan(f));
            if (m == 0) assert_int_equal(specd_f32_to_fp16(f), u);
            else assert_true((specd_f32_to_fp16(f) & 0x7c00) == 0x7c00 && (specd_f32_to_fp16(f) & 0x3ff) != 0);
            continue;
        }
        double want = e == 0 ? s * ldexp((double)m, -24) : s * ldexp(1.0 + m / 1024.0, (int)e - 15);
        assert_true((double)f == want);
        assert_true(!!signbit(f) == !!signbit(s));
        assert_int_equal(specd_f32_to_fp16(f), u);
    }
    /* bf16: every pattern round-trips through f32 */
    for (uint32_t u = 0; u < 65536; u++) {
        float f = specd_bf16_to_f32((uint16_t)u);
        uint16_t back = specd_f32_to_bf16(f);
        if (isnan(f)) assert_true(isnan(specd_bf16_to_f32(back)));
        else assert_int_equal(back, u);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_geometry),
        cmocka_unit_test(test_dequant_vs_gguf_py),
        cmocka_unit_test(test_conversions_vs_numpy),
        cmocka_unit_test(test_fp16_exhaustive),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
