/*
 * test_comm_cuda_ipc_gpu.c: the cuda_ipc communicator (engine/comm/
 * comm_cuda_ipc.h) with 2, 4 and 8 rank processes on ONE GPU (label gpu; the
 * binary re-executes itself as the workers through ranks_launch, as `specd
 * serve` does). Without a usable GPU it prints why and exits 77.
 *
 * Every rank checks its own results against references computed here:
 *  - all-reduce of Kimi's decode sizes (7168 bf16 per token at batch 1, 4, 8,
 *    16, 32 = 14, 57, 115, 230, 460 KB; here f32 counts of those bytes) and odd
 *    sizes (1, 3, 5, 1001, 33333, 115001 floats), each with the automatic
 *    algorithm, forced one-shot and forced two-shot, twice: bit-equal to the
 *    serial rank-order f32 sum (comm_suite.h ref_sum: inputs over 25 binades of
 *    both signs, so another order gives other bits), bit-equal to the
 *    repetition before, the same on every rank (hash all-gathered on the host),
 *    and bit-equal to the host shm all-reduce (comm_all_reduce_sum_f32) of the
 *    same inputs. The stage is 256 KiB, so 460 KB and 115001 floats are split
 *    in two launches. Also in place (in == out) and with pointers 4 bytes off
 *    16-byte alignment (the scalar paths);
 *  - all-gather of 10000, 777 and 300000 (split) bytes per rank; broadcast of
 *    0, 1, 5000 and 300000 bytes from every root;
 *  - a CUDA graph of one all-reduce (14 KB) replayed 3 times with new inputs
 *    each time (the generation lives on the device): each replay exact;
 *  - failures (world 4 / 3): a worker SIGKILLed while the others wait in an
 *    all-reduce kernel: every survivor's call fails naming "rank 3" and
 *    "exited" within KILL_BOUND_MS of the kill (rank 0 measures; the workers
 *    check < 5 s of waiting); a worker that stops calling (alive, not killed):
 *    the others fail with "timed out after 1500 ms waiting for rank 2" within
 *    1500 ms + 2 s, and the silent rank sees the group aborted; mismatched
 *    calls (world 3: rank 1 all_reduce(1001), the others all_reduce(1000)):
 *    every rank fails with "collective mismatch" within 2 s.
 * K processes on one GPU time-share it (no MPS), so a collective takes
 * milliseconds here: this is a correctness test, not a latency figure
 * (tests/perf/bench_comm_gpu.c measures).
 */
#define _GNU_SOURCE
#include <cuda_runtime.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine/comm/comm_cuda_ipc.h"
#include "engine/comm/ranks.h"
#include "tests/comm/comm_suite.h"
#include "tests/kernels/kn_harness.h"

#define STAGE_BYTES (256u << 10)
#define KILL_BOUND_MS 2000
#define HANG_TIMEOUT_MS 1500

static const char *g_exe;

#define CUDA_OK(call)                                                                                      \
    do {                                                                                                   \
        cudaError_t rc_ = (call);                                                                          \
        if (rc_ != cudaSuccess) {                                                                          \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(rc_));        \
            return 1;                                                                                      \
        }                                                                                                  \
    } while (0)

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

typedef struct bufs {
    float *d_in, *d_out, *h, *ref, *host;
    uint8_t *d_b, *d_g, *hb;
    cudaStream_t s;
} bufs;

#define NMAX 115001u
#define GMAX 300000u

/* One all-reduce: inputs gen_f(seed, rank, .), on the device at d_in + off (off floats), result to d_out + off
 * (or in place); checked against ref (already ref_sum'ed); the result left in b->h. */
static int one_ar(comm *c, comm_cuda_ipc *ic, bufs *b, size_t n, uint64_t seed, int inplace, int off,
                  const char *what) {
    int rank = comm_rank(c);
    specd_err e = {{0}};
    for (size_t i = 0; i < n; i++) b->h[i] = gen_f(seed, rank, i);
    float *in = b->d_in + off, *out = inplace ? in : b->d_out + off;
    CUDA_OK(cudaMemcpy(in, b->h, n * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(b->d_out, 0xEE, (NMAX + 4) * sizeof(float)));
    if (comm_cuda_ipc_all_reduce_sum_f32(ic, in, out, n, b->s, &e) || comm_cuda_ipc_sync(ic, b->s, &e)) {
        fprintf(stderr, "rank %d: %s: %s\n", rank, what, e.msg);
        return 1000; /* the group is dead: stop */
    }
    CUDA_OK(cudaMemcpy(b->h, out, n * sizeof(float), cudaMemcpyDeviceToHost));
    size_t diff = 0, at = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&b->h[i], &b->ref[i], sizeof(float)) != 0 && diff++ == 0) at = i;
    if (diff) {
        fprintf(stderr, "rank %d world %d: %s: %zu of %zu elements differ from the rank-order f32 sum, first at %zu: "
                "%.9g vs %.9g\n", rank, comm_world(c), what, diff, n, at, b->h[at], b->ref[at]);
        return 1;
    }
    return 0;
}

static int suite_ar(comm *c, comm_cuda_ipc *ic, bufs *b) {
    static const size_t sizes[] = {3584, 14336, 28672, 57344, 114688, 1, 3, 5, 1001, 33333, 115001};
    static const char *algos[] = {"auto", "one-shot", "two-shot"};
    int rank = comm_rank(c), world = comm_world(c), bad = 0;
    specd_err e = {{0}};
    float *first = malloc(NMAX * sizeof(float));
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes && bad < 1000; k++) {
        size_t n = sizes[k];
        uint64_t seed = 9000 + n;
        ref_sum(b->ref, seed, world, n);
        for (int algo = 0; algo < 3 && bad < 1000; algo++) {
            comm_cuda_ipc_set_algo(ic, algo);
            for (int rep = 0; rep < 2 && bad < 1000; rep++) {
                char what[96];
                snprintf(what, sizeof what, "all_reduce(%zu f32, %s) rep %d", n, algos[algo], rep);
                int r = one_ar(c, ic, b, n, seed, 0, 0, what);
                bad += r;
                if (r) continue;
                if (rep == 0) memcpy(first, b->h, n * sizeof(float));
                else if (memcmp(first, b->h, n * sizeof(float)) != 0) {
                    fprintf(stderr, "rank %d: %s differs from rep 0\n", rank, what);
                    bad++;
                }
                bad += suite_same_everywhere(c, fnv64(b->h, n * sizeof(float)), what);
            }
        }
        comm_cuda_ipc_set_algo(ic, 0);
        /* the host shm all-reduce of the same inputs: the same bits */
        for (size_t i = 0; i < n; i++) b->host[i] = gen_f(seed, rank, i);
        if (comm_all_reduce_sum_f32(c, b->host, n, &e)) {
            fprintf(stderr, "rank %d: shm all_reduce(%zu): %s\n", rank, n, e.msg);
            bad = 1000;
        } else if (memcmp(b->host, first, n * sizeof(float)) != 0) {
            fprintf(stderr, "rank %d: cuda_ipc all_reduce(%zu) differs from the shm all_reduce\n", rank, n);
            bad++;
        }
    }
    /* in place, and 4 bytes off 16-byte alignment (in and out), for each algorithm */
    for (int algo = 1; algo <= 2 && bad < 1000; algo++) {
        comm_cuda_ipc_set_algo(ic, algo);
        size_t n = 33333;
        ref_sum(b->ref, 77 + (uint64_t)algo, world, n);
        bad += one_ar(c, ic, b, n, 77 + (uint64_t)algo, 1, 0, "all_reduce in place");
        if (bad < 1000) bad += one_ar(c, ic, b, n, 77 + (uint64_t)algo, 0, 1, "all_reduce misaligned");
        if (bad < 1000) bad += one_ar(c, ic, b, n, 77 + (uint64_t)algo, 1, 3, "all_reduce misaligned in place");
    }
    comm_cuda_ipc_set_algo(ic, 0);
    free(first);
    return bad;
}

static int suite_gather_bcast(comm *c, comm_cuda_ipc *ic, bufs *b) {
    int rank = comm_rank(c), world = comm_world(c), bad = 0;
    specd_err e = {{0}};
    static const size_t gsz[] = {10000, 777, GMAX};
    for (size_t k = 0; k < 3; k++) {
        size_t cb = gsz[k];
        for (size_t i = 0; i < cb; i++) b->hb[i] = gen_b(31 + k, rank, i);
        CUDA_OK(cudaMemcpy(b->d_b, b->hb, cb, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(b->d_g, 0xEE, (size_t)world * GMAX));
        if (comm_cuda_ipc_all_gather(ic, b->d_b, b->d_g, cb, b->s, &e) || comm_cuda_ipc_sync(ic, b->s, &e)) {
            fprintf(stderr, "rank %d: all_gather(%zu): %s\n", rank, cb, e.msg);
            return 1000;
        }
        uint8_t *all = malloc((size_t)world * cb);
        CUDA_OK(cudaMemcpy(all, b->d_g, (size_t)world * cb, cudaMemcpyDeviceToHost));
        for (int r = 0; r < world; r++)
            for (size_t i = 0; i < cb; i++)
                if (all[(size_t)r * cb + i] != gen_b(31 + k, r, i)) {
                    fprintf(stderr, "rank %d: all_gather(%zu): byte %zu of rank %d wrong\n", rank, cb, i, r);
                    bad++;
                    r = world;
                    break;
                }
        free(all);
    }
    static const size_t bsz[] = {0, 1, 5000, GMAX};
    for (int root = 0; root < world; root++)
        for (size_t k = 0; k < 4; k++) {
            size_t n = bsz[k];
            uint64_t seed = 500 + (uint64_t)root * 10 + k;
            for (size_t i = 0; i < n; i++) b->hb[i] = rank == root ? gen_b(seed, root, i) : 0x11;
            CUDA_OK(cudaMemcpy(b->d_b, b->hb, n ? n : 1, cudaMemcpyHostToDevice));
            /* root: in place; others: into d_g */
            uint8_t *out = rank == root ? b->d_b : b->d_g;
            if (comm_cuda_ipc_broadcast(ic, root, b->d_b, out, n, b->s, &e) || comm_cuda_ipc_sync(ic, b->s, &e)) {
                fprintf(stderr, "rank %d: broadcast(root %d, %zu B): %s\n", rank, root, n, e.msg);
                return 1000;
            }
            CUDA_OK(cudaMemcpy(b->hb, out, n ? n : 1, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < n; i++)
                if (b->hb[i] != gen_b(seed, root, i)) {
                    fprintf(stderr, "rank %d: broadcast(root %d, %zu B): byte %zu wrong\n", rank, root, n, i);
                    bad++;
                    break;
                }
        }
    if (comm_cuda_ipc_barrier(ic, b->s, &e) || comm_cuda_ipc_sync(ic, b->s, &e)) {
        fprintf(stderr, "rank %d: barrier: %s\n", rank, e.msg);
        return 1000;
    }
    return bad;
}

/* One all-reduce captured in a graph, replayed with new inputs (same buffers). */
static int suite_graph(comm *c, comm_cuda_ipc *ic, bufs *b) {
    int rank = comm_rank(c), world = comm_world(c), bad = 0;
    specd_err e = {{0}};
    size_t n = 3584;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(b->s, cudaStreamCaptureModeThreadLocal));
    int rc = comm_cuda_ipc_all_reduce_sum_f32(ic, b->d_in, b->d_out, n, b->s, &e);
    CUDA_OK(cudaStreamEndCapture(b->s, &graph));
    if (rc) {
        fprintf(stderr, "rank %d: capture: %s\n", rank, e.msg);
        return 1000;
    }
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; rep++) {
        uint64_t seed = 4242 + (uint64_t)rep;
        for (size_t i = 0; i < n; i++) b->h[i] = gen_f(seed, rank, i);
        ref_sum(b->ref, seed, world, n);
        CUDA_OK(cudaMemcpy(b->d_in, b->h, n * sizeof(float), cudaMemcpyHostToDevice));
        CUDA_OK(cudaGraphLaunch(exec, b->s));
        if (comm_cuda_ipc_sync(ic, b->s, &e)) {
            fprintf(stderr, "rank %d: graph replay %d: %s\n", rank, rep, e.msg);
            return 1000;
        }
        CUDA_OK(cudaMemcpy(b->h, b->d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
        if (memcmp(b->h, b->ref, n * sizeof(float)) != 0) {
            fprintf(stderr, "rank %d: graph replay %d differs from the rank-order sum\n", rank, rep);
            bad++;
        }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return bad;
}

static int bufs_init(bufs *b) {
    memset(b, 0, sizeof *b);
    CUDA_OK(cudaSetDevice(0));
    /* a blocking stream: the cudaMemset / cudaMemcpy calls (legacy default stream) are ordered with the collectives */
    CUDA_OK(cudaStreamCreateWithFlags(&b->s, cudaStreamDefault));
    CUDA_OK(cudaMalloc((void **)&b->d_in, (NMAX + 4) * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&b->d_out, (NMAX + 4) * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&b->d_b, GMAX));
    CUDA_OK(cudaMalloc((void **)&b->d_g, (size_t)COMM_CUDA_IPC_MAX_WORLD * GMAX));
    b->h = malloc(NMAX * sizeof(float));
    b->ref = malloc(NMAX * sizeof(float));
    b->host = malloc(NMAX * sizeof(float));
    b->hb = malloc(GMAX);
    return 0;
}

static void bufs_free(bufs *b) {
    cudaFree(b->d_in);
    cudaFree(b->d_out);
    cudaFree(b->d_b);
    cudaFree(b->d_g);
    cudaStreamDestroy(b->s);
    free(b->h);
    free(b->ref);
    free(b->host);
    free(b->hb);
}

/* What every rank of the correctness worlds runs. */
static int rank_suite(comm *c) {
    bufs b;
    if (bufs_init(&b)) return 1;
    specd_err e = {{0}};
    comm_cuda_ipc *ic = NULL;
    comm_cuda_ipc_config cfg = {.device = 0, .stage_bytes = STAGE_BYTES, .timeout_ms = 20000};
    if (comm_cuda_ipc_create(c, &cfg, &ic, &e)) {
        fprintf(stderr, "rank %d: %s\n", comm_rank(c), e.msg);
        bufs_free(&b);
        return 1;
    }
    double t0 = now_ms();
    int bad = suite_ar(c, ic, &b);
    if (bad < 1000) bad += suite_gather_bcast(c, ic, &b);
    if (bad < 1000) bad += suite_graph(c, ic, &b);
    if (comm_rank(c) == 0)
        printf("world %d: cuda_ipc suite %s in %.0f ms\n", comm_world(c), bad ? "FAILED" : "passed", now_ms() - t0);
    if (!bad && comm_barrier(c, &e)) bad++; /* nobody frees its region while a peer still reads it */
    comm_cuda_ipc_destroy(ic);
    bufs_free(&b);
    return bad;
}

/* ---- failures ---- */

typedef struct killer {
    ranks *rk;
    int victim;
    volatile int go;
    double t_kill;
} killer;

static void *killer_main(void *arg) {
    killer *k = arg;
    while (!k->go) usleep(1000);
    usleep(300000); /* the survivors are inside the all-reduce kernel by now */
    k->t_kill = now_ms();
    kill(ranks_pid(k->rk, k->victim), SIGKILL);
    return NULL;
}

/* mode 1 (kill): the last rank stops calling after 20 all-reduces and waits to be killed.
 * mode 2 (hang): the last rank stops calling after 20 and polls until the group fails.
 * Returns 0 when this rank saw what it must, else 1. *fail_ms: how long its failing call waited. */
static int rank_failure(comm *c, int mode, killer *k, double *fail_ms, char *msg, size_t msg_len) {
    int rank = comm_rank(c), world = comm_world(c), last = world - 1;
    bufs b;
    if (bufs_init(&b)) return 1;
    specd_err e = {{0}};
    comm_cuda_ipc *ic = NULL;
    comm_cuda_ipc_config cfg = {.device = 0, .stage_bytes = STAGE_BYTES,
                                .timeout_ms = mode == 2 ? HANG_TIMEOUT_MS : 20000};
    if (comm_cuda_ipc_create(c, &cfg, &ic, &e)) {
        fprintf(stderr, "rank %d: %s\n", rank, e.msg);
        return 1;
    }
    size_t n = 14336;
    for (size_t i = 0; i < n; i++) b.h[i] = gen_f(5, rank, i);
    CUDA_OK(cudaMemcpy(b.d_in, b.h, n * sizeof(float), cudaMemcpyHostToDevice));
    int ok = 0;
    for (int it = 0;; it++) {
        if (rank == last && it == 20) {
            if (mode == 1) pause(); /* killed here */
            while (comm_cuda_ipc_poll(ic, &e) == 0) usleep(10000);
            ok = strstr(e.msg, "timed out") != NULL;
            snprintf(msg, msg_len, "%s", e.msg);
            break;
        }
        if (rank == 0 && it == 20 && k) k->go = 1;
        double t0 = now_ms();
        if (comm_cuda_ipc_all_reduce_sum_f32(ic, b.d_in, b.d_out, n, b.s, &e) || comm_cuda_ipc_sync(ic, b.s, &e)) {
            *fail_ms = now_ms() - t0;
            snprintf(msg, msg_len, "%s", e.msg);
            char want[64];
            snprintf(want, sizeof want, "rank %d", last);
            ok = it == 20 && strstr(e.msg, want) != NULL &&
                 (mode == 1 ? strstr(e.msg, "exited") != NULL
                            : strstr(e.msg, "timed out after 1500 ms waiting for rank") != NULL) &&
                 *fail_ms < (mode == 1 ? 5000 : HANG_TIMEOUT_MS + 2000);
            break;
        }
        if (it > 20) {
            snprintf(msg, msg_len, "all_reduce %d succeeded without rank %d", it, last);
            break;
        }
    }
    comm_cuda_ipc_destroy(ic);
    bufs_free(&b);
    return ok ? 0 : 1;
}

/* mode 3 (mismatch): after 5 good all-reduces, rank 1 calls all_reduce(n + 1) while the others call
 * all_reduce(n): every rank's call fails with "collective mismatch" within 2 s, nothing is read. */
static int rank_mismatch(comm *c, char *msg, size_t msg_len) {
    int rank = comm_rank(c);
    bufs b;
    if (bufs_init(&b)) return 1;
    specd_err e = {{0}};
    comm_cuda_ipc *ic = NULL;
    comm_cuda_ipc_config cfg = {.device = 0, .stage_bytes = STAGE_BYTES, .timeout_ms = 20000};
    if (comm_cuda_ipc_create(c, &cfg, &ic, &e)) {
        snprintf(msg, msg_len, "%s", e.msg);
        return 1;
    }
    size_t n = 1000;
    int ok = 0;
    for (int it = 0; it <= 5; it++) {
        size_t m = it == 5 && rank == 1 ? n + 1 : n;
        double t0 = now_ms();
        int rc = comm_cuda_ipc_all_reduce_sum_f32(ic, b.d_in, b.d_out, m, b.s, &e) || comm_cuda_ipc_sync(ic, b.s, &e);
        double ms = now_ms() - t0;
        if (rc) {
            snprintf(msg, msg_len, "after %.0f ms: %.400s", ms, e.msg);
            /* the mismatch is seen at generation 5; a rank other than the mismatching one may still be
             * waiting for its generation-4 sync when a peer raises the group abort (asynchronous by design),
             * and then fails there, with the same reason */
            ok = (it == 5 || (it == 4 && rank != 1)) && strstr(e.msg, "collective mismatch") != NULL && ms < 2000;
            break;
        }
        if (it == 5) snprintf(msg, msg_len, "mismatched all_reduce succeeded");
    }
    comm_cuda_ipc_destroy(ic);
    bufs_free(&b);
    return ok ? 0 : 1;
}

static void run_world(int world) {
    char mode[32] = "--mode=suite";
    const char *argv[] = {g_exe, mode, NULL};
    ranks_config cfg = {.world = world, .worker_argv = argv, .comm = comm_config_default()};
    cfg.comm.timeout_ms = 120000;
    specd_err e = {{0}};
    ranks *rk = NULL;
    if (ranks_launch(&cfg, &rk, &e)) fail_msg("%s", e.msg);
    int bad = rank_suite(ranks_comm(rk));
    if (bad) comm_abort(ranks_comm(rk), "rank 0's cuda_ipc checks failed");
    assert_int_equal(bad, 0);
    if (ranks_shutdown(rk, 60000, &e)) fail_msg("shutdown (a worker's check failed?): %s", e.msg);
    ranks_destroy(rk);
}

static void test_world2(void **st) { (void)st, run_world(2); }
static void test_world4(void **st) { (void)st, run_world(4); }
static void test_world8(void **st) { (void)st, run_world(8); }

static void run_failure(int world, int mode) {
    char m[32];
    snprintf(m, sizeof m, "--mode=%s", mode == 1 ? "kill" : mode == 2 ? "hang" : "mismatch");
    const char *argv[] = {g_exe, m, NULL};
    ranks_config cfg = {.world = world, .worker_argv = argv, .comm = comm_config_default()};
    cfg.comm.timeout_ms = 120000;
    specd_err e = {{0}};
    ranks *rk = NULL;
    if (ranks_launch(&cfg, &rk, &e)) fail_msg("%s", e.msg);
    killer k = {.rk = rk, .victim = world - 1};
    pthread_t th;
    if (mode == 1) pthread_create(&th, NULL, killer_main, &k);
    double fail_ms = -1;
    char msg[SPECD_ERR_MSG_MAX] = "";
    int bad = mode == 3 ? rank_mismatch(ranks_comm(rk), msg, sizeof msg)
                        : rank_failure(ranks_comm(rk), mode, mode == 1 ? &k : NULL, &fail_ms, msg, sizeof msg);
    if (mode == 1) {
        k.go = 1;
        pthread_join(th, NULL);
    }
    double since_kill = mode == 1 ? now_ms() - k.t_kill : -1;
    printf("%s at world %d: rank 0's call failed after %.0f ms (%.0f ms after the kill): %s\n",
           mode == 1 ? "worker killed" : mode == 2 ? "worker silent" : "mismatched call", world, fail_ms, since_kill,
           msg);
    assert_int_equal(bad, 0);
    if (mode == 1) assert_true(since_kill >= 0 && since_kill < KILL_BOUND_MS);
    (void)ranks_shutdown(rk, 30000, &e); /* the group is aborted: this reaps */
    for (int r = 1; r < world; r++) {
        int ws = 0;
        assert_true(ranks_exit_status(rk, r, &ws));
        if (mode == 1 && r == world - 1) {
            assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
        } else if (!(WIFEXITED(ws) && WEXITSTATUS(ws) == 0)) {
            fail_msg("rank %d did not see the failure as expected (wait status 0x%x)", r, ws);
        }
    }
    ranks_destroy(rk);
}

static void test_peer_killed(void **st) { (void)st, run_failure(4, 1); }
static void test_peer_silent(void **st) { (void)st, run_failure(3, 2); }
static void test_mismatch(void **st) { (void)st, run_failure(3, 3); }

static int worker_main(const ranks_worker *w, const char *mode) {
    specd_err e = {{0}};
    comm *c = NULL;
    if (ranks_worker_attach(w, &c, &e)) return 2;
    int bad;
    if (!strcmp(mode, "--mode=suite")) {
        bad = rank_suite(c);
        if (bad) comm_abort(c, "a worker's cuda_ipc checks failed");
        uint8_t b[16];
        size_t n;
        comm_step_kind kind;
        if (!bad && (comm_step_recv(c, b, sizeof b, &n, &kind, 0, &e) || kind != COMM_STEP_SHUTDOWN)) bad++;
    } else if (!strcmp(mode, "--mode=mismatch")) {
        char msg[SPECD_ERR_MSG_MAX] = "";
        bad = rank_mismatch(c, msg, sizeof msg);
        fprintf(stderr, "rank %d: %s\n", w->rank, msg);
    } else {
        double ms = -1;
        char msg[SPECD_ERR_MSG_MAX] = "";
        bad = rank_failure(c, !strcmp(mode, "--mode=kill") ? 1 : 2, NULL, &ms, msg, sizeof msg);
        fprintf(stderr, "rank %d: failed after %.0f ms: %s\n", w->rank, ms, msg);
    }
    comm_destroy(c);
    return bad ? 3 : 0;
}

int main(int argc, char **argv) {
    ranks_worker w;
    specd_err e = {{0}};
    int wk = ranks_worker_detect(argc, argv, &w, &e);
    if (wk < 0) return 2;
    if (wk == 1) {
        ranks_worker_strip_args(&argc, argv);
        return worker_main(&w, argc > 1 ? argv[1] : "--mode=suite");
    }
    kn_harness_require_gpu();
    int mode = -1;
    if (cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, 0) == cudaSuccess &&
        (mode == cudaComputeModeExclusiveProcess || mode == cudaComputeModeProhibited)) {
        printf("SKIP: GPU 0's compute mode (%d) does not let several processes use it\n", mode);
        return 77;
    }
    g_exe = argv[0];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_world2),      cmocka_unit_test(test_world4),     cmocka_unit_test(test_world8),
        cmocka_unit_test(test_peer_killed), cmocka_unit_test(test_peer_silent), cmocka_unit_test(test_mismatch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
