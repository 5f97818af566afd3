/*
 * pretokenize.c: splitting text into the pieces BPE runs on, through PCRE2,
 * and the UTF-8 well-formedness checks every other file relies on.
 *
 * Semantics reproduced (checked against HF `tokenizers` by the fixtures of
 * tests/tokenizer/):
 *  - HF Split/ByteLevel "Isolated" behaviour: every regex match is a piece and
 *    so is every gap between matches (the GPT-2 regex leaves none on valid text).
 *  - HF Digits(individual_digits=true) before ByteLevel (SmolLM2's
 *    tokenizer.json; llama.cpp's "smollm" pre-tokenizer): each \p{N} code point
 *    is a piece, and the regex then runs on each digit-free stretch AS ITS OWN
 *    SUBJECT, so "a  1" gives "a", "  ", "1" (the lookahead in \s+(?!\S) sees
 *    the stretch end, not the digit). A single combined regex would give
 *    "a", " ", " ", "1" and different ids.
 *  - \s is spelled out as the Unicode White_Space set, which is what
 *    Oniguruma (HF) and Rust regex (tiktoken) use; PCRE2's UCP \s differs on
 *    U+0085 and others.
 *  - Bytes that are not part of well-formed UTF-8 are pieces of one byte each
 *    (HF cannot take such input at all; see tests/fixtures/tokenizer/README.md).
 *
 * Threading: a pretok is immutable after pretok_init; the caller passes its
 * own pcre2_match_data to pretok_split.
 */
#include "engine/tokenizer/tok_internal.h"

#include <stdlib.h>
#include <string.h>

/* Unicode White_Space (PropList.txt), as used by Oniguruma's and Rust's \s. */
#define WS "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"

const char *const TOK_RE_GPT2 =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS "])|[" WS "]+";

const char *const TOK_RE_LLAMA3 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*"
    "|[" WS "]*[\\r\\n]+|[" WS "]+(?![^" WS "])|[" WS "]+";

/* Kimi K2: the published pattern uses the class intersection
 * [\p{Lu}...&&[^\p{Han}]] (Rust regex syntax). PCRE2 has no intersection (it
 * silently parses "&&[" as literals), so each class becomes a negative
 * lookahead for Han followed by the class. And \p{Han} is written \p{sc:Han}:
 * since 10.40 PCRE2's bare \p{Han} tests Script_Extensions (so U+3002 "。" and
 * U+300C "「" are Han), while Rust regex (tiktoken) tests the Script property. */
#define KIMI_UP "(?:(?!\\p{sc:Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])"
#define KIMI_LO "(?:(?!\\p{sc:Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])"
#define KIMI_CONTR "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
const char *const TOK_RE_KIMI =
    "[\\p{sc:Han}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?" KIMI_UP "*" KIMI_LO "+" KIMI_CONTR
    "|[^\\r\\n\\p{L}\\p{N}]?" KIMI_UP "+" KIMI_LO "*" KIMI_CONTR
    "|\\p{N}{1,3}"
    "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*"
    "|[" WS "]*[\\r\\n]+"
    "|[" WS "]+(?![^" WS "])"
    "|[" WS "]+";

/* ------------------------------------------------------------------ UTF-8 */

size_t tok_utf8_seq_len(const unsigned char *s, size_t n) {
    if (n == 0) return 0;
    unsigned c = s[0];
    if (c < 0x80) return 1;
    if (c < 0xC2) return 0;
    if (c < 0xE0) return n >= 2 && (s[1] & 0xC0) == 0x80 ? 2 : 0;
    if (c < 0xF0) {
        if (n < 3) return 0;
        unsigned lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        return s[1] >= lo && s[1] <= hi && (s[2] & 0xC0) == 0x80 ? 3 : 0;
    }
    if (c < 0xF5) {
        if (n < 4) return 0;
        unsigned lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        return s[1] >= lo && s[1] <= hi && (s[2] & 0xC0) == 0x80 && (s[3] & 0xC0) == 0x80 ? 4 : 0;
    }
    return 0;
}

size_t tok_utf8_valid_prefix(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) { /* ASCII fast path */
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ull)) {
                i += 8;
                continue;
            }
        }
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t l = tok_utf8_seq_len(s + i, n - i);
        if (!l) break;
        i += l;
    }
    return i;
}

/* ---------------------------------------------------------------- compile */

static pcre2_code *compile(const char *pattern, specd_err *err) {
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        specd_err_set(err, "tokenizer: pre-tokenizer regex does not compile at offset %zu: %s", (size_t)eo,
                      (const char *)msg);
        return NULL;
    }
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* optional: interpreter otherwise */
    return re;
}

int pretok_init(pretok *p, pretok_kind kind, const char *pattern, specd_err *err) {
    memset(p, 0, sizeof *p);
    p->kind = kind;
    p->pattern = strdup(pattern);
    if (!p->pattern) return specd_err_set(err, "tokenizer: out of memory");
    if (!(p->re = compile(pattern, err))) goto fail;
    if (kind == PRETOK_DIGITS_REGEX && !(p->digit = compile("\\p{N}", err))) goto fail;
    return 0;
fail:
    pretok_free(p);
    return -1;
}

void pretok_free(pretok *p) {
    if (!p) return;
    pcre2_code_free(p->re);
    pcre2_code_free(p->digit);
    free(p->pattern);
    memset(p, 0, sizeof *p);
}

/* ------------------------------------------------------------------ split */

/* One match of RE in SUBJECT[0, n) at or after OFF. Returns 1 and [*s, *e),
 * 0 for no match, -1 on error. Falls back to the interpreter if the JIT stack
 * runs out (long runs of one class). */
static int match1(const pcre2_code *re, const char *subject, size_t n, size_t off, pcre2_match_data *md,
                  size_t *s, size_t *e, specd_err *err) {
    int rc = pcre2_match(re, (PCRE2_SPTR)subject, n, off, PCRE2_NO_UTF_CHECK, md, NULL);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(re, (PCRE2_SPTR)subject, n, off, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        return specd_err_set(err, "tokenizer: pre-tokenizer match failed: %s", (const char *)msg);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    *s = ov[0];
    *e = ov[1];
    return 1;
}

/* Regex split of one valid, digit-free stretch (its own subject). */
static int split_regex(const pretok *p, const char *s, size_t n, pcre2_match_data *md, pretok_piece_fn fn,
                       void *ctx, specd_err *err) {
    size_t off = 0;
    while (off < n) {
        size_t ms, me;
        int r = match1(p->re, s, n, off, md, &ms, &me, err);
        if (r < 0) return -1;
        if (r == 0) return fn(ctx, s + off, n - off);
        if (ms > off && (r = fn(ctx, s + off, ms - off))) return r;
        if (me == ms) { /* empty match: cannot happen with our patterns; keep progress */
            me = ms + tok_utf8_seq_len((const unsigned char *)s + ms, n - ms);
            if (me == ms) me = ms + 1;
        }
        if ((r = fn(ctx, s + ms, me - ms))) return r;
        off = me;
    }
    return 0;
}

static int split_valid(const pretok *p, const char *s, size_t n, pcre2_match_data *md, pretok_piece_fn fn,
                       void *ctx, specd_err *err) {
    if (p->kind != PRETOK_DIGITS_REGEX) return split_regex(p, s, n, md, fn, ctx, err);
    size_t off = 0;
    while (off < n) {
        size_t ds = n, de = n;
        /* ASCII-only stretches need no regex to find digits */
        size_t i = off;
        while (i < n && (unsigned char)s[i] < 0x80 && !(s[i] >= '0' && s[i] <= '9')) i++;
        if (i < n && s[i] >= '0' && s[i] <= '9') {
            ds = i;
            de = i + 1;
        } else if (i < n) {
            int r = match1(p->digit, s, n, i, md, &ds, &de, err);
            if (r < 0) return -1;
            if (r == 0) ds = de = n;
        }
        int r;
        if (ds > off && (r = split_regex(p, s + off, ds - off, md, fn, ctx, err))) return r;
        if (de > ds && (r = fn(ctx, s + ds, de - ds))) return r;
        off = de;
    }
    return 0;
}

int pretok_split(const pretok *p, const char *text, size_t len, pcre2_match_data *md, pretok_piece_fn fn,
                 void *ctx, specd_err *err) {
    const unsigned char *u = (const unsigned char *)text;
    size_t i = 0;
    while (i < len) {
        size_t v = tok_utf8_valid_prefix(u + i, len - i);
        int r;
        if (v && (r = split_valid(p, text + i, v, md, fn, ctx, err))) return r;
        i += v;
        if (i < len) { /* one ill-formed byte: a piece of its own */
            if ((r = fn(ctx, text + i, 1))) return r;
            i++;
        }
    }
    return 0;
}
