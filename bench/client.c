/*
 * client.c: the curl-multi event loop, request bodies and stream
 * interpretation (see client.h for what is measured and why).
 *
 * Loop invariant: every request is in exactly one state: not yet released
 * (index >= next), in flight (its easy handle is in the multi handle), or
 * finished (its record is final). Time stamps are taken in the write
 * callback, when the bytes reach the client, so TTFT/ITL include the network
 * and SSE framing but not our JSON work on earlier events.
 */
#include "bench/client.h"

#include <curl/curl.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench/schedule.h"
#include "bench/sse.h"

#define ERR_BODY_MAX 2048 /* bytes of a non-200 body kept for the failure reason */

double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- records ----------------------------------------------------------------- */

static void record_clear(bench_record *r) {
    free(r->error);
    free(r->itl_s);
    free(r->text);
}

void bench_run_free(bench_run *r) {
    if (!r) return;
    for (size_t i = 0; i < r->n; i++) record_clear(&r->rec[i]);
    free(r->rec);
    memset(r, 0, sizeof *r);
}

static int record_push_itl(bench_record *r, double v) {
    if (r->n_itl == r->cap_itl) {
        size_t nc = r->cap_itl ? r->cap_itl * 2 : 64;
        double *n = realloc(r->itl_s, nc * sizeof *n);
        if (!n) return -1;
        r->itl_s = n;
        r->cap_itl = nc;
    }
    r->itl_s[r->n_itl++] = v;
    return 0;
}

static int record_push_text(bench_record *r, const char *s, size_t n) {
    if (r->text_len + n + 1 > r->text_cap) {
        size_t nc = (r->text_len + n + 1) * 2;
        char *t = realloc(r->text, nc);
        if (!t) return -1;
        r->text = t;
        r->text_cap = nc;
    }
    memcpy(r->text + r->text_len, s, n);
    r->text_len += n;
    r->text[r->text_len] = '\0';
    return 0;
}

static void record_fail(bench_record *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void record_fail(bench_record *r, const char *fmt, ...) {
    if (r->error) return; /* keep the first reason */
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    r->success = 0;
    r->error = strdup(buf);
}

/* ---- stream interpretation ------------------------------------------------------ */

int bench_stream_event(bench_stream *s, const char *data, size_t len, double now) {
    bench_record *r = s->rec;
    if (len == 6 && memcmp(data, "[DONE]", 6) == 0) {
        s->got_done = 1;
        return 0;
    }
    json_error_t jerr;
    json_t *o = json_loadb(data, len, 0, &jerr);
    if (!o) {
        record_fail(r, "invalid JSON in stream: %s", jerr.text);
        return -1;
    }
    json_t *e = json_object_get(o, "error");
    if (e) {
        const char *m = json_is_object(e) ? json_string_value(json_object_get(e, "message"))
                                          : json_string_value(e);
        if (!s->server_error) s->server_error = strdup(m ? m : "(no message)");
    }
    json_t *choices = json_object_get(o, "choices");
    json_t *c0 = json_array_get(choices, 0);
    if (c0) {
        const char *text = NULL;
        size_t tl = 0;
        if (s->chat) {
            json_t *delta = json_object_get(c0, "delta");
            json_t *t = json_object_get(delta, "content");
            if (!json_is_string(t) || json_string_length(t) == 0) t = json_object_get(delta, "reasoning_content");
            if (json_is_string(t)) text = json_string_value(t), tl = json_string_length(t);
        } else {
            json_t *t = json_object_get(c0, "text");
            if (json_is_string(t)) text = json_string_value(t), tl = json_string_length(t);
        }
        if (text && tl > 0) {
            if (!s->got_first) {
                s->got_first = 1;
                r->ttft_s = now - s->t_start;
            } else {
                record_push_itl(r, now - s->t_last);
            }
            s->t_last = now;
            r->n_chunks++;
            if (s->keep_text) record_push_text(r, text, tl);
        }
    }
    json_t *u = json_object_get(o, "usage");
    if (json_is_object(u)) {
        json_t *pt = json_object_get(u, "prompt_tokens"), *ct = json_object_get(u, "completion_tokens");
        if (json_is_integer(ct)) {
            r->output_tokens = (long)json_integer_value(ct);
            r->prompt_tokens = json_is_integer(pt) ? (long)json_integer_value(pt) : -1;
            s->got_usage = 1;
        }
    }
    json_decref(o);
    return 0;
}

/* ---- one in-flight request --------------------------------------------------------- */

typedef struct req {
    CURL *easy;
    struct curl_slist *headers;
    char *body;
    bench_sse sse;
    bench_stream st;
    double now;             /* arrival time of the bytes being parsed */
    long status;            /* HTTP status once known, 0 before */
    char err_body[ERR_BODY_MAX + 1];
    size_t err_len;
    char curl_err[CURL_ERROR_SIZE];
    int parse_failed;       /* the stream could not be parsed: stop reading */
    int tokenize;           /* a stream without usage is counted through the tokenize path */
} req;

static int on_sse_event(void *user, const char *data, size_t len) {
    req *q = user;
    return bench_stream_event(&q->st, data, len, q->now);
}

static size_t on_write(char *ptr, size_t size, size_t nmemb, void *user) {
    req *q = user;
    size_t n = size * nmemb;
    q->now = bench_now();
    if (q->status == 0) curl_easy_getinfo(q->easy, CURLINFO_RESPONSE_CODE, &q->status);
    if (q->status != 200) { /* keep the start of the error body for the reason */
        size_t k = n < ERR_BODY_MAX - q->err_len ? n : ERR_BODY_MAX - q->err_len;
        memcpy(q->err_body + q->err_len, ptr, k);
        q->err_len += k;
        q->err_body[q->err_len] = '\0';
        return n;
    }
    if (q->parse_failed) return n;
    specd_err e = {{0}};
    if (bench_sse_feed(&q->sse, ptr, n, &e)) {
        q->parse_failed = 1;
        record_fail(q->st.rec, "stream: %s", e.msg);
    }
    return n;
}

static void req_destroy(req *q) {
    if (!q) return;
    if (q->easy) curl_easy_cleanup(q->easy);
    curl_slist_free_all(q->headers);
    free(q->body);
    bench_sse_free(&q->sse);
    free(q->st.server_error);
    free(q);
}

/* Builds the JSON body of one request. Returns a new string or NULL. */
static char *build_body(const bench_client_cfg *cfg, int chat, const bench_prompt *p, specd_err *err) {
    json_t *o = json_object();
    if (!o) return NULL;
    json_object_set_new(o, "model", json_string(cfg->model ? cfg->model : ""));
    if (chat) {
        json_t *m = json_object();
        json_object_set_new(m, "role", json_string("user"));
        json_object_set_new(m, "content", json_string(p->text));
        json_t *msgs = json_array();
        json_array_append_new(msgs, m);
        json_object_set_new(o, "messages", msgs);
    } else {
        json_object_set_new(o, "prompt", json_string(p->text));
    }
    int max_tokens = cfg->max_tokens > 0 ? cfg->max_tokens : p->output_len > 0 ? p->output_len : BENCH_DEFAULT_MAX_TOKENS;
    json_object_set_new(o, "max_tokens", json_integer(max_tokens));
    json_object_set_new(o, "temperature", json_real(cfg->temperature));
    json_object_set_new(o, "stream", json_true());
    json_t *so = json_object();
    json_object_set_new(so, "include_usage", json_true());
    json_object_set_new(o, "stream_options", so);
    if (cfg->ignore_eos) json_object_set_new(o, "ignore_eos", json_true());
    if (cfg->extra_body && *cfg->extra_body) {
        json_error_t jerr;
        json_t *x = json_loads(cfg->extra_body, 0, &jerr);
        if (!json_is_object(x)) {
            json_decref(x);
            json_decref(o);
            specd_err_set(err, "--extra-body is not a JSON object: %s", jerr.text);
            return NULL;
        }
        json_object_update(o, x);
        json_decref(x);
    }
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) specd_err_set(err, "out of memory");
    return s;
}

static req *req_create(const bench_client_cfg *cfg, const char *url, int chat, const bench_prompt *p,
                       bench_record *rec, specd_err *err) {
    req *q = calloc(1, sizeof *q);
    if (!q) goto oom;
    if (!(q->body = build_body(cfg, chat, p, err))) goto fail;
    if (!(q->easy = curl_easy_init())) goto oom;
    q->headers = curl_slist_append(q->headers, "Content-Type: application/json");
    q->headers = curl_slist_append(q->headers, "Accept: text/event-stream");
    if (cfg->api_key && *cfg->api_key) {
        char auth[1024];
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", cfg->api_key);
        q->headers = curl_slist_append(q->headers, auth);
    }
    if (!q->headers) goto oom;
    bench_sse_init(&q->sse, on_sse_event, q);
    q->st.rec = rec;
    q->st.chat = chat;
    q->st.keep_text = cfg->keep_text || cfg->tokenize_path;
    q->tokenize = cfg->tokenize_path != NULL;
    CURL *e = q->easy;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, q->body);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, q->headers);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, q);
    curl_easy_setopt(e, CURLOPT_PRIVATE, q);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, q->curl_err);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e, CURLOPT_NOPROXY, "localhost,127.0.0.1,::1");
    if (cfg->timeout_s > 0) curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)(cfg->timeout_s * 1000));
    return q;
oom:
    specd_err_set(err, "out of memory");
fail:
    req_destroy(q);
    return NULL;
}

/* Turns a finished transfer into the final state of its record. */
static void req_finish(req *q, CURLcode rc, double now) {
    bench_record *r = q->st.rec;
    r->latency_s = now - q->st.t_start;
    if (q->status == 0) curl_easy_getinfo(q->easy, CURLINFO_RESPONSE_CODE, &q->status);
    if (rc != CURLE_OK) {
        record_fail(r, "transport: %s", q->curl_err[0] ? q->curl_err : curl_easy_strerror(rc));
        return;
    }
    if (q->status != 200) {
        const char *msg = NULL;
        json_t *o = json_loads(q->err_body, 0, NULL);
        json_t *eo = json_object_get(o, "error");
        msg = json_is_object(eo) ? json_string_value(json_object_get(eo, "message")) : json_string_value(eo);
        if (!msg) msg = json_string_value(json_object_get(o, "detail"));
        record_fail(r, "HTTP %ld: %.200s", q->status, msg ? msg : q->err_body);
        json_decref(o);
        return;
    }
    bench_sse_finish(&q->sse);
    if (r->error) return; /* a parse failure already said why */
    if (q->st.server_error) {
        record_fail(r, "server error in stream: %.200s", q->st.server_error);
        return;
    }
    if (!q->st.got_usage && q->tokenize) {
        r->retokenized = 1; /* counted after the run, so the count cannot disturb timing */
        r->success = 1;
        return;
    }
    if (!q->st.got_usage) {
        record_fail(r, q->st.got_done ? "no usage in stream (stream_options.include_usage ignored?)"
                                      : "stream ended without usage or [DONE]");
        return;
    }
    r->success = 1;
}

/* ---- the event loop ------------------------------------------------------------------- */

int bench_client_run(const bench_client_cfg *cfg, const bench_dataset *ds, size_t n, bench_run *out,
                     specd_err *err) {
    memset(out, 0, sizeof *out);
    if (n > ds->n) return specd_err_set(err, "run of %zu prompts but the dataset has %zu", n, ds->n);
    int chat = strstr(cfg->endpoint, "chat") != NULL;
    char url[2048];
    size_t bl = strlen(cfg->base_url);
    while (bl && cfg->base_url[bl - 1] == '/') bl--;
    snprintf(url, sizeof url, "%.*s%s", (int)bl, cfg->base_url, cfg->endpoint);

    double *sched = malloc((n ? n : 1) * sizeof *sched);
    req **inflight_of = calloc(n ? n : 1, sizeof *inflight_of);
    out->rec = calloc(n ? n : 1, sizeof *out->rec);
    CURLM *multi = curl_multi_init();
    int rc = -1;
    if (!sched || !inflight_of || !out->rec || !multi) {
        specd_err_set(err, "out of memory");
        goto done;
    }
    out->n = n;
    if (bench_schedule_build(sched, n, cfg->request_rate, cfg->burstiness, cfg->seed)) {
        specd_err_set(err, "--request-rate and --burstiness must be > 0");
        goto done;
    }
    curl_multi_setopt(multi, CURLMOPT_MAXCONNECTS,
                      (long)(cfg->max_concurrency ? cfg->max_concurrency : (n < 1024 ? n : 1024)) + 1);
    for (size_t i = 0; i < n; i++) {
        out->rec[i].prompt_idx = i;
        out->rec[i].ttft_s = -1;
        out->rec[i].prompt_tokens = out->rec[i].output_tokens = -1;
    }
    int tty = !cfg->quiet && isatty(STDERR_FILENO);
    size_t next = 0, inflight = 0, finished = 0;
    double t0 = bench_now(), t_end = t0;
    while (finished < n) {
        double now = bench_now();
        /* Release every request whose time has come, while a slot is free. */
        while (next < n && sched[next] <= now - t0 && (!cfg->max_concurrency || inflight < cfg->max_concurrency)) {
            bench_record *r = &out->rec[next];
            req *q = req_create(cfg, url, chat, &ds->p[next], r, err);
            if (!q) goto done;
            q->st.t_start = bench_now();
            r->send_s = q->st.t_start - t0;
            if (curl_multi_add_handle(multi, q->easy) != CURLM_OK) {
                req_destroy(q);
                specd_err_set(err, "curl_multi_add_handle failed");
                goto done;
            }
            inflight_of[next] = q;
            next++;
            inflight++;
            if (inflight > out->peak_concurrency) out->peak_concurrency = inflight;
        }
        int running;
        curl_multi_perform(multi, &running);
        CURLMsg *m;
        int left;
        int any_done = 0;
        while ((m = curl_multi_info_read(multi, &left))) {
            if (m->msg != CURLMSG_DONE) continue;
            req *q = NULL;
            curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&q);
            double t = bench_now();
            req_finish(q, m->data.result, t);
            if (t > t_end) t_end = t;
            curl_multi_remove_handle(multi, q->easy);
            inflight_of[q->st.rec->prompt_idx] = NULL;
            req_destroy(q);
            inflight--;
            finished++;
            any_done = 1;
            if (tty) fprintf(stderr, "\r  %zu/%zu requests done", finished, n);
        }
        if (any_done) continue; /* a slot may have opened: release before waiting */
        int wait_ms = 100;
        if (next < n && (!cfg->max_concurrency || inflight < cfg->max_concurrency)) {
            double until = (sched[next] - (bench_now() - t0)) * 1000.0;
            if (until < wait_ms) wait_ms = until < 0 ? 0 : (int)ceil(until);
        }
        curl_multi_poll(multi, NULL, 0, wait_ms, NULL);
    }
    if (tty) fprintf(stderr, "\n");
    out->duration_s = t_end - t0;
    for (size_t i = 0; i < n; i++) { /* servers without streamed usage: count after the clock stopped */
        bench_record *r = &out->rec[i];
        if (!r->retokenized) continue;
        specd_err e = {{0}};
        r->output_tokens = bench_tokenize_count(cfg->base_url, cfg->tokenize_path, cfg->model, r->text ? r->text : "", &e);
        r->prompt_tokens = bench_tokenize_count(cfg->base_url, cfg->tokenize_path, cfg->model, ds->p[i].text, &e);
        if (r->output_tokens < 0 || r->prompt_tokens < 0) record_fail(r, "no usage, and tokenize failed: %s", e.msg);
        if (!cfg->keep_text) {
            free(r->text);
            r->text = NULL;
            r->text_len = r->text_cap = 0;
        }
    }
    rc = 0;
done:
    for (size_t i = 0; inflight_of && i < n; i++)
        if (inflight_of[i]) {
            curl_multi_remove_handle(multi, inflight_of[i]->easy);
            req_destroy(inflight_of[i]);
        }
    if (multi) curl_multi_cleanup(multi);
    free(inflight_of);
    free(sched);
    if (rc) bench_run_free(out);
    return rc;
}

/* ---- blocking GET ------------------------------------------------------------------------ */

typedef struct membuf {
    char *p;
    size_t n, cap;
} membuf;

static size_t on_get(char *ptr, size_t size, size_t nmemb, void *user) {
    membuf *b = user;
    size_t n = size * nmemb;
    if (b->n + n + 1 > b->cap) {
        size_t nc = (b->n + n + 1) * 2;
        char *np = realloc(b->p, nc);
        if (!np) return 0; /* aborts the transfer */
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->n, ptr, n);
    b->n += n;
    b->p[b->n] = '\0';
    return n;
}

int bench_http_request(const char *base_url, const char *path, const char *post_json, double timeout_s,
                       char **body, size_t *len, long *status, specd_err *err) {
    *body = NULL;
    if (len) *len = 0;
    *status = 0;
    char url[2048], cerr[CURL_ERROR_SIZE] = "";
    size_t bl = strlen(base_url);
    while (bl && base_url[bl - 1] == '/') bl--;
    snprintf(url, sizeof url, "%.*s%s", (int)bl, base_url, path);
    CURL *e = curl_easy_init();
    if (!e) return specd_err_set(err, "curl_easy_init failed");
    membuf b = {0};
    struct curl_slist *hdr = NULL;
    if (post_json) {
        hdr = curl_slist_append(NULL, "Content-Type: application/json");
        curl_easy_setopt(e, CURLOPT_HTTPHEADER, hdr);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, post_json);
    }
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_get);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, cerr);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_NOPROXY, "localhost,127.0.0.1,::1");
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
    CURLcode rc = curl_easy_perform(e);
    curl_slist_free_all(hdr);
    if (rc != CURLE_OK) {
        free(b.p);
        curl_easy_cleanup(e);
        return specd_err_set(err, "%s %s: %s", post_json ? "POST" : "GET", url, cerr[0] ? cerr : curl_easy_strerror(rc));
    }
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, status);
    curl_easy_cleanup(e);
    if (!b.p && !(b.p = calloc(1, 1))) return specd_err_set(err, "out of memory");
    *body = b.p;
    if (len) *len = b.n;
    return 0;
}

int bench_http_get(const char *base_url, const char *path, double timeout_s, char **body, size_t *len,
                   long *status, specd_err *err) {
    return bench_http_request(base_url, path, NULL, timeout_s, body, len, status, err);
}

/* ---- token counts for servers that stream no usage -------------------------------------- */

long bench_tokenize_count(const char *base_url, const char *path, const char *model, const char *text,
                          specd_err *err) {
    json_t *o = json_object();
    json_object_set_new(o, "model", json_string(model ? model : ""));
    json_object_set_new(o, "input", json_string(text)); /* llama-cpp-python /extras/tokenize */
    json_object_set_new(o, "prompt", json_string(text)); /* vLLM-style /tokenize */
    json_object_set_new(o, "add_special_tokens", json_false());
    char *reqbody = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!reqbody) return specd_err_set(err, "out of memory");
    char *body = NULL;
    long status;
    int rc = bench_http_request(base_url, path, reqbody, 60, &body, NULL, &status, err);
    free(reqbody);
    if (rc) return -1;
    long n = -1;
    json_t *r = json_loads(body, 0, NULL);
    json_t *tok = json_object_get(r, "tokens"), *cnt = json_object_get(r, "count");
    if (status == 200 && json_is_array(tok)) n = (long)json_array_size(tok);
    else if (status == 200 && json_is_integer(cnt)) n = (long)json_integer_value(cnt);
    else specd_err_set(err, "POST %s: HTTP %ld, no tokens in %.120s", path, status, body);
    json_decref(r);
    free(body);
    return n;
}
