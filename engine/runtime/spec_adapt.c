/*
 * spec_adapt.c: adaptive speculation (see spec_adapt.h for the model): the
 * pure parts (acceptance estimate, expected tokens, the choice, the cost
 * curves) and the engine's use of them (start-up calibration with timed
 * target passes, the per-step cost shares, the per-sequence choice).
 *
 * Invariants: a choice is in 0..s->k; greedy output never depends on it
 * (the verify path handles any per-sequence k, 0 included, in one batch);
 * a seeded sampling request's choice depends on its own history only.
 *
 * Threading: engine thread only (calibration runs in engine_set_proposer,
 * on the owner thread, before the engine thread exists).
 */
#include "engine/runtime/engine_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/util/log.h"

/* ---------------------------------------------------------------- acceptance */

void spec_accept_init(spec_accept *a) { memset(a, 0, sizeof *a); }

void spec_accept_observe(spec_accept *a, int32_t n_draft, int32_t accepted, bool rejected) {
    int32_t seen = accepted + (rejected ? 1 : 0); /* positions with an outcome */
    if (seen > n_draft) seen = n_draft;
    if (seen > SPEC_ADAPT_KMAX) seen = SPEC_ADAPT_KMAX;
    for (int32_t i = 0; i < seen; i++) {
        a->s[i] = (float)(SPEC_ADAPT_GAMMA_OBS * a->s[i] + (i < accepted ? 1.0 : 0.0));
        a->n[i] = (float)(SPEC_ADAPT_GAMMA_OBS * a->n[i] + 1.0);
    }
}

void spec_accept_idle(spec_accept *a) {
    for (int32_t i = 0; i < SPEC_ADAPT_KMAX; i++) {
        a->s[i] = (float)(SPEC_ADAPT_GAMMA_IDLE * a->s[i]);
        a->n[i] = (float)(SPEC_ADAPT_GAMMA_IDLE * a->n[i]);
    }
}

void spec_accept_rates(const spec_accept *a, int32_t k, double *out) {
    double prior = SPEC_ADAPT_P0;
    for (int32_t i = 0; i < k && i < SPEC_ADAPT_KMAX; i++) {
        out[i] = ((double)a->s[i] + SPEC_ADAPT_W0 * prior) / ((double)a->n[i] + SPEC_ADAPT_W0);
        prior = out[i];
    }
}

void spec_accept_upper(const spec_accept *a, int32_t k, double *out) {
    spec_accept_rates(a, k, out);
    if (k < 1) return;
    double u = out[0] + SPEC_ADAPT_UCB * sqrt(out[0] * (1.0 - out[0]) / ((double)a->n[0] + SPEC_ADAPT_W0));
    out[0] = u < 1.0 ? u : 1.0;
}

/* ---------------------------------------------------------------- choice */

double spec_adapt_expected(const double *a, int32_t k) {
    double e = 1.0, run = 1.0;
    for (int32_t i = 0; i < k; i++) {
        run *= a[i];
        e += run;
    }
    return e;
}

int32_t spec_adapt_choose(const double *a, int32_t kmax, double t_draft, const double *t_verify) {
    int32_t best = 0;
    double best_rate = 1.0 / t_verify[0];
    double e = 1.0, run = 1.0;
    for (int32_t k = 1; k <= kmax; k++) {
        run *= a[k - 1];
        e += run;
        double rate = e / ((double)k * t_draft + t_verify[k]);
        if (rate > best_rate) {
            best_rate = rate;
            best = k;
        }
    }
    return best;
}

/* ---------------------------------------------------------------- costs */

void spec_cost_init(spec_cost *c) { memset(c, 0, sizeof *c); }

bool spec_cost_ready(const spec_cost *c) {
    for (int32_t n = 1; n <= SPEC_COST_N; n++)
        if (c->t[n] > 0) return true;
    return false;
}

void spec_cost_set_calibrated(spec_cost *c, int32_t n, double secs) {
    if (n >= 1 && n <= SPEC_COST_N && secs > 0) c->t[n] = secs;
}

/* t(n): linear between the measured points around n, extrapolated from the
 * last two (or held) past them. */
double spec_cost_target(const spec_cost *c, int32_t n) {
    if (n < 1) n = 1;
    if (n <= SPEC_COST_N && c->t[n] > 0) return c->t[n];
    int32_t lo = 0, hi = 0, lo2 = 0;
    for (int32_t i = (n <= SPEC_COST_N ? n : SPEC_COST_N); i >= 1; i--)
        if (c->t[i] > 0) {
            if (!lo) lo = i;
            else if (!lo2) { lo2 = i; break; }
        }
    for (int32_t i = n + 1; i <= SPEC_COST_N; i++)
        if (c->t[i] > 0) { hi = i; break; }
    if (lo && hi) return c->t[lo] + (c->t[hi] - c->t[lo]) * (double)(n - lo) / (double)(hi - lo);
    if (hi) return c->t[hi]; /* below every point: t grows with n, so this is an upper bound */
    if (!lo) return 0.0;
    if (!lo2) return c->t[lo];
    double slope = (c->t[lo] - c->t[lo2]) / (double)(lo - lo2);
    return c->t[lo] + (slope > 0 ? slope : 0.0) * (double)(n - lo);
}


double spec_cost_draft(const spec_cost *c, int32_t r, double prior_secs) {
    if (r < 1) r = 1;
    if (r > SPEC_COST_N) r = SPEC_COST_N;
    for (int32_t i = r; i >= 1; i--)
        if (c->d[i] > 0) return c->d[i];
    for (int32_t i = r + 1; i <= SPEC_COST_N; i++)
        if (c->d[i] > 0) return c->d[i];
    return prior_secs;
}

void spec_cost_observe_target(spec_cost *c, int32_t n, double secs) {
    if (n < 1 || n > SPEC_COST_N || !(secs > 0) || !spec_cost_ready(c)) return;
    /* the load: the whole curve moves by (measured / predicted)^0.1, the n
     * not visited lately included (moving only the visited n made the others
     * stale: under a rising load the plain pass looked dear next to a
     * 4-token verify measured at a quieter time, and drafting looked cheap);
     * the shape: this n moves a further ^0.05 toward its own measurement */
    double r = secs / spec_cost_target(c, n);
    r = r < 0.25 ? 0.25 : (r > 4.0 ? 4.0 : r);
    const double g = pow(r, 0.1);
    for (int32_t i = 1; i <= SPEC_COST_N; i++) c->t[i] *= g;
    if (c->t[n] > 0) { /* a calibrated n (others are interpolated between them) */
        double r2 = secs / c->t[n];
        r2 = r2 < 0.25 ? 0.25 : (r2 > 4.0 ? 4.0 : r2);
        c->t[n] *= pow(r2, 0.05);
    }
}

void spec_cost_observe_draft(spec_cost *c, int32_t r, double secs_per_step) {
    if (r < 1 || r > SPEC_COST_N || !(secs_per_step > 0)) return;
    c->d[r] = c->d[r] > 0 ? 0.8 * c->d[r] + 0.2 * secs_per_step : secs_per_step;
}

void spec_cost_shares(const spec_cost *c, int32_t batch, int32_t kmax, double *t_draft, double *t_verify) {
    if (batch < 1) batch = 1;
    const double t1 = spec_cost_target(c, batch) / (double)batch;
    *t_draft = spec_cost_draft(c, batch, SPEC_ADAPT_NOMINAL_DRAFT * spec_cost_target(c, 1)) / (double)batch;
    for (int32_t k = 0; k <= kmax; k++) {
        t_verify[k] = spec_cost_target(c, batch * (k + 1)) / (double)batch;
        if (!(t_verify[k] > 0)) t_verify[k] = t1 > 0 ? t1 : 1.0;
    }
}

void spec_cost_nominal(int32_t kmax, double *t_draft, double *t_verify) {
    *t_draft = SPEC_ADAPT_NOMINAL_DRAFT;
    for (int32_t k = 0; k <= kmax; k++) t_verify[k] = 1.0 + SPEC_ADAPT_NOMINAL_SLOPE * (double)k;
}

/* ---------------------------------------------------------------- engine */

double engine_cost_clock(const engine *e) { return e->runner.now ? e->runner.now(e->runner.ctx) : engine_now_s(); }

/* The fastest of three timed target passes of n tokens of one scratch
 * sequence (positions 0..n-1, KV written into blocks held only for the
 * calibration), the three rounds interleaved over n: another process's burst
 * only ever adds time, and interleaving spreads it over every n instead of
 * inverting the curve (a loaded machine gave 141 ms for 1 token, 84 ms for 4
 * with three consecutive passes per n). */
int spec_adapt_calibrate(engine *e) {
    spec_cost_init(&e->cost);
    const int32_t K = e->cfg.num_speculative_tokens > SPEC_ADAPT_KMAX ? SPEC_ADAPT_KMAX : e->cfg.num_speculative_tokens;
    if (K <= 0) return 0;
    int32_t nmax = 16 * (K + 1); /* 16 sequences verifying K + 1 each; beyond, t(n) is extrapolated */
    if (nmax > SPEC_COST_N) nmax = SPEC_COST_N;
    if (nmax > e->cfg.max_num_batched_tokens) nmax = e->cfg.max_num_batched_tokens;
    if (nmax > e->cfg.max_model_len) nmax = e->cfg.max_model_len;
    int32_t pts[32], n_pts = 0;
    for (int32_t j = 1; j <= K + 1 && j <= nmax; j++) pts[n_pts++] = j;
    for (int32_t j = 2 * (K + 1); j <= nmax && n_pts < 32; j *= 2) pts[n_pts++] = j;
    if (n_pts == 0) return 0;
    nmax = pts[n_pts - 1];
    kv_seq kv;
    kv_seq_init(&kv);
    int32_t *tok = calloc((size_t)nmax * 3, sizeof *tok);
    float *logits = malloc((size_t)e->runner.vocab * sizeof *logits);
    float *aux = e->n_aux > 0 ? malloc((size_t)nmax * (size_t)e->n_aux * (size_t)e->runner.hidden * sizeof *aux) : NULL;
    int rc = 0;
    if (!tok || !logits || (e->n_aux > 0 && !aux) || kv_seq_ensure(e->kv, &kv, nmax, NULL) != 0) {
        LOG_WARN("engine: adaptive speculation: no memory for the calibration passes; fixed k = %d", K);
        rc = -1;
        goto done;
    }
    int32_t *pos = tok + nmax, *seq_of = pos + nmax;
    for (int32_t i = 0; i < nmax; i++) pos[i] = i;
    const int32_t *tables[1] = {kv.blocks};
    char line[512];
    int len = 0;
    double best[32];
    for (int r = 0; r < 3; r++)
        for (int32_t p = 0; p < n_pts; p++) {
            const int32_t n = pts[p];
            int32_t out = n - 1;
            model_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seq_of = seq_of, .n_seqs = 1,
                             .block_tables = tables, .n_out = 1, .out_idx = &out, .logits = logits,
                             .n_aux = e->n_aux, .aux_layers = e->n_aux > 0 ? e->aux_layers : NULL, .aux = aux};
            specd_err err = {0};
            double t0 = engine_cost_clock(e);
            if (e->runner.forward(e->runner.ctx, &b, &err) != 0) {
                LOG_WARN("engine: adaptive speculation: calibration pass of %d tokens failed (fixed k = %d): %s", n,
                         K, err.msg);
                spec_cost_init(&e->cost);
                rc = -1;
                goto done;
            }
            double dt = engine_cost_clock(e) - t0;
            best[p] = r == 0 || dt < best[p] ? dt : best[p];
        }
    for (int32_t p = 0; p < n_pts; p++) {
        spec_cost_set_calibrated(&e->cost, pts[p], best[p]);
        if (len < (int)sizeof line - 32)
            len += snprintf(line + len, sizeof line - (size_t)len, " %d:%.2f", pts[p], best[p] * 1e3);
    }
    LOG_INFO("engine: adaptive speculation, target pass ms by tokens:%s", line);
done:
    kv_seq_free(e->kv, &kv);
    free(tok);
    free(logits);
    free(aux);
    return rc;
}

void spec_adapt_begin_step(engine *e) {
    int32_t batch = 0;
    for (size_t i = 0; i < e->n_running; i++) {
        const sched_seq *s = e->running[i];
        if (s->n_computed == s->n_tokens - 1) batch++;
    }
    spec_cost_shares(&e->cost, batch, SPEC_ADAPT_KMAX, &e->ad_t_draft, e->ad_t_verify);
}

int32_t spec_adapt_k(const engine *e, const sched_seq *s) {
    const int32_t K = s->k > SPEC_ADAPT_KMAX ? SPEC_ADAPT_KMAX : s->k;
    double a[SPEC_ADAPT_KMAX];
    spec_accept_upper(&s->acc, K, a);
    int32_t k;
    if (s->sp.has_seed && !sampler_is_greedy(&s->sp)) {
        double td, tv[SPEC_ADAPT_KMAX + 1];
        spec_cost_nominal(K, &td, tv);
        k = spec_adapt_choose(a, K, td, tv);
    } else if (!spec_cost_ready(&e->cost)) {
        return K;
    } else {
        k = spec_adapt_choose(a, K, e->ad_t_draft, e->ad_t_verify);
    }
    return k;
}

void spec_adapt_after_forward(engine *e, double secs) {
    int32_t n = 0;
    for (size_t i = 0; i < e->n_sched; i++) n += e->sched[i]->sched_new;
    spec_cost_observe_target(&e->cost, n, secs);
}
