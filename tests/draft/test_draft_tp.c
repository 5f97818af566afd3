/*
 * test_draft_tp.c (draft_tp): the EAGLE-3 head split across tensor-parallel
 * rank processes (draft/eagle3_tp.c) computes what the whole head computes.
 * SmolLM2 (GGUF) and its committed head at TP 3 (3 of the head's 9 heads, its
 * KV head and 512 of its 1536 MLP columns per rank; its 32,000-row LM head
 * does not divide by 3 and stays on rank 0) against the same head whole at
 * TP 1, on the same inputs (4 rows of one sequence, seeded g): the layer's
 * output within 1e-4 of its max |value| and the draft logits within 1e-4 of
 * max |logit|, with the same argmax on every row (the row-parallel o_proj /
 * down_proj sums differ from TP 1 only by reassociation). Workers:
 * `draft_tp --tp-worker --specd-comm-...` (ranks.h), serving the head's calls
 * with eagle3_tp_serve. Skips (77) without the GGUF.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "draft/eagle3.h"
#include "draft/eagle3_head.h"
#include "draft/eagle3_tp.h"
#include "engine/comm/ranks.h"
#include "engine/runtime/tp.h"

#define BS 16
#define NB 8
#define N 4

static char g_head[1024];

static int serve_draft(void *ctx, const int32_t *msg, size_t n, specd_err *err) {
    return eagle3_tp_serve((eagle3_head *)ctx, msg, n, err);
}

static int load(const char *gguf, const model_comm *mc, backend *be, model **m, eagle3_head **h, specd_err *err) {
    model_load_opts o = {.block_size = BS, .n_blocks = NB, .tp = mc};
    eagle3_opts eo = {.n_blocks = NB};
    if (model_load(gguf, be, &o, m, err) < 0) return -1;
    return eagle3_head_load_for(g_head, *m, &eo, h, err);
}

static int worker_main(int argc, char **argv) {
    ranks_worker w;
    specd_err err = {{0}};
    comm *c = NULL;
    if (ranks_worker_detect(argc, argv, &w, &err) != 1 || ranks_worker_attach(&w, &c, &err) < 0) return 1;
    model_comm mc;
    tp_model_comm_shm(c, &mc);
    backend *be = bk_cpu_create(1);
    model *m = NULL;
    eagle3_head *h = NULL;
    char why[160];
    int rc = 1;
    if (load(getenv("SPECD_MODEL_GGUF"), &mc, be, &m, &h, &err) < 0 ||
        eagle3_head_tp_shard(h, c, &mc, why, sizeof why, &err) != 1)
        comm_abort(c, err.msg[0] ? err.msg : why);
    else if (tp_worker_run_ex(c, m, serve_draft, h, &err) == 0)
        rc = 0;
    if (rc) fprintf(stderr, "worker %d: %s\n", w.rank, err.msg);
    eagle3_head_destroy(h);
    model_destroy(m);
    bk_cpu_destroy(be);
    comm_destroy(c);
    return rc;
}

static double maxabs(const float *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--tp-worker")) {
        snprintf(g_head, sizeof g_head, "%s/draft/heads/smollm2-135m-eagle3", getenv("SPECD_SOURCE_DIR"));
        return worker_main(argc, argv);
    }
    const char *gguf = getenv("SPECD_MODEL_GGUF");
    snprintf(g_head, sizeof g_head, "%s/draft/heads/smollm2-135m-eagle3", getenv("SPECD_SOURCE_DIR"));
    if (!gguf || access(gguf, R_OK)) {
        printf("SKIP: SmolLM2 GGUF not found (SPECD_MODEL_GGUF)\n");
        return 77;
    }
    specd_err err = {{0}};
    const char *wargv[] = {argv[0], "--tp-worker", NULL};
    ranks_config rc = {.world = 3, .worker_argv = wargv, .comm = comm_config_default(), .attach_timeout_ms = 60000};
    ranks *rk = NULL;
    if (ranks_launch(&rc, &rk, &err) < 0) { fprintf(stderr, "FAIL: ranks_launch: %s\n", err.msg); return 1; }
    model_comm mc;
    tp_model_comm_shm(ranks_comm(rk), &mc);
    backend *be = bk_cpu_create(1), *be1 = bk_cpu_create(1);
    model *m = NULL, *m1 = NULL;
    eagle3_head *h = NULL, *h1 = NULL;
    char why[160] = "";
    int fail = 1;
    if (load(gguf, &mc, be, &m, &h, &err) < 0 || load(gguf, NULL, be1, &m1, &h1, &err) < 0) {
        fprintf(stderr, "FAIL: load: %s\n", err.msg);
        goto done;
    }
    if (eagle3_head_tp_shard(h, ranks_comm(rk), &mc, why, sizeof why, &err) != 1) {
        fprintf(stderr, "FAIL: the head was not split: %s %s\n", why, err.msg);
        goto done;
    }
    const int32_t H = eagle3_head_config(h1)->hidden, V = eagle3_head_n_scored(h1);
    if (eagle3_head_n_scored(h) != V) { fprintf(stderr, "FAIL: scored rows %d vs %d\n", eagle3_head_n_scored(h), V); goto done; }
    float *g = malloc(sizeof(float) * N * H), *o3 = malloc(sizeof(float) * N * H), *o1 = malloc(sizeof(float) * N * H);
    float *l3 = malloc(sizeof(float) * N * (size_t)V), *l1 = malloc(sizeof(float) * N * (size_t)V);
    uint64_t s = 42;
    for (int i = 0; i < N * H; i++) { /* seeded g, |g| < 2 */
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        g[i] = (float)((double)(s >> 11) / 9007199254740992.0 * 4.0 - 2.0);
    }
    const int32_t tok[N] = {1, 504, 3000, 17}, pos[N] = {0, 1, 2, 3}, seq[N] = {0, 0, 0, 0};
    const int32_t b3 = eagle3_kv_alloc(h), b1 = eagle3_kv_alloc(h1);
    const int32_t *t3[1] = {&b3}, *t1[1] = {&b1};
    eagle3_rows r3 = {N, tok, pos, seq, 1, t3, NULL}, r1 = {N, tok, pos, seq, 1, t1, NULL};
    if (eagle3_layer(h, &r3, g, o3, &err) < 0 || eagle3_layer(h1, &r1, g, o1, &err) < 0 ||
        eagle3_logits(h, o3, N, l3, &err) < 0 || eagle3_logits(h1, o1, N, l1, &err) < 0) {
        fprintf(stderr, "FAIL: forward: %s\n", err.msg);
        goto done;
    }
    double dl = 0, dg = 0;
    for (int i = 0; i < N * H; i++) dl = fmax(dl, fabs((double)o3[i] - o1[i]));
    for (size_t i = 0; i < (size_t)N * V; i++) dg = fmax(dg, fabs((double)l3[i] - l1[i]));
    const double ml = maxabs(o1, (size_t)N * H), mg = maxabs(l1, (size_t)N * V);
    int same_argmax = 1;
    for (int r = 0; r < N; r++) {
        int a = 0, b = 0;
        for (int v = 1; v < V; v++) {
            if (l3[(size_t)r * V + v] > l3[(size_t)r * V + a]) a = v;
            if (l1[(size_t)r * V + v] > l1[(size_t)r * V + b]) b = v;
        }
        same_argmax &= a == b;
    }
    printf("draft head at TP 3 vs TP 1: layer output max|diff| %.3g of max %.3g; logits max|diff| %.3g of max %.3g; "
           "argmax %s\n", dl, ml, dg, mg, same_argmax ? "identical" : "DIFFERENT");
    fail = !(dl <= 1e-4 * ml && dg <= 1e-4 * mg && same_argmax);
    if (fail) fprintf(stderr, "FAIL: beyond the 1e-4 bound or a different argmax\n");
    free(g); free(o3); free(o1); free(l3); free(l1);
done:
    if (rk) {
        if (fail) comm_abort(ranks_comm(rk), "test failed");
        else if (ranks_shutdown(rk, 10000, &err) < 0) { fprintf(stderr, "FAIL: shutdown: %s\n", err.msg); fail = 1; }
        ranks_destroy(rk);
    }
    eagle3_head_destroy(h); eagle3_head_destroy(h1);
    model_destroy(m); model_destroy(m1);
    bk_cpu_destroy(be); bk_cpu_destroy(be1);
    return fail;
}
