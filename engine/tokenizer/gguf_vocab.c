/*
 * gguf_vocab.c: builds a tokenizer from GGUF metadata (llama.cpp's
 * tokenizer.ggml.* keys): model "gpt2" (byte-level BPE) only.
 *
 *   tokenizer.ggml.tokens      [N] strings, byte-level encoded ("Ġthe") for
 *                              normal tokens, literal for control/user tokens
 *   tokenizer.ggml.token_type  [N] ints: 1 normal, 2 unknown, 3 control
 *                              (special), 4 user-defined, 5 unused, 6 byte
 *   tokenizer.ggml.merges      [M] "left right" (byte-level), rank = index
 *   tokenizer.ggml.pre         names the pre-tokenizer; the names mapped here
 *                              follow llama.cpp's llama-vocab.cpp table
 *   tokenizer.ggml.{bos,eos,unknown,padding}_token_id, tokenizer.chat_template
 *
 * Every count and id read from the file is range-checked: the file is
 * untrusted. Threading: construction only.
 */
#include "engine/tokenizer/tok_internal.h"

#include <stdlib.h>
#include <string.h>

#include "engine/util/log.h"

/* tokenizer.ggml.pre -> pre-tokenizer. */
typedef struct pre_entry {
    const char *name;
    pretok_kind kind;
    int regex; /* 0 GPT-2, 1 Llama-3 */
    bool ignore_merges;
} pre_entry;

static const pre_entry PRE_TABLE[] = {
    /* llama.cpp groups these under one regex pair: "\p{N}" then GPT-2's. */
    {"smollm", PRETOK_DIGITS_REGEX, 0, false},
    {"starcoder", PRETOK_DIGITS_REGEX, 0, false},
    {"refact", PRETOK_DIGITS_REGEX, 0, false},
    {"command-r", PRETOK_DIGITS_REGEX, 0, false},
    {"codeshell", PRETOK_DIGITS_REGEX, 0, false},
    {"exaone", PRETOK_DIGITS_REGEX, 0, false},
    {"minerva-7b", PRETOK_DIGITS_REGEX, 0, false},
    /* plain GPT-2 */
    {"default", PRETOK_REGEX, 0, false},
    {"gpt2", PRETOK_REGEX, 0, false},
    {"gpt-2", PRETOK_REGEX, 0, false},
    {"mpt", PRETOK_REGEX, 0, false},
    {"olmo", PRETOK_REGEX, 0, false},
    {"jais", PRETOK_REGEX, 0, false},
    /* Llama-3 (ignore_merges as in its tokenizer.json) */
    {"llama3", PRETOK_REGEX, 1, true},
    {"llama-v3", PRETOK_REGEX, 1, true},
    {"llama-bpe", PRETOK_REGEX, 1, true},
};

static int get_i32_opt(const gguf_file *f, const char *key, int32_t n_vocab, int32_t *out, specd_err *err) {
    if (!gguf_find_kv(f, key)) return 0;
    int64_t v;
    if (gguf_get_i64(f, key, &v, err) < 0) return -1;
    if (v < 0 || v >= n_vocab) {
        LOG_WARN("tokenizer: %s = %lld is outside the vocabulary; ignored", key, (long long)v);
        return 0;
    }
    *out = (int32_t)v;
    return 0;
}

int tok_create_from_gguf(const gguf_file *f, tokenizer **out, specd_err *err) {
    *out = NULL;
    tokenizer *t = NULL;
    char *buf = NULL;
    const char *s;
    size_t sl;
    if (gguf_get_str(f, "tokenizer.ggml.model", &s, &sl, err) < 0) goto fail;
    if (!(sl == 4 && memcmp(s, "gpt2", 4) == 0)) {
        specd_err_set(err, "tokenizer: GGUF tokenizer model \"%.*s\" is not supported (only \"gpt2\" byte-level BPE)",
                      (int)(sl > 64 ? 64 : sl), s);
        goto fail;
    }
    const pre_entry *pre = &PRE_TABLE[7]; /* "default" */
    if (gguf_find_kv(f, "tokenizer.ggml.pre")) {
        if (gguf_get_str(f, "tokenizer.ggml.pre", &s, &sl, err) < 0) goto fail;
        pre = NULL;
        for (size_t i = 0; i < sizeof PRE_TABLE / sizeof PRE_TABLE[0]; i++)
            if (strlen(PRE_TABLE[i].name) == sl && memcmp(PRE_TABLE[i].name, s, sl) == 0) pre = &PRE_TABLE[i];
        if (!pre) {
            specd_err_set(err, "tokenizer: GGUF pre-tokenizer \"%.*s\" is not supported", (int)(sl > 64 ? 64 : sl), s);
            goto fail;
        }
    } else {
        LOG_WARN("tokenizer: GGUF has no tokenizer.ggml.pre; using the GPT-2 pre-tokenizer");
    }

    const gguf_kv *toks = gguf_find_kv(f, "tokenizer.ggml.tokens");
    if (!toks || toks->type != GGUF_VT_ARRAY || toks->arr_type != GGUF_VT_STRING || toks->arr_len == 0 ||
        toks->arr_len > (1u << 24)) {
        specd_err_set(err, "tokenizer: tokenizer.ggml.tokens missing or not a string array of 1..2^24 entries");
        goto fail;
    }
    int32_t n = (int32_t)toks->arr_len;
    const gguf_kv *types = gguf_find_kv(f, "tokenizer.ggml.token_type");
    if (types && (types->type != GGUF_VT_ARRAY || types->arr_len != toks->arr_len)) {
        specd_err_set(err, "tokenizer: tokenizer.ggml.token_type has %llu entries for %d tokens",
                      (unsigned long long)types->arr_len, n);
        goto fail;
    }
    if (!(t = tok_alloc(n, err))) goto fail;
    t->kind = TOK_KIND_BPE;
    t->ignore_merges = pre->ignore_merges;
    size_t bufcap = 0;
    for (int32_t id = 0; id < n; id++) {
        if (gguf_arr_str(toks, (uint64_t)id, &s, &sl) < 0) {
            specd_err_set(err, "tokenizer: token %d unreadable", id);
            goto fail;
        }
        int64_t ty = 1;
        if (types && gguf_arr_i64(types, (uint64_t)id, &ty) < 0) {
            specd_err_set(err, "tokenizer: token_type %d unreadable", id);
            goto fail;
        }
        uint8_t attr = 0;
        const char *bytes = s;
        size_t bl = sl;
        if (ty == 3) attr = TOK_ATTR_SPECIAL;
        else if (ty == 4) attr = TOK_ATTR_ADDED;
        else {
            if (sl > bufcap) {
                free(buf);
                bufcap = sl * 2 + 16;
                if (!(buf = malloc(bufcap))) {
                    specd_err_set(err, "tokenizer: out of memory");
                    goto fail;
                }
            }
            bl = tok_bytelevel_decode(s, sl, buf);
            bytes = buf;
        }
        if (tok_set_token(t, id, bytes, bl, attr, err) < 0) goto fail;
    }
    if (get_i32_opt(f, "tokenizer.ggml.bos_token_id", n, &t->bos, err) < 0 ||
        get_i32_opt(f, "tokenizer.ggml.eos_token_id", n, &t->eos, err) < 0 ||
        get_i32_opt(f, "tokenizer.ggml.unknown_token_id", n, &t->unk, err) < 0 ||
        get_i32_opt(f, "tokenizer.ggml.padding_token_id", n, &t->pad, err) < 0)
        goto fail;
    if (tok_finish(t, err) < 0) goto fail;

    const gguf_kv *merges = gguf_find_kv(f, "tokenizer.ggml.merges");
    if (!merges || merges->type != GGUF_VT_ARRAY || merges->arr_type != GGUF_VT_STRING || merges->arr_len > (1u << 24)) {
        specd_err_set(err, "tokenizer: tokenizer.ggml.merges missing or not a string array");
        goto fail;
    }
    if (tok_pairmap_init(&t->merges, (size_t)merges->arr_len) < 0) {
        specd_err_set(err, "tokenizer: out of memory");
        goto fail;
    }
    size_t skipped = 0;
    for (uint64_t r = 0; r < merges->arr_len; r++) {
        if (gguf_arr_str(merges, r, &s, &sl) < 0) {
            specd_err_set(err, "tokenizer: merge %llu unreadable", (unsigned long long)r);
            goto fail;
        }
        const char *sp = memchr(s, ' ', sl);
        if (!sp || sp == s || sp == s + sl - 1) {
            specd_err_set(err, "tokenizer: merge %llu is not \"left right\"", (unsigned long long)r);
            goto fail;
        }
        if (sl > bufcap) {
            free(buf);
            bufcap = sl * 2 + 16;
            if (!(buf = malloc(bufcap))) {
                specd_err_set(err, "tokenizer: out of memory");
                goto fail;
            }
        }
        size_t ll = tok_bytelevel_decode(s, (size_t)(sp - s), buf);
        int32_t left = tok_strmap_get(&t->plain, buf, ll);
        size_t rl = tok_bytelevel_decode(sp + 1, sl - (size_t)(sp - s) - 1, buf);
        int32_t right = tok_strmap_get(&t->plain, buf, rl);
        if (left < 0 || right < 0) {
            skipped++;
            continue;
        }
        int rc = tok_add_merge(t, left, right, (int32_t)r, err);
        if (rc < 0) goto fail;
        if (rc > 0) skipped++;
    }
    if (skipped) LOG_WARN("tokenizer: %zu GGUF merges refer to tokens not in the vocabulary; ignored", skipped);

    if (pretok_init(&t->pt, pre->kind, pre->regex ? TOK_RE_LLAMA3 : TOK_RE_GPT2, err) < 0) goto fail;
    if (gguf_find_kv(f, "tokenizer.chat_template")) {
        if (gguf_get_str(f, "tokenizer.chat_template", &s, &sl, err) < 0) goto fail;
        if (tok_set_chat_template(t, s, sl, err) < 0) goto fail;
    }
    free(buf);
    *out = t;
    return 0;
fail:
    free(buf);
    tok_destroy(t);
    return specd_err_wrap(err, "tok_create_from_gguf");
}
