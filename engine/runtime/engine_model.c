/*
 * engine_model.c: engine_create, wiring the real target model (model_forward)
 * and the real tokenizer (tok_stream, tok_stop_ids) into the engine's seams
 * (engine_ex.h). Kept apart from engine.c so that tests driving the
 * scheduler with a fake runner do not link the model or the tokenizer.
 *
 * Defaults filled here: max_model_len <= 0 means min(the model's trained
 * context, the KV pool's capacity); max_num_batched_tokens <= 0 means
 * 2048; max_num_seqs <= 0 means 256.
 *
 * Threading: owner thread (before engine_start).
 */
#include <stdlib.h>

#include "engine/runtime/engine_ex.h"
#include "engine/tokenizer/tokenizer.h"

static int model_runner_forward(void *ctx, const model_batch *b, specd_err *err) {
    return model_forward((model *)ctx, b, err);
}

static void *detok_create(void *ctx, bool skip_special) {
    return tok_stream_create((const tokenizer *)ctx, skip_special);
}
static void detok_destroy(void *s) { tok_stream_destroy((tok_stream *)s); }
static int detok_push(void *s, int32_t id, char **out, size_t *len, size_t *cap) {
    return tok_stream_push((tok_stream *)s, id, out, len, cap);
}
/* Serving ends a generation that stops inside a character without a U+FFFD
 * (vLLM): the held bytes are dropped, not flushed as a replacement. */
static int detok_flush(void *s, char **out, size_t *len, size_t *cap) {
    tok_stream_drop((tok_stream *)s);
    return tok_stream_flush((tok_stream *)s, out, len, cap);
}
static void detok_prime(void *s, const int32_t *prompt, size_t n) { tok_stream_prime((tok_stream *)s, prompt, n); }

engine_detok engine_detok_from_tokenizer(const tokenizer *tok) {
    engine_detok d = {
        .ctx = (void *)tok,
        .stream_create = detok_create,
        .stream_destroy = detok_destroy,
        .push = detok_push,
        .flush = detok_flush,
        .prime = detok_prime,
    };
    d.n_eos = tok_stop_ids(tok, &d.eos_ids);
    return d;
}

int engine_create(const engine_config *cfg_in, model *m, const tokenizer *tok, engine **out, specd_err *err) {
    *out = NULL;
    if (!cfg_in || !m || !tok) return specd_err_set(err, "engine: missing configuration, model or tokenizer");
    const model_config *mc = model_get_config(m);
    engine_runner r = {
        .ctx = cfg_in && cfg_in->forward ? cfg_in->forward_ctx : m,
        .forward = cfg_in && cfg_in->forward ? cfg_in->forward : model_runner_forward,
        .vocab = mc->vocab,
        .hidden = mc->hidden,
        .block_size = model_kv_block_size(m),
        .n_blocks = model_kv_n_blocks(m),
        /* a custom forward may not honour logits_dev: host sampling then, unless it says it does */
        .sample_be = (!cfg_in->forward || cfg_in->forward_logits_dev) && model_logits_on_device(m) ? model_backend(m)
                                                                                                  : NULL,
        /* the draft's aux capture left on the device (model_aux_reserve by a draft on the same backend) */
        .aux_dev = !(cfg_in && cfg_in->forward) || cfg_in->forward_aux_dev ? model_aux_device(m) : NULL,
    };
    if (tok_vocab_size(tok) > r.vocab)
        return specd_err_set(err, "engine: tokenizer vocabulary %d exceeds the model's %d", tok_vocab_size(tok),
                             r.vocab);
    engine_detok d = engine_detok_from_tokenizer(tok);
    engine_config cfg = *cfg_in;
    int64_t pool = (int64_t)r.n_blocks * r.block_size;
    if (cfg.max_model_len <= 0) cfg.max_model_len = (int32_t)(mc->max_pos < pool ? mc->max_pos : pool);
    if (cfg.max_model_len > mc->max_pos)
        return specd_err_set(err, "engine: max_model_len %d exceeds the model's context length %d",
                             cfg.max_model_len, mc->max_pos);
    if (cfg.max_num_seqs <= 0) cfg.max_num_seqs = 256;
    if (cfg.max_num_batched_tokens <= 0) cfg.max_num_batched_tokens = 2048;
    return engine_create_ex(&cfg, &r, &d, m, tok, out, err);
}
