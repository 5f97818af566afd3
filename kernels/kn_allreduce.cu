/*
 * kn_allreduce.cu: the cuda_ipc collectives (protocol, layout and failure
 * rules: kn_allreduce.h). No state outside the regions and the ctrl words.
 *
 * Memory model notes:
 *  - staged data -> flag: every thread stores its part of the stage, then
 *    __syncthreads (CTA-scope ordering), then each signalling thread issues
 *    fence.sc.sys and st.release.sys of the flag: cumulative, so a peer whose
 *    ld.acquire.sys sees the flag sees the whole block's stores;
 *  - flag -> data: the waiting thread's ld.acquire.sys, then __syncthreads,
 *    then every thread reads peers' stages with ld.global.cg (L2, never a
 *    possibly stale L1 line from an earlier generation);
 *  - scope .sys: valid between processes on one GPU and between GPUs over
 *    NVLink / PCIe peer access alike.
 * Element arithmetic: plain f32 adds in rank order (no FMA can form from
 * adds), the same in the one-shot and the two-shot path.
 */
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/kn_allreduce.h"

namespace {

struct ar_sig {
    uint64_t flags[2][KN_AR_BLOCKS][KN_AR_MAX_RANKS]; /* [barrier][block][source rank] */
    uint32_t gen[KN_AR_BLOCKS];
};
static_assert(sizeof(ar_sig) <= KN_AR_SIG_BYTES, "signal area");

__device__ __forceinline__ ar_sig *sig_of(const kn_ar_group &g, int r) { return (ar_sig *)g.base[r]; }
__device__ __forceinline__ uint8_t *stage_of(const kn_ar_group &g, int r, uint32_t par) {
    return (uint8_t *)g.base[r] + KN_AR_SIG_BYTES + (size_t)par * g.stage_bytes;
}
__device__ __forceinline__ uint8_t *result_of(const kn_ar_group &g, int r, uint32_t par) {
    return (uint8_t *)g.base[r] + KN_AR_SIG_BYTES + (size_t)(2 + par) * g.stage_bytes;
}

#ifndef KN_EMU_CUDA_RUNTIME_H
__device__ __forceinline__ void st_release_sys(uint64_t *p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void spin_pause() {}
#else
/* tools/kn_emu (ranks = processes on the CPU, regions in shared memory): the same orderings with host atomics */
__device__ __forceinline__ void st_release_sys(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
__device__ __forceinline__ uint64_t globaltimer() { return kn_emu_globaltimer(); }
__device__ __forceinline__ void spin_pause() { kn_emu_spin_pause(); }
#endif

/* Records why this block gives up (host-mapped words, system scope) and stops every block. */
__device__ void ar_fail(const kn_ar_group &g, uint32_t why, int peer, uint32_t gen, uint32_t op, uint32_t desc) {
    kn_ar_ctrl *c = g.ctrl;
    if (c->err == KN_AR_OK) {
        c->err_peer = peer;
        c->err_gen = gen;
        c->err_op = op;
        c->err_desc = desc;
        __threadfence_system();
        c->err = why;
    }
    __threadfence_system();
    c->abort = 1;
}

/* Barrier k of generation gen in this block; returns true if the block must give up. Thread j < world
 * signals rank j, then (after __syncthreads: every signal of the block is out before any wait, which
 * also lets tools/kn_emu run a block's threads one after another) waits for rank j's signal. */
__device__ bool ar_barrier(const kn_ar_group &g, int k, uint32_t gen, uint32_t op, uint32_t desc) {
    __syncthreads();
    int fail = 0;
    const int j = (int)threadIdx.x;
    if (j < g.world) {
        __threadfence_system();
        st_release_sys(&sig_of(g, j)->flags[k][blockIdx.x][g.rank], ((uint64_t)gen << 32) | desc);
    }
    __syncthreads();
    if (j < g.world) {
        const uint64_t *mine = &sig_of(g, g.rank)->flags[k][blockIdx.x][j];
        uint64_t t0 = 0;
        for (uint32_t spin = 0;; spin++) {
            uint64_t v = ld_acquire_sys(mine);
            int32_t ahead = (int32_t)((uint32_t)(v >> 32) - gen);
            if (ahead >= 0) {
                if (ahead == 0 && k == 0 && (uint32_t)v != desc) {
                    ar_fail(g, KN_AR_ERR_MISMATCH, j, gen, op, (uint32_t)v);
                    fail = 1;
                }
                break;
            }
            spin_pause();
            if (spin % KN_AR_POLL == 0) {
                if (g.ctrl->abort) {
                    ar_fail(g, KN_AR_ERR_ABORTED, j, gen, op, 0);
                    fail = 1;
                    break;
                }
                uint64_t now = globaltimer();
                if (t0 == 0) t0 = now;
                else if (now - t0 > g.timeout_ns) {
                    ar_fail(g, KN_AR_ERR_TIMEOUT, j, gen, op, 0);
                    fail = 1;
                    break;
                }
            }
        }
    }
    return __syncthreads_or(fail) != 0;
}

/* [lo, hi) of a length-n message for this block: 32 equal pieces, multiples of `quant`. */
__device__ __forceinline__ void block_range(size_t n, size_t quant, size_t *lo, size_t *hi) {
    size_t per = (n + KN_AR_BLOCKS - 1) / KN_AR_BLOCKS;
    per = (per + quant - 1) / quant * quant;
    size_t a = (size_t)blockIdx.x * per;
    *lo = a < n ? a : n;
    *hi = a + per < n ? a + per : n;
}

/* dst[lo, hi) = src[lo, hi) bytes; 16-byte vectors where both sides allow (lo is a multiple of 16). */
__device__ void copy_bytes(uint8_t *dst, const uint8_t *src, size_t lo, size_t hi, bool vec) {
    for (size_t i = lo + 16 * (size_t)threadIdx.x; i < hi; i += 16 * (size_t)blockDim.x) {
        if (vec && i + 16 <= hi) {
            *(uint4 *)(dst + i) = __ldcg((const uint4 *)(src + i));
        } else {
            size_t e = i + 16 < hi ? i + 16 : hi;
            for (size_t q = i; q < e; q++) dst[q] = __ldcg(src + q);
        }
    }
}

/* out[i] = ((s_0[i] + s_1[i]) + ...) over the world's stages, i in [lo, hi) (lo a multiple of 4). */
__device__ void reduce_range(const kn_ar_group &g, uint32_t par, float *out, size_t lo, size_t hi, bool out_vec) {
    for (size_t i = lo + 4 * (size_t)threadIdx.x; i < hi; i += 4 * (size_t)blockDim.x) {
        if (i + 4 <= hi) {
            float4 a = __ldcg((const float4 *)stage_of(g, 0, par) + i / 4);
            for (int r = 1; r < g.world; r++) {
                float4 b = __ldcg((const float4 *)stage_of(g, r, par) + i / 4);
                a.x += b.x;
                a.y += b.y;
                a.z += b.z;
                a.w += b.w;
            }
            if (out_vec) {
                *(float4 *)(out + i) = a;
            } else {
                out[i] = a.x;
                out[i + 1] = a.y;
                out[i + 2] = a.z;
                out[i + 3] = a.w;
            }
        } else {
            for (size_t q = i; q < hi; q++) {
                float a = __ldcg((const float *)stage_of(g, 0, par) + q);
                for (int r = 1; r < g.world; r++) a += __ldcg((const float *)stage_of(g, r, par) + q);
                out[q] = a;
            }
        }
    }
}

__device__ __forceinline__ bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/*
 * One kernel for every op (grid KN_AR_BLOCKS x KN_AR_THREADS). n: floats for
 * the all-reduces, bytes otherwise. stride: all-gather's output stride in
 * bytes. root: broadcast root.
 */
__global__ void __launch_bounds__(KN_AR_THREADS)
    kn_ar_kernel(const __grid_constant__ kn_ar_group g, uint32_t op, const void *in, void *out, size_t n, size_t stride,
                 int root, uint32_t desc) {
    __shared__ uint32_t s_gen;
    __shared__ int s_dead;
    ar_sig *me = sig_of(g, g.rank);
    if (threadIdx.x == 0) {
        uint32_t gen = me->gen[blockIdx.x] + 1;
        me->gen[blockIdx.x] = gen;
        s_gen = gen;
        s_dead = g.ctrl->abort != 0;
    }
    __syncthreads();
    if (s_dead) return;
    const uint32_t gen = s_gen, par = gen & 1u;
    size_t lo, hi;

    if (op == KN_AR_OP_BARRIER) {
        ar_barrier(g, 0, gen, op, desc);
        return;
    }
    if (op == KN_AR_OP_ONESHOT || op == KN_AR_OP_TWOSHOT) {
        block_range(n, 4, &lo, &hi);
        const float *x = (const float *)in;
        float *y = (float *)out;
        copy_bytes(stage_of(g, g.rank, par), (const uint8_t *)x, lo * 4, hi * 4, aligned16(x));
        if (ar_barrier(g, 0, gen, op, desc)) return;
        if (op == KN_AR_OP_ONESHOT) {
            reduce_range(g, par, y, lo, hi, aligned16(y));
            return;
        }
        /* two-shot: rank j owns slice j of the block's range */
        size_t per = ((hi - lo) + (size_t)g.world - 1) / (size_t)g.world;
        per = (per + 3) / 4 * 4;
        size_t slo = lo + per * (size_t)g.rank < hi ? lo + per * (size_t)g.rank : hi;
        size_t shi = slo + per < hi ? slo + per : hi;
        reduce_range(g, par, (float *)result_of(g, g.rank, par), slo, shi, true);
        if (ar_barrier(g, 1, gen, op, desc)) return;
        for (int j = 0; j < g.world; j++) {
            size_t a = lo + per * (size_t)j < hi ? lo + per * (size_t)j : hi;
            size_t b = a + per < hi ? a + per : hi;
            copy_bytes((uint8_t *)y, result_of(g, j, par), a * 4, b * 4, aligned16(y));
        }
        return;
    }
    block_range(n, 16, &lo, &hi);
    if (op == KN_AR_OP_GATHER) {
        copy_bytes(stage_of(g, g.rank, par), (const uint8_t *)in, lo, hi, aligned16(in));
        if (ar_barrier(g, 0, gen, op, desc)) return;
        for (int j = 0; j < g.world; j++) {
            uint8_t *dst = (uint8_t *)out + (size_t)j * stride;
            copy_bytes(dst, stage_of(g, j, par), lo, hi, aligned16(dst));
        }
        return;
    }
    /* broadcast */
    if (g.rank == root) copy_bytes(stage_of(g, g.rank, par), (const uint8_t *)in, lo, hi, aligned16(in));
    if (ar_barrier(g, 0, gen, op, desc)) return;
    if (g.rank != root || in != out) copy_bytes((uint8_t *)out, stage_of(g, root, par), lo, hi, aligned16(out));
}

/* The call descriptor every rank must agree on: op, size, root. */
uint32_t ar_desc(uint32_t op, size_t n, int root) {
    uint64_t h = ((uint64_t)op << 56) ^ ((uint64_t)(uint32_t)root << 48) ^ (uint64_t)n;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return (uint32_t)h;
}

int ar_launch(const kn_ar_group *g, uint32_t op, const void *in, void *out, size_t n, size_t stride, int root,
              void *stream) {
    if (!g || g->world < 1 || g->world > KN_AR_MAX_RANKS || g->rank < 0 || g->rank >= g->world || !g->ctrl)
        return (int)cudaErrorInvalidValue;
    kn_ar_kernel<<<KN_AR_BLOCKS, KN_AR_THREADS, 0, (cudaStream_t)stream>>>(*g, op, in, out, n, stride, root,
                                                                           ar_desc(op, n, root));
    return (int)cudaGetLastError();
}

}  // namespace

extern "C" size_t kn_ar_region_bytes(size_t stage_bytes) { return KN_AR_SIG_BYTES + 4 * stage_bytes; }

extern "C" int kn_allreduce_sum_f32(const kn_ar_group *g, const float *in, float *out, size_t n, int two_shot,
                                    void *stream) {
    if (!g || n > g->stage_bytes / sizeof(float) || (n && (!in || !out))) return (int)cudaErrorInvalidValue;
    return ar_launch(g, two_shot ? KN_AR_OP_TWOSHOT : KN_AR_OP_ONESHOT, in, out, n, 0, 0, stream);
}

extern "C" int kn_allgather(const kn_ar_group *g, const void *in, void *out, size_t bytes, size_t out_stride,
                            void *stream) {
    if (!g || bytes > g->stage_bytes || out_stride < bytes || (bytes && (!in || !out))) return (int)cudaErrorInvalidValue;
    return ar_launch(g, KN_AR_OP_GATHER, in, out, bytes, out_stride, 0, stream);
}

extern "C" int kn_broadcast(const kn_ar_group *g, int root, const void *in, void *out, size_t bytes, void *stream) {
    if (!g || bytes > g->stage_bytes || root < 0 || root >= g->world || (bytes && !out) ||
        (bytes && g->rank == root && !in))
        return (int)cudaErrorInvalidValue;
    return ar_launch(g, KN_AR_OP_BCAST, in, out, bytes, 0, root, stream);
}

extern "C" int kn_ar_barrier(const kn_ar_group *g, void *stream) {
    return ar_launch(g, KN_AR_OP_BARRIER, nullptr, nullptr, 0, 0, 0, stream);
}
