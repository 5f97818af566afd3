/*
 * test_tp.c (kimi_c_tp): DeepSeek-V3 / Kimi-K2.5 tensor-parallel on the CPU
 * with real rank processes (engine/comm shm group, this binary re-executed as
 * the workers) on the seed-0 Kimi miniature (4 MLA heads, 16 int4 routed
 * experts of width 64, 1 shared expert), against transformers + compressed-
 * tensors (tests/fixtures/kimi/mini_logits.json), the same bounds as
 * kimi_c_logits at TP 1:
 *   - TP 2 (2 heads per rank, latent replicated, every expert split inside:
 *     32 of its 64 columns per rank): top-5 ids identical and max |diff| <=
 *     2e-3 x max|logit| at every stored position of the 4 prompts; the greedy
 *     continuations through the paged latent cache identical; a second
 *     identical pass bit-identical;
 *   - TP 4 is refused with the reason: 16 expert columns per rank would cut
 *     the int4 experts' 32-value groups;
 *   - the "wide8" variant of the same generator (8 heads, experts of width
 *     256: kimi_c_mini_setup) at TP 2, 4 and 8: against TP 1 on it, every
 *     logit of the 4 prompts within 1e-5 x max|logit| (f32 reassociation of
 *     the row-parallel sums only), 16 greedy tokens identical, reruns
 *     bit-identical; and against transformers on the same checkpoint
 *     (tests/fixtures/kimi/mini_wide8_logits.json, tools/kimi/reference.py
 *     --mini OUT/wide8 --name mini_wide8_logits.json) with kimi_c_logits'
 *     bounds: top-5 identical and max |diff| <= 2e-3 x max|logit| at every
 *     stored position, the 32-token greedy continuations identical (TP 1 too,
 *     once, in the TP 2 case).
 * Workers: `kimi_c_tp --tp-worker DIR --specd-comm-...` (ranks.h).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/comm/ranks.h"
#include "engine/runtime/tp.h"
#include "tests/kimi_c/kimi_c_ref.h"
#include "tests/kimi_c/kimi_c_util.h"
#include "tests/tp_test_util.h"

static const char *g_self;



static void test_tp2(void **st) {
    (void)st;
    const char *dir = kc_mini_dir("k25");
    json_t *fx = kc_fixture("mini_logits.json");
    specd_err err = {{0}};
    const char *argv[] = {g_self, "--tp-worker", dir, NULL};
    ranks_config rc = {.world = 2, .worker_argv = argv, .comm = comm_config_default(), .attach_timeout_ms = 60000};
    ranks *rk = NULL;
    if (ranks_launch(&rc, &rk, &err) < 0) fail_msg("ranks_launch: %s", err.msg);
    model_comm mc;
    tp_model_comm_shm(ranks_comm(rk), &mc);
    backend *be = bk_cpu_create(1);
    model_load_opts o = {.block_size = KC_BS, .n_blocks = KC_MAXB, .tp = &mc};
    model *m = NULL;
    if (model_load(dir, be, &o, &m, &err) < 0) fail_msg("model_load at TP 2: %s", err.msg);
    tp_runner run = {m, ranks_comm(rk), NULL};
    kc_tp_runner = &run;
    const double worst = kc_vs_transformers(m, fx, "TP 2");
    printf("kimi_c_tp: TP 2: 4 prompts: top-5 identical, worst |diff| %.3g of max|logit|, greedy identical, "
           "reruns bit-identical\n", worst);
    kc_tp_runner = NULL;
    if (ranks_shutdown(rk, 10000, &err) < 0) fail_msg("ranks_shutdown: %s", err.msg);
    ranks_destroy(rk);
    model_destroy(m);
    bk_cpu_destroy(be);
    json_decref(fx);
}

/* Launches N ranks on DIR; *rk, *m, run filled (rank 0's shard on be). */
static void tp_start(const char *dir, int N, backend *be, ranks **rk, model_comm *mc, model **m, tp_runner *run) {
    specd_err err = {{0}};
    const char *argv[] = {g_self, "--tp-worker", dir, NULL};
    ranks_config rc = {.world = N, .worker_argv = argv, .comm = comm_config_default(), .attach_timeout_ms = 60000};
    if (ranks_launch(&rc, rk, &err) < 0) fail_msg("ranks_launch: %s", err.msg);
    tp_model_comm_shm(ranks_comm(*rk), mc);
    model_load_opts o = {.block_size = KC_BS, .n_blocks = KC_MAXB, .tp = mc};
    if (model_load(dir, be, &o, m, &err) < 0) fail_msg("model_load at TP %d: %s", N, err.msg);
    *run = (tp_runner){*m, ranks_comm(*rk), NULL};
}

static void check_wide(int N) {
    const char *dir = kc_mini_dir("wide8");
    json_t *fx = kc_fixture("mini_wide8_logits.json");
    const json_t *prompts = json_object_get(fx, "prompts");
    backend *be = bk_cpu_create(1);
    model *m1 = kc_load(be, dir, 1), *m = NULL;
    const int V = model_get_config(m1)->vocab;
    ranks *rk = NULL;
    model_comm mc;
    tp_runner run;
    tp_start(dir, N, be, &rk, &mc, &m, &run);
    model_shard_info si;
    model_get_shard(m, &si);
    assert_int_equal(si.n_heads, 8 / N);
    float *a = malloc(sizeof(float) * 128 * (size_t)V), *b = malloc(sizeof(float) * 128 * (size_t)V);
    float *b2 = malloc(sizeof(float) * 128 * (size_t)V);
    double worst = 0;
    for (size_t pi = 0; pi < json_array_size(prompts); pi++) {
        int n;
        int32_t *ids = kc_ids(json_object_get(json_array_get(prompts, pi), "ids"), &n);
        kc_tp_runner = NULL;
        assert_int_equal(kc_run(m1, 0, ids, n, 0, a, NULL, 0, NULL, NULL), 0);
        kc_tp_runner = &run;
        assert_int_equal(kc_run(m, 0, ids, n, 0, b, NULL, 0, NULL, NULL), 0);
        assert_int_equal(kc_run(m, 0, ids, n, 0, b2, NULL, 0, NULL, NULL), 0);
        if (memcmp(b, b2, sizeof(float) * (size_t)n * V)) fail_msg("wide8 TP %d prompt %zu: rerun not bit-identical", N, pi);
        for (int r = 0; r < n; r++) {
            double mx = 0, md = 0;
            for (int v = 0; v < V; v++) {
                mx = fmax(mx, fabs(a[(size_t)r * V + v]));
                md = fmax(md, fabs((double)a[(size_t)r * V + v] - b[(size_t)r * V + v]));
            }
            worst = fmax(worst, md / mx);
            if (md > 1e-5 * mx) fail_msg("wide8 TP %d prompt %zu row %d: max|diff| %.3g of max|logit|", N, pi, r, md / mx);
        }
        /* 16 greedy tokens, each side on its own cache */
        int32_t ta = kc_argmax(a + (size_t)(n - 1) * V, V), tb = kc_argmax(b + (size_t)(n - 1) * V, V);
        for (int s = 0; s < 16; s++) {
            if (ta != tb) fail_msg("wide8 TP %d prompt %zu greedy step %d: TP 1 %d, TP %d %d", N, pi, s, ta, N, tb);
            kc_tp_runner = NULL;
            assert_int_equal(kc_run(m1, 0, &ta, 1, n + s, a, NULL, 0, NULL, NULL), 0);
            kc_tp_runner = &run;
            assert_int_equal(kc_run(m, 0, &tb, 1, n + s, b, NULL, 0, NULL, NULL), 0);
            ta = kc_argmax(a, V);
            tb = kc_argmax(b, V);
        }
        free(ids);
    }
    char what[32];
    snprintf(what, sizeof what, "wide8 TP %d", N);
    const double wt = kc_vs_transformers(m, fx, what);
    kc_tp_runner = NULL;
    const double w1 = N == 2 ? kc_vs_transformers(m1, fx, "wide8 TP 1") : -1;
    printf("wide8 TP %d (%d heads, %d expert columns per rank): logits vs TP 1 within %.3g of max|logit|, 16 greedy "
           "tokens identical, reruns bit-identical; vs transformers (mini_wide8_logits.json): top-5 identical, "
           "worst |diff| %.3g of max|logit|, 32 greedy tokens identical", N, si.n_heads, 256 / N, worst, wt);
    if (w1 >= 0) printf(" (TP 1: %.3g)", w1);
    printf("\n");
    specd_err err = {{0}};
    if (ranks_shutdown(rk, 10000, &err) < 0) fail_msg("ranks_shutdown: %s", err.msg);
    ranks_destroy(rk);
    model_destroy(m);
    model_destroy(m1);
    bk_cpu_destroy(be);
    free(a); free(b); free(b2);
    json_decref(fx);
}

static void test_wide_tp2(void **st) { (void)st; check_wide(2); }
static void test_wide_tp4(void **st) { (void)st; check_wide(4); }
static void test_wide_tp8(void **st) { (void)st; check_wide(8); }

static void test_tp4_refused(void **st) {
    (void)st;
    model_comm mc = {.rank = 0, .size = 4};
    backend *be = bk_cpu_create(1);
    model_load_opts o = {.block_size = KC_BS, .n_blocks = KC_MAXB, .tp = &mc};
    model *m = NULL;
    specd_err err = {{0}};
    assert_int_equal(model_load(kc_mini_dir("k25"), be, &o, &m, &err), -1);
    printf("TP 4 refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "tensor parallel size 4"));
    assert_non_null(strstr(err.msg, "32-value block"));
    bk_cpu_destroy(be);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--tp-worker")) return tp_test_worker_main(argc, argv, KC_BS, KC_MAXB);
    g_self = argv[0];
    kc_mini_dir("k25");
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_tp4_refused), cmocka_unit_test(test_tp2),
                                       cmocka_unit_test(test_wide_tp2), cmocka_unit_test(test_wide_tp4),
                                       cmocka_unit_test(test_wide_tp8)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
