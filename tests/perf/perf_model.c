/*
 * perf_model.c: target forward throughput at batch 1: prefill (one pass over
 * P tokens), decode (one token per step), and a verify-shaped step (k+1
 * tokens of one sequence in one pass), reported as wall tok/s and CPU ms per
 * step (CPU time is what to compare on a shared machine). Decode and verify
 * steps are interleaved and the median of decode_steps rounds is reported.
 *
 * Usage: perf_model MODEL.gguf [threads=2] [prompt_len=128] [decode_steps=64]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/model/model.h"

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double now(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s MODEL.gguf [threads] [prompt_len] [decode_steps]\n", argv[0]); return 2; }
    int threads = argc > 2 ? atoi(argv[2]) : 2, P = argc > 3 ? atoi(argv[3]) : 128, D = argc > 4 ? atoi(argv[4]) : 64;
    backend *be = bk_cpu_create(threads);
    if (!be) { fprintf(stderr, "bk_cpu_create failed\n"); return 1; }
    printf("backend: %s\n", bk_cpu_describe(be));
    model_load_opts o = {.block_size = 16, .n_blocks = (P + D + 64) / 16 + 2};
    model *m = NULL;
    specd_err err = {{0}};
    if (model_load(argv[1], be, &o, &m, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    const int V = model_get_config(m)->vocab, N = P + D + 16;
    int32_t *tok = malloc(sizeof(int32_t) * N), *pos = malloc(sizeof(int32_t) * N), *seq = calloc(N, sizeof(int32_t));
    int32_t *bt = malloc(sizeof(int32_t) * o.n_blocks), last = 0;
    float *logits = malloc(sizeof(float) * V * 8);
    for (int i = 0; i < o.n_blocks; i++) bt[i] = i;
    for (int i = 0; i < N; i++) { tok[i] = 100 + (i * 7919) % 40000; pos[i] = i; }
    const int32_t *bts[1] = {bt};
    model_batch b = {.n_tokens = P, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = bts,
                     .n_out = 1, .out_idx = &last, .logits = logits};
    last = P - 1;
    double w0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_PROCESS_CPUTIME_ID);
    if (model_forward(m, &b, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    double w1 = now(CLOCK_MONOTONIC), c1 = now(CLOCK_PROCESS_CPUTIME_ID);
    printf("prefill %d tokens: %.1f tok/s wall, %.2f ms CPU/token\n", P, P / (w1 - w0), 1e3 * (c1 - c0) / P);
    /* decode and verify-shaped steps, interleaved round by round so a noisy
     * neighbour slows all of them alike; each step timed alone, medians
     * reported (all at positions P.., rewriting the same KV slots) */
    enum { NSHAPE = 6 };
    const int shape_T[NSHAPE] = {1, 2, 3, 4, 5, 8};
    const int R = D;
    double *wall = malloc(sizeof(double) * NSHAPE * R), *cpu = malloc(sizeof(double) * NSHAPE * R);
    int32_t oi[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int r = 0; r < R; r++)
        for (int i = 0; i < NSHAPE; i++) {
            const int T = shape_T[i];
            model_batch v = {.n_tokens = T, .tokens = tok + P, .pos = pos + P, .seq_of = seq, .n_seqs = 1,
                             .block_tables = bts, .n_out = T, .out_idx = oi, .logits = logits};
            w0 = now(CLOCK_MONOTONIC); c0 = now(CLOCK_PROCESS_CPUTIME_ID);
            if (model_forward(m, &v, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
            wall[i * R + r] = 1e3 * (now(CLOCK_MONOTONIC) - w0);
            cpu[i * R + r] = 1e3 * (now(CLOCK_PROCESS_CPUTIME_ID) - c0);
        }
    double med_w[NSHAPE], med_c[NSHAPE];
    for (int i = 0; i < NSHAPE; i++) {
        qsort(wall + i * R, (size_t)R, sizeof(double), cmp_double);
        qsort(cpu + i * R, (size_t)R, sizeof(double), cmp_double);
        med_w[i] = wall[i * R + R / 2];
        med_c[i] = cpu[i * R + R / 2];
    }
    printf("decode (median of %d steps): %.1f tok/s wall (%.2f ms/step), %.2f ms CPU/step\n", R, 1e3 / med_w[0],
           med_w[0], med_c[0]);
    for (int i = 1; i < NSHAPE; i++)
        printf("verify k=%d (%d tokens, logits at all): %.2f ms wall = %.2fx a decode step; %.2f ms CPU = %.2fx\n",
               shape_T[i] - 1, shape_T[i], med_w[i], med_w[i] / med_w[0], med_c[i], med_c[i] / med_c[0]);
    free(wall);
    free(cpu);
    model_destroy(m);
    bk_cpu_destroy(be);
    free(tok); free(pos); free(seq); free(bt); free(logits);
    return 0;
}
