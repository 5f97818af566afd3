/*
 * tok_fixture.h: shared helpers of the tokenizer tests: skip-if-no-model,
 * loading the SmolLM2 tokenizer from the real GGUF, reading the JSON fixtures
 * written by tools/gen_tokenizer_fixtures.py (HF tokenizers / jinja2 output).
 * Header-only (static functions); each test program includes it once.
 */
#ifndef SPECD_TESTS_TOK_FIXTURE_H
#define SPECD_TESTS_TOK_FIXTURE_H

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/loader/gguf.h"
#include "engine/tokenizer/tokenizer.h"

static inline const char *fx_env(const char *name) {
    const char *v = getenv(name);
    return v && v[0] ? v : NULL;
}

/* Exits 77 (skip) if the model is absent. */
static inline void fx_require_model(void) {
    const char *p = fx_env("SPECD_MODEL_GGUF");
    FILE *f = p ? fopen(p, "rb") : NULL;
    if (!f) {
        printf("SKIP: SPECD_MODEL_GGUF (%s) not readable; run tools/setup.sh\n", p ? p : "unset");
        exit(77);
    }
    fclose(f);
}

static inline json_t *fx_load_json(const char *name) {
    char path[4096];
    const char *src = fx_env("SPECD_SOURCE_DIR");
    snprintf(path, sizeof path, "%s/tests/fixtures/tokenizer/%s", src ? src : ".", name);
    json_error_t je;
    json_t *j = json_load_file(path, JSON_ALLOW_NUL, &je);
    if (!j) {
        fprintf(stderr, "cannot load fixture %s: %s (line %d)\n", path, je.text, je.line);
        exit(1);
    }
    return j;
}

/* Hex string -> malloc'd bytes (NUL-terminated for convenience). */
static inline char *fx_unhex(const char *hex, size_t *len) {
    size_t n = strlen(hex) / 2;
    char *b = malloc(n + 1);
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        sscanf(hex + 2 * i, "%2x", &v);
        b[i] = (char)v;
    }
    b[n] = '\0';
    *len = n;
    return b;
}

/* JSON int array -> malloc'd int32 array. */
static inline int32_t *fx_ids(const json_t *arr, size_t *n) {
    *n = json_array_size(arr);
    int32_t *v = malloc((*n ? *n : 1) * sizeof *v);
    for (size_t i = 0; i < *n; i++) v[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    return v;
}

static inline int fx_ids_equal(const int32_t *a, size_t na, const int32_t *b, size_t nb, const char *what, size_t idx) {
    if (na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0)) return 1;
    fprintf(stderr, "%s #%zu: ids differ (got %zu, want %zu)\n  got: ", what, idx, na, nb);
    for (size_t i = 0; i < na && i < 40; i++) fprintf(stderr, "%d ", a[i]);
    fprintf(stderr, "\n want: ");
    for (size_t i = 0; i < nb && i < 40; i++) fprintf(stderr, "%d ", b[i]);
    fprintf(stderr, "\n");
    return 0;
}

static gguf_file *fx_gguf;

static inline tokenizer *fx_smollm2(void) {
    specd_err err = {0};
    if (!fx_gguf && gguf_open(fx_env("SPECD_MODEL_GGUF"), &fx_gguf, &err) < 0) {
        fprintf(stderr, "gguf_open: %s\n", err.msg);
        exit(1);
    }
    tokenizer *t = NULL;
    if (tok_create_from_gguf(fx_gguf, &t, &err) < 0) {
        fprintf(stderr, "tok_create_from_gguf: %s\n", err.msg);
        exit(1);
    }
    return t;
}

#endif
