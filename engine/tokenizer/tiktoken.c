/*
 * tiktoken.c: builds a tokenizer from a tiktoken ranks file (Kimi K2/K2.5's
 * tiktoken.model: one "base64(token bytes) rank" per line, id = rank) plus
 * the 256 reserved special ids that follow the ranks, and picks a tokenizer
 * directory's loader (tok_create_from_dir).
 *
 * tiktoken's merge rule: adjacent parts merge when their concatenated bytes
 * have a rank, lowest rank first (leftmost on ties), and a piece that is
 * itself a token is that token. The first rule is turned into the same
 * (left id, right id) -> (rank, result) table the GPT-2 merges use, by
 * enumerating every split of every token into two tokens; the second is
 * ignore_merges. Tokens are raw bytes (no byte-level mapping).
 *
 * Specials (REFERENCE section 1, Kimi-K2.5): ids n_base .. n_base+255 named
 * by the built-in K2.5 table, overridden by tokenizer_config.json's
 * added_tokens_decoder when given; the rest are <|reserved_token_ID|>, as in
 * Moonshot's tokenization_kimi.py. All 256 are special: split out of text only
 * when parsing specials (tiktoken's allowed_special="all"), never otherwise
 * (encode_ordinary). Not reproduced: tokenization_kimi.py cuts inputs into
 * 400k-character chunks and runs of > 25k non-space/space characters before
 * encoding, which can only change ids of such extreme inputs.
 *
 * Threading: construction only.
 */
#include "engine/tokenizer/tok_internal.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/util/log.h"

enum { TIKTOKEN_N_SPECIAL = 256 };

/* K2.5's known specials, as offsets from the first special id (163584). */
static const struct {
    int off;
    const char *name;
} KIMI_SPECIALS[] = {
    {0, "[BOS]"}, {1, "[EOS]"}, {2, "<|im_end|>"}, {3, "<|im_user|>"}, {4, "<|im_assistant|>"},
    {6, "<|start_header_id|>"}, {7, "<|end_header_id|>"}, {9, "[EOT]"}, {10, "<|im_system|>"},
    {11, "<|tool_calls_section_begin|>"}, {12, "<|tool_calls_section_end|>"}, {13, "<|tool_call_begin|>"},
    {14, "<|tool_call_argument_begin|>"}, {15, "<|tool_call_end|>"}, {17, "<|im_middle|>"},
    {18, "<|media_begin|>"}, {19, "<|media_content|>"}, {20, "<|media_end|>"}, {21, "<|media_pad|>"},
    {22, "<think>"}, {23, "</think>"}, {254, "[UNK]"}, {255, "[PAD]"},
};

static int b64val(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Standard base64 with '=' padding; returns decoded length or -1. */
static long b64_decode(const char *s, size_t n, unsigned char *out) {
    if (n % 4) return -1;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4];
        int pad = 0;
        for (int k = 0; k < 4; k++) {
            if (s[i + k] == '=' && i + 4 == n && k >= 2) {
                v[k] = 0;
                pad++;
            } else if ((v[k] = b64val((unsigned char)s[i + k])) < 0 || pad) {
                return -1;
            }
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (unsigned char)(w >> 16);
        if (pad < 2) out[o++] = (unsigned char)(w >> 8);
        if (pad < 1) out[o++] = (unsigned char)w;
    }
    return (long)o;
}

/* The rank after "base64 " on one line [P, END): decimal digits only, then
 * the line end or a final '\r'. Returns it, or -1 for anything else or a
 * rank >= LIMIT. Bounded by END (no strtol: the text is one buffer, and a
 * string scan per line would be quadratic under strict sanitizers). */
static long parse_rank(const char *p, const char *end, long limit) {
    long r = 0;
    const char *q = p;
    for (; q < end && *q >= '0' && *q <= '9'; q++) {
        r = r * 10 + (*q - '0');
        if (r >= limit) return -1;
    }
    if (q == p || !(q == end || (*q == '\r' && q + 1 == end))) return -1;
    return r;
}

static char *slurp(const char *path, size_t *len, specd_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        specd_err_set(err, "cannot open %s", path);
        return NULL;
    }
    char *buf = NULL;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
    if (n < 0 || n > (1L << 30) || fseek(f, 0, SEEK_SET) != 0 || !(buf = malloc((size_t)n + 1)) ||
        fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
        specd_err_set(err, "cannot read %s", path);
    } else {
        buf[n] = '\0';
        *len = (size_t)n;
    }
    fclose(f);
    return buf;
}

int tok_create_from_tiktoken(const char *ranks_path, const char *config_path, tokenizer **out, specd_err *err) {
    *out = NULL;
    tokenizer *t = NULL;
    json_t *cfg = NULL;
    size_t len = 0;
    char *text = slurp(ranks_path, &len, err);
    unsigned char *tb = NULL;
    if (!text) goto fail;
    /* pass 1: count lines and the highest rank */
    long max_rank = -1;
    size_t n_lines = 0;
    for (char *p = text; p < text + len;) {
        char *nl = memchr(p, '\n', (size_t)(text + len - p));
        char *end = nl ? nl : text + len;
        if (end > p) {
            char *sp = memchr(p, ' ', (size_t)(end - p));
            long r = sp ? parse_rank(sp + 1, end, (1L << 24) - TIKTOKEN_N_SPECIAL) : -1;
            if (r < 0) {
                specd_err_set(err, "line %zu is not \"base64 rank\"", n_lines + 1);
                goto fail;
            }
            if (r > max_rank) max_rank = r;
            n_lines++;
        }
        p = end + 1;
    }
    if (max_rank < 255) {
        specd_err_set(err, "only %zu ranks", n_lines);
        goto fail;
    }
    int32_t n_base = (int32_t)max_rank + 1;
    if (!(t = tok_alloc(n_base + TIKTOKEN_N_SPECIAL, err))) goto fail;
    t->kind = TOK_KIND_TIKTOKEN;
    t->ignore_merges = true;
    if (!(tb = malloc(len + 4))) {
        specd_err_set(err, "out of memory");
        goto fail;
    }
    for (char *p = text; p < text + len;) {
        char *nl = memchr(p, '\n', (size_t)(text + len - p));
        char *end = nl ? nl : text + len;
        if (end > p) {
            char *sp = memchr(p, ' ', (size_t)(end - p));
            long r = parse_rank(sp + 1, end, (1L << 24) - TIKTOKEN_N_SPECIAL); /* valid: pass 1 */
            long bl = b64_decode(p, (size_t)(sp - p), tb);
            if (bl <= 0) {
                specd_err_set(err, "rank %ld: bad base64", r);
                goto fail;
            }
            if (!(t->attr[r] & TOK_ATTR_HOLE)) {
                specd_err_set(err, "rank %ld appears twice", r);
                goto fail;
            }
            if (tok_set_token(t, (int32_t)r, (const char *)tb, (size_t)bl, 0, err) < 0) goto fail;
        }
        p = end + 1;
    }

    /* specials: built-in names (Kimi's id range only), then the config */
    const char *names[TIKTOKEN_N_SPECIAL] = {0};
    if (n_base == 163584)
        for (size_t i = 0; i < sizeof KIMI_SPECIALS / sizeof KIMI_SPECIALS[0]; i++)
            names[KIMI_SPECIALS[i].off] = KIMI_SPECIALS[i].name;
    if (config_path) {
        json_error_t je;
        if (!(cfg = json_load_file(config_path, JSON_DECODE_INT_AS_REAL, &je))) { /* model_max_length 1e30 */
            specd_err_set(err, "%s: %s (line %d)", config_path, je.text, je.line);
            goto fail;
        }
        const char *key;
        json_t *v;
        json_object_foreach(json_object_get(cfg, "added_tokens_decoder"), key, v) {
            long id = strtol(key, NULL, 10);
            const char *c = json_string_value(json_object_get(v, "content"));
            if (id >= n_base && id < n_base + TIKTOKEN_N_SPECIAL && c) names[id - n_base] = c;
        }
    }
    for (int k = 0; k < TIKTOKEN_N_SPECIAL; k++) {
        char buf[64];
        const char *nm = names[k];
        if (!nm) {
            snprintf(buf, sizeof buf, "<|reserved_token_%d|>", n_base + k);
            nm = buf;
        }
        if (tok_set_token(t, n_base + k, nm, strlen(nm), TOK_ATTR_SPECIAL, err) < 0) goto fail;
    }
    if (tok_finish(t, err) < 0) goto fail;
    static const char *const bos_names[] = {"[BOS]", "<|begin_of_text|>"};
    static const char *const eos_names[] = {"[EOS]", "<|end_of_text|>"};
    for (int k = 1; k >= 0; k--) {
        int32_t id = tok_token_id(t, bos_names[k], strlen(bos_names[k]));
        if (id >= 0) t->bos = id;
        id = tok_token_id(t, eos_names[k], strlen(eos_names[k]));
        if (id >= 0) t->eos = id;
    }
    if (cfg) {
        const char *s = json_string_value(json_object_get(cfg, "bos_token"));
        if (s && tok_token_id(t, s, strlen(s)) >= 0) t->bos = tok_token_id(t, s, strlen(s));
        s = json_string_value(json_object_get(cfg, "eos_token"));
        if (s && tok_token_id(t, s, strlen(s)) >= 0) t->eos = tok_token_id(t, s, strlen(s));
    }
    int32_t unk = tok_token_id(t, "[UNK]", 5), pad = tok_token_id(t, "[PAD]", 5);
    t->unk = unk;
    t->pad = pad;
    tok_set_stops(t);

    /* merge table: every split of every token into two tokens */
    if (tok_pairmap_init(&t->merges, n_lines * 4) < 0) { /* by the ranks present, not the highest one */
        specd_err_set(err, "out of memory");
        goto fail;
    }
    for (int32_t id = 0; id < n_base; id++) {
        if (t->attr[id] & TOK_ATTR_HOLE) continue;
        const char *b = t->arena + t->tok_off[id];
        uint32_t l = t->tok_len[id];
        for (uint32_t k = 1; k < l; k++) {
            int32_t a = tok_strmap_get(&t->plain, b, k), c;
            if (a < 0 || (c = tok_strmap_get(&t->plain, b + k, l - k)) < 0) continue;
            if (tok_pairmap_put(&t->merges, a, c, id, id) < 0) {
                specd_err_set(err, "out of memory");
                goto fail;
            }
        }
    }
    if (pretok_init(&t->pt, PRETOK_REGEX, TOK_RE_KIMI, err) < 0) goto fail;
    /* chat: the config's template if any, else the Kimi family by vocabulary */
    const char *tpl = cfg ? json_string_value(json_object_get(cfg, "chat_template")) : NULL;
    if (tpl) {
        if (tok_set_chat_template(t, tpl, strlen(tpl), err) < 0) goto fail;
    } else if (tok_token_id(t, "<|im_middle|>", 13) >= 0) {
        t->chat = CHAT_KIMI; /* K2.5 style, no default system prompt */
        t->chat_think = true;
        t->chat_reason = NULL;
    }
    json_decref(cfg);
    free(tb);
    free(text);
    *out = t;
    return 0;
fail:
    json_decref(cfg);
    free(tb);
    free(text);
    tok_destroy(t);
    return specd_err_wrap(err, "tok_create_from_tiktoken(%s)", ranks_path);
}

static bool is_file(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

int tok_create_from_dir(const char *dir, tokenizer **out, specd_err *err) {
    char p[4096], c[4096];
    *out = NULL;
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    if (is_file(p)) return tok_create_from_hf(p, out, err);
    snprintf(p, sizeof p, "%s/tiktoken.model", dir);
    snprintf(c, sizeof c, "%s/tokenizer_config.json", dir);
    if (is_file(p)) return tok_create_from_tiktoken(p, is_file(c) ? c : NULL, out, err);
    return specd_err_set(err, "%s: neither tokenizer.json nor tiktoken.model found", dir);
}
