/*
 * tokenizer.c: the tokenizer object shared by every loader: construction
 * (tok_alloc / tok_set_token / tok_add_merge / tok_finish), the hash maps it
 * is indexed by, the GPT-2 byte-level mapping, and the read-only accessors of
 * tokenizer.h.
 *
 * Invariants: see tok_internal.h. Everything here runs once at load time
 * except the accessors and the map lookups, which are read-only and
 * thread-safe.
 */
#define _GNU_SOURCE /* qsort_r */
#include "engine/tokenizer/tok_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "engine/util/log.h"

/* ---------------------------------------------------------------- hashing */

uint64_t tok_hash_bytes(const char *k, size_t n) {
    /* 8 bytes at a time, multiply-xorshift mixing; quality is ample for
     * vocabulary strings and BPE pieces. */
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xC2B2AE3D27D4EB4Full);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, k, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        k += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, k, n);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 32;
    return h;
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

int tok_strmap_init(tok_strmap *m, size_t expected) {
    memset(m, 0, sizeof *m);
    m->cap = pow2_at_least(expected * 2 + 1);
    m->key = calloc(m->cap, sizeof *m->key);
    m->klen = calloc(m->cap, sizeof *m->klen);
    m->val = malloc(m->cap * sizeof *m->val);
    if (!m->key || !m->klen || !m->val) {
        tok_strmap_free(m);
        return -1;
    }
    for (size_t i = 0; i < m->cap; i++) m->val[i] = -1;
    return 0;
}

void tok_strmap_free(tok_strmap *m) {
    free(m->key);
    free(m->klen);
    free(m->val);
    memset(m, 0, sizeof *m);
}

static int strmap_grow(tok_strmap *m) {
    tok_strmap g;
    if (tok_strmap_init(&g, m->cap) < 0) return -1;
    for (size_t i = 0; i < m->cap; i++)
        if (m->val[i] >= 0 && tok_strmap_put(&g, m->key[i], m->klen[i], m->val[i]) < 0) {
            tok_strmap_free(&g);
            return -1;
        }
    tok_strmap_free(m);
    *m = g;
    return 0;
}

int tok_strmap_put(tok_strmap *m, const char *k, size_t klen, int32_t v) {
    if ((m->n + 1) * 2 > m->cap && strmap_grow(m) < 0) return -1;
    size_t mask = m->cap - 1, i = (size_t)tok_hash_bytes(k, klen) & mask;
    while (m->val[i] >= 0) {
        if (m->klen[i] == klen && memcmp(m->key[i], k, klen) == 0) {
            m->val[i] = v;
            return 0;
        }
        i = (i + 1) & mask;
    }
    m->key[i] = k;
    m->klen[i] = (uint32_t)klen;
    m->val[i] = v;
    m->n++;
    return 0;
}

int32_t tok_strmap_get(const tok_strmap *m, const char *k, size_t klen) {
    if (!m->cap) return -1;
    size_t mask = m->cap - 1, i = (size_t)tok_hash_bytes(k, klen) & mask;
    while (m->val[i] >= 0) {
        if (m->klen[i] == klen && memcmp(m->key[i], k, klen) == 0) return m->val[i];
        i = (i + 1) & mask;
    }
    return -1;
}

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
}

int tok_pairmap_init(tok_pairmap *m, size_t expected) {
    memset(m, 0, sizeof *m);
    m->cap = pow2_at_least(expected * 2 + 1);
    m->key = malloc(m->cap * sizeof *m->key);
    m->rank = malloc(m->cap * sizeof *m->rank);
    m->result = malloc(m->cap * sizeof *m->result);
    if (!m->key || !m->rank || !m->result) {
        tok_pairmap_free(m);
        return -1;
    }
    memset(m->key, 0xFF, m->cap * sizeof *m->key);
    return 0;
}

void tok_pairmap_free(tok_pairmap *m) {
    free(m->key);
    free(m->rank);
    free(m->result);
    memset(m, 0, sizeof *m);
}

static int pairmap_grow(tok_pairmap *m) {
    tok_pairmap g;
    if (tok_pairmap_init(&g, m->cap) < 0) return -1;
    for (size_t i = 0; i < m->cap; i++)
        if (m->key[i] != UINT64_MAX)
            tok_pairmap_put(&g, (int32_t)(m->key[i] >> 32), (int32_t)(m->key[i] & 0xFFFFFFFFu),
                            m->rank[i], m->result[i]);
    tok_pairmap_free(m);
    *m = g;
    return 0;
}

int tok_pairmap_put(tok_pairmap *m, int32_t left, int32_t right, int32_t rank, int32_t result) {
    if ((m->n + 1) * 2 > m->cap && pairmap_grow(m) < 0) return -1;
    uint64_t k = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    size_t mask = m->cap - 1, i = (size_t)mix64(k) & mask;
    while (m->key[i] != UINT64_MAX) {
        if (m->key[i] == k) return 0; /* first (lowest) rank wins, as in HF's merges map */
        i = (i + 1) & mask;
    }
    m->key[i] = k;
    m->rank[i] = rank;
    m->result[i] = result;
    m->n++;
    return 0;
}

int32_t tok_pairmap_get(const tok_pairmap *m, int32_t left, int32_t right, int32_t *result) {
    if (!m->cap) return -1;
    uint64_t k = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    size_t mask = m->cap - 1, i = (size_t)mix64(k) & mask;
    while (m->key[i] != UINT64_MAX) {
        if (m->key[i] == k) {
            *result = m->result[i];
            return m->rank[i];
        }
        i = (i + 1) & mask;
    }
    return -1;
}

/* ------------------------------------------------- GPT-2 byte-level mapping */
/* GPT-2's bytes_to_unicode(): printable Latin-1 bytes (! .. ~, ¡ .. ¬, ® .. ÿ)
 * map to themselves; the other 68 bytes map, in increasing byte order, to
 * U+0100, U+0101, ... (so ' ' -> U+0120 'Ġ', '\n' -> U+010A 'Ċ'). */
static bool bl_printable(unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

uint32_t tok_bytelevel_cp(uint8_t b) {
    if (bl_printable(b)) return b;
    uint32_t n = 0;
    for (unsigned i = 0; i < b; i++)
        if (!bl_printable(i)) n++;
    return 0x100 + n;
}

int tok_bytelevel_byte(uint32_t cp) {
    if (cp < 0x100) return bl_printable(cp) ? (int)cp : -1;
    if (cp >= 0x100 + 68) return -1;
    uint32_t n = cp - 0x100;
    for (unsigned i = 0; i < 256; i++)
        if (!bl_printable(i) && n-- == 0) return (int)i;
    return -1;
}

static int16_t bl_inv[0x100 + 68]; /* code point -> byte, -1 if unmapped */
static pthread_once_t bl_once = PTHREAD_ONCE_INIT;
static void bl_init(void) {
    for (uint32_t cp = 0; cp < 0x100 + 68; cp++) bl_inv[cp] = (int16_t)tok_bytelevel_byte(cp);
}

size_t tok_bytelevel_decode(const char *s, size_t len, char *out) {
    pthread_once(&bl_once, bl_init);
    const int16_t *inv = bl_inv;
    const unsigned char *u = (const unsigned char *)s;
    size_t o = 0, i = 0;
    while (i < len) {
        size_t sl = tok_utf8_seq_len(u + i, len - i);
        if (sl == 0) { /* not UTF-8: copy the byte */
            out[o++] = s[i++];
            continue;
        }
        uint32_t cp;
        if (sl == 1) cp = u[i];
        else if (sl == 2) cp = (uint32_t)(u[i] & 0x1F) << 6 | (u[i + 1] & 0x3F);
        else cp = 0x110000; /* 3- and 4-byte characters are never mapped bytes */
        if (cp < 0x100 + 68 && inv[cp] >= 0) {
            out[o++] = (char)inv[cp];
        } else {
            memcpy(out + o, s + i, sl);
            o += sl;
        }
        i += sl;
    }
    return o;
}

/* ------------------------------------------------------------ construction */

tokenizer *tok_alloc(int32_t n_vocab, specd_err *err) {
    if (n_vocab <= 0 || n_vocab > (1 << 24)) {
        specd_err_set(err, "tokenizer: vocabulary size %d out of range", n_vocab);
        return NULL;
    }
    tokenizer *t = calloc(1, sizeof *t);
    if (!t) goto oom;
    t->n_vocab = n_vocab;
    t->tok_off = calloc((size_t)n_vocab, sizeof *t->tok_off);
    t->tok_len = calloc((size_t)n_vocab, sizeof *t->tok_len);
    t->attr = malloc((size_t)n_vocab);
    if (!t->tok_off || !t->tok_len || !t->attr) goto oom;
    memset(t->attr, TOK_ATTR_HOLE, (size_t)n_vocab);
    t->bos = t->eos = t->unk = t->pad = -1;
    return t;
oom:
    tok_destroy(t);
    specd_err_set(err, "tokenizer: out of memory");
    return NULL;
}

int tok_set_token(tokenizer *t, int32_t id, const char *bytes, size_t len, uint8_t attr, specd_err *err) {
    if (id < 0 || id >= t->n_vocab) return specd_err_set(err, "tokenizer: token id %d out of range", id);
    if (len > (1u << 20)) return specd_err_set(err, "tokenizer: token %d is %zu bytes long", id, len);
    if (t->arena_len + len + 1 > t->arena_cap) { /* capacity doubles */
        size_t nc = t->arena_cap ? t->arena_cap : 1 << 16;
        while (nc < t->arena_len + len + 1) nc *= 2;
        char *na = realloc(t->arena, nc);
        if (!na) return specd_err_set(err, "tokenizer: out of memory");
        t->arena = na;
        t->arena_cap = nc;
    }
    memcpy(t->arena + t->arena_len, bytes, len);
    t->tok_off[id] = t->arena_len;
    t->tok_len[id] = (uint32_t)len;
    t->arena_len += len;
    t->attr[id] = attr;
    return 0;
}

int tok_add_merge(tokenizer *t, int32_t left, int32_t right, int32_t rank, specd_err *err) {
    int32_t res = -1;
    if (left < 0 || right < 0 || left >= t->n_vocab || right >= t->n_vocab)
        return specd_err_set(err, "tokenizer: merge %d has an id out of range", rank);
    /* the merged token is the concatenation of both sides' bytes */
    size_t ll = t->tok_len[left], rl = t->tok_len[right];
    char stackbuf[256];
    char *buf = ll + rl <= sizeof stackbuf ? stackbuf : malloc(ll + rl);
    if (!buf) return specd_err_set(err, "tokenizer: out of memory");
    memcpy(buf, t->arena + t->tok_off[left], ll);
    memcpy(buf + ll, t->arena + t->tok_off[right], rl);
    res = tok_strmap_get(&t->plain, buf, ll + rl);
    if (buf != stackbuf) free(buf);
    if (res < 0) return 1; /* result not in the vocabulary: HF ignores such merges */
    if (!t->merges.cap && tok_pairmap_init(&t->merges, 1024) < 0)
        return specd_err_set(err, "tokenizer: out of memory");
    if (tok_pairmap_put(&t->merges, left, right, rank, res) < 0)
        return specd_err_set(err, "tokenizer: out of memory");
    return 0;
}

static int cmp_added(const void *a, const void *b, void *ctx) {
    const tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    unsigned char fx = (unsigned char)t->arena[t->tok_off[x]], fy = (unsigned char)t->arena[t->tok_off[y]];
    if (fx != fy) return fx < fy ? -1 : 1;
    uint32_t lx = t->tok_len[x], ly = t->tok_len[y];
    if (lx != ly) return lx > ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

static void add_stop(tokenizer *t, int32_t id) {
    if (id < 0 || t->n_stop >= sizeof t->stop / sizeof t->stop[0]) return;
    for (size_t i = 0; i < t->n_stop; i++)
        if (t->stop[i] == id) return;
    t->stop[t->n_stop++] = id;
}

void tok_set_stops(tokenizer *t) {
    t->n_stop = 0;
    add_stop(t, t->eos);
    /* EOS plus the end-of-turn token of the chat families (REFERENCE: Kimi
     * stops on [EOS] and <|im_end|>). <|endoftext|> is deliberately not added:
     * HF generate would not stop on it for SmolLM2-Instruct (eos 2). */
    static const char *const stop_names[] = {"<|im_end|>"};
    for (size_t i = 0; i < sizeof stop_names / sizeof stop_names[0]; i++) {
        int32_t id = tok_strmap_get(&t->by_bytes, stop_names[i], strlen(stop_names[i]));
        if (id >= 0 && (t->attr[id] & TOK_ATTR_SPECIAL)) add_stop(t, id);
    }
}

int tok_finish(tokenizer *t, specd_err *err) {
    /* plain: the BPE vocabulary; lowest id wins among duplicates (iterate
     * downwards so the lowest is written last). by_bytes: the same plus the
     * specials/added tokens, which win, so tok_token_id("<|im_end|>") is the
     * special id. */
    /* maps sized by the tokens present, not by the id range: a hostile file
     * may name one id near 2^24 with a few hundred tokens (fuzz_tok_tiktoken) */
    size_t n_present = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) n_present += !(t->attr[id] & TOK_ATTR_HOLE);
    if (tok_strmap_init(&t->plain, n_present) < 0) goto oom;
    if (tok_strmap_init(&t->by_bytes, n_present) < 0) goto oom;
    for (int32_t id = t->n_vocab - 1; id >= 0; id--)
        if (!(t->attr[id] & (TOK_ATTR_HOLE | TOK_ATTR_SPECIAL | TOK_ATTR_ADDED))) {
            if (tok_strmap_put(&t->plain, t->arena + t->tok_off[id], t->tok_len[id], id) < 0) goto oom;
            if (tok_strmap_put(&t->by_bytes, t->arena + t->tok_off[id], t->tok_len[id], id) < 0) goto oom;
        }
    /* A byte without a token is dropped by encode, as HF's BPE model does
     * when unk_token is null (SmolLM2 lacks 21 of the 256, e.g. 0x04, 0xF5..0xFF). */
    int n_bytes = 0;
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        t->byte_id[b] = tok_strmap_get(&t->plain, &c, 1);
        n_bytes += t->byte_id[b] >= 0;
    }
    if (n_bytes < 128)
        return specd_err_set(err, "tokenizer: only %d of 256 single-byte tokens: not a byte-level vocabulary", n_bytes);
    if (n_bytes < 256) LOG_DEBUG("tokenizer: %d byte values have no token and are dropped by encode", 256 - n_bytes);
    size_t n_added = 0;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if ((t->attr[id] & (TOK_ATTR_SPECIAL | TOK_ATTR_ADDED)) && t->tok_len[id] > 0) n_added++;
    free(t->added);
    t->added = malloc((n_added ? n_added : 1) * sizeof *t->added);
    if (!t->added) goto oom;
    t->n_added = 0;
    for (int32_t id = t->n_vocab - 1; id >= 0; id--) {
        if (!(t->attr[id] & (TOK_ATTR_SPECIAL | TOK_ATTR_ADDED)) || t->tok_len[id] == 0) continue;
        t->added[t->n_added++] = id;
        if (tok_strmap_put(&t->by_bytes, t->arena + t->tok_off[id], t->tok_len[id], id) < 0) goto oom;
    }
    qsort_r(t->added, t->n_added, sizeof *t->added, cmp_added, t);
    memset(t->added_start, 0, sizeof t->added_start);
    for (size_t i = 0; i < t->n_added; i++) t->added_start[(unsigned char)t->arena[t->tok_off[t->added[i]]] + 1]++;
    for (int b = 0; b < 256; b++) t->added_start[b + 1] += t->added_start[b];

    tok_set_stops(t);
    return 0;
oom:
    return specd_err_set(err, "tokenizer: out of memory");
}

/* ---------------------------------------------------------------- accessors */

void tok_destroy(tokenizer *t) {
    if (!t) return;
    free(t->arena);
    free(t->tok_off);
    free(t->tok_len);
    free(t->attr);
    tok_strmap_free(&t->by_bytes);
    tok_strmap_free(&t->plain);
    tok_pairmap_free(&t->merges);
    free(t->added);
    pretok_free(&t->pt);
    free(t->chat_template);
    free(t->default_system);
    free(t);
}

int32_t tok_vocab_size(const tokenizer *t) { return t->n_vocab; }
int32_t tok_bos_id(const tokenizer *t) { return t->bos; }
int32_t tok_eos_id(const tokenizer *t) { return t->eos; }

size_t tok_stop_ids(const tokenizer *t, const int32_t **ids) {
    *ids = t->stop;
    return t->n_stop;
}

bool tok_is_special(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && (t->attr[id] & TOK_ATTR_SPECIAL);
}

int32_t tok_token_id(const tokenizer *t, const char *text, size_t len) {
    return tok_strmap_get(&t->by_bytes, text, len);
}

const char *tok_token_bytes(const tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab) return NULL;
    if (len) *len = t->tok_len[id];
    return t->arena + t->tok_off[id];
}

int tok_ids_push(tok_ids *ids, int32_t id) {
    if (ids->n == ids->cap) {
        size_t nc = ids->cap ? ids->cap * 2 : 64;
        int32_t *nv = realloc(ids->v, nc * sizeof *nv);
        if (!nv) return -1;
        ids->v = nv;
        ids->cap = nc;
    }
    ids->v[ids->n++] = id;
    return 0;
}
