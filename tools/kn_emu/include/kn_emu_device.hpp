/*
 * kn_emu_device.hpp: the CUDA device model of kn_emu for C++ translation
 * units made from the kernels (.cu) by kn_emu.py (tools/kn_emu/README.md).
 *
 * Threads: every CUDA thread of a block is a fiber on ONE OS thread; blocks
 * run one after another. __syncthreads waits for every live (not exited)
 * thread of the block; the warp operations (__syncwarp, the shuffles, the
 * mma of kn_mla.cu) for every live lane of the warp. Each warp barrier
 * carries a kind and a per-lane count of warp operations, so lanes meeting
 * at different operations, or a shuffle reading a lane that exited or did
 * not take part, are reported and abort (on a GPU: undefined values).
 * __shared__ variables are function statics (one block at a time); dynamic
 * shared memory (`extern __shared__`, rewritten by kn_emu.py) is one buffer
 * of the launch's size, filled with 0xA5 before each block. Atomics are
 * plain read-modify-writes (nothing preempts a fiber).
 *
 * Arithmetic: the _rn intrinsics are the host's IEEE operations in the same
 * precision (volatile, so nothing is contracted or kept wider); __fmaf_rn is
 * fmaf (one rounding). Plain C++ expressions in a kernel are NOT contracted
 * here (no -mfma), where nvcc may fuse a * b + c: the kernels use explicit
 * intrinsics wherever the bits matter. Transcendentals are the host libm's
 * (glibc expf / exp / sqrt; sincospi below), not CUDA's.
 *
 * Memory: device pointers are host pointers; 16-byte vector loads (__ldg,
 * __ldcg of float4 / uint4, the streaming loads of kn_gemv / kn_moe) check
 * their alignment and abort on a misaligned address as the GPU faults.
 */
#ifndef KN_EMU_DEVICE_HPP
#define KN_EMU_DEVICE_HPP

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

using std::isnan;

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
extern dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))

/* CUDA's vector types: 16-byte aligned like the toolkit's */
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(8) uint2 { unsigned x, y; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }

/* Warp barrier kinds (a lane at one kind while another waits at a different one is a divergence). */
enum { KN_EMU_WARP_SYNC = 1, KN_EMU_WARP_SHFL = 2, KN_EMU_WARP_MMA = 3 };
void kn_emu_syncthreads();
void kn_emu_syncwarp(int kind = KN_EMU_WARP_SYNC);
void kn_emu_run(dim3 grid, dim3 block, size_t dyn_smem, const std::function<void()> &body);
void *kn_emu_dyn_smem();         /* the launch's dynamic shared memory (16-byte aligned) */
[[noreturn]] void kn_emu_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
extern unsigned char kn_emu_shfl_buf[2][1024][16]; /* a slot per thread of the block, two buffers */
extern uint64_t kn_emu_shfl_seq[1024];             /* shuffles each thread has done in this block */
extern int kn_emu_sync_or;
uint64_t kn_emu_globaltimer();  /* CLOCK_MONOTONIC ns */
void kn_emu_spin_pause();       /* sched_yield: a spinning fiber lets the peer processes run */

inline void __syncthreads() { kn_emu_syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) kn_emu_fail("__syncwarp(0x%08x): only the full mask is emulated", mask);
    kn_emu_syncwarp(KN_EMU_WARP_SYNC);
}

/* Shuffles: every live lane of the warp writes its value, meets the others at one warp barrier and reads
 * the source lane's. The slots alternate between two buffers by the lanes' shuffle count, so one barrier
 * is enough: a lane cannot write the same buffer again before every lane has passed the next warp barrier,
 * i.e. has read. src < 0: the caller's own value (CUDA's rule for a source outside the lane's width
 * segment). Reading a lane that did not take part in this same shuffle (exited, or at fewer shuffles)
 * aborts; the source may already have written its next one (count + 1). */
template <typename T> inline T kn_emu_shfl(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 16, "kn_emu: shuffle of a type wider than 16 bytes");
    if (mask != 0xffffffffu) kn_emu_fail("shuffle with mask 0x%08x: only the full mask is emulated", mask);
    const unsigned t = threadIdx.x, base = t & ~31u;
    const uint64_t my = ++kn_emu_shfl_seq[t];
    memcpy(kn_emu_shfl_buf[my & 1][t], &v, sizeof(T));
    kn_emu_syncwarp(KN_EMU_WARP_SHFL);
    T r = v;
    if (src >= 0) {
        const unsigned s = base + (unsigned)src;
        const uint64_t ss = s < blockDim.x ? kn_emu_shfl_seq[s] : 0;
        if (ss != my && ss != my + 1)
            kn_emu_fail("thread %u (block %u,%u,%u) shuffles from lane %d, which did not take part (exited or "
                        "elsewhere)", t, blockIdx.x, blockIdx.y, blockIdx.z, src);
        memcpy(&r, kn_emu_shfl_buf[my & 1][s], sizeof(T));
    }
    return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    const int lane = (int)(threadIdx.x & 31u), src = lane ^ lane_mask;
    /* a source in a later width segment gives the caller's own value */
    return kn_emu_shfl(mask, v, src >= (lane / width + 1) * width ? -1 : src);
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = (int)(threadIdx.x & 31u);
    return kn_emu_shfl(mask, v, (lane % width) < (int)delta ? -1 : lane - (int)delta);
}
template <typename T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = (int)(threadIdx.x & 31u);
    return kn_emu_shfl(mask, v, (lane % width) + (int)delta >= width ? -1 : lane + (int)delta);
}
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    const int lane = (int)(threadIdx.x & 31u);
    return kn_emu_shfl(mask, v, (lane / width) * width + (src_lane % width));
}

inline int __syncthreads_or(int p) {
    if (p) kn_emu_sync_or = 1;
    kn_emu_syncthreads();
    const int r = kn_emu_sync_or;
    kn_emu_syncthreads();
    if (threadIdx.x == 0) kn_emu_sync_or = 0;
    kn_emu_syncthreads();
    return r;
}
/* Memory shared with other processes: every access is a real load / store, fences are full fences. */
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

/* Loads. A 16-byte vector load of a misaligned address faults on the GPU ("misaligned address"). */
inline void kn_emu_check_align(const void *p, size_t a, const char *what) {
    if ((uintptr_t)p % a)
        kn_emu_fail("%s of a misaligned address %p (needs %zu bytes) in thread %u of block (%u,%u,%u)", what, p, a,
                    threadIdx.x, blockIdx.x, blockIdx.y, blockIdx.z);
}
template <typename T> inline T __ldcg(const T *p) { return *(const volatile T *)p; }
inline float4 __ldcg(const float4 *p) {
    kn_emu_check_align(p, 16, "__ldcg(float4)");
    const volatile float *q = (const volatile float *)p;
    return float4{q[0], q[1], q[2], q[3]};
}
inline uint4 __ldcg(const uint4 *p) {
    kn_emu_check_align(p, 16, "__ldcg(uint4)");
    const volatile unsigned *q = (const volatile unsigned *)p;
    return uint4{q[0], q[1], q[2], q[3]};
}
template <typename T> inline T __ldg(const T *p) {
    kn_emu_check_align(p, alignof(T), "__ldg");
    return *p;
}
/* ld.global.nc.L1::no_allocate.v4.u32 (kn_gemv.cu, kn_moe.cu): a plain 16-byte load here */
inline uint4 kn_emu_ld_stream16(const void *p) {
    kn_emu_check_align(p, 16, "ld.global.nc.v4.u32");
    return *static_cast<const uint4 *>(p);
}

inline int atomicAdd(int *a, int v) { int o = *a; *a = o + v; return o; }
inline unsigned atomicAdd(unsigned *a, unsigned v) { unsigned o = *a; *a = o + v; return o; }
inline float atomicAdd(float *a, float v) { float o = *a; *a = o + v; return o; }
inline unsigned atomicOr(unsigned *a, unsigned v) { unsigned o = *a; *a = o | v; return o; }
inline int atomicOr(int *a, int v) { int o = *a; *a = o | v; return o; }
inline int atomicMin(int *a, int v) { int o = *a; if (v < o) *a = v; return o; }
inline unsigned atomicMin(unsigned *a, unsigned v) { unsigned o = *a; if (v < o) *a = v; return o; }
inline int atomicMax(int *a, int v) { int o = *a; if (v > o) *a = v; return o; }
inline unsigned atomicMax(unsigned *a, unsigned v) { unsigned o = *a; if (v > o) *a = v; return o; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

/* Bit casts and correctly rounded single / double operations (the host's SSE arithmetic is IEEE RNE;
 * volatile keeps the compiler from fusing or widening). */
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline long long __double_as_longlong(double d) { long long i; memcpy(&i, &d, 8); return i; }
inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); } /* one rounding (libm fmaf) */
inline double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
inline double __dsub_rn(double a, double b) { volatile double r = a - b; return r; }
inline double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
inline double __ddiv_rn(double a, double b) { volatile double r = a / b; return r; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }

/* sin(pi x), cos(pi x) (CUDA's sincospi; glibc has none): exact reduction x = n / 2 + f, |f| <= 1/4,
 * then the host's sin / cos of pi f (a double ulp or two, like CUDA's), and the quadrant n mod 4. */
inline void sincospi(double x, double *s, double *c) {
    if (!std::isfinite(x)) {
        *s = *c = NAN;
        return;
    }
    const double n = std::rint(2.0 * x);      /* |x| < 2^52 here: x - n / 2 is exact */
    const double f = x - 0.5 * n;
    const double a = 3.141592653589793 * f;
    const double sf = f == 0 ? f : std::sin(a), cf = std::cos(a);
    switch ((long long)std::fmod(n, 4.0) & 3) {
    case 0: *s = sf, *c = cf; break;
    case 1: *s = cf, *c = -sf; break;
    case 2: *s = -sf, *c = -cf; break;
    default: *s = -cf, *c = sf; break;
    }
    if (*c == 0) *c = 0.0; /* cospi(n + 1/2) = +0 */
}

/* bf16 (the top half of an f32). f32 -> bf16 round to nearest even; a NaN becomes the canonical 0x7fff
 * (cuda_bf16.hpp's __float2bfloat16_rn). */
inline uint16_t kn_emu_f32_to_bf16_rn(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
/* double -> f32 rounded to odd (the truncation, with the last bit set when anything was cut): rounding
 * that to bf16 (8 bits <= 24 - 2) gives the correctly rounded bf16 of the double, no double rounding. */
inline float kn_emu_f64_to_f32_odd(double x) {
    float f = (float)x;
    if (std::isnan(x) || (double)f == x) return f;
    if (std::isinf(f)) f = std::copysign(3.40282347e38f, f); /* past FLT_MAX: FLT_MAX (odd), then bf16 inf */
    if ((double)f != x && !(__float_as_uint(f) & 1u)) f = std::nextafter(f, (double)f < x ? INFINITY : -INFINITY);
    return f;
}
/* fma.rn.bf16x2 d, a, b, c (PTX ISA): per half, bf16(a * b + c) with one rounding (RNE), subnormals kept,
 * a NaN result canonical (0x7fff). a * b is exact in double (8 x 8 bits); p + c = s + e exactly (TwoSum);
 * s rounded to odd in double when e != 0, then to f32 (odd), then to bf16: one correct rounding. */
inline uint16_t kn_emu_bf16_fma_rn(uint16_t a, uint16_t b, uint16_t c) {
    const double p = (double)__uint_as_float((uint32_t)a << 16) * (double)__uint_as_float((uint32_t)b << 16);
    const double cc = (double)__uint_as_float((uint32_t)c << 16);
    double s = p + cc;
    if (std::isnan(s)) return 0x7fffu;
    if (std::isfinite(s)) {
        const double bb = s - p, e = (p - (s - bb)) + (cc - bb); /* TwoSum: p + cc == s + e exactly */
        if (e != 0 && !(__double_as_longlong(s) & 1)) s = std::nextafter(s, e > 0 ? INFINITY : -INFINITY);
    }
    return kn_emu_f32_to_bf16_rn(kn_emu_f64_to_f32_odd(s));
}
inline uint32_t kn_emu_bf16x2_fma_rn(uint32_t a, uint32_t b, uint32_t c) {
    const uint32_t lo = kn_emu_bf16_fma_rn((uint16_t)a, (uint16_t)b, (uint16_t)c);
    const uint32_t hi = kn_emu_bf16_fma_rn((uint16_t)(a >> 16), (uint16_t)(b >> 16), (uint16_t)(c >> 16));
    return lo | hi << 16;
}

template <typename K, typename... A>
void kn_emu_launch(K kernel, dim3 grid, dim3 block, size_t dyn_smem, A... args) {
    kn_emu_run(grid, block, dyn_smem, [=]() { kernel(args...); });
}

#endif
