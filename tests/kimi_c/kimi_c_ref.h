/* kimi_c_ref.h: a Kimi miniature's logits against its transformers fixture
 * (mini_logits.json / mini_wide8_logits.json, written by make_minis.py): the
 * check kimi_c_tp and kimi_c_ep share. Needs cmocka (fail_msg) included first. */
#ifndef SPECD_TESTS_KIMI_C_REF_H
#define SPECD_TESTS_KIMI_C_REF_H

#include "tests/kimi_c/kimi_c_util.h"

/* M (at any TP or EP size; kc_tp_runner set by the caller) against a transformers fixture: per prompt, the
 * prefill's logits twice (bit-identical), top-5 ids identical and max |diff| <= 2e-3 x max|logit| at every
 * stored position (kimi_c_logits' bounds), then the fixture's greedy continuation token for token through
 * the paged latent cache. Returns the worst |diff| / max|logit|. */
static inline double kc_vs_transformers(model *m, const json_t *fx, const char *what) {
    const int V = model_get_config(m)->vocab;
    const json_t *prompts = json_object_get(fx, "prompts"), *sel = json_object_get(fx, "sel_ids");
    double worst = 0;
    float *lg = malloc(sizeof(float) * 128 * (size_t)V), *lg2 = malloc(sizeof(float) * 128 * (size_t)V);
    for (size_t pi = 0; pi < json_array_size(prompts); pi++) {
        const json_t *pr = json_array_get(prompts, pi);
        int n;
        int32_t *ids = kc_ids(json_object_get(pr, "ids"), &n);
        assert_int_equal(kc_run(m, 0, ids, n, 0, lg2, NULL, 0, NULL, NULL), 0);
        assert_int_equal(kc_run(m, 0, ids, n, 0, lg, NULL, 0, NULL, NULL), 0);
        if (memcmp(lg, lg2, sizeof(float) * (size_t)n * V)) fail_msg("%s prompt %zu: rerun not bit-identical", what, pi);
        const json_t *rows = json_object_get(pr, "logits");
        for (size_t k = 0; k < json_array_size(rows); k++) {
            const json_t *r = json_array_get(rows, k);
            const int p = (int)json_integer_value(json_object_get(r, "pos"));
            const float *row = lg + (size_t)p * V;
            const json_t *t5 = json_object_get(r, "top5_ids"), *t5v = json_object_get(r, "top5_logits");
            int top[5];
            for (int j = 0; j < 5; j++) {
                int b = -1;
                for (int i = 0; i < V; i++) {
                    int used = 0;
                    for (int u = 0; u < j; u++) used |= top[u] == i;
                    if (!used && (b < 0 || row[i] > row[b])) b = i;
                }
                top[j] = b;
            }
            double e = 0;
            for (int j = 0; j < 5; j++) {
                const int want = (int)json_integer_value(json_array_get(t5, (size_t)j));
                if (top[j] != want)
                    fail_msg("%s prompt %zu pos %d: top-%d id %d, transformers %d", what, pi, p, j + 1, top[j], want);
                e = fmax(e, fabs(row[want] - json_number_value(json_array_get(t5v, (size_t)j))));
            }
            const json_t *sv = json_object_get(r, "sel_logits");
            for (size_t j = 0; j < json_array_size(sel); j++)
                e = fmax(e, fabs(row[json_integer_value(json_array_get(sel, j))] - json_number_value(json_array_get(sv, j))));
            e /= json_number_value(json_object_get(r, "max_abs_logit"));
            worst = fmax(worst, e);
            if (e > 2e-3) fail_msg("%s prompt %zu pos %d: |diff| %.3g of max|logit| > 2e-3", what, pi, p, e);
        }
        const json_t *gr = json_object_get(pr, "greedy");
        int32_t next = kc_argmax(lg + (size_t)(n - 1) * V, V);
        for (size_t s = 0; s < json_array_size(gr); s++) {
            const int32_t want = (int32_t)json_integer_value(json_array_get(gr, s));
            if (next != want) fail_msg("%s prompt %zu greedy step %zu: %d != transformers %d", what, pi, s, next, want);
            assert_int_equal(kc_run(m, 0, &next, 1, n + (int)s, lg, NULL, 0, NULL, NULL), 0);
            next = kc_argmax(lg, V);
        }
        free(ids);
    }
    free(lg);
    free(lg2);
    return worst;
}

#endif
