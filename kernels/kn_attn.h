/*
 * kn_attn.h: the paged KV write and the ONE paged attention kernel (any query
 * length: prefill chunks, decode, verify of k+1 tokens, mixed in one batch).
 *
 * Semantics are the CPU backend's kv_write / attention (engine/backend/
 * cpu_backend.c, bk_attn_meta in backend.h), op for op:
 *  - token t of the step belongs to sequence seq_of[t] at absolute position
 *    pos[t]; its K/V row is stored at that sequence's slot pos[t], found
 *    through the block table; it attends to positions [0, pos[t]] of its own
 *    sequence (causal), query head h reading KV head h / (n_heads / n_kv_heads);
 *  - tree mask (optional, u8 [T, T]): token t may NOT see the position p of an
 *    in-step token u of its own sequence when tree_mask[t * T + u] == 0, u
 *    being the FIRST in-step token (in batch order) of that sequence at p;
 *  - a slot written by several in-step tokens (only with a tree mask: sibling
 *    drafts share a position) keeps the LAST writer's row, as the CPU's
 *    sequential memcpy does; K and V may be one plane (MLA latent: k == v
 *    pointers), which then holds the V row.
 *
 * Layout (= bk_kv_layer): each plane f32 [n_blocks, block_size, n_kv_heads,
 * head_dim]; slot s of block b at ((b * block_size) + s) * n_kv_heads *
 * head_dim. Block tables on the device: int32 [n_seqs, bt_stride] (row seq
 * holds that sequence's physical block ids, logical block j at column j).
 *
 * Algorithm (split-KV, flash-decoding style, fixed split SIZE): the KV range
 * [0, pos[t]] of a (token, head) is cut into splits of KN_ATTN_SPLIT
 * positions; pass 1 computes, per split, the split's max score m, sum of
 * exp(s - m) l and unnormalised sum of exp(s - m) v (fixed order inside the
 * split); pass 2 merges the splits of that (token, head) in split order. A
 * (token, head)'s arithmetic depends only on its own q, pos and KV: never on
 * T, the other tokens or how many splits they need (BATCH INVARIANCE).
 *
 * Bad device data (a pos < 0 or >= max_len, seq_of outside [0, n_seqs), a
 * block id outside [0, n_blocks) or a logical block >= bt_stride): kv_write
 * skips that token (writes nothing), attention writes NaN for it.
 *
 * Threading / streams: launchers are asynchronous on `stream` (a
 * cudaStream_t, NULL = legacy default stream), never allocate or
 * synchronise, and are safe to capture in a CUDA graph (all per-step data
 * lives on the device; grid sizes depend only on T, n_heads and max_len).
 */
#ifndef SPECD_KERNELS_KN_ATTN_H
#define SPECD_KERNELS_KN_ATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* KV positions per split (compile-time constant: batch invariance needs the
 * split boundaries to depend on the position only). */
#define KN_ATTN_SPLIT 256
/* Largest head_dim the attention kernel accepts (DeepSeek MLA absorbed form:
 * one KV head of 512 latent + 64 rope dims). */
#define KN_ATTN_MAX_HEAD_DIM 576

/* One layer's paged cache on the device (bk_kv_layer's shape). */
typedef struct kn_paged_kv {
    float *k;               /* f32 [n_blocks, block_size, n_kv_heads, head_dim] */
    float *v;               /* same shape; may equal k (one latent plane) */
    int32_t block_size;     /* slots per block, > 0 */
    int32_t n_kv_heads;     /* > 0 */
    int32_t head_dim;       /* > 0 (attention: <= KN_ATTN_MAX_HEAD_DIM) */
    int32_t n_blocks;       /* physical blocks in the pool */
} kn_paged_kv;

/* Per-step metadata on the device (bk_attn_meta's fields). */
typedef struct kn_attn_batch {
    int32_t n_tokens;              /* T >= 0 */
    const int32_t *pos;            /* device int32 [T]: absolute positions */
    const int32_t *seq_of;         /* device int32 [T]: row of block_tables */
    const int32_t *block_tables;   /* device int32 [n_seqs, bt_stride] physical block ids */
    int32_t bt_stride;             /* int32 elements per block-table row, > 0 */
    int32_t n_seqs;                /* rows of block_tables, > 0 */
    const uint8_t *tree_mask;      /* device u8 [T, T] or NULL */
    int32_t max_len;               /* bound on pos[t] + 1 for every t (sizes grids and scratch) */
} kn_attn_batch;

/* Writes k, v (device f32 [T, n_kv_heads, head_dim]) into the cache at each
 * token's (seq_of, pos) slot. Returns 0 or a cudaError_t value
 * (cudaErrorInvalidValue for bad shapes / NULL pointers). */
int kn_kv_write(const kn_paged_kv *kv, const kn_attn_batch *b, const float *k, const float *v, void *stream);

/* Scratch bytes kn_attention needs for T tokens, n_heads query heads, a
 * max_len bound and head_dim: T * n_heads * ceil(max_len / KN_ATTN_SPLIT) *
 * (head_dim + 2) floats (per split: the partial output row, its max and its
 * exp-sum), rounded up to 256 bytes. */
size_t kn_attn_scratch_bytes(int32_t T, int32_t n_heads, int32_t max_len, int32_t head_dim);

/* Attention over the paged cache: q device f32 [T, n_heads, head_dim] ->
 * out device f32 [T, n_heads, head_dim]; scale = softmax scale. scratch:
 * device memory of at least kn_attn_scratch_bytes(T, n_heads, b->max_len,
 * kv->head_dim) bytes (scratch_bytes says how many were given). n_heads must
 * be a multiple of kv->n_kv_heads. Returns 0 or a cudaError_t value. */
int kn_attention(const kn_paged_kv *kv, const kn_attn_batch *b, const float *q, int32_t n_heads, float scale,
                 float *out, void *scratch, size_t scratch_bytes, void *stream);

#ifdef __cplusplus
}
#endif

#endif
