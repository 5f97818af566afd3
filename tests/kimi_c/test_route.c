/*
 * test_route.c (kimi_c_route): specd's MoE router (dsv3_route, noaux_tc)
 * against Hugging Face transformers' DeepseekV3TopkRouter
 * (tests/fixtures/kimi_c/router_cases.json, tests/kimi_c/gen_router_fixture.py),
 * fed the router's own f32 logits: for a Kimi-like config (1 group), a
 * DeepSeek-V3-like one (8 groups, 4 kept), 4 groups keeping 1, and one without
 * weight normalisation, with biases strongly negative for a quarter of the
 * experts: the chosen expert sets are identical and the weights equal within
 * 1e-6 relative (compared by expert id: torch.topk is unsorted).
 * Pure unit test: needs no checkpoint.
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

static void test_router_vs_transformers(void **st) {
    (void)st;
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/kimi_c/router_cases.json", getenv("SPECD_SOURCE_DIR"));
    json_error_t je;
    json_t *fx = json_load_file(path, 0, &je);
    assert_non_null(fx);
    const json_t *cfgs = json_object_get(fx, "configs");
    int checked = 0;
    for (size_t ci = 0; ci < json_array_size(cfgs); ci++) {
        const json_t *c = json_array_get(cfgs, ci);
        hf_config hc;
        memset(&hc, 0, sizeof hc);
        hc.n_routed_experts = (int32_t)json_integer_value(json_object_get(c, "n_routed_experts"));
        hc.n_experts_per_tok = (int32_t)json_integer_value(json_object_get(c, "num_experts_per_tok"));
        hc.n_group = (int32_t)json_integer_value(json_object_get(c, "n_group"));
        hc.topk_group = (int32_t)json_integer_value(json_object_get(c, "topk_group"));
        hc.routed_scaling = (float)json_number_value(json_object_get(c, "routed_scaling_factor"));
        hc.norm_topk_prob = json_is_true(json_object_get(c, "norm_topk_prob"));
        const int E = hc.n_routed_experts, k = hc.n_experts_per_tok;
        float bias[256], logits[256], scr[512], w[64];
        int32_t ids[64];
        const json_t *jb = json_object_get(c, "bias"), *jl = json_object_get(c, "logits");
        const json_t *jid = json_object_get(c, "topk_ids"), *jw = json_object_get(c, "topk_weights");
        for (int e = 0; e < E; e++) bias[e] = (float)json_number_value(json_array_get(jb, (size_t)e));
        for (size_t t = 0; t < json_array_size(jl); t++) {
            const json_t *lt = json_array_get(jl, t);
            for (int e = 0; e < E; e++) logits[e] = (float)json_number_value(json_array_get(lt, (size_t)e));
            dsv3_route(&hc, logits, bias, scr, ids, w);
            const json_t *wi = json_array_get(jid, t), *ww = json_array_get(jw, t);
            for (int j = 0; j < k; j++) {
                const int want = (int)json_integer_value(json_array_get(wi, (size_t)j));
                const double wv = json_number_value(json_array_get(ww, (size_t)j));
                int found = -1;
                for (int u = 0; u < k; u++) if (ids[u] == want) found = u;
                if (found < 0) fprintf(stderr, "%s token %zu: expert %d not chosen\n",
                                       json_string_value(json_object_get(c, "name")), t, want);
                assert_true(found >= 0);
                assert_true(fabs(w[found] - wv) <= 1e-6 * fabs(wv) + 1e-9);
            }
            checked++;
        }
    }
    printf("kimi_c_route: %d tokens over %zu router configs == transformers (sets and weights)\n", checked,
           json_array_size(cfgs));
    json_decref(fx);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_router_vs_transformers)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
