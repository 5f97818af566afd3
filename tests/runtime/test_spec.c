/*
 * test_spec.c: the speculative step against the fake runner and the fake
 * proposer (fake_proposer.h, which also checks the engine keeps the proposer
 * contract of draft/eagle3.h).
 *
 *  - Lossless greedy: for k = 1, 3, 5, eight concurrent requests (some with
 *    k = 0 in the same batch), chunked prefill, and a run with a pool small
 *    enough to preempt: every output equals the cache-free reference decode
 *    token for token; acceptance is partial (corrupted drafts) and counted
 *    per position; all blocks free at the end.
 *  - Stops inside an accepted block (EOS, a stop string, max_tokens) with
 *    k = 5 and drafts that are always right: tokens, text, usage, finish and
 *    stop reason identical to the same request served without speculation.
 *  - Lossless sampling, end to end: 20,000 seeded requests (temperature 1,
 *    top_k 4) with and without speculation (k = 2, drafts SAMPLED from a
 *    different q), the first four tokens of each compared with the exact
 *    distribution (computed by enumerating the processed distributions of the
 *    fake LM): chi-square on the (t1, t2), (t2, t3) and (t3, t4) tables
 *    (t2 and t3 come from accept/reject of 2 drafts, t4 is the bonus or a
 *    plain decode), cells with expected count < 5 merged. Each of the 6
 *    tables (3 per mode) uses alpha = 1e-6 / 6, so
 *    a correct engine fails this test with probability <= 1e-6 (union bound)
 *    for a random seed; the seeds are fixed, so it is deterministic.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fake_proposer.h"
#include "fake_runner.h"
#include "engine/runtime/engine_ex.h"
#include "engine/runtime/spec_adapt.h"

typedef struct rig {
    fake_runner f;
    fake_prop *fp;
    spec_proposer prop;
    engine_runner r;
    engine_detok d;
    engine *e;
} rig;

static bool g_prefix_caching; /* rig_init: enable prefix caching */
static bool g_adaptive;       /* rig_init: adaptive speculation */
static int g_sleep_us, g_sleep_us_per_token; /* rig_init: fake pass cost (before the adaptive calibration) */

static void rig_init(rig *g, int32_t n_blocks, int32_t bs, int32_t max_len, int32_t max_seqs, int32_t budget,
                     int32_t k, bool with_proposer) {
    memset(g, 0, sizeof *g);
    fake_pieces = NULL;
    assert_int_equal(fake_runner_init(&g->f, n_blocks, bs, &g->r), 0);
    g->f.sleep_us = g_sleep_us;
    g->f.sleep_us_per_token = g_sleep_us_per_token;
    if (g_sleep_us || g_sleep_us_per_token) { /* deterministic costs: a virtual clock the fake forward advances */
        g->f.virtual_time = true;
        g->r.now = fake_now;
    }
    g->fp = calloc(1, sizeof *g->fp);
    g->fp->wrong_every = 3;
    g->fp->q_temp = 2.0f;      /* flatter than p: often proposes ids outside top-k (p = 0) */
    g->fp->q_temp_odd = 0.08f; /* sharper than p: p/q < 1 on its favourite */
    g->prop = (spec_proposer){.ops = &fp_ops, .ctx = g->fp};
    g->d = fake_detok();
    engine_config cfg = {.max_model_len = max_len, .max_num_seqs = max_seqs, .max_num_batched_tokens = budget,
                         .max_waiting = 100000, .num_speculative_tokens = k,
                         .enable_prefix_caching = g_prefix_caching, .spec_adaptive = g_adaptive};
    specd_err err = {0};
    if (engine_create_ex(&cfg, &g->r, &g->d, NULL, NULL, &g->e, &err) != 0) fail_msg("%s", err.msg);
    if (with_proposer && engine_set_proposer(g->e, &g->prop, &err) != 0) fail_msg("%s", err.msg);
}

static void rig_free(rig *g) {
    engine_destroy(g->e);
    free(g->f.kv);
    free(g->fp);
}

static void run_idle(rig *g) {
    specd_err err = {0};
    for (int i = 0; i < 100000; i++) {
        int n = engine_step(g->e, &err);
        if (n == 0) return;
        if (n < 0) fail_msg("step: %s", err.msg);
    }
    fail_msg("engine never idle");
}

typedef struct result {
    int32_t toks[256];
    int32_t n;
    char text[4096];
    finish_reason fin;
    char stop_reason[64];
    int32_t usage;
    int n_outputs;
} result;

static void drain(engine_stream *s, result *r) {
    memset(r, 0, sizeof *r);
    engine_output *o;
    while (engine_stream_poll(s, &o)) {
        r->n_outputs++;
        for (size_t i = 0; i < o->n_tokens; i++) r->toks[r->n++] = o->token_ids[i];
        strncat(r->text, o->text, sizeof r->text - strlen(r->text) - 1);
        r->fin = o->finish;
        r->usage = o->n_completion_tokens;
        snprintf(r->stop_reason, sizeof r->stop_reason, "%s", o->stop_reason);
        engine_output_free(o);
    }
    engine_stream_release(s);
}

static engine_stream *sub(rig *g, const int32_t *p, int32_t n, const sampling_params *sp) {
    engine_request rq;
    memset(&rq, 0, sizeof rq);
    rq.sp = *sp;
    rq.prompt = p;
    rq.n_prompt = (size_t)n;
    specd_err err = {0};
    engine_stream *s = engine_submit(g->e, &rq, NULL, NULL, NULL, &err);
    if (!s) fail_msg("submit: %s", err.msg);
    return s;
}

static void make_prompt(int32_t *p, int32_t n, int32_t salt) {
    for (int32_t i = 0; i < n; i++) p[i] = (salt * 11 + i * 17) % (FAKE_VOCAB - 1);
}

static void greedy_lossless(int32_t k, int32_t n_blocks, bool expect_preempt) {
    rig g;
    rig_init(&g, n_blocks, 4, 96, 8, 32, k, true);
    enum { N = 8 };
    int32_t p[N][40], len[N], maxt[N];
    engine_stream *s[N];
    for (int i = 0; i < N; i++) {
        len[i] = 3 + i * 5;
        maxt[i] = 10 + (i * 7) % 21;
        make_prompt(p[i], len[i], i);
        sampling_params sp;
        sampling_params_init(&sp);
        sp.temperature = 0.0f;
        sp.max_tokens = maxt[i];
        sp.num_speculative_tokens = i == 3 ? 0 : -1; /* one plain request in the same batches */
        s[i] = sub(&g, p[i], len[i], &sp);
    }
    run_idle(&g);
    for (int i = 0; i < N; i++) {
        result r;
        drain(s[i], &r);
        int32_t ref[64];
        int32_t nr = fake_reference_greedy(p[i], len[i], maxt[i], 0, false, ref);
        assert_int_equal(r.n, nr);
        assert_memory_equal(r.toks, ref, (size_t)nr * sizeof *ref);
        assert_int_equal(r.usage, nr);
        assert_int_equal(r.fin, FINISH_LENGTH);
    }
    if (g.fp->violations) fail_msg("proposer contract: %d violations, first: %s", g.fp->violations, g.fp->first_violation);
    engine_stats st;
    engine_get_stats(g.e, &st);
    printf("k=%d: drafts %lld, draft tokens %lld, accepted %lld, preemptions %lld, acceptance length %.2f\n", k,
           (long long)st.spec_num_drafts_total, (long long)st.spec_num_draft_tokens_total,
           (long long)st.spec_num_accepted_tokens_total, (long long)st.preemptions_total,
           1.0 + (double)st.spec_num_accepted_tokens_total / (double)st.spec_num_drafts_total);
    assert_true(st.spec_num_drafts_total > 0);
    assert_true(st.spec_num_accepted_tokens_total > 0);
    assert_true(st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total);
    int64_t per = 0;
    for (int j = 0; j < 16; j++) per += st.spec_accepted_per_pos_total[j];
    assert_int_equal(per, st.spec_num_accepted_tokens_total);
    for (int j = k; j < 16; j++) assert_int_equal(st.spec_accepted_per_pos_total[j], 0);
    /* fewer steps than tokens: several tokens per step */
    assert_true(st.steps_total < st.generation_tokens_total);
    if (expect_preempt) assert_true(st.preemptions_total > 0);
    assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
    assert_int_equal(g.fp->frees, N);
    rig_free(&g);
}

static void test_greedy_lossless_k1(void **st) { (void)st; greedy_lossless(1, 128, false); }
static void test_greedy_lossless_k3(void **st) { (void)st; greedy_lossless(3, 128, false); }
static void test_greedy_lossless_k5(void **st) { (void)st; greedy_lossless(5, 128, false); }
static void test_greedy_lossless_preempt(void **st) { (void)st; greedy_lossless(3, 28, true); }

/* Same request with and without speculation: everything the client sees is equal. */
static void same_as_plain(const sampling_params *sp, int eos_bias, const int32_t *p, int32_t n, result *out) {
    result r[2];
    for (int spec = 0; spec < 2; spec++) {
        rig g;
        rig_init(&g, 64, 4, 96, 8, 64, 5, spec == 1);
        g.fp->wrong_every = 0; /* drafts always right: the stop falls inside an accepted block */
        g.f.eos_bias = eos_bias;
        g.fp->eos_bias = eos_bias; /* the drafts propose the EOS too */
        engine_stream *s = sub(&g, p, n, sp);
        run_idle(&g);
        drain(s, &r[spec]);
        engine_stats st;
        engine_get_stats(g.e, &st);
        if (spec) {
            assert_true(st.spec_num_accepted_tokens_total > 0);
            assert_true(r[1].n_outputs < r[1].n); /* several tokens per output */
        }
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        rig_free(&g);
    }
    assert_int_equal(r[0].n, r[1].n);
    assert_memory_equal(r[0].toks, r[1].toks, (size_t)r[0].n * sizeof(int32_t));
    assert_string_equal(r[0].text, r[1].text);
    assert_int_equal(r[0].fin, r[1].fin);
    assert_string_equal(r[0].stop_reason, r[1].stop_reason);
    assert_int_equal(r[0].usage, r[1].usage);
    *out = r[1];
}

static void test_stops_inside_block(void **st) {
    (void)st;
    int32_t p[9];
    make_prompt(p, 9, 3);
    sampling_params sp;
    sampling_params_init(&sp);
    sp.temperature = 0.0f;
    sp.max_tokens = 40;
    result r;
    /* EOS at context length 9 + 7: the 8th output */
    same_as_plain(&sp, 16, p, 9, &r);
    assert_int_equal(r.fin, FINISH_STOP);
    assert_int_equal(r.n, 8);
    assert_int_equal(r.toks[7], FAKE_EOS);
    assert_int_equal(r.usage, 8);
    /* a stop string: the text of the 7th reference token */
    int32_t ref[40];
    fake_reference_greedy(p, 9, 40, 0, false, ref);
    char stop[16];
    snprintf(stop, sizeof stop, "%s", fake_piece(ref[6]));
    const char *stops[1] = {stop};
    sp.stop = stops;
    sp.n_stop = 1;
    same_as_plain(&sp, 0, p, 9, &r);
    assert_int_equal(r.fin, FINISH_STOP);
    assert_string_equal(r.stop_reason, stop);
    assert_true(r.n <= 7);
    char want[512] = "";
    for (int i = 0; i < 6; i++) strcat(want, fake_piece(ref[i]));
    assert_int_equal(strncmp(r.text, want, strlen(r.text)), 0); /* text before the (earliest) match */
    /* max_tokens inside a block */
    sp.stop = NULL;
    sp.n_stop = 0;
    sp.max_tokens = 7;
    same_as_plain(&sp, 0, p, 9, &r);
    assert_int_equal(r.fin, FINISH_LENGTH);
    assert_int_equal(r.n, 7);
    assert_memory_equal(r.toks, ref, 7 * sizeof(int32_t));
}

#include "stats_chi2.h" /* gamma_q, chi2_sf */

/* chi-square of observed vs expected (probabilities), cells < 5 expected merged; returns the p-value */
static double chi2_pvalue(const long *obs, const double *prob, int n_cells, long n) {
    double chi = 0, m_obs = 0, m_exp = 0;
    int df = -1;
    for (int c = 0; c < n_cells; c++) {
        double e = prob[c] * (double)n;
        if (prob[c] == 0.0) {
            if (obs[c] != 0) return 0.0; /* impossible outcome observed */
            continue;
        }
        if (e < 5) {
            m_obs += (double)obs[c];
            m_exp += e;
            continue;
        }
        chi += ((double)obs[c] - e) * ((double)obs[c] - e) / e;
        df++;
    }
    if (m_exp > 0) {
        chi += (m_obs - m_exp) * (m_obs - m_exp) / m_exp;
        df++;
    }
    return df > 0 ? chi2_sf(chi, df) : 1.0;
}

static void test_sampling_lossless(void **st) {
    (void)st;
    /* sanity of the tail function: scipy.stats.chi2.sf(30.5779, 15) = 0.01, chi2.sf(7.814728, 3) = 0.05 */
    assert_true(fabs(chi2_sf(30.5779141, 15) - 0.01) < 1e-6);
    assert_true(fabs(chi2_sf(7.814727903, 3) - 0.05) < 1e-6);

    int32_t p[6];
    make_prompt(p, 6, 7);
    sampling_params sp;
    sampling_params_init(&sp);
    sp.temperature = 1.0f;
    sp.top_k = 4;
    sp.max_tokens = 4;
    sp.has_seed = true;
    sp.ignore_eos = true;

    /* exact distribution of (t1, t2, t3, t4): enumerate the nonzero paths of the
     * processed distributions (top_k 4: at most 4^4 paths), marginals of pairs */
    static double P12[FAKE_VOCAB * FAKE_VOCAB], P23[FAKE_VOCAB * FAKE_VOCAB], P34[FAKE_VOCAB * FAKE_VOCAB];
    memset(P12, 0, sizeof P12);
    memset(P23, 0, sizeof P23);
    memset(P34, 0, sizeof P34);
    sampler_work *w = sampler_work_create(FAKE_VOCAB);
    float l[FAKE_VOCAB], pr[4][FAKE_VOCAB];
    int32_t ctx[16];
    memcpy(ctx, p, sizeof p);
    sampler_hist h0 = {0};
    fake_logits(ctx, 6, 0, l);
    sampler_probs(w, &sp, &h0, l, pr[0]);
    for (int a = 0; a < FAKE_VOCAB; a++) {
        if (pr[0][a] == 0) continue;
        ctx[6] = a;
        fake_logits(ctx, 7, 0, l);
        sampler_probs(w, &sp, &h0, l, pr[1]);
        for (int b = 0; b < FAKE_VOCAB; b++) {
            if (pr[1][b] == 0) continue;
            ctx[7] = b;
            fake_logits(ctx, 8, 0, l);
            sampler_probs(w, &sp, &h0, l, pr[2]);
            for (int c = 0; c < FAKE_VOCAB; c++) {
                if (pr[2][c] == 0) continue;
                ctx[8] = c;
                fake_logits(ctx, 9, 0, l);
                sampler_probs(w, &sp, &h0, l, pr[3]);
                double pabc = (double)pr[0][a] * pr[1][b] * pr[2][c];
                P12[a * FAKE_VOCAB + b] += pabc;
                P23[b * FAKE_VOCAB + c] += pabc;
                for (int d = 0; d < FAKE_VOCAB; d++) P34[c * FAKE_VOCAB + d] += pabc * pr[3][d];
            }
        }
    }
    sampler_work_destroy(w);

    enum { RUNS = 20000, BATCH = 100 };
    for (int spec = 0; spec < 2; spec++) {
        static long O12[FAKE_VOCAB * FAKE_VOCAB], O23[FAKE_VOCAB * FAKE_VOCAB], O34[FAKE_VOCAB * FAKE_VOCAB];
        memset(O12, 0, sizeof O12);
        memset(O23, 0, sizeof O23);
        memset(O34, 0, sizeof O34);
        rig g;
        rig_init(&g, 512, 4, 32, BATCH, 4096, 2, spec == 1);
        for (int base = 0; base < RUNS; base += BATCH) {
            engine_stream *s[BATCH];
            for (int i = 0; i < BATCH; i++) {
                sp.seed = (uint64_t)(base + i) * 7919u + 13u;
                s[i] = sub(&g, p, 6, &sp);
            }
            run_idle(&g);
            for (int i = 0; i < BATCH; i++) {
                result r;
                drain(s[i], &r);
                assert_int_equal(r.n, 4);
                O12[r.toks[0] * FAKE_VOCAB + r.toks[1]]++;
                O23[r.toks[1] * FAKE_VOCAB + r.toks[2]]++;
                O34[r.toks[2] * FAKE_VOCAB + r.toks[3]]++;
            }
        }
        engine_stats stt;
        engine_get_stats(g.e, &stt);
        double pv12 = chi2_pvalue(O12, P12, FAKE_VOCAB * FAKE_VOCAB, RUNS);
        double pv23 = chi2_pvalue(O23, P23, FAKE_VOCAB * FAKE_VOCAB, RUNS);
        double pv34 = chi2_pvalue(O34, P34, FAKE_VOCAB * FAKE_VOCAB, RUNS);
        printf("%s: p-values (t1,t2) %.4g, (t2,t3) %.4g, (t3,t4) %.4g; drafts %lld, draft tokens %lld, "
               "accepted %lld\n",
               spec ? "speculative" : "plain", pv12, pv23, pv34, (long long)stt.spec_num_drafts_total,
               (long long)stt.spec_num_draft_tokens_total, (long long)stt.spec_num_accepted_tokens_total);
        if (spec) {
            assert_true(stt.spec_num_accepted_tokens_total > 0);
            assert_true(stt.spec_num_accepted_tokens_total < stt.spec_num_draft_tokens_total);
            if (g.fp->violations) fail_msg("proposer contract: %s", g.fp->first_violation);
        }
        assert_true(pv12 > 1e-6 / 6);
        assert_true(pv23 > 1e-6 / 6);
        assert_true(pv34 > 1e-6 / 6);
        assert_int_equal(stt.kv_blocks_free, stt.kv_blocks_total);
        rig_free(&g);
    }
}

/* Seeded sampling with SAMPLED drafts is reproducible: the same seeded
 * request gives the same tokens alone, repeated on the same engine, and
 * submitted mid-way into a batch of seven other sampling requests (its
 * drafts and its accept/reject draws come from its own streams, seeded from
 * its seed). Drafts must be both accepted and rejected for this to mean
 * anything. */
static void seeded_run(rig *g, const int32_t *p, int32_t n, int32_t n_others, result *out) {
    sampling_params sp;
    sampling_params_init(&sp);
    sp.temperature = 1.0f;
    sp.top_k = 6;
    sp.max_tokens = 40;
    sp.ignore_eos = true;
    sp.has_seed = true;
    engine_stream *o[8];
    for (int32_t i = 0; i < n_others; i++) {
        int32_t q[20];
        make_prompt(q, 8 + i, 40 + i);
        sampling_params so = sp;
        so.seed = 900u + (uint64_t)i;
        so.max_tokens = 20 + 3 * i;
        o[i] = sub(g, q, 8 + i, &so);
    }
    specd_err err = {0};
    for (int i = 0; i < 3 && n_others > 0; i++)
        if (engine_step(g->e, &err) < 0) fail_msg("step: %s", err.msg);
    sp.seed = 1234;
    engine_stream *s = sub(g, p, n, &sp);
    run_idle(g);
    drain(s, out);
    for (int32_t i = 0; i < n_others; i++) {
        result r;
        drain(o[i], &r);
    }
}

static void seeded_reproducible(bool adaptive) {
    g_adaptive = adaptive;
    rig g1, g2;
    rig_init(&g1, 256, 4, 96, 16, 256, 3, true);
    rig_init(&g2, 256, 4, 96, 16, 256, 3, true);
    g_adaptive = false;
    g1.fp->q_temp_odd = g2.fp->q_temp_odd = 0; /* the same q whatever the sequence id */
    g1.fp->q_temp = g2.fp->q_temp = 1.0f;       /* q near p: drafts accepted and rejected */
    int32_t p[10];
    make_prompt(p, 10, 1);
    result a, b, c;
    seeded_run(&g1, p, 10, 0, &a);
    seeded_run(&g1, p, 10, 0, &b);
    seeded_run(&g2, p, 10, 7, &c);
    assert_int_equal(a.n, 40);
    assert_int_equal(b.n, 40);
    assert_int_equal(c.n, 40);
    assert_memory_equal(a.toks, b.toks, sizeof(int32_t) * 40);
    assert_memory_equal(a.toks, c.toks, sizeof(int32_t) * 40);
    for (int i = 0; i < 2; i++) {
        rig *g = i ? &g2 : &g1;
        if (g->fp->violations) fail_msg("proposer contract: %s", g->fp->first_violation);
        engine_stats st;
        engine_get_stats(g->e, &st);
        printf("seeded (adaptive %d) engine %d: drafts %lld, draft tokens %lld, accepted %lld\n", adaptive, i,
               (long long)st.spec_num_drafts_total, (long long)st.spec_num_draft_tokens_total,
               (long long)st.spec_num_accepted_tokens_total);
        assert_true(st.spec_num_accepted_tokens_total > 0);
        assert_true(st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total);
    }
    rig_free(&g1);
    rig_free(&g2);
}

static void test_seeded_sampling_reproducible(void **st) { (void)st; seeded_reproducible(false); }
static void test_seeded_sampling_reproducible_adaptive(void **st) { (void)st; seeded_reproducible(true); }

/* ---------------------------------------------------------------- adaptive k */

static uint64_t g_lcg = 88172645463325252ull;
static double urand(void) {
    g_lcg = g_lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(g_lcg >> 11) * 0x1.0p-53;
}

/* E[tokens] of a step with k drafts by enumerating its outcomes: m drafts
 * accepted (m = 0..k) with probability a_1..a_m (1 - a_{m+1}) (no factor for
 * m = k), emitting m + 1 tokens. Independent of spec_adapt_expected's sum. */
static double expected_by_outcomes(const double *a, int32_t k) {
    double e = 0;
    for (int32_t m = 0; m <= k; m++) {
        double p = 1;
        for (int32_t j = 0; j < m; j++) p *= a[j];
        if (m < k) p *= 1 - a[m];
        e += p * (double)(m + 1);
    }
    return e;
}

/* The cost model's choice against a brute-force argmax over k of
 * expected_by_outcomes / (k t_draft + t_verify[k]), on a hand example and
 * 5,000 random (acceptance, cost) cases. */
static void test_adapt_choose_brute_force(void **st) {
    (void)st;
    /* by hand: E = 1, 1.8, 2.2, 2.28; T = 1, 1.2, 1.4, 1.6; rates 1, 1.5, 1.571, 1.425 */
    const double a0[3] = {0.8, 0.5, 0.2}, tv0[4] = {1.0, 1.1, 1.2, 1.3};
    assert_int_equal(spec_adapt_choose(a0, 3, 0.1, tv0), 2);
    assert_true(fabs(spec_adapt_expected(a0, 3) - 2.28) < 1e-12);
    int hist[16] = {0};
    for (int c = 0; c < 5000; c++) {
        int32_t K = 1 + (int32_t)(urand() * 15);
        double a[15], tv[16];
        for (int32_t i = 0; i < K; i++) a[i] = c % 7 == 0 ? 1.0 : urand(); /* some oracle heads */
        double td = urand() * 0.3, t = 0.2 + urand();
        for (int32_t k = 0; k <= K; k++) {
            tv[k] = t;
            t += urand() * (c % 3 == 0 ? 1.0 : 0.1); /* compute-bound and memory-bound shapes */
        }
        double best = -1;
        int32_t bk = -1;
        for (int32_t k = 0; k <= K; k++) {
            double e = expected_by_outcomes(a, k);
            assert_true(fabs(e - spec_adapt_expected(a, k)) < 1e-9);
            double r = e / ((double)k * td + tv[k]);
            if (r > best + 1e-12) best = r, bk = k;
        }
        int32_t got = spec_adapt_choose(a, K, td, tv);
        double rg = expected_by_outcomes(a, got) / ((double)got * td + tv[got]);
        if (got != bk && fabs(rg - best) > 1e-9 * best)
            fail_msg("case %d: chose k=%d (rate %.9g), brute force k=%d (rate %.9g)", c, got, rg, bk, best);
        hist[got]++;
    }
    printf("brute-force cases by chosen k:");
    for (int k = 0; k < 16; k++) printf(" %d", hist[k]);
    printf("\n");
    assert_true(hist[0] > 100 && hist[1] > 100); /* the cases exercise both ends */
    int deep = 0;
    for (int k = 4; k < 16; k++) deep += hist[k];
    assert_true(deep > 100);
}

/* The acceptance estimate: exact values after known observations, the
 * prior, decay toward the prior without drafts. */
static void test_adapt_acceptance_estimate(void **st) {
    (void)st;
    spec_accept a;
    spec_accept_init(&a);
    double r[3];
    spec_accept_rates(&a, 3, r);
    for (int i = 0; i < 3; i++) assert_true(fabs(r[i] - SPEC_ADAPT_P0) < 1e-12);
    spec_accept_observe(&a, 3, 1, true); /* draft 1 accepted, draft 2 rejected, draft 3 unseen */
    spec_accept_rates(&a, 3, r);
    const double w = SPEC_ADAPT_W0, p0 = SPEC_ADAPT_P0;
    const double r0 = (1 + w * p0) / (1 + w), r1 = (0 + w * r0) / (1 + w);
    assert_true(fabs(r[0] - r0) < 1e-6);
    assert_true(fabs(r[1] - r1) < 1e-6);
    assert_true(fabs(r[2] - r1) < 1e-6); /* unseen: the previous position's estimate */
    spec_accept_observe(&a, 3, 2, false); /* a stop after 2 accepted: draft 3 not an outcome */
    spec_accept_rates(&a, 3, r);
    const double g = SPEC_ADAPT_GAMMA_OBS;
    const double q0 = (g + 1 + w * p0) / (g + 1 + w), q1 = (1 + w * q0) / (g + 1 + w);
    assert_true(fabs(r[0] - q0) < 1e-6);
    assert_true(fabs(r[1] - q1) < 1e-6);
    assert_true(fabs(r[2] - q1) < 1e-6);
    spec_accept_init(&a); /* a head that never agrees: 200 rejections of draft 1, then 300 idle steps */
    double n = 0;
    for (int i = 0; i < 200; i++) {
        spec_accept_observe(&a, 3, 0, true);
        n = g * n + 1;
    }
    spec_accept_rates(&a, 1, r);
    assert_true(fabs(r[0] - w * p0 / (n + w)) < 1e-6);
    assert_true(r[0] < 0.03);
    for (int i = 0; i < 300; i++) {
        spec_accept_idle(&a);
        n *= SPEC_ADAPT_GAMMA_IDLE;
    }
    spec_accept_rates(&a, 1, r);
    assert_true(fabs(r[0] - w * p0 / (n + w)) < 1e-5);
    assert_true(r[0] > 0.2); /* back toward the prior */
    /* the choice's rates: the first draft's mean + UCB standard deviations of the discounted counts */
    double u[2];
    spec_accept_upper(&a, 2, u);
    spec_accept_rates(&a, 2, r);
    assert_true(fabs(u[1] - r[1]) < 1e-12); /* deeper positions: their means */
    assert_true(fabs(u[0] - fmin(1.0, r[0] + SPEC_ADAPT_UCB * sqrt(r[0] * (1 - r[0]) / (n + w)))) < 1e-5);
    assert_true(u[0] > r[0]);
}

/* Engine runs with adaptive speculation on a fake runner whose pass costs
 * BASE + PER_TOKEN * n microseconds (the fake proposer costs ~nothing):
 * greedy output equals the reference; returns the chosen-k histogram. */
static void adaptive_run(int n_req, int base_us, int per_token_us, int wrong_every, int wrong_odd, int32_t K, int64_t *hist,
                         fake_prop *fp_out) {
    g_adaptive = true;
    g_sleep_us = base_us;
    g_sleep_us_per_token = per_token_us;
    rig g;
    rig_init(&g, 512, 4, 256, 8, 256, K, true);
    g_adaptive = false;
    g_sleep_us = g_sleep_us_per_token = 0;
    g.fp->wrong_every = wrong_every;
    g.fp->wrong_odd = wrong_odd;
    enum { N = 6 };
    int32_t p[N][24], len[N], maxt = 200;
    engine_stream *s[N];
    for (int i = 0; i < n_req; i++) {
        len[i] = 4 + 3 * i;
        make_prompt(p[i], len[i], 20 + i);
        sampling_params sp;
        sampling_params_init(&sp);
        sp.temperature = 0.0f;
        sp.max_tokens = maxt;
        s[i] = sub(&g, p[i], len[i], &sp);
    }
    run_idle(&g);
    for (int i = 0; i < n_req; i++) {
        result r;
        drain(s[i], &r);
        int32_t ref[256];
        int32_t nr = fake_reference_greedy(p[i], len[i], maxt, 0, false, ref);
        assert_int_equal(r.n, nr);
        assert_memory_equal(r.toks, ref, (size_t)nr * sizeof *ref);
    }
    if (g.fp->violations) fail_msg("proposer contract: %d violations, first: %s", g.fp->violations, g.fp->first_violation);
    engine_stats st;
    engine_get_stats(g.e, &st);
    memcpy(hist, st.spec_k_chosen_total, sizeof st.spec_k_chosen_total);
    printf("adaptive (%d requests, pass %d + %d us/token, wrong_every %d, wrong_odd %d): chosen k", n_req, base_us,
           per_token_us, wrong_every, wrong_odd);
    for (int k = 0; k <= K; k++) printf(" %lld", (long long)hist[k]);
    printf("; drafts %lld, accepted %lld\n", (long long)st.spec_num_drafts_total,
           (long long)st.spec_num_accepted_tokens_total);
    assert_true(st.spec_adaptive);
    assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
    if (fp_out) memcpy(fp_out, g.fp, sizeof *fp_out);
    rig_free(&g);
}

static int64_t hist_total(const int64_t *h) {
    int64_t t = 0;
    for (int k = 0; k < 16; k++) t += h[k];
    return t;
}

/* A head that never agrees (every draft wrong): k = 0 on most steps (only
 * learning and probes); an oracle head: k = K on most steps. Memory-bound
 * passes (2 ms + 0.15 ms per token; six sequences in the batch). */
static void test_adaptive_constant_and_oracle_heads(void **st) {
    (void)st;
    int64_t h[16];
    adaptive_run(6, 2000, 150, 1, 0, 3, h, NULL);
    assert_true(h[0] >= hist_total(h) * 8 / 10);
    adaptive_run(6, 2000, 150, 0, 0, 3, h, NULL);
    assert_true(h[3] >= hist_total(h) * 8 / 10);
}

/* The same head (a third of the drafts wrong) drafts when passes are
 * memory-bound (2 ms + 0.1 ms per token) and stops when they are
 * compute-bound (0.1 ms + 0.5 ms per token: verifying k + 1 tokens costs
 * k + 1 plain steps). */
static void test_adaptive_compute_bound(void **st) {
    (void)st;
    int64_t h[16];
    adaptive_run(6, 2000, 100, 3, 0, 3, h, NULL);
    assert_true(h[0] <= hist_total(h) / 5);
    adaptive_run(6, 100, 500, 3, 0, 3, h, NULL);
    assert_true(h[0] >= hist_total(h) * 8 / 10);
}

/* The batch decides: with passes of 1 ms + 0.3 ms per token and the same
 * head (half the drafts wrong), one request alone drafts (one more verified
 * token costs 23% of a plain pass: drafting pays above 23% acceptance) and
 * six at once do not (six more tokens cost 64% of their plain pass of 6):
 * the verify cost is the sequence's share of a pass at the current batch. */
static void test_adaptive_batch_size(void **st) {
    (void)st;
    int64_t h[16];
    adaptive_run(1, 1000, 300, 2, 0, 3, h, NULL);
    assert_true(h[0] <= hist_total(h) / 4);
    adaptive_run(6, 1000, 300, 2, 0, 3, h, NULL);
    assert_true(h[0] >= hist_total(h) * 3 / 4);
}

/* Per sequence in one batch: odd sequence ids get a head that never agrees
 * (wrong_odd), even ones an oracle: the odd ones draft on at most a quarter
 * of their ~200 decode steps (learning, then probes), the even ones draft K
 * on most of theirs; greedy output stays the reference for all (k = 0 and
 * k = K sequences verified in the same passes). */
static void test_adaptive_per_sequence(void **st) {
    (void)st;
    int64_t h[16];
    static fake_prop fp;
    adaptive_run(6, 2000, 150, 0, 1, 4, h, &fp);
    long odd = 0, even_k = 0, even = 0;
    for (int id = 0; id < 6; id++)
        for (int k = 1; k < 16; k++) {
            if (id & 1) odd += fp.k_seen[id][k];
            else even += fp.k_seen[id][k], even_k += k == 4 ? fp.k_seen[id][k] : 0;
        }
    printf("proposals: odd sequences %ld, even sequences %ld (%ld with k = 4)\n", odd, even, even_k);
    assert_true(even_k >= even * 3 / 4);
    assert_true(odd <= 3 * 200 / 4);
}

/* Prefix caching with speculation: hits feed the proposer the cached
 * positions' features from the aux cache (checked by the fake proposer: no
 * feature gaps, rows carry the right [token, position]); outputs stay equal to
 * the reference; hits and acceptance both happen. */
static void test_prefix_cache_with_speculation(void **st) {
    (void)st;
    g_prefix_caching = true;
    rig g;
    rig_init(&g, 96, 4, 96, 8, 32, 3, true);
    g_prefix_caching = false;
    int32_t base[30];
    make_prompt(base, 30, 5);
    for (int round = 0; round < 3; round++) {
        engine_stream *s[4];
        int32_t p[4][40], len[4];
        for (int i = 0; i < 4; i++) {
            len[i] = 30 + i * 3;
            memcpy(p[i], base, sizeof base);
            for (int j = 30; j < len[i]; j++) p[i][j] = (round * 5 + i * 3 + j) % 60;
            sampling_params sp;
            sampling_params_init(&sp);
            sp.temperature = 0.0f;
            sp.max_tokens = 12;
            s[i] = sub(&g, p[i], len[i], &sp);
        }
        run_idle(&g);
        for (int i = 0; i < 4; i++) {
            result r;
            drain(s[i], &r);
            int32_t ref[16];
            int32_t nr = fake_reference_greedy(p[i], len[i], 12, 0, false, ref);
            assert_int_equal(r.n, nr);
            assert_memory_equal(r.toks, ref, (size_t)nr * sizeof *ref);
        }
    }
    if (g.fp->violations) fail_msg("proposer contract: %d violations, first: %s", g.fp->violations, g.fp->first_violation);
    engine_stats stt;
    engine_get_stats(g.e, &stt);
    printf("prefix hits %lld of %lld; drafts %lld, accepted %lld\n", (long long)stt.prefix_cache_hits_total,
           (long long)stt.prefix_cache_queries_total, (long long)stt.spec_num_drafts_total,
           (long long)stt.spec_num_accepted_tokens_total);
    assert_true(stt.prefix_cache_hits_total >= 2 * 4 * 28); /* rounds 2 and 3: 7 full blocks of the shared 30 */
    assert_true(stt.spec_num_accepted_tokens_total > 0);
    assert_int_equal(stt.kv_blocks_free, stt.kv_blocks_total);
    rig_free(&g);
}

/* engine_set_proposer refuses a proposer with only one of the device-q pair (propose_dev, dev_q_backend), naming
 * the missing one, and one without propose; the full set is accepted. */
static int half_propose_dev(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max,
                            const float *temps, int32_t *out, spec_dev_q *dq, specd_err *err) {
    (void)ctx, (void)ids, (void)k, (void)n, (void)k_max, (void)temps, (void)out, (void)dq;
    return specd_err_set(err, "never called");
}
static const struct backend *half_dev_q_backend(void *ctx) { (void)ctx; return NULL; }
static void test_proposer_ops_refused(void **st) {
    (void)st;
    rig g;
    rig_init(&g, 64, 16, 128, 4, 64, 2, false);
    spec_proposer_ops ops = fp_ops;
    spec_proposer p = {.ops = &ops, .ctx = g.fp};
    specd_err err = {0};
    ops.propose_dev = half_propose_dev;
    assert_int_equal(engine_set_proposer(g.e, &p, &err), -1);
    assert_non_null(strstr(err.msg, "no dev_q_backend"));
    ops.propose_dev = NULL, ops.dev_q_backend = half_dev_q_backend;
    assert_int_equal(engine_set_proposer(g.e, &p, &err), -1);
    assert_non_null(strstr(err.msg, "no propose_dev"));
    ops.dev_q_backend = NULL, ops.propose = NULL;
    assert_int_equal(engine_set_proposer(g.e, &p, &err), -1);
    assert_non_null(strstr(err.msg, "without a propose op"));
    ops = fp_ops, ops.propose_dev = half_propose_dev, ops.dev_q_backend = half_dev_q_backend;
    assert_int_equal(engine_set_proposer(g.e, &p, &err), 0);
    rig_free(&g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_proposer_ops_refused),
        cmocka_unit_test(test_greedy_lossless_k1),      cmocka_unit_test(test_greedy_lossless_k3),
        cmocka_unit_test(test_greedy_lossless_k5),      cmocka_unit_test(test_greedy_lossless_preempt),
        cmocka_unit_test(test_stops_inside_block),      cmocka_unit_test(test_sampling_lossless),
        cmocka_unit_test(test_prefix_cache_with_speculation),
        cmocka_unit_test(test_seeded_sampling_reproducible),
        cmocka_unit_test(test_seeded_sampling_reproducible_adaptive),
        cmocka_unit_test(test_adapt_choose_brute_force),
        cmocka_unit_test(test_adapt_acceptance_estimate),
        cmocka_unit_test(test_adaptive_constant_and_oracle_heads),
        cmocka_unit_test(test_adaptive_compute_bound),
        cmocka_unit_test(test_adaptive_batch_size),
        cmocka_unit_test(test_adaptive_per_sequence),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
