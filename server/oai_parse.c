/*
 * oai_parse.c: OpenAI request bodies -> oai_request (see oai.h for the
 * decisions). Order of checks: UTF-8 of the raw bytes, JSON syntax, object
 * shape, then field by field with the field's name in `param`. A field that is
 * present with JSON null counts as absent (OpenAI clients send nulls).
 *
 * Invariant: on failure *out is freed and zeroed, so callers never see a half
 * request. Threading: pure; any thread.
 */
#include "server/oai.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== errors ==== */
int oai_error_set(oai_error *e, int status, const char *param, const char *fmt, ...) {
    if (!e) return -1;
    memset(e, 0, sizeof *e);
    e->status = status;
    const char *type = "invalid_request_error", *code = "";
    switch (status) {
    case 401: type = "authentication_error"; code = "invalid_api_key"; break;
    case 404: type = "NotFoundError"; code = "model_not_found"; break;
    case 413: code = "request_too_large"; break;
    case 429: type = "rate_limit_error"; code = "server_overloaded"; break;
    case 500: type = "internal_error"; break;
    case 503: type = "service_unavailable"; code = "service_unavailable"; break;
    default: break;
    }
    snprintf(e->type, sizeof e->type, "%s", type);
    snprintf(e->code, sizeof e->code, "%s", code);
    if (param) snprintf(e->param, sizeof e->param, "%s", param);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

char *oai_error_json(const oai_error *e, size_t *len) {
    size_t ml;
    char *msg = oai_utf8_sanitize(e->message, strlen(e->message), &ml);
    json_t *inner = json_pack("{s:s%,s:s,s:o,s:o}", "message", msg ? msg : "", msg ? ml : 0, "type", e->type,
                              "param", e->param[0] ? json_string(e->param) : json_null(), "code",
                              e->code[0] ? json_string(e->code) : json_null());
    free(msg);
    if (!inner) return NULL;
    json_t *root = json_pack("{s:o}", "error", inner);
    if (!root) return NULL;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (s && len) *len = strlen(s);
    return s;
}

/* ==== UTF-8 ==== */
/* Length of the valid sequence at s[0..n), or 0 if invalid/incomplete. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) len = 3, lo = 0xA0;
    else if (c >= 0xE1 && c <= 0xEC) len = 3;
    else if (c == 0xED) len = 3, hi = 0x9F; /* no surrogates */
    else if (c >= 0xEE && c <= 0xEF) len = 3;
    else if (c == 0xF0) len = 4, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else if (c == 0xF4) len = 4, hi = 0x8F; /* <= U+10FFFF */
    else return 0;
    if (n < len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return len;
}

size_t oai_utf8_invalid_at(const char *s, size_t len) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        size_t l = utf8_seq(u + i, len - i);
        if (!l) return i;
        i += l;
    }
    return len;
}

char *oai_utf8_sanitize(const char *s, size_t len, size_t *out_len) {
    char *o = malloc(len * 3 + 1);
    if (!o) return NULL;
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, k = 0;
    while (i < len) {
        size_t l = utf8_seq(u + i, len - i);
        if (l) {
            memcpy(o + k, s + i, l);
            k += l;
            i += l;
        } else {
            memcpy(o + k, "\xEF\xBF\xBD", 3);
            k += 3;
            i += 1;
        }
    }
    o[k] = 0;
    if (out_len) *out_len = k;
    return o;
}

/* ==== helpers ==== */
static const char *json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER:
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

/* Field lookup: NULL when absent or JSON null. */
static json_t *field(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return (v && !json_is_null(v)) ? v : NULL;
}

static int get_bool(json_t *obj, const char *key, bool *out, oai_error *err) {
    json_t *v = field(obj, key);
    if (!v) return 0;
    if (!json_is_boolean(v))
        return oai_error_set(err, 400, key, "'%s' must be a boolean, got %s", key, json_type_name(v));
    *out = json_is_true(v);
    return 0;
}

/* Number (integer or real) in [lo, hi] (open ends when lo_open/hi_open). */
static int get_num(json_t *obj, const char *key, double lo, bool lo_open, double hi, bool hi_open, float *out,
                   oai_error *err) {
    json_t *v = field(obj, key);
    if (!v) return 0;
    if (!json_is_number(v))
        return oai_error_set(err, 400, key, "'%s' must be a number, got %s", key, json_type_name(v));
    double d = json_number_value(v);
    if (!isfinite(d) || (lo_open ? d <= lo : d < lo) || (hi_open ? d >= hi : d > hi))
        return oai_error_set(err, 400, key, "'%s' is out of range: must be in %s%g, %g%s, got %g", key,
                             lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]", d);
    *out = (float)d;
    return 0;
}

/* Integer in [lo, hi]. Reals with an integral value (2.0) are accepted. */
static int get_int(json_t *obj, const char *key, long long lo, long long hi, long long *out, bool *present,
                   oai_error *err) {
    json_t *v = field(obj, key);
    if (present) *present = v != NULL;
    if (!v) return 0;
    long long x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (long long)json_real_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v))) {
        return oai_error_set(err, 400, key, "'%s' is out of range: must be in [%lld, %lld], got %g", key, lo, hi,
                             json_real_value(v));
    } else {
        return oai_error_set(err, 400, key, "'%s' must be an integer, got %s", key, json_type_name(v));
    }
    if (x < lo || x > hi)
        return oai_error_set(err, 400, key, "'%s' is out of range: must be in [%lld, %lld], got %lld", key, lo, hi, x);
    *out = x;
    return 0;
}

static char *dup_json_string(json_t *v, size_t *len) {
    size_t l = json_string_length(v);
    char *s = malloc(l + 1);
    if (!s) return NULL;
    memcpy(s, json_string_value(v), l);
    s[l] = 0;
    if (len) *len = l;
    return s;
}

/* A token-id array: every element an integer >= 0 (vocabulary checked later). */
static int parse_ids(json_t *arr, const char *param, int32_t **ids, size_t *n, oai_error *err) {
    size_t cnt = json_array_size(arr);
    *ids = malloc((cnt ? cnt : 1) * sizeof(int32_t));
    if (!*ids) return oai_error_set(err, 500, NULL, "out of memory");
    *n = cnt;
    for (size_t i = 0; i < cnt; i++) {
        json_t *e = json_array_get(arr, i);
        if (!json_is_integer(e))
            return oai_error_set(err, 400, param, "'%s' token ids must be integers, element %zu is %s", param, i,
                                 json_type_name(e));
        json_int_t x = json_integer_value(e);
        if (x < 0 || x > INT32_MAX)
            return oai_error_set(err, 400, param, "'%s' token id %lld at index %zu is out of range", param,
                                 (long long)x, i);
        (*ids)[i] = (int32_t)x;
    }
    return 0;
}

/* ==== prompt (completions) ==== */
static int add_prompt(oai_request *r, oai_prompt *p) {
    oai_prompt *np = realloc(r->prompts, (r->n_prompts + 1) * sizeof *np);
    if (!np) return -1;
    r->prompts = np;
    r->prompts[r->n_prompts++] = *p;
    return 0;
}

static int parse_prompt(json_t *root, oai_request *r, oai_error *err) {
    json_t *p = json_object_get(root, "prompt");
    if (!p || json_is_null(p)) return oai_error_set(err, 400, "prompt", "'prompt' is required");
    oai_prompt one = {0};
    if (json_is_string(p)) {
        if (json_string_length(p) == 0) return oai_error_set(err, 400, "prompt", "'prompt' must not be empty");
        one.text = dup_json_string(p, &one.text_len);
        if (!one.text || add_prompt(r, &one)) return free(one.text), oai_error_set(err, 500, NULL, "out of memory");
        return 0;
    }
    if (!json_is_array(p))
        return oai_error_set(err, 400, "prompt",
                             "'prompt' must be a string, an array of strings, an array of token ids or an array of "
                             "token-id arrays, got %s", json_type_name(p));
    size_t cnt = json_array_size(p);
    if (cnt == 0) return oai_error_set(err, 400, "prompt", "'prompt' must not be empty");
    json_t *first = json_array_get(p, 0);
    if (json_is_integer(first)) { /* one prompt as token ids */
        one.is_ids = true;
        if (parse_ids(p, "prompt", &one.ids, &one.n_ids, err)) return free(one.ids), -1;
        if (add_prompt(r, &one)) return free(one.ids), oai_error_set(err, 500, NULL, "out of memory");
        return 0;
    }
    if (cnt > OAI_MAX_PROMPTS)
        return oai_error_set(err, 400, "prompt", "at most %d prompts per request, got %zu", OAI_MAX_PROMPTS, cnt);
    for (size_t i = 0; i < cnt; i++) {
        json_t *e = json_array_get(p, i);
        memset(&one, 0, sizeof one);
        if (json_is_string(e)) {
            if (json_string_length(e) == 0)
                return oai_error_set(err, 400, "prompt", "'prompt' element %zu is an empty string", i);
            one.text = dup_json_string(e, &one.text_len);
            if (!one.text) return oai_error_set(err, 500, NULL, "out of memory");
        } else if (json_is_array(e)) {
            if (json_array_size(e) == 0)
                return oai_error_set(err, 400, "prompt", "'prompt' element %zu is an empty token list", i);
            one.is_ids = true;
            if (parse_ids(e, "prompt", &one.ids, &one.n_ids, err)) return free(one.ids), -1;
        } else {
            return oai_error_set(err, 400, "prompt",
                                 "'prompt' array elements must all be strings or all token-id arrays; element %zu "
                                 "is %s", i, json_type_name(e));
        }
        if (i > 0 && one.is_ids != r->prompts[0].is_ids) {
            free(one.text);
            free(one.ids);
            return oai_error_set(err, 400, "prompt", "'prompt' mixes strings and token-id arrays");
        }
        if (add_prompt(r, &one)) {
            free(one.text);
            free(one.ids);
            return oai_error_set(err, 500, NULL, "out of memory");
        }
    }
    return 0;
}

/* ==== messages (chat) ==== */
static int parse_content(json_t *c, size_t i, char **out, oai_error *err) {
    if (json_is_string(c)) {
        *out = dup_json_string(c, NULL);
        return *out ? 0 : oai_error_set(err, 500, NULL, "out of memory");
    }
    if (!json_is_array(c))
        return oai_error_set(err, 400, "messages",
                             "messages[%zu].content must be a string or an array of text parts, got %s", i,
                             c ? json_type_name(c) : "nothing");
    /* content parts: [{"type":"text","text":"..."}...], joined with "\n" (as vLLM does) */
    size_t total = 0, np = json_array_size(c);
    for (size_t k = 0; k < np; k++) {
        json_t *part = json_array_get(c, k);
        json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type) || strcmp(json_string_value(type), "text") ||
            !json_is_string(text))
            return oai_error_set(err, 400, "messages",
                                 "messages[%zu].content[%zu] must be {\"type\":\"text\",\"text\":string} (only text "
                                 "parts are supported)", i, k);
        total += json_string_length(text) + 1;
    }
    char *s = malloc(total + 1), *w = s;
    if (!s) return oai_error_set(err, 500, NULL, "out of memory");
    for (size_t k = 0; k < np; k++) {
        json_t *text = json_object_get(json_array_get(c, k), "text");
        if (k) *w++ = '\n';
        memcpy(w, json_string_value(text), json_string_length(text));
        w += json_string_length(text);
    }
    *w = 0;
    *out = s;
    return 0;
}

static int parse_messages(json_t *root, oai_request *r, oai_error *err) {
    json_t *m = json_object_get(root, "messages");
    if (!m || json_is_null(m)) return oai_error_set(err, 400, "messages", "'messages' is required");
    if (!json_is_array(m))
        return oai_error_set(err, 400, "messages", "'messages' must be an array, got %s", json_type_name(m));
    size_t cnt = json_array_size(m);
    if (cnt == 0) return oai_error_set(err, 400, "messages", "'messages' must not be empty");
    r->messages = calloc(cnt, sizeof *r->messages);
    if (!r->messages) return oai_error_set(err, 500, NULL, "out of memory");
    for (size_t i = 0; i < cnt; i++) {
        json_t *e = json_array_get(m, i);
        if (!json_is_object(e))
            return oai_error_set(err, 400, "messages", "messages[%zu] must be an object, got %s", i, json_type_name(e));
        json_t *role = json_object_get(e, "role"), *content = json_object_get(e, "content");
        json_t *name = json_object_get(e, "name");
        if (!json_is_string(role))
            return oai_error_set(err, 400, "messages", "messages[%zu].role must be a string, got %s", i,
                                 role ? json_type_name(role) : "nothing");
        const char *rs = json_string_value(role);
        if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") && strcmp(rs, "developer") &&
            strcmp(rs, "tool"))
            return oai_error_set(err, 400, "messages",
                                 "messages[%zu].role must be system, developer, user, assistant or tool, got '%s'", i,
                                 rs);
        if (name && !json_is_null(name) && !json_is_string(name))
            return oai_error_set(err, 400, "messages", "messages[%zu].name must be a string", i);
        chat_message *cm = &r->messages[r->n_messages];
        char *c = NULL;
        json_t *calls = json_object_get(e, "tool_calls");
        bool null_ok = !strcmp(rs, "assistant") && json_is_array(calls) && json_array_size(calls) > 0;
        if (!(null_ok && (!content || json_is_null(content))) && parse_content(content, i, &c, err)) return -1;
        cm->content = c;
        r->n_messages++;
        cm->role = strdup(!strcmp(rs, "developer") ? "system" : rs);
        if (!cm->role) return oai_error_set(err, 500, NULL, "out of memory");
        if (oai_parse_msg_tools(e, i, cm, err)) return -1;
        static const char *const msg_keys[] = {"role", "content", "name", "tool_calls", "tool_call_id",
                                               "reasoning_content", NULL};
        const char *key;
        json_t *val;
        json_object_foreach(e, key, val) {
            bool known = false;
            for (size_t k = 0; msg_keys[k]; k++) known |= !strcmp(key, msg_keys[k]);
            if (!known && !json_is_null(val))
                return oai_error_set(err, 400, "messages", "messages[%zu].%s is not supported", i, key);
        }
        if (json_is_string(name)) {
            cm->name = strdup(json_string_value(name));
            if (!cm->name) return oai_error_set(err, 500, NULL, "out of memory");
        }
    }
    return 0;
}

/* ==== stop ==== */
static int parse_stop(json_t *root, oai_request *r, oai_error *err) {
    json_t *s = field(root, "stop");
    if (s) {
        size_t cnt = json_is_string(s) ? 1 : json_is_array(s) ? json_array_size(s) : (size_t)-1;
        if (cnt == (size_t)-1)
            return oai_error_set(err, 400, "stop", "'stop' must be a string or an array of strings, got %s",
                                 json_type_name(s));
        if (cnt > OAI_MAX_STOP)
            return oai_error_set(err, 400, "stop", "at most %d stop strings, got %zu", OAI_MAX_STOP, cnt);
        r->stop = calloc(cnt ? cnt : 1, sizeof(char *));
        if (!r->stop) return oai_error_set(err, 500, NULL, "out of memory");
        for (size_t i = 0; i < cnt; i++) {
            json_t *e = json_is_string(s) ? s : json_array_get(s, i);
            if (!json_is_string(e))
                return oai_error_set(err, 400, "stop", "'stop' element %zu must be a string, got %s", i,
                                     json_type_name(e));
            size_t l = json_string_length(e);
            if (l == 0) return oai_error_set(err, 400, "stop", "'stop' strings must not be empty");
            if (l > OAI_MAX_STOP_LEN)
                return oai_error_set(err, 400, "stop", "'stop' strings are limited to %d bytes", OAI_MAX_STOP_LEN);
            if (memchr(json_string_value(e), 0, l))
                return oai_error_set(err, 400, "stop", "'stop' strings must not contain NUL");
            r->stop[i] = dup_json_string(e, NULL);
            if (!r->stop[i]) return oai_error_set(err, 500, NULL, "out of memory");
            r->n_stop++;
        }
    }
    json_t *ids = field(root, "stop_token_ids");
    if (ids) {
        if (!json_is_array(ids))
            return oai_error_set(err, 400, "stop_token_ids", "'stop_token_ids' must be an array of integers, got %s",
                                 json_type_name(ids));
        if (parse_ids(ids, "stop_token_ids", &r->stop_token_ids, &r->n_stop_token_ids, err)) return -1;
    }
    return 0;
}

/* ==== the request ==== */
void oai_request_free(oai_request *r) {
    if (!r) return;
    free(r->model);
    for (size_t i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].ids);
    }
    free(r->prompts);
    if (r->messages) {
        for (size_t i = 0; i < r->n_messages; i++) {
            free((char *)r->messages[i].role);
            free((char *)r->messages[i].content);
            free((char *)r->messages[i].name);
            oai_msg_tools_free(&r->messages[i]);
        }
        free(r->messages);
    }
    for (size_t i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    free(r->stop_token_ids);
    free(r->logit_bias_ids);
    free(r->logit_bias);
    free(r->tools_json);
    for (size_t i = 0; i < r->n_tools; i++) free(r->tool_names[i]);
    free(r->tool_names);
    free(r->tool_choice_name);
    free(r->forced_ids);
    memset(r, 0, sizeof *r);
}

/* ==== the field table: what each endpoint accepts ====
 * Anything else is a 400 naming the field. Fields that OpenAI defines but
 * specd does not implement get a message saying so. */
static const char *const fields_common[] = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "min_tokens", "ignore_eos",
    "skip_special_tokens", "n", "best_of", "stop", "stop_token_ids", "user", "logit_bias", "logprobs",
    "specd_test_forced_output", "max_completion_tokens", NULL};
static const char *const fields_completion[] = {"prompt", "echo", "suffix", NULL};
static const char *const fields_chat[] = {"messages", "top_logprobs", "add_generation_prompt",
                                          "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls",
                                          "response_format", "store", "modalities", NULL};
/* OpenAI fields specd refuses, with the reason */
static const struct {
    const char *field, *why;
} refused[] = {
    {"functions", "is deprecated by OpenAI and not supported; send 'tools'"},
    {"function_call", "is deprecated by OpenAI and not supported; send 'tool_choice'"},
    {"audio", "is not supported (text only)"},
    {"prediction", "(predicted outputs) is not supported"},
    {"web_search_options", "is not supported"},
    {"reasoning_effort", "is not supported; Kimi thinking is switched by chat_template_kwargs {\"thinking\": bool}"},
    {"metadata", "is not supported (specd stores nothing)"},
    {"service_tier", "is not supported"},
    {"guided_json", "(guided decoding) is not supported"},
    {"guided_regex", "(guided decoding) is not supported"},
    {"guided_choice", "(guided decoding) is not supported"},
    {"guided_grammar", "(guided decoding) is not supported"},
    {"prompt_logprobs", "is not supported; use echo with logprobs (completions)"},
    {"use_beam_search", "is not supported"},
    {"length_penalty", "is not supported"},
    {"include_stop_str_in_output", "is not supported"},
    {"truncate_prompt_tokens", "is not supported"},
};

static bool in_list(const char *const *l, const char *k) {
    for (; *l; l++)
        if (!strcmp(*l, k)) return true;
    return false;
}

static int check_fields(oai_kind kind, json_t *root, oai_error *err) {
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (in_list(fields_common, key) || in_list(kind == OAI_CHAT ? fields_chat : fields_completion, key)) continue;
        if (json_is_null(val)) continue; /* clients send nulls for everything unset */
        for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
            if (!strcmp(refused[i].field, key))
                return oai_error_set(err, 400, key, "'%s' %s", key, refused[i].why);
        if (kind == OAI_COMPLETION && in_list(fields_chat, key))
            return oai_error_set(err, 400, key, "'%s' is a chat field; /v1/completions does not take it", key);
        if (kind == OAI_CHAT && in_list(fields_completion, key))
            return oai_error_set(err, 400, key, "'%s' is a completions field; /v1/chat/completions does not take it",
                                 key);
        return oai_error_set(err, 400, key, "unknown field '%s' (specd refuses fields it does not implement; "
                             "docs/server.md lists every field)", key);
    }
    /* accepted only in the form specd implements */
    json_t *rf = field(root, "response_format");
    if (rf) {
        json_t *t = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
        if (!json_is_string(t) || strcmp(json_string_value(t), "text") || json_object_size(rf) != 1)
            return oai_error_set(err, 400, "response_format",
                                 "'response_format' other than {\"type\": \"text\"} is not supported (no JSON mode "
                                 "or structured outputs)");
    }
    json_t *st = field(root, "store");
    if (st && !json_is_false(st))
        return oai_error_set(err, 400, "store", "'store' must be false (specd stores nothing)");
    json_t *mo = field(root, "modalities");
    if (mo && !(json_is_array(mo) && json_array_size(mo) == 1 && json_is_string(json_array_get(mo, 0)) &&
                !strcmp(json_string_value(json_array_get(mo, 0)), "text")))
        return oai_error_set(err, 400, "modalities", "'modalities' other than [\"text\"] is not supported");
    return 0;
}

/* logit_bias: {"token id": bias}; ids are checked against the vocabulary later. */
static int parse_logit_bias(json_t *root, oai_request *r, oai_error *err) {
    json_t *lb = field(root, "logit_bias");
    if (!lb) return 0;
    if (!json_is_object(lb))
        return oai_error_set(err, 400, "logit_bias", "'logit_bias' must be an object {\"token id\": bias}, got %s",
                             json_type_name(lb));
    size_t n = json_object_size(lb);
    if (n > OAI_MAX_LOGIT_BIAS)
        return oai_error_set(err, 400, "logit_bias", "at most %d 'logit_bias' entries, got %zu", OAI_MAX_LOGIT_BIAS, n);
    r->logit_bias_ids = malloc((n ? n : 1) * sizeof *r->logit_bias_ids);
    r->logit_bias = malloc((n ? n : 1) * sizeof *r->logit_bias);
    if (!r->logit_bias_ids || !r->logit_bias) return oai_error_set(err, 500, NULL, "out of memory");
    const char *key;
    json_t *val;
    json_object_foreach(lb, key, val) {
        char *end = NULL;
        long long id = strtoll(key, &end, 10);
        if (!key[0] || *end || key[0] == '+' || key[0] == ' ')
            return oai_error_set(err, 400, "logit_bias", "'logit_bias' keys must be token ids (decimal integers), got "
                                 "\"%s\"", key);
        if (id < 0 || id > INT32_MAX)
            return oai_error_set(err, 400, "logit_bias", "'logit_bias' token id %s is out of range", key);
        if (!json_is_number(val))
            return oai_error_set(err, 400, "logit_bias", "'logit_bias' value for token %s must be a number, got %s",
                                 key, json_type_name(val));
        double b = json_number_value(val);
        if (!(b >= -100.0 && b <= 100.0))
            return oai_error_set(err, 400, "logit_bias",
                                 "'logit_bias' value for token %s is out of range: must be in [-100, 100], got %g",
                                 key, b);
        r->logit_bias_ids[r->n_logit_bias] = (int32_t)id;
        r->logit_bias[r->n_logit_bias++] = (float)b;
    }
    return 0;
}

static int parse_fields(oai_kind kind, json_t *root, oai_request *r, oai_error *err) {
    if (check_fields(kind, root, err)) return -1;
    if (parse_logit_bias(root, r, err)) return -1;
    json_t *fo = field(root, "specd_test_forced_output");
    if (fo) {
        if (!json_is_array(fo) || json_array_size(fo) == 0)
            return oai_error_set(err, 400, "specd_test_forced_output",
                                 "'specd_test_forced_output' must be a non-empty array of token ids");
        if (parse_ids(fo, "specd_test_forced_output", &r->forced_ids, &r->n_forced_ids, err)) return -1;
        r->has_forced = true;
    }
    json_t *jmodel = field(root, "model");
    if (jmodel) {
        if (!json_is_string(jmodel))
            return oai_error_set(err, 400, "model", "'model' must be a string, got %s", json_type_name(jmodel));
        r->model = dup_json_string(jmodel, NULL);
        if (!r->model) return oai_error_set(err, 500, NULL, "out of memory");
    }
    if (kind == OAI_COMPLETION ? parse_prompt(root, r, err) : parse_messages(root, r, err)) return -1;

    sampling_params *sp = &r->sp;
    long long v;
    bool present;
    /* max_tokens / max_completion_tokens: negative is always 400, 0 only with echo (checked below) */
    r->max_tokens_param = "max_tokens";
    if (get_int(root, "max_tokens", INT32_MIN, INT32_MAX, &v, &present, err)) return -1;
    if (present) r->has_max_tokens = true, r->max_tokens = (int32_t)v;
    if (get_int(root, "max_completion_tokens", INT32_MIN, INT32_MAX, &v, &present, err)) return -1;
    if (present) r->has_max_tokens = true, r->max_tokens = (int32_t)v, r->max_tokens_param = "max_completion_tokens";
    const char *mtp = r->max_tokens_param;
    if (r->has_max_tokens && r->max_tokens < 0)
        return oai_error_set(err, 400, mtp, "'%s' must be at least 1, got %d", mtp, r->max_tokens);

    if (get_num(root, "temperature", 0, false, 1e6, false, &sp->temperature, err)) return -1;
    if (get_num(root, "top_p", 0, true, 1, false, &sp->top_p, err)) return -1;
    if (get_int(root, "top_k", -1, INT32_MAX, &v, &present, err)) return -1;
    if (present) sp->top_k = (int32_t)v;
    if (get_num(root, "min_p", 0, false, 1, false, &sp->min_p, err)) return -1;
    if (get_num(root, "presence_penalty", -2, false, 2, false, &sp->presence_penalty, err)) return -1;
    if (get_num(root, "frequency_penalty", -2, false, 2, false, &sp->frequency_penalty, err)) return -1;
    if (get_num(root, "repetition_penalty", 0, true, 1e6, false, &sp->repetition_penalty, err)) return -1;
    if (get_int(root, "seed", INT64_MIN, INT64_MAX, &v, &present, err)) return -1;
    if (present) sp->has_seed = true, sp->seed = (uint64_t)v;
    if (get_int(root, "min_tokens", 0, INT32_MAX, &v, &present, err)) return -1;
    if (present) sp->min_tokens = (int32_t)v;
    if (get_bool(root, "ignore_eos", &sp->ignore_eos, err)) return -1;
    if (get_bool(root, "skip_special_tokens", &sp->skip_special_tokens, err)) return -1;
    if (get_int(root, "n", 1, OAI_MAX_N, &v, &present, err)) return -1;
    r->n = present ? (int32_t)v : 1;
    if (r->n_prompts * (size_t)r->n > OAI_MAX_N)
        return oai_error_set(err, 400, "n", "%zu prompts x n = %d is %zu choices; at most %d per request",
                             r->n_prompts, r->n, r->n_prompts * (size_t)r->n, OAI_MAX_N);
    if (get_int(root, "best_of", 1, OAI_MAX_N, &v, &present, err)) return -1;
    if (present && v != r->n) return oai_error_set(err, 400, "best_of", "'best_of' other than n is not supported");
    if (parse_stop(root, r, err)) return -1;
    sp->stop = (const char *const *)r->stop;
    sp->n_stop = r->n_stop;
    sp->stop_token_ids = r->stop_token_ids;
    sp->n_stop_token_ids = r->n_stop_token_ids;

    if (get_bool(root, "stream", &r->stream, err)) return -1;
    json_t *so = field(root, "stream_options");
    if (so) {
        if (!json_is_object(so))
            return oai_error_set(err, 400, "stream_options", "'stream_options' must be an object, got %s",
                                 json_type_name(so));
        if (!r->stream)
            return oai_error_set(err, 400, "stream_options", "'stream_options' is only allowed with stream=true");
        if (get_bool(so, "include_usage", &r->include_usage, err)) return -1;
    }
    json_t *user = field(root, "user");
    if (user && !json_is_string(user))
        return oai_error_set(err, 400, "user", "'user' must be a string, got %s", json_type_name(user));

    r->logprobs = -1;
    if (kind == OAI_COMPLETION) {
        if (get_bool(root, "echo", &r->echo, err)) return -1;
        json_t *lp = field(root, "logprobs");
        if (lp && json_is_boolean(lp)) { /* some clients send false */
            if (json_is_true(lp)) return oai_error_set(err, 400, "logprobs", "'logprobs' must be an integer");
        } else if (get_int(root, "logprobs", 0, INT32_MAX, &v, &present, err)) {
            return -1;
        } else if (present) {
            if (v > OAI_MAX_LOGPROBS)
                return oai_error_set(err, 400, "logprobs", "'logprobs' must be at most %d, got %lld", OAI_MAX_LOGPROBS,
                                     v);
            r->logprobs = (int32_t)v;
        }
        json_t *suffix = field(root, "suffix");
        if (suffix) return oai_error_set(err, 400, "suffix", "'suffix' is not supported");
        if (r->echo && r->logprobs >= 0 && r->stream)
            return oai_error_set(err, 400, "logprobs", "'echo' with 'logprobs' is not supported when streaming");
        if (r->has_max_tokens && r->max_tokens == 0 && !r->echo)
            return oai_error_set(err, 400, "max_tokens", "'max_tokens' must be at least 1 (0 is only allowed with echo)");
    } else {
        bool want = false;
        if (get_bool(root, "logprobs", &want, err)) return -1;
        if (get_int(root, "top_logprobs", 0, INT32_MAX, &v, &present, err)) return -1;
        if (present && v > OAI_MAX_LOGPROBS)
            return oai_error_set(err, 400, "top_logprobs", "'top_logprobs' must be at most %d, got %lld",
                                 OAI_MAX_LOGPROBS, v);
        if (present && !want)
            return oai_error_set(err, 400, "top_logprobs", "'top_logprobs' requires 'logprobs': true");
        if (want) r->logprobs = present ? (int32_t)v : 0;
        r->add_generation_prompt = true;
        if (get_bool(root, "add_generation_prompt", &r->add_generation_prompt, err)) return -1;
        r->thinking = -1;
        json_t *kw = json_object_get(root, "chat_template_kwargs");
        if (kw && !json_is_null(kw)) {
            if (!json_is_object(kw))
                return oai_error_set(err, 400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
            const char *key = json_object_get(kw, "thinking") ? "thinking" : "enable_thinking";
            if (json_object_get(kw, key)) {
                bool th = false;
                if (get_bool(kw, key, &th, err)) return -1;
                r->thinking = th ? 1 : 0;
            }
        }
        if (r->has_max_tokens && r->max_tokens == 0)
            return oai_error_set(err, 400, mtp, "'%s' must be at least 1, got 0", mtp);
        if (oai_parse_tools(root, r, err)) return -1;
    }
    sp->logprobs = r->logprobs;
    if (r->has_max_tokens && sp->min_tokens > r->max_tokens)
        return oai_error_set(err, 400, "min_tokens", "'min_tokens' (%d) must not exceed '%s' (%d)", sp->min_tokens,
                             mtp, r->max_tokens);
    sp->logit_bias_ids = r->logit_bias_ids;
    sp->logit_bias = r->logit_bias;
    sp->n_logit_bias = r->n_logit_bias;
    return 0;
}

int oai_parse_request(oai_kind kind, const char *body, size_t len, oai_request *out, oai_error *err) {
    memset(out, 0, sizeof *out);
    out->kind = kind;
    sampling_params_init(&out->sp);
    if (len == 0) return oai_error_set(err, 400, NULL, "the request body is empty; expected a JSON object");
    size_t bad = oai_utf8_invalid_at(body, len);
    if (bad < len) return oai_error_set(err, 400, NULL, "the request body is not valid UTF-8 (byte offset %zu)", bad);
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
    if (!root) {
        if (strstr(je.text, "too big") || strstr(je.text, "overflow")) {
            /* a valid JSON number jansson cannot hold: name the field it belongs to */
            char key[64] = "";
            size_t at = je.position > 0 && (size_t)je.position < len ? (size_t)je.position : len;
            while (at > 0 && body[at - 1] != ':') at--;
            size_t q = at > 0 ? at - 1 : 0;
            while (q > 0 && body[q - 1] != '"') q--; /* closing quote of the key */
            size_t q1 = q > 0 ? q - 1 : 0, q0 = q1;
            while (q0 > 0 && body[q0 - 1] != '"') q0--;
            if (at > 0 && q1 > q0 && q1 - q0 < sizeof key) {
                memcpy(key, body + q0, q1 - q0);
                key[q1 - q0] = 0;
            }
            return oai_error_set(err, 400, key[0] ? key : NULL, "'%s' is out of range (a number too large to "
                                 "represent)", key[0] ? key : "a number");
        }
        return oai_error_set(err, 400, NULL, "malformed JSON at line %d column %d: %s", je.line, je.column, je.text);
    }
    int rc = 0;
    if (!json_is_object(root)) {
        rc = oai_error_set(err, 400, NULL, "the request body must be a JSON object, got %s", json_type_name(root));
    } else {
        rc = parse_fields(kind, root, out, err);
    }
    json_decref(root);
    if (rc) oai_request_free(out);
    return rc;
}

/* ==== checks needing the model ==== */
int oai_check_ids(const int32_t *ids, size_t n, int32_t vocab, const char *param, oai_error *err) {
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab)
            return oai_error_set(err, 400, param, "token id %d at index %zu is out of vocabulary [0, %d)", ids[i], i,
                                 vocab);
    return 0;
}

int oai_resolve_max_tokens(const oai_request *r, int32_t n_prompt, int32_t max_model_len, int32_t *max_tokens,
                           oai_error *err) {
    const char *param = r->kind == OAI_CHAT ? "messages" : "prompt";
    if (n_prompt <= 0) return oai_error_set(err, 400, param, "the prompt is empty after tokenization");
    if (n_prompt > max_model_len)
        return oai_error_set(err, 400, param,
                             "This model's maximum context length is %d tokens. However, your prompt has %d tokens.",
                             max_model_len, n_prompt);
    if (!r->has_max_tokens) {
        int32_t rem = max_model_len - n_prompt;
        if (rem < 1)
            return oai_error_set(err, 400, param,
                                 "This model's maximum context length is %d tokens and your prompt has %d tokens: "
                                 "no room to generate.", max_model_len, n_prompt);
        *max_tokens = rem;
        return 0;
    }
    if ((int64_t)n_prompt + r->max_tokens > max_model_len)
        return oai_error_set(err, 400, r->max_tokens_param ? r->max_tokens_param : "max_tokens",
                             "This model's maximum context length is %d tokens. However, you requested %lld tokens "
                             "(%d in the %s, %d in the completion). Please reduce the length ('%s').",
                             max_model_len, (long long)n_prompt + r->max_tokens, n_prompt,
                             r->kind == OAI_CHAT ? "messages" : "prompt", r->max_tokens,
                             r->max_tokens_param ? r->max_tokens_param : "max_tokens");
    *max_tokens = r->max_tokens;
    return 0;
}
