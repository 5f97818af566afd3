/*
 * fake_runner.h: a fake model runner and a fake detokenizer for the
 * scheduler tests (header-only; each test includes it once).
 *
 * The fake language model is a real function of the whole context, computed
 * THROUGH THE PAGED KV CACHE: forward() writes each batch token's id into its
 * block-table slot of a fake KV array, and the logits for an output token are
 * a hash of the ids read back from slots 0..pos of that sequence's block
 * table. So a wrong block table, a block shared by mistake, a lost KV entry
 * after preemption, or a chunk computed out of order changes the output,
 * which the tests compare with fake_reference_greedy() computed directly from
 * the token list, without any cache.
 *
 * The detokenizer maps id v to the string fake_piece(v) ("t<v> " by
 * default; tests may install their own table; "x " past FAKE_VOCAB).
 */
#ifndef SPECD_TESTS_FAKE_RUNNER_H
#define SPECD_TESTS_FAKE_RUNNER_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/runtime/engine_ex.h"

#define FAKE_VOCAB 64
#define FAKE_EOS 63
#define FAKE_HIDDEN 8

typedef struct fake_runner {
    int32_t block_size, n_blocks;
    int32_t *kv;           /* [n_blocks * block_size] token ids, -1 = never written */
    int calls;
    int max_tokens_seen;   /* largest batch */
    int last_n_tokens, last_n_seqs, last_n_out;
    int fail_next;         /* make the next forward fail */
    int eos_bias;          /* if > 0, EOS gets a high logit at every position >= eos_bias */
    int sleep_us;          /* per forward call (a slow model for timing tests) */
    int sleep_us_per_token; /* and per batch token (a compute-bound model for the adaptive-k tests) */
    bool virtual_time;     /* instead of sleeping, advance vclock (engine_runner.now = fake_now) */
    double vclock;         /* seconds */
} fake_runner;

static inline uint64_t fake_mix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 33);
}

/* Logits of the fake LM after context ctx[0..n). */
static inline void fake_logits(const int32_t *ctx, int32_t n, int eos_bias, float *out) {
    uint64_t h = 1469598103934665603ull;
    for (int32_t i = 0; i < n; i++) h = fake_mix(h ^ (uint64_t)(uint32_t)ctx[i]);
    for (int32_t v = 0; v < FAKE_VOCAB; v++)
        out[v] = (float)(fake_mix(h + (uint64_t)v * 0x9E3779B97F4A7C15ull) >> 40) / (float)(1 << 24) * 8.0f;
    out[FAKE_EOS] = (eos_bias > 0 && n >= eos_bias) ? 100.0f : -100.0f;
}

static inline int fake_forward(void *ctx, const model_batch *b, specd_err *err) {
    fake_runner *f = ctx;
    f->calls++;
    f->last_n_tokens = b->n_tokens;
    f->last_n_seqs = b->n_seqs;
    f->last_n_out = b->n_out;
    if (b->n_tokens > f->max_tokens_seen) f->max_tokens_seen = b->n_tokens;
    if (f->virtual_time) {
        f->vclock += 1e-6 * ((double)f->sleep_us + (double)f->sleep_us_per_token * b->n_tokens);
    } else if (f->sleep_us > 0 || f->sleep_us_per_token > 0) {
        long us = (long)f->sleep_us + (long)f->sleep_us_per_token * b->n_tokens;
        struct timespec ts = {us / 1000000L, (us % 1000000L) * 1000L};
        nanosleep(&ts, NULL);
    }
    if (f->fail_next) {
        f->fail_next = 0;
        return specd_err_set(err, "fake runner: injected failure");
    }
    for (int32_t i = 0; i < b->n_tokens; i++) {
        const int32_t *bt = b->block_tables[b->seq_of[i]];
        int32_t p = b->pos[i];
        f->kv[bt[p / f->block_size] * f->block_size + p % f->block_size] = b->tokens[i];
    }
    if (b->aux && b->n_aux > 0) /* aux features: [token, position, layer id, 0...] per layer */
        for (int32_t i = 0; i < b->n_tokens; i++)
            for (int32_t l = 0; l < b->n_aux; l++) {
                float *row = b->aux + ((size_t)i * (size_t)b->n_aux + (size_t)l) * FAKE_HIDDEN;
                memset(row, 0, FAKE_HIDDEN * sizeof *row);
                row[0] = (float)b->tokens[i];
                row[1] = (float)b->pos[i];
                row[2] = (float)b->aux_layers[l];
            }
    int32_t ctxbuf[4096];
    for (int32_t o = 0; o < b->n_out; o++) {
        int32_t i = b->out_idx[o];
        const int32_t *bt = b->block_tables[b->seq_of[i]];
        int32_t n = b->pos[i] + 1;
        if (n > 4096) return specd_err_set(err, "fake runner: context too long");
        for (int32_t p = 0; p < n; p++) ctxbuf[p] = f->kv[bt[p / f->block_size] * f->block_size + p % f->block_size];
        fake_logits(ctxbuf, n, f->eos_bias, b->logits + (size_t)o * FAKE_VOCAB);
    }
    return 0;
}

static inline double fake_now(void *ctx) { return ((fake_runner *)ctx)->vclock; }

static inline int fake_runner_init(fake_runner *f, int32_t n_blocks, int32_t block_size, engine_runner *r) {
    memset(f, 0, sizeof *f);
    f->n_blocks = n_blocks;
    f->block_size = block_size;
    f->kv = malloc((size_t)n_blocks * block_size * sizeof *f->kv);
    if (!f->kv) return -1;
    for (int32_t i = 0; i < n_blocks * block_size; i++) f->kv[i] = -1;
    *r = (engine_runner){.ctx = f, .forward = fake_forward, .vocab = FAKE_VOCAB, .hidden = FAKE_HIDDEN,
                         .block_size = block_size, .n_blocks = n_blocks};
    return 0;
}

/* Greedy decode of the fake LM without any cache. out [max_new]; returns count (stops after EOS). */
static inline int32_t fake_reference_greedy(const int32_t *prompt, int32_t n_prompt, int32_t max_new, int eos_bias,
                                     bool stop_at_eos, int32_t *out) {
    int32_t *ctx = malloc((size_t)(n_prompt + max_new) * sizeof *ctx);
    memcpy(ctx, prompt, (size_t)n_prompt * sizeof *ctx);
    float l[FAKE_VOCAB];
    int32_t n = 0;
    while (n < max_new) {
        fake_logits(ctx, n_prompt + n, eos_bias, l);
        int32_t best = 0;
        for (int32_t v = 1; v < FAKE_VOCAB; v++)
            if (l[v] > l[best]) best = v;
        ctx[n_prompt + n] = best;
        out[n++] = best;
        if (stop_at_eos && best == FAKE_EOS) break;
    }
    free(ctx);
    return n;
}

/* ---- fake detokenizer: id -> piece ---- */
static const char *const *fake_pieces; /* optional table [FAKE_VOCAB] */
static char fake_piece_buf[FAKE_VOCAB][16];

static inline const char *fake_piece(int32_t v) {
    if (v >= FAKE_VOCAB) return "x "; /* ids of a real model's vocabulary (test_engine_model) */
    if (fake_pieces && fake_pieces[v]) return fake_pieces[v];
    snprintf(fake_piece_buf[v], sizeof fake_piece_buf[v], "t%d ", v);
    return fake_piece_buf[v];
}

typedef struct fake_detok_stream {
    int dummy;
} fake_detok_stream;

static inline void *fake_detok_create(void *ctx, bool skip) {
    (void)ctx;
    (void)skip;
    return calloc(1, sizeof(fake_detok_stream));
}
static inline void fake_detok_destroy(void *s) { free(s); }
static inline int fake_detok_push(void *s, int32_t id, char **out, size_t *len, size_t *cap) {
    (void)s;
    if (id < 0) return -1;
    const char *p = fake_piece(id);
    size_t n = strlen(p);
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap * 2 : 64;
        while (c < *len + n + 1) c *= 2;
        char *nb = realloc(*out, c);
        if (!nb) return -1;
        *out = nb;
        *cap = c;
    }
    memcpy(*out + *len, p, n);
    *len += n;
    (*out)[*len] = '\0';
    return 0;
}
static inline int fake_detok_flush(void *s, char **out, size_t *len, size_t *cap) {
    (void)s;
    (void)out;
    (void)len;
    (void)cap;
    return 0;
}

static const int32_t fake_eos_ids[1] = {FAKE_EOS};

static inline engine_detok fake_detok(void) {
    return (engine_detok){.ctx = NULL, .stream_create = fake_detok_create, .stream_destroy = fake_detok_destroy,
                          .push = fake_detok_push, .flush = fake_detok_flush, .eos_ids = fake_eos_ids, .n_eos = 1};
}

#endif
