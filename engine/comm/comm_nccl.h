/*
 * comm_nccl.h: the NCCL adapter (GPU-NOTES.md sections 1, 5, 8).
 *
 * libnccl.so.2 is loaded at run time with dlopen, never linked, so one binary
 * starts on machines without NCCL or without a GPU. The library searched is
 * $SPECD_NCCL_LIBRARY if set, else "libnccl.so.2" (the loader path), else the
 * CUDA toolkit's lib directories.
 *
 * Bootstrap: rank 0 creates the 128-byte unique id (ncclGetUniqueId, which
 * needs no GPU: it only opens a bootstrap socket) and the others receive it.
 * comm_nccl_id_share does that through a host `comm` (shared memory, one
 * host); multi-node will get it over the TCP control socket instead and call
 * comm_nccl_init with it: comm_nccl_init knows nothing of how the id came.
 *
 * Init is non-blocking (ncclCommInitRankConfig with blocking = 0) and polled
 * with ncclCommGetAsyncError against a timeout; on timeout or error the
 * communicator is aborted (ncclCommAbort), so a rank that never shows up
 * fails start-up instead of hanging it. Collectives on a non-blocking
 * communicator may return ncclInProgress: the adapter then polls until the
 * op is enqueued (or the timeout aborts the communicator). Completion on the
 * GPU is the caller's stream's business; during a long wait the caller polls
 * comm_nccl_poll (asynchronous errors: a peer died, a network failure) and
 * calls comm_nccl_abort on its own timeout: that is the watchdog.
 *
 * Determinism: NCCL's all-reduce order depends on the algorithm/protocol it
 * picks per message size, so results can change with the batch size
 * (GPU-NOTES section 3). specd's deterministic mode therefore never uses it
 * for the tensor-parallel all-reduce; it is for multi-node and for the bf16
 * all-reduce at large batch when fixed order is not required.
 *
 * Devices: NCCL uses the calling thread's current CUDA device: cudaSetDevice
 * before comm_nccl_init. Buffers are device pointers; stream is a
 * cudaStream_t passed as void * (NULL = legacy default stream).
 *
 * Threading: one thread per comm_nccl. Every NCCL call is checked and its
 * failure reported with file:line, NCCL's error string and ncclGetLastError.
 */
#ifndef SPECD_COMM_COMM_NCCL_H
#define SPECD_COMM_COMM_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "engine/comm/comm.h"
#include "engine/util/err.h"

#define COMM_NCCL_ID_BYTES 128

typedef struct comm_nccl comm_nccl;

typedef enum { COMM_NCCL_F32 = 0, COMM_NCCL_BF16 = 1 } comm_nccl_dtype;

/* Loads libnccl (once per process; a failure is not cached). Sets *version to
 * NCCL's version code (e.g. 22809) if version is not NULL. */
int comm_nccl_load(int *version, specd_err *err);

/* Rank 0 only: a fresh unique id. Needs no GPU. */
int comm_nccl_id_new(uint8_t id[COMM_NCCL_ID_BYTES], specd_err *err);

/* Collective over the host comm: rank 0 creates the id and broadcasts it; on
 * return every rank holds the same id. If rank 0 cannot create one, every rank
 * fails with rank 0's reason (no rank is left waiting). */
int comm_nccl_id_share(comm *boot, uint8_t id[COMM_NCCL_ID_BYTES], specd_err *err);

/* Non-blocking init of rank `rank` of `world` on the current CUDA device,
 * polled up to timeout_ms (<= 0: 120000). */
int comm_nccl_init(const uint8_t id[COMM_NCCL_ID_BYTES], int rank, int world, int timeout_ms, comm_nccl **out,
                   specd_err *err);

/* id_share over boot then init with boot's rank and world. */
int comm_nccl_create(comm *boot, int timeout_ms, comm_nccl **out, specd_err *err);

/* recv[i] = sum over ranks of send[i], count elements (NCCL's order). */
int comm_nccl_all_reduce_sum(comm_nccl *c, const void *send, void *recv, size_t count, comm_nccl_dtype dt,
                             void *stream, specd_err *err);
/* recv: [world * send_count], rank r's send at r * send_count. */
int comm_nccl_all_gather(comm_nccl *c, const void *send, void *recv, size_t send_count, comm_nccl_dtype dt,
                         void *stream, specd_err *err);
int comm_nccl_broadcast(comm_nccl *c, const void *send, void *recv, size_t count, comm_nccl_dtype dt, int root,
                        void *stream, specd_err *err);

/* Asynchronous state: 0 ok, 1 still in progress (non-blocking op not yet
 * enqueued), -1 error (message says which). */
int comm_nccl_poll(comm_nccl *c, specd_err *err);

/* Aborts outstanding work and frees the communicator's resources (the
 * handle stays valid for comm_nccl_destroy). Safe on a hung communicator. */
void comm_nccl_abort(comm_nccl *c);

/* Finalize (flushes, polled up to 10 s, abort if it does not finish) and
 * destroy. NULL ok. */
void comm_nccl_destroy(comm_nccl *c);

#endif
