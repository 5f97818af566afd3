/*
 * eagle3_tp_prop.c: the EAGLE-3 proposer at tensor parallelism on GPUs
 * (eagle3_tp.h eagle3_tp_load): every rank runs the WHOLE proposer (the
 * per-sequence windows, the draft KV block tables, the device feature pool,
 * the chain) on its shard of the head, fed the same calls in the same order;
 * rank 0 mirrors each proposer call the engine makes to the workers on the
 * comm step channel before running it itself.
 *
 * Why mirror the calls rather than post each forward call's inputs (what the
 * CPU split does, eagle3_tp.c): the inputs are the target's aux features and
 * the chain's hidden rows, which live in device memory. The target's
 * residual stream is replicated on every rank after each all-reduce (the
 * same bits: fixed-order f32 sums), so each rank's forward captures the same
 * aux rows into its own fixed aux buffer (tp.c: the step says which layers);
 * fc is replicated; the layer's output is replicated after its two
 * all-reduces; the draft logits after the LM head's all-gather (or a whole
 * LM head on every rank), so the argmax + d2t ids are too. The proposer's
 * host logic is deterministic (block and chunk allocation, windows, the
 * sequences' RNGs seeded alike), so every rank holds the same state, calls
 * the same collectives in the same order, and nothing but those collectives
 * crosses ranks: no feature, hidden or logits row goes through the host.
 *
 * Messages (native int32 words; the first word negative: tp_worker_run hands
 * them to the worker's handler; ids and seeds as two words, low first):
 *   EXTEND       [-4, id, id, n, pos0, has_aux, tokens[n]]; then, with
 *                has_aux, the host rows aux [n, featw] f32 by broadcast
 *   EXTEND_ROWS  [-5, id, id, n, pos0, row0, tokens[n]]
 *   PROPOSE      [-6, n, k_max, flags (1 temps, 2 q wanted), ids[2n], k[n],
 *                temps[n] (f32 bits)]
 *   TRUNCATE     [-7, id, id, n_ctx, 0]   SEED [-8, id, id, seed, seed]
 *   FREE         [-9, id, id, 0, 0]
 * Failures: a post that fails aborts the group (the ranks would no longer
 * hold the same state). On a worker a failing extend is logged and not fatal
 * (rank 0's identical state failed identically: a full feature pool is a
 * condition the engine recovers from); a failing propose or a malformed
 * message is fatal (the group aborts with the reason).
 * Threading: rank 0: the engine thread; a worker: its main thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "draft/eagle3.h"
#include "draft/eagle3_internal.h"
#include "draft/eagle3_tp.h"
#include "engine/util/log.h"

enum { E3P_EXTEND = -4, E3P_EXTEND_ROWS = -5, E3P_PROPOSE = -6, E3P_TRUNCATE = -7, E3P_SEED = -8, E3P_FREE = -9 };

/* ------------------------------------------------------------ rank 0: posts */

static int post(comm *c, const int32_t *msg, size_t words, const float *x, size_t n_floats, specd_err *err) {
    size_t nb = n_floats * sizeof(float);
    if (comm_step_send(c, COMM_STEP_DATA, msg, words * 4, err) < 0 ||
        (x && comm_broadcast(c, 0, (void *)(uintptr_t)x, &nb, nb, err) < 0)) {
        char why[COMM_REASON_MAX];
        snprintf(why, sizeof why, "draft mirror: %.200s", err->msg);
        comm_abort(c, why);
        return -1;
    }
    return 0;
}

static int32_t *msg_new(size_t words, specd_err *err) {
    int32_t *m = malloc(words * 4);
    if (!m) specd_err_set(err, "out of memory");
    return m;
}

int e3m_post_extend(comm *c, int64_t id, const int32_t *tokens, int32_t n, int32_t pos0, const float *aux,
                    int32_t featw, bool rows, int32_t row0, specd_err *err) {
    const size_t words = 6 + (size_t)n;
    if (words * 4 > comm_step_max_bytes(c))
        return specd_err_set(err, "draft mirror: an extend of %d tokens does not fit the step channel", n);
    int32_t *m = msg_new(words, err);
    if (!m) return -1;
    m[0] = rows ? E3P_EXTEND_ROWS : E3P_EXTEND;
    m[1] = (int32_t)(uint32_t)id, m[2] = (int32_t)(uint32_t)((uint64_t)id >> 32);
    m[3] = n, m[4] = pos0, m[5] = rows ? row0 : aux != NULL;
    memcpy(m + 6, tokens, 4 * (size_t)n);
    const int rc = post(c, m, words, rows ? NULL : aux, aux && !rows ? (size_t)n * (size_t)featw : 0, err);
    free(m);
    return rc;
}

int e3m_post_propose(comm *c, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                     bool want_q, specd_err *err) {
    const size_t words = 4 + 4 * (size_t)(n > 0 ? n : 0);
    if (words * 4 > comm_step_max_bytes(c))
        return specd_err_set(err, "draft mirror: a propose of %d sequences does not fit the step channel", n);
    int32_t *m = msg_new(words, err);
    if (!m) return -1;
    m[0] = E3P_PROPOSE, m[1] = n, m[2] = k_max, m[3] = (temps ? 1 : 0) | (want_q ? 2 : 0);
    for (int32_t i = 0; i < n; i++) {
        m[4 + 2 * i] = (int32_t)(uint32_t)ids[i];
        m[5 + 2 * i] = (int32_t)(uint32_t)((uint64_t)ids[i] >> 32);
        m[4 + 2 * (size_t)n + i] = k[i];
        float t = temps ? temps[i] : 0.0f;
        memcpy(&m[4 + 3 * (size_t)n + i], &t, 4);
    }
    const int rc = post(c, m, words, NULL, 0, err);
    free(m);
    return rc;
}

void e3m_post_seq(comm *c, int kind, int64_t id, uint64_t arg) {
    const int32_t code = kind == 0 ? E3P_TRUNCATE : kind == 1 ? E3P_SEED : E3P_FREE;
    const int32_t m[5] = {code, (int32_t)(uint32_t)id, (int32_t)(uint32_t)((uint64_t)id >> 32), (int32_t)(uint32_t)arg,
                          (int32_t)(uint32_t)(arg >> 32)};
    specd_err err = {{0}};
    if (post(c, m, 5, NULL, 0, &err) < 0) LOG_ERROR("eagle3 tensor parallel: %s", err.msg);
}

/* ------------------------------------------------------------ workers */

static int64_t id_of(const int32_t *p) { return (int64_t)(((uint64_t)(uint32_t)p[1] << 32) | (uint32_t)p[0]); }

int eagle3_tp_serve_proposer(spec_proposer *p, const model *target, const int32_t *msg, size_t n, specd_err *err) {
    const int32_t *end = msg + n / 4;
    const int32_t Vt = model_get_config(target)->vocab, Ht = model_get_config(target)->hidden;
    if (!p) return specd_err_set(err, "draft mirror message but no proposer on this rank");
    if (n < 12) return specd_err_set(err, "draft mirror: short message");
    const spec_proposer_ops *op = p->ops;
    switch (msg[0]) {
    case E3P_EXTEND:
    case E3P_EXTEND_ROWS: {
        const int32_t cnt = msg[3], pos0 = msg[4], arg = msg[5];
        if (n < 24 || cnt <= 0 || end - (msg + 6) < cnt) return specd_err_set(err, "draft mirror: malformed extend");
        int rc;
        if (msg[0] == E3P_EXTEND_ROWS) {
            rc = op->extend_rows(p->ctx, id_of(msg + 1), msg + 6, cnt, pos0, arg, err);
        } else {
            float *aux = NULL;
            if (arg) { /* rank 0's host rows, broadcast after the message */
                int32_t layers[8];
                const size_t nf = (size_t)cnt * (size_t)op->aux_layers(p->ctx, layers) * (size_t)Ht;
                size_t nb = 0;
                comm *c = eagle3_tp_comm(eagle3_proposer_head(p));
                if (!(aux = malloc(nf * sizeof(float) + 1))) return specd_err_set(err, "out of memory");
                if (!c || comm_broadcast(c, 0, aux, &nb, nf * sizeof(float), err) < 0 || nb != nf * sizeof(float)) {
                    if (!err->msg[0]) specd_err_set(err, "draft mirror: aux broadcast of %zu bytes, expected %zu", nb,
                                                    nf * sizeof(float));
                    free(aux);
                    return -1;
                }
            }
            rc = op->extend(p->ctx, id_of(msg + 1), msg + 6, cnt, pos0, aux, err);
            free(aux);
        }
        if (rc < 0) LOG_WARN("eagle3 tensor parallel worker: extend failed as on rank 0: %s", err->msg);
        return 0;
    }
    case E3P_PROPOSE: {
        const int32_t cnt = msg[1], k_max = msg[2], fl = msg[3];
        if (cnt < 0 || k_max < 0 || k_max > 64 || end - (msg + 4) < 4 * (ptrdiff_t)cnt)
            return specd_err_set(err, "draft mirror: malformed propose");
        int64_t *ids = malloc(sizeof(int64_t) * (size_t)(cnt ? cnt : 1));
        float *temps = malloc(sizeof(float) * (size_t)(cnt ? cnt : 1));
        int32_t *toks = malloc(sizeof(int32_t) * (size_t)(cnt ? cnt : 1) * (size_t)(k_max ? k_max : 1));
        float *q = (fl & 2) ? malloc(sizeof(float) * (size_t)(cnt ? cnt : 1) * (size_t)(k_max ? k_max : 1) * (size_t)Vt)
                            : NULL;
        int rc = -1;
        if (!ids || !temps || !toks || ((fl & 2) && !q)) {
            specd_err_set(err, "out of memory");
        } else {
            for (int32_t i = 0; i < cnt; i++) {
                ids[i] = id_of(msg + 4 + 2 * i);
                memcpy(&temps[i], &msg[4 + 3 * (size_t)cnt + i], 4);
            }
            rc = op->propose(p->ctx, ids, msg + 4 + 2 * (size_t)cnt, cnt, k_max, (fl & 1) ? temps : NULL, toks, q, err);
        }
        free(ids), free(temps), free(toks), free(q);
        return rc;
    }
    case E3P_TRUNCATE:
    case E3P_SEED:
    case E3P_FREE: /* always 5 words (e3m_post_seq) */
        if (n < 20) return specd_err_set(err, "draft mirror: malformed sequence message %d", msg[0]);
        if (msg[0] == E3P_TRUNCATE) op->truncate(p->ctx, id_of(msg + 1), msg[3]);
        else if (msg[0] == E3P_SEED) op->seed_seq(p->ctx, id_of(msg + 1), (uint64_t)id_of(msg + 3));
        else op->free_seq(p->ctx, id_of(msg + 1));
        return 0;
    default:
        return specd_err_set(err, "draft mirror: unknown message %d", msg[0]);
    }
}

/* ------------------------------------------------------------ loading */

int eagle3_tp_load(const char *dir, model *target, const eagle3_opts *o, comm *c, const model_comm *mc,
                   spec_proposer **out, char *why, size_t why_len, specd_err *err) {
    *out = NULL;
    const int N = comm_world(c), rank = comm_rank(c);
    eagle3_config cf;
    int split = 0, rc = eagle3_config_load(dir, &cf, err);
    if (rc == 0) split = eagle3_tp_splits(&cf, N, o && o->q8_0, why, why_len);
    if (rc == 0 && (split || rank == 0)) { /* whole: rank 0 alone holds the head */
        eagle3_opts eo = {0};
        if (o) eo = *o;
        if (split) eo.tp_comm = c, eo.tp_mc = mc;
        rc = eagle3_load(dir, target, &eo, out, err);
    }
    if (rc < 0) { /* the group's reason ("rank R: draft head: ..."): every other rank fails below with it */
        char r[COMM_REASON_MAX];
        snprintf(r, sizeof r, "draft head: %.200s", err->msg);
        comm_abort(c, r);
        return -1;
    }
    /* every rank placed its part (ranks load at different speeds: no per-call timeout; a dead rank is still
     * caught by rank 0's monitor) */
    const int32_t mine = 1;
    int32_t all[COMM_MAX_WORLD];
    comm_set_timeout_ms(c, 0);
    rc = comm_all_gather(c, &mine, sizeof mine, all, err);
    comm_set_timeout_ms(c, comm_config_default().timeout_ms);
    if (rc < 0) {
        eagle3_destroy(*out);
        *out = NULL;
        return specd_err_wrap(err, "draft head at tensor parallel size %d", N);
    }
    if (split && rank == 0) eagle3_proposer_mirror(*out, c);
    return split;
}
