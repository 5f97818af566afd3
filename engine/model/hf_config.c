/*
 * hf_config.c: config.json of a Hugging Face model directory -> hf_config.
 *
 * The DeepSeek-V3 keys and their defaults follow transformers'
 * DeepseekV3Config (configuration_deepseek_v3.py) and the Kimi-K2.5 release
 * (REFERENCE section 1): the text model's keys live in text_config for
 * model_type "kimi_k25", at the top level otherwise. rope_scaling (older
 * configs) and rope_parameters (transformers 5) are both read.
 * Only what specd serves is accepted: sigmoid scoring with noaux_tc, int4
 * pack-quantized experts with group 32; anything else is refused by name
 * rather than run wrongly.
 * Llama-family keys and defaults follow transformers' LlamaConfig
 * (configuration_llama.py) and MistralConfig; rope_scaling types follow
 * modeling_rope_utils.py (default, linear, llama3 accepted; dynamic NTK, YaRN,
 * longrope refused: their frequencies would differ from the checkpoint's).
 * Threading: pure functions.
 */
#include "engine/model/hf_config.h"

#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/util/log.h"

/* ------------------------------------------------------------ JSON helpers */

/* Integer KEY of OBJ in [lo, hi]; missing/null -> def (or an error if required). */
static int cfg_int(const json_t *o, const char *key, bool required, int64_t def, int64_t lo, int64_t hi,
                   int32_t *out, specd_err *err) {
    const json_t *v = json_object_get(o, key);
    int64_t x = def;
    if (!v || json_is_null(v)) {
        if (required) return specd_err_set(err, "config.json: '%s' is missing", key);
    } else if (json_is_integer(v)) {
        x = (int64_t)json_integer_value(v);
    } else if (json_is_real(v) && floor(json_real_value(v)) == json_real_value(v) && fabs(json_real_value(v)) < 9e15) {
        x = (int64_t)json_real_value(v);
    } else {
        return specd_err_set(err, "config.json: '%s' must be an integer", key);
    }
    if (x < lo || x > hi)
        return specd_err_set(err, "config.json: '%s' = %lld is out of range [%lld, %lld]", key, (long long)x,
                             (long long)lo, (long long)hi);
    *out = (int32_t)x;
    return 0;
}

static int cfg_num(const json_t *o, const char *key, double def, double lo, double hi, double *out, specd_err *err) {
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) { *out = def; return 0; }
    if (!json_is_number(v)) return specd_err_set(err, "config.json: '%s' must be a number", key);
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || x > hi)
        return specd_err_set(err, "config.json: '%s' = %g is out of range [%g, %g]", key, x, lo, hi);
    *out = x;
    return 0;
}

static int cfg_bool(const json_t *o, const char *key, bool def, bool *out, specd_err *err) {
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) { *out = def; return 0; }
    if (!json_is_boolean(v)) return specd_err_set(err, "config.json: '%s' must be true or false", key);
    *out = json_is_true(v);
    return 0;
}

/* String KEY into buf (empty if missing). */
static int cfg_str(const json_t *o, const char *key, char *buf, size_t cap, specd_err *err) {
    const json_t *v = json_object_get(o, key);
    buf[0] = 0;
    if (!v || json_is_null(v)) return 0;
    if (!json_is_string(v)) return specd_err_set(err, "config.json: '%s' must be a string", key);
    if (json_string_length(v) >= cap) return specd_err_set(err, "config.json: '%s' is too long", key);
    snprintf(buf, cap, "%s", json_string_value(v));
    return 0;
}

/* eos_token_id may be an int or a list (first element taken). */
static int32_t cfg_token_id(const json_t *o, const char *key) {
    const json_t *v = json_object_get(o, key);
    if (json_is_array(v) && json_array_size(v) > 0) v = json_array_get(v, 0);
    if (json_is_integer(v) && json_integer_value(v) >= 0 && json_integer_value(v) < (1 << 24))
        return (int32_t)json_integer_value(v);
    return -1;
}

/* ------------------------------------------------------------ sections */

static int parse_quant(const json_t *q, hf_quant *out, specd_err *err) {
    memset(out, 0, sizeof *out);
    if (!q || json_is_null(q)) return 0;
    if (!json_is_object(q)) return specd_err_set(err, "config.json: quantization_config must be an object");
    out->present = true;
    if (cfg_str(q, "quant_method", out->method, sizeof out->method, err) < 0 ||
        cfg_str(q, "format", out->format, sizeof out->format, err) < 0)
        return -1;
    if (strcmp(out->method, "compressed-tensors") != 0)
        return specd_err_set(err, "config.json: quantization method '%s' is not supported (compressed-tensors only)",
                             out->method);
    if (strcmp(out->format, "pack-quantized") != 0)
        return specd_err_set(err, "config.json: compressed-tensors format '%s' is not supported (pack-quantized only)",
                             out->format);
    const json_t *groups = json_object_get(q, "config_groups");
    if (!json_is_object(groups) || json_object_size(groups) != 1)
        return specd_err_set(err, "config.json: quantization_config.config_groups must hold exactly one group");
    const char *gname;
    const json_t *g;
    json_object_foreach((json_t *)groups, gname, g) {
        const json_t *w = json_object_get(g, "weights");
        if (!json_is_object(w)) return specd_err_set(err, "config.json: config_groups.%s.weights missing", gname);
        const json_t *ia = json_object_get(g, "input_activations");
        if (ia && !json_is_null(ia))
            return specd_err_set(err, "config.json: activation quantization is not supported");
        char type[16];
        if (cfg_int(w, "num_bits", true, 0, 1, 16, &out->num_bits, err) < 0 ||
            cfg_int(w, "group_size", true, 0, 1, 1 << 20, &out->group_size, err) < 0 ||
            cfg_bool(w, "symmetric", false, &out->symmetric, err) < 0 ||
            cfg_str(w, "strategy", out->strategy, sizeof out->strategy, err) < 0 ||
            cfg_str(w, "type", type, sizeof type, err) < 0)
            return specd_err_wrap(err, "quantization_config");
        if (out->num_bits != 4 || out->group_size != 32 || !out->symmetric || strcmp(out->strategy, "group") != 0 ||
            (type[0] && strcmp(type, "int") != 0))
            return specd_err_set(err,
                                 "config.json: only int4 symmetric group-32 weights are supported (got %d bits, "
                                 "group %d, %s, strategy '%s')",
                                 out->num_bits, out->group_size, out->symmetric ? "symmetric" : "asymmetric",
                                 out->strategy);
    }
    return 0;
}

/* rope_scaling / rope_parameters: YaRN parameters (transformers defaults). */
static int parse_rope(const json_t *t, hf_config *c, specd_err *err) {
    const json_t *rs = json_object_get(t, "rope_scaling");
    if (!rs || json_is_null(rs)) rs = json_object_get(t, "rope_parameters");
    if (cfg_num(t, "rope_theta", 10000.0, 1.0, 1e12, &c->rope_theta, err) < 0) return -1;
    c->yarn = false;
    c->yarn_factor = 1.0;
    if (!rs || json_is_null(rs)) return 0;
    if (!json_is_object(rs)) return specd_err_set(err, "config.json: rope_scaling must be an object");
    if (json_object_get(rs, "rope_theta") &&
        cfg_num(rs, "rope_theta", c->rope_theta, 1.0, 1e12, &c->rope_theta, err) < 0)
        return -1;
    char type[32] = "";
    if (cfg_str(rs, "rope_type", type, sizeof type, err) < 0) return -1;
    if (!type[0] && cfg_str(rs, "type", type, sizeof type, err) < 0) return -1;
    if (!type[0] || !strcmp(type, "default")) return 0;
    if (strcmp(type, "yarn") != 0)
        return specd_err_set(err, "config.json: rope scaling type '%s' is not supported (yarn only)", type);
    c->yarn = true;
    if (cfg_num(rs, "factor", 1.0, 1.0, 1e6, &c->yarn_factor, err) < 0 ||
        cfg_num(rs, "beta_fast", 32.0, 1e-6, 1e6, &c->yarn_beta_fast, err) < 0 ||
        cfg_num(rs, "beta_slow", 1.0, 1e-6, 1e6, &c->yarn_beta_slow, err) < 0 ||
        cfg_num(rs, "mscale", 0.0, 0.0, 1e3, &c->yarn_mscale, err) < 0 ||
        cfg_num(rs, "attention_factor", -1.0, -1.0, 1e3, &c->yarn_attention_factor, err) < 0 ||
        cfg_num(rs, "mscale_all_dim", 0.0, 0.0, 1e3, &c->yarn_mscale_all_dim, err) < 0 ||
        cfg_int(rs, "original_max_position_embeddings", false, c->max_pos, 1, 1 << 30, &c->yarn_orig_max_pos, err) < 0)
        return specd_err_wrap(err, "rope_scaling");
    return 0;
}

static int parse_deepseek(const json_t *t, hf_config *c, specd_err *err) {
    c->arch = MODEL_ARCH_DEEPSEEK_V3;
    if (cfg_int(t, "vocab_size", true, 0, 1, 1 << 22, &c->vocab, err) < 0 ||
        cfg_int(t, "hidden_size", true, 0, 32, 1 << 16, &c->hidden, err) < 0 ||
        cfg_int(t, "num_hidden_layers", true, 0, 1, 1024, &c->n_layers, err) < 0 ||
        cfg_int(t, "max_position_embeddings", false, 4096, 1, 1 << 30, &c->max_pos, err) < 0 ||
        cfg_int(t, "num_attention_heads", true, 0, 1, 1024, &c->n_heads, err) < 0 ||
        cfg_int(t, "intermediate_size", true, 0, 1, 1 << 20, &c->intermediate, err) < 0 ||
        cfg_int(t, "moe_intermediate_size", true, 0, 1, 1 << 20, &c->moe_intermediate, err) < 0 ||
        cfg_int(t, "n_routed_experts", true, 0, 1, 65536, &c->n_routed_experts, err) < 0 ||
        cfg_int(t, "num_experts_per_tok", true, 0, 1, 1024, &c->n_experts_per_tok, err) < 0 ||
        cfg_int(t, "n_shared_experts", false, 0, 0, 64, &c->n_shared_experts, err) < 0 ||
        cfg_int(t, "first_k_dense_replace", false, 0, 0, 1024, &c->first_k_dense, err) < 0 ||
        cfg_int(t, "moe_layer_freq", false, 1, 1, 1024, &c->moe_layer_freq, err) < 0 ||
        cfg_int(t, "n_group", false, 1, 1, 1024, &c->n_group, err) < 0 ||
        cfg_int(t, "topk_group", false, 1, 1, 1024, &c->topk_group, err) < 0 ||
        cfg_int(t, "q_lora_rank", false, 0, 0, 1 << 16, &c->q_lora_rank, err) < 0 ||
        cfg_int(t, "kv_lora_rank", true, 0, 1, 1 << 16, &c->kv_lora_rank, err) < 0 ||
        cfg_int(t, "qk_nope_head_dim", true, 0, 1, 4096, &c->qk_nope, err) < 0 ||
        cfg_int(t, "qk_rope_head_dim", true, 0, 2, 4096, &c->qk_rope, err) < 0 ||
        cfg_int(t, "v_head_dim", true, 0, 1, 4096, &c->v_head, err) < 0 ||
        cfg_bool(t, "norm_topk_prob", true, &c->norm_topk_prob, err) < 0 ||
        cfg_bool(t, "tie_word_embeddings", false, &c->tie_embeddings, err) < 0 ||
        cfg_num(t, "rms_norm_eps", 1e-6, 1e-12, 1.0, &c->rms_eps, err) < 0)
        return -1;
    double rsf = 1.0;
    if (cfg_num(t, "routed_scaling_factor", 1.0, 1e-6, 1e6, &rsf, err) < 0) return -1;
    c->routed_scaling = (float)rsf;
    if (parse_rope(t, c, err) < 0) return -1;
    if (c->qk_rope % 2) return specd_err_set(err, "config.json: qk_rope_head_dim %d is odd", c->qk_rope);
    if (c->n_experts_per_tok > c->n_routed_experts || c->n_routed_experts % c->n_group ||
        c->topk_group > c->n_group || c->n_experts_per_tok > c->topk_group * (c->n_routed_experts / c->n_group))
        return specd_err_set(err, "config.json: inconsistent routing (%d experts, top %d, %d groups, top %d groups)",
                             c->n_routed_experts, c->n_experts_per_tok, c->n_group, c->topk_group);
    if (c->n_group > 1 && c->n_routed_experts / c->n_group < 2)
        return specd_err_set(err, "config.json: groups need at least 2 experts each");
    char s[32];
    if (cfg_str(t, "scoring_func", s, sizeof s, err) < 0) return -1;
    if (s[0] && strcmp(s, "sigmoid") != 0)
        return specd_err_set(err, "config.json: scoring_func '%s' is not supported (sigmoid only)", s);
    if (cfg_str(t, "topk_method", s, sizeof s, err) < 0) return -1;
    if (s[0] && strcmp(s, "noaux_tc") != 0)
        return specd_err_set(err, "config.json: topk_method '%s' is not supported (noaux_tc only)", s);
    if (cfg_str(t, "hidden_act", s, sizeof s, err) < 0) return -1;
    if (s[0] && strcmp(s, "silu") != 0)
        return specd_err_set(err, "config.json: hidden_act '%s' is not supported (silu only)", s);
    int32_t nextn = 0;
    if (cfg_int(t, "num_nextn_predict_layers", false, 0, 0, 16, &nextn, err) < 0) return -1;
    if (nextn) LOG_INFO("config: %d MTP layer(s) present and not used", nextn);
    return 0;
}

/* Llama / Mistral RoPE: rope_theta plus rope_scaling (older configs) or
 * rope_parameters (transformers 5, which also carries rope_theta). */
static int parse_llama_rope(const json_t *t, hf_config *c, specd_err *err) {
    c->rope_kind = HF_ROPE_DEFAULT;
    c->rope_factor = 1.0;
    if (cfg_num(t, "rope_theta", 10000.0, 1.0, 1e12, &c->rope_theta, err) < 0) return -1;
    const json_t *rs = json_object_get(t, "rope_scaling");
    if (!rs || json_is_null(rs)) rs = json_object_get(t, "rope_parameters");
    if (!rs || json_is_null(rs)) return 0;
    if (!json_is_object(rs)) return specd_err_set(err, "config.json: rope_scaling must be an object");
    if (json_object_get(rs, "rope_theta") && cfg_num(rs, "rope_theta", c->rope_theta, 1.0, 1e12, &c->rope_theta, err) < 0)
        return -1;
    char type[32] = "";
    if (cfg_str(rs, "rope_type", type, sizeof type, err) < 0) return -1;
    if (!type[0] && cfg_str(rs, "type", type, sizeof type, err) < 0) return -1;
    if (!type[0] || !strcmp(type, "default")) return 0;
    if (!strcmp(type, "linear")) {
        c->rope_kind = HF_ROPE_LINEAR;
        if (cfg_num(rs, "factor", -1.0, -1.0, 1e6, &c->rope_factor, err) < 0) return specd_err_wrap(err, "rope_scaling");
        if (!(c->rope_factor >= 1.0))
            return specd_err_set(err, "config.json: rope_scaling linear needs a 'factor' >= 1");
        return 0;
    }
    if (!strcmp(type, "llama3")) {
        c->rope_kind = HF_ROPE_LLAMA3;
        if (cfg_num(rs, "factor", -1.0, -1.0, 1e6, &c->rope_factor, err) < 0 ||
            cfg_num(rs, "low_freq_factor", -1.0, -1.0, 1e6, &c->rope_low_freq, err) < 0 ||
            cfg_num(rs, "high_freq_factor", -1.0, -1.0, 1e6, &c->rope_high_freq, err) < 0 ||
            cfg_int(rs, "original_max_position_embeddings", true, 0, 1, 1 << 30, &c->rope_orig_max_pos, err) < 0)
            return specd_err_wrap(err, "rope_scaling llama3");
        if (!(c->rope_factor >= 1.0) || !(c->rope_low_freq > 0) || !(c->rope_high_freq > c->rope_low_freq))
            return specd_err_set(err,
                                 "config.json: rope_scaling llama3 needs factor >= 1 and 0 < low_freq_factor < "
                                 "high_freq_factor (got %g, %g, %g)",
                                 c->rope_factor, c->rope_low_freq, c->rope_high_freq);
        return 0;
    }
    return specd_err_set(err, "config.json: rope scaling type '%s' is not supported for llama (default, linear, llama3)",
                         type);
}

/* LlamaForCausalLM / MistralForCausalLM (same math when no sliding window
 * binds). Sizes are required (save_pretrained always writes them). */
static int parse_llama(const json_t *t, hf_config *c, specd_err *err) {
    c->arch = MODEL_ARCH_LLAMA;
    if (cfg_int(t, "vocab_size", true, 0, 1, 1 << 22, &c->vocab, err) < 0 ||
        cfg_int(t, "hidden_size", true, 0, 1, 1 << 16, &c->hidden, err) < 0 ||
        cfg_int(t, "intermediate_size", true, 0, 1, 1 << 20, &c->intermediate, err) < 0 ||
        cfg_int(t, "num_hidden_layers", true, 0, 1, 1024, &c->n_layers, err) < 0 ||
        cfg_int(t, "num_attention_heads", true, 0, 1, 1024, &c->n_heads, err) < 0 ||
        cfg_int(t, "num_key_value_heads", false, c->n_heads, 1, 1024, &c->n_kv_heads, err) < 0 ||
        cfg_int(t, "head_dim", false, c->hidden / c->n_heads, 1, 4096, &c->head_dim, err) < 0 ||
        cfg_int(t, "max_position_embeddings", false, 2048, 1, 1 << 30, &c->max_pos, err) < 0 ||
        cfg_num(t, "rms_norm_eps", 1e-6, 1e-12, 1.0, &c->rms_eps, err) < 0 ||
        cfg_bool(t, "tie_word_embeddings", false, &c->tie_embeddings, err) < 0)
        return -1;
    if (c->n_heads % c->n_kv_heads)
        return specd_err_set(err, "config.json: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                             c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2) return specd_err_set(err, "config.json: head_dim %d is odd (RoPE rotates pairs)", c->head_dim);
    if (parse_llama_rope(t, c, err) < 0) return -1;
    char s[32];
    if (cfg_str(t, "hidden_act", s, sizeof s, err) < 0) return -1;
    if (s[0] && strcmp(s, "silu") != 0)
        return specd_err_set(err, "config.json: hidden_act '%s' is not supported (silu only)", s);
    bool bias = false;
    if (cfg_bool(t, "attention_bias", false, &bias, err) < 0) return -1;
    if (bias) return specd_err_set(err, "config.json: attention_bias = true is not supported (no projection biases)");
    if (cfg_bool(t, "mlp_bias", false, &bias, err) < 0) return -1;
    if (bias) return specd_err_set(err, "config.json: mlp_bias = true is not supported (no projection biases)");
    const json_t *sw = json_object_get(t, "sliding_window");
    if (sw && !json_is_null(sw)) {
        int32_t w = 0;
        if (cfg_int(t, "sliding_window", false, 0, 0, 1 << 30, &w, err) < 0) return -1;
        if (w < c->max_pos)
            return specd_err_set(err,
                                 "config.json: sliding_window %d < max_position_embeddings %d is not supported "
                                 "(full causal attention only)",
                                 w, c->max_pos);
    }
    return 0;
}

void hf_tensor_file(const char *dir, const char *tensor, char *buf, size_t cap) {
    char path[1200];
    snprintf(buf, cap, "?");
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    json_t *idx = json_load_file(path, 0, NULL);
    if (idx) {
        const json_t *f = json_object_get(json_object_get(idx, "weight_map"), tensor);
        snprintf(buf, cap, "%s", json_is_string(f) ? json_string_value(f) : "model.safetensors.index.json");
        json_decref(idx);
        return;
    }
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n > 12 && !strcmp(e->d_name + n - 12, ".safetensors")) {
            snprintf(buf, cap, "%s", e->d_name);
            break;
        }
    }
    closedir(d);
}

int hf_config_parse(const char *json_text, hf_config *c, specd_err *err) {
    memset(c, 0, sizeof *c);
    json_error_t je;
    json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES, &je);
    if (!root) return specd_err_set(err, "config.json: line %d: %s", je.line, je.text);
    int rc = -1;
    if (!json_is_object(root)) { specd_err_set(err, "config.json: not a JSON object"); goto done; }
    if (cfg_str(root, "model_type", c->top_model_type, sizeof c->top_model_type, err) < 0) goto done;
    const json_t *text = root;
    if (!strcmp(c->top_model_type, "kimi_k25")) {
        text = json_object_get(root, "text_config");
        if (!json_is_object(text)) { specd_err_set(err, "config.json: kimi_k25 without a text_config object"); goto done; }
        const json_t *vc = json_object_get(root, "vision_config");
        c->has_vision = vc && !json_is_null(vc);
    }
    if (cfg_str(text, "model_type", c->model_type, sizeof c->model_type, err) < 0) goto done;
    if (!strcmp(c->model_type, "deepseek_v3") || !strcmp(c->model_type, "kimi_k2")) {
        if (parse_deepseek(text, c, err) < 0) goto done;
    } else if (!strcmp(c->model_type, "llama") || !strcmp(c->model_type, "mistral")) {
        if (parse_llama(text, c, err) < 0) goto done;
    } else if (!strcmp(c->model_type, "qwen2")) {
        specd_err_set(err, "config.json: model_type 'qwen2' is not supported: its q/k/v projections carry biases "
                           "that the llama runner does not apply");
        goto done;
    } else {
        specd_err_set(err,
                      "config.json: model_type '%s' is not supported (kimi_k25, deepseek_v3, kimi_k2, llama, mistral)",
                      c->model_type[0] ? c->model_type : "(missing)");
        goto done;
    }
    /* quantization_config: text_config's wins, the top level's is the fallback */
    const json_t *q = json_object_get(text, "quantization_config");
    if (!q || json_is_null(q)) q = json_object_get(root, "quantization_config");
    if (parse_quant(q, &c->quant, err) < 0) goto done;
    c->bos_id = cfg_token_id(text, "bos_token_id");
    if (c->bos_id < 0) c->bos_id = cfg_token_id(root, "bos_token_id");
    c->eos_id = cfg_token_id(text, "eos_token_id");
    if (c->eos_id < 0) c->eos_id = cfg_token_id(root, "eos_token_id");
    rc = 0;
done:
    json_decref(root);
    return rc;
}

int hf_config_load(const char *dir, hf_config *c, specd_err *err) {
    char path[1200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return specd_err_set(err, "%s: cannot open", path);
    char *buf = NULL;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
    if (n < 0 || n > (16 << 20) || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return specd_err_set(err, "%s: unreadable or larger than 16 MiB", path);
    }
    buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return specd_err_set(err, "%s: read failed", path);
    }
    fclose(f);
    buf[n] = 0;
    int rc = hf_config_parse(buf, c, err);
    free(buf);
    if (rc < 0) return specd_err_wrap(err, "%s", dir);
    return 0;
}
