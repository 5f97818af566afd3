/*
 * fuzz_tokenizer.c: libFuzzer harness for the tokenizer's untrusted-input
 * paths (clang, -DSPECD_FUZZ=ON; target fuzz_tokenizer). The SmolLM2
 * tokenizer is loaded once from SPECD_MODEL_GGUF; each input is
 *   - encoded with and without special parsing, then decoded: the bytes must
 *     come back except those the vocabulary has no token for;
 *   - read as little-endian u16 ids (mod vocab) and streamed through
 *     tok_stream, whose output must be well-formed UTF-8;
 *   - used as a chat message's content (render + encode).
 * Run: SPECD_MODEL_GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf \
 *      build-fuzz/tests/tokenizer/fuzz_tokenizer -max_total_time=60 -max_len=2048
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/loader/gguf.h"
#include "engine/tokenizer/tokenizer.h"

static tokenizer *T;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *p = getenv("SPECD_MODEL_GGUF");
    gguf_file *g = NULL;
    specd_err err = {0};
    if (!p || gguf_open(p, &g, &err) < 0 || tok_create_from_gguf(g, &T, &err) < 0) {
        fprintf(stderr, "fuzz_tokenizer: set SPECD_MODEL_GGUF (%s)\n", err.msg);
        abort();
    }
    return 0; /* g stays open for the process */
}

/* Structural UTF-8 check (lead byte + continuation count). */
static int utf8_ok(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        if (c < 0x80) k = 0;
        else if ((c & 0xE0) == 0xC0) k = 1;
        else if ((c & 0xF0) == 0xE0) k = 2;
        else if ((c & 0xF8) == 0xF0) k = 3;
        else return 0;
        if (i + k >= n && k) return 0;
        for (size_t j = 1; j <= k; j++)
            if ((s[i + j] & 0xC0) != 0x80) return 0;
        i += k + 1;
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    specd_err err = {0};
    for (int special = 0; special < 2; special++) {
        int32_t *ids;
        size_t n, dl;
        char *d;
        if (tok_encode(T, (const char *)data, size, special, &ids, &n, &err) < 0) abort();
        if (tok_decode(T, ids, n, false, &d, &dl, &err) < 0) abort();
        /* decoded bytes = input minus the bytes that have no token (specials
         * decode to their own text, so both modes give the same bytes) */
        size_t j = 0;
        for (size_t i = 0; i < size; i++) {
            char c = (char)data[i];
            int32_t id = tok_token_id(T, &c, 1);
            if (id < 0 || tok_is_special(T, id)) continue;
            if (j >= dl || d[j] != c) abort();
            j++;
        }
        if (j != dl) abort();
        free(d);
        free(ids);
    }
    tok_stream *s = tok_stream_create(T, size & 1);
    char *out = NULL;
    size_t ol = 0, oc = 0;
    for (size_t i = 0; i + 1 < size; i += 2) {
        int32_t id = (int32_t)((data[i] | data[i + 1] << 8) % (unsigned)tok_vocab_size(T));
        if (tok_stream_push(s, id, &out, &ol, &oc) < 0) abort();
    }
    if (tok_stream_flush(s, &out, &ol, &oc) < 0 || !utf8_ok((const unsigned char *)out, ol)) abort();
    free(out);
    tok_stream_destroy(s);
    char *content = malloc(size + 1);
    memcpy(content, data, size);
    content[size] = '\0';
    chat_message m[2] = {{.role = "user", .content = content}, {.role = "assistant", .content = content}};
    chat_options opt = {.add_generation_prompt = true, .thinking = -1};
    char *text;
    size_t tl, n;
    int32_t *ids;
    uint8_t *mask;
    if (tok_chat_render(T, m, 2, &opt, &text, &tl, &err) == 0) free(text);
    if (tok_chat_encode(T, m, 2, &opt, &ids, &n, &mask, &err) == 0) {
        free(ids);
        free(mask);
    }
    free(content);
    return 0;
}
