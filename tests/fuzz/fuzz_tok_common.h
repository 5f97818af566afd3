/*
 * fuzz_tok_common.h: what the two tokenizer-loader harnesses (fuzz_tok_hf.c,
 * fuzz_tok_tiktoken.c) share: splitting one fuzz input into the files of a
 * tokenizer directory, writing them into a private scratch folder (the
 * loaders take paths), and the checks every tokenizer that loads must pass.
 *
 * Input layout: PART0 [NUL PART1 [NUL PART2]]. JSON and ranks files cannot
 * hold a raw NUL, so the separator never cuts a meaningful file; an absent
 * part means the file is absent from the folder.
 *
 * Oracle for a tokenizer that loaded (whatever its vocabulary):
 *   - vocab size in (0, 2^24]; bos / eos / stop ids are -1 or inside it;
 *   - for each probe text (fixed strings, then the input's first 512 bytes),
 *     in both modes (specials parsed or not): every id is inside the
 *     vocabulary; decode succeeds; the decoded bytes are the input with some
 *     bytes deleted (a subsequence: a token's bytes always come from one
 *     contiguous piece of the text), and in plain mode no byte that has a
 *     plain single-byte token is deleted (only token-less bytes are dropped);
 *   - those ids stream through tok_stream with well-formed UTF-8 output;
 *   - the chat template, if any, renders / encodes a fixed conversation or
 *     refuses with a message.
 * A refusal must leave a message. Any violation aborts (a finding).
 * Threading: single-threaded (libFuzzer runs inputs one at a time).
 */
#ifndef SPECD_TESTS_FUZZ_TOK_COMMON_H
#define SPECD_TESTS_FUZZ_TOK_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/tokenizer/tokenizer.h"

static char fz_dir[64];

static void fz_cleanup(void) {
    static const char *const names[] = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                        "tiktoken.model"};
    char p[128];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", fz_dir, names[i]);
        unlink(p);
    }
    rmdir(fz_dir);
}

/* The scratch folder (created on first use, removed at exit). */
static const char *fz_scratch(void) {
    if (!fz_dir[0]) {
        snprintf(fz_dir, sizeof fz_dir, "/tmp/specd_fuzz_tok.XXXXXX");
        if (!mkdtemp(fz_dir)) abort();
        atexit(fz_cleanup);
    }
    return fz_dir;
}

/* Writes BYTES to scratch/NAME, or removes it when BYTES is NULL; the path goes to OUT. */
static void fz_put(const char *name, const uint8_t *bytes, size_t n, char *out, size_t cap) {
    snprintf(out, cap, "%s/%s", fz_scratch(), name);
    if (!bytes) {
        unlink(out);
        return;
    }
    FILE *f = fopen(out, "wb");
    if (!f || (n && fwrite(bytes, 1, n, f) != n) || fclose(f) != 0) abort();
}

/* Splits DATA at its first NUL bytes into up to 3 parts; absent parts are NULL. */
static void fz_split(const uint8_t *data, size_t size, const uint8_t *part[3], size_t len[3]) {
    const uint8_t *p = data;
    size_t rest = size;
    for (int k = 0; k < 3; k++) {
        part[k] = p;
        len[k] = 0;
        if (!p) continue;
        const uint8_t *nul = k < 2 && rest ? memchr(p, 0, rest) : NULL;
        len[k] = nul ? (size_t)(nul - p) : rest;
        if (nul) {
            rest -= len[k] + 1;
            p = nul + 1;
        } else {
            p = NULL;
        }
    }
}

static int fz_utf8_ok(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        if (c < 0x80) k = 0;
        else if ((c & 0xE0) == 0xC0) k = 1;
        else if ((c & 0xF0) == 0xE0) k = 2;
        else if ((c & 0xF8) == 0xF0) k = 3;
        else return 0;
        if (k && i + k >= n) return 0;
        for (size_t j = 1; j <= k; j++)
            if ((s[i + j] & 0xC0) != 0x80) return 0;
        i += k + 1;
    }
    return 1;
}

static void fz_check_text(const tokenizer *t, const char *text, size_t len) {
    specd_err err = {{0}};
    int32_t nv = tok_vocab_size(t);
    for (int special = 0; special < 2; special++) {
        int32_t *ids = NULL;
        size_t n = 0, dl = 0;
        char *d = NULL;
        if (tok_encode(t, text, len, special, &ids, &n, &err) < 0) abort(); /* encode takes any bytes */
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= nv) abort();
        if (tok_decode(t, ids, n, false, &d, &dl, &err) < 0) abort();
        /* decoded = text with bytes deleted; in plain mode only token-less bytes */
        size_t j = 0;
        for (size_t i = 0; i < len; i++) {
            if (j < dl && d[j] == text[i]) {
                j++;
                continue;
            }
            if (!special) {
                int32_t id = tok_token_id(t, &text[i], 1);
                if (id >= 0 && !tok_is_special(t, id)) abort();
            }
        }
        if (j != dl) abort();
        tok_stream *s = tok_stream_create(t, special);
        char *out = NULL;
        size_t ol = 0, oc = 0;
        for (size_t i = 0; i < n; i++)
            if (tok_stream_push(s, ids[i], &out, &ol, &oc) < 0) abort();
        if (tok_stream_flush(s, &out, &ol, &oc) < 0 || !fz_utf8_ok((const unsigned char *)out, ol)) abort();
        free(out);
        tok_stream_destroy(s);
        free(d);
        free(ids);
    }
}

/* The checks of the essay on a tokenizer that loaded; destroys it. */
static void fz_check_tokenizer(tokenizer *t, const uint8_t *data, size_t size) {
    int32_t nv = tok_vocab_size(t);
    if (nv <= 0 || nv > (1 << 24)) abort();
    if (tok_bos_id(t) < -1 || tok_bos_id(t) >= nv || tok_eos_id(t) < -1 || tok_eos_id(t) >= nv) abort();
    const int32_t *stops;
    size_t ns = tok_stop_ids(t, &stops);
    for (size_t i = 0; i < ns; i++)
        if (stops[i] < 0 || stops[i] >= nv) abort();
    static const char *const probes[] = {
        "Hello world! 123 4567", "  leading spaces\n\nand\ttabs", "caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80",
        "<|im_start|>user\nhi<|im_end|>", "\xff\xfe bad \xc0\x80 utf8", "it's don't we'll",
    };
    for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++) fz_check_text(t, probes[i], strlen(probes[i]));
    fz_check_text(t, (const char *)data, size < 512 ? size : 512);
    chat_message m[2] = {{.role = "user", .content = "Hi there"}, {.role = "assistant", .content = "Hello!"}};
    chat_options opt = {.add_generation_prompt = true, .thinking = -1};
    specd_err err = {{0}};
    char *text = NULL;
    size_t tl = 0, n = 0;
    int32_t *ids = NULL;
    uint8_t *mask = NULL;
    if (tok_chat_render(t, m, 2, &opt, &text, &tl, &err) == 0) free(text);
    else if (!err.msg[0]) abort();
    err.msg[0] = 0;
    if (tok_chat_encode(t, m, 2, &opt, &ids, &n, &mask, &err) == 0) {
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= nv || mask[i] > 1) abort();
        free(ids);
        free(mask);
    } else if (!err.msg[0]) {
        abort();
    }
    tok_destroy(t);
}

#endif
