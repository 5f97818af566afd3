/*
 * test_bench_schedule.c: the arrival schedule has the requested mean rate and
 * the gamma gap variance, for Poisson (burstiness 1), bursty (0.5) and
 * regular (4) arrivals.
 *
 * Bounds: with n gaps ~ Gamma(k, 1/(rate k)), their sum is exactly
 * Gamma(n k, 1/(rate k)), so the measured mean gap times rate has mean 1 and
 * standard deviation 1/sqrt(n k). We accept |mean_gap * rate - 1| <=
 * 5/sqrt(n k). With n k >= 10^4 the sum is normal to within a negligible
 * error, so one check fails by chance with probability ~5.7e-7.
 * The gap variance must be 1/(rate^2 k); the sample variance's relative
 * standard deviation is sqrt((2 + 6/k) / n) (gamma excess kurtosis 6/k), and
 * we accept 6 of them (chance failure ~2e-9 under normality; the heavier tail
 * of the variance estimate at k = 0.5 is covered by the extra sigma).
 * 12 (seed, burstiness) cases x 2 checks: total false-failure rate < 2e-5.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench/schedule.h"

#define N_GAPS 20000

static void check_rate(double rate, double k, uint64_t seed) {
    double *t = malloc((N_GAPS + 1) * sizeof *t);
    assert_int_equal(bench_schedule_build(t, N_GAPS + 1, rate, k, seed), 0);
    assert_true(t[0] == 0.0);
    double sum = 0, sum2 = 0;
    for (size_t i = 1; i <= N_GAPS; i++) {
        double g = t[i] - t[i - 1];
        assert_true(g >= 0.0);
        sum += g;
        sum2 += g * g;
    }
    double mean = sum / N_GAPS;
    double var = sum2 / N_GAPS - mean * mean;
    double rel = mean * rate - 1.0;
    double bound = 5.0 / sqrt(N_GAPS * k);
    double var_rel = var * rate * rate * k - 1.0;
    double var_bound = 6.0 * sqrt((2.0 + 6.0 / k) / N_GAPS);
    if (fabs(rel) > bound || fabs(var_rel) > var_bound)
        fprintf(stderr, "rate %g k %g seed %llu: mean err %.4g (bound %.4g), var err %.4g (bound %.4g)\n",
                rate, k, (unsigned long long)seed, rel, bound, var_rel, var_bound);
    assert_true(fabs(rel) <= bound);
    assert_true(fabs(var_rel) <= var_bound);
    free(t);
}

static void test_mean_rate(void **state) {
    (void)state;
    const double ks[] = {1.0, 0.5, 4.0};
    const uint64_t seeds[] = {0, 1, 42, 123456789};
    for (size_t i = 0; i < 3; i++)
        for (size_t j = 0; j < 4; j++) check_rate(j % 2 ? 2.5 : 40.0, ks[i], seeds[j]);
}

static void test_infinite_rate(void **state) {
    (void)state;
    double t[5];
    assert_int_equal(bench_schedule_build(t, 5, INFINITY, 1.0, 3), 0);
    for (int i = 0; i < 5; i++) assert_true(t[i] == 0.0);
    assert_int_equal(bench_schedule_build(t, 5, 0.0, 1.0, 3), -1);
    assert_int_equal(bench_schedule_build(t, 5, 1.0, 0.0, 3), -1);
}

static void test_deterministic(void **state) {
    (void)state;
    double a[64], b[64], c[64];
    bench_schedule_build(a, 64, 3.0, 1.0, 7);
    bench_schedule_build(b, 64, 3.0, 1.0, 7);
    bench_schedule_build(c, 64, 3.0, 1.0, 8);
    int same_c = 1;
    for (int i = 0; i < 64; i++) {
        assert_true(a[i] == b[i]);
        if (a[i] != c[i]) same_c = 0;
    }
    assert_false(same_c);
}

static void test_rng_int_range(void **state) {
    (void)state;
    bench_rng r;
    bench_rng_seed(&r, 99);
    int seen[7] = {0};
    for (int i = 0; i < 7000; i++) {
        int64_t v = bench_rng_int(&r, -3, 3);
        assert_true(v >= -3 && v <= 3);
        seen[v + 3]++;
    }
    /* each bucket expects 1000, sd ~29: 200 is ~7 sd */
    for (int i = 0; i < 7; i++) assert_true(seen[i] > 800 && seen[i] < 1200);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mean_rate),
        cmocka_unit_test(test_infinite_rate),
        cmocka_unit_test(test_deterministic),
        cmocka_unit_test(test_rng_int_range),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
