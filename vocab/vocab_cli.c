/*
 * vocab_cli.c: `specd vocab` dispatch and the count, build and inspect
 * subcommands (validate lives in vocab_validate.c: it runs the target).
 *
 * Every subcommand parses its flags with getopt_long, does its work through
 * the vocab_* library functions, prints a report on stdout and returns an exit
 * code: 0 ok, 1 failure (or an invalid map for inspect), 2 usage.
 * Threading: main thread.
 */
#include "vocab/vocab_cli.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "draft/eagle3_vocab.h"
#include "vocab/npy.h"
#include "vocab/vocab_count.h"
#include "vocab/vocab_data.h"
#include "vocab/vocab_map.h"
#include "vocab/vocab_target.h"

#define MAX_FILES 32
#define MAX_FORCED 4096

static void vocab_usage(FILE *f) {
    fprintf(f, "usage: specd vocab <command> [flags]\n"
               "  count     count the assistant tokens of chat data (writes token_freq.npy)\n"
               "  build     choose the draft vocabulary from token frequencies (writes d2t/t2d)\n"
               "  inspect   check a d2t/t2d map (file, build output or draft head directory)\n"
               "  validate  coverage of a map on held-out data and on the target's greedy outputs\n"
               "`specd vocab <command> --help` lists the flags. See docs/vocab.md.\n");
}

int vocab_main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        vocab_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *c = argv[1];
    optind = 0; /* glibc: full re-initialisation of getopt for each subcommand */
    if (!strcmp(c, "count")) return vocab_count_main(argc - 1, argv + 1);
    if (!strcmp(c, "build")) return vocab_build_main(argc - 1, argv + 1);
    if (!strcmp(c, "inspect")) return vocab_inspect_main(argc - 1, argv + 1);
    if (!strcmp(c, "validate")) return vocab_validate_main(argc - 1, argv + 1);
    fprintf(stderr, "specd vocab: unknown command \"%s\"\n", c);
    vocab_usage(stderr);
    return 2;
}

/* Strict integer flag parse; -1 (and a message) when not an integer in [lo, hi]. */
static int parse_i64(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *e;
    long long v = strtoll(s, &e, 10);
    if (!*s || *e || v < lo || v > hi) {
        fprintf(stderr, "specd vocab: %s expects an integer in [%lld, %lld], got \"%s\"\n", flag, (long long)lo,
                (long long)hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

/* Shared by count and validate: loads every --data file, then the responses. */
int vocab_cli_load_data(vocab_dataset *ds, char **files, int n_files, char **resp, int n_resp, int64_t max_records);
int vocab_cli_load_data(vocab_dataset *ds, char **files, int n_files, char **resp, int n_resp, int64_t max_records) {
    specd_err err = {0};
    for (int i = 0; i < n_files; i++) {
        int64_t before = (int64_t)ds->n_rec, bad = ds->n_malformed;
        if (max_records > 0 && before >= max_records) break;
        if (vocab_data_load(ds, files[i], max_records, &err) < 0) {
            fprintf(stderr, "specd vocab: %s\n", err.msg);
            return -1;
        }
        printf("data: %s: %lld records, %lld malformed lines skipped\n", files[i], (long long)ds->n_rec - before,
               (long long)(ds->n_malformed - bad));
    }
    for (int i = 0; i < n_resp; i++) {
        int64_t m = ds->n_responses_matched;
        if (vocab_data_add_responses(ds, resp[i], &err) < 0) {
            fprintf(stderr, "specd vocab: %s\n", err.msg);
            return -1;
        }
        printf("responses: %s: %lld records answered, %lld responses without a matching question\n", resp[i],
               (long long)(ds->n_responses_matched - m), (long long)ds->n_responses_unmatched);
    }
    for (size_t i = 0; i < ds->n_problems; i++) fprintf(stderr, "malformed: %s\n", ds->problems[i]);
    if (ds->n_malformed > (int64_t)ds->n_problems)
        fprintf(stderr, "malformed: ... and %lld more lines\n", (long long)(ds->n_malformed - (int64_t)ds->n_problems));
    return 0;
}

/* ------------------------------------------------------------------ count */

static void count_usage(FILE *f) {
    fprintf(f, "usage: specd vocab count --target MODEL --data FILE [--data FILE ...] [flags]\n"
               "Counts the assistant tokens (the training loss mask of the target's chat template) of JSONL\n"
               "chat data: {messages}, {conversations}, {prompt, response}, {question, answer} or {turns}\n"
               "(question files such as MT-bench need --responses).\n"
               "  --target MODEL        target .gguf or HF directory (tokenizer and chat template)\n"
               "  --data FILE           JSONL data (repeatable)\n"
               "  --responses FILE      answers for {turns} records, matched by question_id (repeatable)\n"
               "  --max-seq-len N       skip (and report) conversations longer than N tokens (default: none)\n"
               "  --num-samples N       use the first N records (default: all)\n"
               "  --threads N           tokenizer threads (default 2)\n"
               "  --output FILE         frequency vector, int64 [target vocab] .npy (default token_freq.npy)\n");
}

int vocab_count_main(int argc, char **argv) {
    static const struct option opts[] = {
        {"target", 1, 0, 't'},     {"data", 1, 0, 'd'},        {"responses", 1, 0, 'r'}, {"max-seq-len", 1, 0, 'm'},
        {"num-samples", 1, 0, 'n'}, {"threads", 1, 0, 'j'},    {"output", 1, 0, 'o'},    {"help", 0, 0, 'h'},
        {0, 0, 0, 0}};
    const char *target = NULL, *output = "token_freq.npy";
    char *data[MAX_FILES], *resp[MAX_FILES];
    int n_data = 0, n_resp = 0;
    int64_t max_len = 0, num = 0, threads = 2;
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 't': target = optarg; break;
        case 'd':
            if (n_data == MAX_FILES) return fprintf(stderr, "specd vocab count: too many --data files\n"), 2;
            data[n_data++] = optarg;
            break;
        case 'r':
            if (n_resp == MAX_FILES) return fprintf(stderr, "specd vocab count: too many --responses files\n"), 2;
            resp[n_resp++] = optarg;
            break;
        case 'm': if (parse_i64("--max-seq-len", optarg, 1, INT32_MAX, &max_len)) return 2; break;
        case 'n': if (parse_i64("--num-samples", optarg, 1, INT64_MAX, &num)) return 2; break;
        case 'j': if (parse_i64("--threads", optarg, 1, 64, &threads)) return 2; break;
        case 'o': output = optarg; break;
        case 'h': count_usage(stdout); return 0;
        default: count_usage(stderr); return 2;
        }
    }
    if (!target || n_data == 0 || optind < argc) {
        fprintf(stderr, "specd vocab count: %s\n", optind < argc ? "unexpected argument" : "--target and --data are required");
        count_usage(stderr);
        return 2;
    }
    int rc = 1;
    specd_err err = {0};
    vocab_target tg = {0};
    vocab_dataset ds = {0};
    vocab_count_result r = {0};
    if (vocab_target_open(target, &tg, &err) < 0) {
        fprintf(stderr, "specd vocab count: %s\n", err.msg);
        return 1;
    }
    struct timespec ta, tb;
    clock_gettime(CLOCK_MONOTONIC, &ta);
    if (vocab_cli_load_data(&ds, data, n_data, resp, n_resp, num) < 0) goto out;
    clock_gettime(CLOCK_MONOTONIC, &tb);
    double read_s = (double)(tb.tv_sec - ta.tv_sec) + (tb.tv_nsec - ta.tv_nsec) * 1e-9;
    vocab_count_opts o = {.max_seq_len = (int32_t)max_len, .n_threads = (int)threads};
    if (vocab_count(tg.tok, tg.n_vocab, &ds, &o, &r, &err) < 0) {
        fprintf(stderr, "specd vocab count: %s\n", err.msg);
        goto out;
    }
    char lim[32] = "(none)";
    if (max_len) snprintf(lim, sizeof lim, "%lld", (long long)max_len);
    printf("samples: %lld records, %lld processed, %lld skipped longer than --max-seq-len %s, %lld without an "
           "assistant response, %lld refused by the chat template\n",
           (long long)r.n_records, (long long)r.n_processed, (long long)r.n_skipped_long, lim,
           (long long)r.n_no_response, (long long)r.n_failed);
    if (r.n_no_response)
        printf("note: %lld records have no assistant turn (question-only files such as MT-bench): pass "
               "--responses FILE to count them\n", (long long)r.n_no_response);
    if (r.first_failure[0]) fprintf(stderr, "chat template: %s\n", r.first_failure);
    printf("tokens: %lld total, %lld assistant (loss mask), %lld distinct assistant ids of %lld; longest %lld\n",
           (long long)r.total_tokens, (long long)r.assistant_tokens, (long long)r.distinct, (long long)r.n_vocab,
           (long long)r.longest);
    printf("speed: %.3f s wall, %.0f tokens/s (all rendered tokens), %.0f samples/s, %lld threads; %.3f s CPU, "
           "%.0f tokens per CPU-second\n", r.seconds, r.seconds > 0 ? (double)r.total_tokens / r.seconds : 0.0,
           r.seconds > 0 ? (double)r.n_processed / r.seconds : 0.0, (long long)threads, r.cpu_seconds,
           r.cpu_seconds > 0 ? (double)r.total_tokens / r.cpu_seconds : 0.0);
    printf("reading + JSON parsing the data: %.3f s wall (single thread, before counting)\n", read_s);
    if (r.n_processed == 0) {
        fprintf(stderr, "specd vocab count: no sample could be counted; %s not written\n", output);
        goto out;
    }
    if (npy_write_vec(output, "<i8", r.freq, r.n_vocab, &err) < 0) {
        fprintf(stderr, "specd vocab count: %s\n", err.msg);
        goto out;
    }
    printf("wrote %s (int64 [%lld])\n", output, (long long)r.n_vocab);
    rc = 0;
out:
    vocab_count_result_free(&r);
    vocab_dataset_free(&ds);
    vocab_target_close(&tg);
    return rc;
}

/* ------------------------------------------------------------------ build */

static void build_usage(FILE *f) {
    fprintf(f, "usage: specd vocab build --token-freq F --draft-vocab-size N --output-dir DIR [flags]\n"
               "Keeps the N most frequent target tokens (ties: lower id), always including the forced ids;\n"
               "fills with the lowest unused non-special ids when fewer were seen; writes d2t.npy (int64 offsets),\n"
               "t2d.npy (bool) and vocab_map.safetensors (d2t I64, t2d BOOL).\n"
               "  --token-freq F          int64 [target vocab] .npy from `specd vocab count`\n"
               "  --draft-vocab-size N    kept ids (e.g. 32000), 1 <= N < target vocab\n"
               "  --target-vocab-size N   refuse a frequency vector of another length\n"
               "  --target MODEL          tokenizer: default forced ids (EOS, stop, chat-structure tokens),\n"
               "                          token strings in --always-include, names in the report\n"
               "  --always-include LIST   comma-separated ids or token strings to keep (repeatable), in\n"
               "                          addition to the defaults\n"
               "  --no-default-include    do not force the target's EOS/stop/structure tokens\n"
               "  --output-dir DIR        where to write (created)\n");
}

/* Appends the comma-separated ids or token strings of S to forced[]. */
static int parse_forced(const char *s, const vocab_target *tg, int64_t *forced, size_t *n) {
    const char *p = s;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == 0 || len > 255) {
            fprintf(stderr, "specd vocab build: empty or overlong item in --always-include \"%s\"\n", s);
            return -1;
        }
        char item[256];
        memcpy(item, p, len);
        item[len] = '\0';
        char *end;
        long long v = strtoll(item, &end, 10);
        int64_t id;
        if (*end == '\0') id = v;
        else if (!tg->tok) {
            fprintf(stderr, "specd vocab build: --always-include \"%s\" is a token string: pass --target\n", item);
            return -1;
        } else if ((id = tok_token_id(tg->tok, item, len)) < 0) {
            fprintf(stderr, "specd vocab build: --always-include: \"%s\" is not a token of the target\n", item);
            return -1;
        }
        if (*n == MAX_FORCED) {
            fprintf(stderr, "specd vocab build: more than %d --always-include ids\n", MAX_FORCED);
            return -1;
        }
        forced[(*n)++] = id;
        p += len;
        if (*p == ',') p++;
    }
    return 0;
}

int vocab_build_main(int argc, char **argv) {
    static const struct option opts[] = {{"token-freq", 1, 0, 'f'},   {"draft-vocab-size", 1, 0, 'n'},
                                         {"target-vocab-size", 1, 0, 'v'}, {"target", 1, 0, 't'},
                                         {"always-include", 1, 0, 'a'},  {"no-default-include", 0, 0, 'N'},
                                         {"output-dir", 1, 0, 'o'},     {"help", 0, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *freq_path = NULL, *target = NULL, *outdir = NULL;
    const char *always[MAX_FILES];
    int n_always = 0;
    bool defaults = true;
    int64_t n_draft = -1, n_target = -1;
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'f': freq_path = optarg; break;
        case 'n': if (parse_i64("--draft-vocab-size", optarg, 0, INT64_MAX, &n_draft)) return 2; break;
        case 'v': if (parse_i64("--target-vocab-size", optarg, 1, INT64_MAX, &n_target)) return 2; break;
        case 't': target = optarg; break;
        case 'a':
            if (n_always == MAX_FILES) return fprintf(stderr, "specd vocab build: too many --always-include\n"), 2;
            always[n_always++] = optarg;
            break;
        case 'N': defaults = false; break;
        case 'o': outdir = optarg; break;
        case 'h': build_usage(stdout); return 0;
        default: build_usage(stderr); return 2;
        }
    }
    if (!freq_path || n_draft < 0 || !outdir || optind < argc) {
        fprintf(stderr, "specd vocab build: %s\n",
                optind < argc ? "unexpected argument" : "--token-freq, --draft-vocab-size and --output-dir are required");
        build_usage(stderr);
        return 2;
    }
    int rc = 1;
    specd_err err = {0};
    vocab_target tg = {0};
    int64_t *freq = NULL, n_freq = 0;
    int64_t *forced = malloc(sizeof *forced * MAX_FORCED);
    size_t n_forced = 0, n_default = 0;
    vocab_map m = {0};
    uint8_t *avoid = NULL;
    if (!forced) goto out;
    if (target && vocab_target_open(target, &tg, &err) < 0) {
        fprintf(stderr, "specd vocab build: %s\n", err.msg);
        goto out;
    }
    if (n_target > 0 && tg.tok && n_target != tg.n_vocab) {
        fprintf(stderr, "specd vocab build: --target-vocab-size %lld but the target %s has %lld tokens\n",
                (long long)n_target, target, (long long)tg.n_vocab);
        goto out;
    }
    if (vocab_freq_load(freq_path, n_target > 0 ? n_target : tg.tok ? tg.n_vocab : 0, &freq, &n_freq, &err) < 0) {
        fprintf(stderr, "specd vocab build: %s\n", err.msg);
        goto out;
    }
    if (tg.tok && defaults) n_default = n_forced = vocab_target_structural_ids(&tg, forced, MAX_FORCED);
    for (int i = 0; i < n_always; i++)
        if (parse_forced(always[i], &tg, forced, &n_forced) < 0) goto out;
    if (tg.tok && !(avoid = calloc((size_t)n_freq, 1))) goto out;
    for (int64_t i = 0; avoid && i < n_freq && i < tok_vocab_size(tg.tok); i++) avoid[i] = tok_is_special(tg.tok, (int32_t)i);
    vocab_build_report rep;
    if (vocab_build(freq, n_freq, n_draft, forced, n_forced, avoid, &m, &rep, &err) < 0) {
        fprintf(stderr, "specd vocab build: %s\n", err.msg);
        goto out;
    }
    printf("token frequencies: %s (int64 [%lld]): %lld assistant tokens, %lld distinct ids seen\n", freq_path,
           (long long)n_freq, (long long)rep.total_count, (long long)rep.n_seen);
    printf("forced: %lld distinct ids (%zu target defaults%s, %zu from --always-include), %lld of them not kept by "
           "frequency alone\n",
           (long long)rep.n_forced, n_default, tg.tok ? (defaults ? "" : ", disabled") : ", no --target",
           n_forced - n_default, (long long)rep.n_forced_extra);
    for (size_t i = 0; i < n_forced && tg.tok; i++) {
        char b[64];
        vocab_token_display(tg.tok, forced[i], b, sizeof b);
        printf("  forced id %lld \"%s\" (count %lld)\n", (long long)forced[i], b,
               (long long)(forced[i] >= 0 && forced[i] < n_freq ? freq[forced[i]] : 0));
    }
    printf("kept: %lld of %lld target ids: %lld of the %lld seen ids, %lld filled\n", (long long)m.n_draft,
           (long long)m.n_target, (long long)rep.n_seen_kept, (long long)rep.n_seen, (long long)rep.n_filled);
    if (rep.n_filled)
        printf("fill: fewer distinct ids were seen than the draft vocab size; the %lld remaining slots took the lowest "
               "unused ids (%lld..%lld%s)\n", (long long)rep.n_filled, (long long)rep.fill_first, (long long)rep.fill_last,
               avoid ? ", the target's special tokens taken only if nothing else was left" : "");
    printf("coverage: %.4f%% of the assistant-token frequency (%lld of %lld); least frequent id kept by frequency has "
           "count %lld\n",
           rep.total_count ? 100.0 * (double)rep.covered_count / (double)rep.total_count : 0.0,
           (long long)rep.covered_count, (long long)rep.total_count, (long long)rep.min_kept_count);
    printf("ids: lowest kept %lld, highest kept %lld\n", (long long)rep.lowest_id, (long long)rep.highest_id);
    if (vocab_map_write(outdir, &m, &err) < 0) {
        fprintf(stderr, "specd vocab build: %s\n", err.msg);
        goto out;
    }
    printf("wrote %s/d2t.npy (int64 [%lld] offsets), %s/t2d.npy (bool [%lld]), %s/vocab_map.safetensors (d2t I64, "
           "t2d BOOL)\n", outdir, (long long)m.n_draft, outdir, (long long)m.n_target, outdir);
    rc = 0;
out:
    vocab_map_free(&m);
    free(avoid);
    free(freq);
    free(forced);
    vocab_target_close(&tg);
    return rc;
}

/* ---------------------------------------------------------------- inspect */

/* Offsets (absolute=false) or absolute ids: valid? First problem into why. */
static bool reading_valid(const int64_t *d2t, int64_t n, int64_t V, bool absolute, char *why, size_t cap) {
    int64_t prev = -1;
    for (int64_t i = 0; i < n; i++) {
        if (d2t[i] < -((int64_t)1 << 40) || d2t[i] > ((int64_t)1 << 40)) {
            snprintf(why, cap, "d2t[%lld] = %lld is out of range", (long long)i, (long long)d2t[i]);
            return false;
        }
        int64_t u = absolute ? d2t[i] : i + d2t[i];
        if (u < 0 || (V > 0 && u >= V)) {
            snprintf(why, cap, "draft id %lld maps to %lld, outside [0, %lld)", (long long)i, (long long)u, (long long)V);
            return false;
        }
        if (u <= prev) {
            snprintf(why, cap, "draft id %lld maps to %lld, not above the previous %lld", (long long)i, (long long)u,
                     (long long)prev);
            return false;
        }
        prev = u;
    }
    snprintf(why, cap, "strictly increasing ids %lld..%lld", (long long)d2t[0], /* used[0] in both readings */
             (long long)(absolute ? d2t[n - 1] : n - 1 + d2t[n - 1]));
    return true;
}

int vocab_inspect_main(int argc, char **argv) {
    static const struct option opts[] = {{"target", 1, 0, 't'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    const char *target = NULL;
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 't': target = optarg; break;
        case 'h':
            printf("usage: specd vocab inspect FILE|DIR [--target MODEL]\n"
                   "FILE: vocab_map.safetensors, d2t.npy or t2d.npy; DIR: a build output or a draft head.\n"
                   "Prints shapes, dtypes, whether d2t reads as offsets or as absolute ids, the invariants, and\n"
                   "(with --target) the first and last mapped tokens as text. Exit 1 if the map is invalid.\n");
            return 0;
        default: return 2;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "usage: specd vocab inspect FILE|DIR [--target MODEL]\n");
        return 2;
    }
    const char *path = argv[optind];
    specd_err err = {0};
    vocab_target tg = {0};
    vocab_map_raw raw;
    vocab_map m = {0};
    int rc = 1;
    if (target && vocab_target_open(target, &tg, &err) < 0) {
        fprintf(stderr, "specd vocab inspect: %s\n", err.msg);
        return 1;
    }
    if (vocab_map_load_raw(path, &raw, &err) < 0) {
        fprintf(stderr, "specd vocab inspect: %s\n", err.msg);
        vocab_target_close(&tg);
        return 1;
    }
    printf("source: %s\n", raw.source);
    if (raw.d2t) printf("d2t: %s [%lld]\n", raw.d2t_dtype, (long long)raw.n_d2t);
    else printf("d2t: absent\n");
    int64_t t2d_sum = 0;
    if (raw.t2d) {
        for (int64_t i = 0; i < raw.n_t2d; i++) t2d_sum += raw.t2d[i];
        printf("t2d: %s [%lld], %lld true\n", raw.t2d_dtype, (long long)raw.n_t2d, (long long)t2d_sum);
    } else {
        printf("t2d: absent\n");
    }
    if (raw.draft_vocab_cfg > 0 || raw.target_vocab_cfg > 0)
        printf("declared sizes: draft_vocab_size %lld, target vocab %lld\n", (long long)raw.draft_vocab_cfg,
               (long long)raw.target_vocab_cfg);
    int64_t V = tg.tok ? tg.n_vocab : raw.t2d ? raw.n_t2d : raw.target_vocab_cfg;
    if (raw.d2t && raw.n_d2t > 0) {
        char why[256];
        bool off = reading_valid(raw.d2t, raw.n_d2t, V, false, why, sizeof why);
        printf("d2t read as offsets (target = draft + d2t[draft]): %s: %s\n", off ? "valid" : "INVALID", why);
        bool abs_ = reading_valid(raw.d2t, raw.n_d2t, V, true, why, sizeof why);
        printf("d2t read as absolute ids:                          %s: %s\n", abs_ ? "valid" : "invalid", why);
        bool zero = true;
        for (int64_t i = 0; i < raw.n_d2t && zero; i++) zero = raw.d2t[i] == 0;
        printf("detected: %s\n", zero ? "all zeros (identity onto ids 0..N-1)"
                                 : off ? "offsets (the EAGLE-3 convention)"
                                 : abs_ ? "ABSOLUTE ids (wrong convention: convert with d2t - arange(N))"
                                        : "neither reading is a valid map");
    }
    if (vocab_map_from_raw(&raw, tg.tok ? tg.n_vocab : -1, &m, &err) < 0) {
        printf("verdict: INVALID: %s\n", err.msg);
        goto out;
    }
    eagle3_vocab_info info;
    char summary[256];
    eagle3_vocab_validate(m.d2t, m.n_draft, m.t2d, m.n_target, NULL, &info, NULL);
    eagle3_vocab_summary(&info, summary, sizeof summary);
    printf("invariants: t2d.sum() == %lld: ok; used strictly increasing: ok; 0 <= used < %lld: ok%s\n",
           (long long)m.n_draft, (long long)m.n_target, raw.t2d ? "" : " (t2d rebuilt from d2t)");
    eagle3_vocab_validate(raw.d2t, m.n_draft, raw.t2d, m.n_target, NULL, &info, NULL);
    if (info.warning[0]) printf("warning: %s\n", info.warning);
    printf("verdict: OK: %s\n", summary);
    int64_t show = m.n_draft < 5 ? m.n_draft : 5;
    for (int pass = 0; pass < 2; pass++) {
        printf("%s mapped tokens:\n", pass ? "last" : "first");
        for (int64_t k = 0; k < show; k++) {
            int64_t i = pass ? m.n_draft - show + k : k;
            char b[96] = "";
            if (tg.tok) vocab_token_display(tg.tok, m.used[i], b, sizeof b);
            printf("  draft %lld -> target %lld (d2t %lld)%s%s%s\n", (long long)i, (long long)m.used[i],
                   (long long)m.d2t[i], tg.tok ? " \"" : "", b, tg.tok ? "\"" : "");
        }
    }
    if (!tg.tok) printf("(pass --target MODEL to see the tokens as text)\n");
    rc = 0;
out:
    vocab_map_free(&m);
    vocab_map_raw_free(&raw);
    vocab_target_close(&tg);
    return rc;
}
