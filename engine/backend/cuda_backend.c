/*
 * cuda_backend.c: the CUDA backend: backend.h's ops on one CUDA stream with
 * the kernels of kernels/ (kn_linear.h: matmul, embedding, norms, RoPE,
 * element-wise; kn_attn.h: paged KV write and attention). The glue only
 * checks shapes, maps structs and orders work on the stream; the numerics
 * are the kernels' (docs/engine.md "CUDA kernels").
 *
 * Memory (the arena). One cudaMalloc of opts->arena_bytes at create; nothing
 * else is allocated on the device afterwards. The arena is managed by a
 * first-fit allocator over a sorted free list (256-byte granules, adjacent
 * free ranges coalesced on free), so the model's grow-only workspace
 * (model.c model_grow: a bigger buffer, then the old one freed) reuses
 * space instead of leaking it. At create the backend carves its own fixed
 * buffers: the step metadata (pos, seq_of [max_tokens] int32, block tables
 * [max_seqs, ceil(max_len / block_size)] int32, tree mask [max_tokens^2] u8),
 * the attention scratch (kn_attn_scratch_bytes at the opts' bounds) and two
 * int32 flags (bad embedding id, bad gather index).
 *
 * Transfers. Host -> device through cudaMemcpyAsync on the stream: upload
 * from the caller's (pageable) memory, which the runtime stages before the
 * call returns; weight_place and meta_upload through pinned staging buffers
 * (weights in two halves alternated with events; metadata in one buffer
 * guarded by an event so a step never overwrites what the previous copy is
 * still reading). download is the only call that waits (stream sync); it
 * also reads the two flags when a launch since the last download could have
 * set them, so a bad id on the device fails the step that produced it.
 *
 * Errors: every CUDA call and launcher return is checked (CU_CHECK: logs
 * "file:line: call: error" via engine/util/log.h and returns -1); a step
 * beyond the create-time bounds fails with the bound named. Never abort().
 *
 * Threading: engine thread only (one stream, no locks).
 */
#include "engine/backend/cuda_backend.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/util/log.h"

#ifndef SPECD_HAVE_CUDA

int bk_cuda_probe(int dev, char *why, size_t why_len) {
    (void)dev;
    if (why && why_len) snprintf(why, why_len, "this binary was built without CUDA (no CUDA toolkit at configure time)");
    return -1;
}
int bk_cuda_mem_info(int dev, size_t *free_bytes, size_t *total_bytes, specd_err *err) {
    (void)dev;
    *free_bytes = *total_bytes = 0;
    return specd_err_set(err, "this binary was built without CUDA");
}
size_t bk_cuda_fixed_bytes(const bk_cuda_opts *o) { (void)o; return 0; }
backend *bk_cuda_create(const bk_cuda_opts *o, specd_err *err) {
    (void)o;
    specd_err_set(err, "cuda backend: this binary was built without CUDA (no CUDA toolkit at configure time)");
    return NULL;
}
void bk_cuda_destroy(backend *b) { (void)b; }
const char *bk_cuda_describe(const backend *b) { (void)b; return "cuda (not built)"; }
size_t bk_cuda_arena_used(const backend *b) { (void)b; return 0; }

#else

#include <cuda_runtime_api.h>

#include "kernels/kn.h"
#include "kernels/kn_attn.h"
#include "kernels/kn_linear.h"

/* Checks a cuda* / kn_* return value inside a function returning int. */
#define CU_CHECK(call)                                                                                  \
    do {                                                                                                \
        int cu_rc_ = (int)(call);                                                                       \
        if (cu_rc_ != 0) {                                                                              \
            LOG_ERROR("cuda backend: %s:%d: %s: %s", __FILE__, __LINE__, #call, kn_strerror(cu_rc_));  \
            return -1;                                                                                  \
        }                                                                                               \
    } while (0)
/* The same for a check whose failure is a caller mistake (a shape, a bound). */
#define CU_REQUIRE(cond, ...)                                 \
    do {                                                      \
        if (!(cond)) {                                        \
            LOG_ERROR("cuda backend: " __VA_ARGS__);          \
            return -1;                                        \
        }                                                     \
    } while (0)

_Static_assert((int)KN_W_F32 == (int)BK_W_F32 && (int)KN_W_BF16 == (int)BK_W_BF16 && (int)KN_W_F16 == (int)BK_W_F16 &&
                   (int)KN_W_Q8_0 == (int)BK_W_Q8_0 && (int)KN_W_Q4_0 == (int)BK_W_Q4_0 &&
                   (int)KN_W_Q4_1 == (int)BK_W_Q4_1,
               "kn_wtype and bk_wtype must agree");

_Static_assert(BK_CUDA_MAX_HEAD_DIM == KN_ATTN_MAX_HEAD_DIM, "cuda_backend.h's head_dim bound is the kernel's");

#define CU_ALIGN 256u

typedef struct cu_range { size_t off, size; } cu_range;

typedef struct cu_ctx {
    bk_cuda_opts o;
    cudaStream_t stream;
    char *arena;                /* device, arena_bytes */
    size_t arena_bytes, used;
    cu_range *free_list;        /* sorted by off, coalesced */
    size_t n_free, cap_free;
    cu_range *live;             /* allocations (unsorted) */
    size_t n_live, cap_live;
    /* pinned staging for weights: two halves, each guarded by an event */
    char *stage;
    size_t stage_bytes;
    cudaEvent_t stage_ev[2];
    /* step metadata: device buffers, pinned host mirror, an event guarding the mirror */
    int32_t *d_pos, *d_seq, *d_bt;
    uint8_t *d_mask;
    int32_t *h_pos, *h_seq, *h_bt; /* pinned */
    uint8_t *h_mask;               /* pinned */
    int32_t bt_cap;                /* block-table entries per sequence: ceil(max_len / block_size) */
    cudaEvent_t meta_ev;
    bool meta_live;
    kn_attn_batch meta;            /* what bk_attn_meta.dev points at */
    void *d_scratch;
    size_t scratch_bytes;
    int32_t *d_flags;              /* [2]: bad embedding id, bad gather index */
    int32_t *h_flags;              /* pinned [2] */
    bool flags_pending;            /* a flagged launch since the last download */
    bool fixed_shape;              /* meta_upload: stride bt_cap, max_len o.max_len (graph steps) */
    bool capturing;                /* between graph begin and end */
    long graph_launches;           /* replays so far (logs, tests) */
    char name[256];
    char desc[512];
} cu_ctx;

static size_t cu_round(size_t n) { return (n + CU_ALIGN - 1) / CU_ALIGN * CU_ALIGN; }

/* The CUDA current device is per host thread: the model loads on the main
 * thread and steps on the engine thread, so the entry points each of them
 * calls first (buf_alloc / weight_place at load; upload / meta_upload per
 * step) bind the backend's device (a cheap call when already current). */
static int cu_bind(const cu_ctx *c) {
    CU_CHECK(cudaSetDevice(c->o.device));
    return 0;
}

/* ------------------------------------------------------------ arena allocator */

static int cu_list_push(cu_range **a, size_t *n, size_t *cap, size_t at, cu_range r) {
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 64;
        cu_range *p = realloc(*a, nc * sizeof *p);
        if (!p) return -1;
        *a = p;
        *cap = nc;
    }
    memmove(*a + at + 1, *a + at, (*n - at) * sizeof **a);
    (*a)[at] = r;
    (*n)++;
    return 0;
}

/* First fit; returns the offset or (size_t)-1. */
static size_t cu_arena_take(cu_ctx *c, size_t bytes) {
    const size_t need = cu_round(bytes ? bytes : 1);
    for (size_t i = 0; i < c->n_free; i++) {
        if (c->free_list[i].size < need) continue;
        const size_t off = c->free_list[i].off;
        if (cu_list_push(&c->live, &c->n_live, &c->cap_live, c->n_live, (cu_range){off, need}) < 0) return (size_t)-1;
        c->free_list[i].off += need;
        c->free_list[i].size -= need;
        if (!c->free_list[i].size) {
            memmove(c->free_list + i, c->free_list + i + 1, (c->n_free - i - 1) * sizeof *c->free_list);
            c->n_free--;
        }
        c->used += need;
        return off;
    }
    return (size_t)-1;
}

static void cu_arena_give(cu_ctx *c, size_t off) {
    size_t li = 0;
    while (li < c->n_live && c->live[li].off != off) li++;
    if (li == c->n_live) {
        LOG_ERROR("cuda backend: buf_free of %p, which is not an arena allocation", (void *)(c->arena + off));
        return;
    }
    cu_range r = c->live[li];
    c->live[li] = c->live[--c->n_live];
    c->used -= r.size;
    size_t at = 0;
    while (at < c->n_free && c->free_list[at].off < r.off) at++;
    /* merge with the previous and / or the next free range */
    bool prev = at > 0 && c->free_list[at - 1].off + c->free_list[at - 1].size == r.off;
    bool next = at < c->n_free && r.off + r.size == c->free_list[at].off;
    if (prev && next) {
        c->free_list[at - 1].size += r.size + c->free_list[at].size;
        memmove(c->free_list + at, c->free_list + at + 1, (c->n_free - at - 1) * sizeof *c->free_list);
        c->n_free--;
    } else if (prev) {
        c->free_list[at - 1].size += r.size;
    } else if (next) {
        c->free_list[at].off = r.off;
        c->free_list[at].size += r.size;
    } else if (cu_list_push(&c->free_list, &c->n_free, &c->cap_free, at, r) < 0) {
        LOG_ERROR("cuda backend: out of host memory tracking the arena (%zu bytes lost until destroy)", r.size);
    }
}

static size_t cu_free_total(const cu_ctx *c) {
    size_t s = 0;
    for (size_t i = 0; i < c->n_free; i++) s += c->free_list[i].size;
    return s;
}

static void *cu_buf_alloc(void *vctx, size_t bytes) {
    cu_ctx *c = vctx;
    if (cu_bind(c) < 0) return NULL;
    const size_t off = cu_arena_take(c, bytes);
    if (off == (size_t)-1) {
        size_t largest = 0;
        for (size_t i = 0; i < c->n_free; i++) if (c->free_list[i].size > largest) largest = c->free_list[i].size;
        LOG_ERROR("cuda backend: arena exhausted: %zu bytes requested, %zu free (largest range %zu) of %zu "
                  "(raise --gpu-memory-utilization or lower --max-num-batched-tokens / the KV budget)",
                  bytes, cu_free_total(c), largest, c->arena_bytes);
        return NULL;
    }
    void *p = c->arena + off;
    cudaError_t e = cudaMemsetAsync(p, 0, bytes ? bytes : 1, c->stream);
    if (e != cudaSuccess) {
        LOG_ERROR("cuda backend: %s:%d: cudaMemsetAsync(%zu bytes): %s", __FILE__, __LINE__, bytes, kn_strerror(e));
        cu_arena_give(c, off);
        return NULL;
    }
    return p;
}

static void cu_buf_free(void *vctx, void *p) {
    cu_ctx *c = vctx;
    if (!p) return;
    if ((char *)p < c->arena || (char *)p >= c->arena + c->arena_bytes) {
        LOG_ERROR("cuda backend: buf_free of %p, outside the arena", p);
        return;
    }
    /* kernels still queued may read it: the space is reused only by later stream work, which is ordered after them */
    cu_arena_give(c, (size_t)((char *)p - c->arena));
}

/* ------------------------------------------------------------ transfers */

static int cu_upload(void *vctx, void *dst, const void *src_host, size_t bytes) {
    cu_ctx *c = vctx;
    if (!bytes) return 0;
    CU_REQUIRE(!c->capturing, "upload inside a graph capture (upload before capture begins)");
    if (cu_bind(c) < 0) return -1;
    CU_CHECK(cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, c->stream));
    return 0;
}

/* Reads the bad-id flags set by embed / gather_rows launches since the last check (after a sync). */
static int cu_flags_check(cu_ctx *c) {
    if (!c->flags_pending) return 0;
    c->flags_pending = false;
    const int32_t bad_id = c->h_flags[0], bad_idx = c->h_flags[1];
    if (!bad_id && !bad_idx) return 0;
    CU_CHECK(cudaMemsetAsync(c->d_flags, 0, 2 * sizeof(int32_t), c->stream));
    c->h_flags[0] = c->h_flags[1] = 0;
    CU_REQUIRE(false, "%s out of range on the device (the step's results are invalid)",
               bad_id ? "a token id of an embedding lookup" : "a row index of gather_rows");
}

static int cu_download(void *vctx, void *dst_host, const void *src, size_t bytes) {
    cu_ctx *c = vctx;
    CU_REQUIRE(!c->capturing, "download inside a graph capture (download after the launch)");
    if (c->flags_pending)
        CU_CHECK(cudaMemcpyAsync(c->h_flags, c->d_flags, 2 * sizeof(int32_t), cudaMemcpyDeviceToHost, c->stream));
    if (bytes) CU_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
    return cu_flags_check(c);
}

static int cu_weight_place(void *vctx, const bk_weight *src, bk_weight *dst) {
    cu_ctx *c = vctx;
    CU_REQUIRE(src->type <= BK_W_Q4_1, "weight [%lld x %lld]: format %d has no CUDA kernel (I4G32 is CPU-only)",
               (long long)src->rows, (long long)src->cols, (int)src->type);
    CU_REQUIRE(src->data && src->rows > 0 && src->cols > 0, "weight_place: empty weight");
    if (cu_bind(c) < 0) return -1;
    const size_t bytes = (size_t)src->rows * src->row_bytes;
    char *d = cu_buf_alloc(c, bytes);
    if (!d) {
        LOG_ERROR("cuda backend: cannot place a weight [%lld x %lld] of %zu bytes", (long long)src->rows,
                  (long long)src->cols, bytes);
        return -1;
    }
    /* host -> pinned half k -> device; half k is refilled only after its previous copy finished */
    const size_t half = c->stage_bytes / 2;
    const char *s = src->data;
    int k = 0;
    for (size_t off = 0; off < bytes; off += half, k ^= 1) {
        const size_t n = bytes - off < half ? bytes - off : half;
        CU_CHECK(cudaEventSynchronize(c->stage_ev[k]));
        memcpy(c->stage + (size_t)k * half, s + off, n);
        CU_CHECK(cudaMemcpyAsync(d + off, c->stage + (size_t)k * half, n, cudaMemcpyHostToDevice, c->stream));
        CU_CHECK(cudaEventRecord(c->stage_ev[k], c->stream));
    }
    *dst = *src;
    dst->data = d;
    dst->scales = NULL;
    return 0;
}

/* Copies the step metadata to the fixed device buffers (one pinned mirror,
 * four async copies) and points m->dev at the kernels' view of it. */
static int cu_meta_upload(void *vctx, bk_attn_meta *m) {
    cu_ctx *c = vctx;
    const int32_t T = m->n_tokens, bs = c->o.block_size;
    CU_REQUIRE(!c->meta_live, "meta_upload: the previous step's metadata was not released");
    if (cu_bind(c) < 0) return -1;
    CU_REQUIRE(T > 0 && T <= c->o.max_tokens, "step of %d tokens; this backend was sized for at most %d (max tokens)",
               T, c->o.max_tokens);
    CU_REQUIRE(m->n_seqs > 0 && m->n_seqs <= c->o.max_seqs,
               "step of %d sequences; this backend was sized for at most %d", m->n_seqs, c->o.max_seqs);
    CU_CHECK(cudaEventSynchronize(c->meta_ev)); /* the previous step's copies have read the mirror */
    CU_REQUIRE(!c->capturing, "meta_upload inside a graph capture (upload before capture begins)");
    int32_t max_len = 0, stride = 1;
    for (int32_t t = 0; t < T; t++) {
        const int32_t p = m->pos[t], s = m->seq_of[t];
        CU_REQUIRE(p >= 0 && p < c->o.max_len, "token %d at position %d; this backend was sized for %d positions", t,
                   p, c->o.max_len);
        CU_REQUIRE(s >= 0 && s < m->n_seqs, "token %d of sequence %d (of %d)", t, s, m->n_seqs);
        if (p + 1 > max_len) max_len = p + 1;
        if (p / bs + 1 > stride) stride = p / bs + 1;
    }
    if (c->fixed_shape) { /* a graph step: launch parameters that do not depend on the step's positions */
        max_len = c->o.max_len;
        stride = c->bt_cap;
    }
    /* rows [n_seqs, stride]: sequence s's logical blocks 0 .. (its largest position) / block_size */
    int32_t *need = c->h_bt + (size_t)c->o.max_seqs * c->bt_cap; /* [max_seqs] host-only scratch after the table */
    for (int32_t s = 0; s < m->n_seqs; s++) need[s] = 0;
    for (int32_t t = 0; t < T; t++)
        if (m->pos[t] / bs + 1 > need[m->seq_of[t]]) need[m->seq_of[t]] = m->pos[t] / bs + 1;
    for (int32_t s = 0; s < m->n_seqs; s++) {
        int32_t *row = c->h_bt + (size_t)s * stride;
        if (need[s]) memcpy(row, m->block_tables[s], sizeof(int32_t) * (size_t)need[s]);
        for (int32_t j = need[s]; j < stride; j++) row[j] = -1; /* never read (beyond the sequence's positions) */
    }
    memcpy(c->h_pos, m->pos, sizeof(int32_t) * (size_t)T);
    memcpy(c->h_seq, m->seq_of, sizeof(int32_t) * (size_t)T);
    CU_CHECK(cudaMemcpyAsync(c->d_pos, c->h_pos, sizeof(int32_t) * (size_t)T, cudaMemcpyHostToDevice, c->stream));
    CU_CHECK(cudaMemcpyAsync(c->d_seq, c->h_seq, sizeof(int32_t) * (size_t)T, cudaMemcpyHostToDevice, c->stream));
    CU_CHECK(cudaMemcpyAsync(c->d_bt, c->h_bt, sizeof(int32_t) * (size_t)m->n_seqs * (size_t)stride,
                             cudaMemcpyHostToDevice, c->stream));
    if (m->tree_mask) {
        memcpy(c->h_mask, m->tree_mask, (size_t)T * (size_t)T);
        CU_CHECK(cudaMemcpyAsync(c->d_mask, c->h_mask, (size_t)T * (size_t)T, cudaMemcpyHostToDevice, c->stream));
    }
    CU_CHECK(cudaEventRecord(c->meta_ev, c->stream));
    c->meta = (kn_attn_batch){.n_tokens = T,
                              .pos = c->d_pos,
                              .seq_of = c->d_seq,
                              .block_tables = c->d_bt,
                              .bt_stride = stride,
                              .n_seqs = m->n_seqs,
                              .tree_mask = m->tree_mask ? c->d_mask : NULL,
                              .max_len = max_len};
    m->dev = &c->meta;
    c->meta_live = true;
    return 0;
}

static void cu_meta_release(void *vctx, bk_attn_meta *m) {
    cu_ctx *c = vctx;
    if (m->dev == &c->meta) c->meta_live = false;
    m->dev = NULL;
}

/* The kernels' metadata of m (checked: uploaded by this backend, same step size). */
static const kn_attn_batch *cu_meta(cu_ctx *c, const bk_attn_meta *m, int64_t T) {
    if (!m || m->dev != &c->meta || !c->meta_live) {
        LOG_ERROR("cuda backend: attention metadata used without meta_upload");
        return NULL;
    }
    if (T != c->meta.n_tokens) {
        LOG_ERROR("cuda backend: a [%lld, ...] tensor with the metadata of a %d-token step", (long long)T,
                  c->meta.n_tokens);
        return NULL;
    }
    return &c->meta;
}

/* ------------------------------------------------------------ ops */

static int cu_kweight(const bk_weight *w, kn_weight *kw) {
    CU_REQUIRE(w->type <= BK_W_Q4_1, "weight format %d has no CUDA kernel", (int)w->type);
    *kw = (kn_weight){(kn_wtype)w->type, w->rows, w->cols, w->data, w->row_bytes};
    return 0;
}

static int cu_matmul(void *vctx, const bk_weight *w, const bk_tensor *x, bk_tensor *y) {
    cu_ctx *c = vctx;
    kn_weight kw;
    if (cu_kweight(w, &kw) < 0) return -1;
    CU_REQUIRE(x->cols == w->cols && y->cols == w->rows && y->rows == x->rows && x->rows > 0 && x->rows <= INT32_MAX,
               "matmul: x [%lld, %lld], W [%lld, %lld], y [%lld, %lld]", (long long)x->rows, (long long)x->cols,
               (long long)w->rows, (long long)w->cols, (long long)y->rows, (long long)y->cols);
    CU_CHECK(kn_matmul(&kw, x->data, (int32_t)x->rows, y->data, c->stream));
    return 0;
}

static int cu_rmsnorm(void *vctx, const bk_tensor *x, const bk_tensor *g, float eps, bk_tensor *out) {
    cu_ctx *c = vctx;
    CU_REQUIRE(g->rows * g->cols == x->cols && out->rows == x->rows && out->cols == x->cols,
               "rmsnorm: x [%lld, %lld], g %lld values", (long long)x->rows, (long long)x->cols,
               (long long)(g->rows * g->cols));
    CU_CHECK(kn_rmsnorm(x->data, g->data, (int32_t)x->rows, (int32_t)x->cols, eps, out->data, c->stream));
    return 0;
}

static int cu_add_rmsnorm(void *vctx, bk_tensor *x, const bk_tensor *r, const bk_tensor *g, float eps,
                          bk_tensor *out) {
    cu_ctx *c = vctx;
    CU_REQUIRE(r->rows == x->rows && r->cols == x->cols && out->rows == x->rows && out->cols == x->cols &&
                   g->rows * g->cols == x->cols,
               "add_rmsnorm: x [%lld, %lld]", (long long)x->rows, (long long)x->cols);
    const int32_t T = (int32_t)x->rows, dim = (int32_t)x->cols;
    if (out->data == r->data) {
        /* the model's usual call (h = norm(x += h)); kn_add_rmsnorm refuses out == r, so the two ops
         * in sequence: backend.h defines the fused op as exactly those (same bits) */
        CU_CHECK(kn_add(x->data, r->data, (int64_t)T * dim, c->stream));
        CU_CHECK(kn_rmsnorm(x->data, g->data, T, dim, eps, out->data, c->stream));
        return 0;
    }
    CU_CHECK(kn_add_rmsnorm(x->data, r->data, g->data, T, dim, eps, out->data, c->stream));
    return 0;
}

static int cu_rope(void *vctx, bk_tensor *x, int32_t n_heads, int32_t head_dim, int32_t rot_dim,
                   const bk_attn_meta *m, const bk_tensor *inv_freq, float mscale, bool neox) {
    cu_ctx *c = vctx;
    const kn_attn_batch *b = cu_meta(c, m, x->rows);
    if (!b) return -1;
    CU_REQUIRE(x->cols == (int64_t)n_heads * head_dim && inv_freq->rows * inv_freq->cols >= rot_dim / 2,
               "rope: x [%lld, %lld] for %d heads of %d", (long long)x->rows, (long long)x->cols, n_heads, head_dim);
    CU_CHECK(kn_rope(x->data, (int32_t)x->rows, n_heads, head_dim, rot_dim, b->pos, inv_freq->data, mscale, neox,
                     c->stream));
    return 0;
}

static int cu_kv_check(const cu_ctx *c, const bk_kv_layer *kv) {
    CU_REQUIRE(kv->k && kv->v && !kv->k16 && !kv->v16,
               "KV planes in bf16 (k16 / v16) have no CUDA kernel yet: the CUDA backend keeps f32 planes");
    CU_REQUIRE(kv->block_size == c->o.block_size,
               "KV layer of block size %d; this backend's block tables were sized for %d", kv->block_size,
               c->o.block_size);
    return 0;
}

static int cu_kv_write(void *vctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *k,
                       const bk_tensor *v) {
    cu_ctx *c = vctx;
    const kn_attn_batch *b = cu_meta(c, m, k->rows);
    if (!b || cu_kv_check(c, kv) < 0) return -1;
    const int64_t row = (int64_t)kv->n_kv_heads * kv->head_dim;
    CU_REQUIRE(k->cols == row && v->cols == row && v->rows == k->rows, "kv_write: k [%lld, %lld], KV row %lld",
               (long long)k->rows, (long long)k->cols, (long long)row);
    kn_paged_kv p = {kv->k, kv->v, kv->block_size, kv->n_kv_heads, kv->head_dim, kv->n_blocks};
    CU_CHECK(kn_kv_write(&p, b, k->data, v->data, c->stream));
    return 0;
}

static int cu_attention(void *vctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *q,
                        int32_t n_heads, float scale, bk_tensor *out) {
    cu_ctx *c = vctx;
    const kn_attn_batch *b = cu_meta(c, m, q->rows);
    if (!b || cu_kv_check(c, kv) < 0) return -1;
    CU_REQUIRE(q->cols == (int64_t)n_heads * kv->head_dim && out->rows == q->rows && out->cols == q->cols,
               "attention: q [%lld, %lld] for %d heads of %d", (long long)q->rows, (long long)q->cols, n_heads,
               kv->head_dim);
    const size_t need = kn_attn_scratch_bytes(b->n_tokens, n_heads, b->max_len, kv->head_dim);
    CU_REQUIRE(need <= c->scratch_bytes,
               "attention of %d tokens x %d heads up to %d positions (head_dim %d) needs %zu scratch bytes; sized "
               "for %zu (max tokens %d, heads %d, length %d, head_dim %d)",
               b->n_tokens, n_heads, b->max_len, kv->head_dim, need, c->scratch_bytes, c->o.max_tokens,
               c->o.max_heads, c->o.max_len, c->o.max_head_dim);
    kn_paged_kv p = {kv->k, kv->v, kv->block_size, kv->n_kv_heads, kv->head_dim, kv->n_blocks};
    CU_CHECK(kn_attention(&p, b, q->data, n_heads, scale, out->data, c->d_scratch, c->scratch_bytes, c->stream));
    return 0;
}

static int cu_silu_mul(void *vctx, const bk_tensor *gate, const bk_tensor *up, bk_tensor *out) {
    cu_ctx *c = vctx;
    const int64_t n = gate->rows * gate->cols;
    CU_REQUIRE(up->rows * up->cols == n && out->rows * out->cols == n, "silu_mul: shapes differ");
    CU_CHECK(kn_silu_mul(gate->data, up->data, n, out->data, c->stream));
    return 0;
}

static int cu_add(void *vctx, bk_tensor *y, const bk_tensor *x) {
    cu_ctx *c = vctx;
    const int64_t n = y->rows * y->cols;
    CU_REQUIRE(x->rows * x->cols == n, "add: shapes differ");
    CU_CHECK(kn_add(y->data, x->data, n, c->stream));
    return 0;
}

static int cu_add_bias(void *vctx, bk_tensor *y, const bk_tensor *b) {
    cu_ctx *c = vctx;
    CU_REQUIRE(b->rows * b->cols == y->cols, "add_bias: y [%lld, %lld], bias %lld", (long long)y->rows,
               (long long)y->cols, (long long)(b->rows * b->cols));
    CU_CHECK(kn_add_bias(y->data, b->data, (int32_t)y->rows, y->cols, c->stream));
    return 0;
}

static int cu_embed(void *vctx, const bk_weight *w, const bk_tensor *ids, const int32_t *ids_host, bk_tensor *out) {
    cu_ctx *c = vctx;
    kn_weight kw;
    if (cu_kweight(w, &kw) < 0) return -1;
    CU_REQUIRE(ids->dtype == BK_I32 && out->rows == ids->rows && out->cols == w->cols,
               "embed: ids [%lld], out [%lld, %lld], W [%lld, %lld]", (long long)ids->rows, (long long)out->rows,
               (long long)out->cols, (long long)w->rows, (long long)w->cols);
    if (ids_host) /* checked here before anything is launched; otherwise on the device (flag read at download) */
        for (int64_t t = 0; t < ids->rows; t++)
            CU_REQUIRE(ids_host[t] >= 0 && ids_host[t] < w->rows, "embed: token id %d at row %lld outside [0, %lld)",
                       ids_host[t], (long long)t, (long long)w->rows);
    CU_CHECK(kn_embed(&kw, ids->data, (int32_t)ids->rows, out->data, c->d_flags, c->stream));
    c->flags_pending = true;
    return 0;
}

static int cu_copy_cols(void *vctx, bk_tensor *dst, int64_t col0, const bk_tensor *src) {
    cu_ctx *c = vctx;
    CU_REQUIRE(src->rows == dst->rows && col0 >= 0 && col0 + src->cols <= dst->cols,
               "copy_cols: src [%lld, %lld] at column %lld of dst [%lld, %lld]", (long long)src->rows,
               (long long)src->cols, (long long)col0, (long long)dst->rows, (long long)dst->cols);
    CU_CHECK(kn_copy_rows((float *)dst->data + col0, dst->cols, src->data, src->cols, (int32_t)src->rows, src->cols,
                          c->stream));
    return 0;
}

/* dst[i] = src[idx[i]] with the embedding kernel over src seen as an f32
 * weight [src->rows, src->cols] (a bit-exact row copy; a bad index on the
 * device fills its row with NaN and sets flag 1, read at the next download). */
static int cu_gather_rows(void *vctx, const bk_tensor *src, const bk_tensor *idx, bk_tensor *dst) {
    cu_ctx *c = vctx;
    CU_REQUIRE(idx->dtype == BK_I32 && dst->rows == idx->rows && dst->cols == src->cols && idx->rows > 0,
               "gather_rows: src [%lld, %lld], idx [%lld], dst [%lld, %lld]", (long long)src->rows,
               (long long)src->cols, (long long)idx->rows, (long long)dst->rows, (long long)dst->cols);
    kn_weight kw = {KN_W_F32, src->rows, src->cols, src->data, (size_t)src->cols * sizeof(float)};
    CU_CHECK(kn_embed(&kw, idx->data, (int32_t)idx->rows, dst->data, c->d_flags + 1, c->stream));
    c->flags_pending = true;
    return 0;
}

static int cu_argmax(void *vctx, const bk_tensor *logits, const bk_tensor *d2t, bk_tensor *out) {
    cu_ctx *c = vctx;
    CU_REQUIRE(logits->dtype == BK_F32 && out->dtype == BK_I32 && out->rows == logits->rows && logits->rows > 0 &&
                   logits->cols > 0 && logits->cols <= INT32_MAX && (!d2t || (d2t->dtype == BK_I32 &&
                   d2t->rows * d2t->cols >= logits->cols)),
               "argmax: logits [%lld, %lld], out [%lld], d2t %lld", (long long)logits->rows, (long long)logits->cols,
               (long long)out->rows, d2t ? (long long)(d2t->rows * d2t->cols) : -1LL);
    CU_CHECK(kn_argmax(logits->data, (int32_t)logits->rows, (int32_t)logits->cols, d2t ? d2t->data : NULL,
                       d2t ? 32 : 0, out->data, c->stream));
    return 0;
}

/* ------------------------------------------------------------ graphs */

/* Capture on the backend's stream in thread-local mode: only this thread's
 * unsafe calls (a synchronisation, a legacy-stream copy) invalidate it. The
 * glue's own transfers refuse while capturing (c->capturing), so a capture
 * holds kernel launches only. */
static int cu_graph_begin(void *vctx) {
    cu_ctx *c = vctx;
    CU_REQUIRE(!c->capturing, "graph begin: a capture is already open");
    if (cu_bind(c) < 0) return -1;
    CU_CHECK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    c->capturing = true;
    return 0;
}

static int cu_graph_end(void *vctx, void **exec) {
    cu_ctx *c = vctx;
    *exec = NULL;
    CU_REQUIRE(c->capturing, "graph end without begin");
    c->capturing = false;
    cudaGraph_t g = NULL;
    CU_CHECK(cudaStreamEndCapture(c->stream, &g));
    cudaGraphExec_t x = NULL;
    const cudaError_t e = cudaGraphInstantiate(&x, g, 0);
    cudaGraphDestroy(g); /* the executable graph keeps what it needs */
    CU_CHECK(e);
    *exec = x;
    return 0;
}

static int cu_graph_launch(void *vctx, void *exec) {
    cu_ctx *c = vctx;
    CU_REQUIRE(exec && !c->capturing, "graph launch: %s", exec ? "inside a capture" : "no graph");
    if (cu_bind(c) < 0) return -1;
    CU_CHECK(cudaGraphLaunch((cudaGraphExec_t)exec, c->stream));
    c->flags_pending = true; /* the graph may hold embedding / gather launches */
    c->graph_launches++;
    return 0;
}

static void cu_graph_destroy(void *vctx, void *exec) {
    (void)vctx;
    if (exec) cudaGraphExecDestroy((cudaGraphExec_t)exec);
}

static void cu_graph_fixed_shape(void *vctx, bool on) { ((cu_ctx *)vctx)->fixed_shape = on; }

static const bk_graph_ops CUDA_GRAPH_OPS = {
    .begin = cu_graph_begin,
    .end = cu_graph_end,
    .launch = cu_graph_launch,
    .destroy = cu_graph_destroy,
    .fixed_shape = cu_graph_fixed_shape,
};

static const bk_ops CUDA_OPS = {
    .matmul = cu_matmul,
    .rmsnorm = cu_rmsnorm,
    .add_rmsnorm = cu_add_rmsnorm,
    .rope = cu_rope,
    .kv_write = cu_kv_write,
    .attention = cu_attention,
    .silu_mul = cu_silu_mul,
    .add = cu_add,
    .add_bias = cu_add_bias,
    .embed = cu_embed,
    .copy_cols = cu_copy_cols,
    .gather_rows = cu_gather_rows,
    .argmax = cu_argmax,
    .buf_alloc = cu_buf_alloc,
    .buf_free = cu_buf_free,
    .upload = cu_upload,
    .download = cu_download,
    .weight_place = cu_weight_place,
    .meta_upload = cu_meta_upload,
    .meta_release = cu_meta_release,
    .graph = &CUDA_GRAPH_OPS,
};

/* ------------------------------------------------------------ create / destroy */

static int32_t cu_bt_cap(const bk_cuda_opts *o) { return (o->max_len + o->block_size - 1) / o->block_size; }

static size_t cu_scratch_need(const bk_cuda_opts *o) {
    return kn_attn_scratch_bytes(o->max_tokens, o->max_heads, o->max_len, o->max_head_dim);
}

size_t bk_cuda_fixed_bytes(const bk_cuda_opts *o) {
    if (o->block_size <= 0 || o->max_len <= 0 || o->max_tokens <= 0 || o->max_seqs <= 0) return 0;
    const size_t T = (size_t)o->max_tokens;
    return 2 * cu_round(T * 4) + cu_round((size_t)o->max_seqs * (size_t)cu_bt_cap(o) * 4) + cu_round(T * T) +
           cu_round(cu_scratch_need(o)) + CU_ALIGN;
}

int bk_cuda_probe(int dev, char *why, size_t why_len) { return kn_probe(dev, why, why_len); }

int bk_cuda_mem_info(int dev, size_t *free_bytes, size_t *total_bytes, specd_err *err) {
    cudaError_t e = cudaSetDevice(dev);
    if (e == cudaSuccess) e = cudaMemGetInfo(free_bytes, total_bytes);
    if (e != cudaSuccess) return specd_err_set(err, "cudaMemGetInfo on device %d: %s", dev, kn_strerror(e));
    return 0;
}

/* Carves a fixed buffer at create (no memset: contents are always written before use). */
static void *cu_fixed(cu_ctx *c, size_t bytes) {
    const size_t off = cu_arena_take(c, bytes);
    return off == (size_t)-1 ? NULL : c->arena + off;
}

static int cu_create_inner(cu_ctx *c, specd_err *err) {
    const bk_cuda_opts *o = &c->o;
    char why[256];
    if (kn_probe(o->device, why, sizeof why) != 0) return specd_err_set(err, "no usable GPU: %s", why);
    struct cudaDeviceProp prop;
    cudaError_t e;
#define CREATE_CHECK(call)                                                                                 \
    do {                                                                                                   \
        if ((e = (call)) != cudaSuccess)                                                                   \
            return specd_err_set(err, "%s:%d: %s: %s", __FILE__, __LINE__, #call, kn_strerror(e));        \
    } while (0)
    CREATE_CHECK(cudaSetDevice(o->device));
    CREATE_CHECK(cudaGetDeviceProperties(&prop, o->device));
    CREATE_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    size_t fr = 0, tot = 0;
    CREATE_CHECK(cudaMemGetInfo(&fr, &tot));
    if (o->arena_bytes > fr)
        return specd_err_set(err, "arena of %.2f GiB requested, %.2f GiB of %.2f GiB free on %s",
                             (double)o->arena_bytes / (1 << 30), (double)fr / (1 << 30), (double)tot / (1 << 30),
                             prop.name);
    c->arena_bytes = o->arena_bytes / CU_ALIGN * CU_ALIGN;
    void *a = NULL;
    CREATE_CHECK(cudaMalloc(&a, c->arena_bytes));
    c->arena = a;
    if (cu_list_push(&c->free_list, &c->n_free, &c->cap_free, 0, (cu_range){0, c->arena_bytes}) < 0)
        return specd_err_set(err, "out of memory");
    c->stage_bytes = (o->staging_bytes ? o->staging_bytes : (size_t)64 << 20) / (2 * CU_ALIGN) * (2 * CU_ALIGN);
    if (c->stage_bytes < 2 * CU_ALIGN) c->stage_bytes = 2 * CU_ALIGN;
    void *st = NULL;
    CREATE_CHECK(cudaMallocHost(&st, c->stage_bytes));
    c->stage = st;
    for (int i = 0; i < 2; i++) CREATE_CHECK(cudaEventCreateWithFlags(&c->stage_ev[i], cudaEventDisableTiming));
    CREATE_CHECK(cudaEventCreateWithFlags(&c->meta_ev, cudaEventDisableTiming));
    /* the metadata mirror: pos [T] | seq [T] | bt [max_seqs * bt_cap] + need [max_seqs] | flags [2] | mask [T * T] */
    const size_t T = (size_t)o->max_tokens, S = (size_t)o->max_seqs, bt = S * (size_t)c->bt_cap;
    void *hm = NULL;
    CREATE_CHECK(cudaMallocHost(&hm, (2 * T + bt + S + 2) * sizeof(int32_t) + T * T));
    c->h_pos = hm;
    c->h_seq = c->h_pos + T;
    c->h_bt = c->h_seq + T;
    c->h_flags = c->h_bt + bt + S;
    c->h_flags[0] = c->h_flags[1] = 0;
    c->h_mask = (uint8_t *)(c->h_flags + 2);
    c->scratch_bytes = cu_round(cu_scratch_need(o));
    if (!(c->d_pos = cu_fixed(c, T * 4)) || !(c->d_seq = cu_fixed(c, T * 4)) || !(c->d_bt = cu_fixed(c, bt * 4)) ||
        !(c->d_mask = cu_fixed(c, T * T)) || !(c->d_scratch = cu_fixed(c, c->scratch_bytes)) ||
        !(c->d_flags = cu_fixed(c, 2 * sizeof(int32_t))))
        return specd_err_set(err, "arena of %zu bytes cannot hold the backend's own %zu bytes (metadata, %zu bytes "
                                  "of attention scratch)",
                             c->arena_bytes, bk_cuda_fixed_bytes(o), c->scratch_bytes);
    CREATE_CHECK(cudaMemsetAsync(c->d_flags, 0, 2 * sizeof(int32_t), c->stream));
    CREATE_CHECK(cudaStreamSynchronize(c->stream));
#undef CREATE_CHECK
    snprintf(c->name, sizeof c->name, "%s", prop.name);
    return 0;
}

backend *bk_cuda_create(const bk_cuda_opts *o, specd_err *err) {
    if (!o || o->arena_bytes == 0 || o->max_tokens <= 0 || o->max_seqs <= 0 || o->max_len <= 0 ||
        o->block_size <= 0 || o->max_heads <= 0 || o->max_head_dim <= 0 || o->max_head_dim > KN_ATTN_MAX_HEAD_DIM) {
        specd_err_set(err, "cuda backend: bad options (arena, max tokens / seqs / len / heads, block size and "
                           "head_dim <= %d must be set)", KN_ATTN_MAX_HEAD_DIM);
        return NULL;
    }
    if ((size_t)o->max_tokens > ((size_t)1 << 15)) {
        specd_err_set(err, "cuda backend: %d tokens per step exceeds the tree-mask buffer's bound of 32768",
                      o->max_tokens);
        return NULL;
    }
    backend *b = calloc(1, sizeof *b);
    cu_ctx *c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        specd_err_set(err, "out of memory");
        return NULL;
    }
    c->o = *o;
    c->bt_cap = cu_bt_cap(o);
    b->name = "cuda";
    b->ops = &CUDA_OPS;
    b->ctx = c;
    b->host_visible = false;
    if (cu_create_inner(c, err) < 0) {
        specd_err_wrap(err, "cuda backend on device %d", o->device);
        bk_cuda_destroy(b);
        return NULL;
    }
    return b;
}

void bk_cuda_destroy(backend *b) {
    if (!b) return;
    cu_ctx *c = b->ctx;
    if (c->stream) {
        cudaError_t e = cudaStreamSynchronize(c->stream);
        if (e != cudaSuccess) LOG_WARN("cuda backend: destroy: pending work failed: %s", kn_strerror(e));
        cudaStreamDestroy(c->stream);
    }
    for (int i = 0; i < 2; i++) if (c->stage_ev[i]) cudaEventDestroy(c->stage_ev[i]);
    if (c->meta_ev) cudaEventDestroy(c->meta_ev);
    if (c->stage) cudaFreeHost(c->stage);
    if (c->h_pos) cudaFreeHost(c->h_pos);
    if (c->arena) cudaFree(c->arena);
    free(c->free_list);
    free(c->live);
    free(c);
    free(b);
}

const char *bk_cuda_describe(const backend *b) {
    cu_ctx *c = b->ctx;
    snprintf(c->desc, sizeof c->desc, "cuda (%s, device %d; arena %.2f GiB, %.2f GiB used)", c->name, c->o.device,
             (double)c->arena_bytes / (1 << 30), (double)c->used / (1 << 30));
    return c->desc;
}

size_t bk_cuda_arena_used(const backend *b) { return ((const cu_ctx *)b->ctx)->used; }

#endif /* SPECD_HAVE_CUDA */
