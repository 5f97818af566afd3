/* model_test_util.h: helpers shared by the model tests: load SmolLM2 (or skip
 * with exit 77 when the model is not installed) and run a forward pass with a
 * trivial block layout (sequence s owns blocks [s*MAXB, (s+1)*MAXB)). */
#ifndef SPECD_TESTS_MODEL_UTIL_H
#define SPECD_TESTS_MODEL_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/model.h"

#define MT_MAXB 8 /* blocks per sequence: 128 tokens at block size 16 */

static inline model *mt_load(backend *be, int n_seqs) {
    const char *p = getenv("SPECD_MODEL_GGUF");
    FILE *f = p ? fopen(p, "rb") : NULL;
    if (!f) {
        printf("SKIP: SmolLM2 GGUF not found at %s (run tools/setup.sh)\n", p ? p : "(SPECD_MODEL_GGUF unset)");
        exit(77);
    }
    fclose(f);
    model_load_opts o = {.block_size = 16, .n_blocks = MT_MAXB * n_seqs};
    model *m = NULL;
    specd_err err = {{0}};
    if (model_load(p, be, &o, &m, &err) < 0) {
        fprintf(stderr, "model_load: %s\n", err.msg);
        exit(1);
    }
    return m;
}

/* Block table of sequence s (static storage). */
static inline const int32_t *mt_block_table(int s) {
    static int32_t tables[64][MT_MAXB];
    for (int i = 0; i < MT_MAXB; i++) tables[s][i] = s * MT_MAXB + i;
    return tables[s];
}

#endif
