/*
 * chat_template.c: chat templates rendered natively (no Jinja engine).
 *
 * A model's Jinja template (tokenizer.chat_template / tokenizer_config.json)
 * is recognised as one of a few FAMILIES, each rendered by C code that
 * reproduces the Jinja output byte for byte for the features the family
 * supports; a template using anything else (tools, reasoning blocks, ...) is
 * refused with a message at chat time, never rendered approximately.
 *
 *   ChatML (SmolLM2): for each message
 *       <|im_start|>ROLE\nCONTENT<|im_end|>\n
 *     preceded, when the first message is not "system", by the template's
 *     default system message (SmolLM2: "You are a helpful AI assistant named
 *     SmolLM, trained by Hugging Face"); generation prompt <|im_start|>assistant\n.
 *   Kimi (REFERENCE section 1): for each message
 *       <|im_user|>user<|im_middle|>CONTENT<|im_end|>    (<|im_assistant|>, <|im_system|>)
 *     K2 (Kimi-K2-Instruct's template): default system from the template,
 *     generation prompt <|im_assistant|>assistant<|im_middle|>.
 *     K2.5 (a template with <think>, or the bare tiktoken tokenizer): a
 *     message's `name` replaces the role text, assistant turns carry an empty
 *     <think></think> before the content, the generation prompt ends with
 *     <think> (thinking on, the default) or <think></think> (off); no default
 *     system prompt unless the template has one or the caller gives one.
 *     Tools (both): `tools_json` (the server's rendering of `tools | tojson`)
 *     as <|im_system|>tool_declare<|im_middle|>TOOLS<|im_end|> before
 *     everything; an assistant turn with tool calls renders its content (if
 *     any) then <|tool_calls_section_begin|>, per call
 *     <|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>ARGS<|tool_call_end|>
 *     (I = the call's index in that turn, ARGS = the arguments string as a
 *     JSON string literal: K2's `arguments | tojson` of a string), then
 *     <|tool_calls_section_end|>; a "tool" message renders as
 *     <|im_system|>tool<|im_middle|>## Return of ID\nCONTENT<|im_end|>
 *     where "\n" is the two characters backslash and n, as K2-Instruct's
 *     template prints it (a Jinja text literal). Other roles are refused.
 *
 * A conversation is first laid out as SEGMENTS: structural special tokens and
 * text stretches (each with a loss-mask flag). Rendering concatenates them;
 * encoding emits specials as ids and encodes each maximal run of adjacent text
 * segments as ONE plain-text stretch, so the ids equal the reference
 * tokenizer's encode of the rendered text with specials parsed, except that
 * special-token strings typed inside content stay text.
 *
 * chat_options.default_system: NULL = the template's own default, "" = no
 * default system message, anything else = that text.
 * Loss mask: 1 on the tokens of assistant messages' content (a token counts
 * as content if its first byte is) and on their closing <|im_end|>; 0 on
 * structural tokens, roles, empty think blocks, separators, other messages.
 *
 * Threading: read-only on the tokenizer; thread-safe.
 */
#include "engine/tokenizer/tok_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------- detection */

static bool has(const char *s, const char *needle) { return strstr(s, needle) != NULL; }

/* Copies the template text starting at P up to (not including) END_MARK,
 * undoing Jinja string-literal backslash escapes. NULL if END_MARK is absent
 * or the stretch contains template syntax or a quote (then the default is not
 * a constant). */
static char *literal_until(const char *p, const char *end_mark) {
    const char *e = strstr(p, end_mark);
    if (!e) return NULL;
    char *out = malloc((size_t)(e - p) + 1);
    if (!out) return NULL;
    size_t o = 0;
    for (const char *q = p; q < e; q++) {
        if (*q == '\'' || *q == '"' || *q == '{' || *q == '}') {
            free(out);
            return NULL;
        }
        if (*q == '\\' && q + 1 < e) {
            q++;
            switch (*q) {
            case 'n': out[o++] = '\n'; break;
            case 't': out[o++] = '\t'; break;
            case 'r': out[o++] = '\r'; break;
            default: out[o++] = *q; break;
            }
            continue;
        }
        out[o++] = *q;
    }
    out[o] = '\0';
    return out;
}

static char *default_after(const char *s, const char *head, const char *end_mark) {
    const char *d = strstr(s, head);
    return d ? literal_until(d + strlen(head), end_mark) : NULL;
}

int tok_set_chat_template(tokenizer *t, const char *tpl, size_t len, specd_err *err) {
    free(t->chat_template);
    free(t->default_system);
    t->default_system = NULL;
    t->chat = CHAT_NONE;
    t->chat_think = false;
    t->chat_reason = "no chat template";
    if (!(t->chat_template = malloc(len + 1))) return specd_err_set(err, "tokenizer: out of memory");
    memcpy(t->chat_template, tpl, len);
    t->chat_template[len] = '\0';
    const char *s = t->chat_template;
    if (strlen(s) != len) {
        t->chat_reason = "chat template contains a NUL byte";
        return 0;
    }
    if (has(s, "<|im_user|>") && has(s, "<|im_middle|>")) {
        t->chat = CHAT_KIMI;
        t->chat_think = has(s, "<think>");
        t->chat_reason = NULL;
        /* the default system turn is the first system header followed by constant text */
        t->default_system = default_after(s, "<|im_system|>system<|im_middle|>", "<|im_end|>");
        if (t->default_system && !t->default_system[0]) {
            free(t->default_system);
            t->default_system = NULL;
        }
        return 0;
    }
    if (has(s, "<|im_start|>") && has(s, "<|im_end|>")) {
        static const char *const unsupported[] = {"tool", "<think>", "reasoning", "image", "video", "raise_exception"};
        for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++)
            if (has(s, unsupported[i])) {
                t->chat_reason = "ChatML template uses features specd does not render (tools, reasoning or media)";
                return 0;
            }
        if (!(has(s, "message['content']") || has(s, "message.content") || has(s, "message[\"content\"]")) ||
            !(has(s, "message['role']") || has(s, "message.role") || has(s, "message[\"role\"]"))) {
            t->chat_reason = "ChatML-like template that does not print message role and content";
            return 0;
        }
        t->default_system = default_after(s, "<|im_start|>system\n", "<|im_end|>");
        if (!t->default_system) t->default_system = default_after(s, "<|im_start|>system\\n", "<|im_end|>");
        t->chat = CHAT_CHATML;
        t->chat_reason = NULL;
        return 0;
    }
    t->chat_reason = "unrecognised chat template family (supported: ChatML, Kimi)";
    return 0;
}

/* -------------------------------------------------------------- segments */

typedef struct seg {
    const char *special; /* NUL-terminated special token text, or NULL for text */
    const char *text;    /* text segment (not owned) */
    size_t len;
    bool mask;
} seg;

typedef struct segs {
    seg *v;
    size_t n, cap;
} segs;

static int seg_add(segs *s, const char *special, const char *text, bool mask) {
    if (s->n == s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 32;
        seg *nv = realloc(s->v, nc * sizeof *nv);
        if (!nv) return -1;
        s->v = nv;
        s->cap = nc;
    }
    s->v[s->n++] = (seg){special, special ? special : (text ? text : ""), strlen(special ? special : (text ? text : "")),
                         mask};
    return 0;
}
#define SP(s, name, m) seg_add(s, name, NULL, m)
#define TX(s, str, m) seg_add(s, NULL, str, m)

static const char *system_default(const tokenizer *t, const chat_message *msgs, size_t n, const chat_options *opt) {
    if (n == 0 || strcmp(msgs[0].role, "system") == 0) return NULL;
    const char *sys = opt && opt->default_system ? opt->default_system : t->default_system;
    return sys && sys[0] ? sys : NULL;
}

static int layout_chatml(const tokenizer *t, const chat_message *m, size_t n, const chat_options *opt, segs *s) {
    const char *sys = system_default(t, m, n, opt);
    if (sys && (SP(s, "<|im_start|>", 0) || TX(s, "system\n", 0) || TX(s, sys, 0) || SP(s, "<|im_end|>", 0) ||
                TX(s, "\n", 0)))
        return -1;
    for (size_t i = 0; i < n; i++) {
        bool a = strcmp(m[i].role, "assistant") == 0;
        if (SP(s, "<|im_start|>", 0) || TX(s, m[i].role, 0) || TX(s, "\n", 0) || TX(s, m[i].content, a) ||
            SP(s, "<|im_end|>", a) || TX(s, "\n", 0))
            return -1;
    }
    if (opt && opt->add_generation_prompt && (SP(s, "<|im_start|>", 0) || TX(s, "assistant\n", 0))) return -1;
    return 0;
}

/* Strings made while laying out (JSON-escaped arguments, call ids), freed
 * with the segments. */
typedef struct strpool {
    char **v;
    size_t n, cap;
} strpool;

static char *pool_take(strpool *p, char *str) {
    if (!str) return NULL;
    if (p->n == p->cap) {
        size_t nc = p->cap ? p->cap * 2 : 8;
        char **nv = realloc(p->v, nc * sizeof *nv);
        if (!nv) return free(str), NULL;
        p->v = nv;
        p->cap = nc;
    }
    return p->v[p->n++] = str;
}

static void pool_free(strpool *p) {
    for (size_t i = 0; i < p->n; i++) free(p->v[i]);
    free(p->v);
    memset(p, 0, sizeof *p);
}

/* S as a JSON string literal the way Python's json.dumps(s, ensure_ascii=False)
 * writes it: quotes, \" \\ \n \r \t \b \f, other controls as \u00XX, the
 * rest (UTF-8) as is. Malloc'd. */
static char *json_quote(const char *str) {
    size_t n = strlen(str);
    char *o = malloc(n * 6 + 3);
    if (!o) return NULL;
    size_t k = 0;
    o[k++] = '"';
    for (const unsigned char *c = (const unsigned char *)str; *c; c++) {
        const char *esc = NULL;
        switch (*c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default: break;
        }
        if (esc) {
            memcpy(o + k, esc, 2);
            k += 2;
        } else if (*c < 0x20) {
            static const char hex[] = "0123456789abcdef";
            memcpy(o + k, "\\u00", 4);
            o[k + 4] = hex[*c >> 4];
            o[k + 5] = hex[*c & 15];
            k += 6;
        } else {
            o[k++] = (char)*c;
        }
    }
    o[k++] = '"';
    o[k] = 0;
    return o;
}

static char *call_id(const char *name, size_t idx) {
    size_t n = strlen(name) + 40;
    char *o = malloc(n);
    if (o) snprintf(o, n, "functions.%s:%zu", name, idx);
    return o;
}

static int layout_kimi(const tokenizer *t, const chat_message *m, size_t n, const chat_options *opt, segs *s,
                       strpool *pool, specd_err *err) {
    for (size_t i = 0; i < n; i++) {
        const char *r = m[i].role;
        if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") && strcmp(r, "tool"))
            return specd_err_set(err, "tokenizer: Kimi chat: role \"%s\" (message %zu) is not supported", r, i) - 1;
        if (!strcmp(r, "tool") && !m[i].tool_call_id)
            return specd_err_set(err, "tokenizer: Kimi chat: tool message %zu has no tool_call_id", i) - 1;
    }
    if (opt && opt->tools_json &&
        (SP(s, "<|im_system|>", 0) || TX(s, "tool_declare", 0) || SP(s, "<|im_middle|>", 0) ||
         TX(s, opt->tools_json, 0) || SP(s, "<|im_end|>", 0)))
        return -1;
    const char *sys = system_default(t, m, n, opt);
    if (sys && (SP(s, "<|im_system|>", 0) || TX(s, "system", 0) || SP(s, "<|im_middle|>", 0) || TX(s, sys, 0) ||
                SP(s, "<|im_end|>", 0)))
        return -1;
    for (size_t i = 0; i < n; i++) {
        bool a = strcmp(m[i].role, "assistant") == 0, tool = strcmp(m[i].role, "tool") == 0;
        const char *head = a ? "<|im_assistant|>" : strcmp(m[i].role, "user") == 0 ? "<|im_user|>" : "<|im_system|>";
        const char *name = t->chat_think && m[i].name && m[i].name[0] ? m[i].name : m[i].role;
        if (SP(s, head, 0) || TX(s, name, 0) || SP(s, "<|im_middle|>", 0)) return -1;
        if (a && t->chat_think && (SP(s, "<think>", 0) || SP(s, "</think>", 0))) return -1;
        if (a && m[i].n_tool_calls) {
            if (m[i].content && m[i].content[0] && TX(s, m[i].content, 1)) return -1;
            if (SP(s, "<|tool_calls_section_begin|>", 1)) return -1;
            for (size_t c = 0; c < m[i].n_tool_calls; c++) {
                const chat_tool_call *tc = &m[i].tool_calls[c];
                const char *id = pool_take(pool, call_id(tc->name ? tc->name : "", c));
                const char *args = pool_take(pool, json_quote(tc->arguments ? tc->arguments : ""));
                if (!id || !args || SP(s, "<|tool_call_begin|>", 1) || TX(s, id, 1) ||
                    SP(s, "<|tool_call_argument_begin|>", 1) || TX(s, args, 1) || SP(s, "<|tool_call_end|>", 1))
                    return -1;
            }
            if (SP(s, "<|tool_calls_section_end|>", 1) || SP(s, "<|im_end|>", 1)) return -1;
            continue;
        }
        if (tool && (TX(s, "## Return of ", 0) || TX(s, m[i].tool_call_id, 0) || TX(s, "\\n", 0))) return -1;
        if (TX(s, m[i].content, a) || SP(s, "<|im_end|>", a)) return -1;
    }
    if (opt && opt->add_generation_prompt) {
        if (SP(s, "<|im_assistant|>", 0) || TX(s, "assistant", 0) || SP(s, "<|im_middle|>", 0)) return -1;
        if (t->chat_think && (SP(s, "<think>", 0) || (opt->thinking == 0 && SP(s, "</think>", 0)))) return -1;
    }
    return 0;
}

tok_tool_format tok_chat_tool_format(const tokenizer *t) { return t->chat == CHAT_KIMI ? TOK_TOOLS_KIMI : TOK_TOOLS_NONE; }

int tok_chat_thinking(const tokenizer *t) { return t->chat == CHAT_KIMI && t->chat_think; }

/* Lays the conversation out; -1 with err set. */
static int layout(const tokenizer *t, const chat_message *msgs, size_t n, const chat_options *opt, segs *s,
                  strpool *pool, specd_err *err) {
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role) return specd_err_set(err, "tokenizer: chat message %zu has no role", i);
    int rc;
    switch (t->chat) {
    case CHAT_CHATML:
        for (size_t i = 0; i < n; i++)
            if (msgs[i].n_tool_calls || msgs[i].tool_call_id) /* a plain "tool" role renders like any other */
                return specd_err_set(err, "tokenizer: this model's chat template has no tool-call format (message "
                                          "%zu has tool_calls or tool_call_id)", i);
        if (opt && opt->tools_json)
            return specd_err_set(err, "tokenizer: this model's chat template has no tool-call format");
        rc = layout_chatml(t, msgs, n, opt, s);
        break;
    case CHAT_KIMI:
        rc = layout_kimi(t, msgs, n, opt, s, pool, err);
        if (rc < -1) return -1; /* err already set */
        break;
    default:
        return specd_err_set(err, "tokenizer: cannot apply the chat template: %s",
                             t->chat_reason ? t->chat_reason : "no chat template");
    }
    return rc < 0 ? specd_err_set(err, "tokenizer: out of memory") : 0;
}

/* ------------------------------------------------------------- public */

int tok_chat_render(const tokenizer *t, const chat_message *msgs, size_t n_msgs, const chat_options *opt,
                    char **text, size_t *len, specd_err *err) {
    *text = NULL;
    if (len) *len = 0;
    segs s = {0};
    strpool pool = {0};
    if (layout(t, msgs, n_msgs, opt, &s, &pool, err) < 0) {
        free(s.v);
        pool_free(&pool);
        return -1;
    }
    size_t total = 0;
    for (size_t i = 0; i < s.n; i++) total += s.v[i].len;
    char *out = malloc(total + 1);
    if (!out) {
        free(s.v);
        pool_free(&pool);
        return specd_err_set(err, "tokenizer: out of memory");
    }
    size_t o = 0;
    for (size_t i = 0; i < s.n; i++) {
        memcpy(out + o, s.v[i].text, s.v[i].len);
        o += s.v[i].len;
    }
    out[o] = '\0';
    free(s.v);
    pool_free(&pool);
    *text = out;
    if (len) *len = o;
    return 0;
}

int tok_chat_encode(const tokenizer *t, const chat_message *msgs, size_t n_msgs, const chat_options *opt,
                    int32_t **ids, size_t *n_ids, uint8_t **mask, specd_err *err) {
    *ids = NULL;
    *n_ids = 0;
    if (mask) *mask = NULL;
    segs s = {0};
    strpool pool = {0};
    tok_ids out = {0}, m = {0};
    char *run = NULL;
    size_t run_cap = 0;
    if (layout(t, msgs, n_msgs, opt, &s, &pool, err) < 0) goto fail;
    for (size_t i = 0; i < s.n;) {
        if (s.v[i].special) {
            int32_t id = tok_token_id(t, s.v[i].special, s.v[i].len);
            if (id < 0 || !(t->attr[id] & TOK_ATTR_SPECIAL)) {
                specd_err_set(err, "tokenizer: chat template needs the special token %s, absent from the vocabulary",
                              s.v[i].special);
                goto fail;
            }
            if (tok_ids_push(&out, id) < 0 || tok_ids_push(&m, s.v[i].mask) < 0) goto oom;
            i++;
            continue;
        }
        /* a maximal run of text segments is encoded as one stretch */
        size_t j = i, rl = 0;
        while (j < s.n && !s.v[j].special) rl += s.v[j++].len;
        if (rl + 1 > run_cap) {
            free(run);
            run_cap = rl * 2 + 64;
            if (!(run = malloc(run_cap))) goto oom;
        }
        size_t o = 0;
        for (size_t k = i; k < j; k++) {
            memcpy(run + o, s.v[k].text, s.v[k].len);
            o += s.v[k].len;
        }
        size_t first = out.n;
        if (rl && tok_encode_plain(t, run, rl, &out, err) < 0) goto fail;
        size_t off = 0, k = i, seg_end = s.v[i].len;
        for (size_t q = first; q < out.n; q++) { /* mask of the segment holding the token's first byte */
            while (k + 1 < j && off >= seg_end) seg_end += s.v[++k].len;
            if (tok_ids_push(&m, s.v[k].mask) < 0) goto oom;
            off += t->tok_len[out.v[q]];
        }
        i = j;
    }
    if (!out.v && tok_ids_push(&out, 0) == 0) out.n = 0; /* never NULL on success */
    if (!out.v) goto oom;
    if (mask) {
        if (!(*mask = malloc(out.n ? out.n : 1))) goto oom;
        for (size_t q = 0; q < out.n; q++) (*mask)[q] = (uint8_t)m.v[q];
    }
    *ids = out.v;
    *n_ids = out.n;
    free(m.v);
    free(s.v);
    pool_free(&pool);
    free(run);
    return 0;
oom:
    specd_err_set(err, "tokenizer: out of memory");
fail:
    free(out.v);
    free(m.v);
    free(s.v);
    pool_free(&pool);
    free(run);
    return -1;
}
