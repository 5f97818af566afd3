/*
 * test_engine_model.c: the engine end to end on the real SmolLM2-135M GGUF
 * (skipped with exit 77 when it is not installed).
 *
 * Reference: the same model decoded ALONE by a direct loop over
 * model_forward (whole-prompt prefill, then one token per step, argmax, its
 * own block table), independent of the scheduler, block manager, sampler and
 * postprocess. The engine must reproduce it token for token:
 *   - one request through the engine thread;
 *   - 8 concurrent requests of different prompt lengths, with a small token
 *     budget so prefill chunks and decodes share steps (batch invariance end to
 *     end);
 *   - the same with prefix caching on and shared prefixes (hits > 0);
 *   - the same with a KV pool too small for all of them (preemption and
 *     recompute).
 *   - speculative decoding (k = 3, an oracle proposer drafting the reference
 *     continuation with every third draft corrupted): verify batches of
 *     k + 1 tokens per sequence must give the same greedy tokens.
 * After each scenario every KV block is free (stats snapshot).
 * Detokenization is not exercised here (a fake piece table; ignore_eos so
 * lengths are fixed): the token stream is what batch invariance is about.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/runtime/engine_ex.h"
#include "engine/runtime/proposer.h"
#include "fake_runner.h"

#define NREQ 8
#define MAX_NEW 20
#define BS 16

static backend *g_be;
static model *g_model;
static int32_t g_prompts[NREQ][80];
static int32_t g_len[NREQ];
static int32_t g_ref[NREQ][MAX_NEW];

static int real_forward(void *ctx, const model_batch *b, specd_err *err) { return model_forward(ctx, b, err); }

static int argmax(const float *x, int32_t n) {
    int best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* Plain greedy decode of one prompt, alone, with blocks [0, nb) as its table. */
static void reference_decode(const int32_t *prompt, int32_t n, int32_t max_new, int32_t *out) {
    const model_config *mc = model_get_config(g_model);
    int32_t table[64];
    for (int i = 0; i < 64; i++) table[i] = i;
    const int32_t *tables[1] = {table};
    int32_t *tok = malloc((size_t)(n + max_new) * sizeof *tok);
    int32_t *pos = malloc((size_t)(n + max_new) * sizeof *pos);
    int32_t *seq = calloc((size_t)(n + max_new), sizeof *seq);
    float *logits = malloc((size_t)mc->vocab * sizeof *logits);
    memcpy(tok, prompt, (size_t)n * sizeof *tok);
    for (int32_t i = 0; i < n + max_new; i++) pos[i] = i;
    specd_err err = {0};
    int32_t done = 0, cur = n;
    for (int32_t k = 0; k < max_new; k++) {
        int32_t last = cur - done - 1;
        model_batch b = {.n_tokens = cur - done, .tokens = tok + done, .pos = pos + done, .seq_of = seq,
                         .n_seqs = 1, .block_tables = tables, .n_out = 1, .out_idx = &last, .logits = logits};
        if (model_forward(g_model, &b, &err) != 0) fail_msg("reference forward: %s", err.msg);
        done = cur;
        out[k] = argmax(logits, mc->vocab);
        tok[cur++] = out[k];
    }
    free(tok);
    free(pos);
    free(seq);
    free(logits);
}

static int setup(void **st) {
    (void)st;
    const char *p = getenv("SPECD_MODEL_GGUF");
    FILE *f = p ? fopen(p, "rb") : NULL;
    if (!f) {
        printf("SKIP: SmolLM2 GGUF not found at %s (run tools/setup.sh)\n", p ? p : "(SPECD_MODEL_GGUF unset)");
        exit(77);
    }
    fclose(f);
    g_be = bk_cpu_create(0);
    model_load_opts o = {.block_size = BS, .n_blocks = 160};
    specd_err err = {0};
    if (!g_be || model_load(p, g_be, &o, &g_model, &err) != 0) {
        fprintf(stderr, "model_load: %s\n", err.msg);
        return -1;
    }
    /* prompts: pseudo-random ids in [200, 20000), lengths 7..70; requests 2..7
     * share their first 24 tokens (prefix-cache hits once one of them is computed) */
    uint64_t x = 0x1234567ull;
    for (int r = 0; r < NREQ; r++) {
        g_len[r] = 7 + r * 9;
        for (int i = 0; i < g_len[r]; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            g_prompts[r][i] = (r >= 2 && i < 24) ? 300 + i * 37 : 200 + (int32_t)((x >> 33) % 19800);
        }
    }
    for (int r = 0; r < NREQ; r++) reference_decode(g_prompts[r], g_len[r], MAX_NEW, g_ref[r]);
    return 0;
}

static int teardown(void **st) {
    (void)st;
    model_destroy(g_model);
    bk_cpu_destroy(g_be);
    return 0;
}

/* ---- oracle proposer: drafts the reference continuation, every third draft
 * (by a hash) corrupted, so verification accepts, rejects and corrects ---- */
static int32_t or_tok[64][256], or_n[64];
static int or_extend(void *ctx, int64_t id, const int32_t *t, int32_t n, int32_t pos0, const float *aux,
                     specd_err *err) {
    (void)ctx, (void)aux, (void)err;
    for (int32_t i = 0; i < n && pos0 + i < 256; i++) or_tok[id % 64][pos0 + i] = t[i];
    or_n[id % 64] = pos0 + n;
    return 0;
}
static int or_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                      int32_t *out, float *q, specd_err *err) {
    (void)ctx, (void)temps, (void)q, (void)err;
    for (int32_t i = 0; i < n; i++) {
        int64_t id = ids[i] % 64;
        int best = -1;
        for (int r = 0; r < NREQ; r++)
            if (or_n[id] >= g_len[r] && memcmp(or_tok[id], g_prompts[r], (size_t)g_len[r] * sizeof(int32_t)) == 0 &&
                (best < 0 || g_len[r] > g_len[best]))
                best = r;
        for (int32_t j = 0; j < k_max; j++) {
            int32_t gi = best < 0 ? -1 : or_n[id] - g_len[best] + j;
            int32_t d = j < k[i] && gi >= 0 && gi < MAX_NEW ? g_ref[best][gi] : -1;
            if (d >= 0 && fake_mix((uint64_t)ids[i] * 7919u + (uint64_t)or_n[id] * 31u + (uint64_t)j) % 3 == 0)
                d = (d + 1) % 49152;
            out[i * k_max + j] = d;
        }
    }
    return 0;
}
static void or_free(void *ctx, int64_t id) { (void)ctx, or_n[id % 64] = 0; }
static void or_trunc(void *ctx, int64_t id, int32_t n) {
    (void)ctx;
    if (or_n[id % 64] > n) or_n[id % 64] = n;
}
static const spec_proposer_ops or_ops = {.extend = or_extend, .propose = or_propose, .truncate = or_trunc,
                                         .free_seq = or_free};
static spec_proposer g_oracle = {.ops = &or_ops, .ctx = NULL};

static engine *make_engine_k(int32_t n_blocks, int32_t budget, bool prefix, int32_t k) {
    engine_runner r = {.ctx = g_model, .forward = real_forward, .vocab = model_get_config(g_model)->vocab,
                       .hidden = model_get_config(g_model)->hidden, .block_size = BS, .n_blocks = n_blocks};
    engine_detok d = fake_detok();
    d.n_eos = 0;
    engine_config cfg = {.max_model_len = 160, .max_num_seqs = 8, .max_num_batched_tokens = budget,
                         .max_waiting = 64, .enable_prefix_caching = prefix, .num_speculative_tokens = k};
    engine *e = NULL;
    specd_err err = {0};
    if (engine_create_ex(&cfg, &r, &d, g_model, NULL, &e, &err) != 0) fail_msg("%s", err.msg);
    memset(or_n, 0, sizeof or_n);
    if (k > 0 && engine_set_proposer(e, &g_oracle, &err) != 0) fail_msg("%s", err.msg);
    if (engine_start(e, &err) != 0) fail_msg("%s", err.msg);
    return e;
}

static engine *make_engine(int32_t n_blocks, int32_t budget, bool prefix) {
    return make_engine_k(n_blocks, budget, prefix, 0);
}

static engine_stream *submit(engine *e, int r) {
    engine_request rq;
    memset(&rq, 0, sizeof rq);
    sampling_params_init(&rq.sp);
    rq.sp.temperature = 0.0f;
    rq.sp.max_tokens = MAX_NEW;
    rq.sp.ignore_eos = true;
    rq.prompt = g_prompts[r];
    rq.n_prompt = (size_t)g_len[r];
    specd_err err = {0};
    engine_stream *s = engine_submit(e, &rq, NULL, NULL, NULL, &err);
    if (!s) fail_msg("submit: %s", err.msg);
    return s;
}

static void expect_ref(engine_stream *s, int r) {
    int32_t got[MAX_NEW + 4];
    int n = 0;
    finish_reason fin = FINISH_NONE;
    engine_output *o;
    while (fin == FINISH_NONE && engine_stream_wait(s, &o, 120.0)) {
        for (size_t i = 0; i < o->n_tokens && n < MAX_NEW + 4; i++) got[n++] = o->token_ids[i];
        fin = o->finish;
        engine_output_free(o);
    }
    assert_int_equal(fin, FINISH_LENGTH);
    assert_int_equal(n, MAX_NEW);
    for (int i = 0; i < MAX_NEW; i++)
        if (got[i] != g_ref[r][i]) fail_msg("request %d token %d: engine %d, alone %d", r, i, got[i], g_ref[r][i]);
    engine_stream_release(s);
}

static void finish_engine(engine *e, engine_stats *st) {
    assert_int_equal(engine_wait_idle(e, 60.0), 0);
    engine_get_stats(e, st);
    assert_int_equal(st->kv_blocks_free, st->kv_blocks_total);
    engine_destroy(e);
}

static void test_single(void **state) {
    (void)state;
    engine *e = make_engine(160, 512, false);
    expect_ref(submit(e, 5), 5);
    engine_stats st;
    finish_engine(e, &st);
}

static void run_all_k(int32_t n_blocks, int32_t budget, bool prefix, int32_t k, engine_stats *st) {
    engine *e = make_engine_k(n_blocks, budget, prefix, k);
    engine_stream *s[NREQ];
    for (int r = 0; r < NREQ; r++) s[r] = submit(e, r);
    for (int r = 0; r < NREQ; r++) expect_ref(s[r], r);
    finish_engine(e, st);
}

static void run_all(int32_t n_blocks, int32_t budget, bool prefix, engine_stats *st) {
    run_all_k(n_blocks, budget, prefix, 0, st);
}

static void test_concurrent_chunked(void **state) {
    (void)state;
    engine_stats st;
    run_all(160, 48, false, &st);
    assert_int_equal(st.generation_tokens_total, NREQ * MAX_NEW);
}

static void test_concurrent_prefix_cache(void **state) {
    (void)state;
    engine_stats st;
    run_all(160, 48, true, &st);
    printf("prefix cache: %lld of %lld prompt tokens hit\n", (long long)st.prefix_cache_hits_total,
           (long long)st.prefix_cache_queries_total);
    assert_true(st.prefix_cache_hits_total > 0);
}

static void test_preemption(void **state) {
    (void)state;
    engine_stats st;
    run_all(24, 256, false, &st); /* 384 token slots for 8 sequences of up to 90 tokens */
    printf("preemptions: %lld\n", (long long)st.preemptions_total);
    assert_true(st.preemptions_total > 0);
}

/* Speculative greedy (k = 3, oracle drafts with corruptions, chunked prefill,
 * prefix caching on: speculating sequences take no hits) equals plain greedy. */
static void test_speculative_lossless(void **state) {
    (void)state;
    engine_stats st;
    run_all_k(160, 48, true, 3, &st);
    printf("speculative k=3: drafts %lld, draft tokens %lld, accepted %lld, steps %lld for %lld tokens\n",
           (long long)st.spec_num_drafts_total, (long long)st.spec_num_draft_tokens_total,
           (long long)st.spec_num_accepted_tokens_total, (long long)st.steps_total,
           (long long)st.generation_tokens_total);
    assert_true(st.spec_num_accepted_tokens_total > 0);
    assert_true(st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total);
    assert_int_equal(st.generation_tokens_total, NREQ * MAX_NEW);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_single),
        cmocka_unit_test(test_concurrent_chunked),
        cmocka_unit_test(test_concurrent_prefix_cache),
        cmocka_unit_test(test_preemption),
        cmocka_unit_test(test_speculative_lossless),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
