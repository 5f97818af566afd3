/*
 * test_oai.c: the OpenAI schema layer.
 *  - every bad input of issue 3 that the parser owns -> status 400 (param,
 *    message fragment); good inputs -> the exact native oai_request /
 *    sampling_params fields;
 *  - the context checks (prompt too long, max_tokens beyond context,
 *    missing max_tokens = remaining context, echo with max_tokens 0);
 *  - UTF-8 validation (RFC 3629 cases);
 *  - response and SSE shapes against hand-written OpenAI JSON.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/oai.h"

static int parse_c(const char *body, oai_request *r, oai_error *e) {
    return oai_parse_request(OAI_COMPLETION, body, strlen(body), r, e);
}
static int parse_chat(const char *body, oai_request *r, oai_error *e) {
    return oai_parse_request(OAI_CHAT, body, strlen(body), r, e);
}

/* ---- bad inputs ---- */
typedef struct bad_case {
    oai_kind kind;
    const char *body;
    const char *param;   /* expected param ("" = null) */
    const char *msg;     /* fragment of the message */
} bad_case;

static const bad_case BAD[] = {
    {OAI_COMPLETION, "{\"prompt\": \"x\"", "", "malformed JSON"},
    {OAI_COMPLETION, "[1,2]", "", "must be a JSON object, got an array"},
    {OAI_COMPLETION, "42", "", "must be a JSON object"},
    {OAI_COMPLETION, "null", "", "must be a JSON object, got null"},
    {OAI_COMPLETION, "", "", "empty"},
    {OAI_COMPLETION, "{}", "prompt", "'prompt' is required"},
    {OAI_COMPLETION, "{\"prompt\": 5}", "prompt", "'prompt' must be a string"},
    {OAI_COMPLETION, "{\"prompt\": \"\"}", "prompt", "must not be empty"},
    {OAI_COMPLETION, "{\"prompt\": []}", "prompt", "must not be empty"},
    {OAI_COMPLETION, "{\"prompt\": [[]]}", "prompt", "empty token list"},
    {OAI_COMPLETION, "{\"prompt\": [\"a\", \"\"]}", "prompt", "empty string"},
    {OAI_COMPLETION, "{\"prompt\": [1, -5]}", "prompt", "token id -5"},
    {OAI_COMPLETION, "{\"prompt\": [1, \"a\"]}", "prompt", "must be integers"},
    {OAI_COMPLETION, "{\"prompt\": [\"a\", [1]]}", "prompt", "mixes"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"model\": 3}", "model", "'model' must be a string"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 0}", "max_tokens", "at least 1"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": -3}", "max_tokens", "at least 1"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": \"10\"}", "max_tokens", "must be an integer"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 1.5}", "max_tokens", "must be an integer"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"n\": 0}", "n", "\'n\' is out of range: must be in [1, 128]"},
    {OAI_COMPLETION, "{\"prompt\": [\"a\", \"b\", \"c\"], \"n\": 64}", "n", "3 prompts x n = 64 is 192 choices"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"temperature\": -0.1}", "temperature", "\'temperature\' is out of range: must be in [0"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"temperature\": \"hot\"}", "temperature", "must be a number"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"top_p\": 0}", "top_p", "\'top_p\' is out of range: must be in (0, 1]"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"top_p\": 1.01}", "top_p", "\'top_p\' is out of range: must be in (0, 1]"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": 21}", "logprobs", "at most 20"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": -1}", "logprobs", "must be in [0"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"stop\": 7}", "stop", "string or an array of strings"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"stop\": [\"a\", 1]}", "stop", "element 1 must be a string"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"stop\": [\"\"]}", "stop", "must not be empty"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"stop_token_ids\": [-1]}", "stop_token_ids", "out of range"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"stream\": \"yes\"}", "stream", "must be a boolean"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"stream_options\": {\"include_usage\": true}}", "stream_options",
     "only allowed with stream=true"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"echo\": 1}", "echo", "must be a boolean"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"echo\": true, \"logprobs\": 1, \"stream\": true}", "logprobs",
     "not supported when streaming"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"presence_penalty\": 3}", "presence_penalty", "[-2, 2]"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"repetition_penalty\": 0}", "repetition_penalty", "(0,"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"min_tokens\": 5, \"max_tokens\": 2}", "min_tokens", "must not exceed"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"top_k\": -2}", "top_k", "must be in [-1,"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"min_p\": 1.5}", "min_p", "[0, 1]"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"seed\": \"1\"}", "seed", "must be an integer"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"user\": 5}", "user", "'user' must be a string"},
    {OAI_COMPLETION, "{\"prompt\": \"x\", \"prompt\": \"y\"}", "", "malformed JSON"},
    {OAI_COMPLETION, "{\"prompt\": \"\\ud800\"}", "", "malformed JSON"},
    {OAI_CHAT, "{}", "messages", "'messages' is required"},
    {OAI_CHAT, "{\"messages\": []}", "messages", "must not be empty"},
    {OAI_CHAT, "{\"messages\": {}}", "messages", "must be an array"},
    {OAI_CHAT, "{\"messages\": [\"hi\"]}", "messages", "messages[0] must be an object"},
    {OAI_CHAT, "{\"messages\": [{\"role\": 1, \"content\": \"hi\"}]}", "messages", "messages[0].role must be a string"},
    {OAI_CHAT, "{\"messages\": [{\"content\": \"hi\"}]}", "messages", "role must be a string, got nothing"},
    {OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", "messages", "content must be a string"},
    {OAI_CHAT, "{\"messages\": [{\"role\": \"user\"}]}", "messages", "content must be a string"},
    {OAI_CHAT, "{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}", "messages", "role must be system"},
    {OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", "messages",
     "only text parts"},
    {OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": 3}", "logprobs",
     "must be a boolean"},
    {OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": true, \"top_logprobs\": 21}",
     "top_logprobs", "at most 20"},
    {OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"top_logprobs\": 2}", "top_logprobs",
     "requires 'logprobs': true"},
    {OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": 0}", "max_tokens",
     "at least 1"},
    {OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_completion_tokens\": -1}",
     "max_completion_tokens", "'max_completion_tokens' must be at least 1"},
};

static void test_bad_inputs(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        oai_request r;
        oai_error e;
        memset(&e, 0, sizeof e);
        int rc = oai_parse_request(BAD[i].kind, BAD[i].body, strlen(BAD[i].body), &r, &e);
        if (rc != -1 || e.status != 400 || strcmp(e.param, BAD[i].param) || !strstr(e.message, BAD[i].msg) ||
            strcmp(e.type, "invalid_request_error")) {
            print_error("case %zu body=%s -> rc=%d status=%d param='%s' type=%s message='%s'\n", i, BAD[i].body, rc,
                        e.status, e.param, e.type, e.message);
            fail();
        }
        /* the request was freed and zeroed */
        assert_null(r.prompts);
        assert_null(r.messages);
    }
}

static void test_invalid_utf8_body(void **state) {
    (void)state;
    const char body[] = "{\"prompt\": \"ab\xC3\x28\"}";
    oai_request r;
    oai_error e;
    assert_int_equal(oai_parse_request(OAI_COMPLETION, body, strlen(body), &r, &e), -1);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "not valid UTF-8 (byte offset 14)"));
    /* an embedded NUL byte inside JSON text is malformed JSON, not a crash */
    const char nul[] = "{\"prompt\": \"a\0b\"}";
    assert_int_equal(oai_parse_request(OAI_COMPLETION, nul, sizeof nul - 1, &r, &e), -1);
    assert_int_equal(e.status, 400);
}

static void test_utf8_validator(void **state) {
    (void)state;
    struct {
        const char *s;
        size_t bad_at; /* (size_t)-1 = valid */
    } cases[] = {
        {"plain ascii", (size_t)-1},
        {"caf\xC3\xA9", (size_t)-1},
        {"\xE2\x82\xAC euro", (size_t)-1},
        {"\xF0\x9F\x98\x80", (size_t)-1},
        {"\xF4\x8F\xBF\xBF", (size_t)-1},     /* U+10FFFF */
        {"a\xC0\xAF", 1},                     /* overlong '/' */
        {"ab\xE0\x80\xAF", 2},                /* overlong 3-byte */
        {"\xED\xA0\x80", 0},                  /* surrogate U+D800 */
        {"\xF4\x90\x80\x80", 0},              /* > U+10FFFF */
        {"x\xE2\x82", 1},                     /* truncated */
        {"\x80", 0},                          /* lone continuation */
        {"\xFF", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len = strlen(cases[i].s);
        size_t got = oai_utf8_invalid_at(cases[i].s, len);
        size_t want = cases[i].bad_at == (size_t)-1 ? len : cases[i].bad_at;
        if (got != want) {
            print_error("case %zu: got %zu want %zu\n", i, got, want);
            fail();
        }
    }
    size_t ol;
    char *s = oai_utf8_sanitize("a\xFF" "b\xE2\x82", 5, &ol);
    assert_string_equal(s, "a\xEF\xBF\xBD" "b\xEF\xBF\xBD\xEF\xBF\xBD");
    free(s);
}

/* ---- good inputs ---- */
static void test_completion_good(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    const char *body =
        "{\"model\":\"m\",\"prompt\":\"Hello\",\"max_tokens\":7,\"temperature\":0.5,\"top_p\":0.9,\"top_k\":40,"
        "\"min_p\":0.05,\"seed\":1234,\"stop\":[\"\\n\",\"END\"],\"stop_token_ids\":[2,3],\"n\":2,\"logprobs\":3,"
        "\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,\"repetition_penalty\":1.1,\"ignore_eos\":true,"
        "\"min_tokens\":2,\"stream\":true,\"stream_options\":{\"include_usage\":true},\"user\":\"u\","
        "\"skip_special_tokens\":false}";
    assert_int_equal(parse_c(body, &r, &e), 0);
    assert_int_equal(r.kind, OAI_COMPLETION);
    assert_string_equal(r.model, "m");
    assert_int_equal(r.n_prompts, 1);
    assert_false(r.prompts[0].is_ids);
    assert_string_equal(r.prompts[0].text, "Hello");
    assert_int_equal(r.prompts[0].text_len, 5);
    assert_true(r.has_max_tokens);
    assert_int_equal(r.max_tokens, 7);
    assert_true(r.sp.temperature == 0.5f);
    assert_true(r.sp.top_p == 0.9f);
    assert_int_equal(r.sp.top_k, 40);
    assert_true(r.sp.min_p == 0.05f);
    assert_true(r.sp.has_seed);
    assert_int_equal(r.sp.seed, 1234);
    assert_int_equal(r.sp.n_stop, 2);
    assert_string_equal(r.sp.stop[0], "\n");
    assert_string_equal(r.sp.stop[1], "END");
    assert_int_equal(r.sp.n_stop_token_ids, 2);
    assert_int_equal(r.sp.stop_token_ids[1], 3);
    assert_int_equal(r.n, 2);
    assert_int_equal(r.logprobs, 3);
    assert_int_equal(r.sp.logprobs, 3);
    assert_true(r.sp.presence_penalty == 0.5f);
    assert_true(r.sp.frequency_penalty == -0.5f);
    assert_true(r.sp.repetition_penalty == 1.1f);
    assert_true(r.sp.ignore_eos);
    assert_int_equal(r.sp.min_tokens, 2);
    assert_true(r.stream);
    assert_true(r.include_usage);
    assert_false(r.sp.skip_special_tokens);
    assert_false(r.echo);
    oai_request_free(&r);
    assert_null(r.prompts);
}

static void test_completion_defaults(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(parse_c("{\"prompt\":\"x\",\"max_tokens\":null,\"stop\":null,\"logprobs\":null}", &r, &e), 0);
    sampling_params d;
    sampling_params_init(&d);
    assert_true(r.sp.temperature == d.temperature);
    assert_true(r.sp.top_p == d.top_p);
    assert_int_equal(r.sp.top_k, d.top_k);
    assert_false(r.sp.has_seed);
    assert_int_equal(r.sp.n_stop, 0);
    assert_int_equal(r.logprobs, -1);
    assert_int_equal(r.sp.logprobs, -1);
    assert_true(r.sp.skip_special_tokens);
    assert_false(r.has_max_tokens);
    assert_int_equal(r.n, 1);
    assert_null(r.model);
    oai_request_free(&r);
}

static void test_prompt_forms(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(parse_c("{\"prompt\":[1,2,3]}", &r, &e), 0);
    assert_int_equal(r.n_prompts, 1);
    assert_true(r.prompts[0].is_ids);
    assert_int_equal(r.prompts[0].n_ids, 3);
    assert_int_equal(r.prompts[0].ids[2], 3);
    oai_request_free(&r);
    assert_int_equal(parse_c("{\"prompt\":[\"a\",\"bc\"]}", &r, &e), 0);
    assert_int_equal(r.n_prompts, 2);
    assert_string_equal(r.prompts[1].text, "bc");
    oai_request_free(&r);
    assert_int_equal(parse_c("{\"prompt\":[[5],[6,7]]}", &r, &e), 0);
    assert_int_equal(r.n_prompts, 2);
    assert_int_equal(r.prompts[1].n_ids, 2);
    assert_int_equal(r.prompts[1].ids[1], 7);
    oai_request_free(&r);
    /* echo with max_tokens 0 is accepted (returns the echo only) */
    assert_int_equal(parse_c("{\"prompt\":\"a\",\"echo\":true,\"max_tokens\":0}", &r, &e), 0);
    assert_true(r.echo);
    assert_true(r.has_max_tokens);
    assert_int_equal(r.max_tokens, 0);
    oai_request_free(&r);
    /* max_completion_tokens wins */
    assert_int_equal(parse_c("{\"prompt\":\"a\",\"max_tokens\":5,\"max_completion_tokens\":9}", &r, &e), 0);
    assert_int_equal(r.max_tokens, 9);
    oai_request_free(&r);
    /* a single stop string; integral float accepted for ints */
    assert_int_equal(parse_c("{\"prompt\":\"a\",\"stop\":\"###\",\"n\":2.0}", &r, &e), 0);
    assert_int_equal(r.sp.n_stop, 1);
    assert_string_equal(r.sp.stop[0], "###");
    assert_int_equal(r.n, 2);
    oai_request_free(&r);
}

static void test_chat_good(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    const char *body = "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"S\"},"
                       "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\","
                       "\"text\":\"b\"}],\"name\":\"bob\"},{\"role\":\"developer\",\"content\":\"D\"}],"
                       "\"logprobs\":true,\"top_logprobs\":5,\"max_completion_tokens\":12}";
    assert_int_equal(parse_chat(body, &r, &e), 0);
    assert_int_equal(r.n_messages, 3);
    assert_string_equal(r.messages[0].role, "system");
    assert_string_equal(r.messages[0].content, "S");
    assert_string_equal(r.messages[1].content, "a\nb");
    assert_string_equal(r.messages[1].name, "bob");
    assert_string_equal(r.messages[2].role, "system"); /* developer -> system */
    assert_int_equal(r.logprobs, 5);
    assert_int_equal(r.sp.logprobs, 5);
    assert_int_equal(r.max_tokens, 12);
    assert_true(r.add_generation_prompt);
    oai_request_free(&r);
    assert_int_equal(parse_chat("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true}", &r, &e), 0);
    assert_int_equal(r.logprobs, 0);
    assert_int_equal(r.thinking, -1); /* no chat_template_kwargs: the template's default */
    oai_request_free(&r);
    /* chat_template_kwargs (vLLM): thinking / enable_thinking switch Kimi's thinking mode */
    assert_int_equal(parse_chat("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                "\"chat_template_kwargs\":{\"thinking\":false}}", &r, &e), 0);
    assert_int_equal(r.thinking, 0);
    oai_request_free(&r);
    assert_int_equal(parse_chat("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                "\"chat_template_kwargs\":{\"enable_thinking\":true}}", &r, &e), 0);
    assert_int_equal(r.thinking, 1);
    oai_request_free(&r);
    assert_int_equal(parse_chat("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                "\"chat_template_kwargs\":{\"thinking\":\"no\"}}", &r, &e), -1);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "'thinking' must be a boolean"));
    assert_int_equal(parse_chat("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                "\"chat_template_kwargs\":[1]}", &r, &e), -1);
    assert_int_equal(e.status, 400);
}

/* ---- context checks ---- */
static void test_resolve_max_tokens(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    int32_t mt;
    assert_int_equal(parse_c("{\"prompt\":\"x\"}", &r, &e), 0);
    assert_int_equal(oai_resolve_max_tokens(&r, 10, 100, &mt, &e), 0);
    assert_int_equal(mt, 90); /* missing -> remaining context */
    assert_int_equal(oai_resolve_max_tokens(&r, 100, 100, &mt, &e), -1);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "no room"));
    assert_int_equal(oai_resolve_max_tokens(&r, 101, 100, &mt, &e), -1);
    assert_non_null(strstr(e.message, "maximum context length is 100 tokens. However, your prompt has 101 tokens"));
    assert_int_equal(oai_resolve_max_tokens(&r, 0, 100, &mt, &e), -1);
    assert_non_null(strstr(e.message, "empty"));
    oai_request_free(&r);
    assert_int_equal(parse_c("{\"prompt\":\"x\",\"max_tokens\":50}", &r, &e), 0);
    assert_int_equal(oai_resolve_max_tokens(&r, 50, 100, &mt, &e), 0);
    assert_int_equal(mt, 50);
    assert_int_equal(oai_resolve_max_tokens(&r, 51, 100, &mt, &e), -1);
    assert_string_equal(e.param, "max_tokens");
    assert_non_null(strstr(e.message, "you requested 101 tokens (51 in the prompt, 50 in the completion)"));
    oai_request_free(&r);
    assert_int_equal(parse_c("{\"prompt\":\"x\",\"max_tokens\":0,\"echo\":true}", &r, &e), 0);
    assert_int_equal(oai_resolve_max_tokens(&r, 5, 100, &mt, &e), 0);
    assert_int_equal(mt, 0);
    oai_request_free(&r);
}

static void test_check_ids(void **state) {
    (void)state;
    oai_error e;
    int32_t ok[] = {0, 5, 99};
    assert_int_equal(oai_check_ids(ok, 3, 100, "prompt", &e), 0);
    int32_t bad[] = {0, 100};
    assert_int_equal(oai_check_ids(bad, 2, 100, "prompt", &e), -1);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "prompt");
    assert_non_null(strstr(e.message, "token id 100 at index 1 is out of vocabulary [0, 100)"));
}

/* ---- errors and responses ---- */
static void test_error_json(void **state) {
    (void)state;
    oai_error e;
    oai_error_set(&e, 400, "top_p", "bad %s", "value");
    char *j = oai_error_json(&e, NULL);
    assert_string_equal(j, "{\"error\":{\"message\":\"bad value\",\"type\":\"invalid_request_error\",\"param\":"
                           "\"top_p\",\"code\":null}}");
    free(j);
    oai_error_set(&e, 401, NULL, "no key");
    j = oai_error_json(&e, NULL);
    assert_string_equal(j, "{\"error\":{\"message\":\"no key\",\"type\":\"authentication_error\",\"param\":null,"
                           "\"code\":\"invalid_api_key\"}}");
    free(j);
    oai_error_set(&e, 404, "model", "The model `x` does not exist.");
    j = oai_error_json(&e, NULL);
    assert_string_equal(j, "{\"error\":{\"message\":\"The model `x` does not exist.\",\"type\":\"NotFoundError\","
                           "\"param\":\"model\",\"code\":\"model_not_found\"}}");
    free(j);
    oai_error_set(&e, 429, NULL, "busy");
    assert_string_equal(e.type, "rate_limit_error");
    oai_error_set(&e, 413, NULL, "big");
    assert_string_equal(e.type, "invalid_request_error");
}

static const char *fake_tok(void *ctx, int32_t id, size_t *len) {
    (void)ctx;
    static const char *pieces[] = {"Hel", "lo", "\xE2\x82", "!"};
    if (id < 0 || id > 3) return NULL;
    *len = strlen(pieces[id]);
    return pieces[id];
}

static void test_response_shapes(void **state) {
    (void)state;
    oai_resp_ctx rc = {.kind = OAI_COMPLETION, .id = "cmpl-1", .created = 1700000000, .model = "m", .logprobs = -1};
    oai_choice ch[2];
    memset(ch, 0, sizeof ch);
    int32_t ids[2] = {0, 1};
    engine_output o = {.token_ids = ids, .n_tokens = 2, .text = "Hello", .text_len = 5, .finish = FINISH_LENGTH,
                       .stop_token_id = -1, .n_prompt_tokens = 3, .n_completion_tokens = 2};
    ch[0].index = 0;
    ch[1].index = 1;
    assert_int_equal(oai_choice_add(&ch[0], &o), 0);
    o.text = " world";
    o.text_len = 6;
    o.finish = FINISH_STOP;
    snprintf(o.stop_reason, sizeof o.stop_reason, "END");
    o.n_completion_tokens = 4;
    assert_int_equal(oai_choice_add(&ch[1], &o), 0);
    char *j = oai_response_json(&rc, ch, 2, 3, NULL);
    assert_string_equal(j, "{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1700000000,\"model\":\"m\",\"system_fingerprint\":\"" OAI_SYSTEM_FINGERPRINT "\","
                           "\"choices\":[{\"index\":0,\"text\":\"Hello\",\"logprobs\":null,\"finish_reason\":\"length\","
                           "\"stop_reason\":null},{\"index\":1,\"text\":\" world\",\"logprobs\":null,\"finish_reason\":"
                           "\"stop\",\"stop_reason\":\"END\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":6,"
                           "\"total_tokens\":9}}");
    free(j);
    rc.kind = OAI_CHAT;
    rc.id = "chatcmpl-1";
    j = oai_response_json(&rc, ch, 1, 3, NULL);
    assert_string_equal(j, "{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion\",\"created\":1700000000,\"model\":"
                           "\"m\",\"system_fingerprint\":\"" OAI_SYSTEM_FINGERPRINT "\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"Hello\"},"
                           "\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}],\"usage\":{"
                           "\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}");
    free(j);
    oai_choice_free(&ch[0]);
    oai_choice_free(&ch[1]);
}

static void test_echo_logprobs_shape(void **state) {
    (void)state;
    /* prompt [0, 1] ("Hel" "lo") echoed, then generated [3] ("!"): the first prompt token has null logprobs */
    token_logprob plp = {.id = 1, .logprob = -2.0f, .n_top = 1, .top_ids = {1}, .top_logprobs = {-2.0f}};
    token_logprob glp = {.id = 3, .logprob = -0.5f, .n_top = 1, .top_ids = {3}, .top_logprobs = {-0.5f}};
    int32_t gen_id = 3;
    engine_output o = {.token_ids = &gen_id, .n_tokens = 1, .logprobs = &glp, .text = "!", .text_len = 1,
                       .finish = FINISH_LENGTH, .stop_token_id = -1, .n_prompt_tokens = 2,
                       .n_completion_tokens = 1, .prompt_logprobs = &plp, .n_prompt_logprobs = 1};
    int32_t prompt[2] = {0, 1};
    oai_choice c;
    memset(&c, 0, sizeof c);
    c.echo_ids = prompt;
    c.n_echo_ids = 2;
    assert_int_equal(oai_choice_add(&c, &o), 0);
    /* the server prepends the echo text itself */
    free(c.text);
    c.text = strdup("Hello!");
    c.text_len = 6;
    oai_resp_ctx rc = {.kind = OAI_COMPLETION, .id = "c", .created = 1, .model = "m", .logprobs = 1,
                       .token_bytes = fake_tok};
    char *j = oai_response_json(&rc, &c, 1, 2, NULL);
    assert_string_equal(j, "{\"id\":\"c\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"system_fingerprint\":\"" OAI_SYSTEM_FINGERPRINT "\",\"choices\":[{"
                           "\"index\":0,\"text\":\"Hello!\",\"logprobs\":{\"tokens\":[\"Hel\",\"lo\",\"!\"],"
                           "\"token_logprobs\":[null,-2.0,-0.5],\"top_logprobs\":[null,{\"lo\":-2.0},{\"!\":-0.5}],"
                           "\"text_offset\":[0,3,5]},\"finish_reason\":\"length\",\"stop_reason\":null}],\"usage\":{"
                           "\"prompt_tokens\":2,\"completion_tokens\":1,\"total_tokens\":3}}");
    free(j);
    oai_choice_free(&c);
}

static void test_sse_frames(void **state) {
    (void)state;
    oai_resp_ctx rc = {.kind = OAI_CHAT, .id = "c", .created = 1, .model = "m", .logprobs = -1};
    size_t len;
    char *f = oai_chunk_sse(&rc, 0, "", 0, NULL, NULL, 0, 0, FINISH_NONE, NULL, -1, true, false, &len);
    assert_string_equal(f, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"system_fingerprint\":\"" OAI_SYSTEM_FINGERPRINT "\","
                           "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":"
                           "null,\"finish_reason\":null}]}\n\n");
    assert_int_equal(len, strlen(f));
    free(f);
    f = oai_chunk_sse(&rc, 1, "Hi", 2, NULL, NULL, 0, 0, FINISH_STOP, "", 2, false, true, &len);
    assert_string_equal(f, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"system_fingerprint\":\"" OAI_SYSTEM_FINGERPRINT "\","
                           "\"choices\":[{\"index\":1,\"delta\":{\"content\":\"Hi\"},\"logprobs\":null,"
                           "\"finish_reason\":\"stop\",\"stop_reason\":2}],\"usage\":null}\n\n");
    free(f);
    f = oai_usage_sse(&rc, 4, 5, &len);
    assert_string_equal(f, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"system_fingerprint\":\"" OAI_SYSTEM_FINGERPRINT "\","
                           "\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":5,\"total_tokens\":9}}"
                           "\n\n");
    free(f);
    rc.kind = OAI_COMPLETION;
    f = oai_chunk_sse(&rc, 0, "a\"b", 3, NULL, NULL, 0, 0, FINISH_NONE, NULL, -1, false, false, &len);
    assert_string_equal(f, "data: {\"id\":\"c\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"system_fingerprint\":\"" OAI_SYSTEM_FINGERPRINT "\","
                           "\"choices\":[{\"index\":0,\"text\":\"a\\\"b\",\"logprobs\":null,\"finish_reason\":null}]}"
                           "\n\n");
    free(f);
    oai_error e;
    oai_error_set(&e, 500, NULL, "boom");
    f = oai_error_sse(&e, &len);
    assert_string_equal(f, "data: {\"error\":{\"message\":\"boom\",\"type\":\"internal_error\",\"param\":null,"
                           "\"code\":null}}\n\n");
    free(f);
    assert_string_equal(OAI_SSE_DONE, "data: [DONE]\n\n");
}

static void test_logprobs_shapes(void **state) {
    (void)state;
    token_logprob lp[2];
    memset(lp, 0, sizeof lp);
    lp[0] = (token_logprob){.id = 0, .logprob = -0.5f, .n_top = 2, .top_ids = {0, 1}, .top_logprobs = {-0.5f, -1.0f}};
    lp[1] = (token_logprob){.id = 2, .logprob = -0.25f, .n_top = 1, .top_ids = {2}, .top_logprobs = {-0.25f}};
    int32_t ids[2] = {0, 2};
    oai_resp_ctx rc = {.kind = OAI_COMPLETION, .id = "c", .created = 1, .model = "m", .logprobs = 2,
                       .token_bytes = fake_tok};
    size_t len;
    char *f = oai_chunk_sse(&rc, 0, "Hel", 3, ids, lp, 2, 10, FINISH_NONE, NULL, -1, false, false, &len);
    assert_string_equal(f, "data: {\"id\":\"c\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"system_fingerprint\":\"" OAI_SYSTEM_FINGERPRINT "\","
                           "\"choices\":[{\"index\":0,\"text\":\"Hel\",\"logprobs\":{\"tokens\":[\"Hel\",\"bytes:\\\\xe2\\\\x82\"],"
                           "\"token_logprobs\":[-0.5,-0.25],\"top_logprobs\":[{\"Hel\":-0.5,\"lo\":-1.0},"
                           "{\"bytes:\\\\xe2\\\\x82\":-0.25}],\"text_offset\":[10,13]},\"finish_reason\":null}]}\n\n");
    free(f);
    rc.kind = OAI_CHAT;
    f = oai_chunk_sse(&rc, 0, "Hel", 3, ids, lp, 1, 0, FINISH_NONE, NULL, -1, false, false, &len);
    assert_string_equal(f, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"system_fingerprint\":\"" OAI_SYSTEM_FINGERPRINT "\","
                           "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"},\"logprobs\":{\"content\":[{"
                           "\"token\":\"Hel\",\"logprob\":-0.5,\"bytes\":[72,101,108],\"top_logprobs\":[{\"token\":"
                           "\"Hel\",\"logprob\":-0.5,\"bytes\":[72,101,108]},{\"token\":\"lo\",\"logprob\":-1.0,"
                           "\"bytes\":[108,111]}]}]},\"finish_reason\":null}]}\n\n");
    free(f);
}

/* ---- the output parser (oai_tools.c) ---- */
typedef struct parsed_all {
    char reasoning[512], content[512], calls[512];
    size_t n_calls;
} parsed_all;

static void collect(parsed_all *a, const oai_parsed *d) {
    strncat(a->reasoning, d->reasoning ? d->reasoning : "", sizeof a->reasoning - strlen(a->reasoning) - 1);
    strncat(a->content, d->content ? d->content : "", sizeof a->content - strlen(a->content) - 1);
    for (size_t i = 0; i < d->n_calls; i++) {
        char one[200];
        snprintf(one, sizeof one, "[%s|%s|%s]", d->calls[i].id, d->calls[i].name, d->calls[i].arguments);
        strncat(a->calls, one, sizeof a->calls - strlen(a->calls) - 1);
    }
    a->n_calls += d->n_calls;
}

/* Feeds TEXT in pieces of STEP bytes (0 = all at once), final on the last. */
static parsed_all run_parser(const char *text, bool reasoning, bool tools, size_t step) {
    parsed_all a;
    memset(&a, 0, sizeof a);
    oai_outparse p;
    assert_int_equal(oai_outparse_init(&p, reasoning, tools, NULL, 0), 0);
    size_t n = strlen(text), at = 0;
    do {
        size_t k = step && n - at > step ? step : n - at;
        oai_parsed d = {0};
        assert_int_equal(oai_outparse_feed(&p, text + at, k, at + k == n, &d), 0);
        collect(&a, &d);
        oai_parsed_free(&d);
        at += k;
    } while (at < n);
    oai_outparse_free(&p);
    return a;
}

static void test_outparse_split_feeds(void **state) {
    (void)state;
    static const struct {
        const char *text;
        bool reasoning, tools;
        const char *reasoning_want, *content_want, *calls_want;
    } cases[] = {
        {"<think>a<b</think>c<|tool", true, false, "a<b", "c<|tool", ""},
        {"plan</thi", true, true, "plan</thi", "", ""},
        {"x</think>y<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
         "{\"a\": 1}<|tool_call_end|><|tool_calls_section_end|>", true, true, "x", "y", "[functions.f:0|f|{\"a\": 1}]"},
        {"hi <|tool_calls_section_begin|> <|tool_call_begin|>g:3<|tool_call_argument_begin|>{}<|tool_call_end|>"
         "<|tool_call_begin|>functions.h:1<|tool_call_argument_begin|>[]<|tool_call_end|>", false, true, "",
         "hi <|tool_call_begin|>functions.h:1<|tool_call_argument_begin|>[]<|tool_call_end|>", "[g:3|g|{}]"},
        {"<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\"", false,
         true, "", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\"", ""},
        {"a <|tool_calls_section_begin|>b", false, false, "", "a <|tool_calls_section_begin|>b", ""},
        {"<|tool_calls_sec", false, true, "", "<|tool_calls_sec", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        parsed_all whole = run_parser(cases[i].text, cases[i].reasoning, cases[i].tools, 0);
        if (strcmp(whole.reasoning, cases[i].reasoning_want) || strcmp(whole.content, cases[i].content_want) ||
            strcmp(whole.calls, cases[i].calls_want))
            fail_msg("case %zu: reasoning [%s] content [%s] calls [%s]", i, whole.reasoning, whole.content,
                     whole.calls);
        for (size_t step = 1; step <= 7; step++) { /* markers split across feeds: the same result */
            parsed_all part = run_parser(cases[i].text, cases[i].reasoning, cases[i].tools, step);
            if (memcmp(&part, &whole, sizeof whole))
                fail_msg("case %zu step %zu: reasoning [%s] content [%s] calls [%s]", i, step, part.reasoning,
                         part.content, part.calls);
        }
    }
}

/* Streaming holds back a possible marker start and nothing else. */
static void test_outparse_holdback(void **state) {
    (void)state;
    oai_outparse p;
    assert_int_equal(oai_outparse_init(&p, true, true, NULL, 0), 0);
    oai_parsed d = {0};
    assert_int_equal(oai_outparse_feed(&p, "<thi", 4, false, &d), 0);
    assert_int_equal(d.reasoning_len + d.content_len, 0);
    assert_int_equal(oai_outparse_feed(&p, "nk>abc</th", 10, false, &d), 0);
    assert_string_equal(d.reasoning, "abc");
    assert_int_equal(oai_outparse_feed(&p, "ink>ok <|tool_c", 15, false, &d), 0);
    assert_string_equal(d.content, "ok ");
    assert_int_equal(oai_outparse_feed(&p, "", 0, true, &d), 0);
    assert_string_equal(d.content, "ok <|tool_c");
    oai_parsed_free(&d);
    oai_outparse_free(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_outparse_split_feeds), cmocka_unit_test(test_outparse_holdback),
        cmocka_unit_test(test_bad_inputs),        cmocka_unit_test(test_invalid_utf8_body),
        cmocka_unit_test(test_utf8_validator),    cmocka_unit_test(test_completion_good),
        cmocka_unit_test(test_completion_defaults), cmocka_unit_test(test_prompt_forms),
        cmocka_unit_test(test_chat_good),         cmocka_unit_test(test_resolve_max_tokens),
        cmocka_unit_test(test_check_ids),         cmocka_unit_test(test_error_json),
        cmocka_unit_test(test_response_shapes),   cmocka_unit_test(test_sse_frames),
        cmocka_unit_test(test_logprobs_shapes),   cmocka_unit_test(test_echo_logprobs_shape),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
