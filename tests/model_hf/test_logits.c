/*
 * test_logits.c (model_hf_logits): the tiny HF Llama checkpoints loaded from
 * their directories (f32 untied, bf16 tied with head_dim != hidden/heads, f16
 * in two shards with llama3 RoPE scaling, mistral f32 tied with linear RoPE
 * scaling) against Hugging Face transformers on the same files
 * (tests/fixtures/model_hf, tools/gen_llama_hf_ref.py): at 4 positions of 3
 * prompts the top-1 token is identical and max |diff| <= 1e-3 * max |logit|;
 * the 16-token greedy continuation decoded through the paged cache is
 * token-identical to transformers' (cache-free) greedy.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>

#include "tests/model_hf/model_hf_util.h"

static backend *g_be;

static void check_variant(const char *name) {
    json_t *ref = mh_ref();
    const int V = (int)json_integer_value(json_object_get(ref, "vocab"));
    const json_t *prompts = json_object_get(ref, "prompts"), *poss = json_object_get(ref, "positions");
    const json_t *var = json_object_get(json_object_get(ref, "variants"), name);
    assert_non_null(var);
    const int np = (int)json_array_size(prompts), npos = (int)json_array_size(json_array_get(poss, 0));
    const int ng = (int)json_integer_value(json_object_get(ref, "n_greedy"));
    float *want = mh_ref_logits(name, (size_t)np * npos * V);
    model *m = mh_load(g_be, mh_dir(name));
    assert_int_equal(model_get_config(m)->vocab, V);
    assert_true(model_get_config(m)->rope_neox);
    float *lg = malloc(sizeof(float) * (size_t)(npos > 1 ? npos : 1) * V);
    double worst_rel = 0, worst_abs = 0;
    for (int p = 0; p < np; p++) {
        int n;
        const int32_t *toks = mh_prompt(ref, p, &n);
        int32_t pos[256], seq[256], out[8];
        for (int i = 0; i < n; i++) { pos[i] = i; seq[i] = 0; }
        for (int j = 0; j < npos; j++) out[j] = (int32_t)json_integer_value(json_array_get(json_array_get(poss, (size_t)p), (size_t)j));
        assert_int_equal(out[npos - 1], n - 1);
        assert_int_equal(mh_step(m, n, toks, pos, seq, npos, out, lg), 0);
        for (int j = 0; j < npos; j++) {
            const float *w = want + ((size_t)p * npos + j) * V, *g = lg + (size_t)j * V;
            double mx = 0, md = 0;
            for (int v = 0; v < V; v++) {
                mx = fmax(mx, fabs(w[v]));
                md = fmax(md, fabs((double)w[v] - g[v]));
            }
            if (mh_argmax(w, V) != mh_argmax(g, V) || md > 1e-3 * mx)
                fail_msg("%s prompt %d position %d: top-1 %d vs transformers %d, max|diff| %.3g (max|logit| %.3g)", name,
                         p, out[j], mh_argmax(g, V), mh_argmax(w, V), md, mx);
            worst_abs = fmax(worst_abs, md);
            worst_rel = fmax(worst_rel, md / mx);
        }
        /* greedy continuation through the paged cache, one token per step */
        const json_t *gw = json_array_get(json_object_get(var, "greedy"), (size_t)p);
        assert_int_equal((int)json_array_size(gw), ng);
        int32_t t = mh_argmax(lg + (size_t)(npos - 1) * V, V), z = 0;
        for (int k = 0; k < ng; k++) {
            const int32_t wk = (int32_t)json_integer_value(json_array_get(gw, (size_t)k));
            if (t != wk) fail_msg("%s prompt %d: greedy token %d is %d, transformers %d", name, p, k, t, wk);
            int32_t ps = n + k;
            assert_int_equal(mh_step(m, 1, &t, &ps, &z, 1, &z, lg), 0);
            t = mh_argmax(lg, V);
        }
    }
    printf("%-8s %d prompts x %d positions: max|diff| %.3g, max|diff|/max|logit| %.3g; greedy %d x %d identical\n", name,
           np, npos, worst_abs, worst_rel, np, ng);
    free(lg);
    free(want);
    model_destroy(m);
    json_decref(ref);
}

static void test_f32(void **s) { (void)s; check_variant("f32"); }
static void test_bf16(void **s) { (void)s; check_variant("bf16"); }
static void test_sharded(void **s) { (void)s; check_variant("sharded"); }
static void test_mistral(void **s) { (void)s; check_variant("mistral"); }

int main(void) {
    mh_dir("f32"); /* skip early if the checkpoints are absent */
    g_be = bk_cpu_create(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f32), cmocka_unit_test(test_bf16), cmocka_unit_test(test_sharded),
        cmocka_unit_test(test_mistral)};
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    bk_cpu_destroy(g_be);
    return rc;
}
