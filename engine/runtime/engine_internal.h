/*
 * engine_internal.h: the engine's private structures, shared by engine.c
 * (thread, streams, submit, stats) and scheduler.c (one step: schedule, run,
 * postprocess). Not included outside engine/runtime/.
 *
 * Ownership and threading:
 *  - engine.mu guards the inbox (submitted, not yet seen by the engine
 *    thread), the flags (stop, draining, abort_all, wake) and the published
 *    activity count; HTTP threads only ever touch those and their streams.
 *  - Everything else in struct engine (waiting and running queues, the block
 *    manager, the sampler scratch, batch buffers, sequences) belongs to the
 *    engine thread (or to the thread calling engine_step when no thread runs).
 *  - engine_stream.mu guards the stream's output queue, refcount and its
 *    engine pointer. Lock order: stream.mu before engine.mu; the engine thread
 *    never holds engine.mu while taking a stream's mu.
 */
#ifndef SPECD_RUNTIME_ENGINE_INTERNAL_H
#define SPECD_RUNTIME_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "engine/runtime/block_manager.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/engine_ex.h"
#include "engine/runtime/postprocess.h"
#include "engine/runtime/proposer.h"
#include "engine/runtime/sampler.h"
#include "engine/runtime/spec_adapt.h"

struct engine_stream {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    engine_output **q;            /* ring of pending outputs */
    size_t q_head, q_len, q_cap;
    int refs;                     /* caller + engine */
    atomic_bool aborted;
    bool final_pushed;
    int notifying;                /* notify callbacks in flight (release waits for 0) */
    void (*notify)(void *);
    void *notify_arg;
    struct engine *eng;           /* NULL once the engine is gone */
    int64_t seq_id;
};

typedef struct sched_seq {
    int64_t id;
    engine_stream *stream;
    char request_id[64];
    sampling_params sp;           /* stop / stop_token_ids pointers cleared; copies live in pp */
    post_params pp;
    post_state post;
    post_delta delta;             /* this step's output */
    token_logprob *lp; size_t n_lp, cap_lp; /* this step's logprobs */

    int32_t *tokens;              /* [n_tokens] prompt then outputs */
    int32_t n_tokens, cap_tokens;
    int32_t n_prompt;
    int32_t n_computed;           /* leading tokens whose KV is in the cache */
    int32_t n_cached_prompt;      /* prefix-cache hit tokens at first admission */
    bool prompt_logprobs;         /* echo + logprobs: prefix-cache hits disabled */
    token_logprob *plp;           /* [n_prompt - 1] prompt logprobs, filled chunk by chunk */
    int32_t n_plp;                /* entries filled (positions [0, n_plp) done) */
    bool plp_sent;
    int32_t sched_plp_row;        /* first logits row of this step's prompt-logprob positions */
    int32_t sched_plp_pos;        /* first such position */
    int32_t sched_plp_n;          /* rows for positions sched_plp_pos .. + sched_plp_n - 1 */
    int32_t *suppress; size_t n_suppress; /* EOS (unless ignore_eos) + stop ids, masked before min_tokens */
    int32_t *bias_ids; float *bias;       /* [sp.n_logit_bias] owned copies sp.logit_bias_* point at */
    int32_t *forced;                      /* [sp.n_forced_ids] owned copy (test-only forced output) */
    bool admitted_once;
    kv_seq kv;
    sampler_rng rng;
    uint64_t draft_seed;          /* proposer seed_seq: the draft's sampling stream, from the request seed */

    int32_t k;                    /* speculative tokens per step at most (0 = none) */
    spec_accept acc;              /* adaptive speculation: this sequence's acceptance per position */
    int32_t prop_n;               /* n_tokens at its last propose (0 = none yet) */
    int32_t sched_new;            /* tokens in this step's batch */
    int32_t sched_out;            /* index of its first logits row, -1 = none */
    int32_t sched_t0;             /* batch index of its first token */
    int32_t sched_k;              /* drafts wanted this step (KV reserved for 1 + sched_k) */
    int32_t draft[16];            /* this step's draft tokens (target ids) */
    int32_t n_draft;              /* drafts verified this step (sched_new = 1 + n_draft) */
    const float *draft_q;         /* [n_draft, vocab] draft distributions, NULL = one-hot */
    const int32_t *draft_qrow;    /* propose_dev: [n_draft] rows of engine.qdev.q (on sample_be), -1 one-hot;
                                   * NULL: none (verified on the device, never on the host) */
    /* device sampling (scheduler.c device_sample, runner.sample_be): this step's results */
    bool dev_sampled;             /* the tokens below replace host sampling this step */
    int32_t dev_tok;              /* plain row: the sampled token */
    int32_t dev_acc;              /* verify: drafts accepted */
    int32_t dev_out[16];          /* verify: tokens 0..dev_acc (accepted drafts, correction / bonus) */

    double t_submit;              /* monotonic seconds */
    int32_t error_status;         /* copied to engine_output.error_status when it finishes with an error */
    bool first_output_sent;
    bool done;                    /* finished; removed at the end of the step */
} sched_seq;

struct engine {
    engine_config cfg;
    engine_runner runner;
    engine_detok detok;
    model *model;
    const tokenizer *tok;
    spec_proposer *proposer;

    /* engine-thread state */
    kv_block_manager *kv;
    sampler_work *sw;
    sched_seq **waiting; size_t n_waiting, cap_waiting;  /* FCFS; preempted go to the front */
    sched_seq **running; size_t n_running, cap_running;  /* admission order (oldest first) */
    sched_seq **sched;   size_t n_sched, cap_sched;      /* this step */
    int64_t *last_ids; int32_t *last_n;                 /* engine_last_schedule */
    /* batch buffers */
    int32_t *b_tok, *b_pos, *b_seq_of, *b_out;
    const int32_t **b_tables;
    size_t cap_batch, cap_seqs;
    float *logits; size_t cap_logits_rows;
    /* device sampling (runner.sample_be): the step's logits on the device, and
     * grow-only host arrays describing its rows (bk_sample_row / bk_verify_seq) */
    bk_tensor logits_dev;
    bk_sample_row *ds_rows; int32_t *ds_ids; size_t cap_ds_rows;
    bk_verify_seq *ds_vs; int32_t *ds_acc, *ds_vtok; sched_seq **ds_vseq; size_t cap_ds_vs;
    double *ds_u; size_t cap_ds_u;
    const float **ds_qp; size_t cap_ds_qp;                 /* chains' device q row pointers [n_verify, 16] */
    int32_t *ds_hist; size_t cap_ds_hist;             /* chains' histories with drafts appended */
    float *prob;                                          /* [vocab] scratch */
    /* speculative decoding (spec.c); all empty without a proposer */
    int32_t n_aux;                                        /* aux layers the proposer wants */
    int32_t aux_layers[8];
    float *aux; size_t cap_aux_rows;                      /* [n_tokens, n_aux * hidden] (host aux only) */
    bool aux_on_dev;                                      /* aux left on the device (runner.aux_dev + extend_rows) */
    bool feat_slots;      /* aux on the device and the proposer's feature pool is the device feature cache
                             (proposer.h extend_slots: one row per KV slot, shared like the KV): every feed
                             passes the block table, a prefix-cache hit is fed from the cached rows */
    int64_t *p_ids; int32_t *p_k; float *p_temp; int32_t *p_tok; size_t cap_prop;
    sched_seq **p_seqs;
    float *p_q; size_t cap_q_rows;                        /* [n, k_max, vocab] */
    int32_t *p_qrow;    /* propose_dev's q rows: [n, k_max] (stride k_max) in a [max_num_seqs * 16] buffer */
    spec_dev_q qdev;                                      /* the last propose_dev's q (rows on sample_be) */
    float *aux_pool;      /* [n_blocks * block_size, n_aux * hidden]: aux features by KV slot, so a
                             prefix-cache hit can feed the draft the cached positions' features;
                             only with a proposer, aux layers and prefix caching */
    float *aux_gather; size_t cap_gather_rows;
    int64_t spec_drafts, spec_draft_tokens, spec_accepted, spec_per_pos[16];
    int64_t spec_k_chosen[16];    /* decode steps of speculating sequences by the k planned */
    spec_cost cost;               /* adaptive speculation (spec_adapt.c): target / draft cost curves */
    double ad_t_draft, ad_t_verify[SPEC_ADAPT_KMAX + 1]; /* this step's per-sequence cost shares, seconds */
    /* engine-thread wall time (engine_now_s), seconds: target forward passes,
     * the part of them in steps that verify drafts, and proposer calls
     * (propose + extend); engine_stats reports them */
    double t_forward_s, t_verify_forward_s, t_draft_s, t_propose_s;
    double t_last_forward_s; /* run_batch: wall time of its runner.forward call */
    int64_t verify_steps;
    uint64_t seed_state;

    /* shared state (mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv;            /* wakes the engine thread */
    pthread_cond_t idle_cv;       /* signalled after steps that left nothing to do */
    sched_seq **inbox; size_t n_inbox, cap_inbox;
    int64_t n_active_pub;         /* waiting + running, published after each step */
    int64_t n_waiting_pub;        /* waiting, published after each step (queue bound) */
    int64_t next_seq_id;
    bool stop, draining, abort_all, wake;
    bool started;
    pthread_t thread;
    atomic_llong last_loop_ns;
    char stall_file[512];          /* fault injection (engine_loop.c): SPECD_FAULT_ENGINE_STALL_FILE */

    /* stats (stats_mu) */
    pthread_mutex_t stats_mu;
    engine_stats stats;
    int64_t preemptions, steps, prompt_tokens, gen_tokens, pc_queries, pc_hits;
    int64_t queue_timeouts; /* requests finished by the queue time limit */
    int64_t finished[5];
};

double engine_now_s(void);

/* scheduler.c */
int sched_step(engine *e, specd_err *err);
void sched_finish_seq(engine *e, sched_seq *s, finish_reason r, const char *error);
void sched_seq_free(engine *e, sched_seq *s);

/* spec.c: the speculative step pieces (see spec.c's header). */
int spec_init(engine *e, specd_err *err);
int32_t spec_plan_k(engine *e, sched_seq *s, int32_t budget);
void spec_propose(engine *e);
/* Verifies S's drafts on its logits rows, emits accepted + correction/bonus,
 * rolls back KV, feeds the proposer. */
void spec_verify_seq(engine *e, sched_seq *s);
/* Feeds the proposer the tokens S just computed (non-speculative path). */
void spec_extend_computed(engine *e, sched_seq *s, int32_t pos0, int32_t n);
void spec_extend_sampled(engine *e, sched_seq *s, int32_t tok, int32_t pos);
/* After a forward: stores every batch token's aux features at its KV slot. */
void spec_aux_store(engine *e);
/* After a prefix-cache hit of HIT tokens: feeds the proposer those tokens with
 * their stored features (the host aux_pool, or the device feature cache).
 * False if that is impossible (neither). */
bool spec_feed_prefix_hit(engine *e, sched_seq *s, int32_t hit);
bool spec_prefix_hits_ok(const engine *e);
/* spec_adapt.c: adaptive speculation (see spec_adapt.h). */
double engine_cost_clock(const engine *e);           /* runner.now, or engine_now_s */
int spec_adapt_calibrate(engine *e);                 /* timed target passes; 0 or -1 (then fixed k) */
void spec_adapt_begin_step(engine *e);               /* this step's cost shares (before spec_plan_k) */
int32_t spec_adapt_k(const engine *e, const sched_seq *s); /* the k that pays most, 0..s->k */
void spec_adapt_after_forward(engine *e, double secs); /* online target cost update */
int sched_append_token(sched_seq *s, int32_t tok);
sampler_hist sched_hist(const sched_seq *s);

/* engine.c: hands a step's delta of S to its stream (and notifies). */
void engine_push_output(engine *e, sched_seq *s, const char *error);
void engine_publish_stats(engine *e);

#endif
