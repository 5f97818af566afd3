/*
 * detok.c: ids -> bytes, in one go (tok_decode) and incrementally
 * (tok_stream) for streaming generation.
 *
 * tok_decode returns the tokens' bytes concatenated, unmodified: it may hold
 * ill-formed UTF-8 (a byte-level vocabulary splits characters across
 * tokens), and decode(encode(s)) == s for any byte string s.
 *
 * tok_stream emits only well-formed UTF-8. Its output after tok_stream_flush
 * equals the lossy UTF-8 decoding of tok_decode's bytes with the "maximal
 * subpart" rule of Unicode 15 section 3.9 (U+FFFD per maximal ill-formed
 * subpart), which is what Python's bytes.decode("utf-8", "replace") and
 * Rust's String::from_utf8_lossy (so HF's decode) produce. Bytes that may still
 * become a character are held (at most 3); a U+FFFD is emitted as soon as a
 * subpart is known to be ill-formed, never earlier.
 *
 * Threading: tok_decode is thread-safe; a tok_stream belongs to one thread.
 */
#include "engine/tokenizer/tok_internal.h"

#include <stdlib.h>
#include <string.h>

int tok_decode(const tokenizer *t, const int32_t *ids, size_t n, bool skip_special, char **text, size_t *len,
               specd_err *err) {
    *text = NULL;
    if (len) *len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return specd_err_set(err, "tokenizer: decode: id %d at position %zu out of range [0, %d)", ids[i], i,
                                 t->n_vocab);
        if (!(skip_special && (t->attr[ids[i]] & TOK_ATTR_SPECIAL))) total += t->tok_len[ids[i]];
    }
    char *out = malloc(total + 1);
    if (!out) return specd_err_set(err, "tokenizer: out of memory");
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (skip_special && (t->attr[ids[i]] & TOK_ATTR_SPECIAL)) continue;
        memcpy(out + o, t->arena + t->tok_off[ids[i]], t->tok_len[ids[i]]);
        o += t->tok_len[ids[i]];
    }
    out[o] = '\0';
    *text = out;
    if (len) *len = o;
    return 0;
}

/* ------------------------------------------------------------ the stream */

struct tok_stream {
    const tokenizer *t;
    bool skip_special;
    unsigned char held[4]; /* a proper prefix of a well-formed sequence */
    size_t n_held;
};

tok_stream *tok_stream_create(const tokenizer *t, bool skip_special) {
    tok_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->t = t;
    s->skip_special = skip_special;
    return s;
}

void tok_stream_destroy(tok_stream *s) { free(s); }

static int out_append(char **out, size_t *len, size_t *cap, const void *p, size_t n) {
    if (*len + n + 1 > *cap || !*out) {
        size_t nc = *cap ? *cap : 64;
        while (nc < *len + n + 1) nc *= 2;
        char *no = realloc(*out, nc);
        if (!no) return -1;
        *out = no;
        *cap = nc;
    }
    memcpy(*out + *len, p, n);
    *len += n;
    (*out)[*len] = '\0';
    return 0;
}

static const char REPLACEMENT[3] = {(char)0xEF, (char)0xBF, (char)0xBD}; /* U+FFFD */

/* How many bytes at S (N available) are a prefix of some well-formed
 * sequence: 0 for a byte that can start none (80..C1, F5..FF), else 1..4
 * (4 only for a complete 4-byte sequence). Unicode 15 Table 3-7. */
static size_t utf8_prefix_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t need;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) need = 1;
    else if (c >= 0xE0 && c <= 0xEF) {
        need = 2;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 3;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else return 0;
    size_t k = 1;
    if (k < n && k <= need && s[1] >= lo && s[1] <= hi) {
        k++;
        while (k < n && k <= need && (s[k] & 0xC0) == 0x80) k++;
    }
    return k;
}

/* Emits every character of BUF[0, n) that is final; keeps a trailing proper
 * prefix in the stream. */
static int stream_feed(tok_stream *s, const unsigned char *buf, size_t n, char **out, size_t *len, size_t *cap) {
    size_t i = 0, run = 0; /* run: start of pending well-formed bytes to copy */
    while (i < n) {
        if (buf[i] < 0x80) {
            i++;
            continue;
        }
        size_t l = tok_utf8_seq_len(buf + i, n - i);
        if (l) {
            i += l;
            continue;
        }
        size_t k = utf8_prefix_len(buf + i, n - i);
        if (k && i + k == n) break; /* may still complete: hold */
        if (out_append(out, len, cap, buf + run, i - run) < 0) return -1;
        if (out_append(out, len, cap, REPLACEMENT, sizeof REPLACEMENT) < 0) return -1;
        i += k ? k : 1;
        run = i;
    }
    if (out_append(out, len, cap, buf + run, i - run) < 0) return -1;
    s->n_held = n - i;
    memcpy(s->held, buf + i, s->n_held);
    return 0;
}

int tok_stream_push(tok_stream *s, int32_t id, char **out, size_t *out_len, size_t *out_cap) {
    const tokenizer *t = s->t;
    if (id < 0 || id >= t->n_vocab) return -1;
    if (s->skip_special && (t->attr[id] & TOK_ATTR_SPECIAL)) return 0;
    size_t tl = t->tok_len[id];
    if (out_append(out, out_len, out_cap, "", 0) < 0) return -1; /* *out always allocated */
    if (tl == 0) return 0;
    const unsigned char *tb = (const unsigned char *)t->arena + t->tok_off[id];
    if (!s->n_held) return stream_feed(s, tb, tl, out, out_len, out_cap);
    unsigned char small[64];
    size_t n = s->n_held + tl;
    unsigned char *buf = n <= sizeof small ? small : malloc(n);
    if (!buf) return -1;
    memcpy(buf, s->held, s->n_held);
    memcpy(buf + s->n_held, tb, tl);
    int rc = stream_feed(s, buf, n, out, out_len, out_cap);
    if (buf != small) free(buf);
    return rc;
}

void tok_stream_prime(tok_stream *s, const int32_t *ids, size_t n) {
    const tokenizer *t = s->t;
    unsigned char tail[8];
    size_t nt = 0;
    /* the last (up to) 3 bytes of the prompt, specials included only if they are output text */
    for (size_t i = n; i > 0 && nt < 3; i--) {
        int32_t id = ids[i - 1];
        if (id < 0 || id >= t->n_vocab) return;
        if (s->skip_special && (t->attr[id] & TOK_ATTR_SPECIAL)) continue;
        const unsigned char *b = (const unsigned char *)t->arena + t->tok_off[id];
        for (size_t k = t->tok_len[id]; k > 0 && nt < 3; k--) {
            memmove(tail + 1, tail, nt);
            tail[0] = b[k - 1];
            nt++;
        }
    }
    /* the start of the last character: the last byte that is not a continuation byte */
    size_t p = nt;
    while (p > 0 && (tail[p - 1] & 0xC0) == 0x80) p--;
    if (p == 0) return;
    p--;
    size_t l = nt - p;
    if (tail[p] < 0x80 || tok_utf8_seq_len(tail + p, l) || utf8_prefix_len(tail + p, l) != l) return;
    memcpy(s->held, tail + p, l); /* a proper prefix of a well-formed character */
    s->n_held = l;
}

void tok_stream_drop(tok_stream *s) { s->n_held = 0; }

int tok_stream_flush(tok_stream *s, char **out, size_t *out_len, size_t *out_cap) {
    if (out_append(out, out_len, out_cap, "", 0) < 0) return -1;
    if (!s->n_held) return 0;
    s->n_held = 0; /* a held prefix is one maximal subpart */
    return out_append(out, out_len, out_cap, REPLACEMENT, sizeof REPLACEMENT);
}
