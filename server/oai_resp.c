/*
 * oai_resp.c: OpenAI response bodies and SSE frames from engine outputs.
 *
 * Shapes (OpenAI API reference; vLLM's protocol.py agrees):
 *   completion:  {id, object:"text_completion", created, model,
 *                 choices:[{index, text, logprobs, finish_reason, stop_reason}], usage}
 *   chat:        {id, object:"chat.completion", created, model,
 *                 choices:[{index, message:{role:"assistant", content}, logprobs, finish_reason,
 *                           stop_reason}], usage}
 *   chat chunk:  {id, object:"chat.completion.chunk", created, model,
 *                 choices:[{index, delta:{role?, content?}, logprobs, finish_reason}]}
 *   logprobs:    completions {tokens, token_logprobs, top_logprobs:[{tok:lp}], text_offset};
 *                chat {content:[{token, logprob, bytes, top_logprobs:[{token, logprob, bytes}]}]}
 * Text is made valid UTF-8 before it reaches jansson (which refuses
 * anything else): engine text is final UTF-8 already, token pieces in
 * logprobs may be partial sequences and show U+FFFD while `bytes` keeps the
 * exact bytes.
 *
 * Threading: pure; any thread.
 */
#include "server/oai.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *oai_finish_str(finish_reason f) {
    switch (f) {
    case FINISH_STOP: return "stop";
    case FINISH_LENGTH: return "length";
    case FINISH_ABORT: return "abort";
    case FINISH_ERROR: return "error";
    default: return NULL;
    }
}

/* ==== accumulation ==== */
int oai_choice_add(oai_choice *c, const engine_output *o) {
    if (o->prompt_logprobs && o->n_prompt_logprobs && !c->prompt_lps) {
        c->prompt_lps = malloc(o->n_prompt_logprobs * sizeof *c->prompt_lps);
        if (!c->prompt_lps) return -1;
        memcpy(c->prompt_lps, o->prompt_logprobs, o->n_prompt_logprobs * sizeof *c->prompt_lps);
        c->n_prompt_lps = o->n_prompt_logprobs;
    }
    if (c->discard_generated) {
        if (o->finish != FINISH_NONE) c->finish = o->finish == FINISH_ERROR ? FINISH_ERROR : FINISH_LENGTH;
        c->n_prompt_tokens = o->n_prompt_tokens;
        c->n_completion_tokens = 0;
        return 0;
    }
    if (o->text_len) {
        if (c->text_len + o->text_len + 1 > c->text_cap) {
            size_t cap = c->text_cap ? c->text_cap : 256;
            while (cap < c->text_len + o->text_len + 1) cap *= 2;
            char *t = realloc(c->text, cap);
            if (!t) return -1;
            c->text = t;
            c->text_cap = cap;
        }
        memcpy(c->text + c->text_len, o->text, o->text_len);
        c->text_len += o->text_len;
        c->text[c->text_len] = 0;
    }
    if (o->logprobs && o->n_tokens) {
        if (c->n_lps + o->n_tokens > c->lps_cap) {
            size_t cap = c->lps_cap ? c->lps_cap : 64;
            while (cap < c->n_lps + o->n_tokens) cap *= 2;
            token_logprob *l = realloc(c->lps, cap * sizeof *l);
            if (!l) return -1;
            c->lps = l;
            int32_t *ids = realloc(c->ids, cap * sizeof *ids);
            if (!ids) return -1;
            c->ids = ids;
            c->lps_cap = cap;
        }
        memcpy(c->lps + c->n_lps, o->logprobs, o->n_tokens * sizeof *o->logprobs);
        memcpy(c->ids + c->n_lps, o->token_ids, o->n_tokens * sizeof *o->token_ids);
        c->n_lps += o->n_tokens;
    }
    c->finish = o->finish;
    memcpy(c->stop_reason, o->stop_reason, sizeof c->stop_reason);
    c->stop_reason[sizeof c->stop_reason - 1] = 0;
    c->stop_token_id = o->stop_token_id;
    c->n_prompt_tokens = o->n_prompt_tokens;
    c->n_completion_tokens = o->n_completion_tokens;
    c->n_cached_tokens = o->n_cached_prompt_tokens;
    return 0;
}

void oai_choice_free(oai_choice *c) {
    if (!c) return;
    free(c->prompt_lps);
    free(c->text);
    free(c->lps);
    free(c->ids);
    memset(c, 0, sizeof *c);
}

/* ==== small builders ==== */
static json_t *jstr(const char *s, size_t len) {
    size_t l;
    char *clean = oai_utf8_sanitize(s ? s : "", s ? len : 0, &l);
    if (!clean) return NULL;
    json_t *v = json_stringn(clean, l);
    free(clean);
    return v;
}

static json_t *jlogprob(float lp) {
    /* -inf is not JSON: clamp like vLLM (-9999.0) */
    return json_real(isfinite(lp) ? lp : -9999.0);
}

/* A token's text for logprobs: its bytes when they are valid UTF-8, else
 * "bytes:\xNN..." (vLLM's spelling), so two partial-character tokens never
 * both read U+FFFD and collide as keys of a completions top_logprobs dict. */
static json_t *token_json(const oai_resp_ctx *rc, int32_t id) {
    size_t len = 0;
    const char *b = rc->token_bytes ? rc->token_bytes(rc->token_ctx, id, &len) : NULL;
    if (!b) {
        char tmp[32];
        int n = snprintf(tmp, sizeof tmp, "token_id:%d", id);
        return json_stringn(tmp, (size_t)n);
    }
    if (oai_utf8_invalid_at(b, len) < len) {
        char *t = malloc(6 + 4 * len + 1);
        if (!t) return NULL;
        size_t k = (size_t)snprintf(t, 7, "bytes:");
        for (size_t i = 0; i < len; i++) k += (size_t)snprintf(t + k, 5, "\\x%02x", (unsigned char)b[i]);
        json_t *v = json_stringn(t, k);
        free(t);
        return v;
    }
    return jstr(b, len);
}

static json_t *bytes_json(const oai_resp_ctx *rc, int32_t id) {
    size_t len = 0;
    const char *b = rc->token_bytes ? rc->token_bytes(rc->token_ctx, id, &len) : NULL;
    json_t *a = json_array();
    for (size_t i = 0; b && i < len; i++) json_array_append_new(a, json_integer((unsigned char)b[i]));
    return a;
}

/* Completions logprobs object for N tokens. TEXT_OFFSET0: offset of the
 * first token's text in the choice's text so far. */
static json_t *completion_logprobs_echo(const oai_resp_ctx *rc, const int32_t *echo_ids, size_t n_echo,
                                        const token_logprob *prompt_lps, size_t n_prompt_lps, const int32_t *ids,
                                        const token_logprob *lps, size_t n, size_t text_offset0);

static json_t *completion_logprobs(const oai_resp_ctx *rc, const int32_t *ids, const token_logprob *lps, size_t n,
                                   size_t text_offset0) {
    return completion_logprobs_echo(rc, NULL, 0, NULL, 0, ids, lps, n, text_offset0);
}

/* Completions top_logprobs: the top N and, as OpenAI's legacy API and vLLM
 * do, the sampled token too when it is not among them (N + 1 entries). */
static json_t *top_dict(const oai_resp_ctx *rc, const token_logprob *lp) {
    json_t *d = json_object();
    bool seen = false;
    for (int32_t k = 0; k < lp->n_top && k < 20; k++) {
        json_t *t = token_json(rc, lp->top_ids[k]);
        json_object_set_new(d, json_string_value(t), jlogprob(lp->top_logprobs[k]));
        json_decref(t);
        seen |= lp->top_ids[k] == lp->id;
    }
    if (!seen && lp->n_top > 0) {
        json_t *t = token_json(rc, lp->id);
        json_object_set_new(d, json_string_value(t), jlogprob(lp->logprob));
        json_decref(t);
    }
    return d;
}

/* Completions logprobs: the echoed prompt tokens first (the first has no
 * logprob: null, as vLLM; token i >= 1 takes prompt_lps[i-1]), then the
 * generated tokens. text_offset counts bytes from the start of the text. */
static json_t *completion_logprobs_echo(const oai_resp_ctx *rc, const int32_t *echo_ids, size_t n_echo,
                                        const token_logprob *prompt_lps, size_t n_prompt_lps, const int32_t *ids,
                                        const token_logprob *lps, size_t n, size_t text_offset0) {
    json_t *tokens = json_array(), *tlp = json_array(), *top = json_array(), *off = json_array();
    size_t offset = text_offset0;
    for (size_t i = 0; i < n_echo; i++) {
        json_array_append_new(tokens, token_json(rc, echo_ids[i]));
        bool have = i >= 1 && i - 1 < n_prompt_lps;
        json_array_append_new(tlp, have ? jlogprob(prompt_lps[i - 1].logprob) : json_null());
        json_array_append_new(top, have ? top_dict(rc, &prompt_lps[i - 1]) : json_null());
        json_array_append_new(off, json_integer((json_int_t)offset));
        size_t len = 0;
        if (rc->token_bytes && rc->token_bytes(rc->token_ctx, echo_ids[i], &len)) offset += len;
    }
    for (size_t i = 0; i < n; i++) {
        json_array_append_new(tokens, token_json(rc, ids[i]));
        json_array_append_new(tlp, jlogprob(lps[i].logprob));
        json_array_append_new(top, top_dict(rc, &lps[i]));
        json_array_append_new(off, json_integer((json_int_t)offset));
        size_t len = 0;
        if (rc->token_bytes && rc->token_bytes(rc->token_ctx, ids[i], &len)) offset += len;
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "tokens", tokens, "token_logprobs", tlp, "top_logprobs", top,
                     "text_offset", off);
}

static json_t *chat_logprobs(const oai_resp_ctx *rc, const int32_t *ids, const token_logprob *lps, size_t n) {
    json_t *content = json_array();
    for (size_t i = 0; i < n; i++) {
        json_t *top = json_array();
        for (int32_t k = 0; k < lps[i].n_top && k < 20; k++)
            json_array_append_new(top, json_pack("{s:o,s:o,s:o}", "token", token_json(rc, lps[i].top_ids[k]),
                                                 "logprob", jlogprob(lps[i].top_logprobs[k]), "bytes",
                                                 bytes_json(rc, lps[i].top_ids[k])));
        json_array_append_new(content, json_pack("{s:o,s:o,s:o,s:o}", "token", token_json(rc, ids[i]), "logprob",
                                                 jlogprob(lps[i].logprob), "bytes", bytes_json(rc, ids[i]),
                                                 "top_logprobs", top));
    }
    return json_pack("{s:o}", "content", content);
}

static json_t *logprobs_json(const oai_resp_ctx *rc, const int32_t *ids, const token_logprob *lps, size_t n,
                             size_t text_offset0) {
    if (rc->logprobs < 0 || !lps) return json_null();
    return rc->kind == OAI_CHAT ? chat_logprobs(rc, ids, lps, n) : completion_logprobs(rc, ids, lps, n, text_offset0);
}

static json_t *finish_json(finish_reason f) {
    const char *s = oai_finish_str(f);
    return s ? json_string(s) : json_null();
}

/* vLLM's stop_reason: the matched stop string, the stop token id, or null. */
static json_t *stop_reason_json(finish_reason f, const char *stop_reason, int32_t stop_token_id) {
    if (f != FINISH_STOP) return json_null();
    if (stop_reason && stop_reason[0]) return jstr(stop_reason, strlen(stop_reason));
    if (stop_token_id >= 0) return json_integer(stop_token_id);
    return json_null();
}

static json_t *envelope(const oai_resp_ctx *rc, const char *object, json_t *choices) {
    return json_pack("{s:s,s:s,s:I,s:s,s:s,s:o}", "id", rc->id, "object", object, "created", (json_int_t)rc->created,
                     "model", rc->model, "system_fingerprint", OAI_SYSTEM_FINGERPRINT, "choices", choices);
}

static json_t *tool_call_json(const oai_tool_call *c, size_t index, bool with_index) {
    json_t *fn = json_pack("{s:s,s:s}", "name", c->name, "arguments", c->arguments);
    json_t *o = json_pack("{s:s,s:s,s:o}", "id", c->id, "type", "function", "function", fn);
    if (o && with_index) json_object_set_new(o, "index", json_integer((json_int_t)index));
    return o;
}

/* The chat message of a finished choice, parsed into reasoning / content /
 * tool_calls when the context asks for it. *N_CALLS gets the call count. */
static json_t *chat_message_json(const oai_resp_ctx *rc, const oai_choice *c, size_t *n_calls) {
    *n_calls = 0;
    if (!rc->parse_reasoning && !rc->parse_tools)
        return json_pack("{s:s,s:o}", "role", "assistant", "content", jstr(c->text, c->text_len));
    oai_outparse p;
    oai_parsed d = {0};
    if (oai_outparse_init(&p, rc->parse_reasoning, rc->parse_tools, rc->out_prefix, rc->out_prefix_len) ||
        oai_outparse_feed(&p, c->text ? c->text : "", c->text_len, true, &d)) {
        oai_outparse_free(&p);
        oai_parsed_free(&d);
        return NULL;
    }
    oai_outparse_free(&p);
    json_t *m = json_object();
    json_object_set_new(m, "role", json_string("assistant"));
    bool null_content = d.content_len == 0 && (d.n_calls > 0 || rc->parse_reasoning);
    json_object_set_new(m, "content", null_content ? json_null() : jstr(d.content, d.content_len));
    if (rc->parse_reasoning)
        json_object_set_new(m, "reasoning_content", d.reasoning_len ? jstr(d.reasoning, d.reasoning_len) : json_null());
    if (d.n_calls) {
        json_t *arr = json_array();
        for (size_t i = 0; i < d.n_calls; i++) json_array_append_new(arr, tool_call_json(&d.calls[i], i, false));
        json_object_set_new(m, "tool_calls", arr);
    }
    *n_calls = d.n_calls;
    oai_parsed_free(&d);
    return m;
}

static json_t *usage_json(int64_t p, int64_t c) {
    return json_pack("{s:I,s:I,s:I}", "prompt_tokens", (json_int_t)p, "completion_tokens", (json_int_t)c,
                     "total_tokens", (json_int_t)(p + c));
}

static char *dump(json_t *root, size_t *len) {
    if (!root) return NULL;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (s && len) *len = strlen(s);
    return s;
}

static char *sse_wrap(char *json, size_t jl, size_t *len) {
    if (!json) return NULL;
    char *s = malloc(jl + 9);
    if (!s) return free(json), NULL;
    memcpy(s, "data: ", 6);
    memcpy(s + 6, json, jl);
    memcpy(s + 6 + jl, "\n\n", 3);
    free(json);
    if (len) *len = jl + 8;
    return s;
}

/* ==== public builders ==== */
char *oai_response_json(const oai_resp_ctx *rc, const oai_choice *choices, size_t n_choices, int64_t n_prompt_total,
                        size_t *len) {
    json_t *arr = json_array();
    int64_t completion = 0;
    for (size_t i = 0; i < n_choices; i++) {
        const oai_choice *c = &choices[i];
        completion += c->n_completion_tokens;
        json_t *lp = (rc->kind == OAI_COMPLETION && rc->logprobs >= 0 && c->echo_ids)
                         ? completion_logprobs_echo(rc, c->echo_ids, c->n_echo_ids, c->prompt_lps, c->n_prompt_lps,
                                                    c->ids, c->lps, c->n_lps, 0)
                         : logprobs_json(rc, c->ids, c->lps, c->n_lps, 0);
        json_t *ch;
        if (rc->kind == OAI_CHAT) {
            size_t n_calls = 0;
            json_t *msg = chat_message_json(rc, c, &n_calls);
            json_t *fr = n_calls && c->finish == FINISH_STOP ? json_string("tool_calls") : finish_json(c->finish);
            ch = json_pack("{s:i,s:o,s:o,s:o,s:o}", "index", c->index, "message", msg, "logprobs", lp,
                           "finish_reason", fr, "stop_reason",
                           stop_reason_json(c->finish, c->stop_reason, c->stop_token_id));
        } else {
            ch = json_pack("{s:i,s:o,s:o,s:o,s:o}", "index", c->index, "text", jstr(c->text, c->text_len),
                           "logprobs", lp, "finish_reason", finish_json(c->finish), "stop_reason",
                           stop_reason_json(c->finish, c->stop_reason, c->stop_token_id));
        }
        if (!ch) return json_decref(arr), NULL;
        json_array_append_new(arr, ch);
    }
    json_t *root = envelope(rc, rc->kind == OAI_CHAT ? "chat.completion" : "text_completion", arr);
    if (root) json_object_set_new(root, "usage", usage_json(n_prompt_total, completion));
    return dump(root, len);
}

char *oai_chunk_sse(const oai_resp_ctx *rc, int32_t index, const char *text, size_t text_len, const int32_t *ids,
                    const token_logprob *lps, size_t n_lps, size_t text_offset, finish_reason finish, const char *stop_reason,
                    int32_t stop_token_id, bool role_first, bool include_usage, size_t *len) {
    json_t *lp = (n_lps && lps) ? logprobs_json(rc, ids, lps, n_lps, text_offset) : json_null();
    json_t *ch;
    if (rc->kind == OAI_CHAT) {
        json_t *delta = json_object();
        if (role_first) json_object_set_new(delta, "role", json_string("assistant"));
        if (role_first || text_len) json_object_set_new(delta, "content", jstr(text, text_len));
        ch = json_pack("{s:i,s:o,s:o,s:o}", "index", index, "delta", delta, "logprobs", lp, "finish_reason",
                       finish_json(finish));
    } else {
        ch = json_pack("{s:i,s:o,s:o,s:o}", "index", index, "text", jstr(text, text_len), "logprobs", lp,
                       "finish_reason", finish_json(finish));
    }
    if (!ch) return NULL;
    if (finish != FINISH_NONE)
        json_object_set_new(ch, "stop_reason", stop_reason_json(finish, stop_reason, stop_token_id));
    json_t *arr = json_array();
    json_array_append_new(arr, ch);
    json_t *root = envelope(rc, rc->kind == OAI_CHAT ? "chat.completion.chunk" : "text_completion", arr);
    if (root && include_usage) json_object_set_new(root, "usage", json_null());
    size_t jl = 0;
    char *j = dump(root, &jl);
    return sse_wrap(j, jl, len);
}

char *oai_chat_parsed_sse(const oai_resp_ctx *rc, int32_t index, const oai_parsed *d, size_t call_index0,
                          const int32_t *ids, const token_logprob *lps, size_t n_lps, finish_reason finish,
                          const char *finish_str, const char *stop_reason, int32_t stop_token_id, bool include_usage,
                          size_t *len) {
    json_t *lp = (n_lps && lps) ? logprobs_json(rc, ids, lps, n_lps, 0) : json_null();
    json_t *delta = json_object();
    if (d->reasoning_len) json_object_set_new(delta, "reasoning_content", jstr(d->reasoning, d->reasoning_len));
    if (d->content_len) json_object_set_new(delta, "content", jstr(d->content, d->content_len));
    if (d->n_calls) {
        json_t *arr = json_array();
        for (size_t i = 0; i < d->n_calls; i++)
            json_array_append_new(arr, tool_call_json(&d->calls[i], call_index0 + i, true));
        json_object_set_new(delta, "tool_calls", arr);
    }
    json_t *fr = finish_str ? json_string(finish_str) : finish_json(finish);
    json_t *ch = json_pack("{s:i,s:o,s:o,s:o}", "index", index, "delta", delta, "logprobs", lp, "finish_reason", fr);
    if (!ch) return NULL;
    if (finish != FINISH_NONE)
        json_object_set_new(ch, "stop_reason", stop_reason_json(finish, stop_reason, stop_token_id));
    json_t *arr = json_array();
    json_array_append_new(arr, ch);
    json_t *root = envelope(rc, "chat.completion.chunk", arr);
    if (root && include_usage) json_object_set_new(root, "usage", json_null());
    size_t jl = 0;
    char *j = dump(root, &jl);
    return sse_wrap(j, jl, len);
}

char *oai_usage_sse(const oai_resp_ctx *rc, int64_t prompt_tokens, int64_t completion_tokens, size_t *len) {
    json_t *root = envelope(rc, rc->kind == OAI_CHAT ? "chat.completion.chunk" : "text_completion", json_array());
    if (root) json_object_set_new(root, "usage", usage_json(prompt_tokens, completion_tokens));
    size_t jl = 0;
    char *j = dump(root, &jl);
    return sse_wrap(j, jl, len);
}

char *oai_error_sse(const oai_error *e, size_t *len) {
    size_t jl = 0;
    char *j = oai_error_json(e, &jl);
    return sse_wrap(j, jl, len);
}
