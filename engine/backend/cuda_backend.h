/*
 * cuda_backend.h: the CUDA backend (engine/backend/cuda_backend.c): the bk_ops
 * of backend.h implemented with the kernels of kernels/ (kn_linear.h,
 * kn_attn.h) on one CUDA stream, over one device arena.
 *
 * Memory: ONE cudaMalloc at create (the arena, opts->arena_bytes); every
 * buf_alloc / weight_place carves from it (first fit, 256-byte aligned,
 * coalescing free list), so nothing is allocated on the device once the model
 * is loaded. Fixed device buffers for the step metadata (positions, sequence
 * index, flattened block tables, tree mask) and the attention scratch are
 * carved at create, sized from the opts' per-step bounds; a step beyond
 * them fails with the bound it broke (never a device fault).
 *
 * Works in a binary built without CUDA: bk_cuda_probe says why, and
 * bk_cuda_create fails with that reason.
 *
 * Threading: like every backend, ops are called from the engine thread only.
 */
#ifndef SPECD_BACKEND_CUDA_BACKEND_H
#define SPECD_BACKEND_CUDA_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "engine/backend/backend.h"
#include "engine/util/err.h"

/* Largest head_dim the CUDA attention kernel takes (kernels/kn_attn.h KN_ATTN_MAX_HEAD_DIM). */
#define BK_CUDA_MAX_HEAD_DIM 576
/* Largest kv_lora_rank of the MLA ops (kernels/kn_mla.h KN_MLA_MAX_KVL; the latent kv_lora_rank + rope is bounded
 * by BK_CUDA_MAX_HEAD_DIM = KN_MLA_MAX_LATENT). */
#define BK_CUDA_MLA_MAX_KVL 512
/* Most tokens one step may carry on the CUDA backend: kernels that put the step's tokens on grid.y
 * (kn_copy_rows, kn_moe's combine) take at most 65535 (CUDA's grid.y limit). */
#define BK_CUDA_MAX_STEP_TOKENS 65535

typedef struct bk_cuda_opts {
    int device;              /* CUDA device ordinal */
    size_t arena_bytes;      /* device bytes reserved at create (one cudaMalloc); > 0 */
    int32_t max_tokens;      /* tokens of one step (metadata buffers, attention scratch); > 0 */
    int32_t max_seqs;        /* sequences of one step (block-table rows); > 0 */
    int32_t max_len;         /* positions per sequence (block-table width, attention scratch); > 0 */
    int32_t block_size;      /* KV slots per block, as the model's KV pool (block-table entries per row) */
    int32_t max_heads;       /* query heads of an attention call (scratch) */
    int32_t max_head_dim;    /* head_dim of an attention call (scratch); <= KN_ATTN_MAX_HEAD_DIM */
    size_t staging_bytes;    /* pinned host staging for weight uploads; 0 = 64 MiB */
    int32_t sample_vocab;    /* vocabulary of the logits bk_ops.sample sees: its scratch and staging are
                                carved at create (and counted by bk_cuda_fixed_bytes); 0 = carved by the
                                first step that samples (then an arena the KV filled can refuse it) */
    int32_t draw_vocab;      /* the largest logits width of bk_ops.draw calls (a device EAGLE-3 head's draft
                                vocabulary): its scratch (kn_sample_draw_scratch_bytes of 32 rows) is carved at
                                create and counted by bk_cuda_fixed_bytes; 0 = carved by the first draw (an arena
                                the KV filled then refuses it, naming the arena) */
    int32_t mla_kv_lora_rank; /* DeepSeek-V3 MLA: kv_lora_rank of mla_attention calls (its scratch, with
                                 max_tokens / max_heads / max_len); 0 = no MLA */
    /* DeepSeek-V3 MoE: the largest routed-expert count, top-k, hidden size and expert width (this rank's
     * slice) of moe calls. The routing ids / weights ([max_tokens * k]) and kn_moe_experts' workspace for
     * max_tokens tokens are carved at create from these (and counted by bk_cuda_fixed_bytes); a moe call
     * beyond them fails naming the bound. All 0 = no MoE (moe calls are refused). */
    int32_t moe_experts, moe_top_k, moe_hidden, moe_inter;
} bk_cuda_opts;

/* Device memory the backend carves for itself out of the arena for opts
 * (metadata buffers, attention scratch, flags): what a caller sizing the
 * arena must add to weights + KV + model workspace. */
size_t bk_cuda_fixed_bytes(const bk_cuda_opts *o);

/* 0 if device `dev` is usable (kernels/kn.h kn_probe: driver, device, a probe
 * kernel), else non-zero with the reason in why. */
int bk_cuda_probe(int dev, char *why, size_t why_len);

/* Free and total memory of device dev in bytes (cudaMemGetInfo after the
 * context exists, so free already excludes it). -1 with the reason on error. */
int bk_cuda_mem_info(int dev, size_t *free_bytes, size_t *total_bytes, specd_err *err);

/* Creates the backend (probe, stream, arena, pinned staging, fixed buffers).
 * NULL with the reason in err. */
backend *bk_cuda_create(const bk_cuda_opts *o, specd_err *err);
void bk_cuda_destroy(backend *b); /* NULL ok */

/* "cuda (NVIDIA H200, sm_90, arena 120.0 GiB: 15.2 GiB used)" for logs. */
const char *bk_cuda_describe(const backend *b);

/* Bytes of the arena in use (allocations + weights + the backend's fixed buffers). */
size_t bk_cuda_arena_used(const backend *b);

/* Tensor parallelism (engine/runtime/tp.h): the CUDA devices this process
 * sees (0 when none or built without CUDA; CUDA_VISIBLE_DEVICES applies), and
 * a backend's device ordinal and stream (a cudaStream_t), so device
 * collectives run in order with its ops. */
int bk_cuda_device_count(void);
int bk_cuda_device(const backend *b);
void *bk_cuda_stream(const backend *b);

#endif
