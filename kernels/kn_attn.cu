/*
 * kn_attn.cu: paged KV write and split-KV paged attention (kn_attn.h has the
 * semantics, the layout and the error rules).
 *
 * Pass 1, kn_attn_partial_kernel: one CTA of 128 threads per (token, query
 * head, split of KN_ATTN_SPLIT positions); a CTA whose split starts past the
 * token's position exits at once. Inside the split:
 *   scores   warp w takes positions w, w + 4, ...; lane l sums q[d] * k[d]
 *            over d = l, l + 32, ... in order, then a xor butterfly over the
 *            32 lanes (commutative at each level, so every lane holds the same
 *            sum); s = sum * scale; -inf for tree-masked positions;
 *   max      m = max over the split's scores (exact in any order);
 *   exp      e_i = expf(s_i - m) (0 for -inf);
 *   sum      l = sum of e_i over a FIXED shape: lane l adds entries 8l..8l+7
 *            in order (zeros past the split's end), then the butterfly;
 *   PV       thread j owns dims j, j + 128, ...: o[d] = sum_i e_i v_i[d] in
 *            position order (positions with e_i == 0 skipped, as the CPU does).
 *   It writes (o[head_dim], m, l) to the scratch at (token, head, split).
 * Pass 2, kn_attn_merge_kernel: one CTA per (token, head): M = max_s m_s,
 *   w_s = expf(m_s - M), L = sum_s l_s w_s, out[d] = (sum_s o_s[d] w_s) / L,
 *   splits in order 0, 1, ...; splits with m_s = -inf (all masked) skipped.
 * Every sum above has an order fixed by head_dim, KN_ATTN_SPLIT and the
 * token's own position; nothing reads another token's data except the tree
 * mask lookup (which only decides which of the token's own positions are
 * hidden). So a token's output is the same bits whatever shares its batch.
 *
 * Scratch: part_o f32 [T, n_heads, n_split, head_dim], then part_m and part_l
 * f32 [T, n_heads, n_split], n_split = ceil(max_len / KN_ATTN_SPLIT).
 *
 * Threading: launchers are called from one host thread per stream; no state.
 */
#include <climits>
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/kn_attn.h"

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kDimsPerThread = (KN_ATTN_MAX_HEAD_DIM + kThreads - 1) / kThreads; /* 5 */
constexpr int kSumPerLane = KN_ATTN_SPLIT / 32;                                  /* 8 */
static_assert(KN_ATTN_SPLIT % 32 == 0, "the split's fixed-shape sum gives each lane KN_ATTN_SPLIT/32 entries");

int32_t n_splits(int32_t max_len) { return (max_len + KN_ATTN_SPLIT - 1) / KN_ATTN_SPLIT; }

/* Start of slot (seq, p) in a plane, or NULL when the block table entry is
 * unusable (logical block past the row, physical id outside the pool). */
__device__ __forceinline__ const float *kn_slot(const float *plane, const kn_paged_kv &kv, const int32_t *bt_row,
                                                int32_t bt_stride, int32_t p, int32_t kvh) {
    const int32_t lb = p / kv.block_size;
    if (lb >= bt_stride) return nullptr;
    const int32_t blk = bt_row[lb];
    if (blk < 0 || blk >= kv.n_blocks) return nullptr;
    const size_t slot = (size_t)blk * (size_t)kv.block_size + (size_t)(p % kv.block_size);
    return plane + (slot * (size_t)kv.n_kv_heads + (size_t)kvh) * (size_t)kv.head_dim;
}

__device__ __forceinline__ float kn_warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float kn_warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ bool kn_token_ok(const kn_attn_batch &b, int32_t pos, int32_t seq) {
    return pos >= 0 && pos < b.max_len && seq >= 0 && seq < b.n_seqs;
}

/* One CTA per token: copies its K and V rows into the slot. */
__global__ void __launch_bounds__(kThreads) kn_kv_write_kernel(kn_paged_kv kv, kn_attn_batch b, const float *k,
                                                               const float *v) {
    const int32_t t = (int32_t)blockIdx.x;
    const int32_t pos = b.pos[t], seq = b.seq_of[t];
    if (!kn_token_ok(b, pos, seq)) return;
    if (b.tree_mask) /* a later in-step token with the same slot wins (the CPU's last memcpy) */
        for (int32_t u = t + 1; u < b.n_tokens; u++)
            if (b.seq_of[u] == seq && b.pos[u] == pos) return;
    const int32_t *bt_row = b.block_tables + (size_t)seq * (size_t)b.bt_stride;
    float *dk = const_cast<float *>(kn_slot(kv.k, kv, bt_row, b.bt_stride, pos, 0));
    if (!dk) return;
    float *dv = kv.v + (dk - kv.k);
    const size_t row = (size_t)kv.n_kv_heads * (size_t)kv.head_dim;
    const float *sk = k + (size_t)t * row, *sv = v + (size_t)t * row;
    const bool one_plane = kv.k == kv.v; /* CPU: K then V into the same floats: V stays */
    for (size_t i = threadIdx.x; i < row; i += kThreads) {
        if (!one_plane) dk[i] = sk[i];
        dv[i] = sv[i];
    }
}

__global__ void __launch_bounds__(kThreads) kn_attn_partial_kernel(kn_paged_kv kv, kn_attn_batch b, const float *q,
                                                                   int32_t n_heads, float scale, int32_t n_split,
                                                                   float *part_o, float *part_m, float *part_l) {
    __shared__ float qs[KN_ATTN_MAX_HEAD_DIM];
    __shared__ float s[KN_ATTN_SPLIT];   /* scores, then exp weights */
    __shared__ uint8_t msk[KN_ATTN_SPLIT]; /* 1 = hidden by the tree mask */
    __shared__ float sm_max, sm_sum;
    __shared__ int sm_bad;

    const int32_t th = (int32_t)blockIdx.x, split = (int32_t)blockIdx.y;
    const int32_t t = th / n_heads, h = th % n_heads;
    const int32_t pos = b.pos[t], seq = b.seq_of[t];
    const int32_t p0 = split * KN_ATTN_SPLIT;
    if (!kn_token_ok(b, pos, seq) || p0 > pos) return; /* the merge pass writes NaN for bad tokens */
    const int32_t n = min(pos + 1 - p0, KN_ATTN_SPLIT); /* positions p0 .. p0 + n - 1 */
    const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int32_t hd = kv.head_dim, kvh = h / (n_heads / kv.n_kv_heads);

    const float *qh = q + ((size_t)t * (size_t)n_heads + (size_t)h) * (size_t)hd;
    for (int32_t d = tid; d < hd; d += kThreads) qs[d] = qh[d];
    for (int i = tid; i < KN_ATTN_SPLIT; i += kThreads) msk[i] = 0;
    if (tid == 0) sm_bad = 0;
    __syncthreads();
    if (b.tree_mask) {
        /* positions of this split held by in-step tokens of seq that t must not see:
         * decided by the FIRST in-step token at that position (the CPU's lookup) */
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

    /* scores */
    const int32_t *bt_row = b.block_tables + (size_t)seq * (size_t)b.bt_stride;
    for (int32_t i = warp; i < n; i += kWarps) {
        float sc = -INFINITY;
        if (!msk[i]) {
            const float *kp = kn_slot(kv.k, kv, bt_row, b.bt_stride, p0 + i, kvh);
            if (!kp) {
                if (lane == 0) sm_bad = 1;
            } else {
                float acc = 0.0f;
                for (int32_t d = lane; d < hd; d += 32) acc += qs[d] * kp[d];
                sc = kn_warp_sum(acc) * scale;
            }
        }
        if (lane == 0) s[i] = sc;
    }
    __syncthreads();

    /* max, exp weights, their sum (fixed shape over KN_ATTN_SPLIT entries) */
    if (warp == 0) {
        float mx = -INFINITY;
        for (int j = 0; j < kSumPerLane; j++) {
            const int i = lane * kSumPerLane + j;
            if (i < n) mx = fmaxf(mx, s[i]);
        }
        mx = kn_warp_max(mx);
        if (lane == 0) sm_max = mx;
    }
    __syncthreads();
    const float mx = sm_max;
    for (int i = tid; i < n; i += kThreads) s[i] = (mx == -INFINITY || s[i] == -INFINITY) ? 0.0f : expf(s[i] - mx);
    __syncthreads();
    if (warp == 0) {
        float acc = 0.0f;
        for (int j = 0; j < kSumPerLane; j++) {
            const int i = lane * kSumPerLane + j;
            acc += i < n ? s[i] : 0.0f;
        }
        acc = kn_warp_sum(acc);
        if (lane == 0) sm_sum = acc;
    }

    /* PV in position order */
    float o[kDimsPerThread];
#pragma unroll
    for (int j = 0; j < kDimsPerThread; j++) o[j] = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        const float e = s[i];
        if (e == 0.0f) continue;
        const float *vp = kn_slot(kv.v, kv, bt_row, b.bt_stride, p0 + i, kvh);
        if (!vp) continue; /* flagged in the score pass */
#pragma unroll
        for (int j = 0; j < kDimsPerThread; j++) {
            const int32_t d = tid + j * kThreads;
            if (d < hd) o[j] += e * vp[d];
        }
    }
    __syncthreads(); /* sm_sum, sm_bad */
    const size_t ps = (size_t)th * (size_t)n_split + (size_t)split;
    const bool bad = sm_bad != 0;
#pragma unroll
    for (int j = 0; j < kDimsPerThread; j++) {
        const int32_t d = tid + j * kThreads;
        if (d < hd) part_o[ps * (size_t)hd + (size_t)d] = bad ? NAN : o[j];
    }
    if (tid == 0) {
        part_m[ps] = bad ? NAN : mx;
        part_l[ps] = bad ? NAN : sm_sum;
    }
}

__global__ void __launch_bounds__(kThreads) kn_attn_merge_kernel(kn_attn_batch b, int32_t n_heads, int32_t hd,
                                                                 int32_t n_split, const float *part_o,
                                                                 const float *part_m, const float *part_l, float *out) {
    const int32_t th = (int32_t)blockIdx.x;
    const int32_t t = th / n_heads;
    const int32_t pos = b.pos[t], seq = b.seq_of[t];
    float *oh = out + (size_t)th * (size_t)hd;
    if (!kn_token_ok(b, pos, seq)) {
        for (int32_t d = threadIdx.x; d < hd; d += kThreads) oh[d] = NAN;
        return;
    }
    const int32_t ns = pos / KN_ATTN_SPLIT + 1;
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
    for (int32_t d = threadIdx.x; d < hd; d += kThreads) {
        float acc = 0.0f;
        for (int32_t i = 0; i < ns; i++) {
            const float mi = part_m[base + i];
            if (mi == -INFINITY) continue;
            acc += part_o[(base + i) * (size_t)hd + (size_t)d] * expf(mi - M);
        }
        oh[d] = bad ? NAN : acc / L; /* all masked: 0 / 0 = NaN, as the CPU */
    }
}

int kn_check_common(const kn_paged_kv *kv, const kn_attn_batch *b) {
    if (!kv || !b || b->n_tokens < 0) return (int)cudaErrorInvalidValue;
    if (b->n_tokens == 0) return 0;
    if (!kv->k || !kv->v || !b->pos || !b->seq_of || !b->block_tables) return (int)cudaErrorInvalidValue;
    if (kv->block_size <= 0 || kv->n_kv_heads <= 0 || kv->head_dim <= 0 || kv->n_blocks <= 0)
        return (int)cudaErrorInvalidValue;
    if (b->bt_stride <= 0 || b->n_seqs <= 0 || b->max_len <= 0) return (int)cudaErrorInvalidValue;
    return 0;
}

}  // namespace

extern "C" int kn_kv_write(const kn_paged_kv *kv, const kn_attn_batch *b, const float *k, const float *v,
                           void *stream) {
    int rc = kn_check_common(kv, b);
    if (rc != 0 || b->n_tokens == 0) return rc;
    if (!k || !v) return (int)cudaErrorInvalidValue;
    kn_kv_write_kernel<<<(unsigned)b->n_tokens, kThreads, 0, (cudaStream_t)stream>>>(*kv, *b, k, v);
    return (int)cudaGetLastError();
}

extern "C" size_t kn_attn_scratch_bytes(int32_t T, int32_t n_heads, int32_t max_len, int32_t head_dim) {
    if (T <= 0 || n_heads <= 0 || max_len <= 0 || head_dim <= 0) return 0;
    size_t f = (size_t)T * (size_t)n_heads * (size_t)n_splits(max_len) * ((size_t)head_dim + 2);
    return (f * sizeof(float) + 255) / 256 * 256;
}

extern "C" int kn_attention(const kn_paged_kv *kv, const kn_attn_batch *b, const float *q, int32_t n_heads,
                            float scale, float *out, void *scratch, size_t scratch_bytes, void *stream) {
    int rc = kn_check_common(kv, b);
    if (rc != 0 || b->n_tokens == 0) return rc;
    if (!q || !out || !scratch || n_heads <= 0 || n_heads % kv->n_kv_heads != 0) return (int)cudaErrorInvalidValue;
    if (kv->head_dim > KN_ATTN_MAX_HEAD_DIM) return (int)cudaErrorInvalidValue;
    if ((int64_t)b->n_tokens * n_heads > INT_MAX) return (int)cudaErrorInvalidValue;
    const int32_t ns = n_splits(b->max_len);
    if (ns > 65535) return (int)cudaErrorInvalidValue; /* grid y limit: max_len <= 16.7 M */
    if (scratch_bytes < kn_attn_scratch_bytes(b->n_tokens, n_heads, b->max_len, kv->head_dim))
        return (int)cudaErrorInvalidValue;
    const size_t parts = (size_t)b->n_tokens * (size_t)n_heads * (size_t)ns;
    float *part_o = (float *)scratch;
    float *part_m = part_o + parts * (size_t)kv->head_dim;
    float *part_l = part_m + parts;
    const unsigned th = (unsigned)(b->n_tokens * n_heads);
    cudaStream_t st = (cudaStream_t)stream;
    kn_attn_partial_kernel<<<dim3(th, (unsigned)ns), kThreads, 0, st>>>(*kv, *b, q, n_heads, scale, ns, part_o,
                                                                       part_m, part_l);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    kn_attn_merge_kernel<<<th, kThreads, 0, st>>>(*b, n_heads, kv->head_dim, ns, part_o, part_m, part_l, out);
    return (int)cudaGetLastError();
}
