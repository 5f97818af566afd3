/*
 * test_model_logits.c: specd's SmolLM2 logits vs Hugging Face transformers
 * (fixture tests/fixtures/model/smollm2_ref.json from tools/gen_model_fixtures.py:
 * the same GGUF dequantized to float32 and run in float32).
 * Asserts, for every prompt and reference position: top-1 identical and
 * max |diff| <= 1e-3 * max|logit| over the stored ids; and the 64-token greedy
 * continuation (decoded one token per step through the paged cache) identical.
 */
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "tests/model/model_test_util.h"

static int argmax(const float *v, int n) {
    int b = 0;
    for (int i = 1; i < n; i++) if (v[i] > v[b]) b = i;
    return b;
}

static void test_logits_and_greedy(void **state) {
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/model/smollm2_ref.json", getenv("SPECD_SOURCE_DIR"));
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    assert_non_null(root);
    backend *be = bk_cpu_create(0);
    model *m = mt_load(be, 1);
    const int V = model_get_config(m)->vocab;
    json_t *prompts = json_object_get(root, "prompts");
    size_t pi;
    json_t *pr;
    json_array_foreach(prompts, pi, pr) {
        json_t *jids = json_object_get(pr, "ids");
        int n = (int)json_array_size(jids);
        int32_t *ids = malloc(sizeof(int32_t) * (n + 64)), *pos = malloc(sizeof(int32_t) * (n + 64));
        int32_t *seq = calloc(n + 64, sizeof(int32_t)), *outi = malloc(sizeof(int32_t) * n);
        for (int i = 0; i < n; i++) { ids[i] = (int32_t)json_integer_value(json_array_get(jids, i)); pos[i] = i; outi[i] = i; }
        float *logits = malloc(sizeof(float) * (size_t)n * V);
        const int32_t *bt[1] = {mt_block_table(0)};
        model_batch b = {.n_tokens = n, .tokens = ids, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = bt,
                         .n_out = n, .out_idx = outi, .logits = logits};
        specd_err err = {{0}};
        assert_int_equal(model_forward(m, &b, &err), 0);
        json_t *sel = json_object_get(pr, "sel");
        const char *key;
        json_t *s;
        json_object_foreach(sel, key, s) {
            int p = atoi(key);
            const float *row = logits + (size_t)p * V;
            double max_abs = json_real_value(json_object_get(s, "max_abs")), worst = 0;
            json_t *sid = json_object_get(s, "ids"), *sv = json_object_get(s, "vals");
            for (size_t k = 0; k < json_array_size(sid); k++) {
                int id = (int)json_integer_value(json_array_get(sid, k));
                double d = fabs(row[id] - json_real_value(json_array_get(sv, k)));
                if (d > worst) worst = d;
            }
            printf("prompt %zu pos %d: top1 %d (ref %lld), max|diff| %.3g (%.3g of max|logit| %.2f)\n", pi, p,
                   argmax(row, V), (long long)json_integer_value(json_object_get(s, "top1")), worst, worst / max_abs,
                   max_abs);
            assert_int_equal(argmax(row, V), json_integer_value(json_object_get(s, "top1")));
            assert_true(worst <= 1e-3 * max_abs);
        }
        /* greedy continuation, one token per step through the cache */
        json_t *g = json_object_get(pr, "greedy64");
        int next = argmax(logits + (size_t)(n - 1) * V, V);
        for (size_t k = 0; k < json_array_size(g); k++) {
            assert_int_equal(next, json_integer_value(json_array_get(g, k)));
            int32_t t1 = next, p1 = n + (int32_t)k, s1 = 0, o1 = 0;
            model_batch d = {.n_tokens = 1, .tokens = &t1, .pos = &p1, .seq_of = &s1, .n_seqs = 1, .block_tables = bt,
                             .n_out = 1, .out_idx = &o1, .logits = logits};
            assert_int_equal(model_forward(m, &d, &err), 0);
            next = argmax(logits, V);
        }
        free(ids); free(pos); free(seq); free(outi); free(logits);
    }
    model_destroy(m);
    bk_cpu_destroy(be);
    json_decref(root);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_logits_and_greedy)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
