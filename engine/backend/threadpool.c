/* threadpool.c: see threadpool.h. Workers wait on a generation counter:
 * spin (with pause) for a short while, then sleep on a condition variable. */
#include "engine/backend/threadpool.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <stdlib.h>

#define SPIN_ITERS 4000 /* ~20 us of pause instructions */

struct tpool {
    int n;                    /* threads including the caller */
    pthread_t *th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint_fast64_t gen; /* bumped per job */
    atomic_int sleepers;
    atomic_int done;          /* workers finished with the current job */
    int stop;
    /* current job */
    tpool_fn fn;
    void *arg;
    int64_t n_items, grain;
    atomic_int_fast64_t next; /* next chunk start */
};

typedef struct { tpool *p; int tid; } worker_arg;

static void run_chunks(tpool *p, int tid) {
    for (;;) {
        int64_t b = atomic_fetch_add(&p->next, p->grain);
        if (b >= p->n_items) break;
        int64_t e = b + p->grain < p->n_items ? b + p->grain : p->n_items;
        p->fn(p->arg, b, e, tid);
    }
}

static void *worker(void *va) {
    worker_arg wa = *(worker_arg *)va;
    free(va);
    tpool *p = wa.p;
    uint64_t seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load(&p->gen) == seen) {
            if (++spins < SPIN_ITERS) { _mm_pause(); continue; }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (atomic_load(&p->gen) == seen && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
            break;
        }
        if (p->stop) return NULL;
        seen = atomic_load(&p->gen);
        run_chunks(p, wa.tid);
        atomic_fetch_add(&p->done, 1);
    }
}

tpool *tpool_create(int n) {
    if (n < 1) n = 1;
    tpool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->th = calloc((size_t)n, sizeof(pthread_t));
    if (!p->th) { free(p); return NULL; }
    for (int i = 1; i < n; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa) { p->n = i; break; }
        wa->p = p;
        wa->tid = i;
        if (pthread_create(&p->th[i], NULL, worker, wa) != 0) { free(wa); p->n = i; break; }
    }
    return p;
}

void tpool_destroy(tpool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    atomic_fetch_add(&p->gen, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->th);
    free(p);
}

int tpool_size(const tpool *p) { return p->n; }

void tpool_run(tpool *p, tpool_fn fn, void *arg, int64_t n, int64_t grain) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (p->n == 1 || n <= grain) { fn(arg, 0, n, 0); return; }
    p->fn = fn;
    p->arg = arg;
    p->n_items = n;
    p->grain = grain;
    atomic_store(&p->next, 0);
    atomic_store(&p->done, 0);
    atomic_fetch_add(&p->gen, 1); /* publish (seq_cst) */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    run_chunks(p, 0);
    int spins = 0;
    while (atomic_load(&p->done) < p->n - 1) {
        if (++spins < SPIN_ITERS) _mm_pause();
        else sched_yield();
    }
}
