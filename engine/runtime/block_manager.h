/*
 * block_manager.h: KV block bookkeeping for the paged KV cache (DESIGN.md
 * "Memory"). No device memory: the model owns the KV storage; this module only
 * decides which physical block ids a sequence's positions live in.
 *
 * Owns: the pool of n_blocks blocks of block_size token slots, their reference
 * counts, one free queue, and the prefix-cache index (SHA-256 key -> block).
 * A sequence's block table (kv_seq) is embedded in the caller's sequence
 * object; the manager edits it.
 *
 * Invariants:
 *  - A block is in exactly one state: FREE (ref 0, in the free queue, no key),
 *    CACHED (ref 0, in the free queue, key in the index: reusable by a prefix
 *    hit, evictable), or USED (ref >= 1, not in the free queue, key optional).
 *  - The free queue is LRU: allocation takes from the head; a freed block goes
 *    to the tail. A CACHED block taken for a new owner loses its key first
 *    (eviction). Never-used blocks start in the queue, so they go first.
 *  - Only FULL blocks whose every slot holds committed KV are keyed. Key =
 *    SHA-256(parent key (32 zero bytes for the first block) || salt length
 *    (u32 LE) || salt bytes || block_size token ids as i32 LE). A keyed block
 *    is never written again (its owner's later positions live in later blocks),
 *    which is what makes sharing it safe.
 *  - kv_num_free() counts FREE + CACHED blocks: all of them can be handed out.
 *
 * Threading: engine thread only (no locks). Counters are read by the engine
 * when it publishes its stats snapshot.
 */
#ifndef SPECD_RUNTIME_BLOCK_MANAGER_H
#define SPECD_RUNTIME_BLOCK_MANAGER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/util/err.h"

#define KV_KEY_BYTES 32

/* One sequence's block table. Zero-initialise (kv_seq_init) before use. */
typedef struct kv_seq {
    int32_t *blocks;        /* [n_blocks] physical block ids, position p is in blocks[p / block_size] */
    int32_t n_blocks;
    int32_t cap;            /* allocated length of blocks */
    int32_t n_keyed;        /* leading blocks whose prefix-cache key is known (registered or hit) */
    uint8_t last_key[KV_KEY_BYTES]; /* key of blocks[n_keyed-1] (chain parent), valid if n_keyed > 0 */
} kv_seq;

typedef struct kv_counters {
    int64_t allocs;          /* blocks handed out */
    int64_t frees;           /* blocks whose refcount dropped to 0 */
    int64_t evictions;       /* CACHED blocks reused for another content */
    int64_t queries_tokens;  /* prompt tokens looked up in the prefix cache */
    int64_t hits_tokens;     /* of those, found */
    int64_t registered;      /* blocks keyed */
} kv_counters;

typedef struct kv_block_manager kv_block_manager;

/* n_blocks >= 1, block_size >= 1. prefix_caching: key and reuse full blocks.
 * Returns 0, or -1 with err (bad sizes, out of memory). */
int kv_create(int32_t n_blocks, int32_t block_size, bool prefix_caching, kv_block_manager **out,
              specd_err *err);
void kv_destroy(kv_block_manager *m); /* NULL ok */

int32_t kv_block_size(const kv_block_manager *m);
int32_t kv_num_blocks(const kv_block_manager *m);
/* FREE + CACHED blocks (all allocatable). */
int32_t kv_num_free(const kv_block_manager *m);
/* CACHED blocks (ref 0, keyed). */
int32_t kv_num_cached(const kv_block_manager *m);
bool kv_prefix_caching(const kv_block_manager *m);
const kv_counters *kv_get_counters(const kv_block_manager *m);
/* Reference count of a physical block (tests, assertions). -1 if out of range. */
int32_t kv_block_ref(const kv_block_manager *m, int32_t block);

/* Blocks needed to hold n_tokens positions. */
int32_t kv_blocks_for(const kv_block_manager *m, int32_t n_tokens);

void kv_seq_init(kv_seq *s);

/* Prefix lookup at admission. TOKENS [n_tokens] is the sequence's full known
 * token list; at most floor((n_tokens - 1) / block_size) full blocks are looked
 * up, so at least the last token is always computed (its logits are needed).
 * S must be empty. Hits are appended to S's block table with their refcount
 * incremented (a CACHED hit leaves the free queue). Returns the number of
 * tokens covered (a multiple of block_size), 0 if caching is off. Counts
 * n_tokens queried and the hit tokens. */
int32_t kv_seq_match_prefix(kv_block_manager *m, kv_seq *s, const int32_t *tokens, int32_t n_tokens,
                            const char *salt, size_t salt_len);

/* Extra blocks S needs to cover n_tokens positions (0 if it already does). */
int32_t kv_seq_blocks_needed(const kv_block_manager *m, const kv_seq *s, int32_t n_tokens);

/* Grows S's block table to cover positions [0, n_tokens). All or nothing:
 * returns 0, or -1 with err (and S unchanged) when the pool lacks blocks. */
int kv_seq_ensure(kv_block_manager *m, kv_seq *s, int32_t n_tokens, specd_err *err);

/* Registers in the prefix index every full block of S covered by the first
 * n_committed tokens (whose KV are computed and final) that is not keyed yet.
 * TOKENS [>= n_committed]. If another block already has the same key (two
 * sequences computed the same prefix concurrently), S keeps its own block and
 * it stays unkeyed; the chain key is still advanced. No-op if caching is off. */
void kv_seq_commit(kv_block_manager *m, kv_seq *s, const int32_t *tokens, int32_t n_committed,
                   const char *salt, size_t salt_len);

/* Speculative rollback: S now holds n_tokens positions; whole blocks past
 * kv_blocks_for(n_tokens) are released. Keyed blocks are never truncated away
 * by the scheduler (they hold committed positions); if asked, they are
 * released like any other (refcount drop). */
void kv_seq_truncate(kv_block_manager *m, kv_seq *s, int32_t n_tokens);

/* Releases all of S's blocks (last block first, so a chain's tail is evicted
 * before its head) and frees the table; S is empty afterwards. */
void kv_seq_free(kv_block_manager *m, kv_seq *s);

/* Computes one block key: SHA-256(parent || u32le(salt_len) || salt || i32le(tokens)).
 * parent NULL = 32 zero bytes. Exposed for tests. Returns 0, -1 on OpenSSL failure. */
int kv_block_key(const uint8_t *parent, const int32_t *tokens, int32_t block_size, const char *salt,
                 size_t salt_len, uint8_t out[KV_KEY_BYTES]);

/* Consistency check for tests: every block in exactly one state, refcounts
 * equal the number of references from LIVE tables passed in, free queue
 * length equals kv_num_free. Returns 0 or -1 with err. */
int kv_check(const kv_block_manager *m, const kv_seq *const *live, size_t n_live, specd_err *err);

#endif
