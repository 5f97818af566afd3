/*
 * kimi_steps.h: a fixed run of a DeepSeek-V3 / Kimi model through
 * model_forward, shared by the device tests of the Kimi miniature
 * (tests/backend/test_cuda_kimi.c on the fake device, the same file as the
 * GPU test cuda_kimi): three sequences prefilled in ONE step (prompts of
 * 11, 6 and 17 tokens), three batched decode steps (one token each), a
 * verify-style step (4 tokens of sequence 0, 1 of sequence 1, 3 of sequence
 * 2 whose last two are siblings under a tree mask), and two more decode
 * steps. Every step asks for the logits and the final hidden state of every
 * row, and the EAGLE-3 aux capture of layers {0, 2, 4} (the miniature
 * head's). Sequence s owns KV blocks [s * KS_MAXB, (s + 1) * KS_MAXB).
 * Tokens: the prompts are fixed; a decode token is the argmax of the
 * sequence's last logits row in the run that chooses them (ks_run with
 * forced == NULL: the CPU reference), and a replay (forced = that run) feeds
 * the same tokens, so two backends see identical inputs even where their
 * logits differ in the last bits. ks_do_fwd runs the steps through another
 * forward (a tensor-parallel group's tp_runner_forward, test_cuda_kimi_tp.c).
 */
#ifndef SPECD_TESTS_BACKEND_KIMI_STEPS_H
#define SPECD_TESTS_BACKEND_KIMI_STEPS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/model.h"

#define KS_NSEQ 3
#define KS_MAXB 8 /* blocks of KS_BS per sequence */
#define KS_BS 16
#define KS_NSTEP 7
#define KS_MAXT 40
#define KS_NAUX 3

typedef struct ks_run {
    int T[KS_NSTEP];
    int32_t tok[KS_NSTEP][KS_MAXT], pos[KS_NSTEP][KS_MAXT], seq[KS_NSTEP][KS_MAXT];
    float *logits[KS_NSTEP];  /* [T, V] */
    float *hidden[KS_NSTEP];  /* [T, H] */
    float *aux[KS_NSTEP];     /* [T, KS_NAUX * H] */
    int32_t V, H;
} ks_run;

static const int32_t KS_AUX_LAYERS[KS_NAUX] = {0, 2, 4};

static inline int ks_argmax(const float *v, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

static inline const int32_t *const *ks_tables(void) {
    static int32_t rows[KS_NSEQ][KS_MAXB];
    static const int32_t *tabs[KS_NSEQ];
    for (int s = 0; s < KS_NSEQ; s++) {
        for (int j = 0; j < KS_MAXB; j++) rows[s][j] = s * KS_MAXB + j;
        tabs[s] = rows[s];
    }
    return tabs;
}

/* The forward a run goes through: NULL = model_forward(m, ...). */
typedef int (*ks_forward_fn)(void *ctx, const model_batch *b, specd_err *err);

/* Runs the steps on m (through fwd(ctx, ...) when fwd is set). forced: a previous run whose tokens are fed (NULL: choose greedily). Returns 0, or
 * -1 with the message printed. step_hook (may be NULL) is called after each step with its index. hidden:
 * ask for the final hidden states (false: r->hidden stays unwritten; a step asking for them never replays a
 * CUDA graph, model.h). */
static inline int ks_do_fwd(model *m, ks_forward_fn fwd, void *ctx, const ks_run *forced, ks_run *r,
                            void (*step_hook)(int step), bool hidden) {
    const model_config *mc = model_get_config(m);
    const int32_t V = mc->vocab, H = mc->hidden;
    memset(r, 0, sizeof *r);
    r->V = V, r->H = H;
    static const int plen[KS_NSEQ] = {11, 6, 17};
    int32_t len[KS_NSEQ] = {0}, last_row[KS_NSEQ] = {0}, last_step[KS_NSEQ] = {0};
    uint32_t lcg = 12345;
    for (int st = 0; st < KS_NSTEP; st++) {
        int T = 0;
        uint8_t mask[KS_MAXT * KS_MAXT];
        bool use_mask = false;
        for (int s = 0; s < KS_NSEQ; s++) {
            int n = st == 0 ? plen[s] : st == 4 ? (s == 0 ? 4 : s == 1 ? 1 : 3) : 1;
            for (int i = 0; i < n; i++, T++) {
                int32_t t;
                if (st == 0) {
                    lcg = lcg * 1664525u + 1013904223u;
                    t = (int32_t)((lcg >> 8) % 163584u); /* ordinary (non-special) ids */
                } else if (i == 0) {
                    t = ks_argmax(r->logits[last_step[s]] + (size_t)last_row[s] * V, V);
                } else {
                    t = (int32_t)(1000 * (s + 1) + 37 * i); /* verify drafts: arbitrary ids */
                }
                r->tok[st][T] = t;
                r->seq[st][T] = s;
                r->pos[st][T] = len[s] + i;
            }
            if (st == 4 && s == 2) use_mask = true;
            len[s] += n;
            last_row[s] = T - 1;
            last_step[s] = st;
        }
        if (forced) memcpy(r->tok[st], forced->tok[st], sizeof r->tok[st]);
        r->T[st] = T;
        if (use_mask) { /* chains everywhere, except that the last token of sequence 2 does not see its sibling */
            for (int i = 0; i < T; i++)
                for (int j = 0; j < T; j++) mask[i * T + j] = 1;
            mask[(T - 1) * T + (T - 2)] = 0;
        }
        int32_t oi[KS_MAXT];
        for (int i = 0; i < T; i++) oi[i] = i;
        r->logits[st] = malloc(sizeof(float) * (size_t)T * V);
        r->hidden[st] = calloc((size_t)T * H, sizeof(float));
        r->aux[st] = malloc(sizeof(float) * (size_t)T * KS_NAUX * H);
        if (!r->logits[st] || !r->hidden[st] || !r->aux[st]) return -1;
        model_batch b = {.n_tokens = T, .tokens = r->tok[st], .pos = r->pos[st], .seq_of = r->seq[st],
                         .n_seqs = KS_NSEQ, .block_tables = ks_tables(), .tree_mask = use_mask ? mask : NULL,
                         .n_out = T, .out_idx = oi, .logits = r->logits[st], .final_hidden = hidden ? r->hidden[st] : NULL,
                         .n_aux = KS_NAUX, .aux_layers = KS_AUX_LAYERS, .aux = r->aux[st]};
        specd_err err = {{0}};
        if ((fwd ? fwd(ctx, &b, &err) : model_forward(m, &b, &err)) < 0) {
            printf("step %d: model_forward: %s\n", st, err.msg);
            return -1;
        }
        if (step_hook) step_hook(st);
    }
    return 0;
}

static inline int ks_do_ex(model *m, const ks_run *forced, ks_run *r, void (*step_hook)(int step), bool hidden) {
    return ks_do_fwd(m, NULL, NULL, forced, r, step_hook, hidden);
}

static inline int ks_do(model *m, const ks_run *forced, ks_run *r, void (*step_hook)(int step)) {
    return ks_do_ex(m, forced, r, step_hook, true);
}

static inline void ks_free(ks_run *r) {
    for (int st = 0; st < KS_NSTEP; st++) free(r->logits[st]), free(r->hidden[st]), free(r->aux[st]);
    memset(r, 0, sizeof *r);
}

/* FNV-1a of every output byte of the run (a fingerprint for before/after comparisons). */
static inline uint64_t ks_hash(const ks_run *r) {
    uint64_t h = 1469598103934665603ull;
    for (int st = 0; st < KS_NSTEP; st++) {
        const struct { const void *p; size_t n; } parts[] = {
            {r->logits[st], sizeof(float) * (size_t)r->T[st] * r->V},
            {r->hidden[st], sizeof(float) * (size_t)r->T[st] * r->H},
            {r->aux[st], sizeof(float) * (size_t)r->T[st] * KS_NAUX * r->H},
            {r->tok[st], sizeof(int32_t) * (size_t)r->T[st]}};
        for (size_t k = 0; k < sizeof parts / sizeof parts[0]; k++)
            for (size_t i = 0; i < parts[k].n; i++) h = (h ^ ((const uint8_t *)parts[k].p)[i]) * 1099511628211ull;
    }
    return h;
}

#endif
