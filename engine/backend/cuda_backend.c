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
 * call returns; weight_place and moe_place through the pinned staging ring
 * (cu_stage_copy: CU_STAGE_SLOTS slots of staging_bytes / 3, each refilled
 * only after its event says its previous copy finished, copied on a copy
 * stream that the compute stream then waits for: the host fills one slot
 * while two copies are in flight; the fill split over min(4, cores) host
 * threads); meta_upload through one pinned buffer
 * guarded by an event so a step never overwrites what the previous copy is
 * still reading. download is the only call that waits (stream sync); it
 * also reads the two flags when a launch since the last download could have
 * set them, so a bad id on the device fails the step that produced it.
 *
 * Sampling (cu_sample, bk_ops.sample). The host's row descriptions (kn_sample
 * params, histories, min_tokens suppress lists, logit_bias, uniforms, the
 * chains' drafts) are packed into one pinned staging buffer and go up in ONE
 * copy to its device mirror; kn_sample runs in chunks of CU_SAMPLE_CHUNK rows
 * over a fixed scratch (3 x [32, vocab] floats), writing the processed
 * distributions over the consumed logits when a chain samples; kn_spec_verify
 * reads them in place (row0 = each chain's first row), and a sampled draft's q
 * where the draft's draw left it (bk_verify_seq.q: device row pointers staged
 * per draft, DRAFT-vocabulary rows read through the chain's t2d map; every
 * such chain of a call shares one map); ONE download brings
 * back the ids [n_rows], the accepted counts and the chains' tokens. The
 * staging, its mirror and the scratch are carved at create when
 * opts.sample_vocab is set (counted by bk_cuda_fixed_bytes: 12 x 32 x vocab
 * bytes of scratch, ~5 MiB of staging with its 2^20 history ids), else by the
 * first step that samples. A step outgrowing the carved staging is sampled
 * in parts that fit (split between rows, never inside a chain: one upload and
 * one download per part), since the KV pool holds the rest of the arena by
 * then; uncarved staging (no sample_vocab) doubles instead, and a growth that
 * fails keeps the staging it had.
 * The stream sync of that download also retires the staging for reuse.
 *
 * Errors: every CUDA call and launcher return is checked (CU_CHECK: logs
 * "file:line: call: error" via engine/util/log.h and returns -1); a step
 * beyond the create-time bounds fails with the bound named. Never abort().
 *
 * Threading: engine thread only (one stream, no locks).
 */
#include "engine/backend/cuda_backend.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdarg.h>
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
int bk_cuda_device_count(void) { return 0; }
int bk_cuda_device(const backend *b) { (void)b; return -1; }
void *bk_cuda_stream(const backend *b) { (void)b; return NULL; }

#else

#include <cuda_runtime_api.h>

#include <unistd.h>

#include "engine/backend/threadpool.h"
#include "kernels/kn.h"
#include "kernels/kn_attn.h"
#include "kernels/kn_linear.h"
#include "kernels/kn_sample.h"
#include "kernels/kn_mla.h"
#include "kernels/kn_moe.h"

/* Checks a cuda* call on a teardown path (no error to return): a failure is
 * logged with file:line and the call, and the teardown goes on. */
#define CU_TEARDOWN(call)                                                                                   \
    do {                                                                                                    \
        int cu_rc_ = (int)(call);                                                                           \
        if (cu_rc_ != 0)                                                                                    \
            LOG_WARN("cuda backend: %s:%d: %s: %s (teardown continues)", __FILE__, __LINE__, #call,          \
                     kn_strerror(cu_rc_));                                                                  \
    } while (0)

/* Checks a cuda* / kn_* return value inside a function returning int. */
/* The reason of the last failure on this thread, for bk_ops.last_error (the engine puts it in the failed
 * requests' error and its log line; review finding F5). Ops run on the engine thread only. */
static _Thread_local char cu_last_err[384];
__attribute__((format(printf, 1, 2))) static void cu_note(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cu_last_err, sizeof cu_last_err, fmt, ap); /* truncated when longer: a reason, not data */
    va_end(ap);
}
#define CU_CHECK(call)                                                                                  \
    do {                                                                                                \
        int cu_rc_ = (int)(call);                                                                       \
        if (cu_rc_ != 0) {                                                                              \
            LOG_ERROR("cuda backend: %s:%d: %s: %s", __FILE__, __LINE__, #call, kn_strerror(cu_rc_));  \
            cu_note("%s:%d: %s: %s", __FILE__, __LINE__, #call, kn_strerror(cu_rc_));                   \
            return -1;                                                                                  \
        }                                                                                               \
    } while (0)
/* The same for a check whose failure is a caller mistake (a shape, a bound). */
#define CU_REQUIRE(cond, ...)                                 \
    do {                                                      \
        if (!(cond)) {                                        \
            LOG_ERROR("cuda backend: " __VA_ARGS__);          \
            cu_note(__VA_ARGS__);                             \
            return -1;                                        \
        }                                                     \
    } while (0)

_Static_assert((int)KN_W_F32 == (int)BK_W_F32 && (int)KN_W_BF16 == (int)BK_W_BF16 && (int)KN_W_F16 == (int)BK_W_F16 &&
                   (int)KN_W_Q8_0 == (int)BK_W_Q8_0 && (int)KN_W_Q4_0 == (int)BK_W_Q4_0 &&
                   (int)KN_W_Q4_1 == (int)BK_W_Q4_1,
               "kn_wtype and bk_wtype must agree");

_Static_assert(BK_CUDA_MAX_HEAD_DIM == KN_ATTN_MAX_HEAD_DIM, "cuda_backend.h's head_dim bound is the kernel's");
_Static_assert(BK_CUDA_MLA_MAX_KVL == KN_MLA_MAX_KVL && BK_CUDA_MAX_HEAD_DIM == KN_MLA_MAX_LATENT,
               "cuda_backend.h's MLA bounds are kn_mla's");

#define CU_ALIGN 256u

typedef struct cu_range { size_t off, size; } cu_range;

#define CU_STAGE_SLOTS 3 /* pinned staging slots: one filled by the host while two copies are in flight */

typedef struct cu_ctx {
    bk_cuda_opts o;
    cudaStream_t stream;
    char *arena;                /* device, arena_bytes */
    size_t arena_bytes, used;
    cu_range *free_list;        /* sorted by off, coalesced */
    size_t n_free, cap_free;
    cu_range *live;             /* allocations (unsorted) */
    size_t n_live, cap_live;
    /* pinned staging for weights (cu_stage_copy): CU_STAGE_SLOTS slots, each guarded by an event, copied on
     * their own stream; copy_done orders the compute stream after the last copy */
    char *stage;
    size_t stage_bytes;
    cudaEvent_t stage_ev[CU_STAGE_SLOTS];
    int stage_k;                /* the slot the next chunk goes to (rotates across calls) */
    cudaStream_t copy_stream;
    cudaEvent_t copy_done;      /* recorded on copy_stream after a cu_stage_copy's last chunk */
    cudaEvent_t compute_mark;   /* recorded on the compute stream before one: copies wait for earlier work */
    tpool *fill_pool;           /* min(4, cores) threads filling a slot in 1 MiB pieces (NULL: memcpy alone) */
    /* step metadata: device buffers, pinned host mirror, an event guarding the mirror */
    int32_t *d_pos, *d_seq, *d_bt;
    uint8_t *d_mask;
    int32_t *h_pos, *h_seq, *h_bt; /* pinned */
    uint8_t *h_mask;               /* pinned */
    int32_t bt_cap;                /* block-table entries per sequence: ceil(max_len / block_size) */
    cudaEvent_t meta_ev;
    bool meta_live;
    kn_attn_batch meta;            /* what bk_attn_meta.dev points at */
    /* metadata slots 1 .. CU_META_SLOTS - 1 (bk_graph_ops.meta_slot): more sets alive at once, for a captured
     * chain of layer calls (the draft loop); own pos / seq_of [max_tokens] (carved when first selected, at
     * capture), the block tables shared with the default set (a chain's calls have the same tables) */
    int32_t cur_slot;              /* 0: the default set */
    int32_t *d_spos[16], *d_sseq[16];
    kn_attn_batch smeta[16];
    bool slive[16];
    void *d_scratch;
    size_t scratch_bytes;
    int32_t *d_flags;              /* [2]: bad embedding id, bad gather index */
    int32_t *h_flags;              /* pinned [2] */
    bool flags_pending;            /* a flagged launch since the last download */
    /* sampling (cu_sample): grow-only, sized by the first steps that sample (then fixed) */
    char *sm_h, *sm_d;             /* pinned staging / device mirror: inputs, then outputs */
    size_t sm_cap;
    float *sm_scratch;             /* kn_sample scratch for CU_SAMPLE_CHUNK rows of sm_vocab */
    size_t sm_scratch_bytes;
    int32_t sm_vocab;
    void *dw_scratch;              /* cu_draw's kn_sample_draw scratch (grow-only, outside captures) */
    size_t dw_scratch_bytes;
    bool fixed_shape;              /* meta_upload: stride bt_cap, max_len o.max_len (graph steps) */
    int32_t fixed_len;             /* > 0: the max_len fixed_shape bakes in instead of o.max_len (a length class) */
    bool capturing;                /* between graph begin and end */
    long graph_launches;           /* replays so far (logs, tests) */
    char name[256];
    char desc[512];
    /* MoE (cu_moe): routing ids / weights and kn_moe_experts' workspace, carved at create for the
     * opts' bounds (max_tokens x moe_top_k slots; cu_moe_ws_need) */
    int32_t *moe_ids;
    float *moe_w;
    void *moe_ws;
    size_t moe_ws_bytes;
    int32_t moe_cap_rows;           /* T * k the ids / weights hold */
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
    if (c->capturing) { /* its memset would join the graph, and a later regrowth would free what the graph reads */
        LOG_ERROR("cuda backend: buf_alloc of %zu bytes inside a graph capture (allocate before capture begins)",
                  bytes);
        return NULL;
    }
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

static const char *cu_last_error(void *vctx) {
    (void)vctx;
    return cu_last_err[0] ? cu_last_err : "no reason recorded";
}

/* Host -> device through the pinned staging ring: chunk i goes to slot k = (stage_k + i) mod CU_STAGE_SLOTS,
 * which is refilled (memcpy from SRC: the weights' mapped file, whose pages the loader's readers put in the
 * page cache, or a repacked host copy) only once its previous copy has finished (its event), then copied
 * to DST on copy_stream; so the host fills one slot while the copy engine drains the others. Both streams
 * stay ordered as if the copies ran on the compute stream: the copies wait (compute_mark) for the work
 * queued before this call (DST may be arena memory a kernel still reads), and the compute stream waits
 * (copy_done) for the last copy before anything queued after it. SRC may be freed when this returns
 * (every byte is in a slot or on the device by then). */
/* One slot's memcpy in CU_FILL_PIECE pieces over the fill pool (one host thread copies ~10 GB/s; PCIe 5
 * takes ~50). */
#define CU_FILL_PIECE ((size_t)1 << 20)
typedef struct cu_fill { char *dst; const char *src; size_t n; } cu_fill;
static void cu_fill_piece(void *arg, int64_t b, int64_t e, int tid) {
    (void)tid;
    const cu_fill *f = arg;
    const size_t o = (size_t)b * CU_FILL_PIECE, end = (size_t)e * CU_FILL_PIECE < f->n ? (size_t)e * CU_FILL_PIECE : f->n;
    memcpy(f->dst + o, f->src + o, end - o);
}

static int cu_stage_copy(cu_ctx *c, char *d, const void *src, size_t bytes) {
    const size_t slot = c->stage_bytes / CU_STAGE_SLOTS;
    const char *s = src;
    CU_CHECK(cudaEventRecord(c->compute_mark, c->stream));
    CU_CHECK(cudaStreamWaitEvent(c->copy_stream, c->compute_mark, 0));
    for (size_t off = 0; off < bytes; off += slot, c->stage_k = (c->stage_k + 1) % CU_STAGE_SLOTS) {
        const int k = c->stage_k;
        const size_t n = bytes - off < slot ? bytes - off : slot;
        char *st = c->stage + (size_t)k * slot;
        CU_CHECK(cudaEventSynchronize(c->stage_ev[k]));
        if (c->fill_pool && n > CU_FILL_PIECE)
            tpool_run(c->fill_pool, cu_fill_piece, &(cu_fill){st, s + off, n}, (int64_t)((n + CU_FILL_PIECE - 1) / CU_FILL_PIECE), 1);
        else
            memcpy(st, s + off, n);
        CU_CHECK(cudaMemcpyAsync(d + off, st, n, cudaMemcpyHostToDevice, c->copy_stream));
        CU_CHECK(cudaEventRecord(c->stage_ev[k], c->copy_stream));
    }
    CU_CHECK(cudaEventRecord(c->copy_done, c->copy_stream));
    CU_CHECK(cudaStreamWaitEvent(c->stream, c->copy_done, 0));
    return 0;
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
    if (cu_stage_copy(c, d, src->data, bytes) < 0) return -1;
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
    CU_REQUIRE(!c->capturing, "meta_upload inside a graph capture (upload before capture begins)");
    const int32_t sl = c->cur_slot;
    CU_REQUIRE(sl > 0 ? !c->slive[sl] : !c->meta_live, "meta_upload: the previous step's metadata (slot %d) was not "
               "released", sl);
    CU_REQUIRE(sl == 0 || c->d_spos[sl], "meta_upload: slot %d has no buffers", sl);
    if (cu_bind(c) < 0) return -1;
    CU_REQUIRE(T > 0 && T <= c->o.max_tokens, "step of %d tokens; this backend was sized for at most %d (max tokens)",
               T, c->o.max_tokens);
    CU_REQUIRE(m->n_seqs > 0 && m->n_seqs <= c->o.max_seqs,
               "step of %d sequences; this backend was sized for at most %d", m->n_seqs, c->o.max_seqs);
    CU_CHECK(cudaEventSynchronize(c->meta_ev)); /* the previous step's copies have read the mirror */
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
        const int32_t bound = c->fixed_len > 0 && c->fixed_len < c->o.max_len ? c->fixed_len : c->o.max_len;
        CU_REQUIRE(max_len <= bound, "graph step with position %d past its graph's length class %d", max_len - 1, bound);
        max_len = bound;
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
    int32_t *d_pos = sl > 0 ? c->d_spos[sl] : c->d_pos, *d_seq = sl > 0 ? c->d_sseq[sl] : c->d_seq;
    CU_CHECK(cudaMemcpyAsync(d_pos, c->h_pos, sizeof(int32_t) * (size_t)T, cudaMemcpyHostToDevice, c->stream));
    CU_CHECK(cudaMemcpyAsync(d_seq, c->h_seq, sizeof(int32_t) * (size_t)T, cudaMemcpyHostToDevice, c->stream));
    CU_CHECK(cudaMemcpyAsync(c->d_bt, c->h_bt, sizeof(int32_t) * (size_t)m->n_seqs * (size_t)stride,
                             cudaMemcpyHostToDevice, c->stream));
    if (m->tree_mask) {
        memcpy(c->h_mask, m->tree_mask, (size_t)T * (size_t)T);
        CU_CHECK(cudaMemcpyAsync(c->d_mask, c->h_mask, (size_t)T * (size_t)T, cudaMemcpyHostToDevice, c->stream));
    }
    CU_CHECK(cudaEventRecord(c->meta_ev, c->stream));
    kn_attn_batch *kb = sl > 0 ? &c->smeta[sl] : &c->meta;
    *kb = (kn_attn_batch){.n_tokens = T,
                          .pos = d_pos,
                          .seq_of = d_seq,
                          .block_tables = c->d_bt,
                          .bt_stride = stride,
                          .n_seqs = m->n_seqs,
                          .tree_mask = m->tree_mask ? c->d_mask : NULL,
                          .max_len = max_len};
    m->dev = kb;
    if (sl > 0) c->slive[sl] = true;
    else c->meta_live = true;
    return 0;
}

static void cu_meta_release(void *vctx, bk_attn_meta *m) {
    cu_ctx *c = vctx;
    if (m->dev == &c->meta) c->meta_live = false;
    for (int i = 1; i < 16; i++)
        if (m->dev == &c->smeta[i]) c->slive[i] = false;
    m->dev = NULL;
}

/* The kernels' metadata of m (checked: uploaded by this backend, same step size). */
static const kn_attn_batch *cu_meta(cu_ctx *c, const bk_attn_meta *m, int64_t T) {
    const kn_attn_batch *kb = NULL;
    if (m && m->dev == &c->meta && c->meta_live) kb = &c->meta;
    for (int i = 1; m && !kb && i < 16; i++)
        if (m->dev == &c->smeta[i] && c->slive[i]) kb = &c->smeta[i];
    if (!kb) {
        LOG_ERROR("cuda backend: attention metadata used without meta_upload");
        return NULL;
    }
    if (T != kb->n_tokens) {
        LOG_ERROR("cuda backend: a [%lld, ...] tensor with the metadata of a %d-token step", (long long)T,
                  kb->n_tokens);
        return NULL;
    }
    return kb;
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

#define CU_SAMPLE_CHUNK 32 /* rows per kn_sample launch: the scratch is 3 planes of [32, vocab] */

/* bk_draw_param is handed to kn_sample_draw as kn_draw_params: the same layout. */
_Static_assert(sizeof(bk_draw_param) == sizeof(kn_draw_params) &&
                   offsetof(bk_draw_param, temperature) == offsetof(kn_draw_params, temperature) &&
                   offsetof(bk_draw_param, pos) == offsetof(kn_draw_params, pos) &&
                   offsetof(bk_draw_param, seed) == offsetof(kn_draw_params, seed),
               "bk_draw_param and kn_draw_params differ");

/* bk_ops.draw: kn_sample_draw on the stream in chunks of CU_SAMPLE_CHUNK rows over one scratch (no host
 * transfer; capturable once the scratch fits). The scratch (~3 x [32, V] floats) is carved at create for
 * opts.draw_vocab (counted by bk_cuda_fixed_bytes); a wider call grows it from the arena outside a capture,
 * or fails naming the arena. */
static int cu_draw(void *vctx, const bk_tensor *logits, const bk_draw_param *params, const bk_tensor *d2t,
                   bk_tensor *out, bk_tensor *q) {
    cu_ctx *c = vctx;
    CU_REQUIRE(params && logits->dtype == BK_F32 && out->dtype == BK_I32 && out->rows == logits->rows &&
                   logits->rows > 0 && logits->rows <= INT32_MAX && logits->cols > 0 && logits->cols <= INT32_MAX &&
                   (!d2t || (d2t->dtype == BK_I32 && d2t->rows * d2t->cols >= logits->cols)) &&
                   (!q || (q->dtype == BK_F32 && q->rows == logits->rows && q->cols == logits->cols)),
               "draw: logits [%lld, %lld], out [%lld], q [%lld, %lld], d2t %lld", (long long)logits->rows,
               (long long)logits->cols, (long long)out->rows, q ? (long long)q->rows : -1LL,
               q ? (long long)q->cols : -1LL, d2t ? (long long)(d2t->rows * d2t->cols) : -1LL);
    const int32_t T = (int32_t)logits->rows, V = (int32_t)logits->cols;
    const int32_t C = T < CU_SAMPLE_CHUNK ? T : CU_SAMPLE_CHUNK;
    const size_t need = kn_sample_draw_scratch_bytes(C, V);
    if (need > c->dw_scratch_bytes) {
        CU_REQUIRE(!c->capturing,
                   "draw of %d rows x %d inside a graph capture needs %zu scratch bytes, %zu held (draw that shape "
                   "once before capturing)", T, V, need, c->dw_scratch_bytes);
        if (c->dw_scratch) cu_buf_free(c, c->dw_scratch);
        c->dw_scratch_bytes = 0;
        c->dw_scratch = cu_buf_alloc(c, need);
        CU_REQUIRE(c->dw_scratch, "draw: no arena room for %zu bytes of scratch", need);
        c->dw_scratch_bytes = need;
    }
    for (int32_t r0 = 0; r0 < T; r0 += C) {
        const int32_t n = T - r0 < C ? T - r0 : C;
        CU_CHECK(kn_sample_draw(bk_f32(logits) + (size_t)r0 * V, (const kn_draw_params *)params + r0,
                                d2t ? d2t->data : NULL, 32, n, V, bk_i32(out) + r0,
                                q ? bk_f32(q) + (size_t)r0 * V : NULL, c->dw_scratch, c->dw_scratch_bytes, c->stream));
    }
    return 0;
}

/* ------------------------------------------------------------ sampling */


/* The staging carved at create when opts.sample_vocab > 0: a step of min(max_tokens, 16 max_seqs) rows,
 * max_seqs chains of up to 15 drafts, CU_SAMPLE_HIST_IDS history ids and CU_SAMPLE_LIST_IDS suppress +
 * logit_bias entries. A step needing more (long penalised histories, many logit_bias entries) is sampled
 * in parts that fit, split between rows and never inside a chain (cu_sample_split): the KV pool has the
 * rest of the arena by then, so growing would fail the whole step. Only a single row (or chain) that
 * alone outgrows the staging grows it, or fails naming the arena; a failed growth keeps the old staging. */
#define CU_SAMPLE_HIST_IDS ((size_t)1 << 20)
#define CU_SAMPLE_LIST_IDS ((size_t)1 << 16)
static size_t cu_sample_base_bytes(const bk_cuda_opts *o) {
    if (o->sample_vocab <= 0) return 0;
    const size_t rows = (size_t)(o->max_tokens < 16 * o->max_seqs ? o->max_tokens : 16 * o->max_seqs);
    const size_t ch = (size_t)o->max_seqs;
    return rows * sizeof(kn_sample_params) + 4 * CU_SAMPLE_HIST_IDS + 12 * CU_SAMPLE_LIST_IDS +
           ch * (15 * 4 + 4 + 1 + 8 + 4 + 4 + 17 * 8 + 15 * 8) + (rows + ch * 17) * 4 +
           14 * 8; /* + alignment of 14 regions */
}

/* Grows the sampling staging (pinned + device, `bytes` each; doubling unless exact) and the scratch for `vocab`. */
static int cu_sample_reserve(cu_ctx *c, size_t bytes, int32_t vocab, bool exact) {
    if (bytes > c->sm_cap) {
        size_t cap = c->sm_cap ? c->sm_cap : 4096;
        while (cap < bytes) cap *= 2;
        if (exact) cap = bytes;
        /* the new pair first: a growth that fails keeps the staging later (smaller) steps use */
        void *h = NULL;
        CU_CHECK(cudaMallocHost(&h, cap));
        char *d = cu_buf_alloc(c, cap);
        if (!d) {
            CU_CHECK(cudaFreeHost(h));
            CU_REQUIRE(false, "sample: no arena room for %zu bytes of sampling inputs", cap);
        }
        char *old_h = c->sm_h;
        cu_buf_free(c, c->sm_d);
        c->sm_h = h, c->sm_d = d, c->sm_cap = cap;
        if (old_h) CU_CHECK(cudaFreeHost(old_h));
    }
    const size_t sb = kn_sample_scratch_bytes(CU_SAMPLE_CHUNK, vocab);
    if (sb > c->sm_scratch_bytes) {
        if (c->sm_scratch) cu_buf_free(c, c->sm_scratch);
        c->sm_scratch_bytes = 0;
        c->sm_scratch = cu_buf_alloc(c, sb);
        CU_REQUIRE(c->sm_scratch, "sample: no arena room for %zu bytes of sampler scratch", sb);
        c->sm_scratch_bytes = sb;
    }
    c->sm_vocab = vocab;
    return 0;
}

static size_t cu_al8(size_t n) { return (n + 7) & ~(size_t)7; }

/* The staging layout (offsets into sm_h / sm_d), inputs then outputs. */
typedef struct cu_sample_layout {
    size_t prm, hist, supp, bias_ids, bias, draft, n_draft, greedy, seed, pos0, row0, u, q; /* inputs */
    size_t out, in_bytes, total;                                                           /* outputs */
    int32_t k_max, n_hist, n_supp, n_bias;
    bool any_q;             /* a chain with device q rows: q [nv, k_max] pointers staged */
} cu_sample_layout;

static cu_sample_layout cu_sample_plan(const bk_sample_row *rows, int32_t n, const bk_verify_seq *vs, int32_t nv) {
    cu_sample_layout L = {0};
    const int32_t *last_h = NULL;
    int32_t last_len = 0, last_np = -1;
    for (int32_t r = 0; r < n; r++) { /* histories counted as cu_sample stages them (a chain's once) */
        const int32_t nh = rows[r].n_prompt + rows[r].n_output;
        if (nh && rows[r].hist == last_h && rows[r].n_prompt == last_np) {
            if (nh > last_len) L.n_hist += nh - last_len, last_len = nh;
        } else if (nh) {
            L.n_hist += nh, last_h = rows[r].hist, last_len = nh, last_np = rows[r].n_prompt;
        }
        L.n_supp += rows[r].n_suppress;
        L.n_bias += rows[r].n_bias;
    }
    for (int32_t v = 0; v < nv; v++) {
        if (vs[v].n_draft > L.k_max) L.k_max = vs[v].n_draft;
        L.any_q |= !vs[v].greedy && vs[v].q != NULL;
    }
    const size_t V = (size_t)nv, K = (size_t)L.k_max;
    size_t o = 0;
    L.prm = o, o = cu_al8(o + (size_t)n * sizeof(kn_sample_params));
    L.hist = o, o = cu_al8(o + (size_t)L.n_hist * 4);
    L.supp = o, o = cu_al8(o + (size_t)L.n_supp * 4);
    L.bias_ids = o, o = cu_al8(o + (size_t)L.n_bias * 4);
    L.bias = o, o = cu_al8(o + (size_t)L.n_bias * 4);
    L.draft = o, o = cu_al8(o + V * K * 4);
    L.n_draft = o, o = cu_al8(o + V * 4);
    L.greedy = o, o = cu_al8(o + V);
    L.seed = o, o = cu_al8(o + V * 8);
    L.pos0 = o, o = cu_al8(o + V * 4);
    L.row0 = o, o = cu_al8(o + V * 4);
    L.u = o, o = cu_al8(o + V * (K + 2) * 8);
    L.q = o, o = cu_al8(o + (L.any_q ? V * K * 8 : 0));
    L.in_bytes = o;
    L.out = o, o = cu_al8(o + ((size_t)n + V + V * (K + 1)) * 4); /* ids [n] | n_accepted [nv] | tokens [nv, K+1] */
    L.total = o;
    return L;
}

/* A row index cutting rows [0, n) into two non-empty parts without cutting a chain, and the number of
 * chains before it (*nv_left); 0 when there is none (one chain holds every row, or the chains are not in
 * row order). */
static int32_t cu_sample_split(int32_t n, const bk_verify_seq *vs, int32_t nv, int32_t *nv_left) {
    for (int32_t v = 1; v < nv; v++)
        if (vs[v].row0 <= vs[v - 1].row0 + vs[v - 1].n_draft) return 0;
    int32_t mid = n / 2;
    for (int32_t v = 0; v < nv; v++)
        if (vs[v].row0 < mid && mid <= vs[v].row0 + vs[v].n_draft) /* inside chain v: at its start or its end */
            mid = vs[v].row0 > 0 ? vs[v].row0 : vs[v].n_draft + 1;
    if (mid <= 0 || mid >= n) return 0;
    int32_t k = 0;
    while (k < nv && vs[k].row0 < mid) k++;
    *nv_left = k;
    return mid;
}

/* kn_sample over every row (in chunks of CU_SAMPLE_CHUNK on a fixed scratch), the
 * processed distributions written over the logits when a chain samples, then
 * kn_spec_verify over the chains; ONE upload of everything the host staged and
 * ONE download of the ids and counts. */
static int cu_sample(void *vctx, const bk_tensor *logits, const bk_sample_row *rows, int32_t n_rows,
                     const bk_verify_seq *vs, int32_t n_verify, int32_t *ids, int32_t *n_accepted,
                     int32_t *out_tokens) {
    cu_ctx *c = vctx;
    const int64_t V = logits->cols;
    CU_REQUIRE(!c->capturing, "sample inside a graph capture (sample after the graph launch)");
    CU_REQUIRE(logits->dtype == BK_F32 && logits->rows >= n_rows && n_rows >= 0 && n_verify >= 0 && V > 0 &&
                   V <= INT32_MAX,
               "sample: logits [%lld, %lld] for %d rows", (long long)logits->rows, (long long)V, n_rows);
    if (n_rows == 0) return 0;
    const bk_verify_seq *vq = NULL; /* the first sampling chain with device q rows: the others share its map */
    for (int32_t v = 0; v < n_verify; v++) {
        CU_REQUIRE(vs[v].n_draft >= 0 && vs[v].n_draft <= 15 && vs[v].row0 >= 0 &&
                       vs[v].row0 + vs[v].n_draft < n_rows && (vs[v].greedy || vs[v].u),
                   "sample: verify chain %d (rows %d + %d drafts of %d, %s)", v, vs[v].row0, vs[v].n_draft, n_rows,
                   vs[v].greedy ? "greedy" : "sampling");
        if (vs[v].greedy || !vs[v].q) continue;
        CU_REQUIRE(vs[v].q_vocab > 0 && (vs[v].t2d || vs[v].q_vocab == V),
                   "sample: verify chain %d: q rows of %d columns %s a t2d map (vocabulary %lld)", v, vs[v].q_vocab,
                   vs[v].t2d ? "with" : "without", (long long)V);
        if (!vq) vq = &vs[v];
        CU_REQUIRE(vs[v].q_vocab == vq->q_vocab && vs[v].t2d == vq->t2d,
                   "sample: verify chain %d: q over another draft vocabulary (%d columns) than chain %d's (%d)", v,
                   vs[v].q_vocab, (int)(vq - vs), vq->q_vocab);
    }
    if (cu_bind(c) < 0) return -1;
    const cu_sample_layout L = cu_sample_plan(rows, n_rows, vs, n_verify);
    int32_t nvl = 0, mid = 0;
    if (L.total > c->sm_cap && c->o.sample_vocab > 0 && (mid = cu_sample_split(n_rows, vs, n_verify, &nvl)) > 0) {
        /* more than the staging carved at create holds: the rows in two parts (each one upload, one download) */
        bk_verify_seq *vr = NULL;
        if (n_verify > nvl && !(vr = malloc(sizeof *vr * (size_t)(n_verify - nvl))))
            CU_REQUIRE(false, "sample: out of host memory splitting %d rows", n_rows);
        for (int32_t v = nvl; v < n_verify; v++) vr[v - nvl] = vs[v], vr[v - nvl].row0 -= mid;
        bk_tensor lo = *logits, hi = *logits;
        lo.rows = mid;
        hi.data = (float *)logits->data + (size_t)mid * (size_t)V;
        hi.rows = logits->rows - mid;
        int rc = cu_sample(c, &lo, rows, mid, vs, nvl, ids, n_accepted, out_tokens);
        if (rc == 0)
            rc = cu_sample(c, &hi, rows + mid, n_rows - mid, vr, n_verify - nvl, ids + mid,
                           n_verify > nvl ? n_accepted + nvl : NULL,
                           n_verify > nvl ? out_tokens + (size_t)nvl * 16 : NULL);
        free(vr);
        return rc;
    }
    if (cu_sample_reserve(c, L.total, (int32_t)V, false) < 0) return -1;
    char *h = c->sm_h, *d = c->sm_d;
    kn_sample_params *P = (kn_sample_params *)(h + L.prm);
    int32_t *hist = (int32_t *)(h + L.hist), *supp = (int32_t *)(h + L.supp), *bid = (int32_t *)(h + L.bias_ids);
    float *bv = (float *)(h + L.bias);
    int32_t oh = 0, os = 0, ob = 0;
    bool any_sampling = false;
    /* a chain's rows share one history (row j = row 0's plus j drafts): staged once, extended in place */
    const int32_t *last_h = NULL;
    int32_t last_off = 0, last_len = 0, last_np = -1;
    for (int32_t r = 0; r < n_rows; r++) {
        const bk_sample_row *x = &rows[r];
        const int32_t nh = x->n_prompt + x->n_output;
        int32_t hoff = oh;
        if (nh && x->hist == last_h && x->n_prompt == last_np && oh == last_off + last_len) {
            hoff = last_off;
            if (nh > last_len) memcpy(hist + oh, x->hist + last_len, (size_t)(nh - last_len) * 4), oh += nh - last_len;
            if (nh > last_len) last_len = nh;
        } else if (nh) {
            memcpy(hist + oh, x->hist, (size_t)nh * 4);
            last_h = x->hist, last_off = oh, last_len = nh, last_np = x->n_prompt;
            oh += nh;
        }
        P[r] = (kn_sample_params){.temperature = x->temperature, .top_p = x->top_p, .top_k = x->top_k,
                                  .min_p = x->min_p, .presence_penalty = x->presence_penalty,
                                  .frequency_penalty = x->frequency_penalty,
                                  .repetition_penalty = x->repetition_penalty, .pos = 0, .seed = 0,
                                  .hist_off = hoff, .n_prompt = x->n_prompt, .n_output = x->n_output,
                                  .supp_off = os, .n_suppress = x->n_suppress, .bias_off = ob, .n_bias = x->n_bias,
                                  .forced_on = x->forced >= 0, .forced_id = x->forced >= 0 ? x->forced : 0,
                                  .use_u = 1, .u = x->u};
        if (x->n_suppress) memcpy(supp + os, x->suppress, (size_t)x->n_suppress * 4);
        if (x->n_bias) memcpy(bid + ob, x->bias_ids, (size_t)x->n_bias * 4), memcpy(bv + ob, x->bias, (size_t)x->n_bias * 4);
        os += x->n_suppress, ob += x->n_bias;
    }
    const int32_t K = L.k_max;
    for (int32_t v = 0; v < n_verify; v++) {
        int32_t *dr = (int32_t *)(h + L.draft) + (size_t)v * K;
        for (int32_t j = 0; j < K; j++) dr[j] = j < vs[v].n_draft ? vs[v].draft[j] : -1;
        ((int32_t *)(h + L.n_draft))[v] = vs[v].n_draft;
        ((uint8_t *)(h + L.greedy))[v] = vs[v].greedy ? 1 : 0;
        ((uint64_t *)(h + L.seed))[v] = 0;
        ((int32_t *)(h + L.pos0))[v] = 0;
        ((int32_t *)(h + L.row0))[v] = vs[v].row0;
        double *u = (double *)(h + L.u) + (size_t)v * (K + 2);
        for (int32_t j = 0; j < K + 2; j++) u[j] = !vs[v].greedy && j < vs[v].n_draft + 2 ? vs[v].u[j] : 0.0;
        if (L.any_q) { /* draft j's q row (a device pointer) or NULL: one-hot */
            const float **qp = (const float **)(h + L.q) + (size_t)v * K;
            for (int32_t j = 0; j < K; j++) qp[j] = !vs[v].greedy && vs[v].q && j < vs[v].n_draft ? vs[v].q[j] : NULL;
        }
        any_sampling |= !vs[v].greedy;
    }
    CU_CHECK(cudaMemcpyAsync(d, h, L.in_bytes, cudaMemcpyHostToDevice, c->stream));
    float *lg = logits->data;
    int32_t *d_ids = (int32_t *)(d + L.out);
    for (int32_t r0 = 0; r0 < n_rows; r0 += CU_SAMPLE_CHUNK) {
        const int32_t nr = n_rows - r0 < CU_SAMPLE_CHUNK ? n_rows - r0 : CU_SAMPLE_CHUNK;
        float *lr = lg + (size_t)r0 * (size_t)V;
        CU_CHECK(kn_sample(lr, (const kn_sample_params *)(d + L.prm) + r0, (const int32_t *)(d + L.hist),
                           (const int32_t *)(d + L.supp), (const int32_t *)(d + L.bias_ids),
                           (const float *)(d + L.bias), nr, (int32_t)V, d_ids + r0, any_sampling ? lr : NULL,
                           c->sm_scratch, c->sm_scratch_bytes, c->stream));
    }
    int32_t *d_acc = d_ids + n_rows, *d_tok = d_acc + n_verify;
    if (n_verify > 0)
        CU_CHECK(kn_spec_verify(any_sampling ? lg : NULL, L.any_q ? (const float *const *)(d + L.q) : NULL,
                                vq ? vq->q_vocab : 0, vq ? vq->t2d : NULL, d_ids, (const int32_t *)(d + L.draft),
                                (const int32_t *)(d + L.n_draft), (const uint8_t *)(d + L.greedy),
                                (const uint64_t *)(d + L.seed), (const int32_t *)(d + L.pos0),
                                (const int32_t *)(d + L.row0), (const double *)(d + L.u), n_verify, K, (int32_t)V,
                                d_acc, d_tok, c->stream));
    const size_t out_bytes = ((size_t)n_rows + (size_t)n_verify * (size_t)(K + 2)) * 4;
    int32_t *ho = (int32_t *)(h + L.out);
    if (cu_download(c, ho, d_ids, out_bytes) < 0) return -1;
    memcpy(ids, ho, (size_t)n_rows * 4);
    for (int32_t v = 0; v < n_verify; v++) {
        const int32_t a = ho[n_rows + v];
        CU_REQUIRE(a >= 0 && a <= vs[v].n_draft, "sample: verify chain %d: %d accepted of %d drafts", v, a,
                   vs[v].n_draft);
        n_accepted[v] = a;
        memcpy(out_tokens + (size_t)v * 16, ho + n_rows + n_verify + (size_t)v * (K + 1), (size_t)(a + 1) * 4);
    }
    return 0;
}

/* DeepSeek-V3 absorbed MLA on the bf16 latent plane (kernels/kn_mla.h; backend.h mla_*). */
static int cu_mla_cache(const cu_ctx *c, const bk_kv_layer *kv, int32_t kvl, kn_mla_cache *out) {
    CU_REQUIRE(kv->k16 && kv->k16 == kv->v16 && !kv->k && kv->n_kv_heads == 1,
               "MLA on the CUDA backend needs one bf16 latent plane (k16 == v16, one KV head; the model's "
               "latent_bf16)");
    CU_REQUIRE(kvl > 0 && kvl < kv->head_dim && kv->head_dim <= KN_MLA_MAX_LATENT && kvl <= KN_MLA_MAX_KVL,
               "MLA latent of %d = kv_lora_rank %d + rope: kn_mla takes kv_lora_rank <= %d, latent <= %d",
               kv->head_dim, kvl, KN_MLA_MAX_KVL, KN_MLA_MAX_LATENT);
    CU_REQUIRE(kv->block_size == c->o.block_size,
               "KV layer of block size %d; this backend's block tables were sized for %d", kv->block_size,
               c->o.block_size);
    *out = (kn_mla_cache){kv->k16, kv->block_size, kvl, kv->head_dim - kvl, kv->n_blocks};
    return 0;
}

static int cu_mla_latent_write(void *vctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *lat,
                               int32_t kvl) {
    cu_ctx *c = vctx;
    const kn_attn_batch *b = cu_meta(c, m, lat->rows);
    kn_mla_cache mc;
    if (!b || cu_mla_cache(c, kv, kvl, &mc) < 0) return -1;
    CU_REQUIRE(lat->cols == kv->head_dim, "mla_latent_write: lat [%lld, %lld], latent %d", (long long)lat->rows,
               (long long)lat->cols, kv->head_dim);
    CU_CHECK(kn_mla_latent_write(&mc, b, lat->data, c->stream));
    return 0;
}

static int cu_mla_attention(void *vctx, const bk_kv_layer *kv, const bk_attn_meta *m, const bk_tensor *q,
                            int32_t n_heads, int32_t kvl, float scale, bk_tensor *out) {
    cu_ctx *c = vctx;
    const kn_attn_batch *b = cu_meta(c, m, q->rows);
    kn_mla_cache mc;
    if (!b || cu_mla_cache(c, kv, kvl, &mc) < 0) return -1;
    CU_REQUIRE(q->cols == (int64_t)n_heads * kv->head_dim && out->rows == q->rows &&
                   out->cols == (int64_t)n_heads * kvl,
               "mla_attention: q [%lld, %lld], out [%lld, %lld] for %d heads of %d (kv_lora_rank %d)",
               (long long)q->rows, (long long)q->cols, (long long)out->rows, (long long)out->cols, n_heads,
               kv->head_dim, kvl);
    const size_t need = kn_mla_scratch_bytes(b->n_tokens, n_heads, b->max_len, kvl);
    CU_REQUIRE(need <= c->scratch_bytes,
               "MLA attention of %d tokens x %d heads up to %d positions (kv_lora_rank %d) needs %zu scratch bytes; "
               "sized for %zu (bk_cuda_opts.mla_kv_lora_rank %d)",
               b->n_tokens, n_heads, b->max_len, kvl, need, c->scratch_bytes, c->o.mla_kv_lora_rank);
    CU_CHECK(kn_mla_attention(&mc, b, q->data, n_heads, scale, out->data, c->d_scratch, c->scratch_bytes,
                              c->stream));
    return 0;
}

/* DeepSeek-V3 MoE (kernels/kn_moe.h; backend.h moe_*). */
static int cu_moe_place(void *vctx, int32_t E, const bk_weight *gate, const bk_weight *up, const bk_weight *down,
                        bk_moe_experts *out) {
    cu_ctx *c = vctx;
    *out = (bk_moe_experts){0};
    CU_REQUIRE(E >= 1 && gate && up && down, "moe_place: %d experts", E);
    const int64_t I = gate[0].rows, H = gate[0].cols;
    for (int32_t e = 0; e < E; e++) {
        const bk_weight *w3[3] = {&gate[e], &up[e], &down[e]};
        for (int j = 0; j < 3; j++)
            CU_REQUIRE(w3[j]->type == BK_W_I4G32 && w3[j]->scales && w3[j]->row_bytes == (size_t)w3[j]->cols / 2 &&
                           w3[j]->rows == (j < 2 ? I : H) && w3[j]->cols == (j < 2 ? H : I),
                       "moe_place: expert %d %s: [%lld, %lld] type %d row_bytes %zu; want int4 g32 [%lld, %lld] "
                       "packed rows",
                       e, j == 0 ? "gate" : j == 1 ? "up" : "down", (long long)w3[j]->rows, (long long)w3[j]->cols,
                       (int)w3[j]->type, w3[j]->row_bytes, (long long)(j < 2 ? I : H), (long long)(j < 2 ? H : I));
    }
    CU_REQUIRE(H % 32 == 0 && I % 32 == 0 && H <= INT32_MAX && I <= INT32_MAX, "moe_place: H %lld, I %lld",
               (long long)H, (long long)I);
    const size_t n13 = kn_moe_w13_words(E, (int32_t)H, (int32_t)I), c13 = kn_moe_s13_count(E, (int32_t)H, (int32_t)I);
    const size_t n2 = kn_moe_w2_words(E, (int32_t)H, (int32_t)I), c2 = kn_moe_s2_count(E, (int32_t)H, (int32_t)I);
    uint32_t *w13 = malloc(n13 * 4), *w2 = malloc(n2 * 4);
    uint16_t *s13 = malloc(c13 * 2), *s2 = malloc(c2 * 2);
    int rc = -1;
    if (!w13 || !w2 || !s13 || !s2) {
        LOG_ERROR("cuda backend: moe_place: out of host memory for %d experts", E);
        goto done;
    }
    for (int32_t e = 0; e < E; e++)
        if (kn_moe_pack_expert(E, (int32_t)H, (int32_t)I, e, gate[e].data, gate[e].scales, up[e].data, up[e].scales,
                               down[e].data, down[e].scales, w13, s13, w2, s2) < 0) {
            LOG_ERROR("cuda backend: moe_place: expert %d does not repack", e);
            goto done;
        }
    out->w13 = cu_buf_alloc(c, n13 * 4), out->s13 = cu_buf_alloc(c, c13 * 2);
    out->w2 = cu_buf_alloc(c, n2 * 4), out->s2 = cu_buf_alloc(c, c2 * 2);
    if (!out->w13 || !out->s13 || !out->w2 || !out->s2 || cu_stage_copy(c, out->w13, w13, n13 * 4) < 0 ||
        cu_stage_copy(c, out->s13, s13, c13 * 2) < 0 || cu_stage_copy(c, out->w2, w2, n2 * 4) < 0 ||
        cu_stage_copy(c, out->s2, s2, c2 * 2) < 0) {
        LOG_ERROR("cuda backend: moe_place: %zu device bytes for %d experts not available",
                  n13 * 4 + c13 * 2 + n2 * 4 + c2 * 2, E);
        cu_buf_free(c, out->w13), cu_buf_free(c, out->s13), cu_buf_free(c, out->w2), cu_buf_free(c, out->s2);
        *out = (bk_moe_experts){0};
        goto done;
    }
    out->E = E, out->H = (int32_t)H, out->I = (int32_t)I;
    rc = 0;
done:
    free(w13), free(w2), free(s13), free(s2);
    return rc;
}

static int cu_moe(void *vctx, const bk_moe_experts *ex, const bk_moe_cfg *cfg, const bk_tensor *logits,
                  const bk_tensor *bias, const bk_tensor *x, const bk_tensor *shared, bk_tensor *y) {
    cu_ctx *c = vctx;
    const int64_t T = x->rows;
    CU_REQUIRE(ex->w13 && ex->e0 >= 0 && (int64_t)ex->e0 + ex->E <= cfg->E && x->cols == ex->H && y->rows == T && y->cols == ex->H &&
                   logits->rows == T && logits->cols == cfg->E && bias->rows * bias->cols == cfg->E &&
                   (!shared || (shared->rows == T && shared->cols == ex->H)) && T >= 1 && T <= BK_CUDA_MAX_STEP_TOKENS &&
                   cfg->k >= 1 && cfg->k <= 64,
               "moe: x [%lld, %lld], logits [%lld, %lld], y [%lld, %lld] for experts %d..%d of %d [%d | %d], top %d",
               (long long)x->rows, (long long)x->cols, (long long)logits->rows, (long long)logits->cols,
               (long long)y->rows, (long long)y->cols, ex->e0, ex->e0 + ex->E - 1, cfg->E, ex->H, ex->I, cfg->k);
    const int32_t rows = (int32_t)T * cfg->k;
    const size_t ws = kn_moe_workspace_bytes((int32_t)T, cfg->k, ex->E, ex->H, ex->I);
    CU_REQUIRE(c->moe_ids, "moe: this backend was created without MoE bounds (bk_cuda_opts.moe_experts / moe_top_k "
                           "/ moe_hidden / moe_inter)");
    CU_REQUIRE(ex->E <= c->o.moe_experts && cfg->k <= c->o.moe_top_k && ex->H <= c->o.moe_hidden &&
                   ex->I <= c->o.moe_inter && T <= c->o.max_tokens && rows <= c->moe_cap_rows &&
                   ws <= c->moe_ws_bytes,
               "moe: a %lld-token step of %d experts top %d [H %d | I %d] (%zu workspace bytes) exceeds this "
               "backend's MoE bounds: %d tokens (max tokens), %d experts, top %d, H %d, I %d (bk_cuda_opts.moe_*; "
               "%zu bytes carved at create)",
               (long long)T, ex->E, cfg->k, ex->H, ex->I, ws, c->o.max_tokens, c->o.moe_experts, c->o.moe_top_k,
               c->o.moe_hidden, c->o.moe_inter, c->moe_ws_bytes);
    const kn_moe_route_cfg rc = {cfg->E, cfg->k, cfg->n_group, cfg->topk_group, cfg->norm_topk_prob,
                                 cfg->routed_scaling};
    /* expert parallel: the routing picks among all cfg->E, this rank's ex->E from ex->e0 run (kn_moe.h) */
    const kn_moe_weights kw = {ex->E, ex->H, ex->I, ex->w13, ex->s13, ex->w2, ex->s2, ex->e0, cfg->E};
    CU_CHECK(kn_moe_route(logits->data, bias->data, (int32_t)T, &rc, c->moe_ids, c->moe_w, c->stream));
    CU_CHECK(kn_moe_experts(&kw, x->data, c->moe_ids, c->moe_w, (int32_t)T, cfg->k, shared ? shared->data : NULL,
                            c->moe_ws, c->moe_ws_bytes, y->data, NULL, c->stream));
    return 0;
}

/* ------------------------------------------------------------ graphs */

/* Capture on the backend's stream in thread-local mode: only this thread's
 * unsafe calls (a synchronisation, a legacy-stream copy) invalidate it. The
 * glue's own transfers, allocations (buf_alloc's memset) and sampling refuse
 * while capturing (c->capturing), before touching the stream, so a capture
 * holds kernel launches only and a refused call leaves it valid. */
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
    CU_TEARDOWN(cudaGraphDestroy(g)); /* the executable graph keeps what it needs */
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
    if (exec) CU_TEARDOWN(cudaGraphExecDestroy((cudaGraphExec_t)exec));
}

static void cu_graph_fixed_shape(void *vctx, bool on) { ((cu_ctx *)vctx)->fixed_shape = on; }
static void cu_graph_fixed_len(void *vctx, int32_t max_len) { ((cu_ctx *)vctx)->fixed_len = max_len > 0 ? max_len : 0; }
/* Selects the metadata set meta_upload fills (0: the default); a slot's buffers are carved from the arena the
 * first time it is selected (load / capture time, never per step). -1 when they cannot be. */
static int cu_graph_meta_slot(void *vctx, int32_t slot) {
    cu_ctx *c = vctx;
    CU_REQUIRE(slot >= 0 && slot < 16, "meta_slot %d (0 .. 15)", slot);
    CU_REQUIRE(!c->capturing || c->d_spos[slot] || slot == 0, "meta_slot %d: its buffers are carved outside a capture",
               slot);
    if (slot > 0 && !c->d_spos[slot]) {
        c->d_spos[slot] = cu_buf_alloc(c, sizeof(int32_t) * (size_t)c->o.max_tokens);
        c->d_sseq[slot] = c->d_spos[slot] ? cu_buf_alloc(c, sizeof(int32_t) * (size_t)c->o.max_tokens) : NULL;
        if (!c->d_sseq[slot]) {
            cu_buf_free(c, c->d_spos[slot]);
            c->d_spos[slot] = NULL;
            CU_REQUIRE(false, "meta_slot %d: no arena room for its metadata buffers", slot);
        }
    }
    c->cur_slot = slot;
    return 0;
}

static const bk_graph_ops CUDA_GRAPH_OPS = {
    .begin = cu_graph_begin,
    .end = cu_graph_end,
    .launch = cu_graph_launch,
    .destroy = cu_graph_destroy,
    .fixed_shape = cu_graph_fixed_shape,
    .fixed_len = cu_graph_fixed_len,
    .meta_slot = cu_graph_meta_slot,
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
    .draw = cu_draw,
    .buf_alloc = cu_buf_alloc,
    .buf_free = cu_buf_free,
    .upload = cu_upload,
    .download = cu_download,
    .last_error = cu_last_error,
    .weight_place = cu_weight_place,
    .meta_upload = cu_meta_upload,
    .meta_release = cu_meta_release,
    .sample = cu_sample,
    .mla_latent_write = cu_mla_latent_write,
    .mla_attention = cu_mla_attention,
    .moe_place = cu_moe_place,
    .moe = cu_moe,
    .graph = &CUDA_GRAPH_OPS,
};

/* ------------------------------------------------------------ create / destroy */

static int32_t cu_bt_cap(const bk_cuda_opts *o) { return (o->max_len + o->block_size - 1) / o->block_size; }

static size_t cu_scratch_need(const bk_cuda_opts *o) {
    const size_t a = kn_attn_scratch_bytes(o->max_tokens, o->max_heads, o->max_len, o->max_head_dim);
    const size_t mla =
        o->mla_kv_lora_rank > 0 ? kn_mla_scratch_bytes(o->max_tokens, o->max_heads, o->max_len, o->mla_kv_lora_rank) : 0;
    return a > mla ? a : mla;
}

/* kn_moe_experts' workspace for the opts' MoE bounds (0: no MoE). */
static size_t cu_moe_ws_need(const bk_cuda_opts *o) {
    if (o->moe_experts <= 0 || o->moe_top_k <= 0 || o->moe_hidden <= 0 || o->moe_inter <= 0) return 0;
    return kn_moe_workspace_bytes(o->max_tokens, o->moe_top_k, o->moe_experts, o->moe_hidden, o->moe_inter);
}

size_t bk_cuda_fixed_bytes(const bk_cuda_opts *o) {
    if (o->block_size <= 0 || o->max_len <= 0 || o->max_tokens <= 0 || o->max_seqs <= 0) return 0;
    const size_t T = (size_t)o->max_tokens;
    const size_t sampling = o->sample_vocab > 0 ? cu_round(cu_sample_base_bytes(o)) +
                                                      cu_round(kn_sample_scratch_bytes(CU_SAMPLE_CHUNK, o->sample_vocab))
                                                : 0;
    const size_t draw = o->draw_vocab > 0 ? cu_round(kn_sample_draw_scratch_bytes(CU_SAMPLE_CHUNK, o->draw_vocab)) : 0;
    const size_t moe = cu_moe_ws_need(o) ? 2 * cu_round(T * (size_t)o->moe_top_k * 4) + cu_round(cu_moe_ws_need(o)) : 0;
    return 2 * cu_round(T * 4) + cu_round((size_t)o->max_seqs * (size_t)cu_bt_cap(o) * 4) + cu_round(T * T) +
           cu_round(cu_scratch_need(o)) + CU_ALIGN + sampling + draw + moe;
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
    const size_t ring = CU_STAGE_SLOTS * CU_ALIGN;
    c->stage_bytes = (o->staging_bytes ? o->staging_bytes : (size_t)64 << 20) / ring * ring;
    if (c->stage_bytes < ring) c->stage_bytes = ring;
    void *st = NULL;
    CREATE_CHECK(cudaMallocHost(&st, c->stage_bytes));
    c->stage = st;
    for (int i = 0; i < CU_STAGE_SLOTS; i++)
        CREATE_CHECK(cudaEventCreateWithFlags(&c->stage_ev[i], cudaEventDisableTiming));
    CREATE_CHECK(cudaStreamCreateWithFlags(&c->copy_stream, cudaStreamNonBlocking));
    CREATE_CHECK(cudaEventCreateWithFlags(&c->copy_done, cudaEventDisableTiming));
    CREATE_CHECK(cudaEventCreateWithFlags(&c->compute_mark, cudaEventDisableTiming));
    {
        const long nc = sysconf(_SC_NPROCESSORS_ONLN);
        c->fill_pool = tpool_create(nc >= 4 ? 4 : nc > 1 ? (int)nc : 1); /* NULL (no threads): memcpy alone */
    }
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
    if (cu_moe_ws_need(o)) { /* MoE routing + workspace for a max_tokens step (review finding F6) */
        c->moe_cap_rows = o->max_tokens * o->moe_top_k;
        c->moe_ws_bytes = cu_round(cu_moe_ws_need(o));
        if (!(c->moe_ids = cu_fixed(c, (size_t)c->moe_cap_rows * 4)) || !(c->moe_w = cu_fixed(c, (size_t)c->moe_cap_rows * 4)) ||
            !(c->moe_ws = cu_fixed(c, c->moe_ws_bytes)))
            return specd_err_set(err, "arena of %zu bytes cannot hold the MoE routing and workspace (%zu bytes for %d "
                                      "tokens top %d of %d experts [%d | %d])",
                                 c->arena_bytes, c->moe_ws_bytes + 2 * (size_t)c->moe_cap_rows * 4, o->max_tokens,
                                 o->moe_top_k, o->moe_experts, o->moe_hidden, o->moe_inter);
    }
    if (o->sample_vocab > 0 && cu_sample_reserve(c, cu_sample_base_bytes(o), o->sample_vocab, true) < 0)
        return specd_err_set(err, "arena of %zu bytes cannot hold the sampler's staging and scratch (%zu bytes)",
                             c->arena_bytes, bk_cuda_fixed_bytes(o));
    if (o->draw_vocab > 0) { /* the draft's draw scratch, before the KV pool takes the rest of the arena */
        const size_t need = kn_sample_draw_scratch_bytes(CU_SAMPLE_CHUNK, o->draw_vocab);
        if (!(c->dw_scratch = cu_buf_alloc(c, need)))
            return specd_err_set(err, "arena of %zu bytes cannot hold the draft's draw scratch (%zu bytes for a "
                                      "vocabulary of %d)", c->arena_bytes, need, o->draw_vocab);
        c->dw_scratch_bytes = need;
    }
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
        CU_TEARDOWN(cudaStreamDestroy(c->stream));
    }
    if (c->copy_stream) {
        CU_TEARDOWN(cudaStreamSynchronize(c->copy_stream));
        CU_TEARDOWN(cudaStreamDestroy(c->copy_stream));
    }
    if (c->copy_done) CU_TEARDOWN(cudaEventDestroy(c->copy_done));
    if (c->compute_mark) CU_TEARDOWN(cudaEventDestroy(c->compute_mark));
    for (int i = 0; i < CU_STAGE_SLOTS; i++) if (c->stage_ev[i]) CU_TEARDOWN(cudaEventDestroy(c->stage_ev[i]));
    if (c->meta_ev) CU_TEARDOWN(cudaEventDestroy(c->meta_ev));
    if (c->stage) CU_TEARDOWN(cudaFreeHost(c->stage));
    if (c->h_pos) CU_TEARDOWN(cudaFreeHost(c->h_pos));
    if (c->sm_h) CU_TEARDOWN(cudaFreeHost(c->sm_h));
    if (c->arena) CU_TEARDOWN(cudaFree(c->arena));
    tpool_destroy(c->fill_pool);
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

int bk_cuda_device_count(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
int bk_cuda_device(const backend *b) { return ((const cu_ctx *)b->ctx)->o.device; }
void *bk_cuda_stream(const backend *b) { return (void *)((const cu_ctx *)b->ctx)->stream; }

#endif /* SPECD_HAVE_CUDA */
