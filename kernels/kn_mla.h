/*
 * kn_mla.h: DeepSeek-V3 / Kimi-K2.5 MLA attention in the absorbed form on the
 * paged bf16 latent cache (decode, verify of k+1 tokens, prefill chunks, any
 * mix in one batch), and the latent cache write.
 *
 * What it computes (= engine/model/deepseek_v3_fwd.c mla_absorbed, whose
 * attention op runs on the latent plane used as K and as V): per layer the
 * cache holds, per token, the latent row [c_kv (kvl) | k_pe (r)] in bf16.
 * Token t of the step, query head h, q_h = [q_lat_h (kvl) | q_pe_h (r)] f32
 * (q_lat_h = W_UK_h^T q_nope_h, q_pe_h rotated), over the positions p in
 * [0, pos[t]] of its sequence that the tree mask does not hide:
 *     s_p   = scale * (q_h . latent_p)            (all kvl + r dims)
 *     out_h = sum_p softmax(s)_p c_kv_p           (the first kvl dims only)
 * The k_pe half of the output (which the CPU's attention op computes and the
 * model drops) is not produced. Masks, positions, block tables, the "first
 * in-step token decides" tree rule and the bad-metadata rules are kn_attn.h's
 * (kn_attn_batch, the same fields as bk_attn_meta); bad metadata gives NaN
 * rows (attention) or writes nothing (latent write).
 *
 * Layout (= bk_kv_layer with k16 == v16, n_kv_heads 1, head_dim kvl + r):
 * bf16 [n_blocks, block_size, kvl + r]; slot s of block b starts at element
 * (b * block_size + s) * (kvl + r). Kimi-K2.5: kvl 512, r 64: 1,152 bytes per
 * token per layer, 70,272 bytes per token for 61 layers.
 *
 * Work split (FlashMLA's data flow; CUDA-core f32 arithmetic in
 * kn_mla_attention, tensor cores in kn_mla_attention_mma): one CTA per (token,
 * group of KN_MLA_HEADS_PER_CTA query heads, split of KN_MLA_SPLIT
 * positions). The CTA reads each latent row of its split from memory ONCE
 * for all the heads of its group (Kimi at TP 8: the rank's 8 heads = one
 * group), computes the 8 x 64 scores, the split's softmax statistics and the
 * 8 x kvl partial output; a second kernel merges the splits of a (token,
 * head) in split order. The split SIZE is fixed (not the number of splits),
 * so a row's reduction order depends only on its own position: BATCH
 * INVARIANCE (kn.h), and a token decoded alone gives the same bits as the
 * same token at the same position inside a verify pass or a prefill chunk.
 * f32 accumulation throughout; bf16 values widened exactly.
 *
 * Threading / streams: launchers are asynchronous on `stream`, never
 * allocate or synchronise, and are safe to capture in a CUDA graph (grids
 * depend only on T, n_heads and max_len; everything per step is on the
 * device).
 */
#ifndef SPECD_KERNELS_KN_MLA_H
#define SPECD_KERNELS_KN_MLA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/kn_attn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Positions per split (compile-time: batch invariance needs split boundaries
 * that depend on the position only). 64 = FlashMLA's page block. */
#define KN_MLA_SPLIT 64
/* Query heads sharing one read of the latent (a CTA's head group). */
#define KN_MLA_HEADS_PER_CTA 8
/* Largest kv_lora_rank + rope_dim (DeepSeek-V3 / Kimi: 512 + 64). */
#define KN_MLA_MAX_LATENT 576
/* Largest kv_lora_rank (the output width per head). */
#define KN_MLA_MAX_KVL 512

/* One layer's paged latent cache on the device. */
typedef struct kn_mla_cache {
    uint16_t *lat;          /* bf16 [n_blocks, block_size, kv_lora_rank + rope_dim], 4-byte aligned */
    int32_t block_size;     /* slots per block, > 0 */
    int32_t kv_lora_rank;   /* kvl: even, 2..KN_MLA_MAX_KVL */
    int32_t rope_dim;       /* r: even, >= 0; kvl + r <= KN_MLA_MAX_LATENT */
    int32_t n_blocks;       /* physical blocks in the pool, > 0 */
} kn_mla_cache;

/* Writes the step's latent rows lat (device f32 [T, kvl + r] = [c_kv | k_pe])
 * into the cache at each token's (seq_of, pos) slot, each value rounded to
 * bf16 to nearest even (bk_f32_to_bf16's bits, NaN kept quiet). A slot written
 * by several in-step tokens keeps the last one's row (the CPU's order).
 * Returns 0 or a cudaError_t value (cudaErrorInvalidValue for bad shapes). */
int kn_mla_latent_write(const kn_mla_cache *c, const kn_attn_batch *b, const float *lat, void *stream);

/* Scratch bytes kn_mla_attention needs: T * n_heads * ceil(max_len /
 * KN_MLA_SPLIT) * (kvl + 2) floats (per split: the partial output row, its
 * max and its exp-sum), rounded up to 256 bytes; 0 for a non-positive
 * argument. */
size_t kn_mla_scratch_bytes(int32_t T, int32_t n_heads, int32_t max_len, int32_t kv_lora_rank);

/* Absorbed MLA attention: q device f32 [T, n_heads, kvl + r] -> out device f32
 * [T, n_heads, kvl]; scale = the model's softmax scale (Kimi: 0.144680).
 * scratch: device memory of at least kn_mla_scratch_bytes(T, n_heads,
 * b->max_len, kvl) bytes (scratch_bytes says how many were given). Returns 0
 * or a cudaError_t value. */
int kn_mla_attention(const kn_mla_cache *c, const kn_attn_batch *b, const float *q, int32_t n_heads, float scale,
                     float *out, void *scratch, size_t scratch_bytes, void *stream);

/* The same on tensor cores (mma.sync m16n8k16 bf16 -> f32, q and the softmax weights split into bf16 hi +
 * lo): same contract, scratch and split, batch invariant on its own (its bits differ from kn_mla_attention's
 * in the last places). Which of the two the model uses is decided by kn_mla_bench on a GPU. */
int kn_mla_attention_mma(const kn_mla_cache *c, const kn_attn_batch *b, const float *q, int32_t n_heads,
                         float scale, float *out, void *scratch, size_t scratch_bytes, void *stream);

#ifdef __cplusplus
}
#endif

#endif
