/*
 * st_load.c: the parallel range reader behind st_load.h.
 *
 * Owns, for one st_prefetch call: a descriptor per shard file that the plan
 * touches (posix_fadvise SEQUENTIAL), the work list (the merged ranges cut
 * into ST_CHUNK pieces, so that one large tensor is read by every thread
 * and a thread's pread stays a few MiB), the reader threads and their
 * scratch buffers.
 * Why pread into a scratch buffer rather than touching the mapping: a
 * thread that faults a mapped range in gets one page (or one fault-around
 * window) per fault and the kernel's read-ahead guess; pread asks for the
 * whole chunk in one call, from as many threads as there are, and a short
 * read tells a truncated file apart instead of raising SIGBUS. The data is
 * then in the page cache for the mapping's (zero-copy) views.
 * Threading: the threads take chunks from an atomic index; the first error
 * wins (under a mutex) and stops the others at their next chunk.
 */
#include "engine/loader/st_load.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ST_CHUNK ((uint64_t)8 << 20) /* bytes per pread work item */
#define ST_MAX_THREADS 64

/* ------------------------------------------------------------ plans */

void st_plan_free(st_plan *p) {
    free(p->r);
    *p = (st_plan){0};
}

static int plan_add(st_plan *p, int32_t shard, uint64_t off, uint64_t len, specd_err *err) {
    if (!len) return 0;
    if (p->n == p->cap) {
        const size_t cap = p->cap ? 2 * p->cap : 256;
        st_range *r = realloc(p->r, cap * sizeof *r);
        if (!r) return specd_err_set(err, "load plan: out of memory for %zu ranges", cap);
        p->r = r;
        p->cap = cap;
    }
    p->r[p->n++] = (st_range){shard, off, len};
    return 0;
}

int st_plan_whole(st_plan *p, const st_model *m, const st_tensor *t, specd_err *err) {
    return plan_add(p, t->shard, st_tensor_file_offset(m, t), t->nbytes, err);
}

int st_plan_rows(st_plan *p, const st_model *m, const st_tensor *t, int64_t row0, int64_t nrows, specd_err *err) {
    if (t->n_dims < 1 || t->shape[0] <= 0 || row0 < 0 || nrows < 0 || row0 + nrows > t->shape[0])
        return specd_err_set(err, "load plan: %s: rows [%lld, %lld) of tensor '%s' with %lld rows",
                             st_shard_name(m, t->shard), (long long)row0, (long long)(row0 + nrows), t->name,
                             (long long)(t->n_dims ? t->shape[0] : 0));
    const uint64_t rb = t->nbytes / (uint64_t)t->shape[0];
    return plan_add(p, t->shard, st_tensor_file_offset(m, t) + (uint64_t)row0 * rb, (uint64_t)nrows * rb, err);
}

int st_plan_row_parts(st_plan *p, const st_model *m, const st_tensor *t, int64_t part, int64_t n, specd_err *err) {
    if (t->n_dims < 1 || t->shape[0] <= 0 || n < 1 || part < 0 || part >= n || (t->nbytes / (uint64_t)t->shape[0]) % (uint64_t)n)
        return specd_err_set(err, "load plan: %s: part %lld of %lld of the rows of tensor '%s'", st_shard_name(m, t->shard),
                             (long long)part, (long long)n, t->name);
    const uint64_t rb = t->nbytes / (uint64_t)t->shape[0], len = rb / (uint64_t)n, base = st_tensor_file_offset(m, t);
    for (int64_t r = 0; r < t->shape[0]; r++)
        if (plan_add(p, t->shard, base + (uint64_t)r * rb + (uint64_t)part * len, len, err) < 0) return -1;
    return 0;
}

static int cmp_range(const void *a, const void *b) {
    const st_range *x = a, *y = b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    return x->off < y->off ? -1 : x->off > y->off;
}

uint64_t st_plan_merge(st_plan *p) {
    size_t m = 0;
    for (size_t i = 0; i < p->n; i++) /* empty ranges go first */
        if (p->r[i].len) p->r[m++] = p->r[i];
    p->n = m;
    if (!p->n) return 0;
    qsort(p->r, p->n, sizeof *p->r, cmp_range);
    size_t k = 0;
    for (size_t i = 1; i < p->n; i++) {
        st_range *a = &p->r[k];
        const st_range *b = &p->r[i];
        if (b->shard == a->shard && b->off <= a->off + a->len) { /* overlapping or adjacent: one range */
            const uint64_t end = b->off + b->len > a->off + a->len ? b->off + b->len : a->off + a->len;
            a->len = end - a->off;
        } else {
            p->r[++k] = *b;
        }
    }
    p->n = k + 1;
    uint64_t sum = 0;
    for (size_t i = 0; i < p->n; i++) sum += p->r[i].len;
    return sum;
}

/* ------------------------------------------------------------ reading */

int st_load_threads_default(void) {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 8 ? 8 : (int)n;
}

typedef struct rd_item {
    int32_t shard;
    uint64_t off, len;
} rd_item;

typedef struct rd_job {
    const st_model *m;
    const int *fds;
    const rd_item *items;
    size_t n_items;
    atomic_size_t next;
    atomic_bool failed;
    atomic_uint_fast64_t bytes;
    pthread_mutex_t mu;
    specd_err err; /* the first failure */
} rd_job;

static void rd_fail(rd_job *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void rd_fail(rd_job *j, const char *fmt, ...) {
    pthread_mutex_lock(&j->mu);
    if (!atomic_load(&j->failed)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(j->err.msg, sizeof j->err.msg, fmt, ap);
        va_end(ap);
        atomic_store(&j->failed, true);
    }
    pthread_mutex_unlock(&j->mu);
}

static void *rd_thread(void *arg) {
    rd_job *j = arg;
    uint8_t *scratch = NULL;
    for (;;) {
        const size_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n_items || atomic_load(&j->failed)) break;
        const rd_item *it = &j->items[i];
        uint8_t *dst = st_shard_poisoned(j->m, it->shard);
        if (dst) {
            dst += it->off; /* the poisoned copy: the bytes go where the model's views point */
        } else {
            if (!scratch && !(scratch = malloc(ST_CHUNK))) {
                rd_fail(j, "safetensors: out of memory for a %" PRIu64 "-byte read buffer", ST_CHUNK);
                break;
            }
            dst = scratch;
        }
        uint64_t got = 0;
        while (got < it->len) {
            const ssize_t r = pread(j->fds[it->shard], dst + got, (size_t)(it->len - got), (off_t)(it->off + got));
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) {
                rd_fail(j, "safetensors: %s: read error at byte %" PRIu64 ": %s", st_shard_name(j->m, it->shard),
                        it->off + got, strerror(errno));
                break;
            }
            if (r == 0) {
                struct stat st;
                const long long now = fstat(j->fds[it->shard], &st) == 0 ? (long long)st.st_size : -1;
                rd_fail(j, "safetensors: %s is truncated: it ends before byte %" PRIu64 " (%lld bytes now, %" PRIu64
                           " when it was opened)",
                        st_shard_name(j->m, it->shard), it->off + it->len, now, st_shard_size(j->m, it->shard));
                break;
            }
            got += (uint64_t)r;
        }
        atomic_fetch_add(&j->bytes, got);
        if (got < it->len) break;
    }
    free(scratch);
    return NULL;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int st_prefetch(const st_model *m, st_plan *p, int threads, st_load_stats *stats, specd_err *err) {
    const double t0 = now_s();
    const int ns = st_n_shards(m);
    st_load_stats s = {0};
    s.threads = threads > 0 ? (threads > ST_MAX_THREADS ? ST_MAX_THREADS : threads) : st_load_threads_default();
    for (int i = 0; i < ns; i++) s.bytes_files += st_shard_size(m, i);
    st_plan_merge(p);
    s.n_ranges = p->n;
    int *fds = malloc(sizeof(int) * (size_t)(ns > 0 ? ns : 1));
    for (int i = 0; fds && i < ns; i++) fds[i] = -1;
    size_t n_items = 0;
    for (size_t i = 0; i < p->n; i++) n_items += (size_t)((p->r[i].len + ST_CHUNK - 1) / ST_CHUNK);
    rd_item *items = malloc(sizeof *items * (n_items ? n_items : 1));
    pthread_t *th = calloc((size_t)s.threads, sizeof *th);
    int rc = -1, started = 0;
    rd_job j = {.m = m, .fds = fds, .items = items, .n_items = n_items, .mu = PTHREAD_MUTEX_INITIALIZER};
    if (!fds || !items || !th) {
        specd_err_set(err, "safetensors: out of memory planning %zu reads", n_items);
        goto out;
    }
    n_items = 0;
    for (size_t i = 0; i < p->n; i++) {
        const st_range *r = &p->r[i];
        if (r->shard < 0 || r->shard >= ns || !st_shard_path(m, r->shard)) {
            specd_err_set(err, "safetensors: load plan names shard %d of %d (or an in-memory model)", r->shard, ns);
            goto out;
        }
        if (r->off + r->len > st_shard_size(m, r->shard) || r->off + r->len < r->off) {
            specd_err_set(err, "safetensors: load plan reads [%" PRIu64 ", %" PRIu64 ") of %s, a %" PRIu64 "-byte file",
                          r->off, r->off + r->len, st_shard_name(m, r->shard), st_shard_size(m, r->shard));
            goto out;
        }
        if (fds[r->shard] < 0) {
            fds[r->shard] = open(st_shard_path(m, r->shard), O_RDONLY | O_CLOEXEC);
            if (fds[r->shard] < 0) {
                specd_err_set(err, "safetensors: cannot open %s: %s", st_shard_path(m, r->shard), strerror(errno));
                goto out;
            }
            (void)posix_fadvise(fds[r->shard], 0, 0, POSIX_FADV_SEQUENTIAL); /* a hint: its failure changes nothing */
            s.files_read++;
        }
        for (uint64_t o = 0; o < r->len; o += ST_CHUNK)
            items[n_items++] = (rd_item){r->shard, r->off + o, r->len - o < ST_CHUNK ? r->len - o : ST_CHUNK};
    }
    j.n_items = n_items;
    const int want = (size_t)s.threads < n_items ? s.threads : (int)(n_items ? n_items : 1);
    for (; started < want; started++) {
        const int e = pthread_create(&th[started], NULL, rd_thread, &j);
        if (e) {
            rd_fail(&j, "safetensors: cannot start reader thread %d: %s", started, strerror(e));
            break;
        }
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    if (atomic_load(&j.failed)) {
        specd_err_set(err, "%s", j.err.msg);
        goto out;
    }
    s.bytes_read = atomic_load(&j.bytes);
    s.threads = started;
    s.seconds = now_s() - t0;
    if (stats) *stats = s;
    rc = 0;
out:
    for (int i = 0; fds && i < ns; i++)
        if (fds[i] >= 0) close(fds[i]);
    free(fds);
    free(items);
    free(th);
    pthread_mutex_destroy(&j.mu);
    return rc;
}
