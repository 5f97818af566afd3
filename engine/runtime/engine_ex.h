/*
 * engine_ex.h: the engine's two seams, so the scheduler can run against a
 * fake model runner and a fake detokenizer in tests (tests/runtime) and
 * against anything model-shaped later (a TP group, a CUDA runner).
 *
 * engine_create (engine.h) wires the real model (model_forward) and the real
 * tokenizer (tok_stream) through these same seams; it lives in its own
 * translation unit (engine_model.c) so a test that uses engine_create_ex does
 * not link the model or the tokenizer.
 *
 * Threading: every callback is called from the engine thread only.
 */
#ifndef SPECD_RUNTIME_ENGINE_EX_H
#define SPECD_RUNTIME_ENGINE_EX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/model/model.h"
#include "engine/runtime/engine.h"
#include "engine/util/err.h"

/* The model runner: one forward step over a batch (model.h semantics: KV of
 * every batch token written at its block-table slot, logits for out_idx). */
typedef struct engine_runner {
    void *ctx;
    int (*forward)(void *ctx, const model_batch *b, specd_err *err);
    int32_t vocab;       /* logits row width */
    int32_t hidden;      /* H: width of one aux layer's feature (EAGLE-3 capture) */
    int32_t block_size;  /* KV tokens per block */
    int32_t n_blocks;    /* KV blocks in the pool */
    /* Optional: the clock (seconds) of the engine's cost measurements, the
     * forward and propose timings adaptive speculation learns from; NULL =
     * monotonic wall time. A device runner may count device time here; the
     * tests pass a virtual clock that only their fake forward advances, so
     * the costs they set are exactly the costs the engine sees. */
    double (*now)(void *ctx);
    /* Optional: sampling on the device. When set, forward is called with
     * model_batch.logits = NULL and .logits_dev set (the logits stay in this
     * backend's memory), the engine samples and verifies them there with
     * bk_ops.sample and downloads only the ids and accepted counts, plus the
     * raw rows a request needs on the host (logprobs, prompt logprobs, and
     * speculative chains of sampling requests whose draft gave q rows).
     * NULL: logits downloaded (or in place on host-visible backends) and
     * sampled on the host. engine_create sets it when model_logits_on_device. */
    backend *sample_be;
    /* Optional: the target's aux capture stays on the device. When set (the
     * model's fixed buffer, model_aux_device) and the proposer has
     * extend_rows, forward is called with model_batch.aux = NULL and
     * .aux_on_device, and the proposer is fed row indices of this buffer
     * instead of host features: no aux crosses the bus. Prefix-cache hits
     * of speculating sequences are then fed from the proposer's device
     * feature cache (proposer.h feat_cache_slots / extend_slots: rows by KV
     * slot) when it has one, else not taken (their features are not kept on
     * the host). engine_create sets it when the model has one. */
    const bk_tensor *aux_dev;
} engine_runner;

/* Incremental detokenizer (tok_stream semantics: only final UTF-8 bytes out). */
typedef struct engine_detok {
    void *ctx;
    void *(*stream_create)(void *ctx, bool skip_special);
    void (*stream_destroy)(void *stream);
    /* Appends the bytes now final for ID to *out (realloc'd; *len, *cap updated). -1 on a bad id. */
    int (*push)(void *stream, int32_t id, char **out, size_t *len, size_t *cap);
    /* Appends held bytes at the end of generation. */
    int (*flush)(void *stream, char **out, size_t *len, size_t *cap);
    /* Optional (NULL = none): primes a new stream with the prompt's ids (an
     * incomplete trailing character is held for the first output token). */
    void (*prime)(void *stream, const int32_t *prompt, size_t n);
    const int32_t *eos_ids;  /* ids that end generation unless ignore_eos (EOS, <|im_end|>, ...) */
    size_t n_eos;
} engine_detok;

/* The real tokenizer as a detokenizer seam (tok_stream, tok_stop_ids as EOS
 * ids); tok must outlive the engine. In engine_model.c. */
engine_detok engine_detok_from_tokenizer(const tokenizer *tok);

/* Like engine_create, with explicit seams (copied; their ctx must outlive the
 * engine). tok may be NULL (engine_tokenizer then returns NULL); m may be NULL. */
int engine_create_ex(const engine_config *cfg, const engine_runner *runner, const engine_detok *detok,
                     model *m, const tokenizer *tok, engine **out, specd_err *err);

/* Runs one scheduler step on the calling thread (only when engine_start was
 * NOT called): moves submissions in, schedules, runs the runner, postprocesses.
 * Returns the number of sequences that ran (0 = nothing to do), -1 on a runner
 * error (the affected requests finish with FINISH_ERROR). For deterministic
 * policy tests. */
int engine_step(engine *e, specd_err *err);

/* What the last engine_step scheduled (tests): per scheduled sequence, its
 * engine sequence id and the number of tokens it contributed. Returns count. */
size_t engine_last_schedule(const engine *e, const int64_t **seq_ids, const int32_t **n_tokens);

/* Engine sequence id of a stream (stable; what the proposer sees). */
int64_t engine_stream_seq_id(const engine_stream *s);

#endif
