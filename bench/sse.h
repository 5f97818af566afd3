/*
 * sse.h: an incremental parser for text/event-stream (Server-Sent Events).
 *
 * Owns the byte-level framing of a streaming OpenAI response: bytes arrive
 * from libcurl in arbitrary pieces (an event may be split at any byte, a
 * CRLF may be split between two reads, one read may hold many events), and
 * the parser hands complete events to a callback, in order, exactly once.
 *
 * Framing follows the WHATWG HTML "server-sent events" parsing rules: lines
 * end in LF, CRLF or CR; a line starting with ':' is a comment; "data:" lines
 * (one optional space after the colon is dropped) accumulate, joined by LF;
 * an empty line dispatches the event if it has any data; other fields
 * (event, id, retry) are ignored; an event left without its blank line at the
 * end of the stream is discarded (bench_sse_finish reports that it existed).
 *
 * Invariants: the callback sees `data` NUL-terminated (len excludes the NUL),
 * valid only during the call. Memory is bounded by BENCH_SSE_MAX_EVENT bytes
 * per event; a longer event is an error, never a truncation.
 * Threading: one parser per stream, used by one thread.
 */
#ifndef SPECD_BENCH_SSE_H
#define SPECD_BENCH_SSE_H

#include <stddef.h>

#include "engine/util/err.h"

#define BENCH_SSE_MAX_EVENT (16u << 20) /* bytes of one event's data (16 MiB) */

/* Called once per dispatched event. Returns 0 to go on, non-zero to stop:
 * bench_sse_feed then returns -1 with "callback stopped" in err. */
typedef int (*bench_sse_cb)(void *user, const char *data, size_t len);

typedef struct bench_sse {
    bench_sse_cb cb;
    void *user;
    char *line;          /* current partial line, bytes [0, line_len) */
    size_t line_len, line_cap;
    char *data;          /* data of the event being built, joined by '\n' */
    size_t data_len, data_cap;
    int has_data;        /* at least one data: line since the last dispatch */
    int after_cr;        /* last byte seen was CR: a following LF is swallowed */
    size_t n_events;     /* events dispatched so far */
} bench_sse;

/* Prepares p (caller-owned storage) for a new stream. Never fails. */
void bench_sse_init(bench_sse *p, bench_sse_cb cb, void *user);

/* Feeds n bytes of the stream. Returns 0, or -1 with err set when an event
 * exceeds BENCH_SSE_MAX_EVENT, memory runs out, or the callback stops. */
int bench_sse_feed(bench_sse *p, const char *buf, size_t n, specd_err *err);

/* End of stream: returns 1 when an unterminated line or event was pending
 * (it is discarded, as the SSE rules say), else 0. */
int bench_sse_finish(bench_sse *p);

/* Frees the buffers; p may be re-initialised. NULL is allowed. */
void bench_sse_free(bench_sse *p);

#endif
