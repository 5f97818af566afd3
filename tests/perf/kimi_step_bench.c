/*
 * kimi_step_bench.c: the measured step of issue 19 -- one TP-8 rank of
 * Kimi-K2.5 (all 61 layers at 1/8 width, ~76 GB of weights) on one GPU,
 * decode at batch 1, 4, 16, 32 and a verify of 4 tokens of one sequence.
 * A benchmark (tools/gpu_check.sh runs it), not a test: it asserts nothing.
 *
 *   kimi_step_bench [--json PATH] [--iters N] [--ctx N] [--mla cc|mma] [--layers N]
 *
 * The step is the composition of the kernels of kernels/ that the device
 * form of engine/model/deepseek_v3_fwd.c (absorbed MLA, int4 MoE) runs, in
 * the CPU forward's order, with the rank's real shapes (docs/kimi-k2.5.md
 * budget; tools/kimi/kimi_k25_config.json): hidden 7168; per layer q_a
 * [1536, 7168] + q_a_norm, q_b [8 x 192, 1536] (8 of 64 heads), kv_a [576,
 * 7168] + kv_a_norm, the absorbed kv_b per head (W_UK^T [512, 128], W_UV
 * [128, 512]), o_proj [7168, 1024]; layer 0 a dense MLP slice [2304, 7168]
 * x 2 + [7168, 2304]; layers 1..60 router [384, 7168] + bias, the shared
 * expert slice [256, 7168] x 2 + [7168, 256], 384 routed experts of [256 |
 * 256 | 256] int4 group 32 (KN_I4IL) + bf16 scales; embedding and lm_head
 * the rank's 20,480 vocabulary rows. bf16 except the int4 experts.
 * Per layer: add_rmsnorm, q_a, q_a norm, q_b, kv_a, c_kv norm (copy out,
 * norm, copy back), RoPE on q_pe and k_pe, kn_mla_latent_write, per head
 * q_nope gather + W_UK^T + scatter + q_pe copy, kn_mla_attention, per head
 * gather + W_UV + scatter, o_proj, add_rmsnorm, then the MLP or router +
 * kn_moe_route + shared expert + kn_moe_experts. The all-reduces (2 per
 * layer + 1 for the embedding: 123 per step) are NOT included: at TP 8 they
 * are comm_gpu_bench's cuda_ipc / NCCL figures at batch x 7168 values.
 *
 * Weights are generated on the device: a seeded 32 MiB pattern (random
 * words for int4, bf16 values |v| < 2^-4 for bf16 weights, bf16 scales in
 * [2^-8, 2^-6)) is uploaded once and replicated by device-to-device copies,
 * each tensor from its own seeded offset; no host copy of the weights
 * exists. Norm gains are 1, the router bias small random; the latent cache
 * is a constant bf16 pattern (its values do not change the speed). Routing
 * is real (kn_moe_route on the step's own activations), so the experts a
 * step reads are those its tokens choose: counted per layer from the ids
 * downloaded after the step.
 *
 * Per case one JSON line: us per step (CUDA graph of the whole step,
 * replayed; and direct launches), kernels per step (the captured graph's
 * node count) and launcher calls, weight bytes read (every dense weight
 * once, the embedding rows of the step's tokens, the distinct experts
 * chosen per layer), latent bytes read (batch x (ctx + q_len) x 1,152 per
 * layer), GB/s = (weight + latent bytes) / graph time, and its fraction of
 * the measured device-to-device copy bandwidth (read + write). Before
 * allocating, it checks cudaMemGetInfo and refuses (exit 3, with the
 * numbers) when the device cannot hold the rank. Exits 77 without a GPU.
 * Runtime on an H200: ~76 GB of fills (< 1 s of copies) + the cases at
 * iters 10: well under 90 s.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kn_attn.h"
#include "kernels/kn_linear.h"
#include "kernels/kn_mla.h"
#include "kernels/kn_moe.h"
#include "tests/kernels/kn_harness.h"
#include "tests/perf/kn_bench_util.h"

/* a launcher call of the step (counted) */
static long g_calls;
#define LN(call)     \
    do {             \
        g_calls++;   \
        KN_CK(call);    \
    } while (0)

/* Kimi-K2.5 at TP 8, one rank */
enum {
    H = 7168, NL_ALL = 61, NH = 8, QL = 1536, KVL = 512, R = 64, NOPE = 128, VH = 128, D = KVL + R,
    QW = NH * (NOPE + R), I_DENSE = 18432 / 8, E = 384, K = 8, I_TP = 2048 / 8, IS_TP = 2048 / 8,
    V_TP = 163840 / 8, BS = 64, MMAX = 32,
};
#define SCALE 0.144680f /* the model's softmax scale (docs/kimi-k2.5.md) */
#define ROUTED_SCALING 2.827f

typedef struct layer_w {
    void *q_a, *q_b, *kv_a, *o;           /* bf16 */
    void *uk[NH], *uv[NH];                /* bf16 [512, 128], [128, 512] per head */
    void *g, *u, *d;                      /* dense MLP (layer 0) or the shared expert slice */
    void *router;                         /* bf16 [E, H] (MoE layers) */
    float *bias;                          /* f32 [E] */
    kn_moe_weights ex;                    /* device, KN_I4IL */
    int moe;
} layer_w;

static uint64_t g_s = 20261202;
static uint64_t lcg(void) { return g_s = g_s * 6364136223846793005ull + 1442695040888963407ull; }

static size_t g_alloc;
static void *dalloc(size_t n) {
    void *p;
    KN_CK(cudaMalloc(&p, n));
    g_alloc += n;
    return p;
}
static const size_t PAT = (size_t)32 << 20;
/* dst[bytes] = the pattern dpat[PAT] repeated, starting at a seeded offset */
static void fill(void *dst, size_t bytes, const char *dpat, cudaStream_t st) {
    size_t off0 = (size_t)(lcg() >> 33) % (PAT / 2) & ~(size_t)15;
    for (size_t off = 0; off < bytes;) {
        size_t n = PAT - off0 < bytes - off ? PAT - off0 : bytes - off;
        KN_CK(cudaMemcpyAsync((char *)dst + off, dpat + off0, n, cudaMemcpyDeviceToDevice, st));
        off += n, off0 = 0;
    }
}
static void *bf16w(size_t rows, size_t cols, const char *pb, cudaStream_t st) {
    void *p = dalloc(rows * cols * 2);
    fill(p, rows * cols * 2, pb, st);
    return p;
}
static kn_weight kw(const void *p, int64_t rows, int64_t cols) { return (kn_weight){KN_W_BF16, rows, cols, p, (size_t)cols * 2}; }

/* activations and per-step buffers (device), sized for MMAX tokens */
typedef struct acts {
    float *x, *xn, *qlo, *q, *lat, *ckv, *qa, *oa, *tin, *tout, *att, *y, *g, *u, *shared, *rlog, *logits;
    float *ones, *invf;
    int32_t *ids, *tok; /* ids [NL_ALL][MMAX * K] */
    float *w;           /* [NL_ALL][MMAX * K] */
    void *ws, *scratch;
    size_t ws_bytes, scratch_bytes;
} acts;

typedef struct model_w {
    layer_w L[NL_ALL];
    void *embed, *lm_head; /* bf16 [V_TP, H] */
    int nl;
} model_w;

/* one step of T tokens (metadata b, cache per layer at lat + l * layer_elems) */
static void step(const model_w *M, const acts *a, const kn_attn_batch *b, uint16_t *cache, size_t layer_elems,
                 int32_t n_blocks, int mma, cudaStream_t st) {
    const int T = b->n_tokens;
    const kn_weight emb = kw(M->embed, V_TP, H);
    LN(kn_embed(&emb, a->tok, T, a->x, NULL, st));
    for (int l = 0; l < M->nl; l++) {
        const layer_w *Y = &M->L[l];
        /* attention norm (layer 0: the embedding; later: x += previous MLP output) */
        LN(kn_add_rmsnorm(a->x, l ? a->y : NULL, a->ones, T, H, 1e-5f, a->xn, st));
        kn_weight w = kw(Y->q_a, QL, H);
        LN(kn_matmul(&w, a->xn, T, a->qlo, st));
        LN(kn_rmsnorm(a->qlo, a->ones, T, QL, 1e-6f, a->qlo, st));
        w = kw(Y->q_b, QW, QL);
        LN(kn_matmul(&w, a->qlo, T, a->q, st));
        w = kw(Y->kv_a, D, H);
        LN(kn_matmul(&w, a->xn, T, a->lat, st));
        LN(kn_copy_rows(a->ckv, KVL, a->lat, D, T, KVL, st));
        LN(kn_rmsnorm(a->ckv, a->ones, T, KVL, 1e-6f, a->ckv, st));
        LN(kn_copy_rows(a->lat, D, a->ckv, KVL, T, KVL, st));
        LN(kn_rope(a->q + NOPE, T, NH, NOPE + R, R, b->pos, a->invf, 1.0f, 0, st));
        LN(kn_rope(a->lat + KVL, T, 1, D, R, b->pos, a->invf, 1.0f, 0, st));
        const kn_mla_cache c = {cache + (size_t)l * layer_elems, BS, KVL, R, n_blocks};
        LN(kn_mla_latent_write(&c, b, a->lat, st));
        for (int h = 0; h < NH; h++) { /* q_lat = W_UK_h^T q_nope_h; qa = [q_lat | q_pe] */
            LN(kn_copy_rows(a->tin, NOPE, a->q + h * (NOPE + R), QW, T, NOPE, st));
            w = kw(Y->uk[h], KVL, NOPE);
            LN(kn_matmul(&w, a->tin, T, a->tout, st));
            LN(kn_copy_rows(a->qa + h * D, NH * D, a->tout, KVL, T, KVL, st));
            LN(kn_copy_rows(a->qa + h * D + KVL, NH * D, a->q + h * (NOPE + R) + NOPE, QW, T, R, st));
        }
        LN((mma ? kn_mla_attention_mma : kn_mla_attention)(&c, b, a->qa, NH, SCALE, a->oa, a->scratch,
                                                            a->scratch_bytes, st));
        for (int h = 0; h < NH; h++) { /* out_h = W_UV_h o_h */
            LN(kn_copy_rows(a->tin, KVL, a->oa + h * KVL, NH * KVL, T, KVL, st));
            w = kw(Y->uv[h], VH, KVL);
            LN(kn_matmul(&w, a->tin, T, a->tout, st));
            LN(kn_copy_rows(a->att + h * VH, NH * VH, a->tout, VH, T, VH, st));
        }
        w = kw(Y->o, H, NH * VH);
        LN(kn_matmul(&w, a->att, T, a->y, st));
        /* (all-reduce of y here at TP 8) */
        LN(kn_add_rmsnorm(a->x, a->y, a->ones, T, H, 1e-5f, a->xn, st));
        const int I = Y->moe ? IS_TP : I_DENSE;
        kn_weight wg = kw(Y->g, I, H), wu = kw(Y->u, I, H), wd = kw(Y->d, H, I);
        LN(kn_matmul(&wg, a->xn, T, a->g, st));
        LN(kn_matmul(&wu, a->xn, T, a->u, st));
        LN(kn_silu_mul(a->g, a->u, (int64_t)T * I, a->g, st));
        if (!Y->moe) {
            LN(kn_matmul(&wd, a->g, T, a->y, st));
        } else {
            LN(kn_matmul(&wd, a->g, T, a->shared, st));
            const kn_weight wr = kw(Y->router, E, H);
            const kn_moe_route_cfg cfg = {E, K, 1, 1, 1, ROUTED_SCALING};
            LN(kn_matmul(&wr, a->xn, T, a->rlog, st));
            int32_t *ids = a->ids + (size_t)l * MMAX * K;
            float *wt = a->w + (size_t)l * MMAX * K;
            LN(kn_moe_route(a->rlog, Y->bias, T, &cfg, ids, wt, st));
            LN(kn_moe_experts(&Y->ex, a->xn, ids, wt, T, K, a->shared, a->ws, a->ws_bytes, a->y, NULL, st));
        }
        /* (all-reduce of y here at TP 8) */
    }
    LN(kn_add_rmsnorm(a->x, a->y, a->ones, T, H, 1e-5f, a->xn, st));
    const kn_weight lm = kw(M->lm_head, V_TP, H);
    LN(kn_matmul(&lm, a->xn, T, a->logits, st));
}

static double dense_layer_bytes(const layer_w *Y) {
    double b = 2.0 * ((double)QL * H + (double)QW * QL + (double)D * H + 2.0 * NH * KVL * NOPE + (double)H * NH * VH);
    const double I = Y->moe ? IS_TP : I_DENSE;
    b += 2.0 * 3.0 * I * H;
    if (Y->moe) b += 2.0 * E * H + 4.0 * E;
    return b;
}

int main(int argc, char **argv) {
    const char *json = NULL;
    int iters = 10, ctx = 1536, mma = 0, nl = NL_ALL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ctx") && i + 1 < argc) ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) nl = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mla") && i + 1 < argc) {
            const char *v = argv[++i];
            if (!strcmp(v, "mma")) mma = 1;
            else if (strcmp(v, "cc")) { fprintf(stderr, "--mla: cc or mma, not %s\n", v); return 2; }
        } else {
            fprintf(stderr, "usage: %s [--json PATH] [--iters N] [--ctx N] [--mla cc|mma] [--layers N]\n", argv[0]);
            return 2;
        }
    }
    if (iters < 1) iters = 1;
    if (ctx < 0 || ctx > 262144 || nl < 1 || nl > NL_ALL) {
        fprintf(stderr, "--ctx 0..262144, --layers 1..%d\n", NL_ALL);
        return 2;
    }
    kn_harness_require_gpu();
    struct cudaDeviceProp prop;
    KN_CK(cudaGetDeviceProperties(&prop, 0));

    /* the memory plan, checked before anything large is allocated */
    const int qmax = 4, max_len = ctx + qmax, nb_seq = (max_len + BS - 1) / BS, n_blocks = MMAX * nb_seq;
    const size_t layer_elems = (size_t)n_blocks * BS * D;
    const size_t ex_bytes = kn_moe_w13_words(E, H, I_TP) * 4 + kn_moe_s13_count(E, H, I_TP) * 2 +
                            kn_moe_w2_words(E, H, I_TP) * 4 + kn_moe_s2_count(E, H, I_TP) * 2;
    double wbytes = 2.0 * 2.0 * V_TP * H;
    layer_w proto[2] = {{.moe = 0}, {.moe = 1}};
    for (int l = 0; l < nl; l++) wbytes += dense_layer_bytes(&proto[l > 0]) + (l > 0 ? (double)ex_bytes : 0);
    const size_t kv_bytes = layer_elems * 2 * (size_t)nl;
    const size_t ws_bytes = kn_moe_workspace_bytes(MMAX, K, E, H, I_TP);
    const size_t scratch_bytes = kn_mla_scratch_bytes(MMAX, NH, max_len, KVL);
    const double need = wbytes + (double)kv_bytes + ws_bytes + scratch_bytes + 3.0 * PAT + ((size_t)2 << 30);
    size_t fr = 0, tot = 0;
    KN_CK(cudaMemGetInfo(&fr, &tot));
    if ((double)fr < need) {
        printf("REFUSED: one TP-8 rank of Kimi-K2.5 (%d layers) needs %.2f GB (weights %.2f GB, latent cache %.2f GB "
               "at %d x %d positions, workspaces + 2 GiB margin); %s has %.2f GB free of %.2f GB\n",
               nl, need / 1e9, wbytes / 1e9, kv_bytes / 1e9, MMAX, max_len, prop.name, fr / 1e9, tot / 1e9);
        return 3;
    }
    cudaStream_t st;
    KN_CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    KN_CK(cudaEventCreate(&e0));
    KN_CK(cudaEventCreate(&e1));

    /* copy bandwidth (read + write), the reference for every fraction below */
    const double copy_gbps = kn_bench_copy_gbps(st, 10);

    /* the seeded patterns (the only host data the weights come from) */
    uint32_t *hw = malloc(PAT);
    uint16_t *hb = malloc(PAT), *hs = malloc(PAT);
    if (!hw || !hb || !hs) { fprintf(stderr, "out of memory\n"); return 1; }
    for (size_t i = 0; i < PAT / 4; i++) hw[i] = (uint32_t)(lcg() >> 32);
    for (size_t i = 0; i < PAT / 2; i++) {
        const uint64_t s = lcg();
        hb[i] = (uint16_t)(((s >> 63) << 15) | ((uint64_t)(119 + (s >> 40) % 4) << 7) | ((s >> 20) & 0x7f));
        hs[i] = (uint16_t)(((uint64_t)(119 + (s >> 44) % 2) << 7) | ((s >> 24) & 0x7f));
    }
    char *pw = dalloc(PAT), *pb = dalloc(PAT), *ps = dalloc(PAT);
    KN_CK(cudaMemcpy(pw, hw, PAT, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(pb, hb, PAT, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(ps, hs, PAT, cudaMemcpyHostToDevice));
    free(hw), free(hb), free(hs);

    model_w *M = calloc(1, sizeof *M);
    float *hbias = malloc(sizeof(float) * E);
    if (!M || !hbias) { fprintf(stderr, "out of memory\n"); return 1; }
    M->nl = nl;
    M->embed = bf16w(V_TP, H, pb, st);
    M->lm_head = bf16w(V_TP, H, pb, st);
    for (int l = 0; l < nl; l++) {
        layer_w *Y = &M->L[l];
        Y->moe = l > 0;
        Y->q_a = bf16w(QL, H, pb, st), Y->q_b = bf16w(QW, QL, pb, st), Y->kv_a = bf16w(D, H, pb, st);
        Y->o = bf16w(H, NH * VH, pb, st);
        for (int h = 0; h < NH; h++) Y->uk[h] = bf16w(KVL, NOPE, pb, st), Y->uv[h] = bf16w(VH, KVL, pb, st);
        const int I = Y->moe ? IS_TP : I_DENSE;
        Y->g = bf16w(I, H, pb, st), Y->u = bf16w(I, H, pb, st), Y->d = bf16w(H, I, pb, st);
        if (!Y->moe) continue;
        Y->router = bf16w(E, H, pb, st);
        for (int e = 0; e < E; e++) hbias[e] = (float)((double)(lcg() >> 11) * 0x1.0p-53 * 0.02 - 0.01);
        Y->bias = dalloc(sizeof(float) * E);
        KN_CK(cudaMemcpy(Y->bias, hbias, sizeof(float) * E, cudaMemcpyHostToDevice));
        const size_t b13 = kn_moe_w13_words(E, H, I_TP) * 4, bs13 = kn_moe_s13_count(E, H, I_TP) * 2;
        const size_t b2 = kn_moe_w2_words(E, H, I_TP) * 4, bs2 = kn_moe_s2_count(E, H, I_TP) * 2;
        void *w13 = dalloc(b13), *s13 = dalloc(bs13), *w2 = dalloc(b2), *s2 = dalloc(bs2);
        fill(w13, b13, pw, st), fill(s13, bs13, ps, st), fill(w2, b2, pw, st), fill(s2, bs2, ps, st);
        Y->ex = (kn_moe_weights){E, H, I_TP, w13, s13, w2, s2, 0, 0};
    }
    free(hbias);
    KN_CK(cudaFree(pw));
    KN_CK(cudaFree(pb));
    KN_CK(cudaFree(ps));
    uint16_t *cache = dalloc(kv_bytes);
    KN_CK(cudaMemsetAsync(cache, 0x3c, kv_bytes, st)); /* bf16 0x3c3c = 0.0115 */

    acts a = {0};
    const size_t T = MMAX;
    a.x = dalloc(4 * T * H), a.xn = dalloc(4 * T * H), a.qlo = dalloc(4 * T * QL), a.q = dalloc(4 * T * QW);
    a.lat = dalloc(4 * T * D), a.ckv = dalloc(4 * T * KVL), a.qa = dalloc(4 * T * NH * D);
    a.oa = dalloc(4 * T * NH * KVL), a.tin = dalloc(4 * T * KVL), a.tout = dalloc(4 * T * KVL);
    a.att = dalloc(4 * T * NH * VH), a.y = dalloc(4 * T * H), a.g = dalloc(4 * T * I_DENSE);
    a.u = dalloc(4 * T * I_DENSE), a.shared = dalloc(4 * T * H), a.rlog = dalloc(4 * T * E);
    a.logits = dalloc(4 * T * V_TP), a.ones = dalloc(4 * (size_t)H), a.invf = dalloc(4 * R / 2);
    a.ids = dalloc(4 * (size_t)NL_ALL * T * K), a.w = dalloc(4 * (size_t)NL_ALL * T * K), a.tok = dalloc(4 * T);
    a.ws_bytes = ws_bytes, a.ws = dalloc(ws_bytes);
    a.scratch_bytes = scratch_bytes, a.scratch = dalloc(scratch_bytes);
    float hf[H];
    for (int i = 0; i < H; i++) hf[i] = 1.0f;
    KN_CK(cudaMemcpy(a.ones, hf, sizeof hf, cudaMemcpyHostToDevice));
    for (int i = 0; i < R / 2; i++) hf[i] = (float)pow(50000.0, -2.0 * i / R);
    KN_CK(cudaMemcpy(a.invf, hf, sizeof(float) * R / 2, cudaMemcpyHostToDevice));

    /* metadata: sequences' blocks interleaved over the pool */
    int32_t *bt = malloc(sizeof(int32_t) * (size_t)MMAX * nb_seq), pos[MMAX], seq[MMAX], tok[MMAX];
    if (!bt) { fprintf(stderr, "out of memory\n"); return 1; }
    for (int s = 0; s < MMAX; s++)
        for (int j = 0; j < nb_seq; j++) bt[s * nb_seq + j] = j * MMAX + s;
    int32_t *d_bt = dalloc(sizeof(int32_t) * (size_t)MMAX * nb_seq), *d_pos = dalloc(4 * T), *d_seq = dalloc(4 * T);
    KN_CK(cudaMemcpy(d_bt, bt, sizeof(int32_t) * (size_t)MMAX * nb_seq, cudaMemcpyHostToDevice));
    free(bt);
    KN_CK(cudaStreamSynchronize(st));

    printf("device: %s, %d SMs, L2 %d MiB; copy D2D (read + write) %.1f GB/s; allocated %.2f GB\n", prop.name,
           prop.multiProcessorCount, prop.l2CacheSize >> 20, copy_gbps, g_alloc / 1e9);
    printf("Kimi-K2.5 TP-8 rank: %d layers, weights %.2f GB, latent cache %.2f GB, ctx %d, MLA %s\n", nl, wbytes / 1e9,
           kv_bytes / 1e9, ctx, mma ? "mma" : "cuda cores");
    FILE *jf = json ? fopen(json, "w") : NULL;
    if (json && !jf) { fprintf(stderr, "cannot write %s\n", json); return 1; }
    const struct { const char *form; int batch, qlen; } cases[] = {
        {"decode", 1, 1}, {"decode", 4, 1}, {"decode", 16, 1}, {"decode", 32, 1}, {"verify", 1, 4},
    };
    double dense_bytes = 2.0 * V_TP * H; /* lm_head */
    for (int l = 0; l < nl; l++) dense_bytes += dense_layer_bytes(&M->L[l]);
    int32_t *hids = malloc(sizeof(int32_t) * (size_t)NL_ALL * MMAX * K);
    if (!hids) { fprintf(stderr, "out of memory\n"); return 1; }
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int B = cases[ci].batch, q = cases[ci].qlen, Tn = B * q;
        for (int s = 0; s < B; s++)
            for (int j = 0; j < q; j++) seq[s * q + j] = s, pos[s * q + j] = ctx + j;
        KN_CK(cudaMemcpyAsync(d_pos, pos, sizeof(int32_t) * Tn, cudaMemcpyHostToDevice, st));
        KN_CK(cudaMemcpyAsync(d_seq, seq, sizeof(int32_t) * Tn, cudaMemcpyHostToDevice, st));
        const kn_attn_batch b = {Tn, d_pos, d_seq, d_bt, nb_seq, MMAX, NULL, ctx + q};
        double t_direct = 0, t_graph = 0, exbytes = 0, distinct = 0;
        long calls = 0;
        for (int it = -1; it < iters; it++) { /* direct launches; a fresh set of tokens every step */
            for (int i = 0; i < Tn; i++) tok[i] = (int32_t)((lcg() >> 33) % V_TP);
            KN_CK(cudaMemcpyAsync(a.tok, tok, sizeof(int32_t) * Tn, cudaMemcpyHostToDevice, st));
            g_calls = 0;
            KN_CK(cudaEventRecord(e0, st));
            step(M, &a, &b, cache, layer_elems, n_blocks, mma, st);
            KN_CK(cudaEventRecord(e1, st));
            KN_CK(cudaEventSynchronize(e1));
            calls = g_calls;
            if (it < 0) continue;
            float m = 0;
            KN_CK(cudaEventElapsedTime(&m, e0, e1));
            t_direct += m;
            KN_CK(cudaMemcpy(hids, a.ids, sizeof(int32_t) * (size_t)NL_ALL * MMAX * K, cudaMemcpyDeviceToHost));
            for (int l = 1; l < nl; l++) {
                unsigned char seen[E] = {0};
                int nd = 0;
                for (int i = 0; i < Tn * K; i++) {
                    const int32_t e = hids[(size_t)l * MMAX * K + i];
                    if (e >= 0 && e < E && !seen[e]) seen[e] = 1, nd++;
                }
                distinct += nd;
                exbytes += (double)nd * ex_bytes / E;
            }
        }
        /* the whole step as one CUDA graph, replayed */
        cudaGraph_t gr;
        cudaGraphExec_t ge;
        KN_CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        step(M, &a, &b, cache, layer_elems, n_blocks, mma, st);
        KN_CK(cudaStreamEndCapture(st, &gr));
        size_t nodes = 0;
        KN_CK(cudaGraphGetNodes(gr, NULL, &nodes));
        KN_CK(cudaGraphInstantiate(&ge, gr, 0));
        KN_CK(cudaGraphDestroy(gr));
        for (int it = -1; it < iters; it++) {
            for (int i = 0; i < Tn; i++) tok[i] = (int32_t)((lcg() >> 33) % V_TP);
            KN_CK(cudaMemcpyAsync(a.tok, tok, sizeof(int32_t) * Tn, cudaMemcpyHostToDevice, st));
            KN_CK(cudaEventRecord(e0, st));
            KN_CK(cudaGraphLaunch(ge, st));
            KN_CK(cudaEventRecord(e1, st));
            KN_CK(cudaEventSynchronize(e1));
            float m = 0;
            KN_CK(cudaEventElapsedTime(&m, e0, e1));
            if (it >= 0) t_graph += m;
        }
        KN_CK(cudaGraphExecDestroy(ge));
        const double us_d = t_direct / iters * 1e3, us_g = t_graph / iters * 1e3;
        const double wb = dense_bytes + (double)Tn * H * 2 + exbytes / iters;
        const double lb = (double)B * (ctx + q) * D * 2 * nl;
        const double gbps = (wb + lb) / (us_g * 1e-6) / 1e9;
        char line[1024];
        snprintf(line, sizeof line,
                 "{\"bench\": \"kimi_step\", \"model\": \"Kimi-K2.5\", \"tp\": 8, \"layers\": %d, \"form\": \"%s\", "
                 "\"batch\": %d, \"q_len\": %d, \"ctx\": %d, \"mla\": \"%s\", \"iters\": %d, \"us_step_graph\": %.1f, "
                 "\"us_step_direct\": %.1f, \"kernels\": %zu, \"launcher_calls\": %ld, \"distinct_experts_per_layer\": "
                 "%.2f, \"weight_bytes\": %.0f, \"latent_bytes\": %.0f, \"gbps\": %.1f, \"copy_gbps\": %.1f, "
                 "\"frac_copy\": %.3f, \"us_weight_read_at_copy_bw\": %.1f, \"allreduces_not_included\": %d, "
                 "\"device\": \"%s\"}",
                 nl, cases[ci].form, B, q, ctx, mma ? "mma" : "cc", iters, us_g, us_d, nodes, calls,
                 nl > 1 ? distinct / iters / (nl - 1) : 0.0, wb, lb, gbps, copy_gbps, gbps / copy_gbps,
                 wb / (copy_gbps * 1e9) * 1e6, 2 * nl + 1, prop.name);
        printf("%s\n", line);
        if (jf) fprintf(jf, "%s\n", line);
    }
    if (jf) fclose(jf);
    free(hids);
    return 0; /* device memory goes with the process */
}
