/*
 * engine.h: the engine's public request API, the only way server/ (HTTP
 * threads) talks to the engine thread.
 *
 * Model: one engine thread owns the scheduler, the block manager, the KV cache,
 * the model and the draft; it runs step() in a loop (schedule, run, postprocess).
 * HTTP threads submit requests into a bounded, mutex-protected waiting queue and
 * read results from a per-request engine_stream (a small thread-safe queue of
 * engine_output deltas). After pushing outputs for a request the engine thread
 * calls the request's notify callback (the server uses it to resume a suspended
 * libmicrohttpd connection); the callback must be cheap and must not block.
 *
 * One engine request = one sequence. Server-side `n > 1` submits n requests
 * (seeds seed+i) and merges them.
 *
 * Detokenization and stop strings happen on the engine thread (postprocess):
 * each output carries the text delta that is now final, i.e. never a partial
 * UTF-8 character and never text that could still turn out to be the start of a
 * stop string; on a stop-string match the text before it is emitted and the
 * stop string itself is not (OpenAI semantics).
 *
 * Lifetime: engine_submit returns a stream handle owned jointly by the caller
 * and the engine; the caller must call engine_stream_release exactly once (after
 * the final output, or to abandon it: release implies abort). Release waits for
 * a notify callback already running for that stream to return (so notify_arg
 * may be freed right after release): never call release from inside notify,
 * nor while holding a lock that notify takes.
 */
#ifndef SPECD_RUNTIME_ENGINE_H
#define SPECD_RUNTIME_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/model/model.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/util/err.h"

typedef struct sampling_params {
    float temperature;          /* 0 = greedy (argmax) */
    float top_p;                /* (0, 1]; 1 = off */
    int32_t top_k;              /* <= 0 = off */
    float min_p;                /* [0, 1]; 0 = off */
    float presence_penalty;     /* OpenAI semantics, [-2, 2] */
    float frequency_penalty;    /* OpenAI semantics, [-2, 2] */
    float repetition_penalty;   /* HF/CTRL semantics, > 0; 1 = off */
    bool has_seed;
    uint64_t seed;              /* per-request RNG seed (reproducible) */
    int32_t max_tokens;         /* >= 1 */
    int32_t min_tokens;         /* EOS/stop ids suppressed before this many tokens */
    bool ignore_eos;
    const int32_t *stop_token_ids; size_t n_stop_token_ids;   /* copied at submit */
    const char *const *stop;       size_t n_stop;              /* copied at submit */
    int32_t logprobs;           /* -1 = none; 0..20 = sampled token + top-N */
    bool skip_special_tokens;   /* in the detokenized text (default true) */
    int32_t num_speculative_tokens; /* -1 = engine default, 0 = no speculation */
    /* OpenAI logit_bias: logit[ids[i]] += bias[i] (bias in [-100, 100]) after the
     * penalties, before temperature / filtering and before the greedy argmax, in
     * plain and speculative sampling alike (sampler.h step 3b); copied at submit */
    const int32_t *logit_bias_ids; const float *logit_bias; size_t n_logit_bias;
    /* TEST-ONLY forced output (the server honours it only under SPECD_TEST_FORCED_OUTPUT=1):
     * output token j < n_forced_ids is forced_ids[j] (every other logit -inf after all
     * processing), so parsers, streaming and stop handling run on a chosen sequence;
     * copied at submit */
    const int32_t *forced_ids; size_t n_forced_ids;
} sampling_params;

/* Fills the defaults above (temperature 1, top_p 1, top_k -1, ..., max_tokens 16,
 * logprobs -1, skip_special_tokens true, num_speculative_tokens -1). */
void sampling_params_init(sampling_params *sp);

typedef struct engine_request {
    const int32_t *prompt;      /* [n_prompt] token ids; copied at submit */
    size_t n_prompt;
    sampling_params sp;
    const char *request_id;     /* for logs; copied */
    /* Prompt positions whose logprobs are wanted (echo + logprobs): 0 = none.
     * Such a request bypasses prefix-cache hits (cached blocks have no logits). */
    bool prompt_logprobs;
} engine_request;

typedef enum {
    FINISH_NONE = 0,   /* more to come */
    FINISH_STOP,       /* EOS, stop token id or stop string */
    FINISH_LENGTH,     /* max_tokens or context limit */
    FINISH_ABORT,      /* aborted (client gone, shutdown timeout) */
    FINISH_ERROR,      /* internal error: message in engine_output.error */
} finish_reason;

typedef struct token_logprob {
    int32_t id;
    float logprob;
    int32_t n_top;
    int32_t top_ids[20];
    float top_logprobs[20];
} token_logprob;

typedef struct engine_output {
    int32_t *token_ids;  size_t n_tokens;   /* tokens emitted in this delta (several under speculation) */
    token_logprob *logprobs;                /* [n_tokens] or NULL */
    char *text;          size_t text_len;   /* final text delta (NUL-terminated) */
    finish_reason finish;
    char stop_reason[64];                   /* matched stop string, or "" ; stop_token_id >= 0 if a token */
    int32_t stop_token_id;
    int32_t n_prompt_tokens;                /* totals so far */
    int32_t n_completion_tokens;
    int32_t n_cached_prompt_tokens;         /* prefix-cache hits */
    double ttft_s;                          /* set on the first output: submit -> first token */
    char error[256];
    int32_t error_status;                   /* FINISH_ERROR class for the server: 503 = overloaded
                                               (queue time limit), 0 = internal error */
    /* engine_request.prompt_logprobs only, on the first output: entry i is the
     * raw logprob of prompt token i+1 given tokens [0, i] (the first prompt
     * token has none), with top-N (N = sp.logprobs, at least 0). */
    token_logprob *prompt_logprobs; size_t n_prompt_logprobs;
} engine_output;

void engine_output_free(engine_output *o); /* NULL ok */

typedef struct engine_stream engine_stream;

/* Counters for /metrics (monotonic unless noted "gauge"). */
typedef struct engine_stats {
    int64_t num_running;            /* gauge */
    int64_t num_waiting;            /* gauge */
    int64_t kv_blocks_total;        /* gauge */
    int64_t kv_blocks_free;         /* gauge */
    int64_t prompt_tokens_total;
    int64_t generation_tokens_total;
    int64_t prefix_cache_queries_total;   /* tokens looked up */
    int64_t prefix_cache_hits_total;      /* tokens found */
    int64_t preemptions_total;
    int64_t queue_timeouts_total;         /* requests refused by max_queue_time_s (503) */
    int64_t requests_finished_total[5];   /* by finish_reason */
    int64_t steps_total;
    /* speculative decoding (REFERENCE §5 names) */
    int64_t spec_num_drafts_total;
    int64_t spec_num_draft_tokens_total;
    int64_t spec_num_accepted_tokens_total;
    int64_t spec_accepted_per_pos_total[16];
    int32_t spec_max_k;
    bool spec_adaptive;
    int64_t spec_k_chosen_total[16];      /* decode steps of speculating sequences by the k planned */
    /* time split (engine-thread wall seconds): every target forward pass
     * (runner.forward only, prefill included); those of steps with at least
     * one draft to verify (and how many such steps); every proposer call
     * (draft forward: propose + extend, the latter over prompts too), and
     * the propose calls alone */
    double forward_seconds_total;
    double spec_verify_forward_seconds_total;
    int64_t spec_verify_steps_total;
    double spec_draft_seconds_total;          /* propose + extend (extend includes prompts) */
    double spec_draft_propose_seconds_total;  /* propose only: the k draft steps */
    int64_t draft_kv_blocks_total;  /* gauge */
    int64_t draft_kv_blocks_free;   /* gauge */
} engine_stats;

typedef struct engine_config {
    int32_t max_model_len;          /* prompt + generated tokens per sequence */
    int32_t max_num_seqs;           /* running sequences per step */
    int32_t max_num_batched_tokens; /* token budget per step (chunked prefill) */
    int32_t max_waiting;            /* bounded waiting queue; submit fails past it (429); <= 0 = unbounded */
    double max_queue_time_s;        /* a request not yet admitted after this long finishes with
                                       FINISH_ERROR, error_status 503; <= 0 = wait forever */
    bool enable_prefix_caching;
    int32_t num_speculative_tokens; /* default k when a proposer is attached; 0 = off */
    bool spec_adaptive;             /* choose k in 0..K per sequence and step (spec_adapt.h); false = fixed k */
    /* The target forward the engine calls, default model_forward on the
     * engine's model; tensor parallelism sets tp_runner_forward (tp.h), which
     * posts the batch to the worker ranks first. ctx must outlive the engine. */
    int (*forward)(void *ctx, const model_batch *b, specd_err *err);
    void *forward_ctx;
    bool forward_logits_dev;        /* forward honours model_batch.logits_dev (tp_runner_forward does): the
                                       engine may then sample on the model's device backend */
    bool forward_aux_dev;           /* forward honours model_batch.aux_on_device (tp_runner_forward does: every
                                       rank captures into its own fixed aux buffer): a draft on the device
                                       then reads the target's aux rows there (engine_runner.aux_dev) */
} engine_config;

typedef struct engine engine;
struct spec_proposer; /* engine/runtime/proposer.h */

/* The engine borrows model and tokenizer (they must outlive it). */
int engine_create(const engine_config *cfg, model *m, const tokenizer *tok, engine **out, specd_err *err);
/* Attaches a draft proposer (EAGLE-3) before engine_start. */
int engine_set_proposer(engine *e, struct spec_proposer *p, specd_err *err);
int engine_start(engine *e, specd_err *err);   /* spawns the engine thread */
/* Stops admitting (submit fails with "draining"); in-flight requests continue.
 * engine_wait_idle blocks until nothing runs or waits, or timeout (seconds) passes;
 * returns 0 if idle, 1 on timeout (remaining requests are then aborted). */
void engine_drain(engine *e);
int engine_wait_idle(engine *e, double timeout_s);
void engine_destroy(engine *e); /* stops the thread, aborts everything; NULL ok */

/* Error classes for engine_submit failures, so the server maps them to HTTP. */
typedef enum { ENGINE_OK = 0, ENGINE_EINVAL = 400, ENGINE_EFULL = 429, ENGINE_EDRAINING = 503 } engine_status;

/* Validates (prompt non-empty, ids in vocab, length limits, parameters) and
 * enqueues. Returns a stream, or NULL with *status and err set. notify(arg) is
 * called from the engine thread whenever new output is available. */
engine_stream *engine_submit(engine *e, const engine_request *r, void (*notify)(void *), void *notify_arg,
                             engine_status *status, specd_err *err);
/* Non-blocking: 1 and *out (caller frees with engine_output_free) if an output
 * is ready, 0 if none yet. After an output with finish != FINISH_NONE, no more. */
int engine_stream_poll(engine_stream *s, engine_output **out);
/* Blocking variant with a timeout in seconds (<0 = forever): 1, 0 on timeout. */
int engine_stream_wait(engine_stream *s, engine_output **out, double timeout_s);
/* Requests abort (client disconnected). Blocks are freed on the next step. */
void engine_stream_abort(engine_stream *s);
void engine_stream_release(engine_stream *s);

void engine_get_stats(engine *e, engine_stats *out); /* thread-safe snapshot */
const engine_config *engine_get_config(const engine *e);
const tokenizer *engine_tokenizer(const engine *e);
const model *engine_model(const engine *e);
/* Seconds since the engine loop last completed an iteration (watchdog). */
double engine_loop_age_s(engine *e);

#endif
