/*
 * test_gguf_model.c: the GGUF reader on the real SmolLM2-135M-Instruct Q4_1
 * file ($SPECD_MODEL_GGUF; skipped with exit 77 when absent).
 *
 * Three independent references:
 *  - REFERENCE.md §4 (the model card numbers): 30 layers, hidden 576, 9
 *    heads, 3 kv heads, ffn 1536, vocab 49152, rope theta 100000, 272 tensors;
 *  - model_meta.txt: every key as read by gguf.GGUFReader (Python), incl.
 *    array lengths and the first/last element of each array;
 *  - model_cases.txt: rows of Q8_0 / Q4_1 / F32 tensors dequantized by
 *    gguf.quants.dequantize; ours must be bit-identical.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <inttypes.h>
#include <unistd.h>
#include <cmocka.h>

#include "engine/loader/gguf.h"
#include "loader/loader_test_util.h"

static gguf_file *g_f;

static int64_t geti(const char *key) {
    int64_t v = -1;
    specd_err err = {{0}};
    if (gguf_get_i64(g_f, key, &v, &err)) {
        print_error("%s\n", err.msg);
        fail();
    }
    return v;
}

static void test_reference_numbers(void **state) {
    (void)state;
    assert_int_equal(gguf_version(g_f), 3);
    assert_int_equal(gguf_n_tensors(g_f), 272);
    const char *s;
    size_t n;
    specd_err err = {{0}};
    assert_int_equal(gguf_get_str(g_f, "general.architecture", &s, &n, &err), 0);
    assert_int_equal(n, 5);
    assert_memory_equal(s, "llama", 5);
    assert_int_equal(geti("llama.block_count"), 30);
    assert_int_equal(geti("llama.embedding_length"), 576);
    assert_int_equal(geti("llama.attention.head_count"), 9);
    assert_int_equal(geti("llama.attention.head_count_kv"), 3);
    assert_int_equal(geti("llama.feed_forward_length"), 1536);
    assert_int_equal(geti("llama.context_length"), 8192);
    double theta, eps;
    assert_int_equal(gguf_get_f64(g_f, "llama.rope.freq_base", &theta, &err), 0);
    assert_true(theta == 100000.0);
    assert_int_equal(gguf_get_f64(g_f, "llama.attention.layer_norm_rms_epsilon", &eps, &err), 0);
    assert_true(fabs(eps - 1e-5) < 1e-10);
    const gguf_kv *tok = gguf_find_kv(g_f, "tokenizer.ggml.tokens");
    assert_non_null(tok);
    assert_int_equal(tok->arr_type, GGUF_VT_STRING);
    assert_int_equal(tok->arr_len, 49152);
    assert_int_equal(gguf_arr_str(tok, 1, &s, &n), 0);
    assert_int_equal(n, strlen("<|im_start|>"));
    assert_memory_equal(s, "<|im_start|>", n);
    const gguf_tensor *emb = gguf_find_tensor(g_f, "token_embd.weight");
    assert_non_null(emb);
    assert_int_equal(emb->type, GGML_TYPE_Q8_0);
    assert_int_equal(emb->ne[0], 576);
    assert_int_equal(emb->ne[1], 49152);
    const gguf_tensor *q = gguf_find_tensor(g_f, "blk.0.attn_q.weight");
    assert_non_null(q);
    assert_int_equal(q->type, GGML_TYPE_Q4_1);
    const gguf_tensor *k = gguf_find_tensor(g_f, "blk.29.attn_k.weight");
    assert_non_null(k);
    assert_int_equal(k->ne[0], 576);
    assert_int_equal(k->ne[1], 192);
    const gguf_tensor *norm = gguf_find_tensor(g_f, "output_norm.weight");
    assert_non_null(norm);
    assert_int_equal(norm->type, GGML_TYPE_F32);
    assert_null(gguf_find_tensor(g_f, "output.weight")); /* tied embeddings */
}

static int hexval(int c) { return c <= '9' ? c - '0' : (c | 32) - 'a' + 10; }

/* Compares string S (LEN bytes) with the hex text H ("-" = empty). */
static int hex_equal(const char *s, size_t len, const char *h) {
    if (strcmp(h, "-") == 0) return len == 0;
    if (strlen(h) != 2 * len) return 0;
    for (size_t i = 0; i < len; i++)
        if ((uint8_t)s[i] != (uint8_t)(hexval(h[2 * i]) * 16 + hexval(h[2 * i + 1]))) return 0;
    return 1;
}

static void test_metadata_vs_gguf_py(void **state) {
    (void)state;
    char *meta = fixture_read("model_meta.txt", NULL);
    assert_non_null(meta);
    size_t n_checked = 0;
    char *save = NULL;
    for (char *line = strtok_r(meta, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *fld[6] = {0};
        int nf = 0;
        for (char *p = line; nf < 6;) {
            fld[nf++] = p;
            char *tab = strchr(p, '\t');
            if (!tab) break;
            *tab = '\0';
            p = tab + 1;
        }
        assert_true(nf >= 3);
        const char *key = fld[0], *kind = fld[1], *val = fld[2];
        if (key[0] == '#') {
            uint64_t want = strtoull(val, NULL, 10);
            if (!strcmp(key, "#tensors")) assert_int_equal(gguf_n_tensors(g_f), want);
            else if (!strcmp(key, "#alignment")) assert_int_equal(gguf_alignment(g_f), want);
            else if (!strcmp(key, "#data_offset")) assert_int_equal(gguf_data_offset(g_f), want);
            n_checked++;
            continue;
        }
        const gguf_kv *kv = gguf_find_kv(g_f, key);
        if (!kv) {
            print_error("key %s missing\n", key);
            fail();
        }
        specd_err err = {{0}};
        if (!strcmp(kind, "int")) {
            int64_t v;
            assert_int_equal(gguf_get_i64(g_f, key, &v, &err), 0);
            assert_int_equal(v, strtoll(val, NULL, 10));
        } else if (!strcmp(kind, "float")) {
            double v;
            assert_int_equal(gguf_get_f64(g_f, key, &v, &err), 0);
            assert_true(v == strtod(val, NULL));
        } else if (!strcmp(kind, "bool")) {
            bool v;
            assert_int_equal(gguf_get_bool(g_f, key, &v, &err), 0);
            assert_int_equal(v, atoi(val));
        } else if (!strcmp(kind, "str")) {
            const char *s;
            size_t len;
            assert_int_equal(gguf_get_str(g_f, key, &s, &len, &err), 0);
            assert_true(hex_equal(s, len, val));
        } else if (!strncmp(kind, "arr:", 4)) {
            assert_int_equal(kv->type, GGUF_VT_ARRAY);
            uint64_t n = strtoull(val, NULL, 10);
            assert_int_equal(kv->arr_len, n);
            if (n > 0) {
                assert_true(nf >= 5);
                if (!strcmp(kind + 4, "STRING")) {
                    const char *s;
                    size_t len;
                    assert_int_equal(gguf_arr_str(kv, 0, &s, &len), 0);
                    assert_true(hex_equal(s, len, fld[3]));
                    assert_int_equal(gguf_arr_str(kv, n - 1, &s, &len), 0);
                    assert_true(hex_equal(s, len, fld[4]));
                } else if (!strcmp(kind + 4, "FLOAT32") || !strcmp(kind + 4, "FLOAT64")) {
                    double v;
                    assert_int_equal(gguf_arr_f64(kv, 0, &v), 0);
                    assert_true(v == strtod(fld[3], NULL));
                    assert_int_equal(gguf_arr_f64(kv, n - 1, &v), 0);
                    assert_true(v == strtod(fld[4], NULL));
                } else {
                    int64_t v;
                    assert_int_equal(gguf_arr_i64(kv, 0, &v), 0);
                    assert_int_equal(v, strtoll(fld[3], NULL, 10));
                    assert_int_equal(gguf_arr_i64(kv, n - 1, &v), 0);
                    assert_int_equal(v, strtoll(fld[4], NULL, 10));
                }
            }
        } else {
            print_error("unknown kind %s\n", kind);
            fail();
        }
        n_checked++;
    }
    /* the Python reader sees exactly the keys we see (+3 '#' lines) */
    assert_int_equal(n_checked, gguf_n_kv(g_f) + 3);
    free(meta);
}

static void test_rows_vs_gguf_py(void **state) {
    (void)state;
    char *cases = fixture_read("model_cases.txt", NULL);
    assert_non_null(cases);
    char name[128], file[256];
    unsigned long row, nrows;
    int used, n_cases = 0;
    const char *p = cases;
    while (sscanf(p, "%127s %lu %lu %255s%n", name, &row, &nrows, file, &used) == 4) {
        p += used;
        const gguf_tensor *t = gguf_find_tensor(g_f, name);
        assert_non_null(t);
        uint32_t be, bb;
        assert_int_equal(ggml_type_block(t->type, &be, &bb), 0);
        uint64_t row_bytes = t->ne[0] / be * bb;
        uint64_t n_rows_total = t->n_elements / t->ne[0];
        assert_true(row + nrows <= n_rows_total);
        size_t lf;
        float *exp = fixture_read(file, &lf);
        assert_non_null(exp);
        uint64_t n = nrows * t->ne[0];
        assert_int_equal(lf, n * 4);
        float *got = malloc(n * 4);
        assert_int_equal(ggml_dequantize(t->type, (const uint8_t *)t->data + row * row_bytes, got, n), 0);
        size_t bad = 0;
        for (uint64_t i = 0; i < n; i++)
            if (memcmp(&got[i], &exp[i], 4) != 0 && bad++ < 5)
                print_error("%s row %lu [%" PRIu64 "]: got %.9g want %.9g\n", name, row, i, got[i], exp[i]);
        assert_int_equal(bad, 0);
        free(got);
        free(exp);
        n_cases++;
    }
    assert_true(n_cases >= 8);
    free(cases);
}

/* Every tensor dequantizes (the whole model, ~135M floats, row by row). */
static void test_all_tensors_dequantize(void **state) {
    (void)state;
    float *row = malloc(49152 * sizeof(float));
    for (size_t i = 0; i < gguf_n_tensors(g_f); i++) {
        const gguf_tensor *t = gguf_tensor_at(g_f, i);
        uint32_t be, bb;
        assert_int_equal(ggml_type_block(t->type, &be, &bb), 0);
        uint64_t rb = t->ne[0] / be * bb, nr = t->n_elements / t->ne[0];
        assert_true(t->ne[0] <= 49152);
        for (uint64_t r = 0; r < nr; r++) {
            assert_int_equal(ggml_dequantize(t->type, (const uint8_t *)t->data + r * rb, row, t->ne[0]), 0);
            for (uint64_t j = 0; j < t->ne[0]; j++) assert_true(isfinite(row[j]));
        }
    }
    free(row);
}

int main(void) {
    const char *path = getenv("SPECD_MODEL_GGUF");
    if (!path || access(path, R_OK) != 0) {
        printf("skip: SPECD_MODEL_GGUF (%s) not readable; run tools/setup.sh\n", path ? path : "unset");
        return 77;
    }
    specd_err err = {{0}};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (gguf_open(path, &g_f, &err)) {
        printf("gguf_open failed: %s\n", err.msg);
        return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("gguf_open(%s): %.2f ms, %zu kvs, %zu tensors\n", path,
           (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6, gguf_n_kv(g_f), gguf_n_tensors(g_f));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference_numbers),
        cmocka_unit_test(test_metadata_vs_gguf_py),
        cmocka_unit_test(test_rows_vs_gguf_py),
        cmocka_unit_test(test_all_tensors_dequantize),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gguf_close(g_f);
    return rc;
}
