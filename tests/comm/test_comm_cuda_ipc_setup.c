/*
 * test_comm_cuda_ipc_setup.c: comm_cuda_ipc_create's refusals, with or
 * without a GPU (label unit; real cudart, real rank processes):
 *  - world 3 where rank 2 asks for CUDA device 99: rank 2 fails with the
 *    failing call and its file:line ("comm_cuda_ipc.c:N: cudaSetDevice(...)"),
 *    and ranks 0 and 1 fail too, within 5 s, naming cudaSetDevice (their own
 *    call when there is no GPU; rank 2's reason, through the host group's
 *    abort, when there is one) instead of waiting in the handle exchange;
 *  - world 9 (> 8): every rank refuses at once with the bound.
 * Each rank checks its own message; rank 0 checks the workers' exit codes.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include <cmocka.h>

#include "engine/comm/comm_cuda_ipc.h"
#include "engine/comm/ranks.h"

static const char *g_exe;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* 0 when this rank's create failed as it must. */
static int rank_check(comm *c, const char *mode) {
    int rank = comm_rank(c), world = comm_world(c);
    comm_cuda_ipc_config cfg = {.device = 0, .stage_bytes = 1 << 16, .timeout_ms = 2000};
    if (!strcmp(mode, "--mode=baddev") && rank == world - 1) cfg.device = 99;
    comm_cuda_ipc *ic = NULL;
    specd_err e = {{0}};
    /* every rank attached first: a worker's failure must not abort the group while ranks_launch still waits */
    if (comm_barrier(c, &e)) {
        printf("rank %d: barrier: %s\n", rank, e.msg);
        return 1;
    }
    double t0 = now_ms();
    int rc = comm_cuda_ipc_create(c, &cfg, &ic, &e);
    double ms = now_ms() - t0;
    printf("rank %d (%s): create rc %d after %.0f ms: %s\n", rank, mode, rc, ms, e.msg);
    fflush(stdout);
    if (rc == 0) {
        comm_cuda_ipc_destroy(ic);
        return 1;
    }
    if (ms > 5000) return 1;
    if (!strcmp(mode, "--mode=world9")) return strstr(e.msg, "world 9 outside [1, 8]") == NULL;
    if (!strstr(e.msg, "cudaSetDevice")) return 1;
    if (rank == world - 1 && !(strstr(e.msg, "comm_cuda_ipc.c:") && strstr(e.msg, "cudaSetDevice(99)")))
        return 1;
    return 0;
}

static void run(int world, const char *mode) {
    const char *argv[] = {g_exe, mode, NULL};
    ranks_config cfg = {.world = world, .worker_argv = argv, .comm = comm_config_default()};
    cfg.comm.timeout_ms = 30000;
    specd_err e = {{0}};
    ranks *rk = NULL;
    if (ranks_launch(&cfg, &rk, &e)) fail_msg("%s", e.msg);
    int bad = rank_check(ranks_comm(rk), mode);
    comm_abort(ranks_comm(rk), "test over"); /* the workers return from their wait */
    (void)ranks_shutdown(rk, 30000, &e);
    for (int r = 1; r < world; r++) {
        int ws = 0;
        assert_true(ranks_exit_status(rk, r, &ws));
        if (!(WIFEXITED(ws) && WEXITSTATUS(ws) == 0)) {
            fprintf(stderr, "rank %d: wait status 0x%x\n", r, ws);
            bad++;
        }
    }
    ranks_destroy(rk);
    assert_int_equal(bad, 0);
}

static void test_bad_device(void **st) { (void)st, run(3, "--mode=baddev"); }
static void test_world9(void **st) { (void)st, run(9, "--mode=world9"); }

int main(int argc, char **argv) {
    ranks_worker w;
    specd_err e = {{0}};
    int wk = ranks_worker_detect(argc, argv, &w, &e);
    if (wk < 0) return 2;
    if (wk == 1) {
        ranks_worker_strip_args(&argc, argv);
        comm *c = NULL;
        if (ranks_worker_attach(&w, &c, &e)) return 2;
        int bad = rank_check(c, argc > 1 ? argv[1] : "");
        /* wait for rank 0's verdict (its abort) so it can still read our pid's status as ours */
        uint8_t b[16];
        size_t n;
        comm_step_kind kind;
        (void)comm_step_recv(c, b, sizeof b, &n, &kind, 30000, &e);
        comm_destroy(c);
        return bad ? 3 : 0;
    }
    g_exe = argv[0];
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_bad_device), cmocka_unit_test(test_world9)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
