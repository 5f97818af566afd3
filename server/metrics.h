/*
 * metrics.h: the server's Prometheus counters and histograms, and the text
 * exposition (format 0.0.4) of GET /metrics.
 *
 * Naming: every metric is `specd_<name>` (Prometheus-valid, underscores only),
 * counters end in _total, durations are in seconds. The engine's own counters
 * (tokens, KV blocks, prefix cache, speculative decoding) are read from an
 * engine_stats snapshot at scrape time; the peer names of REFERENCE §5 become
 * specd_spec_decode_num_drafts_total, ..._num_draft_tokens_total,
 * ..._num_accepted_tokens_total and ..._num_accepted_tokens_per_pos_total
 * {position="i"}.
 *
 * Server-side: requests by endpoint and HTTP status, TTFT / TPOT / E2E
 * histograms (cumulative buckets + _sum + _count), prompt and generation
 * tokens served.
 *
 * Threading: observations come from any HTTP thread under one mutex (a few
 * additions per request); render takes the same mutex.
 */
#ifndef SPECD_SERVER_METRICS_H
#define SPECD_SERVER_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/runtime/engine.h"

typedef struct metrics metrics;

metrics *metrics_create(void);
void metrics_destroy(metrics *m); /* NULL ok */

/* One finished HTTP request on ENDPOINT ("completions", "chat", "models", ...). */
void metrics_request(metrics *m, const char *endpoint, int status);
/* One finished generation: TTFT, mean time per output token after the first
 * (TPOT, skipped when < 2 tokens), end-to-end latency; seconds. Negative = unknown. */
void metrics_latency(metrics *m, double ttft_s, double tpot_s, double e2e_s);

/* Per-rank memory (rank 0 alone at TP 1): specd_rank_weight_bytes{rank} and
 * specd_rank_kv_cache_bytes{rank}. Set once after loading. */
#define METRICS_MAX_RANKS 64
void metrics_set_ranks(metrics *m, int n, const int64_t *weight_bytes, const int64_t *kv_bytes);
/* Per-rank loading (docs/kimi-k2.5.md "Loading at scale"): specd_rank_load_seconds{rank} (model_load's wall
 * time), specd_rank_load_read_bytes{rank} (checkpoint bytes its readers read; 0 for a GGUF file, read as
 * mapped) and specd_rank_load_file_bytes{rank} (the checkpoint's files). Set once after loading. */
void metrics_set_rank_load(metrics *m, int n, const double *seconds, const int64_t *read_bytes,
                           const int64_t *file_bytes);

/* Renders the exposition text (malloc'd) from the server counters and, when
 * ES is not NULL, the engine snapshot. SERVING: 1 serving, 0 loading/draining. */
char *metrics_render(metrics *m, const engine_stats *es, int serving, size_t *len);

#endif
