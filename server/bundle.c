/*
 * bundle.c: see bundle.h. The order of construction is backend -> model ->
 * tokenizer -> engine; every step failing leaves the bundle freeable.
 */
#include "server/bundle.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "draft/eagle3.h"
#include "engine/util/log.h"
#ifdef SPECD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#include "server/auth.h"

static bool is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

void specd_model_name(const char *model_path, const specd_config *cfg, char *buf, size_t cap) {
    if (cfg && cfg->served_model_name) {
        snprintf(buf, cap, "%s", cfg->served_model_name);
        return;
    }
    size_t n = strlen(model_path);
    while (n > 1 && model_path[n - 1] == '/') n--;
    size_t b = n;
    while (b > 0 && model_path[b - 1] != '/') b--;
    size_t len = n - b;
    if (len > 5 && !strncmp(model_path + n - 5, ".gguf", 5)) len -= 5;
    snprintf(buf, cap, "%.*s", (int)len, model_path + b);
}

/* --device cuda: tells which of the two fallbacks applies (no usable GPU, or
 * a GPU the engine cannot use yet); the engine runs on the CPU either way. */
static void specd_probe_cuda(void) {
#ifdef SPECD_HAVE_CUDA
    int n = 0;
    cudaError_t ce = cudaGetDeviceCount(&n);
    if (ce != cudaSuccess || n == 0) {
        LOG_WARN("--device cuda: no usable GPU (%s); falling back to cpu",
                 ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices");
        return;
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
        LOG_WARN("--device cuda: %d GPU(s) (%s), but the engine has no CUDA backend wired in yet; using cpu", n,
                 prop.name);
    else
        LOG_WARN("--device cuda: %d GPU(s), but the engine has no CUDA backend wired in yet; using cpu", n);
#else
    LOG_WARN("--device cuda: this binary was built without CUDA; falling back to cpu");
#endif
}

static int load_tokenizer(const char *model_path, const gguf_file *g, specd_bundle *b, specd_err *err) {
    if (g) return tok_create_from_gguf(g, &b->tok, err);
    /* HF directory: tokenizer.json, or a tiktoken ranks file (Kimi) */
    return tok_create_from_dir(model_path, &b->tok, err);
}

int specd_tokenizer_load(const char *model_path, const char *tokenizer_json, specd_bundle *b, specd_err *err) {
    memset(b, 0, sizeof *b);
    if (tokenizer_json) { /* tokenizer.json (HF), or a tiktoken ranks file (Kimi's tiktoken.model) */
        FILE *f = fopen(tokenizer_json, "rb");
        if (!f) return specd_err_set(err, "%s: cannot open", tokenizer_json);
        int c;
        while ((c = fgetc(f)) == ' ' || c == '\t' || c == '\n' || c == '\r') {}
        fclose(f);
        if (c == '{') return tok_create_from_hf(tokenizer_json, &b->tok, err);
        return tok_create_from_tiktoken(tokenizer_json, NULL, &b->tok, err);
    }
    if (is_dir(model_path)) return load_tokenizer(model_path, NULL, b, err);
    if (gguf_open(model_path, &b->tok_gguf, err)) return specd_err_wrap(err, "%s", model_path);
    return tok_create_from_gguf(b->tok_gguf, &b->tok, err);
}

int specd_bundle_load(const char *model_path, const specd_config *cfg, specd_bundle *b, specd_err *err) {
    memset(b, 0, sizeof *b);
    if (specd_config_resolve(cfg, &b->spec, err)) return -1;
    b->device = "cpu";
    if (cfg->device && !strcmp(cfg->device, "cuda")) specd_probe_cuda();
    b->be = bk_cpu_create(cfg->threads);
    if (!b->be) {
        specd_err_set(err, "cannot create the CPU backend");
        goto fail;
    }
    LOG_INFO("backend: cpu (%s)", bk_cpu_describe(b->be));
    model_load_opts mo = {.block_size = cfg->block_size, .kv_bytes = cfg->kv_cache_memory, .n_blocks = 0};
    if (model_load(model_path, b->be, &mo, &b->m, err)) {
        specd_err_wrap(err, "loading %s", model_path);
        goto fail;
    }
    const model_config *mc = model_get_config(b->m);
    if (load_tokenizer(model_path, model_gguf(b->m), b, err)) {
        specd_err_wrap(err, "tokenizer of %s", model_path);
        goto fail;
    }
    b->max_model_len = cfg->max_model_len > 0 ? cfg->max_model_len : mc->max_pos;
    if (cfg->max_model_len > mc->max_pos)
        LOG_WARN("--max-model-len %d exceeds the model's trained context %d", cfg->max_model_len, mc->max_pos);
    int64_t kv_tokens = (int64_t)model_kv_n_blocks(b->m) * model_kv_block_size(b->m);
    if (kv_tokens < b->max_model_len) {
        specd_err_set(err,
                      "--kv-cache-memory %lld bytes holds %lld tokens, fewer than --max-model-len %d "
                      "(raise --kv-cache-memory or lower --max-model-len)",
                      (long long)cfg->kv_cache_memory, (long long)kv_tokens, b->max_model_len);
        goto fail;
    }
    LOG_INFO("max_model_len %d (KV pool holds %lld tokens)", b->max_model_len, (long long)kv_tokens);
    if (b->spec.enabled) {
        eagle3_opts eo = {0};
        if (cfg->draft_aux_convention &&
            eagle3_aux_convention_parse(cfg->draft_aux_convention, &eo.aux_ids_convention, err) != 0) {
            specd_err_wrap(err, "--draft-aux-convention");
            goto fail;
        }
        eo.q8_0 = cfg->draft_quantization && !strcmp(cfg->draft_quantization, "q8_0");
        eo.hot_vocab = cfg->speculative_token_map;
        if (eagle3_load(b->spec.model, b->m, &eo, &b->proposer, err)) {
            specd_err_wrap(err, "draft %s", b->spec.model);
            goto fail;
        }
        LOG_INFO("draft: %s (%s), k = %d%s", b->spec.model, b->spec.method, b->spec.k,
                 b->spec.adaptive ? " at most (adaptive)" : " (fixed)");
    } else {
        if (cfg->draft_aux_convention && strcmp(cfg->draft_aux_convention, "auto"))
            LOG_WARN("--draft-aux-convention %s has no effect without a draft", cfg->draft_aux_convention);
        if (cfg->draft_quantization && strcmp(cfg->draft_quantization, "none"))
            LOG_WARN("--draft-quantization %s has no effect without a draft", cfg->draft_quantization);
        if (cfg->speculative_token_map)
            LOG_WARN("--speculative-token-map %s has no effect without a draft", cfg->speculative_token_map);
    }
    engine_config ec = {.max_model_len = b->max_model_len,
                        .max_num_seqs = cfg->max_num_seqs,
                        .max_num_batched_tokens = cfg->max_num_batched_tokens,
                        .max_waiting = cfg->max_waiting,
                        .max_queue_time_s = cfg->max_queue_time,
                        .enable_prefix_caching = cfg->enable_prefix_caching,
                        .num_speculative_tokens = b->spec.enabled ? b->spec.k : 0,
                        .spec_adaptive = b->spec.enabled && b->spec.adaptive};
    if (engine_create(&ec, b->m, b->tok, &b->eng, err)) {
        specd_err_wrap(err, "engine");
        goto fail;
    }
    if (b->proposer && engine_set_proposer(b->eng, b->proposer, err)) goto fail;
    return 0;
fail:
    specd_bundle_free(b);
    return -1;
}

void specd_bundle_free(specd_bundle *b) {
    if (!b) return;
    engine_destroy(b->eng);
    eagle3_destroy(b->proposer); /* after the engine (which calls it), before the model (which it borrows) */
    tok_destroy(b->tok);
    gguf_close(b->tok_gguf);
    model_destroy(b->m);
    if (b->be) bk_cpu_destroy(b->be);
    specd_spec_free(&b->spec);
    memset(b, 0, sizeof *b);
}

int specd_check_config(const char *model_path, const specd_config *cfg, specd_err *err) {
    specd_spec spec;
    if (specd_config_resolve(cfg, &spec, err)) return -1;
    int rc = -1;
    auth *a = NULL;
    specd_bundle b;
    memset(&b, 0, sizeof b);
    if (access(model_path, R_OK)) {
        specd_err_set(err, "model %s: not readable", model_path);
        goto done;
    }
    if (auth_create(cfg->api_key, cfg->api_key_file, &a, err)) goto done;
    if (specd_tokenizer_load(model_path, NULL, &b, err)) {
        specd_err_wrap(err, "model %s", model_path);
        goto done;
    }
    if (b.tok_gguf) {
        int64_t ctx = 0;
        char key[160];
        const char *arch = NULL;
        size_t al = 0;
        if (gguf_get_str(b.tok_gguf, "general.architecture", &arch, &al, err)) goto done;
        snprintf(key, sizeof key, "%.*s.context_length", (int)al, arch);
        if (!gguf_get_i64(b.tok_gguf, key, &ctx, NULL) && cfg->max_model_len > ctx)
            LOG_WARN("--max-model-len %d exceeds the model's trained context %lld", cfg->max_model_len, (long long)ctx);
    }
    if (spec.model) {
        char p[4096];
        snprintf(p, sizeof p, "%s/config.json", spec.model);
        if (!is_dir(spec.model) || access(p, R_OK)) {
            specd_err_set(err, "draft %s: not a directory with a readable config.json", spec.model);
            goto done;
        }
        /* pairing: the head must read this target's hidden states and vocabulary */
        eagle3_config ec;
        if (eagle3_config_load(spec.model, &ec, err)) {
            specd_err_wrap(err, "draft %s", spec.model);
            goto done;
        }
        if (ec.target_vocab != tok_vocab_size(b.tok)) {
            specd_err_set(err, "draft %s expects a target vocabulary of %d tokens, the model has %d", spec.model,
                          ec.target_vocab, tok_vocab_size(b.tok));
            goto done;
        }
        if (cfg->speculative_token_map && eagle3_hot_vocab_check(cfg->speculative_token_map, tok_vocab_size(b.tok), err)) {
            specd_err_wrap(err, "--speculative-token-map");
            goto done;
        }
        if (b.tok_gguf) {
            const char *arch = NULL;
            size_t al = 0;
            int64_t hidden = 0, layers = 0;
            char key[160];
            if (!gguf_get_str(b.tok_gguf, "general.architecture", &arch, &al, NULL)) {
                snprintf(key, sizeof key, "%.*s.embedding_length", (int)al, arch);
                if (!gguf_get_i64(b.tok_gguf, key, &hidden, NULL) && hidden != ec.target_hidden) {
                    specd_err_set(err, "draft %s expects target hidden size %d, the model has %lld", spec.model,
                                  ec.target_hidden, (long long)hidden);
                    goto done;
                }
                snprintf(key, sizeof key, "%.*s.block_count", (int)al, arch);
                int32_t aux[EAGLE3_MAX_AUX];
                eagle3_aux_convention conv = EAGLE3_AUX_AUTO;
                if (cfg->draft_aux_convention &&
                    eagle3_aux_convention_parse(cfg->draft_aux_convention, &conv, err) != 0) {
                    specd_err_wrap(err, "--draft-aux-convention");
                    goto done;
                }
                if (!gguf_get_i64(b.tok_gguf, key, &layers, NULL)) {
                    int n = eagle3_config_aux_layers(&ec, (int32_t)layers, conv, 0, aux, err);
                    if (n < 0) {
                        specd_err_wrap(err, "draft %s vs a %lld-layer target", spec.model, (long long)layers);
                        goto done;
                    }
                    char ids[96];
                    int o = 0;
                    for (int i = 0; i < n && o < (int)sizeof ids - 12; i++)
                        o += snprintf(ids + o, sizeof ids - (size_t)o, "%s%d", i ? ", " : "", aux[i]);
                    LOG_INFO("draft %s: aux layers {%s} (input convention)", spec.model, ids);
                }
            }
        }
    }
    if (cfg->max_num_batched_tokens < cfg->max_num_seqs)
        LOG_WARN("--max-num-batched-tokens %d < --max-num-seqs %d: not every running sequence fits in one step",
                 cfg->max_num_batched_tokens, cfg->max_num_seqs);
    rc = 0;
done:
    auth_destroy(a);
    tok_destroy(b.tok);
    gguf_close(b.tok_gguf);
    specd_spec_free(&spec);
    return rc;
}
