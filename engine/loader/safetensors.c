/*
 * safetensors.c: the safetensors reader and writer behind safetensors.h.
 *
 * Owns: the read-only mappings of every shard (or one borrowed buffer; or,
 * with the test aid ST_OPEN_POISON, an anonymous copy of each file holding
 * only its header until st_load.c fills ranges), each shard's path, the
 * tensor table with copied names, the merged __metadata__ pairs, and a
 * name-sorted index for O(log n) lookup and duplicate detection.
 *
 * File layout (huggingface/safetensors README "Format"): u64 little-endian N,
 * N bytes of UTF-8 JSON (an object; "__metadata__" maps strings to strings;
 * every other key is a tensor {dtype, shape, data_offsets: [begin, end]}),
 * then the data section; offsets are relative to the data section.
 * Validation follows the reference implementation's rules (its Rust
 * `validate`): header length <= 100 MiB and inside the file, header starts
 * with '{', JSON object with no duplicate keys, known dtype, shape entries
 * non-negative integers whose product (times the element size, overflow-
 * checked) equals end - begin, and the tensors tile the data section exactly:
 * sorted by begin they are contiguous from 0 to its end, so there are no
 * overlaps and no holes. Across shards names are unique, and for a sharded
 * directory every weight_map entry names a shard file (a plain file name:
 * no '/', no "..") that really holds that tensor.
 *
 * Threading: an st_model is immutable after open; any thread may read it.
 * jansson is used only here, at the file edge; nothing JSON escapes.
 */
#include "engine/loader/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/loader/gguf.h" /* fp16 / bf16 conversions */

#define ST_MAX_HEADER ((uint64_t)100 << 20)
#define ST_INDEX_NAME "model.safetensors.index.json"

typedef struct st_shard {
    const uint8_t *buf;
    size_t len;
    int mapped;   /* 1: a mapping of the file (or, poisoned, an anonymous one of its size): munmap at close */
    int poisoned; /* ST_OPEN_POISON: anonymous, 0xA5 everywhere but the header until st_prefetch fills ranges */
    char *name;   /* file name (for messages); "<memory>" for st_open_mem */
    char *path;   /* the path it was opened from (st_prefetch reopens it); NULL for st_open_mem */
} st_shard;

struct st_model {
    unsigned flags; /* ST_OPEN_* */
    st_shard *shards;
    int n_shards;
    st_tensor *tensors;
    size_t n_tensors, cap_tensors;
    size_t *sorted; /* tensor indices sorted by name */
    char **meta;    /* key, value, key, value, ... */
    size_t n_meta;
};

static const struct { const char *name; st_dtype t; size_t size; } DTYPES[] = {
    {"BOOL", ST_BOOL, 1}, {"U8", ST_U8, 1},   {"I8", ST_I8, 1},     {"I16", ST_I16, 2}, {"U16", ST_U16, 2},
    {"I32", ST_I32, 4},   {"U32", ST_U32, 4}, {"I64", ST_I64, 8},   {"U64", ST_U64, 8}, {"F16", ST_F16, 2},
    {"BF16", ST_BF16, 2}, {"F32", ST_F32, 4}, {"F64", ST_F64, 8},
};
#define N_DTYPES (sizeof DTYPES / sizeof DTYPES[0])

const char *st_dtype_name(st_dtype t) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (DTYPES[i].t == t) return DTYPES[i].name;
    return "unknown";
}

size_t st_dtype_size(st_dtype t) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (DTYPES[i].t == t) return DTYPES[i].size;
    return 0;
}

static int dtype_parse(const char *s, st_dtype *t) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (strcmp(DTYPES[i].name, s) == 0) {
            *t = DTYPES[i].t;
            return 0;
        }
    return -1;
}

/* ---------------------------------------------------------------- parsing */

static int grow_tensors(st_model *m, specd_err *err) {
    if (m->n_tensors < m->cap_tensors) return 0;
    size_t cap = m->cap_tensors ? m->cap_tensors * 2 : 64;
    st_tensor *t = realloc(m->tensors, cap * sizeof *t);
    if (!t) return specd_err_set(err, "safetensors: out of memory for %zu tensors", cap);
    m->tensors = t;
    m->cap_tensors = cap;
    return 0;
}

static int add_meta(st_model *m, const char *k, const char *v, specd_err *err) {
    for (size_t i = 0; i < m->n_meta; i++)
        if (strcmp(m->meta[2 * i], k) == 0) return 0; /* first shard wins */
    char **p = realloc(m->meta, (m->n_meta + 1) * 2 * sizeof *p);
    if (!p) return specd_err_set(err, "safetensors: out of memory");
    m->meta = p;
    p[2 * m->n_meta] = strdup(k);
    p[2 * m->n_meta + 1] = strdup(v);
    m->n_meta++;
    if (!p[2 * m->n_meta - 2] || !p[2 * m->n_meta - 1]) return specd_err_set(err, "safetensors: out of memory");
    return 0;
}

/* A JSON integer in 0..INT64_MAX (jansson refuses larger at parse time). */
static int json_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return -1;
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

typedef struct range {
    uint64_t begin, end;
    size_t tensor;
} range;

static int cmp_range(const void *a, const void *b) {
    const range *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Parses one tensor entry NAME -> V of shard S into a new st_tensor. */
static int parse_tensor(st_model *m, int s, const char *name, json_t *v, const uint8_t *data, uint64_t data_len,
                        range *r, specd_err *err) {
    const char *fn = m->shards[s].name;
    if (!json_is_object(v)) return specd_err_set(err, "safetensors: %s: tensor '%s' is not a JSON object", fn, name);
    if (name[0] == '\0') return specd_err_set(err, "safetensors: %s: empty tensor name", fn);
    json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"), *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd)) return specd_err_set(err, "safetensors: %s: tensor '%s': missing or non-string dtype", fn, name);
    st_tensor t = {0};
    if (dtype_parse(json_string_value(jd), &t.dtype))
        return specd_err_set(err, "safetensors: %s: tensor '%s': unknown dtype '%.32s'", fn, name, json_string_value(jd));
    if (!json_is_array(js)) return specd_err_set(err, "safetensors: %s: tensor '%s': missing or non-array shape", fn, name);
    if (json_array_size(js) > ST_MAX_DIMS)
        return specd_err_set(err, "safetensors: %s: tensor '%s': %zu dims, at most %d supported", fn, name,
                             json_array_size(js), ST_MAX_DIMS);
    t.n_dims = (int)json_array_size(js);
    uint64_t n_el = 1;
    for (int d = 0; d < t.n_dims; d++) {
        uint64_t dim;
        if (json_u64(json_array_get(js, (size_t)d), &dim))
            return specd_err_set(err, "safetensors: %s: tensor '%s': shape[%d] is not a non-negative integer", fn, name, d);
        if (__builtin_mul_overflow(n_el, dim, &n_el))
            return specd_err_set(err, "safetensors: %s: tensor '%s': element count overflows at shape[%d]", fn, name, d);
        t.shape[d] = (int64_t)dim;
    }
    t.n_elements = n_el;
    if (__builtin_mul_overflow(n_el, (uint64_t)st_dtype_size(t.dtype), &t.nbytes))
        return specd_err_set(err, "safetensors: %s: tensor '%s': byte size overflows", fn, name);
    if (!json_is_array(jo) || json_array_size(jo) != 2)
        return specd_err_set(err, "safetensors: %s: tensor '%s': data_offsets is not [begin, end]", fn, name);
    uint64_t b, e;
    if (json_u64(json_array_get(jo, 0), &b) || json_u64(json_array_get(jo, 1), &e))
        return specd_err_set(err, "safetensors: %s: tensor '%s': data_offsets entries must be non-negative integers", fn, name);
    if (b > e) return specd_err_set(err, "safetensors: %s: tensor '%s': data_offsets begin %" PRIu64 " > end %" PRIu64, fn, name, b, e);
    if (e > data_len)
        return specd_err_set(err, "safetensors: %s: tensor '%s': data_offsets end %" PRIu64 " is past the %" PRIu64 "-byte data section",
                             fn, name, e, data_len);
    if (e - b != t.nbytes)
        return specd_err_set(err, "safetensors: %s: tensor '%s': %" PRIu64 " bytes in data_offsets but shape x %s needs %" PRIu64,
                             fn, name, e - b, st_dtype_name(t.dtype), t.nbytes);
    t.data = data + b;
    t.shard = s;
    char *nm = strdup(name);
    if (!nm || grow_tensors(m, err)) {
        free(nm);
        return specd_err_set(err, "safetensors: out of memory");
    }
    t.name = nm;
    r->begin = b;
    r->end = e;
    r->tensor = m->n_tensors;
    m->tensors[m->n_tensors++] = t;
    return 0;
}

/* Parses shard S (its buf/len already set) and appends its tensors. */
static int parse_shard(st_model *m, int s, specd_err *err) {
    const st_shard *sh = &m->shards[s];
    const char *fn = sh->name;
    uint64_t hlen;
    if (sh->len < 8) return specd_err_set(err, "safetensors: %s: %zu bytes, too short for the 8-byte header length", fn, sh->len);
    memcpy(&hlen, sh->buf, 8);
    if (hlen > ST_MAX_HEADER)
        return specd_err_set(err, "safetensors: %s: header length %" PRIu64 " exceeds the 100 MiB limit", fn, hlen);
    if (hlen > sh->len - 8)
        return specd_err_set(err, "safetensors: %s: header length %" PRIu64 " runs past the end of the %zu-byte file", fn, hlen, sh->len);
    if (hlen < 2 || sh->buf[8] != '{')
        return specd_err_set(err, "safetensors: %s: header at byte offset 8 does not start with '{'", fn);
    json_error_t je;
    json_t *root = json_loadb((const char *)sh->buf + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return specd_err_set(err, "safetensors: %s: bad JSON header at byte offset %d: %s", fn, 8 + je.position, je.text);
    int rc = -1;
    range *ranges = NULL;
    if (!json_is_object(root)) {
        specd_err_set(err, "safetensors: %s: JSON header is not an object", fn);
        goto out;
    }
    const uint8_t *data = sh->buf + 8 + hlen;
    uint64_t data_len = sh->len - 8 - hlen;
    size_t nr = 0, cap = json_object_size(root);
    ranges = malloc((cap ? cap : 1) * sizeof *ranges);
    if (!ranges) {
        specd_err_set(err, "safetensors: out of memory");
        goto out;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(v)) {
                specd_err_set(err, "safetensors: %s: __metadata__ is not an object", fn);
                goto out;
            }
            const char *mk;
            json_t *mv;
            json_object_foreach(v, mk, mv) {
                if (!json_is_string(mv)) {
                    specd_err_set(err, "safetensors: %s: __metadata__['%s'] is not a string", fn, mk);
                    goto out;
                }
                if (add_meta(m, mk, json_string_value(mv), err)) goto out;
            }
            continue;
        }
        if (parse_tensor(m, s, key, v, data, data_len, &ranges[nr], err)) goto out;
        nr++;
    }
    /* the tensors must tile [0, data_len) exactly: no overlap, no hole */
    qsort(ranges, nr, sizeof *ranges, cmp_range);
    uint64_t at = 0;
    for (size_t i = 0; i < nr; i++) {
        if (ranges[i].begin < at) {
            specd_err_set(err, "safetensors: %s: tensor '%s' [%" PRIu64 ", %" PRIu64 ") overlaps the previous tensor (ends at %" PRIu64 ")",
                          fn, m->tensors[ranges[i].tensor].name, ranges[i].begin, ranges[i].end, at);
            goto out;
        }
        if (ranges[i].begin > at) {
            specd_err_set(err, "safetensors: %s: hole in the data section at [%" PRIu64 ", %" PRIu64 ") before tensor '%s'",
                          fn, at, ranges[i].begin, m->tensors[ranges[i].tensor].name);
            goto out;
        }
        at = ranges[i].end;
    }
    if (at != data_len) {
        specd_err_set(err, "safetensors: %s: data section has %" PRIu64 " bytes but the tensors cover %" PRIu64, fn, data_len, at);
        goto out;
    }
    rc = 0;
out:
    free(ranges);
    json_decref(root);
    return rc;
}

static _Thread_local const st_model *sort_ctx;

static int cmp_name(const void *a, const void *b) {
    return strcmp(sort_ctx->tensors[*(const size_t *)a].name, sort_ctx->tensors[*(const size_t *)b].name);
}

static int build_index(st_model *m, specd_err *err) {
    m->sorted = malloc((m->n_tensors ? m->n_tensors : 1) * sizeof *m->sorted);
    if (!m->sorted) return specd_err_set(err, "safetensors: out of memory");
    for (size_t i = 0; i < m->n_tensors; i++) m->sorted[i] = i;
    sort_ctx = m;
    qsort(m->sorted, m->n_tensors, sizeof *m->sorted, cmp_name);
    for (size_t i = 1; i < m->n_tensors; i++) {
        const st_tensor *a = &m->tensors[m->sorted[i - 1]], *b = &m->tensors[m->sorted[i]];
        if (strcmp(a->name, b->name) == 0)
            return specd_err_set(err, "safetensors: duplicate tensor name '%s' (in %s and %s)", a->name,
                                 m->shards[a->shard].name, m->shards[b->shard].name);
    }
    return 0;
}

/* ---------------------------------------------------------------- open */

static st_model *model_new(int n_shards, specd_err *err) {
    st_model *m = calloc(1, sizeof *m);
    if (m) m->shards = calloc((size_t)(n_shards > 0 ? n_shards : 1), sizeof *m->shards);
    if (!m || !m->shards) {
        free(m);
        specd_err_set(err, "safetensors: out of memory");
        return NULL;
    }
    m->n_shards = n_shards;
    return m;
}

/* ST_OPEN_POISON: an anonymous region of the file's size, 0xA5 everywhere except the 8-byte length and
 * the JSON header, which are read (pread) so that parse_shard sees them; the data section stays
 * poisoned until st_prefetch writes the planned ranges into it. Takes FD (closes it). */
static int map_poisoned(int fd, const char *path, size_t len, st_shard *sh, specd_err *err) {
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        close(fd);
        return specd_err_set(err, "safetensors: cannot map %zu anonymous bytes for %s: %s", len, path, strerror(errno));
    }
    memset(p, 0xA5, len);
    sh->buf = p;
    sh->len = len;
    sh->mapped = 1;
    sh->poisoned = 1;
    uint64_t hlen = 0;
    size_t want = 8;
    for (int pass = 0; pass < 2; pass++) { /* the length, then the header it announces (bounded by the file) */
        size_t got = 0;
        while (got < want) {
            const ssize_t r = pread(fd, (uint8_t *)p + got, want - got, (off_t)got);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                close(fd);
                return specd_err_set(err, "safetensors: cannot read the header of %s: %s", path,
                                     r < 0 ? strerror(errno) : "file shorter than its size");
            }
            got += (size_t)r;
        }
        memcpy(&hlen, p, 8);
        want = 8 + (hlen < len - 8 ? (size_t)hlen : len - 8);
    }
    close(fd);
    return 0;
}

static int map_file(const char *path, int poison, st_shard *sh, specd_err *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return specd_err_set(err, "safetensors: cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return specd_err_set(err, "safetensors: %s is not a regular file", path);
    }
    if (st.st_size < 8) {
        close(fd);
        return specd_err_set(err, "safetensors: %s: %lld bytes, too short for the 8-byte header length", path,
                             (long long)st.st_size);
    }
    sh->path = strdup(path);
    if (!sh->path) {
        close(fd);
        return specd_err_set(err, "safetensors: out of memory");
    }
    if (poison) return map_poisoned(fd, path, (size_t)st.st_size, sh, err);
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return specd_err_set(err, "safetensors: cannot mmap %s: %s", path, strerror(errno));
    sh->buf = p;
    sh->len = (size_t)st.st_size;
    sh->mapped = 1;
    return 0;
}

int st_open_mem(const void *buf, size_t len, st_model **out, specd_err *err) {
    *out = NULL;
    st_model *m = model_new(1, err);
    if (!m) return -1;
    m->shards[0].buf = buf ? buf : (const uint8_t *)"";
    m->shards[0].len = buf ? len : 0;
    m->shards[0].name = strdup("<memory>");
    if (!m->shards[0].name || parse_shard(m, 0, err) || build_index(m, err)) goto fail;
    *out = m;
    return 0;
fail:
    st_close(m);
    return -1;
}

static int open_single(const char *path, const char *display, int poison, st_model **out, specd_err *err) {
    st_model *m = model_new(1, err);
    if (!m) return -1;
    m->shards[0].name = strdup(display);
    if (!m->shards[0].name || map_file(path, poison, &m->shards[0], err) || parse_shard(m, 0, err) || build_index(m, err)) goto fail;
    *out = m;
    return 0;
fail:
    st_close(m);
    return -1;
}

/* Reads a small JSON file whole (index.json), capped at the header limit. */
static json_t *load_json_file(const char *path, specd_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        specd_err_set(err, "safetensors: cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    json_error_t je;
    struct stat st;
    json_t *j = NULL;
    if (fstat(fileno(f), &st) != 0 || (uint64_t)st.st_size > ST_MAX_HEADER) {
        specd_err_set(err, "safetensors: %s is larger than 100 MiB", path);
    } else {
        j = json_loadf(f, JSON_REJECT_DUPLICATES, &je);
        if (!j) specd_err_set(err, "safetensors: %s: bad JSON at line %d: %s", path, je.line, je.text);
    }
    fclose(f);
    return j;
}

static int join_path(char *out, size_t cap, const char *dir, const char *name, specd_err *err) {
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return specd_err_set(err, "safetensors: path %s/%s is too long", dir, name);
    return 0;
}

/* A shard name from weight_map: a plain file name inside the directory. */
static int shard_name_ok(const char *s) {
    return s[0] != '\0' && strchr(s, '/') == NULL && strchr(s, '\\') == NULL && strstr(s, "..") == NULL;
}

static int open_sharded(const char *dir, int poison, st_model **out, specd_err *err) {
    char path[4096];
    if (join_path(path, sizeof path, dir, ST_INDEX_NAME, err)) return -1;
    json_t *idx = load_json_file(path, err);
    if (!idx) return -1;
    st_model *m = NULL;
    const char **names = NULL; /* distinct shard file names, borrowed from idx */
    int n_names = 0;
    json_t *wm = json_is_object(idx) ? json_object_get(idx, "weight_map") : NULL;
    if (!json_is_object(wm)) {
        specd_err_set(err, "safetensors: %s: no weight_map object", path);
        goto fail;
    }
    names = calloc(json_object_size(wm) + 1, sizeof *names);
    if (!names) {
        specd_err_set(err, "safetensors: out of memory");
        goto fail;
    }
    const char *tname;
    json_t *v;
    json_object_foreach(wm, tname, v) {
        if (!json_is_string(v)) {
            specd_err_set(err, "safetensors: %s: weight_map['%s'] is not a string", path, tname);
            goto fail;
        }
        const char *sn = json_string_value(v);
        if (!shard_name_ok(sn)) {
            specd_err_set(err, "safetensors: %s: weight_map['%s'] = '%s' is not a plain file name in the directory", path, tname, sn);
            goto fail;
        }
        int k = 0;
        while (k < n_names && strcmp(names[k], sn) != 0) k++;
        if (k == n_names) names[n_names++] = sn;
    }
    if (n_names == 0) {
        specd_err_set(err, "safetensors: %s: empty weight_map", path);
        goto fail;
    }
    m = model_new(n_names, err);
    if (!m) goto fail;
    for (int k = 0; k < n_names; k++) {
        if (join_path(path, sizeof path, dir, names[k], err)) goto fail;
        m->shards[k].name = strdup(names[k]);
        if (!m->shards[k].name) {
            specd_err_set(err, "safetensors: out of memory");
            goto fail;
        }
        if (map_file(path, poison, &m->shards[k], err) || parse_shard(m, k, err)) goto fail;
    }
    if (build_index(m, err)) goto fail;
    json_object_foreach(wm, tname, v) {
        const st_tensor *t = st_find(m, tname);
        const char *sn = json_string_value(v);
        if (!t) {
            specd_err_set(err, "safetensors: index lists tensor '%s' in %s but no shard holds it", tname, sn);
            goto fail;
        }
        if (strcmp(m->shards[t->shard].name, sn) != 0) {
            specd_err_set(err, "safetensors: index puts tensor '%s' in %s but it is in %s", tname, sn, m->shards[t->shard].name);
            goto fail;
        }
    }
    free(names);
    json_decref(idx);
    *out = m;
    return 0;
fail:
    free(names);
    json_decref(idx);
    st_close(m);
    return -1;
}

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static int st_open_paths(const char *path, int poison, st_model **out, specd_err *err);

int st_open(const char *path, st_model **out, specd_err *err) { return st_open_ex(path, 0, out, err); }

int st_open_ex(const char *path, unsigned flags, st_model **out, specd_err *err) {
    *out = NULL;
    const int poison = (flags & ST_OPEN_POISON) != 0;
    int rc = st_open_paths(path, poison, out, err);
    if (rc == 0) (*out)->flags = flags;
    return rc;
}

static int st_open_paths(const char *path, int poison, st_model **out, specd_err *err) {
    struct stat st;
    if (stat(path, &st) != 0) return specd_err_set(err, "safetensors: cannot stat %s: %s", path, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return open_single(path, path, poison, out, err);
    char p[4096];
    if (join_path(p, sizeof p, path, ST_INDEX_NAME, err)) return -1;
    if (access(p, F_OK) == 0) return open_sharded(path, poison, out, err);
    DIR *d = opendir(path);
    if (!d) return specd_err_set(err, "safetensors: cannot list %s: %s", path, strerror(errno));
    char found[1024] = "";
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.' || !ends_with(e->d_name, ".safetensors")) continue;
        if (n++ == 0) snprintf(found, sizeof found, "%s", e->d_name);
    }
    closedir(d);
    if (n != 1)
        return specd_err_set(err, "safetensors: %s has no %s and %d *.safetensors files (need exactly one)", path, ST_INDEX_NAME, n);
    if (join_path(p, sizeof p, path, found, err)) return -1;
    return open_single(p, found, poison, out, err);
}

void st_close(st_model *m) {
    if (!m) return;
    for (int i = 0; m->shards && i < m->n_shards; i++) {
        if (m->shards[i].mapped) munmap((void *)m->shards[i].buf, m->shards[i].len);
        free(m->shards[i].name);
        free(m->shards[i].path);
    }
    free(m->shards);
    for (size_t i = 0; i < m->n_tensors; i++) free((char *)m->tensors[i].name);
    free(m->tensors);
    free(m->sorted);
    for (size_t i = 0; i < 2 * m->n_meta; i++) free(m->meta[i]);
    free(m->meta);
    free(m);
}

/* ---------------------------------------------------------------- queries */

unsigned st_open_flags(const st_model *m) { return m->flags; }
int st_n_shards(const st_model *m) { return m->n_shards; }
const char *st_shard_path(const st_model *m, int s) { return s >= 0 && s < m->n_shards ? m->shards[s].path : NULL; }
const char *st_shard_name(const st_model *m, int s) { return s >= 0 && s < m->n_shards ? m->shards[s].name : NULL; }
uint64_t st_shard_size(const st_model *m, int s) { return s >= 0 && s < m->n_shards ? m->shards[s].len : 0; }
uint8_t *st_shard_poisoned(const st_model *m, int s) {
    return s >= 0 && s < m->n_shards && m->shards[s].poisoned ? (uint8_t *)m->shards[s].buf : NULL;
}
uint64_t st_tensor_file_offset(const st_model *m, const st_tensor *t) {
    return (uint64_t)((const uint8_t *)t->data - m->shards[t->shard].buf);
}

size_t st_n_tensors(const st_model *m) { return m->n_tensors; }
const st_tensor *st_tensor_at(const st_model *m, size_t i) { return i < m->n_tensors ? &m->tensors[i] : NULL; }

const st_tensor *st_find(const st_model *m, const char *name) {
    size_t lo = 0, hi = m->n_tensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(m->tensors[m->sorted[mid]].name, name);
        if (c == 0) return &m->tensors[m->sorted[mid]];
        if (c < 0) lo = mid + 1; else hi = mid;
    }
    return NULL;
}

const char *st_metadata(const st_model *m, const char *key) {
    for (size_t i = 0; i < m->n_meta; i++)
        if (strcmp(m->meta[2 * i], key) == 0) return m->meta[2 * i + 1];
    return NULL;
}

int st_read_f32(const st_tensor *t, float *dst, specd_err *err) {
    const uint8_t *p = t->data;
    switch (t->dtype) {
    case ST_F32:
        memcpy(dst, p, (size_t)t->nbytes);
        return 0;
    case ST_F16:
    case ST_BF16:
        for (uint64_t i = 0; i < t->n_elements; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            dst[i] = t->dtype == ST_F16 ? specd_fp16_to_f32(h) : specd_bf16_to_f32(h);
        }
        return 0;
    case ST_F64:
        for (uint64_t i = 0; i < t->n_elements; i++) {
            double d;
            memcpy(&d, p + 8 * i, 8);
            dst[i] = (float)d;
        }
        return 0;
    default:
        return specd_err_set(err, "safetensors: tensor '%s' has dtype %s, not a float type", t->name, st_dtype_name(t->dtype));
    }
}
