/*
 * test_bench_stream.c: how one streamed response becomes a record, and how
 * records become metrics. Streams are written by hand in the shapes OpenAI
 * and vLLM send (REFERENCE §5: role chunk, content deltas, a finish chunk,
 * a usage chunk with choices: [], [DONE]); expected values are derived by
 * hand in the comments.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench/client.h"
#include "bench/report.h"

#define EV(s, str, t) bench_stream_event((s), (str), strlen(str), (t))

static int close_to(double a, double b) { return fabs(a - b) < 1e-9; }

/* Sent at t=10.00. Role-only chunk at 10.10 (not a token), "Hel" at 10.25
 * (TTFT 0.25), "lo wor" at 10.30 (several tokens in one chunk: ITL 0.05),
 * "ld" at 10.42 (ITL 0.12), finish chunk with an empty delta at 10.43 (not
 * a token), usage at 10.44: completion_tokens 5 although only 3 text chunks
 * arrived, which is exactly why tokens come from usage. */
static void test_chat_stream(void **state) {
    (void)state;
    bench_record r = {.ttft_s = -1, .prompt_tokens = -1, .output_tokens = -1};
    bench_stream s = {.rec = &r, .chat = 1, .keep_text = 1, .t_start = 10.0};
    assert_int_equal(EV(&s, "{\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}", 10.10), 0);
    assert_true(r.ttft_s < 0);
    assert_int_equal(EV(&s, "{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"},\"finish_reason\":null}]}", 10.25), 0);
    assert_int_equal(EV(&s, "{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo wor\"}}]}", 10.30), 0);
    assert_int_equal(EV(&s, "{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ld\"}}]}", 10.42), 0);
    assert_int_equal(EV(&s, "{\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}", 10.43), 0);
    assert_int_equal(EV(&s, "{\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":5,\"total_tokens\":12}}", 10.44), 0);
    assert_int_equal(EV(&s, "[DONE]", 10.45), 0);
    assert_true(close_to(r.ttft_s, 0.25));
    assert_int_equal(r.n_itl, 2);
    assert_true(close_to(r.itl_s[0], 0.05) && close_to(r.itl_s[1], 0.12));
    assert_int_equal(r.n_chunks, 3);
    assert_int_equal(r.output_tokens, 5);
    assert_int_equal(r.prompt_tokens, 7);
    assert_true(s.got_usage && s.got_done && !s.server_error);
    assert_string_equal(r.text, "Hello world");
    free(r.itl_s);
    free(r.text);
}

/* Completions: the token text is choices[0].text; a usage object attached to
 * the last content chunk counts too. */
static void test_completions_stream(void **state) {
    (void)state;
    bench_record r = {.ttft_s = -1, .prompt_tokens = -1, .output_tokens = -1};
    bench_stream s = {.rec = &r, .chat = 0, .t_start = 1.0};
    assert_int_equal(EV(&s, "{\"choices\":[{\"index\":0,\"text\":\" a\"}]}", 1.5), 0);
    assert_int_equal(EV(&s, "{\"choices\":[{\"index\":0,\"text\":\" b c\",\"finish_reason\":\"stop\"}],"
                            "\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":3}}", 1.75), 0);
    assert_true(close_to(r.ttft_s, 0.5));
    assert_int_equal(r.n_itl, 1);
    assert_true(close_to(r.itl_s[0], 0.25));
    assert_int_equal(r.output_tokens, 3);
    assert_null(r.text); /* keep_text off */
    assert_false(s.got_done);
    free(r.itl_s);
}

static void test_error_and_garbage(void **state) {
    (void)state;
    bench_record r = {.ttft_s = -1, .prompt_tokens = -1, .output_tokens = -1};
    bench_stream s = {.rec = &r, .chat = 1};
    assert_int_equal(EV(&s, "{\"error\":{\"message\":\"context too long\",\"type\":\"invalid_request_error\"}}", 1), 0);
    assert_string_equal(s.server_error, "context too long");
    assert_int_equal(EV(&s, "{\"choices\":[], \"usage\": {\"prompt_tokens\": 1}}", 1), 0);
    assert_false(s.got_usage); /* no completion_tokens: not a usable usage */
    assert_int_equal(EV(&s, "{not json", 2), -1);
    assert_non_null(r.error);
    assert_false(r.success);
    free(s.server_error);
    free(r.error);
}

/* Three records over a 2 s run:
 *  A: ttft 0.2 s, e2e 1.0 s, 5 output tokens, 4 ITLs -> TPOT (1.0-0.2)/4 = 200 ms
 *  B: ttft 0.1 s, e2e 0.5 s, 1 output token -> no TPOT (needs > 1 token)
 *  C: failed.
 * completed 2, failed 1, input 10+20 = 30, output 6; request throughput 2/2 =
 * 1/s, output 6/2 = 3 tok/s, total (30+6)/2 = 18 tok/s; TTFT mean 150 ms,
 * median 150 ms; E2EL mean 750 ms; ITL pooled from A only. */
static void test_metrics(void **state) {
    (void)state;
    double itl_a[4] = {0.1, 0.2, 0.3, 0.2};
    bench_record rec[3] = {
        {.success = 1, .ttft_s = 0.2, .latency_s = 1.0, .itl_s = itl_a, .n_itl = 4, .prompt_tokens = 10, .output_tokens = 5},
        {.success = 1, .ttft_s = 0.1, .latency_s = 0.5, .prompt_tokens = 20, .output_tokens = 1},
        {.success = 0, .error = "HTTP 500: boom", .ttft_s = -1, .prompt_tokens = -1, .output_tokens = -1},
    };
    bench_run run = {.rec = rec, .n = 3, .duration_s = 2.0, .peak_concurrency = 3};
    const double qs[] = {50, 99};
    bench_metrics m;
    assert_int_equal(bench_metrics_compute(&run, NULL, qs, 2, &m), 0);
    assert_int_equal(m.completed, 2);
    assert_int_equal(m.failed, 1);
    assert_int_equal(m.total_input, 30);
    assert_int_equal(m.total_output, 6);
    assert_true(close_to(m.request_throughput, 1.0));
    assert_true(close_to(m.output_throughput, 3.0));
    assert_true(close_to(m.total_token_throughput, 18.0));
    assert_int_equal(m.tpot_ms.n, 1);
    assert_true(close_to(m.tpot_ms.mean, 200.0));
    assert_true(close_to(m.ttft_ms.mean, 150.0) && close_to(m.ttft_ms.median, 150.0));
    assert_true(close_to(m.e2el_ms.mean, 750.0));
    assert_int_equal(m.itl_ms.n, 4);
    assert_true(close_to(m.itl_ms.mean, 200.0));
    assert_int_equal(m.n_fail, 1);
    assert_string_equal(m.fail[0].reason, "HTTP 500: boom");
    json_t *o = json_object();
    assert_int_equal(bench_metrics_to_json(&m, &run, o), 0);
    assert_true(close_to(json_real_value(json_object_get(o, "mean_tpot_ms")), 200.0));
    assert_non_null(json_object_get(o, "p99_itl_ms"));
    assert_int_equal(json_array_size(json_object_get(o, "itls")), 3);
    assert_true(json_is_null(json_object_get(o, "spec_decode_acceptance_rate")) ||
                !json_object_get(o, "spec_decode_acceptance_rate"));
    json_decref(o);
    bench_metrics_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_stream),
        cmocka_unit_test(test_completions_stream),
        cmocka_unit_test(test_error_and_garbage),
        cmocka_unit_test(test_metrics),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
