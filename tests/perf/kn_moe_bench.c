/*
 * kn_moe_bench.c: one Kimi-K2.5 MoE layer at a TP-8 rank's shape on the
 * device (kernels/kn_moe.h), at M = 1, 4, 16, 32 tokens. A benchmark
 * (tools/gpu_check.sh runs it), not a test: it asserts nothing.
 *
 *   kn_moe_bench [--json PATH] [--iters N]
 *
 * The layer, as one rank of 8 runs it (docs/kimi-k2.5.md budget; experts
 * split inside as engine/model/tp_shard.c does): hidden 7168; router
 * mlp.gate [384, 7168] bf16 (replicated) + correction bias; 384 routed
 * experts, top 8, n_group 1, each the rank's 256 of 2048 intermediate rows
 * (gate/up [256, 7168], down [7168, 256], int4 group 32 KN_I4IL + bf16
 * scales: 3.10 MB per expert); the shared expert's slice [256, 7168] x 2 +
 * [7168, 256] bf16. Per step: router kn_matmul, kn_moe_route, the shared
 * expert (3 kn_matmul + kn_silu_mul), kn_moe_experts (align, gate/up,
 * down, combine): 10 kernels; the all-reduce after it is not included.
 *
 * Weights are seeded on the device (a host-random 32 MiB pattern
 * replicated; scales a random pattern of bf16 values in [2^-8, 2^-6)), and
 * the router sees a fresh random x every iteration, so the routed experts
 * change every step like real decode. NL = 4 distinct layers are cycled
 * (4.8 GB): a layer's experts are not in the 60 MB L2 when it comes back
 * (one step at M = 1 touches 8 x 3.10 MB). Bytes read per step = router +
 * shared + the distinct experts chosen (counted from the step's ids) x 3.10
 * MB + x; GB/s = bytes / time; frac_copy = that / the measured D2D copy
 * bandwidth (read + write). Times: CUDA events, mean over N iterations after
 * a warm-up, for direct launches and for a CUDA graph of the step (the
 * decode form: launch overhead excluded). Exits 77 without a usable GPU.
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kn_linear.h"
#include "kernels/kn_moe.h"
#include "tests/kernels/kn_harness.h"
#include "tests/perf/kn_bench_util.h"


enum { H = 7168, I_TP = 256, E = 384, K = 8, IS_TP = 256, NL = 4, MMAX = 32 };
static const int MS[] = {1, 4, 16, 32};
#define NMS ((int)(sizeof MS / sizeof MS[0]))

typedef struct moe_layer {
    kn_moe_weights w;   /* device, KN_I4IL */
    void *router;       /* bf16 [E, H] */
    float *bias;        /* f32 [E] */
    void *sg, *su, *sd; /* bf16 [IS, H] x 2, [H, IS] */
} moe_layer;

static uint64_t g_s = 12345;
static uint64_t lcg(void) { return g_s = g_s * 6364136223846793005ull + 1442695040888963407ull; }

/* dst[bytes] = the pattern dpat[pat_bytes] repeated */
static void fill(void *dst, size_t bytes, const void *dpat, size_t pat_bytes, cudaStream_t st) {
    for (size_t off = 0; off < bytes; off += pat_bytes)
        KN_CK(cudaMemcpyAsync((char *)dst + off, dpat, bytes - off < pat_bytes ? bytes - off : pat_bytes,
                           cudaMemcpyDeviceToDevice, st));
}
static void *dalloc(size_t n) {
    void *p;
    KN_CK(cudaMalloc(&p, n));
    return p;
}

/* one step of the layer on dx [M, H] */
static void step(const moe_layer *L, const float *dx, int M, float *logits, int32_t *ids, float *w, float *g,
                 float *u, float *shared, void *ws, size_t ws_bytes, float *y, cudaStream_t st) {
    const kn_weight r = {KN_W_BF16, E, H, L->router, (size_t)H * 2};
    const kn_weight sg = {KN_W_BF16, IS_TP, H, L->sg, (size_t)H * 2}, su = {KN_W_BF16, IS_TP, H, L->su, (size_t)H * 2};
    const kn_weight sd = {KN_W_BF16, H, IS_TP, L->sd, (size_t)IS_TP * 2};
    const kn_moe_route_cfg cfg = {E, K, 1, 1, 1, 2.827f};
    KN_CK(kn_matmul(&r, dx, M, logits, st));
    KN_CK(kn_moe_route(logits, L->bias, M, &cfg, ids, w, st));
    KN_CK(kn_matmul(&sg, dx, M, g, st));
    KN_CK(kn_matmul(&su, dx, M, u, st));
    KN_CK(kn_silu_mul(g, u, (int64_t)M * IS_TP, g, st));
    KN_CK(kn_matmul(&sd, g, M, shared, st));
    KN_CK(kn_moe_experts(&L->w, dx, ids, w, M, K, shared, ws, ws_bytes, y, NULL, st));
}

int main(int argc, char **argv) {
    const char *json = NULL;
    int iters = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--json PATH] [--iters N]\n", argv[0]);
            return 2;
        }
    }
    if (iters < 1) iters = 1;
    kn_harness_require_gpu();
    struct cudaDeviceProp prop;
    KN_CK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t st;
    KN_CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1, e2;
    KN_CK(cudaEventCreate(&e0));
    KN_CK(cudaEventCreate(&e1));
    KN_CK(cudaEventCreate(&e2));

    /* copy bandwidth (read + write), the reference for every fraction below */
    const double copy_gbps = kn_bench_copy_gbps(st, iters);

    /* patterns: random words / bf16 weights (|v| < 2^-4) / bf16 scales in [2^-8, 2^-6) */
    const size_t pat = (size_t)32 << 20;
    uint32_t *hw = malloc(pat);
    uint16_t *hb = malloc(pat), *hs = malloc(pat);
    if (!hw || !hb || !hs) { fprintf(stderr, "out of memory\n"); return 1; }
    for (size_t i = 0; i < pat / 4; i++) hw[i] = (uint32_t)(lcg() >> 32);
    for (size_t i = 0; i < pat / 2; i++) {
        const uint64_t s = lcg();
        hb[i] = (uint16_t)(((s >> 63) << 15) | ((uint64_t)(119 + (s >> 40) % 4) << 7) | ((s >> 20) & 0x7f));
        hs[i] = (uint16_t)(((uint64_t)(119 + (s >> 44) % 2) << 7) | ((s >> 24) & 0x7f));
    }
    void *pw = dalloc(pat), *pb = dalloc(pat), *ps = dalloc(pat);
    KN_CK(cudaMemcpy(pw, hw, pat, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(pb, hb, pat, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(ps, hs, pat, cudaMemcpyHostToDevice));
    free(hw), free(hb), free(hs);
    moe_layer L[NL];
    const size_t b13 = kn_moe_w13_words(E, H, I_TP) * 4, bs13 = kn_moe_s13_count(E, H, I_TP) * 2;
    const size_t b2 = kn_moe_w2_words(E, H, I_TP) * 4, bs2 = kn_moe_s2_count(E, H, I_TP) * 2;
    const double expert_bytes = (double)(b13 + bs13 + b2 + bs2) / E;
    const double router_bytes = (double)E * H * 2 + E * 4, shared_bytes = 3.0 * IS_TP * H * 2;
    float *hbias = malloc(sizeof(float) * E);
    for (int e = 0; e < E; e++) hbias[e] = (float)((double)(lcg() >> 11) * 0x1.0p-53 * 0.02 - 0.01);
    for (int l = 0; l < NL; l++) {
        void *w13 = dalloc(b13), *s13 = dalloc(bs13), *w2 = dalloc(b2), *s2 = dalloc(bs2);
        fill(w13, b13, pw, pat, st), fill(s13, bs13, ps, pat, st), fill(w2, b2, pw, pat, st), fill(s2, bs2, ps, pat, st);
        L[l].w = (kn_moe_weights){E, H, I_TP, w13, s13, w2, s2, 0, 0};
        L[l].router = dalloc((size_t)E * H * 2);
        L[l].sg = dalloc((size_t)IS_TP * H * 2), L[l].su = dalloc((size_t)IS_TP * H * 2), L[l].sd = dalloc((size_t)H * IS_TP * 2);
        /* each layer its own slice of the pattern: different routers */
        KN_CK(cudaMemcpyAsync(L[l].router, (char *)pb + (size_t)l * (pat / NL / 2), (size_t)E * H * 2 < pat / 2 ? (size_t)E * H * 2 : pat / 2,
                           cudaMemcpyDeviceToDevice, st));
        fill(L[l].sg, (size_t)IS_TP * H * 2, pb, pat, st), fill(L[l].su, (size_t)IS_TP * H * 2, pb, pat, st);
        fill(L[l].sd, (size_t)H * IS_TP * 2, pb, pat, st);
        L[l].bias = dalloc(sizeof(float) * E);
        KN_CK(cudaMemcpy(L[l].bias, hbias, sizeof(float) * E, cudaMemcpyHostToDevice));
    }
    KN_CK(cudaFree(pw));
    KN_CK(cudaFree(pb));
    KN_CK(cudaFree(ps));
    free(hbias);
    /* activations: a fresh random x [MMAX, H] per iteration (N(0,1)-ish, like a normed hidden state) */
    const int nx = iters + 1;
    float *hx = malloc(sizeof(float) * (size_t)nx * MMAX * H);
    for (size_t i = 0; i < (size_t)nx * MMAX * H; i++)
        hx[i] = (float)((double)(lcg() >> 11) * 0x1.0p-53 * 3.4 - 1.7);
    float *dxs = dalloc(sizeof(float) * (size_t)nx * MMAX * H), *dx = dalloc(sizeof(float) * MMAX * H);
    KN_CK(cudaMemcpy(dxs, hx, sizeof(float) * (size_t)nx * MMAX * H, cudaMemcpyHostToDevice));
    free(hx);
    float *logits = dalloc(sizeof(float) * MMAX * E), *w = dalloc(sizeof(float) * MMAX * K);
    int32_t *ids = dalloc(sizeof(int32_t) * MMAX * K);
    float *g = dalloc(sizeof(float) * MMAX * IS_TP), *u = dalloc(sizeof(float) * MMAX * IS_TP);
    float *shared = dalloc(sizeof(float) * MMAX * H), *y = dalloc(sizeof(float) * MMAX * H);
    const size_t ws_bytes = kn_moe_workspace_bytes(MMAX, K, E, H, I_TP);
    void *ws = dalloc(ws_bytes);
    KN_CK(cudaStreamSynchronize(st));

    printf("device: %s, %d SMs, L2 %d MiB; copy D2D (read + write) %.1f GB/s\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20, copy_gbps);
    printf("Kimi-K2.5 MoE layer, TP-8 rank: H %d, experts %d x [%d | %d | %d] int4 g32 (%.2f MB each), top %d, shared "
           "[%d] bf16; %d layers cycled\n", H, E, I_TP, I_TP, I_TP, expert_bytes / 1e6, K, IS_TP, NL);
    FILE *jf = json ? fopen(json, "w") : NULL;
    if (json && !jf) { fprintf(stderr, "cannot write %s\n", json); return 1; }
    int32_t hids[MMAX * K];
    for (int mi = 0; mi < NMS; mi++) {
        const int M = MS[mi];
        double t_direct = 0, t_experts = 0, t_graph = 0, bytes = 0, distinct = 0;
        /* direct launches */
        for (int it = -1; it < iters; it++) {
            const moe_layer *Ly = &L[(it + 1) % NL];
            KN_CK(cudaMemcpyAsync(dx, dxs + (size_t)(it + 1) * MMAX * H, sizeof(float) * (size_t)M * H,
                               cudaMemcpyDeviceToDevice, st));
            KN_CK(cudaEventRecord(e0, st));
            step(Ly, dx, M, logits, ids, w, g, u, shared, ws, ws_bytes, y, st);
            KN_CK(cudaEventRecord(e2, st));
            KN_CK(cudaEventSynchronize(e2));
            if (it < 0) continue;
            float m = 0;
            KN_CK(cudaEventElapsedTime(&m, e0, e2));
            t_direct += m;
            KN_CK(cudaMemcpy(hids, ids, sizeof(int32_t) * (size_t)M * K, cudaMemcpyDeviceToHost));
            unsigned char seen[E] = {0};
            int nd = 0;
            for (int i = 0; i < M * K; i++)
                if (hids[i] >= 0 && hids[i] < E && !seen[hids[i]]) seen[hids[i]] = 1, nd++;
            distinct += nd;
            bytes += router_bytes + shared_bytes + nd * expert_bytes + (double)M * H * 4;
        }
        /* the experts alone (kn_moe_experts on the last routing), to split the time */
        for (int it = -1; it < iters; it++) {
            const moe_layer *Ly = &L[(it + 1) % NL];
            KN_CK(cudaEventRecord(e0, st));
            KN_CK(kn_moe_experts(&Ly->w, dx, ids, w, M, K, shared, ws, ws_bytes, y, NULL, st));
            KN_CK(cudaEventRecord(e1, st));
            KN_CK(cudaEventSynchronize(e1));
            float m = 0;
            KN_CK(cudaEventElapsedTime(&m, e0, e1));
            if (it >= 0) t_experts += m;
        }
        /* a CUDA graph per layer, replayed */
        cudaGraphExec_t ge[NL];
        for (int l = 0; l < NL; l++) {
            cudaGraph_t gr;
            KN_CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            step(&L[l], dx, M, logits, ids, w, g, u, shared, ws, ws_bytes, y, st);
            KN_CK(cudaStreamEndCapture(st, &gr));
            KN_CK(cudaGraphInstantiate(&ge[l], gr, 0));
            KN_CK(cudaGraphDestroy(gr));
        }
        for (int it = -1; it < iters; it++) {
            KN_CK(cudaMemcpyAsync(dx, dxs + (size_t)(it + 1) * MMAX * H, sizeof(float) * (size_t)M * H,
                               cudaMemcpyDeviceToDevice, st));
            KN_CK(cudaEventRecord(e0, st));
            KN_CK(cudaGraphLaunch(ge[(it + 1) % NL], st));
            KN_CK(cudaEventRecord(e1, st));
            KN_CK(cudaEventSynchronize(e1));
            float m = 0;
            KN_CK(cudaEventElapsedTime(&m, e0, e1));
            if (it >= 0) t_graph += m;
        }
        for (int l = 0; l < NL; l++) KN_CK(cudaGraphExecDestroy(ge[l]));
        const double us_d = t_direct / iters * 1e3, us_e = t_experts / iters * 1e3, us_g = t_graph / iters * 1e3;
        const double b = bytes / iters, gbps = b / (us_g * 1e-6) / 1e9;
        char line[768];
        snprintf(line, sizeof line,
                 "{\"bench\": \"kn_moe_layer\", \"model\": \"Kimi-K2.5\", \"tp\": 8, \"H\": %d, \"I\": %d, \"E\": %d, "
                 "\"top_k\": %d, \"shared_I\": %d, \"M\": %d, \"iters\": %d, \"kernels\": 10, \"us_layer\": %.2f, "
                 "\"us_layer_graph\": %.2f, \"us_experts\": %.2f, \"distinct_experts\": %.2f, \"bytes\": %.0f, "
                 "\"gbps\": %.1f, \"copy_gbps\": %.1f, \"frac_copy\": %.3f, \"device\": \"%s\"}",
                 H, I_TP, E, K, IS_TP, M, iters, us_d, us_g, us_e, distinct / iters, b, gbps, copy_gbps,
                 gbps / copy_gbps, prop.name);
        printf("%s\n", line);
        if (jf) fprintf(jf, "%s\n", line);
    }
    if (jf) fclose(jf);
    for (int l = 0; l < NL; l++) {
        void *d[] = {(void *)L[l].w.w13, (void *)L[l].w.s13, (void *)L[l].w.w2, (void *)L[l].w.s2, L[l].router,
                     L[l].bias, L[l].sg, L[l].su, L[l].sd};
        for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) KN_CK(cudaFree(d[i]));
    }
    void *d[] = {dxs, dx, logits, w, ids, g, u, shared, y, ws};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) KN_CK(cudaFree(d[i]));
    KN_CK(cudaStreamDestroy(st));
    return 0;
}
