/*
 * kn_blaslt.cu: large-M bf16 matmul through cuBLASLt, loaded at run time
 * (dlopen of libcublasLt.so.13, then libcublasLt.so; never linked, so a
 * binary without the library still starts), for prefill when the backend is
 * NOT deterministic. Owns: the dlopen handle and the cublasLt handle
 * (kn_blaslt), and per-shape plans (kn_blaslt_plan: descriptors, layouts,
 * one pinned algorithm).
 *
 * Why opt-in only: cuBLASLt tiles the reduction differently from kn_matmul
 * and the activations are rounded to bf16 first, so the same token gives
 * different bits here and in the decode kernel (not batch invariant relative
 * to it). kn_blaslt_create refuses when deterministic != 0.
 *
 * Pinned algorithm: at plan creation the heuristic's answers for the plan's
 * exact shape are taken in order; the first one that accepts split-K = 1 and
 * no reduction scheme (cublasLtMatmulAlgoCheck) is kept for the plan's life,
 * so every run of a plan executes the same kernel with the same reduction
 * order (no atomics): run-to-run reproducible.
 *
 * Layout: row-major y[T, rows] = x[T, cols] @ W^T is, column-major,
 * D[rows, T] = op_T(A[cols, rows]) * B[cols, T] with A = W (ld cols),
 * B = xb (ld cols), D = y (ld rows).
 *
 * Threading: a handle and its plans are used from one thread (the engine
 * thread); every cublasLt call is checked, its status kept in the handle.
 */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/kn.h"
#include "kernels/kn_linear.h"

#define KN_LT_FUNCS(X)                  \
    X(cublasLtCreate)                   \
    X(cublasLtDestroy)                  \
    X(cublasLtGetStatusName)            \
    X(cublasLtMatmulDescCreate)         \
    X(cublasLtMatmulDescDestroy)        \
    X(cublasLtMatmulDescSetAttribute)   \
    X(cublasLtMatrixLayoutCreate)       \
    X(cublasLtMatrixLayoutDestroy)      \
    X(cublasLtMatmulPreferenceCreate)   \
    X(cublasLtMatmulPreferenceDestroy)  \
    X(cublasLtMatmulPreferenceSetAttribute) \
    X(cublasLtMatmulAlgoGetHeuristic)   \
    X(cublasLtMatmulAlgoConfigSetAttribute) \
    X(cublasLtMatmulAlgoCheck)          \
    X(cublasLtMatmul)

struct kn_blaslt {
    void *dl;
#define KN_LT_PTR(f) decltype(&::f) f;
    KN_LT_FUNCS(KN_LT_PTR)
#undef KN_LT_PTR
    cublasLtHandle_t lt;
    char last_error[256];
};

struct kn_blaslt_plan {
    kn_blaslt *h;
    int64_t rows, cols;
    int32_t T;
    size_t ws_bytes;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
};

namespace {

void set_why(char *why, size_t n, const char *fmt, ...) {
    if (!why || !n) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, n, fmt, ap);
    va_end(ap);
}

/* Checks a cublasLt status: on failure records "file:line: call: NAME (code)"
 * in h->last_error and `why`, and returns cudaErrorUnknown from the caller. */
#define LT_CHECK(h, why, why_len, call)                                                               \
    do {                                                                                              \
        cublasStatus_t st_ = (call);                                                                  \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                                           \
            snprintf((h)->last_error, sizeof (h)->last_error, "%s:%d: %s: %s (%d)", __FILE__, __LINE__, \
                     #call, (h)->cublasLtGetStatusName ? (h)->cublasLtGetStatusName(st_) : "?", (int)st_); \
            set_why(why, why_len, "%s", (h)->last_error);                                             \
            return (int)cudaErrorUnknown;                                                             \
        }                                                                                             \
    } while (0)

__global__ void kn_f32_to_bf16_kernel(const float *__restrict__ x, __nv_bfloat16 *__restrict__ xb, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        xb[i] = __float2bfloat16_rn(x[i]);
}

}  // namespace

extern "C" int kn_blaslt_create(int deterministic, kn_blaslt **out, char *why, size_t why_len) {
    if (!out) return (int)cudaErrorInvalidValue;
    *out = nullptr;
    set_why(why, why_len, "");
    if (deterministic) {
        set_why(why, why_len, "cuBLASLt is not batch invariant relative to kn_matmul: only a backend created with "
                              "deterministic == false may use it");
        return (int)cudaErrorNotSupported;
    }
    kn_blaslt *h = static_cast<kn_blaslt *>(calloc(1, sizeof *h));
    if (!h) return (int)cudaErrorMemoryAllocation;
    /* $SPECD_CUBLASLT, the loader's path, then the toolkit's default place */
    const char *names[] = {getenv("SPECD_CUBLASLT"), "libcublasLt.so.13", "libcublasLt.so",
                           "/usr/local/cuda/lib64/libcublasLt.so.13",
                           "/usr/local/cuda/targets/x86_64-linux/lib/libcublasLt.so.13"};
    const char *err = "";
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !h->dl; i++) {
        if (!names[i] || !names[i][0]) continue;
        h->dl = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!h->dl) err = dlerror();
    }
    if (!h->dl) {
        set_why(why, why_len, "dlopen $SPECD_CUBLASLT / libcublasLt.so.13 / libcublasLt.so / /usr/local/cuda: %s", err);
        free(h);
        return (int)cudaErrorSharedObjectInitFailed;
    }
#define KN_LT_SYM(f)                                                                     \
    h->f = reinterpret_cast<decltype(h->f)>(dlsym(h->dl, #f));                           \
    if (!h->f) {                                                                         \
        set_why(why, why_len, "libcublasLt has no symbol %s", #f);                      \
        dlclose(h->dl);                                                                  \
        free(h);                                                                         \
        return (int)cudaErrorSharedObjectSymbolNotFound;                                 \
    }
    KN_LT_FUNCS(KN_LT_SYM)
#undef KN_LT_SYM
    cublasStatus_t st = h->cublasLtCreate(&h->lt);
    if (st != CUBLAS_STATUS_SUCCESS) {
        set_why(why, why_len, "%s:%d: cublasLtCreate: %s (%d)", __FILE__, __LINE__, h->cublasLtGetStatusName(st),
                (int)st);
        dlclose(h->dl);
        free(h);
        return (int)cudaErrorUnknown;
    }
    *out = h;
    return 0;
}

extern "C" void kn_blaslt_destroy(kn_blaslt *h) {
    if (!h) return;
    if (h->lt) h->cublasLtDestroy(h->lt);
    if (h->dl) dlclose(h->dl);
    free(h);
}

extern "C" void kn_blaslt_plan_destroy(kn_blaslt_plan *p) {
    if (!p) return;
    kn_blaslt *h = p->h;
    if (p->a) h->cublasLtMatrixLayoutDestroy(p->a);
    if (p->b) h->cublasLtMatrixLayoutDestroy(p->b);
    if (p->d) h->cublasLtMatrixLayoutDestroy(p->d);
    if (p->desc) h->cublasLtMatmulDescDestroy(p->desc);
    free(p);
}

namespace {
/* Fills p's descriptors and pins its algorithm (kn_blaslt_plan_create's body). */
int plan_fill(kn_blaslt_plan *p, char *why, size_t why_len) {
    kn_blaslt *h = p->h;
    LT_CHECK(h, why, why_len, h->cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    LT_CHECK(h, why, why_len,
             h->cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT));
    LT_CHECK(h, why, why_len,
             h->cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN));
    LT_CHECK(h, why, why_len,
             h->cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, (uint64_t)p->cols, (uint64_t)p->rows, p->cols));
    LT_CHECK(h, why, why_len,
             h->cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, (uint64_t)p->cols, (uint64_t)p->T, p->cols));
    LT_CHECK(h, why, why_len,
             h->cublasLtMatrixLayoutCreate(&p->d, CUDA_R_32F, (uint64_t)p->rows, (uint64_t)p->T, p->rows));
    cublasLtMatmulPreference_t pref = nullptr;
    LT_CHECK(h, why, why_len, h->cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = p->ws_bytes;
    cublasStatus_t st = h->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                                 sizeof ws);
    cublasLtMatmulHeuristicResult_t res[16];
    int n = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = h->cublasLtMatmulAlgoGetHeuristic(h->lt, p->desc, p->a, p->b, p->d, p->d, pref, 16, res, &n);
    h->cublasLtMatmulPreferenceDestroy(pref);
    LT_CHECK(h, why, why_len, st);
    const int32_t one = 1;
    const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    for (int i = 0; i < n; i++) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        cublasLtMatmulAlgo_t algo = res[i].algo;
        cublasLtMatmulHeuristicResult_t chk;
        if (h->cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof one) ||
            h->cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof none) ||
            h->cublasLtMatmulAlgoCheck(h->lt, p->desc, p->a, p->b, p->d, p->d, &algo, &chk) ||
            chk.workspaceSize > p->ws_bytes)
            continue;
        p->algo = algo;
        return 0;
    }
    set_why(why, why_len, "cuBLASLt offers no algorithm without split-K for bf16 [%lld x %lld] x T=%d with %zu bytes "
                          "of workspace (%d candidates)", (long long)p->rows, (long long)p->cols, p->T, p->ws_bytes, n);
    return (int)cudaErrorNotSupported;
}
}  // namespace

extern "C" int kn_blaslt_plan_create(kn_blaslt *h, int64_t rows, int64_t cols, int32_t T, size_t ws_bytes,
                                     kn_blaslt_plan **out, char *why, size_t why_len) {
    if (!h || !out || rows <= 0 || cols <= 0 || T <= 0 || cols % 8) return (int)cudaErrorInvalidValue;
    *out = nullptr;
    kn_blaslt_plan *p = static_cast<kn_blaslt_plan *>(calloc(1, sizeof *p));
    if (!p) return (int)cudaErrorMemoryAllocation;
    p->h = h;
    p->rows = rows, p->cols = cols, p->T = T, p->ws_bytes = ws_bytes;
    const int rc = plan_fill(p, why, why_len);
    if (rc) {
        kn_blaslt_plan_destroy(p);
        return rc;
    }
    *out = p;
    return 0;
}

extern "C" int kn_blaslt_matmul(kn_blaslt_plan *p, const kn_weight *w, const float *x, uint16_t *xb, float *y,
                                void *ws, void *stream) {
    if (!p || !w || !x || !xb || !y || (p->ws_bytes && !ws) || w->type != KN_W_BF16 || w->rows != p->rows ||
        w->cols != p->cols || w->row_bytes != (size_t)w->cols * 2)
        return (int)cudaErrorInvalidValue;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int64_t n = (int64_t)p->T * p->cols;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 4096) blocks = 4096;
    kn_f32_to_bf16_kernel<<<(unsigned)blocks, 256, 0, s>>>(x, reinterpret_cast<__nv_bfloat16 *>(xb), n);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    const float alpha = 1.0f, beta = 0.0f;
    kn_blaslt *h = p->h;
    LT_CHECK(h, nullptr, 0,
             h->cublasLtMatmul(h->lt, p->desc, &alpha, w->data, p->a, xb, p->b, &beta, y, p->d, y, p->d, &p->algo, ws,
                               p->ws_bytes, s));
    return 0;
}

extern "C" const char *kn_blaslt_last_error(const kn_blaslt *h) { return h ? h->last_error : ""; }
