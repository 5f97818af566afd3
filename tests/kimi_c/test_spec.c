/*
 * test_spec.c (kimi_c_spec): speculative decoding through the engine on the
 * Kimi miniature (MLA + MoE + int4 experts as the target) is lossless: greedy
 * output identical to plain greedy, token for token.
 * Reference: each prompt decoded ALONE by a direct model_forward loop (whole
 * prompt, then one token per step, argmax), no scheduler, no proposer.
 *   - the EAGLE-3 proposer (draft/) with a random head sized for the miniature
 *     (make_minis.py -> OUT/head; aux capture from the DeepSeek-V3 forward),
 *     k = 3, batch 1 and 8 concurrent requests with chunked prefill;
 *   - an oracle proposer that drafts the reference continuation with every
 *     third draft corrupted, k = 3, 8 requests: verify batches accept, reject
 *     and correct (the random head accepts almost nothing, this covers
 *     acceptance on the MLA/MoE target).
 * After each run every KV block is back in the pool.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "draft/eagle3.h"
#include "engine/runtime/engine_ex.h"
#include "engine/runtime/proposer.h"
#include "tests/kimi_c/kimi_c_util.h"

#define NREQ 8
#define MAX_NEW 16
#define BS 16
#define NBLK 96

static backend *g_be;
static model *g_model;
static int V;
static int32_t g_prompts[NREQ][64], g_len[NREQ], g_ref[NREQ][MAX_NEW];

static int real_forward(void *ctx, const model_batch *b, specd_err *err) { return model_forward(ctx, b, err); }

/* a detokenizer writing "t" per token (the token stream is under test) */
static void *dt_create(void *ctx, bool skip) { (void)ctx, (void)skip; return malloc(1); }
static void dt_destroy(void *s) { free(s); }
static int dt_push(void *s, int32_t id, char **o, size_t *l, size_t *c) {
    (void)s;
    if (id < 0) return -1;
    if (*l + 2 > *c) {
        char *nb = realloc(*o, *c + 64);
        if (!nb) return -1;
        *o = nb;
        *c += 64;
    }
    (*o)[(*l)++] = 't';
    (*o)[*l] = 0;
    return 0;
}
static int dt_flush(void *s, char **o, size_t *l, size_t *c) { (void)s, (void)o, (void)l, (void)c; return 0; }

static void reference_decode(int r) {
    int32_t tok[128];
    memcpy(tok, g_prompts[r], sizeof(int32_t) * (size_t)g_len[r]);
    float *lg = malloc(sizeof(float) * (size_t)g_len[r] * V);
    assert_int_equal(kc_run(g_model, 0, tok, g_len[r], 0, lg, NULL, 0, NULL, NULL), 0);
    int32_t next = kc_argmax(lg + (size_t)(g_len[r] - 1) * V, V);
    for (int s = 0; s < MAX_NEW; s++) {
        g_ref[r][s] = next;
        assert_int_equal(kc_run(g_model, 0, &next, 1, g_len[r] + s, lg, NULL, 0, NULL, NULL), 0);
        next = kc_argmax(lg, V);
    }
    free(lg);
}

/* ---- oracle proposer (reference continuation, every third draft corrupted) ---- */
static int32_t or_tok[64][256], or_n[64];
static uint64_t mix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}
static int or_extend(void *ctx, int64_t id, const int32_t *t, int32_t n, int32_t pos0, const float *aux, specd_err *err) {
    (void)ctx, (void)aux, (void)err;
    for (int32_t i = 0; i < n && pos0 + i < 256; i++) or_tok[id % 64][pos0 + i] = t[i];
    or_n[id % 64] = pos0 + n;
    return 0;
}
static int or_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                      int32_t *out, float *q, specd_err *err) {
    (void)ctx, (void)temps, (void)q, (void)err;
    for (int32_t i = 0; i < n; i++) {
        const int64_t id = ids[i] % 64;
        int best = -1;
        for (int r = 0; r < NREQ; r++)
            if (or_n[id] >= g_len[r] && !memcmp(or_tok[id], g_prompts[r], sizeof(int32_t) * (size_t)g_len[r]) &&
                (best < 0 || g_len[r] > g_len[best]))
                best = r;
        for (int32_t j = 0; j < k_max; j++) {
            const int32_t gi = best < 0 ? -1 : or_n[id] - g_len[best] + j;
            int32_t d = j < k[i] && gi >= 0 && gi < MAX_NEW ? g_ref[best][gi] : -1;
            if (d >= 0 && mix((uint64_t)ids[i] * 7919u + (uint64_t)or_n[id] * 31u + (uint64_t)j) % 3 == 0)
                d = (d + 1) % V;
            out[i * k_max + j] = d;
        }
    }
    return 0;
}
static void or_free(void *ctx, int64_t id) { (void)ctx, or_n[id % 64] = 0; }
static void or_trunc(void *ctx, int64_t id, int32_t n) { (void)ctx; if (or_n[id % 64] > n) or_n[id % 64] = n; }
static const spec_proposer_ops or_ops = {.extend = or_extend, .propose = or_propose, .truncate = or_trunc, .free_seq = or_free};
static spec_proposer g_oracle = {.ops = &or_ops, .ctx = NULL};

/* Runs requests [0, nreq) through an engine with proposer p (k drafts); checks
 * every output against the reference and the pool against leaks. */
static void run(spec_proposer *p, int nreq, int32_t k, engine_stats *st) {
    engine_runner rn = {.ctx = g_model, .forward = real_forward, .vocab = V, .hidden = model_get_config(g_model)->hidden,
                        .block_size = BS, .n_blocks = NBLK};
    engine_detok d = {.stream_create = dt_create, .stream_destroy = dt_destroy, .push = dt_push, .flush = dt_flush};
    engine_config cfg = {.max_model_len = 128, .max_num_seqs = 8, .max_num_batched_tokens = 48, .max_waiting = 64,
                         .num_speculative_tokens = k};
    engine *e = NULL;
    specd_err err = {{0}};
    if (engine_create_ex(&cfg, &rn, &d, g_model, NULL, &e, &err) != 0) fail_msg("%s", err.msg);
    memset(or_n, 0, sizeof or_n);
    if (engine_set_proposer(e, p, &err) != 0 || engine_start(e, &err) != 0) fail_msg("%s", err.msg);
    engine_stream *s[NREQ];
    for (int r = 0; r < nreq; r++) {
        engine_request rq;
        memset(&rq, 0, sizeof rq);
        sampling_params_init(&rq.sp);
        rq.sp.temperature = 0.0f;
        rq.sp.max_tokens = MAX_NEW;
        rq.sp.ignore_eos = true;
        rq.prompt = g_prompts[r];
        rq.n_prompt = (size_t)g_len[r];
        s[r] = engine_submit(e, &rq, NULL, NULL, NULL, &err);
        if (!s[r]) fail_msg("submit: %s", err.msg);
    }
    for (int r = 0; r < nreq; r++) {
        int32_t got[MAX_NEW + 4];
        int n = 0;
        finish_reason fin = FINISH_NONE;
        engine_output *o;
        while (fin == FINISH_NONE && engine_stream_wait(s[r], &o, 300.0)) {
            for (size_t i = 0; i < o->n_tokens && n < MAX_NEW + 4; i++) got[n++] = o->token_ids[i];
            fin = o->finish;
            engine_output_free(o);
        }
        assert_int_equal(fin, FINISH_LENGTH);
        assert_int_equal(n, MAX_NEW);
        for (int i = 0; i < MAX_NEW; i++)
            if (got[i] != g_ref[r][i]) fail_msg("request %d token %d: speculative %d, plain %d", r, i, got[i], g_ref[r][i]);
        engine_stream_release(s[r]);
    }
    assert_int_equal(engine_wait_idle(e, 60.0), 0);
    engine_get_stats(e, st);
    assert_int_equal(st->kv_blocks_free, st->kv_blocks_total);
    engine_destroy(e);
}

static void report(const char *what, const engine_stats *st) {
    printf("kimi_c_spec: %s: drafts %lld, draft tokens %lld, accepted %lld, %lld steps for %lld tokens\n", what,
           (long long)st->spec_num_drafts_total, (long long)st->spec_num_draft_tokens_total,
           (long long)st->spec_num_accepted_tokens_total, (long long)st->steps_total,
           (long long)st->generation_tokens_total);
}

static void test_eagle3_head(void **stt) {
    (void)stt;
    char head[1100];
    snprintf(head, sizeof head, "%s/../head", kc_mini_dir("k25"));
    eagle3_opts o = {0};
    spec_proposer *p = NULL;
    specd_err err = {{0}};
    if (eagle3_load(head, g_model, &o, &p, &err) != 0) fail_msg("eagle3_load: %s", err.msg);
    engine_stats st;
    run(p, 1, 3, &st);
    report("EAGLE-3 random head, k=3, batch 1", &st);
    assert_true(st.spec_num_draft_tokens_total > 0);
    eagle3_destroy(p);
    p = NULL;
    if (eagle3_load(head, g_model, &o, &p, &err) != 0) fail_msg("eagle3_load: %s", err.msg);
    run(p, NREQ, 3, &st);
    report("EAGLE-3 random head, k=3, 8 concurrent", &st);
    assert_int_equal(st.generation_tokens_total, NREQ * MAX_NEW);
    eagle3_destroy(p);
}

static void test_oracle(void **stt) {
    (void)stt;
    engine_stats st;
    run(&g_oracle, NREQ, 3, &st);
    report("oracle drafts (1/3 corrupted), k=3, 8 concurrent", &st);
    assert_true(st.spec_num_accepted_tokens_total > 0);
    assert_true(st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total);
}

int main(void) {
    const char *dir = kc_mini_dir("k25");
    g_be = bk_cpu_create(0);
    model_load_opts lo = {.block_size = BS, .n_blocks = NBLK};
    specd_err err = {{0}};
    if (model_load(dir, g_be, &lo, &g_model, &err) != 0) {
        fprintf(stderr, "model_load: %s\n", err.msg);
        return 1;
    }
    V = model_get_config(g_model)->vocab;
    /* prompts: the 4 fixture prompts, then 4 pseudo-random ones of other lengths */
    json_t *fx = kc_fixture("mini_logits.json");
    const json_t *pr = json_object_get(fx, "prompts");
    uint64_t x = 0x9e3779b9ull;
    for (int r = 0; r < NREQ; r++) {
        if (r < 4) {
            int n;
            int32_t *ids = kc_ids(json_object_get(json_array_get(pr, (size_t)r), "ids"), &n);
            g_len[r] = n;
            memcpy(g_prompts[r], ids, sizeof(int32_t) * (size_t)n);
            free(ids);
        } else {
            g_len[r] = 5 + 11 * (r - 4);
            for (int i = 0; i < g_len[r]; i++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                g_prompts[r][i] = 100 + (int32_t)((x >> 33) % 163000);
            }
        }
        reference_decode(r);
    }
    json_decref(fx);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_eagle3_head),
        cmocka_unit_test(test_oracle),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    model_destroy(g_model);
    bk_cpu_destroy(g_be);
    return rc;
}
