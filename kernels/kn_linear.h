/*
 * kn_linear.h: the "linear algebra" kernel family: small-M matmul (GEMV) for
 * every weight format, embedding lookup, RMSNorm (plain and fused with the
 * residual add), RoPE, SiLU x up, add, bias, strided row copy, argmax with
 * the draft-to-target map, and cuBLASLt for large-M bf16 prefill (opt-in).
 *
 * Conventions: kernels/kn.h (device pointers, explicit shapes, `void *stream`,
 * return 0 or a cudaError_t, never allocate or synchronise, graph-capturable,
 * batch invariant). Every op reproduces the CPU backend's op
 * (engine/backend/cpu_backend.c, cpu_matmul.c) up to the f32 rounding stated
 * per launcher; docs/engine.md "CUDA kernels" gives the reduction orders.
 *
 * Alignment contract: every float / int array passed here starts on a
 * 16-byte boundary (cudaMalloc gives 256); weight data as documented on
 * kn_weight. Shapes the kernels cannot serve return cudaErrorInvalidValue
 * (11) before anything is launched.
 */
#ifndef SPECD_KERNELS_KN_LINEAR_H
#define SPECD_KERNELS_KN_LINEAR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Weight formats; the values equal engine/backend/backend.h bk_wtype's (the
 * glue and the tests assert it), so a bk_weight's type converts by cast. */
typedef enum {
    KN_W_F32 = 0,  /* float [rows, cols] */
    KN_W_BF16 = 1, /* uint16 bf16 [rows, cols] */
    KN_W_F16 = 2,  /* uint16 IEEE half [rows, cols] */
    KN_W_Q8_0 = 3, /* ggml blocks of 32: fp16 d, int8 q[32] (34 bytes); v = d*q */
    KN_W_Q4_0 = 4, /* ggml blocks of 32: fp16 d, 16 nibble bytes (18 bytes); v = d*(q-8) */
    KN_W_Q4_1 = 5, /* ggml blocks of 32: fp16 d, fp16 m, 16 nibble bytes (20 bytes); v = d*q + m */
} kn_wtype;

/* A weight matrix on the device: row r (one output feature) starts at
 * data + r * row_bytes. Plain formats: row_bytes >= cols * element size, even
 * (f16/bf16) or a multiple of 4 (f32); rows are read with 16-byte loads when
 * data and row_bytes are multiples of 16 and cols % 4 == 0, else element by
 * element (a different, still batch-invariant, order). Block formats:
 * cols % 32 == 0, row_bytes >= (cols/32) * block bytes, data and row_bytes
 * even (GGUF stores blocks back to back, 32-byte aligned tensors). */
typedef struct kn_weight {
    kn_wtype type;
    int64_t rows;     /* output features */
    int64_t cols;     /* input features */
    const void *data; /* device, rows * row_bytes bytes; not owned */
    size_t row_bytes;
} kn_weight;

/* ------------------------------------------------------------- matmul */

/* y[T, rows] = x[T, cols] @ W^T, f32 activations, weights dequantized in
 * registers, f32 accumulation. x: 16-byte aligned when the weight takes the
 * 16-byte path (block formats, or aligned plain rows with cols % 4 == 0),
 * else 4-byte. T >= 1 (any size; tokens are tiled by 8 in
 * registers, the weight row is re-read once per tile of 8 tokens).
 * Reduction order of y[t, r] (a function of cols alone): lane l of the warp
 * owning row r accumulates, with one fused multiply-add per element, its
 * units (16-byte weight chunks; 8-value slices of 32-blocks for Q formats)
 * in increasing column order; the 32 lane sums are added by a fixed xor
 * butterfly (16, 8, 4, 2, 1). Same kernel code for T = 1 and T = 128. */
int kn_matmul(const kn_weight *w, const float *x, int32_t T, float *y, void *stream);

/* out[T, cols] = rows tokens[t] of W dequantized to f32, bit-identical to
 * bk_weight_row_f32. Token ids live on the device, so they are checked there:
 * an id outside [0, rows) fills its output row with NaN and, when bad_flag is
 * not NULL, stores 1 into *bad_flag (device int32, never cleared here: the
 * caller zeroes it and reads it back with the step's results). */
int kn_embed(const kn_weight *w, const int32_t *tokens, int32_t T, float *out, int32_t *bad_flag, void *stream);

/* -------------------------------------------------------------- norms */

/* out[T, dim] = x * r * g with r = (float)(1 / sqrt(sum(x^2)/dim + eps)), the
 * sum of squares in double (CPU: sequential double; here 256 strided double
 * partials + a fixed tree: the same value up to double rounding, so r is
 * the CPU's except in rare last-bit cases). (x * r) * g rounded twice as the
 * CPU. out may alias x. g: [dim]. */
int kn_rmsnorm(const float *x, const float *g, int32_t T, int32_t dim, float eps, float *out, void *stream);

/* Fused residual add + RMSNorm: x[T, dim] += r[T, dim] (skipped when r is
 * NULL), then out = rmsnorm(x) as kn_rmsnorm. x is updated in place (the
 * residual stream); out must not alias r. */
int kn_add_rmsnorm(float *x, const float *r, const float *g, int32_t T, int32_t dim, float eps, float *out,
                   void *stream);

/* --------------------------------------------------------------- rope */

/* Rotary embedding in place on x[T, n_heads, head_dim], first rot_dim dims
 * (even, <= head_dim). neox != 0: pairs (i, i + rot_dim/2); else (2i, 2i+1).
 * angle = (double)pos[t] * inv_freq[i] (pos int32 [T], inv_freq f32
 * [rot_dim/2]); c = (float)cos(angle) * mscale, s = (float)sin(angle) * mscale;
 * (a, b) <- (a*c - b*s, b*c + a*s), each product rounded (no FMA), as the CPU. */
int kn_rope(float *x, int32_t T, int32_t n_heads, int32_t head_dim, int32_t rot_dim, const int32_t *pos,
            const float *inv_freq, float mscale, int neox, void *stream);

/* -------------------------------------------------------- elementwise */

/* out[n] = silu(gate) * up, silu(g) = g / (1 + expf(-g)); out may alias gate
 * or up. expf is CUDA's (<= 2 ulp), the rest correctly rounded. */
int kn_silu_mul(const float *gate, const float *up, int64_t n, float *out, void *stream);

/* y[n] += x[n]. */
int kn_add(float *y, const float *x, int64_t n, void *stream);

/* y[T, n] += b[n] (bias broadcast over the rows). */
int kn_add_bias(float *y, const float *b, int32_t T, int64_t n, void *stream);

/* dst[t * dst_ld + i] = src[t * src_ld + i] for t < T, i < n (EAGLE-3 aux
 * capture: dst = aux + a * H, dst_ld = n_aux * H, src_ld = n = H). dst_ld,
 * src_ld >= n; the ranges must not overlap. */
int kn_copy_rows(float *dst, int64_t dst_ld, const float *src, int64_t src_ld, int32_t T, int64_t n, void *stream);

/* ------------------------------------------------------------- argmax */

/* out[t] = argmax over logits[t, 0..V) (f32 [T, V]), the rule of
 * engine/runtime/sampler.c sampler_argmax: the largest value, ties -> the
 * lowest id; NaN loses to every number (-inf included); a row of only NaN
 * gives 0. That is a total order, so the result does not depend on the
 * reduction order. With d2t (device, [V] int32 when d2t_bits == 32, int64
 * when 64; NULL / 0 bits = none) the id is mapped: out = id + d2t[id]
 * (draft -> target vocabulary; the map is validated at load). */
int kn_argmax(const float *logits, int32_t T, int32_t V, const void *d2t, int d2t_bits, int32_t *out, void *stream);

/* ---------------------------------------------------- cuBLASLt (opt-in)
 * Large-M bf16 prefill through cuBLASLt, loaded with dlopen (never linked;
 * $SPECD_CUBLASLT, then libcublasLt.so.13 / .so, then /usr/local/cuda):
 * NOT batch invariant relative to kn_matmul (different tiles, bf16-rounded
 * activations), so only a backend created with deterministic == false may
 * use it; kn_blaslt_create refuses otherwise. One algorithm is pinned per
 * plan (the first heuristic answer for the plan's shape at creation, split-K
 * forced to 1), so repeated runs of one plan are reproducible. */
typedef struct kn_blaslt kn_blaslt;
typedef struct kn_blaslt_plan kn_blaslt_plan;

/* Loads cuBLASLt and creates a handle. deterministic != 0
 * -> cudaErrorNotSupported with the reason. Allocates host memory only. */
int kn_blaslt_create(int deterministic, kn_blaslt **out, char *why, size_t why_len);
void kn_blaslt_destroy(kn_blaslt *h);

/* A plan for y[T, rows] (f32) = xb[T, cols] (bf16) @ W^T (bf16 [rows, cols],
 * row_bytes == 2 * cols) at exactly T tokens, with a caller-owned device
 * workspace of ws_bytes. Host work only (call at start, not per step). */
int kn_blaslt_plan_create(kn_blaslt *h, int64_t rows, int64_t cols, int32_t T, size_t ws_bytes,
                          kn_blaslt_plan **out, char *why, size_t why_len);
void kn_blaslt_plan_destroy(kn_blaslt_plan *p);

/* Rounds x[T, cols] (f32) to bf16 into xb (device scratch [T, cols]), then runs
 * the plan's matmul. Graph-capturable; every cublasLt call checked. */
int kn_blaslt_matmul(kn_blaslt_plan *p, const kn_weight *w, const float *x, uint16_t *xb, float *y, void *ws,
                     void *stream);

/* "file:line: call: STATUS (code)" of the last failed cublasLt call ("" if none). */
const char *kn_blaslt_last_error(const kn_blaslt *h);

#ifdef __cplusplus
}
#endif

#endif
