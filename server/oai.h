/*
 * oai.h: the OpenAI request/response schema, the only place JSON meets the
 * engine's native structs (STYLE.md: JSON never leaves server/).
 *
 * Requests (POST /v1/completions, /v1/chat/completions) are parsed and
 * validated at the edge into an oai_request: prompts as text or token ids,
 * chat messages, and a sampling_params ready for engine_submit. Every
 * rejection is an oai_error carrying the HTTP status, the OpenAI error type,
 * the offending parameter and a message; nothing malformed reaches the engine.
 * The checks that need the tokenizer (out-of-vocabulary ids, context length)
 * are separate small functions (oai_check_ids, oai_resolve_max_tokens) so the
 * parser stays testable without a model.
 *
 * Decisions where OpenAI and peers differ (documented in docs/server.md):
 *  - max_tokens absent or null -> the remaining context (max_model_len - prompt).
 *  - max_tokens 0 is accepted only with echo (completions): the response is the
 *    echoed prompt, finish_reason "length", completion_tokens 0 (vLLM's choice).
 *  - echo + logprobs: logprobs cover the prompt tokens (the first one null, as
 *    vLLM) then the generated ones; not with stream (400).
 *  - max_completion_tokens wins over max_tokens when both are given.
 *  - prompt/ids/messages that are empty, stop strings that are empty, n = 0,
 *    temperature < 0, top_p outside (0, 1], logprobs above OAI_MAX_LOGPROBS
 *    are 400 invalid_request_error with `param` naming the field.
 *  - every field specd does not implement is a 400 naming it (never ignored;
 *    the table in oai_parse.c, docs/server.md); nulls count as absent;
 *    duplicate keys are rejected; numbers out of range say "out of range".
 *  - logit_bias {"id": bias in [-100, 100]} goes to sampling_params.
 *  - chat `tools` / `tool_choice` / message tool calls: oai_tools.c.
 *
 * Responses are built as exact OpenAI shapes: objects "text_completion",
 * "chat.completion", "chat.completion.chunk"; choices with index, text or
 * message/delta (chat: reasoning_content and tool_calls when the output is
 * parsed, oai_tools.c), logprobs, finish_reason ("stop" | "length" |
 * "tool_calls" | null); system_fingerprint;
 * usage {prompt_tokens, completion_tokens, total_tokens}. Streaming frames are
 * Server-Sent Events "data: {json}\n\n", ended by "data: [DONE]\n\n".
 *
 * Threading: pure functions over caller-owned data; safe from any thread.
 */
#ifndef SPECD_SERVER_OAI_H
#define SPECD_SERVER_OAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/runtime/engine.h"
#include "engine/tokenizer/tokenizer.h"

#define OAI_MAX_LOGPROBS 20
#define OAI_MAX_N 128
#define OAI_MAX_STOP 32
#define OAI_MAX_STOP_LEN 256
#define OAI_MAX_PROMPTS 256
#define OAI_MAX_TOOLS 128
#define OAI_MAX_LOGIT_BIAS 1024
/* the system_fingerprint of every response: the build's version */
#define OAI_SYSTEM_FINGERPRINT "fp_specd_" SPECD_FP_VERSION
#ifndef SPECD_FP_VERSION
#define SPECD_FP_VERSION "0.1.0"
#endif

typedef enum {
    OAI_TOOL_CHOICE_NONE = 0,  /* no tools, or tool_choice "none": output is content */
    OAI_TOOL_CHOICE_AUTO,      /* the model decides; its tool-call section is parsed */
    OAI_TOOL_CHOICE_REQUIRED,  /* the reply is opened as a tool call (the prompt ends inside one) */
    OAI_TOOL_CHOICE_NAMED,     /* the reply is opened as a call of tool_choice_name */
} oai_tool_choice;

typedef enum { OAI_COMPLETION, OAI_CHAT } oai_kind;

typedef struct oai_error {
    int status;        /* HTTP status: 400, 401, 404, 413, 429, 500, 503 */
    char type[40];     /* "invalid_request_error", "authentication_error", ... */
    char code[40];     /* machine code or "" (rendered as null) */
    char param[64];    /* offending field or "" (null) */
    char message[512];
} oai_error;

/* Fills E (type derived from the status) and returns -1. PARAM may be NULL. */
int oai_error_set(oai_error *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* {"error":{"message","type","param","code"}} as a malloc'd JSON string. */
char *oai_error_json(const oai_error *e, size_t *len);

typedef struct oai_prompt {
    bool is_ids;            /* the client sent token ids */
    char *text;             /* UTF-8, malloc'd (when !is_ids) */
    size_t text_len;
    int32_t *ids;           /* [n_ids], malloc'd: client ids, or the tokenized text */
    size_t n_ids;
} oai_prompt;

typedef struct oai_request {
    oai_kind kind;
    char *model;                     /* NULL when absent */
    oai_prompt *prompts;             /* completions: [n_prompts] (a batch gives n_prompts * n choices) */
    size_t n_prompts;
    chat_message *messages;          /* chat: [n_messages]; strings malloc'd */
    size_t n_messages;
    bool add_generation_prompt;      /* chat (vLLM extension), default true */
    int32_t thinking;                /* chat_template_kwargs {"thinking" | "enable_thinking": bool}
                                        (vLLM extension; Kimi K2.5 thinking mode): 1 / 0, -1 = template default */
    sampling_params sp;              /* stop / stop_token_ids point at the arrays below */
    char **stop;                     /* [n_stop] malloc'd strings */
    size_t n_stop;
    int32_t *stop_token_ids;         /* [n_stop_token_ids] */
    size_t n_stop_token_ids;
    bool has_max_tokens;             /* max_tokens / max_completion_tokens given (not null) */
    int32_t max_tokens;              /* as requested, >= 0 (0 only with echo) */
    int32_t n;                       /* choices per prompt, 1..OAI_MAX_N (n_prompts * n <= OAI_MAX_N) */
    bool stream;
    bool include_usage;              /* stream_options.include_usage */
    bool echo;                       /* completions */
    int32_t logprobs;                /* -1 none; else top-N (completions: logprobs; chat: top_logprobs) */
    const char *max_tokens_param;    /* the field the client used: "max_tokens" or "max_completion_tokens" */
    /* logit_bias: [n_logit_bias] ids (vocabulary checked with the model) and biases in [-100, 100] */
    int32_t *logit_bias_ids; float *logit_bias; size_t n_logit_bias;
    /* chat tools (oai_tools.c) */
    char *tools_json;                /* `tools | tojson` as the template prints it; NULL = no tools */
    char **tool_names; size_t n_tools;
    oai_tool_choice tool_choice;
    char *tool_choice_name;          /* OAI_TOOL_CHOICE_NAMED */
    /* TEST-ONLY: "specd_test_forced_output" ids; refused unless the server runs
     * with SPECD_TEST_FORCED_OUTPUT=1 (http_gen.c) */
    int32_t *forced_ids; size_t n_forced_ids; bool has_forced;
} oai_request;

/* Parses BODY[0..LEN) (validated as UTF-8 first) for endpoint KIND.
 * On success fills *OUT (free with oai_request_free) and returns 0; on a bad
 * request returns -1 with *ERR (status 400, or 500 on OOM). */
int oai_parse_request(oai_kind kind, const char *body, size_t len, oai_request *out, oai_error *err);
void oai_request_free(oai_request *r); /* NULL ok; leaves *r zeroed */

/* 400 unless every id is in [0, vocab). PARAM names the field. */
int oai_check_ids(const int32_t *ids, size_t n, int32_t vocab, const char *param, oai_error *err);

/* Resolves the generation budget for a prompt of N_PROMPT tokens:
 * absent -> max_model_len - n_prompt (400 if that is < 1 and !echo-with-0);
 * prompt alone over the limit -> 400 stating both sizes; prompt + max_tokens
 * over the limit -> 400 stating the limit and both sizes. *MAX_TOKENS gets the
 * value for sampling_params (0 = echo only, nothing to generate). */
int oai_resolve_max_tokens(const oai_request *r, int32_t n_prompt, int32_t max_model_len, int32_t *max_tokens,
                           oai_error *err);

/* Validates UTF-8 (RFC 3629: no overlongs, no surrogates, <= U+10FFFF).
 * Returns the byte offset of the first invalid sequence, or LEN if valid. */
size_t oai_utf8_invalid_at(const char *s, size_t len);
/* Copies S replacing each invalid sequence by U+FFFD (malloc'd, NUL-terminated). */
char *oai_utf8_sanitize(const char *s, size_t len, size_t *out_len);

/* ---- tools and reasoning (oai_tools.c) ---- */
struct json_t;
/* Python json.dumps(v, ensure_ascii=False) of a jansson value (malloc'd). */
char *oai_json_pydumps(const struct json_t *v);
/* tools / tool_choice / parallel_tool_calls of a chat body into R. */
int oai_parse_tools(struct json_t *root, oai_request *r, oai_error *err);
/* messages[i].tool_calls / tool_call_id into CM (role already set). */
int oai_parse_msg_tools(struct json_t *e, size_t i, chat_message *cm, oai_error *err);
void oai_msg_tools_free(chat_message *cm);

typedef struct oai_tool_call {
    char *id, *name, *arguments; /* malloc'd; arguments = the JSON text the model wrote */
} oai_tool_call;

/* What one parse step produced (appended to; free with oai_parsed_free). */
typedef struct oai_parsed {
    char *reasoning; size_t reasoning_len;
    char *content;   size_t content_len;
    oai_tool_call *calls; size_t n_calls;
} oai_parsed;
void oai_parsed_free(oai_parsed *d);

/* Incremental output parser (see oai_tools.c for the grammar). */
typedef struct oai_outparse {
    bool reasoning, tools;
    char *buf; size_t len, cap;   /* all text so far (the forced prefix first) */
    size_t pos;                   /* bytes of buf already assigned */
    int phase;
    size_t sec_start, sec_calls;  /* current tool-call section: start, calls parsed */
    size_t n_calls;               /* calls parsed in total */
} oai_outparse;
/* PREFIX: text the prompt already opened the reply with (tool_choice required
 * / named); it is parsed as output but not repeated as content. */
int oai_outparse_init(oai_outparse *p, bool reasoning, bool tools, const char *prefix, size_t prefix_len);
void oai_outparse_free(oai_outparse *p);
/* Feeds TEXT (FINAL: no more will come: nothing is held back) and appends
 * what is now decided to *D. 0, or -1 on OOM. */
int oai_outparse_feed(oai_outparse *p, const char *text, size_t len, bool final, oai_parsed *d);

/* ---- responses ---- */

/* Token text for logprob rendering: the token's bytes (may be a partial
 * UTF-8 sequence); NULL if unknown. */
typedef const char *(*oai_token_bytes_fn)(void *ctx, int32_t id, size_t *len);

/* One finished (or streaming) choice's accumulated state. */
typedef struct oai_choice {
    int32_t index;
    char *text;  size_t text_len, text_cap;      /* accumulated text (non-streaming) */
    int32_t *ids; token_logprob *lps;            /* accumulated when logprobs wanted */
    size_t n_lps, lps_cap;
    finish_reason finish;
    char stop_reason[64];
    int32_t stop_token_id;
    int32_t n_prompt_tokens, n_completion_tokens, n_cached_tokens;
    /* echo + logprobs (completions): the prompt ids (borrowed, set by the
     * caller) and the engine's prompt logprobs (entry i is token i+1's) */
    const int32_t *echo_ids; size_t n_echo_ids;
    token_logprob *prompt_lps; size_t n_prompt_lps;
    /* echo with max_tokens 0 but logprobs: the engine ran one token for the
     * prompt logprobs; that token is not part of the answer */
    bool discard_generated;
} oai_choice;

/* Appends one engine delta to C (text, ids and logprobs if any); copies the
 * counters and the finish. Returns 0 or -1 on OOM. */
int oai_choice_add(oai_choice *c, const engine_output *o);
void oai_choice_free(oai_choice *c);

typedef struct oai_resp_ctx {
    oai_kind kind;
    const char *id;           /* "cmpl-..." / "chatcmpl-..." */
    long long created;        /* unix seconds */
    const char *model;        /* served model name */
    int32_t logprobs;         /* -1 none */
    oai_token_bytes_fn token_bytes;
    void *token_ctx;
    /* chat output parsing: reasoning_content and/or tool calls (oai_tools.c) */
    bool parse_reasoning, parse_tools;
    const char *out_prefix; size_t out_prefix_len;  /* see oai_outparse_init */
} oai_resp_ctx;

/* The non-streaming body: all CHOICES (in index order) and usage summed over
 * them (prompt tokens counted once per prompt: the caller passes the sum
 * N_PROMPT_TOTAL). Malloc'd JSON, NULL on OOM. */
char *oai_response_json(const oai_resp_ctx *rc, const oai_choice *choices, size_t n_choices,
                        int64_t n_prompt_total, size_t *len);

/* One SSE frame "data: {chunk}\n\n" for a delta of choice INDEX: TEXT (may be
 * empty), LPS/IDS (n_lps entries, or 0; completions' text_offset starts at
 * TEXT_OFFSET, the bytes of the choice's earlier tokens), FINISH (FINISH_NONE -> null).
 * ROLE_FIRST: chat's first chunk carrying {"role":"assistant"}. With
 * INCLUDE_USAGE the chunk carries "usage": null. Malloc'd, NULL on OOM. */
char *oai_chunk_sse(const oai_resp_ctx *rc, int32_t index, const char *text, size_t text_len,
                    const int32_t *ids, const token_logprob *lps, size_t n_lps, size_t text_offset, finish_reason finish,
                    const char *stop_reason, int32_t stop_token_id, bool role_first, bool include_usage,
                    size_t *len);
/* A chat chunk from a parsed delta D (reasoning_content, content,
 * tool_calls with indices from CALL_INDEX0); FINISH_STR overrides the finish
 * string ("tool_calls"), NULL = from FINISH. Malloc'd, NULL on OOM. */
char *oai_chat_parsed_sse(const oai_resp_ctx *rc, int32_t index, const oai_parsed *d, size_t call_index0,
                          const int32_t *ids, const token_logprob *lps, size_t n_lps, finish_reason finish,
                          const char *finish_str, const char *stop_reason, int32_t stop_token_id, bool include_usage,
                          size_t *len);
/* The final usage frame: choices [] and usage. */
char *oai_usage_sse(const oai_resp_ctx *rc, int64_t prompt_tokens, int64_t completion_tokens, size_t *len);
/* An error as an SSE frame (after headers were sent): data: {"error":...}\n\n */
char *oai_error_sse(const oai_error *e, size_t *len);
#define OAI_SSE_DONE "data: [DONE]\n\n"

const char *oai_finish_str(finish_reason f); /* "stop", "length", "abort", "error", NULL */

#endif
