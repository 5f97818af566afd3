/* err.c: see err.h. */
#include "engine/util/err.h"

#include <stdio.h>
#include <string.h>

int specd_err_set(specd_err *err, const char *fmt, ...) {
    if (!err) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return -1;
}

int specd_err_wrap(specd_err *err, const char *fmt, ...) {
    if (!err) return -1;
    char prefix[SPECD_ERR_MSG_MAX], old[SPECD_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    size_t np = strlen(prefix), no = strlen(old), at = 0;
    char *out = err->msg;
    const size_t cap = sizeof err->msg - 1;
    for (size_t i = 0; i < np && at < cap; i++) out[at++] = prefix[i];
    for (size_t i = 0; i < 2 && at < cap; i++) out[at++] = ": "[i];
    for (size_t i = 0; i < no && at < cap; i++) out[at++] = old[i];
    out[at] = '\0';
    return -1;
}

void specd_err_clear(specd_err *err) {
    if (err) err->msg[0] = '\0';
}
