/*
 * kn_philox.h: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random
 * numbers: as easy as 1, 2, 3", SC 2011), the counter-based generator of the
 * device sampler, written once for C (host references, tests) and CUDA (the
 * kernels): the same function gives the same bits on both sides.
 *
 * Keying of specd's draws: key = the request's 64-bit seed (lo, hi words);
 * counter = (absolute position of the token being chosen, draw index, 0, 0).
 * Draw indices: 0 = the plain sampling draw / the acceptance test of a draft
 * at that position; 1 = the residual draw after a rejection. A uniform takes
 * 53 bits of the 4x32 output: (w0 << 21) | (w1 >> 11), times 2^-53, in
 * [0, 1) (the CPU sampler's sampler_rng_uniform resolution). So a token's
 * randomness depends on (seed, position, draw) only: never on the batch, the
 * row order or how many steps ran before.
 *
 * Known answers (Random123 kat_vectors, checked in tests/kernels/test_kn_sample.c):
 * ctr 0, key 0 -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8.
 *
 * No state; pure functions.
 */
#ifndef SPECD_KERNELS_KN_PHILOX_H
#define SPECD_KERNELS_KN_PHILOX_H

#include <stdint.h>

#ifdef __CUDACC__
#define KN_PHILOX_FN static __host__ __device__ __forceinline__
#else
#define KN_PHILOX_FN static inline
#endif

/* 32 x 32 -> 64-bit product split into hi / lo words. */
KN_PHILOX_FN uint32_t kn_philox_mulhilo(uint32_t a, uint32_t b, uint32_t *hi) {
    uint64_t p = (uint64_t)a * (uint64_t)b;
    *hi = (uint32_t)(p >> 32);
    return (uint32_t)p;
}

/* out[4] = Philox4x32-10(ctr[4], key[2]). */
KN_PHILOX_FN void kn_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k0 += 0x9E3779B9u; /* golden ratio */
            k1 += 0xBB67AE85u; /* sqrt(3) - 1 */
        }
        uint32_t hi0, hi1;
        uint32_t lo0 = kn_philox_mulhilo(0xD2511F53u, c0, &hi0);
        uint32_t lo1 = kn_philox_mulhilo(0xCD9E8D57u, c2, &hi1);
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0, c1 = lo1, c2 = n2, c3 = lo0;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/* Uniform double in [0, 1) for (seed, position, draw index). */
KN_PHILOX_FN double kn_philox_uniform(uint64_t seed, int32_t pos, uint32_t draw) {
    const uint32_t ctr[4] = {(uint32_t)pos, draw, 0u, 0u};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t o[4];
    kn_philox4x32_10(ctr, key, o);
    const uint64_t bits = ((uint64_t)o[0] << 21) | (uint64_t)(o[1] >> 11);
    return (double)bits * (1.0 / 9007199254740992.0); /* 2^-53 */
}

#endif
