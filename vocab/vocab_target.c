/*
 * vocab_target.c: see vocab_target.h. Threading: open/close on one thread;
 * the rest is read-only.
 */
#include "vocab/vocab_target.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int vocab_target_open(const char *path, vocab_target *t, specd_err *err) {
    memset(t, 0, sizeof *t);
    struct stat st;
    if (stat(path, &st) != 0) return specd_err_set(err, "target %s: no such file or directory", path);
    int64_t cfg_vocab = -1;
    if (S_ISDIR(st.st_mode)) {
        if (tok_create_from_dir(path, &t->tok, err) < 0) return specd_err_wrap(err, "target %s", path);
        char p[4200];
        snprintf(p, sizeof p, "%s/config.json", path);
        json_t *c = json_load_file(p, 0, NULL);
        json_t *v = c ? json_object_get(c, "vocab_size") : NULL;
        if (json_is_integer(v)) cfg_vocab = (int64_t)json_integer_value(v);
        json_decref(c);
    } else {
        if (gguf_open(path, &t->gguf, err) < 0) return specd_err_wrap(err, "target %s", path);
        if (tok_create_from_gguf(t->gguf, &t->tok, err) < 0) {
            gguf_close(t->gguf);
            t->gguf = NULL;
            return specd_err_wrap(err, "target %s", path);
        }
        const char *arch;
        size_t al;
        if (gguf_get_str(t->gguf, "general.architecture", &arch, &al, NULL) == 0 && al < 64) {
            char key[96];
            snprintf(key, sizeof key, "%.*s.vocab_size", (int)al, arch);
            int64_t v;
            if (gguf_get_i64(t->gguf, key, &v, NULL) == 0) cfg_vocab = v;
        }
    }
    t->n_vocab = tok_vocab_size(t->tok);
    if (cfg_vocab > t->n_vocab) t->n_vocab = cfg_vocab;
    return 0;
}

void vocab_target_close(vocab_target *t) {
    if (!t) return;
    tok_destroy(t->tok);
    gguf_close(t->gguf);
    memset(t, 0, sizeof *t);
}

static size_t add_id(int64_t *ids, size_t n, size_t cap, int64_t id) {
    if (id < 0) return n;
    for (size_t i = 0; i < n; i++)
        if (ids[i] == id) return n;
    if (n < cap) ids[n++] = id;
    return n;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

size_t vocab_target_structural_ids(const vocab_target *t, int64_t *ids, size_t cap) {
    static const char *const structure[] = {"<|im_start|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                            "<|im_system|>", "<|im_middle|>", "<think>", "</think>"};
    size_t n = add_id(ids, 0, cap, tok_eos_id(t->tok));
    const int32_t *stop;
    size_t ns = tok_stop_ids(t->tok, &stop);
    for (size_t i = 0; i < ns; i++) n = add_id(ids, n, cap, stop[i]);
    for (size_t i = 0; i < sizeof structure / sizeof structure[0]; i++) {
        int32_t id = tok_token_id(t->tok, structure[i], strlen(structure[i]));
        if (id >= 0 && tok_is_special(t->tok, id)) n = add_id(ids, n, cap, id);
    }
    qsort(ids, n, sizeof *ids, cmp_i64);
    return n;
}

void vocab_token_display(const tokenizer *tok, int64_t id, char *buf, size_t cap) {
    size_t len = 0;
    const char *s = id >= 0 && id < tok_vocab_size(tok) ? tok_token_bytes(tok, (int32_t)id, &len) : NULL;
    if (!s) {
        snprintf(buf, cap, "<?>");
        return;
    }
    size_t o = 0;
    for (size_t i = 0; i < len && o + 5 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') o += (size_t)snprintf(buf + o, cap - o, "\\n");
        else if (c == '\t') o += (size_t)snprintf(buf + o, cap - o, "\\t");
        else if (c == '\\') o += (size_t)snprintf(buf + o, cap - o, "\\\\");
        else if (c == '"') o += (size_t)snprintf(buf + o, cap - o, "\\\"");
        else if (c >= 0x20 && c < 0x7f) buf[o++] = (char)c;
        else if (c >= 0x80) buf[o++] = (char)c; /* UTF-8 passes through */
        else o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", c);
    }
    buf[o] = '\0';
}
