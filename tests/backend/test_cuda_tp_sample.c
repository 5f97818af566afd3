/*
 * test_cuda_tp_sample.c (backend_cuda_tp_sample, label unit, no GPU):
 * sampling on the device at tensor parallelism. The tiny HF Llama "f32" at
 * TP 2 (its LM head split by vocabulary: 256 of 512 rows per rank) with
 * every rank on the fake CUDA device (tests/backend/cuda_fake.c): rank 0's
 * forward all-gathers the logits on the device and interleaves them there
 * (model.c: copy_cols per rank), the engine samples them with bk_ops.sample
 * (engine_config.forward_logits_dev, set by the bundle at TP), and the
 * workers keep their gathered copy on the device. Reference: the same
 * engine scenarios on CPU TP 2 (host sampling). tests/backend/engine_gen.h's
 * scenarios: greedy; seeded sampling at n = 2 with top-k / top-p / min-p /
 * penalties / logit_bias / min_tokens; logprobs and prompt logprobs (raw rows
 * downloaded from the device logits); speculative k = 3 with an oracle
 * proposer (greedy chains verified on the device, a sampling chain on the
 * host) and speculative greedy == plain greedy: tokens identical and
 * logprobs bit-identical to CPU TP 2.
 * With SPECD_TP_TEST_COMM=cuda_ipc (tools/kn_emu/run_tp.sh: the real
 * communicator in the kn_emu emulation) every step's device -> host bytes are
 * also checked against engine_gen.h's table (ids, counts, asked-for rows: no
 * logits); with the default shm collectives (staged through the host) that
 * count includes the staging, so it is not checked.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/backend/cuda_fake/cuda_runtime_api.h"
#include "engine/backend/cuda_backend.h"
#include "engine/comm/ranks.h"
#include "engine/runtime/tp.h"
#include "tests/backend/tp_fake_util.h"

extern int fake_violations, fake_kn_sample_calls, fake_kn_spec_verify_calls;
extern size_t fake_d2h_bytes, fake_h2d_bytes;
#define EG_EXACT 1
#include "tests/backend/engine_gen.h"

enum { NBLK = 64 };


static backend *fake_dev(specd_err *err) {
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)96 << 20, .max_tokens = 256, .max_seqs = 8, .max_len = 160,
                      .block_size = EG_BS, .max_heads = 16, .max_head_dim = 128, .sample_vocab = 512,
                      .staging_bytes = 1 << 20};
    return bk_cuda_create(&o, err);
}

typedef struct grp {
    ranks *rk;
    backend *be;
    bool on_dev;
    tp_dev_comm *dev;
    model_comm mc;
    model *m;
    tp_runner tr;
} grp;

/* Worker: `test --tp-worker cpu|fake PATH --specd-comm-...`. */
static int worker_main(int argc, char **argv) {
    ranks_worker w;
    specd_err err = {{0}};
    comm *c = NULL;
    if (ranks_worker_detect(argc, argv, &w, &err) != 1 || argc < 4 || ranks_worker_attach(&w, &c, &err) < 0) {
        fprintf(stderr, "tp worker: %s\n", err.msg);
        return 1;
    }
    const bool on_dev = strcmp(argv[2], "cpu") != 0;
    backend *be = on_dev ? fake_dev(&err) : bk_cpu_create(1);
    tp_dev_comm *dev = NULL;
    model_comm mc;
    model *m = NULL;
    int rc = 1;
    model_load_opts o = {.block_size = EG_BS, .n_blocks = NBLK, .tp = &mc};
    if (!be || tp_dev_comm_open(c, be, on_dev ? tp_fake_dev_comm() : TP_COMM_AUTO, &dev, &mc, &err) < 0 ||
        model_load(argv[3], be, &o, &m, &err) < 0)
        comm_abort(c, err.msg[0] ? err.msg : "no backend");
    else if (tp_worker_run_dev(c, m, dev, NULL, NULL, &err) == 0)
        rc = 0;
    rc = tp_fake_worker_verdict(rc, err.msg, w.rank, on_dev, fake_violations);
    model_destroy(m);
    tp_dev_comm_close(dev);
    if (be) on_dev ? bk_cuda_destroy(be) : bk_cpu_destroy(be);
    comm_destroy(c);
    return rc;
}

static const char *g_self;

static int grp_open(grp *g, const char *path, int N, const char *kind, specd_err *err) {
    memset(g, 0, sizeof *g);
    g->on_dev = strcmp(kind, "cpu") != 0;
    const char *argv[] = {g_self, "--tp-worker", kind, path, NULL};
    ranks_config rc = {.world = N, .worker_argv = argv, .comm = comm_config_default(), .attach_timeout_ms = 60000};
    if (ranks_launch(&rc, &g->rk, err) < 0) return -1;
    g->be = g->on_dev ? fake_dev(err) : bk_cpu_create(1);
    if (!g->be ||
        tp_dev_comm_open(ranks_comm(g->rk), g->be, g->on_dev ? tp_fake_dev_comm() : TP_COMM_AUTO, &g->dev, &g->mc, err) < 0)
        return -1;
    model_load_opts o = {.block_size = EG_BS, .n_blocks = NBLK, .tp = &g->mc};
    if (model_load(path, g->be, &o, &g->m, err) < 0) return -1;
    g->tr = (tp_runner){g->m, ranks_comm(g->rk), g->dev};
    return 0;
}

static int grp_close(grp *g, specd_err *err) {
    return tp_fake_group_close(g->rk, g->dev, g->m, g->be, g->on_dev, err);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--tp-worker")) return worker_main(argc, argv);
    g_self = argv[0];
    const char *mini = getenv("MODEL_HF_MINI_DIR");
    if (!mini) {
        printf("SKIP: MODEL_HF_MINI_DIR not set\n");
        return 77;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/f32", mini);
    specd_err err = {{0}};
    grp gc, gd;
    if (grp_open(&gc, path, 2, "cpu", &err) < 0 || grp_open(&gd, path, 2, "fake", &err) < 0) {
        printf("FAIL: opening the TP 2 groups: %s\n", err.msg);
        return 1;
    }
    model_shard_info si;
    model_get_shard(gd.m, &si);
    EG_EXPECT(si.size == 2 && si.vocab_rows == 256, "the LM head split by vocabulary (%d rows of 512)", si.vocab_rows);
    eg_route(0, gc.m, tp_runner_forward, &gc.tr);
    eg_route(1, gd.m, tp_runner_forward, &gd.tr);
    eg_check_bytes = tp_fake_dev_comm() == TP_COMM_CUDA_IPC;
    printf("TP 2, vocabulary-split LM head, device collectives %s%s\n", tp_comm_kind_name(tp_fake_dev_comm()),
           eg_check_bytes ? " (device -> host bytes checked per step)" : "");
    eg_scenarios(gc.m, gd.m, gd.be);
    EG_EXPECT(fake_violations == 0, "%d host pointers reached device ops", fake_violations);
    EG_EXPECT(grp_close(&gc, &err) == 0, "CPU group shutdown: %s", err.msg);
    EG_EXPECT(grp_close(&gd, &err) == 0, "device group shutdown (a worker failed or saw a host pointer): %s", err.msg);
    printf("%s\n", eg_fail ? "FAILED" : "OK");
    return eg_fail ? 1 : 0;
}
