/*
 * engine.c: the engine object, its thread, request submission and
 * validation, the per-request output streams, drain / wait_idle and the stats
 * snapshot. One step of work is scheduler.c's sched_step.
 *
 * Threading (see engine_internal.h for the lock rules): HTTP threads call
 * engine_submit / engine_stream_* / engine_get_stats; the engine thread runs
 * engine_main, sleeping on e->cv while it has nothing to do (timed, 1 s, so
 * engine_loop_age_s stays fresh for the watchdog) and waking on a submission,
 * an abort, a drain timeout or stop.
 *
 * Stream lifetime: refs = 2 at submit (caller + engine). The engine drops its
 * ref when the sequence is freed (after its final output); the caller drops
 * its ref with engine_stream_release, which also aborts a still-running
 * request and waits for an in-flight notify callback to return, so the
 * caller may free notify_arg right after release.
 */
#include "engine/runtime/engine_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/util/log.h"

double engine_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void abs_deadline(struct timespec *ts, double after_s) {
    clock_gettime(CLOCK_REALTIME, ts);
    double t = (double)ts->tv_nsec * 1e-9 + after_s;
    time_t whole = (time_t)t;
    ts->tv_sec += whole;
    ts->tv_nsec = (long)((t - (double)whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

void sampling_params_init(sampling_params *sp) {
    memset(sp, 0, sizeof *sp);
    sp->temperature = 1.0f;
    sp->top_p = 1.0f;
    sp->top_k = -1;
    sp->repetition_penalty = 1.0f;
    sp->max_tokens = 16;
    sp->logprobs = -1;
    sp->skip_special_tokens = true;
    sp->num_speculative_tokens = -1;
}

void engine_output_free(engine_output *o) {
    if (!o) return;
    free(o->token_ids);
    free(o->logprobs);
    free(o->prompt_logprobs);
    free(o->text);
    free(o);
}

/* ---------------------------------------------------------------- streams */

static void stream_unref(engine_stream *s) {
    pthread_mutex_lock(&s->mu);
    bool last = --s->refs == 0;
    pthread_mutex_unlock(&s->mu);
    if (!last) return;
    for (size_t i = 0; i < s->q_len; i++) engine_output_free(s->q[(s->q_head + i) % s->q_cap]);
    free(s->q);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

static int stream_push(engine_stream *s, engine_output *o) {
    pthread_mutex_lock(&s->mu);
    if (s->final_pushed) {
        pthread_mutex_unlock(&s->mu);
        engine_output_free(o);
        return 0;
    }
    if (s->q_len == s->q_cap) {
        size_t c = s->q_cap ? s->q_cap * 2 : 8;
        engine_output **nq = malloc(c * sizeof *nq);
        if (!nq) {
            pthread_mutex_unlock(&s->mu);
            engine_output_free(o);
            return -1;
        }
        for (size_t i = 0; i < s->q_len; i++) nq[i] = s->q[(s->q_head + i) % s->q_cap];
        free(s->q);
        s->q = nq;
        s->q_cap = c;
        s->q_head = 0;
    }
    s->q[(s->q_head + s->q_len) % s->q_cap] = o;
    s->q_len++;
    if (o->finish != FINISH_NONE) s->final_pushed = true;
    pthread_cond_broadcast(&s->cv);
    void (*notify)(void *) = s->notify;
    void *arg = s->notify_arg;
    if (notify) s->notifying++;
    pthread_mutex_unlock(&s->mu);
    if (notify) {
        notify(arg);
        pthread_mutex_lock(&s->mu);
        s->notifying--;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
    return 0;
}

void engine_push_output(engine *e, sched_seq *s, const char *error) {
    post_delta *d = &s->delta;
    if (d->n_tokens == 0 && d->finish == FINISH_NONE && !error) return;
    engine_output *o = calloc(1, sizeof *o);
    if (!o) goto done;
    o->n_tokens = d->n_tokens;
    if (d->n_tokens) {
        o->token_ids = malloc(d->n_tokens * sizeof *o->token_ids);
        if (o->token_ids) memcpy(o->token_ids, d->tokens, d->n_tokens * sizeof *o->token_ids);
        else o->n_tokens = 0;
    }
    if (s->n_lp && s->n_lp >= o->n_tokens && o->n_tokens) {
        o->logprobs = malloc(o->n_tokens * sizeof *o->logprobs);
        if (o->logprobs) memcpy(o->logprobs, s->lp, o->n_tokens * sizeof *o->logprobs);
    }
    o->text = malloc(d->text_len + 1);
    if (o->text) {
        memcpy(o->text, d->text ? d->text : "", d->text_len);
        o->text[d->text_len] = '\0';
        o->text_len = d->text_len;
    }
    o->finish = d->finish;
    snprintf(o->stop_reason, sizeof o->stop_reason, "%s", d->stop_reason);
    o->stop_token_id = d->stop_token_id;
    o->error_status = s->error_status;
    o->n_prompt_tokens = s->n_prompt;
    o->n_completion_tokens = s->post.n_out;
    o->n_cached_prompt_tokens = s->n_cached_prompt;
    if (!s->first_output_sent) {
        s->first_output_sent = true;
        o->ttft_s = engine_now_s() - s->t_submit;
    }
    if (error) snprintf(o->error, sizeof o->error, "%s", error);
    if (s->plp && !s->plp_sent && s->n_plp == s->n_prompt - 1 && o->n_tokens) {
        o->prompt_logprobs = s->plp; /* ownership moves to the output */
        o->n_prompt_logprobs = (size_t)s->n_plp;
        s->plp = NULL;
        s->plp_sent = true;
    }
    /* A client that reads /metrics right after its final chunk must see its
     * tokens counted: publish before the final output becomes visible. */
    if (o->finish != FINISH_NONE) engine_publish_stats(e);
    stream_push(s->stream, o);
done:
    post_delta_reset(d);
    s->n_lp = 0;
}

int engine_stream_poll(engine_stream *s, engine_output **out) {
    pthread_mutex_lock(&s->mu);
    int got = 0;
    if (s->q_len) {
        *out = s->q[s->q_head];
        s->q_head = (s->q_head + 1) % s->q_cap;
        s->q_len--;
        got = 1;
    }
    pthread_mutex_unlock(&s->mu);
    return got;
}

int engine_stream_wait(engine_stream *s, engine_output **out, double timeout_s) {
    struct timespec dl;
    if (timeout_s >= 0) abs_deadline(&dl, timeout_s);
    pthread_mutex_lock(&s->mu);
    while (s->q_len == 0) {
        int rc = timeout_s < 0 ? pthread_cond_wait(&s->cv, &s->mu) : pthread_cond_timedwait(&s->cv, &s->mu, &dl);
        if (rc == ETIMEDOUT) break;
    }
    int got = 0;
    if (s->q_len) {
        *out = s->q[s->q_head];
        s->q_head = (s->q_head + 1) % s->q_cap;
        s->q_len--;
        got = 1;
    }
    pthread_mutex_unlock(&s->mu);
    return got;
}

void engine_stream_abort(engine_stream *s) {
    if (!s) return;
    atomic_store(&s->aborted, true);
    pthread_mutex_lock(&s->mu);
    engine *e = s->eng;
    if (e) {
        pthread_mutex_lock(&e->mu);
        e->wake = true;
        pthread_cond_signal(&e->cv);
        pthread_mutex_unlock(&e->mu);
    }
    pthread_mutex_unlock(&s->mu);
}

void engine_stream_release(engine_stream *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->notify = NULL;
    while (s->notifying > 0) pthread_cond_wait(&s->cv, &s->mu);
    bool done = s->final_pushed;
    pthread_mutex_unlock(&s->mu);
    if (!done) engine_stream_abort(s);
    stream_unref(s);
}

int64_t engine_stream_seq_id(const engine_stream *s) { return s->seq_id; }

/* ---------------------------------------------------------------- sequences */

void sched_seq_free(engine *e, sched_seq *s) {
    if (!s) return;
    kv_seq_free(e->kv, &s->kv);
    post_free(&s->post);
    post_params_free(&s->pp);
    post_delta_free(&s->delta);
    free(s->lp);
    free(s->plp);
    free(s->tokens);
    free(s->suppress);
    free(s->bias_ids);
    free(s->bias);
    free(s->forced);
    if (s->stream) {
        pthread_mutex_lock(&s->stream->mu);
        s->stream->eng = NULL;
        pthread_mutex_unlock(&s->stream->mu);
        stream_unref(s->stream);
    }
    free(s);
}

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* ---------------------------------------------------------------- submit */

static int validate(const engine *e, const engine_request *r, specd_err *err) {
    const sampling_params *sp = &r->sp;
    const int32_t V = e->runner.vocab, L = e->cfg.max_model_len;
    if (!r->prompt || r->n_prompt == 0) return specd_err_set(err, "the prompt is empty");
    for (size_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= V)
            return specd_err_set(err, "prompt token id %d at position %zu is out of vocabulary [0, %d)",
                                 r->prompt[i], i, V);
    if (r->n_prompt >= (size_t)L)
        return specd_err_set(err,
                             "This model's maximum context length is %d tokens. However, your prompt has %zu "
                             "tokens, which leaves no room for a completion.",
                             L, r->n_prompt);
    if (sp->max_tokens < 1) return specd_err_set(err, "max_tokens must be at least 1, got %d", sp->max_tokens);
    if (r->n_prompt + (size_t)sp->max_tokens > (size_t)L)
        return specd_err_set(err,
                             "This model's maximum context length is %d tokens. However, you requested %zu "
                             "tokens (%zu in the prompt, %d in the completion). Please reduce the length.",
                             L, r->n_prompt + (size_t)sp->max_tokens, r->n_prompt, sp->max_tokens);
    if (!(sp->temperature >= 0.0f)) return specd_err_set(err, "temperature must be >= 0, got %g", sp->temperature);
    if (!(sp->top_p > 0.0f && sp->top_p <= 1.0f)) return specd_err_set(err, "top_p must be in (0, 1], got %g", sp->top_p);
    if (!(sp->min_p >= 0.0f && sp->min_p <= 1.0f)) return specd_err_set(err, "min_p must be in [0, 1], got %g", sp->min_p);
    if (sp->top_k < -1) return specd_err_set(err, "top_k must be -1 (off) or >= 0, got %d", sp->top_k);
    if (!(sp->presence_penalty >= -2.0f && sp->presence_penalty <= 2.0f))
        return specd_err_set(err, "presence_penalty must be in [-2, 2], got %g", sp->presence_penalty);
    if (!(sp->frequency_penalty >= -2.0f && sp->frequency_penalty <= 2.0f))
        return specd_err_set(err, "frequency_penalty must be in [-2, 2], got %g", sp->frequency_penalty);
    if (!(sp->repetition_penalty > 0.0f && sp->repetition_penalty <= 100.0f))
        return specd_err_set(err, "repetition_penalty must be in (0, 100], got %g", sp->repetition_penalty);
    if (sp->min_tokens < 0 || sp->min_tokens > sp->max_tokens)
        return specd_err_set(err, "min_tokens must be in [0, max_tokens=%d], got %d", sp->max_tokens, sp->min_tokens);
    if (sp->logprobs < -1 || sp->logprobs > 20)
        return specd_err_set(err, "logprobs must be in [0, 20], got %d", sp->logprobs);
    if (sp->num_speculative_tokens < -1 || sp->num_speculative_tokens > 15)
        return specd_err_set(err, "num_speculative_tokens must be in [0, 15], got %d", sp->num_speculative_tokens);
    for (size_t i = 0; i < sp->n_stop_token_ids; i++)
        if (sp->stop_token_ids[i] < 0 || sp->stop_token_ids[i] >= V)
            return specd_err_set(err, "stop_token_ids[%zu] = %d is out of vocabulary [0, %d)", i,
                                 sp->stop_token_ids[i], V);
    for (size_t i = 0; i < sp->n_stop; i++)
        if (!sp->stop[i] || strlen(sp->stop[i]) > 1024)
            return specd_err_set(err, "stop[%zu] must be a string of at most 1024 bytes", i);
    for (size_t i = 0; i < sp->n_logit_bias; i++) {
        if (sp->logit_bias_ids[i] < 0 || sp->logit_bias_ids[i] >= V)
            return specd_err_set(err, "logit_bias token id %d is out of vocabulary [0, %d)", sp->logit_bias_ids[i], V);
        if (!(sp->logit_bias[i] >= -100.0f && sp->logit_bias[i] <= 100.0f))
            return specd_err_set(err, "logit_bias value %g for token %d is out of range [-100, 100]",
                                 sp->logit_bias[i], sp->logit_bias_ids[i]);
    }
    for (size_t i = 0; i < sp->n_forced_ids; i++)
        if (sp->forced_ids[i] < 0 || sp->forced_ids[i] >= V)
            return specd_err_set(err, "forced output id %d is out of vocabulary [0, %d)", sp->forced_ids[i], V);
    return 0;
}

static sched_seq *seq_new(engine *e, const engine_request *r) {
    sched_seq *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->sp = r->sp;
    s->sp.stop = NULL;
    s->sp.n_stop = 0;
    s->sp.stop_token_ids = NULL;
    s->sp.n_stop_token_ids = 0;
    s->sp.logit_bias_ids = NULL;
    s->sp.logit_bias = NULL;
    s->sp.forced_ids = NULL;
    size_t nb = r->sp.n_logit_bias, nf = r->sp.n_forced_ids;
    if (nb) {
        s->bias_ids = malloc(nb * sizeof *s->bias_ids);
        s->bias = malloc(nb * sizeof *s->bias);
        if (!s->bias_ids || !s->bias) goto fail;
        memcpy(s->bias_ids, r->sp.logit_bias_ids, nb * sizeof *s->bias_ids);
        memcpy(s->bias, r->sp.logit_bias, nb * sizeof *s->bias);
        s->sp.logit_bias_ids = s->bias_ids;
        s->sp.logit_bias = s->bias;
    }
    if (nf) {
        if (!(s->forced = malloc(nf * sizeof *s->forced))) goto fail;
        memcpy(s->forced, r->sp.forced_ids, nf * sizeof *s->forced);
        s->sp.forced_ids = s->forced;
    }
    snprintf(s->request_id, sizeof s->request_id, "%s", r->request_id ? r->request_id : "");
    s->n_prompt = (int32_t)r->n_prompt;
    s->cap_tokens = s->n_prompt + 16;
    s->tokens = malloc((size_t)s->cap_tokens * sizeof *s->tokens);
    size_t n_eos = r->sp.ignore_eos ? 0 : e->detok.n_eos;
    s->suppress = malloc((n_eos + r->sp.n_stop_token_ids + 1) * sizeof *s->suppress);
    if (!s->tokens || !s->suppress) goto fail;
    memcpy(s->tokens, r->prompt, r->n_prompt * sizeof *s->tokens);
    s->n_tokens = s->n_prompt;
    for (size_t i = 0; i < n_eos; i++) s->suppress[s->n_suppress++] = e->detok.eos_ids[i];
    for (size_t i = 0; i < r->sp.n_stop_token_ids; i++) s->suppress[s->n_suppress++] = r->sp.stop_token_ids[i];
    if (post_params_init(&s->pp, &r->sp, e->cfg.max_model_len) != 0) goto fail;
    if (post_init(&s->post, &e->detok, r->sp.skip_special_tokens) != 0) goto fail;
    if (e->detok.prime && s->post.stream) e->detok.prime(s->post.stream, r->prompt, r->n_prompt);
    post_delta_reset(&s->delta);
    kv_seq_init(&s->kv);
    s->prompt_logprobs = r->prompt_logprobs && r->n_prompt > 1;
    if (s->prompt_logprobs) {
        s->plp = calloc(r->n_prompt - 1, sizeof *s->plp);
        if (!s->plp) goto fail;
    }
    int32_t k = r->sp.num_speculative_tokens < 0 ? e->cfg.num_speculative_tokens : r->sp.num_speculative_tokens;
    s->k = e->proposer ? k : 0;
    spec_accept_init(&s->acc);
    s->t_submit = engine_now_s();
    return s;
fail:
    post_free(&s->post);
    post_params_free(&s->pp);
    free(s->plp);
    free(s->tokens);
    free(s->suppress);
    free(s->bias_ids);
    free(s->bias);
    free(s->forced);
    free(s);
    return NULL;
}

engine_stream *engine_submit(engine *e, const engine_request *r, void (*notify)(void *), void *notify_arg,
                             engine_status *status, specd_err *err) {
    engine_status st_local;
    if (!status) status = &st_local;
    *status = ENGINE_EINVAL;
    if (validate(e, r, err) != 0) return NULL;
    sched_seq *s = seq_new(e, r);
    engine_stream *st = calloc(1, sizeof *st);
    if (!s || !st) {
        sched_seq_free(e, s);
        free(st);
        *status = ENGINE_EFULL;
        specd_err_set(err, "engine: out of memory");
        return NULL;
    }
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv, NULL);
    st->refs = 2;
    st->notify = notify;
    st->notify_arg = notify_arg;
    st->eng = e;

    pthread_mutex_lock(&e->mu);
    if (e->draining || e->stop) {
        pthread_mutex_unlock(&e->mu);
        *status = ENGINE_EDRAINING;
        specd_err_set(err, "the server is shutting down (draining)");
        goto reject;
    }
    if (e->cfg.max_waiting > 0 && e->n_inbox + (size_t)e->n_waiting_pub >= (size_t)e->cfg.max_waiting) {
        pthread_mutex_unlock(&e->mu);
        *status = ENGINE_EFULL;
        specd_err_set(err, "the server is overloaded: %d requests are already waiting", e->cfg.max_waiting);
        goto reject;
    }
    if (e->n_inbox == e->cap_inbox) {
        size_t c = e->cap_inbox ? e->cap_inbox * 2 : 16;
        sched_seq **ni = realloc(e->inbox, c * sizeof *ni);
        if (!ni) {
            pthread_mutex_unlock(&e->mu);
            *status = ENGINE_EFULL;
            specd_err_set(err, "engine: out of memory");
            goto reject;
        }
        e->inbox = ni;
        e->cap_inbox = c;
    }
    s->id = e->next_seq_id++;
    st->seq_id = s->id;
    s->stream = st;
    uint64_t seed = r->sp.has_seed ? r->sp.seed : splitmix(&e->seed_state);
    sampler_rng_seed(&s->rng, seed);
    /* the draft's stream: a function of the same seed, distinct from the target's */
    uint64_t x = seed ^ 0xD3AF7C0DE5EED5EDull;
    s->draft_seed = splitmix(&x);
    e->inbox[e->n_inbox++] = s;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    *status = ENGINE_OK;
    return st;
reject:
    sched_seq_free(e, s);
    pthread_mutex_destroy(&st->mu);
    pthread_cond_destroy(&st->cv);
    free(st);
    return NULL;
}

/* ---------------------------------------------------------------- stats */

void engine_publish_stats(engine *e) {
    pthread_mutex_lock(&e->stats_mu);
    engine_stats *t = &e->stats;
    t->num_running = (int64_t)e->n_running;
    t->num_waiting = (int64_t)e->n_waiting;
    t->kv_blocks_total = kv_num_blocks(e->kv);
    t->kv_blocks_free = kv_num_free(e->kv);
    t->prompt_tokens_total = e->prompt_tokens;
    t->generation_tokens_total = e->gen_tokens;
    t->prefix_cache_queries_total = e->pc_queries;
    t->prefix_cache_hits_total = e->pc_hits;
    t->preemptions_total = e->preemptions;
    t->queue_timeouts_total = e->queue_timeouts;
    memcpy(t->requests_finished_total, e->finished, sizeof e->finished);
    t->steps_total = e->steps;
    t->spec_max_k = e->proposer ? e->cfg.num_speculative_tokens : 0;
    t->spec_num_drafts_total = e->spec_drafts;
    t->spec_num_draft_tokens_total = e->spec_draft_tokens;
    t->spec_num_accepted_tokens_total = e->spec_accepted;
    memcpy(t->spec_accepted_per_pos_total, e->spec_per_pos, sizeof e->spec_per_pos);
    memcpy(t->spec_k_chosen_total, e->spec_k_chosen, sizeof e->spec_k_chosen);
    t->spec_adaptive = e->proposer && e->cfg.spec_adaptive;
    t->forward_seconds_total = e->t_forward_s;
    t->spec_verify_forward_seconds_total = e->t_verify_forward_s;
    t->spec_verify_steps_total = e->verify_steps;
    t->spec_draft_seconds_total = e->t_draft_s;
    t->spec_draft_propose_seconds_total = e->t_propose_s;
    if (e->proposer && e->proposer->ops->kv_usage)
        e->proposer->ops->kv_usage(e->proposer->ctx, &t->draft_kv_blocks_total, &t->draft_kv_blocks_free);
    pthread_mutex_unlock(&e->stats_mu);

    pthread_mutex_lock(&e->mu);
    e->n_waiting_pub = (int64_t)e->n_waiting;
    e->n_active_pub = (int64_t)(e->n_waiting + e->n_running);
    if (e->n_active_pub == 0 && e->n_inbox == 0) pthread_cond_broadcast(&e->idle_cv);
    pthread_mutex_unlock(&e->mu);
}

void engine_get_stats(engine *e, engine_stats *out) {
    pthread_mutex_lock(&e->stats_mu);
    *out = e->stats;
    pthread_mutex_unlock(&e->stats_mu);
    pthread_mutex_lock(&e->mu);
    out->num_waiting += (int64_t)e->n_inbox;
    pthread_mutex_unlock(&e->mu);
}

const engine_config *engine_get_config(const engine *e) { return &e->cfg; }
const tokenizer *engine_tokenizer(const engine *e) { return e->tok; }
const model *engine_model(const engine *e) { return e->model; }

double engine_loop_age_s(engine *e) { return (double)(now_ns() - atomic_load(&e->last_loop_ns)) * 1e-9; }

size_t engine_last_schedule(const engine *e, const int64_t **seq_ids, const int32_t **n_tokens) {
    *seq_ids = e->last_ids;
    *n_tokens = e->last_n;
    return e->last_ids ? e->n_sched : 0;
}
