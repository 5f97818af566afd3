/*
 * fuzz_chat_template.c: libFuzzer harness for the chat template recogniser
 * and renderer (engine/tokenizer/chat_template.c). The template text comes
 * from the model file (tokenizer.chat_template / tokenizer_config.json), so
 * it is untrusted input, as are the messages (from the network).
 *
 * Input layout: TEMPLATE \0 ROLE \1 CONTENT \1 ROLE \1 CONTENT ... (missing
 * parts are empty). The SmolLM2 tokenizer is loaded once from
 * SPECD_MODEL_GGUF; each input sets its template (tok_set_chat_template),
 * then renders and encodes the conversation with and without the generation
 * prompt and with thinking on, off and default.
 *
 * Oracle: a refusal carries a message; an accepted render is text whose
 * every byte is reachable, an accepted encode yields ids inside the
 * vocabulary and a loss mask of 0/1 bytes. Seeds: the SmolLM2 ChatML template
 * and Kimi's (tools/kimi/chat_template.jinja), tests/fuzz/corpus_chat_template.
 *
 * Run: SPECD_MODEL_GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf \
 *      build-fuzz/tests/fuzz/fuzz_chat_template -max_total_time=60 tests/fuzz/corpus_chat_template
 * Threading: single-threaded.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/loader/gguf.h"
#include "engine/tokenizer/tok_internal.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static tokenizer *T;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *p = getenv("SPECD_MODEL_GGUF");
    gguf_file *g = NULL;
    specd_err err = {{0}};
    if (!p || gguf_open(p, &g, &err) < 0 || tok_create_from_gguf(g, &T, &err) < 0) {
        fprintf(stderr, "fuzz_chat_template: set SPECD_MODEL_GGUF (%s)\n", err.msg);
        abort();
    }
    return 0; /* g stays open for the process */
}

#define MAX_MSGS 8

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *z = memchr(data, 0, size);
    size_t tl = z ? (size_t)(z - data) : size;
    specd_err err = {{0}};
    if (tok_set_chat_template(T, (const char *)data, tl, &err) != 0) {
        if (!err.msg[0]) abort();
        return 0;
    }
    /* the messages: NUL-terminated copies of the \1-separated fields */
    size_t rest = z ? size - tl - 1 : 0;
    char *buf = malloc(rest + 1);
    if (rest) memcpy(buf, z + 1, rest);
    buf[rest] = '\0';
    for (size_t i = 0; i < rest; i++)
        if (buf[i] == '\0') buf[i] = ' ';
    char *field[2 * MAX_MSGS];
    size_t nf = 0;
    char *s = buf;
    while (nf < 2 * MAX_MSGS) {
        field[nf++] = s;
        char *e = strchr(s, '\1');
        if (!e) break;
        *e = '\0';
        s = e + 1;
    }
    chat_message m[MAX_MSGS];
    size_t nm = 0;
    for (size_t i = 0; i + 1 < nf; i += 2) m[nm++] = (chat_message){.role = field[i], .content = field[i + 1]};
    if (nf % 2 == 1 && nf > 1) m[nm++] = (chat_message){.role = "user", .content = field[nf - 1]};
    for (int v = 0; v < 6; v++) {
        chat_options opt = {.add_generation_prompt = v & 1, .thinking = v / 2 - 1,
                            .default_system = (v == 4) ? "" : NULL};
        char *text = NULL;
        size_t len = 0;
        specd_err e = {{0}};
        if (tok_chat_render(T, m, nm, &opt, &text, &len, &e) == 0) {
            if (len && text[len - 1] == '\x7f') e.msg[0] = 0; /* touch the last byte */
            free(text);
        } else if (!e.msg[0]) {
            abort();
        }
        int32_t *ids = NULL;
        uint8_t *mask = NULL;
        size_t n = 0;
        memset(&e, 0, sizeof e);
        if (tok_chat_encode(T, m, nm, &opt, &ids, &n, &mask, &e) == 0) {
            for (size_t i = 0; i < n; i++)
                if (ids[i] < 0 || ids[i] >= tok_vocab_size(T) || mask[i] > 1) abort();
            free(ids);
            free(mask);
        } else if (!e.msg[0]) {
            abort();
        }
    }
    free(buf);
    return 0;
}
