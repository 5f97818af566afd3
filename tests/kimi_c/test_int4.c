/*
 * test_int4.c (kimi_c_int4): specd's compressed-tensors int4 (BK_W_I4G32)
 * dequantization equals compressed-tensors' own, bit for bit
 * (tests/fixtures/kimi/int4_dequant.json: 9 expert rows of the seed-0
 * miniature dequantized by PackedQuantizationCompressor.decompress, bf16).
 *   - bk_weight_row_f32 on the fixture's packed words and scales gives exactly
 *     the bf16 values (as f32 bit patterns); the fixture must contain values
 *     where f32 q*scale differs from bf16(q*scale), so the rounding is tested;
 *   - the regenerated miniature's tensors hold the fixture's words and scales,
 *     and the backend matmul (AVX2 and portable kernels) on the whole packed
 *     expert against the identity returns the same values: the packed weight
 *     the model uses is the reference's weight.
 */
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/backend/backend.h"
#include "engine/loader/safetensors.h"
#include "tests/kimi_c/kimi_c_util.h"

static json_t *g_fx;

static uint32_t f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

static void test_rows_vs_compressed_tensors(void **st) {
    (void)st;
    const json_t *rows = json_object_get(g_fx, "rows");
    size_t n_rounded = 0, n_vals = 0;
    for (size_t k = 0; k < json_array_size(rows); k++) {
        const json_t *r = json_array_get(rows, k);
        const json_t *pk = json_object_get(r, "packed_u32"), *sc = json_object_get(r, "scale_bf16_bits");
        const json_t *dq = json_object_get(r, "dequant_bf16_bits");
        const int cols = (int)json_integer_value(json_array_get(json_object_get(r, "shape"), 1));
        assert_int_equal(json_array_size(pk), cols / 8);
        uint32_t words[64];
        uint16_t scales[16];
        for (int j = 0; j < cols / 8; j++) words[j] = (uint32_t)json_integer_value(json_array_get(pk, (size_t)j));
        for (int j = 0; j < cols / 32; j++) scales[j] = (uint16_t)json_integer_value(json_array_get(sc, (size_t)j));
        bk_weight w = {.type = BK_W_I4G32, .rows = 1, .cols = cols, .data = words, .row_bytes = (size_t)cols / 2,
                       .scales = scales};
        float out[256];
        bk_weight_row_f32(&w, 0, out);
        const json_t *q = json_object_get(r, "q");
        for (int i = 0; i < cols; i++) {
            const uint32_t want = (uint32_t)json_integer_value(json_array_get(dq, (size_t)i)) << 16;
            assert_int_equal(f32_bits(out[i]), want);
            /* would keeping q*scale in f32 have differed? */
            uint32_t sb = (uint32_t)scales[i / 32] << 16;
            float s;
            memcpy(&s, &sb, 4);
            const float exact = s * (float)json_integer_value(json_array_get(q, (size_t)i));
            n_rounded += f32_bits(exact) != want;
            n_vals++;
        }
    }
    printf("kimi_c_int4: %zu values bit-identical to compressed-tensors; %zu of them need the bf16 rounding\n",
           n_vals, n_rounded);
    assert_true(n_rounded > 0);
}

static void check_matmul(backend *be, const st_model *st) {
    const json_t *rows = json_object_get(g_fx, "rows");
    for (size_t k = 0; k < json_array_size(rows); k++) {
        const json_t *r = json_array_get(rows, k);
        const char *name = json_string_value(json_object_get(r, "tensor"));
        char sname[256];
        snprintf(sname, sizeof sname, "%.*s_scale", (int)(strlen(name) - strlen("_packed")), name);
        const st_tensor *p = st_find(st, name), *s = st_find(st, sname);
        assert_non_null(p);
        assert_non_null(s);
        const int rows_n = (int)p->shape[0], cols = (int)p->shape[1] * 8, row = (int)json_integer_value(json_object_get(r, "row"));
        /* the checkpoint CI regenerated holds the fixture's words and scales */
        const json_t *pk = json_object_get(r, "packed_u32"), *sc = json_object_get(r, "scale_bf16_bits");
        for (int j = 0; j < cols / 8; j++) {
            uint32_t w;
            memcpy(&w, (const uint8_t *)p->data + ((size_t)row * cols / 8 + j) * 4, 4);
            assert_int_equal(w, (uint32_t)json_integer_value(json_array_get(pk, (size_t)j)));
        }
        for (int j = 0; j < cols / 32; j++) {
            uint16_t h;
            memcpy(&h, (const uint8_t *)s->data + ((size_t)row * cols / 32 + j) * 2, 2);
            assert_int_equal(h, (uint16_t)json_integer_value(json_array_get(sc, (size_t)j)));
        }
        /* y = I @ W^T: y[t][row] = W[row][t] */
        bk_weight w = {.type = BK_W_I4G32, .rows = rows_n, .cols = cols, .data = p->data,
                       .row_bytes = (size_t)cols / 2, .scales = s->data};
        float *x = calloc((size_t)cols * cols, sizeof(float)), *y = malloc(sizeof(float) * (size_t)cols * rows_n);
        for (int t = 0; t < cols; t++) x[(size_t)t * cols + t] = 1.0f;
        assert_int_equal(bk_matmul_f32(be, &w, x, cols, y), 0);
        const json_t *dq = json_object_get(r, "dequant_bf16_bits");
        for (int t = 0; t < cols; t++)
            assert_int_equal(f32_bits(y[(size_t)t * rows_n + row]),
                             (uint32_t)json_integer_value(json_array_get(dq, (size_t)t)) << 16);
        free(x);
        free(y);
    }
}

static void test_miniature_matmul(void **st) {
    (void)st;
    st_model *sm = NULL;
    specd_err err = {{0}};
    assert_int_equal(st_open(kc_mini_dir("k25"), &sm, &err), 0);
    backend *be = bk_cpu_create(2);
    check_matmul(be, sm);
    printf("kimi_c_int4: matmul (%s) on the packed experts == compressed-tensors\n", bk_cpu_describe(be));
    bk_cpu_destroy(be);
    setenv("SPECD_CPU_PORTABLE", "1", 1);
    be = bk_cpu_create(2);
    check_matmul(be, sm);
    printf("kimi_c_int4: matmul (%s) on the packed experts == compressed-tensors\n", bk_cpu_describe(be));
    bk_cpu_destroy(be);
    unsetenv("SPECD_CPU_PORTABLE");
    st_close(sm);
}

int main(void) {
    g_fx = kc_fixture("int4_dequant.json");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_vs_compressed_tensors),
        cmocka_unit_test(test_miniature_matmul),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    json_decref(g_fx);
    return rc;
}
