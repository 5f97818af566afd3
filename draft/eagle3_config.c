/*
 * eagle3_config.c: config.json of an EAGLE-3 head, both layouts, into
 * eagle3_config (see eagle3_config.h for the defaults and the aux-id
 * convention).
 *
 * A config is untrusted input: every size is range-checked before anything is
 * allocated from it, and a wrong JSON type is an error, never a silent default
 * (a missing key or JSON null takes the documented default).
 * Threading: pure functions.
 */
#include "draft/eagle3_config.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const char *eagle3_layout_name(eagle3_layout l) { return l == EAGLE3_LAYOUT_SPECULATORS ? "speculators" : "eagle"; }

/* ------------------------------------------------------------ JSON helpers */

/* Integer value of KEY in OBJ (an integral real is accepted). Missing or null:
 * *out = def and returns 0 (or -1 "missing" when required). */
static int get_int(const json_t *obj, const char *key, bool required, int64_t def, int64_t lo, int64_t hi,
                   int64_t *out, specd_err *err) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        if (required) return specd_err_set(err, "config.json: '%s' is missing", key);
        *out = def;
        return 0;
    }
    int64_t x;
    if (json_is_integer(v)) x = (int64_t)json_integer_value(v);
    else if (json_is_real(v) && floor(json_real_value(v)) == json_real_value(v) && fabs(json_real_value(v)) < 9e15)
        x = (int64_t)json_real_value(v);
    else return specd_err_set(err, "config.json: '%s' must be an integer", key);
    if (x < lo || x > hi)
        return specd_err_set(err, "config.json: '%s' = %lld is out of range [%lld, %lld]", key, (long long)x,
                             (long long)lo, (long long)hi);
    *out = x;
    return 0;
}

static int get_num(const json_t *obj, const char *key, double def, double *out, bool *found, specd_err *err) {
    const json_t *v = json_object_get(obj, key);
    if (found) *found = false;
    if (!v || json_is_null(v)) { *out = def; return 0; }
    if (!json_is_number(v)) return specd_err_set(err, "config.json: '%s' must be a number", key);
    *out = json_number_value(v);
    if (!isfinite(*out)) return specd_err_set(err, "config.json: '%s' is not finite", key);
    if (found) *found = true;
    return 0;
}

static int get_bool(const json_t *obj, const char *key, bool def, bool *out, specd_err *err) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) { *out = def; return 0; }
    if (!json_is_boolean(v)) return specd_err_set(err, "config.json: '%s' must be true or false", key);
    *out = json_is_true(v);
    return 0;
}

static int get_ids(const json_t *v, const char *where, eagle3_config *c, specd_err *err) {
    if (!v || json_is_null(v)) return 0;
    if (!json_is_array(v)) return specd_err_set(err, "config.json: %s must be a list of layer ids", where);
    size_t n = json_array_size(v);
    if (n == 0) return 0;
    if (n > EAGLE3_MAX_AUX) return specd_err_set(err, "config.json: %s has %zu ids (at most %d)", where, n, EAGLE3_MAX_AUX);
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_array_get(v, i);
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > 4096)
            return specd_err_set(err, "config.json: %s[%zu] is not a layer id", where, i);
        c->aux_ids[i] = (int32_t)json_integer_value(e);
    }
    c->n_aux_ids = (int32_t)n;
    return 0;
}

/* rope_scaling (or transformers v5 rope_parameters): default / linear / llama3. */
static int parse_rope(const json_t *lc, eagle3_config *c, specd_err *err) {
    bool found = false;
    double theta = 10000.0;
    if (get_num(lc, "rope_theta", 10000.0, &theta, &found, err) < 0) return -1;
    const json_t *rp = json_object_get(lc, "rope_parameters");
    if (!found && json_is_object(rp) && get_num(rp, "rope_theta", 10000.0, &theta, &found, err) < 0) return -1;
    if (!(theta > 1.0) || theta > 1e12) return specd_err_set(err, "config.json: rope_theta %g is out of range", theta);
    c->rope_theta = (float)theta;
    c->rope_theta_defaulted = !found;
    c->rope_type = EAGLE3_ROPE_DEFAULT;
    const json_t *rs = json_object_get(lc, "rope_scaling");
    if (!rs || json_is_null(rs)) rs = json_is_object(rp) ? rp : NULL;
    if (!rs) return 0;
    if (!json_is_object(rs)) return specd_err_set(err, "config.json: rope_scaling must be an object or null");
    const json_t *t = json_object_get(rs, "rope_type");
    if (!t || json_is_null(t)) t = json_object_get(rs, "type");
    const char *type = json_is_string(t) ? json_string_value(t) : "default";
    double f = 1, lo = 1, hi = 4, om = 8192;
    if (get_num(rs, "factor", 1.0, &f, NULL, err) < 0 || get_num(rs, "low_freq_factor", 1.0, &lo, NULL, err) < 0 ||
        get_num(rs, "high_freq_factor", 4.0, &hi, NULL, err) < 0 ||
        get_num(rs, "original_max_position_embeddings", 8192, &om, NULL, err) < 0)
        return -1;
    if (!strcmp(type, "default")) return 0;
    if (!(f >= 1.0) || f > 1024) return specd_err_set(err, "config.json: rope_scaling factor %g is out of range", f);
    if (!(om >= 1) || om > 1e8)
        return specd_err_set(err, "config.json: rope_scaling original_max_position_embeddings %g is out of range", om);
    if (!strcmp(type, "linear")) {
        c->rope_type = EAGLE3_ROPE_LINEAR;
    } else if (!strcmp(type, "llama3")) {
        if (!(lo > 0) || !(hi > lo) || hi > 1e6)
            return specd_err_set(err, "config.json: llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor");
        c->rope_type = EAGLE3_ROPE_LLAMA3;
    } else {
        return specd_err_set(err, "config.json: rope_scaling type '%s' is not supported (default, linear, llama3)", type);
    }
    c->rope_factor = (float)f;
    /* linear scaling reads only the factor: the llama3 fields keep their defaults there */
    c->rope_low_freq_factor = c->rope_type == EAGLE3_ROPE_LLAMA3 ? (float)lo : 1.0f;
    c->rope_high_freq_factor = c->rope_type == EAGLE3_ROPE_LLAMA3 ? (float)hi : 4.0f;
    c->rope_orig_max_pos = (int32_t)om;
    return 0;
}

/* ------------------------------------------------------------ parsing */

static int parse_obj(const json_t *root, eagle3_config *c, specd_err *err) {
    memset(c, 0, sizeof *c);
    if (!json_is_object(root)) return specd_err_set(err, "config.json: not a JSON object");
    const json_t *smt = json_object_get(root, "speculators_model_type");
    const json_t *lc = root; /* the Llama part */
    if (smt && !json_is_null(smt)) {
        if (!json_is_string(smt) || strcmp(json_string_value(smt), "eagle3") != 0)
            return specd_err_set(err, "config.json: speculators_model_type '%s' is not supported (eagle3 only)",
                                 json_is_string(smt) ? json_string_value(smt) : "?");
        c->layout = EAGLE3_LAYOUT_SPECULATORS;
        lc = json_object_get(root, "transformer_layer_config");
        if (!json_is_object(lc)) return specd_err_set(err, "config.json: transformer_layer_config missing (speculators layout)");
    } else if (json_object_get(root, "draft_vocab_size")) {
        c->layout = EAGLE3_LAYOUT_EAGLE;
    } else {
        return specd_err_set(err, "config.json: neither an EAGLE-3 head (no draft_vocab_size) nor a speculators eagle3 "
                                  "config (no speculators_model_type)");
    }
    int64_t H, nh, nkv, hd, ffn, dv, tv, th, mp;
    if (get_int(lc, "hidden_size", true, 0, 32, 65536, &H, err) < 0 ||
        get_int(lc, "num_attention_heads", true, 0, 1, 1024, &nh, err) < 0 ||
        get_int(lc, "num_key_value_heads", false, nh, 1, 1024, &nkv, err) < 0 ||
        get_int(lc, "intermediate_size", true, 0, 1, 1 << 20, &ffn, err) < 0 ||
        get_int(lc, "vocab_size", true, 0, 1, 1 << 24, &tv, err) < 0 ||
        get_int(lc, "max_position_embeddings", false, 0, 0, 1 << 26, &mp, err) < 0 ||
        get_int(root, "draft_vocab_size", true, 0, 1, 1 << 24, &dv, err) < 0 ||
        get_int(root, "target_hidden_size", false, H, 32, 65536, &th, err) < 0)
        return -1;
    if (nh % nkv) return specd_err_set(err, "config.json: %lld heads are not a multiple of %lld kv heads", (long long)nh, (long long)nkv);
    if (get_int(lc, "head_dim", false, H % nh ? 0 : H / nh, 2, 1024, &hd, err) < 0) return -1;
    if (hd < 2 || hd % 2) return specd_err_set(err, "config.json: head_dim must be even and given when hidden %% heads != 0");
    c->hidden = (int32_t)H;
    c->target_hidden = (int32_t)th;
    c->n_heads = (int32_t)nh;
    c->n_kv_heads = (int32_t)nkv;
    c->head_dim = (int32_t)hd;
    c->ffn = (int32_t)ffn;
    c->draft_vocab = (int32_t)dv;
    c->target_vocab = (int32_t)tv;
    c->max_pos = (int32_t)mp;
    double eps = 1e-6;
    if (get_num(lc, "rms_norm_eps", 1e-6, &eps, NULL, err) < 0) return -1;
    if (!(eps > 0) || eps > 1) return specd_err_set(err, "config.json: rms_norm_eps %g is out of range", eps);
    c->rms_eps = (float)eps;
    if (parse_rope(lc, c, err) < 0) return -1;
    if (get_bool(lc, "attention_bias", false, &c->attention_bias, err) < 0) return -1;
    bool mlp_bias = false;
    if (get_bool(lc, "mlp_bias", false, &mlp_bias, err) < 0) return -1;
    if (mlp_bias) return specd_err_set(err, "config.json: mlp_bias is not supported by EAGLE-3 heads");
    const json_t *act = json_object_get(lc, "hidden_act");
    if (act && json_is_string(act) && strcmp(json_string_value(act), "silu") != 0)
        return specd_err_set(err, "config.json: hidden_act '%s' is not supported (silu)", json_string_value(act));
    /* norm_before_residual: top level in both layouts; MISSING MEANS FALSE. */
    if (get_bool(root, "norm_before_residual", false, &c->norm_before_residual, err) < 0) return -1;
    static const char *const variants[] = {"norm_before_fc", "fc_norm", "norm_output"};
    for (size_t i = 0; i < 3; i++) {
        bool on = false;
        if (get_bool(root, variants[i], false, &on, err) < 0) return -1;
        if (on) return specd_err_set(err, "config.json: '%s' = true is a post-EAGLE-3 variant specd does not implement",
                                     variants[i]);
    }
    /* explicit aux ids: top level (input convention) else eagle_config (output convention) */
    const json_t *ec = json_object_get(root, "eagle_config");
    const json_t *top = json_object_get(root, "eagle_aux_hidden_state_layer_ids");
    if (top && !json_is_null(top)) {
        if (get_ids(top, "eagle_aux_hidden_state_layer_ids", c, err) < 0) return -1;
        c->aux_ids_source = EAGLE3_AUX_INPUT;
    }
    if (c->n_aux_ids == 0 && json_is_object(ec)) {
        if (get_ids(json_object_get(ec, "eagle_aux_hidden_state_layer_ids"), "eagle_config.eagle_aux_hidden_state_layer_ids",
                    c, err) < 0)
            return -1;
        c->aux_ids_source = EAGLE3_AUX_OUTPUT;
    }
    const json_t *sc = json_object_get(root, "speculators_config");
    const json_t *ver = json_is_object(sc) ? json_object_get(sc, "verifier") : NULL;
    const json_t *vn = json_is_object(ver) ? json_object_get(ver, "name_or_path") : NULL;
    if (json_is_string(vn)) snprintf(c->verifier, sizeof c->verifier, "%s", json_string_value(vn));
    if (c->draft_vocab > c->target_vocab)
        return specd_err_set(err, "config.json: draft_vocab_size %d exceeds the target vocab_size %d", c->draft_vocab,
                             c->target_vocab);
    return 0;
}

int eagle3_config_parse(const char *text, size_t len, eagle3_config *out, specd_err *err) {
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return specd_err_set(err, "config.json: invalid JSON at line %d: %s", je.line, je.text);
    int rc = parse_obj(root, out, err);
    json_decref(root);
    return rc;
}

static bool dir_has_suffix(const char *dir, const char *suffix) {
    DIR *d = opendir(dir);
    if (!d) return false;
    bool found = false;
    size_t ns = strlen(suffix);
    for (struct dirent *e; !found && (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        found = n >= ns && strcmp(e->d_name + n - ns, suffix) == 0;
    }
    closedir(d);
    return found;
}

int eagle3_config_load(const char *dir, eagle3_config *out, specd_err *err) {
    char path[4096];
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return specd_err_set(err, "%s: not a directory (an EAGLE-3 head is a directory with config.json and *.safetensors)", dir);
    if (!dir_has_suffix(dir, ".safetensors")) {
        if (dir_has_suffix(dir, ".bin") || dir_has_suffix(dir, ".pt"))
            return specd_err_set(err, "%s: only pytorch_model.bin (pickle) weights found; specd loads safetensors only "
                                      "(convert with: python -c \"import torch; from safetensors.torch import save_file; "
                                      "save_file(torch.load('pytorch_model.bin'), 'model.safetensors')\")", dir);
        return specd_err_set(err, "%s: no *.safetensors file", dir);
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return specd_err_set(err, "%s: %s", path, strerror(errno));
    char *buf = NULL;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
    if (n < 0 || n > (1 << 24) || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return specd_err_set(err, "%s: unreadable or larger than 16 MiB", path);
    }
    buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        fclose(f);
        return specd_err_set(err, "%s: read failed", path);
    }
    fclose(f);
    int rc = eagle3_config_parse(buf, (size_t)n, out, err);
    free(buf);
    if (rc < 0) specd_err_wrap(err, "%s", dir);
    return rc;
}

/* ------------------------------------------------------------ derived values */

int eagle3_config_aux_layers(const eagle3_config *c, int32_t nl, eagle3_aux_convention conv, int32_t n_expected,
                             int32_t *out, specd_err *err) {
    int32_t n;
    if (c->n_aux_ids > 0) {
        eagle3_aux_convention cv = conv == EAGLE3_AUX_AUTO ? c->aux_ids_source : conv;
        n = c->n_aux_ids;
        for (int32_t i = 0; i < n; i++) {
            out[i] = c->aux_ids[i] + (cv == EAGLE3_AUX_OUTPUT ? 1 : 0);
            if (out[i] < 0 || out[i] >= nl)
                return specd_err_set(err, "aux layer id %d (%s convention) is outside the %d-layer target: specd captures "
                                          "the residual entering layers 0..%d",
                                     c->aux_ids[i], cv == EAGLE3_AUX_OUTPUT ? "output" : "input", nl, nl - 1);
        }
    } else {
        if (nl < 4) return specd_err_set(err, "a %d-layer target is too shallow for the default aux layers", nl);
        n = 3;
        out[0] = 2;
        out[1] = nl / 2;
        out[2] = nl - 3;
    }
    if (n_expected > 0 && n != n_expected)
        return specd_err_set(err, "%d aux layers, but fc takes %d target features", n, n_expected);
    return n;
}

void eagle3_config_inv_freq(const eagle3_config *c, float *inv) {
    const int32_t d = c->head_dim;
    for (int32_t i = 0; i < d / 2; i++) {
        double f = 1.0 / pow((double)c->rope_theta, (double)(2 * i) / d); /* Su et al. 2021 */
        if (c->rope_type == EAGLE3_ROPE_LINEAR) {
            f /= c->rope_factor;
        } else if (c->rope_type == EAGLE3_ROPE_LLAMA3) {
            /* Llama 3.1: keep high frequencies, divide low ones by factor, blend between. */
            const double om = c->rope_orig_max_pos, lo = c->rope_low_freq_factor, hi = c->rope_high_freq_factor;
            const double wavelen = 2.0 * M_PI / f, lo_wl = om / lo, hi_wl = om / hi;
            if (wavelen > lo_wl) {
                f /= c->rope_factor;
            } else if (wavelen >= hi_wl) {
                double s = (om / wavelen - lo) / (hi - lo);
                f = (1.0 - s) * f / c->rope_factor + s * f;
            }
        }
        inv[i] = (float)f;
    }
}
