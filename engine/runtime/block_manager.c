/*
 * block_manager.c: KV block bookkeeping (see block_manager.h for the states
 * and invariants).
 *
 * Layout: per-block arrays (refcount, free-queue links, key, "keyed" flag,
 * hash-bucket chain link). The free queue is an intrusive doubly linked list
 * through prev/next arrays with a head and a tail, so removing a CACHED block
 * hit by a prefix lookup from the middle of the queue is O(1). The prefix
 * index is a chained hash table over the first 8 bytes of the SHA-256 key,
 * with 2^k >= 2 * n_blocks buckets and the chain threaded through the blocks
 * themselves (a block is in at most one bucket), so it never allocates after
 * creation.
 *
 * Threading: engine thread only.
 */
#include "engine/runtime/block_manager.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

#define KV_NONE (-1)

struct kv_block_manager {
    int32_t n_blocks;
    int32_t block_size;
    bool prefix_caching;

    int32_t *ref;       /* [n_blocks] reference count */
    int32_t *prev;      /* [n_blocks] free-queue links, KV_NONE at the ends */
    int32_t *next;
    uint8_t *in_queue;  /* [n_blocks] 1 if in the free queue */
    int32_t head, tail; /* free queue ends (LRU at head) */
    int32_t n_free;     /* length of the free queue */
    int32_t n_cached;   /* keyed blocks in the free queue */

    uint8_t *keyed;     /* [n_blocks] 1 if key[] is registered in the index */
    uint8_t *key;       /* [n_blocks, 32] */
    int32_t *bucket;    /* [n_buckets] first block of each chain */
    int32_t *chain;     /* [n_blocks] next block in the same bucket */
    uint32_t bucket_mask;

    kv_counters c;
};

/* ---------------------------------------------------------------- free queue */

static void queue_push_tail(kv_block_manager *m, int32_t b) {
    m->prev[b] = m->tail;
    m->next[b] = KV_NONE;
    if (m->tail != KV_NONE) m->next[m->tail] = b;
    else m->head = b;
    m->tail = b;
    m->in_queue[b] = 1;
    m->n_free++;
    if (m->keyed[b]) m->n_cached++;
}

static void queue_remove(kv_block_manager *m, int32_t b) {
    if (m->prev[b] != KV_NONE) m->next[m->prev[b]] = m->next[b];
    else m->head = m->next[b];
    if (m->next[b] != KV_NONE) m->prev[m->next[b]] = m->prev[b];
    else m->tail = m->prev[b];
    m->prev[b] = m->next[b] = KV_NONE;
    m->in_queue[b] = 0;
    m->n_free--;
    if (m->keyed[b]) m->n_cached--;
}

/* ---------------------------------------------------------------- prefix index */

static uint32_t key_bucket(const kv_block_manager *m, const uint8_t *key) {
    uint64_t h;
    memcpy(&h, key, sizeof h);
    return (uint32_t)(h ^ (h >> 32)) & m->bucket_mask;
}

static int32_t index_find(const kv_block_manager *m, const uint8_t *key) {
    for (int32_t b = m->bucket[key_bucket(m, key)]; b != KV_NONE; b = m->chain[b])
        if (memcmp(m->key + (size_t)b * KV_KEY_BYTES, key, KV_KEY_BYTES) == 0) return b;
    return KV_NONE;
}

static void index_insert(kv_block_manager *m, int32_t b, const uint8_t *key) {
    uint32_t h = key_bucket(m, key);
    memcpy(m->key + (size_t)b * KV_KEY_BYTES, key, KV_KEY_BYTES);
    m->chain[b] = m->bucket[h];
    m->bucket[h] = b;
    m->keyed[b] = 1;
    if (m->in_queue[b]) m->n_cached++;
    m->c.registered++;
}

static void index_remove(kv_block_manager *m, int32_t b) {
    uint32_t h = key_bucket(m, m->key + (size_t)b * KV_KEY_BYTES);
    int32_t *link = &m->bucket[h];
    while (*link != KV_NONE && *link != b) link = &m->chain[*link];
    if (*link == b) *link = m->chain[b];
    m->chain[b] = KV_NONE;
    if (m->in_queue[b]) m->n_cached--;
    m->keyed[b] = 0;
}

int kv_block_key(const uint8_t *parent, const int32_t *tokens, int32_t block_size, const char *salt,
                 size_t salt_len, uint8_t out[KV_KEY_BYTES]) {
    static const uint8_t zero[KV_KEY_BYTES] = {0};
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx) return -1;
    uint8_t sl[4] = {(uint8_t)salt_len, (uint8_t)(salt_len >> 8), (uint8_t)(salt_len >> 16),
                     (uint8_t)(salt_len >> 24)};
    int ok = EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1 &&
             EVP_DigestUpdate(ctx, parent ? parent : zero, KV_KEY_BYTES) == 1 &&
             EVP_DigestUpdate(ctx, sl, sizeof sl) == 1 &&
             (salt_len == 0 || EVP_DigestUpdate(ctx, salt, salt_len) == 1);
    for (int32_t i = 0; ok && i < block_size; i++) {
        uint32_t t = (uint32_t)tokens[i];
        uint8_t le[4] = {(uint8_t)t, (uint8_t)(t >> 8), (uint8_t)(t >> 16), (uint8_t)(t >> 24)};
        ok = EVP_DigestUpdate(ctx, le, sizeof le) == 1;
    }
    unsigned int n = 0;
    ok = ok && EVP_DigestFinal_ex(ctx, out, &n) == 1 && n == KV_KEY_BYTES;
    EVP_MD_CTX_free(ctx);
    return ok ? 0 : -1;
}

/* ---------------------------------------------------------------- lifecycle */

int kv_create(int32_t n_blocks, int32_t block_size, bool prefix_caching, kv_block_manager **out,
              specd_err *err) {
    *out = NULL;
    if (n_blocks < 1 || block_size < 1 || n_blocks > (1 << 28))
        return specd_err_set(err, "kv: bad pool size (%d blocks of %d tokens)", n_blocks, block_size);
    kv_block_manager *m = calloc(1, sizeof *m);
    if (!m) return specd_err_set(err, "kv: out of memory");
    m->n_blocks = n_blocks;
    m->block_size = block_size;
    m->prefix_caching = prefix_caching;
    uint32_t nb = 1;
    while (nb < 2u * (uint32_t)n_blocks) nb <<= 1;
    m->bucket_mask = nb - 1;
    size_t n = (size_t)n_blocks;
    m->ref = calloc(n, sizeof *m->ref);
    m->prev = malloc(n * sizeof *m->prev);
    m->next = malloc(n * sizeof *m->next);
    m->in_queue = calloc(n, 1);
    m->keyed = calloc(n, 1);
    m->key = calloc(n, KV_KEY_BYTES);
    m->chain = malloc(n * sizeof *m->chain);
    m->bucket = malloc((size_t)nb * sizeof *m->bucket);
    if (!m->ref || !m->prev || !m->next || !m->in_queue || !m->keyed || !m->key || !m->chain || !m->bucket) {
        kv_destroy(m);
        return specd_err_set(err, "kv: out of memory for %d blocks", n_blocks);
    }
    for (uint32_t i = 0; i < nb; i++) m->bucket[i] = KV_NONE;
    m->head = m->tail = KV_NONE;
    for (int32_t b = 0; b < n_blocks; b++) {
        m->chain[b] = KV_NONE;
        queue_push_tail(m, b);
    }
    *out = m;
    return 0;
}

void kv_destroy(kv_block_manager *m) {
    if (!m) return;
    free(m->ref);
    free(m->prev);
    free(m->next);
    free(m->in_queue);
    free(m->keyed);
    free(m->key);
    free(m->chain);
    free(m->bucket);
    free(m);
}

int32_t kv_block_size(const kv_block_manager *m) { return m->block_size; }
int32_t kv_num_blocks(const kv_block_manager *m) { return m->n_blocks; }
int32_t kv_num_free(const kv_block_manager *m) { return m->n_free; }
int32_t kv_num_cached(const kv_block_manager *m) { return m->n_cached; }
bool kv_prefix_caching(const kv_block_manager *m) { return m->prefix_caching; }
const kv_counters *kv_get_counters(const kv_block_manager *m) { return &m->c; }

int32_t kv_block_ref(const kv_block_manager *m, int32_t block) {
    return block >= 0 && block < m->n_blocks ? m->ref[block] : -1;
}

int32_t kv_blocks_for(const kv_block_manager *m, int32_t n_tokens) {
    return n_tokens <= 0 ? 0 : (n_tokens + m->block_size - 1) / m->block_size;
}

void kv_seq_init(kv_seq *s) { memset(s, 0, sizeof *s); }

/* ---------------------------------------------------------------- per-sequence */

static int seq_reserve(kv_seq *s, int32_t n) {
    if (n <= s->cap) return 0;
    int32_t cap = s->cap ? s->cap : 8;
    while (cap < n) cap *= 2;
    int32_t *nb = realloc(s->blocks, (size_t)cap * sizeof *nb);
    if (!nb) return -1;
    s->blocks = nb;
    s->cap = cap;
    return 0;
}

/* Takes a reference on block b (a prefix hit or a fresh allocation). */
static void block_ref(kv_block_manager *m, int32_t b) {
    if (m->ref[b] == 0 && m->in_queue[b]) queue_remove(m, b);
    m->ref[b]++;
}

static void block_unref(kv_block_manager *m, int32_t b) {
    if (--m->ref[b] == 0) {
        m->c.frees++;
        queue_push_tail(m, b);
    }
}

int32_t kv_seq_match_prefix(kv_block_manager *m, kv_seq *s, const int32_t *tokens, int32_t n_tokens,
                            const char *salt, size_t salt_len) {
    if (!m->prefix_caching || n_tokens <= 0 || s->n_blocks != 0) return 0;
    m->c.queries_tokens += n_tokens;
    int32_t max_blocks = (n_tokens - 1) / m->block_size;
    if (seq_reserve(s, max_blocks) != 0) return 0;
    uint8_t key[KV_KEY_BYTES];
    const uint8_t *parent = NULL;
    int32_t i = 0;
    for (; i < max_blocks; i++) {
        if (kv_block_key(parent, tokens + (size_t)i * m->block_size, m->block_size, salt, salt_len, key) != 0)
            break;
        int32_t b = index_find(m, key);
        if (b == KV_NONE) break;
        block_ref(m, b);
        s->blocks[s->n_blocks++] = b;
        memcpy(s->last_key, key, KV_KEY_BYTES);
        parent = s->last_key;
    }
    s->n_keyed = i;
    int32_t hit = i * m->block_size;
    m->c.hits_tokens += hit;
    return hit;
}

int32_t kv_seq_blocks_needed(const kv_block_manager *m, const kv_seq *s, int32_t n_tokens) {
    int32_t need = kv_blocks_for(m, n_tokens) - s->n_blocks;
    return need > 0 ? need : 0;
}

int kv_seq_ensure(kv_block_manager *m, kv_seq *s, int32_t n_tokens, specd_err *err) {
    int32_t need = kv_seq_blocks_needed(m, s, n_tokens);
    if (need == 0) return 0;
    if (need > m->n_free)
        return specd_err_set(err, "kv: need %d blocks, %d free", need, m->n_free);
    if (seq_reserve(s, s->n_blocks + need) != 0) return specd_err_set(err, "kv: out of memory");
    for (int32_t i = 0; i < need; i++) {
        int32_t b = m->head;
        queue_remove(m, b);
        if (m->keyed[b]) {
            index_remove(m, b);
            m->c.evictions++;
        }
        m->ref[b] = 1;
        m->c.allocs++;
        s->blocks[s->n_blocks++] = b;
    }
    return 0;
}

void kv_seq_commit(kv_block_manager *m, kv_seq *s, const int32_t *tokens, int32_t n_committed,
                   const char *salt, size_t salt_len) {
    if (!m->prefix_caching) return;
    int32_t full = n_committed / m->block_size;
    if (full > s->n_blocks) full = s->n_blocks;
    uint8_t key[KV_KEY_BYTES];
    for (int32_t i = s->n_keyed; i < full; i++) {
        if (kv_block_key(i > 0 ? s->last_key : NULL, tokens + (size_t)i * m->block_size, m->block_size, salt,
                         salt_len, key) != 0)
            return;
        int32_t b = s->blocks[i];
        if (!m->keyed[b] && index_find(m, key) == KV_NONE) index_insert(m, b, key);
        memcpy(s->last_key, key, KV_KEY_BYTES);
        s->n_keyed = i + 1;
    }
}

void kv_seq_truncate(kv_block_manager *m, kv_seq *s, int32_t n_tokens) {
    int32_t keep = kv_blocks_for(m, n_tokens);
    while (s->n_blocks > keep) block_unref(m, s->blocks[--s->n_blocks]);
    /* Dropping keyed blocks leaves last_key stale: restart the chain (the next
     * commit rehashes from block 0; already keyed blocks stay registered). */
    if (s->n_keyed > keep) s->n_keyed = 0;
}

void kv_seq_free(kv_block_manager *m, kv_seq *s) {
    while (s->n_blocks > 0) block_unref(m, s->blocks[--s->n_blocks]);
    free(s->blocks);
    kv_seq_init(s);
}

/* ---------------------------------------------------------------- checks */

int kv_check(const kv_block_manager *m, const kv_seq *const *live, size_t n_live, specd_err *err) {
    int32_t *count = calloc((size_t)m->n_blocks, sizeof *count);
    if (!count) return specd_err_set(err, "kv_check: out of memory");
    int rc = -1;
    for (size_t i = 0; i < n_live; i++)
        for (int32_t j = 0; j < live[i]->n_blocks; j++) {
            int32_t b = live[i]->blocks[j];
            if (b < 0 || b >= m->n_blocks) {
                specd_err_set(err, "kv_check: table %zu slot %d holds bad block %d", i, j, b);
                goto out;
            }
            count[b]++;
        }
    int32_t qlen = 0, qcached = 0;
    for (int32_t b = m->head, prev = KV_NONE; b != KV_NONE; prev = b, b = m->next[b]) {
        if (m->prev[b] != prev || !m->in_queue[b] || m->ref[b] != 0 || ++qlen > m->n_blocks) {
            specd_err_set(err, "kv_check: free queue corrupt at block %d", b);
            goto out;
        }
        qcached += m->keyed[b];
    }
    if (qlen != m->n_free || qcached != m->n_cached) {
        specd_err_set(err, "kv_check: free queue has %d (%d cached), counters say %d (%d)", qlen, qcached,
                      m->n_free, m->n_cached);
        goto out;
    }
    for (int32_t b = 0; b < m->n_blocks; b++) {
        if (m->ref[b] != count[b]) {
            specd_err_set(err, "kv_check: block %d ref %d but %d tables hold it", b, m->ref[b], count[b]);
            goto out;
        }
        if ((m->ref[b] == 0) != (m->in_queue[b] != 0)) {
            specd_err_set(err, "kv_check: block %d ref %d in_queue %d", b, m->ref[b], m->in_queue[b]);
            goto out;
        }
        if (m->keyed[b] && index_find(m, m->key + (size_t)b * KV_KEY_BYTES) != b) {
            specd_err_set(err, "kv_check: keyed block %d not found in the index", b);
            goto out;
        }
    }
    rc = 0;
out:
    free(count);
    return rc;
}
