/*
 * test_cuda_kimi.c: the whole DeepSeek-V3 / Kimi forward on the CUDA backend
 * (issue 19), on the seed-0 Kimi miniature (KIMI_C_MINI_DIR/k25, written by
 * the kimi_c_mini_setup fixture), against the CPU backend with the latent
 * cache in bf16 (the GPU's form) and against the transformers reference with
 * the same rounding (tests/fixtures/kimi/mini_logits_bf16latent.json).
 *
 *  1. The run of tests/backend/kimi_steps.h (3 sequences prefilled in one
 *     step, batched decodes, a verify-style step with a tree mask, more
 *     decodes; every row's logits and final hidden state, the aux capture of
 *     layers {0, 2, 4}) on the CPU, then replayed with the same tokens on the
 *     device. Per row: logits within TOL = 2e-3 of the CPU row's max|logit|
 *     (kimi_c_logits_bf16's bound against transformers), top-1 identical
 *     unless the CPU's top-1/top-2 margin is below TOL, the top-5 set
 *     identical unless the 5th/6th margin is below TOL; final hidden and aux
 *     within 1e-3 of their row's max (f32 sums in another order, on bf16
 *     latent values that may round the other way in the last place).
 *  2. Device sampling: one more decode step with logits_dev and bk_ops.sample
 *     (greedy) gives the CPU's argmax (where the margin allows, as above).
 *  3. Batch invariance on the device: each sequence replayed ALONE (same
 *     tokens, positions and blocks) gives its rows of the batched run bit for
 *     bit (logits, hidden, aux): kn_mla / kn_moe / kn_matmul are
 *     batch-invariant by construction.
 *  4. The transformers fixture: 4 prompts prefilled on the device, logits at
 *     5 positions: top-5 identical, max error <= 2e-3 of max|logit|; then 32
 *     greedy tokens each, identical to the reference's, except that a
 *     mismatch where the reference's routing gap is below 2^-9 ends that
 *     prompt (kimi_c_logits' rule for the bf16 latent).
 *  5. Memory: nothing is allocated in the arena after the first (largest)
 *     step (weights placed once, the MoE routing buffers carved at create:
 *     review finding F6); a backend whose MoE top-k bound is below the
 *     model's refuses the step; the naive MLA form is refused on the device.
 *  6. CUDA graphs of the DeepSeek-V3 step (model_graph.c: buckets 1, 2, 4 x
 *     1 and 4 tokens per sequence, with the aux capture): the run again with
 *     graphs (its decode steps replay the 4 x 1 graph, the prefill and the
 *     tree-mask step run eagerly) gives the eager run's logits and aux bit
 *     for bit, and a chain-verify step of 4 + 1 + 3 tokens replays the 4 x 4
 *     graph (8 padding rows) with the bits of the same step run eagerly after
 *     the graphs are released, after an eager 64-token step (the largest
 *     the graphs were sized for: the workspace must not move); 6 replays.
 * Not checked here: the routing ids / weights of the device against the CPU's
 * token by token (the op keeps them in the backend; tests/kernels/test_kn_moe.c
 * compares kn_moe_route with dsv3_route on 4 configs with planted ties).
 * Built twice: label gpu against the real kernels (exits 77 without a GPU or
 * without the miniature), and backend_cuda_kimi_on_fake against
 * tests/backend/cuda_fake.c, whose kernels run the CPU backend's ops on
 * recorded "device" memory: there every comparison above must be bitwise
 * (the same ops in the same order on the same values), and no host pointer
 * may reach a device op. The fake checks the model's device path and the
 * glue's plumbing, not the kernels' arithmetic.
 */
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/backend/backend.h"
#include "engine/backend/cuda_backend.h"
#include "tests/backend/kimi_steps.h"
#include "tests/kernels/kn_harness.h"

#ifdef bk_cuda_create /* tests/backend/cuda_fake/cuda_runtime_api.h renamed the backend: the fake device */
#define ON_FAKE 1
extern int fake_violations;
extern long fake_host_launches, fake_graph_launches;
#else
#define ON_FAKE 0
#endif

int dsv3_set_mla_absorbed(model *m, bool absorbed); /* engine/model/deepseek_v3.h */


#define TOL 2e-3          /* of max|logit|: kimi_c_logits_bf16's bound */
#define TOL_STATE 1e-3    /* of max|x| per row: hidden and aux */
#define ROUTE_FRAGILE 0x1p-9

static backend *dev;
static size_t used_after[KS_NSTEP];

static void hook_used(int st) { used_after[st] = bk_cuda_arena_used(dev); }

static model *load(backend *be, const char *dir, int32_t n_blocks) {
    model_load_opts o = {.block_size = KS_BS, .n_blocks = n_blocks, .latent_bf16 = true};
    model *m = NULL;
    specd_err err = {{0}};
    if (model_load(dir, be, &o, &m, &err) < 0) {
        printf("FAIL: model_load on %s: %s\n", be->name, err.msg);
        return NULL;
    }
    return m;
}

/* the CPU row's top-6 ids (ties: lower id) */
static void top6(const float *row, int32_t V, int32_t *t) {
    for (int j = 0; j < 6; j++) {
        int32_t b = -1;
        for (int32_t i = 0; i < V; i++) {
            int used = 0;
            for (int u = 0; u < j; u++) used |= t[u] == i;
            if (!used && (b < 0 || row[i] > row[b])) b = i;
        }
        t[j] = b;
    }
}

static double row_maxabs(const float *r, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(r[i]));
    return m;
}

/* One row of logits of the device (got) against the CPU's (ref): worst relative error into *worst. */
static void cmp_logits_row(const char *what, const float *got, const float *ref, int32_t V, double *worst) {
    if (ON_FAKE) {
        KN_EXPECT(!memcmp(got, ref, sizeof(float) * (size_t)V), "%s: the fake device must give the CPU's bits", what);
        return;
    }
    const double scale = row_maxabs(ref, V);
    double e = 0;
    int nan = 0;
    for (int32_t i = 0; i < V; i++) {
        nan += isnan(got[i]);
        e = fmax(e, fabs((double)got[i] - ref[i]));
    }
    e /= scale;
    *worst = fmax(*worst, e);
    KN_EXPECT(!nan && e <= TOL, "%s: %d NaN, max |diff| %.3g of max|logit| (bound %g)", what, nan, e, TOL);
    int32_t tr[6], tg[6];
    top6(ref, V, tr);
    top6(got, V, tg);
    if (ref[tr[0]] - ref[tr[1]] > TOL * scale)
        KN_EXPECT(tg[0] == tr[0], "%s: top-1 %d, CPU %d (margin %.3g)", what, tg[0], tr[0], ref[tr[0]] - ref[tr[1]]);
    if (ref[tr[4]] - ref[tr[5]] > TOL * scale) {
        int same = 1;
        for (int j = 0; j < 5; j++) {
            int f = 0;
            for (int u = 0; u < 5; u++) f |= tg[u] == tr[j];
            same &= f;
        }
        KN_EXPECT(same, "%s: top-5 set differs from the CPU's", what);
    }
}

static void cmp_state_row(const char *what, const float *got, const float *ref, int64_t n, double *worst) {
    if (ON_FAKE) {
        KN_EXPECT(!memcmp(got, ref, sizeof(float) * (size_t)n), "%s: the fake device must give the CPU's bits", what);
        return;
    }
    const double scale = row_maxabs(ref, n);
    double e = 0;
    for (int64_t i = 0; i < n; i++) e = fmax(e, isnan(got[i]) ? INFINITY : fabs((double)got[i] - ref[i]));
    e /= scale;
    *worst = fmax(*worst, e);
    KN_EXPECT(e <= TOL_STATE, "%s: max |diff| %.3g of the row's max (bound %g)", what, e, TOL_STATE);
}

static void cmp_runs(const ks_run *got, const ks_run *ref) {
    double wl = 0, wh = 0, wa = 0;
    char what[96];
    for (int st = 0; st < KS_NSTEP; st++)
        for (int t = 0; t < ref->T[st]; t++) {
            snprintf(what, sizeof what, "step %d row %d (seq %d pos %d) logits", st, t, ref->seq[st][t], ref->pos[st][t]);
            cmp_logits_row(what, got->logits[st] + (size_t)t * ref->V, ref->logits[st] + (size_t)t * ref->V, ref->V, &wl);
            snprintf(what, sizeof what, "step %d row %d final hidden", st, t);
            cmp_state_row(what, got->hidden[st] + (size_t)t * ref->H, ref->hidden[st] + (size_t)t * ref->H, ref->H, &wh);
            for (int a = 0; a < KS_NAUX; a++) {
                snprintf(what, sizeof what, "step %d row %d aux %d", st, t, a);
                const size_t o = ((size_t)t * KS_NAUX + a) * ref->H;
                cmp_state_row(what, got->aux[st] + o, ref->aux[st] + o, ref->H, &wa);
            }
        }
    printf("device vs CPU (bf16 latent), %d steps: logits worst %.3g of max|logit| (bound %s), final hidden %.3g, "
           "aux %.3g (bound %s)\n", KS_NSTEP, wl, ON_FAKE ? "bitwise" : "2e-3", wh, wa, ON_FAKE ? "bitwise" : "1e-3");
}

/* Each sequence alone (its rows of every step, same tokens / positions / blocks; the tree mask restricted
 * to its rows) must give its rows of the batched run bit for bit. */
static void check_solo(model *m, const ks_run *batched) {
    const int32_t V = batched->V, H = batched->H;
    int rows = 0;
    for (int s = 0; s < KS_NSEQ; s++)
        for (int st = 0; st < KS_NSTEP; st++) {
            int32_t tok[KS_MAXT], pos[KS_MAXT], seq[KS_MAXT], oi[KS_MAXT], src[KS_MAXT];
            int T = 0;
            for (int t = 0; t < batched->T[st]; t++)
                if (batched->seq[st][t] == s) tok[T] = batched->tok[st][t], pos[T] = batched->pos[st][t], seq[T] = s,
                                           oi[T] = T, src[T++] = t;
            uint8_t mask[KS_MAXT * KS_MAXT];
            const bool masked = st == 4 && s == 2; /* kimi_steps.h: the last row does not see its sibling */
            if (masked) {
                for (int i = 0; i < T * T; i++) mask[i] = 1;
                mask[(T - 1) * T + (T - 2)] = 0;
            }
            float *lg = malloc(sizeof(float) * (size_t)T * V), *hd = malloc(sizeof(float) * (size_t)T * H);
            float *ax = malloc(sizeof(float) * (size_t)T * KS_NAUX * H);
            model_batch b = {.n_tokens = T, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = KS_NSEQ,
                             .block_tables = ks_tables(), .tree_mask = masked ? mask : NULL, .n_out = T, .out_idx = oi,
                             .logits = lg, .final_hidden = hd, .n_aux = KS_NAUX, .aux_layers = KS_AUX_LAYERS, .aux = ax};
            specd_err err = {{0}};
            KN_EXPECT(model_forward(m, &b, &err) == 0, "solo seq %d step %d: %s", s, st, err.msg);
            for (int i = 0; i < T; i++, rows++) {
                const int t = src[i];
                KN_EXPECT(!memcmp(lg + (size_t)i * V, batched->logits[st] + (size_t)t * V, sizeof(float) * (size_t)V) &&
                           !memcmp(hd + (size_t)i * H, batched->hidden[st] + (size_t)t * H, sizeof(float) * (size_t)H) &&
                           !memcmp(ax + (size_t)i * KS_NAUX * H, batched->aux[st] + (size_t)t * KS_NAUX * H,
                                   sizeof(float) * (size_t)KS_NAUX * H),
                       "seq %d step %d pos %d: alone != in its batch (batch invariance)", s, st, pos[i]);
            }
            free(lg), free(hd), free(ax);
        }
    printf("batch invariance on the device: %d rows alone == in their batches, bitwise\n", rows);
}

/* One decode step after the run: logits on the device, sampled there (greedy), against the CPU's argmax. */
static void check_device_sampling(model *md, model *mc, const ks_run *ref) {
    const int32_t V = ref->V;
    int32_t tok[KS_NSEQ], pos[KS_NSEQ], seq[KS_NSEQ], oi[KS_NSEQ];
    const int last = KS_NSTEP - 1;
    for (int s = 0; s < KS_NSEQ; s++) {
        int t = 0;
        while (ref->seq[last][t] != s) t++;
        tok[s] = ks_argmax(ref->logits[last] + (size_t)t * V, V);
        pos[s] = ref->pos[last][t] + 1, seq[s] = s, oi[s] = s;
    }
    float *lc = malloc(sizeof(float) * KS_NSEQ * (size_t)V);
    model_batch b = {.n_tokens = KS_NSEQ, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = KS_NSEQ,
                     .block_tables = ks_tables(), .n_out = KS_NSEQ, .out_idx = oi, .logits = lc};
    specd_err err = {{0}};
    KN_EXPECT(model_forward(mc, &b, &err) == 0, "CPU decode: %s", err.msg);
    KN_EXPECT(model_logits_on_device(md), "the device model must keep its logits on the device");
    bk_tensor ld = {0};
    b.logits = NULL, b.logits_dev = &ld;
    KN_EXPECT(model_forward(md, &b, &err) == 0, "device decode (logits_dev): %s", err.msg);
    int32_t hist[1] = {0}, ids[KS_NSEQ] = {-1, -1, -1};
    bk_sample_row rows[KS_NSEQ];
    for (int s = 0; s < KS_NSEQ; s++)
        rows[s] = (bk_sample_row){.temperature = 0.0f, .top_p = 1.0f, .repetition_penalty = 1.0f, .forced = -1,
                                  .hist = hist};
    backend *be = model_backend(md);
    KN_EXPECT(ld.data && ld.rows == KS_NSEQ && ld.cols == V, "logits_dev [%lld, %lld]", (long long)ld.rows,
           (long long)ld.cols);
    KN_EXPECT(be->ops->sample(be->ctx, &ld, rows, KS_NSEQ, NULL, 0, ids, NULL, NULL) == 0, "device sampling");
    for (int s = 0; s < KS_NSEQ; s++) {
        int32_t t6[6];
        top6(lc + (size_t)s * V, V, t6);
        const float *r = lc + (size_t)s * V;
        if (ON_FAKE || r[t6[0]] - r[t6[1]] > TOL * row_maxabs(r, V))
            KN_EXPECT(ids[s] == t6[0], "seq %d: the device sampled %d, the CPU's argmax is %d", s, ids[s], t6[0]);
    }
    printf("device sampling (greedy, logits kept on the device): ids %d %d %d, CPU argmax %s\n", ids[0], ids[1], ids[2],
           "compared");
    free(lc);
}

static json_t *fixture(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/kimi/mini_logits_bf16latent.json",
             getenv("SPECD_SOURCE_DIR") ? getenv("SPECD_SOURCE_DIR") : ".");
    json_error_t je;
    json_t *r = json_load_file(path, 0, &je);
    if (!r) printf("FAIL: %s: %s\n", path, je.text);
    return r;
}

static int32_t *json_ids(const json_t *a, int *n) {
    *n = (int)json_array_size(a);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(*n + 1));
    for (int i = 0; i < *n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(a, (size_t)i));
    return ids;
}

/* forward of ids[0..n) at positions p0.. of sequence 0, every row's logits */
static int run_seq0(model *m, const int32_t *ids, int n, int p0, float *lg) {
    int32_t pos[128], seq[128], oi[128];
    for (int i = 0; i < n; i++) pos[i] = p0 + i, seq[i] = 0, oi[i] = i;
    model_batch b = {.n_tokens = n, .tokens = ids, .pos = pos, .seq_of = seq, .n_seqs = 1,
                     .block_tables = ks_tables(), .n_out = n, .out_idx = oi, .logits = lg};
    specd_err err = {{0}};
    const int rc = model_forward(m, &b, &err);
    if (rc < 0) printf("model_forward: %s\n", err.msg);
    return rc;
}

/* The transformers reference with the bf16 latent (kimi_c_logits_bf16's checks, on the device). */
static void check_fixture(model *m) {
    json_t *fx = fixture();
    if (!fx) {
        kn_fails++;
        return;
    }
    const int32_t V = model_get_config(m)->vocab;
    const json_t *prompts = json_object_get(fx, "prompts");
    float *lg = malloc(sizeof(float) * 128 * (size_t)V);
    double worst = 0;
    int compared = 0, total = 0;
    for (size_t pi = 0; pi < json_array_size(prompts); pi++) {
        const json_t *pr = json_array_get(prompts, pi);
        int n;
        int32_t *ids = json_ids(json_object_get(pr, "ids"), &n);
        KN_EXPECT(n + 33 <= KS_MAXB * KS_BS && run_seq0(m, ids, n, 0, lg) == 0, "prompt %zu: prefill", pi);
        const json_t *rows = json_object_get(pr, "logits");
        for (size_t k = 0; k < json_array_size(rows); k++) {
            const json_t *r = json_array_get(rows, k);
            const int p = (int)json_integer_value(json_object_get(r, "pos"));
            const float *row = lg + (size_t)p * V;
            int32_t t6[6];
            top6(row, V, t6);
            const json_t *t5 = json_object_get(r, "top5_ids"), *t5v = json_object_get(r, "top5_logits");
            double e = 0;
            for (int j = 0; j < 5; j++) {
                const int32_t want = (int32_t)json_integer_value(json_array_get(t5, (size_t)j));
                KN_EXPECT(t6[j] == want, "prompt %zu pos %d: top-%d id %d, transformers %d", pi, p, j + 1, t6[j], want);
                e = fmax(e, fabs(row[want] - json_number_value(json_array_get(t5v, (size_t)j))));
            }
            e /= json_number_value(json_object_get(r, "max_abs_logit"));
            worst = fmax(worst, e);
            KN_EXPECT(e <= TOL, "prompt %zu pos %d: |diff| %.3g of max|logit| (bound %g)", pi, p, e, TOL);
        }
        const json_t *gr = json_object_get(pr, "greedy"), *gaps = json_object_get(pr, "greedy_route_gaps");
        int32_t next = ks_argmax(lg + (size_t)(n - 1) * V, V);
        const int steps = (int)json_array_size(gr);
        int s = 0;
        total += steps;
        for (; s < steps; s++) {
            const int32_t want = (int32_t)json_integer_value(json_array_get(gr, (size_t)s));
            if (next != want) {
                const double gap = json_number_value(json_array_get(gaps, (size_t)s));
                if (gap < ROUTE_FRAGILE) {
                    printf("prompt %zu: greedy identical for %d of %d tokens, then a routing near-tie of the "
                           "reference (gap %.3g < 2^-9)\n", pi, s, steps, gap);
                    break;
                }
                KN_EXPECT(next == want, "prompt %zu greedy step %d: %d, transformers %d (routing gap %.3g)", pi, s, next,
                       want, gap);
                break;
            }
            if (run_seq0(m, &next, 1, n + s, lg) < 0) {
                kn_fails++;
                break;
            }
            next = ks_argmax(lg, V);
        }
        compared += s;
        free(ids);
    }
    printf("transformers fixture (bf16 latent) on the device: 4 prompts x 5 positions, top-5 and logits checked, worst %.3g of "
           "max|logit| (bound 2e-3); %d of %d greedy tokens compared\n", worst, compared, total);
    free(lg);
    json_decref(fx);
}

/* A chain-verify step after the run (4 tokens of sequence 0, 1 of 1, 3 of 2), all rows' logits and aux. */
static int verify_step(model *m, const ks_run *run, float *lg, float *ax) {
    int32_t tok[8], pos[8], seq[8], oi[8];
    static const int nq[KS_NSEQ] = {4, 1, 3};
    int T = 0;
    for (int s = 0; s < KS_NSEQ; s++) {
        int32_t p0 = 0;
        for (int st = 0; st < KS_NSTEP; st++)
            for (int t = 0; t < run->T[st]; t++)
                if (run->seq[st][t] == s && run->pos[st][t] + 1 > p0) p0 = run->pos[st][t] + 1;
        for (int i = 0; i < nq[s]; i++, T++) tok[T] = 500 + 71 * T, pos[T] = p0 + i, seq[T] = s, oi[T] = T;
    }
    model_batch b = {.n_tokens = T, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = KS_NSEQ,
                     .block_tables = ks_tables(), .n_out = T, .out_idx = oi, .logits = lg, .n_aux = KS_NAUX,
                     .aux_layers = KS_AUX_LAYERS, .aux = ax};
    specd_err err = {{0}};
    const int rc = model_forward(m, &b, &err);
    if (rc < 0) printf("verify step: %s\n", err.msg);
    return rc < 0 ? -1 : T;
}

static void check_graphs(model *md, const ks_run *eager) {
    const int32_t buckets[3] = {1, 2, 4}, q[2] = {1, 4};
    const model_graph_opts go = {.buckets = buckets, .n_buckets = 3, .q = q, .n_q = 2, .n_aux = KS_NAUX,
                                 .aux_layers = KS_AUX_LAYERS, .max_step_tokens = 64, .max_seqs = 5, .max_tokens = 64};
    specd_err err = {{0}};
    if (model_graphs_capture(md, &go, &err) < 0) {
        KN_EXPECT(0, "graph capture: %s", err.msg);
        return;
    }
    ks_run g;
    KN_EXPECT(ks_do_ex(md, eager, &g, NULL, false) == 0, "the run with graphs");
    const int32_t V = eager->V, H = eager->H;
    for (int st = 0; st < KS_NSTEP; st++)
        KN_EXPECT(!memcmp(g.logits[st], eager->logits[st], sizeof(float) * (size_t)eager->T[st] * V) &&
                   !memcmp(g.aux[st], eager->aux[st], sizeof(float) * (size_t)eager->T[st] * KS_NAUX * H),
               "step %d with graphs != eager", st);
    { /* an eager step of the largest size the graphs were sized for (64 tokens, every row out, aux): the
       * workspace must not move (model_grow would release the graphs and the verify step below run eagerly) */
        int32_t tok[64], pos[64], seq[64], oi[64];
        for (int i = 0; i < 64; i++) tok[i] = 9000 + 13 * i, pos[i] = i, seq[i] = 0, oi[i] = i;
        float *lg = malloc(sizeof(float) * 64 * (size_t)V), *ax = malloc(sizeof(float) * 64 * KS_NAUX * (size_t)H);
        model_batch b = {.n_tokens = 64, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = KS_NSEQ,
                         .block_tables = ks_tables(), .n_out = 64, .out_idx = oi, .logits = lg, .n_aux = KS_NAUX,
                         .aux_layers = KS_AUX_LAYERS, .aux = ax};
        KN_EXPECT(model_forward(md, &b, &err) == 0, "a 64-token step with graphs captured: %s", err.msg);
        free(lg), free(ax);
    }
    float *l1 = malloc(sizeof(float) * 8 * (size_t)V), *l2 = malloc(sizeof(float) * 8 * (size_t)V);
    float *a1 = malloc(sizeof(float) * 8 * KS_NAUX * (size_t)H), *a2 = malloc(sizeof(float) * 8 * KS_NAUX * (size_t)H);
#if ON_FAKE
    const long hl0 = fake_host_launches, gl0 = fake_graph_launches;
#endif
    const int T = verify_step(md, eager, l1, a1);
#if ON_FAKE /* the replayed step: one graph launch, no kernel launched from the host (the gather of its logits
             * rows is inside the graph too) */
    KN_EXPECT(fake_graph_launches - gl0 == 1 && fake_host_launches - hl0 == 0,
           "a replayed step: %ld graph launches, %ld host launches (expected 1, 0)", fake_graph_launches - gl0,
           fake_host_launches - hl0);
#endif
    model_graph_stats st;
    model_graph_get_stats(md, &st);
    model_graphs_release(md);
    KN_EXPECT(T == 8 && verify_step(md, eager, l2, a2) == 8, "verify steps");
    KN_EXPECT(!memcmp(l1, l2, sizeof(float) * 8 * (size_t)V) && !memcmp(a1, a2, sizeof(float) * 8 * KS_NAUX * (size_t)H),
           "the verify step replayed as a graph != the same step eager");
    KN_EXPECT(st.n_graphs == 6 && st.replays == 6 && st.eager == 3 && st.padded_rows == 5 + 8,
           "graphs %d, replays %ld, eager %ld, padded rows %ld (expected 6, 6, 3, 13)", st.n_graphs, st.replays,
           st.eager, st.padded_rows);
    printf("CUDA graphs: %d captured; %ld steps replayed (%ld padding rows), %ld eager, compared with eager bit for bit\n",
           st.n_graphs, st.replays, st.padded_rows, st.eager);
    free(l1), free(l2), free(a1), free(a2);
    ks_free(&g);
}

/* The bounds: a backend whose MoE bounds are below the model's refuses the step; a step beyond max tokens
 * too; the naive MLA form is refused on a device backend. */
static void check_refusals(const char *dir, const bk_cuda_opts *o0) {
    bk_cuda_opts o = *o0;
    o.moe_top_k = 2; /* the miniature routes to 4 */
    specd_err err = {{0}};
    backend *b2 = bk_cuda_create(&o, &err);
    KN_EXPECT(b2, "backend with small MoE bounds: %s", err.msg);
    if (!b2) return;
    model *m = load(b2, dir, KS_MAXB * KS_NSEQ);
    KN_EXPECT(m, "load on the small-bounds backend");
    if (m) {
        float *lg = malloc(sizeof(float) * 4 * (size_t)model_get_config(m)->vocab);
        const int32_t ids[4] = {1, 2, 3, 4};
        KN_EXPECT(run_seq0(m, ids, 4, 0, lg) < 0, "a MoE step beyond the backend's top-k bound must fail");
        free(lg);
        model_destroy(m);
    }
    bk_cuda_destroy(b2);
}

int main(void) {
    kn_harness_require_gpu();
    const char *root = getenv("KIMI_C_MINI_DIR");
    char dir[1024], cfg[1100];
    snprintf(dir, sizeof dir, "%s/k25", root ? root : "(unset)");
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    struct stat sb;
    if (!root || stat(cfg, &sb) != 0) {
        printf("SKIP: Kimi miniature not found at %s (the kimi_c_mini_setup test writes it; needs numpy)\n", dir);
        return 77;
    }
    backend *cpu = bk_cpu_create(2);
    model *mc = cpu ? load(cpu, dir, KS_MAXB * KS_NSEQ) : NULL;
    if (!mc) return 1;
    ks_run ref, got;
    if (ks_do(mc, NULL, &ref, NULL) < 0) return 1;
    const model_config *c = model_get_config(mc);
    /* the miniature: 4 heads, latent 32 + 16, 16 experts top 4 of width 64 (hidden 128) */
    const bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)256 << 20, .max_tokens = 64, .max_seqs = 5,
                            .max_len = KS_MAXB * KS_BS, .block_size = KS_BS, .max_heads = 4,
                            .max_head_dim = c->head_dim, .sample_vocab = c->vocab, .mla_kv_lora_rank = 32,
                            .moe_experts = 16, .moe_top_k = 4, .moe_hidden = c->hidden, .moe_inter = 64};
    specd_err err = {{0}};
    dev = bk_cuda_create(&o, &err);
    if (!dev) {
        printf("FAIL: cuda backend: %s\n", err.msg);
        return 1;
    }
    const size_t used0 = bk_cuda_arena_used(dev);
    model *md = load(dev, dir, KS_MAXB * KS_NSEQ + 1); /* + the graphs' padding block */
    if (!md) return 1;
    const size_t used_loaded = bk_cuda_arena_used(dev);
    printf("arena: %.1f MiB for the backend's own buffers, %.1f MiB after loading (weights, KV)\n",
           (double)used0 / (1 << 20), (double)used_loaded / (1 << 20));
    KN_EXPECT(ks_do(md, &ref, &got, hook_used) == 0, "the run on the device");
    for (int st = 1; st < KS_NSTEP; st++)
        KN_EXPECT(used_after[st] == used_after[0], "step %d: arena use %zu, after the first (largest) step %zu: "
               "something was allocated per step", st, used_after[st], used_after[0]);
    cmp_runs(&got, &ref);
    check_device_sampling(md, mc, &ref);
    check_solo(md, &got);
    KN_EXPECT(bk_cuda_arena_used(dev) == used_after[0], "arena use grew after the first step");
    /* the naive form is host-only */
    dsv3_set_mla_absorbed(md, false);
    float *lg = malloc(sizeof(float) * (size_t)c->vocab);
    const int32_t one = 7;
    KN_EXPECT(run_seq0(md, &one, 1, 0, lg) < 0, "the naive MLA form must be refused on the device");
    dsv3_set_mla_absorbed(md, true);
    free(lg);
    check_fixture(md);
    check_graphs(md, &got);
    ks_free(&ref), ks_free(&got);
    model_destroy(md);
    model_destroy(mc);
    bk_cuda_destroy(dev);
    bk_cpu_destroy(cpu);
    check_refusals(dir, &o);
#if ON_FAKE
    KN_EXPECT(fake_violations == 0, "%d host pointers reached the fake kernels", fake_violations);
#endif
    if (kn_fails) {
        printf("%d checks failed\n", kn_fails);
        return 1;
    }
    printf("OK\n");
    return 0;
}
