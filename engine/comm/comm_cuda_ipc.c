/*
 * comm_cuda_ipc.c: the host side of the cuda_ipc communicator
 * (comm_cuda_ipc.h): bootstrap over the host comm, the launches (split into
 * stage-size pieces), the watchdog thread, the waits and the error reports.
 * The device side is kernels/kn_allreduce.cu.
 *
 * Owns: this rank's region (cudaMalloc), the peers' mappings
 * (cudaIpcOpenMemHandle), the pinned ctrl words (cudaHostAllocMapped) and the
 * watchdog thread. Every CUDA call is checked and reported with file:line.
 *
 * The watchdog (one thread, every COMM_CUDA_IPC_WATCH_MS) links the two
 * failure domains: host group aborted -> ctrl->abort = 1 (the kernels of this
 * rank stop waiting); a kernel recorded a failure (ctrl->err) -> the host
 * group is aborted with the reason (the peers' watchdogs then stop theirs).
 * Host reads / writes of the ctrl words are volatile accesses to pinned
 * memory, ordered with full fences (__atomic_thread_fence seq_cst).
 */
#define _GNU_SOURCE
#include "engine/comm/comm_cuda_ipc.h"

#include <stdio.h>
#include <string.h>

#ifndef SPECD_HAVE_CUDA

#define NO_CUDA(err) specd_err_set(err, "comm_cuda_ipc: this binary was built without CUDA")
int comm_cuda_ipc_create(comm *boot, const comm_cuda_ipc_config *cfg, comm_cuda_ipc **out, specd_err *err) {
    (void)boot, (void)cfg;
    *out = NULL;
    return NO_CUDA(err);
}
int comm_cuda_ipc_all_reduce_sum_f32(comm_cuda_ipc *c, const float *in, float *out, size_t n, void *stream,
                                     specd_err *err) {
    (void)c, (void)in, (void)out, (void)n, (void)stream;
    return NO_CUDA(err);
}
int comm_cuda_ipc_all_gather(comm_cuda_ipc *c, const void *in, void *out, size_t bytes, void *stream,
                             specd_err *err) {
    (void)c, (void)in, (void)out, (void)bytes, (void)stream;
    return NO_CUDA(err);
}
int comm_cuda_ipc_broadcast(comm_cuda_ipc *c, int root, const void *in, void *out, size_t bytes, void *stream,
                            specd_err *err) {
    (void)c, (void)root, (void)in, (void)out, (void)bytes, (void)stream;
    return NO_CUDA(err);
}
int comm_cuda_ipc_barrier(comm_cuda_ipc *c, void *stream, specd_err *err) {
    (void)c, (void)stream;
    return NO_CUDA(err);
}
int comm_cuda_ipc_sync(comm_cuda_ipc *c, void *stream, specd_err *err) {
    (void)c, (void)stream;
    return NO_CUDA(err);
}
int comm_cuda_ipc_poll(comm_cuda_ipc *c, specd_err *err) {
    (void)c;
    return NO_CUDA(err);
}
void comm_cuda_ipc_set_algo(comm_cuda_ipc *c, int algo) { (void)c, (void)algo; }
void comm_cuda_ipc_abort(comm_cuda_ipc *c, const char *reason) { (void)c, (void)reason; }
#define DESTROY_CHECK(c, call)                                                                              \
    do {                                                                                                    \
        int dc_rc_ = (int)(call);                                                                           \
        if (dc_rc_ != 0)                                                                                    \
            LOG_WARN("comm_cuda_ipc rank %d: %s:%d: %s: %s", (c)->rank, __FILE__, __LINE__, #call,         \
                     kn_strerror(dc_rc_));                                                                  \
    } while (0)

void comm_cuda_ipc_destroy(comm_cuda_ipc *c) { (void)c; }

#else

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "engine/util/log.h"
#include "kernels/kn.h"
#include "kernels/kn_allreduce.h"

_Static_assert(COMM_CUDA_IPC_MAX_WORLD == KN_AR_MAX_RANKS, "comm_cuda_ipc.h's bound is the kernel's");

struct comm_cuda_ipc {
    comm *boot;
    int rank, world, device;
    void *region;                    /* this rank's region, device, kn_ar_region_bytes(stage_bytes) bytes:
                                        [8 KiB flags + counters][stage 2 x stage_bytes][result 2 x stage_bytes] */
    size_t stage_bytes, oneshot_max;
    void *peer[KN_AR_MAX_RANKS];     /* peers' regions as opened here (NULL: own / not opened) */
    kn_ar_ctrl *ctrl;                /* host view of the pinned, device-mapped ctrl words (one kn_ar_ctrl) */
    kn_ar_group g;
    int algo;                        /* 0 auto, 1 one-shot, 2 two-shot */
    int timeout_ms;
    pthread_t watch;
    int watch_started;
    atomic_int stop;
    atomic_int reported;             /* the device failure was turned into a host abort */
};

/* A failed CUDA call: file:line, the call, CUDA's name and string. */
#define CI_CHECK(call)                                                                                    \
    do {                                                                                                  \
        int ci_rc_ = (int)(call);                                                                         \
        if (ci_rc_ != 0) {                                                                                \
            specd_err_set(err, "comm_cuda_ipc rank %d: %s:%d: %s: %s", rank, __FILE__, __LINE__, #call,   \
                          kn_strerror(ci_rc_));                                                           \
            goto fail;                                                                                    \
        }                                                                                                 \
    } while (0)

static const char *op_name(uint32_t op) {
    switch (op) {
    case KN_AR_OP_BARRIER: return "barrier";
    case KN_AR_OP_ONESHOT: return "all_reduce (one-shot)";
    case KN_AR_OP_TWOSHOT: return "all_reduce (two-shot)";
    case KN_AR_OP_GATHER: return "all_gather";
    case KN_AR_OP_BCAST: return "broadcast";
    default: return "?";
    }
}

/* The reason the device recorded, as text (ctrl->err != 0). */
static void device_reason(const comm_cuda_ipc *c, char *buf, size_t len) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    const kn_ar_ctrl *k = c->ctrl;
    switch (k->err) {
    case KN_AR_ERR_TIMEOUT:
        snprintf(buf, len, "%s timed out after %d ms waiting for rank %d (generation %u)", op_name(k->err_op),
                 c->timeout_ms, (int)k->err_peer, (unsigned)k->err_gen);
        break;
    case KN_AR_ERR_MISMATCH:
        snprintf(buf, len,
                 "collective mismatch: rank %d called %s (generation %u), rank %d called another collective "
                 "(descriptor %08x)",
                 c->rank, op_name(k->err_op), (unsigned)k->err_gen, (int)k->err_peer, (unsigned)k->err_desc);
        break;
    default:
        snprintf(buf, len, "%s stopped on the abort word (generation %u)", op_name(k->err_op),
                 (unsigned)k->err_gen);
    }
}

static void set_abort_word(comm_cuda_ipc *c) {
    c->ctrl->abort = 1;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* The group failed (host or device): -1 with the reason, op naming the call. Aborts the host group too. */
static int fail_reason(comm_cuda_ipc *c, const char *op, specd_err *err) {
    char why[COMM_REASON_MAX + 64];
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint32_t dev = c->ctrl->err;
    if (dev == KN_AR_ERR_TIMEOUT || dev == KN_AR_ERR_MISMATCH) {
        device_reason(c, why, sizeof why);
        comm_abort(c->boot, why);
        set_abort_word(c);
        return specd_err_set(err, "comm_cuda_ipc rank %d: %s: %s", c->rank, op, why);
    }
    if (comm_aborted(c->boot, why, sizeof why)) {
        set_abort_word(c);
        return specd_err_set(err, "comm_cuda_ipc rank %d: %s: aborted: %s", c->rank, op, why);
    }
    set_abort_word(c);
    comm_abort(c->boot, "cuda_ipc: a kernel stopped on the abort word");
    return specd_err_set(err, "comm_cuda_ipc rank %d: %s: aborted", c->rank, op);
}

static int is_failed(comm_cuda_ipc *c) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return c->ctrl->abort || c->ctrl->err || comm_aborted(c->boot, NULL, 0);
}

static void *watch_main(void *arg) {
    comm_cuda_ipc *c = arg;
    struct timespec ts = {0, COMM_CUDA_IPC_WATCH_MS * 1000000L};
    while (!atomic_load(&c->stop)) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (!c->ctrl->abort && comm_aborted(c->boot, NULL, 0)) set_abort_word(c);
        uint32_t dev = c->ctrl->err;
        if ((dev == KN_AR_ERR_TIMEOUT || dev == KN_AR_ERR_MISMATCH) && !atomic_exchange(&c->reported, 1)) {
            char why[COMM_REASON_MAX];
            device_reason(c, why, sizeof why);
            comm_abort(c->boot, why);
        }
        nanosleep(&ts, NULL);
    }
    return NULL;
}

typedef struct ipc_info {
    cudaIpcMemHandle_t handle;
    char bus[32];
    uint64_t stage_bytes, oneshot_max;
    int32_t pid, device;
} ipc_info;

int comm_cuda_ipc_create(comm *boot, const comm_cuda_ipc_config *cfg, comm_cuda_ipc **out, specd_err *err) {
    *out = NULL;
    int rank = comm_rank(boot), world = comm_world(boot);
    if (world < 1 || world > KN_AR_MAX_RANKS)
        return specd_err_set(err, "comm_cuda_ipc rank %d: world %d outside [1, %d]", rank, world, KN_AR_MAX_RANKS);
    comm_cuda_ipc *c = calloc(1, sizeof *c);
    ipc_info *all = calloc((size_t)world, sizeof *all);
    if (!c || !all) {
        free(c);
        free(all);
        return specd_err_set(err, "comm_cuda_ipc rank %d: out of memory", rank);
    }
    c->boot = boot;
    c->rank = rank;
    c->world = world;
    c->device = cfg ? cfg->device : 0;
    size_t stage = cfg && cfg->stage_bytes ? cfg->stage_bytes : (size_t)8 << 20;
    c->stage_bytes = (stage + 255) / 256 * 256;
    c->oneshot_max = cfg && cfg->oneshot_max_bytes ? cfg->oneshot_max_bytes : ((size_t)1 << 20) / (size_t)world;
    c->timeout_ms = cfg && cfg->timeout_ms > 0 ? cfg->timeout_ms : 10000;
    ipc_info mine;
    memset(&mine, 0, sizeof mine);

    int rc_dev = (int)cudaSetDevice(c->device);
    if (rc_dev != 0) {
        specd_err_set(err, "comm_cuda_ipc rank %d: %s:%d: cudaSetDevice(%d): %s", rank, __FILE__, __LINE__, c->device,
                      kn_strerror(rc_dev));
        goto fail;
    }
    size_t bytes = kn_ar_region_bytes(c->stage_bytes);
    CI_CHECK(cudaMalloc(&c->region, bytes));
    CI_CHECK(cudaMemset(c->region, 0, bytes));
    CI_CHECK(cudaHostAlloc((void **)&c->ctrl, sizeof(kn_ar_ctrl), cudaHostAllocMapped));
    memset((void *)c->ctrl, 0, sizeof(kn_ar_ctrl));
    void *ctrl_dev = NULL;
    CI_CHECK(cudaHostGetDevicePointer(&ctrl_dev, c->ctrl, 0));
    CI_CHECK(cudaDeviceSynchronize()); /* zeroed before any peer may write a flag */
    CI_CHECK(cudaIpcGetMemHandle(&mine.handle, c->region));
    CI_CHECK(cudaDeviceGetPCIBusId(mine.bus, sizeof mine.bus, c->device));
    mine.stage_bytes = c->stage_bytes;
    mine.oneshot_max = c->oneshot_max;
    mine.pid = (int32_t)getpid();
    mine.device = c->device;
    if (comm_all_gather(boot, &mine, sizeof mine, all, err)) goto fail_quiet;
    for (int j = 0; j < world; j++) {
        if (all[j].stage_bytes != c->stage_bytes || all[j].oneshot_max != c->oneshot_max) {
            specd_err_set(err,
                          "comm_cuda_ipc rank %d: rank %d uses stage %llu B / one-shot up to %llu B, this rank %zu / %zu "
                          "(every rank must pass the same)",
                          rank, j, (unsigned long long)all[j].stage_bytes, (unsigned long long)all[j].oneshot_max,
                          c->stage_bytes, c->oneshot_max);
            goto fail;
        }
        if (j == rank) continue;
        int pdev = -1;
        if (cudaDeviceGetByPCIBusId(&pdev, all[j].bus) != cudaSuccess) {
            specd_err_set(err, "comm_cuda_ipc rank %d: rank %d's GPU (PCI %s) is not visible to this process", rank,
                          j, all[j].bus);
            goto fail;
        }
        if (pdev != c->device) {
            int can = 0;
            CI_CHECK(cudaDeviceCanAccessPeer(&can, c->device, pdev));
            if (!can) {
                specd_err_set(err, "comm_cuda_ipc rank %d: GPU %d cannot access rank %d's GPU %d (PCI %s): no peer "
                              "access (use NCCL)", rank, c->device, j, pdev, all[j].bus);
                goto fail;
            }
        }
        CI_CHECK(cudaIpcOpenMemHandle(&c->peer[j], all[j].handle, cudaIpcMemLazyEnablePeerAccess));
    }
    /* Every region is zeroed and open everywhere before the first flag is written. */
    if (comm_barrier(boot, err)) goto fail_quiet;
    c->g.rank = rank;
    c->g.world = world;
    c->g.ctrl = ctrl_dev;
    c->g.stage_bytes = c->stage_bytes;
    c->g.timeout_ns = (uint64_t)c->timeout_ms * 1000000ULL;
    for (int j = 0; j < world; j++) c->g.base[j] = j == rank ? c->region : c->peer[j];
    if (pthread_create(&c->watch, NULL, watch_main, c) != 0) {
        specd_err_set(err, "comm_cuda_ipc rank %d: cannot start the watchdog thread", rank);
        goto fail;
    }
    c->watch_started = 1;
    free(all);
    *out = c;
    return 0;
fail:
    comm_abort(boot, err ? err->msg : "comm_cuda_ipc: start-up failed"); /* the peers stop waiting for us */
fail_quiet:
    free(all);
    comm_cuda_ipc_destroy(c);
    return -1;
}

#define DESTROY_CHECK(c, call)                                                                              \
    do {                                                                                                    \
        int dc_rc_ = (int)(call);                                                                           \
        if (dc_rc_ != 0)                                                                                    \
            LOG_WARN("comm_cuda_ipc rank %d: %s:%d: %s: %s", (c)->rank, __FILE__, __LINE__, #call,         \
                     kn_strerror(dc_rc_));                                                                  \
    } while (0)

void comm_cuda_ipc_destroy(comm_cuda_ipc *c) {
    if (!c) return;
    if (c->watch_started) {
        atomic_store(&c->stop, 1);
        pthread_join(c->watch, NULL);
    }
    /* Never fails, but says what went wrong (a peer that died may have taken its region with it). */
    for (int j = 0; j < KN_AR_MAX_RANKS; j++)
        if (c->peer[j]) DESTROY_CHECK(c, cudaIpcCloseMemHandle(c->peer[j]));
    if (c->region) DESTROY_CHECK(c, cudaFree(c->region));
    if (c->ctrl) DESTROY_CHECK(c, cudaFreeHost((void *)c->ctrl));
    free(c);
}

void comm_cuda_ipc_set_algo(comm_cuda_ipc *c, int algo) { c->algo = algo; }

void comm_cuda_ipc_abort(comm_cuda_ipc *c, const char *reason) {
    if (!c) return;
    set_abort_word(c);
    comm_abort(c->boot, reason ? reason : "cuda_ipc aborted");
}

/* A launcher's return value: 0, or the group fails with file:line (a refused argument or a launch error). */
static int launch_check(comm_cuda_ipc *c, int rc, const char *op, const char *call, int line, specd_err *err) {
    if (rc == 0) return 0;
    char why[COMM_REASON_MAX];
    snprintf(why, sizeof why, "%s:%d: %s: %s", __FILE__, line, call, kn_strerror(rc));
    comm_cuda_ipc_abort(c, why);
    return specd_err_set(err, "comm_cuda_ipc rank %d: %s: %s", c->rank, op, why);
}
#define LAUNCH(c, op, call) launch_check(c, (call), op, #call, __LINE__, err)

int comm_cuda_ipc_all_reduce_sum_f32(comm_cuda_ipc *c, const float *in, float *out, size_t n, void *stream,
                                     specd_err *err) {
    char op[64];
    snprintf(op, sizeof op, "all_reduce(%zu f32)", n);
    if (is_failed(c)) return fail_reason(c, op, err);
    size_t per = c->stage_bytes / sizeof(float), done = 0;
    do {
        size_t m = n - done < per ? n - done : per;
        int two = c->algo == 2 || (c->algo == 0 && m * sizeof(float) > c->oneshot_max && c->world > 1);
        if (LAUNCH(c, op, kn_allreduce_sum_f32(&c->g, in + done, out + done, m, two, stream))) return -1;
        done += m;
    } while (done < n);
    return 0;
}

int comm_cuda_ipc_all_gather(comm_cuda_ipc *c, const void *in, void *out, size_t bytes, void *stream,
                             specd_err *err) {
    char op[64];
    snprintf(op, sizeof op, "all_gather(%zu B per rank)", bytes);
    if (is_failed(c)) return fail_reason(c, op, err);
    size_t done = 0;
    do {
        size_t m = bytes - done < c->stage_bytes ? bytes - done : c->stage_bytes;
        if (LAUNCH(c, op, kn_allgather(&c->g, (const uint8_t *)in + done, (uint8_t *)out + done, m, bytes, stream)))
            return -1;
        done += m;
    } while (done < bytes);
    return 0;
}

int comm_cuda_ipc_broadcast(comm_cuda_ipc *c, int root, const void *in, void *out, size_t bytes, void *stream,
                            specd_err *err) {
    char op[64];
    snprintf(op, sizeof op, "broadcast(root %d, %zu B)", root, bytes);
    if (root < 0 || root >= c->world) {
        char why[96];
        snprintf(why, sizeof why, "broadcast from root %d outside world %d", root, c->world);
        comm_cuda_ipc_abort(c, why);
        return specd_err_set(err, "comm_cuda_ipc rank %d: %s", c->rank, why);
    }
    if (is_failed(c)) return fail_reason(c, op, err);
    size_t done = 0;
    do {
        size_t m = bytes - done < c->stage_bytes ? bytes - done : c->stage_bytes;
        const uint8_t *src = c->rank == root ? (const uint8_t *)in + done : NULL;
        if (LAUNCH(c, op, kn_broadcast(&c->g, root, src, (uint8_t *)out + done, m, stream))) return -1;
        done += m;
    } while (done < bytes);
    return 0;
}

int comm_cuda_ipc_barrier(comm_cuda_ipc *c, void *stream, specd_err *err) {
    if (is_failed(c)) return fail_reason(c, "barrier", err);
    return LAUNCH(c, "barrier", kn_ar_barrier(&c->g, stream));
}

int comm_cuda_ipc_poll(comm_cuda_ipc *c, specd_err *err) {
    return is_failed(c) ? fail_reason(c, "poll", err) : 0;
}

int comm_cuda_ipc_sync(comm_cuda_ipc *c, void *stream, specd_err *err) {
    struct timespec t0, now, nap = {0, 20000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    /* Backstop: every kernel gives up within timeout_ms of waiting (or at once on abort); a stream still
     * busy well after that is not waiting on a peer (a wedged GPU, or the caller's own long work). */
    int64_t limit_ms = 2 * (int64_t)c->timeout_ms + 5000;
    for (;;) {
        cudaError_t q = cudaStreamQuery((cudaStream_t)stream);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) {
            char why[COMM_REASON_MAX];
            snprintf(why, sizeof why, "%s:%d: cudaStreamQuery: %s", __FILE__, __LINE__, kn_strerror((int)q));
            comm_cuda_ipc_abort(c, why);
            return specd_err_set(err, "comm_cuda_ipc rank %d: sync: %s", c->rank, why);
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        int64_t ms = (now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000;
        if (ms > limit_ms) {
            char why[COMM_REASON_MAX];
            snprintf(why, sizeof why, "the stream did not finish within %lld ms", (long long)limit_ms);
            comm_cuda_ipc_abort(c, why);
            return specd_err_set(err, "comm_cuda_ipc rank %d: sync: %s", c->rank, why);
        }
        nanosleep(&nap, NULL);
    }
    return is_failed(c) ? fail_reason(c, "sync", err) : 0;
}

#endif
