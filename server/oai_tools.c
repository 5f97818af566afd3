/*
 * oai_tools.c: tool calling and reasoning at the OpenAI edge: the request's
 * `tools` / `tool_choice` / message tool calls, the tool declarations printed
 * the way the model's template prints them, and the parser that splits the
 * generated text into reasoning_content, content and tool_calls.
 *
 * Declarations. Kimi's template prints `tools | tojson`; Hugging Face's
 * apply_chat_template (what vLLM and SGLang run) defines tojson as
 * json.dumps(x, ensure_ascii=False) (key order kept, ", " and ": "
 * separators, non-ASCII as is), so oai_json_pydumps writes exactly that:
 * floats in Python's repr (shortest round trip, "1e-05", "1.0"), strings
 * escaped as json.dumps does.
 *
 * Output (Kimi, REFERENCE section 1 and the K2 template; semantics of vLLM's
 * kimi_k2 tool parser and DeepSeek-R1-style reasoning parser):
 *   [<think>] REASONING </think> CONTENT
 *   <|tool_calls_section_begin|>
 *     <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|> ...
 *   <|tool_calls_section_end|>
 *  - reasoning (only when on): everything before </think> (a leading <think>
 *    is dropped); the section marker also ends it; output that never closes
 *    it (max_tokens or a stop string inside) is all reasoning, content null.
 *  - a call is well formed when its id is [functions.]NAME:DIGITS (NAME
 *    non-empty, no white space) and its arguments (white space trimmed) are a
 *    JSON object; it becomes {id: the model's id, type "function",
 *    function {name, arguments: the JSON text as emitted}}. The id is kept
 *    because K2's template renders past calls as functions.NAME:IDX and the
 *    tool result quotes it back.
 *  - malformed or truncated output never fails the request: from the first
 *    call that does not parse (or from the section marker when no call of
 *    that section parsed yet) the raw text goes to content, and everything
 *    after it too.
 * Streaming: the same parse run incrementally; text that may still become a
 * marker is held back, a call is sent as one tool_calls delta once its
 * <|tool_call_end|> arrived (id, type, name and the whole arguments), so a
 * streamed answer assembles to exactly the non-streamed one.
 *
 * Threading: pure functions over caller-owned data.
 */
#include "server/oai.h"

#include <ctype.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== growable strings ==== */
typedef struct sbuf {
    char *s;
    size_t n, cap;
} sbuf;

static int sb_add(sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 64;
        while (c < b->n + n + 1) c *= 2;
        char *ns = realloc(b->s, c);
        if (!ns) return -1;
        b->s = ns;
        b->cap = c;
    }
    if (n) memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
    return 0;
}
static int sb_str(sbuf *b, const char *s) { return sb_add(b, s, strlen(s)); }

/* ==== Python json.dumps ==== */
static int py_string(sbuf *b, const char *s, size_t n) {
    if (sb_add(b, "\"", 1)) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        const char *e = NULL;
        switch (c) {
        case '"': e = "\\\""; break;
        case '\\': e = "\\\\"; break;
        case '\n': e = "\\n"; break;
        case '\r': e = "\\r"; break;
        case '\t': e = "\\t"; break;
        case '\b': e = "\\b"; break;
        case '\f': e = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", c);
                e = esc;
            }
        }
        if (e ? sb_str(b, e) : sb_add(b, (const char *)&s[i], 1)) return -1;
    }
    return sb_add(b, "\"", 1);
}

/* Python's float repr: the shortest digits that round-trip; fixed notation
 * when the decimal exponent is in [-4, 16), else d.ddde+XX. */
static int py_float(sbuf *b, double d) {
    char tmp[64];
    if (!isfinite(d)) return sb_str(b, isnan(d) ? "NaN" : d > 0 ? "Infinity" : "-Infinity");
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, d);
        if (strtod(tmp, NULL) == d) break;
    }
    /* tmp = [-]D[.DDD]e[+-]XX */
    char digits[32];
    size_t nd = 0;
    const char *p = tmp;
    bool neg = *p == '-';
    if (neg) p++;
    for (; *p && *p != 'e'; p++)
        if (isdigit((unsigned char)*p)) digits[nd++] = *p;
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    char out[64];
    size_t k = 0;
    if (neg) out[k++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            out[k++] = '0';
            out[k++] = '.';
            for (int z = 0; z < -exp10 - 1; z++) out[k++] = '0';
            for (size_t i = 0; i < nd; i++) out[k++] = digits[i];
        } else {
            for (int i = 0; i <= exp10; i++) out[k++] = (size_t)i < nd ? digits[i] : '0';
            out[k++] = '.';
            if ((size_t)exp10 + 1 < nd)
                for (size_t i = (size_t)exp10 + 1; i < nd; i++) out[k++] = digits[i];
            else
                out[k++] = '0';
        }
        out[k] = 0;
    } else {
        out[k++] = digits[0];
        if (nd > 1) {
            out[k++] = '.';
            for (size_t i = 1; i < nd; i++) out[k++] = digits[i];
        }
        snprintf(out + k, sizeof out - k, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    }
    return sb_str(b, out);
}

static int py_dump(sbuf *b, const json_t *v) {
    char tmp[32];
    switch (json_typeof(v)) {
    case JSON_NULL: return sb_str(b, "null");
    case JSON_TRUE: return sb_str(b, "true");
    case JSON_FALSE: return sb_str(b, "false");
    case JSON_INTEGER:
        snprintf(tmp, sizeof tmp, "%lld", (long long)json_integer_value(v));
        return sb_str(b, tmp);
    case JSON_REAL: return py_float(b, json_real_value(v));
    case JSON_STRING: return py_string(b, json_string_value(v), json_string_length(v));
    case JSON_ARRAY: {
        if (sb_str(b, "[")) return -1;
        for (size_t i = 0; i < json_array_size(v); i++)
            if ((i && sb_str(b, ", ")) || py_dump(b, json_array_get(v, i))) return -1;
        return sb_str(b, "]");
    }
    case JSON_OBJECT: {
        if (sb_str(b, "{")) return -1;
        const char *key;
        json_t *val;
        bool first = true;
        /* jansson >= 2.8 iterates objects in insertion order (Python dicts keep it too) */
        json_object_foreach((json_t *)v, key, val) {
            if ((!first && sb_str(b, ", ")) || py_string(b, key, strlen(key)) || sb_str(b, ": ") || py_dump(b, val))
                return -1;
            first = false;
        }
        return sb_str(b, "}");
    }
    }
    return -1;
}

char *oai_json_pydumps(const json_t *v) {
    sbuf b = {0};
    if (py_dump(&b, v)) {
        free(b.s);
        return NULL;
    }
    if (!b.s && sb_add(&b, "", 0)) return NULL;
    return b.s;
}

/* ==== request side ==== */
static const char *type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER:
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

static bool name_ok(const char *s) {
    if (!*s || strlen(s) > 64) return false;
    for (; *s; s++)
        if (!(isalnum((unsigned char)*s) || *s == '_' || *s == '-' || *s == '.')) return false;
    return true;
}

int oai_parse_tools(json_t *root, oai_request *r, oai_error *err) {
    json_t *tools = json_object_get(root, "tools");
    r->tool_choice = OAI_TOOL_CHOICE_NONE;
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools))
            return oai_error_set(err, 400, "tools", "'tools' must be an array, got %s", type_name(tools));
        size_t n = json_array_size(tools);
        if (n > OAI_MAX_TOOLS)
            return oai_error_set(err, 400, "tools", "at most %d tools, got %zu", OAI_MAX_TOOLS, n);
        r->tool_names = calloc(n ? n : 1, sizeof *r->tool_names);
        if (!r->tool_names) return oai_error_set(err, 500, NULL, "out of memory");
        for (size_t i = 0; i < n; i++) {
            json_t *t = json_array_get(tools, i), *type = json_object_get(t, "type"), *fn = json_object_get(t, "function");
            if (!json_is_object(t) || !json_is_string(type) || strcmp(json_string_value(type), "function"))
                return oai_error_set(err, 400, "tools", "tools[%zu] must be {\"type\": \"function\", \"function\": {...}}",
                                     i);
            json_t *nm = json_object_get(fn, "name"), *params = json_object_get(fn, "parameters");
            if (!json_is_object(fn) || !json_is_string(nm) || !name_ok(json_string_value(nm)))
                return oai_error_set(err, 400, "tools",
                                     "tools[%zu].function.name must be 1 to 64 characters of a-z, A-Z, 0-9, _, - or .",
                                     i);
            if (params && !json_is_null(params) && !json_is_object(params))
                return oai_error_set(err, 400, "tools", "tools[%zu].function.parameters must be an object (a JSON "
                                     "Schema), got %s", i, type_name(params));
            if (!(r->tool_names[i] = strdup(json_string_value(nm)))) return oai_error_set(err, 500, NULL, "out of memory");
            r->n_tools++;
        }
        if (n) {
            r->tools_json = oai_json_pydumps(tools);
            if (!r->tools_json) return oai_error_set(err, 500, NULL, "out of memory");
            r->tool_choice = OAI_TOOL_CHOICE_AUTO;
        }
    }
    json_t *tc = json_object_get(root, "tool_choice");
    if (tc && !json_is_null(tc)) {
        if (json_is_string(tc)) {
            const char *s = json_string_value(tc);
            if (!strcmp(s, "none")) r->tool_choice = OAI_TOOL_CHOICE_NONE;
            else if (!strcmp(s, "auto")) r->tool_choice = r->n_tools ? OAI_TOOL_CHOICE_AUTO : OAI_TOOL_CHOICE_NONE;
            else if (!strcmp(s, "required")) r->tool_choice = OAI_TOOL_CHOICE_REQUIRED;
            else
                return oai_error_set(err, 400, "tool_choice",
                                     "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                     "\"function\": {\"name\": ...}}, got \"%s\"", s);
        } else if (json_is_object(tc)) {
            json_t *fn = json_object_get(tc, "function"), *nm = json_object_get(fn, "name");
            json_t *type = json_object_get(tc, "type");
            if (!json_is_string(type) || strcmp(json_string_value(type), "function") || !json_is_string(nm))
                return oai_error_set(err, 400, "tool_choice",
                                     "'tool_choice' object must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
            r->tool_choice = OAI_TOOL_CHOICE_NAMED;
            if (!(r->tool_choice_name = strdup(json_string_value(nm)))) return oai_error_set(err, 500, NULL, "out of memory");
            bool found = false;
            for (size_t i = 0; i < r->n_tools; i++) found |= !strcmp(r->tool_names[i], r->tool_choice_name);
            if (!found)
                return oai_error_set(err, 400, "tool_choice", "'tool_choice' names function '%s', which is not in 'tools'",
                                     r->tool_choice_name);
        } else {
            return oai_error_set(err, 400, "tool_choice", "'tool_choice' must be a string or an object, got %s",
                                 type_name(tc));
        }
        if (r->tool_choice == OAI_TOOL_CHOICE_REQUIRED && !r->n_tools)
            return oai_error_set(err, 400, "tool_choice", "'tool_choice' \"required\" needs a non-empty 'tools'");
    }
    json_t *ptc = json_object_get(root, "parallel_tool_calls");
    if (ptc && !json_is_null(ptc)) {
        if (!json_is_boolean(ptc))
            return oai_error_set(err, 400, "parallel_tool_calls", "'parallel_tool_calls' must be a boolean, got %s",
                                 type_name(ptc));
        if (json_is_false(ptc))
            return oai_error_set(err, 400, "parallel_tool_calls",
                                 "'parallel_tool_calls': false is not supported (specd cannot stop the model from "
                                 "emitting several calls in one turn); omit it or send true");
    }
    return 0;
}

int oai_parse_msg_tools(json_t *e, size_t i, chat_message *cm, oai_error *err) {
    json_t *calls = json_object_get(e, "tool_calls"), *tcid = json_object_get(e, "tool_call_id");
    if (calls && !json_is_null(calls)) {
        if (strcmp(cm->role, "assistant"))
            return oai_error_set(err, 400, "messages", "messages[%zu].tool_calls is only allowed on assistant messages", i);
        if (!json_is_array(calls))
            return oai_error_set(err, 400, "messages", "messages[%zu].tool_calls must be an array", i);
        size_t n = json_array_size(calls);
        chat_tool_call *tc = calloc(n ? n : 1, sizeof *tc);
        if (!tc) return oai_error_set(err, 500, NULL, "out of memory");
        cm->tool_calls = tc;
        for (size_t k = 0; k < n; k++) {
            json_t *c = json_array_get(calls, k), *fn = json_object_get(c, "function");
            json_t *id = json_object_get(c, "id"), *nm = json_object_get(fn, "name"), *args = json_object_get(fn, "arguments");
            if (!json_is_object(c) || !json_is_object(fn) || !json_is_string(nm) || !json_is_string(args) ||
                (id && !json_is_null(id) && !json_is_string(id)))
                return oai_error_set(err, 400, "messages",
                                     "messages[%zu].tool_calls[%zu] must be {\"id\": string, \"type\": \"function\", "
                                     "\"function\": {\"name\": string, \"arguments\": string}}", i, k);
            tc[k].name = strdup(json_string_value(nm));
            tc[k].arguments = strdup(json_string_value(args));
            tc[k].id = strdup(json_is_string(id) ? json_string_value(id) : "");
            cm->n_tool_calls = k + 1;
            if (!tc[k].name || !tc[k].arguments || !tc[k].id) return oai_error_set(err, 500, NULL, "out of memory");
        }
    }
    if (!strcmp(cm->role, "tool")) {
        if (!json_is_string(tcid))
            return oai_error_set(err, 400, "messages", "messages[%zu] (role tool) needs 'tool_call_id' (a string)", i);
        if (!(cm->tool_call_id = strdup(json_string_value(tcid)))) return oai_error_set(err, 500, NULL, "out of memory");
    } else if (tcid && !json_is_null(tcid)) {
        return oai_error_set(err, 400, "messages", "messages[%zu].tool_call_id is only allowed on tool messages", i);
    }
    return 0;
}

void oai_msg_tools_free(chat_message *cm) {
    for (size_t k = 0; k < cm->n_tool_calls; k++) {
        free((char *)cm->tool_calls[k].id);
        free((char *)cm->tool_calls[k].name);
        free((char *)cm->tool_calls[k].arguments);
    }
    free((void *)cm->tool_calls);
    free((char *)cm->tool_call_id);
}

/* ==== output parser ==== */
#define M_THINK "<think>"
#define M_THINK_END "</think>"
#define M_SEC "<|tool_calls_section_begin|>"
#define M_SEC_END "<|tool_calls_section_end|>"
#define M_CALL "<|tool_call_begin|>"
#define M_ARG "<|tool_call_argument_begin|>"
#define M_CALL_END "<|tool_call_end|>"

enum { OP_THINK_START, OP_REASON, OP_CONTENT, OP_SECTION, OP_RAW };

int oai_outparse_init(oai_outparse *p, bool reasoning, bool tools, const char *prefix, size_t prefix_len) {
    memset(p, 0, sizeof *p);
    p->reasoning = reasoning;
    p->tools = tools;
    p->phase = reasoning ? OP_THINK_START : OP_CONTENT;
    p->buf = malloc(prefix_len + 1); /* never NULL, even for an empty output */
    if (!p->buf) return -1;
    if (prefix_len) memcpy(p->buf, prefix, prefix_len);
    p->buf[prefix_len] = 0;
    p->len = prefix_len;
    p->cap = prefix_len + 1;
    return 0;
}

void oai_outparse_free(oai_outparse *p) {
    free(p->buf);
    memset(p, 0, sizeof *p);
}

void oai_parsed_free(oai_parsed *d) {
    free(d->reasoning);
    free(d->content);
    for (size_t i = 0; i < d->n_calls; i++) {
        free(d->calls[i].id);
        free(d->calls[i].name);
        free(d->calls[i].arguments);
    }
    free(d->calls);
    memset(d, 0, sizeof *d);
}

static int append(char **s, size_t *n, const char *src, size_t len) {
    if (!len) return 0;
    char *ns = realloc(*s, *n + len + 1);
    if (!ns) return -1;
    memcpy(ns + *n, src, len);
    *n += len;
    ns[*n] = 0;
    *s = ns;
    return 0;
}

static const char *find(const char *hay, size_t n, const char *needle) {
    size_t m = strlen(needle);
    for (size_t i = 0; i + m <= n; i++)
        if (hay[i] == needle[0] && !memcmp(hay + i, needle, m)) return hay + i;
    return NULL;
}

static bool starts(const char *s, size_t n, const char *m) {
    size_t l = strlen(m);
    return n >= l && !memcmp(s, m, l);
}

/* S[0..n) is a proper prefix of marker M (the empty string counts). */
static bool proper_prefix(const char *s, size_t n, const char *m) { return n < strlen(m) && !memcmp(s, m, n); }

/* Longest suffix of S[0..n) that is a proper prefix of one of the markers. */
static size_t holdback(const char *s, size_t n, const char *const *marks, size_t n_marks) {
    size_t best = 0;
    for (size_t k = 0; k < n_marks; k++) {
        size_t ml = strlen(marks[k]);
        for (size_t l = ml - 1; l > best; l--)
            if (l <= n && !memcmp(s + n - l, marks[k], l)) {
                best = l;
                break;
            }
    }
    return best;
}

static char *dup_trim(const char *s, size_t n) {
    while (n && isspace((unsigned char)*s)) s++, n--;
    while (n && isspace((unsigned char)s[n - 1])) n--;
    char *o = malloc(n + 1);
    if (!o) return NULL;
    memcpy(o, s, n);
    o[n] = 0;
    return o;
}

/* Parses one call's inside (between <|tool_call_begin|> and <|tool_call_end|>).
 * 1 = well formed (*out filled), 0 = malformed, -1 = out of memory. */
static int parse_call(const char *s, size_t n, oai_tool_call *out) {
    const char *a = find(s, n, M_ARG);
    if (!a) return 0;
    char *id = dup_trim(s, (size_t)(a - s));
    char *args = dup_trim(a + strlen(M_ARG), n - (size_t)(a - s) - strlen(M_ARG));
    if (!id || !args) return free(id), free(args), -1;
    int ok = 0;
    char *colon = strrchr(id, ':');
    if (colon && colon[1]) {
        ok = 1;
        for (const char *d = colon + 1; *d; d++) ok &= isdigit((unsigned char)*d) != 0;
        const char *nm = strncmp(id, "functions.", 10) == 0 ? id + 10 : id;
        if (nm >= colon) ok = 0;
        for (const char *c = nm; c < colon; c++) ok &= !isspace((unsigned char)*c);
        if (ok) {
            json_error_t je;
            json_t *j = json_loads(args, 0, &je);
            ok = j && json_is_object(j);
            json_decref(j);
        }
        if (ok) {
            out->name = malloc((size_t)(colon - nm) + 1);
            if (!out->name) return free(id), free(args), -1;
            memcpy(out->name, nm, (size_t)(colon - nm));
            out->name[colon - nm] = 0;
            out->id = id;
            out->arguments = args;
            return 1;
        }
    }
    free(id);
    free(args);
    return 0;
}

static int add_call(oai_parsed *d, oai_tool_call *c) {
    oai_tool_call *nc = realloc(d->calls, (d->n_calls + 1) * sizeof *nc);
    if (!nc) return -1;
    d->calls = nc;
    d->calls[d->n_calls++] = *c;
    return 0;
}

int oai_outparse_feed(oai_outparse *p, const char *text, size_t len, bool final, oai_parsed *d) {
    if (len) {
        if (p->len + len + 1 > p->cap) {
            size_t c = p->cap ? p->cap * 2 : 256;
            while (c < p->len + len + 1) c *= 2;
            char *nb = realloc(p->buf, c);
            if (!nb) return -1;
            p->buf = nb;
            p->cap = c;
        }
        memcpy(p->buf + p->len, text, len);
        p->len += len;
        p->buf[p->len] = 0;
    }
    for (;;) {
        const char *s = p->buf + p->pos;
        size_t n = p->len - p->pos;
        switch (p->phase) {
        case OP_THINK_START:
            if (starts(s, n, M_THINK)) {
                p->pos += strlen(M_THINK);
            } else if (!final && proper_prefix(s, n, M_THINK)) {
                return 0;
            }
            p->phase = OP_REASON;
            continue;
        case OP_REASON: {
            const char *e1 = find(s, n, M_THINK_END), *e2 = p->tools ? find(s, n, M_SEC) : NULL;
            const char *e = e1 && (!e2 || e1 < e2) ? e1 : e2;
            if (e) {
                if (append(&d->reasoning, &d->reasoning_len, s, (size_t)(e - s))) return -1;
                p->pos += (size_t)(e - s) + (e == e1 ? strlen(M_THINK_END) : 0);
                p->phase = OP_CONTENT;
                continue;
            }
            static const char *const mk[] = {M_THINK_END, M_SEC};
            size_t keep = final ? 0 : holdback(s, n, mk, p->tools ? 2 : 1);
            if (append(&d->reasoning, &d->reasoning_len, s, n - keep)) return -1;
            p->pos += n - keep;
            return 0;
        }
        case OP_CONTENT: {
            const char *e = p->tools ? find(s, n, M_SEC) : NULL;
            if (e) {
                if (append(&d->content, &d->content_len, s, (size_t)(e - s))) return -1;
                p->sec_start = p->pos + (size_t)(e - s);
                p->pos = p->sec_start + strlen(M_SEC);
                p->sec_calls = 0;
                p->phase = OP_SECTION;
                continue;
            }
            static const char *const mk[] = {M_SEC};
            size_t keep = final || !p->tools ? 0 : holdback(s, n, mk, 1);
            if (append(&d->content, &d->content_len, s, n - keep)) return -1;
            p->pos += n - keep;
            return 0;
        }
        case OP_SECTION: {
            size_t ws = 0;
            while (ws < n && isspace((unsigned char)s[ws])) ws++;
            const char *q = s + ws;
            size_t qn = n - ws;
            size_t at = p->pos + ws;
            if (starts(q, qn, M_SEC_END)) {
                p->pos = at + strlen(M_SEC_END);
                p->phase = OP_CONTENT;
                continue;
            }
            if (starts(q, qn, M_CALL)) {
                const char *ce = find(q, qn, M_CALL_END);
                if (ce) {
                    oai_tool_call c = {0};
                    int ok = parse_call(q + strlen(M_CALL), (size_t)(ce - q) - strlen(M_CALL), &c);
                    if (ok < 0) return -1;
                    if (ok) {
                        if (add_call(d, &c)) {
                            free(c.id), free(c.name), free(c.arguments);
                            return -1;
                        }
                        p->pos = at + (size_t)(ce - q) + strlen(M_CALL_END);
                        p->sec_calls++;
                        p->n_calls++;
                        continue;
                    }
                } else if (!final) {
                    return 0;
                }
            } else if (!final && (proper_prefix(q, qn, M_SEC_END) || proper_prefix(q, qn, M_CALL))) {
                return 0;
            } else if (qn == 0) {
                return 0; /* final: a section left open after complete calls is accepted */
            }
            /* malformed: the raw text from here (or from the section marker) is content */
            size_t from = p->sec_calls ? at : p->sec_start;
            if (append(&d->content, &d->content_len, p->buf + from, p->len - from)) return -1;
            p->pos = p->len;
            p->phase = OP_RAW;
            return 0;
        }
        default: /* OP_RAW */
            if (append(&d->content, &d->content_len, s, n)) return -1;
            p->pos = p->len;
            return 0;
        }
    }
}
