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

int eagle3_fc(eagle3_head *h, const float *aux, int32_t n, float *g, specd_err *err) {
    if (n <= 0) return 0;
    if (h->tgt.be->ops->matmul(h->tgt.be->ctx, &h->fc, aux, n, g)) return specd_err_set(err, "draft fc matmul failed");
    return 0;
}

static void add_bias(const bk_ops *op, void *bx, float *y, const float *b, int32_t n, int64_t dim) {
    if (!b) return;
    for (int32_t i = 0; i < n; i++) op->add(bx, y + (size_t)i * dim, b, dim);
}

int eagle3_layer(eagle3_head *h, const eagle3_rows *r, const float *g, float *out, specd_err *err) {
    const eagle3_config *c = &h->cfg;
    const bk_ops *op = h->tgt.be->ops;
    void *bx = h->tgt.be->ctx;
    const int32_t T = r->n, H = c->hidden, nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim;
    const int64_t qd = (int64_t)nh * hd, kvd = (int64_t)nkv * hd, I = c->ffn;
    if (T <= 0) return 0;
    for (int32_t i = 0; i < T; i++) {
        if (r->tokens[i] < 0 || r->tokens[i] >= h->embed->rows)
            return specd_err_set(err, "draft token id %d out of range [0, %lld)", r->tokens[i], (long long)h->embed->rows);
        if (r->pos[i] < 0 || r->seq_of[i] < 0 || r->seq_of[i] >= r->n_seqs)
            return specd_err_set(err, "draft row %d: bad position or sequence index", i);
    }
    /* workspace: gn e x[2H] q k v att | gate up   (all [T, *]) */
    const size_t need = (size_t)T * (size_t)(2 * H + 2 * H + qd + 2 * kvd + qd + 2 * I) + (size_t)T * (size_t)H;
    float *gn = eagle3_workspace(h, need);
    if (!gn) return specd_err_set(err, "out of memory for a %d-row draft step", T);
    float *e = gn + (size_t)T * H, *x = e + (size_t)T * H, *q = x + (size_t)T * 2 * H, *k = q + (size_t)T * qd;
    float *v = k + (size_t)T * kvd, *att = v + (size_t)T * kvd, *gate = att + (size_t)T * qd, *up = gate + (size_t)T * I;
    float *tmp = up + (size_t)T * I;

    /* 2-3: hidden_norm(g); residual; x = [input_layernorm(embed(token)) | hidden_norm(g)] */
    op->rmsnorm(bx, g, h->n_hidden, T, H, c->rms_eps, gn);
    if (op->embed(bx, h->embed, r->tokens, T, e) < 0) return specd_err_set(err, "draft embedding lookup failed");
    op->rmsnorm(bx, e, h->n_input, T, H, c->rms_eps, e);
    for (int32_t i = 0; i < T; i++) {
        memcpy(x + (size_t)i * 2 * H, e + (size_t)i * H, sizeof(float) * (size_t)H);
        memcpy(x + (size_t)i * 2 * H + H, gn + (size_t)i * H, sizeof(float) * (size_t)H);
    }
    memcpy(out, c->norm_before_residual ? gn : g, sizeof(float) * (size_t)T * H); /* out = residual */

    /* 4: projections from 2H, RoPE (NeoX), paged KV write, causal attention, o_proj */
    if (op->matmul(bx, &h->wq, x, T, q) || op->matmul(bx, &h->wk, x, T, k) || op->matmul(bx, &h->wv, x, T, v))
        return specd_err_set(err, "draft q/k/v matmul failed");
    add_bias(op, bx, q, h->bq, T, qd);
    add_bias(op, bx, k, h->bk, T, kvd);
    add_bias(op, bx, v, h->bv, T, kvd);
    op->rope(bx, q, T, nh, hd, hd, r->pos, h->inv_freq, 1.0f, true);
    op->rope(bx, k, T, nkv, hd, hd, r->pos, h->inv_freq, 1.0f, true);
    bk_kv_layer kv = eagle3_head_kv(h);
    bk_attn_meta am = {T, r->pos, r->seq_of, r->block_tables, r->n_seqs, NULL};
    op->kv_write(bx, &kv, &am, k, v);
    op->attention(bx, &kv, &am, q, nh, 1.0f / sqrtf((float)hd), att);
    if (op->matmul(bx, &h->wo, att, T, tmp)) return specd_err_set(err, "draft o_proj matmul failed");
    add_bias(op, bx, tmp, h->bo, T, H);

    /* 5: h = residual + attn; h += down(silu(gate(n)) * up(n)) */
    op->add(bx, out, tmp, (int64_t)T * H);
    op->rmsnorm(bx, out, h->n_post, T, H, c->rms_eps, tmp);
    if (op->matmul(bx, &h->wgate, tmp, T, gate) || op->matmul(bx, &h->wup, tmp, T, up))
        return specd_err_set(err, "draft MLP matmul failed");
    op->silu_mul(bx, gate, up, (int64_t)T * I, gate);
    if (op->matmul(bx, &h->wdown, gate, T, tmp)) return specd_err_set(err, "draft down_proj matmul failed");
    op->add(bx, out, tmp, (int64_t)T * H);
    return 0;
}

int eagle3_logits(eagle3_head *h, const float *hid, int32_t n, float *logits, specd_err *err) {
    if (n <= 0) return 0;
    const int32_t H = h->cfg.hidden;
    /* The layer's workspace is free again here; norm into it. */
    float *xn = eagle3_workspace(h, (size_t)n * H);
    if (!xn) return specd_err_set(err, "out of memory");
    h->tgt.be->ops->rmsnorm(h->tgt.be->ctx, hid, h->n_final, n, H, h->cfg.rms_eps, xn);
    if (h->tgt.be->ops->matmul(h->tgt.be->ctx, &h->lm_head, xn, n, logits))
        return specd_err_set(err, "draft lm_head matmul failed");
    return 0;
}
