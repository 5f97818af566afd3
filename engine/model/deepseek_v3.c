/*
 * deepseek_v3.c: loading a DeepSeek-V3 / Kimi-K2.5 target from a Hugging
 * Face directory (config.json + sharded safetensors with the index) onto the
 * model struct; the tensor-parallel style of every linear; YaRN parameters.
 *
 * Owns: the dsv3_state (parsed config, the shard mappings, per-layer weight
 * views, converted copies: f32 norms and router biases, the transposed
 * per-head W_UK blocks of kv_b_proj for absorbed MLA) and, on a device
 * backend, the placement (dsv3_place: weights through weight_place, norms and
 * biases uploaded, the routed experts repacked by moe_place; kv_b_proj stays
 * a host view, only the host-only naive MLA form reads it).
 * Weights stay in their checkpoint dtype and are used in place: bf16/f16/f32
 * views of the mapping; compressed-tensors int4 experts (weight_packed int32
 * [out, in/8] + weight_scale bf16 [out, in/32] + weight_shape [2]) become
 * BK_W_I4G32 views, unpacked by the backend's matmul row by row.
 * Tensor names: `language_model.model.X` (Kimi-K2.5), `language_model.X`
 * (re-exports without `.model`) or `model.X` (plain DeepSeek-V3), with the
 * LM head at `language_model.lm_head.weight` or `lm_head.weight`; the layout
 * is detected from where the embedding is. Vision-tower tensors are ignored.
 * A model file is untrusted: every shape and dtype is checked before use.
 * Threading: load on one thread; immutable afterwards.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/deepseek_v3.h"
#include "engine/util/log.h"

/* ------------------------------------------------------------ TP styles */

/* Parallel style of every linear (REFERENCE section 1; Megatron-LM column/row):
 * matched on the last name components, most specific first. */
static const struct { const char *suffix; tp_style style; } DSV3_LINEARS[] = {
    {"self_attn.q_a_proj.weight", TP_REPLICATED},          /* low-rank down-projections: every rank */
    {"self_attn.kv_a_proj_with_mqa.weight", TP_REPLICATED},
    {"self_attn.q_a_layernorm.weight", TP_REPLICATED},
    {"self_attn.kv_a_layernorm.weight", TP_REPLICATED},
    {"self_attn.q_b_proj.weight", TP_COLUMN},              /* heads split: nh/TP per rank */
    {"self_attn.q_proj.weight", TP_COLUMN},
    {"self_attn.kv_b_proj.weight", TP_COLUMN},
    {"self_attn.o_proj.weight", TP_ROW},                   /* inputs split by heads, all-reduce after */
    {"mlp.gate.weight", TP_REPLICATED},                    /* the router: every rank routes every token */
    {"mlp.gate.e_score_correction_bias", TP_REPLICATED},
    {"gate_proj.weight", TP_COLUMN},                       /* dense MLP, shared experts */
    {"up_proj.weight", TP_COLUMN},
    {"down_proj.weight", TP_ROW},
    {"gate_proj.weight_packed", TP_COLUMN},                /* routed experts: TP inside each expert */
    {"gate_proj.weight_scale", TP_COLUMN},
    {"up_proj.weight_packed", TP_COLUMN},
    {"up_proj.weight_scale", TP_COLUMN},
    {"down_proj.weight_packed", TP_ROW},                   /* group 32 divides the per-rank input slice */
    {"down_proj.weight_scale", TP_ROW},
    {"gate_proj.weight_shape", TP_REPLICATED},
    {"up_proj.weight_shape", TP_REPLICATED},
    {"down_proj.weight_shape", TP_REPLICATED},
    {"input_layernorm.weight", TP_REPLICATED},
    {"post_attention_layernorm.weight", TP_REPLICATED},
    {"embed_tokens.weight", TP_COLUMN},                    /* vocabulary-parallel rows */
    {"lm_head.weight", TP_COLUMN},
    {"norm.weight", TP_REPLICATED},
};

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && memcmp(s + a - b, suf, b) == 0 && (a == b || s[a - b - 1] == '.');
}

int dsv3_tensor_parallel(const char *name) {
    if (!strncmp(name, "vision_tower.", 13) || !strncmp(name, "mm_projector.", 13) ||
        !strncmp(name, "multi_modal_projector.", 22))
        return -1;
    for (size_t i = 0; i < sizeof DSV3_LINEARS / sizeof DSV3_LINEARS[0]; i++)
        if (ends_with(name, DSV3_LINEARS[i].suffix)) return (int)DSV3_LINEARS[i].style;
    return -1;
}

/* ------------------------------------------------------------ YaRN */

/* transformers get_mscale: 0.1 m ln(f) + 1 for f > 1. */
static double yarn_get_mscale(double f, double m) { return f <= 1 ? 1.0 : 0.1 * m * log(f) + 1.0; }

static double yarn_corr_dim(double n_rot, int d, double base, double max_pos) {
    return d * log(max_pos / (n_rot * 2 * M_PI)) / (2 * log(base));
}

int32_t dsv3_rope_dim(const dsv3_state *s) { return s->hc.qk_rope; }

void dsv3_rope_params(const hf_config *hc, float *inv_freq, float *attention_factor, float *softmax_scale) {
    const int d = hc->qk_rope;
    const float base = (float)hc->rope_theta;
    double sm = 1.0 / sqrt((double)(hc->qk_nope + hc->qk_rope));
    if (!hc->yarn) {
        for (int i = 0; i < d / 2; i++) inv_freq[i] = 1.0f / powf(base, (float)(2 * i) / (float)d);
        *attention_factor = 1.0f;
        *softmax_scale = (float)sm;
        return;
    }
    const double f = hc->yarn_factor;
    /* bounds of the ramp (truncate = true) */
    double lo = floor(yarn_corr_dim(hc->yarn_beta_fast, d, hc->rope_theta, hc->yarn_orig_max_pos));
    double hi = ceil(yarn_corr_dim(hc->yarn_beta_slow, d, hc->rope_theta, hc->yarn_orig_max_pos));
    if (lo < 0) lo = 0;
    if (hi > d - 1) hi = d - 1;
    if (lo == hi) hi += 0.001;
    const float flo = (float)lo, fspan = (float)(hi - lo), ff = (float)f;
    for (int i = 0; i < d / 2; i++) {
        /* all float32, in transformers' order of operations */
        const float pf = powf(base, (float)(2 * i) / (float)d);
        const float extra = 1.0f / pf, inter = 1.0f / (ff * pf);
        float ramp = ((float)i - flo) / fspan;
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        const float extra_factor = 1.0f - ramp;
        inv_freq[i] = inter * (1.0f - extra_factor) + extra * extra_factor;
    }
    double att;
    if (hc->yarn_attention_factor >= 0) att = hc->yarn_attention_factor;
    else if (hc->yarn_mscale != 0 && hc->yarn_mscale_all_dim != 0)
        att = yarn_get_mscale(f, hc->yarn_mscale) / yarn_get_mscale(f, hc->yarn_mscale_all_dim);
    else att = yarn_get_mscale(f, 1.0);
    *attention_factor = (float)att;
    if (hc->yarn_mscale_all_dim != 0) {
        const double ms = yarn_get_mscale(f, hc->yarn_mscale_all_dim);
        sm = sm * ms * ms;
    }
    *softmax_scale = (float)sm;
}

/* ------------------------------------------------------------ tensors */

typedef struct ds_loader {
    model *m;
    dsv3_state *s;
    const char *pre;      /* prefix of model.* tensors */
    const char *head;     /* name of the LM head */
} ds_loader;

static void *ds_own(dsv3_state *s, size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) return NULL;
    void **n = realloc(s->owned, sizeof(void *) * (size_t)(s->n_owned + 1));
    if (!n) { free(p); return NULL; }
    s->owned = n;
    s->owned[s->n_owned++] = p;
    return p;
}

static const st_tensor *ds_find(const ds_loader *L, const char *canon, char *full, size_t cap) {
    snprintf(full, cap, "%s%s", L->pre, canon);
    return st_find(L->s->st, full);
}

/* A 2-D float weight [rows, cols] as a view (bf16 / f16 / f32). */
static int ds_view(const st_tensor *t, const char *name, int64_t rows, int64_t cols, bk_weight *w, specd_err *err) {
    if (!t) return specd_err_set(err, "tensor %s missing", name);
    if (t->n_dims != 2 || t->shape[0] != rows || t->shape[1] != cols)
        return specd_err_set(err, "tensor %s has shape [%lld, %lld] (%d dims), expected [%lld, %lld]", name,
                             (long long)(t->n_dims > 0 ? t->shape[0] : 0), (long long)(t->n_dims > 1 ? t->shape[1] : 0),
                             t->n_dims, (long long)rows, (long long)cols);
    memset(w, 0, sizeof *w);
    switch (t->dtype) {
    case ST_BF16: w->type = BK_W_BF16; break;
    case ST_F16: w->type = BK_W_F16; break;
    case ST_F32: w->type = BK_W_F32; break;
    default: return specd_err_set(err, "tensor %s: dtype %s is not supported for a float weight", name, st_dtype_name(t->dtype));
    }
    w->rows = rows;
    w->cols = cols;
    w->data = t->data;
    w->row_bytes = (size_t)cols * st_dtype_size(t->dtype);
    return 0;
}

static int ds_mat(ds_loader *L, const char *canon, int64_t rows, int64_t cols, bk_weight *w, specd_err *err) {
    char full[256];
    return ds_view(ds_find(L, canon, full, sizeof full), full, rows, cols, w, err);
}

/* A vector [n] as an f32 copy. */
static int ds_vec(ds_loader *L, const char *canon, int64_t n, float **out, specd_err *err) {
    char full[256];
    const st_tensor *t = ds_find(L, canon, full, sizeof full);
    if (!t) return specd_err_set(err, "tensor %s missing", full);
    if (t->n_dims != 1 || t->shape[0] != n)
        return specd_err_set(err, "tensor %s: expected shape [%lld]", full, (long long)n);
    float *f = ds_own(L->s, sizeof(float) * (size_t)n);
    if (!f) return specd_err_set(err, "out of memory");
    if (st_read_f32(t, f, err) < 0) return specd_err_wrap(err, "%s", full);
    *out = f;
    return 0;
}

/* A routed expert's projection BASE ("layers.N.mlp.experts.E.gate_proj"):
 * compressed-tensors int4 (weight_packed / weight_scale / weight_shape) or a
 * plain float weight. */
static int ds_expert(ds_loader *L, const char *base, int64_t rows, int64_t cols, bk_weight *w, specd_err *err) {
    char canon[200], full[256];
    snprintf(canon, sizeof canon, "%s.weight_packed", base);
    const st_tensor *p = ds_find(L, canon, full, sizeof full);
    if (!p) {
        snprintf(canon, sizeof canon, "%s.weight", base);
        return ds_mat(L, canon, rows, cols, w, err);
    }
    if (cols % 32) return specd_err_set(err, "%s: int4 input width %lld is not a multiple of 32", full, (long long)cols);
    if (p->dtype != ST_I32 || p->n_dims != 2 || p->shape[0] != rows || p->shape[1] != cols / 8)
        return specd_err_set(err, "tensor %s: expected I32 [%lld, %lld]", full, (long long)rows, (long long)(cols / 8));
    snprintf(canon, sizeof canon, "%s.weight_scale", base);
    const st_tensor *sc = ds_find(L, canon, full, sizeof full);
    if (!sc || sc->dtype != ST_BF16 || sc->n_dims != 2 || sc->shape[0] != rows || sc->shape[1] != cols / 32)
        return specd_err_set(err, "tensor %s: missing or not BF16 [%lld, %lld] (group 32)", full, (long long)rows,
                             (long long)(cols / 32));
    snprintf(canon, sizeof canon, "%s.weight_shape", base);
    const st_tensor *sh = ds_find(L, canon, full, sizeof full);
    if (sh) { /* I32 in Kimi's files, I64 from compressed-tensors' own compress() */
        int64_t v[2] = {0, 0};
        if (sh->n_dims != 1 || sh->shape[0] != 2 || (sh->dtype != ST_I32 && sh->dtype != ST_I64))
            return specd_err_set(err, "tensor %s: expected I32 or I64 [2]", full);
        for (int i = 0; i < 2; i++) {
            if (sh->dtype == ST_I32) { int32_t x; memcpy(&x, (const char *)sh->data + 4 * i, 4); v[i] = x; }
            else memcpy(&v[i], (const char *)sh->data + 8 * i, 8);
        }
        if (v[0] != rows || v[1] != cols)
            return specd_err_set(err, "tensor %s = [%lld, %lld], expected [%lld, %lld]", full, (long long)v[0],
                                 (long long)v[1], (long long)rows, (long long)cols);
    }
    memset(w, 0, sizeof *w);
    w->type = BK_W_I4G32;
    w->rows = rows;
    w->cols = cols;
    w->data = p->data;
    w->row_bytes = (size_t)(cols / 8) * 4;
    w->scales = sc->data;
    return 0;
}

/* W_UK^T of head h: [kvl, n] with W[j][i] = kv_b[h*(n+v) + i][j], same dtype. */
static int ds_make_wuk_t(dsv3_state *s, const bk_weight *kvb, int h, bk_weight *out, specd_err *err) {
    const hf_config *c = &s->hc;
    const int64_t n = c->qk_nope, v = c->v_head, kvl = c->kv_lora_rank;
    const size_t es = kvb->row_bytes / (size_t)kvb->cols; /* 2 or 4: a bit copy keeps the values exact */
    uint8_t *d = ds_own(s, es * (size_t)(kvl * n));
    if (!d) return specd_err_set(err, "out of memory");
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = (const uint8_t *)kvb->data + (size_t)(h * (n + v) + i) * kvb->row_bytes;
        for (int64_t j = 0; j < kvl; j++) memcpy(d + ((size_t)j * n + i) * es, row + (size_t)j * es, es);
    }
    *out = *kvb;
    out->rows = kvl;
    out->cols = n;
    out->data = d;
    out->row_bytes = es * (size_t)n;
    return 0;
}

static int ds_load_layer(ds_loader *L, int32_t l, specd_err *err) {
    dsv3_state *s = L->s;
    const hf_config *c = &s->hc;
    dsv3_layer *Y = &s->layers[l];
    const int64_t H = c->hidden, nh = c->n_heads, n = c->qk_nope, r = c->qk_rope, v = c->v_head;
    const int64_t kvl = c->kv_lora_rank, ql = c->q_lora_rank;
    char nm[200];
#define NAME(...) (snprintf(nm, sizeof nm, __VA_ARGS__), nm)
    if (ds_vec(L, NAME("layers.%d.input_layernorm.weight", l), H, &Y->attn_norm, err) < 0 ||
        ds_vec(L, NAME("layers.%d.post_attention_layernorm.weight", l), H, &Y->ffn_norm, err) < 0)
        return -1;
    if (ql > 0) {
        if (ds_mat(L, NAME("layers.%d.self_attn.q_a_proj.weight", l), ql, H, &Y->q_a, err) < 0 ||
            ds_vec(L, NAME("layers.%d.self_attn.q_a_layernorm.weight", l), ql, &Y->q_a_norm, err) < 0 ||
            ds_mat(L, NAME("layers.%d.self_attn.q_b_proj.weight", l), nh * (n + r), ql, &Y->q_b, err) < 0)
            return -1;
    } else if (ds_mat(L, NAME("layers.%d.self_attn.q_proj.weight", l), nh * (n + r), H, &Y->q_b, err) < 0) {
        return -1;
    }
    if (ds_mat(L, NAME("layers.%d.self_attn.kv_a_proj_with_mqa.weight", l), kvl + r, H, &Y->kv_a, err) < 0 ||
        ds_vec(L, NAME("layers.%d.self_attn.kv_a_layernorm.weight", l), kvl, &Y->kv_a_norm, err) < 0 ||
        ds_mat(L, NAME("layers.%d.self_attn.kv_b_proj.weight", l), nh * (n + v), kvl, &Y->kv_b, err) < 0 ||
        ds_mat(L, NAME("layers.%d.self_attn.o_proj.weight", l), H, nh * v, &Y->o, err) < 0)
        return -1;
    /* absorbed-MLA per-head blocks of kv_b: W_UK^T (copied), W_UV (views), for this rank's heads only
     * (all of them at TP 1; a TP size that does not divide the heads is refused by model_tp_shard) */
    const model_comm *tp = L->m->tp;
    const int h0 = tp && tp->size > 1 && nh % tp->size == 0 ? (int)(tp->rank * (nh / tp->size)) : 0;
    const int hn = tp && tp->size > 1 && nh % tp->size == 0 ? (int)(nh / tp->size) : (int)nh;
    Y->w_uk_t = ds_own(s, sizeof(bk_weight) * (size_t)hn);
    Y->w_uv = ds_own(s, sizeof(bk_weight) * (size_t)hn);
    if (!Y->w_uk_t || !Y->w_uv) return specd_err_set(err, "out of memory");
    for (int h = h0; h < h0 + hn; h++) {
        if (ds_make_wuk_t(s, &Y->kv_b, h, &Y->w_uk_t[h - h0], err) < 0) return -1;
        Y->w_uv[h - h0] = Y->kv_b;
        Y->w_uv[h - h0].rows = v;
        Y->w_uv[h - h0].data = (const uint8_t *)Y->kv_b.data + (size_t)(h * (n + v) + n) * Y->kv_b.row_bytes;
    }
    Y->moe = l >= c->first_k_dense && l % c->moe_layer_freq == 0;
    if (!Y->moe) {
        const int64_t I = c->intermediate;
        return ds_mat(L, NAME("layers.%d.mlp.gate_proj.weight", l), I, H, &Y->gate, err) < 0 ||
                       ds_mat(L, NAME("layers.%d.mlp.up_proj.weight", l), I, H, &Y->up, err) < 0 ||
                       ds_mat(L, NAME("layers.%d.mlp.down_proj.weight", l), H, I, &Y->down, err) < 0
                   ? -1
                   : 0;
    }
    const int64_t E = c->n_routed_experts, Im = c->moe_intermediate, Is = Im * c->n_shared_experts;
    if (ds_mat(L, NAME("layers.%d.mlp.gate.weight", l), E, H, &Y->router, err) < 0 ||
        ds_vec(L, NAME("layers.%d.mlp.gate.e_score_correction_bias", l), E, &Y->router_bias, err) < 0)
        return -1;
    Y->has_shared = Is > 0;
    if (Y->has_shared &&
        (ds_mat(L, NAME("layers.%d.mlp.shared_experts.gate_proj.weight", l), Is, H, &Y->gate, err) < 0 ||
         ds_mat(L, NAME("layers.%d.mlp.shared_experts.up_proj.weight", l), Is, H, &Y->up, err) < 0 ||
         ds_mat(L, NAME("layers.%d.mlp.shared_experts.down_proj.weight", l), H, Is, &Y->down, err) < 0))
        return -1;
    Y->ex_gate = ds_own(s, sizeof(bk_weight) * (size_t)E);
    Y->ex_up = ds_own(s, sizeof(bk_weight) * (size_t)E);
    Y->ex_down = ds_own(s, sizeof(bk_weight) * (size_t)E);
    if (!Y->ex_gate || !Y->ex_up || !Y->ex_down) return specd_err_set(err, "out of memory");
    /* every expert's views are indexed by its global id; with expert parallelism only this rank's
     * [ex0, ex0 + ex_n) are views (the others stay zeroed: never read, never used) */
    for (int64_t e = L->m->ex0; e < L->m->ex0 + L->m->ex_n; e++)
        if (ds_expert(L, NAME("layers.%d.mlp.experts.%lld.gate_proj", l, (long long)e), Im, H, &Y->ex_gate[e], err) < 0 ||
            ds_expert(L, NAME("layers.%d.mlp.experts.%lld.up_proj", l, (long long)e), Im, H, &Y->ex_up[e], err) < 0 ||
            ds_expert(L, NAME("layers.%d.mlp.experts.%lld.down_proj", l, (long long)e), H, Im, &Y->ex_down[e], err) < 0)
            return -1;
#undef NAME
    return 0;
}

/* ------------------------------------------------------------ load */

int dsv3_load(model *m, const hf_config *hc, specd_err *err) {
    dsv3_state *s = calloc(1, sizeof *s);
    if (!s) return specd_err_set(err, "out of memory");
    m->ds = s;
    s->hc = *hc;
    s->absorbed = true;
    const hf_config *c = &s->hc;
    /* the routed experts this rank holds (all of them unless expert parallel): the plan reads only theirs */
    if (model_ep_range(m, c->first_k_dense < c->n_layers ? c->n_routed_experts : 0, err) < 0) return -1;
    m->ex_w = c->moe_intermediate;
    if (model_st_open(m, c, &s->st, err) < 0) return -1;
    ds_loader L = {m, s, NULL, NULL};
    static const struct { const char *pre, *head; } LAYOUTS[] = {
        {"language_model.model.", "language_model.lm_head.weight"}, /* Kimi-K2.5 */
        {"language_model.", "language_model.lm_head.weight"},       /* re-exports without .model */
        {"model.", "lm_head.weight"},                               /* plain DeepSeek-V3 */
    };
    for (size_t i = 0; i < sizeof LAYOUTS / sizeof LAYOUTS[0] && !L.pre; i++) {
        char nm[128];
        snprintf(nm, sizeof nm, "%sembed_tokens.weight", LAYOUTS[i].pre);
        if (st_find(s->st, nm)) { L.pre = LAYOUTS[i].pre; L.head = LAYOUTS[i].head; }
    }
    if (!L.pre) return specd_err_set(err, "no embed_tokens.weight under language_model.model., language_model. or model.");
    size_t n_vision = 0, n_unknown = 0;
    for (size_t i = 0; i < st_n_tensors(s->st); i++) {
        const char *nm = st_tensor_at(s->st, i)->name;
        if (!strncmp(nm, "vision_tower.", 13) || !strncmp(nm, "mm_projector.", 13) ||
            !strncmp(nm, "multi_modal_projector.", 22))
            n_vision++;
        else if (dsv3_tensor_parallel(nm) < 0)
            n_unknown++;
    }
    if (n_vision || c->has_vision)
        LOG_INFO("%s: vision tower ignored (%zu tensors): serving text only", m->path, n_vision);
    if (n_unknown) LOG_WARN("%s: %zu tensors with no declared role are not loaded", m->path, n_unknown);
    if (c->quant.present) LOG_INFO("%s: routed experts %s %s int%d group %d", m->path, c->quant.method, c->quant.format,
                                   c->quant.num_bits, c->quant.group_size);

    /* model_config: the latent is the one "KV head" of head_dim kvl + r */
    model_config *mc = &m->cfg;
    mc->arch = MODEL_ARCH_DEEPSEEK_V3;
    snprintf(mc->name, sizeof mc->name, "%s%s%s", c->top_model_type, strcmp(c->top_model_type, c->model_type) ? "/" : "",
             strcmp(c->top_model_type, c->model_type) ? c->model_type : "");
    mc->n_layers = c->n_layers;
    mc->hidden = c->hidden;
    mc->n_heads = c->n_heads;
    mc->n_kv_heads = 1;
    mc->head_dim = c->kv_lora_rank + c->qk_rope;
    mc->ffn = c->intermediate;
    mc->vocab = c->vocab;
    mc->max_pos = c->max_pos;
    mc->rope_theta = (float)c->rope_theta;
    mc->rms_eps = (float)c->rms_eps;
    mc->tied_embeddings = c->tie_embeddings;
    mc->rope_neox = false; /* adjacent pairs rotated in place (docs/kimi-k2.5.md, RoPE) */
    m->kv_planes = 1;

    m->inv_freq = malloc(sizeof(float) * (size_t)(c->qk_rope / 2));
    if (!m->inv_freq) return specd_err_set(err, "out of memory");
    dsv3_rope_params(c, m->inv_freq, &s->rope_mscale, &s->softmax_scale);

    if (ds_mat(&L, "embed_tokens.weight", c->vocab, c->hidden, &m->embed, err) < 0) return -1;
    if (c->tie_embeddings) m->lm_head = m->embed;
    else if (ds_view(st_find(s->st, L.head), L.head, c->vocab, c->hidden, &m->lm_head, err) < 0) return -1;
    if (ds_vec(&L, "norm.weight", c->hidden, &m->out_norm, err) < 0) return -1;
    s->layers = calloc((size_t)c->n_layers, sizeof *s->layers);
    if (!s->layers) return specd_err_set(err, "out of memory");
    for (int32_t l = 0; l < c->n_layers; l++)
        if (ds_load_layer(&L, l, err) < 0) return specd_err_wrap(err, "layer %d", l);
    LOG_INFO("%s: DeepSeek-V3 MLA (heads %d, q_lora %d, kv_lora %d, nope %d, rope %d, v %d; softmax scale %.6f, "
             "rope mscale %.4f), %d dense + %d MoE layers (%d experts, top %d, %d shared)",
             m->path, c->n_heads, c->q_lora_rank, c->kv_lora_rank, c->qk_nope, c->qk_rope, c->v_head,
             (double)s->softmax_scale, (double)s->rope_mscale, c->first_k_dense < c->n_layers ? c->first_k_dense : c->n_layers,
             c->n_layers - (c->first_k_dense < c->n_layers ? c->first_k_dense : c->n_layers), c->n_routed_experts,
             c->n_experts_per_tok, c->n_shared_experts);
    return 0;
}

void dsv3_free(dsv3_state *s) {
    if (!s) return;
    for (int i = 0; i < s->n_owned; i++) free(s->owned[i]);
    free(s->owned);
    free(s->layers);
    free(s->idx_host);
    st_close(s->st);
    free(s);
}

int dsv3_set_mla_absorbed(model *m, bool absorbed) {
    if (!m || !m->ds) return -1;
    m->ds->absorbed = absorbed;
    return 0;
}

/* ------------------------------------------------------------ placement */

int dsv3_place(model *m, specd_err *err) {
    dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    backend *be = m->be;
    const bool dev = !be->host_visible;
    if (dev && !(be->ops->moe_place && be->ops->moe && be->ops->mla_attention && be->ops->mla_latent_write))
        return specd_err_set(err, "DeepSeek-V3 on the %s backend needs its MLA and MoE ops", be->name);
    if (dev && !m->kv_bf16)
        return specd_err_set(err, "DeepSeek-V3 on the %s backend keeps the latent cache in bf16", be->name);
    for (int32_t l = 0; l < c->n_layers; l++) {
        dsv3_layer *Y = &s->layers[l];
        if (model_vec_place(m, Y->attn_norm, c->hidden, &Y->attn_norm_t, err) < 0 ||
            model_vec_place(m, Y->ffn_norm, c->hidden, &Y->ffn_norm_t, err) < 0 ||
            model_vec_place(m, Y->kv_a_norm, c->kv_lora_rank, &Y->kv_a_norm_t, err) < 0 ||
            (c->q_lora_rank > 0 && model_vec_place(m, Y->q_a_norm, c->q_lora_rank, &Y->q_a_norm_t, err) < 0) ||
            (Y->moe && model_vec_place(m, Y->router_bias, c->n_routed_experts, &Y->router_bias_t, err) < 0))
            return specd_err_wrap(err, "layer %d", l);
        if (!dev) continue; /* host-visible: the loader's views are the backend's tensors (zero copies) */
        /* kv_b stays a host view: only the naive MLA form reads it, and that form is host-only */
        bk_weight *ws[8];
        int nw = 0;
        if (c->q_lora_rank > 0) ws[nw++] = &Y->q_a;
        ws[nw++] = &Y->q_b, ws[nw++] = &Y->kv_a, ws[nw++] = &Y->o;
        if (!Y->moe || Y->has_shared) ws[nw++] = &Y->gate, ws[nw++] = &Y->up, ws[nw++] = &Y->down;
        if (Y->moe) ws[nw++] = &Y->router;
        for (int i = 0; i < nw + 2 * m->nh_l; i++) { /* then the absorbed per-head blocks W_UK_h^T, W_UV_h */
            bk_weight *w = i < nw ? ws[i] : (i - nw) % 2 ? &Y->w_uv[(i - nw) / 2] : &Y->w_uk_t[(i - nw) / 2];
            if (be->ops->weight_place(be->ctx, w, w) < 0)
                return specd_err_set(err, "placing layer %d's weights in %s memory", l, be->name);
        }
        /* this rank's experts (all E, or [ex0, ex0 + ex_n) with expert parallelism): local expert j is global
         * ex0 + j, which bk_moe_experts.e0 tells the moe op (routing stays over all E) */
        if (Y->moe && be->ops->moe_place(be->ctx, m->ex_n, Y->ex_gate + m->ex0, Y->ex_up + m->ex0,
                                         Y->ex_down + m->ex0, &Y->ex_dev) < 0)
            return specd_err_set(err, "layer %d: placing %d routed experts in %s memory failed (int4 group-32 "
                                      "experts only; the log has the reason)", l, m->ex_n, be->name);
        if (Y->moe) Y->ex_dev.e0 = m->ex0;
    }
    return 0;
}

void dsv3_unplace(model *m) {
    if (!m->ds || !m->be || !m->ds->layers) return; /* a load that failed before the layers were allocated */
    for (int32_t l = 0; l < m->ds->hc.n_layers; l++) {
        bk_moe_experts *x = &m->ds->layers[l].ex_dev;
        if (!x->w13) continue;
        void *p[4] = {x->w13, x->s13, x->w2, x->s2};
        for (int i = 0; i < 4; i++) m->be->ops->buf_free(m->be->ctx, p[i]);
        *x = (bk_moe_experts){0};
    }
}

/* ------------------------------------------------------------ tensor parallelism */

int dsv3_tp_slice(model *m, specd_err *err) {
    dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    const int32_t N = m->tp_size, r = m->tp_rank, nh = c->n_heads / N;
    const int64_t n = c->qk_nope, rr = c->qk_rope, v = c->v_head;
    const int64_t I = c->intermediate, Im = c->moe_intermediate, Is = Im * c->n_shared_experts;
    /* expert parallel: the routed experts stay whole (model_ep_range kept only this rank's), so their width
     * need not divide */
    if (I % N || (!m->ep && Im % N) || Is % N)
        return specd_err_set(err, "tensor parallel size %d does not divide the MLP widths (dense %lld, expert %lld%s, "
                                  "shared %lld)", N, (long long)I, (long long)Im, m->ep ? " whole: expert parallel" : "",
                             (long long)Is);
    m->ex_w = (int32_t)(m->ep ? Im : Im / N);
    char what[96];
    for (int32_t l = 0; l < c->n_layers; l++) {
        dsv3_layer *Y = &s->layers[l];
        /* MLA: this rank's heads of q_b and kv_b (and of their absorbed blocks); o_proj by its inputs */
        model_slice_rows(&Y->q_b, (int64_t)r * nh * (n + rr), (int64_t)nh * (n + rr));
        model_slice_rows(&Y->kv_b, (int64_t)r * nh * (n + v), (int64_t)nh * (n + v));
        /* w_uk_t / w_uv were built for this rank's heads only (ds_load_layer) */
        snprintf(what, sizeof what, "layer %d o_proj", l);
        if (model_slice_cols(m, what, &Y->o, (int64_t)r * nh * v, (int64_t)nh * v, err) < 0) return -1;
        /* dense MLP, or the shared experts: column (gate/up) and row (down) parallel */
        if (!Y->moe || Y->has_shared) {
            const int64_t w = (Y->moe ? Is : I) / N;
            model_slice_rows(&Y->gate, (int64_t)r * w, w);
            model_slice_rows(&Y->up, (int64_t)r * w, w);
            snprintf(what, sizeof what, "layer %d %s down_proj", l, Y->moe ? "shared expert" : "MLP");
            if (model_slice_cols(m, what, &Y->down, (int64_t)r * w, w, err) < 0) return -1;
        }
        if (!Y->moe || m->ep) continue; /* expert parallel: this rank's experts whole, the others never loaded */
        /* every routed expert split inside: the router sees the same scores on every rank */
        const int64_t w = Im / N;
        for (int32_t e = 0; e < c->n_routed_experts; e++) {
            model_slice_rows(&Y->ex_gate[e], (int64_t)r * w, w);
            model_slice_rows(&Y->ex_up[e], (int64_t)r * w, w);
            snprintf(what, sizeof what, "layer %d expert %d down_proj", l, e);
            if (model_slice_cols(m, what, &Y->ex_down[e], (int64_t)r * w, w, err) < 0) return -1;
        }
    }
    return 0;
}

static int64_t wbytes(const bk_weight *w) {
    int64_t b = (int64_t)w->rows * (int64_t)w->row_bytes;
    if (w->type == BK_W_I4G32) b += (int64_t)w->rows * (w->cols / 32) * 2;
    return b;
}

int64_t dsv3_weight_bytes(const model *m) {
    const dsv3_state *s = m->ds;
    const hf_config *c = &s->hc;
    int64_t b = 0;
    for (int32_t l = 0; l < c->n_layers; l++) {
        const dsv3_layer *Y = &s->layers[l];
        const bk_weight *ws[] = {&Y->q_a, &Y->q_b, &Y->kv_a, &Y->kv_b, &Y->o, &Y->gate, &Y->up, &Y->down, &Y->router};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            if (ws[i]->data) b += wbytes(ws[i]);
        if (Y->moe)
            for (int32_t e = 0; e < c->n_routed_experts; e++)
                b += wbytes(&Y->ex_gate[e]) + wbytes(&Y->ex_up[e]) + wbytes(&Y->ex_down[e]);
    }
    return b;
}
