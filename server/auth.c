/*
 * auth.c: see auth.h. The digest, not the key, is the state; the key text is
 * wiped from the stack buffer after hashing.
 */
#include "server/auth.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

struct auth {
    pthread_mutex_t mu;
    bool enabled;
    unsigned char digest[SHA256_DIGEST_LENGTH];
    char *file;
};

bool auth_equal(const char *a, size_t alen, const char *b, size_t blen) {
    unsigned char da[SHA256_DIGEST_LENGTH], db[SHA256_DIGEST_LENGTH];
    SHA256((const unsigned char *)a, alen, da);
    SHA256((const unsigned char *)b, blen, db);
    return CRYPTO_memcmp(da, db, sizeof da) == 0;
}

/* Reads the first line of PATH, trailing CR/LF/space/tab stripped, hashed into OUT. */
static int read_key_file(const char *path, unsigned char out[SHA256_DIGEST_LENGTH], specd_err *err) {
    FILE *f = fopen(path, "r");
    if (!f) return specd_err_set(err, "api key file %s: cannot open: %s", path, strerror(errno));
    char line[4096];
    if (!fgets(line, sizeof line, f)) {
        int e = ferror(f) ? errno : 0; /* a directory opens but fails to read (EISDIR) */
        fclose(f);
        if (e) return specd_err_set(err, "api key file %s: cannot read: %s", path, strerror(e));
        return specd_err_set(err, "api key file %s: empty", path);
    }
    fclose(f);
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t')) n--;
    if (n == 0) {
        OPENSSL_cleanse(line, sizeof line);
        return specd_err_set(err, "api key file %s: the first line is empty", path);
    }
    SHA256((const unsigned char *)line, n, out);
    OPENSSL_cleanse(line, sizeof line);
    return 0;
}

int auth_create(const char *key, const char *key_file, auth **out, specd_err *err) {
    *out = NULL;
    auth *a = calloc(1, sizeof *a);
    if (!a) return specd_err_set(err, "out of memory");
    pthread_mutex_init(&a->mu, NULL);
    if (key_file) {
        a->file = strdup(key_file);
        if (!a->file) {
            specd_err_set(err, "out of memory");
            goto fail;
        }
        if (read_key_file(key_file, a->digest, err)) goto fail;
        a->enabled = true;
    } else if (key) {
        if (!*key) {
            specd_err_set(err, "api key is empty");
            goto fail;
        }
        SHA256((const unsigned char *)key, strlen(key), a->digest);
        a->enabled = true;
    }
    *out = a;
    return 0;
fail:
    auth_destroy(a);
    return -1;
}

void auth_destroy(auth *a) {
    if (!a) return;
    pthread_mutex_destroy(&a->mu);
    OPENSSL_cleanse(a->digest, sizeof a->digest);
    free(a->file);
    free(a);
}

bool auth_enabled(const auth *a) { return a && a->enabled; }

int auth_reload(auth *a, specd_err *err) {
    if (!a || !a->file) return 0;
    unsigned char d[SHA256_DIGEST_LENGTH];
    if (read_key_file(a->file, d, err)) return -1;
    pthread_mutex_lock(&a->mu);
    memcpy(a->digest, d, sizeof d);
    pthread_mutex_unlock(&a->mu);
    OPENSSL_cleanse(d, sizeof d);
    return 0;
}

bool auth_check(auth *a, const char *hdr) {
    if (!a || !a->enabled) return true;
    if (!hdr) return false;
    if (strncasecmp(hdr, "Bearer ", 7) != 0) return false;
    const char *tok = hdr + 7;
    while (*tok == ' ') tok++;
    size_t n = strlen(tok);
    while (n && (tok[n - 1] == ' ' || tok[n - 1] == '\t')) n--;
    unsigned char d[SHA256_DIGEST_LENGTH], cur[SHA256_DIGEST_LENGTH];
    SHA256((const unsigned char *)tok, n, d);
    pthread_mutex_lock(&a->mu);
    memcpy(cur, a->digest, sizeof cur);
    pthread_mutex_unlock(&a->mu);
    bool ok = CRYPTO_memcmp(d, cur, sizeof d) == 0;
    OPENSSL_cleanse(cur, sizeof cur);
    return ok;
}
