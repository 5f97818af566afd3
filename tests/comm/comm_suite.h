/*
 * comm_suite.h: what rank 0 (the cmocka test) and the workers (the same
 * binary re-executed by ranks_launch) both run, so that every rank checks its
 * own results against an independent reference.
 *
 *  - gen_f(seed, rank, i): rank r's input element i, a deterministic hash
 *    mapped to floats of both signs over 25 binades (2^-12 .. 2^12), so that
 *    f32 addition order matters: a reduction in another order gives other bits
 *    (test_comm_shm checks that this is so, so the bit-equality tests can fail).
 *  - ref_sum: the serial rank-order f32 sum computed here, element by element,
 *    with no code shared with engine/comm.
 *
 * Suites return the number of mismatches (0 = pass) and print each kind of
 * mismatch once, naming the rank.
 */
#ifndef SPECD_TESTS_COMM_SUITE_H
#define SPECD_TESTS_COMM_SUITE_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/comm/comm.h"

static inline uint64_t suite_mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static inline float gen_f(uint64_t seed, int rank, size_t i) {
    uint64_t h = suite_mix(seed * 0x100000001b3ULL ^ suite_mix(((uint64_t)rank << 40) ^ (uint64_t)i));
    float m = (float)(h >> 40) / 16777216.0f; /* [0, 1) */
    int e = (int)((h >> 8) % 25) - 12;
    float v = ldexpf(0.5f + m, e);
    return (h & 1) ? -v : v;
}

static inline uint8_t gen_b(uint64_t seed, int rank, size_t i) {
    return (uint8_t)(suite_mix(seed ^ ((uint64_t)rank << 48) ^ (i * 0x9e37ULL)) >> 17);
}

/* ref[i] = ((x_0[i] + x_1[i]) + x_2[i]) + ... in f32: the order comm.h promises. */
static inline void ref_sum(float *ref, uint64_t seed, int world, size_t n) {
    for (size_t i = 0; i < n; i++) {
        volatile float s = gen_f(seed, 0, i); /* volatile: no reassociation, no excess precision */
        for (int r = 1; r < world; r++) s = s + gen_f(seed, r, i);
        ref[i] = s;
    }
}

static inline uint64_t fnv64(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

/* Every rank ends with the same 64-bit value? (all_gather of it). */
static inline int suite_same_everywhere(comm *c, uint64_t v, const char *what) {
    uint64_t all[COMM_MAX_WORLD];
    specd_err e = {{0}};
    if (comm_all_gather(c, &v, sizeof v, all, &e)) {
        fprintf(stderr, "rank %d: %s: %s\n", comm_rank(c), what, e.msg);
        return 1;
    }
    for (int r = 0; r < comm_world(c); r++)
        if (all[r] != all[0]) {
            fprintf(stderr, "rank %d: %s: rank %d's result differs from rank 0's\n", comm_rank(c), what, r);
            return 1;
        }
    return 0;
}

static const size_t SUITE_AR_SIZES[] = {1, 7, 4096, 115000};
#define SUITE_AR_REPS 3

/* All-reduce at every size, SUITE_AR_REPS times: bit-equal to ref_sum, to the
 * first repetition, and across ranks. Also n = 0 (a no-op that synchronises). */
static inline int suite_all_reduce(comm *c) {
    int world = comm_world(c), rank = comm_rank(c), bad = 0;
    size_t nmax = 115000;
    float *buf = malloc(nmax * sizeof *buf), *ref = malloc(nmax * sizeof *ref), *first = malloc(nmax * sizeof *first);
    specd_err e = {{0}};
    for (size_t k = 0; k < sizeof SUITE_AR_SIZES / sizeof *SUITE_AR_SIZES; k++) {
        size_t n = SUITE_AR_SIZES[k];
        uint64_t seed = 1000 + n;
        ref_sum(ref, seed, world, n);
        for (int rep = 0; rep < SUITE_AR_REPS; rep++) {
            for (size_t i = 0; i < n; i++) buf[i] = gen_f(seed, rank, i);
            if (comm_all_reduce_sum_f32(c, buf, n, &e)) {
                fprintf(stderr, "rank %d: all_reduce(%zu): %s\n", rank, n, e.msg);
                bad++;
                goto out;
            }
            size_t diff = 0, at = 0;
            for (size_t i = 0; i < n; i++)
                if (memcmp(&buf[i], &ref[i], sizeof(float)) != 0 && diff++ == 0) at = i;
            if (diff) {
                fprintf(stderr, "rank %d world %d: all_reduce(%zu) rep %d: %zu elements differ from the rank-order "
                        "f32 sum, first at %zu: %.9g vs %.9g\n", rank, world, n, rep, diff, at, buf[at], ref[at]);
                bad++;
            }
            if (rep == 0)
                memcpy(first, buf, n * sizeof *buf);
            else if (memcmp(first, buf, n * sizeof *buf) != 0) {
                fprintf(stderr, "rank %d: all_reduce(%zu) rep %d differs from rep 0\n", rank, n, rep);
                bad++;
            }
            bad += suite_same_everywhere(c, fnv64(buf, n * sizeof *buf), "all_reduce result hash");
        }
    }
    if (comm_all_reduce_sum_f32(c, buf, 0, &e)) {
        fprintf(stderr, "rank %d: all_reduce(0): %s\n", rank, e.msg);
        bad++;
    }
out:
    free(buf);
    free(ref);
    free(first);
    return bad;
}

/* All-gather of 10000-byte chunks (several slot rounds when the slot is
 * small), in place and out of place; broadcast from every root of sizes 0, 1,
 * 5000 and 20000 bytes. */
static inline int suite_gather_broadcast(comm *c) {
    int world = comm_world(c), rank = comm_rank(c), bad = 0;
    const size_t cb = 10000;
    uint8_t *mine = malloc(cb), *out = malloc(cb * (size_t)world), *b = malloc(20000);
    specd_err e = {{0}};
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < cb; i++) mine[i] = gen_b(7 + (uint64_t)pass, rank, i);
        memset(out, 0xEE, cb * (size_t)world);
        const uint8_t *src = mine;
        if (pass == 1) { /* in place: my chunk already sits at its place in out */
            memcpy(out + (size_t)rank * cb, mine, cb);
            src = out + (size_t)rank * cb;
        }
        if (comm_all_gather(c, src, cb, out, &e)) {
            fprintf(stderr, "rank %d: all_gather: %s\n", rank, e.msg);
            bad++;
            goto out;
        }
        for (int r = 0; r < world; r++)
            for (size_t i = 0; i < cb; i++)
                if (out[(size_t)r * cb + i] != gen_b(7 + (uint64_t)pass, r, i)) {
                    fprintf(stderr, "rank %d: all_gather pass %d: byte %zu of rank %d's chunk is wrong\n", rank,
                            pass, i, r);
                    bad++;
                    r = world;
                    break;
                }
    }
    static const size_t sizes[] = {0, 1, 5000, 20000};
    for (int root = 0; root < world; root++)
        for (size_t k = 0; k < 4; k++) {
            size_t n = sizes[k], got = 12345;
            uint64_t seed = 100 + (uint64_t)root * 10 + k;
            if (rank == root)
                for (size_t i = 0; i < n; i++) b[i] = gen_b(seed, root, i);
            else
                memset(b, 0xEE, 20000);
            size_t nb = n;
            if (comm_broadcast(c, root, b, rank == root ? &nb : &got, 20000, &e)) {
                fprintf(stderr, "rank %d: broadcast(root %d, %zu B): %s\n", rank, root, n, e.msg);
                bad++;
                goto out;
            }
            if (rank != root && got != n) {
                fprintf(stderr, "rank %d: broadcast(root %d): got %zu bytes, sent %zu\n", rank, root, got, n);
                bad++;
            }
            for (size_t i = 0; i < n; i++)
                if (b[i] != gen_b(seed, root, i)) {
                    fprintf(stderr, "rank %d: broadcast(root %d, %zu B): byte %zu wrong\n", rank, root, n, i);
                    bad++;
                    break;
                }
        }
out:
    free(mine);
    free(out);
    free(b);
    return bad;
}

#endif
