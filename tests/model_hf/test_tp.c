/*
 * test_tp.c (model_hf_tp): tensor parallelism on the CPU with real rank
 * processes (engine/comm shm group, this binary re-executed as the workers)
 * on the tiny HF Llama checkpoints, against transformers:
 *   - TP 2, 4, 8 (mistral: 8 heads, 4 KV heads, so TP 8 replicates each KV
 *     head on two ranks), TP 2, 4 (f32, bf16 tied with head_dim 24, sharded
 *     f16 with one KV head): at 4 positions of 3 prompts the top-1 token
 *     equals transformers' and max |diff| <= 1e-3 * max |logit| (the TP 1
 *     bound of model_hf_logits); the 16-token greedy continuations through
 *     the paged cache are token-identical to transformers';
 *   - TP = N is bit-reproducible: the same prompt run again gives the same
 *     logits bit for bit (fixed rank-order all-reduce);
 *   - the TP N logits against TP 1 are reported (they differ in the last
 *     bits: a row-parallel matmul sums its inputs in N pieces);
 *   - a TP size that does not divide the heads is refused with the reason;
 *   - a malformed step (a position outside its block table, a block id
 *     outside the pool) aborts the group with that reason on the workers.
 * Workers: `test_tp --tp-worker DIR --specd-comm-...` (ranks.h).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <unistd.h>

#include "engine/comm/ranks.h"
#include "engine/runtime/tp.h"
#include "tests/model_hf/model_hf_util.h"
#include "tests/tp_test_util.h"

static const char *g_self;


typedef struct tp_case {
    ranks *rk;
    model_comm mc;
    backend *be;
    model *m;
    tp_runner run;
} tp_case;

static void tp_open(tp_case *t, const char *dir, int n) {
    specd_err err = {{0}};
    const char *argv[] = {g_self, "--tp-worker", dir, NULL};
    ranks_config rc = {.world = n, .worker_argv = argv, .comm = comm_config_default(), .attach_timeout_ms = 30000};
    if (ranks_launch(&rc, &t->rk, &err) < 0) fail_msg("ranks_launch: %s", err.msg);
    tp_model_comm_shm(ranks_comm(t->rk), &t->mc);
    t->be = bk_cpu_create(1);
    model_load_opts o = {.block_size = MH_BS, .n_blocks = MH_MAXB * MH_NSEQ, .tp = &t->mc};
    if (model_load(dir, t->be, &o, &t->m, &err) < 0) fail_msg("model_load at TP %d: %s", n, err.msg);
    t->run = (tp_runner){t->m, ranks_comm(t->rk), NULL};
}

static void tp_close(tp_case *t) {
    specd_err err = {{0}};
    int rc = ranks_shutdown(t->rk, 10000, &err);
    if (rc) fail_msg("ranks_shutdown: %s", err.msg);
    ranks_destroy(t->rk);
    model_destroy(t->m);
    bk_cpu_destroy(t->be);
}

static int tp_step(tp_case *t, int n, const int32_t *toks, const int32_t *pos, const int32_t *seq, int n_out,
                   const int32_t *out, float *lg) {
    model_batch b = {.n_tokens = n, .tokens = toks, .pos = pos, .seq_of = seq, .n_seqs = MH_NSEQ,
                     .block_tables = mh_block_tables(), .n_out = n_out, .out_idx = out, .logits = lg};
    specd_err err = {{0}};
    int rc = tp_runner_forward(&t->run, &b, &err);
    if (rc) fprintf(stderr, "tp forward: %s\n", err.msg);
    return rc;
}

static void check_tp(const char *name, int N) {
    json_t *ref = mh_ref();
    const int V = (int)json_integer_value(json_object_get(ref, "vocab"));
    const json_t *prompts = json_object_get(ref, "prompts"), *poss = json_object_get(ref, "positions");
    const json_t *var = json_object_get(json_object_get(ref, "variants"), name);
    const int np = (int)json_array_size(prompts), npos = (int)json_array_size(json_array_get(poss, 0));
    const int ng = (int)json_integer_value(json_object_get(ref, "n_greedy"));
    float *want = mh_ref_logits(name, (size_t)np * npos * V);
    const char *dir = mh_dir(name);
    /* TP 1 on the same checkpoint, for the report */
    backend *be1 = bk_cpu_create(1);
    model *m1 = mh_load(be1, dir);
    tp_case t;
    tp_open(&t, dir, N);
    model_shard_info si;
    model_get_shard(t.m, &si);
    assert_int_equal(si.size, N);
    assert_int_equal(si.n_heads * N, model_get_config(t.m)->n_heads);
    float *lg = malloc(sizeof(float) * (size_t)npos * V), *lg2 = malloc(sizeof(float) * (size_t)npos * V);
    float *l1 = malloc(sizeof(float) * (size_t)npos * V);
    double worst_rel = 0, vs_tp1 = 0;
    for (int p = 0; p < np; p++) {
        int n;
        const int32_t *toks = mh_prompt(ref, p, &n);
        int32_t pos[256], seq[256], out[8];
        for (int i = 0; i < n; i++) { pos[i] = i; seq[i] = 0; }
        for (int j = 0; j < npos; j++)
            out[j] = (int32_t)json_integer_value(json_array_get(json_array_get(poss, (size_t)p), (size_t)j));
        assert_int_equal(tp_step(&t, n, toks, pos, seq, npos, out, lg), 0);
        assert_int_equal(tp_step(&t, n, toks, pos, seq, npos, out, lg2), 0); /* the same pass again */
        if (memcmp(lg, lg2, sizeof(float) * (size_t)npos * V))
            fail_msg("%s TP %d prompt %d: a second identical pass gave different logits bits", name, N, p);
        assert_int_equal(mh_step(m1, n, toks, pos, seq, npos, out, l1), 0);
        for (int j = 0; j < npos; j++) {
            const float *w = want + ((size_t)p * npos + j) * V, *g = lg + (size_t)j * V;
            double mx = 0, md = 0;
            for (int v = 0; v < V; v++) {
                mx = fmax(mx, fabs(w[v]));
                md = fmax(md, fabs((double)w[v] - g[v]));
                vs_tp1 = fmax(vs_tp1, fabs((double)l1[(size_t)j * V + v] - g[v]));
            }
            if (mh_argmax(w, V) != mh_argmax(g, V) || md > 1e-3 * mx)
                fail_msg("%s TP %d prompt %d position %d: top-1 %d vs transformers %d, max|diff| %.3g (max|logit| %.3g)",
                         name, N, p, out[j], mh_argmax(g, V), mh_argmax(w, V), md, mx);
            worst_rel = fmax(worst_rel, md / mx);
        }
        const json_t *gw = json_array_get(json_object_get(var, "greedy"), (size_t)p);
        int32_t tok = mh_argmax(lg + (size_t)(npos - 1) * V, V), z = 0;
        for (int k = 0; k < ng; k++) {
            const int32_t wk = (int32_t)json_integer_value(json_array_get(gw, (size_t)k));
            if (tok != wk) fail_msg("%s TP %d prompt %d: greedy token %d is %d, transformers %d", name, N, p, k, tok, wk);
            int32_t ps = n + k;
            assert_int_equal(tp_step(&t, 1, &tok, &ps, &z, 1, &z, lg), 0);
            tok = mh_argmax(lg, V);
        }
    }
    printf("%-8s TP %d: %d of %d heads, KV heads %d, MLP %d, LM-head rows %d, %.1f KiB of weights on rank 0; "
           "max|diff|/max|logit| vs transformers %.3g, max|diff| vs TP 1 %.3g; greedy identical; reruns bit-identical\n",
           name, N, si.n_heads, model_get_config(t.m)->n_heads, si.n_kv_heads, si.ffn, si.vocab_rows,
           (double)si.weight_bytes / 1024, worst_rel, vs_tp1);
    tp_close(&t);
    model_destroy(m1);
    bk_cpu_destroy(be1);
    free(lg); free(lg2); free(l1); free(want);
    json_decref(ref);
}

static void test_mistral_tp2(void **s) { (void)s; check_tp("mistral", 2); }
static void test_mistral_tp4(void **s) { (void)s; check_tp("mistral", 4); }
static void test_mistral_tp8(void **s) { (void)s; check_tp("mistral", 8); }
static void test_f32_tp2(void **s) { (void)s; check_tp("f32", 2); }
static void test_f32_tp4(void **s) { (void)s; check_tp("f32", 4); }
static void test_bf16_tp2(void **s) { (void)s; check_tp("bf16", 2); }
static void test_sharded_tp4(void **s) { (void)s; check_tp("sharded", 4); }

/* A malformed step (a position past its sequence's block table, then a block id past the pool) makes the
 * workers abort the group with the reason instead of reading or writing outside their KV pool. */
static void check_bad_step(int mode) {
    tp_case t;
    tp_open(&t, mh_dir("f32"), 2);
    /* tp.h's message: T S n_out n_aux flags | tokens | pos | seq_of | per sequence: count, block ids */
    const int32_t msg[] = {1, 1, 0, 0, 0, /* token */ 5, /* pos */ mode ? 3 : 1000000, /* seq */ 0,
                           /* blocks */ 1, mode ? 1 << 28 : 0};
    specd_err err = {{0}};
    comm *c = ranks_comm(t.rk);
    assert_int_equal(comm_step_send(c, COMM_STEP_DATA, msg, sizeof msg, &err), 0);
    char why[COMM_REASON_MAX] = "";
    for (int i = 0; i < 500 && !comm_aborted(c, why, sizeof why); i++) usleep(10000);
    printf("malformed step %d: %s\n", mode, why);
    assert_non_null(strstr(why, mode ? "outside this rank's" : "outside its block table"));
    ranks_destroy(t.rk);
    model_destroy(t.m);
    bk_cpu_destroy(t.be);
}
static void test_bad_step_pos(void **s) { (void)s; check_bad_step(0); }
static void test_bad_step_block(void **s) { (void)s; check_bad_step(1); }

/* A group of 3 "ranks" that never communicates: the refusal comes first. */
static void test_refuses_tp3(void **s) {
    (void)s;
    model_comm mc = {.rank = 0, .size = 3};
    backend *be = bk_cpu_create(1);
    model_load_opts o = {.block_size = MH_BS, .n_blocks = 8, .tp = &mc};
    model *m = NULL;
    specd_err err = {{0}};
    assert_int_equal(model_load(mh_dir("f32"), be, &o, &m, &err), -1);
    assert_null(m);
    if (!strstr(err.msg, "tensor parallel size 3 does not divide the 4 attention heads"))
        fail_msg("unexpected refusal: %s", err.msg);
    printf("refused: %s\n", err.msg);
    bk_cpu_destroy(be);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--tp-worker")) return tp_test_worker_main(argc, argv, MH_BS, MH_MAXB * MH_NSEQ);
    g_self = argv[0];
    mh_dir("f32"); /* skip early if the checkpoints are absent */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refuses_tp3), cmocka_unit_test(test_mistral_tp2), cmocka_unit_test(test_mistral_tp4),
        cmocka_unit_test(test_mistral_tp8), cmocka_unit_test(test_f32_tp2),     cmocka_unit_test(test_f32_tp4),
        cmocka_unit_test(test_bf16_tp2),    cmocka_unit_test(test_sharded_tp4), cmocka_unit_test(test_bad_step_pos),
        cmocka_unit_test(test_bad_step_block)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
