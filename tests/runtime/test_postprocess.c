/*
 * test_postprocess.c: stop handling on hand-written token pieces: stop
 * strings across token boundaries and inside one token, hold-back of stop
 * prefixes (and its release), multi-token steps cut exactly at the stop,
 * EOS / ignore_eos / stop_token_ids / min_tokens / max_tokens / context limit,
 * and usage (tokens kept). Expected texts are written out by hand from the
 * OpenAI/vLLM rules in postprocess.h.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "fake_runner.h"
#include "engine/runtime/postprocess.h"

static const char *const pieces[FAKE_VOCAB] = {
    [0] = "Hello", [1] = " wo", [2] = "rld", [3] = "!", [4] = " EN", [5] = "D", [6] = "x", [7] = "abSTOPcd",
};

typedef struct run {
    post_params pp;
    post_state st;
    post_delta d;
    engine_detok dk;
} run;

static void run_init(run *r, const sampling_params *sp, int32_t max_model_len) {
    memset(r, 0, sizeof *r);
    fake_pieces = pieces;
    r->dk = fake_detok();
    assert_int_equal(post_params_init(&r->pp, sp, max_model_len), 0);
    assert_int_equal(post_init(&r->st, &r->dk, true), 0);
    post_delta_reset(&r->d);
}

static void run_free(run *r) {
    post_params_free(&r->pp);
    post_free(&r->st);
    post_delta_free(&r->d);
}

/* Pushes one token as its own step; returns the finish; TEXT gets the delta text. */
static finish_reason step1(run *r, int32_t tok, int32_t n_ctx, char *text, size_t cap) {
    post_delta_reset(&r->d);
    finish_reason f = post_token(&r->st, &r->pp, &r->dk, tok, n_ctx, &r->d);
    snprintf(text, cap, "%s", r->d.text ? r->d.text : "");
    return f;
}

static sampling_params sp_stop(const char *const *stop, size_t n) {
    sampling_params sp;
    sampling_params_init(&sp);
    sp.max_tokens = 100;
    sp.stop = stop;
    sp.n_stop = n;
    return sp;
}

static void test_holdback(void **st) {
    (void)st;
    char *s1[1] = {"bcd"};
    assert_int_equal(post_holdback("abc", 3, s1, 1), 2);
    char *s2[2] = {"c", "xy"};
    assert_int_equal(post_holdback("abc", 3, s2, 2), 0);
    char *s3[2] = {"END", "cE"};
    assert_int_equal(post_holdback("abcE", 4, s3, 2), 1); /* "E" (prefix of "END"); "cE" is a full match, not a prefix */
    assert_int_equal(post_holdback("", 0, s3, 2), 0);
}

static void test_stop_across_tokens(void **st) {
    (void)st;
    const char *stop[1] = {"END"};
    sampling_params sp = sp_stop(stop, 1);
    run r;
    run_init(&r, &sp, 1000);
    char t[64];
    assert_int_equal(step1(&r, 0, 10, t, sizeof t), FINISH_NONE);
    assert_string_equal(t, "Hello");
    assert_int_equal(step1(&r, 1, 11, t, sizeof t), FINISH_NONE);
    assert_string_equal(t, " wo");
    assert_int_equal(step1(&r, 2, 12, t, sizeof t), FINISH_NONE);
    assert_string_equal(t, "rld");
    assert_int_equal(step1(&r, 4, 13, t, sizeof t), FINISH_NONE);
    assert_string_equal(t, " "); /* "EN" held back: could become "END" */
    assert_int_equal(step1(&r, 5, 14, t, sizeof t), FINISH_STOP);
    assert_string_equal(t, ""); /* the stop string itself is not emitted */
    assert_string_equal(r.d.stop_reason, "END");
    assert_int_equal(r.d.stop_token_id, -1);
    assert_int_equal(r.st.n_out, 5);
    run_free(&r);
}

static void test_holdback_released(void **st) {
    (void)st;
    const char *stop[1] = {"END"};
    sampling_params sp = sp_stop(stop, 1);
    run r;
    run_init(&r, &sp, 1000);
    char t[64];
    assert_int_equal(step1(&r, 4, 10, t, sizeof t), FINISH_NONE);
    assert_string_equal(t, " ");
    assert_int_equal(step1(&r, 6, 11, t, sizeof t), FINISH_NONE);
    assert_string_equal(t, "ENx");
    /* held text is flushed when the sequence ends by length */
    assert_int_equal(step1(&r, 4, 12, t, sizeof t), FINISH_NONE);
    assert_string_equal(t, " ");
    post_delta_reset(&r.d);
    post_finish(&r.st, FINISH_LENGTH, &r.d);
    assert_string_equal(r.d.text, "EN");
    run_free(&r);
}

static void test_multi_token_step_cut(void **st) {
    (void)st;
    const char *stop[2] = {"cd", "STOP"};
    sampling_params sp = sp_stop(stop, 2);
    run r;
    run_init(&r, &sp, 1000);
    /* one step accepted three tokens: Hello | abSTOPcd | " wo"; processing stops inside the second */
    int32_t toks[3] = {0, 7, 1};
    size_t kept = 0;
    post_delta_reset(&r.d);
    for (size_t i = 0; i < 3; i++) {
        kept++;
        if (post_token(&r.st, &r.pp, &r.dk, toks[i], 20 + (int32_t)i, &r.d) != FINISH_NONE) break;
    }
    assert_int_equal(kept, 2);
    assert_int_equal(r.d.n_tokens, 2);
    assert_int_equal(r.st.n_out, 2);
    assert_string_equal(r.d.text, "Helloab"); /* earliest match "STOP" at 'S', not "cd" */
    assert_string_equal(r.d.stop_reason, "STOP");
    assert_int_equal(r.d.finish, FINISH_STOP);
    /* a finished state ignores further tokens */
    assert_int_equal(post_token(&r.st, &r.pp, &r.dk, 3, 30, &r.d), FINISH_STOP);
    assert_int_equal(r.st.n_out, 2);
    run_free(&r);
}

static void test_token_stops(void **st) {
    (void)st;
    char t[64];
    run r;
    /* EOS: counted, no text, held text flushed */
    const char *stop[1] = {"END"};
    sampling_params sp = sp_stop(stop, 1);
    run_init(&r, &sp, 1000);
    assert_int_equal(step1(&r, 4, 5, t, sizeof t), FINISH_NONE);
    assert_int_equal(step1(&r, FAKE_EOS, 6, t, sizeof t), FINISH_STOP);
    assert_string_equal(t, "EN");
    assert_int_equal(r.d.stop_token_id, -1); /* EOS: stop_reason null, as vLLM */
    assert_int_equal(r.d.n_tokens, 1);
    assert_int_equal(r.st.n_out, 2);
    run_free(&r);
    /* ignore_eos: EOS is an ordinary token */
    sp = sp_stop(NULL, 0);
    sp.ignore_eos = true;
    run_init(&r, &sp, 1000);
    assert_int_equal(step1(&r, FAKE_EOS, 5, t, sizeof t), FINISH_NONE);
    assert_string_equal(t, "t63 ");
    run_free(&r);
    /* stop_token_ids */
    int32_t ids[2] = {9, 3};
    sp = sp_stop(NULL, 0);
    sp.stop_token_ids = ids;
    sp.n_stop_token_ids = 2;
    run_init(&r, &sp, 1000);
    assert_int_equal(step1(&r, 0, 5, t, sizeof t), FINISH_NONE);
    assert_int_equal(step1(&r, 3, 6, t, sizeof t), FINISH_STOP);
    assert_string_equal(t, "");
    assert_int_equal(r.d.stop_token_id, 3);
    run_free(&r);
}

static void test_min_max_tokens_and_context(void **st) {
    (void)st;
    char t[64];
    run r;
    /* min_tokens 3: "wo" inside token 2 is not a stop yet; at token 4 ("rld", n_out 3) "rl" stops */
    const char *stop[2] = {"wo", "rl"};
    sampling_params sp = sp_stop(stop, 2);
    sp.min_tokens = 3;
    run_init(&r, &sp, 1000);
    assert_int_equal(step1(&r, 0, 5, t, sizeof t), FINISH_NONE);
    assert_int_equal(step1(&r, 1, 6, t, sizeof t), FINISH_NONE);
    assert_string_equal(t, " wo");
    assert_int_equal(step1(&r, 2, 7, t, sizeof t), FINISH_STOP);
    assert_string_equal(t, "");
    assert_string_equal(r.d.stop_reason, "rl");
    run_free(&r);
    /* max_tokens 2: length; held-back text flushed */
    const char *stop2[1] = {"END"};
    sp = sp_stop(stop2, 1);
    sp.max_tokens = 2;
    run_init(&r, &sp, 1000);
    assert_int_equal(step1(&r, 0, 5, t, sizeof t), FINISH_NONE);
    assert_int_equal(step1(&r, 4, 6, t, sizeof t), FINISH_LENGTH);
    assert_string_equal(t, " EN");
    assert_int_equal(r.st.n_out, 2);
    run_free(&r);
    /* context limit: sequence length reaches max_model_len */
    sp = sp_stop(NULL, 0);
    run_init(&r, &sp, 8);
    assert_int_equal(step1(&r, 0, 7, t, sizeof t), FINISH_NONE);
    assert_int_equal(step1(&r, 0, 8, t, sizeof t), FINISH_LENGTH);
    run_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_holdback),           cmocka_unit_test(test_stop_across_tokens),
        cmocka_unit_test(test_holdback_released),  cmocka_unit_test(test_multi_token_step_cut),
        cmocka_unit_test(test_token_stops),        cmocka_unit_test(test_min_max_tokens_and_context),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
