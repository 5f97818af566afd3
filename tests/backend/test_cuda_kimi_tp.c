/*
 * test_cuda_kimi_tp.c (backend_cuda_kimi_tp, label unit, no GPU): DeepSeek-V3
 * / Kimi-K2.5 tensor parallelism with every rank on the CUDA backend, on the
 * FAKE device of cuda_fake.c (device memory = recorded host memory, kernels =
 * the CPU backend's ops, kn_mla / kn_moe included), real rank processes
 * (engine/comm/ranks.h: this binary re-executed as the workers) and the shm
 * collectives staged through the host (tp.h tp_dev_comm_open), i.e. what
 * `specd serve --device cuda --tensor-parallel-size N` runs on every rank:
 * each rank's shard of the MLA heads (q_b, the absorbed W_UK / W_UV blocks of
 * kv_b, o_proj's inputs), of the dense MLP and shared expert (gate/up rows,
 * down columns) and of every int4 routed expert (inside the expert, repacked
 * by moe_place at width I / N), the latent replicated, the routing replicated
 * (every rank routes every token), all-reduces after o_proj and after the
 * MLP / MoE combine, the LM head split by vocabulary (logits all-gathered).
 *
 * Models (KIMI_C_MINI_DIR, the kimi_c_mini fixture): the seed-0 miniature
 * "k25" (4 heads, 16 experts of width 64, 1 shared) at TP 2, and its 8-head
 * "wide8" variant (experts of width 256, the CPU TP tests' model) at TP 2,
 * 4 and 8 (one head per rank, expert slices of one int4 group). Each backend gets the per-rank bounds the server plans
 * (server/bundle.c): heads / N, expert width / N in the MoE workspace.
 *
 * Per model and N, the run of tests/backend/kimi_steps.h (3 sequences
 * prefilled in one step, batched decodes, a verify step with a tree mask,
 * more decodes; logits, final hidden state and the EAGLE-3 aux capture of
 * every row), greedy, three ways: CPU TP N (the CPU backend on every rank,
 * the latent cache in bf16 as on a device), fake-device TP N, CPU TP 1:
 *   - fake-device TP N == CPU TP N bit for bit (every logit, hidden and aux
 *     value of every row of every step; hence the same greedy tokens);
 *   - greedy tokens == TP 1's; logits within 2e-3 of each row's max|logit|
 *     of TP 1's (kimi_c_logits_bf16's bound; the row-parallel sums are
 *     reassociated, and the bf16 latent may round the other way);
 *   - no host pointer reached a device op on rank 0 (fake_violations) nor
 *     on a worker (a worker with one exits 1, which ranks_shutdown reports).
 * k25 at TP 4 is refused at load with the reason (16 expert columns per rank
 * would cut the int4 experts' 32-value groups), as on the CPU.
 * Speculative decoding (k25, TP 2, target on the fake device): the
 * miniature's EAGLE-3 head (OUT/kimi_head; the random OUT/head without
 * ../shared/data) whole on a CPU backend of rank 0, as the bundle runs a
 * draft at --device cuda --tensor-parallel-size N today, through the engine
 * (k = 3; greedy verified on the device: the engine samples the gathered
 * logits there, as the bundle's forward_logits_dev), batch 1 and 8
 * concurrent, then an oracle proposer (each
 * request's continuation, every third draft corrupted: verify steps that
 * accept, reject and correct), 8 concurrent: greedy == plain greedy of the
 * same group, token for token, every KV block back in the pool.
 * SPECD_TP_TEST_COMM=cuda_ipc (tools/kn_emu/run_tp.sh BUILD kimi, ctest
 * backend_cuda_kimi_tp_ipc_emu) runs the device ranks' collectives through
 * the real cuda_ipc communicator in the kn_emu emulation instead: the same
 * bits (wide8 at TP 2 only there, KIMI_TP_QUICK=1), and with
 * KIMI_TP_GPU_LOGIC=1 the GPU build's checks below as well.
 * Built a second time without the fake (ctest cuda_kimi_tp, label gpu;
 * exits 77 without a GPU): every rank a process on the one real GPU, k25 at
 * TP 2 and wide8 at TP 4, each device run fed CPU TP N's tokens: logits
 * within TOL = 2e-3 of each row's max|logit| of CPU TP N (cuda_kimi's bound
 * of the device against the CPU), top-1 identical where CPU TP's margin
 * exceeds that, final hidden and aux within 1e-3 of the row's max; the run
 * with `--tp-comm cuda_ipc` == the run with shm staging == a rerun, bit for
 * bit; CPU TP N's greedy == TP 1's; the refusal; speculative greedy == plain
 * greedy on the GPU group (device sampling), batch 1 and 8, the oracle.
 * Expert parallelism (model_load_opts.expert_parallel; kinds "cpu+ep" / "dev+ep"): k25 at EP 2 and 4 (4
 * works: the experts are not cut) and wide8 at EP 4 and 8, every rank holding E / N whole experts (moe_place
 * of its [e0, e0 + E/N), bk_moe_experts.e0; the MoE workspace planned for E / N experts of full width):
 * fake-device EP N == CPU EP N bit for bit, CPU EP N greedy == TP 1's, logits within 2e-3 of TP 1's; the
 * speculative runs at EP 2 (head, batch 1 and 8; oracle) == plain greedy. On the GPU: wide8 at EP 4 and
 * the speculative runs at EP 2; under run_tp.sh kimi (KIMI_TP_QUICK): wide8 at EP 2 through cuda_ipc.
 * Not checked here: nccl; `specd serve` at TP on the GPU (kimi_c_tp_cuda_gpu).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "draft/eagle3.h"
#include "engine/backend/cuda_backend.h"
#include "engine/comm/ranks.h"
#include "engine/model/hf_config.h"
#include "engine/runtime/engine_ex.h"
#include "engine/runtime/proposer.h"
#include "engine/runtime/tp.h"
#include "tests/backend/kimi_steps.h"
#include "tests/backend/tp_fake_util.h"

#ifdef bk_cuda_create /* cuda_fake's header (-include) renamed the backend: the fake device */
#define ON_FAKE 1
extern int fake_violations, fake_kn_sample_calls;
#else
#define ON_FAKE 0
static int fake_violations, fake_kn_sample_calls; /* stay 0 on a GPU */
#endif
#define DEV_NAME (ON_FAKE ? "the fake device" : "the GPU")

static int n_fail;
#define EXPECT(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); n_fail++; } } while (0)

#define NBLK 96 /* KV blocks of every rank (the same pool on every rank) */
#define TOL 2e-3       /* GPU: of each row's max|logit| against CPU TP (cuda_kimi's bound against the CPU) */
#define TOL_STATE 1e-3 /* GPU: of each row's max|x|, final hidden and aux */

/* The device ranks' collectives: --tp-comm's name, passed to the workers. */
static const char *dev_comm_name(void) { return ON_FAKE ? tp_comm_kind_name(tp_fake_dev_comm()) : "cuda_ipc"; }

/* A rank's kind: "cpu" or "dev" (the fake device / the GPU), "+ep" appended for expert parallelism. */
static bool kind_dev(const char *kind) { return strncmp(kind, "cpu", 3) != 0; }
static bool kind_ep(const char *kind) { return strstr(kind, "+ep") != NULL; }

/* The (fake) device of one rank of N with the bounds server/bundle.c plans for it: this rank's heads, the
 * latent, the MoE of its expert slices (width I / N), or with expert parallelism (ep) of its E / N whole
 * experts. */
static backend *dev_backend(const char *path, int N, bool ep, specd_err *err) {
    hf_config hc;
    if (hf_config_load(path, &hc, err) < 0) return NULL;
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)(N >= 4 ? 192 : 384) << 20, .max_tokens = 64, .max_seqs = 9, .max_len = 256,
                      .block_size = KS_BS, .max_heads = hc.n_heads / N, .max_head_dim = hc.kv_lora_rank + hc.qk_rope,
                      .staging_bytes = 1 << 20, .mla_kv_lora_rank = hc.kv_lora_rank,
                      .moe_experts = ep ? hc.n_routed_experts / N : hc.n_routed_experts,
                      .moe_top_k = hc.n_experts_per_tok, .moe_hidden = hc.hidden,
                      .moe_inter = ep ? hc.moe_intermediate : hc.moe_intermediate / N};
    return bk_cuda_create(&o, err);
}

static void be_destroy(backend *be, bool on_dev) {
    if (be) on_dev ? bk_cuda_destroy(be) : bk_cpu_destroy(be);
}

/* Worker: `test --tp-worker cpu|dev[+ep] PATH COMM --specd-comm-...`. */
static int worker_main(int argc, char **argv) {
    ranks_worker w;
    specd_err err = {{0}};
    comm *c = NULL;
    if (ranks_worker_detect(argc, argv, &w, &err) != 1 || argc < 5 || ranks_worker_attach(&w, &c, &err) < 0) {
        fprintf(stderr, "tp worker: %s\n", err.msg);
        return 1;
    }
    const char *kind = argv[2], *path = argv[3];
    const bool on_dev = kind_dev(kind), ep = kind_ep(kind);
    tp_comm_kind ck = TP_COMM_AUTO;
    backend *be = tp_comm_kind_parse(argv[4], &ck, &err) < 0 ? NULL : on_dev ? dev_backend(path, w.world, ep, &err)
                                                                            : bk_cpu_create(1);
    tp_dev_comm *dev = NULL;
    model_comm mc;
    model *m = NULL;
    int rc = 1;
    model_load_opts o = {.block_size = KS_BS, .n_blocks = NBLK, .latent_bf16 = true, .expert_parallel = ep};
    if (!be) {
        char why[COMM_REASON_MAX];
        snprintf(why, sizeof why, "device start failed: %.200s", err.msg);
        comm_abort(c, why);
    } else if (tp_dev_comm_open(c, be, on_dev ? ck : TP_COMM_AUTO, &dev, &mc, &err) < 0 ||
               (o.tp = &mc, model_load(path, be, &o, &m, &err) < 0)) {
        comm_abort(c, err.msg);
    } else if (tp_worker_run_dev(c, m, dev, NULL, NULL, &err) == 0) {
        rc = 0;
    }
    rc = tp_fake_worker_verdict(rc, err.msg, w.rank, on_dev, fake_violations);
    model_destroy(m);
    tp_dev_comm_close(dev);
    be_destroy(be, on_dev);
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

/* N ranks (N = 1: this process alone) of kind "cpu" / "dev" (the device ranks' collectives: a --tp-comm
 * name, cname); the latent cache in bf16 everywhere. */
static int run_open(run *r, const char *path, int N, const char *kind, const char *cname, specd_err *err) {
    memset(r, 0, sizeof *r);
    r->on_dev = kind_dev(kind);
    const bool ep = kind_ep(kind);
    tp_comm_kind ck = TP_COMM_AUTO;
    if (tp_comm_kind_parse(cname, &ck, err) < 0) return -1;
    if (N > 1) {
        const char *argv[] = {g_self, "--tp-worker", kind, path, cname, NULL};
        ranks_config rc = {.world = N, .worker_argv = argv, .comm = comm_config_default(), .attach_timeout_ms = 60000};
        if (ranks_launch(&rc, &r->rk, err) < 0) return -1;
    }
    r->be = r->on_dev ? dev_backend(path, N, ep, err) : bk_cpu_create(1);
    if (!r->be) return -1;
    model_load_opts o = {.block_size = KS_BS, .n_blocks = NBLK, .latent_bf16 = true, .expert_parallel = ep};
    if (r->rk) {
        if (tp_dev_comm_open(ranks_comm(r->rk), r->be, r->on_dev ? ck : TP_COMM_AUTO, &r->dev, &r->mc, err) < 0)
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

static int run_fwd(void *ctx, const model_batch *b, specd_err *err) {
    run *r = ctx;
    return r->rk ? tp_runner_forward(&r->tr, b, err) : model_forward(r->m, b, err);
}

/* The kimi_steps run on N ranks of kind (forced: that run's tokens fed, NULL: greedy); 0, or -1 with the reason
 * printed. */
static int steps_on(const char *name, const char *path, int N, const char *kind, const char *cname,
                    const ks_run *forced, ks_run *out, model_shard_info *si) {
    specd_err err = {{0}};
    run r;
    int rc = run_open(&r, path, N, kind, cname, &err);
    if (rc < 0) printf("%s %s TP %d: %s\n", name, kind, N, err.msg);
    if (rc == 0 && si) model_get_shard(r.m, si);
    if (rc == 0 && (rc = ks_do_fwd(r.m, run_fwd, &r, forced, out, NULL, true)) < 0)
        printf("%s %s TP %d: the steps failed\n", name, kind, N);
    if (run_close(&r, &err) < 0) {
        printf("%s %s TP %d shutdown (a worker failed or saw a host pointer): %s\n", name, kind, N, err.msg);
        rc = -1;
    }
    return rc;
}

/* Values of a and b (floats) whose bits differ, over every step's logits, hidden and aux. */
static size_t bits_differ(const ks_run *a, const ks_run *b) {
    size_t d = 0;
    for (int st = 0; st < KS_NSTEP; st++) {
        const size_t T = (size_t)a->T[st];
        const struct { const float *x, *y; size_t n; } p[] = {{a->logits[st], b->logits[st], T * (size_t)a->V},
                                                            {a->hidden[st], b->hidden[st], T * (size_t)a->H},
                                                            {a->aux[st], b->aux[st], T * KS_NAUX * (size_t)a->H}};
        for (size_t k = 0; k < 3; k++)
            for (size_t i = 0; i < p[k].n; i++) d += memcmp(&p[k].x[i], &p[k].y[i], sizeof(float)) != 0;
    }
    return d;
}

/* GPU: the device run rf (fed CPU TP's tokens) against CPU TP's rc, row by row, within TOL / TOL_STATE, top-1
 * identical where the CPU's margin exceeds TOL. Returns the worst logit error (of max|logit|). */
static double gpu_vs_cpu(const char *name, int N, const ks_run *rc, const ks_run *rf) {
    double worst = 0;
    for (int st = 0; st < KS_NSTEP; st++)
        for (int t = 0; t < rc->T[st]; t++) {
            const float *a = rc->logits[st] + (size_t)t * rc->V, *b = rf->logits[st] + (size_t)t * rc->V;
            double mx = 0, e = 0;
            int nan = 0;
            for (int i = 0; i < rc->V; i++) mx = fmax(mx, fabs(a[i])), e = fmax(e, fabs((double)a[i] - b[i])), nan += isnan(b[i]);
            worst = fmax(worst, e / mx);
            EXPECT(!nan && e <= TOL * mx, "%s TP %d step %d row %d: %d NaN, logits |diff| %.3g of max|logit| (bound %g)",
                   name, N, st, t, nan, e / mx, TOL);
            int t1 = 0, t2 = -1;
            for (int i = 1; i < rc->V; i++)
                if (a[i] > a[t1]) t2 = t1, t1 = i;
                else if (t2 < 0 || a[i] > a[t2]) t2 = i;
            if (a[t1] - a[t2] > TOL * mx)
                EXPECT(ks_argmax(b, rc->V) == t1, "%s TP %d step %d row %d: top-1 %d, CPU TP %d", name, N, st, t,
                       ks_argmax(b, rc->V), t1);
            const struct { const float *x, *y; int64_t n; } v[] = {
                {rc->hidden[st] + (size_t)t * rc->H, rf->hidden[st] + (size_t)t * rc->H, rc->H},
                {rc->aux[st] + (size_t)t * KS_NAUX * rc->H, rf->aux[st] + (size_t)t * KS_NAUX * rc->H, KS_NAUX * rc->H}};
            for (int k = 0; k < 2; k++) {
                double m = 0, d = 0;
                for (int64_t i = 0; i < v[k].n; i++) m = fmax(m, fabs(v[k].x[i])), d = fmax(d, fabs((double)v[k].x[i] - v[k].y[i]));
                EXPECT(d <= TOL_STATE * m, "%s TP %d step %d row %d: %s |diff| %.3g of max %.3g", name, N, st, t,
                       k ? "aux" : "hidden", d, m);
            }
        }
    return worst;
}

/* TP N (ep false) or expert parallel N (ep: E / N whole experts per rank, the rest as at TP N). */
static void check_model(const char *name, const char *path, int N, bool ep) {
    const char *kc = ep ? "cpu+ep" : "cpu", *kd = ep ? "dev+ep" : "dev", *P = ep ? "EP" : "TP";
    ks_run r1, rc, rf, rg, rf2;
    memset(&rg, 0, sizeof rg), memset(&rf2, 0, sizeof rf2);
    model_shard_info si = {0};
    const int viol0 = fake_violations;
    const int ok1 = steps_on(name, path, 1, "cpu", "auto", NULL, &r1, NULL) == 0;
    const int okc = steps_on(name, path, N, kc, "auto", NULL, &rc, NULL) == 0;
    /* the fake device must choose CPU TP's tokens by itself (its bits are the CPU's); a GPU is fed them. The GPU's
     * logic also runs on the fake with KIMI_TP_GPU_LOGIC=1 (run_tp.sh kimi, where cuda_ipc is the real one) */
    const char *gl = getenv("KIMI_TP_GPU_LOGIC");
    const bool gpu_logic = !ON_FAKE || (gl && *gl && strcmp(gl, "0"));
    const int okf = steps_on(name, path, N, kd, dev_comm_name(), gpu_logic ? &rc : NULL, &rf, &si) == 0;
    int okg = 1;
    if (gpu_logic) /* GPU: shm staged == cuda_ipc bit for bit, and a rerun identical */
        okg = okf && steps_on(name, path, N, kd, "shm", &rc, &rg, NULL) == 0 &&
              steps_on(name, path, N, kd, dev_comm_name(), &rc, &rf2, NULL) == 0;
    EXPECT(ok1 && okc && okf && okg, "%s %s %d: a run failed (above)", name, P, N);
    EXPECT(fake_violations == viol0, "%s: %d host pointers reached device ops on rank 0", name, fake_violations - viol0);
    if (ok1 && okc && okf) {
        hf_config hc;
        specd_err err = {{0}};
        EXPECT(hf_config_load(path, &hc, &err) == 0 && si.size == N && si.n_heads * N == hc.n_heads &&
                   si.vocab_rows * N == rc.V && si.expert_parallel == ep &&
                   si.n_experts == (ep ? hc.n_routed_experts / N : hc.n_routed_experts) &&
                   si.expert_width == (ep ? hc.moe_intermediate : hc.moe_intermediate / N),
               "%s: rank 0's shard: %s %d, %d heads, %d LM-head rows, experts %d + %d of width %d", name, P, si.size,
               si.n_heads, si.vocab_rows, si.expert0, si.n_experts, si.expert_width);
        const size_t differ = bits_differ(&rc, &rf);
        size_t total = 0;
        for (int st = 0; st < KS_NSTEP; st++) total += (size_t)rc.T[st] * ((size_t)rc.V + (1 + KS_NAUX) * (size_t)rc.H);
        if (ON_FAKE) {
            EXPECT(differ == 0, "%s %s %d: %zu of %zu logit / hidden / aux values of the fake device differ from CPU "
                                "%s's bits", name, P, N, differ, total, P);
            EXPECT(!memcmp(rc.tok, rf.tok, sizeof rc.tok), "%s %s %d: greedy tokens differ from CPU %s's", name, P, N, P);
        }
        if (gpu_logic && okg) {
            const size_t dg = bits_differ(&rf, &rg), d2 = bits_differ(&rf, &rf2);
            EXPECT(dg == 0, "%s %s %d: %zu values differ between cuda_ipc and shm (both the rank-order f32 sum)", name,
                   P, N, dg);
            EXPECT(d2 == 0, "%s %s %d: %zu values differ between two identical runs", name, P, N, d2);
            const double e = gpu_vs_cpu(name, N, &rc, &rf);
            printf("%-6s %s %d on %s: logits within %.3g of max|logit| of CPU %s %d (bound %g), hidden / aux "
                   "within %g; %s == shm and a rerun bit for bit (%zu values)\n", name, P, N, DEV_NAME, e, P, N, TOL,
                   TOL_STATE, dev_comm_name(), total);
        }
        const bool same1 = !memcmp(r1.tok, rc.tok, sizeof r1.tok);
        EXPECT(same1, "%s %s %d: CPU %s's greedy tokens differ from TP 1's", name, P, N, P);
        double worst = 0, big = 0;
        for (int st = 0; st < KS_NSTEP; st++)
            for (int t = 0; t < r1.T[st]; t++) {
                const float *a = r1.logits[st] + (size_t)t * r1.V, *b = rc.logits[st] + (size_t)t * r1.V;
                double mx = 0, e = 0;
                for (int i = 0; i < r1.V; i++) mx = fmax(mx, fabs(a[i])), e = fmax(e, fabs((double)a[i] - b[i]));
                worst = fmax(worst, e / mx), big = fmax(big, mx);
            }
        EXPECT(worst <= TOL, "%s %s %d: logits |diff| vs TP 1 %.3g of max|logit| > %g", name, P, N, worst, TOL);
        printf("%-6s %s %d on %s (%s; %d of %d heads, LM-head rows %d of %d per rank, routed experts %d..%d of "
               "width %d): %zu logit / hidden / aux values of %d steps, %zu differ from CPU %s %d's bits; CPU %s %d "
               "greedy %s TP 1's, max|diff| vs TP 1 %.3g of max|logit| (<= %.3g)\n",
               name, P, N, DEV_NAME, dev_comm_name(), si.n_heads, si.n_heads * N, si.vocab_rows, rc.V, si.expert0,
               si.expert0 + si.n_experts - 1, si.expert_width, total, KS_NSTEP, differ, P, N, P, N,
               same1 ? "==" : "!=", worst, big);
    }
    ks_free(&r1), ks_free(&rc), ks_free(&rf), ks_free(&rg), ks_free(&rf2);
}

/* k25 at TP 4: 16 of the experts' 64 input columns per rank would cut their int4 groups: refused at load. */
static void check_refusal(const char *path) {
    specd_err err = {{0}};
    run r;
    const int rc = run_open(&r, path, 4, "dev", dev_comm_name(), &err);
    printf("k25 TP 4 on %s: %s\n", DEV_NAME, rc < 0 ? err.msg : "(loaded)");
    EXPECT(rc < 0 && strstr(err.msg, "cannot be split") && strstr(err.msg, "32-value block"),
           "k25 at TP 4 must be refused for the int4 groups: %s", err.msg);
    specd_err e2 = {{0}};
    run_close(&r, &e2); /* the workers failed the same load: their failure is expected here */
}

/* ------------------------------------------------------------ speculative decoding at TP 2 */

enum { NREQ = 8, MAX_NEW = 16 };
static int32_t g_prompts[NREQ][64], g_len[NREQ], g_ref[NREQ][MAX_NEW];

static void *dt_create(void *ctx, bool skip) { (void)ctx, (void)skip; return malloc(1); }
static void dt_destroy(void *s) { free(s); }
static int dt_push(void *s, int32_t id, char **o, size_t *l, size_t *c) {
    (void)s;
    if (id < 0) return -1;
    if (*l + 2 > *c) {
        char *nb = realloc(*o, *c + 64);
        if (!nb) return -1;
        *o = nb;
        *c += 64;
    }
    (*o)[(*l)++] = 't';
    (*o)[*l] = 0;
    return 0;
}
static int dt_flush(void *s, char **o, size_t *l, size_t *c) { (void)s, (void)o, (void)l, (void)c; return 0; }

/* Plain greedy of request q alone through the group (its own blocks), MAX_NEW tokens. */
static int plain_greedy(run *r, int q, int V, specd_err *err) {
    int32_t tab[8], pos[64], seq[64] = {0}, out[1];
    for (int j = 0; j < 8; j++) tab[j] = 8 * q + j;
    const int32_t *tabs[1] = {tab};
    float *lg = malloc(sizeof(float) * (size_t)V);
    int n = g_len[q], rc = 0;
    int32_t next = 0;
    for (int s = 0; rc == 0 && s <= MAX_NEW; s++) {
        const int T = s ? 1 : n;
        for (int i = 0; i < T; i++) pos[i] = s ? n + s - 1 : i;
        out[0] = T - 1;
        model_batch b = {.n_tokens = T, .tokens = s ? &next : g_prompts[q], .pos = pos, .seq_of = seq, .n_seqs = 1,
                         .block_tables = tabs, .n_out = 1, .out_idx = out, .logits = lg};
        rc = run_fwd(r, &b, err);
        if (rc == 0) next = ks_argmax(lg, V);
        if (rc == 0 && s < MAX_NEW) g_ref[q][s] = next;
    }
    free(lg);
    return rc;
}

/* An oracle proposer: drafts each request's plain-greedy continuation with every third draft corrupted, so
 * that verify steps on the TP device target accept, reject and correct (a random head accepts nothing). */
static int g_V;
static int32_t or_tok[64][128], or_n[64];
static uint64_t mix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}
static int or_extend(void *ctx, int64_t id, const int32_t *t, int32_t n, int32_t pos0, const float *aux, specd_err *err) {
    (void)ctx, (void)aux, (void)err;
    for (int32_t i = 0; i < n && pos0 + i < 128; i++) or_tok[id % 64][pos0 + i] = t[i];
    or_n[id % 64] = pos0 + n;
    return 0;
}
static int or_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                      int32_t *out, float *q, specd_err *err) {
    (void)ctx, (void)temps, (void)q, (void)err;
    for (int32_t i = 0; i < n; i++) {
        const int64_t id = ids[i] % 64;
        int best = -1;
        for (int r = 0; r < NREQ; r++)
            if (or_n[id] >= g_len[r] && !memcmp(or_tok[id], g_prompts[r], sizeof(int32_t) * (size_t)g_len[r]) &&
                (best < 0 || g_len[r] > g_len[best]))
                best = r;
        for (int32_t j = 0; j < k_max; j++) {
            const int32_t gi = best < 0 ? -1 : or_n[id] - g_len[best] + j;
            int32_t d = j < k[i] && gi >= 0 && gi < MAX_NEW ? g_ref[best][gi] : -1;
            if (d >= 0 && mix((uint64_t)ids[i] * 7919u + (uint64_t)or_n[id] * 31u + (uint64_t)j) % 3 == 0)
                d = (d + 1) % g_V;
            out[i * k_max + j] = d;
        }
    }
    return 0;
}
static void or_free(void *ctx, int64_t id) { (void)ctx, or_n[id % 64] = 0; }
static void or_trunc(void *ctx, int64_t id, int32_t n) { (void)ctx; if (or_n[id % 64] > n) or_n[id % 64] = n; }
static const spec_proposer_ops or_ops = {.extend = or_extend, .propose = or_propose, .truncate = or_trunc, .free_seq = or_free};

/* The engine at k = 3 on the group with proposer p, nreq requests: every one == its plain greedy.
 * oracle: the drafts must be partly accepted, partly rejected. */
static const char *g_spec_label = "TP"; /* check_spec's group: TP 2 or EP 2 */
static void spec_run(run *r, spec_proposer *p, int nreq, const char *what, bool oracle) {
    const model_config *mc = model_get_config(r->m);
    /* sampling on the device, as the bundle runs a device target at TP (forward_logits_dev: the vocabulary-split
     * logits all-gathered and interleaved on rank 0's device, bk_ops.sample there) */
    engine_runner rn = {.ctx = r, .forward = run_fwd, .vocab = mc->vocab, .hidden = mc->hidden, .block_size = KS_BS,
                        .n_blocks = model_kv_n_blocks(r->m), .sample_be = r->on_dev ? r->be : NULL};
    const int samples0 = fake_kn_sample_calls;
    engine_detok d = {.stream_create = dt_create, .stream_destroy = dt_destroy, .push = dt_push, .flush = dt_flush};
    engine_config cfg = {.max_model_len = 128, .max_num_seqs = 8, .max_num_batched_tokens = 48, .max_waiting = 64,
                         .num_speculative_tokens = 3};
    engine *e = NULL;
    specd_err err = {{0}};
    if (engine_create_ex(&cfg, &rn, &d, r->m, NULL, &e, &err) != 0 || engine_set_proposer(e, p, &err) != 0 ||
        engine_start(e, &err) != 0) {
        EXPECT(0, "engine: %s", err.msg);
        engine_destroy(e);
        return;
    }
    engine_stream *s[NREQ] = {0};
    for (int q = 0; q < nreq; q++) {
        engine_request rq;
        memset(&rq, 0, sizeof rq);
        sampling_params_init(&rq.sp);
        rq.sp.temperature = 0.0f;
        rq.sp.max_tokens = MAX_NEW;
        rq.sp.ignore_eos = true;
        rq.prompt = g_prompts[q];
        rq.n_prompt = (size_t)g_len[q];
        s[q] = engine_submit(e, &rq, NULL, NULL, NULL, &err);
        EXPECT(s[q], "submit: %s", err.msg);
    }
    int same = 0;
    for (int q = 0; q < nreq && s[q]; q++) {
        int32_t got[MAX_NEW + 4];
        int n = 0;
        finish_reason fin = FINISH_NONE;
        engine_output *o;
        while (fin == FINISH_NONE && engine_stream_wait(s[q], &o, 300.0)) {
            for (size_t i = 0; i < o->n_tokens && n < MAX_NEW + 4; i++) got[n++] = o->token_ids[i];
            fin = o->finish;
            engine_output_free(o);
        }
        EXPECT(fin == FINISH_LENGTH && n == MAX_NEW, "%s request %d: %d tokens, finish %d", what, q, n, (int)fin);
        const bool eq = n == MAX_NEW && !memcmp(got, g_ref[q], sizeof g_ref[q]);
        EXPECT(eq, "%s request %d: speculative greedy differs from plain greedy", what, q);
        same += eq;
        engine_stream_release(s[q]);
    }
    EXPECT(engine_wait_idle(e, 60.0) == 0, "%s: engine not idle", what);
    engine_stats st;
    engine_get_stats(e, &st);
    EXPECT(st.kv_blocks_free == st.kv_blocks_total, "%s: %lld of %lld KV blocks free after the run", what,
           (long long)st.kv_blocks_free, (long long)st.kv_blocks_total);
    EXPECT(st.spec_num_draft_tokens_total > 0, "%s: nothing was drafted", what);
    EXPECT(!ON_FAKE || !r->on_dev || fake_kn_sample_calls > samples0, "%s: the engine did not sample on the device",
           what);
    if (oracle)
        EXPECT(st.spec_num_accepted_tokens_total > 0 && st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total,
               "%s: %lld of %lld drafts accepted: the oracle's verify steps must accept and reject", what,
               (long long)st.spec_num_accepted_tokens_total, (long long)st.spec_num_draft_tokens_total);
    printf("k25    %s 2 on %s, %s: %d of %d requests == plain greedy (%lld drafts, %lld draft tokens, "
           "%lld accepted, %lld steps)\n", g_spec_label, DEV_NAME, what, same, nreq, (long long)st.spec_num_drafts_total,
           (long long)st.spec_num_draft_tokens_total, (long long)st.spec_num_accepted_tokens_total,
           (long long)st.steps_total);
    engine_destroy(e);
}

static void check_spec(const char *root, bool ep) {
    char path[1100], head[1100], cfgp[1200];
    snprintf(path, sizeof path, "%s/k25", root);
    snprintf(head, sizeof head, "%s/kimi_head", root);
    snprintf(cfgp, sizeof cfgp, "%s/config.json", head);
    struct stat sb;
    if (stat(cfgp, &sb) != 0) snprintf(head, sizeof head, "%s/head", root); /* no ../shared/data: the random head */
    specd_err err = {{0}};
    run r;
    g_spec_label = ep ? "EP" : "TP";
    if (run_open(&r, path, 2, ep ? "dev+ep" : "dev", dev_comm_name(), &err) < 0) {
        EXPECT(0, "spec: k25 %s 2 on %s: %s", g_spec_label, DEV_NAME, err.msg);
        run_close(&r, &err);
        return;
    }
    const int V = g_V = model_get_config(r.m)->vocab;
    uint64_t x = 0x9e3779b9ull;
    for (int q = 0; q < NREQ; q++) { /* prompts of 5 .. 40 tokens, ordinary ids */
        g_len[q] = 5 + 5 * q;
        for (int i = 0; i < g_len[q]; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            g_prompts[q][i] = 100 + (int32_t)((x >> 33) % 163000);
        }
        if (plain_greedy(&r, q, V, &err) < 0) EXPECT(0, "plain greedy of request %d: %s", q, err.msg);
    }
    backend *dcpu = bk_cpu_create(1);
    for (int b = 0; b < 2 && !n_fail; b++) {
        eagle3_opts o = {.be = dcpu}; /* the head whole on rank 0's CPU, next to the device target (bundle.c) */
        spec_proposer *p = NULL;
        if (eagle3_load(head, r.m, &o, &p, &err) != 0) {
            EXPECT(0, "eagle3_load %s next to the %s 2 device target: %s", head, g_spec_label, err.msg);
            break;
        }
        char what[160];
        snprintf(what, sizeof what, "head %s on rank 0's CPU, k = 3, %s", strstr(head, "kimi_head") ? "kimi_head" : "head (random)",
                 b ? "8 concurrent" : "batch 1");
        spec_run(&r, p, b ? NREQ : 1, what, false);
        eagle3_destroy(p);
    }
    spec_proposer oracle = {.ops = &or_ops, .ctx = NULL};
    memset(or_n, 0, sizeof or_n);
    spec_run(&r, &oracle, NREQ, "oracle drafts (1/3 corrupted), k = 3, 8 concurrent", true);
    bk_cpu_destroy(dcpu);
    EXPECT(run_close(&r, &err) == 0, "spec %s 2 shutdown: %s", g_spec_label, err.msg);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--tp-worker")) return worker_main(argc, argv);
    g_self = argv[0];
    const char *root = getenv("KIMI_C_MINI_DIR");
    char k25[1100], wide[1100], cfg[1200];
    struct stat sb;
    snprintf(k25, sizeof k25, "%s/k25", root ? root : "");
    snprintf(wide, sizeof wide, "%s/wide8", root ? root : "");
    snprintf(cfg, sizeof cfg, "%s/config.json", wide);
    if (!root || stat(cfg, &sb) != 0) {
        printf("SKIP: KIMI_C_MINI_DIR unset or without the miniatures (the kimi_c_mini_setup fixture writes them)\n");
        return 77;
    }
#if !ON_FAKE
    char why[256];
    if (bk_cuda_probe(0, why, sizeof why) != 0) {
        printf("SKIP: no usable GPU: %s\n", why);
        return 77;
    }
#endif
    const char *quick = getenv("KIMI_TP_QUICK");
    if (quick && *quick && strcmp(quick, "0")) { /* run_tp.sh under kn_emu: one case */
        check_model("wide8", wide, 2, false);
        check_model("wide8", wide, 2, true); /* expert parallel: its collectives through cuda_ipc too */
    } else if (!ON_FAKE) { /* the GPU (gpu_check.sh's ctest_gpu budget): one model per width class */
        check_model("k25", k25, 2, false);
        check_model("wide8", wide, 4, false);
        check_model("wide8", wide, 4, true);
        check_refusal(k25);
        check_spec(root, false);
        check_spec(root, true);
    } else {
        check_model("k25", k25, 2, false);
        check_model("wide8", wide, 2, false);
        check_model("wide8", wide, 4, false);
        check_model("wide8", wide, 8, false);
        check_refusal(k25);
        check_spec(root, false);
        /* expert parallelism: E / N whole experts per rank (k25 at 4 too, which TP cannot split) */
        check_model("k25", k25, 2, true);
        check_model("k25", k25, 4, true);
        check_model("wide8", wide, 4, true);
        check_model("wide8", wide, 8, true);
        check_spec(root, true);
    }
    printf(n_fail ? "FAILED: %d\n" : "OK\n", n_fail);
    return n_fail ? 1 : 0;
}
