/*
 * kn_sample.cu: the device sampler and the speculative chain verifier
 * (kn_sample.h has the semantics; engine/runtime/sampler.c is the reference).
 *
 * One CTA of 512 threads per row (kn_sample) or per sequence
 * (kn_spec_verify); a row's work never depends on another row. Reductions:
 *   max / argmax / min       exact, any order gives the same value (the
 *                            argmax uses the total order value desc, NaN
 *                            last, id asc);
 *   double sums              thread t sums ids t, t + 512, ... in order, then
 *                            a fixed binary tree over the 512 partials;
 *   the inverse-CDF draw     thread t owns the contiguous ids [t C, t C + C),
 *                            C = ceil(vocab / 512); a fixed Hillis-Steele scan
 *                            of the 512 chunk sums gives each chunk's start;
 *                            the first id (smallest) with target < cumulative
 *                            wins, else the last positive id, else 0
 *                            (sampler_draw's rule);
 *   top-k threshold          radix select on the order-preserving u32 key of
 *                            the f32 logits (4 passes of 8 bits, integer
 *                            histograms: exact);
 *   top-p cut                bisection on the u32 bits of p (non-negative, so
 *                            the bits order like the values) for the smallest
 *                            key K with mass(p > K) < top_p; the cut value v*
 *                            is the smallest present p >= K, ties at v* kept in
 *                            id order while the running mass is < top_p.
 * Integer atomics (id counts, histograms, first-found index) give the same
 * result in any order; no float atomics anywhere.
 *
 * Threading: launchers from one host thread per stream; no state.
 */
#include <climits>
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/kn_philox.h"
#include "kernels/kn_sample.h"

namespace {

constexpr int kT = 512;
constexpr uint32_t kSeen = 0x80000000u; /* cnt bit: id in prompt + output (repetition penalty) */
constexpr float kGreedyEps = 1e-5f;     /* SAMPLER_GREEDY_EPS */

struct Shared {
    double d[kT];
    float f[kT];
    int i[kT];
    int found, last;
    uint32_t u0;
    int k0;
};

__device__ double block_sum(Shared &sh, double v) {
    const int tid = (int)threadIdx.x;
    sh.d[tid] = v;
    __syncthreads();
    for (int s = kT / 2; s > 0; s >>= 1) {
        if (tid < s) sh.d[tid] += sh.d[tid + s];
        __syncthreads();
    }
    const double r = sh.d[0];
    __syncthreads();
    return r;
}

__device__ float block_max(Shared &sh, float v) {
    const int tid = (int)threadIdx.x;
    sh.f[tid] = v;
    __syncthreads();
    for (int s = kT / 2; s > 0; s >>= 1) {
        if (tid < s) sh.f[tid] = fmaxf(sh.f[tid], sh.f[tid + s]);
        __syncthreads();
    }
    const float r = sh.f[0];
    __syncthreads();
    return r;
}

__device__ int block_sum_int(Shared &sh, int v) {
    const int tid = (int)threadIdx.x;
    sh.i[tid] = v;
    __syncthreads();
    for (int s = kT / 2; s > 0; s >>= 1) {
        if (tid < s) sh.i[tid] += sh.i[tid + s];
        __syncthreads();
    }
    const int r = sh.i[0];
    __syncthreads();
    return r;
}

/* a (id ia) before b (id ib) in the argmax order: larger value, NaN never
 * wins over a number, ties -> lower id (sampler_argmax). */
__device__ __forceinline__ bool amax_better(float a, int ia, float b, int ib) {
    const bool na = isnan(a), nb = isnan(b);
    if (na != nb) return nb;
    if (!na && a != b) return a > b;
    return ia < ib;
}

__device__ int block_argmax(Shared &sh, const float *x, int32_t V) {
    const int tid = (int)threadIdx.x;
    float bv = NAN;
    int bi = INT_MAX;
    for (int32_t i = tid; i < V; i += kT)
        if (bi == INT_MAX || amax_better(x[i], i, bv, bi)) bv = x[i], bi = i;
    sh.f[tid] = bv;
    sh.i[tid] = bi;
    __syncthreads();
    for (int s = kT / 2; s > 0; s >>= 1) {
        if (tid < s && sh.i[tid + s] != INT_MAX &&
            (sh.i[tid] == INT_MAX || amax_better(sh.f[tid + s], sh.i[tid + s], sh.f[tid], sh.i[tid]))) {
            sh.f[tid] = sh.f[tid + s];
            sh.i[tid] = sh.i[tid + s];
        }
        __syncthreads();
    }
    const int r = sh.i[0];
    __syncthreads();
    return r;
}

/* Inverse CDF in id order over weights w(i) >= 0 (sampler_draw): smallest i
 * with w(i) > 0 and u * total < w(0) + ... + w(i); else the last positive
 * id; else 0. *total_out = the total (0 iff every weight is 0). */
template <typename W>
__device__ int32_t block_draw(Shared &sh, const W &w, int32_t V, double u, double *total_out) {
    const int tid = (int)threadIdx.x;
    const int32_t C = (V + kT - 1) / kT;
    const int32_t i0 = min(V, tid * C), i1 = min(V, i0 + C);
    double cs = 0.0;
    for (int32_t i = i0; i < i1; i++) {
        const float x = w(i);
        if (x > 0.0f) cs += x;
    }
    if (tid == 0) sh.found = INT_MAX, sh.last = -1;
    sh.d[tid] = cs;
    __syncthreads();
    for (int off = 1; off < kT; off <<= 1) { /* inclusive scan, fixed shape */
        const double add = tid >= off ? sh.d[tid - off] : 0.0;
        __syncthreads();
        sh.d[tid] += add;
        __syncthreads();
    }
    const double excl = tid > 0 ? sh.d[tid - 1] : 0.0, total = sh.d[kT - 1];
    const double target = u * total;
    double acc = excl;
    int32_t last = -1;
    for (int32_t i = i0; i < i1; i++) {
        const float x = w(i);
        if (!(x > 0.0f)) continue;
        acc += x;
        last = i;
        if (target < acc) {
            atomicMin(&sh.found, i);
            break;
        }
    }
    if (last >= 0) atomicMax(&sh.last, last);
    __syncthreads();
    const int32_t r = sh.found != INT_MAX ? sh.found : (sh.last >= 0 ? sh.last : 0);
    __syncthreads();
    *total_out = total;
    return r;
}

struct ArrayW {
    const float *p;
    __device__ float operator()(int32_t i) const { return p[i]; }
};

/* q(i) of a draft's row qr over the DRAFT vocabulary (q_vocab columns) read through t2d (target id ->
 * column, < 0 or >= q_vocab: outside the draft vocabulary, q = 0); t2d NULL: the row is over the target
 * vocabulary itself. */
__device__ __forceinline__ float q_at(const float *qr, const int32_t *t2d, int32_t qv, int32_t i) {
    if (!t2d) return qr[i];
    const int32_t c = t2d[i];
    return c >= 0 && c < qv ? qr[c] : 0.0f;
}

/* max(0, p - q), q one-hot at x when NULL (sampler_accept's residual); q read through t2d (q_at). */
struct ResidualW {
    const float *p, *q;
    const int32_t *t2d;
    int32_t qv, x;
    __device__ float operator()(int32_t i) const {
        const float qi = q ? q_at(q, t2d, qv, i) : (i == x ? 1.0f : 0.0f);
        const float d = p[i] - qi;
        return d > 0.0f ? d : 0.0f;
    }
};

/* Order-preserving map of f32 to u32 (larger float -> larger key). */
__device__ __forceinline__ uint32_t f2key(float f) {
    const uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key2f(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* k-th largest (1-based, counting duplicates) of x[0..V): radix select. */
__device__ float block_kth_largest(Shared &sh, const float *x, int32_t V, int32_t k) {
    const int tid = (int)threadIdx.x;
    uint32_t prefix = 0, pmask = 0;
    int kk = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += kT) sh.i[b] = 0;
        __syncthreads();
        for (int32_t i = tid; i < V; i += kT) {
            const uint32_t key = f2key(x[i]);
            if ((key & pmask) == prefix) atomicAdd(&sh.i[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        if (tid == 0) {
            int b = 255;
            for (; b > 0 && kk > sh.i[b]; b--) kk -= sh.i[b];
            sh.u0 = prefix | ((uint32_t)b << shift);
            sh.k0 = kk;
        }
        __syncthreads();
        prefix = sh.u0;
        kk = sh.k0;
        pmask |= 255u << shift;
        __syncthreads();
    }
    return key2f(prefix);
}

/* softmax_row: p = exp(row - max) / sum over finite row entries. */
__device__ void block_softmax(Shared &sh, const float *row, float *p, int32_t V) {
    const int tid = (int)threadIdx.x;
    float mx = -INFINITY;
    for (int32_t i = tid; i < V; i += kT) mx = fmaxf(mx, row[i]);
    mx = block_max(sh, mx);
    if (!(mx > -INFINITY)) {
        for (int32_t i = tid; i < V; i += kT) p[i] = 1.0f / (float)V;
        __syncthreads();
        return;
    }
    double s = 0.0;
    for (int32_t i = tid; i < V; i += kT) {
        const float e = row[i] > -INFINITY ? expf(row[i] - mx) : 0.0f;
        p[i] = e;
        s += e;
    }
    const double sum = block_sum(sh, s);
    const float inv = (float)(1.0 / sum);
    for (int32_t i = tid; i < V; i += kT) p[i] *= inv;
    __syncthreads();
}

/* mass of p over ids whose p bits exceed key (p >= 0: bits order as values) */
__device__ double block_mass_above(Shared &sh, const float *p, int32_t V, uint32_t key) {
    double s = 0.0;
    for (int32_t i = (int32_t)threadIdx.x; i < V; i += kT)
        if (p[i] > 0.0f && __float_as_uint(p[i]) > key) s += p[i];
    return block_sum(sh, s);
}

/* top-p (HF TopPLogitsWarper as sampler_probs does it): sets row = -inf for
 * the ids outside the kept prefix of the (p desc, id asc) order. */
__device__ void block_top_p(Shared &sh, const float *p, float *row, int32_t V, float top_p) {
    const int tid = (int)threadIdx.x;
    const double tp = (double)top_p;
    float pmax = 0.0f;
    for (int32_t i = tid; i < V; i += kT) pmax = fmaxf(pmax, p[i]);
    pmax = block_max(sh, pmax);
    uint32_t lo = 0, hi = __float_as_uint(pmax); /* mass above pmax is 0 < top_p */
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (block_mass_above(sh, p, V, mid) < tp) hi = mid;
        else lo = mid + 1;
    }
    /* v*: smallest present p with bits >= lo */
    uint32_t vb = UINT_MAX;
    for (int32_t i = tid; i < V; i += kT) {
        const uint32_t b = __float_as_uint(p[i]);
        if (p[i] > 0.0f && b >= lo && b < vb) vb = b;
    }
    if (tid == 0) sh.u0 = UINT_MAX;
    __syncthreads();
    atomicMin(&sh.u0, vb);
    __syncthreads();
    vb = sh.u0;
    __syncthreads();
    const float vstar = __uint_as_float(vb);
    const double before = block_mass_above(sh, p, V, vb);
    /* ties at v*, in id order over contiguous chunks */
    const int32_t C = (V + kT - 1) / kT;
    const int32_t i0 = min(V, tid * C), i1 = min(V, i0 + C);
    int nt = 0;
    for (int32_t i = i0; i < i1; i++) nt += p[i] == vstar;
    sh.i[tid] = nt;
    __syncthreads();
    for (int off = 1; off < kT; off <<= 1) {
        const int add = tid >= off ? sh.i[tid - off] : 0;
        __syncthreads();
        sh.i[tid] += add;
        __syncthreads();
    }
    const int tie0 = tid > 0 ? sh.i[tid - 1] : 0, n_ties = sh.i[kT - 1];
    if (tid == 0) { /* ties kept while the mass before them is < top_p (before = 0 < top_p for the first id) */
        double b = before;
        int c = 0;
        while (c < n_ties && b < tp) b += vstar, c++;
        sh.k0 = c;
    }
    __syncthreads();
    const int keep_ties = sh.k0;
    int r = tie0;
    for (int32_t i = i0; i < i1; i++) {
        if (!(p[i] > 0.0f)) continue;
        if (p[i] < vstar) row[i] = -INFINITY;
        else if (p[i] == vstar && r++ >= keep_ties) row[i] = -INFINITY;
    }
    __syncthreads();
}

__global__ void __launch_bounds__(kT) kn_sample_kernel(const float *logits, const kn_sample_params *params,
                                                        const int32_t *hist, const int32_t *suppress,
                                                        const int32_t *bias_ids, const float *bias, int32_t V,
                                                        int32_t *out_token, float *out_probs, float *s_row,
                                                        float *s_p, uint32_t *s_cnt) {
    __shared__ Shared sh;
    const int tid = (int)threadIdx.x;
    const int32_t r = (int32_t)blockIdx.x;
    const kn_sample_params P = params[r];
    const size_t off = (size_t)r * (size_t)V;
    const float *lg = logits + off;
    float *row = s_row + off, *p = (out_probs ? out_probs : s_p) + off;
    uint32_t *cnt = s_cnt + off;
    const float rp = P.repetition_penalty, fp = P.frequency_penalty, pp = P.presence_penalty;
    const bool rep = rp > 0.0f && rp != 1.0f, fpp = fp != 0.0f || pp != 0.0f;

    /* 1-3: suppression, repetition, frequency / presence */
    for (int32_t i = tid; i < V; i += kT) {
        row[i] = lg[i];
        if (rep || fpp) cnt[i] = 0;
    }
    __syncthreads();
    for (int32_t j = tid; j < P.n_suppress; j += kT) {
        const int32_t id = suppress[P.supp_off + j];
        if (id >= 0 && id < V) row[id] = -INFINITY;
    }
    if (rep || fpp) {
        const int32_t *h = hist + P.hist_off;
        for (int32_t j = tid; j < P.n_prompt + P.n_output; j += kT) {
            const int32_t id = h[j];
            if (id < 0 || id >= V) continue;
            if (rep) atomicOr(&cnt[id], kSeen);
            if (fpp && j >= P.n_prompt) atomicAdd(&cnt[id], 1u);
        }
    }
    __syncthreads();
    if (rep || fpp) {
        for (int32_t i = tid; i < V; i += kT) {
            const uint32_t c = cnt[i];
            if (!c) continue;
            float x = row[i];
            if (rep && (c & kSeen)) x = x > 0.0f ? x / rp : x * rp;
            const uint32_t n = c & ~kSeen;
            if (fpp && n) x = __fsub_rn(x, __fadd_rn(__fmul_rn(fp, (float)n), pp)); /* no FMA: the CPU's rounding */
            row[i] = x;
        }
        __syncthreads();
    }
    /* 3b: logit_bias, in list order (duplicates accumulate as on the CPU); 3c: forced id (tests) */
    if (P.n_bias > 0 && tid == 0)
        for (int32_t j = 0; j < P.n_bias; j++) {
            const int32_t id = bias_ids[P.bias_off + j];
            if (id >= 0 && id < V) row[id] = __fadd_rn(row[id], bias[P.bias_off + j]);
        }
    __syncthreads();
    if (P.forced_on && P.forced_id >= 0 && P.forced_id < V) {
        for (int32_t i = tid; i < V; i += kT) row[i] = i == P.forced_id ? 0.0f : -INFINITY;
        __syncthreads();
    }

    /* 4: greedy */
    const int32_t amax = block_argmax(sh, row, V);
    if (!(P.temperature >= kGreedyEps)) {
        if (out_probs)
            for (int32_t i = tid; i < V; i += kT) p[i] = i == amax ? 1.0f : 0.0f;
        if (out_token && tid == 0) out_token[r] = amax;
        return;
    }
    /* 5: temperature, top-k */
    const float inv_t = 1.0f / P.temperature;
    for (int32_t i = tid; i < V; i += kT) row[i] *= inv_t;
    __syncthreads();
    if (P.top_k > 0 && P.top_k < V) {
        int nf = 0;
        for (int32_t i = tid; i < V; i += kT) nf += row[i] > -INFINITY;
        nf = block_sum_int(sh, nf);
        if (P.top_k < nf) {
            const float kth = block_kth_largest(sh, row, V, P.top_k);
            for (int32_t i = tid; i < V; i += kT)
                if (row[i] < kth) row[i] = -INFINITY;
            __syncthreads();
        }
    }
    /* 6-8: softmax, top-p, min-p */
    block_softmax(sh, row, p, V);
    if (P.top_p > 0.0f && P.top_p < 1.0f) {
        block_top_p(sh, p, row, V, P.top_p);
        block_softmax(sh, row, p, V);
    }
    if (P.min_p > 0.0f) {
        float pmax = 0.0f;
        for (int32_t i = tid; i < V; i += kT) pmax = fmaxf(pmax, p[i]);
        pmax = block_max(sh, pmax);
        const float thr = P.min_p * pmax;
        int cut = 0;
        for (int32_t i = tid; i < V; i += kT)
            if (p[i] > 0.0f && p[i] < thr) row[i] = -INFINITY, cut = 1;
        if (block_sum_int(sh, cut) > 0) block_softmax(sh, row, p, V);
    }
    if (out_token) {
        double total;
        const double u = P.use_u ? P.u : kn_philox_uniform(P.seed, P.pos, 0);
        const int32_t tok = block_draw(sh, ArrayW{p}, V, u, &total);
        if (tid == 0) out_token[r] = tok;
    }
}

__global__ void __launch_bounds__(kT) kn_spec_verify_kernel(const float *p, const float *const *q, int32_t qv,
                                                             const int32_t *t2d, const int32_t *target_tok,
                                                             const int32_t *draft, const int32_t *n_draft,
                                                             const uint8_t *greedy, const uint64_t *seed,
                                                             const int32_t *pos0, const int32_t *row0,
                                                             const double *uh, int32_t k_max, int32_t V,
                                                             int32_t *n_accepted, int32_t *out_tokens) {
    __shared__ Shared sh;
    const int tid = (int)threadIdx.x;
    const int32_t s = (int32_t)blockIdx.x;
    const int32_t nd = min(max(n_draft[s], 0), k_max);
    const int32_t *d = draft + (size_t)s * (size_t)k_max;
    int32_t *out = out_tokens + (size_t)s * (size_t)(k_max + 1);
    const size_t r0 = row0 ? (size_t)row0[s] : (size_t)s * (size_t)(k_max + 1); /* first row of p / target_tok */
    const double *us = uh ? uh + (size_t)s * (size_t)(k_max + 2) : nullptr;
    if (greedy[s] || !p) {
        if (tid == 0 && !target_tok) n_accepted[s] = -1; /* caller bug: no argmax rows */
        if (tid == 0 && target_tok) {
            const int32_t *tt = target_tok + r0;
            int32_t a = 0;
            while (a < nd && d[a] == tt[a]) out[a] = d[a], a++;
            out[a] = tt[a];
            n_accepted[s] = a;
        }
        return;
    }
    const uint64_t sd = seed[s];
    for (int32_t j = 0; j < nd; j++) {
        const float *pj = p + (r0 + (size_t)j) * (size_t)V;
        const float *qj = q ? q[(size_t)s * (size_t)k_max + (size_t)j] : nullptr;
        const int32_t x = d[j], P = pos0[s] + j;
        const bool ok = x >= 0 && x < V;
        const double px = ok ? (double)pj[x] : 0.0;
        const double qx = ok ? (qj ? (double)q_at(qj, t2d, qv, x) : 1.0) : 1.0;
        const double u = us ? us[j] : kn_philox_uniform(sd, P, 0);
        if (px > 0.0 && (qx <= 0.0 || u * qx < px)) {
            if (tid == 0) out[j] = x;
            continue;
        }
        const double u2 = us ? us[j + 1] : kn_philox_uniform(sd, P, 1);
        double total;
        int32_t tok = block_draw(sh, ResidualW{pj, qj, t2d, qv, x}, V, u2, &total);
        if (!(total > 0.0)) tok = block_draw(sh, ArrayW{pj}, V, u2, &total);
        if (tid == 0) {
            out[j] = tok;
            n_accepted[s] = j;
        }
        return;
    }
    double total;
    const float *pb = p + (r0 + (size_t)nd) * (size_t)V;
    const int32_t tok = block_draw(sh, ArrayW{pb}, V, us ? us[nd] : kn_philox_uniform(sd, pos0[s] + nd, 0), &total);
    if (tid == 0) {
        out[nd] = tok;
        n_accepted[s] = nd;
    }
}

__global__ void kn_philox_kernel(const uint64_t *seed, const int32_t *pos, const uint32_t *draw, int32_t n,
                                 double *out) {
    const int32_t i = (int32_t)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) out[i] = kn_philox_uniform(seed[i], pos[i], draw[i]);
}

/* kn_sample_draw's prologue: row r's compact draw parameters -> a full kn_sample_params (no penalties, no
 * lists, top-k / top-p / min-p off, Philox uniform). */
__global__ void kn_draw_params_kernel(const kn_draw_params *in, int32_t n, kn_sample_params *out) {
    const int32_t i = (int32_t)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    kn_sample_params p = {};
    p.temperature = in[i].temperature;
    p.top_p = 1.0f;
    p.repetition_penalty = 1.0f;
    p.pos = in[i].pos;
    p.seed = in[i].seed;
    out[i] = p;
}

/* kn_sample_draw's epilogue: out[i] = id + d2t[id] (d2t_bits 32 or 64), ids outside [0, vocab) untouched. */
__global__ void kn_draw_d2t_kernel(int32_t *out, int32_t n, const void *d2t, int d2t_bits, int32_t vocab) {
    const int32_t i = (int32_t)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    const int32_t id = out[i];
    if (id < 0 || id >= vocab) return;
    out[i] = d2t_bits == 64 ? (int32_t)(id + ((const int64_t *)d2t)[id]) : id + ((const int32_t *)d2t)[id];
}

size_t round256(size_t b) { return (b + 255) / 256 * 256; }

}  // namespace

extern "C" size_t kn_sample_scratch_bytes(int32_t n_rows, int32_t vocab) {
    if (n_rows <= 0 || vocab <= 0) return 0;
    return 3 * round256((size_t)n_rows * (size_t)vocab * 4);
}

extern "C" int kn_sample(const float *logits, const kn_sample_params *params, const int32_t *hist,
                         const int32_t *suppress, const int32_t *bias_ids, const float *bias, int32_t n_rows,
                         int32_t vocab, int32_t *out_token, float *out_probs, void *scratch, size_t scratch_bytes,
                         void *stream) {
    if (n_rows < 0 || vocab <= 0) return (int)cudaErrorInvalidValue;
    if (n_rows == 0) return 0;
    if (!logits || !params || !scratch || scratch_bytes < kn_sample_scratch_bytes(n_rows, vocab))
        return (int)cudaErrorInvalidValue;
    const size_t plane = round256((size_t)n_rows * (size_t)vocab * 4);
    char *sc = (char *)scratch;
    kn_sample_kernel<<<(unsigned)n_rows, kT, 0, (cudaStream_t)stream>>>(
        logits, params, hist, suppress, bias_ids, bias, vocab, out_token, out_probs, (float *)sc, (float *)(sc + plane),
        (uint32_t *)(sc + 2 * plane));
    return (int)cudaGetLastError();
}

extern "C" int kn_spec_verify(const float *p, const float *const *q, int32_t q_vocab, const int32_t *t2d,
                              const int32_t *target_tok, const int32_t *draft, const int32_t *n_draft,
                              const uint8_t *greedy, const uint64_t *seed, const int32_t *pos0, const int32_t *row0,
                              const double *u, int32_t n_seqs, int32_t k_max, int32_t vocab, int32_t *n_accepted,
                              int32_t *out_tokens, void *stream) {
    if (n_seqs < 0 || k_max < 0 || vocab <= 0) return (int)cudaErrorInvalidValue;
    if (n_seqs == 0) return 0;
    if ((k_max > 0 && !draft) || !n_draft || !greedy || !seed || !pos0 || !n_accepted || !out_tokens)
        return (int)cudaErrorInvalidValue;
    if (!p && !target_tok) return (int)cudaErrorInvalidValue;
    if (q && (q_vocab <= 0 || (!t2d && q_vocab != vocab))) return (int)cudaErrorInvalidValue;
    kn_spec_verify_kernel<<<(unsigned)n_seqs, kT, 0, (cudaStream_t)stream>>>(
        p, q, q_vocab, t2d, target_tok, draft, n_draft, greedy, seed, pos0, row0, u, k_max, vocab, n_accepted,
        out_tokens);
    return (int)cudaGetLastError();
}

extern "C" int kn_philox_uniforms(const uint64_t *seed, const int32_t *pos, const uint32_t *draw, int32_t n,
                                  double *out, void *stream) {
    if (n < 0) return (int)cudaErrorInvalidValue;
    if (n == 0) return 0;
    if (!seed || !pos || !draw || !out) return (int)cudaErrorInvalidValue;
    kn_philox_kernel<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)stream>>>(seed, pos, draw, n, out);
    return (int)cudaGetLastError();
}

extern "C" size_t kn_sample_draw_scratch_bytes(int32_t n_rows, int32_t vocab) {
    if (n_rows <= 0 || vocab <= 0) return 0;
    return round256((size_t)n_rows * sizeof(kn_sample_params)) + kn_sample_scratch_bytes(n_rows, vocab);
}

extern "C" int kn_sample_draw(const float *logits, const kn_draw_params *params, const void *d2t, int d2t_bits,
                              int32_t n_rows, int32_t vocab, int32_t *out_token, float *out_probs, void *scratch,
                              size_t scratch_bytes, void *stream) {
    if (n_rows < 0 || vocab <= 0) return (int)cudaErrorInvalidValue;
    if (n_rows == 0) return 0;
    if (!logits || !params || !out_token || !scratch || scratch_bytes < kn_sample_draw_scratch_bytes(n_rows, vocab) ||
        (d2t && d2t_bits != 32 && d2t_bits != 64))
        return (int)cudaErrorInvalidValue;
    const size_t ph = round256((size_t)n_rows * sizeof(kn_sample_params));
    kn_sample_params *full = (kn_sample_params *)scratch;
    kn_draw_params_kernel<<<(unsigned)((n_rows + 255) / 256), 256, 0, (cudaStream_t)stream>>>(params, n_rows, full);
    int rc = (int)cudaGetLastError();
    if (rc) return rc;
    rc = kn_sample(logits, full, NULL, NULL, NULL, NULL, n_rows, vocab, out_token, out_probs, (char *)scratch + ph,
                   scratch_bytes - ph, stream);
    if (rc || !d2t) return rc;
    kn_draw_d2t_kernel<<<(unsigned)((n_rows + 255) / 256), 256, 0, (cudaStream_t)stream>>>(out_token, n_rows, d2t,
                                                                                            d2t_bits, vocab);
    return (int)cudaGetLastError();
}
