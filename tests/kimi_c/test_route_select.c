/*
 * test_route_select.c (kimi_c_route_select): the GPU router's selection
 * scheme (kernels/kn_moe.cu kn_moe_route_kernel: lane-strided scans over 32
 * lanes combined by an xor butterfly, under kn_moe_select.h's total order)
 * gives exactly dsv3_route's experts, in its order, on the CPU. The warp is
 * modelled here step by step (32 lanes, the kernel's strides, its butterfly
 * 16, 8, 4, 2, 1, its sigmoid (float)exp((double)-x), its f32 weight
 * arithmetic) with the kernel's own comparison (kn_cand_better), so the
 * claim "a total order makes the parallel argmax equal to the sequential
 * loop" is checked on every CI machine, not only on a GPU (tests/kernels
 * kn_moe checks the kernel itself there).
 * Cases: 4 configs (Kimi 384 / 1 group, DeepSeek-V3 256 / 8 groups keep 4,
 * 64 / 4 keep 1, 16 without normalisation), 4,000 tokens each with planted
 * ties (equal logits and biases in pairs, all-equal tokens, equal groups) and
 * masked (-inf) experts; ids and their order identical; weights bitwise
 * equal where glibc's expf equals the correctly rounded value on the token's
 * logits; all-NaN tokens still give k distinct ids in range.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "engine/model/deepseek_v3.h"
#include "kernels/kn_moe_select.h"

static uint64_t g_rng = 0x70e5e1ec7ull;
static double unif(void) { /* [-1, 1) */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

/* the warp's xor butterfly over 32 lane candidates: every lane ends with the maximum */
static kn_cand warp_best(kn_cand c[32]) {
    for (int off = 16; off > 0; off >>= 1) {
        kn_cand n[32];
        for (int l = 0; l < 32; l++) n[l] = kn_cand_better(c[l ^ off], c[l]) ? c[l ^ off] : c[l];
        memcpy(c, n, sizeof n);
    }
    for (int l = 1; l < 32; l++) assert_memory_equal(&c[l], &c[0], sizeof c[0]); /* a total order: all agree */
    return c[0];
}

/* kn_moe_route_kernel's steps for one token (its lanes modelled one after the other) */
static void model_route(const hf_config *c, const float *lg, const float *bias, int32_t *ids, float *w) {
    const int E = c->n_routed_experts, G = c->n_group, k = c->n_experts_per_tok, per = E / G;
    float sc[512], ch[512], gs[64];
    unsigned char used[512] = {0}, keep[64] = {0};
    int sel[64];
    for (int e = 0; e < E; e++) {
        sc[e] = 1.0f / (1.0f + (float)exp(-(double)lg[e]));
        ch[e] = sc[e] + bias[e];
    }
    if (G > 1 && c->topk_group < G) {
        for (int g = 0; g < G; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++) {
                if (ch[e] > b1) { b2 = b1; b1 = ch[e]; }
                else if (ch[e] > b2) b2 = ch[e];
            }
            gs[g] = b1 + b2;
        }
        for (int j = 0; j < c->topk_group; j++) {
            kn_cand lane[32];
            for (int l = 0; l < 32; l++) {
                kn_cand b = {0.f, 0x7fffffff, 0};
                for (int g = l; g < G; g += 32) {
                    const kn_cand x = {gs[g], g, !keep[g]};
                    if (kn_cand_better(x, b)) b = x;
                }
                lane[l] = b;
            }
            keep[warp_best(lane).id] = 1;
        }
        for (int e = 0; e < E; e++)
            if (!keep[e / per]) ch[e] = -INFINITY;
    }
    for (int j = 0; j < k; j++) {
        kn_cand lane[32];
        for (int l = 0; l < 32; l++) {
            kn_cand b = {0.f, 0x7fffffff, 0};
            for (int e = l; e < E; e += 32) {
                const kn_cand x = {ch[e], e, !used[e]};
                if (kn_cand_better(x, b)) b = x;
            }
            lane[l] = b;
        }
        const kn_cand b = warp_best(lane);
        assert_true(b.valid && b.id >= 0 && b.id < E);
        used[b.id] = 1;
        sel[j] = b.id;
    }
    float sum = 0.f;
    for (int j = 0; j < k; j++) sum += sc[sel[j]];
    const float den = sum + 1e-20f;
    for (int j = 0; j < k; j++) {
        float v = sc[sel[j]];
        if (c->norm_topk_prob) v = v / den;
        ids[j] = sel[j];
        w[j] = v * c->routed_scaling;
    }
}

static int expf_exact(const float *l, int E) {
    for (int e = 0; e < E; e++) {
        const float a = expf(-l[e]), b = (float)exp(-(double)l[e]);
        if (memcmp(&a, &b, 4)) return 0;
    }
    return 1;
}

static void run_config(int E, int k, int G, int tg, int norm, float scaling) {
    hf_config hc;
    memset(&hc, 0, sizeof hc);
    hc.n_routed_experts = E, hc.n_experts_per_tok = k, hc.n_group = G, hc.topk_group = tg;
    hc.routed_scaling = scaling, hc.norm_topk_prob = norm;
    float bias[512], tied[512], lg[512], scr[1024], cw[64], gw[64];
    int32_t cid[64], gid[64];
    for (int e = 0; e < E; e++) bias[e] = (float)(0.1 * (unif() + unif() + unif())) - (e % 4 == 1 ? 0.5f : 0.f);
    memcpy(tied, bias, sizeof(float) * (size_t)E);
    for (int e = 0; e + 1 < E; e += 2) tied[e + 1] = tied[e];
    for (int e = 0; e < E / G && G > 1; e++) tied[(G - 1) * (E / G) + e] = tied[e];
    int n_tok = 0, n_exact = 0, n_wbit = 0, n_w = 0;
    for (int t = 0; t < 4000; t++) {
        const int kind = t % 8;
        for (int e = 0; e < E; e++) lg[e] = (float)(2.0 * (unif() + unif() + unif()));
        if (kind == 1) for (int e = 0; e + 1 < E; e += 2) lg[e + 1] = lg[e];
        if (kind == 2) for (int e = 0; e < E; e++) lg[e] = 0.25f;
        if (kind == 3) for (int e = 0; e < E / G && G > 1; e++) lg[(G - 1) * (E / G) + e] = lg[e];
        if (kind == 4) for (int e = 0; e < E; e++) lg[e] = (float)(int)(4 * unif()); /* few distinct values */
        const float *b = (kind >= 1 && kind <= 4 && t % 16 >= 8) ? tied : bias;
        dsv3_route(&hc, lg, b, scr, cid, cw);
        model_route(&hc, lg, b, gid, gw);
        assert_memory_equal(gid, cid, sizeof(int32_t) * (size_t)k); /* same experts, same order */
        const int exact = expf_exact(lg, E);
        n_exact += exact;
        for (int j = 0; j < k; j++) {
            n_wbit += !memcmp(&gw[j], &cw[j], 4);
            n_w++;
            if (exact) assert_memory_equal(&gw[j], &cw[j], 4);
            else assert_true(fabs((double)gw[j] - cw[j]) <= 1e-6 * fabs((double)cw[j]));
        }
        n_tok++;
    }
    /* NaN logits: unspecified choice, but k distinct ids in range */
    for (int e = 0; e < E; e++) lg[e] = NAN;
    model_route(&hc, lg, bias, gid, gw);
    for (int j = 0; j < k; j++) {
        assert_true(gid[j] >= 0 && gid[j] < E);
        for (int u = 0; u < j; u++) assert_true(gid[u] != gid[j]);
    }
    printf("kimi_c_route_select: E %d k %d groups %d keep %d: %d tokens, ids identical to dsv3_route in order; "
           "weights bitwise %d/%d (%d tokens with only correctly rounded expf)\n", E, k, G, tg, n_tok, n_wbit, n_w,
           n_exact);
}

static void test_select(void **st) {
    (void)st;
    run_config(384, 8, 1, 1, 1, 2.827f);
    run_config(256, 8, 8, 4, 1, 2.5f);
    run_config(64, 6, 4, 1, 1, 1.0f);
    run_config(16, 4, 1, 1, 0, 1.5f);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_select)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
