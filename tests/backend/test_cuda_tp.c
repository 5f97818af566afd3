/*
 * test_cuda_tp.c (backend_cuda_tp, label unit, no GPU): tensor parallelism
 * with every rank on the CUDA backend, on the FAKE device of cuda_fake.c
 * (device memory = recorded host memory, kernels = the CPU backend's ops),
 * with real rank processes (engine/comm/ranks.h: this binary re-executed as
 * the workers) and the `shm` collectives staged through the host
 * (engine/runtime/tp.h tp_dev_comm_open: download, fixed-order f32 host
 * all-reduce / all-gather, upload), the path `specd serve --device cuda
 * --tensor-parallel-size N --tp-comm shm` runs on every rank.
 *
 * What it checks, per model and N (the tiny HF Llama "f32" at TP 2, "mistral"
 * at TP 2 and 4, SmolLM2-135M Q4_1 at TP 3: 9 heads, 3 KV heads, its LM
 * head split by vocabulary so the logits go through the staged all-gather):
 * a 2-sequence prefill (13 + 9 tokens, blocks shuffled) then 8 batched greedy
 * decode steps, run three ways: CPU TP N (the CPU backend on every rank, the
 * shm group: what model_hf_tp / server_tp test against transformers), fake-
 * device TP N, and CPU TP 1.
 *   - fake-device TP N logits == CPU TP N logits, bit for bit (memcmp), every
 *     step, every output row; hence the same greedy tokens;
 *   - the HF minis' greedy tokens == TP 1's (model_hf_tp asserts TP N greedy
 *     == transformers == TP 1 there); SmolLM2: the TP 1 agreement is reported
 *     (server_tp documents a late near-tie flip at TP 3);
 *   - no host pointer reached a device op on rank 0 (fake_violations) nor on
 *     any worker (a worker with a violation exits 1, which ranks_shutdown
 *     reports);
 *   - SmolLM2 at TP 3 on the fake device with the committed EAGLE-3 head
 *     whole on a CPU backend of rank 0 (the bundle's fallback at --device
 *     cuda --tensor-parallel-size N for a head the GPU cannot run; the split
 *     head is test_cuda_tp_draft.c's: aux features downloaded from
 *     rank 0's device forward, the target's host views): greedy speculative
 *     decoding (k = 1, 3) of 24 tokens of a chat prompt == plain greedy at the
 *     same TP, and every draft == the drafts next to CPU TP 3;
 *   - a worker whose device fails to start (device 1 of a one-device fake)
 *     aborts the group with its reason: rank 0's first step fails naming it
 *     within 5 s, and the group is reaped (no hang).
 * SPECD_TP_TEST_COMM=cuda_ipc (tools/kn_emu/run_tp.sh, ctest
 * backend_cuda_tp_ipc_emu) runs the device ranks' collectives through the
 * real cuda_ipc communicator in the kn_emu emulation instead: the same bits.
 * Not checked here: nccl (its GPU test), real kernels (label gpu).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/backend/cuda_fake/cuda_runtime_api.h"
#include "engine/backend/cuda_backend.h"
#include "engine/comm/ranks.h"
#include "engine/runtime/tp.h"
#include "tests/backend/tp_fake_util.h"
#include "draft/eagle3.h"
#include "engine/loader/gguf.h"
#include "engine/tokenizer/tokenizer.h"

extern int fake_violations;

static int n_fail;
#define EXPECT(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); n_fail++; } } while (0)

enum { BS = 16, NB = 8, NSEQ = 2, L0 = 13, L1 = 9, STEPS = 8 };
static const int32_t tab0[4] = {0, 1, 2, 3}, tab1[4] = {7, 6, 5, 4};
static const int32_t *const tables[NSEQ] = {tab0, tab1};


static size_t arena_for(const char *path) { return strstr(path, ".gguf") ? (size_t)192 << 20 : (size_t)48 << 20; }

/* The fake device backend of one rank: device `dev` (0 exists, 1 does not). */
static backend *fake_dev(const char *path, int dev, specd_err *err) {
    bk_cuda_opts o = {.device = dev, .arena_bytes = arena_for(path), .max_tokens = 64, .max_seqs = 4, .max_len = 256,
                      .block_size = BS, .max_heads = 16, .max_head_dim = 128, .staging_bytes = 1 << 20};
    return bk_cuda_create(&o, err);
}

/* Worker: `test --tp-worker cpu|fake|fakebad PATH --specd-comm-...`. */
static int worker_main(int argc, char **argv) {
    ranks_worker w;
    specd_err err = {{0}};
    comm *c = NULL;
    if (ranks_worker_detect(argc, argv, &w, &err) != 1 || argc < 4 || ranks_worker_attach(&w, &c, &err) < 0) {
        fprintf(stderr, "tp worker: %s\n", err.msg);
        return 1;
    }
    const char *kind = argv[2], *path = argv[3];
    const bool on_dev = strcmp(kind, "cpu") != 0;
    backend *be = on_dev ? fake_dev(path, !strcmp(kind, "fakebad") ? 1 : 0, &err) : bk_cpu_create(1);
    tp_dev_comm *dev = NULL;
    model_comm mc;
    model *m = NULL;
    int rc = 1;
    model_load_opts o = {.block_size = BS, .n_blocks = NB};
    if (!be) {
        char why[COMM_REASON_MAX];
        snprintf(why, sizeof why, "device start failed: %.200s", err.msg);
        comm_abort(c, why);
    } else if (tp_dev_comm_open(c, be, on_dev ? tp_fake_dev_comm() : TP_COMM_AUTO, &dev, &mc, &err) < 0 ||
               (o.tp = &mc, model_load(path, be, &o, &m, &err) < 0)) {
        comm_abort(c, err.msg);
    } else if (tp_worker_run_dev(c, m, dev, NULL, NULL, &err) == 0) {
        rc = 0;
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
} run;

/* N ranks (N = 1: this process alone) of kind "cpu" / "fake" / "fakebad" (workers only; rank 0 fake). */
static int run_open(run *r, const char *path, int N, const char *kind, specd_err *err) {
    memset(r, 0, sizeof *r);
    r->on_dev = strcmp(kind, "cpu") != 0;
    if (N > 1) {
        const char *argv[] = {g_self, "--tp-worker", kind, path, NULL};
        ranks_config rc = {.world = N, .worker_argv = argv, .comm = comm_config_default(), .attach_timeout_ms = 60000};
        if (ranks_launch(&rc, &r->rk, err) < 0) return -1;
    }
    r->be = r->on_dev ? fake_dev(path, 0, err) : bk_cpu_create(1);
    if (!r->be) return -1;
    model_load_opts o = {.block_size = BS, .n_blocks = NB};
    if (r->rk) {
        if (tp_dev_comm_open(ranks_comm(r->rk), r->be, r->on_dev ? tp_fake_dev_comm() : TP_COMM_AUTO, &r->dev, &r->mc, err) < 0)
            return -1;
        o.tp = &r->mc;
    }
    if (model_load(path, r->be, &o, &r->m, err) < 0) return -1;
    r->tr = (tp_runner){r->m, r->rk ? ranks_comm(r->rk) : NULL, r->dev};
    return 0;
}

static int run_close(run *r, specd_err *err) {
    const int rc = tp_fake_group_close(r->rk, r->dev, r->m, r->be, r->on_dev, err);
    memset(r, 0, sizeof *r);
    return rc;
}

static int run_step(run *r, int n, const int32_t *tok, const int32_t *pos, const int32_t *seq, int n_out,
                    const int32_t *out, float *logits, specd_err *err) {
    model_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = NSEQ, .block_tables = tables,
                     .n_out = n_out, .out_idx = out, .logits = logits};
    return r->rk ? tp_runner_forward(&r->tr, &b, err) : model_forward(r->m, &b, err);
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    return b;
}

/* Prefill + STEPS greedy decode steps; logits: [(1 + STEPS) * NSEQ, V], toks: [STEPS + 1][NSEQ]. */
static int run_seq(run *r, int V, float *logits, int32_t *toks, specd_err *err) {
    int32_t tok[L0 + L1], pos[L0 + L1], seq[L0 + L1], out[NSEQ] = {L0 - 1, L0 + L1 - 1};
    for (int i = 0; i < L0 + L1; i++) {
        tok[i] = (int32_t)((i * 7919u + 13u) % (unsigned)(V > 300 ? 300 : V)) + 1;
        pos[i] = i < L0 ? i : i - L0;
        seq[i] = i < L0 ? 0 : 1;
    }
    if (run_step(r, L0 + L1, tok, pos, seq, NSEQ, out, logits, err) < 0) return -1;
    for (int k = 0; k <= STEPS; k++) {
        int32_t t[NSEQ], p[NSEQ], s[NSEQ] = {0, 1}, o[NSEQ] = {0, 1};
        for (int q = 0; q < NSEQ; q++) {
            t[q] = toks[k * NSEQ + q] = argmax(logits + ((size_t)k * NSEQ + q) * V, V);
            p[q] = (q ? L1 : L0) + k;
        }
        if (k == STEPS) break;
        if (run_step(r, NSEQ, t, p, s, NSEQ, o, logits + (size_t)(k + 1) * NSEQ * V, err) < 0) return -1;
    }
    return 0;
}

static void check_model(const char *name, const char *path, int N, bool greedy_tp1) {
    specd_err err = {{0}};
    run r;
    if (run_open(&r, path, 1, "cpu", &err) < 0) {
        EXPECT(0, "%s TP 1: %s", name, err.msg);
        run_close(&r, &err);
        return;
    }
    const int V = model_get_config(r.m)->vocab;
    const size_t nl = (size_t)(1 + STEPS) * NSEQ * V;
    float *l1 = malloc(nl * sizeof *l1), *lc = malloc(nl * sizeof *lc), *lf = malloc(nl * sizeof *lf);
    int32_t t1[(STEPS + 1) * NSEQ], tc[(STEPS + 1) * NSEQ], tf[(STEPS + 1) * NSEQ];
    EXPECT(run_seq(&r, V, l1, t1, &err) == 0, "%s TP 1: %s", name, err.msg);
    run_close(&r, &err);
    if (run_open(&r, path, N, "cpu", &err) < 0 || run_seq(&r, V, lc, tc, &err) < 0)
        EXPECT(0, "%s CPU TP %d: %s", name, N, err.msg);
    EXPECT(run_close(&r, &err) == 0, "%s CPU TP %d shutdown: %s", name, N, err.msg);
    const int viol0 = fake_violations;
    model_shard_info si = {0};
    if (run_open(&r, path, N, "fake", &err) < 0 || run_seq(&r, V, lf, tf, &err) < 0)
        EXPECT(0, "%s fake-device TP %d: %s", name, N, err.msg);
    if (r.m) model_get_shard(r.m, &si);
    EXPECT(run_close(&r, &err) == 0, "%s fake-device TP %d shutdown (a worker failed or saw a host pointer): %s", name,
           N, err.msg);
    EXPECT(fake_violations == viol0, "%s: %d host pointers reached device ops on rank 0", name, fake_violations - viol0);
    EXPECT(si.size == N, "%s: rank 0's shard is of TP %d", name, si.size);
    size_t differ = 0;
    for (size_t i = 0; i < nl; i++) differ += memcmp(&lc[i], &lf[i], sizeof(float)) != 0;
    EXPECT(differ == 0, "%s TP %d: %zu of %zu logits of the fake device differ from CPU TP's bits", name, N, differ, nl);
    EXPECT(!memcmp(tc, tf, sizeof tc), "%s TP %d: greedy tokens differ between the fake device and the CPU", name, N);
    double d1 = 0;
    for (size_t i = 0; i < nl; i++) d1 = fmax(d1, fabs((double)l1[i] - lf[i]));
    const bool same1 = !memcmp(t1, tf, sizeof t1);
    if (greedy_tp1) EXPECT(same1, "%s TP %d: greedy tokens differ from TP 1's", name, N);
    printf("%-8s TP %d on the fake device, %s (%d of %d heads, LM-head rows %d of %d): logits == CPU TP %d bit for bit "
           "(%zu values over %d steps); greedy %s TP 1's; max|diff| vs TP 1 %.3g\n",
           name, N, tp_comm_kind_name(tp_fake_dev_comm()), si.n_heads, si.size ? si.n_heads * N : 0, si.vocab_rows, V, N, nl, 1 + STEPS,
           same1 ? "==" : "!=", d1);
    free(l1), free(lc), free(lf);
}

/* Greedy speculative decoding at TP N with the target on the fake device and the EAGLE-3 head whole on a CPU
 * backend of rank 0 (what the bundle does at --device cuda --tensor-parallel-size N with a draft): the aux
 * features rank 0's device forward downloads, the target's host views (embedding, the whole LM head). GEN
 * tokens of one sequence at k: must equal plain greedy at the same TP token for token. */
enum { GEN = 24 };
static int spec_step(run *r, const int32_t *tok, int n, int32_t pos0, float *lg, const int32_t *layers, float *aux,
                     specd_err *err) {
    int32_t pos[32], seq[32] = {0}, out[32];
    for (int i = 0; i < n; i++) pos[i] = pos0 + i, out[i] = i;
    model_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = NSEQ, .block_tables = tables,
                     .n_out = n, .out_idx = out, .logits = lg, .n_aux = aux ? 3 : 0, .aux_layers = layers, .aux = aux};
    return r->rk ? tp_runner_forward(&r->tr, &b, err) : model_forward(r->m, &b, err);
}

/* props: [n_ks][GEN * 8] every draft proposed (-1 past the end), for the comparison across kinds. */
static void check_spec(const char *gguf, const char *head, int N, const char *kind, const int32_t *ks, int n_ks,
                       int32_t *props) {
    specd_err err = {{0}};
    run r;
    memset(props, 0xff, sizeof(int32_t) * (size_t)n_ks * GEN * 8);
    if (run_open(&r, gguf, N, kind, &err) < 0) {
        EXPECT(0, "spec at TP %d: %s", N, err.msg);
        run_close(&r, &err);
        return;
    }
    const int V = model_get_config(r.m)->vocab, H = model_get_config(r.m)->hidden;
    int32_t prompt[20], plain[GEN], layers[8];
    { /* a chat prompt of 20 tokens (the head was trained on chats: it accepts drafts there) */
        static const char text[] = "<|im_start|>user\nWhat is the capital of France? Answer in one short sentence."
                                   "<|im_end|>\n<|im_start|>assistant\n";
        gguf_file *g = NULL;
        tokenizer *tk = NULL;
        int32_t *ids = NULL;
        size_t n = 0;
        if (gguf_open(gguf, &g, &err) < 0 || tok_create_from_gguf(g, &tk, &err) < 0 ||
            tok_encode(tk, text, sizeof text - 1, true, &ids, &n, &err) < 0 || n < 20) {
            EXPECT(0, "tokenizing the prompt: %s (%zu tokens)", err.msg, n);
            n = 0;
        }
        for (int i = 0; i < 20; i++) prompt[i] = n ? ids[n - 20 + (size_t)i] : 1; /* its last 20 tokens */
        free(ids);
        tok_destroy(tk);
        gguf_close(g);
    }
    float *lg = malloc(sizeof(float) * 32 * (size_t)V), *aux = malloc(sizeof(float) * 32 * 3 * (size_t)H);
    /* plain greedy */
    int ok = spec_step(&r, prompt, 20, 0, lg, NULL, NULL, &err) == 0;
    for (int i = 0; ok && i < GEN; i++) {
        plain[i] = argmax(i ? lg : lg + (size_t)19 * V, V);
        ok = spec_step(&r, &plain[i], 1, 20 + i, lg, NULL, NULL, &err) == 0;
    }
    EXPECT(ok, "plain greedy at TP %d: %s", N, err.msg);
    backend *dcpu = bk_cpu_create(1);
    for (int ki = 0; ok && ki < n_ks; ki++) {
        int32_t k = ks[ki], out[GEN + 8], n_out = 0, n_acc = 0, n_steps = 0;
        spec_proposer *sp = NULL;
        eagle3_opts o = {.n_blocks = 16, .be = dcpu, .max_rows = 32, .max_seqs = 4};
        if (eagle3_load(head, r.m, &o, &sp, &err) < 0) {
            EXPECT(0, "eagle3_load next to the TP %d device target: %s", N, err.msg);
            break;
        }
        sp->ops->aux_layers(sp->ctx, layers);
        ok = spec_step(&r, prompt, 20, 0, lg, layers, aux, &err) == 0;
        int32_t x = argmax(lg + (size_t)19 * V, V), mpos = 20;
        ok = ok && sp->ops->extend(sp->ctx, 1, prompt, 20, 0, aux, &err) == 0 &&
             sp->ops->extend(sp->ctx, 1, &x, 1, 20, NULL, &err) == 0;
        out[n_out++] = x;
        while (ok && n_out < GEN) {
            int64_t id = 1;
            int32_t d[8], batch[9];
            float t0 = 0.0f;
            ok = sp->ops->propose(sp->ctx, &id, &k, 1, k, &t0, d, NULL, &err) == 0;
            batch[0] = x;
            for (int j = 0; j < k; j++) batch[1 + j] = d[j], props[(size_t)ki * GEN * 8 + (size_t)n_steps * k + (size_t)j] = d[j];
            ok = ok && spec_step(&r, batch, k + 1, mpos, lg, layers, aux, &err) == 0;
            if (!ok) break;
            int32_t a = 0;
            while (a < k && argmax(lg + (size_t)a * V, V) == d[a]) a++;
            const int32_t bonus = argmax(lg + (size_t)a * V, V);
            ok = sp->ops->extend(sp->ctx, 1, batch, a + 1, mpos, aux, &err) == 0 &&
                 sp->ops->extend(sp->ctx, 1, &bonus, 1, mpos + a + 1, NULL, &err) == 0;
            for (int j = 0; j < a && n_out < GEN; j++) out[n_out++] = d[j];
            if (n_out < GEN) out[n_out++] = bonus;
            n_acc += a, n_steps++;
            mpos += a + 1;
            x = bonus;
        }
        EXPECT(ok, "speculative greedy at TP %d, k = %d: %s", N, k, err.msg);
        EXPECT(!memcmp(out, plain, sizeof plain), "TP %d k = %d: speculative greedy differs from plain greedy", N, k);
        printf("smollm2  TP %d, target on %s, head on rank 0's CPU, k = %d: %d tokens == plain greedy "
               "(%d verify steps, %d drafts accepted)\n", N, strcmp(kind, "cpu") ? "the fake device" : "the CPU", k, GEN,
               n_steps, n_acc);
        eagle3_destroy(sp);
    }
    bk_cpu_destroy(dcpu);
    free(lg), free(aux);
    EXPECT(run_close(&r, &err) == 0, "spec TP %d shutdown: %s", N, err.msg);
}

/* A worker whose device fails to start: rank 0 fails at its first collective with the reason, no hang. */
static void check_bad_device(const char *path) {
    specd_err err = {{0}};
    run r;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int rc = run_open(&r, path, 2, "fakebad", &err);
    float *lg = NULL;
    int32_t toks[(STEPS + 1) * NSEQ];
    if (rc == 0) {
        const int V = model_get_config(r.m)->vocab;
        lg = malloc(sizeof(float) * (size_t)(1 + STEPS) * NSEQ * (size_t)V);
        rc = lg ? run_seq(&r, V, lg, toks, &err) : -1;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("a worker's device fails to start: rank 0 fails after %.2f s: %s\n", s, err.msg);
    EXPECT(rc < 0, "the group must fail");
    EXPECT(strstr(err.msg, "rank 1: device start failed") && strstr(err.msg, "device 1"),
           "the reason names the rank and its device: %s", err.msg);
    EXPECT(s < 5, "failed after %.2f s (bound 5 s)", s);
    specd_err e2 = {{0}};
    EXPECT(run_close(&r, &e2) != 0, "the failed worker is reported at shutdown");
    free(lg);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--tp-worker")) return worker_main(argc, argv);
    g_self = argv[0];
    const char *mini = getenv("MODEL_HF_MINI_DIR"), *gguf = getenv("SPECD_MODEL_GGUF");
    if (gguf && !*gguf) gguf = NULL; /* run_tp.sh: the minis only */
    char p[4096];
    if (!mini) {
        printf("SKIP: MODEL_HF_MINI_DIR not set\n");
        return 77;
    }
    snprintf(p, sizeof p, "%s/f32", mini);
    check_model("f32", p, 2, true);
    snprintf(p, sizeof p, "%s/mistral", mini);
    check_model("mistral", p, 2, true);
    check_model("mistral", p, 4, true);
    if (gguf) {
        check_model("smollm2", gguf, 3, false);
        const char *src = getenv("SPECD_SOURCE_DIR");
        snprintf(p, sizeof p, "%s/draft/heads/smollm2-135m-eagle3", src ? src : ".");
        const int32_t ks[2] = {1, 3};
        int32_t *pc = malloc(sizeof(int32_t) * 2 * GEN * 8), *pf = malloc(sizeof(int32_t) * 2 * GEN * 8);
        check_spec(gguf, p, 3, "cpu", ks, 2, pc);
        check_spec(gguf, p, 3, "fake", ks, 2, pf);
        EXPECT(!memcmp(pc, pf, sizeof(int32_t) * 2 * GEN * 8),
               "the head's drafts next to the fake-device TP 3 target differ from those next to CPU TP 3 (the aux "
               "features or the host views differ)");
        free(pc), free(pf);
    } else {
        printf("SmolLM2: SPECD_MODEL_GGUF not set, skipped\n");
    }
    snprintf(p, sizeof p, "%s/f32", mini);
    check_bad_device(p);
    printf(n_fail ? "FAILED: %d\n" : "OK\n", n_fail);
    return n_fail ? 1 : 0;
}
