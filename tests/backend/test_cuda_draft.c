/*
 * test_cuda_draft.c (label model, no GPU): the EAGLE-3 head on a CPU backend
 * next to a target on the (fake) CUDA device, as the bundle wires it for
 * `--device cuda` with a draft (eagle3_opts.be): the head reads the target's
 * embedding / LM head through their host views (model_embed_weight /
 * model_lm_head_weight) and gets the aux features the target downloads each
 * step (llama_forward on a device backend). The loop is
 * tests/draft/test_draft_spec_loop.c's greedy speculative loop (prefill with
 * capture, propose k, verify k + 1 rows with capture, accept, bonus, extend).
 * Checked: 12 tokens of greedy speculative decoding at k = 1 and 4 equal
 * plain greedy decoding on the CPU target token for token, the proposals are
 * the ones a head on the CPU target makes (same head, same aux bits: the fake
 * device reproduces the CPU ops), and no host pointer reached a device op.
 * Needs the SmolLM2 GGUF and the venv's numpy (random head); skips (77)
 * without them.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "tests/backend/cuda_fake/cuda_runtime_api.h" /* first: renames the CUDA backend's entry points */
#include "draft/eagle3.h"
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

static int target(model *m, const int32_t *tokens, int32_t n, int32_t pos0, float *logits, const int32_t *aux_layers,
                  float *aux) {
    int32_t pos[MAXT], seq[MAXT] = {0}, out[MAXT];
    for (int32_t i = 0; i < n; i++) pos[i] = pos0 + i, out[i] = i;
    const int32_t *tables[1] = {g_table};
    model_batch b = {.n_tokens = n, .tokens = tokens, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = tables,
                     .n_out = n, .out_idx = out, .logits = logits, .n_aux = aux ? 3 : 0, .aux_layers = aux_layers, .aux = aux};
    specd_err err = {{0}};
    if (model_forward(m, &b, &err) < 0) { printf("FAIL forward: %s\n", err.msg); n_fail++; return -1; }
    return 0;
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
    eagle3_opts o = {.n_blocks = 16, .be = draft_be};
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

int main(void) {
    backend *cpu = bk_cpu_create(0), *draft_cpu = bk_cpu_create(0);
    specd_err err = {{0}};
    bk_cuda_opts co = {.device = 0, .arena_bytes = (size_t)512 << 20, .max_tokens = MAXT, .max_seqs = 4, .max_len = 1024,
                       .block_size = 16, .max_heads = 16, .max_head_dim = 128};
    backend *dev = bk_cuda_create(&co, &err);
    if (!cpu || !draft_cpu || !dev) { printf("FAIL backends: %s\n", err.msg); return 1; }
    model *mc = dt_model(cpu, 8), *md = dt_model(dev, 8);
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
        int32_t out_c[GEN] = {0}, out_d[GEN] = {0}, pr_c[GEN * 4] = {0}, pr_d[GEN * 4] = {0};
        spec_greedy(mc, NULL, dir, k, out_c, pr_c);      /* head on the CPU target's own backend */
        spec_greedy(md, draft_cpu, dir, k, out_d, pr_d); /* target on the device, head on its CPU backend */
        EXPECT(!memcmp(out_d, ref, sizeof ref), "k=%d: speculative output (device target) != plain greedy", k);
        EXPECT(!memcmp(out_c, ref, sizeof ref), "k=%d: speculative output (cpu target) != plain greedy", k);
        EXPECT(!memcmp(pr_c, pr_d, sizeof pr_c), "k=%d: the head proposed differently next to the device target", k);
        printf("k=%d: 12 tokens == plain greedy; proposals identical to the all-CPU run\n", k);
    }
    EXPECT(fake_violations == 0, "%d host pointers reached device ops", fake_violations);
    dt_rm_head(dir);
    model_destroy(mc), model_destroy(md);
    bk_cuda_destroy(dev), bk_cpu_destroy(cpu), bk_cpu_destroy(draft_cpu);
    printf(n_fail ? "FAILED: %d\n" : "OK\n", n_fail);
    return n_fail ? 1 : 0;
}
