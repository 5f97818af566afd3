/*
 * err.h: errors as values.
 *
 * Every fallible library function returns an int status (0 = ok, -1 = error)
 * and fills a caller-owned specd_err with a human-readable message. Nothing in
 * a library path calls exit(). A NULL specd_err pointer is allowed (the message
 * is dropped). Thread rule: a specd_err belongs to one thread at a time.
 */
#ifndef SPECD_UTIL_ERR_H
#define SPECD_UTIL_ERR_H

#include <stdarg.h>
#include <stddef.h>

#define SPECD_ERR_MSG_MAX 512

typedef struct specd_err {
    char msg[SPECD_ERR_MSG_MAX]; /* NUL-terminated; "" when no error */
} specd_err;

/* Sets err->msg from a printf format. Always returns -1 so callers can write
 * `return specd_err_set(err, "bad %s", x);`. err may be NULL. */
int specd_err_set(specd_err *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Prefixes the existing message with "prefix: " (context on the way up). */
int specd_err_wrap(specd_err *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

void specd_err_clear(specd_err *err);

#endif
