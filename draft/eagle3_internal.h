/* eagle3_internal.h: the eagle3_head struct shared by eagle3_weights.c
 * (loading, KV pool) and eagle3_forward.c. Not a public header. */
#ifndef SPECD_DRAFT_EAGLE3_INTERNAL_H
#define SPECD_DRAFT_EAGLE3_INTERNAL_H

#include <stddef.h>

#include "draft/eagle3_head.h"
#include "engine/loader/safetensors.h"

struct eagle3_head {
    eagle3_config cfg;
    eagle3_target tgt;
    st_model *st;                     /* mapping the in-place matrices point into */
    bk_weight fc;                     /* [H, A*Ht] */
    bk_weight wq, wk, wv;             /* [nh*hd, 2H], [nkv*hd, 2H] x2 */
    bk_weight wo;                     /* [H, nh*hd] */
    bk_weight wgate, wup, wdown;      /* [I, H] x2, [H, I] */
    bk_weight lm_head;                /* [Vd, H]: the head's, or the target's rows used[] */
    bk_weight own_embed;              /* [Vt, H] when the head ships embed_tokens */
    const bk_weight *embed;           /* &own_embed or the target's [Vt, Ht] */
    float *bq, *bk, *bv, *bo;         /* f32 biases [nh*hd], [nkv*hd] x2, [H] (HF attention_bias), or NULL */
    float *n_input, *n_hidden, *n_post, *n_final; /* f32 [H]: input_layernorm, hidden_norm, post_attention_layernorm, norm */
    float *inv_freq;                  /* f32 [hd/2] */
    int64_t *used;                    /* [lm_head.rows] logits row -> target id (draft ids, or their hot subset) */
    uint8_t *hot;                     /* load only: [Vt] target ids of the hot vocabulary, or NULL */
    eagle3_vocab_info vocab;
    int32_t n_aux;
    int32_t aux_layers[EAGLE3_MAX_AUX];
    /* draft KV pool: K and V each f32 [n_blocks, block_size, nkv, hd], backend memory */
    float *kv_k, *kv_v;
    int32_t block_size, n_blocks;
    int32_t *free_ids;                /* stack of free block ids */
    int32_t n_free;
    /* workspace in backend memory, allocated at load for max_rows rows (grows on host-visible backends only) */
    float *ws;
    size_t ws_cap;                    /* floats */
    int32_t max_rows;
    /* Residency. On a device backend (dev) every matrix above points into backend memory (placed at load,
     * or the target's placed embedding / LM head shared) and the vectors have the placed copies below; on a
     * host-visible backend the host vectors are wrapped per call (eagle3_tp.c re-points the biases when it
     * slices the head, after load). */
    bool dev;
    bk_tensor t_bq, t_bk, t_bv, t_bo;                /* F32 [1, n] copies of bq..bo (data NULL when absent) */
    bk_tensor t_input, t_hidden, t_post, t_final;    /* F32 [1, H] */
    bk_tensor t_inv_freq;                            /* F32 [1, hd/2] */
    bk_tensor d2t;                    /* I32 [n_scored, 1], backend memory: used[i] - i (the argmax op's map) */
    void **placed;                    /* backend allocations of the head (placed weights, vectors), freed at destroy */
    int n_placed;
    void **owned;                     /* converted copies, freed at destroy */
    int n_owned;
    /* tensor parallelism (eagle3_tp.c): NULL = the whole head here */
    struct eagle3_tp *tp;
    int32_t nh_l, nkv_l, ffn_l;       /* this rank's attention heads, KV heads, MLP width */
};

/* The workspace, at least n_floats (backend memory); NULL when a device backend's load-time size is short. */
float *eagle3_workspace(eagle3_head *h, size_t n_floats);
/* Workspace floats eagle3_layer_t takes for a call of T rows. */
size_t eagle3_layer_ws(const eagle3_head *h, int32_t T);
/* A zeroed allocation freed with the head (converted / sliced copies). */
void *head_own(eagle3_head *h, size_t bytes);

/* eagle3_tp.c, used by the forward: no-ops without tensor parallelism.
 * post_*: rank 0 sends the call and its inputs to the workers first.
 * all_reduce: after the row-parallel o_proj / down_proj. gather_logits:
 * the vocabulary-split LM head's [n, Vs/N] pieces into logits [n, Vs]
 * (NULL on workers); vocab_split: whether that applies. */
int eagle3_tp_post_layer(eagle3_head *h, const eagle3_rows *r, const float *g, specd_err *err);
int eagle3_tp_post_logits(eagle3_head *h, const float *hid, int32_t n, specd_err *err);
int eagle3_tp_all_reduce(eagle3_head *h, bk_tensor *x, specd_err *err);
int eagle3_tp_gather_logits(eagle3_head *h, const float *local, int32_t n, float *logits, specd_err *err);
bool eagle3_tp_vocab_split(const eagle3_head *h);
/* Device TP (eagle3_tp_load): every rank runs the proposer on its shard; nothing is posted. */
bool eagle3_tp_mirror(const eagle3_head *h);
/* Device TP, split LM head: local [n, Vl] -> all [N * n, Vl] (all-gather on the backend's memory) -> logits
 * [n, N * Vl] (one copy_cols per rank), on every rank. */
int eagle3_tp_gather_logits_t(eagle3_head *h, const bk_tensor *local, bk_tensor *all, bk_tensor *logits,
                              specd_err *err);
int eagle3_tp_size(const eagle3_head *h); /* ranks the head is split over (1: whole) */
comm *eagle3_tp_comm(const eagle3_head *h); /* the host group of a split head, or NULL */
/* Device TP: cuts h to this rank's shard (mirror mode) before placement; shapes that do not divide: -1. */
int eagle3_head_tp_shard_mirror(eagle3_head *h, comm *c, const model_comm *mc, specd_err *err);

/* eagle3_tp_prop.c: rank 0's mirror of the proposer calls (device TP). The proposer (eagle3_proposer.c)
 * posts each call before running it once eagle3_proposer_mirror gave it the group. e3m_post_seq: kind 0
 * truncate (arg n_ctx), 1 seed (arg seed), 2 free; a failure aborts the group (logged). */
struct spec_proposer;
void eagle3_proposer_mirror(struct spec_proposer *p, comm *c);
int e3m_post_extend(comm *c, int64_t id, const int32_t *tokens, int32_t n, int32_t pos0, const float *aux,
                    int32_t featw, bool rows, int32_t row0, specd_err *err);
int e3m_post_propose(comm *c, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                     bool want_q, specd_err *err);
void e3m_post_seq(comm *c, int kind, int64_t id, uint64_t arg);

#endif
