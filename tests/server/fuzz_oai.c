/*
 * fuzz_oai.c: libFuzzer harness for the OpenAI request parser (untrusted
 * input from the network): every byte string goes through
 * oai_parse_request for both endpoints; accepted requests are also taken
 * through the context check and the response/SSE builders, and rejected ones
 * through the error body. The invariants checked by the sanitizers: no crash,
 * no leak, no out-of-bounds access, and a rejected request is 400/500 with a
 * non-empty message. The input is also taken as model output through the
 * chat output parser (oai_tools.c) with every reasoning / tools setting, in
 * one piece and in 3-byte pieces: the two results must be identical.
 *
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DSPECD_FUZZ=ON
 *   cmake --build build-fuzz --target fuzz_oai
 *   build-fuzz/tests/server/fuzz_oai -max_total_time=60 /tmp/corpus tests/server/corpus_oai
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/oai.h"

/* The parser only needs the runtime for sampling_params_init; the harness is
 * built without the engine libraries (they need not compile with the fuzzer
 * flags), so it carries a stand-in with the defaults engine.h documents. */
void sampling_params_init(sampling_params *sp) {
    memset(sp, 0, sizeof *sp);
    sp->temperature = 1.0f;
    sp->top_p = 1.0f;
    sp->top_k = -1;
    sp->repetition_penalty = 1.0f;
    sp->max_tokens = 16;
    sp->logprobs = -1;
    sp->skip_special_tokens = true;
    sp->num_speculative_tokens = -1;
}

/* Parses TEXT fed in pieces of STEP bytes (0 = whole) into *D. */
static void parse_pieces(const char *text, size_t n, bool reasoning, bool tools, size_t step, oai_parsed *d) {
    oai_outparse p;
    if (oai_outparse_init(&p, reasoning, tools, NULL, 0)) abort();
    size_t at = 0;
    do {
        size_t k = step && n - at > step ? step : n - at;
        if (oai_outparse_feed(&p, text + at, k, at + k == n, d)) abort();
        at += k;
    } while (at < n);
    oai_outparse_free(&p);
}

static bool same(const char *a, size_t al, const char *b, size_t bl) { return al == bl && (!al || !memcmp(a, b, al)); }

static void fuzz_output_parser(const char *text, size_t n) {
    for (int mode = 0; mode < 4; mode++) {
        oai_parsed whole = {0}, split = {0};
        parse_pieces(text, n, mode & 1, mode & 2, 0, &whole);
        parse_pieces(text, n, mode & 1, mode & 2, 3, &split);
        if (!same(whole.reasoning, whole.reasoning_len, split.reasoning, split.reasoning_len) ||
            !same(whole.content, whole.content_len, split.content, split.content_len) || whole.n_calls != split.n_calls)
            abort();
        for (size_t i = 0; i < whole.n_calls; i++)
            if (strcmp(whole.calls[i].id, split.calls[i].id) || strcmp(whole.calls[i].arguments, split.calls[i].arguments))
                abort();
        /* nothing is lost: every byte lands in reasoning, content or a call (markers aside) */
        if (whole.reasoning_len + whole.content_len > n) abort();
        oai_parsed_free(&whole);
        oai_parsed_free(&split);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_output_parser((const char *)data, size);
    for (int k = 0; k < 2; k++) {
        oai_request r;
        oai_error e;
        memset(&e, 0, sizeof e);
        if (oai_parse_request(k ? OAI_CHAT : OAI_COMPLETION, (const char *)data, size, &r, &e) == 0) {
            int32_t mt;
            (void)oai_resolve_max_tokens(&r, 7, 64, &mt, &e);
            if (r.n_prompts && r.prompts[0].is_ids) (void)oai_check_ids(r.prompts[0].ids, r.prompts[0].n_ids, 100, "prompt", &e);
            oai_resp_ctx rc = {.kind = r.kind, .id = "x", .created = 1, .model = "m", .logprobs = r.logprobs};
            oai_choice c;
            memset(&c, 0, sizeof c);
            engine_output o;
            memset(&o, 0, sizeof o);
            const char *text = r.n_prompts ? r.prompts[0].text : (r.n_messages ? r.messages[0].content : NULL);
            o.text = (char *)(text ? text : "");
            o.text_len = strlen(o.text);
            o.finish = FINISH_STOP;
            if (r.n_stop) snprintf(o.stop_reason, sizeof o.stop_reason, "%s", r.stop[0]);
            if (oai_choice_add(&c, &o) == 0) {
                free(oai_response_json(&rc, &c, 1, 7, NULL));
                size_t len;
                free(oai_chunk_sse(&rc, 0, c.text, c.text_len, NULL, NULL, 0, 0, c.finish, c.stop_reason, -1, true,
                                   r.include_usage, &len));
            }
            oai_choice_free(&c);
            oai_request_free(&r);
        } else {
            if ((e.status != 400 && e.status != 500) || !e.message[0]) abort();
            free(oai_error_json(&e, NULL));
        }
    }
    return 0;
}
