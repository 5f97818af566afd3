/*
 * test_draft_sample.c: how the proposer turns draft logits into a draft token
 * and its q (eagle3_pick, draft/eagle3_head.h). The acceptance rule
 * min(1, p/q) is lossless only if the draft token is really drawn from the q
 * handed to the verifier (REFERENCE §3), so:
 *   - temperature 0 (or no q): argmax, ties to the lower draft id, one-hot q
 *     at the TARGET id used[argmax];
 *   - temperature t > 0: q = softmax(logits / t) scattered to used[] target
 *     ids, exactly zero elsewhere, sum 1; the token is the inverse CDF at u;
 *   - drawn with 10^6 uniform u's (a splitmix64 stream of this test), the
 *     frequencies match q within 6 standard deviations per id (false-failure
 *     probability < 1e-8 for the 6 ids).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "draft/eagle3_head.h"

#define VD 6
#define VT 20
static const int64_t USED[VD] = {0, 3, 4, 9, 12, 19};
static const float LG[VD] = {0.5f, 2.0f, -1.0f, 2.0f, 1.25f, 0.0f};

static void test_greedy(void **state) {
    (void)state;
    float q[VT] = {0};
    assert_int_equal(eagle3_pick(LG, VD, USED, 0.0f, 0.99, q), 1); /* ties 1 and 3: lower id */
    for (int v = 0; v < VT; v++) assert_true(q[v] == (v == 3 ? 1.0f : 0.0f)); /* used[1] = 3 */
    assert_int_equal(eagle3_pick(LG, VD, USED, 0.7f, 0.99, NULL), 1); /* no q: argmax whatever t */
}

static void softmax(float t, double *p) {
    double s = 0;
    for (int i = 0; i < VD; i++) s += p[i] = exp((double)LG[i] / t);
    for (int i = 0; i < VD; i++) p[i] /= s;
}

static void test_q_is_the_softmax(void **state) {
    (void)state;
    const float temps[3] = {0.5f, 1.0f, 2.5f};
    for (int k = 0; k < 3; k++) {
        double p[VD];
        softmax(temps[k], p);
        float q[VT] = {0};
        eagle3_pick(LG, VD, USED, temps[k], 0.5, q);
        double sum = 0;
        for (int v = 0; v < VT; v++) sum += q[v];
        assert_true(fabs(sum - 1.0) < 1e-6);
        for (int i = 0; i < VD; i++) assert_true(fabs(q[USED[i]] - p[i]) < 1e-7);
        for (int v = 0; v < VT; v++) {
            int kept = 0;
            for (int i = 0; i < VD; i++) kept |= USED[i] == v;
            if (!kept) assert_true(q[v] == 0.0f);
        }
        /* inverse CDF: u just inside each cumulative interval picks that id */
        double c = 0;
        for (int i = 0; i < VD; i++) {
            float qq[VT] = {0};
            assert_int_equal(eagle3_pick(LG, VD, USED, temps[k], c + p[i] * 0.5, qq), i);
            c += p[i];
        }
    }
}

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void test_frequencies(void **state) {
    (void)state;
    const int N = 1000000;
    const float t = 0.8f;
    double p[VD];
    softmax(t, p);
    long cnt[VD] = {0};
    uint64_t x = 12345;
    float q[VT];
    for (int n = 0; n < N; n++) {
        double u = (double)(splitmix(&x) >> 11) * 0x1.0p-53;
        memset(q, 0, sizeof q);
        cnt[eagle3_pick(LG, VD, USED, t, u, q)]++;
    }
    for (int i = 0; i < VD; i++) {
        double f = (double)cnt[i] / N, sd = sqrt(p[i] * (1 - p[i]) / N);
        printf("draft id %d: frequency %.5f, q %.5f (%.2f sd)\n", i, f, p[i], (f - p[i]) / sd);
        assert_true(fabs(f - p[i]) <= 6 * sd);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_q_is_the_softmax),
        cmocka_unit_test(test_frequencies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
