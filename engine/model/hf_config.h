/*
 * hf_config.h: a Hugging Face model directory's config.json, parsed into a
 * native struct at the edge (no JSON beyond hf_config.c).
 *
 * Accepted shapes (REFERENCE section 1):
 *   - Kimi-K2.5: top level model_type "kimi_k25" with a text_config whose
 *     model_type is "deepseek_v3" or "kimi_k2" (mirrors disagree); the
 *     vision_config is ignored with a log line; quantization_config at the top
 *     level and/or inside text_config.
 *   - a plain DeepSeek-V3 / Kimi-K2 config (model_type "deepseek_v3" or
 *     "kimi_k2" at the top level).
 *   - Llama family: model_type "llama" (LlamaForCausalLM), and "mistral" when
 *     it is the same math (no sliding window shorter than the context).
 *     "qwen2" is refused by name (q/k/v projection biases). Keys and defaults
 *     follow transformers' LlamaConfig; rope_scaling types default, linear and
 *     llama3 are read, every other type is refused by name.
 * A config is untrusted input: every size is range-checked, a wrong JSON type
 * is an error, a missing optional key takes the transformers default.
 * Threading: pure functions.
 */
#ifndef SPECD_MODEL_HF_CONFIG_H
#define SPECD_MODEL_HF_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model/model.h"
#include "engine/util/err.h"

/* compressed-tensors "pack-quantized" int4 of the routed experts. */
typedef struct hf_quant {
    bool present;            /* a quantization_config was found */
    char method[32];         /* "compressed-tensors" */
    char format[32];         /* "pack-quantized" */
    int32_t num_bits;        /* 4 */
    int32_t group_size;      /* 32 */
    bool symmetric;          /* true */
    char strategy[16];       /* "group" */
} hf_quant;

/* RoPE frequency scaling of a Llama-family config (transformers
 * modeling_rope_utils.py: _compute_default / _linear / _llama3_parameters). */
typedef enum { HF_ROPE_DEFAULT, HF_ROPE_LINEAR, HF_ROPE_LLAMA3 } hf_rope_kind;

typedef struct hf_config {
    model_arch arch;
    char model_type[32];       /* of the text model: "deepseek_v3", "kimi_k2", "llama" */
    char top_model_type[32];   /* "kimi_k25" or == model_type */
    bool has_vision;           /* a vision_config was present (ignored) */
    int32_t vocab, hidden, n_layers, max_pos;
    int32_t n_heads;
    int32_t intermediate;      /* dense MLP width (layers < first_k_dense) */
    /* MoE (DeepSeek-V3): sigmoid scoring, noaux_tc selection */
    int32_t moe_intermediate, n_routed_experts, n_experts_per_tok, n_shared_experts;
    int32_t first_k_dense, moe_layer_freq, n_group, topk_group;
    float routed_scaling;
    bool norm_topk_prob;
    /* MLA */
    int32_t q_lora_rank;       /* 0: no q compression (q_proj directly) */
    int32_t kv_lora_rank, qk_nope, qk_rope, v_head;
    /* RoPE: theta, YaRN (factor <= 1 or type != yarn: plain RoPE) */
    double rope_theta;
    bool yarn;
    double yarn_factor, yarn_beta_fast, yarn_beta_slow;
    double yarn_mscale, yarn_mscale_all_dim; /* 0 when absent (transformers: "if mscale and mscale_all_dim") */
    double yarn_attention_factor;            /* -1 when absent (then derived from factor / mscales) */
    int32_t yarn_orig_max_pos;
    double rms_eps;
    bool tie_embeddings;
    int32_t bos_id, eos_id;    /* -1 if absent */
    hf_quant quant;
    /* Llama family (arch LLAMA) */
    int32_t n_kv_heads;        /* num_key_value_heads (default n_heads) */
    int32_t head_dim;          /* head_dim (default hidden / n_heads) */
    hf_rope_kind rope_kind;
    double rope_factor;        /* linear, llama3: factor (1 otherwise) */
    double rope_low_freq, rope_high_freq; /* llama3: low_freq_factor, high_freq_factor */
    int32_t rope_orig_max_pos; /* llama3: original_max_position_embeddings */
} hf_config;

/* Parses DIR/config.json into *c. Errors: unreadable file, invalid JSON,
 * an unsupported model_type or scoring, values out of range. */
int hf_config_load(const char *dir, hf_config *c, specd_err *err);

/* Same from a JSON text (for tests). */
int hf_config_parse(const char *json_text, hf_config *c, specd_err *err);

/* The file of DIR that holds TENSOR, for error messages: the shard named by
 * DIR/model.safetensors.index.json's weight_map, else the directory's single
 * *.safetensors file, else "?". Writes a NUL-terminated name into buf. */
void hf_tensor_file(const char *dir, const char *tensor, char *buf, size_t cap);

/* llama.c: loads a Llama-family HF directory m->path whose config.json is HC
 * (arch LLAMA): safetensors weights as bk_weight views of the mapping
 * (BF16/F16/F32), norms as f32 copies, RoPE frequencies with the config's
 * scaling, rotate_half layout. *ST receives the mapped shards (the weights
 * point into them): the caller closes it after the model is destroyed, also
 * on failure. Errors name the tensor and the file. */
struct model;
struct st_model;
int llama_load_hf(struct model *m, const hf_config *hc, struct st_model **st, specd_err *err);

#endif
