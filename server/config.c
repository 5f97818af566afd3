/*
 * config.c: the flag table of `specd serve` and the machinery it drives
 * (defaults, SPECD_* environment, argv, --help, JSON introspection). See
 * config.h for the precedence and ownership rules.
 *
 * Invariant: a field is only ever written by cfg_set_value, so every source
 * gets identical parsing and bounds. Threading: main thread, before serving.
 */
#include "server/config.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define OFF(f) offsetof(specd_config, f)
#define NOB 1, 0 /* no bounds */
/* "--port 7" but "SPECD_PORT=7" */
#define SEP(src) ((src)[0] && (src)[strlen(src) - 1] == '=' ? "" : " ")

/* ==== the serve table ==== */
const cfg_option specd_serve_options[] = {
    {"host", CFG_STR, "127.0.0.1", NOB, OFF(host), 0, NULL, "address to bind (0.0.0.0 for all interfaces)"},
    {"port", CFG_INT, "8000", 1, 65535, OFF(port), 0, NULL, "TCP port"},
    {"api-key", CFG_STR, NULL, NOB, OFF(api_key), CFG_SECRET, NULL,
     "require 'Authorization: Bearer KEY' on /v1/* and /tokenize, /detokenize"},
    {"api-key-file", CFG_STR, NULL, NOB, OFF(api_key_file), 0, NULL,
     "read the API key from this file (first line); re-read on SIGHUP"},
    {"served-model-name", CFG_STR, NULL, NOB, OFF(served_model_name), 0, NULL,
     "model name clients must send (default: the model file's base name)"},
    {"max-model-len", CFG_INT, "0", 0, 1 << 24, OFF(max_model_len), CFG_ENGINE, NULL,
     "prompt + generated tokens per sequence (0 = the model's trained context)"},
    {"max-num-seqs", CFG_INT, "64", 1, 4096, OFF(max_num_seqs), CFG_ENGINE, NULL, "sequences running in one step"},
    {"max-num-batched-tokens", CFG_INT, "2048", 1, 1 << 20, OFF(max_num_batched_tokens), CFG_ENGINE, NULL,
     "token budget of one step (prefill is chunked to fit)"},
    {"max-waiting", CFG_INT, "1024", 0, 1 << 20, OFF(max_waiting), CFG_ENGINE, NULL,
     "waiting-queue bound in sequences (0 = unbounded); beyond it 429 with Retry-After; a request needing more than the bound alone (n x prompts) is a 400"},
    {"max-queue-time", CFG_DOUBLE, "0", 0, 86400, OFF(max_queue_time), CFG_ENGINE, NULL,
     "seconds a request may wait in the queue before it starts; past it, 503 (0 = no limit)"},
    {"block-size", CFG_INT, "16", 1, 1024, OFF(block_size), CFG_ENGINE, NULL, "KV cache tokens per block"},
    {"enable-prefix-caching", CFG_BOOL, "false", NOB, OFF(enable_prefix_caching), CFG_ENGINE, NULL,
     "reuse full KV blocks across requests (SHA-256 keyed, LRU eviction)"},
    {"kv-cache-memory", CFG_BYTES, "1G", 1 << 20, 1e15, OFF(kv_cache_memory), CFG_ENGINE, NULL,
     "KV cache budget in bytes (suffixes K, M, G, T; binary)"},
    {"shutdown-timeout", CFG_DOUBLE, "30", 0, 86400, OFF(shutdown_timeout), 0, NULL,
     "seconds in-flight requests may run after SIGTERM before they are aborted"},
    {"max-body-bytes", CFG_BYTES, "8M", 1024, 1 << 30, OFF(max_body_bytes), 0, NULL,
     "largest request body accepted (413 beyond)"},
    {"max-connections", CFG_INT, "512", 1, 65536, OFF(max_connections), 0, NULL, "open HTTP connections"},
    {"per-ip-connections", CFG_INT, "256", 0, 65536, OFF(per_ip_connections), 0, NULL,
     "open HTTP connections per client address (0 = no limit)"},
    {"connection-timeout", CFG_INT, "300", 0, 86400, OFF(connection_timeout), 0, NULL,
     "seconds an idle connection is kept (0 = forever)"},
    {"http-threads", CFG_INT, "4", 1, 256, OFF(http_threads), 0, NULL, "HTTP polling threads"},
    {"threads", CFG_INT, "0", 0, 1024, OFF(threads), CFG_ENGINE, NULL, "CPU compute threads (0 = all cores)"},
    {"load-threads", CFG_INT, "0", 0, 64, OFF(load_threads), CFG_ENGINE, NULL,
     "threads each rank reads its byte ranges of a safetensors checkpoint with (0 = min(8, cores); vLLM: "
     "--model-loader-extra-config '{\"num_threads\": N}'; docs/kimi-k2.5.md \"Loading at scale\")"},
    {"tensor-parallel-size", CFG_INT, "1", 1, 64, OFF(tensor_parallel_size), CFG_ENGINE, NULL,
     "ranks the target is split across (Megatron layout; each rank a process of this binary with --threads "
     "threads; rank 0 serves HTTP; docs/engine.md)"},
    {"enable-expert-parallel", CFG_BOOL, "false", NOB, OFF(enable_expert_parallel), CFG_ENGINE, NULL,
     "with --tensor-parallel-size N on a DeepSeek-V3 / Kimi model: the routed experts split across the ranks "
     "whole (rank r holds experts r E/N .. (r+1) E/N - 1 and reads only their bytes) instead of 1/N of every "
     "expert; attention, dense MLP and shared expert stay tensor-parallel (vLLM's flag; docs/kimi-k2.5.md "
     "\"Expert parallelism\")"},
    {"device", CFG_STR, "auto", NOB, OFF(device), CFG_ENGINE, "auto|cpu|cuda",
     "compute device: auto = cuda when a usable GPU is found and the model runs there, else cpu (one log line "
     "says why); cuda refuses to start without one"},
    {"tp-comm", CFG_STR, "auto", NOB, OFF(tp_comm), CFG_ENGINE, "auto|shm|cuda_ipc|nccl",
     "tensor parallelism on GPUs: the all-reduce / all-gather between ranks: cuda_ipc (fixed rank order, "
     "deterministic; ranks may share a GPU), shm (host staging, deterministic, slow), nccl (not deterministic); "
     "auto = cuda_ipc on one host, shm on the cpu backend (docs/engine.md)"},
    {"gpu-memory-utilization", CFG_DOUBLE, "0.9", 0.05, 1.0, OFF(gpu_memory_utilization), CFG_ENGINE, NULL,
     "cuda: fraction of the GPU's total memory this process may use (weights + workspace + KV cache; the KV "
     "cache gets what the weights and workspace leave, and --kv-cache-memory is ignored)"},
    {"enforce-eager", CFG_BOOL, "false", NOB, OFF(enforce_eager), CFG_ENGINE, NULL,
     "cuda: no CUDA graphs, every step launched op by op (vLLM's meaning)"},
    {"cuda-graph-sizes", CFG_STR, NULL, NOB, OFF(cuda_graph_sizes), CFG_ENGINE, NULL,
     "cuda: batch buckets (sequences) captured as CUDA graphs, comma-separated ascending, e.g. 1,2,4,8; "
     "default 1,2,4,8,16,32,... up to --max-num-seqs (docs/engine.md \"CUDA graphs\")"},
    {"speculative-config", CFG_STR, NULL, NOB, OFF(speculative_config), CFG_ENGINE, NULL,
     "vLLM-style JSON: {\"method\":\"eagle3\",\"model\":DIR,\"num_speculative_tokens\":K,\"adaptive\":true}"},
    {"draft", CFG_STR, NULL, NOB, OFF(draft), CFG_ENGINE, NULL, "EAGLE-3 draft head directory (same as speculative-config model)"},
    {"num-speculative-tokens", CFG_INT, "-1", -1, 16, OFF(num_speculative_tokens), CFG_ENGINE, NULL,
     "draft tokens per step k (default 3 with a draft); with adaptive speculation the most per step"},
    {"speculative-adaptive", CFG_BOOL, "true", NOB, OFF(speculative_adaptive), CFG_ENGINE, NULL,
     "choose the drafts per step (0..k) for each sequence from its acceptance and the measured draft / verify costs "
     "(docs/draft.md); --no-speculative-adaptive (or \"adaptive\": false in --speculative-config): always k"},
    {"draft-aux-convention", CFG_STR, "auto", NOB, OFF(draft_aux_convention), CFG_ENGINE, "auto|input|output",
     "how the head's explicit aux layer ids are read: input = residual entering layer i (vLLM), output = leaving "
     "layer i (SGLang/SpecForge eagle_config), auto = by the key's place (docs/draft.md)"},
    {"draft-quantization", CFG_STR, "none", NOB, OFF(draft_quantization), CFG_ENGINE, "none|q8_0",
     "re-quantize the draft head's float (f32/bf16/f16) matrices at load: q8_0 = ggml Q8_0 blocks (less memory traffic and the "
     "integer kernels on the CPU; docs/draft.md has its speed and acceptance)"},
    {"speculative-token-map", CFG_STR, NULL, NOB, OFF(speculative_token_map), CFG_ENGINE, NULL,
     "hot draft vocabulary (FR-Spec; SGLang's name): a `specd vocab build` map (directory or .safetensors); the draft "
     "scores only its ids that are in it (smaller draft lm_head; still lossless; docs/draft.md)"},
    {"check-config", CFG_BOOL, "false", NOB, OFF(check_config), CFG_NOENV, NULL,
     "validate flags, files and the model/draft pairing, then exit without serving"},
    {"log-level", CFG_STR, "info", NOB, OFF(log_level), CFG_ENGINE, "debug|info|warn|error", "log verbosity"},
};
const size_t specd_serve_n_options = sizeof specd_serve_options / sizeof specd_serve_options[0];

void specd_config_table(specd_config *c, cfg_table *out) {
    out->title = "serve options";
    out->opts = specd_serve_options;
    out->n_opts = specd_serve_n_options;
    out->base = c;
    out->require = 0;
}

void specd_config_free(specd_config *c) {
    if (!c) return;
    cfg_table t;
    specd_config_table(c, &t);
    cfg_free(&t, 1);
}

/* ==== typed values ==== */
void cfg_env_name(const char *name, char *buf, size_t cap) {
    size_t n = 0;
    const char *pre = "SPECD_";
    for (const char *p = pre; *p && n + 1 < cap; p++) buf[n++] = *p;
    for (const char *p = name; *p && n + 1 < cap; p++) buf[n++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    buf[n] = 0;
}

int cfg_parse_bytes(const char *s, int64_t *out) {
    if (!s || !*s) return -1;
    errno = 0;
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || errno || !isfinite(v) || v < 0) return -1;
    while (*end == ' ') end++;
    double mul = 1;
    switch (toupper((unsigned char)*end)) {
    case 0: break;
    case 'B': mul = 1; end++; break;
    case 'K': mul = 1024.0; end++; break;
    case 'M': mul = 1024.0 * 1024; end++; break;
    case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: return -1;
    }
    if (mul > 1) {
        if (*end == 'i' || *end == 'I') end++;
        if (*end == 'B' || *end == 'b') end++;
    }
    if (*end) return -1;
    double b = v * mul;
    if (b > 9.0e18) return -1;
    *out = (int64_t)llround(b);
    return 0;
}

static int parse_bool(const char *s, bool *out) {
    static const char *yes[] = {"1", "true", "yes", "on"}, *no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < 4; i++) {
        if (!strcasecmp(s, yes[i])) return *out = true, 0;
        if (!strcasecmp(s, no[i])) return *out = false, 0;
    }
    return -1;
}

static int check_bounds(const cfg_option *o, double v, const char *source, const char *value, specd_err *err) {
    if (o->min > o->max) return 0;
    if (v < o->min)
        return specd_err_set(err, "%s%s%s: below the minimum %.15g of --%s", source, SEP(source), value, o->min, o->name);
    if (v > o->max)
        return specd_err_set(err, "%s%s%s: above the maximum %.15g of --%s", source, SEP(source), value, o->max, o->name);
    return 0;
}

int cfg_set_value(const cfg_option *o, void *base, const char *value, const char *source, specd_err *err) {
    char *field = (char *)base + o->offset;
    const char *shown = (o->flags & CFG_SECRET) ? "(secret)" : value;
    if (!value) return specd_err_set(err, "%s: --%s needs a value", source, o->name);
    switch (o->type) {
    case CFG_STR: {
        if (o->choices) {
            /* value must be one of "a|b|c" */
            size_t vl = strlen(value);
            const char *c = o->choices;
            bool ok = false;
            while (*c) {
                const char *bar = strchr(c, '|');
                size_t cl = bar ? (size_t)(bar - c) : strlen(c);
                if (cl == vl && !strncmp(c, value, vl)) ok = true;
                c += cl + (bar ? 1 : 0);
            }
            if (!ok) return specd_err_set(err, "%s%s%s: --%s must be one of %s", source, SEP(source), shown, o->name, o->choices);
        }
        char *dup = strdup(value);
        if (!dup) return specd_err_set(err, "out of memory");
        free(*(char **)field);
        *(char **)field = dup;
        return 0;
    }
    case CFG_INT:
    case CFG_I64: {
        errno = 0;
        char *end = NULL;
        long long v = strtoll(value, &end, 10);
        if (!*value || *end || errno) return specd_err_set(err, "%s%s%s: --%s is not an integer", source, SEP(source), shown, o->name);
        if (check_bounds(o, (double)v, source, shown, err)) return -1;
        if (o->type == CFG_INT) {
            if (v < INT32_MIN || v > INT32_MAX) return specd_err_set(err, "%s%s%s: out of range", source, SEP(source), shown);
            *(int32_t *)field = (int32_t)v;
        } else {
            *(int64_t *)field = (int64_t)v;
        }
        return 0;
    }
    case CFG_BYTES: {
        int64_t b;
        if (cfg_parse_bytes(value, &b))
            return specd_err_set(err, "%s%s%s: --%s is not a byte size (e.g. 512M, 4G)", source, SEP(source), shown, o->name);
        if (check_bounds(o, (double)b, source, shown, err)) return -1;
        *(int64_t *)field = b;
        return 0;
    }
    case CFG_DOUBLE: {
        errno = 0;
        char *end = NULL;
        double v = strtod(value, &end);
        if (!*value || *end || errno || !isfinite(v))
            return specd_err_set(err, "%s%s%s: --%s is not a number", source, SEP(source), shown, o->name);
        if (check_bounds(o, v, source, shown, err)) return -1;
        *(double *)field = v;
        return 0;
    }
    case CFG_BOOL: {
        bool b;
        if (parse_bool(value, &b))
            return specd_err_set(err, "%s%s%s: --%s expects true/false, 1/0, yes/no or on/off", source, SEP(source), shown, o->name);
        *(bool *)field = b;
        return 0;
    }
    }
    return specd_err_set(err, "--%s: unknown option type", o->name);
}

int cfg_defaults(const cfg_table *t, size_t n_tables, specd_err *err) {
    for (size_t ti = 0; ti < n_tables; ti++) {
        for (size_t i = 0; i < t[ti].n_opts; i++) {
            const cfg_option *o = &t[ti].opts[i];
            char *field = (char *)t[ti].base + o->offset;
            if (o->type == CFG_STR) {
                free(*(char **)field);
                *(char **)field = NULL;
            }
            if (o->def && cfg_set_value(o, t[ti].base, o->def, "default", err)) return -1;
        }
    }
    return 0;
}

bool cfg_visible(const cfg_table *t, const cfg_option *o) { return (o->flags & t->require) == t->require; }

static const char *real_getenv(const char *n) { return getenv(n); }

int cfg_apply_env(const cfg_table *t, size_t n_tables, const char *(*getenv_fn)(const char *), specd_err *err) {
    if (!getenv_fn) getenv_fn = real_getenv;
    for (size_t ti = 0; ti < n_tables; ti++) {
        for (size_t i = 0; i < t[ti].n_opts; i++) {
            const cfg_option *o = &t[ti].opts[i];
            if ((o->flags & CFG_NOENV) || !cfg_visible(&t[ti], o)) continue;
            char name[128];
            cfg_env_name(o->name, name, sizeof name);
            const char *v = getenv_fn(name);
            if (!v) continue;
            char source[160];
            snprintf(source, sizeof source, "%s=", name);
            if (cfg_set_value(o, t[ti].base, v, source, err)) return -1;
        }
    }
    return 0;
}

static const cfg_option *find_opt(const cfg_table *t, size_t n_tables, const char *name, size_t len, void **base) {
    for (size_t ti = 0; ti < n_tables; ti++)
        for (size_t i = 0; i < t[ti].n_opts; i++)
            if (strlen(t[ti].opts[i].name) == len && !strncmp(t[ti].opts[i].name, name, len) &&
                cfg_visible(&t[ti], &t[ti].opts[i])) {
                *base = t[ti].base;
                return &t[ti].opts[i];
            }
    return NULL;
}

int cfg_parse_args(const cfg_table *t, size_t n_tables, int argc, char **argv, const char **positional,
                   size_t max_pos, size_t *n_pos, bool *help, specd_err *err) {
    *n_pos = 0;
    if (help) *help = false;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            if (help) *help = true;
            continue;
        }
        if (strncmp(a, "--", 2) != 0 || a[2] == 0) {
            if (*n_pos >= max_pos) return specd_err_set(err, "unexpected argument '%s'", a);
            positional[(*n_pos)++] = a;
            continue;
        }
        const char *name = a + 2;
        const char *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        void *base = NULL;
        const cfg_option *o = find_opt(t, n_tables, name, len, &base);
        bool negated = false;
        if (!o && len > 3 && !strncmp(name, "no-", 3)) {
            o = find_opt(t, n_tables, name + 3, len - 3, &base);
            if (o && o->type != CFG_BOOL) o = NULL;
            negated = o != NULL;
        }
        if (!o) return specd_err_set(err, "unknown option '--%.*s' (see --help)", (int)len, name);
        char source[160];
        snprintf(source, sizeof source, "--%s", o->name);
        const char *value;
        if (o->type == CFG_BOOL && !eq) {
            value = negated ? "false" : "true";
        } else if (eq) {
            if (negated) return specd_err_set(err, "--no-%s takes no value", o->name);
            value = eq + 1;
        } else {
            if (i + 1 >= argc) return specd_err_set(err, "--%s needs a value", o->name);
            value = argv[++i];
        }
        if (cfg_set_value(o, base, value, source, err)) return -1;
    }
    return 0;
}

void cfg_free(const cfg_table *t, size_t n_tables) {
    for (size_t ti = 0; ti < n_tables; ti++)
        for (size_t i = 0; i < t[ti].n_opts; i++)
            if (t[ti].opts[i].type == CFG_STR) {
                char **f = (char **)((char *)t[ti].base + t[ti].opts[i].offset);
                free(*f);
                *f = NULL;
            }
}

static const char *type_meta(const cfg_option *o) {
    switch (o->type) {
    case CFG_STR: return o->choices ? o->choices : "TEXT";
    case CFG_INT:
    case CFG_I64: return "N";
    case CFG_BYTES: return "BYTES";
    case CFG_DOUBLE: return "NUM";
    case CFG_BOOL: return "";
    }
    return "";
}

void cfg_print_help(FILE *f, const cfg_table *t, size_t n_tables) {
    for (size_t ti = 0; ti < n_tables; ti++) {
        fprintf(f, "\n%s:\n", t[ti].title);
        for (size_t i = 0; i < t[ti].n_opts; i++) {
            const cfg_option *o = &t[ti].opts[i];
            if (!cfg_visible(&t[ti], o)) continue;
            char head[96];
            snprintf(head, sizeof head, "--%s %s", o->name, type_meta(o));
            fprintf(f, "  %-36s %s", head, o->help);
            if (o->def && !(o->flags & CFG_SECRET)) fprintf(f, " [default: %s]", o->def);
            if (o->min <= o->max && o->type != CFG_BOOL) fprintf(f, " [%.15g..%.15g]", o->min, o->max);
            if (!(o->flags & CFG_NOENV)) {
                char env[128];
                cfg_env_name(o->name, env, sizeof env);
                fprintf(f, " [env: %s]", env);
            }
            fputc('\n', f);
        }
    }
}

char *cfg_to_json(const cfg_table *t, size_t n_tables) {
    json_t *obj = json_object();
    if (!obj) return NULL;
    for (size_t ti = 0; ti < n_tables; ti++) {
        for (size_t i = 0; i < t[ti].n_opts; i++) {
            const cfg_option *o = &t[ti].opts[i];
            const char *field = (const char *)t[ti].base + o->offset;
            char key[96];
            size_t k = 0;
            for (const char *p = o->name; *p && k + 5 < sizeof key; p++) key[k++] = *p == '-' ? '_' : *p;
            key[k] = 0;
            json_t *v = NULL;
            if (o->flags & CFG_SECRET) {
                strcat(key, "_set");
                v = json_boolean(*(char *const *)field != NULL);
            } else {
                switch (o->type) {
                case CFG_STR: {
                    const char *s = *(char *const *)field;
                    v = s ? json_string(s) : json_null();
                    if (!v) v = json_null(); /* not UTF-8: shown as null rather than failing */
                    break;
                }
                case CFG_INT: v = json_integer(*(const int32_t *)field); break;
                case CFG_I64:
                case CFG_BYTES: v = json_integer(*(const int64_t *)field); break;
                case CFG_DOUBLE: v = json_real(*(const double *)field); break;
                case CFG_BOOL: v = json_boolean(*(const bool *)field); break;
                }
            }
            json_object_set_new(obj, key, v);
        }
    }
    char *s = json_dumps(obj, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(obj);
    return s;
}

/* ==== cross-flag resolution ==== */
void specd_spec_free(specd_spec *s) {
    if (!s) return;
    free(s->model);
    memset(s, 0, sizeof *s);
}

int specd_config_graph_sizes(const specd_config *c, int32_t *out, int cap, specd_err *err) {
    int n = 0;
    const int32_t S = c->max_num_seqs;
    if (c->cuda_graph_sizes) {
        const char *p = c->cuda_graph_sizes;
        for (;;) {
            char *end = NULL;
            errno = 0;
            const long v = *p >= '0' && *p <= '9' ? strtol(p, &end, 10) : -1;
            if (v < 0 || errno || (*end && *end != ','))
                return specd_err_set(err, "--cuda-graph-sizes %s: comma-separated integers (e.g. 1,2,4,8)",
                                     c->cuda_graph_sizes);
            if (v < 1 || v > S || (n && v <= out[n - 1]) || n == cap)
                return specd_err_set(err, "--cuda-graph-sizes %s: ascending sequence counts in [1, --max-num-seqs %d], "
                                          "at most %d", c->cuda_graph_sizes, S, cap);
            out[n++] = (int32_t)v;
            if (!*end) break;
            p = end + 1;
        }
        return n;
    }
    if (S < 1 || cap < 1) return specd_err_set(err, "--max-num-seqs %d: no CUDA graph bucket", S);
    for (int32_t b = 1; b < S && n < cap - 1; b *= 2) out[n++] = b;
    out[n++] = S;
    return n;
}

int specd_config_resolve(const specd_config *c, specd_spec *spec, specd_err *err) {
    memset(spec, 0, sizeof *spec);
    if (c->api_key && c->api_key_file) return specd_err_set(err, "--api-key and --api-key-file are exclusive");
    if (c->api_key && !*c->api_key) return specd_err_set(err, "--api-key is empty");
    int32_t buckets[32];
    if (c->cuda_graph_sizes && c->enforce_eager) /* a bucket list nothing would capture: refused, not ignored */
        return specd_err_set(err, "--cuda-graph-sizes %s and --enforce-eager contradict each other (eager steps "
                                  "capture no CUDA graphs; drop one)", c->cuda_graph_sizes);
    if (c->cuda_graph_sizes && specd_config_graph_sizes(c, buckets, 32, err) < 0) return -1;
    /* device collectives on a host backend: refused here, so --check-config says what serve would (serve
     * refused it only once the ranks had started) */
    if (c->device && !strcmp(c->device, "cpu") && c->tp_comm &&
        (!strcmp(c->tp_comm, "cuda_ipc") || !strcmp(c->tp_comm, "nccl")))
        return specd_err_set(err, "--tp-comm %s needs a GPU backend, and --device cpu is none (the cpu backend's "
                                  "tensors are host memory: use shm or auto)", c->tp_comm);
    int32_t k = -1;
    bool json_adaptive = true;
    if (c->speculative_config) {
        json_error_t je;
        json_t *j = json_loads(c->speculative_config, 0, &je);
        if (!j || !json_is_object(j)) {
            json_decref(j);
            return specd_err_set(err, "--speculative-config: not a JSON object (%s)", j ? "wrong type" : je.text);
        }
        const char *key;
        json_t *val;
        int rc = 0;
        json_object_foreach(j, key, val) {
            if (!strcmp(key, "method")) {
                if (!json_is_string(val) ||
                    (strcmp(json_string_value(val), "eagle3") && strcmp(json_string_value(val), "eagle"))) {
                    rc = specd_err_set(err, "--speculative-config: method must be \"eagle3\" or \"eagle\"");
                    break;
                }
                snprintf(spec->method, sizeof spec->method, "%s", json_string_value(val));
            } else if (!strcmp(key, "model")) {
                if (!json_is_string(val) || !*json_string_value(val)) {
                    rc = specd_err_set(err, "--speculative-config: model must be a non-empty string");
                    break;
                }
                free(spec->model);
                spec->model = strdup(json_string_value(val));
            } else if (!strcmp(key, "num_speculative_tokens")) {
                if (!json_is_integer(val) || json_integer_value(val) < 1 || json_integer_value(val) > 16) {
                    rc = specd_err_set(err, "--speculative-config: num_speculative_tokens must be an integer in [1, 16]");
                    break;
                }
                k = (int32_t)json_integer_value(val);
            } else if (!strcmp(key, "adaptive")) {
                if (!json_is_boolean(val)) {
                    rc = specd_err_set(err, "--speculative-config: adaptive must be true or false");
                    break;
                }
                json_adaptive = json_is_true(val);
            } else {
                rc = specd_err_set(err, "--speculative-config: unknown key \"%s\"", key);
                break;
            }
        }
        json_decref(j);
        if (rc) goto fail;
        if (!spec->model) {
            specd_err_set(err, "--speculative-config: \"model\" (the draft directory) is required");
            goto fail;
        }
        if (!spec->method[0]) snprintf(spec->method, sizeof spec->method, "eagle3");
        if (c->draft && strcmp(c->draft, spec->model)) {
            specd_err_set(err, "--draft %s disagrees with --speculative-config model %s", c->draft, spec->model);
            goto fail;
        }
        if (c->num_speculative_tokens >= 0 && k >= 0 && c->num_speculative_tokens != k) {
            specd_err_set(err, "--num-speculative-tokens %d disagrees with --speculative-config num_speculative_tokens %d",
                          c->num_speculative_tokens, k);
            goto fail;
        }
    } else if (c->draft) {
        spec->model = strdup(c->draft);
        snprintf(spec->method, sizeof spec->method, "eagle3");
    }
    if (c->num_speculative_tokens >= 0) {
        if (c->num_speculative_tokens > 0 && !spec->model) {
            specd_err_set(err, "--num-speculative-tokens %d needs a draft (--draft or --speculative-config)",
                          c->num_speculative_tokens);
            goto fail;
        }
        k = c->num_speculative_tokens;
    }
    if (spec->model) {
        if (k < 0) k = 3;
        spec->k = k;
        spec->enabled = k > 0;
        spec->adaptive = json_adaptive && c->speculative_adaptive;
    }
    return 0;
fail:
    specd_spec_free(spec);
    return -1;
}
