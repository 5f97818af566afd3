/*
 * kn_elementwise.cu: SiLU x up, add, bias broadcast, strided row copy, and
 * argmax over logits rows with the draft-to-target map. No state.
 *
 * The element-wise ops compute each output from its own inputs with
 * correctly rounded f32 operations (expf excepted: CUDA's, <= 2 ulp), so
 * they are batch invariant by construction. Grid-stride loops over a grid
 * capped at KN_EW_MAX_BLOCKS blocks of 256 threads.
 *
 * Argmax: one block of 1024 threads per row. The comparison (value first;
 * NaN below every number; equal values -> lower id) is a strict total order
 * on (value, id) pairs, so the winner is the same whatever order the threads
 * meet in; that makes it batch invariant and equal to sampler_argmax.
 */
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/kn.h"
#include "kernels/kn_linear.h"

namespace {

constexpr int KN_EW_THREADS = 256;
constexpr int64_t KN_EW_MAX_BLOCKS = 4096;
constexpr int KN_ARGMAX_THREADS = 1024;

unsigned ew_blocks(int64_t n) {
    const int64_t b = (n + KN_EW_THREADS - 1) / KN_EW_THREADS;
    return (unsigned)(b < KN_EW_MAX_BLOCKS ? b : KN_EW_MAX_BLOCKS);
}

__global__ void kn_silu_mul_kernel(const float *gate, const float *up, int64_t n, float *out) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), up[i]);
    }
}

__global__ void kn_add_kernel(float *y, const float *__restrict__ x, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

__global__ void kn_add_bias_kernel(float *y, const float *__restrict__ b, int64_t total, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], b[i % n]);
}

/* grid.y = row (token), grid-stride over the row in x */
__global__ void kn_copy_rows_kernel(float *__restrict__ dst, int64_t dst_ld, const float *__restrict__ src,
                                    int64_t src_ld, int64_t n) {
    const int64_t t = blockIdx.y;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[t * dst_ld + i] = src[t * src_ld + i];
}

/* (v, i) beats (bv, bi): the order of sampler_argmax */
__device__ __forceinline__ bool am_better(float v, int32_t i, float bv, int32_t bi) {
    const bool vn = isnan(v), bn = isnan(bv);
    if (vn != bn) return bn;  /* a number beats NaN */
    if (!vn && v != bv) return v > bv;
    return i < bi;            /* equal values (or both NaN): lower id */
}

__global__ void __launch_bounds__(KN_ARGMAX_THREADS) kn_argmax_kernel(const float *__restrict__ logits, int32_t V,
                                                                       const void *d2t, int d2t_bits,
                                                                       int32_t *out) {
    __shared__ float sv[KN_ARGMAX_THREADS / 32];
    __shared__ int32_t si[KN_ARGMAX_THREADS / 32];
    const float *row = logits + (int64_t)blockIdx.x * V;
    float bv = __int_as_float(0x7fc00000);
    int32_t bi = INT32_MAX;
    for (int32_t i = threadIdx.x; i < V; i += KN_ARGMAX_THREADS) {
        const float v = row[i];
        if (am_better(v, i, bv, bi)) bv = v, bi = i;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (am_better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if ((threadIdx.x & 31) == 0) sv[threadIdx.x >> 5] = bv, si[threadIdx.x >> 5] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < KN_ARGMAX_THREADS / 32; w++)
            if (am_better(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
        int32_t id = bi;
        if (d2t_bits == 32) id += static_cast<const int32_t *>(d2t)[bi];
        else if (d2t_bits == 64) id = (int32_t)((int64_t)id + static_cast<const int64_t *>(d2t)[bi]);
        out[blockIdx.x] = id;
    }
}

}  // namespace

extern "C" int kn_silu_mul(const float *gate, const float *up, int64_t n, float *out, void *stream) {
    if (!gate || !up || !out || n <= 0) return (int)cudaErrorInvalidValue;
    kn_silu_mul_kernel<<<ew_blocks(n), KN_EW_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(gate, up, n, out);
    return (int)cudaGetLastError();
}

extern "C" int kn_add(float *y, const float *x, int64_t n, void *stream) {
    if (!y || !x || n <= 0) return (int)cudaErrorInvalidValue;
    kn_add_kernel<<<ew_blocks(n), KN_EW_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(y, x, n);
    return (int)cudaGetLastError();
}

extern "C" int kn_add_bias(float *y, const float *b, int32_t T, int64_t n, void *stream) {
    if (!y || !b || T <= 0 || n <= 0) return (int)cudaErrorInvalidValue;
    const int64_t total = (int64_t)T * n;
    kn_add_bias_kernel<<<ew_blocks(total), KN_EW_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(y, b, total, n);
    return (int)cudaGetLastError();
}

extern "C" int kn_copy_rows(float *dst, int64_t dst_ld, const float *src, int64_t src_ld, int32_t T, int64_t n,
                            void *stream) {
    if (!dst || !src || T <= 0 || n <= 0 || dst_ld < n || src_ld < n || T > 65535) return (int)cudaErrorInvalidValue;
    int64_t bx = (n + KN_EW_THREADS - 1) / KN_EW_THREADS;
    if (bx > 64) bx = 64;
    kn_copy_rows_kernel<<<dim3((unsigned)bx, (unsigned)T), KN_EW_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
        dst, dst_ld, src, src_ld, n);
    return (int)cudaGetLastError();
}

extern "C" int kn_argmax(const float *logits, int32_t T, int32_t V, const void *d2t, int d2t_bits, int32_t *out,
                         void *stream) {
    if (!logits || !out || T <= 0 || V <= 0) return (int)cudaErrorInvalidValue;
    if (d2t ? (d2t_bits != 32 && d2t_bits != 64) : d2t_bits != 0) return (int)cudaErrorInvalidValue;
    kn_argmax_kernel<<<T, KN_ARGMAX_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(logits, V, d2t, d2t_bits, out);
    return (int)cudaGetLastError();
}
