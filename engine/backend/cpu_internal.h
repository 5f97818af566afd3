/* cpu_internal.h: private state of the CPU backend shared by its files. */
#ifndef SPECD_BACKEND_CPU_INTERNAL_H
#define SPECD_BACKEND_CPU_INTERNAL_H

#include "engine/backend/backend.h"

typedef struct cpu_ctx {
    int n_threads; /* OpenMP threads per op */
    int avx2;      /* AVX2 + FMA + F16C available */
    char desc[96];
} cpu_ctx;

int cpu_matmul(void *ctx, const bk_weight *w, const float *x, int32_t T, float *y);

#endif
