/*
 * spec.c: the speculative step inside the scheduler (DESIGN.md "The
 * speculative step", REFERENCE §3), for every running sequence with k > 0
 * when a proposer is attached.
 *
 * One step for a decoding sequence whose last sampled token x_m (position m)
 * has no KV yet:
 *   plan     spec_plan_k: k_eff = min(k, room left in the context, tokens
 *            left before max_tokens - 1, step budget - 1); KV is reserved for
 *            positions m .. m + k_eff. With adaptive speculation k is the
 *            sequence's choice in 0..K for this step (spec_adapt.c); k_eff = 0
 *            makes it a plain decode step in the same batch.
 *   propose  spec_propose: ONE proposer call for all such sequences; drafts
 *            d_1..d_k are target ids; a -1 (or an id out of range) ends that
 *            sequence's drafts. q rows only when some sequence samples:
 *            on the host [n, k_max, V], or, when the proposer can leave
 *            them on the backend that samples the logits (propose_dev,
 *            dev_q_backend == runner.sample_be), there (draft_qrow): such a
 *            chain is verified on the device (scheduler.c device_sample)
 *            and its q never crosses to the host.
 *   verify   the sequence contributes [x_m, d_1..d_k] at positions m..m+k to
 *            the step's single model_forward, with a logits row for each
 *            (row j = target distribution for position m + 1 + j).
 *   accept   spec_verify_seq, row by row with the sequence's own history
 *            (accepted drafts appended before the next row, so penalties and
 *            min_tokens see exactly what plain decoding would): greedy accepts
 *            d_j iff it is the argmax of the processed row (else the argmax is
 *            emitted: the correction); sampling uses sampler_accept on the
 *            processed distribution p (sampler_probs, the same processing as
 *            plain sampling) and the draft's q. If all k are accepted the
 *            bonus token is sampled from row k. Each emitted token goes
 *            through post_token one at a time: a stop inside the block ends it
 *            there and nothing after is emitted or counted.
 *   commit   n_computed = m + 1 + accepted; KV past it is dead and whole blocks
 *            past it are freed (kv_seq_truncate); prefix-cache keys only for
 *            committed full blocks; the proposer gets extend([x_m, d_1..d_a],
 *            aux rows of those positions) then extend(last emitted token, no
 *            features), the contract in draft/eagle3.h.
 * Non-speculative steps feed the proposer too (spec_extend_computed /
 * spec_extend_sampled), so its state always mirrors the sequence.
 * Prefix caching: the draft needs the target's features of EVERY committed
 * position, and a prefix-cache hit skips the target. So, with a proposer and
 * prefix caching, the engine keeps each token's aux features next to its KV
 * slot (aux_pool, same block ids; written after every forward, keyed and
 * shared exactly like the KV), and a hit feeds the proposer the cached
 * tokens with their stored features (spec_feed_prefix_hit). Memory: n_aux *
 * hidden floats per KV slot (SmolLM2: 6.75 KiB per token next to 45 KiB of KV).
 * Features on the device (engine_runner.aux_dev and the proposer's
 * extend_rows, docs/engine.md "The draft head on the GPU"): the forward
 * leaves the aux rows in the model's fixed device buffer, the proposer is
 * told which rows (extend_rows, row sched_t0 = position n_computed of the
 * step) and copies them on the device; e->aux and the host aux_pool are not
 * used. The device feature cache (feat_slots: the proposer's feat_cache_slots
 * covers every KV slot) replaces the aux_pool there: the proposer's feature
 * pool has one row per KV slot, every feed passes the sequence's block table
 * (extend_slots) and the proposer's copy writes the rows at the positions'
 * slots, so a KV block the prefix cache keeps keeps its features in the same
 * physical block id (no second bookkeeping: the block manager's hashes,
 * refcounts and eviction govern both), and a hit is fed with aux_row0 = -1
 * (no copy, no transfer). Without it (a proposer that has none: the TP
 * mirror), prefix-cache hits are not taken for speculating sequences.
 *
 * Threading: engine thread only.
 */
#include "engine/runtime/engine_internal.h"

#include <stdlib.h>
#include <string.h>

#include "engine/util/log.h"

int spec_init(engine *e, specd_err *err) {
    e->n_aux = 0;
    e->aux_on_dev = false;
    if (!e->proposer) return 0;
    int32_t layers[8];
    int n = e->proposer->ops->aux_layers ? e->proposer->ops->aux_layers(e->proposer->ctx, layers) : 0;
    if (n < 0 || n > 8) return specd_err_set(err, "engine: proposer wants %d aux layers (0..8)", n);
    e->n_aux = n;
    memcpy(e->aux_layers, layers, (size_t)n * sizeof *layers);
    size_t ns = (size_t)e->cfg.max_num_seqs;
    free(e->p_seqs), free(e->p_ids), free(e->p_k), free(e->p_temp), free(e->p_tok), free(e->prob), free(e->p_qrow);
    e->p_seqs = malloc(ns * sizeof *e->p_seqs);
    e->p_ids = malloc(ns * sizeof *e->p_ids);
    e->p_k = malloc(ns * sizeof *e->p_k);
    e->p_temp = malloc(ns * sizeof *e->p_temp);
    e->p_tok = malloc(ns * 16 * sizeof *e->p_tok);
    e->p_qrow = malloc(ns * 16 * sizeof *e->p_qrow);
    e->prob = malloc((size_t)e->runner.vocab * sizeof *e->prob);
    if (!e->p_seqs || !e->p_ids || !e->p_k || !e->p_temp || !e->p_tok || !e->prob || !e->p_qrow)
        return specd_err_set(err, "engine: out of memory for speculative buffers");
    e->cap_prop = ns;
    free(e->aux_pool);
    e->aux_pool = NULL;
    const bk_tensor *ad = e->runner.aux_dev;
    e->aux_on_dev = n > 0 && ad && e->proposer->ops->extend_rows &&
                    ad->rows >= (int64_t)e->cfg.max_num_batched_tokens && ad->cols == (int64_t)n * e->runner.hidden;
    if (n > 0 && ad && !e->aux_on_dev)
        LOG_INFO("engine: the draft's features travel through the host (device aux buffer %lld x %lld, steps of %d "
                 "tokens, %d layers x %d%s)", (long long)ad->rows, (long long)ad->cols,
                 e->cfg.max_num_batched_tokens, n, e->runner.hidden,
                 e->proposer->ops->extend_rows ? "" : ", the proposer has no extend_rows");
    /* the device feature cache: the proposer's pool indexed by this engine's KV slots */
    const int64_t kv_slots = (int64_t)e->runner.n_blocks * e->runner.block_size;
    const spec_proposer_ops *po = e->proposer->ops;
    const int64_t fslots = n > 0 && po->feat_cache_slots ? po->feat_cache_slots(e->proposer->ctx) : 0;
    e->feat_slots = false;
    if (fslots > 0) {
        if (!e->aux_on_dev || !po->extend_slots)
            return specd_err_set(err, "engine: the draft's features live in its device feature cache, which only the "
                                      "target's device aux buffer feeds (extend_slots); this engine's features travel "
                                      "through the host");
        if (fslots < kv_slots)
            return specd_err_set(err, "engine: the draft's device feature cache has %lld rows, the KV pool %lld slots "
                                      "(%d blocks of %d)", (long long)fslots, (long long)kv_slots, e->runner.n_blocks,
                                 e->runner.block_size);
        e->feat_slots = true;
    } else if (e->aux_on_dev && kv_prefix_caching(e->kv)) {
        LOG_INFO("engine: the draft's features stay on the device and it keeps no device feature cache "
                 "(eagle3_opts.feat_cache; not at tensor parallelism): prefix-cache hits are not taken for speculating "
                 "sequences");
    }
    if (n > 0 && kv_prefix_caching(e->kv) && !e->aux_on_dev) {
        size_t slots = (size_t)e->runner.n_blocks * (size_t)e->runner.block_size;
        e->aux_pool = malloc(slots * (size_t)n * (size_t)e->runner.hidden * sizeof *e->aux_pool);
        if (!e->aux_pool)
            return specd_err_set(err, "engine: out of memory for the aux feature cache (%zu slots)", slots);
    }
    if (e->cfg.spec_adaptive) spec_adapt_calibrate(e); /* on failure: fixed k, logged */
    return 0;
}

bool spec_prefix_hits_ok(const engine *e) {
    return !e->proposer || e->n_aux == 0 || e->aux_pool != NULL || e->feat_slots;
}

void spec_aux_store(engine *e) {
    if (!e->aux_pool) return;
    const size_t row = (size_t)e->n_aux * (size_t)e->runner.hidden;
    const int32_t bs = e->runner.block_size;
    for (size_t i = 0; i < e->n_sched; i++) {
        const sched_seq *s = e->sched[i];
        for (int32_t j = 0; j < s->sched_new; j++) {
            int32_t pos = s->n_computed + j;
            size_t slot = (size_t)s->kv.blocks[pos / bs] * (size_t)bs + (size_t)(pos % bs);
            memcpy(e->aux_pool + slot * row, e->aux + ((size_t)s->sched_t0 + (size_t)j) * row, row * sizeof(float));
        }
    }
}

bool spec_feed_prefix_hit(engine *e, sched_seq *s, int32_t hit) {
    if (!e->proposer || hit <= 0) return true;
    if (e->feat_slots) { /* the features are in the cache rows of the hit blocks: nothing to copy */
        specd_err err = {0};
        double t0 = engine_now_s();
        if (e->proposer->ops->extend_slots(e->proposer->ctx, s->id, s->tokens, hit, 0, -1, s->kv.blocks,
                                           s->kv.n_blocks, &err) != 0)
            LOG_DEBUG("engine: proposer extend of a %d-token prefix hit from the feature cache: %s", hit, err.msg);
        e->t_draft_s += engine_now_s() - t0;
        return true;
    }
    if (e->n_aux > 0 && !e->aux_pool) return false;
    const size_t row = (size_t)e->n_aux * (size_t)e->runner.hidden;
    const float *aux = NULL;
    if (row > 0) {
        if ((size_t)hit > e->cap_gather_rows) {
            float *ng = realloc(e->aux_gather, (size_t)hit * row * sizeof *ng);
            if (!ng) return false;
            e->aux_gather = ng;
            e->cap_gather_rows = (size_t)hit;
        }
        const int32_t bs = e->runner.block_size;
        for (int32_t p = 0; p < hit; p++) {
            size_t slot = (size_t)s->kv.blocks[p / bs] * (size_t)bs + (size_t)(p % bs);
            memcpy(e->aux_gather + (size_t)p * row, e->aux_pool + slot * row, row * sizeof(float));
        }
        aux = e->aux_gather;
    }
    specd_err err = {0};
    double t0 = engine_now_s();
    if (e->proposer->ops->extend &&
        e->proposer->ops->extend(e->proposer->ctx, s->id, s->tokens, hit, 0, aux, &err) != 0)
        LOG_DEBUG("engine: proposer extend of a %d-token prefix hit: %s", hit, err.msg);
    e->t_draft_s += engine_now_s() - t0;
    return true;
}

int32_t spec_plan_k(engine *e, sched_seq *s, int32_t budget) {
    if (!e->proposer || s->k <= 0 || s->n_computed != s->n_tokens - 1) return 0;
    int32_t k = e->cfg.spec_adaptive ? spec_adapt_k(e, s) : s->k;
    int32_t room_ctx = e->cfg.max_model_len - s->n_tokens;   /* positions m+1..m+k < max_model_len */
    int32_t room_out = s->pp.max_tokens - s->post.n_out - 1; /* the last token is always a correction/bonus */
    if (k > room_ctx) k = room_ctx;
    if (k > room_out) k = room_out;
    if (k > budget - 1) k = budget - 1;
    if (k > 15) k = 15;
    if (k < 0) k = 0;
    e->spec_k_chosen[k]++;
    if (k == 0) spec_accept_idle(&s->acc);
    return k;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 8;
    while (c < need) c *= 2;
    void *np = realloc(*p, c * elem);
    if (!np) return -1;
    *p = np;
    *cap = c;
    return 0;
}

void spec_propose(engine *e) {
    size_t n = 0;
    int32_t k_max = 0;
    bool sampling = false;
    for (size_t i = 0; i < e->n_sched; i++) {
        sched_seq *s = e->sched[i];
        s->n_draft = 0;
        s->draft_q = NULL;
        s->draft_qrow = NULL;
        if (s->sched_k <= 0) continue;
        n++;
        if (s->sched_k > k_max) k_max = s->sched_k;
        if (!sampler_is_greedy(&s->sp)) sampling = true;
    }
    if (n == 0) return;
    const int32_t V = e->runner.vocab;
    if (n > e->cap_prop) return; /* cannot happen: n <= max_num_seqs */
    /* q on the device: the proposer leaves it on the backend that samples the logits (propose_dev), the chain is
     * verified there and nothing but ids and counts comes back; else q rows [n, k_max, V] on the host */
    const spec_proposer_ops *po = e->proposer->ops;
    const bool qdev = sampling && e->runner.sample_be && po->propose_dev && po->dev_q_backend &&
                      po->dev_q_backend(e->proposer->ctx) == e->runner.sample_be;
    size_t q_rows = n * (size_t)k_max;
    if (sampling && !qdev && q_rows > e->cap_q_rows) {
        float *nq = realloc(e->p_q, q_rows * (size_t)V * sizeof *nq);
        if (!nq) return;
        e->p_q = nq;
        e->cap_q_rows = q_rows;
    }
    size_t j = 0;
    bool steady = true; /* every proposing sequence drafted a step ago: no long catch-up inside the timing */
    for (size_t i = 0; i < e->n_sched; i++) {
        sched_seq *s = e->sched[i];
        if (s->sched_k <= 0) continue;
        if (s->prop_n == 0 || s->n_tokens - s->prop_n > 16) steady = false;
        s->prop_n = s->n_tokens;
        e->p_seqs[j] = s;
        e->p_ids[j] = s->id;
        e->p_k[j] = s->sched_k;
        e->p_temp[j] = sampler_is_greedy(&s->sp) ? 0.0f : s->sp.temperature;
        j++;
    }
    for (size_t t = 0; t < n * (size_t)k_max; t++) e->p_tok[t] = -1;
    specd_err err = {0};
    double t0 = engine_cost_clock(e);
    e->qdev = (spec_dev_q){.row = e->p_qrow};
    if ((qdev ? po->propose_dev(e->proposer->ctx, e->p_ids, e->p_k, (int32_t)n, k_max, e->p_temp, e->p_tok, &e->qdev,
                                &err)
              : po->propose(e->proposer->ctx, e->p_ids, e->p_k, (int32_t)n, k_max, e->p_temp, e->p_tok,
                            sampling ? e->p_q : NULL, &err)) != 0) {
        LOG_WARN("engine: proposer failed, verifying without drafts: %s", err.msg);
        return;
    }
    if (e->cfg.spec_adaptive && steady)
        spec_cost_observe_draft(&e->cost, (int32_t)n, (engine_cost_clock(e) - t0) / (double)k_max);
    for (size_t i = 0; i < n; i++) {
        sched_seq *s = e->p_seqs[i];
        int32_t nd = 0;
        while (nd < s->sched_k) {
            int32_t t = e->p_tok[i * (size_t)k_max + (size_t)nd];
            if (t < 0 || t >= V) break;
            s->draft[nd++] = t;
        }
        s->n_draft = nd;
        s->draft_q = sampling && !qdev ? e->p_q + i * (size_t)k_max * (size_t)V : NULL;
        s->draft_qrow = qdev ? e->p_qrow + i * (size_t)k_max : NULL;
        s->sched_new = 1 + nd;
    }
}

/* ---------------------------------------------------------------- proposer feed */

void spec_extend_computed(engine *e, sched_seq *s, int32_t pos0, int32_t n) {
    if (!e->proposer || !e->proposer->ops->extend || n <= 0) return;
    const float *aux = e->n_aux > 0 && !e->aux_on_dev
                           ? e->aux + (size_t)s->sched_t0 * (size_t)e->n_aux * (size_t)e->runner.hidden
                           : NULL;
    specd_err err = {0};
    double t0 = engine_now_s();
    /* row sched_t0 of the step is position pos0 (= n_computed when it was scheduled) */
    const spec_proposer_ops *po = e->proposer->ops;
    void *pc = e->proposer->ctx;
    const int32_t *tk = s->tokens + pos0;
    if ((e->feat_slots   ? po->extend_slots(pc, s->id, tk, n, pos0, s->sched_t0, s->kv.blocks, s->kv.n_blocks, &err)
         : e->aux_on_dev ? po->extend_rows(pc, s->id, tk, n, pos0, s->sched_t0, &err)
                         : po->extend(pc, s->id, tk, n, pos0, aux, &err)) != 0)
        LOG_DEBUG("engine: proposer extend (seq %lld, %d tokens at %d): %s", (long long)s->id, n, pos0, err.msg);
    e->t_draft_s += engine_now_s() - t0;
}

void spec_extend_sampled(engine *e, sched_seq *s, int32_t tok, int32_t pos) {
    if (!e->proposer || !e->proposer->ops->extend) return;
    specd_err err = {0};
    double t0 = engine_now_s();
    if (e->proposer->ops->extend(e->proposer->ctx, s->id, &tok, 1, pos, NULL, &err) != 0)
        LOG_DEBUG("engine: proposer extend (seq %lld, sampled at %d): %s", (long long)s->id, pos, err.msg);
    e->t_draft_s += engine_now_s() - t0;
}

/* ---------------------------------------------------------------- verify */

/* Emits one token chosen from logits ROW; returns the finish (FINISH_NONE = go on). */
static finish_reason emit(engine *e, sched_seq *s, int32_t tok, const float *row) {
    if (s->sp.logprobs >= 0 && grow((void **)&s->lp, &s->cap_lp, s->n_lp + 1, sizeof *s->lp) == 0)
        sampler_logprobs(row, e->runner.vocab, tok, s->sp.logprobs, &s->lp[s->n_lp++]);
    if (sched_append_token(s, tok) != 0) return FINISH_ERROR;
    e->gen_tokens++;
    return post_token(&s->post, &s->pp, &e->detok, tok, s->n_tokens, &s->delta);
}

void spec_verify_seq(engine *e, sched_seq *s) {
    const int32_t V = e->runner.vocab;
    const int32_t m = s->n_computed; /* position of x_m, the first verified token */
    const bool greedy = sampler_is_greedy(&s->sp);
    int32_t accepted = 0, last = -1;
    bool rejected = false;
    finish_reason fin = FINISH_NONE;
    for (int32_t j = 0; j <= s->n_draft && fin == FINISH_NONE; j++) {
        const float *row = e->logits + (size_t)(s->sched_out + j) * (size_t)V;
        bool suppress = s->post.n_out < s->pp.min_tokens;
        sampler_hist h = sched_hist(s);
        if (!suppress) {
            h.suppress = NULL;
            h.n_suppress = 0;
        }
        int32_t tok;
        bool ok = false;
        if (s->dev_sampled) { /* verified on the device (scheduler.c device_sample): the same rule's result */
            tok = s->dev_out[j];
            ok = j < s->dev_acc;
        } else if (j == s->n_draft) { /* every draft accepted: bonus token */
            tok = sampler_sample(e->sw, &s->sp, &h, &s->rng, row);
        } else if (greedy) {
            tok = sampler_sample(e->sw, &s->sp, &h, &s->rng, row); /* argmax, no RNG draw */
            ok = tok == s->draft[j];
        } else {
            sampler_probs(e->sw, &s->sp, &h, row, e->prob);
            const float *q = s->draft_q ? s->draft_q + (size_t)j * (size_t)V : NULL;
            ok = sampler_accept(e->prob, q, V, s->draft[j], &s->rng, e->sw, &tok) == 1;
        }
        fin = emit(e, s, tok, row);
        last = tok;
        if (ok) {
            accepted++;
            e->spec_per_pos[j < 16 ? j : 15]++;
        } else if (j < s->n_draft) {
            rejected = true;
            break; /* correction emitted */
        }
    }
    spec_accept_observe(&s->acc, s->n_draft, accepted, rejected);
    e->spec_drafts++;
    e->spec_draft_tokens += s->n_draft;
    e->spec_accepted += accepted;
    if (fin != FINISH_NONE) {
        sched_finish_seq(e, s, fin, fin == FINISH_ERROR ? "postprocess failed" : NULL);
        return;
    }
    /* commit x_m and the accepted drafts; rejected positions' KV is dead */
    s->n_computed = m + 1 + accepted;
    kv_seq_truncate(e->kv, &s->kv, s->n_computed);
    kv_seq_commit(e->kv, &s->kv, s->tokens, s->n_computed, NULL, 0);
    spec_extend_computed(e, s, m, 1 + accepted);
    spec_extend_sampled(e, s, last, s->n_tokens - 1);
    engine_push_output(e, s, NULL);
}
