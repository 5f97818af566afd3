/*
 * npy.c: .npy reader and writer (see npy.h for the format and the checks).
 *
 * The header dict is parsed by hand with a cursor that never reads past the
 * header's end: Python literal strings without escapes, True/False, and a
 * tuple of non-negative integers, nothing else. Threading: pure functions.
 */
#include "vocab/npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Larger dimensions cannot describe an array that fits in memory; bounding
 * them keeps the shape product overflow check simple. */
#define NPY_DIM_MAX ((int64_t)1 << 40)

static const char npy_magic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};

typedef struct {
    const char *p, *end;
} cursor;

static void skip_ws(cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

static bool eat(cursor *c, char ch) {
    skip_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return true;
    }
    return false;
}

/* A quoted literal without escapes into buf (cap bytes incl. NUL). */
static int parse_str(cursor *c, char *buf, size_t cap) {
    skip_ws(c);
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) return -1;
    char q = *c->p++;
    size_t n = 0;
    while (c->p < c->end && *c->p != q) {
        if (*c->p == '\\' || n + 1 >= cap) return -1;
        buf[n++] = *c->p++;
    }
    if (c->p >= c->end) return -1;
    c->p++;
    buf[n] = '\0';
    return 0;
}

static bool starts(cursor *c, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n) != 0) return false;
    c->p += n;
    return true;
}

static int parse_shape(cursor *c, npy_array *a) {
    if (!eat(c, '(')) return -1;
    a->ndim = 0;
    for (;;) {
        if (eat(c, ')')) return 0;
        skip_ws(c);
        if (c->p >= c->end || *c->p < '0' || *c->p > '9') return -1;
        int64_t v = 0;
        while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
            v = v * 10 + (*c->p++ - '0');
            if (v > NPY_DIM_MAX) return -1;
        }
        if (c->p < c->end && *c->p == 'L') c->p++; /* Python 2 long literal */
        if (a->ndim >= NPY_MAX_DIMS) return -1;
        a->shape[a->ndim++] = v;
        if (eat(c, ',')) continue;
        if (eat(c, ')')) return 0;
        return -1;
    }
}

/* "<i8" -> 8; byte order must be little, native ('=') or not applicable. */
static int descr_itemsize(const char *d, size_t *size) {
    if (strlen(d) < 3) return -1;
    char order = d[0], kind = d[1];
    if (order != '<' && order != '|' && order != '=') return -1;
    if (!strchr("biuf", kind)) return -1;
    char *e;
    long n = strtol(d + 2, &e, 10);
    if (*e || (n != 1 && n != 2 && n != 4 && n != 8)) return -1;
    if (order == '|' && n != 1) return -1;
    if (kind == 'b' && n != 1) return -1;
    *size = (size_t)n;
    return 0;
}

static int parse_header(const char *h, size_t len, npy_array *a, specd_err *err) {
    cursor c = {h, h + len};
    bool have_descr = false, have_fortran = false, have_shape = false;
    if (!eat(&c, '{')) return specd_err_set(err, "npy header: expected a '{' dict literal");
    for (;;) {
        if (eat(&c, '}')) break;
        char key[32];
        if (parse_str(&c, key, sizeof key) < 0 || !eat(&c, ':'))
            return specd_err_set(err, "npy header: malformed key at header byte %zu", (size_t)(c.p - h));
        if (!strcmp(key, "descr")) {
            if (have_descr || parse_str(&c, a->descr, sizeof a->descr) < 0)
                return specd_err_set(err, "npy header: malformed or repeated 'descr'");
            have_descr = true;
        } else if (!strcmp(key, "fortran_order")) {
            skip_ws(&c);
            if (have_fortran) return specd_err_set(err, "npy header: repeated 'fortran_order'");
            if (starts(&c, "True")) a->fortran_order = true;
            else if (starts(&c, "False")) a->fortran_order = false;
            else return specd_err_set(err, "npy header: 'fortran_order' must be True or False");
            have_fortran = true;
        } else if (!strcmp(key, "shape")) {
            if (have_shape || parse_shape(&c, a) < 0)
                return specd_err_set(err, "npy header: malformed or repeated 'shape' (a tuple of at most %d "
                                          "non-negative integers expected)", NPY_MAX_DIMS);
            have_shape = true;
        } else {
            return specd_err_set(err, "npy header: unexpected key '%s'", key);
        }
        if (eat(&c, ',')) continue;
        if (eat(&c, '}')) break;
        return specd_err_set(err, "npy header: expected ',' or '}' at header byte %zu", (size_t)(c.p - h));
    }
    skip_ws(&c);
    if (c.p != c.end) return specd_err_set(err, "npy header: unexpected bytes after the dict");
    if (!have_descr || !have_fortran || !have_shape)
        return specd_err_set(err, "npy header: missing key (%s)", !have_descr ? "descr" : !have_fortran ? "fortran_order" : "shape");
    if (descr_itemsize(a->descr, &a->itemsize) < 0)
        return specd_err_set(err, "npy: unsupported dtype '%s' (little-endian bool/int/uint/float scalars only)", a->descr);
    return 0;
}

int npy_parse_mem(const void *buf, size_t len, npy_array *out, specd_err *err) {
    memset(out, 0, sizeof *out);
    const unsigned char *b = buf;
    if (len < 10 || memcmp(b, npy_magic, 6) != 0) return specd_err_set(err, "not a .npy file (bad magic)");
    unsigned major = b[6];
    size_t hlen, pre;
    if (major == 1) {
        hlen = (size_t)b[8] | (size_t)b[9] << 8;
        pre = 10;
    } else if (major == 2 || major == 3) {
        if (len < 12) return specd_err_set(err, "npy: truncated preamble");
        hlen = (size_t)b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 | (size_t)b[11] << 24;
        pre = 12;
    } else {
        return specd_err_set(err, "npy: unsupported format version %u.%u", major, (unsigned)b[7]);
    }
    if (hlen > len - pre) return specd_err_set(err, "npy: header length %zu exceeds the file (%zu bytes)", hlen, len);
    if (parse_header((const char *)b + pre, hlen, out, err) < 0) return -1;
    uint64_t n = 1;
    for (int i = 0; i < out->ndim; i++) {
        if (out->shape[i] != 0 && n > UINT64_MAX / (uint64_t)out->shape[i] / 8)
            return specd_err_set(err, "npy: shape product overflows");
        n *= (uint64_t)out->shape[i];
    }
    size_t avail = len - pre - hlen;
    if (n > SIZE_MAX / out->itemsize || n * out->itemsize != avail)
        return specd_err_set(err, "npy: shape needs %llu bytes of data, the file has %zu after the header",
                             (unsigned long long)(n * out->itemsize), avail);
    out->n_elements = n;
    out->nbytes = avail;
    if (!(out->data = malloc(avail ? avail : 1))) return specd_err_set(err, "npy: out of memory");
    memcpy(out->data, b + pre + hlen, avail);
    return 0;
}

/* Whole file into memory (malloc'd). */
static int read_file(const char *path, char **buf, size_t *len, specd_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return specd_err_set(err, "%s: %s", path, strerror(errno));
    char *b = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : 1 << 16;
            char *nb = realloc(b, cap);
            if (!nb) {
                free(b);
                fclose(f);
                return specd_err_set(err, "%s: out of memory", path);
            }
            b = nb;
        }
        size_t r = fread(b + n, 1, cap - n, f);
        n += r;
        if (r == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(b);
        return specd_err_set(err, "%s: read error", path);
    }
    *buf = b;
    *len = n;
    return 0;
}

int npy_read(const char *path, npy_array *out, specd_err *err) {
    memset(out, 0, sizeof *out);
    char *buf = NULL;
    size_t len = 0;
    if (read_file(path, &buf, &len, err) < 0) return -1;
    int rc = npy_parse_mem(buf, len, out, err);
    free(buf);
    if (rc < 0) return specd_err_wrap(err, "%s", path);
    return 0;
}

void npy_array_free(npy_array *a) {
    if (!a) return;
    free(a->data);
    memset(a, 0, sizeof *a);
}

static int check_vec(const char *path, const char *what, const npy_array *a, const char *want, const char *want_name,
                     specd_err *err) {
    if (strcmp(a->descr, want) != 0 && !(want[1] != 'b' && a->descr[0] == '=' && !strcmp(a->descr + 1, want + 1)))
        return specd_err_set(err, "%s: %s must be %s ('%s'), the file holds dtype '%s'", path, what, want_name, want,
                             a->descr);
    if (a->ndim != 1) return specd_err_set(err, "%s: %s must be 1-D, the file has %d dimensions", path, what, a->ndim);
    return 0;
}

int npy_read_i64_vec(const char *path, const char *what, int64_t **v, int64_t *n, specd_err *err) {
    npy_array a;
    *v = NULL;
    *n = 0;
    if (npy_read(path, &a, err) < 0) return -1;
    if (check_vec(path, what, &a, "<i8", "int64", err) < 0) {
        npy_array_free(&a);
        return -1;
    }
    *v = a.data; /* 1-D: C and Fortran order are the same bytes */
    *n = a.shape[0];
    return 0;
}

int npy_read_bool_vec(const char *path, const char *what, uint8_t **v, int64_t *n, specd_err *err) {
    npy_array a;
    *v = NULL;
    *n = 0;
    if (npy_read(path, &a, err) < 0) return -1;
    if (check_vec(path, what, &a, "|b1", "bool", err) < 0) {
        npy_array_free(&a);
        return -1;
    }
    const uint8_t *d = a.data;
    for (int64_t i = 0; i < a.shape[0]; i++)
        if (d[i] > 1) {
            unsigned bad = d[i];
            npy_array_free(&a);
            return specd_err_set(err, "%s: %s: byte %u at index %lld is not a bool", path, what, bad, (long long)i);
        }
    *v = a.data;
    *n = a.shape[0];
    return 0;
}

int npy_write_vec(const char *path, const char *descr, const void *data, int64_t n, specd_err *err) {
    size_t isz;
    if (descr_itemsize(descr, &isz) < 0 || n < 0) return specd_err_set(err, "npy: cannot write dtype '%s'", descr);
    char dict[128];
    int dl = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (%lld,), }", descr,
                      (long long)n);
    /* pad with spaces + '\n' so that 10 + header is a multiple of 64 */
    size_t total = 10 + (size_t)dl + 1;
    size_t padded = (total + 63) / 64 * 64;
    size_t hlen = padded - 10;
    char head[256];
    memcpy(head, npy_magic, 6);
    head[6] = 1;
    head[7] = 0;
    head[8] = (char)(hlen & 0xff);
    head[9] = (char)(hlen >> 8);
    memcpy(head + 10, dict, (size_t)dl);
    memset(head + 10 + dl, ' ', hlen - (size_t)dl - 1);
    head[padded - 1] = '\n';
    char tmp[4096];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", path) >= sizeof tmp) return specd_err_set(err, "npy: path too long");
    FILE *f = fopen(tmp, "wb");
    if (!f) return specd_err_set(err, "%s: %s", tmp, strerror(errno));
    bool ok = fwrite(head, 1, padded, f) == padded && (n == 0 || fwrite(data, isz, (size_t)n, f) == (size_t)n);
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        remove(tmp);
        return specd_err_set(err, "%s: write failed: %s", path, strerror(errno));
    }
    return 0;
}
