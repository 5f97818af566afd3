/*
 * bpe.c: text -> ids. Splits out added/special tokens (leftmost-longest, as
 * HF's AddedVocabulary does), pre-tokenizes the rest (pretokenize.c) and
 * runs byte-pair merging on each piece.
 *
 * Merging: a piece of n bytes starts as n single-byte tokens; the adjacent
 * pair with the lowest merge rank is merged, ties going to the leftmost, until
 * no adjacent pair merges. That order is HF tokenizers' (BinaryHeap keyed by
 * (rank, position)) and tiktoken's (argmin over ranks, first minimum). Here a
 * binary heap of candidate pairs with lazy invalidation gives O(n log n) per
 * piece. With ignore_merges (tiktoken, Llama-3) a piece that is itself a
 * vocabulary token is that token.
 *
 * A per-call cache (piece bytes -> ids) skips repeated words in long texts.
 * Nothing is shared between calls: tok_encode is thread-safe on a shared
 * tokenizer.
 */
#include "engine/tokenizer/tok_internal.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ merge heap */

typedef struct cand {
    int32_t rank, pos, lid, rid;
} cand;

static inline bool cand_less(const cand *a, const cand *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(cand *h, size_t *n, cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static cand heap_pop(cand *h, size_t *n) {
    cand top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const cand *best = &last;
        if (l < *n && cand_less(&h[l], best)) {
            m = l;
            best = &h[l];
        }
        if (r < *n && cand_less(&h[r], best)) m = r;
        if (m == i) break;
        h[i] = h[m];
        i = m;
    }
    if (*n) h[i] = last;
    return top;
}

static inline void push_pair(const tokenizer *t, cand *h, size_t *nh, const int32_t *id, int32_t a, int32_t b) {
    int32_t res;
    int32_t r = tok_pairmap_get(&t->merges, id[a], id[b], &res);
    if (r >= 0) heap_push(h, nh, (cand){r, a, id[a], id[b]});
}

/* BPE of one piece; appends its ids to OUT. */
static int bpe_piece(const tokenizer *t, const unsigned char *p, size_t n, tok_ids *out) {
    if (n == 1) return t->byte_id[p[0]] >= 0 ? tok_ids_push(out, t->byte_id[p[0]]) : 0;
    if (t->ignore_merges) {
        int32_t whole = tok_strmap_get(&t->plain, (const char *)p, n);
        if (whole >= 0) return tok_ids_push(out, whole);
    }
    enum { SMALL = 64 };
    int32_t sid[SMALL], snx[SMALL], spv[SMALL];
    cand sh[3 * SMALL];
    int32_t *id = sid, *nx = snx, *pv = spv;
    cand *h = sh;
    int rc = -1;
    if (n > SMALL) {
        if (n > INT32_MAX / 4) return -1;
        id = malloc(n * sizeof *id);
        nx = malloc(n * sizeof *nx);
        pv = malloc(n * sizeof *pv);
        h = malloc(3 * n * sizeof *h);
        if (!id || !nx || !pv || !h) goto done;
    }
    /* one symbol per byte that has a token; bytes without one are dropped and
     * their neighbours become adjacent (HF Word construction) */
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (t->byte_id[p[i]] >= 0) id[m++] = t->byte_id[p[i]];
    for (size_t i = 0; i < m; i++) {
        pv[i] = (int32_t)i - 1;
        nx[i] = i + 1 < m ? (int32_t)i + 1 : -1;
    }
    n = m;
    rc = 0;
    if (!n) goto done;
    rc = -1;
    size_t nh = 0;
    for (size_t i = 0; i + 1 < n; i++) push_pair(t, h, &nh, id, (int32_t)i, (int32_t)i + 1);
    while (nh) {
        cand c = heap_pop(h, &nh);
        int32_t a = c.pos, b = nx[a];
        if (id[a] != c.lid || b < 0 || id[b] != c.rid) continue; /* stale */
        int32_t res;
        tok_pairmap_get(&t->merges, id[a], id[b], &res);
        id[a] = res;
        id[b] = -1;
        nx[a] = nx[b];
        if (nx[b] >= 0) pv[nx[b]] = a;
        if (pv[a] >= 0) push_pair(t, h, &nh, id, pv[a], a);
        if (nx[a] >= 0) push_pair(t, h, &nh, id, a, nx[a]);
    }
    for (int32_t i = 0; i >= 0; i = nx[i])
        if (tok_ids_push(out, id[i]) < 0) goto done;
    rc = 0;
done:
    if (id != sid) {
        free(id);
        free(nx);
        free(pv);
        free(h);
    }
    return rc;
}

/* --------------------------------------------------------- per-call cache */

typedef struct cache_entry {
    uint64_t hash;
    const char *key; /* into the text being encoded; NULL = empty slot */
    uint32_t klen, ids_off, ids_n;
} cache_entry;

typedef struct piece_cache {
    cache_entry *e; /* cap slots; small enough to stay in cache (1 MB at most) */
    size_t cap, n;
    tok_ids vals; /* ids of all cached pieces, back to back */
} piece_cache;

enum { CACHE_MIN_TEXT = 2048, CACHE_MAX_PIECE = 128 };

static void cache_free(piece_cache *c) {
    free(c->e);
    free(c->vals.v);
    memset(c, 0, sizeof *c);
}

static int cache_init(piece_cache *c, size_t cap) {
    memset(c, 0, sizeof *c);
    c->cap = cap;
    c->e = calloc(cap, sizeof *c->e);
    return c->e ? 0 : -1;
}

typedef struct enc_ctx {
    const tokenizer *t;
    tok_ids *out;
    piece_cache cache; /* cap == 0: disabled */
} enc_ctx;

/* pretok callback: 0 = go on, 1 = out of memory (stops the split). */
static int on_piece_impl(enc_ctx *c, const char *piece, size_t len);
static int on_piece(void *vctx, const char *piece, size_t len) {
    return on_piece_impl(vctx, piece, len) < 0 ? 1 : 0;
}

static int on_piece_impl(enc_ctx *c, const char *piece, size_t len) {
    piece_cache *pc = &c->cache;
    if (!pc->cap || len < 2 || len > CACHE_MAX_PIECE) return bpe_piece(c->t, (const unsigned char *)piece, len, c->out);
    uint64_t h = tok_hash_bytes(piece, len);
    size_t mask = pc->cap - 1, i = (size_t)h & mask;
    for (cache_entry *e; (e = &pc->e[i])->key; i = (i + 1) & mask)
        if (e->hash == h && e->klen == len && memcmp(e->key, piece, len) == 0) {
            for (uint32_t k = 0; k < e->ids_n; k++)
                if (tok_ids_push(c->out, pc->vals.v[e->ids_off + k]) < 0) return -1;
            return 0;
        }
    size_t before = c->out->n;
    if (bpe_piece(c->t, (const unsigned char *)piece, len, c->out) < 0) return -1;
    if ((pc->n + 1) * 2 > pc->cap || pc->vals.n > (1u << 24)) { /* full: start over */
        memset(pc->e, 0, pc->cap * sizeof *pc->e);
        pc->n = 0;
        pc->vals.n = 0;
        i = (size_t)h & mask;
    }
    pc->e[i] = (cache_entry){h, piece, (uint32_t)len, (uint32_t)pc->vals.n, (uint32_t)(c->out->n - before)};
    pc->n++;
    for (size_t k = before; k < c->out->n; k++)
        if (tok_ids_push(&pc->vals, c->out->v[k]) < 0) return -1;
    return 0;
}

static int encode_plain_ctx(const tokenizer *t, enc_ctx *c, pcre2_match_data *md, const char *text, size_t len,
                            specd_err *err) {
    int r = pretok_split(&t->pt, text, len, md, on_piece, c, err);
    if (r > 0) return specd_err_set(err, "tokenizer: out of memory");
    return r; /* -1: pretok_split set err */
}

/* ---------------------------------------------------------------- encode */

static pcre2_match_data *md_create(specd_err *err) {
    pcre2_match_data *md = pcre2_match_data_create(4, NULL);
    if (!md) specd_err_set(err, "tokenizer: out of memory");
    return md;
}

int tok_encode_plain(const tokenizer *t, const char *text, size_t len, tok_ids *out, specd_err *err) {
    pcre2_match_data *md = md_create(err);
    if (!md) return -1;
    enc_ctx c = {.t = t, .out = out};
    int rc = encode_plain_ctx(t, &c, md, text, len, err);
    pcre2_match_data_free(md);
    return rc;
}

/* Longest added token at TEXT[pos..] that this call may split out, or -1. */
static int32_t added_at(const tokenizer *t, const char *text, size_t len, size_t pos, bool parse_special) {
    unsigned b = (unsigned char)text[pos];
    for (uint32_t k = t->added_start[b]; k < t->added_start[b + 1]; k++) {
        int32_t id = t->added[k];
        if (!parse_special && (t->attr[id] & TOK_ATTR_SPECIAL)) continue;
        uint32_t l = t->tok_len[id];
        if (l <= len - pos && memcmp(text + pos, t->arena + t->tok_off[id], l) == 0) return id;
    }
    return -1;
}

int tok_encode(const tokenizer *t, const char *text, size_t len, bool parse_special, int32_t **ids,
               size_t *n_ids, specd_err *err) {
    *ids = NULL;
    *n_ids = 0;
    tok_ids out = {0};
    enc_ctx c = {.t = t, .out = &out};
    pcre2_match_data *md = md_create(err);
    int rc = -1;
    if (!md) return -1;
    if (len >= CACHE_MIN_TEXT) {
        size_t cap = 1024;
        while (cap < len / 16 && cap < (1u << 15)) cap <<= 1;
        if (cache_init(&c.cache, cap) < 0) goto oom;
    }
    size_t start = 0;
    for (size_t pos = 0; pos < len && t->n_added; pos++) {
        if (t->added_start[(unsigned char)text[pos]] == t->added_start[(unsigned char)text[pos] + 1]) continue;
        int32_t id = added_at(t, text, len, pos, parse_special);
        if (id < 0) continue;
        if (pos > start && encode_plain_ctx(t, &c, md, text + start, pos - start, err) < 0) goto fail;
        if (tok_ids_push(&out, id) < 0) goto oom;
        pos += t->tok_len[id] - 1;
        start = pos + 1;
    }
    if (len > start && encode_plain_ctx(t, &c, md, text + start, len - start, err) < 0) goto fail;
    if (!out.v && !(out.v = malloc(sizeof *out.v))) goto oom;
    *ids = out.v;
    *n_ids = out.n;
    out.v = NULL;
    rc = 0;
    goto fail;
oom:
    specd_err_set(err, "tokenizer: out of memory");
fail:
    free(out.v);
    cache_free(&c.cache);
    pcre2_match_data_free(md);
    return rc;
}
