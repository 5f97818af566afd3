/*
 * stats_chi2.h: chi-square upper-tail probability for the statistical tests
 * (tests/runtime/test_spec.c, tests/spec/test_sampling_e2e.c,
 * tests/runtime/test_sampler.c's exhaustive acceptance test).
 * gamma_q(a, x) = Q(a, x), the regularized upper incomplete gamma function:
 * series for P when x < a + 1, Lentz's continued fraction for Q otherwise
 * (Numerical Recipes, section 6.2); chi2_sf(x, df) = Q(df/2, x/2).
 * test_spec.c and test_sampling_e2e.c check chi2_sf against tabulated
 * quantiles (scipy.stats.chi2).
 */
#ifndef SPECD_TESTS_STATS_CHI2_H
#define SPECD_TESTS_STATS_CHI2_H

#include <math.h>

static double gamma_q(double a, double x) { /* Q(a, x) = 1 - P(a, x) */
    if (x <= 0) return 1.0;
    if (x < a + 1) { /* series for P */
        double sum = 1.0 / a, term = sum;
        for (int n = 1; n < 1000; n++) {
            term *= x / (a + n);
            sum += term;
            if (term < sum * 1e-15) break;
        }
        return 1.0 - sum * exp(-x + a * log(x) - lgamma(a));
    }
    double b = x + 1 - a, c = 1e300, d = 1 / b, h = d; /* continued fraction for Q (Lentz) */
    for (int i = 1; i < 1000; i++) {
        double an = -i * (i - a);
        b += 2;
        d = an * d + b;
        if (fabs(d) < 1e-300) d = 1e-300;
        c = b + an / c;
        if (fabs(c) < 1e-300) c = 1e-300;
        d = 1 / d;
        double del = d * c;
        h *= del;
        if (fabs(del - 1) < 1e-15) break;
    }
    return exp(-x + a * log(x) - lgamma(a)) * h;
}
static double chi2_sf(double x, int df) { return gamma_q(df / 2.0, x / 2.0); }

#endif
