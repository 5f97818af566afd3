/*
 * kn_bench.c: device copy bandwidth and kn_matmul (the batch-invariant
 * GEMV) on a bf16 Llama-3.1-8B-shaped layer set, at batch 1..64. A benchmark
 * (tools/gpu_check.sh runs it), not a test: it asserts nothing.
 *
 *   kn_bench [--json PATH] [--iters N]
 *
 * Copy bandwidth: cudaMemcpyAsync device to device of a 1 GiB buffer,
 * counted as bytes read + bytes written (2 x size / time), the usual "copy
 * bandwidth" of a GPU. GEMV: per layer, weight bytes / time (activations are
 * < 0.1 % of the bytes at batch 1); "frac" = that / copy bandwidth. The
 * layers run back to back in model order, so every layer's weights have
 * been evicted from L2 by the 1 GiB lm_head before they are read again.
 * Times are CUDA events around each launch, mean over N iterations after
 * one warm-up. Weights are a random 32 MiB bf16 pattern replicated (values
 * do not matter to the speed). Exits 77 without a usable GPU.
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kn_linear.h"
#include "tests/kernels/kn_harness.h"
#include "tests/perf/kn_bench_util.h"


typedef struct layer {
    const char *name;
    int64_t rows, cols; /* bf16 [rows, cols] */
    void *w;
} layer;

static layer LAYERS[] = {
    {"q_proj", 4096, 4096, NULL},     {"k_proj", 1024, 4096, NULL},   {"v_proj", 1024, 4096, NULL},
    {"o_proj", 4096, 4096, NULL},     {"gate_proj", 14336, 4096, NULL}, {"up_proj", 14336, 4096, NULL},
    {"down_proj", 4096, 14336, NULL}, {"lm_head", 128256, 4096, NULL},
};
#define NL ((int)(sizeof LAYERS / sizeof LAYERS[0]))
static const int BATCHES[] = {1, 2, 4, 8, 16, 32, 64};
#define NB ((int)(sizeof BATCHES / sizeof BATCHES[0]))

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
    KN_CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    KN_CK(cudaEventCreate(&e0));
    KN_CK(cudaEventCreate(&e1));

    /* copy bandwidth (read + write), the reference for every fraction below */
    const double copy_gbps = kn_bench_copy_gbps(st, iters);
    printf("device: %s, %d SMs, L2 %d MiB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    printf("copy D2D (read + write): %.1f GB/s\n", copy_gbps);

    /* weights: a 32 MiB random bf16 pattern (|v| < 2^-4), replicated */
    const size_t pat_n = (size_t)16 << 20;
    uint16_t *pat = malloc(pat_n * 2);
    if (!pat) { fprintf(stderr, "out of memory\n"); return 1; }
    uint64_t s = 12345;
    for (size_t i = 0; i < pat_n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        pat[i] = (uint16_t)(((s >> 63) << 15) | ((uint64_t)(119 + (s >> 40) % 4) << 7) | ((s >> 20) & 0x7f));
    }
    void *dpat;
    KN_CK(cudaMalloc(&dpat, pat_n * 2));
    KN_CK(cudaMemcpy(dpat, pat, pat_n * 2, cudaMemcpyHostToDevice));
    free(pat);
    int64_t max_rows = 0, max_cols = 0;
    double set_bytes = 0;
    for (int l = 0; l < NL; l++) {
        const size_t bytes = (size_t)LAYERS[l].rows * LAYERS[l].cols * 2;
        KN_CK(cudaMalloc(&LAYERS[l].w, bytes));
        for (size_t off = 0; off < bytes; off += pat_n * 2)
            KN_CK(cudaMemcpyAsync((char *)LAYERS[l].w + off, dpat, bytes - off < pat_n * 2 ? bytes - off : pat_n * 2,
                               cudaMemcpyDeviceToDevice, st));
        if (LAYERS[l].rows > max_rows) max_rows = LAYERS[l].rows;
        if (LAYERS[l].cols > max_cols) max_cols = LAYERS[l].cols;
        set_bytes += (double)bytes;
    }
    KN_CK(cudaFree(dpat));
    const int bmax = BATCHES[NB - 1];
    float *dx, *dy;
    KN_CK(cudaMalloc((void **)&dx, (size_t)bmax * max_cols * 4));
    KN_CK(cudaMalloc((void **)&dy, (size_t)bmax * max_rows * 4));
    KN_CK(cudaMemsetAsync(dx, 0, (size_t)bmax * max_cols * 4, st)); /* zeros: the speed does not depend on values */
    cudaEvent_t ev[NL + 1];
    for (int l = 0; l <= NL; l++) KN_CK(cudaEventCreate(&ev[l]));

    FILE *jf = json ? fopen(json, "w") : NULL;
    if (json && !jf) { fprintf(stderr, "cannot write %s\n", json); return 1; }
    if (jf)
        fprintf(jf, "{\"device\": \"%s\", \"sms\": %d, \"copy_gbps\": %.1f, \"iters\": %d, \"gemv\": [", prop.name,
                prop.multiProcessorCount, copy_gbps, iters);
    printf("\nkn_matmul bf16, Llama-3.1-8B shapes: us per call, weight GB/s, fraction of copy bandwidth\n");
    printf("%-10s %7s %6s", "layer", "rows", "cols");
    for (int b = 0; b < NB; b++) printf(" |   b=%-2d us   GB/s frac", BATCHES[b]);
    printf("\n");
    double lt[NB][NL + 1];
    for (int b = 0; b < NB; b++) {
        const int T = BATCHES[b];
        double acc[NL] = {0};
        for (int it = -1; it < iters; it++) { /* it = -1: warm-up */
            KN_CK(cudaEventRecord(ev[0], st));
            for (int l = 0; l < NL; l++) {
                const kn_weight w = {KN_W_BF16, LAYERS[l].rows, LAYERS[l].cols, LAYERS[l].w, (size_t)LAYERS[l].cols * 2};
                KN_CK(kn_matmul(&w, dx, T, dy, st));
                KN_CK(cudaEventRecord(ev[l + 1], st));
            }
            KN_CK(cudaEventSynchronize(ev[NL]));
            for (int l = 0; l < NL && it >= 0; l++) {
                float m = 0;
                KN_CK(cudaEventElapsedTime(&m, ev[l], ev[l + 1]));
                acc[l] += m;
            }
        }
        double tot = 0;
        for (int l = 0; l < NL; l++) tot += (lt[b][l] = acc[l] / iters);
        lt[b][NL] = tot;
    }
    for (int l = 0; l <= NL; l++) {
        const double bytes = l < NL ? (double)LAYERS[l].rows * LAYERS[l].cols * 2 : set_bytes;
        printf("%-10s %7lld %6lld", l < NL ? LAYERS[l].name : "all", l < NL ? (long long)LAYERS[l].rows : 0LL,
               l < NL ? (long long)LAYERS[l].cols : 0LL);
        for (int b = 0; b < NB; b++) {
            const double gbps = bytes / (lt[b][l] * 1e-3) / 1e9;
            printf(" | %9.1f %6.0f %4.2f", lt[b][l] * 1e3, gbps, gbps / copy_gbps);
            if (jf)
                fprintf(jf, "%s{\"layer\": \"%s\", \"rows\": %lld, \"cols\": %lld, \"batch\": %d, \"us\": %.2f, \"gbps\": %.1f, \"frac_copy\": %.3f}",
                        l == 0 && b == 0 ? "" : ", ", l < NL ? LAYERS[l].name : "all",
                        l < NL ? (long long)LAYERS[l].rows : 0LL, l < NL ? (long long)LAYERS[l].cols : 0LL, BATCHES[b],
                        lt[b][l] * 1e3, gbps, gbps / copy_gbps);
        }
        printf("\n");
    }
    if (jf) {
        fprintf(jf, "]}\n");
        fclose(jf);
    }
    for (int l = 0; l < NL; l++) KN_CK(cudaFree(LAYERS[l].w));
    KN_CK(cudaFree(dx));
    KN_CK(cudaFree(dy));
    return 0;
}
