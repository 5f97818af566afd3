/*
 * eagle3_proposer.c: the spec_proposer ops for EAGLE-3 (engine/runtime/
 * proposer.h): per-sequence draft state, the token/feature shift, chained
 * proposal, the draft KV block tables. The contract with the engine is
 * written out in draft/eagle3.h.
 *
 * Per-sequence state (positions absolute):
 *   n_tok   committed tokens known: x_0 .. x_{n_tok-1}
 *   n_feat  target features known:  f_0 .. f_{n_feat-1}   (n_feat <= n_tok)
 *   n_kv    SETTLED draft KV entries: real pairs (f_t, x_{t+1}) at t < n_kv,
 *           never recomputed. The pairs from n_kv up to the last complete one
 *           are pending; the last real pair is always recomputed at the next
 *           propose (it is the row whose output starts the chain), so
 *           n_kv = last real pair after a run.
 *   window  wtok: x at positions [n_kv+1, n_tok); wfeat: f at [n_kv, n_feat)
 *           (raw aux rows [n_aux*Ht]; fc is applied when the pairs are run,
 *           batched over sequences).
 * Draft KV positions >= the last real pair + 1 hold speculative entries of
 * the last chain; they are overwritten by real pairs as they arrive.
 * Sampling: a chain step with a sampled row draws every row with bk_ops.draw
 * (draw_step; greedy rows at temperature 0), u = Philox4x32-10 (kernels/
 * kn_philox.h) with key = the sequence's draft seed (dseed: set by the engine
 * from the request's seed, op_seed_seq; until then from opts.seed and the
 * sequence id) and counter = the drafted token's position, so a seeded
 * request's drafts never depend on the batch, on other requests or on the
 * backend (the CPU op and the CUDA kernel draw the same ids).
 * A sequence that skips drafting for some steps (adaptive k = 0) only
 * accumulates pending real pairs in its window; the next propose runs them
 * all in one batched pass, so the draft KV is the same as if it had drafted.
 * Residency: the token windows (wtok) are host memory; the feature windows
 * are host memory (wfeat) on host-visible backends and, on a device backend,
 * chunks of a device feature pool (fpool, chunks of a KV block's rows; fed by
 * extend_rows from the target's fixed aux buffer, device to device, or by
 * extend's host rows, uploaded), so target features never come back to the
 * host; everything the forward touches lives in the head's backend memory,
 * allocated at load (e3_buf: feature rows, fc / layer outputs, tokens, gather
 * indices, the chain's hidden rows, logits and drafted ids). With CUDA graphs
 * (eagle3_graphs_capture: per row bucket, per k in 1..K, per length class) a greedy chain of any
 * k_max <= K is one graph launch of exactly the steps its longest chain needs. A propose on a device backend uploads each chunk's
 * features and tokens and each layer call's metadata, keeps the chain on
 * the device (argmax + d2t by the backend op, dropped rows compacted with
 * gather_rows) and downloads the drafted ids ONCE at the end; a step with a
 * sampled draft (temperature > 0 with q wanted) draws on the device; propose
 * brings its q rows [rows, Vd] to the host (scattered to target ids: the
 * engine verifies those chains there), propose_dev leaves them in qd
 * ([max_k, max_seqs, Vd], carved at load without TP) and tells the engine
 * which row holds each draft's q, read there through t2d by the device
 * verifier (nothing but the drafted ids comes back).
 * The device feature cache (opts.feat_cache, proposer.h extend_slots): the
 * pool is instead one row per TARGET KV slot, so the chunk of a sequence's
 * positions [c * bs, (c + 1) * bs) is the target's KV block c of that
 * sequence: the copies that fill the window fill the cache, a KV block the
 * prefix cache shares carries its features with it, and a prefix-cache hit
 * is fed with no copy (its positions' rows are already there). Its rows
 * live as long as the target's KV: this proposer never allocates or frees
 * them (fb is the target's block table).
 * Device tensor parallelism (eagle3_tp_prop.c): every rank runs this proposer
 * on its shard of the head; rank 0's posts each engine call (mirror) to the
 * workers before running it, so all ranks hold the same state.
 * Invariants: n_kv <= max(n_tok - 1, 0) (n_tok - 2 after a propose);
 * n_kv <= n_feat <= n_tok; the block table covers every position written.
 * A truncate to n <= n_kv drops the window (n_kv = n - 1, n_feat = n_kv):
 * the engine re-sends features from n - 1 (eagle3.h).
 * Threading: engine thread only.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "draft/eagle3.h"
#include "draft/eagle3_head.h"
#include "draft/eagle3_internal.h"
#include "engine/util/log.h"
#include "kernels/kn_philox.h"

typedef struct e3_seq {
    int64_t id;
    int32_t n_tok, n_feat, n_kv;
    int32_t *wtok;             /* [n_tok - n_kv - 1] */
    int32_t wtok_cap;
    float *wfeat;              /* [n_feat - n_kv, featw] */
    int32_t wfeat_cap;         /* rows */
    int32_t *blocks;           /* block table */
    int32_t n_blocks, blocks_cap;
    /* device backends: the window's features in the proposer's feature pool. Chunk c (positions
     * [c * fc, (c + 1) * fc), fc = the pool's rows per chunk) is pool chunk fb[c - fb_first], for
     * fb_first <= c < fb_first + n_fb; the chunks held cover [n_kv, n_feat) (wfeat is unused there) */
    int32_t *fb;
    int32_t fb_cap, fb_first, n_fb;
    uint64_t dseed;            /* Philox key of this sequence's sampled drafts (counter: the draft's position) */
} e3_seq;

/* A buffer in the head's backend memory (bytes; allocated at load, grown
 * only on host-visible backends). */
typedef struct e3_buf {
    void *p;
    size_t cap;
} e3_buf;

typedef struct e3_proposer {
    spec_proposer pub;
    eagle3_head *head;
    eagle3_opts opts;
    backend *be;               /* the head's */
    int32_t featw;             /* n_aux * Ht */
    int32_t H, Vd, Vt;
    e3_seq **seqs;
    int32_t n_seqs, cap_seqs;
    /* backend buffers: real pairs (max_rows rows), the chain (max_seqs rows, max_k steps) */
    e3_buf aux;                /* F32 [max_rows, featw]  the pairs' target features */
    e3_buf g, hout;            /* F32 [max_rows, H]      fc output, layer output */
    e3_buf tok;                /* I32 [max_rows]         the pairs' tokens x_{t+1} */
    e3_buf idx;                /* I32 [max(max_rows, max_seqs)] gather indices */
    e3_buf hA, hB;             /* F32 [max_seqs, H]      chain hidden states (pre-norm), ping-pong */
    e3_buf lg;                 /* F32 [max_seqs, Vd]     draft logits of one chain step */
    e3_buf dr;                 /* I32 [max_k * max_seqs] drafted target ids, step after step (one download) */
    e3_buf nt;                 /* I32 [max_seqs]         the next step's token ids when rows drop out */
    e3_buf dpar;               /* bk_draw_param [max_seqs] a sampling step's draw parameters (bk_ops.draw) */
    /* device backends without TP: sampled drafts' q kept for the device verifier (propose_dev) */
    e3_buf qd;                 /* F32 [max_k, max_seqs, Vd] step j's draws write their q rows into slice j */
    e3_buf t2d;                /* I32 [Vt] target id -> draft column (scored vocabulary), -1 outside */
    int32_t *qrow;             /* during propose_dev: the caller's [n, k_max] q row of each draft, else NULL */
    /* device backends: the pending pairs' target features stay in backend memory (no host window) */
    e3_buf fpool;              /* F32 [n_fchunks * fc, featw]  feature chunks of fc rows (the KV block size) */
    e3_buf fidx;               /* I32 [max_rows]         pool rows of a chunk of pairs (gather indices) */
    int32_t fc, n_fchunks;
    int32_t *ffree, n_ffree;   /* free chunk ids (a stack) */
    bool slots;                /* opts.feat_cache: fpool is the device feature cache, F32 [n_fchunks * fc, featw]
                                * with chunk = the TARGET's KV block id (n_fchunks = its n_blocks): a sequence's
                                * fb is the target's block table (fb_first 0), written by extend_slots only;
                                * nothing is allocated or freed from it (the block manager owns its rows) */
    bk_tensor src_aux;         /* the target's fixed aux buffer (model_aux_device), data NULL when none */
    bool pool_warned;
    /* CUDA graphs of the chain (eagle3_graphs_capture): per row bucket B, per step count k in 1 .. gk, per
     * length class L (k >= 2; 0: the backend's bound); sorted by B, then k, then L ascending (0 last) */
    struct { int32_t B, k, L; void *exec; } *gr;
    int32_t n_gr, gk;
    int32_t gr_pad;            /* the padding rows' draft KV block (held while graphs exist) */
    void *gr_x0;               /* the buffer the graphs read the chain's first rows from (P->hA.p at capture) */
    eagle3_graph_stats gst;
    comm *mirror;              /* device TP, rank 0: every call is posted to the workers first (eagle3_tp_prop.c) */
} e3_proposer;

/* ------------------------------------------------------------ small helpers */


static int grow(void **p, int32_t *cap, int32_t need, size_t elem) {
    if (need <= *cap) return 0;
    int32_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *n = realloc(*p, (size_t)c * elem);
    if (!n) return -1;
    *p = n;
    *cap = c;
    return 0;
}

static e3_seq *seq_find(e3_proposer *P, int64_t id, int32_t *idx) {
    for (int32_t i = 0; i < P->n_seqs; i++)
        if (P->seqs[i]->id == id) {
            if (idx) *idx = i;
            return P->seqs[i];
        }
    return NULL;
}

static e3_seq *seq_get(e3_proposer *P, int64_t id) {
    e3_seq *s = seq_find(P, id, NULL);
    if (s) return s;
    if (grow((void **)&P->seqs, &P->cap_seqs, P->n_seqs + 1, sizeof *P->seqs) < 0) return NULL;
    s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->id = id;
    s->dseed = (P->opts.seed ? P->opts.seed : 0x5eed5eed5eedULL) ^ ((uint64_t)id * 0xd1342543de82ef95ULL);
    P->seqs[P->n_seqs++] = s;
    return s;
}

/* Block table covers position pos (allocating); -1 when the pool is empty. */
static int seq_cover(e3_proposer *P, e3_seq *s, int32_t pos) {
    const int32_t bs = eagle3_head_kv(P->head).block_size, need = pos / bs + 1;
    if (grow((void **)&s->blocks, &s->blocks_cap, need, sizeof *s->blocks) < 0) return -1;
    while (s->n_blocks < need) {
        int32_t b = eagle3_kv_alloc(P->head);
        if (b < 0) return -1;
        s->blocks[s->n_blocks++] = b;
    }
    return 0;
}

/* Frees blocks beyond what positions [0, n_pos) need. */
static void seq_release_blocks(e3_proposer *P, e3_seq *s, int32_t n_pos) {
    const int32_t bs = eagle3_head_kv(P->head).block_size, keep = (n_pos + bs - 1) / bs;
    while (s->n_blocks > keep) eagle3_kv_free(P->head, s->blocks[--s->n_blocks]);
}

/* Last complete real pair position (f_t and x_{t+1} both known), or -1. */
static int32_t seq_last_pair(const e3_seq *s) {
    int32_t L = s->n_tok - 2 < s->n_feat - 1 ? s->n_tok - 2 : s->n_feat - 1;
    return L;
}

/* ---- the device feature pool (device backends): chunks of fc rows, a sequence holding those that cover
 * its window [n_kv, n_feat) ---- */

/* Pool row of feature f_t (t inside the held chunks). */
static int32_t feat_row(const e3_proposer *P, const e3_seq *s, int32_t t) {
    return s->fb[t / P->fc - s->fb_first] * P->fc + t % P->fc;
}

/* Gives back the chunks outside the window [n_kv, n_feat): those wholly before n_kv, and those at or past
 * n_feat (after a truncate). */
static void feat_release(e3_proposer *P, e3_seq *s) {
    if (!P->fpool.p || P->slots) return; /* the cache's rows belong to the target's blocks */
    const int32_t lo = s->n_kv / P->fc, hi = s->n_feat > s->n_kv ? (s->n_feat - 1) / P->fc + 1 : lo;
    int32_t drop = 0;
    while (drop < s->n_fb && s->fb_first + drop < lo) P->ffree[P->n_ffree++] = s->fb[drop++];
    if (drop) {
        memmove(s->fb, s->fb + drop, sizeof(int32_t) * (size_t)(s->n_fb - drop));
        s->n_fb -= drop, s->fb_first += drop;
    }
    while (s->n_fb > 0 && s->fb_first + s->n_fb > hi) P->ffree[P->n_ffree++] = s->fb[--s->n_fb];
    if (s->n_fb == 0) s->fb_first = lo;
}

/* The chunk of position t held (t is n_feat: the next feature). -1 when the pool is empty. */
static int feat_cover(e3_proposer *P, e3_seq *s, int32_t t) {
    const int32_t c = t / P->fc;
    if (P->slots) return c < s->n_fb ? 0 : -1; /* the cache: the target's block, given by extend_slots */
    if (s->n_fb == 0) s->fb_first = c;
    while (s->fb_first + s->n_fb <= c) {
        if (P->n_ffree == 0) return -1;
        if (grow((void **)&s->fb, &s->fb_cap, s->n_fb + 1, sizeof(int32_t)) < 0) return -1;
        s->fb[s->n_fb++] = P->ffree[--P->n_ffree];
    }
    return 0;
}

/* Moves the window start to new_kv (>= n_kv), dropping what it no longer needs. */
static void seq_settle(e3_proposer *P, e3_seq *s, int32_t new_kv) {
    int32_t d = new_kv - s->n_kv;
    if (d <= 0) return;
    int32_t nt = s->n_tok - s->n_kv - 1, nf = s->n_feat - s->n_kv;
    if (nt > d) memmove(s->wtok, s->wtok + d, sizeof(int32_t) * (size_t)(nt - d));
    if (!P->fpool.p && nf > d)
        memmove(s->wfeat, s->wfeat + (size_t)d * P->featw, sizeof(float) * (size_t)(nf - d) * P->featw);
    s->n_kv = new_kv;
    feat_release(P, s);
}

static void seq_truncate(e3_proposer *P, e3_seq *s, int32_t n) {
    if (n < 0) n = 0;
    if (s->n_tok > n) s->n_tok = n;
    if (s->n_feat > n) s->n_feat = n;
    if (n <= s->n_kv) {
        /* settled pairs t >= n - 1 used a token now gone; the window before
         * the old n_kv was never kept: features from n - 1 must be re-sent */
        s->n_kv = n > 0 ? n - 1 : 0;
        s->n_feat = s->n_kv;
    }
    feat_release(P, s);
    seq_release_blocks(P, s, s->n_tok);
}

/* ------------------------------------------------------------ running real pairs */

/* Backend memory of at least BYTES in B: what load allocated, grown on a
 * host-visible backend; on a device backend a larger need fails with the
 * bound named (nothing is allocated on the device per step). */
static void *buf_need(e3_proposer *P, e3_buf *b, size_t bytes, const char *what, specd_err *err) {
    if (bytes <= b->cap && b->p) return b->p;
    if (!P->be->host_visible) {
        specd_err_set(err, "eagle3: %s needs %zu bytes; the draft's %s buffers were sized at load for %zu (raise "
                           "eagle3_opts max_rows / max_seqs / max_k)", what, bytes, P->be->name, b->cap);
        return NULL;
    }
    void *p = P->be->ops->buf_alloc(P->be->ctx, bytes ? bytes : 1);
    if (!p) {
        specd_err_set(err, "out of memory (%zu bytes for the draft's %s)", bytes, what);
        return NULL;
    }
    P->be->ops->buf_free(P->be->ctx, b->p);
    b->p = p;
    b->cap = bytes;
    return p;
}

static void buf_drop(e3_proposer *P, e3_buf *b) {
    if (P->be) P->be->ops->buf_free(P->be->ctx, b->p);
    b->p = NULL;
    b->cap = 0;
}

/* Host memory to fill for backend buffer DST: DST itself on a host-visible
 * backend (zero copies), else the caller's staging STAGE. */
static void *fill_ptr(const e3_proposer *P, void *dst, void *stage) { return P->be->host_visible ? dst : stage; }

/* Uploads the staged bytes to DST (no-op on a host-visible backend: filled in
 * place). The CUDA backend copies pageable memory through cudart, which
 * stages it before cudaMemcpyAsync returns, so STAGE may be refilled after. */
static int fill_commit(e3_proposer *P, void *dst, const void *stage, size_t bytes, specd_err *err) {
    if (P->be->host_visible || !bytes) return 0;
    if (P->be->ops->upload(P->be->ctx, dst, stage, bytes) < 0)
        return specd_err_set(err, "eagle3: upload of %zu bytes to the %s backend failed", bytes, P->be->name);
    return 0;
}

/* Runs the pending real pairs of S[0..m) (from n_kv through the last complete
 * pair), batched over sequences in chunks of max_rows. Each sequence's
 * last-pair output row is gathered into last_h (backend F32 [>= m, H],
 * optional) in sequence order: rows [0, *n_last); ok[i] (optional) is set to
 * 1 for the sequences that produced one. Sequences whose blocks cannot be
 * covered are skipped (ok 0). Afterwards n_kv = last pair (kept for
 * recomputation). Per chunk on a device backend: one upload of the chunk's
 * features and tokens, the metadata upload, the gather indices; no download. */
static int run_pairs(e3_proposer *P, e3_seq **S, int32_t m, float *last_h, uint8_t *ok, int32_t *n_last,
                     specd_err *err) {
    const int32_t H = P->H, fw = P->featw;
    const size_t mm = (size_t)(m > 0 ? m : 1);
    int64_t pending = 0; /* host staging sized by the rows there are, at most max_rows */
    for (int32_t k = 0; k < m; k++) pending += seq_last_pair(S[k]) >= S[k]->n_kv ? seq_last_pair(S[k]) - S[k]->n_kv + 1 : 0;
    const int32_t maxr = (int32_t)(pending < P->opts.max_rows ? (pending > 0 ? pending : 1) : P->opts.max_rows);
    const bool hv = P->be->host_visible;
    int32_t *tokh = malloc(sizeof(int32_t) * (size_t)maxr * 4), *bt_seq = malloc(sizeof(int32_t) * mm);
    const int32_t **bt = malloc(sizeof(int32_t *) * mm);
    uint8_t *ran = calloc(mm, 1);
    /* device backends: the features are rows of the feature pool, gathered on the device (fidxh: their pool
     * rows); host-visible ones copy them from the windows in place */
    int32_t *fidxh = hv ? NULL : malloc(sizeof(int32_t) * (size_t)maxr);
    float *aux_d = buf_need(P, &P->aux, sizeof(float) * (size_t)maxr * fw, "feature rows", err);
    float *g_d = aux_d ? buf_need(P, &P->g, sizeof(float) * (size_t)maxr * H, "fc rows", err) : NULL;
    float *ho_d = g_d ? buf_need(P, &P->hout, sizeof(float) * (size_t)maxr * H, "layer rows", err) : NULL;
    int32_t *tok_d = ho_d ? buf_need(P, &P->tok, sizeof(int32_t) * (size_t)maxr, "pair tokens", err) : NULL;
    int32_t *idx_d = tok_d ? buf_need(P, &P->idx, sizeof(int32_t) * (size_t)maxr, "gather indices", err) : NULL;
    int rc = 0;
    if (!idx_d) { rc = -1; goto done; }
    if (!tokh || !bt || !bt_seq || !ran || (!hv && !fidxh)) { rc = specd_err_set(err, "out of memory"); goto done; }
    if (!hv && (!P->fpool.p || (size_t)maxr * 4 > P->fidx.cap)) {
        rc = specd_err_set(err, "eagle3: no feature pool for %d rows", maxr);
        goto done;
    }
    int32_t *pos = tokh + maxr, *seq_of = pos + maxr, *idxh = seq_of + maxr;
    int32_t *tok = fill_ptr(P, tok_d, tokh), *idx = fill_ptr(P, idx_d, idxh);
    if (ok) memset(ok, 0, (size_t)m);
    if (n_last) *n_last = 0;
    int32_t si = 0, t = 0, L = -1;
    bool active = false;
    while (si < m) {
        /* fill one chunk of <= max_rows rows, sequences in order, positions ascending */
        int32_t n = 0, nseq = 0;
        while (si < m && n < maxr) {
            e3_seq *s = S[si];
            if (!active) {
                L = seq_last_pair(s);
                t = s->n_kv;
                if (L < s->n_kv || seq_cover(P, s, L) < 0) { si++; continue; }
                active = true;
                ran[si] = 1;
            }
            if (nseq == 0 || bt_seq[nseq - 1] != si) { bt[nseq] = s->blocks; bt_seq[nseq++] = si; }
            for (; t <= L && n < maxr; n++, t++) {
                if (hv) memcpy(aux_d + (size_t)n * fw, s->wfeat + (size_t)(t - s->n_kv) * fw, sizeof(float) * (size_t)fw);
                else fidxh[n] = feat_row(P, s, t);
                tok[n] = s->wtok[t - s->n_kv]; /* x_{t+1} */
                pos[n] = t;
                seq_of[n] = nseq - 1;
            }
            if (t > L) { si++; active = false; }
        }
        if (n == 0) continue;
        if (!hv) { /* the chunk's feature rows, gathered from the pool on the device */
            bk_tensor pool = bk_wrap_f32(P->fpool.p, (int64_t)P->n_fchunks * P->fc, fw);
            bk_tensor fi = bk_wrap_i32(P->fidx.p, n, 1), dst = bk_wrap_f32(aux_d, n, fw);
            if (fill_commit(P, P->fidx.p, fidxh, sizeof(int32_t) * (size_t)n, err) < 0 ||
                P->be->ops->gather_rows(P->be->ctx, &pool, &fi, &dst) < 0) {
                rc = specd_err_set(err, "eagle3: gathering %d feature rows from the pool failed", n);
                goto done;
            }
        }
        if (fill_commit(P, tok_d, tok, sizeof(int32_t) * (size_t)n, err) < 0) { rc = -1; goto done; }
        eagle3_rows r = {n, tok, pos, seq_of, nseq, bt, NULL};
        bk_tensor at = bk_wrap_f32(aux_d, n, fw), gt = bk_wrap_f32(g_d, n, H), ot = bk_wrap_f32(ho_d, n, H);
        bk_tensor it = bk_wrap_i32(tok_d, n, 1);
        if (eagle3_fc_t(P->head, &at, &gt, err) < 0 || eagle3_layer_t(P->head, &r, &it, &gt, &ot, err) < 0) { rc = -1; goto done; }
        /* a sequence's last-pair row starts its chain: gathered into last_h in sequence order */
        int32_t cnt = 0;
        for (int32_t i = 0; i < n; i++) {
            int32_t k = bt_seq[seq_of[i]];
            if (pos[i] != seq_last_pair(S[k])) continue;
            idx[cnt++] = i;
            if (ok) ok[k] = 1;
        }
        if (last_h && cnt > 0) {
            bk_tensor ix = bk_wrap_i32(idx_d, cnt, 1), dst = bk_wrap_f32(last_h + (size_t)*n_last * H, cnt, H);
            if (fill_commit(P, idx_d, idx, sizeof(int32_t) * (size_t)cnt, err) < 0 ||
                P->be->ops->gather_rows(P->be->ctx, &ot, &ix, &dst) < 0) {
                rc = specd_err_set(err, "eagle3: gathering the last-pair rows failed");
                goto done;
            }
            *n_last += cnt;
        }
    }
    for (int32_t k = 0; k < m; k++)
        if (ran[k]) seq_settle(P, S[k], seq_last_pair(S[k]));
done:
    free(tokh);
    free(bt);
    free(bt_seq);
    free(ran);
    free(fidxh);
    return rc;
}

/* ------------------------------------------------------------ ops */

static int op_aux_layers(void *ctx, int32_t *layers) {
    e3_proposer *P = ctx;
    return eagle3_head_aux_layers(P->head, layers);
}

/* The token part of extend: x_{pos0 .. pos0 + n) committed (see eagle3.h). */
static int extend_tokens(e3_proposer *P, e3_seq *s, const int32_t *tokens, int32_t n, int32_t pos0, specd_err *err) {
    const int64_t id = s->id;
    if (pos0 > s->n_tok)
        return specd_err_set(err, "eagle3 extend: sequence %lld knows %d tokens, extend starts at %d (gap)", (long long)id,
                             s->n_tok, pos0);
    for (int32_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= P->Vt) return specd_err_set(err, "eagle3 extend: token id %d out of range", tokens[i]);
        int32_t p = pos0 + i;
        if (p < s->n_tok) {
            if (p <= s->n_kv || s->wtok[p - s->n_kv - 1] == tokens[i]) continue; /* settled or equal */
            seq_truncate(P, s, p); /* the engine rewrote history from p */
            if (p > s->n_tok)
                return specd_err_set(err, "eagle3 extend: sequence %lld: rewriting position %d cut into the draft's "
                                          "built entries; re-send from position %d", (long long)id, p, s->n_tok);
        }
        if (p > s->n_kv) {
            if (grow((void **)&s->wtok, &s->wtok_cap, p - s->n_kv, sizeof(int32_t)) < 0) return specd_err_set(err, "out of memory");
            s->wtok[p - s->n_kv - 1] = tokens[i];
        }
        s->n_tok = p + 1;
    }
    return 0;
}

/* Feature pool chunks for position t, making room when the pool is empty: first by running every sequence's
 * pending pairs (their windows then hold only their last pair), which the next propose would have run. */
static int feat_cover_or_run(e3_proposer *P, e3_seq *s, int32_t t, specd_err *err) {
    if (feat_cover(P, s, t) == 0) return 0;
    if (P->slots)
        return specd_err_set(err, "eagle3 extend: sequence %lld: no target KV block for position %d in the feature "
                                  "cache (extend_slots gives the block table)", (long long)s->id, t);
    if (run_pairs(P, P->seqs, P->n_seqs, NULL, NULL, NULL, err) < 0) return -1;
    if (feat_cover(P, s, t) == 0) return 0;
    if (!P->pool_warned) {
        P->pool_warned = true;
        LOG_WARN("eagle3: the draft's feature pool (%d chunks of %d rows) is full with %d sequences; their drafts "
                 "stop until re-sent (raise eagle3_opts feat_chunks)", P->n_fchunks, P->fc, P->n_seqs);
    }
    return specd_err_set(err, "eagle3 extend: the draft's feature pool (%d chunks of %d rows) is full", P->n_fchunks,
                         P->fc);
}

/* The feature part of extend: f_{pos0 .. pos0 + n) from host rows AUX [n, featw] (host_aux) or from rows
 * row0 .. row0 + n - 1 of the target's device aux buffer. Host-visible backends keep them in the host window
 * (wfeat); device backends in the feature pool, copied there on the device (a device -> device copy per
 * chunk run, or an upload of host rows): nothing comes back to the host. Long windows are run in chunks of
 * max_rows as they fill (a prefill). */
static int extend_feats(e3_proposer *P, e3_seq *s, int32_t n, int32_t pos0, const float *aux, int32_t row0,
                        specd_err *err) {
    if (pos0 > s->n_feat)
        return specd_err_set(err, "eagle3 extend: sequence %lld has features up to %d, extend gives %d.. (gap)",
                             (long long)s->id, s->n_feat, pos0);
    const int32_t fw = P->featw;
    for (int32_t i = 0; i < n;) {
        int32_t p = pos0 + i;
        if (p < s->n_feat) { i++; continue; }
        if (!P->fpool.p) { /* host window */
            if (grow((void **)&s->wfeat, &s->wfeat_cap, p - s->n_kv + 1, sizeof(float) * (size_t)fw) < 0)
                return specd_err_set(err, "out of memory");
            memcpy(s->wfeat + (size_t)(p - s->n_kv) * fw, aux + (size_t)i * fw, sizeof(float) * (size_t)fw);
            s->n_feat = p + 1;
            i++;
            continue;
        }
        /* a run of rows inside one pool chunk */
        if (feat_cover_or_run(P, s, p, err) < 0) return -1;
        int32_t len = P->fc - p % P->fc;
        if (len > n - i) len = n - i;
        float *dst = (float *)P->fpool.p + (size_t)feat_row(P, s, p) * fw;
        if (aux) {
            if (fill_commit(P, dst, aux + (size_t)i * fw, sizeof(float) * (size_t)len * fw, err) < 0) return -1;
        } else {
            bk_tensor d = bk_wrap_f32(dst, len, fw), src = bk_rows(P->src_aux, row0 + i, len);
            if (P->be->ops->copy_cols(P->be->ctx, &d, 0, &src) < 0)
                return specd_err_set(err, "eagle3 extend: copying %d feature rows on the device failed", len);
        }
        s->n_feat = p + len;
        i += len;
        /* bound the window: run a long prefill's pairs now, chunk by chunk */
        if (seq_last_pair(s) - s->n_kv >= P->opts.max_rows && run_pairs(P, &s, 1, NULL, NULL, NULL, err) < 0) return -1;
    }
    return 0;
}

static int op_extend(void *ctx, int64_t id, const int32_t *tokens, int32_t n, int32_t pos0, const float *aux,
                     specd_err *err) {
    e3_proposer *P = ctx;
    if (n <= 0) return 0;
    if (pos0 < 0 || !tokens) return specd_err_set(err, "eagle3 extend: bad arguments");
    if (aux && P->slots)
        return specd_err_set(err, "eagle3 extend: the draft's features live in the device feature cache "
                                  "(eagle3_opts.feat_cache): they come with extend_slots, not as host rows");
    if (P->mirror && e3m_post_extend(P->mirror, id, tokens, n, pos0, aux, P->featw, false, 0, err) < 0) return -1;
    e3_seq *s = seq_get(P, id);
    if (!s) return specd_err_set(err, "out of memory");
    if (extend_tokens(P, s, tokens, n, pos0, err) < 0) return -1;
    if (aux && extend_feats(P, s, n, pos0, aux, 0, err) < 0) return -1;
    /* bound the window: run long prefills now, in chunks */
    if (seq_last_pair(s) - s->n_kv >= P->opts.max_rows) return run_pairs(P, &s, 1, NULL, NULL, NULL, err);
    return 0;
}

/* extend with the features in the target's device aux buffer (proposer.h extend_rows). */
static int op_extend_rows(void *ctx, int64_t id, const int32_t *tokens, int32_t n, int32_t pos0, int32_t row0,
                          specd_err *err) {
    e3_proposer *P = ctx;
    if (n <= 0) return 0;
    if (pos0 < 0 || !tokens || row0 < 0) return specd_err_set(err, "eagle3 extend: bad arguments");
    if (!P->fpool.p || !P->src_aux.data)
        return specd_err_set(err, "eagle3 extend_rows: the head has no device feature pool or target aux buffer");
    if (P->slots)
        return specd_err_set(err, "eagle3 extend_rows: the draft's feature pool is the device feature cache: use "
                                  "extend_slots (it needs the target's block table)");
    if ((int64_t)row0 + n > P->src_aux.rows)
        return specd_err_set(err, "eagle3 extend_rows: rows %d..%d outside the target's aux buffer of %lld", row0,
                             row0 + n - 1, (long long)P->src_aux.rows);
    if (P->mirror && e3m_post_extend(P->mirror, id, tokens, n, pos0, NULL, 0, true, row0, err) < 0) return -1;
    e3_seq *s = seq_get(P, id);
    if (!s) return specd_err_set(err, "out of memory");
    if (extend_tokens(P, s, tokens, n, pos0, err) < 0 || extend_feats(P, s, n, pos0, NULL, row0, err) < 0) return -1;
    if (seq_last_pair(s) - s->n_kv >= P->opts.max_rows) return run_pairs(P, &s, 1, NULL, NULL, NULL, err);
    return 0;
}

/* extend with the features in the device feature cache, one row per target KV slot (proposer.h extend_slots):
 * the cache fill first (rows row0.. of the target's aux buffer into the positions' slots, one device copy per
 * block run), then the tokens and the window, which reads those same rows (no copy of its own). */
static int op_extend_slots(void *ctx, int64_t id, const int32_t *tokens, int32_t n, int32_t pos0, int32_t row0,
                           const int32_t *blocks, int32_t n_blocks, specd_err *err) {
    e3_proposer *P = ctx;
    if (n <= 0) return 0;
    if (!P->slots) return specd_err_set(err, "eagle3 extend_slots: the head has no device feature cache (feat_cache)");
    if (P->mirror) /* eagle3_tp_load never sets feat_cache; the mirror does not carry block tables */
        return specd_err_set(err, "eagle3 extend_slots: no device feature cache at tensor parallelism");
    if (pos0 < 0 || !tokens || !blocks || n_blocks < 0 || (int64_t)n_blocks * P->fc < (int64_t)pos0 + n)
        return specd_err_set(err, "eagle3 extend_slots: positions %d..%d, a block table of %d blocks of %d", pos0,
                             pos0 + n - 1, n_blocks, P->fc);
    if (row0 >= 0 && (!P->src_aux.data || (int64_t)row0 + n > P->src_aux.rows))
        return specd_err_set(err, "eagle3 extend_slots: rows %d..%d outside the target's aux buffer of %lld", row0,
                             row0 + n - 1, (long long)P->src_aux.rows);
    e3_seq *s = seq_get(P, id);
    if (!s || grow((void **)&s->fb, &s->fb_cap, n_blocks > 0 ? n_blocks : 1, sizeof(int32_t)) < 0)
        return specd_err_set(err, "out of memory");
    /* the blocks this call writes and the window reads: [min(n_kv, pos0), pos0 + n) */
    for (int32_t b = (pos0 < s->n_kv ? pos0 : s->n_kv) / P->fc; b <= (pos0 + n - 1) / P->fc; b++)
        if (blocks[b] < 0 || blocks[b] >= P->n_fchunks)
            return specd_err_set(err, "eagle3 extend_slots: KV block id %d outside the target's %d", blocks[b],
                                 P->n_fchunks);
    memcpy(s->fb, blocks, sizeof(int32_t) * (size_t)n_blocks); /* the window reads its rows through it */
    s->n_fb = n_blocks, s->fb_first = 0;
    const int32_t fw = P->featw;
    for (int32_t i = 0; row0 >= 0 && i < n;) { /* the cache fill: every position given, whatever the window */
        const int32_t p = pos0 + i, len = P->fc - p % P->fc < n - i ? P->fc - p % P->fc : n - i;
        bk_tensor d = bk_wrap_f32((float *)P->fpool.p + ((size_t)blocks[p / P->fc] * P->fc + (size_t)(p % P->fc)) * fw,
                                  len, fw);
        bk_tensor src = bk_rows(P->src_aux, row0 + i, len);
        if (P->be->ops->copy_cols(P->be->ctx, &d, 0, &src) < 0)
            return specd_err_set(err, "eagle3 extend_slots: copying %d feature rows into the cache failed", len);
        i += len;
    }
    if (extend_tokens(P, s, tokens, n, pos0, err) < 0) return -1;
    if (pos0 > s->n_feat)
        return specd_err_set(err, "eagle3 extend: sequence %lld has features up to %d, extend gives %d.. (gap)",
                             (long long)id, s->n_feat, pos0);
    if (pos0 + n > s->n_feat) s->n_feat = pos0 + n;
    /* bound the window as the chunk pool does (the same runs, so the same draft KV) */
    if (seq_last_pair(s) - s->n_kv >= P->opts.max_rows) return run_pairs(P, &s, 1, NULL, NULL, NULL, err);
    return 0;
}

static int64_t op_feat_cache_slots(void *ctx) {
    const e3_proposer *P = ctx;
    return P->slots ? (int64_t)P->n_fchunks * P->fc : 0;
}

int32_t eagle3_pick(const float *lg, int32_t Vd, const int64_t *used, float temp, double u, float *q) {
    int32_t best = 0;
    for (int32_t i = 1; i < Vd; i++)
        if (lg[i] > lg[best]) best = i;
    if (temp <= 0.0f || !q) {
        if (q) q[used[best]] = 1.0f;
        return best;
    }
    /* softmax(lg / temp) in double, max-subtracted; inverse CDF in draft-id order */
    double sum = 0;
    for (int32_t i = 0; i < Vd; i++) sum += exp(((double)lg[i] - lg[best]) / temp);
    const double target = u * sum;
    double acc = 0;
    int32_t pickd = -1;
    for (int32_t i = 0; i < Vd; i++) {
        double e = exp(((double)lg[i] - lg[best]) / temp);
        acc += e;
        if (pickd < 0 && target < acc) pickd = i;
        q[used[i]] = (float)(e / sum);
    }
    return pickd < 0 ? best : pickd; /* u -> 1 with rounding: the mass is there */
}

/* Whether row i's drafts are sampled (else argmax, on the backend): q wanted (out_q on the host, or the
 * device rows of propose_dev) and a temperature. */
static bool samples(const e3_proposer *P, const float *temps, int32_t ci, const float *out_q) {
    return (out_q || P->qrow) && !P->opts.argmax_drafts && temps && temps[ci] > 0.0f;
}

/* A chain step with a sampled row: every row of lt (logits F32 [nr, Vd], backend memory) drawn by
 * bk_ops.draw (greedy rows at temperature 0: the argmax, as the argmax op gave), ids through d2t into dj
 * over the argmax, q written over the logits in place; u = Philox(key = the sequence's draft seed, counter =
 * the drafted token's position n_tok + j), so a seeded request drafts the same tokens on every backend
 * (backends without the op: eagle3_pick on downloaded logits, same uniform). The sampled rows' q (draft
 * vocabulary) is scattered through `used` into out_q's target-vocabulary row; on a device backend the q rows
 * cross to the host here (one download of nr x Vd floats, the logits' size: the engine verifies such a chain
 * on the host). propose_dev (P->qrow set): the draw writes q into slice j of P->qd instead (row j max_seqs + r,
 * recorded in P->qrow for the sampled rows), nothing is downloaded: the engine's device verifier reads it
 * there. */
static int draw_step(e3_proposer *P, e3_seq **S, const int32_t *map, const int32_t *rows, int32_t nr, int32_t j,
                     int32_t k_max, const float *temps, bk_tensor *lt, const bk_tensor *d2t, bk_tensor *dj,
                     float *out_q, float **lgh, specd_err *err) {
    const bk_ops *op = P->be->ops;
    void *bx = P->be->ctx;
    const int32_t Vd = P->Vd;
    const int64_t *used = eagle3_head_used(P->head);
    const bool hv = P->be->host_visible;
    bk_draw_param *prm = malloc(sizeof(bk_draw_param) * (size_t)nr);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)nr);
    int rc = 0;
    if (!prm || !ids || (!hv && !P->qrow && !*lgh && !(*lgh = malloc(sizeof(float) * (size_t)P->opts.max_seqs * Vd)))) {
        rc = specd_err_set(err, "out of memory");
        goto done;
    }
    for (int32_t r = 0; r < nr; r++) {
        const int32_t ci = map[rows[r]];
        const e3_seq *s = S[rows[r]];
        prm[r] = (bk_draw_param){samples(P, temps, ci, out_q) ? temps[ci] : 0.0f, s->n_tok + j, s->dseed};
    }
    const float *qh = bk_f32(lt);
    if (P->qrow) { /* propose_dev: q stays in slice j of qd, each sampled row's place recorded */
        const size_t G = (size_t)P->opts.max_seqs;
        bk_draw_param *pd = P->dpar.p;
        bk_tensor qt = bk_wrap_f32((float *)P->qd.p + (size_t)j * G * (size_t)Vd, nr, Vd);
        if (j >= P->opts.max_k || (size_t)nr > G) {
            rc = specd_err_set(err, "eagle3: q rows of step %d (%d rows) outside the q buffer [%d, %zu]", j, nr,
                               P->opts.max_k, G);
            goto done;
        }
        if (fill_commit(P, pd, prm, sizeof(bk_draw_param) * (size_t)nr, err) < 0) { rc = -1; goto done; }
        if (op->draw(bx, lt, pd, d2t, dj, &qt) < 0) { rc = specd_err_set(err, "eagle3: draft draw failed"); goto done; }
        for (int32_t r = 0; r < nr; r++)
            if (prm[r].temperature > 0.0f) P->qrow[(size_t)map[rows[r]] * k_max + j] = (int32_t)((size_t)j * G + (size_t)r);
        goto done;
    }
    if (op->draw) {
        bk_draw_param *pd = buf_need(P, &P->dpar, sizeof(bk_draw_param) * (size_t)nr, "draw parameters", err);
        if (!pd) { rc = -1; goto done; }
        if (hv) memcpy(pd, prm, sizeof(bk_draw_param) * (size_t)nr);
        if (fill_commit(P, pd, prm, sizeof(bk_draw_param) * (size_t)nr, err) < 0) { rc = -1; goto done; }
        if (op->draw(bx, lt, pd, d2t, dj, lt) < 0) { rc = specd_err_set(err, "eagle3: draft draw failed"); goto done; }
        if (!hv) {
            if (op->download(bx, *lgh, lt->data, sizeof(float) * (size_t)nr * Vd) < 0) {
                rc = specd_err_set(err, "eagle3: draft q download failed");
                goto done;
            }
            qh = *lgh;
        }
        for (int32_t r = 0; r < nr; r++) {
            if (!(prm[r].temperature > 0.0f)) continue;
            float *q = out_q + ((size_t)map[rows[r]] * k_max + j) * P->Vt;
            const float *qr = qh + (size_t)r * Vd;
            for (int32_t i = 0; i < Vd; i++) q[used[i]] = qr[i];
        }
        goto done;
    }
    /* no draw op: the host draws from downloaded logits, over the argmax in the ids buffer */
    if (!hv) {
        if (op->download(bx, *lgh, lt->data, sizeof(float) * (size_t)nr * Vd) < 0 ||
            op->download(bx, ids, dj->data, sizeof(int32_t) * (size_t)nr) < 0) {
            rc = specd_err_set(err, "eagle3: draft logits download failed");
            goto done;
        }
        qh = *lgh;
    }
    int32_t *idp = hv ? bk_i32(dj) : ids;
    for (int32_t r = 0; r < nr; r++) {
        if (!(prm[r].temperature > 0.0f)) continue;
        float *q = out_q + ((size_t)map[rows[r]] * k_max + j) * P->Vt;
        idp[r] = (int32_t)used[eagle3_pick(qh + (size_t)r * Vd, Vd, used, prm[r].temperature,
                                           kn_philox_uniform(prm[r].seed, prm[r].pos, 0), q)];
    }
    rc = fill_commit(P, dj->data, ids, sizeof(int32_t) * (size_t)nr, err);
done:
    free(prm);
    free(ids);
    return rc;
}

/* The chain for the m sequences S (caller indices map[]) whose first rows
 * hA[0, nr) run_pairs left (rows[r] = index in S of row r): step j turns the
 * nr rows into logits, picks each row's draft (argmax + d2t on the backend;
 * sampled rows on the host from the logits), and feeds (hidden, draft) of
 * the rows that continue to the layer at the next position. The drafted ids
 * stay in backend memory (dr) until the end: ONE download for the whole
 * chain; on a device backend the only other transfers are host -> device
 * (metadata, and gather indices when rows drop out), plus, per step with a
 * sampled row, the logits download the host draw needs. */
static int chain(e3_proposer *P, e3_seq **S, const int32_t *map, int32_t *rows, int32_t nr, const int32_t *k,
                 int32_t k_max, const float *temps, int32_t *out_tokens, float *out_q, specd_err *err) {
    const int32_t H = P->H, Vd = P->Vd, G = nr;
    const bk_ops *op = P->be->ops;
    void *bx = P->be->ctx;
    const bool hv = P->be->host_visible;
    float *hA = P->hA.p, *hB = buf_need(P, &P->hB, sizeof(float) * (size_t)G * H, "chain rows", err);
    float *lg = hB ? buf_need(P, &P->lg, sizeof(float) * (size_t)G * Vd, "draft logits", err) : NULL;
    const size_t DR = ((size_t)G + 3) * (size_t)k_max; /* each step's ids start on 16 bytes (kn_linear.h) */
    int32_t *dr = lg ? buf_need(P, &P->dr, sizeof(int32_t) * DR, "drafted ids", err) : NULL;
    int32_t *nt = dr ? buf_need(P, &P->nt, sizeof(int32_t) * (size_t)G, "next tokens", err) : NULL;
    int32_t *idx_d = nt ? buf_need(P, &P->idx, sizeof(int32_t) * (size_t)G, "gather indices", err) : NULL;
    if (!idx_d) return -1;
    /* host: per step, the caller index of each row (to scatter the one download), and the step's metadata */
    int32_t *who = malloc(sizeof(int32_t) * DR), *stepj = malloc(sizeof(int32_t) * DR);
    int32_t *tok4 = malloc(sizeof(int32_t) * (size_t)G * 4);
    const int32_t **bt = malloc(sizeof(int32_t *) * (size_t)G);
    float *lgh = NULL;          /* host q rows of a sampling step (device backends) */
    int32_t *drh = NULL;        /* host copy of dr */
    int rc = 0, n_dr = 0;
    if (!who || !stepj || !tok4 || !bt) { rc = specd_err_set(err, "out of memory"); goto done; }
    for (size_t i = 0; i < DR; i++) who[i] = -1; /* the alignment gaps hold no draft */
    int32_t *pos = tok4, *seq_of = pos + G, *keep = seq_of + G, *idxh = keep + G;
    const bk_tensor *d2t = eagle3_head_d2t(P->head);
    /* chain: step j consumes (h of step j-1, draft j-1) at position L + j - 1 */
    for (int32_t j = 0; nr > 0; j++) {
        bk_tensor ht = bk_wrap_f32(hA, nr, H), lt = bk_wrap_f32(lg, nr, Vd), dj = bk_wrap_i32(dr + n_dr, nr, 1);
        if (eagle3_logits_t(P->head, &ht, &lt, err) < 0) { rc = -1; goto done; }
        if (op->argmax(bx, &lt, d2t, &dj) < 0) { rc = specd_err_set(err, "eagle3: draft argmax failed"); goto done; }
        bool any_sampled = false;
        for (int32_t r = 0; r < nr; r++) any_sampled |= samples(P, temps, map[rows[r]], out_q);
        if (any_sampled && (rc = draw_step(P, S, map, rows, nr, j, k_max, temps, &lt, d2t, &dj, out_q, &lgh, err)) < 0)
            goto done;
        int32_t nn = 0;
        for (int32_t r = 0; r < nr; r++) {
            const int32_t si = rows[r], ci = map[si];
            who[n_dr + r] = ci;
            stepj[n_dr + r] = j;
            if (j + 1 >= k[ci]) continue;
            e3_seq *s = S[si];
            const int32_t p = seq_last_pair(s) + j + 1;
            if (seq_cover(P, s, p) < 0) continue; /* pool exhausted: this sequence stops here */
            keep[nn] = r;
            pos[nn] = p;
            seq_of[nn] = nn;
            bt[nn] = s->blocks;
            rows[nn++] = si;
        }
        n_dr += (nr + 3) & ~3;
        if (nn == 0) break;
        /* the next step's inputs: (hidden, draft id) of the rows that continue, compacted on the backend */
        bk_tensor g_in, ids;
        float *out;
        if (nn == nr) { /* nobody dropped out: the rows as they are */
            g_in = bk_wrap_f32(hA, nn, H);
            ids = dj;
            out = hB;
        } else {
            int32_t *ix = fill_ptr(P, idx_d, idxh);
            memcpy(ix, keep, sizeof(int32_t) * (size_t)nn);
            bk_tensor it = bk_wrap_i32(idx_d, nn, 1), src = bk_wrap_f32(hA, nr, H);
            g_in = bk_wrap_f32(hB, nn, H);
            ids = bk_wrap_i32(nt, nn, 1);
            if (fill_commit(P, idx_d, ix, sizeof(int32_t) * (size_t)nn, err) < 0 ||
                op->gather_rows(bx, &src, &it, &g_in) < 0 || op->gather_rows(bx, &dj, &it, &ids) < 0) {
                rc = specd_err_set(err, "eagle3: compacting the chain rows failed");
                goto done;
            }
            out = hA;
        }
        nr = nn;
        eagle3_rows er = {nr, hv ? bk_i32(&ids) : NULL, pos, seq_of, nr, bt, NULL};
        bk_tensor ot = bk_wrap_f32(out, nr, H);
        if (eagle3_layer_t(P->head, &er, &ids, &g_in, &ot, err) < 0) { rc = -1; goto done; }
        if (out != hA) { float *sw = hA; hA = hB; hB = sw; } /* the layer's output is the next step's hA */
    }
    /* the one download of the chain: every drafted id of every step */
    const int32_t *ids_h = dr;
    if (!hv) {
        if (!drh && !(drh = malloc(sizeof(int32_t) * DR))) { rc = specd_err_set(err, "out of memory"); goto done; }
        if (op->download(bx, drh, dr, sizeof(int32_t) * (size_t)n_dr) < 0) {
            rc = specd_err_set(err, "eagle3: drafted ids download failed");
            goto done;
        }
        ids_h = drh;
    }
    for (int32_t i = 0; i < n_dr; i++) {
        const int32_t ci = who[i], j = stepj[i], id = ids_h[i];
        if (ci < 0) continue;
        if (id < 0 || id >= P->Vt) { rc = specd_err_set(err, "eagle3: drafted id %d outside the target vocabulary", id); goto done; }
        out_tokens[(size_t)ci * k_max + j] = id;
        if (out_q && !samples(P, temps, ci, out_q)) out_q[((size_t)ci * k_max + j) * P->Vt + id] = 1.0f; /* one-hot */
    }
done:
    /* the ping-pong may have swapped: keep P->hA / P->hB naming the two buffers (either order is fine, except
     * with captured graphs, which read the chain's first rows from gr_x0: P->hA stays that one) */
    if (hA != P->hA.p && !P->n_gr) { void *sw = P->hA.p; P->hA.p = P->hB.p; P->hB.p = sw; size_t c = P->hA.cap; P->hA.cap = P->hB.cap; P->hB.cap = c; }
    free(who);
    free(stepj);
    free(tok4);
    free(bt);
    free(lgh);
    free(drh);
    return rc;
}

/* ------------------------------------------------------------ the chain as CUDA graphs */

/* The captured ops of a chain of K steps over B rows (every row runs every step, no compaction): per step
 * the LM head, argmax + d2t into the ids buffer's slice j (4-aligned), and but after the last the layer at
 * metadata slot j + 1 fed slice j; the hidden rows alternate between gr_x0 and the other chain buffer. am[s]
 * (s = 1 .. K - 1) are the slots' uploaded metadata; pos / seq_of / tables describe them to eagle3_layer_t's
 * host checks. */
static int graph_ops(e3_proposer *P, int32_t B, int32_t K, bk_attn_meta *am, const int32_t *pos,
                     const int32_t *seq_of, const int32_t *const *tables, specd_err *err) {
    const int32_t H = P->H, Vd = P->Vd, pad = (B + 3) & ~3;
    float *x[2] = {P->gr_x0, P->gr_x0 == P->hA.p ? P->hB.p : P->hA.p};
    const bk_tensor *d2t = eagle3_head_d2t(P->head);
    for (int32_t j = 0; j < K; j++) {
        bk_tensor ht = bk_wrap_f32(x[j & 1], B, H), lt = bk_wrap_f32(P->lg.p, B, Vd);
        bk_tensor dj = bk_wrap_i32((int32_t *)P->dr.p + (size_t)j * pad, B, 1);
        if (eagle3_logits_t(P->head, &ht, &lt, err) < 0) return -1;
        if (P->be->ops->argmax(P->be->ctx, &lt, d2t, &dj) < 0) return specd_err_set(err, "eagle3 graph: argmax failed");
        if (j + 1 == K) break;
        eagle3_rows er = {B, NULL, pos + (size_t)(j + 1) * B, seq_of, B + 1, tables, am[j + 1].dev};
        bk_tensor ot = bk_wrap_f32(x[(j + 1) & 1], B, H);
        if (eagle3_layer_t(P->head, &er, &dj, &ht, &ot, err) < 0) return -1;
    }
    return 0;
}

/* Uploads the K - 1 metadata slots of a chain of K steps over B rows: real rows r < nr at positions
 * min(L[r] + s, top[r]) of their own sequence r (tables[r]), padding rows at position 0 of sequence B (the
 * padding block). pos [K, B]. top[r] is the last position the row's own drafts need (chain_graph): a row with
 * fewer drafts than the graph's steps runs its extra steps there, never past the positions the eager chain
 * would use. The caller has set the graph's length class (fixed_len): a position past it is refused here. */
static int graph_meta(e3_proposer *P, int32_t B, int32_t K, int32_t nr, const int32_t *L, const int32_t *top,
                      int32_t *pos, int32_t *seq_of, const int32_t **tables, bk_attn_meta *am, specd_err *err) {
    const bk_graph_ops *go = P->be->ops->graph;
    for (int32_t r = 0; r < B; r++) seq_of[r] = r < nr ? r : B;
    for (int32_t r = nr; r < B; r++) tables[r] = NULL; /* unused rows (no token names them) */
    tables[B] = &P->gr_pad;
    for (int32_t sl = 1; sl < K; sl++) {
        int32_t *ps = pos + (size_t)sl * B;
        for (int32_t r = 0; r < B; r++) ps[r] = r < nr ? (L[r] + sl < top[r] ? L[r] + sl : top[r]) : 0;
        am[sl] = (bk_attn_meta){B, ps, seq_of, tables, B + 1, NULL, NULL};
        if (go->meta_slot(P->be->ctx, sl) < 0 || P->be->ops->meta_upload(P->be->ctx, &am[sl]) < 0) {
            go->meta_slot(P->be->ctx, 0);
            for (int32_t t = 1; t < sl; t++) P->be->ops->meta_release(P->be->ctx, &am[t]);
            for (int32_t t = 1; t < K; t++) am[t].dev = NULL;
            return specd_err_set(err, "eagle3 graph: metadata slot %d upload failed", sl);
        }
    }
    go->meta_slot(P->be->ctx, 0);
    return 0;
}

static void graph_meta_release(e3_proposer *P, int32_t K, bk_attn_meta *am) {
    for (int32_t sl = 1; sl < K; sl++)
        if (am[sl].dev) P->be->ops->meta_release(P->be->ctx, &am[sl]);
}

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Sets (or, with L < 0, clears) the backend's fixed-shape mode at length class L. */
static void graph_shape(e3_proposer *P, int32_t L) {
    const bk_graph_ops *go = P->be->ops->graph;
    go->fixed_shape(P->be->ctx, L >= 0);
    if (go->fixed_len) go->fixed_len(P->be->ctx, L > 0 ? L : 0);
}

/* The graph for nr rows, kg steps, positions < len: the smallest bucket, then the smallest class that holds
 * them (entries sorted by B, k, L with 0 = the backend's bound last); -1 when none. */
static int32_t graph_pick(const e3_proposer *P, int32_t nr, int32_t kg, int32_t len) {
    int32_t B = -1;
    for (int32_t i = 0; i < P->n_gr; i++) {
        if (P->gr[i].B < nr || P->gr[i].k != kg || (B >= 0 && P->gr[i].B != B)) continue;
        B = P->gr[i].B;
        if (P->gr[i].L == 0 || len <= P->gr[i].L) return i;
    }
    return -1;
}

/* The chain of rows hA[0, nr) (rows[r] = index in S) as one graph launch when every row is greedy and a
 * captured graph fits (graph_pick): 1 done (out_tokens filled), 0 = not applicable (run it eagerly), -1
 * failed. */
static int chain_graph(e3_proposer *P, e3_seq **S, const int32_t *map, const int32_t *rows, int32_t nr,
                       const int32_t *k, int32_t k_max, const float *temps, int32_t *out_tokens, float *out_q,
                       specd_err *err) {
    if (!P->n_gr || P->hA.p != P->gr_x0) return 0;
    int32_t kg = 0; /* the group's largest k: the steps the graph runs */
    for (int32_t r = 0; r < nr; r++) {
        if (samples(P, temps, map[rows[r]], out_q)) return 0;
        kg = k[map[rows[r]]] > kg ? k[map[rows[r]]] : kg;
    }
    if (kg < 1 || kg > P->gk) {
        P->gst.eager++;
        return 0;
    }
    /* every row runs kg steps; a row's steps past its own k (whose drafts are ignored) stay at the last position
     * its drafts need, L + k - 1 (L + 1 at k = 1): the eager chain's positions, which the engine keeps below
     * max_model_len (a row near the end of the context at L + kg - 1 would be past the backend's positions) */
    int32_t *top = malloc(sizeof(int32_t) * (size_t)nr), len = 0;
    if (!top) return specd_err_set(err, "out of memory");
    for (int32_t r = 0; r < nr; r++) {
        const int32_t kr = k[map[rows[r]]];
        top[r] = seq_last_pair(S[rows[r]]) + (kr > 1 ? kr - 1 : 1); /* kr <= kg */
        if (kg > 1 && top[r] + 1 > len) len = top[r] + 1; /* the positions the layer calls use: < len */
        if (kg > 1 && seq_cover(P, S[rows[r]], top[r]) < 0) { /* its blocks cover every position the graph writes */
            free(top);
            return 0;
        }
    }
    const int32_t gi = graph_pick(P, nr, kg, len);
    if (gi < 0) {
        free(top);
        P->gst.eager++;
        return 0;
    }
    const int32_t B = P->gr[gi].B, pad = (B + 3) & ~3, GL = P->gr[gi].L;
    int32_t *L = malloc(sizeof(int32_t) * (size_t)B), *pos = malloc(sizeof(int32_t) * (size_t)B * kg);
    int32_t *seq_of = malloc(sizeof(int32_t) * (size_t)B), *ids = malloc(sizeof(int32_t) * (size_t)pad * kg);
    const int32_t **tables = malloc(sizeof(int32_t *) * (size_t)(B + 1));
    bk_attn_meta am[16] = {{0}};
    const bk_graph_ops *go = P->be->ops->graph;
    int rc = -1;
    if (!L || !pos || !seq_of || !ids || !tables) { specd_err_set(err, "out of memory"); goto out; }
    for (int32_t r = 0; r < nr; r++) L[r] = seq_last_pair(S[rows[r]]), tables[r] = S[rows[r]]->blocks;
    graph_shape(P, GL);
    const int mu = graph_meta(P, B, kg, nr, L, top, pos, seq_of, tables, am, err);
    graph_shape(P, -1);
    if (mu < 0) goto out;
    if (go->launch(P->be->ctx, P->gr[gi].exec) < 0) {
        specd_err_set(err, "eagle3: chain graph launch failed");
        graph_meta_release(P, kg, am);
        goto out;
    }
    graph_meta_release(P, kg, am);
    if (P->be->ops->download(P->be->ctx, ids, P->dr.p, sizeof(int32_t) * (size_t)pad * kg) < 0) {
        specd_err_set(err, "eagle3: drafted ids download failed");
        goto out;
    }
    for (int32_t r = 0; r < nr; r++) {
        const int32_t ci = map[rows[r]];
        for (int32_t j = 0; j < k[ci]; j++) {
            const int32_t id = ids[(size_t)j * pad + r];
            if (id < 0 || id >= P->Vt) { specd_err_set(err, "eagle3: drafted id %d outside the target vocabulary", id); goto out; }
            out_tokens[(size_t)ci * k_max + j] = id;
            if (out_q) out_q[((size_t)ci * k_max + j) * P->Vt + id] = 1.0f; /* one-hot (greedy rows only here) */
        }
    }
    P->gst.replays++;
    P->gst.replays_k[kg]++;
    P->gst.short_replays += kg > 1 && GL != P->gst.classes[0];
    P->gst.last_B = B, P->gst.last_k = kg;
    if (kg > 1) P->gst.last_L = GL;
    rc = 1;
out:
    free(L), free(pos), free(seq_of), free(ids), free(tables), free(top);
    return rc;
}

/* Captures the graph of K steps over B rows at length class GL into *exec. */
static int graph_capture_one(e3_proposer *P, int32_t B, int32_t K, int32_t GL, void **exec, specd_err *err) {
    const bk_graph_ops *go = P->be->ops->graph;
    int32_t *L = calloc((size_t)B, sizeof(int32_t)), *pos = calloc((size_t)B * K, sizeof(int32_t));
    int32_t *seq_of = calloc((size_t)B, sizeof(int32_t));
    const int32_t **tables = calloc((size_t)B + 1, sizeof(int32_t *));
    bk_attn_meta am[16] = {{0}};
    int rc = -1;
    *exec = NULL;
    if (!L || !pos || !seq_of || !tables) {
        specd_err_set(err, "out of memory");
        goto out;
    }
    graph_shape(P, GL);
    if (graph_meta(P, B, K, 0, L, NULL, pos, seq_of, tables, am, err) == 0) { /* every row padding */
        if (go->begin(P->be->ctx) < 0) specd_err_set(err, "eagle3 graphs: capture could not begin");
        else {
            const int run = graph_ops(P, B, K, am, pos, seq_of, tables, err);
            const int end = go->end(P->be->ctx, exec);
            if (run == 0 && end == 0) rc = 0;
            else {
                if (run == 0) specd_err_set(err, "eagle3 graphs: capture / instantiation failed (device memory?)");
                if (*exec) go->destroy(P->be->ctx, *exec);
                *exec = NULL;
            }
        }
        graph_meta_release(P, K, am);
    }
    graph_shape(P, -1);
out:
    free(L), free(pos), free(seq_of), free(tables);
    return rc;
}

size_t eagle3_graphs_nodes(int32_t n_buckets, int32_t k, int32_t n_classes) {
    if (n_buckets <= 0 || k <= 0) return 0;
    const size_t tri = (size_t)k * (size_t)(k + 1) / 2; /* steps over the graphs of k = 1 .. K */
    return (size_t)n_buckets * 24 * (1 + (size_t)(n_classes > 0 ? n_classes : 1) * (tri - 1));
}

int eagle3_graphs_capture(spec_proposer *p, const eagle3_graph_opts *o, specd_err *err) {
    e3_proposer *P = p->ctx;
    const bk_graph_ops *go = P->be->ops->graph;
    if (!go || !go->meta_slot || P->be->host_visible)
        return specd_err_set(err, "eagle3 graphs: the %s backend has no graphs with metadata slots", P->be->name);
    if (P->n_gr) return specd_err_set(err, "eagle3 graphs: already captured");
    if (!o || o->k < 1 || o->k > 15 || o->k > P->opts.max_k || o->n_buckets < 1 || !o->buckets || o->max_len < 0)
        return specd_err_set(err, "eagle3 graphs: k = %d (1 .. min(15, max_k %d)), %d buckets, max_len %d",
                             o ? o->k : 0, P->opts.max_k, o ? o->n_buckets : 0, o ? o->max_len : 0);
    int32_t Ls[4];
    const int32_t nL = model_graph_len_classes(o->max_len, o->len_floor, Ls);
    const int32_t per_bucket = 1 + nL * (o->k - 1);
    if ((P->gr_pad = eagle3_kv_alloc(P->head)) < 0) return specd_err_set(err, "eagle3 graphs: no draft KV block left for padding");
    P->gr = calloc((size_t)o->n_buckets * (size_t)per_bucket, sizeof *P->gr);
    if (!P->gr) {
        eagle3_kv_free(P->head, P->gr_pad);
        P->gr_pad = -1;
        return specd_err_set(err, "out of memory");
    }
    P->gk = o->k;
    P->gr_x0 = P->hA.p;
    memset(&P->gst, 0, sizeof P->gst);
    const double t0 = mono_s();
    char list[128];
    size_t lo = 0;
    list[0] = 0;
    for (int32_t i = 0; i < o->n_buckets; i++) {
        const int32_t B = o->buckets[i];
        if (B < 1 || B > P->opts.max_seqs || (i > 0 && B <= o->buckets[i - 1])) {
            LOG_WARN("eagle3 graphs: bucket %d dropped (ascending, 1 .. max_seqs %d)", B, P->opts.max_seqs);
            continue;
        }
        /* k = 1: no layer call, one graph for every length; k >= 2: one per class, ascending (0 = the backend's
         * bound sorts last: model_graph_len_classes gives {0} without max_len) */
        for (int32_t kk = 1; kk <= o->k; kk++)
            for (int32_t li = kk == 1 ? 0 : nL - 1; li >= 0; li--) {
                const int32_t GL = kk == 1 ? 0 : Ls[li];
                void *exec = NULL;
                if (graph_capture_one(P, B, kk, GL, &exec, err) < 0) {
                    eagle3_graphs_release(p);
                    return specd_err_wrap(err, "eagle3 graphs: bucket %d x %d steps (length class %d)", B, kk, GL);
                }
                P->gr[P->n_gr].B = B, P->gr[P->n_gr].k = kk, P->gr[P->n_gr].L = GL;
                P->gr[P->n_gr++].exec = exec;
            }
        if (lo < sizeof list) lo += (size_t)snprintf(list + lo, sizeof list - lo, "%s%d", lo ? "," : "", B);
    }
    if (!P->n_gr) {
        eagle3_graphs_release(p);
        return specd_err_set(err, "eagle3 graphs: no bucket fits (max_seqs %d)", P->opts.max_seqs);
    }
    P->gst.n_graphs = P->n_gr;
    P->gst.n_classes = nL;
    for (int32_t li = 0; li < nL; li++) P->gst.classes[li] = Ls[li];
    char cl[64];
    size_t co = 0;
    for (int32_t li = 0; li < nL; li++) co += (size_t)snprintf(cl + co, sizeof cl - co, "%s%d", li ? "," : "", Ls[li]);
    LOG_INFO("eagle3 graphs: %d captured in %.0f ms: buckets %s x k = 1..%d x length classes %s (k = 1: one class), "
             "about %zu kernel nodes", P->n_gr, (mono_s() - t0) * 1e3, list, o->k, nL > 1 || Ls[0] ? cl : "none",
             eagle3_graphs_nodes(o->n_buckets, o->k, nL));
    return 0;
}

void eagle3_graphs_release(spec_proposer *p) {
    if (!p) return;
    e3_proposer *P = p->ctx;
    for (int32_t i = 0; i < P->n_gr; i++)
        if (P->be->ops->graph) P->be->ops->graph->destroy(P->be->ctx, P->gr[i].exec);
    free(P->gr);
    P->gr = NULL;
    if (P->gr_pad >= 0 && (P->n_gr || P->gk)) eagle3_kv_free(P->head, P->gr_pad);
    P->n_gr = 0;
    P->gk = 0;
    P->gr_pad = -1;
    P->gst.n_graphs = 0;
    P->gst.n_classes = 0;
}

long eagle3_graph_replays(const spec_proposer *p) { return p ? ((const e3_proposer *)p->ctx)->gst.replays : 0; }

void eagle3_graph_get_stats(const spec_proposer *p, eagle3_graph_stats *out) {
    memset(out, 0, sizeof *out);
    if (p) *out = ((const e3_proposer *)p->ctx)->gst;
}

static int op_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                      int32_t *out_tokens, float *out_q, specd_err *err) {
    e3_proposer *P = ctx;
    if (P->mirror && e3m_post_propose(P->mirror, ids, k, n, k_max, temps, out_q != NULL, err) < 0) return -1;
    for (int64_t i = 0; i < (int64_t)n * k_max; i++) out_tokens[i] = -1;
    if (out_q) memset(out_q, 0, sizeof(float) * (size_t)n * k_max * P->Vt);
    if (n <= 0 || k_max <= 0) return 0;
    e3_seq **S = calloc((size_t)n, sizeof *S);
    int32_t *map = calloc((size_t)n, sizeof *map); /* S index -> caller index */
    uint8_t *ok = calloc((size_t)n, 1);
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)n);
    int rc = 0, m = 0;
    if (!S || !map || !ok || !rows) { rc = specd_err_set(err, "out of memory"); goto done; }
    for (int32_t i = 0; i < n; i++) {
        if (k[i] <= 0) continue;
        if (k[i] > k_max) { rc = specd_err_set(err, "eagle3 propose: k[%d] = %d exceeds k_max %d", i, k[i], k_max); goto done; }
        e3_seq *s = seq_find(P, ids[i], NULL);
        if (!s || s->n_tok < 2 || s->n_feat < s->n_tok - 1) {
            LOG_DEBUG("eagle3: sequence %lld has no draftable state (tokens %d, features %d)", (long long)ids[i],
                      s ? s->n_tok : 0, s ? s->n_feat : 0);
            continue;
        }
        S[m] = s;
        map[m++] = i;
    }
    /* groups of at most max_seqs sequences on a device backend (its buffers' rows); all at once on a
     * host-visible one (buffers grow). Rows are independent (batch-invariant ops): same drafts either way. */
    const int32_t G = P->be->host_visible ? (m > 0 ? m : 1) : P->opts.max_seqs;
    for (int32_t g0 = 0; g0 < m; g0 += G) {
        const int32_t gm = m - g0 < G ? m - g0 : G;
        /* first draft of every sequence: its pending real pairs, last row -> hA, in sequence order */
        float *hA = buf_need(P, &P->hA, sizeof(float) * (size_t)gm * P->H, "chain rows", err);
        int32_t nr = 0;
        if (!hA || run_pairs(P, S + g0, gm, hA, ok, &nr, err) < 0) { rc = -1; goto done; }
        int32_t c = 0;
        for (int32_t j = 0; j < gm; j++)
            if (ok[j]) rows[c++] = j;
        int gc = nr > 0 ? chain_graph(P, S + g0, map + g0, rows, nr, k, k_max, temps, out_tokens, out_q, err) : 1;
        if (gc < 0 || (gc == 0 && chain(P, S + g0, map + g0, rows, nr, k, k_max, temps, out_tokens, out_q, err) < 0)) {
            rc = -1;
            goto done;
        }
    }
done:
    free(S);
    free(map);
    free(ok);
    free(rows);
    return rc;
}

/* The backend propose_dev leaves q on: a device backend with the draw op, the q buffer carved at load (not
 * at TP, where rank 0's mirror posts each propose to the workers: q comes to the host there). */
static const backend *op_dev_q_backend(void *ctx) {
    const e3_proposer *P = ctx;
    return P->qd.p && P->t2d.p && !P->mirror && P->be->ops->draw ? P->be : NULL;
}

/* propose with q left on the device (proposer.h): the draws write q into qd (draw_step), P->qrow records
 * where; the drafts are propose's. */
static int op_propose_dev(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max,
                          const float *temps, int32_t *out_tokens, spec_dev_q *dq, specd_err *err) {
    e3_proposer *P = ctx;
    if (!op_dev_q_backend(P))
        return specd_err_set(err, "eagle3 propose_dev: no device q rows on the %s backend", P->be->name);
    if (n > P->opts.max_seqs)
        return specd_err_set(err, "eagle3 propose_dev: %d sequences, the q buffer holds %d (max_seqs)", n,
                             P->opts.max_seqs);
    for (int64_t i = 0; i < (int64_t)n * k_max; i++) dq->row[i] = -1;
    dq->q = P->qd.p, dq->q_vocab = P->Vd, dq->t2d = P->t2d.p;
    if (k_max > P->opts.max_k) {
        /* more drafts than the q buffer's [max_k] slices (a per-request k above the head's, engine API only): the
         * drafts come as propose's, every row -1, so the verifier treats them one-hot (accept x with p(x), else
         * draw from max(0, p - onehot(x))): still lossless, only a lower acceptance */
        LOG_DEBUG("eagle3 propose_dev: k_max %d > the q buffer's %d: drafts verified one-hot", k_max, P->opts.max_k);
        return op_propose(P, ids, k, n, k_max, temps, out_tokens, NULL, err);
    }
    P->qrow = dq->row;
    const int rc = op_propose(P, ids, k, n, k_max, temps, out_tokens, NULL, err);
    P->qrow = NULL;
    return rc;
}

static void op_truncate(void *ctx, int64_t id, int32_t n_ctx) {
    e3_proposer *P = ctx;
    if (P->mirror) e3m_post_seq(P->mirror, 0, id, (uint64_t)(uint32_t)n_ctx);
    e3_seq *s = seq_find(P, id, NULL);
    if (s) seq_truncate(P, s, n_ctx);
}

static void op_seed_seq(void *ctx, int64_t id, uint64_t seed) {
    e3_proposer *P = ctx;
    if (P->mirror) e3m_post_seq(P->mirror, 1, id, seed);
    e3_seq *s = seq_get(P, id);
    if (s) s->dseed = seed; /* out of memory: extend reports it */
}

static void op_free_seq(void *ctx, int64_t id) {
    e3_proposer *P = ctx;
    if (P->mirror) e3m_post_seq(P->mirror, 2, id, 0);
    int32_t i;
    e3_seq *s = seq_find(P, id, &i);
    if (!s) return;
    seq_release_blocks(P, s, 0);
    s->n_kv = s->n_feat = 0;
    feat_release(P, s); /* every chunk back to the pool */
    free(s->fb);
    free(s->wtok);
    free(s->wfeat);
    free(s->blocks);
    free(s);
    P->seqs[i] = P->seqs[--P->n_seqs];
}

static void op_kv_usage(void *ctx, int64_t *total, int64_t *free_blocks) {
    e3_proposer *P = ctx;
    *total = eagle3_head_kv(P->head).n_blocks;
    *free_blocks = eagle3_kv_n_free(P->head);
}

static const spec_proposer_ops EAGLE3_OPS = {
    .aux_layers = op_aux_layers,
    .extend = op_extend,
    .extend_rows = op_extend_rows,
    .feat_cache_slots = op_feat_cache_slots,
    .extend_slots = op_extend_slots,
    .propose = op_propose,
    .dev_q_backend = op_dev_q_backend,
    .propose_dev = op_propose_dev,
    .truncate = op_truncate,
    .seed_seq = op_seed_seq,
    .free_seq = op_free_seq,
    .kv_usage = op_kv_usage,
};

/* ------------------------------------------------------------ construction */

int eagle3_aux_convention_parse(const char *s, eagle3_aux_convention *out, specd_err *err) {
    if (!s || !strcmp(s, "auto")) *out = EAGLE3_AUX_AUTO;
    else if (!strcmp(s, "input")) *out = EAGLE3_AUX_INPUT;
    else if (!strcmp(s, "output")) *out = EAGLE3_AUX_OUTPUT;
    else return specd_err_set(err, "aux_ids_convention '%s': expected auto, input or output", s);
    return 0;
}

int eagle3_head_load_for(const char *dir, model *target, const eagle3_opts *o, eagle3_head **out, specd_err *err) {
    const model_config *mc = model_get_config(target);
    backend *be = o->be ? o->be : model_backend(target);
    const bool shared = be == model_backend(target) && !be->host_visible; /* the target's device copies */
    eagle3_target t = {be, model_embed_weight(target), model_lm_head_weight(target), mc->hidden, mc->vocab,
                       mc->n_layers, shared ? model_embed_placed(target) : NULL,
                       shared ? model_lm_head_placed(target) : NULL};
    const int32_t rows = o->max_rows > 0 ? o->max_rows : 512, seqs = o->max_seqs > 0 ? o->max_seqs : 64;
    eagle3_head_opts ho = {o->aux_ids_convention, model_kv_block_size(target),
                           o->n_blocks > 0 ? o->n_blocks : model_kv_n_blocks(target) + 256, o->q8_0, o->hot_vocab,
                           rows > seqs ? rows : seqs, seqs, o->tp_comm, o->tp_mc};
    return eagle3_head_load(dir, &t, &ho, out, err);
}

int eagle3_load(const char *dir, model *target, const eagle3_opts *o, spec_proposer **out, specd_err *err) {
    *out = NULL;
    e3_proposer *P = calloc(1, sizeof *P);
    if (!P) return specd_err_set(err, "out of memory");
    if (o) P->opts = *o;
    if (P->opts.max_rows <= 0) P->opts.max_rows = 512;
    if (P->opts.max_seqs <= 0) P->opts.max_seqs = 64;
    if (P->opts.max_k <= 0) P->opts.max_k = 16;
    const model_config *mc = model_get_config(target);
    if (eagle3_head_load_for(dir, target, &P->opts, &P->head, err) < 0) {
        free(P);
        return -1;
    }
    P->be = eagle3_head_backend(P->head);
    P->featw = eagle3_head_n_aux(P->head) * mc->hidden;
    P->H = eagle3_head_config(P->head)->hidden;
    P->Vd = eagle3_head_n_scored(P->head); /* rows of the draft logits: the draft vocab or its hot subset */
    P->opts.hot_vocab = NULL;              /* not owned past load */
    P->Vt = mc->vocab;
    P->pub.ops = &EAGLE3_OPS;
    P->pub.ctx = P;
    /* the backend buffers, once (device backends never allocate per step) */
    const size_t R = (size_t)P->opts.max_rows, G = (size_t)P->opts.max_seqs, K = (size_t)P->opts.max_k;
    struct { e3_buf *b; size_t bytes; } bufs[] = {
        {&P->aux, R * (size_t)P->featw * 4}, {&P->g, R * (size_t)P->H * 4}, {&P->hout, R * (size_t)P->H * 4},
        {&P->tok, R * 4}, {&P->idx, (R > G ? R : G) * 4}, {&P->hA, G * (size_t)P->H * 4},
        {&P->hB, G * (size_t)P->H * 4}, {&P->lg, G * (size_t)P->Vd * 4}, {&P->dr, K * (G + 3) * 4}, {&P->nt, G * 4},
        {&P->dpar, G * sizeof(bk_draw_param)},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        if (!(bufs[i].b->p = P->be->ops->buf_alloc(P->be->ctx, bufs[i].bytes))) {
            specd_err_set(err, "cannot allocate the draft's buffers (%zu bytes of %s memory)", bufs[i].bytes,
                          P->be->name);
            eagle3_destroy(&P->pub);
            return -1;
        }
        bufs[i].b->cap = bufs[i].bytes;
    }
    if (!P->be->host_visible) {
        /* the features of the pending pairs stay on the device: a pool of chunks of fc rows (the KV block
         * size), enough for a max_rows window (a prefill run as it fills) and, per sequence of a chain group,
         * a window of k_max + 2 rows across two chunks (eagle3_opts.feat_chunks) */
        P->fc = eagle3_head_kv(P->head).block_size;
        const int32_t fc = P->fc;
        /* or, with feat_cache, the device feature cache: one chunk per target KV block (the target's block size
         * is the head's KV block size), rows = the target's KV slots */
        P->slots = P->opts.feat_cache;
        if (P->slots && (P->opts.aux_rows <= 0 || model_backend(target) != P->be || P->opts.tp_comm)) {
            specd_err_set(err, "eagle3: the device feature cache needs the head on its target's device backend with "
                               "the target's aux buffer (aux_rows > 0), and no tensor parallelism");
            eagle3_destroy(&P->pub);
            return -1;
        }
        P->n_fchunks = P->slots ? model_kv_n_blocks(target)
                       : P->opts.feat_chunks > 0
                           ? P->opts.feat_chunks
                           : 2 * ((P->opts.max_rows + fc - 1) / fc + 1) + P->opts.max_seqs * ((P->opts.max_k + 2 + fc - 1) / fc + 1);
        const size_t pool = (size_t)P->n_fchunks * (size_t)fc * (size_t)P->featw * 4;
        P->ffree = malloc(sizeof(int32_t) * (size_t)P->n_fchunks);
        P->fpool.p = P->ffree ? P->be->ops->buf_alloc(P->be->ctx, pool) : NULL;
        P->fidx.p = P->fpool.p ? P->be->ops->buf_alloc(P->be->ctx, R * 4) : NULL;
        if (!P->fidx.p) {
            if (P->slots)
                specd_err_set(err, "cannot allocate the draft's device feature cache (the target's %d KV blocks of %d "
                                   "slots x %d floats: %zu bytes of %s memory; the plan counts it per KV token with "
                                   "prefix caching)", P->n_fchunks, fc, P->featw, pool, P->be->name);
            else
                specd_err_set(err, "cannot allocate the draft's feature pool (%d chunks of %d rows: %zu bytes of %s "
                                   "memory)", P->n_fchunks, fc, pool, P->be->name);
            eagle3_destroy(&P->pub);
            return -1;
        }
        P->fpool.cap = pool, P->fidx.cap = R * 4;
        /* without TP: the sampled drafts' q rows for the device verifier [max_k, max_seqs, Vd] and the t2d map of
         * the scored vocabulary (propose_dev), carved here: nothing per step */
        if (!P->opts.tp_comm && P->be->ops->draw) {
            const size_t qb = K * G * (size_t)P->Vd * 4, tb = (size_t)P->Vt * 4;
            int32_t *t2d = malloc(tb);
            const int64_t *used = eagle3_head_used(P->head);
            P->qd.p = t2d ? P->be->ops->buf_alloc(P->be->ctx, qb) : NULL;
            P->t2d.p = P->qd.p ? P->be->ops->buf_alloc(P->be->ctx, tb) : NULL;
            if (P->t2d.p) {
                for (int32_t i = 0; i < P->Vt; i++) t2d[i] = -1;
                for (int32_t i = 0; i < P->Vd; i++)
                    if (used[i] >= 0 && used[i] < P->Vt) t2d[used[i]] = i;
            }
            const char *why = !t2d ? "host memory for the map" : !P->qd.p ? "the q rows" : !P->t2d.p ? "the t2d map"
                              : P->be->ops->upload(P->be->ctx, P->t2d.p, t2d, tb) < 0 ? "the t2d upload" : NULL;
            free(t2d);
            if (why) {
                /* optional: without them sampled chains verify on the host over downloaded q (propose) */
                LOG_WARN("eagle3: no device q rows for sampled drafts (%s failed; %zu bytes of %s memory: [%zu, %zu, "
                         "%d] floats + the map): sampled chains are verified on the host", why, qb + tb, P->be->name,
                         K, G, P->Vd);
                buf_drop(P, &P->qd);
                buf_drop(P, &P->t2d);
            } else {
                P->qd.cap = qb, P->t2d.cap = tb;
            }
        }
        for (int32_t i = 0; i < P->n_fchunks && !P->slots; i++) P->ffree[i] = P->n_fchunks - 1 - i;
        P->n_ffree = P->slots ? 0 : P->n_fchunks;
        /* the target leaves its aux capture in a fixed device buffer the pool copies from (extend_rows) */
        int32_t layers[EAGLE3_MAX_AUX];
        const int32_t na = eagle3_head_aux_layers(P->head, layers);
        if (P->opts.aux_rows > 0 && model_backend(target) == P->be) {
            if (model_aux_reserve(target, na, layers, P->opts.aux_rows, err) < 0) {
                specd_err_wrap(err, "eagle3: the target's device aux buffer");
                eagle3_destroy(&P->pub);
                return -1;
            }
            const bk_tensor *ad = model_aux_device(target);
            if (ad) P->src_aux = *ad;
        }
    }
    *out = &P->pub;
    return 0;
}

void eagle3_destroy(spec_proposer *p) {
    if (!p) return;
    e3_proposer *P = p->ctx;
    P->mirror = NULL; /* the workers' copies go with their own proposers */
    eagle3_graphs_release(p);
    while (P->n_seqs > 0) op_free_seq(P, P->seqs[0]->id);
    free(P->seqs);
    e3_buf *bufs[] = {&P->aux, &P->g, &P->hout, &P->tok, &P->idx, &P->hA, &P->hB, &P->lg, &P->dr, &P->nt,
                      &P->dpar, &P->fpool, &P->fidx, &P->qd, &P->t2d};
    if (P->be && !P->be->host_visible) P->be->ops->download(P->be->ctx, NULL, NULL, 0); /* queued work is done */
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) buf_drop(P, bufs[i]);
    eagle3_head_destroy(P->head);
    free(P->ffree);
    free(P);
}

struct eagle3_head *eagle3_proposer_head(spec_proposer *p) { return p ? ((e3_proposer *)p->ctx)->head : NULL; }

void eagle3_proposer_mirror(spec_proposer *p, comm *c) {
    if (p) ((e3_proposer *)p->ctx)->mirror = c;
}
