/*
 * fuzz_safetensors.c: libFuzzer harness for st_open_mem (see
 * tests/fuzz/CMakeLists.txt). A parsed file must be internally consistent:
 * every tensor's bytes lie in the input, lookups by name return the same
 * tensor, and float tensors convert to f32. Any crash or sanitizer report is
 * a bug in the reader.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/loader/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    st_model *m = NULL;
    specd_err err = {{0}};
    if (st_open_mem(data, size, &m, &err) != 0) {
        if (m != NULL || err.msg[0] == '\0') abort();
        return 0;
    }
    volatile uint64_t sink = 0;
    for (size_t i = 0; i < st_n_tensors(m); i++) {
        const st_tensor *t = st_tensor_at(m, i);
        if (st_find(m, t->name) != t) abort();
        const uint8_t *p = t->data;
        if (p < data || p + t->nbytes > data + size) abort();
        if (t->nbytes) sink += p[0] + p[t->nbytes - 1];
        if (t->n_elements <= 65536) {
            float *dst = malloc((size_t)t->n_elements * sizeof *dst + 1);
            if (!dst) break;
            int rc = st_read_f32(t, dst, &err);
            int is_float = t->dtype == ST_F32 || t->dtype == ST_F16 || t->dtype == ST_BF16 || t->dtype == ST_F64;
            if ((rc == 0) != is_float) abort();
            free(dst);
        }
    }
    sink += st_metadata(m, "format") != NULL;
    (void)sink;
    st_close(m);
    return 0;
}
