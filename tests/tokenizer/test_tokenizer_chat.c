/*
 * test_tokenizer_chat.c: the ChatML template of SmolLM2 rendered natively,
 * against jinja2 rendering the GGUF's own tokenizer.chat_template, and
 * tok_chat_encode against HF tokenizers' encode of that rendering (specials
 * parsed) with the assistant mask from HF's offsets
 * (tests/fixtures/tokenizer/smollm2_chat.json, tools/gen_tokenizer_fixtures.py).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "engine/tokenizer/tok_internal.h"
#include "tok_fixture.h"

static tokenizer *T;
static json_t *CHAT;

/* Builds chat_message[] from a JSON array of {role, content}. */
static chat_message *msgs_of(const json_t *arr, size_t *n) {
    *n = json_array_size(arr);
    chat_message *m = calloc(*n ? *n : 1, sizeof *m);
    for (size_t i = 0; i < *n; i++) {
        m[i].role = json_string_value(json_object_get(json_array_get(arr, i), "role"));
        m[i].content = json_string_value(json_object_get(json_array_get(arr, i), "content"));
    }
    return m;
}

static void tokenizer_chat_template_from_gguf(void **state) {
    (void)state;
    assert_int_equal(T->chat, CHAT_CHATML);
    assert_string_equal(T->default_system, json_string_value(json_object_get(CHAT, "default_system")));
    assert_string_equal(T->chat_template, json_string_value(json_object_get(CHAT, "template")));
}

static void tokenizer_chat_render_matches_jinja(void **state) {
    (void)state;
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(CHAT, "conversations"), i, c) {
        size_t n, len;
        chat_message *m = msgs_of(json_object_get(c, "messages"), &n);
        chat_options opt = {.add_generation_prompt = json_is_true(json_object_get(c, "add_generation_prompt")),
                            .thinking = -1};
        char *text;
        specd_err err = {0};
        assert_int_equal(tok_chat_render(T, m, n, &opt, &text, &len, &err), 0);
        const char *want = json_string_value(json_object_get(c, "rendered"));
        if (strcmp(text, want) != 0) fail_msg("conversation %zu:\n got: [%s]\nwant: [%s]", i, text, want);
        assert_int_equal(len, strlen(want));
        free(text);
        free(m);
    }
    printf("render: %zu conversations byte-identical to jinja2\n", json_array_size(json_object_get(CHAT, "conversations")));
    assert_true(json_array_size(json_object_get(CHAT, "conversations")) >= 20);
    json_array_foreach(json_object_get(CHAT, "custom_system"), i, c) {
        size_t n, len;
        chat_message *m = msgs_of(json_object_get(c, "messages"), &n);
        chat_options opt = {.add_generation_prompt = true, .thinking = -1,
                            .default_system = json_string_value(json_object_get(c, "default_system"))};
        char *text;
        specd_err err = {0};
        assert_int_equal(tok_chat_render(T, m, n, &opt, &text, &len, &err), 0);
        assert_string_equal(text, json_string_value(json_object_get(c, "rendered")));
        free(text);
        /* "" disables the default: the rendering without its system turn */
        opt.default_system = "";
        assert_int_equal(tok_chat_render(T, m, n, &opt, &text, &len, &err), 0);
        const char *with = json_string_value(json_object_get(json_array_get(json_object_get(CHAT, "conversations"), 2 * i + 1), "rendered"));
        if (strcmp(m[0].role, "system") != 0) with = strstr(with, "<|im_end|>\n") + strlen("<|im_end|>\n");
        assert_string_equal(text, with);
        free(text);
        free(m);
    }
}

static void tokenizer_chat_encode_matches_hf(void **state) {
    (void)state;
    size_t i, n_injected = 0, n_masked = 0;
    json_t *c;
    json_array_foreach(json_object_get(CHAT, "conversations"), i, c) {
        size_t n, nid, nw;
        chat_message *m = msgs_of(json_object_get(c, "messages"), &n);
        chat_options opt = {.add_generation_prompt = json_is_true(json_object_get(c, "add_generation_prompt")),
                            .thinking = -1};
        int32_t *ids;
        uint8_t *mask;
        specd_err err = {0};
        assert_int_equal(tok_chat_encode(T, m, n, &opt, &ids, &nid, &mask, &err), 0);
        /* structural ids + every text stretch as plain text (HF with encode_special_tokens) */
        int32_t *want = fx_ids(json_object_get(c, "ids_plain"), &nw);
        assert_true(fx_ids_equal(ids, nid, want, nw, "chat ids_plain", i));
        free(want);
        if (json_is_true(json_object_get(c, "injected_specials"))) {
            /* typed "<|im_end|>" stays text: id 2 appears once per turn only */
            n_injected++;
            size_t n_im_end = 0, turns = n + (strcmp(m[0].role, "system") != 0);
            for (size_t k = 0; k < nid; k++) n_im_end += ids[k] == 2;
            assert_int_equal(n_im_end, turns);
        } else {
            /* identical to HF's encode of the jinja rendering, specials parsed */
            want = fx_ids(json_object_get(c, "ids"), &nw);
            assert_true(fx_ids_equal(ids, nid, want, nw, "chat ids", i));
            free(want);
            int32_t *wm = fx_ids(json_object_get(c, "mask"), &nw);
            for (size_t k = 0; k < nid; k++) {
                if (mask[k] != wm[k]) fail_msg("conversation %zu: mask differs at token %zu", i, k);
                n_masked += mask[k];
            }
            free(wm);
        }
        free(ids);
        free(mask);
        free(m);
    }
    printf("chat encode: %zu conversations (%zu with typed special strings), %zu masked tokens\n",
           json_array_size(json_object_get(CHAT, "conversations")), n_injected, n_masked);
    assert_true(n_injected >= 2);
    assert_true(n_masked > 20);
}

static void tokenizer_chat_refuses_unknown_templates(void **state) {
    (void)state;
    static const char *const bad[] = {
        "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if tools %}<tools>{{ tools }}</tools>{% endif %}",
    };
    for (size_t k = 0; k < 2; k++) {
        tokenizer *t = fx_smollm2();
        specd_err err = {0};
        assert_int_equal(tok_set_chat_template(t, bad[k], strlen(bad[k]), &err), 0);
        chat_message m = {.role = "user", .content = "hi"};
        chat_options opt = {.add_generation_prompt = true, .thinking = -1};
        char *text;
        size_t len;
        assert_int_equal(tok_chat_render(t, &m, 1, &opt, &text, &len, &err), -1);
        assert_non_null(strstr(err.msg, "chat template"));
        printf("refused: %s\n", err.msg);
        tok_destroy(t);
    }
    chat_message nor = {.role = NULL, .content = "x"};
    chat_options opt = {0};
    char *text;
    size_t len;
    specd_err err = {0};
    assert_int_equal(tok_chat_render(T, &nor, 1, &opt, &text, &len, &err), -1);
}

int main(void) {
    fx_require_model();
    T = fx_smollm2();
    CHAT = fx_load_json("smollm2_chat.json");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tokenizer_chat_template_from_gguf),
        cmocka_unit_test(tokenizer_chat_render_matches_jinja),
        cmocka_unit_test(tokenizer_chat_encode_matches_hf),
        cmocka_unit_test(tokenizer_chat_refuses_unknown_templates),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    json_decref(CHAT);
    tok_destroy(T);
    gguf_close(fx_gguf);
    return rc;
}
