/*
 * step_loop.c: a P-token prefill of each of S sequences, then N steps of T
 * tokens of each sequence (S = 1, T = 1: decode; S = 1, T = k+1:
 * verify-shaped; S = 8, T = 1: batch-8 decode), and nothing else: the program
 * to run under `perf stat`, `perf record` or valgrind's callgrind /
 * cachegrind when counting what one kind of step costs (subtract a run with
 * N = 0 for the load and the prefill). Every step rewrites the same KV slots
 * at positions P..P+T-1, so each costs the same. Prints the last step's
 * argmax (of the first sequence's last token) so the work cannot be
 * optimised away. A measuring tool, not a ctest test.
 *
 * Usage: step_loop MODEL.gguf THREADS P N T [S=1]   (1 <= S * T <= 64)
 */
#include <stdio.h>
#include <stdlib.h>

#include "engine/model/model.h"

int main(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "usage: %s MODEL.gguf THREADS P N T [S]\n", argv[0]); return 2; }
    const int P = atoi(argv[3]), N = atoi(argv[4]), T = atoi(argv[5]), S = argc > 6 ? atoi(argv[6]) : 1;
    if (P < 1 || N < 0 || T < 1 || S < 1 || S * T > 64) {
        fprintf(stderr, "need P >= 1, N >= 0, T >= 1, S >= 1, S * T <= 64\n");
        return 2;
    }
    backend *be = bk_cpu_create(atoi(argv[2]));
    const int per_seq = (P + T) / 16 + 2; /* KV blocks of one sequence */
    model_load_opts o = {.block_size = 16, .n_blocks = S * per_seq};
    model *m = NULL;
    specd_err err = {{0}};
    if (!be || model_load(argv[1], be, &o, &m, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    const int V = model_get_config(m)->vocab, L = P + T;
    /* the same tokens for every sequence: [P prompt | T step tokens] */
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)L), *pos = malloc(sizeof(int32_t) * (size_t)L);
    int32_t *seq = calloc((size_t)L, sizeof(int32_t)), *bt = malloc(sizeof(int32_t) * (size_t)o.n_blocks);
    int32_t *stok = malloc(sizeof(int32_t) * 64), *spos = malloc(sizeof(int32_t) * 64);
    int32_t *sseq = malloc(sizeof(int32_t) * 64), oi[64], last = P - 1;
    float *logits = malloc(sizeof(float) * (size_t)V * 64);
    const int32_t **bts = malloc(sizeof(int32_t *) * (size_t)S);
    if (!tok || !pos || !seq || !bt || !stok || !spos || !sseq || !logits || !bts) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (int i = 0; i < o.n_blocks; i++) bt[i] = i;
    for (int i = 0; i < L; i++) tok[i] = 100 + (i * 7919) % 40000, pos[i] = i;
    for (int i = 0; i < 64; i++) oi[i] = i;
    for (int s = 0; s < S; s++) { /* sequence s: its own blocks; prefilled one at a time */
        bts[s] = bt + s * per_seq;
        model_batch b = {.n_tokens = P, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = 1,
                         .block_tables = &bts[s], .n_out = 1, .out_idx = &last, .logits = logits};
        if (model_forward(m, &b, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    }
    for (int s = 0; s < S; s++)
        for (int t = 0; t < T; t++) stok[s * T + t] = tok[P + t], spos[s * T + t] = P + t, sseq[s * T + t] = s;
    model_batch st = {.n_tokens = S * T, .tokens = stok, .pos = spos, .seq_of = sseq, .n_seqs = S,
                      .block_tables = bts, .n_out = S * T, .out_idx = oi, .logits = logits};
    for (int i = 0; i < N; i++)
        if (model_forward(m, &st, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    int best = 0;
    for (int v = 1; v < V; v++) if (logits[(size_t)(T - 1) * V + v] > logits[(size_t)(T - 1) * V + best]) best = v;
    printf("argmax %d\n", best);
    model_destroy(m);
    bk_cpu_destroy(be);
    free(tok); free(pos); free(seq); free(bt); free(stok); free(spos); free(sseq); free(logits); free(bts);
    return 0;
}
