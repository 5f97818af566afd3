/*
 * http_internal.h: state shared by http.c (daemon, routing, simple
 * endpoints) and http_gen.c (completions: submit, wait, stream). Not a public
 * header.
 *
 * Per-connection state (http_req) lives in MHD's *req_cls from the first
 * handler call to the completion callback, which frees it. A request with
 * engine streams is also on the server's registry list so the ticker and
 * http_stop can reach it; the list is guarded by srv->reg_mu, and a request
 * is removed from it (under that lock) before being freed.
 *
 * Wake protocol between the engine thread (notify) and the MHD thread:
 *   MHD thread: lock(r->mu); wake = false; unlock; poll streams;
 *               if nothing: lock; if wake -> poll again; else suspended = true,
 *               MHD_suspend_connection; unlock.
 *   notify:     lock(r->mu); wake = true; if suspended -> suspended = false,
 *               MHD_resume_connection; unlock.
 * so an output pushed between the poll and the suspend is never lost.
 */
#ifndef SPECD_SERVER_HTTP_INTERNAL_H
#define SPECD_SERVER_HTTP_INTERNAL_H

#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>

#include "server/http.h"
#include "server/oai.h"

typedef enum {
    R_NONE, R_HEALTH, R_METRICS, R_MODELS, R_CONFIG, R_COMPLETIONS, R_CHAT, R_TOKENIZE, R_DETOKENIZE, R_NOT_FOUND,
} http_route;

typedef enum { PH_BODY, PH_WAIT, PH_STREAM, PH_DONE } http_phase;

typedef struct http_req http_req;

struct http_server {
    struct MHD_Daemon *d;
    const specd_config *cfg;
    auth *auth;
    metrics *metrics;
    const char *config_json;
    _Atomic int state;                  /* http_state */
    char drain_why[512];                /* written once before state becomes DRAINING; "" = SIGTERM */
    engine *eng;                        /* set before state becomes SERVING */
    const tokenizer *tok;
    char model_name[256];
    char model_root[1024];
    int32_t max_model_len;
    int32_t vocab;
    long long model_created;
    uint16_t port;
    pthread_mutex_t reg_mu;
    http_req *reg_head;                 /* requests with open engine streams */
    int n_active;
    pthread_t ticker;
    bool ticker_started;
    _Atomic bool stopping;
    pthread_mutex_t tick_mu;
    pthread_cond_t tick_cv;
};

struct http_req {
    http_server *srv;
    struct MHD_Connection *conn;
    http_route route;
    http_phase phase;
    const char *endpoint;               /* metrics label */
    char model_id[256];                 /* GET /v1/models/{id}: the id asked for ("" = the list) */
    /* body */
    char *body;
    size_t body_len, body_cap;
    bool too_large;
    bool auth_failed;
    /* generation */
    oai_request oreq;
    oai_resp_ctx rc;
    char id[48];
    size_t n_streams;                   /* n_prompts * n */
    engine_stream **streams;
    oai_choice *choices;
    bool *done;
    int64_t prompt_tokens_total;        /* once per prompt */
    int64_t completion_tokens_total;
    char **echo_text;                   /* [n_prompts] echoed prompt text (completions with echo) */
    size_t *echo_len;
    int n_done;
    /* chat output parsing (tools / reasoning): one parser per choice when streaming */
    oai_outparse *parsers;
    char *out_prefix;                   /* tool_choice required / named: the reply's forced opening */
    size_t out_prefix_len;
    bool any_error;
    int32_t error_status;   /* engine_output.error_status of the first error (503: overloaded), 0 = 500 */
    char error_msg[640];
    /* streaming output buffer (SSE bytes not yet handed to MHD) */
    char *out;
    size_t out_len, out_off, out_cap;
    bool sse_finished;                  /* [DONE] appended */
    /* wake protocol (see above) */
    pthread_mutex_t mu;
    bool suspended, wake, tick;
    /* registry */
    http_req *reg_next, *reg_prev;
    bool registered;
    /* accounting */
    int status;
    double t_start;                     /* monotonic seconds */
    double ttft;                        /* first output's engine ttft, -1 none */
    bool client_gone;
};

double http_now(void);

/* http.c */
enum MHD_Result http_send_json(struct MHD_Connection *c, int status, const char *json, size_t len);
enum MHD_Result http_send_error(http_req *r, const oai_error *e);
void http_registry_add(http_req *r);
void http_registry_remove(http_req *r);
bool http_peer_closed(http_req *r);
/* Suspends unless a wake arrived; returns true if suspended. */
bool http_req_suspend(http_req *r);
void http_req_clear_wake(http_req *r);
void http_req_notify(void *arg);

/* http_gen.c */
/* Final handler call of /v1/completions or /v1/chat/completions (body complete). */
enum MHD_Result http_gen_begin(http_req *r);
/* Handler call after a resume while waiting for a non-streaming result. */
enum MHD_Result http_gen_resume(http_req *r);
/* Aborts and releases every engine stream of R (client gone / cleanup). */
void http_gen_release(http_req *r);
void http_gen_free(http_req *r);
/* POST /tokenize, /detokenize. */
enum MHD_Result http_tokenize(http_req *r);
enum MHD_Result http_detokenize(http_req *r);

#endif
