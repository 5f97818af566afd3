/* cpu_internal.h: private state of the CPU backend shared by its files. */
#ifndef SPECD_BACKEND_CPU_INTERNAL_H
#define SPECD_BACKEND_CPU_INTERNAL_H

#include "engine/backend/backend.h"

#include "engine/backend/threadpool.h"

#define CPU_MAX_THREADS 256

/* Grow-only per-thread scratch (tid-indexed), reused across ops. */
typedef struct cpu_scratch {
    float *buf;
    size_t cap; /* floats */
} cpu_scratch;

typedef struct cpu_ctx {
    int n_threads; /* pool threads per op, caller included */
    tpool *pool;
    cpu_scratch scratch[CPU_MAX_THREADS];
    int avx2;      /* AVX2 + FMA + F16C available */
    char desc[96];
} cpu_ctx;

/* Scratch of at least n floats for thread tid (NULL on allocation failure). */
float *cpu_scratch_get(cpu_ctx *ctx, int tid, size_t n);

int cpu_matmul(void *ctx, const bk_weight *w, const float *x, int32_t T, float *y);

#endif
