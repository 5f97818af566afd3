/*
 * metrics.c: see metrics.h. Histogram buckets follow vLLM's choices for
 * TTFT / TPOT / E2E so dashboards built for it read specd the same way.
 */
#include "server/metrics.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SERIES 64

static const double TTFT_BUCKETS[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                      1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double TPOT_BUCKETS[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                      1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
static const double E2E_BUCKETS[] = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                                     30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
#define NB(a) (sizeof a / sizeof a[0])
#define MAXB 24

typedef struct histo {
    const double *bounds;
    size_t n;
    uint64_t counts[MAXB]; /* per bucket (not cumulative); index n = +Inf */
    double sum;
    uint64_t count;
} histo;

typedef struct series {
    char endpoint[24];
    int status;
    uint64_t count;
} series;

struct metrics {
    pthread_mutex_t mu;
    series req[MAX_SERIES];
    size_t n_req;
    histo ttft, tpot, e2e;
    int n_ranks;                      /* tensor-parallel ranks reported (0: none yet) */
    int64_t rank_weight_bytes[METRICS_MAX_RANKS], rank_kv_bytes[METRICS_MAX_RANKS];
    int n_load;                       /* ranks with load figures (0: none yet) */
    double rank_load_s[METRICS_MAX_RANKS];
    int64_t rank_read_bytes[METRICS_MAX_RANKS], rank_file_bytes[METRICS_MAX_RANKS];
};

void metrics_set_ranks(metrics *m, int n, const int64_t *weight_bytes, const int64_t *kv_bytes) {
    pthread_mutex_lock(&m->mu);
    m->n_ranks = n < METRICS_MAX_RANKS ? n : METRICS_MAX_RANKS;
    for (int r = 0; r < m->n_ranks; r++) m->rank_weight_bytes[r] = weight_bytes[r], m->rank_kv_bytes[r] = kv_bytes[r];
    pthread_mutex_unlock(&m->mu);
}

void metrics_set_rank_load(metrics *m, int n, const double *seconds, const int64_t *read_bytes,
                           const int64_t *file_bytes) {
    pthread_mutex_lock(&m->mu);
    m->n_load = n < METRICS_MAX_RANKS ? n : METRICS_MAX_RANKS;
    for (int r = 0; r < m->n_load; r++)
        m->rank_load_s[r] = seconds[r], m->rank_read_bytes[r] = read_bytes[r], m->rank_file_bytes[r] = file_bytes[r];
    pthread_mutex_unlock(&m->mu);
}

metrics *metrics_create(void) {
    metrics *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    pthread_mutex_init(&m->mu, NULL);
    m->ttft = (histo){.bounds = TTFT_BUCKETS, .n = NB(TTFT_BUCKETS)};
    m->tpot = (histo){.bounds = TPOT_BUCKETS, .n = NB(TPOT_BUCKETS)};
    m->e2e = (histo){.bounds = E2E_BUCKETS, .n = NB(E2E_BUCKETS)};
    return m;
}

void metrics_destroy(metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

void metrics_request(metrics *m, const char *endpoint, int status) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    size_t i;
    for (i = 0; i < m->n_req; i++)
        if (m->req[i].status == status && !strcmp(m->req[i].endpoint, endpoint)) break;
    if (i == m->n_req && m->n_req < MAX_SERIES) {
        snprintf(m->req[i].endpoint, sizeof m->req[i].endpoint, "%s", endpoint);
        m->req[i].status = status;
        m->n_req++;
    }
    if (i < m->n_req) m->req[i].count++;
    pthread_mutex_unlock(&m->mu);
}

static void histo_observe(histo *h, double v) {
    size_t b = 0;
    while (b < h->n && v > h->bounds[b]) b++;
    h->counts[b]++;
    h->sum += v;
    h->count++;
}

void metrics_latency(metrics *m, double ttft_s, double tpot_s, double e2e_s) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    if (ttft_s >= 0) histo_observe(&m->ttft, ttft_s);
    if (tpot_s >= 0) histo_observe(&m->tpot, tpot_s);
    if (e2e_s >= 0) histo_observe(&m->e2e, e2e_s);
    pthread_mutex_unlock(&m->mu);
}

/* ==== text exposition ==== */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;
} sbuf;

__attribute__((format(printf, 2, 3))) static void sb_printf(sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
}

static void head(sbuf *b, const char *name, const char *type, const char *help) {
    sb_printf(b, "# HELP specd_%s %s\n# TYPE specd_%s %s\n", name, help, name, type);
}

static void scalar(sbuf *b, const char *name, const char *type, const char *help, double v) {
    head(b, name, type, help);
    sb_printf(b, "specd_%s %.17g\n", name, v);
}

static void histo_render(sbuf *b, const char *name, const char *help, const histo *h) {
    head(b, name, "histogram", help);
    uint64_t cum = 0;
    for (size_t i = 0; i < h->n; i++) {
        cum += h->counts[i];
        sb_printf(b, "specd_%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i], (unsigned long long)cum);
    }
    cum += h->counts[h->n];
    sb_printf(b, "specd_%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
    sb_printf(b, "specd_%s_sum %.17g\nspecd_%s_count %llu\n", name, h->sum, name, (unsigned long long)h->count);
}

char *metrics_render(metrics *m, const engine_stats *es, int serving, size_t *len) {
    sbuf b = {.cap = 8192};
    b.p = malloc(b.cap);
    if (!b.p) return NULL;
    b.p[0] = 0;
    scalar(&b, "up", "gauge", "1 while serving, 0 while loading or draining", serving);
    pthread_mutex_lock(&m->mu);
    head(&b, "http_requests_total", "counter", "HTTP requests by endpoint and status code");
    for (size_t i = 0; i < m->n_req; i++)
        sb_printf(&b, "specd_http_requests_total{endpoint=\"%s\",status=\"%d\"} %llu\n", m->req[i].endpoint,
                  m->req[i].status, (unsigned long long)m->req[i].count);
    histo_render(&b, "time_to_first_token_seconds", "Time to first token (submit to first output)", &m->ttft);
    histo_render(&b, "time_per_output_token_seconds", "Mean time per output token after the first", &m->tpot);
    histo_render(&b, "e2e_request_latency_seconds", "End-to-end request latency", &m->e2e);
    if (m->n_ranks) {
        head(&b, "rank_weight_bytes", "gauge", "Weight bytes each tensor-parallel rank holds (its slices)");
        for (int r = 0; r < m->n_ranks; r++)
            sb_printf(&b, "specd_rank_weight_bytes{rank=\"%d\"} %lld\n", r, (long long)m->rank_weight_bytes[r]);
        head(&b, "rank_kv_cache_bytes", "gauge", "KV cache pool bytes of each tensor-parallel rank");
        for (int r = 0; r < m->n_ranks; r++)
            sb_printf(&b, "specd_rank_kv_cache_bytes{rank=\"%d\"} %lld\n", r, (long long)m->rank_kv_bytes[r]);
    }
    if (m->n_load) {
        head(&b, "rank_load_seconds", "gauge", "Seconds each tensor-parallel rank took to load its weights");
        for (int r = 0; r < m->n_load; r++)
            sb_printf(&b, "specd_rank_load_seconds{rank=\"%d\"} %.6f\n", r, m->rank_load_s[r]);
        head(&b, "rank_load_read_bytes", "gauge", "Checkpoint bytes each rank's readers read (its slices)");
        for (int r = 0; r < m->n_load; r++)
            sb_printf(&b, "specd_rank_load_read_bytes{rank=\"%d\"} %lld\n", r, (long long)m->rank_read_bytes[r]);
        head(&b, "rank_load_file_bytes", "gauge", "Bytes of the checkpoint's files, as each rank saw them");
        for (int r = 0; r < m->n_load; r++)
            sb_printf(&b, "specd_rank_load_file_bytes{rank=\"%d\"} %lld\n", r, (long long)m->rank_file_bytes[r]);
    }
    pthread_mutex_unlock(&m->mu);
    if (es) {
        scalar(&b, "num_requests_running", "gauge", "Sequences running in the engine", (double)es->num_running);
        scalar(&b, "num_requests_waiting", "gauge", "Sequences waiting for admission", (double)es->num_waiting);
        scalar(&b, "kv_blocks_total", "gauge", "KV cache blocks in the pool", (double)es->kv_blocks_total);
        scalar(&b, "kv_blocks_free", "gauge", "KV cache blocks free", (double)es->kv_blocks_free);
        scalar(&b, "kv_blocks_used", "gauge", "KV cache blocks in use", (double)(es->kv_blocks_total - es->kv_blocks_free));
        scalar(&b, "kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use",
               es->kv_blocks_total ? (double)(es->kv_blocks_total - es->kv_blocks_free) / (double)es->kv_blocks_total
                                   : 0.0);
        scalar(&b, "prompt_tokens_total", "counter", "Prompt tokens processed", (double)es->prompt_tokens_total);
        scalar(&b, "generation_tokens_total", "counter", "Tokens generated", (double)es->generation_tokens_total);
        scalar(&b, "prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache",
               (double)es->prefix_cache_queries_total);
        scalar(&b, "prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache",
               (double)es->prefix_cache_hits_total);
        scalar(&b, "num_preemptions_total", "counter", "Sequences preempted (recompute)", (double)es->preemptions_total);
        scalar(&b, "num_queue_timeouts_total", "counter", "Requests refused with 503 after --max-queue-time in the queue",
               (double)es->queue_timeouts_total);
        scalar(&b, "engine_steps_total", "counter", "Engine steps run", (double)es->steps_total);
        static const char *reasons[5] = {"none", "stop", "length", "abort", "error"};
        head(&b, "request_success_total", "counter", "Finished sequences by finish reason");
        for (int i = 1; i < 5; i++)
            sb_printf(&b, "specd_request_success_total{finished_reason=\"%s\"} %lld\n", reasons[i],
                      (long long)es->requests_finished_total[i]);
        scalar(&b, "spec_decode_num_drafts_total", "counter", "Speculative draft rounds",
               (double)es->spec_num_drafts_total);
        scalar(&b, "spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed",
               (double)es->spec_num_draft_tokens_total);
        scalar(&b, "spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted",
               (double)es->spec_num_accepted_tokens_total);
        head(&b, "spec_decode_num_accepted_tokens_per_pos_total", "counter", "Draft tokens accepted by position");
        int kmax = es->spec_max_k > 16 ? 16 : es->spec_max_k;
        for (int i = 0; i < kmax; i++)
            sb_printf(&b, "specd_spec_decode_num_accepted_tokens_per_pos_total{position=\"%d\"} %lld\n", i,
                      (long long)es->spec_accepted_per_pos_total[i]);
        head(&b, "spec_decode_chosen_k_total", "counter",
             "Decode steps of speculating sequences by the number of drafts planned (adaptive speculation's choice)");
        for (int i = 0; i <= kmax && i < 16; i++)
            sb_printf(&b, "specd_spec_decode_chosen_k_total{k=\"%d\"} %lld\n", i, (long long)es->spec_k_chosen_total[i]);
        scalar(&b, "spec_decode_adaptive", "gauge", "1 when the drafts per step are chosen adaptively",
               es->spec_adaptive ? 1.0 : 0.0);
        scalar(&b, "model_forward_seconds_total", "counter",
               "Engine-thread wall time in target forward passes (prefill included)",
               es->forward_seconds_total);
        scalar(&b, "spec_decode_verify_forward_seconds_total", "counter",
               "Target forward time in steps that verify drafts", es->spec_verify_forward_seconds_total);
        scalar(&b, "spec_decode_verify_steps_total", "counter", "Engine steps that verified drafts",
               (double)es->spec_verify_steps_total);
        scalar(&b, "spec_decode_draft_seconds_total", "counter",
               "Engine-thread wall time in the draft model (propose and extend; extend covers prompts too)",
               es->spec_draft_seconds_total);
        scalar(&b, "spec_decode_draft_propose_seconds_total", "counter",
               "Engine-thread wall time proposing drafts (the k draft steps)", es->spec_draft_propose_seconds_total);
        scalar(&b, "draft_kv_blocks_total", "gauge", "Draft KV cache blocks in the pool",
               (double)es->draft_kv_blocks_total);
        scalar(&b, "draft_kv_blocks_free", "gauge", "Draft KV cache blocks free", (double)es->draft_kv_blocks_free);
    }
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    if (len) *len = b.len;
    return b.p;
}
