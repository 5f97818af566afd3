/*
 * kn_mla.cu: absorbed MLA attention on the paged bf16 latent cache and the
 * latent write (kn_mla.h has the semantics, the layout and the error rules).
 *
 * Pass 1, kn_mla_partial_kernel: one CTA of 256 threads (8 warps) per (token
 * t, head group g of 8 heads, split of KN_MLA_SPLIT = 64 positions p0 ..
 * p0 + n - 1); a CTA whose split starts past pos[t] exits at once.
 *   setup    the split's row offsets (block table looked up once per
 *            position; -1 = not read: tree-masked or a bad block entry, which
 *            also flags the CTA bad) and the group's q rows in shared memory,
 *            each 64-dim chunk stored [even dims | odd dims] so that lane l's
 *            pair (64j + 2l, 64j + 2l + 1) sits at 64j + l and 64j + 32 + l
 *            (conflict-free);
 *   scores   warp w takes positions 4w .. 4w + 3 (and + 32): lane l loads the
 *            bf16 pair (64j + 2l, +1) of each of the 4 latent rows, j = 0, 1,
 *            ... in order (one 128-byte coalesced segment per row and chunk:
 *            each row is read from memory once, for all 8 heads), and keeps 32
 *            partial dot products acc[h][s] += q_h[d] k_s[d] (fmaf, d then
 *            d + 1); a reduce-scatter butterfly (xor 16, 8, 4, 2, 1: 31
 *            shuffles) leaves in lane l the full sum of (head l / 4, position
 *            slot l % 4), each summed over the same lane tree whatever its
 *            index; s = sum * scale, -inf for positions not read;
 *   softmax  warp h (head h of the group): m = max over the split, e = expf(s
 *            - m) (0 for -inf), l = sum of e over a FIXED shape (lane: e[l] +
 *            e[l + 32], then the xor butterfly), zeros past n;
 *   PV       thread j owns dims 2j, 2j + 1 of c_kv (kvl <= 512) for the 8
 *            heads: o[h][d] = fmaf(e_h,p, c_kv_p[d], o) for p in position
 *            order (the rows come from L1/L2: read from HBM once above);
 *   and writes (o[kvl], m, l) per head to the scratch at (t, head, split).
 * Pass 2, kn_mla_merge_kernel: one CTA per (token, head), as kn_attn's merge:
 *   M = max_s m_s, L = sum_s l_s expf(m_s - M), out[d] = (sum_s o_s[d]
 *   expf(m_s - M)) / L, splits in order, all-masked splits (m = -inf)
 *   skipped, NaN if any split was bad.
 * Every sum has an order fixed by kvl + r, KN_MLA_SPLIT and the token's own
 * position; the head grouping and the position slot only decide which lane
 * or warp does the same arithmetic. So a (token, head) row is the same bits
 * whatever shares its batch (BATCH INVARIANCE).
 *
 * Arithmetic intensity: at 8 heads a latent row (1,152 bytes) costs 8 x (576 +
 * 512) FMAs: about what an H200's CUDA cores do in the time HBM delivers the
 * row, so decode is near the bandwidth bound only with every SM busy, and a
 * verify of 4 tokens is compute-bound on CUDA cores (each token's CTAs re-read
 * the rows from L2). Hence the second pass-1 kernel,
 * kn_mla_partial_mma_kernel: the same CTA, rows, masks, softmax statistics,
 * scratch and merge, with the two products on tensor cores (mma.sync
 * m16n8k16 bf16 -> f32; q and the weights p split into bf16 hi + lo, both
 * multiplied; the 8 heads fill half of the 16 A rows). Its comment says more.
 * Which one the model uses is for kn_mla_bench on a GPU to decide.
 *
 * Scratch: part_o f32 [T, n_heads, n_split, kvl], then part_m and part_l f32
 * [T, n_heads, n_split], n_split = ceil(max_len / KN_MLA_SPLIT).
 *
 * Threading: launchers are called from one host thread per stream; no state.
 */
#include <climits>
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/kn_mla.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;                       /* 8 */
constexpr int kHG = KN_MLA_HEADS_PER_CTA;                   /* heads per CTA */
constexpr int kSlots = 4;                                   /* positions per warp per pass */
constexpr int kPasses = KN_MLA_SPLIT / (kWarps * kSlots);   /* 2 */
constexpr int kMaxChunks = KN_MLA_MAX_LATENT / 64;          /* 9 chunks of 64 dims */
static_assert(kHG * kSlots == 32, "the reduce-scatter leaves one (head, slot) sum per lane");
static_assert(kWarps == kHG, "softmax: one warp per head of the group");
static_assert(KN_MLA_SPLIT == 64, "softmax: each lane takes positions l and l + 32");
static_assert(KN_MLA_SPLIT % (kWarps * kSlots) == 0, "whole passes");
static_assert(KN_MLA_MAX_KVL == 2 * kThreads, "PV: one dim pair per thread");
static_assert(KN_MLA_MAX_LATENT % 64 == 0, "whole chunks");

int32_t n_splits(int32_t max_len) { return (max_len + KN_MLA_SPLIT - 1) / KN_MLA_SPLIT; }

/* bf16 pair packed little-endian in a u32 (element 2i in the low half), widened exactly. */
__device__ __forceinline__ float kn_bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float kn_bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

/* f32 -> bf16, round to nearest even; NaN stays a quiet NaN (bk_f32_to_bf16's bits). */
__device__ __forceinline__ uint16_t kn_bf16_rne(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__device__ __forceinline__ float kn_warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float kn_warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

#if defined(KN_EMU_DEVICE_HPP)
/* tools/kn_emu (every thread a fiber): the warp's fragments through a table, then each lane computes its
 * own four D elements from the PTX ISA's m16n8k16 layouts (sequential f32 FMAs; the hardware's internal
 * order differs, a fixed order either way). */
inline void kn_emu_mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                            uint32_t b1) {
    static uint32_t fa[1024][4], fb[1024][2];
    const unsigned me = threadIdx.x, base = me & ~31u, lane = me & 31u;
    fa[me][0] = a0, fa[me][1] = a1, fa[me][2] = a2, fa[me][3] = a3, fb[me][0] = b0, fb[me][1] = b1;
    kn_emu_syncwarp();
    auto half = [](uint32_t w, int hi) { return __uint_as_float((hi ? w >> 16 : w & 0xffffu) << 16); };
    /* A (16 x 16, row): a0 rows 0-7 / cols 0-7, a1 rows 8-15, a2 cols 8-15, a3 both; lane = 4 row + col / 2 */
    auto A = [&](int r, int k) {
        return half(fa[base + (r & 7) * 4 + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)], k & 1);
    };
    /* B (16 x 8, col): b0 rows (k) 0-7, b1 rows 8-15; lane = 4 n + k / 2 */
    auto B = [&](int k, int n) { return half(fb[base + n * 4 + ((k & 7) >> 1)][k >> 3], k & 1); };
    const int g = (int)(lane >> 2), t = (int)(lane & 3);
    float d[4];
    for (int e = 0; e < 4; e++) { /* c0, c1: row g, cols 2t, 2t + 1; c2, c3: row g + 8 */
        const int r = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float acc = c[e];
        for (int k = 0; k < 16; k++) acc = fmaf(A(r, k), B(k, col), acc);
        d[e] = acc;
    }
    kn_emu_syncwarp();
    for (int e = 0; e < 4; e++) c[e] = d[e];
}
#endif

/* D = A B + D, one warp: A bf16 16 x 16 (row-major fragments a0..a3), B bf16 16 x 8 (column-major
 * fragments b0, b1), D f32 16 x 8 (c0..c3); each u32 holds two bf16, the lower index in the low half
 * (PTX ISA, mma.m16n8k16 .bf16). */
__device__ __forceinline__ void kn_mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#elif defined(KN_EMU_DEVICE_HPP)
    kn_emu_mma_bf16(c, a0, a1, a2, a3, b0, b1);
#endif
}

/* x ~= hi + lo, both bf16 (RNE): 16 significant bits between them, relative error <= 2^-17. */
__device__ __forceinline__ void kn_split_bf16(float x, uint32_t &hi, uint32_t &lo) {
    hi = kn_bf16_rne(x);
    lo = kn_bf16_rne(x - __uint_as_float(hi << 16));
}

__device__ __forceinline__ bool kn_token_ok(const kn_attn_batch &b, int32_t pos, int32_t seq) {
    return pos >= 0 && pos < b.max_len && seq >= 0 && seq < b.n_seqs;
}

/* Element offset of slot (seq, p) in the pool, or -1 when the block table
 * entry is unusable (logical block past the row, physical id outside the pool). */
__device__ __forceinline__ int64_t kn_row_off(const kn_mla_cache &c, const int32_t *bt_row, int32_t bt_stride,
                                              int32_t p) {
    const int32_t lb = p / c.block_size;
    if (lb >= bt_stride) return -1;
    const int32_t blk = bt_row[lb];
    if (blk < 0 || blk >= c.n_blocks) return -1;
    const int64_t slot = (int64_t)blk * c.block_size + (int64_t)(p % c.block_size);
    return slot * (int64_t)(c.kv_lora_rank + c.rope_dim);
}

/* The split's row offsets into roff[KN_MLA_SPLIT] (shared): the element offset of position p0 + i's latent
 * row, or -1 when it is not read (i >= n, hidden from token t by the tree mask, or a bad block entry, which
 * also sets sm_bad). The tree rule: a position held by in-step tokens of seq is decided by the FIRST of them
 * (the CPU's lookup). Called by all threads of the CTA; ends with a barrier. */
__device__ __forceinline__ void kn_mla_rows(const kn_mla_cache &c, const kn_attn_batch &b, int32_t t, int32_t seq,
                                            int32_t p0, int32_t n, int64_t *roff, uint8_t *msk, int &sm_bad) {
    const int tid = (int)threadIdx.x;
    const int32_t *bt_row = b.block_tables + (size_t)seq * (size_t)b.bt_stride;
    for (int i = tid; i < KN_MLA_SPLIT; i += kThreads) msk[i] = 0;
    if (tid == 0) sm_bad = 0;
    __syncthreads();
    if (b.tree_mask) {
        const int32_t T = b.n_tokens;
        const uint8_t *mrow = b.tree_mask + (size_t)t * (size_t)T;
        for (int32_t u = tid; u < T; u += kThreads) {
            const int32_t pu = b.pos[u];
            if (b.seq_of[u] != seq || pu < p0 || pu >= p0 + n || mrow[u]) continue;
            bool first = true;
            for (int32_t u2 = 0; u2 < u && first; u2++) first = !(b.seq_of[u2] == seq && b.pos[u2] == pu);
            if (first) msk[pu - p0] = 1;
        }
        __syncthreads();
    }
    for (int i = tid; i < KN_MLA_SPLIT; i += kThreads) {
        int64_t ro = -1;
        if (i < n && !msk[i]) {
            ro = kn_row_off(c, bt_row, b.bt_stride, p0 + i);
            if (ro < 0) sm_bad = 1;
        }
        roff[i] = ro;
    }
    __syncthreads();
}

/* The split's softmax statistics, warp = head of the group: sc[h][i] (scores, i < n) -> pe[i][h] = expf(s -
 * m) (0 for -inf and past n), sm_m[h] = m, sm_l[h] = sum of pe over a fixed shape (lane: e[l] + e[l + 32],
 * then the xor butterfly). Ends with a barrier. */
__device__ __forceinline__ void kn_mla_softmax(const float (*sc)[KN_MLA_SPLIT], int32_t n, float (*pe)[kHG],
                                               float *sm_m, float *sm_l) {
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, hh = warp;
    const float a = lane < n ? sc[hh][lane] : -INFINITY, a2 = lane + 32 < n ? sc[hh][lane + 32] : -INFINITY;
    const float mx = kn_warp_max(fmaxf(a, a2));
    const float e = (mx == -INFINITY || a == -INFINITY) ? 0.0f : expf(a - mx);
    const float e2 = (mx == -INFINITY || a2 == -INFINITY) ? 0.0f : expf(a2 - mx);
    pe[lane][hh] = e;
    pe[lane + 32][hh] = e2;
    const float l = kn_warp_sum(e + e2);
    if (lane == 0) sm_m[hh] = mx, sm_l[hh] = l;
    __syncthreads();
}

/* One CTA per token: its latent row, rounded to bf16, into the slot. */
__global__ void __launch_bounds__(128) kn_mla_write_kernel(kn_mla_cache c, kn_attn_batch b, const float *lat) {
    const int32_t t = (int32_t)blockIdx.x;
    const int32_t pos = b.pos[t], seq = b.seq_of[t];
    if (!kn_token_ok(b, pos, seq)) return;
    if (b.tree_mask) /* a later in-step token with the same slot wins (the CPU's last memcpy) */
        for (int32_t u = t + 1; u < b.n_tokens; u++)
            if (b.seq_of[u] == seq && b.pos[u] == pos) return;
    const int64_t off = kn_row_off(c, b.block_tables + (size_t)seq * (size_t)b.bt_stride, b.bt_stride, pos);
    if (off < 0) return;
    const int32_t D = c.kv_lora_rank + c.rope_dim;
    const float *src = lat + (size_t)t * (size_t)D;
    uint16_t *dst = c.lat + off;
    for (int32_t i = (int32_t)threadIdx.x; i < D; i += 128) dst[i] = kn_bf16_rne(src[i]);
}

__global__ void __launch_bounds__(kThreads) kn_mla_partial_kernel(kn_mla_cache c, kn_attn_batch b, const float *q,
                                                                  int32_t n_heads, float scale, int32_t n_split,
                                                                  float *part_o, float *part_m, float *part_l) {
    __shared__ float qs[kHG * KN_MLA_MAX_LATENT]; /* [head][chunk][even dims | odd dims] */
    __shared__ float sc[kHG][KN_MLA_SPLIT];       /* scores */
    __shared__ float pe[KN_MLA_SPLIT][kHG];       /* exp weights, [position][head] */
    __shared__ int64_t roff[KN_MLA_SPLIT];        /* element offset of each row, -1 = not read */
    __shared__ uint8_t msk[KN_MLA_SPLIT];         /* 1 = hidden by the tree mask */
    __shared__ float sm_m[kHG], sm_l[kHG];
    __shared__ int sm_bad;

    const int32_t t = (int32_t)blockIdx.x, split = (int32_t)blockIdx.y, h0 = (int32_t)blockIdx.z * kHG;
    const int32_t pos = b.pos[t], seq = b.seq_of[t];
    const int32_t p0 = split * KN_MLA_SPLIT;
    if (!kn_token_ok(b, pos, seq) || p0 > pos) return; /* the merge pass writes NaN for bad tokens */
    const int32_t n = min(pos + 1 - p0, KN_MLA_SPLIT);  /* positions p0 .. p0 + n - 1 */
    const int32_t nh = min(kHG, n_heads - h0);          /* heads h0 .. h0 + nh - 1 */
    const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int32_t kvl = c.kv_lora_rank, D = kvl + c.rope_dim;
    const int32_t nch = (D + 63) / 64, Dp = nch * 64; /* chunks; padded q row in shared */

    /* q rows of the group, permuted per chunk, zeros past D and for absent heads */
    const float *qg = q + ((size_t)t * (size_t)n_heads + (size_t)h0) * (size_t)D;
    for (int32_t i = tid; i < kHG * Dp; i += kThreads) {
        const int32_t hh = i / Dp, k = i % Dp, j = k / 64, w = k % 64;
        const int32_t d = 64 * j + (w < 32 ? 2 * w : 2 * (w - 32) + 1);
        qs[i] = (hh < nh && d < D) ? qg[(size_t)hh * (size_t)D + (size_t)d] : 0.0f;
    }
    kn_mla_rows(c, b, t, seq, p0, n, roff, msk, sm_bad);

    /* scores: 4 positions per warp per pass, all heads of the group from one read of each row */
    const uint16_t *lat = c.lat;
    for (int pass = 0; pass < kPasses; pass++) {
        const int ib = pass * (kWarps * kSlots) + warp * kSlots; /* this warp's first position (split index) */
        int64_t ro[kSlots];
#pragma unroll
        for (int s = 0; s < kSlots; s++) ro[s] = ib + s < n ? roff[ib + s] : -1;
        float v[kHG * kSlots]; /* v[h * kSlots + s] */
#pragma unroll
        for (int i = 0; i < kHG * kSlots; i++) v[i] = 0.0f;
        for (int32_t j = 0; j < kMaxChunks; j++) {
            if (j >= nch) break;
            const int32_t d0 = 64 * j + 2 * lane;
            float k0[kSlots], k1[kSlots];
#pragma unroll
            for (int s = 0; s < kSlots; s++) {
                uint32_t u = 0;
                if (ro[s] >= 0 && d0 < D) u = *reinterpret_cast<const uint32_t *>(lat + ro[s] + d0);
                k0[s] = kn_bf16_lo(u);
                k1[s] = kn_bf16_hi(u);
            }
#pragma unroll
            for (int h = 0; h < kHG; h++) {
                const float qa = qs[h * Dp + 64 * j + lane], qb = qs[h * Dp + 64 * j + 32 + lane];
#pragma unroll
                for (int s = 0; s < kSlots; s++) {
                    v[h * kSlots + s] = fmaf(qa, k0[s], v[h * kSlots + s]);
                    v[h * kSlots + s] = fmaf(qb, k1[s], v[h * kSlots + s]);
                }
            }
        }
        /* reduce-scatter over the 32 lanes: after level w, slot i holds value i + (bits of lane >= w) */
#pragma unroll
        for (int w = 16; w >= 1; w >>= 1) {
            const bool up = (lane & w) != 0;
#pragma unroll
            for (int i = 0; i < w; i++) {
                const float send = up ? v[i] : v[i + w];
                const float keep = up ? v[i + w] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, w);
            }
        }
        const int hh = lane / kSlots, i = ib + lane % kSlots; /* lane holds value index lane */
        if (i < n) sc[hh][i] = roff[i] < 0 ? -INFINITY : v[0] * scale;
    }
    __syncthreads();

    kn_mla_softmax(sc, n, pe, sm_m, sm_l);

    /* PV on the c_kv half: thread tid owns dims 2 tid, 2 tid + 1 for every head of the group */
    const int32_t dp = 2 * tid;
    float o[kHG][2];
#pragma unroll
    for (int h = 0; h < kHG; h++) o[h][0] = o[h][1] = 0.0f;
    if (dp < kvl) {
#pragma unroll 4
        for (int32_t i = 0; i < n; i++) {
            const int64_t r = roff[i];
            const uint32_t u = r >= 0 ? *reinterpret_cast<const uint32_t *>(lat + r + dp) : 0u;
            const float v0 = kn_bf16_lo(u), v1 = kn_bf16_hi(u);
#pragma unroll
            for (int h = 0; h < kHG; h++) {
                const float e = pe[i][h]; /* 0 for a position not read */
                o[h][0] = fmaf(e, v0, o[h][0]);
                o[h][1] = fmaf(e, v1, o[h][1]);
            }
        }
    }
    const bool bad = sm_bad != 0;
#pragma unroll
    for (int h = 0; h < kHG; h++) {
        if (h >= nh) break;
        const size_t ps = ((size_t)t * (size_t)n_heads + (size_t)(h0 + h)) * (size_t)n_split + (size_t)split;
        if (dp < kvl) {
            part_o[ps * (size_t)kvl + (size_t)dp] = bad ? NAN : o[h][0];
            part_o[ps * (size_t)kvl + (size_t)dp + 1] = bad ? NAN : o[h][1];
        }
        if (tid == 0) {
            part_m[ps] = bad ? NAN : sm_m[h];
            part_l[ps] = bad ? NAN : sm_l[h];
        }
    }
}

/* The same partial pass on tensor cores (kn_mla_attention_mma): per CTA the scores S [8 heads (+ 8 empty
 * rows) x 64 positions] = Q [16 x (kvl + r)] . L^T and the output O [16 x kvl] = P [16 x 64] . C_kv [64 x
 * kvl] as mma.m16n8k16 bf16 -> f32. q and the softmax weights p are f32: each is split into bf16 hi + lo
 * and both halves are multiplied (x.b = hi.b + lo.b: 16 significant bits of x, so the f32 accuracy of the
 * CUDA-core kernel within 2^-17 per product); the latent is bf16 already. Warp w: scores of positions
 * 8w .. 8w + 7 over ceil((kvl + r) / 16) k-steps (B fragments straight from the latent rows: each row read
 * from memory once for the 8 heads), then O's dims 64w .. 64w + 63 over the 4 k-steps of 16 positions.
 * A row's result depends only on its own q (or p) row and the latent: the empty rows and the other heads
 * never enter it, so batch invariance holds as in the CUDA-core kernel (not the same bits as that kernel). */
constexpr int kQPairs = KN_MLA_MAX_LATENT / 2 + 4; /* u32 pairs per head row in shared, padded: conflict-free */
constexpr int kPPairs = KN_MLA_SPLIT / 2 + 4;
static_assert(KN_MLA_SPLIT == 8 * kWarps, "scores: one 8-position n-tile per warp");
static_assert(KN_MLA_MAX_KVL == 64 * kWarps, "PV: 64 dims (8 n-tiles) per warp");

__global__ void __launch_bounds__(kThreads) kn_mla_partial_mma_kernel(kn_mla_cache c, kn_attn_batch b,
                                                                      const float *q, int32_t n_heads, float scale,
                                                                      int32_t n_split, float *part_o, float *part_m,
                                                                      float *part_l) {
    __shared__ uint32_t qh[kHG * kQPairs], ql[kHG * kQPairs]; /* q rows as bf16 pairs, hi and lo */
    __shared__ uint32_t ph[kHG * kPPairs], pl[kHG * kPPairs]; /* softmax weights as bf16 pairs, hi and lo */
    __shared__ float sc[kHG][KN_MLA_SPLIT];
    __shared__ float pe[KN_MLA_SPLIT][kHG];
    __shared__ int64_t roff[KN_MLA_SPLIT];
    __shared__ uint8_t msk[KN_MLA_SPLIT];
    __shared__ float sm_m[kHG], sm_l[kHG];
    __shared__ int sm_bad;

    const int32_t t = (int32_t)blockIdx.x, split = (int32_t)blockIdx.y, h0 = (int32_t)blockIdx.z * kHG;
    const int32_t pos = b.pos[t], seq = b.seq_of[t];
    const int32_t p0 = split * KN_MLA_SPLIT;
    if (!kn_token_ok(b, pos, seq) || p0 > pos) return;
    const int32_t n = min(pos + 1 - p0, KN_MLA_SPLIT);
    const int32_t nh = min(kHG, n_heads - h0);
    const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
    const int32_t kvl = c.kv_lora_rank, D = kvl + c.rope_dim, nks = (D + 15) / 16;

    const float *qg = q + ((size_t)t * (size_t)n_heads + (size_t)h0) * (size_t)D;
    for (int32_t i = tid; i < kHG * (KN_MLA_MAX_LATENT / 2); i += kThreads) {
        const int32_t hh = i / (KN_MLA_MAX_LATENT / 2), j = i % (KN_MLA_MAX_LATENT / 2), d = 2 * j;
        const float x0 = (hh < nh && d < D) ? qg[(size_t)hh * (size_t)D + (size_t)d] : 0.0f;
        const float x1 = (hh < nh && d + 1 < D) ? qg[(size_t)hh * (size_t)D + (size_t)d + 1] : 0.0f;
        uint32_t h0b, l0b, h1b, l1b;
        kn_split_bf16(x0, h0b, l0b);
        kn_split_bf16(x1, h1b, l1b);
        qh[hh * kQPairs + j] = h0b | (h1b << 16);
        ql[hh * kQPairs + j] = l0b | (l1b << 16);
    }
    kn_mla_rows(c, b, t, seq, p0, n, roff, msk, sm_bad);

    /* scores: warp w, positions 8w + g (B column g), k-steps of 16 dims; rows 8..15 of A are empty */
    const uint16_t *lat = c.lat;
    {
        const int64_t ro = roff[8 * warp + g]; /* -1 past n */
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int32_t ks = 0; ks < nks; ks++) {
            const int32_t d0 = 16 * ks + 2 * t4;
            const uint32_t b0 = (ro >= 0 && d0 < D) ? *reinterpret_cast<const uint32_t *>(lat + ro + d0) : 0u;
            const uint32_t b1 = (ro >= 0 && d0 + 8 < D) ? *reinterpret_cast<const uint32_t *>(lat + ro + d0 + 8) : 0u;
            const int qa = g * kQPairs + 8 * ks + t4;
            kn_mma_bf16(acc, qh[qa], 0u, qh[qa + 4], 0u, b0, b1);
            kn_mma_bf16(acc, ql[qa], 0u, ql[qa + 4], 0u, b0, b1);
        }
        /* acc[0], acc[1]: head g, positions 8w + 2 t4, + 1 */
        for (int e = 0; e < 2; e++) {
            const int i = 8 * warp + 2 * t4 + e;
            if (i < n) sc[g][i] = roff[i] < 0 ? -INFINITY : acc[e] * scale;
        }
    }
    __syncthreads();
    kn_mla_softmax(sc, n, pe, sm_m, sm_l);
    {
        const int hh = tid / 32, j = tid % 32; /* 8 heads x 32 position pairs = 256 threads */
        uint32_t h0b, l0b, h1b, l1b;
        kn_split_bf16(pe[2 * j][hh], h0b, l0b);
        kn_split_bf16(pe[2 * j + 1][hh], h1b, l1b);
        ph[hh * kPPairs + j] = h0b | (h1b << 16);
        pl[hh * kPPairs + j] = l0b | (l1b << 16);
    }
    __syncthreads();

    /* PV: warp w, dims 64w .. 64w + 63 as 8 n-tiles; B = C_kv [positions x dims]: b0 = the dim-(g) values of
     * positions 16 ks + 2 t4 and + 1, b1 = positions + 8 (2-byte loads; the rows are in L1 / L2 by now) */
    const bool bad = sm_bad != 0;
    if (64 * warp < kvl) {
        uint32_t ah[4][2], al[4][2];
#pragma unroll
        for (int ks = 0; ks < 4; ks++) {
            const int pa = g * kPPairs + 8 * ks + t4;
            ah[ks][0] = ph[pa], ah[ks][1] = ph[pa + 4], al[ks][0] = pl[pa], al[ks][1] = pl[pa + 4];
        }
        for (int nt = 0; nt < 8; nt++) {
            const int32_t dn = 64 * warp + 8 * nt + g; /* this lane's B column */
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                uint32_t v[4];
#pragma unroll
                for (int e = 0; e < 4; e++) { /* positions 16 ks + 2 t4 + {0, 1, 8, 9} */
                    const int64_t r = roff[16 * ks + 2 * t4 + (e & 1) + 8 * (e >> 1)];
                    v[e] = (r >= 0 && dn < kvl) ? (uint32_t)lat[r + dn] : 0u;
                }
                const uint32_t b0 = v[0] | (v[1] << 16), b1 = v[2] | (v[3] << 16);
                kn_mma_bf16(acc, ah[ks][0], 0u, ah[ks][1], 0u, b0, b1);
                kn_mma_bf16(acc, al[ks][0], 0u, al[ks][1], 0u, b0, b1);
            }
            /* acc[0], acc[1]: head g, dims 64w + 8 nt + 2 t4, + 1 */
            const int32_t d = 64 * warp + 8 * nt + 2 * t4;
            if (g < nh && d < kvl) {
                const size_t ps = ((size_t)t * (size_t)n_heads + (size_t)(h0 + g)) * (size_t)n_split + (size_t)split;
                part_o[ps * (size_t)kvl + (size_t)d] = bad ? NAN : acc[0];
                part_o[ps * (size_t)kvl + (size_t)d + 1] = bad ? NAN : acc[1];
            }
        }
    }
    if (tid < nh) {
        const size_t ps = ((size_t)t * (size_t)n_heads + (size_t)(h0 + tid)) * (size_t)n_split + (size_t)split;
        part_m[ps] = bad ? NAN : sm_m[tid];
        part_l[ps] = bad ? NAN : sm_l[tid];
    }
}

__global__ void __launch_bounds__(128) kn_mla_merge_kernel(kn_attn_batch b, int32_t n_heads, int32_t kvl,
                                                           int32_t n_split, const float *part_o, const float *part_m,
                                                           const float *part_l, float *out) {
    const int32_t th = (int32_t)blockIdx.x;
    const int32_t t = th / n_heads;
    const int32_t pos = b.pos[t], seq = b.seq_of[t];
    float *oh = out + (size_t)th * (size_t)kvl;
    if (!kn_token_ok(b, pos, seq)) {
        for (int32_t d = (int32_t)threadIdx.x; d < kvl; d += 128) oh[d] = NAN;
        return;
    }
    const int32_t ns = pos / KN_MLA_SPLIT + 1;
    const size_t base = (size_t)th * (size_t)n_split;
    float M = -INFINITY;
    bool bad = false;
    for (int32_t i = 0; i < ns; i++) {
        const float mi = part_m[base + i];
        bad = bad || isnan(mi);
        M = fmaxf(M, mi);
    }
    float L = 0.0f;
    for (int32_t i = 0; i < ns; i++) {
        const float mi = part_m[base + i];
        if (mi == -INFINITY) continue;
        L += part_l[base + i] * expf(mi - M);
    }
    for (int32_t d = (int32_t)threadIdx.x; d < kvl; d += 128) {
        float acc = 0.0f;
        for (int32_t i = 0; i < ns; i++) {
            const float mi = part_m[base + i];
            if (mi == -INFINITY) continue;
            acc += part_o[(base + i) * (size_t)kvl + (size_t)d] * expf(mi - M);
        }
        oh[d] = bad ? NAN : acc / L; /* all masked: 0 / 0 = NaN, as the CPU */
    }
}

int kn_mla_check(const kn_mla_cache *c, const kn_attn_batch *b) {
    if (!c || !b || b->n_tokens < 0) return (int)cudaErrorInvalidValue;
    if (b->n_tokens == 0) return 0;
    if (!c->lat || ((uintptr_t)c->lat & 3u) != 0 || !b->pos || !b->seq_of || !b->block_tables)
        return (int)cudaErrorInvalidValue;
    if (c->block_size <= 0 || c->n_blocks <= 0 || c->kv_lora_rank < 2 || c->kv_lora_rank > KN_MLA_MAX_KVL ||
        c->kv_lora_rank % 2 != 0 || c->rope_dim < 0 || c->rope_dim % 2 != 0 ||
        c->kv_lora_rank + c->rope_dim > KN_MLA_MAX_LATENT)
        return (int)cudaErrorInvalidValue;
    if (b->bt_stride <= 0 || b->n_seqs <= 0 || b->max_len <= 0) return (int)cudaErrorInvalidValue;
    return 0;
}

}  // namespace

extern "C" int kn_mla_latent_write(const kn_mla_cache *c, const kn_attn_batch *b, const float *lat, void *stream) {
    int rc = kn_mla_check(c, b);
    if (rc != 0 || b->n_tokens == 0) return rc;
    if (!lat) return (int)cudaErrorInvalidValue;
    kn_mla_write_kernel<<<(unsigned)b->n_tokens, 128, 0, (cudaStream_t)stream>>>(*c, *b, lat);
    return (int)cudaGetLastError();
}

extern "C" size_t kn_mla_scratch_bytes(int32_t T, int32_t n_heads, int32_t max_len, int32_t kv_lora_rank) {
    if (T <= 0 || n_heads <= 0 || max_len <= 0 || kv_lora_rank <= 0) return 0;
    const size_t f = (size_t)T * (size_t)n_heads * (size_t)n_splits(max_len) * ((size_t)kv_lora_rank + 2);
    return (f * sizeof(float) + 255) / 256 * 256;
}

namespace {
int kn_mla_launch(bool mma, const kn_mla_cache *c, const kn_attn_batch *b, const float *q, int32_t n_heads,
                  float scale, float *out, void *scratch, size_t scratch_bytes, void *stream) {
    int rc = kn_mla_check(c, b);
    if (rc != 0 || b->n_tokens == 0) return rc;
    if (!q || !out || !scratch || n_heads <= 0) return (int)cudaErrorInvalidValue;
    if ((int64_t)b->n_tokens * n_heads > INT_MAX) return (int)cudaErrorInvalidValue;
    const int32_t ns = n_splits(b->max_len), ng = (n_heads + kHG - 1) / kHG;
    if (ns > 65535 || ng > 65535) return (int)cudaErrorInvalidValue; /* grid y / z limits: max_len <= 4.19 M */
    if (scratch_bytes < kn_mla_scratch_bytes(b->n_tokens, n_heads, b->max_len, c->kv_lora_rank))
        return (int)cudaErrorInvalidValue;
    const int32_t kvl = c->kv_lora_rank;
    const size_t parts = (size_t)b->n_tokens * (size_t)n_heads * (size_t)ns;
    float *part_o = (float *)scratch;
    float *part_m = part_o + parts * (size_t)kvl;
    float *part_l = part_m + parts;
    cudaStream_t st = (cudaStream_t)stream;
    const dim3 grid((unsigned)b->n_tokens, (unsigned)ns, (unsigned)ng);
    if (mma)
        kn_mla_partial_mma_kernel<<<grid, kThreads, 0, st>>>(*c, *b, q, n_heads, scale, ns, part_o, part_m, part_l);
    else
        kn_mla_partial_kernel<<<grid, kThreads, 0, st>>>(*c, *b, q, n_heads, scale, ns, part_o, part_m, part_l);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    kn_mla_merge_kernel<<<(unsigned)(b->n_tokens * n_heads), 128, 0, st>>>(*b, n_heads, kvl, ns, part_o, part_m,
                                                                         part_l, out);
    return (int)cudaGetLastError();
}
}  // namespace

extern "C" int kn_mla_attention(const kn_mla_cache *c, const kn_attn_batch *b, const float *q, int32_t n_heads,
                                float scale, float *out, void *scratch, size_t scratch_bytes, void *stream) {
    return kn_mla_launch(false, c, b, q, n_heads, scale, out, scratch, scratch_bytes, stream);
}

extern "C" int kn_mla_attention_mma(const kn_mla_cache *c, const kn_attn_batch *b, const float *q, int32_t n_heads,
                                    float scale, float *out, void *scratch, size_t scratch_bytes, void *stream) {
    return kn_mla_launch(true, c, b, q, n_heads, scale, out, scratch, scratch_bytes, stream);
}
