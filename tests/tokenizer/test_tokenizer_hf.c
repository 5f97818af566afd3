/*
 * test_tokenizer_hf.c: tok_create_from_hf on the tokenizer.json that
 * transformers writes for the SmolLM2 GGUF (save_pretrained). The committed
 * fixture smollm2_hf_skeleton.json is that file without model.vocab and
 * model.merges (3.5 MB); this test puts them back from the GGUF, exactly as
 * tools/gen_tokenizer_fixtures.py checked they were, into a temporary
 * directory with the saved tokenizer_config.json and chat_template.jinja.
 *
 *  - "smollm2": pre-tokenizer Sequence[Digits, ByteLevel] as on the hub (and
 *    merges written as "left right" strings, the hub file's format): ids must
 *    equal HF tokenizers' (fixture) and so the GGUF path's.
 *  - "transformers_gguf": transformers' own conversion (ByteLevel only): ids
 *    must equal what HF computes with that file (ids_transformers_gguf where
 *    it differs from SmolLM2's); merges as [left, right] pairs.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include <cmocka.h>

#include "tok_fixture.h"

static json_t *SKEL, *STR, *CHAT;
static char DIR_[256];

static void write_json(const char *name, json_t *j) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", DIR_, name);
    assert_int_equal(json_dump_file(j, p, JSON_COMPACT), 0);
}

/* tokenizer.json = skeleton + vocab/merges from the GGUF. Returns its path. */
static char *make_tokenizer_dir(const char *variant) {
    json_t *tj = json_deep_copy(json_object_get(SKEL, variant));
    json_t *model = json_object_get(tj, "model");
    const gguf_kv *toks = gguf_find_kv(fx_gguf, "tokenizer.ggml.tokens");
    const gguf_kv *merges = gguf_find_kv(fx_gguf, "tokenizer.ggml.merges");
    json_t *vocab = json_object(), *marr = json_array();
    for (uint64_t i = 0; i < toks->arr_len; i++) {
        const char *s;
        size_t l;
        assert_int_equal(gguf_arr_str(toks, i, &s, &l), 0);
        json_object_setn_new(vocab, s, l, json_integer((json_int_t)i));
    }
    for (uint64_t i = 0; i < merges->arr_len; i++) {
        const char *s;
        size_t l;
        assert_int_equal(gguf_arr_str(merges, i, &s, &l), 0);
        const char *sp = memchr(s, ' ', l);
        assert_non_null(sp);
        if (strcmp(variant, "smollm2") == 0) { /* the hub file's older "left right" strings */
            json_array_append_new(marr, json_stringn(s, l));
            continue;
        }
        json_t *pair = json_array(); /* save_pretrained's [left, right] pairs */
        json_array_append_new(pair, json_stringn(s, (size_t)(sp - s)));
        json_array_append_new(pair, json_stringn(sp + 1, l - (size_t)(sp - s) - 1));
        json_array_append_new(marr, pair);
    }
    json_object_set_new(model, "vocab", vocab);
    json_object_set_new(model, "merges", marr);
    write_json("tokenizer.json", tj);
    json_decref(tj);
    char p[512];
    snprintf(p, sizeof p, "%s/tokenizer_config.json", DIR_); /* verbatim (holds a 31-digit integer) */
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    fputs(json_string_value(json_object_get(SKEL, "tokenizer_config_text")), f);
    fclose(f);
    const char *jinja = json_string_value(json_object_get(SKEL, "chat_template_jinja"));
    snprintf(p, sizeof p, "%s/chat_template.jinja", DIR_);
    f = fopen(p, "wb");
    assert_non_null(f);
    if (jinja) fputs(jinja, f);
    fclose(f);
    snprintf(p, sizeof p, "%s/tokenizer.json", DIR_);
    return strdup(p);
}

static tokenizer *load_variant(const char *variant) {
    char *p = make_tokenizer_dir(variant);
    tokenizer *t = NULL;
    specd_err err = {0};
    if (tok_create_from_hf(p, &t, &err) < 0) fail_msg("tok_create_from_hf: %s", err.msg);
    free(p);
    return t;
}

static void tokenizer_hf_json_smollm2_matches_hf_and_gguf(void **state) {
    (void)state;
    tokenizer *t = load_variant("smollm2"), *g = fx_smollm2();
    assert_int_equal(tok_vocab_size(t), 49152);
    assert_int_equal(tok_eos_id(t), 2); /* tokenizer_config.json eos_token <|im_end|> */
    assert_int_equal(tok_bos_id(t), 1);
    const int32_t *stop;
    size_t ns = tok_stop_ids(t, &stop);
    assert_true(ns >= 1 && stop[0] == 2);
    size_t i, bad = 0;
    json_t *it;
    json_array_foreach(json_object_get(STR, "strings"), i, it) {
        size_t len;
        char *s = fx_unhex(json_string_value(json_object_get(it, "hex")), &len);
        for (int special = 1; special >= 0; special--) {
            size_t nw, nh, ng;
            int32_t *want = fx_ids(json_object_get(it, special ? "ids" : "ids_plain"), &nw), *h, *gg;
            specd_err err = {0};
            assert_int_equal(tok_encode(t, s, len, special, &h, &nh, &err), 0);
            assert_int_equal(tok_encode(g, s, len, special, &gg, &ng, &err), 0);
            if (!fx_ids_equal(h, nh, want, nw, "hf-json vs HF", i)) bad++;
            if (!fx_ids_equal(h, nh, gg, ng, "hf-json vs gguf", i)) bad++;
            free(h);
            free(gg);
            free(want);
        }
        free(s);
    }
    printf("tokenizer.json (Digits+ByteLevel): %zu strings x 2 modes, %zu mismatches vs HF and the GGUF path\n",
           json_array_size(json_object_get(STR, "strings")), bad);
    assert_int_equal(bad, 0);
    /* the chat template came from chat_template.jinja */
    json_array_foreach(json_object_get(CHAT, "conversations"), i, it) {
        const json_t *ms = json_object_get(it, "messages");
        size_t n = json_array_size(ms), len;
        chat_message m[8] = {{0}};
        for (size_t k = 0; k < n && k < 8; k++) {
            m[k].role = json_string_value(json_object_get(json_array_get(ms, k), "role"));
            m[k].content = json_string_value(json_object_get(json_array_get(ms, k), "content"));
            m[k].name = NULL;
        }
        chat_options opt = {.add_generation_prompt = json_is_true(json_object_get(it, "add_generation_prompt")),
                            .thinking = -1};
        char *text;
        specd_err err = {0};
        assert_int_equal(tok_chat_render(t, m, n, &opt, &text, &len, &err), 0);
        assert_string_equal(text, json_string_value(json_object_get(it, "rendered")));
        free(text);
    }
    tok_destroy(t);
    tok_destroy(g);
}

static void tokenizer_hf_json_transformers_conversion(void **state) {
    (void)state;
    tokenizer *t = load_variant("transformers_gguf");
    size_t i, n_diff = 0;
    json_t *it;
    json_array_foreach(json_object_get(STR, "strings"), i, it) {
        if (!json_is_true(json_object_get(it, "valid_utf8"))) continue;
        const json_t *w = json_object_get(it, "ids_transformers_gguf");
        n_diff += w != NULL;
        if (!w) w = json_object_get(it, "ids");
        size_t len, nw, nh;
        char *s = fx_unhex(json_string_value(json_object_get(it, "hex")), &len);
        int32_t *want = fx_ids(w, &nw), *h;
        specd_err err = {0};
        assert_int_equal(tok_encode(t, s, len, true, &h, &nh, &err), 0);
        assert_true(fx_ids_equal(h, nh, want, nw, "transformers tokenizer.json", i));
        free(h);
        free(want);
        free(s);
    }
    printf("tokenizer.json (transformers' GGUF conversion, ByteLevel only): equal to HF; %zu strings differ from "
           "SmolLM2's own pre-tokenizer\n", n_diff);
    assert_true(n_diff > 0);
    tok_destroy(t);
}

static void tokenizer_hf_json_refusals(void **state) {
    (void)state;
    static const char *const bad[] = {
        "{",
        "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}, \"normalizer\": {\"type\": \"NFC\"},"
        " \"decoder\": {\"type\": \"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -3}, \"merges\": []}, \"decoder\": {\"type\": \"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, \"decoder\": {\"type\": \"ByteLevel\"}}",
    };
    char p[512];
    snprintf(p, sizeof p, "%s/bad.json", DIR_);
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        FILE *f = fopen(p, "wb");
        fputs(bad[k], f);
        fclose(f);
        tokenizer *t = (tokenizer *)1;
        specd_err err = {0};
        assert_int_equal(tok_create_from_hf(p, &t, &err), -1);
        assert_null(t);
        assert_true(strlen(err.msg) > 0);
        printf("refused: %s\n", err.msg);
    }
    unlink(p);
}

int main(void) {
    fx_require_model();
    SKEL = fx_load_json("smollm2_hf_skeleton.json");
    STR = fx_load_json("smollm2_strings.json");
    CHAT = fx_load_json("smollm2_chat.json");
    tok_destroy(fx_smollm2()); /* opens fx_gguf */
    snprintf(DIR_, sizeof DIR_, "/tmp/specd-tok-hf-XXXXXX");
    if (!mkdtemp(DIR_)) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tokenizer_hf_json_smollm2_matches_hf_and_gguf),
        cmocka_unit_test(tokenizer_hf_json_transformers_conversion),
        cmocka_unit_test(tokenizer_hf_json_refusals),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    static const char *const files[] = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"};
    for (size_t k = 0; k < 3; k++) {
        char p[512];
        snprintf(p, sizeof p, "%s/%s", DIR_, files[k]);
        unlink(p);
    }
    rmdir(DIR_);
    json_decref(SKEL);
    json_decref(STR);
    json_decref(CHAT);
    gguf_close(fx_gguf);
    return rc;
}
