/*
 * report.h: from per-request records to the figures people compare.
 *
 * Owns the metric definitions (vLLM bench serve's, so numbers line up with
 * what users already read): duration = first send to last completion;
 * request throughput = successful requests / duration; output token
 * throughput = sum of usage.completion_tokens / duration; total token
 * throughput = (prompt + completion tokens) / duration; TTFT and E2E latency
 * per successful request; TPOT per successful request with more than one
 * output token = (E2E - TTFT) / (output_tokens - 1); ITL = every gap between
 * text chunks of every successful request, pooled. Latencies are reported in
 * milliseconds with mean, median, std and the requested percentiles (stats.h).
 * Speculative-decoding figures come from a /metrics difference (prom.h).
 *
 * It also renders the terminal table and the result JSON (vLLM key names:
 * mean_ttft_ms, p99_itl_ms, output_throughput, ...), plus the description of
 * the machine and the git commit that a result file records.
 * Threading: pure functions over caller-owned data.
 */
#ifndef SPECD_BENCH_REPORT_H
#define SPECD_BENCH_REPORT_H

#include <jansson.h>
#include <stdio.h>

#include "bench/client.h"
#include "bench/prom.h"
#include "bench/stats.h"

typedef struct bench_fail_reason {
    char *reason; /* owned */
    size_t count;
} bench_fail_reason;

typedef struct bench_metrics {
    size_t n_requests, completed, failed;
    double duration_s;
    long total_input, total_output;
    double request_throughput, output_throughput, total_token_throughput;
    size_t peak_concurrency;
    size_t retokenized;      /* successful requests counted by re-tokenizing (no usage streamed) */
    bench_summary ttft_ms, tpot_ms, itl_ms, e2el_ms;
    bench_fail_reason *fail; /* owned, n_fail distinct reasons */
    size_t n_fail;
    int have_metrics;        /* /metrics could be read before and after */
    bench_spec_counters srv; /* after - before */
} bench_metrics;

/* Computes m from a run; srv_diff may be NULL (server without /metrics).
 * qs: the percentiles to compute (0..100). Returns 0 or -1 on OOM. */
int bench_metrics_compute(const bench_run *run, const bench_spec_counters *srv_diff, const double *qs,
                          size_t n_q, bench_metrics *m);
void bench_metrics_free(bench_metrics *m);

/* Prints the vLLM-style table. metrics_sel: comma list of ttft,tpot,itl,e2el
 * whose latency blocks to print; max_concurrency 0 = not shown. */
void bench_metrics_print(FILE *f, const bench_metrics *m, const char *metrics_sel, size_t max_concurrency);

/* Adds the metrics (vLLM keys) to obj, and when run is not NULL the
 * per-request arrays (input_lens, output_lens, ttfts, itls, e2els,
 * send_times, errors, generated_texts when kept). Returns 0 or -1. */
int bench_metrics_to_json(const bench_metrics *m, const bench_run *run, json_t *obj);

/* Fills obj with uname, nproc, cpu_model and mem_total_kb of this machine. */
void bench_machine_json(json_t *obj);

/* `git rev-parse HEAD` in the current directory (or $SPECD_GIT_COMMIT);
 * writes "" when unknown. */
void bench_git_commit(char *buf, size_t cap);

/* 1 when name (ttft, tpot, itl, e2el) is in the comma list sel. */
int bench_metric_selected(const char *sel, const char *name);

#endif
