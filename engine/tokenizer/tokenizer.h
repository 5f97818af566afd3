/*
 * tokenizer.h: byte-level BPE (GPT-2 family, from GGUF metadata or HF
 * tokenizer.json) and tiktoken-ranks BPE (Kimi), special tokens, decode,
 * an incremental UTF-8-safe detokenizer, and chat templates.
 *
 * Owns: vocabulary, merge ranks, the compiled PCRE2 pre-tokenizer, special
 * token table. Threading: a tokenizer is immutable after creation and safe to
 * use from many threads at once (PCRE2 match data is per call). A tok_stream
 * belongs to one thread.
 */
#ifndef SPECD_TOKENIZER_TOKENIZER_H
#define SPECD_TOKENIZER_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/loader/gguf.h"
#include "engine/util/err.h"

typedef struct tokenizer tokenizer;

/* Loads from GGUF metadata: tokenizer.ggml.{model,pre,tokens,token_type,
 * merges,bos/eos/unknown/padding_token_id}, tokenizer.chat_template. */
int tok_create_from_gguf(const gguf_file *f, tokenizer **out, specd_err *err);
/* Loads from a Hugging Face tokenizer.json (+ optional tokenizer_config.json
 * in the same directory for the chat template and special tokens). */
int tok_create_from_hf(const char *tokenizer_json_path, tokenizer **out, specd_err *err);
/* Loads a tiktoken ranks file ("base64 rank" lines; Kimi K2/K2.5's
 * tiktoken.model) with the 256 reserved special ids after the ranks.
 * CONFIG_JSON (tokenizer_config.json: added_tokens_decoder names, bos/eos,
 * chat_template) may be NULL: Kimi-K2.5's names are built in. */
int tok_create_from_tiktoken(const char *ranks_path, const char *config_json, tokenizer **out, specd_err *err);
/* A model directory: tokenizer.json (tok_create_from_hf) or tiktoken.model
 * (+ tokenizer_config.json). */
int tok_create_from_dir(const char *dir, tokenizer **out, specd_err *err);
void tok_destroy(tokenizer *t); /* NULL ok */

int32_t tok_vocab_size(const tokenizer *t);
int32_t tok_bos_id(const tokenizer *t); /* -1 if none */
int32_t tok_eos_id(const tokenizer *t);
/* Ids that end generation by default (EOS, <|im_end|>, ...). Returns the count;
 * ids points into the tokenizer. */
size_t tok_stop_ids(const tokenizer *t, const int32_t **ids);
bool tok_is_special(const tokenizer *t, int32_t id);
/* Id of an exact token string (special or normal), -1 if absent. */
int32_t tok_token_id(const tokenizer *t, const char *text, size_t len);
/* The token's decoded bytes (byte-level mapping undone). NULL if out of range. */
const char *tok_token_bytes(const tokenizer *t, int32_t id, size_t *len);

/* Encodes LEN bytes of TEXT (arbitrary bytes; invalid UTF-8 is encoded as
 * bytes). If PARSE_SPECIAL, special-token strings in the text become their ids;
 * otherwise text is plain text (what user content must use).
 * *ids is malloc'd, caller frees. Returns 0 or -1 with err. */
int tok_encode(const tokenizer *t, const char *text, size_t len, bool parse_special,
               int32_t **ids, size_t *n_ids, specd_err *err);

/* Decodes ids to bytes (malloc'd, NUL-terminated, caller frees). Special
 * tokens are rendered as their text unless SKIP_SPECIAL. Out-of-range id: -1. */
int tok_decode(const tokenizer *t, const int32_t *ids, size_t n, bool skip_special,
               char **text, size_t *len, specd_err *err);

/* Incremental detokenizer: push one id at a time, get the bytes that are now
 * final. Never emits a partial UTF-8 sequence; a sequence that can never
 * become valid is emitted as U+FFFD at the point it is known to be invalid. */
typedef struct tok_stream tok_stream;
tok_stream *tok_stream_create(const tokenizer *t, bool skip_special);
void tok_stream_destroy(tok_stream *s);
/* Appends to *out (realloc'd as needed; *out_len updated). Returns -1 on a bad id. */
int tok_stream_push(tok_stream *s, int32_t id, char **out, size_t *out_len, size_t *out_cap);
/* Flushes held bytes at end of generation (incomplete tail -> U+FFFD). */
int tok_stream_flush(tok_stream *s, char **out, size_t *out_len, size_t *out_cap);
/* Serving edges (vLLM's DecodeStream semantics, docs/server.md):
 * tok_stream_prime: when the bytes of IDS (the prompt) end inside a character,
 * hold those bytes, so the generated token that completes the character emits
 * it whole (the completion starts with the full character, no U+FFFD);
 * tok_stream_drop: forget held bytes (a generation that ends inside a
 * character emits nothing for it, no U+FFFD). */
void tok_stream_prime(tok_stream *s, const int32_t *ids, size_t n);
void tok_stream_drop(tok_stream *s);

/* ---- chat templates ---- */
/* One tool call of an earlier assistant turn (OpenAI tool_calls[i]). */
typedef struct chat_tool_call {
    const char *id;         /* the call's id (Kimi K2's template renders functions.NAME:INDEX instead) */
    const char *name;       /* function name */
    const char *arguments;  /* the arguments as the client sent them: a JSON text in a string */
} chat_tool_call;

typedef struct chat_message {
    const char *role;    /* "system" | "user" | "assistant" | "tool" | other */
    const char *content; /* UTF-8; NULL = none (an assistant turn with only tool calls) */
    const char *name;    /* optional, NULL */
    const chat_tool_call *tool_calls; size_t n_tool_calls; /* assistant turns */
    const char *tool_call_id;                              /* role "tool": the call answered */
} chat_message;

typedef struct chat_options {
    bool add_generation_prompt;   /* append the assistant header */
    int thinking;                 /* Kimi: 1 = "<think>", 0 = "<think></think>", -1 default */
    const char *default_system;   /* NULL = the template's own default */
    /* the tool declarations exactly as the template prints `tools | tojson`
     * (Python json.dumps, made by the server); NULL = no tools */
    const char *tools_json;
} chat_options;

/* The tool-call format of the loaded chat template: TOK_TOOLS_NONE (tools
 * refused), TOK_TOOLS_KIMI (tool_declare / <|tool_calls_section_begin|>). */
typedef enum { TOK_TOOLS_NONE = 0, TOK_TOOLS_KIMI = 1 } tok_tool_format;
tok_tool_format tok_chat_tool_format(const tokenizer *t);
/* 1 if the template has a thinking section (<think> ... </think> after the
 * generation prompt, on by default), else 0. */
int tok_chat_thinking(const tokenizer *t);

/* Renders a conversation to token ids: structural tokens are inserted as ids,
 * message content is tokenized as plain text (never parsed for specials).
 * Also returns, if MASK != NULL, a malloc'd per-token byte: 1 for tokens that
 * belong to assistant turns' content and end (the training loss mask), else 0.
 * The template family is detected from the model (ChatML for SmolLM2, Kimi). */
int tok_chat_encode(const tokenizer *t, const chat_message *msgs, size_t n_msgs,
                    const chat_options *opt, int32_t **ids, size_t *n_ids,
                    uint8_t **mask, specd_err *err);
/* Same conversation rendered as text (what the Jinja template would print). */
int tok_chat_render(const tokenizer *t, const chat_message *msgs, size_t n_msgs,
                    const chat_options *opt, char **text, size_t *len, specd_err *err);

#endif
