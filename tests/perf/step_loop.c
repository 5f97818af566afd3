/*
 * step_loop.c: a P-token prefill, then N steps of T tokens of the same
 * sequence (T = 1: decode; T = k+1: verify-shaped), and nothing else: the
 * program to run under `perf stat`, `perf record` or valgrind's callgrind /
 * cachegrind when counting what one kind of step costs (subtract a run with
 * N = 0 for the load and the prefill). Every step rewrites the same KV slots
 * at positions P..P+T-1, so each costs the same. Prints the last step's
 * argmax so the work cannot be optimised away. A measuring tool, not a
 * ctest test.
 *
 * Usage: step_loop MODEL.gguf THREADS P N T   (1 <= T <= 64)
 */
#include <stdio.h>
#include <stdlib.h>

#include "engine/model/model.h"

int main(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "usage: %s MODEL.gguf THREADS P N T\n", argv[0]); return 2; }
    const int P = atoi(argv[3]), N = atoi(argv[4]), T = atoi(argv[5]);
    if (P < 1 || N < 0 || T < 1 || T > 64) { fprintf(stderr, "need P >= 1, N >= 0, 1 <= T <= 64\n"); return 2; }
    backend *be = bk_cpu_create(atoi(argv[2]));
    model_load_opts o = {.block_size = 16, .n_blocks = (P + T) / 16 + 2};
    model *m = NULL;
    specd_err err = {{0}};
    if (!be || model_load(argv[1], be, &o, &m, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    const int V = model_get_config(m)->vocab, L = P + T;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)L), *pos = malloc(sizeof(int32_t) * (size_t)L);
    int32_t *seq = calloc((size_t)L, sizeof(int32_t)), *bt = malloc(sizeof(int32_t) * (size_t)o.n_blocks);
    int32_t oi[64], last = P - 1;
    float *logits = malloc(sizeof(float) * (size_t)V * 64);
    if (!tok || !pos || !seq || !bt || !logits) { fprintf(stderr, "out of memory\n"); return 1; }
    for (int i = 0; i < o.n_blocks; i++) bt[i] = i;
    for (int i = 0; i < L; i++) tok[i] = 100 + (i * 7919) % 40000, pos[i] = i;
    for (int i = 0; i < 64; i++) oi[i] = i;
    const int32_t *bts[1] = {bt};
    model_batch b = {.n_tokens = P, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = bts,
                     .n_out = 1, .out_idx = &last, .logits = logits};
    if (model_forward(m, &b, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    model_batch s = {.n_tokens = T, .tokens = tok + P, .pos = pos + P, .seq_of = seq, .n_seqs = 1,
                     .block_tables = bts, .n_out = T, .out_idx = oi, .logits = logits};
    for (int i = 0; i < N; i++)
        if (model_forward(m, &s, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    int best = 0;
    for (int v = 1; v < V; v++) if (logits[v] > logits[best]) best = v;
    printf("argmax %d\n", best);
    model_destroy(m);
    bk_cpu_destroy(be);
    free(tok); free(pos); free(seq); free(bt); free(logits);
    return 0;
}
