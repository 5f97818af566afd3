/*
 * test_auth.c: API-key checks: equality through SHA-256 + CRYPTO_memcmp for
 * equal and unequal lengths, the Bearer header forms, disabled auth, and the
 * key-file reload (old key stops working, new key works, a failed reload keeps
 * the old key). Also the Prometheus rendering of the server metrics.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "server/auth.h"
#include "server/metrics.h"

static void test_equal(void **state) {
    (void)state;
    assert_true(auth_equal("abc", 3, "abc", 3));
    assert_false(auth_equal("abc", 3, "abd", 3));
    assert_false(auth_equal("abc", 3, "abcd", 4));
    assert_false(auth_equal("", 0, "a", 1));
    assert_true(auth_equal("", 0, "", 0));
}

static void test_header_forms(void **state) {
    (void)state;
    auth *a = NULL;
    specd_err err = {{0}};
    assert_int_equal(auth_create("sk-123", NULL, &a, &err), 0);
    assert_true(auth_enabled(a));
    assert_true(auth_check(a, "Bearer sk-123"));
    assert_true(auth_check(a, "bearer sk-123"));
    assert_true(auth_check(a, "Bearer  sk-123 "));
    assert_false(auth_check(a, NULL));
    assert_false(auth_check(a, ""));
    assert_false(auth_check(a, "sk-123"));
    assert_false(auth_check(a, "Bearer sk-12"));
    assert_false(auth_check(a, "Bearer sk-1234"));
    assert_false(auth_check(a, "Basic c2stMTIz"));
    auth_destroy(a);
    assert_int_equal(auth_create(NULL, NULL, &a, &err), 0);
    assert_false(auth_enabled(a));
    assert_true(auth_check(a, NULL));
    auth_destroy(a);
    assert_int_equal(auth_create("", NULL, &a, &err), -1);
}

static void write_file(const char *path, const char *s) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(s, f);
    fclose(f);
}

static void test_reload(void **state) {
    (void)state;
    char path[] = "/tmp/specd_auth_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    write_file(path, "old-key\n");
    auth *a = NULL;
    specd_err err = {{0}};
    assert_int_equal(auth_create(NULL, path, &a, &err), 0);
    assert_true(auth_check(a, "Bearer old-key"));
    write_file(path, "new-key\r\nsecond line ignored\n");
    assert_true(auth_check(a, "Bearer old-key")); /* not before the reload */
    assert_int_equal(auth_reload(a, &err), 0);
    assert_false(auth_check(a, "Bearer old-key"));
    assert_true(auth_check(a, "Bearer new-key"));
    write_file(path, "\n");
    assert_int_equal(auth_reload(a, &err), -1); /* empty: keep the current key */
    assert_true(auth_check(a, "Bearer new-key"));
    assert_null(strstr(err.msg, "new-key"));
    unlink(path);
    assert_int_equal(auth_reload(a, &err), -1);
    assert_true(auth_check(a, "Bearer new-key"));
    auth_destroy(a);
    assert_int_equal(auth_create(NULL, "/nonexistent/key", &a, &err), -1);
}

static void test_metrics_render(void **state) {
    (void)state;
    metrics *m = metrics_create();
    metrics_request(m, "completions", 200);
    metrics_request(m, "completions", 200);
    metrics_request(m, "chat", 400);
    metrics_latency(m, 0.03, 0.02, 1.2);
    engine_stats es;
    memset(&es, 0, sizeof es);
    es.kv_blocks_total = 100;
    es.kv_blocks_free = 90;
    es.spec_num_drafts_total = 7;
    es.spec_max_k = 2;
    es.spec_accepted_per_pos_total[0] = 5;
    es.spec_accepted_per_pos_total[1] = 3;
    size_t len;
    char *t = metrics_render(m, &es, 1, &len);
    assert_non_null(t);
    assert_int_equal(strlen(t), len);
    assert_non_null(strstr(t, "specd_http_requests_total{endpoint=\"completions\",status=\"200\"} 2\n"));
    assert_non_null(strstr(t, "specd_http_requests_total{endpoint=\"chat\",status=\"400\"} 1\n"));
    assert_non_null(strstr(t, "# TYPE specd_time_to_first_token_seconds histogram\n"));
    assert_non_null(strstr(t, "specd_time_to_first_token_seconds_bucket{le=\"0.02\"} 0\n"));
    assert_non_null(strstr(t, "specd_time_to_first_token_seconds_bucket{le=\"0.04\"} 1\n"));
    assert_non_null(strstr(t, "specd_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1\n"));
    assert_non_null(strstr(t, "specd_time_to_first_token_seconds_count 1\n"));
    assert_non_null(strstr(t, "specd_e2e_request_latency_seconds_bucket{le=\"1\"} 0\n"));
    assert_non_null(strstr(t, "specd_e2e_request_latency_seconds_bucket{le=\"1.5\"} 1\n"));
    assert_non_null(strstr(t, "specd_kv_blocks_used 10\n"));
    assert_non_null(strstr(t, "specd_kv_blocks_free 90\n"));
    assert_non_null(strstr(t, "specd_spec_decode_num_drafts_total 7\n"));
    assert_non_null(strstr(t, "specd_spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"} 3\n"));
    assert_non_null(strstr(t, "specd_up 1\n"));
    free(t);
    t = metrics_render(m, NULL, 0, &len);
    assert_non_null(strstr(t, "specd_up 0\n"));
    assert_null(strstr(t, "kv_blocks"));
    free(t);
    metrics_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_equal),
        cmocka_unit_test(test_header_forms),
        cmocka_unit_test(test_reload),
        cmocka_unit_test(test_metrics_render),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
