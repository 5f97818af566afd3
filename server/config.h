/*
 * config.h: every command-line flag of `specd serve` (and the engine flags
 * `specd generate` shares) declared ONCE, in a table of cfg_option rows. The
 * same table drives argv parsing, the SPECD_* environment variables, `--help`
 * and the GET /v1/specd/config introspection document, so a flag cannot exist
 * in one of them and be missing from another.
 *
 * Precedence: built-in default < environment (SPECD_<NAME>, dashes become
 * underscores, upper case) < command line. Every value, whatever its source,
 * goes through the same typed parser and the same bounds check, and an error
 * names the flag and the source ("--port 70000: above the maximum 65535",
 * "SPECD_PORT=abc: not an integer").
 *
 * Flags follow vLLM's spelling (--max-model-len, --enable-prefix-caching,
 * --speculative-config ...). Booleans take no value on the command line
 * (--enable-prefix-caching), accept --no-<name>, and take 1/0, true/false,
 * yes/no, on/off from the environment or after '='.
 *
 * Ownership: string fields of a filled struct are malloc'd copies owned by the
 * struct (cfg_free / specd_config_free). The API key is a secret: it is
 * marked CFG_SECRET, never printed by --help defaults, never exported by the
 * introspection document (only whether one is set).
 *
 * Threading: parse once in main before any thread starts; read-only after.
 */
#ifndef SPECD_SERVER_CONFIG_H
#define SPECD_SERVER_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "engine/util/err.h"

typedef enum {
    CFG_STR,    /* char * (malloc'd, NULL when unset) */
    CFG_INT,    /* int32_t, bounds [min, max] */
    CFG_I64,    /* int64_t, bounds [min, max] */
    CFG_BYTES,  /* int64_t bytes, "123", "512K", "4M", "1.5G", "2GiB" (binary multiples) */
    CFG_DOUBLE, /* double, bounds [min, max] */
    CFG_BOOL,   /* bool */
} cfg_type;

enum {
    CFG_SECRET = 1u << 0, /* never shown (api key) */
    CFG_NOENV = 1u << 1,  /* no SPECD_* variable (per-invocation flags like --prompt) */
    CFG_ENGINE = 1u << 2, /* engine/model flag, shared by `specd generate` */
};

typedef struct cfg_option {
    const char *name;    /* flag without dashes: "max-model-len" */
    cfg_type type;
    const char *def;     /* default as text (parsed like any value); NULL = unset */
    double min, max;     /* bounds for numeric types (ignored if min > max) */
    size_t offset;       /* field offset in the target struct */
    unsigned flags;
    const char *choices; /* "cpu|cuda" for enumerated strings, else NULL */
    const char *help;
} cfg_option;

typedef struct cfg_table {
    const char *title;        /* section heading in --help */
    const cfg_option *opts;
    size_t n_opts;
    void *base;               /* struct the offsets point into */
    unsigned require;         /* only options with all these flags exist in this table (0 = all) */
} cfg_table;

/* Whether option O takes part in table T (its flags include T->require). */
bool cfg_visible(const cfg_table *t, const cfg_option *o);

/* ---- the serve configuration ---- */
typedef struct specd_config {
    char *host;
    int32_t port;
    char *api_key;             /* secret */
    char *api_key_file;
    char *served_model_name;
    int32_t max_model_len;     /* 0 = the model's trained context */
    int32_t max_num_seqs;
    int32_t max_num_batched_tokens;
    int32_t max_waiting;
    double max_queue_time;     /* seconds, 0 = no limit */
    int32_t block_size;
    bool enable_prefix_caching;
    int64_t kv_cache_memory;   /* bytes */
    double shutdown_timeout;   /* seconds */
    int64_t max_body_bytes;
    int32_t max_connections;
    int32_t per_ip_connections;
    int32_t connection_timeout; /* seconds */
    int32_t http_threads;
    int32_t threads;           /* CPU compute threads, 0 = all cores */
    int32_t load_threads;      /* reader threads per rank for a safetensors checkpoint, 0 = min(8, cores) */
    int32_t tensor_parallel_size; /* ranks (processes) the target is split across; 1 = no TP */
    bool enable_expert_parallel; /* routed experts split whole across the TP ranks (model_load_opts.expert_parallel) */
    char *device;              /* "auto" | "cpu" | "cuda" */
    char *tp_comm;             /* "auto" | "shm" | "cuda_ipc" | "nccl": TP collectives on device memory */
    double gpu_memory_utilization; /* cuda: fraction of total GPU memory, (0, 1] */
    char *speculative_config;  /* vLLM JSON */
    char *draft;               /* draft head directory */
    int32_t num_speculative_tokens; /* -1 = from --speculative-config or 3 */
    bool speculative_adaptive; /* adaptive k (engine_config.spec_adaptive); off if this or the JSON key is false */
    char *draft_aux_convention; /* "auto" | "input" | "output": how the head's explicit aux layer ids are read */
    char *draft_quantization;   /* "none" | "q8_0": re-quantize the head's float matrices at load (eagle3_opts.q8_0) */
    char *speculative_token_map; /* NULL or a vocab map: the draft's hot vocabulary (eagle3_opts.hot_vocab) */
    bool check_config;
    char *log_level;
    bool enforce_eager;         /* cuda: no CUDA graphs */
    char *cuda_graph_sizes;     /* cuda: "1,2,4,8" graph buckets, NULL = the default */
} specd_config;

/* The resolved speculation setting, from --speculative-config or
 * --draft/--num-speculative-tokens (which must agree if both are given). */
typedef struct specd_spec {
    bool enabled;
    char method[32];      /* "eagle3" | "eagle" */
    char *model;          /* draft directory, malloc'd */
    int32_t k;            /* num_speculative_tokens, 1..16: the most drafts per step */
    bool adaptive;        /* choose k in 0..k per sequence and step; false = always k */
} specd_spec;

extern const cfg_option specd_serve_options[];
extern const size_t specd_serve_n_options;

/* Sets every field of the tables to its default. Returns 0 or -1. */
int cfg_defaults(const cfg_table *t, size_t n_tables, specd_err *err);

/* Applies SPECD_* variables through GETENV (NULL = getenv; tests pass a fake). */
int cfg_apply_env(const cfg_table *t, size_t n_tables, const char *(*getenv_fn)(const char *), specd_err *err);

/* Parses argv[0..argc) (argv[0] is NOT the program name: pass the arguments
 * after the subcommand). Non-flag words go to positional[] (up to max_pos; more
 * is an error). "--help"/"-h" sets *help. Unknown flags are errors. */
int cfg_parse_args(const cfg_table *t, size_t n_tables, int argc, char **argv, const char **positional,
                   size_t max_pos, size_t *n_pos, bool *help, specd_err *err);

/* One value through the typed parser + bounds check (used by all sources). */
int cfg_set_value(const cfg_option *o, void *base, const char *value, const char *source, specd_err *err);

/* Frees the CFG_STR fields of the tables and NULLs them. */
void cfg_free(const cfg_table *t, size_t n_tables);

/* Prints the flag reference (name, type, default, env var, help). */
void cfg_print_help(FILE *f, const cfg_table *t, size_t n_tables);

/* Writes the current values as a JSON object body (secrets replaced by
 * "<name>_set": true|false) into a malloc'd string. Keys are the flag names
 * with '-' replaced by '_'. Returns NULL on OOM. */
char *cfg_to_json(const cfg_table *t, size_t n_tables);

/* "SPECD_MAX_MODEL_LEN" for "max-model-len" into buf. */
void cfg_env_name(const char *name, char *buf, size_t cap);

/* Convenience for the serve table. */
void specd_config_table(specd_config *c, cfg_table *out);
void specd_config_free(specd_config *c);

/* Cross-flag checks and speculation resolution: api-key and api-key-file are
 * exclusive; --speculative-config JSON parsed (method eagle3|eagle, model,
 * num_speculative_tokens 1..16, adaptive true|false (default true; false here
 * or --no-speculative-adaptive: fixed k)); --draft/--num-speculative-tokens agree with
 * it. Fills *spec (free with specd_spec_free). Returns 0 or -1 with err. */
int specd_config_resolve(const specd_config *c, specd_spec *spec, specd_err *err);
void specd_spec_free(specd_spec *s);

/* The CUDA graph batch buckets (sequences per graph): --cuda-graph-sizes
 * parsed ("1,2,4,8": ascending integers in [1, --max-num-seqs], comma-
 * separated, no empty item, at most cap), or by default 1, 2, 4, ... below
 * --max-num-seqs and --max-num-seqs itself. out [cap]. Returns the count, or
 * -1 with the reason in err. specd_config_resolve checks the flag on every
 * device, so a bad value is refused even where no graph is captured. */
int specd_config_graph_sizes(const specd_config *c, int32_t *out, int cap, specd_err *err);

/* Parses "512M" etc. into bytes. Returns 0 or -1. */
int cfg_parse_bytes(const char *s, int64_t *out);

#endif
