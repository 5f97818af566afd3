/*
 * test_kn_linear.c: every kernel of kernels/kn_linear.h against the CPU
 * backend's op (bk_cpu_create, SPECD_CPU_ISA=portable: f32 activations, so
 * the only difference is the order of f32 roundings), at M (tokens) in
 * {1, 2, 3, 4, 5, 8, 16, 33, 128}, with seeded random data, plus BITWISE
 * batch invariance of every op on the GPU: a row computed with T = 1 equals
 * the same row inside T = 33 and T = 128 batches, at any position.
 *
 * Bounds (NMSE = sum (gpu - cpu)^2 / sum cpu^2, kn_harness.h), from the math:
 *  - matmul: both sides accumulate n = cols f32 products, in different
 *    orders (CPU: 8 interleaved partials, or per-32-block d*s + m*sum(x);
 *    GPU: one FMA chain per lane + a 32-lane tree). Each rounding contributes
 *    a relative error <= u = 2^-24 of a partial sum; for random zero-mean
 *    data the errors add like a random walk, NMSE ~ n u^2 / 3 <= 3e-12 for
 *    n <= 1536 (dequantization differences add ~u^2; an emulation of the
 *    kernel's order on the host measured 1e-14..3e-13 on these shapes).
 *    Bound 1e-10; one missing or misplaced element gives ~1/n >= 1e-4.
 *  - embed, add, add_bias, copy_rows, the residual of add_rmsnorm: the same
 *    correctly rounded operations as the CPU: bit-identical (memcmp).
 *  - rmsnorm / add_rmsnorm out: identical formula, the double sum of squares
 *    in another order (1e-16 relative), so r differs in the last f32 bit
 *    only in near-tie cases: bound 1e-12 (one ulp everywhere would be 4e-15).
 *  - rope: cos/sin in double from a different implementation (a few double
 *    ulps), then the CPU's f32 operations: bound 1e-12.
 *  - silu_mul: CUDA expf is within 2 ulp (glibc's within 1): relative error
 *    <= ~4 ulp = 2.4e-7 per element, NMSE <= 6e-14: bound 1e-12.
 *  - argmax: equal to sampler_argmax (engine/runtime/sampler.c), with ties,
 *    NaN and -inf planted, then mapped through d2t (int32 and int64).
 *  - cuBLASLt (opt-in, not batch invariant): see test_blaslt.
 *  - CUDA graphs: a decoder step captured and replayed = direct launches.
 * KN_TEST_SMALL=1 (kn_harness.h, for tools/kn_emu): the 49152-row matmul
 * shape gets 2053 rows, the 1024 x 4096 one 256 rows; nothing else changes.
 * Exits 77 without a usable GPU (kn_harness_require_gpu).
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/backend/backend.h"
#include "engine/runtime/sampler.h"
#include "kernels/kn_linear.h"
#include "tests/kernels/kn_harness.h"

_Static_assert((int)KN_W_F32 == (int)BK_W_F32 && (int)KN_W_BF16 == (int)BK_W_BF16 && (int)KN_W_F16 == (int)BK_W_F16 &&
                   (int)KN_W_Q8_0 == (int)BK_W_Q8_0 && (int)KN_W_Q4_0 == (int)BK_W_Q4_0 &&
                   (int)KN_W_Q4_1 == (int)BK_W_Q4_1,
               "kn_wtype values must equal bk_wtype's");

static const int32_t MS[] = {1, 2, 3, 4, 5, 8, 16, 33, 128};
#define NM ((int)(sizeof MS / sizeof MS[0]))
#define TMAX 128
static const double NMSE_MATMUL = 1e-10, NMSE_NORM = 1e-12, NMSE_ROPE = 1e-12, NMSE_SILU = 1e-12;

static backend *g_cpu;

/* The CPU backend's ops on host arrays (its tensors are host memory: bk_wrap_* views, no copies). */
static int cpu_matmul_h(const bk_weight *w, const float *x, int32_t T, float *y) { return bk_matmul_f32(g_cpu, w, x, T, y); }
static int cpu_embed_h(const bk_weight *w, const int32_t *ids, int32_t T, float *out) {
    bk_tensor it = bk_wrap_i32(ids, T, 1), ot = bk_wrap_f32(out, T, w->cols);
    return g_cpu->ops->embed(g_cpu->ctx, w, &it, ids, &ot);
}
static void cpu_rmsnorm_h(const float *x, const float *g, int32_t T, int32_t dim, float eps, float *out) {
    bk_tensor xt = bk_wrap_f32((float *)(uintptr_t)x, T, dim), gt = bk_wrap_f32((float *)(uintptr_t)g, 1, dim);
    bk_tensor ot = bk_wrap_f32(out, T, dim);
    g_cpu->ops->rmsnorm(g_cpu->ctx, &xt, &gt, eps, &ot);
}
static void cpu_add_h(float *y, const float *x, int64_t n) {
    bk_tensor yt = bk_wrap_f32(y, 1, n), xt = bk_wrap_f32((float *)(uintptr_t)x, 1, n);
    g_cpu->ops->add(g_cpu->ctx, &yt, &xt);
}
static void cpu_rope_h(float *x, int32_t T, int32_t nh, int32_t hd, int32_t rot, const int32_t *pos, const float *inv,
                       float mscale, bool neox) {
    bk_tensor xt = bk_wrap_f32(x, T, (int64_t)nh * hd), ft = bk_wrap_f32((float *)(uintptr_t)inv, 1, rot / 2);
    bk_attn_meta am = {.n_tokens = T, .pos = pos};
    g_cpu->ops->rope(g_cpu->ctx, &xt, nh, hd, rot, &am, &ft, mscale, neox);
}
static void cpu_silu_h(const float *a, const float *b, int64_t n, float *out) {
    bk_tensor at = bk_wrap_f32((float *)(uintptr_t)a, 1, n), bt = bk_wrap_f32((float *)(uintptr_t)b, 1, n);
    bk_tensor ot = bk_wrap_f32(out, 1, n);
    g_cpu->ops->silu_mul(g_cpu->ctx, &at, &bt, &ot);
}



/* ------------------------------------------------------------ helpers */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rng_u64(void) { /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_unif(void) { return (float)((double)(rng_u64() >> 11) * 0x1.0p-53 * 2.0 - 1.0); } /* [-1, 1) */

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of memory (%zu bytes)\n", n); exit(1); }
    return p;
}
static void *dev_alloc(size_t n) {
    void *p = NULL;
    KN_CK(cudaMalloc(&p, n ? n : 1));
    return p;
}
static void *dev_upload(const void *h, size_t n) {
    void *d = dev_alloc(n);
    KN_CK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    return d;
}
static void dev_download(void *h, const void *d, size_t n) {
    KN_CK(cudaDeviceSynchronize());
    KN_CK(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost));
}
static float *rand_f32(size_t n) {
    float *p = xmalloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = rng_unif();
    return p;
}
/* a normal fp16 / bf16 of magnitude in [2^e0, 2^e1), random sign */
static uint16_t rand_f16(int e0, int e1) {
    const int e = e0 + (int)(rng_u64() % (uint64_t)(e1 - e0));
    return (uint16_t)(((rng_u64() & 1) << 15) | ((uint32_t)(e + 15) << 10) | (rng_u64() & 0x3ff));
}
static uint16_t rand_bf16(int e0, int e1) {
    const int e = e0 + (int)(rng_u64() % (uint64_t)(e1 - e0));
    return (uint16_t)(((rng_u64() & 1) << 15) | ((uint32_t)(e + 127) << 7) | (rng_u64() & 0x7f));
}
static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

static size_t natural_row_bytes(kn_wtype t, int64_t cols) {
    switch (t) {
    case KN_W_F32: return (size_t)cols * 4;
    case KN_W_BF16: case KN_W_F16: return (size_t)cols * 2;
    case KN_W_Q8_0: return (size_t)(cols / 32) * 34;
    case KN_W_Q4_0: return (size_t)(cols / 32) * 18;
    case KN_W_Q4_1: return (size_t)(cols / 32) * 20;
    }
    return 0;
}
static const char *wname(kn_wtype t) {
    static const char *n[] = {"f32", "bf16", "f16", "q8_0", "q4_0", "q4_1"};
    return n[t];
}

/* Random weight bytes in format t; row_bytes >= natural (padding filled with junk). */
static uint8_t *rand_weight(kn_wtype t, int64_t rows, int64_t cols, size_t row_bytes) {
    uint8_t *w = xmalloc((size_t)rows * row_bytes);
    for (size_t i = 0; i < (size_t)rows * row_bytes; i++) w[i] = (uint8_t)rng_u64();
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *p = w + (size_t)r * row_bytes;
        switch (t) {
        case KN_W_F32: for (int64_t j = 0; j < cols; j++) { float v = rng_unif(); memcpy(p + 4 * j, &v, 4); } break;
        case KN_W_BF16: for (int64_t j = 0; j < cols; j++) put16(p + 2 * j, rand_bf16(-8, 1)); break;
        case KN_W_F16: for (int64_t j = 0; j < cols; j++) put16(p + 2 * j, rand_f16(-8, 1)); break;
        case KN_W_Q8_0: /* 2 + 32 bytes: random int8 quants already there */
            for (int64_t b = 0; b < cols / 32; b++) put16(p + 34 * b, rand_f16(-10, -6));
            break;
        case KN_W_Q4_0:
            for (int64_t b = 0; b < cols / 32; b++) put16(p + 18 * b, rand_f16(-7, -3));
            break;
        case KN_W_Q4_1:
            for (int64_t b = 0; b < cols / 32; b++) {
                put16(p + 20 * b, rand_f16(-7, -3));
                put16(p + 20 * b + 2, (uint16_t)(rand_f16(-5, -2) | 0x8000)); /* m < 0: centred-ish values */
            }
            break;
        }
    }
    return w;
}

/* ------------------------------------------------------------- matmul */

/* One weight case: GPU vs CPU at every M, and bitwise batch invariance.
 * misalign: bytes added to the device data pointer (forces the scalar path
 * for plain formats; must keep the format's element alignment). */
static void test_matmul_case(kn_wtype t, int64_t rows, int64_t cols, size_t pad, size_t misalign) {
    const size_t rb = natural_row_bytes(t, cols) + pad;
    uint8_t *hw = rand_weight(t, rows, cols, rb);
    float *x = rand_f32((size_t)TMAX * cols);
    uint8_t *dw0 = dev_alloc((size_t)rows * rb + misalign);
    KN_CK(cudaMemcpy(dw0 + misalign, hw, (size_t)rows * rb, cudaMemcpyHostToDevice));
    kn_weight kw = {t, rows, cols, dw0 + misalign, rb};
    bk_weight bw = {(bk_wtype)t, rows, cols, hw, rb, NULL};
    float *dx = dev_upload(x, (size_t)TMAX * cols * sizeof(float));
    float *dy = dev_alloc((size_t)TMAX * rows * sizeof(float));
    float *yall = xmalloc((size_t)TMAX * rows * sizeof(float)), *y = xmalloc((size_t)TMAX * rows * sizeof(float));
    float *ref = xmalloc((size_t)TMAX * rows * sizeof(float));
    const size_t rowsz = (size_t)rows * sizeof(float);

    KN_CK(kn_matmul(&kw, dx, TMAX, dy, NULL));
    dev_download(yall, dy, TMAX * rowsz);
    double worst = 0;
    for (int mi = 0; mi < NM; mi++) {
        const int32_t M = MS[mi];
        KN_EXPECT(cpu_matmul_h(&bw, x, M, ref) == 0, "cpu matmul failed");
        KN_CK(cudaMemset(dy, 0xff, (size_t)M * rowsz));
        KN_CK(kn_matmul(&kw, dx, M, dy, NULL));
        dev_download(y, dy, (size_t)M * rowsz);
        const double e = kn_nmse(y, ref, (size_t)M * rows);
        if (e > worst) worst = e;
        KN_EXPECT(e <= NMSE_MATMUL, "matmul %s %lldx%lld pad %zu mis %zu M=%d: NMSE %.3g > %.0e", wname(t),
               (long long)rows, (long long)cols, pad, misalign, M, e, NMSE_MATMUL);
        KN_EXPECT(!memcmp(y, yall, (size_t)M * rowsz), "matmul %s %lldx%lld M=%d: rows differ from the same rows at T=128",
               wname(t), (long long)rows, (long long)cols, M);
    }
    /* any position: single tokens and a 33-token batch at an offset */
    const int32_t single[] = {0, 7, 8, 9, 31, 32, 63, 100, 127};
    for (size_t k = 0; k < sizeof single / sizeof single[0]; k++) {
        const int32_t p = single[k];
        KN_CK(kn_matmul(&kw, dx + (size_t)p * cols, 1, dy, NULL));
        dev_download(y, dy, rowsz);
        KN_EXPECT(!memcmp(y, yall + (size_t)p * rows, rowsz), "matmul %s %lldx%lld: token %d alone != inside T=128",
               wname(t), (long long)rows, (long long)cols, p);
    }
    const int32_t off = 50;
    KN_CK(kn_matmul(&kw, dx + (size_t)off * cols, 33, dy, NULL));
    dev_download(y, dy, 33 * rowsz);
    KN_EXPECT(!memcmp(y, yall + (size_t)off * rows, 33 * rowsz), "matmul %s %lldx%lld: T=33 at offset %d != inside T=128",
           wname(t), (long long)rows, (long long)cols, off);
    printf("matmul %-4s %6lld x %-5lld pad %2zu mis %zu: worst NMSE %.2e (bound %.0e)\n", wname(t), (long long)rows,
           (long long)cols, pad, misalign, worst, NMSE_MATMUL);
    KN_CK(cudaFree(dw0));
    KN_CK(cudaFree(dx));
    KN_CK(cudaFree(dy));
    free(hw), free(x), free(yall), free(y), free(ref);
}

static void test_matmul(void) {
    /* KN_TEST_SMALL: the LM-head shape gets 2053 rows instead of 49152, the k_proj one 256 instead of 1024 */
    const int small = kn_harness_small();
    const struct { int64_t rows, cols; } shapes[] = {{576, 1536}, {1536, 576}, {small ? 2053 : 49152, 576}, {1001, 96}, {3, 64}};
    for (int t = KN_W_F32; t <= KN_W_Q4_1; t++) {
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            test_matmul_case((kn_wtype)t, shapes[s].rows, shapes[s].cols, 0, 0);
        /* padded rows (row_bytes > natural, even) and an odd row count */
        test_matmul_case((kn_wtype)t, 77, 256, t <= KN_W_F16 ? 16 : 6, 0);
        if (t == KN_W_BF16) { /* Llama-3.1-8B k_proj, and a 14336-long dot (down_proj rows) */
            test_matmul_case((kn_wtype)t, small ? 256 : 1024, 4096, 0, 0);
            test_matmul_case((kn_wtype)t, 67, 14336, 0, 0);
        }
        if (t <= KN_W_F16) {
            const size_t es = t == KN_W_F32 ? 4 : 2;
            /* 16-byte path with a 4-column scalar tail (bf16/f16: rows padded to 208 bytes) */
            test_matmul_case((kn_wtype)t, 37, 100, t == KN_W_F32 ? 0 : 8, 0);
            test_matmul_case((kn_wtype)t, 33, 33, 0, 0);  /* cols % 4 != 0: element path */
            test_matmul_case((kn_wtype)t, 129, 576, 0, es); /* data not 16-byte aligned: element path */
        } else {
            test_matmul_case((kn_wtype)t, 65, 576, 0, 2); /* block rows at a 2-byte offset */
        }
    }
    /* refused shapes: nothing launched, cudaErrorInvalidValue */
    float *d = dev_alloc(4096);
    kn_weight q = {KN_W_Q8_0, 4, 48, d, 34 * 2};
    KN_EXPECT(kn_matmul(&q, d, 1, d, NULL) == (int)cudaErrorInvalidValue, "Q8_0 with cols %% 32 != 0 accepted");
    kn_weight f = {KN_W_F32, 4, 8, d, 16};
    KN_EXPECT(kn_matmul(&f, d, 1, d, NULL) == (int)cudaErrorInvalidValue, "row_bytes < cols * 4 accepted");
    f.row_bytes = 32;
    KN_EXPECT(kn_matmul(&f, d, 0, d, NULL) == (int)cudaErrorInvalidValue, "T = 0 accepted");
    KN_EXPECT(kn_matmul(&f, (const float *)((const char *)d + 4), 1, d, NULL) == (int)cudaErrorInvalidValue,
           "x not 16-byte aligned accepted");
    KN_CK(cudaFree(d));
}

/* ----------------------------------------------------------- cuBLASLt
 * Opt-in large-M bf16 path: vs the CPU matmul of the same bf16-rounded
 * activations (products exact in f32, f32 accumulation in another order;
 * tensor cores may keep fewer guard bits than IEEE adds: NMSE ~ n (2u)^2 <
 * 2e-11, bound 1e-8), and bitwise reproducible run to run (pinned algorithm,
 * no split-K). Not compared with kn_matmul: it is not batch invariant
 * relative to it, by design. */
static uint16_t f32_to_bf16_rne(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static void test_blaslt(void) {
    char why[512] = "";
    kn_blaslt *h = NULL;
    KN_EXPECT(kn_blaslt_create(1, &h, why, sizeof why) == (int)cudaErrorNotSupported && !h && why[0],
           "cuBLASLt accepted a deterministic backend");
    const int rc = kn_blaslt_create(0, &h, why, sizeof why);
    if (rc == (int)cudaErrorSharedObjectInitFailed) {
        printf("cublaslt: not tested, the library is not loadable here (set SPECD_CUBLASLT): %s\n", why);
        return;
    }
    KN_EXPECT(rc == 0 && h, "kn_blaslt_create: %d %s", rc, why);
    if (rc) return;
    const struct { int64_t rows, cols; int32_t T; } cs[] = {{576, 1536, 128}, {1536, 576, 64}, {49152, 576, 33}};
    const size_t ws_bytes = (size_t)32 << 20;
    void *ws = dev_alloc(ws_bytes);
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        const int64_t rows = cs[c].rows, cols = cs[c].cols;
        const int32_t T = cs[c].T;
        kn_blaslt_plan *p = NULL;
        const int prc = kn_blaslt_plan_create(h, rows, cols, T, ws_bytes, &p, why, sizeof why);
        KN_EXPECT(prc == 0, "kn_blaslt_plan_create %lldx%lld T=%d: %d %s", (long long)rows, (long long)cols, T, prc, why);
        if (prc) continue;
        uint8_t *hw = rand_weight(KN_W_BF16, rows, cols, (size_t)cols * 2);
        float *x = rand_f32((size_t)T * cols), *xr = xmalloc((size_t)T * cols * 4);
        for (size_t i = 0; i < (size_t)T * cols; i++) {
            const uint32_t b = (uint32_t)f32_to_bf16_rne(x[i]) << 16;
            memcpy(&xr[i], &b, 4);
        }
        float *ref = xmalloc((size_t)T * rows * 4), *y = xmalloc((size_t)T * rows * 4), *y2 = xmalloc((size_t)T * rows * 4);
        const bk_weight bw = {BK_W_BF16, rows, cols, hw, (size_t)cols * 2, NULL};
        KN_EXPECT(cpu_matmul_h(&bw, xr, T, ref) == 0, "cpu matmul failed");
        void *dw = dev_upload(hw, (size_t)rows * cols * 2);
        float *dx = dev_upload(x, (size_t)T * cols * 4), *dy = dev_alloc((size_t)T * rows * 4);
        uint16_t *dxb = dev_alloc((size_t)T * cols * 2);
        const kn_weight kw = {KN_W_BF16, rows, cols, dw, (size_t)cols * 2};
        const int mrc = kn_blaslt_matmul(p, &kw, dx, dxb, dy, ws, NULL);
        KN_EXPECT(mrc == 0, "kn_blaslt_matmul: %d %s", mrc, kn_blaslt_last_error(h));
        dev_download(y, dy, (size_t)T * rows * 4);
        KN_CK(cudaMemset(dy, 0, (size_t)T * rows * 4));
        KN_CK(kn_blaslt_matmul(p, &kw, dx, dxb, dy, ws, NULL));
        dev_download(y2, dy, (size_t)T * rows * 4);
        const double e = kn_nmse(y, ref, (size_t)T * rows);
        KN_EXPECT(e <= 1e-8, "cublaslt %lldx%lld T=%d: NMSE %.3g > 1e-8", (long long)rows, (long long)cols, T, e);
        KN_EXPECT(!memcmp(y, y2, (size_t)T * rows * 4), "cublaslt %lldx%lld T=%d: two runs differ", (long long)rows,
               (long long)cols, T);
        const kn_weight bad = {KN_W_BF16, rows + 1, cols, dw, (size_t)cols * 2};
        KN_EXPECT(kn_blaslt_matmul(p, &bad, dx, dxb, dy, ws, NULL) == (int)cudaErrorInvalidValue,
               "a weight of another shape than the plan's accepted");
        printf("cublaslt bf16 %6lld x %-5lld T=%3d: NMSE %.2e (bound 1e-08), reproducible\n", (long long)rows,
               (long long)cols, T, e);
        kn_blaslt_plan_destroy(p);
        KN_CK(cudaFree(dw)); KN_CK(cudaFree(dx)); KN_CK(cudaFree(dy)); KN_CK(cudaFree(dxb));
        free(hw), free(x), free(xr), free(ref), free(y), free(y2);
    }
    KN_CK(cudaFree(ws));
    kn_blaslt_destroy(h);
}

/* -------------------------------------------------------------- embed */

static void test_embed(void) {
    const int64_t rows = 1000, cols = 576;
    for (int t = KN_W_F32; t <= KN_W_Q4_1; t++) {
        const size_t rb = natural_row_bytes((kn_wtype)t, cols);
        uint8_t *hw = rand_weight((kn_wtype)t, rows, cols, rb);
        uint8_t *dw = dev_upload(hw, (size_t)rows * rb);
        kn_weight kw = {(kn_wtype)t, rows, cols, dw, rb};
        bk_weight bw = {(bk_wtype)t, rows, cols, hw, rb, NULL};
        int32_t ids[TMAX];
        for (int i = 0; i < TMAX; i++) ids[i] = i == 0 ? 0 : i == 1 ? (int32_t)rows - 1 : (int32_t)(rng_u64() % rows);
        int32_t *did = dev_upload(ids, sizeof ids);
        int32_t *dflag = dev_alloc(4), flag = -1;
        float *dout = dev_alloc((size_t)TMAX * cols * 4), *out = xmalloc((size_t)TMAX * cols * 4),
              *ref = xmalloc((size_t)TMAX * cols * 4);
        for (int mi = 0; mi < NM; mi++) {
            const int32_t M = MS[mi];
            KN_CK(cudaMemset(dflag, 0, 4));
            KN_CK(kn_embed(&kw, did, M, dout, dflag, NULL));
            dev_download(out, dout, (size_t)M * cols * 4);
            dev_download(&flag, dflag, 4);
            KN_EXPECT(cpu_embed_h(&bw, ids, M, ref) == 0, "cpu embed failed");
            KN_EXPECT(!memcmp(out, ref, (size_t)M * cols * 4), "embed %s M=%d: not bit-identical to the CPU", wname((kn_wtype)t), M);
            KN_EXPECT(flag == 0, "embed %s M=%d: bad-id flag %d with valid ids", wname((kn_wtype)t), M, flag);
        }
        /* bad ids: -1 and rows; their rows NaN, the flag set, the other rows intact */
        int32_t bad[4] = {5, -1, 7, (int32_t)rows};
        KN_CK(cudaMemcpy(did, bad, sizeof bad, cudaMemcpyHostToDevice));
        KN_CK(cudaMemset(dflag, 0, 4));
        KN_CK(kn_embed(&kw, did, 4, dout, dflag, NULL));
        dev_download(out, dout, 4 * (size_t)cols * 4);
        dev_download(&flag, dflag, 4);
        KN_EXPECT(flag == 1, "embed %s: bad ids did not set the flag (%d)", wname((kn_wtype)t), flag);
        KN_EXPECT(isnan(out[cols]) && isnan(out[4 * cols - 1]), "embed %s: bad-id rows are not NaN", wname((kn_wtype)t));
        bk_weight_row_f32(&bw, 7, ref);
        KN_EXPECT(!memcmp(out + 2 * cols, ref, (size_t)cols * 4), "embed %s: a good row next to bad ones changed", wname((kn_wtype)t));
        KN_CK(kn_embed(&kw, did, 4, dout, NULL, NULL)); /* no flag: still no wild read */
        KN_CK(cudaDeviceSynchronize());
        KN_CK(cudaFree(dw)); KN_CK(cudaFree(did)); KN_CK(cudaFree(dflag)); KN_CK(cudaFree(dout));
        free(hw), free(out), free(ref);
    }
    printf("embed: all formats bit-identical to the CPU, bad ids flagged\n");
}

/* -------------------------------------------------------------- norms */

static void test_rmsnorm(void) {
    const int32_t dims[] = {576, 4096, 1000};
    for (size_t di = 0; di < 3; di++) {
        const int32_t dim = dims[di];
        const size_t n = (size_t)TMAX * dim;
        float *x = rand_f32(n), *r = rand_f32(n), *g = rand_f32((size_t)dim);
        for (size_t i = 0; i < n; i++) x[i] *= 3.0f; /* not unit scale */
        float *dx = dev_upload(x, n * 4), *dr = dev_upload(r, n * 4), *dg = dev_upload(g, (size_t)dim * 4);
        float *dout = dev_alloc(n * 4), *dxr = dev_alloc(n * 4);
        float *out = xmalloc(n * 4), *all = xmalloc(n * 4), *ref = xmalloc(n * 4), *xr = xmalloc(n * 4);
        const float eps = 1e-5f;
        /* plain */
        KN_CK(kn_rmsnorm(dx, dg, TMAX, dim, eps, dout, NULL));
        dev_download(all, dout, n * 4);
        double worst = 0, worst_add = 0;
        for (int mi = 0; mi < NM; mi++) {
            const int32_t M = MS[mi];
            cpu_rmsnorm_h(x, g, M, dim, eps, ref);
            KN_CK(kn_rmsnorm(dx, dg, M, dim, eps, dout, NULL));
            dev_download(out, dout, (size_t)M * dim * 4);
            const double e = kn_nmse(out, ref, (size_t)M * dim);
            worst = e > worst ? e : worst;
            KN_EXPECT(e <= NMSE_NORM, "rmsnorm dim %d M=%d: NMSE %.3g", dim, M, e);
            KN_EXPECT(!memcmp(out, all, (size_t)M * dim * 4), "rmsnorm dim %d M=%d: != rows of T=128", dim, M);
        }
        for (int32_t p = 0; p < TMAX; p += 37) {
            KN_CK(kn_rmsnorm(dx + (size_t)p * dim, dg, 1, dim, eps, dout, NULL));
            dev_download(out, dout, (size_t)dim * 4);
            KN_EXPECT(!memcmp(out, all + (size_t)p * dim, (size_t)dim * 4), "rmsnorm: row %d alone != in T=128", p);
        }
        /* fused add: x' = x + r (bitwise = CPU add), out = rmsnorm(x') */
        for (int mi = 0; mi < NM; mi++) {
            const int32_t M = MS[mi];
            const size_t m = (size_t)M * dim;
            memcpy(xr, x, m * 4);
            cpu_add_h(xr, r, (int64_t)m);
            cpu_rmsnorm_h(xr, g, M, dim, eps, ref);
            KN_CK(cudaMemcpy(dxr, x, m * 4, cudaMemcpyHostToDevice));
            KN_CK(kn_add_rmsnorm(dxr, dr, dg, M, dim, eps, dout, NULL));
            dev_download(out, dout, m * 4);
            const double e = kn_nmse(out, ref, m);
            worst_add = e > worst_add ? e : worst_add;
            KN_EXPECT(e <= NMSE_NORM, "add_rmsnorm dim %d M=%d: NMSE %.3g", dim, M, e);
            dev_download(out, dxr, m * 4);
            KN_EXPECT(!memcmp(out, xr, m * 4), "add_rmsnorm dim %d M=%d: residual != CPU add", dim, M);
        }
        /* fused add, batch invariance: row 77 alone vs inside T=128; r = NULL = plain */
        KN_CK(cudaMemcpy(dxr, x, n * 4, cudaMemcpyHostToDevice));
        KN_CK(kn_add_rmsnorm(dxr, dr, dg, TMAX, dim, eps, dout, NULL));
        dev_download(all, dout, n * 4);
        KN_CK(cudaMemcpy(dxr, x + 77 * (size_t)dim, (size_t)dim * 4, cudaMemcpyHostToDevice));
        KN_CK(kn_add_rmsnorm(dxr, dr + 77 * (size_t)dim, dg, 1, dim, eps, dout, NULL));
        dev_download(out, dout, (size_t)dim * 4);
        KN_EXPECT(!memcmp(out, all + 77 * (size_t)dim, (size_t)dim * 4), "add_rmsnorm: row 77 alone != in T=128");
        KN_CK(cudaMemcpy(dxr, x, n * 4, cudaMemcpyHostToDevice));
        KN_CK(kn_add_rmsnorm(dxr, NULL, dg, 5, dim, eps, dout, NULL));
        KN_CK(kn_rmsnorm(dx, dg, 5, dim, eps, dr, NULL)); /* dr reused as scratch */
        dev_download(out, dout, 5 * (size_t)dim * 4);
        dev_download(ref, dr, 5 * (size_t)dim * 4);
        KN_EXPECT(!memcmp(out, ref, 5 * (size_t)dim * 4), "add_rmsnorm(r = NULL) != rmsnorm");
        /* out aliasing x (plain) */
        KN_CK(cudaMemcpy(dxr, x, n * 4, cudaMemcpyHostToDevice));
        KN_CK(kn_rmsnorm(dxr, dg, TMAX, dim, eps, dxr, NULL));
        KN_CK(kn_rmsnorm(dx, dg, TMAX, dim, eps, dout, NULL));
        dev_download(out, dxr, n * 4);
        dev_download(ref, dout, n * 4);
        KN_EXPECT(!memcmp(out, ref, n * 4), "rmsnorm in place != out of place");
        printf("rmsnorm dim %d: worst NMSE %.2e, fused add %.2e (bound %.0e)\n", dim, worst, worst_add, NMSE_NORM);
        KN_CK(cudaFree(dx)); KN_CK(cudaFree(dr)); KN_CK(cudaFree(dg)); KN_CK(cudaFree(dout)); KN_CK(cudaFree(dxr));
        free(x), free(r), free(g), free(out), free(all), free(ref), free(xr);
    }
}

/* --------------------------------------------------------------- rope */

static void test_rope(void) {
    const struct { int32_t n_heads, head_dim, rot_dim; float theta, mscale; } cs[] = {
        {9, 64, 64, 10000.f, 1.0f}, {32, 128, 128, 500000.f, 1.0f}, {8, 128, 64, 10000.f, 1.2f}, {3, 96, 32, 1e6f, 0.7f}};
    int32_t pos[TMAX];
    for (int i = 0; i < TMAX; i++) pos[i] = i < 4 ? i : (int32_t)(rng_u64() % 131072);
    pos[TMAX - 1] = 1 << 20;
    int32_t *dpos = dev_upload(pos, sizeof pos);
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++)
        for (int neox = 0; neox <= 1; neox++) {
            const int32_t H = cs[c].n_heads, D = cs[c].head_dim, R = cs[c].rot_dim, row = H * D;
            const size_t n = (size_t)TMAX * row;
            float inv[256];
            for (int i = 0; i < R / 2; i++) inv[i] = (float)pow(cs[c].theta, -2.0 * i / R);
            float *x = rand_f32(n), *ref = xmalloc(n * 4), *out = xmalloc(n * 4), *all = xmalloc(n * 4);
            float *dinv = dev_upload(inv, (size_t)R / 2 * 4), *dx = dev_alloc(n * 4);
            KN_CK(cudaMemcpy(dx, x, n * 4, cudaMemcpyHostToDevice));
            KN_CK(kn_rope(dx, TMAX, H, D, R, dpos, dinv, cs[c].mscale, neox, NULL));
            dev_download(all, dx, n * 4);
            double worst = 0;
            for (int mi = 0; mi < NM; mi++) {
                const int32_t M = MS[mi];
                const size_t m = (size_t)M * row;
                memcpy(ref, x, m * 4);
                cpu_rope_h(ref, M, H, D, R, pos, inv, cs[c].mscale, neox);
                KN_CK(cudaMemcpy(dx, x, m * 4, cudaMemcpyHostToDevice));
                KN_CK(kn_rope(dx, M, H, D, R, dpos, dinv, cs[c].mscale, neox, NULL));
                dev_download(out, dx, m * 4);
                const double e = kn_nmse(out, ref, m);
                worst = e > worst ? e : worst;
                KN_EXPECT(e <= NMSE_ROPE, "rope H%d D%d R%d neox %d M=%d: NMSE %.3g", H, D, R, neox, M, e);
                KN_EXPECT(!memcmp(out, all, m * 4), "rope M=%d: != rows of T=128", M);
                int untouched = 1;
                for (int32_t t = 0; t < M && untouched; t++)
                    for (int32_t h = 0; h < H; h++)
                        if (memcmp(out + (size_t)t * row + h * D + R, x + (size_t)t * row + h * D + R, (size_t)(D - R) * 4))
                            untouched = 0;
                KN_EXPECT(untouched, "rope: dims past rot_dim changed");
            }
            /* a token alone at the last position (the largest angle) vs inside T=128 */
            KN_CK(cudaMemcpy(dx, x + (size_t)(TMAX - 1) * row, (size_t)row * 4, cudaMemcpyHostToDevice));
            KN_CK(kn_rope(dx, 1, H, D, R, dpos + TMAX - 1, dinv, cs[c].mscale, neox, NULL));
            dev_download(out, dx, (size_t)row * 4);
            KN_EXPECT(!memcmp(out, all + (size_t)(TMAX - 1) * row, (size_t)row * 4), "rope: last token alone != in T=128");
            printf("rope H%d D%d rot %d neox %d mscale %.1f: worst NMSE %.2e (bound %.0e)\n", H, D, R, neox,
                   cs[c].mscale, worst, NMSE_ROPE);
            KN_CK(cudaFree(dinv)); KN_CK(cudaFree(dx));
            free(x), free(ref), free(out), free(all);
        }
    KN_CK(cudaFree(dpos));
}

/* -------------------------------------------------------- elementwise */

static void test_elementwise(void) {
    const int32_t n = 1536; /* per row */
    const size_t N = (size_t)TMAX * n;
    float *a = rand_f32(N), *b = rand_f32(N), *bias = rand_f32((size_t)n);
    for (size_t i = 0; i < N; i++) a[i] *= 12.0f; /* gate values into expf's tails */
    a[0] = 100.f, a[1] = -100.f, a[2] = 0.f;
    float *da = dev_upload(a, N * 4), *db = dev_upload(b, N * 4), *dbias = dev_upload(bias, (size_t)n * 4);
    float *dout = dev_alloc(N * 4), *out = xmalloc(N * 4), *ref = xmalloc(N * 4), *all = xmalloc(N * 4);
    double worst = 0;
    KN_CK(kn_silu_mul(da, db, (int64_t)N, dout, NULL));
    dev_download(all, dout, N * 4);
    for (int mi = 0; mi < NM; mi++) {
        const size_t m = (size_t)MS[mi] * n;
        cpu_silu_h(a, b, (int64_t)m, ref);
        KN_CK(kn_silu_mul(da, db, (int64_t)m, dout, NULL));
        dev_download(out, dout, m * 4);
        const double e = kn_nmse(out, ref, m);
        worst = e > worst ? e : worst;
        KN_EXPECT(e <= NMSE_SILU, "silu_mul M=%d: NMSE %.3g", MS[mi], e);
        KN_EXPECT(!memcmp(out, all, m * 4), "silu_mul M=%d: != rows of T=128", MS[mi]);
        /* add: bitwise the CPU's */
        memcpy(ref, a, m * 4);
        cpu_add_h(ref, b, (int64_t)m);
        KN_CK(cudaMemcpy(dout, a, m * 4, cudaMemcpyHostToDevice));
        KN_CK(kn_add(dout, db, (int64_t)m, NULL));
        dev_download(out, dout, m * 4);
        KN_EXPECT(!memcmp(out, ref, m * 4), "add M=%d: not bit-identical to the CPU", MS[mi]);
        /* bias: the CPU add of the bias row onto each row */
        memcpy(ref, a, m * 4);
        for (int32_t t = 0; t < MS[mi]; t++) cpu_add_h(ref + (size_t)t * n, bias, n);
        KN_CK(cudaMemcpy(dout, a, m * 4, cudaMemcpyHostToDevice));
        KN_CK(kn_add_bias(dout, dbias, MS[mi], n, NULL));
        dev_download(out, dout, m * 4);
        KN_EXPECT(!memcmp(out, ref, m * 4), "add_bias M=%d: not bit-identical to the CPU", MS[mi]);
    }
    printf("silu_mul: worst NMSE %.2e (bound %.0e); add, add_bias bit-identical\n", worst, NMSE_SILU);
    /* silu in place (out = gate) */
    KN_CK(cudaMemcpy(dout, a, N * 4, cudaMemcpyHostToDevice));
    KN_CK(kn_silu_mul(dout, db, (int64_t)N, dout, NULL));
    dev_download(out, dout, N * 4);
    KN_EXPECT(!memcmp(out, all, N * 4), "silu_mul in place != out of place");
    /* copy_rows: aux capture of layer a = 1 of n_aux = 3 into [T, 3n]; the rest untouched */
    for (int mi = 0; mi < NM; mi++) {
        const int32_t M = MS[mi];
        float *daux = dev_alloc((size_t)M * 3 * n * 4), *aux = xmalloc((size_t)M * 3 * n * 4);
        KN_CK(cudaMemset(daux, 0x7f, (size_t)M * 3 * n * 4));
        KN_CK(kn_copy_rows(daux + n, 3 * (int64_t)n, da, n, M, n, NULL));
        dev_download(aux, daux, (size_t)M * 3 * n * 4);
        int ok = 1;
        for (int32_t t = 0; t < M && ok; t++) {
            const uint8_t *row = (const uint8_t *)(aux + (size_t)t * 3 * n);
            ok = !memcmp(row + 4 * (size_t)n, a + (size_t)t * n, (size_t)n * 4);
            for (size_t i = 0; i < 4 * (size_t)n && ok; i++) ok = row[i] == 0x7f && row[8 * (size_t)n + i] == 0x7f;
        }
        KN_EXPECT(ok, "copy_rows M=%d: wrong rows or bytes outside them written", M);
        KN_CK(cudaFree(daux));
        free(aux);
    }
    KN_CK(cudaFree(da)); KN_CK(cudaFree(db)); KN_CK(cudaFree(dbias)); KN_CK(cudaFree(dout));
    free(a), free(b), free(bias), free(out), free(ref), free(all);
}

/* ------------------------------------------------------------- argmax */

static void test_argmax(void) {
    const int32_t Vs[] = {1000, 49152, 128256};
    for (size_t vi = 0; vi < 3; vi++) {
        const int32_t V = Vs[vi];
        const size_t N = (size_t)TMAX * V;
        float *l = rand_f32(N);
        for (int32_t t = 0; t < TMAX; t++) {
            float *row = l + (size_t)t * V;
            const int kind = t % 6;
            if (kind == 1) { row[V / 3] = 5.f, row[V / 2] = 5.f, row[V - 1] = 5.f; }     /* tie: lowest id */
            if (kind == 2) { row[0] = NAN, row[17] = 7.f, row[V - 2] = NAN; }             /* NaN loses */
            if (kind == 3) for (int32_t i = 0; i < V; i++) row[i] = NAN;                  /* all NaN -> 0 */
            if (kind == 4) { for (int32_t i = 0; i < V; i++) row[i] = -INFINITY; row[V / 7] = NAN; } /* -inf beats NaN */
            if (kind == 5) { row[V - 1] = INFINITY, row[5] = INFINITY; }                  /* +inf tie */
        }
        int32_t *d2t32 = xmalloc((size_t)V * 4);
        int64_t *d2t64 = xmalloc((size_t)V * 8);
        for (int32_t i = 0; i < V; i++) d2t32[i] = (int32_t)(rng_u64() % 1000), d2t64[i] = d2t32[i] + 7;
        float *dl = dev_upload(l, N * 4);
        int32_t *dd32 = dev_upload(d2t32, (size_t)V * 4), *dout = dev_alloc(TMAX * 4);
        int64_t *dd64 = dev_upload(d2t64, (size_t)V * 8);
        int32_t out[TMAX], all[TMAX];
        KN_CK(kn_argmax(dl, TMAX, V, NULL, 0, dout, NULL));
        dev_download(all, dout, sizeof all);
        for (int mi = 0; mi < NM; mi++) {
            const int32_t M = MS[mi];
            int ok = 1, ok32 = 1, ok64 = 1;
            KN_CK(kn_argmax(dl, M, V, NULL, 0, dout, NULL));
            dev_download(out, dout, (size_t)M * 4);
            for (int32_t t = 0; t < M; t++) ok &= out[t] == sampler_argmax(l + (size_t)t * V, V) && out[t] == all[t];
            KN_CK(kn_argmax(dl, M, V, dd32, 32, dout, NULL));
            dev_download(out, dout, (size_t)M * 4);
            for (int32_t t = 0; t < M; t++) { const int32_t id = sampler_argmax(l + (size_t)t * V, V); ok32 &= out[t] == id + d2t32[id]; }
            KN_CK(kn_argmax(dl, M, V, dd64, 64, dout, NULL));
            dev_download(out, dout, (size_t)M * 4);
            for (int32_t t = 0; t < M; t++) { const int32_t id = sampler_argmax(l + (size_t)t * V, V); ok64 &= out[t] == id + d2t64[id]; }
            KN_EXPECT(ok && ok32 && ok64, "argmax V=%d M=%d: plain %d d2t32 %d d2t64 %d (1 = equal to sampler_argmax)", V, M,
                   ok, ok32, ok64);
        }
        KN_CK(kn_argmax(dl + (size_t)101 * V, 1, V, NULL, 0, dout, NULL));
        dev_download(out, dout, 4);
        KN_EXPECT(out[0] == all[101], "argmax: row 101 alone != in T=128");
        KN_EXPECT(kn_argmax(dl, 1, V, dd32, 0, dout, NULL) == (int)cudaErrorInvalidValue, "d2t with 0 bits accepted");
        KN_CK(cudaFree(dl)); KN_CK(cudaFree(dd32)); KN_CK(cudaFree(dd64)); KN_CK(cudaFree(dout));
        free(l), free(d2t32), free(d2t64);
    }
    printf("argmax: equal to sampler_argmax (ties, NaN, -inf, +inf), d2t int32/int64\n");
}

/* --------------------------------------------------------- CUDA graph
 * A miniature decoder step (embed, rmsnorm, q + rope, SwiGLU MLP, fused
 * residual add + rmsnorm, LM head, argmax) launched on a stream, then captured
 * into a CUDA graph and replayed twice: the launchers must be capturable (no
 * allocation, no sync) and the replays bit-identical to the direct launch. */
typedef struct step_bufs {
    kn_weight emb, wq, wg, wu, wd;
    const int32_t *ids, *pos;
    const float *g, *inv;
    float *h, *n, *q, *a, *b, *d, *logits;
    int32_t *out, *flag;
} step_bufs;

static int step_launch(const step_bufs *s, int32_t T, cudaStream_t st) {
    const int32_t H = 576, F = 1536, V = 1000;
    KN_CHECK(kn_embed(&s->emb, s->ids, T, s->h, s->flag, st));
    KN_CHECK(kn_rmsnorm(s->h, s->g, T, H, 1e-5f, s->n, st));
    KN_CHECK(kn_matmul(&s->wq, s->n, T, s->q, st));
    KN_CHECK(kn_rope(s->q, T, 9, 64, 64, s->pos, s->inv, 1.0f, 1, st));
    KN_CHECK(kn_matmul(&s->wg, s->n, T, s->a, st));
    KN_CHECK(kn_matmul(&s->wu, s->n, T, s->b, st));
    KN_CHECK(kn_silu_mul(s->a, s->b, (int64_t)T * F, s->a, st));
    KN_CHECK(kn_matmul(&s->wd, s->a, T, s->d, st));
    KN_CHECK(kn_add(s->d, s->q, (int64_t)T * H, st));
    KN_CHECK(kn_add_rmsnorm(s->h, s->d, s->g, T, H, 1e-5f, s->n, st));
    KN_CHECK(kn_matmul(&s->emb, s->n, T, s->logits, st)); /* tied LM head */
    KN_CHECK(kn_argmax(s->logits, T, V, NULL, 0, s->out, st));
    return 0;
}

static void test_graph(void) {
    const int32_t T = 5, H = 576, F = 1536, V = 1000;
    uint8_t *he = rand_weight(KN_W_Q8_0, V, H, natural_row_bytes(KN_W_Q8_0, H));
    uint8_t *hq = rand_weight(KN_W_BF16, H, H, natural_row_bytes(KN_W_BF16, H));
    uint8_t *hg = rand_weight(KN_W_Q4_1, F, H, natural_row_bytes(KN_W_Q4_1, H));
    uint8_t *hu = rand_weight(KN_W_Q4_0, F, H, natural_row_bytes(KN_W_Q4_0, H));
    uint8_t *hd = rand_weight(KN_W_F16, H, F, natural_row_bytes(KN_W_F16, F));
    int32_t ids[5] = {1, 999, 17, 500, 3}, pos[5] = {0, 1, 2, 3, 4};
    float *g = rand_f32((size_t)H), inv[32];
    for (int i = 0; i < 32; i++) inv[i] = (float)pow(10000.0, -2.0 * i / 64);
    step_bufs s = {
        .emb = {KN_W_Q8_0, V, H, dev_upload(he, (size_t)V * natural_row_bytes(KN_W_Q8_0, H)), natural_row_bytes(KN_W_Q8_0, H)},
        .wq = {KN_W_BF16, H, H, dev_upload(hq, (size_t)H * natural_row_bytes(KN_W_BF16, H)), natural_row_bytes(KN_W_BF16, H)},
        .wg = {KN_W_Q4_1, F, H, dev_upload(hg, (size_t)F * natural_row_bytes(KN_W_Q4_1, H)), natural_row_bytes(KN_W_Q4_1, H)},
        .wu = {KN_W_Q4_0, F, H, dev_upload(hu, (size_t)F * natural_row_bytes(KN_W_Q4_0, H)), natural_row_bytes(KN_W_Q4_0, H)},
        .wd = {KN_W_F16, H, F, dev_upload(hd, (size_t)H * natural_row_bytes(KN_W_F16, F)), natural_row_bytes(KN_W_F16, F)},
        .ids = dev_upload(ids, sizeof ids), .pos = dev_upload(pos, sizeof pos),
        .g = dev_upload(g, (size_t)H * 4), .inv = dev_upload(inv, sizeof inv),
        .h = dev_alloc((size_t)T * H * 4), .n = dev_alloc((size_t)T * H * 4), .q = dev_alloc((size_t)T * H * 4),
        .a = dev_alloc((size_t)T * F * 4), .b = dev_alloc((size_t)T * F * 4), .d = dev_alloc((size_t)T * H * 4),
        .logits = dev_alloc((size_t)T * V * 4), .out = dev_alloc((size_t)T * 4), .flag = dev_alloc(4),
    };
    KN_CK(cudaMemset(s.flag, 0, 4));
    cudaStream_t st;
    KN_CK(cudaStreamCreate(&st));
    float *n0 = xmalloc((size_t)T * H * 4), *n1 = xmalloc((size_t)T * H * 4), *l0 = xmalloc((size_t)T * V * 4),
          *l1 = xmalloc((size_t)T * V * 4);
    int32_t o0[5], o1[5];
    KN_EXPECT(step_launch(&s, T, st) == 0, "graph: direct launch failed");
    KN_CK(cudaStreamSynchronize(st));
    dev_download(n0, s.n, (size_t)T * H * 4);
    dev_download(l0, s.logits, (size_t)T * V * 4);
    dev_download(o0, s.out, sizeof o0);
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    KN_CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    const int lrc = step_launch(&s, T, st);
    KN_CK(cudaStreamEndCapture(st, &graph));
    KN_EXPECT(lrc == 0, "graph: a launcher failed during capture");
    KN_CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; rep++) {
        KN_CK(cudaMemset(s.logits, 0, (size_t)T * V * 4));
        KN_CK(cudaGraphLaunch(exec, st));
        KN_CK(cudaStreamSynchronize(st));
        dev_download(n1, s.n, (size_t)T * H * 4);
        dev_download(l1, s.logits, (size_t)T * V * 4);
        dev_download(o1, s.out, sizeof o1);
        KN_EXPECT(!memcmp(n0, n1, (size_t)T * H * 4) && !memcmp(l0, l1, (size_t)T * V * 4) && !memcmp(o0, o1, sizeof o0),
               "graph replay %d differs from the direct launch", rep);
    }
    int32_t flag = -1;
    dev_download(&flag, s.flag, 4);
    KN_EXPECT(flag == 0, "graph: embed flagged valid ids");
    printf("graph: a decoder step captured and replayed twice, bit-identical to direct launches\n");
    KN_CK(cudaGraphExecDestroy(exec));
    KN_CK(cudaGraphDestroy(graph));
    KN_CK(cudaStreamDestroy(st));
    void *bufs[] = {(void *)s.emb.data, (void *)s.wq.data, (void *)s.wg.data, (void *)s.wu.data, (void *)s.wd.data,
                    (void *)s.ids, (void *)s.pos, (void *)s.g, (void *)s.inv, s.h, s.n, s.q, s.a, s.b, s.d,
                    s.logits, s.out, s.flag};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) KN_CK(cudaFree(bufs[i]));
    free(he), free(hq), free(hg), free(hu), free(hd), free(g), free(n0), free(n1), free(l0), free(l1);
}

int main(void) {
    kn_harness_require_gpu();
    setenv("SPECD_CPU_ISA", "portable", 1); /* f32 activations on the CPU: the reference */
    g_cpu = bk_cpu_create((int)sysconf(_SC_NPROCESSORS_ONLN)); /* not OMP_NUM_THREADS=2 of ctest */
    if (!g_cpu) { fprintf(stderr, "bk_cpu_create failed\n"); return 1; }
    printf("reference: %s\n", bk_cpu_describe(g_cpu));
    test_matmul();
    test_embed();
    test_rmsnorm();
    test_rope();
    test_elementwise();
    test_argmax();
    test_blaslt();
    test_graph();
    bk_cpu_destroy(g_cpu);
    printf("%s: %d checks, %d failed\n", kn_fails ? "FAIL" : "ok", kn_checks, kn_fails);
    return kn_fails ? 1 : 0;
}
