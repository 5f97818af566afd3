/*
 * backend.h: the op interface model code is written against.
 *
 * A backend is an ops table plus a context (ggml-backend style). Model code
 * (engine/model/) calls only these ops; the CPU backend (cpu_*.c) is the
 * reference every other backend is tested against, op by op.
 *
 * Tensors here are plain pointers + explicit shapes: activations are f32,
 * row-major, [T, dim] where T is the number of tokens in the step's batch.
 * Weights are `bk_weight` views of a matrix [rows=out_features, cols=in_features]
 * in one of the storage formats below (a row is one output feature).
 *
 * BATCH INVARIANCE (the property the lossless speculative test relies on):
 * every op computes each output element with a reduction order that depends
 * only on that element's own inputs: never on T, on the token's index in the
 * batch, on the number of threads, or on which thread ran it. Threads split
 * work over output rows/tokens/heads, never inside one reduction.
 *
 * Threading: ops are called from the engine thread only; the CPU backend
 * parallelises internally with its own thread pool (engine/backend/threadpool.c).
 */
#ifndef SPECD_BACKEND_BACKEND_H
#define SPECD_BACKEND_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/util/err.h"

/* Weight storage formats. Blocks follow ggml (Q*) or compressed-tensors (I4G32). */
typedef enum {
    BK_W_F32,   /* float [rows, cols] */
    BK_W_BF16,  /* uint16 bf16 [rows, cols] */
    BK_W_F16,   /* uint16 IEEE half [rows, cols] */
    BK_W_Q8_0,  /* ggml Q8_0 blocks of 32: fp16 d, int8 q[32]; 34 bytes */
    BK_W_Q4_0,  /* ggml Q4_0 blocks of 32: fp16 d, 16 nibble bytes; v = d*(q-8) */
    BK_W_Q4_1,  /* ggml Q4_1 blocks of 32: fp16 d, fp16 m, 16 nibble bytes; v = d*q + m */
    BK_W_I4G32, /* compressed-tensors pack-quantized int4 symmetric, group 32:
                   packed int32 [rows, cols/8], scales bf16 [rows, cols/32] */
} bk_wtype;

typedef struct bk_weight {
    bk_wtype type;
    int64_t rows;       /* output features */
    int64_t cols;       /* input features (multiple of 32 for block formats) */
    const void *data;   /* rows * row_bytes bytes; not owned */
    size_t row_bytes;   /* bytes per row of data */
    const void *scales; /* I4G32 only: bf16 [rows, cols/32]; not owned */
} bk_weight;

/* Paged KV cache view for one attention layer (flashinfer-style layout):
 * k, v: f32 [n_blocks, block_size, n_kv_heads, head_dim]. Slot s of block b
 * is at ((b * block_size) + s) * n_kv_heads * head_dim. */
typedef struct bk_kv_layer {
    float *k;
    float *v;
    int32_t block_size;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t n_blocks;
} bk_kv_layer;

/* Per-step attention metadata (explicit struct, no globals).
 * Token i of the step belongs to sequence seq_of[i] at absolute position
 * pos[i]; it attends to KV positions [0, pos[i]] of its own sequence
 * (causal), read through that sequence's block table. If tree_mask is not
 * NULL, token i additionally may NOT attend to in-step positions j whose
 * tree_mask[i * T + j] is 0 (draft trees; chain drafting passes NULL). */
typedef struct bk_attn_meta {
    int32_t n_tokens;                    /* T */
    const int32_t *pos;                  /* [T] */
    const int32_t *seq_of;               /* [T] index into block_tables */
    const int32_t *const *block_tables;  /* [n_seqs][ceil(len/block_size)] physical block ids */
    int32_t n_seqs;
    const uint8_t *tree_mask;            /* [T, T] or NULL */
} bk_attn_meta;

typedef struct bk_ops {
    /* y[T, w->rows] = x[T, w->cols] @ W^T. */
    int (*matmul)(void *ctx, const bk_weight *w, const float *x, int32_t T, float *y);
    /* out[T, dim] = x * rsqrt(mean(x^2) + eps) * g  (RMSNorm, Zhang & Sennrich 2019).
     * out may alias x. */
    void (*rmsnorm)(void *ctx, const float *x, const float *g, int32_t T, int32_t dim, float eps, float *out);
    /* Rotary embedding in place on x[T, n_heads, head_dim], rotating the first
     * rot_dim dims. neox=true: pairs (i, i + rot_dim/2) (rotate_half, HF);
     * neox=false: adjacent pairs (2i, 2i+1) (GPT-J / ggml "normal").
     * inv_freq[rot_dim/2]: per-pair angular frequency (caller computes plain
     * theta^(-2i/d) or YaRN); mscale multiplies cos and sin (YaRN attention factor, 1 otherwise). */
    void (*rope)(void *ctx, float *x, int32_t T, int32_t n_heads, int32_t head_dim, int32_t rot_dim,
                 const int32_t *pos, const float *inv_freq, float mscale, bool neox);
    /* Writes k/v [T, n_kv_heads, head_dim] of this step into the paged cache
     * at each token's (seq, pos) slot. */
    void (*kv_write)(void *ctx, const bk_kv_layer *kv, const bk_attn_meta *m, const float *k, const float *v);
    /* Attention over the paged cache: q [T, n_heads, head_dim] -> out [T, n_heads, head_dim].
     * GQA: head h uses kv head h / (n_heads / n_kv_heads). scale = softmax scale.
     * Exact softmax in f32 with a max-subtracted, fixed-order reduction (sums
     * in double); the PV numerator in double (portable) or f32 lanes (AVX2). */
    void (*attention)(void *ctx, const bk_kv_layer *kv, const bk_attn_meta *m, const float *q,
                      int32_t n_heads, float scale, float *out);
    /* out[T, n] = silu(gate) * up, gate/up [T, n]. out may alias gate. */
    void (*silu_mul)(void *ctx, const float *gate, const float *up, int64_t n_total, float *out);
    /* y += x, n elements. */
    void (*add)(void *ctx, float *y, const float *x, int64_t n);
    /* out[T, w->cols] = rows tokens[i] of W dequantized (embedding lookup). */
    int (*embed)(void *ctx, const bk_weight *w, const int32_t *tokens, int32_t T, float *out);
} bk_ops;

typedef struct backend {
    const char *name;   /* "cpu", "cuda" */
    const bk_ops *ops;
    void *ctx;
} backend;

/* CPU backend. n_threads <= 0: OMP_NUM_THREADS if set, else one per online
 * core. The kernel level is chosen at run time from CPUID/XGETBV: AVX-512
 * (F/BW/VL/DQ), else AVX2/FMA/F16C, else portable C; SPECD_CPU_ISA=
 * portable|avx2|avx512 caps it (SPECD_CPU_PORTABLE=1 = portable). Results are
 * batch-invariant on one machine; AVX-512 and AVX2 give bit-identical
 * results, the portable path does not (f32 instead of int16 activations).
 * Returns NULL on allocation failure. */
backend *bk_cpu_create(int n_threads);
void bk_cpu_destroy(backend *b);
/* Human-readable description of the chosen kernel paths (for logs). */
const char *bk_cpu_describe(const backend *b);

/* Reference (scalar) dequantization of one weight row to f32, any bk_wtype. */
void bk_weight_row_f32(const bk_weight *w, int64_t row, float *out);

#endif
