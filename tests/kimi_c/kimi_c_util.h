/* kimi_c_util.h: helpers shared by the kimi_c tests: where the regenerated
 * miniatures are (KIMI_C_MINI_DIR, written by the kimi_c_mini_setup fixture,
 * tests/kimi_c/make_minis.py), loading one on a CPU backend, the reference
 * fixture JSON, and a forward pass over one sequence with a trivial block
 * layout (sequence s owns blocks [s*KC_MAXB, (s+1)*KC_MAXB)).
 * A missing miniature (numpy unavailable) skips with exit 77. */
#ifndef SPECD_TESTS_KIMI_C_UTIL_H
#define SPECD_TESTS_KIMI_C_UTIL_H

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/model/model.h"

#define KC_MAXB 8     /* blocks per sequence: 128 tokens at block size 16 */
#define KC_BS 16

/* Directory of the miniature in LAYOUT ("k25", "nomodel", "dsv3"); skips the test if absent. */
static inline const char *kc_mini_dir(const char *layout) {
    static char buf[4][1024];
    static int k;
    const char *root = getenv("KIMI_C_MINI_DIR");
    char *p = buf[k++ & 3];
    snprintf(p, sizeof buf[0], "%s/%s", root ? root : "(unset)", layout);
    char cfg[1100];
    snprintf(cfg, sizeof cfg, "%s/config.json", p);
    struct stat st;
    if (!root || stat(cfg, &st) != 0) {
        printf("SKIP: Kimi miniature not found at %s (the kimi_c_mini_setup test writes it; needs numpy)\n", p);
        exit(77);
    }
    return p;
}

static inline model *kc_load(backend *be, const char *dir, int n_seqs) {
    /* KIMI_C_LATENT_BF16=1: the MLA latent cache in bf16 (the *_bf16 ctest variants) */
    const char *b16 = getenv("KIMI_C_LATENT_BF16");
    model_load_opts o = {.block_size = KC_BS, .n_blocks = KC_MAXB * n_seqs,
                         .latent_bf16 = b16 && *b16 && strcmp(b16, "0") != 0};
    if (o.latent_bf16) fprintf(stderr, "kimi_c: latent cache in bf16 (KIMI_C_LATENT_BF16)\n");
    model *m = NULL;
    specd_err err = {{0}};
    if (model_load(dir, be, &o, &m, &err) < 0) {
        fprintf(stderr, "model_load: %s\n", err.msg);
        exit(1);
    }
    return m;
}

static inline const int32_t *kc_block_table(int s) {
    static int32_t tables[64][KC_MAXB];
    for (int i = 0; i < KC_MAXB; i++) tables[s][i] = s * KC_MAXB + i;
    return tables[s];
}

static inline json_t *kc_fixture(const char *file) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/kimi/%s", getenv("SPECD_SOURCE_DIR"), file);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) {
        fprintf(stderr, "%s: %s\n", path, je.text);
        exit(1);
    }
    return root;
}

/* When set (tests/kimi_c/test_tp.c), kc_run goes through this tensor-parallel
 * runner (rank 0 posts the batch to the worker ranks, then runs its shard). */
static void *kc_tp_runner;
int tp_runner_forward(void *ctx, const model_batch *b, specd_err *err); /* engine/runtime/tp.h */

/* Runs tokens ids[0..n) at positions p0.. of sequence s in one step; logits
 * (may be NULL) get all n rows [n, V]; aux/n_aux/aux_layers optional. */
static inline int kc_run(model *m, int s, const int32_t *ids, int n, int p0, float *logits, float *final_hidden,
                         int n_aux, const int32_t *aux_layers, float *aux) {
    int32_t *pos = malloc(sizeof(int32_t) * n), *seq = malloc(sizeof(int32_t) * n), *oi = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) { pos[i] = p0 + i; seq[i] = s; oi[i] = i; }
    const int32_t *bt[64];
    for (int i = 0; i <= s; i++) bt[i] = kc_block_table(i);
    model_batch b = {.n_tokens = n, .tokens = ids, .pos = pos, .seq_of = seq, .n_seqs = s + 1, .block_tables = bt,
                     .n_out = n, .out_idx = oi, .logits = logits, .final_hidden = final_hidden,
                     .n_aux = n_aux, .aux_layers = aux_layers, .aux = aux};
    specd_err err = {{0}};
    int rc = kc_tp_runner ? tp_runner_forward(kc_tp_runner, &b, &err) : model_forward(m, &b, &err);
    if (rc < 0) fprintf(stderr, "model_forward: %s\n", err.msg);
    free(pos); free(seq); free(oi);
    return rc;
}

static inline int kc_argmax(const float *v, int n) {
    int b = 0;
    for (int i = 1; i < n; i++) if (v[i] > v[b]) b = i;
    return b;
}

static inline int32_t *kc_ids(const json_t *arr, int *n) {
    *n = (int)json_array_size(arr);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(*n + 64));
    for (int i = 0; i < *n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    return ids;
}

#endif
