/*
 * fake_proposer.h: a proposer for the speculative-step tests that follows
 * draft/eagle3.h's contract and CHECKS that the engine does too.
 *
 * State per sequence id (< FP_MAX_SEQ): the committed tokens it was told
 * about (extend) and how many positions have features. Contract checks
 * (counted in fp->violations, with the first message kept):
 *  - extend never leaves a gap in tokens or features;
 *  - aux rows carry the fake runner's [token, position, layer] for exactly
 *    the positions extended;
 *  - at propose, features cover [0, n_tok - 1) (the last token is the one
 *    just sampled, not yet processed by the target).
 * Drafts: the true greedy continuation of the fake LM from the known tokens
 * (a real "oracle"), with deterministic corruptions (draft j wrong when a
 * hash of (seq, n_tok, j) % wrong_every == 0), so acceptance is partial. When
 * the engine passes out_q and the temperature is > 0, drafts are instead
 * sampled from q = softmax(fake logits / q_temp), and q is returned, with
 * the sequence's own RNG (seed_seq; a sequence the engine never seeded
 * draws from a fixed state and counts a violation).
 * Each proposal is recorded per sequence (k_seen: the k asked for) for the
 * adaptive-speculation tests; wrong_odd makes every draft of an odd sequence
 * id wrong (a head that never agrees with those sequences).
 * A fixed list of target ids can be forced through script_* for edge cases.
 */
#ifndef SPECD_TESTS_FAKE_PROPOSER_H
#define SPECD_TESTS_FAKE_PROPOSER_H

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "engine/runtime/proposer.h"
#include "engine/runtime/sampler.h"
#include "fake_runner.h"

#define FP_MAX_SEQ 256
#define FP_MAX_TOK 512

typedef struct fake_prop {
    int32_t toks[FP_MAX_SEQ][FP_MAX_TOK];
    int32_t n_tok[FP_MAX_SEQ];
    int32_t n_feat[FP_MAX_SEQ];
    int wrong_every;        /* 0 = never corrupt */
    int eos_bias;           /* as fake_runner.eos_bias, for the oracle drafts */
    float q_temp;           /* sampling drafts: q = softmax(logits / q_temp) */
    float q_temp_odd;       /* if > 0, used instead for odd sequence ids */
    sampler_rng rng[FP_MAX_SEQ];  /* per sequence, from seed_seq */
    bool seeded[FP_MAX_SEQ];
    int wrong_odd;          /* every draft of an odd sequence id is wrong */
    long k_seen[FP_MAX_SEQ][16]; /* propose calls per sequence slot by k asked */
    int violations;
    char first_violation[256];
    int propose_calls, extend_calls, truncates, frees;
    int max_batch;          /* most sequences in one propose call */
} fake_prop;

static inline void fp_violation(fake_prop *fp, const char *msg, long long a, long long b) {
    if (fp->violations++ == 0) snprintf(fp->first_violation, sizeof fp->first_violation, "%s (%lld, %lld)", msg, a, b);
}

static inline int fp_aux_layers(void *ctx, int32_t *layers) {
    (void)ctx;
    layers[0] = 2;
    layers[1] = 15;
    layers[2] = 27;
    return 3;
}

static inline int fp_extend(void *ctx, int64_t id, const int32_t *tokens, int32_t n, int32_t pos0, const float *aux,
                            specd_err *err) {
    fake_prop *fp = ctx;
    fp->extend_calls++;
    id %= FP_MAX_SEQ; /* in-flight sequences have consecutive ids: slots never collide in the tests */
    if (id < 0 || pos0 + n > FP_MAX_TOK) return specd_err_set(err, "fake proposer: out of range");
    if (pos0 > fp->n_tok[id]) fp_violation(fp, "extend leaves a token gap", pos0, fp->n_tok[id]);
    for (int32_t i = 0; i < n; i++) {
        int32_t p = pos0 + i;
        if (p < fp->n_tok[id] && fp->toks[id][p] != tokens[i]) { /* rewritten history: roll back */
            fp->n_tok[id] = p;
            if (fp->n_feat[id] > p) fp->n_feat[id] = p;
        }
        fp->toks[id][p] = tokens[i];
    }
    if (pos0 + n > fp->n_tok[id]) fp->n_tok[id] = pos0 + n;
    if (aux) {
        if (pos0 > fp->n_feat[id]) fp_violation(fp, "extend leaves a feature gap", pos0, fp->n_feat[id]);
        for (int32_t i = 0; i < n; i++)
            for (int l = 0; l < 3; l++) {
                const float *row = aux + ((size_t)i * 3 + (size_t)l) * FAKE_HIDDEN;
                if (row[0] != (float)tokens[i] || row[1] != (float)(pos0 + i))
                    fp_violation(fp, "aux row does not belong to the extended position", (long long)row[1], pos0 + i);
            }
        if (pos0 + n > fp->n_feat[id]) fp->n_feat[id] = pos0 + n;
    }
    return 0;
}

static inline int fp_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max,
                             const float *temps, int32_t *out_tokens, float *out_q, specd_err *err) {
    fake_prop *fp = ctx;
    (void)err;
    fp->propose_calls++;
    if (n > fp->max_batch) fp->max_batch = n;
    int32_t ctxbuf[FP_MAX_TOK + 16];
    float l[FAKE_VOCAB];
    for (int32_t i = 0; i < n; i++) {
        int64_t id = ids[i] % FP_MAX_SEQ;
        int32_t nt = fp->n_tok[id];
        if (fp->n_feat[id] != nt - 1) fp_violation(fp, "propose without features for [0, n_tok-1)", fp->n_feat[id], nt);
        memcpy(ctxbuf, fp->toks[id], (size_t)nt * sizeof *ctxbuf);
        for (int32_t j = 0; j < k_max; j++) {
            out_tokens[i * k_max + j] = -1;
            if (out_q) memset(out_q + ((size_t)i * k_max + j) * FAKE_VOCAB, 0, FAKE_VOCAB * sizeof(float));
        }
        for (int32_t j = 0; j < k[i]; j++) {
            fake_logits(ctxbuf, nt + j, fp->eos_bias, l);
            int32_t d;
            if (j == 0) fp->k_seen[id][k[i] < 16 ? k[i] : 15]++;
            if (out_q && temps[i] > 0.0f) {
                if (!fp->seeded[id]) fp_violation(fp, "sampled drafts of a sequence the engine never seeded", ids[i], 0);
                float *q = out_q + ((size_t)i * k_max + j) * FAKE_VOCAB;
                float qt = fp->q_temp_odd > 0 && (ids[i] & 1) ? fp->q_temp_odd : fp->q_temp;
                double mx = -1e30, sum = 0;
                for (int v = 0; v < FAKE_VOCAB; v++) mx = l[v] / qt > mx ? l[v] / qt : mx;
                for (int v = 0; v < FAKE_VOCAB; v++) sum += exp(l[v] / qt - mx);
                for (int v = 0; v < FAKE_VOCAB; v++) q[v] = (float)(exp(l[v] / qt - mx) / sum);
                d = sampler_draw(q, FAKE_VOCAB, sampler_rng_uniform(&fp->rng[id]));
            } else {
                d = 0;
                for (int v = 1; v < FAKE_VOCAB; v++)
                    if (l[v] > l[d]) d = v;
                if (fp->wrong_odd && (ids[i] & 1)) d = (d + 1) % (FAKE_VOCAB - 1);
                else if (fp->wrong_every > 0 && fake_mix((uint64_t)ids[i] * 1000003u + (uint64_t)nt * 31u + (uint64_t)j) %
                                                   (uint64_t)fp->wrong_every == 0)
                    d = (d + 1) % (FAKE_VOCAB - 1);
                if (out_q) out_q[((size_t)i * k_max + j) * FAKE_VOCAB + d] = 1.0f;
            }
            out_tokens[i * k_max + j] = d;
            ctxbuf[nt + j] = d;
        }
    }
    return 0;
}

static inline void fp_truncate(void *ctx, int64_t id, int32_t n) {
    fake_prop *fp = ctx;
    fp->truncates++;
    id %= FP_MAX_SEQ;
    if (fp->n_tok[id] > n) fp->n_tok[id] = n;
    if (fp->n_feat[id] > n) fp->n_feat[id] = n;
}

static inline void fp_seed_seq(void *ctx, int64_t id, uint64_t seed) {
    fake_prop *fp = ctx;
    id %= FP_MAX_SEQ;
    sampler_rng_seed(&fp->rng[id], seed);
    fp->seeded[id] = true;
}

static inline void fp_free_seq(void *ctx, int64_t id) {
    fake_prop *fp = ctx;
    fp->frees++;
    id %= FP_MAX_SEQ;
    fp->n_tok[id] = fp->n_feat[id] = 0;
    fp->seeded[id] = false;
}

static const spec_proposer_ops fp_ops = {
    .aux_layers = fp_aux_layers, .extend = fp_extend, .propose = fp_propose,
    .truncate = fp_truncate,     .free_seq = fp_free_seq, .seed_seq = fp_seed_seq,
};

#endif
