/*
 * tp_fake_util.h: what the fake-device TP tests (test_cuda_tp.c,
 * test_cuda_tp_sample.c, test_cuda_kimi_tp.c) share: the device ranks' communicator choice and
 * rank 0's teardown of a group, in the one order that is safe.
 */
#ifndef SPECD_TESTS_TP_FAKE_UTIL_H
#define SPECD_TESTS_TP_FAKE_UTIL_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/backend.h"
#include "engine/backend/cuda_backend.h"
#include "engine/comm/ranks.h"
#include "engine/model/model.h"
#include "engine/runtime/tp.h"

/* The device ranks' collectives: shm staged through the host, or cuda_ipc with SPECD_TP_TEST_COMM=cuda_ipc (the
 * build of tools/kn_emu/run_tp.sh, where the cuda_ipc kernel runs in the CPU emulation; workers inherit it). */
static inline tp_comm_kind tp_fake_dev_comm(void) {
    const char *e = getenv("SPECD_TP_TEST_COMM");
    return e && !strcmp(e, "cuda_ipc") ? TP_COMM_CUDA_IPC : TP_COMM_SHM;
}

/* A worker's verdict at exit: its error (when rc != 0) and, on the device, the host pointers that reached
 * device ops (`violations`: the fake's fake_violations, passed in because a GPU build of a test has none).
 * Returns rc, or 1 when any host pointer reached a device op. */
static inline int tp_fake_worker_verdict(int rc, const char *why, int rank, bool on_dev, int violations) {
    if (rc) fprintf(stderr, "tp worker rank %d: %s\n", rank, why);
    if (on_dev && violations) {
        fprintf(stderr, "tp worker rank %d: %d host pointers reached device ops\n", rank, violations);
        rc = 1;
    }
    return rc;
}

/* Rank 0's end of a group (any argument may be NULL): the workers are shut down first, then the device
 * collectives closed (cuda_ipc's watchdog reads the host group, so before ranks_destroy), then the host group,
 * the model and the backend. Returns ranks_shutdown's result (0, or -1 with the reason in err). */
static inline int tp_fake_group_close(ranks *rk, tp_dev_comm *dev, model *m, backend *be, bool on_dev,
                                      specd_err *err) {
    int rc = 0;
    if (rk) rc = ranks_shutdown(rk, 10000, err);
    tp_dev_comm_close(dev);
    if (rk) ranks_destroy(rk);
    model_destroy(m);
    if (be) on_dev ? bk_cuda_destroy(be) : bk_cpu_destroy(be);
    return rc;
}

#endif
