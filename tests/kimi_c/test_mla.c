/*
 * test_mla.c (kimi_c_mla): the two forms of MLA attention agree on the Kimi
 * miniature. Absorbed (attention on the latent cache, kv_b_proj folded into q
 * and into the output: what specd runs) vs naive (the latent decompressed
 * through kv_b_proj into per-head K/V). Asserts, for the 4 fixture prompts:
 * prefill logits at every position and 8 decode steps agree within 1e-5 x
 * max|logit| (f32 reassociation only); the naive form alone also meets the
 * transformers fixture (top-1, 2e-3); the naive form with two sequences in one
 * step is bit-identical to each alone (its scratch cache is per sequence).
 */
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/model/deepseek_v3.h"
#include "tests/kimi_c/kimi_c_util.h"

#define DECODE 8

static json_t *g_fx;
static model *g_m;
static backend *g_be;
static int V;

/* prefill + DECODE greedy steps in the current MLA form; rows [n + DECODE, V] */
static float *run_form(bool absorbed, const int32_t *ids, int n) {
    assert_int_equal(dsv3_set_mla_absorbed(g_m, absorbed), 0);
    float *lg = malloc(sizeof(float) * (size_t)(n + DECODE) * V);
    assert_int_equal(kc_run(g_m, 0, ids, n, 0, lg, NULL, 0, NULL, NULL), 0);
    for (int s = 0; s < DECODE; s++) {
        /* the same forced tokens in both forms: the prompt's own ids, cycled */
        int32_t t = ids[s % n];
        assert_int_equal(kc_run(g_m, 0, &t, 1, n + s, lg + (size_t)(n + s) * V, NULL, 0, NULL, NULL), 0);
    }
    return lg;
}

static void test_absorbed_equals_naive(void **st) {
    (void)st;
    const json_t *prompts = json_object_get(g_fx, "prompts");
    double worst = 0;
    for (size_t pi = 0; pi < json_array_size(prompts); pi++) {
        const json_t *pr = json_array_get(prompts, pi);
        int n;
        int32_t *ids = kc_ids(json_object_get(pr, "ids"), &n);
        float *a = run_form(true, ids, n), *b = run_form(false, ids, n);
        for (int p = 0; p < n + DECODE; p++) {
            const float *ra = a + (size_t)p * V, *rb = b + (size_t)p * V;
            double mx = 0, e = 0;
            for (int i = 0; i < V; i++) { mx = fmax(mx, fabs(ra[i])); e = fmax(e, fabs(ra[i] - rb[i])); }
            e /= mx;
            worst = fmax(worst, e);
            if (e > 1e-5) fprintf(stderr, "prompt %zu position %d: absorbed vs naive %.3g\n", pi, p, e);
            assert_true(e <= 1e-5);
            assert_int_equal(kc_argmax(ra, V), kc_argmax(rb, V));
        }
        /* the naive form against transformers too */
        const json_t *rows = json_object_get(pr, "logits");
        for (size_t k = 0; k < json_array_size(rows); k++) {
            const json_t *r = json_array_get(rows, k);
            const int p = (int)json_integer_value(json_object_get(r, "pos"));
            assert_int_equal(kc_argmax(b + (size_t)p * V, V), (int)json_integer_value(json_object_get(r, "top1")));
            const json_t *t5 = json_object_get(r, "top5_ids"), *t5v = json_object_get(r, "top5_logits");
            for (int j = 0; j < 5; j++) {
                const double d = fabs(b[(size_t)p * V + json_integer_value(json_array_get(t5, (size_t)j))] -
                                      json_number_value(json_array_get(t5v, (size_t)j)));
                assert_true(d <= 2e-3 * json_number_value(json_object_get(r, "max_abs_logit")));
            }
        }
        free(a); free(b); free(ids);
    }
    printf("kimi_c_mla: absorbed vs naive over 4 prompts (prefill + %d decode steps): worst %.3g of max|logit|\n",
           DECODE, worst);
    dsv3_set_mla_absorbed(g_m, true);
}

static void test_naive_two_sequences(void **st) {
    (void)st;
    const json_t *prompts = json_object_get(g_fx, "prompts");
    int n0, n1;
    int32_t *i0 = kc_ids(json_object_get(json_array_get(prompts, 1), "ids"), &n0);
    int32_t *i1 = kc_ids(json_object_get(json_array_get(prompts, 2), "ids"), &n1);
    dsv3_set_mla_absorbed(g_m, false);
    float *a0 = malloc(sizeof(float) * (size_t)n0 * V), *a1 = malloc(sizeof(float) * (size_t)n1 * V);
    assert_int_equal(kc_run(g_m, 0, i0, n0, 0, a0, NULL, 0, NULL, NULL), 0);
    assert_int_equal(kc_run(g_m, 1, i1, n1, 0, a1, NULL, 0, NULL, NULL), 0);
    /* both prompts in one step: seq 1 first, then seq 0 */
    const int n = n0 + n1;
    int32_t *tok = malloc(sizeof(int32_t) * n), *pos = malloc(sizeof(int32_t) * n), *seq = malloc(sizeof(int32_t) * n);
    int32_t *oi = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n1; i++) { tok[i] = i1[i]; pos[i] = i; seq[i] = 1; }
    for (int i = 0; i < n0; i++) { tok[n1 + i] = i0[i]; pos[n1 + i] = i; seq[n1 + i] = 0; }
    for (int i = 0; i < n; i++) oi[i] = i;
    const int32_t *bt[2] = {kc_block_table(0), kc_block_table(1)};
    float *lg = malloc(sizeof(float) * (size_t)n * V);
    model_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = 2, .block_tables = bt,
                     .n_out = n, .out_idx = oi, .logits = lg};
    specd_err err = {{0}};
    assert_int_equal(model_forward(g_m, &b, &err), 0);
    assert_memory_equal(lg, a1, sizeof(float) * (size_t)n1 * V);
    assert_memory_equal(lg + (size_t)n1 * V, a0, sizeof(float) * (size_t)n0 * V);
    dsv3_set_mla_absorbed(g_m, true);
    free(a0); free(a1); free(tok); free(pos); free(seq); free(oi); free(lg); free(i0); free(i1);
}

int main(void) {
    const char *dir = kc_mini_dir("k25");
    g_fx = kc_fixture("mini_logits.json");
    g_be = bk_cpu_create(0);
    g_m = kc_load(g_be, dir, 2);
    V = model_get_config(g_m)->vocab;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_absorbed_equals_naive),
        cmocka_unit_test(test_naive_two_sequences),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    model_destroy(g_m);
    bk_cpu_destroy(g_be);
    json_decref(g_fx);
    return rc;
}
