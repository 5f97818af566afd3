/*
 * eagle3_head.h: the EAGLE-3 draft head below the proposer: its weights, its
 * paged KV pool and the three pieces of its forward (REFERENCE.md §2), for
 * draft/eagle3_proposer.c and for tests that compare the forward with the
 * PyTorch reference (tools/eagle3/reference.py). The engine never sees this
 * header; it sees spec_proposer (engine/runtime/proposer.h) via draft/eagle3.h.
 *
 * Owns: converted weight copies (f32 norms, biases, an lm_head gathered from
 * the target's rows), the safetensors mapping the bf16/f16/f32 matrices are
 * used from in place, the vocabulary map, and in its backend's memory the
 * draft KV storage, the workspace (sized at load for max_rows rows), the
 * d2t map of the logits rows and, on a device backend, placed copies of
 * every matrix and vector (eagle3_weights.c head_place). Borrows: the
 * target's embedding / LM head weights (host views, and on the target's
 * device backend its placed embedding and, when used whole, LM head) and
 * backend (the target model must outlive the head).
 * Shapes: H = draft hidden, Ht = target hidden, A = n_aux (3), nh/nkv heads
 * of head_dim hd, I = ffn, Vd = draft vocab, Vt = target vocab.
 * Threading: engine thread only.
 */
#ifndef SPECD_DRAFT_EAGLE3_HEAD_H
#define SPECD_DRAFT_EAGLE3_HEAD_H

#include <stdbool.h>
#include <stdint.h>

#include "draft/eagle3_config.h"
#include "draft/eagle3_vocab.h"
#include "engine/backend/backend.h"
#include "engine/comm/comm.h"
#include "engine/model/model.h"
#include "engine/util/err.h"

/* What the head borrows from its target. */
typedef struct eagle3_target {
    backend *be;               /* the backend the head computes on */
    const bk_weight *embed;    /* [Vt, Ht] host view */
    const bk_weight *lm_head;  /* [Vt, Ht] host view (tied: == embed) */
    int32_t hidden;            /* Ht */
    int32_t vocab;             /* Vt */
    int32_t n_layers;
    /* The target's own copies in be's memory when be is the target's backend
     * and not host-visible (model_embed_placed / model_lm_head_placed): the
     * head then shares them instead of placing its own. NULL otherwise. */
    const bk_weight *embed_placed;   /* [Vt, Ht] */
    const bk_weight *lm_head_placed; /* [Vt, Ht] */
} eagle3_target;

typedef struct eagle3_head_opts {
    eagle3_aux_convention aux_ids_convention;
    int32_t block_size;        /* draft KV block size (the engine's) */
    int32_t n_blocks;          /* draft KV blocks */
    bool q8_0;                 /* re-quantize bf16/f16/f32 matrices (fc, q/k/v/o, MLP, lm_head) to
                                  ggml Q8_0 at load: about half the bytes read per draft step on CPU,
                                  logits within ~1e-2 of max|logit| (tests/draft/test_draft_forward.c) */
    const char *hot_vocab;     /* NULL, or a vocab map (a `specd vocab build` output directory or its
                                  .safetensors: d2t I64 [n], target id = i + d2t[i]): the draft then
                                  scores only its ids whose target id is in that set (FR-Spec, Zhao et
                                  al. 2025; SGLang's speculative_token_map): the lm_head is cut to those
                                  rows at load. Drafts are still verified: lossless either way. */
    int32_t max_rows;          /* rows of one forward call the workspace is allocated for at load (<= 0:
                                  512); a device backend refuses larger calls, a host-visible one grows */
    int32_t logit_rows;        /* rows of one logits call (the chain's sequences; <= 0: max_rows): a
                                  vocabulary-split head on a device sizes its gather space for them */
    comm *tp_comm;             /* device tensor parallelism (eagle3_tp.h eagle3_tp_load): the head is cut
                                  to this rank's shard BEFORE it is placed, mirrored (every rank runs the
                                  whole proposer on its shard); NULL = the whole head (or a CPU TP split
                                  after load: eagle3_head_tp_shard) */
    const model_comm *tp_mc;   /* the target's collectives over the same group, with tp_comm */
} eagle3_head_opts;

typedef struct eagle3_head eagle3_head;

/* Loads DIR (config.json + *.safetensors), checks every tensor's shape against
 * the config and the target, validates d2t / t2d (eagle3_vocab.h), resolves the
 * aux layers, allocates the KV pool. Returns 0 or -1 with err. */
int eagle3_head_load(const char *dir, const eagle3_target *t, const eagle3_head_opts *o, eagle3_head **out,
                     specd_err *err);
void eagle3_head_destroy(eagle3_head *h); /* NULL ok */

const eagle3_config *eagle3_head_config(const eagle3_head *h);
const eagle3_vocab_info *eagle3_head_vocab(const eagle3_head *h);
/* used[n]: row i of the draft logits -> target id; n = eagle3_head_n_scored(h):
 * the draft vocab (i + d2t[i]), or its hot subset (opts.hot_vocab), in draft-id order. */
const int64_t *eagle3_head_used(const eagle3_head *h);
int32_t eagle3_head_n_scored(const eagle3_head *h);
/* Target layers (input convention) the head needs, written to out (<= 8). */
int eagle3_head_aux_layers(const eagle3_head *h, int32_t *out);
int32_t eagle3_head_n_aux(const eagle3_head *h);

/* The backend the head computes on, and the draft -> target map of the
 * logits rows as the argmax op takes it: I32 [n_scored, 1] in that
 * backend's memory, d2t[i] = used[i] - i. */
backend *eagle3_head_backend(const eagle3_head *h);
const bk_tensor *eagle3_head_d2t(const eagle3_head *h);

/* ---- draft KV pool: f32 [n_blocks, block_size, nkv, hd] for K and V, a free
 * list of block ids. Block tables are the caller's (the proposer's). */
bk_kv_layer eagle3_head_kv(eagle3_head *h);
/* Pops a free block id, or -1 when the pool is exhausted. */
int32_t eagle3_kv_alloc(eagle3_head *h);
void eagle3_kv_free(eagle3_head *h, int32_t block);
int32_t eagle3_kv_n_free(const eagle3_head *h);

/* ---- forward pieces (each row independent; the ops are batch-invariant) */

/* Step 1: g[n, H] = fc(aux[n, A*Ht]) (no bias). Target features only. */
int eagle3_fc(eagle3_head *h, const float *aux, int32_t n, float *g, specd_err *err);

/* Steps 2-5 for n rows: row i is token tokens[i] (TARGET id, embedded with the
 * target's table) at rotary/cache position pos[i] of sequence seq_of[i]
 * (index into block_tables, which must cover pos[i]); g[i] is either fc's
 * output or a fed-back pre-norm draft output. Writes the rows' K/V into the
 * draft cache, attends causally to positions [0, pos[i]] of the sequence,
 * and writes the pre-norm output h_out[n, H]. */
typedef struct eagle3_rows {
    int32_t n;
    const int32_t *tokens;              /* [n] target ids */
    const int32_t *pos;                 /* [n] */
    const int32_t *seq_of;              /* [n] */
    int32_t n_seqs;
    const int32_t *const *block_tables; /* [n_seqs] */
    void *meta_dev;                     /* NULL: the layer call uploads (and releases) the metadata of pos /
                                           seq_of / block_tables; else the backend's metadata the caller
                                           uploaded for them (bk_attn_meta.dev), kept (a captured draft loop) */
} eagle3_rows;
int eagle3_layer(eagle3_head *h, const eagle3_rows *r, const float *g, float *h_out, specd_err *err);

/* Step 7: logits[n, Vs] = lm_head(norm(hid[n, H])), Vs = eagle3_head_n_scored(h). */
int eagle3_logits(eagle3_head *h, const float *hid, int32_t n, float *logits, specd_err *err);

/* The same three on tensors in the head's backend memory (device memory on a
 * device backend; the functions above wrap host buffers and need a
 * host-visible backend). aux F32 [n, A*Ht] -> g F32 [n, H]; layer: ids I32
 * [n, 1] the rows' target token ids in backend memory (r->tokens may then
 * be NULL: they are checked on the device; NULL ids = r->tokens wrapped, on
 * a host-visible backend only), g F32 [n, H] -> out F32 [n, H] (out must
 * not alias g); hid F32 [n, H] -> logits F32 [n, Vs]. Nothing is
 * allocated and nothing is copied to or from the host except each layer
 * call's metadata upload (positions, block tables: ops->meta_upload). */
int eagle3_fc_t(eagle3_head *h, const bk_tensor *aux, bk_tensor *g, specd_err *err);
int eagle3_layer_t(eagle3_head *h, const eagle3_rows *r, const bk_tensor *ids, const bk_tensor *g, bk_tensor *out,
                   specd_err *err);
int eagle3_logits_t(eagle3_head *h, const bk_tensor *hid, bk_tensor *logits, specd_err *err);

/* ---- draft token choice (used by the proposer; exposed for its tests) */

/* Picks a draft id from logits lg[Vd]. temp <= 0 or q == NULL: the argmax
 * (lowest id on ties) and, if q, q[used[argmax]] = 1. temp > 0: the inverse
 * CDF of softmax(lg / temp) (computed in double, draft-id order) at u in
 * [0, 1), and q[used[i]] = that softmax for every draft id i. q: f32 over
 * TARGET ids, zeroed by the caller (entries outside used[] stay 0). */
int32_t eagle3_pick(const float *lg, int32_t Vd, const int64_t *used, float temp, double u, float *q);

#endif
