/*
 * bench_kimi_c.c: a measuring tool, not a test (kimi_c_bench).
 *   kimi_c_bench experts [iterations]   one Kimi-K2.5 routed expert projection
 *       [2048 x 7168] as packed int4 (BK_W_I4G32, group 32), as bf16 and as f32
 *       (the "dequantize at load" alternatives), T = 1 and 4 tokens: ms per
 *       matmul and weight GB/s; checks the three agree (same values).
 *   kimi_c_bench mini DIR [steps]       the miniature: prefill of 32 tokens and
 *       batch-1 decode steps (ms per step), absorbed and naive MLA.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#include "engine/backend/backend.h"
#include "engine/model/deepseek_v3.h"
#include "engine/model/model.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t rng = 88172645463325252ull;
static uint32_t next32(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static double time_mm(backend *be, const bk_weight *w, const float *x, int T, float *y, int it) {
    bk_matmul_f32(be, w, x, T, y); /* warm */
    double t0 = now();
    for (int i = 0; i < it; i++) bk_matmul_f32(be, w, x, T, y);
    return (now() - t0) / it;
}

static int bench_experts(int it) {
    const int64_t R = 2048, C = 7168;
    uint32_t *pk = malloc(sizeof(uint32_t) * R * C / 8);
    uint16_t *sc = malloc(sizeof(uint16_t) * R * C / 32), *b16 = malloc(sizeof(uint16_t) * R * C);
    float *f32 = malloc(sizeof(float) * R * C), *x = malloc(sizeof(float) * 4 * C), *y = malloc(sizeof(float) * 4 * R);
    float *y2 = malloc(sizeof(float) * 4 * R);
    for (int64_t i = 0; i < R * C / 8; i++) pk[i] = next32();
    for (int64_t i = 0; i < R * C / 32; i++) sc[i] = (uint16_t)(0x3c00 + (next32() & 0xff)); /* ~0.008..0.016 */
    for (int64_t i = 0; i < 4 * C; i++) x[i] = (float)((int)(next32() % 2001) - 1000) / 1000.0f;
    bk_weight wi = {.type = BK_W_I4G32, .rows = R, .cols = C, .data = pk, .row_bytes = (size_t)C / 2, .scales = sc};
    for (int64_t r = 0; r < R; r++) bk_weight_row_f32(&wi, r, f32 + r * C);
    for (int64_t i = 0; i < R * C; i++) { uint32_t b; memcpy(&b, &f32[i], 4); b16[i] = (uint16_t)(b >> 16); } /* exact: values are bf16 */
    bk_weight wb = {.type = BK_W_BF16, .rows = R, .cols = C, .data = b16, .row_bytes = (size_t)C * 2};
    bk_weight wf = {.type = BK_W_F32, .rows = R, .cols = C, .data = f32, .row_bytes = (size_t)C * 4};
    backend *be = bk_cpu_create(0);
    printf("%s; one expert projection [%lld x %lld]\n", bk_cpu_describe(be), (long long)R, (long long)C);
    const struct { const char *name; const bk_weight *w; double bytes; } F[] = {
        {"int4 packed (I4G32)", &wi, R * C / 2.0 + R * C / 32 * 2.0},
        {"bf16 (dequantized at load)", &wb, R * C * 2.0},
        {"f32 (dequantized at load)", &wf, R * C * 4.0},
    };
    for (int T = 1; T <= 4; T += 3) {
        bk_matmul_f32(be, &wf, x, T, y2);
        for (int k = 0; k < 3; k++) {
            double s = time_mm(be, F[k].w, x, T, y, it);
            double e = 0;
            for (int i = 0; i < T * R; i++) e = e > fabsf(y[i] - y2[i]) ? e : fabsf(y[i] - y2[i]);
            printf("  T=%d %-28s %8.3f ms  %6.2f GB/s of weights  (max |diff| vs f32 %.2g)\n", T, F[k].name, s * 1e3,
                   F[k].bytes / s / 1e9, e);
        }
    }
    bk_cpu_destroy(be);
    free(pk); free(sc); free(b16); free(f32); free(x); free(y); free(y2);
    return 0;
}

static int bench_mini(const char *dir, int steps) {
    backend *be = bk_cpu_create(0);
    model_load_opts o = {.block_size = 16, .n_blocks = 64};
    model *m = NULL;
    specd_err err = {{0}};
    if (model_load(dir, be, &o, &m, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
    const int V = model_get_config(m)->vocab;
    int32_t table[64];
    for (int i = 0; i < 64; i++) table[i] = i;
    const int32_t *bt[1] = {table};
    float *lg = malloc(sizeof(float) * V);
    printf("%s; miniature %s\n", bk_cpu_describe(be), dir);
    for (int form = 1; form >= 0; form--) {
        dsv3_set_mla_absorbed(m, form);
        int32_t tok[32], pos[32], seq[32] = {0}, last = 31;
        for (int i = 0; i < 32; i++) { tok[i] = 1000 + 37 * i; pos[i] = i; }
        model_batch b = {.n_tokens = 32, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = bt,
                         .n_out = 1, .out_idx = &last, .logits = lg};
        double t0 = now();
        if (model_forward(m, &b, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
        double tp = now() - t0;
        int32_t t1 = 0, p1;
        last = 0;
        t0 = now();
        for (int s = 0; s < steps; s++) {
            p1 = 32 + s;
            t1 = 500 + s;
            model_batch d = {.n_tokens = 1, .tokens = &t1, .pos = &p1, .seq_of = seq, .n_seqs = 1, .block_tables = bt,
                             .n_out = 1, .out_idx = &last, .logits = lg};
            if (model_forward(m, &d, &err) < 0) { fprintf(stderr, "%s\n", err.msg); return 1; }
        }
        double td = (now() - t0) / steps;
        printf("  %-8s MLA: prefill 32 tokens %.2f ms (%.0f tok/s), decode %.3f ms/step (%.0f tok/s)\n",
               form ? "absorbed" : "naive", tp * 1e3, 32 / tp, td * 1e3, 1 / td);
    }
    free(lg);
    model_destroy(m);
    bk_cpu_destroy(be);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "experts")) return bench_experts(argc > 2 ? atoi(argv[2]) : 5);
    if (argc >= 3 && !strcmp(argv[1], "mini")) return bench_mini(argv[2], argc > 3 ? atoi(argv[3]) : 50);
    fprintf(stderr, "usage: %s experts [iterations] | mini DIR [steps]\n", argv[0]);
    return 2;
}
