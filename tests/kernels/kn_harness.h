/*
 * kn_harness.h: what every GPU test shares (llm.c dev/cuda style): the skip
 * rule, device buffers, and the error measures.
 *
 *  - kn_harness_require_gpu(): no usable GPU -> prints why and exits 77
 *    (ctest: skipped). Every GPU test calls it first.
 *  - NMSE (llama.cpp test-backend-ops): sum (a - b)^2 / sum b^2 over all
 *    elements, with b the CPU reference; bounds are stated per op in the test.
 *  - Batch invariance is checked bitwise (memcmp), never with a tolerance.
 *  - KN_CK / KN_EXPECT / kn_fails: the die-on-error check and the counted
 *    expectation; kn_mix64 / kn_hval: the seeded data every test generates.
 */
#ifndef SPECD_TESTS_KN_HARNESS_H
#define SPECD_TESTS_KN_HARNESS_H

#include <math.h>
#include <stdint.h>
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

/* Reduced sizes, for tools/kn_emu (a CPU emulation that runs every CUDA
 * thread as a fiber on one core, README there): KN_TEST_SMALL set to
 * anything but "" or "0". Each test says what it shrinks; every check and
 * code path stays, only rows / contexts / sample counts get smaller. Never
 * set for a GPU run: the full sizes are the default. Prints a line when on. */
static inline int kn_harness_small(void) {
    static int said;
    const char *s = getenv("KN_TEST_SMALL");
    const int on = s && *s && strcmp(s, "0") != 0;
    if (on && !said++) printf("KN_TEST_SMALL: reduced sizes (emulation mode; the GPU default is full size)\n");
    return on;
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

/* Checks a kn_* / cuda* return value in a test or benchmark: logs
 * "file:line: call: error" (kn_strerror) to stderr and exits 1. */
#define KN_CK(call)                                                                             \
    do {                                                                                        \
        int kn_ck_rc_ = (int)(call);                                                            \
        if (kn_ck_rc_ != 0) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, kn_strerror(kn_ck_rc_)); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

/* The test's expectation counters: KN_EXPECT counts every check, prints
 * "FAIL file:line: message" and counts a failure; main returns
 * kn_fails ? 1 : 0. One test = one translation unit, so a static is one
 * counter per test. */
__attribute__((unused)) static int kn_fails, kn_checks;
#define KN_EXPECT(cond, ...)                            \
    do {                                                \
        kn_checks++;                                    \
        if (!(cond)) {                                  \
            kn_fails++;                                 \
            printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                        \
            printf("\n");                               \
        }                                               \
    } while (0)

/* splitmix64's finaliser (Steele et al.), the tests' seeded hash. */
static inline uint64_t kn_mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A value uniform in [-1, 1) from (stream, a, b, c), with 24 significant
 * bits (so bf16 rounding ties occur): the same input always gives the same
 * value, so CPU and GPU sides generate identical data independently. */
static inline float kn_hval(uint64_t stream, uint64_t a, uint64_t b, uint64_t c) {
    uint64_t x = kn_mix64(kn_mix64(kn_mix64(stream) ^ a) ^ b) ^ c;
    x = kn_mix64(x);
    return (float)((double)(x >> 40) * 0x1.0p-24 * 2.0 - 1.0);
}

#endif
