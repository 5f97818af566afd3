/*
 * deepseek_v3_route.c: dsv3_route (deepseek_v3.h), the noaux_tc MoE router
 * of DeepSeek-V3 / Kimi-K2.5 for one token: a pure function of the router's
 * f32 logits, the correction bias and the config. In its own file so that
 * the GPU router's test (tests/kernels/test_kn_moe.c, kernels/kn_moe.cu)
 * links the CPU reference itself without the rest of the model (the
 * nvcc + cc fallback build of tools/kn_direct_build.sh has no loader).
 * kn_moe_route reproduces its order of operations.
 * Threading: pure; any thread.
 */
#include <math.h>
#include <stdbool.h>

#include "engine/model/deepseek_v3.h"

void dsv3_route(const hf_config *c, const float *logits, const float *bias, float *scratch, int32_t *ids, float *w) {
    float *sc = scratch, *choice = scratch + c->n_routed_experts;
    const int32_t E = c->n_routed_experts, k = c->n_experts_per_tok, G = c->n_group, per = E / G;
    for (int32_t e = 0; e < E; e++) {
        sc[e] = 1.0f / (1.0f + expf(-logits[e]));
        choice[e] = sc[e] + bias[e];
    }
    if (G > 1 && c->topk_group < G) {
        float gs[1024];
        bool keep[1024] = {false};
        for (int32_t g = 0; g < G; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int32_t e = g * per; e < (g + 1) * per; e++) {
                if (choice[e] > b1) { b2 = b1; b1 = choice[e]; }
                else if (choice[e] > b2) b2 = choice[e];
            }
            gs[g] = b1 + b2;
        }
        for (int32_t j = 0; j < c->topk_group; j++) {
            int32_t best = -1;
            for (int32_t g = 0; g < G; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
            keep[best] = true;
        }
        for (int32_t e = 0; e < E; e++)
            if (!keep[e / per]) choice[e] = -INFINITY;
    }
    float sum = 0;
    for (int32_t j = 0; j < k; j++) {
        int32_t best = -1;
        for (int32_t e = 0; e < E; e++) {
            bool used = false;
            for (int32_t u = 0; u < j; u++) used |= ids[u] == e;
            if (!used && (best < 0 || choice[e] > choice[best])) best = e;
        }
        ids[j] = best;
        w[j] = sc[best];
        sum += w[j];
    }
    for (int32_t j = 0; j < k; j++) {
        if (c->norm_topk_prob) w[j] /= (sum + 1e-20f);
        w[j] *= c->routed_scaling;
    }
}
