/*
 * kn_harness.h: what every GPU test shares (llm.c dev/cuda style): the skip
 * rule, device buffers, and the error measures.
 *
 *  - kn_harness_require_gpu(): no usable GPU -> prints why and exits 77
 *    (ctest: skipped). Every GPU test calls it first.
 *  - NMSE (llama.cpp test-backend-ops): sum (a - b)^2 / sum b^2 over all
 *    elements, with b the CPU reference; bounds are stated per op in the test.
 *  - Batch invariance is checked bitwise (memcmp), never with a tolerance.
 */
#ifndef SPECD_TESTS_KN_HARNESS_H
#define SPECD_TESTS_KN_HARNESS_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kn.h"

static inline void kn_harness_require_gpu(void) {
    char why[256];
    if (kn_probe(0, why, sizeof why) != 0) {
        printf("SKIP: no usable GPU: %s\n", why);
        fflush(stdout);
        exit(77);
    }
}

/* Normalised mean squared error of got against the reference ref (n values). */
static inline double kn_nmse(const float *got, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)got[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * (double)ref[i];
    }
    return den > 0 ? num / den : num;
}

#endif
