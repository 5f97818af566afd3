/*
 * test_kn_moe.c (kn_moe, label gpu): the MoE kernels of kernels/kn_moe.h
 * against the CPU path, on seeded experts in exactly the checkpoint's format
 * (compressed-tensors int4 words + bf16 group scales, repacked on the host by
 * kn_moe_pack_expert as a loader would) at two shapes: the Kimi miniature's
 * (H 128, moe_intermediate 64, 16 experts, top 4, 1 shared expert) and a Kimi
 * TP-8 rank's (H 7168, I 256 = 2048 / 8, top 8; 32 of the 384 experts, so
 * that the test's host memory stays small).
 *
 *  1. routing (kn_moe_route) vs dsv3_route on the same f32 logits, 4 configs
 *     (Kimi: 384 experts, 1 group; DeepSeek-V3: 256, 8 groups keep 4; 64, 4
 *     groups keep 1; 16 without normalisation), 96 tokens each incl. planted
 *     ties (equal logits inside and across groups, all-equal tokens, -inf from
 *     the group mask): expert ids EQUAL, in selection order; weights BITWISE
 *     equal on every token whose scores use only expf values that glibc
 *     rounds correctly (the host checks expf(x) == (float)exp((double)x) for
 *     each of the token's logits; the device computes the latter), else within
 *     8 ulp (relative 1e-6): the only difference is then one expf ulp.
 *  2. every expert value of both shapes dequantised on the device
 *     (kn_moe_dequant, the GEMM's own code) == the host's kn_i4il_dequant_row
 *     == the CPU backend's BK_W_I4G32 row (bk_weight_row_f32), bit for bit.
 *  3. the MoE block: routing + kn_moe_experts + the shared expert (kn_matmul
 *     bf16, kn_silu_mul) vs moe_forward's computation on the CPU backend
 *     (bk_matmul_f32 on the original compressed-tensors experts, silu_mul,
 *     the ascending-expert combine, + shared) at M in {1, 2, 3, 4, 5, 8, 16,
 *     33}. Bound, from the math (test_kn_linear.c's argument): each dot
 *     product differs only in the order of n f32 roundings, NMSE ~ n u^2 / 3
 *     <= 1e-11 for n = 7168, through silu and a second dot product and the
 *     sum of k + 1 terms; bound NMSE <= 1e-9. Per element the error is a
 *     random walk of ~sqrt(n) u of the partial sums, ~5e-6 of a typical |y|
 *     (a 4.5-sigma tail over 236k values ~1e-5 of max|y|): bound max|gpu -
 *     cpu| <= 1e-4 x max|cpu|. A wrong expert or slot gives NMSE ~ 1e-1.
 *  4. batch invariance, BITWISE: each token of a 33-token batch alone (T = 1)
 *     and in the reversed batch gives the same ids, weights and output row;
 *     a captured CUDA graph of the block replays to the same bits.
 *  5. refusals: bad shapes return cudaErrorInvalidValue; an expert id out of
 *     range or repeated makes that token's row NaN and raises the flag while
 *     the other tokens keep their bits.
 *  6. expert parallelism (kn_moe_weights.e0 / E_route): at N = 2 and 4 each
 *     rank's E/N experts (a contiguous sub-array of the packed layer) on the
 *     global routing ids of 33 tokens, no shared expert: == the CPU's sum over
 *     the chosen experts in [e0, e0 + E/N) only (bounds of 3); a token with
 *     none of them gives exactly 0; no flag for other ranks' ids; an id >=
 *     E_route still NaN + flag; e0 + E > E_route refused. The ranks' partials
 *     summed in rank order within the bounds of 3 of the whole layer's output.
 * Exits 77 without a usable GPU (kn_harness_require_gpu).
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/backend/backend.h"
#include "engine/model/deepseek_v3.h"
#include "kernels/kn_linear.h"
#include "kernels/kn_moe.h"
#include "tests/kernels/kn_harness.h"

static backend *g_cpu;



static const double NMSE_MOE = 1e-9, MAXREL_MOE = 1e-4, W_REL = 1e-6;
static const int32_t MS[] = {1, 2, 3, 4, 5, 8, 16, 33};
#define NM ((int)(sizeof MS / sizeof MS[0]))
#define TMAX 33

/* ------------------------------------------------------------ helpers */

static uint64_t g_rng = 0x5eed0019ull;
static uint64_t rng_u64(void) { /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_unif(void) { return (float)((double)(rng_u64() >> 11) * 0x1.0p-53 * 2.0 - 1.0); } /* [-1, 1) */
static float rng_normalish(void) { return rng_unif() + rng_unif() + rng_unif(); }            /* var 1 */

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of memory (%zu bytes)\n", n); exit(1); }
    return p;
}
static void *dev_alloc(size_t n) {
    void *p = NULL;
    KN_CK(cudaMalloc(&p, n ? n : 1));
    return p;
}
static void *dev_upload(const void *h, size_t n) {
    void *d = dev_alloc(n);
    KN_CK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    return d;
}
static void dev_download(void *h, const void *d, size_t n) {
    KN_CK(cudaDeviceSynchronize());
    KN_CK(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost));
}
static uint32_t f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static uint16_t f32_to_bf16(float f) { uint32_t b = f32_bits(f); b += 0x7fffu + ((b >> 16) & 1u); return (uint16_t)(b >> 16); }

/* -------------------------------------------------------------- routing */

/* the token's scores take only correctly rounded expf values (then the device's must be bitwise equal) */
static int expf_exact(const float *l, int E) {
    for (int e = 0; e < E; e++)
        if (f32_bits(expf(-l[e])) != f32_bits((float)exp(-(double)l[e]))) return 0;
    return 1;
}

static void route_case(const char *name, int E, int k, int G, int tg, int norm, float scaling) {
    const int T = 96;
    hf_config hc;
    memset(&hc, 0, sizeof hc);
    hc.n_routed_experts = E, hc.n_experts_per_tok = k, hc.n_group = G, hc.topk_group = tg;
    hc.routed_scaling = scaling, hc.norm_topk_prob = norm;
    float *lg = xmalloc(sizeof(float) * (size_t)T * E), *bias = xmalloc(sizeof(float) * (size_t)E);
    for (int e = 0; e < E; e++) bias[e] = 0.1f * rng_normalish() - (e % 4 == 1 ? 0.5f : 0.f);
    for (int t = 0; t < T; t++) {
        float *l = lg + (size_t)t * E;
        for (int e = 0; e < E; e++) l[e] = 2.0f * rng_normalish();
        if (t % 8 == 1) /* ties: pairs of experts with equal logits and (below) equal biases */
            for (int e = 0; e + 1 < E; e += 2) l[e + 1] = l[e];
        if (t % 8 == 2) for (int e = 0; e < E; e++) l[e] = 0.25f; /* everything equal but the bias */
        if (t % 8 == 3) /* one group's members equal to another's: equal group scores */
            for (int e = 0; e < E / G && G > 1; e++) l[(G - 1) * (E / G) + e] = l[e];
    }
    float *bias_t = xmalloc(sizeof(float) * (size_t)E); /* tie tokens need equal biases too */
    memcpy(bias_t, bias, sizeof(float) * (size_t)E);
    for (int e = 0; e + 1 < E; e += 2) bias_t[e + 1] = bias_t[e];
    for (int e = 0; e < E / G && G > 1; e++) bias_t[(G - 1) * (E / G) + e] = bias_t[e];
    for (int pass = 0; pass < 2; pass++) { /* 0: random bias; 1: biases tied like the planted logits */
        const float *b = pass ? bias_t : bias;
        float *db = dev_upload(b, sizeof(float) * (size_t)E), *dl = dev_upload(lg, sizeof(float) * (size_t)T * E);
        int32_t *dids = dev_alloc(sizeof(int32_t) * (size_t)T * k);
        float *dw = dev_alloc(sizeof(float) * (size_t)T * k);
        const kn_moe_route_cfg cfg = {E, k, G, tg, norm, scaling};
        KN_CK(kn_moe_route(dl, db, T, &cfg, dids, dw, NULL));
        int32_t *gids = xmalloc(sizeof(int32_t) * (size_t)T * k), cids[64];
        float *gw = xmalloc(sizeof(float) * (size_t)T * k), cw[64], *scr = xmalloc(sizeof(float) * 2 * (size_t)E);
        dev_download(gids, dids, sizeof(int32_t) * (size_t)T * k);
        dev_download(gw, dw, sizeof(float) * (size_t)T * k);
        int n_bit = 0, n_exact_tok = 0, ids_bad = 0;
        double worst = 0;
        for (int t = 0; t < T; t++) {
            dsv3_route(&hc, lg + (size_t)t * E, b, scr, cids, cw);
            const int exact = expf_exact(lg + (size_t)t * E, E);
            n_exact_tok += exact;
            for (int j = 0; j < k; j++) {
                const int32_t gi = gids[(size_t)t * k + j];
                const float gv = gw[(size_t)t * k + j];
                if (gi != cids[j]) ids_bad++;
                const double rel = fabs((double)gv - cw[j]) / fmax(fabs((double)cw[j]), 1e-30);
                worst = fmax(worst, rel);
                n_bit += f32_bits(gv) == f32_bits(cw[j]);
                if (exact) KN_EXPECT(f32_bits(gv) == f32_bits(cw[j]), "%s token %d slot %d: weight %.9g vs CPU %.9g (expf exact)",
                                  name, t, j, gv, cw[j]);
                else KN_EXPECT(rel <= W_REL, "%s token %d slot %d: weight %.9g vs CPU %.9g", name, t, j, gv, cw[j]);
            }
        }
        KN_EXPECT(ids_bad == 0, "%s: %d expert ids differ from dsv3_route", name, ids_bad);
        printf("route %-10s bias %d: %d tokens x %d: ids identical to dsv3_route (%s), weights bitwise %d/%d "
               "(%d tokens with only correctly rounded expf), worst rel %.2e (bound %.0e)\n", name, pass, T, k,
               ids_bad ? "NO" : "yes", n_bit, T * k, n_exact_tok, worst, W_REL);
        KN_CK(cudaFree(db)); KN_CK(cudaFree(dl)); KN_CK(cudaFree(dids)); KN_CK(cudaFree(dw));
        free(gids), free(gw), free(scr);
    }
    /* refusals */
    const kn_moe_route_cfg bad[] = {{E, 0, G, tg, norm, scaling}, {E, E + 1, G, tg, norm, scaling},
                                    {E, k, 3, 1, norm, scaling}, {E, k, G, G + 1, norm, scaling}, {0, 1, 1, 1, 0, 1.f}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (bad[i].n_group == 3 && E % 3 == 0) continue;
        KN_EXPECT(kn_moe_route((const float *)16, (const float *)16, 1, &bad[i], (int32_t *)16, (float *)16, NULL) ==
                   (int)cudaErrorInvalidValue, "%s: bad config %zu not refused", name, i);
    }
    free(lg), free(bias), free(bias_t);
}

static void test_route(void) {
    route_case("kimi", 384, 8, 1, 1, 1, 2.827f);
    route_case("dsv3", 256, 8, 8, 4, 1, 2.5f);
    route_case("g4k1", 64, 6, 4, 1, 1, 1.0f);
    route_case("nonorm", 16, 4, 1, 1, 0, 1.5f);
}

/* --------------------------------------------------------- the MoE layer */

typedef struct layer {
    int32_t E, H, I, k, Is;
    /* host, compressed-tensors (the CPU path) */
    uint32_t **gw, **uw, **dw;   /* [E] of [I, H/8], [I, H/8], [H, I/8] */
    uint16_t **gs, **us, **ds;   /* their scales */
    uint16_t *sg, *su, *sd;      /* shared expert bf16 [Is, H], [Is, H], [H, Is] */
    float *bias;                 /* [E] */
    hf_config hc;
    /* device */
    kn_moe_weights dw_;          /* KN_I4IL */
    void *d13, *ds13, *d2, *ds2, *dsg, *dsu, *dsd;
    float *dbias;
} layer;

static uint32_t *rand_words(size_t n) {
    uint32_t *w = xmalloc(n * 4);
    for (size_t i = 0; i < n; i++) w[i] = (uint32_t)rng_u64();
    return w;
}
/* group scales as compressed-tensors' quantizer makes them for weights of std 1/sqrt(fan_in): max|w| / 7.5 */
static uint16_t *rand_scales(size_t n, int fan_in) {
    uint16_t *s = xmalloc(n * 2);
    for (size_t i = 0; i < n; i++) s[i] = f32_to_bf16((float)(2.5 / sqrt((double)fan_in) / 7.5 * (1.0 + 0.5 * rng_unif())));
    return s;
}
static uint16_t *rand_bf16(size_t n, int fan_in) {
    uint16_t *s = xmalloc(n * 2);
    for (size_t i = 0; i < n; i++) s[i] = f32_to_bf16(rng_normalish() / (float)sqrt((double)fan_in));
    return s;
}

static void layer_create(layer *L, int32_t E, int32_t H, int32_t I, int32_t k, int32_t G, int32_t tg) {
    memset(L, 0, sizeof *L);
    L->E = E, L->H = H, L->I = I, L->k = k, L->Is = I;
    L->hc.n_routed_experts = E, L->hc.n_experts_per_tok = k, L->hc.n_group = G, L->hc.topk_group = tg;
    L->hc.routed_scaling = 2.827f, L->hc.norm_topk_prob = true;
    L->gw = xmalloc(sizeof(void *) * (size_t)E), L->uw = xmalloc(sizeof(void *) * (size_t)E);
    L->dw = xmalloc(sizeof(void *) * (size_t)E), L->gs = xmalloc(sizeof(void *) * (size_t)E);
    L->us = xmalloc(sizeof(void *) * (size_t)E), L->ds = xmalloc(sizeof(void *) * (size_t)E);
    const size_t n13 = kn_moe_w13_words(E, H, I), ns13 = kn_moe_s13_count(E, H, I);
    const size_t n2 = kn_moe_w2_words(E, H, I), ns2 = kn_moe_s2_count(E, H, I);
    uint32_t *w13 = xmalloc(n13 * 4), *w2 = xmalloc(n2 * 4);
    uint16_t *s13 = xmalloc(ns13 * 2), *s2 = xmalloc(ns2 * 2);
    for (int e = 0; e < E; e++) {
        L->gw[e] = rand_words((size_t)I * H / 8), L->uw[e] = rand_words((size_t)I * H / 8);
        L->dw[e] = rand_words((size_t)H * I / 8);
        L->gs[e] = rand_scales((size_t)I * H / 32, H), L->us[e] = rand_scales((size_t)I * H / 32, H);
        L->ds[e] = rand_scales((size_t)H * I / 32, I);
        if (kn_moe_pack_expert(E, H, I, e, L->gw[e], L->gs[e], L->uw[e], L->us[e], L->dw[e], L->ds[e], w13, s13, w2,
                               s2)) {
            fprintf(stderr, "kn_moe_pack_expert failed\n");
            exit(1);
        }
    }
    L->sg = rand_bf16((size_t)L->Is * H, H), L->su = rand_bf16((size_t)L->Is * H, H);
    L->sd = rand_bf16((size_t)H * L->Is, L->Is);
    L->bias = xmalloc(sizeof(float) * (size_t)E);
    for (int e = 0; e < E; e++) L->bias[e] = 0.1f * rng_normalish();
    L->d13 = dev_upload(w13, n13 * 4), L->ds13 = dev_upload(s13, ns13 * 2);
    L->d2 = dev_upload(w2, n2 * 4), L->ds2 = dev_upload(s2, ns2 * 2);
    L->dsg = dev_upload(L->sg, (size_t)L->Is * H * 2), L->dsu = dev_upload(L->su, (size_t)L->Is * H * 2);
    L->dsd = dev_upload(L->sd, (size_t)H * L->Is * 2);
    L->dbias = dev_upload(L->bias, sizeof(float) * (size_t)E);
    L->dw_ = (kn_moe_weights){E, H, I, L->d13, L->ds13, L->d2, L->ds2, 0, 0}; /* all E experts */
    free(w13), free(w2), free(s13), free(s2);
}

static void layer_destroy(layer *L) {
    for (int e = 0; e < L->E; e++) free(L->gw[e]), free(L->uw[e]), free(L->dw[e]), free(L->gs[e]), free(L->us[e]), free(L->ds[e]);
    free(L->gw), free(L->uw), free(L->dw), free(L->gs), free(L->us), free(L->ds);
    free(L->sg), free(L->su), free(L->sd), free(L->bias);
    void *d[] = {L->d13, L->ds13, L->d2, L->ds2, L->dsg, L->dsu, L->dsd, L->dbias};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) KN_CK(cudaFree(d[i]));
}

static bk_weight i4w(const uint32_t *w, const uint16_t *s, int64_t rows, int64_t cols) {
    return (bk_weight){.type = BK_W_I4G32, .rows = rows, .cols = cols, .data = w, .row_bytes = (size_t)cols / 2, .scales = s};
}
static bk_weight bf16w(const uint16_t *w, int64_t rows, int64_t cols) {
    return (bk_weight){.type = BK_W_BF16, .rows = rows, .cols = cols, .data = w, .row_bytes = (size_t)cols * 2};
}

/* every value of every expert: device dequant == host dequant of the repacked form == CPU backend */
static void check_dequant(const layer *L, const char *name) {
    const int32_t H = L->H, I = L->I;
    size_t n = 0, bad_host = 0, bad_dev = 0;
    uint16_t *dev = xmalloc((size_t)2 * I * H * 2), *host = xmalloc((size_t)(H > I ? H : I) * 2);
    uint16_t *dbuf = dev_alloc((size_t)2 * I * H * 2);
    float *ref = xmalloc(sizeof(float) * (size_t)(H > I ? H : I));
    uint32_t *il = xmalloc((size_t)2 * I * H / 2);
    for (int e = 0; e < L->E; e++) {
        for (int which = 0; which < 2; which++) {
            const int64_t rows = which ? H : 2 * (int64_t)I, cols = which ? I : H;
            KN_CK(kn_moe_dequant(&L->dw_, e, which, dbuf, NULL));
            dev_download(dev, dbuf, (size_t)rows * cols * 2);
            for (int64_t r = 0; r < rows; r++) {
                const uint32_t *w = which ? L->dw[e] : r < I ? L->gw[e] : L->uw[e];
                const uint16_t *s = which ? L->ds[e] : r < I ? L->gs[e] : L->us[e];
                const int64_t rr = which ? r : r % I;
                bk_weight bw = i4w(w, s, which ? H : I, cols);
                bk_weight_row_f32(&bw, rr, ref);
                kn_i4_repack(w + rr * (cols / 8), 1, cols, il);
                kn_i4il_dequant_row(il, s + rr * (cols / 32), cols, 0, host);
                for (int64_t c = 0; c < cols; c++, n++) {
                    const int bh = f32_bits(ref[c]) != (uint32_t)host[c] << 16, bd = host[c] != dev[r * cols + c];
                    if ((bh || bd) && bad_host + bad_dev < 4)
                        printf("  %s expert %d %s row %lld col %lld: CPU %08x host %04x device %04x\n", name, e,
                               which ? "w2" : "w13", (long long)r, (long long)c, f32_bits(ref[c]), host[c],
                               dev[r * cols + c]);
                    bad_host += bh;
                    bad_dev += bd;
                }
            }
        }
    }
    KN_EXPECT(bad_host == 0 && bad_dev == 0, "%s: dequant: %zu host / %zu device values differ of %zu", name, bad_host,
           bad_dev, n);
    printf("dequant %-5s: %zu expert values, device == host repacked == CPU backend (I4G32): %s\n", name, n,
           bad_host || bad_dev ? "NO" : "bit-identical");
    free(dev), free(host), free(ref), free(il);
    KN_CK(cudaFree(dbuf));
}

/* moe_forward (engine/model/deepseek_v3_fwd.c) on the CPU backend, for T tokens x [T, H]: routing from
 * the logits, experts in ascending id each on its tokens, y += ye * w, then + shared. */
static void cpu_moe(const layer *L, const float *x, const float *logits, int32_t T, float *y, int32_t *ids_out,
                    float *w_out) {
    const int32_t H = L->H, I = L->I, E = L->E, k = L->k;
    float *scr = xmalloc(sizeof(float) * 2 * (size_t)E), *xe = xmalloc(sizeof(float) * (size_t)T * H);
    float *g = xmalloc(sizeof(float) * (size_t)T * I), *u = xmalloc(sizeof(float) * (size_t)T * I);
    float *ye = xmalloc(sizeof(float) * (size_t)T * H), *wl = xmalloc(sizeof(float) * (size_t)T);
    int32_t *tl = xmalloc(sizeof(int32_t) * (size_t)T);
    for (int32_t t = 0; t < T; t++)
        dsv3_route(&L->hc, logits + (size_t)t * E, L->bias, scr, ids_out + (size_t)t * k, w_out + (size_t)t * k);
    memset(y, 0, sizeof(float) * (size_t)T * H);
    for (int32_t e = 0; e < E; e++) {
        int32_t nt = 0;
        for (int32_t t = 0; t < T; t++)
            for (int32_t j = 0; j < k; j++)
                if (ids_out[(size_t)t * k + j] == e) { tl[nt] = t; wl[nt++] = w_out[(size_t)t * k + j]; }
        if (!nt) continue;
        for (int32_t i = 0; i < nt; i++) memcpy(xe + (size_t)i * H, x + (size_t)tl[i] * H, sizeof(float) * H);
        bk_weight gw = i4w(L->gw[e], L->gs[e], I, H), uw = i4w(L->uw[e], L->us[e], I, H), dw = i4w(L->dw[e], L->ds[e], H, I);
        KN_CK(bk_matmul_f32(g_cpu, &gw, xe, nt, g));
        KN_CK(bk_matmul_f32(g_cpu, &uw, xe, nt, u));
        bk_tensor gt = bk_wrap_f32(g, nt, I), ut = bk_wrap_f32(u, nt, I);
        g_cpu->ops->silu_mul(g_cpu->ctx, &gt, &ut, &gt);
        KN_CK(bk_matmul_f32(g_cpu, &dw, g, nt, ye));
        for (int32_t i = 0; i < nt; i++)
            for (int32_t d = 0; d < H; d++) y[(size_t)tl[i] * H + d] += ye[(size_t)i * H + d] * wl[i];
    }
    bk_weight sg = bf16w(L->sg, L->Is, H), su = bf16w(L->su, L->Is, H), sd = bf16w(L->sd, H, L->Is);
    KN_CK(bk_matmul_f32(g_cpu, &sg, x, T, g));
    KN_CK(bk_matmul_f32(g_cpu, &su, x, T, u));
    bk_tensor gt = bk_wrap_f32(g, T, L->Is), ut = bk_wrap_f32(u, T, L->Is);
    g_cpu->ops->silu_mul(g_cpu->ctx, &gt, &ut, &gt);
    KN_CK(bk_matmul_f32(g_cpu, &sd, g, T, ye));
    bk_tensor yt = bk_wrap_f32(y, T, H), st = bk_wrap_f32(ye, T, H);
    g_cpu->ops->add(g_cpu->ctx, &yt, &st);
    free(scr), free(xe), free(g), free(u), free(ye), free(wl), free(tl);
}

/* The CPU's partial routed sum of expert parallelism: y[T, H] = sum over the chosen experts in [e0, e0 + ne)
 * (ids / w [T, k] given), ascending, y += ye * w; no shared expert (deepseek_v3_fwd.c moe_forward's loop). */
static void cpu_moe_part(const layer *L, const float *x, const int32_t *ids, const float *w, int32_t T, int32_t e0,
                         int32_t ne, float *y) {
    const int32_t H = L->H, I = L->I, k = L->k;
    float *xe = xmalloc(sizeof(float) * (size_t)T * H), *g = xmalloc(sizeof(float) * (size_t)T * I);
    float *u = xmalloc(sizeof(float) * (size_t)T * I), *ye = xmalloc(sizeof(float) * (size_t)T * H);
    float *wl = xmalloc(sizeof(float) * (size_t)T);
    int32_t *tl = xmalloc(sizeof(int32_t) * (size_t)T);
    memset(y, 0, sizeof(float) * (size_t)T * H);
    for (int32_t e = e0; e < e0 + ne; e++) {
        int32_t nt = 0;
        for (int32_t t = 0; t < T; t++)
            for (int32_t j = 0; j < k; j++)
                if (ids[(size_t)t * k + j] == e) { tl[nt] = t; wl[nt++] = w[(size_t)t * k + j]; }
        if (!nt) continue;
        for (int32_t i = 0; i < nt; i++) memcpy(xe + (size_t)i * H, x + (size_t)tl[i] * H, sizeof(float) * H);
        bk_weight gw = i4w(L->gw[e], L->gs[e], I, H), uw = i4w(L->uw[e], L->us[e], I, H), dw = i4w(L->dw[e], L->ds[e], H, I);
        KN_CK(bk_matmul_f32(g_cpu, &gw, xe, nt, g));
        KN_CK(bk_matmul_f32(g_cpu, &uw, xe, nt, u));
        bk_tensor gt = bk_wrap_f32(g, nt, I), ut = bk_wrap_f32(u, nt, I);
        g_cpu->ops->silu_mul(g_cpu->ctx, &gt, &ut, &gt);
        KN_CK(bk_matmul_f32(g_cpu, &dw, g, nt, ye));
        for (int32_t i = 0; i < nt; i++)
            for (int32_t d = 0; d < H; d++) y[(size_t)tl[i] * H + d] += ye[(size_t)i * H + d] * wl[i];
    }
    free(xe), free(g), free(u), free(ye), free(wl), free(tl);
}

/* device buffers of one block run at up to TMAX tokens */
typedef struct run_bufs {
    float *x, *logits, *w, *g, *u, *shared, *y;
    int32_t *ids, *flag;
    void *ws;
    size_t ws_bytes;
} run_bufs;

static void bufs_create(run_bufs *b, const layer *L) {
    b->x = dev_alloc(sizeof(float) * TMAX * L->H), b->logits = dev_alloc(sizeof(float) * TMAX * L->E);
    b->w = dev_alloc(sizeof(float) * TMAX * L->k), b->ids = dev_alloc(sizeof(int32_t) * TMAX * L->k);
    b->g = dev_alloc(sizeof(float) * TMAX * L->Is), b->u = dev_alloc(sizeof(float) * TMAX * L->Is);
    b->shared = dev_alloc(sizeof(float) * TMAX * L->H), b->y = dev_alloc(sizeof(float) * TMAX * L->H);
    b->flag = dev_alloc(sizeof(int32_t));
    b->ws_bytes = kn_moe_workspace_bytes(TMAX, L->k, L->E, L->H, L->I);
    b->ws = dev_alloc(b->ws_bytes);
}
static void bufs_destroy(run_bufs *b) {
    void *d[] = {b->x, b->logits, b->w, b->ids, b->g, b->u, b->shared, b->y, b->flag, b->ws};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) KN_CK(cudaFree(d[i]));
}

/* the device block on b->x / b->logits (already uploaded) for T tokens: route, shared expert, experts */
static void gpu_moe_enqueue(const layer *L, run_bufs *b, int32_t T, void *st) {
    const kn_moe_route_cfg cfg = {L->E, L->k, L->hc.n_group, L->hc.topk_group, 1, L->hc.routed_scaling};
    KN_CK(kn_moe_route(b->logits, L->dbias, T, &cfg, b->ids, b->w, st));
    kn_weight sg = {KN_W_BF16, L->Is, L->H, L->dsg, (size_t)L->H * 2}, su = {KN_W_BF16, L->Is, L->H, L->dsu, (size_t)L->H * 2};
    kn_weight sd = {KN_W_BF16, L->H, L->Is, L->dsd, (size_t)L->Is * 2};
    KN_CK(kn_matmul(&sg, b->x, T, b->g, st));
    KN_CK(kn_matmul(&su, b->x, T, b->u, st));
    KN_CK(kn_silu_mul(b->g, b->u, (int64_t)T * L->Is, b->g, st));
    KN_CK(kn_matmul(&sd, b->g, T, b->shared, st));
    KN_CK(kn_moe_experts(&L->dw_, b->x, b->ids, b->w, T, L->k, b->shared, b->ws, b->ws_bytes, b->y, b->flag, st));
}

static void gpu_moe(const layer *L, run_bufs *b, const float *x, const float *logits, int32_t T, float *y,
                    int32_t *ids, float *w) {
    KN_CK(cudaMemcpy(b->x, x, sizeof(float) * (size_t)T * L->H, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(b->logits, logits, sizeof(float) * (size_t)T * L->E, cudaMemcpyHostToDevice));
    gpu_moe_enqueue(L, b, T, NULL);
    dev_download(y, b->y, sizeof(float) * (size_t)T * L->H);
    if (ids) dev_download(ids, b->ids, sizeof(int32_t) * (size_t)T * L->k);
    if (w) dev_download(w, b->w, sizeof(float) * (size_t)T * L->k);
}

static void test_layer(const char *name, int32_t E, int32_t H, int32_t I, int32_t k, int32_t G, int32_t tg) {
    layer L;
    layer_create(&L, E, H, I, k, G, tg);
    check_dequant(&L, name);
    run_bufs b;
    bufs_create(&b, &L);
    KN_CK(cudaMemset(b.flag, 0, sizeof(int32_t)));
    float *x = xmalloc(sizeof(float) * TMAX * H), *lg = xmalloc(sizeof(float) * TMAX * E);
    for (size_t i = 0; i < (size_t)TMAX * H; i++) x[i] = rng_normalish();
    for (size_t i = 0; i < (size_t)TMAX * E; i++) lg[i] = 2.0f * rng_normalish();
    float *yc = xmalloc(sizeof(float) * TMAX * H), *yg = xmalloc(sizeof(float) * TMAX * H);
    float *wc = xmalloc(sizeof(float) * TMAX * k), *wg = xmalloc(sizeof(float) * TMAX * k);
    int32_t *ic = xmalloc(sizeof(int32_t) * TMAX * k), *ig = xmalloc(sizeof(int32_t) * TMAX * k);
    /* 3. against the CPU path at every M */
    for (int mi = 0; mi < NM; mi++) {
        const int32_t T = MS[mi];
        cpu_moe(&L, x, lg, T, yc, ic, wc);
        gpu_moe(&L, &b, x, lg, T, yg, ig, wg);
        KN_EXPECT(!memcmp(ic, ig, sizeof(int32_t) * (size_t)T * k), "%s M=%d: routing ids differ", name, T);
        double mx = 0, md = 0;
        for (size_t i = 0; i < (size_t)T * H; i++) mx = fmax(mx, fabs(yc[i])), md = fmax(md, fabs((double)yg[i] - yc[i]));
        const double e = kn_nmse(yg, yc, (size_t)T * H);
        KN_EXPECT(e <= NMSE_MOE && md <= MAXREL_MOE * mx, "%s M=%d: NMSE %.3e (bound %.0e), max err %.3e of %.3e", name, T,
               e, NMSE_MOE, md, mx);
        printf("moe %-5s M=%2d: NMSE %.2e (bound %.0e), max|gpu-cpu| %.2e of max|y| %.3g (bound %.0e rel)\n", name, T,
               e, NMSE_MOE, md, mx, MAXREL_MOE);
    }
    /* 4. batch invariance: the 33-token batch's rows vs each token alone and vs the reversed batch */
    float *yb = xmalloc(sizeof(float) * TMAX * H), *y1 = xmalloc(sizeof(float) * H);
    float *xr = xmalloc(sizeof(float) * TMAX * H), *lr = xmalloc(sizeof(float) * TMAX * E);
    int32_t *ib = xmalloc(sizeof(int32_t) * TMAX * k), i1[64];
    float *wb = xmalloc(sizeof(float) * TMAX * k), w1[64];
    gpu_moe(&L, &b, x, lg, TMAX, yb, ib, wb);
    int diff_alone = 0, diff_rev = 0;
    for (int t = 0; t < TMAX; t++) {
        gpu_moe(&L, &b, x + (size_t)t * H, lg + (size_t)t * E, 1, y1, i1, w1);
        diff_alone += memcmp(y1, yb + (size_t)t * H, sizeof(float) * H) != 0 ||
                      memcmp(i1, ib + (size_t)t * k, sizeof(int32_t) * k) != 0 || memcmp(w1, wb + (size_t)t * k, sizeof(float) * k) != 0;
        memcpy(xr + (size_t)(TMAX - 1 - t) * H, x + (size_t)t * H, sizeof(float) * H);
        memcpy(lr + (size_t)(TMAX - 1 - t) * E, lg + (size_t)t * E, sizeof(float) * E);
    }
    gpu_moe(&L, &b, xr, lr, TMAX, yg, NULL, NULL);
    for (int t = 0; t < TMAX; t++) diff_rev += memcmp(yg + (size_t)(TMAX - 1 - t) * H, yb + (size_t)t * H, sizeof(float) * H) != 0;
    KN_EXPECT(diff_alone == 0 && diff_rev == 0, "%s: batch invariance: %d tokens differ alone, %d reversed", name,
           diff_alone, diff_rev);
    printf("moe %-5s: batch invariance: %d tokens alone == in the 33-token batch == reversed: %s\n", name, TMAX,
           diff_alone || diff_rev ? "NO" : "bitwise");
    /* a CUDA graph of the whole block replays to the same bits */
    cudaStream_t st;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    KN_CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    KN_CK(cudaMemcpy(b.x, x, sizeof(float) * TMAX * H, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(b.logits, lg, sizeof(float) * TMAX * E, cudaMemcpyHostToDevice));
    KN_CK(cudaMemset(b.y, 0, sizeof(float) * TMAX * H));
    KN_CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    gpu_moe_enqueue(&L, &b, TMAX, st);
    KN_CK(cudaStreamEndCapture(st, &graph));
    KN_CK(cudaGraphInstantiate(&exec, graph, 0));
    KN_CK(cudaGraphLaunch(exec, st));
    KN_CK(cudaStreamSynchronize(st));
    dev_download(yg, b.y, sizeof(float) * TMAX * H);
    KN_EXPECT(!memcmp(yg, yb, sizeof(float) * TMAX * H), "%s: graph replay differs from direct launches", name);
    KN_CK(cudaGraphExecDestroy(exec));
    KN_CK(cudaGraphDestroy(graph));
    KN_CK(cudaStreamDestroy(st));
    int32_t flag = -1;
    dev_download(&flag, b.flag, sizeof flag);
    KN_EXPECT(flag == 0, "%s: bad-id flag raised on valid routing", name);
    /* 5. invalid ids: token 1 gets an id out of range, token 2 a repeated id; token 0 keeps its bits */
    int32_t *bid = xmalloc(sizeof(int32_t) * 3 * (size_t)k);
    memcpy(bid, ib, sizeof(int32_t) * 3 * (size_t)k);
    bid[k + 1] = E;
    bid[2 * k + 1] = bid[2 * k];
    KN_CK(cudaMemcpy(b.ids, bid, sizeof(int32_t) * 3 * (size_t)k, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(b.w, wb, sizeof(float) * 3 * (size_t)k, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(b.x, x, sizeof(float) * 3 * H, cudaMemcpyHostToDevice));
    KN_CK(cudaMemset(b.flag, 0, sizeof(int32_t)));
    KN_CK(kn_moe_experts(&L.dw_, b.x, b.ids, b.w, 3, k, NULL, b.ws, b.ws_bytes, b.y, b.flag, NULL));
    dev_download(yg, b.y, sizeof(float) * 3 * H);
    dev_download(&flag, b.flag, sizeof flag);
    int nan1 = 1, nan2 = 1;
    for (int d = 0; d < H; d++) nan1 &= isnan(yg[H + d]), nan2 &= isnan(yg[2 * H + d]);
    KN_EXPECT(flag == 1 && nan1 && nan2, "%s: invalid ids: flag %d, rows NaN %d %d", name, flag, nan1, nan2);
    KN_CK(kn_moe_experts(&L.dw_, b.x, b.ids, b.w, 1, k, NULL, b.ws, b.ws_bytes, b.y + H, NULL, NULL));
    dev_download(y1, b.y + H, sizeof(float) * H);
    KN_EXPECT(!memcmp(y1, yg, sizeof(float) * H), "%s: a valid token changed next to invalid ones", name);
    /* refusals: bad shapes and buffers, before any launch */
    kn_moe_weights bw = L.dw_;
    bw.I = 48;
    KN_EXPECT(kn_moe_experts(&bw, b.x, b.ids, b.w, 1, k, NULL, b.ws, b.ws_bytes, b.y, NULL, NULL) == (int)cudaErrorInvalidValue,
           "%s: I = 48 not refused", name);
    KN_EXPECT(kn_moe_experts(&L.dw_, b.x, b.ids, b.w, 1, k, NULL, b.ws, 16, b.y, NULL, NULL) == (int)cudaErrorInvalidValue,
           "%s: small workspace not refused", name);
    KN_EXPECT(kn_moe_experts(&L.dw_, b.x + 1, b.ids, b.w, 1, k, NULL, b.ws, b.ws_bytes, b.y, NULL, NULL) ==
               (int)cudaErrorInvalidValue, "%s: misaligned x not refused", name);
    KN_EXPECT(kn_moe_experts(&L.dw_, b.x, b.ids, b.w, 1, E + 1, NULL, b.ws, b.ws_bytes, b.y, NULL, NULL) ==
               (int)cudaErrorInvalidValue, "%s: k > E not refused", name);
    KN_EXPECT(kn_moe_dequant(&L.dw_, E, 0, (uint16_t *)b.y, NULL) == (int)cudaErrorInvalidValue, "%s: expert E not refused", name);
    KN_EXPECT(kn_moe_experts(&L.dw_, b.x, b.ids, b.w, 65536, k, NULL, b.ws, (size_t)-1, b.y, NULL, NULL) ==
               (int)cudaErrorInvalidValue, "%s: T = 65536 not refused", name);
    free(bid), free(x), free(lg), free(yc), free(yg), free(wc), free(wg), free(ic), free(ig), free(yb), free(y1);
    free(xr), free(lr), free(ib), free(wb);
    bufs_destroy(&b);
    layer_destroy(&L);
}

/* 6. expert parallelism: rank r of N runs experts [r E/N, (r+1) E/N) of the layer (header). */
static void test_ep(const char *name, int32_t E, int32_t H, int32_t I, int32_t k) {
    layer L;
    layer_create(&L, E, H, I, k, 1, 1);
    run_bufs b;
    bufs_create(&b, &L);
    float *x = xmalloc(sizeof(float) * TMAX * H), *lg = xmalloc(sizeof(float) * TMAX * E);
    for (size_t i = 0; i < (size_t)TMAX * H; i++) x[i] = rng_normalish();
    for (size_t i = 0; i < (size_t)TMAX * E; i++) lg[i] = 2.0f * rng_normalish();
    float *w = xmalloc(sizeof(float) * TMAX * k), *yc = xmalloc(sizeof(float) * TMAX * H);
    float *yg = xmalloc(sizeof(float) * TMAX * H), *sum = xmalloc(sizeof(float) * TMAX * H);
    float *whole = xmalloc(sizeof(float) * TMAX * H);
    int32_t *ids = xmalloc(sizeof(int32_t) * TMAX * k);
    /* the global routing on the device, as every rank computes it */
    const kn_moe_route_cfg cfg = {E, k, 1, 1, 1, L.hc.routed_scaling};
    KN_CK(cudaMemcpy(b.x, x, sizeof(float) * TMAX * H, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(b.logits, lg, sizeof(float) * TMAX * E, cudaMemcpyHostToDevice));
    KN_CK(kn_moe_route(b.logits, L.dbias, TMAX, &cfg, b.ids, b.w, NULL));
    dev_download(ids, b.ids, sizeof(int32_t) * TMAX * k);
    dev_download(w, b.w, sizeof(float) * TMAX * k);
    KN_CK(kn_moe_experts(&L.dw_, b.x, b.ids, b.w, TMAX, k, NULL, b.ws, b.ws_bytes, b.y, NULL, NULL));
    dev_download(whole, b.y, sizeof(float) * TMAX * H);
    double wmx = 0;
    for (size_t i = 0; i < (size_t)TMAX * H; i++) wmx = fmax(wmx, fabs(whole[i]));
    const size_t w13 = (size_t)2 * I * (H / 8), s13 = (size_t)2 * I * (H / 32), w2 = (size_t)H * (I / 8),
                 s2 = (size_t)H * (I / 32); /* one expert's words / scales */
    for (int N = 2; N <= 4; N *= 2) {
        memset(sum, 0, sizeof(float) * TMAX * H);
        int zero_rows = 0, zero_bad = 0;
        for (int r = 0; r < N; r++) {
            const int32_t ne = E / N, e0 = r * ne;
            kn_moe_weights pw = {ne, H, I, (const uint32_t *)L.d13 + (size_t)e0 * w13,
                                 (const uint16_t *)L.ds13 + (size_t)e0 * s13, (const uint32_t *)L.d2 + (size_t)e0 * w2,
                                 (const uint16_t *)L.ds2 + (size_t)e0 * s2, e0, E};
            KN_CK(cudaMemset(b.flag, 0, sizeof(int32_t)));
            KN_CK(kn_moe_experts(&pw, b.x, b.ids, b.w, TMAX, k, NULL, b.ws, b.ws_bytes, b.y, b.flag, NULL));
            dev_download(yg, b.y, sizeof(float) * TMAX * H);
            int32_t flag = -1;
            dev_download(&flag, b.flag, sizeof flag);
            cpu_moe_part(&L, x, ids, w, TMAX, e0, ne, yc);
            double mx = 0, md = 0;
            for (size_t i = 0; i < (size_t)TMAX * H; i++) mx = fmax(mx, fabs(yc[i])), md = fmax(md, fabs((double)yg[i] - yc[i]));
            const double e = kn_nmse(yg, yc, (size_t)TMAX * H);
            for (int t = 0; t < TMAX; t++) {
                int mine = 0;
                for (int j = 0; j < k; j++) mine += ids[(size_t)t * k + j] >= e0 && ids[(size_t)t * k + j] < e0 + ne;
                if (mine) continue;
                zero_rows++;
                for (int d = 0; d < H; d++) zero_bad += yg[(size_t)t * H + d] != 0.0f || signbit(yg[(size_t)t * H + d]);
            }
            KN_EXPECT(flag == 0 && e <= NMSE_MOE && md <= MAXREL_MOE * mx,
                      "%s EP %d rank %d: flag %d, NMSE %.3e (bound %.0e), max err %.3e of %.3e", name, N, r, flag, e,
                      NMSE_MOE, md, mx);
            for (size_t i = 0; i < (size_t)TMAX * H; i++) sum[i] += yg[i];
            printf("moe %-5s EP %d rank %d (experts %d..%d): NMSE %.2e, max|gpu-cpu| %.2e of max|y| %.3g\n", name, N,
                   r, e0, e0 + ne - 1, e, md, mx);
        }
        KN_EXPECT(zero_bad == 0, "%s EP %d: %d values of tokens without a local expert are not +0", name, N, zero_bad);
        double md = 0;
        for (size_t i = 0; i < (size_t)TMAX * H; i++) md = fmax(md, fabs((double)sum[i] - whole[i]));
        const double e = kn_nmse(sum, whole, (size_t)TMAX * H);
        KN_EXPECT(e <= NMSE_MOE && md <= MAXREL_MOE * wmx, "%s EP %d: ranks' sum vs the whole layer: NMSE %.3e, %.3e of %.3e",
                  name, N, e, md, wmx);
        printf("moe %-5s EP %d: %d (token, rank) rows with no local expert exactly 0; the %d ranks' sum vs the whole "
               "layer: NMSE %.2e, max %.2e of %.3g\n", name, N, zero_rows, N, e, md, wmx);
    }
    /* an id past E_route is still refused (NaN + flag); a range past E_route is refused before any launch */
    kn_moe_weights pw = {E / 2, H, I, L.d13, L.ds13, L.d2, L.ds2, 0, E};
    int32_t bid[64];
    memcpy(bid, ids, sizeof(int32_t) * (size_t)k);
    bid[0] = E;
    KN_CK(cudaMemcpy(b.ids, bid, sizeof(int32_t) * (size_t)k, cudaMemcpyHostToDevice));
    KN_CK(cudaMemset(b.flag, 0, sizeof(int32_t)));
    KN_CK(kn_moe_experts(&pw, b.x, b.ids, b.w, 1, k, NULL, b.ws, b.ws_bytes, b.y, b.flag, NULL));
    int32_t flag = 0;
    dev_download(&flag, b.flag, sizeof flag);
    dev_download(yg, b.y, sizeof(float) * H);
    KN_EXPECT(flag == 1 && isnan(yg[0]), "%s EP: an id >= E_route: flag %d, y %g", name, flag, (double)yg[0]);
    pw.e0 = E / 2 + 1;
    KN_EXPECT(kn_moe_experts(&pw, b.x, b.ids, b.w, 1, k, NULL, b.ws, b.ws_bytes, b.y, NULL, NULL) ==
                  (int)cudaErrorInvalidValue, "%s EP: e0 + E > E_route not refused", name);
    free(x), free(lg), free(w), free(yc), free(yg), free(sum), free(whole), free(ids);
    bufs_destroy(&b);
    layer_destroy(&L);
}

int main(void) {
    kn_harness_require_gpu();
    g_cpu = bk_cpu_create((int)sysconf(_SC_NPROCESSORS_ONLN));
    if (!g_cpu) { fprintf(stderr, "bk_cpu_create failed\n"); return 1; }
    printf("reference: %s\n", bk_cpu_describe(g_cpu));
    test_route();
    test_layer("mini", 16, 128, 64, 4, 1, 1);  /* the Kimi miniature's MoE shape */
    test_layer("tp8", 32, 7168, 256, 8, 1, 1); /* a Kimi TP-8 rank's expert slices (32 of 384 experts) */
    test_layer("g4", 64, 256, 64, 6, 4, 2);    /* group limits through the whole block */
    test_ep("mini", 16, 128, 64, 4);           /* expert parallelism on the miniature's shape */
    test_ep("ep8", 16, 512, 2048, 8);          /* whole experts of Kimi's width 2048 (H and E smaller: emulation time) */
    bk_cpu_destroy(g_cpu);
    printf("%s: %d checks, %d failed\n", kn_fails ? "FAIL" : "ok", kn_checks, kn_fails);
    return kn_fails ? 1 : 0;
}
