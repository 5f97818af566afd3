/*
 * http_gen.c: the generation endpoints (POST /v1/completions and
 * /v1/chat/completions) and /tokenize, /detokenize.
 *
 * A request is parsed and validated (oai_parse_request), tokenized (chat
 * template for chat, plain text with special-token parsing for completions,
 * as Hugging Face tokenizers and vLLM do), checked against the vocabulary and
 * the context limit, then fanned out: one engine request per (prompt, choice),
 * choice index = prompt * n + i, seed + i when a seed is given. Usage counts
 * prompt tokens once per prompt and completion tokens over all choices.
 *
 * Non-streaming: the connection is suspended in the access handler; each
 * notify resumes it, the handler drains the streams, and when every choice
 * has finished it queues one JSON body. Streaming: a callback response
 * (text/event-stream) whose reader drains the streams into SSE frames and
 * suspends when none are ready; never a busy wait.
 *
 * Chat output parsing (oai_tools.c): with tools (tool_choice other than
 * "none") or a thinking template with thinking on, the special tokens are
 * kept in the text and the text is split into reasoning_content / content /
 * tool_calls: once over the whole text (non-streaming), or by one
 * incremental parser per choice (streaming). tool_choice "required" or a
 * named function appends the opening of a call to the prompt; the parser
 * starts with it.
 *
 * TEST-ONLY: `specd_test_forced_output` (sampling_params.forced_ids) is
 * honoured only when the process runs with SPECD_TEST_FORCED_OUTPUT=1, else
 * refused like an unknown field.
 *
 * Invariant: engine streams are only released in http_gen_release (called
 * from the completion callback after the request left the registry); anything
 * else only aborts them. Threading: MHD threads; see http_internal.h.
 */
#include "server/http_internal.h"

#include <jansson.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/util/log.h"

static const char *token_bytes_cb(void *ctx, int32_t id, size_t *len) {
    return tok_token_bytes((const tokenizer *)ctx, id, len);
}

static void make_id(char *buf, size_t cap, const char *prefix) {
    unsigned char rnd[12];
    if (RAND_bytes(rnd, sizeof rnd) != 1) {
        static _Atomic unsigned long long counter;
        unsigned long long c = atomic_fetch_add(&counter, 1) + (unsigned long long)time(NULL);
        memcpy(rnd, &c, sizeof c);
        memset(rnd + 8, 0, 4);
    }
    size_t n = (size_t)snprintf(buf, cap, "%s", prefix);
    for (size_t i = 0; i < sizeof rnd && n + 2 < cap; i++) n += (size_t)snprintf(buf + n, cap - n, "%02x", rnd[i]);
}

/* TEST-ONLY forced output (engine.h sampling_params.forced_ids): honoured
 * only when the server process runs with SPECD_TEST_FORCED_OUTPUT=1, so the
 * e2e tests can drive the output parsers with chosen token sequences;
 * otherwise the field is refused like any unknown one. */
static bool forced_output_enabled(void) {
    const char *v = getenv("SPECD_TEST_FORCED_OUTPUT");
    return v && !strcmp(v, "1");
}

/* ==== output buffer ==== */
static int out_append(http_req *r, const char *s, size_t n) {
    if (r->out_off == r->out_len) r->out_off = r->out_len = 0;
    if (r->out_len + n > r->out_cap) {
        size_t cap = r->out_cap ? r->out_cap : 4096;
        while (cap < r->out_len + n) cap *= 2;
        char *b = realloc(r->out, cap);
        if (!b) return -1;
        r->out = b;
        r->out_cap = cap;
    }
    memcpy(r->out + r->out_len, s, n);
    r->out_len += n;
    return 0;
}

/* Appends a malloc'd NUL-terminated frame and frees it (-1 if FRAME is NULL). */
static int out_take(http_req *r, char *frame) {
    if (!frame) return -1;
    int rc = out_append(r, frame, strlen(frame));
    free(frame);
    return rc;
}

/* ==== tokenization ==== */
static int tokenize_prompts(http_req *r, oai_error *e) {
    const tokenizer *tok = r->srv->tok;
    oai_request *q = &r->oreq;
    specd_err err = {{0}};
    if (q->kind == OAI_CHAT) {
        q->prompts = calloc(1, sizeof *q->prompts);
        if (!q->prompts) return oai_error_set(e, 500, NULL, "out of memory");
        q->n_prompts = 1;
        if (q->tools_json && tok_chat_tool_format(tok) == TOK_TOOLS_NONE)
            return oai_error_set(e, 400, "tools", "this model's chat template has no tool-call format, so 'tools' "
                                 "cannot be used (supported: Kimi K2 / K2.5 templates)");
        chat_options opt = {.add_generation_prompt = q->add_generation_prompt, .thinking = q->thinking,
                            .tools_json = q->tools_json};
        if (tok_chat_encode(tok, q->messages, q->n_messages, &opt, &q->prompts[0].ids, &q->prompts[0].n_ids, NULL,
                            &err))
            return oai_error_set(e, 400, "messages", "cannot apply the chat template: %s", err.msg);
        /* tool_choice required / named: the reply is opened as a tool call in
         * the prompt (no constrained decoding: the arguments are the model's) */
        if (q->tool_choice == OAI_TOOL_CHOICE_REQUIRED || q->tool_choice == OAI_TOOL_CHOICE_NAMED) {
            if (!q->add_generation_prompt)
                return oai_error_set(e, 400, "tool_choice", "'tool_choice' \"required\" or a named function needs "
                                     "add_generation_prompt");
            bool close_think = tok_chat_thinking(tok) && q->thinking != 0;
            size_t cap = 160 + (q->tool_choice_name ? strlen(q->tool_choice_name) : 0);
            r->out_prefix = malloc(cap);
            if (!r->out_prefix) return oai_error_set(e, 500, NULL, "out of memory");
            int n = q->tool_choice == OAI_TOOL_CHOICE_NAMED
                        ? snprintf(r->out_prefix, cap, "%s<|tool_calls_section_begin|><|tool_call_begin|>functions.%s:0"
                                   "<|tool_call_argument_begin|>", close_think ? "</think>" : "", q->tool_choice_name)
                        : snprintf(r->out_prefix, cap, "%s<|tool_calls_section_begin|><|tool_call_begin|>functions.",
                                   close_think ? "</think>" : "");
            r->out_prefix_len = (size_t)n;
            int32_t *pre = NULL;
            size_t n_pre = 0;
            if (tok_encode(tok, r->out_prefix, r->out_prefix_len, true, &pre, &n_pre, &err))
                return oai_error_set(e, 500, NULL, "cannot encode the tool-call opening: %s", err.msg);
            int32_t *all = realloc(q->prompts[0].ids, (q->prompts[0].n_ids + n_pre) * sizeof *all);
            if (!all) return free(pre), oai_error_set(e, 500, NULL, "out of memory");
            memcpy(all + q->prompts[0].n_ids, pre, n_pre * sizeof *pre);
            q->prompts[0].ids = all;
            q->prompts[0].n_ids += n_pre;
            free(pre);
        }
        return 0;
    }
    for (size_t p = 0; p < q->n_prompts; p++) {
        oai_prompt *pr = &q->prompts[p];
        if (pr->is_ids) {
            if (oai_check_ids(pr->ids, pr->n_ids, r->srv->vocab, "prompt", e)) return -1;
            continue;
        }
        if (tok_encode(tok, pr->text, pr->text_len, true, &pr->ids, &pr->n_ids, &err))
            return oai_error_set(e, 400, "prompt", "cannot tokenize the prompt: %s", err.msg);
    }
    return 0;
}

/* ==== submission ==== */
static int submit_all(http_req *r, oai_error *e) {
    http_server *s = r->srv;
    oai_request *q = &r->oreq;
    if (oai_check_ids(q->stop_token_ids, q->n_stop_token_ids, s->vocab, "stop_token_ids", e)) return -1;
    if (oai_check_ids(q->logit_bias_ids, q->n_logit_bias, s->vocab, "logit_bias", e)) return -1;
    if (oai_check_ids(q->forced_ids, q->n_forced_ids, s->vocab, "specd_test_forced_output", e)) return -1;
    q->sp.forced_ids = q->forced_ids;
    q->sp.n_forced_ids = q->n_forced_ids;
    if (r->rc.parse_tools || r->rc.parse_reasoning) q->sp.skip_special_tokens = false; /* the markers are specials */
    size_t n = q->n_prompts * (size_t)q->n;
    /* The engine's queue bound counts sequences, and a request's sequences are
     * queued back to back: one needing more than the bound can never be
     * admitted, so it is invalid (400), not a 429 the client would retry forever. */
    int32_t max_waiting = engine_get_config(s->eng)->max_waiting;
    if (max_waiting > 0 && n > (size_t)max_waiting)
        return oai_error_set(e, 400, "n", "this request needs %zu sequences (n x prompts) but at most %d can be queued "
                             "(--max-waiting)", n, max_waiting);
    r->streams = calloc(n, sizeof *r->streams);
    r->choices = calloc(n, sizeof *r->choices);
    r->done = calloc(n, sizeof *r->done);
    if (q->stream && (r->rc.parse_tools || r->rc.parse_reasoning)) {
        r->parsers = calloc(n, sizeof *r->parsers);
        if (!r->parsers) return oai_error_set(e, 500, NULL, "out of memory");
        for (size_t i = 0; i < n; i++)
            if (oai_outparse_init(&r->parsers[i], r->rc.parse_reasoning, r->rc.parse_tools, r->out_prefix,
                                  r->out_prefix_len))
                return oai_error_set(e, 500, NULL, "out of memory");
    }
    r->echo_text = calloc(q->n_prompts, sizeof *r->echo_text);
    r->echo_len = calloc(q->n_prompts, sizeof *r->echo_len);
    if (!r->streams || !r->choices || !r->done || !r->echo_text || !r->echo_len)
        return oai_error_set(e, 500, NULL, "out of memory");
    r->n_streams = n;
    int32_t *max_tokens = calloc(q->n_prompts, sizeof *max_tokens);
    if (!max_tokens) return oai_error_set(e, 500, NULL, "out of memory");
    int rc = 0;
    for (size_t p = 0; p < q->n_prompts && !rc; p++) {
        rc = oai_resolve_max_tokens(q, (int32_t)q->prompts[p].n_ids, s->max_model_len, &max_tokens[p], e);
        r->prompt_tokens_total += (int64_t)q->prompts[p].n_ids;
        if (!rc && q->echo) {
            if (q->prompts[p].is_ids) {
                specd_err err = {{0}};
                if (tok_decode(s->tok, q->prompts[p].ids, q->prompts[p].n_ids, false, &r->echo_text[p],
                               &r->echo_len[p], &err))
                    rc = oai_error_set(e, 400, "prompt", "cannot decode the prompt: %s", err.msg);
            } else {
                r->echo_text[p] = malloc(q->prompts[p].text_len + 1);
                if (!r->echo_text[p]) rc = oai_error_set(e, 500, NULL, "out of memory");
                else {
                    memcpy(r->echo_text[p], q->prompts[p].text, q->prompts[p].text_len + 1);
                    r->echo_len[p] = q->prompts[p].text_len;
                }
            }
        }
    }
    /* registered before the first submit: notify may fire at once */
    if (!rc) http_registry_add(r);
    for (size_t p = 0; p < q->n_prompts && !rc; p++) {
        for (int32_t i = 0; i < q->n && !rc; i++) {
            size_t idx = p * (size_t)q->n + (size_t)i;
            oai_choice *c = &r->choices[idx];
            c->index = (int32_t)idx;
            c->n_prompt_tokens = (int32_t)q->prompts[p].n_ids;
            c->stop_token_id = -1;
            bool want_plp = q->echo && q->logprobs >= 0;
            if (want_plp) {
                c->echo_ids = q->prompts[p].ids;
                c->n_echo_ids = q->prompts[p].n_ids;
            }
            if (max_tokens[p] == 0 && !(want_plp && q->prompts[p].n_ids > 1)) {
                /* echo only (max_tokens 0 with echo): nothing to run */
                r->done[idx] = true;
                r->n_done++;
                c->finish = FINISH_LENGTH;
                continue;
            }
            engine_request er = {0};
            er.prompt = q->prompts[p].ids;
            er.n_prompt = q->prompts[p].n_ids;
            er.sp = q->sp;
            er.sp.max_tokens = max_tokens[p];
            er.prompt_logprobs = want_plp;
            if (max_tokens[p] == 0) { /* echo + logprobs with max_tokens 0: one token for the prompt logprobs */
                er.sp.max_tokens = 1;
                c->discard_generated = true;
            }
            if (er.sp.has_seed) er.sp.seed = q->sp.seed + (uint64_t)i;
            char rid[64];
            snprintf(rid, sizeof rid, "%s-%zu", r->id, idx);
            er.request_id = rid;
            engine_status st = ENGINE_OK;
            specd_err err = {{0}};
            r->streams[idx] = engine_submit(s->eng, &er, http_req_notify, r, &st, &err);
            if (!r->streams[idx]) {
                int status = st == ENGINE_EFULL ? 429 : st == ENGINE_EDRAINING ? 503 : st == ENGINE_EINVAL ? 400 : 500;
                rc = oai_error_set(e, status, NULL, "%s", err.msg[0] ? err.msg : "the engine refused the request");
            }
        }
    }
    free(max_tokens);
    if (rc) {
        for (size_t i = 0; i < r->n_streams; i++)
            if (r->streams[i]) engine_stream_abort(r->streams[i]);
    }
    return rc;
}

/* Drains every stream that has output. Non-streaming: accumulates into
 * choices. Streaming: appends SSE frames. Returns the number of outputs taken
 * (-1 on OOM). */
static int pump(http_req *r) {
    int got = 0;
    for (size_t i = 0; i < r->n_streams; i++) {
        if (r->done[i] || !r->streams[i]) continue;
        engine_output *o = NULL;
        while (!r->done[i] && engine_stream_poll(r->streams[i], &o) == 1) {
            got++;
            if (r->ttft < 0 && o->ttft_s > 0) r->ttft = o->ttft_s;
            oai_choice *c = &r->choices[i];
            if (o->finish != FINISH_NONE) {
                r->done[i] = true;
                r->n_done++;
                if (!c->discard_generated) r->completion_tokens_total += o->n_completion_tokens;
                if (o->finish == FINISH_ERROR || o->finish == FINISH_ABORT) {
                    r->any_error = true;
                    if (o->finish == FINISH_ERROR && o->error_status) r->error_status = o->error_status;
                    if (o->finish == FINISH_ERROR)
                        snprintf(r->error_msg, sizeof r->error_msg, "%s", o->error[0] ? o->error : "internal error");
                    else if (atomic_load(&r->srv->state) == HTTP_DRAINING && r->srv->drain_why[0])
                        snprintf(r->error_msg, sizeof r->error_msg, "the request was aborted: %s", r->srv->drain_why);
                    else
                        snprintf(r->error_msg, sizeof r->error_msg, "the request was aborted");
                }
            }
            int rc = 0;
            if (r->phase == PH_STREAM) {
                c->finish = o->finish;
                c->n_completion_tokens = o->n_completion_tokens;
                bool lp = r->oreq.logprobs >= 0 && o->logprobs && o->n_tokens;
                if (o->finish == FINISH_ERROR || o->finish == FINISH_ABORT) {
                    oai_error e;
                    oai_error_set(&e, r->error_status ? r->error_status : 500, NULL, "%s", r->error_msg);
                    size_t n = 0;
                    rc = out_take(r, oai_error_sse(&e, &n));
                } else if (r->parsers) {
                    oai_outparse *p = &r->parsers[i];
                    oai_parsed d = {0};
                    size_t call0 = p->n_calls;
                    rc = oai_outparse_feed(p, o->text ? o->text : "", o->text_len, o->finish != FINISH_NONE, &d);
                    if (!rc && (d.reasoning_len || d.content_len || d.n_calls || lp || o->finish != FINISH_NONE)) {
                        const char *fs = o->finish == FINISH_STOP && p->n_calls ? "tool_calls" : NULL;
                        size_t n = 0;
                        rc = out_take(r, oai_chat_parsed_sse(&r->rc, c->index, &d, call0, o->token_ids,
                                                             lp ? o->logprobs : NULL, lp ? o->n_tokens : 0, o->finish,
                                                             fs, o->stop_reason, o->stop_token_id,
                                                             r->oreq.include_usage, &n));
                    }
                    oai_parsed_free(&d);
                } else if (o->text_len || lp || o->finish != FINISH_NONE) {
                    size_t n = 0;
                    rc = out_take(r,
                                  oai_chunk_sse(&r->rc, c->index, o->text, o->text_len, o->token_ids, lp ? o->logprobs : NULL,
                                                lp ? o->n_tokens : 0, c->text_len, o->finish, o->stop_reason, o->stop_token_id, false,
                                                r->oreq.include_usage, &n));
                    /* streaming keeps no text: text_len is the running text_offset (token bytes so far) */
                    for (size_t k = 0; lp && k < o->n_tokens; k++) {
                        size_t tl = 0;
                        if (tok_token_bytes(r->srv->tok, o->token_ids[k], &tl)) c->text_len += tl;
                    }
                }
            } else {
                rc = oai_choice_add(c, o);
            }
            engine_output_free(o);
            o = NULL;
            if (rc) return -1;
        }
    }
    if (r->phase == PH_STREAM && r->n_done == (int)r->n_streams && !r->sse_finished) {
        if (r->oreq.include_usage) {
            size_t n = 0;
            if (out_take(r, oai_usage_sse(&r->rc, r->prompt_tokens_total, r->completion_tokens_total, &n))) return -1;
        }
        if (out_append(r, OAI_SSE_DONE, strlen(OAI_SSE_DONE))) return -1;
        r->sse_finished = true;
        got++;
    }
    return got;
}

/* ==== non-streaming ==== */
static enum MHD_Result finish_json(http_req *r) {
    r->phase = PH_DONE;
    if (r->any_error) {
        oai_error e;
        /* aborted by the shutdown timeout: the client may retry elsewhere */
        bool draining = atomic_load(&r->srv->state) == HTTP_DRAINING;
        oai_error_set(&e, r->error_status ? r->error_status : draining ? 503 : 500, NULL, "%s%s", r->error_msg,
                      draining && !r->error_status && !r->srv->drain_why[0] ? " (the server is shutting down)" : "");
        return http_send_error(r, &e);
    }
    /* echo: prepend the prompt text to every choice of its prompt */
    if (r->oreq.echo) {
        for (size_t i = 0; i < r->n_streams; i++) {
            size_t p = i / (size_t)r->oreq.n;
            oai_choice *c = &r->choices[i];
            size_t el = r->echo_len[p];
            char *t = malloc(el + c->text_len + 1);
            if (!t) return MHD_NO;
            memcpy(t, r->echo_text[p], el);
            if (c->text_len) memcpy(t + el, c->text, c->text_len);
            t[el + c->text_len] = 0;
            free(c->text);
            c->text = t;
            c->text_len = c->text_cap = el + c->text_len;
        }
    }
    size_t len = 0;
    char *j = oai_response_json(&r->rc, r->choices, r->n_streams, r->prompt_tokens_total, &len);
    if (!j) return MHD_NO;
    r->status = 200;
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, j, MHD_RESPMEM_MUST_FREE);
    if (!resp) return free(j), MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    enum MHD_Result rc = MHD_queue_response(r->conn, 200, resp);
    MHD_destroy_response(resp);
    return rc;
}

enum MHD_Result http_gen_resume(http_req *r) {
    for (;;) {
        http_req_clear_wake(r);
        int got = pump(r);
        if (got < 0) return MHD_NO;
        if (r->n_done == (int)r->n_streams) return finish_json(r);
        if (got) continue;
        pthread_mutex_lock(&r->mu);
        bool tick = r->tick;
        r->tick = false;
        pthread_mutex_unlock(&r->mu);
        if (atomic_load(&r->srv->stopping) || (tick && http_peer_closed(r))) {
            r->client_gone = !atomic_load(&r->srv->stopping);
            for (size_t i = 0; i < r->n_streams; i++)
                if (r->streams[i]) engine_stream_abort(r->streams[i]);
            return MHD_NO; /* closes the connection; on_completed releases */
        }
        if (http_req_suspend(r)) return MHD_YES;
    }
}

/* ==== streaming ==== */
static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    http_req *r = cls;
    for (;;) {
        if (r->out_off < r->out_len) {
            size_t n = r->out_len - r->out_off;
            if (n > max) n = max;
            memcpy(buf, r->out + r->out_off, n);
            r->out_off += n;
            return (ssize_t)n;
        }
        if (r->sse_finished) return MHD_CONTENT_READER_END_OF_STREAM;
        http_req_clear_wake(r);
        int got = pump(r);
        if (got < 0) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (got) continue;
        pthread_mutex_lock(&r->mu);
        bool tick = r->tick;
        r->tick = false;
        pthread_mutex_unlock(&r->mu);
        if (atomic_load(&r->srv->stopping) || (tick && http_peer_closed(r))) {
            r->client_gone = !atomic_load(&r->srv->stopping);
            for (size_t i = 0; i < r->n_streams; i++)
                if (r->streams[i]) engine_stream_abort(r->streams[i]);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (http_req_suspend(r)) return 0;
    }
}

static enum MHD_Result start_stream(http_req *r) {
    r->phase = PH_STREAM;
    /* first frames: chat role per choice; completions echo per choice */
    for (size_t i = 0; i < r->n_streams; i++) {
        size_t n = 0;
        char *f = NULL;
        if (r->oreq.kind == OAI_CHAT) {
            f = oai_chunk_sse(&r->rc, (int32_t)i, "", 0, NULL, NULL, 0, 0, FINISH_NONE, NULL, -1, true,
                              r->oreq.include_usage, &n);
        } else if (r->oreq.echo) {
            size_t p = i / (size_t)r->oreq.n;
            f = oai_chunk_sse(&r->rc, (int32_t)i, r->echo_text[p], r->echo_len[p], NULL, NULL, 0, 0,
                              r->done[i] ? FINISH_LENGTH : FINISH_NONE, NULL, -1, false, r->oreq.include_usage, &n);
        } else {
            continue;
        }
        if (out_take(r, f)) return MHD_NO;
    }
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, sse_reader, r, NULL);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    r->status = 200;
    enum MHD_Result rc = MHD_queue_response(r->conn, 200, resp);
    MHD_destroy_response(resp);
    return rc;
}

enum MHD_Result http_gen_begin(http_req *r) {
    http_server *s = r->srv;
    oai_error e;
    oai_kind kind = r->route == R_CHAT ? OAI_CHAT : OAI_COMPLETION;
    make_id(r->id, sizeof r->id, kind == OAI_CHAT ? "chatcmpl-" : "cmpl-");
    if (oai_parse_request(kind, r->body ? r->body : "", r->body_len, &r->oreq, &e)) return http_send_error(r, &e);
    if (r->oreq.model && strcmp(r->oreq.model, s->model_name)) {
        oai_error_set(&e, 404, "model", "The model `%s` does not exist.", r->oreq.model);
        return http_send_error(r, &e);
    }
    if (r->oreq.has_forced && !forced_output_enabled()) {
        oai_error_set(&e, 400, "specd_test_forced_output", "unknown field 'specd_test_forced_output' (a test-only "
                      "field, honoured only when the server runs with SPECD_TEST_FORCED_OUTPUT=1)");
        return http_send_error(r, &e);
    }
    if (tokenize_prompts(r, &e)) return http_send_error(r, &e);
    bool chat = kind == OAI_CHAT;
    r->rc = (oai_resp_ctx){.kind = kind, .id = r->id, .created = (long long)time(NULL), .model = s->model_name,
                           .logprobs = r->oreq.logprobs, .token_bytes = token_bytes_cb, .token_ctx = (void *)s->tok,
                           .parse_reasoning = chat && tok_chat_thinking(s->tok) && r->oreq.thinking != 0,
                           .parse_tools = chat && r->oreq.tool_choice != OAI_TOOL_CHOICE_NONE,
                           .out_prefix = r->out_prefix, .out_prefix_len = r->out_prefix_len};
    if (submit_all(r, &e)) {
        /* streams already submitted are aborted; they are released on completion */
        return http_send_error(r, &e);
    }
    if (r->oreq.stream) return start_stream(r);
    r->phase = PH_WAIT;
    return http_gen_resume(r);
}

void http_gen_release(http_req *r) {
    for (size_t i = 0; r->streams && i < r->n_streams; i++) {
        if (!r->streams[i]) continue;
        if (!r->done[i]) engine_stream_abort(r->streams[i]);
        engine_stream_release(r->streams[i]);
        r->streams[i] = NULL;
    }
}

void http_gen_free(http_req *r) {
    for (size_t i = 0; r->parsers && i < r->n_streams; i++) oai_outparse_free(&r->parsers[i]);
    free(r->parsers);
    free(r->out_prefix);
    for (size_t i = 0; r->choices && i < r->n_streams; i++) oai_choice_free(&r->choices[i]);
    for (size_t p = 0; r->echo_text && p < r->oreq.n_prompts; p++) free(r->echo_text[p]);
    free(r->echo_text);
    free(r->echo_len);
    free(r->choices);
    free(r->streams);
    free(r->done);
    free(r->out);
    oai_request_free(&r->oreq);
}

/* ==== /tokenize, /detokenize (vLLM shapes) ==== */
static enum MHD_Result send_root(http_req *r, json_t *root) {
    char *j = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (!j) return MHD_NO;
    r->status = 200;
    enum MHD_Result rc = http_send_json(r->conn, 200, j, strlen(j));
    free(j);
    return rc;
}

static json_t *parse_body_object(http_req *r, oai_error *e) {
    if (!r->body_len) return oai_error_set(e, 400, NULL, "the request body is empty; expected a JSON object"), NULL;
    size_t bad = oai_utf8_invalid_at(r->body, r->body_len);
    if (bad < r->body_len)
        return oai_error_set(e, 400, NULL, "the request body is not valid UTF-8 (byte offset %zu)", bad), NULL;
    json_error_t je;
    json_t *root = json_loadb(r->body, r->body_len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
    if (!root) return oai_error_set(e, 400, NULL, "malformed JSON: %s", je.text), NULL;
    if (!json_is_object(root)) {
        json_decref(root);
        return oai_error_set(e, 400, NULL, "the request body must be a JSON object"), NULL;
    }
    json_t *jmodel = json_object_get(root, "model");
    if (jmodel && !json_is_null(jmodel) && (!json_is_string(jmodel) || strcmp(json_string_value(jmodel), r->srv->model_name))) {
        oai_error_set(e, json_is_string(jmodel) ? 404 : 400, "model", "The model `%s` does not exist.",
                      json_is_string(jmodel) ? json_string_value(jmodel) : "?");
        json_decref(root);
        return NULL;
    }
    return root;
}

enum MHD_Result http_tokenize(http_req *r) {
    oai_error e;
    json_t *root = parse_body_object(r, &e);
    if (!root) return http_send_error(r, &e);
    bool is_chat = json_object_get(root, "messages") != NULL;
    json_t *ast = json_object_get(root, "add_special_tokens");
    if (ast && !json_is_boolean(ast)) {
        json_decref(root);
        oai_error_set(&e, 400, "add_special_tokens", "'add_special_tokens' must be a boolean");
        return http_send_error(r, &e);
    }
    int32_t *ids = NULL;
    size_t n = 0;
    specd_err err = {{0}};
    int rc;
    if (is_chat) {
        /* reuse the chat parser for the messages */
        oai_request q;
        json_object_del(root, "add_special_tokens"); /* a /tokenize field, not a chat one */
        char *body = json_dumps(root, JSON_COMPACT);
        rc = body ? oai_parse_request(OAI_CHAT, body, strlen(body), &q, &e) : oai_error_set(&e, 500, NULL, "oom");
        free(body);
        if (!rc) {
            chat_options opt = {.add_generation_prompt = q.add_generation_prompt, .thinking = q.thinking,
                                .tools_json = q.tools_json};
            if (q.tools_json && tok_chat_tool_format(r->srv->tok) == TOK_TOOLS_NONE)
                rc = oai_error_set(&e, 400, "tools", "this model's chat template has no tool-call format");
            else if (tok_chat_encode(r->srv->tok, q.messages, q.n_messages, &opt, &ids, &n, NULL, &err))
                rc = oai_error_set(&e, 400, "messages", "cannot apply the chat template: %s", err.msg);
            oai_request_free(&q);
        }
    } else {
        json_t *p = json_object_get(root, "prompt");
        if (!json_is_string(p)) {
            rc = oai_error_set(&e, 400, "prompt", "'prompt' must be a string (or send 'messages')");
        } else if (tok_encode(r->srv->tok, json_string_value(p), json_string_length(p), true, &ids, &n, &err)) {
            rc = oai_error_set(&e, 400, "prompt", "cannot tokenize: %s", err.msg);
        } else {
            rc = 0;
        }
    }
    json_decref(root);
    if (rc) {
        free(ids);
        return http_send_error(r, &e);
    }
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(arr, json_integer(ids[i]));
    free(ids);
    r->prompt_tokens_total = (int64_t)n;
    return send_root(r, json_pack("{s:I,s:i,s:o}", "count", (json_int_t)n, "max_model_len", r->srv->max_model_len,
                                  "tokens", arr));
}

enum MHD_Result http_detokenize(http_req *r) {
    oai_error e;
    json_t *root = parse_body_object(r, &e);
    if (!root) return http_send_error(r, &e);
    json_t *t = json_object_get(root, "tokens");
    if (!json_is_array(t)) {
        json_decref(root);
        oai_error_set(&e, 400, "tokens", "'tokens' must be an array of token ids");
        return http_send_error(r, &e);
    }
    size_t n = json_array_size(t);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    int rc = ids ? 0 : oai_error_set(&e, 500, NULL, "out of memory");
    for (size_t i = 0; !rc && i < n; i++) {
        json_t *v = json_array_get(t, i);
        if (!json_is_integer(v)) rc = oai_error_set(&e, 400, "tokens", "'tokens' element %zu is not an integer", i);
        else if (json_integer_value(v) < 0 || json_integer_value(v) >= r->srv->vocab)
            rc = oai_error_set(&e, 400, "tokens", "token id %lld at index %zu is out of vocabulary [0, %d)",
                               (long long)json_integer_value(v), i, r->srv->vocab);
        else ids[i] = (int32_t)json_integer_value(v);
    }
    json_decref(root);
    char *text = NULL;
    size_t len = 0;
    specd_err err = {{0}};
    if (!rc && tok_decode(r->srv->tok, ids, n, false, &text, &len, &err))
        rc = oai_error_set(&e, 400, "tokens", "cannot decode: %s", err.msg);
    free(ids);
    if (rc) return http_send_error(r, &e);
    size_t cl = 0;
    char *clean = oai_utf8_sanitize(text, len, &cl);
    free(text);
    if (!clean) return MHD_NO;
    json_t *res = json_pack("{s:s%}", "prompt", clean, cl);
    free(clean);
    return send_root(r, res);
}
