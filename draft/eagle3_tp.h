/*
 * eagle3_tp.h: the EAGLE-3 head split across tensor-parallel ranks like its
 * target (issue 18): attention heads and MLP column/row-parallel, the draft
 * LM head by draft-vocabulary rows (logits all-gathered, then d2t as usual);
 * fc (3H -> H) and the norms replicated.
 *
 * Rank 0 runs the proposer (engine/runtime/proposer.h) exactly as at TP 1;
 * its head posts each layer / logits call on the comm step channel (a
 * message whose first word is negative, so tp_worker_run hands it to
 * eagle3_tp_serve on the workers) and broadcasts the call's float inputs
 * (the g rows of the layer, the hidden rows of the logits), then computes its
 * shard; the collectives inside (an all-reduce after o_proj and after
 * down_proj, the logits all-gather) pair up on every rank. fc runs on rank 0
 * only: its output is the layer's broadcast input. Workers never allocate
 * draft KV blocks: the block ids come in the messages, checked against their
 * pool (the same size on every rank).
 *
 * A head whose shapes the TP size does not divide stays whole on rank 0 (the
 * caller is told; serving is unchanged). Threading: the engine thread (rank
 * 0) or the worker's main thread.
 */
#ifndef SPECD_DRAFT_EAGLE3_TP_H
#define SPECD_DRAFT_EAGLE3_TP_H

#include "draft/eagle3_head.h"
#include "engine/comm/comm.h"
#include "engine/model/model.h"

/* Slices head h (loaded whole, on every rank with the same options) to this
 * rank of comm c; mc: the target's model_comm over the same group (its
 * collectives). Returns 1 when split, 0 when the shapes do not divide
 * (nothing changed; *why says what), -1 on error. */
int eagle3_head_tp_shard(eagle3_head *h, comm *c, const model_comm *mc, char *why, size_t why_len, specd_err *err);

/* Worker: one draft message (msg[0] < 0) from the step channel, n bytes:
 * receives its broadcast inputs and runs this rank's part of the call. */
int eagle3_tp_serve(eagle3_head *h, const int32_t *msg, size_t n, specd_err *err);

#endif
