/* tp_test_util.h: the worker side of the tensor-parallel tests that re-execute
 * themselves as rank processes (engine/comm/ranks.h): `TEST --tp-worker DIR
 * --specd-comm-...` attaches to the group, loads DIR's shard with the given
 * KV pool (it must equal rank 0's) on a 1-thread CPU backend and serves steps
 * until rank 0 shuts the group down (exit 0) or it fails (exit 1, the reason
 * on stderr; a load failure aborts the group so rank 0 fails at once). */
#ifndef SPECD_TESTS_TP_TEST_UTIL_H
#define SPECD_TESTS_TP_TEST_UTIL_H

#include <stdio.h>

#include "engine/comm/ranks.h"
#include "engine/runtime/tp.h"

static inline int tp_test_worker_main(int argc, char **argv, int32_t block_size, int32_t n_blocks) {
    ranks_worker w;
    specd_err err = {{0}};
    comm *c = NULL;
    if (ranks_worker_detect(argc, argv, &w, &err) != 1 || argc < 3 || ranks_worker_attach(&w, &c, &err) < 0) {
        fprintf(stderr, "tp worker: %s\n", err.msg);
        return 1;
    }
    model_comm mc;
    tp_model_comm_shm(c, &mc);
    backend *be = bk_cpu_create(1);
    model_load_opts o = {.block_size = block_size, .n_blocks = n_blocks, .tp = &mc};
    model *m = NULL;
    int rc = 1;
    if (!be || model_load(argv[2], be, &o, &m, &err) < 0) comm_abort(c, be ? err.msg : "no CPU backend");
    else if (tp_worker_run(c, m, &err) == 0) rc = 0;
    if (rc) fprintf(stderr, "tp worker rank %d: %s\n", w.rank, err.msg);
    model_destroy(m);
    if (be) bk_cpu_destroy(be);
    comm_destroy(c);
    return rc;
}

#endif
