/*
 * kn_moe.h: the DeepSeek-V3 / Kimi-K2.5 MoE block on the device (issue 19):
 * noaux_tc routing, the grouped int4 group-32 expert GEMMs (gate/up fused
 * with SiLU x up, then down) and the fixed-order combine; plus the host-side
 * repacking of compressed-tensors experts into the layout the kernels read
 * (kernels/kn_moe_pack.c, plain C: built and tested without CUDA).
 *
 * Conventions: kernels/kn.h (device pointers, explicit shapes, `void *stream`,
 * return 0 or a cudaError_t, never allocate or synchronise, graph-capturable,
 * batch invariant). The CPU reference is engine/model/deepseek_v3_fwd.c
 * (dsv3_route, moe_forward) over the CPU backend's BK_W_I4G32 matmul;
 * docs/kimi-k2.5.md "MoE kernels" states layout, rounding and order.
 *
 * ---------------------------------------------------------------- layout
 * compressed-tensors (the checkpoint, BK_W_I4G32): weight_packed int32
 * [rows, cols/8], element c of a row in word c/8 at bits 4(c%8).. (low nibble
 * first), stored offset-binary u = q + 8, q in [-8, 7]; weight_scale bf16
 * [rows, cols/32]; value = bf16(q x scale), round to nearest even.
 *
 * KN_I4IL ("interleaved", what the kernels read): the same words, rows and
 * scales, with the 8 nibbles of every word permuted so that elements 2p and
 * 2p+1 of the word sit at bits 4p and 16 + 4p (p = 0..3): slot j of the word
 * (bits 4j..4j+3) holds element [0, 2, 4, 6, 1, 3, 5, 7][j] -- the u4b8
 * interleave of Marlin (vLLM csrc/quantization/marlin), offset kept. Then
 * `((word >> 4p) & 0x000F000F) | 0x43004300` is a bf16 pair (128 + u_2p,
 * 128 + u_2p+1) exactly; one bf16x2 fma subtracts 136 (exact: q), one more
 * multiplies by the scale pair with a single round-to-nearest-even: exactly
 * compressed-tensors' bf16(q x scale), two values per instruction. Scales
 * are not changed (bf16 [rows, cols/32], read one per lane per group).
 * A row of cols values is cols/2 bytes: group g (32 values) is the 16 bytes
 * at 16g, one 16-byte load.
 *
 * One layer's experts (kn_moe_weights): E experts, hidden H, intermediate I
 * (the rank's slice at TP: moe_intermediate / tp, engine/model/tp_shard.c):
 *   w13 u32 [E][2I][H/8]  rows 0..I-1 gate_proj, I..2I-1 up_proj (KN_I4IL)
 *   s13 u16 [E][2I][H/32] their bf16 scales
 *   w2  u32 [E][H][I/8]   down_proj (KN_I4IL)
 *   s2  u16 [E][H][I/32]
 * H % 32 == 0 and I % 32 == 0 (group 32; Kimi TP 8: H 7168, I 256).
 */
#ifndef SPECD_KERNELS_KN_MOE_H
#define SPECD_KERNELS_KN_MOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* --------------------------------------------------------- host: packing
 * kernels/kn_moe_pack.c. No CUDA; pure functions over caller buffers. */

/* Slot j of a KN_I4IL word holds element KN_I4IL_ORDER[j] of the word. */
extern const int KN_I4IL_ORDER[8];

/* out[rows, cols/8] (KN_I4IL) = in[rows, cols/8] (compressed-tensors words).
 * cols % 32 == 0, rows >= 1; -1 otherwise (nothing written). in == out is
 * allowed (word by word). */
int kn_i4_repack(const uint32_t *in, int64_t rows, int64_t cols, uint32_t *out);

/* The inverse: compressed-tensors words from KN_I4IL words (same contract). */
int kn_i4_unpack(const uint32_t *in, int64_t rows, int64_t cols, uint32_t *out);

/* Dequantizes row `row` of a KN_I4IL matrix: out bf16 bits [cols] =
 * bf16(q x scale) (round to nearest even; inf/NaN scales give the f32
 * product's top half). scales: bf16 bits [rows, cols/32]. The host reference
 * of the device's dequantisation. */
void kn_i4il_dequant_row(const uint32_t *il, const uint16_t *scales, int64_t cols, int64_t row, uint16_t *out);

/* One layer's repacked experts (layout above). Host or device pointers
 * depending on where they are used; never owned. */
typedef struct kn_moe_weights {
    int32_t E, H, I;
    const uint32_t *w13; /* [E][2I][H/8] */
    const uint16_t *s13; /* [E][2I][H/32] */
    const uint32_t *w2;  /* [E][H][I/8] */
    const uint16_t *s2;  /* [E][H][I/32] */
    /* Expert parallelism: these E experts are routed experts [e0, e0 + E) of E_route (the ids kn_moe_route
     * gives); 0, 0: all of them (e0 = 0, E_route = E). 0 <= e0, e0 + E <= E_route <= KN_MOE_MAX_E. */
    int32_t e0, E_route;
} kn_moe_weights;

/* Element counts of the four arrays of kn_moe_weights (u32 words, u16 scales). */
size_t kn_moe_w13_words(int32_t E, int32_t H, int32_t I);
size_t kn_moe_s13_count(int32_t E, int32_t H, int32_t I);
size_t kn_moe_w2_words(int32_t E, int32_t H, int32_t I);
size_t kn_moe_s2_count(int32_t E, int32_t H, int32_t I);

/* Repacks expert e's compressed-tensors tensors (gate/up: words [I, H/8],
 * scales [I, H/32]; down: words [H, I/8], scales [H, I/32]; each row-major
 * with no padding, e.g. the rank's TP slices) into its place in the host
 * arrays w13/s13/w2/s2 of a layer of E experts. -1 on a bad shape. */
int kn_moe_pack_expert(int32_t E, int32_t H, int32_t I, int32_t e, const uint32_t *gate_w, const uint16_t *gate_s,
                       const uint32_t *up_w, const uint16_t *up_s, const uint32_t *down_w, const uint16_t *down_s,
                       uint32_t *w13, uint16_t *s13, uint32_t *w2, uint16_t *s2);

/* ------------------------------------------------------- device: routing */

typedef struct kn_moe_route_cfg {
    int32_t E;            /* n_routed_experts, 1..4096 */
    int32_t k;            /* num_experts_per_tok, 1..64, <= E */
    int32_t n_group;      /* >= 1, divides E, <= 1024 */
    int32_t topk_group;   /* 1..n_group (n_group when not limiting) */
    int32_t norm_topk_prob;
    float routed_scaling; /* routed_scaling_factor */
} kn_moe_route_cfg;

/* noaux_tc routing of T tokens, dsv3_route's semantics and arithmetic:
 * logits f32 [T, E] (the router matmul), bias f32 [E] (e_score_correction_
 * bias) -> ids int32 [T, k] (selection order, best first), w f32 [T, k].
 * s = 1 / (1 + e^-logit) with e^-logit = (float)exp((double)-logit) (the
 * correctly rounded expf: equal to glibc's expf except where glibc is off by
 * its last-bit error, < 0.502 ulp); choice = s + bias; n_group > 1 and
 * topk_group < n_group: group score = sum of its two best choices, all but
 * the topk_group best groups masked to -inf; top-k by choice (ties: lower
 * id; a total order on finite and infinite values, so the parallel argmax
 * equals the CPU's sequential loop); weights = s / (sum of the k s in
 * selection order + 1e-20) if norm_topk_prob, times routed_scaling, in f32
 * with the CPU's roundings. NaN logits or biases: unspecified choice (never
 * out of range). One warp per token; no state. */
int kn_moe_route(const float *logits, const float *bias, int32_t T, const kn_moe_route_cfg *cfg, int32_t *ids,
                 float *w, void *stream);

/* ------------------------------------------------ device: routed experts */

/* Bytes of the workspace of kn_moe_experts for T tokens (256-aligned parts). */
size_t kn_moe_workspace_bytes(int32_t T, int32_t k, int32_t E, int32_t H, int32_t I);

/* y[T, H] = sum over the k chosen experts of token t, in ascending expert id,
 * of w[t, j] x down_e(silu(gate_e(x_t)) * up_e(x_t)), then + shared[t]
 * (skipped when shared == NULL) -- moe_forward's order and roundings:
 * y = 0; y += ye * w (product rounded, then the sum); y += shared.
 * Expert parallelism (wt->e0, wt->E_route): the sum runs over the chosen ids
 * in [e0, e0 + E) only (local expert id - e0); a chosen id of another rank
 * (in [0, E_route) outside that range) adds nothing.
 *   wt: device kn_moe_weights (KN_I4IL); x f32 [T, H] (16-byte aligned);
 *   ids int32 [T, k] (from kn_moe_route or any source: an id outside
 *   [0, E_route) or an expert chosen twice by one token is refused ON THE
 *   DEVICE: that token's y row is NaN, and *bad_flag = 1 when bad_flag !=
 *   NULL);
 *   wts f32 [T, k]; shared f32 [T, H] or NULL (the shared expert's output,
 *   from kn_matmul / kn_silu_mul); ws: workspace of kn_moe_workspace_bytes
 *   (256-byte aligned); y f32 [T, H], must not alias x or shared.
 * Kernels: align (one block: per-expert token lists in ascending token
 * order), gate/up (grid: I row tiles x min(E, T*k) expert slots; a slot
 * past the number of active experts exits), down (H row tiles x the same),
 * combine. Batch invariance: every dot product is one lane sequence + a
 * fixed butterfly fixed by the weight shape (kn_moe.cu), the combine order
 * by expert id: a token's y row does not depend on T or on the other
 * tokens. silu(g) = g / (1 + e^-g) with e^-g as in kn_moe_route.
 * T <= 65535, k <= 64 (cudaErrorInvalidValue otherwise). The align kernel is
 * one block that scans all T*k slots per expert: built for decode / verify
 * sizes, slow for long prefills (a sort-based align would be needed there). */
int kn_moe_experts(const kn_moe_weights *wt, const float *x, const int32_t *ids, const float *wts, int32_t T,
                   int32_t k, const float *shared, void *ws, size_t ws_bytes, float *y, int32_t *bad_flag,
                   void *stream);

/* Device dequantisation of the whole matrix `which` (0: w13 of expert e,
 * [2I, H]; 1: w2 of expert e, [H, I]) to bf16 bits out [rows, cols], with
 * the GEMM kernels' own dequantisation code (tests: bit-identity with the
 * host's kn_i4il_dequant_row and compressed-tensors). */
int kn_moe_dequant(const kn_moe_weights *wt, int32_t e, int which, uint16_t *out, void *stream);

#ifdef __cplusplus
}
#endif

#endif
