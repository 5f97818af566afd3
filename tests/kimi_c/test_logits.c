/*
 * test_logits.c (kimi_c_logits): specd's DeepSeek-V3 forward pass on the
 * seed-0 Kimi miniature vs Hugging Face transformers' DeepseekV3ForCausalLM
 * (tests/fixtures/kimi/mini_logits.json, tools/kimi/reference.py: float32,
 * experts dequantized by compressed-tensors). Asserts:
 *   - YaRN inv_freq within 2 ulp of transformers', the softmax scale and the
 *     cos/sin attention factor equal;
 *   - for 4 prompts at 5 positions each: top-1 and top-5 ids identical, max
 *     |diff| over the 64 stored ids + top-5 <= 2e-3 x max|logit|;
 *   - prompt 0: the residual stream entering every layer (EAGLE-3 aux capture)
 *     and the final-normed state within 1e-4 relative at the stored positions;
 *   - the 32-token greedy continuations, decoded one token per step through the
 *     latent paged cache, identical (a mismatch prints the reference margin).
 * With KIMI_C_LATENT_BF16=1 (ctest kimi_c_logits_bf16) the model keeps its latent
 * cache in bf16 and the reference is mini_logits_bf16latent.json (the doc's
 * forward pass with the same rounding, tools/kimi/gen_bf16_latent_fixture.py):
 * the same bounds, and greedy identical up to the reference's first routing
 * near-tie where the tokens part (test_greedy says why). Against the f32
 * transformers fixture a bf16 latent cannot hold these bounds on this random
 * miniature: the rounding alone (no specd code) moves its logits by up to 0.113
 * of max|logit| and parts greedy after 4 to 32 tokens (docs/kimi-k2.5.md).
 */
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/model/deepseek_v3.h"
#include "tests/kimi_c/kimi_c_util.h"

static json_t *g_fx;
static model *g_m;
static backend *g_be;
static int V;

static double jnum(const json_t *o, const char *k) { return json_number_value(json_object_get(o, k)); }

static void test_rope_params(void **st) {
    (void)st;
    hf_config hc;
    specd_err err = {{0}};
    assert_int_equal(hf_config_load(kc_mini_dir("k25"), &hc, &err), 0);
    float inv[64], att, scale;
    dsv3_rope_params(&hc, inv, &att, &scale);
    const json_t *rope = json_object_get(g_fx, "rope"), *ref = json_object_get(rope, "inv_freq");
    assert_int_equal(json_array_size(ref), hc.qk_rope / 2);
    for (int i = 0; i < hc.qk_rope / 2; i++) {
        const float want = (float)json_number_value(json_array_get(ref, (size_t)i));
        printf("inv_freq[%d] = %.9g (transformers %.9g)\n", i, (double)inv[i], (double)want);
        assert_true(fabsf(inv[i] - want) <= 2 * (nextafterf(want, INFINITY) - want));
    }
    assert_true(fabs(scale - jnum(rope, "softmax_scale")) <= 1e-7 * jnum(rope, "softmax_scale"));
    assert_true(att == (float)jnum(rope, "attention_scaling_cos_sin"));
}

static void test_logits(void **st) {
    (void)st;
    const json_t *prompts = json_object_get(g_fx, "prompts"), *sel = json_object_get(g_fx, "sel_ids");
    double worst = 0;
    for (size_t pi = 0; pi < json_array_size(prompts); pi++) {
        const json_t *pr = json_array_get(prompts, pi);
        int n;
        int32_t *ids = kc_ids(json_object_get(pr, "ids"), &n);
        float *lg = malloc(sizeof(float) * (size_t)n * V);
        assert_int_equal(kc_run(g_m, 0, ids, n, 0, lg, NULL, 0, NULL, NULL), 0);
        const json_t *rows = json_object_get(pr, "logits");
        for (size_t k = 0; k < json_array_size(rows); k++) {
            const json_t *r = json_array_get(rows, k);
            const int p = (int)json_integer_value(json_object_get(r, "pos"));
            const float *row = lg + (size_t)p * V;
            /* top-5 by value (ties: lower id, as a stable argsort) */
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
            const json_t *t5 = json_object_get(r, "top5_ids"), *t5v = json_object_get(r, "top5_logits");
            const double scale = jnum(r, "max_abs_logit");
            double err = 0;
            for (int j = 0; j < 5; j++) {
                const int want = (int)json_integer_value(json_array_get(t5, (size_t)j));
                if (top[j] != want)
                    fprintf(stderr, "prompt %zu pos %d: top-%d id %d, transformers %d\n", pi, p, j + 1, top[j], want);
                assert_int_equal(top[j], want);
                err = fmax(err, fabs(row[want] - json_number_value(json_array_get(t5v, (size_t)j))));
            }
            const json_t *sv = json_object_get(r, "sel_logits");
            for (size_t j = 0; j < json_array_size(sel); j++)
                err = fmax(err, fabs(row[json_integer_value(json_array_get(sel, j))] -
                                     json_number_value(json_array_get(sv, j))));
            err /= scale;
            worst = fmax(worst, err);
            assert_true(err <= 2e-3);
        }
        free(lg);
        free(ids);
    }
    printf("kimi_c_logits: 4 prompts x 5 positions: top-5 identical, worst |diff| %.3g of max|logit|\n", worst);
}

static void test_hidden_states(void **st) {
    (void)st;
    const json_t *pr = json_array_get(json_object_get(g_fx, "prompts"), 0);
    const json_t *hs = json_object_get(pr, "hidden_states");
    const json_t *states = json_object_get(hs, "states"), *fin = json_object_get(hs, "final_norm");
    const json_t *poss = json_object_get(hs, "positions");
    const model_config *mc = model_get_config(g_m);
    const int H = mc->hidden, L = mc->n_layers;
    int n;
    int32_t *ids = kc_ids(json_object_get(pr, "ids"), &n);
    int32_t layers[64];
    for (int l = 0; l < L; l++) layers[l] = l;
    float *aux = malloc(sizeof(float) * (size_t)n * L * H), *fh = malloc(sizeof(float) * (size_t)n * H);
    assert_int_equal(kc_run(g_m, 0, ids, n, 0, NULL, fh, L, layers, aux), 0);
    double worst = 0;
    for (size_t k = 0; k < json_array_size(poss); k++) {
        const int p = (int)json_integer_value(json_array_get(poss, k));
        /* states[l] for l < L = residual entering layer l (states[0] = embedding) */
        for (int l = 0; l <= L; l++) {
            const json_t *ref = l < L ? json_array_get(json_array_get(states, (size_t)l), k) : json_array_get(fin, k);
            const float *got = l < L ? aux + ((size_t)p * L + l) * H : fh + (size_t)p * H;
            double mx = 0, e = 0;
            for (int i = 0; i < H; i++) {
                const double r = json_number_value(json_array_get(ref, (size_t)i));
                mx = fmax(mx, fabs(r));
                e = fmax(e, fabs(got[i] - r));
            }
            e /= mx;
            worst = fmax(worst, e);
            if (e >= 1e-4) fprintf(stderr, "pos %d %s %d: rel err %.3g\n", p, l < L ? "layer" : "final norm", l, e);
            assert_true(e < 1e-4);
        }
    }
    printf("kimi_c_logits: hidden states of prompt 0 (every layer + final norm): worst %.3g relative\n", worst);
    free(aux); free(fh); free(ids);
}

/* The bf16-latent reference (mini_logits_bf16latent.json) also stores, per greedy step, the smallest gap
 * between the k-th and (k+1)-th routing score of the last token over the MoE layers. One bf16 rounding that
 * falls the other way (a 1e-7 f32 difference upstream decides it) moves a latent value by 2^-8 of itself and
 * the router's scores by ~1e-3; so a step whose gap is below ROUTE_FRAGILE (2^-9 = 1.95e-3) may swap an
 * expert, and the two sequences go separate ways from there. There a mismatch ends the comparison of that
 * prompt (reported); anywhere else it fails. The f32 fixture has no gaps: every mismatch fails. */
#define ROUTE_FRAGILE 0x1p-9

static void test_greedy(void **st) {
    (void)st;
    const json_t *prompts = json_object_get(g_fx, "prompts");
    float *lg = malloc(sizeof(float) * 128 * (size_t)V);
    int compared = 0, total = 0;
    for (size_t pi = 0; pi < json_array_size(prompts); pi++) {
        const json_t *pr = json_array_get(prompts, pi);
        const json_t *gr = json_object_get(pr, "greedy"), *mg = json_object_get(pr, "greedy_margins");
        const json_t *gaps = json_object_get(pr, "greedy_route_gaps");
        int n;
        int32_t *ids = kc_ids(json_object_get(pr, "ids"), &n);
        assert_int_equal(kc_run(g_m, 0, ids, n, 0, lg, NULL, 0, NULL, NULL), 0);
        int32_t next = kc_argmax(lg + (size_t)(n - 1) * V, V);
        const int steps = (int)json_array_size(gr);
        int s = 0;
        total += steps;
        for (; s < steps; s++) {
            const int32_t want = (int32_t)json_integer_value(json_array_get(gr, (size_t)s));
            if (next != want) {
                const double gap = gaps ? json_number_value(json_array_get(gaps, (size_t)s)) : 1.0;
                fprintf(stderr, "prompt %zu greedy step %d: %d != %d (reference margin %.4g, routing gap %.3g)\n", pi,
                        s, next, want, json_number_value(json_array_get(mg, (size_t)s)), gap);
                if (gap < ROUTE_FRAGILE) {
                    printf("kimi_c_logits: prompt %zu: greedy identical for %d of %d tokens, then a routing near-tie "
                           "(gap %.3g < %.3g) of the reference\n", pi, s, steps, gap, ROUTE_FRAGILE);
                    break;
                }
            }
            assert_int_equal(next, want);
            /* decode: one token per step through the paged latent cache */
            assert_int_equal(kc_run(g_m, 0, &next, 1, n + s, lg, NULL, 0, NULL, NULL), 0);
            next = kc_argmax(lg, V);
        }
        compared += s;
        if (s == steps) printf("kimi_c_logits: prompt %zu: %d greedy tokens identical to the reference\n", pi, steps);
        free(ids);
    }
    printf("kimi_c_logits: %d of %d greedy tokens compared, all identical\n", compared, total);
    free(lg);
}

int main(void) {
    const char *dir = kc_mini_dir("k25");
    /* KIMI_C_LATENT_BF16=1 (ctest kimi_c_logits_bf16): the latent cache in bf16 (kc_load), against the reference
     * with the same rounding (tools/kimi/gen_bf16_latent_fixture.py), at the same bounds */
    const char *b16 = getenv("KIMI_C_LATENT_BF16");
    const bool bf16 = b16 && *b16 && strcmp(b16, "0") != 0;
    g_fx = kc_fixture(bf16 ? "mini_logits_bf16latent.json" : "mini_logits.json");
    g_be = bk_cpu_create(0);
    g_m = kc_load(g_be, dir, 1);
    V = model_get_config(g_m)->vocab;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rope_params),
        cmocka_unit_test(test_logits),
        cmocka_unit_test(test_hidden_states),
        cmocka_unit_test(test_greedy),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    model_destroy(g_m);
    bk_cpu_destroy(g_be);
    json_decref(g_fx);
    return rc;
}
