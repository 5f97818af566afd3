/*
 * sampler.h: logits processing and sampling for one sequence row, and the
 * speculative acceptance rule (REFERENCE §3).
 *
 * Processing order (one row of raw logits, f32 [vocab]):
 *   1. suppression: ids in hist->suppress set to -inf (min_tokens: EOS and
 *      stop ids before min_tokens outputs, vLLM semantics);
 *   2. repetition penalty (HF CTRL, Keskar et al. 2019 as implemented by HF
 *      RepetitionPenaltyLogitsProcessor): every distinct id in prompt+output,
 *      logit > 0 -> logit / r, logit <= 0 -> logit * r;
 *   3. frequency and presence penalties (OpenAI semantics, output ids only):
 *      logit -= frequency * count(id) + presence * (count(id) > 0);
 *   3b. logit_bias (OpenAI): logit[id] += bias (sp->logit_bias_*);
 *   3c. TEST-ONLY forced output: while n_output < sp->n_forced_ids every logit
 *      but forced_ids[n_output] is -inf (engine.h);
 *   4. temperature < 1e-5: greedy, p = one-hot at argmax (ties -> lowest id);
 *      otherwise logits / temperature;
 *   5. top-k: keep every id whose logit >= the k-th largest (ties with the k-th
 *      are kept, as HF TopKLogitsWarper and vLLM do);
 *   6. top-p (HF TopPLogitsWarper): on the softmax of what is left, ids sorted
 *      by probability (desc, ties -> lower id first) are kept while the mass
 *      strictly before them is < top_p (at least one is kept);
 *   7. min-p: keep ids with p >= min_p * max p (ratio-invariant, so applying it
 *      before or after renormalisation is the same);
 *   8. softmax over what is left -> p, the PROCESSED distribution.
 * Sampling draws u ~ U[0,1) from the request's own RNG and walks the cumulative
 * of p in id order, so a given seed gives the same tokens whatever else is in
 * the batch. Greedy draws nothing from the RNG.
 * The speculative verifier calls sampler_probs for the same p, so speculative
 * and plain sampling process logits identically.
 *
 * Logprobs: like vLLM's default ("raw_logprobs"), log_softmax of the RAW model
 * logits, before penalties, temperature and filtering; the sampled token's and
 * the top-N's (ties -> lower id).
 *
 * Threading: a sampler_work belongs to one thread (the engine thread); the
 * functions are otherwise pure.
 */
#ifndef SPECD_RUNTIME_SAMPLER_H
#define SPECD_RUNTIME_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/runtime/engine.h"

#define SAMPLER_GREEDY_EPS 1e-5f

/* xoshiro256** (Blackman & Vigna 2018) seeded by splitmix64. */
typedef struct sampler_rng {
    uint64_t s[4];
} sampler_rng;

void sampler_rng_seed(sampler_rng *r, uint64_t seed);
uint64_t sampler_rng_next(sampler_rng *r);
/* Uniform double in [0, 1) with 53 random bits. */
double sampler_rng_uniform(sampler_rng *r);

/* Token history of one sequence (all borrowed). */
typedef struct sampler_hist {
    const int32_t *prompt;   size_t n_prompt;
    const int32_t *output;   size_t n_output;
    const int32_t *suppress; size_t n_suppress; /* ids forced to -inf */
} sampler_hist;

/* Scratch buffers sized for one vocabulary (counts, sort index, a row copy). */
typedef struct sampler_work sampler_work;
sampler_work *sampler_work_create(int32_t vocab);
void sampler_work_destroy(sampler_work *w); /* NULL ok */

bool sampler_is_greedy(const sampling_params *sp);

/* Steps 1-3c in place on LOGITS f32 [vocab]. */
void sampler_apply_penalties(sampler_work *w, const sampling_params *sp, const sampler_hist *h, float *logits);

/* Steps 1-8: P f32 [vocab] receives the processed distribution (sums to 1;
 * zeros for filtered ids; one-hot for greedy). LOGITS is not modified.
 * Returns the argmax of the penalised logits (the greedy token). */
int32_t sampler_probs(sampler_work *w, const sampling_params *sp, const sampler_hist *h, const float *logits,
                      float *p);

/* Samples the next token from raw LOGITS: greedy -> argmax (no RNG draw),
 * otherwise one draw from the processed distribution. */
int32_t sampler_sample(sampler_work *w, const sampling_params *sp, const sampler_hist *h, sampler_rng *rng,
                       const float *logits);

/* Inverse CDF in id order: smallest i with u * sum(p) < p[0] + ... + p[i]
 * (sums in double). Skips zeros; returns the last nonzero id if rounding
 * leaves u past the end. */
int32_t sampler_draw(const float *p, int32_t vocab, double u);
/* Argmax, ties -> lowest id. NaN never wins. */
int32_t sampler_argmax(const float *x, int32_t n);

/* Raw logprobs of TOKEN and the top N (0..20) from LOGITS f32 [vocab]. */
void sampler_logprobs(const float *logits, int32_t vocab, int32_t token, int32_t n_top, token_logprob *out);

/* Speculative acceptance of a draft token X (REFERENCE §3; Leviathan et al.
 * 2023, Chen et al. 2023). P: processed target distribution at this position,
 * Q: the draft's distribution over target ids, or NULL for a one-hot draft at
 * X (argmax drafting). Accepts with probability min(1, p(x)/q(x)) (q(x) = 0
 * with p(x) > 0 counts as ratio infinity); on rejection samples from
 * normalise(max(0, p - q)) (p itself if that is all zero). One or two RNG
 * draws. Returns 1 (accepted, *out = x) or 0 (rejected, *out = the
 * replacement). */
int sampler_accept(const float *p, const float *q, int32_t vocab, int32_t x, sampler_rng *rng, sampler_work *w,
                   int32_t *out);

#endif
