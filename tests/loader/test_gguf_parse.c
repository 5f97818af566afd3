/*
 * test_gguf_parse.c: the GGUF reader on files built byte by byte here.
 *
 * A valid baseline (3 kvs including a string array, 2 tensors) must parse
 * with the values written; then each malformed variant (truncations,
 * overflowing counts and lengths, bad types, bad dims, bad offsets, overlaps,
 * duplicates, bad alignment) must be refused with -1, a NULL handle and a
 * non-empty message, without crashing (the suite also runs under ASan).
 * Expected values are the ones this file writes: the GGUF layout itself is
 * from the spec (ggml docs/gguf.md), not from specd's reader.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/loader/gguf.h"
#include "loader/loader_test_util.h"

/* ---------------------------------------------------------------- builder */

static void g_str(tbuf *b, const char *s) {
    tb_u64(b, strlen(s));
    tb_bytes(b, s, strlen(s));
}
static void g_hdr(tbuf *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    tb_bytes(b, "GGUF", 4);
    tb_u32(b, version);
    tb_u64(b, n_tensors);
    tb_u64(b, n_kv);
}
static void g_kv_str(tbuf *b, const char *k, const char *v) {
    g_str(b, k);
    tb_u32(b, GGUF_VT_STRING);
    g_str(b, v);
}
static void g_kv_u32(tbuf *b, const char *k, uint32_t v) {
    g_str(b, k);
    tb_u32(b, GGUF_VT_UINT32);
    tb_u32(b, v);
}
static void g_ti(tbuf *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type, uint64_t off) {
    g_str(b, name);
    tb_u32(b, n_dims);
    for (uint32_t i = 0; i < n_dims; i++) tb_u64(b, ne[i]);
    tb_u32(b, type);
    tb_u64(b, off);
}
static void g_pad(tbuf *b, size_t align) {
    while (b->n % align) tb_u8(b, 0);
}

/* Baseline: 3 kvs, t0 = Q8_0 [32, 2] at 0 (68 B), t1 = F32 [4] at 96 (16 B). */
static void build_valid(tbuf *b) {
    g_hdr(b, 3, 2, 3);
    g_kv_str(b, "general.architecture", "llama");
    g_kv_u32(b, "llama.block_count", 30);
    g_str(b, "tokenizer.ggml.tokens");
    tb_u32(b, GGUF_VT_ARRAY);
    tb_u32(b, GGUF_VT_STRING);
    tb_u64(b, 3);
    g_str(b, "a");
    g_str(b, "bc");
    g_str(b, "");
    uint64_t ne0[2] = {32, 2}, ne1[1] = {4};
    g_ti(b, "t0", 2, ne0, GGML_TYPE_Q8_0, 0);
    g_ti(b, "t1", 1, ne1, GGML_TYPE_F32, 96);
    g_pad(b, 32);
    for (int i = 0; i < 96; i++) tb_u8(b, (uint8_t)i);
    float v[4] = {1.5f, -2.0f, 0.25f, 8.0f};
    tb_bytes(b, v, sizeof v);
}

static void expect_reject(const void *p, size_t n, const char *needle) {
    gguf_file *f = (gguf_file *)(uintptr_t)1;
    specd_err err = {{0}};
    int rc = gguf_open_mem(p, n, &f, &err);
    if (rc != -1 || f != NULL || err.msg[0] == '\0')
        print_error("expected rejection (%s), got rc=%d msg='%s'\n", needle ? needle : "", rc, err.msg);
    assert_int_equal(rc, -1);
    assert_null(f);
    assert_true(err.msg[0] != '\0');
    if (needle && !strstr(err.msg, needle)) {
        print_error("message '%s' lacks '%s'\n", err.msg, needle);
        fail();
    }
}

/* ---------------------------------------------------------------- positive */

static void test_valid(void **state) {
    (void)state;
    tbuf b = {0};
    build_valid(&b);
    gguf_file *f = NULL;
    specd_err err = {{0}};
    assert_int_equal(gguf_open_mem(b.p, b.n, &f, &err), 0);
    assert_int_equal(gguf_version(f), 3);
    assert_int_equal(gguf_n_kv(f), 3);
    assert_int_equal(gguf_n_tensors(f), 2);
    assert_int_equal(gguf_alignment(f), 32);
    const char *s;
    size_t len;
    assert_int_equal(gguf_get_str(f, "general.architecture", &s, &len, &err), 0);
    assert_int_equal(len, 5);
    assert_memory_equal(s, "llama", 5);
    int64_t i64;
    assert_int_equal(gguf_get_i64(f, "llama.block_count", &i64, &err), 0);
    assert_int_equal(i64, 30);
    double d;
    assert_int_equal(gguf_get_f64(f, "llama.block_count", &d, &err), 0);
    assert_true(d == 30.0);
    assert_int_equal(gguf_get_i64(f, "missing.key", &i64, &err), -1);
    assert_non_null(strstr(err.msg, "missing.key"));
    assert_int_equal(gguf_get_str(f, "llama.block_count", &s, &len, &err), -1);
    bool bv;
    assert_int_equal(gguf_get_bool(f, "llama.block_count", &bv, &err), -1);
    const gguf_kv *kv = gguf_find_kv(f, "tokenizer.ggml.tokens");
    assert_non_null(kv);
    assert_int_equal(kv->type, GGUF_VT_ARRAY);
    assert_int_equal(kv->arr_type, GGUF_VT_STRING);
    assert_int_equal(kv->arr_len, 3);
    assert_int_equal(gguf_arr_str(kv, 1, &s, &len), 0);
    assert_int_equal(len, 2);
    assert_memory_equal(s, "bc", 2);
    assert_int_equal(gguf_arr_str(kv, 2, &s, &len), 0);
    assert_int_equal(len, 0);
    assert_int_equal(gguf_arr_str(kv, 0, &s, &len), 0);
    assert_int_equal(len, 1);
    assert_int_equal(s[0], 'a');
    assert_int_equal(gguf_arr_str(kv, 3, &s, &len), -1);
    assert_int_equal(gguf_arr_i64(kv, 0, &i64), -1);

    const gguf_tensor *t0 = gguf_find_tensor(f, "t0"), *t1 = gguf_find_tensor(f, "t1");
    assert_non_null(t0);
    assert_non_null(t1);
    assert_null(gguf_find_tensor(f, "t2"));
    assert_int_equal(t0->n_dims, 2);
    assert_int_equal(t0->ne[0], 32);
    assert_int_equal(t0->ne[1], 2);
    assert_int_equal(t0->ne[2], 1);
    assert_int_equal(t0->n_elements, 64);
    assert_int_equal(t0->nbytes, 68);
    assert_int_equal(t0->type, GGML_TYPE_Q8_0);
    size_t data_start = b.n - 112;
    assert_int_equal(gguf_data_offset(f), data_start);
    assert_ptr_equal(t0->data, b.p + data_start);
    assert_ptr_equal(t1->data, b.p + data_start + 96);
    assert_int_equal(t1->nbytes, 16);
    float out[4];
    assert_int_equal(ggml_dequantize(t1->type, t1->data, out, 4), 0);
    assert_true(out[0] == 1.5f && out[1] == -2.0f && out[2] == 0.25f && out[3] == 8.0f);
    assert_ptr_equal(gguf_tensor_at(f, 0), t0);
    assert_null(gguf_tensor_at(f, 2));
    assert_null(gguf_kv_at(f, 3));
    gguf_close(f);
    gguf_close(NULL);
    tb_free(&b);
}

static void test_v2_and_custom_alignment(void **state) {
    (void)state;
    tbuf b = {0};
    g_hdr(&b, 2, 1, 1);
    g_kv_u32(&b, "general.alignment", 64);
    uint64_t ne[1] = {8};
    g_ti(&b, "x", 1, ne, GGML_TYPE_F16, 64);
    g_pad(&b, 64);
    tb_zeros(&b, 64 + 16);
    gguf_file *f = NULL;
    specd_err err = {{0}};
    assert_int_equal(gguf_open_mem(b.p, b.n, &f, &err), 0);
    assert_int_equal(gguf_version(f), 2);
    assert_int_equal(gguf_alignment(f), 64);
    assert_int_equal(gguf_data_offset(f) % 64, 0);
    gguf_close(f);
    /* the same offset with the default alignment 32 is fine too, but 48 is not aligned to 64 */
    tb_free(&b);
    g_hdr(&b, 3, 1, 1);
    g_kv_u32(&b, "general.alignment", 64);
    g_ti(&b, "x", 1, ne, GGML_TYPE_F16, 32);
    g_pad(&b, 64);
    tb_zeros(&b, 64 + 16);
    expect_reject(b.p, b.n, "alignment");
    tb_free(&b);
}

static void test_no_tensors(void **state) {
    (void)state;
    tbuf b = {0};
    g_hdr(&b, 3, 0, 1);
    g_kv_str(&b, "k", "v");
    gguf_file *f = NULL;
    specd_err err = {{0}};
    assert_int_equal(gguf_open_mem(b.p, b.n, &f, &err), 0);
    assert_int_equal(gguf_n_tensors(f), 0);
    gguf_close(f);
    tb_free(&b);
}

/* ---------------------------------------------------------------- malformed */

/* Every strict prefix of the valid file is refused (truncated header,
 * truncated mid-kv, mid-tensor-info, inside the data section). */
static void test_truncations(void **state) {
    (void)state;
    tbuf b = {0};
    build_valid(&b);
    for (size_t n = 0; n < b.n; n++) {
        uint8_t *copy = malloc(n ? n : 1); /* exact size so ASan sees any over-read */
        memcpy(copy, b.p, n);
        expect_reject(copy, n, NULL);
        free(copy);
    }
    tb_free(&b);
}

static void test_bad_magic_version(void **state) {
    (void)state;
    tbuf b = {0};
    build_valid(&b);
    b.p[0] = 'X';
    expect_reject(b.p, b.n, "magic");
    b.p[0] = 'G';
    uint32_t v = 1;
    memcpy(b.p + 4, &v, 4);
    expect_reject(b.p, b.n, "version 1");
    v = 0x03000000u; /* big-endian v3 */
    memcpy(b.p + 4, &v, 4);
    expect_reject(b.p, b.n, "big-endian");
    v = 4;
    memcpy(b.p + 4, &v, 4);
    expect_reject(b.p, b.n, "version");
    tb_free(&b);
}

static void test_huge_counts(void **state) {
    (void)state;
    tbuf b = {0};
    build_valid(&b);
    uint64_t big = UINT64_MAX;
    memcpy(b.p + 8, &big, 8); /* tensor_count */
    expect_reject(b.p, b.n, "tensor_count");
    big = (uint64_t)1 << 40;
    memcpy(b.p + 8, &big, 8);
    expect_reject(b.p, b.n, "tensor_count");
    big = 2;
    memcpy(b.p + 8, &big, 8);
    big = UINT64_MAX / 2; /* kv_count */
    memcpy(b.p + 16, &big, 8);
    expect_reject(b.p, b.n, "kv_count");
    /* counts that just fit the size bound but describe more entries than exist */
    big = 3 + 5;
    memcpy(b.p + 16, &big, 8);
    expect_reject(b.p, b.n, NULL);
    tb_free(&b);
}

static void test_huge_string_length(void **state) {
    (void)state;
    tbuf b = {0};
    build_valid(&b);
    uint64_t big = UINT64_MAX - 3; /* the first key's length, at offset 24 */
    memcpy(b.p + 24, &big, 8);
    expect_reject(b.p, b.n, "length");
    big = (uint64_t)b.n; /* plausible but past the end */
    memcpy(b.p + 24, &big, 8);
    expect_reject(b.p, b.n, "length");
    tb_free(&b);
    /* huge string value */
    g_hdr(&b, 3, 0, 1);
    g_str(&b, "k");
    tb_u32(&b, GGUF_VT_STRING);
    tb_u64(&b, (uint64_t)1 << 62);
    tb_zeros(&b, 16);
    expect_reject(b.p, b.n, "length");
    tb_free(&b);
}

static void test_huge_array_length(void **state) {
    (void)state;
    uint32_t types[] = {GGUF_VT_STRING, GGUF_VT_UINT8, GGUF_VT_INT32, GGUF_VT_FLOAT64};
    uint64_t lens[] = {UINT64_MAX, UINT64_MAX / 4 + 1, (uint64_t)1 << 61, 100};
    for (size_t ti = 0; ti < 4; ti++) {
        for (size_t li = 0; li < 4; li++) {
            tbuf b = {0};
            g_hdr(&b, 3, 0, 1);
            g_str(&b, "arr");
            tb_u32(&b, GGUF_VT_ARRAY);
            tb_u32(&b, types[ti]);
            tb_u64(&b, lens[li]);
            tb_zeros(&b, 40);
            expect_reject(b.p, b.n, NULL);
            tb_free(&b);
        }
    }
}

static void test_bad_value_types(void **state) {
    (void)state;
    tbuf b = {0};
    g_hdr(&b, 3, 0, 1);
    g_str(&b, "k");
    tb_u32(&b, 13); /* one past FLOAT64 */
    tb_zeros(&b, 16);
    expect_reject(b.p, b.n, "unknown value type");
    tb_free(&b);
    g_hdr(&b, 3, 0, 1);
    g_str(&b, "k");
    tb_u32(&b, 0xffffffffu);
    tb_zeros(&b, 16);
    expect_reject(b.p, b.n, "unknown value type");
    tb_free(&b);
    /* array of unknown element type */
    g_hdr(&b, 3, 0, 1);
    g_str(&b, "k");
    tb_u32(&b, GGUF_VT_ARRAY);
    tb_u32(&b, 77);
    tb_u64(&b, 1);
    tb_zeros(&b, 16);
    expect_reject(b.p, b.n, "element type");
    tb_free(&b);
    /* nested array */
    g_hdr(&b, 3, 0, 1);
    g_str(&b, "k");
    tb_u32(&b, GGUF_VT_ARRAY);
    tb_u32(&b, GGUF_VT_ARRAY);
    tb_u64(&b, 1);
    tb_u32(&b, GGUF_VT_UINT8);
    tb_u64(&b, 1);
    tb_u8(&b, 1);
    expect_reject(b.p, b.n, "nested");
    tb_free(&b);
    /* bool that is neither 0 nor 1 */
    g_hdr(&b, 3, 0, 1);
    g_str(&b, "k");
    tb_u32(&b, GGUF_VT_BOOL);
    tb_u8(&b, 2);
    expect_reject(b.p, b.n, "bool");
    tb_free(&b);
    /* key with an embedded NUL, and an empty key */
    g_hdr(&b, 3, 0, 1);
    tb_u64(&b, 3);
    tb_bytes(&b, "a\0b", 3);
    tb_u32(&b, GGUF_VT_UINT8);
    tb_u8(&b, 1);
    expect_reject(b.p, b.n, "NUL");
    tb_free(&b);
    g_hdr(&b, 3, 0, 1);
    tb_u64(&b, 0);
    tb_u32(&b, GGUF_VT_UINT8);
    tb_u8(&b, 1);
    expect_reject(b.p, b.n, "empty");
    tb_free(&b);
}

/* One tensor with the given geometry, followed by DATA zero bytes. */
static void one_tensor(tbuf *b, uint32_t n_dims, const uint64_t *ne, uint32_t type, uint64_t off, size_t data) {
    g_hdr(b, 3, 1, 0);
    g_ti(b, "w", n_dims, ne, type, off);
    g_pad(b, 32);
    tb_zeros(b, data);
}

static void test_bad_dims(void **state) {
    (void)state;
    tbuf b = {0};
    uint64_t ne[5] = {32, 1, 1, 1, 1};
    one_tensor(&b, 0, ne, GGML_TYPE_F32, 0, 128);
    expect_reject(b.p, b.n, "n_dims 0");
    tb_free(&b);
    one_tensor(&b, 5, ne, GGML_TYPE_F32, 0, 128);
    expect_reject(b.p, b.n, "n_dims 5");
    tb_free(&b);
    uint64_t zero[2] = {32, 0};
    one_tensor(&b, 2, zero, GGML_TYPE_F32, 0, 128);
    expect_reject(b.p, b.n, "zero");
    tb_free(&b);
    uint64_t ovf[3] = {(uint64_t)1 << 32, (uint64_t)1 << 32, 4};
    one_tensor(&b, 3, ovf, GGML_TYPE_F32, 0, 128);
    expect_reject(b.p, b.n, "overflow");
    tb_free(&b);
    uint64_t neg[1] = {UINT64_MAX};
    one_tensor(&b, 1, neg, GGML_TYPE_F32, 0, 128);
    expect_reject(b.p, b.n, "overflow");
    tb_free(&b);
    /* product fits int64 but the byte size (x4 for F32) does not fit the file */
    uint64_t big[2] = {(uint64_t)1 << 31, (uint64_t)1 << 20};
    one_tensor(&b, 2, big, GGML_TYPE_F32, 0, 128);
    expect_reject(b.p, b.n, "outside");
    tb_free(&b);
    /* byte size overflows: 2^62 F32 elements = 2^64 bytes */
    uint64_t bo3[3] = {(uint64_t)1 << 31, (uint64_t)1 << 30, 2};
    one_tensor(&b, 3, bo3, GGML_TYPE_F32, 0, 128);
    expect_reject(b.p, b.n, "byte size overflows");
    tb_free(&b);
}

static void test_bad_types(void **state) {
    (void)state;
    tbuf b = {0};
    uint64_t ne[1] = {32};
    uint32_t bad[] = {4, 5, 6, 7, 9, 10, 11, 13, 15, 16, 29, 31, 39, 1000, 0xffffffffu};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        one_tensor(&b, 1, ne, bad[i], 0, 256);
        expect_reject(b.p, b.n, "ggml type");
        tb_free(&b);
    }
    uint64_t odd[1] = {33}; /* not a multiple of the Q8_0 block (32) */
    one_tensor(&b, 1, odd, GGML_TYPE_Q8_0, 0, 256);
    expect_reject(b.p, b.n, "multiple");
    tb_free(&b);
    uint64_t k[2] = {128, 2}; /* Q4_K needs rows of 256 */
    one_tensor(&b, 2, k, GGML_TYPE_Q4_K, 0, 512);
    expect_reject(b.p, b.n, "multiple");
    tb_free(&b);
}

static void test_bad_offsets(void **state) {
    (void)state;
    tbuf b = {0};
    uint64_t ne[1] = {8};
    one_tensor(&b, 1, ne, GGML_TYPE_F32, 32, 32); /* needs 32+32 = 64 bytes of data */
    expect_reject(b.p, b.n, "outside");
    tb_free(&b);
    one_tensor(&b, 1, ne, GGML_TYPE_F32, UINT64_MAX - 31, 64); /* aligned, wraps */
    expect_reject(b.p, b.n, "outside");
    tb_free(&b);
    one_tensor(&b, 1, ne, GGML_TYPE_F32, 4, 64); /* misaligned */
    expect_reject(b.p, b.n, "alignment");
    tb_free(&b);
    /* data section (after padding) starts past EOF */
    g_hdr(&b, 3, 1, 0);
    g_ti(&b, "w", 1, ne, GGML_TYPE_F32, 0);
    expect_reject(b.p, b.n, NULL);
    tb_free(&b);
}

static void test_overlap_and_duplicates(void **state) {
    (void)state;
    tbuf b = {0};
    uint64_t ne[1] = {16}; /* 64 bytes of F32 */
    g_hdr(&b, 3, 2, 0);
    g_ti(&b, "a", 1, ne, GGML_TYPE_F32, 0);
    g_ti(&b, "b", 1, ne, GGML_TYPE_F32, 32);
    g_pad(&b, 32);
    tb_zeros(&b, 128);
    expect_reject(b.p, b.n, "overlaps");
    tb_free(&b);
    g_hdr(&b, 3, 2, 0); /* same offset */
    g_ti(&b, "a", 1, ne, GGML_TYPE_F32, 64);
    g_ti(&b, "b", 1, ne, GGML_TYPE_F32, 64);
    g_pad(&b, 32);
    tb_zeros(&b, 128);
    expect_reject(b.p, b.n, "overlaps");
    tb_free(&b);
    g_hdr(&b, 3, 2, 0);
    g_ti(&b, "same", 1, ne, GGML_TYPE_F32, 0);
    g_ti(&b, "same", 1, ne, GGML_TYPE_F32, 64);
    g_pad(&b, 32);
    tb_zeros(&b, 128);
    expect_reject(b.p, b.n, "duplicate tensor name 'same'");
    tb_free(&b);
    g_hdr(&b, 3, 0, 3);
    g_kv_u32(&b, "x", 1);
    g_kv_u32(&b, "y", 1);
    g_kv_str(&b, "x", "again");
    expect_reject(b.p, b.n, "duplicate key 'x'");
    tb_free(&b);
}

static void test_bad_alignment(void **state) {
    (void)state;
    uint32_t vals[] = {0, 3, 48, 0x80000000u};
    for (size_t i = 0; i < 4; i++) {
        tbuf b = {0};
        g_hdr(&b, 3, 0, 1);
        g_kv_u32(&b, "general.alignment", vals[i]);
        expect_reject(b.p, b.n, "alignment");
        tb_free(&b);
    }
    tbuf b = {0};
    g_hdr(&b, 3, 0, 1);
    g_kv_str(&b, "general.alignment", "32");
    expect_reject(b.p, b.n, "alignment");
    tb_free(&b);
}

/* Flipping any single byte of the valid file never crashes (accept or
 * refuse with a message). */
static void test_byte_flips(void **state) {
    (void)state;
    tbuf b = {0};
    build_valid(&b);
    const uint8_t pats[] = {0x00, 0xff, 0x80, 0x7f, 0x01};
    for (size_t i = 0; i < b.n; i++) {
        for (size_t k = 0; k < sizeof pats; k++) {
            uint8_t *c = malloc(b.n);
            memcpy(c, b.p, b.n);
            c[i] = pats[k];
            gguf_file *f = NULL;
            specd_err err = {{0}};
            int rc = gguf_open_mem(c, b.n, &f, &err);
            if (rc == 0) {
                for (size_t t = 0; t < gguf_n_tensors(f); t++) {
                    const gguf_tensor *gt = gguf_tensor_at(f, t);
                    assert_true((const uint8_t *)gt->data + gt->nbytes <= c + b.n);
                }
                gguf_close(f);
            } else {
                assert_null(f);
                assert_true(err.msg[0] != '\0');
            }
            free(c);
        }
    }
    tb_free(&b);
}

static void test_open_errors(void **state) {
    (void)state;
    gguf_file *f = NULL;
    specd_err err = {{0}};
    assert_int_equal(gguf_open("/nonexistent/x.gguf", &f, &err), -1);
    assert_null(f);
    assert_non_null(strstr(err.msg, "/nonexistent/x.gguf"));
    assert_int_equal(gguf_open("/", &f, &err), -1);
    assert_null(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),
        cmocka_unit_test(test_v2_and_custom_alignment),
        cmocka_unit_test(test_no_tensors),
        cmocka_unit_test(test_truncations),
        cmocka_unit_test(test_bad_magic_version),
        cmocka_unit_test(test_huge_counts),
        cmocka_unit_test(test_huge_string_length),
        cmocka_unit_test(test_huge_array_length),
        cmocka_unit_test(test_bad_value_types),
        cmocka_unit_test(test_bad_dims),
        cmocka_unit_test(test_bad_types),
        cmocka_unit_test(test_bad_offsets),
        cmocka_unit_test(test_overlap_and_duplicates),
        cmocka_unit_test(test_bad_alignment),
        cmocka_unit_test(test_byte_flips),
        cmocka_unit_test(test_open_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
