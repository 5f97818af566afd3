/*
 * postprocess.h: per-sequence output handling after a token is chosen:
 * stop conditions (EOS, stop_token_ids, stop strings, max_tokens, context
 * limit), incremental detokenization and stop-string hold-back.
 *
 * Semantics (vLLM / OpenAI):
 *  - Tokens are processed ONE AT A TIME even when a step produced several
 *    (speculation): the first token that finishes the sequence is the last
 *    one kept; the caller drops the rest. Usage counts kept tokens only.
 *  - EOS (unless ignore_eos) and stop_token_ids finish with FINISH_STOP; the
 *    token is counted and reported in token_ids but contributes no text.
 *  - Stop strings are matched on the detokenized text once at least
 *    min_tokens outputs exist; on a match the text before the stop is emitted,
 *    the stop string and anything after it is not; FINISH_STOP with
 *    stop_reason = the string.
 *  - Hold-back: text that could still be the beginning of a stop string (the
 *    longest suffix of the pending text that is a proper prefix of some stop
 *    string) is held until it is resolved. Together with the detokenizer's
 *    UTF-8 rule, an emitted delta never contains a partial character nor a
 *    stop-string prefix that later matches, and text before a stop is never
 *    lost.
 *  - max_tokens and the context limit finish with FINISH_LENGTH after the
 *    detokenizer is flushed (held bytes emitted; an incomplete UTF-8 tail
 *    becomes U+FFFD, tok_stream's rule).
 *
 * Threading: engine thread only.
 */
#ifndef SPECD_RUNTIME_POSTPROCESS_H
#define SPECD_RUNTIME_POSTPROCESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/runtime/engine.h"
#include "engine/runtime/engine_ex.h"

/* Stop configuration of one request (owned copies). */
typedef struct post_params {
    int32_t max_tokens;
    int32_t min_tokens;
    bool ignore_eos;
    int32_t max_model_len;
    int32_t *stop_ids;  size_t n_stop_ids;
    char **stop;        size_t n_stop;        /* NUL-terminated, non-empty */
    size_t max_stop_len;
} post_params;

/* Per-sequence state. */
typedef struct post_state {
    const engine_detok *detok;
    void *stream;                 /* detokenizer stream */
    char *pending; size_t pending_len, pending_cap; /* detokenized, not yet emitted */
    int32_t n_out;                /* output tokens kept so far (usage) */
    bool finished;
} post_state;

/* A delta being built for one step: tokens kept and final text. */
typedef struct post_delta {
    int32_t *tokens; size_t n_tokens, cap_tokens;
    char *text; size_t text_len, text_cap;
    finish_reason finish;
    char stop_reason[64];
    int32_t stop_token_id;        /* the stop_token_ids entry that stopped it; -1 otherwise (EOS included, as vLLM) */
} post_delta;

/* Copies SP's stop settings into P (owned). Returns 0 or -1 (out of memory). */
int post_params_init(post_params *p, const sampling_params *sp, int32_t max_model_len);
void post_params_free(post_params *p);

int post_init(post_state *s, const engine_detok *d, bool skip_special);
void post_free(post_state *s);

void post_delta_reset(post_delta *d);
void post_delta_free(post_delta *d);

/* Processes one chosen token. N_CTX is the sequence length (prompt + outputs)
 * including this token. Appends to D; returns D->finish (FINISH_NONE = keep
 * going). -1 cast is never returned: out-of-memory finishes with FINISH_ERROR. */
finish_reason post_token(post_state *s, const post_params *p, const engine_detok *d_ops, int32_t token,
                         int32_t n_ctx, post_delta *d);

/* Finishes a sequence for a reason decided outside (abort, error): emits what
 * is pending when REASON is FINISH_LENGTH-like (flush), nothing otherwise. */
void post_finish(post_state *s, finish_reason reason, post_delta *d);

/* Length of the longest suffix of TEXT[0..len) that is a proper prefix of
 * one of the stop strings (exposed for tests). */
size_t post_holdback(const char *text, size_t len, char *const *stop, size_t n_stop);

#endif
