/*
 * test_cuda_tp_graphs.c (backend_cuda_tp_graphs, label unit, no GPU; and
 * under tools/kn_emu/run_tp.sh, ctest backend_cuda_tp_ipc_emu): CUDA graphs
 * of the target's step at TP 2 (engine/model/model_graph.c, "Tensor
 * parallelism"; engine/runtime/tp.c tp_graphs_agree, the step's graph pick).
 *
 * Every rank on the FAKE device of cuda_fake.c (its graphs record the
 * launches and replay them on the memory's contents at launch), real rank
 * processes. With SPECD_TP_TEST_COMM=cuda_ipc (run_tp.sh) the collectives
 * are the REAL cuda_ipc communicator (comm_cuda_ipc.c + kn_allreduce.cu in
 * the kn_emu CPU emulation); the emulation's launches made while the fake
 * captures are recorded as nodes of the fake's graph, in order with its own
 * (cuda_fake.c fake_capture_foreign), so a replay runs the cuda_ipc kernels
 * with the arguments they were captured with, as a GPU graph does. What is
 * checked, on the tiny HF Llama "f32" and "mistral" at TP 2 (a
 * vocabulary-split LM head: its all-gather and device interleave are inside
 * the graph):
 *   - graphs: every rank captures (buckets 1, 2, 4 x length classes), the
 *     ranks agree (tp_graphs_agree == 1, same count);
 *   - a 2-sequence prefill (eager: not every row is an output) then STEPS
 *     batched decode steps: every decode step replays the same graph (bucket
 *     2), so the cuda_ipc kernels of one graph run STEPS times; logits ==
 *     eager fake-device TP 2 == CPU TP 2, bit for bit (memcmp), every step;
 *     replay safety of the collectives is the point: a protocol that baked a
 *     per-call epoch into the graph would see the previous replay's flags and
 *     read stale stages;
 *   - launches per decode step on rank 0: exactly 1 graph launch, 0 kernel
 *     launches of the fake and 0 collective launches from the host (the
 *     collectives run inside the graph); each worker checks at exit that it
 *     launched exactly one graph per replayed step and no collective from the
 *     host outside its eager steps (a failed check: exit 1, reported by
 *     ranks_shutdown);
 *   - a capture failure on rank 1 (injected: the worker reports a failed
 *     capture) turns graphs off on both ranks with rank 1's reason, and the
 *     steps then run eagerly with the same bits (no hang);
 *   - the same on the Kimi miniature "k25" (KIMI_C_MINI_DIR; DeepSeek-V3:
 *     MLA, the MoE's all-reduces, a vocabulary-split head) against the eager
 *     fake-device run (CPU TP keeps the latent in bf16: test_cuda_kimi_tp.c
 *     compares CPU and device);
 *   - with shm (the plain ctest run, host-staged collectives) the capture is
 *     refused on every rank naming shm, the group agrees on off, eager bits;
 *   - (both runs) the pick / force mechanism on one model: a forced -1 runs a
 *     fitting step eagerly with the replay's bits; a step without logits (a
 *     worker whose LM head is not split) fits nothing by itself but replays
 *     rank 0's forced pick; a forced graph that does not fit, or that was not
 *     captured, fails with the reason.
 * Not checked here: nccl graphs (their GPU check), real kernels (label gpu:
 * gpu_check's server_tp graphs step).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/backend/cuda_fake/cuda_runtime_api.h"
#include "engine/backend/cuda_backend.h"
#include "engine/comm/ranks.h"
#include "engine/model/hf_config.h"
#include "engine/runtime/tp.h"
#include "tests/backend/tp_fake_util.h"

extern int fake_violations;
extern long fake_host_launches, fake_graph_launches;
long fake_foreign_host_launches(void);

static int n_fail;
#define EXPECT(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); n_fail++; } } while (0)

enum { BS = 16, NB = 9 /* 8 + the graphs' padding block */, NSEQ = 2, L0 = 13, L1 = 9, STEPS = 8 };
static const int32_t tab0[4] = {0, 1, 2, 3}, tab1[4] = {7, 6, 5, 4};
static const int32_t *const tables[NSEQ] = {tab0, tab1};
static const int32_t buckets[3] = {1, 2, 4}, q1[1] = {1};

/* The fake device of one rank of TP 2 (path: the model; DeepSeek-V3 / Kimi: its latent and MoE bounds, as
 * server/bundle.c plans them). */
static backend *fake_dev(const char *path, specd_err *err) {
    hf_config hc;
    memset(&hc, 0, sizeof hc);
    const bool mla = hf_config_load(path, &hc, err) == 0 && hc.kv_lora_rank > 0;
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)(mla ? 384 : 64) << 20, .max_tokens = 64, .max_seqs = 6,
                      .max_len = 256, .block_size = BS, .max_heads = 16, .max_head_dim = 128, .staging_bytes = 1 << 20};
    if (mla) {
        o.max_heads = hc.n_heads, o.max_head_dim = hc.kv_lora_rank + hc.qk_rope;
        o.mla_kv_lora_rank = hc.kv_lora_rank, o.moe_experts = hc.n_routed_experts;
        o.moe_top_k = hc.n_experts_per_tok, o.moe_hidden = hc.hidden, o.moe_inter = hc.moe_intermediate / 2;
    }
    return bk_cuda_create(&o, err);
}

/* Every rank: the same options, so the same graphs in the same order. */
static int capture(model *m, specd_err *err) {
    model_graph_opts go = {.buckets = buckets, .n_buckets = 3, .q = q1, .n_q = 1, .max_step_tokens = 64,
                           .max_seqs = 6, .max_tokens = 64, .max_len = 256};
    return model_graphs_capture(m, &go, err);
}

/* Capture (or the injected failure), then the group's agreement; returns 1 on, 0 off, -1 group failure. */
static int graphs_up(comm *c, model *m, bool inject_fail, char *why, size_t cap, specd_err *err) {
    specd_err ce = {{0}};
    int ok = 0;
    if (inject_fail) snprintf(ce.msg, sizeof ce.msg, "injected capture failure");
    else ok = capture(m, &ce) == 0;
    return tp_graphs_agree(c, m, ok, ce.msg, why, cap, err);
}

/* Worker: `test --tp-worker cpu|fake|fakegraphs|fakegraphsbad PATH --specd-comm-...`. */
static int worker_main(int argc, char **argv) {
    ranks_worker w;
    specd_err err = {{0}};
    comm *c = NULL;
    if (ranks_worker_detect(argc, argv, &w, &err) != 1 || argc < 4 || ranks_worker_attach(&w, &c, &err) < 0) {
        fprintf(stderr, "tp worker: %s\n", err.msg);
        return 1;
    }
    const char *kind = argv[2], *path = argv[3];
    const bool on_dev = strcmp(kind, "cpu") != 0, graphs = strstr(kind, "graphs") != NULL;
    backend *be = on_dev ? fake_dev(path, &err) : bk_cpu_create(1);
    tp_dev_comm *dev = NULL;
    model_comm mc;
    model *m = NULL;
    int rc = 1;
    model_load_opts o = {.block_size = BS, .n_blocks = NB};
    char why[256];
    if (!be || tp_dev_comm_open(c, be, on_dev ? tp_fake_dev_comm() : TP_COMM_AUTO, &dev, &mc, &err) < 0 ||
        (o.tp = &mc, model_load(path, be, &o, &m, &err) < 0)) {
        comm_abort(c, err.msg);
    } else if (graphs && graphs_up(c, m, strstr(kind, "bad") != NULL, why, sizeof why, &err) < 0) {
        comm_abort(c, err.msg);
    } else {
        const long g0 = fake_graph_launches;
        if (tp_worker_run_dev(c, m, dev, NULL, NULL, &err) == 0) rc = 0;
        model_graph_stats st;
        model_graph_get_stats(m, &st);
        if (rc == 0 && fake_graph_launches - g0 != st.replays) {
            fprintf(stderr, "tp worker rank %d: %ld graph launches for %ld replayed steps\n", w.rank,
                    fake_graph_launches - g0, st.replays);
            rc = 1;
        }
    }
    rc = tp_fake_worker_verdict(rc, err.msg, w.rank, on_dev, fake_violations);
    model_destroy(m);
    tp_dev_comm_close(dev);
    if (be) on_dev ? bk_cuda_destroy(be) : bk_cpu_destroy(be);
    comm_destroy(c);
    return rc;
}

static const char *g_self;

typedef struct run {
    ranks *rk;
    backend *be;
    bool on_dev;
    tp_dev_comm *dev;
    model_comm mc;
    model *m;
    tp_runner tr;
    int graphs;       /* tp_graphs_agree's answer */
    char why[256];    /* its reason when off */
    long step_graph_launches, step_host_launches, step_foreign; /* of the decode steps, rank 0 */
} run;

static int run_open(run *r, const char *path, int N, const char *kind, specd_err *err) {
    memset(r, 0, sizeof *r);
    r->on_dev = strcmp(kind, "cpu") != 0;
    const char *argv[] = {g_self, "--tp-worker", kind, path, NULL};
    ranks_config rc = {.world = N, .worker_argv = argv, .comm = comm_config_default(), .attach_timeout_ms = 60000};
    if (ranks_launch(&rc, &r->rk, err) < 0) return -1;
    r->be = r->on_dev ? fake_dev(path, err) : bk_cpu_create(1);
    if (!r->be) return -1;
    model_load_opts o = {.block_size = BS, .n_blocks = NB};
    if (tp_dev_comm_open(ranks_comm(r->rk), r->be, r->on_dev ? tp_fake_dev_comm() : TP_COMM_AUTO, &r->dev, &r->mc,
                         err) < 0)
        return -1;
    o.tp = &r->mc;
    if (model_load(path, r->be, &o, &r->m, err) < 0) return -1;
    r->tr = (tp_runner){r->m, ranks_comm(r->rk), r->dev};
    if (strstr(kind, "graphs")) {
        r->graphs = graphs_up(ranks_comm(r->rk), r->m, false, r->why, sizeof r->why, err);
        if (r->graphs < 0) return -1;
    }
    return 0;
}

static int run_close(run *r, specd_err *err) {
    const int rc = tp_fake_group_close(r->rk, r->dev, r->m, r->be, r->on_dev, err);
    memset(r, 0, sizeof *r);
    return rc;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    return b;
}

/* Prefill + STEPS greedy decode steps; logits: [(1 + STEPS) * NSEQ, V]. */
static int run_seq(run *r, int V, float *logits, specd_err *err) {
    int32_t tok[L0 + L1], pos[L0 + L1], seq[L0 + L1], out[NSEQ] = {L0 - 1, L0 + L1 - 1};
    for (int i = 0; i < L0 + L1; i++) {
        tok[i] = (int32_t)((i * 7919u + 13u) % (unsigned)(V > 300 ? 300 : V)) + 1;
        pos[i] = i < L0 ? i : i - L0;
        seq[i] = i < L0 ? 0 : 1;
    }
    model_batch b = {.n_tokens = L0 + L1, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = NSEQ,
                     .block_tables = tables, .n_out = NSEQ, .out_idx = out, .logits = logits};
    if (tp_runner_forward(&r->tr, &b, err) < 0) return -1;
    for (int k = 0; k < STEPS; k++) {
        int32_t t[NSEQ], p[NSEQ], s[NSEQ] = {0, 1}, o[NSEQ] = {0, 1};
        for (int q = 0; q < NSEQ; q++) {
            t[q] = argmax(logits + ((size_t)k * NSEQ + q) * V, V);
            p[q] = (q ? L1 : L0) + k;
        }
        model_batch d = {.n_tokens = NSEQ, .tokens = t, .pos = p, .seq_of = s, .n_seqs = NSEQ, .block_tables = tables,
                         .n_out = NSEQ, .out_idx = o, .logits = logits + (size_t)(k + 1) * NSEQ * V};
        const long g0 = fake_graph_launches, h0 = fake_host_launches, f0 = fake_foreign_host_launches();
        if (tp_runner_forward(&r->tr, &d, err) < 0) return -1;
        r->step_graph_launches += fake_graph_launches - g0;
        r->step_host_launches += fake_host_launches - h0;
        r->step_foreign += fake_foreign_host_launches() - f0;
    }
    return 0;
}

static void check_model(const char *name, const char *path, bool vs_cpu) {
    const bool ipc = tp_fake_dev_comm() == TP_COMM_CUDA_IPC;
    specd_err err = {{0}};
    run r;
    size_t nl = 0;
    float *ref = NULL, *eag = NULL, *gra = NULL, *bad = NULL;
    const char *kinds[4] = {"cpu", "fake", "fakegraphs", "fakegraphsbad"};
    float **outs[4] = {&ref, &eag, &gra, &bad};
    run got[4];
    for (int k = 0; k < 4; k++) {
        if (run_open(&r, path, 2, kinds[k], &err) == 0) {
            const int V = model_get_config(r.m)->vocab;
            nl = (size_t)(1 + STEPS) * NSEQ * V;
            *outs[k] = calloc(nl, sizeof(float));
            EXPECT(run_seq(&r, V, *outs[k], &err) == 0, "%s %s TP 2: %s", name, kinds[k], err.msg);
        } else {
            EXPECT(0, "%s %s TP 2 start: %s", name, kinds[k], err.msg);
        }
        model_graph_stats st = {0};
        if (r.m) model_graph_get_stats(r.m, &st);
        got[k] = r;
        got[k].step_graph_launches = st.replays; /* reuse: rank 0's replays */
        got[k].step_host_launches = r.step_host_launches;
        got[k].step_foreign = r.step_foreign;
        const long gl = r.step_graph_launches;
        EXPECT(run_close(&r, &err) == 0, "%s %s TP 2 shutdown (a worker failed its checks): %s", name, kinds[k],
               err.msg);
        if (k == 2) {
            if (ipc) {
                EXPECT(got[2].graphs == 1, "%s: graphs agreed on (%d: %s)", name, got[2].graphs, got[2].why);
                EXPECT(st.replays == STEPS, "%s: %ld of %d decode steps replayed a graph", name, st.replays, STEPS);
                EXPECT(gl == STEPS, "%s: %ld graph launches over %d decode steps (1 per step)", name, gl, STEPS);
                EXPECT(got[2].step_host_launches == 0 && got[2].step_foreign == 0,
                       "%s: decode steps launched %ld kernels and %ld collectives from the host (0: all in the graph)",
                       name, got[2].step_host_launches, got[2].step_foreign);
                printf("%-8s TP 2 cuda_ipc graphs: %d decode steps, %ld graph launches, %ld host kernel / %ld host "
                       "collective launches\n", name, STEPS, gl, got[2].step_host_launches, got[2].step_foreign);
            } else {
                EXPECT(got[2].graphs == 0 && strstr(got[2].why, "rank 0") && strstr(got[2].why, "shm"),
                       "%s: with shm the group agrees graphs off naming shm (%d: %s)", name, got[2].graphs, got[2].why);
                EXPECT(st.replays == 0, "%s: %ld replays with graphs off", name, st.replays);
                printf("%-8s TP 2 shm: graphs off on every rank: %s\n", name, got[2].why);
            }
        }
    }
    /* the injected failure: rank 1's reason, graphs off on rank 0 too (its own capture succeeded) */
    if (ipc) {
        EXPECT(got[3].graphs == 0 && strstr(got[3].why, "rank 1") && strstr(got[3].why, "injected"),
               "%s: rank 1's failed capture turns graphs off everywhere with its reason (%d: %s)", name, got[3].graphs,
               got[3].why);
        EXPECT(got[3].step_graph_launches == 0, "%s: %ld replays after the group turned graphs off", name,
               got[3].step_graph_launches);
        printf("%-8s TP 2: a failed capture on rank 1 -> graphs off on both ranks: %s\n", name, got[3].why);
    }
    /* the reference: CPU TP 2 for the Llama minis; for the Kimi miniature the eager fake-device run (CPU TP keeps
     * the latent in bf16, the device in f32: test_cuda_kimi_tp.c compares those two) */
    const float *base = vs_cpu ? ref : eag;
    for (int k = vs_cpu ? 1 : 2; k < 4 && base; k++) {
        if (!*outs[k]) continue;
        size_t differ = 0;
        for (size_t i = 0; i < nl; i++) differ += memcmp(&base[i], &(*outs[k])[i], sizeof(float)) != 0;
        EXPECT(differ == 0, "%s %s TP 2: %zu of %zu logits differ from %s TP 2's bits", name, kinds[k], differ, nl,
               vs_cpu ? "CPU" : "the eager fake device's");
    }
    printf("%-8s TP 2 %s: %s logits == %s TP 2 bit for bit (%zu values, %d steps)\n", name,
           tp_comm_kind_name(tp_fake_dev_comm()), vs_cpu ? "eager, graphs and graphs-off" : "graphs and graphs-off",
           vs_cpu ? "CPU" : "eager fake-device", nl, 1 + STEPS);
    free(ref), free(eag), free(gra), free(bad);
}

/* The pick / force mechanism on one fake-device model (TP 1: what a worker does with rank 0's pick). A step that
 * fits graph i: forcing -1 runs it eagerly (same bits); a step WITHOUT logits (a worker of a head that is not split
 * by vocabulary) fits no graph by itself, forcing rank 0's pick replays it; a forced graph the step does not fit or
 * one not captured fails with the reason. */
static void check_force(const char *path) {
    specd_err err = {{0}};
    backend *be = fake_dev(path, &err);
    model *m = NULL;
    model_load_opts o = {.block_size = BS, .n_blocks = NB};
    if (!be || model_load(path, be, &o, &m, &err) < 0 || capture(m, &err) < 0) {
        EXPECT(0, "force: setup: %s", err.msg);
        model_destroy(m);
        if (be) bk_cuda_destroy(be);
        return;
    }
    const int V = model_get_config(m)->vocab;
    float *l0 = calloc((size_t)(L0 + L1) * V, sizeof(float)), *l1 = calloc((size_t)NSEQ * V, sizeof(float)),
          *l2 = calloc((size_t)NSEQ * V, sizeof(float));
    int32_t tok[L0 + L1], pos[L0 + L1], seq[L0 + L1], out[NSEQ] = {L0 - 1, L0 + L1 - 1};
    for (int i = 0; i < L0 + L1; i++) tok[i] = i % 300 + 1, pos[i] = i < L0 ? i : i - L0, seq[i] = i >= L0;
    model_batch pre = {.n_tokens = L0 + L1, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = NSEQ,
                       .block_tables = tables, .n_out = NSEQ, .out_idx = out, .logits = l0};
    EXPECT(model_forward(m, &pre, &err) == 0, "force: prefill: %s", err.msg);
    int32_t t[NSEQ] = {5, 7}, p[NSEQ] = {L0, L1}, s[NSEQ] = {0, 1}, oi[NSEQ] = {0, 1};
    model_batch d = {.n_tokens = NSEQ, .tokens = t, .pos = p, .seq_of = s, .n_seqs = NSEQ, .block_tables = tables,
                     .n_out = NSEQ, .out_idx = oi, .logits = l1};
    const int32_t pick = model_graph_pick(m, &d);
    model_graph_stats a, b2;
    model_graph_get_stats(m, &a);
    EXPECT(pick >= 0, "force: a 2-sequence decode step fits a graph (pick %d)", pick);
    model_graph_force(m, -1); /* rank 0 said eager */
    EXPECT(model_forward(m, &d, &err) == 0, "force: eager step: %s", err.msg);
    model_graph_get_stats(m, &b2);
    EXPECT(b2.eager == a.eager + 1 && b2.replays == a.replays, "force -1: eager %ld -> %ld, replays %ld -> %ld",
           a.eager, b2.eager, a.replays, b2.replays);
    d.logits = l2; /* the same step again (its KV rewritten with the same values): replayed, the same bits */
    EXPECT(model_forward(m, &d, &err) == 0, "force: replayed step: %s", err.msg);
    model_graph_get_stats(m, &a);
    EXPECT(a.replays == b2.replays + 1, "unforced fitting step: %ld replays (want %ld)", a.replays, b2.replays + 1);
    EXPECT(!memcmp(l1, l2, sizeof(float) * (size_t)NSEQ * V), "force -1 (eager) and the replay differ");
    d.logits = NULL; /* a worker without logits */
    EXPECT(model_graph_pick(m, &d) < 0, "a step without logits fits no graph by itself");
    model_graph_force(m, pick);
    EXPECT(model_forward(m, &d, &err) == 0, "force: a step without logits, rank 0's pick: %s", err.msg);
    model_graph_get_stats(m, &b2);
    EXPECT(b2.replays == a.replays + 1, "forced pick %d without logits: replays %ld -> %ld", pick, a.replays, b2.replays);
    d.logits = l2;
    model_graph_force(m, 0); /* bucket 1: a 2-sequence step does not fit */
    EXPECT(model_forward(m, &d, &err) < 0 && strstr(err.msg, "does not fit"), "forced bucket 1: %s", err.msg);
    model_graph_force(m, 1000);
    EXPECT(model_forward(m, &d, &err) < 0 && strstr(err.msg, "captured"), "forced graph 1000: %s", err.msg);
    printf("pick / force on the fake device: pick %d; force -1 -> eager (== the replay bitwise); a step without logits "
           "replays rank 0's pick; a pick that does not fit / was not captured fails with the reason\n", pick);
    free(l0), free(l1), free(l2);
    model_destroy(m);
    bk_cuda_destroy(be);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--tp-worker")) return worker_main(argc, argv);
    g_self = argv[0];
    const char *mini = getenv("MODEL_HF_MINI_DIR");
    if (!mini) {
        printf("SKIP: MODEL_HF_MINI_DIR not set\n");
        return 77;
    }
    char p[4096];
    snprintf(p, sizeof p, "%s/f32", mini);
    check_force(p);
    check_model("f32", p, true);
    snprintf(p, sizeof p, "%s/mistral", mini);
    check_model("mistral", p, true);
    const char *kimi = getenv("KIMI_C_MINI_DIR"); /* optional: the Kimi miniature (MLA, MoE all-reduces) */
    if (kimi && *kimi) {
        snprintf(p, sizeof p, "%s/k25", kimi);
        check_model("k25", p, false);
    } else {
        printf("k25: KIMI_C_MINI_DIR not set, skipped\n");
    }
    printf(n_fail ? "FAILED: %d\n" : "OK\n", n_fail);
    return n_fail ? 1 : 0;
}
