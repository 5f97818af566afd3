/*
 * auth.h: API-key checking for the HTTP layer.
 *
 * The key is held only as its SHA-256 digest; a presented bearer token is
 * hashed the same way and the two 32-byte digests are compared with OpenSSL's
 * CRYPTO_memcmp, so neither the content nor the length of the key leaks
 * through timing. Neither key nor token is ever logged.
 *
 * The key comes from --api-key or from --api-key-file (first line, trailing
 * whitespace stripped). auth_reload() re-reads the file and swaps the digest
 * atomically under a mutex: requests already authenticated are unaffected,
 * the next request sees the new key. A reload that fails (file missing,
 * empty) keeps the old key and returns -1.
 *
 * Threading: auth_check from any HTTP thread; auth_reload from the reload
 * thread; both take the same short mutex.
 */
#ifndef SPECD_SERVER_AUTH_H
#define SPECD_SERVER_AUTH_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/util/err.h"

typedef struct auth auth;

/* KEY and KEY_FILE are both NULL: authentication disabled (everything passes).
 * Returns 0 or -1 (unreadable/empty file). */
int auth_create(const char *key, const char *key_file, auth **out, specd_err *err);
void auth_destroy(auth *a); /* NULL ok */
bool auth_enabled(const auth *a);
/* Re-reads the key file (no-op returning 0 without a file). */
int auth_reload(auth *a, specd_err *err);
/* Checks an Authorization header value ("Bearer KEY"; NULL = absent).
 * true when auth is disabled or the key matches. */
bool auth_check(auth *a, const char *authorization_header);
/* Constant-time equality of two byte strings of any lengths (SHA-256 of both,
 * then CRYPTO_memcmp). Exposed for tests. */
bool auth_equal(const char *a, size_t alen, const char *b, size_t blen);

#endif
