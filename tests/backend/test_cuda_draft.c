/*
 * test_cuda_draft.c (label model, no GPU): the EAGLE-3 head next to a target
 * on the (fake) CUDA device, both ways the bundle wires it for `--device
 * cuda` with a draft:
 *   - on the DEVICE, the target's own backend (eagle3_opts.be NULL): its
 *     weights placed, the target's placed embedding shared, its KV, workspace
 *     and chain buffers in device memory, argmax + d2t on the device, one
 *     download of the drafted ids per propose;
 *   - on a CPU backend of its own (the fallback, eagle3_opts.be): the
 *     target's embedding / LM head through their host views
 *     (model_embed_weight / model_lm_head_weight), the aux features the target
 *     downloads each step (llama_forward on a device backend).
 * Checked:
 *   1. greedy speculative decoding (tests/draft/test_draft_spec_loop.c's loop:
 *      prefill with capture, propose k, verify k + 1 rows with capture,
 *      accept, bonus, extend) of 12 tokens at k = 1 and 4 with the target on
 *      the device equals plain greedy decoding on the CPU target token for
 *      token, with the head on the device and with the head on its CPU
 *      backend, and the proposals equal those of a head on the CPU target
 *      (same head, same aux bits: the fake device reproduces the CPU ops);
 *   2. the trained head of draft/heads on the device against the same head
 *      on the CPU target, fed the very same inputs (4 sequences of different
 *      prompt lengths verified on the CPU target, 5 speculative steps, k =
 *      k0, k0 - 1, ... per sequence so rows leave the chain at different
 *      steps): every draft token identical for k0 = 1..5, batch 1 and 4,
 *      with and without its hot vocabulary (--speculative-token-map
 *      hot_vocab_4096), and each propose on
 *      the device waits on it exactly once (one stream synchronisation: the
 *      download of the drafted ids; the embedding's bad-id flag travels in the
 *      same sync) and uploads only metadata, features, tokens and indices;
 *   3. with CUDA graphs captured on the device target (buckets {1, 2} x q
 *      {1, k + 1}, the head's aux layers; model_graph.c): plain greedy and
 *      greedy speculative decoding (k = 1, 4; the head on the same device,
 *      its eager steps interleaved with the target's replays) equal plain
 *      greedy on the CPU token for token, and the decode / verify steps
 *      were replayed (stats);
 *   4. the chain graph with a sequence next to the end of the backend's
 *      positions (its k below the graph's steps): the propose replays the
 *      graph and drafts what the eager CPU head drafts (part 5, near_end);
 *   5. no host pointer reached a device op.
 * Part 4 in detail: graphs for every k in 1..5 at buckets 1 / 2 / 4 with length
 * classes 1024 / 256 (max_len 1024, floor 64): for batches of 1, 2, 3
 * (padded to 4) and 4 (hot vocabulary) and each k_max in 1..5 (per-sequence k
 * of k, k - 1, ... so rows leave at different steps), five speculative steps
 * whose every propose replays exactly one graph: the k_max-step one, in the
 * smallest bucket, in the class computed here from the positions
 * (want_class); drafts identical to the eager CPU head's. Part 6
 * (len_classes): contexts of 20, 254 and 300 tokens alone and mixed replay
 * the 256 and 1024 classes (254 on both sides of the edge), drafts
 * identical.
 * Needs the SmolLM2 GGUF and the venv's numpy (random head); skips (77)
 * without them.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "tests/backend/cuda_fake/cuda_runtime_api.h" /* first: renames the CUDA backend's entry points */
#include "draft/eagle3.h"
#include "draft/eagle3_head.h"
#include "engine/backend/cuda_backend.h"
#include "tests/draft/draft_test_util.h"

#define GEN 12
#define MAXT 128
static int n_fail;
#define EXPECT(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); n_fail++; } } while (0)

static int32_t g_prompt[MAXT], g_np, g_table[8] = {3, 0, 7, 1, 6, 2, 5, 4};

static int32_t argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    return b;
}

static int target_t(model *m, const int32_t *table, const int32_t *tokens, int32_t n, int32_t pos0, float *logits,
                    const int32_t *aux_layers, float *aux) {
    int32_t pos[MAXT], seq[MAXT] = {0}, out[MAXT];
    for (int32_t i = 0; i < n; i++) pos[i] = pos0 + i, out[i] = i;
    const int32_t *tables[1] = {table};
    model_batch b = {.n_tokens = n, .tokens = tokens, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = tables,
                     .n_out = n, .out_idx = out, .logits = logits, .n_aux = aux ? 3 : 0, .aux_layers = aux_layers, .aux = aux};
    specd_err err = {{0}};
    if (model_forward(m, &b, &err) < 0) { printf("FAIL forward: %s\n", err.msg); n_fail++; return -1; }
    return 0;
}

static int target(model *m, const int32_t *tokens, int32_t n, int32_t pos0, float *logits, const int32_t *aux_layers,
                  float *aux) {
    return target_t(m, g_table, tokens, n, pos0, logits, aux_layers, aux);
}

static void plain_greedy(model *m, int32_t *out) {
    const int32_t V = model_get_config(m)->vocab;
    float *lg = malloc(sizeof(float) * (size_t)MAXT * V);
    target(m, g_prompt, g_np, 0, lg, NULL, NULL);
    int32_t x = argmax(lg + (size_t)(g_np - 1) * V, V);
    for (int i = 0; i < GEN; i++) {
        out[i] = x;
        target(m, &x, 1, g_np + i, lg, NULL, NULL);
        x = argmax(lg, V);
    }
    free(lg);
}

/* Greedy speculative decoding of GEN tokens with the head in dir on backend draft_be; proposals logged into props. */
static void spec_greedy(model *m, backend *draft_be, const char *dir, int32_t k, int32_t *out, int32_t *props) {
    const int32_t V = model_get_config(m)->vocab, H = model_get_config(m)->hidden;
    spec_proposer *sp = NULL;
    specd_err err = {{0}};
    eagle3_opts o = {.n_blocks = 16, .be = draft_be, .max_rows = MAXT, .max_seqs = 4};
    if (eagle3_load(dir, m, &o, &sp, &err) < 0) { printf("FAIL eagle3_load: %s\n", err.msg); n_fail++; return; }
    int32_t layers[8];
    sp->ops->aux_layers(sp->ctx, layers);
    float *lg = malloc(sizeof(float) * (size_t)MAXT * V), *aux = malloc(sizeof(float) * (size_t)MAXT * 3 * H);
    target(m, g_prompt, g_np, 0, lg, layers, aux);
    int32_t x = argmax(lg + (size_t)(g_np - 1) * V, V), n_out = 0, mpos = g_np, n_props = 0;
    EXPECT(sp->ops->extend(sp->ctx, 1, g_prompt, g_np, 0, aux, &err) == 0, "extend prompt: %s", err.msg);
    EXPECT(sp->ops->extend(sp->ctx, 1, &x, 1, g_np, NULL, &err) == 0, "extend x: %s", err.msg);
    out[n_out++] = x;
    while (n_out < GEN && !n_fail) {
        int64_t id = 1;
        int32_t d[8], batch[9];
        float t0 = 0.0f;
        EXPECT(sp->ops->propose(sp->ctx, &id, &k, 1, k, &t0, d, NULL, &err) == 0, "propose: %s", err.msg);
        batch[0] = x;
        for (int j = 0; j < k; j++) batch[1 + j] = d[j], props[n_props++] = d[j];
        if (target(m, batch, k + 1, mpos, lg, layers, aux) < 0) break;
        int32_t a = 0;
        while (a < k && argmax(lg + (size_t)a * V, V) == d[a]) a++;
        int32_t bonus = argmax(lg + (size_t)a * V, V);
        EXPECT(sp->ops->extend(sp->ctx, 1, batch, a + 1, mpos, aux, &err) == 0, "extend: %s", err.msg);
        EXPECT(sp->ops->extend(sp->ctx, 1, &bonus, 1, mpos + a + 1, NULL, &err) == 0, "extend bonus: %s", err.msg);
        for (int j = 0; j < a && n_out < GEN; j++) out[n_out++] = d[j];
        if (n_out < GEN) out[n_out++] = bonus;
        mpos += a + 1;
        x = bonus;
    }
    free(lg), free(aux);
    eagle3_destroy(sp);
}

/* Part 2: proposers a (head on the CPU target's backend) and b (head on the
 * device target's backend) fed the same inputs: NSEQ sequences (prompt 0 cut
 * to 37 - 5s tokens, s = 0..NSEQ-1), 5 greedy speculative steps verified on
 * the CPU target. Every proposal of b must equal a's; each propose of b must
 * synchronise with the device once. */
#define STEPS 5
/* The length class a chain graph of rows at last pairs L[0..n) with k[0..n) drafts must replay: the smallest of
 * GCLASS (descending) above the positions its layer calls write (row r's last one: L + k - 1, L + 1 at k = 1),
 * computed here from the positions alone; 0 when no row drafts more than 1 (a k = 1 graph has no layer call). */
static const int32_t GCLASS[2] = {1024, 256};
static int32_t want_class(const int32_t *L, const int32_t *k, int32_t n) {
    int32_t kg = 0, len = 0;
    for (int32_t r = 0; r < n; r++) kg = k[r] > kg ? k[r] : kg;
    if (kg < 2) return 0;
    for (int32_t r = 0; r < n; r++) {
        const int32_t top = L[r] + (k[r] > 1 ? k[r] - 1 : 1);
        len = top + 1 > len ? top + 1 : len;
    }
    int32_t c = GCLASS[0];
    for (int i = 0; i < 2; i++)
        if (len <= GCLASS[i]) c = GCLASS[i];
    return c;
}

/* graph_k > 0: the device head has chain graphs for buckets {1, 2, 4}, every k in 1..graph_k, length classes
 * GCLASS (max_len 1024, floor 64: model_graph_len_classes rounds a class up to the attention's 256-position
 * split, so 1024 and 256); every greedy propose must replay the graph of the call's largest k, in the
 * smallest bucket above nseq, in the class want_class names. */
static void batch_compare(model *mc, model *md, const char *dir, const char *hot, int32_t nseq, int32_t k,
                          int32_t graph_k) {
    const bool graphs = graph_k > 0;
    const int32_t V = model_get_config(mc)->vocab, H = model_get_config(mc)->hidden;
    specd_err err = {{0}};
    spec_proposer *pa = NULL, *pb = NULL;
    eagle3_opts o = {.n_blocks = 32, .hot_vocab = hot, .max_rows = MAXT, .max_seqs = 4, .max_k = 8};
    if (eagle3_load(dir, mc, &o, &pa, &err) < 0 || eagle3_load(dir, md, &o, &pb, &err) < 0) {
        printf("FAIL eagle3_load: %s\n", err.msg);
        n_fail++;
        eagle3_destroy(pa);
        return;
    }
    static const int32_t gb[3] = {1, 2, 4};
    const eagle3_graph_opts gopt = {.buckets = gb, .n_buckets = 3, .k = graph_k, .max_len = 1024, .len_floor = 64};
    if (graphs && eagle3_graphs_capture(pb, &gopt, &err) < 0) {
        EXPECT(0, "chain graphs: %s", err.msg);
        eagle3_destroy(pa), eagle3_destroy(pb);
        return;
    }
    const long gl0 = fake_graph_launches, gr0 = eagle3_graph_replays(pb);
    eagle3_head *hb = eagle3_proposer_head(pb);
    EXPECT(fake_is_device(eagle3_head_d2t(hb)->data, 4) && fake_is_device(eagle3_head_kv(hb).k, 4),
           "the device head's d2t map and KV must be device memory");
    EXPECT(eagle3_head_n_scored(hb) == eagle3_head_n_scored(eagle3_proposer_head(pa)), "scored ids differ");
    int32_t layers[8], tables[4][8], x[4], mpos[4], np[4];
    pa->ops->aux_layers(pa->ctx, layers);
    float *lg = malloc(sizeof(float) * (size_t)MAXT * V), *aux = malloc(sizeof(float) * (size_t)MAXT * 3 * H);
    int64_t ids[4];
    int32_t ks[4];
    for (int32_t s = 0; s < nseq; s++) {
        for (int b = 0; b < 8; b++) tables[s][b] = s * 8 + b;
        np[s] = g_np - 5 * s;
        ids[s] = 100 + s;
        ks[s] = k - s > 1 ? k - s : 1; /* different k per sequence: rows leave the chain at different steps */
        if (target_t(mc, tables[s], g_prompt, np[s], 0, lg, layers, aux) < 0) goto out;
        x[s] = argmax(lg + (size_t)(np[s] - 1) * V, V);
        mpos[s] = np[s];
        spec_proposer *both[2] = {pa, pb};
        for (int w = 0; w < 2; w++) {
            EXPECT(both[w]->ops->extend(both[w]->ctx, ids[s], g_prompt, np[s], 0, aux, &err) == 0, "extend: %s", err.msg);
            EXPECT(both[w]->ops->extend(both[w]->ctx, ids[s], &x[s], 1, np[s], NULL, &err) == 0, "extend: %s", err.msg);
        }
    }
    int32_t n_same = 0, n_acc = 0;
    for (int step = 0; step < STEPS && !n_fail; step++) {
        int32_t da[4 * 8], db[4 * 8];
        const long s0 = fake_syncs, d0 = fake_d2h, u0 = fake_h2d, h0 = fake_host_launches;
        int32_t Ls[4];
        for (int32_t s = 0; s < nseq; s++) Ls[s] = mpos[s] - 1; /* the last real pair: (f at mpos - 1, x) */
        EXPECT(pb->ops->propose(pb->ctx, ids, ks, nseq, k, NULL, db, NULL, &err) == 0, "propose (device): %s", err.msg);
        if (graphs) {
            eagle3_graph_stats gs;
            eagle3_graph_get_stats(pb, &gs);
            const int32_t wB = nseq <= 2 ? nseq : 4, wL = want_class(Ls, ks, nseq);
            EXPECT(gs.last_B == wB && gs.last_k == k && (k < 2 || gs.last_L == wL),
                   "nseq=%d k=%d step %d: replayed bucket %d, %d steps, class %d; want %d, %d, %d", nseq, k, step,
                   gs.last_B, gs.last_k, gs.last_L, wB, k, wL);
            if (step == 0 && nseq == 3 && k == 2)
                printf("  graph propose of 3 x (2, 1, 1) drafts: %ld host kernel launches (the real pairs), 1 graph\n",
                       fake_host_launches - h0);
        }
        const long syncs = fake_syncs - s0, d2h = fake_d2h - d0, h2d = fake_h2d - u0;
        EXPECT(pa->ops->propose(pa->ctx, ids, ks, nseq, k, NULL, da, NULL, &err) == 0, "propose (cpu): %s", err.msg);
        EXPECT(syncs == 1 && d2h >= 1 && d2h <= 2, "propose of %d x %d drafts on the device: %ld syncs, %ld downloads "
               "(want one round trip)", nseq, k, syncs, d2h);
        if (step == 0 && nseq == 4 && k == 5)
            printf("  propose of 4 x (5, 4, 3, 2) drafts on the device: %ld stream sync, %ld device->host copies (the ids and the "
                   "bad-id flag), %ld host->device copies (metadata per layer call, features, tokens, indices)\n",
                   syncs, d2h, h2d);
        for (int32_t i = 0; i < nseq * k; i++) {
            EXPECT(da[i] == db[i], "hot=%s nseq=%d k=%d step %d: draft %d: device %d, cpu %d", hot ? "yes" : "no", nseq,
                   k, step, i, db[i], da[i]);
            EXPECT(i % k < ks[i / k] ? da[i] >= 0 && da[i] < V : da[i] == -1, "draft %d is %d", i, da[i]);
            n_same += da[i] == db[i] && da[i] >= 0;
        }
        for (int32_t s = 0; s < nseq && !n_fail; s++) { /* verify on the CPU target; both heads get the same aux */
            int32_t batch[9];
            batch[0] = x[s];
            const int32_t kk = ks[s];
            for (int j = 0; j < kk; j++) batch[1 + j] = da[s * k + j];
            if (target_t(mc, tables[s], batch, kk + 1, mpos[s], lg, layers, aux) < 0) goto out;
            int32_t a = 0;
            while (a < kk && argmax(lg + (size_t)a * V, V) == batch[1 + a]) a++;
            const int32_t bonus = argmax(lg + (size_t)a * V, V);
            n_acc += a;
            spec_proposer *both[2] = {pa, pb};
            for (int w = 0; w < 2; w++) {
                EXPECT(both[w]->ops->extend(both[w]->ctx, ids[s], batch, a + 1, mpos[s], aux, &err) == 0, "extend: %s",
                       err.msg);
                EXPECT(both[w]->ops->extend(both[w]->ctx, ids[s], &bonus, 1, mpos[s] + a + 1, NULL, &err) == 0,
                       "extend: %s", err.msg);
            }
            mpos[s] += a + 1;
            x[s] = bonus;
        }
    }
    printf("hot=%s batch %d k=%d%s: %d drafts identical on the device and the CPU (%d accepted)\n", hot ? "yes" : "no",
           nseq, k, graphs ? " (chain as CUDA graphs of k steps, padded to a bucket of 1 / 2 / 4)" : "", n_same, n_acc);
    if (graphs) {
        eagle3_graph_stats gs;
        eagle3_graph_get_stats(pb, &gs);
        EXPECT(eagle3_graph_replays(pb) - gr0 == STEPS && fake_graph_launches - gl0 == STEPS &&
                   gs.replays_k[k] == STEPS && gs.eager == 0,
               "every greedy propose replayed the chain graph of %d steps (%ld replays, %ld of k = %d, %ld graph "
               "launches of %d proposes, %ld eager)", k, eagle3_graph_replays(pb) - gr0, gs.replays_k[k], k,
               fake_graph_launches - gl0, STEPS, gs.eager);
        EXPECT(gs.n_graphs == 3 * (1 + 2 * (graph_k - 1)) && gs.n_classes == 2 && gs.classes[1] == 256,
               "captured %d graphs in %d classes (want 3 buckets x (1 + 2 classes x %d))", gs.n_graphs, gs.n_classes,
               graph_k - 1);
    }
    { /* sampled drafts (temperature 0.8 for even sequences, greedy for odd ones, q wanted): both heads draw with
       * bk_ops.draw (the CPU op vs the fake device's kn_sample_draw, which runs sampler.c) at Philox(draft seed,
       * position); the device head brings each such step's q rows to the host; with the same seeds both heads
       * draw the same drafts from the same q, bit for bit */
        float temps[4] = {0.8f, 0.0f, 0.8f, 0.0f};
        const size_t nq = (size_t)nseq * (size_t)k * (size_t)V;
        float *qa = malloc(sizeof(float) * nq), *qb = malloc(sizeof(float) * nq);
        int32_t da[4 * 8], db[4 * 8];
        for (int32_t s = 0; s < nseq; s++) {
            pa->ops->seed_seq(pa->ctx, ids[s], 1234 + (uint64_t)s);
            pb->ops->seed_seq(pb->ctx, ids[s], 1234 + (uint64_t)s);
        }
        const long s0 = fake_syncs;
        EXPECT(pb->ops->propose(pb->ctx, ids, ks, nseq, k, temps, db, qb, &err) == 0, "sampled propose: %s", err.msg);
        const long syncs = fake_syncs - s0;
        EXPECT(pa->ops->propose(pa->ctx, ids, ks, nseq, k, temps, da, qa, &err) == 0, "sampled propose: %s", err.msg);
        EXPECT(!memcmp(da, db, sizeof(int32_t) * (size_t)nseq * k), "sampled drafts differ (nseq %d, k %d)", nseq, k);
        EXPECT(!memcmp(qa, qb, sizeof(float) * nq), "draft q differs (nseq %d, k %d)", nseq, k);
        for (int32_t i = 0; i < nseq * k; i++) /* a one-hot q for greedy rows, a distribution for sampled ones */
            if (da[i] >= 0) EXPECT(qa[(size_t)i * V + da[i]] > 0.0f, "q of draft %d is 0 at the drawn id", i);
        EXPECT(syncs == ks[0] + 1, "sampled propose: %ld syncs, want %d (one per chain step with a sampled row, then "
               "the ids)", syncs, ks[0] + 1);
        free(qa), free(qb);
    }
out:
    free(lg), free(aux);
    eagle3_destroy(pa), eagle3_destroy(pb);
}

/* Part 5: the chain graph next to the end of the context. The backend holds positions < NE_LEN; sequence 0
 * (prompt 37 tokens, then x: 38 tokens, L = 36) has room for 2 drafts (the engine's spec_plan_k: k <= max_len -
 * n_tokens), sequence 1 (prompt 30) drafts 5, so k_max == the graph's 5 steps and the greedy propose replays the
 * chain graph. Sequence 0's row keeps running steps past its k in the graph: those steps must stay at positions
 * the backend holds (an unclamped row reached L + 4 = 40: the metadata upload refused it and the whole propose
 * failed, every sequence of the batch verifying without drafts). Its drafts must equal an eager CPU head's. */
#define NE_LEN 40
static void near_end(model *mc, const char *dir) {
    const int32_t V = model_get_config(mc)->vocab, H = model_get_config(mc)->hidden;
    specd_err err = {{0}};
    bk_cuda_opts co = {.device = 0, .arena_bytes = (size_t)512 << 20, .max_tokens = MAXT, .max_seqs = 5,
                       .max_len = NE_LEN, .block_size = 16, .max_heads = 16, .max_head_dim = 128};
    backend *dev = bk_cuda_create(&co, &err);
    model *md = dev ? dt_model(dev, 8) : NULL;
    spec_proposer *pa = NULL, *pb = NULL;
    eagle3_opts o = {.n_blocks = 32, .max_rows = MAXT, .max_seqs = 4, .max_k = 8};
    static const int32_t gb[1] = {2};
    long cap0 = fake_captured_launches;
    if (!md || eagle3_load(dir, mc, &o, &pa, &err) < 0 || eagle3_load(dir, md, &o, &pb, &err) < 0 ||
        (cap0 = fake_captured_launches,
         eagle3_graphs_capture(pb, &(eagle3_graph_opts){.buckets = gb, .n_buckets = 1, .k = 5}, &err) < 0)) {
        EXPECT(0, "near the end: setup: %s", err.msg);
        goto out;
    }
    /* the graphs of k = 1..5 hold 15 LM-head + argmax steps and 10 layer calls; the memory plan estimates 24
     * kernel nodes per step (eagle3_graphs_nodes) */
    printf("chain graphs of k = 1..5, bucket 2: %ld kernel nodes captured (the plan's estimate: %zu)\n",
           fake_captured_launches - cap0, eagle3_graphs_nodes(1, 5, 1));
    int32_t layers[8], tables[2][8];
    pa->ops->aux_layers(pa->ctx, layers);
    float *lg = malloc(sizeof(float) * (size_t)MAXT * V), *aux = malloc(sizeof(float) * (size_t)MAXT * 3 * H);
    const int64_t ids[2] = {200, 201};
    const int32_t np[2] = {g_np, g_np - 7}, ks[2] = {NE_LEN - (g_np + 1), 5};
    for (int32_t s = 0; s < 2 && lg && aux; s++) {
        for (int b = 0; b < 8; b++) tables[s][b] = s * 8 + b;
        if (target_t(mc, tables[s], g_prompt, np[s], 0, lg, layers, aux) < 0) break;
        const int32_t x = argmax(lg + (size_t)(np[s] - 1) * V, V);
        spec_proposer *both[2] = {pa, pb};
        for (int w = 0; w < 2; w++) {
            EXPECT(both[w]->ops->extend(both[w]->ctx, ids[s], g_prompt, np[s], 0, aux, &err) == 0, "extend: %s", err.msg);
            EXPECT(both[w]->ops->extend(both[w]->ctx, ids[s], &x, 1, np[s], NULL, &err) == 0, "extend: %s", err.msg);
        }
    }
    int32_t da[2 * 5], db[2 * 5];
    const long r0 = eagle3_graph_replays(pb);
    if (!n_fail) {
        EXPECT(pb->ops->propose(pb->ctx, ids, ks, 2, 5, NULL, db, NULL, &err) == 0,
               "near the end: propose (device, chain graph): %s", err.msg);
        EXPECT(pa->ops->propose(pa->ctx, ids, ks, 2, 5, NULL, da, NULL, &err) == 0, "near the end: propose (cpu): %s",
               err.msg);
        EXPECT(eagle3_graph_replays(pb) - r0 == 1, "near the end: the propose replayed the chain graph (%ld)",
               eagle3_graph_replays(pb) - r0);
        for (int32_t i = 0; i < 2 * 5 && !n_fail; i++)
            EXPECT(da[i] == db[i] && (i % 5 < ks[i / 5] ? da[i] >= 0 : da[i] == -1),
                   "near the end: draft %d: device %d, cpu %d", i, db[i], da[i]);
        if (!n_fail)
            printf("near the end of a %d-position backend: chain graph of 5 steps, k = (%d, 5): drafts == the eager "
                   "CPU head's\n", NE_LEN, ks[0]);
    }
    free(lg), free(aux);
out:
    eagle3_destroy(pa), eagle3_destroy(pb);
    model_destroy(md);
    bk_cuda_destroy(dev);
}

/* Part 6: length classes of the chain graphs (max_len 1024, floor 64: classes 1024 and 256). Three sequences
 * whose contexts are short (20 tokens), at the class edge (254: its last pair at 253, so k = 3 writes up to
 * position 255, the 256 class's last, and k = 4 position 256, past it) and long (300; g_prompt repeated),
 * prefilled on the CPU target in chunks; each propose (alone, and mixes of them) must replay the bucket /
 * steps / class want_class names from the positions, and draft what the eager CPU head drafts. A class too
 * small is refused by the backend (the propose fails); a class too large is caught by the class assertion. */
static void len_classes(model *mc, model *md, const char *dir) {
    const int32_t V = model_get_config(mc)->vocab, H = model_get_config(mc)->hidden;
    specd_err err = {{0}};
    spec_proposer *pa = NULL, *pb = NULL;
    eagle3_opts o = {.n_blocks = 48, .max_rows = MAXT, .max_seqs = 4, .max_k = 8};
    static const int32_t gb[3] = {1, 2, 4};
    const eagle3_graph_opts gopt = {.buckets = gb, .n_buckets = 3, .k = 4, .max_len = 1024, .len_floor = 64};
    float *lg = malloc(sizeof(float) * (size_t)MAXT * V), *aux = malloc(sizeof(float) * (size_t)MAXT * 3 * H);
    if (!lg || !aux || eagle3_load(dir, mc, &o, &pa, &err) < 0 || eagle3_load(dir, md, &o, &pb, &err) < 0 ||
        eagle3_graphs_capture(pb, &gopt, &err) < 0) {
        EXPECT(0, "length classes: setup: %s", err.msg);
        goto out;
    }
    enum { NS = 3, LONG = 300 };
    static int32_t toks[LONG + 1], tables[NS][20];
    const int32_t np[NS] = {20, 254, LONG};
    const int64_t ids[NS] = {300, 301, 302};
    int32_t layers[8];
    pa->ops->aux_layers(pa->ctx, layers);
    for (int32_t i = 0; i < LONG; i++) toks[i] = g_prompt[i % g_np];
    for (int32_t s = 0; s < NS && !n_fail; s++) {
        /* the CPU target's 32 blocks, reused: each sequence is prefilled whole before the next */
        for (int32_t b = 0; b < (np[s] + 16) / 16; b++) tables[s][b] = b;
        for (int32_t p0 = 0; p0 < np[s] && !n_fail; p0 += MAXT) { /* prefill in chunks of MAXT rows */
            const int32_t n = np[s] - p0 < MAXT ? np[s] - p0 : MAXT;
            if (target_t(mc, tables[s], toks + p0, n, p0, lg, layers, aux) < 0) goto out;
            spec_proposer *both[2] = {pa, pb};
            for (int w = 0; w < 2; w++)
                EXPECT(both[w]->ops->extend(both[w]->ctx, ids[s], toks + p0, n, p0, aux, &err) == 0, "extend: %s",
                       err.msg);
            if (p0 + n == np[s]) {
                const int32_t x = argmax(lg + (size_t)(n - 1) * V, V);
                for (int w = 0; w < 2; w++)
                    EXPECT(both[w]->ops->extend(both[w]->ctx, ids[s], &x, 1, np[s], NULL, &err) == 0, "extend: %s",
                           err.msg);
            }
        }
    }
    /* (which sequences, their k): alone, the edge both sides, pairs, all three, all at k = 1 (class-free) */
    static const struct { int32_t n, s[3], k[3]; } cs[] = {
        {1, {0}, {3}}, {1, {1}, {3}}, {1, {1}, {4}}, {1, {2}, {3}}, {2, {0, 1}, {4, 3}}, {2, {0, 1}, {2, 4}},
        {2, {1, 2}, {4, 2}}, {3, {0, 1, 2}, {1, 2, 3}}, {3, {0, 1, 2}, {1, 1, 1}}, {1, {0}, {4}},
    };
    int seen[3] = {0}; /* replays per class 256, 1024, none */
    for (size_t c = 0; c < sizeof cs / sizeof cs[0] && !n_fail; c++) {
        int64_t cid[3];
        int32_t L[3], kmax = 0, da[3 * 4], db[3 * 4];
        for (int32_t i = 0; i < cs[c].n; i++) {
            cid[i] = ids[cs[c].s[i]];
            L[i] = np[cs[c].s[i]] - 1;
            kmax = cs[c].k[i] > kmax ? cs[c].k[i] : kmax;
        }
        const long r0 = eagle3_graph_replays(pb), g0 = fake_graph_launches;
        EXPECT(pb->ops->propose(pb->ctx, cid, cs[c].k, cs[c].n, kmax, NULL, db, NULL, &err) == 0,
               "case %zu: propose (device): %s", c, err.msg);
        EXPECT(pa->ops->propose(pa->ctx, cid, cs[c].k, cs[c].n, kmax, NULL, da, NULL, &err) == 0,
               "case %zu: propose (cpu): %s", c, err.msg);
        eagle3_graph_stats gs;
        eagle3_graph_get_stats(pb, &gs);
        const int32_t wL = want_class(L, cs[c].k, cs[c].n), wB = cs[c].n <= 2 ? cs[c].n : 4;
        EXPECT(eagle3_graph_replays(pb) - r0 == 1 && fake_graph_launches - g0 == 1 && gs.last_B == wB &&
                   gs.last_k == kmax && (kmax < 2 || gs.last_L == wL),
               "case %zu: %ld replays (%ld launches), bucket %d, %d steps, class %d; want 1, %d, %d, %d", c,
               eagle3_graph_replays(pb) - r0, fake_graph_launches - g0, gs.last_B, gs.last_k, gs.last_L, wB, kmax, wL);
        for (int32_t i = 0; i < cs[c].n * kmax; i++)
            EXPECT(da[i] == db[i] && (i % kmax < cs[c].k[i / kmax] ? da[i] >= 0 : da[i] == -1),
                   "case %zu: draft %d: device %d, cpu %d", c, i, db[i], da[i]);
        seen[wL == 256 ? 0 : wL == 1024 ? 1 : 2]++;
    }
    EXPECT(seen[0] >= 3 && seen[1] >= 3 && seen[2] >= 1, "every class replayed (256: %d, 1024: %d, none: %d)",
           seen[0], seen[1], seen[2]);
    if (!n_fail)
        printf("length classes 1024 / 256: contexts of 20, 254 (the class edge) and 300 tokens, alone and mixed, "
               "replayed the class their positions need (256: %d, 1024: %d, k = 1: %d); drafts == the eager CPU "
               "head's\n", seen[0], seen[1], seen[2]);
out:
    free(lg), free(aux);
    eagle3_destroy(pa), eagle3_destroy(pb);
}

int main(void) {
    backend *cpu = bk_cpu_create(0), *draft_cpu = bk_cpu_create(0);
    specd_err err = {{0}};
    bk_cuda_opts co = {.device = 0, .arena_bytes = (size_t)512 << 20, .max_tokens = MAXT, .max_seqs = 5, .max_len = 1024,
                       .block_size = 16, .max_heads = 16, .max_head_dim = 128};
    backend *dev = bk_cuda_create(&co, &err);
    if (!cpu || !draft_cpu || !dev) { printf("FAIL backends: %s\n", err.msg); return 1; }
    model *mc = dt_model(cpu, 32), *md = dt_model(dev, 8);
    char p[1024], dir[64];
    snprintf(p, sizeof p, "%s/tests/fixtures/eagle3/capture_smollm2.json", dt_src());
    json_error_t je;
    json_t *cap = json_load_file(p, 0, &je);
    if (!cap) { printf("FAIL %s: %s\n", p, je.text); return 1; }
    json_t *ids = json_object_get(json_array_get(json_object_get(cap, "prompts"), 0), "token_ids");
    g_np = (int32_t)json_array_size(ids);
    for (int32_t i = 0; i < g_np && i < MAXT; i++) g_prompt[i] = (int32_t)json_integer_value(json_array_get(ids, (size_t)i));
    json_decref(cap);
    json_t *fx = dt_fixtures();
    dt_make_head(fx, "spec_s1", NULL, dir);
    json_decref(fx);
    /* the head computes on the host: it must get the host views, never the placed (device) copies */
    EXPECT(!fake_is_device(model_embed_weight(md)->data, 1) && !fake_is_device(model_lm_head_weight(md)->data, 1),
           "model_embed_weight / model_lm_head_weight of a device model must be host memory");
    int32_t ref[GEN];
    plain_greedy(mc, ref);
    for (int32_t k = 1; k <= 4; k += 3) {
        int32_t out_c[GEN] = {0}, out_d[GEN] = {0}, out_g[GEN] = {0}, pr_c[GEN * 4] = {0}, pr_d[GEN * 4] = {0},
                pr_g[GEN * 4] = {0};
        spec_greedy(mc, NULL, dir, k, out_c, pr_c);      /* head on the CPU target's own backend */
        spec_greedy(md, draft_cpu, dir, k, out_d, pr_d); /* target on the device, head on its CPU backend */
        spec_greedy(md, NULL, dir, k, out_g, pr_g);      /* target and head on the device */
        EXPECT(!memcmp(out_d, ref, sizeof ref), "k=%d: speculative output (device target) != plain greedy", k);
        EXPECT(!memcmp(out_g, ref, sizeof ref), "k=%d: speculative output (device target and head) != plain greedy", k);
        EXPECT(!memcmp(out_c, ref, sizeof ref), "k=%d: speculative output (cpu target) != plain greedy", k);
        EXPECT(!memcmp(pr_c, pr_d, sizeof pr_c), "k=%d: the head proposed differently next to the device target", k);
        EXPECT(!memcmp(pr_c, pr_g, sizeof pr_c), "k=%d: the head on the device proposed differently", k);
        printf("k=%d: 12 tokens == plain greedy (head on the device, and on its CPU backend); proposals identical to "
               "the all-CPU run\n", k);
    }
    /* part 3: the device target with CUDA graphs (one block more: the padding block leaves the pool) */
    {
        backend *dev2 = bk_cuda_create(&co, &err);
        model *mg = dev2 ? dt_model(dev2, 9) : NULL;
        spec_proposer *sp = NULL;
        eagle3_opts eo = {.n_blocks = 16, .max_rows = MAXT, .max_seqs = 4};
        int32_t layers[8] = {0}, n_aux = 0;
        if (mg && eagle3_load(dir, mg, &eo, &sp, &err) == 0) {
            n_aux = sp->ops->aux_layers(sp->ctx, layers);
            eagle3_destroy(sp);
        }
        EXPECT(mg && n_aux == 3, "graph target: %s", err.msg);
        static const int32_t buckets[] = {1, 2};
        for (int32_t k = 1; mg && n_aux == 3 && k <= 4; k += 3) {
            const int32_t q[2] = {1, k + 1};
            model_graphs_release(mg);
            model_graph_opts go = {.buckets = buckets, .n_buckets = 2, .q = q, .n_q = 2, .n_aux = 3,
                                   .aux_layers = layers, .max_step_tokens = MAXT, .max_seqs = co.max_seqs,
                                   .max_tokens = MAXT};
            /* the second capture reuses the padding block the first one kept (the pool stays at 8 blocks) */
            if (model_graphs_capture(mg, &go, &err) < 0) { EXPECT(0, "capture: %s", err.msg); break; }
            EXPECT(model_kv_n_blocks(mg) == 8, "k=%d: the pool keeps 8 blocks (%d)", k, model_kv_n_blocks(mg));
            int32_t out_p[GEN] = {0}, out_s[GEN] = {0}, pr[GEN * 4] = {0};
            plain_greedy(mg, out_p);
            spec_greedy(mg, NULL, dir, k, out_s, pr);
            model_graph_stats st;
            model_graph_get_stats(mg, &st);
            EXPECT(!memcmp(out_p, ref, sizeof ref), "k=%d: plain greedy with graphs != plain greedy on the CPU", k);
            EXPECT(!memcmp(out_s, ref, sizeof ref), "k=%d: speculative greedy with graphs != plain greedy", k);
            EXPECT(st.replays >= GEN, "k=%d: %ld steps replayed (decode and verify steps fit)", k, st.replays);
            printf("k=%d, graphs on the device target: plain and speculative greedy == plain greedy on the CPU "
                   "(%ld steps replayed, %ld eager)\n", k, st.replays, st.eager);
        }
        model_destroy(mg);
        bk_cuda_destroy(dev2);
    }
    /* part 2 with the trained head shipped in draft/heads (real acceptance) and its hot vocabulary */
    char head[1024], map[1100];
    snprintf(head, sizeof head, "%s/draft/heads/smollm2-135m-eagle3", dt_src());
    snprintf(map, sizeof map, "%s/hot_vocab_4096", head);
    for (int with_map = 0; with_map < 2; with_map++)
        for (int32_t nseq = 1; nseq <= 4; nseq += 3)
            for (int32_t k = 1; k <= 5; k++) batch_compare(mc, md, head, with_map ? map : NULL, nseq, k, 0);
    /* part 4: the chain draft loop as CUDA graphs on the device head (eagle3_graphs_capture): the same drafts as
     * the eager CPU head, per-sequence k below the graph's (rows keep drafting, ignored), padded buckets (3 -> 4) */
    { /* refusals leave the proposer as it was: a CPU head (no graphs), k beyond the chain buffers' max_k */
        spec_proposer *pc = NULL, *pd = NULL;
        eagle3_opts o = {.n_blocks = 32, .max_rows = MAXT, .max_seqs = 4, .max_k = 8};
        static const int32_t b1[1] = {1};
        if (eagle3_load(head, mc, &o, &pc, &err) == 0 && eagle3_load(head, md, &o, &pd, &err) == 0) {
            const int32_t free0 = eagle3_kv_n_free(eagle3_proposer_head(pd));
            EXPECT(eagle3_graphs_capture(pc, &(eagle3_graph_opts){.buckets = b1, .n_buckets = 1, .k = 2}, &err) < 0 && strstr(err.msg, "no graphs"),
                   "a CPU head's chain graphs: refused (%s)", err.msg);
            EXPECT(eagle3_graphs_capture(pd, &(eagle3_graph_opts){.buckets = b1, .n_buckets = 1, .k = 9}, &err) < 0 && strstr(err.msg, "max_k"),
                   "k = 9 > max_k 8: refused (%s)", err.msg);
            EXPECT(eagle3_kv_n_free(eagle3_proposer_head(pd)) == free0 && eagle3_graph_replays(pd) == 0,
                   "a refused capture keeps no padding block");
            EXPECT(eagle3_graphs_capture(pd, &(eagle3_graph_opts){.buckets = b1, .n_buckets = 1, .k = 2}, &err) == 0 &&
                       eagle3_kv_n_free(eagle3_proposer_head(pd)) == free0 - 1,
                   "a capture holds one padding block: %s", err.msg);
            eagle3_graphs_release(pd);
            EXPECT(eagle3_kv_n_free(eagle3_proposer_head(pd)) == free0, "a release gives the padding block back");
        } else {
            EXPECT(0, "eagle3_load: %s", err.msg);
        }
        eagle3_destroy(pc), eagle3_destroy(pd);
    }
    /* graphs for every k in 1..5 at buckets 1 / 2 / 4: each propose of k_max = k (1..5) replays the k-step graph */
    for (int32_t nseq = 1; nseq <= 3; nseq++)
        for (int32_t k = 1; k <= 5; k++) batch_compare(mc, md, head, NULL, nseq, k, 5);
    batch_compare(mc, md, head, map, 4, 4, 5);
    len_classes(mc, md, head);
    near_end(mc, head);
    EXPECT(fake_violations == 0, "%d host pointers reached device ops", fake_violations);
    dt_rm_head(dir);
    model_destroy(mc), model_destroy(md);
    bk_cuda_destroy(dev), bk_cpu_destroy(cpu), bk_cpu_destroy(draft_cpu);
    printf(n_fail ? "FAILED: %d\n" : "OK\n", n_fail);
    return n_fail ? 1 : 0;
}
