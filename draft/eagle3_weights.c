/*
 * eagle3_weights.c: loading an EAGLE-3 head directory into eagle3_head
 * (REFERENCE.md §2 "Checkpoint formats to load"), and the draft KV pool.
 *
 * Tensors (layer prefix `midlayer.` for EAGLE/SpecForge, `layers.0.` for
 * speculators; the other prefix is accepted too, with a note in the log):
 *   fc.weight [H, A*Ht]; <p>self_attn.{q,k,v}_proj.weight [nh*hd | nkv*hd, 2H]
 *   (+ .bias when attention_bias); <p>self_attn.o_proj.weight [H, nh*hd]
 *   (+ .bias [H] when attention_bias and present: HF Llama semantics);
 *   <p>mlp.{gate,up}_proj.weight [I, H], <p>mlp.down_proj.weight [H, I];
 *   <p>{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H];
 *   norm.weight [H]; lm_head.weight [Vd, H] (optional); embed_tokens.weight
 *   [Vt, H] (optional); d2t int64 [Vd] (optional); t2d bool [Vt] (optional).
 * Matrices in bf16 / f16 / f32 are used IN PLACE from the mapping (copied
 * only when misaligned), or re-quantized to Q8_0 copies when asked (a CPU
 * speed option); norms and biases are converted to f32 copies.
 * Absent embed_tokens: the target's table is shared (needs H == Ht). Absent
 * lm_head: the target's LM-head rows used[0..Vd) are gathered into a copy in
 * the target's own storage format.
 * Invariants after load: every shape matches the config and the target; the
 * vocab map passed eagle3_vocab_validate; aux layers lie inside the target.
 * Threading: engine thread only.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "draft/eagle3_internal.h"
#include "draft/eagle3_tp.h"
#include "engine/loader/gguf.h" /* fp16 conversion */
#include "engine/util/log.h"

void *head_own(eagle3_head *h, size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) return NULL;
    void **n = realloc(h->owned, sizeof(void *) * (size_t)(h->n_owned + 1));
    if (!n) { free(p); return NULL; }
    h->owned = n;
    h->owned[h->n_owned++] = p;
    return p;
}

float *eagle3_workspace(eagle3_head *h, size_t n) {
    if (n > h->ws_cap) {
        backend *be = h->tgt.be;
        if (h->dev) {
            LOG_ERROR("eagle3: a draft call needs %zu workspace floats; the head was sized at load for %d rows (%zu)",
                      n, h->max_rows, h->ws_cap);
            return NULL;
        }
        float *p = be->ops->buf_alloc(be->ctx, n * sizeof(float));
        if (!p) return NULL;
        be->ops->buf_free(be->ctx, h->ws);
        h->ws = p;
        h->ws_cap = n;
    }
    return h->ws;
}

/* Records a backend allocation of the head (freed at destroy). */
static int head_placed(eagle3_head *h, const void *p) {
    void **n = realloc(h->placed, sizeof(void *) * (size_t)(h->n_placed + 1));
    if (!n) return -1;
    h->placed = n;
    h->placed[h->n_placed++] = (void *)(uintptr_t)p;
    return 0;
}

static const st_tensor *find_layer(eagle3_head *h, const char *key, const char **prefix_used) {
    static const char *const prefixes[] = {"midlayer.", "layers.0."};
    int first = h->cfg.layout == EAGLE3_LAYOUT_SPECULATORS ? 1 : 0;
    char name[160];
    for (int k = 0; k < 2; k++) {
        const char *p = prefixes[(first + k) % 2];
        snprintf(name, sizeof name, "%s%s", p, key);
        const st_tensor *t = st_find(h->st, name);
        if (t) {
            if (prefix_used) *prefix_used = p;
            return t;
        }
    }
    return NULL;
}

/* A bk_weight [rows, cols] over tensor T (in place when the dtype and
 * alignment allow, else an f32 copy). */
static int load_matrix(eagle3_head *h, const st_tensor *t, const char *name, int64_t rows, int64_t cols, bk_weight *w,
                       specd_err *err) {
    if (!t) return specd_err_set(err, "tensor %s is missing", name);
    if (t->n_dims != 2 || t->shape[0] != rows || t->shape[1] != cols)
        return specd_err_set(err, "tensor %s has shape [%lld, %lld] (%d dims), expected [%lld, %lld]", name,
                             (long long)(t->n_dims > 0 ? t->shape[0] : 0), (long long)(t->n_dims > 1 ? t->shape[1] : 0),
                             t->n_dims, (long long)rows, (long long)cols);
    w->rows = rows;
    w->cols = cols;
    w->scales = NULL;
    uintptr_t a = (uintptr_t)t->data;
    if ((t->dtype == ST_BF16 || t->dtype == ST_F16) && a % 2 == 0) {
        w->type = t->dtype == ST_BF16 ? BK_W_BF16 : BK_W_F16;
        w->data = t->data;
        w->row_bytes = 2 * (size_t)cols;
        return 0;
    }
    if (t->dtype == ST_F32 && a % 4 == 0) {
        w->type = BK_W_F32;
        w->data = t->data;
        w->row_bytes = 4 * (size_t)cols;
        return 0;
    }
    if (t->dtype != ST_BF16 && t->dtype != ST_F16 && t->dtype != ST_F32 && t->dtype != ST_F64)
        return specd_err_set(err, "tensor %s has dtype %s (bf16, f16 or f32 expected)", name, st_dtype_name(t->dtype));
    float *f = head_own(h, sizeof(float) * (size_t)rows * (size_t)cols);
    if (!f) return specd_err_set(err, "out of memory converting %s", name);
    if (st_read_f32(t, f, err) < 0) return specd_err_wrap(err, "%s", name);
    w->type = BK_W_F32;
    w->data = f;
    w->row_bytes = 4 * (size_t)cols;
    return 0;
}

static int load_vec(eagle3_head *h, const st_tensor *t, const char *name, int64_t n, float **out, specd_err *err) {
    if (!t) return specd_err_set(err, "tensor %s is missing", name);
    if (t->n_dims != 1 || t->shape[0] != n)
        return specd_err_set(err, "tensor %s has %d dims / %lld values, expected [%lld]", name, t->n_dims,
                             (long long)(t->n_dims ? t->shape[0] : 0), (long long)n);
    float *f = head_own(h, sizeof(float) * (size_t)n);
    if (!f) return specd_err_set(err, "out of memory");
    if (st_read_f32(t, f, err) < 0) return specd_err_wrap(err, "%s", name);
    *out = f;
    return 0;
}

/* d2t int64 (or int32) [Vd] and t2d bool/u8 [Vt] -> validated used[]. */
static int load_vocab(eagle3_head *h, specd_err *err) {
    const eagle3_config *c = &h->cfg;
    const int64_t Vd = c->draft_vocab, Vt = h->tgt.vocab;
    const st_tensor *td = st_find(h->st, "d2t"), *tt = st_find(h->st, "t2d");
    int64_t *d2t = NULL;
    const uint8_t *t2d = NULL;
    if (td) {
        if (td->n_dims != 1 || td->shape[0] != Vd)
            return specd_err_set(err, "d2t has %lld entries, draft_vocab_size is %lld", (long long)(td->n_dims ? td->shape[0] : 0),
                                 (long long)Vd);
        if (td->dtype != ST_I64 && td->dtype != ST_I32)
            return specd_err_set(err, "d2t has dtype %s (int64 expected)", st_dtype_name(td->dtype));
        d2t = head_own(h, sizeof(int64_t) * (size_t)Vd);
        if (!d2t) return specd_err_set(err, "out of memory");
        for (int64_t i = 0; i < Vd; i++) {
            if (td->dtype == ST_I64) memcpy(&d2t[i], (const char *)td->data + 8 * i, 8);
            else { int32_t v; memcpy(&v, (const char *)td->data + 4 * i, 4); d2t[i] = v; }
        }
    }
    if (tt) {
        if (tt->n_dims != 1 || tt->shape[0] != Vt)
            return specd_err_set(err, "t2d has %lld entries, the target vocabulary has %lld",
                                 (long long)(tt->n_dims ? tt->shape[0] : 0), (long long)Vt);
        if (tt->dtype != ST_BOOL && tt->dtype != ST_U8)
            return specd_err_set(err, "t2d has dtype %s (bool expected)", st_dtype_name(tt->dtype));
        t2d = tt->data;
    }
    h->used = head_own(h, sizeof(int64_t) * (size_t)Vd);
    if (!h->used) return specd_err_set(err, "out of memory");
    if (eagle3_vocab_validate(d2t, Vd, t2d, Vt, h->used, &h->vocab, err) < 0) return -1;
    char line[256];
    eagle3_vocab_summary(&h->vocab, line, sizeof line);
    LOG_INFO("eagle3 vocab: %s", line);
    if (h->vocab.warning[0]) LOG_WARN("eagle3 vocab: %s", h->vocab.warning);
    return 0;
}

/* Copies the rows of SRC for the draft ids d with keep(d) (all when h->hot is
 * NULL, else those whose target id is hot) into a head-owned matrix, kept in
 * SRC's format; row of draft id d = SRC row (by_target ? used[d] : d). Then
 * lm_head = that matrix and used[] = the kept ids' target ids. */
static int cut_lm_head(eagle3_head *h, const bk_weight *src, bool by_target, specd_err *err) {
    const int64_t Vd = h->cfg.draft_vocab;
    int64_t kept = 0;
    for (int64_t d = 0; d < Vd; d++) kept += !h->hot || h->hot[h->used[d]];
    if (kept == 0) return specd_err_set(err, "none of the hot vocabulary's ids is in the head's draft vocabulary");
    const size_t sc_row = src->scales ? (size_t)(src->cols / 32) : 0;
    char *rows = head_own(h, src->row_bytes * (size_t)kept);
    uint16_t *sc = sc_row ? head_own(h, sizeof(uint16_t) * sc_row * (size_t)kept) : NULL;
    int64_t *used = h->hot ? head_own(h, sizeof(int64_t) * (size_t)kept) : h->used;
    if (!rows || !used || (sc_row && !sc)) return specd_err_set(err, "out of memory cutting the LM head");
    for (int64_t d = 0, j = 0; d < Vd; d++) {
        if (h->hot && !h->hot[h->used[d]]) continue;
        const int64_t r = by_target ? h->used[d] : d;
        memcpy(rows + src->row_bytes * (size_t)j, (const char *)src->data + src->row_bytes * (size_t)r, src->row_bytes);
        if (sc_row) memcpy(sc + sc_row * (size_t)j, (const uint16_t *)src->scales + sc_row * (size_t)r, 2 * sc_row);
        used[j++] = h->used[d];
    }
    h->lm_head = *src;
    h->lm_head.rows = kept;
    h->lm_head.data = rows;
    h->lm_head.scales = sc;
    h->used = used;
    return 0;
}

/* lm_head [Vd, H] = rows used[] of the target's LM head (only the hot ones
 * with a hot vocabulary), kept in its format. */
static int gather_lm_head(eagle3_head *h, specd_err *err) {
    if (h->cfg.hidden != h->tgt.hidden)
        return specd_err_set(err, "the head has no lm_head.weight and its hidden size %d differs from the target's %d",
                             h->cfg.hidden, h->tgt.hidden);
    return cut_lm_head(h, h->tgt.lm_head, true, err);
}

/* Reads the vocab map at PATH into hot[Vt] (1 = its target id is in the map);
 * *n_ids = its distinct ids. The caller frees *hot_out. */
static int read_hot(const char *path, int64_t Vt, uint8_t **hot_out, int64_t *n_ids, specd_err *err) {
    *hot_out = NULL;
    st_model *m = NULL;
    if (st_open(path, &m, err) < 0) return specd_err_wrap(err, "hot vocabulary %s", path);
    const st_tensor *t = st_find(m, "d2t");
    const char *tv = st_metadata(m, "target_vocab_size"); /* written by `specd vocab build` */
    int rc = 0;
    uint8_t *hot = NULL;
    if (tv && strtoll(tv, NULL, 10) != Vt) {
        rc = specd_err_set(err, "hot vocabulary %s was built for a target vocabulary of %s ids, this target has %lld",
                           path, tv, (long long)Vt);
        goto done;
    }
    if (!t || t->dtype != ST_I64 || t->n_dims != 1 || t->shape[0] < 1 || t->shape[0] > Vt) {
        rc = specd_err_set(err, "hot vocabulary %s: needs d2t, int64 [n] with 1 <= n <= %lld (a `specd vocab build` map)",
                           path, (long long)Vt);
        goto done;
    }
    hot = calloc((size_t)Vt, 1);
    if (!hot) { rc = specd_err_set(err, "out of memory"); goto done; }
    for (int64_t i = 0; i < t->shape[0]; i++) {
        int64_t off;
        memcpy(&off, (const char *)t->data + 8 * (size_t)i, 8);
        if (off < -i || off >= Vt - i) {
            rc = specd_err_set(err, "hot vocabulary %s: d2t[%lld] = %lld maps outside the target vocabulary %lld", path,
                               (long long)i, (long long)off, (long long)Vt);
            goto done;
        }
        hot[i + off] = 1;
    }
    *n_ids = 0;
    for (int64_t i = 0; i < Vt; i++) *n_ids += hot[i];
done:
    st_close(m);
    if (rc) free(hot);
    else *hot_out = hot;
    return rc;
}

int eagle3_hot_vocab_check(const char *path, int64_t target_vocab, specd_err *err) {
    uint8_t *hot = NULL;
    int64_t n = 0;
    int rc = read_hot(path, target_vocab, &hot, &n, err);
    free(hot);
    return rc;
}

static int load_tensors(eagle3_head *h, specd_err *err) {
    const eagle3_config *c = &h->cfg;
    const int64_t H = c->hidden, Ht = c->target_hidden, qd = (int64_t)c->n_heads * c->head_dim,
                  kvd = (int64_t)c->n_kv_heads * c->head_dim, I = c->ffn;
    const st_tensor *fc = st_find(h->st, "fc.weight");
    if (!fc || fc->n_dims != 2) return specd_err_set(err, "tensor fc.weight is missing or not 2-D");
    if (fc->shape[1] % Ht || fc->shape[1] / Ht < 1 || fc->shape[1] / Ht > EAGLE3_MAX_AUX)
        return specd_err_set(err, "fc.weight has %lld input features, not a multiple (1..%d) of target_hidden_size %lld",
                             (long long)fc->shape[1], EAGLE3_MAX_AUX, (long long)Ht);
    h->n_aux = (int32_t)(fc->shape[1] / Ht);
    if (load_matrix(h, fc, "fc.weight", H, h->n_aux * Ht, &h->fc, err) < 0) return -1;
    if (st_find(h->st, "layers.1.self_attn.q_proj.weight") || st_find(h->st, "midlayer.1.self_attn.q_proj.weight"))
        return specd_err_set(err, "the head has more than one decoder layer; specd implements single-layer EAGLE-3 heads");
    const char *pfx = NULL;
    const char *want = c->layout == EAGLE3_LAYOUT_SPECULATORS ? "layers.0." : "midlayer.";
    struct { const char *key; bk_weight *w; int64_t rows, cols; } mats[] = {
        {"self_attn.q_proj.weight", &h->wq, qd, 2 * H}, {"self_attn.k_proj.weight", &h->wk, kvd, 2 * H},
        {"self_attn.v_proj.weight", &h->wv, kvd, 2 * H}, {"self_attn.o_proj.weight", &h->wo, H, qd},
        {"mlp.gate_proj.weight", &h->wgate, I, H},       {"mlp.up_proj.weight", &h->wup, I, H},
        {"mlp.down_proj.weight", &h->wdown, H, I},
    };
    for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
        char name[160];
        snprintf(name, sizeof name, "%s%s", want, mats[i].key);
        if (load_matrix(h, find_layer(h, mats[i].key, &pfx), name, mats[i].rows, mats[i].cols, mats[i].w, err) < 0)
            return -1;
    }
    if (pfx && strcmp(pfx, want) != 0)
        LOG_WARN("eagle3: %s layout config but tensors are named %s*: loading them anyway", eagle3_layout_name(c->layout), pfx);
    struct { const char *key; float **v; } vecs[] = {
        {"input_layernorm.weight", &h->n_input}, {"hidden_norm.weight", &h->n_hidden},
        {"post_attention_layernorm.weight", &h->n_post},
    };
    for (size_t i = 0; i < 3; i++)
        if (load_vec(h, find_layer(h, vecs[i].key, NULL), vecs[i].key, H, vecs[i].v, err) < 0) return -1;
    if (load_vec(h, st_find(h->st, "norm.weight"), "norm.weight", H, &h->n_final, err) < 0) return -1;
    if (c->attention_bias) {
        if (load_vec(h, find_layer(h, "self_attn.q_proj.bias", NULL), "self_attn.q_proj.bias", qd, &h->bq, err) < 0 ||
            load_vec(h, find_layer(h, "self_attn.k_proj.bias", NULL), "self_attn.k_proj.bias", kvd, &h->bk, err) < 0 ||
            load_vec(h, find_layer(h, "self_attn.v_proj.bias", NULL), "self_attn.v_proj.bias", kvd, &h->bv, err) < 0)
            return -1;
        /* HF Llama's attention_bias also covers o_proj (tools/eagle3/NOTES.md); optional here */
        const st_tensor *ob = find_layer(h, "self_attn.o_proj.bias", NULL);
        if (ob && load_vec(h, ob, "self_attn.o_proj.bias", H, &h->bo, err) < 0) return -1;
    } else if (find_layer(h, "self_attn.q_proj.bias", NULL)) {
        return specd_err_set(err, "the head has q/k/v biases but config attention_bias is false");
    }
    if (load_vocab(h, err) < 0) return -1;
    const st_tensor *lm = st_find(h->st, "lm_head.weight");
    if (lm) {
        if (load_matrix(h, lm, "lm_head.weight", c->draft_vocab, H, &h->lm_head, err) < 0) return -1;
        const bk_weight full = h->lm_head;
        if (h->hot && cut_lm_head(h, &full, false, err) < 0) return -1; /* a gathered one is cut while gathering */
    } else if (gather_lm_head(h, err) < 0) {
        return -1;
    }
    const st_tensor *em = st_find(h->st, "embed_tokens.weight");
    if (em) {
        if (load_matrix(h, em, "embed_tokens.weight", h->tgt.vocab, H, &h->own_embed, err) < 0) return -1;
        h->embed = &h->own_embed;
    } else {
        if (H != h->tgt.hidden)
            return specd_err_set(err, "the head has no embed_tokens.weight and its hidden size %lld differs from the "
                                      "target's %d", (long long)H, h->tgt.hidden);
        h->embed = h->tgt.embed;
    }
    LOG_INFO("eagle3: lm_head %s, embed_tokens %s", lm ? "from the head" : "gathered from the target's rows",
             em ? "from the head" : "shared with the target");
    return 0;
}

/* Q8_0 (ggml): blocks of 32 values, fp16 scale d = max|x| / 127, int8 q = round(x / d). */
static int requant_q8_0(eagle3_head *h, bk_weight *w, specd_err *err) {
    if (w->type != BK_W_F32 && w->type != BK_W_BF16 && w->type != BK_W_F16) return 0; /* already packed */
    if (w->cols % 32) return specd_err_set(err, "cannot quantize a matrix of %lld columns to Q8_0", (long long)w->cols);
    const size_t nb = (size_t)(w->cols / 32), row_bytes = nb * 34;
    uint8_t *dst = head_own(h, row_bytes * (size_t)w->rows);
    float *row = malloc(sizeof(float) * (size_t)w->cols);
    if (!dst || !row) {
        free(row);
        return specd_err_set(err, "out of memory quantizing the draft head");
    }
    for (int64_t r = 0; r < w->rows; r++) {
        bk_weight_row_f32(w, r, row);
        for (size_t b = 0; b < nb; b++) {
            const float *x = row + b * 32;
            uint8_t *blk = dst + (size_t)r * row_bytes + b * 34;
            float amax = 0;
            for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            const float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
            uint16_t dh = specd_f32_to_fp16(d);
            memcpy(blk, &dh, 2);
            for (int i = 0; i < 32; i++) blk[2 + i] = (uint8_t)(int8_t)lroundf(x[i] * id);
        }
    }
    free(row);
    w->type = BK_W_Q8_0;
    w->data = dst;
    w->row_bytes = row_bytes;
    w->scales = NULL;
    return 0;
}

static int alloc_kv(eagle3_head *h, const eagle3_head_opts *o, specd_err *err) {
    h->block_size = o && o->block_size > 0 ? o->block_size : 16;
    h->n_blocks = o && o->n_blocks > 0 ? o->n_blocks : 1024;
    if (h->block_size > 1024 || h->n_blocks > (1 << 22))
        return specd_err_set(err, "draft KV: %d blocks of %d tokens is out of range", h->n_blocks, h->block_size);
    /* a device TP shard (cut before this) holds its KV heads only; a CPU TP shard is cut after (whole pool) */
    const size_t elems = (size_t)h->n_blocks * h->block_size * (h->tp ? h->nkv_l : h->cfg.n_kv_heads) * h->cfg.head_dim;
    backend *be = h->tgt.be; /* zeroed backend memory (calloc on the CPU) */
    h->kv_k = be->ops->buf_alloc(be->ctx, elems * sizeof(float));
    h->kv_v = be->ops->buf_alloc(be->ctx, elems * sizeof(float));
    h->free_ids = malloc(sizeof(int32_t) * (size_t)h->n_blocks);
    if (!h->kv_k || !h->kv_v || !h->free_ids)
        return specd_err_set(err, "cannot allocate the draft KV cache (%zu bytes of %s memory)",
                             2 * elems * sizeof(float), be->name);
    for (int32_t i = 0; i < h->n_blocks; i++) h->free_ids[i] = h->n_blocks - 1 - i; /* pop order 0, 1, 2, ... */
    h->n_free = h->n_blocks;
    return 0;
}

/* A copy of host floats [1, n] in backend memory, recorded for destroy. */
static int vec_place(eagle3_head *h, const float *host, int64_t n, bk_tensor *out, specd_err *err) {
    if (!host) return 0;
    if (bk_tensor_from_host(h->tgt.be, host, 1, n, out) < 0 || head_placed(h, out->data) < 0)
        return specd_err_set(err, "cannot place %lld floats of the head in %s memory", (long long)n, h->tgt.be->name);
    return 0;
}

static int mat_place(eagle3_head *h, bk_weight *w, const char *name, specd_err *err) {
    backend *be = h->tgt.be;
    if (be->ops->weight_place(be->ctx, w, w) < 0 || head_placed(h, w->data) < 0)
        return specd_err_set(err, "cannot place the head's %s [%lld x %lld] in %s memory", name, (long long)w->rows,
                             (long long)w->cols, be->name);
    return 0;
}

/* Backend residency, after every host-side conversion (hot-vocabulary cut,
 * Q8_0): the d2t map and the workspace on every backend; on a device backend
 * also every matrix and vector. The embedding is the target's placed copy
 * when it has one (and so is the LM head when the gathered rows are the
 * target's whole head in order); otherwise the head places its own. */
static int head_place(eagle3_head *h, const eagle3_head_opts *o, specd_err *err) {
    backend *be = h->tgt.be;
    const eagle3_config *c = &h->cfg;
    const int64_t Vs = eagle3_head_n_scored(h); /* all of them when a TP shard holds 1/N of the LM head's rows */
    /* d2t of the logits rows: used[i] - i (int32: ids fit, the map was validated) */
    int32_t *off = malloc(sizeof(int32_t) * (size_t)Vs);
    if (!off) return specd_err_set(err, "out of memory");
    for (int64_t i = 0; i < Vs; i++) off[i] = (int32_t)(h->used[i] - i);
    int rc = bk_tensor_alloc(be, BK_I32, Vs, 1, &h->d2t);
    if (rc == 0) rc = be->ops->upload(be->ctx, h->d2t.data, off, sizeof(int32_t) * (size_t)Vs);
    if (rc == 0 && !be->host_visible) rc = be->ops->download(be->ctx, NULL, NULL, 0); /* off is freed next */
    free(off);
    if (rc < 0) return specd_err_set(err, "cannot place the draft's d2t map in %s memory", be->name);
    h->max_rows = o && o->max_rows > 0 ? o->max_rows : 512;
    size_t ws = eagle3_layer_ws(h, h->max_rows) > (size_t)h->max_rows * (size_t)c->hidden + 64
                    ? eagle3_layer_ws(h, h->max_rows)
                    : (size_t)h->max_rows * (size_t)c->hidden + 64;
    if (eagle3_tp_vocab_split(h) && eagle3_tp_mirror(h)) { /* eagle3_logits_t: xn, local logits, the gathered rows */
        const size_t lr = (size_t)(o->logit_rows > 0 && o->logit_rows < h->max_rows ? o->logit_rows : h->max_rows);
        const size_t lw = lr * ((size_t)c->hidden + (size_t)h->lm_head.rows * (1 + (size_t)eagle3_tp_size(h))) + 64;
        if (lw > ws) ws = lw;
    }
    if (!(h->ws = be->ops->buf_alloc(be->ctx, ws * sizeof(float))))
        return specd_err_set(err, "cannot allocate the draft workspace (%d rows, %zu bytes of %s memory)", h->max_rows,
                             ws * sizeof(float), be->name);
    h->ws_cap = ws;
    if (be->host_visible) return 0;
    h->dev = true;
    const int64_t H = c->hidden, qd = (int64_t)(h->tp ? h->nh_l : c->n_heads) * c->head_dim,
                  kvd = (int64_t)(h->tp ? h->nkv_l : c->n_kv_heads) * c->head_dim; /* this rank's (device TP) */
    struct { bk_weight *w; const char *name; } mats[] = {
        {&h->fc, "fc"}, {&h->wq, "q_proj"}, {&h->wk, "k_proj"}, {&h->wv, "v_proj"}, {&h->wo, "o_proj"},
        {&h->wgate, "gate_proj"}, {&h->wup, "up_proj"}, {&h->wdown, "down_proj"},
    };
    for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++)
        if (mat_place(h, mats[i].w, mats[i].name, err) < 0) return -1;
    const bk_weight *tl = h->tgt.lm_head;
    const bool whole = h->tgt.lm_head_placed && h->lm_head.type == tl->type && h->lm_head.rows == tl->rows &&
                       h->lm_head.cols == tl->cols && h->lm_head.row_bytes == tl->row_bytes &&
                       !memcmp(h->lm_head.data, tl->data, tl->row_bytes * (size_t)tl->rows);
    if (whole) {
        h->lm_head = *h->tgt.lm_head_placed; /* the target's own device LM head: the same rows in the same order */
    } else if (mat_place(h, &h->lm_head, "lm_head", err) < 0) {
        return -1;
    }
    if (h->embed == &h->own_embed) {
        if (mat_place(h, &h->own_embed, "embed_tokens", err) < 0) return -1;
    } else if (h->tgt.embed_placed) {
        h->embed = h->tgt.embed_placed;
    } else {
        h->own_embed = *h->tgt.embed; /* a target on another backend: a copy of its table */
        h->embed = &h->own_embed;
        if (mat_place(h, &h->own_embed, "embed_tokens (the target's)", err) < 0) return -1;
    }
    if (vec_place(h, h->bq, qd, &h->t_bq, err) < 0 || vec_place(h, h->bk, kvd, &h->t_bk, err) < 0 ||
        vec_place(h, h->bv, kvd, &h->t_bv, err) < 0 || vec_place(h, h->bo, H, &h->t_bo, err) < 0 ||
        vec_place(h, h->n_input, H, &h->t_input, err) < 0 || vec_place(h, h->n_hidden, H, &h->t_hidden, err) < 0 ||
        vec_place(h, h->n_post, H, &h->t_post, err) < 0 || vec_place(h, h->n_final, H, &h->t_final, err) < 0 ||
        vec_place(h, h->inv_freq, c->head_dim / 2, &h->t_inv_freq, err) < 0)
        return -1;
    if (be->ops->download(be->ctx, NULL, NULL, 0) < 0) /* the uploads read host memory until the stream passes them */
        return specd_err_set(err, "placing the head in %s memory failed", be->name);
    LOG_INFO("eagle3: head placed in %s memory (embedding %s, lm_head %s)", be->name,
             h->embed == h->tgt.embed_placed ? "the target's" : "its own copy", whole ? "the target's" : "its own copy");
    return 0;
}

int eagle3_head_load(const char *dir, const eagle3_target *t, const eagle3_head_opts *o, eagle3_head **out,
                     specd_err *err) {
    *out = NULL;
    eagle3_head *h = calloc(1, sizeof *h);
    if (!h) return specd_err_set(err, "out of memory");
    h->tgt = *t;
    if (!t->be) {
        specd_err_set(err, "no backend to compute on");
        goto fail;
    }
    if (eagle3_config_load(dir, &h->cfg, err) < 0) goto fail;
    const eagle3_config *c = &h->cfg;
    if (c->target_hidden != t->hidden) {
        specd_err_set(err, "target_hidden_size %d does not match the target's hidden size %d", c->target_hidden, t->hidden);
        goto fail;
    }
    if (c->target_vocab != t->vocab)
        LOG_WARN("eagle3: config vocab_size %d differs from the target's vocabulary %d; the target's is used",
                 c->target_vocab, t->vocab);
    if (c->draft_vocab > t->vocab) {
        specd_err_set(err, "draft_vocab_size %d exceeds the target vocabulary %d", c->draft_vocab, t->vocab);
        goto fail;
    }
    if (st_open(dir, &h->st, err) < 0) goto fail;
    int64_t hot_n = 0;
    if (o && o->hot_vocab && read_hot(o->hot_vocab, t->vocab, &h->hot, &hot_n, err) < 0) goto fail;
    if (load_tensors(h, err) < 0) goto fail;
    int32_t n = eagle3_config_aux_layers(c, t->n_layers, o ? o->aux_ids_convention : EAGLE3_AUX_AUTO, h->n_aux,
                                         h->aux_layers, err);
    if (n < 0) goto fail;
    if (h->hot) {
        LOG_INFO("eagle3: hot vocabulary %s: the draft scores %lld of its %d ids (%lld of the map's %lld ids are "
                 "outside the draft vocabulary)", o->hot_vocab, (long long)h->lm_head.rows, c->draft_vocab,
                 (long long)(hot_n - h->lm_head.rows), (long long)hot_n);
        free(h->hot);
        h->hot = NULL;
    }
    if (o && o->q8_0) {
        bk_weight *mats[] = {&h->fc, &h->wq, &h->wk, &h->wv, &h->wo, &h->wgate, &h->wup, &h->wdown, &h->lm_head};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++)
            if (requant_q8_0(h, mats[i], err) < 0) goto fail;
    }
    h->inv_freq = head_own(h, sizeof(float) * (size_t)(c->head_dim / 2));
    if (!h->inv_freq) { specd_err_set(err, "out of memory"); goto fail; }
    eagle3_config_inv_freq(c, h->inv_freq);
    /* device tensor parallelism: this rank's shard, cut on the host views before anything is placed */
    if (o && o->tp_comm && eagle3_head_tp_shard_mirror(h, o->tp_comm, o->tp_mc, err) < 0) goto fail;
    if (alloc_kv(h, o, err) < 0 || head_place(h, o, err) < 0) goto fail;
    LOG_INFO("eagle3 head %s: %s layout, hidden %d (target %d), heads %d/%d x %d, ffn %d, rope_theta %g%s, "
             "norm_before_residual %s, aux layers {%d, %d, %d} (input convention), draft KV %d blocks x %d%s",
             dir, eagle3_layout_name(c->layout), c->hidden, c->target_hidden, c->n_heads, c->n_kv_heads, c->head_dim,
             c->ffn, (double)c->rope_theta, c->rope_theta_defaulted ? " (default)" : "",
             c->norm_before_residual ? "true" : "false", h->aux_layers[0], n > 1 ? h->aux_layers[1] : -1,
             n > 2 ? h->aux_layers[2] : -1, h->n_blocks, h->block_size, o && o->q8_0 ? ", matrices re-quantized to Q8_0" : "");
    *out = h;
    return 0;
fail:
    specd_err_wrap(err, "EAGLE-3 head %s", dir);
    eagle3_head_destroy(h);
    return -1;
}

void eagle3_head_destroy(eagle3_head *h) {
    if (!h) return;
    for (int i = 0; i < h->n_owned; i++) free(h->owned[i]);
    free(h->owned);
    backend *be = h->tgt.be;
    if (be) { /* backend memory: buf_free takes NULL */
        if (h->dev) be->ops->download(be->ctx, NULL, NULL, 0); /* nothing queued may still read what is freed */
        be->ops->buf_free(be->ctx, h->kv_k);
        be->ops->buf_free(be->ctx, h->kv_v);
        be->ops->buf_free(be->ctx, h->ws);
        bk_tensor_free(be, &h->d2t);
        for (int i = 0; i < h->n_placed; i++) be->ops->buf_free(be->ctx, h->placed[i]);
    }
    free(h->placed);
    free(h->free_ids);
    free(h->hot);
    st_close(h->st);
    free(h);
}

const eagle3_config *eagle3_head_config(const eagle3_head *h) { return &h->cfg; }
const eagle3_vocab_info *eagle3_head_vocab(const eagle3_head *h) { return &h->vocab; }
const int64_t *eagle3_head_used(const eagle3_head *h) { return h->used; }
int32_t eagle3_head_n_scored(const eagle3_head *h) {
    /* a vocabulary-split head holds 1/N of the rows; the gathered logits have them all */
    return (int32_t)h->lm_head.rows * (eagle3_tp_vocab_split(h) ? eagle3_tp_size(h) : 1);
}
int32_t eagle3_head_n_aux(const eagle3_head *h) { return h->n_aux; }
backend *eagle3_head_backend(const eagle3_head *h) { return h->tgt.be; }
const bk_tensor *eagle3_head_d2t(const eagle3_head *h) { return &h->d2t; }
int eagle3_head_aux_layers(const eagle3_head *h, int32_t *out) {
    memcpy(out, h->aux_layers, sizeof(int32_t) * (size_t)h->n_aux);
    return h->n_aux;
}

/* ------------------------------------------------------------ KV pool */

bk_kv_layer eagle3_head_kv(eagle3_head *h) {
    /* at TP > 1 the pool was sized for all KV heads; a rank uses its nkv_l of them per slot */
    bk_kv_layer kv = {h->kv_k, h->kv_v, h->block_size, h->tp ? h->nkv_l : h->cfg.n_kv_heads, h->cfg.head_dim,
                      h->n_blocks, NULL, NULL};
    return kv;
}

int32_t eagle3_kv_alloc(eagle3_head *h) { return h->n_free > 0 ? h->free_ids[--h->n_free] : -1; }

void eagle3_kv_free(eagle3_head *h, int32_t b) {
    if (b >= 0 && b < h->n_blocks && h->n_free < h->n_blocks) h->free_ids[h->n_free++] = b;
}

int32_t eagle3_kv_n_free(const eagle3_head *h) { return h->n_free; }
