/*
 * test_draft_spec_loop.c: the proposer contract of draft/eagle3.h driven by
 * a minimal greedy speculative loop written here (the engine's scheduler is
 * the real user; this is the smallest loop that exercises the same calls):
 *   prefill with aux capture -> extend(prompt, aux) + extend(sampled, NULL);
 *   each step: propose k -> verify [x_last, d_1..d_k] in one target pass with
 *   aux capture -> accept while the draft equals the target argmax -> bonus ->
 *   extend(accepted tokens + their aux) + extend(bonus, NULL).
 * The target's KV of rejected positions is simply overwritten next step.
 * Checked: the output equals plain greedy decoding token for token (k = 1
 * and 4; the random head accepts little, so this pins the bookkeeping, not
 * the speed-up), every proposed token is a valid target id inside t2d, and
 * the draft KV returns to the pool after free_seq.
 * Uses the first prompt of tests/fixtures/eagle3/capture_smollm2.json
 * (chat-templated token ids) and the random head spec_s1.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "draft/eagle3.h"
#include "tests/draft/draft_test_util.h"

#define GEN 12
#define MAXT 128

static backend *g_be;
static model *g_model;
static char g_dir[64];
static int32_t g_prompt[MAXT], g_np;
static int32_t g_table[8] = {0, 1, 2, 3, 4, 5, 6, 7};

static int32_t argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* One target pass over tokens[n] at positions pos0.. of sequence 0, logits
 * for all rows, aux (optional) for all rows. */
static void target(const int32_t *tokens, int32_t n, int32_t pos0, float *logits, const int32_t *aux_layers, float *aux) {
    int32_t pos[MAXT], seq[MAXT] = {0}, out[MAXT];
    for (int32_t i = 0; i < n; i++) pos[i] = pos0 + i, out[i] = i;
    const int32_t *tables[1] = {g_table};
    model_batch b = {.n_tokens = n, .tokens = tokens, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = tables,
                     .n_out = n, .out_idx = out, .logits = logits, .n_aux = aux ? 3 : 0, .aux_layers = aux_layers, .aux = aux};
    specd_err err = {{0}};
    if (model_forward(g_model, &b, &err) < 0) { fprintf(stderr, "%s\n", err.msg); fail(); }
}

static void plain_greedy(int32_t *out) {
    const int32_t V = model_get_config(g_model)->vocab;
    float *lg = malloc(sizeof(float) * (size_t)MAXT * V);
    target(g_prompt, g_np, 0, lg, NULL, NULL);
    int32_t x = argmax(lg + (size_t)(g_np - 1) * V, V);
    for (int i = 0; i < GEN; i++) {
        out[i] = x;
        target(&x, 1, g_np + i, lg, NULL, NULL);
        x = argmax(lg, V);
    }
    free(lg);
}

static void spec_greedy(int32_t k, const int32_t *ref) {
    const int32_t V = model_get_config(g_model)->vocab, H = model_get_config(g_model)->hidden;
    spec_proposer *sp = NULL;
    specd_err err = {{0}};
    eagle3_opts o = {.n_blocks = 16};
    if (eagle3_load(g_dir, g_model, &o, &sp, &err) < 0) { fprintf(stderr, "%s\n", err.msg); fail(); }
    int64_t total = 0, free0 = 0, free1 = 0;
    sp->ops->kv_usage(sp->ctx, &total, &free0);
    int32_t layers[8];
    assert_int_equal(sp->ops->aux_layers(sp->ctx, layers), 3);
    float *lg = malloc(sizeof(float) * (size_t)MAXT * V), *aux = malloc(sizeof(float) * (size_t)MAXT * 3 * H);
    /* prefill */
    target(g_prompt, g_np, 0, lg, layers, aux);
    int32_t x = argmax(lg + (size_t)(g_np - 1) * V, V);
    assert_int_equal(sp->ops->extend(sp->ctx, 1, g_prompt, g_np, 0, aux, &err), 0);
    assert_int_equal(sp->ops->extend(sp->ctx, 1, &x, 1, g_np, NULL, &err), 0);
    int32_t out[GEN + 8], n_out = 0, m = g_np, steps = 0, accepted = 0; /* x sits at position m */
    out[n_out++] = x;
    const uint8_t *keep = NULL;
    st_model *hs = NULL;
    assert_int_equal(st_open(g_dir, &hs, &err), 0);
    keep = st_find(hs, "t2d")->data;
    while (n_out < GEN) {
        int64_t id = 1;
        int32_t d[8], batch[9];
        float t0 = 0.0f;
        assert_int_equal(sp->ops->propose(sp->ctx, &id, &k, 1, k, &t0, d, NULL, &err), 0);
        batch[0] = x;
        for (int j = 0; j < k; j++) {
            assert_true(d[j] >= 0 && d[j] < V && keep[d[j]]);
            batch[1 + j] = d[j];
        }
        target(batch, k + 1, m, lg, layers, aux);
        int32_t a = 0;
        while (a < k && argmax(lg + (size_t)a * V, V) == d[a]) a++;
        int32_t bonus = argmax(lg + (size_t)a * V, V);
        steps++;
        accepted += a;
        assert_int_equal(sp->ops->extend(sp->ctx, 1, batch, a + 1, m, aux, &err), 0); /* x_m, d_1..d_a + features */
        assert_int_equal(sp->ops->extend(sp->ctx, 1, &bonus, 1, m + a + 1, NULL, &err), 0);
        for (int j = 0; j < a && n_out < GEN; j++) out[n_out++] = d[j];
        if (n_out < GEN) out[n_out++] = bonus;
        m += a + 1;
        x = bonus;
    }
    printf("k = %d: %d steps, %d drafts accepted, acceptance length %.2f\n", k, steps, accepted,
           1.0 + (double)accepted / steps);
    for (int i = 0; i < GEN; i++) assert_int_equal(out[i], ref[i]);
    sp->ops->free_seq(sp->ctx, 1);
    sp->ops->kv_usage(sp->ctx, &total, &free1);
    assert_int_equal(free1, free0);
    st_close(hs);
    free(lg), free(aux);
    eagle3_destroy(sp);
}

static void test_lossless_greedy(void **state) {
    (void)state;
    int32_t ref[GEN];
    plain_greedy(ref);
    spec_greedy(1, ref);
    spec_greedy(4, ref);
}

int main(void) {
    g_be = bk_cpu_create(0);
    g_model = dt_model(g_be, 8);
    char p[1024];
    snprintf(p, sizeof p, "%s/tests/fixtures/eagle3/capture_smollm2.json", dt_src());
    json_error_t je;
    json_t *cap = json_load_file(p, 0, &je);
    if (!cap) { fprintf(stderr, "%s: %s\n", p, je.text); return 1; }
    json_t *ids = json_object_get(json_array_get(json_object_get(cap, "prompts"), 0), "token_ids");
    g_np = (int32_t)json_array_size(ids);
    for (int32_t i = 0; i < g_np; i++) g_prompt[i] = (int32_t)json_integer_value(json_array_get(ids, (size_t)i));
    json_decref(cap);
    json_t *fx = dt_fixtures();
    dt_make_head(fx, "spec_s1", NULL, g_dir);
    json_decref(fx);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_lossless_greedy)};
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    dt_rm_head(g_dir);
    model_destroy(g_model);
    bk_cpu_destroy(g_be);
    return rc;
}
