/*
 * test_draft_vocab.c: d2t / t2d validation (draft/eagle3_vocab.h): every
 * refusal REFERENCE §2 lists, the all-zeros identity, the summary, and that a
 * valid map sends a draft argmax to the right target id.
 * The maps are built here by REFERENCE §2's construction (used = sorted kept
 * target ids; d2t[i] = used[i] - i; t2d[used[i]] = true) from explicit id
 * lists, so every expected target id is written out by hand.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "draft/eagle3_vocab.h"

#define V 16 /* target vocab */
#define N 5  /* draft vocab */

/* kept target ids, ascending */
static const int64_t USED[N] = {1, 4, 5, 9, 15};

static void build(int64_t *d2t, uint8_t *t2d) {
    memset(t2d, 0, V);
    for (int i = 0; i < N; i++) {
        d2t[i] = USED[i] - i;
        t2d[USED[i]] = 1;
    }
}

static void expect_fail(const int64_t *d2t, int64_t n, const uint8_t *t2d, int64_t v, const char *needle) {
    specd_err err = {{0}};
    int64_t used[64];
    assert_int_equal(eagle3_vocab_validate(d2t, n, t2d, v, used, NULL, &err), -1);
    if (!strstr(err.msg, needle)) fprintf(stderr, "message '%s' lacks '%s'\n", err.msg, needle);
    assert_non_null(strstr(err.msg, needle));
}

static void test_valid_offsets(void **state) {
    (void)state;
    int64_t d2t[N], used[N];
    uint8_t t2d[V];
    build(d2t, t2d);
    /* d2t = {1, 3, 3, 6, 11}: offsets, not ids */
    assert_int_equal(d2t[1], 3);
    eagle3_vocab_info info;
    specd_err err = {{0}};
    assert_int_equal(eagle3_vocab_validate(d2t, N, t2d, V, used, &info, &err), 0);
    for (int i = 0; i < N; i++) assert_int_equal(used[i], USED[i]);
    assert_false(info.identity);
    assert_int_equal(info.first_id, 1);
    assert_int_equal(info.last_id, 15);
    assert_string_equal(info.warning, "");
    char line[256];
    eagle3_vocab_summary(&info, line, sizeof line);
    assert_string_equal(line, "draft vocab 5 -> target vocab 16 via d2t offsets (ids 1..15, not identity), t2d consistent");
    /* a draft argmax maps to the right target id: logits over the draft vocab */
    const float logits[N] = {0.1f, -2.0f, 0.3f, 7.5f, 1.0f};
    int best = 0;
    for (int i = 1; i < N; i++)
        if (logits[i] > logits[best]) best = i;
    assert_int_equal(best, 3);
    assert_int_equal(best + d2t[best], 9);
    assert_int_equal(used[best], 9);
    assert_true(t2d[used[best]]);
    /* without t2d the same d2t is valid */
    assert_int_equal(eagle3_vocab_validate(d2t, N, NULL, V, used, &info, &err), 0);
    eagle3_vocab_summary(&info, line, sizeof line);
    assert_non_null(strstr(line, "no t2d"));
}

static void test_identity(void **state) {
    (void)state;
    int64_t zeros[V] = {0}, used[V];
    eagle3_vocab_info info;
    specd_err err = {{0}};
    /* equal vocabularies: no d2t at all, or all zeros */
    assert_int_equal(eagle3_vocab_validate(NULL, V, NULL, V, used, &info, &err), 0);
    assert_true(info.identity);
    assert_int_equal(used[V - 1], V - 1);
    assert_int_equal(eagle3_vocab_validate(zeros, V, NULL, V, used, &info, &err), 0);
    assert_true(info.identity);
    assert_false(info.warn_zero_d2t);
    /* smaller draft, all zeros, no t2d: accepted with a warning (ids 0..N-1) */
    assert_int_equal(eagle3_vocab_validate(zeros, N, NULL, V, used, &info, &err), 0);
    assert_true(info.identity);
    assert_true(info.warn_zero_d2t);
    assert_non_null(strstr(info.warning, "all zeros"));
    assert_int_equal(used[N - 1], N - 1);
    /* ... with a t2d that agrees: accepted silently */
    uint8_t t2d[V] = {0};
    for (int i = 0; i < N; i++) t2d[i] = 1;
    assert_int_equal(eagle3_vocab_validate(zeros, N, t2d, V, used, &info, &err), 0);
    assert_false(info.warn_zero_d2t);
    /* ... with a t2d that disagrees: refused */
    int64_t d2t[N];
    build(d2t, t2d);
    expect_fail(zeros, N, t2d, V, "t2d is inconsistent with d2t");
}

static void test_no_d2t_smaller_draft_refused(void **state) {
    (void)state;
    expect_fail(NULL, N, NULL, V, "has no d2t");
    int64_t d2t[N];
    uint8_t t2d[V];
    build(d2t, t2d);
    expect_fail(NULL, N, t2d, V, "rebuilt from t2d");
}

static void test_out_of_range_refused(void **state) {
    (void)state;
    int64_t d2t[N];
    uint8_t t2d[V];
    build(d2t, t2d);
    d2t[4] = 12; /* 4 + 12 = 16 = V */
    expect_fail(d2t, N, t2d, V, "d2t[4] = 12 maps outside the target vocabulary");
    build(d2t, t2d);
    d2t[0] = -1; /* 0 - 1 */
    expect_fail(d2t, N, NULL, V, "d2t[0] = -1 maps outside");
    d2t[0] = INT64_MIN / 2;
    expect_fail(d2t, N, NULL, V, "out of range");
    expect_fail(d2t, V + 1, NULL, V, "larger than the target vocab");
}

static void test_not_increasing_refused(void **state) {
    (void)state;
    int64_t d2t[N];
    uint8_t t2d[V];
    build(d2t, t2d);
    d2t[2] = 2; /* used[2] = 4 == used[1] */
    expect_fail(d2t, N, NULL, V, "d2t[2] = 2 breaks the strictly increasing order");
}

static void test_t2d_inconsistent_refused(void **state) {
    (void)state;
    int64_t d2t[N];
    uint8_t t2d[V];
    build(d2t, t2d);
    t2d[0] = 1; /* 6 true entries */
    expect_fail(d2t, N, t2d, V, "t2d marks 6 target ids, the draft vocab has 5");
    build(d2t, t2d);
    t2d[9] = 0;
    t2d[10] = 1; /* count right, but used[3] = 9 is not marked */
    expect_fail(d2t, N, t2d, V, "draft id 3 maps to target id 9 but t2d[9] is false");
}

static void test_absolute_ids_detected(void **state) {
    (void)state;
    int64_t abs_ids[N];
    uint8_t t2d[V];
    int64_t d2t[N];
    build(d2t, t2d);
    /* written as absolute ids: 15 + 4 = 19 >= V */
    memcpy(abs_ids, USED, sizeof abs_ids);
    expect_fail(abs_ids, N, NULL, V, "d2t looks like absolute ids, expected offsets");
    expect_fail(abs_ids, N, t2d, V, "d2t looks like absolute ids, expected offsets");
    /* absolute ids that stay in range as offsets: only t2d can tell */
    const int64_t low[N] = {0, 2, 3, 5, 6}; /* as offsets: 0, 3, 5, 8, 10 (valid, increasing) */
    memset(t2d, 0, V);
    for (int i = 0; i < N; i++) t2d[low[i]] = 1;
    expect_fail(low, N, t2d, V, "d2t looks like absolute ids");
    specd_err err = {{0}};
    assert_int_equal(eagle3_vocab_validate(low, N, NULL, V, NULL, NULL, &err), 0); /* undetectable without t2d */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_offsets),
        cmocka_unit_test(test_identity),
        cmocka_unit_test(test_no_d2t_smaller_draft_refused),
        cmocka_unit_test(test_out_of_range_refused),
        cmocka_unit_test(test_not_increasing_refused),
        cmocka_unit_test(test_t2d_inconsistent_refused),
        cmocka_unit_test(test_absolute_ids_detected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
