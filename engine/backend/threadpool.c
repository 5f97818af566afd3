/* threadpool.c: see threadpool.h.
 *
 * One atomic word, `claim`, carries both the current job's number (high
 * bits) and how many of its chunks are still unclaimed (low CHUNK_BITS).
 * tpool_run writes the job's fields, then publishes the word; a thread takes
 * a chunk by decrementing the count with a compare-and-swap that also checks
 * the job number, so a thread that woke late can never take a chunk of a
 * job it did not see published (and never runs a chunk twice). A thread
 * adds the chunks it ran to `finished` when it leaves the job; the caller
 * returns once every chunk of its job has finished, and waits for no thread that claimed nothing: a worker that was
 * asleep or descheduled while the caller did all the work costs the caller
 * nothing (before this, the caller waited for every worker to check in to
 * every job, so on an oversubscribed machine each of a step's ~150 jobs
 * waited for a descheduled worker to be scheduled again).
 * The job's fields are read only after a successful claim: the job cannot
 * finish (and the caller cannot overwrite them for the next job) while a
 * claimed chunk is unfinished.
 * Waiting workers spin (with pause) for a short while, then sleep on a
 * condition variable; the caller broadcasts when some are asleep. */
#include "engine/backend/threadpool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#define SPIN_ITERS 4000 /* ~20 us of pause instructions */
#define CHUNK_BITS 24   /* chunks per job < 2^24; the job number has the other 40 bits */
#define CHUNK_MAX ((1ull << CHUNK_BITS) - 1)

struct tpool {
    int n;                      /* threads including the caller */
    pthread_t *th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Alignas(64) atomic_uint_fast64_t claim; /* (job << CHUNK_BITS) | chunks of that job not yet claimed */
    _Alignas(64) atomic_int_fast64_t finished; /* chunks of the current job finished (each thread adds its
                                                  count once, after its last chunk of the job) */
    _Alignas(64) atomic_int sleepers;
    atomic_int stop;
    uint64_t job;               /* the caller's job counter (caller only) */
    /* the current job: written before claim is published, read after a successful claim */
    tpool_fn fn;
    void *arg;
    int64_t n_items, grain, n_chunks;
};

typedef struct { tpool *p; int tid; } worker_arg;

static inline uint64_t job_of(uint64_t v) { return v >> CHUNK_BITS; }

/* Takes and runs chunks of job `job` until none is left (or the job is not
 * current), then adds how many it ran to `finished` (one atomic add per
 * thread and job, not per chunk: the claim word is the only line the threads
 * share per chunk). */
static void run_job(tpool *p, uint64_t job, int tid) {
    uint64_t v = atomic_load(&p->claim);
    int64_t ran = 0;
    for (;;) {
        if (job_of(v) != job || (v & CHUNK_MAX) == 0) break;
        if (!atomic_compare_exchange_weak(&p->claim, &v, v - 1)) continue; /* v reloaded */
        const int64_t c = p->n_chunks - (int64_t)(v & CHUNK_MAX), b = c * p->grain;
        const int64_t e = b + p->grain < p->n_items ? b + p->grain : p->n_items;
        p->fn(p->arg, b, e, tid);
        ran++;
        v = atomic_load(&p->claim);
    }
    if (ran) atomic_fetch_add(&p->finished, ran);
}

static void *worker(void *va) {
    worker_arg wa = *(worker_arg *)va;
    free(va);
    tpool *p = wa.p;
    uint64_t seen = 0; /* the last job this worker looked at */
    for (;;) {
        int spins = 0;
        while (job_of(atomic_load(&p->claim)) == seen && !atomic_load(&p->stop)) {
            if (++spins < SPIN_ITERS) { _mm_pause(); continue; }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (job_of(atomic_load(&p->claim)) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
            break;
        }
        if (atomic_load(&p->stop)) return NULL;
        seen = job_of(atomic_load(&p->claim));
        run_job(p, seen, wa.tid);
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
    atomic_store(&p->stop, 1);
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
    if ((n + grain - 1) / grain > (int64_t)CHUNK_MAX) grain = (n + (int64_t)CHUNK_MAX - 1) / (int64_t)CHUNK_MAX;
    p->fn = fn;
    p->arg = arg;
    p->n_items = n;
    p->grain = grain;
    p->n_chunks = (n + grain - 1) / grain;
    atomic_store(&p->finished, 0);
    const uint64_t job = ++p->job & ((1ull << (64 - CHUNK_BITS)) - 1);
    atomic_store(&p->claim, (job << CHUNK_BITS) | (uint64_t)p->n_chunks); /* publish (seq_cst) */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    run_job(p, job, 0);
    /* wait for the chunks other threads claimed (none, if they did not wake in time) */
    int spins = 0;
    while (atomic_load(&p->finished) < p->n_chunks) {
        if (++spins < SPIN_ITERS) _mm_pause();
        else sched_yield();
    }
}
