/*
 * npy.h: NumPy .npy files (format 1.0 written; 1.0, 2.0 and 3.0 read) for the
 * vocabulary artefacts: token_freq.npy (int64 [target_vocab]), d2t.npy
 * (int64 [draft_vocab]) and t2d.npy (bool [target_vocab]).
 *
 * Format (numpy/lib/format.py, "NPY format"): the 6 magic bytes "\x93NUMPY",
 * u8 major, u8 minor, a little-endian header length (u16 in 1.0, u32 in
 * 2.0/3.0), an ASCII (3.0: UTF-8) Python dict literal with exactly the keys
 * 'descr', 'fortran_order' and 'shape', padded with spaces and ended by '\n'
 * so that the data starts on a 64-byte boundary; then the raw array data.
 *
 * A .npy file is untrusted input: the header length is checked against the
 * file size, the dict literal is parsed by a small bounded parser (no eval),
 * the shape product is overflow-checked, and the data size must equal the
 * bytes after the header exactly (a short file and trailing bytes are both
 * refused). Only little-endian or byte-sized dtypes are accepted ('<i8',
 * '<i4', '<u8', '<f8', '<f4', '|b1', '|u1', '|i1', ...): the consumer then
 * checks that the dtype is the one it expects and says which it got.
 *
 * Ownership: npy_array owns its data (malloc'd); npy_array_free releases it.
 * Threading: pure functions.
 */
#ifndef SPECD_VOCAB_NPY_H
#define SPECD_VOCAB_NPY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/util/err.h"

#define NPY_MAX_DIMS 8

typedef struct npy_array {
    char descr[16];                 /* e.g. "<i8", "|b1" */
    size_t itemsize;                /* bytes per element, from descr */
    bool fortran_order;
    int ndim;                       /* 0..NPY_MAX_DIMS */
    int64_t shape[NPY_MAX_DIMS];
    uint64_t n_elements;
    void *data;                     /* n_elements * itemsize bytes, malloc'd */
    size_t nbytes;
} npy_array;

/* Parses a whole .npy file held in BUF (LEN bytes). The data is copied into
 * out->data. Returns 0, or -1 with err naming what is wrong and where. */
int npy_parse_mem(const void *buf, size_t len, npy_array *out, specd_err *err);
/* Reads and parses PATH (errors are prefixed with the path). */
int npy_read(const char *path, npy_array *out, specd_err *err);
void npy_array_free(npy_array *a); /* NULL ok; leaves a zeroed struct */

/* Reads a 1-D int64 ('<i8', C order) vector: *v malloc'd [*n]. Any other
 * dtype or rank is refused with a message naming what the file holds.
 * WHAT names the artefact in messages ("token frequency vector"). */
int npy_read_i64_vec(const char *path, const char *what, int64_t **v, int64_t *n, specd_err *err);
/* Reads a 1-D bool ('|b1') vector; bytes other than 0/1 are refused. */
int npy_read_bool_vec(const char *path, const char *what, uint8_t **v, int64_t *n, specd_err *err);

/* Writes a 1-D vector as format 1.0, C order: DESCR "<i8" (int64) or "|b1"
 * (bool, one byte 0/1 per element). Written to PATH.tmp and renamed. */
int npy_write_vec(const char *path, const char *descr, const void *data, int64_t n, specd_err *err);

#endif
