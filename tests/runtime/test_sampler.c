/*
 * test_sampler.c: the sampler on small hand-computed vectors, against Hugging
 * Face's logits warpers and numpy (values produced once in Python, quoted
 * below with the code that made them), RNG reference values from a Python
 * transcription of the published splitmix64 / xoshiro256** algorithms, and
 * statistical tests of sampling and of the speculative acceptance rule.
 *
 * Statistical tests: chi-square goodness of fit with df = V - 1 = 3 over
 * cells with p > 0 (cells with p = 0 must get exactly 0 draws). The threshold
 * is the chi-square(3) quantile at alpha = 1e-6 / (cases in the test) per
 * case (1 case in the sampling test, 25 in the acceptance test), so a correct
 * implementation fails a test with probability <= 1e-6 (union bound) for a
 * random seed; cases with fewer nonzero cells have fewer degrees of freedom,
 * for which the df=3 threshold is conservative. The seeds are fixed, so the test is
 * deterministic; the bound says how unlucky a fixed seed would have to be.
 * Every expected count is >= 5000 (p >= 0.05, N = 100000), so the chi-square
 * approximation holds. test_accept_rule_exhaustive covers every (p, q) pair of
 * a 1/4 grid over V = 4, one seed per case, with exact df (its comment).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "engine/runtime/sampler.h"
#include "stats_chi2.h" /* chi2_sf */

static sampling_params params(void) {
    sampling_params sp;
    memset(&sp, 0, sizeof sp);
    sp.temperature = 1.0f;
    sp.top_p = 1.0f;
    sp.top_k = -1;
    sp.repetition_penalty = 1.0f;
    sp.max_tokens = 16;
    sp.logprobs = -1;
    return sp;
}

static void assert_close(double a, double b, double tol) {
    if (fabs(a - b) > tol) fail_msg("%.9g != %.9g (tol %g)", a, b, tol);
}

static void test_rng_reference(void **st) {
    (void)st;
    /* Python: splitmix64 x4 from the seed, then xoshiro256** next() */
    sampler_rng r;
    sampler_rng_seed(&r, 42);
    assert_true(sampler_rng_next(&r) == 0x15780b2e0c2ec716ull);
    assert_true(sampler_rng_next(&r) == 0x6104d9866d113a7eull);
    assert_true(sampler_rng_next(&r) == 0xae17533239e499a1ull);
    sampler_rng_seed(&r, 0);
    assert_true(sampler_rng_next(&r) == 0x99ec5f36cb75f2b4ull);
    assert_true(sampler_rng_next(&r) == 0xbf6e1f784956452aull);
    for (int i = 0; i < 1000; i++) {
        double u = sampler_rng_uniform(&r);
        assert_true(u >= 0.0 && u < 1.0);
    }
}

static void test_penalties(void **st) {
    (void)st;
    sampler_work *w = sampler_work_create(4);
    sampling_params sp = params();
    /* repetition 2 over prompt {0} + output {1,1}: positive / 2, negative * 2, each id once */
    float l[4] = {2.0f, -1.0f, 0.5f, 3.0f};
    int32_t prompt[1] = {0}, out[2] = {1, 1};
    sampler_hist h = {prompt, 1, out, 2, NULL, 0};
    sp.repetition_penalty = 2.0f;
    sampler_apply_penalties(w, &sp, &h, l);
    assert_close(l[0], 1.0, 0);
    assert_close(l[1], -2.0, 0);
    assert_close(l[2], 0.5, 0);
    assert_close(l[3], 3.0, 0);
    /* frequency 0.5, presence 1 over output {2,2,3} only (prompt id 0 untouched) */
    float m[4] = {2.0f, -1.0f, 0.5f, 3.0f};
    int32_t out2[3] = {2, 2, 3};
    sampler_hist h2 = {prompt, 1, out2, 3, NULL, 0};
    sp = params();
    sp.frequency_penalty = 0.5f;
    sp.presence_penalty = 1.0f;
    sampler_apply_penalties(w, &sp, &h2, m);
    assert_close(m[0], 2.0, 0);
    assert_close(m[1], -1.0, 0);
    assert_close(m[2], 0.5 - (0.5 * 2 + 1), 0);
    assert_close(m[3], 3.0 - (0.5 + 1), 0);
    /* applying again gives the same (scratch state was reset) */
    float m2[4] = {2.0f, -1.0f, 0.5f, 3.0f};
    sampler_apply_penalties(w, &sp, &h2, m2);
    assert_memory_equal(m, m2, sizeof m);
    /* suppression (min_tokens) */
    float s[4] = {2.0f, -1.0f, 0.5f, 3.0f};
    int32_t sup[1] = {3};
    sampler_hist h3 = {NULL, 0, NULL, 0, sup, 1};
    sp = params();
    sp.temperature = 0.0f;
    assert_int_equal(sampler_sample(w, &sp, &h3, NULL, s), 0);
    assert_true(isinf(s[3]) == 0); /* input row not modified by sampler_sample */
    sampler_work_destroy(w);
}

static void test_greedy_ties_and_draw(void **st) {
    (void)st;
    float x[5] = {1.0f, 4.0f, -2.0f, 4.0f, NAN};
    assert_int_equal(sampler_argmax(x, 5), 1);
    float y[3] = {NAN, -1.0f, -3.0f};
    assert_int_equal(sampler_argmax(y, 3), 1);
    float p[4] = {0.25f, 0.0f, 0.5f, 0.25f};
    assert_int_equal(sampler_draw(p, 4, 0.0), 0);
    assert_int_equal(sampler_draw(p, 4, 0.2499), 0);
    assert_int_equal(sampler_draw(p, 4, 0.25), 2);
    assert_int_equal(sampler_draw(p, 4, 0.7499), 2);
    assert_int_equal(sampler_draw(p, 4, 0.75), 3);
    assert_int_equal(sampler_draw(p, 4, 0.999999999), 3);
}

static void test_temperature_and_filters(void **st) {
    (void)st;
    sampler_work *w = sampler_work_create(8);
    float p[8];
    sampling_params sp = params();
    /* numpy: x = [1,2,3] / 0.5; softmax -> [0.01587624, 0.11731043, 0.86681333] */
    sampler_work *w3 = sampler_work_create(3);
    float l3[3] = {1, 2, 3}, p3[3];
    sp.temperature = 0.5f;
    sampler_hist h0 = {0};
    sampler_probs(w3, &sp, &h0, l3, p3);
    assert_close(p3[0], 0.01587624, 1e-6);
    assert_close(p3[1], 0.11731043, 1e-6);
    assert_close(p3[2], 0.86681333, 1e-6);
    sampler_work_destroy(w3);

    /* top-k 2 with a three-way tie at the k-th value keeps all three */
    float tk[5] = {1, 3, 3, 2, 3};
    sampler_work *w5 = sampler_work_create(5);
    float p5[5];
    sp = params();
    sp.top_k = 2;
    sampler_probs(w5, &sp, &h0, tk, p5);
    assert_close(p5[0], 0, 0);
    assert_close(p5[3], 0, 0);
    assert_close(p5[1], 1.0 / 3, 1e-6);
    assert_close(p5[2], 1.0 / 3, 1e-6);
    assert_close(p5[4], 1.0 / 3, 1e-6);
    sampler_work_destroy(w5);

    /* top-p on p = [0.1, 0.4, 0.3, 0.2]: 0.7 keeps {1,2}; 0.75 keeps {1,2,3}; 1e-6 keeps the max only */
    sampler_work *w4 = sampler_work_create(4);
    float lp[4] = {logf(0.1f), logf(0.4f), logf(0.3f), logf(0.2f)}, p4[4];
    sp = params();
    sp.top_p = 0.7f;
    sampler_probs(w4, &sp, &h0, lp, p4);
    assert_close(p4[0], 0, 0);
    assert_close(p4[1], 4.0 / 7, 1e-6);
    assert_close(p4[2], 3.0 / 7, 1e-6);
    assert_close(p4[3], 0, 0);
    sp.top_p = 0.75f;
    sampler_probs(w4, &sp, &h0, lp, p4);
    assert_close(p4[3], 2.0 / 9, 1e-6);
    assert_close(p4[0], 0, 0);
    sp.top_p = 1e-6f;
    sampler_probs(w4, &sp, &h0, lp, p4);
    assert_close(p4[1], 1.0, 0);
    /* min-p 0.6: threshold 0.24 keeps {1,2} */
    sp = params();
    sp.min_p = 0.6f;
    sampler_probs(w4, &sp, &h0, lp, p4);
    assert_close(p4[1], 4.0 / 7, 1e-6);
    assert_close(p4[2], 3.0 / 7, 1e-6);
    assert_close(p4[3], 0, 0);
    /* top-k 1 == greedy support */
    sp = params();
    sp.top_k = 1;
    sampler_probs(w4, &sp, &h0, lp, p4);
    assert_close(p4[1], 1.0, 0);
    sampler_work_destroy(w4);

    /* The whole chain against Hugging Face (transformers 4.x):
     *   sc = [[0.3,1.7,-0.4,1.1,0.9,-2.0,1.7,0.2]]; ids = [[0,3]]
     *   RepetitionPenalty(1.3) -> Temperature(0.8) -> TopK(5) -> TopP(0.8) -> MinP(0.3) -> softmax
     *   = [0, 0.4223187982515182, 0, 0, 0.15536240349696362, 0, 0.4223187982515182, 0] */
    float sc[8] = {0.3f, 1.7f, -0.4f, 1.1f, 0.9f, -2.0f, 1.7f, 0.2f};
    int32_t prompt[1] = {0}, out[1] = {3};
    sampler_hist h = {prompt, 1, out, 1, NULL, 0};
    sp = params();
    sp.repetition_penalty = 1.3f;
    sp.temperature = 0.8f;
    sp.top_k = 5;
    sp.top_p = 0.8f;
    sp.min_p = 0.3f;
    int32_t amax = sampler_probs(w, &sp, &h, sc, p);
    assert_int_equal(amax, 1);
    const double hf[8] = {0, 0.4223187982515182, 0, 0, 0.15536240349696362, 0, 0.4223187982515182, 0};
    for (int i = 0; i < 8; i++) assert_close(p[i], hf[i], 2e-6);
    /* greedy processes penalties too: one-hot at the penalised argmax */
    sp.temperature = 0.0f;
    assert_int_equal(sampler_probs(w, &sp, &h, sc, p), 1);
    assert_close(p[1], 1.0, 0);
    sampler_work_destroy(w);
}

static void test_logprobs(void **st) {
    (void)st;
    /* numpy log_softmax([0.5,-1.25,2,2,0]) = [-2.37431793,-4.12431793,-0.87431793,-0.87431793,-2.87431793] */
    float l[5] = {0.5f, -1.25f, 2.0f, 2.0f, 0.0f};
    token_logprob lp;
    sampler_logprobs(l, 5, 1, 3, &lp);
    assert_int_equal(lp.id, 1);
    assert_close(lp.logprob, -4.12431793, 1e-6);
    assert_int_equal(lp.n_top, 3);
    assert_int_equal(lp.top_ids[0], 2); /* tie 2/3 -> lower id first */
    assert_int_equal(lp.top_ids[1], 3);
    assert_int_equal(lp.top_ids[2], 0);
    assert_close(lp.top_logprobs[0], -0.87431793, 1e-6);
    assert_close(lp.top_logprobs[2], -2.37431793, 1e-6);
    sampler_logprobs(l, 5, 4, 0, &lp);
    assert_int_equal(lp.n_top, 0);
    assert_close(lp.logprob, -2.87431793, 1e-6);
    sampler_logprobs(l, 5, 4, 20, &lp);
    assert_int_equal(lp.n_top, 5);
    assert_int_equal(lp.top_ids[4], 1);
}

/* chi-square(3) survival, from stats_chi2.h (shared with the other statistical tests) */
static double chi2_3_sf(double x) { return chi2_sf(x, 3); }
static double chi2_3_quantile(double alpha) {
    double lo = 0, hi = 200;
    for (int i = 0; i < 200; i++) {
        double mid = (lo + hi) / 2;
        if (chi2_3_sf(mid) > alpha) lo = mid;
        else hi = mid;
    }
    return hi;
}

static void check_hist(const long *count, const float *p, long n, double thr, const char *what) {
    double chi = 0;
    for (int i = 0; i < 4; i++) {
        if (p[i] <= 0.0f) {
            if (count[i] != 0) fail_msg("%s: id %d has p=0 but %ld draws", what, i, count[i]);
            continue;
        }
        double e = (double)n * p[i];
        chi += ((double)count[i] - e) * ((double)count[i] - e) / e;
    }
    if (chi > thr) fail_msg("%s: chi2 %.2f > %.2f", what, chi, thr);
}

static void test_sampling_distribution(void **st) {
    (void)st;
    const double thr = chi2_3_quantile(1e-6);
    assert_close(chi2_3_sf(7.814727903), 0.05, 1e-6); /* scipy.stats.chi2.ppf(0.95, 3) = 7.814727903 */
    sampler_work *w = sampler_work_create(4);
    sampling_params sp = params();
    sp.temperature = 0.7f;
    float l[4] = {0.2f, -0.3f, 0.9f, 0.1f}, p[4];
    sampler_hist h = {0};
    sampler_probs(w, &sp, &h, l, p);
    sampler_rng r;
    sampler_rng_seed(&r, 1234);
    long count[4] = {0}, n = 100000;
    for (long i = 0; i < n; i++) count[sampler_sample(w, &sp, &h, &r, l)]++;
    check_hist(count, p, n, thr, "temperature 0.7");
    /* same seed -> same tokens */
    sampler_rng a, b;
    sampler_rng_seed(&a, 77);
    sampler_rng_seed(&b, 77);
    for (int i = 0; i < 200; i++) assert_int_equal(sampler_sample(w, &sp, &h, &a, l), sampler_sample(w, &sp, &h, &b, l));
    sampler_work_destroy(w);
}

/* Exhaustive small cases: output of draft-then-accept must be distributed as p. */
static void test_accept_rule_lossless(void **st) {
    (void)st;
    const double thr = chi2_3_quantile(1e-6 / 25);
    sampler_work *w = sampler_work_create(4);
    static const float P[5][4] = {
        {0.25f, 0.25f, 0.25f, 0.25f}, {0.7f, 0.1f, 0.1f, 0.1f}, {0.05f, 0.45f, 0.0f, 0.5f},
        {0.0f, 0.0f, 1.0f, 0.0f},     {0.1f, 0.2f, 0.3f, 0.4f},
    };
    static const float Q[4][4] = {
        {0.25f, 0.25f, 0.25f, 0.25f}, {0.0f, 0.0f, 0.0f, 1.0f}, {0.6f, 0.2f, 0.1f, 0.1f}, {0.1f, 0.4f, 0.4f, 0.1f},
    };
    sampler_rng r;
    sampler_rng_seed(&r, 2024);
    int cases = 0;
    for (int pi = 0; pi < 5; pi++)
        for (int qi = 0; qi < 4; qi++) {
            const float *p = P[pi], *q = Q[qi];
            long count[4] = {0}, n = 100000, acc = 0;
            for (long t = 0; t < n; t++) {
                int32_t x = sampler_draw(q, 4, sampler_rng_uniform(&r)); /* draft token ~ q */
                int32_t y;
                acc += sampler_accept(p, q, 4, x, &r, w, &y);
                count[y]++;
            }
            char what[64];
            snprintf(what, sizeof what, "p%d q%d", pi, qi);
            check_hist(count, p, n, thr, what);
            /* acceptance rate = sum min(p, q); binomial sd <= 0.0016, 6 sd */
            double a = 0;
            for (int i = 0; i < 4; i++) a += fmin(p[i], q[i]);
            assert_close((double)acc / n, a, 0.01);
            cases++;
        }
    /* one-hot drafts (q = NULL): x fixed, accept w.p. p(x), else p without x */
    for (int pi = 0; pi < 5; pi++) {
        const float *p = P[pi];
        long count[4] = {0}, n = 100000;
        for (long t = 0; t < n; t++) {
            int32_t y;
            sampler_accept(p, NULL, 4, 1, &r, w, &y);
            count[y]++;
        }
        /* one-hot at x=1 means the draft distribution is delta(1); output must still be p */
        char what[64];
        snprintf(what, sizeof what, "p%d one-hot", pi);
        check_hist(count, p, n, thr, what);
    }
    assert_int_equal(cases, 20);
    sampler_work_destroy(w);
}

/* Exhaustive over a grid, many seeds: every p and every q over V = 4 whose
 * probabilities are multiples of 1/4 (the 35 compositions of 4 into 4 parts:
 * uniform, one-hot, two- and three-point, with zeros anywhere), all 35 x 35
 * (p, q) pairs with x ~ q, plus every p with a one-hot draft at each of the 4
 * ids (q = NULL): 1,365 cases, each with its own seed (1000 + case) and
 * N = 20,000 draft-then-accept draws. Per case:
 *   - output ~ p: ids with p = 0 must get exactly 0 draws; over the others a
 *     chi-square test with df = (ids with p > 0) - 1 at alpha = 1e-6 / 2730
 *     (stats_chi2.h's exact upper tail; every expected count >= 0.25 N = 5000);
 *     a p with one id must give that id every time;
 *   - acceptance rate = sum_i min(p_i, q_i) (= p(x) for a one-hot draft at x):
 *     exact when that is 0 or 1, else within 6.5 binomial sd (two-sided tail
 *     8e-11 per case under the normal approximation, N a = N (1 - a) >= 5000
 *     here: a is a multiple of 1/4).
 * Union bound: a correct rule fails with probability <= 1e-6 for random seeds;
 * the seeds are fixed, so the run is deterministic. */
static void test_accept_rule_exhaustive(void **st) {
    (void)st;
    float G[35][4];
    int ng = 0;
    for (int a = 0; a <= 4; a++)
        for (int b = 0; a + b <= 4; b++)
            for (int c = 0; a + b + c <= 4; c++) {
                G[ng][0] = a / 4.0f, G[ng][1] = b / 4.0f, G[ng][2] = c / 4.0f, G[ng][3] = (4 - a - b - c) / 4.0f;
                ng++;
            }
    assert_int_equal(ng, 35);
    const int n_cases = 35 * 35 + 35 * 4;
    const double alpha = 1e-6 / (2.0 * n_cases);
    const long N = 20000;
    sampler_work *w = sampler_work_create(4);
    int cases = 0;
    double min_pv = 1.0;
    for (int pi = 0; pi < 35; pi++)
        for (int qi = 0; qi < 35 + 4; qi++) {
            const float *p = G[pi], *q = qi < 35 ? G[qi] : NULL;
            const int32_t onehot = qi - 35; /* draft id when q == NULL */
            sampler_rng r;
            sampler_rng_seed(&r, 1000 + (uint64_t)cases);
            long count[4] = {0}, acc = 0;
            for (long t = 0; t < N; t++) {
                int32_t x = q ? sampler_draw(q, 4, sampler_rng_uniform(&r)) : onehot, y = -1;
                acc += sampler_accept(p, q, 4, x, &r, w, &y);
                if (y < 0 || y > 3) fail_msg("p%d q%d: output %d out of range", pi, qi, y);
                count[y]++;
            }
            double chi = 0;
            int support = 0;
            for (int i = 0; i < 4; i++) {
                if (p[i] == 0.0f) {
                    if (count[i]) fail_msg("p%d q%d: id %d has p = 0 but %ld draws", pi, qi, i, count[i]);
                    continue;
                }
                double e = (double)N * p[i];
                chi += ((double)count[i] - e) * ((double)count[i] - e) / e;
                support++;
            }
            if (support > 1) {
                double pv = chi2_sf(chi, support - 1);
                if (pv < min_pv) min_pv = pv;
                if (pv < alpha) fail_msg("p%d q%d: chi2 %.2f (df %d), p-value %.3g < %.3g", pi, qi, chi, support - 1, pv, alpha);
            }
            double a = 0;
            for (int i = 0; i < 4; i++) a += q ? fmin(p[i], q[i]) : (i == onehot ? p[i] : 0.0);
            double rate = (double)acc / (double)N;
            if (a == 0.0 || a == 1.0) {
                if (rate != a) fail_msg("p%d q%d: acceptance rate %.5f, exactly %.2f expected", pi, qi, rate, a);
            } else if (fabs(rate - a) > 6.5 * sqrt(a * (1 - a) / (double)N)) {
                fail_msg("p%d q%d: acceptance rate %.5f vs sum min(p, q) = %.2f", pi, qi, rate, a);
            }
            cases++;
        }
    assert_int_equal(cases, n_cases);
    printf("accept rule, exhaustive 1/4 grid: %d cases x %ld draws, smallest chi-square p-value %.3g (alpha %.3g)\n",
           cases, N, min_pv, alpha);
    sampler_work_destroy(w);
}

/* logit_bias (step 3b) and the test-only forced output (3c), against a
 * logits row biased by hand (the reference never passes the bias to the sampler). */
static void test_logit_bias_and_forced(void **st) {
    (void)st;
    enum { V = 64 };
    sampler_work *w = sampler_work_create(V);
    float logits[V], biased[V], p1[V], p2[V];
    sampler_rng rng;
    sampler_rng_seed(&rng, 7);
    for (int i = 0; i < V; i++) logits[i] = (float)(sampler_rng_uniform(&rng) * 8.0 - 4.0);
    int32_t a = sampler_argmax(logits, V);
    int32_t second = a == 0 ? 1 : 0;
    for (int i = 0; i < V; i++)
        if (i != a && logits[i] > logits[second]) second = i;
    sampling_params sp;
    memset(&sp, 0, sizeof sp);
    sp.top_p = 1.0f;
    sp.top_k = -1;
    sp.repetition_penalty = 1.0f;
    int32_t ids[3] = {a, 5, 9};
    float bias[3] = {-100.0f, 2.5f, -0.75f};
    sp.logit_bias_ids = ids;
    sp.logit_bias = bias;
    sp.n_logit_bias = 3;
    sampler_hist h = {0};
    memcpy(biased, logits, sizeof biased);
    for (int k = 0; k < 3; k++) biased[ids[k]] += bias[k];
    /* greedy: the argmax of the hand-biased row (the runner-up unless 5 or 9 overtook it) */
    assert_int_equal(sampler_sample(w, &sp, &h, &rng, logits), sampler_argmax(biased, V));
    if (second != 5 && second != 9 && biased[second] > biased[5] && biased[second] > biased[9])
        assert_int_equal(sampler_sample(w, &sp, &h, &rng, logits), second);
    /* +100 wins whatever the row */
    bias[0] = 100.0f;
    ids[0] = second;
    assert_int_equal(sampler_sample(w, &sp, &h, &rng, logits), second);
    /* sampling: the processed distribution is the one of the hand-biased row */
    sp.temperature = 0.7f;
    sp.top_k = 20;
    sp.top_p = 0.9f;
    bias[0] = -1.25f;
    memcpy(biased, logits, sizeof biased);
    for (int k = 0; k < 3; k++) biased[ids[k]] += bias[k];
    sampler_probs(w, &sp, &h, logits, p1);
    sampling_params plain = sp;
    plain.n_logit_bias = 0;
    sampler_probs(w, &plain, &h, biased, p2);
    for (int i = 0; i < V; i++) assert_true(p1[i] == p2[i]);
    /* forced output: token j < n_forced is forced_ids[j], greedy or not, then the normal rule again */
    int32_t forced[2] = {11, 12};
    sp.forced_ids = forced;
    sp.n_forced_ids = 2;
    int32_t out[2] = {0};
    for (size_t j = 0; j < 2; j++) {
        h.output = out;
        h.n_output = j;
        assert_int_equal(sampler_sample(w, &sp, &h, &rng, logits), forced[j]);
        out[j] = forced[j];
    }
    h.n_output = 2;
    sp.temperature = 0.0f;
    assert_int_equal(sampler_sample(w, &sp, &h, &rng, logits), sampler_argmax(biased, V));
    sampler_work_destroy(w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logit_bias_and_forced),
        cmocka_unit_test(test_rng_reference),   cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_greedy_ties_and_draw), cmocka_unit_test(test_temperature_and_filters),
        cmocka_unit_test(test_logprobs),        cmocka_unit_test(test_sampling_distribution),
        cmocka_unit_test(test_accept_rule_lossless), cmocka_unit_test(test_accept_rule_exhaustive),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
