/*
 * cpu_backend.c: the CPU backend: element-wise ops, RMSNorm, RoPE, the paged
 * KV write and attention, embedding lookup; matmul lives in cpu_matmul.c.
 *
 * The CPU backend is the reference every other backend is tested against.
 * Activations are f32. Batch invariance (backend.h): each output element is
 * produced by one thread with a fixed reduction order that depends only on
 * its own inputs; OpenMP splits tokens / heads / rows, never a reduction.
 * Threading: called from the engine thread; parallel inside with OpenMP.
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/backend.h"
#include "engine/backend/cpu_internal.h"

/* RMSNorm (Zhang & Sennrich 2019): x * 1/sqrt(mean(x^2) + eps) * g.
 * The sum of squares runs in a fixed sequential order (double accumulator). */
static void cpu_rmsnorm(void *vctx, const float *x, const float *g, int32_t T, int32_t dim, float eps, float *out) {
    cpu_ctx *ctx = vctx;
#pragma omp parallel for schedule(static) num_threads(ctx->n_threads) if (T > 1)
    for (int32_t t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * dim;
        float *ot = out + (size_t)t * dim;
        double ss = 0;
        for (int32_t i = 0; i < dim; i++) ss += (double)xt[i] * xt[i];
        float r = (float)(1.0 / sqrt(ss / dim + eps));
        for (int32_t i = 0; i < dim; i++) ot[i] = xt[i] * r * g[i];
    }
}

/* RoPE (Su et al. 2021). angle = pos * inv_freq[i]; pair (a, b) rotated by it.
 * neox: a = x[i], b = x[i + rot/2] (HF rotate_half); else a = x[2i], b = x[2i+1]. */
static void cpu_rope(void *vctx, float *x, int32_t T, int32_t n_heads, int32_t head_dim, int32_t rot_dim,
                     const int32_t *pos, const float *inv_freq, float mscale, bool neox) {
    cpu_ctx *ctx = vctx;
    const int32_t half = rot_dim / 2;
#pragma omp parallel for schedule(static) num_threads(ctx->n_threads) if (T > 1)
    for (int32_t t = 0; t < T; t++) {
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

static inline size_t kv_slot(const bk_kv_layer *kv, const bk_attn_meta *m, int32_t seq, int32_t p) {
    int32_t blk = m->block_tables[seq][p / kv->block_size];
    return ((size_t)blk * kv->block_size + (size_t)(p % kv->block_size)) * kv->n_kv_heads * kv->head_dim;
}

static void cpu_kv_write(void *vctx, const bk_kv_layer *kv, const bk_attn_meta *m, const float *k, const float *v) {
    const size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    for (int32_t t = 0; t < m->n_tokens; t++) {
        size_t off = kv_slot(kv, m, m->seq_of[t], m->pos[t]);
        memcpy(kv->k + off, k + (size_t)t * row, row * sizeof(float));
        memcpy(kv->v + off, v + (size_t)t * row, row * sizeof(float));
    }
}

/* Scaled dot-product attention (Vaswani et al. 2017) over the paged cache.
 * For token t, head h: s_j = scale * q.k_j for j in [0, pos[t]] (minus masked
 * in-step tree positions), p = softmax(s) (max-subtracted, sequential sums in
 * double), out = sum_j p_j v_j in position order. */
static void cpu_attention(void *vctx, const bk_kv_layer *kv, const bk_attn_meta *m, const float *q,
                          int32_t n_heads, float scale, float *out) {
    cpu_ctx *ctx = vctx;
    const int32_t T = m->n_tokens, hd = kv->head_dim, group = n_heads / kv->n_kv_heads;
    int32_t max_len = 0;
    for (int32_t t = 0; t < T; t++) if (m->pos[t] + 1 > max_len) max_len = m->pos[t] + 1;
#pragma omp parallel num_threads(ctx->n_threads)
    {
        float *s = malloc(sizeof(float) * (size_t)max_len);
        double *acc = malloc(sizeof(double) * (size_t)hd);
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int32_t t = 0; t < T; t++) {
            for (int32_t h = 0; h < n_heads; h++) {
                if (!s || !acc) continue;
                const int32_t seq = m->seq_of[t], len = m->pos[t] + 1, kvh = h / group;
                const float *qh = q + ((size_t)t * n_heads + h) * hd;
                float mx = -INFINITY;
                for (int32_t j = 0; j < len; j++) {
                    if (m->tree_mask) {
                        /* in-step token at position j? masked if the tree says so */
                        int masked = 0;
                        for (int32_t u = 0; u < T; u++)
                            if (m->seq_of[u] == seq && m->pos[u] == j) { masked = !m->tree_mask[(size_t)t * T + u]; break; }
                        if (masked) { s[j] = -INFINITY; continue; }
                    }
                    const float *kj = kv->k + kv_slot(kv, m, seq, j) + (size_t)kvh * hd;
                    float d = 0;
                    for (int32_t i = 0; i < hd; i++) d += qh[i] * kj[i];
                    s[j] = d * scale;
                    if (s[j] > mx) mx = s[j];
                }
                double sum = 0;
                for (int32_t j = 0; j < len; j++) {
                    float e = s[j] == -INFINITY ? 0.0f : expf(s[j] - mx);
                    s[j] = e;
                    sum += e;
                }
                for (int32_t i = 0; i < hd; i++) acc[i] = 0;
                for (int32_t j = 0; j < len; j++) {
                    if (s[j] == 0.0f) continue;
                    const float *vj = kv->v + kv_slot(kv, m, seq, j) + (size_t)kvh * hd;
                    for (int32_t i = 0; i < hd; i++) acc[i] += (double)s[j] * vj[i];
                }
                float *oh = out + ((size_t)t * n_heads + h) * hd;
                for (int32_t i = 0; i < hd; i++) oh[i] = (float)(acc[i] / sum);
            }
        }
        free(s);
        free(acc);
    }
}

/* SwiGLU gate (Shazeer 2020): silu(g) * u, silu(g) = g / (1 + e^-g). */
static void cpu_silu_mul(void *vctx, const float *gate, const float *up, int64_t n, float *out) {
    cpu_ctx *ctx = vctx;
#pragma omp parallel for schedule(static) num_threads(ctx->n_threads) if (n > 16384)
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static void cpu_add(void *vctx, float *y, const float *x, int64_t n) {
    (void)vctx;
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

static int cpu_embed(void *vctx, const bk_weight *w, const int32_t *tokens, int32_t T, float *out) {
    (void)vctx;
    for (int32_t t = 0; t < T; t++) {
        if (tokens[t] < 0 || tokens[t] >= w->rows) return -1;
        bk_weight_row_f32(w, tokens[t], out + (size_t)t * w->cols);
    }
    return 0;
}

static const bk_ops CPU_OPS = {
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .silu_mul = cpu_silu_mul,
    .add = cpu_add,
    .embed = cpu_embed,
};

backend *bk_cpu_create(int n_threads) {
    backend *b = calloc(1, sizeof *b);
    cpu_ctx *ctx = calloc(1, sizeof *ctx);
    if (!b || !ctx) {
        free(b);
        free(ctx);
        return NULL;
    }
    __builtin_cpu_init();
    ctx->avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const char *force = getenv("SPECD_CPU_PORTABLE");
    if (force && *force == '1') ctx->avx2 = 0;
    ctx->n_threads = n_threads > 0 ? n_threads : omp_get_max_threads();
    snprintf(ctx->desc, sizeof ctx->desc, "cpu (%s kernels, %d threads)", ctx->avx2 ? "avx2+fma" : "portable",
             ctx->n_threads);
    b->name = "cpu";
    b->ops = &CPU_OPS;
    b->ctx = ctx;
    return b;
}

void bk_cpu_destroy(backend *b) {
    if (!b) return;
    free(b->ctx);
    free(b);
}

const char *bk_cpu_describe(const backend *b) { return ((const cpu_ctx *)b->ctx)->desc; }
