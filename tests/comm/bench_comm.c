/*
 * bench_comm.c: all-reduce latency of the shared-memory communicator per
 * message size and world size (not a ctest test; figures in docs/engine.md).
 *
 *   comm_bench [--worlds 2,4,8] [--iters 2000] [--mode auto|oneshot|twoshot] [--spin-us N]
 *
 * Every rank runs the same back-to-back loop of all-reduces (as the 123 per
 * Kimi decode step are); rank 0 times each call; the median and 90th
 * percentile over --iters calls (after 100 warm-up calls) are printed with
 * the algorithm bandwidth (message bytes / median time). Sizes: 14, 57, 115,
 * 230 and 460 KB (Kimi's 7168-wide bf16 hidden state at batch 1, 4, 8, 16,
 * 32; on the CPU backend the activations are f32, so those bytes are half the
 * batch). Results first checked against the rank-order sum (comm_suite.h).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/comm/ranks.h"
#include "tests/comm/comm_suite.h"

static const size_t SIZES[] = {14336, 57344, 114688, 229376, 458752};
#define NSIZES (sizeof SIZES / sizeof *SIZES)
#define WARMUP 100

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Every rank: correctness once, then the timed loop. t: [iters] per-call µs (rank 0). */
static int bench_loop(comm *c, size_t bytes, int iters, double *t) {
    size_t n = bytes / sizeof(float);
    float *buf = malloc(bytes), *ref = malloc(bytes);
    specd_err e = {{0}};
    int rc = 0;
    ref_sum(ref, 3 + n, comm_world(c), n);
    for (size_t i = 0; i < n; i++) buf[i] = gen_f(3 + n, comm_rank(c), i);
    if (comm_all_reduce_sum_f32(c, buf, n, &e) || memcmp(buf, ref, bytes) != 0) {
        fprintf(stderr, "rank %d: %zu B: %s\n", comm_rank(c), bytes, e.msg[0] ? e.msg : "result differs from the rank-order sum");
        rc = -1;
        goto out;
    }
    for (int it = -WARMUP; it < iters; it++) {
        double t0 = now_us();
        if (comm_all_reduce_sum_f32(c, buf, n, &e)) {
            fprintf(stderr, "rank %d: %s\n", comm_rank(c), e.msg);
            rc = -1;
            goto out;
        }
        if (it >= 0 && t) t[it] = now_us() - t0;
    }
out:
    free(buf);
    free(ref);
    return rc;
}

static int parse_args(int argc, char **argv, int *worlds, int *nworlds, int *iters, size_t *oneshot, int *spin) {
    *nworlds = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--worlds") && i + 1 < argc) {
            char *s = argv[++i];
            for (char *tok = strtok(s, ","); tok && *nworlds < 8; tok = strtok(NULL, ",")) worlds[(*nworlds)++] = atoi(tok);
        } else if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
            *iters = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--mode") && i + 1 < argc) {
            const char *m = argv[++i];
            *oneshot = !strcmp(m, "oneshot") ? SIZE_MAX : !strcmp(m, "twoshot") ? 1 : 0;
        } else if (!strcmp(argv[i], "--spin-us") && i + 1 < argc) {
            *spin = atoi(argv[++i]);
        } else if (!strncmp(argv[i], "--specd-comm-", 13) || !strncmp(argv[i], "--bench-", 8)) {
            continue;
        } else {
            fprintf(stderr, "usage: %s [--worlds 2,4,8] [--iters N] [--mode auto|oneshot|twoshot] [--spin-us N]\n",
                    argv[0]);
            return -1;
        }
    }
    if (*nworlds == 0) {
        worlds[0] = 2, worlds[1] = 4, worlds[2] = 8;
        *nworlds = 3;
    }
    return 0;
}

int main(int argc, char **argv) {
    ranks_worker w;
    specd_err e = {{0}};
    int wk = ranks_worker_detect(argc, argv, &w, &e);
    if (wk < 0) {
        fprintf(stderr, "%s\n", e.msg);
        return 2;
    }
    int iters = 2000;
    if (wk == 1) {
        comm *c = NULL;
        if (ranks_worker_attach(&w, &c, &e)) return 2;
        for (int i = 1; i < argc; i++)
            if (!strncmp(argv[i], "--bench-iters=", 14)) iters = atoi(argv[i] + 14);
        for (size_t k = 0; k < NSIZES; k++)
            if (bench_loop(c, SIZES[k], iters, NULL)) return 3;
        uint8_t b[16];
        size_t n;
        comm_step_kind kind;
        comm_step_recv(c, b, sizeof b, &n, &kind, 0, &e);
        comm_destroy(c);
        return 0;
    }
    int worlds[8], nworlds, spin = -1;
    size_t oneshot = 0;
    if (parse_args(argc, argv, worlds, &nworlds, &iters, &oneshot, &spin)) return 2;
    char a_iters[48];
    snprintf(a_iters, sizeof a_iters, "--bench-iters=%d", iters);
    const char *wargv[] = {argv[0], a_iters, NULL};
    double *t = malloc((size_t)iters * sizeof *t);
    printf("%-6s %-9s %-8s %12s %12s %10s\n", "world", "bytes", "mode", "median_us", "p90_us", "GB/s");
    for (int wi = 0; wi < nworlds; wi++) {
        ranks_config cfg = {.world = worlds[wi], .worker_argv = wargv, .comm = comm_config_default()};
        cfg.comm.oneshot_max_bytes = oneshot;
        cfg.comm.spin_us = spin;
        ranks *rk = NULL;
        if (ranks_launch(&cfg, &rk, &e)) {
            fprintf(stderr, "%s\n", e.msg);
            return 1;
        }
        for (size_t k = 0; k < NSIZES; k++) {
            if (bench_loop(ranks_comm(rk), SIZES[k], iters, t)) return 1;
            qsort(t, (size_t)iters, sizeof *t, cmp_d);
            double med = t[iters / 2], p90 = t[iters * 9 / 10];
            const char *mode = oneshot == SIZE_MAX ? "oneshot" : oneshot == 1 ? "twoshot" : "auto";
            printf("%-6d %-9zu %-8s %12.1f %12.1f %10.2f\n", worlds[wi], SIZES[k], mode, med, p90,
                   (double)SIZES[k] / med / 1e3);
            fflush(stdout);
        }
        if (ranks_shutdown(rk, 10000, &e)) fprintf(stderr, "%s\n", e.msg);
        ranks_destroy(rk);
    }
    free(t);
    return 0;
}
