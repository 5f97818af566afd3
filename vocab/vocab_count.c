/*
 * vocab_count.c: see vocab_count.h. Each worker owns a private int64
 * frequency vector [n_vocab] and private counters: no sharing, no atomics in
 * the hot loop; the main thread sums them after joining, in worker order.
 */
#include "vocab/vocab_count.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct worker {
    const tokenizer *tok;
    const vocab_dataset *ds;
    const vocab_count_opts *o;
    int64_t n_vocab;
    int index, n_workers;
    vocab_count_result r;     /* private partial result */
    int64_t first_fail_rec;   /* lowest failing record index, -1 */
    char fail_msg[SPECD_ERR_MSG_MAX];
    int oom;
} worker;

static void *work(void *arg) {
    worker *w = arg;
    vocab_count_result *r = &w->r;
    size_t other = w->ds->n_categories;
    for (size_t i = (size_t)w->index; i < w->ds->n_rec; i += (size_t)w->n_workers) {
        const vocab_record *rec = &w->ds->rec[i];
        if (rec->n_assistant == 0) {
            r->n_no_response++;
            continue;
        }
        int32_t *ids = NULL;
        uint8_t *mask = NULL;
        size_t n = 0;
        specd_err e = {0};
        if (tok_chat_encode(w->tok, rec->msgs, rec->n_msgs, NULL, &ids, &n, &mask, &e) < 0) {
            r->n_failed++;
            if (w->first_fail_rec < 0) {
                w->first_fail_rec = (int64_t)i;
                snprintf(w->fail_msg, sizeof w->fail_msg, "%s", e.msg);
            }
            continue;
        }
        if (w->o->max_seq_len > 0 && n > (size_t)w->o->max_seq_len) {
            r->n_skipped_long++;
            free(ids);
            free(mask);
            continue;
        }
        int64_t a = 0, cov = 0;
        for (size_t k = 0; k < n; k++) {
            if (!mask[k]) continue;
            r->freq[ids[k]]++;
            a++;
            if (w->o->t2d) cov += w->o->t2d[ids[k]] != 0;
        }
        vocab_cat_stats *cs = &r->per_cat[rec->category >= 0 ? (size_t)rec->category : other];
        cs->samples++;
        cs->assistant_tokens += a;
        cs->covered_tokens += cov;
        r->n_processed++;
        r->total_tokens += (int64_t)n;
        r->assistant_tokens += a;
        if ((int64_t)n > r->longest) r->longest = (int64_t)n;
        free(ids);
        free(mask);
    }
    return NULL;
}

void vocab_count_result_free(vocab_count_result *r) {
    if (!r) return;
    free(r->freq);
    free(r->per_cat);
    memset(r, 0, sizeof *r);
}

static double clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int vocab_count(const tokenizer *t, int64_t V, const vocab_dataset *ds, const vocab_count_opts *o,
                vocab_count_result *r, specd_err *err) {
    memset(r, 0, sizeof *r);
    if (V < tok_vocab_size(t))
        return specd_err_set(err, "count: vocab size %lld is smaller than the tokenizer's %d", (long long)V,
                             tok_vocab_size(t));
    int nw = o->n_threads < 1 ? 1 : o->n_threads > 64 ? 64 : o->n_threads;
    size_t n_cat = ds->n_categories + 1;
    worker *w = calloc((size_t)nw, sizeof *w);
    pthread_t *th = calloc((size_t)nw, sizeof *th);
    r->n_vocab = V;
    r->n_cat = n_cat;
    r->freq = calloc((size_t)V, sizeof *r->freq);
    r->per_cat = calloc(n_cat, sizeof *r->per_cat);
    if (!w || !th || !r->freq || !r->per_cat) goto oom;
    for (int i = 0; i < nw; i++) {
        w[i] = (worker){.tok = t, .ds = ds, .o = o, .n_vocab = V, .index = i, .n_workers = nw, .first_fail_rec = -1};
        w[i].r.freq = calloc((size_t)V, sizeof *r->freq);
        w[i].r.per_cat = calloc(n_cat, sizeof *r->per_cat);
        if (!w[i].r.freq || !w[i].r.per_cat) goto oom;
    }
    double t0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
    int started = 0;
    for (; started < nw; started++)
        if (pthread_create(&th[started], NULL, work, &w[started]) != 0) break;
    if (started == 0) work(&w[0]), started = -1; /* no thread could start: run inline */
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    if (started > 0 && started < nw) /* the rest of the shares, inline */
        for (int i = started; i < nw; i++) work(&w[i]);
    r->seconds = clock_s(CLOCK_MONOTONIC) - t0;
    r->cpu_seconds = clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
    int64_t fail_rec = -1;
    for (int i = 0; i < nw; i++) {
        vocab_count_result *p = &w[i].r;
        for (int64_t k = 0; k < V; k++) r->freq[k] += p->freq[k];
        for (size_t c = 0; c < n_cat; c++) {
            r->per_cat[c].samples += p->per_cat[c].samples;
            r->per_cat[c].assistant_tokens += p->per_cat[c].assistant_tokens;
            r->per_cat[c].covered_tokens += p->per_cat[c].covered_tokens;
        }
        r->n_processed += p->n_processed;
        r->n_skipped_long += p->n_skipped_long;
        r->n_no_response += p->n_no_response;
        r->n_failed += p->n_failed;
        r->total_tokens += p->total_tokens;
        r->assistant_tokens += p->assistant_tokens;
        if (p->longest > r->longest) r->longest = p->longest;
        if (w[i].first_fail_rec >= 0 && (fail_rec < 0 || w[i].first_fail_rec < fail_rec)) {
            fail_rec = w[i].first_fail_rec;
            snprintf(r->first_failure, sizeof r->first_failure, "line %lld: %s",
                     (long long)ds->rec[fail_rec].line, w[i].fail_msg);
        }
    }
    r->n_records = (int64_t)ds->n_rec;
    for (int64_t k = 0; k < V; k++) r->distinct += r->freq[k] > 0;
    for (int i = 0; i < nw; i++) vocab_count_result_free(&w[i].r);
    free(w);
    free(th);
    return 0;
oom:
    if (w)
        for (int i = 0; i < nw; i++) vocab_count_result_free(&w[i].r);
    free(w);
    free(th);
    vocab_count_result_free(r);
    return specd_err_set(err, "count: out of memory");
}
