/*
 * http.h: the HTTP front of `specd serve` on libmicrohttpd (internal polling
 * threads, suspend/resume).
 *
 * Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
 * GET /health, GET /metrics, POST /tokenize, POST /detokenize,
 * GET /v1/specd/config (the flag table's values, secrets redacted).
 *
 * Lifecycle: http_start binds and serves at once in state LOADING (/health
 * answers 503 so load balancers and tests can poll); http_attach_engine hands
 * over the engine once the model is loaded and warmed up and flips to
 * SERVING; http_set_draining (SIGTERM) makes /health and every new generation
 * 503 while in-flight streams continue; http_stop resumes every suspended
 * connection, waits for them to end and stops the daemon.
 *
 * Threading: MHD's polling threads run the handlers; the engine thread only
 * calls the per-request notify (resume); one ticker thread resumes suspended
 * connections periodically so that disconnects are noticed (MHD does not time
 * out or watch suspended connections).
 */
#ifndef SPECD_SERVER_HTTP_H
#define SPECD_SERVER_HTTP_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/runtime/engine.h"
#include "engine/util/err.h"
#include "server/auth.h"
#include "server/config.h"
#include "server/metrics.h"

typedef struct http_server http_server;

typedef struct http_opts {
    const specd_config *cfg;   /* host, port, limits; borrowed, must outlive the server */
    auth *auth;                /* borrowed */
    metrics *metrics;          /* borrowed */
    const char *config_json;   /* GET /v1/specd/config body; borrowed */
} http_opts;

typedef enum { HTTP_LOADING = 0, HTTP_SERVING = 1, HTTP_DRAINING = 2 } http_state;

int http_start(const http_opts *o, http_server **out, specd_err *err);
/* Attaches the running engine (borrowed) and switches to SERVING. MODEL_NAME
 * is the name clients must send; MAX_MODEL_LEN the context limit. */
void http_attach_engine(http_server *s, engine *e, const char *model_name, const char *model_root,
                        int32_t max_model_len);
void http_set_draining(http_server *s);
/* http_set_draining with the reason the server stops for ("tensor parallel
 * group failed: rank 1 ... exited (signal 9)"), copied (truncated at 511
 * bytes): requests aborted from then on carry it in their error message, so a
 * client sees why, not only that the server went away. NULL or "" = no reason. */
void http_set_draining_why(http_server *s, const char *why);
http_state http_get_state(const http_server *s);
/* Number of requests with generation still in flight (streams open). */
int http_active_requests(http_server *s);
/* Stops: ends every open response (resuming suspended connections first),
 * waits up to GRACE_S for them to close, stops the daemon, frees. NULL ok. */
void http_stop(http_server *s, double grace_s);
/* Port actually bound (useful with --port 0). */
uint16_t http_port(const http_server *s);

#endif
