/*
 * mm_bench.c: CPU time of one bk_matmul_f32 over a random Q4_1 / Q8_0 weight
 * of ROWS x COLS at T = 1..5 tokens, the weight either small enough to stay in
 * L1/L2 (ROWS small: the kernels' instruction cost) or larger than the last
 * level cache (the cost a model step sees, weights streamed from memory).
 * Reports ns per row and block pair (64 columns) and the weight bytes per
 * second. A measuring tool, not a ctest test (docs/engine.md, "Where a decode
 * step goes").
 *
 * Usage: mm_bench q4_1|q8_0 ROWS COLS THREADS REPEATS [T ...]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/backend/backend.h"

static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "usage: %s q4_1|q8_0 ROWS COLS THREADS REPEATS [T ...]\n", argv[0]); return 2; }
    const int q8 = !strcmp(argv[1], "q8_0");
    const int64_t rows = atoll(argv[2]), cols = atoll(argv[3]);
    const int threads = atoi(argv[4]), reps = atoi(argv[5]);
    if (rows < 1 || cols < 32 || cols % 64 || threads < 1 || reps < 1) { fprintf(stderr, "bad arguments\n"); return 2; }
    const size_t bs = q8 ? 34 : 20, rb = (size_t)(cols / 32) * bs;
    uint8_t *w = malloc(rb * (size_t)rows);
    float *x = malloc(sizeof(float) * 8 * (size_t)cols), *y = malloc(sizeof(float) * 8 * (size_t)rows);
    if (!w || !x || !y) { fprintf(stderr, "out of memory\n"); return 1; }
    uint64_t s = 88172645463325252ull;
    for (size_t i = 0; i < rb * (size_t)rows; i++) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; w[i] = (uint8_t)s; }
    for (size_t b = 0; b < (size_t)rows * (size_t)(cols / 32); b++) { /* fp16 scales of magnitude ~2^-6 */
        w[b * bs] = 0; w[b * bs + 1] = 0x24;
        if (!q8) { w[b * bs + 2] = 0; w[b * bs + 3] = 0xa4; }
    }
    for (int64_t i = 0; i < 8 * cols; i++) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; x[i] = (float)(s % 2001) / 1000.0f - 1.0f; }
    backend *be = bk_cpu_create(threads);
    if (!be) return 1;
    const bk_weight wt = {q8 ? BK_W_Q8_0 : BK_W_Q4_1, rows, cols, w, rb, NULL};
    printf("%s %lld x %lld (%.1f MB), %d threads, %s\n", argv[1], (long long)rows, (long long)cols,
           1e-6 * (double)(rb * (size_t)rows), threads, bk_cpu_describe(be));
    for (int a = 6; a < argc || a == 6; a++) {
        const int T = a < argc ? atoi(argv[a]) : 1;
        if (T < 1 || T > 8) continue;
        bk_matmul_f32(be, &wt, x, T, y); /* warm */
        const double t0 = cpu_s();
        for (int r = 0; r < reps; r++) bk_matmul_f32(be, &wt, x, T, y);
        const double dt = (cpu_s() - t0) / reps;
        printf("T=%d  %8.3f ms CPU per matmul  %6.2f ns per row and block pair  %5.2f GB/s\n", T, 1e3 * dt,
               1e9 * dt / ((double)rows * (double)(cols / 64)), 1e-9 * (double)(rb * (size_t)rows) / dt);
    }
    bk_cpu_destroy(be);
    free(w); free(x); free(y);
    return 0;
}
