/*
 * deepseek_v3_fwd.c: the DeepSeek-V3 / Kimi-K2.5 forward pass on the backend
 * op interface: MLA attention over the latent paged cache (absorbed and
 * naive forms), the dense SwiGLU MLP, and the MoE (sigmoid router with the
 * noaux_tc selection bias and group limits, int4 routed experts, shared
 * experts). The math is docs/kimi-k2.5.md (checked against transformers).
 *
 * One forward for every backend (host-visible or not): every activation is a
 * bk_tensor carved from the model's workspace, every weight, norm and bias is
 * what dsv3_place made backend-resident (zero-copy views on the CPU), and the
 * step follows the phases of model_internal.h (MODEL_PH_UP: the token ids, the
 * row-gather index lists and the attention metadata uploaded; MODEL_PH_RUN:
 * only kernel launches, so a CUDA graph can capture it; MODEL_PH_DOWN: aux
 * and logits downloaded). Nothing is allocated per step on the device: the
 * workspace grows to the largest step (model_graph.c sizes it before a
 * capture), the backend's MLA scratch and MoE buffers are carved at create.
 * Host-only parts: the naive MLA form (refused on a device backend) and, where
 * the backend has no moe op (the CPU), moe_forward: the CPU's reference path.
 *
 * MLA. Per layer the cache holds, per token, the latent [c_kv (kvl) | k_pe
 * (r)] = kvl + r values (f32, or bf16: model_load_opts.latent_bf16, always on
 * a device): one paged plane with one "KV head" of head_dim kvl + r, used as K
 * and as V (bk_kv_layer.k == .v).
 *   absorbed: q_lat_h = W_UK_h^T q_nope_h, so q_nope.k_nope = q_lat.c_kv and
 *     attention on q = [q_lat | q_pe] against K = [c_kv | k_pe] gives exactly
 *     the MLA scores; bk_ops.mla_attention returns per head sum_p p c_kv, which
 *     goes through W_UV_h (CPU: the attention op + the c_kv columns; CUDA:
 *     kn_mla). The per-head column blocks (q_nope of one head, q_pe, one head's
 *     output, c_kv of the latent) move as whole rows of g = gcd(n, r, kvl)
 *     floats through gather_rows (ds_idx) and back through copy_cols: exact
 *     copies, so every backend does the same arithmetic in the same order, and
 *     the CPU's bits are those of the host-pointer version this replaced.
 *   naive: the latent of every context position of the batch's sequences is
 *     decompressed through kv_b_proj into per-head K = [k_nope | k_pe] and V,
 *     padded to a common width, into a scratch cache (one block per
 *     sequence), and the attention op runs on that (host-visible only).
 * The model uses one form for every token (dsv3_state.absorbed), so a
 * token's result does not depend on whether it came in a prefill chunk or a
 * decode step.
 * MoE: the router matmul, the shared expert (SwiGLU), then bk_ops.moe on the
 * experts moe_place repacked (noaux_tc routing, the experts, the fixed-order
 * combine + shared: moe_forward's order and roundings) where the backend has
 * it; moe_forward on host memory otherwise.
 * RoPE: the rope op with neox = false rotates adjacent pairs (2i, 2i+1) of
 * q_pe and k_pe in place; transformers rotates the same pairs and writes them
 * de-interleaved, a permutation shared by q and k that leaves q.k unchanged.
 *
 * Expert parallelism (model_load_opts.expert_parallel): routing is the same
 * on every rank (the router replicated, the residual identical after each
 * all-reduce); a rank runs only the experts it holds, whole, and its part of
 * the routed sum (plus its slice of the shared expert) is summed over the
 * ranks by the MoE block's all-reduce, the one TP already has.
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
 * For the parts that run on host-visible backends only (the naive MLA form,
 * the MoE block where the backend has no moe op: the CPU's reference path):
 * host buffers wrapped as tensors per call (no copies). */
static int h_matmul(backend *be, const bk_weight *w, const float *x, int32_t T, float *y) {
    return bk_matmul_f32(be, w, x, T, y);
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

/* ------------------------------------------------------------ MLA */

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
    /* routed experts in ascending id, each on its tokens; y[t] accumulates in that order. Every rank routes
     * over all E; with expert parallelism it runs only its own [ex0, ex0 + ex_n) (whole), so y holds their
     * part of the sum and the MoE block's all-reduce adds the other ranks' (in rank order) */
    memset(y, 0, sizeof(float) * (size_t)T * H);
    for (int32_t e = m->ex0; e < m->ex0 + m->ex_n; e++) {
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

/* ------------------------------------------------------------ forward (backend tensors) */

static int32_t ds_gcd(int32_t a, int32_t b) {
    while (b) { const int32_t t = a % b; a = b; b = t; }
    return a;
}

/* Column blocks as row gathers. The per-head pieces MLA needs (q_nope of one
 * head, the q_pe of all heads, one head's attention output, c_kv of the
 * latent) are column blocks of row-major tensors; seen as rows of g floats
 * (g = gcd(n, r, kvl): 16 for the miniature, 64 for Kimi) each block is a
 * list of whole rows, so gather_rows (a bit-exact copy on every backend)
 * moves it. The lists depend only on T and the shapes:
 *   qn  [nh * T * n/g]: head-major q_nope: dst row (h T + t) n/g + j <- ((t nh + h)(n + r))/g + j
 *   qpe [T * nh * r/g]: q_pe per (t, h):   dst row (t nh + h) r/g + j <- ((t nh + h)(n + r) + n)/g + j
 *   oh  [nh * T]:      head-major output:  dst row h T + t <- t nh + h   (rows of kvl)
 *   ckv [T * kvl/g]:   c_kv of the latent: dst row t kvl/g + j <- (t D)/g + j
 * written into host memory grown to the largest step (dsv3_state.idx_host). */
typedef struct ds_idx {
    int32_t g;
    size_t n_qn, n_qpe, n_oh, n_ckv;
} ds_idx;

static ds_idx ds_idx_plan(const hf_config *c, int32_t nh, int32_t T) {
    const int32_t n = c->qk_nope, r = c->qk_rope, kvl = c->kv_lora_rank;
    ds_idx x;
    x.g = ds_gcd(ds_gcd(n, r), kvl);
    x.n_qn = (size_t)nh * T * (size_t)(n / x.g);
    x.n_qpe = (size_t)T * nh * (size_t)(r / x.g);
    x.n_oh = (size_t)nh * T;
    x.n_ckv = (size_t)T * (size_t)(kvl / x.g);
    return x;
}

static int32_t *ds_idx_fill(dsv3_state *s, const ds_idx *x, int32_t nh, int32_t T) {
    const hf_config *c = &s->hc;
    const int32_t n = c->qk_nope, r = c->qk_rope, kvl = c->kv_lora_rank, D = kvl + r, g = x->g;
    const size_t total = x->n_qn + x->n_qpe + x->n_oh + x->n_ckv;
    if (total > s->idx_cap) {
        int32_t *p = realloc(s->idx_host, sizeof(int32_t) * total);
        if (!p) return NULL;
        s->idx_host = p;
        s->idx_cap = total;
    }
    int32_t *o = s->idx_host;
    for (int32_t h = 0; h < nh; h++)
        for (int32_t t = 0; t < T; t++)
            for (int32_t j = 0; j < n / g; j++) *o++ = (int32_t)(((int64_t)t * nh + h) * (n + r) / g + j);
    for (int32_t th = 0; th < T * nh; th++)
        for (int32_t j = 0; j < r / g; j++) *o++ = (int32_t)(((int64_t)th * (n + r) + n) / g + j);
    for (int32_t h = 0; h < nh; h++)
        for (int32_t t = 0; t < T; t++) *o++ = t * nh + h;
    for (int32_t t = 0; t < T; t++)
        for (int32_t j = 0; j < kvl / g; j++) *o++ = (int32_t)((int64_t)t * D / g + j);
    return s->idx_host;
}

#define OPS(call) \
    do { if ((call) < 0) return specd_err_set(err, "%s backend: %s failed", m->be->name, #call); } while (0)

/* y [T, H] = down(silu(gate(x)) * up(x)) on backend tensors; g, u [T, >= gate rows]. */
static int d_swiglu(model *m, const bk_weight *gate, const bk_weight *up, const bk_weight *down, const bk_tensor *x,
                    bk_tensor g, bk_tensor u, bk_tensor *y, specd_err *err) {
    const bk_ops *op = m->be->ops;
    void *bx = m->be->ctx;
    g = bk_reshape(g, x->rows, gate->rows), u = bk_reshape(u, x->rows, up->rows);
    OPS(op->matmul(bx, gate, x, &g));
    OPS(op->matmul(bx, up, x, &u));
    OPS(op->silu_mul(bx, &g, &u, &g));
    OPS(op->matmul(bx, down, &g, y));
    return 0;
}

/* The step's activations (backend memory, carved from the model's workspace). */
typedef struct ds_ws {
    bk_tensor x, xn, qlo, q, lat, ckv, qn, qpe, qa, oa, oh, tq, tv, att, y, g, u, rl, sh;
    bk_tensor idx_qn, idx_qpe, idx_oh, idx_ckv; /* I32 lists (ds_idx) */
    int32_t *ids;                                /* I32 [T] (device backends) */
    bk_tensor aux;                               /* [T, n_aux H] (device backends) */
} ds_ws;

/* Absorbed MLA on backend tensors: q [T, nh(n + r)] (q_pe rotated), the layer's latent written for
 * this step -> w->att [T, nh v]:
 *   qa = [W_UK_h^T q_nope_h | q_pe_h] per head [T, nh, D]; oa = mla_attention(qa) [T, nh, kvl]
 *   (per head sum_p softmax_p c_kv_p); att_h = W_UV_h oa_h. The per-head blocks move through
 *   gather_rows (ds_idx) and copy_cols: exact copies, so the arithmetic is the matmuls' and the
 *   attention op's, as on every backend. */
static int mla_absorbed(model *m, int32_t l, const bk_attn_meta *am, ds_ws *w, const ds_idx *ix, specd_err *err) {
    const dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    const dsv3_layer *Y = &s->layers[l];
    const bk_ops *op = m->be->ops;
    void *bx = m->be->ctx;
    const int32_t T = am->n_tokens, nh = m->nh_l, n = c->qk_nope, r = c->qk_rope, v = c->v_head;
    const int32_t kvl = c->kv_lora_rank, D = kvl + r, g = ix->g;
    if (!op->mla_attention) return specd_err_set(err, "%s backend has no mla_attention op", m->be->name);
    /* q_nope head-major [nh T, n]; q_lat_h = W_UK_h^T q_nope_h into qa's columns h D .. h D + kvl */
    bk_tensor qg = bk_reshape(w->q, (int64_t)T * nh * (n + r) / g, g);
    bk_tensor qn = bk_reshape(w->qn, (int64_t)ix->n_qn, g);
    OPS(op->gather_rows(bx, &qg, &w->idx_qn, &qn));
    qn = bk_reshape(w->qn, (int64_t)nh * T, n);
    for (int32_t h = 0; h < nh; h++) {
        const bk_tensor in = bk_rows(qn, (int64_t)h * T, T);
        OPS(op->matmul(bx, &Y->w_uk_t[h], &in, &w->tq));
        OPS(op->copy_cols(bx, &w->qa, (int64_t)h * D, &w->tq));
    }
    /* q_pe of every (token, head) into qa's columns kvl .. D of each head */
    bk_tensor pe = bk_reshape(w->qpe, (int64_t)ix->n_qpe, g);
    OPS(op->gather_rows(bx, &qg, &w->idx_qpe, &pe));
    pe = bk_reshape(w->qpe, (int64_t)T * nh, r);
    bk_tensor qa_th = bk_reshape(w->qa, (int64_t)T * nh, D);
    OPS(op->copy_cols(bx, &qa_th, kvl, &pe));
    bk_kv_layer kv = model_kv_layer(m, l);
    OPS(op->mla_attention(bx, &kv, am, &w->qa, nh, kvl, s->softmax_scale, &w->oa));
    /* out_h = W_UV_h oa_h (head-major rows), into att's columns h v .. h v + v */
    bk_tensor oa_th = bk_reshape(w->oa, (int64_t)T * nh, kvl);
    OPS(op->gather_rows(bx, &oa_th, &w->idx_oh, &w->oh));
    for (int32_t h = 0; h < nh; h++) {
        const bk_tensor in = bk_rows(w->oh, (int64_t)h * T, T);
        OPS(op->matmul(bx, &Y->w_uv[h], &in, &w->tv));
        OPS(op->copy_cols(bx, &w->att, (int64_t)h * v, &w->tv));
    }
    return 0;
}

/* The MLP half of layer l on xn -> y: dense SwiGLU, or the MoE block (the backend's moe op on the
 * experts moe_place put there, with the shared expert's output; else moe_forward, the CPU path). */
static int ds_mlp(model *m, int32_t l, ds_ws *w, specd_err *err) {
    const dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    const dsv3_layer *Y = &s->layers[l];
    const bk_ops *op = m->be->ops;
    const int32_t T = (int32_t)w->x.rows;
    if (!Y->moe) return d_swiglu(m, &Y->gate, &Y->up, &Y->down, &w->xn, w->g, w->u, &w->y, err);
    if (!Y->ex_dev.w13) {
        if (!m->be->host_visible)
            return specd_err_set(err, "layer %d: the MoE experts are not placed on the %s backend", l, m->be->name);
        return moe_forward(m, l, bk_f32(&w->xn), T, bk_f32(&w->y), err) < 0 ? specd_err_wrap(err, "layer %d", l) : 0;
    }
    bk_tensor rl = bk_reshape(w->rl, T, c->n_routed_experts);
    OPS(op->matmul(m->be->ctx, &Y->router, &w->xn, &rl));
    if (Y->has_shared && d_swiglu(m, &Y->gate, &Y->up, &Y->down, &w->xn, w->g, w->u, &w->sh, err) < 0) return -1;
    const bk_moe_cfg mc = {c->n_routed_experts, c->n_experts_per_tok, c->n_group, c->topk_group, c->norm_topk_prob,
                           c->routed_scaling};
    if (op->moe(m->be->ctx, &Y->ex_dev, &mc, &rl, &Y->router_bias_t, &w->xn, Y->has_shared ? &w->sh : NULL, &w->y) < 0)
        return specd_err_set(err, "%s backend: MoE of layer %d failed", m->be->name, l);
    return 0;
}

/* One layer on the residual stream w->x. */
static int ds_layer(model *m, int32_t l, const bk_attn_meta *am, ds_ws *w, const ds_idx *ix, specd_err *err) {
    const dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    const dsv3_layer *Y = &s->layers[l];
    const bk_ops *op = m->be->ops;
    void *bx = m->be->ctx;
    const int32_t T = am->n_tokens, nh = m->nh_l, n = c->qk_nope, r = c->qk_rope;
    const int32_t kvl = c->kv_lora_rank, D = kvl + r;
    /* attention rmsnorm; q = q_b(rmsnorm(q_a(x))) */
    OPS(op->rmsnorm(bx, &w->x, &Y->attn_norm_t, (float)c->rms_eps, &w->xn));
    if (c->q_lora_rank > 0) {
        OPS(op->matmul(bx, &Y->q_a, &w->xn, &w->qlo));
        OPS(op->rmsnorm(bx, &w->qlo, &Y->q_a_norm_t, DSV3_LORA_NORM_EPS, &w->qlo));
        OPS(op->matmul(bx, &Y->q_b, &w->qlo, &w->q));
    } else {
        OPS(op->matmul(bx, &Y->q_b, &w->xn, &w->q));
    }
    /* latent = [rmsnorm(c_kv) | k_pe] from kv_a_proj_with_mqa */
    OPS(op->matmul(bx, &Y->kv_a, &w->xn, &w->lat));
    bk_tensor latg = bk_reshape(w->lat, (int64_t)T * D / ix->g, ix->g);
    bk_tensor ckvg = bk_reshape(w->ckv, (int64_t)ix->n_ckv, ix->g);
    OPS(op->gather_rows(bx, &latg, &w->idx_ckv, &ckvg));
    OPS(op->rmsnorm(bx, &w->ckv, &Y->kv_a_norm_t, DSV3_LORA_NORM_EPS, &w->ckv));
    OPS(op->copy_cols(bx, &w->lat, 0, &w->ckv));
    /* decoupled RoPE (YaRN inv_freq, mscale on cos/sin) on q_pe of each head and the shared k_pe: the
     * views start at the rope part of the first head, each head's first r values are rotated */
    bk_tensor qpe = w->q, kpe = w->lat;
    qpe.data = (float *)w->q.data + n;
    kpe.data = (float *)w->lat.data + kvl;
    OPS(op->rope(bx, &qpe, nh, n + r, r, am, &m->inv_freq_t, s->rope_mscale, false));
    OPS(op->rope(bx, &kpe, 1, D, r, am, &m->inv_freq_t, s->rope_mscale, false));
    /* latent into the paged cache (one plane: K == V) */
    bk_kv_layer kv = model_kv_layer(m, l);
    if (op->mla_latent_write ? op->mla_latent_write(bx, &kv, am, &w->lat, kvl) < 0
                             : op->kv_write(bx, &kv, am, &w->lat, &w->lat) < 0)
        return specd_err_set(err, "latent write failed (layer %d)", l);
    if (s->absorbed) {
        if (mla_absorbed(m, l, am, w, ix, err) < 0) return -1;
    } else if (!m->be->host_visible) {
        return specd_err_set(err, "the naive MLA form runs on host-visible backends only (the %s backend runs the "
                                  "absorbed form)", m->be->name);
    } else if (mla_naive(m, l, am, bk_f32(&w->q), bk_f32(&w->att), err) < 0) {
        return -1;
    }
    /* output projection (row-parallel at TP > 1: partial sums all-reduced) + residual */
    OPS(op->matmul(bx, &Y->o, &w->att, &w->y));
    if (model_tp_all_reduce(m, &w->y, err) < 0) return -1;
    OPS(op->add(bx, &w->x, &w->y));
    /* MLP rmsnorm; dense SwiGLU or MoE; each rank's slice gave a partial sum; residual */
    OPS(op->rmsnorm(bx, &w->x, &Y->ffn_norm_t, (float)c->rms_eps, &w->xn));
    if (ds_mlp(m, l, w, err) < 0) return -1;
    if (model_tp_all_reduce(m, &w->y, err) < 0) return -1;
    OPS(op->add(bx, &w->x, &w->y));
    return 0;
}
#undef OPS

/* Workspace floats of a T-token step (ds_ws, in dsv3_forward's order of takes). */
static size_t ds_ws_floats(const model *m, int32_t T, const ds_idx *ix, int64_t naux) {
    const hf_config *c = &m->ds->hc;
    const int64_t H = c->hidden, nh = m->nh_l, n = c->qk_nope, r = c->qk_rope, v = c->v_head;
    const int64_t kvl = c->kv_lora_rank, D = kvl + r, ql = c->q_lora_rank > 0 ? c->q_lora_rank : 1;
    const int64_t Is = (int64_t)c->moe_intermediate * c->n_shared_experts;
    const int64_t W = c->intermediate > Is ? c->intermediate : Is;
    const int64_t E = c->n_routed_experts > 0 ? c->n_routed_experts : 1;
    const int64_t per_tok = 2 * H + ql + nh * (n + r) + D + kvl + nh * n + nh * r + nh * D + nh * kvl + nh * kvl +
                            kvl + v + nh * v + H + 2 * W + E + H + 1 + naux * H;
    return (size_t)T * (size_t)per_tok + ix->n_qn + ix->n_qpe + ix->n_oh + ix->n_ckv + 26 * BK_TAKE_SLACK;
}

size_t dsv3_workspace_floats(const model *m, int32_t T, int32_t n_aux) {
    const ds_idx ix = ds_idx_plan(&m->ds->hc, m->nh_l, T);
    return ds_ws_floats(m, T, &ix, n_aux);
}

int dsv3_forward(model *m, const model_batch *b, specd_err *err) {
    dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    const bk_ops *op = m->be->ops;
    void *bx = m->be->ctx;
    const bool hv = m->be->host_visible;
    const int32_t T = b->n_tokens, H = c->hidden, nh = m->nh_l, n = c->qk_nope, r = c->qk_rope, v = c->v_head;
    const int32_t kvl = c->kv_lora_rank, D = kvl + r, ql = c->q_lora_rank > 0 ? c->q_lora_rank : 1;
    const int64_t Is = (int64_t)c->moe_intermediate * c->n_shared_experts;
    const int64_t W = c->intermediate > Is ? c->intermediate : Is, naux = b->aux ? b->n_aux : 0;
    const ds_idx ix = ds_idx_plan(c, nh, T);
    float *w0 = model_workspace(m, ds_ws_floats(m, T, &ix, hv ? 0 : naux));
    if (!w0) return specd_err_set(err, "out of memory for a %d-token step", T);
    bk_cursor wc = {w0};
    ds_ws w;
    w.x = bk_take(&wc, T, H), w.xn = bk_take(&wc, T, H), w.qlo = bk_take(&wc, T, ql);
    w.q = bk_take(&wc, T, (int64_t)nh * (n + r)), w.lat = bk_take(&wc, T, D), w.ckv = bk_take(&wc, T, kvl);
    w.qn = bk_take(&wc, (int64_t)nh * T, n), w.qpe = bk_take(&wc, (int64_t)T * nh, r);
    w.qa = bk_take(&wc, T, (int64_t)nh * D), w.oa = bk_take(&wc, T, (int64_t)nh * kvl);
    w.oh = bk_take(&wc, (int64_t)nh * T, kvl), w.tq = bk_take(&wc, T, kvl), w.tv = bk_take(&wc, T, v);
    w.att = bk_take(&wc, T, (int64_t)nh * v), w.y = bk_take(&wc, T, H);
    w.g = bk_take(&wc, T, W), w.u = bk_take(&wc, T, W);
    w.rl = bk_take(&wc, T, c->n_routed_experts > 0 ? c->n_routed_experts : 1), w.sh = bk_take(&wc, T, H);
    w.ids = (int32_t *)(void *)bk_take(&wc, T, 1).data;
    int32_t *idx_dev = (int32_t *)(void *)bk_take(&wc, 1, (int64_t)(ix.n_qn + ix.n_qpe + ix.n_oh + ix.n_ckv)).data;
    w.aux = hv ? bk_wrap_f32(b->aux, T, naux * H) : bk_take(&wc, T, naux * H);
    /* a graph step calls this in phases (model_internal.h MODEL_PH_*): uploads, ops, downloads */
    const int ph = m->ph ? m->ph : MODEL_PH_ALL;
    bk_tensor ids = ph & MODEL_PH_UP ? model_ids(m, b, w.ids) : bk_wrap_i32(w.ids, T, 1);
    int32_t *idx = hv ? NULL : idx_dev;
    if (hv || (ph & MODEL_PH_UP)) {
        int32_t *host = ds_idx_fill(s, &ix, nh, T);
        if (!host) return specd_err_set(err, "out of memory for a %d-token step's index lists", T);
        if (hv) idx = host;
        else if (op->upload(bx, idx_dev, host, sizeof(int32_t) * (ix.n_qn + ix.n_qpe + ix.n_oh + ix.n_ckv)) < 0)
            return specd_err_set(err, "%s backend: index upload failed", m->be->name);
    }
    w.idx_qn = bk_wrap_i32(idx, (int64_t)ix.n_qn, 1);
    w.idx_qpe = bk_wrap_i32(idx + ix.n_qn, (int64_t)ix.n_qpe, 1);
    w.idx_oh = bk_wrap_i32(idx + ix.n_qn + ix.n_qpe, (int64_t)ix.n_oh, 1);
    w.idx_ckv = bk_wrap_i32(idx + ix.n_qn + ix.n_qpe + ix.n_oh, (int64_t)ix.n_ckv, 1);

    bk_attn_meta am;
    if (model_step_meta(m, b, T, ph, &am, err) < 0) return -1;
    int rc = -1;
    if (ph & MODEL_PH_RUN) {
        if (op->embed(bx, &m->embed, &ids, b->tokens, &w.x) < 0) {
            specd_err_set(err, "token id out of range");
            goto done;
        }
        for (int32_t l = 0; l < c->n_layers; l++) {
            bool fail = false;
            for (int32_t a = 0; a < naux; a++) /* EAGLE-3 capture: the residual stream entering layer l */
                if (b->aux_layers[a] == l && op->copy_cols(bx, &w.aux, (int64_t)a * H, &w.x) < 0) fail = true;
            if (fail) {
                specd_err_set(err, "%s backend: aux capture failed", m->be->name);
                goto done;
            }
            if (ds_layer(m, l, &am, &w, &ix, err) < 0) goto done;
        }
    }
    if (!hv && naux && (ph & MODEL_PH_DOWN) && b->aux &&
        op->download(bx, b->aux, w.aux.data,
                     sizeof(float) * (size_t)(m->ph ? m->ph_rows_down : T) * (size_t)(naux * H)) < 0) {
        specd_err_set(err, "%s backend: aux download failed", m->be->name);
        goto done;
    }
    rc = model_finish_outputs(m, b, &w.x, err);
done:
    if (rc < 0 || (ph & MODEL_PH_DOWN)) {
        op->meta_release(bx, &am);
        m->ph_dev = NULL;
    }
    return rc;
}
