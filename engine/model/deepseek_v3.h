/*
 * deepseek_v3.h: the DeepSeek-V3 / Kimi-K2.5 target's private state, shared
 * by its loader (deepseek_v3.c), its forward pass (deepseek_v3_fwd.c) and the
 * tests. Not a public header: the engine sees only model.h.
 *
 * Architecture (DeepSeek-AI 2024, arXiv:2412.19437; HF DeepseekV3ForCausalLM;
 * the executable description is docs/kimi-k2.5.md + tools/kimi/numpy_forward.py):
 *   MLA attention with low-rank q and kv projections, decoupled RoPE (YaRN)
 *   on a per-head rope part, a latent KV cache of kv_lora_rank + rope values
 *   per token per layer; dense SwiGLU MLP for the first layers, then MoE with
 *   sigmoid router scores, an additive selection bias (noaux_tc), group
 *   limits, normalised top-k weights times routed_scaling_factor, and shared
 *   experts. Routed experts may be compressed-tensors int4 (BK_W_I4G32),
 *   used packed by the backend's matmul.
 * Threading: engine thread only.
 */
#ifndef SPECD_MODEL_DEEPSEEK_V3_H
#define SPECD_MODEL_DEEPSEEK_V3_H

#include <stdbool.h>

#include "engine/loader/safetensors.h"
#include "engine/model/hf_config.h"
#include "engine/model/model_internal.h"

/* transformers builds q_a_layernorm / kv_a_layernorm with its RMSNorm default
 * eps, not rms_norm_eps (docs/kimi-k2.5.md, "Note on eps"). */
#define DSV3_LORA_NORM_EPS 1e-6f

typedef struct dsv3_layer {
    float *attn_norm, *ffn_norm;   /* f32 [H] input_layernorm, post_attention_layernorm */
    /* MLA */
    bk_weight q_a;                 /* [q_lora, H]            (q_lora_rank > 0) */
    float *q_a_norm;               /* f32 [q_lora] */
    bk_weight q_b;                 /* [nh*(n+r), q_lora], or q_proj [nh*(n+r), H] when q_lora_rank == 0 */
    bk_weight kv_a;                /* [kvl + r, H] kv_a_proj_with_mqa */
    float *kv_a_norm;              /* f32 [kvl] */
    bk_weight kv_b;                /* [nh*(n+v), kvl] */
    bk_weight o;                   /* [H, nh*v] */
    bk_weight *w_uk_t;             /* [nh] of [kvl, n]: head h's k_nope rows of kv_b, transposed (absorbed q) */
    bk_weight *w_uv;               /* [nh] of [v, kvl]: head h's v rows of kv_b (views, absorbed output) */
    /* MLP: dense (moe == false) or MoE */
    bool moe;
    bk_weight gate, up, down;      /* dense [I, H] x2, [H, I]; or the shared experts [Is, H] x2, [H, Is] */
    bool has_shared;
    bk_weight router;              /* [E, H] mlp.gate.weight */
    float *router_bias;            /* f32 [E] e_score_correction_bias (selection only) */
    bk_weight *ex_gate, *ex_up, *ex_down; /* [E] each: [Im, H], [Im, H], [H, Im] (host views) */
    /* In backend memory (dsv3_place; zero-copy wraps on host-visible backends): */
    bk_tensor attn_norm_t, ffn_norm_t, q_a_norm_t, kv_a_norm_t; /* [1, H], [1, H], [1, q_lora], [1, kvl] */
    bk_tensor router_bias_t;       /* [1, E] */
    bk_moe_experts ex_dev;         /* the routed experts in the backend's layout (moe_place), or zeroed: the
                                      CPU path (moe_forward over the host views) */
} dsv3_layer;

typedef struct dsv3_state {
    hf_config hc;
    st_model *st;                  /* the mapped shards (weights are views into them) */
    dsv3_layer *layers;            /* [n_layers] */
    float rope_mscale;             /* YaRN attention factor on cos/sin (1 for Kimi) */
    float softmax_scale;           /* (n + r)^-0.5 * mscale(f, mscale_all_dim)^2 */
    bool absorbed;                 /* MLA form used for every token (see dsv3_set_mla_absorbed) */
    void **owned;                  /* converted copies freed with the state */
    int n_owned;
    int32_t *idx_host;             /* the forward's row-gather index lists (deepseek_v3_fwd.c ds_idx), host,
                                      grown to the largest step */
    size_t idx_cap;                /* entries */
} dsv3_state;

/* Chooses the MLA form for all later forward passes: absorbed (default:
 * attention on the latent cache, kv_b folded into q and into the output) or
 * naive (the latent decompressed through kv_b into per-head K/V). One form
 * for every token, prefill and decode alike, so a token's result never
 * depends on how it was batched. Returns -1 if m is not a DeepSeek-V3 model. */
int dsv3_set_mla_absorbed(model *m, bool absorbed);

/* Tensor-parallel style of a checkpoint tensor (canonical or prefixed name),
 * REFERENCE section 1: q_a/kv_a/router/norms replicated, q_b/kv_b column (heads
 * split), o_proj row, dense MLP and shared experts gate/up column + down row,
 * routed experts split inside each expert the same way, embedding and lm_head
 * split by vocabulary rows (column). Returns -1 for a name that is not a weight
 * of the text model. */
int dsv3_tensor_parallel(const char *name);

/* noaux_tc routing of one token (docs/kimi-k2.5.md MoE; transformers
 * DeepseekV3TopkRouter): logits f32 [E] (router matmul output), bias f32 [E]
 * -> ids[k] (selection order: best choice first), w[k]. s = sigmoid(logit);
 * choice = s + bias; with n_group > 1 each group is scored by the sum of its
 * two best choices and all but the topk_group best groups are masked (-inf);
 * the top-k experts by choice (ties: lower index); weights = s of the chosen
 * (the bias is for selection only) / (sum + 1e-20) if norm_topk_prob, times
 * routed_scaling_factor. scratch: 2E floats. */
void dsv3_route(const hf_config *c, const float *logits, const float *bias, float *scratch, int32_t *ids, float *w);

/* YaRN inverse frequencies [r/2] in float32 exactly as transformers computes
 * them (_compute_yarn_parameters), plus the cos/sin attention factor and the
 * softmax scale. Without YaRN: theta^(-2i/r), 1, (n+r)^-0.5. */
void dsv3_rope_params(const hf_config *hc, float *inv_freq, float *attention_factor, float *softmax_scale);

#endif
