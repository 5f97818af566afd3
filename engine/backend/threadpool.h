/*
 * threadpool.h: the CPU backend's worker pool.
 *
 * Why not OpenMP: libgomp workers spin at every barrier (GOMP_SPINCOUNT) and
 * a decode step had ~250 parallel regions (151 now: q/k/v and gate/up are
 * one job each); when the machine is shared (CI runs tests in parallel on 2
 * cores, or several servers share a box) that spinning starves the thread
 * doing real work (measured: 90% of cycles in libgomp's spin loop). This pool spins briefly (~20 us) and then sleeps on a condition
 * variable, so an oversubscribed machine degrades gracefully.
 *
 * tpool_run splits [0, n) into chunks of `grain` handed out dynamically; the
 * calling thread participates, and returns when every chunk has run; it does
 * not wait for workers that took no chunk (threadpool.c). Which thread runs a chunk never changes the
 * result as long as fn computes each output from its own inputs (batch
 * invariance is the callers' contract, see backend.h).
 * Threading: one tpool_run at a time per pool (the engine thread).
 */
#ifndef SPECD_BACKEND_THREADPOOL_H
#define SPECD_BACKEND_THREADPOOL_H

#include <stdint.h>

typedef struct tpool tpool;
/* fn(arg, begin, end, tid): process items [begin, end); tid in [0, n_threads). */
typedef void (*tpool_fn)(void *arg, int64_t begin, int64_t end, int tid);

tpool *tpool_create(int n_threads); /* n_threads >= 1 (1 = run inline); NULL on failure */
void tpool_destroy(tpool *p);       /* NULL ok */
int tpool_size(const tpool *p);
void tpool_run(tpool *p, tpool_fn fn, void *arg, int64_t n, int64_t grain);

#endif
