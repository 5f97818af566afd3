/*
 * tp_shard.c: tensor parallelism for the Llama family: which slice of each
 * weight this rank keeps, and the collectives of the forward pass.
 *
 * Layout (Megatron-LM, Shoeybi et al. 2019; vLLM's QKV/MergedColumn/Row
 * parallel linears): with N ranks, rank r keeps
 *   q_proj      rows of its heads [r * nh/N, (r+1) * nh/N)          column
 *   k/v_proj    rows of its KV heads: [r * nkv/N, ...) when N divides nkv;
 *               when nkv divides N (fewer KV heads than ranks) the one KV
 *               head its q heads use, head r / (N / nkv), replicated on
 *               N / nkv ranks (vLLM does the same)                     column
 *   o_proj      the input columns of its heads                        row
 *   gate/up     rows [r * ffn/N, (r+1) * ffn/N)                         column
 *   down        the same input columns                                row
 *   lm_head     rows [r * V/N, (r+1) * V/N) (vocabulary-parallel; the logits
 *               of the output rows are all-gathered) when N divides V, else
 *               the whole head on every rank
 *   embedding, norms: replicated (the embedding stays a view of the mapped
 *               file, so a rank only touches the rows of the ids it embeds).
 * After o_proj and down the partial sums are all-reduced in rank order
 * (model_comm.all_reduce), so the residual stream is identical on every
 * rank, which is what EAGLE-3 reads as its aux hidden states.
 * Column slices are views (contiguous rows); row slices are copies of the
 * byte range of each row, which for block formats (Q8_0 / Q4_x, 32 values
 * per block) must start and end on a block: a TP size whose slices would
 * cut a block is refused with the reason, as is one that does not divide the
 * heads, the KV heads (either way) or the MLP width.
 * Threading: load time, one thread.
 */
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/model/model_internal.h"
#include "engine/util/log.h"


void model_slice_rows(bk_weight *w, int64_t r0, int64_t n) {
    w->data = (const uint8_t *)w->data + (size_t)r0 * w->row_bytes;
    if (w->type == BK_W_I4G32) w->scales = (const uint8_t *)w->scales + (size_t)r0 * (size_t)(w->cols / 32) * 2;
    w->rows = n;
}
#define slice_rows model_slice_rows

int model_slice_cols(model *m, const char *what, bk_weight *w, int64_t c0, int64_t n, specd_err *err) {
    const size_t off = bk_row_span(w->type, c0), len = bk_row_span(w->type, n);
    if ((c0 && !off) || !len)
        return specd_err_set(err, "tensor parallel size %d: %s cannot be split (%lld of its %lld input columns per "
                                  "rank would cut a 32-value block of its format)",
                             m->tp_size, what, (long long)n, (long long)w->cols);
    uint8_t *dst = model_own(m, len * (size_t)w->rows);
    if (!dst) return specd_err_set(err, "out of memory slicing %s", what);
    const void *old_scales = NULL;
    if (w->type == BK_W_I4G32) { /* the group scales [rows, cols / 32] bf16 follow the columns */
        old_scales = w->scales;
        const size_t sw = (size_t)(w->cols / 32) * 2, so = (size_t)(c0 / 32) * 2, sl = (size_t)(n / 32) * 2;
        uint8_t *sd = model_own(m, sl * (size_t)w->rows);
        if (!sd) return specd_err_set(err, "out of memory slicing %s", what);
        for (int64_t r = 0; r < w->rows; r++) memcpy(sd + (size_t)r * sl, (const uint8_t *)w->scales + (size_t)r * sw + so, sl);
        w->scales = sd;
    }
    for (int64_t r = 0; r < w->rows; r++)
        memcpy(dst + (size_t)r * len, (const uint8_t *)w->data + (size_t)r * w->row_bytes + off, len);
    /* the whole source was read: give its pages of the (read-only) mapping back, so that this rank's
     * resident memory is its slices (they are re-read from the file if anything touches them again).
     * Never for a converted copy on the heap (model_own), whose pages would read back as zeros. */
    bool owned = false;
    for (int i = 0; i < m->n_owned; i++) owned |= m->owned[i] == w->data;
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), a = ((uintptr_t)w->data + pg - 1) & ~(pg - 1);
    const uintptr_t e = ((uintptr_t)w->data + (size_t)w->rows * w->row_bytes) & ~(pg - 1);
    if (!owned && e > a) madvise((void *)a, e - a, MADV_DONTNEED);
    if (old_scales) { /* the int4 group scales: the same for their range */
        const uintptr_t sa = ((uintptr_t)old_scales + pg - 1) & ~(pg - 1);
        const uintptr_t se = ((uintptr_t)old_scales + (size_t)w->rows * (size_t)(w->cols / 32) * 2) & ~(pg - 1);
        if (se > sa) madvise((void *)sa, se - sa, MADV_DONTNEED);
    }
    w->data = dst;
    w->row_bytes = len;
    w->cols = n;
    return 0;
}

static int64_t weight_bytes(const bk_weight *w) { return (int64_t)w->rows * (int64_t)w->row_bytes; }

int model_tp_shard(model *m, specd_err *err) {
    const model_config *c = &m->cfg;
    const int32_t N = m->tp ? m->tp->size : 1, r = m->tp ? m->tp->rank : 0;
    m->tp_size = N;
    m->tp_rank = r;
    m->nh_l = c->n_heads;
    m->nkv_l = c->n_kv_heads;
    m->kv_h0 = 0;
    m->ffn_l = c->ffn;
    m->vocab_l = c->vocab;
    m->vocab_split = false;
    if (N < 1 || r < 0 || r >= N) return specd_err_set(err, "bad tensor-parallel rank %d of %d", r, N);
    if (N > 1 && c->arch == MODEL_ARCH_DEEPSEEK_V3) {
        if (c->n_heads % N)
            return specd_err_set(err, "tensor parallel size %d does not divide the %d attention heads", N, c->n_heads);
        m->nh_l = c->n_heads / N;
        m->vocab_split = c->vocab % N == 0;
        m->vocab_l = m->vocab_split ? c->vocab / N : c->vocab;
        m->lm_head_full = m->lm_head;
        if (m->vocab_split) model_slice_rows(&m->lm_head, (int64_t)r * m->vocab_l, m->vocab_l);
        if (dsv3_tp_slice(m, err) < 0) return -1;
        m->ffn_l = c->ffn / N;
        m->weight_bytes = weight_bytes(&m->embed) + (c->tied_embeddings ? 0 : weight_bytes(&m->lm_head)) +
                          dsv3_weight_bytes(m);
        if (m->ep)
            LOG_INFO("tensor parallel rank %d/%d: %d of %d MLA heads (latent replicated), dense MLP and shared expert "
                     "split inside, routed experts %d..%d of %d whole (expert parallel), LM head %s, %.1f MiB of "
                     "weights", r, N, m->nh_l, c->n_heads, m->ex0, m->ex0 + m->ex_n - 1, m->ex_n * N,
                     m->vocab_split ? "split by vocabulary" : "replicated", (double)m->weight_bytes / (1 << 20));
        else
            LOG_INFO("tensor parallel rank %d/%d: %d of %d MLA heads (latent replicated), MLPs and experts split "
                     "inside (1/%d of every expert), LM head %s, %.1f MiB of weights",
                     r, N, m->nh_l, c->n_heads, N, m->vocab_split ? "split by vocabulary" : "replicated",
                     (double)m->weight_bytes / (1 << 20));
        return 0;
    }
    if (N > 1) {
        if (c->n_heads % N)
            return specd_err_set(err, "tensor parallel size %d does not divide the %d attention heads", N, c->n_heads);
        if (c->n_kv_heads % N && N % c->n_kv_heads)
            return specd_err_set(err, "tensor parallel size %d and the %d KV heads: neither divides the other", N,
                                 c->n_kv_heads);
        if (c->ffn % N)
            return specd_err_set(err, "tensor parallel size %d does not divide the MLP width %d", N, c->ffn);
        m->nh_l = c->n_heads / N;
        m->nkv_l = c->n_kv_heads % N == 0 ? c->n_kv_heads / N : 1;
        m->kv_h0 = c->n_kv_heads % N == 0 ? r * m->nkv_l : r / (N / c->n_kv_heads);
        m->ffn_l = c->ffn / N;
        m->vocab_split = c->vocab % N == 0;
        m->vocab_l = m->vocab_split ? c->vocab / N : c->vocab;
        if (!m->vocab_split)
            LOG_INFO("tensor parallel: vocabulary %d is not divisible by %d: the LM head is replicated", c->vocab, N);
    }
    int64_t bytes = weight_bytes(&m->embed) + (int64_t)(2 * c->n_layers + 1) * c->hidden * 4;
    const int32_t hd = c->head_dim;
    m->lm_head_full = m->lm_head;
    const bool tied = c->tied_embeddings; /* a tied head is a view of the embedding, counted above */
    if (m->vocab_split) slice_rows(&m->lm_head, (int64_t)r * m->vocab_l, m->vocab_l);
    if (!tied) bytes += weight_bytes(&m->lm_head);
    for (int32_t l = 0; l < c->n_layers && c->arch == MODEL_ARCH_LLAMA; l++) {
        llama_layer *L = &m->layers[l];
        char what[64];
        if (N > 1) {
            slice_rows(&L->wq, (int64_t)r * m->nh_l * hd, (int64_t)m->nh_l * hd);
            slice_rows(&L->wk, (int64_t)m->kv_h0 * hd, (int64_t)m->nkv_l * hd);
            slice_rows(&L->wv, (int64_t)m->kv_h0 * hd, (int64_t)m->nkv_l * hd);
            slice_rows(&L->wgate, (int64_t)r * m->ffn_l, m->ffn_l);
            slice_rows(&L->wup, (int64_t)r * m->ffn_l, m->ffn_l);
            snprintf(what, sizeof what, "layer %d o_proj", l);
            if (model_slice_cols(m, what, &L->wo, (int64_t)r * m->nh_l * hd, (int64_t)m->nh_l * hd, err) < 0) return -1;
            snprintf(what, sizeof what, "layer %d down_proj", l);
            if (model_slice_cols(m, what, &L->wdown, (int64_t)r * m->ffn_l, m->ffn_l, err) < 0) return -1;
        }
        const bk_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->wgate, &L->wup, &L->wdown};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) bytes += weight_bytes(ws[i]);
    }
    if (c->arch == MODEL_ARCH_DEEPSEEK_V3) bytes += dsv3_weight_bytes(m);
    m->weight_bytes = bytes;
    if (N > 1)
        LOG_INFO("tensor parallel rank %d/%d: %d of %d heads, KV heads %d..%d of %d, MLP %d of %d, LM head %s, "
                 "%.1f MiB of weights",
                 r, N, m->nh_l, c->n_heads, m->kv_h0, m->kv_h0 + m->nkv_l - 1, c->n_kv_heads, m->ffn_l, c->ffn,
                 m->vocab_split ? "split by vocabulary" : "replicated", (double)bytes / (1 << 20));
    return 0;
}

int model_ep_range(model *m, int32_t E, specd_err *err) {
    const int32_t N = m->tp ? m->tp->size : 1, r = m->tp ? m->tp->rank : 0;
    m->ex0 = 0;
    m->ex_n = E;
    if (!m->ep) return 0;
    if (E <= 0)
        return specd_err_set(err, "expert parallelism needs routed experts: this model has none (n_routed_experts "
                                  "%d)", E);
    if (N < 1 || r < 0 || r >= N) return specd_err_set(err, "bad tensor-parallel rank %d of %d", r, N);
    if (E % N)
        return specd_err_set(err, "expert parallelism over %d ranks: %d does not divide the %d routed experts (each "
                                  "rank holds E/N whole experts)", N, N, E);
    m->ex_n = E / N;
    m->ex0 = r * m->ex_n;
    return 0;
}

int model_tp_all_reduce(model *m, bk_tensor *x, specd_err *err) {
    if (m->tp_size <= 1) return 0;
    return m->tp->all_reduce(m->tp->ctx, x, err);
}

void model_get_shard(const model *m, model_shard_info *o) {
    o->rank = m->tp_rank;
    o->size = m->tp_size;
    o->n_heads = m->nh_l;
    o->n_kv_heads = m->nkv_l;
    o->ffn = m->ffn_l;
    o->vocab_rows = m->vocab_l;
    o->expert_parallel = m->ep;
    o->expert0 = m->ex0;
    o->n_experts = m->ex_n;
    o->expert_width = m->ex_w;
    o->weight_bytes = m->weight_bytes;
    o->kv_bytes = model_kv_bytes_per_token(m) * m->block_size * m->n_blocks;
}
