/*
 * test_cuda_spec_engine.c (label model, no GPU): speculative decoding through
 * the engine with SmolLM2 and its trained EAGLE-3 head
 * (draft/heads/smollm2-135m-eagle3) both on the FAKE CUDA device
 * (cuda_fake.c), the way `specd serve --device cuda` with a draft wires it:
 * logits sampled and chains verified on the device (engine_runner.sample_be),
 * the target's aux features left in the model's fixed device buffer
 * (model_aux_reserve via eagle3_opts.aux_rows, engine_runner.aux_dev) and
 * copied into the head's device feature pool by extend_rows.
 *
 * Checked, against an engine with the same model and head on the CPU
 * backend (host sampling, host features, zero copies):
 *   1. every request's tokens identical, and the speculation counters
 *      (drafts, draft tokens, accepted tokens) identical: the same drafts were
 *      made from the same feature bits;
 *   2. every step's device -> host bytes (counted by the fake
 *      cudaMemcpyAsync) equal exactly the table of docs/engine.md "The draft
 *      head on the GPU": 8 (the error flags) + 4 per device-sampled row +
 *      4 (k_max + 2) per verified chain, and, in a step that drafts, 8 + the
 *      drafted ids (4 x sum over chain steps j of the rows still drafting,
 *      each step's ids padded to 4); nothing else, in particular no aux
 *      feature rows (n_aux x H x 4 = 6,912 B per token for SmolLM2);
 *   3. the same with the feature pool shrunk to 6 chunks (96 rows for 3
 *      prompts of 37 + 23 + 30 tokens): extend_rows runs the pending pairs
 *      early when it fills, outputs and bytes unchanged;
 *   4. with the features travelling through the host (runner.aux_dev NULL:
 *      the path before) the device engine's bytes are the table PLUS exactly
 *      the aux rows of every step and a second 8-byte read of the error flags
 *      (the check above tells the two apart);
 *   5. the feature pool through truncates (into the settled pairs and past
 *      them), re-sent features and freed sequences (test_pool_truncate):
 *      drafts equal the CPU head's, and a 4-chunk pool does not run out over
 *      6 sequences one after the other (no chunk leaked);
 *   6. adaptive speculation (engine_config.spec_adaptive, costs from a
 *      virtual clock both engines share, so k depends on acceptance only)
 *      with the head's chain graphs (buckets 1, 2, 4; k = 1..K): tokens and
 *      speculation counters equal the CPU engine's with adaptive speculation,
 *      and the tokens equal plain greedy; every drafting step replays
 *      exactly ONE graph (one graph launch, one chain replay), the graph of
 *      that step's largest k (replays per k == drafting steps per largest k,
 *      some below K), and its bytes are the table with the graph's download
 *      (8 + 4 x pad4(bucket) x k_max);
 *   7. no host pointer reached a device op.
 * Needs the SmolLM2 GGUF; skips (77) without it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "tests/backend/cuda_fake/cuda_runtime_api.h" /* first: renames the CUDA backend's entry points */
#include "draft/eagle3.h"
#include "engine/backend/cuda_backend.h"
#include "engine/runtime/engine_ex.h"
#include "tests/draft/draft_test_util.h"

static int n_fail;
#define EXPECT(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); n_fail++; } } while (0)

#define NREQ 3
#define GEN 24
#define K 3
#define STEP_TOKENS 128

static void *dt_create(void *ctx, bool skip) { (void)ctx, (void)skip; return calloc(1, 1); }
static void dt_destroy(void *s) { free(s); }
static int dt_push(void *s, int32_t id, char **out, size_t *len, size_t *cap) { (void)s, (void)id, (void)out, (void)len, (void)cap; return 0; }
static int dt_flush(void *s, char **out, size_t *len, size_t *cap) { (void)s, (void)out, (void)len, (void)cap; return 0; }
/* The engine's cost clock (engine_runner.now) is virtual: a forward of n tokens costs 1 ms + 0.02 ms per token, a
 * propose 0.02 ms per draft step, whatever the backend, so adaptive speculation (spec_adapt.h) sees the same
 * costs on the CPU and on the fake device and, with the same acceptance, picks the same k per sequence. */
static double g_vclock;
static double vnow(void *ctx) { (void)ctx; return g_vclock; }
static int fwd(void *ctx, const model_batch *b, specd_err *err) {
    g_vclock += 1e-3 + 2e-5 * b->n_tokens;
    return model_forward(ctx, b, err);
}
static int (*g_propose)(void *, const int64_t *, const int32_t *, int32_t, int32_t, const float *, int32_t *, float *,
                        specd_err *);
static int timed_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                         int32_t *out_tokens, float *out_q, specd_err *err) {
    g_vclock += 2e-5 * k_max;
    return g_propose(ctx, ids, k, n, k_max, temps, out_tokens, out_q, err);
}

static int32_t g_prompt[NREQ][64], g_np[NREQ];

typedef struct run_out {
    int32_t tok[NREQ][GEN], n[NREQ];
    engine_stats st;
    int steps, bad_steps, draft_steps;
    size_t d2h, d2h_aux; /* bytes over the run; of which the aux rows the table expects on the host path */
    long kg_steps[K + 1];   /* drafting steps by their largest k (graphs: the graph that must replay) */
    int graph_misses;       /* drafting steps that did not replay exactly one graph (graphs on) */
    eagle3_graph_stats gs;  /* the chain graphs' counters at the end (graphs on) */
} run_out;

/* How run() drives the engine. */
typedef struct run_mode {
    backend *dev;       /* the device backend (sampling there), or NULL */
    bool aux_dev;       /* the features stay on the device */
    int32_t feat_chunks;
    bool adaptive;      /* engine_config.spec_adaptive (the virtual clock above) */
    bool graphs;        /* the head's chain graphs (buckets 1, 2, 4; k = 1..K; length classes of max_model_len) */
    bool plain;         /* no proposer: plain greedy */
} run_mode;

/* Drafted-id bytes of a propose whose sequences drafted nd[0..n) tokens (chain(): each step's ids padded to 4;
 * a chain graph replay: its bucket's rows padded to 4 for each of its k_max steps). */
static size_t draft_bytes(const int32_t *nd, size_t n, bool graphs) {
    int32_t kmax = 0;
    for (size_t i = 0; i < n; i++) kmax = nd[i] > kmax ? nd[i] : kmax;
    if (graphs && kmax) {
        const size_t B = n <= 2 ? n : 4;
        return 8 + 4 * ((B + 3) & ~(size_t)3) * (size_t)kmax;
    }
    size_t b = 0;
    for (int32_t j = 0; j < kmax; j++) {
        size_t rows = 0;
        for (size_t i = 0; i < n; i++) rows += nd[i] > j;
        b += 4 * ((rows + 3) & ~(size_t)3);
    }
    return kmax ? 8 + b : 0;
}

/* One generation of NREQ greedy requests (run_mode says how). */
static void run(model *m, const run_mode *md, const char *head, run_out *r) {
    memset(r, 0, sizeof *r);
    specd_err err = {{0}};
    const int32_t H = model_get_config(m)->hidden;
    backend *dev = md->dev;
    const bool aux_dev = md->aux_dev;
    eagle3_opts eo = {.n_blocks = 64};
    if (dev) eo.max_rows = STEP_TOKENS, eo.max_seqs = 4, eo.max_k = K, eo.aux_rows = STEP_TOKENS, eo.feat_chunks = md->feat_chunks;
    spec_proposer *sp = NULL, timed;
    spec_proposer_ops timed_ops;
    if (eagle3_load(head, m, &eo, &sp, &err) < 0) { EXPECT(0, "eagle3_load: %s", err.msg); return; }
    static const int32_t gb[3] = {1, 2, 4};
    const eagle3_graph_opts gopt = {.buckets = gb, .n_buckets = 3, .k = K, .max_len = 160, .len_floor = 64};
    if (md->graphs && eagle3_graphs_capture(sp, &gopt, &err) < 0) { EXPECT(0, "chain graphs: %s", err.msg); return; }
    /* the engine sees the proposer through timed_propose (the virtual clock); everything else is the head's */
    timed_ops = *sp->ops;
    g_propose = sp->ops->propose;
    timed_ops.propose = timed_propose;
    timed = (spec_proposer){.ops = &timed_ops, .ctx = sp->ctx};
    g_vclock = 0;
    EXPECT(!dev || (model_aux_device(m) && fake_is_device(model_aux_device(m)->data, 4)),
           "the device head reserved the target's aux buffer in device memory");
    int32_t layers[8];
    const int n_aux = sp->ops->aux_layers(sp->ctx, layers);
    engine_runner rn = {.ctx = m, .forward = fwd, .vocab = model_get_config(m)->vocab, .hidden = H,
                        .block_size = model_kv_block_size(m), .n_blocks = model_kv_n_blocks(m),
                        .sample_be = dev, .aux_dev = dev && aux_dev ? model_aux_device(m) : NULL, .now = vnow};
    static const int32_t eos[1] = {2};
    engine_detok d = {.stream_create = dt_create, .stream_destroy = dt_destroy, .push = dt_push, .flush = dt_flush,
                      .eos_ids = eos, .n_eos = 1};
    engine_config cfg = {.max_model_len = 160, .max_num_seqs = 4, .max_num_batched_tokens = STEP_TOKENS,
                         .max_waiting = 16, .num_speculative_tokens = md->plain ? 0 : K,
                         .spec_adaptive = md->adaptive};
    engine *e = NULL;
    if (engine_create_ex(&cfg, &rn, &d, m, NULL, &e, &err) != 0 ||
        (!md->plain && engine_set_proposer(e, &timed, &err) != 0)) {
        EXPECT(0, "engine: %s", err.msg);
        eagle3_destroy(sp);
        return;
    }
    engine_stream *st[NREQ];
    int64_t sid[NREQ];
    bool seen[NREQ] = {0}, done[NREQ] = {0};
    for (int i = 0; i < NREQ; i++) {
        engine_request q;
        memset(&q, 0, sizeof q);
        sampling_params_init(&q.sp);
        q.sp.temperature = 0.0f, q.sp.max_tokens = GEN, q.sp.ignore_eos = true;
        q.prompt = g_prompt[i], q.n_prompt = (size_t)g_np[i];
        st[i] = engine_submit(e, &q, NULL, NULL, NULL, &err);
        if (!st[i]) { EXPECT(0, "submit: %s", err.msg); return; }
        sid[i] = engine_stream_seq_id(st[i]);
    }
    const size_t row_aux = (size_t)n_aux * (size_t)H * 4;
    const size_t d2h0 = fake_d2h_bytes;
    for (int step = 0; step < 200; step++) {
        const size_t b0 = fake_d2h_bytes;
        const long g0 = fake_graph_launches, r0 = eagle3_graph_replays(sp);
        const int n = engine_step(e, &err);
        if (n < 0) { EXPECT(0, "step: %s", err.msg); break; }
        if (n == 0) break;
        r->steps++;
        const int64_t *ids;
        const int32_t *nt;
        const size_t ns = engine_last_schedule(e, &ids, &nt);
        size_t rows = 0, n_verify = 0, kmax = 0, tokens = 0, nprop = 0;
        int32_t nd[NREQ];
        for (size_t j = 0; j < ns; j++) {
            int ri = 0;
            while (ri < NREQ && sid[ri] != ids[j]) ri++;
            if (ri == NREQ) continue;
            const bool prefill = !seen[ri];
            seen[ri] = true;
            tokens += (size_t)nt[j];
            const size_t ndj = prefill ? 0 : (size_t)nt[j] - 1;
            rows += 1 + ndj;
            if (ndj > 0) n_verify++, kmax = ndj > kmax ? ndj : kmax, nd[nprop++] = (int32_t)ndj;
        }
        int32_t kg = 0;
        for (size_t j = 0; j < nprop; j++) kg = nd[j] > kg ? nd[j] : kg;
        r->kg_steps[kg]++;
        if (md->graphs && nprop > 0 &&
            (fake_graph_launches - g0 != 1 || eagle3_graph_replays(sp) - r0 != 1) && r->graph_misses++ < 3)
            printf("FAIL step %d: %d sequences drafting up to %d: %ld graph launches, %ld chain replays (want 1)\n",
                   step, (int)nprop, kg, fake_graph_launches - g0, eagle3_graph_replays(sp) - r0);
        if (!dev) continue;
        /* the host path: the aux rows, and the flags read twice (the aux download reads them, the LM head's
         * output-row gather re-arms them for the sample download) */
        const size_t aux = aux_dev ? 0 : tokens * row_aux + 8;
        const size_t want = 8 + 4 * (rows + n_verify * (kmax + 2)) + draft_bytes(nd, nprop, md->graphs) + aux;
        const size_t got = fake_d2h_bytes - b0;
        r->d2h_aux += aux;
        r->draft_steps += nprop > 0;
        if (got != want && r->bad_steps++ < 3)
            printf("FAIL step %d (aux %s): %zu bytes device -> host, the table says %zu (%zu rows, %zu chains, "
                   "k_max %zu, %zu drafting, %zu aux bytes)\n", step, aux_dev ? "on the device" : "via the host", got,
                   want, rows, n_verify, kmax, nprop, aux);
    }
    r->d2h = fake_d2h_bytes - d2h0;
    for (int i = 0; i < NREQ; i++) {
        engine_output *o;
        while (!done[i] && engine_stream_wait(st[i], &o, 0.0)) {
            for (size_t t = 0; t < o->n_tokens && r->n[i] < GEN; t++) r->tok[i][r->n[i]++] = o->token_ids[t];
            done[i] = o->finish != FINISH_NONE;
            EXPECT(o->finish != FINISH_ERROR, "request %d finished with an error", i);
            engine_output_free(o);
        }
        EXPECT(done[i], "request %d did not finish", i);
        engine_stream_release(st[i]);
    }
    engine_get_stats(e, &r->st);
    eagle3_graph_get_stats(sp, &r->gs);
    engine_destroy(e);
    eagle3_destroy(sp);
}

static void expect_same(const char *what, const run_out *a, const run_out *b) {
    EXPECT(b->graph_misses == 0, "%s: %d drafting steps did not replay one chain graph", what, b->graph_misses);
    for (int i = 0; i < NREQ; i++)
        EXPECT(a->n[i] == b->n[i] && !memcmp(a->tok[i], b->tok[i], sizeof(int32_t) * (size_t)a->n[i]),
               "%s: request %d: tokens differ from the CPU engine's", what, i);
    EXPECT(a->st.spec_num_drafts_total == b->st.spec_num_drafts_total &&
               a->st.spec_num_draft_tokens_total == b->st.spec_num_draft_tokens_total &&
               a->st.spec_num_accepted_tokens_total == b->st.spec_num_accepted_tokens_total,
           "%s: speculation differs: drafts %lld / %lld, draft tokens %lld / %lld, accepted %lld / %lld", what,
           (long long)a->st.spec_num_drafts_total, (long long)b->st.spec_num_drafts_total,
           (long long)a->st.spec_num_draft_tokens_total, (long long)b->st.spec_num_draft_tokens_total,
           (long long)a->st.spec_num_accepted_tokens_total, (long long)b->st.spec_num_accepted_tokens_total);
    EXPECT(b->bad_steps == 0, "%s: %d steps moved other bytes device -> host than the table", what, b->bad_steps);
    EXPECT(b->draft_steps >= 5, "%s: only %d steps drafted", what, b->draft_steps);
}

/* The head's device feature pool through truncates, re-sent features and freed sequences, against the same
 * head on the CPU (host windows), fed the same host features (a CPU prefill of prompt 0 with aux capture):
 * each round a new sequence id extends the prompt, is truncated to 30 before any pair ran (features cut, the
 * window's last chunk freed), gets the cut tokens and features back, proposes, is truncated into its settled
 * pairs (the window dropped: features re-sent from n - 1), proposes, and is freed. Every draft equal to the CPU head's; the pool has 4
 * chunks (64 rows) for a 37-row prompt, so a chunk leaked by a truncate or a free exhausts it within the 6
 * rounds (the extend then fails). */
static void test_pool_truncate(model *mc, model *md, const char *head) {
    const int32_t V = model_get_config(mc)->vocab, H = model_get_config(mc)->hidden, P = g_np[0];
    specd_err err = {{0}};
    spec_proposer *pa = NULL, *pb = NULL;
    eagle3_opts oa = {.n_blocks = 32}, ob = {.n_blocks = 32, .max_rows = STEP_TOKENS, .max_seqs = 4, .max_k = 4,
                                             .feat_chunks = 4};
    if (eagle3_load(head, mc, &oa, &pa, &err) < 0 || eagle3_load(head, md, &ob, &pb, &err) < 0) {
        EXPECT(0, "eagle3_load: %s", err.msg);
        eagle3_destroy(pa);
        return;
    }
    int32_t layers[8], pos[64], seq[64] = {0}, out[64], table[8];
    const int n_aux = pa->ops->aux_layers(pa->ctx, layers);
    for (int32_t i = 0; i < P; i++) pos[i] = i, out[i] = i;
    for (int32_t b = 0; b < 8; b++) table[b] = b;
    const int32_t *tables[1] = {table};
    float *lg = malloc(sizeof(float) * (size_t)P * V), *aux = malloc(sizeof(float) * (size_t)P * n_aux * H);
    model_batch b = {.n_tokens = P, .tokens = g_prompt[0], .pos = pos, .seq_of = seq, .n_seqs = 1,
                     .block_tables = tables, .n_out = P, .out_idx = out, .logits = lg, .n_aux = n_aux,
                     .aux_layers = layers, .aux = aux};
    if (model_forward(mc, &b, &err) < 0) { EXPECT(0, "forward: %s", err.msg); goto out; }
    int32_t x = 0;
    for (int32_t v = 1; v < V; v++) x = lg[(size_t)(P - 1) * V + v] > lg[(size_t)(P - 1) * V + x] ? v : x;
    const size_t fw = (size_t)n_aux * (size_t)H;
    int n_props = 0;
    for (int64_t id = 1; id <= 6 && !n_fail; id++) {
        spec_proposer *both[2] = {pa, pb};
        int32_t d[2][K];
        const int32_t k = K;
        for (int stage = 0; stage < 2 && !n_fail; stage++) {
            for (int w = 0; w < 2; w++) {
                spec_proposer *sp = both[w];
                int rc = 0;
                if (stage == 0) { /* the prompt and its features, cut past the settled pairs (none yet: the
                                   * window's last chunk goes back), then given back */
                    rc = sp->ops->extend(sp->ctx, id, g_prompt[0], P, 0, aux, &err);
                    sp->ops->truncate(sp->ctx, id, 30);
                    if (rc == 0) rc = sp->ops->extend(sp->ctx, id, g_prompt[0] + 30, P - 30, 30, aux + 30 * fw, &err);
                } else { /* into the settled pairs: the window goes, features re-sent from n - 1 */
                    sp->ops->truncate(sp->ctx, id, P - 5);
                    rc = sp->ops->extend(sp->ctx, id, g_prompt[0] + P - 6, 6, P - 6, aux + (size_t)(P - 6) * fw, &err);
                }
                if (rc == 0) rc = sp->ops->extend(sp->ctx, id, &x, 1, P, NULL, &err);
                if (rc == 0) rc = sp->ops->propose(sp->ctx, &id, &k, 1, K, NULL, d[w], NULL, &err);
                EXPECT(rc == 0, "round %lld stage %d (%s): %s", (long long)id, stage, w ? "device" : "cpu", err.msg);
            }
            EXPECT(!memcmp(d[0], d[1], sizeof d[0]) && d[0][0] >= 0,
                   "round %lld stage %d: device drafts %d %d %d, cpu %d %d %d", (long long)id, stage, d[1][0], d[1][1],
                   d[1][2], d[0][0], d[0][1], d[0][2]);
            n_props++;
        }
        pa->ops->free_seq(pa->ctx, id);
        pb->ops->free_seq(pb->ctx, id);
    }
    if (!n_fail)
        printf("feature pool (4 chunks): %d proposes through truncates, re-sent features and 6 freed sequences, drafts "
               "== the CPU head's\n", n_props);
out:
    free(lg), free(aux);
    eagle3_destroy(pa), eagle3_destroy(pb);
}

int main(void) {
    char p[1024], head[1024];
    snprintf(p, sizeof p, "%s/tests/fixtures/eagle3/capture_smollm2.json", dt_src());
    snprintf(head, sizeof head, "%s/draft/heads/smollm2-135m-eagle3", dt_src());
    json_error_t je;
    json_t *cap = json_load_file(p, 0, &je);
    if (!cap) { printf("FAIL %s: %s\n", p, je.text); return 1; }
    for (int i = 0; i < NREQ; i++) { /* prompts 0, 1 and the tail of prompt 0 */
        json_t *ids = json_object_get(json_array_get(json_object_get(cap, "prompts"), (size_t)(i % 2)), "token_ids");
        const int32_t n = (int32_t)json_array_size(ids), off = i == 2 ? 7 : 0;
        g_np[i] = n - off < 64 ? n - off : 64;
        for (int32_t t = 0; t < g_np[i]; t++) g_prompt[i][t] = (int32_t)json_integer_value(json_array_get(ids, (size_t)(t + off)));
    }
    json_decref(cap);
    backend *cpu = bk_cpu_create(0);
    specd_err err = {{0}};
    /* max_seqs 5: a chain graph of bucket 4 bakes 4 rows + the padding sequence */
    bk_cuda_opts co = {.device = 0, .arena_bytes = (size_t)768 << 20, .max_tokens = STEP_TOKENS, .max_seqs = 5,
                       .max_len = 160, .block_size = 16, .max_heads = 16, .max_head_dim = 128, .sample_vocab = 49152};
    backend *dev = bk_cuda_create(&co, &err);
    if (!cpu || !dev) { printf("FAIL backends: %s\n", err.msg); return 1; }
    model *mc = dt_model(cpu, 48), *md = dt_model(dev, 48);
    test_pool_truncate(mc, md, head);
    run_out a, b, c, h;
    run(mc, &(run_mode){0}, head, &a);
    run(md, &(run_mode){.dev = dev, .aux_dev = true}, head, &b);
    expect_same("features on the device", &a, &b);
    printf("features on the device: %d requests x %d tokens == the CPU engine (%lld drafts, %lld accepted); %d "
           "steps (%d drafting): %zu bytes device -> host in all, %.1f per step, each step exactly the table\n", NREQ,
           GEN, (long long)b.st.spec_num_drafts_total, (long long)b.st.spec_num_accepted_tokens_total, b.steps,
           b.draft_steps, b.d2h, (double)b.d2h / b.steps);
    run(md, &(run_mode){.dev = dev, .aux_dev = true, .feat_chunks = 6}, head, &c);
    expect_same("features on the device, a 6-chunk feature pool", &a, &c);
    EXPECT(c.d2h == b.d2h, "the small pool moved other bytes (%zu vs %zu)", c.d2h, b.d2h);
    run(md, &(run_mode){.dev = dev}, head, &h);
    expect_same("features through the host", &a, &h);
    EXPECT(h.d2h == b.d2h + h.d2h_aux && h.d2h_aux > 0, "the host path moves the table + the aux rows (%zu = %zu + %zu)",
           h.d2h, b.d2h, h.d2h_aux);
    printf("features through the host (before): %zu bytes device -> host, of which %zu aux rows (%.1f per step)\n",
           h.d2h, h.d2h_aux, (double)h.d2h_aux / h.steps);
    /* adaptive speculation with the head's chain graphs: the engine picks k in 0..K per sequence and step, and
     * every greedy drafting step replays ONE graph, the one of its largest k; tokens and counters equal the CPU
     * engine's with adaptive speculation, and both equal plain greedy */
    run_out pa, aa, ag;
    run(mc, &(run_mode){.plain = true}, head, &pa);
    run(mc, &(run_mode){.adaptive = true}, head, &aa);
    run(md, &(run_mode){.dev = dev, .aux_dev = true, .adaptive = true, .graphs = true}, head, &ag);
    expect_same("adaptive, chain graphs", &aa, &ag);
    for (int i = 0; i < NREQ; i++)
        EXPECT(pa.n[i] == GEN && !memcmp(pa.tok[i], ag.tok[i], sizeof pa.tok[i]) &&
                   !memcmp(pa.tok[i], a.tok[i], sizeof pa.tok[i]),
               "request %d: speculative greedy (fixed k, adaptive with graphs) != plain greedy", i);
    long replays = 0, below = 0;
    for (int32_t k = 1; k <= K; k++) {
        EXPECT(ag.gs.replays_k[k] == ag.kg_steps[k], "k = %d: %ld replays of its graph, %ld drafting steps of that "
               "largest k", k, ag.gs.replays_k[k], ag.kg_steps[k]);
        replays += ag.kg_steps[k];
        below += k < K ? ag.kg_steps[k] : 0;
    }
    EXPECT(ag.gs.replays == replays && ag.gs.eager == 0 && below > 0 && replays == ag.draft_steps,
           "adaptive: %ld replays for %d drafting steps (%ld of them with k_max < %d), %ld eager", ag.gs.replays,
           ag.draft_steps, below, K, ag.gs.eager);
    printf("adaptive speculation with chain graphs: %d requests x %d tokens == the CPU engine's == plain greedy "
           "(%lld drafts, %lld accepted); %d drafting steps, each ONE graph launch: by largest k", NREQ, GEN,
           (long long)ag.st.spec_num_drafts_total, (long long)ag.st.spec_num_accepted_tokens_total, ag.draft_steps);
    for (int32_t k = 1; k <= K; k++) printf(" %d: %ld", k, ag.kg_steps[k]);
    printf(" (%ld in a short length class); %zu bytes device -> host\n", ag.gs.short_replays, ag.d2h);
    EXPECT(fake_violations == 0, "%d host pointers reached device ops", fake_violations);
    model_destroy(mc), model_destroy(md);
    bk_cuda_destroy(dev), bk_cpu_destroy(cpu);
    printf(n_fail ? "FAILED: %d\n" : "OK\n", n_fail);
    return n_fail ? 1 : 0;
}
