/*
 * vocab_target.h: the target model as far as vocab/ needs it without weights:
 * its tokenizer (GGUF file or HF directory), its vocabulary size (the LM head
 * rows, which may exceed the tokenizer's entries in HF checkpoints padded for
 * the GPU) and the token ids a draft vocabulary must always keep.
 *
 * Ownership: vocab_target owns the GGUF mapping (the tokenizer is built from
 * it and kept alongside) and the tokenizer. Threading: immutable after open.
 */
#ifndef SPECD_VOCAB_VOCAB_TARGET_H
#define SPECD_VOCAB_VOCAB_TARGET_H

#include <stddef.h>
#include <stdint.h>

#include "engine/loader/gguf.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/util/err.h"

typedef struct vocab_target {
    gguf_file *gguf;      /* NULL for an HF directory */
    tokenizer *tok;
    int64_t n_vocab;      /* max(tokenizer entries, config/metadata vocab_size) */
} vocab_target;

/* PATH: a .gguf file or an HF model directory (tokenizer.json or tiktoken.model,
 * config.json). Returns 0 or -1 with err. */
int vocab_target_open(const char *path, vocab_target *t, specd_err *err);
void vocab_target_close(vocab_target *t); /* NULL ok */

/* The ids a draft vocab keeps regardless of frequency: EOS, the stop ids, and
 * the chat-structure specials present in the vocabulary (<|im_start|>,
 * <|im_end|>, <|im_user|>, <|im_assistant|>, <|im_system|>, <|im_middle|>,
 * <think>, </think>). Writes up to CAP distinct ids, ascending; returns the
 * count. */
size_t vocab_target_structural_ids(const vocab_target *t, int64_t *ids, size_t cap);

/* Token text for display inside double quotes: printable ASCII and UTF-8
 * bytes kept, '"' and '\\' backslash-escaped, control bytes as \n, \t, \xNN;
 * truncated to fit CAP bytes. Unknown id -> "<?>". */
void vocab_token_display(const tokenizer *tok, int64_t id, char *buf, size_t cap);

#endif
