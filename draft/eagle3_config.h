/*
 * eagle3_config.h: an EAGLE-3 draft head's config.json, normalised from
 * either checkpoint layout (REFERENCE.md §2 "Checkpoint formats to load"):
 *
 *   EAGLE / SafeAILab / SpecForge: a Llama config (architectures
 *     ["LlamaForCausalLMEagle3"]) + draft_vocab_size, optional
 *     target_hidden_size, optional eagle_config.eagle_aux_hidden_state_layer_ids;
 *     tensors `midlayer.*`.
 *   speculators: speculators_model_type "eagle3", transformer_layer_config
 *     (a Llama config whose vocab_size is the TARGET's), draft_vocab_size,
 *     norm_before_residual, target_hidden_size,
 *     eagle_aux_hidden_state_layer_ids, speculators_config; tensors `layers.0.*`.
 *
 * Defaults (each pinned by tests/draft/test_draft_config.c):
 *   norm_before_residual missing -> false (speculators' own default; one
 *     engine's translator defaulted it to true, REFERENCE §2 says that is wrong);
 *   rope_theta missing -> 10000 (Llama default; transformers v5 nests it in
 *     rope_parameters, read too);  num_key_value_heads missing -> heads;
 *   head_dim missing -> hidden / heads;  target_hidden_size missing -> hidden;
 *   rms_norm_eps missing -> 1e-6 (transformers LlamaConfig default).
 *
 * AUX LAYER ID CONVENTION (REFERENCE §2: engines shipped off-by-one bugs here).
 * specd captures "the residual stream ENTERING target layer i" and calls that
 * id i ("input" convention); ids {2, N/2, N-3} by default. Explicit ids in a
 * config are read with the convention of the engine that consumes that key:
 *   - top-level `eagle_aux_hidden_state_layer_ids` (speculators configs and
 *     vLLM-style Llama configs): vLLM captures the residual entering layer i
 *     for id i -> "input" convention, used as is;
 *   - `eagle_config.eagle_aux_hidden_state_layer_ids` (EAGLE / SpecForge
 *     configs): SGLang and SpecForge's HF backend capture the OUTPUT of layer i
 *     (SGLang adds 1 to each id to get the layer whose input it captures;
 *     SpecForge's default is {1, N/2-1, N-4}) -> "output" convention, specd
 *     adds 1.
 * eagle3_opts.aux_ids_convention overrides this ("input" or "output") for
 * checkpoints that were trained against the other convention.
 *
 * Threading: pure functions; the struct is plain data.
 */
#ifndef SPECD_DRAFT_EAGLE3_CONFIG_H
#define SPECD_DRAFT_EAGLE3_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/util/err.h"

#define EAGLE3_MAX_AUX 8

typedef enum { EAGLE3_LAYOUT_EAGLE, EAGLE3_LAYOUT_SPECULATORS } eagle3_layout;

/* How explicit aux layer ids are to be read. AUTO: by the key's location
 * (see the essay above). */
typedef enum { EAGLE3_AUX_AUTO = 0, EAGLE3_AUX_INPUT, EAGLE3_AUX_OUTPUT } eagle3_aux_convention;

typedef enum { EAGLE3_ROPE_DEFAULT, EAGLE3_ROPE_LINEAR, EAGLE3_ROPE_LLAMA3 } eagle3_rope_type;

typedef struct eagle3_config {
    eagle3_layout layout;
    int32_t hidden;             /* H: the draft layer's hidden size */
    int32_t target_hidden;      /* H_target: fc input is n_aux * H_target */
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t ffn;                /* intermediate_size */
    int32_t draft_vocab;        /* draft_vocab_size (lm_head rows) */
    int32_t target_vocab;       /* vocab_size of the Llama part (= the target's) */
    int32_t max_pos;            /* max_position_embeddings (0 if absent) */
    float rms_eps;
    float rope_theta;
    bool rope_theta_defaulted;  /* true when the config had none (10000 used) */
    eagle3_rope_type rope_type; /* rope_scaling type */
    float rope_factor;          /* linear / llama3 factor */
    float rope_low_freq_factor, rope_high_freq_factor;
    int32_t rope_orig_max_pos;  /* llama3 original_max_position_embeddings */
    bool attention_bias;
    bool norm_before_residual;
    /* Explicit aux ids exactly as written in the config (0 = none given). */
    int32_t n_aux_ids;
    int32_t aux_ids[EAGLE3_MAX_AUX];
    /* Convention implied by where the ids were found (INPUT or OUTPUT). */
    eagle3_aux_convention aux_ids_source;
    char verifier[256];         /* speculators_config.verifier.name_or_path, "" if none */
} eagle3_config;

/* Parses config.json text (len bytes, not necessarily NUL-terminated).
 * Refuses: unknown layout (neither speculators_model_type "eagle3" nor a
 * draft_vocab_size), missing or out-of-range sizes, head counts that do not
 * divide, unsupported variant flags (norm_before_fc, fc_norm, norm_output set
 * true), unsupported rope_scaling types, more than EAGLE3_MAX_AUX aux ids.
 * Returns 0, or -1 with err. */
int eagle3_config_parse(const char *json, size_t len, eagle3_config *out, specd_err *err);

/* Reads DIR/config.json and parses it. Also refuses a directory whose weights
 * are only pytorch_model.bin (pickle): safetensors only, with a message that
 * says how to convert. */
int eagle3_config_load(const char *dir, eagle3_config *out, specd_err *err);

/* The target layers (input convention) whose entering residual stream the
 * draft consumes: explicit ids converted with CONV (AUTO = the config's own
 * source convention), else {2, N/2, N-3} for an N-layer target. n_expected:
 * the number of features fc takes (fc.cols / H_target), or 0 for "any".
 * Writes <= EAGLE3_MAX_AUX ids to out; returns the count, or -1 with err when
 * an id falls outside [0, n_target_layers) or the count does not match. */
int eagle3_config_aux_layers(const eagle3_config *c, int32_t n_target_layers, eagle3_aux_convention conv,
                             int32_t n_expected, int32_t *out, specd_err *err);

/* RoPE inverse frequencies f32 [head_dim/2]: theta^(-2i/d), then the
 * rope_scaling rule (linear: / factor; llama3: Meta's wavelength-banded rule
 * from the Llama 3.1 release, as transformers' _compute_llama3_parameters). */
void eagle3_config_inv_freq(const eagle3_config *c, float *inv_freq);

const char *eagle3_layout_name(eagle3_layout l);

#endif
