/*
 * test_cuda_spec_prefix.c (label model, no GPU): prefix-cache hits of
 * SPECULATING sequences with the features on the device, the device feature
 * cache (eagle3_opts.feat_cache, proposer.h extend_slots; docs/engine.md
 * "The draft head on the GPU"). SmolLM2 and its trained EAGLE-3 head on the
 * FAKE CUDA device (cuda_fake.c), wired as `specd serve --device cuda
 * --enable-prefix-caching` with a draft wires them: device sampling, the
 * target's aux rows in its fixed device buffer, the head's feature pool one
 * row per target KV slot.
 *
 * A KV pool of 8 blocks of 16 tokens, greedy requests of 71 prompt tokens
 * (a 64-token shared prefix = 4 blocks: chat turns of the capture fixture's
 * prompts; then one varying token and the assistant header) and 16
 * generated tokens at k = 3, served one after the other on one engine:
 *   R1 = P1 + a   cold (6 blocks); its full blocks stay in the prefix cache
 *   R2 = P1 + b   must hit 64 tokens (n_cached_prompt, and the engine's
 *                 prefix_cache_hits_total grows by 64); 2 new blocks: all
 *                 8 blocks of the pool have now been used
 *   R3 = P2 + c   P2 shares its first block (the system turn) with P1: a hit
 *                 of 16; its other 5 blocks are evicted cached ones (every
 *                 block was used), so P2's KV and features now sit in
 *                 physical blocks that held P1's / R1's / R2's
 *   R4 = P2 + d   must hit 64 tokens, on those reused blocks
 *   R5 = P1 + a   P1's blocks after the first were evicted by R3: a hit of
 *                 16 (the shared first block), then recomputed
 * Checked for every request:
 *   1. its tokens, every draft token the proposer returned (recorded at its
 *      propose) and its speculation counters (drafts, draft tokens, accepted
 *      tokens: the engine's totals before / after it) equal the same request
 *      served COLD on a fresh device engine (empty cache): the cached
 *      positions' features fed the draft the same bits the cold prefill
 *      computed;
 *   2. the same against the CPU engine with prefix caching (host features,
 *      the host aux_pool: the reference path) running R1..R5 the same way,
 *      including the same cached-token counts;
 *   3. every step's device -> host bytes equal exactly the table of
 *      backend_cuda_spec_engine (8 + 4 per sampled row + 4 (k_max + 2) per
 *      verified chain + the drafted ids' download): no feature row ever
 *      comes back, and a hit request moves exactly the bytes of its cold run;
 *   4. R2 and R4 drafted and accepted something (the comparison is not void);
 *   5. no host pointer reached a device op.
 * Also: a head loaded with feat_cache but an engine whose features travel
 * through the host is refused at engine_set_proposer with the reason; the
 * cache takes exactly the target's KV slots x n_aux x H x 4 bytes of the
 * device arena in place of the chunk pool (bk_cuda_arena_used: what the
 * bundle's plan counts per KV token), allocated once at load; and a load
 * whose arena cannot hold the cache (a filler leaves the head and half the
 * cache free) fails naming the device feature cache, while the same arena
 * still takes the head without it.
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

#define NB 8          /* KV blocks of 16 tokens: tight, so R3 evicts cached blocks */
#define PREFIX 64
#define SUFFIX 7
#define PLEN (PREFIX + SUFFIX)
#define GEN 16
#define K 3
#define STEP_TOKENS 128
#define MAX_LEN 128
#define NREQ 5

static void *dt_create(void *ctx, bool skip) { (void)ctx, (void)skip; return calloc(1, 1); }
static void dt_destroy(void *s) { free(s); }
static int dt_push(void *s, int32_t id, char **out, size_t *len, size_t *cap) { (void)s, (void)id, (void)out, (void)len, (void)cap; return 0; }
static int dt_flush(void *s, char **out, size_t *len, size_t *cap) { (void)s, (void)out, (void)len, (void)cap; return 0; }

static int fwd(void *ctx, const model_batch *b, specd_err *err) { return model_forward(ctx, b, err); }

static int32_t g_req[NREQ][PLEN];

/* Every draft the proposer returned during the current request (the engine sees the proposer through
 * rec_propose). */
#define MAX_DRAFTS (GEN * K * 2)
static int32_t g_drafts[MAX_DRAFTS];
static int g_n_drafts;
static int (*g_propose)(void *, const int64_t *, const int32_t *, int32_t, int32_t, const float *, int32_t *, float *,
                        specd_err *);
static int rec_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                       int32_t *out_tokens, float *out_q, specd_err *err) {
    const int rc = g_propose(ctx, ids, k, n, k_max, temps, out_tokens, out_q, err);
    for (int32_t i = 0; rc == 0 && i < n * k_max; i++)
        if (g_n_drafts < MAX_DRAFTS) g_drafts[g_n_drafts++] = out_tokens[i];
    return rc;
}

/* One request's result. */
typedef struct req_out {
    int32_t tok[GEN], n;
    int32_t drafted[MAX_DRAFTS], n_drafted; /* the proposer's outputs, in order (-1: no draft) */
    int32_t cached;                    /* n_cached_prompt_tokens of its output */
    int64_t drafts, draft_tokens, acc; /* the engine's speculation counters over it */
    int64_t hits;                      /* the engine's prefix_cache_hits_total over it */
    size_t d2h;                        /* device -> host bytes over it */
    int bad_steps;                     /* steps whose bytes differ from the table */
} req_out;

typedef struct rig {
    engine *e;
    spec_proposer *sp, rec;
    spec_proposer_ops rec_ops;
    backend *dev;
} rig;

static int rig_open(rig *r, model *m, backend *dev, const char *head, specd_err *err) {
    memset(r, 0, sizeof *r);
    r->dev = dev;
    eagle3_opts eo = {.n_blocks = 64};
    if (dev) eo.max_rows = STEP_TOKENS, eo.max_seqs = 4, eo.max_k = K, eo.aux_rows = STEP_TOKENS, eo.feat_cache = true;
    if (eagle3_load(head, m, &eo, &r->sp, err) < 0) return -1;
    engine_runner rn = {.ctx = m, .vocab = model_get_config(m)->vocab,
                        .hidden = model_get_config(m)->hidden, .block_size = model_kv_block_size(m),
                        .n_blocks = model_kv_n_blocks(m), .sample_be = dev,
                        .aux_dev = dev ? model_aux_device(m) : NULL};
    rn.forward = fwd;
    static const int32_t eos[1] = {2};
    engine_detok d = {.stream_create = dt_create, .stream_destroy = dt_destroy, .push = dt_push, .flush = dt_flush,
                      .eos_ids = eos, .n_eos = 1};
    engine_config cfg = {.max_model_len = MAX_LEN, .max_num_seqs = 4, .max_num_batched_tokens = STEP_TOKENS,
                         .max_waiting = 16, .num_speculative_tokens = K, .enable_prefix_caching = true};
    if (engine_create_ex(&cfg, &rn, &d, m, NULL, &r->e, err) != 0) return -1;
    r->rec_ops = *r->sp->ops;
    g_propose = r->sp->ops->propose;
    r->rec_ops.propose = rec_propose;
    r->rec = (spec_proposer){.ops = &r->rec_ops, .ctx = r->sp->ctx};
    return engine_set_proposer(r->e, &r->rec, err);
}

static void rig_close(rig *r) {
    engine_destroy(r->e);
    eagle3_destroy(r->sp);
    memset(r, 0, sizeof *r);
}

/* Drafted-id bytes of a propose whose one sequence drafted nd tokens (chain(): each step's ids padded to 4). */
static size_t draft_bytes(int32_t nd) { return nd > 0 ? 8 + 4 * 4 * (size_t)nd : 0; }

/* Serves request `ri` alone on r (steps until it finishes), with the table check per step on a device rig. */
static void serve(rig *r, int ri, req_out *o) {
    memset(o, 0, sizeof *o);
    specd_err err = {{0}};
    engine_stats s0, s1;
    engine_get_stats(r->e, &s0);
    engine_request q;
    memset(&q, 0, sizeof q);
    sampling_params_init(&q.sp);
    q.sp.temperature = 0.0f, q.sp.max_tokens = GEN, q.sp.ignore_eos = true;
    q.prompt = g_req[ri], q.n_prompt = PLEN;
    engine_stream *st = engine_submit(r->e, &q, NULL, NULL, NULL, &err);
    if (!st) { EXPECT(0, "submit: %s", err.msg); return; }
    const size_t d0 = fake_d2h_bytes;
    g_n_drafts = 0;
    bool first = true;
    for (int step = 0; step < 100; step++) {
        const size_t b0 = fake_d2h_bytes;
        const int n = engine_step(r->e, &err);
        if (n < 0) { EXPECT(0, "R%d step: %s", ri + 1, err.msg); break; }
        if (n == 0) break;
        if (!r->dev) continue;
        const int64_t *ids;
        const int32_t *nt;
        if (engine_last_schedule(r->e, &ids, &nt) != 1) { EXPECT(0, "R%d: one sequence per step", ri + 1); break; }
        const int32_t nd = first ? 0 : nt[0] - 1; /* the prefill step samples one row; a verify 1 + nd rows */
        first = false;
        const size_t want = 8 + 4 * (size_t)(1 + nd) + (nd > 0 ? 4 * (size_t)(nd + 2) : 0) + draft_bytes(nd);
        const size_t got = fake_d2h_bytes - b0;
        if (got != want && o->bad_steps++ < 3)
            printf("FAIL R%d step %d: %zu bytes device -> host, the table says %zu (%d drafts)\n", ri + 1, step, got,
                   want, nd);
    }
    o->d2h = fake_d2h_bytes - d0;
    memcpy(o->drafted, g_drafts, sizeof(int32_t) * (size_t)g_n_drafts);
    o->n_drafted = g_n_drafts;
    engine_output *out;
    bool done = false;
    while (!done && engine_stream_wait(st, &out, 0.0)) {
        for (size_t t = 0; t < out->n_tokens && o->n < GEN; t++) o->tok[o->n++] = out->token_ids[t];
        if (out->finish != FINISH_NONE) o->cached = (int32_t)out->n_cached_prompt_tokens;
        done = out->finish != FINISH_NONE;
        EXPECT(out->finish != FINISH_ERROR, "R%d finished with an error: %s", ri + 1, out->error);
        engine_output_free(out);
    }
    EXPECT(done && o->n == GEN, "R%d did not finish with %d tokens (%d)", ri + 1, GEN, o->n);
    engine_stream_release(st);
    engine_get_stats(r->e, &s1);
    o->drafts = s1.spec_num_drafts_total - s0.spec_num_drafts_total;
    o->draft_tokens = s1.spec_num_draft_tokens_total - s0.spec_num_draft_tokens_total;
    o->acc = s1.spec_num_accepted_tokens_total - s0.spec_num_accepted_tokens_total;
    o->hits = s1.prefix_cache_hits_total - s0.prefix_cache_hits_total;
}

static void expect_same(const char *what, int ri, const req_out *a, const req_out *b) {
    EXPECT(a->n == b->n && !memcmp(a->tok, b->tok, sizeof(int32_t) * (size_t)a->n), "R%d (%s): tokens differ", ri + 1,
           what);
    EXPECT(a->n_drafted == b->n_drafted && !memcmp(a->drafted, b->drafted, sizeof(int32_t) * (size_t)a->n_drafted),
           "R%d (%s): the proposer's drafts differ (%d / %d proposed)", ri + 1, what, a->n_drafted, b->n_drafted);
    EXPECT(a->drafts == b->drafts && a->draft_tokens == b->draft_tokens && a->acc == b->acc,
           "R%d (%s): speculation differs: drafts %lld / %lld, draft tokens %lld / %lld, accepted %lld / %lld", ri + 1,
           what, (long long)a->drafts, (long long)b->drafts, (long long)a->draft_tokens, (long long)b->draft_tokens,
           (long long)a->acc, (long long)b->acc);
}

/* A fresh fake device of ARENA bytes with SmolLM2 of NBM KV blocks on it. */
static backend *mem_dev(size_t arena, int32_t nbm, model **m) {
    specd_err err = {{0}};
    bk_cuda_opts co = {.device = 0, .arena_bytes = arena, .max_tokens = STEP_TOKENS, .max_seqs = 5, .max_len = MAX_LEN,
                       .block_size = 16, .max_heads = 16, .max_head_dim = 128, .sample_vocab = 49152};
    backend *dev = bk_cuda_create(&co, &err);
    if (!dev) { EXPECT(0, "fake device: %s", err.msg); return NULL; }
    *m = dt_model(dev, nbm);
    return dev;
}

/* The cache's device memory: exactly the KV slots x n_aux x H f32 in place of the chunk pool, and a refusal naming
 * it when the arena cannot hold it (a target of 64 KV blocks: the cache, 7 MB, outweighs the chunk pool). */
static void check_memory(const char *head) {
    enum { NBM = 64 };
    specd_err err = {{0}};
    model *md = NULL;
    backend *dev = mem_dev((size_t)512 << 20, NBM, &md);
    if (!dev) return;
    spec_proposer *sp = NULL;
    eagle3_opts with = {.n_blocks = 64, .max_rows = STEP_TOKENS, .max_seqs = 4, .max_k = K, .aux_rows = STEP_TOKENS,
                        .feat_cache = true}, without = with;
    without.feat_cache = false;
    /* fresh arena: the head without the cache (its first load also reserves the target's aux buffer for good) */
    if (eagle3_load(head, md, &without, &sp, &err) < 0) { EXPECT(0, "eagle3_load (no cache): %s", err.msg); return; }
    EXPECT(sp->ops->feat_cache_slots(sp->ctx) == 0, "a head without feat_cache reports a feature cache");
    const size_t top_without = bk_cuda_arena_used(dev);
    eagle3_destroy(sp);
    const size_t used_a = bk_cuda_arena_used(dev); /* the model + the aux buffer */
    if (eagle3_load(head, md, &with, &sp, &err) < 0) { EXPECT(0, "eagle3_load (cache): %s", err.msg); return; }
    const int64_t slots = sp->ops->feat_cache_slots(sp->ctx);
    int32_t layers[8];
    const int n_aux = sp->ops->aux_layers(sp->ctx, layers);
    const size_t used_with = bk_cuda_arena_used(dev) - used_a, used_without = top_without - used_a;
    const size_t row = 4 * (size_t)n_aux * (size_t)model_get_config(md)->hidden;
    eagle3_destroy(sp);
    model_destroy(md);
    bk_cuda_destroy(dev);
    const size_t cache = (size_t)NBM * 16 * row;
    /* the chunk pool's default (eagle3.h feat_chunks): 2 (max_rows / bs + 1) + max_seqs (ceil((k + 2) / bs) + 1) */
    const size_t chunks = 2 * (STEP_TOKENS / 16 + 1) + 4 * ((K + 2 + 15) / 16 + 1), pool = chunks * 16 * row;
    EXPECT(slots == (int64_t)NBM * 16, "the cache has %lld rows, the KV pool %d slots", (long long)slots, NBM * 16);
    EXPECT(used_with + pool == used_without + cache, "arena: %zu bytes with the cache, %zu without; the cache is %zu, "
           "the chunk pool %zu", used_with, used_without, cache, pool);
    /* an arena that holds the model and the head without the cache (the same loads on a fresh arena place alike,
     * first fit) and 64 KiB more: the cache's 4 MB over the chunk pool outweighs all the head places after its
     * feature pool (the sampled drafts' q rows, 1.7 MB here), so the load with it must fail naming the cache */
    const size_t arena_b = (top_without + ((size_t)64 << 10) + 255) & ~(size_t)255;
    if (!(dev = mem_dev(arena_b, NBM, &md))) return;
    err.msg[0] = 0;
    const int rc = eagle3_load(head, md, &with, &sp, &err);
    EXPECT(rc < 0 && strstr(err.msg, "device feature cache"), "a cache that does not fit: rc %d, '%s'", rc, err.msg);
    if (rc == 0) eagle3_destroy(sp);
    else printf("a cache that does not fit is refused: %s\n", err.msg);
    sp = NULL;
    EXPECT(eagle3_load(head, md, &without, &sp, &err) == 0, "the same arena without the cache: %s", err.msg);
    EXPECT(sp && sp->ops->dev_q_backend(sp->ctx) == dev, "a head with room for its q rows has no device q");
    eagle3_destroy(sp);
    model_destroy(md);
    bk_cuda_destroy(dev);
    /* the q rows of sampled drafts are optional: an arena 1 MB short of the head without the cache (its q rows are
     * [K, 4, Vd] f32 = 1.5 MB, placed after everything it cannot do without) loads the head without them, and
     * sampled chains verify on the host (dev_q_backend NULL) */
    const size_t arena_c = (top_without - ((size_t)1 << 20)) & ~(size_t)255;
    if (!(dev = mem_dev(arena_c, NBM, &md))) return;
    sp = NULL;
    EXPECT(eagle3_load(head, md, &without, &sp, &err) == 0, "an arena short of the q rows: %s", err.msg);
    EXPECT(sp && sp->ops->dev_q_backend(sp->ctx) == NULL, "an arena short of the q rows still has device q rows");
    if (sp) eagle3_destroy(sp);
    model_destroy(md);
    bk_cuda_destroy(dev);
    printf("device memory: the cache takes %zu bytes (%d KV slots x %zu) in place of the %zu-byte chunk pool\n",
           cache, NBM * 16, row, pool);
}

/* extend_slots refuses what it cannot index (review5): every block id the call writes or the draft's window reads
 * must be one of the target's NBB KV blocks, the table must cover the positions, the aux rows must be in the
 * target's buffer; a refused call leaves the sequence as it was (a valid call at the same positions then works),
 * and a feature-cache head refuses the host-row and aux-row feeds with the reason. */
static void check_bad_calls(const char *head) {
    enum { NBB = 8 };
    specd_err err = {{0}};
    model *md = NULL;
    backend *dev = mem_dev((size_t)512 << 20, NBB, &md);
    if (!dev) return;
    spec_proposer *sp = NULL;
    eagle3_opts eo = {.n_blocks = 64, .max_rows = STEP_TOKENS, .max_seqs = 4, .max_k = K, .aux_rows = STEP_TOKENS,
                      .feat_cache = true};
    if (eagle3_load(head, md, &eo, &sp, &err) < 0) {
        EXPECT(0, "eagle3_load: %s", err.msg);
        model_destroy(md), bk_cuda_destroy(dev);
        return;
    }
    const spec_proposer_ops *o = sp->ops;
    const int fails0 = n_fail;
    EXPECT(o->feat_cache_slots(sp->ctx) == NBB * 16, "the cache has %lld rows, want %d",
           (long long)o->feat_cache_slots(sp->ctx), NBB * 16);
    int32_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = 100 + i;
    static const struct { const char *what, *want; int32_t pos0, n, row0, nb, b[3]; } BAD[] = {
        {"a block id past the pool", "KV block id 8 outside the target's 8", 0, 20, 0, 2, {0, NBB}},
        {"a negative block id", "KV block id -1 outside", 0, 20, 0, 2, {-1, 1}},
        {"a table shorter than the positions", "a block table of 1 blocks of 16", 0, 20, 0, 1, {0}},
        {"aux rows past the target's buffer", "outside the target's aux buffer", 0, 20, STEP_TOKENS - 10, 2, {0, 1}},
        {"a negative table length", "a block table of -1 blocks", 0, 20, 0, -1, {0}},
    };
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        err.msg[0] = 0;
        const int rc = o->extend_slots(sp->ctx, 1, tok, BAD[i].n, BAD[i].pos0, BAD[i].row0, BAD[i].b, BAD[i].nb, &err);
        EXPECT(rc < 0 && strstr(err.msg, BAD[i].want), "%s: rc %d, '%s' (want '%s')", BAD[i].what, rc, err.msg,
               BAD[i].want);
    }
    /* positions 0..19 in blocks 5, 2; then 20..23 with a table whose block 0 (read by the window, which still
     * starts at 0: no pair has run) is bad, while the block the call writes (1) is fine: refused */
    const int32_t good[3] = {5, 2, 7}, bad_low[2] = {NBB + 3, 2};
    EXPECT(o->extend_slots(sp->ctx, 1, tok, 20, 0, 0, good, 2, &err) == 0, "a valid extend_slots: %s", err.msg);
    err.msg[0] = 0;
    int rc = o->extend_slots(sp->ctx, 1, tok + 20, 4, 20, 20, bad_low, 2, &err);
    EXPECT(rc < 0 && strstr(err.msg, "KV block id 11 outside"), "a bad block the window reads (below pos0): rc %d, "
           "'%s'", rc, err.msg);
    EXPECT(o->extend_slots(sp->ctx, 1, tok + 20, 4, 20, 20, good, 2, &err) == 0,
           "the same positions with a valid table after the refusal: %s", err.msg);
    /* the sampled token (no features yet), then a propose: the window read blocks 5, 2 and drafted */
    EXPECT(o->extend(sp->ctx, 1, tok + 24, 1, 24, NULL, &err) == 0, "extend of the sampled token: %s", err.msg);
    const int32_t prop_k = K;
    int32_t drafts[K];
    const int64_t id = 1;
    const float temp0 = 0.f;
    EXPECT(o->propose(sp->ctx, &id, &prop_k, 1, K, &temp0, drafts, NULL, &err) == 0, "propose after them: %s", err.msg);
    EXPECT(drafts[0] >= 0 && drafts[0] < model_get_config(md)->vocab, "no draft after the valid feeds (%d)", drafts[0]);
    /* propose_dev past the q buffer's max_k slices (a per-request k above the head's, engine API): the same
     * drafts as propose, every q row -1 (verified one-hot: lossless), not a failed step */
    {
        enum { KX = K + 2 };
        const int32_t kx = KX;
        int32_t dx[KX], rows[KX];
        spec_dev_q dq = {.row = rows};
        EXPECT(o->propose_dev(sp->ctx, &id, &kx, 1, KX, &temp0, dx, &dq, &err) == 0,
               "propose_dev with k_max %d > max_k %d: %s", KX, K, err.msg);
        EXPECT(!memcmp(dx, drafts, sizeof drafts), "propose_dev past max_k drafts differently from propose");
        for (int j = 0; j < KX; j++) EXPECT(rows[j] == -1, "propose_dev past max_k: q row %d of draft %d", rows[j], j);
    }
    /* the host-row and aux-row feeds are refused on a feature-cache head */
    float aux[1] = {0};
    err.msg[0] = 0;
    rc = o->extend(sp->ctx, 2, tok, 1, 0, aux, &err);
    EXPECT(rc < 0 && strstr(err.msg, "device feature cache"), "extend with host rows: rc %d, '%s'", rc, err.msg);
    err.msg[0] = 0;
    rc = o->extend_rows(sp->ctx, 2, tok, 1, 0, 0, &err);
    EXPECT(rc < 0 && strstr(err.msg, "extend_slots"), "extend_rows: rc %d, '%s'", rc, err.msg);
    if (n_fail == fails0)
        printf("extend_slots: %zu bad calls refused with the reason, valid ones after them fed and proposed\n",
               sizeof BAD / sizeof BAD[0] + 1);
    eagle3_destroy(sp);
    model_destroy(md);
    bk_cuda_destroy(dev);
}

int main(void) {
    char p[1024], head[1024];
    snprintf(p, sizeof p, "%s/tests/fixtures/eagle3/capture_smollm2.json", dt_src());
    snprintf(head, sizeof head, "%s/draft/heads/smollm2-135m-eagle3", dt_src());
    setvbuf(stdout, NULL, _IONBF, 0);
    check_bad_calls(head); /* first: quick */
    json_error_t je;
    json_t *cap = json_load_file(p, 0, &je);
    if (!cap) { printf("FAIL %s: %s\n", p, je.text); return 1; }
    int32_t src[2][64], ns[2];
    for (int i = 0; i < 2; i++) {
        json_t *ids = json_object_get(json_array_get(json_object_get(cap, "prompts"), (size_t)i), "token_ids");
        ns[i] = (int32_t)json_array_size(ids) < 64 ? (int32_t)json_array_size(ids) : 64;
        for (int32_t t = 0; t < ns[i]; t++) src[i][t] = (int32_t)json_integer_value(json_array_get(ids, (size_t)t));
    }
    json_decref(cap);
    if (ns[0] < 16 || ns[1] < 16) { printf("FAIL: capture prompts too short\n"); return 1; }
    /* prompt 0 is a chat: the system turn (21 tokens), "<|im_start|>user\n" (3), the question (7), then
     * "<|im_end|>\n<|im_start|>assistant\n" (its last 6 tokens); prompt 1 a plain text of 23 tokens.
     * P1 = system + user header + question + prompt 1 + prompt 1's first 10 (64 tokens); P2 = system + user header
     * + prompt 1 + prompt 1's first 17 (64); a request = prefix + one varying token + the assistant header */
    if (ns[0] != 37 || ns[1] != 23) { printf("FAIL: capture prompts of %d and %d tokens, want 37 and 23\n", ns[0], ns[1]); return 1; }
    int32_t P1[PREFIX], P2[PREFIX];
    memcpy(P1, src[0], sizeof(int32_t) * 31), memcpy(P1 + 31, src[1], sizeof(int32_t) * 23);
    memcpy(P1 + 54, src[1], sizeof(int32_t) * 10);
    memcpy(P2, src[0], sizeof(int32_t) * 24), memcpy(P2 + 24, src[1], sizeof(int32_t) * 23);
    memcpy(P2 + 47, src[1], sizeof(int32_t) * 17);
    const int32_t *pre[NREQ] = {P1, P1, P2, P2, P1};
    const int32_t vary[NREQ] = {src[0][30], src[1][22], src[0][30], src[1][11], src[0][30]};
    for (int r = 0; r < NREQ; r++) {
        memcpy(g_req[r], pre[r], sizeof(int32_t) * PREFIX);
        g_req[r][PREFIX] = vary[r];
        memcpy(g_req[r] + PREFIX + 1, src[0] + 31, sizeof(int32_t) * 6);
    }
    backend *cpu = bk_cpu_create(0);
    specd_err err = {{0}};
    bk_cuda_opts co = {.device = 0, .arena_bytes = (size_t)768 << 20, .max_tokens = STEP_TOKENS, .max_seqs = 5,
                       .max_len = MAX_LEN, .block_size = 16, .max_heads = 16, .max_head_dim = 128,
                       .sample_vocab = 49152};
    backend *dev = bk_cuda_create(&co, &err);
    if (!cpu || !dev) { printf("FAIL backends: %s\n", err.msg); return 1; }
    model *mc = dt_model(cpu, NB), *md = dt_model(dev, NB);

    /* the device engine, R1..R5 on one cache */
    req_out w[NREQ], c[NREQ], h[NREQ];
    rig r;
    if (rig_open(&r, md, dev, head, &err) < 0) { printf("FAIL device rig: %s\n", err.msg); return 1; }
    for (int i = 0; i < NREQ; i++) serve(&r, i, &w[i]);
    rig_close(&r);
    /* each request cold: a fresh device engine (empty cache) */
    for (int i = 0; i < NREQ; i++) {
        if (rig_open(&r, md, dev, head, &err) < 0) { printf("FAIL device rig: %s\n", err.msg); return 1; }
        serve(&r, i, &c[i]);
        rig_close(&r);
    }
    /* the CPU engine (host features, the host aux_pool), R1..R5 on one cache */
    if (rig_open(&r, mc, NULL, head, &err) < 0) { printf("FAIL cpu rig: %s\n", err.msg); return 1; }
    for (int i = 0; i < NREQ; i++) serve(&r, i, &h[i]);
    rig_close(&r);

    static const int32_t want_hit[NREQ] = {0, PREFIX, 16, PREFIX, 16};
    for (int i = 0; i < NREQ; i++) {
        EXPECT(w[i].cached == want_hit[i] && w[i].hits == want_hit[i], "R%d: %d cached prompt tokens, %lld prefix-cache "
               "hit tokens counted; want %d", i + 1, w[i].cached, (long long)w[i].hits, want_hit[i]);
        EXPECT(c[i].cached == 0, "R%d cold: %d cached tokens", i + 1, c[i].cached);
        EXPECT(h[i].cached == w[i].cached, "R%d: the CPU engine cached %d tokens, the device %d", i + 1, h[i].cached,
               w[i].cached);
        expect_same("after the others vs cold, device", i, &c[i], &w[i]);
        expect_same("device vs the CPU engine", i, &h[i], &w[i]);
        EXPECT(w[i].bad_steps == 0 && c[i].bad_steps == 0, "R%d: %d (warm) / %d (cold) steps off the byte table", i + 1,
               w[i].bad_steps, c[i].bad_steps);
        EXPECT(w[i].d2h == c[i].d2h, "R%d: %zu bytes device -> host after the others, %zu cold", i + 1, w[i].d2h,
               c[i].d2h);
        printf("R%d: %2d prompt tokens from the cache; %d tokens, %lld drafts, %lld draft tokens, %lld accepted == "
               "cold == CPU engine; %zu bytes device -> host (cold %zu)\n", i + 1, w[i].cached, w[i].n,
               (long long)w[i].drafts, (long long)w[i].draft_tokens, (long long)w[i].acc, w[i].d2h, c[i].d2h);
    }
    EXPECT(w[1].acc + w[3].acc > 0 && w[1].n_drafted > 0 && w[3].n_drafted > 0,
           "the hit requests drafted %d / %d and accepted %lld / %lld: nothing compared", w[1].n_drafted,
           w[3].n_drafted, (long long)w[1].acc, (long long)w[3].acc);

    /* a feature-cache head next to an engine whose features travel through the host: refused, with the reason */
    spec_proposer *sp = NULL;
    eagle3_opts eo = {.n_blocks = 64, .max_rows = STEP_TOKENS, .max_seqs = 4, .max_k = K, .aux_rows = STEP_TOKENS,
                      .feat_cache = true};
    engine *e = NULL;
    if (eagle3_load(head, md, &eo, &sp, &err) == 0) {
        engine_runner rn = {.ctx = md, .vocab = model_get_config(md)->vocab, .hidden = model_get_config(md)->hidden,
                            .block_size = 16, .n_blocks = NB, .sample_be = dev, .aux_dev = NULL};
        rn.forward = fwd;
        static const int32_t eos[1] = {2};
        engine_detok d = {.stream_create = dt_create, .stream_destroy = dt_destroy, .push = dt_push,
                          .flush = dt_flush, .eos_ids = eos, .n_eos = 1};
        engine_config cfg = {.max_model_len = MAX_LEN, .max_num_seqs = 4, .max_num_batched_tokens = STEP_TOKENS,
                             .num_speculative_tokens = K, .enable_prefix_caching = true};
        err.msg[0] = 0;
        const int rc = engine_create_ex(&cfg, &rn, &d, md, NULL, &e, &err) == 0 ? engine_set_proposer(e, sp, &err) : 0;
        EXPECT(rc < 0 && strstr(err.msg, "feature cache"), "feature cache + host features: rc %d, '%s'", rc, err.msg);
        if (rc < 0) printf("refused as it must: %s\n", err.msg);
        engine_destroy(e);
        eagle3_destroy(sp);
    } else {
        EXPECT(0, "eagle3_load: %s", err.msg);
    }
    check_memory(head);
    EXPECT(fake_violations == 0, "%d host pointers reached device ops", fake_violations);
    model_destroy(mc), model_destroy(md);
    bk_cuda_destroy(dev), bk_cpu_destroy(cpu);
    printf(n_fail ? "FAILED: %d\n" : "OK\n", n_fail);
    return n_fail ? 1 : 0;
}
