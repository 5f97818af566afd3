/*
 * model.c: model loading dispatch, the paged KV storage, the workspace, the
 * final norm + LM head, and the public accessors of model.h.
 *
 * KV storage layout (flashinfer style, documented in backend.h bk_kv_layer):
 * one allocation; layer l's K at [l][0], V at [l][1], each
 * [n_blocks, block_size, n_kv_heads, head_dim] f32. The pool is sized from the
 * byte budget at load. Which block belongs to which sequence is decided by the
 * block manager (engine/runtime), never here.
 * HF directories: config.json picks the architecture (hf_config.c):
 * DeepSeek-V3 / Kimi (deepseek_v3.c) or Llama family (llama.c). An HF Llama's
 * weights are views into the safetensors mappings, which this file keeps open
 * in the model's allocation (model_alloc below) until model_destroy.
 * Threading: engine thread only.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "engine/loader/safetensors.h"
#include "engine/model/hf_config.h"
#include "engine/model/model_internal.h"
#include "engine/util/log.h"

/* Every model is allocated as this wrapper (model first, so a model * is
 * one): the mapped safetensors of an HF Llama directory live next to it. */
typedef struct model_alloc {
    model m;
    st_model *st;                     /* HF Llama: owned, closed after the weights are gone */
} model_alloc;

/* Grow-only backend buffer of n floats (contents not kept when it grows). */
static float *model_grow(model *m, float **buf, size_t *cap, size_t n) {
    if (n > *cap) {
        if (m->gr) { /* captured graphs hold the current address: they go, the step runs eagerly */
            LOG_WARN("model: a step needs %zu workspace floats, more than the %zu the CUDA graphs were captured "
                     "with; graphs released (eager from now on)", n, *cap);
            model_graphs_release(m);
        }
        float *p = m->be->ops->buf_alloc(m->be->ctx, n * sizeof(float));
        if (!p) return NULL;
        m->be->ops->buf_free(m->be->ctx, *buf);
        *buf = p;
        *cap = n;
    }
    return *buf;
}

float *model_workspace(model *m, size_t n) { return model_grow(m, &m->ws, &m->ws_cap, n); }
float *model_workspace_out(model *m, size_t n) { return model_grow(m, &m->ws_out, &m->ws_out_cap, n); }

int model_vec_place(model *m, float *host, int64_t n, bk_tensor *out, specd_err *err) {
    if (m->be->host_visible) {
        *out = bk_wrap_f32(host, 1, n);
        return 0;
    }
    bk_tensor *np = realloc(m->placed, sizeof *np * (size_t)(m->n_placed + 1));
    if (!np) return specd_err_set(err, "out of memory");
    m->placed = np;
    if (bk_tensor_from_host(m->be, host, 1, n, out) < 0)
        return specd_err_set(err, "cannot place %lld floats in %s memory", (long long)n, m->be->name);
    m->placed[m->n_placed++] = *out;
    return 0;
}

/* The layers' weights and norms (DeepSeek-V3's: dsv3_place). */
int model_place(model *m, specd_err *err) {
    const model_config *c = &m->cfg;
    const backend *be = m->be;
    const int32_t rot = c->arch == MODEL_ARCH_DEEPSEEK_V3 ? dsv3_rope_dim(m->ds) : c->head_dim;
    if (model_vec_place(m, m->inv_freq, rot / 2, &m->inv_freq_t, err) < 0 ||
        model_vec_place(m, m->out_norm, c->hidden, &m->out_norm_t, err) < 0)
        return -1;
    /* a tied LM head is a view of the embedding (its vocabulary slice at TP > 1): keep it one */
    m->embed_host = m->embed, m->lm_head_host = m->lm_head;
    const bool tied = c->tied_embeddings;
    const ptrdiff_t head_off = (const char *)m->lm_head.data - (const char *)m->embed.data;
    const int64_t head_rows = m->lm_head.rows;
    if (be->ops->weight_place(be->ctx, &m->embed, &m->embed) < 0) return specd_err_set(err, "placing the embedding");
    if (tied) {
        m->lm_head = m->embed;
        m->lm_head.data = (const char *)m->embed.data + head_off;
        m->lm_head.rows = head_rows;
    } else if (be->ops->weight_place(be->ctx, &m->lm_head, &m->lm_head) < 0)
        return specd_err_set(err, "placing the LM head");
    if (c->arch != MODEL_ARCH_LLAMA) return dsv3_place(m, err);
    for (int32_t l = 0; l < c->n_layers; l++) {
        llama_layer *L = &m->layers[l];
        bk_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->wgate, &L->wup, &L->wdown};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            if (be->ops->weight_place(be->ctx, ws[i], ws[i]) < 0)
                return specd_err_set(err, "placing layer %d's weights in %s memory", l, be->name);
        if (model_vec_place(m, L->attn_norm, c->hidden, &L->attn_norm_t, err) < 0 ||
            model_vec_place(m, L->ffn_norm, c->hidden, &L->ffn_norm_t, err) < 0)
            return -1;
    }
    return 0;
}

bk_tensor model_ids(model *m, const model_batch *b, int32_t *ids_buf) {
    if (m->be->host_visible) return bk_wrap_i32(b->tokens, b->n_tokens, 1);
    if (m->be->ops->upload(m->be->ctx, ids_buf, b->tokens, sizeof(int32_t) * (size_t)b->n_tokens) < 0)
        return bk_wrap_i32(NULL, b->n_tokens, 1); /* embed refuses a NULL tensor */
    return bk_wrap_i32(ids_buf, b->n_tokens, 1);
}

int model_step_meta(model *m, const model_batch *b, int32_t T, int ph, bk_attn_meta *am, specd_err *err) {
    *am = (bk_attn_meta){T, b->pos, b->seq_of, b->block_tables, b->n_seqs, b->tree_mask, NULL};
    if (!(ph & MODEL_PH_UP)) am->dev = m->ph_dev; /* uploaded by this step's upload phase */
    else if (m->be->ops->meta_upload(m->be->ctx, am) < 0)
        return specd_err_set(err, "%s backend: step metadata upload failed", m->be->name);
    m->ph_dev = am->dev;
    return 0;
}

bk_kv_layer model_kv_layer(model *m, int32_t l) {
    if (m->kv_bf16) { /* the same element offsets on a plane of uint16 */
        uint16_t *base = (uint16_t *)(void *)m->kv;
        bk_kv_layer kv = {.block_size = m->block_size, .n_kv_heads = m->nkv_l, .head_dim = m->cfg.head_dim,
                          .n_blocks = m->n_blocks + m->kv_pad_blocks};
        kv.k16 = base + (size_t)l * m->kv_planes * m->kv_layer_elems;
        kv.v16 = m->kv_planes == 1 ? kv.k16 : base + ((size_t)l * 2 + 1) * m->kv_layer_elems;
        return kv;
    }
    bk_kv_layer kv = {
        .k = m->kv + (size_t)l * m->kv_planes * m->kv_layer_elems,
        .v = m->kv_planes == 1 ? m->kv + (size_t)l * m->kv_layer_elems
                               : m->kv + ((size_t)l * 2 + 1) * m->kv_layer_elems,
        .block_size = m->block_size,
        .n_kv_heads = m->nkv_l,
        .head_dim = m->cfg.head_dim,
        .n_blocks = m->n_blocks + m->kv_pad_blocks,
    };
    return kv;
}

int64_t model_kv_bytes_per_token(const model *m) {
    return (int64_t)m->cfg.n_layers * m->kv_planes * m->nkv_l * m->cfg.head_dim * (m->kv_bf16 ? 2 : 4);
}

static int model_alloc_kv(model *m, const model_load_opts *o, specd_err *err) {
    m->block_size = o && o->block_size > 0 ? o->block_size : 16;
    if (m->block_size > 1024) return specd_err_set(err, "block size %d too large", m->block_size);
    const int64_t per_block = model_kv_bytes_per_token(m) * m->block_size;
    int64_t nb = o && o->n_blocks > 0 ? o->n_blocks : 0;
    if (!nb) {
        int64_t budget = o && o->kv_bytes > 0 ? o->kv_bytes : (int64_t)1 << 30;
        nb = budget / per_block;
    }
    if (nb < 1) return specd_err_set(err, "KV budget holds no block (one block needs %lld bytes)", (long long)per_block);
    if (nb > (1 << 24)) nb = 1 << 24;
    m->n_blocks = (int32_t)nb;
    m->kv_layer_elems = (size_t)nb * m->block_size * m->nkv_l * m->cfg.head_dim;
    m->kv = m->be->ops->buf_alloc(m->be->ctx,
                                  m->kv_layer_elems * (size_t)m->kv_planes * (size_t)m->cfg.n_layers *
                                      (m->kv_bf16 ? 2 : sizeof(float)));
    if (!m->kv) return specd_err_set(err, "cannot allocate %lld bytes of KV cache", (long long)(nb * per_block));
    return 0;
}

int model_load(const char *path, backend *be, const model_load_opts *opts, model **out, specd_err *err) {
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0) return specd_err_set(err, "%s: no such file or directory", path);
    model_alloc *ma = calloc(1, sizeof *ma);
    if (!ma) return specd_err_set(err, "out of memory");
    model *m = &ma->m;
    snprintf(m->path, sizeof m->path, "%s", path);
    m->be = be;
    m->kv_planes = 2;
    m->tp = opts ? opts->tp : NULL;
    m->load_threads = opts ? opts->load_threads : 0;
    m->load_lazy = opts && opts->load_lazy;
    m->load_st_flags = opts ? opts->load_st_flags : 0;
    m->load_row_min = opts ? opts->load_row_min : 0;
    m->ep = opts && opts->expert_parallel;
    const double t0 = model_now_s();
    if (S_ISDIR(st.st_mode)) { /* HF directory: config.json decides the architecture */
        hf_config hc;
        if (hf_config_load(path, &hc, err) < 0) goto fail;
        if (hc.arch == MODEL_ARCH_LLAMA) {
            if (m->ep) {
                specd_err_set(err, "expert parallelism needs a mixture-of-experts model (DeepSeek-V3 / Kimi); this is "
                                   "a dense %s model", hc.model_type);
                goto fail;
            }
            if (llama_load_hf(m, &hc, &ma->st, err) < 0 || model_tp_shard(m, err) < 0 ||
                model_alloc_kv(m, opts, err) < 0)
                goto fail;
            goto loaded;
        }
        /* the latent cache in bf16 where asked, and always on a device backend (kn_mla reads bf16 only) */
        m->kv_bf16 = (opts && opts->latent_bf16) || !be->host_visible;
        if (dsv3_load(m, &hc, err) < 0 || model_tp_shard(m, err) < 0 || model_alloc_kv(m, opts, err) < 0) goto fail;
        goto loaded;
    }
    m->load_info.bytes_files = (int64_t)st.st_size;
    if (m->ep) {
        specd_err_set(err, "expert parallelism needs a mixture-of-experts model (DeepSeek-V3 / Kimi, a Hugging Face "
                           "directory); a GGUF file is loaded as a dense llama model");
        goto fail;
    }
    if (gguf_open(path, &m->gguf, err) < 0) goto fail;
    if (llama_load_gguf(m, err) < 0) goto fail;
    const int32_t hd = m->cfg.head_dim;
    m->inv_freq = malloc(sizeof(float) * (size_t)(hd / 2));
    if (!m->inv_freq) { specd_err_set(err, "out of memory"); goto fail; }
    for (int32_t i = 0; i < hd / 2; i++) /* RoPE frequencies (Su et al. 2021): theta^(-2i/d) */
        m->inv_freq[i] = (float)(1.0 / pow((double)m->cfg.rope_theta, (double)(2 * i) / hd));
    if (model_tp_shard(m, err) < 0 || model_alloc_kv(m, opts, err) < 0) goto fail;
loaded:
    if (model_place(m, err) < 0) goto fail;
    m->load_info.seconds = model_now_s() - t0;
    m->load_info.bytes_loaded = m->weight_bytes;
    {
        const model_load_info *li = &m->load_info;
        if (m->gguf || m->load_lazy) /* nothing read up front: a rate would only measure the mapping */
            LOG_INFO("rank %d/%d: mapped %.3f GB in %.2f s (%s: pages read as used, no load rate), %.3f GB in files",
                     m->tp_rank, m->tp_size, (double)li->bytes_loaded * 1e-9, li->seconds, m->gguf ? "GGUF" : "lazy",
                     (double)li->bytes_files * 1e-9);
        else
            LOG_INFO("rank %d/%d: loaded %.3f GB in %.2f s (%.2f GB/s), read %.3f GB of %.3f GB in files", m->tp_rank,
                     m->tp_size, (double)li->bytes_loaded * 1e-9, li->seconds,
                     li->seconds > 0 ? (double)li->bytes_loaded * 1e-9 / li->seconds : 0.0,
                     (double)li->bytes_read * 1e-9, (double)li->bytes_files * 1e-9);
    }
    LOG_INFO("model %s: %s, %d layers, hidden %d, heads %d/%d, vocab %d, KV %d blocks x %d tokens (%.1f MiB)", path,
             m->cfg.name, m->cfg.n_layers, m->cfg.hidden, m->cfg.n_heads, m->cfg.n_kv_heads, m->cfg.vocab, m->n_blocks,
             m->block_size, (double)model_kv_bytes_per_token(m) * m->block_size * m->n_blocks / (1 << 20));
    *out = m;
    return 0;
fail:
    specd_err_wrap(err, "%s", path);
    model_destroy(m);
    return -1;
}

double model_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void model_get_load_info(const model *m, model_load_info *out) { *out = m->load_info; }

void model_destroy(model *m) {
    if (!m) return;
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    free(m->inv_freq);
    for (int i = 0; i < m->n_placed; i++) bk_tensor_free(m->be, &m->placed[i]);
    free(m->placed);
    model_graphs_release(m);
    dsv3_unplace(m);
    if (m->be) {
        m->be->ops->buf_free(m->be->ctx, m->kv);
        m->be->ops->buf_free(m->be->ctx, m->ws);
        m->be->ops->buf_free(m->be->ctx, m->ws_out);
        m->be->ops->buf_free(m->be->ctx, m->aux_dev.data);
    }
    dsv3_free(m->ds);
    gguf_close(m->gguf);
    st_close(((model_alloc *)m)->st);
    free(m);
}

int model_forward(model *m, const model_batch *b, specd_err *err) {
    if (b->n_tokens <= 0) return specd_err_set(err, "empty batch");
    for (int32_t i = 0; i < b->n_tokens; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= m->cfg.vocab)
            return specd_err_set(err, "token id %d out of range [0, %d)", b->tokens[i], m->cfg.vocab);
        if (b->pos[i] < 0 || b->seq_of[i] < 0 || b->seq_of[i] >= b->n_seqs)
            return specd_err_set(err, "bad position or sequence index at token %d", i);
    }
    for (int32_t i = 0; i < b->n_out; i++)
        if (b->out_idx[i] < 0 || b->out_idx[i] >= b->n_tokens) return specd_err_set(err, "bad out_idx");
    if (b->aux_on_device && !model_aux_fixed(m, b))
        return specd_err_set(err, "aux on the device: no reserved aux buffer for %d layers x %d tokens", b->n_aux,
                             b->n_tokens);
    if (m->gr) {
        const int r = model_graph_forward(m, b, err);
        if (r <= 0) return r;
    }
    return m->cfg.arch == MODEL_ARCH_DEEPSEEK_V3 ? dsv3_forward(m, b, err) : llama_forward(m, b, err);
}

int model_aux_reserve(model *m, int32_t n_aux, const int32_t *layers, int32_t max_rows, specd_err *err) {
    if (m->be->host_visible || m->cfg.arch != MODEL_ARCH_LLAMA || n_aux <= 0) return 0;
    if (n_aux > 8 || max_rows <= 0) return specd_err_set(err, "aux buffer: %d layers x %d rows", n_aux, max_rows);
    bool same = m->aux_dev.data && m->aux_n == n_aux && max_rows <= m->aux_dev.rows;
    for (int32_t a = 0; same && a < n_aux; a++) same = m->aux_layers[a] == layers[a];
    if (same) return 0;
    if (m->gr) return specd_err_set(err, "aux buffer: reserve it before capturing CUDA graphs (they bake its address)");
    bk_tensor t;
    if (bk_tensor_alloc(m->be, BK_F32, max_rows, (int64_t)n_aux * m->cfg.hidden, &t) < 0)
        return specd_err_set(err, "aux buffer: out of %s memory for %d x %lld floats", m->be->name, max_rows,
                             (long long)n_aux * m->cfg.hidden);
    bk_tensor_free(m->be, &m->aux_dev);
    m->aux_dev = t;
    m->aux_n = n_aux;
    memcpy(m->aux_layers, layers, sizeof(int32_t) * (size_t)n_aux);
    return 0;
}

const bk_tensor *model_aux_device(const model *m) { return m->aux_dev.data ? &m->aux_dev : NULL; }

bool model_aux_fixed(const model *m, const model_batch *b) {
    if (!m->aux_dev.data || b->n_aux != m->aux_n || b->n_tokens > m->aux_dev.rows) return false;
    for (int32_t a = 0; a < b->n_aux; a++)
        if (b->aux_layers[a] != m->aux_layers[a]) return false;
    return true;
}

/* Output rows: gather out_idx rows of x, final norm, then (optionally) the
 * LM head. On a host-visible backend final_hidden and logits are written in
 * place (zero copies); otherwise they are computed in ws_out and downloaded,
 * which is the only device -> host traffic of a step besides aux. With a
 * vocabulary-parallel LM head each rank computes its V/N columns, they are
 * all-gathered rank-major ([N, n, V/N]) and interleaved into [n, V] on the
 * host. */
int model_finish_outputs(model *m, const model_batch *b, const bk_tensor *x, specd_err *err) {
    const bool dev_logits = !b->logits && b->logits_dev && !m->be->host_visible;
    if (b->n_out <= 0 || (!b->logits && !b->final_hidden && !dev_logits)) return 0;
    const bk_ops *op = m->be->ops;
    void *bx = m->be->ctx;
    const bool hv = m->be->host_visible, split = m->vocab_split && m->tp_size > 1;
    const int32_t H = m->cfg.hidden, n = b->n_out, V = m->cfg.vocab, Vl = m->vocab_l, N = m->tp_size;
    /* ws_out: idx [n] | xn [n, H] | logits [n, V] (device backends) | split: local [n, V/N], gathered [N, n, V/N]
     * (+ the interleaved [n, V] when the logits stay on the device), each region on a 64-byte boundary */
    const size_t lg_floats = !b->logits && !dev_logits ? 0
                             : split ? (size_t)n * Vl * (size_t)(N + 1) + 32 + (dev_logits || m->ph ? (size_t)n * V : 0)
                             : hv    ? 0
                                     : (size_t)n * V;
    const size_t n_pad = ((size_t)n + 15) & ~(size_t)15, xn_pad = ((size_t)n * H + 15) & ~(size_t)15;
    float *w = model_grow(m, &m->ws_out, &m->ws_out_cap, n_pad + xn_pad + lg_floats + 16);
    if (!w) return specd_err_set(err, "out of memory for %d output rows", n);
    w = (float *)(((uintptr_t)w + 63) & ~(uintptr_t)63); /* grown buffers are 16-aligned (calloc) or more */
    /* a graph step runs this in phases (MODEL_PH_*); its download phase brings back the real rows only */
    const int ph = m->ph ? m->ph : MODEL_PH_ALL;
    const int32_t n_down = m->ph ? m->ph_rows_down : n;
    bk_tensor idx = bk_wrap_i32(b->out_idx, n, 1);
    if (!hv) {
        idx.data = w;
        if ((ph & MODEL_PH_UP) && op->upload(bx, w, b->out_idx, sizeof(int32_t) * (size_t)n) < 0) goto dev_fail;
    }
    bk_tensor xn = bk_wrap_f32(w + n_pad, n, H);
    if ((ph & MODEL_PH_RUN) &&
        (op->gather_rows(bx, x, &idx, &xn) < 0 || op->rmsnorm(bx, &xn, &m->out_norm_t, m->cfg.rms_eps, &xn) < 0))
        goto dev_fail;
    if ((ph & MODEL_PH_DOWN) && b->final_hidden &&
        op->download(bx, b->final_hidden, xn.data, sizeof(float) * (size_t)n_down * H) < 0)
        goto dev_fail;
    if (!b->logits && !dev_logits) return 0;
    float *lw = w + n_pad + xn_pad;
    if (!split) {
        bk_tensor lg = hv ? bk_wrap_f32(b->logits, n, V) : bk_wrap_f32(lw, n, V);
        if ((ph & MODEL_PH_RUN) && op->matmul(bx, &m->lm_head, &xn, &lg))
            return specd_err_set(err, "LM head matmul failed");
        if (dev_logits) { /* stays on the device: the caller samples it there (a graph step: its real rows) */
            if (ph & MODEL_PH_DOWN) {
                lg.rows = n_down;
                *b->logits_dev = lg;
            }
            return 0;
        }
        if ((ph & MODEL_PH_DOWN) && op->download(bx, b->logits, lg.data, sizeof(float) * (size_t)n_down * V) < 0)
            goto dev_fail;
        return 0;
    }
    bk_tensor loc = bk_wrap_f32(lw, n, Vl), all = bk_wrap_f32(lw + (((size_t)n * Vl + 15) & ~(size_t)15), (int64_t)N * n, Vl);
    if (m->ph) { /* a graph step (TP, model_graph.c): the gather and the device interleave are captured whatever the
                  * step does with the logits; the download phase brings the real rows of [n, V] or leaves them there */
        bk_tensor lg = bk_wrap_f32(lw + (((size_t)n * Vl + 15) & ~(size_t)15) + (((size_t)N * n * Vl + 15) & ~(size_t)15),
                                   n, V);
        if (ph & MODEL_PH_RUN) {
            if (op->matmul(bx, &m->lm_head, &xn, &loc)) return specd_err_set(err, "LM head matmul failed");
            if (m->tp->all_gather(m->tp->ctx, &loc, &all, err) < 0) return specd_err_wrap(err, "gathering the logits");
            for (int32_t r = 0; r < N; r++) {
                bk_tensor part = bk_wrap_f32((float *)all.data + (size_t)r * n * Vl, n, Vl);
                if (!op->copy_cols || op->copy_cols(bx, &lg, (int64_t)r * Vl, &part) < 0) goto dev_fail;
            }
        }
        if (ph & MODEL_PH_DOWN) {
            lg.rows = n_down;
            if (dev_logits) *b->logits_dev = lg;
            else if (op->download(bx, b->logits, lg.data, sizeof(float) * (size_t)n_down * V) < 0) goto dev_fail;
        }
        return 0;
    }
    if (op->matmul(bx, &m->lm_head, &xn, &loc)) return specd_err_set(err, "LM head matmul failed");
    if (m->tp->all_gather(m->tp->ctx, &loc, &all, err) < 0) return specd_err_wrap(err, "gathering the logits");
    if (dev_logits) { /* interleave [N, n, V/N] into [n, V] on the device (rank r's columns at r V/N); it stays there */
        bk_tensor lg = bk_wrap_f32(lw + (((size_t)n * Vl + 15) & ~(size_t)15) + (((size_t)N * n * Vl + 15) & ~(size_t)15),
                                   n, V);
        for (int32_t r = 0; r < N; r++) {
            bk_tensor part = bk_wrap_f32((float *)all.data + (size_t)r * n * Vl, n, Vl);
            if (op->copy_cols(bx, &lg, (int64_t)r * Vl, &part) < 0) goto dev_fail;
        }
        *b->logits_dev = lg;
        return 0;
    }
    float *host = hv ? bk_f32(&all) : b->logits; /* device: download [N, n, Vl] into logits, then permute in place */
    if (!hv) {
        if (op->download(bx, b->logits, all.data, bk_nbytes(&all)) < 0) goto dev_fail;
        float *tmp = malloc(bk_nbytes(&all));
        if (!tmp) return specd_err_set(err, "out of memory");
        memcpy(tmp, b->logits, bk_nbytes(&all));
        host = tmp;
    }
    for (int32_t i = 0; i < n; i++)
        for (int32_t r = 0; r < N; r++)
            memcpy(b->logits + (size_t)i * V + (size_t)r * Vl, host + ((size_t)r * n + i) * Vl, sizeof(float) * Vl);
    if (!hv) free(host);
    return 0;
dev_fail:
    return specd_err_set(err, "%s backend: output rows failed", m->be->name);
}

bool model_logits_on_device(const model *m) {
    return !m->be->host_visible && m->be->ops->sample && (!(m->vocab_split && m->tp_size > 1) || m->be->ops->copy_cols);
}

const model_config *model_get_config(const model *m) { return &m->cfg; }
const gguf_file *model_gguf(const model *m) { return m->gguf; }
const char *model_path(const model *m) { return m->path; }
int32_t model_kv_block_size(const model *m) { return m->block_size; }
int32_t model_kv_n_blocks(const model *m) { return m->n_blocks; }
/* Host views (the draft's): on a device backend the model's own copies are in device memory. */
const bk_weight *model_embed_weight(const model *m) { return m->be->host_visible ? &m->embed : &m->embed_host; }
/* At TP > 1 this rank's LM head is a vocabulary slice; the draft gets the whole one (host-visible backends). */
const bk_weight *model_lm_head_weight(const model *m) {
    return m->tp_size > 1 ? &m->lm_head_full : m->be->host_visible ? &m->lm_head : &m->lm_head_host;
}
backend *model_backend(const model *m) { return m->be; }
const bk_weight *model_embed_placed(const model *m) { return &m->embed; } /* replicated whole at TP too */
const bk_weight *model_lm_head_placed(const model *m) { return m->tp_size > 1 ? NULL : &m->lm_head; }
