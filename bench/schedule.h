/*
 * schedule.h: seeded randomness and the request arrival schedule.
 *
 * Owns (1) a small deterministic PRNG (xoshiro256** seeded through
 * splitmix64, Blackman & Vigna) so that a --seed reproduces the same
 * workload and the same arrival times on every machine, and (2) the arrival
 * process of vLLM's `bench serve`: inter-arrival gaps are drawn from a gamma
 * distribution with shape = burstiness and scale = 1 / (rate * burstiness),
 * so the mean gap is 1/rate for any burstiness; burstiness 1 is a Poisson
 * process (exponential gaps), < 1 burstier, > 1 more regular. rate = +inf
 * sends everything at t = 0.
 *
 * The first request is sent at t = 0 and request i at the sum of the first i
 * gaps (vLLM sends, then sleeps). Gamma variates use Marsaglia & Tsang (2000)
 * for shape >= 1 and the boost X(k) = X(k+1) * U^(1/k) for shape < 1.
 * Threading: a bench_rng belongs to one thread.
 */
#ifndef SPECD_BENCH_SCHEDULE_H
#define SPECD_BENCH_SCHEDULE_H

#include <stddef.h>
#include <stdint.h>

typedef struct bench_rng {
    uint64_t s[4];
} bench_rng;

void bench_rng_seed(bench_rng *r, uint64_t seed);
uint64_t bench_rng_next(bench_rng *r);
/* Uniform double in the open interval (0, 1). */
double bench_rng_uniform(bench_rng *r);
/* Uniform integer in [lo, hi] (inclusive); lo <= hi. */
int64_t bench_rng_int(bench_rng *r, int64_t lo, int64_t hi);
/* Standard normal variate (Marsaglia polar method). */
double bench_rng_normal(bench_rng *r);
/* Gamma(shape, scale) variate; shape > 0, scale > 0. Mean shape * scale. */
double bench_rng_gamma(bench_rng *r, double shape, double scale);

/* Fills t[0..n) with send times in seconds from the start (t[0] = 0,
 * non-decreasing). rate: requests/s (> 0, may be INFINITY); burstiness > 0.
 * Returns 0, or -1 for a non-positive rate or burstiness. */
int bench_schedule_build(double *t, size_t n, double rate, double burstiness, uint64_t seed);

#endif
