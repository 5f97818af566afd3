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

#include "draft/eagle3.h"
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

/* Whether a head of config cf splits across N ranks: its heads, KV heads
 * and MLP divide (and with q8_0, o_proj / down_proj slices of whole 32-value
 * blocks). 1 yes, 0 no with *why. The draft LM head is split by rows when
 * its scored vocabulary divides too (else scored whole: on rank 0 on the
 * CPU, on every rank on GPUs). */
int eagle3_tp_splits(const eagle3_config *cf, int N, bool q8_0, char *why, size_t why_len);

/* ------------------------------------------------------------ on GPU ranks (eagle3_tp_prop.c)
 *
 * At --device cuda --tensor-parallel-size N every rank loads the head on its
 * device cut to its shard (the same split as above, before placement: its
 * heads, KV heads and MLP slice, the LM head by draft-vocabulary rows when
 * they divide, else whole on every rank) and runs the WHOLE proposer on it;
 * rank 0's proposer mirrors every call the engine makes (extend,
 * extend_rows, propose, truncate, seed, free) to the workers on the step
 * channel before running it. The aux features stay on each rank's device
 * (each rank's forward captures them from its replicated residual stream),
 * and only the forward's collectives (two all-reduces per layer call, the LM
 * head's all-gather) cross ranks. Rank 0 moves the same bytes device -> host
 * per step as at TP 1 (the drafted ids, once per propose). */

/* Collective over c (every rank, at the same point of its start-up, with the
 * same options). Returns 1: split, *out is this rank's proposer (rank 0:
 * mirroring; a worker: serve it with eagle3_tp_serve_proposer); 0: the
 * shapes do not divide (*why says what): rank 0 holds the whole head on its
 * backend (*out), the workers none (*out NULL); -1: a rank failed (its
 * reason: the failing rank aborts the group with "draft head: ...", so
 * every rank fails here naming it). mc: the target's device collectives. */
int eagle3_tp_load(const char *dir, model *target, const eagle3_opts *o, comm *c, const model_comm *mc,
                   spec_proposer **out, char *why, size_t why_len, specd_err *err);
/* Worker: one mirrored proposer call (msg[0] < 0, n bytes) on its proposer p of target model. */
int eagle3_tp_serve_proposer(spec_proposer *p, const model *target, const int32_t *msg, size_t n, specd_err *err);

#endif
