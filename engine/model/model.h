/*
 * model.h: a target model (the "model runner" of nano-vllm): weights,
 * the paged KV storage, and one forward pass over a batch of tokens from
 * many sequences at once (prefill chunks, decode tokens and speculative
 * verify tokens mixed freely).
 *
 * Owns: the weights (views into the mapped model file, or converted copies),
 * the KV storage (n_blocks blocks of block_size tokens for every layer).
 * Does NOT own: which blocks belong to whom: that is the block manager's
 * bookkeeping (engine/runtime), passed in through block tables.
 * Threading: engine thread only.
 *
 * Architectures: "llama" (GGUF or HF safetensors). Every linear is declared
 * column-parallel, row-parallel or replicated (model_linear_parallel); with a
 * model_comm in the load options the loader keeps only this rank's slices
 * (Megatron-LM layout, engine/model/tp_shard.c) and the forward pass
 * all-reduces after each row-parallel linear. Every rank runs the same
 * model_forward on the same batch, in lock step.
 */
#ifndef SPECD_MODEL_MODEL_H
#define SPECD_MODEL_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/backend/backend.h"
#include "engine/loader/gguf.h"
#include "engine/util/err.h"

typedef enum { MODEL_ARCH_LLAMA, MODEL_ARCH_DEEPSEEK_V3 } model_arch;
typedef enum { TP_REPLICATED, TP_COLUMN, TP_ROW } tp_style;

typedef struct model_config {
    model_arch arch;
    char name[128];
    int32_t n_layers;
    int32_t hidden;          /* H */
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t ffn;             /* intermediate size */
    int32_t vocab;
    int32_t max_pos;         /* context length the model was trained for */
    float rope_theta;
    float rms_eps;
    bool tied_embeddings;
    bool rope_neox;          /* rotate_half layout (HF) vs adjacent pairs (GGUF-permuted q/k) */
} model_config;

typedef struct model model;

/* The collectives a tensor-parallel model needs, on backend memory (host
 * memory for the CPU backend: engine/comm's shm group; device memory for a
 * GPU backend: cuda_ipc / NCCL). Every rank calls them in the same order
 * with the same shapes. Errors: -1 with err set (the group is then aborted). */
typedef struct model_comm {
    int32_t rank, size;
    /* x [rows, cols] f32, summed over the ranks in place; the result must be
     * identical on every rank and its per-element order fixed (rank order),
     * so that a row's result does not depend on the batch. */
    int (*all_reduce)(void *ctx, bk_tensor *x, specd_err *err);
    /* in [rows, cols] f32 on every rank -> out [size * rows, cols], rank r's
     * rows at r * rows (rank-major). */
    int (*all_gather)(void *ctx, const bk_tensor *in, bk_tensor *out, specd_err *err);
    void *ctx;
    /* the collectives are kernels on the backend's stream that a CUDA graph can capture and replay (cuda_ipc:
     * its generations are device-side counters; nccl); false for the host-staged ones (shm), whose steps stay
     * eager at TP > 1 */
    bool graphs;
} model_comm;

typedef struct model_load_opts {
    int32_t block_size;      /* KV tokens per block (16 default) */
    int64_t kv_bytes;        /* KV storage budget in bytes (this rank: all layers, K and V) */
    int32_t n_blocks;        /* if > 0, overrides kv_bytes */
    const model_comm *tp;    /* tensor-parallel group (must outlive the model), or NULL = TP 1 */
    bool latent_bf16;        /* DeepSeek-V3: the MLA latent cache in bf16, the model's own dtype ((kv_lora_rank +
                                qk_rope) x 2 bytes per token per layer: 70,272 B for Kimi-K2.5) instead of f32; the form the
                                GPU kernel reads (kernels/kn_mla.h). Off by default on the CPU: on the random seed-0
                                miniature the rounding alone moves logits by up to 0.11 of max|logit| against the f32
                                transformers reference; kimi_c_logits_bf16 checks it against a reference with the
                                same rounding (docs/kimi-k2.5.md "The bf16 latent cache") */
    /* Reading a Hugging Face safetensors checkpoint (engine/model/load_plan.c; GGUF files are mapped and
     * read lazily as before). */
    int32_t load_threads;    /* reader threads for this rank's byte ranges (0: min(8, cores)) */
    bool load_lazy;          /* read nothing up front: the read-only mapping faults pages in as the weights
                                are first used, on the loading thread (the path before issue 19; the tests'
                                reference) */
    unsigned load_st_flags;  /* st_open_ex flags: 0, or the test aid ST_OPEN_POISON (safetensors.h) */
    int32_t load_row_min;    /* a row-parallel tensor is read row by row (the rank's columns) when they are at
                                least this many bytes a row, else whole (0: MODEL_LOAD_ROW_MIN) */
    bool expert_parallel;    /* DeepSeek-V3 / Kimi with tp: the routed experts are split across the ranks WHOLE
                                (vLLM's --enable-expert-parallel): rank r of N keeps experts [r E/N, (r+1) E/N)
                                and reads only their bytes; attention, the dense MLP and the shared expert stay
                                tensor-parallel, routing replicated; the MoE block's all-reduce sums the experts'
                                contributions. Refused for a model without routed experts and when N does not
                                divide E (tp_shard.c; docs/kimi-k2.5.md "Expert parallelism") */
} model_load_opts;

#define MODEL_LOAD_ROW_MIN 1024 /* load_plan.c: measured by tests/perf/bench_load */

/* The checkpoint bytes rank R of N would read from the Hugging Face safetensors directory DIR (the load
 * plan of engine/model/load_plan.c, merged; expert_parallel and row_min as model_load_opts'), without
 * reading any weight: only config.json and the safetensors headers are read, so it works on a checkpoint
 * whose data are absent (sparse files: tests/loader/test_kimi_plan.py computes Kimi-K2.5's real per-rank
 * figures that way). *files: the shards' sizes together. -1 with the reason. */
int model_plan_rank_bytes(const char *dir, int32_t N, int32_t r, bool expert_parallel, int32_t row_min,
                          int64_t *bytes, int64_t *files, specd_err *err);

/* What loading cost this rank (model_get_load_info). */
typedef struct model_load_info {
    double seconds;          /* model_load's wall time: open, reads, slicing, placement */
    double read_seconds;     /* the parallel reads alone (0 when lazy or GGUF) */
    int64_t bytes_read;      /* checkpoint bytes this rank's readers read (0 when lazy or GGUF) */
    int64_t bytes_files;     /* the checkpoint's files together */
    int64_t bytes_loaded;    /* this rank's weights after slicing (model_shard_info.weight_bytes) */
    int32_t threads;         /* reader threads used */
} model_load_info;
void model_get_load_info(const model *m, model_load_info *out);

/* This rank's share of the model (tensor parallelism; the whole model at TP 1). */
typedef struct model_shard_info {
    int32_t rank, size;
    int32_t n_heads, n_kv_heads, ffn; /* local attention heads, KV heads (replicated when fewer than ranks), MLP width */
    int32_t vocab_rows;      /* LM-head rows held here (vocabulary-parallel), or the whole vocabulary */
    bool expert_parallel;    /* routed experts held whole: [expert0, expert0 + n_experts); else every expert, split */
    int32_t expert0, n_experts; /* routed experts held (all E at TP without EP, and for a dense model 0, 0) */
    int32_t expert_width;    /* columns of each routed expert held: moe_intermediate (EP, TP 1) or / N (TP) */
    int64_t weight_bytes;    /* bytes of weights this rank keeps in backend memory or maps (its slices) */
    int64_t kv_bytes;        /* KV pool of this rank */
} model_shard_info;
void model_get_shard(const model *m, model_shard_info *out);

/* Loads a GGUF file (llama architecture) or an HF directory. The KV storage
 * is allocated here from opts. The backend must outlive the model. */
int model_load(const char *path, backend *be, const model_load_opts *opts, model **out, specd_err *err);
void model_destroy(model *m); /* NULL ok */

const model_config *model_get_config(const model *m);
/* The GGUF the model came from (for the tokenizer), NULL for HF directories. */
const gguf_file *model_gguf(const model *m);
/* Directory or file the model was loaded from. */
const char *model_path(const model *m);
int32_t model_kv_block_size(const model *m);
int32_t model_kv_n_blocks(const model *m);
/* KV bytes per token (all layers, K and V): for sizing and /metrics. */
int64_t model_kv_bytes_per_token(const model *m);

/* One forward step. Token i (0 <= i < n_tokens) is tokens[i] at absolute
 * position pos[i] of sequence seq_of[i]; its K/V are written to that
 * sequence's block table slot for pos[i], then it attends causally to
 * positions [0, pos[i]] of its sequence. The caller guarantees that all
 * earlier positions' KV are already in the cache or in this same batch, and
 * that block tables cover pos[i].
 * Outputs (each optional, NULL = not wanted):
 *   logits        f32 [n_out, vocab] for the tokens listed in out_idx
 *   final_hidden  f32 [n_out, H]     post-final-norm hidden state of those tokens
 *   aux           f32 [n_tokens, n_aux * H]  residual stream ENTERING layers
 *                 aux_layers[0..n_aux) (EAGLE-3 capture; REFERENCE §2), for
 *                 every token of the batch, concatenated in the given order.
 *   logits_dev    instead of logits, on a backend that is not host-visible:
 *                 *logits_dev receives the backend tensor f32 [n_out, vocab]
 *                 (the model's output workspace, valid until the next
 *                 forward) and nothing is downloaded; the caller samples it
 *                 there (bk_ops.sample) and downloads only the rows it needs.
 *                 Ignored (NULL ok) when logits is set or the backend is
 *                 host-visible. */
typedef struct model_batch {
    int32_t n_tokens;
    const int32_t *tokens;                /* [n_tokens] */
    const int32_t *pos;                   /* [n_tokens] */
    const int32_t *seq_of;                /* [n_tokens] */
    int32_t n_seqs;
    const int32_t *const *block_tables;   /* [n_seqs] */
    const uint8_t *tree_mask;             /* [n_tokens, n_tokens] or NULL */
    int32_t n_out;
    const int32_t *out_idx;               /* [n_out] token indices whose outputs are wanted */
    float *logits;
    float *final_hidden;
    bk_tensor *logits_dev;
    int32_t n_aux;
    const int32_t *aux_layers;
    float *aux;
    /* aux_on_device: the aux rows [n_tokens, n_aux * H] are left in the
     * model's fixed device buffer (model_aux_device, rows 0 .. n_tokens - 1,
     * valid until the next forward) and not downloaded (aux may be NULL;
     * when it is set too they are also downloaded). Needs model_aux_reserve
     * with these aux layers and n_tokens <= its rows; refused otherwise. */
    bool aux_on_device;
} model_batch;

int model_forward(model *m, const model_batch *b, specd_err *err);

/* The EAGLE-3 aux capture in a fixed buffer of the model's backend memory
 * (docs/engine.md "The draft head on the GPU"): F32 [max_rows, n_aux * H],
 * allocated once here (never per step), for aux layers LAYERS. From then on
 * every forward that captures exactly these layers on at most max_rows
 * tokens writes them there (graphs captured afterwards too), so a draft on
 * the same device reads them without a host round trip
 * (model_batch.aux_on_device). A no-op returning 0 on a host-visible
 * backend (its aux is the caller's host array, zero copies) and for
 * architectures without a device aux path (DeepSeek-V3 today); a second
 * call with the same layers and no more rows is a no-op. Refused after CUDA
 * graphs are captured (they bake the aux address: reserve first). */
int model_aux_reserve(model *m, int32_t n_aux, const int32_t *layers, int32_t max_rows, specd_err *err);
/* The buffer model_aux_reserve made (rows = max_rows, cols = n_aux * H), or NULL. */
const bk_tensor *model_aux_device(const model *m);
/* True when model_batch.logits_dev works for m: its backend is not
 * host-visible, samples (bk_ops.sample) and the LM head is not split by
 * vocabulary (tensor parallelism gathers it on the host). */
bool model_logits_on_device(const model *m);

/* CUDA graphs of the Llama forward (model_graph.c; docs/engine.md "CUDA
 * graphs"). A graph is captured per (bucket B, tokens per sequence q): a step
 * of B * q token rows and B + 1 sequences (the last one the padding rows').
 * A step with T tokens of S sequences, no tree mask, no final hidden, and
 * logits for every row in order (decode: q = 1; verify of k drafts: q = k +
 * 1; any other step too when it fits) replays the smallest graph with T <=
 * B * q and S <= B: its rows are padded with token 0 at position 0 of the
 * padding sequence, whose block table is one KV block reserved for it (taken
 * from the pool at capture: model_kv_n_blocks drops by one), so padding
 * never reads or writes a real sequence's KV, and the real rows are
 * computed as eagerly (every op is batch-invariant). Other steps run eagerly.
 * Capture after load and before the engine reads model_kv_n_blocks; on a
 * backend without graphs (CPU) it fails with the reason. */
typedef struct model_graph_opts {
    const int32_t *buckets;   /* sequences per graph, ascending, each >= 1 */
    int32_t n_buckets;
    const int32_t *q;         /* tokens per sequence to capture (1 = decode, k + 1 = verify of k drafts) */
    int32_t n_q;
    int32_t n_aux;            /* aux capture in the graphs (EAGLE-3 features): layers, or 0 */
    const int32_t *aux_layers;
    int32_t max_step_tokens;  /* largest eager step: the workspace is sized for it first (it must never move) */
    int32_t max_seqs;         /* sequences the backend's metadata holds: buckets need B + 1 <= max_seqs */
    int32_t max_tokens;       /* tokens the backend's metadata holds: B * q <= max_tokens */
    int32_t max_len;          /* > 0: positions stay below it (the engine's max_model_len); every (B, q) is
                                 captured per length class (model_graph_len_classes) and a step replays the
                                 smallest class above its positions. 0: one class, the backend's bound */
    int32_t len_floor;        /* the smallest class (0: 2048) */
} model_graph_opts;
/* The length classes of graphs for positions below max_len: max_len, then
 * max_len / 4, / 16, ... (rounded up to 256, the attention split) while >=
 * len_floor (0: 2048), at most 4, largest first, into out[4]. Returns the
 * count (1 when max_len <= 0: the backend's bound). The attention kernel's
 * grid is T x heads x ceil(L / 256) blocks whatever the step's lengths (the
 * splits past a token's position exit at once): a graph baked with the
 * context bound would launch mostly idle blocks for short sequences (review
 * finding F8); a class per factor 4 bounds that waste to 4x the blocks the
 * step's longest sequence needs (at >= len_floor), for at most 4x the graphs. */
int32_t model_graph_len_classes(int32_t max_len, int32_t len_floor, int32_t *out);
int model_graphs_capture(model *m, const model_graph_opts *o, specd_err *err);
void model_graphs_release(model *m); /* NULL ok; steps run eagerly afterwards */
/* model_graphs_release, and the padding block goes back to the KV pool: only
 * before any engine has read the pool (start-up: tp_graphs_agree's "off"). */
void model_graphs_discard(model *m);
typedef struct model_graph_stats {
    int32_t n_graphs;         /* captured */
    long replays;             /* steps run as one graph launch */
    long eager;               /* steps that fit no graph */
    long padded_rows;         /* padding rows computed by replays (waste) */
    long short_replays;       /* replays of a length class below the largest (model_graph_opts.max_len) */
} model_graph_stats;
void model_graph_get_stats(const model *m, model_graph_stats *out);
/* Tensor parallelism (engine/runtime/tp.c): rank 0 picks the graph of a step
 * (index into the captured list, -1: eager; the same rule model_forward
 * applies) and posts it with the step; a worker forces that pick for its next
 * model_forward, so every rank replays the same graph (the same collectives
 * in the same order) or every rank runs eagerly. Forcing a graph this rank
 * does not have, or one the step does not fit, fails the step. */
int32_t model_graph_pick(const model *m, const model_batch *b);
void model_graph_force(model *m, int32_t pick);

/* The embedding and LM head, for a draft head that shares them (EAGLE-3). */
/* Host memory views even when the model runs on a device backend (the GGUF /
 * safetensors mapping stays open), so a draft may compute on a host backend. */
const bk_weight *model_embed_weight(const model *m);   /* [vocab, H] */
const bk_weight *model_lm_head_weight(const model *m); /* [vocab, H] (tied: same as embed) */
backend *model_backend(const model *m);
/* The same two in the model's backend memory (the copies its forward reads:
 * device memory on a device backend; == the host views on host-visible
 * ones), for a draft head computing on the model's own backend, which then
 * shares them instead of placing copies. The LM head: NULL at TP > 1 (a
 * vocabulary slice there); the embedding is replicated whole at any TP (a
 * draft shard on a GPU rank shares it). */
const bk_weight *model_embed_placed(const model *m);
const bk_weight *model_lm_head_placed(const model *m);

#endif
