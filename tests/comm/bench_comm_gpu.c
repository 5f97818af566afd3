/*
 * bench_comm_gpu.c: all-reduce latency of cuda_ipc vs NCCL on ONE GPU, K rank
 * processes (not a ctest test; tools/gpu_check.sh runs it; exits 77 without a
 * usable GPU).
 *
 *   comm_gpu_bench [--worlds 2,4,8] [--iters 200] [--nccl-iters 30] [--json FILE] [--no-nccl]
 *
 * For each world K: K processes (this binary re-executed through
 * ranks_launch), all on GPU 0. Per message size (14, 57, 115, 230, 460 KB:
 * Kimi's 7168-wide bf16 hidden state at batch 1, 4, 8, 16, 32, sent here as
 * f32 counts of those bytes), every rank first checks one result against the
 * rank-order f32 sum (comm_suite.h), then runs warm-up calls and the timed
 * loop; rank 0 times each call from launch to stream completion (launch +
 * comm_cuda_ipc_sync / cudaStreamSynchronize) and prints one JSON line:
 *   {"bench": "comm_gpu", "impl": "cuda_ipc" | "nccl", "world": K, "bytes": B,
 *    "algo": "auto|one-shot|two-shot" (cuda_ipc), "iters": N, "median_us": ..,
 *    "p10_us": .., "p90_us": ..}
 * (also appended to --json FILE). cuda_ipc runs with the automatic algorithm
 * and with each forced one.
 *
 * Caveat, stated in every run's first line: K processes on one GPU time-share
 * it (no MPS); a collective cannot finish before every rank's kernel has run,
 * so the figures measure context switching as much as the collective, and say
 * nothing about K GPUs. NCCL runs with a distinct NCCL_HOSTID per process
 * (GPU-NOTES section 1: NCCL refuses two ranks on one GPU otherwise), i.e.
 * over sockets on loopback: a function check with a latency, not NCCL's
 * NVLink speed.
 */
#define _GNU_SOURCE
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/comm/comm_cuda_ipc.h"
#include "engine/comm/comm_nccl.h"
#include "engine/comm/ranks.h"
#include "tests/comm/comm_suite.h"
#include "tests/kernels/kn_harness.h"

static const size_t SIZES[] = {14336, 57344, 114688, 229376, 458752};
#define NSIZES (sizeof SIZES / sizeof *SIZES)
#define WARMUP 20

typedef struct opts {
    int worlds[8], nworlds, iters, nccl_iters, nccl;
    const char *json;
} opts;

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define CUDA_OK(call)                                                                                      \
    do {                                                                                                   \
        cudaError_t rc_ = (call);                                                                          \
        if (rc_ != cudaSuccess) {                                                                          \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(rc_));        \
            return -1;                                                                                     \
        }                                                                                                  \
    } while (0)

static void set_nccl_env(int rank) {
    char id[64];
    snprintf(id, sizeof id, "specd-comm-bench-rank%d", rank);
    setenv("NCCL_HOSTID", id, 1);
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    setenv("NCCL_IB_DISABLE", "1", 0);
}

static void report(const opts *o, const char *impl, int world, size_t bytes, const char *algo, double *t, int n) {
    qsort(t, (size_t)n, sizeof *t, cmp_d);
    char line[384];
    snprintf(line, sizeof line,
             "{\"bench\": \"comm_gpu\", \"impl\": \"%s\", \"world\": %d, \"bytes\": %zu, \"algo\": \"%s\", "
             "\"iters\": %d, \"median_us\": %.1f, \"p10_us\": %.1f, \"p90_us\": %.1f}",
             impl, world, bytes, algo, n, t[n / 2], t[n / 10], t[n * 9 / 10]);
    puts(line);
    fflush(stdout);
    if (o->json) {
        FILE *f = fopen(o->json, "a");
        if (f) {
            fprintf(f, "%s\n", line);
            fclose(f);
        }
    }
}

/* Every rank: the cuda_ipc and NCCL loops; rank 0 reports. */
static int bench_rank(comm *c, const opts *o) {
    int rank = comm_rank(c), world = comm_world(c), rc = 0;
    specd_err e = {{0}};
    size_t nmax = SIZES[NSIZES - 1] / sizeof(float);
    float *h = malloc(nmax * sizeof *h), *ref = malloc(nmax * sizeof *ref), *d_in = NULL, *d_out = NULL;
    int maxit = o->iters > o->nccl_iters ? o->iters : o->nccl_iters;
    double *t = malloc((size_t)maxit * sizeof *t);
    cudaStream_t s;
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamDefault)); /* blocking: ordered with the cudaMemcpy calls */
    CUDA_OK(cudaMalloc((void **)&d_in, nmax * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&d_out, nmax * sizeof(float)));

    comm_cuda_ipc *ic = NULL;
    comm_cuda_ipc_config cfg = {.device = 0};
    if (comm_cuda_ipc_create(c, &cfg, &ic, &e)) {
        fprintf(stderr, "rank %d: %s\n", rank, e.msg);
        return -1;
    }
    static const char *algos[] = {"auto", "one-shot", "two-shot"};
    for (size_t k = 0; k < NSIZES && !rc; k++) {
        size_t n = SIZES[k] / sizeof(float);
        for (size_t i = 0; i < n; i++) h[i] = gen_f(3 + n, rank, i);
        ref_sum(ref, 3 + n, world, n);
        CUDA_OK(cudaMemcpy(d_in, h, n * sizeof(float), cudaMemcpyHostToDevice));
        for (int algo = 0; algo < 3 && !rc; algo++) {
            comm_cuda_ipc_set_algo(ic, algo);
            if (comm_cuda_ipc_all_reduce_sum_f32(ic, d_in, d_out, n, s, &e) || comm_cuda_ipc_sync(ic, s, &e)) {
                fprintf(stderr, "rank %d: cuda_ipc %zu B: %s\n", rank, SIZES[k], e.msg);
                rc = -1;
                break;
            }
            CUDA_OK(cudaMemcpy(h, d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
            if (memcmp(h, ref, n * sizeof(float)) != 0) {
                fprintf(stderr, "rank %d: cuda_ipc %zu B (%s) differs from the rank-order sum\n", rank, SIZES[k],
                        algos[algo]);
                rc = -1;
                break;
            }
            for (int it = -WARMUP; it < o->iters; it++) {
                double t0 = now_us();
                if (comm_cuda_ipc_all_reduce_sum_f32(ic, d_in, d_out, n, s, &e) || comm_cuda_ipc_sync(ic, s, &e)) {
                    fprintf(stderr, "rank %d: %s\n", rank, e.msg);
                    rc = -1;
                    break;
                }
                if (it >= 0) t[it] = now_us() - t0;
            }
            if (!rc && rank == 0) report(o, "cuda_ipc", world, SIZES[k], algos[algo], t, o->iters);
        }
    }
    if (!rc && comm_barrier(c, &e)) rc = -1;
    comm_cuda_ipc_destroy(ic);

    if (!rc && o->nccl) {
        comm_nccl *nc = NULL;
        if (comm_nccl_create(c, 120000, &nc, &e)) {
            fprintf(stderr, "rank %d: NCCL not measured: %s\n", rank, e.msg);
        } else {
            for (size_t k = 0; k < NSIZES && !rc; k++) {
                size_t n = SIZES[k] / sizeof(float);
                int warm = WARMUP < o->nccl_iters ? WARMUP / 4 : 1;
                for (int it = -warm; it < o->nccl_iters; it++) {
                    double t0 = now_us();
                    if (comm_nccl_all_reduce_sum(nc, d_in, d_out, n, COMM_NCCL_F32, s, &e)) {
                        fprintf(stderr, "rank %d: %s\n", rank, e.msg);
                        rc = -1;
                        break;
                    }
                    CUDA_OK(cudaStreamSynchronize(s));
                    if (it >= 0) t[it] = now_us() - t0;
                }
                if (!rc && rank == 0) report(o, "nccl", world, SIZES[k], "nccl", t, o->nccl_iters);
            }
            comm_nccl_destroy(nc);
        }
    }
    cudaFree(d_in);
    cudaFree(d_out);
    cudaStreamDestroy(s);
    free(h);
    free(ref);
    free(t);
    return rc;
}

static int parse(int argc, char **argv, opts *o) {
    *o = (opts){.iters = 200, .nccl_iters = 30, .nccl = 1};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--worlds") && i + 1 < argc) {
            for (char *tok = strtok(argv[++i], ","); tok && o->nworlds < 8; tok = strtok(NULL, ","))
                o->worlds[o->nworlds++] = atoi(tok);
        } else if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
            o->iters = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--nccl-iters") && i + 1 < argc) {
            o->nccl_iters = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--json") && i + 1 < argc) {
            o->json = argv[++i];
        } else if (!strcmp(argv[i], "--no-nccl")) {
            o->nccl = 0;
        } else {
            fprintf(stderr, "usage: %s [--worlds 2,4,8] [--iters N] [--nccl-iters N] [--json FILE] [--no-nccl]\n",
                    argv[0]);
            return -1;
        }
    }
    if (!o->nworlds) {
        o->worlds[0] = 2, o->worlds[1] = 4, o->worlds[2] = 8;
        o->nworlds = 3;
    }
    for (int i = 0; i < o->nworlds; i++)
        if (o->worlds[i] < 2 || o->worlds[i] > COMM_CUDA_IPC_MAX_WORLD) {
            fprintf(stderr, "world %d outside [2, %d]\n", o->worlds[i], COMM_CUDA_IPC_MAX_WORLD);
            return -1;
        }
    if (o->iters < 10 || o->nccl_iters < 10) {
        fprintf(stderr, "--iters and --nccl-iters must be >= 10\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    ranks_worker w;
    specd_err e = {{0}};
    int wk = ranks_worker_detect(argc, argv, &w, &e);
    if (wk < 0) return 2;
    if (wk == 1) {
        ranks_worker_strip_args(&argc, argv);
        opts o;
        if (parse(argc, argv, &o)) return 2;
        set_nccl_env(w.rank);
        comm *c = NULL;
        if (ranks_worker_attach(&w, &c, &e)) return 2;
        int rc = bench_rank(c, &o);
        if (rc) comm_abort(c, "a worker's benchmark failed");
        uint8_t b[16];
        size_t n;
        comm_step_kind kind;
        if (!rc && (comm_step_recv(c, b, sizeof b, &n, &kind, 0, &e) || kind != COMM_STEP_SHUTDOWN)) rc = -1;
        comm_destroy(c);
        return rc ? 3 : 0;
    }
    opts o;
    char **orig = calloc((size_t)argc + 1, sizeof *orig);
    for (int i = 0; i < argc; i++) orig[i] = strdup(argv[i]); /* parse() cuts the --worlds list with strtok */
    if (parse(argc, argv, &o)) return 2;
    kn_harness_require_gpu();
    if (o.nccl && comm_nccl_load(NULL, &e)) {
        printf("NCCL not measured: %s\n", e.msg);
        o.nccl = 0;
    }
    set_nccl_env(0);
    printf("comm_gpu_bench: every rank a process on GPU 0, time-sharing it (no MPS): latencies include context "
           "switches and say nothing about K GPUs; NCCL over loopback sockets (NCCL_HOSTID per process)\n");
    int bad = 0;
    for (int wi = 0; wi < o.nworlds; wi++) {
        ranks_config cfg = {.world = o.worlds[wi], .worker_argv = (const char *const *)orig,
                            .comm = comm_config_default()};
        cfg.comm.timeout_ms = 300000;
        ranks *rk = NULL;
        if (ranks_launch(&cfg, &rk, &e)) {
            fprintf(stderr, "%s\n", e.msg);
            return 1;
        }
        int rc = bench_rank(ranks_comm(rk), &o);
        if (rc) comm_abort(ranks_comm(rk), "rank 0's benchmark failed");
        if (ranks_shutdown(rk, 60000, &e)) {
            fprintf(stderr, "world %d: %s\n", o.worlds[wi], e.msg);
            rc = -1;
        }
        ranks_destroy(rk);
        bad += rc != 0;
    }
    return bad ? 1 : 0;
}
