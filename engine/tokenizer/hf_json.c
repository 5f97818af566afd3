/*
 * hf_json.c: builds a tokenizer from a Hugging Face tokenizer.json (the
 * `tokenizers` serialisation) plus, from the same directory, the chat template
 * and special-token names of tokenizer_config.json / chat_template.jinja.
 *
 * Supported, and refused with a message otherwise:
 *   model         BPE over a byte-level vocabulary (no byte_fallback, no
 *                 continuing_subword_prefix / end_of_word_suffix); merges as
 *                 "a b" strings or ["a", "b"] pairs; ignore_merges honoured
 *   normalizer    null
 *   pre_tokenizer ByteLevel(use_regex, no prefix space);
 *                 Sequence[Digits(individual_digits), ByteLevel] (SmolLM2);
 *                 Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]
 *                 (Llama-3 / Qwen style: the pattern is compiled by PCRE2,
 *                 with \s spelled as White_Space when it is Llama-3's)
 *   decoder       ByteLevel
 *   added_tokens  special -> split out when parsing specials, skipped by
 *                 skip_special; non-special -> always split out (HF). lstrip /
 *                 rstrip / single_word are not implemented (warned).
 * The post-processor is ignored: tok_encode never adds BOS/EOS.
 *
 * Threading: construction only.
 */
#include "engine/tokenizer/tok_internal.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/util/log.h"

static const char *jstr(const json_t *o, const char *k) { return json_string_value(json_object_get(o, k)); }
static bool jis(const json_t *o, const char *k, const char *v) {
    const char *s = jstr(o, k);
    return s && strcmp(s, v) == 0;
}

/* The ByteLevel pre-tokenizer step must not add a prefix space. */
static int check_bytelevel(const json_t *bl, bool want_regex, specd_err *err) {
    if (!jis(bl, "type", "ByteLevel")) return specd_err_set(err, "expected a ByteLevel pre-tokenizer step");
    if (json_is_true(json_object_get(bl, "add_prefix_space")))
        return specd_err_set(err, "ByteLevel add_prefix_space=true is not supported");
    json_t *ur = json_object_get(bl, "use_regex");
    bool use_regex = !ur || json_is_true(ur);
    if (use_regex != want_regex)
        return specd_err_set(err, "ByteLevel use_regex=%s is not supported here", use_regex ? "true" : "false");
    return 0;
}

/* HF's Llama-3 pattern as written in its tokenizer.json. */
static const char LLAMA3_HF_PATTERN[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static int setup_pretok(tokenizer *t, const json_t *pt, specd_err *err) {
    if (!pt || json_is_null(pt)) return specd_err_set(err, "tokenizer.json has no pre_tokenizer (not byte-level)");
    if (jis(pt, "type", "ByteLevel")) {
        if (check_bytelevel(pt, true, err) < 0) return -1;
        return pretok_init(&t->pt, PRETOK_REGEX, TOK_RE_GPT2, err);
    }
    if (!jis(pt, "type", "Sequence")) return specd_err_set(err, "pre_tokenizer type %s is not supported", jstr(pt, "type"));
    const json_t *seq = json_object_get(pt, "pretokenizers");
    if (json_array_size(seq) != 2) return specd_err_set(err, "pre_tokenizer Sequence of %zu steps is not supported", json_array_size(seq));
    const json_t *a = json_array_get(seq, 0), *b = json_array_get(seq, 1);
    if (jis(a, "type", "Digits")) {
        if (!json_is_true(json_object_get(a, "individual_digits")))
            return specd_err_set(err, "Digits(individual_digits=false) is not supported");
        if (check_bytelevel(b, true, err) < 0) return -1;
        return pretok_init(&t->pt, PRETOK_DIGITS_REGEX, TOK_RE_GPT2, err);
    }
    if (jis(a, "type", "Split")) {
        const char *pat = jstr(json_object_get(a, "pattern"), "Regex");
        if (!pat) return specd_err_set(err, "Split pre-tokenizer without a Regex pattern is not supported");
        if (!jis(a, "behavior", "Isolated") || json_is_true(json_object_get(a, "invert")))
            return specd_err_set(err, "Split pre-tokenizer behaviour other than Isolated is not supported");
        if (check_bytelevel(b, false, err) < 0) return -1;
        if (strcmp(pat, LLAMA3_HF_PATTERN) == 0) return pretok_init(&t->pt, PRETOK_REGEX, TOK_RE_LLAMA3, err);
        LOG_WARN("tokenizer: compiling a tokenizer.json Split pattern with PCRE2 as written (\\s is PCRE2's)");
        return pretok_init(&t->pt, PRETOK_REGEX, pat, err);
    }
    return specd_err_set(err, "pre_tokenizer Sequence starting with %s is not supported", jstr(a, "type"));
}

/* A token name in tokenizer_config.json: "text" or {"content": "text"}. */
static int32_t config_token(const tokenizer *t, const json_t *cfg, const char *key) {
    const json_t *v = json_object_get(cfg, key);
    const char *s = json_is_string(v) ? json_string_value(v) : jstr(v, "content");
    return s ? tok_token_id(t, s, strlen(s)) : -1;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && n < (1L << 26) && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1))) {
            if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
                free(buf);
                buf = NULL;
            } else {
                buf[n] = '\0';
                *len = (size_t)n;
            }
        }
    }
    fclose(f);
    return buf;
}

/* tokenizer_config.json (+ chat_template.jinja) next to the tokenizer.json. */
static int load_side_files(tokenizer *t, const char *json_path, specd_err *err) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", json_path);
    char *slash = strrchr(dir, '/');
    if (slash) slash[1] = '\0';
    else snprintf(dir, sizeof dir, "./");
    char path[4200];
    snprintf(path, sizeof path, "%stokenizer_config.json", dir);
    json_error_t je;
    json_t *cfg = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je); /* model_max_length is often 1e30 */
    const char *tpl = NULL;
    size_t tpl_len = 0;
    char *tpl_file = NULL;
    if (cfg) {
        int32_t id;
        if ((id = config_token(t, cfg, "bos_token")) >= 0) t->bos = id;
        if ((id = config_token(t, cfg, "eos_token")) >= 0) t->eos = id;
        if ((id = config_token(t, cfg, "unk_token")) >= 0) t->unk = id;
        if ((id = config_token(t, cfg, "pad_token")) >= 0) t->pad = id;
        const json_t *ct = json_object_get(cfg, "chat_template");
        if (json_is_string(ct)) {
            tpl = json_string_value(ct);
            tpl_len = json_string_length(ct);
        } else if (json_is_array(ct)) { /* [{name, template}]: the "default" one */
            size_t i;
            json_t *e;
            json_array_foreach(ct, i, e) if (jis(e, "name", "default")) {
                tpl = jstr(e, "template");
                tpl_len = tpl ? strlen(tpl) : 0;
            }
        }
    }
    if (!tpl) { /* transformers >= 4.43 may write it separately */
        snprintf(path, sizeof path, "%schat_template.jinja", dir);
        if ((tpl_file = read_file(path, &tpl_len))) tpl = tpl_file;
    }
    int rc = 0;
    if (tpl) rc = tok_set_chat_template(t, tpl, tpl_len, err);
    free(tpl_file);
    json_decref(cfg);
    return rc;
}

int tok_create_from_hf(const char *tokenizer_json_path, tokenizer **out, specd_err *err) {
    *out = NULL;
    tokenizer *t = NULL;
    char *buf = NULL;
    json_error_t je;
    json_t *root = json_load_file(tokenizer_json_path, 0, &je);
    if (!root) {
        specd_err_set(err, "cannot parse: %s (line %d)", je.text, je.line);
        goto fail;
    }
    const json_t *model = json_object_get(root, "model");
    if (!jis(model, "type", "BPE")) {
        specd_err_set(err, "model type %s is not supported (only BPE)", model ? jstr(model, "type") : "(none)");
        goto fail;
    }
    if (json_is_true(json_object_get(model, "byte_fallback")) ||
        (jstr(model, "continuing_subword_prefix") && jstr(model, "continuing_subword_prefix")[0]) ||
        (jstr(model, "end_of_word_suffix") && jstr(model, "end_of_word_suffix")[0])) {
        specd_err_set(err, "BPE with byte_fallback or subword prefix/suffix is not supported");
        goto fail;
    }
    const json_t *norm = json_object_get(root, "normalizer");
    if (norm && !json_is_null(norm)) {
        specd_err_set(err, "normalizer %s is not supported", jstr(norm, "type"));
        goto fail;
    }
    const json_t *dec = json_object_get(root, "decoder");
    if (!jis(dec, "type", "ByteLevel")) {
        specd_err_set(err, "decoder %s is not supported (only ByteLevel)", dec ? jstr(dec, "type") : "(none)");
        goto fail;
    }
    const json_t *vocab = json_object_get(model, "vocab"), *added = json_object_get(root, "added_tokens");
    if (!json_is_object(vocab)) {
        specd_err_set(err, "model.vocab is not an object");
        goto fail;
    }
    int64_t max_id = -1;
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= (1 << 24)) {
            specd_err_set(err, "model.vocab[%s] is not an id in [0, 2^24)", key);
            goto fail;
        }
        if (json_integer_value(v) > max_id) max_id = json_integer_value(v);
    }
    size_t i;
    json_array_foreach(added, i, v) {
        json_int_t id = json_integer_value(json_object_get(v, "id"));
        if (!json_is_integer(json_object_get(v, "id")) || id < 0 || id >= (1 << 24) || !jstr(v, "content")) {
            specd_err_set(err, "added_tokens[%zu] has no valid id/content", i);
            goto fail;
        }
        if (id > max_id) max_id = id;
    }
    if (!(t = tok_alloc((int32_t)(max_id + 1), err))) goto fail;
    t->kind = TOK_KIND_BPE;
    t->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    size_t bufcap = 0;
    json_object_foreach((json_t *)vocab, key, v) {
        size_t kl = strlen(key);
        if (kl + 1 > bufcap) {
            free(buf);
            bufcap = kl * 2 + 16;
            if (!(buf = malloc(bufcap))) {
                specd_err_set(err, "out of memory");
                goto fail;
            }
        }
        size_t bl = tok_bytelevel_decode(key, kl, buf);
        if (tok_set_token(t, (int32_t)json_integer_value(v), buf, bl, 0, err) < 0) goto fail;
    }
    bool warned = false;
    json_array_foreach(added, i, v) {
        const char *c = jstr(v, "content");
        if (!warned && (json_is_true(json_object_get(v, "lstrip")) || json_is_true(json_object_get(v, "rstrip")) ||
                        json_is_true(json_object_get(v, "single_word")))) {
            LOG_WARN("tokenizer: added token %s uses lstrip/rstrip/single_word, which specd ignores", c);
            warned = true;
        }
        uint8_t attr = json_is_true(json_object_get(v, "special")) ? TOK_ATTR_SPECIAL : TOK_ATTR_ADDED;
        if (tok_set_token(t, (int32_t)json_integer_value(json_object_get(v, "id")), c, strlen(c), attr, err) < 0)
            goto fail;
    }
    if (tok_finish(t, err) < 0) goto fail;
    if (load_side_files(t, tokenizer_json_path, err) < 0) goto fail; /* names -> ids need tok_finish */
    tok_set_stops(t);

    const json_t *merges = json_object_get(model, "merges");
    if (!json_is_array(merges)) {
        specd_err_set(err, "model.merges is not an array");
        goto fail;
    }
    if (tok_pairmap_init(&t->merges, json_array_size(merges)) < 0) {
        specd_err_set(err, "out of memory");
        goto fail;
    }
    size_t skipped = 0;
    json_array_foreach(merges, i, v) {
        const char *l, *r;
        size_t ll, rl;
        if (json_is_string(v)) {
            l = json_string_value(v);
            const char *sp = strchr(l, ' ');
            if (!sp) {
                specd_err_set(err, "merge %zu is not \"left right\"", i);
                goto fail;
            }
            ll = (size_t)(sp - l);
            r = sp + 1;
            rl = strlen(r);
        } else if (json_array_size(v) == 2 && json_is_string(json_array_get(v, 0)) &&
                   json_is_string(json_array_get(v, 1))) {
            l = json_string_value(json_array_get(v, 0));
            r = json_string_value(json_array_get(v, 1));
            ll = strlen(l);
            rl = strlen(r);
        } else {
            specd_err_set(err, "merge %zu is neither a string nor a pair", i);
            goto fail;
        }
        if (ll + rl + 1 > bufcap) {
            free(buf);
            bufcap = (ll + rl) * 2 + 16;
            if (!(buf = malloc(bufcap))) {
                specd_err_set(err, "out of memory");
                goto fail;
            }
        }
        size_t dl = tok_bytelevel_decode(l, ll, buf);
        int32_t left = tok_strmap_get(&t->plain, buf, dl);
        dl = tok_bytelevel_decode(r, rl, buf);
        int32_t right = tok_strmap_get(&t->plain, buf, dl);
        if (left < 0 || right < 0) {
            skipped++;
            continue;
        }
        int rc = tok_add_merge(t, left, right, (int32_t)i, err);
        if (rc < 0) goto fail;
        skipped += rc > 0;
    }
    if (skipped) LOG_WARN("tokenizer: %zu merges refer to tokens not in the vocabulary; ignored", skipped);
    if (setup_pretok(t, json_object_get(root, "pre_tokenizer"), err) < 0) goto fail;
    free(buf);
    json_decref(root);
    *out = t;
    return 0;
fail:
    free(buf);
    json_decref(root);
    tok_destroy(t);
    return specd_err_wrap(err, "tok_create_from_hf(%s)", tokenizer_json_path);
}
