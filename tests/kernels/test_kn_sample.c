/*
 * test_kn_sample.c: kernels/kn_philox.h, kn_sample and kn_spec_verify
 * (kernels/kn_sample.h) against the CPU sampler (engine/runtime/sampler.c).
 *
 * Without a GPU (run before the probe):
 *  - Philox4x32-10 known answers (Random123 kat_vectors);
 *  - ref_accept (this file's host verifier, taking its uniforms as inputs)
 *    == sampler_accept fed the same uniforms (drawn from a copy of its RNG),
 *    on random rows: so the host reference below IS the CPU's rule;
 *  - launcher refusals.
 * On the GPU:
 *  1. device Philox == host Philox, bitwise (kn_philox_uniforms);
 *  2. kn_sample vs sampler_probs + sampler_draw(p, kn_philox_uniform(seed,
 *     pos, 0)) (greedy: sampler_sample), 12 parameter sets x 8 rows x vocab
 *     {100, 1000, 49152}: the same token on every row; the processed distribution
 *     has the same support and max |p_gpu - p_cpu| <= 1e-6 (f32 expf and a
 *     different double-sum order: a few ulps); each row alone (n_rows = 1)
 *     gives the same bits as inside the batch. The logits sit on a 1/16 grid
 *     with a low tail, temperatures / penalties keep them on a 1/64 grid and
 *     min_p = exp(-3 - 1/128), so no top-k / min-p / top-p decision is within
 *     rounding of its threshold; a draw can still differ where u falls within
 *     ~4e-7 of a cumulative boundary: false-failure probability < 1e-4.
 *     Three sets cover what the engine's device sampling adds (cuda_backend.c
 *     cu_sample): OpenAI logit_bias (on the 1/16 grid, a duplicate id that
 *     accumulates, an id out of range), the test-only forced id, and the
 *     host's uniform (params.use_u: the request's own RNG, compared with
 *     sampler_draw at that u).
 *  3. kn_spec_verify vs ref_verify (the CPU's spec_verify_seq rule with
 *     Philox uniforms) on 96 sequences (greedy, sampled with q, one-hot
 *     drafts; 0..4 drafts): accepted counts and tokens identical; again with
 *     the host's uniforms (u [n, K + 2], consumed in sampler_accept's order)
 *     and the rows of the sequences in reverse order (row0), as the engine
 *     lays them out.
 *  3b. kn_spec_verify with q over a DRAFT vocabulary (120 of 300 ids) read
 *     through t2d, one device pointer per draft (shuffled rows, some NULL:
 *     one-hot), drafts inside and outside the draft vocabulary, host
 *     uniforms: identical to ref_verify over q scattered to target ids.
 *  2b. kn_sample_draw (test_draw, V = 100 and 32000) vs sampler_probs +
 *     sampler_draw with a temperature only, then d2t: same tokens, q within
 *     1e-6, greedy rows one-hot; in place and with a 64-bit d2t.
 *  4. distribution: 200,000 sequences, V = 8, 3 drafts drawn from q: the
 *     first emitted token ~ p (Leviathan et al. 2023, Theorem 1); chi-square,
 *     6 degrees of freedom (one id has p = 0 and must never appear), fails
 *     below p-value 1e-6 (that is the false-failure rate); again with one-hot
 *     (argmax) drafts. KN_TEST_SMALL=1 (kn_harness.h, for tools/kn_emu):
 *     20,000 sequences (same false-failure rate, less power).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "engine/runtime/sampler.h"
#include "kernels/kn_philox.h"
#include "kernels/kn_sample.h"
#include "tests/kernels/kn_harness.h"
#include "tests/stats_chi2.h"



static uint64_t g_rng = 12345;
static uint64_t rnd(void) { return g_rng = kn_mix64(g_rng); }
static double rnd_u(void) { return (double)(rnd() >> 11) * 0x1.0p-53; }
static int32_t rnd_int(int32_t n) { return (int32_t)(rnd() % (uint64_t)n); }

static void *dmalloc_copy(const void *h, size_t bytes) {
    void *d = NULL;
    KN_CK(cudaMalloc(&d, bytes ? bytes : 1));
    if (h && bytes) KN_CK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}

/* ------------------------------------------------------------ host references */

/* sampler_accept's rule with its two uniforms given (u: the test, u2: the
 * residual draw). */
static int ref_accept(const float *p, const float *q, int32_t V, int32_t x, double u, double u2, float *tmp,
                      int32_t *out) {
    double px = (x >= 0 && x < V) ? p[x] : 0.0;
    double qx = (x >= 0 && x < V) ? (q ? q[x] : 1.0) : 1.0;
    if (px > 0.0 && (qx <= 0.0 || u * qx < px)) {
        *out = x;
        return 1;
    }
    double total = 0.0;
    for (int32_t i = 0; i < V; i++) {
        float qi = q ? q[i] : (i == x ? 1.0f : 0.0f);
        float d = p[i] - qi;
        tmp[i] = d > 0.0f ? d : 0.0f;
        total += tmp[i];
    }
    *out = total > 0.0 ? sampler_draw(tmp, V, u2) : sampler_draw(p, V, u2);
    return 0;
}

/* spec_verify_seq's chain rule with Philox uniforms: p [k+1, V], q [k, V] or
 * NULL, tt [k+1] argmax rows. Returns the accepted count; out[0..a]. */
static int32_t ref_verify(const float *p, const float *q, const int32_t *tt, const int32_t *d, int32_t nd,
                          int greedy, uint64_t seed, int32_t pos0, const double *uh, int32_t V, float *tmp,
                          int32_t *out) {
    if (greedy) {
        int32_t a = 0;
        while (a < nd && d[a] == tt[a]) out[a] = d[a], a++;
        out[a] = tt[a];
        return a;
    }
    for (int32_t j = 0; j < nd; j++) {
        const double u = uh ? uh[j] : kn_philox_uniform(seed, pos0 + j, 0);
        const double u2 = uh ? uh[j + 1] : kn_philox_uniform(seed, pos0 + j, 1);
        if (!ref_accept(p + (size_t)j * V, q ? q + (size_t)j * V : NULL, V, d[j], u, u2, tmp, &out[j])) return j;
    }
    out[nd] = sampler_draw(p + (size_t)nd * V, V, uh ? uh[nd] : kn_philox_uniform(seed, pos0 + nd, 0));
    return nd;
}

/* ------------------------------------------------------------ host-only tests */

static void test_philox_kat(void) {
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d, 0x41c83b0e, 0xa20bc7c6,
         0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09, 0x94fdcceb, 0x5001e420,
         0x24126ea1},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        kn_philox4x32_10(kat[i], kat[i] + 4, out);
        KN_EXPECT(memcmp(out, kat[i] + 6, sizeof out) == 0, "philox KAT %d: %08x %08x %08x %08x", i, out[0], out[1],
               out[2], out[3]);
    }
    double lo = 1, hi = 0, mean = 0;
    for (int i = 0; i < 100000; i++) {
        double u = kn_philox_uniform(7, i, (uint32_t)(i & 1));
        lo = u < lo ? u : lo, hi = u > hi ? u : hi, mean += u;
    }
    mean /= 100000;
    KN_EXPECT(lo >= 0 && hi < 1 && fabs(mean - 0.5) < 0.005, "philox uniforms: min %g max %g mean %g", lo, hi, mean);
}

/* ref_accept == sampler_accept given the same two uniforms. */
static void test_ref_accept_is_cpu(void) {
    enum { V = 64 };
    float p[V], q[V], tmp[V];
    sampler_work *w = sampler_work_create(V);
    int agree = 0, n = 100000;
    for (int it = 0; it < n; it++) {
        double sp = 0, sq = 0;
        for (int i = 0; i < V; i++) {
            p[i] = rnd_int(4) == 0 ? 0.0f : (float)rnd_u();
            q[i] = rnd_int(4) == 0 ? 0.0f : (float)rnd_u();
            sp += p[i], sq += q[i];
        }
        for (int i = 0; i < V; i++) p[i] = (float)(p[i] / sp), q[i] = (float)(q[i] / sq);
        int32_t x = rnd_int(V);
        int one_hot = it % 3 == 0;
        sampler_rng r1, r2;
        sampler_rng_seed(&r1, (uint64_t)it);
        r2 = r1;
        int32_t o1, o2;
        int a1 = sampler_accept(p, one_hot ? NULL : q, V, x, &r1, w, &o1);
        double u = sampler_rng_uniform(&r2), u2 = sampler_rng_uniform(&r2);
        int a2 = ref_accept(p, one_hot ? NULL : q, V, x, u, u2, tmp, &o2);
        agree += a1 == a2 && o1 == o2;
    }
    KN_EXPECT(agree == n, "ref_accept differs from sampler_accept on %d of %d rows", n - agree, n);
    sampler_work_destroy(w);
}

static void test_refusals(void) {
    void *f = (void *)(uintptr_t)0x1000;
    const int inval = (int)cudaErrorInvalidValue;
    size_t need = kn_sample_scratch_bytes(3, 1000);
    KN_EXPECT(need == 3 * (((size_t)3 * 1000 * 4 + 255) / 256 * 256), "scratch bytes %zu", need);
    KN_EXPECT(kn_sample(f, f, f, f, f, f, 3, 1000, f, f, f, need - 1, NULL) == inval, "small scratch accepted");
    KN_EXPECT(kn_sample(f, f, f, f, f, f, 3, 0, f, f, f, need, NULL) == inval, "vocab 0 accepted");
    KN_EXPECT(kn_sample(f, f, f, f, f, f, 0, 1000, f, f, f, 0, NULL) == 0, "0 rows refused");
    KN_EXPECT(kn_spec_verify(NULL, NULL, 0, NULL, NULL, f, f, f, f, f, NULL, NULL, 2, 3, 100, f, f, NULL) == inval,
           "no p and no argmax rows");
    KN_EXPECT(kn_spec_verify(f, NULL, 0, NULL, f, NULL, f, f, f, f, NULL, NULL, 2, 3, 100, f, f, NULL) == inval,
           "no drafts with k_max 3");
    KN_EXPECT(kn_spec_verify(f, f, 50, NULL, f, f, f, f, f, f, NULL, NULL, 2, 3, 100, f, f, NULL) == inval,
           "q rows of 50 columns without t2d over a vocabulary of 100");
    KN_EXPECT(kn_spec_verify(f, f, 0, f, f, f, f, f, f, f, NULL, NULL, 2, 3, 100, f, f, NULL) == inval,
           "q rows of 0 columns");
    KN_EXPECT(kn_philox_uniforms(f, f, f, -1, f, NULL) == inval, "n < 0 accepted");
    const size_t dneed = kn_sample_draw_scratch_bytes(3, 1000);
    KN_EXPECT(dneed == (3 * sizeof(kn_sample_params) + 255) / 256 * 256 + need, "draw scratch bytes %zu", dneed);
    KN_EXPECT(kn_sample_draw(f, f, f, 32, 3, 1000, f, f, f, dneed - 1, NULL) == inval, "draw: small scratch accepted");
    KN_EXPECT(kn_sample_draw(f, f, f, 16, 3, 1000, f, f, f, dneed, NULL) == inval, "draw: d2t of 16 bits accepted");
    KN_EXPECT(kn_sample_draw(f, f, NULL, 0, 3, 1000, NULL, f, f, dneed, NULL) == inval, "draw: no out_token accepted");
}

/* ------------------------------------------------------------ GPU tests */

/* kn_sample_draw (EAGLE-3's sampled drafts, bk_ops.draw) vs sampler_probs + sampler_draw(p, Philox(seed, pos,
 * 0)) with only a temperature, then d2t: 24 rows (temperatures 0, 1e-6 greedy; 0.5 .. 2 sampled), logits on a
 * 1/16 grid: the same token on every row, max |q_gpu - q_cpu| <= 1e-6, greedy q one-hot exactly; again with q
 * written over the logits in place (what the proposer does) and with 64-bit d2t: the same tokens. */
static void test_draw(int32_t V) {
    enum { R = 24 };
    static const float temps[8] = {0.0f, 1e-6f, 0.5f, 0.7f, 0.8f, 1.0f, 1.3f, 2.0f};
    float *logits = malloc((size_t)R * V * sizeof(float)), *q_gpu = malloc((size_t)R * V * sizeof(float));
    float *q_cpu = malloc((size_t)V * sizeof(float));
    int32_t *d2t = malloc((size_t)V * sizeof(int32_t)), tok_gpu[R], tok2[R];
    int64_t *d2t64 = malloc((size_t)V * sizeof(int64_t));
    kn_draw_params prm[R];
    for (size_t i = 0; i < (size_t)R * V; i++) logits[i] = (float)(rnd_int(160) - 120) / 16.0f;
    for (int32_t i = 0; i < V; i++) d2t[i] = 3 * i + 1, d2t64[i] = 3 * i + 1; /* target id 4 id + 1 */
    for (int32_t r = 0; r < R; r++) prm[r] = (kn_draw_params){temps[r % 8], 100 + 7 * r, rnd()};
    float *d_logits = dmalloc_copy(logits, (size_t)R * V * sizeof(float)), *d_q = dmalloc_copy(NULL, (size_t)R * V * 4);
    kn_draw_params *d_prm = dmalloc_copy(prm, sizeof prm);
    int32_t *d_d2t = dmalloc_copy(d2t, (size_t)V * 4), *d_tok = dmalloc_copy(NULL, sizeof tok_gpu);
    int64_t *d_d2t64 = dmalloc_copy(d2t64, (size_t)V * 8);
    const size_t sb = kn_sample_draw_scratch_bytes(R, V);
    void *d_scr = dmalloc_copy(NULL, sb);
    KN_CK(kn_sample_draw(d_logits, d_prm, d_d2t, 32, R, V, d_tok, d_q, d_scr, sb, NULL));
    KN_CK(cudaMemcpy(tok_gpu, d_tok, sizeof tok_gpu, cudaMemcpyDeviceToHost));
    KN_CK(cudaMemcpy(q_gpu, d_q, (size_t)R * V * 4, cudaMemcpyDeviceToHost));
    sampler_work *w = sampler_work_create(V);
    int tok_bad = 0, onehot_bad = 0;
    double worst = 0;
    for (int32_t r = 0; r < R; r++) {
        sampling_params sp;
        sampling_params_init(&sp);
        sp.temperature = prm[r].temperature;
        sampler_hist hh = {NULL, 0, NULL, 0, NULL, 0};
        const int32_t am = sampler_probs(w, &sp, &hh, logits + (size_t)r * V, q_cpu);
        const int32_t id = sampler_is_greedy(&sp) ? am : sampler_draw(q_cpu, V, kn_philox_uniform(prm[r].seed, prm[r].pos, 0));
        tok_bad += tok_gpu[r] != 4 * id + 1;
        for (int32_t i = 0; i < V; i++) {
            const double e = fabs((double)q_gpu[(size_t)r * V + i] - q_cpu[i]);
            worst = e > worst ? e : worst;
            if (sampler_is_greedy(&sp)) onehot_bad += q_gpu[(size_t)r * V + i] != (i == am ? 1.0f : 0.0f);
        }
    }
    KN_EXPECT(!tok_bad, "draw V=%d: %d of %d tokens differ from sampler_probs + sampler_draw", V, tok_bad, R);
    KN_EXPECT(worst <= 1e-6 && !onehot_bad, "draw V=%d: max |q_gpu - q_cpu| %g, %d greedy entries not one-hot", V,
              worst, onehot_bad);
    /* in place (q over the logits) with the 64-bit map */
    KN_CK(kn_sample_draw(d_logits, d_prm, d_d2t64, 64, R, V, d_tok, d_logits, d_scr, sb, NULL));
    KN_CK(cudaMemcpy(tok2, d_tok, sizeof tok2, cudaMemcpyDeviceToHost));
    KN_EXPECT(!memcmp(tok2, tok_gpu, sizeof tok2), "draw V=%d: in place / 64-bit d2t changed the tokens", V);
    sampler_work_destroy(w);
    cudaFree(d_logits), cudaFree(d_q), cudaFree(d_prm), cudaFree(d_d2t), cudaFree(d_tok), cudaFree(d_d2t64);
    cudaFree(d_scr);
    free(logits), free(q_gpu), free(q_cpu), free(d2t), free(d2t64);
}

static void test_philox_device(void) {
    enum { N = 4096 };
    uint64_t seed[N];
    int32_t pos[N];
    uint32_t draw[N];
    double host[N], dev[N];
    for (int i = 0; i < N; i++) {
        seed[i] = i < 8 ? (uint64_t)i : rnd();
        pos[i] = i % 5 == 0 ? (int32_t)rnd() : rnd_int(100000);
        draw[i] = (uint32_t)(i & 1);
        host[i] = kn_philox_uniform(seed[i], pos[i], draw[i]);
    }
    uint64_t *ds = dmalloc_copy(seed, sizeof seed);
    int32_t *dp = dmalloc_copy(pos, sizeof pos);
    uint32_t *dd = dmalloc_copy(draw, sizeof draw);
    double *dout = dmalloc_copy(NULL, sizeof dev);
    KN_CK(kn_philox_uniforms(ds, dp, dd, N, dout, NULL));
    KN_CK(cudaMemcpy(dev, dout, sizeof dev, cudaMemcpyDeviceToHost));
    KN_EXPECT(memcmp(host, dev, sizeof dev) == 0, "device Philox differs from the host's");
    printf("philox: %d device uniforms == host, bitwise\n", N);
    cudaFree(ds), cudaFree(dp), cudaFree(dd), cudaFree(dout);
}

typedef struct variant {
    const char *name;
    float temperature, top_p, min_p, rep, freq, pres;
    int32_t top_k;
    int suppress;
    int bias;   /* logit_bias entries (NB) */
    int forced; /* the test-only forced id */
    int host_u; /* the host's uniform instead of Philox */
} variant;

#define MIN_P 0.049399622f /* exp(-3 - 1/128): midway between multiples of 1/64 in log space */

static void test_sampler(int32_t V) {
    static const variant vars[] = {
        {"greedy", 0.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, -1, 0, 0, 0, 0},
        {"greedy+penalties+suppress", 0.0f, 1.0f, 0.0f, 2.0f, 0.5f, 0.25f, -1, 1, 0, 0, 0},
        {"temp 0.7", 0.7f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, -1, 0, 0, 0, 0},
        {"top_k 20 (ties)", 1.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 20, 0, 0, 0, 0},
        {"top_p 0.9", 1.0f, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, -1, 0, 0, 0, 0},
        {"top_p 0.5 temp 0.5", 0.5f, 0.5f, 0.0f, 1.0f, 0.0f, 0.0f, -1, 0, 0, 0, 0},
        {"min_p", 1.0f, 1.0f, MIN_P, 1.0f, 0.0f, 0.0f, -1, 0, 0, 0, 0},
        {"all", 0.5f, 0.95f, MIN_P, 2.0f, 0.5f, 0.25f, 25, 1, 0, 0, 0},
        {"top_k 1", 1.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 1, 0, 0, 0, 0},
        {"bias greedy", 0.0f, 1.0f, 0.0f, 1.0f, 0.5f, 0.0f, -1, 0, 1, 0, 0},
        {"bias host-u all", 0.5f, 0.95f, MIN_P, 2.0f, 0.5f, 0.25f, 25, 1, 1, 0, 1},
        {"forced host-u", 0.7f, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, -1, 1, 1, 1, 1},
    };
    enum { ROWS_PER = 8, NP = 40, NO = 12, NS = 3, NB = 5 };
    const int n_var = (int)(sizeof vars / sizeof vars[0]);
    const int32_t R = n_var * ROWS_PER;
    float *logits = malloc((size_t)R * V * sizeof(float));
    float *p_cpu = malloc((size_t)V * sizeof(float));
    float *p_gpu = malloc((size_t)R * V * sizeof(float));
    float *p_one = malloc((size_t)V * sizeof(float));
    int32_t *hist = malloc((size_t)R * (NP + NO) * sizeof(int32_t));
    int32_t *supp = malloc((size_t)R * NS * sizeof(int32_t));
    int32_t *bias_ids = malloc((size_t)R * NB * sizeof(int32_t));
    float *bias = malloc((size_t)R * NB * sizeof(float));
    kn_sample_params *prm = calloc((size_t)R, sizeof *prm);
    int32_t *tok_ref = malloc((size_t)R * sizeof(int32_t)), *tok_gpu = malloc((size_t)R * sizeof(int32_t));
    for (int32_t r = 0; r < R; r++) {
        const variant *vr = &vars[r / ROWS_PER];
        float *l = logits + (size_t)r * V;
        for (int32_t i = 0; i < V; i++) l[i] = (float)(-320 + rnd_int(128)) / 16.0f; /* tail: [-20, -12) */
        int32_t head[30];
        for (int b = 0; b < 30; b++) head[b] = rnd_int(V), l[head[b]] = (float)rnd_int(97) / 16.0f; /* [0, 6], ties */
        int32_t *h = hist + (size_t)r * (NP + NO);
        for (int i = 0; i < NP + NO; i++) h[i] = rnd_int(4) == 0 ? rnd_int(V) : rnd_int(64); /* repeats */
        h[0] = head[4], h[1] = head[5];                                               /* prompt */
        h[NP + 2] = h[NP + 3] = head[0], h[NP + 4] = head[1], h[NP + 5] = head[2];    /* output, head[0] twice */
        h[NP + 1] = V + 5;                                                            /* out of vocabulary: ignored */
        int32_t *sp = supp + (size_t)r * NS;
        sp[0] = sampler_argmax(l, V), sp[1] = rnd_int(V), sp[2] = -3;
        int32_t *bi = bias_ids + (size_t)r * NB;
        float *bv = bias + (size_t)r * NB;
        /* on the 1/16 grid: a tail id lifted into the head, a head id pushed down twice (accumulates), a
         * head id lifted, an id out of range (ignored) */
        bi[0] = rnd_int(V), bv[0] = 18.0f;
        bi[1] = head[3], bv[1] = -1.25f;
        bi[2] = head[3], bv[2] = -2.5f;
        bi[3] = head[6], bv[3] = 1.5f;
        bi[4] = V + 1, bv[4] = 3.0f;
        kn_sample_params *P = &prm[r];
        P->bias_off = r * NB, P->n_bias = vr->bias ? NB : 0;
        P->forced_on = vr->forced, P->forced_id = vr->forced ? head[7] : 0;
        P->use_u = vr->host_u, P->u = rnd_u();
        P->temperature = vr->temperature, P->top_p = vr->top_p, P->top_k = vr->top_k, P->min_p = vr->min_p;
        P->repetition_penalty = vr->rep, P->frequency_penalty = vr->freq, P->presence_penalty = vr->pres;
        P->seed = rnd(), P->pos = rnd_int(1 << 20);
        P->hist_off = r * (NP + NO), P->n_prompt = NP, P->n_output = NO;
        P->supp_off = r * NS, P->n_suppress = vr->suppress ? NS : 0;
    }
    /* GPU, all rows in one batch */
    float *d_logits = dmalloc_copy(logits, (size_t)R * V * sizeof(float));
    kn_sample_params *d_prm = dmalloc_copy(prm, (size_t)R * sizeof *prm);
    int32_t *d_hist = dmalloc_copy(hist, (size_t)R * (NP + NO) * sizeof(int32_t));
    int32_t *d_supp = dmalloc_copy(supp, (size_t)R * NS * sizeof(int32_t));
    int32_t *d_bi = dmalloc_copy(bias_ids, (size_t)R * NB * sizeof(int32_t));
    float *d_bv = dmalloc_copy(bias, (size_t)R * NB * sizeof(float));
    int32_t *d_tok = dmalloc_copy(NULL, (size_t)R * sizeof(int32_t));
    float *d_p = dmalloc_copy(NULL, (size_t)R * V * sizeof(float));
    size_t sb = kn_sample_scratch_bytes(R, V);
    void *d_scr = dmalloc_copy(NULL, sb);
    KN_CK(kn_sample(d_logits, d_prm, d_hist, d_supp, d_bi, d_bv, R, V, d_tok, d_p, d_scr, sb, NULL));
    KN_CK(cudaMemcpy(tok_gpu, d_tok, (size_t)R * sizeof(int32_t), cudaMemcpyDeviceToHost));
    KN_CK(cudaMemcpy(p_gpu, d_p, (size_t)R * V * sizeof(float), cudaMemcpyDeviceToHost));

    sampler_work *w = sampler_work_create(V);
    int tok_bad = 0, supp_bad = 0, inv_bad = 0;
    double worst = 0;
    for (int32_t r = 0; r < R; r++) {
        const variant *vr = &vars[r / ROWS_PER];
        sampling_params sp;
        sampling_params_init(&sp);
        sp.temperature = vr->temperature, sp.top_p = vr->top_p, sp.top_k = vr->top_k, sp.min_p = vr->min_p;
        sp.repetition_penalty = vr->rep, sp.frequency_penalty = vr->freq, sp.presence_penalty = vr->pres;
        if (vr->bias)
            sp.logit_bias_ids = bias_ids + (size_t)r * NB, sp.logit_bias = bias + (size_t)r * NB, sp.n_logit_bias = NB;
        /* forced: output NO (the next one) is forced_id */
        int32_t forced_ids[NO + 1];
        for (int i = 0; i <= NO; i++) forced_ids[i] = i == NO ? prm[r].forced_id : 0;
        if (vr->forced) sp.forced_ids = forced_ids, sp.n_forced_ids = NO + 1;
        const int32_t *h = hist + (size_t)r * (NP + NO);
        sampler_hist hh = {h, NP, h + NP, NO, supp + (size_t)r * NS, vr->suppress ? NS : 0};
        const float *l = logits + (size_t)r * V;
        sampler_probs(w, &sp, &hh, l, p_cpu);
        tok_ref[r] = sampler_is_greedy(&sp) ? sampler_sample(w, &sp, &hh, NULL, l)
                                            : sampler_draw(p_cpu, V, prm[r].use_u ? prm[r].u
                                                                   : kn_philox_uniform(prm[r].seed, prm[r].pos, 0));
        if (vr->forced && tok_ref[r] != prm[r].forced_id) {
            tok_bad++;
            printf("FAIL V=%d %s row %d: CPU reference did not emit the forced id\n", V, vr->name, r);
        }
        if (tok_ref[r] != tok_gpu[r]) {
            tok_bad++;
            printf("FAIL V=%d %s row %d: GPU token %d, CPU %d\n", V, vr->name, r, tok_gpu[r], tok_ref[r]);
        }
        const float *pg = p_gpu + (size_t)r * V;
        for (int32_t i = 0; i < V; i++) {
            if ((pg[i] > 0.0f) != (p_cpu[i] > 0.0f)) supp_bad++;
            double d = fabs((double)pg[i] - p_cpu[i]);
            if (d > worst) worst = d;
        }
        /* the row alone */
        KN_CK(kn_sample(d_logits + (size_t)r * V, d_prm + r, d_hist, d_supp, d_bi, d_bv, 1, V, d_tok, d_p, d_scr, sb,
                     NULL));
        int32_t t1;
        KN_CK(cudaMemcpy(&t1, d_tok, sizeof t1, cudaMemcpyDeviceToHost));
        KN_CK(cudaMemcpy(p_one, d_p, (size_t)V * sizeof(float), cudaMemcpyDeviceToHost));
        if (t1 != tok_gpu[r] || memcmp(p_one, pg, (size_t)V * sizeof(float)) != 0) inv_bad++;
    }
    KN_EXPECT(tok_bad == 0, "V=%d: %d of %d rows drew another token than the CPU sampler", V, tok_bad, R);
    KN_EXPECT(supp_bad == 0, "V=%d: %d ids kept / filtered differently from sampler_probs", V, supp_bad);
    KN_EXPECT(worst <= 1e-6, "V=%d: max |p_gpu - p_cpu| = %.3g > 1e-6", V, worst);
    KN_EXPECT(inv_bad == 0, "V=%d: %d rows differ alone vs in the batch", V, inv_bad);
    printf("sampler V=%d: %d rows (%d parameter sets): %d token mismatches, %d support mismatches, max |dp| %.3g, "
           "%d rows alone != batch\n",
           V, R, n_var, tok_bad, supp_bad, worst, inv_bad);
    sampler_work_destroy(w);
    cudaFree(d_logits), cudaFree(d_prm), cudaFree(d_hist), cudaFree(d_supp), cudaFree(d_tok), cudaFree(d_p);
    cudaFree(d_scr), cudaFree(d_bi), cudaFree(d_bv);
    free(bias_ids), free(bias);
    free(logits), free(p_cpu), free(p_gpu), free(p_one), free(hist), free(supp), free(prm), free(tok_ref);
    free(tok_gpu);
}

/* Random distribution over V with some zeros (f32, sums to ~1). */
static void rand_dist(float *p, int32_t V, int zeros) {
    double s = 0;
    for (int32_t i = 0; i < V; i++) {
        p[i] = zeros && rnd_int(5) == 0 ? 0.0f : (float)(rnd_u() * rnd_u());
        s += p[i];
    }
    if (s == 0) p[0] = 1.0f, s = 1;
    for (int32_t i = 0; i < V; i++) p[i] = (float)(p[i] / s);
}
static int32_t draw_host(const float *p, int32_t V) { return sampler_draw(p, V, rnd_u()); }

typedef struct verify_case {
    int32_t n, K, V;
    float *p, *q;
    int32_t *tt, *draft, *nd, *pos0;
    uint8_t *greedy;
    uint64_t *seed;
    double *u;          /* [n, K + 2] host uniforms, or NULL (Philox) */
    int32_t *acc, *out; /* GPU results */
} verify_case;

static void verify_case_run(verify_case *c, int with_q) {
    const int32_t n = c->n, K = c->K, V = c->V;
    /* with host uniforms: the sequences' rows in reverse order, found through row0 */
    float *pr = c->p;
    int32_t *ttr = c->tt, *row0 = NULL;
    if (c->u) {
        pr = malloc((size_t)n * (K + 1) * V * sizeof(float));
        ttr = malloc((size_t)n * (K + 1) * sizeof(int32_t));
        row0 = malloc((size_t)n * sizeof(int32_t));
        for (int32_t s = 0; s < n; s++) {
            row0[s] = (n - 1 - s) * (K + 1);
            memcpy(pr + (size_t)row0[s] * V, c->p + (size_t)s * (K + 1) * V, (size_t)(K + 1) * V * sizeof(float));
            memcpy(ttr + row0[s], c->tt + (size_t)s * (K + 1), (size_t)(K + 1) * sizeof(int32_t));
        }
    }
    float *dp = dmalloc_copy(pr, (size_t)n * (K + 1) * V * sizeof(float));
    float *dq = with_q ? dmalloc_copy(c->q, (size_t)n * K * V * sizeof(float)) : NULL;
    /* the kernel takes one device pointer per draft: here row s K + j of the dense [n, K, V] block */
    const float **qp = malloc(sizeof *qp * (size_t)n * K);
    for (int32_t i = 0; i < n * K; i++) qp[i] = dq ? dq + (size_t)i * V : NULL;
    const float **dqp = with_q ? dmalloc_copy(qp, sizeof *qp * (size_t)n * K) : NULL;
    free(qp);
    int32_t *dtt = dmalloc_copy(ttr, (size_t)n * (K + 1) * sizeof(int32_t));
    int32_t *drow0 = row0 ? dmalloc_copy(row0, (size_t)n * sizeof(int32_t)) : NULL;
    double *du = c->u ? dmalloc_copy(c->u, (size_t)n * (K + 2) * sizeof(double)) : NULL;
    int32_t *dd = dmalloc_copy(c->draft, (size_t)n * K * sizeof(int32_t));
    int32_t *dnd = dmalloc_copy(c->nd, (size_t)n * sizeof(int32_t));
    uint8_t *dg = dmalloc_copy(c->greedy, (size_t)n);
    uint64_t *ds = dmalloc_copy(c->seed, (size_t)n * sizeof(uint64_t));
    int32_t *dpos = dmalloc_copy(c->pos0, (size_t)n * sizeof(int32_t));
    int32_t *dacc = dmalloc_copy(NULL, (size_t)n * sizeof(int32_t));
    int32_t *dout = dmalloc_copy(NULL, (size_t)n * (K + 1) * sizeof(int32_t));
    KN_CK(kn_spec_verify(dp, (const float *const *)dqp, V, NULL, dtt, dd, dnd, dg, ds, dpos, drow0, du, n, K, V, dacc,
                         dout, NULL));
    KN_CK(cudaMemcpy(c->acc, dacc, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost));
    KN_CK(cudaMemcpy(c->out, dout, (size_t)n * (K + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost));
    cudaFree(dp), cudaFree(dq), cudaFree(dtt), cudaFree(dd), cudaFree(dnd), cudaFree(dg), cudaFree(ds);
    cudaFree(dpos), cudaFree(dacc), cudaFree(dout), cudaFree(drow0), cudaFree(du), cudaFree(dqp);
    if (c->u) free(pr), free(ttr), free(row0);
}

static void verify_case_alloc(verify_case *c, int32_t n, int32_t K, int32_t V) {
    c->n = n, c->K = K, c->V = V;
    c->p = malloc((size_t)n * (K + 1) * V * sizeof(float));
    c->q = malloc((size_t)n * K * V * sizeof(float));
    c->tt = malloc((size_t)n * (K + 1) * sizeof(int32_t));
    c->draft = malloc((size_t)n * K * sizeof(int32_t));
    c->nd = malloc((size_t)n * sizeof(int32_t));
    c->pos0 = malloc((size_t)n * sizeof(int32_t));
    c->greedy = malloc((size_t)n);
    c->seed = malloc((size_t)n * sizeof(uint64_t));
    c->u = NULL;
    c->acc = malloc((size_t)n * sizeof(int32_t));
    c->out = malloc((size_t)n * (K + 1) * sizeof(int32_t));
}
static void verify_case_free(verify_case *c) {
    free(c->p), free(c->q), free(c->tt), free(c->draft), free(c->nd), free(c->pos0), free(c->greedy);
    free(c->seed), free(c->acc), free(c->out), free(c->u);
}

/* 3. exact agreement with ref_verify (host_u: the host's uniforms and reversed rows). */
static void test_verify_exact(int with_q, int host_u) {
    verify_case c;
    verify_case_alloc(&c, 96, 4, 300);
    const int32_t K = c.K, V = c.V;
    if (host_u) {
        c.u = malloc((size_t)c.n * (K + 2) * sizeof(double));
        for (int32_t i = 0; i < c.n * (K + 2); i++) c.u[i] = rnd_u();
    }
    for (int32_t s = 0; s < c.n; s++) {
        c.greedy[s] = s % 4 == 0;
        c.nd[s] = s % 5; /* 0..4 drafts */
        c.seed[s] = rnd();
        c.pos0[s] = rnd_int(4096);
        for (int32_t j = 0; j <= K; j++) {
            float *pj = c.p + ((size_t)s * (K + 1) + j) * V;
            if (c.greedy[s]) { /* one-hot, as kn_sample writes for greedy rows */
                memset(pj, 0, (size_t)V * sizeof(float));
                pj[rnd_int(V)] = 1.0f;
            } else {
                rand_dist(pj, V, 1);
            }
            c.tt[s * (K + 1) + j] = sampler_argmax(pj, V);
        }
        for (int32_t j = 0; j < K; j++) {
            float *qj = c.q + ((size_t)s * K + j) * V;
            rand_dist(qj, V, 1);
            int32_t *d = &c.draft[s * K + j];
            /* drafts: from q (sampled), the target argmax (greedy, to accept some), or random */
            *d = c.greedy[s] ? (rnd_int(3) ? c.tt[s * (K + 1) + j] : rnd_int(V)) : (with_q ? draw_host(qj, V) : rnd_int(V));
        }
    }
    verify_case_run(&c, with_q);
    float *tmp = malloc((size_t)V * sizeof(float));
    int32_t ref[5];
    int bad = 0, n_acc = 0, n_rej = 0;
    for (int32_t s = 0; s < c.n; s++) {
        const float *ps = c.p + (size_t)s * (K + 1) * V;
        const float *qs = with_q ? c.q + (size_t)s * K * V : NULL;
        int32_t a = ref_verify(ps, qs, c.tt + s * (K + 1), c.draft + s * K, c.nd[s], c.greedy[s], c.seed[s],
                               c.pos0[s], host_u ? c.u + (size_t)s * (K + 2) : NULL, V, tmp, ref);
        n_acc += a, n_rej += a < c.nd[s];
        int same = c.acc[s] == a && memcmp(c.out + s * (K + 1), ref, (size_t)(a + 1) * sizeof(int32_t)) == 0;
        if (!same && bad++ < 5)
            printf("FAIL verify seq %d: GPU accepted %d (last token %d), reference %d (last token %d)\n", s, c.acc[s],
                   c.acc[s] >= 0 && c.acc[s] <= K ? c.out[s * (K + 1) + c.acc[s]] : -1, a, ref[a]);
    }
    KN_EXPECT(bad == 0, "kn_spec_verify (%s drafts%s): %d of %d sequences differ from the reference",
           with_q ? "q" : "one-hot", host_u ? ", host uniforms" : "", bad, c.n);
    KN_EXPECT(n_acc > 0 && n_rej > 0, "verify case exercises nothing: %d accepted, %d rejections", n_acc, n_rej);
    printf("spec verify (%s drafts%s): %d sequences, %d differ from the reference (reference: %d drafts accepted, %d "
           "rejections)\n",
           with_q ? "sampled, q" : "one-hot", host_u ? ", host uniforms, rows reversed" : "", c.n, bad, n_acc, n_rej);
    free(tmp);
    verify_case_free(&c);
}

/* 3b. q over a DRAFT vocabulary read through t2d (EAGLE-3's q as its draw leaves it on the device): Vd = 120
 * draft ids of V = 300 (target id used[c] = (7 c + 5) mod V), each draft's q row at its own device address (rows
 * in a shuffled block, one pointer per draft, some NULL: one-hot), drafts mostly drawn from q, some outside
 * the draft vocabulary (q = 0 there: accepted iff p > 0), the host's uniforms; against ref_verify over q
 * scattered to target ids (what the engine's host path verifies): accepted counts and tokens identical. */
static void test_verify_t2d(void) {
    enum { VD = 120 };
    verify_case c;
    verify_case_alloc(&c, 96, 4, 300);
    const int32_t n = c.n, K = c.K, V = c.V;
    int32_t used[VD], *t2d = malloc(sizeof(int32_t) * (size_t)V);
    for (int32_t i = 0; i < V; i++) t2d[i] = -1;
    for (int32_t d = 0; d < VD; d++) used[d] = (7 * d + 5) % V, t2d[used[d]] = d;
    float *qd = malloc(sizeof(float) * (size_t)n * K * VD);  /* [n K (shuffled), VD] */
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)n * K); /* draft s K + j's row in qd, -1: one-hot */
    c.u = malloc((size_t)n * (K + 2) * sizeof(double));
    for (int32_t i = 0; i < n * (K + 2); i++) c.u[i] = rnd_u();
    for (int32_t i = 0; i < n * K; i++) perm[i] = i;
    for (int32_t i = n * K - 1; i > 0; i--) {
        const int32_t r = rnd_int(i + 1), t = perm[i];
        perm[i] = perm[r], perm[r] = t;
    }
    memset(c.q, 0, (size_t)n * K * V * sizeof(float));
    for (int32_t s = 0; s < n; s++) {
        c.greedy[s] = s % 8 == 0;
        c.nd[s] = s % 5;
        c.seed[s] = rnd();
        c.pos0[s] = rnd_int(4096);
        for (int32_t j = 0; j <= K; j++) {
            float *pj = c.p + ((size_t)s * (K + 1) + j) * V;
            rand_dist(pj, V, 1);
            c.tt[s * (K + 1) + j] = sampler_argmax(pj, V);
        }
        for (int32_t j = 0; j < K; j++) {
            const int32_t i = s * K + j;
            float *qfull = c.q + (size_t)i * V, *qr = qd + (size_t)perm[i] * VD;
            int32_t *d = &c.draft[i];
            if ((s + j) % 7 == 3) { /* a one-hot draft (NULL pointer) */
                perm[i] = -1;
                *d = rnd_int(V);
                qfull[*d] = 1.0f;
                continue;
            }
            rand_dist(qr, VD, 1);
            for (int32_t x = 0; x < VD; x++) qfull[used[x]] = qr[x];
            *d = rnd_int(6) == 0 ? rnd_int(V) : used[sampler_draw(qr, VD, rnd_u())];
        }
    }
    float *dqd = dmalloc_copy(qd, sizeof(float) * (size_t)n * K * VD);
    const float **qp = malloc(sizeof *qp * (size_t)n * K);
    for (int32_t i = 0; i < n * K; i++) qp[i] = perm[i] < 0 ? NULL : dqd + (size_t)perm[i] * VD;
    const float **dqp = dmalloc_copy(qp, sizeof *qp * (size_t)n * K);
    int32_t *dt2d = dmalloc_copy(t2d, sizeof(int32_t) * (size_t)V);
    float *dp = dmalloc_copy(c.p, (size_t)n * (K + 1) * V * sizeof(float));
    int32_t *dtt = dmalloc_copy(c.tt, (size_t)n * (K + 1) * sizeof(int32_t));
    double *du = dmalloc_copy(c.u, (size_t)n * (K + 2) * sizeof(double));
    int32_t *dd = dmalloc_copy(c.draft, (size_t)n * K * sizeof(int32_t));
    int32_t *dnd = dmalloc_copy(c.nd, (size_t)n * sizeof(int32_t));
    uint8_t *dg = dmalloc_copy(c.greedy, (size_t)n);
    uint64_t *ds = dmalloc_copy(c.seed, (size_t)n * sizeof(uint64_t));
    int32_t *dpos = dmalloc_copy(c.pos0, (size_t)n * sizeof(int32_t));
    int32_t *dacc = dmalloc_copy(NULL, (size_t)n * sizeof(int32_t));
    int32_t *dout = dmalloc_copy(NULL, (size_t)n * (K + 1) * sizeof(int32_t));
    KN_CK(kn_spec_verify(dp, (const float *const *)dqp, VD, dt2d, dtt, dd, dnd, dg, ds, dpos, NULL, du, n, K, V, dacc,
                         dout, NULL));
    KN_CK(cudaMemcpy(c.acc, dacc, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost));
    KN_CK(cudaMemcpy(c.out, dout, (size_t)n * (K + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost));
    float *tmp = malloc((size_t)V * sizeof(float));
    int32_t ref[5];
    int bad = 0, n_acc = 0, n_rej = 0, n_out = 0;
    for (int32_t s = 0; s < n; s++) {
        for (int32_t j = 0; j < c.nd[s]; j++) n_out += !c.greedy[s] && t2d[c.draft[s * K + j]] < 0;
        const int32_t a = ref_verify(c.p + (size_t)s * (K + 1) * V, c.q + (size_t)s * K * V, c.tt + s * (K + 1),
                                     c.draft + s * K, c.nd[s], c.greedy[s], c.seed[s], c.pos0[s],
                                     c.u + (size_t)s * (K + 2), V, tmp, ref);
        n_acc += a, n_rej += a < c.nd[s];
        const int same = c.acc[s] == a && memcmp(c.out + s * (K + 1), ref, (size_t)(a + 1) * sizeof(int32_t)) == 0;
        if (!same && bad++ < 5)
            printf("FAIL verify t2d seq %d: GPU accepted %d, reference %d (last token %d)\n", s, c.acc[s], a, ref[a]);
    }
    KN_EXPECT(bad == 0, "kn_spec_verify (draft-vocabulary q through t2d): %d of %d sequences differ from the reference",
              bad, n);
    KN_EXPECT(n_acc > 0 && n_rej > 0 && n_out > 0, "t2d case exercises nothing: %d accepted, %d rejections, %d drafts "
              "outside the draft vocabulary", n_acc, n_rej, n_out);
    printf("spec verify (q over a %d-id draft vocabulary through t2d, host uniforms): %d sequences, %d differ from the "
           "reference over scattered q (%d drafts accepted, %d rejections, %d drafts outside the draft vocabulary)\n",
           VD, n, bad, n_acc, n_rej, n_out);
    cudaFree(dqd), cudaFree(dqp), cudaFree(dt2d), cudaFree(dp), cudaFree(dtt), cudaFree(du), cudaFree(dd);
    cudaFree(dnd), cudaFree(dg), cudaFree(ds), cudaFree(dpos), cudaFree(dacc), cudaFree(dout);
    free(qd), free(perm), free(t2d), free(qp), free(tmp);
    verify_case_free(&c);
}

/* 4. the first emitted token is distributed as p. */
static void test_verify_distribution(int with_q) {
    enum { V = 8, K = 3 };
    const int32_t n = kn_harness_small() ? 20000 : 200000; /* KN_TEST_SMALL: 20,000 sequences (tools/kn_emu) */
    verify_case c;
    verify_case_alloc(&c, n, K, V);
    float p[K + 1][V], q[K][V];
    for (int j = 0; j <= K; j++) rand_dist(p[j], V, 0);
    for (int j = 0; j < K; j++) rand_dist(q[j], V, 0);
    p[0][5] = 0.0f; /* an id the target never emits (the draft may propose it) */
    double s0 = 0;
    for (int i = 0; i < V; i++) s0 += p[0][i];
    for (int i = 0; i < V; i++) p[0][i] = (float)(p[0][i] / s0);
    for (int32_t s = 0; s < n; s++) {
        memcpy(c.p + (size_t)s * (K + 1) * V, p, sizeof p);
        memcpy(c.q + (size_t)s * K * V, q, sizeof q);
        c.greedy[s] = 0, c.nd[s] = K, c.seed[s] = (uint64_t)s * 0x9E3779B97F4A7C15ull + 1, c.pos0[s] = 77;
        for (int j = 0; j < K; j++) c.draft[s * K + j] = with_q ? draw_host(q[j], V) : sampler_argmax(q[j], V);
        for (int j = 0; j <= K; j++) c.tt[s * (K + 1) + j] = sampler_argmax(p[j], V);
    }
    verify_case_run(&c, with_q);
    double count[V] = {0};
    int bad = 0;
    for (int32_t s = 0; s < n; s++) {
        int32_t t = c.out[s * (K + 1)];
        if (t < 0 || t >= V) bad++;
        else count[t]++;
    }
    double chi2 = 0;
    int df = -1;
    for (int i = 0; i < V; i++) {
        double e = n * (double)p[0][i];
        if (e == 0) {
            if (count[i] > 0) bad++;
            continue;
        }
        chi2 += (count[i] - e) * (count[i] - e) / e;
        df++;
    }
    double pv = chi2_sf(chi2, df);
    KN_EXPECT(bad == 0, "first emitted token: %d outside the support of p", bad);
    KN_EXPECT(pv > 1e-6, "first emitted token ~ p (%s drafts): chi2 %.2f, df %d, p-value %.3g < 1e-6",
           with_q ? "sampled" : "one-hot", chi2, df, pv);
    printf("spec verify distribution (%s drafts, %d sequences): chi2 %.2f df %d p-value %.3g\n",
           with_q ? "sampled" : "one-hot", n, chi2, df, pv);
    verify_case_free(&c);
}

int main(void) {
    test_philox_kat();
    test_ref_accept_is_cpu();
    test_refusals();
    if (kn_fails) {
        printf("FAILED (host checks)\n");
        return 1;
    }
    kn_harness_require_gpu();
    test_philox_device();
    test_sampler(100); /* fewer ids than threads */
    test_sampler(1000);
    test_sampler(49152);
    test_draw(100);
    test_draw(kn_harness_small() ? 2000 : 32000); /* KN_TEST_SMALL (tools/kn_emu): a 2,000-id vocabulary */
    test_verify_exact(1, 0);
    test_verify_exact(0, 0);
    test_verify_exact(1, 1);
    test_verify_exact(0, 1);
    test_verify_t2d();
    test_verify_distribution(1);
    test_verify_distribution(0);
    printf("%s\n", kn_fails ? "FAILED" : "OK");
    return kn_fails ? 1 : 0;
}
