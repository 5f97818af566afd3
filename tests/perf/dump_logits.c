/*
 * dump_logits.c: writes the raw f32 logits of one P-token pass (logits at
 * every position) to stdout, for byte-for-byte comparisons of two builds'
 * kernels (e.g. `cmp <(old/dump_logits M 2 11) <(new/dump_logits M 2 11)`).
 * A measuring tool, not a ctest test.
 *
 * Usage: dump_logits MODEL.gguf THREADS P   (1 <= P <= 256)
 */
#include <stdio.h>
#include <stdlib.h>

#include "engine/model/model.h"

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s MODEL.gguf THREADS P\n", argv[0]); return 2; }
    const int P = atoi(argv[3]);
    if (P < 1 || P > 256) { fprintf(stderr, "P must be in 1..256\n"); return 2; }
    backend *be = bk_cpu_create(atoi(argv[2]));
    model_load_opts o = {.block_size = 16, .n_blocks = 20};
    model *m = NULL;
    specd_err err = {{0}};
    if (!be || model_load(argv[1], be, &o, &m, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    const int V = model_get_config(m)->vocab;
    int32_t tok[256], pos[256], seq[256] = {0}, bt[20], oi[256];
    for (int i = 0; i < 20; i++) bt[i] = i;
    for (int i = 0; i < P; i++) tok[i] = 100 + (i * 7919) % 40000, pos[i] = i, oi[i] = i;
    const int32_t *bts[1] = {bt};
    float *lg = malloc(sizeof(float) * (size_t)V * (size_t)P);
    model_batch b = {.n_tokens = P, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = bts,
                     .n_out = P, .out_idx = oi, .logits = lg};
    if (!lg || model_forward(m, &b, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    fwrite(lg, sizeof(float), (size_t)V * (size_t)P, stdout);
    free(lg);
    model_destroy(m);
    bk_cpu_destroy(be);
    return 0;
}
