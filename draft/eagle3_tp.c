/*
 * eagle3_tp.c: the EAGLE-3 head at tensor parallelism (eagle3_tp.h): its
 * slicing, rank 0's posts and the workers' side.
 *
 * Draft messages on the comm step channel (native int32 words; the first word
 * negative tells them from a target step, tp.h):
 *   LAYER   [-2, n, n_seqs, tokens[n], pos[n], seq_of[n], per sequence: its
 *            block count then the block ids]; then g [n, H] f32 by broadcast
 *   LOGITS  [-3, n]; then hid [n, H] f32 by broadcast (only with a
 *            vocabulary-split LM head: otherwise rank 0 alone computes them)
 * Device tensor parallelism (eagle3_tp_load, mirror mode) posts none of these:
 * every rank runs the proposer itself (eagle3_tp_prop.c), so only the
 * collectives inside the forward cross ranks, on device memory.
 * Threading: see eagle3_tp.h.
 */
#include "draft/eagle3_tp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "draft/eagle3_internal.h"
#include "engine/runtime/tp.h"
#include "engine/util/log.h"

enum { E3TP_LAYER = -2, E3TP_LOGITS = -3 };

struct eagle3_tp {
    comm *c;
    const model_comm *mc;
    int rank, size;
    bool vocab_split;       /* lm_head rows split: logits all-gathered */
    bool mirror;            /* device TP: every rank runs the proposer (nothing posted; eagle3_tp_load) */
    int32_t vl;             /* lm_head rows held */
};

/* ------------------------------------------------------------ slicing */


static void rows_view(bk_weight *w, int64_t r0, int64_t n) {
    w->data = (const uint8_t *)w->data + (size_t)r0 * w->row_bytes;
    w->rows = n;
}

static int cols_copy(eagle3_head *h, bk_weight *w, int64_t c0, int64_t n) {
    const size_t off = bk_row_span(w->type, c0), len = bk_row_span(w->type, n);
    if ((c0 && !off) || !len) return -1;
    uint8_t *d = head_own(h, len * (size_t)w->rows);
    if (!d) return -1;
    for (int64_t r = 0; r < w->rows; r++)
        memcpy(d + (size_t)r * len, (const uint8_t *)w->data + (size_t)r * w->row_bytes + off, len);
    w->data = d;
    w->row_bytes = len;
    w->cols = n;
    return 0;
}

int eagle3_tp_splits(const eagle3_config *cf, int N, bool q8_0, char *why, size_t why_len) {
    if (N <= 1) return 0;
    if (cf->n_heads % N || (cf->n_kv_heads % N && N % cf->n_kv_heads) || cf->ffn % N) {
        snprintf(why, why_len, "%d heads / %d KV heads / MLP %d do not divide by %d", cf->n_heads, cf->n_kv_heads,
                 cf->ffn, N);
        return 0;
    }
    /* the row-parallel inputs must be cut on whole blocks (Q8_0 after --draft-quantization: 32 values) */
    const int nhd = cf->n_heads / N * cf->head_dim, ffl = cf->ffn / N;
    if (q8_0 && (nhd % 32 || ffl % 32)) {
        snprintf(why, why_len, "o_proj / down_proj slices of %d / %d inputs would cut a 32-value block", nhd, ffl);
        return 0;
    }
    return 1;
}

/* Cuts h to rank r of N (host views: before placement on a device). mirror: every rank runs the proposer
 * itself (device TP, eagle3_tp_load): nothing is posted, and a vocabulary that does not divide is scored
 * whole on every rank instead of on rank 0 alone. */
static int shard(eagle3_head *h, comm *c, const model_comm *mc, bool mirror, char *why, size_t why_len,
                 specd_err *err) {
    const eagle3_config *cf = &h->cfg;
    const int N = comm_world(c), r = comm_rank(c), hd = cf->head_dim;
    const bool q8 = h->wo.type == BK_W_Q8_0 || h->wdown.type == BK_W_Q8_0;
    if (!eagle3_tp_splits(cf, N, q8, why, why_len)) return 0;
    const int64_t Vs = h->lm_head.rows;
    const int nhl = cf->n_heads / N, nkvl = cf->n_kv_heads % N == 0 ? cf->n_kv_heads / N : 1;
    const int kv0 = cf->n_kv_heads % N == 0 ? r * nkvl : r / (N / cf->n_kv_heads);
    if ((r && !bk_row_span(h->wo.type, (int64_t)r * nhl * hd)) || !bk_row_span(h->wo.type, (int64_t)nhl * hd) ||
        !bk_row_span(h->wdown.type, (int64_t)cf->ffn / N) || (r && !bk_row_span(h->wdown.type, (int64_t)r * (cf->ffn / N)))) {
        snprintf(why, why_len, "o_proj / down_proj slices of %d / %d inputs would cut a block of their format",
                 nhl * hd, cf->ffn / N);
        return 0;
    }
    struct eagle3_tp *t = head_own(h, sizeof *t);
    if (!t) return specd_err_set(err, "out of memory");
    t->c = c;
    t->mc = mc;
    t->rank = r;
    t->size = N;
    t->mirror = mirror;
    t->vocab_split = Vs % N == 0;
    t->vl = t->vocab_split ? (int32_t)(Vs / N) : (int32_t)Vs;
    rows_view(&h->wq, (int64_t)r * nhl * hd, (int64_t)nhl * hd);
    rows_view(&h->wk, (int64_t)kv0 * hd, (int64_t)nkvl * hd);
    rows_view(&h->wv, (int64_t)kv0 * hd, (int64_t)nkvl * hd);
    if (h->bq) h->bq += (size_t)r * nhl * hd;
    if (h->bk) h->bk += (size_t)kv0 * hd;
    if (h->bv) h->bv += (size_t)kv0 * hd;
    rows_view(&h->wgate, (int64_t)r * (cf->ffn / N), cf->ffn / N);
    rows_view(&h->wup, (int64_t)r * (cf->ffn / N), cf->ffn / N);
    if (cols_copy(h, &h->wo, (int64_t)r * nhl * hd, (int64_t)nhl * hd) < 0 ||
        cols_copy(h, &h->wdown, (int64_t)r * (cf->ffn / N), cf->ffn / N) < 0)
        return specd_err_set(err, "out of memory slicing the draft head");
    if (t->vocab_split) rows_view(&h->lm_head, (int64_t)r * t->vl, t->vl);
    h->nh_l = nhl;
    h->nkv_l = nkvl;
    h->ffn_l = cf->ffn / N;
    h->tp = t;
    LOG_INFO("eagle3 head, tensor parallel rank %d/%d: %d of %d heads, KV head(s) %d..%d, MLP %d of %d, lm_head %s",
             r, N, nhl, cf->n_heads, kv0, kv0 + nkvl - 1, h->ffn_l, cf->ffn,
             t->vocab_split ? "split by draft vocabulary" : mirror ? "whole on every rank" : "whole on rank 0");
    return 1;
}

int eagle3_head_tp_shard(eagle3_head *h, comm *c, const model_comm *mc, char *why, size_t why_len, specd_err *err) {
    if (comm_world(c) <= 1) return 0;
    return shard(h, c, mc, false, why, why_len, err);
}

int eagle3_head_tp_shard_mirror(eagle3_head *h, comm *c, const model_comm *mc, specd_err *err) {
    char why[160] = "";
    const int rc = shard(h, c, mc, true, why, sizeof why, err);
    if (rc == 0) return specd_err_set(err, "the head does not split across %d ranks: %s", comm_world(c), why);
    return rc < 0 ? -1 : 0;
}

/* ------------------------------------------------------------ rank 0: posts */

/* Posts MSG (words) then broadcasts n_floats from X; a failure aborts the group. */
static int post(eagle3_head *h, const int32_t *msg, size_t words, const float *x, size_t n_floats, specd_err *err) {
    struct eagle3_tp *t = h->tp;
    size_t nb = n_floats * sizeof(float);
    if (comm_step_send(t->c, COMM_STEP_DATA, msg, words * 4, err) < 0 ||
        comm_broadcast(t->c, 0, (void *)(uintptr_t)x, &nb, nb, err) < 0) {
        comm_abort(t->c, err->msg);
        return -1;
    }
    return 0;
}

int eagle3_tp_post_layer(eagle3_head *h, const eagle3_rows *rw, const float *g, specd_err *err) {
    if (!h->tp || h->tp->rank != 0 || h->tp->mirror) return 0;
    const int32_t n = rw->n, S = rw->n_seqs;
    const size_t words = 3 + tp_rows_words(n, rw->pos, rw->seq_of, S, h->block_size);
    if (words * 4 > comm_step_max_bytes(h->tp->c))
        return specd_err_set(err, "tensor parallel: a %d-row draft step does not fit the step channel", n);
    int32_t *m = malloc(words * 4), *p = m;
    if (!m) return specd_err_set(err, "out of memory");
    *p++ = E3TP_LAYER;
    *p++ = n;
    *p++ = S;
    tp_rows_write(p, n, rw->tokens, rw->pos, rw->seq_of, S, rw->block_tables, h->block_size);
    const int rc = post(h, m, words, g, (size_t)n * h->cfg.hidden, err);
    free(m);
    return rc;
}

int eagle3_tp_post_logits(eagle3_head *h, const float *hid, int32_t n, specd_err *err) {
    if (!h->tp || h->tp->rank != 0 || h->tp->mirror || !h->tp->vocab_split) return 0;
    const int32_t m[2] = {E3TP_LOGITS, n};
    return post(h, m, 2, hid, (size_t)n * h->cfg.hidden, err);
}

int eagle3_tp_all_reduce(eagle3_head *h, bk_tensor *x, specd_err *err) {
    if (!h->tp) return 0;
    return h->tp->mc->all_reduce(h->tp->mc->ctx, x, err);
}

bool eagle3_tp_vocab_split(const eagle3_head *h) { return h->tp && h->tp->vocab_split; }
bool eagle3_tp_mirror(const eagle3_head *h) { return h->tp && h->tp->mirror; }

int eagle3_tp_gather_logits_t(eagle3_head *h, const bk_tensor *local, bk_tensor *all, bk_tensor *logits,
                              specd_err *err) {
    struct eagle3_tp *t = h->tp;
    const int64_t n = local->rows, Vl = local->cols;
    if (t->mc->all_gather(t->mc->ctx, local, all, err) < 0) return -1;
    backend *be = h->tgt.be;
    for (int r = 0; r < t->size; r++) { /* rank-major [N, n, Vl] -> [n, N * Vl]: rank r's rows at columns r Vl */
        const bk_tensor src = bk_rows(*all, (int64_t)r * n, n);
        if (be->ops->copy_cols(be->ctx, logits, (int64_t)r * Vl, &src) < 0)
            return specd_err_set(err, "draft logits: interleaving rank %d's columns failed", r);
    }
    return 0;
}
int eagle3_tp_size(const eagle3_head *h) { return h->tp ? h->tp->size : 1; }
comm *eagle3_tp_comm(const eagle3_head *h) { return h && h->tp ? h->tp->c : NULL; }

int eagle3_tp_gather_logits(eagle3_head *h, const float *local, int32_t n, float *logits, specd_err *err) {
    struct eagle3_tp *t = h->tp;
    if (!t || !t->vocab_split) return 0;
    const int32_t Vl = t->vl, N = t->size;
    float *all = malloc(sizeof(float) * (size_t)N * n * Vl);
    if (!all) return specd_err_set(err, "out of memory");
    bk_tensor in = bk_wrap_f32((float *)(uintptr_t)local, n, Vl), out = bk_wrap_f32(all, (int64_t)N * n, Vl);
    if (t->mc->all_gather(t->mc->ctx, &in, &out, err) < 0) {
        free(all);
        return -1;
    }
    if (logits) /* rank-major [N, n, Vl] -> [n, N * Vl] */
        for (int32_t i = 0; i < n; i++)
            for (int32_t r = 0; r < N; r++)
                memcpy(logits + ((size_t)i * N + r) * Vl, all + ((size_t)r * n + i) * Vl, sizeof(float) * Vl);
    free(all);
    return 0;
}

/* ------------------------------------------------------------ workers */

static float *recv_floats(eagle3_head *h, size_t n_floats, specd_err *err) {
    float *x = malloc(sizeof(float) * (n_floats ? n_floats : 1));
    size_t nb = 0;
    if (!x) {
        specd_err_set(err, "out of memory");
        return NULL;
    }
    if (comm_broadcast(h->tp->c, 0, x, &nb, n_floats * sizeof(float), err) < 0 || nb != n_floats * sizeof(float)) {
        if (!err->msg[0]) specd_err_set(err, "draft broadcast of %zu bytes, expected %zu", nb, n_floats * sizeof(float));
        free(x);
        return NULL;
    }
    return x;
}

int eagle3_tp_serve(eagle3_head *h, const int32_t *msg, size_t n, specd_err *err) {
    if (!h || !h->tp) return specd_err_set(err, "draft message but no tensor-parallel draft head on this rank");
    const int32_t *p = msg, *end = msg + n / 4;
    const int32_t H = h->cfg.hidden;
    if (n < 8) return specd_err_set(err, "short draft message");
    if (p[0] == E3TP_LOGITS) {
        const int32_t rows = p[1];
        if (rows <= 0 || !h->tp->vocab_split) return specd_err_set(err, "bad draft logits message");
        float *hid = recv_floats(h, (size_t)rows * H, err), *lg = NULL;
        const int rc = hid ? eagle3_logits(h, hid, rows, lg, err) : -1; /* NULL: the gathered rows are rank 0's */
        free(hid);
        return rc;
    }
    if (p[0] != E3TP_LAYER || n < 12) return specd_err_set(err, "unknown draft message %d", p[0]);
    const int32_t rows = p[1], S = p[2];
    eagle3_rows rw = {.n = rows, .n_seqs = S};
    const int32_t **tb = S > 0 ? malloc(sizeof *tb * (size_t)S) : NULL;
    int rc = -1;
    float *g = NULL, *out = NULL;
    if (!tb) { specd_err_set(err, S > 0 ? "out of memory" : "malformed draft message"); goto done; }
    if (!tp_rows_read(p + 3, end, rows, S, h->n_blocks, h->block_size, &rw.tokens, &rw.pos, &rw.seq_of, tb, err))
        goto done;
    rw.block_tables = tb;
    g = recv_floats(h, (size_t)rows * H, err);
    out = malloc(sizeof(float) * (size_t)rows * H);
    if (!g || !out) { if (g) specd_err_set(err, "out of memory"); goto done; }
    rc = eagle3_layer(h, &rw, g, out, err);
done:
    free(tb);
    free(g);
    free(out);
    return rc;
}
