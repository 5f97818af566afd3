/*
 * main.c: the specd-bench command line.
 *
 * Owns the flag table (one declaration drives parsing, defaults and --help;
 * flags are named as in vLLM's `bench serve` wherever it has one) and the
 * order of a benchmark: load the workload, resolve the model, warm up, then
 * for each concurrency level snapshot GET /metrics, run, snapshot again,
 * compute and print the metrics; finally save the result JSON and the plots.
 * --compare FILE FILE... instead reads result files and prints ratios.
 * Exit status: 0 when the benchmark ran (even with failed requests, which are
 * reported), 1 on a usage or setup error, 2 when every request failed.
 */
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/client.h"
#include "bench/dataset.h"
#include "bench/prom.h"
#include "bench/report.h"
#include "bench/results.h"

/* ---- configuration -------------------------------------------------------------- */

typedef struct cli {
    char *base_url, *host, *endpoint, *backend, *model, *dataset_name, *dataset_path;
    long num_prompts, max_tokens, num_warmups, random_input_len, random_output_len, port;
    double random_range_ratio, temperature, request_rate, burstiness, request_timeout;
    long max_concurrency;
    char *sweep_concurrency;
    long seed;
    int ignore_eos, save_result, save_detailed, help;
    char *result_dir, *result_filename, *percentile_metrics, *metric_percentiles;
    char *plot_dir, *server_cmd, *label, *extra_body, *metrics_path, *compare_format, *tokenize_path;
} cli;

typedef enum { T_STR, T_LONG, T_DBL, T_FLAG } opt_type;

typedef struct opt {
    const char *name;
    opt_type type;
    size_t off;
    const char *def; /* default as text; NULL = unset */
    const char *help;
} opt;

#define O(f) offsetof(cli, f)
static const opt OPTS[] = {
    {"--base-url", T_STR, O(base_url), NULL, "server root URL; overrides --host/--port"},
    {"--host", T_STR, O(host), "127.0.0.1", "server host"},
    {"--port", T_LONG, O(port), "8000", "server port"},
    {"--endpoint", T_STR, O(endpoint), NULL, "API path [/v1/completions; /v1/chat/completions for openai-chat]"},
    {"--backend", T_STR, O(backend), "openai", "openai | vllm (completions) or openai-chat (chat), as in vLLM"},
    {"--model", T_STR, O(model), NULL, "model name sent in requests (default: first of GET /v1/models)"},
    {"--dataset-name", T_STR, O(dataset_name), "random", "mt-bench | gsm8k | humaneval | jsonl | random"},
    {"--dataset-path", T_STR, O(dataset_path), NULL, "JSONL file (.gz allowed) for file datasets"},
    {"--num-prompts", T_LONG, O(num_prompts), "1000", "requests to send (file prompts wrap around)"},
    {"--max-tokens", T_LONG, O(max_tokens), NULL, "max_tokens of every request (default: the dataset's, else 128)"},
    {"--random-input-len", T_LONG, O(random_input_len), "1024", "random workload: input length (~tokens)"},
    {"--random-output-len", T_LONG, O(random_output_len), "128", "random workload: output length (tokens)"},
    {"--random-range-ratio", T_DBL, O(random_range_ratio), "0", "lengths uniform in [len*(1-r), len*(1+r)]"},
    {"--ignore-eos", T_FLAG, O(ignore_eos), NULL, "send ignore_eos: true (vLLM extension)"},
    {"--temperature", T_DBL, O(temperature), "0", "sampling temperature (0 = greedy)"},
    {"--num-warmups", T_LONG, O(num_warmups), "0", "warm-up requests before measuring (not recorded)"},
    {"--request-rate", T_DBL, O(request_rate), "inf", "requests/s (gamma arrivals); inf = all at once"},
    {"--burstiness", T_DBL, O(burstiness), "1.0", "gamma shape of arrival gaps; 1 = Poisson"},
    {"--max-concurrency", T_LONG, O(max_concurrency), "0", "most requests in flight; 0 = unlimited"},
    {"--sweep-concurrency", T_STR, O(sweep_concurrency), NULL, "comma list, e.g. 1,2,4,8: one run per level"},
    {"--seed", T_LONG, O(seed), "0", "seed of the random workload and the arrival times"},
    {"--request-timeout", T_DBL, O(request_timeout), "3600", "per-request limit in seconds"},
    {"--extra-body", T_STR, O(extra_body), NULL, "JSON object merged into every request body"},
    {"--tokenize-fallback", T_STR, O(tokenize_path), NULL,
     "for servers that stream no usage: count tokens via this tokenize path (e.g. /extras/tokenize)"},
    {"--percentile-metrics", T_STR, O(percentile_metrics), "ttft,tpot,itl,e2el", "latency blocks printed"},
    {"--metric-percentiles", T_STR, O(metric_percentiles), "90,99", "percentiles reported, e.g. 25,50,99"},
    {"--metrics-path", T_STR, O(metrics_path), "/metrics", "Prometheus path for spec-decode counters; '' = off"},
    {"--save-result", T_FLAG, O(save_result), NULL, "write the result JSON"},
    {"--save-detailed", T_FLAG, O(save_detailed), NULL, "also keep generated texts in the result"},
    {"--result-dir", T_STR, O(result_dir), ".", "folder of the result JSON"},
    {"--result-filename", T_STR, O(result_filename), NULL, "result JSON name (default: derived from the run)"},
    {"--label", T_STR, O(label), NULL, "name of this run in comparisons and plots"},
    {"--server-cmd", T_STR, O(server_cmd), NULL, "server command line to record (env SPECD_BENCH_SERVER_CMD)"},
    {"--plot-dir", T_STR, O(plot_dir), NULL, "write PNG plots (gnuplot) into this folder"},
    {"--compare-format", T_STR, O(compare_format), "text", "--compare output: text | markdown"},
    {"--help", T_FLAG, O(help), NULL, "this text"},
};
#define N_OPTS (sizeof OPTS / sizeof OPTS[0])

static void usage(FILE *f) {
    fprintf(f, "usage: specd-bench [options]\n"
               "       specd-bench --compare RESULT.json RESULT.json... [--plot-dir DIR] [--compare-format markdown]\n\n"
               "Serving benchmark for OpenAI-compatible servers (conventions of vLLM's bench serve).\n"
               "Requests stream; tokens are counted from usage; spec-decode figures come from /metrics.\n\n");
    for (size_t i = 0; i < N_OPTS; i++) {
        const char *arg = OPTS[i].type == T_FLAG ? "" : OPTS[i].type == T_STR ? " S" : " N";
        char left[64];
        snprintf(left, sizeof left, "%s%s", OPTS[i].name, arg);
        fprintf(f, "  %-26s %s", left, OPTS[i].help);
        if (OPTS[i].def) fprintf(f, " [%s]", OPTS[i].def);
        fputc('\n', f);
    }
    fprintf(f, "  %-26s %s\n", "--compare F1 F2...", "print metrics of result files with ratios to F1");
}

static int set_opt(cli *c, const opt *o, const char *val) {
    char *base = (char *)c + o->off, *end;
    switch (o->type) {
    case T_STR: *(char **)base = (char *)val; return 0;
    case T_FLAG: *(int *)base = 1; return 0;
    case T_LONG:
        errno = 0;
        *(long *)base = strtol(val, &end, 10);
        return errno || *end ? -1 : 0;
    case T_DBL:
        *(double *)base = strtod(val, &end);
        return *end ? -1 : 0;
    }
    return -1;
}

/* Parses argv; file arguments of --compare go to *cmp. Returns 0 or -1. */
static int parse_args(int argc, char **argv, cli *c, char ***cmp, size_t *n_cmp) {
    memset(c, 0, sizeof *c);
    for (size_t i = 0; i < N_OPTS; i++)
        if (OPTS[i].def && set_opt(c, &OPTS[i], OPTS[i].def)) return -1;
    *cmp = NULL;
    *n_cmp = 0;
    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a], *val = NULL;
        char name[64];
        const char *eq = strchr(arg, '=');
        if (eq && (size_t)(eq - arg) < sizeof name) {
            snprintf(name, sizeof name, "%.*s", (int)(eq - arg), arg);
            val = eq + 1;
        } else {
            snprintf(name, sizeof name, "%s", arg);
        }
        if (strcmp(name, "-h") == 0) strcpy(name, "--help");
        if (strcmp(name, "--compare") == 0) {
            *cmp = &argv[a + 1];
            while (a + 1 < argc && strncmp(argv[a + 1], "--", 2) != 0) {
                a++;
                (*n_cmp)++;
            }
            if (*n_cmp < 1) {
                fprintf(stderr, "specd-bench: --compare needs result files\n");
                return -1;
            }
            continue;
        }
        const opt *o = NULL;
        for (size_t i = 0; i < N_OPTS && !o; i++)
            if (strcmp(OPTS[i].name, name) == 0) o = &OPTS[i];
        if (!o) {
            fprintf(stderr, "specd-bench: unknown option '%s' (see --help)\n", arg);
            return -1;
        }
        if (o->type != T_FLAG && !val) {
            if (a + 1 >= argc) {
                fprintf(stderr, "specd-bench: %s needs a value\n", name);
                return -1;
            }
            val = argv[++a];
        }
        if (set_opt(c, o, val ? val : "")) {
            fprintf(stderr, "specd-bench: bad value '%s' for %s\n", val, name);
            return -1;
        }
    }
    return 0;
}

/* Parses a comma list of numbers. Returns the count or -1. */
static int parse_list(const char *s, double *out, int cap) {
    int n = 0;
    for (const char *p = s; p && *p;) {
        char *end;
        double v = strtod(p, &end);
        if (end == p || n >= cap) return -1;
        out[n++] = v;
        p = *end == ',' ? end + 1 : (*end ? NULL : end);
        if (!p) return -1;
    }
    return n;
}

/* ---- helpers around the server ------------------------------------------------------ */

/* GET /v1/models and take the first id. Returns a new string or NULL. */
static char *first_model(const char *base_url) {
    char *body = NULL;
    long status;
    specd_err err = {{0}};
    if (bench_http_get(base_url, "/v1/models", 30, &body, NULL, &status, &err) || status != 200) {
        free(body);
        return NULL;
    }
    json_t *o = json_loads(body, 0, NULL);
    free(body);
    const char *id = json_string_value(json_object_get(json_array_get(json_object_get(o, "data"), 0), "id"));
    char *r = id ? strdup(id) : NULL;
    json_decref(o);
    return r;
}

/* Snapshot of the server counters; 0 when /metrics was read and parsed. */
static int snapshot(const char *base_url, const char *path, bench_spec_counters *c) {
    if (!path || !*path) return -1;
    char *body = NULL;
    size_t len;
    long status;
    specd_err err = {{0}};
    if (bench_http_get(base_url, path, 30, &body, &len, &status, &err) || status != 200) {
        free(body);
        return -1;
    }
    bench_prom *p = NULL;
    int rc = bench_prom_parse(body, len, &p, &err);
    free(body);
    if (rc) return -1;
    bench_spec_from_prom(p, c);
    bench_prom_destroy(p);
    return 0;
}

static void default_filename(const cli *c, const char *model, double maxc_first, int sweep, char *buf, size_t cap) {
    char ts[32], m[128];
    time_t now = time(NULL);
    strftime(ts, sizeof ts, "%Y%m%d-%H%M%S", localtime(&now));
    const char *slash = strrchr(model, '/');
    snprintf(m, sizeof m, "%s", slash ? slash + 1 : model);
    for (char *p = m; *p; p++)
        if (*p == ' ') *p = '_';
    char rate[32];
    if (isinf(c->request_rate)) snprintf(rate, sizeof rate, "inf");
    else snprintf(rate, sizeof rate, "%g", c->request_rate);
    if (sweep) snprintf(buf, cap, "specd-bench-%sqps-sweep-%s-%s.json", rate, m, ts);
    else if (maxc_first > 0) snprintf(buf, cap, "specd-bench-%sqps-concurrency%g-%s-%s.json", rate, maxc_first, m, ts);
    else snprintf(buf, cap, "specd-bench-%sqps-%s-%s.json", rate, m, ts);
}

/* ---- modes ------------------------------------------------------------------------------ */

static int run_compare(const cli *c, char **files, size_t n) {
    bench_result *r = calloc(n, sizeof *r);
    int rc = 1;
    size_t loaded = 0;
    specd_err err = {{0}};
    if (!r) return 1;
    for (; loaded < n; loaded++)
        if (bench_result_load(files[loaded], &r[loaded], &err)) {
            fprintf(stderr, "specd-bench: %s\n", err.msg);
            goto done;
        }
    bench_compare_print(stdout, r, n, strcmp(c->compare_format, "markdown") == 0);
    if (c->plot_dir && bench_plot(c->plot_dir, r, n, &err)) {
        fprintf(stderr, "specd-bench: plots: %s\n", err.msg);
        goto done;
    }
    rc = 0;
done:
    for (size_t i = 0; i < loaded; i++) bench_result_free(&r[i]);
    free(r);
    return rc;
}

static int run_bench(cli *c) {
    char url[1024];
    if (c->base_url) snprintf(url, sizeof url, "%s", c->base_url);
    else snprintf(url, sizeof url, "http://%s:%ld", c->host, c->port);
    double qs[BENCH_MAX_PERCENTILES], levels[64];
    int n_q = parse_list(c->metric_percentiles, qs, BENCH_MAX_PERCENTILES);
    if (n_q < 0) {
        fprintf(stderr, "specd-bench: bad --metric-percentiles '%s'\n", c->metric_percentiles);
        return 1;
    }
    int n_lvl = 1, sweep = c->sweep_concurrency != NULL;
    levels[0] = (double)c->max_concurrency;
    if (sweep && (n_lvl = parse_list(c->sweep_concurrency, levels, 64)) < 1) {
        fprintf(stderr, "specd-bench: bad --sweep-concurrency '%s'\n", c->sweep_concurrency);
        return 1;
    }
    if (c->num_prompts < 1 || c->max_tokens < 0 || c->num_warmups < 0) {
        fprintf(stderr, "specd-bench: --num-prompts must be >= 1, --max-tokens and --num-warmups >= 0\n");
        return 1;
    }
    if (!c->endpoint) {
        if (!strcmp(c->backend, "openai-chat")) c->endpoint = "/v1/chat/completions";
        else if (!strcmp(c->backend, "openai") || !strcmp(c->backend, "vllm")) c->endpoint = "/v1/completions";
        else {
            fprintf(stderr, "specd-bench: unknown --backend '%s' (openai, openai-chat, vllm)\n", c->backend);
            return 1;
        }
    }
    specd_err err = {{0}};
    bench_dataset_cfg dc = {
        .name = c->dataset_name, .path = c->dataset_path, .num_prompts = (size_t)c->num_prompts,
        .seed = (uint64_t)c->seed, .random_input_len = (int)c->random_input_len,
        .random_output_len = (int)c->random_output_len, .random_range_ratio = c->random_range_ratio};
    bench_dataset *ds = NULL;
    if (bench_dataset_load(&dc, &ds, &err)) {
        fprintf(stderr, "specd-bench: %s\n", err.msg);
        return 1;
    }
    char *model = c->model ? strdup(c->model) : first_model(url);
    if (!model) {
        fprintf(stderr, "specd-bench: no --model and GET %s/v1/models gave none (is the server up?)\n", url);
        bench_dataset_destroy(ds);
        return 1;
    }
    const char *server_cmd = c->server_cmd ? c->server_cmd : getenv("SPECD_BENCH_SERVER_CMD");
    const char *api_key = getenv("OPENAI_API_KEY");
    bench_client_cfg cc = {
        .base_url = url, .endpoint = c->endpoint, .model = model, .api_key = api_key,
        .extra_body = c->extra_body, .max_tokens = (int)c->max_tokens, .temperature = c->temperature,
        .ignore_eos = c->ignore_eos, .request_rate = c->request_rate, .burstiness = c->burstiness,
        .seed = (uint64_t)c->seed, .timeout_s = c->request_timeout, .keep_text = c->save_detailed,
        .tokenize_path = c->tokenize_path};
    int rc = 1;
    json_t *root = json_object(), *sweep_arr = json_array();
    size_t total_ok = 0;

    printf("specd-bench: %s%s model=%s dataset=%s prompts=%ld rate=%g burstiness=%g\n", url, c->endpoint,
           model, c->dataset_name, c->num_prompts, c->request_rate, c->burstiness);
    if (c->num_warmups > 0) {
        bench_dataset_cfg wc = dc;
        wc.num_prompts = (size_t)c->num_warmups;
        bench_dataset *wd = NULL;
        bench_run wr;
        bench_client_cfg w = cc;
        w.request_rate = INFINITY;
        w.max_concurrency = levels[0] > 0 ? (size_t)levels[0] : 0;
        w.keep_text = 0;
        w.quiet = 1;
        printf("Warming up with %ld requests...\n", c->num_warmups);
        if (bench_dataset_load(&wc, &wd, &err) || bench_client_run(&w, wd, wd->n, &wr, &err)) {
            fprintf(stderr, "specd-bench: warm-up: %s\n", err.msg);
            bench_dataset_destroy(wd);
            goto done;
        }
        size_t bad = 0;
        for (size_t i = 0; i < wr.n; i++) bad += !wr.rec[i].success;
        if (bad) fprintf(stderr, "specd-bench: %zu warm-up requests failed (first: %s)\n", bad, wr.rec[0].error ? wr.rec[0].error : "see run");
        bench_run_free(&wr);
        bench_dataset_destroy(wd);
    }
    for (int l = 0; l < n_lvl; l++) {
        cc.max_concurrency = levels[l] > 0 ? (size_t)levels[l] : 0;
        if (sweep) printf("\n--- max concurrency %zu ---\n", cc.max_concurrency);
        bench_spec_counters before, after, diff;
        int have_before = snapshot(url, c->metrics_path, &before) == 0;
        bench_run run;
        if (bench_client_run(&cc, ds, ds->n, &run, &err)) {
            fprintf(stderr, "specd-bench: %s\n", err.msg);
            goto done;
        }
        int have_after = have_before && snapshot(url, c->metrics_path, &after) == 0;
        if (have_after) bench_spec_diff(&after, &before, &diff);
        /* Counters are scraped, not transactional: a server may publish its
         * counters a moment after it sent the last usage chunk. Wait (<= 5 s)
         * until its token counter covers what usage reported. */
        double usage_total = 0;
        for (size_t i = 0; i < run.n; i++) usage_total += run.rec[i].output_tokens > 0 ? (double)run.rec[i].output_tokens : 0;
        for (int tries = 0; have_after && diff.has_tokens && diff.generation_tokens < usage_total && tries < 50; tries++) {
            struct timespec ts = {0, 100 * 1000 * 1000};
            nanosleep(&ts, NULL);
            if (snapshot(url, c->metrics_path, &after) == 0) bench_spec_diff(&after, &before, &diff);
        }
        bench_metrics m;
        if (bench_metrics_compute(&run, have_after ? &diff : NULL, qs, (size_t)n_q, &m)) {
            fprintf(stderr, "specd-bench: out of memory\n");
            bench_run_free(&run);
            goto done;
        }
        bench_metrics_print(stdout, &m, c->percentile_metrics, cc.max_concurrency);
        fflush(stdout);
        total_ok += m.completed;
        json_t *lv = sweep ? json_object() : root;
        json_object_set_new(lv, "max_concurrency",
                            cc.max_concurrency ? json_integer((json_int_t)cc.max_concurrency) : json_null());
        bench_metrics_to_json(&m, &run, lv);
        if (sweep) json_array_append_new(sweep_arr, lv);
        bench_metrics_free(&m);
        bench_run_free(&run);
    }

    /* Provenance: enough to rerun and to judge the comparison. */
    char date[32], commit[128];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y%m%d-%H%M%S", localtime(&now));
    bench_git_commit(commit, sizeof commit);
    json_t *mach = json_object();
    bench_machine_json(mach);
    json_object_set_new(root, "date", json_string(date));
    json_object_set_new(root, "backend", json_string(strstr(c->endpoint, "chat") ? "openai-chat" : "openai"));
    json_object_set_new(root, "label", json_string(c->label ? c->label : model));
    json_object_set_new(root, "model_id", json_string(model));
    json_object_set_new(root, "base_url", json_string(url));
    json_object_set_new(root, "endpoint", json_string(c->endpoint));
    json_object_set_new(root, "dataset_name", json_string(c->dataset_name));
    json_object_set_new(root, "dataset_path", c->dataset_path ? json_string(c->dataset_path) : json_null());
    json_object_set_new(root, "num_prompts", json_integer(c->num_prompts));
    json_object_set_new(root, "max_tokens", c->max_tokens > 0 ? json_integer(c->max_tokens) : json_null());
    json_object_set_new(root, "ignore_eos", json_boolean(c->ignore_eos));
    json_object_set_new(root, "temperature", json_real(c->temperature));
    json_object_set_new(root, "num_warmups", json_integer(c->num_warmups));
    json_object_set_new(root, "request_rate", isinf(c->request_rate) ? json_string("inf") : json_real(c->request_rate));
    json_object_set_new(root, "burstiness", json_real(c->burstiness));
    json_object_set_new(root, "seed", json_integer(c->seed));
    if (!strcmp(c->dataset_name, "random")) {
        json_object_set_new(root, "random_input_len", json_integer(c->random_input_len));
        json_object_set_new(root, "random_output_len", json_integer(c->random_output_len));
        json_object_set_new(root, "random_range_ratio", json_real(c->random_range_ratio));
    }
    json_object_set_new(root, "server_cmd", server_cmd ? json_string(server_cmd) : json_null());
    json_object_set_new(root, "git_commit", json_string(commit));
    json_object_set_new(root, "machine", mach);
    if (sweep) json_object_set(root, "sweep", sweep_arr);

    char fname[512], path[1024];
    if (c->result_filename) snprintf(fname, sizeof fname, "%s", c->result_filename);
    else default_filename(c, model, levels[0], sweep, fname, sizeof fname);
    if (fname[0] == '/' || !c->result_dir) snprintf(path, sizeof path, "%s", fname);
    else snprintf(path, sizeof path, "%s/%s", c->result_dir, fname);
    if (c->save_result) {
        if (json_dump_file(root, path, JSON_INDENT(1) | JSON_REAL_PRECISION(10))) {
            fprintf(stderr, "specd-bench: cannot write %s\n", path);
            goto done;
        }
        printf("Result saved to %s\n", path);
    }
    if (c->plot_dir) {
        bench_result br;
        if (bench_result_wrap(root, c->label ? c->label : model, &br, &err) ||
            bench_plot(c->plot_dir, &br, 1, &err)) {
            fprintf(stderr, "specd-bench: plots: %s\n", err.msg);
            bench_result_free(&br);
            goto done;
        }
        bench_result_free(&br);
        printf("Plots written to %s\n", c->plot_dir);
    }
    rc = total_ok ? 0 : 2;
done:
    json_decref(sweep_arr);
    json_decref(root);
    free(model);
    bench_dataset_destroy(ds);
    return rc;
}

int main(int argc, char **argv) {
    cli c;
    char **cmp;
    size_t n_cmp;
    if (parse_args(argc, argv, &c, &cmp, &n_cmp)) return 1;
    if (c.help) {
        usage(stdout);
        return 0;
    }
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        fprintf(stderr, "specd-bench: curl_global_init failed\n");
        return 1;
    }
    int rc = n_cmp ? run_compare(&c, cmp, n_cmp) : run_bench(&c);
    curl_global_cleanup();
    return rc;
}
