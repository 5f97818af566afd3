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
 * Sampling on the device (runner.sample_be, a backend that is not
 * host-visible): the forward leaves the logits on the device; run_batch puts
 * the rows sampled there first (plan_out_rows), then the raw rows only the
 * host reads (prompt logprobs, chains of sampling requests whose draft gave
 * q rows on the HOST; a draft whose q stayed on the device, propose_dev, is
 * verified there); device_sample downloads those, describes every other row
 * (parameters, history, min_tokens mask, logit_bias, and the uniform drawn
 * from the request's own RNG exactly as sampler_sample / sampler_accept would
 * draw it) and makes ONE bk_ops.sample call; postprocess and spec_verify_seq
 * then consume its ids / accepted counts instead of sampling. So a seed gives
 * the same tokens on every backend, and only ids and counts cross the bus
 * unless a request asked for logprobs.
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
        /* and still waiting in the count engine_submit checks --max-waiting against: without this, a submission
         * between this move and the step's publish saw inbox 0 + the old waiting count, and an n = 3 request
         * meant to be refused (one slot left) was admitted whole on a slow step (reliability_overload in CI) */
        e->n_waiting_pub += (int64_t)n_in;
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

/* A sampling sequence verified with draft distributions (q rows) on a device-sampling engine: its
 * chain is verified on the host over downloaded rows (the draft's q rows are on the host: a proposer
 * without propose_dev, or whose q is not on sample_be; with propose_dev draft_q is NULL and the chain is
 * verified on the device against draft_qrow's device rows). */
static bool ds_on_host(const sched_seq *s) { return s->n_draft > 0 && !sampler_is_greedy(&s->sp) && s->draft_q; }

/* Logits rows for S's prompt-logprob positions of this step (if any), from *n_out on. */
static void plan_plp_rows(engine *e, sched_seq *s, size_t *n_out) {
    if (!s->prompt_logprobs) return;
    const size_t t0 = (size_t)s->sched_t0;
    int32_t lo = s->n_computed > s->n_plp ? s->n_computed : s->n_plp;
    int32_t hi = s->n_computed + s->sched_new;
    if (hi > s->n_prompt - 1) hi = s->n_prompt - 1;
    if (hi > lo) {
        s->sched_plp_row = (int32_t)*n_out;
        s->sched_plp_pos = lo;
        s->sched_plp_n = hi - lo;
        for (int32_t p = lo; p < hi; p++) e->b_out[(*n_out)++] = (int32_t)(t0 + (size_t)(p - s->n_computed));
    }
}

/* S's sampling row (its last token, when it is the last known one), or its verify rows. */
static void plan_out_rows(engine *e, sched_seq *s, size_t *n_out) {
    const int32_t t0 = s->sched_t0;
    if (s->n_draft > 0) { /* verify: a row for x_m and every draft */
        s->sched_out = (int32_t)*n_out;
        for (int32_t j = 0; j <= s->n_draft; j++) e->b_out[(*n_out)++] = t0 + j;
    } else if (s->n_computed + s->sched_new == s->n_tokens) {
        s->sched_out = (int32_t)*n_out;
        e->b_out[(*n_out)++] = t0 + s->sched_new - 1;
    }
}

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
     * positions (if any), then its sampling row (if its last known token is in);
     * with device sampling, every sequence's device-sampled rows first, then the
     * rows the host reads */
    size_t t = 0, n_out = 0;
    const bool dev = e->runner.sample_be != NULL;
    for (size_t i = 0; i < e->n_sched; i++) {
        sched_seq *s = e->sched[i];
        s->sched_t0 = (int32_t)t;
        e->b_tables[i] = s->kv.blocks;
        for (int32_t j = 0; j < s->sched_new; j++, t++) {
            int32_t pos = s->n_computed + j;
            e->b_tok[t] = j > 0 && s->n_draft > 0 ? s->draft[j - 1] : s->tokens[pos];
            e->b_pos[t] = pos;
            e->b_seq_of[t] = (int32_t)i;
        }
        s->sched_plp_n = 0;
        s->sched_out = -1;
        if (!dev) {
            plan_plp_rows(e, s, &n_out);
            plan_out_rows(e, s, &n_out);
        } else if (!ds_on_host(s)) {
            plan_out_rows(e, s, &n_out); /* device sampling: the rows it samples first, contiguous */
        }
    }
    if (dev) /* then the raw rows only the host reads (prompt logprobs, chains verified on the host) */
        for (size_t i = 0; i < e->n_sched; i++) {
            plan_plp_rows(e, e->sched[i], &n_out);
            if (ds_on_host(e->sched[i])) plan_out_rows(e, e->sched[i], &n_out);
        }
    if (e->n_aux > 0 && !e->aux_on_dev && n_tok > e->cap_aux_rows) {
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
        .logits = e->runner.sample_be ? NULL : e->logits,
        .logits_dev = e->runner.sample_be ? &e->logits_dev : NULL,
        .n_aux = e->n_aux,
        .aux_layers = e->n_aux > 0 ? e->aux_layers : NULL,
        .aux = e->n_aux > 0 && !e->aux_on_dev ? e->aux : NULL,
        .aux_on_device = e->n_aux > 0 && e->aux_on_dev, /* left for the draft in the model's device buffer */
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

/* ---------------------------------------------------------------- device sampling */

/* Raw rows [row0, row0 + n) of the device logits into e->logits (same rows). */
static int ds_download_rows(engine *e, int32_t row0, int32_t n) {
    if (n <= 0) return 0;
    backend *be = e->runner.sample_be;
    const size_t V = (size_t)e->runner.vocab;
    return be->ops->download(be->ctx, e->logits + (size_t)row0 * V,
                             (const float *)e->logits_dev.data + (size_t)row0 * V, (size_t)n * V * sizeof(float));
}

/* One row's description: S's parameters, the history PROMPT ids + N_OUT outputs in HIST, the min_tokens
 * mask as if J more tokens had been emitted, and the uniform U. */
static bk_sample_row ds_row(const sched_seq *s, const int32_t *hist, int32_t n_out, int32_t j, double u) {
    const sampling_params *sp = &s->sp;
    const bool pen = (sp->repetition_penalty > 0.0f && sp->repetition_penalty != 1.0f) ||
                     sp->frequency_penalty != 0.0f || sp->presence_penalty != 0.0f;
    const bool supp = s->post.n_out + j < s->pp.min_tokens;
    const int32_t n_output = n_out; /* outputs so far, drafts 1..j included */
    const size_t o = (size_t)n_output;
    bk_sample_row r = {
        .temperature = sp->temperature, .top_p = sp->top_p, .min_p = sp->min_p,
        .presence_penalty = sp->presence_penalty, .frequency_penalty = sp->frequency_penalty,
        .repetition_penalty = sp->repetition_penalty, .top_k = sp->top_k,
        .forced = o < sp->n_forced_ids && sp->forced_ids[o] >= 0 ? sp->forced_ids[o] : -1,
        .hist = pen ? hist : NULL, .n_prompt = pen ? s->n_prompt : 0, .n_output = pen ? n_output : 0,
        .suppress = supp ? s->suppress : NULL, .n_suppress = supp ? (int32_t)s->n_suppress : 0,
        .bias_ids = sp->logit_bias_ids, .bias = sp->logit_bias, .n_bias = (int32_t)sp->n_logit_bias,
        .u = u,
    };
    return r;
}

/* Samples this step's rows on the device (runner.sample_be): downloads first the raw rows the host still
 * needs (prompt logprobs, logprobs, chains verified on the host), then ONE bk_ops.sample call for every
 * other sequence's rows; their results land in dev_tok / dev_acc / dev_out, and each sequence's RNG
 * advances by exactly the uniforms the host sampler would have drawn. */
static int device_sample(engine *e, specd_err *err) {
    backend *be = e->runner.sample_be;
    size_t n_rows = 0, n_vs = 0, n_u = 0, n_hist = 0;
    for (size_t i = 0; i < e->n_sched; i++) {
        sched_seq *s = e->sched[i];
        s->dev_sampled = false;
        if (s->sched_plp_n > 0 && ds_download_rows(e, s->sched_plp_row, s->sched_plp_n) < 0) goto dev_fail;
        if (s->sched_out < 0) continue;
        const int32_t nr = 1 + s->n_draft;
        if (ds_on_host(s) || s->sp.logprobs >= 0) /* raw rows: host verification, or logprobs of emitted tokens */
            if (ds_download_rows(e, s->sched_out, nr) < 0) goto dev_fail;
        if (ds_on_host(s)) continue;
        n_rows += (size_t)nr;
        if (s->n_draft > 0) n_vs++, n_u += (size_t)s->n_draft + 2, n_hist += (size_t)(s->n_tokens + s->n_draft);
    }
    if (n_rows == 0) return 0;
    if (grow((void **)&e->ds_rows, &e->cap_ds_rows, n_rows, sizeof *e->ds_rows) != 0) goto oom;
    size_t cap = e->cap_ds_rows;
    int32_t *ni = realloc(e->ds_ids, cap * sizeof *ni);
    if (!ni) goto oom;
    e->ds_ids = ni;
    if (n_vs > 0) {
        if (grow((void **)&e->ds_vs, &e->cap_ds_vs, n_vs, sizeof *e->ds_vs) != 0) goto oom;
        cap = e->cap_ds_vs;
        int32_t *na = realloc(e->ds_acc, cap * sizeof *na), *nt;
        if (!na) goto oom;
        e->ds_acc = na;
        if (!(nt = realloc(e->ds_vtok, cap * 16 * sizeof *nt))) goto oom;
        e->ds_vtok = nt;
        sched_seq **nq = realloc(e->ds_vseq, cap * sizeof *nq);
        if (!nq) goto oom;
        e->ds_vseq = nq;
        if (grow((void **)&e->ds_u, &e->cap_ds_u, n_u, sizeof *e->ds_u) != 0) goto oom;
        if (grow((void **)&e->ds_qp, &e->cap_ds_qp, n_vs * 16, sizeof *e->ds_qp) != 0) goto oom;
        if (grow((void **)&e->ds_hist, &e->cap_ds_hist, n_hist, sizeof *e->ds_hist) != 0) goto oom;
    }
    size_t r = 0, v = 0, ou = 0, oh = 0;
    for (size_t i = 0; i < e->n_sched; i++) {
        sched_seq *s = e->sched[i];
        if (s->sched_out < 0 || ds_on_host(s)) continue;
        const bool greedy = sampler_is_greedy(&s->sp);
        const int32_t n_out = s->n_tokens - s->n_prompt;
        if (s->n_draft == 0) { /* one draw, as sampler_sample makes (none when greedy) */
            e->ds_rows[r++] = ds_row(s, s->tokens, n_out, 0, greedy ? 0.0 : sampler_rng_uniform(&s->rng));
            continue;
        }
        /* the chain's history: tokens then the drafts (row j sees drafts 1..j, as spec_verify_seq appends them) */
        int32_t *h = e->ds_hist + oh;
        memcpy(h, s->tokens, (size_t)s->n_tokens * sizeof *h);
        memcpy(h + s->n_tokens, s->draft, (size_t)s->n_draft * sizeof *h);
        oh += (size_t)(s->n_tokens + s->n_draft);
        double *u = e->ds_u + ou;
        ou += (size_t)s->n_draft + 2;
        sampler_rng peek = s->rng; /* the next n_draft + 2 uniforms; s->rng advances by those used, below */
        for (int32_t j = 0; j < s->n_draft + 2; j++) u[j] = greedy ? 0.0 : sampler_rng_uniform(&peek);
        e->ds_vs[v] = (bk_verify_seq){.row0 = (int32_t)r, .n_draft = s->n_draft, .draft = s->draft,
                                      .greedy = greedy, .u = u};
        if (!greedy && s->draft_qrow) { /* the draft's q rows where propose_dev left them (device pointers) */
            const float **qp = e->ds_qp + (size_t)v * 16;
            for (int32_t j = 0; j < s->n_draft; j++)
                qp[j] = s->draft_qrow[j] >= 0 ? e->qdev.q + (size_t)s->draft_qrow[j] * (size_t)e->qdev.q_vocab : NULL;
            e->ds_vs[v].q = qp, e->ds_vs[v].q_vocab = e->qdev.q_vocab, e->ds_vs[v].t2d = e->qdev.t2d;
        }
        e->ds_vseq[v++] = s;
        for (int32_t j = 0; j <= s->n_draft; j++) e->ds_rows[r++] = ds_row(s, h, n_out + j, j, 0.0);
    }
    /* run_batch put the rows sampled here first, in this order (plan_out_rows); checked */
    bk_tensor lg = e->logits_dev;
    bool compact = true;
    {
        size_t rr = 0;
        for (size_t i = 0; i < e->n_sched && compact; i++) {
            const sched_seq *s = e->sched[i];
            if (s->sched_out < 0 || ds_on_host(s)) continue;
            compact = s->sched_out == (int32_t)rr;
            rr += (size_t)(1 + s->n_draft);
        }
    }
    if (!compact) {
        specd_err_set(err, "engine: device sampling: the sampled rows are not the first ones (internal error)");
        goto fail_rows;
    }
    if (be->ops->sample(be->ctx, &lg, e->ds_rows, (int32_t)n_rows, e->ds_vs, (int32_t)n_vs, e->ds_ids, e->ds_acc,
                        e->ds_vtok) < 0)
        goto dev_fail;
    r = 0, v = 0;
    for (size_t i = 0; i < e->n_sched; i++) {
        sched_seq *s = e->sched[i];
        if (s->sched_out < 0 || ds_on_host(s)) continue;
        s->dev_sampled = true;
        if (s->n_draft == 0) {
            s->dev_tok = e->ds_ids[r++];
            continue;
        }
        const int32_t a = e->ds_acc[v];
        memcpy(s->dev_out, e->ds_vtok + (size_t)v * 16, (size_t)(a + 1) * sizeof *s->dev_out);
        s->dev_acc = a;
        if (!sampler_is_greedy(&s->sp)) /* the CPU's draws: one per accepted draft, then 2 (rejection) or 1 (bonus) */
            for (int32_t k = 0; k < a + (a < s->n_draft ? 2 : 1); k++) (void)sampler_rng_uniform(&s->rng);
        v++;
        r += (size_t)(1 + s->n_draft);
    }
    return 0;
oom:
    return specd_err_set(err, "engine: out of memory describing %zu sampling rows", n_rows);
dev_fail:
    /* the backend's own reason (review finding F5): it reaches the requests' error and the step's log line */
    return specd_err_set(err, "engine: %s backend: device sampling failed: %s", be->name,
                         be->ops->last_error ? be->ops->last_error(be->ctx) : "(the backend gives no reason)");
fail_rows:
    return -1;
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
        const float *row = e->logits + (size_t)s->sched_out * (size_t)V; /* device sampling: only if logprobs */
        sampler_hist h = sched_hist(s);
        int32_t tok = s->dev_sampled ? s->dev_tok : sampler_sample(e->sw, &s->sp, &h, &s->rng, row);
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
        } else if (e->runner.sample_be && device_sample(e, &local) < 0) {
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
