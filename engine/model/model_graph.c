/*
 * model_graph.c: CUDA graphs of the target's forward (Llama, and DeepSeek-V3 /
 * Kimi: deepseek_v3_fwd.c runs the same three phases): capture per batch bucket,
 * padding, replay (model.h model_graphs_capture; docs/engine.md "CUDA
 * graphs").
 *
 * What a graph is. The ops of the forward's MODEL_PH_RUN phase (embedding
 * to LM head) captured on the backend's stream for a step of exactly
 * T = B * q token rows and S = B + 1 sequences: every buffer they touch is
 * fixed (the workspace and the output region are grown to their largest
 * size before the first capture and never move afterwards; the backend's
 * metadata buffers; the KV pool; the weights), and every host scalar they
 * bake in (T, S, the block-table stride, the attention length bound) is the
 * same at every replay because the backend's fixed_shape mode uploads the
 * metadata with the stride and bound it was sized for, not the step's.
 *
 * Padding rules. A step of T_r tokens of S_r sequences replays the graph
 * (B, q) with the smallest B * q such that T_r <= B * q and S_r <= B (ties:
 * the smaller B). Rows T_r .. B * q - 1 are padding: token 0, position 0,
 * sequence B (the padding sequence; block-table rows S_r .. B - 1 are unused
 * and filled with -1 by the backend), whose block table is one KV block kept
 * out of the pool for it (the last block: model_kv_n_blocks reports one
 * fewer once graphs are captured). So a padding row writes its K/V into slot
 * 0 of that block only and attends to that slot only: it never reads or
 * writes a real sequence's KV. Padding rows' logits and aux are computed and
 * never downloaded (only the first T_r rows come back). Every op is
 * batch-invariant (backend.h), so a real row's bits do not depend on the
 * padding or on B: a replay computes what the eager step computes.
 *
 * Length classes (review finding F8). The attention kernel's grid is
 * T x heads x ceil(max_len / 256) blocks for the max_len baked in, whatever
 * the step's lengths (splits past a token's position exit at once). With
 * model_graph_opts.max_len every (B, q) is captured per length class L
 * (model_graph_len_classes: max_len, max_len / 4, ... >= 2048, at most 4)
 * through the backend's fixed_len, and a step replays the smallest class
 * above its longest sequence: at most 4x the blocks it needs (above the
 * floor) instead of up to max_len / its length times. The results do not
 * depend on the class (a token's arithmetic depends on its own position).
 *
 * Which steps fit: no tree mask, no final hidden, logits (host, or kept on
 * the device for device sampling: model_batch.logits_dev) for every row in
 * order (out_idx = 0 .. T_r - 1; decode and chain verify steps are so), and
 * either no aux or exactly the aux layers the graphs were captured with.
 * Anything else runs eagerly (counted in the stats).
 *
 * Per replay the host does: build the padded arrays (O(T) host work), the
 * upload phase (ids, metadata, output indices: 4 copies + the block tables),
 * ONE graph launch, the download phase (logits and aux of the real rows).
 *
 * Memory. Instantiating a graph allocates no device memory of the arena (no
 * allocation nodes: the captured ops only launch kernels on fixed buffers);
 * the driver's own bookkeeping for the graphs sits in the reserve the
 * bundle's plan keeps outside the arena (server/bundle.c).
 *
 * Tensor parallelism (docs/engine.md "CUDA graphs at TP > 1"). With a
 * communicator whose collectives are kernels on the stream (model_comm.graphs:
 * cuda_ipc, nccl) every rank captures the same list (same options, same
 * order), the all-reduces / all-gathers inside. A vocabulary-split LM head
 * is captured with its all-gather and the device interleave (copy_cols) into
 * [T, V], whether the step then downloads the logits or keeps them on the
 * device. Rank 0 picks the graph of a step (model_graph_pick) and posts the
 * pick with the step (tp.c); a worker forces it (model_graph_force), so the
 * ranks never disagree on graph vs eager, which would pair a replayed
 * collective with an eager one. cuda_ipc is replay-safe because its
 * generation counters live in device memory (kn_allreduce.cu: each launch,
 * captured or not, bumps them) and it stages through its own fixed regions:
 * the graph's kernel arguments hold no per-call epoch.
 *
 * Threading: engine thread only, like the model (capture at load time on the
 * loading thread, before the engine starts).
 */
#include <stdlib.h>
#include <string.h>

#include "engine/model/model_internal.h"
#include "engine/util/log.h"

typedef struct model_graph {
    int32_t B, q;     /* sequences (real rows' bound), tokens per sequence */
    int32_t T;        /* B * q token rows */
    int32_t L;        /* length class: positions < L (0: the backend's bound) */
    void *exec;       /* the backend's instantiated graph */
} model_graph;

struct model_graphs {
    model_graph *g;   /* sorted by T, then B, then L (0 last) */
    int32_t L_top;    /* the largest length class (0: the backend's bound) */
    int32_t n;
    int32_t n_aux;    /* aux layers captured (0: none) */
    int32_t aux_layers[8];
    int32_t pad_block; /* the padding sequence's KV block */
    int32_t forced;    /* model_graph_force's pick for the next step (-1 eager), valid while has_forced */
    bool has_forced;
    int32_t max_T, max_S;
    /* host staging of the padded step, [max_T] / [max_S] */
    int32_t *tokens, *pos, *seq_of, *out_idx;
    const int32_t **tables;
    float *dummy;     /* logits / aux target of the capture's forward (never written: no download phase) */
    model_graph_stats st;
};

void model_graphs_release(model *m) {
    if (!m || !m->gr) return;
    struct model_graphs *gr = m->gr;
    const bk_graph_ops *go = m->be->ops->graph;
    for (int32_t i = 0; i < gr->n; i++)
        if (go) go->destroy(m->be->ctx, gr->g[i].exec);
    free(gr->g);
    free(gr->tokens);
    free(gr->pos);
    free(gr->seq_of);
    free(gr->out_idx);
    free(gr->tables);
    free(gr->dummy);
    free(gr);
    m->gr = NULL;
    m->ph = 0;
}

void model_graphs_discard(model *m) {
    if (!m) return;
    model_graphs_release(m);
    if (m->kv_pad_blocks) m->n_blocks += 1, m->kv_pad_blocks = 0;
}

void model_graph_get_stats(const model *m, model_graph_stats *out) {
    memset(out, 0, sizeof *out);
    if (m->gr) *out = m->gr->st;
}

/* The padded batch of graph g for the real step b (NULL: a capture, every row padding). */
static model_batch graph_batch(struct model_graphs *gr, const model_graph *g, const model_batch *b, float *logits,
                               float *aux) {
    const int32_t Tr = b ? b->n_tokens : 0, Sr = b ? b->n_seqs : 0;
    if (Tr) {
        memcpy(gr->tokens, b->tokens, sizeof(int32_t) * (size_t)Tr);
        memcpy(gr->pos, b->pos, sizeof(int32_t) * (size_t)Tr);
        memcpy(gr->seq_of, b->seq_of, sizeof(int32_t) * (size_t)Tr);
    }
    for (int32_t t = Tr; t < g->T; t++) gr->tokens[t] = 0, gr->pos[t] = 0, gr->seq_of[t] = g->B;
    for (int32_t s = 0; s < Sr; s++) gr->tables[s] = b->block_tables[s];
    for (int32_t s = Sr; s < g->B; s++) gr->tables[s] = NULL; /* unused rows (no token names them) */
    gr->tables[g->B] = &gr->pad_block;
    model_batch p = {
        .n_tokens = g->T, .tokens = gr->tokens, .pos = gr->pos, .seq_of = gr->seq_of, .n_seqs = g->B + 1,
        .block_tables = gr->tables, .tree_mask = NULL, .n_out = g->T, .out_idx = gr->out_idx, .logits = logits,
        .final_hidden = NULL, .n_aux = aux || (b && b->aux_on_device) ? gr->n_aux : 0, .aux_layers = gr->aux_layers,
        .aux = aux, .aux_on_device = b && b->aux_on_device,
        .logits_dev = b && !logits ? b->logits_dev : NULL, /* device sampling: the real rows' logits stay there */
    };
    return p;
}

/* The architecture's forward (its phases: MODEL_PH_*). */
static int model_arch_forward(model *m, const model_batch *b, specd_err *err) {
    return m->cfg.arch == MODEL_ARCH_DEEPSEEK_V3 ? dsv3_forward(m, b, err) : llama_forward(m, b, err);
}

static int graph_capture_one(model *m, model_graph *g, specd_err *err) {
    struct model_graphs *gr = m->gr;
    const bk_graph_ops *go = m->be->ops->graph;
    void *bx = m->be->ctx;
    model_batch p = graph_batch(gr, g, NULL, gr->dummy, gr->n_aux ? gr->dummy : NULL);
    int rc = -1;
    go->fixed_shape(bx, true);
    if (go->fixed_len) go->fixed_len(bx, g->L);
    m->ph = MODEL_PH_UP; /* uploads happen before the capture opens */
    if (model_arch_forward(m, &p, err) < 0) goto out;
    if (go->begin(bx) < 0) {
        specd_err_set(err, "%s backend: graph capture could not begin", m->be->name);
        goto release;
    }
    m->ph = MODEL_PH_RUN;
    const int run = model_arch_forward(m, &p, err);
    void *exec = NULL;
    const int end = go->end(bx, &exec); /* always closes the capture */
    if (run < 0) { /* the forward released the metadata */
        go->destroy(bx, exec);
        goto out;
    }
    if (end < 0) {
        specd_err_set(err, "%s backend: graph capture / instantiation failed (device memory?)", m->be->name);
        goto release;
    }
    g->exec = exec;
    rc = 0;
release:;
    bk_attn_meta am = {.dev = m->ph_dev};
    m->be->ops->meta_release(bx, &am);
    m->ph_dev = NULL;
out:
    m->ph = 0;
    go->fixed_shape(bx, false);
    if (go->fixed_len) go->fixed_len(bx, 0);
    return rc;
}

static int graph_cmp(const void *a, const void *b) {
    const model_graph *x = a, *y = b;
    const uint32_t lx = (uint32_t)(x->L - 1), ly = (uint32_t)(y->L - 1); /* 0 (the backend's bound) sorts last */
    if (x->T != y->T) return x->T < y->T ? -1 : 1;
    if (x->B != y->B) return x->B < y->B ? -1 : 1;
    return (lx > ly) - (lx < ly);
}

int32_t model_graph_len_classes(int32_t max_len, int32_t len_floor, int32_t *out) {
    if (max_len <= 0) {
        out[0] = 0;
        return 1;
    }
    const int32_t floor = len_floor > 0 ? len_floor : 2048;
    int32_t n = 0, L = max_len;
    out[n++] = L;
    while (n < 4) {
        L = ((L / 4 + 255) / 256) * 256;
        if (L < floor || L >= out[n - 1]) break;
        out[n++] = L;
    }
    return n;
}

int model_graphs_capture(model *m, const model_graph_opts *o, specd_err *err) {
    const bk_graph_ops *go = m->be->ops->graph;
    if (!go) return specd_err_set(err, "the %s backend has no graphs", m->be->name);
    if (m->tp_size > 1 && !(m->tp && m->tp->graphs))
        return specd_err_set(err, "graphs at TP %d need collectives a graph can capture (--tp-comm cuda_ipc or nccl; "
                                  "shm stages them through the host)", m->tp_size);
    const bool split = m->vocab_split && m->tp_size > 1;
    if (split && !m->be->ops->copy_cols)
        return specd_err_set(err, "the %s backend cannot interleave a vocabulary-split LM head on the device",
                             m->be->name);
    if (m->gr) return specd_err_set(err, "graphs already captured");
    if (!o || o->n_buckets <= 0 || o->n_q <= 0 || o->max_seqs <= 1 || o->max_tokens <= 0 || o->n_aux < 0 ||
        o->n_aux > 8)
        return specd_err_set(err, "graph options: buckets, q values, max_seqs > 1, max_tokens and <= 8 aux layers");
    if (!m->kv_pad_blocks && m->n_blocks < 2)
        return specd_err_set(err, "a KV pool of %d blocks cannot spare the padding block", m->n_blocks);
    struct model_graphs *gr = calloc(1, sizeof *gr);
    if (!gr) return specd_err_set(err, "out of memory");
    int32_t Ls[4];
    const int32_t nL = model_graph_len_classes(o->max_len, o->len_floor, Ls);
    gr->L_top = Ls[0];
    gr->g = calloc((size_t)o->n_buckets * (size_t)o->n_q * (size_t)nL, sizeof *gr->g);
    for (int32_t qi = 0; gr->g && qi < o->n_q; qi++)
        for (int32_t bi = 0; bi < o->n_buckets; bi++) {
            const int32_t B = o->buckets[bi], q = o->q[qi];
            if (B < 1 || q < 1) {
                free(gr->g);
                free(gr);
                return specd_err_set(err, "graph bucket %d x %d tokens: both must be >= 1", B, q);
            }
            if (B + 1 > o->max_seqs || (int64_t)B * q > o->max_tokens) {
                /* a requested bucket that will never replay: its steps run eagerly (review finding F9) */
                LOG_WARN("graphs: bucket %d sequences x %d tokens dropped: %s (the backend holds %d sequences + the "
                         "padding one, %d tokens per step); such steps run eagerly", B, q,
                         B + 1 > o->max_seqs ? "more sequences than the backend's metadata holds"
                                             : "more tokens than a step of the backend holds",
                         o->max_seqs - 1, o->max_tokens);
                continue;
            }
            bool dup = false;
            for (int32_t i = 0; i < gr->n; i++) dup |= gr->g[i].B == B && gr->g[i].T == B * q;
            if (dup) continue;
            for (int32_t li = 0; li < nL; li++) gr->g[gr->n++] = (model_graph){B, q, B * q, Ls[li], NULL};
            if (B * q > gr->max_T) gr->max_T = B * q;
            if (B + 1 > gr->max_S) gr->max_S = B + 1;
        }
    if (!gr->g || !gr->n) {
        const bool oom = !gr->g;
        free(gr->g);
        free(gr);
        return specd_err_set(err, oom ? "out of memory" : "no graph bucket fits the backend's bounds");
    }
    qsort(gr->g, (size_t)gr->n, sizeof *gr->g, graph_cmp);
    const int32_t V = m->cfg.vocab, H = m->cfg.hidden;
    /* the workspace and the output region at their largest, so no later step moves them (model_grow would
     * release the graphs): the largest eager step (all rows output, aux) and the largest graph step */
    const int32_t Tmax = o->max_step_tokens > gr->max_T ? o->max_step_tokens : gr->max_T;
    const int64_t qd = (int64_t)m->nh_l * m->cfg.head_dim, kvd = (int64_t)m->nkv_l * m->cfg.head_dim;
    const size_t ws = m->cfg.arch == MODEL_ARCH_DEEPSEEK_V3
                          ? dsv3_workspace_floats(m, Tmax, o->n_aux)
                          : (size_t)Tmax * (size_t)(2 * H + 2 * qd + 2 * kvd + 2 * (int64_t)m->ffn_l + 1 +
                                                    (int64_t)o->n_aux * H) + 11 * BK_TAKE_SLACK;
    const size_t n_pad = ((size_t)Tmax + 15) & ~(size_t)15, xn_pad = ((size_t)Tmax * H + 15) & ~(size_t)15;
    /* a vocabulary-split head (model_finish_outputs): local [T, V/N], gathered [N, T, V/N], interleaved [T, V],
     * each on a 16-float boundary */
    const size_t wo = n_pad + xn_pad + 16 +
                      (split ? (size_t)Tmax * m->vocab_l * (size_t)(m->tp_size + 1) + 32 + (size_t)Tmax * V
                             : (size_t)Tmax * V);
    if (!model_workspace(m, ws) || !model_workspace_out(m, wo)) { /* before m->gr is set (model_grow) */
        free(gr->g);
        free(gr);
        return specd_err_set(err, "out of memory for the graphs' workspace (%d tokens)", Tmax);
    }
    gr->n_aux = o->n_aux;
    for (int32_t a = 0; a < o->n_aux; a++) gr->aux_layers[a] = o->aux_layers[a];
    gr->tokens = malloc(sizeof(int32_t) * (size_t)gr->max_T);
    gr->pos = malloc(sizeof(int32_t) * (size_t)gr->max_T);
    gr->seq_of = malloc(sizeof(int32_t) * (size_t)gr->max_T);
    gr->out_idx = malloc(sizeof(int32_t) * (size_t)gr->max_T);
    gr->tables = calloc((size_t)gr->max_S, sizeof *gr->tables);
    gr->dummy = malloc(sizeof(float) * 16);
    const int32_t nsaved = gr->n;
    gr->n = 0; /* nothing to destroy until captured */
    m->gr = gr;
    if (!gr->tokens || !gr->pos || !gr->seq_of || !gr->out_idx || !gr->tables || !gr->dummy) {
        model_graphs_release(m);
        return specd_err_set(err, "out of memory");
    }
    for (int32_t t = 0; t < gr->max_T; t++) gr->out_idx[t] = t;
    /* the padding block: the pool's last block leaves the block manager's view (once: a later capture reuses it) */
    const bool took = !m->kv_pad_blocks;
    if (took) m->n_blocks -= 1, m->kv_pad_blocks = 1;
    gr->pad_block = m->n_blocks;
    for (int32_t i = 0; i < nsaved; i++) {
        gr->n = i; /* graphs 0 .. i-1 captured */
        if (graph_capture_one(m, &gr->g[i], err) < 0) {
            const int32_t B = gr->g[i].B, q = gr->g[i].q;
            gr->n = i;
            model_graphs_release(m);
            if (took) m->n_blocks += 1, m->kv_pad_blocks = 0; /* no engine has seen the pool yet: the block goes back */
            return specd_err_wrap(err, "capturing the graph of %d sequences x %d tokens", B, q);
        }
    }
    gr->n = nsaved;
    gr->st.n_graphs = nsaved;
    return 0;
}

/* The graph step b replays: its index in gr->g, or -1 (eager). */
static int32_t graph_pick(const struct model_graphs *gr, const model_batch *b) {
    const int32_t T = b->n_tokens, S = b->n_seqs;
    bool fits = !b->tree_mask && !b->final_hidden && (b->logits || b->logits_dev) && b->n_out == T && T <= gr->max_T;
    for (int32_t i = 0; fits && i < T; i++) fits = b->out_idx[i] == i;
    const int32_t naux = b->aux || b->aux_on_device ? b->n_aux : 0;
    if (fits && naux) {
        fits = naux == gr->n_aux;
        for (int32_t a = 0; fits && a < naux; a++) fits = b->aux_layers[a] == gr->aux_layers[a];
    }
    int32_t len = 0; /* the step's longest sequence: positions < len */
    for (int32_t i = 0; fits && i < T; i++) len = b->pos[i] + 1 > len ? b->pos[i] + 1 : len;
    for (int32_t i = 0; fits && i < gr->n; i++)
        if (T <= gr->g[i].T && S <= gr->g[i].B && (gr->g[i].L == 0 || len <= gr->g[i].L)) return i;
    return -1;
}

int32_t model_graph_pick(const model *m, const model_batch *b) { return m->gr ? graph_pick(m->gr, b) : -1; }

void model_graph_force(model *m, int32_t pick) {
    if (!m->gr) return;
    m->gr->forced = pick;
    m->gr->has_forced = true;
}

int model_graph_forward(model *m, const model_batch *b, specd_err *err) {
    struct model_graphs *gr = m->gr;
    const int32_t T = b->n_tokens, S = b->n_seqs;
    const bool forced = gr->has_forced;
    const int32_t gi = forced ? gr->forced : graph_pick(gr, b);
    gr->has_forced = false;
    if (gi < 0) {
        gr->st.eager++;
        return 1;
    }
    if (gi >= gr->n) return specd_err_set(err, "graph %d forced (rank 0's pick), this rank captured %d", gi, gr->n);
    const model_graph *g = &gr->g[gi];
    int32_t len = 0;
    for (int32_t i = 0; i < T; i++) len = b->pos[i] + 1 > len ? b->pos[i] + 1 : len;
    if (T > g->T || S > g->B || (g->L && len > g->L) || b->tree_mask || b->n_out != T)
        return specd_err_set(err, "graph %d (%d sequences x %d tokens, positions < %d) forced for a step of %d tokens "
                                  "of %d sequences up to position %d it does not fit", gi, g->B, g->q, g->L, T, S, len);
    model_batch sunk;
    bk_tensor sink;
    if (forced && !b->logits && !b->logits_dev) { /* a TP worker without logits: the output indices still go up */
        sunk = *b;
        sunk.logits_dev = &sink;
        b = &sunk;
    }
    const bk_graph_ops *go = m->be->ops->graph;
    void *bx = m->be->ctx;
    /* aux: the graph computes it when captured with it; downloaded only when this step asks */
    /* without aux the workspace tensors keep their offsets (aux is the last region) and the graph's aux copy
     * writes where nobody reads */
    const int32_t naux = b->aux || b->aux_on_device ? b->n_aux : 0;
    model_batch p = graph_batch(gr, g, b, b->logits, naux ? b->aux : NULL);
    go->fixed_shape(bx, true);
    if (go->fixed_len) go->fixed_len(bx, g->L);
    m->ph = MODEL_PH_UP;
    m->ph_rows_down = T;
    int rc = model_arch_forward(m, &p, err);
    go->fixed_shape(bx, false);
    if (go->fixed_len) go->fixed_len(bx, 0);
    if (rc < 0) goto out;
    if (go->launch(bx, g->exec) < 0) {
        specd_err_set(err, "%s backend: graph launch failed", m->be->name);
        bk_attn_meta am = {.dev = m->ph_dev};
        m->be->ops->meta_release(bx, &am);
        m->ph_dev = NULL;
        rc = -1;
        goto out;
    }
    m->ph = MODEL_PH_DOWN;
    rc = model_arch_forward(m, &p, err);
    if (rc == 0) {
        gr->st.replays++;
        gr->st.padded_rows += g->T - T;
        gr->st.short_replays += g->L != gr->L_top;
    }
out:
    m->ph = 0;
    return rc;
}
