/*
 * sse.c: incremental Server-Sent Events parser (see sse.h for the rules).
 *
 * The parser is a two-level state machine: bytes build a line (line terminator
 * handling lives in bench_sse_feed, including a CRLF split across two reads via
 * after_cr), and each complete line is interpreted by sse_line, which either
 * appends to the event's data or dispatches it. Nothing here knows about JSON
 * or OpenAI; client.c interprets the events.
 */
#include "bench/sse.h"

#include <stdlib.h>
#include <string.h>

/* ---- growable buffers --------------------------------------------------- */

static int buf_reserve(char **buf, size_t *cap, size_t need, specd_err *err) {
    if (need <= *cap) return 0;
    if (need > BENCH_SSE_MAX_EVENT + 1)
        return specd_err_set(err, "sse: event larger than %u bytes", BENCH_SSE_MAX_EVENT);
    size_t c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    char *nb = realloc(*buf, c);
    if (!nb) return specd_err_set(err, "sse: out of memory (%zu bytes)", c);
    *buf = nb;
    *cap = c;
    return 0;
}

void bench_sse_init(bench_sse *p, bench_sse_cb cb, void *user) {
    memset(p, 0, sizeof *p);
    p->cb = cb;
    p->user = user;
}

void bench_sse_free(bench_sse *p) {
    if (!p) return;
    free(p->line);
    free(p->data);
    p->line = p->data = NULL;
    p->line_len = p->line_cap = p->data_len = p->data_cap = 0;
}

/* ---- one complete line -------------------------------------------------- */

static int sse_dispatch(bench_sse *p, specd_err *err) {
    if (!p->has_data) return 0; /* blank line with no data: nothing to send */
    if (buf_reserve(&p->data, &p->data_cap, p->data_len + 1, err)) return -1;
    p->data[p->data_len] = '\0';
    size_t len = p->data_len;
    p->data_len = 0;
    p->has_data = 0;
    p->n_events++;
    if (p->cb && p->cb(p->user, p->data, len) != 0)
        return specd_err_set(err, "sse: callback stopped the stream");
    return 0;
}

static int sse_line(bench_sse *p, const char *line, size_t len, specd_err *err) {
    if (len == 0) return sse_dispatch(p, err);
    if (line[0] == ':') return 0; /* comment (servers use these as keep-alives) */
    const char *colon = memchr(line, ':', len);
    size_t name_len = colon ? (size_t)(colon - line) : len;
    const char *val = colon ? colon + 1 : line + len;
    size_t val_len = (size_t)(line + len - val);
    if (val_len > 0 && val[0] == ' ') {
        val++;
        val_len--;
    }
    if (name_len != 4 || memcmp(line, "data", 4) != 0) return 0; /* event/id/retry */
    size_t need = p->data_len + (p->has_data ? 1 : 0) + val_len + 1;
    if (buf_reserve(&p->data, &p->data_cap, need, err)) return -1;
    if (p->has_data) p->data[p->data_len++] = '\n';
    memcpy(p->data + p->data_len, val, val_len);
    p->data_len += val_len;
    p->has_data = 1;
    return 0;
}

/* ---- byte stream --------------------------------------------------------- */

int bench_sse_feed(bench_sse *p, const char *buf, size_t n, specd_err *err) {
    size_t i = 0;
    while (i < n) {
        if (p->after_cr) { /* CRLF split across reads, or within this one */
            p->after_cr = 0;
            if (buf[i] == '\n') {
                i++;
                continue;
            }
        }
        /* Find the next line terminator in the remaining bytes. */
        size_t j = i;
        while (j < n && buf[j] != '\n' && buf[j] != '\r') j++;
        if (j == n) { /* no terminator: keep the partial line for the next read */
            if (buf_reserve(&p->line, &p->line_cap, p->line_len + (n - i), err)) return -1;
            memcpy(p->line + p->line_len, buf + i, n - i);
            p->line_len += n - i;
            return 0;
        }
        int rc;
        if (p->line_len == 0) { /* fast path: the whole line is in buf */
            rc = sse_line(p, buf + i, j - i, err);
        } else {
            if (buf_reserve(&p->line, &p->line_cap, p->line_len + (j - i), err)) return -1;
            memcpy(p->line + p->line_len, buf + i, j - i);
            p->line_len += j - i;
            rc = sse_line(p, p->line, p->line_len, err);
            p->line_len = 0;
        }
        if (rc) return -1;
        p->after_cr = buf[j] == '\r';
        i = j + 1;
    }
    return 0;
}

int bench_sse_finish(bench_sse *p) {
    int pending = p->line_len > 0 || p->has_data;
    p->line_len = 0;
    p->data_len = 0;
    p->has_data = 0;
    p->after_cr = 0;
    return pending;
}
