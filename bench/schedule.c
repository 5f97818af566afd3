/*
 * schedule.c: xoshiro256**, gamma variates and the arrival schedule (see
 * schedule.h for the distributions and their sources).
 */
#include "bench/schedule.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

void bench_rng_seed(bench_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

uint64_t bench_rng_next(bench_rng *r) {
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double bench_rng_uniform(bench_rng *r) {
    /* 53 random bits, shifted by half an ulp so that 0 is never returned. */
    return ((double)(bench_rng_next(r) >> 11) + 0.5) * 0x1.0p-53;
}

int64_t bench_rng_int(bench_rng *r, int64_t lo, int64_t hi) {
    uint64_t span = (uint64_t)(hi - lo) + 1;
    if (span == 0) return (int64_t)bench_rng_next(r); /* full 64-bit range */
    /* Rejection removes the modulo bias. */
    uint64_t limit = UINT64_MAX - UINT64_MAX % span;
    uint64_t v;
    do v = bench_rng_next(r);
    while (v >= limit);
    return lo + (int64_t)(v % span);
}

double bench_rng_normal(bench_rng *r) {
    double u, v, s;
    do {
        u = 2.0 * bench_rng_uniform(r) - 1.0;
        v = 2.0 * bench_rng_uniform(r) - 1.0;
        s = u * u + v * v;
    } while (s >= 1.0 || s == 0.0);
    return u * sqrt(-2.0 * log(s) / s);
}

double bench_rng_gamma(bench_rng *r, double shape, double scale) {
    if (shape < 1.0) {
        double u = bench_rng_uniform(r);
        return bench_rng_gamma(r, shape + 1.0, scale) * pow(u, 1.0 / shape);
    }
    double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x, v;
        do {
            x = bench_rng_normal(r);
            v = 1.0 + c * x;
        } while (v <= 0.0);
        v = v * v * v;
        double u = bench_rng_uniform(r);
        if (u < 1.0 - 0.0331 * x * x * x * x) return d * v * scale;
        if (log(u) < 0.5 * x * x + d * (1.0 - v + log(v))) return d * v * scale;
    }
}

int bench_schedule_build(double *t, size_t n, double rate, double burstiness, uint64_t seed) {
    if (!(rate > 0) || !(burstiness > 0)) return -1;
    if (isinf(rate)) {
        for (size_t i = 0; i < n; i++) t[i] = 0.0;
        return 0;
    }
    bench_rng r;
    bench_rng_seed(&r, seed ^ 0x5CEDu); /* own stream, independent of the workload's */
    double theta = 1.0 / (rate * burstiness), now = 0.0;
    for (size_t i = 0; i < n; i++) {
        t[i] = now;
        now += bench_rng_gamma(&r, burstiness, theta);
    }
    return 0;
}
