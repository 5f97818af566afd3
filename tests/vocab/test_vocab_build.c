/*
 * test_vocab_build.c: the draft-vocabulary selection rule on hand-computed
 * examples (ties, forced ids, fill, avoided fill ids), the offsets, the
 * refusals, and round trips through .npy and safetensors back through the
 * loader and draft/eagle3_vocab.
 *
 * Hand computation of the main example (V = 12, N = 5, forced {9}):
 *   freq   = [0, 5, 3, 5, 0, 1, 7, 3, 0, 0, 2, 0]   (sum 26)
 *   ranked by (count desc, id asc): 6(7) 1(5) 3(5) 2(3) 7(3) 10(2) 5(1)
 *   4 slots after the forced id: 6, 1, 3, then the tie 2 vs 7 -> 2 (lower id)
 *   used = [1, 2, 3, 6, 9], d2t = used - arange(5) = [1, 1, 1, 3, 5]
 *   covered = 5 + 3 + 5 + 7 + 0 = 20 of 26; id 9 would not be kept by
 *   frequency alone (top 5 by frequency: 6 1 3 2 7) -> 1 forced extra.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vocab/npy.h"
#include "vocab/vocab_map.h"

static char tmpdir[256];

static int setup(void **s) {
    (void)s;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/specd_vocab_build_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **s) {
    (void)s;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

static void test_ties_and_forced(void **s) {
    (void)s;
    const int64_t freq[12] = {0, 5, 3, 5, 0, 1, 7, 3, 0, 0, 2, 0};
    const int64_t forced[2] = {9, 9}; /* duplicates count once */
    vocab_map m;
    vocab_build_report r;
    specd_err err = {0};
    assert_int_equal(vocab_build(freq, 12, 5, forced, 2, NULL, &m, &r, &err), 0);
    const int64_t used[5] = {1, 2, 3, 6, 9}, d2t[5] = {1, 1, 1, 3, 5};
    assert_memory_equal(m.used, used, sizeof used);
    assert_memory_equal(m.d2t, d2t, sizeof d2t);
    for (int64_t i = 0; i < 12; i++) assert_int_equal(m.t2d[i], i == 1 || i == 2 || i == 3 || i == 6 || i == 9);
    assert_int_equal(r.total_count, 26);
    assert_int_equal(r.covered_count, 20);
    assert_int_equal(r.n_seen, 7);
    assert_int_equal(r.n_seen_kept, 4);
    assert_int_equal(r.n_forced, 1);
    assert_int_equal(r.n_forced_extra, 1);
    assert_int_equal(r.n_filled, 0);
    assert_int_equal(r.min_kept_count, 3);
    assert_int_equal(r.lowest_id, 1);
    assert_int_equal(r.highest_id, 9);
    vocab_map_free(&m);
    /* without the forced id the tie 2 vs 7 is inside the cut: both kept */
    assert_int_equal(vocab_build(freq, 12, 5, NULL, 0, NULL, &m, &r, &err), 0);
    const int64_t used2[5] = {1, 2, 3, 6, 7};
    assert_memory_equal(m.used, used2, sizeof used2);
    assert_int_equal(r.covered_count, 23);
    vocab_map_free(&m);
    /* N = 2: tie between 1 and 3 (count 5) after 6 -> 1 */
    assert_int_equal(vocab_build(freq, 12, 2, NULL, 0, NULL, &m, &r, &err), 0);
    assert_int_equal(m.used[0], 1);
    assert_int_equal(m.used[1], 6);
    assert_int_equal(m.d2t[0], 1);
    assert_int_equal(m.d2t[1], 5);
    vocab_map_free(&m);
}

static void test_fill(void **s) {
    (void)s;
    /* V = 10, N = 6, forced {7}; seen 2(4), 4(1); 3 slots left to fill */
    const int64_t freq[10] = {0, 0, 4, 0, 1, 0, 0, 0, 0, 0};
    const int64_t forced[1] = {7};
    uint8_t avoid[10] = {1, 0, 0, 0, 0, 0, 0, 0, 0, 0}; /* id 0 is "special" */
    vocab_map m;
    vocab_build_report r;
    specd_err err = {0};
    assert_int_equal(vocab_build(freq, 10, 6, forced, 1, NULL, &m, &r, &err), 0);
    const int64_t u1[6] = {0, 1, 2, 3, 4, 7}, d1[6] = {0, 0, 0, 0, 0, 2};
    assert_memory_equal(m.used, u1, sizeof u1);
    assert_memory_equal(m.d2t, d1, sizeof d1);
    assert_int_equal(r.n_filled, 3);
    assert_int_equal(r.fill_first, 0);
    assert_int_equal(r.fill_last, 3);
    assert_int_equal(r.covered_count, 5);
    vocab_map_free(&m);
    assert_int_equal(vocab_build(freq, 10, 6, forced, 1, avoid, &m, &r, &err), 0);
    const int64_t u2[6] = {1, 2, 3, 4, 5, 7}, d2[6] = {1, 1, 1, 1, 1, 2};
    assert_memory_equal(m.used, u2, sizeof u2);
    assert_memory_equal(m.d2t, d2, sizeof d2);
    assert_int_equal(r.fill_first, 1);
    assert_int_equal(r.fill_last, 5);
    vocab_map_free(&m);
    /* avoided ids are taken last when nothing else is left: V 5, N 4, avoid {0, 1} */
    const int64_t f3[5] = {0, 0, 0, 0, 9};
    uint8_t av3[5] = {1, 1, 0, 0, 0};
    assert_int_equal(vocab_build(f3, 5, 4, NULL, 0, av3, &m, &r, &err), 0);
    const int64_t u3[4] = {0, 2, 3, 4};
    assert_memory_equal(m.used, u3, sizeof u3);
    assert_int_equal(r.n_filled, 3);
    vocab_map_free(&m);
    /* nothing seen at all: the lowest ids */
    const int64_t zero[6] = {0};
    assert_int_equal(vocab_build(zero, 6, 3, NULL, 0, NULL, &m, &r, &err), 0);
    assert_int_equal(m.used[0] + m.used[1] + m.used[2], 0 + 1 + 2);
    assert_int_equal(r.total_count, 0);
    vocab_map_free(&m);
}

static void test_refusals(void **s) {
    (void)s;
    const int64_t freq[6] = {1, 2, 3, 4, 5, 6};
    const int64_t neg[6] = {1, 2, -3, 4, 5, 6};
    vocab_map m;
    specd_err err = {0};
    assert_int_equal(vocab_build(freq, 6, 0, NULL, 0, NULL, &m, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "at least 1"));
    assert_int_equal(vocab_build(freq, 6, 6, NULL, 0, NULL, &m, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "must be smaller than the target vocab size 6"));
    assert_int_equal(vocab_build(freq, 6, 7, NULL, 0, NULL, &m, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "must be smaller"));
    assert_int_equal(vocab_build(neg, 6, 3, NULL, 0, NULL, &m, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "negative count -3 at id 2"));
    const int64_t out_of_range[1] = {6};
    assert_int_equal(vocab_build(freq, 6, 3, out_of_range, 1, NULL, &m, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "always-include id 6 is outside"));
    const int64_t many[3] = {0, 1, 2};
    assert_int_equal(vocab_build(freq, 6, 2, many, 3, NULL, &m, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "3 distinct always-include ids do not fit"));
    assert_null(m.used);
}

static void path(char *buf, size_t n, const char *name) { snprintf(buf, n, "%s/%s", tmpdir, name); }

static void test_freq_load_refusals(void **s) {
    (void)s;
    char p[512];
    specd_err err = {0};
    int64_t *f = NULL, n = 0;
    const int64_t good[4] = {3, 0, 2, 1}, neg[4] = {3, 0, -2, 1};
    path(p, sizeof p, "good.npy");
    assert_int_equal(npy_write_vec(p, "<i8", good, 4, &err), 0);
    assert_int_equal(vocab_freq_load(p, 4, &f, &n, &err), 0);
    assert_int_equal(n, 4);
    assert_memory_equal(f, good, sizeof good);
    free(f);
    assert_int_equal(vocab_freq_load(p, 5, &f, &n, &err), -1);
    assert_non_null(strstr(err.msg, "has 4 entries, the target vocab has 5"));
    path(p, sizeof p, "neg.npy");
    assert_int_equal(npy_write_vec(p, "<i8", neg, 4, &err), 0);
    assert_int_equal(vocab_freq_load(p, 0, &f, &n, &err), -1);
    assert_non_null(strstr(err.msg, "negative count -2 at id 2"));
    /* wrong dtypes: float64, int32 and bool vectors */
    const double fd[4] = {1, 2, 3, 4};
    path(p, sizeof p, "f8.npy");
    assert_int_equal(npy_write_vec(p, "<f8", fd, 4, &err), 0);
    assert_int_equal(vocab_freq_load(p, 4, &f, &n, &err), -1);
    assert_non_null(strstr(err.msg, "must be int64 ('<i8'), the file holds dtype '<f8'"));
    const int32_t i4[4] = {1, 2, 3, 4};
    path(p, sizeof p, "i4.npy");
    assert_int_equal(npy_write_vec(p, "<i4", i4, 4, &err), 0);
    assert_int_equal(vocab_freq_load(p, 4, &f, &n, &err), -1);
    assert_non_null(strstr(err.msg, "'<i4'"));
    path(p, sizeof p, "missing.npy");
    assert_int_equal(vocab_freq_load(p, 4, &f, &n, &err), -1);
}

static void test_round_trip(void **s) {
    (void)s;
    enum { V = 1000, N = 300 };
    int64_t *freq = calloc(V, sizeof *freq);
    for (int i = 0; i < V; i++) freq[i] = (i * 7919) % 13 == 0 ? 0 : (i * 31) % 97;
    const int64_t forced[2] = {998, 999};
    vocab_map m, back;
    specd_err err = {0};
    assert_int_equal(vocab_build(freq, V, N, forced, 2, NULL, &m, NULL, &err), 0);
    for (int64_t i = 0; i < N; i++) {
        assert_int_equal(m.used[i], i + m.d2t[i]);
        if (i) assert_true(m.used[i] > m.used[i - 1]);
    }
    char dir[512];
    path(dir, sizeof dir, "out/nested");
    assert_int_equal(vocab_map_write(dir, &m, &err), 0);
    const char *sources[3] = {"", "/vocab_map.safetensors", "/d2t.npy"};
    for (int k = 0; k < 3; k++) {
        char p[600];
        snprintf(p, sizeof p, "%s%s", dir, sources[k]);
        vocab_map_raw raw;
        assert_int_equal(vocab_map_load_raw(p, &raw, &err), 0);
        assert_int_equal(raw.n_d2t, N);
        assert_int_equal(raw.n_t2d, V);
        assert_int_equal(vocab_map_from_raw(&raw, -1, &back, &err), 0);
        assert_int_equal(back.n_draft, N);
        assert_int_equal(back.n_target, V);
        assert_memory_equal(back.d2t, m.d2t, sizeof(int64_t) * N);
        assert_memory_equal(back.used, m.used, sizeof(int64_t) * N);
        assert_memory_equal(back.t2d, m.t2d, V);
        vocab_map_free(&back);
        vocab_map_raw_free(&raw);
    }
    /* npy bytes: the documented header for int64 [300] */
    char p[600];
    snprintf(p, sizeof p, "%s/d2t.npy", dir);
    FILE *f = fopen(p, "rb");
    unsigned char head[128];
    assert_int_equal(fread(head, 1, 128, f), 128);
    fclose(f);
    assert_memory_equal(head, "\x93NUMPY\x01\x00\x76\x00", 10);
    assert_memory_equal(head + 10, "{'descr': '<i8', 'fortran_order': False, 'shape': (300,), }", 59);
    assert_int_equal(head[127], '\n');
    /* a d2t written as absolute ids is refused by the shared validator */
    for (int64_t i = 0; i < N; i++) m.d2t[i] = m.used[i];
    snprintf(p, sizeof p, "%s/abs.npy", dir);
    assert_int_equal(npy_write_vec(p, "<i8", m.d2t, N, &err), 0);
    vocab_map_raw raw;
    assert_int_equal(vocab_map_load_raw(p, &raw, &err), 0); /* with the sibling t2d.npy */
    assert_int_equal(vocab_map_from_raw(&raw, V, &back, &err), -1);
    assert_non_null(strstr(err.msg, "absolute ids"));
    vocab_map_raw_free(&raw);
    vocab_map_free(&m);
    free(freq);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ties_and_forced),    cmocka_unit_test(test_fill),
        cmocka_unit_test(test_refusals),           cmocka_unit_test_setup_teardown(test_freq_load_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_round_trip, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
