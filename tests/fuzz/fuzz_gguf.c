/*
 * fuzz_gguf.c: libFuzzer harness for gguf_open_mem (see tests/fuzz/CMakeLists.txt).
 * A parsed file must be internally consistent: every tensor's bytes lie in
 * the input, every array element is reachable through the accessors, and
 * the first row of every tensor dequantizes. Any crash or sanitizer report
 * is a bug in the reader.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/loader/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    gguf_file *f = NULL;
    specd_err err = {{0}};
    if (gguf_open_mem(data, size, &f, &err) != 0) {
        if (f != NULL || err.msg[0] == '\0') abort();
        return 0;
    }
    volatile uint64_t sink = 0;
    for (size_t i = 0; i < gguf_n_kv(f); i++) {
        const gguf_kv *kv = gguf_kv_at(f, i);
        if (gguf_find_kv(f, kv->key) != kv) abort();
        if (kv->type == GGUF_VT_STRING && kv->str_len) sink += (uint8_t)kv->str[kv->str_len - 1];
        if (kv->type != GGUF_VT_ARRAY || kv->arr_len == 0) continue;
        uint64_t last = kv->arr_len - 1;
        const char *s;
        size_t len;
        int64_t iv;
        double dv;
        if (gguf_arr_str(kv, last, &s, &len) == 0 && len) sink += (uint8_t)s[len - 1];
        if (gguf_arr_i64(kv, last, &iv) == 0) sink += (uint64_t)iv;
        if (gguf_arr_f64(kv, 0, &dv) == 0) sink += (uint64_t)(dv == dv);
    }
    float *row = NULL;
    for (size_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        if (gguf_find_tensor(f, t->name) != t) abort();
        const uint8_t *p = t->data;
        if (p < data || p + t->nbytes > data + size) abort();
        sink += p[0] + p[t->nbytes - 1];
        if (t->ne[0] <= 4096) {
            float *r = realloc(row, (size_t)t->ne[0] * sizeof *r);
            if (!r) break;
            row = r;
            if (ggml_dequantize(t->type, t->data, row, t->ne[0]) != 0) abort();
        }
    }
    (void)sink;
    free(row);
    gguf_close(f);
    return 0;
}
