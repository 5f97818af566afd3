/*
 * test_bench_stats.c: summary statistics against numpy. The expected values
 * in tests/fixtures/bench/percentiles.json were computed by numpy
 * (np.percentile default "linear" method, np.mean, np.std ddof=0, np.median)
 * with tools/bench_gen_percentiles.py. Tolerance: 1e-12 relative (numpy sums
 * pairwise, we sum in order, so the mean may differ in the last bits).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/stats.h"

static void near(double got, double want, const char *what, const char *name) {
    double tol = 1e-12 * fmax(1.0, fabs(want));
    if (!(fabs(got - want) <= tol)) {
        fprintf(stderr, "%s/%s: got %.17g want %.17g\n", name, what, got, want);
        fail();
    }
}

static void test_against_numpy(void **state) {
    (void)state;
    const char *src = getenv("SPECD_SOURCE_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/tests/fixtures/bench/percentiles.json", src ? src : ".");
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) fprintf(stderr, "cannot read %s: %s\n", path, jerr.text);
    assert_non_null(root);
    json_t *cases = json_object_get(root, "cases");
    assert_true(json_array_size(cases) >= 5);
    size_t ci;
    json_t *c;
    json_array_foreach(cases, ci, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        json_t *jx = json_object_get(c, "x"), *jq = json_object_get(c, "q"),
               *jp = json_object_get(c, "percentile");
        size_t n = json_array_size(jx), nq = json_array_size(jq);
        double *x = malloc(n * sizeof *x), qs[BENCH_MAX_PERCENTILES];
        assert_true(nq <= BENCH_MAX_PERCENTILES);
        for (size_t i = 0; i < n; i++) x[i] = json_number_value(json_array_get(jx, i));
        for (size_t i = 0; i < nq; i++) qs[i] = json_number_value(json_array_get(jq, i));
        bench_summary s;
        assert_int_equal(bench_summary_compute(&s, x, n, qs, nq), 0);
        assert_int_equal(s.n, n);
        near(s.mean, json_number_value(json_object_get(c, "mean")), "mean", name);
        near(s.std, json_number_value(json_object_get(c, "std")), "std", name);
        near(s.median, json_number_value(json_object_get(c, "median")), "median", name);
        near(s.min, json_number_value(json_object_get(c, "min")), "min", name);
        near(s.max, json_number_value(json_object_get(c, "max")), "max", name);
        for (size_t i = 0; i < nq; i++) {
            char what[32];
            snprintf(what, sizeof what, "p%g", qs[i]);
            near(s.pct_v[i], json_number_value(json_array_get(jp, i)), what, name);
            near(bench_summary_pct(&s, qs[i]), s.pct_v[i], what, name);
        }
        free(x);
    }
    json_decref(root);
}

/* Hand-derived: x = [1, 2, 3, 4]; h = 3q/100. p50: h=1.5 -> 2.5; p90: h=2.7 ->
 * 3.7; p99: h=2.97 -> 3.97; p0 -> 1; p100 -> 4. */
static void test_by_hand(void **state) {
    (void)state;
    const double x[] = {4, 1, 3, 2};
    const double qs[] = {0, 50, 90, 99, 100};
    bench_summary s;
    assert_int_equal(bench_summary_compute(&s, x, 4, qs, 5), 0);
    assert_true(fabs(s.pct_v[0] - 1.0) < 1e-15);
    assert_true(fabs(s.pct_v[1] - 2.5) < 1e-15);
    assert_true(fabs(s.pct_v[2] - 3.7) < 1e-15);
    assert_true(fabs(s.pct_v[3] - 3.97) < 1e-15);
    assert_true(fabs(s.pct_v[4] - 4.0) < 1e-15);
    assert_true(fabs(s.mean - 2.5) < 1e-15);
    assert_true(fabs(s.std - sqrt(1.25)) < 1e-15); /* population std of 1..4 */
    assert_true(isnan(bench_summary_pct(&s, 75)));
}

static void test_empty(void **state) {
    (void)state;
    const double qs[] = {99};
    bench_summary s;
    assert_int_equal(bench_summary_compute(&s, NULL, 0, qs, 1), 0);
    assert_int_equal(s.n, 0);
    assert_true(s.mean == 0 && s.median == 0 && s.pct_v[0] == 0);
}

static void test_pct_word(void **state) {
    (void)state;
    char b[16];
    bench_pct_word(99, b, sizeof b);
    assert_string_equal(b, "99");
    bench_pct_word(99.9, b, sizeof b);
    assert_string_equal(b, "99.9");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_numpy),
        cmocka_unit_test(test_by_hand),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_pct_word),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
