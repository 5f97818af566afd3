/*
 * client.h: the load generator. Sends a workload to an OpenAI-compatible
 * server over HTTP and records, per request, what a client observes.
 *
 * One thread drives every request through libcurl's multi interface (an event
 * loop; no thread per request). Requests are released at the times of the
 * arrival schedule (schedule.h) and, like vLLM's bench serve, a released
 * request waits for a free slot when --max-concurrency is reached; its
 * latency clock starts when it is actually sent.
 *
 * Every request streams (stream: true, stream_options.include_usage: true).
 * Per request: TTFT = time from send to the first chunk whose delta carries
 * text (a role-only or finish-only chunk is not a token); ITL = gaps between
 * successive text-carrying chunks (under speculation one chunk may carry
 * several tokens, so ITLs are per chunk, not per token); E2E latency = send to
 * end of the response. Token counts come only from the final `usage` object
 * (prompt_tokens, completion_tokens), never from counting chunks; a stream
 * without usage is a failed request with that reason, because its tokens
 * cannot be counted honestly. TPOT is derived later (report.c). Only when the
 * caller names a tokenize endpoint (for servers that never stream usage, such
 * as llama-cpp-python's) are such streams counted, after the run, by asking
 * the server to tokenize the generated text (and the raw prompt, without its
 * chat template); those records are flagged `retokenized`, and the count is an
 * approximation (re-tokenizing text can merge tokens differently).
 *
 * Threading: bench_client_run blocks its caller and uses no other thread.
 */
#ifndef SPECD_BENCH_CLIENT_H
#define SPECD_BENCH_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "bench/dataset.h"
#include "engine/util/err.h"

#define BENCH_DEFAULT_MAX_TOKENS 128

typedef struct bench_client_cfg {
    const char *base_url;   /* e.g. "http://127.0.0.1:8000" */
    const char *endpoint;   /* "/v1/chat/completions" or "/v1/completions" */
    const char *model;      /* "model" field */
    const char *api_key;    /* Bearer token, or NULL */
    const char *extra_body; /* JSON object merged into every request body, or NULL */
    int max_tokens;         /* > 0: every request's max_tokens; else the prompt's output_len,
                               else BENCH_DEFAULT_MAX_TOKENS */
    double temperature;
    int ignore_eos;         /* send the vLLM extension field ignore_eos: true */
    double request_rate;    /* requests/s, INFINITY = all at once */
    double burstiness;      /* gamma shape of the inter-arrival gaps */
    size_t max_concurrency; /* in-flight cap, 0 = none */
    uint64_t seed;          /* arrival schedule seed */
    double timeout_s;       /* per-request limit, 0 = none */
    int keep_text;          /* keep generated text in the records */
    const char *tokenize_path; /* NULL, or a tokenize endpoint (e.g. /extras/tokenize) used to count
                                  the tokens of streams that carry no usage; see bench_tokenize_count */
    int quiet;              /* no progress line on stderr */
} bench_client_cfg;

typedef struct bench_record {
    size_t prompt_idx;
    int success;
    char *error;       /* owned failure reason, NULL on success */
    double send_s;     /* send time, seconds since the run's start */
    double ttft_s;     /* seconds; < 0 when no text chunk arrived */
    double latency_s;  /* end-to-end seconds */
    double *itl_s;     /* owned, n_itl gaps in seconds */
    size_t n_itl, cap_itl;
    long prompt_tokens, output_tokens; /* from usage; -1 when absent */
    size_t n_chunks;   /* text-carrying chunks */
    int retokenized;   /* the server sent no usage: counts come from re-tokenizing the texts
                          (prompt without chat template, generated text), see tokenize_path */
    char *text;        /* owned generated text when keep_text, else NULL */
    size_t text_len, text_cap;
} bench_record;

typedef struct bench_run {
    bench_record *rec; /* owned, n records in prompt order */
    size_t n;
    double duration_s;       /* first send to last completion */
    size_t peak_concurrency; /* most requests in flight at once */
} bench_run;

/* Runs prompts [0, n) of ds (n <= ds->n). Returns 0 with *out filled (free
 * with bench_run_free) even when requests failed (see each record), or -1
 * with err set when the run itself could not proceed (curl setup, OOM). */
int bench_client_run(const bench_client_cfg *cfg, const bench_dataset *ds, size_t n, bench_run *out,
                     specd_err *err);
void bench_run_free(bench_run *r);

/* ---- interpreting one stream (exposed for tests) ---------------------------- */

typedef struct bench_stream {
    bench_record *rec;
    int chat;          /* chat deltas (choices[0].delta.content) vs completions text */
    int keep_text;     /* append text to rec->text */
    double t_start;    /* monotonic seconds at send */
    double t_last;     /* monotonic seconds of the last text chunk */
    int got_first, got_usage, got_done;
    char *server_error; /* owned: an {"error": ...} event's message */
} bench_stream;

/* Interprets one SSE event's data at monotonic time now (seconds).
 * Returns 0, or -1 when the data is not JSON (the record then fails). */
int bench_stream_event(bench_stream *s, const char *data, size_t len, double now);

/* Number of tokens the server's tokenize endpoint (base_url + path) gives for
 * text: POSTs {"model", "input", "prompt", "add_special_tokens": false} (the
 * field names of llama-cpp-python and vLLM) and reads "tokens" (array) or
 * "count". Returns the count, or -1 with err set. */
long bench_tokenize_count(const char *base_url, const char *path, const char *model, const char *text,
                          specd_err *err);

/* Blocking request: GET, or POST of a JSON body when post_json is not NULL. */
int bench_http_request(const char *base_url, const char *path, const char *post_json, double timeout_s,
                       char **body, size_t *len, long *status, specd_err *err);

/* Monotonic clock in seconds. */
double bench_now(void);

/* Blocking GET of base_url + path. *body (caller frees, NUL-terminated) and
 * *status are set when the transfer completed; returns -1 with err set on a
 * transport failure. */
int bench_http_get(const char *base_url, const char *path, double timeout_s, char **body, size_t *len,
                   long *status, specd_err *err);

#endif
