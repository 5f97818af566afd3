/*
 * gguf.c: the GGUF v2/v3 parser behind gguf.h.
 *
 * Owns: the read-only mapping of one file (or a borrowed caller buffer), one
 * heap array of parsed key/values, one of tensor infos, the copied key and
 * tensor-name strings, per string-array offset tables, and two sorted index
 * arrays used for duplicate detection and O(log n) lookup by name.
 *
 * Parsing model: a cursor (pos) walks the buffer; every read goes through
 * rd_need(), which checks `len - pos >= n` (never `pos + n <= len`, which can
 * wrap). Counts read from the file are checked against the bytes that remain
 * before anything is allocated for them: each KV pair needs at least
 * KV_MIN_BYTES and each tensor info TI_MIN_BYTES, so a count larger than
 * remaining/min is refused as "count exceeds file size" without allocating.
 * Multiplications of file-controlled numbers use __builtin_mul_overflow.
 * Error messages say what is wrong and at which byte offset (or which tensor).
 *
 * Invariants after gguf_open* returns 0: see gguf.h. In addition every
 * STRING array kv has an offset table so gguf_arr_str() is O(1), and every
 * numeric array's bytes lie inside the buffer.
 *
 * Threading: the gguf_file is immutable after open; any thread may read it.
 * Assumes a little-endian host (x86-64, aarch64); big-endian files are refused.
 * Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
 */
#include "engine/loader/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32u
/* Smallest possible encodings, used to bound counts by the remaining bytes. */
#define KV_MIN_BYTES 13u  /* u64 key length + u32 type + 1-byte value      */
#define TI_MIN_BYTES 32u  /* u64 name length + u32 n_dims + 1 dim + u32 type + u64 offset */
/* Largest alignment we accept; real files use 32. Keeps align-up arithmetic
 * far from overflow. */
#define GGUF_MAX_ALIGNMENT (1u << 30)

/* Internal kv: the public struct first so a gguf_kv* can be mapped back. */
typedef struct kv_int {
    gguf_kv pub;
    const uint8_t *arr_data; /* first element (numeric arrays) */
    uint64_t *str_offs;      /* STRING arrays: arr_len offsets of the u64 length prefixes, from arr_data */
} kv_int;

struct gguf_file {
    const uint8_t *buf;
    size_t len;
    int mapped;              /* 1: buf is our mmap, munmap at close */
    uint32_t version;
    uint32_t alignment;
    uint64_t data_start;     /* byte offset of the aligned data section */
    kv_int *kvs;
    size_t n_kv;
    gguf_tensor *tensors;
    size_t n_tensors;
    size_t *kv_sorted;       /* kv indices sorted by key */
    size_t *t_sorted;        /* tensor indices sorted by name */
};

/* ---------------------------------------------------------------- reading */

typedef struct rd {
    const uint8_t *buf;
    size_t len;
    size_t pos;
    specd_err *err;
} rd;

static int rd_need(rd *r, uint64_t n, const char *what) {
    if (r->pos > r->len || n > (uint64_t)(r->len - r->pos))
        return specd_err_set(r->err, "gguf: truncated file: %s needs %" PRIu64
                             " bytes at byte offset %zu but the file has %zu",
                             what, n, r->pos, r->len);
    return 0;
}

static int rd_u32(rd *r, uint32_t *v, const char *what) {
    if (rd_need(r, 4, what)) return -1;
    memcpy(v, r->buf + r->pos, 4);
    r->pos += 4;
    return 0;
}

static int rd_u64(rd *r, uint64_t *v, const char *what) {
    if (rd_need(r, 8, what)) return -1;
    memcpy(v, r->buf + r->pos, 8);
    r->pos += 8;
    return 0;
}

/* A GGUF string: u64 length + bytes (no terminator). Points into the buffer. */
static int rd_str(rd *r, const char **s, uint64_t *n, const char *what) {
    size_t at = r->pos;
    if (rd_u64(r, n, what)) return -1;
    if (*n > (uint64_t)(r->len - r->pos))
        return specd_err_set(r->err, "gguf: %s length %" PRIu64 " at byte offset %zu exceeds the %zu bytes left in the file",
                             what, *n, at, r->len - r->pos);
    *s = (const char *)(r->buf + r->pos);
    r->pos += (size_t)*n;
    return 0;
}

/* Copies a name/key into a NUL-terminated heap string; refuses empty names
 * and embedded NULs (they would make two distinct names compare equal). */
static char *dup_name(rd *r, const char *s, uint64_t n, size_t at, const char *what) {
    if (n == 0) {
        specd_err_set(r->err, "gguf: empty %s at byte offset %zu", what, at);
        return NULL;
    }
    if (memchr(s, '\0', (size_t)n)) {
        specd_err_set(r->err, "gguf: %s at byte offset %zu contains a NUL byte", what, at);
        return NULL;
    }
    char *c = malloc((size_t)n + 1);
    if (!c) {
        specd_err_set(r->err, "gguf: out of memory for a %s of %" PRIu64 " bytes", what, n);
        return NULL;
    }
    memcpy(c, s, (size_t)n);
    c[n] = '\0';
    return c;
}

static size_t vtype_size(uint32_t t) {
    switch (t) {
    case GGUF_VT_UINT8: case GGUF_VT_INT8: case GGUF_VT_BOOL: return 1;
    case GGUF_VT_UINT16: case GGUF_VT_INT16: return 2;
    case GGUF_VT_UINT32: case GGUF_VT_INT32: case GGUF_VT_FLOAT32: return 4;
    case GGUF_VT_UINT64: case GGUF_VT_INT64: case GGUF_VT_FLOAT64: return 8;
    default: return 0; /* STRING, ARRAY, unknown */
    }
}

static const char *vtype_name(uint32_t t) {
    static const char *names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                  "bool", "string", "array", "uint64", "int64", "float64"};
    return t <= GGUF_VT_FLOAT64 ? names[t] : "unknown";
}

static int vtype_is_int(uint32_t t) {
    return t == GGUF_VT_UINT8 || t == GGUF_VT_INT8 || t == GGUF_VT_UINT16 || t == GGUF_VT_INT16 ||
           t == GGUF_VT_UINT32 || t == GGUF_VT_INT32 || t == GGUF_VT_UINT64 || t == GGUF_VT_INT64;
}

/* Widens one scalar at P of type T into the u64/i64/f64 fields (i64 = 0 for
 * a uint64 above INT64_MAX; callers check u64 for that case). */
static void scalar_widen(uint32_t t, const uint8_t *p, gguf_kv *kv) {
    kv->u64 = 0; kv->i64 = 0; kv->f64 = 0;
    switch (t) {
    case GGUF_VT_UINT8: case GGUF_VT_BOOL: { uint8_t v = p[0]; kv->u64 = v; kv->i64 = v; kv->f64 = v; break; }
    case GGUF_VT_INT8: { int8_t v; memcpy(&v, p, 1); kv->i64 = v; kv->f64 = v; break; }
    case GGUF_VT_UINT16: { uint16_t v; memcpy(&v, p, 2); kv->u64 = v; kv->i64 = v; kv->f64 = v; break; }
    case GGUF_VT_INT16: { int16_t v; memcpy(&v, p, 2); kv->i64 = v; kv->f64 = v; break; }
    case GGUF_VT_UINT32: { uint32_t v; memcpy(&v, p, 4); kv->u64 = v; kv->i64 = v; kv->f64 = v; break; }
    case GGUF_VT_INT32: { int32_t v; memcpy(&v, p, 4); kv->i64 = v; kv->f64 = v; break; }
    case GGUF_VT_UINT64: {
        uint64_t v; memcpy(&v, p, 8);
        kv->u64 = v; kv->i64 = v <= (uint64_t)INT64_MAX ? (int64_t)v : 0; kv->f64 = (double)v; break;
    }
    case GGUF_VT_INT64: { int64_t v; memcpy(&v, p, 8); kv->i64 = v; kv->f64 = (double)v; break; }
    case GGUF_VT_FLOAT32: { float v; memcpy(&v, p, 4); kv->f64 = v; break; }
    case GGUF_VT_FLOAT64: { double v; memcpy(&v, p, 8); kv->f64 = v; break; }
    default: break;
    }
}

/* Parses the value of KV (its type already read). Arrays: one level only;
 * an array of arrays is refused (no GGUF producer writes one and llama.cpp
 * does not read them). */
static int parse_value(rd *r, kv_int *kv) {
    gguf_kv *p = &kv->pub;
    size_t at = r->pos;
    if (p->type == GGUF_VT_STRING) {
        return rd_str(r, &p->str, &p->str_len, "string value");
    }
    if (p->type == GGUF_VT_ARRAY) {
        uint32_t et;
        if (rd_u32(r, &et, "array element type")) return -1;
        if (rd_u64(r, &p->arr_len, "array length")) return -1;
        if (et == GGUF_VT_ARRAY)
            return specd_err_set(r->err, "gguf: key '%s': nested array at byte offset %zu is not supported", p->key, at);
        if (et > GGUF_VT_FLOAT64)
            return specd_err_set(r->err, "gguf: key '%s': unknown array element type %u at byte offset %zu", p->key, et, at);
        p->arr_type = (gguf_vtype)et;
        size_t left = r->len - r->pos;
        kv->arr_data = r->buf + r->pos;
        if (et == GGUF_VT_STRING) {
            /* each element needs at least its 8-byte length */
            if (p->arr_len > left / 8)
                return specd_err_set(r->err, "gguf: key '%s': string array length %" PRIu64
                                     " at byte offset %zu exceeds the file size", p->key, p->arr_len, at);
            kv->str_offs = malloc((size_t)(p->arr_len ? p->arr_len : 1) * sizeof *kv->str_offs);
            if (!kv->str_offs)
                return specd_err_set(r->err, "gguf: key '%s': out of memory for %" PRIu64 " strings", p->key, p->arr_len);
            size_t base = r->pos;
            for (uint64_t i = 0; i < p->arr_len; i++) {
                const char *s;
                uint64_t n;
                kv->str_offs[i] = r->pos - base;
                if (rd_str(r, &s, &n, "string array element"))
                    return specd_err_wrap(r->err, "key '%s' element %" PRIu64, p->key, i);
            }
            return 0;
        }
        size_t es = vtype_size(et);
        if (p->arr_len > left / es)
            return specd_err_set(r->err, "gguf: key '%s': array of %" PRIu64 " %s at byte offset %zu exceeds the file size",
                                 p->key, p->arr_len, vtype_name(et), at);
        if (et == GGUF_VT_BOOL) {
            for (uint64_t i = 0; i < p->arr_len; i++)
                if (r->buf[r->pos + i] > 1)
                    return specd_err_set(r->err, "gguf: key '%s': bool array element %" PRIu64 " is %u (not 0/1)",
                                         p->key, i, r->buf[r->pos + i]);
        }
        r->pos += (size_t)(p->arr_len * es);
        return 0;
    }
    size_t es = vtype_size(p->type);
    if (es == 0)
        return specd_err_set(r->err, "gguf: key '%s': unknown value type %u at byte offset %zu", p->key, p->type, at - 4);
    if (rd_need(r, es, "scalar value")) return -1;
    if (p->type == GGUF_VT_BOOL && r->buf[r->pos] > 1)
        return specd_err_set(r->err, "gguf: key '%s': bool value %u at byte offset %zu is not 0/1", p->key, r->buf[r->pos], at);
    scalar_widen(p->type, r->buf + r->pos, p);
    r->pos += es;
    return 0;
}

/* ---------------------------------------------------------------- sorting */

/* qsort has no context argument; these sorts run on one thread at a time
 * per call (the pointer is set just before, read only inside qsort). A
 * thread-local keeps concurrent opens on different threads safe. */
static _Thread_local const gguf_file *sort_ctx;

static int cmp_kv(const void *a, const void *b) {
    return strcmp(sort_ctx->kvs[*(const size_t *)a].pub.key, sort_ctx->kvs[*(const size_t *)b].pub.key);
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(sort_ctx->tensors[*(const size_t *)a].name, sort_ctx->tensors[*(const size_t *)b].name);
}

static int cmp_tensor_data(const void *a, const void *b) {
    const uint8_t *x = sort_ctx->tensors[*(const size_t *)a].data, *y = sort_ctx->tensors[*(const size_t *)b].data;
    return x < y ? -1 : x > y;
}

/* ---------------------------------------------------------------- parsing */

static int parse_header_and_kvs(gguf_file *f, rd *r, uint64_t *n_tensors_out) {
    if (r->len < 4 || memcmp(r->buf, GGUF_MAGIC, 4) != 0)
        return specd_err_set(r->err, "gguf: bad magic at byte offset 0 (not a GGUF file)");
    r->pos = 4;
    if (rd_u32(r, &f->version, "version")) return -1;
    if (f->version == 1)
        return specd_err_set(r->err, "gguf: version 1 at byte offset 4 is not supported (v2 and v3 are)");
    if (f->version != 2 && f->version != 3) {
        if ((f->version & 0xffffu) == 0 && (f->version >> 16) != 0)
            return specd_err_set(r->err, "gguf: version field 0x%08x at byte offset 4 looks big-endian; only little-endian files are supported",
                                 f->version);
        return specd_err_set(r->err, "gguf: unsupported version %u at byte offset 4", f->version);
    }
    uint64_t n_tensors, n_kv;
    if (rd_u64(r, &n_tensors, "tensor_count")) return -1;
    if (rd_u64(r, &n_kv, "kv_count")) return -1;
    size_t left = r->len - r->pos;
    if (n_kv > left / KV_MIN_BYTES)
        return specd_err_set(r->err, "gguf: kv_count %" PRIu64 " at byte offset 16 exceeds what the %zu-byte file can hold",
                             n_kv, r->len);
    left -= (size_t)n_kv * KV_MIN_BYTES;
    if (n_tensors > left / TI_MIN_BYTES)
        return specd_err_set(r->err, "gguf: tensor_count %" PRIu64 " at byte offset 8 exceeds what the %zu-byte file can hold",
                             n_tensors, r->len);
    f->kvs = calloc((size_t)(n_kv ? n_kv : 1), sizeof *f->kvs);
    f->tensors = calloc((size_t)(n_tensors ? n_tensors : 1), sizeof *f->tensors);
    f->kv_sorted = malloc((size_t)(n_kv ? n_kv : 1) * sizeof *f->kv_sorted);
    f->t_sorted = malloc((size_t)(n_tensors ? n_tensors : 1) * sizeof *f->t_sorted);
    if (!f->kvs || !f->tensors || !f->kv_sorted || !f->t_sorted)
        return specd_err_set(r->err, "gguf: out of memory for %" PRIu64 " kvs / %" PRIu64 " tensors", n_kv, n_tensors);

    for (uint64_t i = 0; i < n_kv; i++) {
        kv_int *kv = &f->kvs[i];
        size_t at = r->pos;
        const char *k;
        uint64_t kn;
        if (rd_str(r, &k, &kn, "key")) return specd_err_wrap(r->err, "kv %" PRIu64, i);
        char *key = dup_name(r, k, kn, at, "key");
        if (!key) return -1;
        kv->pub.key = key;
        f->n_kv = (size_t)i + 1; /* owns key now, freed at close */
        uint32_t t;
        if (rd_u32(r, &t, "value type")) return specd_err_wrap(r->err, "key '%s'", key);
        if (t > GGUF_VT_FLOAT64)
            return specd_err_set(r->err, "gguf: key '%s': unknown value type %u at byte offset %zu", key, t, r->pos - 4);
        kv->pub.type = (gguf_vtype)t;
        if (parse_value(r, kv)) return -1;
    }
    for (size_t i = 0; i < f->n_kv; i++) f->kv_sorted[i] = i;
    sort_ctx = f;
    qsort(f->kv_sorted, f->n_kv, sizeof *f->kv_sorted, cmp_kv);
    for (size_t i = 1; i < f->n_kv; i++)
        if (strcmp(f->kvs[f->kv_sorted[i - 1]].pub.key, f->kvs[f->kv_sorted[i]].pub.key) == 0)
            return specd_err_set(r->err, "gguf: duplicate key '%s'", f->kvs[f->kv_sorted[i]].pub.key);

    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const gguf_kv *al = gguf_find_kv(f, "general.alignment");
    if (al) {
        if (!vtype_is_int(al->type))
            return specd_err_set(r->err, "gguf: general.alignment has type %s, expected an integer", vtype_name(al->type));
        if (al->i64 <= 0 || al->i64 > GGUF_MAX_ALIGNMENT || (al->i64 & (al->i64 - 1)) != 0)
            return specd_err_set(r->err, "gguf: general.alignment %" PRId64 " is not a power of two in 1..%u",
                                 al->i64, GGUF_MAX_ALIGNMENT);
        f->alignment = (uint32_t)al->i64;
    }
    *n_tensors_out = n_tensors;
    return 0;
}

/* Reads N_TENSORS tensor infos, then places the data section and checks every
 * tensor's bytes against it. OFFS: caller scratch, N_TENSORS entries. */
static int parse_tensor_infos(gguf_file *f, rd *r, uint64_t n_tensors, uint64_t *offs) {
    for (uint64_t i = 0; i < n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        size_t at = r->pos;
        const char *s;
        uint64_t sn;
        if (rd_str(r, &s, &sn, "tensor name")) return specd_err_wrap(r->err, "tensor info %" PRIu64, i);
        char *name = dup_name(r, s, sn, at, "tensor name");
        if (!name) return -1;
        t->name = name;
        f->n_tensors = (size_t)i + 1;
        size_t dims_at = r->pos;
        if (rd_u32(r, &t->n_dims, "n_dims")) return specd_err_wrap(r->err, "tensor '%s'", name);
        if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
            return specd_err_set(r->err, "gguf: tensor '%s': n_dims %u at byte offset %zu not in 1..%d",
                                 name, t->n_dims, dims_at, GGUF_MAX_DIMS);
        uint64_t n_el = 1;
        for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            if (rd_u64(r, &t->ne[d], "tensor dim")) return specd_err_wrap(r->err, "tensor '%s'", name);
            if (t->ne[d] == 0)
                return specd_err_set(r->err, "gguf: tensor '%s': dim %u is zero", name, d);
            if (t->ne[d] > (uint64_t)INT64_MAX || __builtin_mul_overflow(n_el, t->ne[d], &n_el) || n_el > (uint64_t)INT64_MAX)
                return specd_err_set(r->err, "gguf: tensor '%s': element count overflows at dim %u (%" PRIu64 ")",
                                     name, d, t->ne[d]);
        }
        t->n_elements = n_el;
        uint32_t ty;
        size_t ty_at = r->pos;
        if (rd_u32(r, &ty, "tensor type")) return specd_err_wrap(r->err, "tensor '%s'", name);
        uint32_t be, bb;
        if (ggml_type_block((ggml_type)ty, &be, &bb))
            return specd_err_set(r->err, "gguf: tensor '%s': unsupported ggml type %u at byte offset %zu", name, ty, ty_at);
        t->type = (ggml_type)ty;
        if (t->ne[0] % be != 0)
            return specd_err_set(r->err, "gguf: tensor '%s': row length %" PRIu64 " is not a multiple of the %s block size %u",
                                 name, t->ne[0], ggml_type_name(t->type), be);
        if (__builtin_mul_overflow(n_el / be, (uint64_t)bb, &t->nbytes))
            return specd_err_set(r->err, "gguf: tensor '%s': byte size overflows", name);
        uint64_t off;
        if (rd_u64(r, &off, "tensor offset")) return specd_err_wrap(r->err, "tensor '%s'", name);
        offs[i] = off; /* relative to the data section, placed below */
        if (off % f->alignment != 0)
            return specd_err_set(r->err, "gguf: tensor '%s': offset %" PRIu64 " is not a multiple of the alignment %u",
                                 name, off, f->alignment);
    }
    /* data section: first alignment boundary after the tensor infos */
    uint64_t pos = r->pos;
    uint64_t data_start = (pos + f->alignment - 1) / f->alignment * f->alignment;
    f->data_start = data_start;
    if (f->n_tensors > 0 && data_start > r->len)
        return specd_err_set(r->err, "gguf: data section at byte offset %" PRIu64 " starts past the end of the %zu-byte file",
                             data_start, r->len);
    uint64_t data_len = data_start <= r->len ? r->len - data_start : 0;
    for (size_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        uint64_t off = offs[i];
        if (off > data_len || t->nbytes > data_len - off)
            return specd_err_set(r->err, "gguf: tensor '%s': data [%" PRIu64 ", +%" PRIu64 ") at file byte offset %" PRIu64
                                 " lies outside the %" PRIu64 "-byte data section",
                                 t->name, off, t->nbytes, data_start + off, data_len);
        t->data = r->buf + data_start + off;
    }
    for (size_t i = 0; i < f->n_tensors; i++) f->t_sorted[i] = i;
    sort_ctx = f;
    qsort(f->t_sorted, f->n_tensors, sizeof *f->t_sorted, cmp_tensor_data);
    for (size_t i = 1; i < f->n_tensors; i++) {
        const gguf_tensor *a = &f->tensors[f->t_sorted[i - 1]], *b = &f->tensors[f->t_sorted[i]];
        if ((const uint8_t *)a->data + a->nbytes > (const uint8_t *)b->data)
            return specd_err_set(r->err, "gguf: tensor '%s' data overlaps tensor '%s' (offsets %td and %td)", a->name, b->name,
                                 (const uint8_t *)a->data - r->buf - (ptrdiff_t)data_start,
                                 (const uint8_t *)b->data - r->buf - (ptrdiff_t)data_start);
    }
    qsort(f->t_sorted, f->n_tensors, sizeof *f->t_sorted, cmp_tensor_name);
    for (size_t i = 1; i < f->n_tensors; i++)
        if (strcmp(f->tensors[f->t_sorted[i - 1]].name, f->tensors[f->t_sorted[i]].name) == 0)
            return specd_err_set(r->err, "gguf: duplicate tensor name '%s'", f->tensors[f->t_sorted[i]].name);
    return 0;
}

static int parse(gguf_file *f, specd_err *err) {
    rd r = {.buf = f->buf, .len = f->len, .pos = 0, .err = err};
    uint64_t n_tensors = 0;
    if (parse_header_and_kvs(f, &r, &n_tensors)) return -1;
    uint64_t *offs = malloc((size_t)(n_tensors ? n_tensors : 1) * sizeof *offs);
    if (!offs) return specd_err_set(err, "gguf: out of memory for %" PRIu64 " tensor offsets", n_tensors);
    int rc = parse_tensor_infos(f, &r, n_tensors, offs);
    free(offs);
    return rc;
}

/* ---------------------------------------------------------------- open/close */

int gguf_open_mem(const void *buf, size_t len, gguf_file **out, specd_err *err) {
    *out = NULL;
    if (!buf && len) return specd_err_set(err, "gguf: NULL buffer");
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) return specd_err_set(err, "gguf: out of memory");
    f->buf = buf ? buf : (const uint8_t *)"";
    f->len = len;
    if (parse(f, err)) goto fail;
    *out = f;
    return 0;
fail:
    gguf_close(f);
    return -1;
}

int gguf_open(const char *path, gguf_file **out, specd_err *err) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return specd_err_set(err, "gguf: cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        specd_err_set(err, "gguf: cannot stat %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode) || st.st_size <= 0) {
        close(fd);
        return specd_err_set(err, "gguf: %s is not a non-empty regular file", path);
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return specd_err_set(err, "gguf: cannot mmap %s: %s", path, strerror(errno));
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) {
        munmap(p, (size_t)st.st_size);
        return specd_err_set(err, "gguf: out of memory");
    }
    f->buf = p;
    f->len = (size_t)st.st_size;
    f->mapped = 1;
    if (parse(f, err)) {
        specd_err_wrap(err, "%s", path);
        gguf_close(f);
        return -1;
    }
    *out = f;
    return 0;
}

void gguf_close(gguf_file *f) {
    if (!f) return;
    if (f->kvs) {
        for (size_t i = 0; i < f->n_kv; i++) {
            free((char *)f->kvs[i].pub.key);
            free(f->kvs[i].str_offs);
        }
        free(f->kvs);
    }
    if (f->tensors) {
        for (size_t i = 0; i < f->n_tensors; i++) free((char *)f->tensors[i].name);
        free(f->tensors);
    }
    free(f->kv_sorted);
    free(f->t_sorted);
    if (f->mapped) munmap((void *)f->buf, f->len);
    free(f);
}

/* ---------------------------------------------------------------- queries */

uint32_t gguf_version(const gguf_file *f) { return f->version; }
size_t gguf_n_kv(const gguf_file *f) { return f->n_kv; }
const gguf_kv *gguf_kv_at(const gguf_file *f, size_t i) { return i < f->n_kv ? &f->kvs[i].pub : NULL; }
size_t gguf_n_tensors(const gguf_file *f) { return f->n_tensors; }
const gguf_tensor *gguf_tensor_at(const gguf_file *f, size_t i) { return i < f->n_tensors ? &f->tensors[i] : NULL; }
uint32_t gguf_alignment(const gguf_file *f) { return f->alignment; }
uint64_t gguf_data_offset(const gguf_file *f) { return f->data_start; }

const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key) {
    size_t lo = 0, hi = f->n_kv;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(f->kvs[f->kv_sorted[mid]].pub.key, key);
        if (c == 0) return &f->kvs[f->kv_sorted[mid]].pub;
        if (c < 0) lo = mid + 1; else hi = mid;
    }
    return NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    size_t lo = 0, hi = f->n_tensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(f->tensors[f->t_sorted[mid]].name, name);
        if (c == 0) return &f->tensors[f->t_sorted[mid]];
        if (c < 0) lo = mid + 1; else hi = mid;
    }
    return NULL;
}

static const gguf_kv *need_kv(const gguf_file *f, const char *key, specd_err *err) {
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) specd_err_set(err, "gguf: key '%s' not found", key);
    return kv;
}

int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out, specd_err *err) {
    const gguf_kv *kv = need_kv(f, key, err);
    if (!kv) return -1;
    if (!vtype_is_int(kv->type))
        return specd_err_set(err, "gguf: key '%s' has type %s, expected an integer", key, vtype_name(kv->type));
    if (kv->type == GGUF_VT_UINT64 && kv->u64 > (uint64_t)INT64_MAX)
        return specd_err_set(err, "gguf: key '%s' value %" PRIu64 " does not fit int64", key, kv->u64);
    *out = kv->i64;
    return 0;
}

int gguf_get_f64(const gguf_file *f, const char *key, double *out, specd_err *err) {
    const gguf_kv *kv = need_kv(f, key, err);
    if (!kv) return -1;
    if (!vtype_is_int(kv->type) && kv->type != GGUF_VT_FLOAT32 && kv->type != GGUF_VT_FLOAT64)
        return specd_err_set(err, "gguf: key '%s' has type %s, expected a number", key, vtype_name(kv->type));
    *out = kv->f64;
    return 0;
}

int gguf_get_bool(const gguf_file *f, const char *key, bool *out, specd_err *err) {
    const gguf_kv *kv = need_kv(f, key, err);
    if (!kv) return -1;
    if (kv->type != GGUF_VT_BOOL)
        return specd_err_set(err, "gguf: key '%s' has type %s, expected bool", key, vtype_name(kv->type));
    *out = kv->u64 != 0;
    return 0;
}

int gguf_get_str(const gguf_file *f, const char *key, const char **s, size_t *len, specd_err *err) {
    const gguf_kv *kv = need_kv(f, key, err);
    if (!kv) return -1;
    if (kv->type != GGUF_VT_STRING)
        return specd_err_set(err, "gguf: key '%s' has type %s, expected string", key, vtype_name(kv->type));
    *s = kv->str;
    *len = (size_t)kv->str_len;
    return 0;
}

static const kv_int *as_int(const gguf_kv *kv) { return (const kv_int *)kv; }

int gguf_arr_str(const gguf_kv *kv, uint64_t i, const char **s, size_t *len) {
    if (!kv || kv->type != GGUF_VT_ARRAY || kv->arr_type != GGUF_VT_STRING || i >= kv->arr_len) return -1;
    const kv_int *k = as_int(kv);
    const uint8_t *p = k->arr_data + k->str_offs[i];
    uint64_t n;
    memcpy(&n, p, 8); /* validated at parse time */
    *s = (const char *)(p + 8);
    *len = (size_t)n;
    return 0;
}

int gguf_arr_i64(const gguf_kv *kv, uint64_t i, int64_t *out) {
    if (!kv || kv->type != GGUF_VT_ARRAY || i >= kv->arr_len) return -1;
    if (!vtype_is_int(kv->arr_type) && kv->arr_type != GGUF_VT_BOOL) return -1;
    const kv_int *k = as_int(kv);
    size_t es = vtype_size(kv->arr_type);
    gguf_kv tmp;
    scalar_widen(kv->arr_type, k->arr_data + i * es, &tmp);
    if (kv->arr_type == GGUF_VT_UINT64 && tmp.u64 > (uint64_t)INT64_MAX) return -1;
    *out = tmp.i64;
    return 0;
}

int gguf_arr_f64(const gguf_kv *kv, uint64_t i, double *out) {
    if (!kv || kv->type != GGUF_VT_ARRAY || i >= kv->arr_len) return -1;
    if (!vtype_is_int(kv->arr_type) && kv->arr_type != GGUF_VT_FLOAT32 && kv->arr_type != GGUF_VT_FLOAT64) return -1;
    const kv_int *k = as_int(kv);
    gguf_kv tmp;
    scalar_widen(kv->arr_type, k->arr_data + i * vtype_size(kv->arr_type), &tmp);
    *out = tmp.f64;
    return 0;
}
