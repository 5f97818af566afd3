/*
 * gguf.h: read-only GGUF v3 reader over a memory mapping.
 *
 * Owns: the mapping of one .gguf file (or a caller's buffer), the parsed
 * metadata key/values and tensor infos. Everything returned points into the
 * gguf_file and lives until gguf_close().
 * Invariants after a successful open: every count, string length, array
 * length, tensor dim, tensor offset and byte size has been bounds-checked
 * against the file size with overflow-safe arithmetic; tensor names and keys
 * are unique; every tensor's data lies inside the data section; ggml types are
 * ones this reader knows. A model file is untrusted input.
 * Threading: immutable after open; safe to read from any thread.
 * Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
 */
#ifndef SPECD_LOADER_GGUF_H
#define SPECD_LOADER_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/util/err.h"

/* Metadata value types (GGUF spec numbering). */
typedef enum {
    GGUF_VT_UINT8 = 0, GGUF_VT_INT8 = 1, GGUF_VT_UINT16 = 2, GGUF_VT_INT16 = 3,
    GGUF_VT_UINT32 = 4, GGUF_VT_INT32 = 5, GGUF_VT_FLOAT32 = 6, GGUF_VT_BOOL = 7,
    GGUF_VT_STRING = 8, GGUF_VT_ARRAY = 9, GGUF_VT_UINT64 = 10, GGUF_VT_INT64 = 11,
    GGUF_VT_FLOAT64 = 12,
} gguf_vtype;

/* Tensor element types (ggml numbering). Only these are accepted. */
typedef enum {
    GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_Q4_0 = 2, GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q8_0 = 8, GGML_TYPE_Q4_K = 12, GGML_TYPE_Q6_K = 14, GGML_TYPE_BF16 = 30,
} ggml_type;

#define GGUF_MAX_DIMS 4

typedef struct gguf_kv {
    const char *key;        /* NUL-terminated copy */
    gguf_vtype type;
    /* Scalars (type != STRING/ARRAY), widened: */
    uint64_t u64;           /* unsigned ints and bool */
    int64_t i64;            /* signed ints (also set for unsigned that fit) */
    double f64;             /* floats (also set for ints) */
    /* STRING: bytes (not NUL-terminated; may contain NUL) */
    const char *str;
    uint64_t str_len;
    /* ARRAY: element type and count; elements via gguf_arr_* below */
    gguf_vtype arr_type;
    uint64_t arr_len;
} gguf_kv;

typedef struct gguf_tensor {
    const char *name;            /* NUL-terminated copy */
    uint32_t n_dims;             /* 1..GGUF_MAX_DIMS */
    uint64_t ne[GGUF_MAX_DIMS];  /* elements per dim, innermost first; unused dims = 1 */
    ggml_type type;
    uint64_t n_elements;
    uint64_t nbytes;             /* n_elements / block_elems * block_bytes */
    const void *data;            /* inside the mapping, nbytes readable */
} gguf_tensor;

typedef struct gguf_file gguf_file;

/* Maps and parses PATH. On error returns -1, *out = NULL and err says what is
 * wrong and where (byte offset). */
int gguf_open(const char *path, gguf_file **out, specd_err *err);
/* Parses a caller-owned buffer (not copied; must outlive the gguf_file).
 * Used by tests and the fuzz harness. */
int gguf_open_mem(const void *buf, size_t len, gguf_file **out, specd_err *err);
void gguf_close(gguf_file *f); /* NULL ok */

uint32_t gguf_version(const gguf_file *f);
/* general.alignment (default 32) and the file byte offset of the aligned data
 * section; tensor data = data section + the tensor's (aligned) offset. */
uint32_t gguf_alignment(const gguf_file *f);
uint64_t gguf_data_offset(const gguf_file *f);
size_t gguf_n_kv(const gguf_file *f);
const gguf_kv *gguf_kv_at(const gguf_file *f, size_t i);
const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key); /* NULL if absent */

/* Typed getters: return 0 and set *out, or -1 (absent or wrong type) with err
 * set. Integer getters accept any integer type whose value fits. */
int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out, specd_err *err);
int gguf_get_f64(const gguf_file *f, const char *key, double *out, specd_err *err);
int gguf_get_bool(const gguf_file *f, const char *key, bool *out, specd_err *err);
int gguf_get_str(const gguf_file *f, const char *key, const char **s, size_t *len, specd_err *err);

/* Array element access, bounds-checked (i < kv->arr_len, type matches). */
int gguf_arr_str(const gguf_kv *kv, uint64_t i, const char **s, size_t *len);
int gguf_arr_i64(const gguf_kv *kv, uint64_t i, int64_t *out); /* any int array */
int gguf_arr_f64(const gguf_kv *kv, uint64_t i, double *out);  /* float or int array */

size_t gguf_n_tensors(const gguf_file *f);
const gguf_tensor *gguf_tensor_at(const gguf_file *f, size_t i);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name); /* NULL if absent */

/* ggml block geometry: elements per block and bytes per block (F32: 1, 4). */
int ggml_type_block(ggml_type t, uint32_t *block_elems, uint32_t *block_bytes);
const char *ggml_type_name(ggml_type t);

/* Dequantizes N elements (a multiple of the block size) of type T at SRC to
 * f32 DST. Math: ggml-quants.c reference dequantize_row_* functions.
 * Returns -1 for an unsupported type or a length not a multiple of the block. */
int ggml_dequantize(ggml_type t, const void *src, float *dst, uint64_t n);

/* fp16 / bf16 scalar conversions (IEEE half; bf16 = top 16 bits of f32). */
float specd_fp16_to_f32(uint16_t h);
uint16_t specd_f32_to_fp16(float f);
float specd_bf16_to_f32(uint16_t h);
uint16_t specd_f32_to_bf16(float f); /* round to nearest even */

#endif
