/*
 * test_tokenizer_bpe.c: SmolLM2 byte-level BPE from the real GGUF against HF
 * `tokenizers` (fixture tests/fixtures/tokenizer/smollm2_strings.json, made by
 * tools/gen_tokenizer_fixtures.py): encode with and without special parsing,
 * decode round trip, the incremental detokenizer against Python's lossy UTF-8
 * decoding, a large text through the cache path, and the GGUF metadata.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <cmocka.h>

#include "tok_fixture.h"

static tokenizer *T;
static json_t *STR;

static json_t *strings(void) { return json_object_get(STR, "strings"); }

static void tokenizer_gguf_metadata(void **state) {
    (void)state;
    /* REFERENCE.md section 4 */
    assert_int_equal(tok_vocab_size(T), 49152);
    assert_int_equal(tok_bos_id(T), 1);
    assert_int_equal(tok_eos_id(T), 2);
    assert_int_equal(tok_token_id(T, "<|im_end|>", 10), 2);
    assert_int_equal(tok_token_id(T, "<|im_start|>", 12), 1);
    assert_int_equal(tok_token_id(T, "<|endoftext|>", 13), 0);
    for (int32_t id = 0; id <= 16; id++) assert_true(tok_is_special(T, id));
    assert_false(tok_is_special(T, 17));
    assert_false(tok_is_special(T, 49151));
    assert_false(tok_is_special(T, 49152));
    const int32_t *stop;
    size_t n = tok_stop_ids(T, &stop);
    assert_int_equal(n, 1); /* EOS is <|im_end|> (2) itself */
    assert_int_equal(stop[0], 2);
    size_t len;
    const char *b = tok_token_bytes(T, 2, &len);
    assert_int_equal(len, 10);
    assert_memory_equal(b, "<|im_end|>", 10);
    assert_null(tok_token_bytes(T, 49152, &len));
    assert_null(tok_token_bytes(T, -1, &len));
    /* byte-level mapping undone: " the" is one token whose bytes start with a space */
    int32_t *ids;
    size_t nid;
    specd_err err = {0};
    assert_int_equal(tok_encode(T, " the", 4, false, &ids, &nid, &err), 0);
    assert_int_equal(nid, 1);
    b = tok_token_bytes(T, ids[0], &len);
    assert_int_equal(len, 4);
    assert_memory_equal(b, " the", 4);
    assert_int_equal(tok_token_id(T, " the", 4), ids[0]);
    free(ids);
}

static void tokenizer_encode_matches_hf(void **state) {
    (void)state;
    size_t bad = 0, i;
    json_t *it;
    json_array_foreach(strings(), i, it) {
        size_t len;
        char *s = fx_unhex(json_string_value(json_object_get(it, "hex")), &len);
        for (int special = 1; special >= 0; special--) {
            size_t nw, ng;
            int32_t *want = fx_ids(json_object_get(it, special ? "ids" : "ids_plain"), &nw), *got;
            specd_err err = {0};
            assert_int_equal(tok_encode(T, s, len, special, &got, &ng, &err), 0);
            if (!fx_ids_equal(got, ng, want, nw, special ? "encode(parse_special)" : "encode(plain)", i)) bad++;
            free(got);
            free(want);
        }
        free(s);
    }
    printf("encode: %zu strings x 2 modes compared with HF tokenizers, %zu mismatches\n", json_array_size(strings()),
           bad);
    assert_int_equal(bad, 0);
}

static void tokenizer_decode_roundtrip(void **state) {
    (void)state;
    size_t i, n_exact = 0;
    json_t *it;
    json_array_foreach(strings(), i, it) {
        size_t len, wl, nid, dl;
        char *s = fx_unhex(json_string_value(json_object_get(it, "hex")), &len);
        const char *dh = json_string_value(json_object_get(it, "decoded_hex"));
        char *want = dh ? fx_unhex(dh, &wl) : NULL;
        int32_t *ids = fx_ids(json_object_get(it, "ids"), &nid);
        char *d;
        specd_err err = {0};
        assert_int_equal(tok_decode(T, ids, nid, false, &d, &dl, &err), 0);
        if (!want) n_exact++; /* decode(encode(s)) == s */
        assert_int_equal(dl, want ? wl : len);
        assert_memory_equal(d, want ? want : s, dl);
        free(d);
        /* skip_special drops exactly the special ids */
        assert_int_equal(tok_decode(T, ids, nid, true, &d, &dl, &err), 0);
        size_t expect = 0;
        for (size_t k = 0; k < nid; k++) {
            size_t tl;
            tok_token_bytes(T, ids[k], &tl);
            if (!tok_is_special(T, ids[k])) expect += tl;
        }
        assert_int_equal(dl, expect);
        free(d);
        free(ids);
        free(want);
        free(s);
    }
    printf("decode: %zu strings; %zu round-trip exactly (the rest hold bytes SmolLM2 has no token for)\n",
           json_array_size(strings()), n_exact);
    assert_true(n_exact >= 300);
    int32_t bad_id = 49152;
    char *d;
    size_t dl;
    specd_err err = {0};
    assert_int_equal(tok_decode(T, &bad_id, 1, false, &d, &dl, &err), -1);
    assert_true(strlen(err.msg) > 0);
}

/* Well-formed UTF-8 per RFC 3629, written independently of the library. */
static int utf8_ok(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        uint32_t cp;
        if (c < 0x80) { i++; continue; }
        else if ((c & 0xE0) == 0xC0) { k = 1; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { k = 2; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { k = 3; cp = c & 0x07; }
        else return 0;
        if (i + k >= n) return 0; /* truncated */
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (s[i + j] & 0x3F);
        }
        if ((k == 1 && cp < 0x80) || (k == 2 && cp < 0x800) || (k == 3 && cp < 0x10000) || cp > 0x10FFFF ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += k + 1;
    }
    return 1;
}

static void tokenizer_stream_matches_lossy_decode(void **state) {
    (void)state;
    size_t i;
    json_t *it;
    json_array_foreach(strings(), i, it) {
        size_t nid;
        int32_t *ids = fx_ids(json_object_get(it, "ids"), &nid);
        /* final text: Python's bytes.decode("utf-8", "replace") of the decoded
         * bytes, or the input itself when that is valid and round-trips */
        size_t lossy_len;
        char *input = fx_unhex(json_string_value(json_object_get(it, "hex")), &lossy_len);
        const char *lossy = input;
        if (json_object_get(it, "lossy")) {
            lossy = json_string_value(json_object_get(it, "lossy"));
            lossy_len = json_string_length(json_object_get(it, "lossy"));
        }
        tok_stream *st = tok_stream_create(T, false);
        char *out = NULL;
        size_t ol = 0, oc = 0, dec_len = 0;
        for (size_t k = 0; k < nid; k++) {
            assert_int_equal(tok_stream_push(st, ids[k], &out, &ol, &oc), 0);
            size_t tl;
            tok_token_bytes(T, ids[k], &tl);
            dec_len += tl;
            assert_true(utf8_ok((const unsigned char *)out, ol)); /* never a partial sequence */
            assert_true(ol <= lossy_len);
            assert_memory_equal(out, lossy, ol); /* a prefix of the final text */
            if (json_is_true(json_object_get(it, "valid_utf8")) && !json_object_get(it, "decoded_hex")) {
                /* valid text: exactly the text cut at the last character
                 * boundary covered so far (nothing final is held back) */
                size_t cut = dec_len; /* last boundary at or before dec_len */
                while (cut > 0 && cut < lossy_len && ((unsigned char)lossy[cut] & 0xC0) == 0x80) cut--;
                assert_int_equal(ol, cut);
            }
        }
        assert_int_equal(tok_stream_flush(st, &out, &ol, &oc), 0);
        if (ol != lossy_len || (ol && memcmp(out, lossy, ol) != 0))
            fail_msg("stream #%zu: final output differs from Python's lossy decode", i);
        free(out);
        tok_stream_destroy(st);
        free(ids);
        free(input);
    }
    /* bad id */
    tok_stream *st = tok_stream_create(T, true);
    char *out = NULL;
    size_t ol = 0, oc = 0;
    assert_int_equal(tok_stream_push(st, -5, &out, &ol, &oc), -1);
    assert_int_equal(tok_stream_push(st, 2, &out, &ol, &oc), 0); /* skipped special */
    assert_int_equal(ol, 0);
    free(out);
    tok_stream_destroy(st);
}

/* A large text: fixture strings joined by <|endoftext|>. With specials parsed,
 * the stretches between them are encoded independently, so the ids must be
 * the fixtures' ids joined by 0 (and the per-call cache is exercised). */
static void tokenizer_large_text_and_throughput(void **state) {
    (void)state;
    size_t cap = 1 << 20, len = 0, nw = 0, wcap = 1 << 18;
    char *text = malloc(cap);
    int32_t *want = malloc(wcap * sizeof *want);
    for (int rep = 0; rep < 12; rep++) {
        size_t i;
        json_t *it;
        json_array_foreach(strings(), i, it) {
            size_t sl, n;
            char *s = fx_unhex(json_string_value(json_object_get(it, "hex")), &sl);
            int32_t *ids = fx_ids(json_object_get(it, "ids"), &n);
            while (len + sl + 16 > cap) text = realloc(text, cap *= 2);
            while (nw + n + 1 > wcap) want = realloc(want, (wcap *= 2) * sizeof *want);
            memcpy(text + len, s, sl);
            len += sl;
            memcpy(want + nw, ids, n * sizeof *ids);
            nw += n;
            memcpy(text + len, "<|endoftext|>", 13);
            len += 13;
            want[nw++] = 0;
            free(s);
            free(ids);
        }
    }
    int32_t *got;
    size_t ng;
    specd_err err = {0};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(tok_encode(T, text, len, true, &got, &ng, &err), 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("large text: %.2f MB, %zu tokens, encode %.3f s = %.1f MB/s (mixed fixture text)\n", len / 1e6, ng, s,
           len / 1e6 / s);
    assert_true(fx_ids_equal(got, ng, want, nw, "large", 0));
    free(got);
    free(want);
    free(text);
}

/* The per-call piece cache (texts >= 2 KB) is reset when full: a text with
 * ~40k distinct words must encode exactly as its small pieces do without a
 * cache (chunks cut before a space, < 2 KB each). Also random byte strings
 * (all of whose bytes have tokens) round-trip through encode/decode. */
static void tokenizer_cache_reset_and_random_bytes(void **state) {
    (void)state;
    size_t cap = 1 << 20, len = 0;
    char *text = malloc(cap);
    for (unsigned i = 0; i < 40000; i++) {
        char w[16];
        int wl = 0;
        w[wl++] = ' ';
        for (unsigned v = i * 2654435761u % 1000003u; v; v /= 26) w[wl++] = (char)('a' + v % 26);
        memcpy(text + len, w, (size_t)wl);
        len += (size_t)wl;
    }
    int32_t *all, *part;
    size_t n_all, n_part;
    specd_err err = {0};
    assert_int_equal(tok_encode(T, text, len, false, &all, &n_all, &err), 0);
    size_t pos = 0, k = 0;
    while (pos < len) {
        size_t end = pos + 1500 < len ? pos + 1500 : len;
        while (end < len && text[end] != ' ') end++;
        assert_int_equal(tok_encode(T, text + pos, end - pos, false, &part, &n_part, &err), 0);
        assert_true(k + n_part <= n_all);
        assert_memory_equal(all + k, part, n_part * sizeof *part);
        k += n_part;
        free(part);
        pos = end;
    }
    assert_int_equal(k, n_all);
    free(all);
    free(text);
    /* random bytes */
    uint64_t x = 88172645463325252ull;
    char buf[256];
    for (int r = 0; r < 3000; r++) {
        size_t n = 0, want = (size_t)(r % 200);
        while (n < want) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            char c = (char)(x & 0xFF);
            if (tok_token_id(T, &c, 1) >= 0 && !tok_is_special(T, tok_token_id(T, &c, 1))) buf[n++] = c;
        }
        int32_t *ids;
        size_t nid, dl;
        char *d;
        assert_int_equal(tok_encode(T, buf, n, true, &ids, &nid, &err), 0);
        assert_int_equal(tok_decode(T, ids, nid, false, &d, &dl, &err), 0);
        assert_int_equal(dl, n);
        assert_memory_equal(d, buf, n);
        free(d);
        free(ids);
    }
}

int main(void) {
    fx_require_model();
    T = fx_smollm2();
    STR = fx_load_json("smollm2_strings.json");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tokenizer_gguf_metadata),
        cmocka_unit_test(tokenizer_encode_matches_hf),
        cmocka_unit_test(tokenizer_decode_roundtrip),
        cmocka_unit_test(tokenizer_stream_matches_lossy_decode),
        cmocka_unit_test(tokenizer_large_text_and_throughput),
        cmocka_unit_test(tokenizer_cache_reset_and_random_bytes),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    json_decref(STR);
    tok_destroy(T);
    gguf_close(fx_gguf);
    return rc;
}
