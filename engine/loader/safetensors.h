/*
 * safetensors.h: read-only safetensors reader (single file or a sharded
 * directory with model.safetensors.index.json), over memory mappings, plus a
 * writer.
 *
 * Owns: the mappings of all shards and the parsed tensor table. Everything
 * returned points into the st_model and lives until st_close().
 * Invariants after a successful open: the 8-byte header length and the JSON
 * header are bounds-checked (header <= 100 MiB, valid UTF-8 JSON object);
 * every tensor's dtype is known, its shape product times the element size
 * equals its byte range exactly (overflow-checked), the ranges tile the
 * file's data section exactly (no overlap, no hole, as the reference
 * implementation requires); names are unique across shards; for
 * a sharded model every tensor listed in the index's weight_map is present in
 * the named shard. A model file is untrusted input.
 * Threading: immutable after open; safe to read from any thread.
 * Format: https://github.com/huggingface/safetensors (README "Format").
 */
#ifndef SPECD_LOADER_SAFETENSORS_H
#define SPECD_LOADER_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "engine/util/err.h"

typedef enum {
    ST_BOOL, ST_U8, ST_I8, ST_I16, ST_U16, ST_I32, ST_U32, ST_I64, ST_U64,
    ST_F16, ST_BF16, ST_F32, ST_F64,
} st_dtype;

#define ST_MAX_DIMS 8

typedef struct st_tensor {
    const char *name;            /* NUL-terminated */
    st_dtype dtype;
    int n_dims;                  /* 0..ST_MAX_DIMS (0 = scalar) */
    int64_t shape[ST_MAX_DIMS];  /* outermost first (row-major, as PyTorch) */
    uint64_t n_elements;
    uint64_t nbytes;
    const void *data;            /* inside the mapping; may be unaligned */
    int shard;                   /* index of the file it lives in */
} st_tensor;

typedef struct st_model st_model;

/* PATH is a .safetensors file, or a directory holding either
 * model.safetensors.index.json (+ shards) or exactly one *.safetensors file. */
int st_open(const char *path, st_model **out, specd_err *err);
/* st_open with FLAGS (0 = st_open). ST_OPEN_POISON is a test aid for st_load.h's rank plans: each
 * shard is an anonymous copy holding only its header, every data byte 0xA5 until st_prefetch writes a
 * planned range into it, so that a model built on it differs from one built on the plain mapping
 * wherever it uses a byte its plan did not read (the shards' memory: their whole size, anonymous). */
#define ST_OPEN_POISON 1u
int st_open_ex(const char *path, unsigned flags, st_model **out, specd_err *err);
/* One in-memory file (not copied). For tests and fuzzing. */
int st_open_mem(const void *buf, size_t len, st_model **out, specd_err *err);
void st_close(st_model *m); /* NULL ok */

size_t st_n_tensors(const st_model *m);
const st_tensor *st_tensor_at(const st_model *m, size_t i);
const st_tensor *st_find(const st_model *m, const char *name); /* NULL if absent */
/* "__metadata__" string value for KEY, NULL if absent. */
const char *st_metadata(const st_model *m, const char *key);

/* The files behind an st_model (st_load.h reads them): shard s's path as opened (NULL for st_open_mem),
 * its file name (for messages), its size in bytes, and where a tensor's data starts in its file. */
unsigned st_open_flags(const st_model *m);
int st_n_shards(const st_model *m);
const char *st_shard_path(const st_model *m, int s);
const char *st_shard_name(const st_model *m, int s);
uint64_t st_shard_size(const st_model *m, int s);
uint64_t st_tensor_file_offset(const st_model *m, const st_tensor *t);
/* ST_OPEN_POISON: shard s's writable anonymous copy (st_prefetch fills it); NULL for a mapped file. */
uint8_t *st_shard_poisoned(const st_model *m, int s);

const char *st_dtype_name(st_dtype t);
size_t st_dtype_size(st_dtype t); /* bytes per element; BOOL = 1 */

/* Reads the tensor as f32 into DST (n_elements floats) from F32/F16/BF16/F64.
 * Returns -1 with err for other dtypes. */
int st_read_f32(const st_tensor *t, float *dst, specd_err *err);

/* Writer: one file, tensors in the given order, optional __metadata__
 * (NULL-terminated key/value pairs, may be NULL). As the Python package does,
 * the JSON header is padded with spaces so the data section starts 8-byte
 * aligned; tensors follow back to back (the format forbids holes, so a
 * tensor's offset is aligned only if the sizes before it keep it so).
 * Written to a temporary file and renamed into place. */
typedef struct st_write_tensor {
    const char *name;
    st_dtype dtype;
    int n_dims;
    const int64_t *shape;
    const void *data;            /* n_elements * st_dtype_size bytes */
} st_write_tensor;
int st_write(const char *path, const st_write_tensor *tensors, size_t n,
             const char *const *metadata_kv, specd_err *err);

#endif
