/* model_hf_util.h: helpers shared by the model_hf tests: where the tiny HF
 * Llama checkpoints are (MODEL_HF_MINI_DIR, written by the model_hf_setup
 * fixture with tools/gen_llama_hf_mini.py), the transformers reference
 * (tests/fixtures/model_hf: ref.json + logits_<variant>.bin from
 * tools/gen_llama_hf_ref.py), loading on a CPU backend and one forward step
 * with a trivial block layout (sequence s owns blocks [s*MH_MAXB, (s+1)*MH_MAXB)).
 * A missing checkpoint (numpy unavailable) skips with exit 77. */
#ifndef SPECD_TESTS_MODEL_HF_UTIL_H
#define SPECD_TESTS_MODEL_HF_UTIL_H

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/model/model.h"

#define MH_MAXB 8 /* blocks per sequence: 128 tokens at block size 16 */
#define MH_BS 16
#define MH_NSEQ 8

static const char *const MH_VARIANTS[] = {"f32", "bf16", "sharded", "mistral"};
#define MH_NVAR 4

/* Directory MODEL_HF_MINI_DIR/NAME (static storage, 4 in rotation); skips if absent. */
static inline const char *mh_dir(const char *name) {
    static char buf[4][1024];
    static int k;
    const char *root = getenv("MODEL_HF_MINI_DIR");
    char *p = buf[k++ & 3];
    snprintf(p, sizeof buf[0], "%s/%s", root ? root : "(unset)", name);
    char cfg[1100];
    snprintf(cfg, sizeof cfg, "%s/config.json", p);
    struct stat st;
    if (!root || stat(cfg, &st) != 0) {
        printf("SKIP: tiny HF Llama not found at %s (the model_hf_setup test writes it; needs numpy)\n", p);
        exit(77);
    }
    return p;
}

static inline model *mh_load(backend *be, const char *dir) {
    model_load_opts o = {.block_size = MH_BS, .n_blocks = MH_MAXB * MH_NSEQ};
    model *m = NULL;
    specd_err err = {{0}};
    if (model_load(dir, be, &o, &m, &err) < 0) {
        fprintf(stderr, "model_load: %s\n", err.msg);
        exit(1);
    }
    return m;
}

static inline const int32_t *const *mh_block_tables(void) {
    static int32_t tables[MH_NSEQ][MH_MAXB];
    static const int32_t *ptrs[MH_NSEQ];
    for (int s = 0; s < MH_NSEQ; s++) {
        for (int i = 0; i < MH_MAXB; i++) tables[s][i] = s * MH_MAXB + i;
        ptrs[s] = tables[s];
    }
    return ptrs;
}

/* One step: token i is toks[i] at pos[i] of sequence seq[i]; logits of the
 * tokens out[0..n_out) go to lg [n_out, vocab]. Returns model_forward's status. */
static inline int mh_step(model *m, int n, const int32_t *toks, const int32_t *pos, const int32_t *seq, int n_out,
                          const int32_t *out, float *lg) {
    model_batch b = {.n_tokens = n, .tokens = toks, .pos = pos, .seq_of = seq, .n_seqs = MH_NSEQ,
                     .block_tables = mh_block_tables(), .n_out = n_out, .out_idx = out, .logits = lg};
    specd_err err = {{0}};
    int rc = model_forward(m, &b, &err);
    if (rc) fprintf(stderr, "model_forward: %s\n", err.msg);
    return rc;
}

static inline json_t *mh_ref(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/model_hf/ref.json", getenv("SPECD_SOURCE_DIR"));
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) {
        fprintf(stderr, "%s: %s\n", path, je.text);
        exit(1);
    }
    return root;
}

/* The reference logits of VARIANT: f32 [n_prompts, n_positions, vocab], malloc'd. */
static inline float *mh_ref_logits(const char *variant, size_t n_floats) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/model_hf/logits_%s.bin", getenv("SPECD_SOURCE_DIR"), variant);
    FILE *f = fopen(path, "rb");
    float *p = malloc(sizeof(float) * n_floats);
    if (!f || !p || fread(p, sizeof(float), n_floats, f) != n_floats || fgetc(f) != EOF) {
        fprintf(stderr, "%s: missing or not %zu floats\n", path, n_floats);
        exit(1);
    }
    fclose(f);
    return p;
}

/* Prompt P of ref.json as int32 [*n] (static storage). */
static inline const int32_t *mh_prompt(const json_t *ref, int p, int *n) {
    static int32_t buf[4][256];
    static int k;
    int32_t *o = buf[k++ & 3];
    const json_t *a = json_array_get(json_object_get(ref, "prompts"), (size_t)p);
    *n = (int)json_array_size(a);
    for (int i = 0; i < *n && i < 256; i++) o[i] = (int32_t)json_integer_value(json_array_get(a, (size_t)i));
    return o;
}

static inline int mh_argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

#endif
