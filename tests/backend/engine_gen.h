/*
 * engine_gen.h: generations through the engine on two backends, compared
 * token for token (tests/backend/test_cuda_sample.c on the fake device,
 * tests/kernels/test_cuda_backend.c on a GPU). Header-only; one includer per
 * binary. The includer defines, before including it:
 *   EG_EXACT        1: logprobs compared bitwise (the fake device reproduces
 *                   the CPU's logits bit for bit); 0: within 1e-4 (a GPU's
 *                   f32 reductions run in another order)
 * and, on the fake device (cuda_fake/cuda_runtime_api.h included first), the
 * bytes copied device -> host are checked per step against the design
 * (engine_gen_run's comment); on a real device they are not counted.
 *
 * eg_scenarios runs every scenario: greedy; seeded sampling at n = 2 with
 * temperature, top-k, top-p, min-p, penalties, logit_bias, min_tokens;
 * logprobs; greedy with penalties and a biased EG_EOS behind min_tokens;
 * speculative k = 3 with an oracle proposer (greedy chains verified on the
 * device, a sampling chain with q rows on the host, and the same chain with
 * its q rows left on the device: propose_dev, q over a draft vocabulary of
 * half the ids read through t2d, verified on the device), and speculative
 * greedy == plain greedy. The reference engine runs on `mc` (a host-visible
 * backend: host sampling), the other on `md` with runner.sample_be = `dev`.
 */
#ifndef SPECD_TESTS_BACKEND_ENGINE_GEN_H
#define SPECD_TESTS_BACKEND_ENGINE_GEN_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/runtime/engine_ex.h"
#include "engine/runtime/proposer.h"

#ifndef EG_EXACT
#error "define EG_EXACT (1: bitwise logprobs, 0: within 1e-4) before including engine_gen.h"
#endif
#ifdef SPECD_TESTS_CUDA_FAKE_RUNTIME_API_H
#define EG_FAKE 1
#else
#define EG_FAKE 0
#endif

static int eg_fail;
#define EG_EXPECT(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); eg_fail++; } } while (0)

#define EG_MAXR 4
#define EG_MAXN 32
#define EG_BS 16
#define EG_EOS 2
static int32_t eg_vocab;

/* ---- detokenizer: ids as "t<id> " (only the token stream matters here) ---- */
static void *eg_dt_create(void *ctx, bool skip) { (void)ctx, (void)skip; return calloc(1, 1); }
static void eg_dt_destroy(void *s) { free(s); }
static int eg_dt_push(void *s, int32_t id, char **out, size_t *len, size_t *cap) {
    (void)s;
    char b[16];
    int n = snprintf(b, sizeof b, "t%d ", id);
    if (*len + (size_t)n + 1 > *cap) {
        size_t c = *cap ? *cap * 2 : 64;
        while (c < *len + (size_t)n + 1) c *= 2;
        char *nb = realloc(*out, c);
        if (!nb) return -1;
        *out = nb, *cap = c;
    }
    memcpy(*out + *len, b, (size_t)n + 1);
    *len += (size_t)n;
    return 0;
}
static int eg_dt_flush(void *s, char **out, size_t *len, size_t *cap) { (void)s, (void)out, (void)len, (void)cap; return 0; }
static const int32_t eg_eos[1] = {EG_EOS};

/* ---- oracle proposer: drafts the plain greedy continuation of its request (g_oracle_ref), every third
 * draft corrupted. q (when asked): for a sampled row (temperature > 0) a dense distribution over a DRAFT
 * vocabulary of EG_VD ids (draft id c is target id eg_or_used(c); half the vocabulary, so some drafts fall
 * outside it, where q = 0), with extra mass on the draft; scattered to target ids on the host (propose),
 * or left as draft-vocabulary rows in device memory with a t2d map (propose_dev, when eg_or_qdev is set and
 * the engine samples on eg_dev): host and device verify the same q. Greedy rows: one-hot at the draft ---- */
#define EG_VD 256
static int eg_or_qdev;          /* offer propose_dev (q rows on eg_dev) */
static backend *eg_or_be;       /* the device backend of the q rows (eg_scenarios sets it) */
static float *eg_or_dq;         /* eg_or_be memory: [EG_MAXR * 16, EG_VD] q rows */
static int32_t *eg_or_dt2d;     /* eg_or_be memory: I32 [vocab] */
static long eg_or_dev_rows;     /* dense q rows propose_dev left on the device */
static int32_t eg_or_used(int32_t c) { return (int32_t)(((int64_t)c * 5 + 1) % eg_vocab); }
/* Row j's q over the draft vocabulary (EG_VD floats, normalised) at n_tok known tokens, draft d. */
static void eg_or_qrow(int32_t n_tok, int32_t j, int32_t d, float *qr) {
    double w[EG_VD], sum = 0;
    for (int32_t c = 0; c < EG_VD; c++) {
        w[c] = 1.0 + (double)(((uint64_t)c * 13u + (uint64_t)n_tok * 7u + (uint64_t)j * 3u) % 17u);
        if (eg_or_used(c) == d) w[c] += 2000.0;
        sum += w[c];
    }
    for (int32_t c = 0; c < EG_VD; c++) qr[c] = (float)(w[c] / sum);
}
static int32_t eg_or_tok[64][256], eg_or_n[64];
static const int32_t *eg_or_prompt[EG_MAXR];
static int32_t eg_or_np[EG_MAXR], eg_or_ref[EG_MAXR][EG_MAXN];
static int eg_or_count; /* requests the oracle knows */
static int eg_or_extend(void *ctx, int64_t id, const int32_t *t, int32_t n, int32_t pos0, const float *aux, specd_err *err) {
    (void)ctx, (void)aux, (void)err;
    for (int32_t i = 0; i < n && pos0 + i < 256; i++) eg_or_tok[id % 64][pos0 + i] = t[i];
    eg_or_n[id % 64] = pos0 + n;
    return 0;
}
/* The drafts and their q: host rows over the target vocabulary into q (when not NULL), or, with dq, device
 * rows over the draft vocabulary into eg_or_dq (row i k_max + j; -1 in dq->row for one-hot). */
static int eg_or_draft(const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                       int32_t *out, float *q, spec_dev_q *dq, specd_err *err) {
    float qr[EG_VD];
    for (int32_t i = 0; i < n; i++) {
        const int64_t id = ids[i] % 64;
        int best = -1;
        for (int r = 0; r < eg_or_count; r++)
            if (eg_or_n[id] >= eg_or_np[r] && memcmp(eg_or_tok[id], eg_or_prompt[r], (size_t)eg_or_np[r] * 4) == 0) best = r;
        for (int32_t j = 0; j < k_max; j++) {
            const int32_t gi = best < 0 ? -1 : eg_or_n[id] - eg_or_np[best] + j;
            int32_t d = j < k[i] && gi >= 0 && gi < EG_MAXN ? eg_or_ref[best][gi] : -1;
            if (d >= 0 && ((uint64_t)eg_or_n[id] * 31u + (uint64_t)j * 7u) % 3 == 0) d = (d + 1) % eg_vocab;
            out[i * k_max + j] = d;
            const bool dense = d >= 0 && temps && temps[i] > 0.0f;
            if (dense) eg_or_qrow(eg_or_n[id], j, d, qr);
            if (q) {
                float *qj = q + ((size_t)i * k_max + j) * (size_t)eg_vocab;
                memset(qj, 0, sizeof(float) * (size_t)eg_vocab);
                if (dense)
                    for (int32_t c = 0; c < EG_VD; c++) qj[eg_or_used(c)] = qr[c];
                else if (d >= 0)
                    qj[d] = 1.0f;
            }
            if (dq) {
                const int32_t row = i * k_max + j;
                dq->row[row] = dense ? row : -1;
                if (dense && eg_or_be->ops->upload(eg_or_be->ctx, eg_or_dq + (size_t)row * EG_VD, qr, sizeof qr) < 0)
                    return specd_err_set(err, "oracle: q row upload failed");
                eg_or_dev_rows += dense;
            }
        }
    }
    return 0;
}
static int eg_or_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                      int32_t *out, float *q, specd_err *err) {
    (void)ctx;
    return eg_or_draft(ids, k, n, k_max, temps, out, q, NULL, err);
}
static const struct backend *eg_or_dev_q_backend(void *ctx) {
    (void)ctx;
    return eg_or_qdev && eg_or_dq ? eg_or_be : NULL;
}
static int eg_or_propose_dev(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max,
                             const float *temps, int32_t *out, spec_dev_q *dq, specd_err *err) {
    (void)ctx;
    if (n > EG_MAXR || k_max > 16) return specd_err_set(err, "oracle: %d sequences x %d drafts", n, k_max);
    dq->q = eg_or_dq, dq->q_vocab = EG_VD, dq->t2d = eg_or_dt2d;
    return eg_or_draft(ids, k, n, k_max, temps, out, NULL, dq, err);
}
static void eg_or_free(void *ctx, int64_t id) { (void)ctx, eg_or_n[id % 64] = 0; }
static void eg_or_trunc(void *ctx, int64_t id, int32_t n) { (void)ctx; if (eg_or_n[id % 64] > n) eg_or_n[id % 64] = n; }
static const spec_proposer_ops eg_or_ops = {.extend = eg_or_extend, .propose = eg_or_propose, .truncate = eg_or_trunc,
                                         .free_seq = eg_or_free, .dev_q_backend = eg_or_dev_q_backend,
                                         .propose_dev = eg_or_propose_dev};
static spec_proposer eg_oracle = {.ops = &eg_or_ops, .ctx = NULL};

/* ---- one generation of up to EG_MAXR requests on an engine stepped on this thread ---- */
typedef struct eg_req {
    const int32_t *prompt;
    int32_t n_prompt;
    sampling_params sp;
    bool prompt_logprobs;
} eg_req;
typedef struct eg_result {
    int32_t tok[EG_MAXR][EG_MAXN], n[EG_MAXR];
    token_logprob lp[EG_MAXR][EG_MAXN];
    int32_t n_lp[EG_MAXR];
    token_logprob plp[EG_MAXR][EG_MAXN]; /* prompt logprobs (prompts shorter than EG_MAXN) */
    int32_t n_plp[EG_MAXR];
    int steps, bytes_bad;
    size_t d2h, h2d; /* bytes over the run (fake device only) */
} eg_result;

static size_t eg_d2h(void) {
#if EG_FAKE
    return fake_d2h_bytes;
#else
    return 0;
#endif
}
static size_t eg_h2d(void) {
#if EG_FAKE
    return fake_h2d_bytes;
#else
    return 0;
#endif
}
static int eg_sample_calls(void) {
#if EG_FAKE
    return fake_kn_sample_calls;
#else
    return 0;
#endif
}
static int eg_verify_calls(void) {
#if EG_FAKE
    return fake_kn_spec_verify_calls;
#else
    return 0;
#endif
}

static int eg_verify_q_rows(void) {
#if EG_FAKE
    return (int)fake_kn_spec_verify_q_rows;
#else
    return 0;
#endif
}

static int eg_fwd(void *ctx, const model_batch *b, specd_err *err) { return model_forward(ctx, b, err); }

/* The includer may route a model's forward elsewhere (tensor parallelism: rank 0's tp_runner_forward, which
 * honours logits_dev): eg_route(m, fn, ctx); and turn the per-step byte check off (eg_check_bytes = 0) where
 * the collectives stage through the host (their downloads are not the sampler's). */
static model *eg_route_m[2];
static int (*eg_route_fn[2])(void *ctx, const model_batch *b, specd_err *err);
static void *eg_route_ctx[2];
static int eg_check_bytes = 1;
static inline void eg_route(int slot, model *m, int (*fn)(void *, const model_batch *, specd_err *), void *ctx) {
    eg_route_m[slot] = m, eg_route_fn[slot] = fn, eg_route_ctx[slot] = ctx;
}

static void eg_run(model *m, backend *sample_be, int32_t k, const eg_req *rq, int n_req, eg_result *res) {
    memset(res, 0, sizeof *res);
    engine_runner r = {.ctx = m, .forward = eg_fwd, .vocab = eg_vocab, .hidden = model_get_config(m)->hidden,
                       .block_size = EG_BS, .n_blocks = model_kv_n_blocks(m), .sample_be = sample_be};
    for (int i = 0; i < 2; i++)
        if (eg_route_m[i] == m) r.ctx = eg_route_ctx[i], r.forward = eg_route_fn[i];
    engine_detok d = {.stream_create = eg_dt_create, .stream_destroy = eg_dt_destroy, .push = eg_dt_push, .flush = eg_dt_flush,
                      .eos_ids = eg_eos, .n_eos = 1};
    engine_config cfg = {.max_model_len = 160, .max_num_seqs = 8, .max_num_batched_tokens = 256, .max_waiting = 64,
                         .num_speculative_tokens = k};
    engine *e = NULL;
    specd_err err = {{0}};
    if (engine_create_ex(&cfg, &r, &d, m, NULL, &e, &err) != 0) { EG_EXPECT(0, "engine: %s", err.msg); return; }
    memset(eg_or_n, 0, sizeof eg_or_n);
    if (k > 0 && engine_set_proposer(e, &eg_oracle, &err) != 0) { EG_EXPECT(0, "proposer: %s", err.msg); return; }
    engine_stream *st[EG_MAXR];
    int64_t sid[EG_MAXR];
    bool seen[EG_MAXR] = {0}, done[EG_MAXR] = {0};
    for (int i = 0; i < n_req; i++) {
        engine_request q;
        memset(&q, 0, sizeof q);
        q.sp = rq[i].sp;
        q.prompt = rq[i].prompt;
        q.n_prompt = (size_t)rq[i].n_prompt;
        q.prompt_logprobs = rq[i].prompt_logprobs;
        st[i] = engine_submit(e, &q, NULL, NULL, NULL, &err);
        if (!st[i]) { EG_EXPECT(0, "submit: %s", err.msg); return; }
        sid[i] = engine_stream_seq_id(st[i]);
    }
    const size_t d2h0 = eg_d2h(), h2d0 = eg_h2d();
    for (int step = 0; step < 400; step++) {
        const size_t d0 = eg_d2h();
        const int n = engine_step(e, &err);
        if (n < 0) { EG_EXPECT(0, "step: %s", err.msg); break; }
        if (n == 0) break;
        res->steps++;
        if (sample_be && EG_FAKE && eg_check_bytes) { /* what crossed the bus, against what the design allows */
            const int64_t *ids;
            const int32_t *nt;
            const size_t ns = engine_last_schedule(e, &ids, &nt);
            size_t host = 0, rows = 0, n_verify = 0, kmax = 0;
            for (size_t j = 0; j < ns; j++) {
                int ri = 0;
                while (ri < n_req && sid[ri] != ids[j]) ri++;
                if (ri == n_req) continue;
                const bool prefill = !seen[ri];
                seen[ri] = true;
                const size_t nd = prefill ? 0 : (size_t)nt[j] - 1, nr = 1 + nd;
                if (prefill && rq[ri].prompt_logprobs) /* positions 0 .. n_prompt - 2: raw rows */
                    host += (size_t)(rq[ri].n_prompt - 1) * (size_t)eg_vocab * 4;
                const bool sampling = rq[ri].sp.temperature >= 1e-5f;
                if (nd > 0 && sampling && !eg_or_qdev) { /* q rows on the host: verified there over raw rows */
                    host += nr * (size_t)eg_vocab * 4;
                    continue;
                }
                rows += nr;
                if (nd > 0) n_verify++, kmax = nd > kmax ? nd : kmax;
                if (rq[ri].sp.logprobs >= 0) host += nr * (size_t)eg_vocab * 4;
            }
            const size_t want = 8 + host + (rows ? 4 * (rows + n_verify * (kmax + 2)) : 0);
            const size_t got = eg_d2h() - d0;
            if (got != want && res->bytes_bad++ < 3)
                printf("FAIL step %d: %zu bytes device -> host, expected %zu (%zu rows, %zu chains, k_max %zu, %zu raw)\n",
                       step, got, want, rows, n_verify, kmax, host);
        }
        for (int i = 0; i < n_req; i++) {
            engine_output *o;
            while (!done[i] && engine_stream_wait(st[i], &o, 0.0)) {
                for (size_t t = 0; t < o->n_prompt_logprobs && res->n_plp[i] < EG_MAXN; t++)
                    res->plp[i][res->n_plp[i]++] = o->prompt_logprobs[t];
                for (size_t t = 0; t < o->n_tokens && res->n[i] < EG_MAXN; t++) {
                    if (o->logprobs) res->lp[i][res->n_lp[i]++] = o->logprobs[t];
                    res->tok[i][res->n[i]++] = o->token_ids[t];
                }
                done[i] = o->finish != FINISH_NONE;
                EG_EXPECT(o->finish != FINISH_ERROR, "request %d finished with an error", i);
                engine_output_free(o);
            }
        }
    }
    res->d2h = eg_d2h() - d2h0, res->h2d = eg_h2d() - h2d0;
    for (int i = 0; i < n_req; i++) {
        EG_EXPECT(done[i], "request %d did not finish", i);
        engine_stream_release(st[i]);
    }
    engine_destroy(e);
}

static void eg_expect_same(const char *what, const eg_result *a, const eg_result *b, int n_req) {
    int bad = 0;
    for (int i = 0; i < n_req; i++) {
        if (a->n[i] != b->n[i] || memcmp(a->tok[i], b->tok[i], (size_t)a->n[i] * 4) != 0) {
            bad++;
            printf("FAIL %s: request %d: %d tokens on the CPU, %d on the device; first:", what, i, a->n[i], b->n[i]);
            for (int t = 0; t < a->n[i] && t < b->n[i]; t++)
                if (a->tok[i][t] != b->tok[i][t]) { printf(" token %d: %d vs %d", t, a->tok[i][t], b->tok[i][t]); break; }
            printf("\n");
        }
        if (a->n_lp[i] != b->n_lp[i] || a->n_plp[i] != b->n_plp[i]) bad++;
        for (int t = 0; t < a->n_lp[i] + a->n_plp[i] && t < b->n_lp[i] + b->n_plp[i]; t++) {
            const bool pl = t >= a->n_lp[i]; /* then the prompt logprobs */
            const token_logprob *x = pl ? &a->plp[i][t - a->n_lp[i]] : &a->lp[i][t];
            const token_logprob *y = pl ? &b->plp[i][t - a->n_lp[i]] : &b->lp[i][t];
            if (pl && t - a->n_lp[i] >= b->n_plp[i]) break;
            bool same = x->id == y->id && x->n_top == y->n_top &&
                        !memcmp(x->top_ids, y->top_ids, sizeof x->top_ids[0] * (size_t)x->n_top);
            if (EG_EXACT)
                same = same && !memcmp(&x->logprob, &y->logprob, 4) &&
                       !memcmp(x->top_logprobs, y->top_logprobs, sizeof(float) * (size_t)x->n_top);
            else
                for (int j = -1; j < x->n_top && same; j++)
                    same = fabsf((j < 0 ? x->logprob : x->top_logprobs[j]) - (j < 0 ? y->logprob : y->top_logprobs[j])) <= 1e-4f;
            if (!same) {
                bad++;
                printf("FAIL %s: request %d: logprobs of token %d differ\n", what, i, t);
                break;
            }
        }
    }
    EG_EXPECT(bad == 0, "%s: %d differences between the CPU and the device engine", what, bad);
    EG_EXPECT(b->bytes_bad == 0, "%s: %d steps moved other bytes device -> host than ids / counts / asked-for rows", what,
           b->bytes_bad);
    int total = 0;
    for (int i = 0; i < n_req; i++) total += a->n[i];
    printf("%s: %d requests, %d tokens, %d device steps: identical to the CPU engine", what, n_req, total, b->steps);
    if (EG_FAKE && eg_check_bytes)
        printf("; bytes per step as designed (device -> host %.0f B/step, host -> device %.0f B/step)",
               (double)b->d2h / b->steps, (double)b->h2d / b->steps);
    printf("\n");
}

static model *eg_mc, *eg_md;
static backend *eg_dev;

static void eg_scenario(const char *what, int32_t k, const eg_req *rq, int n_req, eg_result *cpu_out) {
    eg_result a, b;
    const int sc0 = eg_sample_calls();
    eg_run(eg_mc, NULL, k, rq, n_req, &a);
    eg_run(eg_md, eg_dev, k, rq, n_req, &b);
    EG_EXPECT(!EG_FAKE || eg_sample_calls() > sc0, "%s: the device engine never sampled on the device", what);
    eg_expect_same(what, &a, &b, n_req);
    if (cpu_out) *cpu_out = a;
}


/* Every scenario (see the header) with mc as the reference and md on dev (sample_be). */
static void eg_scenarios(model *mc, model *md, backend *dev) {
    eg_mc = mc, eg_md = md, eg_dev = dev;
    eg_vocab = model_get_config(mc)->vocab;
    EG_EXPECT(model_logits_on_device(md) && !model_logits_on_device(mc), "logits on the device: %s yes, reference no",
              dev->name);
    static int32_t p0[19], p1[11];
    for (int i = 0; i < 19; i++) p0[i] = 3 + (int32_t)((i * 7919u + 13u) % (uint32_t)(eg_vocab - 3));
    for (int i = 0; i < 11; i++) p1[i] = 3 + (int32_t)((i * 104729u + 5u) % (uint32_t)(eg_vocab - 3));
    eg_req rq[EG_MAXR];
    for (int i = 0; i < EG_MAXR; i++) {
        sampling_params_init(&rq[i].sp);
        rq[i].sp.max_tokens = 24;
        rq[i].sp.ignore_eos = true;
        rq[i].prompt = i % 2 ? p1 : p0;
        rq[i].n_prompt = i % 2 ? 11 : 19;
    }

    /* 1. greedy, two prompts */
    eg_result greedy;
    rq[0].sp.temperature = rq[1].sp.temperature = 0.0f;
    eg_scenario("greedy", 0, rq, 2, &greedy);

    /* 2. seeded sampling, n = 2 (one prompt, seeds s and s + 1), every processing step */
    static const int32_t bias_ids[3] = {5, 17, 300};
    static const float bias[3] = {3.0f, -100.0f, 2.5f};
    eg_req rs[2];
    for (int i = 0; i < 2; i++) {
        rs[i] = rq[0];
        sampling_params *sp = &rs[i].sp;
        sp->temperature = 0.8f, sp->top_k = 50, sp->top_p = 0.9f, sp->min_p = 0.02f;
        sp->presence_penalty = 0.4f, sp->frequency_penalty = 0.3f, sp->repetition_penalty = 1.3f;
        sp->logit_bias_ids = bias_ids, sp->logit_bias = bias, sp->n_logit_bias = 3;
        sp->ignore_eos = false, sp->min_tokens = 6; /* EG_EOS suppressed for 6 tokens, then it may end the request */
        sp->has_seed = true, sp->seed = 1234 + (uint64_t)i;
    }
    eg_scenario("seeded sampling n=2 (top-k/p, min-p, penalties, logit_bias, min_tokens)", 0, rs, 2, NULL);
    /* the same with a high temperature and no filters, where every id can be drawn */
    for (int i = 0; i < 2; i++) {
        rs[i].sp.temperature = 1.7f, rs[i].sp.top_k = -1, rs[i].sp.top_p = 1.0f, rs[i].sp.min_p = 0.0f;
        rs[i].sp.seed = 99 + (uint64_t)i;
    }
    eg_scenario("seeded sampling n=2 (temperature 1.7, penalties, logit_bias)", 0, rs, 2, NULL);

    /* 3. logprobs: the raw rows of those requests only */
    eg_req rl[3] = {rq[0], rq[1], rs[0]};
    rl[0].sp.logprobs = 3;
    rl[2].sp.logprobs = 2;
    eg_scenario("logprobs (greedy top-3, sampled top-2) next to a request without", 0, rl, 3, NULL);

    /* 3b. prompt logprobs (their rows come after the device-sampled ones) beside device-sampled requests */
    eg_req rp[3] = {rq[1], rs[0], rq[0]};
    rp[0].prompt_logprobs = true, rp[0].sp.logprobs = 2;
    rp[2].prompt_logprobs = true;
    eg_result plp;
    eg_scenario("prompt logprobs (greedy top-2, and none) beside a seeded request", 0, rp, 3, &plp);
    EG_EXPECT(plp.n_plp[0] == rp[0].n_prompt - 1 && plp.n_plp[2] == rp[2].n_prompt - 1 && plp.n_plp[1] == 0,
              "prompt logprobs received: %d, %d, %d", plp.n_plp[0], plp.n_plp[1], plp.n_plp[2]);

    /* 4. speculative, k = 3: greedy chains verified on the device, a sampling chain (q rows) on the host */
    eg_or_count = 2;
    eg_or_prompt[0] = p0, eg_or_np[0] = 19, eg_or_prompt[1] = p1, eg_or_np[1] = 11;
    memcpy(eg_or_ref[0], greedy.tok[0], sizeof eg_or_ref[0]);
    memcpy(eg_or_ref[1], greedy.tok[1], sizeof eg_or_ref[1]);
    const int sv0 = eg_verify_calls();
    eg_result spec;
    eg_scenario("speculative greedy k=3 (device verify)", 3, rq, 2, &spec);
    EG_EXPECT(!EG_FAKE || eg_verify_calls() > sv0, "chains were verified on the device");
    for (int i = 0; i < 2; i++)
        EG_EXPECT(spec.n[i] == greedy.n[i] && memcmp(spec.tok[i], greedy.tok[i], (size_t)greedy.n[i] * 4) == 0,
               "request %d: speculative greedy != plain greedy", i);
    /* greedy chains whose rows see the drafts in their history (penalties), and the min_tokens boundary
     * inside a chain (EG_EOS lifted by logit_bias, suppressed for 5 tokens): the oracle drafts each request's
     * own plain output, so chains are accepted and rows j >= 1 decide */
    static int32_t p2[9];
    for (int i = 0; i < 9; i++) p2[i] = 3 + (int32_t)((i * 15485863u + 11u) % (uint32_t)(eg_vocab - 3));
    static const int32_t bias_eos_ids[1] = {EG_EOS};
    static const float bias_eos[1] = {100.0f};
    eg_req rm[4] = {rq[0], rq[1], rq[0], rs[1]};
    /* id 40 lifted by +12 and pushed down by the penalties at each occurrence (5 of 24 here): where its
     * runs end depends on the counted history, which inside a chain includes the drafts (dropping them
     * from a chain row's history fails this test) */
    static const int32_t bias_run_ids[2] = {40, 17};
    static const float bias_run[2] = {12.0f, -100.0f};
    rm[1].sp.repetition_penalty = 1.5f, rm[1].sp.frequency_penalty = 2.0f, rm[1].sp.presence_penalty = 0.2f;
    rm[1].sp.logit_bias_ids = bias_run_ids, rm[1].sp.logit_bias = bias_run, rm[1].sp.n_logit_bias = 2;
    rm[2].prompt = p2, rm[2].n_prompt = 9;
    rm[2].sp.logit_bias_ids = bias_eos_ids, rm[2].sp.logit_bias = bias_eos, rm[2].sp.n_logit_bias = 1;
    rm[2].sp.ignore_eos = false, rm[2].sp.min_tokens = 5;
    eg_result pen;
    eg_scenario("greedy with penalties + logit_bias; EOS-biased with min_tokens 5", 0, rm, 3, &pen);
    int run40 = 0;
    for (int t = 0; t < pen.n[1]; t++) run40 += pen.tok[1][t] == 40;
    EG_EXPECT(run40 >= 3 && run40 < pen.n[1] / 2, "id 40 appears %d times of %d (its biased run)", run40, pen.n[1]);
    EG_EXPECT(pen.n[2] == 6 && pen.tok[2][5] == EG_EOS, "the EOS-biased request ends at token 6 (%d tokens)", pen.n[2]);
    eg_or_count = 3;
    eg_or_prompt[2] = p2, eg_or_np[2] = 9;
    memcpy(eg_or_ref[1], pen.tok[1], sizeof eg_or_ref[1]);
    memcpy(eg_or_ref[2], pen.tok[2], sizeof eg_or_ref[2]);
    eg_result spen;
    eg_scenario("speculative k=3 of those (device verify)", 3, rm, 3, &spen);
    for (int i = 1; i < 3; i++)
        EG_EXPECT(spen.n[i] == pen.n[i] && memcmp(spen.tok[i], pen.tok[i], (size_t)pen.n[i] * 4) == 0,
               "request %d: speculative greedy != plain greedy", i);
    rm[3].sp.temperature = 0.9f;
    rm[3].prompt = p1, rm[3].n_prompt = 11;
    eg_scenario("speculative k=3, greedy chains on the device + a sampling chain on the host", 3, rm, 4, NULL);
    /* the same with the sampling chain's q rows left on the device (propose_dev: draft-vocabulary rows, t2d) and
     * verified there: the CPU engine verifies the same q scattered to target ids on the host; two more sampling
     * requests (seeds apart, one at temperature 1.5) so rejections and residual draws happen */
    const int32_t V = eg_vocab;
    int32_t *t2d = malloc(sizeof(int32_t) * (size_t)V);
    for (int32_t i = 0; i < V; i++) t2d[i] = -1;
    for (int32_t c = 0; c < EG_VD; c++) t2d[eg_or_used(c)] = c;
    eg_or_be = dev;
    eg_or_dq = dev->ops->buf_alloc(dev->ctx, sizeof(float) * EG_MAXR * 16 * EG_VD);
    eg_or_dt2d = dev->ops->buf_alloc(dev->ctx, sizeof(int32_t) * (size_t)V);
    EG_EXPECT(eg_or_dq && eg_or_dt2d && dev->ops->upload(dev->ctx, eg_or_dt2d, t2d, sizeof(int32_t) * (size_t)V) == 0,
              "oracle q rows on the device");
    eg_req rd[4] = {rm[0], rs[0], rs[1], rm[3]};
    rd[1].sp.max_tokens = rd[2].sp.max_tokens = 24, rd[1].sp.ignore_eos = rd[2].sp.ignore_eos = true;
    rd[1].sp.min_tokens = rd[2].sp.min_tokens = 0;
    rd[1].sp.temperature = 1.5f, rd[1].sp.seed = 77;
    rd[2].prompt = p2, rd[2].n_prompt = 9, rd[2].sp.seed = 4242;
    eg_or_count = 3;
    eg_or_qdev = 1;
    const long qr0 = eg_or_dev_rows;
    const int vq0 = eg_verify_q_rows();
    eg_result dq;
    eg_scenario("speculative k=3, sampling chains with q rows on the device (t2d) verified there", 3, rd, 4, &dq);
    EG_EXPECT(eg_or_dev_rows > qr0, "the oracle left no q rows on the device");
    EG_EXPECT(!EG_FAKE || eg_verify_q_rows() > vq0, "no draft was verified against a device q row");
    printf("  device q: %ld dense q rows proposed on the device, %d verified against one\n", eg_or_dev_rows - qr0,
           eg_verify_q_rows() - vq0);
    eg_or_qdev = 0;
    dev->ops->buf_free(dev->ctx, eg_or_dq), dev->ops->buf_free(dev->ctx, eg_or_dt2d);
    eg_or_dq = NULL, eg_or_dt2d = NULL;
    free(t2d);

}

#endif
