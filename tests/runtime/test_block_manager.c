/*
 * test_block_manager.c: unit tests of the KV block manager (bookkeeping only):
 * allocation / free / refcounts, truncate (speculative rollback), prefix-cache
 * hits with the SHA-256 chain, LRU eviction order, and no leaks (kv_check after
 * every scenario: each block in exactly one state, refcounts equal to the
 * tables holding them).
 *
 * Block keys are compared with values computed by Python's hashlib
 * (independent SHA-256):
 *   key(parent, toks, salt) = sha256((parent or bytes(32)) + struct.pack('<I', len(salt))
 *                                    + salt + b''.join(struct.pack('<i', t) for t in toks))
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "engine/runtime/block_manager.h"

static void hex(const uint8_t *k, char *out) {
    for (int i = 0; i < KV_KEY_BYTES; i++) sprintf(out + 2 * i, "%02x", k[i]);
}

static void check_ok(const kv_block_manager *m, const kv_seq *const *live, size_t n) {
    specd_err err = {0};
    int rc = kv_check(m, live, n, &err);
    if (rc != 0) fail_msg("%s", err.msg);
}

static void test_key_matches_hashlib(void **st) {
    (void)st;
    uint8_t k1[32], k2[32], k3[32];
    char h[65];
    int32_t t1[4] = {1, 2, 3, 4}, t2[4] = {5, 6, 7, 8}, t3[4] = {-1, 49151, 0, 7};
    assert_int_equal(kv_block_key(NULL, t1, 4, NULL, 0, k1), 0);
    hex(k1, h);
    assert_string_equal(h, "1c322dd33278f40848ade6503b39cb75d1c817a262296ecf2922d6bf504b68f6");
    assert_int_equal(kv_block_key(k1, t2, 4, "abc", 3, k2), 0);
    hex(k2, h);
    assert_string_equal(h, "8571e0fe61aff7d94a2524351b8d0c09810a4174150c75ca40ec83eda24c6666");
    assert_int_equal(kv_block_key(NULL, t3, 4, "", 0, k3), 0);
    hex(k3, h);
    assert_string_equal(h, "2b27e325cecf086ef0b58c377be0a1db5525ce232ccc463b9a11aba7d667ac91");
}

static void test_alloc_free_truncate(void **st) {
    (void)st;
    kv_block_manager *m = NULL;
    specd_err err = {0};
    assert_int_equal(kv_create(8, 4, false, &m, &err), 0);
    assert_int_equal(kv_num_free(m), 8);
    assert_int_equal(kv_blocks_for(m, 0), 0);
    assert_int_equal(kv_blocks_for(m, 1), 1);
    assert_int_equal(kv_blocks_for(m, 4), 1);
    assert_int_equal(kv_blocks_for(m, 5), 2);

    kv_seq a, b;
    kv_seq_init(&a);
    kv_seq_init(&b);
    assert_int_equal(kv_seq_ensure(m, &a, 9, &err), 0); /* 3 blocks */
    assert_int_equal(a.n_blocks, 3);
    assert_int_equal(kv_num_free(m), 5);
    /* fresh pool hands out blocks in id order (queue head first) */
    assert_int_equal(a.blocks[0], 0);
    assert_int_equal(a.blocks[2], 2);
    assert_int_equal(kv_seq_ensure(m, &a, 12, &err), 0); /* still 3 */
    assert_int_equal(a.n_blocks, 3);
    assert_int_equal(kv_seq_blocks_needed(m, &a, 13), 1);

    /* all or nothing: 6 more blocks needed, 5 free */
    assert_int_equal(kv_seq_ensure(m, &b, 24, &err), -1);
    assert_non_null(strstr(err.msg, "need 6 blocks, 5 free"));
    assert_int_equal(b.n_blocks, 0);
    assert_int_equal(kv_num_free(m), 5);
    assert_int_equal(kv_seq_ensure(m, &b, 20, &err), 0);
    assert_int_equal(kv_num_free(m), 0);
    const kv_seq *live[2] = {&a, &b};
    check_ok(m, live, 2);

    /* speculative rollback: 20 -> 9 tokens keeps 3 blocks, 20 -> 8 keeps 2 */
    kv_seq_truncate(m, &b, 9);
    assert_int_equal(b.n_blocks, 3);
    assert_int_equal(kv_num_free(m), 2);
    kv_seq_truncate(m, &b, 8);
    assert_int_equal(b.n_blocks, 2);
    assert_int_equal(kv_num_free(m), 3);
    kv_seq_truncate(m, &b, 8); /* idempotent */
    assert_int_equal(kv_num_free(m), 3);
    check_ok(m, live, 2);

    kv_seq_free(m, &a);
    kv_seq_free(m, &b);
    assert_int_equal(kv_num_free(m), 8);
    check_ok(m, NULL, 0);
    assert_int_equal(kv_get_counters(m)->allocs, 3 + 5);
    assert_int_equal(kv_get_counters(m)->frees, 8);
    kv_destroy(m);
    kv_destroy(NULL);
}

static void test_prefix_hits_and_refcounts(void **st) {
    (void)st;
    kv_block_manager *m = NULL;
    specd_err err = {0};
    assert_int_equal(kv_create(16, 4, true, &m, &err), 0);
    int32_t toks[14] = {10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33, 40, 41};

    kv_seq a;
    kv_seq_init(&a);
    assert_int_equal(kv_seq_match_prefix(m, &a, toks, 14, NULL, 0), 0); /* empty cache */
    assert_int_equal(kv_seq_ensure(m, &a, 14, &err), 0);
    /* only full, committed blocks are keyed: 10 committed -> 2 blocks */
    kv_seq_commit(m, &a, toks, 10, NULL, 0);
    assert_int_equal(a.n_keyed, 2);
    kv_seq_commit(m, &a, toks, 14, NULL, 0);
    assert_int_equal(a.n_keyed, 3);
    assert_int_equal(kv_get_counters(m)->registered, 3);
    uint8_t k0[32];
    kv_block_key(NULL, toks, 4, NULL, 0, k0);

    /* same prompt: 3 full blocks cached but at most (14-1)/4 = 3 looked up */
    kv_seq b;
    kv_seq_init(&b);
    assert_int_equal(kv_seq_match_prefix(m, &b, toks, 14, NULL, 0), 12);
    assert_int_equal(b.n_blocks, 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(b.blocks[i], a.blocks[i]);
        assert_int_equal(kv_block_ref(m, a.blocks[i]), 2);
    }
    /* a block-aligned prompt of 12 tokens: the last block is recomputed */
    kv_seq c;
    kv_seq_init(&c);
    assert_int_equal(kv_seq_match_prefix(m, &c, toks, 12, NULL, 0), 8);
    /* a different salt shares nothing */
    kv_seq d;
    kv_seq_init(&d);
    assert_int_equal(kv_seq_match_prefix(m, &d, toks, 14, "tenant-b", 8), 0);
    /* diverging second block: only the first hits */
    int32_t other[9] = {10, 11, 12, 13, 20, 21, 22, 99, 1};
    kv_seq e;
    kv_seq_init(&e);
    assert_int_equal(kv_seq_match_prefix(m, &e, other, 9, NULL, 0), 4);
    assert_int_equal(kv_block_ref(m, a.blocks[0]), 4);
    const kv_seq *live[5] = {&a, &b, &c, &d, &e};
    check_ok(m, live, 5);
    const kv_counters *cnt = kv_get_counters(m);
    assert_int_equal(cnt->queries_tokens, 14 + 14 + 12 + 14 + 9);
    assert_int_equal(cnt->hits_tokens, 12 + 8 + 4);

    /* freeing everyone leaves the keyed blocks CACHED (free but reusable) */
    kv_seq_free(m, &a);
    kv_seq_free(m, &b);
    kv_seq_free(m, &c);
    kv_seq_free(m, &d);
    kv_seq_free(m, &e);
    assert_int_equal(kv_num_free(m), 16);
    assert_int_equal(kv_num_cached(m), 3);
    check_ok(m, NULL, 0);
    /* a hit on a CACHED block takes it out of the free queue */
    kv_seq f;
    kv_seq_init(&f);
    assert_int_equal(kv_seq_match_prefix(m, &f, toks, 14, NULL, 0), 12);
    assert_int_equal(kv_num_free(m), 13);
    assert_int_equal(kv_num_cached(m), 0);
    const kv_seq *live2[1] = {&f};
    check_ok(m, live2, 1);
    kv_seq_free(m, &f);
    check_ok(m, NULL, 0);
    kv_destroy(m);
}

static void test_duplicate_content_not_double_keyed(void **st) {
    (void)st;
    kv_block_manager *m = NULL;
    specd_err err = {0};
    assert_int_equal(kv_create(8, 2, true, &m, &err), 0);
    int32_t toks[5] = {1, 2, 3, 4, 5};
    kv_seq a, b;
    kv_seq_init(&a);
    kv_seq_init(&b);
    /* two sequences computed the same prefix concurrently (neither hit) */
    assert_int_equal(kv_seq_ensure(m, &a, 5, &err), 0);
    assert_int_equal(kv_seq_ensure(m, &b, 5, &err), 0);
    kv_seq_commit(m, &a, toks, 5, NULL, 0);
    kv_seq_commit(m, &b, toks, 5, NULL, 0);
    assert_int_equal(kv_get_counters(m)->registered, 2);
    assert_int_equal(b.n_keyed, 2); /* chain advanced even though b's blocks stay unkeyed */
    kv_seq_free(m, &b);
    assert_int_equal(kv_num_cached(m), 0); /* b's blocks were never keyed */
    kv_seq_free(m, &a);
    assert_int_equal(kv_num_cached(m), 2);
    check_ok(m, NULL, 0);
    kv_destroy(m);
}

static void test_lru_eviction(void **st) {
    (void)st;
    kv_block_manager *m = NULL;
    specd_err err = {0};
    assert_int_equal(kv_create(4, 2, true, &m, &err), 0);
    int32_t p1[3] = {1, 1, 9}, p2[3] = {2, 2, 9}, p3[3] = {3, 3, 9};
    kv_seq s1, s2, s3, t;
    kv_seq_init(&s1);
    kv_seq_init(&s2);
    kv_seq_init(&s3);
    kv_seq_init(&t);
    /* s1 and s2 fill 2 blocks each; only their first block is full and committed */
    assert_int_equal(kv_seq_ensure(m, &s1, 3, &err), 0);
    kv_seq_commit(m, &s1, p1, 2, NULL, 0);
    assert_int_equal(kv_seq_ensure(m, &s2, 3, &err), 0);
    kv_seq_commit(m, &s2, p2, 2, NULL, 0);
    int32_t s1_head = s1.blocks[0], s2_head = s2.blocks[0];
    kv_seq_free(m, &s1); /* queue: s1 tail, s1 head */
    kv_seq_free(m, &s2); /* queue: s1 tail, s1 head, s2 tail, s2 head */
    assert_int_equal(kv_num_cached(m), 2);
    /* a new sequence of 2 blocks takes the unkeyed s1 tail first, then evicts s1's head */
    assert_int_equal(kv_seq_ensure(m, &s3, 3, &err), 0);
    assert_int_equal(s3.blocks[1], s1_head);
    assert_int_equal(kv_get_counters(m)->evictions, 1);
    kv_seq_commit(m, &s3, p3, 2, NULL, 0);
    /* s1's prefix is gone, s2's survives */
    assert_int_equal(kv_seq_match_prefix(m, &t, p1, 3, NULL, 0), 0);
    assert_int_equal(kv_seq_match_prefix(m, &t, p2, 3, NULL, 0), 2);
    assert_int_equal(t.blocks[0], s2_head);
    const kv_seq *live[2] = {&s3, &t};
    check_ok(m, live, 2);
    kv_seq_free(m, &s3);
    kv_seq_free(m, &t);
    check_ok(m, NULL, 0);
    assert_int_equal(kv_num_free(m), 4);
    kv_destroy(m);
}

/* Random churn: many sequences grow, commit, truncate and free; the pool is
 * consistent after every operation and whole again at the end. */
static void test_random_churn_no_leak(void **st) {
    (void)st;
    kv_block_manager *m = NULL;
    specd_err err = {0};
    assert_int_equal(kv_create(64, 4, true, &m, &err), 0);
    enum { NS = 6, LEN = 60 };
    kv_seq s[NS];
    int32_t len[NS] = {0}, toks[NS][LEN];
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < NS; i++) {
        kv_seq_init(&s[i]);
        for (int j = 0; j < LEN; j++) toks[i][j] = (j < 16) ? j : i * 100 + j; /* shared 16-token prefix */
    }
    for (int it = 0; it < 3000; it++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int i = (int)(x % NS), op = (int)((x >> 8) % 4);
        if (op == 0 && len[i] == 0) {
            len[i] = kv_seq_match_prefix(m, &s[i], toks[i], 20, NULL, 0);
        } else if (op <= 1 && len[i] < LEN) {
            int32_t want = len[i] + 1 + (int32_t)((x >> 16) % 6);
            if (want > LEN) want = LEN;
            if (kv_seq_ensure(m, &s[i], want, &err) == 0) {
                len[i] = want;
                kv_seq_commit(m, &s[i], toks[i], len[i], NULL, 0);
            }
        } else if (op == 2 && len[i] > 0) {
            int32_t to = len[i] - (int32_t)((x >> 20) % 5);
            if (to < s[i].n_keyed * 4) to = s[i].n_keyed * 4; /* rollback never crosses committed blocks */
            kv_seq_truncate(m, &s[i], to);
            len[i] = to;
        } else if (op == 3) {
            kv_seq_free(m, &s[i]);
            len[i] = 0;
        }
        const kv_seq *live[NS];
        for (int k = 0; k < NS; k++) live[k] = &s[k];
        check_ok(m, live, NS);
    }
    for (int i = 0; i < NS; i++) kv_seq_free(m, &s[i]);
    check_ok(m, NULL, 0);
    assert_int_equal(kv_num_free(m), 64);
    assert_true(kv_get_counters(m)->hits_tokens > 0);
    kv_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_key_matches_hashlib),
        cmocka_unit_test(test_alloc_free_truncate),
        cmocka_unit_test(test_prefix_hits_and_refcounts),
        cmocka_unit_test(test_duplicate_content_not_double_keyed),
        cmocka_unit_test(test_lru_eviction),
        cmocka_unit_test(test_random_churn_no_leak),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
