/*
 * test_cuda_dsv3_ops.c: the CUDA backend's DeepSeek-V3 ops against the CPU
 * (issue 19): MLA (backend.h mla_latent_write / mla_attention over
 * kernels/kn_mla.h) and the MoE block (moe_place / moe over kn_moe_pack +
 * kernels/kn_moe.h).
 *
 * MLA, against the CPU backend's mla ops (the attention op on the bf16
 * latent plane + the c_kv columns: what deepseek_v3_fwd.c mla_absorbed
 * computes), at two shapes: a Kimi-K2.5 TP-8 rank (8 heads, kv_lora_rank
 * 512, rope 64) and the Kimi miniature (4 heads, 32, 16).
 * Per shape: a prefill step writes the context of 3 sequences (37, 130 and 5
 * positions, their blocks scattered backwards over the pool) through
 * mla_latent_write on both backends; then a mixed step (a decode token, a
 * 4-token verify, a 2-token chunk) and a tree step (siblings at one
 * position, tree mask) write their latent rows and run mla_attention on the
 * same random q.
 *   - the latent plane after every write: bitwise equal to the CPU's (both
 *     round each f32 to bf16 to nearest even: kn_mla_latent_write's contract);
 *   - mla_attention: NMSE <= 1e-8 against the CPU's on a GPU (kn_mla's bound:
 *     both read the same bf16 values, f32 vs double softmax sums; a wrong
 *     head, column or position moves it to >= ~1e-4, tests/kernels/test_kn_mla.c),
 *     and no NaN;
 *   - refusals: an f32 plane, a kv_lora_rank >= the latent width.
 * MoE, against an independent host reference written from moe_forward's
 * definition (dsv3_route per token, each chosen expert through the CPU
 * backend's BK_W_I4G32 matmul on the checkpoint's words, silu_mul, y = 0;
 * y += ye * w in ascending expert id; y += shared): random int4 experts
 * (every nibble, bf16 scales in [2^-8, 2^-6)), two configs (16 experts top 4
 * with 4 groups / 2 kept, norm, scale 2.5, a shared expert; 8 experts top 2,
 * no groups, no norm, no shared), T = 1, 5, 33 (the op's buffers are carved at create from the opts'
 * MoE bounds; a 257-token call beyond them is refused): on a
 * GPU NMSE <= 1e-9 and max|diff| <= 1e-4 max|y| (kn_moe's bounds: f32
 * activations, the same bf16 dequantised values, different summation order);
 * a non-int4 expert is refused by moe_place.
 * Built twice: label gpu against the real kernels (exits 77 without a GPU),
 * and backend_cuda_dsv3_on_fake against tests/backend/cuda_fake.c, whose
 * kn_mla_* run the CPU backend's own mla ops and whose kn_moe_* run
 * dsv3_route + the CPU backend's I4G32 matmul on the words unpacked from the
 * repacked layout, on the recorded "device" memory: there the results must
 * be bitwise equal (and every pointer the glue passes must be device
 * memory). The fake checks the glue's plumbing (shapes, metadata, scratch,
 * repacking, pointers), NOT the kernels' arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/backend.h"
#include "engine/backend/cuda_backend.h"
#include "engine/model/deepseek_v3.h"
#include "tests/kernels/kn_harness.h"

#ifdef bk_cuda_create /* tests/backend/cuda_fake/cuda_runtime_api.h renamed the backend: the fake device */
#define ON_FAKE 1
extern int fake_violations;
#else
#define ON_FAKE 0
#endif

#define NMSE_BOUND 1e-8
#define BS 16
#define NSEQ 3
#define NBLK 40


static backend *cpu, *dev;
static uint64_t g_s = 19;
static float frand(void) {
    g_s = g_s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(g_s >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

typedef struct shape { const char *name; int32_t nh, kvl, r; } shape;

/* the paged plane pair: host (CPU backend) and device */
typedef struct planes { uint16_t *h; uint16_t *d; size_t n; bk_kv_layer hk, dk; } planes;

static int32_t bt_rows[NSEQ][NBLK / NSEQ];
static const int32_t *bts[NSEQ];

static bk_tensor dup(const float *h, int64_t r, int64_t c) {
    bk_tensor t = {0};
    if (bk_tensor_alloc(dev, BK_F32, r, c, &t) == 0) dev->ops->upload(dev->ctx, t.data, h, sizeof(float) * (size_t)(r * c));
    return t;
}

static void check_plane(const planes *p, const char *what, const shape *s) {
    uint16_t *g = malloc(p->n * 2);
    KN_EXPECT(g && dev->ops->download(dev->ctx, g, p->d, p->n * 2) == 0, "%s %s: download", s->name, what);
    size_t bad = 0;
    for (size_t i = 0; g && i < p->n; i++) bad += g[i] != p->h[i];
    KN_EXPECT(g && bad == 0, "%s %s: %zu of %zu latent values differ from the CPU's", s->name, what, bad, p->n);
    free(g);
}

/* one step on both backends: write lat [T, D], then (q != NULL) attention -> compare */
static void run(const shape *s, planes *p, const char *what, int32_t T, const int32_t *pos, const int32_t *seq,
                const uint8_t *mask, int attend) {
    const int32_t D = s->kvl + s->r;
    float *lat = malloc(sizeof(float) * (size_t)T * D), *q = malloc(sizeof(float) * (size_t)T * s->nh * D);
    float *oc = malloc(sizeof(float) * (size_t)T * s->nh * s->kvl), *od = malloc(sizeof(float) * (size_t)T * s->nh * s->kvl);
    for (size_t i = 0; i < (size_t)T * D; i++) lat[i] = frand() * 2.0f;
    for (size_t i = 0; i < (size_t)T * s->nh * D; i++) q[i] = frand() * 0.5f;
    bk_attn_meta hm = {T, pos, seq, bts, NSEQ, mask, NULL}, dm = hm;
    bk_tensor hl = bk_wrap_f32(lat, T, D), dl = dup(lat, T, D);
    KN_EXPECT(cpu->ops->mla_latent_write(cpu->ctx, &p->hk, &hm, &hl, s->kvl) == 0, "%s %s: CPU write", s->name, what);
    KN_EXPECT(dev->ops->meta_upload(dev->ctx, &dm) == 0, "%s %s: meta_upload", s->name, what);
    KN_EXPECT(dev->ops->mla_latent_write(dev->ctx, &p->dk, &dm, &dl, s->kvl) == 0, "%s %s: device write", s->name, what);
    if (attend) {
        bk_tensor hq = bk_wrap_f32(q, T, (int64_t)s->nh * D), ho = bk_wrap_f32(oc, T, (int64_t)s->nh * s->kvl);
        bk_tensor dq = dup(q, T, (int64_t)s->nh * D), dout = {0};
        bk_tensor_alloc(dev, BK_F32, T, (int64_t)s->nh * s->kvl, &dout);
        const float scale = 1.0f / sqrtf((float)(128 + s->r));
        KN_EXPECT(cpu->ops->mla_attention(cpu->ctx, &p->hk, &hm, &hq, s->nh, s->kvl, scale, &ho) == 0, "%s %s: CPU mla",
               s->name, what);
        KN_EXPECT(dev->ops->mla_attention(dev->ctx, &p->dk, &dm, &dq, s->nh, s->kvl, scale, &dout) == 0,
               "%s %s: device mla", s->name, what);
        /* refusals: an f32 plane; kv_lora_rank = the whole latent (no rope part) */
        bk_kv_layer f32k = p->dk;
        f32k.k = f32k.v = (float *)(void *)p->d, f32k.k16 = f32k.v16 = NULL;
        KN_EXPECT(dev->ops->mla_attention(dev->ctx, &f32k, &dm, &dq, s->nh, s->kvl, scale, &dout) == -1,
               "%s: an f32 plane must be refused", s->name);
        KN_EXPECT(dev->ops->mla_attention(dev->ctx, &p->dk, &dm, &dq, s->nh, D, scale, &dout) == -1,
               "%s: kv_lora_rank = latent width must be refused", s->name);
        const size_t n = (size_t)T * s->nh * s->kvl;
        KN_EXPECT(dev->ops->download(dev->ctx, od, dout.data, sizeof(float) * n) == 0, "%s %s: download", s->name, what);
        int nan = 0;
        for (size_t i = 0; i < n; i++) nan += isnan(od[i]) || isnan(oc[i]);
        const double e = kn_nmse(od, oc, n);
        KN_EXPECT(!nan, "%s %s: %d NaN values", s->name, what, nan);
        if (ON_FAKE)
            KN_EXPECT(!memcmp(od, oc, sizeof(float) * n), "%s %s: the fake device must give the CPU's bits", s->name, what);
        else
            KN_EXPECT(e <= NMSE_BOUND, "%s %s: NMSE %.3g > %.0e", s->name, what, e, NMSE_BOUND);
        printf("%s %s: T %d, mla_attention NMSE %.3g vs the CPU backend (bound %s)\n", s->name, what, T, e,
               ON_FAKE ? "bitwise" : "1e-8");
        bk_tensor_free(dev, &dq), bk_tensor_free(dev, &dout);
    }
    dev->ops->meta_release(dev->ctx, &dm);
    check_plane(p, what, s);
    bk_tensor_free(dev, &dl);
    free(lat), free(q), free(oc), free(od);
}

static void test_shape(const shape *s) {
    const int32_t D = s->kvl + s->r;
    planes p = {0};
    p.n = (size_t)NBLK * BS * D;
    p.h = calloc(p.n, 2);
    p.d = dev->ops->buf_alloc(dev->ctx, p.n * 2);
    KN_EXPECT(p.h && p.d, "%s: planes", s->name);
    if (!p.h || !p.d) return;
    p.hk = (bk_kv_layer){NULL, NULL, BS, 1, D, NBLK, p.h, p.h};
    p.dk = (bk_kv_layer){NULL, NULL, BS, 1, D, NBLK, p.d, p.d};
    /* prefill: sequences of 37, 130, 5 positions */
    static const int32_t ctx[NSEQ] = {37, 130, 5};
    int32_t pos[256], seq[256], T = 0;
    for (int32_t q = 0; q < NSEQ; q++)
        for (int32_t i = 0; i < ctx[q]; i++) pos[T] = i, seq[T++] = q;
    run(s, &p, "prefill", T, pos, seq, NULL, 1);
    /* mixed: a decode token, a 4-token verify, a 2-token chunk */
    T = 0;
    pos[T] = 37, seq[T++] = 0;
    for (int32_t i = 0; i < 4; i++) pos[T] = 130 + i, seq[T++] = 1;
    for (int32_t i = 0; i < 2; i++) pos[T] = 5 + i, seq[T++] = 2;
    run(s, &p, "decode+verify", T, pos, seq, NULL, 1);
    /* tree: sequence 0 at 38, then two siblings at 39 (the second must not see the first) */
    uint8_t mask[9] = {1, 0, 0, 1, 1, 0, 1, 0, 1};
    int32_t tp[3] = {38, 39, 39}, ts[3] = {0, 0, 0};
    run(s, &p, "tree", 3, tp, ts, mask, 1);
    dev->ops->buf_free(dev->ctx, p.d);
    free(p.h);
}

/* ------------------------------------------------------------ MoE */

typedef struct moe_case { const char *name; bk_moe_cfg cfg; int32_t H, I; int shared; } moe_case;

static uint16_t rand_scale(void) {
    const uint64_t r = (uint64_t)((frand() + 1.0f) * 1048576.0f);
    return (uint16_t)(((uint64_t)(119 + (r & 1)) << 7) | ((r >> 1) & 0x7f));
}
static bk_weight rand_i4(int64_t rows, int64_t cols) {
    uint32_t *w = malloc(sizeof(uint32_t) * (size_t)(rows * cols / 8));
    uint16_t *sc = malloc(sizeof(uint16_t) * (size_t)(rows * cols / 32));
    for (int64_t i = 0; i < rows * cols / 8; i++)
        w[i] = (uint32_t)((frand() + 1.0f) * 32768.0f) << 16 ^ (uint32_t)((frand() + 1.0f) * 32768.0f);
    for (int64_t i = 0; i < rows * cols / 32; i++) sc[i] = rand_scale();
    return (bk_weight){BK_W_I4G32, rows, cols, w, (size_t)cols / 2, sc};
}

/* moe_forward's definition on the host: routing, experts in ascending id, y += ye * w, + shared */
static void moe_ref(const moe_case *mc, const bk_weight *g, const bk_weight *u, const bk_weight *d, const float *logits,
                    const float *bias, const float *x, const float *shared, int32_t T, float *y) {
    const int32_t E = mc->cfg.E, k = mc->cfg.k, H = mc->H, I = mc->I;
    hf_config c = {0};
    c.n_routed_experts = E, c.n_experts_per_tok = k, c.n_group = mc->cfg.n_group, c.topk_group = mc->cfg.topk_group;
    c.norm_topk_prob = mc->cfg.norm_topk_prob, c.routed_scaling = mc->cfg.routed_scaling;
    float scr[2 * 64], w[64], gb[2 * 1024], ye[1024];
    int32_t ids[64];
    for (int32_t t = 0; t < T; t++) {
        dsv3_route(&c, logits + (size_t)t * E, bias, scr, ids, w);
        float *yt = y + (size_t)t * H;
        memset(yt, 0, sizeof(float) * (size_t)H);
        for (int32_t e = 0; e < E; e++)
            for (int32_t j = 0; j < k; j++) {
                if (ids[j] != e) continue;
                bk_matmul_f32(cpu, &g[e], x + (size_t)t * H, 1, gb);
                bk_matmul_f32(cpu, &u[e], x + (size_t)t * H, 1, gb + I);
                bk_tensor gt = bk_wrap_f32(gb, 1, I), ut = bk_wrap_f32(gb + I, 1, I);
                cpu->ops->silu_mul(cpu->ctx, &gt, &ut, &gt);
                bk_matmul_f32(cpu, &d[e], gb, 1, ye);
                for (int32_t i = 0; i < H; i++) yt[i] += ye[i] * w[j];
            }
        if (shared) {
            bk_tensor a = bk_wrap_f32(yt, 1, H), b = bk_wrap_f32((float *)shared + (size_t)t * H, 1, H);
            cpu->ops->add(cpu->ctx, &a, &b);
        }
    }
}

static void test_moe(const moe_case *mc) {
    const int32_t E = mc->cfg.E, H = mc->H, I = mc->I;
    bk_weight *g = calloc((size_t)E, sizeof *g), *u = calloc((size_t)E, sizeof *u), *d = calloc((size_t)E, sizeof *d);
    for (int32_t e = 0; e < E; e++) g[e] = rand_i4(I, H), u[e] = rand_i4(I, H), d[e] = rand_i4(H, I);
    bk_moe_experts ex;
    bk_weight bad = g[E - 1];
    bad.type = BK_W_BF16;
    g[E - 1] = bad;
    KN_EXPECT(dev->ops->moe_place(dev->ctx, E, g, u, d, &ex) == -1, "%s: a bf16 expert must be refused", mc->name);
    g[E - 1].type = BK_W_I4G32;
    KN_EXPECT(dev->ops->moe_place(dev->ctx, E, g, u, d, &ex) == 0, "%s: moe_place", mc->name);
    float bias[64];
    for (int32_t e = 0; e < E; e++) bias[e] = frand() * 0.1f;
    bk_tensor dbias = dup(bias, 1, E);
    static const int32_t Ts[] = {1, 5, 33};
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
        const int32_t T = Ts[ti];
        float *x = malloc(sizeof(float) * (size_t)T * H), *lg = malloc(sizeof(float) * (size_t)T * E);
        float *sh = malloc(sizeof(float) * (size_t)T * H), *yr = malloc(sizeof(float) * (size_t)T * H);
        float *yd = malloc(sizeof(float) * (size_t)T * H);
        for (size_t i = 0; i < (size_t)T * H; i++) x[i] = frand() * 1.7f, sh[i] = frand() * 0.05f;
        for (size_t i = 0; i < (size_t)T * E; i++) lg[i] = frand() * 3.0f;
        moe_ref(mc, g, u, d, lg, bias, x, mc->shared ? sh : NULL, T, yr);
        bk_tensor dx = dup(x, T, H), dl = dup(lg, T, E), ds = dup(sh, T, H), dy = {0};
        bk_tensor_alloc(dev, BK_F32, T, H, &dy);
        KN_EXPECT(dev->ops->moe(dev->ctx, &ex, &mc->cfg, &dl, &dbias, &dx, mc->shared ? &ds : NULL, &dy) == 0,
               "%s T %d: moe", mc->name, T);
        KN_EXPECT(dev->ops->download(dev->ctx, yd, dy.data, sizeof(float) * (size_t)T * H) == 0, "%s: download", mc->name);
        double mx = 0, md = 0;
        int nan = 0;
        for (size_t i = 0; i < (size_t)T * H; i++) {
            nan += isnan(yd[i]) || isnan(yr[i]);
            if (fabs(yr[i]) > mx) mx = fabs(yr[i]);
            if (fabs(yd[i] - yr[i]) > md) md = fabs(yd[i] - yr[i]);
        }
        const double e = kn_nmse(yd, yr, (size_t)T * H);
        KN_EXPECT(!nan && mx > 0, "%s T %d: %d NaN, max|y| %g", mc->name, T, nan, mx);
        if (ON_FAKE)
            KN_EXPECT(!memcmp(yd, yr, sizeof(float) * (size_t)T * H), "%s T %d: the fake device must give the reference's bits",
                   mc->name, T);
        else
            KN_EXPECT(e <= 1e-9 && md <= 1e-4 * mx, "%s T %d: NMSE %.3g (bound 1e-9), max diff %.3g of max|y| %.3g (bound 1e-4)",
                   mc->name, T, e, md, mx);
        printf("%s T %d: moe NMSE %.3g, max diff %.3g of max|y| %.3g vs the host reference (bound %s)\n", mc->name, T, e,
               md, mx, ON_FAKE ? "bitwise" : "1e-9 / 1e-4");
        bk_tensor_free(dev, &dx), bk_tensor_free(dev, &dl), bk_tensor_free(dev, &ds), bk_tensor_free(dev, &dy);
        free(x), free(lg), free(sh), free(yr), free(yd);
    }
    { /* a step beyond the backend's bounds (256 tokens) is refused, not grown into */
        const int32_t T = 257;
        bk_tensor dx = {0}, dl = {0}, dy = {0};
        bk_tensor_alloc(dev, BK_F32, T, H, &dx), bk_tensor_alloc(dev, BK_F32, T, E, &dl);
        bk_tensor_alloc(dev, BK_F32, T, H, &dy);
        KN_EXPECT(dev->ops->moe(dev->ctx, &ex, &mc->cfg, &dl, &dbias, &dx, NULL, &dy) == -1,
               "%s: a %d-token moe call beyond the backend's 256 tokens must be refused", mc->name, T);
        bk_tensor_free(dev, &dx), bk_tensor_free(dev, &dl), bk_tensor_free(dev, &dy);
    }
    bk_tensor_free(dev, &dbias);
    dev->ops->buf_free(dev->ctx, ex.w13), dev->ops->buf_free(dev->ctx, ex.s13);
    dev->ops->buf_free(dev->ctx, ex.w2), dev->ops->buf_free(dev->ctx, ex.s2);
    for (int32_t e = 0; e < E; e++) {
        bk_weight *w3[3] = {&g[e], &u[e], &d[e]};
        for (int j = 0; j < 3; j++) free((void *)w3[j]->data), free((void *)w3[j]->scales);
    }
    free(g), free(u), free(d);
}

int main(void) {
    kn_harness_require_gpu();
    for (int32_t q = 0; q < NSEQ; q++) { /* blocks scattered backwards over the pool */
        for (int32_t j = 0; j < NBLK / NSEQ; j++) bt_rows[q][j] = NBLK - 1 - (j * NSEQ + q);
        bts[q] = bt_rows[q];
    }
    cpu = bk_cpu_create(2);
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)256 << 20, .max_tokens = 256, .max_seqs = 4,
                      .max_len = 256, .block_size = BS, .max_heads = 8, .max_head_dim = 576,
                      .mla_kv_lora_rank = 512,
                      /* the MoE bounds: the largest of the two cases below (routing + workspace carved at create) */
                      .moe_experts = 16, .moe_top_k = 4, .moe_hidden = 256, .moe_inter = 64};
    specd_err err = {0};
    dev = bk_cuda_create(&o, &err);
    if (!cpu || !dev) {
        printf("FAIL: backends: %s\n", err.msg);
        return 1;
    }
    static const shape shapes[] = {{"kimi-tp8-rank", 8, 512, 64}, {"kimi-mini", 4, 32, 16}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) test_shape(&shapes[i]);
    static const moe_case moes[] = {
        {"moe-16x4-grouped", {16, 4, 4, 2, true, 2.5f}, 256, 64, 1},
        {"moe-8x2-plain", {8, 2, 1, 1, false, 1.0f}, 128, 32, 0},
    };
    for (size_t i = 0; i < sizeof moes / sizeof moes[0]; i++) test_moe(&moes[i]);
#if ON_FAKE
    KN_EXPECT(fake_violations == 0, "%d host pointers reached the fake kernels", fake_violations);
#endif
    bk_cuda_destroy(dev);
    bk_cpu_destroy(cpu);
    if (kn_fails) {
        printf("%d checks failed\n", kn_fails);
        return 1;
    }
    printf("OK\n");
    return 0;
}
