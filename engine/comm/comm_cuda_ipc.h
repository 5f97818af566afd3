/*
 * comm_cuda_ipc.h: the `cuda_ipc` communicator: collectives between rank
 * processes on one host over device buffers mapped with CUDA IPC
 * (GPU-NOTES.md sections 1, 3, 5; docs/engine.md "cuda_ipc").
 *
 * What it gives: the deterministic all-reduce of comm.h on the device
 * (every rank gets, for element i, ((x0[i] + x1[i]) + ...) + x_{N-1}[i] in
 * f32, rank order fixed, whatever the size, the algorithm or the timing: the
 * same bits as comm_shm's all-reduce of the same inputs), all-gather,
 * broadcast and barrier, all on the caller's stream, without a host round
 * trip per call, capturable in a CUDA graph. Up to COMM_CUDA_IPC_MAX_WORLD (8) ranks,
 * each a process; several ranks may share ONE GPU (that is how TP runs on a
 * one-GPU machine: IPC handles of the same device open fine in another
 * process; the kernels of different processes then time-share the GPU, so
 * latencies there say nothing about a multi-GPU machine), or each have its
 * own GPU with peer access (NVLink / PCIe P2P).
 *
 * Bootstrap (comm_cuda_ipc_create, collective over the host `comm`): each
 * rank allocates its region once (cudaMalloc of kn_ar_region_bytes: flags,
 * two stage halves, two result halves; kernels/kn_allreduce.h), zeroes it,
 * exports it (cudaIpcGetMemHandle) and all-gathers the handles, its device's
 * PCI bus id and its configuration through the host comm (shared memory);
 * then opens every peer's handle (cudaIpcOpenMemHandle; on another device
 * only after cudaDeviceCanAccessPeer says yes) and passes a host barrier, so
 * no flag is written into a region before its owner zeroed it. Every rank
 * must pass the same stage size and one-shot threshold (refused otherwise:
 * the algorithm choice must agree).
 *
 * Protocol: kernels/kn_allreduce.h (fixed grid, per-block generation counters
 * in device memory, flags written into the peers' regions, one-shot up to
 * oneshot_max_bytes of message, two-shot above; messages larger than the
 * stage are split into stage-size launches on the host).
 *
 * A dead or hung peer never hangs a rank:
 *  - device side: every wait in the kernel polls this rank's abort word
 *    (pinned host memory mapped into the device) and gives up after
 *    timeout_ms (%globaltimer), recording why;
 *  - host side: a watchdog thread per comm_cuda_ipc (every
 *    COMM_CUDA_IPC_WATCH_MS) sets the abort word as soon as the host group is
 *    aborted (rank 0's monitor aborts it when a worker process exits, any rank
 *    aborts it on an error: comm.h), and aborts the host group with the reason
 *    as soon as a kernel of this rank recorded a failure, so the peers' kernels
 *    stop too. Bound: the poll interval of the kernel (microseconds) plus the
 *    watchdog's (1 ms) plus the host group's abort propagation (< 1 s asserted
 *    in tests/comm, measured in ms);
 *  - comm_cuda_ipc_sync waits for a stream while reporting any of this, with
 *    the reason ("comm_cuda_ipc rank 1: all_reduce(28672 f32): aborted: rank 2
 *    (pid P) exited (signal 9)", "... timed out after 2000 ms waiting for rank
 *    2 (generation 17)").
 * After a failure the group is dead (flags are out of step): every later call
 * fails at once, and graph replays return at once on the device (the abort
 * word is sticky). A failed collective's output is undefined.
 *
 * Contract: every rank calls the same collectives in the same order with the
 * same sizes (a mismatch seen at the first barrier is reported as such, not
 * read); all calls of a group on ONE stream per rank (the double-buffering
 * argument needs launches ordered per rank); buffers are device pointers of
 * this rank's device; in and out may alias for the all-reduce.
 *
 * Threading: one thread per rank uses a comm_cuda_ipc; the watchdog is
 * internal; comm_cuda_ipc_abort from any thread.
 *
 * Built without CUDA, every function fails with "built without CUDA".
 */
#ifndef SPECD_COMM_COMM_CUDA_IPC_H
#define SPECD_COMM_COMM_CUDA_IPC_H

#include <stddef.h>
#include <stdint.h>

#include "engine/comm/comm.h"
#include "engine/util/err.h"

#define COMM_CUDA_IPC_WATCH_MS 1
#define COMM_CUDA_IPC_MAX_WORLD 8 /* = KN_AR_MAX_RANKS */

typedef struct comm_cuda_ipc comm_cuda_ipc;

typedef struct comm_cuda_ipc_config {
    int device;               /* this rank's CUDA device (ranks may share one) */
    size_t stage_bytes;       /* per stage half; larger messages are split. 0: 8 MiB. Rounded up to 256 B */
    int timeout_ms;           /* device-side limit of one wait. <= 0: 10000 */
    size_t oneshot_max_bytes; /* all-reduce one-shot up to this message size, two-shot above (same bits).
                                 0: auto, 1 MiB / world (each rank then reads <= 1 MiB); SIZE_MAX: always */
} comm_cuda_ipc_config;

/* Collective over boot (every rank of it, each with its own config's device). */
int comm_cuda_ipc_create(comm *boot, const comm_cuda_ipc_config *cfg, comm_cuda_ipc **out, specd_err *err);

/* out[i] = rank-order f32 sum of every rank's in[i]; n floats; in may equal out. */
int comm_cuda_ipc_all_reduce_sum_f32(comm_cuda_ipc *c, const float *in, float *out, size_t n, void *stream,
                                     specd_err *err);
/* out: [world * bytes]; rank r's in at r * bytes. */
int comm_cuda_ipc_all_gather(comm_cuda_ipc *c, const void *in, void *out, size_t bytes, void *stream,
                             specd_err *err);
/* out[0, bytes) = root's in (in ignored elsewhere; may equal out on the root). Every rank passes the same bytes. */
int comm_cuda_ipc_broadcast(comm_cuda_ipc *c, int root, const void *in, void *out, size_t bytes, void *stream,
                            specd_err *err);
int comm_cuda_ipc_barrier(comm_cuda_ipc *c, void *stream, specd_err *err);

/* Waits for `stream` (NULL: legacy default), returning -1 with the reason if
 * the group failed meanwhile (device timeout, mismatch, host group aborted),
 * or the stream failed. */
int comm_cuda_ipc_sync(comm_cuda_ipc *c, void *stream, specd_err *err);

/* 0 while healthy, else -1 with the reason (no waiting). */
int comm_cuda_ipc_poll(comm_cuda_ipc *c, specd_err *err);

/* Forces one algorithm from now on (this rank; call identically on every
 * rank): 0 auto, 1 one-shot, 2 two-shot. For tests and the benchmark. */
void comm_cuda_ipc_set_algo(comm_cuda_ipc *c, int algo);

/* Marks the group failed: this rank's kernels stop, the host group is
 * aborted with the reason (so the peers stop too). Any thread. */
void comm_cuda_ipc_abort(comm_cuda_ipc *c, const char *reason);

/* Stops the watchdog, closes the peers' handles, frees the region. Does not
 * synchronise with the peers (barrier first for a clean shutdown). NULL ok. */
void comm_cuda_ipc_destroy(comm_cuda_ipc *c);

#endif
