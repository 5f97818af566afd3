/*
 * bundle.h: loading what a command needs to run the engine: backend, target
 * model (GGUF file or HF directory), tokenizer, and the engine itself,
 * configured from the shared engine flags of the config table. Used by
 * `specd serve` and `specd generate` so both build the engine identically
 * (which is what makes "greedy output of serve == generate" a fair test).
 *
 * Also the cheap checks of `--check-config` and the tokenizer-only load of
 * `specd tokenize` (no weights, no KV).
 *
 * Ownership: the bundle owns everything it created; specd_bundle_free tears
 * it down in reverse order (engine, tokenizer, model, backend). Threading:
 * main thread.
 */
#ifndef SPECD_SERVER_BUNDLE_H
#define SPECD_SERVER_BUNDLE_H

#include "engine/backend/backend.h"
#include "engine/comm/ranks.h"
#include "engine/model/model.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/tp.h"
#include "engine/tokenizer/tokenizer.h"
#include "server/config.h"

#define SPECD_RANK_WORDS 8 /* int64 words per rank in specd_bundle.rank_mem */

typedef struct specd_bundle {
    backend *be;
    backend *draft_be;        /* the draft head's own CPU backend when the target runs on cuda but the head
                                 cannot (draft_why says why), else NULL: the head shares the target's backend */
    char draft_why[200];      /* "" when the head runs on the target's (cuda) backend */
    model *m;
    tokenizer *tok;
    gguf_file *tok_gguf;      /* tokenizer-only load of a GGUF */
    engine *eng;
    struct spec_proposer *proposer; /* EAGLE-3 draft (--draft / --speculative-config), or NULL */
    int32_t max_model_len;    /* resolved (flag or the model's trained context) */
    specd_spec spec;
    const char *device;       /* "cpu" (after any fallback) */
    /* tensor parallelism (--tensor-parallel-size > 1): the worker processes,
     * the model's collectives over their shm group, rank 0's forward */
    ranks *rk;
    model_comm tp_comm;
    tp_dev_comm *tp_dev;                 /* cuda: the collectives on device memory (--tp-comm), else NULL */
    tp_runner tp_run;
    int n_ranks;                         /* 1 without TP */
    int64_t rank_mem[SPECD_RANK_WORDS * 64]; /* per rank: weight bytes, KV bytes, KV blocks, block size, then the load:
                                                 bytes read, bytes in the files, microseconds, reader threads
                                                 (gathered after loading) */
    int32_t graph_buckets[32];           /* cuda: CUDA-graph batch buckets planned (0 of them: eager) */
    int32_t n_graph_buckets;
    size_t graph_reserve;                /* cuda: device bytes the plan keeps outside the arena for the graphs */
} specd_bundle;

/* Loads backend + model + tokenizer and creates (not starts) the engine.
 * With --tensor-parallel-size N > 1 it first starts N - 1 worker processes
 * running worker_argv (this binary's own argv: every flag the same; they
 * find their rank in the arguments ranks.h appends, see specd_tp_worker_main)
 * and loads rank 0's shard; worker_argv NULL refuses TP > 1. */
int specd_bundle_load(const char *model_path, const specd_config *cfg, const char *const *worker_argv,
                      specd_bundle *b, specd_err *err);
/* Stops the engine, then drains the worker ranks (their shutdown message,
 * reaped within 10 s); -1 with the reason if any did not exit cleanly. The
 * bundle stays freeable. No-op without TP. Call after HTTP has stopped. */
int specd_bundle_tp_shutdown(specd_bundle *b, specd_err *err);
/* CPU threads per rank: --threads, or at TP N with --threads 0 the online
 * cores divided among the N ranks (at least 1). */
int specd_tp_threads(const specd_config *cfg);
/* Why the tensor-parallel group failed (a worker died, hung or failed a
 * step), into why; 0 while it is healthy or there is none. */
int specd_bundle_tp_failed(specd_bundle *b, char *why, size_t cap);

/* A worker rank's whole life: argv is rank 0's `specd serve ...` argv plus
 * ranks.h's --specd-comm-* arguments. Parses the same flags, attaches to the
 * group, loads this rank's shard with the same backend options and serves
 * steps until rank 0 shuts the group down (exit code 0) or it fails (1, the
 * reason logged). */
int specd_tp_worker_main(int argc, char **argv);
void specd_bundle_free(specd_bundle *b);

/* Tokenizer only: MODEL_PATH a GGUF or an HF directory, or TOKENIZER_JSON a
 * tokenizer.json (one of them non-NULL). */
int specd_tokenizer_load(const char *model_path, const char *tokenizer_json, specd_bundle *b, specd_err *err);

/* --check-config: the model path exists and its metadata/tokenizer load, the
 * API key file is readable, the draft directory (if any) exists and has a
 * config.json, limits are consistent. Returns 0 or -1 with err. */
int specd_check_config(const char *model_path, const specd_config *cfg, specd_err *err);

/* The served model name: --served-model-name or the path's base name
 * (".gguf" stripped) into buf. */
void specd_model_name(const char *model_path, const specd_config *cfg, char *buf, size_t cap);

#endif
