/*
 * test_cuda_graphs.c (label unit, no GPU): CUDA graphs of the Llama forward
 * (engine/model/model_graph.c + the glue's graph ops) on the FAKE device
 * (cuda_fake.c: a capture records the kn_* launches with their arguments, a
 * graph launch replays them on the memory's contents at that time).
 *
 * Two copies of the same model on two fake devices, one eager, one with
 * graphs captured for buckets {1, 2, 4, 8} x q {1, 4} (decode; verify of 3
 * drafts), fed the same steps:
 *   - 8 sequences prefilled eagerly to different lengths (3 .. 45);
 *   - decode steps of 1..8 sequences (inside buckets: 1, 2, 4, 8; between
 *     them, so padded: 3, 5, 6, 7), verify steps of 4 tokens for 1..8
 *     sequences, a mixed step (decode + verify rows: fits the decode graph of
 *     8 with padding), and steps that fit no graph (T = 40: eager);
 *   - every step's logits (and aux features, when captured with them) of the
 *     graph model are bit-identical (memcmp) to the eager model's, and the
 *     eager model's to the CPU backend's at the first and last step; every
 *     other step of the graph model keeps its logits on the device
 *     (model_batch.logits_dev, the engine's device sampling) and those real
 *     rows, downloaded by the test, are the same bits;
 *   - a replayed step issues ZERO kernel launches from the host and exactly
 *     one graph launch (counted by the fake); an eager step issues launches
 *     and no graph launch; the stats count replays, eager steps and padding;
 *   - the padding block left the pool (model_kv_n_blocks one lower);
 *   - no host pointer reached a device op, no copy / sync inside a capture.
 * Mutation checks: padding rows pointed at a real sequence's table change
 * that sequence's later logits; meta_upload ignoring fixed_shape (the step's
 * own length bound baked into the graph) fails the replays.
 *
 * The same source is the GPU test `cuda_graphs` (label gpu, tests/kernels;
 * exits 77 without a usable GPU): on an H200 the graph model's logits and
 * aux must equal the eager model's bit for bit (the kernels are
 * batch-invariant and the attention's arithmetic for a token depends on its
 * position only, not on the launch's length bound), on the HF minis and the
 * SmolLM2-shaped twin ($SPECD_TWIN_DIR); launches are not counted there (the
 * replay count is), and GPU vs CPU is tests/kernels/test_cuda_backend.c's
 * job. `cuda_graphs --bench FILE` times decode steps with graphs on vs off
 * at batch 1..32 on the twin (tools/gpu_check.sh) and appends JSON lines.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <time.h>

#include "engine/backend/backend.h"
#include "engine/model/model.h"
#ifdef SPECD_GRAPHS_ON_FAKE
#include "tests/backend/cuda_fake/cuda_runtime_api.h"
#define ON_GPU 0
#else
#include "tests/kernels/kn_harness.h"
#define ON_GPU 1
static long fake_host_launches, fake_graph_launches, fake_captured_launches; /* not counted on a GPU */
static int fake_violations, fake_graphs_alive;
#endif
#include "engine/backend/cuda_backend.h"

static int n_fail;
#define EXPECT(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); n_fail++; } } while (0)

#define NS 8     /* sequences */
#define NB 8     /* blocks per sequence (128 positions) */
#define MAXT 48  /* largest step (prefill of 45 tokens) */

typedef struct side { backend *be; model *m; } side;

typedef struct step {
    int32_t n, n_seqs;
    int32_t tok[MAXT], pos[MAXT], seq[MAXT], oi[MAXT];
    const int32_t *bt[NS];
} step;

static int32_t tables[NS][NB];
static int32_t len[NS];
#define NBL 20    /* blocks of the long sequence (320 positions), after the others' NS * NB */
static int32_t long_table[NBL];

/* Adds q tokens of sequence s (its next positions) to st; ids from a hash of (s, position, salt). */
static void add_seq(step *st, int32_t s, int32_t q, int32_t V, uint32_t salt) {
    const int32_t si = st->n_seqs++;
    st->bt[si] = tables[s];
    for (int32_t j = 0; j < q; j++) {
        const int32_t t = st->n++;
        st->pos[t] = len[s] + j;
        st->seq[t] = si;
        st->tok[t] = (int32_t)(((uint32_t)s * 2654435761u + (uint32_t)st->pos[t] * 40503u + salt) % (uint32_t)V);
        st->oi[t] = t;
    }
}

static int run(side *S, const step *st, int32_t n_out, const int32_t *oi, float *logits, int32_t n_aux,
               const int32_t *aux_layers, float *aux, specd_err *err) {
    model_batch b = {.n_tokens = st->n, .tokens = st->tok, .pos = st->pos, .seq_of = st->seq, .n_seqs = st->n_seqs,
                     .block_tables = st->bt, .n_out = n_out, .out_idx = oi, .logits = logits, .n_aux = n_aux,
                     .aux_layers = aux_layers, .aux = aux};
    return model_forward(S->m, &b, err);
}

/* run() with the logits kept on the device (model_batch.logits_dev, as the engine's device sampling asks),
 * then downloaded here into logits: a graph step must leave the real rows' logits where an eager one does. */
static int run_dev(side *S, const step *st, float *logits, int32_t n_aux, const int32_t *aux_layers, float *aux,
                   specd_err *err) {
    bk_tensor ld = {0};
    model_batch b = {.n_tokens = st->n, .tokens = st->tok, .pos = st->pos, .seq_of = st->seq, .n_seqs = st->n_seqs,
                     .block_tables = st->bt, .n_out = st->n, .out_idx = st->oi, .logits_dev = &ld, .n_aux = n_aux,
                     .aux_layers = aux_layers, .aux = aux};
    if (model_forward(S->m, &b, err) < 0) return -1;
    const int32_t V = model_get_config(S->m)->vocab;
    if (!ld.data || ld.rows != st->n || ld.cols != V)
        return specd_err_set(err, "device logits [%lld, %lld], want [%d, %d]", (long long)ld.rows, (long long)ld.cols,
                             st->n, V);
    return S->be->ops->download(S->be->ctx, logits, ld.data, sizeof(float) * (size_t)st->n * V);
}

static backend *fake_dev(void) {
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)(ON_GPU ? 2048 : 256) << 20, .max_tokens = 64,
                      .max_seqs = NS + 1,
                      .max_len = 512, .block_size = 16, .max_heads = 16, .max_head_dim = 128, .staging_bytes = 4096};
    specd_err err = {{0}};
    backend *b = bk_cuda_create(&o, &err);
    if (!b) printf("FAIL: fake device: %s\n", err.msg);
    return b;
}

/* Inside a capture the glue refuses what a graph cannot hold (metadata upload, upload, download, buf_alloc,
 * sample) BEFORE any stream call: the capture stays valid (end instantiates it; the fake counts no copy,
 * memset or sync inside it). A meta_upload that synchronised before refusing, or a buf_alloc / sample that
 * staged or memset, invalidates a real capture (on the fake: a violation). */
static void test_capture_refusals(void) {
    backend *b = fake_dev();
    if (!b) { n_fail++; return; }
    const bk_ops *op = b->ops;
    void *bx = b->ctx;
    const int v0 = fake_violations;
    float *buf = op->buf_alloc(bx, 64 * sizeof(float)); /* [1, 64] logits, before the capture */
    EXPECT(buf != NULL, "buf_alloc before a capture");
    int32_t pos[1] = {0}, seq[1] = {0}, blk[1] = {0};
    const int32_t *bt[1] = {blk};
    bk_attn_meta am = {1, pos, seq, bt, 1, NULL, NULL};
    float h[4] = {0};
    const bk_tensor lg = bk_wrap_f32(buf, 1, 64);
    const bk_sample_row row = {.temperature = 0.0f, .top_p = 1.0f, .repetition_penalty = 1.0f, .top_k = 0,
                               .forced = -1};
    int32_t id = -1;
    EXPECT(op->graph->begin(bx) == 0, "graph begin");
    EXPECT(op->meta_upload(bx, &am) < 0, "meta_upload inside a capture accepted");
    EXPECT(op->upload(bx, buf, h, sizeof h) < 0, "upload inside a capture accepted");
    EXPECT(op->download(bx, h, buf, sizeof h) < 0, "download inside a capture accepted");
    void *p = op->buf_alloc(bx, 256);
    EXPECT(p == NULL, "buf_alloc inside a capture accepted");
    op->buf_free(bx, p);
    EXPECT(op->sample(bx, &lg, &row, 1, NULL, 0, &id, NULL, NULL) < 0, "sample inside a capture accepted");
    void *exec = NULL;
    EXPECT(op->graph->end(bx, &exec) == 0 && exec, "the capture was invalidated by a refused call");
    EXPECT(fake_violations == v0, "%d calls a capture cannot hold were made inside it", fake_violations - v0);
    if (exec) op->graph->destroy(bx, exec);
    am.dev = NULL;
    EXPECT(op->meta_upload(bx, &am) == 0, "meta_upload after the capture");
    op->meta_release(bx, &am);
    op->buf_free(bx, buf);
    bk_cuda_destroy(b);
}

static void test_model(const char *path, backend *cpu, bool with_aux) {
    struct stat stt;
    if (stat(path, &stt) != 0) { printf("%s: absent, skipped\n", path); return; }
    specd_err err = {{0}};
    /* + the long sequence's blocks, + 1: the graph model's padding block */
    model_load_opts mo = {.block_size = 16, .n_blocks = NS * NB + NBL + 1};
    side c = {cpu, NULL}, e = {fake_dev(), NULL}, g = {fake_dev(), NULL};
    float *lc = NULL, *le = NULL, *lg = NULL, *ae = NULL, *ag = NULL;
    if (!e.be || !g.be) goto out;
    if (model_load(path, c.be, &mo, &c.m, &err) || model_load(path, e.be, &mo, &e.m, &err) ||
        model_load(path, g.be, &mo, &g.m, &err)) {
        EXPECT(0, "%s: %s", path, err.msg);
        goto out;
    }
    const model_config *cfg = model_get_config(e.m);
    const int32_t V = cfg->vocab, H = cfg->hidden;
    const int32_t aux_layers[2] = {1, cfg->n_layers > 2 ? cfg->n_layers - 2 : 1};
    const int32_t n_aux = with_aux ? 2 : 0;
    /* CPU capture is refused with the reason */
    static const int32_t buckets[] = {1, 2, 4, 8}, qs[] = {1, 4};
    /* length classes (F8): 512 (the backend's bound) and 256 (the next, 512 / 4 rounded up to the attention's
     * 256-position split; floor 64): short steps replay grids of one split per (token, head) */
    model_graph_opts go = {.buckets = buckets, .n_buckets = 4, .q = qs, .n_q = 2, .n_aux = n_aux,
                           .aux_layers = aux_layers, .max_step_tokens = MAXT, .max_seqs = NS + 1, .max_tokens = 64,
                           .max_len = 512, .len_floor = 64};
    EXPECT(model_graphs_capture(c.m, &go, &err) < 0 && strstr(err.msg, "no graphs"), "CPU: refused (%s)", err.msg);
    EXPECT(model_kv_n_blocks(c.m) == NS * NB + NBL + 1, "a refused capture leaves the pool whole");
    const long cap0 = fake_captured_launches;
    const int32_t nb0 = model_kv_n_blocks(g.m);
    if (model_graphs_capture(g.m, &go, &err) < 0) {
        EXPECT(0, "%s: capture: %s", path, err.msg);
        goto out;
    }
    model_graph_stats gs;
    model_graph_get_stats(g.m, &gs);
    EXPECT(gs.n_graphs == 16, "16 graphs captured: 8 buckets x 2 length classes (%d)", gs.n_graphs);
    EXPECT(model_kv_n_blocks(g.m) == nb0 - 1, "the padding block left the pool (%d -> %d)", nb0,
           model_kv_n_blocks(g.m));
    EXPECT(ON_GPU || fake_captured_launches > cap0, "captures recorded launches");
    printf("%s: 16 graphs captured (2 length classes), %ld launches recorded\n", path, fake_captured_launches - cap0);

    /* physical blocks: sequence s owns s, s + NS, s + 2 NS, ... (interleaved, so a wrong table collides) */
    for (int32_t s = 0; s < NS; s++) {
        for (int32_t j = 0; j < NB; j++) tables[s][j] = s + NS * j;
        len[s] = 0;
    }
    lc = malloc(sizeof(float) * MAXT * (size_t)V), le = malloc(sizeof(float) * MAXT * (size_t)V);
    lg = malloc(sizeof(float) * MAXT * (size_t)V);
    ae = calloc((size_t)MAXT * 2 * (size_t)H, sizeof(float)), ag = calloc((size_t)MAXT * 2 * (size_t)H, sizeof(float));
    if (!lc || !le || !lg || !ae || !ag) { EXPECT(0, "out of memory"); goto out; }

    /* prefill (eager on both: one output row), lengths 3 + 6 s */
    for (int32_t s = 0; s < NS; s++) {
        step st = {0};
        add_seq(&st, s, 3 + 6 * s, V, 7);
        const int32_t oi[1] = {st.n - 1};
        if (run(&e, &st, 1, oi, le, 0, NULL, NULL, &err) || run(&g, &st, 1, oi, lg, 0, NULL, NULL, &err) ||
            (!ON_GPU && run(&c, &st, 1, oi, lc, 0, NULL, NULL, &err))) {
            EXPECT(0, "prefill: %s", err.msg);
            goto out;
        }
        EXPECT(!memcmp(le, lg, sizeof(float) * (size_t)V), "prefill logits equal");
        len[s] += 3 + 6 * s;
    }
    model_graph_get_stats(g.m, &gs);
    EXPECT(gs.replays == 0 && gs.eager == NS, "prefill steps fit no graph (replays %ld, eager %ld)", gs.replays,
           gs.eager);

    /* the plan: (sequences, tokens per sequence); q 0 = mixed (decode rows + one verify) */
    static const int32_t plan[][2] = {{1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}, {7, 1}, {8, 1}, {1, 4},
                                      {3, 4}, {5, 4}, {8, 4}, {3, 0}, {8, 5}, {2, 1}, {8, 1}};
    const int n_plan = (int)(sizeof plan / sizeof plan[0]);
    int n_same = 0, n_replayed = 0, n_eager = 0, n_dev = 0;
    for (int pi = 0; pi < n_plan; pi++) {
        const int32_t ns = plan[pi][0], q = plan[pi][1];
        step st = {0};
        /* rotate which sequences take part */
        for (int32_t k = 0; k < ns; k++) {
            const int32_t s = (k * 3 + pi) % NS, qq = q ? q : (k == ns - 1 ? 4 : 1);
            add_seq(&st, s, qq, V, (uint32_t)pi);
        }
        const bool fits = st.n <= 32;
        const long hl0 = fake_host_launches, gl0 = fake_graph_launches;
        model_graph_get_stats(g.m, &gs);
        const long r0 = gs.replays;
        /* odd steps: the logits stay on the device (device sampling), downloaded by run_dev */
        const bool dev = pi % 2 == 1 && model_logits_on_device(g.m);
        const int rg = dev ? run_dev(&g, &st, lg, n_aux, aux_layers, ag, &err)
                           : run(&g, &st, st.n, st.oi, lg, n_aux, aux_layers, ag, &err);
        const long hl = fake_host_launches - hl0, gl = fake_graph_launches - gl0;
        const int re = rg ? -1 : run(&e, &st, st.n, st.oi, le, n_aux, aux_layers, ae, &err);
        if (rg || re) {
            EXPECT(0, "step %d (%d seqs x %d): %s", pi, ns, q, err.msg);
            goto out;
        }
        model_graph_get_stats(g.m, &gs);
        if (fits) {
            EXPECT(ON_GPU || (hl == 0 && gl == 1), "step %d: launches", pi);
            EXPECT(gs.replays == r0 + 1 && gs.replays == r0 + 1, "step %d (%d tokens): %ld host launches, %ld graph launches (want 0, 1)", pi,
                   st.n, hl, gl);
            n_replayed++;
        } else {
            EXPECT((ON_GPU || (hl > 0 && gl == 0)) && gs.replays == r0, "step %d (%d tokens, eager): %ld host launches, %ld graph", pi,
                   st.n, hl, gl);
            n_eager++;
        }
        const bool same = !memcmp(le, lg, sizeof(float) * (size_t)st.n * V) &&
                          (!n_aux || !memcmp(ae, ag, sizeof(float) * (size_t)st.n * n_aux * H));
        EXPECT(same, "step %d (%d seqs x %d tokens, %s%s): graph %s differ from eager", pi, ns, q,
               fits ? "replayed" : "eager", dev ? ", logits on the device" : "", n_aux ? "logits / aux" : "logits");
        n_same += same;
        n_dev += dev;
        /* the CPU model runs every step too (its KV in step); the eager device path against it (fake only: a
         * GPU's sums differ in order, tests/kernels/test_cuda_backend.c bounds them) */
        if (!ON_GPU && run(&c, &st, st.n, st.oi, lc, 0, NULL, NULL, &err)) {
            EXPECT(0, "cpu step: %s", err.msg);
            goto out;
        }
        EXPECT(ON_GPU || !memcmp(lc, le, sizeof(float) * (size_t)st.n * V), "step %d: eager device == CPU", pi);
        /* advance: decode rows keep their token; verify rows accept a varying count (the rest is overwritten) */
        for (int32_t k = 0; k < st.n_seqs; k++) {
            const int32_t s = (k * 3 + pi) % NS;
            int32_t rows = 0;
            for (int32_t t = 0; t < st.n; t++) rows += st.seq[t] == k;
            len[s] += rows == 1 ? 1 : 1 + (pi + k) % rows;
        }
    }
    model_graph_get_stats(g.m, &gs);
    EXPECT(n_replayed == 15 && n_eager == 1, "15 steps replayed, 1 eager (%d, %d)", n_replayed, n_eager);
    EXPECT(gs.replays == n_replayed && gs.eager == NS + n_eager, "stats: replays %ld, eager %ld", gs.replays, gs.eager);
    EXPECT(gs.short_replays == gs.replays, "every step so far (positions < 128) replayed the short class (%ld of %ld)",
           gs.short_replays, gs.replays);
    { /* a long sequence (positions up to 305: past the short class) prefilled eagerly, then a decode step of it
       * with 3 short ones and a verify step of it: both replay the 512 class, equal to eager bit for bit (a graph
       * of the short class would bake max_len 256 < its positions: meta_upload refuses, the kernels flag it) */
        for (int32_t j = 0; j < NBL; j++) long_table[j] = NS * NB + j;
        int32_t llen = 0;
        const long sr0 = gs.short_replays, r0 = gs.replays;
        for (int chunk = 0; llen < 300 && !n_fail; chunk++) {
            step st = {0};
            st.bt[0] = long_table, st.n_seqs = 1;
            for (int32_t j = 0; j < MAXT && llen + j < 300; j++, st.n++)
                st.pos[st.n] = llen + j, st.seq[st.n] = 0, st.tok[st.n] = (llen + j) * 7 % V, st.oi[st.n] = st.n;
            const int32_t oi[1] = {st.n - 1};
            if (run(&e, &st, 1, oi, le, 0, NULL, NULL, &err) || run(&g, &st, 1, oi, lg, 0, NULL, NULL, &err) ||
                (!ON_GPU && run(&c, &st, 1, oi, lc, 0, NULL, NULL, &err))) {
                EXPECT(0, "long prefill: %s", err.msg);
                goto out;
            }
            llen += st.n;
        }
        for (int k = 0; k < 2; k++) {
            step st = {0};
            const int32_t ql = k == 0 ? 1 : 4;
            st.bt[0] = long_table, st.n_seqs = 1;
            for (int32_t j = 0; j < ql; j++, st.n++)
                st.pos[st.n] = llen + j, st.seq[st.n] = 0, st.tok[st.n] = (llen + j) * 7 % V, st.oi[st.n] = st.n;
            if (k == 0)
                for (int32_t s = 0; s < 3; s++) add_seq(&st, s, 1, V, 99);
            if (run(&g, &st, st.n, st.oi, lg, n_aux, aux_layers, ag, &err) ||
                run(&e, &st, st.n, st.oi, le, n_aux, aux_layers, ae, &err) ||
                (!ON_GPU && run(&c, &st, st.n, st.oi, lc, 0, NULL, NULL, &err))) {
                EXPECT(0, "long step %d: %s", k, err.msg);
                goto out;
            }
            EXPECT(!memcmp(le, lg, sizeof(float) * (size_t)st.n * V) &&
                       (!n_aux || !memcmp(ae, ag, sizeof(float) * (size_t)st.n * n_aux * H)),
                   "long step %d (position %d): the 512-class replay differs from eager", k, llen);
            EXPECT(ON_GPU || !memcmp(lc, le, sizeof(float) * (size_t)st.n * V), "long step %d: eager device == CPU", k);
            if (k == 0)
                for (int32_t s = 0; s < 3; s++) len[s] += 1;
            llen += 1;
        }
        model_graph_get_stats(g.m, &gs);
        EXPECT(gs.replays == r0 + 2 && gs.short_replays == sr0, "the long steps replayed the 512 class (replays +%ld, "
               "short +%ld)", gs.replays - r0, gs.short_replays - sr0);
        n_eager += (300 + MAXT - 1) / MAXT;
    }
    EXPECT(gs.padded_rows > 0, "padding happened (%ld rows)", gs.padded_rows);
    EXPECT(n_dev == n_plan / 2, "%d steps kept their logits on the device", n_dev);
    printf("%s%s: %d/%d steps bit-identical to eager (%d replayed as one graph launch each, %d eager, %ld padding "
           "rows; %d with the logits left on the device); length classes: %ld replays at 256, 2 at 512 (a "
           "305-position sequence), bit-identical\n", path, n_aux ? " (aux)" : "", n_same, n_plan, n_replayed,
           n_eager, gs.padded_rows, n_dev, gs.short_replays);
out:
    free(lc), free(le), free(lg), free(ae), free(ag);
    model_destroy(c.m), model_destroy(e.m), model_destroy(g.m);
    bk_cuda_destroy(e.be), bk_cuda_destroy(g.be);
}

/* ------------------------------------------------------------ benchmark (GPU): graphs on vs off */
#if ON_GPU

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define BS 32   /* largest batch */
#define BLEN 64 /* context of every sequence */

/* ms per decode step of B sequences at context BLEN (iters steps, after 3 warm-up), on model S */
static double bench_decode(side *S, int32_t B, int iters, const int32_t (*tb)[16], float *logits, specd_err *err) {
    int32_t tok[BS], pos[BS], seq[BS], oi[BS];
    const int32_t *bt[BS];
    double t0 = 0;
    for (int it = 0; it < iters + 3; it++) {
        if (it == 3) t0 = now_s();
        for (int32_t s = 0; s < B; s++) {
            tok[s] = (s * 31 + it) % 100 + 1, pos[s] = BLEN + it, seq[s] = s, oi[s] = s;
            bt[s] = tb[s];
        }
        model_batch b = {.n_tokens = B, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = B, .block_tables = bt,
                         .n_out = B, .out_idx = oi, .logits = logits};
        if (model_forward(S->m, &b, err) < 0) return -1;
    }
    return (now_s() - t0) * 1e3 / iters;
}

static int bench(const char *path, const char *json) {
    specd_err err = {{0}};
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)3 << 30, .max_tokens = BLEN, .max_seqs = BS + 1,
                      .max_len = 1024, .block_size = 16, .max_heads = 64, .max_head_dim = 128};
    side e = {bk_cuda_create(&o, &err), NULL}, g = {NULL, NULL};
    if (e.be) g.be = bk_cuda_create(&o, &err);
    if (!e.be || !g.be) { printf("FAIL: bench backends: %s\n", err.msg); return 1; }
    model_load_opts mo = {.block_size = 16, .n_blocks = BS * 16 + 1};
    if (model_load(path, e.be, &mo, &e.m, &err) || model_load(path, g.be, &mo, &g.m, &err)) {
        printf("FAIL: bench: %s\n", err.msg);
        return 1;
    }
    static const int32_t buckets[] = {1, 2, 4, 8, 16, 32}, q1[] = {1};
    model_graph_opts go = {.buckets = buckets, .n_buckets = 6, .q = q1, .n_q = 1, .max_step_tokens = BLEN,
                           .max_seqs = BS + 1, .max_tokens = BLEN};
    const double c0 = now_s();
    if (model_graphs_capture(g.m, &go, &err) < 0) { printf("FAIL: bench capture: %s\n", err.msg); return 1; }
    const double cap_ms = (now_s() - c0) * 1e3;
    static int32_t tb[BS][16];
    const int32_t V = model_get_config(e.m)->vocab;
    float *lg = malloc(sizeof(float) * BLEN * (size_t)V);
    int32_t tok[BLEN], pos[BLEN], seq[BLEN], oi[1] = {BLEN - 1};
    for (int32_t s = 0; s < BS; s++) { /* prefill every sequence to BLEN (eager on both) */
        for (int j = 0; j < 16; j++) tb[s][j] = s * 16 + j;
        const int32_t *bt[1] = {tb[s]};
        for (int32_t t = 0; t < BLEN; t++) tok[t] = (s * 7 + t * 13) % 100 + 1, pos[t] = t, seq[t] = 0;
        model_batch b = {.n_tokens = BLEN, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = bt,
                         .n_out = 1, .out_idx = oi, .logits = lg};
        if (model_forward(e.m, &b, &err) || model_forward(g.m, &b, &err)) { printf("FAIL: %s\n", err.msg); return 1; }
    }
    FILE *f = json ? fopen(json, "a") : NULL;
    int fails = 0;
    for (int i = 0; i < 6; i++) {
        const int32_t B = buckets[i];
        const double me = bench_decode(&e, B, 20, (const int32_t (*)[16])tb, lg, &err);
        const double mg = bench_decode(&g, B, 20, (const int32_t (*)[16])tb, lg, &err);
        if (me < 0 || mg < 0) { printf("FAIL: bench B=%d: %s\n", B, err.msg); fails++; continue; }
        printf("BENCH cuda_graphs %s: batch %2d decode step: eager %.3f ms, graphs %.3f ms (x%.2f)\n", path, B, me, mg,
               me / mg);
        if (f)
            fprintf(f, "{\"bench\": \"cuda_graphs\", \"model\": \"%s\", \"batch\": %d, \"eager_ms\": %.4f, "
                       "\"graph_ms\": %.4f, \"speedup\": %.3f, \"capture_ms_6_graphs\": %.1f}\n",
                    path, B, me, mg, me / mg, cap_ms);
    }
    if (f) fclose(f);
    free(lg);
    model_destroy(e.m), model_destroy(g.m);
    bk_cuda_destroy(e.be), bk_cuda_destroy(g.be);
    return fails ? 1 : 0;
}
#endif

int main(int argc, char **argv) {
#if ON_GPU
    kn_harness_require_gpu();
    if (argc == 3 && !strcmp(argv[1], "--bench")) {
        const char *twin = getenv("SPECD_TWIN_DIR");
        struct stat st;
        if (!twin || stat(twin, &st) != 0) {
            printf("SKIP: no SmolLM2-shaped twin ($SPECD_TWIN_DIR: tools/gen_llama_hf_mini.py DIR --smollm2-shape)\n");
            return 77;
        }
        return bench(twin, argv[2]);
    }
#endif
    (void)argc, (void)argv;
    backend *cpu = bk_cpu_create(0);
    if (!cpu) return 1;
    const char *mini = getenv("MODEL_HF_MINI_DIR"), *gguf = getenv("SPECD_MODEL_GGUF");
    const char *twin = ON_GPU ? getenv("SPECD_TWIN_DIR") : NULL;
    char p[4096];
    test_capture_refusals();
    if (mini) {
        snprintf(p, sizeof p, "%s/f32", mini);
        test_model(p, cpu, false);
        snprintf(p, sizeof p, "%s/bf16", mini);
        test_model(p, cpu, true);
    }
    if (gguf) test_model(gguf, cpu, true);
    if (twin) test_model(twin, cpu, true);
    if (!mini && !gguf) EXPECT(0, "neither MODEL_HF_MINI_DIR nor SPECD_MODEL_GGUF is set");
    EXPECT(fake_violations == 0, "%d violations (host pointers on device ops, copies inside a capture)",
           fake_violations);
    EXPECT(fake_graphs_alive == 0, "%d graphs leaked", fake_graphs_alive);
    bk_cpu_destroy(cpu);
    printf(n_fail ? "FAILED: %d\n" : "OK\n", n_fail);
    return n_fail ? 1 : 0;
}
