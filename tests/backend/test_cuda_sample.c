/*
 * test_cuda_sample.c (label unit, no GPU): sampling on the device, end to end
 * through the engine, on the FAKE CUDA device (cuda_fake.c).
 *
 * Two engines over the HF Llama miniature ($MODEL_HF_MINI_DIR/f32, vocab 512):
 * the reference on the CPU backend (logits sampled on the host, zero copies,
 * the path every CPU test covers) and one on the fake device with
 * engine_runner.sample_be set, so the logits stay on the "device", the engine
 * describes each row (bk_sample_row, bk_verify_seq) and bk_ops.sample returns
 * only the ids and accepted counts. Checked, scenario by scenario, token for
 * token and logprob for logprob (bitwise): greedy; seeded sampling with
 * temperature, top-k, top-p, min-p, presence / frequency / repetition
 * penalties, logit_bias, min_tokens (EOS suppressed) at n = 2 (one prompt,
 * seeds s and s + 1, as the server expands n); logprobs (greedy and sampled);
 * speculative decoding (k = 3, an oracle proposer drafting the greedy
 * continuation with every third draft corrupted) with greedy chains verified
 * on the device and a sampling chain (the proposer gives q rows) verified on
 * the host beside them; and speculative greedy == plain greedy.
 * And, every step of the device engine, the bytes copied device -> host
 * (counted by the fake cudaMemcpyAsync) equal exactly what the design says
 * crosses the bus: the two int32 error flags, 4 bytes per sampled row, per
 * verified chain 4 * (k_max + 2) (its count and its k_max + 1 tokens), and a
 * full raw logits row (vocab * 4 bytes) ONLY for each row of a request that
 * asked for logprobs and each row of a chain verified on the host: no logits
 * otherwise.
 *
 * WHAT THIS DOES NOT TEST: the sampling numerics of the device. The fake
 * kn_sample / kn_spec_verify run the host sampler (engine/runtime/sampler.c)
 * on the staged inputs, so token equality here is partly by construction; it
 * proves the plumbing (which rows, parameters, histories, suppress and bias
 * lists, uniforms and chains are staged, how results are unpacked, how each
 * request's RNG advances, what is downloaded and when). The kernels'
 * numerics against sampler.c are tests/kernels/test_kn_sample.c (on a GPU or
 * under tools/kn_emu), and tests/kernels/test_cuda_backend.c runs this same
 * engine comparison on a real device. Skips (77) without the miniature.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/backend/cuda_fake/cuda_runtime_api.h" /* first: renames the CUDA backend's entry points */
#include "engine/backend/cuda_backend.h"
#include "engine/runtime/engine_ex.h"
#include "engine/runtime/proposer.h"

static int n_fail;
#define EXPECT(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); n_fail++; } } while (0)

#define MAXR 4
#define MAXN 32
#define BS 16
#define EOS 2
static int32_t g_vocab;

/* ---- detokenizer: ids as "t<id> " (only the token stream matters here) ---- */
static void *dt_create(void *ctx, bool skip) { (void)ctx, (void)skip; return calloc(1, 1); }
static void dt_destroy(void *s) { free(s); }
static int dt_push(void *s, int32_t id, char **out, size_t *len, size_t *cap) {
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
static int dt_flush(void *s, char **out, size_t *len, size_t *cap) { (void)s, (void)out, (void)len, (void)cap; return 0; }
static const int32_t g_eos[1] = {EOS};

/* ---- oracle proposer: drafts the plain greedy continuation of its request (g_oracle_ref), every third
 * draft corrupted; q (when asked) one-hot at the draft, so host and device verify the same rule ---- */
static int32_t or_tok[64][256], or_n[64];
static const int32_t *g_or_prompt[MAXR];
static int32_t g_or_np[MAXR], g_or_ref[MAXR][MAXN];
static int g_or_n;
static int or_extend(void *ctx, int64_t id, const int32_t *t, int32_t n, int32_t pos0, const float *aux, specd_err *err) {
    (void)ctx, (void)aux, (void)err;
    for (int32_t i = 0; i < n && pos0 + i < 256; i++) or_tok[id % 64][pos0 + i] = t[i];
    or_n[id % 64] = pos0 + n;
    return 0;
}
static int or_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                      int32_t *out, float *q, specd_err *err) {
    (void)ctx, (void)temps, (void)err;
    for (int32_t i = 0; i < n; i++) {
        const int64_t id = ids[i] % 64;
        int best = -1;
        for (int r = 0; r < g_or_n; r++)
            if (or_n[id] >= g_or_np[r] && memcmp(or_tok[id], g_or_prompt[r], (size_t)g_or_np[r] * 4) == 0) best = r;
        for (int32_t j = 0; j < k_max; j++) {
            const int32_t gi = best < 0 ? -1 : or_n[id] - g_or_np[best] + j;
            int32_t d = j < k[i] && gi >= 0 && gi < MAXN ? g_or_ref[best][gi] : -1;
            if (d >= 0 && ((uint64_t)or_n[id] * 31u + (uint64_t)j * 7u) % 3 == 0) d = (d + 1) % g_vocab;
            out[i * k_max + j] = d;
            if (q) {
                float *qj = q + ((size_t)i * k_max + j) * (size_t)g_vocab;
                memset(qj, 0, sizeof(float) * (size_t)g_vocab);
                if (d >= 0) qj[d] = 1.0f;
            }
        }
    }
    return 0;
}
static void or_free(void *ctx, int64_t id) { (void)ctx, or_n[id % 64] = 0; }
static void or_trunc(void *ctx, int64_t id, int32_t n) { (void)ctx; if (or_n[id % 64] > n) or_n[id % 64] = n; }
static const spec_proposer_ops or_ops = {.extend = or_extend, .propose = or_propose, .truncate = or_trunc,
                                         .free_seq = or_free};
static spec_proposer g_oracle = {.ops = &or_ops, .ctx = NULL};

/* ---- one generation of up to MAXR requests on an engine stepped on this thread ---- */
typedef struct req {
    const int32_t *prompt;
    int32_t n_prompt;
    sampling_params sp;
} req;
typedef struct result {
    int32_t tok[MAXR][MAXN], n[MAXR];
    token_logprob lp[MAXR][MAXN];
    int32_t n_lp[MAXR];
    int steps, bytes_bad;
} result;

static int fwd(void *ctx, const model_batch *b, specd_err *err) { return model_forward(ctx, b, err); }

static void run(model *m, backend *sample_be, int32_t k, const req *rq, int n_req, result *res) {
    memset(res, 0, sizeof *res);
    engine_runner r = {.ctx = m, .forward = fwd, .vocab = g_vocab, .hidden = model_get_config(m)->hidden,
                       .block_size = BS, .n_blocks = model_kv_n_blocks(m), .sample_be = sample_be};
    engine_detok d = {.stream_create = dt_create, .stream_destroy = dt_destroy, .push = dt_push, .flush = dt_flush,
                      .eos_ids = g_eos, .n_eos = 1};
    engine_config cfg = {.max_model_len = 160, .max_num_seqs = 8, .max_num_batched_tokens = 256, .max_waiting = 64,
                         .num_speculative_tokens = k};
    engine *e = NULL;
    specd_err err = {{0}};
    if (engine_create_ex(&cfg, &r, &d, m, NULL, &e, &err) != 0) { EXPECT(0, "engine: %s", err.msg); return; }
    memset(or_n, 0, sizeof or_n);
    if (k > 0 && engine_set_proposer(e, &g_oracle, &err) != 0) { EXPECT(0, "proposer: %s", err.msg); return; }
    engine_stream *st[MAXR];
    int64_t sid[MAXR];
    bool seen[MAXR] = {0}, done[MAXR] = {0};
    for (int i = 0; i < n_req; i++) {
        engine_request q;
        memset(&q, 0, sizeof q);
        q.sp = rq[i].sp;
        q.prompt = rq[i].prompt;
        q.n_prompt = (size_t)rq[i].n_prompt;
        st[i] = engine_submit(e, &q, NULL, NULL, NULL, &err);
        if (!st[i]) { EXPECT(0, "submit: %s", err.msg); return; }
        sid[i] = engine_stream_seq_id(st[i]);
    }
    for (int step = 0; step < 400; step++) {
        const size_t d0 = fake_d2h_bytes;
        const int n = engine_step(e, &err);
        if (n < 0) { EXPECT(0, "step: %s", err.msg); break; }
        if (n == 0) break;
        res->steps++;
        if (sample_be) { /* what crossed the bus, against what the design allows */
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
                const bool sampling = rq[ri].sp.temperature >= 1e-5f;
                if (nd > 0 && sampling) { /* q rows: verified on the host over downloaded raw rows */
                    host += nr * (size_t)g_vocab * 4;
                    continue;
                }
                rows += nr;
                if (nd > 0) n_verify++, kmax = nd > kmax ? nd : kmax;
                if (rq[ri].sp.logprobs >= 0) host += nr * (size_t)g_vocab * 4;
            }
            const size_t want = 8 + host + (rows ? 4 * (rows + n_verify * (kmax + 2)) : 0);
            const size_t got = fake_d2h_bytes - d0;
            if (got != want && res->bytes_bad++ < 3)
                printf("FAIL step %d: %zu bytes device -> host, expected %zu (%zu rows, %zu chains, k_max %zu, %zu raw)\n",
                       step, got, want, rows, n_verify, kmax, host);
        }
        for (int i = 0; i < n_req; i++) {
            engine_output *o;
            while (!done[i] && engine_stream_wait(st[i], &o, 0.0)) {
                for (size_t t = 0; t < o->n_tokens && res->n[i] < MAXN; t++) {
                    if (o->logprobs) res->lp[i][res->n_lp[i]++] = o->logprobs[t];
                    res->tok[i][res->n[i]++] = o->token_ids[t];
                }
                done[i] = o->finish != FINISH_NONE;
                EXPECT(o->finish != FINISH_ERROR, "request %d finished with an error", i);
                engine_output_free(o);
            }
        }
    }
    for (int i = 0; i < n_req; i++) {
        EXPECT(done[i], "request %d did not finish", i);
        engine_stream_release(st[i]);
    }
    engine_destroy(e);
}

static void expect_same(const char *what, const result *a, const result *b, int n_req) {
    int bad = 0;
    for (int i = 0; i < n_req; i++) {
        if (a->n[i] != b->n[i] || memcmp(a->tok[i], b->tok[i], (size_t)a->n[i] * 4) != 0) {
            bad++;
            printf("FAIL %s: request %d: %d tokens on the CPU, %d on the device; first:", what, i, a->n[i], b->n[i]);
            for (int t = 0; t < a->n[i] && t < b->n[i]; t++)
                if (a->tok[i][t] != b->tok[i][t]) { printf(" token %d: %d vs %d", t, a->tok[i][t], b->tok[i][t]); break; }
            printf("\n");
        }
        if (a->n_lp[i] != b->n_lp[i]) bad++;
        for (int t = 0; t < a->n_lp[i] && t < b->n_lp[i]; t++) {
            const token_logprob *x = &a->lp[i][t], *y = &b->lp[i][t];
            if (x->id != y->id || memcmp(&x->logprob, &y->logprob, 4) || x->n_top != y->n_top ||
                memcmp(x->top_ids, y->top_ids, sizeof x->top_ids[0] * (size_t)x->n_top) ||
                memcmp(x->top_logprobs, y->top_logprobs, sizeof(float) * (size_t)x->n_top)) {
                bad++;
                printf("FAIL %s: request %d: logprobs of token %d differ\n", what, i, t);
                break;
            }
        }
    }
    EXPECT(bad == 0, "%s: %d differences between the CPU and the device engine", what, bad);
    EXPECT(b->bytes_bad == 0, "%s: %d steps moved other bytes device -> host than ids / counts / asked-for rows", what,
           b->bytes_bad);
    int total = 0;
    for (int i = 0; i < n_req; i++) total += a->n[i];
    printf("%s: %d requests, %d tokens, %d device steps: identical to the CPU engine; bytes per step as designed\n",
           what, n_req, total, b->steps);
}

static model *g_mc, *g_md;
static backend *g_cpu, *g_dev;

static void scenario(const char *what, int32_t k, const req *rq, int n_req, result *cpu_out) {
    result a, b;
    const int sc0 = fake_kn_sample_calls;
    run(g_mc, NULL, k, rq, n_req, &a);
    run(g_md, g_dev, k, rq, n_req, &b);
    EXPECT(fake_kn_sample_calls > sc0, "%s: the device engine never sampled on the device", what);
    expect_same(what, &a, &b, n_req);
    if (cpu_out) *cpu_out = a;
}

int main(void) {
    const char *mini = getenv("MODEL_HF_MINI_DIR");
    char path[4096];
    struct stat stt;
    snprintf(path, sizeof path, "%s/f32", mini ? mini : "");
    if (!mini || stat(path, &stt) != 0) {
        printf("SKIP: the HF miniature is not at $MODEL_HF_MINI_DIR/f32\n");
        return 77;
    }
    specd_err err = {{0}};
    g_cpu = bk_cpu_create(1);
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)256 << 20, .max_tokens = 256, .max_seqs = 8,
                      .max_len = 160, .block_size = BS, .max_heads = 16, .max_head_dim = 128};
    g_dev = bk_cuda_create(&o, &err);
    if (!g_cpu || !g_dev) { printf("FAIL: backends: %s\n", err.msg); return 1; }
    model_load_opts mo = {.block_size = BS, .n_blocks = 64};
    if (model_load(path, g_cpu, &mo, &g_mc, &err) || model_load(path, g_dev, &mo, &g_md, &err)) {
        printf("FAIL: %s: %s\n", path, err.msg);
        return 1;
    }
    g_vocab = model_get_config(g_mc)->vocab;
    EXPECT(model_logits_on_device(g_md) && !model_logits_on_device(g_mc), "logits on the device: fake yes, CPU no");

    static int32_t p0[19], p1[11];
    for (int i = 0; i < 19; i++) p0[i] = 3 + (int32_t)((i * 7919u + 13u) % (uint32_t)(g_vocab - 3));
    for (int i = 0; i < 11; i++) p1[i] = 3 + (int32_t)((i * 104729u + 5u) % (uint32_t)(g_vocab - 3));
    req rq[MAXR];
    for (int i = 0; i < MAXR; i++) {
        sampling_params_init(&rq[i].sp);
        rq[i].sp.max_tokens = 24;
        rq[i].sp.ignore_eos = true;
        rq[i].prompt = i % 2 ? p1 : p0;
        rq[i].n_prompt = i % 2 ? 11 : 19;
    }

    /* 1. greedy, two prompts */
    result greedy;
    rq[0].sp.temperature = rq[1].sp.temperature = 0.0f;
    scenario("greedy", 0, rq, 2, &greedy);

    /* 2. seeded sampling, n = 2 (one prompt, seeds s and s + 1), every processing step */
    static const int32_t bias_ids[3] = {5, 17, 300};
    static const float bias[3] = {3.0f, -100.0f, 2.5f};
    req rs[2];
    for (int i = 0; i < 2; i++) {
        rs[i] = rq[0];
        sampling_params *sp = &rs[i].sp;
        sp->temperature = 0.8f, sp->top_k = 50, sp->top_p = 0.9f, sp->min_p = 0.02f;
        sp->presence_penalty = 0.4f, sp->frequency_penalty = 0.3f, sp->repetition_penalty = 1.3f;
        sp->logit_bias_ids = bias_ids, sp->logit_bias = bias, sp->n_logit_bias = 3;
        sp->ignore_eos = false, sp->min_tokens = 6; /* EOS suppressed for 6 tokens, then it may end the request */
        sp->has_seed = true, sp->seed = 1234 + (uint64_t)i;
    }
    scenario("seeded sampling n=2 (top-k/p, min-p, penalties, logit_bias, min_tokens)", 0, rs, 2, NULL);
    /* the same with a high temperature and no filters, where every id can be drawn */
    for (int i = 0; i < 2; i++) {
        rs[i].sp.temperature = 1.7f, rs[i].sp.top_k = -1, rs[i].sp.top_p = 1.0f, rs[i].sp.min_p = 0.0f;
        rs[i].sp.seed = 99 + (uint64_t)i;
    }
    scenario("seeded sampling n=2 (temperature 1.7, penalties, logit_bias)", 0, rs, 2, NULL);

    /* 3. logprobs: the raw rows of those requests only */
    req rl[3] = {rq[0], rq[1], rs[0]};
    rl[0].sp.logprobs = 3;
    rl[2].sp.logprobs = 2;
    scenario("logprobs (greedy top-3, sampled top-2) next to a request without", 0, rl, 3, NULL);

    /* 4. speculative, k = 3: greedy chains verified on the device, a sampling chain (q rows) on the host */
    g_or_n = 2;
    g_or_prompt[0] = p0, g_or_np[0] = 19, g_or_prompt[1] = p1, g_or_np[1] = 11;
    memcpy(g_or_ref[0], greedy.tok[0], sizeof g_or_ref[0]);
    memcpy(g_or_ref[1], greedy.tok[1], sizeof g_or_ref[1]);
    const int sv0 = fake_kn_spec_verify_calls;
    result spec;
    scenario("speculative greedy k=3 (device verify)", 3, rq, 2, &spec);
    EXPECT(fake_kn_spec_verify_calls > sv0, "chains were verified on the device");
    for (int i = 0; i < 2; i++)
        EXPECT(spec.n[i] == greedy.n[i] && memcmp(spec.tok[i], greedy.tok[i], (size_t)greedy.n[i] * 4) == 0,
               "request %d: speculative greedy != plain greedy", i);
    /* greedy chains whose rows see the drafts in their history (penalties), and the min_tokens boundary
     * inside a chain (EOS lifted by logit_bias, suppressed for 5 tokens): the oracle drafts each request's
     * own plain output, so chains are accepted and rows j >= 1 decide */
    static int32_t p2[9];
    for (int i = 0; i < 9; i++) p2[i] = 3 + (int32_t)((i * 15485863u + 11u) % (uint32_t)(g_vocab - 3));
    static const int32_t bias_eos_ids[1] = {EOS};
    static const float bias_eos[1] = {100.0f};
    req rm[4] = {rq[0], rq[1], rq[0], rs[1]};
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
    result pen;
    scenario("greedy with penalties + logit_bias; EOS-biased with min_tokens 5", 0, rm, 3, &pen);
    int run40 = 0;
    for (int t = 0; t < pen.n[1]; t++) run40 += pen.tok[1][t] == 40;
    EXPECT(run40 >= 3 && run40 < pen.n[1] / 2, "id 40 appears %d times of %d (its biased run)", run40, pen.n[1]);
    EXPECT(pen.n[2] == 6 && pen.tok[2][5] == EOS, "the EOS-biased request ends at token 6 (%d tokens)", pen.n[2]);
    g_or_n = 3;
    g_or_prompt[2] = p2, g_or_np[2] = 9;
    memcpy(g_or_ref[1], pen.tok[1], sizeof g_or_ref[1]);
    memcpy(g_or_ref[2], pen.tok[2], sizeof g_or_ref[2]);
    result spen;
    scenario("speculative k=3 of those (device verify)", 3, rm, 3, &spen);
    for (int i = 1; i < 3; i++)
        EXPECT(spen.n[i] == pen.n[i] && memcmp(spen.tok[i], pen.tok[i], (size_t)pen.n[i] * 4) == 0,
               "request %d: speculative greedy != plain greedy", i);
    rm[3].sp.temperature = 0.9f;
    rm[3].prompt = p1, rm[3].n_prompt = 11;
    scenario("speculative k=3, greedy chains on the device + a sampling chain on the host", 3, rm, 4, NULL);

    EXPECT(fake_violations == 0, "%d host pointers reached device ops", fake_violations);
    model_destroy(g_mc), model_destroy(g_md);
    bk_cuda_destroy(g_dev);
    bk_cpu_destroy(g_cpu);
    printf("%s\n", n_fail ? "FAILED" : "OK");
    return n_fail ? 1 : 0;
}
