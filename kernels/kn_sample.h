/*
 * kn_sample.h: the sampler and the speculative verifier on the device.
 *
 * kn_sample: one row of logits per CTA, the CPU sampler's processing
 * (engine/runtime/sampler.h, steps 1-8) in the same order and with the same
 * f32 element arithmetic: suppression, repetition penalty (distinct ids of
 * prompt + output), frequency / presence penalties (output ids), greedy when
 * temperature < SAMPLER_GREEDY_EPS (argmax of the penalised logits, ties ->
 * lowest id, NaN never wins), temperature, top-k (ties with the k-th kept),
 * softmax, top-p (sorted by probability desc then id asc, kept while the mass
 * before is < top_p), min-p, softmax; then one inverse-CDF draw in id order
 * with u = kn_philox_uniform(seed, pos, 0) (kernels/kn_philox.h). The sums run
 * (Steps 3b / 3c of sampler.h, logit_bias and the test-only forced id, run
 * after the penalties as on the CPU: bias entries added in list order by one
 * thread, so duplicate ids accumulate in the CPU's order.) The uniform is
 * the host's when params.use_u != 0 (params.u: the request's own RNG stream,
 * so a seed gives the CPU backend's tokens), else Philox. The sums run
 * in double in an order fixed by the vocabulary size (not the CPU's
 * sequential order), so a probability may differ from sampler_probs in its
 * last bits: a draw can differ only when u lands within ~1e-15 of a cumulative
 * boundary. Nothing in a row depends on another row (BATCH INVARIANCE).
 *
 * kn_spec_verify: one CTA per sequence, the chain verifier of
 * engine/runtime/spec.c (spec_verify_seq) with sampler_accept's rule:
 *   greedy sequence: accept draft j iff it equals the target argmax of row j;
 *     the first mismatch emits the argmax (the correction);
 *   sampling sequence: draft x at row j (output position P = pos0 + j) is
 *     accepted iff p(x) > 0 and (q(x) <= 0 or u q(x) < p(x)), u =
 *     kn_philox_uniform(seed, P, 0) (q = NULL: one-hot drafts, q(x) = 1);
 *     on rejection the replacement is drawn from max(0, p - q) (from p when
 *     that is all zero) with u2 = kn_philox_uniform(seed, P, 1). q may be
 *     over the DRAFT vocabulary (EAGLE-3's q as the draw left it): q(x) =
 *     qd[t2d[x]], 0 for an x outside the draft vocabulary (t2d[x] < 0), the
 *     same values as the host's q scattered to target ids (sampler_accept);
 *   every draft accepted: the bonus token is drawn from row n_draft with
 *     kn_philox_uniform(seed, pos0 + n_draft, 0) (greedy: its argmax).
 * Penalties that depend on the accepted drafts are the caller's: row j's p /
 * argmax must come from kn_sample run with that row's history (prompt +
 * output + drafts 1..j), as spec_verify_seq builds it.
 *
 * Launchers: device pointers, asynchronous on `stream`, no allocation, no
 * synchronisation, graph-capturable; return 0 or a cudaError_t value
 * (cudaErrorInvalidValue for refused shapes).
 */
#ifndef SPECD_KERNELS_KN_SAMPLE_H
#define SPECD_KERNELS_KN_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Sampling parameters of one row (sampling_params' processing fields). */
typedef struct kn_sample_params {
    float temperature;        /* < 1e-5: greedy */
    float top_p;              /* (0, 1) active; otherwise off */
    int32_t top_k;            /* (0, vocab) active; otherwise off */
    float min_p;              /* > 0 active */
    float presence_penalty;   /* OpenAI semantics, output ids */
    float frequency_penalty;  /* OpenAI semantics, output ids */
    float repetition_penalty; /* HF semantics, > 0 and != 1 active */
    int32_t pos;              /* absolute position of the token being chosen (Philox counter) */
    uint64_t seed;            /* Philox key */
    int32_t hist_off;         /* into `hist`: n_prompt prompt ids, then n_output output ids */
    int32_t n_prompt;
    int32_t n_output;
    int32_t supp_off;         /* into `suppress`: n_suppress ids forced to -inf */
    int32_t n_suppress;
    int32_t bias_off;         /* into `bias_ids` / `bias`: logit[id] += bias (OpenAI logit_bias) */
    int32_t n_bias;
    int32_t forced_on;        /* != 0: every logit but forced_id -> -inf, forced_id's -> 0 (sampler.h 3c) */
    int32_t forced_id;        /* in [0, vocab) when forced_on */
    int32_t use_u;            /* != 0: the draw uses u instead of kn_philox_uniform(seed, pos, 0) */
    double u;                 /* [0, 1): the host's uniform */
} kn_sample_params;

/* Scratch bytes of kn_sample: three [n_rows, vocab] planes (f32 logits,
 * f32 probabilities, u32 id counts), each rounded up to 256 bytes. */
size_t kn_sample_scratch_bytes(int32_t n_rows, int32_t vocab);

/* logits: device f32 [n_rows, vocab]; params: device [n_rows]; hist,
 * suppress, bias_ids (int32) and bias (f32): device lists the params index
 * (may be NULL when every count is 0). out_token: device int32 [n_rows] (the greedy argmax, or the
 * draw) or NULL (no draw); out_probs: device f32 [n_rows, vocab] receives the
 * processed distribution (one-hot for greedy) or NULL. Ids outside [0, vocab)
 * in hist / suppress / bias_ids are ignored (as the CPU does). out_probs may
 * be logits itself (a CTA reads its row of logits once, into the scratch,
 * before it writes any probability): the processed distribution then
 * replaces the raw logits in place. */
int kn_sample(const float *logits, const kn_sample_params *params, const int32_t *hist, const int32_t *suppress,
              const int32_t *bias_ids, const float *bias, int32_t n_rows, int32_t vocab, int32_t *out_token,
              float *out_probs, void *scratch, size_t scratch_bytes, void *stream);

/* Chain verification of k_max-wide draft blocks (see above).
 *  p           device f32 [n_seqs, k_max + 1, vocab]: processed target rows
 *              (may be NULL when every sequence is greedy: a NULL p makes
 *              every sequence greedy); with row0: f32 [*, vocab], sequence
 *              s's rows at row0[s] .. row0[s] + n_draft[s]
 *  q           device array [n_seqs, k_max] of device pointers: q[s k_max + j]
 *              = draft j's distribution, a row of q_vocab f32 (NULL entry: a
 *              one-hot draft), or q NULL (every draft one-hot: argmax drafting)
 *  q_vocab     columns of a q row (> 0 when q is not NULL)
 *  t2d         device int32 [vocab]: target id -> column of a q row, < 0 (or
 *              >= q_vocab) outside the draft vocabulary (q = 0 there); NULL:
 *              the rows are over the target vocabulary (q_vocab == vocab)
 *  target_tok  device int32 [n_seqs, k_max + 1]: each row's argmax (used by
 *              greedy sequences; may be NULL when none is greedy, else such
 *              a sequence gets n_accepted = -1)
 *  draft       device int32 [n_seqs, k_max]; n_draft device int32 [n_seqs]
 *              (clamped to [0, k_max])
 *  greedy      device u8 [n_seqs] (1 = greedy); seed device u64 [n_seqs];
 *              pos0 device int32 [n_seqs] = absolute position of row 0's
 *              output token (m + 1 for x_m at m)
 *  row0        device int32 [n_seqs] or NULL: sequence s's first row of p
 *              and target_tok (NULL: s * (k_max + 1))
 *  u           device f64 [n_seqs, k_max + 2] or NULL (Philox): the host's
 *              uniforms, consumed in the CPU's order: draft j's accept test
 *              u[j], its rejection's replacement u[j + 1], the bonus u[n_draft]
 *              (what sampler_accept / sampler_sample draw from the request's
 *              RNG in spec_verify_seq)
 * Outputs: n_accepted device int32 [n_seqs]; out_tokens device int32
 * [n_seqs, k_max + 1], entries 0..n_accepted (accepted drafts, then the
 * correction or bonus token). */
int kn_spec_verify(const float *p, const float *const *q, int32_t q_vocab, const int32_t *t2d,
                   const int32_t *target_tok, const int32_t *draft, const int32_t *n_draft, const uint8_t *greedy,
                   const uint64_t *seed, const int32_t *pos0, const int32_t *row0, const double *u, int32_t n_seqs,
                   int32_t k_max, int32_t vocab, int32_t *n_accepted, int32_t *out_tokens, void *stream);

/* One row of kn_sample_draw (16 bytes; engine/backend/backend.h's
 * bk_draw_param has this layout, checked in cuda_backend.c). */
typedef struct kn_draw_params {
    float temperature;        /* < 1e-5: greedy (argmax, one-hot probabilities) */
    int32_t pos;              /* Philox counter (the drafted token's position) */
    uint64_t seed;            /* Philox key (the sequence's draft seed) */
} kn_draw_params;

/* Scratch bytes of kn_sample_draw: n_rows kn_sample_params (256-rounded),
 * then kn_sample_scratch_bytes(n_rows, vocab). */
size_t kn_sample_draw_scratch_bytes(int32_t n_rows, int32_t vocab);

/* A draw per row with temperature only (EAGLE-3's sampled drafts): kn_sample
 * with params expanded on the device from `params` (device [n_rows]: top-k /
 * top-p / min-p / penalties off, u = kn_philox_uniform(seed, pos, 0)), then
 * out_token[r] = id + d2t[id] when d2t is not NULL (device, vocab entries of
 * d2t_bits 32 or 64: the draft -> target map). logits device f32 [n_rows,
 * vocab]; out_token device int32 [n_rows] (required); out_probs device f32
 * [n_rows, vocab] (the draft distribution q over the DRAFT vocabulary;
 * one-hot for greedy rows) or NULL. Three launches, no host work:
 * graph-capturable. */
int kn_sample_draw(const float *logits, const kn_draw_params *params, const void *d2t, int d2t_bits,
                   int32_t n_rows, int32_t vocab, int32_t *out_token, float *out_probs, void *scratch,
                   size_t scratch_bytes, void *stream);

/* out[i] = kn_philox_uniform(seed[i], pos[i], draw[i]) computed on the
 * device (the host/device identity check). All device arrays of n. */
int kn_philox_uniforms(const uint64_t *seed, const int32_t *pos, const uint32_t *draw, int32_t n, double *out,
                       void *stream);

#ifdef __cplusplus
}
#endif

#endif
