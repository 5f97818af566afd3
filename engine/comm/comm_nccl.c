/*
 * comm_nccl.c: the NCCL adapter (comm_nccl.h): dlopen'ed libnccl, the unique
 * id exchange, non-blocking init with a timeout, collectives that tolerate
 * ncclInProgress, abort.
 *
 * Owns: the process-wide table of NCCL entry points (loaded once, under a
 * mutex, never unloaded), and each comm_nccl's ncclComm_t.
 *
 * Built against the toolkit's nccl.h when CMake found it (SPECD_HAVE_NCCL_H);
 * without it every call fails with the reason (the id exchange protocol is
 * still compiled, so a build without CUDA has the same API).
 */
#define _GNU_SOURCE
#include "engine/comm/comm_nccl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef SPECD_HAVE_NCCL_H
#include <nccl.h>

/* ============================ the dlopen'ed table =========================== */

#define NCCL_FNS(X)                                                                                           \
    X(ncclGetVersion) X(ncclGetUniqueId) X(ncclCommInitRankConfig) X(ncclCommGetAsyncError) X(ncclCommAbort)  \
    X(ncclCommFinalize) X(ncclCommDestroy) X(ncclGetErrorString) X(ncclGetLastError) X(ncclAllReduce)        \
    X(ncclAllGather) X(ncclBroadcast)

static struct {
#define X(f) __typeof__(f) *f;
    NCCL_FNS(X)
#undef X
    void *handle;
    int version;
} nccl;
static pthread_mutex_t nccl_mu = PTHREAD_MUTEX_INITIALIZER;

struct comm_nccl {
    ncclComm_t comm;
    int rank, world;
    int timeout_ms;
    int aborted;
};

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Every NCCL call goes through this: file:line, the call, NCCL's string and last error. */
static int nccl_fail(specd_err *err, const char *file, int line, const char *call, ncclResult_t rc,
                     ncclComm_t nc) {
    const char *last = nccl.ncclGetLastError ? nccl.ncclGetLastError(nc) : NULL;
    return specd_err_set(err, "%s:%d: %s: %s (%d)%s%s", file, line, call,
                         nccl.ncclGetErrorString ? nccl.ncclGetErrorString(rc) : "?", (int)rc,
                         last && *last ? "; " : "", last && *last ? last : "");
}
#define NCCL_FAIL(err, call, rc, nc) nccl_fail(err, __FILE__, __LINE__, call, rc, nc)

int comm_nccl_load(int *version, specd_err *err) {
    pthread_mutex_lock(&nccl_mu);
    if (nccl.handle) {
        if (version) *version = nccl.version;
        pthread_mutex_unlock(&nccl_mu);
        return 0;
    }
    const char *env = getenv("SPECD_NCCL_LIBRARY");
    const char *tried[4];
    int ntried = 0;
    void *h = NULL;
    if (env && *env) {
        tried[ntried++] = env;
        h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
    } else {
        static const char *const cands[] = {"libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2",
                                            "/usr/local/cuda/lib/libnccl.so.2"};
        for (size_t i = 0; i < sizeof cands / sizeof *cands && !h; i++) {
            tried[ntried++] = cands[i];
            h = dlopen(cands[i], RTLD_NOW | RTLD_LOCAL);
        }
    }
    if (!h) {
        const char *why = dlerror();
        pthread_mutex_unlock(&nccl_mu);
        return specd_err_set(err, "nccl: cannot load %s%s%s (%s)", tried[0], ntried > 1 ? " or the CUDA toolkit's" : "",
                             ntried > 1 ? " copies" : "", why ? why : "?");
    }
#define X(f)                                                                                                 \
    nccl.f = (__typeof__(f) *)dlsym(h, #f);                                                                  \
    if (!nccl.f) {                                                                                           \
        dlclose(h);                                                                                          \
        memset(&nccl, 0, sizeof nccl);                                                                       \
        pthread_mutex_unlock(&nccl_mu);                                                                      \
        return specd_err_set(err, "nccl: %s lacks %s (NCCL older than 2.14?)", tried[ntried - 1], #f);        \
    }
    NCCL_FNS(X)
#undef X
    int v = 0;
    ncclResult_t rc = nccl.ncclGetVersion(&v);
    if (rc != ncclSuccess) {
        NCCL_FAIL(err, "ncclGetVersion", rc, NULL);
        dlclose(h);
        memset(&nccl, 0, sizeof nccl);
        pthread_mutex_unlock(&nccl_mu);
        return -1;
    }
    nccl.version = v;
    nccl.handle = h;
    if (version) *version = v;
    pthread_mutex_unlock(&nccl_mu);
    return 0;
}

int comm_nccl_id_new(uint8_t id[COMM_NCCL_ID_BYTES], specd_err *err) {
    _Static_assert(sizeof(ncclUniqueId) == COMM_NCCL_ID_BYTES, "ncclUniqueId is 128 bytes");
    if (comm_nccl_load(NULL, err)) return -1;
    ncclUniqueId uid;
    ncclResult_t rc = nccl.ncclGetUniqueId(&uid);
    if (rc != ncclSuccess) return NCCL_FAIL(err, "ncclGetUniqueId", rc, NULL);
    memcpy(id, uid.internal, COMM_NCCL_ID_BYTES);
    return 0;
}

/* Waits while the communicator's async state is ncclInProgress; aborts on error or timeout. */
static int nccl_wait_progress(comm_nccl *c, const char *what, int timeout_ms, specd_err *err) {
    int64_t deadline = now_ms() + timeout_ms;
    for (;;) {
        ncclResult_t st = ncclInProgress;
        ncclResult_t rc = nccl.ncclCommGetAsyncError(c->comm, &st);
        if (rc != ncclSuccess) {
            NCCL_FAIL(err, "ncclCommGetAsyncError", rc, c->comm);
            comm_nccl_abort(c);
            return specd_err_wrap(err, "nccl rank %d: %s", c->rank, what);
        }
        if (st == ncclSuccess) return 0;
        if (st != ncclInProgress) {
            NCCL_FAIL(err, what, st, c->comm);
            comm_nccl_abort(c);
            return specd_err_wrap(err, "nccl rank %d", c->rank);
        }
        if (now_ms() >= deadline) {
            comm_nccl_abort(c);
            return specd_err_set(err, "nccl rank %d: %s did not complete within %d ms (communicator aborted)",
                                 c->rank, what, timeout_ms);
        }
        struct timespec ts = {0, 1000000}; /* 1 ms */
        nanosleep(&ts, NULL);
    }
}

int comm_nccl_init(const uint8_t id[COMM_NCCL_ID_BYTES], int rank, int world, int timeout_ms, comm_nccl **out,
                   specd_err *err) {
    *out = NULL;
    if (world < 1 || rank < 0 || rank >= world)
        return specd_err_set(err, "nccl: rank %d of world %d is out of range", rank, world);
    if (comm_nccl_load(NULL, err)) return -1;
    comm_nccl *c = calloc(1, sizeof *c);
    if (!c) return specd_err_set(err, "nccl: out of memory");
    c->rank = rank;
    c->world = world;
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : 120000;
    ncclUniqueId uid;
    memcpy(uid.internal, id, COMM_NCCL_ID_BYTES);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t rc = nccl.ncclCommInitRankConfig(&c->comm, world, uid, rank, &cfg);
    if (rc != ncclSuccess && rc != ncclInProgress) {
        NCCL_FAIL(err, "ncclCommInitRankConfig", rc, c->comm);
        if (c->comm) nccl.ncclCommAbort(c->comm);
        free(c);
        return specd_err_wrap(err, "nccl rank %d of %d", rank, world);
    }
    if (!c->comm) {
        free(c);
        return specd_err_set(err, "nccl rank %d of %d: ncclCommInitRankConfig returned no communicator", rank, world);
    }
    if (nccl_wait_progress(c, "ncclCommInitRankConfig", c->timeout_ms, err)) {
        free(c);
        return -1;
    }
    *out = c;
    return 0;
}

static ncclDataType_t nccl_dtype(comm_nccl_dtype dt) { return dt == COMM_NCCL_BF16 ? ncclBfloat16 : ncclFloat32; }

/* A collective call on a non-blocking communicator: ncclInProgress means "being enqueued". */
static int nccl_enqueued(comm_nccl *c, const char *file, int line, const char *call, ncclResult_t rc,
                         specd_err *err) {
    if (c->aborted) return specd_err_set(err, "nccl rank %d: %s on an aborted communicator", c->rank, call);
    if (rc == ncclSuccess) return 0;
    if (rc == ncclInProgress) return nccl_wait_progress(c, call, c->timeout_ms, err);
    nccl_fail(err, file, line, call, rc, c->comm);
    return specd_err_wrap(err, "nccl rank %d", c->rank);
}

int comm_nccl_all_reduce_sum(comm_nccl *c, const void *send, void *recv, size_t count, comm_nccl_dtype dt,
                             void *stream, specd_err *err) {
    if (c->aborted) return specd_err_set(err, "nccl rank %d: all_reduce on an aborted communicator", c->rank);
    ncclResult_t rc = nccl.ncclAllReduce(send, recv, count, nccl_dtype(dt), ncclSum, c->comm, (cudaStream_t)stream);
    return nccl_enqueued(c, __FILE__, __LINE__, "ncclAllReduce", rc, err);
}

int comm_nccl_all_gather(comm_nccl *c, const void *send, void *recv, size_t send_count, comm_nccl_dtype dt,
                         void *stream, specd_err *err) {
    if (c->aborted) return specd_err_set(err, "nccl rank %d: all_gather on an aborted communicator", c->rank);
    ncclResult_t rc = nccl.ncclAllGather(send, recv, send_count, nccl_dtype(dt), c->comm, (cudaStream_t)stream);
    return nccl_enqueued(c, __FILE__, __LINE__, "ncclAllGather", rc, err);
}

int comm_nccl_broadcast(comm_nccl *c, const void *send, void *recv, size_t count, comm_nccl_dtype dt, int root,
                        void *stream, specd_err *err) {
    if (c->aborted) return specd_err_set(err, "nccl rank %d: broadcast on an aborted communicator", c->rank);
    if (root < 0 || root >= c->world)
        return specd_err_set(err, "nccl rank %d: broadcast root %d outside world %d", c->rank, root, c->world);
    ncclResult_t rc =
        nccl.ncclBroadcast(send, recv, count, nccl_dtype(dt), root, c->comm, (cudaStream_t)stream);
    return nccl_enqueued(c, __FILE__, __LINE__, "ncclBroadcast", rc, err);
}

int comm_nccl_poll(comm_nccl *c, specd_err *err) {
    if (c->aborted) return specd_err_set(err, "nccl rank %d: communicator was aborted", c->rank);
    ncclResult_t st = ncclSuccess;
    ncclResult_t rc = nccl.ncclCommGetAsyncError(c->comm, &st);
    if (rc != ncclSuccess) return NCCL_FAIL(err, "ncclCommGetAsyncError", rc, c->comm);
    if (st == ncclInProgress) return 1;
    if (st != ncclSuccess) return NCCL_FAIL(err, "asynchronous error", st, c->comm);
    return 0;
}

void comm_nccl_abort(comm_nccl *c) {
    if (!c || c->aborted) return;
    if (c->comm) nccl.ncclCommAbort(c->comm);
    c->aborted = 1;
}

void comm_nccl_destroy(comm_nccl *c) {
    if (!c) return;
    if (!c->aborted && c->comm) {
        specd_err e;
        ncclResult_t rc = nccl.ncclCommFinalize(c->comm);
        if ((rc == ncclSuccess || rc == ncclInProgress) && nccl_wait_progress(c, "ncclCommFinalize", 10000, &e) == 0)
            nccl.ncclCommDestroy(c->comm);
        else
            comm_nccl_abort(c); /* nccl_wait_progress may already have */
    }
    free(c);
}

#else /* !SPECD_HAVE_NCCL_H */

#define NO_NCCL(err) specd_err_set(err, "nccl: this build has no nccl.h (configure with the CUDA toolkit)")
int comm_nccl_load(int *version, specd_err *err) { return NO_NCCL(err); }
int comm_nccl_id_new(uint8_t id[COMM_NCCL_ID_BYTES], specd_err *err) { return NO_NCCL(err); }
int comm_nccl_init(const uint8_t id[COMM_NCCL_ID_BYTES], int rank, int world, int timeout_ms, comm_nccl **out,
                   specd_err *err) {
    *out = NULL;
    return NO_NCCL(err);
}
int comm_nccl_all_reduce_sum(comm_nccl *c, const void *send, void *recv, size_t count, comm_nccl_dtype dt,
                             void *stream, specd_err *err) { return NO_NCCL(err); }
int comm_nccl_all_gather(comm_nccl *c, const void *send, void *recv, size_t send_count, comm_nccl_dtype dt,
                         void *stream, specd_err *err) { return NO_NCCL(err); }
int comm_nccl_broadcast(comm_nccl *c, const void *send, void *recv, size_t count, comm_nccl_dtype dt, int root,
                        void *stream, specd_err *err) { return NO_NCCL(err); }
int comm_nccl_poll(comm_nccl *c, specd_err *err) { return NO_NCCL(err); }
void comm_nccl_abort(comm_nccl *c) {}
void comm_nccl_destroy(comm_nccl *c) {}

#endif

/* ============================ bootstrap (any build) ========================= */

int comm_nccl_id_share(comm *boot, uint8_t id[COMM_NCCL_ID_BYTES], specd_err *err) {
    /* Rank 0 broadcasts the id, or an empty blob plus its reason when it has none, so the
     * others fail with that reason instead of waiting for an id that never comes. */
    uint8_t blob[COMM_NCCL_ID_BYTES > SPECD_ERR_MSG_MAX ? COMM_NCCL_ID_BYTES : SPECD_ERR_MSG_MAX];
    size_t n = 0;
    if (comm_rank(boot) == 0) {
        specd_err e = {{0}};
        if (comm_nccl_id_new(id, &e) == 0) {
            memcpy(blob, id, COMM_NCCL_ID_BYTES);
            n = COMM_NCCL_ID_BYTES;
        } else {
            n = strlen(e.msg) + 1; /* != 128 unless the message is exactly 127 chars: pad it */
            if (n == COMM_NCCL_ID_BYTES) n++;
            memset(blob, 0, sizeof blob);
            memcpy(blob, e.msg, strlen(e.msg));
        }
        if (comm_broadcast(boot, 0, blob, &n, sizeof blob, err)) return -1;
        if (n != COMM_NCCL_ID_BYTES) return specd_err_set(err, "nccl id: rank 0: %s", (const char *)blob);
        return 0;
    }
    if (comm_broadcast(boot, 0, blob, &n, sizeof blob, err)) return -1;
    if (n != COMM_NCCL_ID_BYTES) {
        blob[sizeof blob - 1] = 0;
        return specd_err_set(err, "nccl id: rank 0 could not create one: %s", (const char *)blob);
    }
    memcpy(id, blob, COMM_NCCL_ID_BYTES);
    return 0;
}

int comm_nccl_create(comm *boot, int timeout_ms, comm_nccl **out, specd_err *err) {
    *out = NULL;
    uint8_t id[COMM_NCCL_ID_BYTES];
    if (comm_nccl_id_share(boot, id, err)) return -1;
    return comm_nccl_init(id, comm_rank(boot), comm_world(boot), timeout_ms, out, err);
}
