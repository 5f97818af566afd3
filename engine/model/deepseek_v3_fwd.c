/*
 * deepseek_v3_fwd.c: the DeepSeek-V3 / Kimi-K2.5 forward pass on the backend
 * op interface: MLA attention over the latent paged cache (absorbed and
 * naive forms), the dense SwiGLU MLP, and the MoE (sigmoid router with the
 * noaux_tc selection bias and group limits, int4 routed experts, shared
 * experts). The math is docs/kimi-k2.5.md (checked against transformers).
 *
 * MLA on existing ops. Per layer the cache holds, per token, the latent
 * [c_kv (kvl) | k_pe (r)] = kvl + r f32 values: one paged plane with one "KV
 * head" of head_dim kvl + r, used as K and as V (bk_kv_layer.k == .v).
 *   absorbed: q_lat_h = W_UK_h^T q_nope_h, so q_nope.k_nope = q_lat.c_kv and
 *     the attention op on q = [q_lat | q_pe] against K = [c_kv | k_pe] gives
 *     exactly the MLA scores; its output on V = [c_kv | k_pe] is
 *     [sum p c_kv | sum p k_pe], whose first kvl values go through W_UV_h.
 *     (The k_pe half of the output is wasted work: r / (kvl + r) = 11% for Kimi.)
 *   naive: the latent of every context position of the batch's sequences is
 *     decompressed through kv_b_proj into per-head K = [k_nope | k_pe] and V,
 *     padded to a common width, into a scratch cache (one block per
 *     sequence), and the attention op runs on that.
 * The model uses one form for every token (dsv3_state.absorbed), so a
 * token's result does not depend on whether it came in a prefill chunk or a
 * decode step.
 * RoPE: the rope op with neox = false rotates adjacent pairs (2i, 2i+1) of
 * q_pe and k_pe in place; transformers rotates the same pairs and writes them
 * de-interleaved, a permutation shared by q and k that leaves q.k unchanged.
 *
 * Batch invariance (backend.h): matmul, rmsnorm, rope and attention are
 * invariant per row; the router works per token; each token's routed sum is
 * accumulated in ascending expert order, then the shared expert is added.
 * Threading: engine thread only (ops parallelise inside).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/deepseek_v3.h"

#define MATMUL(w, x, T, y) \
    do { if (h_matmul(m->be, (w), (x), (T), (y))) return specd_err_set(err, "matmul failed (out of memory)"); } while (0)

/* ------------------------------------------------------------ host forms of the ops
 * DeepSeek-V3 runs on host-visible backends only (model_place refuses the
 * others until its MLA / MoE parts have device ops): its buffers are host
 * memory, wrapped as tensors per call (no copies). */
static int h_matmul(backend *be, const bk_weight *w, const float *x, int32_t T, float *y) {
    return bk_matmul_f32(be, w, x, T, y);
}
static void h_rmsnorm(const backend *be, const float *x, const float *g, int32_t T, int32_t dim, float eps,
                      float *out) {
    bk_tensor xt = bk_wrap_f32((float *)(uintptr_t)x, T, dim), gt = bk_wrap_f32((float *)(uintptr_t)g, 1, dim);
    bk_tensor ot = bk_wrap_f32(out, T, dim);
    be->ops->rmsnorm(be->ctx, &xt, &gt, eps, &ot);
}
/* x: head h of token t at x + (t * n_heads + h) * head_dim (x may point inside a wider row) */
static void h_rope(const backend *be, float *x, int32_t T, int32_t n_heads, int32_t head_dim, int32_t rot_dim,
                   const bk_attn_meta *am, const float *inv_freq, float mscale, bool neox) {
    bk_tensor xt = bk_wrap_f32(x, T, (int64_t)n_heads * head_dim);
    bk_tensor ft = bk_wrap_f32((float *)(uintptr_t)inv_freq, 1, rot_dim / 2);
    be->ops->rope(be->ctx, &xt, n_heads, head_dim, rot_dim, am, &ft, mscale, neox);
}
static int h_attention(const backend *be, const bk_kv_layer *kv, const bk_attn_meta *am, const float *q,
                       int32_t n_heads, float scale, float *out) {
    const int64_t w = (int64_t)n_heads * kv->head_dim;
    bk_tensor qt = bk_wrap_f32((float *)(uintptr_t)q, am->n_tokens, w), ot = bk_wrap_f32(out, am->n_tokens, w);
    return be->ops->attention(be->ctx, kv, am, &qt, n_heads, scale, &ot);
}
static void h_add(const backend *be, float *y, const float *x, int64_t n) {
    bk_tensor yt = bk_wrap_f32(y, 1, n), xt = bk_wrap_f32((float *)(uintptr_t)x, 1, n);
    be->ops->add(be->ctx, &yt, &xt);
}

/* ------------------------------------------------------------ helpers */

/* dst[t, 0..n) = src[t * ld_src + off .. + n) for t < T */
static void gather_cols(float *dst, const float *src, int32_t T, size_t ld_src, size_t off, size_t n) {
    for (int32_t t = 0; t < T; t++) memcpy(dst + (size_t)t * n, src + (size_t)t * ld_src + off, n * sizeof(float));
}
static void scatter_cols(float *dst, size_t ld_dst, size_t off, const float *src, int32_t T, size_t n) {
    for (int32_t t = 0; t < T; t++) memcpy(dst + (size_t)t * ld_dst + off, src + (size_t)t * n, n * sizeof(float));
}

/* ------------------------------------------------------------ MLA */

/* q [T, nh*(n+r)] (q_pe rotated), latent cache of layer l written for this
 * step -> att [T, nh*v]. tmp: at least T * (kvl + max(n, v)) floats. */
static int mla_absorbed(model *m, int32_t l, const bk_attn_meta *am, const float *q, float *att, float *qa,
                        float *oa, float *tmp, specd_err *err) {
    const dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    const dsv3_layer *Y = &s->layers[l];
    const int32_t T = am->n_tokens, nh = m->nh_l, n = c->qk_nope, r = c->qk_rope, v = c->v_head;
    const int32_t kvl = c->kv_lora_rank, D = kvl + r;
    float *in = tmp, *outp = tmp + (size_t)T * (n > v ? n : v);
    /* q_lat = W_UK^T q_nope per head; qa = [q_lat | q_pe] [T, nh, D] */
    for (int32_t h = 0; h < nh; h++) {
        gather_cols(in, q, T, (size_t)nh * (n + r), (size_t)h * (n + r), (size_t)n);
        MATMUL(&Y->w_uk_t[h], in, T, outp);
        scatter_cols(qa, (size_t)nh * D, (size_t)h * D, outp, T, (size_t)kvl);
        for (int32_t t = 0; t < T; t++)
            memcpy(qa + ((size_t)t * nh + h) * D + kvl, q + ((size_t)t * nh + h) * (n + r) + n, sizeof(float) * r);
    }
    bk_kv_layer kv = model_kv_layer(m, l);
    /* oa: per head sum p c_kv [T, nh, kvl] (the backend's MLA op), or the attention op's whole [T, nh, D] */
    const bk_ops *op = m->be->ops;
    const size_t ow = op->mla_attention ? (size_t)kvl : (size_t)D;
    if (op->mla_attention) {
        bk_tensor qt = bk_wrap_f32(qa, T, (int64_t)nh * D), ot = bk_wrap_f32(oa, T, (int64_t)nh * kvl);
        if (op->mla_attention(m->be->ctx, &kv, am, &qt, nh, kvl, s->softmax_scale, &ot) < 0)
            return specd_err_set(err, "MLA attention failed");
    } else if (h_attention(m->be, &kv, am, qa, nh, s->softmax_scale, oa) < 0) {
        return specd_err_set(err, "attention failed");
    }
    /* out_h = W_UV_h (sum p c_kv) */
    for (int32_t h = 0; h < nh; h++) {
        gather_cols(in, oa, T, (size_t)nh * ow, (size_t)h * ow, (size_t)kvl);
        MATMUL(&Y->w_uv[h], in, T, outp);
        scatter_cols(att, (size_t)nh * v, (size_t)h * v, outp, T, (size_t)v);
    }
    return 0;
}

/* The naive form: per-head K/V decompressed from the latent cache. */
static int mla_naive(model *m, int32_t l, const bk_attn_meta *am, const float *q, float *att, specd_err *err) {
    const dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    const dsv3_layer *Y = &s->layers[l];
    const int32_t T = am->n_tokens, nh = m->nh_l, n = c->qk_nope, r = c->qk_rope, v = c->v_head;
    const int32_t kvl = c->kv_lora_rank, Dl = kvl + r, D = (n + r) > v ? (n + r) : v;
    const int32_t S = am->n_seqs;
    int rc = -1;
    int32_t *len = calloc((size_t)S, sizeof *len), *blk = calloc((size_t)S, sizeof *blk);
    const int32_t **tables = calloc((size_t)S, sizeof *tables);
    float *lat = NULL, *kvb = NULL, *tk = NULL, *tv = NULL, *qn = NULL, *on = NULL;
    if (!len || !blk || !tables) goto oom;
    int32_t Lmax = 1;
    for (int32_t t = 0; t < T; t++)
        if (am->pos[t] + 1 > len[am->seq_of[t]]) len[am->seq_of[t]] = am->pos[t] + 1;
    size_t N = 0;
    for (int32_t q0 = 0; q0 < S; q0++) {
        N += (size_t)len[q0];
        if (len[q0] > Lmax) Lmax = len[q0];
        blk[q0] = q0;
        tables[q0] = &blk[q0];
    }
    lat = malloc(sizeof(float) * (N ? N : 1) * (size_t)kvl);
    kvb = malloc(sizeof(float) * (N ? N : 1) * (size_t)nh * (n + v));
    tk = calloc((size_t)S * Lmax * nh * D, sizeof(float));
    tv = calloc((size_t)S * Lmax * nh * D, sizeof(float));
    qn = calloc((size_t)T * nh * D, sizeof(float));
    on = malloc(sizeof(float) * (size_t)T * nh * D);
    if (!lat || !kvb || !tk || !tv || !qn || !on) goto oom;
    /* gather c_kv of every context position, decompress through kv_b */
    bk_kv_layer kv = model_kv_layer(m, l);
    size_t i = 0;
    for (int32_t q0 = 0; q0 < S; q0++)
        for (int32_t p = 0; p < len[q0]; p++, i++) {
            const int32_t b = am->block_tables[q0][p / kv.block_size];
            const size_t o = ((size_t)b * kv.block_size + (size_t)(p % kv.block_size)) * Dl;
            for (int32_t j = 0; j < kvl; j++) lat[i * kvl + j] = kv.k16 ? bk_bf16_to_f32(kv.k16[o + j]) : kv.k[o + j];
        }
    if (N && h_matmul(m->be, &Y->kv_b, lat, (int32_t)N, kvb)) goto oom;
    i = 0;
    for (int32_t q0 = 0; q0 < S; q0++)
        for (int32_t p = 0; p < len[q0]; p++, i++) {
            const int32_t b = am->block_tables[q0][p / kv.block_size];
            const size_t o = ((size_t)b * kv.block_size + (size_t)(p % kv.block_size)) * Dl + kvl;
            float kpe[4096]; /* qk_rope_head_dim <= 4096 (hf_config.c bounds it; 64 for DeepSeek-V3 / Kimi) */
            for (int32_t j = 0; j < r; j++) kpe[j] = kv.k16 ? bk_bf16_to_f32(kv.k16[o + j]) : kv.k[o + j];
            for (int32_t h = 0; h < nh; h++) {
                const float *src = kvb + (i * nh + h) * (size_t)(n + v);
                float *kd = tk + (((size_t)q0 * Lmax + p) * nh + h) * D, *vd = tv + (((size_t)q0 * Lmax + p) * nh + h) * D;
                memcpy(kd, src, sizeof(float) * n);
                memcpy(kd + n, kpe, sizeof(float) * r);
                memcpy(vd, src + n, sizeof(float) * v);
            }
        }
    for (int32_t t = 0; t < T; t++)
        for (int32_t h = 0; h < nh; h++)
            memcpy(qn + ((size_t)t * nh + h) * D, q + ((size_t)t * nh + h) * (n + r), sizeof(float) * (n + r));
    bk_kv_layer tkv = {.k = tk, .v = tv, .block_size = Lmax, .n_kv_heads = nh, .head_dim = D, .n_blocks = S};
    bk_attn_meta tm = *am;
    tm.block_tables = tables;
    if (h_attention(m->be, &tkv, &tm, qn, nh, s->softmax_scale, on) < 0) goto oom;
    for (int32_t t = 0; t < T; t++)
        for (int32_t h = 0; h < nh; h++)
            memcpy(att + ((size_t)t * nh + h) * v, on + ((size_t)t * nh + h) * D, sizeof(float) * v);
    rc = 0;
    goto done;
oom:
    specd_err_set(err, "out of memory in naive MLA (%d tokens)", T);
done:
    free(len); free(blk); free(tables); free(lat); free(kvb); free(tk); free(tv); free(qn); free(on);
    return rc;
}

/* ------------------------------------------------------------ MoE */

/* dsv3_route (the router of one token): deepseek_v3_route.c */

/* SwiGLU MLP: y [T, H] = down(silu(gate(x)) * up(x)); g, u: [T, width]. */
static int swiglu(model *m, const bk_weight *gate, const bk_weight *up, const bk_weight *down, const float *x,
                  int32_t T, float *g, float *u, float *y, specd_err *err) {
    MATMUL(gate, x, T, g);
    MATMUL(up, x, T, u);
    bk_tensor gt = bk_wrap_f32(g, T, gate->rows), ut = bk_wrap_f32(u, T, gate->rows);
    m->be->ops->silu_mul(m->be->ctx, &gt, &ut, &gt);
    MATMUL(down, g, T, y);
    return 0;
}

/* MoE block: h [T, H] (normed) -> y [T, H] = sum_k w_k expert_k(h) + shared(h). */
static int moe_forward(model *m, int32_t l, const float *h, int32_t T, float *y, specd_err *err) {
    const dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    const dsv3_layer *Y = &s->layers[l];
    const int32_t H = c->hidden, E = c->n_routed_experts, k = c->n_experts_per_tok, Im = c->moe_intermediate;
    const int32_t Is = Im * c->n_shared_experts, W = Is > Im ? Is : Im;
    int rc = -1;
    float *logits = malloc(sizeof(float) * (size_t)T * E), *scr = malloc(sizeof(float) * 2 * (size_t)E);
    float *w = malloc(sizeof(float) * (size_t)T * k), *xe = malloc(sizeof(float) * (size_t)T * H);
    float *g = malloc(sizeof(float) * (size_t)T * W), *u = malloc(sizeof(float) * (size_t)T * W);
    float *ye = malloc(sizeof(float) * (size_t)T * H);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k), *tl = malloc(sizeof(int32_t) * (size_t)T);
    float *wl = malloc(sizeof(float) * (size_t)T);
    if (!logits || !scr || !w || !xe || !g || !u || !ye || !ids || !tl || !wl) {
        specd_err_set(err, "out of memory in MoE (%d tokens)", T);
        goto done;
    }
    /* router: f32 logits, per-token selection */
    if (h_matmul(m->be, &Y->router, h, T, logits)) { specd_err_set(err, "matmul failed"); goto done; }
    for (int32_t t = 0; t < T; t++)
        dsv3_route(c, logits + (size_t)t * E, Y->router_bias, scr, ids + (size_t)t * k, w + (size_t)t * k);
    /* routed experts in ascending id, each on its tokens; y[t] accumulates in that order */
    memset(y, 0, sizeof(float) * (size_t)T * H);
    for (int32_t e = 0; e < E; e++) {
        int32_t nt = 0;
        for (int32_t t = 0; t < T; t++)
            for (int32_t j = 0; j < k; j++)
                if (ids[(size_t)t * k + j] == e) { tl[nt] = t; wl[nt++] = w[(size_t)t * k + j]; }
        if (!nt) continue;
        for (int32_t i = 0; i < nt; i++) memcpy(xe + (size_t)i * H, h + (size_t)tl[i] * H, sizeof(float) * H);
        if (swiglu(m, &Y->ex_gate[e], &Y->ex_up[e], &Y->ex_down[e], xe, nt, g, u, ye, err) < 0) goto done;
        for (int32_t i = 0; i < nt; i++) {
            float *yt = y + (size_t)tl[i] * H;
            const float *src = ye + (size_t)i * H;
            for (int32_t d = 0; d < H; d++) yt[d] += src[d] * wl[i];
        }
    }
    /* shared experts: added after the routed sum (transformers' order) */
    if (Y->has_shared) {
        if (swiglu(m, &Y->gate, &Y->up, &Y->down, h, T, g, u, ye, err) < 0) goto done;
        h_add(m->be, y, ye, (int64_t)T * H);
    }
    rc = 0;
done:
    free(logits); free(scr); free(w); free(xe); free(g); free(u); free(ye); free(ids); free(tl); free(wl);
    return rc;
}

/* ------------------------------------------------------------ forward */

int dsv3_forward(model *m, const model_batch *b, specd_err *err) {
    const dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    const int32_t T = b->n_tokens, H = c->hidden, nh = m->nh_l, n = c->qk_nope, r = c->qk_rope, v = c->v_head;
    const int32_t kvl = c->kv_lora_rank, D = kvl + r, ql = c->q_lora_rank > 0 ? c->q_lora_rank : 1;
    const int32_t nw = n > v ? n : v, I = c->intermediate;
    /* workspace: x xn qa q lat ckv qabs oabs tmp att y | g u  (all [T, *]) */
    const size_t per_tok = (size_t)2 * H + ql + (size_t)nh * (n + r) + D + kvl + (size_t)2 * nh * D + (kvl + nw) +
                           (size_t)nh * v + H + (size_t)2 * I;
    float *x = model_workspace(m, (size_t)T * per_tok);
    if (!x) return specd_err_set(err, "out of memory for a %d-token step", T);
    float *xn = x + (size_t)T * H, *qlo = xn + (size_t)T * H, *q = qlo + (size_t)T * ql;
    float *lat = q + (size_t)T * nh * (n + r), *ckv = lat + (size_t)T * D, *qabs = ckv + (size_t)T * kvl;
    float *oabs = qabs + (size_t)T * nh * D, *tmp = oabs + (size_t)T * nh * D, *att = tmp + (size_t)T * (kvl + nw);
    float *y = att + (size_t)T * nh * v, *g = y + (size_t)T * H, *u = g + (size_t)T * I;

    bk_tensor ids = bk_wrap_i32(b->tokens, T, 1), xt = bk_wrap_f32(x, T, H);
    if (m->be->ops->embed(m->be->ctx, &m->embed, &ids, b->tokens, &xt) < 0)
        return specd_err_set(err, "token id out of range");
    const bk_attn_meta am = {T, b->pos, b->seq_of, b->block_tables, b->n_seqs, b->tree_mask, NULL};
    for (int32_t l = 0; l < c->n_layers; l++) {
        const dsv3_layer *Y = &s->layers[l];
        for (int32_t a = 0; a < b->n_aux; a++) /* EAGLE-3 capture: residual stream entering layer l */
            if (b->aux && b->aux_layers[a] == l)
                for (int32_t t = 0; t < T; t++)
                    memcpy(b->aux + ((size_t)t * b->n_aux + a) * H, x + (size_t)t * H, sizeof(float) * H);
        /* attention rmsnorm; q = q_b(rmsnorm(q_a(x))) */
        h_rmsnorm(m->be, x, Y->attn_norm, T, H, (float)c->rms_eps, xn);
        if (c->q_lora_rank > 0) {
            MATMUL(&Y->q_a, xn, T, qlo);
            h_rmsnorm(m->be, qlo, Y->q_a_norm, T, ql, DSV3_LORA_NORM_EPS, qlo);
            MATMUL(&Y->q_b, qlo, T, q);
        } else {
            MATMUL(&Y->q_b, xn, T, q);
        }
        /* latent = [rmsnorm(c_kv) | k_pe] from kv_a_proj_with_mqa */
        MATMUL(&Y->kv_a, xn, T, lat);
        gather_cols(ckv, lat, T, (size_t)D, 0, (size_t)kvl);
        h_rmsnorm(m->be, ckv, Y->kv_a_norm, T, kvl, DSV3_LORA_NORM_EPS, ckv);
        scatter_cols(lat, (size_t)D, 0, ckv, T, (size_t)kvl);
        /* decoupled RoPE (YaRN inv_freq, mscale on cos/sin) on q_pe of each head and the shared k_pe */
        h_rope(m->be, q + n, T, nh, n + r, r, &am, m->inv_freq, s->rope_mscale, false);
        h_rope(m->be, lat + kvl, T, 1, D, r, &am, m->inv_freq, s->rope_mscale, false);
        /* latent into the paged cache (one plane: K == V) */
        bk_kv_layer kv = model_kv_layer(m, l);
        bk_tensor latt = bk_wrap_f32(lat, T, D);
        if (m->be->ops->mla_latent_write ? m->be->ops->mla_latent_write(m->be->ctx, &kv, &am, &latt, kvl) < 0
                                         : m->be->ops->kv_write(m->be->ctx, &kv, &am, &latt, &latt) < 0)
            return specd_err_set(err, "latent write failed (layer %d)", l);
        if (s->absorbed) {
            if (mla_absorbed(m, l, &am, q, att, qabs, oabs, tmp, err) < 0) return -1;
        } else if (mla_naive(m, l, &am, q, att, err) < 0) {
            return -1;
        }
        /* output projection (row-parallel at TP > 1: partial sums all-reduced) + residual */
        MATMUL(&Y->o, att, T, y);
        bk_tensor yt = bk_wrap_f32(y, T, H);
        if (model_tp_all_reduce(m, &yt, err) < 0) return -1;
        h_add(m->be, x, y, (int64_t)T * H);
        /* MLP rmsnorm; dense SwiGLU or MoE; residual */
        h_rmsnorm(m->be, x, Y->ffn_norm, T, H, (float)c->rms_eps, xn);
        if (!Y->moe) {
            if (swiglu(m, &Y->gate, &Y->up, &Y->down, xn, T, g, u, y, err) < 0) return -1;
        } else if (moe_forward(m, l, xn, T, y, err) < 0) {
            return specd_err_wrap(err, "layer %d", l);
        }
        /* each rank's experts / MLP slice gave a partial sum (after the fixed-order expert combine) */
        if (model_tp_all_reduce(m, &yt, err) < 0) return -1;
        h_add(m->be, x, y, (int64_t)T * H);
    }
    return model_finish_outputs(m, b, &xt, err);
}
