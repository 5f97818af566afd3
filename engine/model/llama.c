/*
 * llama.c: the Llama-family target model (Touvron et al. 2023): RMSNorm,
 * GQA attention with RoPE, SwiGLU MLP, optional tied embeddings; loaded from
 * a GGUF file (llama.cpp naming) or a Hugging Face directory (config.json +
 * safetensors, transformers' LlamaForCausalLM naming) and run on the backend
 * op interface over the paged KV cache.
 *
 * Owns: the model struct, converted weight copies (formats the kernels do not
 * take packed are dequantized to f32 at load), the KV storage and a grow-only
 * activation workspace. Packed weights are views into the GGUF mapping; HF
 * BF16/F16/F32 matrices are views into the safetensors mapping (the caller,
 * model.c, keeps the st_model open for the model's lifetime).
 * Tensor parallelism: each linear is declared with its style (LLAMA_LINEARS);
 * at TP = 1 every rank holds everything.
 * RoPE layout: llama.cpp's converter permutes q/k rows for adjacent-pair RoPE,
 * so GGUF weights use neox = false (REFERENCE §4); HF weights use rotate_half.
 * Threading: engine thread only.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/loader/safetensors.h"
#include "engine/model/hf_config.h"
#include "engine/model/model_internal.h"
#include "engine/util/log.h"

/* Parallel style of every linear (Megatron-LM, Shoeybi et al. 2019):
 * q/k/v and gate/up split output features (column), o/down split inputs (row). */
static const struct { const char *name; tp_style style; } LLAMA_LINEARS[] = {
    {"attn_q", TP_COLUMN}, {"attn_k", TP_COLUMN}, {"attn_v", TP_COLUMN}, {"attn_output", TP_ROW},
    {"ffn_gate", TP_COLUMN}, {"ffn_up", TP_COLUMN}, {"ffn_down", TP_ROW},
    {"token_embd", TP_REPLICATED}, {"output", TP_REPLICATED},
    /* the same linears under transformers' names (HF directories) */
    {"q_proj", TP_COLUMN}, {"k_proj", TP_COLUMN}, {"v_proj", TP_COLUMN}, {"o_proj", TP_ROW},
    {"gate_proj", TP_COLUMN}, {"up_proj", TP_COLUMN}, {"down_proj", TP_ROW},
    {"embed_tokens", TP_REPLICATED}, {"lm_head", TP_REPLICATED},
};

/* NAME: a GGUF tensor name (blk.N.attn_q.weight) or an HF one
 * (model.layers.N.self_attn.q_proj.weight); anything else is replicated. */
tp_style model_linear_parallel(const char *gguf_name) {
    for (size_t i = 0; i < sizeof LLAMA_LINEARS / sizeof LLAMA_LINEARS[0]; i++)
        if (strstr(gguf_name, LLAMA_LINEARS[i].name)) return LLAMA_LINEARS[i].style;
    return TP_REPLICATED;
}

/* ------------------------------------------------------------ loading */

void *model_own(model *m, size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) return NULL;
    void **n = realloc(m->owned, sizeof(void *) * (size_t)(m->n_owned + 1));
    if (!n) { free(p); return NULL; }
    m->owned = n;
    m->owned[m->n_owned++] = p;
    return p;
}

/* Makes a bk_weight [rows, cols] view (or an f32 copy) of a GGUF tensor.
 * EXPECT_COLS/EXPECT_ROWS: required shape (innermost first: ne0 = cols). */
static int load_weight(model *m, const char *name, int64_t expect_cols, int64_t expect_rows, bk_weight *w,
                       specd_err *err) {
    const gguf_tensor *t = gguf_find_tensor(m->gguf, name);
    if (!t) return specd_err_set(err, "tensor %s missing", name);
    if (t->n_dims > 2 || (int64_t)t->ne[0] != expect_cols || (int64_t)(t->n_dims == 2 ? t->ne[1] : 1) != expect_rows)
        return specd_err_set(err, "tensor %s has shape [%llu, %llu], expected [%lld, %lld]", name,
                             (unsigned long long)t->ne[0], (unsigned long long)(t->n_dims == 2 ? t->ne[1] : 1),
                             (long long)expect_cols, (long long)expect_rows);
    w->rows = expect_rows;
    w->cols = expect_cols;
    w->scales = NULL;
    uint32_t be = 0, bb = 0;
    if (ggml_type_block(t->type, &be, &bb) < 0) return specd_err_set(err, "tensor %s: unsupported type", name);
    switch (t->type) {
    case GGML_TYPE_F32: w->type = BK_W_F32; break;
    case GGML_TYPE_F16: w->type = BK_W_F16; break;
    case GGML_TYPE_BF16: w->type = BK_W_BF16; break;
    case GGML_TYPE_Q8_0: w->type = BK_W_Q8_0; break;
    case GGML_TYPE_Q4_0: w->type = BK_W_Q4_0; break;
    case GGML_TYPE_Q4_1: w->type = BK_W_Q4_1; break;
    default: {
        /* K-quants: dequantized to f32 once at load (measured simpler; SmolLM2 has none). */
        float *f = model_own(m, sizeof(float) * (size_t)t->n_elements);
        if (!f) return specd_err_set(err, "out of memory dequantizing %s", name);
        if (ggml_dequantize(t->type, t->data, f, t->n_elements) < 0)
            return specd_err_set(err, "cannot dequantize %s (%s)", name, ggml_type_name(t->type));
        w->type = BK_W_F32;
        w->data = f;
        w->row_bytes = sizeof(float) * (size_t)expect_cols;
        return 0;
    }
    }
    w->data = t->data;
    w->row_bytes = (size_t)(expect_cols / be) * bb;
    return 0;
}

/* A norm vector as f32 [n] (view if already f32). */
static int load_vec(model *m, const char *name, int64_t n, float **out, specd_err *err) {
    bk_weight w;
    if (load_weight(m, name, n, 1, &w, err) < 0) return -1;
    if (w.type == BK_W_F32) { *out = (float *)w.data; return 0; }
    float *f = model_own(m, sizeof(float) * (size_t)n);
    if (!f) return specd_err_set(err, "out of memory");
    bk_weight_row_f32(&w, 0, f);
    *out = f;
    return 0;
}

static int meta_i(const gguf_file *f, const char *arch, const char *key, int64_t *v, specd_err *err) {
    char k[160];
    snprintf(k, sizeof k, "%s.%s", arch, key);
    return gguf_get_i64(f, k, v, err);
}
static int meta_f(const gguf_file *f, const char *arch, const char *key, double *v, specd_err *err) {
    char k[160];
    snprintf(k, sizeof k, "%s.%s", arch, key);
    return gguf_get_f64(f, k, v, err);
}

int llama_load_gguf(model *m, specd_err *err) {
    model_config *c = &m->cfg;
    const char *arch = NULL;
    size_t arch_len = 0;
    if (gguf_get_str(m->gguf, "general.architecture", &arch, &arch_len, err) < 0) return -1;
    if (arch_len != 5 || memcmp(arch, "llama", 5) != 0)
        return specd_err_set(err, "GGUF architecture '%.*s' is not supported (llama only)", (int)arch_len, arch);
    int64_t nl, h, nh, nkv = 0, ffn, ctx = 4096, rot = 0;
    double theta = 10000.0, eps;
    if (meta_i(m->gguf, "llama", "block_count", &nl, err) < 0 || meta_i(m->gguf, "llama", "embedding_length", &h, err) < 0 ||
        meta_i(m->gguf, "llama", "attention.head_count", &nh, err) < 0 ||
        meta_i(m->gguf, "llama", "feed_forward_length", &ffn, err) < 0 ||
        meta_f(m->gguf, "llama", "attention.layer_norm_rms_epsilon", &eps, err) < 0)
        return specd_err_wrap(err, "GGUF metadata");
    if (meta_i(m->gguf, "llama", "attention.head_count_kv", &nkv, NULL) < 0) nkv = nh;
    meta_i(m->gguf, "llama", "context_length", &ctx, NULL);
    meta_f(m->gguf, "llama", "rope.freq_base", &theta, NULL);
    if (nl < 1 || nl > 1024 || h < 32 || h > 65536 || nh < 1 || nh > 1024 || nkv < 1 || nh % nkv || h % nh ||
        ffn < 1 || ffn > 1 << 20 || ctx < 1 || !(eps > 0) || !(theta > 0))
        return specd_err_set(err, "GGUF llama hyper-parameters out of range (layers %lld, hidden %lld, heads %lld/%lld)",
                             (long long)nl, (long long)h, (long long)nh, (long long)nkv);
    c->arch = MODEL_ARCH_LLAMA;
    c->n_layers = (int32_t)nl;
    c->hidden = (int32_t)h;
    c->n_heads = (int32_t)nh;
    c->n_kv_heads = (int32_t)nkv;
    c->head_dim = (int32_t)(h / nh);
    if (meta_i(m->gguf, "llama", "rope.dimension_count", &rot, NULL) == 0 && rot != c->head_dim)
        return specd_err_set(err, "partial rotary (rope.dimension_count %lld != head_dim %d) is not supported",
                             (long long)rot, c->head_dim);
    c->ffn = (int32_t)ffn;
    c->max_pos = (int32_t)(ctx > (1 << 24) ? (1 << 24) : ctx);
    c->rope_theta = (float)theta;
    c->rms_eps = (float)eps;
    c->rope_neox = false;
    const char *name = NULL;
    size_t name_len = 0;
    if (gguf_get_str(m->gguf, "general.name", &name, &name_len, NULL) == 0)
        snprintf(c->name, sizeof c->name, "%.*s", (int)name_len, name);

    const gguf_tensor *te = gguf_find_tensor(m->gguf, "token_embd.weight");
    if (!te || te->n_dims != 2) return specd_err_set(err, "tensor token_embd.weight missing or not 2-D");
    if (te->ne[1] < 1 || te->ne[1] > (1u << 22)) return specd_err_set(err, "vocabulary size %llu out of range", (unsigned long long)te->ne[1]);
    c->vocab = (int32_t)te->ne[1];
    if (load_weight(m, "token_embd.weight", h, c->vocab, &m->embed, err) < 0) return -1;
    c->tied_embeddings = gguf_find_tensor(m->gguf, "output.weight") == NULL;
    if (c->tied_embeddings) m->lm_head = m->embed;
    else if (load_weight(m, "output.weight", h, c->vocab, &m->lm_head, err) < 0) return -1;
    if (load_vec(m, "output_norm.weight", h, &m->out_norm, err) < 0) return -1;

    m->layers = calloc((size_t)nl, sizeof *m->layers);
    if (!m->layers) return specd_err_set(err, "out of memory");
    const int64_t qd = (int64_t)nh * c->head_dim, kvd = (int64_t)nkv * c->head_dim;
    for (int32_t l = 0; l < c->n_layers; l++) {
        llama_layer *L = &m->layers[l];
        char n[96];
#define W(field, suffix, cols, rows) \
    snprintf(n, sizeof n, "blk.%d." suffix ".weight", l); \
    if (load_weight(m, n, cols, rows, &L->field, err) < 0) return -1;
        W(wq, "attn_q", h, qd)
        W(wk, "attn_k", h, kvd)
        W(wv, "attn_v", h, kvd)
        W(wo, "attn_output", qd, h)
        W(wgate, "ffn_gate", h, ffn)
        W(wup, "ffn_up", h, ffn)
        W(wdown, "ffn_down", ffn, h)
#undef W
        snprintf(n, sizeof n, "blk.%d.attn_norm.weight", l);
        if (load_vec(m, n, h, &L->attn_norm, err) < 0) return -1;
        snprintf(n, sizeof n, "blk.%d.ffn_norm.weight", l);
        if (load_vec(m, n, h, &L->ffn_norm, err) < 0) return -1;
    }
    return 0;
}

/* ------------------------------------------------------------ HF directories */

/* Refusal naming the tensor and the file of m->path that holds it. */
static int hf_refuse(const model *m, const char *name, specd_err *err, const char *what) {
    char file[256];
    hf_tensor_file(m->path, name, file, sizeof file);
    return specd_err_set(err, "tensor %s (%s/%s): %s", name, m->path, file, what);
}

/* "[d0, d1, ...]" of T into buf. */
static const char *hf_shape(const st_tensor *t, char *buf, size_t cap) {
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < t->n_dims && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
    return buf;
}

/* A [rows, cols] bk_weight view (PyTorch order: rows = out features) of an
 * HF tensor stored as BF16, F16 or F32. */
static int hf_weight(model *m, const st_model *st, const char *name, int64_t rows, int64_t cols, bk_weight *w,
                     specd_err *err) {
    const st_tensor *t = st_find(st, name);
    char what[160];
    if (!t) return hf_refuse(m, name, err, "missing");
    if (t->n_dims != 2 || t->shape[0] != rows || t->shape[1] != cols) {
        char sh[96];
        snprintf(what, sizeof what, "shape %s, expected [%lld, %lld]", hf_shape(t, sh, sizeof sh), (long long)rows,
                 (long long)cols);
        return hf_refuse(m, name, err, what);
    }
    switch (t->dtype) {
    case ST_BF16: w->type = BK_W_BF16; break;
    case ST_F16: w->type = BK_W_F16; break;
    case ST_F32: w->type = BK_W_F32; break;
    default:
        snprintf(what, sizeof what, "dtype %s is not supported (BF16, F16, F32)", st_dtype_name(t->dtype));
        return hf_refuse(m, name, err, what);
    }
    w->rows = rows;
    w->cols = cols;
    w->data = t->data;
    w->row_bytes = (size_t)cols * st_dtype_size(t->dtype);
    w->scales = NULL;
    return 0;
}

/* A norm weight [n] as an f32 copy owned by the model. */
static int hf_vec(model *m, const st_model *st, const char *name, int64_t n, float **out, specd_err *err) {
    const st_tensor *t = st_find(st, name);
    char what[128];
    if (!t) return hf_refuse(m, name, err, "missing");
    if (t->n_dims != 1 || t->shape[0] != n) {
        char sh[96];
        snprintf(what, sizeof what, "shape %s, expected [%lld]", hf_shape(t, sh, sizeof sh), (long long)n);
        return hf_refuse(m, name, err, what);
    }
    if (t->dtype != ST_BF16 && t->dtype != ST_F16 && t->dtype != ST_F32) {
        snprintf(what, sizeof what, "dtype %s is not supported (BF16, F16, F32)", st_dtype_name(t->dtype));
        return hf_refuse(m, name, err, what);
    }
    float *f = model_own(m, sizeof(float) * (size_t)n);
    if (!f) return specd_err_set(err, "out of memory");
    if (st_read_f32(t, f, err) < 0) return specd_err_wrap(err, "%s", name);
    *out = f;
    return 0;
}

/* RoPE inverse frequencies theta^(-2i/d) (Su et al. 2021) with the config's
 * scaling, as transformers' modeling_rope_utils.py computes them:
 *   linear (position interpolation, Chen et al. 2023): inv_freq / factor;
 *   llama3: wavelengths 2 pi / f longer than orig/low_freq_factor are divided
 *   by factor, shorter than orig/high_freq_factor kept, and in between blended
 *   with s = (orig / wavelen - low) / (high - low):
 *   (1 - s) * f / factor + s * f. The attention factor stays 1 for all three. */
static int hf_rope_freqs(model *m, const hf_config *hc, specd_err *err) {
    const int32_t hd = m->cfg.head_dim;
    m->inv_freq = malloc(sizeof(float) * (size_t)(hd / 2));
    if (!m->inv_freq) return specd_err_set(err, "out of memory");
    for (int32_t i = 0; i < hd / 2; i++) {
        double f = 1.0 / pow(hc->rope_theta, (double)(2 * i) / hd);
        if (hc->rope_kind == HF_ROPE_LINEAR) {
            f /= hc->rope_factor;
        } else if (hc->rope_kind == HF_ROPE_LLAMA3) {
            const double pi = 3.14159265358979323846;
            const double wavelen = 2.0 * pi / f, orig = hc->rope_orig_max_pos;
            const double low_wavelen = orig / hc->rope_low_freq, high_wavelen = orig / hc->rope_high_freq;
            if (wavelen > low_wavelen) {
                f /= hc->rope_factor;
            } else if (wavelen >= high_wavelen) {
                const double s = (orig / wavelen - hc->rope_low_freq) / (hc->rope_high_freq - hc->rope_low_freq);
                f = (1.0 - s) * f / hc->rope_factor + s * f;
            }
        }
        m->inv_freq[i] = (float)f;
    }
    return 0;
}

/* Whether NAME is a tensor of a Llama checkpoint with N_LAYERS layers. */
static bool hf_known_tensor(const char *name, int32_t n_layers) {
    static const char *const TOP[] = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"};
    static const char *const PER_LAYER[] = {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight", "self_attn.rotary_emb.inv_freq"}; /* last: old checkpoints, recomputed */
    for (size_t i = 0; i < sizeof TOP / sizeof TOP[0]; i++)
        if (!strcmp(name, TOP[i])) return true;
    int l = -1, off = 0;
    char pre[48];
    if (sscanf(name, "model.layers.%d.%n", &l, &off) != 1 || off == 0 || l < 0 || l >= n_layers) return false;
    snprintf(pre, sizeof pre, "model.layers.%d.", l); /* canonical spelling only (no "01", "+1") */
    if (strncmp(name, pre, strlen(pre)) != 0 || (size_t)off != strlen(pre)) return false;
    for (size_t i = 0; i < sizeof PER_LAYER / sizeof PER_LAYER[0]; i++)
        if (!strcmp(name + off, PER_LAYER[i])) return true;
    return false;
}

int llama_load_hf(model *m, const hf_config *hc, st_model **stp, specd_err *err) {
    model_config *c = &m->cfg;
    *stp = NULL;
    if (hc->arch != MODEL_ARCH_LLAMA) return specd_err_set(err, "not a Llama-family config");
    if (hc->quant.present)
        return specd_err_set(err, "config.json: quantized Llama checkpoints (%s) are not supported (BF16, F16, F32)",
                             hc->quant.method);
    c->arch = MODEL_ARCH_LLAMA;
    c->n_layers = hc->n_layers;
    c->hidden = hc->hidden;
    c->n_heads = hc->n_heads;
    c->n_kv_heads = hc->n_kv_heads;
    c->head_dim = hc->head_dim;
    c->ffn = hc->intermediate;
    c->vocab = hc->vocab;
    c->max_pos = hc->max_pos > (1 << 24) ? (1 << 24) : hc->max_pos;
    c->rope_theta = (float)hc->rope_theta;
    c->rms_eps = (float)hc->rms_eps;
    c->tied_embeddings = hc->tie_embeddings;
    c->rope_neox = true; /* HF q/k rows are in rotate_half order (llama.cpp permutes them for GGUF) */
    const char *base = strrchr(m->path, '/');
    base = base && base[1] ? base + 1 : m->path;
    snprintf(c->name, sizeof c->name, "%.80s (%.31s, HF)", base, hc->model_type);

    if (model_st_open(m, hc, stp, err) < 0) return -1;
    const st_model *st = *stp;
    const int64_t H = c->hidden, qd = (int64_t)c->n_heads * c->head_dim, kvd = (int64_t)c->n_kv_heads * c->head_dim;
    if (hf_weight(m, st, "model.embed_tokens.weight", c->vocab, H, &m->embed, err) < 0) return -1;
    if (c->tied_embeddings) {
        if (st_find(st, "lm_head.weight")) LOG_INFO("%s: tie_word_embeddings: lm_head.weight ignored", m->path);
        m->lm_head = m->embed;
    } else if (hf_weight(m, st, "lm_head.weight", c->vocab, H, &m->lm_head, err) < 0) {
        return specd_err_wrap(err, "tie_word_embeddings is false");
    }
    if (hf_vec(m, st, "model.norm.weight", H, &m->out_norm, err) < 0) return -1;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return specd_err_set(err, "out of memory");
    for (int32_t l = 0; l < c->n_layers; l++) {
        llama_layer *L = &m->layers[l];
        char n[128];
#define W(field, suffix, rows, cols) \
    snprintf(n, sizeof n, "model.layers.%d." suffix ".weight", l); \
    if (hf_weight(m, st, n, rows, cols, &L->field, err) < 0) return -1;
        W(wq, "self_attn.q_proj", qd, H)
        W(wk, "self_attn.k_proj", kvd, H)
        W(wv, "self_attn.v_proj", kvd, H)
        W(wo, "self_attn.o_proj", H, qd)
        W(wgate, "mlp.gate_proj", c->ffn, H)
        W(wup, "mlp.up_proj", c->ffn, H)
        W(wdown, "mlp.down_proj", H, c->ffn)
#undef W
        snprintf(n, sizeof n, "model.layers.%d.input_layernorm.weight", l);
        if (hf_vec(m, st, n, H, &L->attn_norm, err) < 0) return -1;
        snprintf(n, sizeof n, "model.layers.%d.post_attention_layernorm.weight", l);
        if (hf_vec(m, st, n, H, &L->ffn_norm, err) < 0) return -1;
    }
    /* Anything else (a layer past num_hidden_layers, a bias, an unknown
     * tensor) means the checkpoint is not the model config.json describes. */
    for (size_t i = 0; i < st_n_tensors(st); i++) {
        const char *nm = st_tensor_at(st, i)->name;
        if (!hf_known_tensor(nm, c->n_layers)) return hf_refuse(m, nm, err, "unexpected tensor for this config.json");
    }
    return hf_rope_freqs(m, hc, err);
}

/* ------------------------------------------------------------ forward */

int llama_forward(model *m, const model_batch *b, specd_err *err) {
    const model_config *c = &m->cfg;
    const bk_ops *op = m->be->ops;
    void *bx = m->be->ctx;
    const bool hv = m->be->host_visible;
    /* this rank's heads, KV heads and MLP width (all of them at TP 1; tp_shard.c) */
    const int32_t T = b->n_tokens, H = c->hidden, nh = m->nh_l, nkv = m->nkv_l, hd = c->head_dim, F = m->ffn_l;
    const int64_t qd = (int64_t)nh * hd, kvd = (int64_t)nkv * hd, naux = b->aux || b->aux_on_device ? b->n_aux : 0;
    /* aux: the caller's host array (host-visible backends), the reserved fixed buffer (model_aux_reserve: the
     * draft reads it there), else a workspace region downloaded at the end */
    const bool aux_fixed = !hv && naux && model_aux_fixed(m, b);
    /* workspace: x h q k v att | gate up | ids [T] | aux [T, n_aux * H] (device backends without the fixed one) */
    float *w0 = model_workspace(m, (size_t)T * (2 * H + 2 * qd + 2 * kvd + 2 * (int64_t)F + 1 +
                                                (hv || aux_fixed ? 0 : naux * H)) + 11 * BK_TAKE_SLACK);
    if (!w0) return specd_err_set(err, "out of memory for a %d-token step", T);
    bk_cursor wc = {w0};
    bk_tensor x = bk_take(&wc, T, H), h = bk_take(&wc, T, H), q = bk_take(&wc, T, qd), k = bk_take(&wc, T, kvd);
    bk_tensor v = bk_take(&wc, T, kvd), att = bk_take(&wc, T, qd), gate = bk_take(&wc, T, F);
    /* a graph step (model_graph.c) calls this three times: uploads, ops (captured or not), downloads */
    const int ph = m->ph ? m->ph : MODEL_PH_ALL;
    bk_tensor up = bk_take(&wc, T, F);
    int32_t *ids_buf = (int32_t *)(void *)bk_take(&wc, T, 1).data;
    bk_tensor ids = ph & MODEL_PH_UP ? model_ids(m, b, ids_buf) : bk_wrap_i32(ids_buf, T, 1);
    bk_tensor aux = hv ? bk_wrap_f32(b->aux, T, naux * H) : aux_fixed ? bk_rows(m->aux_dev, 0, T) : bk_take(&wc, T, naux * H);

    bk_attn_meta am;
    if (model_step_meta(m, b, T, ph, &am, err) < 0) return -1;
    int rc = -1;
    if (!(ph & MODEL_PH_RUN)) goto outputs;
    if (op->embed(bx, &m->embed, &ids, b->tokens, &x) < 0) { specd_err_set(err, "token id out of range"); goto done; }
    const float scale = 1.0f / sqrtf((float)hd);
#define OPS(call) do { if ((call) < 0) { specd_err_set(err, "%s backend: %s failed", m->be->name, #call); goto done; } } while (0)
    for (int32_t l = 0; l < c->n_layers; l++) {
        const llama_layer *L = &m->layers[l];
        /* the previous layer's MLP residual add, fused into this attention rmsnorm unless the
         * EAGLE-3 capture needs the residual stream entering layer l first */
        bool cap = false;
        for (int32_t a = 0; a < naux; a++) cap |= b->aux_layers[a] == l;
        if (l > 0 && cap) OPS(op->add(bx, &x, &h));
        for (int32_t a = 0; a < naux; a++)
            if (b->aux_layers[a] == l) OPS(op->copy_cols(bx, &aux, (int64_t)a * H, &x));
        /* attention rmsnorm, q/k/v projections, RoPE */
        if (l == 0 || cap) OPS(op->rmsnorm(bx, &x, &L->attn_norm_t, c->rms_eps, &h));
        else OPS(op->add_rmsnorm(bx, &x, &h, &L->attn_norm_t, c->rms_eps, &h));
        const bk_weight *wqkv[3] = {&L->wq, &L->wk, &L->wv};
        bk_tensor *yqkv[3] = {&q, &k, &v};
        OPS(bk_matmul_n(m->be, 3, wqkv, &h, yqkv)); /* one pass where the backend has matmul_n */
        OPS(op->rope(bx, &q, nh, hd, hd, &am, &m->inv_freq_t, 1.0f, c->rope_neox));
        OPS(op->rope(bx, &k, nkv, hd, hd, &am, &m->inv_freq_t, 1.0f, c->rope_neox));
        /* paged KV write, then causal attention over the cache */
        bk_kv_layer kv = model_kv_layer(m, l);
        OPS(op->kv_write(bx, &kv, &am, &k, &v));
        OPS(op->attention(bx, &kv, &am, &q, nh, scale, &att));
        /* output projection (row-parallel: partial sums all-reduced); residual connection + MLP rmsnorm (fused) */
        OPS(op->matmul(bx, &L->wo, &att, &h));
        if (model_tp_all_reduce(m, &h, err) < 0) goto done;
        OPS(op->add_rmsnorm(bx, &x, &h, &L->ffn_norm_t, c->rms_eps, &h));
        /* SwiGLU, down projection (its residual add is fused into the next norm) */
        const bk_weight *wgu[2] = {&L->wgate, &L->wup};
        bk_tensor *ygu[2] = {&gate, &up};
        OPS(bk_matmul_n(m->be, 2, wgu, &h, ygu));
        OPS(op->silu_mul(bx, &gate, &up, &gate));
        OPS(op->matmul(bx, &L->wdown, &gate, &h));
        if (model_tp_all_reduce(m, &h, err) < 0) goto done;
    }
    OPS(op->add(bx, &x, &h)); /* the last layer's residual connection */
#undef OPS
outputs:
    if (!hv && naux && (ph & MODEL_PH_DOWN) && b->aux &&
        op->download(bx, b->aux, aux.data,
                     sizeof(float) * (size_t)(m->ph ? m->ph_rows_down : T) * (size_t)(naux * H)) < 0) {
        specd_err_set(err, "%s backend: aux download failed", m->be->name);
        goto done;
    }
    rc = model_finish_outputs(m, b, &x, err);
done:
    if (rc < 0 || (ph & MODEL_PH_DOWN)) {
        op->meta_release(bx, &am);
        m->ph_dev = NULL;
    }
    return rc;
}
