/*
 * test_engine_text.c: detokenization and stop strings through the engine with
 * the REAL SmolLM2 tokenizer (from the GGUF; skipped with exit 77 when the
 * model is not installed).
 *
 * A scripted runner makes the "model" emit the tokenization of a known UTF-8
 * string S (emoji, CJK, symbols that byte-level BPE splits across tokens),
 * then EOS. The expected text is S itself (the independent reference: the
 * string we started from; decode(encode(S)) == S is the tokenizer's own
 * tested property). Checked, with and without speculation (a scripted
 * proposer whose drafts are always right, so steps carry up to 6 tokens):
 *  - the deltas concatenate to S, each delta is valid UTF-8 (never a split
 *    character), the EOS is counted in usage and adds no text;
 *  - stop strings (CJK, emoji, spanning tokens): text is exactly S up to the
 *    stop, never a byte of the stop itself, nothing lost before it;
 *  - max_tokens ending inside a multi-byte character: the complete characters
 *    and nothing for the incomplete tail (no U+FFFD: vLLM's rule, docs/server.md).
 * Last, the real model through engine_create (model + tokenizer): a chat
 * prompt's greedy output text equals tok_decode of its tokens.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/runtime/engine_ex.h"
#include "engine/runtime/proposer.h"
#include "engine/tokenizer/tokenizer.h"

static const char *S = "Hi \xF0\x9F\x8E\x89 \xE4\xBD\xA0\xE5\xA5\xBD \xE2\x82\xAC" "5 \xE2\x80\x94 done. "
                       "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E\xE3\x81\xAE\xE3\x83\x86\xE3\x82\xAD\xE3\x82\xB9\xE3\x83\x88 "
                       "\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD!";

static gguf_file *g_gguf;
static tokenizer *g_tok;
static int32_t *g_ids;
static size_t g_n;
static int32_t g_eos;
static int32_t g_prompt[4] = {504, 3458, 314, 260}; /* any in-vocabulary ids */

/* ---- scripted runner: output at position p is script[p + 1 - P], then EOS ---- */
typedef struct scripted {
    int32_t vocab;
} scripted;

static int scripted_forward(void *ctx, const model_batch *b, specd_err *err) {
    scripted *sc = ctx;
    (void)err;
    for (int32_t o = 0; o < b->n_out; o++) {
        int32_t p = b->pos[b->out_idx[o]];
        int32_t idx = p + 1 - 4;
        int32_t next = idx >= 0 && (size_t)idx < g_n ? g_ids[idx] : g_eos;
        float *row = b->logits + (size_t)o * (size_t)sc->vocab;
        for (int32_t v = 0; v < sc->vocab; v++) row[v] = 0.0f;
        row[next] = 10.0f;
    }
    return 0;
}

/* ---- scripted proposer: drafts the script (always right) ---- */
static int32_t sp_ntok[64];
static int sp_extend(void *ctx, int64_t id, const int32_t *t, int32_t n, int32_t pos0, const float *aux,
                     specd_err *err) {
    (void)ctx, (void)t, (void)aux, (void)err;
    if (pos0 + n > sp_ntok[id % 64]) sp_ntok[id % 64] = pos0 + n;
    return 0;
}
static int sp_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                      int32_t *out, float *q, specd_err *err) {
    (void)ctx, (void)temps, (void)q, (void)err;
    for (int32_t i = 0; i < n; i++)
        for (int32_t j = 0; j < k_max; j++) {
            int32_t idx = sp_ntok[ids[i] % 64] - 4 + j;
            out[i * k_max + j] = j < k[i] && idx >= 0 && (size_t)idx < g_n ? g_ids[idx] : -1;
        }
    return 0;
}
static void sp_free(void *ctx, int64_t id) { (void)ctx, sp_ntok[id % 64] = 0; }
static void sp_trunc(void *ctx, int64_t id, int32_t n) {
    (void)ctx;
    if (sp_ntok[id % 64] > n) sp_ntok[id % 64] = n;
}
static const spec_proposer_ops sp_ops = {.extend = sp_extend, .propose = sp_propose, .truncate = sp_trunc,
                                         .free_seq = sp_free};

static int utf8_valid(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!len || i + (size_t)len > n) return 0;
        for (int j = 1; j < len; j++)
            if (((unsigned char)s[i + (size_t)j] >> 6) != 2) return 0;
        i += (size_t)len;
    }
    return 1;
}

typedef struct got {
    char text[1024];
    int32_t n_tokens, usage, n_outputs;
    finish_reason fin;
    char stop_reason[64];
} got;

static void run(bool spec, const char *const *stop, size_t n_stop, int32_t max_tokens, got *g) {
    scripted sc = {.vocab = tok_vocab_size(g_tok)};
    engine_runner r = {.ctx = &sc, .forward = scripted_forward, .vocab = sc.vocab, .hidden = 8, .block_size = 4,
                       .n_blocks = 64};
    engine_detok d = engine_detok_from_tokenizer(g_tok);
    engine_config cfg = {.max_model_len = 200, .max_num_seqs = 4, .max_num_batched_tokens = 64, .max_waiting = 8,
                         .num_speculative_tokens = 5};
    engine *e = NULL;
    specd_err err = {0};
    spec_proposer prop = {.ops = &sp_ops, .ctx = NULL};
    memset(sp_ntok, 0, sizeof sp_ntok);
    if (engine_create_ex(&cfg, &r, &d, NULL, g_tok, &e, &err) != 0) fail_msg("%s", err.msg);
    if (spec && engine_set_proposer(e, &prop, &err) != 0) fail_msg("%s", err.msg);
    engine_request rq;
    memset(&rq, 0, sizeof rq);
    sampling_params_init(&rq.sp);
    rq.sp.temperature = 0.0f;
    rq.sp.max_tokens = max_tokens;
    rq.sp.stop = stop;
    rq.sp.n_stop = n_stop;
    rq.prompt = g_prompt;
    rq.n_prompt = 4;
    engine_stream *s = engine_submit(e, &rq, NULL, NULL, NULL, &err);
    if (!s) fail_msg("%s", err.msg);
    for (int i = 0; i < 1000 && engine_step(e, &err) > 0; i++) {}
    memset(g, 0, sizeof *g);
    engine_output *o;
    while (engine_stream_poll(s, &o)) {
        g->n_outputs++;
        if (!utf8_valid(o->text, o->text_len)) fail_msg("delta %d is not valid UTF-8", g->n_outputs);
        strncat(g->text, o->text, sizeof g->text - strlen(g->text) - 1);
        g->n_tokens += (int32_t)o->n_tokens;
        g->usage = o->n_completion_tokens;
        g->fin = o->finish;
        snprintf(g->stop_reason, sizeof g->stop_reason, "%s", o->stop_reason);
        engine_output_free(o);
    }
    engine_stream_release(s);
    engine_stats st;
    engine_get_stats(e, &st);
    assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
    if (spec && max_tokens >= 3) assert_true(st.spec_num_accepted_tokens_total > 0);
    engine_destroy(e);
}

static int setup(void **st) {
    (void)st;
    const char *p = getenv("SPECD_MODEL_GGUF");
    FILE *f = p ? fopen(p, "rb") : NULL;
    if (!f) {
        printf("SKIP: SmolLM2 GGUF not found at %s (run tools/setup.sh)\n", p ? p : "(SPECD_MODEL_GGUF unset)");
        exit(77);
    }
    fclose(f);
    specd_err err = {0};
    if (gguf_open(p, &g_gguf, &err) != 0 || tok_create_from_gguf(g_gguf, &g_tok, &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    if (tok_encode(g_tok, S, strlen(S), false, &g_ids, &g_n, &err) != 0) return -1;
    g_eos = tok_eos_id(g_tok);
    /* the script must split at least one character across tokens, or the test proves little */
    int split = 0;
    for (size_t i = 0; i < g_n; i++) {
        size_t len;
        const char *b = tok_token_bytes(g_tok, g_ids[i], &len);
        if (!utf8_valid(b, len)) split++;
    }
    printf("%zu tokens, %d of them not valid UTF-8 on their own\n", g_n, split);
    return split > 0 ? 0 : -1;
}

static int teardown(void **st) {
    (void)st;
    free(g_ids);
    tok_destroy(g_tok);
    gguf_close(g_gguf);
    return 0;
}

static void test_full_text(void **st) {
    (void)st;
    for (int spec = 0; spec < 2; spec++) {
        got g;
        run(spec, NULL, 0, 100, &g);
        assert_string_equal(g.text, S);
        assert_int_equal(g.fin, FINISH_STOP);
        assert_int_equal(g.n_tokens, (int32_t)g_n + 1); /* + EOS */
        assert_int_equal(g.usage, (int32_t)g_n + 1);
        if (spec) assert_true(g.n_outputs < g.n_tokens);
    }
}

static void expect_stop(const char *stop, const char *before) {
    for (int spec = 0; spec < 2; spec++) {
        got g;
        const char *stops[2] = {"never-appears", stop};
        run(spec, stops, 2, 100, &g);
        assert_string_equal(g.text, before);
        assert_int_equal(g.fin, FINISH_STOP);
        assert_string_equal(g.stop_reason, stop);
        assert_true(g.usage < (int32_t)g_n);
    }
}

static void test_stop_strings(void **st) {
    (void)st;
    expect_stop("\xE4\xBD\xA0\xE5\xA5\xBD", "Hi \xF0\x9F\x8E\x89 ");                 /* CJK */
    expect_stop("\xF0\x9F\x8E\x89 \xE4\xBD\xA0", "Hi ");                              /* emoji + space + CJK */
    expect_stop("done", "Hi \xF0\x9F\x8E\x89 \xE4\xBD\xA0\xE5\xA5\xBD \xE2\x82\xAC" "5 \xE2\x80\x94 ");
    expect_stop("\xF0\x9F\x8F\xBD", "Hi \xF0\x9F\x8E\x89 \xE4\xBD\xA0\xE5\xA5\xBD \xE2\x82\xAC" "5 \xE2\x80\x94 done. "
                                    "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E\xE3\x81\xAE\xE3\x83\x86\xE3\x82\xAD\xE3\x82\xB9"
                                    "\xE3\x83\x88 \xF0\x9F\x91\x8D"); /* skin-tone modifier */
}

/* max_tokens cutting a character: complete characters, nothing for the rest */
static void test_length_inside_character(void **st) {
    (void)st;
    int tested = 0;
    for (size_t k = 1; k < g_n && tested < 3; k++) {
        char raw[512] = "";
        size_t rl = 0;
        for (size_t i = 0; i < k; i++) {
            size_t len;
            const char *b = tok_token_bytes(g_tok, g_ids[i], &len);
            memcpy(raw + rl, b, len);
            rl += len;
        }
        raw[rl] = '\0';
        if (utf8_valid(raw, rl)) continue;
        /* expected: raw minus the incomplete tail */
        size_t cut = rl;
        while (cut > 0 && ((unsigned char)raw[cut - 1] >> 6) == 2) cut--;
        if (cut > 0) cut--; /* the lead byte */
        char want[520];
        memcpy(want, raw, cut);
        want[cut] = '\0';
        for (int spec = 0; spec < 2; spec++) {
            got g;
            run(spec, NULL, 0, (int32_t)k, &g);
            assert_int_equal(g.fin, FINISH_LENGTH);
            assert_int_equal(g.usage, (int32_t)k);
            assert_string_equal(g.text, want);
        }
        tested++;
    }
    assert_true(tested > 0);
}

/* The real model through engine_create: output text equals tok_decode of its tokens. */
static void test_real_model_chat(void **st) {
    (void)st;
    backend *be = bk_cpu_create(0);
    model_load_opts o = {.block_size = 16, .n_blocks = 64};
    model *m = NULL;
    specd_err err = {0};
    if (model_load(getenv("SPECD_MODEL_GGUF"), be, &o, &m, &err) != 0) fail_msg("%s", err.msg);
    engine_config cfg = {.max_model_len = 0, .max_num_seqs = 4, .max_num_batched_tokens = 256, .max_waiting = 8};
    engine *e = NULL;
    if (engine_create(&cfg, m, g_tok, &e, &err) != 0) fail_msg("%s", err.msg);
    assert_int_equal(engine_get_config(e)->max_model_len, 1024); /* min(8192 trained, 64 x 16 pool) */
    assert_int_equal(engine_start(e, &err), 0);
    chat_message msgs[1] = {{.role = "user", .content = "Write one sentence about the sea."}};
    chat_options co = {.add_generation_prompt = true, .thinking = -1};
    int32_t *ids = NULL;
    size_t n = 0;
    if (tok_chat_encode(g_tok, msgs, 1, &co, &ids, &n, NULL, &err) != 0) fail_msg("%s", err.msg);
    engine_request rq;
    memset(&rq, 0, sizeof rq);
    sampling_params_init(&rq.sp);
    rq.sp.temperature = 0.0f;
    rq.sp.max_tokens = 24;
    rq.prompt = ids;
    rq.n_prompt = n;
    engine_stream *s = engine_submit(e, &rq, NULL, NULL, NULL, &err);
    assert_non_null(s);
    char text[2048] = "";
    int32_t toks[64];
    size_t nt = 0;
    engine_output *out;
    finish_reason fin = FINISH_NONE;
    while (fin == FINISH_NONE && engine_stream_wait(s, &out, 300.0)) {
        assert_true(utf8_valid(out->text, out->text_len));
        strncat(text, out->text, sizeof text - strlen(text) - 1);
        for (size_t i = 0; i < out->n_tokens; i++) toks[nt++] = out->token_ids[i];
        fin = out->finish;
        assert_int_equal(out->n_prompt_tokens, (int32_t)n);
        engine_output_free(out);
    }
    engine_stream_release(s);
    size_t n_text = nt;
    if (fin == FINISH_STOP) n_text--; /* the stop token adds no text */
    char *dec = NULL;
    size_t dl = 0;
    assert_int_equal(tok_decode(g_tok, toks, n_text, true, &dec, &dl, &err), 0);
    printf("output (%zu tokens, finish %d): %s\n", nt, fin, text);
    assert_string_equal(text, dec);
    assert_true(nt > 3);
    free(dec);
    free(ids);
    engine_destroy(e);
    model_destroy(m);
    bk_cpu_destroy(be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_full_text),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_length_inside_character),
        cmocka_unit_test(test_real_model_chat),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
