/*
 * test_comm_nccl_gpu.c: the NCCL adapter on a real GPU, 2 processes on ONE
 * device (label gpu). NCCL refuses two ranks on one GPU ("Duplicate GPU
 * detected"); a different NCCL_HOSTID per process makes it see two "nodes"
 * talking NET/Socket over loopback (GPU-NOTES section 1): function only, ~4 ms
 * per call, not a performance figure.
 *
 * Checked on both ranks (each against its own host reference):
 *  - all-reduce of 3584 and 115000 f32 (14 KB and 460 KB: Kimi decode at
 *    batch 1 and 32) equals x0 + x1 computed on the host (one f32 rounding of
 *    two operands: bit-exact whatever NCCL's algorithm);
 *  - all-gather of 1000 f32 per rank, broadcast of 5000 f32 from rank 1;
 *  - the watchdog: rank 0 initialises a second communicator that rank 1
 *    never joins: comm_nccl_init fails after its 3 s timeout, aborted, no hang.
 * Without a usable GPU it prints why and exits 77 (kn_probe).
 */
#define _GNU_SOURCE
#include <cuda_runtime.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "engine/comm/comm_nccl.h"
#include "engine/comm/ranks.h"
#include "tests/comm/comm_suite.h"
#include "tests/kernels/kn_harness.h"

static const char *g_exe;

#define CUDA_OK(call)                                                                                      \
    do {                                                                                                   \
        cudaError_t rc_ = (call);                                                                          \
        if (rc_ != cudaSuccess) {                                                                          \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(rc_));        \
            return 1;                                                                                      \
        }                                                                                                  \
    } while (0)

/* Before any NCCL call in this process: look like another host than the peer. */
static void set_nccl_env(int rank) {
    char id[64];
    snprintf(id, sizeof id, "specd-comm-test-rank%d", rank);
    setenv("NCCL_HOSTID", id, 1);
    setenv("NCCL_SOCKET_IFNAME", "lo", 0); /* a user's setting wins */
    setenv("NCCL_IB_DISABLE", "1", 0);
}

/* Waits for the stream while polling NCCL's asynchronous error (the watchdog loop). */
static int stream_wait(comm_nccl *nc, cudaStream_t s, int timeout_ms) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    specd_err e = {{0}};
    for (;;) {
        cudaError_t q = cudaStreamQuery(s);
        if (q == cudaSuccess) return 0;
        if (q != cudaErrorNotReady) {
            fprintf(stderr, "cudaStreamQuery: %s\n", cudaGetErrorString(q));
            return 1;
        }
        if (comm_nccl_poll(nc, &e) < 0) {
            fprintf(stderr, "%s\n", e.msg);
            return 1;
        }
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 > timeout_ms) {
            fprintf(stderr, "stream did not finish in %d ms: aborting NCCL\n", timeout_ms);
            comm_nccl_abort(nc);
            return 1;
        }
    }
}

static int nccl_suite(comm *c) {
    int rank = comm_rank(c), world = comm_world(c), bad = 0;
    specd_err e = {{0}};
    CUDA_OK(cudaSetDevice(0));
    comm_nccl *nc = NULL;
    if (comm_nccl_create(c, 60000, &nc, &e)) {
        fprintf(stderr, "rank %d: %s\n", rank, e.msg);
        return 1;
    }
    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));
    size_t nmax = 115000;
    float *h = malloc(nmax * sizeof *h), *ref = malloc(nmax * sizeof *ref), *d_in, *d_out;
    CUDA_OK(cudaMalloc((void **)&d_in, nmax * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&d_out, nmax * world * sizeof(float)));
    static const size_t sizes[] = {3584, 115000};
    for (int k = 0; k < 2; k++) {
        size_t n = sizes[k];
        for (size_t i = 0; i < n; i++) h[i] = gen_f(55 + n, rank, i);
        ref_sum(ref, 55 + n, world, n);
        CUDA_OK(cudaMemcpy(d_in, h, n * sizeof(float), cudaMemcpyHostToDevice));
        if (comm_nccl_all_reduce_sum(nc, d_in, d_out, n, COMM_NCCL_F32, s, &e)) {
            fprintf(stderr, "rank %d: %s\n", rank, e.msg);
            bad++;
            break;
        }
        if (stream_wait(nc, s, 30000)) return bad + 1;
        CUDA_OK(cudaMemcpy(h, d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
        if (memcmp(h, ref, n * sizeof(float)) != 0) {
            fprintf(stderr, "rank %d: NCCL all-reduce of %zu f32 differs from x0 + x1\n", rank, n);
            bad++;
        }
    }
    /* all-gather 1000 per rank */
    for (size_t i = 0; i < 1000; i++) h[i] = gen_f(77, rank, i);
    CUDA_OK(cudaMemcpy(d_in, h, 1000 * sizeof(float), cudaMemcpyHostToDevice));
    if (comm_nccl_all_gather(nc, d_in, d_out, 1000, COMM_NCCL_F32, s, &e) || stream_wait(nc, s, 30000)) {
        fprintf(stderr, "rank %d: all_gather: %s\n", rank, e.msg);
        return bad + 1;
    }
    CUDA_OK(cudaMemcpy(h, d_out, 1000 * world * sizeof(float), cudaMemcpyDeviceToHost));
    for (int r = 0; r < world; r++)
        for (size_t i = 0; i < 1000; i++)
            if (h[(size_t)r * 1000 + i] != gen_f(77, r, i)) {
                fprintf(stderr, "rank %d: all_gather: rank %d element %zu wrong\n", rank, r, i);
                bad++;
                r = world;
                break;
            }
    /* broadcast 5000 from rank 1 */
    for (size_t i = 0; i < 5000; i++) h[i] = rank == 1 ? gen_f(99, 1, i) : 0.0f;
    CUDA_OK(cudaMemcpy(d_in, h, 5000 * sizeof(float), cudaMemcpyHostToDevice));
    if (comm_nccl_broadcast(nc, d_in, d_out, 5000, COMM_NCCL_F32, 1, s, &e) || stream_wait(nc, s, 30000)) {
        fprintf(stderr, "rank %d: broadcast: %s\n", rank, e.msg);
        return bad + 1;
    }
    CUDA_OK(cudaMemcpy(h, d_out, 5000 * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < 5000; i++)
        if (h[i] != gen_f(99, 1, i)) {
            fprintf(stderr, "rank %d: broadcast element %zu wrong\n", rank, i);
            bad++;
            break;
        }
    comm_nccl_destroy(nc);
    cudaFree(d_in);
    cudaFree(d_out);
    cudaStreamDestroy(s);
    free(h);
    free(ref);
    /* The watchdog: rank 0 alone in a 2-rank init. */
    if (comm_barrier(c, &e)) return bad + 1;
    if (rank == 0) {
        uint8_t id[COMM_NCCL_ID_BYTES];
        comm_nccl *lone = NULL;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        if (comm_nccl_id_new(id, &e)) return bad + 1;
        int rc = comm_nccl_init(id, 0, 2, 3000, &lone, &e);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
        printf("lone init: rc %d after %.0f ms: %s\n", rc, ms, e.msg);
        if (rc == 0 || !strstr(e.msg, "did not complete within 3000 ms") || ms > 13000) bad++;
        comm_nccl_destroy(lone);
    }
    if (comm_barrier(c, &e)) return bad + 1;
    return bad;
}

static void test_nccl_two_processes_one_gpu(void **st) {
    (void)st;
    set_nccl_env(0);
    const char *argv[] = {g_exe, NULL};
    ranks_config cfg = {.world = 2, .worker_argv = argv, .comm = comm_config_default()};
    cfg.comm.timeout_ms = 120000;
    specd_err e = {{0}};
    ranks *rk = NULL;
    if (ranks_launch(&cfg, &rk, &e)) fail_msg("%s", e.msg);
    int bad = nccl_suite(ranks_comm(rk));
    if (bad) comm_abort(ranks_comm(rk), "rank 0's NCCL checks failed"); /* the worker stops waiting */
    assert_int_equal(bad, 0);
    if (ranks_shutdown(rk, 60000, &e)) fail_msg("shutdown (the worker's check failed?): %s", e.msg);
    ranks_destroy(rk);
}

int main(int argc, char **argv) {
    ranks_worker w;
    specd_err e = {{0}};
    int wk = ranks_worker_detect(argc, argv, &w, &e);
    if (wk < 0) return 2;
    if (wk == 1) {
        set_nccl_env(w.rank);
        comm *c = NULL;
        if (ranks_worker_attach(&w, &c, &e)) return 2;
        int bad = nccl_suite(c);
        if (bad) comm_abort(c, "a worker's NCCL checks failed");
        uint8_t b[16];
        size_t n;
        comm_step_kind kind;
        if (!bad && (comm_step_recv(c, b, sizeof b, &n, &kind, 0, &e) || kind != COMM_STEP_SHUTDOWN)) bad++;
        comm_destroy(c);
        return bad ? 3 : 0;
    }
    kn_harness_require_gpu();
    if (comm_nccl_load(NULL, &e)) {
        printf("SKIP: %s\n", e.msg);
        return 77;
    }
    g_exe = argv[0];
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_nccl_two_processes_one_gpu)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
