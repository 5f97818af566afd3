/*
 * test_lossless_mtbench.c: lossless greedy speculative decoding on real data
 * (issue 4 "What must be shown", first point): MT-bench first turns through
 * SmolLM2's chat template, decoded by the engine with a real EAGLE-3 head
 * (eagle3_load), must be token-identical to plain greedy decoding, served one
 * at a time AND 8 at a time concurrently, for k = 1, 3 and 5.
 *
 * The reference is independent of the engine: a direct loop over
 * model_forward (each prompt prefilled alone, then batched one-token decode
 * steps of up to 8 sequences with their own block tables, argmax, stop at the
 * first of the tokenizer's stop ids or at max_new). The engine (scheduler,
 * block manager, sampler, postprocess, spec.c's verify / accept / rollback,
 * the EAGLE-3 proposer) must reproduce it token for token, including the
 * stop token and the finish reason. Batch invariance of the model (tested in
 * tests/model) is what makes "different batch compositions, same argmax" a
 * fair demand.
 *
 * Heads:
 *   - a random head, regenerated with tools/eagle3/make_random_head.py
 *     --layout speculators --seed 1 (numpy only; SPECD_PYTHON). It accepts
 *     almost nothing: this pins the bookkeeping (drafts rejected at position
 *     0 every step), not the accept path; no acceptance floor.
 *   - the trained head, when draft/heads/smollm2-135m-eagle3 exists (or env
 *     SPECD_SPEC_TRAINED_HEAD names a directory): same checks, plus its
 *     acceptance length at k = 3 must reach TRAINED_HEAD_MIN_TAU_K3 (env
 *     SPECD_SPEC_MIN_TAU overrides). Real acceptance exercises multi-token
 *     accepted blocks, stops inside them and the draft's extend after them.
 *   - the trained head again with its matrices re-quantized to Q8_0 at load
 *     (--draft-quantization q8_0), k = 3 only: lossless and above the floor.
 *   - the trained head with ADAPTIVE speculation (engine_config.spec_adaptive,
 *     the server's default), at most 3 drafts: k chosen per sequence and step
 *     from measured costs and acceptance, so k = 0 steps and k > 0 steps mix
 *     in one batch and a sequence skips drafting for stretches (its draft KV
 *     catching up at the next propose): still token-identical; both kinds of
 *     step must occur (the chosen-k histogram is printed).
 * One engine per head, prefix caching ON (the realistic server setting; the
 * proposer is then fed cached features on hits), max_num_seqs 8, k chosen
 * per request (sampling_params.num_speculative_tokens).
 *
 * Size: CI runs the first 16 prompts x 64 new tokens; env SPECD_SPEC_FULL=1
 * runs all 80 x 256 (the closing-note command; see tools/spec_lossless_full.sh).
 * SPECD_SPEC_PROMPTS / SPECD_SPEC_NEW override the two numbers (quick runs);
 * SPECD_SPEC_RANDOM=0 leaves the random head out (a full run with the trained
 * head only); SPECD_SPEC_SHARD=i/n keeps every n-th prompt from i (parallel
 * single-thread processes; the script sums their counts). SPECD_SPEC_FILTER
 * (a cmocka test-name pattern, e.g. '*adaptive') runs only those tests.
 * Prompts: SPECD_PROMPTS_DIR or $SPECD_SOURCE_DIR/../shared/data/prompts
 * (mt_bench.jsonl); skipped (77) when absent, as when the model or python is.
 * Printed per (head, k, mode): acceptance length 1 + accepted/drafts,
 * acceptance rate, per-position acceptance (accepted at i / drafts), CPU s.
 * Spec counters are also checked for the chain-drafting invariants:
 * per-position counts are non-increasing and sum to the accepted count,
 * accepted <= draft tokens <= k * drafts.
 *
 * Threading: the test thread submits and reads; the engine thread runs.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "draft/eagle3.h"
#include "engine/runtime/engine.h"
#include "engine/tokenizer/tokenizer.h"

/* Acceptance-length floor for the trained head at k = 3 (the random head has
 * none). Set from the trained head's measured figure minus a margin. */
/* The committed head (run3, 650 steps on 1,917 self-distilled GSM8K
 * conversations: 2.027 at k=3 on 200 gsm8k_test questions) measured 1.155 at
 * k=3 here (16 prompts x 64 tokens, serial and concurrent alike; 1.146 at
 * k=1, 1.155 at k=5; per position 0.145 / 0.008 / 0.002): MT-bench is off
 * its training domain. Greedy decoding is deterministic, so the floor sits
 * just below: a broken draft path (1.000, nothing accepted) fails it, and so
 * does a return to the previous head (1.065). */
#define TRAINED_HEAD_MIN_TAU_K3 1.10
#define BS 16
#define CONC 8
#define MAXP 80

static backend *g_be;
static model *g_model;
static gguf_file *g_tok_gguf;
static tokenizer *g_tok;
static int g_np, g_max_new;
static int32_t *g_prompt[MAXP];
static int32_t g_plen[MAXP];
static int32_t *g_ref[MAXP];
static int32_t g_ref_n[MAXP];
static finish_reason g_ref_fin[MAXP];
static int32_t g_max_len;
static char g_rand_head[64];
static char g_trained_head[1024];

static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static const char *src_dir(void) {
    const char *s = getenv("SPECD_SOURCE_DIR");
    return s ? s : ".";
}

static bool is_stop(int32_t id) {
    const int32_t *ids = NULL;
    size_t n = tok_stop_ids(g_tok, &ids);
    for (size_t i = 0; i < n; i++)
        if (ids[i] == id) return true;
    return false;
}

static int argmax(const float *x, int32_t n) {
    int b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* ---------------------------------------------------------------- prompts */

/* SPECD_SPEC_SHARD=i/n: this process serves prompts whose index % n == i (of
 * the first `want`), so tools/spec_lossless_full.sh can run n single-thread
 * processes side by side; default 0/1 = all. */
static int g_shard_i = 0, g_shard_n = 1;

static void load_prompts(int want) {
    char path[1200];
    const char *dir = getenv("SPECD_PROMPTS_DIR");
    if (dir) snprintf(path, sizeof path, "%s/mt_bench.jsonl", dir);
    else snprintf(path, sizeof path, "%s/../shared/data/prompts/mt_bench.jsonl", src_dir());
    FILE *f = fopen(path, "r");
    if (!f) {
        printf("SKIP: MT-bench prompts not found at %s (set SPECD_PROMPTS_DIR)\n", path);
        exit(77);
    }
    char *line = NULL;
    size_t cap = 0;
    g_np = 0;
    int li = 0, kept_want = 0;
    for (int i = 0; i < want; i++) kept_want += i % g_shard_n == g_shard_i;
    while (li < want && getline(&line, &cap, f) > 0) {
        if (li++ % g_shard_n != g_shard_i) continue;
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        const char *q = json_string_value(json_array_get(json_object_get(j, "turns"), 0));
        if (!q) { fprintf(stderr, "%s: line %d has no turns[0]\n", path, li); exit(1); }
        chat_message msg = {.role = "user", .content = q, .name = NULL};
        chat_options co = {.add_generation_prompt = true, .thinking = -1, .default_system = NULL};
        size_t n = 0;
        specd_err err = {{0}};
        if (tok_chat_encode(g_tok, &msg, 1, &co, &g_prompt[g_np], &n, NULL, &err) != 0) {
            fprintf(stderr, "tok_chat_encode: %s\n", err.msg);
            exit(1);
        }
        g_plen[g_np++] = (int32_t)n;
        json_decref(j);
    }
    free(line);
    fclose(f);
    if (g_np < kept_want) { fprintf(stderr, "%s: only %d prompts, want %d\n", path, li, want); exit(1); }
}

/* ---------------------------------------------------------------- reference */

/* Plain greedy of prompts [p0, p0 + n) (n <= CONC) by a direct model_forward
 * loop; sequence i owns blocks [i * per, (i + 1) * per). */
static void reference_group(int p0, int n) {
    const int32_t V = model_get_config(g_model)->vocab;
    const int32_t per = (g_max_len + BS - 1) / BS;
    int32_t *tables[CONC];
    const int32_t *ctab[CONC];
    float *logits = malloc(sizeof(float) * (size_t)V * CONC);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)g_max_len), *seq = calloc((size_t)g_max_len, sizeof(int32_t));
    int32_t last[CONC], len[CONC], act[CONC];
    assert_non_null(logits);
    specd_err err = {{0}};
    for (int i = 0; i < n; i++) {
        tables[i] = malloc(sizeof(int32_t) * (size_t)per);
        for (int32_t b = 0; b < per; b++) tables[i][b] = i * per + b;
        ctab[i] = tables[i];
        int r = p0 + i;
        g_ref[r] = malloc(sizeof(int32_t) * (size_t)(g_max_new + 1));
        g_ref_n[r] = 0;
        for (int32_t t = 0; t < g_plen[r]; t++) pos[t] = t;
        int32_t out = g_plen[r] - 1;
        model_batch b = {.n_tokens = g_plen[r], .tokens = g_prompt[r], .pos = pos, .seq_of = seq, .n_seqs = 1,
                         .block_tables = &ctab[i], .n_out = 1, .out_idx = &out, .logits = logits};
        if (model_forward(g_model, &b, &err) != 0) fail_msg("reference prefill: %s", err.msg);
        last[i] = argmax(logits, V);
        len[i] = g_plen[r];
        g_ref[r][g_ref_n[r]++] = last[i];
    }
    for (;;) {
        int32_t tok[CONC], p[CONC], so[CONC], oi[CONC];
        const int32_t *bt[CONC];
        int m = 0;
        for (int i = 0; i < n; i++) {
            int r = p0 + i;
            if (is_stop(last[i]) || g_ref_n[r] >= g_max_new) continue;
            act[m] = i, tok[m] = last[i], p[m] = len[i], so[m] = m, oi[m] = m, bt[m] = ctab[i];
            m++;
        }
        if (m == 0) break;
        model_batch b = {.n_tokens = m, .tokens = tok, .pos = p, .seq_of = so, .n_seqs = m, .block_tables = bt,
                         .n_out = m, .out_idx = oi, .logits = logits};
        if (model_forward(g_model, &b, &err) != 0) fail_msg("reference decode: %s", err.msg);
        for (int j = 0; j < m; j++) {
            int i = act[j], r = p0 + i;
            len[i]++;
            last[i] = argmax(logits + (size_t)j * V, V);
            g_ref[r][g_ref_n[r]++] = last[i];
        }
    }
    for (int i = 0; i < n; i++) {
        int r = p0 + i;
        g_ref_fin[r] = is_stop(g_ref[r][g_ref_n[r] - 1]) ? FINISH_STOP : FINISH_LENGTH;
        free(tables[i]);
    }
    free(logits), free(pos), free(seq);
}

/* ---------------------------------------------------------------- setup */

static int setup(void **state) {
    (void)state;
    const bool full = getenv("SPECD_SPEC_FULL") && atoi(getenv("SPECD_SPEC_FULL")) == 1;
    int want = full ? 80 : 16;
    g_max_new = full ? 256 : 64;
    if (getenv("SPECD_SPEC_PROMPTS")) want = atoi(getenv("SPECD_SPEC_PROMPTS")); /* quick local runs */
    if (getenv("SPECD_SPEC_NEW")) g_max_new = atoi(getenv("SPECD_SPEC_NEW"));
    if (want < 1 || want > MAXP || g_max_new < 1) { fprintf(stderr, "bad SPECD_SPEC_PROMPTS/NEW\n"); return -1; }
    const char *sh_env = getenv("SPECD_SPEC_SHARD");
    if (sh_env && (sscanf(sh_env, "%d/%d", &g_shard_i, &g_shard_n) != 2 || g_shard_n < 1 || g_shard_i < 0 ||
                   g_shard_i >= g_shard_n || g_shard_n > want)) {
        fprintf(stderr, "bad SPECD_SPEC_SHARD=%s (want i/n, 0 <= i < n <= prompts)\n", sh_env);
        return -1;
    }
    const char *gg = getenv("SPECD_MODEL_GGUF");
    if (!gg || access(gg, R_OK) != 0) {
        printf("SKIP: SmolLM2 GGUF not found at %s (run tools/setup.sh)\n", gg ? gg : "(SPECD_MODEL_GGUF unset)");
        exit(77);
    }
    const char *py = getenv("SPECD_PYTHON");
    if (!py || access(py, X_OK) != 0) {
        printf("SKIP: no project python at %s (tools/setup.sh makes .venv)\n", py ? py : "(SPECD_PYTHON unset)");
        exit(77);
    }
    /* tokenizer first (prompt lengths size the KV pool) */
    gguf_file *g = NULL;
    specd_err err = {{0}};
    if (gguf_open(gg, &g, &err) != 0 || tok_create_from_gguf(g, &g_tok, &err) != 0) {
        fprintf(stderr, "tokenizer: %s\n", err.msg);
        return -1;
    }
    g_tok_gguf = g;
    load_prompts(want);
    int32_t maxp = 0;
    for (int i = 0; i < g_np; i++)
        if (g_plen[i] > maxp) maxp = g_plen[i];
    g_max_len = ((maxp + g_max_new + 16 + BS - 1) / BS) * BS;
    /* KV: CONC sequences of g_max_len, plus as much again for prefix-cache residents */
    int32_t n_blocks = 2 * CONC * (g_max_len / BS) + 16;
    g_be = bk_cpu_create(0);
    model_load_opts mo = {.block_size = BS, .n_blocks = n_blocks};
    if (!g_be || model_load(gg, g_be, &mo, &g_model, &err) != 0) {
        fprintf(stderr, "model_load: %s\n", err.msg);
        return -1;
    }
    /* the random head */
    strcpy(g_rand_head, "/tmp/specd_spec_head_XXXXXX");
    if (!mkdtemp(g_rand_head)) return -1;
    char sh[2048];
    snprintf(sh, sizeof sh,
             "cd '%s' && '%s' tools/eagle3/make_random_head.py --layout speculators --out '%s' --seed 1 > /dev/null",
             src_dir(), py, g_rand_head);
    if (system(sh) != 0) {
        printf("SKIP: could not make the random head (%s)\n", sh);
        exit(77);
    }
    const char *th = getenv("SPECD_SPEC_TRAINED_HEAD");
    if (th) snprintf(g_trained_head, sizeof g_trained_head, "%s", th);
    else snprintf(g_trained_head, sizeof g_trained_head, "%s/draft/heads/smollm2-135m-eagle3", src_dir());
    if (access(g_trained_head, R_OK) != 0) g_trained_head[0] = 0;
    double c0 = cpu_s();
    for (int p0 = 0; p0 < g_np; p0 += CONC) reference_group(p0, g_np - p0 < CONC ? g_np - p0 : CONC);
    int stops = 0;
    for (int i = 0; i < g_np; i++) stops += g_ref_fin[i] == FINISH_STOP;
    printf("reference: %d prompts (%d..%d tokens) x up to %d new tokens, %d end at a stop token; %.1f s CPU\n", g_np,
           g_plen[0], maxp, g_max_new, stops, cpu_s() - c0);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    if (g_rand_head[0]) {
        char sh[256];
        snprintf(sh, sizeof sh, "rm -rf '%s'", g_rand_head);
        if (system(sh) != 0) fprintf(stderr, "could not remove %s\n", g_rand_head);
    }
    for (int i = 0; i < g_np; i++) free(g_prompt[i]), free(g_ref[i]);
    tok_destroy(g_tok);
    gguf_close(g_tok_gguf);
    model_destroy(g_model);
    if (g_be) bk_cpu_destroy(g_be);
    return 0;
}

/* ---------------------------------------------------------------- engine runs */

static engine_stream *submit(engine *e, int r, int32_t k) {
    engine_request rq;
    memset(&rq, 0, sizeof rq);
    sampling_params_init(&rq.sp);
    rq.sp.temperature = 0.0f;
    rq.sp.max_tokens = g_max_new;
    rq.sp.num_speculative_tokens = k;
    rq.prompt = g_prompt[r];
    rq.n_prompt = (size_t)g_plen[r];
    engine_status st;
    specd_err err = {{0}};
    engine_stream *s = engine_submit(e, &rq, NULL, NULL, &st, &err);
    if (!s) fail_msg("submit %d: %s", r, err.msg);
    return s;
}

static void expect_ref(engine_stream *s, int r, int32_t k, const char *mode) {
    int32_t *got = malloc(sizeof(int32_t) * (size_t)(g_max_new + 32));
    int n = 0, completion = -1;
    finish_reason fin = FINISH_NONE;
    engine_output *o;
    while (fin == FINISH_NONE && engine_stream_wait(s, &o, 600.0)) {
        for (size_t i = 0; i < o->n_tokens && n < g_max_new + 32; i++) got[n++] = o->token_ids[i];
        fin = o->finish;
        completion = o->n_completion_tokens;
        if (fin == FINISH_ERROR) fail_msg("prompt %d: engine error %s", r, o->error);
        engine_output_free(o);
    }
    engine_stream_release(s);
    int first_diff = -1;
    for (int i = 0; i < n && i < g_ref_n[r]; i++)
        if (got[i] != g_ref[r][i]) { first_diff = i; break; }
    if (first_diff >= 0 || n != g_ref_n[r] || fin != g_ref_fin[r] || completion != n)
        fail_msg("k=%d %s prompt %d: %d tokens (usage %d, finish %d) vs reference %d (finish %d); first difference "
                 "at %d: %d vs %d", k, mode, r, n, completion, fin, g_ref_n[r], g_ref_fin[r], first_diff,
                 first_diff >= 0 ? got[first_diff] : -1, first_diff >= 0 ? g_ref[r][first_diff] : -1);
    free(got);
}

/* Set by run_head for an adaptive head: a pass may then have no draft at all
 * (the cost model found none worth it, e.g. at 8 concurrent sequences with low
 * acceptance); run_head still requires k = 0 and k > 0 steps over the head's
 * passes together, and every pass's text equal to the reference. */
static bool g_report_adaptive;

/* Differences of the spec counters over one pass, checked and printed; returns tau. */
static double report(const char *head, int32_t k, const char *mode, const engine_stats *a, const engine_stats *b,
                     double cpu) {
    int64_t drafts = b->spec_num_drafts_total - a->spec_num_drafts_total;
    int64_t dt = b->spec_num_draft_tokens_total - a->spec_num_draft_tokens_total;
    int64_t acc = b->spec_num_accepted_tokens_total - a->spec_num_accepted_tokens_total;
    int64_t gen = b->generation_tokens_total - a->generation_tokens_total;
    if (drafts == 0 && g_report_adaptive) { /* adaptive k may find no step worth drafting in one pass: by design */
        printf("%-8s k<=%d %-10s: %lld tokens, no drafts (adaptive: k = 0 at every step of this pass), %.1f s CPU\n",
               head, k, mode, (long long)gen, cpu);
        return 1.0;
    }
    assert_true(drafts > 0);
    assert_true(acc <= dt);
    assert_true(dt <= (int64_t)k * drafts);
    int64_t sum = 0, prev = drafts;
    char per[256];
    int off = 0;
    for (int i = 0; i < 16; i++) {
        int64_t c = b->spec_accepted_per_pos_total[i] - a->spec_accepted_per_pos_total[i];
        if (i >= k) assert_int_equal(c, 0);
        if (c > prev) fail_msg("%s k=%d %s: accepted at position %d (%lld) > at %d (%lld)", head, k, mode, i,
                               (long long)c, i - 1, (long long)prev);
        prev = c;
        sum += c;
        if (i < k) off += snprintf(per + off, sizeof per - (size_t)off, " %.3f", (double)c / (double)drafts);
    }
    assert_int_equal(sum, acc);
    double tau = 1.0 + (double)acc / (double)drafts;
    char counts[256];
    int co = 0;
    for (int i = 0; i < k && i < 16; i++)
        co += snprintf(counts + co, sizeof counts - (size_t)co, " %lld",
                       (long long)(b->spec_accepted_per_pos_total[i] - a->spec_accepted_per_pos_total[i]));
    printf("%-8s k=%d %-10s: %lld tokens, %lld drafts, acceptance length %.3f, rate %.3f, per position [%s ], "
           "%.1f s CPU; counts: drafts %lld draft_tokens %lld accepted %lld per_pos%s\n", head, k, mode,
           (long long)gen, (long long)drafts, tau, dt ? (double)acc / (double)dt : 0.0, per, cpu, (long long)drafts,
           (long long)dt, (long long)acc, counts);
    fflush(stdout);
    return tau;
}

/* All prompts with one head: for each k in ks, one at a time then all at
 * once (8 running). q8_0: the head's matrices re-quantized at load
 * (eagle3_opts.q8_0, serve --draft-quantization q8_0). Returns tau at k = 3
 * (concurrent pass). */
static double run_head(const char *dir, const char *name, bool q8_0, bool adaptive, const int32_t *ks, int nks) {
    spec_proposer *prop = NULL;
    specd_err err = {{0}};
    eagle3_opts eo = {.q8_0 = q8_0};
    if (eagle3_load(dir, g_model, &eo, &prop, &err) != 0) fail_msg("eagle3_load %s: %s", dir, err.msg);
    engine_config cfg = {.max_model_len = g_max_len, .max_num_seqs = CONC, .max_num_batched_tokens = 512,
                         .max_waiting = 256, .enable_prefix_caching = true, .num_speculative_tokens = 5,
                         .spec_adaptive = adaptive};
    engine *e = NULL;
    if (engine_create(&cfg, g_model, g_tok, &e, &err) != 0) fail_msg("engine_create: %s", err.msg);
    if (engine_set_proposer(e, prop, &err) != 0) fail_msg("engine_set_proposer: %s", err.msg);
    if (engine_start(e, &err) != 0) fail_msg("engine_start: %s", err.msg);
    double tau3 = 0;
    g_report_adaptive = adaptive;
    engine_stream **s = calloc((size_t)g_np, sizeof *s);
    for (int ki = 0; ki < nks; ki++) {
        int32_t k = ks[ki];
        engine_stats a, b;
        engine_get_stats(e, &a);
        double c0 = cpu_s();
        for (int r = 0; r < g_np; r++) expect_ref(submit(e, r, k), r, k, "serial");
        assert_int_equal(engine_wait_idle(e, 60.0), 0);
        engine_get_stats(e, &b);
        report(name, k, "serial", &a, &b, cpu_s() - c0);
        engine_get_stats(e, &a);
        c0 = cpu_s();
        for (int r = 0; r < g_np; r++) s[r] = submit(e, r, k);
        for (int r = 0; r < g_np; r++) expect_ref(s[r], r, k, "concurrent");
        assert_int_equal(engine_wait_idle(e, 60.0), 0);
        engine_get_stats(e, &b);
        double t = report(name, k, "concurrent", &a, &b, cpu_s() - c0);
        if (k == 3) tau3 = t;
        if (adaptive) {
            int64_t kpos = 0;
            printf("%-8s k<=%d adaptive: chosen k (serial + concurrent):", name, k);
            for (int j = 0; j <= k; j++) {
                printf(" %d:%lld", j, (long long)b.spec_k_chosen_total[j]);
                if (j > 0) kpos += b.spec_k_chosen_total[j];
            }
            printf("\n");
            assert_true(b.spec_k_chosen_total[0] > 0 && kpos > 0); /* k = 0 and k > 0 steps both ran */
        }
        assert_int_equal(b.kv_blocks_free, b.kv_blocks_total);
        assert_int_equal(b.draft_kv_blocks_free, b.draft_kv_blocks_total);
    }
    free(s);
    engine_destroy(e);
    eagle3_destroy(prop);
    return tau3;
}

static const int32_t KS[3] = {1, 3, 5};

static void test_random_head(void **state) {
    (void)state;
    if (getenv("SPECD_SPEC_RANDOM") && atoi(getenv("SPECD_SPEC_RANDOM")) == 0) {
        printf("random head: not run (SPECD_SPEC_RANDOM=0)\n");
        skip();
    }
    run_head(g_rand_head, "random", false, false, KS, 3);
}

static void test_trained_head(void **state) {
    (void)state;
    if (!g_trained_head[0]) {
        printf("trained head: draft/heads/smollm2-135m-eagle3 not present (SPECD_SPEC_TRAINED_HEAD unset); not run\n");
        skip();
    }
    double tau3 = run_head(g_trained_head, "trained", false, false, KS, 3);
    double floor = getenv("SPECD_SPEC_MIN_TAU") ? atof(getenv("SPECD_SPEC_MIN_TAU")) : TRAINED_HEAD_MIN_TAU_K3;
    if (floor > 0 && tau3 < floor) fail_msg("trained head: acceptance length %.3f at k=3 is below the floor %.3f", tau3, floor);
}

/* The trained head with its matrices re-quantized to Q8_0 at load: still
 * lossless (k = 3, serial and concurrent), and its drafts still good enough
 * to clear the same floor (a broken re-quantization accepts ~nothing). */
static void test_trained_head_q8_0(void **state) {
    (void)state;
    if (!g_trained_head[0]) {
        printf("trained head (q8_0): draft/heads/smollm2-135m-eagle3 not present; not run\n");
        skip();
    }
    static const int32_t k3[1] = {3};
    double tau3 = run_head(g_trained_head, "trained-q8_0", true, false, k3, 1);
    double floor = getenv("SPECD_SPEC_MIN_TAU") ? atof(getenv("SPECD_SPEC_MIN_TAU")) : TRAINED_HEAD_MIN_TAU_K3;
    if (floor > 0 && tau3 < floor)
        fail_msg("trained head, q8_0: acceptance length %.3f at k=3 is below the floor %.3f", tau3, floor);
}

/* Adaptive speculation (the server default) with the trained head, at most 3
 * drafts: lossless whatever k each sequence picks at each step; no floor
 * (adaptive k drafts less where acceptance is low, by design). */
static void test_trained_head_adaptive(void **state) {
    (void)state;
    if (!g_trained_head[0]) {
        printf("trained head (adaptive): draft/heads/smollm2-135m-eagle3 not present; not run\n");
        skip();
    }
    static const int32_t k3[1] = {3};
    run_head(g_trained_head, "trained-adaptive", false, true, k3, 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_head),
        cmocka_unit_test(test_trained_head),
        cmocka_unit_test(test_trained_head_q8_0),
        cmocka_unit_test(test_trained_head_adaptive),
    };
    if (getenv("SPECD_SPEC_FILTER")) cmocka_set_test_filter(getenv("SPECD_SPEC_FILTER")); /* e.g. *adaptive */
    return cmocka_run_group_tests(tests, setup, teardown);
}
