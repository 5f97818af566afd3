/*
 * draft_test_util.h: helpers shared by the draft tests that need the real
 * target and a regenerated random head:
 *   - dt_model(): the SmolLM2 GGUF (SPECD_MODEL_GGUF), or exit 77;
 *   - dt_make_head(): runs tools/eagle3/make_random_head.py with the project
 *     venv (SPECD_PYTHON; numpy only) into a fresh /tmp directory, exactly as
 *     tests/fixtures/eagle3/draft_fixtures.json records, and checks the sha256
 *     of the files it wrote against the fixture (so the head the reference
 *     logits came from is the head under test), or exit 77 without python;
 *   - fixture access (jansson for the JSON, the safetensors reader for arrays).
 * Header-only (static functions); tests are single-threaded.
 */
#ifndef SPECD_TESTS_DRAFT_UTIL_H
#define SPECD_TESTS_DRAFT_UTIL_H

#include <jansson.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/loader/safetensors.h"
#include "engine/model/model.h"

static inline const char *dt_src(void) {
    const char *s = getenv("SPECD_SOURCE_DIR");
    return s ? s : ".";
}

static inline model *dt_model(backend *be, int32_t n_blocks) {
    const char *p = getenv("SPECD_MODEL_GGUF");
    if (!p || access(p, R_OK) != 0) {
        printf("SKIP: SmolLM2 GGUF not found at %s (run tools/setup.sh)\n", p ? p : "(SPECD_MODEL_GGUF unset)");
        exit(77);
    }
    model_load_opts o = {.block_size = 16, .n_blocks = n_blocks};
    model *m = NULL;
    specd_err err = {{0}};
    if (model_load(p, be, &o, &m, &err) < 0) {
        fprintf(stderr, "model_load: %s\n", err.msg);
        exit(1);
    }
    return m;
}

static inline json_t *dt_fixtures(void) {
    char p[1024];
    snprintf(p, sizeof p, "%s/tests/fixtures/eagle3/draft_fixtures.json", dt_src());
    json_error_t je;
    json_t *j = json_load_file(p, 0, &je);
    if (!j) {
        fprintf(stderr, "%s: %s\n", p, je.text);
        exit(1);
    }
    return j;
}

static inline int dt_sha256_hex(const char *path, char out[65]) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    EVP_DigestInit_ex(c, EVP_sha256(), NULL);
    unsigned char buf[65536], md[32];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) EVP_DigestUpdate(c, buf, n);
    unsigned int len = 0;
    EVP_DigestFinal_ex(c, md, &len);
    EVP_MD_CTX_free(c);
    fclose(f);
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", md[i]);
    return 0;
}

/* Regenerates head NAME of the fixture into a new directory (written to dir,
 * >= 64 bytes) and checks its sha256 sums. Extra arguments (e.g. "--no-lm-head")
 * may be appended with EXTRA, which skips the checksum (a variant head). */
static inline void dt_make_head(json_t *fx, const char *name, const char *extra, char *dir) {
    const char *py = getenv("SPECD_PYTHON");
    if (!py || access(py, X_OK) != 0) {
        printf("SKIP: no project python at %s (tools/setup.sh makes .venv)\n", py ? py : "(SPECD_PYTHON unset)");
        exit(77);
    }
    json_t *h = json_object_get(json_object_get(fx, "heads"), name);
    const char *cmd = json_string_value(json_object_get(h, "make_head"));
    if (!cmd) { fprintf(stderr, "fixture has no head %s\n", name); exit(1); }
    strcpy(dir, "/tmp/specd_draft_head_XXXXXX");
    if (!mkdtemp(dir)) { perror("mkdtemp"); exit(1); }
    /* "tools/eagle3/make_random_head.py ... --out DIR ..." with DIR replaced */
    char args[1024];
    const char *d = strstr(cmd, " DIR");
    snprintf(args, sizeof args, "%.*s %s%s", (int)(d - cmd), cmd, dir, d + 4);
    char sh[4096];
    snprintf(sh, sizeof sh, "cd '%s' && '%s' %s %s > /dev/null", dt_src(), py, args, extra ? extra : "");
    if (system(sh) != 0) {
        printf("SKIP: could not regenerate the random head (%s)\n", sh);
        exit(77);
    }
    if (extra && *extra) return;
    static const char *const files[][2] = {{"model.safetensors", "model_safetensors_sha256"},
                                           {"config.json", "config_json_sha256"}};
    for (int i = 0; i < 2; i++) {
        char p[1024], hex[65];
        snprintf(p, sizeof p, "%s/%s", dir, files[i][0]);
        const char *want = json_string_value(json_object_get(h, files[i][1]));
        if (dt_sha256_hex(p, hex) < 0 || !want || strcmp(hex, want) != 0) {
            fprintf(stderr, "regenerated %s of head %s has sha256 %s, fixture says %s\n", files[i][0], name, hex,
                    want ? want : "?");
            exit(1);
        }
    }
}

static inline void dt_rm_head(const char *dir) {
    char sh[1200];
    snprintf(sh, sizeof sh, "rm -f '%s/model.safetensors' '%s/config.json' && rmdir '%s'", dir, dir, dir);
    if (system(sh) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

static inline st_model *dt_open_fixture(const char *file) {
    char p[1024];
    snprintf(p, sizeof p, "%s/tests/fixtures/eagle3/%s", dt_src(), file);
    st_model *m = NULL;
    specd_err err = {{0}};
    if (st_open(p, &m, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        exit(1);
    }
    return m;
}

/* A malloc'd copy of tensor NAME of M (4-byte elements: f32 or i32); exits
 * when it is missing or has another element count. */
static inline void *dt_tensor(const st_model *m, const char *name, uint64_t n_elements) {
    const st_tensor *t = st_find(m, name);
    if (!t || t->n_elements != n_elements || st_dtype_size(t->dtype) != 4) {
        fprintf(stderr, "fixture tensor %s missing or not %llu 4-byte elements\n", name, (unsigned long long)n_elements);
        exit(1);
    }
    void *p = malloc(t->nbytes);
    if (!p) abort();
    memcpy(p, t->data, t->nbytes);
    return p;
}

#endif
