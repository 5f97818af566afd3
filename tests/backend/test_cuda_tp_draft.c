/*
 * test_cuda_tp_draft.c (backend_cuda_tp_draft, label model, no GPU): the
 * EAGLE-3 head split across GPU tensor-parallel ranks (draft/eagle3_tp.h
 * eagle3_tp_load), on the FAKE CUDA device (cuda_fake.c: device memory is
 * recorded host memory, kernels are the CPU backend's ops), with real rank
 * processes (this binary re-executed as the workers) and the device
 * collectives of --tp-comm shm (staged through the host) or, under
 * tools/kn_emu/run_tp.sh (SPECD_TP_TEST_COMM=cuda_ipc), the real cuda_ipc
 * communicator in the kn_emu emulation.
 *
 * SmolLM2-135M Q4_1 and its trained head (draft/heads/smollm2-135m-eagle3:
 * 9 heads, 3 KV heads, MLP 1536, 32,000 draft ids) at TP 3: every rank holds
 * 3 heads, 1 KV head and 512 MLP rows of the head; 32,000 does not divide by
 * 3, so its LM head is whole on every rank; with a 3,000-id hot vocabulary
 * (written here from the head's own d2t: its first 3,000 draft ids) the LM
 * head is split by rows (1,000 per rank) and the logits are all-gathered on
 * the device before argmax + d2t. Each rank's forward captures the aux rows
 * into its own fixed device buffer; the engine runs with the features on the
 * device (extend_rows), sampling and verification on the device.
 *
 * Checked, against the same engine on CPU TP 3 (the CPU backend on every
 * rank, the head split the CPU way: eagle3_head_tp_shard, rank 0 posting each
 * layer call), for k = 1 and 3 at batch 1 and 8 (greedy, 16 tokens each, 8
 * chat prompts of 17-44 tokens) and the hot-vocabulary head at k = 3, batch 8:
 *   1. every request's tokens identical, and the speculation counters
 *      (drafts, draft tokens, accepted) identical: the device ranks made the
 *      same drafts (fake kernels = CPU ops, collectives in the same rank
 *      order: CPU TP guarantees these bits, so equality is exact);
 *   2. speculative greedy == plain greedy (no draft) at the same TP, token
 *      for token (TP 3 is not bitwise TP 1: the row-parallel sums differ in
 *      the last bits, server_tp documents a late near-tie flip; so the
 *      reference is plain greedy at TP 3);
 *   3. every step's device -> host bytes on rank 0, less what the shm
 *      staging of the collectives downloaded (tp_dev_comm_staged_bytes; 0
 *      under cuda_ipc), equal exactly the table of docs/engine.md "The draft
 *      head on the GPU", as at TP 1: 8 + 4 per sampled row + 4 (k_max + 2)
 *      per verified chain, and in a step that drafts 8 + the drafted ids;
 *      no aux, hidden or logits rows;
 *   4. no host pointer reached a device op on rank 0 or on a worker;
 *   5. a worker whose draft shard does not fit its arena (kind "fakefull":
 *      the arena filled after the target loaded) makes rank 0's
 *      eagle3_tp_load fail naming that rank and the placement ("rank 2:
 *      draft head: ... cannot ..."), within 20 s (loading included).
 * Under kn_emu (SPECD_TP_TEST_COMM=cuda_ipc, SPECD_TP_DRAFT_QUICK=1: the
 * hot-vocabulary case only) check 3 is exact; with the shm staging each
 * staged download may read the backend's 8 flag bytes once more (tp.h), so
 * there a step may exceed the table by a multiple of 8 bytes, at most 8 per
 * staged download, and nothing else.
 * Needs the SmolLM2 GGUF (SPECD_MODEL_GGUF); skips (77) without it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "tests/backend/cuda_fake/cuda_runtime_api.h" /* first: renames the CUDA backend's entry points */
#include "draft/eagle3.h"
#include "draft/eagle3_head.h"
#include "draft/eagle3_tp.h"
#include "engine/backend/cuda_backend.h"
#include "engine/comm/ranks.h"
#include "engine/loader/safetensors.h"
#include "engine/runtime/engine_ex.h"
#include "engine/runtime/tp.h"
#include "tests/backend/tp_fake_util.h"

extern int fake_violations;
extern size_t fake_d2h_bytes;

static int n_fail;
#define EXPECT(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); n_fail++; } } while (0)

enum { N_TP = 3, NREQ = 8, GEN = 16, KMAX = 3, STEP_TOKENS = 128, BS = 16, NBLK = 64, DRAFT_BLK = 128 };
#define ARENA ((size_t)384 << 20)

static backend *fake_dev(specd_err *err) {
    bk_cuda_opts o = {.device = 0, .arena_bytes = ARENA, .max_tokens = STEP_TOKENS, .max_seqs = NREQ + 1,
                      .max_len = 160, .block_size = BS, .max_heads = 16, .max_head_dim = 128, .sample_vocab = 49152,
                      .staging_bytes = (size_t)4 << 20};
    return bk_cuda_create(&o, err);
}

/* The head's options, the same on every rank (their proposers must be sized alike to stay in step). */
static eagle3_opts head_opts(bool on_dev, const char *hot) {
    eagle3_opts o = {.n_blocks = DRAFT_BLK, .hot_vocab = hot && *hot ? hot : NULL};
    if (on_dev) o.max_rows = STEP_TOKENS, o.max_seqs = NREQ, o.max_k = KMAX, o.aux_rows = STEP_TOKENS;
    return o;
}

typedef struct wctx {
    spec_proposer *sp;
    eagle3_head *head;
    model *m;
} wctx;
static int w_mirror(void *ctx, const int32_t *msg, size_t n, specd_err *err) {
    const wctx *w = ctx;
    return eagle3_tp_serve_proposer(w->sp, w->m, msg, n, err);
}
static int w_split(void *ctx, const int32_t *msg, size_t n, specd_err *err) {
    return eagle3_tp_serve(((const wctx *)ctx)->head, msg, n, err);
}

/* Worker: `test --tp-worker cpu|fake|fakefull GGUF HEAD HOT --specd-comm-...` (HOT "" = none). */
static int worker_main(int argc, char **argv) {
    ranks_worker w;
    specd_err err = {{0}};
    comm *c = NULL;
    if (ranks_worker_detect(argc, argv, &w, &err) != 1 || argc < 6 || ranks_worker_attach(&w, &c, &err) < 0) {
        fprintf(stderr, "tp worker: %s\n", err.msg);
        return 1;
    }
    const char *kind = argv[2], *gguf = argv[3], *hdir = argv[4], *hot = argv[5];
    const bool on_dev = strcmp(kind, "cpu") != 0;
    backend *be = on_dev ? fake_dev(&err) : bk_cpu_create(1);
    tp_dev_comm *dev = NULL;
    model_comm mc;
    wctx wc = {0};
    int rc = 1;
    void *ballast = NULL;
    model_load_opts o = {.block_size = BS, .n_blocks = NBLK, .tp = &mc};
    eagle3_opts eo = head_opts(on_dev, hot);
    char why[160] = "";
    if (!be || tp_dev_comm_open(c, be, on_dev ? tp_fake_dev_comm() : TP_COMM_AUTO, &dev, &mc, &err) < 0 ||
        model_load(gguf, be, &o, &wc.m, &err) < 0) {
        comm_abort(c, err.msg[0] ? err.msg : "no backend");
        goto out;
    }
    if (!strcmp(kind, "fakefull")) /* the arena full after the target: the draft shard cannot be placed */
        ballast = be->ops->buf_alloc(be->ctx, ARENA - bk_cuda_arena_used(be) - ((size_t)1 << 20));
    if (on_dev) {
        if (eagle3_tp_load(hdir, wc.m, &eo, c, &mc, &wc.sp, why, sizeof why, &err) < 0) goto out;
        if (!wc.sp) { fprintf(stderr, "tp worker rank %d: the head did not split: %s\n", w.rank, why); goto out; }
    } else if (eagle3_head_load_for(hdir, wc.m, &eo, &wc.head, &err) < 0 ||
               eagle3_head_tp_shard(wc.head, c, &mc, why, sizeof why, &err) != 1) {
        comm_abort(c, err.msg[0] ? err.msg : why);
        goto out;
    }
    if (tp_worker_run_dev(c, wc.m, dev, on_dev ? w_mirror : w_split, &wc, &err) == 0) rc = 0;
out:
    rc = tp_fake_worker_verdict(rc, err.msg, w.rank, on_dev, fake_violations);
    eagle3_destroy(wc.sp);
    eagle3_head_destroy(wc.head);
    model_destroy(wc.m);
    if (ballast) be->ops->buf_free(be->ctx, ballast);
    tp_dev_comm_close(dev);
    if (be) on_dev ? bk_cuda_destroy(be) : bk_cpu_destroy(be);
    comm_destroy(c);
    return rc;
}

static const char *g_self;

typedef struct grp {
    ranks *rk;
    backend *be;
    bool on_dev;
    tp_dev_comm *dev;
    model_comm mc;
    model *m;
    tp_runner tr;
    spec_proposer *sp;
} grp;

/* N_TP ranks of KIND (rank 0: "fake" for any fake kind) with the head at HEAD (HOT: hot vocabulary or ""). */
static int grp_open(grp *g, const char *gguf, const char *head, const char *hot, const char *kind, specd_err *err) {
    memset(g, 0, sizeof *g);
    g->on_dev = strcmp(kind, "cpu") != 0;
    const char *argv[] = {g_self, "--tp-worker", kind, gguf, head, hot, NULL};
    ranks_config rc = {.world = N_TP, .worker_argv = argv, .comm = comm_config_default(), .attach_timeout_ms = 60000};
    if (ranks_launch(&rc, &g->rk, err) < 0) return -1;
    comm *c = ranks_comm(g->rk);
    g->be = g->on_dev ? fake_dev(err) : bk_cpu_create(1);
    if (!g->be || tp_dev_comm_open(c, g->be, g->on_dev ? tp_fake_dev_comm() : TP_COMM_AUTO, &g->dev, &g->mc, err) < 0)
        return -1;
    model_load_opts o = {.block_size = BS, .n_blocks = NBLK, .tp = &g->mc};
    if (model_load(gguf, g->be, &o, &g->m, err) < 0) return -1;
    g->tr = (tp_runner){g->m, c, g->dev};
    eagle3_opts eo = head_opts(g->on_dev, hot);
    char why[160] = "";
    if (g->on_dev) {
        const size_t a0 = bk_cuda_arena_used(g->be);
        const int split = eagle3_tp_load(head, g->m, &eo, c, &g->mc, &g->sp, why, sizeof why, err);
        if (split < 0) return -1;
        if (split != 1) return specd_err_set(err, "the head did not split across %d ranks: %s", N_TP, why);
        printf("rank 0's draft shard%s: %.1f MiB of its arena (weights, KV, workspace, feature pool, buffers)\n",
               *hot ? " (hot vocabulary)" : "", (double)(bk_cuda_arena_used(g->be) - a0) / (1 << 20));
    } else if (eagle3_load(head, g->m, &eo, &g->sp, err) < 0 ||
               eagle3_head_tp_shard(eagle3_proposer_head(g->sp), c, &g->mc, why, sizeof why, err) != 1) {
        if (!err->msg[0]) specd_err_set(err, "the CPU head did not split: %s", why);
        return -1;
    }
    return 0;
}

/* tp_fake_group_close's order, with the proposer destroyed after the workers are gone (its destroy posts
 * nothing) and before the model it borrows. */
static int grp_close(grp *g, specd_err *err) {
    int rc = 0;
    if (g->rk) rc = ranks_shutdown(g->rk, 10000, err);
    eagle3_destroy(g->sp);
    tp_dev_comm_close(g->dev);
    if (g->rk) ranks_destroy(g->rk);
    model_destroy(g->m);
    if (g->be) g->on_dev ? bk_cuda_destroy(g->be) : bk_cpu_destroy(g->be);
    memset(g, 0, sizeof *g);
    return rc;
}

/* ------------------------------------------------------------ the engine at TP 3 */

static void *dt_create(void *ctx, bool skip) { (void)ctx, (void)skip; return calloc(1, 1); }
static void dt_destroy(void *s) { free(s); }
static int dt_push(void *s, int32_t id, char **out, size_t *len, size_t *cap) { (void)s, (void)id, (void)out, (void)len, (void)cap; return 0; }
static int dt_flush(void *s, char **out, size_t *len, size_t *cap) { (void)s, (void)out, (void)len, (void)cap; return 0; }

static int32_t g_prompt[NREQ][64], g_np[NREQ];

typedef struct run_out {
    int32_t tok[NREQ][GEN], n[NREQ];
    engine_stats st;
    int steps, bad_steps, draft_steps;
    size_t d2h, staged;
} run_out;

/* Drafted-id bytes of a propose whose sequences drafted nd[0..n) tokens (the chain's one download: each step's
 * ids padded to 4, after the 8-byte flags). */
static size_t draft_bytes(const int32_t *nd, size_t n) {
    int32_t kmax = 0;
    for (size_t i = 0; i < n; i++) kmax = nd[i] > kmax ? nd[i] : kmax;
    size_t b = 0;
    for (int32_t j = 0; j < kmax; j++) {
        size_t rows = 0;
        for (size_t i = 0; i < n; i++) rows += nd[i] > j;
        b += 4 * ((rows + 3) & ~(size_t)3);
    }
    return kmax ? 8 + b : 0;
}

/* nreq greedy requests of GEN tokens through an engine on group g at k (0: plain, no proposer). */
static void run(grp *g, int k, int nreq, run_out *r) {
    memset(r, 0, sizeof *r);
    specd_err err = {{0}};
    model *m = g->m;
    engine_runner rn = {.ctx = &g->tr, .forward = tp_runner_forward, .vocab = model_get_config(m)->vocab,
                        .hidden = model_get_config(m)->hidden, .block_size = model_kv_block_size(m),
                        .n_blocks = model_kv_n_blocks(m), .sample_be = g->on_dev ? g->be : NULL,
                        .aux_dev = g->on_dev ? model_aux_device(m) : NULL};
    static const int32_t eos[1] = {2};
    engine_detok d = {.stream_create = dt_create, .stream_destroy = dt_destroy, .push = dt_push, .flush = dt_flush,
                      .eos_ids = eos, .n_eos = 1};
    engine_config cfg = {.max_model_len = 160, .max_num_seqs = NREQ, .max_num_batched_tokens = STEP_TOKENS,
                         .max_waiting = 16, .num_speculative_tokens = k};
    engine *e = NULL;
    if (engine_create_ex(&cfg, &rn, &d, m, NULL, &e, &err) != 0 || (k > 0 && engine_set_proposer(e, g->sp, &err) != 0)) {
        EXPECT(0, "engine: %s", err.msg);
        engine_destroy(e);
        return;
    }
    engine_stream *st[NREQ];
    int64_t sid[NREQ];
    bool done[NREQ] = {0};
    int32_t pre[NREQ] = {0}; /* prompt tokens computed */
    for (int i = 0; i < nreq; i++) {
        engine_request q;
        memset(&q, 0, sizeof q);
        sampling_params_init(&q.sp);
        q.sp.temperature = 0.0f, q.sp.max_tokens = GEN, q.sp.ignore_eos = true;
        q.prompt = g_prompt[i], q.n_prompt = (size_t)g_np[i];
        st[i] = engine_submit(e, &q, NULL, NULL, NULL, &err);
        if (!st[i]) { EXPECT(0, "submit: %s", err.msg); engine_destroy(e); return; }
        sid[i] = engine_stream_seq_id(st[i]);
    }
    const size_t d2h0 = fake_d2h_bytes, sg0 = tp_dev_comm_staged_bytes(g->dev, NULL);
    const bool exact = tp_dev_comm_kind(g->dev) != TP_COMM_SHM; /* no staging: nothing but the engine's bytes */
    for (int step = 0; step < 400; step++) {
        size_t n0 = 0, n1 = 0;
        const size_t b0 = fake_d2h_bytes, s0 = tp_dev_comm_staged_bytes(g->dev, &n0);
        const int n = engine_step(e, &err);
        if (n < 0) { EXPECT(0, "step: %s", err.msg); break; }
        if (n == 0) break;
        r->steps++;
        const int64_t *ids;
        const int32_t *nt;
        const size_t ns = engine_last_schedule(e, &ids, &nt);
        size_t rows = 0, n_verify = 0, kmax = 0, nprop = 0;
        int32_t nd[NREQ];
        for (size_t j = 0; j < ns; j++) {
            int ri = 0;
            while (ri < nreq && sid[ri] != ids[j]) ri++;
            if (ri == nreq) continue;
            /* a prompt chunk samples a row only when it completes the prompt (the budget splits 8 prompts) */
            if (pre[ri] < g_np[ri]) {
                pre[ri] += nt[j];
                rows += pre[ri] >= g_np[ri];
                continue;
            }
            const size_t ndj = (size_t)nt[j] - 1;
            rows += 1 + ndj;
            if (ndj > 0) n_verify++, kmax = ndj > kmax ? ndj : kmax, nd[nprop++] = (int32_t)ndj;
        }
        if (!g->on_dev) continue;
        const size_t want = 8 + 4 * (rows + n_verify * (kmax + 2)) + draft_bytes(nd, nprop);
        const size_t got = fake_d2h_bytes - b0 - (tp_dev_comm_staged_bytes(g->dev, &n1) - s0);
        r->draft_steps += nprop > 0;
        /* shm: each staged download may read the 8 flag bytes once more (tp.h); cuda_ipc: exactly the table */
        const bool ok = exact ? got == want : got >= want && (got - want) % 8 == 0 && got - want <= 8 * (n1 - n0);
        if (!ok && r->bad_steps++ < 3)
            printf("FAIL step %d (k %d, batch %d): %zu bytes device -> host on rank 0 besides the staged collectives, "
                   "the table says %zu (%zu rows, %zu chains, k_max %zu, %zu drafting)\n", step, k, nreq, got, want,
                   rows, n_verify, kmax, nprop);
    }
    r->d2h = fake_d2h_bytes - d2h0;
    r->staged = tp_dev_comm_staged_bytes(g->dev, NULL) - sg0;
    for (int i = 0; i < nreq; i++) {
        engine_output *o;
        while (!done[i] && engine_stream_wait(st[i], &o, 0.0)) {
            for (size_t t = 0; t < o->n_tokens && r->n[i] < GEN; t++) r->tok[i][r->n[i]++] = o->token_ids[t];
            done[i] = o->finish != FINISH_NONE;
            EXPECT(o->finish != FINISH_ERROR, "k %d batch %d: request %d finished with an error", k, nreq, i);
            engine_output_free(o);
        }
        EXPECT(done[i], "k %d batch %d: request %d did not finish", k, nreq, i);
        engine_stream_release(st[i]);
    }
    engine_get_stats(e, &r->st);
    engine_destroy(e);
}

static bool same_tokens(const run_out *a, const run_out *b, int nreq) {
    for (int i = 0; i < nreq; i++)
        if (a->n[i] != b->n[i] || memcmp(a->tok[i], b->tok[i], sizeof(int32_t) * (size_t)a->n[i])) return false;
    return true;
}

/* ------------------------------------------------------------ the proposer driven directly */

/* The calls the engine above does not make (or not in these runs), on rank 0's proposer, mirrored to the
 * workers: extend with HOST features (uploaded on every rank: the broadcast path), a truncate before any pair
 * ran and one into the settled pairs (features re-sent), a seeded sampled propose (temperature 0.8, q wanted:
 * every rank draws from its own copy of the sequence's RNG over the gathered logits), a free. The features are
 * a fixed pattern (the same on both groups: the drafts are compared, not judged). out: DIRECT_OUT drafts. */
enum { DIRECT_OUT = 4 * KMAX };
static int direct(grp *g, int32_t *out, specd_err *err) {
    spec_proposer *sp = g->sp;
    const spec_proposer_ops *op = sp->ops;
    const int32_t Ht = model_get_config(g->m)->hidden, Vt = model_get_config(g->m)->vocab, P = g_np[0];
    int32_t layers[8];
    const size_t fw = (size_t)op->aux_layers(sp->ctx, layers) * (size_t)Ht;
    float *aux = malloc(sizeof(float) * (size_t)P * fw), *q = calloc((size_t)KMAX * (size_t)Vt, sizeof(float));
    int rc = -1;
    if (!aux || !q) { specd_err_set(err, "out of memory"); goto out; }
    for (size_t i = 0; i < (size_t)P * fw; i++) aux[i] = (float)((int)(i * 2654435761u % 2001u) - 1000) / 400.0f;
    const int64_t id = 4242;
    const int32_t k = KMAX, x = 1000;
    const float temp = 0.8f, greedy = 0.0f;
    if (op->extend(sp->ctx, id, g_prompt[0], P, 0, aux, err) < 0) goto out;
    op->truncate(sp->ctx, id, 30); /* before any pair ran: the window's tail goes */
    if (op->extend(sp->ctx, id, g_prompt[0] + 30, P - 30, 30, aux + 30 * fw, err) < 0 ||
        op->extend(sp->ctx, id, &x, 1, P, NULL, err) < 0 ||
        op->propose(sp->ctx, &id, &k, 1, KMAX, &greedy, out, NULL, err) < 0)
        goto out;
    op->truncate(sp->ctx, id, P - 5); /* into the settled pairs: features re-sent from P - 6 */
    if (op->extend(sp->ctx, id, g_prompt[0] + P - 6, 6, P - 6, aux + (size_t)(P - 6) * fw, err) < 0 ||
        op->extend(sp->ctx, id, &x, 1, P, NULL, err) < 0 ||
        op->propose(sp->ctx, &id, &k, 1, KMAX, &greedy, out + KMAX, NULL, err) < 0)
        goto out;
    op->seed_seq(sp->ctx, id, 12345);
    if (op->propose(sp->ctx, &id, &k, 1, KMAX, &temp, out + 2 * KMAX, q, err) < 0) goto out;
    op->seed_seq(sp->ctx, id, 777);
    if (op->propose(sp->ctx, &id, &k, 1, KMAX, &temp, out + 3 * KMAX, q, err) < 0) goto out;
    op->free_seq(sp->ctx, id);
    rc = 0;
out:
    free(aux), free(q);
    return rc;
}

/* ------------------------------------------------------------ the hot vocabulary of 3,000 draft ids */

/* Writes PATH: d2t I64 [3000] whose target ids are the head's draft ids 0 .. 2999 (so every one is scored: an LM
 * head of 3,000 rows, which divides by 3). The head's own map, read from its safetensors. */
static int write_hot(const char *head, const char *path, specd_err *err) {
    char p[4200];
    snprintf(p, sizeof p, "%s/model.safetensors", head);
    st_model *sm = NULL;
    if (st_open(p, &sm, err) < 0) return -1;
    const st_tensor *t = st_find(sm, "d2t");
    enum { NH = 3000 };
    int rc = -1;
    if (!t || t->dtype != ST_I64 || t->shape[0] < NH) {
        specd_err_set(err, "%s: no int64 d2t of >= %d entries", p, NH);
    } else {
        int64_t off[NH];
        memcpy(off, t->data, sizeof off); /* target id = i + d2t[i]: the same offsets for the first NH ids */
        const int64_t shape[1] = {NH};
        const st_write_tensor w = {"d2t", ST_I64, 1, shape, off};
        static const char *const meta[] = {"target_vocab_size", "49152", NULL};
        rc = st_write(path, &w, 1, meta, err);
    }
    st_close(sm);
    return rc;
}

/* ------------------------------------------------------------ scenarios */

typedef struct cfg_run {
    int k, nreq;
} cfg_run;

static void scenarios(const char *gguf, const char *head, const char *hot, const cfg_run *cr, int n_cr) {
    specd_err err = {{0}};
    grp gc, gd;
    run_out *rc = calloc((size_t)n_cr, sizeof *rc), *rd = calloc((size_t)n_cr, sizeof *rd), plain_d[2];
    if (grp_open(&gc, gguf, head, hot, "cpu", &err) < 0) {
        EXPECT(0, "CPU TP %d group%s: %s", N_TP, *hot ? " (hot vocabulary)" : "", err.msg);
        grp_close(&gc, &err);
        free(rc), free(rd);
        return;
    }
    for (int i = 0; i < n_cr; i++) run(&gc, cr[i].k, cr[i].nreq, &rc[i]);
    int32_t dc[DIRECT_OUT], dd[DIRECT_OUT];
    EXPECT(direct(&gc, dc, &err) == 0, "CPU TP %d, the proposer driven directly: %s", N_TP, err.msg);
    EXPECT(grp_close(&gc, &err) == 0, "CPU group shutdown: %s", err.msg);
    const int viol0 = fake_violations;
    if (grp_open(&gd, gguf, head, hot, "fake", &err) < 0) {
        EXPECT(0, "fake-device TP %d group%s: %s", N_TP, *hot ? " (hot vocabulary)" : "", err.msg);
        grp_close(&gd, &err);
        free(rc), free(rd);
        return;
    }
    const bool vsplit = eagle3_head_n_scored(eagle3_proposer_head(gd.sp)) % N_TP == 0;
    run(&gd, 0, 1, &plain_d[0]);
    run(&gd, 0, NREQ, &plain_d[1]);
    for (int i = 0; i < n_cr; i++) {
        run(&gd, cr[i].k, cr[i].nreq, &rd[i]);
        const run_out *a = &rc[i], *b = &rd[i], *pl = &plain_d[cr[i].nreq > 1];
        const char *what = *hot ? "hot vocabulary (LM head split)" : "LM head whole on every rank";
        EXPECT(same_tokens(a, b, cr[i].nreq), "%s, k %d, batch %d: tokens differ from CPU TP %d's", what, cr[i].k,
               cr[i].nreq, N_TP);
        EXPECT(same_tokens(pl, b, cr[i].nreq), "%s, k %d, batch %d: speculative greedy differs from plain greedy", what,
               cr[i].k, cr[i].nreq);
        EXPECT(a->st.spec_num_drafts_total == b->st.spec_num_drafts_total &&
                   a->st.spec_num_draft_tokens_total == b->st.spec_num_draft_tokens_total &&
                   a->st.spec_num_accepted_tokens_total == b->st.spec_num_accepted_tokens_total,
               "%s, k %d, batch %d: speculation differs from CPU TP: drafts %lld / %lld, draft tokens %lld / %lld, "
               "accepted %lld / %lld", what, cr[i].k, cr[i].nreq, (long long)b->st.spec_num_drafts_total,
               (long long)a->st.spec_num_drafts_total, (long long)b->st.spec_num_draft_tokens_total,
               (long long)a->st.spec_num_draft_tokens_total, (long long)b->st.spec_num_accepted_tokens_total,
               (long long)a->st.spec_num_accepted_tokens_total);
        EXPECT(b->bad_steps == 0, "%s, k %d, batch %d: %d steps moved other bytes than the table", what, cr[i].k,
               cr[i].nreq, b->bad_steps);
        EXPECT(b->draft_steps >= 3 && b->st.spec_num_accepted_tokens_total > 0,
               "%s, k %d, batch %d: %d drafting steps, %lld accepted", what, cr[i].k, cr[i].nreq, b->draft_steps,
               (long long)b->st.spec_num_accepted_tokens_total);
        printf("smollm2 TP %d, %s (%s), k = %d, batch %d: %d x %d tokens == CPU TP %d == plain greedy; %lld drafts, "
               "%lld of %lld draft tokens accepted (== CPU TP); %d steps (%d drafting): %zu B device -> host on rank 0 "
               "besides %zu B of staged collectives, %.1f per step, each step the table\n",
               N_TP, what, vsplit ? "logits all-gathered" : "no gather", cr[i].k, cr[i].nreq, cr[i].nreq, GEN, N_TP,
               (long long)b->st.spec_num_drafts_total, (long long)b->st.spec_num_accepted_tokens_total,
               (long long)b->st.spec_num_draft_tokens_total, b->steps, b->draft_steps, b->d2h - b->staged, b->staged,
               (double)(b->d2h - b->staged) / b->steps);
    }
    EXPECT(vsplit == (*hot != 0), "the LM head split by vocabulary %s", *hot ? "with 3,000 ids" : "not with 32,000");
    EXPECT(direct(&gd, dd, &err) == 0, "fake-device TP %d, the proposer driven directly: %s", N_TP, err.msg);
    EXPECT(!memcmp(dc, dd, sizeof dc) && dd[0] >= 0 && dd[KMAX] >= 0 && dd[2 * KMAX] >= 0,
           "host-feature extends, truncates, seeded sampled proposes: drafts differ from CPU TP's (%d %d %d | %d %d "
           "%d | %d %d %d vs %d %d %d | %d %d %d | %d %d %d)", dd[0], dd[1], dd[2], dd[3], dd[4], dd[5], dd[6], dd[7],
           dd[8], dc[0], dc[1], dc[2], dc[3], dc[4], dc[5], dc[6], dc[7], dc[8]);
    if (!memcmp(dc, dd, sizeof dc))
        printf("the proposer driven directly (host-feature extends, 2 truncates, greedy and seeded sampled proposes, "
               "a free): %d drafts == CPU TP %d's\n", DIRECT_OUT, N_TP);
    EXPECT(grp_close(&gd, &err) == 0, "fake-device group shutdown (a worker failed or saw a host pointer): %s", err.msg);
    EXPECT(fake_violations == viol0, "%d host pointers reached device ops on rank 0", fake_violations - viol0);
    free(rc), free(rd);
}

/* A worker whose draft shard cannot be placed: rank 0's eagle3_tp_load fails naming the rank and the reason. */
static void check_place_fails(const char *gguf, const char *head) {
    specd_err err = {{0}};
    grp g;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const int rc = grp_open(&g, gguf, head, "", "fakefull", &err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("draft shards that do not fit on ranks 1 and 2: rank 0 fails after %.2f s: %s\n", s, err.msg);
    EXPECT(rc < 0 && !g.sp, "rank 0's head load must fail");
    EXPECT((strstr(err.msg, "rank 1: draft head:") || strstr(err.msg, "rank 2: draft head:")) &&
               (strstr(err.msg, "cannot") || strstr(err.msg, "arena")),
           "the reason names the rank and the placement: %s", err.msg);
    EXPECT(s < 20, "failed after %.2f s (bound 20 s, loading included)", s);
    specd_err e2 = {{0}};
    EXPECT(grp_close(&g, &e2) != 0, "the failed workers are reported at shutdown");
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--tp-worker")) return worker_main(argc, argv);
    g_self = argv[0];
    const char *gguf = getenv("SPECD_MODEL_GGUF"), *src = getenv("SPECD_SOURCE_DIR");
    if (!gguf || access(gguf, R_OK)) {
        printf("SKIP: SmolLM2 GGUF not found at %s\n", gguf ? gguf : "(SPECD_MODEL_GGUF unset)");
        return 77;
    }
    char p[4096], head[4096], hot[256];
    snprintf(head, sizeof head, "%s/draft/heads/smollm2-135m-eagle3", src ? src : ".");
    snprintf(p, sizeof p, "%s/tests/fixtures/eagle3/capture_smollm2.json", src ? src : ".");
    json_error_t je;
    json_t *cap = json_load_file(p, 0, &je);
    if (!cap) { printf("FAIL %s: %s\n", p, je.text); return 1; }
    for (int i = 0; i < NREQ; i++) { /* prompts 0 and 1, each with 4 different starts */
        json_t *ids = json_object_get(json_array_get(json_object_get(cap, "prompts"), (size_t)(i % 2)), "token_ids");
        const int32_t n = (int32_t)json_array_size(ids), off = 3 * (i / 2);
        g_np[i] = n - off < 64 ? n - off : 64;
        for (int32_t t = 0; t < g_np[i]; t++) g_prompt[i][t] = (int32_t)json_integer_value(json_array_get(ids, (size_t)(t + off)));
    }
    json_decref(cap);
    snprintf(hot, sizeof hot, "/tmp/specd_tp_draft_hot_%d.safetensors", (int)getpid());
    specd_err err = {{0}};
    if (write_hot(head, hot, &err) < 0) { printf("FAIL writing the hot vocabulary: %s\n", err.msg); return 1; }
    printf("device collectives: %s\n", tp_comm_kind_name(tp_fake_dev_comm()));
    const cfg_run all[4] = {{1, 1}, {3, 1}, {1, NREQ}, {3, NREQ}}, hot1[1] = {{3, NREQ}};
    /* SPECD_TP_DRAFT_QUICK=1 (tools/kn_emu/run_tp.sh, where the cuda_ipc kernels run emulated): k = 3 at batch 8
     * with the vocabulary-split head only */
    const char *quick = getenv("SPECD_TP_DRAFT_QUICK");
    if (!quick || strcmp(quick, "1")) scenarios(gguf, head, "", all, 4);
    scenarios(gguf, head, hot, hot1, 1);
    check_place_fails(gguf, head);
    unlink(hot);
    printf(n_fail ? "FAILED: %d\n" : "OK\n", n_fail);
    return n_fail ? 1 : 0;
}
