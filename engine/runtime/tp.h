/*
 * tp.h: tensor-parallel serving on top of engine/comm: what rank 0 sends
 * each step, what a worker rank does with it, and the model_comm adapter.
 *
 * Ranks are processes (engine/comm/ranks.h). Rank 0 runs HTTP, the
 * scheduler and the draft; before each target forward it posts the batch on
 * the comm step channel (tp_step_post) and then runs its own shard; every
 * worker loops in tp_worker_run: receive the batch, run the same
 * model_forward on its shard (the collectives inside pair up because every
 * rank calls them in the same order), until rank 0 posts shutdown. Only
 * rank 0 keeps outputs: workers compute the logits only because the
 * vocabulary-parallel LM head's all-gather needs every rank; they skip the
 * final hidden states and the EAGLE-3 aux capture (local copies), except
 * into a rank's own fixed device aux buffer when rank 0's step leaves the
 * aux on the device (model_batch.aux_on_device: a draft shard on every GPU
 * rank reads it there, draft/eagle3_tp.h eagle3_tp_load).
 *
 * Step message (native byte order, one host): a header of int32 counts
 * (n_tokens, n_seqs, n_out, n_aux, flags), then tokens, pos, seq_of [T],
 * per sequence its number of block-table entries and the entries, out_idx
 * [n_out], aux_layers [n_aux] (flag TP_AUX_DEV: captured on the device), and
 * the tree mask [T * T] bytes when present.
 * Multi-node serving will carry the same message over TCP.
 *
 * Failure: any error on any rank aborts the comm group with the reason, so
 * every other rank's next collective or receive fails promptly (comm.h); a
 * worker that dies is reported by rank 0's monitor (ranks.h) the same way.
 * Threading: rank 0: the engine thread; worker: its main thread.
 */
#ifndef SPECD_RUNTIME_TP_H
#define SPECD_RUNTIME_TP_H

#include <stdbool.h>

#include "engine/comm/comm.h"
#include "engine/model/model.h"
#include "engine/util/err.h"

/* The rows section a step message shares with the draft head's calls
 * (draft/eagle3_tp.c): tokens[n], pos[n], seq_of[n] (n > 0), then for each
 * of the S sequences its block count (up to the last position its rows use)
 * and its block ids. words: its size; write: appends it at p, returns the
 * end; read: points into it, checking every sequence index, every block id
 * against a pool of n_blocks blocks and every position against its table
 * (bs tokens per block); returns the end, or NULL with err (the message is
 * malformed: nothing may index with it). */
size_t tp_rows_words(int32_t n, const int32_t *pos, const int32_t *seq_of, int32_t S, int32_t bs);
int32_t *tp_rows_write(int32_t *p, int32_t n, const int32_t *tokens, const int32_t *pos, const int32_t *seq_of,
                       int32_t S, const int32_t *const *tables, int32_t bs);
const int32_t *tp_rows_read(const int32_t *p, const int32_t *end, int32_t n, int32_t S, int32_t n_blocks, int32_t bs,
                            const int32_t **tokens, const int32_t **pos, const int32_t **seq_of, const int32_t **tables,
                            specd_err *err);

/* The model_comm of a host-visible backend over a shm comm group
 * (comm_all_reduce_sum_f32: fixed rank order, f32; comm_all_gather). */
void tp_model_comm_shm(comm *c, model_comm *out);

/* ------------------------------------------------------------ collectives on device memory
 *
 * The model_comm of a rank whose backend is not host-visible (the CUDA
 * backend: weights, KV and activations in device memory), chosen by
 * `--tp-comm`:
 *   shm       the host group (comm_all_reduce_sum_f32 / comm_all_gather) over
 *             host staging: each collective downloads its device tensor
 *             (one stream synchronisation), runs the shm collective, uploads
 *             the result. The same per-element rank-order f32 additions as
 *             the CPU backend's TP, so on a device whose ops equal the CPU's
 *             (the fake device of tests/backend) the logits equal CPU TP's
 *             bit for bit; on a GPU it is deterministic and slow.
 *   cuda_ipc  comm_cuda_ipc (engine/comm/comm_cuda_ipc.h): fixed rank order,
 *             f32, the same bits as shm, on the backend's stream; K ranks may
 *             share one GPU. Deterministic.
 *   nccl      comm_nccl (NCCL's algorithm and order: NOT deterministic across
 *             message sizes, so speculative greedy may differ from plain
 *             greedy in the last bits); across nodes, or where IPC is refused.
 *   auto      cuda_ipc on a device backend with at most 8 ranks (one host),
 *             else nccl; shm on a host-visible backend.
 * Only shm exists for a host-visible backend (tp_model_comm_shm). The step
 * broadcast is the host comm's step channel in every case. */
typedef enum { TP_COMM_AUTO = 0, TP_COMM_SHM, TP_COMM_CUDA_IPC, TP_COMM_NCCL } tp_comm_kind;

/* "auto" | "shm" | "cuda_ipc" | "nccl" (NULL = auto); -1 with err otherwise. */
int tp_comm_kind_parse(const char *s, tp_comm_kind *out, specd_err *err);
const char *tp_comm_kind_name(tp_comm_kind k);
/* auto resolved for a backend (host-visible or not) and a world size. */
tp_comm_kind tp_comm_kind_resolve(tp_comm_kind k, bool host_visible, int world);

typedef struct tp_dev_comm tp_dev_comm;

/* Opens this rank's collectives over backend be (collective over c for
 * cuda_ipc and nccl: every rank calls it at the same point of its start-up,
 * each with its own backend) and fills *mc (valid until tp_dev_comm_close).
 * A host-visible backend gets the plain shm adapter (kind must resolve to
 * shm). Errors: -1 with the reason (the caller aborts the group). */
int tp_dev_comm_open(comm *c, backend *be, tp_comm_kind kind, tp_dev_comm **out, model_comm *mc, specd_err *err);
/* After a forward: waits for the device collectives of the step and reports
 * a failure they saw (a peer's death, a device timeout, a mismatch); 0 when
 * healthy. No-op for shm. */
int tp_dev_comm_sync(tp_dev_comm *d, specd_err *err);
tp_comm_kind tp_dev_comm_kind(const tp_dev_comm *d);
/* The payload bytes the shm staging downloaded so far (device -> host; 0 for cuda_ipc / nccl and NULL) and,
 * in *downloads (may be NULL), in how many download calls: what a step's device -> host count holds beyond
 * the engine's own at --tp-comm shm (each such download may also read the backend's 8 bytes of error flags,
 * which the engine's next download then reads again once a later op re-armed them). */
size_t tp_dev_comm_staged_bytes(const tp_dev_comm *d, size_t *downloads);
/* Marks the device group failed (its waiting kernels return). NULL ok. */
void tp_dev_comm_abort(tp_dev_comm *d, const char *why);
/* NULL ok. Before the host comm c is destroyed (cuda_ipc's watchdog thread
 * reads it until then), after the peers are done with collectives. */
void tp_dev_comm_close(tp_dev_comm *d);

/* Rank 0: posts batch b of model m to every worker (returns once it is
 * queued), with rank 0's graph pick for it (model_graph_pick: the workers
 * force it, so every rank replays the same graph or none does). Returns 0, -2 when it refused before sending anything (a batch
 * larger than the step channel's message size, out of memory: the group is
 * still consistent), or -1 when the channel failed. */
int tp_step_post(comm *c, const model *m, const model_batch *b, specd_err *err);

/* Worker: serves steps on model m (loaded with this rank's shard) until rank
 * 0 posts shutdown (returns 0) or the group fails (returns -1; err says why,
 * e.g. rank 0 exited). A forward that fails here aborts the group. */
int tp_worker_run(comm *c, model *m, specd_err *err);
/* The same, handing every message whose first int32 word is negative (a
 * draft head's call, draft/eagle3_tp.h) to on_other; its failure aborts the
 * group. on_other NULL: such a message is an error. */
typedef int (*tp_other_fn)(void *ctx, const int32_t *msg, size_t n, specd_err *err);
int tp_worker_run_ex(comm *c, model *m, tp_other_fn on_other, void *ctx, specd_err *err);
/* The same with the device collectives dev (NULL: none): every forward is
 * followed by tp_dev_comm_sync, whose failure aborts the group. */
int tp_worker_run_dev(comm *c, model *m, tp_dev_comm *dev, tp_other_fn on_other, void *ctx, specd_err *err);

/* Rank 0: model_forward preceded by tp_step_post: the engine runner of a
 * tensor-parallel model. ctx: tp_runner. A failure aborts the group. */
typedef struct tp_runner {
    model *m;
    comm *c;
    tp_dev_comm *dev; /* device collectives (synced after each forward), or NULL */
} tp_runner;
int tp_runner_forward(void *ctx, const model_batch *b, specd_err *err);

/* CUDA graphs at TP > 1 (docs/engine.md "CUDA graphs at TP > 1"): every rank
 * calls this at the same point after its own model_graphs_capture (captured:
 * 1 ok, 0 failed with why_local). The ranks exchange their outcomes and
 * graph counts over the host group; unless every rank captured the same
 * number of graphs, every rank releases its graphs (steps run eagerly) and
 * *why says which rank failed and why. Returns 1 (graphs on everywhere), 0
 * (off everywhere), -1 (the group failed: err). Since a capture records the
 * collectives without running them, a rank whose capture fails never leaves
 * a peer waiting inside one. */
int tp_graphs_agree(comm *c, model *m, int captured, const char *why_local, char *why, size_t why_cap,
                    specd_err *err);

#endif
