/*
 * test_cuda_glue.c (label unit, no GPU): the CUDA backend's glue
 * (engine/backend/cuda_backend.c) and the model's device path (model.c /
 * llama.c with host_visible == false) on a FAKE device: cuda_fake.c supplies
 * a synchronous cudart whose "device memory" is recorded host memory and
 * kn_* launchers that check every pointer is device memory, then run the
 * CPU backend's op. So this checks, without a GPU:
 *   - the arena allocator: first fit, reuse of a freed range, coalescing back
 *     to one range, exhaustion returns NULL, buf_alloc zeroes (the fake
 *     cudaMalloc fills 0xA5);
 *   - every op's mapping (shapes, pointers, the add_rmsnorm alias case the
 *     kernel refuses, gather through the embedding kernel, flags): each op's
 *     output bit-identical to the CPU backend's;
 *   - meta_upload's flattened block tables ([n_seqs, stride] rows, stride =
 *     the step's largest logical block + 1) and max_len, the bounds it
 *     refuses, the device bad-index flag failing the next download;
 *   - whole models through llama_forward / model_finish_outputs on the fake
 *     device vs the CPU backend: the tiny HF checkpoints ($MODEL_HF_MINI_DIR)
 *     and the SmolLM2 Q4_1 GGUF ($SPECD_MODEL_GGUF) when present: a 2-sequence
 *     prefill step (40 + 7 tokens, shuffled physical blocks), then 8 decode
 *     steps of both sequences in one batch: logits of every output row
 *     bit-identical (memcmp), and no host pointer ever reached a device op;
 *   - bk_ops.draw (test_draw): the CPU op == the fake device's kn_sample_draw
 *     (sampler.c's rule) bitwise, against softmax and the inverse CDF at the
 *     Philox uniform computed here, replayed inside a graph capture.
 * What it cannot check: the kernels themselves (tests/kernels, label gpu).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/backend/backend.h"
#include "engine/model/model.h"
#include "tests/backend/cuda_fake/cuda_runtime_api.h"
#include "engine/backend/cuda_backend.h"
#include "kernels/kn_philox.h"
#include "kernels/kn_sample.h"

static int n_fail;
#define EXPECT(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); n_fail++; } } while (0)

static backend *cpu, *dev;

static void test_arena(void) {
    const bk_ops *o = dev->ops;
    size_t base = bk_cuda_arena_used(dev);
    char *a = o->buf_alloc(dev->ctx, 1000), *b = o->buf_alloc(dev->ctx, 5000), *c = o->buf_alloc(dev->ctx, 300);
    EXPECT(a && b && c && b == a + 1024 && c == b + 5120, "first fit in order, 256-byte granules (%p %p %p)", (void *)a,
           (void *)b, (void *)c);
    unsigned char z[5000];
    o->download(dev->ctx, z, b, sizeof z);
    int nz = 0;
    for (size_t i = 0; i < sizeof z; i++) nz |= z[i];
    EXPECT(!nz, "buf_alloc must zero (device memory starts as garbage)");
    o->buf_free(dev->ctx, b);
    char *d = o->buf_alloc(dev->ctx, 4000);
    EXPECT(d == b, "a freed range is reused first fit (%p vs %p)", (void *)d, (void *)b);
    o->buf_free(dev->ctx, a), o->buf_free(dev->ctx, c), o->buf_free(dev->ctx, d);
    EXPECT(bk_cuda_arena_used(dev) == base, "all freed: used %zu, was %zu", bk_cuda_arena_used(dev), base);
    char *big = o->buf_alloc(dev->ctx, ((size_t)256 << 20) - base - 4096);
    EXPECT(big != NULL, "after coalescing, one allocation of (almost) the whole free arena fits");
    EXPECT(o->buf_alloc(dev->ctx, 8192) == NULL, "exhaustion returns NULL");
    o->buf_free(dev->ctx, big);
}

static bk_tensor up(const float *h, int64_t r, int64_t c) {
    bk_tensor t;
    bk_tensor_alloc(dev, BK_F32, r, c, &t);
    dev->ops->upload(dev->ctx, t.data, h, bk_nbytes(&t));
    return t;
}
static int same(const bk_tensor *d, const float *h, int64_t n) {
    float *g = malloc(sizeof(float) * (size_t)n);
    int ok = dev->ops->download(dev->ctx, g, d->data, sizeof(float) * (size_t)n) == 0 && !memcmp(g, h, sizeof(float) * (size_t)n);
    free(g);
    return ok;
}

static void test_ops(void) {
    enum { T = 5, H = 64 };
    float x[T * H], r[T * H], g[H], c[T * H], c2[T * H];
    for (int i = 0; i < T * H; i++) x[i] = sinf((float)i), r[i] = cosf((float)i * 0.7f);
    for (int i = 0; i < H; i++) g[i] = 1.0f + 0.01f * (float)i;
    bk_tensor dx = up(x, T, H), dr = up(r, T, H), dg = up(g, 1, H);
    bk_tensor hx = bk_wrap_f32(c, T, H), hr = bk_wrap_f32(c2, T, H), hg = bk_wrap_f32(g, 1, H);
    memcpy(c, x, sizeof c), memcpy(c2, r, sizeof c2);
    /* the model's call: out aliases r (the real kn_add_rmsnorm refuses it: the glue must split it) */
    cpu->ops->add_rmsnorm(cpu->ctx, &hx, &hr, &hg, 1e-5f, &hr);
    EXPECT(dev->ops->add_rmsnorm(dev->ctx, &dx, &dr, &dg, 1e-5f, &dr) == 0, "add_rmsnorm out == r");
    EXPECT(same(&dr, c2, T * H) && same(&dx, c, T * H), "add_rmsnorm (out == r): bits differ from the CPU");
    /* gather_rows through the embedding kernel; a bad index fails the next download */
    int32_t idx[3] = {4, 0, 2};
    bk_tensor di, dd;
    bk_tensor_alloc(dev, BK_I32, 3, 1, &di), bk_tensor_alloc(dev, BK_F32, 3, H, &dd);
    dev->ops->upload(dev->ctx, di.data, idx, sizeof idx);
    EXPECT(dev->ops->gather_rows(dev->ctx, &dx, &di, &dd) == 0, "gather_rows");
    for (int i = 0; i < 3; i++) memcpy(c2 + i * H, c + idx[i] * H, sizeof(float) * H);
    EXPECT(same(&dd, c2, 3 * H), "gather_rows rows");
    idx[1] = T;
    dev->ops->upload(dev->ctx, di.data, idx, sizeof idx);
    EXPECT(dev->ops->gather_rows(dev->ctx, &dx, &di, &dd) == 0, "gather_rows launch");
    EXPECT(dev->ops->download(dev->ctx, c2, dd.data, 4) == -1, "an out-of-range index must fail the next download");
    EXPECT(dev->ops->download(dev->ctx, c2, dd.data, 4) == 0, "and only that one");
    /* copy_cols into an EAGLE-3-style aux buffer */
    bk_tensor aux;
    bk_tensor_alloc(dev, BK_F32, T, 3 * H, &aux);
    EXPECT(dev->ops->copy_cols(dev->ctx, &aux, H, &dx) == 0, "copy_cols");
    float *a = calloc(T * 3 * H, sizeof(float));
    for (int t = 0; t < T; t++) memcpy(a + t * 3 * H + H, c + t * H, sizeof(float) * H);
    EXPECT(same(&aux, a, T * 3 * H), "copy_cols columns");
    EXPECT(dev->ops->copy_cols(dev->ctx, &aux, 2 * H + 1, &dx) == -1, "copy_cols past the last column is refused");
    free(a);
    /* meta bounds */
    int32_t pos[2] = {0, 600}, seq[2] = {0, 0}, bt0[64] = {0};
    const int32_t *bts[1] = {bt0};
    bk_attn_meta m = {2, pos, seq, bts, 1, NULL, NULL};
    EXPECT(dev->ops->meta_upload(dev->ctx, &m) == -1, "a position beyond max_len is refused");
    pos[1] = 1, seq[1] = 1;
    EXPECT(dev->ops->meta_upload(dev->ctx, &m) == -1, "a sequence index >= n_seqs is refused");
    seq[1] = 0;
    EXPECT(dev->ops->meta_upload(dev->ctx, &m) == 0, "a good step");
    EXPECT(dev->ops->meta_upload(dev->ctx, &m) == -1, "a second live step is refused");
    dev->ops->meta_release(dev->ctx, &m);
    bk_tensor_free(dev, &dx), bk_tensor_free(dev, &dr), bk_tensor_free(dev, &dg), bk_tensor_free(dev, &di);
    bk_tensor_free(dev, &dd), bk_tensor_free(dev, &aux);
}

/* bk_ops.draw (EAGLE-3's sampled drafts on the device): the CPU backend's op against the fake device's
 * kn_sample_draw (which runs sampler.c's sampler_probs + sampler_draw: an independent implementation of the
 * rule), ids and q bitwise; each q against softmax(x / T) computed here in double; each drawn id against the
 * inverse CDF of that q at kn_philox_uniform(seed, pos, 0) (draw 1 would pick another id in most rows); the
 * op inside a graph capture, replayed on new logits and new parameters; refused shapes. */
static void test_draw(void) {
    enum { T = 40, V = 300 }; /* two launches on the device: chunks of 32 rows */
    static float x[T * V], qc[T * V], qd[T * V], ref[V];
    int32_t d2t[V], idc[T], idd[T];
    uint32_t st = 12345u;
    for (int i = 0; i < T * V; i++) {
        st = st * 1664525u + 1013904223u;
        x[i] = (float)((double)(st >> 8) / 16777216.0 * 8.0 - 4.0);
    }
    x[2 * V + 17] = 9.0f; /* a clear argmax for the greedy row */
    for (int i = 0; i < V; i++) d2t[i] = i + 7; /* target id = 2 id + 7 */
    static const float temps[6] = {0.0f, 0.7f, 1.0f, 1.5f, 1e-6f, 0.3f};
    bk_draw_param prm[T];
    for (int t = 0; t < T; t++) prm[t] = (bk_draw_param){temps[t % 6], 11 + 3 * t, 0x9e3779b97f4a7c15ULL * (uint64_t)(t + 1)};
    bk_tensor hx = bk_wrap_f32(x, T, V), hq = bk_wrap_f32(qc, T, V), hi = bk_wrap_i32(idc, T, 1),
              hd = bk_wrap_i32(d2t, V, 1);
    EXPECT(cpu->ops->draw && cpu->ops->draw(cpu->ctx, &hx, prm, &hd, &hi, &hq) == 0, "cpu draw");
    bk_tensor dx = up(x, T, V), dq, di, dd, dp;
    bk_tensor_alloc(dev, BK_F32, T, V, &dq), bk_tensor_alloc(dev, BK_I32, T, 1, &di);
    bk_tensor_alloc(dev, BK_I32, V, 1, &dd), bk_tensor_alloc(dev, BK_I32, T * (int64_t)sizeof prm[0] / 4, 1, &dp);
    dev->ops->upload(dev->ctx, dd.data, d2t, sizeof d2t);
    dev->ops->upload(dev->ctx, dp.data, prm, sizeof prm);
    const int calls0 = fake_kn_sample_draw_calls;
    const size_t d2h0 = fake_d2h_bytes;
    EXPECT(dev->ops->draw && dev->ops->draw(dev->ctx, &dx, dp.data, &dd, &di, &dq) == 0, "device draw");
    EXPECT(fake_kn_sample_draw_calls == calls0 + 2 && fake_d2h_bytes == d2h0, "two launches, nothing downloaded");
    dev->ops->download(dev->ctx, idd, di.data, sizeof idd), dev->ops->download(dev->ctx, qd, dq.data, sizeof qd);
    EXPECT(!memcmp(idc, idd, sizeof idc), "draw ids: cpu %d %d %d %d %d %d, device %d %d %d %d %d %d", idc[0], idc[1],
           idc[2], idc[3], idc[4], idc[5], idd[0], idd[1], idd[2], idd[3], idd[4], idd[5]);
    EXPECT(!memcmp(qc, qd, sizeof qc), "draw q: the CPU op differs from sampler_probs' bits");
    int n_other = 0;
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * V, *q = qc + (size_t)t * V;
        int32_t am = 0;
        for (int i = 1; i < V; i++) if (xt[i] > xt[am]) am = i;
        if (prm[t].temperature < 1e-5f) {
            int one = 1;
            for (int i = 0; i < V; i++) one &= q[i] == (i == am ? 1.0f : 0.0f);
            EXPECT(one && idc[t] == 2 * am + 7, "greedy row %d: id %d, argmax %d mapped %d, q one-hot %d", t, idc[t], am,
                   2 * am + 7, one);
            continue;
        }
        double z = 0.0, err = 0.0;
        for (int i = 0; i < V; i++) z += exp(((double)xt[i] - xt[am]) / prm[t].temperature);
        for (int i = 0; i < V; i++) {
            ref[i] = (float)(exp(((double)xt[i] - xt[am]) / prm[t].temperature) / z);
            const double e = fabs((double)q[i] - ref[i]);
            if (e > err) err = e;
        }
        EXPECT(err < 1e-6, "row %d: q vs softmax(x / %g) max error %g", t, prm[t].temperature, err);
        int32_t pick[2];
        for (uint32_t d = 0; d < 2; d++) { /* the inverse CDF in id order at the row's uniform of draw d */
            const double u = kn_philox_uniform(prm[t].seed, prm[t].pos, d);
            double tot = 0.0, acc = 0.0;
            for (int i = 0; i < V; i++) tot += q[i];
            pick[d] = V - 1;
            for (int i = 0; i < V; i++) if (u * tot < (acc += q[i])) { pick[d] = i; break; }
        }
        EXPECT(idc[t] == 2 * pick[0] + 7, "row %d: drew %d, the inverse CDF at Philox(seed, pos, 0) gives %d", t,
               idc[t], 2 * pick[0] + 7);
        n_other += pick[1] != pick[0];
    }
    EXPECT(n_other >= 8, "the draws are not distinguishable from draw index 1 (%d rows differ)", n_other);
    /* captured: new logits and parameters uploaded before the replay; no q, no d2t */
    const bk_graph_ops *g = dev->ops->graph;
    void *exec = NULL;
    EXPECT(g && g->begin(dev->ctx) == 0, "graph begin");
    EXPECT(dev->ops->draw(dev->ctx, &dx, dp.data, NULL, &di, NULL) == 0, "draw inside a capture");
    EXPECT(g->end(dev->ctx, &exec) == 0 && exec, "graph end");
    for (int i = 0; i < T * V; i++) x[i] = -x[i];
    for (int t = 0; t < T; t++) prm[t].pos += 100, prm[t].seed ^= 0xabcdefULL;
    dev->ops->upload(dev->ctx, dx.data, x, sizeof x), dev->ops->upload(dev->ctx, dp.data, prm, sizeof prm);
    EXPECT(exec && g->launch(dev->ctx, exec) == 0, "graph launch");
    dev->ops->download(dev->ctx, idd, di.data, sizeof idd);
    EXPECT(cpu->ops->draw(cpu->ctx, &hx, prm, NULL, &hi, NULL) == 0, "cpu draw without q");
    EXPECT(!memcmp(idc, idd, sizeof idc), "the replayed draw differs from the CPU's on the new inputs");
    if (exec) g->destroy(dev->ctx, exec);
    /* refusals: q of the wrong shape, d2t shorter than the vocabulary */
    bk_tensor bq = bk_wrap_f32(qc, T, V - 1), bd = bk_wrap_i32(d2t, V - 1, 1);
    EXPECT(cpu->ops->draw(cpu->ctx, &hx, prm, NULL, &hi, &bq) == -1, "cpu: q [T, V - 1] refused");
    EXPECT(cpu->ops->draw(cpu->ctx, &hx, prm, &bd, &hi, NULL) == -1, "cpu: d2t of V - 1 refused");
    bk_tensor dbq = dq;
    dbq.cols = V - 1;
    EXPECT(dev->ops->draw(dev->ctx, &dx, dp.data, NULL, &di, &dbq) == -1, "device: q [T, V - 1] refused");
    bk_tensor_free(dev, &dx), bk_tensor_free(dev, &dq), bk_tensor_free(dev, &di), bk_tensor_free(dev, &dd);
    bk_tensor_free(dev, &dp);
}

typedef struct runner { backend *be; model *m; } runner;

static int run_step(runner *R, int32_t n, const int32_t *tok, const int32_t *pos, const int32_t *seq,
                    const int32_t *const *bt, int32_t n_out, const int32_t *oi, float *logits, specd_err *err) {
    model_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seq_of = seq, .n_seqs = 2, .block_tables = bt,
                     .n_out = n_out, .out_idx = oi, .logits = logits};
    return model_forward(R->m, &b, err);
}

static void test_model(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) { printf("%s: absent, skipped\n", path); return; }
    specd_err err = {{0}};
    model_load_opts mo = {.block_size = 16, .n_blocks = 4}; /* every block in use: a wrong table collides */
    runner rc = {cpu, NULL}, rd = {dev, NULL};
    if (model_load(path, cpu, &mo, &rc.m, &err) || model_load(path, dev, &mo, &rd.m, &err)) {
        EXPECT(0, "%s: %s", path, err.msg);
        model_destroy(rc.m);
        return;
    }
    const int32_t V = model_get_config(rc.m)->vocab;
    int32_t b0[3] = {2, 0, 3}, b1[1] = {1}; /* 48 + 15 positions */
    const int32_t *bt[2] = {b0, b1};
    int32_t tok[47], pos[47], seq[47], oi[2] = {39, 46};
    for (int i = 0; i < 47; i++) {
        tok[i] = (int32_t)((i * 7919u + 13u) % (uint32_t)V);
        seq[i] = i < 40 ? 0 : 1;
        pos[i] = i < 40 ? i : i - 40;
    }
    float *lc = malloc(sizeof(float) * 2 * V), *ld = malloc(sizeof(float) * 2 * V);
    int steps_same = 0, bad = 0;
    int rcpu = run_step(&rc, 47, tok, pos, seq, bt, 2, oi, lc, &err), rdev = run_step(&rd, 47, tok, pos, seq, bt, 2, oi, ld, &err);
    EXPECT(!rcpu && !rdev, "%s: prefill step: %s", path, err.msg);
    if (rcpu || rdev) goto out;
    bad |= memcmp(lc, ld, sizeof(float) * 2 * V) != 0;
    int32_t len[2] = {40, 7};
    for (int s = 0; s < 8 && !bad; s++) {
        int32_t t2[2], p2[2] = {len[0], len[1]}, s2[2] = {0, 1}, o2[2] = {0, 1};
        for (int q = 0; q < 2; q++) {
            int32_t best = 0;
            for (int32_t i = 1; i < V; i++) if (lc[q * V + i] > lc[q * V + best]) best = i;
            t2[q] = best;
        }
        if (run_step(&rc, 2, t2, p2, s2, bt, 2, o2, lc, &err) || run_step(&rd, 2, t2, p2, s2, bt, 2, o2, ld, &err)) {
            EXPECT(0, "%s: decode %d: %s", path, s, err.msg);
            goto out;
        }
        len[0]++, len[1]++;
        bad |= memcmp(lc, ld, sizeof(float) * 2 * V) != 0;
        steps_same += !bad;
    }
    EXPECT(!bad, "%s: logits differ from the CPU backend after %d identical decode steps", path, steps_same);
    printf("%s: prefill (40 + 7 tokens) + %d decode steps of 2 sequences: logits bit-identical to the CPU backend\n",
           path, steps_same);
out:
    free(lc), free(ld);
    model_destroy(rc.m), model_destroy(rd.m);
}

/* opts.draw_vocab: the draw scratch is carved at create and counted by bk_cuda_fixed_bytes, so a draw still
 * runs once the rest of the arena is taken (as the KV pool takes it); without it the first draw needs arena
 * room and is refused naming the arena. */
static void test_draw_carved(const bk_cuda_opts *base) {
    enum { T = 3, V = 5000 };
    specd_err err = {{0}};
    for (int carve = 0; carve < 2; carve++) {
        bk_cuda_opts o = *base;
        o.arena_bytes = (size_t)16 << 20;
        o.draw_vocab = carve ? V : 0;
        const size_t plain = bk_cuda_fixed_bytes(&(bk_cuda_opts){.device = 0, .arena_bytes = o.arena_bytes,
                                                                 .max_tokens = o.max_tokens, .max_seqs = o.max_seqs,
                                                                 .max_len = o.max_len, .block_size = o.block_size,
                                                                 .max_heads = o.max_heads, .max_head_dim = o.max_head_dim});
        EXPECT(bk_cuda_fixed_bytes(&o) >= plain + (carve ? kn_sample_draw_scratch_bytes(32, V) : 0),
               "fixed bytes %zu must count the draw scratch (%zu without)", bk_cuda_fixed_bytes(&o), plain);
        backend *d = bk_cuda_create(&o, &err);
        if (!d) { EXPECT(0, "backend: %s", err.msg); continue; }
        bk_tensor x, q, id, pr;
        EXPECT(bk_tensor_alloc(d, BK_F32, T, V, &x) == 0 && bk_tensor_alloc(d, BK_F32, T, V, &q) == 0 &&
                   bk_tensor_alloc(d, BK_I32, T, 1, &id) == 0 &&
                   bk_tensor_alloc(d, BK_I32, T * (int64_t)sizeof(bk_draw_param) / 4, 1, &pr) == 0, "tensors");
        bk_draw_param prm[T];
        for (int t = 0; t < T; t++) prm[t] = (bk_draw_param){0.8f, 5 + t, 77u + (uint64_t)t};
        d->ops->upload(d->ctx, pr.data, prm, sizeof prm);
        /* the KV pool's role: take (almost) everything that is left, 256-byte granules */
        size_t left = o.arena_bytes - bk_cuda_arena_used(d);
        void *fill = NULL;
        while (left >= 4096 && !(fill = d->ops->buf_alloc(d->ctx, left))) left -= 4096;
        EXPECT(fill && o.arena_bytes - bk_cuda_arena_used(d) < 8192, "arena filled (%zu left)",
               o.arena_bytes - bk_cuda_arena_used(d));
        const int rc = d->ops->draw(d->ctx, &x, pr.data, NULL, &id, &q);
        const char *why = d->ops->last_error ? d->ops->last_error(d->ctx) : "";
        if (carve)
            EXPECT(rc == 0, "carved draw scratch: a draw runs with the arena full (%s)", why);
        else
            EXPECT(rc != 0 && why && strstr(why, "arena"), "uncarved: the first draw is refused naming the arena (%d, %s)",
                   rc, why ? why : "");
        bk_cuda_destroy(d);
    }
}

int main(void) {
    cpu = bk_cpu_create(0);
    specd_err err = {{0}};
    bk_cuda_opts bad = {.device = 1, .arena_bytes = 1 << 20, .max_tokens = 64, .max_seqs = 4, .max_len = 512,
                        .block_size = 16, .max_heads = 8, .max_head_dim = 64};
    EXPECT(!bk_cuda_create(&bad, &err) && strstr(err.msg, "device 1"), "a missing device is refused: %s", err.msg);
    bad.device = 0, bad.max_head_dim = 1000;
    EXPECT(!bk_cuda_create(&bad, &err) && strstr(err.msg, "head_dim"), "head_dim above the kernel's: %s", err.msg);
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)256 << 20, .max_tokens = 64, .max_seqs = 4,
                      .max_len = 512, .block_size = 16, .max_heads = 16, .max_head_dim = 128, .staging_bytes = 4096};
    dev = bk_cuda_create(&o, &err);
    if (!cpu || !dev) { printf("FAIL: backends: %s\n", err.msg); return 1; }
    printf("%s\n", bk_cuda_describe(dev));
    test_arena();
    test_ops();
    test_draw();
    test_draw_carved(&o);
    const char *mini = getenv("MODEL_HF_MINI_DIR"), *gguf = getenv("SPECD_MODEL_GGUF");
    char p[4096];
    static const char *const V[] = {"f32", "bf16", "sharded", "mistral"};
    for (int i = 0; mini && i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", mini, V[i]);
        /* a fresh device per model: the weights stay placed until destroy */
        bk_cuda_destroy(dev);
        dev = bk_cuda_create(&o, &err);
        test_model(p);
    }
    if (gguf) {
        bk_cuda_destroy(dev);
        dev = bk_cuda_create(&o, &err);
        test_model(gguf);
    }
    EXPECT(fake_violations == 0, "%d host pointers reached device ops", fake_violations);
    EXPECT(fake_kn_calls > 0, "the fake kernels ran");
    bk_cuda_destroy(dev);
    bk_cpu_destroy(cpu);
    printf(n_fail ? "FAILED: %d\n" : "OK\n", n_fail);
    return n_fail ? 1 : 0;
}
