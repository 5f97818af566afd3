/*
 * proposer.h: the speculative proposer interface (DESIGN.md "The speculative
 * step"). The engine owns verify / accept / rollback; a proposer only drafts.
 * draft/ implements it for EAGLE-3 on the engine's public headers; n-gram or
 * MTP proposers can implement it later without touching the scheduler.
 *
 * Threading: called from the engine thread only.
 * Ids: a proposer returns TARGET token ids (EAGLE-3 maps draft ids through d2t
 * itself) plus, when sampling, its distribution q over target ids.
 */
#ifndef SPECD_RUNTIME_PROPOSER_H
#define SPECD_RUNTIME_PROPOSER_H

#include <stdint.h>

#include "engine/util/err.h"

typedef struct spec_seq_ref {
    int64_t seq_id;          /* stable engine sequence id */
    int32_t n_ctx;           /* tokens of this sequence already known to the target */
} spec_seq_ref;

struct backend;

/* The draft distributions of a propose_dev call, left in the proposer's
 * backend memory for a verifier on that backend (bk_verify_seq.q). */
typedef struct spec_dev_q {
    const float *q;          /* backend memory: rows of q_vocab f32 over the DRAFT vocabulary */
    int32_t q_vocab;
    const int32_t *t2d;      /* backend memory: I32 [target vocab]: target id -> q column, -1 outside */
    int32_t *row;            /* host [n, k_max], the CALLER's: row of q holding draft j of sequence i, -1: one-hot */
} spec_dev_q;

typedef struct spec_proposer_ops {
    /* Target layers whose INPUT residual stream the proposer needs (EAGLE-3 aux
     * capture), written to *layers (<= 8). Returns the count. */
    int (*aux_layers)(void *ctx, int32_t *layers);
    /* Feeds the target's features for newly committed tokens of one sequence:
     * tokens [n] at positions [pos0, pos0+n) and aux [n, n_aux*H] f32 captured
     * for those same positions (the draft pairs feature t with token t+1). */
    int (*extend)(void *ctx, int64_t seq_id, const int32_t *tokens, int32_t n, int32_t pos0,
                  const float *aux, specd_err *err);
    /* Optional: extend with the features on the device. The same as extend
     * with aux, except that the features of positions [pos0, pos0 + n) are
     * rows [aux_row0, aux_row0 + n) of the target's device aux buffer
     * (model_aux_device of the proposer's target) as the target's last
     * forward left them; the proposer copies what it keeps on the device
     * before the next forward. Used when engine_runner.aux_dev is set. */
    int (*extend_rows)(void *ctx, int64_t seq_id, const int32_t *tokens, int32_t n, int32_t pos0, int32_t aux_row0,
                       specd_err *err);
    /* Optional: the device feature cache. feat_cache_slots returns the rows of
     * the proposer's feature pool when that pool is indexed by the TARGET's
     * KV slots (row b * block_size + p % block_size holds the features of the
     * position whose KV is in slot p % block_size of target block b), else
     * 0. Such a pool is shared exactly like the KV: the block manager's
     * prefix cache, eviction and refcounts govern it, and nothing in the
     * proposer allocates or frees its rows. extend_slots is then the only way
     * features reach it: the same as extend_rows for positions [pos0, pos0 +
     * n), whose KV slots are given by blocks[0 .. n_blocks) (the target's
     * block table of the sequence, covering pos0 + n - 1); with aux_row0 >= 0
     * the features are rows [aux_row0, aux_row0 + n) of the target's device
     * aux buffer and are copied into those slots (device to device) whatever
     * the sequence's draft state; with aux_row0 < 0 they are already there (a
     * prefix-cache hit: the sequence that computed those KV blocks left its
     * features in the same slots) and nothing is copied. */
    int64_t (*feat_cache_slots)(void *ctx);
    int (*extend_slots)(void *ctx, int64_t seq_id, const int32_t *tokens, int32_t n, int32_t pos0, int32_t aux_row0,
                        const int32_t *blocks, int32_t n_blocks, specd_err *err);
    /* Proposes k[i] tokens for each of n sequences: out_tokens[i*k_max + j]
     * (target ids); out_q (if not NULL) [n, k_max, vocab_target] f32 draft
     * probabilities (zero outside the draft vocabulary). */
    int (*propose)(void *ctx, const int64_t *seq_ids, const int32_t *k, int32_t n, int32_t k_max,
                   const float *temperatures, int32_t *out_tokens, float *out_q, specd_err *err);
    /* Optional, both or neither. dev_q_backend: the backend propose_dev leaves q on (NULL: it cannot now).
     * propose_dev: propose with out_q wanted, except that q stays in that backend's memory: the same
     * drafts, and dq->row[i * k_max + j] names the row of dq->q (over the draft vocabulary, read through
     * dq->t2d) with draft j's distribution, -1 for a one-hot draft (greedy rows, argmax drafts). The rows
     * stay valid until the next propose / propose_dev / extend (the engine verifies before extending);
     * nothing crosses to the host but the drafted ids. */
    const struct backend *(*dev_q_backend)(void *ctx);
    int (*propose_dev)(void *ctx, const int64_t *seq_ids, const int32_t *k, int32_t n, int32_t k_max,
                       const float *temperatures, int32_t *out_tokens, spec_dev_q *dq, specd_err *err);
    /* Rolls the draft state of a sequence back to n_ctx committed tokens. */
    void (*truncate)(void *ctx, int64_t seq_id, int32_t n_ctx);
    /* Frees everything of a sequence. */
    void (*free_seq)(void *ctx, int64_t seq_id);
    /* Optional. Seeds the draft's sampling RNG of one sequence; the engine
     * calls it once, when the sequence is first admitted (before any extend),
     * with a seed derived from the request's seed. A proposer that samples
     * drafts must draw only from that per-sequence state, so the drafts of a
     * seeded request do not depend on the batch or on other requests. */
    void (*seed_seq)(void *ctx, int64_t seq_id, uint64_t seed);
    /* Draft KV blocks (total, free) for /metrics. */
    void (*kv_usage)(void *ctx, int64_t *total, int64_t *free_blocks);
} spec_proposer_ops;

typedef struct spec_proposer {
    const spec_proposer_ops *ops;
    void *ctx;
} spec_proposer;

#endif
