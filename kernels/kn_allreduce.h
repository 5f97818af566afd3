/*
 * kn_allreduce.h: the device side of the `cuda_ipc` communicator
 * (engine/comm/comm_cuda_ipc.h): all-reduce (sum, f32, fixed rank order),
 * all-gather, broadcast and barrier between up to KN_AR_MAX_RANKS processes
 * whose device buffers are mapped into each other through CUDA IPC (on one
 * GPU or on GPUs with peer access). vLLM's custom all-reduce idea (one-shot
 * for small messages, two-shot reduce-scatter + all-gather for large ones,
 * flags in peer memory), written for specd's determinism rule.
 *
 * Each rank owns one region (cudaMalloc, exported with cudaIpcGetMemHandle),
 * laid out as
 *   [KN_AR_SIG_BYTES]          signal area: flags[2][KN_AR_BLOCKS][KN_AR_MAX_RANKS]
 *                              u64 ("rank r reached barrier k of generation g
 *                              in block b", written by rank r INTO this rank's
 *                              region), gen[KN_AR_BLOCKS] u32 (this rank's
 *                              per-block generation counters)
 *   stage[2][stage_bytes]      inputs staged by this rank, by generation parity
 *   result[2][stage_bytes]     two-shot: this rank's reduced slices, by parity
 * so kn_ar_region_bytes(stage_bytes) = KN_AR_SIG_BYTES + 4 * stage_bytes.
 * The region must be zeroed (cudaMemset) and every rank must know that every
 * peer's is zeroed (a host barrier) before the first launch.
 *
 * One launch = one generation. Every launch runs the same fixed grid of
 * KN_AR_BLOCKS CTAs (blocks without data still take part in the barriers), so
 * block b's counter gen[b] is the same on every rank at every launch, and a
 * block never waits for anything but block b of its peers. A block reads
 * gen[b] + 1 = g at start and stores it back (graph-capturable: the
 * generation lives in device memory, not in a kernel argument; a replayed
 * graph advances it like a fresh launch). Parity p = g & 1 selects the stage
 * and result halves.
 *
 * Barrier k of generation g in block b: after __syncthreads, thread j < world
 * fences (system scope) and stores (g << 32 | desc) with st.release.sys into
 * rank j's flags[k][b][my rank]; __syncthreads; then thread j spins with
 * ld.acquire.sys on MY flags[k][b][j] until its generation reaches g;
 * __syncthreads. desc identifies the call (op, size, root): a peer at the
 * same generation with another desc is a collective mismatch, reported
 * instead of read.
 *
 * Why two halves suffice (same argument as comm_shm.c): rank r writes half p
 * in generation g + 2 only after passing generation g + 1's first barrier,
 * which every peer reaches only after its launch of generation g has
 * finished (launches are ordered on each rank's stream), i.e. after it read
 * half p. Hence: ONE STREAM per rank for every call on a group, and no
 * programmatic dependent launch across these kernels.
 *
 * Ops (per block b, on its range of the message: a multiple of 4 floats /
 * 16 bytes, the same on every rank):
 *   all-reduce one-shot: stage my range, barrier 0, out[i] = ((s_0[i] + s_1[i])
 *     + ...) + s_{N-1}[i] in f32 reading every rank's stage in rank order;
 *   all-reduce two-shot: stage, barrier 0, reduce my 1/N slice of the range
 *     (same per-element order) into my result half, barrier 1, copy every
 *     rank's slice out. Both give every element the same sequence of f32
 *     additions: the result bits do not depend on the algorithm, on n, on
 *     timing or on the rank, and equal comm_shm's all-reduce of the same inputs;
 *   all-gather: stage my bytes, barrier 0, out[j * out_stride + i] = stage_j[i];
 *   broadcast: the root stages, barrier 0, out[i] = stage_root[i];
 *   barrier: barrier 0 only.
 *
 * Failure: the waiting threads check, every KN_AR_POLL spins, the abort word
 * of this rank's kn_ar_ctrl (pinned host memory mapped into the device: the
 * host's watchdog sets it when the host group is aborted, e.g. a peer process
 * died) and %globaltimer against timeout_ns. On abort or timeout the block
 * records why in kn_ar_ctrl (err, err_peer, err_gen), sets the abort word
 * (so the other blocks and every later launch return at once, without
 * touching data) and returns; the output is then undefined and the group is
 * dead: the host reports the reason and aborts the host group so peers stop
 * too. A launch that finds the abort word set returns immediately.
 *
 * Launchers: device pointers, asynchronous on `stream`, no allocation, no
 * synchronisation, graph-capturable; return 0 or a cudaError_t value
 * (cudaErrorInvalidValue for refused arguments: a message over stage_bytes,
 * a world outside [1, KN_AR_MAX_RANKS], a root outside it).
 */
#ifndef SPECD_KERNELS_KN_ALLREDUCE_H
#define SPECD_KERNELS_KN_ALLREDUCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KN_AR_MAX_RANKS 8
#define KN_AR_BLOCKS 32   /* the fixed grid */
#define KN_AR_THREADS 512
#define KN_AR_SIG_BYTES 8192 /* 2 x 32 x 8 u64 flags (4 KiB) + 32 u32 counters, padded */
#define KN_AR_POLL 256       /* spins between two checks of the abort word and the clock */

enum { KN_AR_OK = 0, KN_AR_ERR_TIMEOUT = 1, KN_AR_ERR_ABORTED = 2, KN_AR_ERR_MISMATCH = 3 };
enum { KN_AR_OP_BARRIER = 1, KN_AR_OP_ONESHOT = 2, KN_AR_OP_TWOSHOT = 3, KN_AR_OP_GATHER = 4, KN_AR_OP_BCAST = 5 };

/* One per rank, in pinned host memory mapped into the device
 * (cudaHostAllocMapped): written by the device and read by the host while a
 * kernel runs, and the other way round. */
typedef struct kn_ar_ctrl {
    volatile uint32_t abort;    /* 1: every waiting block and every later launch returns at once (sticky) */
    volatile uint32_t err;      /* KN_AR_ERR_*: why a block gave up (the first writer wins, roughly) */
    volatile int32_t err_peer;  /* the rank it was waiting for */
    volatile uint32_t err_gen;  /* generation of the failed launch */
    volatile uint32_t err_op;   /* KN_AR_OP_* of the failed launch */
    volatile uint32_t err_desc; /* mismatch: the peer's call descriptor */
} kn_ar_ctrl;

/* What every launch needs (passed by value). */
typedef struct kn_ar_group {
    void *base[KN_AR_MAX_RANKS]; /* each rank's region as mapped in THIS process (own: the local pointer) */
    kn_ar_ctrl *ctrl;            /* this rank's ctrl, device view */
    int32_t rank, world;
    uint64_t stage_bytes;        /* bytes of each stage / result half (a multiple of 256) */
    uint64_t timeout_ns;         /* device-side wait limit per barrier */
} kn_ar_group;

size_t kn_ar_region_bytes(size_t stage_bytes);

/* out[i] = sum over ranks in rank order of in_r[i], f32, for n <= stage_bytes / 4
 * floats. two_shot selects the algorithm (same bits either way; every rank
 * must pass the same). in and out may alias. */
int kn_allreduce_sum_f32(const kn_ar_group *g, const float *in, float *out, size_t n, int two_shot, void *stream);

/* Rank r's `in` (bytes <= stage_bytes) lands at out + r * out_stride (out_stride >= bytes). */
int kn_allgather(const kn_ar_group *g, const void *in, void *out, size_t bytes, size_t out_stride, void *stream);

/* out[0, bytes) = root's in. On the root, in may equal out. bytes <= stage_bytes. */
int kn_broadcast(const kn_ar_group *g, int root, const void *in, void *out, size_t bytes, void *stream);

int kn_ar_barrier(const kn_ar_group *g, void *stream);

#ifdef __cplusplus
}
#endif

#endif
