/*
 * test_draft_proposer.c: the EAGLE-3 proposer's state machine
 * (draft/eagle3_proposer.c, contract in draft/eagle3.h) on the real target
 * and the speculators-layout random head spec_s1 of the fixtures:
 *   - the draft state built incrementally, the way the engine feeds it
 *     (prefill, sampled token alone, verify with partial acceptance, bonus),
 *     proposes exactly what a one-shot extend proposes: same tokens and a
 *     bit-identical first-step q (speculative KV entries of the earlier chain
 *     must be overwritten by the real pairs);
 *   - several sequences in one propose call give what each gives alone;
 *   - a long prefill run in chunks (max_rows 4) equals one run;
 *   - truncate below the built entries + re-extend reproduces the proposal;
 *     a re-sent token that differs rolls the draft back;
 *   - sequences the draft cannot serve get -1, an exhausted KV pool cuts the
 *     chain where the blocks end, free_seq returns every block.
 * The first proposal is also pinned to the fixture's reference chain
 * (chain_target_ids), so "the same as one-shot" cannot be "the same wrong".
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "draft/eagle3.h"
#include "tests/draft/draft_test_util.h"

#define NT 12
#define FW (3 * 576)
#define KM 4

static backend *g_be;
static model *g_model;
static json_t *g_fx;
static float *g_feats;
static int32_t *g_ids;
static int32_t g_ref[KM];
static char g_dir[64];
static int32_t g_vt;

static spec_proposer *make(int32_t n_blocks, int32_t max_rows) {
    spec_proposer *sp = NULL;
    specd_err err = {{0}};
    eagle3_opts o = {.n_blocks = n_blocks, .max_rows = max_rows};
    if (eagle3_load(g_dir, g_model, &o, &sp, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        fail();
    }
    return sp;
}

static void extend(spec_proposer *sp, int64_t id, int32_t from, int32_t to, bool feats) {
    specd_err err = {{0}};
    int rc = sp->ops->extend(sp->ctx, id, g_ids + from, to - from, from, feats ? g_feats + (size_t)from * FW : NULL, &err);
    if (rc) fprintf(stderr, "extend: %s\n", err.msg);
    assert_int_equal(rc, 0);
}

/* Proposes k for each of n ids at temperature temp; tokens [n, KM], q [n, KM, Vt] (optional). */
static void propose(spec_proposer *sp, const int64_t *ids, const int32_t *k, int32_t n, float temp, int32_t *tok,
                    float *q) {
    specd_err err = {{0}};
    float temps[8];
    for (int i = 0; i < n; i++) temps[i] = temp;
    int rc = sp->ops->propose(sp->ctx, ids, k, n, KM, temps, tok, q, &err);
    if (rc) fprintf(stderr, "propose: %s\n", err.msg);
    assert_int_equal(rc, 0);
}

/* One-shot: prompt x_0..x_10 with features, then x_11 alone. */
static void one_shot(spec_proposer *sp, int64_t id) {
    extend(sp, id, 0, NT - 1, true);
    extend(sp, id, NT - 1, NT, false);
}

static void test_incremental_equals_one_shot(void **state) {
    (void)state;
    spec_proposer *sp = make(64, 0);
    int64_t a = 1, b = 2;
    int32_t k = KM, tok_a[KM], tok_b[KM];
    float *qa = malloc(sizeof(float) * KM * g_vt), *qb = malloc(sizeof(float) * KM * g_vt);
    one_shot(sp, a);
    propose(sp, &a, &k, 1, 0.0f, tok_a, NULL);
    for (int j = 0; j < KM; j++) assert_int_equal(tok_a[j], g_ref[j]);
    propose(sp, &a, &k, 1, 1.0f, tok_a, qa);
    /* b: prefill of 6 tokens, the sampled x_6 alone, a k=4 proposal (whose
     * speculative entries land at positions 6..8), then a verify of
     * [x_6, d_1, d_2] accepting 2 drafts (= x_7, x_8) with bonus x_9, another
     * proposal, then a verify accepting 1 with bonus x_11. */
    extend(sp, b, 0, 6, true);
    extend(sp, b, 6, 7, false);
    propose(sp, &b, &k, 1, 0.0f, tok_b, NULL);
    extend(sp, b, 6, 9, true);  /* x_6, x_7, x_8 and their features (x_6 re-sent, equal) */
    extend(sp, b, 9, 10, false);
    propose(sp, &b, &k, 1, 0.0f, tok_b, NULL);
    extend(sp, b, 9, 11, true);
    extend(sp, b, 11, 12, false);
    propose(sp, &b, &k, 1, 0.0f, tok_b, NULL);
    for (int j = 0; j < KM; j++) assert_int_equal(tok_b[j], g_ref[j]);
    propose(sp, &b, &k, 1, 1.0f, tok_b, qb);
    assert_memory_equal(qa, qb, sizeof(float) * g_vt); /* first step: bit-identical distribution */
    /* both in one call, in either order, with different k */
    int64_t ids[2] = {b, a};
    int32_t ks[2] = {KM, 2}, tok2[2 * KM];
    float *q2 = malloc(sizeof(float) * 2 * KM * g_vt);
    propose(sp, ids, ks, 2, 0.0f, tok2, NULL);
    for (int j = 0; j < KM; j++) assert_int_equal(tok2[j], g_ref[j]);
    assert_int_equal(tok2[KM + 0], g_ref[0]);
    assert_int_equal(tok2[KM + 1], g_ref[1]);
    assert_int_equal(tok2[KM + 2], -1);
    assert_int_equal(tok2[KM + 3], -1);
    propose(sp, ids, ks, 2, 1.0f, tok2, q2);
    assert_memory_equal(q2, qa, sizeof(float) * g_vt);
    assert_memory_equal(q2 + (size_t)KM * g_vt, qa, sizeof(float) * g_vt);
    for (int v = 0; v < g_vt; v++) assert_true(q2[(size_t)(KM + 2) * g_vt + v] == 0.0f); /* slot past k */
    free(qa), free(qb), free(q2);
    eagle3_destroy(sp);
}

static void test_chunked_prefill(void **state) {
    (void)state;
    spec_proposer *s1 = make(64, 0), *s4 = make(64, 4);
    int64_t id = 5;
    int32_t k = KM, t1[KM], t4[KM];
    float *q1 = malloc(sizeof(float) * KM * g_vt), *q4 = malloc(sizeof(float) * KM * g_vt);
    one_shot(s1, id);
    one_shot(s4, id); /* 11 pending pairs > 4: extend runs them in chunks of 4 */
    propose(s1, &id, &k, 1, 1.0f, t1, q1);
    propose(s4, &id, &k, 1, 1.0f, t4, q4);
    assert_memory_equal(q1, q4, sizeof(float) * g_vt);
    propose(s4, &id, &k, 1, 0.0f, t4, NULL);
    for (int j = 0; j < KM; j++) assert_int_equal(t4[j], g_ref[j]);
    free(q1), free(q4);
    eagle3_destroy(s1);
    eagle3_destroy(s4);
}

static void test_truncate_and_rewrite(void **state) {
    (void)state;
    spec_proposer *sp = make(64, 0);
    int64_t id = 9;
    int32_t k = KM, tok[KM];
    one_shot(sp, id);
    propose(sp, &id, &k, 1, 0.0f, tok, NULL);
    sp->ops->truncate(sp->ctx, id, 100); /* beyond: no-op */
    propose(sp, &id, &k, 1, 0.0f, tok, NULL);
    for (int j = 0; j < KM; j++) assert_int_equal(tok[j], g_ref[j]);
    /* cut below the built entries: the window is dropped, re-send and recompute */
    sp->ops->truncate(sp->ctx, id, 8);
    propose(sp, &id, &k, 1, 0.0f, tok, NULL);
    for (int j = 0; j < KM; j++) assert_int_equal(tok[j], -1); /* nothing to draft from until re-sent */
    extend(sp, id, 0, NT - 1, true); /* re-send from 0: held positions are skipped */
    extend(sp, id, NT - 1, NT, false);
    propose(sp, &id, &k, 1, 0.0f, tok, NULL);
    for (int j = 0; j < KM; j++) assert_int_equal(tok[j], g_ref[j]);
    /* a re-sent token that differs: the draft follows the new history */
    int32_t other = g_ids[NT - 1] == 5 ? 6 : 5;
    specd_err err = {{0}};
    assert_int_equal(sp->ops->extend(sp->ctx, id, &other, 1, NT - 1, NULL, &err), 0);
    propose(sp, &id, &k, 1, 0.0f, tok, NULL);
    spec_proposer *fresh = make(64, 0);
    extend(fresh, id, 0, NT - 1, true);
    assert_int_equal(fresh->ops->extend(fresh->ctx, id, &other, 1, NT - 1, NULL, &err), 0);
    int32_t tf[KM];
    propose(fresh, &id, &k, 1, 0.0f, tf, NULL);
    assert_memory_equal(tok, tf, sizeof tok);
    assert_true(memcmp(tok, g_ref, sizeof tok) != 0);
    /* gaps are refused */
    assert_int_equal(sp->ops->extend(sp->ctx, id, g_ids, 1, NT + 3, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "gap"));
    assert_int_equal(sp->ops->extend(sp->ctx, id, g_ids, 1, NT, g_feats, &err), -1);
    assert_non_null(strstr(err.msg, "gap"));
    eagle3_destroy(fresh);
    eagle3_destroy(sp);
}

static void test_unservable_and_pool(void **state) {
    (void)state;
    spec_proposer *sp = make(1, 0); /* one block: positions 0..15 */
    int64_t total = 0, nfree = 0;
    sp->ops->kv_usage(sp->ctx, &total, &nfree);
    assert_int_equal(total, 1);
    assert_int_equal(nfree, 1);
    int64_t ids[3] = {1, 2, 3};
    int32_t ks[3] = {KM, KM, 0}, tok[3 * KM];
    extend(sp, 1, 0, 1, true);    /* one token: no pair yet */
    extend(sp, 3, 0, NT - 1, true);
    extend(sp, 3, NT - 1, NT, false);
    propose(sp, ids, ks, 3, 0.0f, tok, NULL);
    for (int i = 0; i < 3 * KM; i++) assert_int_equal(tok[i], -1); /* 1: too short, 2: unknown, 3: k = 0 */
    specd_err err = {{0}};
    int32_t kbig = KM + 1;
    float t0 = 0;
    assert_int_equal(sp->ops->propose(sp->ctx, &ids[2], &kbig, 1, KM, &t0, tok, NULL, &err), -1);
    /* sequence 3 has pairs at 0..10; a chain of 8 needs positions up to 17: cut at 15 */
    int32_t k8 = 8, t8[8];
    assert_int_equal(sp->ops->propose(sp->ctx, &ids[2], &k8, 1, 8, &t0, t8, NULL, &err), 0);
    for (int j = 0; j < KM; j++) assert_int_equal(t8[j], g_ref[j]);
    for (int j = 0; j < 8; j++) assert_true(j <= 5 ? t8[j] >= 0 : t8[j] == -1);
    sp->ops->kv_usage(sp->ctx, &total, &nfree);
    assert_int_equal(nfree, 0);
    sp->ops->free_seq(sp->ctx, 3);
    sp->ops->free_seq(sp->ctx, 1);
    sp->ops->free_seq(sp->ctx, 42); /* unknown: ignored */
    sp->ops->kv_usage(sp->ctx, &total, &nfree);
    assert_int_equal(nfree, 1);
    int32_t layers[8];
    assert_int_equal(sp->ops->aux_layers(sp->ctx, layers), 3);
    assert_int_equal(layers[0], 2);
    assert_int_equal(layers[1], 15);
    assert_int_equal(layers[2], 27);
    eagle3_destroy(sp);
}

int main(void) {
    g_be = bk_cpu_create(0);
    g_model = dt_model(g_be, 64);
    g_vt = model_get_config(g_model)->vocab;
    g_fx = dt_fixtures();
    st_model *in = dt_open_fixture("draft_inputs.safetensors");
    g_feats = dt_tensor(in, "feats", (uint64_t)NT * FW);
    g_ids = dt_tensor(in, "ids", NT);
    st_close(in);
    json_t *ct = json_object_get(json_object_get(json_object_get(g_fx, "heads"), "spec_s1"), "chain_target_ids");
    for (int j = 0; j < KM; j++) g_ref[j] = (int32_t)json_integer_value(json_array_get(ct, (size_t)j));
    dt_make_head(g_fx, "spec_s1", NULL, g_dir);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_incremental_equals_one_shot),
        cmocka_unit_test(test_chunked_prefill),
        cmocka_unit_test(test_truncate_and_rewrite),
        cmocka_unit_test(test_unservable_and_pool),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    dt_rm_head(g_dir);
    free(g_feats);
    free(g_ids);
    json_decref(g_fx);
    model_destroy(g_model);
    bk_cpu_destroy(g_be);
    return rc;
}
