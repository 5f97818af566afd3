/*
 * dataset.c: workload loading (see dataset.h). Files are read line by line
 * with getline; a ".gz" file is decompressed by zlib when the build found it,
 * else by `gzip -dc` through popen. Lines are parsed with jansson; the prompt text is copied
 * out and the JSON dropped before the run starts.
 */
#define _GNU_SOURCE /* fopencookie, getline */
#include "bench/dataset.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#ifdef SPECD_BENCH_HAVE_ZLIB
#include <zlib.h>
#endif

#include "bench/schedule.h"

/* Common English words: each is a single BPE token (with its leading space) in
 * GPT-2-family vocabularies such as SmolLM2's. */
static const char *const WORDS[] = {
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other", "its",
    "may", "these", "what", "them", "than", "some", "him", "time", "into", "only", "do", "could",
    "new", "about", "two", "first", "then", "also", "any", "like", "our", "over", "my", "man",
    "me", "out", "up", "state", "very", "most", "after", "such", "many", "made", "way", "world",
    "good", "water", "long", "people", "little", "work", "year", "day", "years", "great", "life",
    "where", "before", "through", "back", "much", "should", "well", "word", "used", "school",
    "place", "old", "own", "right", "house", "three", "down", "part", "small", "number", "city",
    "each", "those", "just", "now", "same", "here", "last", "both", "under", "never", "book",
    "light", "country", "family", "home", "group", "wind", "name", "music", "food", "river",
    "night", "power", "money", "story", "open", "market", "game", "line", "table", "road",
    "field", "color", "paper", "stone", "green", "black", "white", "red", "blue", "high", "low",
};
#define N_WORDS (sizeof WORDS / sizeof WORDS[0])

char *bench_dataset_random_text(uint64_t seed, size_t index, int words) {
    bench_rng r;
    bench_rng_seed(&r, seed * 0x9E3779B97F4A7C15ull + index + 1);
    size_t cap = (size_t)(words > 0 ? words : 1) * 9 + 1, n = 0;
    char *s = malloc(cap);
    if (!s) return NULL;
    for (int i = 0; i < words; i++) {
        const char *w = WORDS[bench_rng_int(&r, 0, N_WORDS - 1)];
        size_t wl = strlen(w);
        if (n + wl + 2 > cap) {
            cap = cap * 2 + wl + 2;
            char *ns = realloc(s, cap);
            if (!ns) {
                free(s);
                return NULL;
            }
            s = ns;
        }
        if (i) s[n++] = ' ';
        memcpy(s + n, w, wl);
        n += wl;
    }
    s[n] = '\0';
    return s;
}

void bench_dataset_destroy(bench_dataset *d) {
    if (!d) return;
    for (size_t i = 0; i < d->n; i++) free(d->p[i].text);
    free(d->p);
    free(d);
}

/* ---- JSONL ---------------------------------------------------------------- */

static const char *field_string(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_array(v) && json_is_string(json_array_get(v, 0))) return json_string_value(json_array_get(v, 0));
    return NULL;
}

char *bench_dataset_parse_line(const char *kind, const char *line, int *output_len, specd_err *err) {
    *output_len = -1;
    json_error_t jerr;
    json_t *o = json_loads(line, JSON_DECODE_ANY, &jerr);
    if (!o || !json_is_object(o)) {
        json_decref(o);
        specd_err_set(err, "not a JSON object (%s)", o ? "wrong type" : jerr.text);
        return NULL;
    }
    const char *text = NULL;
    if (strcmp(kind, "mt-bench") == 0) text = field_string(o, "turns");
    else if (strcmp(kind, "gsm8k") == 0) text = field_string(o, "question");
    else if (strcmp(kind, "humaneval") == 0) text = field_string(o, "prompt");
    else {
        static const char *const keys[] = {"prompt", "question", "text", "turns"};
        for (size_t i = 0; i < 4 && !text; i++) text = field_string(o, keys[i]);
    }
    json_t *ol = json_object_get(o, "output_len");
    if (json_is_integer(ol) && json_integer_value(ol) > 0) *output_len = (int)json_integer_value(ol);
    char *out = NULL;
    if (!text || !*text) specd_err_set(err, "no prompt field for dataset kind '%s'", kind);
    else if (!(out = strdup(text))) specd_err_set(err, "out of memory");
    json_decref(o);
    return out;
}

/* Opens path for reading lines: plain files with fopen; ".gz" files through
 * zlib (wrapped in a FILE* with fopencookie) when built with zlib, else
 * through `gzip -dc`. *is_pipe tells the caller to pclose. */
#ifdef SPECD_BENCH_HAVE_ZLIB
static ssize_t gz_cookie_read(void *c, char *buf, size_t n) {
    int r = gzread((gzFile)c, buf, (unsigned)(n > (1u << 30) ? (1u << 30) : n));
    return r < 0 ? -1 : r;
}
static int gz_cookie_close(void *c) { return gzclose((gzFile)c) == Z_OK ? 0 : EOF; }
#endif

static FILE *open_text(const char *path, int *is_pipe) {
    *is_pipe = 0;
    size_t l = strlen(path);
    if (l < 3 || strcmp(path + l - 3, ".gz") != 0) return fopen(path, "r");
#ifdef SPECD_BENCH_HAVE_ZLIB
    gzFile gz = gzopen(path, "rb");
    if (!gz) return NULL;
    cookie_io_functions_t io = {.read = gz_cookie_read, .close = gz_cookie_close};
    FILE *f = fopencookie(gz, "r", io);
    if (!f) gzclose(gz);
    return f;
#else
    if (strchr(path, '\'')) return NULL; /* keep the shell quoting below trivially safe */
    FILE *probe = fopen(path, "r");
    if (!probe) return NULL;
    fclose(probe);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "gzip -dc -- '%s'", path);
    *is_pipe = 1;
    return popen(cmd, "r");
#endif
}

/* Reads every non-empty line of a (possibly gzipped) file into prompts. */
static int load_jsonl(const bench_dataset_cfg *cfg, bench_prompt **out, size_t *n_out, specd_err *err) {
    *out = NULL;
    *n_out = 0;
    int is_pipe;
    FILE *f = open_text(cfg->path, &is_pipe);
    if (!f) return specd_err_set(err, "cannot open dataset '%s'", cfg->path);
    char *line = NULL;
    size_t cap = 0, n = 0, pcap = 0, lineno = 0;
    bench_prompt *p = NULL;
    int rc = -1;
    ssize_t got;
    while ((got = getline(&line, &cap, f)) >= 0) {
        size_t len = (size_t)got;
        lineno++;
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' ')) line[--len] = '\0';
        if (len == 0) continue;
        int olen;
        char *text = bench_dataset_parse_line(cfg->name, line, &olen, err);
        if (!text) {
            specd_err_wrap(err, "%s line %zu", cfg->path, lineno);
            goto fail;
        }
        if (n == pcap) {
            pcap = pcap ? pcap * 2 : 128;
            bench_prompt *np = realloc(p, pcap * sizeof *np);
            if (!np) {
                free(text);
                specd_err_set(err, "out of memory");
                goto fail;
            }
            p = np;
        }
        p[n++] = (bench_prompt){.text = text, .output_len = olen, .input_words = 0};
    }
    if (ferror(f)) {
        specd_err_set(err, "%s: read error", cfg->path);
        goto fail;
    }
    if (n == 0) {
        specd_err_set(err, "%s: no prompts", cfg->path);
        goto fail;
    }
    *out = p;
    *n_out = n;
    p = NULL;
    n = 0;
    rc = 0;
fail:
    for (size_t i = 0; i < n; i++) free(p[i].text);
    free(p);
    free(line);
    int st = is_pipe ? pclose(f) : fclose(f);
    if (rc == 0 && st != 0) { /* gzip failed, or the zlib stream was corrupt */
        for (size_t i = 0; i < *n_out; i++) free((*out)[i].text);
        free(*out);
        *out = NULL;
        *n_out = 0;
        return specd_err_set(err, "%s: cannot decompress", cfg->path);
    }
    return rc;
}

/* ---- entry point ---------------------------------------------------------- */

static int sample_len(bench_rng *r, int len, double ratio) {
    int lo = (int)((double)len * (1.0 - ratio)), hi = (int)((double)len * (1.0 + ratio));
    if (lo < 1) lo = 1;
    if (hi < lo) hi = lo;
    return (int)bench_rng_int(r, lo, hi);
}

int bench_dataset_load(const bench_dataset_cfg *cfg, bench_dataset **out, specd_err *err) {
    *out = NULL;
    if (cfg->num_prompts == 0) return specd_err_set(err, "--num-prompts must be >= 1");
    bench_dataset *d = calloc(1, sizeof *d);
    if (!d) return specd_err_set(err, "out of memory");
    d->p = calloc(cfg->num_prompts, sizeof *d->p);
    if (!d->p) goto oom;
    if (strcmp(cfg->name, "random") == 0) {
        if (cfg->random_input_len < 1 || cfg->random_output_len < 1 || cfg->random_range_ratio < 0 ||
            cfg->random_range_ratio >= 1) {
            bench_dataset_destroy(d);
            return specd_err_set(err, "random dataset: lengths must be >= 1 and --random-range-ratio in [0, 1)");
        }
        bench_rng r;
        bench_rng_seed(&r, cfg->seed);
        for (size_t i = 0; i < cfg->num_prompts; i++) {
            int in = sample_len(&r, cfg->random_input_len, cfg->random_range_ratio);
            int outl = sample_len(&r, cfg->random_output_len, cfg->random_range_ratio);
            d->p[i].text = bench_dataset_random_text(cfg->seed, i, in);
            if (!d->p[i].text) goto oom;
            d->p[i].output_len = outl;
            d->p[i].input_words = in;
            d->n = i + 1;
        }
        *out = d;
        return 0;
    }
    static const char *const kinds[] = {"mt-bench", "gsm8k", "humaneval", "jsonl"};
    int known = 0;
    for (size_t i = 0; i < 4; i++) known |= strcmp(cfg->name, kinds[i]) == 0;
    if (!known) {
        bench_dataset_destroy(d);
        return specd_err_set(err, "unknown --dataset-name '%s' (mt-bench, gsm8k, humaneval, jsonl, random)", cfg->name);
    }
    if (!cfg->path) {
        bench_dataset_destroy(d);
        return specd_err_set(err, "--dataset-name %s needs --dataset-path", cfg->name);
    }
    bench_prompt *file;
    size_t nf;
    if (load_jsonl(cfg, &file, &nf, err)) {
        bench_dataset_destroy(d);
        return -1;
    }
    for (size_t i = 0; i < cfg->num_prompts; i++) {
        const bench_prompt *src = &file[i % nf];
        d->p[i].output_len = src->output_len;
        d->p[i].text = strdup(src->text);
        if (!d->p[i].text) break;
        d->n = i + 1;
    }
    for (size_t i = 0; i < nf; i++) free(file[i].text);
    free(file);
    if (d->n != cfg->num_prompts) goto oom;
    *out = d;
    return 0;
oom:
    bench_dataset_destroy(d);
    return specd_err_set(err, "out of memory");
}
