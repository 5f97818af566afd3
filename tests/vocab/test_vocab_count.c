/*
 * test_vocab_count.c: `vocab_count` on the first 500 GSM8K train records with
 * SmolLM2's chat template equals an independent count
 * (tests/fixtures/vocab/gsm8k_train_ref.json, made by tools/vocab_ref_count.py
 * with jinja2 + Hugging Face tokenizers and a mask from prefix renderings):
 * processed / skipped samples, total and assistant tokens, distinct ids, the
 * sha256 of the whole int64 frequency vector and the top-200 (id, count)
 * pairs, with and without a --max-seq-len cut, for 1, 2 and 3 threads.
 *
 * Needs the model (SPECD_MODEL_GGUF) and ../shared/data/prompts/gsm8k_train.jsonl
 * (or SPECD_VOCAB_GSM8K); skips (77) without them.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vocab/vocab_count.h"
#include "vocab/vocab_data.h"
#include "vocab/vocab_target.h"

static char model_path[1024], data_path[1024], fixture_path[1024];
static json_t *fixture;
static vocab_target tg;
static vocab_dataset ds;

static void hex(const unsigned char *d, size_t n, char *out) {
    for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", d[i]);
}

/* sha256 of the first N non-blank lines, each with its "\n" (as the generator hashes them). */
static void data_sha(const char *path, size_t n, char *out) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    EVP_DigestInit_ex(c, EVP_sha256(), NULL);
    char *line = NULL;
    size_t cap = 0, k = 0;
    ssize_t len;
    while (k < n && (len = getline(&line, &cap, f)) >= 0) {
        if (len > 0 && line[len - 1] == '\n') len--;
        if (len == 0) continue;
        EVP_DigestUpdate(c, line, (size_t)len);
        EVP_DigestUpdate(c, "\n", 1);
        k++;
    }
    free(line);
    fclose(f);
    unsigned char d[32];
    unsigned int dl = 0;
    EVP_DigestFinal_ex(c, d, &dl);
    EVP_MD_CTX_free(c);
    hex(d, 32, out);
}

static void test_matches_reference(void **s) {
    (void)s;
    size_t n_rec = (size_t)json_integer_value(json_object_get(fixture, "n_records"));
    assert_int_equal(ds.n_rec, n_rec);
    assert_int_equal(ds.n_malformed, 0);
    char sha[65];
    data_sha(data_path, n_rec, sha);
    assert_string_equal(sha, json_string_value(json_object_get(fixture, "data_sha256")));
    assert_int_equal(tg.n_vocab, json_integer_value(json_object_get(fixture, "vocab")));
    json_t *counts = json_object_get(fixture, "counts");
    assert_int_equal(json_array_size(counts), 2);
    for (size_t c = 0; c < 2; c++) {
        json_t *ref = json_array_get(counts, c);
        for (int threads = 1; threads <= 3; threads++) {
            vocab_count_opts o = {.max_seq_len = (int32_t)json_integer_value(json_object_get(ref, "max_seq_len")),
                                  .n_threads = threads};
            vocab_count_result r;
            specd_err err = {0};
            assert_int_equal(vocab_count(tg.tok, tg.n_vocab, &ds, &o, &r, &err), 0);
            assert_int_equal(r.n_records, n_rec);
            assert_int_equal(r.n_processed, json_integer_value(json_object_get(ref, "processed")));
            assert_int_equal(r.n_skipped_long, json_integer_value(json_object_get(ref, "skipped_long")));
            assert_int_equal(r.n_failed, 0);
            assert_int_equal(r.n_no_response, 0);
            assert_int_equal(r.total_tokens, json_integer_value(json_object_get(ref, "total_tokens")));
            assert_int_equal(r.assistant_tokens, json_integer_value(json_object_get(ref, "assistant_tokens")));
            assert_int_equal(r.distinct, json_integer_value(json_object_get(ref, "distinct")));
            unsigned char d[32];
            unsigned int dl = 0; /* the host is little-endian, as the reference's '<i8' bytes */
            assert_int_equal(EVP_Digest(r.freq, sizeof(int64_t) * (size_t)r.n_vocab, d, &dl, EVP_sha256(), NULL), 1);
            hex(d, 32, sha);
            assert_string_equal(sha, json_string_value(json_object_get(ref, "freq_sha256")));
            json_t *top = json_object_get(ref, "top200");
            assert_true(json_array_size(top) > 100);
            for (size_t k = 0; k < json_array_size(top); k++) {
                json_t *p = json_array_get(top, k);
                int64_t id = json_integer_value(json_array_get(p, 0)), cnt = json_integer_value(json_array_get(p, 1));
                assert_int_equal(r.freq[id], cnt);
            }
            if (o.max_seq_len) assert_true(r.longest <= o.max_seq_len);
            vocab_count_result_free(&r);
        }
    }
}

/* A conversation with no assistant turn is not counted; the mask covers the
 * assistant content and its <|im_end|> only. */
static void test_mask_scope(void **s) {
    (void)s;
    vocab_dataset d = {0};
    vocab_record r;
    specd_err err = {0};
    const char *line = "{\"messages\": [{\"role\": \"user\", \"content\": \"hello hello\"}, "
                       "{\"role\": \"assistant\", \"content\": \"ok\"}]}";
    assert_int_equal(vocab_data_parse_line(&d, line, strlen(line), &r, &err), 0);
    d.rec = &r;
    d.n_rec = 1;
    vocab_count_opts o = {.n_threads = 1};
    vocab_count_result res;
    assert_int_equal(vocab_count(tg.tok, tg.n_vocab, &d, &o, &res, &err), 0);
    int32_t *ids;
    size_t n;
    assert_int_equal(tok_encode(tg.tok, "ok", 2, false, &ids, &n, &err), 0);
    int32_t im_end = tok_token_id(tg.tok, "<|im_end|>", 10);
    assert_true(im_end >= 0);
    assert_int_equal(res.assistant_tokens, (int64_t)n + 1);
    for (size_t i = 0; i < n; i++) assert_true(res.freq[ids[i]] >= 1);
    assert_int_equal(res.freq[im_end], 1); /* the assistant's, not the system's or the user's */
    free(ids);
    vocab_count_result_free(&res);
    r.n_assistant = 0; /* as for a question-only record */
    assert_int_equal(vocab_count(tg.tok, tg.n_vocab, &d, &o, &res, &err), 0);
    assert_int_equal(res.n_no_response, 1);
    assert_int_equal(res.n_processed, 0);
    assert_int_equal(res.assistant_tokens, 0);
    vocab_count_result_free(&res);
    r.n_assistant = 1;
    vocab_record_free(&r);
    assert_int_equal(vocab_count(tg.tok, 10, &d, &o, &res, &err), -1); /* vocab smaller than the tokenizer */
}

int main(void) {
    const char *src = getenv("SPECD_SOURCE_DIR"), *m = getenv("SPECD_MODEL_GGUF"), *g = getenv("SPECD_VOCAB_GSM8K");
    if (!src) src = ".";
    snprintf(model_path, sizeof model_path, "%s", m ? m : "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if (g) snprintf(data_path, sizeof data_path, "%s", g);
    else snprintf(data_path, sizeof data_path, "%s/../shared/data/prompts/gsm8k_train.jsonl", src);
    snprintf(fixture_path, sizeof fixture_path, "%s/tests/fixtures/vocab/gsm8k_train_ref.json", src);
    if (access(model_path, R_OK) != 0 || access(data_path, R_OK) != 0) {
        printf("skip: needs %s and %s\n", model_path, data_path);
        return 77;
    }
    json_error_t je;
    if (!(fixture = json_load_file(fixture_path, 0, &je))) {
        fprintf(stderr, "%s: %s\n", fixture_path, je.text);
        return 1;
    }
    specd_err err = {0};
    if (vocab_target_open(model_path, &tg, &err) < 0 ||
        vocab_data_load(&ds, data_path, json_integer_value(json_object_get(fixture, "n_records")), &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_reference),
        cmocka_unit_test(test_mask_scope),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    vocab_dataset_free(&ds);
    vocab_target_close(&tg);
    json_decref(fixture);
    return rc;
}
