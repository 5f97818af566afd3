/*
 * kn_emu_device.hpp: the CUDA device model of kn_emu for C++ translation
 * units made from the kernels (.cu) by kn_emu.py. Every CUDA thread of a block is
 * a fiber on ONE OS thread; blocks run one after another. __syncthreads waits
 * for every live thread of the block, __shfl_xor_sync for every live lane of
 * the warp (a thread at the other kind of barrier is reported as divergence
 * and aborts). __shared__ variables are function statics (one block at a
 * time). Atomics are plain read-modify-writes (nothing preempts a fiber).
 */
#ifndef KN_EMU_DEVICE_HPP
#define KN_EMU_DEVICE_HPP

#include <cmath>
#include <cstdint>
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

struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };

void kn_emu_syncthreads();
void kn_emu_syncwarp();
void kn_emu_run(dim3 grid, dim3 block, const std::function<void()> &body);
extern float kn_emu_shfl_f[1024];
extern int kn_emu_sync_or;
uint64_t kn_emu_globaltimer();  /* CLOCK_MONOTONIC ns */
void kn_emu_spin_pause();       /* sched_yield: a spinning fiber lets the peer processes run */

inline void __syncthreads() { kn_emu_syncthreads(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    const unsigned t = threadIdx.x;
    kn_emu_shfl_f[t] = v;
    kn_emu_syncwarp();
    const float r = kn_emu_shfl_f[t ^ (unsigned)lane_mask];
    kn_emu_syncwarp();
    return r;
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
template <typename T> inline T __ldcg(const T *p) { return *(const volatile T *)p; }
inline float4 __ldcg(const float4 *p) { const volatile float *q = (const volatile float *)p; return float4{q[0], q[1], q[2], q[3]}; }
inline uint4 __ldcg(const uint4 *p) { const volatile unsigned *q = (const volatile unsigned *)p; return uint4{q[0], q[1], q[2], q[3]}; }
inline int atomicAdd(int *a, int v) { int o = *a; *a = o + v; return o; }
inline unsigned atomicAdd(unsigned *a, unsigned v) { unsigned o = *a; *a = o + v; return o; }
inline unsigned atomicOr(unsigned *a, unsigned v) { unsigned o = *a; *a = o | v; return o; }
inline int atomicMin(int *a, int v) { int o = *a; if (v < o) *a = v; return o; }
inline unsigned atomicMin(unsigned *a, unsigned v) { unsigned o = *a; if (v < o) *a = v; return o; }
inline int atomicMax(int *a, int v) { int o = *a; if (v > o) *a = v; return o; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }

template <typename K, typename... A>
void kn_emu_launch(K kernel, dim3 grid, dim3 block, A... args) {
    kn_emu_run(grid, block, [=]() { kernel(args...); });
}

#endif
