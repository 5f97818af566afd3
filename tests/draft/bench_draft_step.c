/*
 * bench_draft_step.c: cost of one EAGLE-3 proposal next to one target decode
 * step, batch 1, on the CPU backend (not a ctest test; a measuring tool).
 *
 *   draft_bench_step GGUF HEAD_DIR [q8_0] [iterations]
 *
 * Prints, per k = 1..5, the time of propose(k) after a 100-token prompt, and
 * the time of a 1-token target decode and of a (k+1)-token verify pass, as
 * process CPU time (less sensitive than wall time on a shared machine; with
 * OMP_NUM_THREADS=1 it is the single-core cost). c = draft step / decode is
 * the cost ratio of REFERENCE §3's speed-up estimate tau / (1 + k c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "draft/eagle3.h"

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s GGUF HEAD_DIR [q8_0] [iterations]\n", argv[0]);
        return 2;
    }
    const int q8 = argc > 3 && !strcmp(argv[3], "q8_0"), N = argc > 4 ? atoi(argv[4]) : 20;
    backend *be = bk_cpu_create(0);
    model *m = NULL;
    specd_err err = {{0}};
    model_load_opts mo = {.block_size = 16, .n_blocks = 16};
    if (model_load(argv[1], be, &mo, &m, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    const int32_t V = model_get_config(m)->vocab, H = model_get_config(m)->hidden;
    spec_proposer *sp = NULL;
    eagle3_opts eo = {.q8_0 = q8};
    if (eagle3_load(argv[2], m, &eo, &sp, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    int32_t table[16], tok[160], pos[160], seq[160] = {0}, out[8], layers[8];
    for (int i = 0; i < 16; i++) table[i] = i;
    for (int i = 0; i < 160; i++) tok[i] = 100 + 7 * i, pos[i] = i;
    const int32_t *tables[1] = {table};
    sp->ops->aux_layers(sp->ctx, layers);
    float *aux = malloc(sizeof(float) * 160 * 3 * (size_t)H), *lg = malloc(sizeof(float) * 8 * (size_t)V);
    model_batch pre = {.n_tokens = 100, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = tables,
                       .n_aux = 3, .aux_layers = layers, .aux = aux};
    if (model_forward(m, &pre, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    sp->ops->extend(sp->ctx, 1, tok, 100, 0, aux, &err);
    sp->ops->extend(sp->ctx, 1, tok + 100, 1, 100, NULL, &err);
    int32_t oi[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    double t0 = cpu_now();
    for (int i = 0; i < N; i++) {
        model_batch d = {.n_tokens = 1, .tokens = tok + 100, .pos = pos + 100, .seq_of = seq, .n_seqs = 1,
                         .block_tables = tables, .n_out = 1, .out_idx = oi, .logits = lg};
        model_forward(m, &d, &err);
    }
    const double dec = (cpu_now() - t0) / N;
    printf("head %s (%s): target decode %.2f ms/token (CPU time)\n", argv[2], q8 ? "Q8_0" : "as stored", dec * 1e3);
    int64_t id = 1;
    float temp = 0.0f;
    for (int32_t k = 1; k <= 5; k++) {
        t0 = cpu_now();
        for (int i = 0; i < N; i++) sp->ops->propose(sp->ctx, &id, &k, 1, 8, &temp, out, NULL, &err);
        const double pr = (cpu_now() - t0) / N;
        t0 = cpu_now();
        for (int i = 0; i < N; i++) {
            model_batch v = {.n_tokens = k + 1, .tokens = tok + 100, .pos = pos + 100, .seq_of = seq, .n_seqs = 1,
                             .block_tables = tables, .n_out = k + 1, .out_idx = oi, .logits = lg};
            model_forward(m, &v, &err);
        }
        const double ve = (cpu_now() - t0) / N;
        printf("k=%d: propose %.2f ms (%.2f ms/draft step, c = %.2f), verify %d tokens %.2f ms\n", k, pr * 1e3,
               pr * 1e3 / k, pr / k / dec, k + 1, ve * 1e3);
    }
    free(aux), free(lg);
    eagle3_destroy(sp);
    model_destroy(m);
    bk_cpu_destroy(be);
    return 0;
}
