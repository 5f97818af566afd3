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
 * Threading: engine thread only (the backend parallelises inside ops).
 */
#include <math.h>
#include <string.h>

#include "draft/eagle3_internal.h"

/* The head's buffers are host memory for now (eagle3_head_load refuses a
 * backend that is not host-visible): wrapped as tensors per call, no copies. */
static bk_tensor hw(const float *p, int64_t rows, int64_t cols) { return bk_wrap_f32((float *)(uintptr_t)p, rows, cols); }

int eagle3_fc(eagle3_head *h, const float *aux, int32_t n, float *g, specd_err *err) {
    if (n <= 0) return 0;
    bk_tensor xt = hw(aux, n, h->fc.cols), yt = hw(g, n, h->fc.rows);
    if (h->tgt.be->ops->matmul(h->tgt.be->ctx, &h->fc, &xt, &yt)) return specd_err_set(err, "draft fc matmul failed");
    return 0;
}

int eagle3_layer(eagle3_head *h, const eagle3_rows *r, const float *g, float *out, specd_err *err) {
    const eagle3_config *c = &h->cfg;
    const bk_ops *op = h->tgt.be->ops;
    void *bx = h->tgt.be->ctx;
    /* this rank's heads, KV heads and MLP width (the whole head without tensor parallelism) */
    const int32_t T = r->n, H = c->hidden, hd = c->head_dim;
    const int32_t nh = h->tp ? h->nh_l : c->n_heads, nkv = h->tp ? h->nkv_l : c->n_kv_heads;
    const int64_t qd = (int64_t)nh * hd, kvd = (int64_t)nkv * hd, I = h->tp ? h->ffn_l : c->ffn;
    if (T <= 0) return 0;
    for (int32_t i = 0; i < T; i++) {
        if (r->tokens[i] < 0 || r->tokens[i] >= h->embed->rows)
            return specd_err_set(err, "draft token id %d out of range [0, %lld)", r->tokens[i], (long long)h->embed->rows);
        if (r->pos[i] < 0 || r->seq_of[i] < 0 || r->seq_of[i] >= r->n_seqs)
            return specd_err_set(err, "draft row %d: bad position or sequence index", i);
    }
    if (eagle3_tp_post_layer(h, r, g, err) < 0) return -1; /* rank 0: the workers run the same call on their shards */
    /* workspace: gn e x[2H] q k v att | gate up | tmp   (all [T, *]) */
    const size_t need = (size_t)T * (size_t)(2 * H + 2 * H + qd + 2 * kvd + qd + 2 * I) + (size_t)T * (size_t)H +
                        10 * BK_TAKE_SLACK;
    float *w0 = eagle3_workspace(h, need);
    if (!w0) return specd_err_set(err, "out of memory for a %d-row draft step", T);
    bk_cursor wc = {w0};
    bk_tensor gn = bk_take(&wc, T, H), e = bk_take(&wc, T, H), x = bk_take(&wc, T, 2 * H), q = bk_take(&wc, T, qd);
    bk_tensor k = bk_take(&wc, T, kvd), v = bk_take(&wc, T, kvd), att = bk_take(&wc, T, qd);
    bk_tensor gate = bk_take(&wc, T, I), up = bk_take(&wc, T, I), tmp = bk_take(&wc, T, H);
    bk_tensor gt = hw(g, T, H), outt = hw(out, T, H), ids = bk_wrap_i32(r->tokens, T, 1);
    const bk_tensor nhid = hw(h->n_hidden, 1, H), ninp = hw(h->n_input, 1, H), npost = hw(h->n_post, 1, H);
    const bk_tensor freq = hw(h->inv_freq, 1, hd / 2);
    bk_attn_meta am = {T, r->pos, r->seq_of, r->block_tables, r->n_seqs, NULL, NULL};
#define OPS(call) do { if ((call) < 0) return specd_err_set(err, "draft: %s failed", #call); } while (0)
#define BIAS(y, b, n) do { if (b) { bk_tensor bt_ = hw((b), 1, (n)); OPS(op->add_bias(bx, &(y), &bt_)); } } while (0)

    /* 2-3: hidden_norm(g); residual; x = [input_layernorm(embed(token)) | hidden_norm(g)] */
    OPS(op->rmsnorm(bx, &gt, &nhid, c->rms_eps, &gn));
    if (op->embed(bx, h->embed, &ids, r->tokens, &e) < 0) return specd_err_set(err, "draft embedding lookup failed");
    OPS(op->rmsnorm(bx, &e, &ninp, c->rms_eps, &e));
    OPS(op->copy_cols(bx, &x, 0, &e));
    OPS(op->copy_cols(bx, &x, H, &gn));
    OPS(op->copy_cols(bx, &outt, 0, c->norm_before_residual ? &gn : &gt)); /* out = residual */

    /* 4: projections from 2H, RoPE (NeoX), paged KV write, causal attention, o_proj */
    if (op->matmul(bx, &h->wq, &x, &q) || op->matmul(bx, &h->wk, &x, &k) || op->matmul(bx, &h->wv, &x, &v))
        return specd_err_set(err, "draft q/k/v matmul failed");
    BIAS(q, h->bq, qd);
    BIAS(k, h->bk, kvd);
    BIAS(v, h->bv, kvd);
    OPS(op->rope(bx, &q, nh, hd, hd, &am, &freq, 1.0f, true));
    OPS(op->rope(bx, &k, nkv, hd, hd, &am, &freq, 1.0f, true));
    bk_kv_layer kv = eagle3_head_kv(h);
    OPS(op->kv_write(bx, &kv, &am, &k, &v));
    OPS(op->attention(bx, &kv, &am, &q, nh, 1.0f / sqrtf((float)hd), &att));
    if (op->matmul(bx, &h->wo, &att, &tmp)) return specd_err_set(err, "draft o_proj matmul failed");
    if (eagle3_tp_all_reduce(h, &tmp, err) < 0) return -1; /* row-parallel: partial sums; the bias once, after */
    BIAS(tmp, h->bo, H);

    /* 5: h = residual + attn; h += down(silu(gate(n)) * up(n)) */
    OPS(op->add_rmsnorm(bx, &outt, &tmp, &npost, c->rms_eps, &tmp));
    if (op->matmul(bx, &h->wgate, &tmp, &gate) || op->matmul(bx, &h->wup, &tmp, &up))
        return specd_err_set(err, "draft MLP matmul failed");
    OPS(op->silu_mul(bx, &gate, &up, &gate));
    if (op->matmul(bx, &h->wdown, &gate, &tmp)) return specd_err_set(err, "draft down_proj matmul failed");
    if (eagle3_tp_all_reduce(h, &tmp, err) < 0) return -1;
    OPS(op->add(bx, &outt, &tmp));
#undef BIAS
#undef OPS
    return 0;
}

int eagle3_logits(eagle3_head *h, const float *hid, int32_t n, float *logits, specd_err *err) {
    if (n <= 0) return 0;
    const int32_t H = h->cfg.hidden;
    const bool split = eagle3_tp_vocab_split(h);
    if (eagle3_tp_post_logits(h, hid, n, err) < 0) return -1; /* rank 0, split LM head: the workers join */
    /* The layer's workspace is free again here; norm into it (and the local logits of a split head after it). */
    const size_t Vl = (size_t)h->lm_head.rows;
    float *xn = eagle3_workspace(h, (size_t)n * H + (split ? (size_t)n * Vl : 0));
    if (!xn) return specd_err_set(err, "out of memory");
    float *loc = split ? xn + (size_t)n * H : logits;
    bk_tensor ht = hw(hid, n, H), xt = hw(xn, n, H), g = hw(h->n_final, 1, H), lt = hw(loc, n, (int64_t)Vl);
    if (h->tgt.be->ops->rmsnorm(h->tgt.be->ctx, &ht, &g, h->cfg.rms_eps, &xt) < 0 ||
        h->tgt.be->ops->matmul(h->tgt.be->ctx, &h->lm_head, &xt, &lt))
        return specd_err_set(err, "draft lm_head matmul failed");
    return split ? eagle3_tp_gather_logits(h, loc, n, logits, err) : 0;
}
