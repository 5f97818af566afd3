/*
 * test_bench_prom.c: Prometheus text parsing (comments, labels with escapes,
 * special values, timestamps, malformed lines) and the spec-decode figures of
 * a /metrics difference. The input is written in the format vLLM's
 * prometheus_client exporter produces (prefix "vllm:", model_name and engine
 * labels, _created samples); expected numbers are derived by hand below.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <string.h>

#include "bench/prom.h"

static const char BEFORE[] =
    "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n"
    "# TYPE vllm:spec_decode_num_drafts_total counter\n"
    "vllm:spec_decode_num_drafts_total{engine=\"0\",model_name=\"m\"} 10.0\n"
    "vllm:spec_decode_num_drafts_created{engine=\"0\",model_name=\"m\"} 1.7e9\n"
    "vllm:spec_decode_num_draft_tokens_total{engine=\"0\",model_name=\"m\"} 30.0\n"
    "vllm:spec_decode_num_accepted_tokens_total{engine=\"0\",model_name=\"m\"} 12.0\n"
    "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",model_name=\"m\",position=\"0\"} 7.0\n"
    "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",model_name=\"m\",position=\"1\"} 4.0\n"
    "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",model_name=\"m\",position=\"2\"} 1.0\n"
    "vllm:generation_tokens_total{model_name=\"m\"} 100\n"
    "vllm:prompt_tokens_total{model_name=\"m\"} 50\n";

/* After the run: two engines (summed), CRLF endings, a timestamp, odd spacing,
 * an escaped label value, a NaN gauge, a histogram and a garbage line. */
static const char AFTER[] =
    "# a free comment\r\n"
    "vllm:spec_decode_num_drafts_total{engine=\"0\",model_name=\"m\"} 50\r\n"
    "vllm:spec_decode_num_drafts_total{engine=\"1\",model_name=\"m\"} 20 1700000000000\r\n"
    "vllm:spec_decode_num_draft_tokens_total{engine=\"0\",model_name=\"m\"} 150\r\n"
    "vllm:spec_decode_num_draft_tokens_total{engine=\"1\",model_name=\"m\"} 60\r\n"
    "vllm:spec_decode_num_accepted_tokens_total { engine = \"0\" , model_name=\"m\" } 72\r\n"
    "vllm:spec_decode_num_accepted_tokens_total{engine=\"1\",model_name=\"m\",} 24\r\n"
    "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",position=\"0\"} 37\r\n"
    "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"1\",position=\"0\"} 15\r\n"
    "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",position=\"1\"} 28\r\n"
    "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",position=\"2\"} 19\r\n"
    "vllm:generation_tokens_total{model_name=\"m\"} 400\r\n"
    "vllm:prompt_tokens_total{model_name=\"m\"} 170\r\n"
    "odd_label{path=\"C:\\\\x\\\"y\\\"\\nz\"} -Inf\r\n"
    "gauge_nan NaN\r\n"
    "lat_bucket{le=\"+Inf\"} 3\r\n"
    "this is not a sample\r\n"
    "broken{a=\"unterminated} 1\r\n";

static void test_parse_labels_and_values(void **state) {
    (void)state;
    bench_prom *p = NULL;
    specd_err err = {{0}};
    assert_int_equal(bench_prom_parse(AFTER, sizeof AFTER - 1, &p, &err), 0);
    assert_int_equal(p->n_samples, 15);
    assert_int_equal(p->n_bad_lines, 2);
    const bench_prom_sample *s = &p->samples[1];
    assert_string_equal(s->name, "vllm:spec_decode_num_drafts_total");
    assert_int_equal(s->n_labels, 2);
    assert_string_equal(bench_prom_label_get(s, "engine"), "1");
    assert_true(s->value == 20.0);
    s = &p->samples[4];
    assert_string_equal(bench_prom_label_get(s, "model_name"), "m");
    assert_true(s->value == 72.0);
    s = &p->samples[12];
    assert_string_equal(s->name, "odd_label");
    assert_string_equal(bench_prom_label_get(s, "path"), "C:\\x\"y\"\nz");
    assert_true(isinf(s->value) && s->value < 0);
    assert_true(isnan(p->samples[13].value));
    assert_string_equal(bench_prom_label_get(&p->samples[14], "le"), "+Inf");
    size_t found;
    assert_true(bench_prom_sum_suffix(p, "num_drafts_total", NULL, NULL, &found) == 70.0);
    assert_int_equal(found, 2);
    assert_true(bench_prom_sum_suffix(p, "per_pos_total", "position", "0", &found) == 52.0);
    assert_int_equal(found, 2);
    bench_prom_destroy(p);
}

/* Difference: drafts 70-10 = 60, draft tokens 210-30 = 180, accepted
 * 96-12 = 84, per position (52-7, 28-4, 19-1) = (45, 24, 18).
 * Acceptance rate 84/180 = 0.4666..., acceptance length 1 + 84/60 = 2.4,
 * per-position 45/60 = 0.75, 24/60 = 0.4, 18/60 = 0.3.
 * Tokens: generation 400-100 = 300, prompt 170-50 = 120. */
static void test_spec_difference(void **state) {
    (void)state;
    bench_prom *a = NULL, *b = NULL;
    assert_int_equal(bench_prom_parse(BEFORE, sizeof BEFORE - 1, &b, NULL), 0);
    assert_int_equal(bench_prom_parse(AFTER, sizeof AFTER - 1, &a, NULL), 0);
    bench_spec_counters cb, ca, d;
    bench_spec_from_prom(b, &cb);
    bench_spec_from_prom(a, &ca);
    assert_true(cb.has_spec && ca.has_spec);
    bench_spec_diff(&ca, &cb, &d);
    assert_true(d.has_spec && d.has_tokens);
    assert_true(d.drafts == 60 && d.draft_tokens == 180 && d.accepted == 84);
    assert_int_equal(d.n_pos, 3);
    assert_true(fabs(bench_spec_acceptance_rate(&d) - 84.0 / 180.0) < 1e-15);
    assert_true(fabs(bench_spec_acceptance_length(&d) - 2.4) < 1e-15);
    assert_true(fabs(bench_spec_pos_rate(&d, 0) - 0.75) < 1e-15);
    assert_true(fabs(bench_spec_pos_rate(&d, 1) - 0.4) < 1e-15);
    assert_true(fabs(bench_spec_pos_rate(&d, 2) - 0.3) < 1e-15);
    assert_true(isnan(bench_spec_pos_rate(&d, 3)));
    assert_true(d.generation_tokens == 300 && d.prompt_tokens == 120);
    /* the same snapshot twice: counters exist but no draft was made in between */
    bench_spec_diff(&ca, &ca, &d);
    assert_false(d.has_spec);
    assert_true(d.has_tokens && d.generation_tokens == 0);
    bench_prom_destroy(a);
    bench_prom_destroy(b);
}

static void test_no_spec_metrics(void **state) {
    (void)state;
    static const char T[] = "# TYPE x counter\nprocess_cpu_seconds_total 3.5\n\n   \n";
    bench_prom *p = NULL;
    assert_int_equal(bench_prom_parse(T, sizeof T - 1, &p, NULL), 0);
    assert_int_equal(p->n_samples, 1);
    assert_int_equal(p->n_bad_lines, 0);
    bench_spec_counters c;
    bench_spec_from_prom(p, &c);
    assert_false(c.has_spec);
    assert_false(c.has_tokens);
    assert_true(isnan(bench_spec_acceptance_rate(&c)));
    bench_prom_destroy(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_labels_and_values),
        cmocka_unit_test(test_spec_difference),
        cmocka_unit_test(test_no_spec_metrics),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
