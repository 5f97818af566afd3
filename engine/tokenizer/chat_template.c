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
 *   Kimi (K2/K2.5, REFERENCE section 1): not rendered yet (see chat_kimi_*).
 *
 * Encoding (tok_chat_encode) emits structural tokens as ids and encodes each
 * stretch of text between two structural tokens as plain text, so the ids
 * equal HF's encode of the rendered text with specials parsed, except that
 * special-token strings typed inside CONTENT stay text.
 *
 * chat_options.default_system: NULL = the template's own default, "" = no
 * default system message, anything else = that text.
 * Loss mask: 1 on the tokens of assistant messages' CONTENT (token start at or
 * after the content's first byte) and on their closing <|im_end|>; 0 on
 * structural tokens, roles, the newline after <|im_end|>, other messages.
 *
 * Threading: read-only on the tokenizer; thread-safe.
 */
#include "engine/tokenizer/tok_internal.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------- detection */

static bool has(const char *s, const char *needle) { return strstr(s, needle) != NULL; }

/* Copies the Jinja string-literal text starting at P up to (not including)
 * END_MARK, undoing backslash escapes. NULL if END_MARK is not found within
 * the same literal (a quote comes first). */
static char *literal_until(const char *p, const char *end_mark) {
    const char *e = strstr(p, end_mark);
    if (!e) return NULL;
    char *out = malloc((size_t)(e - p) + 1);
    if (!out) return NULL;
    size_t o = 0;
    for (const char *q = p; q < e; q++) {
        if (*q == '\'' || *q == '"') { /* literal ended: not a constant default */
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

int tok_set_chat_template(tokenizer *t, const char *tpl, size_t len, specd_err *err) {
    free(t->chat_template);
    free(t->default_system);
    t->default_system = NULL;
    t->chat = CHAT_NONE;
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
        t->chat_reason = NULL;
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
        const char *d = strstr(s, "<|im_start|>system\n");
        size_t skip = strlen("<|im_start|>system\n");
        if (!d) {
            d = strstr(s, "<|im_start|>system\\n");
            skip = strlen("<|im_start|>system\\n");
        }
        if (d) t->default_system = literal_until(d + skip, "<|im_end|>");
        t->chat = CHAT_CHATML;
        t->chat_reason = NULL;
        return 0;
    }
    t->chat_reason = "unrecognised chat template family (supported: ChatML)";
    return 0;
}

/* ----------------------------------------------------------- text buffer */

typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

static int sb_add(sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + n + 1) nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) return -1;
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return 0;
}
static int sb_str(sbuf *b, const char *s) { return sb_add(b, s ? s : "", s ? strlen(s) : 0); }

/* -------------------------------------------------------------- ChatML */

static const char *chatml_system(const tokenizer *t, const chat_message *msgs, size_t n, const chat_options *opt) {
    if (n == 0 || (msgs[0].role && strcmp(msgs[0].role, "system") == 0)) return NULL;
    const char *sys = opt && opt->default_system ? opt->default_system : t->default_system;
    return sys && sys[0] ? sys : NULL;
}

static int chatml_render(const tokenizer *t, const chat_message *msgs, size_t n, const chat_options *opt, sbuf *b) {
    const char *sys = chatml_system(t, msgs, n, opt);
    if (sys && (sb_str(b, "<|im_start|>system\n") || sb_str(b, sys) || sb_str(b, "<|im_end|>\n"))) return -1;
    for (size_t i = 0; i < n; i++)
        if (sb_str(b, "<|im_start|>") || sb_str(b, msgs[i].role) || sb_str(b, "\n") || sb_str(b, msgs[i].content) ||
            sb_str(b, "<|im_end|>\n"))
            return -1;
    if (opt && opt->add_generation_prompt && sb_str(b, "<|im_start|>assistant\n")) return -1;
    return 0;
}

typedef struct chat_enc {
    const tokenizer *t;
    tok_ids ids;
    tok_ids mask; /* one int per token, 0/1 */
    specd_err *err;
} chat_enc;

static int ce_special(chat_enc *c, int32_t id, int m) {
    if (tok_ids_push(&c->ids, id) < 0 || tok_ids_push(&c->mask, m) < 0)
        return specd_err_set(c->err, "tokenizer: out of memory");
    return 0;
}

/* Plain-encodes TEXT; tokens starting at byte >= MASK_FROM get mask 1
 * (MASK_FROM = SIZE_MAX: none). */
static int ce_text(chat_enc *c, const char *text, size_t len, size_t mask_from) {
    size_t first = c->ids.n;
    if (len && tok_encode_plain(c->t, text, len, &c->ids, c->err) < 0) return -1;
    size_t off = 0;
    for (size_t k = first; k < c->ids.n; k++) {
        if (tok_ids_push(&c->mask, off >= mask_from) < 0) return specd_err_set(c->err, "tokenizer: out of memory");
        off += c->t->tok_len[c->ids.v[k]];
    }
    return 0;
}

static int need_special(const tokenizer *t, const char *s, int32_t *id, specd_err *err) {
    *id = tok_token_id(t, s, strlen(s));
    if (*id < 0 || !(t->attr[*id] & TOK_ATTR_SPECIAL))
        return specd_err_set(err, "tokenizer: chat template needs the special token %s, absent from the vocabulary", s);
    return 0;
}

static int chatml_encode(const tokenizer *t, const chat_message *msgs, size_t n, const chat_options *opt,
                         chat_enc *c) {
    int32_t im_start, im_end;
    if (need_special(t, "<|im_start|>", &im_start, c->err) < 0 || need_special(t, "<|im_end|>", &im_end, c->err) < 0)
        return -1;
    sbuf seg = {0};
    int rc = -1;
    const char *sys = chatml_system(t, msgs, n, opt);
    size_t n_turns = n + (sys != NULL);
    for (size_t k = 0; k < n_turns; k++) {
        const char *role = sys ? (k == 0 ? "system" : msgs[k - 1].role) : msgs[k].role;
        const char *content = sys ? (k == 0 ? sys : msgs[k - 1].content) : msgs[k].content;
        bool assistant = role && strcmp(role, "assistant") == 0;
        seg.n = 0;
        if (sb_str(&seg, role) || sb_str(&seg, "\n")) goto oom;
        size_t content_at = seg.n;
        if (sb_str(&seg, content)) goto oom;
        if (ce_special(c, im_start, 0) || ce_text(c, seg.p, seg.n, assistant ? content_at : SIZE_MAX) ||
            ce_special(c, im_end, assistant) || ce_text(c, "\n", 1, SIZE_MAX))
            goto done;
    }
    if (opt && opt->add_generation_prompt &&
        (ce_special(c, im_start, 0) || ce_text(c, "assistant\n", strlen("assistant\n"), SIZE_MAX)))
        goto done;
    rc = 0;
    goto done;
oom:
    specd_err_set(c->err, "tokenizer: out of memory");
done:
    free(seg.p);
    return rc;
}

/* ---------------------------------------------------------------- Kimi */
/* Placeholder for the Kimi family (REFERENCE section 1): detection is in
 * place so that a Kimi template is refused with a precise message. */
static int kimi_unsupported(specd_err *err) {
    return specd_err_set(err, "tokenizer: the Kimi chat template is recognised but not implemented yet");
}

/* ------------------------------------------------------------- public */

static int check_family(const tokenizer *t, const chat_message *msgs, size_t n, specd_err *err) {
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role) return specd_err_set(err, "tokenizer: chat message %zu has no role", i);
    if (t->chat == CHAT_NONE)
        return specd_err_set(err, "tokenizer: cannot apply the chat template: %s",
                             t->chat_reason ? t->chat_reason : "no chat template");
    return 0;
}

int tok_chat_render(const tokenizer *t, const chat_message *msgs, size_t n_msgs, const chat_options *opt,
                    char **text, size_t *len, specd_err *err) {
    *text = NULL;
    if (len) *len = 0;
    if (check_family(t, msgs, n_msgs, err) < 0) return -1;
    if (t->chat == CHAT_KIMI) return kimi_unsupported(err);
    sbuf b = {0};
    if (sb_add(&b, "", 0) < 0 || chatml_render(t, msgs, n_msgs, opt, &b) < 0) {
        free(b.p);
        return specd_err_set(err, "tokenizer: out of memory");
    }
    *text = b.p;
    if (len) *len = b.n;
    return 0;
}

int tok_chat_encode(const tokenizer *t, const chat_message *msgs, size_t n_msgs, const chat_options *opt,
                    int32_t **ids, size_t *n_ids, uint8_t **mask, specd_err *err) {
    *ids = NULL;
    *n_ids = 0;
    if (mask) *mask = NULL;
    if (check_family(t, msgs, n_msgs, err) < 0) return -1;
    if (t->chat == CHAT_KIMI) return kimi_unsupported(err);
    chat_enc c = {.t = t, .err = err};
    if (chatml_encode(t, msgs, n_msgs, opt, &c) < 0) goto fail;
    if (mask) {
        if (!(*mask = malloc(c.ids.n ? c.ids.n : 1))) {
            specd_err_set(err, "tokenizer: out of memory");
            goto fail;
        }
        for (size_t i = 0; i < c.ids.n; i++) (*mask)[i] = (uint8_t)c.mask.v[i];
    }
    if (!c.ids.v && tok_ids_push(&c.ids, 0) == 0) c.ids.n = 0; /* never return NULL on success */
    *ids = c.ids.v;
    *n_ids = c.ids.n;
    free(c.mask.v);
    return c.ids.v ? 0 : specd_err_set(err, "tokenizer: out of memory");
fail:
    free(c.ids.v);
    free(c.mask.v);
    return -1;
}
