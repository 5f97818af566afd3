/*
 * sampler.c: logits processing, sampling, raw logprobs and the speculative
 * acceptance rule (see sampler.h for the processing order and its sources).
 *
 * Determinism: every reduction runs in id order in double precision, so the
 * result for a row depends only on that row, the parameters, the history and
 * the request's RNG state, never on the batch. Sorting (top-p only) uses a
 * total order (probability desc, id asc).
 *
 * Threading: the work buffers belong to one thread.
 */
#include "engine/runtime/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct sampler_pair {
    float p;
    int32_t id;
} sampler_pair;

struct sampler_work {
    int32_t vocab;
    int32_t *count;   /* [vocab] output-token counts (zero between calls) */
    uint8_t *seen;    /* [vocab] prompt+output membership (zero between calls) */
    sampler_pair *pairs; /* [vocab] top-p sort buffer */
    float *row;       /* [vocab] processed logits */
    float *tmp;       /* [vocab] top-k selection scratch, residual */
    float *prob;      /* [vocab] sampler_sample's distribution */
};

/* ---------------------------------------------------------------- RNG */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void sampler_rng_seed(sampler_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t sampler_rng_next(sampler_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double sampler_rng_uniform(sampler_rng *r) { return (double)(sampler_rng_next(r) >> 11) * 0x1.0p-53; }

/* ---------------------------------------------------------------- work */

sampler_work *sampler_work_create(int32_t vocab) {
    if (vocab < 1) return NULL;
    sampler_work *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->vocab = vocab;
    w->count = calloc((size_t)vocab, sizeof *w->count);
    w->seen = calloc((size_t)vocab, 1);
    w->pairs = malloc((size_t)vocab * sizeof *w->pairs);
    w->row = malloc((size_t)vocab * sizeof *w->row);
    w->tmp = malloc((size_t)vocab * sizeof *w->tmp);
    w->prob = malloc((size_t)vocab * sizeof *w->prob);
    if (!w->count || !w->seen || !w->pairs || !w->row || !w->tmp || !w->prob) {
        sampler_work_destroy(w);
        return NULL;
    }
    return w;
}

void sampler_work_destroy(sampler_work *w) {
    if (!w) return;
    free(w->count);
    free(w->seen);
    free(w->pairs);
    free(w->row);
    free(w->tmp);
    free(w->prob);
    free(w);
}

bool sampler_is_greedy(const sampling_params *sp) { return !(sp->temperature >= SAMPLER_GREEDY_EPS); }

/* ---------------------------------------------------------------- penalties */

static bool in_vocab(int32_t t, int32_t v) { return t >= 0 && t < v; }

void sampler_apply_penalties(sampler_work *w, const sampling_params *sp, const sampler_hist *h, float *logits) {
    const int32_t V = w->vocab;
    for (size_t i = 0; i < h->n_suppress; i++)
        if (in_vocab(h->suppress[i], V)) logits[h->suppress[i]] = -INFINITY;

    float rp = sp->repetition_penalty;
    if (rp > 0.0f && rp != 1.0f) {
        for (int pass = 0; pass < 2; pass++) {
            const int32_t *ids = pass ? h->output : h->prompt;
            size_t n = pass ? h->n_output : h->n_prompt;
            for (size_t i = 0; i < n; i++) {
                int32_t t = ids[i];
                if (!in_vocab(t, V) || w->seen[t]) continue;
                w->seen[t] = 1;
                logits[t] = logits[t] > 0.0f ? logits[t] / rp : logits[t] * rp;
            }
        }
        for (int pass = 0; pass < 2; pass++) {
            const int32_t *ids = pass ? h->output : h->prompt;
            size_t n = pass ? h->n_output : h->n_prompt;
            for (size_t i = 0; i < n; i++)
                if (in_vocab(ids[i], V)) w->seen[ids[i]] = 0;
        }
    }

    float fp = sp->frequency_penalty, pp = sp->presence_penalty;
    if (fp != 0.0f || pp != 0.0f) {
        for (size_t i = 0; i < h->n_output; i++)
            if (in_vocab(h->output[i], V)) w->count[h->output[i]]++;
        for (size_t i = 0; i < h->n_output; i++) {
            int32_t t = h->output[i];
            if (!in_vocab(t, V) || w->count[t] == 0) continue;
            logits[t] -= fp * (float)w->count[t] + pp;
            w->count[t] = 0; /* each id once; also resets the scratch */
        }
    }

    for (size_t i = 0; i < sp->n_logit_bias; i++)
        if (in_vocab(sp->logit_bias_ids[i], V)) logits[sp->logit_bias_ids[i]] += sp->logit_bias[i];

    if (h->n_output < sp->n_forced_ids && in_vocab(sp->forced_ids[h->n_output], V)) {
        int32_t f = sp->forced_ids[h->n_output];
        for (int32_t i = 0; i < V; i++)
            if (i != f) logits[i] = -INFINITY;
        logits[f] = 0.0f; /* finite even if a suppression or bias made it -inf */
    }
}

/* ---------------------------------------------------------------- helpers */

int32_t sampler_argmax(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best] || (isnan(x[best]) && !isnan(x[i]))) best = i;
    return best;
}

int32_t sampler_draw(const float *p, int32_t vocab, double u) {
    double total = 0.0;
    for (int32_t i = 0; i < vocab; i++) total += p[i];
    double target = u * total, acc = 0.0;
    int32_t last = -1;
    for (int32_t i = 0; i < vocab; i++) {
        if (!(p[i] > 0.0f)) continue;
        acc += p[i];
        last = i;
        if (target < acc) return i;
    }
    return last >= 0 ? last : 0;
}

/* k-th largest value of x[0..n) (1-based k), by quickselect on a copy. */
static float kth_largest(float *buf, int32_t n, int32_t k) {
    int32_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float pivot = buf[lo + (hi - lo) / 2];
        int32_t i = lo, j = hi;
        while (i <= j) {
            while (buf[i] > pivot) i++;
            while (buf[j] < pivot) j--;
            if (i <= j) {
                float t = buf[i];
                buf[i] = buf[j];
                buf[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return buf[want];
}

/* Softmax of row into p over ids with finite logits (others 0): one expf per
 * id, the sum in double in id order, one scale. */
static void softmax_row(const float *row, int32_t V, float *p) {
    float mx = -INFINITY;
    for (int32_t i = 0; i < V; i++)
        if (row[i] > mx) mx = row[i];
    if (!(mx > -INFINITY)) { /* everything filtered: cannot happen (argmax survives); uniform fallback */
        for (int32_t i = 0; i < V; i++) p[i] = 1.0f / (float)V;
        return;
    }
    double sum = 0.0;
    for (int32_t i = 0; i < V; i++) {
        float e = row[i] > -INFINITY ? expf(row[i] - mx) : 0.0f;
        p[i] = e;
        sum += e;
    }
    float inv = (float)(1.0 / sum);
    for (int32_t i = 0; i < V; i++) p[i] *= inv;
}

static int32_t amax_of(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int cmp_prob_desc(const void *a, const void *b) {
    const sampler_pair *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

/* ---------------------------------------------------------------- processing */

int32_t sampler_probs(sampler_work *w, const sampling_params *sp, const sampler_hist *h, const float *logits,
                      float *p) {
    const int32_t V = w->vocab;
    float *row = w->row;
    memcpy(row, logits, (size_t)V * sizeof *row);
    sampler_apply_penalties(w, sp, h, row);
    int32_t amax = sampler_argmax(row, V);
    if (sampler_is_greedy(sp)) {
        memset(p, 0, (size_t)V * sizeof *p);
        p[amax] = 1.0f;
        return amax;
    }
    float inv_t = 1.0f / sp->temperature;
    for (int32_t i = 0; i < V; i++) row[i] *= inv_t;

    if (sp->top_k > 0 && sp->top_k < V) {
        int32_t n = 0;
        for (int32_t i = 0; i < V; i++)
            if (row[i] > -INFINITY) w->tmp[n++] = row[i];
        if (sp->top_k < n) {
            float kth = kth_largest(w->tmp, n, sp->top_k);
            for (int32_t i = 0; i < V; i++)
                if (row[i] < kth) row[i] = -INFINITY;
        }
    }
    softmax_row(row, V, p);

    if (sp->top_p > 0.0f && sp->top_p < 1.0f) {
        /* Only ids with p >= t can be kept once the mass of {p >= t} reaches
         * top_p (the first id past that set has mass >= top_p before it), so
         * sort just those; t is lowered until the set is big enough, and the
         * full set is the fallback if rounding ever lets the walk run out. */
        float pmax = p[amax_of(p, V)];
        double t = (double)pmax * 1e-4;
        for (;;) {
            int32_t n = 0, n_pos = 0;
            double mass = 0.0;
            for (int32_t i = 0; i < V; i++) {
                if (!(p[i] > 0.0f)) continue;
                n_pos++;
                if ((double)p[i] >= t) {
                    w->pairs[n++] = (sampler_pair){p[i], i};
                    mass += p[i];
                }
            }
            if (mass < (double)sp->top_p && n < n_pos) {
                t = t > 1e-30 ? t * 1e-3 : 0.0;
                continue;
            }
            qsort(w->pairs, (size_t)n, sizeof *w->pairs, cmp_prob_desc);
            double before = 0.0;
            int32_t keep = 0;
            while (keep < n && (keep == 0 || before < (double)sp->top_p)) before += w->pairs[keep++].p;
            if (keep == n && before < (double)sp->top_p && n < n_pos) {
                t = 0.0;
                continue;
            }
            for (int32_t i = 0; i < V; i++)
                if (p[i] > 0.0f && (double)p[i] < t) row[i] = -INFINITY;
            for (int32_t r = keep; r < n; r++) row[w->pairs[r].id] = -INFINITY;
            break;
        }
        softmax_row(row, V, p);
    }
    if (sp->min_p > 0.0f) {
        float pmax = p[sampler_argmax(p, V)];
        float thr = sp->min_p * pmax;
        bool cut = false;
        for (int32_t i = 0; i < V; i++)
            if (p[i] > 0.0f && p[i] < thr) {
                row[i] = -INFINITY;
                cut = true;
            }
        if (cut) softmax_row(row, V, p);
    }
    return amax;
}

int32_t sampler_sample(sampler_work *w, const sampling_params *sp, const sampler_hist *h, sampler_rng *rng,
                       const float *logits) {
    if (sampler_is_greedy(sp)) {
        memcpy(w->row, logits, (size_t)w->vocab * sizeof *w->row);
        sampler_apply_penalties(w, sp, h, w->row);
        return sampler_argmax(w->row, w->vocab);
    }
    sampler_probs(w, sp, h, logits, w->prob);
    return sampler_draw(w->prob, w->vocab, sampler_rng_uniform(rng));
}

/* ---------------------------------------------------------------- logprobs */

void sampler_logprobs(const float *logits, int32_t vocab, int32_t token, int32_t n_top, token_logprob *out) {
    float mx = -INFINITY;
    for (int32_t i = 0; i < vocab; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0.0;
    for (int32_t i = 0; i < vocab; i++) sum += exp((double)logits[i] - mx);
    double lse = (double)mx + log(sum);
    out->id = token;
    out->logprob = (token >= 0 && token < vocab) ? (float)((double)logits[token] - lse) : -INFINITY;
    if (n_top < 0) n_top = 0;
    if (n_top > 20) n_top = 20;
    if (n_top > vocab) n_top = vocab;
    /* insertion into a sorted top list: (logit desc, id asc); strict > keeps lower ids first */
    int32_t n = 0;
    for (int32_t i = 0; i < vocab && n_top > 0; i++) {
        float v = logits[i];
        if (n == n_top && !(v > logits[out->top_ids[n - 1]])) continue;
        int32_t j = n < n_top ? n++ : n - 1;
        while (j > 0 && v > logits[out->top_ids[j - 1]]) {
            out->top_ids[j] = out->top_ids[j - 1];
            j--;
        }
        out->top_ids[j] = i;
    }
    out->n_top = n;
    for (int32_t j = 0; j < n; j++) out->top_logprobs[j] = (float)((double)logits[out->top_ids[j]] - lse);
}

/* ---------------------------------------------------------------- acceptance */

int sampler_accept(const float *p, const float *q, int32_t vocab, int32_t x, sampler_rng *rng, sampler_work *w,
                   int32_t *out) {
    double px = (x >= 0 && x < vocab) ? p[x] : 0.0;
    double qx = (x >= 0 && x < vocab) ? (q ? q[x] : 1.0) : 1.0;
    double u = sampler_rng_uniform(rng);
    if (px > 0.0 && (qx <= 0.0 || u * qx < px)) {
        *out = x;
        return 1;
    }
    /* residual normalise(max(0, p - q)) */
    float *r = w->tmp;
    double total = 0.0;
    for (int32_t i = 0; i < vocab; i++) {
        float qi = q ? q[i] : (i == x ? 1.0f : 0.0f);
        float d = p[i] - qi;
        r[i] = d > 0.0f ? d : 0.0f;
        total += r[i];
    }
    double u2 = sampler_rng_uniform(rng);
    *out = total > 0.0 ? sampler_draw(r, vocab, u2) : sampler_draw(p, vocab, u2);
    return 0;
}
