/*
 * test_cuda_eagle3.c (label gpu): the EAGLE-3 head on the CUDA backend (its
 * weights, KV and buffers in the arena, sharing the target's placed
 * embedding; draft/eagle3_weights.c head_place) against the same head on the
 * CPU backend, then speculative decoding with target and head both on the
 * GPU.
 *
 * Reference: the CPU backend at SPECD_CPU_ISA=portable (f32 activations,
 * double sums in norms and attention), set before it is created.
 * Target: $SPECD_EAGLE3_TARGET, else $SPECD_TWIN_DIR/smollm2_twin (the
 * SmolLM2-shaped bf16 twin tools/gpu_check.sh generates on the GPU machine:
 * hidden 576, vocabulary 49152, 30 layers, what the head was trained for),
 * else $SPECD_MODEL_GGUF (SmolLM2 itself, where it exists). Head: the
 * trained head shipped in draft/heads/smollm2-135m-eagle3, whole and with its
 * hot vocabulary (hot_vocab_4096, --speculative-token-map).
 *
 * Part 1, the forward, same inputs on both backends: a 24-token prompt
 * through the CPU target with aux capture; its 23 real pairs through fc, the
 * layer and the LM head of each head (the GPU one through eagle3_*_t on
 * device tensors), then the backend argmax op with the head's d2t map:
 *   - layer output max|diff| <= 1e-4 x max|h| and logits max|diff| <= 1e-3
 *     x max|logit| (f32 on both sides with different reduction orders over
 *     <= 1,728 terms per dot product: ~1e-6 relative per value; a wrong row,
 *     head, position or weight moves whole values);
 *   - the GPU's mapped argmax equals used[CPU argmax] on every row whose CPU
 *     top-2 margin exceeds 2e-3 x max|logit| (twice the logits bound: there
 *     the order cannot flip); rows below that margin are counted, not
 *     checked.
 * Part 2, lossless on the GPU: 16 greedy tokens of speculative decoding with
 * target and head on the GPU (propose k, verify k + 1 rows with capture,
 * accept, bonus, extend) equal 16 tokens of plain greedy decoding on the GPU,
 * token for token, for k = 1..5, with and without the hot vocabulary; the
 * GPU kernels are batch-invariant, so this holds bit for bit whatever the
 * drafts are.
 * Part 3, the features on the device (model_aux_reserve through
 * eagle3_opts.aux_rows, the forward's aux_on_device, extend_rows into the
 * head's feature pool): at k = 1 and 4 every draft equals the Part 2 run's
 * (host features: downloaded and uploaded again, exact copies) and the output
 * equals plain greedy.
 * Part 4, the chain draft loop as CUDA graphs (eagle3_graphs_capture, bucket
 * 1, graphs for every k in 1..K, length classes 4096 / 1024 / 256): at
 * k = 1 and 4 the drafts equal the eager chain's and every propose replays
 * the graph of its k; with k varying per step (1, 2, .., 5, 1, ...) at
 * prompts of 24 and 100 tokens the drafts equal the eager chain's with the
 * same k, every k's graph replayed, every k >= 2 replay in the 256 class.
 * Exits 77 with the reason without a usable GPU, a target or the head. The
 * arena is 2 GiB (SPECD_CUDA_TEST_ARENA_MB overrides). tests/backend builds
 * this same file against the fake device (backend_cuda_eagle3_on_fake, with
 * SmolLM2 as the target) to check the test's own logic without a GPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "draft/eagle3.h"
#include "draft/eagle3_head.h"
#include "engine/backend/backend.h"
#include "engine/backend/cuda_backend.h"
#include "engine/model/model.h"
#include "tests/kernels/kn_harness.h"


#define P 24     /* prompt tokens */
#define GEN 16   /* generated tokens of part 2 */
#define MAXT 128
static backend *cpu, *gpu;
static int32_t g_table[8] = {3, 0, 7, 1, 6, 2, 5, 4};

static int32_t argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    return b;
}

static bool exists(const char *p) {
    struct stat st;
    return p && stat(p, &st) == 0;
}

static model *load_target(const char *path, backend *be) {
    model_load_opts o = {.block_size = 16, .n_blocks = 16};
    model *m = NULL;
    specd_err err = {{0}};
    if (model_load(path, be, &o, &m, &err) < 0) {
        printf("FAIL model_load %s on %s: %s\n", path, be->name, err.msg);
        exit(1);
    }
    return m;
}

/* One target step of n tokens at pos0 (sequence 0, g_table); all rows' logits, aux when asked (dev_aux: left in
 * the model's device aux buffer, model_aux_reserve, for extend_rows). */
static bool g_dev_aux;
static bool g_graphs; /* the chain draft loop as CUDA graphs (eagle3_graphs_capture, bucket 1, K = k) */
static bool g_kvar;   /* propose k = 1 + step % k (adaptive speculation's varying k) instead of k every step */
static int32_t g_P = P; /* prompt tokens of greedy() */
static long g_replays;
static eagle3_graph_stats g_gst; /* the last greedy() run's chain graph stats */
static int target(model *m, const int32_t *tokens, int32_t n, int32_t pos0, float *logits, const int32_t *layers,
                  float *aux) {
    int32_t pos[MAXT], seq[MAXT] = {0}, out[MAXT];
    for (int32_t i = 0; i < n; i++) pos[i] = pos0 + i, out[i] = i;
    const int32_t *tables[1] = {g_table};
    const bool dev = aux && g_dev_aux;
    model_batch b = {.n_tokens = n, .tokens = tokens, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = tables,
                     .n_out = logits ? n : 0, .out_idx = out, .logits = logits, .n_aux = aux ? 3 : 0,
                     .aux_layers = layers, .aux = dev ? NULL : aux, .aux_on_device = dev};
    specd_err err = {{0}};
    if (model_forward(m, &b, &err) < 0) { printf("FAIL forward on %s: %s\n", model_backend(m)->name, err.msg); kn_fails++; return -1; }
    return 0;
}

static bk_tensor ddup(const void *host, bk_dtype dt, int64_t rows, int64_t cols) {
    bk_tensor t;
    if (bk_tensor_alloc(gpu, dt, rows, cols, &t) < 0 || gpu->ops->upload(gpu->ctx, t.data, host, bk_nbytes(&t)) < 0) {
        printf("FAIL: device tensor [%lld, %lld]\n", (long long)rows, (long long)cols);
        exit(1);
    }
    return t;
}
static void down(void *host, const bk_tensor *t) {
    if (gpu->ops->download(gpu->ctx, host, t->data, bk_nbytes(t)) < 0) { printf("FAIL download\n"); exit(1); }
}

static double maxabs(const float *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fabs(x[i]) > m ? fabs(x[i]) : m;
    return m;
}
static double maxdiff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fabs((double)a[i] - b[i]) > m ? fabs((double)a[i] - b[i]) : m;
    return m;
}

/* Part 1 with the head in dir (hot vocabulary: hot, or NULL). */
static void test_forward(model *mc, model *mg, const char *dir, const char *hot) {
    const int32_t V = model_get_config(mc)->vocab, Ht = model_get_config(mc)->hidden;
    specd_err err = {{0}};
    spec_proposer *pc = NULL, *pg = NULL;
    eagle3_opts o = {.n_blocks = 8, .hot_vocab = hot, .max_rows = MAXT, .max_seqs = 8};
    if (eagle3_load(dir, mc, &o, &pc, &err) < 0 || eagle3_load(dir, mg, &o, &pg, &err) < 0) {
        KN_EXPECT(0, "eagle3_load %s: %s", dir, err.msg);
        eagle3_destroy(pc);
        return;
    }
    eagle3_head *hc = eagle3_proposer_head(pc), *hg = eagle3_proposer_head(pg);
    const int32_t H = eagle3_head_config(hc)->hidden, Vs = eagle3_head_n_scored(hc), fw = 3 * Ht, n = P - 1;
    const int64_t *used = eagle3_head_used(hc);
    int32_t layers[8], tok[P], tk[P], pos[P], seq[P] = {0};
    pc->ops->aux_layers(pc->ctx, layers);
    for (int32_t i = 0; i < P; i++) tok[i] = (int32_t)((1000 + 37 * (int64_t)i) % V);
    float *aux = malloc(sizeof(float) * (size_t)P * fw), *g = malloc(sizeof(float) * (size_t)n * H);
    float *hc_out = malloc(sizeof(float) * (size_t)n * H), *hg_out = malloc(sizeof(float) * (size_t)n * H);
    float *lc = malloc(sizeof(float) * (size_t)n * Vs), *lgp = malloc(sizeof(float) * (size_t)n * Vs);
    int32_t ids[P];
    if (target(mc, tok, P, 0, NULL, layers, aux) < 0) goto out;
    /* real pairs (f_t, x_{t+1}) at position t, t = 0 .. P - 2, in two fresh blocks of each head's pool */
    const int32_t bc[2] = {eagle3_kv_alloc(hc), eagle3_kv_alloc(hc)}, bg[2] = {eagle3_kv_alloc(hg), eagle3_kv_alloc(hg)};
    const int32_t *tc[1] = {bc}, *tg[1] = {bg};
    for (int32_t t = 0; t < n; t++) tk[t] = tok[t + 1], pos[t] = t;
    eagle3_rows rc = {n, tk, pos, seq, 1, tc, NULL}, rg = {n, tk, pos, seq, 1, tg, NULL};
    if (eagle3_fc(hc, aux, n, g, &err) < 0 || eagle3_layer(hc, &rc, g, hc_out, &err) < 0 ||
        eagle3_logits(hc, hc_out, n, lc, &err) < 0) {
        KN_EXPECT(0, "cpu head forward: %s", err.msg);
        goto out;
    }
    bk_tensor da = ddup(aux, BK_F32, n, fw), di = ddup(tk, BK_I32, n, 1), dg, dh, dl, dids;
    if (bk_tensor_alloc(gpu, BK_F32, n, H, &dg) < 0 || bk_tensor_alloc(gpu, BK_F32, n, H, &dh) < 0 ||
        bk_tensor_alloc(gpu, BK_F32, n, Vs, &dl) < 0 || bk_tensor_alloc(gpu, BK_I32, n, 1, &dids) < 0) {
        printf("FAIL: device buffers\n");
        exit(1);
    }
    if (eagle3_fc_t(hg, &da, &dg, &err) < 0 || eagle3_layer_t(hg, &rg, &di, &dg, &dh, &err) < 0 ||
        eagle3_logits_t(hg, &dh, &dl, &err) < 0 ||
        gpu->ops->argmax(gpu->ctx, &dl, eagle3_head_d2t(hg), &dids) < 0) {
        KN_EXPECT(0, "gpu head forward: %s", err.msg);
    } else {
        down(hg_out, &dh);
        down(lgp, &dl);
        down(ids, &dids);
        const double hm = maxabs(hc_out, (size_t)n * H), hd = maxdiff(hc_out, hg_out, (size_t)n * H);
        const double lm = maxabs(lc, (size_t)n * Vs), ld = maxdiff(lc, lgp, (size_t)n * Vs);
        KN_EXPECT(hd <= 1e-4 * hm, "%s: layer output max|diff| %.3g > 1e-4 x %.3g", hot ? "hot" : "whole", hd, hm);
        KN_EXPECT(ld <= 1e-3 * lm, "%s: logits max|diff| %.3g > 1e-3 x %.3g", hot ? "hot" : "whole", ld, lm);
        int32_t checked = 0, close = 0;
        for (int32_t r = 0; r < n; r++) {
            const float *row = lc + (size_t)r * Vs;
            const int32_t b = argmax(row, Vs);
            float second = -INFINITY;
            for (int32_t i = 0; i < Vs; i++) if (i != b && row[i] > second) second = row[i];
            if ((double)row[b] - second <= 2e-3 * lm) { close++; continue; }
            checked++;
            KN_EXPECT(ids[r] == (int32_t)used[b], "%s row %d: gpu argmax + d2t %d, cpu %lld (margin %.3g)",
                   hot ? "hot" : "whole", r, ids[r], (long long)used[b], (double)row[b] - second);
        }
        printf("%s head (%d scored ids): layer max|diff| %.3g of %.3g, logits max|diff| %.3g of %.3g; argmax + d2t "
               "identical on %d rows (%d rows within the margin, not checked)\n", hot ? "hot" : "whole", Vs, hd, hm,
               ld, lm, checked, close);
        KN_EXPECT(checked >= n / 2, "only %d of %d rows had a margin to check", checked, n);
    }
    bk_tensor_free(gpu, &da), bk_tensor_free(gpu, &di), bk_tensor_free(gpu, &dg), bk_tensor_free(gpu, &dh);
    bk_tensor_free(gpu, &dl), bk_tensor_free(gpu, &dids);
out:
    free(aux), free(g), free(hc_out), free(hg_out), free(lc), free(lgp);
    eagle3_destroy(pc), eagle3_destroy(pg);
}

/* extend with host rows, or (g_dev_aux) with rows row0.. of the target's device aux buffer (extend_rows) */
static int feed(spec_proposer *sp, const int32_t *tok, int32_t n, int32_t pos0, const float *aux, specd_err *err) {
    if (!aux || !g_dev_aux) return sp->ops->extend(sp->ctx, 1, tok, n, pos0, aux, err);
    return sp->ops->extend_rows(sp->ctx, 1, tok, n, pos0, 0, err);
}

/* Part 2: GEN greedy tokens, plain (k = 0) or speculative with the head in dir on the target's backend; the
 * drafts proposed go to props[GEN * 5] when not NULL. g_dev_aux: the features never leave the device. */
static void greedy(model *m, const char *dir, const char *hot, int32_t k, int32_t *out, int32_t *props) {
    const int32_t V = model_get_config(m)->vocab, H = model_get_config(m)->hidden;
    float *lg = malloc(sizeof(float) * (size_t)MAXT * V), *aux = malloc(sizeof(float) * (size_t)MAXT * 3 * H);
    const int32_t np = g_P;
    int32_t prompt[MAXT], layers[8] = {0}, n_out = 0, mpos = np, step = 0;
    for (int32_t i = 0; i < np; i++) prompt[i] = (int32_t)((1000 + 37 * (int64_t)i) % V);
    spec_proposer *sp = NULL;
    specd_err err = {{0}};
    eagle3_opts o = {.n_blocks = 16, .hot_vocab = hot, .max_rows = MAXT, .max_seqs = 8,
                     .aux_rows = g_dev_aux ? MAXT : 0};
    int32_t n_props = 0;
    if (k > 0 && eagle3_load(dir, m, &o, &sp, &err) < 0) { KN_EXPECT(0, "eagle3_load: %s", err.msg); goto out; }
    /* bucket 1, graphs for every k in 1..k, length classes 4096, 1024, 256 (floor 64, rounded to 256) */
    static const int32_t bucket1[1] = {1};
    const eagle3_graph_opts gopt = {.buckets = bucket1, .n_buckets = 1, .k = k, .max_len = 4096, .len_floor = 64};
    if (sp && g_graphs && eagle3_graphs_capture(sp, &gopt, &err) < 0) { KN_EXPECT(0, "chain graphs: %s", err.msg); goto out; }
    if (sp) sp->ops->aux_layers(sp->ctx, layers);
    if (target(m, prompt, np, 0, lg, layers, sp ? aux : NULL) < 0) goto out;
    int32_t x = argmax(lg + (size_t)(np - 1) * V, V);
    if (sp && (feed(sp, prompt, np, 0, aux, &err) < 0 ||
               sp->ops->extend(sp->ctx, 1, &x, 1, np, NULL, &err) < 0)) { KN_EXPECT(0, "extend: %s", err.msg); goto out; }
    out[n_out++] = x;
    while (n_out < GEN && !kn_fails) {
        int32_t batch[9], d[8], a = 0;
        const int32_t ks = g_kvar && k > 0 ? 1 + step % k : k;
        step++;
        batch[0] = x;
        if (sp) {
            int64_t id = 1;
            float t0 = 0.0f;
            if (sp->ops->propose(sp->ctx, &id, &ks, 1, ks, &t0, d, NULL, &err) < 0) { KN_EXPECT(0, "propose: %s", err.msg); break; }
            for (int j = 0; j < ks; j++) batch[1 + j] = d[j] >= 0 ? d[j] : 0;
            for (int j = 0; j < ks && props && n_props < GEN * 5; j++) props[n_props++] = d[j];
        }
        const int32_t nb = sp ? ks + 1 : 1;
        if (target(m, batch, nb, mpos, lg, layers, sp ? aux : NULL) < 0) break;
        while (a < nb - 1 && argmax(lg + (size_t)a * V, V) == batch[1 + a]) a++;
        const int32_t next = argmax(lg + (size_t)a * V, V);
        if (sp && (feed(sp, batch, a + 1, mpos, aux, &err) < 0 ||
                   sp->ops->extend(sp->ctx, 1, &next, 1, mpos + a + 1, NULL, &err) < 0)) {
            KN_EXPECT(0, "extend: %s", err.msg);
            break;
        }
        for (int j = 0; j < a && n_out < GEN; j++) out[n_out++] = batch[1 + j];
        if (n_out < GEN) out[n_out++] = next;
        mpos += a + 1;
        x = next;
    }
out:
    g_replays += eagle3_graph_replays(sp);
    eagle3_graph_get_stats(sp, &g_gst);
    free(lg), free(aux);
    eagle3_destroy(sp);
}

int main(void) {
    kn_harness_require_gpu();
    setenv("SPECD_CPU_ISA", "portable", 1);
    const char *src = getenv("SPECD_SOURCE_DIR"), *twin = getenv("SPECD_TWIN_DIR");
    char head[1024], map[1100], tw[1100];
    snprintf(head, sizeof head, "%s/draft/heads/smollm2-135m-eagle3", src ? src : ".");
    snprintf(map, sizeof map, "%s/hot_vocab_4096", head);
    snprintf(tw, sizeof tw, "%s/smollm2_twin", twin ? twin : "/nonexistent");
    const char *tgt = getenv("SPECD_EAGLE3_TARGET");
    if (!exists(tgt)) tgt = exists(tw) ? tw : getenv("SPECD_MODEL_GGUF");
    if (!exists(tgt) || !exists(head)) {
        printf("SKIP: no SmolLM2-shaped target (SPECD_EAGLE3_TARGET, $SPECD_TWIN_DIR/smollm2_twin, SPECD_MODEL_GGUF) "
               "or no head at %s\n", head);
        return 77;
    }
    cpu = bk_cpu_create(0);
    specd_err err = {{0}};
    const char *mb = getenv("SPECD_CUDA_TEST_ARENA_MB");
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)(mb && atoi(mb) > 0 ? atoi(mb) : 2048) << 20,
                      .max_tokens = MAXT, .max_seqs = 8, .max_len = 4096, .block_size = 16, .max_heads = 16,
                      .max_head_dim = 128};
    gpu = bk_cuda_create(&o, &err);
    if (!cpu || !gpu) {
        printf("FAIL: backends: %s\n", err.msg);
        return 1;
    }
    printf("%s; reference %s; target %s; head %s\n", bk_cuda_describe(gpu), bk_cpu_describe(cpu), tgt, head);
    model *mc = load_target(tgt, cpu), *mg = load_target(tgt, gpu);
    test_forward(mc, mg, head, NULL);
    test_forward(mc, mg, head, map);
    int32_t ref[GEN] = {0}, props_host[2][GEN * 5];
    memset(props_host, 0xff, sizeof props_host); /* -1 past the drafts a run records */
    greedy(mg, head, NULL, 0, ref, NULL);
    for (int with_map = 0; with_map < 2; with_map++)
        for (int32_t k = 1; k <= 5; k++) {
            int32_t out[GEN] = {0};
            greedy(mg, head, with_map ? map : NULL, k, out, !with_map && (k == 1 || k == 4) ? props_host[k == 4] : NULL);
            KN_EXPECT(!memcmp(out, ref, sizeof ref), "k=%d%s: speculative greedy on the GPU != plain greedy on the GPU", k,
                   with_map ? " (hot vocabulary)" : "");
        }
    printf("speculative greedy (target and head on the GPU, k = 1..5, whole and hot head) == plain greedy: %s\n",
           kn_fails ? "NO" : "16 tokens each");
    /* Part 3: the features never leave the device (model_aux_reserve via eagle3_opts.aux_rows, the forward's
     * aux_on_device, extend_rows into the head's feature pool): the same drafts as with the features
     * downloaded and uploaded again (exact copies both ways), and speculative greedy == plain greedy */
    g_dev_aux = true;
    for (int32_t k = 1; k <= 4; k += 3) {
        int32_t out[GEN] = {0}, props[GEN * 5];
        memset(props, 0xff, sizeof props);
        greedy(mg, head, NULL, k, out, props);
        KN_EXPECT(!memcmp(out, ref, sizeof ref), "k=%d, features on the device: speculative greedy != plain greedy", k);
        KN_EXPECT(!memcmp(props, props_host[k == 4], sizeof props),
               "k=%d: the drafts with the features on the device differ from those with host features", k);
    }
    g_dev_aux = false;
    printf("features on the device (k = 1, 4): drafts identical to the host-feature runs, output == plain greedy: %s\n",
           kn_fails ? "NO" : "yes");
    /* Part 4: the chain draft loop replayed as CUDA graphs (bucket 1, graphs for every k in 1..K, length classes
     * 4096 / 1024 / 256): the eager chain's drafts, bit for bit (the same kernels on the same inputs; the class
     * bound does not change a token's arithmetic), every propose a replay of the graph of ITS k, in the class its
     * positions need (prompts of 24 and 100 tokens: the 256 class, a quarter of the backend's 4096 grid).
     * First with k fixed (K = 1, 4), then with k varying per step (1 + step % 5, adaptive speculation's pattern) */
    for (int32_t k = 1; k <= 4; k += 3) {
        int32_t out[GEN] = {0}, props[GEN * 5];
        memset(props, 0xff, sizeof props);
        const long r0 = g_replays;
        g_graphs = true;
        greedy(mg, head, NULL, k, out, props);
        g_graphs = false;
        KN_EXPECT(!memcmp(out, ref, sizeof ref), "k=%d, chain graphs: speculative greedy != plain greedy", k);
        KN_EXPECT(!memcmp(props, props_host[k == 4], sizeof props), "k=%d: the graph chain's drafts differ from the eager "
               "chain's", k);
        KN_EXPECT(g_replays - r0 >= GEN / (k + 1) && g_gst.replays_k[k] == g_replays - r0,
                  "k=%d: %ld proposes replayed a chain graph, %ld of them the %d-step one", k, g_replays - r0,
                  g_gst.replays_k[k], k);
    }
    for (int32_t pl = 24; pl <= 100; pl += 76) {
        int32_t ref_p[GEN] = {0}, out_e[GEN] = {0}, out_g[GEN] = {0}, pr_e[GEN * 5], pr_g[GEN * 5];
        memset(pr_e, 0xff, sizeof pr_e), memset(pr_g, 0xff, sizeof pr_g);
        g_P = pl;
        greedy(mg, head, NULL, 0, ref_p, NULL); /* plain greedy at this prompt length */
        g_kvar = true;
        greedy(mg, head, NULL, 5, out_e, pr_e); /* eager chain, k = 1, 2, 3, 4, 5, 1, ... */
        g_graphs = true;
        const long r0 = g_replays;
        greedy(mg, head, NULL, 5, out_g, pr_g);
        g_graphs = g_kvar = false;
        long by_k = 0;
        for (int32_t k = 1; k <= 5; k++) by_k += g_gst.replays_k[k] > 0;
        KN_EXPECT(!memcmp(out_e, ref_p, sizeof ref_p) && !memcmp(out_g, ref_p, sizeof ref_p),
                  "prompt %d, k varying: speculative greedy (eager / graphs) != plain greedy", pl);
        KN_EXPECT(!memcmp(pr_e, pr_g, sizeof pr_e), "prompt %d, k varying: the graph chain's drafts differ from the "
                  "eager chain's", pl);
        KN_EXPECT(g_replays - r0 >= 4 && by_k == 5 && g_gst.eager == 0, "prompt %d: %ld replays, %ld distinct k, %ld "
                  "eager", pl, g_replays - r0, by_k, g_gst.eager);
        /* classes 4096, 1024, 256 (rounded up to the attention's 256-position split): both contexts stay below
         * 256 positions, so every replay of k >= 2 is in the 256 class, below the backend's 4096 */
        KN_EXPECT(g_gst.n_classes == 3 && g_gst.classes[2] == 256 && g_gst.last_L == 256 &&
                      g_gst.short_replays == g_gst.replays - g_gst.replays_k[1],
                  "prompt %d: the last replay in class %d, %ld short replays of %ld (%d classes)", pl, g_gst.last_L,
                  g_gst.short_replays, g_gst.replays - g_gst.replays_k[1], g_gst.n_classes);
    }
    g_P = P;
    printf("chain draft loop as CUDA graphs (k = 1, 4 fixed; k = 1..5 varying per step, prompts of 24 and 100 "
           "tokens: class 256 of 4096): drafts identical to the eager chain, output == plain greedy: %s\n",
           kn_fails ? "NO" : "yes");
    model_destroy(mc), model_destroy(mg);
    bk_cuda_destroy(gpu);
    bk_cpu_destroy(cpu);
    if (kn_fails) printf("FAILED: %d checks\n", kn_fails);
    else printf("OK\n");
    return kn_fails ? 1 : 0;
}
