/*
 * stats.c: mean, population std, min/max and numpy-compatible percentiles
 * (see stats.h for the definitions). Sorting uses qsort on a private copy;
 * samples are at most a few million doubles (ITLs of a long run).
 */
#include "bench/stats.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_percentile_sorted(const double *sorted, size_t n, double q) {
    if (n == 0) return NAN;
    if (q < 0) q = 0;
    if (q > 100) q = 100;
    double h = (double)(n - 1) * (q / 100.0);
    double lo_f = floor(h);
    size_t lo = (size_t)lo_f;
    if (lo >= n - 1) return sorted[n - 1];
    double t = h - lo_f;
    double a = sorted[lo], b = sorted[lo + 1], d = b - a;
    /* Interpolate from the nearer end, as numpy's _lerp does: this keeps
     * the result monotone in t and exact at both ends. */
    return t >= 0.5 ? b - d * (1.0 - t) : a + d * t;
}

int bench_summary_compute(bench_summary *s, const double *x, size_t n,
                          const double *qs, size_t n_q) {
    memset(s, 0, sizeof *s);
    if (n_q > BENCH_MAX_PERCENTILES) return -1;
    s->n = n;
    s->n_pct = n_q;
    for (size_t i = 0; i < n_q; i++) s->pct_q[i] = qs[i];
    if (n == 0) return 0;
    double *v = malloc(n * sizeof *v);
    if (!v) return -1;
    memcpy(v, x, n * sizeof *v);
    qsort(v, n, sizeof *v, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++) sum += v[i];
    s->mean = sum / (double)n;
    double ss = 0;
    for (size_t i = 0; i < n; i++) ss += (v[i] - s->mean) * (v[i] - s->mean);
    s->std = sqrt(ss / (double)n);
    s->min = v[0];
    s->max = v[n - 1];
    s->median = bench_percentile_sorted(v, n, 50);
    for (size_t i = 0; i < n_q; i++) s->pct_v[i] = bench_percentile_sorted(v, n, qs[i]);
    free(v);
    return 0;
}

double bench_summary_pct(const bench_summary *s, double q) {
    for (size_t i = 0; i < s->n_pct; i++)
        if (s->pct_q[i] == q) return s->pct_v[i];
    return NAN;
}

void bench_pct_word(double q, char *buf, size_t cap) {
    if (q == floor(q)) snprintf(buf, cap, "%d", (int)q);
    else snprintf(buf, cap, "%g", q);
}
