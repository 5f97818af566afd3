/*
 * test_threadpool.c: the CPU backend's worker pool (engine/backend/threadpool.c).
 * Every item of every job runs exactly once (a per-item counter, checked
 * after each job), on a thread id in [0, threads); tpool_run returns only
 * after every chunk has finished, including one a worker holds while it
 * sleeps (the counters are read right after tpool_run returns); 20,000
 * back-to-back small jobs with varying sizes and grains (the decode pattern:
 * many short jobs, workers waking late) never lose or repeat an item; and
 * 1 to 4 threads, with more threads than cores, all agree.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "engine/backend/threadpool.h"

typedef struct job {
    atomic_int *hits; /* [n] */
    int threads;
    atomic_int bad_tid;
    int sleep_us;     /* > 0: every chunk a worker runs sleeps this long first */
} job;

static void count(void *va, int64_t b, int64_t e, int tid) {
    job *j = va;
    if (tid < 0 || tid >= j->threads) atomic_store(&j->bad_tid, 1);
    if (j->sleep_us && tid != 0) nanosleep(&(struct timespec){0, j->sleep_us * 1000L}, NULL);
    for (int64_t i = b; i < e; i++) atomic_fetch_add(&j->hits[i], 1);
}

static void run_checked(tpool *p, job *j, int64_t n, int64_t grain) {
    for (int64_t i = 0; i < n; i++) atomic_store(&j->hits[i], 0);
    tpool_run(p, count, j, n, grain);
    for (int64_t i = 0; i < n; i++)
        if (atomic_load(&j->hits[i]) != 1)
            fail_msg("%d threads, n %lld grain %lld: item %lld ran %d times", j->threads, (long long)n,
                     (long long)grain, (long long)i, atomic_load(&j->hits[i]));
    assert_int_equal(atomic_load(&j->bad_tid), 0);
}

static void test_every_item_once(void **st) {
    (void)st;
    enum { NMAX = 5000 };
    atomic_int *hits = malloc(sizeof(atomic_int) * NMAX);
    assert_non_null(hits);
    for (int threads = 1; threads <= 4; threads++) {
        tpool *p = tpool_create(threads);
        assert_non_null(p);
        assert_int_equal(tpool_size(p), threads);
        job j = {.hits = hits, .threads = threads};
        const int64_t shapes[][2] = {{1, 1}, {7, 1}, {64, 16}, {960, 16}, {4999, 3}, {5000, 4096}, {100, 200}};
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) run_checked(p, &j, shapes[s][0], shapes[s][1]);
        /* many short jobs back to back, sizes and grains varying */
        uint32_t r = 12345;
        for (int k = 0; k < 20000; k++) {
            r = r * 1103515245u + 12345u;
            const int64_t n = 1 + (r >> 8) % 300, grain = 1 + (r >> 20) % 40;
            run_checked(p, &j, n, grain);
        }
        /* a worker's chunk that is slow: tpool_run must wait for it */
        j.sleep_us = 2000;
        for (int k = 0; k < 20; k++) run_checked(p, &j, 64, 1);
        tpool_destroy(p);
    }
    free(hits);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_every_item_once)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
