/*
 * stats.h: summary statistics of latency samples, matching numpy.
 *
 * Owns the maths behind every "mean / median / p90 / p99" that specd-bench
 * prints. Percentiles follow numpy.percentile's default method ("linear",
 * Hyndman & Fan definition 7): for sorted x[0..n-1] and q in [0, 100], the
 * virtual index is h = (n - 1) * q / 100 and the value is
 * x[floor(h)] + (h - floor(h)) * (x[floor(h)+1] - x[floor(h)]), evaluated
 * like numpy's _lerp (from the upper end when the fraction is >= 0.5) so that
 * results agree to the last bits. The standard deviation is the population
 * one (ddof = 0), numpy.std's default, which vLLM's bench serve reports.
 * An empty sample summarises to zeros with n = 0 (vLLM prints 0 then too).
 *
 * Threading: pure functions; bench_summary_compute sorts a private copy.
 */
#ifndef SPECD_BENCH_STATS_H
#define SPECD_BENCH_STATS_H

#include <stddef.h>

#define BENCH_MAX_PERCENTILES 16

typedef struct bench_summary {
    size_t n;
    double mean, std, median, min, max;
    size_t n_pct;                             /* number of requested percentiles */
    double pct_q[BENCH_MAX_PERCENTILES];      /* requested q values, 0..100 */
    double pct_v[BENCH_MAX_PERCENTILES];      /* their values, same unit as input */
} bench_summary;

/* numpy.percentile(sorted, q) with the default linear method.
 * sorted: n >= 1 values in ascending order; q in [0, 100] (clamped). */
double bench_percentile_sorted(const double *sorted, size_t n, double q);

/* Sorts a copy of x[0..n) and fills s (mean, std, median, min, max and the
 * n_q percentiles in qs). Returns 0, or -1 when out of memory or
 * n_q > BENCH_MAX_PERCENTILES. n may be 0. */
int bench_summary_compute(bench_summary *s, const double *x, size_t n,
                          const double *qs, size_t n_q);

/* Value of percentile q in s, or NAN when q was not requested. */
double bench_summary_pct(const bench_summary *s, double q);

/* Writes the vLLM-style key fragment of q: "99", "99.9", "50". */
void bench_pct_word(double q, char *buf, size_t cap);

#endif
