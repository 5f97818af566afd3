/*
 * http.c: the libmicrohttpd daemon of `specd serve`: limits, routing, body
 * accumulation, authentication, the simple endpoints (/health, /metrics,
 * /v1/models, /v1/specd/config), the request registry and ticker, shutdown.
 * Generation endpoints live in http_gen.c.
 *
 * Limits (STYLE.md: MHD's defaults are "none"): --max-connections,
 * --per-ip-connections, --connection-timeout, --max-body-bytes. A body over
 * the limit is read and discarded (so an ordinary client sees the answer
 * rather than a reset) and answered 413; a body announced far over the limit
 * (16x) or with "Expect: 100-continue" is refused before it is sent.
 *
 * Suspended connections neither time out nor notice a peer that went away,
 * so the ticker resumes every suspended request once per second; a resumed
 * request that finds nothing new peeks at its socket (MSG_PEEK) and aborts its
 * engine streams when the peer has closed.
 *
 * Threading: see http_internal.h.
 */
#include "server/http_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "engine/util/log.h"

double http_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ==== responses ==== */
static enum MHD_Result send_buf(struct MHD_Connection *c, int status, const char *body, size_t len, const char *ctype,
                                const char *retry_after) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (retry_after) MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, retry_after);
    enum MHD_Result rc = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return rc;
}

enum MHD_Result http_send_json(struct MHD_Connection *c, int status, const char *json, size_t len) {
    return send_buf(c, status, json, len, "application/json", NULL);
}

enum MHD_Result http_send_error(http_req *r, const oai_error *e) {
    size_t len = 0;
    char *j = oai_error_json(e, &len);
    r->status = e->status;
    if (!j) return MHD_NO;
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, j, MHD_RESPMEM_MUST_FREE);
    if (!resp) return free(j), MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    if (e->status == 429) MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, "1");
    if (e->status == 503) MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, "5");
    if (e->status == 401) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    enum MHD_Result rc = MHD_queue_response(r->conn, (unsigned)e->status, resp);
    MHD_destroy_response(resp);
    return rc;
}

/* ==== registry + wake protocol ==== */
void http_registry_add(http_req *r) {
    http_server *s = r->srv;
    pthread_mutex_lock(&s->reg_mu);
    r->reg_prev = NULL;
    r->reg_next = s->reg_head;
    if (s->reg_head) s->reg_head->reg_prev = r;
    s->reg_head = r;
    r->registered = true;
    s->n_active++;
    pthread_mutex_unlock(&s->reg_mu);
}

void http_registry_remove(http_req *r) {
    http_server *s = r->srv;
    pthread_mutex_lock(&s->reg_mu);
    if (r->registered) {
        if (r->reg_prev) r->reg_prev->reg_next = r->reg_next;
        else s->reg_head = r->reg_next;
        if (r->reg_next) r->reg_next->reg_prev = r->reg_prev;
        r->registered = false;
        s->n_active--;
    }
    pthread_mutex_unlock(&s->reg_mu);
}

void http_req_clear_wake(http_req *r) {
    pthread_mutex_lock(&r->mu);
    r->wake = false;
    pthread_mutex_unlock(&r->mu);
}

bool http_req_suspend(http_req *r) {
    pthread_mutex_lock(&r->mu);
    if (r->wake || atomic_load(&r->srv->stopping)) {
        r->wake = false;
        pthread_mutex_unlock(&r->mu);
        return false;
    }
    r->suspended = true;
    MHD_suspend_connection(r->conn);
    pthread_mutex_unlock(&r->mu);
    return true;
}

static void req_wake(http_req *r, bool tick) {
    pthread_mutex_lock(&r->mu);
    r->wake = true;
    if (tick) r->tick = true;
    if (r->suspended) {
        r->suspended = false;
        MHD_resume_connection(r->conn);
    }
    pthread_mutex_unlock(&r->mu);
}

void http_req_notify(void *arg) { req_wake((http_req *)arg, false); }

bool http_peer_closed(http_req *r) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return false;
    char b;
    ssize_t n = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return true;
    return false;
}

static void *ticker_main(void *arg) {
    http_server *s = arg;
    pthread_mutex_lock(&s->tick_mu);
    while (!atomic_load(&s->stopping)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        pthread_cond_timedwait(&s->tick_cv, &s->tick_mu, &ts);
        if (atomic_load(&s->stopping)) break;
        pthread_mutex_lock(&s->reg_mu);
        for (http_req *r = s->reg_head; r; r = r->reg_next) req_wake(r, true);
        pthread_mutex_unlock(&s->reg_mu);
    }
    pthread_mutex_unlock(&s->tick_mu);
    return NULL;
}

/* ==== simple endpoints ==== */
static enum MHD_Result handle_health(http_req *r) {
    http_state st = (http_state)atomic_load(&r->srv->state);
    if (st == HTTP_SERVING) {
        r->status = 200;
        return send_buf(r->conn, 200, "", 0, "text/plain", NULL);
    }
    oai_error e;
    oai_error_set(&e, 503, NULL, "%s", st == HTTP_LOADING ? "the model is loading" : "the server is shutting down");
    return http_send_error(r, &e);
}

static enum MHD_Result handle_metrics(http_req *r) {
    http_server *s = r->srv;
    engine_stats es;
    bool have = atomic_load(&s->state) != HTTP_LOADING && s->eng;
    if (have) engine_get_stats(s->eng, &es);
    size_t len = 0;
    char *txt = metrics_render(s->metrics, have ? &es : NULL, atomic_load(&s->state) == HTTP_SERVING, &len);
    if (!txt) return MHD_NO;
    r->status = 200;
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, txt, MHD_RESPMEM_MUST_FREE);
    if (!resp) return free(txt), MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8");
    enum MHD_Result rc = MHD_queue_response(r->conn, 200, resp);
    MHD_destroy_response(resp);
    return rc;
}

static enum MHD_Result handle_models(http_req *r) {
    http_server *s = r->srv;
    if (r->model_id[0]) { /* GET /v1/models/{id} (the openai client's models.retrieve) */
        if (atomic_load(&s->state) == HTTP_LOADING || strcmp(r->model_id, s->model_name)) {
            oai_error e;
            oai_error_set(&e, 404, "model", "The model `%s` does not exist.", r->model_id);
            return http_send_error(r, &e);
        }
        json_t *m = json_pack("{s:s,s:s,s:I,s:s,s:s,s:i}", "id", s->model_name, "object", "model", "created",
                              (json_int_t)s->model_created, "owned_by", "specd", "root", s->model_root,
                              "max_model_len", s->max_model_len);
        char *j = m ? json_dumps(m, JSON_COMPACT) : NULL;
        json_decref(m);
        if (!j) return MHD_NO;
        r->status = 200;
        enum MHD_Result rc = http_send_json(r->conn, 200, j, strlen(j));
        free(j);
        return rc;
    }
    json_t *data = json_array();
    if (atomic_load(&s->state) != HTTP_LOADING) {
        json_array_append_new(data, json_pack("{s:s,s:s,s:I,s:s,s:s,s:i}", "id", s->model_name, "object", "model",
                                              "created", (json_int_t)s->model_created, "owned_by", "specd", "root",
                                              s->model_root, "max_model_len", s->max_model_len));
    }
    json_t *root = json_pack("{s:s,s:o}", "object", "list", "data", data);
    char *j = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (!j) return MHD_NO;
    r->status = 200;
    enum MHD_Result rc = http_send_json(r->conn, 200, j, strlen(j));
    free(j);
    return rc;
}

/* ==== routing ==== */
static http_route route_of(const char *method, const char *url, bool *method_ok, const char **endpoint) {
    static const struct {
        const char *url, *method, *endpoint;
        http_route route;
    } table[] = {
        {"/health", "GET", "health", R_HEALTH},
        {"/metrics", "GET", "metrics", R_METRICS},
        {"/v1/models", "GET", "models", R_MODELS},
        {"/v1/specd/config", "GET", "config", R_CONFIG},
        {"/v1/completions", "POST", "completions", R_COMPLETIONS},
        {"/v1/chat/completions", "POST", "chat", R_CHAT},
        {"/tokenize", "POST", "tokenize", R_TOKENIZE},
        {"/detokenize", "POST", "detokenize", R_DETOKENIZE},
    };
    *method_ok = true;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(url, table[i].url)) continue;
        *endpoint = table[i].endpoint;
        bool head_ok = !strcmp(method, "HEAD") && !strcmp(table[i].method, "GET");
        if (strcmp(method, table[i].method) && !head_ok) *method_ok = false;
        return table[i].route;
    }
    *endpoint = "other";
    return R_NOT_FOUND;
}

static bool needs_auth(http_route rt) {
    return rt == R_MODELS || rt == R_CONFIG || rt == R_COMPLETIONS || rt == R_CHAT || rt == R_TOKENIZE ||
           rt == R_DETOKENIZE;
}

static bool has_body(http_route rt) {
    return rt == R_COMPLETIONS || rt == R_CHAT || rt == R_TOKENIZE || rt == R_DETOKENIZE;
}

static enum MHD_Result dispatch(http_req *r) {
    http_server *s = r->srv;
    oai_error e;
    if (r->auth_failed) {
        oai_error_set(&e, 401, NULL, "Incorrect or missing API key (send 'Authorization: Bearer <key>')");
        return http_send_error(r, &e);
    }
    if (r->too_large) {
        oai_error_set(&e, 413, NULL, "the request body exceeds the limit of %lld bytes",
                      (long long)s->cfg->max_body_bytes);
        return http_send_error(r, &e);
    }
    switch (r->route) {
    case R_HEALTH: return handle_health(r);
    case R_METRICS: return handle_metrics(r);
    case R_MODELS: return handle_models(r);
    case R_CONFIG:
        r->status = 200;
        return http_send_json(r->conn, 200, s->config_json ? s->config_json : "{}",
                              s->config_json ? strlen(s->config_json) : 2);
    default: break;
    }
    http_state st = (http_state)atomic_load(&s->state);
    if (st != HTTP_SERVING) {
        oai_error_set(&e, 503, NULL, "%s", st == HTTP_LOADING ? "the model is still loading" : "the server is shutting down");
        return http_send_error(r, &e);
    }
    switch (r->route) {
    case R_COMPLETIONS:
    case R_CHAT: return http_gen_begin(r);
    case R_TOKENIZE: return http_tokenize(r);
    case R_DETOKENIZE: return http_detokenize(r);
    default: break;
    }
    oai_error_set(&e, 404, NULL, "no such endpoint");
    snprintf(e.type, sizeof e.type, "NotFoundError");
    e.code[0] = 0;
    return http_send_error(r, &e);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **req_cls) {
    http_server *s = cls;
    http_req *r = *req_cls;
    if (!r) {
        r = calloc(1, sizeof *r);
        if (!r) return MHD_NO;
        r->srv = s;
        r->conn = conn;
        r->t_start = http_now();
        r->ttft = -1;
        pthread_mutex_init(&r->mu, NULL);
        *req_cls = r;
        bool method_ok;
        r->route = route_of(method, url, &method_ok, &r->endpoint);
        if (r->route == R_NOT_FOUND && !strncmp(url, "/v1/models/", 11) && url[11] &&
            strlen(url + 11) < sizeof r->model_id) {
            snprintf(r->model_id, sizeof r->model_id, "%s", url + 11);
            r->route = R_MODELS;
            r->endpoint = "models";
            method_ok = !strcmp(method, "GET") || !strcmp(method, "HEAD");
        }
        if (r->route != R_NOT_FOUND && !method_ok) {
            oai_error e;
            oai_error_set(&e, 405, NULL, "method %s is not allowed on %s", method, url);
            r->phase = PH_DONE;
            return http_send_error(r, &e);
        }
        if (needs_auth(r->route)) {
            const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
            r->auth_failed = !auth_check(s->auth, h);
        }
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        const char *expect = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
        long long clen = cl ? atoll(cl) : 0;
        if (clen > s->cfg->max_body_bytes && (expect || clen > 16 * s->cfg->max_body_bytes || r->auth_failed)) {
            /* refuse before the body is sent */
            r->too_large = true;
            r->phase = PH_DONE;
            return dispatch(r);
        }
        return MHD_YES;
    }
    if (r->phase == PH_BODY) {
        if (*upload_data_size) {
            size_t n = *upload_data_size;
            *upload_data_size = 0;
            if (r->too_large || !has_body(r->route) || r->auth_failed) return MHD_YES; /* discard */
            if (r->body_len + n > (size_t)s->cfg->max_body_bytes) {
                r->too_large = true;
                free(r->body);
                r->body = NULL;
                r->body_len = r->body_cap = 0;
                return MHD_YES;
            }
            if (r->body_len + n + 1 > r->body_cap) {
                size_t cap = r->body_cap ? r->body_cap : 4096;
                while (cap < r->body_len + n + 1) cap *= 2;
                char *b = realloc(r->body, cap);
                if (!b) return MHD_NO;
                r->body = b;
                r->body_cap = cap;
            }
            memcpy(r->body + r->body_len, upload_data, n);
            r->body_len += n;
            r->body[r->body_len] = 0;
            return MHD_YES;
        }
        r->phase = PH_DONE; /* http_gen_begin moves it to PH_WAIT / PH_STREAM */
        return dispatch(r);
    }
    if (r->phase == PH_WAIT) return http_gen_resume(r);
    return MHD_YES;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **req_cls, enum MHD_RequestTerminationCode toe) {
    http_req *r = *req_cls;
    if (!r) return;
    *req_cls = NULL;
    http_registry_remove(r);
    if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK && r->n_done < (int)r->n_streams) r->client_gone = true;
    http_gen_release(r);
    double total = http_now() - r->t_start;
    int status = r->status ? r->status : 500;
    if (r->client_gone) status = 499; /* nginx's "client closed request" */
    metrics_request(r->srv->metrics, r->endpoint, status);
    bool generation = r->route == R_COMPLETIONS || r->route == R_CHAT || r->route == R_TOKENIZE ||
                      r->route == R_DETOKENIZE;
    if (!generation && r->route != R_HEALTH && r->route != R_METRICS && status >= 400)
        LOG_INFO("request - %s status=%d total_ms=%.1f", r->endpoint, status, total * 1e3);
    if (generation) {
        if (r->n_streams && !r->client_gone && r->status == 200) {
            double tpot = -1;
            int64_t per = r->n_streams ? r->completion_tokens_total / (int64_t)r->n_streams : 0;
            if (per > 1 && r->ttft >= 0) tpot = (total - r->ttft) / (double)(per - 1);
            metrics_latency(r->srv->metrics, r->ttft, tpot, total);
        }
        /* toe: why MHD ended the request when not completed (1 error, 2 timeout, 3 daemon shutdown,
         * 4 read error, 5 client abort), so an early close can be told apart in the log */
        LOG_INFO("request %s %s status=%d prompt_tokens=%lld completion_tokens=%lld ttft_ms=%.1f total_ms=%.1f%s%s",
                 r->id[0] ? r->id : "-", r->endpoint, status, (long long)r->prompt_tokens_total,
                 (long long)r->completion_tokens_total, r->ttft >= 0 ? r->ttft * 1e3 : -1.0, total * 1e3,
                 r->client_gone ? " (client gone)" : "",
                 toe == MHD_REQUEST_TERMINATED_COMPLETED_OK ? ""
                 : toe == MHD_REQUEST_TERMINATED_WITH_ERROR ? " (mhd: terminated with error)"
                 : toe == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED ? " (mhd: timeout)"
                 : toe == MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN ? " (mhd: daemon shutdown)"
                 : toe == MHD_REQUEST_TERMINATED_READ_ERROR ? " (mhd: read error)"
                 : " (mhd: client abort)");
    }
    http_gen_free(r);
    free(r->body);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* MHD's logger passes its own printf format: forward it. */
__attribute__((format(printf, 2, 0))) static void log_mhd(void *cls, const char *fmt, va_list ap) {
    char buf[512];
    vsnprintf(buf, sizeof buf, fmt, ap);
    size_t n = strlen(buf);
    while (n && buf[n - 1] == '\n') buf[--n] = 0;
    LOG_DEBUG("http: %s", buf);
}

/* ==== lifecycle ==== */
int http_start(const http_opts *o, http_server **out, specd_err *err) {
    *out = NULL;
    http_server *s = calloc(1, sizeof *s);
    if (!s) return specd_err_set(err, "out of memory");
    s->cfg = o->cfg;
    s->auth = o->auth;
    s->metrics = o->metrics;
    s->config_json = o->config_json;
    atomic_store(&s->state, HTTP_LOADING);
    pthread_mutex_init(&s->reg_mu, NULL);
    pthread_mutex_init(&s->tick_mu, NULL);
    pthread_cond_init(&s->tick_cv, NULL);

    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    const char *host = o->cfg->host ? o->cfg->host : "127.0.0.1";
    struct sockaddr_in *v4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons((uint16_t)o->cfg->port);
    } else if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons((uint16_t)o->cfg->port);
        flags |= MHD_USE_IPv6;
    } else if (!strcmp(host, "localhost")) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons((uint16_t)o->cfg->port);
        v4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    } else {
        specd_err_set(err, "--host %s: not an IPv4/IPv6 address", host);
        goto fail;
    }
    s->d = MHD_start_daemon(flags, (uint16_t)o->cfg->port, NULL, NULL, on_request, s,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)o->cfg->max_connections,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)o->cfg->per_ip_connections,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)o->cfg->connection_timeout,
                            MHD_OPTION_THREAD_POOL_SIZE, (unsigned)o->cfg->http_threads,
                            MHD_OPTION_EXTERNAL_LOGGER, log_mhd, s,
                            MHD_OPTION_END);
    if (!s->d) {
        specd_err_set(err, "cannot listen on %s:%d (%s)", host, o->cfg->port, strerror(errno));
        goto fail;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : (uint16_t)o->cfg->port;
    if (pthread_create(&s->ticker, NULL, ticker_main, s)) {
        specd_err_set(err, "cannot start the ticker thread");
        goto fail;
    }
    s->ticker_started = true;
    *out = s;
    return 0;
fail:
    http_stop(s, 0);
    return -1;
}

void http_attach_engine(http_server *s, engine *e, const char *model_name, const char *model_root,
                        int32_t max_model_len) {
    s->eng = e;
    s->tok = engine_tokenizer(e);
    s->vocab = tok_vocab_size(s->tok);
    snprintf(s->model_name, sizeof s->model_name, "%s", model_name);
    snprintf(s->model_root, sizeof s->model_root, "%s", model_root ? model_root : "");
    s->max_model_len = max_model_len;
    s->model_created = (long long)time(NULL);
    atomic_store(&s->state, HTTP_SERVING);
}

void http_set_draining(http_server *s) { atomic_store(&s->state, HTTP_DRAINING); }
void http_set_draining_why(http_server *s, const char *why) {
    if (atomic_load(&s->state) != HTTP_DRAINING) /* written before the (seq_cst) store readers load */
        snprintf(s->drain_why, sizeof s->drain_why, "%s", why ? why : "");
    atomic_store(&s->state, HTTP_DRAINING);
}
http_state http_get_state(const http_server *s) { return (http_state)atomic_load(&s->state); }
uint16_t http_port(const http_server *s) { return s->port; }

int http_active_requests(http_server *s) {
    pthread_mutex_lock(&s->reg_mu);
    int n = s->n_active;
    pthread_mutex_unlock(&s->reg_mu);
    return n;
}

void http_stop(http_server *s, double grace_s) {
    if (!s) return;
    atomic_store(&s->stopping, true);
    if (s->ticker_started) {
        pthread_mutex_lock(&s->tick_mu);
        pthread_cond_broadcast(&s->tick_cv);
        pthread_mutex_unlock(&s->tick_mu);
        pthread_join(s->ticker, NULL);
    }
    if (s->d) {
        /* Resume every suspended connection (a stopped daemon must have none);
         * with `stopping` set they finish instead of suspending again. */
        double until = http_now() + grace_s;
        for (;;) {
            pthread_mutex_lock(&s->reg_mu);
            for (http_req *r = s->reg_head; r; r = r->reg_next) {
                engine_stream **st = r->streams;
                for (size_t i = 0; st && i < r->n_streams; i++)
                    if (st[i]) engine_stream_abort(st[i]);
                req_wake(r, true);
            }
            int n = s->n_active;
            pthread_mutex_unlock(&s->reg_mu);
            if (n == 0 || http_now() > until) break;
            struct timespec ts = {0, 20 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        MHD_stop_daemon(s->d);
    }
    pthread_cond_destroy(&s->tick_cv);
    pthread_mutex_destroy(&s->tick_mu);
    pthread_mutex_destroy(&s->reg_mu);
    free(s);
}
