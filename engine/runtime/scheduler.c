/*
 * scheduler.c: one engine step = schedule, run, postprocess (nano-vllm's
 * three-line step), on the engine thread.
 *
 * Policy (vLLM v1 style, one batch per step):
 *  - Running sequences first, oldest first: each gets the tokens it still
 *    needs (1 for decode; the rest of its prompt for a sequence whose prefill
 *    was chunked), capped by the step's token budget max_num_batched_tokens.
 *    If the KV pool cannot cover them, the NEWEST running sequence is
 *    preempted (blocks freed, recomputed later from its tokens, which include
 *    its outputs so far; it goes back to the FRONT of the waiting queue), until
 *    the allocation fits or the sequence preempted itself.
 *  - Then, if nothing was preempted in this step, waiting sequences in FCFS
 *    order while running < max_num_seqs, budget remains and the KV pool covers
 *    the first chunk; prefix-cache hits are counted first (they need no
 *    compute and no new blocks). The head of the queue blocks the rest (no
 *    overtaking).
 *  - Every scheduled token goes into ONE model_forward call (prefill chunks
 *    and decode tokens mixed); logits only for each sequence's last token,
 *    and only when that token is the last known one (a finished prefill or a
 *    decode).
 *  - Postprocess: KV commit (prefix-cache keys for full blocks), sampling with
 *    the request's own RNG, postprocess.c stop handling, one output delta per
 *    sequence per step; finished and aborted sequences free their blocks in
 *    the same step.
 *
 * Speculative decoding (spec.c): a decoding sequence with k > 0 reserves KV
 * for 1 + k positions here, all such sequences get their drafts from ONE
 * proposer call after scheduling, each contributes [x_m, d_1..d_k] with k + 1
 * logits rows to the same forward, and postprocess hands it to
 * spec_verify_seq (accept, bonus, KV rollback, proposer feed). Aux features
 * (model_batch.aux) are captured only when a proposer is attached.
 *
 * Threading: engine thread only (or the engine_step caller).
 */
#include "engine/runtime/engine_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/util/log.h"

/* ---------------------------------------------------------------- helpers */

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *np = realloc(*p, c * elem);
    if (!np) return -1;
    *p = np;
    *cap = c;
    return 0;
}

static int queue_insert(sched_seq ***q, size_t *n, size_t *cap, size_t at, sched_seq *s) {
    if (grow((void **)q, cap, *n + 1, sizeof **q) != 0) return -1;
    memmove(*q + at + 1, *q + at, (*n - at) * sizeof **q);
    (*q)[at] = s;
    (*n)++;
    return 0;
}

static void queue_remove_at(sched_seq **q, size_t *n, size_t at) {
    memmove(q + at, q + at + 1, (*n - at - 1) * sizeof *q);
    (*n)--;
}

/* ---------------------------------------------------------------- finish */

void sched_finish_seq(engine *e, sched_seq *s, finish_reason r, const char *error) {
    if (s->done) return;
    if (!s->post.finished) post_finish(&s->post, r, &s->delta);
    s->delta.finish = r;
    engine_push_output(e, s, error);
    kv_seq_free(e->kv, &s->kv);
    if (e->proposer && e->proposer->ops->free_seq) e->proposer->ops->free_seq(e->proposer->ctx, s->id);
    s->done = true;
    if (r >= 0 && r < 5) e->finished[r]++;
}

/* Drops done sequences from the waiting and running queues and frees them. */
static void reap(engine *e) {
    for (int pass = 0; pass < 2; pass++) {
        sched_seq **q = pass ? e->running : e->waiting;
        size_t *n = pass ? &e->n_running : &e->n_waiting;
        size_t j = 0;
        for (size_t i = 0; i < *n; i++) {
            if (q[i]->done) sched_seq_free(e, q[i]);
            else q[j++] = q[i];
        }
        *n = j;
    }
}

/* Moves submissions in and applies aborts (client gone, wait_idle timeout)
 * and the queue time limit (cfg.max_queue_time_s: a request never admitted
 * that long finishes with FINISH_ERROR and error_status 503, so an overloaded
 * server answers "retry later" instead of holding the client indefinitely;
 * sequences preempted back to the queue have started and are exempt). */
static void intake_and_aborts(engine *e) {
    pthread_mutex_lock(&e->mu);
    bool abort_all = e->abort_all;
    e->abort_all = false;
    size_t n_in = e->n_inbox;
    int rc = n_in ? grow((void **)&e->waiting, &e->cap_waiting, e->n_waiting + n_in, sizeof *e->waiting) : 0;
    if (rc == 0) {
        memcpy(e->waiting + e->n_waiting, e->inbox, n_in * sizeof *e->inbox);
        e->n_waiting += n_in;
        e->n_inbox = 0;
        /* still active in the published count until the step's engine_publish_stats: otherwise
         * engine_wait_idle (the SIGTERM drain) could see neither inbox nor active requests while
         * this step prefills them and emits their first tokens */
        e->n_active_pub += (int64_t)n_in;
    }
    pthread_mutex_unlock(&e->mu);
    for (int pass = 0; pass < 2; pass++) {
        sched_seq **q = pass ? e->running : e->waiting;
        size_t n = pass ? e->n_running : e->n_waiting;
        for (size_t i = 0; i < n; i++)
            if (abort_all || atomic_load(&q[i]->stream->aborted)) sched_finish_seq(e, q[i], FINISH_ABORT, NULL);
    }
    if (e->cfg.max_queue_time_s > 0) {
        const double now = engine_now_s();
        for (size_t i = 0; i < e->n_waiting; i++) {
            sched_seq *s = e->waiting[i];
            if (s->done || s->admitted_once || now - s->t_submit <= e->cfg.max_queue_time_s) continue;
            char msg[160];
            snprintf(msg, sizeof msg,
                     "the server is overloaded: the request waited %.1f s in the queue without starting "
                     "(--max-queue-time %g); retry later", now - s->t_submit, e->cfg.max_queue_time_s);
            s->error_status = 503;
            sched_finish_seq(e, s, FINISH_ERROR, msg);
            e->queue_timeouts++;
        }
    }
    reap(e);
}

/* ---------------------------------------------------------------- schedule */

/* Prompt-logprob sequences get at most this many tokens per step (each needs a
 * logits row of vocab floats). */
#define SCHED_PLP_CHUNK 256

static int32_t cap_chunk(const sched_seq *s, int32_t n_new) {
    if (s->prompt_logprobs && s->n_plp < s->n_prompt - 1 && n_new > SCHED_PLP_CHUNK) return SCHED_PLP_CHUNK;
    return n_new;
}


static void preempt(engine *e, sched_seq *s) {
    kv_seq_free(e->kv, &s->kv);
    s->n_computed = 0;
    if (e->proposer && e->proposer->ops->truncate) e->proposer->ops->truncate(e->proposer->ctx, s->id, 0);
    e->preemptions++;
    LOG_DEBUG("sched: preempted seq %lld (%d tokens) for recompute", (long long)s->id, s->n_tokens);
}

static int add_sched(engine *e, sched_seq *s, int32_t n_new, int32_t k) {
    if (grow((void **)&e->sched, &e->cap_sched, e->n_sched + 1, sizeof *e->sched) != 0) return -1;
    s->sched_new = n_new;
    s->sched_k = k;
    s->n_draft = 0;
    s->sched_out = -1;
    e->sched[e->n_sched++] = s;
    return 0;
}

static void schedule(engine *e) {
    int32_t budget = e->cfg.max_num_batched_tokens;
    bool preempted = false;
    e->n_sched = 0;
    if (e->proposer && e->cfg.spec_adaptive) spec_adapt_begin_step(e);

    /* running sequences, oldest first */
    for (size_t i = 0; i < e->n_running && budget > 0;) {
        sched_seq *s = e->running[i];
        int32_t n_new = cap_chunk(s, s->n_tokens - s->n_computed);
        if (n_new > budget) n_new = budget;
        int32_t k = spec_plan_k(e, s, budget); /* decode + k drafts to verify (spec.c) */
        bool self_preempted = false;
        while (kv_seq_ensure(e->kv, &s->kv, s->n_computed + n_new + k, NULL) != 0) {
            sched_seq *victim = e->running[e->n_running - 1];
            e->n_running--;
            preempt(e, victim);
            queue_insert(&e->waiting, &e->n_waiting, &e->cap_waiting, 0, victim);
            preempted = true;
            if (victim == s) {
                self_preempted = true;
                break;
            }
        }
        if (self_preempted) break;
        if (add_sched(e, s, n_new, k) != 0) break;
        budget -= n_new + k;
        i++;
    }

    /* waiting sequences, FCFS */
    while (!preempted && e->n_waiting > 0 && budget > 0 && e->n_running < (size_t)e->cfg.max_num_seqs) {
        sched_seq *s = e->waiting[0];
        int32_t hit = 0;
        /* no hits for prompt logprobs (cached blocks have no logits), nor for a
         * speculating sequence when no aux features are cached (spec.c) */
        if (s->n_computed == 0 && !s->prompt_logprobs && (s->k == 0 || spec_prefix_hits_ok(e)))
            hit = kv_seq_match_prefix(e->kv, &s->kv, s->tokens, s->n_tokens, NULL, 0);
        int32_t n_new = cap_chunk(s, s->n_tokens - hit);
        if (n_new > budget) n_new = budget;
        if (kv_seq_ensure(e->kv, &s->kv, hit + n_new, NULL) != 0) {
            kv_seq_free(e->kv, &s->kv); /* give the hit blocks back; retry next step */
            break;
        }
        if (grow((void **)&e->running, &e->cap_running, e->n_running + 1, sizeof *e->running) != 0) break;
        s->n_computed = hit;
        if (!s->admitted_once) {
            s->admitted_once = true;
            if (e->proposer && e->proposer->ops->seed_seq)
                e->proposer->ops->seed_seq(e->proposer->ctx, s->id, s->draft_seed);
            s->n_cached_prompt = hit < s->n_prompt ? hit : s->n_prompt;
            e->prompt_tokens += s->n_prompt;
            e->pc_queries += kv_prefix_caching(e->kv) ? s->n_tokens : 0;
            e->pc_hits += hit;
        }
        if (hit > 0) spec_feed_prefix_hit(e, s, hit);
        queue_remove_at(e->waiting, &e->n_waiting, 0);
        e->running[e->n_running++] = s;
        if (add_sched(e, s, n_new, 0) != 0) break;
        budget -= n_new;
    }
    if (e->proposer) {
        double t0 = engine_now_s();
        spec_propose(e);
        double dt = engine_now_s() - t0;
        e->t_draft_s += dt;
        e->t_propose_s += dt;
    }
}

/* ---------------------------------------------------------------- run */

static int run_batch(engine *e, specd_err *err) {
    size_t n_tok = 0;
    for (size_t i = 0; i < e->n_sched; i++) n_tok += (size_t)e->sched[i]->sched_new;
    if (grow((void **)&e->b_tok, &e->cap_batch, n_tok, sizeof *e->b_tok) != 0) goto oom;
    size_t cap = e->cap_batch;
    int32_t *np = realloc(e->b_pos, cap * sizeof *np);
    if (!np) goto oom;
    e->b_pos = np;
    np = realloc(e->b_seq_of, cap * sizeof *np);
    if (!np) goto oom;
    e->b_seq_of = np;
    np = realloc(e->b_out, cap * sizeof *np);
    if (!np) goto oom;
    e->b_out = np;
    if (grow((void **)&e->b_tables, &e->cap_seqs, e->n_sched, sizeof *e->b_tables) != 0) goto oom;

    /* tokens of each sequence contiguous; logits rows: its prompt-logprob
     * positions (if any), then its sampling row (if its last known token is in) */
    size_t t = 0, n_out = 0;
    for (size_t i = 0; i < e->n_sched; i++) {
        sched_seq *s = e->sched[i];
        size_t t0 = t;
        s->sched_t0 = (int32_t)t;
        e->b_tables[i] = s->kv.blocks;
        for (int32_t j = 0; j < s->sched_new; j++, t++) {
            int32_t pos = s->n_computed + j;
            e->b_tok[t] = j > 0 && s->n_draft > 0 ? s->draft[j - 1] : s->tokens[pos];
            e->b_pos[t] = pos;
            e->b_seq_of[t] = (int32_t)i;
        }
        s->sched_plp_n = 0;
        if (s->prompt_logprobs) {
            int32_t lo = s->n_computed > s->n_plp ? s->n_computed : s->n_plp;
            int32_t hi = s->n_computed + s->sched_new;
            if (hi > s->n_prompt - 1) hi = s->n_prompt - 1;
            if (hi > lo) {
                s->sched_plp_row = (int32_t)n_out;
                s->sched_plp_pos = lo;
                s->sched_plp_n = hi - lo;
                for (int32_t p = lo; p < hi; p++) e->b_out[n_out++] = (int32_t)(t0 + (size_t)(p - s->n_computed));
            }
        }
        s->sched_out = -1;
        if (s->n_draft > 0) { /* verify: a row for x_m and every draft */
            s->sched_out = (int32_t)n_out;
            for (int32_t j = 0; j <= s->n_draft; j++) e->b_out[n_out++] = (int32_t)t0 + j;
        } else if (s->n_computed + s->sched_new == s->n_tokens) {
            s->sched_out = (int32_t)n_out;
            e->b_out[n_out++] = (int32_t)t - 1;
        }
    }
    if (e->n_aux > 0 && n_tok > e->cap_aux_rows) {
        float *na = realloc(e->aux, n_tok * (size_t)e->n_aux * (size_t)e->runner.hidden * sizeof *na);
        if (!na) goto oom;
        e->aux = na;
        e->cap_aux_rows = n_tok;
    }
    if (n_out > e->cap_logits_rows) {
        float *nl = realloc(e->logits, n_out * (size_t)e->runner.vocab * sizeof *nl);
        if (!nl) goto oom;
        e->logits = nl;
        e->cap_logits_rows = n_out;
    }
    model_batch b = {
        .n_tokens = (int32_t)n_tok,
        .tokens = e->b_tok,
        .pos = e->b_pos,
        .seq_of = e->b_seq_of,
        .n_seqs = (int32_t)e->n_sched,
        .block_tables = e->b_tables,
        .tree_mask = NULL,
        .n_out = (int32_t)n_out,
        .out_idx = e->b_out,
        .logits = e->logits,
        .n_aux = e->n_aux,
        .aux_layers = e->n_aux > 0 ? e->aux_layers : NULL,
        .aux = e->n_aux > 0 ? e->aux : NULL,
    };
    double t0 = engine_cost_clock(e);
    int rc = e->runner.forward(e->runner.ctx, &b, err);
    e->t_last_forward_s = engine_cost_clock(e) - t0;
    return rc;
oom:
    return specd_err_set(err, "engine: out of memory building a batch of %zu tokens", n_tok);
}

/* ---------------------------------------------------------------- postprocess */

int sched_append_token(sched_seq *s, int32_t tok) {
    if (s->n_tokens + 1 > s->cap_tokens) {
        int32_t c = s->cap_tokens ? s->cap_tokens * 2 : 64;
        int32_t *nt = realloc(s->tokens, (size_t)c * sizeof *nt);
        if (!nt) return -1;
        s->tokens = nt;
        s->cap_tokens = c;
    }
    s->tokens[s->n_tokens++] = tok;
    return 0;
}

/* History for penalties: prompt, outputs so far, and the min_tokens mask. */
sampler_hist sched_hist(const sched_seq *s) {
    bool suppress = s->post.n_out < s->pp.min_tokens;
    sampler_hist h = {
        .prompt = s->tokens, .n_prompt = (size_t)s->n_prompt,
        .output = s->tokens + s->n_prompt, .n_output = (size_t)(s->n_tokens - s->n_prompt),
        .suppress = suppress ? s->suppress : NULL, .n_suppress = suppress ? s->n_suppress : 0,
    };
    return h;
}

static void postprocess(engine *e) {
    const int32_t V = e->runner.vocab;
    for (size_t i = 0; i < e->n_sched; i++) {
        sched_seq *s = e->sched[i];
        if (s->n_draft > 0) { /* speculative verify */
            spec_verify_seq(e, s);
            continue;
        }
        int32_t pos0 = s->n_computed;
        s->n_computed += s->sched_new;
        kv_seq_commit(e->kv, &s->kv, s->tokens, s->n_computed, NULL, 0);
        spec_extend_computed(e, s, pos0, s->sched_new);
        for (int32_t j = 0; j < s->sched_plp_n; j++) {
            int32_t p = s->sched_plp_pos + j;
            sampler_logprobs(e->logits + (size_t)(s->sched_plp_row + j) * (size_t)V, V, s->tokens[p + 1],
                             s->sp.logprobs > 0 ? s->sp.logprobs : 0, &s->plp[p]);
            s->n_plp = p + 1;
        }
        if (s->sched_out < 0) continue; /* mid-prefill chunk */
        const float *row = e->logits + (size_t)s->sched_out * (size_t)V;
        sampler_hist h = sched_hist(s);
        int32_t tok = sampler_sample(e->sw, &s->sp, &h, &s->rng, row);
        if (s->sp.logprobs >= 0) {
            if (grow((void **)&s->lp, &s->cap_lp, s->n_lp + 1, sizeof *s->lp) == 0)
                sampler_logprobs(row, V, tok, s->sp.logprobs, &s->lp[s->n_lp++]);
        }
        if (sched_append_token(s, tok) != 0) {
            sched_finish_seq(e, s, FINISH_ERROR, "out of memory");
            continue;
        }
        e->gen_tokens++;
        finish_reason r = post_token(&s->post, &s->pp, &e->detok, tok, s->n_tokens, &s->delta);
        if (r != FINISH_NONE) {
            sched_finish_seq(e, s, r, r == FINISH_ERROR ? "postprocess failed" : NULL);
            continue;
        }
        spec_extend_sampled(e, s, tok, s->n_tokens - 1);
        engine_push_output(e, s, NULL);
    }
}

/* ---------------------------------------------------------------- step */

int sched_step(engine *e, specd_err *err) {
    intake_and_aborts(e);
    schedule(e);
    int n = (int)e->n_sched;
    if (e->last_ids) {
        free(e->last_ids);
        free(e->last_n);
    }
    e->last_ids = n ? malloc((size_t)n * sizeof *e->last_ids) : NULL;
    e->last_n = n ? malloc((size_t)n * sizeof *e->last_n) : NULL;
    for (int i = 0; i < n && e->last_ids && e->last_n; i++) {
        e->last_ids[i] = e->sched[i]->id;
        e->last_n[i] = e->sched[i]->sched_new;
    }
    int rc = 0;
    if (n > 0) {
        specd_err local = {0};
        bool verify = false;
        for (size_t i = 0; i < e->n_sched; i++) verify |= e->sched[i]->n_draft > 0;
        e->t_last_forward_s = 0;
        int frc = run_batch(e, &local);
        double dt = e->t_last_forward_s;
        e->t_forward_s += dt;
        if (verify) e->t_verify_forward_s += dt, e->verify_steps++;
        if (frc == 0 && e->proposer && e->cfg.spec_adaptive) spec_adapt_after_forward(e, dt);
        if (frc != 0) {
            LOG_ERROR("engine: step failed: %s", local.msg);
            for (size_t i = 0; i < e->n_sched; i++) sched_finish_seq(e, e->sched[i], FINISH_ERROR, local.msg);
            if (err) *err = local;
            rc = -1;
        } else {
            spec_aux_store(e);
            postprocess(e);
        }
        e->steps++;
    }
    reap(e);
    engine_publish_stats(e);
    return rc < 0 ? rc : n;
}
