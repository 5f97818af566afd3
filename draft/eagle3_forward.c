/*
 * eagle3_forward.c: the single-layer EAGLE-3 draft forward on the backend op
 * interface (REFERENCE.md §2, steps 1-7; Li et al. 2025, "EAGLE-3: Scaling up
 * Inference Acceleration of Large Language Models via Training-Time Test").
 *
 *   1. g = fc(concat(h_low, h_mid, h_high))          eagle3_fc, target rows only
 *   2. residual = g, or hidden_norm(g) when norm_before_residual
 *   3. x = concat(input_layernorm(embed(token)), hidden_norm(g))  [2H], EMBEDDING FIRST
 *   4. q/k/v = x W^T (+ bias; o_proj too, HF attention_bias); NeoX RoPE with the draft's theta; causal
 *      attention over the draft's own paged KV cache; o_proj
 *   5. h = residual + attn;  h = h + down(silu(gate(n)) * up(n)), n = post_attention_layernorm(h)
 *   6. h (pre-norm) is the next chained step's g   (the proposer's business)
 *   7. logits = lm_head(norm(h))                      eagle3_logits
 *
 * Every op is batch-invariant, so a row's output does not depend on which
 * other rows or sequences share the call.
 *
 * Residency: the *_t functions take tensors in the head's backend memory
 * (device memory on a device backend: weights, norms, KV and workspace were
 * placed there at load, eagle3_weights.c head_place), so a call launches ops
 * and uploads only its step metadata (ops->meta_upload); nothing is read
 * back. The host-pointer functions wrap host buffers for them and need a
 * host-visible backend (tests, CPU tensor-parallel ranks). At device tensor
 * parallelism (eagle3_tp_load) every rank runs these on its shard: the
 * all-reduces and the LM head's all-gather are its only cross-rank traffic.
 * Threading: engine thread only (the backend parallelises inside ops).
 */
#include <math.h>
#include <string.h>

#include "draft/eagle3_internal.h"

/* Host buffers as tensors (host-visible backends only). */
static bk_tensor hw(const float *p, int64_t rows, int64_t cols) { return bk_wrap_f32((float *)(uintptr_t)p, rows, cols); }

/* A norm / bias / frequency vector [1, n]: the placed copy on a device
 * backend, the host one wrapped otherwise (which eagle3_tp.c may have
 * re-pointed at this rank's slice after load). */
static bk_tensor vec(const eagle3_head *h, const float *host, const bk_tensor *placed, int64_t n) {
    return h->dev ? bk_reshape(*placed, 1, n) : hw(host, 1, n);
}

static int need_host(const eagle3_head *h, specd_err *err) {
    if (h->dev) return specd_err_set(err, "eagle3: host-buffer forward on the %s backend (use the *_t functions)",
                                     h->tgt.be->name);
    return 0;
}

int eagle3_fc_t(eagle3_head *h, const bk_tensor *aux, bk_tensor *g, specd_err *err) {
    if (aux->rows <= 0) return 0;
    if (aux->cols != h->fc.cols || g->rows != aux->rows || g->cols != h->fc.rows)
        return specd_err_set(err, "draft fc: aux [%lld, %lld], g [%lld, %lld]", (long long)aux->rows,
                             (long long)aux->cols, (long long)g->rows, (long long)g->cols);
    if (h->tgt.be->ops->matmul(h->tgt.be->ctx, &h->fc, aux, g)) return specd_err_set(err, "draft fc matmul failed");
    return 0;
}

int eagle3_fc(eagle3_head *h, const float *aux, int32_t n, float *g, specd_err *err) {
    if (n <= 0) return 0;
    if (need_host(h, err) < 0) return -1;
    bk_tensor xt = hw(aux, n, h->fc.cols), yt = hw(g, n, h->fc.rows);
    return eagle3_fc_t(h, &xt, &yt, err);
}

size_t eagle3_layer_ws(const eagle3_head *h, int32_t T) {
    const eagle3_config *c = &h->cfg;
    const int64_t H = c->hidden, hd = c->head_dim;
    const int64_t qd = (int64_t)(h->tp ? h->nh_l : c->n_heads) * hd, kvd = (int64_t)(h->tp ? h->nkv_l : c->n_kv_heads) * hd;
    const int64_t I = h->tp ? h->ffn_l : c->ffn;
    /* gn e x[2H] q k v att | gate up | tmp   (all [T, *]) */
    return (size_t)T * (size_t)(2 * H + 2 * H + qd + 2 * kvd + qd + 2 * I) + (size_t)T * (size_t)H + 10 * BK_TAKE_SLACK;
}

int eagle3_layer_t(eagle3_head *h, const eagle3_rows *r, const bk_tensor *ids_in, const bk_tensor *g,
                   bk_tensor *outt, specd_err *err) {
    const eagle3_config *c = &h->cfg;
    const bk_ops *op = h->tgt.be->ops;
    void *bx = h->tgt.be->ctx;
    /* this rank's heads, KV heads and MLP width (the whole head without tensor parallelism) */
    const int32_t T = r->n, H = c->hidden, hd = c->head_dim;
    const int32_t nh = h->tp ? h->nh_l : c->n_heads, nkv = h->tp ? h->nkv_l : c->n_kv_heads;
    const int64_t qd = (int64_t)nh * hd, kvd = (int64_t)nkv * hd, I = h->tp ? h->ffn_l : c->ffn;
    if (T <= 0) return 0;
    if (!ids_in && (h->dev || !r->tokens)) return specd_err_set(err, "draft layer: no token ids");
    if (g->rows != T || g->cols != H || outt->rows != T || outt->cols != H || g->data == outt->data ||
        (ids_in && ids_in->rows != T))
        return specd_err_set(err, "draft layer: %d rows, g [%lld, %lld], out [%lld, %lld]", T, (long long)g->rows,
                             (long long)g->cols, (long long)outt->rows, (long long)outt->cols);
    for (int32_t i = 0; i < T; i++) {
        if (r->tokens && (r->tokens[i] < 0 || r->tokens[i] >= h->embed->rows))
            return specd_err_set(err, "draft token id %d out of range [0, %lld)", r->tokens[i], (long long)h->embed->rows);
        if (r->pos[i] < 0 || r->seq_of[i] < 0 || r->seq_of[i] >= r->n_seqs)
            return specd_err_set(err, "draft row %d: bad position or sequence index", i);
    }
    if (h->tp && !eagle3_tp_mirror(h) && !r->tokens)
        return specd_err_set(err, "draft layer: tensor parallelism (CPU) needs the host token ids");
    if (eagle3_tp_post_layer(h, r, bk_f32(g), err) < 0) return -1; /* rank 0: the workers run the same call */
    float *w0 = eagle3_workspace(h, eagle3_layer_ws(h, T));
    if (!w0) return specd_err_set(err, "no workspace for a %d-row draft step", T);
    bk_cursor wc = {w0};
    bk_tensor gn = bk_take(&wc, T, H), e = bk_take(&wc, T, H), x = bk_take(&wc, T, 2 * H), q = bk_take(&wc, T, qd);
    bk_tensor k = bk_take(&wc, T, kvd), v = bk_take(&wc, T, kvd), att = bk_take(&wc, T, qd);
    bk_tensor gate = bk_take(&wc, T, I), up = bk_take(&wc, T, I), tmp = bk_take(&wc, T, H);
    const bk_tensor ids = ids_in ? bk_reshape(*ids_in, T, 1) : bk_wrap_i32(r->tokens, T, 1);
    const bk_tensor nhid = vec(h, h->n_hidden, &h->t_hidden, H), ninp = vec(h, h->n_input, &h->t_input, H);
    const bk_tensor npost = vec(h, h->n_post, &h->t_post, H), freq = vec(h, h->inv_freq, &h->t_inv_freq, hd / 2);
    bk_attn_meta am = {T, r->pos, r->seq_of, r->block_tables, r->n_seqs, NULL, r->meta_dev};
    if (!r->meta_dev && op->meta_upload(bx, &am) < 0) return specd_err_set(err, "draft: metadata upload failed");
    int rc = -1;
#define OPS(call) do { if ((call) < 0) { specd_err_set(err, "draft: %s failed", #call); goto done; } } while (0)
#define BIAS(y, b, tb, n) do { if (b) { bk_tensor bt_ = vec(h, (b), &(tb), (n)); OPS(op->add_bias(bx, &(y), &bt_)); } } while (0)

    /* 2-3: hidden_norm(g); residual; x = [input_layernorm(embed(token)) | hidden_norm(g)] */
    OPS(op->rmsnorm(bx, g, &nhid, c->rms_eps, &gn));
    OPS(op->embed(bx, h->embed, &ids, r->tokens, &e));
    OPS(op->rmsnorm(bx, &e, &ninp, c->rms_eps, &e));
    OPS(op->copy_cols(bx, &x, 0, &e));
    OPS(op->copy_cols(bx, &x, H, &gn));
    OPS(op->copy_cols(bx, outt, 0, c->norm_before_residual ? &gn : g)); /* out = residual */

    /* 4: projections from 2H, RoPE (NeoX), paged KV write, causal attention, o_proj */
    OPS(op->matmul(bx, &h->wq, &x, &q));
    OPS(op->matmul(bx, &h->wk, &x, &k));
    OPS(op->matmul(bx, &h->wv, &x, &v));
    BIAS(q, h->bq, h->t_bq, qd);
    BIAS(k, h->bk, h->t_bk, kvd);
    BIAS(v, h->bv, h->t_bv, kvd);
    OPS(op->rope(bx, &q, nh, hd, hd, &am, &freq, 1.0f, true));
    OPS(op->rope(bx, &k, nkv, hd, hd, &am, &freq, 1.0f, true));
    bk_kv_layer kv = eagle3_head_kv(h);
    OPS(op->kv_write(bx, &kv, &am, &k, &v));
    OPS(op->attention(bx, &kv, &am, &q, nh, 1.0f / sqrtf((float)hd), &att));
    OPS(op->matmul(bx, &h->wo, &att, &tmp));
    if (eagle3_tp_all_reduce(h, &tmp, err) < 0) goto done; /* row-parallel: partial sums; the bias once, after */
    BIAS(tmp, h->bo, h->t_bo, H);

    /* 5: h = residual + attn; h += down(silu(gate(n)) * up(n)) */
    OPS(op->add_rmsnorm(bx, outt, &tmp, &npost, c->rms_eps, &tmp));
    OPS(op->matmul(bx, &h->wgate, &tmp, &gate));
    OPS(op->matmul(bx, &h->wup, &tmp, &up));
    OPS(op->silu_mul(bx, &gate, &up, &gate));
    OPS(op->matmul(bx, &h->wdown, &gate, &tmp));
    if (eagle3_tp_all_reduce(h, &tmp, err) < 0) goto done;
    OPS(op->add(bx, outt, &tmp));
#undef BIAS
#undef OPS
    rc = 0;
done:
    if (!r->meta_dev) op->meta_release(bx, &am);
    return rc;
}

int eagle3_layer(eagle3_head *h, const eagle3_rows *r, const float *g, float *out, specd_err *err) {
    if (r->n <= 0) return 0;
    if (need_host(h, err) < 0) return -1;
    bk_tensor gt = hw(g, r->n, h->cfg.hidden), ot = hw(out, r->n, h->cfg.hidden);
    return eagle3_layer_t(h, r, NULL, &gt, &ot, err);
}

int eagle3_logits_t(eagle3_head *h, const bk_tensor *hid, bk_tensor *logits, specd_err *err) {
    const int32_t n = (int32_t)hid->rows, H = h->cfg.hidden;
    if (n <= 0) return 0;
    const bool split = eagle3_tp_vocab_split(h);
    const size_t Vl = (size_t)h->lm_head.rows;
    if (hid->cols != H || logits->rows != n || logits->cols != eagle3_head_n_scored(h))
        return specd_err_set(err, "draft logits: hid [%lld, %lld], logits [%lld, %lld] (%d scored ids)",
                             (long long)hid->rows, (long long)hid->cols, (long long)logits->rows,
                             (long long)logits->cols, eagle3_head_n_scored(h));
    if (eagle3_tp_post_logits(h, bk_f32(hid), n, err) < 0) return -1; /* rank 0, split LM head: the workers join */
    /* The layer's workspace is free again here; norm into it (and the local logits of a split head after it;
     * on a device, mirrored, then the all-gathered [N, n, Vl] rows, interleaved into logits on every rank) */
    const bool dev_split = split && eagle3_tp_mirror(h);
    const size_t N = (size_t)eagle3_tp_size(h);
    float *xn = eagle3_workspace(h, (size_t)n * H + (split ? (size_t)n * Vl * (dev_split ? 1 + N : 1) : 0));
    if (!xn) return specd_err_set(err, "no workspace for %d draft logits rows", n);
    bk_tensor xt = bk_wrap_f32(xn, n, H), gf = vec(h, h->n_final, &h->t_final, H);
    bk_tensor lt = split ? bk_wrap_f32(xn + (size_t)n * H, n, (int64_t)Vl) : *logits;
    if (h->tgt.be->ops->rmsnorm(h->tgt.be->ctx, hid, &gf, h->cfg.rms_eps, &xt) < 0 ||
        h->tgt.be->ops->matmul(h->tgt.be->ctx, &h->lm_head, &xt, &lt))
        return specd_err_set(err, "draft lm_head matmul failed");
    if (dev_split) {
        bk_tensor all = bk_wrap_f32(xn + (size_t)n * H + (size_t)n * Vl, (int64_t)N * n, (int64_t)Vl);
        return eagle3_tp_gather_logits_t(h, &lt, &all, logits, err);
    }
    return split ? eagle3_tp_gather_logits(h, bk_f32(&lt), n, bk_f32(logits), err) : 0;
}

int eagle3_logits(eagle3_head *h, const float *hid, int32_t n, float *logits, specd_err *err) {
    if (n <= 0) return 0;
    if (need_host(h, err) < 0) return -1;
    bk_tensor ht = hw(hid, n, h->cfg.hidden), lt = hw(logits, n, eagle3_head_n_scored(h));
    return eagle3_logits_t(h, &ht, &lt, err);
}
