/*
 * tp.c: tensor-parallel serving (tp.h): the step message, the worker loop,
 * the shm model_comm adapter and the device collectives (host-staged shm,
 * cuda_ipc, nccl) behind a model_comm. The layout of the message is tp.h's.
 * Threading: see tp.h.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/runtime/tp.h"
#include "engine/backend/cuda_backend.h"
#include "engine/comm/comm_cuda_ipc.h"
#include "engine/comm/comm_nccl.h"
#include "engine/util/log.h"

enum { TP_WANT_LOGITS = 1, TP_TREE = 2, TP_AUX_DEV = 4 };
#define TP_GRAPH_SHIFT 8 /* flags word bits 8..30: rank 0's graph pick + 1 (0: eager) */
#define TP_HDR 5 /* int32 header words */

/* ------------------------------------------------------------ model_comm over shm */

/* An all-gather's output must hold world x the input's bytes (every implementation writes that much). */
static int gather_fits(const bk_tensor *in, const bk_tensor *out, int world, specd_err *err) {
    const size_t all = bk_nbytes(in) * (size_t)world;
    if (bk_nbytes(out) < all)
        return specd_err_set(err, "tensor parallel: all-gather output of %zu bytes < %zu (%d ranks x %zu)",
                             bk_nbytes(out), all, world, bk_nbytes(in));
    return 0;
}

static int shm_all_reduce(void *ctx, bk_tensor *x, specd_err *err) {
    return comm_all_reduce_sum_f32((comm *)ctx, bk_f32(x), (size_t)x->rows * (size_t)x->cols, err);
}
static int shm_all_gather(void *ctx, const bk_tensor *in, bk_tensor *out, specd_err *err) {
    if (gather_fits(in, out, comm_world((comm *)ctx), err) < 0) return -1;
    return comm_all_gather((comm *)ctx, in->data, bk_nbytes(in), out->data, err);
}

void tp_model_comm_shm(comm *c, model_comm *out) {
    out->rank = comm_rank(c);
    out->size = comm_world(c);
    out->all_reduce = shm_all_reduce;
    out->all_gather = shm_all_gather;
    out->ctx = c;
}

/* ------------------------------------------------------------ collectives on device memory (tp.h) */

struct tp_dev_comm {
    tp_comm_kind kind;
    comm *c;              /* the host group (bootstrap, staging, failure propagation) */
    backend *be;
    void *stream;         /* the backend's stream: every device collective is ordered with its ops */
    comm_cuda_ipc *ipc;
    comm_nccl *nccl;
    float *host;          /* shm staging: grow-only host copy of the tensor being reduced / gathered */
    size_t host_cap;      /* bytes */
    size_t staged_d2h;    /* shm staging: bytes downloaded so far, and in how many downloads */
    size_t staged_n;
};

int tp_comm_kind_parse(const char *s, tp_comm_kind *out, specd_err *err) {
    static const char *names[] = {"auto", "shm", "cuda_ipc", "nccl"};
    if (!s) s = "auto";
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, names[i])) {
            *out = (tp_comm_kind)i;
            return 0;
        }
    return specd_err_set(err, "--tp-comm %s: must be one of auto, shm, cuda_ipc, nccl", s);
}

const char *tp_comm_kind_name(tp_comm_kind k) {
    return k == TP_COMM_SHM ? "shm" : k == TP_COMM_CUDA_IPC ? "cuda_ipc" : k == TP_COMM_NCCL ? "nccl" : "auto";
}

tp_comm_kind tp_comm_kind_resolve(tp_comm_kind k, bool host_visible, int world) {
    if (k != TP_COMM_AUTO) return k;
    if (host_visible) return TP_COMM_SHM;
    return world <= COMM_CUDA_IPC_MAX_WORLD ? TP_COMM_CUDA_IPC : TP_COMM_NCCL;
}

static float *dev_stage(tp_dev_comm *d, size_t bytes, specd_err *err) {
    if (bytes > d->host_cap) {
        float *p = realloc(d->host, bytes);
        if (!p) {
            specd_err_set(err, "out of memory staging %zu bytes of a collective", bytes);
            return NULL;
        }
        d->host = p;
        d->host_cap = bytes;
    }
    return d->host;
}

/* shm over host staging: download (waits for the stream), host collective, upload (queued on the stream). */
static int staged_all_reduce(void *ctx, bk_tensor *x, specd_err *err) {
    tp_dev_comm *d = ctx;
    const size_t n = (size_t)x->rows * (size_t)x->cols, bytes = n * sizeof(float);
    float *h = dev_stage(d, bytes, err);
    if (!h) return -1;
    if (d->be->ops->download(d->be->ctx, h, x->data, bytes) < 0)
        return specd_err_set(err, "tensor parallel: downloading %zu bytes for the all-reduce", bytes);
    d->staged_d2h += bytes, d->staged_n++;
    if (comm_all_reduce_sum_f32(d->c, h, n, err) < 0) return -1;
    if (d->be->ops->upload(d->be->ctx, x->data, h, bytes) < 0)
        return specd_err_set(err, "tensor parallel: uploading the all-reduce's %zu bytes", bytes);
    return 0;
}
static int staged_all_gather(void *ctx, const bk_tensor *in, bk_tensor *out, specd_err *err) {
    tp_dev_comm *d = ctx;
    const size_t b = bk_nbytes(in), all = b * (size_t)comm_world(d->c);
    if (gather_fits(in, out, comm_world(d->c), err) < 0) return -1;
    float *h = dev_stage(d, b + all, err);
    if (!h) return -1;
    char *mine = (char *)h, *gathered = (char *)h + b;
    if (d->be->ops->download(d->be->ctx, mine, in->data, b) < 0)
        return specd_err_set(err, "tensor parallel: downloading %zu bytes for the all-gather", b);
    d->staged_d2h += b, d->staged_n++;
    if (comm_all_gather(d->c, mine, b, gathered, err) < 0) return -1;
    if (d->be->ops->upload(d->be->ctx, out->data, gathered, all) < 0)
        return specd_err_set(err, "tensor parallel: uploading the all-gather's %zu bytes", all);
    return 0;
}

static int ipc_all_reduce(void *ctx, bk_tensor *x, specd_err *err) {
    tp_dev_comm *d = ctx;
    return comm_cuda_ipc_all_reduce_sum_f32(d->ipc, bk_f32(x), bk_f32(x), (size_t)x->rows * (size_t)x->cols, d->stream,
                                            err);
}
static int ipc_all_gather(void *ctx, const bk_tensor *in, bk_tensor *out, specd_err *err) {
    tp_dev_comm *d = ctx;
    if (gather_fits(in, out, comm_world(d->c), err) < 0) return -1;
    return comm_cuda_ipc_all_gather(d->ipc, in->data, out->data, bk_nbytes(in), d->stream, err);
}
static int nccl_all_reduce(void *ctx, bk_tensor *x, specd_err *err) {
    tp_dev_comm *d = ctx;
    return comm_nccl_all_reduce_sum(d->nccl, x->data, x->data, (size_t)x->rows * (size_t)x->cols, COMM_NCCL_F32,
                                    d->stream, err);
}
static int nccl_all_gather(void *ctx, const bk_tensor *in, bk_tensor *out, specd_err *err) {
    tp_dev_comm *d = ctx;
    if (gather_fits(in, out, comm_world(d->c), err) < 0) return -1;
    return comm_nccl_all_gather(d->nccl, in->data, out->data, (size_t)in->rows * (size_t)in->cols, COMM_NCCL_F32,
                                d->stream, err);
}

int tp_dev_comm_open(comm *c, backend *be, tp_comm_kind kind, tp_dev_comm **out, model_comm *mc, specd_err *err) {
    *out = NULL;
    const int world = comm_world(c);
    kind = tp_comm_kind_resolve(kind, be->host_visible, world);
    if (be->host_visible) {
        if (kind != TP_COMM_SHM)
            return specd_err_set(err, "--tp-comm %s needs a GPU backend (the %s backend's tensors are host memory: "
                                      "use shm)", tp_comm_kind_name(kind), be->name);
        tp_model_comm_shm(c, mc);
        return 0;
    }
    tp_dev_comm *d = calloc(1, sizeof *d);
    if (!d) return specd_err_set(err, "out of memory");
    d->kind = kind;
    d->c = c;
    d->be = be;
    d->stream = bk_cuda_stream(be);
    mc->rank = comm_rank(c);
    mc->size = world;
    mc->ctx = d;
    if (kind == TP_COMM_SHM) {
        mc->all_reduce = staged_all_reduce;
        mc->all_gather = staged_all_gather;
    } else if (kind == TP_COMM_CUDA_IPC) {
        if (world > COMM_CUDA_IPC_MAX_WORLD) {
            free(d);
            return specd_err_set(err, "--tp-comm cuda_ipc: at most %d ranks (use nccl)", COMM_CUDA_IPC_MAX_WORLD);
        }
        comm_cuda_ipc_config ic = {.device = bk_cuda_device(be)};
        if (comm_cuda_ipc_create(c, &ic, &d->ipc, err) < 0) {
            free(d);
            return specd_err_wrap(err, "--tp-comm cuda_ipc on device %d", ic.device);
        }
        mc->all_reduce = ipc_all_reduce;
        mc->all_gather = ipc_all_gather;
        mc->graphs = true; /* kernels on the stream; generations counted on the device (kn_allreduce.cu) */
    } else {
        /* tests on one GPU only (GPU-NOTES section 1): NCCL < 2.30 refuses two ranks of one GPU; a distinct
         * NCCL_HOSTID per rank process makes it see two hosts and talk sockets over loopback (function, not speed) */
        const char *per = getenv("SPECD_TP_NCCL_HOSTID_PER_RANK");
        if (per && !strcmp(per, "1")) {
            char id[64];
            snprintf(id, sizeof id, "specd-tp-rank%d", comm_rank(c));
            setenv("NCCL_HOSTID", id, 1);
            setenv("NCCL_SOCKET_IFNAME", "lo", 0);
            setenv("NCCL_IB_DISABLE", "1", 0);
        }
        if (comm_nccl_create(c, 0, &d->nccl, err) < 0) {
            free(d);
            return specd_err_wrap(err, "--tp-comm nccl on device %d", bk_cuda_device(be));
        }
        mc->all_reduce = nccl_all_reduce;
        mc->all_gather = nccl_all_gather;
        mc->graphs = true; /* NCCL collectives are capturable on the stream */
    }
    *out = d;
    return 0;
}

int tp_dev_comm_sync(tp_dev_comm *d, specd_err *err) {
    if (!d) return 0;
    if (d->ipc) return comm_cuda_ipc_sync(d->ipc, d->stream, err);
    if (d->nccl) return comm_nccl_poll(d->nccl, err) < 0 ? -1 : 0;
    return 0;
}

tp_comm_kind tp_dev_comm_kind(const tp_dev_comm *d) { return d ? d->kind : TP_COMM_SHM; }
size_t tp_dev_comm_staged_bytes(const tp_dev_comm *d, size_t *downloads) {
    if (downloads) *downloads = d ? d->staged_n : 0;
    return d ? d->staged_d2h : 0;
}

void tp_dev_comm_abort(tp_dev_comm *d, const char *why) {
    if (!d) return;
    if (d->ipc) comm_cuda_ipc_abort(d->ipc, why);
    if (d->nccl) comm_nccl_abort(d->nccl);
}

void tp_dev_comm_close(tp_dev_comm *d) {
    if (!d) return;
    comm_cuda_ipc_destroy(d->ipc);
    comm_nccl_destroy(d->nccl);
    free(d->host);
    free(d);
}

/* ------------------------------------------------------------ the step message */

/* Block-table entries sequence s needs: up to its largest position in the rows. */
static int32_t seq_blocks(int32_t n, const int32_t *pos, const int32_t *seq_of, int32_t s, int32_t bs) {
    int32_t mx = -1;
    for (int32_t i = 0; i < n; i++)
        if (seq_of[i] == s && pos[i] > mx) mx = pos[i];
    return mx < 0 ? 0 : mx / bs + 1;
}

size_t tp_rows_words(int32_t n, const int32_t *pos, const int32_t *seq_of, int32_t S, int32_t bs) {
    size_t w = 3 * (size_t)n + (size_t)S;
    for (int32_t s = 0; s < S; s++) w += (size_t)seq_blocks(n, pos, seq_of, s, bs);
    return w;
}

int32_t *tp_rows_write(int32_t *p, int32_t n, const int32_t *tokens, const int32_t *pos, const int32_t *seq_of,
                       int32_t S, const int32_t *const *tables, int32_t bs) {
    memcpy(p, tokens, 4 * (size_t)n), p += n;
    memcpy(p, pos, 4 * (size_t)n), p += n;
    memcpy(p, seq_of, 4 * (size_t)n), p += n;
    for (int32_t s = 0; s < S; s++) {
        const int32_t nb = seq_blocks(n, pos, seq_of, s, bs);
        *p++ = nb;
        if (nb) memcpy(p, tables[s], 4 * (size_t)nb), p += nb;
    }
    return p;
}

const int32_t *tp_rows_read(const int32_t *p, const int32_t *end, int32_t n, int32_t S, int32_t n_blocks, int32_t bs,
                            const int32_t **tokens, const int32_t **pos, const int32_t **seq_of, const int32_t **tb,
                            specd_err *err) {
    if (n <= 0 || S <= 0 || end - p < 3 * (ptrdiff_t)n + S) {
        specd_err_set(err, "tensor parallel: malformed step message");
        return NULL;
    }
    *tokens = p, *pos = p + n, *seq_of = p + 2 * n;
    p += 3 * n;
    for (int32_t s = 0; s < S; s++) {
        if (p >= end || *p < 0 || end - p - 1 < *p) {
            specd_err_set(err, "tensor parallel: malformed block table");
            return NULL;
        }
        const int32_t nb = *p++;
        for (int32_t i = 0; i < nb; i++)
            if (p[i] < 0 || p[i] >= n_blocks) {
                specd_err_set(err, "tensor parallel: block id %d of sequence %d outside this rank's %d blocks", p[i], s,
                              n_blocks);
                return NULL;
            }
        tb[s] = p;
        p += nb;
    }
    for (int32_t t = 0; t < n; t++) { /* every position inside its sequence's table (its count is the word before it) */
        const int32_t s = (*seq_of)[t], ps = (*pos)[t];
        if (s < 0 || s >= S || ps < 0 || ps / bs >= tb[s][-1]) {
            specd_err_set(err, "tensor parallel: token %d (sequence %d, position %d) outside its block table", t, s, ps);
            return NULL;
        }
    }
    return p;
}

int tp_step_post(comm *c, const model *m, const model_batch *b, specd_err *err) {
    const int32_t T = b->n_tokens, S = b->n_seqs, bs = model_kv_block_size(m);
    const int32_t naux = b->aux || b->aux_on_device ? b->n_aux : 0;
    const size_t words = TP_HDR + tp_rows_words(T, b->pos, b->seq_of, S, bs) + (size_t)b->n_out + (size_t)naux;
    const size_t bytes = words * 4 + (b->tree_mask ? (size_t)T * T : 0);
    if (bytes > comm_step_max_bytes(c)) {
        specd_err_set(err, "tensor parallel: a %d-token step needs %zu bytes, the step channel holds %zu", T, bytes,
                      comm_step_max_bytes(c));
        return -2;
    }
    int32_t *w = malloc(bytes);
    if (!w) {
        specd_err_set(err, "out of memory");
        return -2;
    }
    int32_t *p = w;
    *p++ = T;
    *p++ = S;
    *p++ = b->n_out;
    *p++ = naux;
    /* the workers' logits exist only for a vocabulary-parallel LM head's all-gather */
    model_shard_info si;
    model_get_shard(m, &si);
    const bool gather = (b->logits || b->logits_dev) && b->n_out > 0 && si.size > 1 &&
                        si.vocab_rows < model_get_config(m)->vocab;
    const int32_t pick = model_graph_pick(m, b); /* model_forward on rank 0 applies the same rule to the same b */
    *p++ = (gather ? TP_WANT_LOGITS : 0) | (b->tree_mask ? TP_TREE : 0) | (naux && b->aux_on_device ? TP_AUX_DEV : 0) |
           ((pick + 1) << TP_GRAPH_SHIFT);
    p = tp_rows_write(p, T, b->tokens, b->pos, b->seq_of, S, b->block_tables, bs);
    if (b->n_out) memcpy(p, b->out_idx, 4 * (size_t)b->n_out), p += b->n_out;
    if (naux) memcpy(p, b->aux_layers, 4 * (size_t)naux), p += naux;
    if (b->tree_mask) memcpy(p, b->tree_mask, (size_t)T * T);
    const int rc = comm_step_send(c, COMM_STEP_DATA, w, bytes, err);
    free(w);
    return rc;
}

/* Rebuilds a model_batch pointing into msg (n bytes); tables: grown to n_seqs
 * pointers. Everything a worker's forward will index is checked against its
 * own KV pool (n_blocks blocks of bs tokens): each token's sequence, its
 * position covered by that sequence's table, every block id in range. */
static int step_parse(const int32_t *msg, size_t n, int32_t n_blocks, int32_t bs, model_batch *b,
                      const int32_t ***tables, specd_err *err) {
    const int32_t *p = msg, *end = msg + n / 4;
    if (n < TP_HDR * 4) return specd_err_set(err, "tensor parallel: short step message (%zu bytes)", n);
    memset(b, 0, sizeof *b);
    const int32_t T = p[0], S = p[1], no = p[2], na = p[3], fl = p[4];
    p += TP_HDR;
    if (T <= 0 || S <= 0 || no < 0 || na < 0) return specd_err_set(err, "tensor parallel: malformed step message");
    b->n_tokens = T;
    b->n_seqs = S;
    const int32_t **tb = realloc((void *)*tables, sizeof *tb * (size_t)S);
    if (!tb) return specd_err_set(err, "out of memory");
    *tables = tb;
    p = tp_rows_read(p, end, T, S, n_blocks, bs, &b->tokens, &b->pos, &b->seq_of, tb, err);
    if (!p) return -1;
    b->block_tables = tb;
    if (end - p < (ptrdiff_t)no + na) return specd_err_set(err, "tensor parallel: malformed step message");
    b->n_out = no;
    b->out_idx = p, p += no;
    if (fl & TP_AUX_DEV) b->n_aux = na, b->aux_layers = p; /* the worker decides whether it captures them */
    p += na; /* host aux: rank 0 alone captures them */
    if (fl & TP_TREE) {
        if ((size_t)((const char *)msg + n - (const char *)p) < (size_t)T * T)
            return specd_err_set(err, "tensor parallel: truncated tree mask");
        b->tree_mask = (const uint8_t *)p;
    }
    return fl;
}

int tp_worker_run(comm *c, model *m, specd_err *err) { return tp_worker_run_dev(c, m, NULL, NULL, NULL, err); }

int tp_worker_run_ex(comm *c, model *m, tp_other_fn on_other, void *octx, specd_err *err) {
    return tp_worker_run_dev(c, m, NULL, on_other, octx, err);
}

int tp_worker_run_dev(comm *c, model *m, tp_dev_comm *dev, tp_other_fn on_other, void *octx, specd_err *err) {
    const size_t cap = comm_step_max_bytes(c);
    int32_t *msg = malloc(cap);
    const int32_t **tables = NULL;
    float *logits = NULL;
    size_t logits_cap = 0;
    const int32_t V = model_get_config(m)->vocab;
    int rc = -1;
    if (!msg) { specd_err_set(err, "out of memory"); goto done; }
    for (;;) {
        size_t n = 0;
        comm_step_kind kind;
        if (comm_step_recv(c, msg, cap, &n, &kind, 0, err) < 0) goto done;
        if (kind == COMM_STEP_SHUTDOWN) { rc = 0; goto done; }
        if (n >= 4 && msg[0] < 0) { /* not a target step: a draft head's call */
            if (!on_other) specd_err_set(err, "tensor parallel: message kind %d but no handler on this rank", msg[0]);
            if (!on_other || on_other(octx, msg, n, err) < 0) {
                char why[COMM_REASON_MAX];
                snprintf(why, sizeof why, "worker draft call failed: %.200s", err->msg);
                comm_abort(c, why);
                goto done;
            }
            continue;
        }
        model_batch b;
        const int fl = step_parse(msg, n, model_kv_n_blocks(m), model_kv_block_size(m), &b, &tables, err);
        if (fl < 0) { comm_abort(c, err->msg); goto done; }
        /* a device draft shard (eagle3_tp_load) reads the aux rows from this rank's own fixed buffer: captured
         * here too (the residual stream is replicated: the same rows as rank 0's); anything else is rank 0's */
        b.aux_on_device = (fl & TP_AUX_DEV) && model_aux_device(m); /* model_forward checks its layers */
        if (!b.aux_on_device) b.n_aux = 0, b.aux_layers = NULL;
        model_graph_force(m, (fl >> TP_GRAPH_SHIFT) - 1); /* rank 0's pick (a rank without graphs: no-op) */
        model_graph_stats gs;
        model_graph_get_stats(m, &gs);
        if ((fl >> TP_GRAPH_SHIFT) > gs.n_graphs) {
            specd_err_set(err, "tensor parallel: rank 0 replays graph %d, this rank captured %d", (fl >> TP_GRAPH_SHIFT) - 1,
                          gs.n_graphs);
            comm_abort(c, err->msg);
            goto done;
        }
        bk_tensor dev_sink;
        if ((fl & TP_WANT_LOGITS) && !model_backend(m)->host_visible) {
            b.logits_dev = &dev_sink; /* the all-gather needs every rank; a device rank keeps its copy there */
        } else if (fl & TP_WANT_LOGITS) { /* the all-gather needs every rank; the rows are rank 0's business */
            const size_t need = (size_t)b.n_out * (size_t)V;
            if (need > logits_cap) {
                float *nl = realloc(logits, need * sizeof *nl);
                if (!nl) { specd_err_set(err, "out of memory"); comm_abort(c, err->msg); goto done; }
                logits = nl;
                logits_cap = need;
            }
            b.logits = logits;
        }
        if (model_forward(m, &b, err) < 0 || tp_dev_comm_sync(dev, err) < 0) {
            char why[COMM_REASON_MAX];
            snprintf(why, sizeof why, "worker forward failed: %.200s", err->msg);
            tp_dev_comm_abort(dev, why);
            comm_abort(c, why);
            goto done;
        }
    }
done:
    free(msg);
    free((void *)tables);
    free(logits);
    return rc;
}

int tp_runner_forward(void *ctx, const model_batch *b, specd_err *err) {
    tp_runner *r = ctx;
    const int rc = tp_step_post(r->c, r->m, b, err);
    if (rc == -2) return -1; /* refused before anything was sent: the ranks are still in step, fail this step only */
    if (rc < 0) {
        comm_abort(r->c, err->msg);
        return -1;
    }
    if (model_forward(r->m, b, err) < 0 || tp_dev_comm_sync(r->dev, err) < 0) {
        char why[COMM_REASON_MAX];
        snprintf(why, sizeof why, "rank 0 forward failed: %.200s", err->msg);
        tp_dev_comm_abort(r->dev, why);
        comm_abort(r->c, why);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------ graphs at TP > 1 */

typedef struct graph_vote {
    int32_t ok, n_graphs;
    char why[200];
} graph_vote;

int tp_graphs_agree(comm *c, model *m, int captured, const char *why_local, char *why, size_t why_cap,
                    specd_err *err) {
    const int world = comm_world(c);
    graph_vote mine = {.ok = captured ? 1 : 0}, *all = calloc((size_t)world, sizeof *all);
    if (!all) return specd_err_set(err, "out of memory");
    model_graph_stats st;
    model_graph_get_stats(m, &st);
    mine.n_graphs = captured ? st.n_graphs : 0;
    snprintf(mine.why, sizeof mine.why, "%s", captured ? "" : why_local ? why_local : "capture failed");
    if (comm_all_gather(c, &mine, sizeof mine, all, err) < 0) {
        free(all);
        return -1;
    }
    int on = 1;
    if (why_cap) why[0] = 0;
    for (int r = 0; r < world && on; r++) {
        if (!all[r].ok) {
            on = 0;
            snprintf(why, why_cap, "rank %d: %.*s", r, (int)sizeof all[r].why - 1, all[r].why);
        } else if (all[r].n_graphs != all[0].n_graphs) {
            on = 0;
            snprintf(why, why_cap, "rank %d captured %d graphs, rank 0 %d", r, all[r].n_graphs, all[0].n_graphs);
        }
    }
    free(all);
    if (!on) model_graphs_discard(m); /* every pool whole again: the ranks' block counts stay equal */
    return on;
}
