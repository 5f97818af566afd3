/*
 * test_cuda_backend.c (label gpu): the CUDA backend (engine/backend/
 * cuda_backend.c) against the CPU backend, through the bk_ops interface
 * only, then whole models on both backends.
 *
 * Reference: the CPU backend at SPECD_CPU_ISA=portable (f32 activations in
 * matmul, double sums in norms and attention), set before it is created.
 *
 * Part 1, every op at T in {1, 2, 3, 4, 5, 8, 16, 33, 128}: the inputs of a
 * T-token call are the first T rows of one 128-row set, so
 *   - NMSE (kn_harness.h) of the GPU output vs the CPU output, per op:
 *       matmul (f32, bf16, f16, Q8_0, Q4_0, Q4_1; 160 x 256)  1e-10
 *       rmsnorm, add_rmsnorm (both alias forms), rope (neox and
 *       adjacent pairs), silu_mul (CUDA expf <= 2 ulp)          1e-10
 *       attention over a paged cache (4 sequences with histories 0, 5,
 *       40 and 300 positions: 1 and 2 KV splits, a shuffled block
 *       table, GQA 8/2, head_dim 64), and with a tree mask at T 8 / 33 1e-8
 *       add, add_bias, embed (6 formats), copy_cols, gather_rows,
 *       kv_write (the pool after the step)                       exact (NMSE 0)
 *     Why these bounds: both sides round in f32 with different summation
 *     orders over <= 300 terms: relative error per element ~1e-6 at worst
 *     (NMSE ~1e-12); a wrong row, head, position, block or scale moves whole
 *     values (NMSE >= 1e-4). Copies and element-wise ops without a reduction
 *     must be bit-exact (same IEEE operations; silu uses expf, bounded).
 *   - BATCH INVARIANCE on the GPU, bitwise: row t of every op's T-token
 *     output equals row t of its 128-token output (memcmp).
 *   - refusals: a token id out of range (host check), an index out of range
 *     on the device (gather_rows: flag read at the next download), a step
 *     larger than the create-time bounds, an arena that cannot fit.
 * Part 2, models (SPECD_CUDA_TEST_MODELS: directories separated by ':';
 * default $MODEL_HF_MINI_DIR/{f32,bf16,sharded,mistral} and, when present,
 * $SPECD_TWIN_DIR/smollm2_twin written by tools/gen_llama_hf_mini.py
 * --smollm2-shape): each loaded on both backends; a 20-token prompt in one
 * step, then 32 greedy decode steps on each backend independently:
 *   - the prompt's last-position logits: top-5 ids identical, max|diff| <=
 *     1e-3 * max|logit| (f32 with a different order in every reduction,
 *     over 30 layers for the twin);
 *   - the 32 greedy tokens identical (the test prints the first divergence
 *     and its logit margin when not).
 * Part 3, sampling on the device through the engine ($MODEL_HF_MINI_DIR/f32):
 * tests/backend/engine_gen.h's scenarios with the reference engine on the
 * CPU backend (host sampler) and the other on the GPU with
 * engine_runner.sample_be (kn_sample / kn_spec_verify via bk_ops.sample,
 * only ids and counts downloaded): greedy, seeded sampling at n = 2 with
 * top-k / top-p / min-p / penalties / logit_bias / min_tokens, logprobs
 * (within 1e-4, top ids identical), penalties + a biased EOS behind
 * min_tokens, speculative k = 3 (greedy chains verified on the GPU, a
 * sampling chain on the host) and speculative greedy == plain greedy: the
 * same tokens on both. A sampled token can differ only where the draw's
 * uniform falls within the logits' f32 difference (~1e-6 relative) of a
 * cumulative boundary, or a top-k / top-p / min-p threshold sits that close
 * to a probability: rare enough that a difference is reported as a failure.
 * Exits 77 with the reason when no usable GPU is present. The arena is 2 GiB
 * (SPECD_CUDA_TEST_ARENA_MB overrides). tests/backend builds this same file
 * against a fake device (backend_cuda_test_on_fake, label unit) to check the
 * test's own logic without a GPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/backend/backend.h"
#include "engine/backend/cuda_backend.h"
#include "engine/model/model.h"
#include "tests/kernels/kn_harness.h"


#define TMAX 128
static const int32_t TS[] = {1, 2, 3, 4, 5, 8, 16, 33, 128};
#define NT ((int)(sizeof TS / sizeof TS[0]))

static backend *cpu, *gpu;
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}
static float frand(void) { return (float)((rnd() & 0xFFFFFF) / 16777216.0 * 2.0 - 1.0); }
static void fill(float *p, size_t n, float scale) { for (size_t i = 0; i < n; i++) p[i] = frand() * scale; }
static uint16_t f2h(float f) { /* f32 -> IEEE half, round to nearest (values here are normal and small) */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t s = (x >> 16) & 0x8000, e = ((x >> 23) & 0xff) - 127 + 15, m = x & 0x7fffff;
    if ((int32_t)e <= 0) return (uint16_t)s;
    uint32_t h = s | (e << 10) | (m >> 13);
    if (m & 0x1000) h++;
    return (uint16_t)h;
}

/* --------------------------------------------------------------- device helpers */

static void *dalloc(size_t bytes) {
    void *p = gpu->ops->buf_alloc(gpu->ctx, bytes);
    if (!p) { printf("FAIL: arena allocation of %zu bytes\n", bytes); exit(1); }
    return p;
}
static bk_tensor dten(const float *host, int64_t rows, int64_t cols) {
    bk_tensor t = {dalloc((size_t)rows * cols * 4), BK_F32, rows, cols};
    if (host && gpu->ops->upload(gpu->ctx, t.data, host, (size_t)rows * cols * 4) < 0) { printf("FAIL upload\n"); exit(1); }
    return t;
}
static bk_tensor dten_i32(const int32_t *host, int64_t rows) {
    bk_tensor t = {dalloc((size_t)rows * 4), BK_I32, rows, 1};
    if (gpu->ops->upload(gpu->ctx, t.data, host, (size_t)rows * 4) < 0) { printf("FAIL upload\n"); exit(1); }
    return t;
}
static void down(float *host, const bk_tensor *t) {
    if (gpu->ops->download(gpu->ctx, host, t->data, bk_nbytes(t)) < 0) { printf("FAIL download\n"); exit(1); }
}
static void dfree(bk_tensor *t) { gpu->ops->buf_free(gpu->ctx, t->data); t->data = NULL; }

/* Checks GPU output g against CPU c ([T, n] each) within bound, and against the 128-token GPU output g128 bitwise. */
static double worst[32];
static void check(int slot, const char *op, int32_t T, const float *g, const float *c, const float *g128, size_t n,
                  double bound) {
    double e = kn_nmse(g, c, (size_t)T * n);
    if (e > worst[slot]) worst[slot] = e;
    KN_EXPECT(e <= bound, "%s T=%d: NMSE %.3g > %.0e", op, T, e, bound);
    if (g128) KN_EXPECT(!memcmp(g, g128, sizeof(float) * (size_t)T * n), "%s T=%d: rows differ from the T=128 call", op, T);
}

/* ------------------------------------------------------------------- weights */

#define WR 160
#define WC 256
typedef struct wset { bk_weight host, dev; void *buf; } wset;
static void make_weight(bk_wtype ty, wset *w) {
    size_t rb = 0;
    switch (ty) {
    case BK_W_F32: rb = WC * 4; break;
    case BK_W_BF16: case BK_W_F16: rb = WC * 2; break;
    case BK_W_Q8_0: rb = WC / 32 * 34; break;
    case BK_W_Q4_0: rb = WC / 32 * 18; break;
    case BK_W_Q4_1: rb = WC / 32 * 20; break;
    default: break;
    }
    uint8_t *b = malloc(rb * WR);
    for (int r = 0; r < WR; r++) {
        uint8_t *row = b + (size_t)r * rb;
        if (ty == BK_W_F32) for (int i = 0; i < WC; i++) ((float *)row)[i] = frand() * 0.1f;
        else if (ty == BK_W_F16) for (int i = 0; i < WC; i++) ((uint16_t *)row)[i] = f2h(frand() * 0.1f);
        else if (ty == BK_W_BF16) for (int i = 0; i < WC; i++) {
            float f = frand() * 0.1f;
            uint32_t x;
            memcpy(&x, &f, 4);
            ((uint16_t *)row)[i] = (uint16_t)(x >> 16);
        } else {
            const size_t bb = rb / (WC / 32);
            for (int k = 0; k < WC / 32; k++) {
                uint8_t *blk = row + k * bb;
                uint16_t d = f2h(0.002f + 0.01f * (frand() + 1)), m = f2h(frand() * 0.05f);
                memcpy(blk, &d, 2);
                size_t q0 = 2;
                if (ty == BK_W_Q4_1) { memcpy(blk + 2, &m, 2); q0 = 4; }
                for (size_t i = q0; i < bb; i++) blk[i] = (uint8_t)rnd();
            }
        }
    }
    w->buf = b;
    w->host = (bk_weight){ty, WR, WC, b, rb, NULL};
    if (gpu->ops->weight_place(gpu->ctx, &w->host, &w->dev) < 0) { printf("FAIL weight_place type %d\n", ty); exit(1); }
}

/* -------------------------------------------------------------------- part 1 */

static void test_ops(void) {
    enum { H = 256, NH = 8, NKV = 2, HD = 64 };
    float *x = malloc(sizeof(float) * TMAX * 2048), *r = malloc(sizeof(float) * TMAX * 2048);
    float *c = malloc(sizeof(float) * TMAX * 2048), *g = malloc(sizeof(float) * TMAX * 2048);
    float *g128 = malloc(sizeof(float) * TMAX * 2048 * 24), *tmp = malloc(sizeof(float) * TMAX * 2048);
    float gain[2048], bias[2048], invf[HD / 2];
    fill(x, (size_t)TMAX * 2048, 2.0f);
    fill(r, (size_t)TMAX * 2048, 1.0f);
    for (int i = 0; i < 2048; i++) gain[i] = 1.0f + 0.3f * frand(), bias[i] = frand();
    for (int i = 0; i < HD / 2; i++) invf[i] = (float)pow(10000.0, -2.0 * i / HD);
    bk_tensor dg = dten(gain, 1, H), db = dten(bias, 1, H), dinv = dten(invf, 1, HD / 2);
    bk_tensor hg = bk_wrap_f32(gain, 1, H), hb = bk_wrap_f32(bias, 1, H), hinv = bk_wrap_f32(invf, 1, HD / 2);
    const bk_ops *C = cpu->ops, *G = gpu->ops;
    /* 4 sequences, paged KV: histories of 0, 5, 40 and 300 positions; block size 16; a shuffled block table */
    const int32_t hist[4] = {0, 5, 40, 300}, BS = 16, NB = 96;
    int32_t bt_store[4][32], *bt[4];
    int32_t perm[96];
    for (int i = 0; i < NB; i++) perm[i] = i;
    for (int i = NB - 1; i > 0; i--) { int j = (int)(rnd() % (uint32_t)(i + 1)), t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
    for (int s = 0; s < 4; s++) { for (int j = 0; j < 24; j++) bt_store[s][j] = perm[s * 24 + j]; bt[s] = bt_store[s]; }
    int32_t pos[TMAX], seq[TMAX], cnt[4] = {0};
    for (int t = 0; t < TMAX; t++) { seq[t] = t % 4; pos[t] = hist[seq[t]] + cnt[seq[t]]++; }
    const size_t pool = (size_t)NB * BS * NKV * HD;
    float *kv0 = malloc(sizeof(float) * pool * 2), *kvc = malloc(sizeof(float) * pool * 2), *kvg = malloc(sizeof(float) * pool * 2);
    fill(kv0, pool * 2, 1.0f);
    float *dkv = dalloc(sizeof(float) * pool * 2);
    int32_t ids[TMAX];

    for (int ti = NT - 1; ti >= 0; ti--) { /* T = 128 first: its GPU outputs are the invariance reference */
        const int32_t T = TS[ti];
        const bool ref = T == TMAX;
        float *ref_at = g128;
        int slot = 0;
#define REF(n) (ref ? (memcpy(ref_at, g, sizeof(float) * (size_t)T * (n)), (const float *)NULL) : (const float *)ref_at)
#define NEXT(n) (ref_at += (size_t)TMAX * (n), slot++)
        /* matmul, 6 formats */
        for (int ty = BK_W_F32; ty <= BK_W_Q4_1; ty++) {
            static wset ws[6];
            if (ref) make_weight((bk_wtype)ty, &ws[ty]);
            bk_tensor hx = bk_wrap_f32(x, T, WC), hy = bk_wrap_f32(c, T, WR), dx = dten(x, T, WC), dy = dten(NULL, T, WR);
            KN_EXPECT(C->matmul(cpu->ctx, &ws[ty].host, &hx, &hy) == 0, "cpu matmul");
            KN_EXPECT(G->matmul(gpu->ctx, &ws[ty].dev, &dx, &dy) == 0, "gpu matmul type %d", ty);
            down(g, &dy);
            char nm[32];
            snprintf(nm, sizeof nm, "matmul/type%d", ty);
            check(slot, nm, T, g, c, REF(WR), WR, 1e-10);
            NEXT(WR);
            /* embed with the same weight: ids in range */
            for (int t = 0; t < T; t++) ids[t] = (int32_t)(rnd() % WR);
            bk_tensor hid = bk_wrap_i32(ids, T, 1), did = dten_i32(ids, T), he = bk_wrap_f32(c, T, WC), de = dten(NULL, T, WC);
            KN_EXPECT(C->embed(cpu->ctx, &ws[ty].host, &hid, ids, &he) == 0, "cpu embed");
            KN_EXPECT(G->embed(gpu->ctx, &ws[ty].dev, &did, ids, &de) == 0, "gpu embed");
            down(g, &de);
            snprintf(nm, sizeof nm, "embed/type%d", ty);
            check(slot, nm, T, g, c, NULL, WC, 0.0);
            slot++;
            dfree(&dx), dfree(&dy), dfree(&did), dfree(&de);
        }
        /* rmsnorm; add_rmsnorm with out == r (the model's call) and out distinct */
        {
            bk_tensor dx = dten(x, T, H), dout = dten(NULL, T, H), hx = bk_wrap_f32(x, T, H), ho = bk_wrap_f32(c, T, H);
            C->rmsnorm(cpu->ctx, &hx, &hg, 1e-5f, &ho);
            KN_EXPECT(G->rmsnorm(gpu->ctx, &dx, &dg, 1e-5f, &dout) == 0, "gpu rmsnorm");
            down(g, &dout);
            check(slot, "rmsnorm", T, g, c, REF(H), H, 1e-10);
            NEXT(H);
            for (int alias = 0; alias < 2; alias++) {
                memcpy(tmp, x, sizeof(float) * T * H);
                float *cr = malloc(sizeof(float) * T * H);
                memcpy(cr, r, sizeof(float) * T * H);
                bk_tensor hxx = bk_wrap_f32(tmp, T, H), hr = bk_wrap_f32(cr, T, H), hout = bk_wrap_f32(alias ? cr : c, T, H);
                bk_tensor gx = dten(x, T, H), gr = dten(r, T, H), gout = alias ? gr : dten(NULL, T, H);
                C->add_rmsnorm(cpu->ctx, &hxx, &hr, &hg, 1e-5f, &hout);
                KN_EXPECT(G->add_rmsnorm(gpu->ctx, &gx, &gr, &dg, 1e-5f, &gout) == 0, "gpu add_rmsnorm alias %d", alias);
                down(g, &gout);
                check(slot, alias ? "add_rmsnorm(out=r)" : "add_rmsnorm", T, g, alias ? cr : c, REF(H), H, 1e-10);
                NEXT(H);
                down(g, &gx);
                check(slot, "add_rmsnorm residual x", T, g, tmp, NULL, H, 0.0);
                slot++;
                dfree(&gx), dfree(&gr);
                if (!alias) dfree(&gout);
                free(cr);
            }
        }
        /* elementwise: silu_mul, add, add_bias, copy_cols, gather_rows */
        {
            const int n = 512;
            bk_tensor ga = dten(x, T, n), gb = dten(r, T, n);
            memcpy(c, x, sizeof(float) * T * n);
            bk_tensor ha = bk_wrap_f32(c, T, n), hbb = bk_wrap_f32(r, T, n);
            C->silu_mul(cpu->ctx, &ha, &hbb, &ha);
            KN_EXPECT(G->silu_mul(gpu->ctx, &ga, &gb, &ga) == 0, "gpu silu_mul");
            down(g, &ga);
            check(slot, "silu_mul", T, g, c, REF(n), n, 1e-10);
            NEXT(n);
            C->add(cpu->ctx, &ha, &hbb);
            KN_EXPECT(G->add(gpu->ctx, &ga, &gb) == 0, "gpu add");
            down(g, &ga);
            check(slot, "silu_mul+add", T, g, c, REF(n), n, 1e-10);
            NEXT(n);
            bk_tensor hy = bk_wrap_f32(c, T, H), gy = dten(x, T, H);
            memcpy(c, x, sizeof(float) * T * H);
            C->add_bias(cpu->ctx, &hy, &hb);
            KN_EXPECT(G->add_bias(gpu->ctx, &gy, &db) == 0, "gpu add_bias");
            down(g, &gy);
            check(slot, "add_bias", T, g, c, REF(H), H, 0.0);
            NEXT(H);
            /* copy_cols: src [T, 64] into columns 96.. of dst [T, 256] */
            bk_tensor hd = bk_wrap_f32(c, T, H), gd = dten(x, T, H), hs = bk_wrap_f32(r, T, 64), gs = dten(r, T, 64);
            memcpy(c, x, sizeof(float) * T * H);
            C->copy_cols(cpu->ctx, &hd, 96, &hs);
            KN_EXPECT(G->copy_cols(gpu->ctx, &gd, 96, &gs) == 0, "gpu copy_cols");
            down(g, &gd);
            check(slot, "copy_cols", T, g, c, NULL, H, 0.0);
            slot++;
            /* gather_rows: T indices into a [128, 256] source */
            bk_tensor src = dten(x, TMAX, H), hsrc = bk_wrap_f32(x, TMAX, H);
            for (int t = 0; t < T; t++) ids[t] = (int32_t)(rnd() % TMAX);
            bk_tensor hidx = bk_wrap_i32(ids, T, 1), gidx = dten_i32(ids, T), hdst = bk_wrap_f32(c, T, H), gdst = dten(NULL, T, H);
            C->gather_rows(cpu->ctx, &hsrc, &hidx, &hdst);
            KN_EXPECT(G->gather_rows(gpu->ctx, &src, &gidx, &gdst) == 0, "gpu gather_rows");
            down(g, &gdst);
            check(slot, "gather_rows", T, g, c, NULL, H, 0.0);
            slot++;
            dfree(&ga), dfree(&gb), dfree(&gy), dfree(&gd), dfree(&gs), dfree(&src), dfree(&gidx), dfree(&gdst);
        }
        /* rope (both pair layouts), kv_write, attention (no mask; tree mask at T 8 and 33) */
        for (int masked = 0; masked < 2; masked++) {
            if (masked && T != 8 && T != 33) continue;
            uint8_t *mask = NULL;
            if (masked) { /* token t may not see in-step tokens of its sequence whose index is odd and < t (random-ish tree) */
                mask = malloc((size_t)T * T);
                for (int a = 0; a < T; a++) for (int b2 = 0; b2 < T; b2++) mask[a * T + b2] = (uint8_t)(b2 == a || (rnd() & 1));
            }
            bk_attn_meta hm = {T, pos, seq, (const int32_t *const *)bt, 4, mask, NULL}, gm = hm;
            KN_EXPECT(C->meta_upload(cpu->ctx, &hm) == 0, "cpu meta");
            KN_EXPECT(G->meta_upload(gpu->ctx, &gm) == 0 && gm.dev, "gpu meta_upload");
            const int qd = NH * HD, kvd = NKV * HD;
            float *q = malloc(sizeof(float) * T * qd), *k = malloc(sizeof(float) * T * kvd), *v = malloc(sizeof(float) * T * kvd);
            memcpy(q, x, sizeof(float) * T * qd);
            memcpy(k, r, sizeof(float) * T * kvd);
            memcpy(v, r + (size_t)TMAX * kvd, sizeof(float) * T * kvd); /* the same rows at every T */
            bk_tensor gq = dten(q, T, qd), gk = dten(k, T, kvd), gv = dten(v, T, kvd), go = dten(NULL, T, qd);
            bk_tensor hq = bk_wrap_f32(q, T, qd), hk = bk_wrap_f32(k, T, kvd), hv = bk_wrap_f32(v, T, kvd), ho = bk_wrap_f32(c, T, qd);
            const bool neox = masked == 0;
            C->rope(cpu->ctx, &hq, NH, HD, HD, &hm, &hinv, 1.0f, neox);
            C->rope(cpu->ctx, &hk, NKV, HD, HD, &hm, &hinv, 1.0f, neox);
            KN_EXPECT(G->rope(gpu->ctx, &gq, NH, HD, HD, &gm, &dinv, 1.0f, neox) == 0, "gpu rope q");
            KN_EXPECT(G->rope(gpu->ctx, &gk, NKV, HD, HD, &gm, &dinv, 1.0f, neox) == 0, "gpu rope k");
            down(g, &gq);
            check(slot, neox ? "rope(neox) q" : "rope(pairs) q", T, g, q, masked ? NULL : REF(qd), qd, 1e-10);
            if (!masked) NEXT(qd); else slot++;
            /* kv_write into copies of the same random pool */
            memcpy(kvc, kv0, sizeof(float) * pool * 2);
            KN_EXPECT(G->upload(gpu->ctx, dkv, kv0, sizeof(float) * pool * 2) == 0, "upload pool");
            bk_kv_layer hl = {kvc, kvc + pool, BS, NKV, HD, NB, NULL, NULL}, gl = {dkv, dkv + pool, BS, NKV, HD, NB, NULL, NULL};
            C->kv_write(cpu->ctx, &hl, &hm, &hk, &hv);
            KN_EXPECT(G->kv_write(gpu->ctx, &gl, &gm, &gk, &gv) == 0, "gpu kv_write");
            KN_EXPECT(G->download(gpu->ctx, kvg, dkv, sizeof(float) * pool * 2) == 0, "download pool");
            /* k went through rope on both sides with a 1e-10 bound, so compare the pool with the same bound */
            double e = kn_nmse(kvg, kvc, pool * 2);
            KN_EXPECT(e <= 1e-10, "kv_write T=%d: pool NMSE %.3g", T, e);
            /* attention on each side's own pool */
            C->attention(cpu->ctx, &hl, &hm, &hq, NH, 0.125f, &ho);
            KN_EXPECT(G->attention(gpu->ctx, &gl, &gm, &gq, NH, 0.125f, &go) == 0, "gpu attention");
            down(g, &go);
            check(slot, masked ? "attention(tree mask)" : "attention", T, g, c, masked ? NULL : REF(qd), qd, 1e-8);
            if (!masked) NEXT(qd); else slot++;
            C->meta_release(cpu->ctx, &hm);
            G->meta_release(gpu->ctx, &gm);
            dfree(&gq), dfree(&gk), dfree(&gv), dfree(&go);
            free(q), free(k), free(v), free(mask);
        }
#undef REF
#undef NEXT
    }
    printf("ops: T in {1,2,3,4,5,8,16,33,128}: worst NMSE per check:");
    for (int i = 0; i < 32; i++) if (worst[i] > 0) printf(" %.2g", worst[i]);
    printf("\n");

    /* refusals */
    {
        wset w;
        make_weight(BK_W_F32, &w);
        int32_t bad[2] = {3, WR};
        bk_tensor did = dten_i32(bad, 2), de = dten(NULL, 2, WC);
        KN_EXPECT(G->embed(gpu->ctx, &w.dev, &did, bad, &de) == -1, "embed with id %d of %d rows must fail (host check)", WR, WR);
        bk_tensor src = dten(x, 4, H), gidx = dten_i32(bad, 2), gdst = dten(NULL, 2, H);
        KN_EXPECT(G->gather_rows(gpu->ctx, &src, &gidx, &gdst) == 0, "gather_rows launch");
        KN_EXPECT(G->download(gpu->ctx, g, gdst.data, bk_nbytes(&gdst)) == -1, "a device-side bad index must fail the download");
        KN_EXPECT(G->download(gpu->ctx, g, gdst.data, 4) == 0, "the flag is cleared after it was reported");
        int32_t p1[TMAX + 1] = {0}, s1[TMAX + 1] = {0};
        bk_attn_meta big = {TMAX + 1, p1, s1, (const int32_t *const *)bt, 1, NULL, NULL};
        KN_EXPECT(G->meta_upload(gpu->ctx, &big) == -1, "a step above max_tokens must be refused");
        free(w.buf);
    }
    free(x), free(r), free(c), free(g), free(g128), free(tmp), free(kv0), free(kvc), free(kvg);
}

/* -------------------------------------------------------------------- part 2 */

#define EG_EXACT 0 /* the GPU's logits differ from the CPU's in the last bits: logprobs within 1e-4 */
#include "tests/backend/engine_gen.h"

typedef struct run { backend *be; model *m; int32_t bt[64]; const int32_t *btp[1]; } run;

static int step(run *R, const int32_t *toks, int32_t n, int32_t pos0, float *logits, specd_err *err) {
    int32_t pos[64], seq[64], oi = n - 1;
    for (int i = 0; i < n; i++) pos[i] = pos0 + i, seq[i] = 0;
    model_batch b = {.n_tokens = n, .tokens = toks, .pos = pos, .seq_of = seq, .n_seqs = 1,
                     .block_tables = R->btp, .n_out = 1, .out_idx = &oi, .logits = logits};
    return model_forward(R->m, &b, err);
}

static int32_t argmax(const float *l, int32_t V) {
    int32_t best = 0;
    for (int32_t i = 1; i < V; i++) if (l[i] > l[best]) best = i;
    return best;
}

static void test_model(const char *dir) {
    specd_err err = {{0}};
    model_load_opts mo = {.block_size = 16, .n_blocks = 8};
    run rc = {.be = cpu}, rg = {.be = gpu};
    if (model_load(dir, cpu, &mo, &rc.m, &err) < 0 || model_load(dir, gpu, &mo, &rg.m, &err) < 0) {
        KN_EXPECT(0, "%s: load: %s", dir, err.msg);
        model_destroy(rc.m);
        return;
    }
    for (int i = 0; i < 8; i++) rc.bt[i] = i, rg.bt[i] = 7 - i; /* different physical blocks: paging is per backend */
    rc.btp[0] = rc.bt, rg.btp[0] = rg.bt;
    const int32_t V = model_get_config(rc.m)->vocab;
    float *lc = malloc(sizeof(float) * V), *lg = malloc(sizeof(float) * V);
    int32_t prompt[20];
    for (int i = 0; i < 20; i++) prompt[i] = (int32_t)(rnd() % (uint32_t)V);
    if (step(&rc, prompt, 20, 0, lc, &err) < 0 || step(&rg, prompt, 20, 0, lg, &err) < 0) {
        KN_EXPECT(0, "%s: prefill: %s", dir, err.msg);
        goto out;
    }
    double mx = 0, md = 0;
    for (int32_t i = 0; i < V; i++) {
        if (fabs(lc[i]) > mx) mx = fabs(lc[i]);
        if (fabs(lc[i] - lg[i]) > md) md = fabs(lc[i] - lg[i]);
    }
    int32_t tc[5], tg[5];
    float vc[5], vg[5];
    for (int k = 0; k < 5; k++) { /* top-5 by repeated argmax, knocking each winner out, then restoring them */
        tc[k] = argmax(lc, V), tg[k] = argmax(lg, V);
        vc[k] = lc[tc[k]], vg[k] = lg[tg[k]];
        lc[tc[k]] = -INFINITY, lg[tg[k]] = -INFINITY;
    }
    for (int k = 0; k < 5; k++) lc[tc[k]] = vc[k], lg[tg[k]] = vg[k];
    KN_EXPECT(!memcmp(tc, tg, sizeof tc), "%s: top-5 differ (cpu %d %d %d %d %d, gpu %d %d %d %d %d)", dir, tc[0], tc[1],
           tc[2], tc[3], tc[4], tg[0], tg[1], tg[2], tg[3], tg[4]);
    KN_EXPECT(md <= 1e-3 * mx, "%s: max|logit diff| %.3g > 1e-3 x max|logit| %.3g", dir, md, mx);
    int32_t c_tok = tc[0], g_tok = tg[0], diverged = -1;
    for (int i = 0; i < 32; i++) {
        if (c_tok != g_tok && diverged < 0) {
            diverged = i;
            printf("%s: token %d: cpu %d (logit %.6g), gpu %d (cpu's logit for it %.6g): a near tie or an error\n", dir,
                   i, c_tok, lc[c_tok], g_tok, lc[g_tok]);
        }
        if (step(&rc, &c_tok, 1, 20 + i, lc, &err) < 0 || step(&rg, &g_tok, 1, 20 + i, lg, &err) < 0) {
            KN_EXPECT(0, "%s: decode %d: %s", dir, i, err.msg);
            goto out;
        }
        c_tok = argmax(lc, V), g_tok = argmax(lg, V);
    }
    if (c_tok != g_tok && diverged < 0) diverged = 32;
    KN_EXPECT(diverged < 0, "%s: greedy continuation diverges at token %d", dir, diverged);
    printf("%s: prompt logits max|diff| %.3g (max|logit| %.3g, ratio %.2g), top-5 %s, greedy 32 tokens %s\n", dir, md,
           mx, md / mx, memcmp(tc, tg, sizeof tc) ? "DIFFER" : "identical", diverged < 0 ? "identical" : "DIFFER");
out:
    free(lc), free(lg);
    model_destroy(rc.m);
    model_destroy(rg.m);
}

int main(void) {
    kn_harness_require_gpu();
    setenv("SPECD_CPU_ISA", "portable", 1);
    cpu = bk_cpu_create(0);
    /* arena bound check first: an arena that cannot hold the backend's own buffers is refused */
    specd_err err = {{0}};
    bk_cuda_opts tiny = {.device = 0, .arena_bytes = 4096, .max_tokens = 128, .max_seqs = 8, .max_len = 4096,
                         .block_size = 16, .max_heads = 8, .max_head_dim = 64};
    backend *t = bk_cuda_create(&tiny, &err);
    KN_EXPECT(!t && strstr(err.msg, "arena"), "a 4 KiB arena must be refused naming it (got %s)", err.msg);
    bk_cuda_destroy(t);
    const char *mb = getenv("SPECD_CUDA_TEST_ARENA_MB"); /* default 2 GiB (the twin's 270 MB + KV + workspace) */
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)(mb && atoi(mb) > 0 ? atoi(mb) : 2048) << 20, .max_tokens = TMAX, .max_seqs = 8,
                      .max_len = 4096, .block_size = 16, .max_heads = 16, .max_head_dim = 128};
    gpu = bk_cuda_create(&o, &err);
    if (!cpu || !gpu) {
        printf("FAIL: backends: %s\n", err.msg);
        return 1;
    }
    printf("%s; reference %s\n", bk_cuda_describe(gpu), bk_cpu_describe(cpu));
    test_ops();
    const char *list = getenv("SPECD_CUDA_TEST_MODELS");
    char buf[8192] = "";
    if (list) snprintf(buf, sizeof buf, "%s", list);
    else {
        const char *mini = getenv("MODEL_HF_MINI_DIR"), *twin = getenv("SPECD_TWIN_DIR");
        int o2 = 0;
        if (mini)
            o2 += snprintf(buf + o2, sizeof buf - (size_t)o2, "%s/f32:%s/bf16:%s/sharded:%s/mistral", mini, mini, mini, mini);
        if (twin) o2 += snprintf(buf + o2, sizeof buf - (size_t)o2, "%s%s/smollm2_twin", o2 ? ":" : "", twin);
    }
    int n_models = 0;
    for (char *s = strtok(buf, ":"); s; s = strtok(NULL, ":")) {
        struct stat st;
        if (stat(s, &st) != 0) { printf("model %s: absent, skipped\n", s); continue; }
        test_model(s);
        n_models++;
    }
    printf("models checked: %d\n", n_models);
    /* part 3: sampling on the device through the engine */
    const char *mini = getenv("MODEL_HF_MINI_DIR");
    char path[4096];
    struct stat st3;
    snprintf(path, sizeof path, "%s/f32", mini ? mini : "");
    if (mini && stat(path, &st3) == 0) {
        model_load_opts mo = {.block_size = EG_BS, .n_blocks = 64};
        model *mc = NULL, *md = NULL;
        if (model_load(path, cpu, &mo, &mc, &err) || model_load(path, gpu, &mo, &md, &err)) {
            KN_EXPECT(0, "%s: %s", path, err.msg);
        } else {
            eg_scenarios(mc, md, gpu);
            kn_fails += eg_fail;
        }
        model_destroy(mc), model_destroy(md);
    } else {
        printf("part 3 (device sampling): %s absent, skipped\n", path);
    }
    bk_cuda_destroy(gpu);
    bk_cpu_destroy(cpu);
    if (kn_fails) printf("FAILED: %d checks\n", kn_fails);
    else printf("OK\n");
    return kn_fails ? 1 : 0;
}
