/*
 * test_scheduler.c: scheduler policy and the request API against the fake
 * model runner (fake_runner.h: a context-hash LM computed through the paged
 * KV cache, compared with a cache-free reference decode).
 *
 * Covered: outputs equal the reference (single, concurrent, with chunked
 * prefill, with preemption + recompute, with prefix caching), the token
 * budget per step and the chunk sizes, admission limited by free blocks,
 * preemption order, abort freeing blocks in the same step, validation errors
 * with the sizes in the message, the bounded waiting queue, draining, seeded
 * sampling independent of the batch, runner failure, and all blocks free at
 * the end (kv_blocks_free == total from the stats snapshot).
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "fake_runner.h"
#include "engine/runtime/engine_ex.h"

typedef struct harness {
    fake_runner f;
    engine_runner r;
    engine_detok d;
    engine *e;
} harness;

static void h_init(harness *h, int32_t n_blocks, int32_t bs, int32_t max_len, int32_t max_seqs, int32_t budget,
                   bool prefix) {
    memset(h, 0, sizeof *h);
    fake_pieces = NULL;
    assert_int_equal(fake_runner_init(&h->f, n_blocks, bs, &h->r), 0);
    h->d = fake_detok();
    engine_config cfg = {.max_model_len = max_len, .max_num_seqs = max_seqs, .max_num_batched_tokens = budget,
                         .max_waiting = 64, .enable_prefix_caching = prefix};
    specd_err err = {0};
    if (engine_create_ex(&cfg, &h->r, &h->d, NULL, NULL, &h->e, &err) != 0) fail_msg("%s", err.msg);
}

static void h_free(harness *h) {
    engine_destroy(h->e);
    free(h->f.kv);
}

static engine_stream *submit(harness *h, const int32_t *prompt, size_t n, int32_t max_tokens, engine_status *st,
                             specd_err *err) {
    engine_request rq;
    memset(&rq, 0, sizeof rq);
    sampling_params_init(&rq.sp);
    rq.sp.temperature = 0.0f;
    rq.sp.max_tokens = max_tokens;
    rq.prompt = prompt;
    rq.n_prompt = n;
    return engine_submit(h->e, &rq, NULL, NULL, st, err);
}

static engine_stream *submit_ok(harness *h, const int32_t *prompt, size_t n, int32_t max_tokens) {
    engine_status st;
    specd_err err = {0};
    engine_stream *s = submit(h, prompt, n, max_tokens, &st, &err);
    if (!s) fail_msg("submit: %s", err.msg);
    return s;
}

/* Drains all outputs of a stream into toks; returns the count, sets *fin. */
typedef struct collected {
    int32_t toks[512];
    int32_t n;
    finish_reason fin;
    int32_t usage;
    char text[4096];
} collected;

static bool collect(engine_stream *s, collected *c) {
    engine_output *o;
    while (engine_stream_poll(s, &o)) {
        for (size_t i = 0; i < o->n_tokens; i++) c->toks[c->n++] = o->token_ids[i];
        strncat(c->text, o->text, sizeof c->text - strlen(c->text) - 1);
        c->usage = o->n_completion_tokens;
        c->fin = o->finish;
        engine_output_free(o);
        if (c->fin != FINISH_NONE) return true;
    }
    return false;
}

static void run_until_idle(harness *h, int max_steps) {
    specd_err err = {0};
    for (int i = 0; i < max_steps; i++)
        if (engine_step(h->e, &err) == 0) return;
    fail_msg("engine still busy after %d steps", max_steps);
}

static void assert_all_free(harness *h) {
    engine_stats st;
    engine_get_stats(h->e, &st);
    assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
    assert_int_equal(st.num_running, 0);
    assert_int_equal(st.num_waiting, 0);
}

static void make_prompt(int32_t *p, int32_t n, int32_t salt) {
    for (int32_t i = 0; i < n; i++) p[i] = (salt * 7 + i * 13) % (FAKE_VOCAB - 1);
}

static void check_against_reference(const int32_t *prompt, int32_t n, const collected *c, int32_t max_tokens) {
    int32_t ref[512];
    int32_t nr = fake_reference_greedy(prompt, n, max_tokens, 0, false, ref);
    assert_int_equal(c->n, nr);
    assert_memory_equal(c->toks, ref, (size_t)nr * sizeof *ref);
    assert_int_equal(c->fin, FINISH_LENGTH);
    assert_int_equal(c->usage, nr);
}

static void test_single_request_matches_reference(void **st) {
    (void)st;
    harness h;
    h_init(&h, 32, 4, 100, 8, 64, false);
    int32_t p[10];
    make_prompt(p, 10, 1);
    engine_stream *s = submit_ok(&h, p, 10, 12);
    run_until_idle(&h, 100);
    collected c = {0};
    assert_true(collect(s, &c));
    check_against_reference(p, 10, &c, 12);
    /* text is the concatenation of the pieces */
    char want[4096] = "";
    for (int i = 0; i < c.n; i++) strcat(want, fake_piece(c.toks[i]));
    assert_string_equal(c.text, want);
    engine_stream_release(s);
    assert_all_free(&h);
    h_free(&h);
}

static void test_chunked_prefill_budget(void **st) {
    (void)st;
    harness h;
    h_init(&h, 64, 4, 100, 8, 8, false);
    int32_t a[3], b[20];
    make_prompt(a, 3, 2);
    make_prompt(b, 20, 3);
    engine_stream *sa = submit_ok(&h, a, 3, 10);
    specd_err err = {0};
    assert_int_equal(engine_step(h.e, &err), 1); /* a's prefill (3 tokens) */
    engine_stream *sb = submit_ok(&h, b, 20, 4);
    const int64_t *ids;
    const int32_t *nt;
    /* steps: a decodes 1 token first, then b gets the rest of the budget: 7, 7, 6 */
    int32_t want_b[3] = {7, 7, 6};
    for (int step = 0; step < 3; step++) {
        assert_int_equal(engine_step(h.e, &err), 2);
        size_t n = engine_last_schedule(h.e, &ids, &nt);
        assert_int_equal(n, 2);
        assert_int_equal(ids[0], engine_stream_seq_id(sa));
        assert_int_equal(nt[0], 1);
        assert_int_equal(ids[1], engine_stream_seq_id(sb));
        assert_int_equal(nt[1], want_b[step]);
        assert_true(h.f.last_n_tokens <= 8);
        /* logits only for a (decode) until b's last chunk */
        assert_int_equal(h.f.last_n_out, step < 2 ? 1 : 2);
    }
    run_until_idle(&h, 100);
    assert_true(h.f.max_tokens_seen <= 8);
    collected ca = {0}, cb = {0};
    assert_true(collect(sa, &ca));
    assert_true(collect(sb, &cb));
    check_against_reference(a, 3, &ca, 10);
    check_against_reference(b, 20, &cb, 4);
    engine_stream_release(sa);
    engine_stream_release(sb);
    assert_all_free(&h);
    h_free(&h);
}

static void test_admission_limited_by_blocks(void **st) {
    (void)st;
    harness h;
    /* 8 blocks of 4: each 10-token prompt needs 3 blocks, so two fit, the third waits */
    h_init(&h, 8, 4, 32, 8, 64, false);
    int32_t p[3][10];
    engine_stream *s[3];
    for (int i = 0; i < 3; i++) {
        make_prompt(p[i], 10, 10 + i);
        s[i] = submit_ok(&h, p[i], 10, 2);
    }
    specd_err err = {0};
    assert_int_equal(engine_step(h.e, &err), 2);
    engine_stats stt;
    engine_get_stats(h.e, &stt);
    assert_int_equal(stt.num_running, 2);
    assert_int_equal(stt.num_waiting, 1);
    assert_int_equal(stt.kv_blocks_free, 2);
    run_until_idle(&h, 100);
    for (int i = 0; i < 3; i++) {
        collected c = {0};
        assert_true(collect(s[i], &c));
        check_against_reference(p[i], 10, &c, 2);
        engine_stream_release(s[i]);
    }
    engine_get_stats(h.e, &stt);
    assert_int_equal(stt.preemptions_total, 0);
    assert_all_free(&h);
    h_free(&h);
}

static void test_preemption_recompute(void **st) {
    (void)st;
    harness h;
    /* 12 blocks of 2 tokens; 4 sequences of 5-token prompts growing to 5+14 = 19 tokens
     * (10 blocks each) cannot all stay resident: the newest get preempted and recomputed */
    h_init(&h, 12, 2, 24, 8, 64, false);
    int32_t p[4][5];
    engine_stream *s[4];
    for (int i = 0; i < 4; i++) {
        make_prompt(p[i], 5, 20 + i);
        s[i] = submit_ok(&h, p[i], 5, 14);
    }
    run_until_idle(&h, 500);
    engine_stats stt;
    engine_get_stats(h.e, &stt);
    assert_true(stt.preemptions_total > 0);
    for (int i = 0; i < 4; i++) {
        collected c = {0};
        assert_true(collect(s[i], &c));
        check_against_reference(p[i], 5, &c, 14);
        engine_stream_release(s[i]);
    }
    assert_int_equal(stt.requests_finished_total[FINISH_LENGTH], 4);
    assert_int_equal(stt.generation_tokens_total, 4 * 14);
    assert_all_free(&h);
    h_free(&h);
}

static void test_abort_frees_blocks_same_step(void **st) {
    (void)st;
    harness h;
    h_init(&h, 32, 4, 100, 8, 64, false);
    int32_t p[9];
    make_prompt(p, 9, 5);
    engine_stream *s = submit_ok(&h, p, 9, 50);
    specd_err err = {0};
    for (int i = 0; i < 3; i++) assert_int_equal(engine_step(h.e, &err), 1);
    engine_stats stt;
    engine_get_stats(h.e, &stt);
    assert_int_equal(stt.kv_blocks_free, 32 - 3); /* 11 computed positions in 3 blocks */
    engine_stream_abort(s);
    assert_int_equal(engine_step(h.e, &err), 0); /* nothing left to run: freed in this step */
    engine_get_stats(h.e, &stt);
    assert_int_equal(stt.kv_blocks_free, 32);
    assert_int_equal(stt.requests_finished_total[FINISH_ABORT], 1);
    collected c = {0};
    assert_true(collect(s, &c));
    assert_int_equal(c.fin, FINISH_ABORT);
    assert_int_equal(c.n, 3);
    engine_stream_release(s);
    /* release of an unfinished stream aborts it */
    engine_stream *s2 = submit_ok(&h, p, 9, 50);
    assert_int_equal(engine_step(h.e, &err), 1);
    engine_stream_release(s2);
    assert_int_equal(engine_step(h.e, &err), 0);
    assert_all_free(&h);
    h_free(&h);
}

static void test_validation_and_limits(void **st) {
    (void)st;
    harness h;
    h_init(&h, 32, 4, 100, 8, 64, false);
    engine_status status;
    specd_err err = {0};
    int32_t p[120];
    make_prompt(p, 120, 1);
    assert_null(submit(&h, p, 0, 4, &status, &err));
    assert_int_equal(status, ENGINE_EINVAL);
    assert_non_null(strstr(err.msg, "empty"));
    int32_t bad[3] = {1, FAKE_VOCAB, 2};
    assert_null(submit(&h, bad, 3, 4, &status, &err));
    assert_non_null(strstr(err.msg, "token id 64 at position 1"));
    int32_t neg[2] = {-5, 2};
    assert_null(submit(&h, neg, 2, 4, &status, &err));
    assert_non_null(strstr(err.msg, "-5"));
    assert_null(submit(&h, p, 100, 1, &status, &err));
    assert_non_null(strstr(err.msg, "maximum context length is 100"));
    assert_non_null(strstr(err.msg, "100 tokens"));
    assert_null(submit(&h, p, 60, 41, &status, &err));
    assert_int_equal(status, ENGINE_EINVAL);
    assert_non_null(strstr(err.msg, "requested 101 tokens (60 in the prompt, 41 in the completion)"));
    assert_null(submit(&h, p, 10, 0, &status, &err));
    assert_non_null(strstr(err.msg, "max_tokens"));
    engine_request rq;
    memset(&rq, 0, sizeof rq);
    sampling_params_init(&rq.sp);
    rq.prompt = p;
    rq.n_prompt = 5;
    rq.sp.temperature = -0.5f;
    assert_null(engine_submit(h.e, &rq, NULL, NULL, &status, &err));
    assert_non_null(strstr(err.msg, "temperature"));
    rq.sp.temperature = 1.0f;
    rq.sp.top_p = 0.0f;
    assert_null(engine_submit(h.e, &rq, NULL, NULL, &status, &err));
    assert_non_null(strstr(err.msg, "top_p"));
    rq.sp.top_p = 1.0f;
    rq.sp.logprobs = 21;
    assert_null(engine_submit(h.e, &rq, NULL, NULL, &status, &err));
    assert_non_null(strstr(err.msg, "logprobs"));
    /* an exact fit is accepted */
    engine_stream *ok = submit(&h, p, 60, 40, &status, &err);
    assert_non_null(ok);
    assert_int_equal(status, ENGINE_OK);
    engine_stream_release(ok);
    run_until_idle(&h, 10);
    h_free(&h);

    /* bounded waiting queue, then draining */
    fake_runner f;
    engine_runner r;
    fake_runner_init(&f, 32, 4, &r);
    engine_detok d = fake_detok();
    engine_config cfg = {.max_model_len = 64, .max_num_seqs = 4, .max_num_batched_tokens = 64, .max_waiting = 3};
    engine *e;
    assert_int_equal(engine_create_ex(&cfg, &r, &d, NULL, NULL, &e, &err), 0);
    harness hh = {.e = e};
    engine_stream *q[4];
    for (int i = 0; i < 3; i++) q[i] = submit_ok(&hh, p, 4, 2);
    assert_null(submit(&hh, p, 4, 2, &status, &err));
    assert_int_equal(status, ENGINE_EFULL);
    assert_non_null(strstr(err.msg, "3 requests"));
    engine_drain(e);
    assert_null(submit(&hh, p, 4, 2, &status, &err));
    assert_int_equal(status, ENGINE_EDRAINING);
    for (int i = 0; i < 3; i++) engine_stream_release(q[i]);
    engine_destroy(e);
    free(f.kv);
}

/* --max-waiting while a step runs: the step's intake has moved the queued
 * requests out of the inbox, and engine_submit must still count them (the
 * published waiting count is only refreshed at the step's end). A runner
 * whose forward submits two requests in the middle of a step, with 2 of the
 * 3 places taken: the first is admitted, the second refused (before the fix
 * in scheduler.c intake_and_aborts both were admitted: 4 waiting of 3). */
typedef struct submitting_runner {
    engine_runner inner;
    harness *h;
    const int32_t *prompt;
    int armed;
    engine_stream *got[2];
    engine_status st[2];
} submitting_runner;

static int submitting_forward(void *ctx, const model_batch *b, specd_err *err) {
    submitting_runner *sr = ctx;
    if (sr->armed) {
        sr->armed = 0;
        for (int i = 0; i < 2; i++) {
            specd_err e2 = {0};
            sr->got[i] = submit(sr->h, sr->prompt, 4, 2, &sr->st[i], &e2);
        }
    }
    return sr->inner.forward(sr->inner.ctx, b, err);
}

static void test_max_waiting_mid_step(void **st) {
    (void)st;
    fake_runner f;
    submitting_runner sr = {0};
    fake_runner_init(&f, 32, 4, &sr.inner);
    engine_runner r = sr.inner;
    r.ctx = &sr;
    r.forward = submitting_forward;
    engine_detok d = fake_detok();
    engine_config cfg = {.max_model_len = 64, .max_num_seqs = 1, .max_num_batched_tokens = 64, .max_waiting = 3};
    engine *e;
    specd_err err = {0};
    assert_int_equal(engine_create_ex(&cfg, &r, &d, NULL, NULL, &e, &err), 0);
    harness hh = {.e = e};
    int32_t p[8];
    make_prompt(p, 8, 5);
    sr.h = &hh;
    sr.prompt = p;
    engine_stream *a = submit_ok(&hh, p, 8, 20);
    assert_int_equal(engine_step(e, &err), 1); /* a runs (max_num_seqs 1) */
    engine_stream *b = submit_ok(&hh, p, 4, 2), *c = submit_ok(&hh, p, 4, 2); /* 2 of the 3 places */
    sr.armed = 1;
    assert_int_equal(engine_step(e, &err), 1); /* intake moves b, c; the forward submits two more */
    assert_non_null(sr.got[0]);
    assert_int_equal(sr.st[0], ENGINE_OK);
    if (sr.got[1]) fail_msg("a 4th waiting request was admitted with --max-waiting 3 (status %d)", sr.st[1]);
    assert_int_equal(sr.st[1], ENGINE_EFULL);
    engine_stream_release(sr.got[0]);
    engine_stream_release(a), engine_stream_release(b), engine_stream_release(c);
    run_until_idle(&hh, 200);
    engine_destroy(e);
    free(f.kv);
}

/* --max-queue-time: a request still waiting (never admitted) past the limit
 * finishes with FINISH_ERROR, error_status 503 and a message naming the
 * flag; the running request is untouched; the counter counts it; nothing
 * leaks. */
static void test_queue_time_limit(void **st) {
    (void)st;
    fake_runner f;
    engine_runner r;
    fake_runner_init(&f, 32, 4, &r);
    engine_detok d = fake_detok();
    engine_config cfg = {.max_model_len = 64, .max_num_seqs = 1, .max_num_batched_tokens = 64, .max_waiting = 8,
                         .max_queue_time_s = 0.2};
    engine *e;
    specd_err err = {0};
    assert_int_equal(engine_create_ex(&cfg, &r, &d, NULL, NULL, &e, &err), 0);
    harness hh = {.e = e};
    int32_t p[8];
    make_prompt(p, 8, 3);
    engine_stream *a = submit_ok(&hh, p, 8, 20), *b = submit_ok(&hh, p, 4, 2);
    assert_int_equal(engine_step(e, &err), 1); /* a admitted (max_num_seqs 1), b waits */
    struct timespec ts = {0, 300 * 1000 * 1000};
    nanosleep(&ts, NULL);
    assert_int_equal(engine_step(e, &err), 1);
    engine_output *o = NULL;
    assert_int_equal(engine_stream_poll(b, &o), 1);
    assert_int_equal(o->finish, FINISH_ERROR);
    assert_int_equal(o->error_status, 503);
    assert_int_equal(o->n_tokens, 0);
    assert_non_null(strstr(o->error, "--max-queue-time"));
    engine_output_free(o);
    run_until_idle(&hh, 100);
    collected c = {0};
    assert_true(collect(a, &c));
    assert_int_equal(c.fin, FINISH_LENGTH);
    assert_int_equal(c.n, 20);
    engine_stats stt;
    engine_get_stats(e, &stt);
    assert_int_equal(stt.queue_timeouts_total, 1);
    assert_int_equal(stt.kv_blocks_free, stt.kv_blocks_total);
    engine_stream_release(a);
    engine_stream_release(b);
    engine_destroy(e);
    free(f.kv);
}

static void test_prefix_cache_hits(void **st) {
    (void)st;
    harness h;
    h_init(&h, 32, 4, 100, 8, 64, true);
    int32_t p[14];
    make_prompt(p, 14, 9);
    engine_stream *a = submit_ok(&h, p, 14, 6);
    run_until_idle(&h, 50);
    engine_stream *b = submit_ok(&h, p, 14, 6);
    run_until_idle(&h, 50);
    collected ca = {0}, cb = {0};
    assert_true(collect(a, &ca));
    assert_true(collect(b, &cb));
    check_against_reference(p, 14, &ca, 6);
    check_against_reference(p, 14, &cb, 6);
    engine_stats stt;
    engine_get_stats(h.e, &stt);
    assert_int_equal(stt.prefix_cache_hits_total, 12); /* 3 full blocks of 4 */
    assert_int_equal(stt.prefix_cache_queries_total, 28);
    assert_int_equal(stt.prompt_tokens_total, 28);
    engine_stream_release(a);
    engine_stream_release(b);
    assert_all_free(&h);
    h_free(&h);
}

static void test_seeded_sampling_batch_independent(void **st) {
    (void)st;
    int32_t p[6];
    make_prompt(p, 6, 4);
    int32_t toks[2][32];
    for (int run = 0; run < 2; run++) {
        harness h;
        h_init(&h, 64, 4, 100, 8, 64, false);
        engine_request rq;
        memset(&rq, 0, sizeof rq);
        sampling_params_init(&rq.sp);
        rq.sp.temperature = 1.5f;
        rq.sp.has_seed = true;
        rq.sp.seed = 1234;
        rq.sp.max_tokens = 20;
        rq.prompt = p;
        rq.n_prompt = 6;
        engine_stream *others[3] = {0};
        if (run == 1) /* same request inside a batch with other sampled requests */
            for (int i = 0; i < 3; i++) {
                engine_request o = rq;
                o.sp.seed = 99 + (uint64_t)i;
                others[i] = engine_submit(h.e, &o, NULL, NULL, NULL, NULL);
            }
        engine_stream *s = engine_submit(h.e, &rq, NULL, NULL, NULL, NULL);
        assert_non_null(s);
        run_until_idle(&h, 100);
        collected c = {0};
        assert_true(collect(s, &c));
        assert_int_equal(c.n, 20);
        memcpy(toks[run], c.toks, 20 * sizeof(int32_t));
        engine_stream_release(s);
        for (int i = 0; i < 3; i++) engine_stream_release(others[i]);
        h_free(&h);
    }
    assert_memory_equal(toks[0], toks[1], 20 * sizeof(int32_t));
}

static void test_runner_failure_and_eos(void **st) {
    (void)st;
    harness h;
    h_init(&h, 32, 4, 100, 8, 64, false);
    int32_t p[5];
    make_prompt(p, 5, 6);
    engine_stream *s = submit_ok(&h, p, 5, 10);
    h.f.fail_next = 1;
    specd_err err = {0};
    assert_int_equal(engine_step(h.e, &err), -1);
    collected c = {0};
    assert_true(collect(s, &c));
    assert_int_equal(c.fin, FINISH_ERROR);
    engine_stream_release(s);
    assert_all_free(&h);
    /* EOS from the model ends the request with FINISH_STOP; the EOS token is counted */
    h.f.eos_bias = 8;
    engine_stream *t = submit_ok(&h, p, 5, 10);
    run_until_idle(&h, 50);
    collected d = {0};
    assert_true(collect(t, &d));
    assert_int_equal(d.fin, FINISH_STOP);
    assert_int_equal(d.n, 4); /* positions 5,6,7 -> normal tokens; context length 8 -> EOS */
    assert_int_equal(d.toks[3], FAKE_EOS);
    assert_int_equal(d.usage, 4);
    engine_stream_release(t);
    assert_all_free(&h);
    h_free(&h);
}

/* The engine thread: 8 concurrent requests of different lengths, each equal
 * to its reference; notify is called; wait_idle returns idle. */
static int notify_count;
static void on_notify(void *arg) { __atomic_add_fetch((int *)arg, 1, __ATOMIC_SEQ_CST); }

static void test_thread_concurrent(void **st) {
    (void)st;
    harness h;
    h_init(&h, 40, 4, 64, 4, 16, true);
    specd_err err = {0};
    assert_int_equal(engine_start(h.e, &err), 0);
    int32_t p[8][30];
    engine_stream *s[8];
    int32_t lens[8], maxt[8];
    for (int i = 0; i < 8; i++) {
        lens[i] = 3 + i * 3;
        maxt[i] = 5 + (i * 7) % 11;
        make_prompt(p[i], lens[i], i < 4 ? 1 : i); /* the first four share a prefix */
        engine_request rq;
        memset(&rq, 0, sizeof rq);
        sampling_params_init(&rq.sp);
        rq.sp.temperature = 0.0f;
        rq.sp.max_tokens = maxt[i];
        rq.prompt = p[i];
        rq.n_prompt = (size_t)lens[i];
        s[i] = engine_submit(h.e, &rq, on_notify, &notify_count, NULL, &err);
        assert_non_null(s[i]);
    }
    for (int i = 0; i < 8; i++) {
        collected c = {0};
        engine_output *o;
        while (engine_stream_wait(s[i], &o, 10.0)) {
            for (size_t j = 0; j < o->n_tokens; j++) c.toks[c.n++] = o->token_ids[j];
            c.fin = o->finish;
            c.usage = o->n_completion_tokens;
            engine_output_free(o);
            if (c.fin) break;
        }
        check_against_reference(p[i], lens[i], &c, maxt[i]);
        engine_stream_release(s[i]);
    }
    assert_int_equal(engine_wait_idle(h.e, 5.0), 0);
    assert_true(__atomic_load_n(&notify_count, __ATOMIC_SEQ_CST) >= 8);
    assert_true(engine_loop_age_s(h.e) < 2.0);
    assert_all_free(&h);
    h_free(&h);
}

/* echo + logprobs: prompt logprobs across prefill chunks, equal to
 * log_softmax of the fake LM's logits computed directly; no prefix-cache hit. */
static void test_prompt_logprobs(void **st) {
    (void)st;
    harness h;
    h_init(&h, 32, 4, 100, 8, 8, true);
    int32_t p[20];
    make_prompt(p, 20, 12);
    engine_stream *warm = submit_ok(&h, p, 20, 2); /* fills the prefix cache */
    run_until_idle(&h, 50);
    engine_stream_release(warm);
    engine_request rq;
    memset(&rq, 0, sizeof rq);
    sampling_params_init(&rq.sp);
    rq.sp.temperature = 0.0f;
    rq.sp.max_tokens = 3;
    rq.sp.logprobs = 2;
    rq.prompt = p;
    rq.n_prompt = 20;
    rq.prompt_logprobs = true;
    engine_stream *s = engine_submit(h.e, &rq, NULL, NULL, NULL, NULL);
    assert_non_null(s);
    run_until_idle(&h, 50);
    engine_output *o;
    assert_true(engine_stream_poll(s, &o));
    assert_int_equal(o->n_cached_prompt_tokens, 0);
    assert_int_equal(o->n_prompt_logprobs, 19);
    for (int i = 0; i < 19; i++) {
        float l[FAKE_VOCAB];
        fake_logits(p, i + 1, 0, l);
        double mx = l[0], sum = 0;
        for (int v = 1; v < FAKE_VOCAB; v++) mx = l[v] > mx ? l[v] : mx;
        for (int v = 0; v < FAKE_VOCAB; v++) sum += exp(l[v] - mx);
        double want = l[p[i + 1]] - mx - log(sum);
        assert_int_equal(o->prompt_logprobs[i].id, p[i + 1]);
        if (fabs(o->prompt_logprobs[i].logprob - want) > 1e-5) fail_msg("pos %d: %g vs %g", i, o->prompt_logprobs[i].logprob, want);
        assert_int_equal(o->prompt_logprobs[i].n_top, 2);
    }
    /* sampled-token logprobs ride along */
    assert_non_null(o->logprobs);
    assert_int_equal(o->logprobs[0].n_top, 2);
    assert_int_equal(o->logprobs[0].top_ids[0], o->token_ids[0]); /* greedy = top-1 */
    engine_output_free(o);
    engine_stream_release(s);
    assert_all_free(&h);
    h_free(&h);
}

/* drain refuses new work, lets in-flight requests finish; wait_idle past its
 * timeout aborts what is left (running and waiting) and returns 1. */
static void test_drain_and_wait_idle_timeout(void **st) {
    (void)st;
    harness h;
    h_init(&h, 32, 4, 100, 1, 64, false); /* one running at a time: the second request waits */
    h.f.sleep_us = 2000;
    specd_err err = {0};
    assert_int_equal(engine_start(h.e, &err), 0);
    int32_t p[5];
    make_prompt(p, 5, 3);
    engine_stream *a = submit_ok(&h, p, 5, 90);
    engine_stream *b = submit_ok(&h, p, 5, 90);
    engine_drain(h.e);
    engine_status status;
    assert_null(submit(&h, p, 5, 2, &status, &err));
    assert_int_equal(status, ENGINE_EDRAINING);
    assert_int_equal(engine_wait_idle(h.e, 0.05), 1); /* 90 steps of 2 ms cannot finish in 50 ms */
    finish_reason fin[2] = {FINISH_NONE, FINISH_NONE};
    engine_stream *s[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        engine_output *o;
        while (fin[i] == FINISH_NONE && engine_stream_wait(s[i], &o, 10.0)) {
            fin[i] = o->finish;
            engine_output_free(o);
        }
        assert_int_equal(fin[i], FINISH_ABORT);
        engine_stream_release(s[i]);
    }
    assert_int_equal(engine_wait_idle(h.e, 5.0), 0);
    assert_all_free(&h);
    h_free(&h);
}

/* Client threads submitting, reading, aborting mid-stream and releasing
 * early while the engine thread runs (the HTTP disconnect pattern). Finished
 * requests equal the reference; afterwards nothing runs or waits and every
 * block is free. (Run under ThreadSanitizer by hand; clean.) */
typedef struct client_arg {
    harness *h;
    int id;
    int finished_ok, aborted;
} client_arg;

static void *client_main(void *arg) {
    client_arg *c = arg;
    uint64_t x = 0x9E3779B97F4A7C15ull * (uint64_t)(c->id + 1);
    for (int n = 0; n < 25; n++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int32_t p[24];
        int32_t len = 3 + (int32_t)(x % 20), maxt = 4 + (int32_t)((x >> 8) % 20);
        make_prompt(p, len, c->id * 100 + n);
        engine_request rq;
        memset(&rq, 0, sizeof rq);
        sampling_params_init(&rq.sp);
        rq.sp.temperature = 0.0f;
        rq.sp.max_tokens = maxt;
        rq.prompt = p;
        rq.n_prompt = (size_t)len;
        engine_stream *s = engine_submit(c->h->e, &rq, NULL, NULL, NULL, NULL);
        if (!s) continue;
        int mode = (int)((x >> 16) % 4); /* 0: abort after the first output, 1: release at once, else read all */
        if (mode == 1) {
            engine_stream_release(s);
            c->aborted++;
            continue;
        }
        collected col = {0};
        engine_output *o;
        bool done = false;
        while (!done && engine_stream_wait(s, &o, 10.0)) {
            for (size_t i = 0; i < o->n_tokens; i++) col.toks[col.n++] = o->token_ids[i];
            col.fin = o->finish;
            done = o->finish != FINISH_NONE;
            engine_output_free(o);
            if (mode == 0 && !done) {
                engine_stream_abort(s);
                mode = 2;
            }
        }
        if (col.fin == FINISH_LENGTH) {
            int32_t ref[64];
            int32_t nr = fake_reference_greedy(p, len, maxt, 0, false, ref);
            if (col.n == nr && memcmp(col.toks, ref, (size_t)nr * sizeof *ref) == 0) c->finished_ok++;
        } else if (col.fin == FINISH_ABORT) {
            c->aborted++;
        }
        engine_stream_release(s);
    }
    return NULL;
}

static void test_client_threads_abort_stress(void **st) {
    (void)st;
    harness h;
    h_init(&h, 24, 4, 64, 6, 24, true);
    h.f.sleep_us = 200;
    specd_err err = {0};
    assert_int_equal(engine_start(h.e, &err), 0);
    pthread_t th[4];
    client_arg ca[4];
    for (int i = 0; i < 4; i++) {
        ca[i] = (client_arg){.h = &h, .id = i};
        assert_int_equal(pthread_create(&th[i], NULL, client_main, &ca[i]), 0);
    }
    int ok = 0, aborted = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ok += ca[i].finished_ok;
        aborted += ca[i].aborted;
    }
    printf("stress: %d finished equal to the reference, %d aborted, of 100\n", ok, aborted);
    assert_int_equal(ok + aborted, 100);
    assert_true(ok > 20 && aborted > 10);
    assert_int_equal(engine_wait_idle(h.e, 10.0), 0);
    assert_all_free(&h);
    h_free(&h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_single_request_matches_reference),
        cmocka_unit_test(test_chunked_prefill_budget),
        cmocka_unit_test(test_admission_limited_by_blocks),
        cmocka_unit_test(test_preemption_recompute),
        cmocka_unit_test(test_abort_frees_blocks_same_step),
        cmocka_unit_test(test_validation_and_limits),
        cmocka_unit_test(test_queue_time_limit),
        cmocka_unit_test(test_max_waiting_mid_step),
        cmocka_unit_test(test_prefix_cache_hits),
        cmocka_unit_test(test_seeded_sampling_batch_independent),
        cmocka_unit_test(test_runner_failure_and_eos),
        cmocka_unit_test(test_thread_concurrent),
        cmocka_unit_test(test_prompt_logprobs),
        cmocka_unit_test(test_drain_and_wait_idle_timeout),
        cmocka_unit_test(test_client_threads_abort_stress),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
