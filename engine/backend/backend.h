/*
 * backend.h: the op interface model code is written against.
 *
 * A backend is an ops table plus a context (ggml-backend style). Model code
 * (engine/model/) calls only these ops; the CPU backend (cpu_*.c) is the
 * reference every other backend is tested against, op by op.
 *
 * Ops take tensor handles (bk_tensor: backend memory + dtype + shape), never
 * host float pointers, so the same model code runs on host memory (CPU
 * backend, zero copies) and device memory (CUDA backend): activations are
 * f32, row-major, [T, dim] where T is the number of tokens in the step's
 * batch. Weights are `bk_weight` views of a matrix [rows=out_features,
 * cols=in_features] in one of the storage formats below (a row is one output
 * feature), placed in backend memory once at load (ops->weight_place).
 * Per step the host uploads only the metadata (ids, positions, block
 * tables: ops->meta_upload / upload) and downloads only what it needs.
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

/* Bytes of n consecutive values of one row of a weight of type t, starting
 * on a value whose index is a multiple of 32 for the block formats; 0 when n
 * cuts a 32-value block (Q8_0 / Q4_x / I4G32 need n % 32 == 0). I4G32: the
 * packed words only (its bf16 group scales are separate). Used to slice rows
 * by columns (tensor parallelism). */
static inline size_t bk_row_span(bk_wtype t, int64_t n) {
    switch (t) {
    case BK_W_F32: return 4 * (size_t)n;
    case BK_W_BF16:
    case BK_W_F16: return 2 * (size_t)n;
    case BK_W_Q8_0: return n % 32 ? 0 : (size_t)(n / 32) * 34;
    case BK_W_Q4_0: return n % 32 ? 0 : (size_t)(n / 32) * 18;
    case BK_W_Q4_1: return n % 32 ? 0 : (size_t)(n / 32) * 20;
    case BK_W_I4G32: return n % 32 ? 0 : (size_t)n / 2;
    }
    return 0;
}

typedef struct bk_weight {
    bk_wtype type;
    int64_t rows;       /* output features */
    int64_t cols;       /* input features (multiple of 32 for block formats) */
    const void *data;   /* rows * row_bytes bytes; not owned */
    size_t row_bytes;   /* bytes per row of data */
    const void *scales; /* I4G32 only: bf16 [rows, cols/32]; not owned */
} bk_weight;

/* Activation / metadata dtypes of bk_tensor. */
typedef enum {
    BK_F32, /* float */
    BK_I32, /* int32_t (token ids, positions, row indices) */
} bk_dtype;

/* A 2-D tensor in the backend's memory: [rows, cols] row-major, contiguous.
 * data is host memory on the CPU backend and device memory on the CUDA one;
 * model code never dereferences it (except on host-visible backends, through
 * bk_f32 / bk_i32, for the parts that have no device op yet). Not owned: the
 * memory comes from the backend (buf_alloc) or, on host-visible backends,
 * from a caller's buffer wrapped with bk_wrap_f32 (zero copy). */
typedef struct bk_tensor {
    void *data;
    bk_dtype dtype;
    int64_t rows, cols;
} bk_tensor;

static inline size_t bk_dtype_size(bk_dtype t) { (void)t; return 4; }
static inline bk_tensor bk_wrap_f32(float *p, int64_t rows, int64_t cols) {
    bk_tensor t = {p, BK_F32, rows, cols};
    return t;
}
static inline bk_tensor bk_wrap_i32(const int32_t *p, int64_t rows, int64_t cols) {
    bk_tensor t = {(void *)(uintptr_t)p, BK_I32, rows, cols};
    return t;
}
/* Rows [r0, r0 + n) of t (a view sharing t's memory). */
static inline bk_tensor bk_rows(bk_tensor t, int64_t r0, int64_t n) {
    bk_tensor v = {(char *)t.data + (size_t)r0 * (size_t)t.cols * bk_dtype_size(t.dtype), t.dtype, n, t.cols};
    return v;
}
/* The same memory seen as [rows, cols] (rows * cols must not exceed t's). */
static inline bk_tensor bk_reshape(bk_tensor t, int64_t rows, int64_t cols) {
    bk_tensor v = {t.data, t.dtype, rows, cols};
    return v;
}
static inline size_t bk_nbytes(const bk_tensor *t) { return (size_t)t->rows * (size_t)t->cols * bk_dtype_size(t->dtype); }
/* Bump allocation of f32 [rows, cols] tensors out of a workspace region of
 * backend memory (a pass sums its sizes plus BK_TAKE_SLACK per take,
 * allocates once, carves in order). Every tensor starts on a 64-byte
 * boundary (vector loads on the GPU need 16). */
#define BK_TAKE_SLACK 16 /* floats of padding a take may add */
typedef struct bk_cursor { float *p; } bk_cursor;
static inline bk_tensor bk_take(bk_cursor *c, int64_t rows, int64_t cols) {
    c->p = (float *)(((uintptr_t)c->p + 63) & ~(uintptr_t)63);
    bk_tensor t = bk_wrap_f32(c->p, rows, cols);
    c->p += (size_t)rows * (size_t)cols;
    return t;
}
/* Host pointers of a host-visible backend's tensor (backend.host_visible). */
static inline float *bk_f32(const bk_tensor *t) { return (float *)t->data; }
static inline int32_t *bk_i32(const bk_tensor *t) { return (int32_t *)t->data; }

/* Paged KV cache view for one attention layer (flashinfer-style layout):
 * k, v: [n_blocks, block_size, n_kv_heads, head_dim] in backend memory, f32
 * (k, v) or bf16 (k16, v16; the other pair NULL). Slot s of block b is at
 * ((b * block_size) + s) * n_kv_heads * head_dim. k == v for a single plane
 * used as both (DeepSeek-V3's MLA latent). bf16: kv_write rounds each f32 to
 * nearest even (NaN kept a NaN), readers widen exactly. */
typedef struct bk_kv_layer {
    float *k;
    float *v;
    int32_t block_size;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t n_blocks;
    uint16_t *k16;
    uint16_t *v16;
} bk_kv_layer;

/* bf16 of an f32, round to nearest even (the conversion torch and the CUDA
 * intrinsics use); NaN stays a quiet NaN. */
static inline uint16_t bk_f32_to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float bk_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

/* Per-step attention metadata (explicit struct, no globals).
 * Token i of the step belongs to sequence seq_of[i] at absolute position
 * pos[i]; it attends to KV positions [0, pos[i]] of its own sequence
 * (causal), read through that sequence's block table. If tree_mask is not
 * NULL, token i additionally may NOT attend to in-step positions j whose
 * tree_mask[i * T + j] is 0 (draft trees; chain drafting passes NULL).
 * The host arrays are what the scheduler built; `dev` is the backend's copy
 * of them, made once per step by ops->meta_upload (NULL on host-visible
 * backends, which read the host arrays: zero copies), released by
 * ops->meta_release. Every op taking the meta reads whichever it needs. */
typedef struct bk_attn_meta {
    int32_t n_tokens;                    /* T */
    const int32_t *pos;                  /* [T] */
    const int32_t *seq_of;               /* [T] index into block_tables */
    const int32_t *const *block_tables;  /* [n_seqs][ceil(len/block_size)] physical block ids */
    int32_t n_seqs;
    const uint8_t *tree_mask;            /* [T, T] or NULL */
    void *dev;                           /* backend-private device copy, or NULL */
} bk_attn_meta;

/* One row of device sampling: the processing of engine/runtime/sampler.h
 * (steps 1-8) with the request's parameters and history, as host arrays
 * (the backend stages them). The draw uses u, a uniform the host drew from
 * the request's own RNG stream (sampler_rng_uniform), so a seed gives the
 * same tokens on every backend; greedy rows (temperature < 1e-5) ignore it. */
typedef struct bk_sample_row {
    float temperature, top_p, min_p;
    float presence_penalty, frequency_penalty, repetition_penalty;
    int32_t top_k;
    int32_t forced;                   /* >= 0: sampler.h step 3c (test-only forced id); -1 none */
    const int32_t *hist;              /* [n_prompt + n_output]: prompt ids, then output ids (penalties) */
    int32_t n_prompt, n_output;
    const int32_t *suppress;          /* [n_suppress] ids forced to -inf (min_tokens) */
    int32_t n_suppress;
    const int32_t *bias_ids;          /* [n_bias] OpenAI logit_bias */
    const float *bias;
    int32_t n_bias;
    double u;                         /* [0, 1) */
} bk_sample_row;

/* One row's parameters of bk_ops.draw, in BACKEND memory (16 bytes; the
 * CUDA backend hands the array to kernels/kn_sample.h kn_sample_draw as
 * kn_draw_params, same layout). */
typedef struct bk_draw_param {
    float temperature;                /* < 1e-5 (SAMPLER_GREEDY_EPS): greedy, argmax and a one-hot q */
    int32_t pos;                      /* Philox counter: the drawn token's absolute position */
    uint64_t seed;                    /* Philox key: the sequence's draft seed */
} bk_draw_param;

/* A speculative chain to verify in bk_ops.sample: rows row0 .. row0 + n_draft
 * of the logits are the target at x_m and after each draft; row j's
 * bk_sample_row carries that row's history (drafts 1..j appended). Greedy:
 * accept draft j iff it is row j's argmax; sampling: sampler_accept's rule
 * with u[j] (test) and u[j + 1] (replacement), the bonus with u[n_draft] (the
 * uniforms the host would draw, in order), against the draft's q: one-hot at
 * the draft when q is NULL (or q[j] is NULL), else the row q[j] in BACKEND
 * memory (the draft's distribution as its draw left it, never downloaded):
 * q_vocab f32 over the DRAFT vocabulary, read through t2d (q(x) =
 * q[j][t2d[x]], 0 where t2d[x] < 0: exactly the host's q scattered to target
 * ids, so the residual max(0, p - q) subtracts only the draft vocabulary's
 * entries). */
typedef struct bk_verify_seq {
    int32_t row0, n_draft;            /* n_draft in [0, 15] */
    const int32_t *draft;             /* [n_draft] target ids */
    bool greedy;
    const double *u;                  /* [n_draft + 2], unused when greedy */
    const float *const *q;            /* host [n_draft] of backend pointers to rows of q_vocab f32, or NULL */
    int32_t q_vocab;                  /* columns of a q row */
    const int32_t *t2d;               /* backend I32 [vocab]: target id -> q column, -1 outside the draft
                                       * vocabulary; NULL: the rows are over the target vocabulary */
} bk_verify_seq;
/* DeepSeek-V3 MoE (issue 19; the moe_* ops). One layer's routed experts as
 * moe_place left them in backend memory, in the backend's own layout (CUDA:
 * kernels/kn_moe.h KN_I4IL w13 [E][2I][H/8] u32, s13 [E][2I][H/32] bf16, w2
 * [E][H][I/8], s2 [E][H][I/32]); the caller frees the four with buf_free. */
typedef struct bk_moe_experts {
    int32_t E, H, I;
    void *w13, *s13, *w2, *s2;
    int32_t e0;   /* expert parallelism: local expert j is routed expert e0 + j of bk_moe_cfg.E (0: all of them);
                     set by the caller after moe_place */
} bk_moe_experts;
/* noaux_tc routing configuration (hf_config's fields of the same names). */
typedef struct bk_moe_cfg {
    int32_t E, k, n_group, topk_group;
    bool norm_topk_prob;
    float routed_scaling;
} bk_moe_cfg;

/* The ops. Activations are bk_tensor f32 [T, dim] (T = tokens of the call,
 * x->rows); unless stated otherwise an output must not alias an input.
 * Ops returning int return 0, or -1 on failure (allocation, a device error,
 * an out-of-range id), logged by the backend with the reason. */
typedef struct bk_ops {
    /* y[T, w->rows] = x[T, w->cols] @ W^T. */
    int (*matmul)(void *ctx, const bk_weight *w, const bk_tensor *x, bk_tensor *y);
    /* Optional (NULL: call matmul n times; bk_matmul_n does). y[k][T, w[k]->rows] = x @ W_k^T for
     * k < n, 1 <= n <= 4, all w[k] with x's cols: the same bits as n matmul calls, in one pass (the
     * CPU: one activation quantization and one pool job for q/k/v or gate/up). */
    int (*matmul_n)(void *ctx, int n, const bk_weight *const *w, const bk_tensor *x, bk_tensor *const *y);
    /* out[T, dim] = x * rsqrt(mean(x^2) + eps) * g, g f32 [1, dim]
     * (RMSNorm, Zhang & Sennrich 2019). out may alias x. */
    int (*rmsnorm)(void *ctx, const bk_tensor *x, const bk_tensor *g, float eps, bk_tensor *out);
    /* Fused residual add + RMSNorm: x += r, then out = rmsnorm(x) as above
     * (exactly the two ops in sequence, same bits; one pass on a GPU). out may
     * alias r (the usual call: h = norm(x += h)), not x. */
    int (*add_rmsnorm)(void *ctx, bk_tensor *x, const bk_tensor *r, const bk_tensor *g, float eps, bk_tensor *out);
    /* Rotary embedding in place on x[T, n_heads * head_dim], rotating the
     * first rot_dim dims of each head. neox=true: pairs (i, i + rot_dim/2)
     * (rotate_half, HF); neox=false: adjacent pairs (2i, 2i+1) (GPT-J / ggml
     * "normal"). Positions from m (m->n_tokens == T). inv_freq f32 [1,
     * rot_dim/2]: per-pair angular frequency (caller computes plain
     * theta^(-2i/d) or YaRN); mscale multiplies cos and sin (YaRN attention
     * factor, 1 otherwise). */
    int (*rope)(void *ctx, bk_tensor *x, int32_t n_heads, int32_t head_dim, int32_t rot_dim,
                const bk_attn_meta *m, const bk_tensor *inv_freq, float mscale, bool neox);
    /* Writes k/v [T, n_kv_heads * head_dim] of this step into the paged cache
     * at each token's (seq, pos) slot. */
    int (*kv_write)(void *ctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *k, const bk_tensor *v);
    /* Attention over the paged cache: q [T, n_heads * head_dim] -> out [T,
     * n_heads * head_dim]. GQA: head h uses kv head h / (n_heads / n_kv_heads).
     * scale = softmax scale. Exact softmax in f32 with a max-subtracted,
     * fixed-order reduction (sums in double on the CPU); the PV numerator in
     * double (portable) or f32 lanes (AVX2). */
    int (*attention)(void *ctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *q, int32_t n_heads,
                     float scale, bk_tensor *out);
    /* out = silu(gate) * up elementwise (same shapes). out may alias gate. */
    int (*silu_mul)(void *ctx, const bk_tensor *gate, const bk_tensor *up, bk_tensor *out);
    /* y += x elementwise (same shapes). */
    int (*add)(void *ctx, bk_tensor *y, const bk_tensor *x);
    /* y[t, :] += b[0, :] for every row t (a bias [1, y->cols]). */
    int (*add_bias)(void *ctx, bk_tensor *y, const bk_tensor *b);
    /* out[T, w->cols] = rows ids[t] of W dequantized (embedding lookup);
     * ids I32 [T, 1]; an id outside [0, w->rows) fails the op. ids_host: the
     * same ids on the host (for the check; may be NULL on device backends
     * that check on the device). */
    int (*embed)(void *ctx, const bk_weight *w, const bk_tensor *ids, const int32_t *ids_host, bk_tensor *out);
    /* dst[t, col0 .. col0 + src->cols) = src[t, :] for every row t
     * (concatenation along columns, EAGLE-3's aux capture and input). */
    int (*copy_cols)(void *ctx, bk_tensor *dst, int64_t col0, const bk_tensor *src);
    /* dst[i, :] = src[idx[i], :], idx I32 [n, 1] (selecting output rows). A
     * bit-exact copy of 4-byte elements, so src / dst may be I32 tensors too
     * (the draft loop compacts its device token ids with it). */
    int (*gather_rows)(void *ctx, const bk_tensor *src, const bk_tensor *idx, bk_tensor *dst);
    /* out[t] = the argmax of row t of logits F32 [T, V] (sampler_argmax's rule:
     * the largest value, ties -> the lowest id, NaN loses to every number, a
     * row of only NaN gives 0), mapped through d2t when it is not NULL:
     * out[t] = id + d2t[id], d2t I32 [V, 1] of offsets (EAGLE-3's draft ->
     * target map, validated at load). out I32 [T, 1]. The greedy draft pick
     * of the chain loop, on the device (no logits download). */
    int (*argmax)(void *ctx, const bk_tensor *logits, const bk_tensor *d2t, bk_tensor *out);
    /* Optional (NULL: the caller draws on the host). A draw per row of logits F32 [T, V] with
     * temperature only, no host transfer (graph-capturable on the CUDA backend): row t with
     * params[t] (bk_draw_param [T] in backend memory, uploaded by the caller): greedy rows
     * (temperature < 1e-5) take argmax's id with a one-hot q; the others q = softmax(logits /
     * temperature) with sampler_probs' f32 element arithmetic (row * (1 / T), expf of the
     * max-subtracted row, a double sum, times (float)(1 / sum)) and the id of sampler_draw(q, V, u)
     * (inverse CDF in id order), u = kn_philox_uniform(seed, pos, 0) (kernels/kn_philox.h). out I32
     * [T, 1] = id + d2t[id] when d2t (I32 [V, 1]) is not NULL; q F32 [T, V] (over V, the draft
     * vocabulary) or NULL; q may be logits itself (written in place). The CUDA kernel's sums run in another order: q may differ in its last
     * bits, a draw only when u is within ~1e-15 of a boundary (kernels/kn_sample.h). */
    int (*draw)(void *ctx, const bk_tensor *logits, const bk_draw_param *params, const bk_tensor *d2t, bk_tensor *out,
                bk_tensor *q);

    /* --- memory and transfers (all backends; trivial on host-visible ones) */
    /* bytes of backend memory (16-byte aligned at least, zeroed), or NULL. Called at
     * start-up (weights, KV pool, workspace), never per step. */
    void *(*buf_alloc)(void *ctx, size_t bytes);
    void (*buf_free)(void *ctx, void *p); /* NULL ok */
    /* Copies between host and backend memory (bytes). upload may be queued;
     * from ordinary (pageable) host memory the source may be reused as soon
     * as it returns (the CUDA backend: cudart stages pageable memory before
     * cudaMemcpyAsync returns; the draft's staging relies on it). download
     * waits. */
    int (*upload)(void *ctx, void *dst, const void *src_host, size_t bytes);
    int (*download)(void *ctx, void *dst_host, const void *src, size_t bytes);
    /* Makes *dst a backend-resident copy of the host weight *src (same type
     * and shape; data/scales in backend memory owned by the backend until
     * destroy). Host-visible backends copy the struct only (zero copies). */
    int (*weight_place)(void *ctx, const bk_weight *src, bk_weight *dst);
    /* Per-step metadata copy (see bk_attn_meta.dev); no-ops on host-visible backends. */
    int (*meta_upload)(void *ctx, bk_attn_meta *m);
    void (*meta_release)(void *ctx, bk_attn_meta *m);

    /* --- sampling on the backend (optional: NULL on host-visible backends,
     * where the engine samples the logits in place with the host sampler,
     * zero copies). logits f32 [n_rows, vocab] in backend memory, CONSUMED:
     * the rows may be overwritten (processed distributions). Rows that are
     * not in a verify chain get a token in ids[r] (ids host [n_rows]; chain
     * rows' entries are left unspecified). Chains: n_accepted[c] (host
     * [n_verify]) and out_tokens[c * 16 + 0 .. n_accepted[c]] (host
     * [n_verify, 16]: accepted drafts then the correction / bonus). The only
     * device -> host traffic is those ids and counts (4 bytes each); what the
     * host stages is the rows' parameters, histories, lists and uniforms. */
    int (*sample)(void *ctx, const bk_tensor *logits, const bk_sample_row *rows, int32_t n_rows,
                  const bk_verify_seq *verify, int32_t n_verify, int32_t *ids, int32_t *n_accepted,
                  int32_t *out_tokens);
    /* --- DeepSeek-V3 / Kimi-K2.5 absorbed MLA on the latent plane (issue 19). kv: ONE plane used as K
     * and as V (k == v, or k16 == v16 on a bf16 plane), n_kv_heads 1, head_dim D = kv_lora_rank + rope
     * dims (the latent [c_kv | k_pe]). NULL on a backend without them (the model then calls kv_write /
     * attention, the same bits on the CPU). */
    /* Writes the step's latent rows lat F32 [T, D] at each token's (seq, pos) slot: exactly
     * kv_write(kv, m, lat, lat) (bf16 planes: round to nearest even). */
    int (*mla_latent_write)(void *ctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *lat,
                            int32_t kv_lora_rank);
    /* q F32 [T, n_heads * D] (per head [q_lat | q_pe]) -> out F32 [T, n_heads * kv_lora_rank]: per head
     * the first kv_lora_rank values of attention(kv, m, q, n_heads, scale) over the plane (the c_kv part
     * of sum_p softmax_p latent_p; the k_pe part is not produced). CPU: that attention op, then the
     * columns (same bits); CUDA: kn_mla_attention (kernels/kn_mla.h), bf16 planes only. */
    int (*mla_attention)(void *ctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *q,
                         int32_t n_heads, int32_t kv_lora_rank, float scale, bk_tensor *out);

    /* --- DeepSeek-V3 MoE block (issue 19). NULL on the CPU backend: the model's own MoE code
     * (deepseek_v3_fwd.c moe_forward over matmul on BK_W_I4G32) IS the CPU path and the reference. */
    /* Places E routed experts (gate[e], up[e] [I, H], down[e] [H, I], BK_W_I4G32 host views with
     * row_bytes == cols / 2) into *out in the backend's layout (CUDA: repacked with kn_moe_pack_expert,
     * uploaded). Load time only. */
    int (*moe_place)(void *ctx, int32_t E, const bk_weight *gate, const bk_weight *up, const bk_weight *down,
                     bk_moe_experts *out);
    /* y [T, H] = sum over the k experts that noaux_tc routing (dsv3_route's semantics) picks from
     * logits F32 [T, E] (the router matmul; E = cfg->E, all routed experts) and bias F32 [1, E], in
     * ascending expert id, of w x down(silu(gate(x)) * up(x)), then + shared [T, H] (NULL: none):
     * moe_forward's order and roundings (kernels/kn_moe.h kn_moe_experts). Expert parallelism: ex holds
     * experts [ex->e0, ex->e0 + ex->E) of the E; the sum runs over the chosen ones among them only.
     * x F32 [T, H]; y must not alias x or shared. */
    int (*moe)(void *ctx, const bk_moe_experts *ex, const bk_moe_cfg *cfg, const bk_tensor *logits,
               const bk_tensor *bias, const bk_tensor *x, const bk_tensor *shared, bk_tensor *y);
    /* Graph capture and replay (CUDA graphs); NULL on backends without it
     * (the CPU backend: every step is eager). See bk_graph_ops. */
    const struct bk_graph_ops *graph;
    /* Optional (NULL: none): the reason of the last op that returned -1 on
     * the calling thread (what the backend logged), for callers that report
     * a failure to a request (the engine's device sampling). Valid until the
     * next op on that thread. */
    const char *(*last_error)(void *ctx);
} bk_ops;

/* Graph capture: the ops issued between begin and end are recorded, not run
 * (no transfer, no wait, no allocation may happen in between: uploads go
 * before begin, downloads after launch), and launch replays them on the
 * buffers' contents at that time. Everything a captured op reads or writes
 * must live at the same address at every replay (fixed buffers), and every
 * host scalar the ops bake in (tokens of the call, sequences, block-table
 * stride, the attention's length bound) must be the same at every replay:
 * fixed_shape(true) makes meta_upload use shape-independent values (the
 * block-table stride and the length bound the backend was sized for) so a
 * step of T tokens and S sequences always bakes the same launch parameters
 * (the attention kernel's arithmetic for a token depends on its own
 * position only, so the results are those of the eager step, bit for bit). */
typedef struct bk_graph_ops {
    int (*begin)(void *ctx);
    int (*end)(void *ctx, void **exec);      /* *exec: the instantiated graph */
    int (*launch)(void *ctx, void *exec);
    void (*destroy)(void *ctx, void *exec);  /* NULL ok */
    void (*fixed_shape)(void *ctx, bool on);
    /* Optional (NULL: always the backend's bound): the attention length bound
     * fixed_shape bakes in, max_len > 0 (clamped to the backend's), or 0 for
     * the backend's own. A graph captured for a length class L serves steps
     * whose positions are all < L; meta_upload refuses others. The attention
     * grid (and its mostly idle blocks) scales with the bound, not with the
     * step's lengths, so short sequences replay a short-class graph. */
    void (*fixed_len)(void *ctx, int32_t max_len);
    /* Optional: selects the metadata set the next meta_upload fills (0: the
     * default one; 1 .. 15: more sets alive at once, each released on its
     * own, for a captured chain of calls with different positions: the
     * EAGLE-3 draft loop). A slot's buffers are carved the first time it is
     * selected (outside a capture). -1 on failure (logged). */
    int (*meta_slot)(void *ctx, int32_t slot);
} bk_graph_ops;

typedef struct backend {
    const char *name;   /* "cpu", "cuda" */
    const bk_ops *ops;
    void *ctx;
    bool host_visible;  /* tensors are host memory: bk_f32 / bk_wrap_* are valid */
} backend;

/* Backend memory tensor of [rows, cols] (buf_alloc; free with bk_tensor_free). */
int bk_tensor_alloc(backend *be, bk_dtype dt, int64_t rows, int64_t cols, bk_tensor *out);
void bk_tensor_free(backend *be, bk_tensor *t); /* zeroes *t; ok on a zeroed tensor */
/* y[T, w->rows] = x[T, w->cols] @ W^T with host arrays, for host-visible
 * backends only (tests, benchmarks, and model code that has no device form
 * yet): wraps them as tensors and calls ops->matmul. */
int bk_matmul_f32(backend *be, const bk_weight *w, const float *x, int32_t T, float *y);
/* ops->matmul_n where the backend has it, else n ops->matmul calls. */
int bk_matmul_n(backend *be, int n, const bk_weight *const *w, const bk_tensor *x, bk_tensor *const *y);
/* A backend copy of host floats [rows, cols] (norm gains, biases, inv_freq). */
int bk_tensor_from_host(backend *be, const float *host, int64_t rows, int64_t cols, bk_tensor *out);

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
