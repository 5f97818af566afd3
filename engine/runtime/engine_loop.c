/*
 * engine_loop.c: engine lifecycle (create with explicit seams, proposer
 * attach, start, drain, wait_idle, destroy) and the engine thread's loop.
 *
 * The loop: take e->mu; while there is nothing to do (no submissions, nothing
 * waiting or running, no abort to apply) sleep on e->cv with a 1 s timeout
 * (no busy-wait; the timeout only refreshes the watchdog timestamp); then
 * release the lock and run one sched_step. Stop is checked between steps, so
 * destroy waits at most one step.
 *
 * Fault injection (tests only): when SPECD_FAULT_ENGINE_STALL_FILE names a
 * path at engine_start, the loop stalls, without refreshing the watchdog
 * timestamp and without holding e->mu, for as long as that file exists: a
 * hung engine, for the systemd watchdog test (tests/server/test_notify.py).
 *
 * Threading: create / destroy / start / set_proposer from the owner thread;
 * drain / wait_idle from any thread.
 */
#include "engine/runtime/engine_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/util/log.h"

static long long mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int engine_create_ex(const engine_config *cfg, const engine_runner *runner, const engine_detok *detok,
                     model *m, const tokenizer *tok, engine **out, specd_err *err) {
    *out = NULL;
    if (!cfg || !runner || !runner->forward || !detok)
        return specd_err_set(err, "engine: missing configuration, runner or detokenizer");
    if (runner->vocab < 1 || runner->block_size < 1 || runner->n_blocks < 1)
        return specd_err_set(err, "engine: bad runner (vocab %d, %d blocks of %d)", runner->vocab,
                             runner->n_blocks, runner->block_size);
    int64_t pool_tokens = (int64_t)runner->n_blocks * runner->block_size;
    if (cfg->max_model_len < 2 || cfg->max_model_len > pool_tokens)
        return specd_err_set(err,
                             "engine: max_model_len %d must be in [2, %lld] (the KV pool holds %d blocks of %d "
                             "tokens)",
                             cfg->max_model_len, (long long)pool_tokens, runner->n_blocks, runner->block_size);
    if (cfg->max_num_seqs < 1 || cfg->max_num_batched_tokens < 1)
        return specd_err_set(err, "engine: max_num_seqs (%d) and max_num_batched_tokens (%d) must be >= 1",
                             cfg->max_num_seqs, cfg->max_num_batched_tokens);
    if (cfg->num_speculative_tokens < 0 || cfg->num_speculative_tokens > 15)
        return specd_err_set(err, "engine: num_speculative_tokens %d must be in [0, 15]",
                             cfg->num_speculative_tokens);

    engine *e = calloc(1, sizeof *e);
    if (!e) return specd_err_set(err, "engine: out of memory");
    e->cfg = *cfg;
    e->runner = *runner;
    e->detok = *detok;
    e->model = m;
    e->tok = tok;
    e->seed_state = (uint64_t)mono_ns() ^ 0x5EEDull;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    pthread_cond_init(&e->idle_cv, NULL);
    pthread_mutex_init(&e->stats_mu, NULL);
    atomic_store(&e->last_loop_ns, mono_ns());
    if (kv_create(runner->n_blocks, runner->block_size, cfg->enable_prefix_caching, &e->kv, err) != 0) goto fail;
    e->sw = sampler_work_create(runner->vocab);
    if (!e->sw) {
        specd_err_set(err, "engine: out of memory for the sampler");
        goto fail;
    }
    engine_publish_stats(e);
    *out = e;
    return 0;
fail:
    engine_destroy(e);
    return -1;
}

int engine_set_proposer(engine *e, struct spec_proposer *p, specd_err *err) {
    if (e->started) return specd_err_set(err, "engine: attach the proposer before engine_start");
    if (p && (!p->ops || !p->ops->propose)) return specd_err_set(err, "engine: proposer without a propose op");
    if (p && !p->ops->propose_dev != !p->ops->dev_q_backend)
        return specd_err_set(err, "engine: proposer with %s but no %s (proposer.h: both or neither)",
                             p->ops->propose_dev ? "propose_dev" : "dev_q_backend",
                             p->ops->propose_dev ? "dev_q_backend" : "propose_dev");
    e->proposer = p;
    return spec_init(e, err);
}

static bool stall_requested(const engine *e) { return e->stall_file[0] && access(e->stall_file, F_OK) == 0; }

static void *engine_main(void *arg) {
    engine *e = arg;
    for (;;) {
        if (stall_requested(e)) {
            LOG_WARN("engine: stalling while %s exists (fault injection)", e->stall_file);
            while (stall_requested(e) && !e->stop) {
                struct timespec ts = {0, 100 * 1000 * 1000};
                nanosleep(&ts, NULL);
            }
        }
        pthread_mutex_lock(&e->mu);
        while (!e->stop && e->n_inbox == 0 && e->n_active_pub == 0 && !e->wake && !e->abort_all) {
            struct timespec dl;
            clock_gettime(CLOCK_REALTIME, &dl);
            dl.tv_sec += 1;
            pthread_cond_timedwait(&e->cv, &e->mu, &dl);
            if (stall_requested(e)) break;
            atomic_store(&e->last_loop_ns, mono_ns());
        }
        bool stop = e->stop;
        e->wake = false;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
        sched_step(e, NULL);
        atomic_store(&e->last_loop_ns, mono_ns());
    }
    return NULL;
}

int engine_start(engine *e, specd_err *err) {
    if (e->started) return specd_err_set(err, "engine: already started");
    const char *stall = getenv("SPECD_FAULT_ENGINE_STALL_FILE");
    if (stall && *stall) snprintf(e->stall_file, sizeof e->stall_file, "%s", stall);
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0)
        return specd_err_set(err, "engine: cannot create the engine thread");
    e->started = true;
    return 0;
}

int engine_step(engine *e, specd_err *err) {
    if (e->started) return specd_err_set(err, "engine: engine_step while the engine thread runs");
    return sched_step(e, err);
}

void engine_drain(engine *e) {
    pthread_mutex_lock(&e->mu);
    e->draining = true;
    pthread_mutex_unlock(&e->mu);
}

int engine_wait_idle(engine *e, double timeout_s) {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    double t = (double)dl.tv_nsec * 1e-9 + (timeout_s > 0 ? timeout_s : 0);
    dl.tv_sec += (time_t)t;
    dl.tv_nsec = (long)((t - (double)(time_t)t) * 1e9);
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    while (e->n_inbox + (size_t)e->n_active_pub > 0) {
        if (pthread_cond_timedwait(&e->idle_cv, &e->mu, &dl) == ETIMEDOUT &&
            e->n_inbox + (size_t)e->n_active_pub > 0) {
            e->abort_all = true;
            pthread_cond_signal(&e->cv);
            rc = 1;
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

void engine_destroy(engine *e) {
    if (!e) return;
    if (e->started) {
        pthread_mutex_lock(&e->mu);
        e->stop = true;
        pthread_cond_signal(&e->cv);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->thread, NULL);
        e->started = false;
    }
    /* abort everything still known: inbox, waiting, running */
    if (e->kv) {
        for (size_t i = 0; i < e->n_inbox; i++) {
            sched_finish_seq(e, e->inbox[i], FINISH_ABORT, "engine shut down");
            sched_seq_free(e, e->inbox[i]);
        }
        for (size_t i = 0; i < e->n_waiting; i++) {
            sched_finish_seq(e, e->waiting[i], FINISH_ABORT, "engine shut down");
            sched_seq_free(e, e->waiting[i]);
        }
        for (size_t i = 0; i < e->n_running; i++) {
            sched_finish_seq(e, e->running[i], FINISH_ABORT, "engine shut down");
            sched_seq_free(e, e->running[i]);
        }
    }
    free(e->inbox);
    free(e->waiting);
    free(e->running);
    free(e->sched);
    free(e->last_ids);
    free(e->last_n);
    free(e->b_tok);
    free(e->b_pos);
    free(e->b_seq_of);
    free(e->b_out);
    free(e->b_tables);
    free(e->logits);
    free(e->prob);
    free(e->aux);
    free(e->p_ids);
    free(e->p_k);
    free(e->p_temp);
    free(e->p_tok);
    free(e->p_seqs);
    free(e->p_q);
    free(e->p_qrow);
    free(e->ds_qp);
    free(e->aux_pool);
    free(e->aux_gather);
    free(e->ds_rows);
    free(e->ds_ids);
    free(e->ds_vs);
    free(e->ds_acc);
    free(e->ds_vtok);
    free(e->ds_vseq);
    free(e->ds_u);
    free(e->ds_hist);
    sampler_work_destroy(e->sw);
    kv_destroy(e->kv);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    pthread_cond_destroy(&e->idle_cv);
    pthread_mutex_destroy(&e->stats_mu);
    free(e);
}
