/*
 * cuda_fake.c: the fake CUDA runtime and kernel launchers behind
 * test_cuda_glue.c (see cuda_fake/cuda_runtime_api.h), and the glue itself
 * compiled against them (cuda_backend.c included below with every CUDA and
 * kernel name renamed fake_*).
 *
 * Each fake launcher checks that every pointer it is given is "device"
 * memory (inside a fake cudaMalloc; a host pointer counts a violation), then
 * computes with the CPU backend's op on that memory, so the glue + model
 * device path must reproduce the CPU backend bit for bit. The fake
 * kn_add_rmsnorm refuses out == r like the real one (kernels/kn_norm.cu).
 *
 * The fake kn_sample / kn_spec_verify run the HOST sampler
 * (engine/runtime/sampler.c: sampler_probs, sampler_draw, sampler_accept's
 * rule with the given uniforms) on the device memory they are handed. So a
 * test on this fake checks the plumbing of device sampling (what is staged,
 * uploaded, launched, downloaded, and how the engine consumes it), NOT the
 * sampling kernels' numerics: those are tests/kernels/test_kn_sample.c's
 * (kernels vs sampler.c on a GPU, or under tools/kn_emu).
 * Graphs: between cudaStreamBeginCapture and cudaStreamEndCapture every
 * launcher records its call (arguments by value: the pointers, the scalars,
 * the kn_weight / kn_paged_kv / kn_attn_batch structs as they were) instead
 * of running it; cudaGraphLaunch replays the list in order, each node
 * running the launcher with the recorded arguments on whatever the memory
 * holds then, which is what a GPU graph does with its kernel nodes. A copy,
 * memset or synchronisation inside a capture fails (a real capture would be
 * invalidated) and counts a violation.
 */
#include "tests/backend/cuda_fake/cuda_runtime_api.h"
#include <math.h>
#ifndef SPECD_HAVE_CUDA
#define SPECD_HAVE_CUDA 1
#endif
#include "engine/backend/cuda_backend.c"
#include "engine/runtime/sampler.h"
#include "kernels/kn_philox.h"

/* ------------------------------------------------------------ fake runtime */

typedef struct fake_alloc { char *p; size_t n; } fake_alloc;
static fake_alloc fake_allocs[64];
static int fake_n_allocs;
int fake_violations, fake_kn_add_rmsnorm_calls, fake_kn_calls;
long fake_h2d, fake_d2h, fake_syncs;
size_t fake_d2h_bytes, fake_h2d_bytes;
int fake_d2h_calls, fake_kn_sample_calls, fake_kn_spec_verify_calls, fake_kn_sample_draw_calls;
long fake_kn_spec_verify_q_rows; /* draft rows kn_spec_verify tested against a dense q (device q rows) */
long fake_host_launches, fake_graph_launches, fake_captured_launches;
int fake_graphs_alive;

/* ------------------------------------------------------------ fake graphs */

typedef enum fake_op {
    FK_MATMUL, FK_EMBED, FK_RMSNORM, FK_ADD_RMSNORM, FK_ROPE, FK_SILU_MUL, FK_ADD, FK_ADD_BIAS, FK_COPY_ROWS,
    FK_KV_WRITE, FK_ATTENTION, FK_ARGMAX, FK_MLA_WRITE, FK_MLA_ATTENTION, FK_MOE_ROUTE, FK_MOE_EXPERTS,
    FK_FOREIGN, /* a launch of another runtime (kn_emu's collective kernels: fake_capture_foreign) */
    FK_SAMPLE_DRAW,
} fake_op;
typedef struct fake_node { /* one recorded launch: the arguments by value */
    fake_op op;
    kn_weight w;
    kn_paged_kv kv;
    kn_attn_batch b;
    kn_mla_cache mc;       /* FK_MLA_* */
    kn_moe_route_cfg rc;   /* FK_MOE_ROUTE */
    kn_moe_weights mw;     /* FK_MOE_EXPERTS */
    void *p[8];
    int64_t i[6];
    float f[2];
    int (*foreign)(void *); /* FK_FOREIGN: run(p[0]) */
} fake_node;
struct fake_graph {
    fake_node *nodes;
    int n, cap;
};
static struct fake_graph *fake_cap; /* the open capture, or NULL */

/* fake_async_copies (cuda_runtime_api.h): host -> device copies from pinned memory queued in issue order;
 * fake_copies_land(upto) performs the first upto of them (-1: all) that have not landed yet. */
int fake_async_copies;
long fake_deferred_copies; /* copies that were queued (a test checks the mode was exercised) */
typedef struct fake_copy { void *dst; const void *src; size_t n; } fake_copy;
static fake_copy *fake_q;
static long fake_q_n, fake_q_cap, fake_q_done;
struct fake_event { long seq; }; /* copies issued before the event was recorded */
static void fake_copies_land(long upto) {
    if (upto < 0 || upto > fake_q_n) upto = fake_q_n;
    for (; fake_q_done < upto; fake_q_done++) memcpy(fake_q[fake_q_done].dst, fake_q[fake_q_done].src, fake_q[fake_q_done].n);
}
static struct { char *p; size_t n; } fake_pinned[64];
static int fake_n_pinned;
static int fake_is_pinned(const void *p, size_t n) {
    for (int i = 0; i < fake_n_pinned; i++)
        if ((const char *)p >= fake_pinned[i].p && (const char *)p + n <= fake_pinned[i].p + fake_pinned[i].n) return 1;
    return 0;
}
static int fake_replaying;          /* > 0 while a graph launch runs its nodes */

/* The launch prologue: inside a capture, record and return 0; else count a host launch (not during a replay). */
#define FAKE_LAUNCH(...)                                                            \
    do {                                                                            \
        if (fake_cap) return fake_record(&(fake_node){__VA_ARGS__});                \
        fake_copies_land(-1);                                                       \
        if (!fake_replaying) fake_host_launches++;                                  \
    } while (0)
static int fake_record(const fake_node *n) {
    if (fake_cap->n == fake_cap->cap) {
        int nc = fake_cap->cap ? 2 * fake_cap->cap : 256;
        fake_node *p = realloc(fake_cap->nodes, sizeof *p * (size_t)nc);
        if (!p) return cudaErrorMemoryAllocation;
        fake_cap->nodes = p;
        fake_cap->cap = nc;
    }
    fake_cap->nodes[fake_cap->n++] = *n;
    fake_captured_launches++;
    return 0;
}
/* tools/kn_emu/kn_emu_runtime.cpp's launches (the cuda_ipc collectives of run_tp.sh) while this fake captures:
 * recorded in order between the fake's own nodes and run at replay; 1 recorded, 0 not capturing, -1 no memory. */
int fake_capture_foreign(int (*run)(void *), void *arg);
long fake_foreign_host_launches(void);
static long fake_foreign_host; /* the other runtime's launches from the host (not captured, not in a replay) */
long fake_foreign_host_launches(void) { return fake_foreign_host; }
int fake_capture_foreign(int (*run)(void *), void *arg) {
    if (!fake_cap) {
        if (!fake_replaying) fake_foreign_host++;
        return 0;
    }
    return fake_record(&(fake_node){.op = FK_FOREIGN, .foreign = run, .p = {arg}}) ? -1 : 1;
}
/* A call the capture cannot hold (a copy, a memset, a wait): a violation, as a real capture would be invalidated. */
#define FAKE_NOT_IN_CAPTURE()                                                                  \
    do {                                                                                       \
        if (fake_cap) {                                                                        \
            fprintf(stderr, "FAKE: %s inside a graph capture\n", __func__);                    \
            fake_violations++;                                                                 \
            return cudaErrorStreamCaptureUnsupported;                                          \
        }                                                                                      \
    } while (0)

int fake_is_device(const void *p, size_t bytes) {
    for (int i = 0; i < fake_n_allocs; i++)
        if ((const char *)p >= fake_allocs[i].p && (const char *)p + bytes <= fake_allocs[i].p + fake_allocs[i].n) return 1;
    return 0;
}
#define DEV(p, n)                                                                          \
    do {                                                                                   \
        if ((p) && !fake_is_device((p), (n))) {                                            \
            fprintf(stderr, "FAKE: %s: %s (%p, %zu bytes) is not device memory\n", __func__, #p, (const void *)(p), \
                    (size_t)(n));                                                          \
            fake_violations++;                                                             \
            return cudaErrorInvalidValue;                                                  \
        }                                                                                  \
    } while (0)

cudaError_t cudaMalloc(void **p, size_t n) {
    if (fake_n_allocs == 64) return cudaErrorMemoryAllocation;
    *p = aligned_alloc(256, (n + 255) / 256 * 256);
    if (!*p) return cudaErrorMemoryAllocation;
    memset(*p, 0xA5, n); /* garbage, as device memory is: the glue must zero what it promises zeroed */
    fake_allocs[fake_n_allocs++] = (fake_alloc){*p, n};
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    for (int i = 0; i < fake_n_allocs; i++)
        if (fake_allocs[i].p == p) { fake_allocs[i] = fake_allocs[--fake_n_allocs]; free(p); return cudaSuccess; }
    return cudaErrorInvalidValue;
}
cudaError_t cudaMallocHost(void **p, size_t n) {
    *p = malloc(n ? n : 1);
    if (*p) memset(*p, 0xA5, n); /* garbage: nothing may rely on fresh pinned memory being zero */
    if (*p && fake_n_pinned < 64) fake_pinned[fake_n_pinned++] = (typeof(fake_pinned[0])){*p, n};
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void *p) {
    fake_copies_land(-1); /* a real cudaFreeHost waits for the copies reading it */
    for (int i = 0; i < fake_n_pinned; i++)
        if (fake_pinned[i].p == p) { fake_pinned[i] = fake_pinned[--fake_n_pinned]; break; }
    free(p);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s) {
    (void)s;
    FAKE_NOT_IN_CAPTURE();
    if (kind == cudaMemcpyHostToDevice) {
        DEV(dst, n);
        fake_h2d++, fake_h2d_bytes += n;
        if (fake_async_copies && fake_is_pinned(src, n)) { /* lands at the next ordering point */
            if (fake_q_n == fake_q_cap) {
                fake_q_cap = fake_q_cap ? 2 * fake_q_cap : 1024;
                fake_q = realloc(fake_q, sizeof *fake_q * (size_t)fake_q_cap);
                if (!fake_q) return cudaErrorMemoryAllocation;
            }
            fake_q[fake_q_n++] = (fake_copy){dst, src, n};
            fake_deferred_copies++;
            return cudaSuccess;
        }
    } else {
        DEV(src, n);
        fake_d2h++, fake_d2h_bytes += n, fake_d2h_calls++;
        fake_copies_land(-1);
    }
    memcpy(dst, src, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *dst, int v, size_t n, cudaStream_t s) {
    (void)s;
    FAKE_NOT_IN_CAPTURE();
    DEV(dst, n);
    fake_copies_land(-1);
    memset(dst, v, n);
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; FAKE_NOT_IN_CAPTURE(); fake_copies_land(-1); fake_syncs++; return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned f) {
    static uintptr_t next = 1; /* distinct handles: the glue's compute and copy streams */
    (void)f;
    if (getenv("SPECD_FAKE_ASYNC_COPIES")) fake_async_copies = 1; /* a test's environment turns the mode on */
    *s = (cudaStream_t)next++;
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) { (void)s; return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned f) {
    (void)f;
    *e = calloc(1, sizeof **e);
    return *e ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { free(e); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { (void)s; e->seq = fake_q_n; return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { FAKE_NOT_IN_CAPTURE(); fake_copies_land(e->seq); return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f) {
    (void)s, (void)f;
    FAKE_NOT_IN_CAPTURE();
    fake_copies_land(e->seq); /* the fake's later work on s runs synchronously: the copies land now */
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int dev) { return dev == 0 ? cudaSuccess : cudaErrorInvalidValue; }
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; } /* one fake device: TP ranks share it */
cudaError_t cudaMemGetInfo(size_t *f, size_t *t) { *f = (size_t)8 << 30; *t = (size_t)8 << 30; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev) {
    (void)dev;
    snprintf(p->name, sizeof p->name, "fake device (host memory, CPU backend ops)");
    return cudaSuccess;
}
int kn_probe(int dev, char *why, size_t n) {
    if (why && n) why[0] = 0;
    if (dev != 0) { snprintf(why, n, "fake: device %d requested, 1 visible", dev); return 101; }
    return 0;
}
const char *kn_strerror(int code) {
    static char b[64];
    snprintf(b, sizeof b, "fake error %d", code);
    return b;
}

/* ------------------------------------------------------------ fake launchers (CPU backend ops) */

static backend *fake_cpu(void) {
    static backend *b;
    if (!b) b = bk_cpu_create(1);
    return b;
}
#define F32(p, n) DEV((p), (size_t)(n) * 4)
static size_t kn_wbytes(const kn_weight *w) { return (size_t)w->rows * w->row_bytes; }
static bk_weight bkw(const kn_weight *w) { return (bk_weight){(bk_wtype)w->type, w->rows, w->cols, w->data, w->row_bytes, NULL}; }

int kn_matmul(const kn_weight *w, const float *x, int32_t T, float *y, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_MATMUL, .w = *w, .p = {(void *)x, y}, .i = {T});
    fake_kn_calls++;
    DEV(w->data, kn_wbytes(w)); F32(x, (size_t)T * w->cols); F32(y, (size_t)T * w->rows);
    bk_weight bw = bkw(w);
    bk_tensor xt = bk_wrap_f32((float *)x, T, w->cols), yt = bk_wrap_f32(y, T, w->rows);
    return fake_cpu()->ops->matmul(fake_cpu()->ctx, &bw, &xt, &yt) ? cudaErrorInvalidValue : 0;
}
int kn_embed(const kn_weight *w, const int32_t *tok, int32_t T, float *out, int32_t *bad, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_EMBED, .w = *w, .p = {(void *)tok, out, bad}, .i = {T});
    fake_kn_calls++;
    DEV(w->data, kn_wbytes(w)); DEV(tok, (size_t)T * 4); F32(out, (size_t)T * w->cols);
    if (bad) DEV(bad, 4);
    bk_weight bw = bkw(w);
    for (int32_t t = 0; t < T; t++) {
        if (tok[t] < 0 || tok[t] >= w->rows) {
            for (int64_t i = 0; i < w->cols; i++) out[(size_t)t * w->cols + i] = NAN;
            if (bad) *bad = 1;
            continue;
        }
        bk_weight_row_f32(&bw, tok[t], out + (size_t)t * w->cols);
    }
    return 0;
}
int kn_rmsnorm(const float *x, const float *g, int32_t T, int32_t dim, float eps, float *out, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_RMSNORM, .p = {(void *)x, (void *)g, out}, .i = {T, dim}, .f = {eps});
    fake_kn_calls++;
    F32(x, (size_t)T * dim); F32(g, dim); F32(out, (size_t)T * dim);
    bk_tensor xt = bk_wrap_f32((float *)x, T, dim), gt = bk_wrap_f32((float *)g, 1, dim), ot = bk_wrap_f32(out, T, dim);
    return fake_cpu()->ops->rmsnorm(fake_cpu()->ctx, &xt, &gt, eps, &ot);
}
int kn_add_rmsnorm(float *x, const float *r, const float *g, int32_t T, int32_t dim, float eps, float *out, void *stream) {
    FAKE_LAUNCH(.op = FK_ADD_RMSNORM, .p = {x, (void *)r, (void *)g, out}, .i = {T, dim}, .f = {eps});
    fake_kn_add_rmsnorm_calls++;
    if (r && r == out) return cudaErrorInvalidValue; /* as kernels/kn_norm.cu */
    F32(r, (size_t)T * dim);
    if (r) for (size_t i = 0; i < (size_t)T * dim; i++) x[i] += r[i];
    return kn_rmsnorm(x, g, T, dim, eps, out, stream);
}
int kn_rope(float *x, int32_t T, int32_t nh, int32_t hd, int32_t rot, const int32_t *pos, const float *invf, float ms,
            int neox, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_ROPE, .p = {x, (void *)pos, (void *)invf}, .i = {T, nh, hd, rot, neox}, .f = {ms});
    fake_kn_calls++;
    F32(x, (size_t)T * nh * hd); DEV(pos, (size_t)T * 4); F32(invf, rot / 2);
    bk_attn_meta m = {T, pos, NULL, NULL, 0, NULL, NULL};
    bk_tensor xt = bk_wrap_f32(x, T, (int64_t)nh * hd), ft = bk_wrap_f32((float *)invf, 1, rot / 2);
    return fake_cpu()->ops->rope(fake_cpu()->ctx, &xt, nh, hd, rot, &m, &ft, ms, neox != 0);
}
int kn_silu_mul(const float *g, const float *u, int64_t n, float *out, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_SILU_MUL, .p = {(void *)g, (void *)u, out}, .i = {n});
    fake_kn_calls++;
    F32(g, n); F32(u, n); F32(out, n);
    bk_tensor gt = bk_wrap_f32((float *)g, 1, n), ut = bk_wrap_f32((float *)u, 1, n), ot = bk_wrap_f32(out, 1, n);
    return fake_cpu()->ops->silu_mul(fake_cpu()->ctx, &gt, &ut, &ot);
}
int kn_add(float *y, const float *x, int64_t n, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_ADD, .p = {y, (void *)x}, .i = {n});
    fake_kn_calls++;
    F32(y, n); F32(x, n);
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
    return 0;
}
int kn_add_bias(float *y, const float *b, int32_t T, int64_t n, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_ADD_BIAS, .p = {y, (void *)b}, .i = {T, n});
    fake_kn_calls++;
    F32(y, (size_t)T * n); F32(b, n);
    for (int32_t t = 0; t < T; t++) for (int64_t i = 0; i < n; i++) y[(size_t)t * n + i] += b[i];
    return 0;
}
int kn_copy_rows(float *dst, int64_t dld, const float *src, int64_t sld, int32_t T, int64_t n, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_COPY_ROWS, .p = {dst, (void *)src}, .i = {dld, sld, T, n});
    fake_kn_calls++;
    F32(dst, (size_t)(T - 1) * dld + n); F32(src, (size_t)(T - 1) * sld + n);
    for (int32_t t = 0; t < T; t++) memcpy(dst + (size_t)t * dld, src + (size_t)t * sld, sizeof(float) * (size_t)n);
    return 0;
}
/* the metadata as the CPU backend reads it: block-table rows of bt_stride entries */
static int fake_meta(const kn_attn_batch *b, const kn_paged_kv *kv, bk_attn_meta *m, const int32_t **rows) {
    DEV(b->pos, (size_t)b->n_tokens * 4); DEV(b->seq_of, (size_t)b->n_tokens * 4);
    DEV(b->block_tables, (size_t)b->n_seqs * b->bt_stride * 4);
    if (b->tree_mask) DEV(b->tree_mask, (size_t)b->n_tokens * b->n_tokens);
    F32(kv->k, (size_t)kv->n_blocks * kv->block_size * kv->n_kv_heads * kv->head_dim);
    F32(kv->v, (size_t)kv->n_blocks * kv->block_size * kv->n_kv_heads * kv->head_dim);
    for (int32_t s = 0; s < b->n_seqs; s++) rows[s] = b->block_tables + (size_t)s * b->bt_stride;
    for (int32_t t = 0; t < b->n_tokens; t++) /* what the kernel would read must be a valid block */
        if (b->pos[t] + 1 > b->max_len || b->pos[t] / kv->block_size >= b->bt_stride ||
            rows[b->seq_of[t]][b->pos[t] / kv->block_size] < 0 ||
            rows[b->seq_of[t]][b->pos[t] / kv->block_size] >= kv->n_blocks) {
            fprintf(stderr, "FAKE: token %d: position %d, max_len %d, stride %d: bad metadata\n", t, b->pos[t],
                    b->max_len, b->bt_stride);
            fake_violations++;
            return cudaErrorInvalidValue;
        }
    *m = (bk_attn_meta){b->n_tokens, b->pos, b->seq_of, rows, b->n_seqs, b->tree_mask, NULL};
    return 0;
}
int kn_kv_write(const kn_paged_kv *kv, const kn_attn_batch *b, const float *k, const float *v, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_KV_WRITE, .kv = *kv, .b = *b, .p = {(void *)k, (void *)v});
    fake_kn_calls++;
    const int32_t *rows[256];
    bk_attn_meta m;
    const size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    F32(k, b->n_tokens * row); F32(v, b->n_tokens * row);
    if (b->n_seqs > 256 || fake_meta(b, kv, &m, rows)) return cudaErrorInvalidValue;
    bk_kv_layer l = {kv->k, kv->v, kv->block_size, kv->n_kv_heads, kv->head_dim, kv->n_blocks, NULL, NULL};
    bk_tensor kt = bk_wrap_f32((float *)k, b->n_tokens, (int64_t)row), vt = bk_wrap_f32((float *)v, b->n_tokens, (int64_t)row);
    return fake_cpu()->ops->kv_write(fake_cpu()->ctx, &l, &m, &kt, &vt);
}
size_t kn_attn_scratch_bytes(int32_t T, int32_t nh, int32_t max_len, int32_t hd) {
    size_t f = (size_t)T * nh * (size_t)((max_len + 255) / 256) * (size_t)(hd + 2) * 4;
    return (f + 255) / 256 * 256;
}
int kn_attention(const kn_paged_kv *kv, const kn_attn_batch *b, const float *q, int32_t nh, float scale, float *out,
                 void *scratch, size_t scratch_bytes, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_ATTENTION, .kv = *kv, .b = *b, .p = {(void *)q, out, scratch}, .i = {nh, (int64_t)scratch_bytes},
                .f = {scale});
    fake_kn_calls++;
    const int32_t *rows[256];
    bk_attn_meta m;
    const size_t qd = (size_t)nh * kv->head_dim;
    F32(q, b->n_tokens * qd); F32(out, b->n_tokens * qd);
    DEV(scratch, scratch_bytes);
    if (scratch_bytes < kn_attn_scratch_bytes(b->n_tokens, nh, b->max_len, kv->head_dim)) return cudaErrorInvalidValue;
    if (b->n_seqs > 256 || fake_meta(b, kv, &m, rows)) return cudaErrorInvalidValue;
    bk_kv_layer l = {kv->k, kv->v, kv->block_size, kv->n_kv_heads, kv->head_dim, kv->n_blocks, NULL, NULL};
    bk_tensor qt = bk_wrap_f32((float *)q, b->n_tokens, (int64_t)qd), ot = bk_wrap_f32(out, b->n_tokens, (int64_t)qd);
    return fake_cpu()->ops->attention(fake_cpu()->ctx, &l, &m, &qt, nh, scale, &ot);
}
int kn_argmax(const float *logits, int32_t T, int32_t V, const void *d2t, int d2t_bits, int32_t *out, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_ARGMAX, .p = {(void *)logits, (void *)d2t, out}, .i = {T, V, d2t_bits});
    fake_kn_calls++;
    F32(logits, (size_t)T * V); DEV(out, (size_t)T * 4);
    if (d2t) DEV(d2t, (size_t)V * (d2t_bits == 64 ? 8 : 4));
    if (d2t && d2t_bits != 32 && d2t_bits != 64) return cudaErrorInvalidValue;
    for (int32_t t = 0; t < T; t++) { /* the kernel's rule (kernels/kn_elementwise.cu): sampler_argmax's order */
        const float *x = logits + (size_t)t * V;
        int32_t b = 0;
        for (int32_t i = 1; i < V; i++) if (x[i] > x[b] || (isnan(x[b]) && !isnan(x[i]))) b = i;
        out[t] = !d2t ? b : d2t_bits == 32 ? b + ((const int32_t *)d2t)[b] : (int32_t)(b + ((const int64_t *)d2t)[b]);
    }
    return 0;
}

/* ------------------------------------------------------------ fake sampling (the host sampler; see the header) */

size_t kn_sample_scratch_bytes(int32_t n_rows, int32_t vocab) {
    if (n_rows <= 0 || vocab <= 0) return 0;
    return 3 * (((size_t)n_rows * (size_t)vocab * 4 + 255) / 256 * 256);
}

static sampler_work *fake_sw(int32_t V) {
    static sampler_work *w;
    static int32_t wv;
    if (w && wv != V) sampler_work_destroy(w), w = NULL;
    if (!w) w = sampler_work_create(V), wv = V;
    return w;
}

int kn_sample(const float *logits, const kn_sample_params *params, const int32_t *hist, const int32_t *suppress,
              const int32_t *bias_ids, const float *bias, int32_t n_rows, int32_t V, int32_t *out_token,
              float *out_probs, void *scratch, size_t scratch_bytes, void *stream) {
    (void)stream;
    fake_kn_calls++, fake_kn_sample_calls++;
    if (n_rows < 0 || V <= 0) return cudaErrorInvalidValue;
    if (n_rows == 0) return 0;
    if (scratch_bytes < kn_sample_scratch_bytes(n_rows, V)) return cudaErrorInvalidValue;
    F32(logits, (size_t)n_rows * V); DEV(params, (size_t)n_rows * sizeof *params); DEV(scratch, scratch_bytes);
    if (out_token) DEV(out_token, (size_t)n_rows * 4);
    if (out_probs) F32(out_probs, (size_t)n_rows * V);
    sampler_work *w = fake_sw(V);
    float *row = malloc((size_t)V * 4), *p = malloc((size_t)V * 4);
    for (int32_t r = 0; r < n_rows; r++) {
        const kn_sample_params *P = &params[r];
        if (P->n_prompt + P->n_output) DEV(hist + P->hist_off, (size_t)(P->n_prompt + P->n_output) * 4);
        if (P->n_suppress) DEV(suppress + P->supp_off, (size_t)P->n_suppress * 4);
        if (P->n_bias) {
            DEV(bias_ids + P->bias_off, (size_t)P->n_bias * 4);
            DEV(bias + P->bias_off, (size_t)P->n_bias * 4);
        }
        sampling_params sp;
        sampling_params_init(&sp);
        sp.temperature = P->temperature, sp.top_p = P->top_p, sp.top_k = P->top_k, sp.min_p = P->min_p;
        sp.presence_penalty = P->presence_penalty, sp.frequency_penalty = P->frequency_penalty;
        sp.repetition_penalty = P->repetition_penalty;
        if (P->n_bias) sp.logit_bias_ids = bias_ids + P->bias_off, sp.logit_bias = bias + P->bias_off, sp.n_logit_bias = (size_t)P->n_bias;
        int32_t forced[1] = {P->forced_id}; /* as the CPU sees it: output n_output is forced */
        int32_t *fv = NULL;
        if (P->forced_on) {
            fv = calloc((size_t)P->n_output + 1, sizeof *fv);
            fv[P->n_output] = forced[0];
            sp.forced_ids = fv, sp.n_forced_ids = (size_t)P->n_output + 1;
        }
        const int32_t *h = hist ? hist + P->hist_off : NULL;
        sampler_hist hh = {h, (size_t)P->n_prompt, h ? h + P->n_prompt : NULL, (size_t)P->n_output,
                           P->n_suppress ? suppress + P->supp_off : NULL, (size_t)P->n_suppress};
        memcpy(row, logits + (size_t)r * V, (size_t)V * 4); /* out_probs may alias logits */
        int32_t tok;
        if (sampler_is_greedy(&sp)) {
            tok = sampler_sample(w, &sp, &hh, NULL, row);
            sampler_probs(w, &sp, &hh, row, p);
        } else {
            sampler_probs(w, &sp, &hh, row, p);
            tok = sampler_draw(p, V, P->use_u ? P->u : kn_philox_uniform(P->seed, P->pos, 0));
        }
        free(fv);
        if (out_token) out_token[r] = tok;
        if (out_probs) memcpy(out_probs + (size_t)r * V, p, (size_t)V * 4);
    }
    free(row), free(p);
    return 0;
}

size_t kn_sample_draw_scratch_bytes(int32_t n_rows, int32_t vocab) {
    if (n_rows <= 0 || vocab <= 0) return 0;
    return ((size_t)n_rows * sizeof(kn_sample_params) + 255) / 256 * 256 + kn_sample_scratch_bytes(n_rows, vocab);
}

/* The host sampler with temperature only (sampler_probs, sampler_draw at kn_philox_uniform(seed, pos, 0)),
 * then d2t: what the kernel computes (kernels/kn_sample.h), independently of the CPU backend's draw op.
 * Capturable (recorded as FK_SAMPLE_DRAW). */
int kn_sample_draw(const float *logits, const kn_draw_params *params, const void *d2t, int d2t_bits, int32_t n_rows,
                   int32_t V, int32_t *out_token, float *out_probs, void *scratch, size_t scratch_bytes, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_SAMPLE_DRAW, .p = {(void *)logits, (void *)params, (void *)d2t, out_token, out_probs, scratch},
                .i = {d2t_bits, n_rows, V, (int64_t)scratch_bytes});
    fake_kn_calls++, fake_kn_sample_draw_calls++;
    if (n_rows < 0 || V <= 0) return cudaErrorInvalidValue;
    if (n_rows == 0) return 0;
    if (!out_token || scratch_bytes < kn_sample_draw_scratch_bytes(n_rows, V) || (d2t && d2t_bits != 32 && d2t_bits != 64))
        return cudaErrorInvalidValue;
    F32(logits, (size_t)n_rows * V); DEV(params, (size_t)n_rows * sizeof *params); DEV(scratch, scratch_bytes);
    DEV(out_token, (size_t)n_rows * 4);
    if (out_probs) F32(out_probs, (size_t)n_rows * V);
    if (d2t) DEV(d2t, (size_t)V * (size_t)(d2t_bits / 8));
    sampler_work *w = fake_sw(V);
    float *p = malloc((size_t)V * 4);
    if (!p) return cudaErrorMemoryAllocation;
    for (int32_t r = 0; r < n_rows; r++) {
        sampling_params sp;
        sampling_params_init(&sp);
        sp.temperature = params[r].temperature, sp.top_p = 1.0f, sp.top_k = 0, sp.min_p = 0.0f;
        sampler_hist hh = {NULL, 0, NULL, 0, NULL, 0};
        const int32_t amax = sampler_probs(w, &sp, &hh, logits + (size_t)r * V, p);
        int32_t tok = sampler_is_greedy(&sp) ? amax : sampler_draw(p, V, kn_philox_uniform(params[r].seed, params[r].pos, 0));
        if (d2t) tok += d2t_bits == 32 ? ((const int32_t *)d2t)[tok] : (int32_t)((const int64_t *)d2t)[tok];
        out_token[r] = tok;
        if (out_probs) memcpy(out_probs + (size_t)r * V, p, (size_t)V * 4);
    }
    free(p);
    return 0;
}

/* q(i) of a draft row over the draft vocabulary through t2d (kn_sample.cu q_at): 0 outside it. */
static float fake_q_at(const float *qr, const int32_t *t2d, int32_t qv, int32_t i) {
    if (!t2d) return qr[i];
    return t2d[i] >= 0 && t2d[i] < qv ? qr[t2d[i]] : 0.0f;
}
int kn_spec_verify(const float *p, const float *const *q, int32_t qv, const int32_t *t2d, const int32_t *target_tok,
                   const int32_t *draft, const int32_t *n_draft, const uint8_t *greedy, const uint64_t *seed,
                   const int32_t *pos0, const int32_t *row0, const double *u, int32_t n_seqs, int32_t k_max, int32_t V,
                   int32_t *n_accepted, int32_t *out_tokens, void *stream) {
    (void)stream;
    fake_kn_calls++, fake_kn_spec_verify_calls++;
    if (n_seqs < 0 || k_max < 0 || V <= 0) return cudaErrorInvalidValue;
    if (n_seqs == 0) return 0;
    if ((k_max > 0 && !draft) || !n_draft || !greedy || !seed || !pos0 || !n_accepted || !out_tokens) return cudaErrorInvalidValue;
    if (!p && !target_tok) return cudaErrorInvalidValue;
    if (q && (qv <= 0 || (!t2d && qv != V))) return cudaErrorInvalidValue;
    if (q) DEV(q, (size_t)n_seqs * k_max * sizeof *q);
    if (t2d) DEV(t2d, (size_t)V * 4);
    DEV(n_draft, (size_t)n_seqs * 4); DEV(greedy, (size_t)n_seqs); DEV(seed, (size_t)n_seqs * 8); DEV(pos0, (size_t)n_seqs * 4);
    DEV(n_accepted, (size_t)n_seqs * 4); DEV(out_tokens, (size_t)n_seqs * (k_max + 1) * 4);
    if (k_max) DEV(draft, (size_t)n_seqs * k_max * 4);
    if (row0) DEV(row0, (size_t)n_seqs * 4);
    if (u) DEV(u, (size_t)n_seqs * (k_max + 2) * 8);
    float *res = malloc((size_t)V * 4);
    for (int32_t s = 0; s < n_seqs; s++) {
        const int32_t nd = n_draft[s] < 0 ? 0 : n_draft[s] > k_max ? k_max : n_draft[s];
        const int32_t *d = draft + (size_t)s * k_max;
        int32_t *out = out_tokens + (size_t)s * (k_max + 1);
        const size_t r0 = row0 ? (size_t)row0[s] : (size_t)s * (k_max + 1);
        const double *us = u ? u + (size_t)s * (k_max + 2) : NULL;
        if (target_tok) DEV(target_tok + r0, (size_t)(nd + 1) * 4);
        if (p) F32(p + r0 * V, (size_t)(nd + 1) * V);
        if (greedy[s] || !p) {
            if (!target_tok) { n_accepted[s] = -1; continue; }
            const int32_t *tt = target_tok + r0;
            int32_t a = 0;
            while (a < nd && d[a] == tt[a]) out[a] = d[a], a++;
            out[a] = tt[a];
            n_accepted[s] = a;
            continue;
        }
        int32_t j = 0;
        for (; j < nd; j++) {
            const float *pj = p + (r0 + (size_t)j) * V, *qj = q ? q[(size_t)s * k_max + j] : NULL;
            if (qj) {
                F32(qj, qv);
                fake_kn_spec_verify_q_rows++;
            }
            const int32_t x = d[j];
            const double px = x >= 0 && x < V ? pj[x] : 0.0;
            const double qx = x >= 0 && x < V ? (qj ? fake_q_at(qj, t2d, qv, x) : 1.0) : 1.0;
            const double ua = us ? us[j] : kn_philox_uniform(seed[s], pos0[s] + j, 0);
            if (px > 0.0 && (qx <= 0.0 || ua * qx < px)) { out[j] = x; continue; }
            double total = 0.0;
            for (int32_t i = 0; i < V; i++) {
                const float qi = qj ? fake_q_at(qj, t2d, qv, i) : (i == x ? 1.0f : 0.0f), df = pj[i] - qi;
                res[i] = df > 0.0f ? df : 0.0f;
                total += res[i];
            }
            const double u2 = us ? us[j + 1] : kn_philox_uniform(seed[s], pos0[s] + j, 1);
            out[j] = total > 0.0 ? sampler_draw(res, V, u2) : sampler_draw(pj, V, u2);
            break;
        }
        if (j == nd) out[nd] = sampler_draw(p + (r0 + (size_t)nd) * V, V, us ? us[nd] : kn_philox_uniform(seed[s], pos0[s] + nd, 0));
        n_accepted[s] = j;
    }
    free(res);
    return 0;
}

/* MLA (kernels/kn_mla.h) as the CPU backend's mla ops on the bf16 latent plane: the fake checks the
 * plumbing (device pointers, metadata, scratch size), not kn_mla's arithmetic (tests/kernels/test_kn_mla.c
 * on a GPU and tools/kn_emu do that). */
static int fake_mla_meta(const kn_mla_cache *c, const kn_attn_batch *b, bk_attn_meta *m, const int32_t **rows,
                         bk_kv_layer *l) {
    const int32_t D = c->kv_lora_rank + c->rope_dim;
    DEV(c->lat, (size_t)c->n_blocks * c->block_size * D * 2);
    if (b->n_seqs > 256) return cudaErrorInvalidValue;
    const kn_paged_kv kv = {NULL, NULL, c->block_size, 1, D, c->n_blocks}; /* the metadata rules only */
    if (fake_meta(b, &kv, m, rows)) return cudaErrorInvalidValue;
    *l = (bk_kv_layer){NULL, NULL, c->block_size, 1, D, c->n_blocks, c->lat, c->lat};
    return 0;
}
int kn_mla_latent_write(const kn_mla_cache *c, const kn_attn_batch *b, const float *lat, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_MLA_WRITE, .mc = *c, .b = *b, .p = {(void *)lat});
    fake_kn_calls++;
    const int32_t *rows[256];
    bk_attn_meta m;
    bk_kv_layer l;
    F32(lat, (size_t)b->n_tokens * (c->kv_lora_rank + c->rope_dim));
    if (fake_mla_meta(c, b, &m, rows, &l)) return cudaErrorInvalidValue;
    bk_tensor lt = bk_wrap_f32((float *)lat, b->n_tokens, c->kv_lora_rank + c->rope_dim);
    return fake_cpu()->ops->mla_latent_write(fake_cpu()->ctx, &l, &m, &lt, c->kv_lora_rank) ? cudaErrorInvalidValue : 0;
}
size_t kn_mla_scratch_bytes(int32_t T, int32_t nh, int32_t max_len, int32_t kvl) {
    if (T <= 0 || nh <= 0 || max_len <= 0 || kvl <= 0) return 0;
    size_t f = (size_t)T * nh * (size_t)((max_len + KN_MLA_SPLIT - 1) / KN_MLA_SPLIT) * ((size_t)kvl + 2) * 4;
    return (f + 255) / 256 * 256;
}
int kn_mla_attention(const kn_mla_cache *c, const kn_attn_batch *b, const float *q, int32_t nh, float scale,
                     float *out, void *scratch, size_t scratch_bytes, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_MLA_ATTENTION, .mc = *c, .b = *b, .p = {(void *)q, out, scratch},
                .i = {nh, (int64_t)scratch_bytes}, .f = {scale});
    fake_kn_calls++;
    const int32_t *rows[256];
    bk_attn_meta m;
    bk_kv_layer l;
    const int32_t D = c->kv_lora_rank + c->rope_dim, T = b->n_tokens;
    F32(q, (size_t)T * nh * D); F32(out, (size_t)T * nh * c->kv_lora_rank);
    DEV(scratch, scratch_bytes);
    if (scratch_bytes < kn_mla_scratch_bytes(T, nh, b->max_len, c->kv_lora_rank)) return cudaErrorInvalidValue;
    if (fake_mla_meta(c, b, &m, rows, &l)) return cudaErrorInvalidValue;
    bk_tensor qt = bk_wrap_f32((float *)q, T, (int64_t)nh * D), ot = bk_wrap_f32(out, T, (int64_t)nh * c->kv_lora_rank);
    return fake_cpu()->ops->mla_attention(fake_cpu()->ctx, &l, &m, &qt, nh, c->kv_lora_rank, scale, &ot)
               ? cudaErrorInvalidValue : 0;
}

/* MoE (kernels/kn_moe.h): routing = dsv3_route per token, experts = the CPU backend's I4G32 matmul on the
 * expert's words unpacked from KN_I4IL (kn_i4_unpack), silu_mul, the combine in moe_forward's order. Like the
 * MLA fakes, a test of the glue (repacking, shapes, pointers, order), not of kn_moe's arithmetic. */
#include "engine/model/deepseek_v3.h"
int kn_moe_route(const float *logits, const float *bias, int32_t T, const kn_moe_route_cfg *cfg, int32_t *ids,
                 float *w, void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_MOE_ROUTE, .rc = *cfg, .p = {(void *)logits, (void *)bias, ids, w}, .i = {T});
    fake_kn_calls++;
    F32(logits, (size_t)T * cfg->E); F32(bias, cfg->E); DEV(ids, (size_t)T * cfg->k * 4); F32(w, (size_t)T * cfg->k);
    hf_config c = {0};
    c.n_routed_experts = cfg->E, c.n_experts_per_tok = cfg->k, c.n_group = cfg->n_group, c.topk_group = cfg->topk_group;
    c.norm_topk_prob = cfg->norm_topk_prob != 0, c.routed_scaling = cfg->routed_scaling;
    float *scr = malloc(sizeof(float) * 2 * (size_t)cfg->E);
    if (!scr) return cudaErrorMemoryAllocation;
    for (int32_t t = 0; t < T; t++)
        dsv3_route(&c, logits + (size_t)t * cfg->E, bias, scr, ids + (size_t)t * cfg->k, w + (size_t)t * cfg->k);
    free(scr);
    return 0;
}
size_t kn_moe_workspace_bytes(int32_t T, int32_t k, int32_t E, int32_t H, int32_t I) {
    (void)T, (void)k, (void)E, (void)H, (void)I;
    return 256;
}
int kn_moe_dequant(const kn_moe_weights *wt, int32_t e, int which, uint16_t *out, void *stream) {
    (void)wt, (void)e, (void)which, (void)out, (void)stream;
    return cudaErrorInvalidValue; /* not faked */
}
int kn_moe_experts(const kn_moe_weights *wt, const float *x, const int32_t *ids, const float *wts, int32_t T,
                   int32_t k, const float *shared, void *ws, size_t ws_bytes, float *y, int32_t *bad_flag,
                   void *stream) {
    (void)stream;
    FAKE_LAUNCH(.op = FK_MOE_EXPERTS, .mw = *wt, .p = {(void *)x, (void *)ids, (void *)wts, (void *)shared, ws, y, bad_flag},
                .i = {T, k, (int64_t)ws_bytes});
    fake_kn_calls++;
    const int32_t E = wt->E, H = wt->H, I = wt->I;
    DEV(wt->w13, kn_moe_w13_words(E, H, I) * 4); DEV(wt->s13, kn_moe_s13_count(E, H, I) * 2);
    DEV(wt->w2, kn_moe_w2_words(E, H, I) * 4); DEV(wt->s2, kn_moe_s2_count(E, H, I) * 2);
    F32(x, (size_t)T * H); DEV(ids, (size_t)T * k * 4); F32(wts, (size_t)T * k); F32(y, (size_t)T * H);
    if (shared) F32(shared, (size_t)T * H);
    DEV(ws, ws_bytes);
    if (bad_flag) DEV(bad_flag, 4);
    if (ws_bytes < kn_moe_workspace_bytes(T, k, E, H, I) || k > 64) return cudaErrorInvalidValue;
    uint32_t *u13 = malloc(sizeof(uint32_t) * 2 * (size_t)I * (H / 8)), *u2 = malloc(sizeof(uint32_t) * (size_t)H * (I / 8));
    float *g = malloc(sizeof(float) * 2 * (size_t)I), *ye = malloc(sizeof(float) * (size_t)H);
    if (!u13 || !u2 || !g || !ye) { free(u13), free(u2), free(g), free(ye); return cudaErrorMemoryAllocation; }
    backend *cb = fake_cpu();
    for (int32_t t = 0; t < T; t++) {
        float *yt = y + (size_t)t * H;
        const int32_t *it = ids + (size_t)t * k;
        int bad = 0;
        const int32_t e0 = wt->e0, Er = wt->E_route > 0 ? wt->E_route : E; /* expert parallel: [e0, e0 + E) of Er */
        for (int32_t j = 0; j < k; j++) {
            bad |= it[j] < 0 || it[j] >= Er;
            for (int32_t j2 = 0; j2 < j; j2++) bad |= it[j] == it[j2];
        }
        if (bad) {
            for (int32_t d = 0; d < H; d++) yt[d] = NAN;
            if (bad_flag) *bad_flag = 1;
            continue;
        }
        memset(yt, 0, sizeof(float) * (size_t)H);
        for (int32_t e = 0; e < E; e++) /* ascending expert id: local e is routed expert e0 + e */
            for (int32_t j = 0; j < k; j++) {
                if (it[j] != e0 + e) continue;
                const uint32_t *w13 = wt->w13 + (size_t)e * 2 * I * (H / 8), *w2 = wt->w2 + (size_t)e * H * (I / 8);
                const uint16_t *s13 = wt->s13 + (size_t)e * 2 * I * (H / 32), *s2 = wt->s2 + (size_t)e * H * (I / 32);
                kn_i4_unpack(w13, 2 * I, H, u13), kn_i4_unpack(w2, H, I, u2);
                bk_weight gw = {BK_W_I4G32, I, H, u13, (size_t)H / 2, s13};
                bk_weight uw = {BK_W_I4G32, I, H, u13 + (size_t)I * (H / 8), (size_t)H / 2, s13 + (size_t)I * (H / 32)};
                bk_weight dw = {BK_W_I4G32, H, I, u2, (size_t)I / 2, s2};
                bk_tensor xt = bk_wrap_f32((float *)x + (size_t)t * H, 1, H), gt = bk_wrap_f32(g, 1, I);
                bk_tensor ut = bk_wrap_f32(g + I, 1, I), yet = bk_wrap_f32(ye, 1, H);
                cb->ops->matmul(cb->ctx, &gw, &xt, &gt);
                cb->ops->matmul(cb->ctx, &uw, &xt, &ut);
                cb->ops->silu_mul(cb->ctx, &gt, &ut, &gt);
                cb->ops->matmul(cb->ctx, &dw, &gt, &yet);
                const float wk = wts[(size_t)t * k + j];
                for (int32_t d = 0; d < H; d++) yt[d] += ye[d] * wk;
            }
        if (shared) {
            bk_tensor yt_t = bk_wrap_f32(yt, 1, H), st = bk_wrap_f32((float *)shared + (size_t)t * H, 1, H);
            cb->ops->add(cb->ctx, &yt_t, &st);
        }
    }
    free(u13), free(u2), free(g), free(ye);
    return 0;
}

/* ------------------------------------------------------------ fake graph API */

cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode) {
    (void)s;
    (void)mode;
    if (fake_cap) return cudaErrorInvalidValue;
    fake_cap = calloc(1, sizeof *fake_cap);
    return fake_cap ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    (void)s;
    if (!fake_cap) return cudaErrorInvalidValue;
    *g = fake_cap;
    fake_cap = NULL;
    fake_graphs_alive++;
    return cudaSuccess;
}
/* The executable graph is a copy of the node list (the captured graph may be destroyed at once). */
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags) {
    (void)flags;
    struct fake_graph *e = calloc(1, sizeof *e);
    if (!e) return cudaErrorMemoryAllocation;
    e->nodes = malloc(sizeof *e->nodes * (size_t)(g->n ? g->n : 1));
    if (!e->nodes) { free(e); return cudaErrorMemoryAllocation; }
    if (g->n) memcpy(e->nodes, g->nodes, sizeof *e->nodes * (size_t)g->n);
    e->n = e->cap = g->n;
    fake_graphs_alive++;
    *x = e;
    return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
    if (!g) return cudaErrorInvalidValue;
    free(g->nodes);
    free(g);
    fake_graphs_alive--;
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x) { return cudaGraphDestroy(x); }
cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t st) {
    fake_copies_land(-1);
    if (!x || fake_cap) return cudaErrorInvalidValue;
    fake_graph_launches++;
    fake_replaying++;
    int rc = 0;
    for (int k = 0; k < x->n && !rc; k++) {
        const fake_node *n = &x->nodes[k];
        void *const *p = n->p;
        const int64_t *i = n->i;
        switch (n->op) {
        case FK_MATMUL: rc = kn_matmul(&n->w, p[0], (int32_t)i[0], p[1], st); break;
        case FK_EMBED: rc = kn_embed(&n->w, p[0], (int32_t)i[0], p[1], p[2], st); break;
        case FK_RMSNORM: rc = kn_rmsnorm(p[0], p[1], (int32_t)i[0], (int32_t)i[1], n->f[0], p[2], st); break;
        case FK_ADD_RMSNORM:
            rc = kn_add_rmsnorm(p[0], p[1], p[2], (int32_t)i[0], (int32_t)i[1], n->f[0], p[3], st);
            break;
        case FK_ROPE:
            rc = kn_rope(p[0], (int32_t)i[0], (int32_t)i[1], (int32_t)i[2], (int32_t)i[3], p[1], p[2], n->f[0],
                         (int)i[4], st);
            break;
        case FK_SILU_MUL: rc = kn_silu_mul(p[0], p[1], i[0], p[2], st); break;
        case FK_ADD: rc = kn_add(p[0], p[1], i[0], st); break;
        case FK_ADD_BIAS: rc = kn_add_bias(p[0], p[1], (int32_t)i[0], i[1], st); break;
        case FK_COPY_ROWS: rc = kn_copy_rows(p[0], i[0], p[1], i[1], (int32_t)i[2], i[3], st); break;
        case FK_KV_WRITE: rc = kn_kv_write(&n->kv, &n->b, p[0], p[1], st); break;
        case FK_ATTENTION:
            rc = kn_attention(&n->kv, &n->b, p[0], (int32_t)i[0], n->f[0], p[1], p[2], (size_t)i[1], st);
            break;
        case FK_ARGMAX: rc = kn_argmax(p[0], (int32_t)i[0], (int32_t)i[1], p[1], (int)i[2], p[2], st); break;
        case FK_SAMPLE_DRAW:
            rc = kn_sample_draw(p[0], p[1], p[2], (int)i[0], (int32_t)i[1], (int32_t)i[2], p[3], p[4], p[5], (size_t)i[3],
                                st);
            break;
        case FK_MLA_WRITE: rc = kn_mla_latent_write(&n->mc, &n->b, p[0], st); break;
        case FK_MLA_ATTENTION:
            rc = kn_mla_attention(&n->mc, &n->b, p[0], (int32_t)i[0], n->f[0], p[1], p[2], (size_t)i[1], st);
            break;
        case FK_MOE_ROUTE: rc = kn_moe_route(p[0], p[1], (int32_t)i[0], &n->rc, p[2], p[3], st); break;
        case FK_MOE_EXPERTS:
            rc = kn_moe_experts(&n->mw, p[0], p[1], p[2], (int32_t)i[0], (int32_t)i[1], p[3], p[4], (size_t)i[2], p[5],
                                p[6], st);
            break;
        case FK_FOREIGN: rc = n->foreign(p[0]); break;
        }
    }
    fake_replaying--;
    return rc ? cudaErrorInvalidValue : cudaSuccess;
}
