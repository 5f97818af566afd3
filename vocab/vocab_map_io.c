/*
 * vocab_map_io.c: finding and reading d2t / t2d on disk (vocab_map_load_raw)
 * and turning them into a validated vocab_map (vocab_map_from_raw, through
 * draft/eagle3_vocab: one validator for the loader and the CLI).
 *
 * Layouts read: our own build output (vocab_map.safetensors, d2t.npy,
 * t2d.npy), a bare .safetensors or .npy file, and an EAGLE-3 head directory
 * (EAGLE/SpecForge: config.json vocab_size + draft_vocab_size; speculators:
 * transformer_layer_config.vocab_size + draft_vocab_size). Every file is
 * untrusted: shapes and dtypes are checked before any element is read.
 * Threading: pure functions.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "draft/eagle3_vocab.h"
#include "engine/loader/safetensors.h"
#include "vocab/npy.h"
#include "vocab/vocab_map.h"

void vocab_map_raw_free(vocab_map_raw *r) {
    if (!r) return;
    free(r->d2t);
    free(r->t2d);
    memset(r, 0, sizeof *r);
}

static bool exists(const char *p, bool dir) {
    struct stat st;
    return stat(p, &st) == 0 && (dir ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode));
}

static bool ends_with(const char *s, const char *suf) {
    size_t n = strlen(s), m = strlen(suf);
    return n >= m && !strcmp(s + n - m, suf);
}

static int64_t json_int(json_t *o, const char *k) {
    json_t *v = o ? json_object_get(o, k) : NULL;
    return json_is_integer(v) ? (int64_t)json_integer_value(v) : -1;
}

/* draft_vocab_size / target vocab from a head's config.json (both layouts). */
static void read_config(const char *dir, vocab_map_raw *r) {
    char p[4200];
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_t *root = json_load_file(p, 0, NULL);
    if (!root) return;
    r->draft_vocab_cfg = json_int(root, "draft_vocab_size");
    int64_t v = json_int(json_object_get(root, "transformer_layer_config"), "vocab_size");
    r->target_vocab_cfg = v > 0 ? v : json_int(root, "vocab_size");
    json_decref(root);
}

static int take_st_tensor(const st_tensor *t, const char *path, bool is_d2t, vocab_map_raw *r, specd_err *err) {
    if (t->n_dims != 1)
        return specd_err_set(err, "%s: tensor %s must be 1-D, it has %d dimensions", path, t->name, t->n_dims);
    int64_t n = t->shape[0];
    if (is_d2t) {
        if (t->dtype != ST_I64 && t->dtype != ST_I32)
            return specd_err_set(err, "%s: d2t must be int64 (I64), it is %s", path, st_dtype_name(t->dtype));
        if (!(r->d2t = malloc(sizeof *r->d2t * (size_t)(n ? n : 1)))) return specd_err_set(err, "out of memory");
        for (int64_t i = 0; i < n; i++) {
            if (t->dtype == ST_I64) memcpy(&r->d2t[i], (const char *)t->data + 8 * i, 8);
            else {
                int32_t v;
                memcpy(&v, (const char *)t->data + 4 * i, 4);
                r->d2t[i] = v;
            }
        }
        r->n_d2t = n;
        snprintf(r->d2t_dtype, sizeof r->d2t_dtype, "%s", st_dtype_name(t->dtype));
    } else {
        if (t->dtype != ST_BOOL && t->dtype != ST_U8)
            return specd_err_set(err, "%s: t2d must be bool (BOOL), it is %s", path, st_dtype_name(t->dtype));
        const uint8_t *d = t->data;
        for (int64_t i = 0; i < n; i++)
            if (d[i] > 1) return specd_err_set(err, "%s: t2d[%lld] = %u is not a bool", path, (long long)i, d[i]);
        if (!(r->t2d = malloc((size_t)(n ? n : 1)))) return specd_err_set(err, "out of memory");
        memcpy(r->t2d, d, (size_t)n);
        r->n_t2d = n;
        snprintf(r->t2d_dtype, sizeof r->t2d_dtype, "%s", st_dtype_name(t->dtype));
    }
    return 0;
}

static int load_st(const char *path, vocab_map_raw *r, specd_err *err) {
    st_model *m = NULL;
    if (st_open(path, &m, err) < 0) return -1;
    const st_tensor *d = st_find(m, "d2t"), *t = st_find(m, "t2d");
    int rc = 0;
    if (!d && !t) rc = specd_err_set(err, "%s: no d2t or t2d tensor", path);
    if (!rc && d) rc = take_st_tensor(d, path, true, r, err);
    if (!rc && t) rc = take_st_tensor(t, path, false, r, err);
    const char *s;
    if (!rc && (s = st_metadata(m, "draft_vocab_size")) && r->draft_vocab_cfg < 0) r->draft_vocab_cfg = atoll(s);
    if (!rc && (s = st_metadata(m, "target_vocab_size")) && r->target_vocab_cfg < 0) r->target_vocab_cfg = atoll(s);
    st_close(m);
    return rc;
}

static int load_npy_pair(const char *d2t_path, const char *t2d_path, vocab_map_raw *r, specd_err *err) {
    if (exists(d2t_path, false)) {
        if (npy_read_i64_vec(d2t_path, "d2t", &r->d2t, &r->n_d2t, err) < 0) return -1;
        snprintf(r->d2t_dtype, sizeof r->d2t_dtype, "<i8");
    }
    if (exists(t2d_path, false)) {
        if (npy_read_bool_vec(t2d_path, "t2d", &r->t2d, &r->n_t2d, err) < 0) return -1;
        snprintf(r->t2d_dtype, sizeof r->t2d_dtype, "|b1");
    }
    if (!r->d2t && !r->t2d) return specd_err_set(err, "neither %s nor %s exists", d2t_path, t2d_path);
    return 0;
}

int vocab_map_load_raw(const char *path, vocab_map_raw *r, specd_err *err) {
    memset(r, 0, sizeof *r);
    r->draft_vocab_cfg = r->target_vocab_cfg = -1;
    snprintf(r->source, sizeof r->source, "%s", path);
    char a[4200], b[4200];
    int rc;
    if (exists(path, true)) {
        snprintf(a, sizeof a, "%s/vocab_map.safetensors", path);
        read_config(path, r);
        if (exists(a, false)) {
            snprintf(r->source, sizeof r->source, "%.4000s", a);
            rc = load_st(a, r, err);
        } else {
            snprintf(a, sizeof a, "%s/d2t.npy", path);
            snprintf(b, sizeof b, "%s/t2d.npy", path);
            if (exists(a, false) || exists(b, false)) rc = load_npy_pair(a, b, r, err);
            else rc = load_st(path, r, err); /* a draft head directory */
        }
    } else if (ends_with(path, ".npy")) {
        /* d2t.npy or t2d.npy: take the sibling too when it is there */
        const char *slash = strrchr(path, '/');
        int dl = slash ? (int)(slash - path) : 1;
        const char *dirp = slash ? path : ".";
        snprintf(a, sizeof a, "%.*s/d2t.npy", dl, dirp);
        snprintf(b, sizeof b, "%.*s/t2d.npy", dl, dirp);
        if (ends_with(path, "t2d.npy")) rc = load_npy_pair(a, path, r, err);
        else rc = load_npy_pair(path, b, r, err);
    } else if (exists(path, false)) {
        rc = load_st(path, r, err);
    } else {
        rc = specd_err_set(err, "%s: no such file or directory", path);
    }
    if (rc < 0) vocab_map_raw_free(r);
    return rc;
}

int vocab_map_from_raw(const vocab_map_raw *raw, int64_t V, vocab_map *out, specd_err *err) {
    memset(out, 0, sizeof *out);
    if (V <= 0) V = raw->t2d ? raw->n_t2d : raw->target_vocab_cfg;
    if (V <= 0)
        return specd_err_set(err, "%s: the target vocab size is unknown (no t2d, no config): pass --target",
                             raw->source);
    if (raw->t2d && raw->n_t2d != V)
        return specd_err_set(err, "%s: t2d has %lld entries but the target vocab has %lld", raw->source,
                             (long long)raw->n_t2d, (long long)V);
    int64_t N = raw->d2t ? raw->n_d2t : raw->draft_vocab_cfg;
    if (N <= 0 && raw->t2d) {
        N = 0;
        for (int64_t i = 0; i < raw->n_t2d; i++) N += raw->t2d[i];
    }
    if (raw->d2t && raw->draft_vocab_cfg > 0 && raw->draft_vocab_cfg != raw->n_d2t)
        return specd_err_set(err, "%s: d2t has %lld entries but draft_vocab_size is %lld", raw->source,
                             (long long)raw->n_d2t, (long long)raw->draft_vocab_cfg);
    if (N <= 0) return specd_err_set(err, "%s: empty draft vocabulary", raw->source);
    if (!(out->used = malloc(sizeof *out->used * (size_t)N))) return specd_err_set(err, "out of memory");
    if (eagle3_vocab_validate(raw->d2t, N, raw->t2d, V, out->used, NULL, err) < 0) {
        vocab_map_free(out);
        return specd_err_wrap(err, "%s", raw->source);
    }
    out->n_draft = N;
    out->n_target = V;
    out->d2t = malloc(sizeof *out->d2t * (size_t)N);
    out->t2d = calloc((size_t)V, 1);
    if (!out->d2t || !out->t2d) {
        vocab_map_free(out);
        return specd_err_set(err, "out of memory");
    }
    for (int64_t i = 0; i < N; i++) {
        out->d2t[i] = out->used[i] - i;
        out->t2d[out->used[i]] = 1;
    }
    return 0;
}
