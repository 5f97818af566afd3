/*
 * test_batch_invariance.c (model_hf_batch_invariance): on every tiny HF
 * Llama variant, the logits of one sequence are BIT-identical whether its 33
 * tokens come all at once (prefill), one per step (decode), in two chunks,
 * mixed into a batch with two other sequences (placed before and after it),
 * or on a 1-thread instead of a 2-thread backend (backend.h, BATCH INVARIANCE).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "tests/model_hf/model_hf_util.h"

static backend *g_b1, *g_b2;

/* Sequence SEQ's tokens [from, to) of TOKS in one step; logits of each into out[pos]. */
static void run_chunk(model *m, const int32_t *toks, int from, int to, int32_t seq, float *out, int V) {
    int32_t pos[256], sq[256], oi[256];
    const int n = to - from;
    for (int i = 0; i < n; i++) { pos[i] = from + i; sq[i] = seq; oi[i] = i; }
    float *lg = malloc(sizeof(float) * (size_t)n * V);
    assert_int_equal(mh_step(m, n, toks + from, pos, sq, n, oi, lg), 0);
    memcpy(out + (size_t)from * V, lg, sizeof(float) * (size_t)n * V);
    free(lg);
}

static void check_variant(const char *name) {
    json_t *ref = mh_ref();
    const int V = (int)json_integer_value(json_object_get(ref, "vocab"));
    int na, nb, nc;
    const int32_t *A = mh_prompt(ref, 2, &na), *B = mh_prompt(ref, 0, &nb), *C = mh_prompt(ref, 1, &nc);
    model *m2 = mh_load(g_b2, mh_dir(name)), *m1 = mh_load(g_b1, mh_dir(name));
    const size_t bytes = sizeof(float) * (size_t)na * V;
    float *all = malloc(bytes), *got = malloc(bytes);
    run_chunk(m2, A, 0, na, 0, all, V);                              /* prefill all at once */
    for (int p = 0; p < na; p++) run_chunk(m2, A, p, p + 1, 0, got, V); /* one by one */
    assert_memory_equal(all, got, bytes);
    run_chunk(m2, A, 0, 10, 0, got, V);                              /* two chunks */
    run_chunk(m2, A, 10, na, 0, got, V);
    assert_memory_equal(all, got, bytes);
    run_chunk(m1, A, 0, na, 0, got, V);                              /* 1 thread */
    assert_memory_equal(all, got, bytes);
    /* in a batch: B (seq 1) then A (seq 5) then C (seq 2), all prefilling together */
    int32_t tk[256], ps[256], sq[256], oi[256];
    int n = 0, no = 0;
    for (int i = 0; i < nb; i++) { tk[n] = B[i]; ps[n] = i; sq[n++] = 1; }
    for (int i = 0; i < na; i++) { oi[no++] = n; tk[n] = A[i]; ps[n] = i; sq[n++] = 5; }
    for (int i = 0; i < nc; i++) { tk[n] = C[i]; ps[n] = i; sq[n++] = 2; }
    assert_int_equal(mh_step(m2, n, tk, ps, sq, no, oi, got), 0);
    assert_memory_equal(all, got, bytes);
    printf("%-8s %d tokens: prefill == one-by-one == 2 chunks == 1 thread == in a batch of 3 (bit-identical)\n", name,
           na);
    free(all);
    free(got);
    model_destroy(m1);
    model_destroy(m2);
    json_decref(ref);
}

static void test_all(void **s) {
    (void)s;
    for (int i = 0; i < MH_NVAR; i++) check_variant(MH_VARIANTS[i]);
}

int main(void) {
    mh_dir("f32");
    g_b1 = bk_cpu_create(1);
    g_b2 = bk_cpu_create(2);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_all)};
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    bk_cpu_destroy(g_b1);
    bk_cpu_destroy(g_b2);
    return rc;
}
