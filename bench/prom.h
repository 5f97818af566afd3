/*
 * prom.h: Prometheus text exposition parsing and the speculative-decoding
 * counters specd-bench reads from GET /metrics.
 *
 * Owns the parse of the text format (version 0.0.4): '#' lines (HELP, TYPE,
 * comments) are skipped; a sample line is `name{label="value",...} value
 * [timestamp]`, label values may contain \\ \" \n escapes, and values may be
 * NaN, +Inf or -Inf. Malformed lines are skipped and counted, not fatal: a
 * benchmark must not die on an exotic exporter.
 *
 * On top of it, bench_spec_* collects the counters that peers name
 * `<prefix>spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
 * `..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total
 * {position="i"}` (any prefix, e.g. "vllm:" or "specd_"; samples of one name
 * with different other labels, e.g. one per engine, are summed), plus the
 * token counters `<prefix>generation_tokens_total` and
 * `<prefix>prompt_tokens_total`. The derived figures follow vLLM's
 * spec-decode logging: acceptance rate = accepted / draft tokens, acceptance
 * length = 1 + accepted / drafts (the bonus token included), and per-position
 * acceptance = accepted at position i / drafts.
 *
 * Threading: plain data; no shared state.
 */
#ifndef SPECD_BENCH_PROM_H
#define SPECD_BENCH_PROM_H

#include <stddef.h>

#include "engine/util/err.h"

#define BENCH_SPEC_MAX_POS 64

typedef struct bench_prom_label {
    char *name, *value; /* owned, NUL-terminated, escapes decoded */
} bench_prom_label;

typedef struct bench_prom_sample {
    char *name;               /* owned */
    bench_prom_label *labels; /* owned array of n_labels */
    size_t n_labels;
    double value;
} bench_prom_sample;

typedef struct bench_prom {
    bench_prom_sample *samples;
    size_t n_samples, cap;
    size_t n_bad_lines; /* lines that were neither comments nor samples */
} bench_prom;

/* Parses the exposition text[0..len) into a new bench_prom (*out, destroy
 * with bench_prom_destroy). Returns 0, or -1 when out of memory. */
int bench_prom_parse(const char *text, size_t len, bench_prom **out, specd_err *err);
void bench_prom_destroy(bench_prom *p);

/* Value of label `name` on sample s, or NULL. */
const char *bench_prom_label_get(const bench_prom_sample *s, const char *name);

/* Sum of all samples whose name ends with suffix (and, when label is not NULL,
 * carry label=value). *found is set to the number of samples summed. */
double bench_prom_sum_suffix(const bench_prom *p, const char *suffix, const char *label,
                             const char *value, size_t *found);

/* Counters of one /metrics snapshot; a difference of two is a run's share. */
typedef struct bench_spec_counters {
    int has_spec;        /* the server exposed the spec-decode counters */
    double drafts, draft_tokens, accepted;
    double accepted_pos[BENCH_SPEC_MAX_POS];
    size_t n_pos;        /* positions seen: 0..n_pos-1 */
    int has_tokens;      /* the server exposed generation_tokens_total */
    double generation_tokens, prompt_tokens;
} bench_spec_counters;

/* Extracts the counters from a parsed snapshot. */
void bench_spec_from_prom(const bench_prom *p, bench_spec_counters *c);

/* after - before, field by field. has_spec: both snapshots have the counters
 * and the run made at least one draft (a server exporting zeros without a
 * draft model reports no acceptance); has_tokens: both have the counter. */
void bench_spec_diff(const bench_spec_counters *after, const bench_spec_counters *before,
                     bench_spec_counters *d);

/* Derived figures of a difference; NAN where the denominator is 0. */
double bench_spec_acceptance_rate(const bench_spec_counters *d);
double bench_spec_acceptance_length(const bench_spec_counters *d);
double bench_spec_pos_rate(const bench_spec_counters *d, size_t pos);

#endif
