/*
 * loader_test_util.h: helpers shared by the loader tests: a growable byte
 * buffer for building GGUF / safetensors files byte by byte, and fixture
 * file reading from $SPECD_SOURCE_DIR/tests/fixtures/loader.
 * Header-only (static functions); tests are single-threaded.
 */
#ifndef SPECD_TESTS_LOADER_UTIL_H
#define SPECD_TESTS_LOADER_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct tbuf {
    uint8_t *p;
    size_t n, cap;
} tbuf;

static inline void tb_bytes(tbuf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n) cap *= 2;
        b->p = realloc(b->p, cap);
        if (!b->p) abort();
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}
static inline void tb_u8(tbuf *b, uint8_t v) { tb_bytes(b, &v, 1); }
static inline void tb_u32(tbuf *b, uint32_t v) { tb_bytes(b, &v, 4); }
static inline void tb_u64(tbuf *b, uint64_t v) { tb_bytes(b, &v, 8); }
static inline void tb_zeros(tbuf *b, size_t n) {
    for (size_t i = 0; i < n; i++) tb_u8(b, 0);
}
static inline void tb_free(tbuf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

/* Fixture path: $SPECD_SOURCE_DIR/tests/fixtures/loader/NAME (falls back to
 * the source path baked in at compile time via SPECD_TEST_SRC_DIR). */
static inline void fixture_path(char *out, size_t cap, const char *name) {
    const char *root = getenv("SPECD_SOURCE_DIR");
#ifdef SPECD_TEST_SRC_DIR
    if (!root) root = SPECD_TEST_SRC_DIR;
#endif
    if (!root) root = ".";
    snprintf(out, cap, "%s/tests/fixtures/loader/%s", root, name);
}

/* Reads a whole fixture file; returns malloc'd bytes with a NUL appended
 * (not counted in *len), NULL if missing. */
static inline void *fixture_read(const char *name, size_t *len) {
    char path[4096];
    fixture_path(path, sizeof path, name);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc(n > 0 ? (size_t)n + 1 : 1);
    if (p && n > 0 && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) p[n > 0 ? n : 0] = '\0';
    if (len) *len = (size_t)(n > 0 ? n : 0);
    return p;
}

#endif
