/*
 * test_batch_invariance.c: a sequence's logits are BIT-identical whatever else
 * is in the batch, wherever it sits, however many threads run, and whether its
 * tokens come one per step or all at once (the property that makes speculative
 * greedy output equal plain greedy output; backend.h). The backends use the
 * best kernel level the CPU has; on an AVX-512 machine the logits must also
 * equal those of the AVX2 kernels bit for bit (skipped elsewhere, saying so).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "tests/model/model_test_util.h"

#define NA 21            /* tokens of the sequence under test (A) */
#define NSEQ 9           /* A + up to 8 others */

static model *g_m2, *g_m1;    /* same GGUF on a 2-thread and a 1-thread backend */
static backend *g_b2, *g_b1;
static int V;

static int32_t tok_of(int s, int p) { return (int32_t)((s * 7919 + p * 104729 + 13) % 49000) + 100; }

/* Runs one step over the listed (seq, pos) tokens; copies A's logits (seq 0) into outA[pos]. */
static void step(model *m, int n, const int *seqs, const int *poss, float *outA) {
    int32_t tok[256], pos[256], seq[256], oi[256];
    int no = 0;
    for (int i = 0; i < n; i++) {
        tok[i] = tok_of(seqs[i], poss[i]); pos[i] = poss[i]; seq[i] = seqs[i];
        if (seqs[i] == 0) oi[no++] = i;
    }
    const int32_t *bt[NSEQ];
    for (int s = 0; s < NSEQ; s++) bt[s] = mt_block_table(s);
    float *lg = malloc(sizeof(float) * (size_t)(no ? no : 1) * V);
    model_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = NSEQ, .block_tables = bt,
                     .n_out = no, .out_idx = oi, .logits = lg};
    specd_err err = {{0}};
    assert_int_equal(model_forward(m, &b, &err), 0);
    for (int k = 0; k < no; k++) memcpy(outA + (size_t)poss[oi[k]] * V, lg + (size_t)k * V, sizeof(float) * V);
    free(lg);
}

static void prefill_all(model *m, int s, int len, float *outA) {
    int seqs[128], poss[128];
    for (int i = 0; i < len; i++) { seqs[i] = s; poss[i] = i; }
    step(m, len, seqs, poss, outA);
}

static float *ref_logits(void) {
    static float *ref;
    if (!ref) {
        ref = malloc(sizeof(float) * NA * V);
        prefill_all(g_m2, 0, NA, ref);
        for (size_t i = 0; i < (size_t)NA * V; i++) /* bit-equality of NaNs would prove nothing */
            if (!isfinite(ref[i])) fail_msg("reference logit %zu is not finite", i);
    }
    return ref;
}

static void assert_rows_equal(const float *a, const float *b, int from, int to, const char *what) {
    for (int p = from; p < to; p++)
        if (memcmp(a + (size_t)p * V, b + (size_t)p * V, sizeof(float) * V) != 0) {
            fprintf(stderr, "%s: logits at position %d differ\n", what, p);
            fail();
        }
}

static void test_one_by_one_equals_prefill(void **st) {
    (void)st;
    float *got = malloc(sizeof(float) * NA * V);
    for (int p = 0; p < NA; p++) { int s = 0; step(g_m2, 1, &s, &p, got); }
    assert_rows_equal(ref_logits(), got, 0, NA, "one-by-one vs prefill");
    /* chunked prefill: 5 + 9 + 7 */
    int seqs[16] = {0}, poss[16];
    for (int c0 = 0, c; c0 < NA; c0 += c) {
        c = c0 == 0 ? 5 : c0 == 5 ? 9 : NA - c0;
        for (int i = 0; i < c; i++) poss[i] = c0 + i;
        step(g_m2, c, seqs, poss, got);
    }
    assert_rows_equal(ref_logits(), got, 0, NA, "chunked prefill vs prefill");
    free(got);
}

static void test_threads(void **st) {
    (void)st;
    float *got = malloc(sizeof(float) * NA * V);
    prefill_all(g_m1, 0, NA, got);
    assert_rows_equal(ref_logits(), got, 0, NA, "1 thread vs 2 threads");
    free(got);
}

static void test_batches(void **st) {
    (void)st;
    float *got = malloc(sizeof(float) * NA * V), *junk = malloc(sizeof(float) * NA * V);
    for (int B = 2; B <= 8; B++) {
        /* others 1..B-1 get prompts of different lengths, prefilled alone */
        for (int s = 1; s < B; s++) prefill_all(g_m2, s, 3 + 5 * s, junk);
        /* (a) A's whole prompt as a prefill chunk, at a varying place among decode tokens of the others */
        int seqs[128], poss[128], n = 0, at = B % (B - 1 + 1);
        for (int s = 1; s < B; s++) {
            if (n == at) for (int i = 0; i < NA; i++) { seqs[n] = 0; poss[n++] = i; }
            seqs[n] = s; poss[n++] = 3 + 5 * s;
        }
        if (at >= n) for (int i = 0; i < NA; i++) { seqs[n] = 0; poss[n++] = i; }
        step(g_m2, n, seqs, poss, got);
        assert_rows_equal(ref_logits(), got, 0, NA, "A prefilled inside a batch");
        /* (b) A decodes its last token while the others run prefill chunks for new positions */
        n = 0;
        for (int s = B - 1; s >= 1; s--) {
            for (int i = 0; i < 3; i++) { seqs[n] = s; poss[n++] = 4 + 5 * s + i; }
            if (s == (B + 1) / 2) { seqs[n] = 0; poss[n++] = NA - 1; }
        }
        step(g_m2, n, seqs, poss, got);
        assert_rows_equal(ref_logits(), got, NA - 1, NA, "A decoding inside a batch");
    }
    free(got);
    free(junk);
}

static void test_avx512_equals_avx2(void **st) {
    (void)st;
    if (!strstr(bk_cpu_describe(g_b2), "avx512")) {
        print_message("backend is %s: no AVX-512 here, the AVX-512 == AVX2 model check is not run\n",
                      bk_cpu_describe(g_b2));
        skip();
    }
    setenv("SPECD_CPU_ISA", "avx2", 1);
    backend *b = bk_cpu_create(2);
    unsetenv("SPECD_CPU_ISA");
    assert_non_null(b);
    assert_null(strstr(bk_cpu_describe(b), "avx512"));
    model *m = mt_load(b, NSEQ);
    float *got = malloc(sizeof(float) * NA * V);
    prefill_all(m, 0, NA, got);
    assert_rows_equal(ref_logits(), got, 0, NA, "AVX2 vs AVX-512 kernels (prefill)");
    for (int p = 0; p < NA; p++) { int s = 0; step(m, 1, &s, &p, got); }
    assert_rows_equal(ref_logits(), got, 0, NA, "AVX2 vs AVX-512 kernels (decode)");
    free(got);
    model_destroy(m);
    bk_cpu_destroy(b);
}

int main(void) {
    g_b2 = bk_cpu_create(2);
    g_b1 = bk_cpu_create(1);
    g_m2 = mt_load(g_b2, NSEQ);
    g_m1 = mt_load(g_b1, NSEQ);
    V = model_get_config(g_m2)->vocab;
    printf("backend: %s\n", bk_cpu_describe(g_b2));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_by_one_equals_prefill),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_batches),
        cmocka_unit_test(test_avx512_equals_avx2),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    model_destroy(g_m1); model_destroy(g_m2);
    bk_cpu_destroy(g_b1); bk_cpu_destroy(g_b2);
    return rc;
}
