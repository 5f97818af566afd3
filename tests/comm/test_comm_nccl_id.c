/*
 * test_comm_nccl_id.c: the NCCL adapter without a GPU (GPU-NOTES section 1:
 * ncclGetUniqueId needs only a bootstrap socket).
 *
 *  - a bad $SPECD_NCCL_LIBRARY is refused with the path in the message;
 *  - at world 3 (real processes), comm_nccl_id_share gives every rank the
 *    same 128 bytes (all-gathered and compared on every rank), not all zero,
 *    and a second exchange gives a different id;
 *  - comm_nccl_init returns (success on a GPU machine, an error naming the
 *    NCCL call with file:line here), never hangs, on rank 0 and the worker.
 * Skips (77) if libnccl.so.2 cannot be loaded or the build has no nccl.h.
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

#include "engine/comm/comm_nccl.h"
#include "engine/comm/ranks.h"

static const char *g_exe;

/* What rank 0 and the workers both check; returns the number of failures. */
static int id_suite(comm *c) {
    int rank = comm_rank(c), world = comm_world(c), bad = 0;
    uint8_t id[COMM_NCCL_ID_BYTES], id2[COMM_NCCL_ID_BYTES], all[8 * COMM_NCCL_ID_BYTES];
    specd_err e = {{0}};
    if (comm_nccl_id_share(c, id, &e) || comm_nccl_id_share(c, id2, &e)) {
        fprintf(stderr, "rank %d: id_share: %s\n", rank, e.msg);
        return 1;
    }
    if (comm_all_gather(c, id, sizeof id, all, &e)) {
        fprintf(stderr, "rank %d: all_gather: %s\n", rank, e.msg);
        return 1;
    }
    for (int r = 1; r < world; r++)
        if (memcmp(all, all + (size_t)r * COMM_NCCL_ID_BYTES, COMM_NCCL_ID_BYTES) != 0) {
            fprintf(stderr, "rank %d: rank %d holds another NCCL id than rank 0\n", rank, r);
            bad++;
        }
    int nonzero = 0;
    for (size_t i = 0; i < sizeof id; i++) nonzero |= id[i];
    if (!nonzero) {
        fprintf(stderr, "rank %d: the NCCL id is all zero\n", rank);
        bad++;
    }
    if (memcmp(id, id2, sizeof id) == 0) {
        fprintf(stderr, "rank %d: two exchanges gave the same id\n", rank);
        bad++;
    }
    /* Init at world 2 (ranks 0 and 1): must return either way, within the timeout. */
    if (rank < 2) {
        comm_nccl *nc = NULL;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int rc = comm_nccl_init(id, rank, 2, 20000, &nc, &e);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
        printf("rank %d: comm_nccl_init -> %d in %.1f ms%s%s\n", rank, rc, ms, rc ? ": " : "", rc ? e.msg : "");
        if (rc != 0 && !(strstr(e.msg, "comm_nccl.c:") && strstr(e.msg, "nccl"))) {
            fprintf(stderr, "rank %d: init error without file:line / NCCL reason: %s\n", rank, e.msg);
            bad++;
        }
        comm_nccl_destroy(nc);
    }
    return bad;
}

/* main tries a bad path before anything loads the library (a success is cached). */
static int g_bad_rc;
static specd_err g_bad_err;
static int g_version;

static void test_bad_library_path(void **st) {
    (void)st;
    assert_int_equal(g_bad_rc, -1);
    assert_non_null(strstr(g_bad_err.msg, "/nonexistent/libnccl.so.2"));
    /* The failure was not cached: the real library loaded afterwards (main). */
    printf("NCCL version code %d\n", g_version);
    assert_true(g_version >= 21400);
}

static void test_id_exchange_world3(void **st) {
    (void)st;
    const char *argv[] = {g_exe, NULL};
    ranks_config cfg = {.world = 3, .worker_argv = argv, .comm = comm_config_default()};
    cfg.comm.timeout_ms = 30000;
    specd_err e = {{0}};
    ranks *rk = NULL;
    if (ranks_launch(&cfg, &rk, &e)) fail_msg("%s", e.msg);
    assert_int_equal(id_suite(ranks_comm(rk)), 0);
    if (ranks_shutdown(rk, 30000, &e)) fail_msg("shutdown (a worker's check failed?): %s", e.msg);
    ranks_destroy(rk);
}

int main(int argc, char **argv) {
    ranks_worker w;
    specd_err e = {{0}};
    int wk = ranks_worker_detect(argc, argv, &w, &e);
    if (wk < 0) return 2;
    if (wk == 1) {
        comm *c = NULL;
        if (ranks_worker_attach(&w, &c, &e)) return 2;
        int bad = id_suite(c);
        uint8_t b[16];
        size_t n;
        comm_step_kind kind;
        if (comm_step_recv(c, b, sizeof b, &n, &kind, 0, &e) || kind != COMM_STEP_SHUTDOWN) bad++;
        comm_destroy(c);
        return bad ? 3 : 0;
    }
    g_exe = argv[0];
    setenv("SPECD_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
    g_bad_rc = comm_nccl_load(NULL, &g_bad_err);
    unsetenv("SPECD_NCCL_LIBRARY");
    if (comm_nccl_load(&g_version, &e)) {
        printf("SKIP: %s\n", e.msg);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_library_path),
        cmocka_unit_test(test_id_exchange_world3),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
