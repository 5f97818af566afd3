/*
 * spec_adapt.h: adaptive speculation (issue 20; docs/draft.md "Adaptive
 * speculation"): per sequence and per step, the number of drafts k in 0..K
 * that maximises expected emitted tokens per unit of engine time.
 *
 * Model. For a sequence whose conditional acceptance at draft position i is
 * a_i = P(draft i accepted | drafts 1..i-1 accepted), a step with k drafts
 * emits on average
 *     E(k) = 1 + sum_{i=1..k} prod_{j=1..i} a_j
 * tokens (the accepted run plus the correction or bonus token) and costs
 *     T(k) = k * t_draft + t_verify[k]
 * where t_draft is this sequence's share of one draft step and t_verify[k]
 * its share of a target pass that verifies k + 1 tokens per sequence, both
 * at the current batch size B: t_draft = d(B) / B, t_verify[k] =
 * t(B (k + 1)) / B, with t(n) the wall time of a target pass of n tokens and
 * d(r) that of one draft step over r sequences. k = argmax E(k) / T(k) (ties:
 * the smaller k). k = 0 whenever drafting does not pay: low acceptance, or a
 * batch large enough that t(n) grows with n (compute-bound verify).
 *
 * Acceptance (spec_accept): per position, a discounted Beta estimate with a
 * prior, a_i = (s_i + W0 * a_{i-1}) / (n_i + W0) (a_0's prior is P0): a
 * position never observed yet inherits the estimate of the one before it,
 * so a sequence that drafts 2 with an excellent head tries 3 next (a fixed
 * prior of 0.5 there kept it at 2 for good). Each observation discounts the
 * earlier ones by GAMMA_OBS; a step that drafts nothing discounts them by
 * GAMMA_IDLE. The choice is optimistic about the first draft (upper
 * confidence bound, as in bandits): it uses a_1 + UCB * sqrt(a_1 (1 - a_1) /
 * (n_1 + W0)), the deeper positions at their means (so exploring costs one
 * draft, not K: optimism at every position made the probes K drafts deep,
 * as expensive as fixed K on this CPU; deeper positions are reached as the
 * first one proves good, their priors chaining from it). A sequence
 * that stopped drafting learns nothing more, but its counts shrink, its
 * bound widens, and after a while it drafts again (its acceptance may have
 * changed, or the batch); a greedy choice on the mean instead stayed at k = 0
 * for good after an unlucky streak whenever the prior sat below the break-even
 * acceptance. Price: a head that never agrees drafts on ~10% of steps.
 *
 * Costs (spec_cost): t(n) comes from timed target passes at start-up
 * (engine spec_adapt_calibrate: n = 1..K+1 and (K+1) * 2^m up to 16 (K+1)
 * and the step budget, the fastest of 3 rounds interleaved over n); then
 * each step's measured pass moves the whole curve by (measured /
 * predicted)^0.1 (the load and the context growing, the n not visited lately
 * included) and its own calibrated n a further ^0.05 (the shape); between
 * calibrated n, linear interpolation, past the last, linear extrapolation.
 * d(r) is an EWMA of the measured propose time per draft step, per r
 * (r sequences drafting), from steady proposes only: a propose after a
 * prefill or after steps without drafts first runs the draft over every
 * pair pending since (a 69-token prompt made one draft step look like 0.6
 * of a target pass, and `specd generate` then never drafted again).
 *
 * Seeded sampling requests: their text depends on the k chosen at each step
 * (speculative sampling draws differently from plain sampling), so their k
 * must not depend on timings or on the batch. They use NOMINAL costs
 * (batch 1, a draft step = SPEC_ADAPT_NOMINAL_DRAFT target steps, a pass of
 * j tokens = 1 + SPEC_ADAPT_NOMINAL_SLOPE * (j - 1)): their k is a function
 * of their own acceptance history only, so their text is reproducible.
 *
 * Threading: pure functions on caller-owned structs; the engine thread owns
 * the engine's.
 */
#ifndef SPECD_RUNTIME_SPEC_ADAPT_H
#define SPECD_RUNTIME_SPEC_ADAPT_H

#include <stdbool.h>
#include <stdint.h>

#define SPEC_ADAPT_KMAX 15         /* drafts per step at most (engine limit) */
#define SPEC_ADAPT_P0 0.5          /* prior acceptance per position */
#define SPEC_ADAPT_W0 1.0          /* prior weight, in observations */
#define SPEC_ADAPT_GAMMA_OBS 0.95  /* discount per observation (memory ~20 observations; floor 0.5 / 21) */
#define SPEC_ADAPT_GAMMA_IDLE 0.98 /* discount per step without drafts: the estimate grows uncertain */
#define SPEC_ADAPT_UCB 1.0         /* the choice uses a_i + UCB * (its standard deviation) */
#define SPEC_ADAPT_NOMINAL_DRAFT 0.05 /* seeded sampling: draft step / target pass of 1 token (CPU, hot vocab) */
#define SPEC_ADAPT_NOMINAL_SLOPE 0.20 /* seeded sampling: extra cost per verified token / pass of 1 token (CPU) */
#define SPEC_COST_N 256            /* target passes are tabulated for n = 1..SPEC_COST_N tokens */

typedef struct spec_accept {
    float s[SPEC_ADAPT_KMAX]; /* discounted acceptances at position i (0-based: draft i + 1) */
    float n[SPEC_ADAPT_KMAX]; /* discounted observations at position i */
} spec_accept;

void spec_accept_init(spec_accept *a);
/* One verify: N_DRAFT drafts, the first ACCEPTED accepted; REJECTED: draft
 * ACCEPTED + 1 was seen and rejected (false when a stop ended the step). */
void spec_accept_observe(spec_accept *a, int32_t n_draft, int32_t accepted, bool rejected);
/* A step without drafts. */
void spec_accept_idle(spec_accept *a);
/* a_i for i < k into out [k] (each position's prior is the previous estimate). */
void spec_accept_rates(const spec_accept *a, int32_t k, double *out);
/* The rates the choice uses: a_0 optimistic, min(1, a_0 + UCB * sqrt(a_0 (1 - a_0) / (n_0 + W0))),
 * the deeper ones their means. */
void spec_accept_upper(const spec_accept *a, int32_t k, double *out);

/* E(k) for conditional rates a [k]. */
double spec_adapt_expected(const double *a, int32_t k);
/* argmax over k in 0..kmax of E(k) / (k * t_draft + t_verify[k]); t_verify
 * [kmax + 1] seconds (> 0). Ties go to the smaller k. */
int32_t spec_adapt_choose(const double *a, int32_t kmax, double t_draft, const double *t_verify);

typedef struct spec_cost {
    double t[SPEC_COST_N + 1];       /* seconds of a target pass of n tokens (calibrated, then EWMA), 0 = none */
    double d[SPEC_COST_N + 1];       /* EWMA seconds of one draft step over r sequences, 0 = none yet */
} spec_cost;

void spec_cost_init(spec_cost *c);
bool spec_cost_ready(const spec_cost *c); /* at least one calibrated target point */
void spec_cost_set_calibrated(spec_cost *c, int32_t n, double secs);
/* Interpolated t(n) (n >= 1); 0 if not ready. */
double spec_cost_target(const spec_cost *c, int32_t n);
/* d(r): the measured value nearest r (below first), or PRIOR_SECS if none. */
double spec_cost_draft(const spec_cost *c, int32_t r, double prior_secs);
void spec_cost_observe_target(spec_cost *c, int32_t n, double secs);
void spec_cost_observe_draft(spec_cost *c, int32_t r, double secs_per_step);
/* Per-sequence shares at batch B (>= 1): *t_draft and t_verify [kmax + 1]. */
void spec_cost_shares(const spec_cost *c, int32_t batch, int32_t kmax, double *t_draft, double *t_verify);
/* The nominal (timing-free, batch-1) shares of seeded sampling requests. */
void spec_cost_nominal(int32_t kmax, double *t_draft, double *t_verify);

#endif
