/*
 * test_comm_shm.c: the shared-memory communicator and the rank processes,
 * with real processes: this binary is rank 0 (the cmocka tests) and, re-
 * executed by ranks_launch with --case=NAME plus the --specd-comm-* arguments,
 * every worker (worker_main below). Workers check their own results and
 * report through their exit status (0 = every check passed), which rank 0
 * asserts after the drain.
 *
 * What is compared with what:
 *  - all-reduce at world 2, 3, 4, 8, sizes 1, 7, 4096, 115000 floats: every
 *    rank's result bit-equal to the serial rank-order f32 sum computed in
 *    comm_suite.h, equal across ranks and across 3 repetitions, with the
 *    default algorithm choice, one-shot forced with a 64 KB slot (chunked) and
 *    two-shot forced;
 *  - all-gather and broadcast contents (chunked through a 4 KB slot), barrier
 *    waits for the slowest rank, the step channel delivers 200 messages in
 *    order through a 2-deep ring, and drains;
 *  - failures: a worker SIGKILLed mid-collective -> every other rank fails
 *    naming "rank 2" and "signal 9" in < 1 s; a SIGSTOPped worker -> timeout
 *    error naming it; rank 0 SIGKILLed -> its workers die within 1 s; abort
 *    from a worker reaches everybody with its reason; mismatched collectives
 *    and oversize messages are refused; malformed worker arguments.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine/comm/comm.h"
#include "engine/comm/ranks.h"
#include "tests/comm/comm_suite.h"

/* The detection bound comm.h / ranks.h state for a dead or aborting rank. */
#define DETECT_BOUND_MS 1000

static const char *g_exe;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ================================= workers ================================== */

enum { WK_OK = 0, WK_ATTACH = 2, WK_CHECK = 3, WK_UNEXPECTED = 4 };

/* Expects err to be a failure whose message contains both needles. */
static int expect_err(const specd_err *e, const char *n1, const char *n2) {
    if (strstr(e->msg, n1) && (!n2 || strstr(e->msg, n2))) return WK_OK;
    fprintf(stderr, "worker: error '%s' lacks '%s'/'%s'\n", e->msg, n1, n2 ? n2 : "");
    return WK_CHECK;
}

/* The step case: 200 messages checked byte by byte; after the 200th, the hash
 * of all of them is compared with rank 0's (an all-gather inside the step, as
 * a real step does collectives). A message starting with "bad" fails the step. */
typedef struct step_ctx {
    comm *c;
    int got, bad;
    uint64_t h;
} step_ctx;

static int on_step(void *ctx, const void *msg, size_t n, specd_err *err) {
    step_ctx *sc = ctx;
    const uint8_t *b = msg;
    if (n >= 3 && !memcmp(b, "bad", 3)) return specd_err_set(err, "bad step %d", sc->got);
    for (size_t i = 0; i < n; i++)
        if (b[i] != gen_b((uint64_t)sc->got, 0, i)) {
            fprintf(stderr, "rank %d: step %d byte %zu wrong\n", comm_rank(sc->c), sc->got, i);
            sc->bad++;
            break;
        }
    sc->h = sc->h * 31 + fnv64(b, n) + n;
    if (++sc->got == 200) sc->bad += suite_same_everywhere(sc->c, sc->h, "step hash");
    if (sc->got % 20 == 0) sleep_ms(2); /* let rank 0 fill the ring */
    return 0;
}

static int worker_case(comm *c, const char *cs) {
    int rank = comm_rank(c);
    specd_err e = {{0}};
    if (!strcmp(cs, "allreduce")) return suite_all_reduce(c) ? WK_CHECK : WK_OK;
    if (!strcmp(cs, "gather")) {
        if (suite_gather_broadcast(c)) return WK_CHECK;
        sleep_ms(rank * 40); /* the barrier must wait for the slowest */
        return comm_barrier(c, &e) ? WK_UNEXPECTED : WK_OK;
    }
    if (!strcmp(cs, "loop")) { /* all-reduce until the group fails; the failure must name rank 2 */
        float buf[4096];
        for (;;) {
            for (int i = 0; i < 4096; i++) buf[i] = (float)i;
            if (comm_all_reduce_sum_f32(c, buf, 4096, &e)) return expect_err(&e, "rank 2", "signal 9");
        }
    }
    if (!strcmp(cs, "stop")) {
        if (comm_barrier(c, &e)) return WK_UNEXPECTED;
        if (rank == 2) raise(SIGSTOP); /* stops responding; rank 0 SIGKILLs it at the drain */
        float x = 1.0f;
        if (comm_all_reduce_sum_f32(c, &x, 1, &e) == 0) return WK_CHECK;
        return expect_err(&e, "rank 2", NULL);
    }
    if (!strcmp(cs, "abort")) {
        if (comm_barrier(c, &e)) return WK_UNEXPECTED;
        if (rank == 1) {
            comm_abort(c, "test abort from rank 1");
            return WK_OK;
        }
        if (comm_barrier(c, &e) == 0) return WK_CHECK;
        return expect_err(&e, "rank 1: test abort from rank 1", NULL);
    }
    if (!strcmp(cs, "mismatch")) { /* rank 0 all-reduces 7 floats, we 8 */
        float x[8] = {0};
        if (comm_all_reduce_sum_f32(c, x, 8, &e) == 0) return WK_CHECK;
        return expect_err(&e, "collective mismatch", NULL);
    }
    if (!strcmp(cs, "smallcap")) { /* our buffer is smaller than what rank 0 broadcasts */
        uint8_t b[16];
        size_t n = 0;
        if (comm_broadcast(c, 0, b, &n, sizeof b, &e) == 0) return WK_CHECK;
        return expect_err(&e, "exceeds rank", "buffer of 16 bytes");
    }
    if (!strcmp(cs, "barrierloop")) { /* until rank 0 dies */
        for (;;)
            if (comm_barrier(c, &e)) return WK_UNEXPECTED;
    }
    if (!strcmp(cs, "step") || !strcmp(cs, "stepfail")) { /* through ranks_worker_loop */
        step_ctx sc = {.c = c};
        if (ranks_worker_loop(c, on_step, &sc, &e)) {
            if (!strcmp(cs, "stepfail")) return expect_err(&e, "bad step 5", NULL);
            fprintf(stderr, "rank %d: worker loop: %s\n", rank, e.msg);
            return WK_UNEXPECTED;
        }
        return sc.got == 200 && !sc.bad ? WK_OK : WK_CHECK;
    }
    if (!strcmp(cs, "exit-before-attach") || !strcmp(cs, "hang-before-attach")) return WK_OK; /* the others */
    fprintf(stderr, "worker: unknown case '%s'\n", cs);
    return WK_UNEXPECTED;
}

static int worker_main(int argc, char **argv, const ranks_worker *w) {
    specd_err e = {{0}};
    comm *c = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--case=exit-before-attach") && w->rank == 2) return 5;
        if (!strcmp(argv[i], "--case=hang-before-attach") && w->rank == 1) sleep_ms(30000);
    }
    if (ranks_worker_attach(w, &c, &e)) {
        fprintf(stderr, "worker: %s\n", e.msg);
        return WK_ATTACH;
    }
    const char *cs = "";
    for (int i = 1; i < argc; i++)
        if (!strncmp(argv[i], "--case=", 7)) cs = argv[i] + 7;
    int rc = worker_case(c, cs);
    /* Cases that end without a failure wait for the drain, as a real worker does. */
    if (rc == WK_OK && strcmp(cs, "step") && strcmp(cs, "stepfail") && !comm_aborted(c, NULL, 0)) {
        uint8_t b[64];
        size_t n;
        comm_step_kind kind;
        if (comm_step_recv(c, b, sizeof b, &n, &kind, 0, &e) || kind != COMM_STEP_SHUTDOWN) rc = WK_UNEXPECTED;
    }
    comm_destroy(c);
    return rc;
}

/* ================================= rank 0 =================================== */

static ranks *launch(int world, const char *cs, comm_config cfg) {
    char arg[64];
    snprintf(arg, sizeof arg, "--case=%s", cs);
    const char *argv[] = {g_exe, arg, NULL};
    ranks_config rc = {.world = world, .worker_argv = argv, .comm = cfg, .attach_timeout_ms = 20000};
    specd_err e = {{0}};
    ranks *rk = NULL;
    if (ranks_launch(&rc, &rk, &e)) fail_msg("ranks_launch(world %d, %s): %s", world, cs, e.msg);
    assert_int_equal(comm_world(ranks_comm(rk)), world);
    assert_int_equal(comm_rank(ranks_comm(rk)), 0);
    return rk;
}

/* Drain, then every worker must have exited 0 (its own checks passed). */
static void drain_ok(ranks *rk) {
    specd_err e = {{0}};
    if (ranks_shutdown(rk, 20000, &e)) fail_msg("shutdown: %s", e.msg);
    ranks_destroy(rk);
}

static int wstatus_of(ranks *rk, int r) {
    int ws = -1;
    assert_true(ranks_exit_status(rk, r, &ws));
    return ws;
}

static void check_all_reduce(int world) {
    comm_config cfgs[3];
    cfgs[0] = comm_config_default();            /* default one/two-shot switch, 1 MiB slot */
    cfgs[1] = comm_config_default();
    cfgs[1].slot_bytes = 64 * 1024;             /* 115000 floats = 8 rounds */
    cfgs[1].oneshot_max_bytes = SIZE_MAX;       /* one-shot everywhere */
    cfgs[2] = comm_config_default();
    cfgs[2].oneshot_max_bytes = 1;              /* two-shot for every size > 1 float */
    for (int k = 0; k < 3; k++) {
        cfgs[k].timeout_ms = 20000;
        ranks *rk = launch(world, "allreduce", cfgs[k]);
        int bad = suite_all_reduce(ranks_comm(rk));
        if (bad) fail_msg("world %d config %d: %d all-reduce mismatches on rank 0", world, k, bad);
        drain_ok(rk);
    }
}

static void test_all_reduce_world2(void **st) { (void)st; check_all_reduce(2); }
static void test_all_reduce_world3(void **st) { (void)st; check_all_reduce(3); }
static void test_all_reduce_world4(void **st) { (void)st; check_all_reduce(4); }
static void test_all_reduce_world8(void **st) { (void)st; check_all_reduce(8); }

/* The inputs make order matter: without this, a bit-equality test of a
 * reordered sum could not fail. Reverse rank order must differ somewhere. */
static void test_inputs_are_order_sensitive(void **st) {
    (void)st;
    for (int world = 3; world <= 8; world++) {
        size_t n = 4096, differ = 0;
        float *ref = malloc(n * sizeof *ref);
        ref_sum(ref, 1000 + n, world, n);
        for (size_t i = 0; i < n; i++) {
            volatile float s = gen_f(1000 + n, world - 1, i);
            for (int r = world - 2; r >= 0; r--) s = s + gen_f(1000 + n, r, i);
            if (memcmp((const void *)&s, &ref[i], sizeof(float))) differ++;
        }
        free(ref);
        assert_true(differ > n / 100);
    }
}

/* World 1: no workers, collectives are local identities. */
static void test_world1(void **st) {
    (void)st;
    ranks *rk = launch(1, "none", comm_config_default());
    specd_err e = {{0}};
    float x[3] = {1.5f, -2.0f, 3.25f};
    assert_int_equal(comm_all_reduce_sum_f32(ranks_comm(rk), x, 3, &e), 0);
    assert_true(x[0] == 1.5f && x[1] == -2.0f && x[2] == 3.25f);
    assert_int_equal(comm_barrier(ranks_comm(rk), &e), 0);
    drain_ok(rk);
}

static void test_gather_broadcast_barrier(void **st) {
    (void)st;
    comm_config cfg = comm_config_default();
    cfg.slot_bytes = 4096; /* 10000-byte chunks and 20000-byte blobs take several rounds */
    cfg.timeout_ms = 20000;
    ranks *rk = launch(4, "gather", cfg);
    comm *c = ranks_comm(rk);
    assert_int_equal(suite_gather_broadcast(c), 0);
    specd_err e = {{0}};
    double t0 = now_ms();
    assert_int_equal(comm_barrier(c, &e), 0);
    double waited = now_ms() - t0;
    /* rank 3 sleeps 120 ms before the barrier (after the same broadcast rank 0 just finished) */
    assert_true(waited >= 100.0);
    drain_ok(rk);
}

static void test_step_channel(void **st) {
    (void)st;
    comm_config cfg = comm_config_default();
    cfg.step_depth = 2;
    cfg.step_max_bytes = 65536;
    cfg.timeout_ms = 20000;
    ranks *rk = launch(3, "step", cfg);
    comm *c = ranks_comm(rk);
    specd_err e = {{0}};
    uint8_t *b = malloc(65537);
    uint64_t h = 0;
    for (int s = 0; s < 200; s++) {
        size_t n = s == 0 ? 0 : s == 1 ? 65536 : (size_t)(suite_mix((uint64_t)s) % 65536);
        for (size_t i = 0; i < n; i++) b[i] = gen_b((uint64_t)s, 0, i);
        if (comm_step_send(c, COMM_STEP_DATA, b, n, &e)) fail_msg("step_send %d: %s", s, e.msg);
        h = h * 31 + fnv64(b, n) + n;
    }
    /* Oversize: refused on rank 0, group intact. */
    assert_int_equal(comm_step_send(c, COMM_STEP_DATA, b, 65537, &e), -1);
    assert_non_null(strstr(e.msg, "exceeds the step maximum"));
    assert_int_equal(comm_aborted(c, NULL, 0), 0);
    assert_int_equal(suite_same_everywhere(c, h, "step hash"), 0);
    free(b);
    drain_ok(rk);
}

static ranks *g_kill_rk;
static double g_kill_at;
static void *killer(void *arg) {
    (void)arg;
    sleep_ms(150);
    g_kill_at = now_ms();
    kill(ranks_pid(g_kill_rk, 2), SIGKILL);
    return NULL;
}

static void test_worker_killed_mid_collective(void **st) {
    (void)st;
    comm_config cfg = comm_config_default();
    cfg.timeout_ms = 10000; /* detection must come from the monitor, long before this */
    ranks *rk = launch(4, "loop", cfg);
    comm *c = ranks_comm(rk);
    g_kill_rk = rk;
    pthread_t th;
    pthread_create(&th, NULL, killer, NULL);
    specd_err e = {{0}};
    float buf[4096];
    int iters = 0;
    for (;; iters++) {
        for (int i = 0; i < 4096; i++) buf[i] = (float)i;
        if (comm_all_reduce_sum_f32(c, buf, 4096, &e)) break;
    }
    double detected = now_ms();
    pthread_join(th, NULL);
    double lat = detected - g_kill_at;
    printf("kill -> error on rank 0: %.2f ms after %d all-reduces: %s\n", lat, iters, e.msg);
    assert_true(iters > 0);
    assert_non_null(strstr(e.msg, "rank 2"));
    assert_non_null(strstr(e.msg, "signal 9"));
    assert_true(lat < DETECT_BOUND_MS);
    /* Future calls fail at once with the same reason. */
    assert_int_equal(comm_barrier(c, &e), -1);
    assert_non_null(strstr(e.msg, "signal 9"));
    specd_err se = {{0}};
    assert_int_equal(ranks_shutdown(rk, 5000, &se), -1); /* names the dead rank */
    double reaped = now_ms() - g_kill_at;
    printf("all workers reaped %.2f ms after the kill; shutdown says: %s\n", reaped, se.msg);
    assert_true(reaped < DETECT_BOUND_MS);
    int ws = wstatus_of(rk, 2);
    assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
    for (int r = 1; r < 4; r++)
        if (r != 2) {
            ws = wstatus_of(rk, r);
            if (!(WIFEXITED(ws) && WEXITSTATUS(ws) == 0)) fail_msg("rank %d's own check failed (status %#x)", r, ws);
        }
    ranks_destroy(rk);
}

static void test_stopped_worker_times_out(void **st) {
    (void)st;
    comm_config cfg = comm_config_default();
    cfg.timeout_ms = 300;
    ranks *rk = launch(3, "stop", cfg);
    comm *c = ranks_comm(rk);
    specd_err e = {{0}};
    assert_int_equal(comm_barrier(c, &e), 0);
    double t0 = now_ms();
    float x = 1.0f;
    assert_int_equal(comm_all_reduce_sum_f32(c, &x, 1, &e), -1);
    double t = now_ms() - t0;
    printf("stopped rank: %.1f ms: %s\n", t, e.msg);
    assert_non_null(strstr(e.msg, "timed out after 300 ms waiting for rank 2"));
    assert_true(t >= 290 && t < 300 + DETECT_BOUND_MS);
    assert_int_equal(ranks_shutdown(rk, 1000, &e), -1); /* rank 2 SIGKILLed at the drain */
    assert_true(WIFEXITED(wstatus_of(rk, 1)) && WEXITSTATUS(wstatus_of(rk, 1)) == 0);
    int ws = wstatus_of(rk, 2);
    assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
    ranks_destroy(rk);
}

static void test_abort_from_worker(void **st) {
    (void)st;
    comm_config cfg = comm_config_default();
    cfg.timeout_ms = 10000;
    ranks *rk = launch(4, "abort", cfg);
    comm *c = ranks_comm(rk);
    specd_err e = {{0}};
    assert_int_equal(comm_barrier(c, &e), 0);
    double t0 = now_ms();
    assert_int_equal(comm_barrier(c, &e), -1);
    printf("abort from rank 1 seen in %.2f ms: %s\n", now_ms() - t0, e.msg);
    assert_non_null(strstr(e.msg, "rank 1: test abort from rank 1"));
    assert_true(now_ms() - t0 < DETECT_BOUND_MS);
    specd_err se = {{0}};
    assert_int_equal(ranks_shutdown(rk, 5000, &se), -1); /* the group was aborted */
    for (int r = 1; r < 4; r++) assert_true(WIFEXITED(wstatus_of(rk, r)) && WEXITSTATUS(wstatus_of(rk, r)) == 0);
    ranks_destroy(rk);
}

static void test_mismatch_and_small_buffer(void **st) {
    (void)st;
    comm_config cfg = comm_config_default();
    cfg.timeout_ms = 10000;
    ranks *rk = launch(2, "mismatch", cfg);
    specd_err e = {{0}};
    float x[7] = {0};
    assert_int_equal(comm_all_reduce_sum_f32(ranks_comm(rk), x, 7, &e), -1);
    assert_non_null(strstr(e.msg, "collective mismatch"));
    assert_non_null(strstr(e.msg, "rank 1 called all_reduce(32 bytes"));
    ranks_shutdown(rk, 5000, &e);
    assert_true(WIFEXITED(wstatus_of(rk, 1)) && WEXITSTATUS(wstatus_of(rk, 1)) == 0);
    ranks_destroy(rk);

    rk = launch(2, "smallcap", cfg);
    uint8_t big[100] = {0};
    size_t n = sizeof big;
    assert_int_equal(comm_broadcast(ranks_comm(rk), 0, big, &n, 0, &e), 0); /* root is done... */
    assert_int_equal(comm_barrier(ranks_comm(rk), &e), -1);                 /* ...but the group is aborted */
    assert_non_null(strstr(e.msg, "broadcast of 100 bytes exceeds rank 1's buffer of 16 bytes"));
    ranks_shutdown(rk, 5000, &e);
    assert_true(WIFEXITED(wstatus_of(rk, 1)) && WEXITSTATUS(wstatus_of(rk, 1)) == 0);
    ranks_destroy(rk);
}

/* Rank 0 (a forked child of this test, which becomes the orphans' subreaper)
 * is SIGKILLed while its workers wait in a barrier: they must die within the bound. */
static void test_rank0_death_kills_workers(void **st) {
    (void)st;
    assert_int_equal(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t r0 = fork();
    assert_true(r0 >= 0);
    if (r0 == 0) {
        close(pfd[0]);
        ranks *rk = launch(3, "barrierloop", comm_config_default());
        pid_t pids[2] = {ranks_pid(rk, 1), ranks_pid(rk, 2)};
        if (write(pfd[1], pids, sizeof pids) != (ssize_t)sizeof pids) _exit(1);
        specd_err e;
        for (int i = 0; i < 20; i++) comm_barrier(ranks_comm(rk), &e);
        for (;;) comm_barrier(ranks_comm(rk), &e); /* killed in here by the parent */
    }
    close(pfd[1]);
    pid_t pids[2];
    assert_int_equal(read(pfd[0], pids, sizeof pids), (ssize_t)sizeof pids);
    close(pfd[0]);
    sleep_ms(50);
    double t0 = now_ms();
    kill(r0, SIGKILL);
    int ws;
    assert_int_equal(waitpid(r0, &ws, 0), r0);
    for (int k = 0; k < 2; k++) {
        pid_t got = 0;
        while ((got = waitpid(pids[k], &ws, WNOHANG)) == 0 && now_ms() - t0 < 5000) sleep_ms(1);
        assert_int_equal(got, pids[k]);
        printf("worker %d gone %.2f ms after rank 0 was killed (%s %d)\n", k + 1, now_ms() - t0,
               WIFSIGNALED(ws) ? "signal" : "status", WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws));
        assert_true(now_ms() - t0 < DETECT_BOUND_MS);
        /* Killed by PR_SET_PDEATHSIG, not by the slower getppid() check in its waits. */
        assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
    }
    prctl(PR_SET_CHILD_SUBREAPER, 0);
}

static void test_bad_arguments(void **st) {
    (void)st;
    ranks_worker w;
    specd_err e = {{0}};
    char *none[] = {"x", "--case=y", NULL};
    assert_int_equal(ranks_worker_detect(2, none, &w, &e), 0);
    char *partial[] = {"x", "--specd-comm-rank=1", NULL};
    assert_int_equal(ranks_worker_detect(2, partial, &w, &e), -1);
    assert_non_null(strstr(e.msg, "--specd-comm-world="));
    char *bad[] = {"x", "--specd-comm-rank=1x", NULL};
    assert_int_equal(ranks_worker_detect(2, bad, &w, &e), -1);
    assert_non_null(strstr(e.msg, "malformed"));
    char *range[] = {"x", "--specd-comm-rank=4", "--specd-comm-world=4", "--specd-comm-fd=3",
                     "--specd-comm-parent=1", NULL};
    assert_int_equal(ranks_worker_detect(5, range, &w, &e), -1);
    assert_non_null(strstr(e.msg, "out of range"));
    char *good[] = {"x", "--specd-comm-rank=3", "--specd-comm-world=4", "--specd-comm-fd=7",
                    "--specd-comm-parent=99", NULL};
    assert_int_equal(ranks_worker_detect(5, good, &w, &e), 1);
    assert_true(w.rank == 3 && w.world == 4 && w.fd == 7 && w.parent == 99);
    char *mixed[] = {"specd", "serve", "--specd-comm-rank=3", "m.gguf", "--specd-comm-world=4", "--port",
                     "--specd-comm-fd=7", "8080", "--specd-comm-parent=99", NULL};
    int mc = 9;
    ranks_worker_strip_args(&mc, mixed);
    assert_int_equal(mc, 5);
    assert_string_equal(mixed[1], "serve");
    assert_string_equal(mixed[2], "m.gguf");
    assert_string_equal(mixed[3], "--port");
    assert_string_equal(mixed[4], "8080");
    assert_null(mixed[5]);

    /* A file that is not a segment. */
    int fd = memfd_create("not-comm", 0);
    assert_int_equal(ftruncate(fd, 1 << 16), 0);
    comm *c = NULL;
    assert_int_equal(comm_shm_attach(fd, 1, 2, getpid(), &c, &e), -1);
    assert_non_null(strstr(e.msg, "not a comm segment"));
    assert_null(c);
    /* A real segment, the wrong world / a taken rank. */
    comm *c0 = NULL;
    int sfd = -1;
    assert_int_equal(comm_shm_create(2, NULL, &sfd, &c0, &e), 0);
    assert_int_equal(comm_shm_attach(dup(sfd), 1, 3, getpid(), &c, &e), -1);
    assert_non_null(strstr(e.msg, "world 2"));
    assert_int_equal(comm_shm_attach(dup(sfd), 1, 2, getpid(), &c, &e), 0);
    comm *c2 = NULL;
    assert_int_equal(comm_shm_attach(dup(sfd), 1, 2, getpid(), &c2, &e), -1);
    assert_non_null(strstr(e.msg, "already attached"));
    comm_destroy(c);
    comm_destroy(c0);
    close(sfd);
    assert_int_equal(comm_shm_create(0, NULL, &sfd, &c0, &e), -1);
    assert_int_equal(comm_shm_create(COMM_MAX_WORLD + 1, NULL, &sfd, &c0, &e), -1);
}

static void test_step_failure_reaches_rank0(void **st) {
    (void)st;
    comm_config cfg = comm_config_default();
    cfg.timeout_ms = 10000;
    ranks *rk = launch(2, "stepfail", cfg);
    comm *c = ranks_comm(rk);
    specd_err e = {{0}};
    uint8_t b[4096];
    int s;
    double t0 = now_ms();
    for (s = 0; s < 200; s++) {
        size_t n = 100;
        for (size_t i = 0; i < n; i++) b[i] = gen_b((uint64_t)s, 0, i);
        if (s == 5) memcpy(b, "bad", 3);
        if (comm_step_send(c, COMM_STEP_DATA, b, n, &e)) break;
    }
    if (s == 200) assert_int_equal(comm_barrier(c, &e), -1); /* all posted: the next collective fails */
    printf("worker's step failure seen by rank 0 after %d sends, %.2f ms: %s\n", s, now_ms() - t0, e.msg);
    assert_non_null(strstr(e.msg, "rank 1 step failed: bad step 5"));
    ranks_shutdown(rk, 5000, &e);
    assert_true(WIFEXITED(wstatus_of(rk, 1)) && WEXITSTATUS(wstatus_of(rk, 1)) == 0);
    ranks_destroy(rk);
}

/* A worker that exits before attaching fails the launch at once, naming it;
 * one that never attaches fails it at the attach timeout. Nothing is left running. */
static void test_launch_failures(void **st) {
    (void)st;
    const char *a1[] = {g_exe, "--case=exit-before-attach", NULL};
    ranks_config rc = {.world = 3, .worker_argv = a1, .comm = comm_config_default(), .attach_timeout_ms = 20000};
    specd_err e = {{0}};
    ranks *rk = NULL;
    double t0 = now_ms();
    assert_int_equal(ranks_launch(&rc, &rk, &e), -1);
    printf("launch: %.1f ms: %s\n", now_ms() - t0, e.msg);
    assert_null(rk);
    assert_non_null(strstr(e.msg, "rank 2"));
    assert_non_null(strstr(e.msg, "status 5"));
    assert_true(now_ms() - t0 < 5000);

    const char *a2[] = {g_exe, "--case=hang-before-attach", NULL};
    rc.worker_argv = a2;
    rc.attach_timeout_ms = 300;
    t0 = now_ms();
    assert_int_equal(ranks_launch(&rc, &rk, &e), -1);
    printf("launch: %.1f ms: %s\n", now_ms() - t0, e.msg);
    assert_non_null(strstr(e.msg, "timed out after 300 ms waiting for rank 1 to attach"));
    assert_true(now_ms() - t0 < 5000);
    /* Both launches reaped their workers: no child of ours is left. */
    assert_int_equal(waitpid(-1, NULL, WNOHANG), -1);
    assert_int_equal(errno, ECHILD);
}

int main(int argc, char **argv) {
    ranks_worker w;
    specd_err e = {{0}};
    int wk = ranks_worker_detect(argc, argv, &w, &e);
    if (wk < 0) {
        fprintf(stderr, "%s\n", e.msg);
        return WK_ATTACH;
    }
    if (wk == 1) return worker_main(argc, argv, &w);
    g_exe = argv[0];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_inputs_are_order_sensitive),
        cmocka_unit_test(test_world1),
        cmocka_unit_test(test_all_reduce_world2),
        cmocka_unit_test(test_all_reduce_world3),
        cmocka_unit_test(test_all_reduce_world4),
        cmocka_unit_test(test_all_reduce_world8),
        cmocka_unit_test(test_gather_broadcast_barrier),
        cmocka_unit_test(test_step_channel),
        cmocka_unit_test(test_step_failure_reaches_rank0),
        cmocka_unit_test(test_launch_failures),
        cmocka_unit_test(test_worker_killed_mid_collective),
        cmocka_unit_test(test_stopped_worker_times_out),
        cmocka_unit_test(test_abort_from_worker),
        cmocka_unit_test(test_mismatch_and_small_buffer),
        cmocka_unit_test(test_rank0_death_kills_workers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
