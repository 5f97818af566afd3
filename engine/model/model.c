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

float *model_workspace(model *m, size_t n) {
    if (n > m->ws_cap) {
        float *p = realloc(m->ws, n * sizeof(float));
        if (!p) return NULL;
        m->ws = p;
        m->ws_cap = n;
    }
    return m->ws;
}

bk_kv_layer model_kv_layer(model *m, int32_t l) {
    bk_kv_layer kv = {
        .k = m->kv + (size_t)l * m->kv_planes * m->kv_layer_elems,
        .v = m->kv_planes == 1 ? m->kv + (size_t)l * m->kv_layer_elems
                               : m->kv + ((size_t)l * 2 + 1) * m->kv_layer_elems,
        .block_size = m->block_size,
        .n_kv_heads = m->cfg.n_kv_heads,
        .head_dim = m->cfg.head_dim,
        .n_blocks = m->n_blocks,
    };
    return kv;
}

int64_t model_kv_bytes_per_token(const model *m) {
    return (int64_t)m->cfg.n_layers * m->kv_planes * m->cfg.n_kv_heads * m->cfg.head_dim * (int64_t)sizeof(float);
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
    m->kv_layer_elems = (size_t)nb * m->block_size * m->cfg.n_kv_heads * m->cfg.head_dim;
    m->kv = calloc(m->kv_layer_elems * (size_t)m->kv_planes * (size_t)m->cfg.n_layers, sizeof(float));
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
    if (S_ISDIR(st.st_mode)) { /* HF directory: config.json decides the architecture */
        hf_config hc;
        if (hf_config_load(path, &hc, err) < 0) goto fail;
        if (hc.arch == MODEL_ARCH_LLAMA) {
            if (llama_load_hf(m, &hc, &ma->st, err) < 0 || model_alloc_kv(m, opts, err) < 0) goto fail;
            goto loaded;
        }
        if (dsv3_load(m, &hc, err) < 0 || model_alloc_kv(m, opts, err) < 0) goto fail;
        goto loaded;
    }
    if (gguf_open(path, &m->gguf, err) < 0) goto fail;
    if (llama_load_gguf(m, err) < 0) goto fail;
    const int32_t hd = m->cfg.head_dim;
    m->inv_freq = malloc(sizeof(float) * (size_t)(hd / 2));
    if (!m->inv_freq) { specd_err_set(err, "out of memory"); goto fail; }
    for (int32_t i = 0; i < hd / 2; i++) /* RoPE frequencies (Su et al. 2021): theta^(-2i/d) */
        m->inv_freq[i] = (float)(1.0 / pow((double)m->cfg.rope_theta, (double)(2 * i) / hd));
    if (model_alloc_kv(m, opts, err) < 0) goto fail;
loaded:
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

void model_destroy(model *m) {
    if (!m) return;
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    free(m->inv_freq);
    free(m->kv);
    free(m->ws);
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
    return m->cfg.arch == MODEL_ARCH_DEEPSEEK_V3 ? dsv3_forward(m, b, err) : llama_forward(m, b, err);
}

int model_finish_outputs(model *m, const model_batch *b, const float *x, specd_err *err) {
    if (b->n_out <= 0 || (!b->logits && !b->final_hidden)) return 0;
    const int32_t H = m->cfg.hidden;
    float *xn = malloc(sizeof(float) * (size_t)b->n_out * H);
    if (!xn) return specd_err_set(err, "out of memory");
    for (int32_t i = 0; i < b->n_out; i++) memcpy(xn + (size_t)i * H, x + (size_t)b->out_idx[i] * H, sizeof(float) * H);
    m->be->ops->rmsnorm(m->be->ctx, xn, m->out_norm, b->n_out, H, m->cfg.rms_eps, xn);
    if (b->final_hidden) memcpy(b->final_hidden, xn, sizeof(float) * (size_t)b->n_out * H);
    int rc = 0;
    if (b->logits && m->be->ops->matmul(m->be->ctx, &m->lm_head, xn, b->n_out, b->logits))
        rc = specd_err_set(err, "LM head matmul failed");
    free(xn);
    return rc;
}

const model_config *model_get_config(const model *m) { return &m->cfg; }
const gguf_file *model_gguf(const model *m) { return m->gguf; }
const char *model_path(const model *m) { return m->path; }
int32_t model_kv_block_size(const model *m) { return m->block_size; }
int32_t model_kv_n_blocks(const model *m) { return m->n_blocks; }
const bk_weight *model_embed_weight(const model *m) { return &m->embed; }
const bk_weight *model_lm_head_weight(const model *m) { return &m->lm_head; }
backend *model_backend(const model *m) { return m->be; }
