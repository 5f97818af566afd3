/*
 * test_kn_attn.c: kn_kv_write and kn_attention (kernels/kn_attn.h) against
 * the CPU backend's kv_write / attention, on random data.
 *
 * Four shapes: SmolLM2 (9 heads over 3 KV heads, head_dim 64, GQA 3), Llama
 * (8 over 2, head_dim 128), the DeepSeek MLA absorbed form (8 heads over one
 * KV head of 576, K and V one plane) and plain multi-head 4 x 80. Five sequences with contexts 5,
 * 130, 300, 600 and 1000 positions (1..4 splits of KN_ATTN_SPLIT = 256),
 * block tables shuffled over the pool. K, V and q of (seq, pos) are a hash of
 * (seq, pos), so whatever batch writes a slot writes the same values.
 *   1. fill: one batch of every (seq, pos) in shuffled order through both
 *      kv_writes; the two pools must be bitwise equal.
 *   2. T in {1, 2, 3, 4, 5, 8, 16, 33, 128}: a mixed batch (decode rows,
 *      verify rows of 4 and 3, a prefill chunk; interleaved or grouped)
 *      written then attended on both sides: pools bitwise equal, outputs
 *      within NMSE 1e-8 of the CPU. Bound: both sides compute in f32 with
 *      different association (warp-strided dot products and a per-split
 *      softmax rescaled at the merge, vs sequential / 8-lane FMA dot products
 *      and double sums), a relative error of ~1e-6 per element at worst,
 *      NMSE ~1e-12; a wrong position, head, split or mask moves whole
 *      softmax weights, NMSE >= ~1e-4.
 *   3. batch invariance, bitwise: every token of every batch above again
 *      alone (T = 1, and max_len = pos + 1, a different grid and scratch
 *      layout): same bits as inside the batch.
 *   4. tree mask (T = 8): sibling drafts at the same position, a chain,
 *      random mask bits across sequences (must be ignored), per-token K/V
 *      (the slot keeps the last writer): pools bitwise, NMSE as above.
 *   5. bad metadata: a token with seq_of out of range writes nothing and
 *      attends to NaN.
 * Argument refusals (no GPU needed) run before the GPU probe.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "engine/backend/backend.h"
#include "kernels/kn_attn.h"
#include "tests/kernels/kn_harness.h"


#define NMSE_BOUND 1e-8
#define N_SEQS 5
#define ROOM 130 /* positions past each context that batches may write */



typedef struct shape {
    const char *name;
    int32_t n_heads, n_kv_heads, head_dim, block_size;
    int one_plane; /* K and V are one plane (MLA latent) */
} shape;

typedef struct world {
    shape sh;
    int32_t ctx[N_SEQS], fill[N_SEQS];
    int32_t n_blocks, bt_stride, max_len, row; /* row = n_kv_heads * head_dim */
    int32_t *bt;                /* host [N_SEQS, bt_stride] */
    const int32_t *bt_rows[N_SEQS];
    float *hk, *hv;             /* CPU pools */
    float *dk, *dv;             /* device pools */
    int32_t *d_bt;
    backend *cpu;
    /* step buffers, sized for cap tokens */
    int32_t cap;
    float *q, *kin, *vin, *out_cpu, *out_gpu, *pool_copy;
    int32_t *d_pos, *d_seq;
    uint8_t *d_mask;
    float *d_q, *d_kin, *d_vin, *d_out;
    void *d_scratch;
    size_t scratch_bytes;
} world;

static size_t pool_floats(const world *w) { return (size_t)w->n_blocks * w->sh.block_size * w->row; }

static void gen_q(const world *w, int32_t seq, int32_t pos, float *q) {
    const int32_t n = w->sh.n_heads * w->sh.head_dim;
    for (int32_t i = 0; i < n; i++) q[i] = 2.0f * kn_hval(1, (uint64_t)seq, (uint64_t)pos, (uint64_t)i);
}
static void gen_kv(const world *w, int32_t seq, int32_t pos, float *k, float *v) {
    for (int32_t i = 0; i < w->row; i++) {
        k[i] = kn_hval(2, (uint64_t)seq, (uint64_t)pos, (uint64_t)i);
        v[i] = w->sh.one_plane ? k[i] : kn_hval(3, (uint64_t)seq, (uint64_t)pos, (uint64_t)i);
    }
}

static void world_create(world *w, shape sh) {
    memset(w, 0, sizeof *w);
    w->sh = sh;
    const int32_t ctx[N_SEQS] = {5, 130, 300, 600, 1000};
    w->row = sh.n_kv_heads * sh.head_dim;
    int32_t total = 0, maxnb = 0;
    for (int s = 0; s < N_SEQS; s++) {
        w->ctx[s] = ctx[s];
        w->fill[s] = ctx[s] + ROOM;
        if (w->fill[s] > w->max_len) w->max_len = w->fill[s];
        int32_t nb = (w->fill[s] + sh.block_size - 1) / sh.block_size;
        total += nb;
        if (nb > maxnb) maxnb = nb;
    }
    w->n_blocks = total + 7;
    w->bt_stride = maxnb + 3;
    w->bt = malloc((size_t)N_SEQS * w->bt_stride * sizeof *w->bt);
    int32_t *perm = malloc((size_t)w->n_blocks * sizeof *perm);
    for (int32_t i = 0; i < w->n_blocks; i++) perm[i] = i;
    for (int32_t i = w->n_blocks - 1; i > 0; i--) { /* Fisher-Yates, hashed */
        int32_t j = (int32_t)(kn_mix64(0xB10C + (uint64_t)i) % (uint64_t)(i + 1));
        int32_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
    }
    int32_t next = 0;
    for (int s = 0; s < N_SEQS; s++) {
        int32_t nb = (w->fill[s] + sh.block_size - 1) / sh.block_size;
        for (int32_t j = 0; j < w->bt_stride; j++) w->bt[s * w->bt_stride + j] = j < nb ? perm[next++] : -1;
        w->bt_rows[s] = w->bt + s * w->bt_stride;
    }
    free(perm);
    const size_t pf = pool_floats(w);
    w->hk = calloc(pf, sizeof(float));
    w->hv = sh.one_plane ? w->hk : calloc(pf, sizeof(float));
    KN_CK(cudaMalloc((void **)&w->dk, pf * sizeof(float)));
    KN_CK(cudaMemset(w->dk, 0, pf * sizeof(float)));
    if (sh.one_plane) {
        w->dv = w->dk;
    } else {
        KN_CK(cudaMalloc((void **)&w->dv, pf * sizeof(float)));
        KN_CK(cudaMemset(w->dv, 0, pf * sizeof(float)));
    }
    KN_CK(cudaMalloc((void **)&w->d_bt, (size_t)N_SEQS * w->bt_stride * sizeof(int32_t)));
    KN_CK(cudaMemcpy(w->d_bt, w->bt, (size_t)N_SEQS * w->bt_stride * sizeof(int32_t), cudaMemcpyHostToDevice));
    w->cpu = bk_cpu_create(0);
    if (!w->cpu) { fprintf(stderr, "bk_cpu_create failed\n"); exit(1); }

    int32_t cap = 0;
    for (int s = 0; s < N_SEQS; s++) cap += w->fill[s];
    w->cap = cap;
    const size_t qn = (size_t)cap * sh.n_heads * sh.head_dim, kn = (size_t)cap * w->row;
    w->q = malloc(qn * sizeof(float));
    w->kin = malloc(kn * sizeof(float));
    w->vin = malloc(kn * sizeof(float));
    w->out_cpu = malloc(qn * sizeof(float));
    w->out_gpu = malloc(qn * sizeof(float));
    w->pool_copy = malloc(pf * sizeof(float));
    KN_CK(cudaMalloc((void **)&w->d_pos, (size_t)cap * sizeof(int32_t)));
    KN_CK(cudaMalloc((void **)&w->d_seq, (size_t)cap * sizeof(int32_t)));
    KN_CK(cudaMalloc((void **)&w->d_mask, (size_t)cap * cap));
    KN_CK(cudaMalloc((void **)&w->d_q, qn * sizeof(float)));
    KN_CK(cudaMalloc((void **)&w->d_kin, kn * sizeof(float)));
    KN_CK(cudaMalloc((void **)&w->d_vin, kn * sizeof(float)));
    KN_CK(cudaMalloc((void **)&w->d_out, qn * sizeof(float)));
    w->scratch_bytes = kn_attn_scratch_bytes(128, sh.n_heads, w->max_len, sh.head_dim);
    KN_CK(cudaMalloc(&w->d_scratch, w->scratch_bytes));
    if (!w->hk || !w->hv || !w->q || !w->kin || !w->vin || !w->out_cpu || !w->out_gpu || !w->pool_copy) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
    }
}

static void world_destroy(world *w) {
    bk_cpu_destroy(w->cpu);
    if (w->hv != w->hk) free(w->hv);
    free(w->hk);
    free(w->bt);
    free(w->q), free(w->kin), free(w->vin), free(w->out_cpu), free(w->out_gpu), free(w->pool_copy);
    if (w->dv != w->dk) cudaFree(w->dv);
    cudaFree(w->dk);
    cudaFree(w->d_bt), cudaFree(w->d_pos), cudaFree(w->d_seq), cudaFree(w->d_mask);
    cudaFree(w->d_q), cudaFree(w->d_kin), cudaFree(w->d_vin), cudaFree(w->d_out), cudaFree(w->d_scratch);
}

static bk_kv_layer cpu_kv(const world *w) {
    return (bk_kv_layer){w->hk, w->hv, w->sh.block_size, w->sh.n_kv_heads, w->sh.head_dim, w->n_blocks, NULL, NULL};
}
static kn_paged_kv gpu_kv(const world *w) {
    return (kn_paged_kv){w->dk, w->dv, w->sh.block_size, w->sh.n_kv_heads, w->sh.head_dim, w->n_blocks};
}

/* Uploads the step (seq_of, pos, k, v, q, mask) and runs kv_write (+ attention
 * when attend) on both sides; q/k/v already in w->q / kin / vin. */
static void run_step(world *w, int32_t T, const int32_t *seq_of, const int32_t *pos, const uint8_t *mask,
                     int attend, int32_t max_len) {
    const size_t qn = (size_t)T * w->sh.n_heads * w->sh.head_dim, kn = (size_t)T * w->row;
    bk_attn_meta m = {T, pos, seq_of, w->bt_rows, N_SEQS, mask, NULL};
    bk_kv_layer ckv = cpu_kv(w);
    const float scale = 1.0f / sqrtf((float)w->sh.head_dim);
    /* the CPU backend's tensors are host memory: its ops take wrapped host arrays */
    bk_tensor kt = bk_wrap_f32(w->kin, T, w->row), vt = bk_wrap_f32(w->sh.one_plane ? w->kin : w->vin, T, w->row);
    bk_tensor qt = bk_wrap_f32(w->q, T, (int64_t)w->sh.n_heads * w->sh.head_dim);
    bk_tensor ot = bk_wrap_f32(w->out_cpu, T, (int64_t)w->sh.n_heads * w->sh.head_dim);
    w->cpu->ops->kv_write(w->cpu->ctx, &ckv, &m, &kt, &vt);
    if (attend) w->cpu->ops->attention(w->cpu->ctx, &ckv, &m, &qt, w->sh.n_heads, scale, &ot);

    KN_CK(cudaMemcpy(w->d_pos, pos, (size_t)T * sizeof(int32_t), cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(w->d_seq, seq_of, (size_t)T * sizeof(int32_t), cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(w->d_kin, w->kin, kn * sizeof(float), cudaMemcpyHostToDevice));
    if (!w->sh.one_plane) KN_CK(cudaMemcpy(w->d_vin, w->vin, kn * sizeof(float), cudaMemcpyHostToDevice));
    if (mask) KN_CK(cudaMemcpy(w->d_mask, mask, (size_t)T * T, cudaMemcpyHostToDevice));
    kn_paged_kv gkv = gpu_kv(w);
    kn_attn_batch b = {T, w->d_pos, w->d_seq, w->d_bt, w->bt_stride, N_SEQS, mask ? w->d_mask : NULL, max_len};
    KN_CK(kn_kv_write(&gkv, &b, w->d_kin, w->sh.one_plane ? w->d_kin : w->d_vin, NULL));
    if (attend) {
        KN_CK(cudaMemcpy(w->d_q, w->q, qn * sizeof(float), cudaMemcpyHostToDevice));
        KN_CK(cudaMemset(w->d_out, 0xff, qn * sizeof(float))); /* NaN: an unwritten output cannot pass */
        KN_CK(kn_attention(&gkv, &b, w->d_q, w->sh.n_heads, scale, w->d_out, w->d_scratch, w->scratch_bytes, NULL));
        KN_CK(cudaMemcpy(w->out_gpu, w->d_out, qn * sizeof(float), cudaMemcpyDeviceToHost));
    }
    KN_CK(cudaDeviceSynchronize());
}

/* GPU pools == CPU pools, bitwise. */
static void check_pools(world *w, const char *what) {
    const size_t pf = pool_floats(w);
    KN_CK(cudaMemcpy(w->pool_copy, w->dk, pf * sizeof(float), cudaMemcpyDeviceToHost));
    KN_EXPECT(memcmp(w->pool_copy, w->hk, pf * sizeof(float)) == 0, "%s %s: K pool differs from the CPU's", w->sh.name,
           what);
    if (!w->sh.one_plane) {
        KN_CK(cudaMemcpy(w->pool_copy, w->dv, pf * sizeof(float), cudaMemcpyDeviceToHost));
        KN_EXPECT(memcmp(w->pool_copy, w->hv, pf * sizeof(float)) == 0, "%s %s: V pool differs from the CPU's",
               w->sh.name, what);
    }
}

static double check_out(world *w, int32_t T, const char *what) {
    const size_t qn = (size_t)T * w->sh.n_heads * w->sh.head_dim;
    int finite = 1;
    for (size_t i = 0; i < qn; i++) finite &= isfinite(w->out_gpu[i]) != 0;
    double e = kn_nmse(w->out_gpu, w->out_cpu, qn);
    KN_EXPECT(finite, "%s %s: non-finite GPU output", w->sh.name, what);
    KN_EXPECT(e < NMSE_BOUND, "%s %s: NMSE %.3g >= %.0e", w->sh.name, what, e, NMSE_BOUND);
    return e;
}

/* Step 1: every (seq, pos) of the fill, in shuffled order. */
static void test_fill(world *w) {
    int32_t T = 0;
    int32_t *seq_of = malloc((size_t)w->cap * sizeof *seq_of), *pos = malloc((size_t)w->cap * sizeof *pos);
    for (int s = 0; s < N_SEQS; s++)
        for (int32_t p = 0; p < w->fill[s]; p++) seq_of[T] = s, pos[T] = p, T++;
    for (int32_t i = T - 1; i > 0; i--) {
        int32_t j = (int32_t)(kn_mix64(0xF111 + (uint64_t)i) % (uint64_t)(i + 1));
        int32_t a = seq_of[i], b = pos[i];
        seq_of[i] = seq_of[j], pos[i] = pos[j], seq_of[j] = a, pos[j] = b;
    }
    for (int32_t t = 0; t < T; t++) gen_kv(w, seq_of[t], pos[t], w->kin + (size_t)t * w->row, w->vin + (size_t)t * w->row);
    run_step(w, T, seq_of, pos, NULL, 0, w->max_len);
    check_pools(w, "fill");
    free(seq_of), free(pos);
}

/* Batch of T tokens: runs per sequence {1, 4, 1 + extra, 3, 1} (decode,
 * verify k=3, decode or prefill chunk, verify k=2, decode), truncated to T;
 * odd T interleaves the runs token by token, even T groups them. */
static void build_batch(const world *w, int32_t T, int32_t *seq_of, int32_t *pos) {
    const int32_t want[N_SEQS] = {1, 4, 1, 3, 1};
    int32_t run[N_SEQS], left = T;
    for (int s = 0; s < N_SEQS; s++) {
        run[s] = want[s] < left ? want[s] : left;
        left -= run[s];
    }
    run[2] += left;
    int32_t n = 0, done[N_SEQS] = {0};
    if (T % 2) {
        while (n < T)
            for (int s = 0; s < N_SEQS; s++)
                if (done[s] < run[s]) seq_of[n] = s, pos[n] = w->ctx[s] + done[s]++, n++;
    } else {
        for (int s = 0; s < N_SEQS; s++)
            for (int32_t j = 0; j < run[s]; j++) seq_of[n] = s, pos[n] = w->ctx[s] + j, n++;
    }
}

static void test_batches(world *w) {
    static const int32_t Ts[] = {1, 2, 3, 4, 5, 8, 16, 33, 128};
    const size_t hrow = (size_t)w->sh.n_heads * w->sh.head_dim;
    float *batch_out = malloc(128 * hrow * sizeof(float));
    int32_t seq_of[128], pos[128];
    int n_inv = 0, n_inv_bad = 0;
    double worst = 0;
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
        const int32_t T = Ts[ti];
        build_batch(w, T, seq_of, pos);
        for (int32_t t = 0; t < T; t++) {
            gen_q(w, seq_of[t], pos[t], w->q + (size_t)t * hrow);
            gen_kv(w, seq_of[t], pos[t], w->kin + (size_t)t * w->row, w->vin + (size_t)t * w->row);
        }
        run_step(w, T, seq_of, pos, NULL, 1, w->max_len);
        char what[32];
        snprintf(what, sizeof what, "T=%d", T);
        check_pools(w, what);
        double e = check_out(w, T, what);
        if (e > worst) worst = e;
        memcpy(batch_out, w->out_gpu, (size_t)T * hrow * sizeof(float));
        /* each token alone, with a grid sized for its own position only */
        for (int32_t t = 0; t < T; t++) {
            gen_q(w, seq_of[t], pos[t], w->q);
            gen_kv(w, seq_of[t], pos[t], w->kin, w->vin);
            run_step(w, 1, &seq_of[t], &pos[t], NULL, 1, pos[t] + 1);
            n_inv++;
            if (memcmp(w->out_gpu, batch_out + (size_t)t * hrow, hrow * sizeof(float)) != 0) {
                n_inv_bad++;
                if (n_inv_bad <= 5)
                    printf("FAIL %s T=%d token %d (seq %d pos %d): alone != inside the batch\n", w->sh.name, T, t,
                           seq_of[t], pos[t]);
            }
        }
    }
    KN_EXPECT(n_inv_bad == 0, "%s: %d of %d tokens not batch invariant", w->sh.name, n_inv_bad, n_inv);
    printf("%s: T in {1..128} mixed batches: worst NMSE %.3g (bound %.0e); %d of %d tokens bitwise batch invariant\n",
           w->sh.name, worst, NMSE_BOUND, n_inv - n_inv_bad, n_inv);
    free(batch_out);
}

/* Tree step, T = 8: seq 1 root r at c1, siblings a and a2 both at c1 + 1, a2's
 * child at c1 + 2; seq 3 chain of 3 at c3; seq 0 decode at c0. Same-sequence
 * entries: t sees u iff u is an ancestor of t or t; other entries random. */
static void test_tree(world *w) {
    enum { T = 8 };
    const int32_t c0 = w->ctx[0], c1 = w->ctx[1], c3 = w->ctx[3];
    int32_t seq_of[T] = {1, 3, 1, 1, 3, 0, 1, 3};
    int32_t pos[T] = {c1, c3, c1 + 1, c1 + 1, c3 + 1, c0, c1 + 2, c3 + 2};
    /* parent within the step (-1 = root of its sequence's block) */
    int32_t parent[T] = {-1, -1, 0, 0, 1, -1, 3, 4};
    uint8_t mask[T * T];
    for (int t = 0; t < T; t++)
        for (int u = 0; u < T; u++) {
            int see = 0;
            if (seq_of[t] == seq_of[u]) {
                for (int a = t; a >= 0; a = parent[a]) see |= a == u;
            } else {
                see = (int)(kn_mix64(0x7EE + (uint64_t)(t * T + u)) & 1);
            }
            mask[t * T + u] = (uint8_t)see;
        }
    const size_t hrow = (size_t)w->sh.n_heads * w->sh.head_dim;
    for (int t = 0; t < T; t++) {
        for (size_t i = 0; i < hrow; i++) w->q[t * hrow + i] = 2.0f * kn_hval(11, (uint64_t)t, 0, i);
        for (int32_t i = 0; i < w->row; i++) {
            w->kin[(size_t)t * w->row + i] = kn_hval(12, (uint64_t)t, 0, (uint64_t)i);
            w->vin[(size_t)t * w->row + i] = kn_hval(13, (uint64_t)t, 0, (uint64_t)i);
        }
    }
    run_step(w, T, seq_of, pos, mask, 1, w->max_len);
    check_pools(w, "tree");
    double e = check_out(w, T, "tree");
    printf("%s: tree mask step (siblings at one position): NMSE %.3g\n", w->sh.name, e);
}

/* A token whose sequence index is out of range: nothing written, NaN out. */
static void test_bad_seq(world *w) {
    int32_t seq_of = N_SEQS, pos = 3;
    const size_t hrow = (size_t)w->sh.n_heads * w->sh.head_dim;
    gen_q(w, 0, 3, w->q);
    for (int32_t i = 0; i < w->row; i++) w->kin[i] = w->vin[i] = 1234.0f;
    const size_t pf = pool_floats(w);
    float *before = malloc(pf * sizeof(float));
    KN_CK(cudaMemcpy(before, w->dk, pf * sizeof(float), cudaMemcpyDeviceToHost));
    kn_paged_kv gkv = gpu_kv(w);
    KN_CK(cudaMemcpy(w->d_pos, &pos, sizeof pos, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(w->d_seq, &seq_of, sizeof seq_of, cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(w->d_kin, w->kin, (size_t)w->row * sizeof(float), cudaMemcpyHostToDevice));
    KN_CK(cudaMemcpy(w->d_q, w->q, hrow * sizeof(float), cudaMemcpyHostToDevice));
    kn_attn_batch b = {1, w->d_pos, w->d_seq, w->d_bt, w->bt_stride, N_SEQS, NULL, w->max_len};
    KN_CK(kn_kv_write(&gkv, &b, w->d_kin, w->d_kin, NULL));
    KN_CK(kn_attention(&gkv, &b, w->d_q, w->sh.n_heads, 0.125f, w->d_out, w->d_scratch, w->scratch_bytes, NULL));
    KN_CK(cudaMemcpy(w->out_gpu, w->d_out, hrow * sizeof(float), cudaMemcpyDeviceToHost));
    KN_CK(cudaMemcpy(w->pool_copy, w->dk, pf * sizeof(float), cudaMemcpyDeviceToHost));
    KN_EXPECT(memcmp(before, w->pool_copy, pf * sizeof(float)) == 0, "%s: bad seq_of wrote into the pool", w->sh.name);
    int all_nan = 1;
    for (size_t i = 0; i < hrow; i++) all_nan &= isnan(w->out_gpu[i]) != 0;
    KN_EXPECT(all_nan, "%s: bad seq_of did not give NaN", w->sh.name);
    free(before);
}

/* Launcher refusals: checked before any CUDA call, so they run without a GPU. */
static void test_refusals(void) {
    float *fake = (float *)(uintptr_t)0x1000;
    int32_t *ifake = (int32_t *)(uintptr_t)0x1000;
    kn_paged_kv kv = {fake, fake, 16, 2, 64, 10};
    kn_attn_batch b = {4, ifake, ifake, ifake, 8, 2, NULL, 300};
    size_t need = kn_attn_scratch_bytes(4, 8, 300, 64);
    KN_EXPECT(need == ((size_t)4 * 8 * 2 * 66 * 4 + 255) / 256 * 256, "scratch bytes %zu", need);
    const int inval = (int)cudaErrorInvalidValue;
    KN_EXPECT(kn_attention(&kv, &b, fake, 8, 1.0f, fake, fake, need - 1, NULL) == inval, "small scratch accepted");
    KN_EXPECT(kn_attention(&kv, &b, fake, 7, 1.0f, fake, fake, need, NULL) == inval, "7 heads over 2 KV heads accepted");
    kn_paged_kv big = kv;
    big.head_dim = KN_ATTN_MAX_HEAD_DIM + 1;
    KN_EXPECT(kn_attention(&big, &b, fake, 8, 1.0f, fake, fake, (size_t)1 << 30, NULL) == inval, "head_dim 577 accepted");
    kn_attn_batch nob = b;
    nob.block_tables = NULL;
    KN_EXPECT(kn_kv_write(&kv, &nob, fake, fake, NULL) == inval, "NULL block tables accepted");
    kn_paged_kv bs0 = kv;
    bs0.block_size = 0;
    KN_EXPECT(kn_kv_write(&bs0, &b, fake, fake, NULL) == inval, "block_size 0 accepted");
    kn_attn_batch empty = b;
    empty.n_tokens = 0;
    KN_EXPECT(kn_attention(&kv, &empty, fake, 8, 1.0f, fake, fake, 0, NULL) == 0, "T = 0 refused");
}

int main(void) {
    test_refusals();
    if (kn_fails) return 1;
    kn_harness_require_gpu();
    const shape shapes[] = {
        {"smollm2 9/3 x 64", 9, 3, 64, 16, 0},
        {"llama 8/2 x 128", 8, 2, 128, 16, 0},
        {"mla 8/1 x 576 k==v", 8, 1, 576, 64, 1},
        {"mha 4/4 x 80", 4, 4, 80, 32, 0}, /* head_dim not a multiple of 64, no GQA */
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        world w;
        world_create(&w, shapes[i]);
        test_fill(&w);
        test_batches(&w);
        test_bad_seq(&w);
        test_tree(&w); /* last: per-token K/V break the (seq, pos) -> values rule */
        world_destroy(&w);
    }
    printf("%s\n", kn_fails ? "FAILED" : "OK");
    return kn_fails ? 1 : 0;
}
