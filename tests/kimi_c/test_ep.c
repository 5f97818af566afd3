/*
 * test_ep.c (kimi_c_ep): expert parallelism (model_load_opts.expert_parallel,
 * `--enable-expert-parallel`) for DeepSeek-V3 / Kimi-K2.5 on the CPU, with
 * real rank processes (engine/comm shm group, this binary re-executed as the
 * workers), on the seed-0 Kimi miniature (k25: 4 MLA heads, 16 int4 routed
 * experts of width 64, top 4, 1 shared expert) and its wide8 variant (8
 * heads, 16 experts of width 256):
 *   - EP N (k25: 2, 4; wide8: 2, 4, 8): rank r holds routed experts
 *     [r 16/N, (r+1) 16/N) whole (model_get_shard says so; it keeps exactly
 *     TP N's weight bytes and reads fewer), attention / dense MLP / shared expert
 *     tensor-parallel as at TP N. Against TP 1 on the same checkpoint: every
 *     logit of the 4 fixture prompts within 1e-5 x max|logit| (bound below),
 *     16 greedy tokens through the paged latent cache identical, a rerun bit
 *     for bit; against transformers (mini_logits.json / mini_wide8_logits.json)
 *     with kimi_c_logits' bounds (top-5 identical, 2e-3 x max|logit|, the
 *     fixture's 32 greedy tokens identical).
 *     The bound: at TP 1 a token's MoE output is one f32 sum, in ascending
 *     expert id, of its k = 4 weighted expert outputs, then + shared; at EP N
 *     each rank sums its own chosen experts (same order), adds 1/N of the
 *     shared expert (row-parallel: its down_proj's columns), and the ranks'
 *     partial sums are added in rank order. Each expert's own output is
 *     bit-identical to TP 1's (the expert is whole, the same matmul), so only
 *     the association of at most k + N terms changes: |diff| <= (k + N) u
 *     sum|terms| per element per layer (u = 2^-24), ~7e-7 of the terms at
 *     N = 8; plus the attention's o_proj reassociation (as at TP N, whose
 *     kimi_c_tp bound is the same 1e-5). 1e-5 leaves 10-20x for the growth
 *     through 6 layers; measured values are printed.
 *   - batch invariance at EP 2: a sequence's logits bit-identical prefilled
 *     alone, prefilled next to two others (mixed positions), and fed one token
 *     per step while other sequences decode in the same steps (its experts'
 *     token sets change with the batch on every rank);
 *   - EP 2 == EP 2 on the workers' own logits: the rank-0 and worker shards
 *     agree (the all-reduce result is the same on every rank: checked by the
 *     group, tp.c);
 *   - refusals, with the reason: EP 3 on k25 (3 does not divide the 16
 *     experts), EP on a dense Llama directory (model_hf mini) and on a GGUF.
 * Workers: `kimi_c_ep --tp-worker DIR [--ep] --specd-comm-...` (ranks.h).
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

#define EP_SEQS 8 /* KV pool of every rank: EP_SEQS sequences of KC_MAXB blocks (kc_block_table) */

static const char *g_self;

/* The worker side: the shard of DIR, expert parallel when "--ep" follows DIR. */
static int ep_worker_main(int argc, char **argv) {
    ranks_worker w;
    specd_err err = {{0}};
    comm *c = NULL;
    if (ranks_worker_detect(argc, argv, &w, &err) != 1 || argc < 3 || ranks_worker_attach(&w, &c, &err) < 0) {
        fprintf(stderr, "ep worker: %s\n", err.msg);
        return 1;
    }
    model_comm mc;
    tp_model_comm_shm(c, &mc);
    backend *be = bk_cpu_create(1);
    model_load_opts o = {.block_size = KC_BS, .n_blocks = KC_MAXB * EP_SEQS, .tp = &mc,
                         .expert_parallel = argc > 3 && !strcmp(argv[3], "--ep")};
    model *m = NULL;
    int rc = 1;
    if (!be || model_load(argv[2], be, &o, &m, &err) < 0) comm_abort(c, be ? err.msg : "no CPU backend");
    else if (tp_worker_run(c, m, &err) == 0) rc = 0;
    if (rc) fprintf(stderr, "ep worker rank %d: %s\n", w.rank, err.msg);
    model_destroy(m);
    if (be) bk_cpu_destroy(be);
    comm_destroy(c);
    return rc;
}

typedef struct group {
    ranks *rk;
    model_comm mc;
    model *m;
    tp_runner run;
} group;

/* N ranks on DIR (expert parallel or plain TP); rank 0's shard on be. */
static void group_start(group *g, const char *dir, int N, bool ep, backend *be) {
    specd_err err = {{0}};
    const char *argv[] = {g_self, "--tp-worker", dir, ep ? "--ep" : NULL, NULL};
    ranks_config rc = {.world = N, .worker_argv = argv, .comm = comm_config_default(), .attach_timeout_ms = 60000};
    if (ranks_launch(&rc, &g->rk, &err) < 0) fail_msg("ranks_launch: %s", err.msg);
    tp_model_comm_shm(ranks_comm(g->rk), &g->mc);
    model_load_opts o = {.block_size = KC_BS, .n_blocks = KC_MAXB * EP_SEQS, .tp = &g->mc, .expert_parallel = ep};
    if (model_load(dir, be, &o, &g->m, &err) < 0) fail_msg("model_load at %s %d: %s", ep ? "EP" : "TP", N, err.msg);
    g->run = (tp_runner){g->m, ranks_comm(g->rk), NULL};
}

static void group_stop(group *g) {
    specd_err err = {{0}};
    if (ranks_shutdown(g->rk, 10000, &err) < 0) fail_msg("ranks_shutdown: %s", err.msg);
    ranks_destroy(g->rk);
    model_destroy(g->m);
}


/* EP N on LAYOUT ("k25" or "wide8") against TP 1 and transformers (the header's bounds). */
static void check_ep(const char *layout, const char *fixture, int N) {
    const char *dir = kc_mini_dir(layout);
    json_t *fx = kc_fixture(fixture);
    const json_t *prompts = json_object_get(fx, "prompts");
    backend *be = bk_cpu_create(1);
    model *m1 = kc_load(be, dir, 1);
    const int V = model_get_config(m1)->vocab;
    model_shard_info s1;
    model_get_shard(m1, &s1);
    /* the same group as plain TP N first: its weight bytes, to compare */
    group g;
    int64_t tp_bytes = -1, tp_read = -1;
    if (!(N == 4 && !strcmp(layout, "k25"))) { /* k25 at TP 4 is refused (int4 groups); EP 4 is not */
        group_start(&g, dir, N, false, be);
        model_shard_info st;
        model_get_shard(g.m, &st);
        model_load_info li;
        model_get_load_info(g.m, &li);
        tp_bytes = st.weight_bytes, tp_read = li.bytes_read;
        group_stop(&g);
    }
    group_start(&g, dir, N, true, be);
    model_shard_info si;
    model_get_shard(g.m, &si);
    model_load_info li;
    model_get_load_info(g.m, &li);
    const int E = 16;
    if (!si.expert_parallel || si.expert0 != 0 || si.n_experts != E / N || si.expert_width != s1.expert_width)
        fail_msg("%s EP %d: rank 0 holds experts %d + %d of width %d (ep %d), want 0 + %d of width %d", layout, N,
                 si.expert0, si.n_experts, si.expert_width, si.expert_parallel, E / N, s1.expert_width);
    /* the same bytes kept (E/N whole experts = 1/N of every expert), fewer read: TP reads the int4 down_proj
     * of every expert whole (its per-row parts are below load_row_min), EP only its experts' tensors */
    if (tp_bytes >= 0 && (si.weight_bytes != tp_bytes || li.bytes_read >= tp_read))
        fail_msg("%s EP %d: rank 0 keeps %lld weight bytes and read %lld; TP %d: %lld and %lld", layout, N,
                 (long long)si.weight_bytes, (long long)li.bytes_read, N, (long long)tp_bytes, (long long)tp_read);
    float *a = malloc(sizeof(float) * 128 * (size_t)V), *b = malloc(sizeof(float) * 128 * (size_t)V);
    float *b2 = malloc(sizeof(float) * 128 * (size_t)V);
    double worst = 0;
    for (size_t pi = 0; pi < json_array_size(prompts); pi++) {
        int n;
        int32_t *ids = kc_ids(json_object_get(json_array_get(prompts, pi), "ids"), &n);
        kc_tp_runner = NULL;
        assert_int_equal(kc_run(m1, 0, ids, n, 0, a, NULL, 0, NULL, NULL), 0);
        kc_tp_runner = &g.run;
        assert_int_equal(kc_run(g.m, 0, ids, n, 0, b, NULL, 0, NULL, NULL), 0);
        assert_int_equal(kc_run(g.m, 0, ids, n, 0, b2, NULL, 0, NULL, NULL), 0);
        if (memcmp(b, b2, sizeof(float) * (size_t)n * V))
            fail_msg("%s EP %d prompt %zu: rerun not bit-identical", layout, N, pi);
        for (int r = 0; r < n; r++) {
            double mx = 0, md = 0;
            for (int v = 0; v < V; v++) {
                mx = fmax(mx, fabs(a[(size_t)r * V + v]));
                md = fmax(md, fabs((double)a[(size_t)r * V + v] - b[(size_t)r * V + v]));
            }
            worst = fmax(worst, md / mx);
            if (md > 1e-5 * mx)
                fail_msg("%s EP %d prompt %zu row %d: max|diff| %.3g of max|logit| vs TP 1", layout, N, pi, r, md / mx);
        }
        int32_t ta = kc_argmax(a + (size_t)(n - 1) * V, V), tb = kc_argmax(b + (size_t)(n - 1) * V, V);
        for (int s = 0; s < 16; s++) {
            if (ta != tb) fail_msg("%s EP %d prompt %zu greedy step %d: TP 1 %d, EP %d %d", layout, N, pi, s, ta, N, tb);
            kc_tp_runner = NULL;
            assert_int_equal(kc_run(m1, 0, &ta, 1, n + s, a, NULL, 0, NULL, NULL), 0);
            kc_tp_runner = &g.run;
            assert_int_equal(kc_run(g.m, 0, &tb, 1, n + s, b, NULL, 0, NULL, NULL), 0);
            ta = kc_argmax(a, V);
            tb = kc_argmax(b, V);
        }
        free(ids);
    }
    char what[32];
    snprintf(what, sizeof what, "%s EP %d", layout, N);
    const double wt = kc_vs_transformers(g.m, fx, what);
    kc_tp_runner = NULL;
    printf("%s EP %d (experts %d..%d whole on rank 0, %lld weight bytes, read %lld; TP %d: %lld kept, %lld read): "
           "logits vs TP 1 within %.3g of max|logit| (bound 1e-5), 16 greedy tokens identical, rerun bit-identical; "
           "vs transformers: top-5 identical, worst |diff| %.3g of max|logit|, greedy identical\n",
           layout, N, si.expert0, si.expert0 + si.n_experts - 1, (long long)si.weight_bytes, (long long)li.bytes_read,
           N, (long long)tp_bytes, (long long)tp_read, worst, wt);
    group_stop(&g);
    model_destroy(m1);
    bk_cpu_destroy(be);
    free(a); free(b); free(b2);
    json_decref(fx);
}

static void test_k25_ep2(void **st) { (void)st; check_ep("k25", "mini_logits.json", 2); }
static void test_k25_ep4(void **st) { (void)st; check_ep("k25", "mini_logits.json", 4); }
static void test_wide_ep2(void **st) { (void)st; check_ep("wide8", "mini_wide8_logits.json", 2); }
static void test_wide_ep4(void **st) { (void)st; check_ep("wide8", "mini_wide8_logits.json", 4); }
static void test_wide_ep8(void **st) { (void)st; check_ep("wide8", "mini_wide8_logits.json", 8); }

static int32_t tok_of(int s, int p) { return (int32_t)((s * 7919 + p * 104729 + 13) % 163000) + 100; }

/* One step of (seq, pos) tokens through the group; seq A's logits rows into outA[pos]. */
static void step(group *g, int V, int n, const int *seqs, const int *poss, int A, float *outA) {
    int32_t tok[128], pos[128], seq[128], oi[128];
    int no = 0;
    for (int i = 0; i < n; i++) {
        tok[i] = tok_of(seqs[i], poss[i]), pos[i] = poss[i], seq[i] = seqs[i];
        if (seqs[i] == A) oi[no++] = i;
    }
    const int32_t *bt[EP_SEQS];
    for (int s = 0; s < EP_SEQS; s++) bt[s] = kc_block_table(s);
    float *lg = malloc(sizeof(float) * (size_t)(no ? no : 1) * V);
    model_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = EP_SEQS, .block_tables = bt,
                     .n_out = no, .out_idx = oi, .logits = lg};
    specd_err err = {{0}};
    if (tp_runner_forward(&g->run, &b, &err) < 0) fail_msg("forward: %s", err.msg);
    for (int k = 0; k < no; k++) memcpy(outA + (size_t)poss[oi[k]] * V, lg + (size_t)k * V, sizeof(float) * V);
    free(lg);
}

/* A's 20 tokens (its ids depend on the sequence id: A is written under several ids with the same tokens) */
#define NA 20
static void test_batch_invariance_ep2(void **st) {
    (void)st;
    const char *dir = kc_mini_dir("wide8");
    backend *be = bk_cpu_create(1);
    group g;
    group_start(&g, dir, 2, true, be);
    const int V = model_get_config(g.m)->vocab;
    float *ref = malloc(sizeof(float) * NA * (size_t)V), *got = malloc(sizeof(float) * NA * (size_t)V);
    int seqs[128], poss[128];
    /* alone: seq 0 prefilled in one step (tok_of uses the sequence id: sequences 0, 3 and 5 below all carry
     * seq 0's tokens, so the same logits are expected) */
#define TOKSEQ(s) ((s) == 3 || (s) == 5 ? 0 : (s))
    for (int i = 0; i < NA; i++) seqs[i] = 0, poss[i] = i;
    step(&g, V, NA, seqs, poss, 0, ref);
    /* in a batch: seq 1 (7 tokens) | A as seq 3 | seq 2 (12 tokens): A's rows in the middle; seq 3's tokens are
     * seq 0's */
    int n = 0;
    for (int i = 0; i < 7; i++) seqs[n] = 1, poss[n++] = i;
    for (int i = 0; i < NA; i++) seqs[n] = 3, poss[n++] = i;
    for (int i = 0; i < 12; i++) seqs[n] = 2, poss[n++] = i;
    {
        int32_t tok[128], pos[128], seq[128], oi[NA];
        int no = 0;
        for (int i = 0; i < n; i++) {
            tok[i] = tok_of(TOKSEQ(seqs[i]), poss[i]), pos[i] = poss[i], seq[i] = seqs[i];
            if (seqs[i] == 3) oi[no++] = i;
        }
        const int32_t *bt[EP_SEQS];
        for (int s = 0; s < EP_SEQS; s++) bt[s] = kc_block_table(s);
        model_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = EP_SEQS,
                         .block_tables = bt, .n_out = no, .out_idx = oi, .logits = got};
        specd_err err = {{0}};
        if (tp_runner_forward(&g.run, &b, &err) < 0) fail_msg("forward: %s", err.msg);
    }
    if (memcmp(ref, got, sizeof(float) * NA * (size_t)V)) fail_msg("EP 2: A's logits differ in a batch of 3 sequences");
    /* one token per step (A as seq 5) while seq 4 decodes and seq 6 prefills chunks in the same steps */
    for (int p = 0; p < NA; p++) {
        int32_t tok[16], pos[16], seq[16], oi[1];
        int k = 0;
        tok[k] = tok_of(4, p), pos[k] = p, seq[k++] = 4;
        oi[0] = k;
        tok[k] = tok_of(0, p), pos[k] = p, seq[k++] = 5;
        for (int j = 0; j < 3; j++) tok[k] = tok_of(6, 3 * p + j), pos[k] = 3 * p + j, seq[k++] = 6;
        const int32_t *bt[EP_SEQS];
        for (int s = 0; s < EP_SEQS; s++) bt[s] = kc_block_table(s);
        model_batch b = {.n_tokens = k, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = EP_SEQS,
                         .block_tables = bt, .n_out = 1, .out_idx = oi, .logits = got + (size_t)p * V};
        specd_err err = {{0}};
        if (tp_runner_forward(&g.run, &b, &err) < 0) fail_msg("forward: %s", err.msg);
    }
    if (memcmp(ref, got, sizeof(float) * NA * (size_t)V))
        fail_msg("EP 2: A's logits fed one token per step next to other sequences differ from its prefill");
    printf("EP 2 (wide8): a sequence's %d rows of logits bit-identical alone, in a batch of 3, and one token per step "
           "next to a decode and a chunked prefill\n", NA);
#undef TOKSEQ
    group_stop(&g);
    bk_cpu_destroy(be);
    free(ref);
    free(got);
}

static void expect_refusal(const char *path, int N, const char *want1, const char *want2) {
    model_comm mc = {.rank = 0, .size = N};
    backend *be = bk_cpu_create(1);
    model_load_opts o = {.block_size = KC_BS, .n_blocks = KC_MAXB, .tp = N > 1 ? &mc : NULL, .expert_parallel = true};
    model *m = NULL;
    specd_err err = {{0}};
    assert_int_equal(model_load(path, be, &o, &m, &err), -1);
    printf("refused: %s\n", err.msg);
    if (!strstr(err.msg, want1) || (want2 && !strstr(err.msg, want2)))
        fail_msg("refusal of %s at EP %d says '%s', want '%s' and '%s'", path, N, err.msg, want1, want2 ? want2 : "");
    bk_cpu_destroy(be);
}

static void test_refusals(void **st) {
    (void)st;
    expect_refusal(kc_mini_dir("k25"), 3, "3 does not divide the 16 routed experts", NULL);
    const char *hf = getenv("MODEL_HF_MINI_DIR");
    char p[1024];
    snprintf(p, sizeof p, "%s/f32", hf ? hf : "");
    struct stat sb;
    if (hf && stat(p, &sb) == 0) expect_refusal(p, 2, "expert parallelism needs a mixture-of-experts model", "dense");
    else printf("dense HF refusal not checked: no %s\n", p);
    snprintf(p, sizeof p, "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf", getenv("SPECD_SOURCE_DIR"));
    if (stat(p, &sb) == 0) expect_refusal(p, 2, "expert parallelism needs a mixture-of-experts model", "GGUF");
    else printf("GGUF refusal not checked: no %s\n", p);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--tp-worker")) return ep_worker_main(argc, argv);
    g_self = argv[0];
    kc_mini_dir("k25");
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_refusals), cmocka_unit_test(test_k25_ep2),
                                       cmocka_unit_test(test_k25_ep4), cmocka_unit_test(test_wide_ep2),
                                       cmocka_unit_test(test_wide_ep4), cmocka_unit_test(test_wide_ep8),
                                       cmocka_unit_test(test_batch_invariance_ep2)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
