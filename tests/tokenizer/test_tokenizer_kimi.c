/*
 * test_tokenizer_kimi.c: the Kimi K2/K2.5 tiktoken tokenizer against the
 * `tiktoken` package (fixture kimi_strings.json, tools/gen_tokenizer_fixtures.py
 * --only kimi): 537 strings with specials allowed and as plain text, the
 * REFERENCE.md test vector, the special-id table, decode round trip, and the
 * PCRE2 rewrite of the class intersection; the Kimi chat family against jinja2
 * renderings of Kimi-K2-Instruct's own template (from tokenizer_config.
 * k2-instruct.json) and of a K2.5-style template (kimi_chat.json), with ids
 * equal to tiktoken's encode of the rendering and the mask from its offsets.
 * Needs the ranks file: SPECD_KIMI_TIKTOKEN or ../shared/data/kimi-k2/
 * tiktoken.model next to the repository; skips (77) without it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "engine/tokenizer/tok_internal.h"
#include "tok_fixture.h"

static tokenizer *K;
static json_t *STR, *CHAT;
static char RANKS[4096];

static void tokenizer_kimi_reference_vector(void **state) {
    (void)state;
    const char *s = "Hello, world! 你好，世界！";
    static const int32_t want[] = {19180, 11, 2695, 0, 220, 33845, 378, 2243, 856};
    int32_t *ids;
    size_t n;
    specd_err err = {0};
    assert_int_equal(tok_encode(K, s, strlen(s), true, &ids, &n, &err), 0);
    assert_true(fx_ids_equal(ids, n, want, 9, "REFERENCE vector", 0));
    free(ids);
}

static void tokenizer_kimi_specials(void **state) {
    (void)state;
    /* REFERENCE.md section 1 */
    assert_int_equal(tok_vocab_size(K), 163840);
    assert_int_equal(tok_bos_id(K), 163584);
    assert_int_equal(tok_eos_id(K), 163585);
    static const struct {
        int32_t id;
        const char *name;
    } sp[] = {{163586, "<|im_end|>"}, {163587, "<|im_user|>"}, {163588, "<|im_assistant|>"},
              {163594, "<|im_system|>"}, {163601, "<|im_middle|>"}, {163606, "<think>"}, {163607, "</think>"},
              {163838, "[UNK]"}, {163839, "[PAD]"}, {163700, "<|reserved_token_163700|>"}};
    for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++) {
        assert_int_equal(tok_token_id(K, sp[i].name, strlen(sp[i].name)), sp[i].id);
        assert_true(tok_is_special(K, sp[i].id));
    }
    assert_false(tok_is_special(K, 163583));
    const int32_t *stop;
    size_t ns = tok_stop_ids(K, &stop);
    int eos = 0, im_end = 0;
    for (size_t i = 0; i < ns; i++) {
        eos |= stop[i] == 163585;
        im_end |= stop[i] == 163586;
    }
    assert_true(eos && im_end);
    assert_int_equal(ns, 2);
}

static void tokenizer_kimi_matches_tiktoken(void **state) {
    (void)state;
    size_t i, bad = 0;
    json_t *it;
    json_array_foreach(json_object_get(STR, "strings"), i, it) {
        size_t len;
        char *s = fx_unhex(json_string_value(json_object_get(it, "hex")), &len);
        for (int special = 1; special >= 0; special--) {
            size_t nw, ng;
            int32_t *want = fx_ids(json_object_get(it, special ? "ids" : "ids_plain"), &nw), *got;
            specd_err err = {0};
            assert_int_equal(tok_encode(K, s, len, special, &got, &ng, &err), 0);
            if (!fx_ids_equal(got, ng, want, nw, special ? "kimi(allowed_special=all)" : "kimi(ordinary)", i)) bad++;
            char *d;
            size_t dl;
            assert_int_equal(tok_decode(K, got, ng, false, &d, &dl, &err), 0);
            assert_int_equal(dl, len);
            assert_memory_equal(d, s, len);
            free(d);
            free(got);
            free(want);
        }
        free(s);
    }
    printf("kimi: %zu strings x 2 modes compared with tiktoken, %zu mismatches\n",
           json_array_size(json_object_get(STR, "strings")), bad);
    assert_int_equal(bad, 0);
    assert_true(json_array_size(json_object_get(STR, "strings")) >= 500);
}

/* REFERENCE's warning: PCRE2 compiles "&&[^\p{Han}]" without error and means
 * something else. Show that on the literal class, and that the rewrite keeps
 * uppercase non-Han runs whole and Han out. */
static void tokenizer_kimi_class_intersection(void **state) {
    (void)state;
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *lit = pcre2_compile((PCRE2_SPTR) "^[\\p{Lu}&&[^\\p{Han}]]+", PCRE2_ZERO_TERMINATED,
                                    PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    assert_non_null(lit);
    pcre2_match_data *md = pcre2_match_data_create(4, NULL);
    assert_true(pcre2_match(lit, (PCRE2_SPTR) "ABC", 3, 0, 0, md, NULL) < 0 ||
                pcre2_get_ovector_pointer(md)[1] != 3); /* the literal class does not match "ABC" */
    pcre2_code_free(lit);
    pcre2_match_data_free(md);
    /* the rewrite: "ABCdef" is one piece (upper* lower+), "漢字" another */
    const char *s = "ABCdef漢字";
    int32_t *ids;
    size_t n;
    specd_err err = {0};
    assert_int_equal(tok_encode(K, s, strlen(s), false, &ids, &n, &err), 0);
    size_t off = 0, cut_ok = 0;
    for (size_t i = 0; i < n; i++) {
        size_t l;
        tok_token_bytes(K, ids[i], &l);
        off += l;
        cut_ok |= off == 6; /* a token boundary between "ABCdef" and the Han run */
    }
    assert_true(cut_ok);
    free(ids);
}

/* One family's conversations: render == jinja2, encode == tiktoken. */
static void check_conversations(tokenizer *t, const json_t *convs, const char *what) {
    size_t i, n_inj = 0, n_masked = 0;
    json_t *c;
    json_array_foreach(convs, i, c) {
        const json_t *ms = json_object_get(c, "messages");
        size_t n = json_array_size(ms), len, nid, nw;
        chat_message m[16] = {{0}};
        assert_true(n <= 16);
        for (size_t k = 0; k < n; k++) {
            const json_t *jm = json_array_get(ms, k);
            m[k].role = json_string_value(json_object_get(jm, "role"));
            m[k].content = json_string_value(json_object_get(jm, "content"));
            m[k].name = json_string_value(json_object_get(jm, "name"));
        }
        const json_t *th = json_object_get(c, "thinking");
        chat_options opt = {.add_generation_prompt = json_is_true(json_object_get(c, "add_generation_prompt")),
                            .thinking = th ? json_is_true(th) : -1,
                            .default_system = json_string_value(json_object_get(c, "default_system"))};
        char *text;
        specd_err err = {0};
        if (tok_chat_render(t, m, n, &opt, &text, &len, &err) < 0) fail_msg("%s #%zu: %s", what, i, err.msg);
        const char *want = json_string_value(json_object_get(c, "rendered"));
        if (strcmp(text, want) != 0) fail_msg("%s #%zu:\n got: [%s]\nwant: [%s]", what, i, text, want);
        free(text);
        int32_t *ids;
        uint8_t *mask;
        assert_int_equal(tok_chat_encode(t, m, n, &opt, &ids, &nid, &mask, &err), 0);
        int32_t *w = fx_ids(json_object_get(c, "ids_plain"), &nw);
        assert_true(fx_ids_equal(ids, nid, w, nw, what, i));
        free(w);
        if (json_is_true(json_object_get(c, "injected_specials"))) {
            n_inj++;
            size_t n_end = 0, turns = n + (strcmp(m[0].role, "system") != 0 && strcmp(what, "K2") == 0);
            for (size_t k = 0; k < nid; k++) n_end += ids[k] == 163586;
            assert_int_equal(n_end, turns); /* typed "<|im_end|>" stayed text */
        } else {
            w = fx_ids(json_object_get(c, "ids"), &nw); /* tiktoken encode(rendered, allowed_special="all") */
            assert_true(fx_ids_equal(ids, nid, w, nw, what, i));
            free(w);
            int32_t *wm = fx_ids(json_object_get(c, "mask"), &nw);
            for (size_t k = 0; k < nid; k++) {
                if (mask[k] != wm[k]) fail_msg("%s #%zu: mask differs at token %zu", what, i, k);
                n_masked += mask[k];
            }
            free(wm);
        }
        free(ids);
        free(mask);
    }
    printf("kimi chat %s: %zu conversations byte-identical to jinja2 and id-identical to tiktoken "
           "(%zu with typed specials, %zu masked tokens)\n", what, json_array_size(convs), n_inj, n_masked);
    assert_true(json_array_size(convs) >= 10 && n_inj >= 1 && n_masked > 10);
}

static void tokenizer_kimi_chat_k2_template(void **state) {
    (void)state;
    char cfg[4200];
    snprintf(cfg, sizeof cfg, "%s", RANKS);
    char *slash = strrchr(cfg, '/');
    snprintf(slash ? slash + 1 : cfg, sizeof cfg - (size_t)(slash ? slash + 1 - cfg : 0),
             "tokenizer_config.k2-instruct.json");
    tokenizer *t;
    specd_err err = {0};
    if (tok_create_from_tiktoken(RANKS, cfg, &t, &err) < 0) fail_msg("%s", err.msg);
    assert_string_equal(t->default_system, "You are a helpful assistant");
    assert_false(t->chat_think);
    check_conversations(t, json_object_get(json_object_get(CHAT, "k2"), "conversations"), "K2");
    /* a tool result without tool_call_id: refused */
    chat_message tm[2] = {{.role = "user", .content = "x"}, {.role = "tool", .content = "{}"}};
    chat_options opt = {.thinking = -1};
    char *text;
    size_t len;
    assert_int_equal(tok_chat_render(t, tm, 2, &opt, &text, &len, &err), -1);
    printf("refused: %s\n", err.msg);
    tok_destroy(t);
}

static void tokenizer_kimi_chat_k25_template(void **state) {
    (void)state;
    const json_t *k25 = json_object_get(CHAT, "k25");
    const char *tpl = json_string_value(json_object_get(k25, "template"));
    specd_err err = {0};
    assert_int_equal(K->chat, CHAT_KIMI); /* bare tiktoken tokenizer: K2.5 style by vocabulary */
    assert_true(K->chat_think);
    assert_int_equal(tok_set_chat_template(K, tpl, strlen(tpl), &err), 0);
    assert_true(K->chat_think);
    assert_null(K->default_system);
    check_conversations(K, json_object_get(k25, "conversations"), "K2.5");
}

int main(void) {
    const char *r = fx_env("SPECD_KIMI_TIKTOKEN");
    if (r) snprintf(RANKS, sizeof RANKS, "%s", r);
    else snprintf(RANKS, sizeof RANKS, "%s/../shared/data/kimi-k2/tiktoken.model",
                  fx_env("SPECD_SOURCE_DIR") ? fx_env("SPECD_SOURCE_DIR") : ".");
    FILE *f = fopen(RANKS, "rb");
    if (!f) {
        printf("SKIP: Kimi ranks file %s not found (set SPECD_KIMI_TIKTOKEN)\n", RANKS);
        return 77;
    }
    fclose(f);
    specd_err err = {0};
    if (tok_create_from_tiktoken(RANKS, NULL, &K, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    STR = fx_load_json("kimi_strings.json");
    CHAT = fx_load_json("kimi_chat.json");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tokenizer_kimi_reference_vector),
        cmocka_unit_test(tokenizer_kimi_specials),
        cmocka_unit_test(tokenizer_kimi_matches_tiktoken),
        cmocka_unit_test(tokenizer_kimi_class_intersection),
        cmocka_unit_test(tokenizer_kimi_chat_k2_template),
        cmocka_unit_test(tokenizer_kimi_chat_k25_template),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    json_decref(STR);
    json_decref(CHAT);
    tok_destroy(K);
    return rc;
}
