/*
 * cpu_backend.c: the CPU backend: element-wise ops, RMSNorm, RoPE, the paged
 * KV write and attention, embedding lookup; matmul lives in cpu_matmul.c.
 *
 * The CPU backend is the reference every other backend is tested against.
 * Activations are f32. Batch invariance (backend.h): each output element is
 * produced by one thread with a fixed reduction order that depends only on
 * its own inputs; OpenMP splits tokens / heads / rows, never a reduction.
 * Memory: host memory; tensors are plain pointers into it, so upload /
 * download / weight_place / meta_upload copy nothing (the same interface as
 * the CUDA backend, zero copies here).
 * Threading: called from the engine thread; parallel inside with its pool.
 */
#include <cpuid.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/backend/backend.h"
#include "engine/backend/cpu_internal.h"
#include "engine/util/log.h"
#include "kernels/kn_philox.h"

/* RMSNorm (Zhang & Sennrich 2019): x * 1/sqrt(mean(x^2) + eps) * g.
 * The sum of squares runs in a fixed sequential order (double accumulator). */
typedef struct norm_job { const float *x, *g; int32_t dim; float eps; float *out; } norm_job;
static void norm_rows(void *va, int64_t t0, int64_t t1, int tid) {
    (void)tid;
    const norm_job *j = va;
    const float *x = j->x, *g = j->g;
    const int32_t dim = j->dim;
    const float eps = j->eps;
    float *out = j->out;
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + (size_t)t * dim;
        float *ot = out + (size_t)t * dim;
        double ss = 0;
        for (int32_t i = 0; i < dim; i++) ss += (double)xt[i] * xt[i];
        float r = (float)(1.0 / sqrt(ss / dim + eps));
        for (int32_t i = 0; i < dim; i++) ot[i] = xt[i] * r * g[i];
    }
}

static int cpu_rmsnorm(void *vctx, const bk_tensor *x, const bk_tensor *g, float eps, bk_tensor *out) {
    cpu_ctx *ctx = vctx;
    norm_job j = {bk_f32(x), bk_f32(g), (int32_t)x->cols, eps, bk_f32(out)};
    tpool_run(ctx->pool, norm_rows, &j, x->rows, 8);
    return 0;
}

static void cpu_add_f32(float *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

/* The residual add and the norm exactly as two ops (same bits as add, then rmsnorm). */
static int cpu_add_rmsnorm(void *vctx, bk_tensor *x, const bk_tensor *r, const bk_tensor *g, float eps,
                           bk_tensor *out) {
    cpu_add_f32(bk_f32(x), bk_f32(r), x->rows * x->cols);
    return cpu_rmsnorm(vctx, x, g, eps, out);
}

/* RoPE (Su et al. 2021). angle = pos * inv_freq[i]; pair (a, b) rotated by it.
 * neox: a = x[i], b = x[i + rot/2] (HF rotate_half); else a = x[2i], b = x[2i+1]. */
typedef struct rope_job {
    float *x; int32_t n_heads, head_dim, rot_dim; const int32_t *pos; const float *inv_freq; float mscale; bool neox;
} rope_job;
static void rope_rows(void *va, int64_t t0, int64_t t1, int tid) {
    (void)tid;
    const rope_job *j = va;
    float *x = j->x;
    const int32_t n_heads = j->n_heads, head_dim = j->head_dim, half = j->rot_dim / 2;
    const int32_t *pos = j->pos;
    const float *inv_freq = j->inv_freq, mscale = j->mscale;
    const bool neox = j->neox;
    for (int64_t t = t0; t < t1; t++) {
        for (int32_t i = 0; i < half; i++) {
            /* angle in double then rounded: identical for a given (pos, i) */
            double ang = (double)pos[t] * (double)inv_freq[i];
            float c = (float)cos(ang) * mscale, s = (float)sin(ang) * mscale;
            for (int32_t h = 0; h < n_heads; h++) {
                float *xh = x + ((size_t)t * n_heads + h) * head_dim;
                int32_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
                float a = xh[ia], b = xh[ib];
                xh[ia] = a * c - b * s;
                xh[ib] = b * c + a * s;
            }
        }
    }
}

static int cpu_rope(void *vctx, bk_tensor *x, int32_t n_heads, int32_t head_dim, int32_t rot_dim,
                    const bk_attn_meta *m, const bk_tensor *inv_freq, float mscale, bool neox) {
    cpu_ctx *ctx = vctx;
    rope_job j = {bk_f32(x), n_heads, head_dim, rot_dim, m->pos, bk_f32(inv_freq), mscale, neox};
    tpool_run(ctx->pool, rope_rows, &j, x->rows, 4);
    return 0;
}

static inline size_t kv_slot(const bk_kv_layer *kv, const bk_attn_meta *m, int32_t seq, int32_t p) {
    int32_t blk = m->block_tables[seq][p / kv->block_size];
    return ((size_t)blk * kv->block_size + (size_t)(p % kv->block_size)) * kv->n_kv_heads * kv->head_dim;
}

static int cpu_kv_write(void *vctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *kt,
                        const bk_tensor *vt) {
    const float *k = bk_f32(kt), *v = bk_f32(vt);
    const size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    for (int32_t t = 0; t < m->n_tokens; t++) {
        size_t off = kv_slot(kv, m, m->seq_of[t], m->pos[t]);
        if (kv->k16) { /* bf16 cache: round to nearest even */
            for (size_t i = 0; i < row; i++) kv->k16[off + i] = bk_f32_to_bf16(k[(size_t)t * row + i]);
            for (size_t i = 0; i < row; i++) kv->v16[off + i] = bk_f32_to_bf16(v[(size_t)t * row + i]);
            continue;
        }
        memcpy(kv->k + off, k + (size_t)t * row, row * sizeof(float));
        memcpy(kv->v + off, v + (size_t)t * row, row * sizeof(float));
    }
    return 0;
}

/* Scaled dot-product attention (Vaswani et al. 2017) over the paged cache.
 * For token t, head h: s_j = scale * q.k_j for j in [0, pos[t]] (minus masked
 * in-step tree positions), p = softmax(s) (max-subtracted, sequential sums in
 * double), out = sum_j p_j v_j in position order. */
typedef struct attn_job {
    cpu_ctx *ctx;
    const bk_kv_layer *kv;
    const bk_attn_meta *m;
    const float *q;
    int32_t n_heads;
    float scale;
    float *out;
    int32_t max_len;
} attn_job;

/* 1 if in-step token t must not see position p of its sequence seq: p is
 * another in-step token of seq that the tree mask hides from t. */
static inline int attn_masked(const bk_attn_meta *m, int32_t t, int32_t seq, int32_t p) {
    if (!m->tree_mask) return 0;
    const int32_t T = m->n_tokens;
    for (int32_t u = 0; u < T; u++)
        if (m->seq_of[u] == seq && m->pos[u] == p) return !m->tree_mask[(size_t)t * T + u];
    return 0;
}

/* s[p] <- exp(s[p] - mx) (0 for masked -inf scores); returns their sum,
 * accumulated in double in position order. */
static inline double attn_softmax_num(float *s, int32_t len, float mx) {
    double sum = 0;
    for (int32_t p = 0; p < len; p++) {
        const float e = s[p] == -INFINITY ? 0.0f : expf(s[p] - mx);
        s[p] = e;
        sum += e;
    }
    return sum;
}

/* n values of a cache plane at element offset off as f32: the f32 plane
 * itself, or the bf16 plane widened into tmp. */
static inline const float *kv_vals(const float *p32, const uint16_t *p16, size_t off, int32_t n, float *tmp) {
    if (!p16) return p32 + off;
    for (int32_t i = 0; i < n; i++) tmp[i] = bk_bf16_to_f32(p16[off + i]);
    return tmp;
}

/* Items are (token, head) pairs: item = t * n_heads + h. */
static void attn_items(void *va, int64_t i0, int64_t i1, int tid) {
    const attn_job *j = va;
    const bk_kv_layer *kv = j->kv;
    const bk_attn_meta *m = j->m;
    const int32_t hd = kv->head_dim, n_heads = j->n_heads, group = n_heads / kv->n_kv_heads;
    float *s = cpu_scratch_get(j->ctx, tid, (size_t)j->max_len + 3 * (size_t)hd + 2);
    if (!s) return; /* cannot happen after cpu_attention's pre-allocation */
    double *acc = (double *)(void *)(s + j->max_len + (j->max_len & 1));
    float *tmp = (float *)(void *)(acc + hd); /* a bf16 row widened */
    for (int64_t it = i0; it < i1; it++) {
        const int32_t t = (int32_t)(it / n_heads), h = (int32_t)(it % n_heads);
        const int32_t seq = m->seq_of[t], len = m->pos[t] + 1, kvh = h / group;
        const float *qh = j->q + ((size_t)t * n_heads + h) * hd;
        float mx = -INFINITY;
        for (int32_t p = 0; p < len; p++) {
            if (attn_masked(m, t, seq, p)) { s[p] = -INFINITY; continue; }
            const float *kp = kv_vals(kv->k, kv->k16, kv_slot(kv, m, seq, p) + (size_t)kvh * hd, hd, tmp);
            float d = 0;
            for (int32_t i = 0; i < hd; i++) d += qh[i] * kp[i];
            s[p] = d * j->scale;
            if (s[p] > mx) mx = s[p];
        }
        const double sum = attn_softmax_num(s, len, mx);
        for (int32_t i = 0; i < hd; i++) acc[i] = 0;
        for (int32_t p = 0; p < len; p++) {
            if (s[p] == 0.0f) continue;
            const float *vp = kv_vals(kv->v, kv->v16, kv_slot(kv, m, seq, p) + (size_t)kvh * hd, hd, tmp);
            for (int32_t i = 0; i < hd; i++) acc[i] += (double)s[p] * vp[i];
        }
        float *oh = j->out + ((size_t)t * n_heads + h) * hd;
        for (int32_t i = 0; i < hd; i++) oh[i] = (float)(acc[i] / sum);
    }
}

/* The same attention with AVX2/FMA (head_dim % 8 == 0), for the AVX2 and
 * AVX-512 levels alike (so those two stay bit-identical). Per (token, head):
 *   s_p = scale * hsum8(a + b), a/b the 8-lane FMA accumulators of q.k_p over
 *         16-dim steps (a: dims 16i..16i+7, b: 16i+8..16i+15; a last 8-dim
 *         step goes to a);
 *   softmax as the scalar path (expf, max-subtracted, sum in double);
 *   out[i] = (sum_p e_p v_p[i]) / sum, the numerator in f32 lanes, one FMA per
 *         position in position order.
 * A function of the (token, head) item alone, like the scalar path: batch
 * invariance holds. It replaces a 64-long dependent scalar add chain per
 * position and a double-precision PV loop. */
__attribute__((target("avx2,fma"))) static void attn_items_avx2(void *va, int64_t i0, int64_t i1, int tid) {
    const attn_job *j = va;
    const bk_kv_layer *kv = j->kv;
    const bk_attn_meta *m = j->m;
    const int32_t hd = kv->head_dim, n_heads = j->n_heads, group = n_heads / kv->n_kv_heads, bs = kv->block_size;
    const size_t row = (size_t)kv->n_kv_heads * (size_t)hd; /* floats per KV slot */
    float *s = cpu_scratch_get(j->ctx, tid, (size_t)j->max_len + 3 * (size_t)hd + 2);
    if (!s) return; /* cannot happen after cpu_attention's pre-allocation */
    float *tmp = s + j->max_len + 2 * (size_t)hd + 2; /* a bf16 row widened */
    for (int64_t it = i0; it < i1; it++) {
        const int32_t t = (int32_t)(it / n_heads), h = (int32_t)(it % n_heads);
        const int32_t seq = m->seq_of[t], len = m->pos[t] + 1, kvh = h / group;
        const float *qh = j->q + ((size_t)t * n_heads + h) * hd;
        __m256 q8[8];
        if (hd == 64)
            for (int r = 0; r < 8; r++) q8[r] = _mm256_loadu_ps(qh + 8 * r);
        float mx = -INFINITY;
        /* positions walked block by block: one block-table read per block, no division per position */
        size_t kb = 0;
        for (int32_t p = 0, slot = bs; p < len; p++, slot++) {
            if (slot == bs) kb = kv_slot(kv, m, seq, p) + (size_t)kvh * hd, slot = 0;
            if (attn_masked(m, t, seq, p)) { s[p] = -INFINITY; continue; }
            const float *kp = kv_vals(kv->k, kv->k16, kb + (size_t)slot * row, hd, tmp);
            __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
            int32_t i = 0;
            if (hd == 64) { /* the loop below unrolled, q in registers: the same FMAs in the same order */
                a = _mm256_fmadd_ps(q8[0], _mm256_loadu_ps(kp), a);
                b = _mm256_fmadd_ps(q8[1], _mm256_loadu_ps(kp + 8), b);
                a = _mm256_fmadd_ps(q8[2], _mm256_loadu_ps(kp + 16), a);
                b = _mm256_fmadd_ps(q8[3], _mm256_loadu_ps(kp + 24), b);
                a = _mm256_fmadd_ps(q8[4], _mm256_loadu_ps(kp + 32), a);
                b = _mm256_fmadd_ps(q8[5], _mm256_loadu_ps(kp + 40), b);
                a = _mm256_fmadd_ps(q8[6], _mm256_loadu_ps(kp + 48), a);
                b = _mm256_fmadd_ps(q8[7], _mm256_loadu_ps(kp + 56), b);
                i = hd;
            }
            for (; i + 16 <= hd; i += 16) {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(kp + i), a);
                b = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i + 8), _mm256_loadu_ps(kp + i + 8), b);
            }
            if (i < hd) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(kp + i), a);
            s[p] = cpu_hsum8(_mm256_add_ps(a, b)) * j->scale;
            if (s[p] > mx) mx = s[p];
        }
        const double sum = attn_softmax_num(s, len, mx);
        float *oh = j->out + ((size_t)t * n_heads + h) * hd;
        for (int32_t c0 = 0; c0 < hd; c0 += 64) { /* 64 dims (8 registers) per pass over the positions */
            const int32_t nr = (hd - c0 < 64 ? hd - c0 : 64) / 8;
            float num[64];
            if (nr == 8) { /* the loop below with 8 named accumulators: GCC keeps a runtime-bound acc[] in
                            * memory (a store-forwarding round trip per FMA); the same FMAs in the same order */
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                size_t vb = 0;
                for (int32_t p = 0, slot = bs; p < len; p++, slot++) {
                    if (slot == bs) vb = kv_slot(kv, m, seq, p) + (size_t)kvh * hd + c0, slot = 0;
                    if (s[p] == 0.0f) continue;
                    const float *vp = kv_vals(kv->v, kv->v16, vb + (size_t)slot * row, 64, tmp);
                    const __m256 w = _mm256_set1_ps(s[p]);
                    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp), a0);
                    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + 8), a1);
                    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + 16), a2);
                    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + 24), a3);
                    a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + 32), a4);
                    a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + 40), a5);
                    a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + 48), a6);
                    a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + 56), a7);
                }
                _mm256_storeu_ps(num, a0), _mm256_storeu_ps(num + 8, a1), _mm256_storeu_ps(num + 16, a2);
                _mm256_storeu_ps(num + 24, a3), _mm256_storeu_ps(num + 32, a4), _mm256_storeu_ps(num + 40, a5);
                _mm256_storeu_ps(num + 48, a6), _mm256_storeu_ps(num + 56, a7);
                for (int32_t i = 0; i < 64; i++) oh[c0 + i] = (float)((double)num[i] / sum);
                continue;
            }
            __m256 acc[8];
            for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
            size_t vb = 0;
            for (int32_t p = 0, slot = bs; p < len; p++, slot++) {
                if (slot == bs) vb = kv_slot(kv, m, seq, p) + (size_t)kvh * hd + c0, slot = 0;
                if (s[p] == 0.0f) continue;
                const float *vp = kv_vals(kv->v, kv->v16, vb + (size_t)slot * row, 8 * nr, tmp);
                const __m256 w = _mm256_set1_ps(s[p]);
                for (int r = 0; r < nr; r++) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + 8 * r), acc[r]);
            }
            for (int r = 0; r < nr; r++) _mm256_storeu_ps(num + 8 * r, acc[r]);
            for (int32_t i = 0; i < 8 * nr; i++) oh[c0 + i] = (float)((double)num[i] / sum);
        }
    }
}

/* Scaled dot-product attention (Vaswani et al. 2017) over the paged cache.
 * For token t, head h: s_p = scale * q.k_p for p in [0, pos[t]] (minus masked
 * in-step tree positions), softmax (max-subtracted; sums in double, in
 * position order), out = sum_p w_p v_p in position order (numerator in double
 * on the portable path, in f32 lanes on the AVX2 one). AVX2 kernels
 * (attn_items_avx2) when the backend runs AVX2 or AVX-512 and head_dim % 8
 * == 0, else the portable scalar loop (attn_items). */
static int cpu_attention(void *vctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *qt,
                         int32_t n_heads, float scale, bk_tensor *outt) {
    cpu_ctx *ctx = vctx;
    const float *q = bk_f32(qt);
    float *out = bk_f32(outt);
    int32_t max_len = 0;
    for (int32_t t = 0; t < m->n_tokens; t++) if (m->pos[t] + 1 > max_len) max_len = m->pos[t] + 1;
    for (int i = 0; i < ctx->n_threads; i++)
        if (!cpu_scratch_get(ctx, i, (size_t)max_len + 3 * (size_t)kv->head_dim + 2)) {
            LOG_ERROR("attention: out of memory for %d positions", max_len);
            return -1;
        }
    attn_job j = {ctx, kv, m, q, n_heads, scale, out, max_len};
    tpool_run(ctx->pool, ctx->avx2 && kv->head_dim % 8 == 0 ? attn_items_avx2 : attn_items, &j,
              (int64_t)m->n_tokens * n_heads, 1);
    return 0;
}

/* SwiGLU gate (Shazeer 2020): silu(g) * u, silu(g) = g / (1 + e^-g). */
typedef struct silu_job { const float *gate, *up; float *out; } silu_job;
static void silu_range(void *va, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    const silu_job *j = va;
    for (int64_t i = i0; i < i1; i++) {
        float g = j->gate[i];
        j->out[i] = g / (1.0f + expf(-g)) * j->up[i];
    }
}

static int cpu_silu_mul(void *vctx, const bk_tensor *gate, const bk_tensor *up, bk_tensor *out) {
    cpu_ctx *ctx = vctx;
    silu_job j = {bk_f32(gate), bk_f32(up), bk_f32(out)};
    tpool_run(ctx->pool, silu_range, &j, gate->rows * gate->cols, 4096);
    return 0;
}

static int cpu_add(void *vctx, bk_tensor *y, const bk_tensor *x) {
    (void)vctx;
    cpu_add_f32(bk_f32(y), bk_f32(x), y->rows * y->cols);
    return 0;
}

static int cpu_add_bias(void *vctx, bk_tensor *y, const bk_tensor *b) {
    (void)vctx;
    for (int64_t t = 0; t < y->rows; t++) cpu_add_f32(bk_f32(y) + (size_t)t * y->cols, bk_f32(b), y->cols);
    return 0;
}

static int cpu_embed(void *vctx, const bk_weight *w, const bk_tensor *ids, const int32_t *ids_host, bk_tensor *out) {
    (void)vctx;
    (void)ids_host;
    const int32_t *tokens = bk_i32(ids);
    for (int64_t t = 0; t < ids->rows; t++) {
        if (tokens[t] < 0 || tokens[t] >= w->rows) return -1;
        bk_weight_row_f32(w, tokens[t], bk_f32(out) + (size_t)t * w->cols);
    }
    return 0;
}

static int cpu_copy_cols(void *vctx, bk_tensor *dst, int64_t col0, const bk_tensor *src) {
    (void)vctx;
    for (int64_t t = 0; t < src->rows; t++)
        memcpy(bk_f32(dst) + (size_t)t * dst->cols + col0, bk_f32(src) + (size_t)t * src->cols,
               sizeof(float) * (size_t)src->cols);
    return 0;
}

static int cpu_gather_rows(void *vctx, const bk_tensor *src, const bk_tensor *idx, bk_tensor *dst) {
    (void)vctx;
    const int32_t *ix = bk_i32(idx);
    for (int64_t i = 0; i < idx->rows; i++) {
        if (ix[i] < 0 || ix[i] >= src->rows) return -1;
        memcpy(bk_f32(dst) + (size_t)i * src->cols, bk_f32(src) + (size_t)ix[i] * src->cols,
               sizeof(float) * (size_t)src->cols);
    }
    return 0;
}

static int cpu_argmax(void *vctx, const bk_tensor *logits, const bk_tensor *d2t, bk_tensor *out) {
    (void)vctx;
    const int64_t V = logits->cols;
    if (out->rows != logits->rows || V <= 0 || (d2t && d2t->rows * d2t->cols < V)) return -1;
    for (int64_t t = 0; t < logits->rows; t++) {
        const float *x = bk_f32(logits) + (size_t)t * (size_t)V;
        int32_t best = 0;
        for (int32_t i = 1; i < V; i++) /* sampler_argmax (engine/runtime/sampler.c) */
            if (x[i] > x[best] || (isnan(x[best]) && !isnan(x[i]))) best = i;
        bk_i32(out)[t] = d2t ? best + bk_i32(d2t)[best] : best;
    }
    return 0;
}

/* bk_ops.draw: sampler_probs (engine/runtime/sampler.c) restricted to a temperature, element for element
 * (the backend library does not link the sampler; the fake CUDA device runs sampler.c itself, so
 * backend_cuda_glue compares the two), then sampler_draw with u = kn_philox_uniform(seed, pos, 0). */
static int cpu_draw(void *vctx, const bk_tensor *logits, const bk_draw_param *params, const bk_tensor *d2t,
                    bk_tensor *out, bk_tensor *q) {
    (void)vctx;
    const int64_t V = logits->cols, T = logits->rows;
    if (!params || logits->dtype != BK_F32 || out->dtype != BK_I32 || out->rows != T || V <= 0 || V > INT32_MAX ||
        (d2t && d2t->rows * d2t->cols < V) || (q && (q->dtype != BK_F32 || q->rows != T || q->cols != V)))
        return -1;
    float *tmp = q ? NULL : malloc(sizeof(float) * (size_t)V);
    if (!q && !tmp) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *x = bk_f32(logits) + (size_t)t * (size_t)V;
        float *p = q ? bk_f32(q) + (size_t)t * (size_t)V : tmp;
        int32_t id = 0;
        for (int32_t i = 1; i < V; i++) /* sampler_argmax */
            if (x[i] > x[id] || (isnan(x[id]) && !isnan(x[i]))) id = i;
        const float temp = params[t].temperature;
        if (!(temp >= 1e-5f)) { /* greedy (sampler_is_greedy): the argmax, q one-hot */
            if (q) {
                memset(p, 0, sizeof(float) * (size_t)V);
                p[id] = 1.0f;
            }
        } else {
            const float inv_t = 1.0f / temp;
            float mx = -INFINITY;
            for (int32_t i = 0; i < V; i++) {
                p[i] = x[i] * inv_t;
                if (p[i] > mx) mx = p[i];
            }
            if (!(mx > -INFINITY)) { /* softmax_row's fallback */
                for (int32_t i = 0; i < V; i++) p[i] = 1.0f / (float)V;
            } else {
                double sum = 0.0;
                for (int32_t i = 0; i < V; i++) {
                    const float e = p[i] > -INFINITY ? expf(p[i] - mx) : 0.0f;
                    p[i] = e;
                    sum += e;
                }
                const float inv = (float)(1.0 / sum);
                for (int32_t i = 0; i < V; i++) p[i] *= inv;
            }
            double total = 0.0; /* sampler_draw */
            for (int32_t i = 0; i < V; i++) total += p[i];
            const double target = kn_philox_uniform(params[t].seed, params[t].pos, 0) * total;
            double acc = 0.0;
            int32_t last = -1, pick = -1;
            for (int32_t i = 0; i < V && pick < 0; i++) {
                if (!(p[i] > 0.0f)) continue;
                acc += p[i];
                last = i;
                if (target < acc) pick = i;
            }
            id = pick >= 0 ? pick : last >= 0 ? last : 0;
        }
        bk_i32(out)[t] = d2t ? id + bk_i32(d2t)[id] : id;
    }
    free(tmp);
    return 0;
}

static int cpu_matmul_t(void *vctx, const bk_weight *w, const bk_tensor *x, bk_tensor *y) {
    return cpu_matmul(vctx, w, bk_f32(x), (int32_t)x->rows, bk_f32(y));
}

static int cpu_matmul_n_t(void *vctx, int n, const bk_weight *const *w, const bk_tensor *x, bk_tensor *const *y) {
    float *yp[CPU_MATMUL_N_MAX];
    if (n < 1 || n > CPU_MATMUL_N_MAX) return -1;
    for (int k = 0; k < n; k++) yp[k] = bk_f32(y[k]);
    return cpu_matmul_n(vctx, n, w, bk_f32(x), (int32_t)x->rows, yp);
}

/* ------------------------------------------ memory: host memory, zero copies */

/* calloc: large pools (the KV cache) are mapped lazily, zero pages untouched
 * until written, as before this interface existed. */
static void *cpu_buf_alloc(void *vctx, size_t bytes) {
    (void)vctx;
    return calloc(1, bytes ? bytes : 1);
}
static void cpu_buf_free(void *vctx, void *p) { (void)vctx; free(p); }
static int cpu_copy(void *vctx, void *dst, const void *src, size_t bytes) {
    (void)vctx;
    if (dst != src && bytes) memmove(dst, src, bytes);
    return 0;
}
static int cpu_weight_place(void *vctx, const bk_weight *src, bk_weight *dst) {
    (void)vctx;
    *dst = *src;
    return 0;
}
static int cpu_meta_upload(void *vctx, bk_attn_meta *m) { (void)vctx; m->dev = NULL; return 0; }
static void cpu_meta_release(void *vctx, bk_attn_meta *m) { (void)vctx; m->dev = NULL; }

/* Absorbed MLA (backend.h): exactly kv_write(lat, lat) and attention + the first kvl columns per head,
 * so a model calling these gets the bits of the two older ops. */
static int cpu_mla_check(const bk_kv_layer *kv, int32_t kvl) {
    if (kv->n_kv_heads != 1 || kv->k != kv->v || kv->k16 != kv->v16 || kvl <= 0 || kvl > kv->head_dim) {
        LOG_ERROR("mla: not one latent plane (n_kv_heads %d, head_dim %d, kv_lora_rank %d, K %s V)", kv->n_kv_heads,
                  kv->head_dim, kvl, kv->k == kv->v && kv->k16 == kv->v16 ? "==" : "!=");
        return -1;
    }
    return 0;
}
static int cpu_mla_latent_write(void *vctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *lat,
                                int32_t kvl) {
    if (cpu_mla_check(kv, kvl) < 0) return -1;
    return cpu_kv_write(vctx, kv, m, lat, lat);
}
static int cpu_mla_attention(void *vctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *q,
                             int32_t n_heads, int32_t kvl, float scale, bk_tensor *out) {
    if (cpu_mla_check(kv, kvl) < 0) return -1;
    const int64_t T = q->rows, D = kv->head_dim;
    if (q->cols != n_heads * D || out->rows != T || out->cols != (int64_t)n_heads * kvl) {
        LOG_ERROR("mla_attention: q [%lld, %lld], out [%lld, %lld] for %d heads of %lld (kv_lora_rank %d)",
                  (long long)q->rows, (long long)q->cols, (long long)out->rows, (long long)out->cols, n_heads,
                  (long long)D, kvl);
        return -1;
    }
    const size_t nfull = (size_t)T * (size_t)n_heads * (size_t)D;
    float *full = malloc(sizeof(float) * (nfull ? nfull : 1));
    if (!full) {
        LOG_ERROR("mla_attention: out of memory for %lld tokens", (long long)T);
        return -1;
    }
    bk_tensor ft = bk_wrap_f32(full, T, n_heads * D);
    int rc = cpu_attention(vctx, kv, m, q, n_heads, scale, &ft);
    if (rc >= 0)
        for (int64_t i = 0; i < T * n_heads; i++) memcpy(bk_f32(out) + i * kvl, full + i * D, sizeof(float) * (size_t)kvl);
    free(full);
    return rc < 0 ? -1 : 0;
}

float *cpu_scratch_get(cpu_ctx *ctx, int tid, size_t n) {
    cpu_scratch *sc = &ctx->scratch[tid];
    if (n > sc->cap) {
        float *p = realloc(sc->buf, n * sizeof(float));
        if (!p) return NULL;
        sc->buf = p;
        sc->cap = n;
    }
    return sc->buf;
}

static const bk_ops CPU_OPS = {
    .matmul = cpu_matmul_t,
    .matmul_n = cpu_matmul_n_t,
    .rmsnorm = cpu_rmsnorm,
    .add_rmsnorm = cpu_add_rmsnorm,
    .rope = cpu_rope,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .silu_mul = cpu_silu_mul,
    .add = cpu_add,
    .add_bias = cpu_add_bias,
    .embed = cpu_embed,
    .copy_cols = cpu_copy_cols,
    .gather_rows = cpu_gather_rows,
    .argmax = cpu_argmax,
    .draw = cpu_draw,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .weight_place = cpu_weight_place,
    .meta_upload = cpu_meta_upload,
    .meta_release = cpu_meta_release,
    .mla_latent_write = cpu_mla_latent_write,
    .mla_attention = cpu_mla_attention,
};

float cpu_fp16_f32[65536];
static pthread_once_t fp16_once = PTHREAD_ONCE_INIT;
static void fp16_fill(void) {
    for (uint32_t h = 0; h < 65536; h++) cpu_fp16_f32[h] = cpu_fp16_to_f32((uint16_t)h);
}
void cpu_fp16_table_init(void) { pthread_once(&fp16_once, fp16_fill); }

backend *bk_cpu_create(int n_threads) {
    cpu_fp16_table_init();
    backend *b = calloc(1, sizeof *b);
    cpu_ctx *ctx = calloc(1, sizeof *ctx);
    if (!b || !ctx) {
        free(b);
        free(ctx);
        return NULL;
    }
    /* CPUID: leaf 1 ECX bit 12 FMA, bit 29 F16C, bit 27 OSXSAVE; leaf 7 EBX bit 5 AVX2, bits 16 / 17
     * / 30 / 31 AVX-512 F / DQ / BW / VL, ECX bits 1 / 11 AVX-512 VBMI / VNNI; XGETBV(0) must show the OS saves YMM state (bits 1-2) and,
     * for AVX-512, the opmask and ZMM state too (bits 5-7) (Intel SDM vol. 1, 13.3 and 15.2).
     * Portable across gcc and clang. */
    unsigned a, bx, c, d, xcr0 = 0;
    int fma = 0, f16c = 0, avx2 = 0, avx512 = 0, vbmi_vnni = 0;
    if (__get_cpuid(1, &a, &bx, &c, &d)) {
        fma = (c >> 12) & 1;
        f16c = (c >> 29) & 1;
        if ((c >> 27) & 1) {
            unsigned hi;
            __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(hi) : "c"(0));
        }
    }
    if (__get_cpuid_count(7, 0, &a, &bx, &c, &d)) {
        avx2 = (bx >> 5) & 1;
        avx512 = ((bx >> 16) & 1) && ((bx >> 17) & 1) && ((bx >> 30) & 1) && ((bx >> 31) & 1);
        vbmi_vnni = ((c >> 1) & 1) && ((c >> 11) & 1);
    }
    ctx->avx2 = fma && f16c && avx2 && (xcr0 & 6) == 6;
    ctx->avx512 = ctx->avx2 && avx512 && (xcr0 & 0xe6) == 0xe6;
    ctx->avx512x = ctx->avx512 && vbmi_vnni;
    /* SPECD_CPU_ISA caps the level (it never raises it above what the CPU has) */
    const char *isa = getenv("SPECD_CPU_ISA"), *force = getenv("SPECD_CPU_PORTABLE");
    if ((force && *force == '1') || (isa && !strcmp(isa, "portable"))) ctx->avx2 = ctx->avx512 = ctx->avx512x = 0;
    else if (isa && !strcmp(isa, "avx2")) ctx->avx512 = ctx->avx512x = 0;
    else if (isa && !strcmp(isa, "avx512base")) ctx->avx512x = 0;
    else if (isa && *isa && strcmp(isa, "avx512"))
        LOG_WARN("SPECD_CPU_ISA='%s' is not portable, avx2, avx512base or avx512: ignored (using the best level)",
                 isa);
    if (n_threads <= 0) {
        const char *e = getenv("OMP_NUM_THREADS");
        n_threads = e && atoi(e) > 0 ? atoi(e) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    }
    if (n_threads < 1) n_threads = 1;
    if (n_threads > CPU_MAX_THREADS) n_threads = CPU_MAX_THREADS;
    ctx->n_threads = n_threads;
    ctx->pool = tpool_create(n_threads);
    if (!ctx->pool) {
        free(b);
        free(ctx);
        return NULL;
    }
    ctx->n_threads = tpool_size(ctx->pool);
    snprintf(ctx->desc, sizeof ctx->desc, "cpu (%s kernels, %d threads)",
             ctx->avx512x  ? "avx512+vbmi+vnni+avx2+fma"
             : ctx->avx512 ? "avx512+avx2+fma"
             : ctx->avx2 ? "avx2+fma" : "portable",
             ctx->n_threads);
    b->name = "cpu";
    b->ops = &CPU_OPS;
    b->ctx = ctx;
    b->host_visible = true;
    return b;
}

void bk_cpu_destroy(backend *b) {
    if (!b) return;
    cpu_ctx *ctx = b->ctx;
    tpool_destroy(ctx->pool);
    for (int i = 0; i < CPU_MAX_THREADS; i++) free(ctx->scratch[i].buf);
    free(b->ctx);
    free(b);
}

const char *bk_cpu_describe(const backend *b) { return ((const cpu_ctx *)b->ctx)->desc; }

