/*
 * safetensors_write.c: st_write(), the safetensors writer (see safetensors.h).
 *
 * Output layout, as the Python `safetensors` package writes it: u64 header
 * length N, N bytes of compact JSON ("__metadata__" first when given, then
 * the tensors in the caller's order), padded with spaces so that 8 + N is a
 * multiple of 8, then the tensors' bytes back to back in the same order. The
 * data section therefore starts 8-byte aligned and has no holes (the format
 * forbids holes, so individual tensors are not padded).
 *
 * The file is written to "<path>.tmp.<pid>" and renamed into place, so a
 * reader never sees a half-written file.
 * Threading: reentrant.
 */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/loader/safetensors.h"

static int fail_tensor(specd_err *err, const char *name, const char *why) {
    return specd_err_set(err, "safetensors: st_write: tensor '%s': %s", name ? name : "(null)", why);
}

/* Builds the JSON header; *nbytes gets each tensor's byte size. */
static json_t *build_header(const st_write_tensor *ts, size_t n, const char *const *meta, uint64_t *nbytes,
                            specd_err *err) {
    json_t *root = json_object();
    if (!root) goto oom;
    if (meta) {
        json_t *jm = json_object();
        if (!jm || json_object_set_new(root, "__metadata__", jm)) goto oom;
        for (size_t i = 0; meta[i]; i += 2) {
            if (!meta[i + 1]) {
                specd_err_set(err, "safetensors: st_write: metadata key '%s' has no value", meta[i]);
                goto fail;
            }
            if (json_object_set_new(jm, meta[i], json_string(meta[i + 1]))) {
                specd_err_set(err, "safetensors: st_write: metadata '%s' is not valid UTF-8", meta[i]);
                goto fail;
            }
        }
    }
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const st_write_tensor *t = &ts[i];
        if (!t->name || !t->name[0] || strcmp(t->name, "__metadata__") == 0) {
            fail_tensor(err, t->name, "invalid name");
            goto fail;
        }
        if (json_object_get(root, t->name)) {
            fail_tensor(err, t->name, "duplicate name");
            goto fail;
        }
        size_t es = st_dtype_size(t->dtype);
        if (es == 0 || t->n_dims < 0 || t->n_dims > ST_MAX_DIMS || (t->n_dims > 0 && !t->shape)) {
            fail_tensor(err, t->name, "bad dtype or dims");
            goto fail;
        }
        uint64_t n_el = 1;
        json_t *shape = json_array();
        json_t *obj = json_object();
        if (!shape || !obj) {
            json_decref(shape);
            json_decref(obj);
            goto oom;
        }
        json_object_set_new(obj, "dtype", json_string(st_dtype_name(t->dtype)));
        json_object_set_new(obj, "shape", shape);
        if (json_object_set_new(root, t->name, obj)) {
            fail_tensor(err, t->name, "name is not valid UTF-8");
            goto fail;
        }
        for (int d = 0; d < t->n_dims; d++) {
            if (t->shape[d] < 0 || __builtin_mul_overflow(n_el, (uint64_t)t->shape[d], &n_el)) {
                fail_tensor(err, t->name, "negative or overflowing shape");
                goto fail;
            }
            json_array_append_new(shape, json_integer(t->shape[d]));
        }
        if (__builtin_mul_overflow(n_el, (uint64_t)es, &nbytes[i]) || nbytes[i] > (uint64_t)INT64_MAX - off) {
            fail_tensor(err, t->name, "byte size overflows");
            goto fail;
        }
        if (nbytes[i] && !t->data) {
            fail_tensor(err, t->name, "NULL data");
            goto fail;
        }
        json_t *offs = json_array();
        if (!offs) goto oom;
        json_array_append_new(offs, json_integer((json_int_t)off));
        json_array_append_new(offs, json_integer((json_int_t)(off + nbytes[i])));
        json_object_set_new(obj, "data_offsets", offs);
        off += nbytes[i];
    }
    return root;
oom:
    specd_err_set(err, "safetensors: st_write: out of memory");
fail:
    json_decref(root);
    return NULL;
}

int st_write(const char *path, const st_write_tensor *tensors, size_t n, const char *const *metadata_kv, specd_err *err) {
    uint64_t *nbytes = calloc(n ? n : 1, sizeof *nbytes);
    if (!nbytes) return specd_err_set(err, "safetensors: st_write: out of memory");
    char *hdr = NULL, tmp[4200];
    FILE *f = NULL;
    int rc = -1;
    json_t *root = build_header(tensors, n, metadata_kv, nbytes, err);
    if (!root) goto out;
    hdr = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!hdr) {
        specd_err_set(err, "safetensors: st_write: cannot serialize the header");
        goto out;
    }
    size_t hl = strlen(hdr);
    size_t pad = (8 - (8 + hl) % 8) % 8;
    uint64_t n_hdr = hl + pad;
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    f = fopen(tmp, "wb");
    if (!f) {
        specd_err_set(err, "safetensors: st_write: cannot create %s: %s", tmp, strerror(errno));
        goto out;
    }
    int ok = fwrite(&n_hdr, 8, 1, f) == 1 && fwrite(hdr, 1, hl, f) == hl;
    for (size_t i = 0; ok && i < pad; i++) ok = fputc(' ', f) != EOF;
    for (size_t i = 0; ok && i < n; i++)
        ok = nbytes[i] == 0 || fwrite(tensors[i].data, 1, (size_t)nbytes[i], f) == nbytes[i];
    if (fclose(f) != 0) ok = 0;
    f = NULL;
    if (!ok) {
        specd_err_set(err, "safetensors: st_write: writing %s failed: %s", tmp, strerror(errno));
        unlink(tmp);
        goto out;
    }
    if (rename(tmp, path) != 0) {
        specd_err_set(err, "safetensors: st_write: cannot rename %s to %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
        goto out;
    }
    rc = 0;
out:
    free(hdr);
    free(nbytes);
    return rc;
}
