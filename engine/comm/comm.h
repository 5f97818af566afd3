/*
 * comm.h: the host communicator of a tensor-parallel group (DESIGN.md "The
 * backend and the model code", GPU-NOTES.md sections 1, 3, 5, 8).
 *
 * Ranks are processes. A `comm` is one rank's handle on a group of `world`
 * ranks on one host that share one memory segment (comm_shm.c). It carries:
 *  - the collectives the CPU backend needs (all-reduce sum in f32, all-gather,
 *    broadcast, barrier), on host memory;
 *  - the step channel: rank 0 posts each step's control message (an opaque
 *    byte blob: token ids, positions, block tables, sampling inputs) and the
 *    workers block until the next one arrives (comm_step_send / _recv);
 *  - abort: any rank (or rank 0's liveness monitor, engine/comm/ranks.h) marks
 *    the group failed with a reason; every pending and future call on every
 *    rank then returns -1 with that reason, promptly (sleepers are woken;
 *    the worst case is one sleep slice, COMM_SLEEP_SLICE_MS);
 *  - a per-call timeout: a peer that does not arrive within timeout_ms fails
 *    the call with "timed out ... waiting for rank R" and aborts the group
 *    (a collective that half happened cannot be resumed).
 * Device communicators (comm_nccl.h, comm_cuda_ipc.h) are bootstrapped through
 * a `comm` (the NCCL unique id travels by comm_broadcast; the CUDA IPC handles
 * by comm_all_gather) and propagate their failures through its abort.
 *
 * Determinism: comm_all_reduce_sum_f32 gives every rank, for element i, the
 * value ((x0[i] + x1[i]) + x2[i]) + ... + x_{N-1}[i] in f32, rank order fixed,
 * whatever n is, whichever rank arrives first and whichever algorithm (one-
 * shot or two-shot) runs. So a row's result never depends on the other rows
 * of the batch: batch invariance holds at TP > 1, and the result is bit-
 * reproducible run to run. (Built with -ffp-contract=off: no fused a*b+c.)
 *
 * Contract: every rank calls the same collectives in the same order with the
 * same sizes (and root). Each call checks that the ranks agree (op, size,
 * root) and fails naming the first rank that disagrees instead of corrupting
 * data. Sizes larger than the configured slot are split into slot-size
 * chunks internally; callers need not care.
 *
 * Threading: one thread per rank uses a `comm` at a time (calls are not
 * reentrant). comm_abort may be called from any thread, of any rank, at any
 * time, and is async-signal-unsafe only because of its reason formatting.
 *
 * Errors: -1 and a message naming this rank, the op and the reason, e.g.
 * "comm rank 1: all_reduce(115000 f32): aborted: rank 2 (pid 4711) exited
 * (signal 9)"; "comm rank 0: barrier: timed out after 300 ms waiting for
 * rank 3".
 */
#ifndef SPECD_COMM_COMM_H
#define SPECD_COMM_COMM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "engine/util/err.h"

#define COMM_MAX_WORLD 64
#define COMM_REASON_MAX 256
/* Longest a sleeping waiter goes without re-checking abort, deadline and
 * (workers) whether rank 0 still lives; aborts normally wake sleepers at once. */
#define COMM_SLEEP_SLICE_MS 20

typedef struct comm comm;

/* Start from comm_config_default() and change fields: a zeroed struct means
 * spin_us = 0 (never spin), not the automatic choice. */
typedef struct comm_config {
    size_t slot_bytes;        /* per-rank staging slot; larger calls are chunked. 0: 1 MiB */
    size_t step_max_bytes;    /* largest step control message. 0: 1 MiB */
    uint32_t step_depth;      /* step messages rank 0 may post ahead of the slowest worker. 0: 4 */
    int timeout_ms;           /* per-call timeout for collectives and step_send; <= 0: 60000 */
    int spin_us;              /* busy-wait before sleeping in a futex. < 0: auto (see comm_shm.c) */
    size_t oneshot_max_bytes; /* all-reduce: one-shot up to this message size, two-shot above (same bits
                                 either way). SIZE_MAX: always one-shot; 0: 128 KiB / world (comm_shm.c) */
} comm_config;

/* Fills the defaults in (any field left 0 gets its default). */
comm_config comm_config_default(void);

/* ---- group lifecycle (comm_shm.c) ---- */

/* Rank 0: creates the shared segment (an anonymous memfd, so nothing is left
 * in /dev/shm if a rank is SIGKILLed) sized for `world` ranks, and returns the
 * rank-0 handle plus the memfd the workers must inherit (*fd_out; close-on-exec
 * is NOT set on it; ranks.c passes it to the workers and closes it). world in
 * [1, COMM_MAX_WORLD]. */
int comm_shm_create(int world, const comm_config *cfg, int *fd_out, comm **out, specd_err *err);

/* Worker: maps the segment from the inherited memfd (closed on return, success
 * or not) as `rank` of `world`; parent_pid is rank 0's pid (workers check it is
 * still alive while they wait). Announces itself to rank 0. */
int comm_shm_attach(int fd, int rank, int world, pid_t parent_pid, comm **out, specd_err *err);

/* Rank 0: waits until every worker has attached (or the group is aborted, or
 * timeout_ms passes: the message names the first rank missing). */
int comm_wait_attached(comm *c, int timeout_ms, specd_err *err);

/* Unmaps; never blocks, never signals peers. NULL ok. */
void comm_destroy(comm *c);

int comm_rank(const comm *c);
int comm_world(const comm *c);
/* Per-call timeout from now on (this rank only). ms <= 0: wait forever. */
void comm_set_timeout_ms(comm *c, int ms);
/* The pid each rank recorded when it attached (0 if not yet attached). */
pid_t comm_rank_pid(const comm *c, int rank);

/* ---- collectives ---- */

/* buf: [n] f32 host memory, in place. Result identical on every rank (see the
 * determinism paragraph above). n == 0 is a no-op that still synchronises. */
int comm_all_reduce_sum_f32(comm *c, float *buf, size_t n, specd_err *err);

/* chunk: this rank's chunk_bytes; out: [world * chunk_bytes] bytes, rank r's
 * chunk at offset r * chunk_bytes (out may alias chunk's position in it). */
int comm_all_gather(comm *c, const void *chunk, size_t chunk_bytes, void *out, specd_err *err);

/* Variable-size broadcast of a byte blob from `root`. On root: buf holds
 * *nbytes bytes to send (cap ignored). Elsewhere: buf has room for cap bytes,
 * and *nbytes receives the size; a blob larger than cap fails on that rank and
 * aborts the group (a misconfigured buffer is not recoverable mid-protocol). */
int comm_broadcast(comm *c, int root, void *buf, size_t *nbytes, size_t cap, specd_err *err);

int comm_barrier(comm *c, specd_err *err);

/* Marks the group failed (first reason wins) and wakes every waiter of every
 * rank. Idempotent. reason: short text, e.g. "engine step failed: ...". */
void comm_abort(comm *c, const char *reason);
/* Same, attributed to `rank` (rank 0's monitor reports a dead worker). */
void comm_abort_as(comm *c, int rank, const char *reason);
/* 1 if aborted (reason copied into why, if not NULL, as "rank R: reason"). */
int comm_aborted(comm *c, char *why, size_t why_len);

/* ---- step channel (rank 0 -> all workers) ---- */

typedef enum { COMM_STEP_DATA = 0, COMM_STEP_SHUTDOWN = 1 } comm_step_kind;

/* Rank 0: posts one message of n <= step_max_bytes bytes to every worker.
 * Returns once it is in the ring (does not wait for the workers to read it),
 * waiting (per-call timeout) only if the slowest worker is step_depth behind. */
int comm_step_send(comm *c, comm_step_kind kind, const void *msg, size_t n, specd_err *err);

/* Worker: blocks until the next message (timeout_ms <= 0: forever, still
 * failing promptly on abort or if rank 0 dies), copies it into buf (cap bytes)
 * and sets *kind and *n. A message larger than cap fails (and aborts). */
int comm_step_recv(comm *c, void *buf, size_t cap, size_t *n, comm_step_kind *kind, int timeout_ms,
                   specd_err *err);

size_t comm_step_max_bytes(const comm *c);

#endif
