/*
 * kn_norm.cu: RMSNorm (plain and fused with the residual add) and RoPE.
 * No state.
 *
 * RMSNorm: one block of KN_NORM_THREADS per token. Thread i sums, in double,
 * x[j]^2 for j = i, i + 256, ... in increasing j; the 256 partials are
 * combined by a xor butterfly inside each warp, then warp 0..7 in order.
 * That order is a function of dim alone (batch invariant); the value equals
 * the CPU's sequential double sum up to double rounding (~1e-16 relative),
 * far below the f32 rounding of r = 1 / sqrt(ss / dim + eps), computed in
 * double and rounded once exactly as the CPU does.
 *
 * RoPE: one block per token; cos/sin of each pair's angle in double
 * (kn_sincos: a few double ulps, so the rounded f32 equals the CPU's glibc
 * value except in near-tie cases), computed once into shared memory and
 * applied to every head. Element-wise, trivially batch invariant.
 */
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/kn.h"
#include "kernels/kn_linear.h"

namespace {

constexpr int KN_NORM_THREADS = 256;

template <bool ADD>
__global__ void __launch_bounds__(KN_NORM_THREADS) kn_rmsnorm_kernel(float *x, const float *__restrict__ r,
                                                                      const float *__restrict__ g, int32_t dim,
                                                                      float eps, float *out) {
    __shared__ double part[KN_NORM_THREADS / 32];
    const int64_t base = (int64_t)blockIdx.x * dim;
    float *xt = x + base;
    double ss = 0.0;
    for (int32_t j = threadIdx.x; j < dim; j += KN_NORM_THREADS) {
        float v = xt[j];
        if constexpr (ADD) {
            v = __fadd_rn(v, r[base + j]);
            xt[j] = v;
        }
        ss = __dadd_rn(ss, __dmul_rn((double)v, (double)v));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss = __dadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    double tot = part[0];
#pragma unroll
    for (int w = 1; w < KN_NORM_THREADS / 32; w++) tot = __dadd_rn(tot, part[w]);
    const float rs = (float)(1.0 / sqrt(tot / (double)dim + (double)eps));
    for (int32_t j = threadIdx.x; j < dim; j += KN_NORM_THREADS)
        out[base + j] = __fmul_rn(__fmul_rn(xt[j], rs), g[j]);
}

/* sin and cos of a (|a| < 2^31) in double, without CUDA's Payne-Hanek path for
 * large arguments (it keeps a local array: a stack frame in a decode kernel).
 * a = n * pi/2 + y: pi/2 split into four 21-bit parts (n * part is exact for
 * |n| < 2^32) and a 53-bit tail, 2^-137 in all, so y is a's remainder to
 * about 1e-16 absolute; then sincospi(y / pi) (exact argument reduction) and
 * the quadrant n mod 4. Accurate to a few double ulps, like sincos. */
__device__ __forceinline__ void kn_sincos(double a, double *s, double *c) {
    const double n = rint(a * 0.63661977236758138); /* 2 / pi */
    double y = a - n * 0x1.921fbp+0;
    y = y - n * 0x1.5110bp-22;
    y = y - n * 0x1.18469p-44;
    y = y - n * 0x1.13198p-65;
    y = y - n * 0x1.45c06e0e68948p-86;
    double sy, cy;
    sincospi(y * 0.31830988618379067, &sy, &cy); /* 1 / pi */
    switch ((long long)n & 3) {
    case 0: *s = sy, *c = cy; break;
    case 1: *s = cy, *c = -sy; break;
    case 2: *s = -sy, *c = -cy; break;
    default: *s = -cy, *c = sy; break;
    }
}

/* dynamic shared memory: 2 * half floats (cos, sin) */
__global__ void __launch_bounds__(256) kn_rope_kernel(float *x, int32_t n_heads, int32_t head_dim, int32_t half,
                                                       const int32_t *__restrict__ pos,
                                                       const float *__restrict__ inv_freq, float mscale, int neox) {
    extern __shared__ float cs[];
    const int32_t t = (int32_t)blockIdx.x;
    const double p = (double)pos[t];
    for (int32_t i = threadIdx.x; i < half; i += blockDim.x) {
        double sd, cd;
        kn_sincos(p * (double)inv_freq[i], &sd, &cd);
        cs[i] = __fmul_rn((float)cd, mscale);
        cs[half + i] = __fmul_rn((float)sd, mscale);
    }
    __syncthreads();
    float *xt = x + (int64_t)t * n_heads * head_dim;
    for (int32_t k = threadIdx.x; k < n_heads * half; k += blockDim.x) {
        const int32_t h = k / half, i = k % half;
        float *xh = xt + (int64_t)h * head_dim;
        const int32_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        const float a = xh[ia], b = xh[ib], c = cs[i], s = cs[half + i];
        xh[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        xh[ib] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
}

}  // namespace

extern "C" int kn_rmsnorm(const float *x, const float *g, int32_t T, int32_t dim, float eps, float *out,
                          void *stream) {
    if (!x || !g || !out || T <= 0 || dim <= 0) return (int)cudaErrorInvalidValue;
    /* the kernel only reads x when ADD is false */
    kn_rmsnorm_kernel<false><<<T, KN_NORM_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
        const_cast<float *>(x), nullptr, g, dim, eps, out);
    return (int)cudaGetLastError();
}

extern "C" int kn_add_rmsnorm(float *x, const float *r, const float *g, int32_t T, int32_t dim, float eps,
                              float *out, void *stream) {
    if (!x || !g || !out || T <= 0 || dim <= 0 || (r && r == out)) return (int)cudaErrorInvalidValue;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (r) kn_rmsnorm_kernel<true><<<T, KN_NORM_THREADS, 0, s>>>(x, r, g, dim, eps, out);
    else kn_rmsnorm_kernel<false><<<T, KN_NORM_THREADS, 0, s>>>(x, nullptr, g, dim, eps, out);
    return (int)cudaGetLastError();
}

extern "C" int kn_rope(float *x, int32_t T, int32_t n_heads, int32_t head_dim, int32_t rot_dim, const int32_t *pos,
                       const float *inv_freq, float mscale, int neox, void *stream) {
    if (!x || !pos || !inv_freq || T <= 0 || n_heads <= 0 || head_dim <= 0 || rot_dim <= 0 || rot_dim % 2 ||
        rot_dim > head_dim || rot_dim > 8192)
        return (int)cudaErrorInvalidValue;
    const int32_t half = rot_dim / 2;
    kn_rope_kernel<<<T, 256, 2 * (size_t)half * sizeof(float), static_cast<cudaStream_t>(stream)>>>(
        x, n_heads, head_dim, half, pos, inv_freq, mscale, neox);
    return (int)cudaGetLastError();
}
