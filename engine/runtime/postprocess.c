/*
 * postprocess.c: stop conditions, incremental detokenization and stop-string
 * hold-back for one sequence (semantics in postprocess.h).
 *
 * Invariant: s->pending holds only text that is a candidate for a stop-string
 * match (a proper prefix of some stop string, shorter than the longest one)
 * plus whatever the latest token appended; after each token it is either
 * emitted up to the hold-back, cut at a match, or flushed entirely at a
 * finish. An earlier emitted byte can never be part of a later match: any
 * position where a match could start was inside the held suffix.
 *
 * Threading: engine thread only.
 */
#include "engine/runtime/postprocess.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int buf_append(char **buf, size_t *len, size_t *cap, const char *src, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 64;
        while (c < *len + n + 1) c *= 2;
        char *nb = realloc(*buf, c);
        if (!nb) return -1;
        *buf = nb;
        *cap = c;
    }
    if (n) memcpy(*buf + *len, src, n);
    *len += n;
    (*buf)[*len] = '\0';
    return 0;
}

int post_params_init(post_params *p, const sampling_params *sp, int32_t max_model_len) {
    memset(p, 0, sizeof *p);
    p->max_tokens = sp->max_tokens;
    p->min_tokens = sp->min_tokens;
    p->ignore_eos = sp->ignore_eos;
    p->max_model_len = max_model_len;
    if (sp->n_stop_token_ids) {
        p->stop_ids = malloc(sp->n_stop_token_ids * sizeof *p->stop_ids);
        if (!p->stop_ids) goto fail;
        memcpy(p->stop_ids, sp->stop_token_ids, sp->n_stop_token_ids * sizeof *p->stop_ids);
        p->n_stop_ids = sp->n_stop_token_ids;
    }
    if (sp->n_stop) {
        p->stop = calloc(sp->n_stop, sizeof *p->stop);
        if (!p->stop) goto fail;
        for (size_t i = 0; i < sp->n_stop; i++) {
            if (!sp->stop[i] || !sp->stop[i][0]) continue; /* empty stop strings never match */
            p->stop[p->n_stop] = strdup(sp->stop[i]);
            if (!p->stop[p->n_stop]) goto fail;
            size_t l = strlen(p->stop[p->n_stop]);
            if (l > p->max_stop_len) p->max_stop_len = l;
            p->n_stop++;
        }
    }
    return 0;
fail:
    post_params_free(p);
    return -1;
}

void post_params_free(post_params *p) {
    if (!p) return;
    free(p->stop_ids);
    for (size_t i = 0; i < p->n_stop; i++) free(p->stop[i]);
    free(p->stop);
    memset(p, 0, sizeof *p);
}

int post_init(post_state *s, const engine_detok *d, bool skip_special) {
    memset(s, 0, sizeof *s);
    s->detok = d;
    if (d && d->stream_create) {
        s->stream = d->stream_create(d->ctx, skip_special);
        if (!s->stream) return -1;
    }
    return 0;
}

void post_free(post_state *s) {
    if (!s) return;
    if (s->stream && s->detok && s->detok->stream_destroy) s->detok->stream_destroy(s->stream);
    free(s->pending);
    memset(s, 0, sizeof *s);
}

void post_delta_reset(post_delta *d) {
    d->n_tokens = 0;
    d->text_len = 0;
    if (d->text) d->text[0] = '\0';
    d->finish = FINISH_NONE;
    d->stop_reason[0] = '\0';
    d->stop_token_id = -1;
}

void post_delta_free(post_delta *d) {
    if (!d) return;
    free(d->tokens);
    free(d->text);
    memset(d, 0, sizeof *d);
}

size_t post_holdback(const char *text, size_t len, char *const *stop, size_t n_stop) {
    size_t best = 0;
    for (size_t i = 0; i < n_stop; i++) {
        size_t sl = strlen(stop[i]);
        size_t maxh = sl - 1 < len ? sl - 1 : len;
        for (size_t h = maxh; h > best; h--)
            if (memcmp(text + len - h, stop[i], h) == 0) {
                best = h;
                break;
            }
    }
    return best;
}

/* Emits pending[0..n) into the delta and drops it from pending. */
static int emit(post_state *s, post_delta *d, size_t n) {
    if (buf_append(&d->text, &d->text_len, &d->text_cap, s->pending, n) != 0) return -1;
    if (s->pending_len > n) memmove(s->pending, s->pending + n, s->pending_len - n);
    s->pending_len -= n;
    if (s->pending) s->pending[s->pending_len] = '\0';
    return 0;
}

static finish_reason finish(post_state *s, post_delta *d, finish_reason r) {
    s->finished = true;
    d->finish = r;
    return r;
}

static bool id_in(int32_t id, const int32_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (ids[i] == id) return true;
    return false;
}

/* Flushes the detokenizer and emits everything pending (no stop can match any more). */
static int flush_all(post_state *s, post_delta *d) {
    if (s->stream && s->detok->flush &&
        s->detok->flush(s->stream, &s->pending, &s->pending_len, &s->pending_cap) != 0)
        return -1;
    return emit(s, d, s->pending_len);
}

finish_reason post_token(post_state *s, const post_params *p, const engine_detok *dk, int32_t token,
                         int32_t n_ctx, post_delta *d) {
    if (s->finished) return d->finish;
    if (d->n_tokens + 1 > d->cap_tokens) {
        size_t c = d->cap_tokens ? d->cap_tokens * 2 : 16;
        int32_t *nt = realloc(d->tokens, c * sizeof *nt);
        if (!nt) return finish(s, d, FINISH_ERROR);
        d->tokens = nt;
        d->cap_tokens = c;
    }
    d->tokens[d->n_tokens++] = token;
    s->n_out++;

    /* token stops: the token is counted, its text is not emitted */
    bool eos = !p->ignore_eos && dk && id_in(token, dk->eos_ids, dk->n_eos);
    if (eos || id_in(token, p->stop_ids, p->n_stop_ids)) {
        /* vLLM's StopChecker: the model's EOS finishes with stop_reason None; a
         * request's stop_token_ids entry (checked after EOS) reports its id */
        d->stop_token_id = eos ? -1 : token;
        if (flush_all(s, d) != 0) return finish(s, d, FINISH_ERROR);
        return finish(s, d, FINISH_STOP);
    }

    size_t old_len = s->pending_len;
    if (s->stream && dk->push(s->stream, token, &s->pending, &s->pending_len, &s->pending_cap) != 0)
        return finish(s, d, FINISH_ERROR);

    if (p->n_stop && s->n_out >= p->min_tokens) {
        /* earliest match; it can only end inside the new bytes */
        size_t from = old_len >= p->max_stop_len ? old_len - p->max_stop_len + 1 : 0;
        size_t best_pos = (size_t)-1, best_i = 0;
        for (size_t i = 0; i < p->n_stop; i++) {
            size_t sl = strlen(p->stop[i]);
            for (size_t pos = from; pos + sl <= s->pending_len && pos < best_pos; pos++)
                if (memcmp(s->pending + pos, p->stop[i], sl) == 0) {
                    best_pos = pos;
                    best_i = i;
                    break;
                }
        }
        if (best_pos != (size_t)-1) {
            if (emit(s, d, best_pos) != 0) return finish(s, d, FINISH_ERROR);
            s->pending_len = 0;
            snprintf(d->stop_reason, sizeof d->stop_reason, "%s", p->stop[best_i]);
            return finish(s, d, FINISH_STOP);
        }
    }

    if (s->n_out >= p->max_tokens || (p->max_model_len > 0 && n_ctx >= p->max_model_len)) {
        if (flush_all(s, d) != 0) return finish(s, d, FINISH_ERROR);
        return finish(s, d, FINISH_LENGTH);
    }

    size_t hold = p->n_stop ? post_holdback(s->pending, s->pending_len, p->stop, p->n_stop) : 0;
    if (emit(s, d, s->pending_len - hold) != 0) return finish(s, d, FINISH_ERROR);
    return FINISH_NONE;
}

void post_finish(post_state *s, finish_reason reason, post_delta *d) {
    if (s->finished) return;
    if (reason == FINISH_LENGTH) (void)flush_all(s, d);
    finish(s, d, reason);
}
