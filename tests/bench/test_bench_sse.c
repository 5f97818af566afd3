/*
 * test_bench_sse.c: the SSE parser must deliver the same events whatever way
 * the stream is cut into reads: whole, one byte at a time, split at every byte
 * position, and split at every pair of positions. Expected events are written
 * by hand from the SSE rules (WHATWG HTML, "Parsing an event stream").
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/sse.h"

typedef struct collected {
    char ev[16][256];
    size_t n;
} collected;

static int collect(void *user, const char *data, size_t len) {
    collected *c = user;
    assert_true(c->n < 16);
    assert_true(len < 256);
    assert_int_equal(strlen(data), len); /* NUL-terminated, no embedded NUL here */
    memcpy(c->ev[c->n], data, len + 1);
    c->n++;
    return 0;
}

/* A stream mixing what real servers send: LF and CRLF endings, a keep-alive
 * comment, an `event:` field, a multi-line data field, a field without a
 * space after the colon, a bare CR ending, a blank line without data (no
 * event), and a final event without its blank line (discarded). */
static const char STREAM[] =
    ": keep-alive\n\n"
    "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n"
    "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\r\n\r\n"
    "event: message\nid: 7\ndata: line one\ndata: line two\n\n"
    "data:nospace\r\rdata: \n\n"
    "data: crlf one\r\ndata: crlf two\r\n\r\n"
    "\n\n"
    "data: {\"choices\":[],\"usage\":{\"completion_tokens\":5}}\n\n"
    "data: [DONE]\n\n"
    "data: truncated";

static const char *EXPECTED[] = {
    "{\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}",
    "{\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}",
    "line one\nline two",
    "nospace",
    "",
    "crlf one\ncrlf two",
    "{\"choices\":[],\"usage\":{\"completion_tokens\":5}}",
    "[DONE]",
};
#define N_EXPECTED (sizeof EXPECTED / sizeof EXPECTED[0])

static void check(const collected *c) {
    assert_int_equal(c->n, N_EXPECTED);
    for (size_t i = 0; i < N_EXPECTED; i++) assert_string_equal(c->ev[i], EXPECTED[i]);
}

/* Feeds STREAM cut at the given (sorted) positions. */
static void run_cuts(const size_t *cuts, size_t n_cuts) {
    size_t len = sizeof STREAM - 1;
    collected c = {0};
    bench_sse p;
    bench_sse_init(&p, collect, &c);
    specd_err err = {{0}};
    size_t prev = 0;
    for (size_t k = 0; k <= n_cuts; k++) {
        size_t at = k < n_cuts ? cuts[k] : len;
        /* feed from a private heap copy so that reads past a piece are caught by ASan */
        char *piece = malloc(at - prev + 1);
        memcpy(piece, STREAM + prev, at - prev);
        assert_int_equal(bench_sse_feed(&p, piece, at - prev, &err), 0);
        free(piece);
        prev = at;
    }
    assert_int_equal(bench_sse_finish(&p), 1); /* "data: truncated" was pending */
    bench_sse_free(&p);
    check(&c);
}

static void test_whole(void **state) {
    (void)state;
    run_cuts(NULL, 0);
}

static void test_every_single_split(void **state) {
    (void)state;
    for (size_t i = 0; i <= sizeof STREAM - 1; i++) run_cuts(&i, 1);
}

static void test_every_pair_split(void **state) {
    (void)state;
    size_t len = sizeof STREAM - 1;
    for (size_t i = 0; i <= len; i++)
        for (size_t j = i; j <= len; j++) {
            size_t cuts[2] = {i, j};
            run_cuts(cuts, 2);
        }
}

static void test_byte_at_a_time(void **state) {
    (void)state;
    size_t len = sizeof STREAM - 1;
    size_t *cuts = malloc(len * sizeof *cuts);
    for (size_t i = 0; i < len; i++) cuts[i] = i + 1;
    run_cuts(cuts, len - 1);
    free(cuts);
}

static int stop_after_first(void *user, const char *data, size_t len) {
    (void)data;
    (void)len;
    (*(int *)user)++;
    return 1;
}

static void test_callback_stop(void **state) {
    (void)state;
    int calls = 0;
    bench_sse p;
    bench_sse_init(&p, stop_after_first, &calls);
    specd_err err = {{0}};
    assert_int_equal(bench_sse_feed(&p, STREAM, sizeof STREAM - 1, &err), -1);
    assert_int_equal(calls, 1);
    assert_non_null(strstr(err.msg, "callback"));
    bench_sse_free(&p);
}

static void test_oversized_event(void **state) {
    (void)state;
    bench_sse p;
    bench_sse_init(&p, NULL, NULL);
    specd_err err = {{0}};
    size_t chunk = 1u << 20;
    char *buf = malloc(chunk);
    memset(buf, 'x', chunk);
    memcpy(buf, "data: ", 6);
    int rc = 0;
    for (size_t sent = 0; sent <= BENCH_SSE_MAX_EVENT + chunk && rc == 0; sent += chunk)
        rc = bench_sse_feed(&p, sent ? buf + 6 : buf, sent ? chunk - 6 : chunk, &err);
    assert_int_equal(rc, -1);
    assert_non_null(strstr(err.msg, "larger"));
    free(buf);
    bench_sse_free(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_whole),
        cmocka_unit_test(test_every_single_split),
        cmocka_unit_test(test_every_pair_split),
        cmocka_unit_test(test_byte_at_a_time),
        cmocka_unit_test(test_callback_stop),
        cmocka_unit_test(test_oversized_event),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
