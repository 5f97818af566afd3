/*
 * cli.c: the offline subcommands of `specd`:
 *
 *   specd generate MODEL (--prompt TEXT | --chat TEXT) [sampling] [engine flags]
 *       One request through the same engine `serve` runs (engine API: submit,
 *       wait on the stream). The generated text goes to stdout exactly as the
 *       server would return it (plus a newline on a terminal); prompt and
 *       decode throughput go to stderr.
 *   specd tokenize (--model MODEL | --tokenizer FILE) [--text TEXT | TEXT | stdin] [--no-special]
 *   specd detokenize (--model MODEL | --tokenizer FILE) [IDS-JSON | stdin] [--skip-special]
 *       Token ids as a JSON array on stdout / from the argument or stdin.
 *
 * The sampling flags are a second cfg table (CFG_NOENV: per-invocation),
 * parsed together with the engine flags of the serve table
 * (require = CFG_ENGINE), so --help lists both from the same source.
 * Threading: main thread.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/util/log.h"
#include "server/bundle.h"
#include "server/oai.h"
#include "server/serve.h"

typedef struct gen_opts {
    char *prompt, *chat, *system, *stop;
    int32_t max_tokens, top_k, min_tokens;
    double temperature, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty;
    int64_t seed;
    bool ignore_eos, no_skip_special, raw_prompt_ids;
} gen_opts;

#define G(f) offsetof(gen_opts, f)
#define NB 1, 0
static const cfg_option gen_options[] = {
    {"prompt", CFG_STR, NULL, NB, G(prompt), CFG_NOENV, NULL, "completion prompt (special-token strings are parsed)"},
    {"chat", CFG_STR, NULL, NB, G(chat), CFG_NOENV, NULL, "one user message, rendered with the model's chat template"},
    {"system", CFG_STR, NULL, NB, G(system), CFG_NOENV, NULL, "system message for --chat"},
    {"max-tokens", CFG_INT, "128", 1, 1 << 24, G(max_tokens), CFG_NOENV, NULL, "tokens to generate at most"},
    {"temperature", CFG_DOUBLE, "0", 0, 1e6, G(temperature), CFG_NOENV, NULL, "0 = greedy"},
    {"top-p", CFG_DOUBLE, "1", 1e-9, 1, G(top_p), CFG_NOENV, NULL, "nucleus sampling mass"},
    {"top-k", CFG_INT, "-1", -1, 1 << 30, G(top_k), CFG_NOENV, NULL, "top-k (-1 = off)"},
    {"min-p", CFG_DOUBLE, "0", 0, 1, G(min_p), CFG_NOENV, NULL, "min-p (0 = off)"},
    {"presence-penalty", CFG_DOUBLE, "0", -2, 2, G(presence_penalty), CFG_NOENV, NULL, "OpenAI presence penalty"},
    {"frequency-penalty", CFG_DOUBLE, "0", -2, 2, G(frequency_penalty), CFG_NOENV, NULL, "OpenAI frequency penalty"},
    {"repetition-penalty", CFG_DOUBLE, "1", 1e-9, 1e6, G(repetition_penalty), CFG_NOENV, NULL, "HF repetition penalty"},
    {"seed", CFG_I64, "-1", -1, 9.2e18, G(seed), CFG_NOENV, NULL, "sampling seed (-1 = random)"},
    {"min-tokens", CFG_INT, "0", 0, 1 << 24, G(min_tokens), CFG_NOENV, NULL, "suppress EOS before this many tokens"},
    {"ignore-eos", CFG_BOOL, "false", NB, G(ignore_eos), CFG_NOENV, NULL, "keep generating past EOS"},
    {"stop", CFG_STR, NULL, NB, G(stop), CFG_NOENV, NULL, "one stop string"},
    {"no-skip-special", CFG_BOOL, "false", NB, G(no_skip_special), CFG_NOENV, NULL, "render special tokens in the text"},
};
#undef G

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void gen_usage(FILE *f, cfg_table *t) {
    fprintf(f, "usage: specd generate MODEL (--prompt TEXT | --chat TEXT) [options]\n"
               "  Runs one request offline and prints the generated text; prompt and decode\n"
               "  throughput go to stderr.\n");
    cfg_print_help(f, t, 2);
}

int specd_generate_main(int argc, char **argv) {
    specd_config cfg;
    gen_opts g;
    memset(&cfg, 0, sizeof cfg);
    memset(&g, 0, sizeof g);
    cfg_table t[2];
    specd_config_table(&cfg, &t[0]);
    t[0].title = "engine options";
    t[0].require = CFG_ENGINE;
    t[1] = (cfg_table){.title = "sampling options", .opts = gen_options,
                       .n_opts = sizeof gen_options / sizeof gen_options[0], .base = &g, .require = 0};
    specd_err err = {{0}};
    const char *pos[2];
    size_t n_pos = 0;
    bool help = false;
    int rc = 1;
    specd_bundle b;
    memset(&b, 0, sizeof b);
    int32_t *ids = NULL;
    size_t n_ids = 0;
    engine_stream *s = NULL;
    if (cfg_defaults(t, 2, &err) || cfg_apply_env(t, 1, NULL, &err) ||
        cfg_parse_args(t, 2, argc, argv, pos, 2, &n_pos, &help, &err)) {
        fprintf(stderr, "specd generate: %s\n", err.msg);
        rc = 2;
        goto out;
    }
    if (help) {
        gen_usage(stdout, t);
        rc = 0;
        goto out;
    }
    if (n_pos != 1 || (!g.prompt == !g.chat)) {
        fprintf(stderr, "specd generate: expected MODEL and exactly one of --prompt / --chat (see --help)\n");
        rc = 2;
        goto out;
    }
    /* quiet by default (the text is the output); --log-level / SPECD_LOG_LEVEL override */
    bool level_given = getenv("SPECD_LOG_LEVEL") != NULL;
    for (int i = 0; i < argc; i++) level_given |= !strncmp(argv[i], "--log-level", 11);
    const char *lv = level_given && cfg.log_level ? cfg.log_level : "warn";
    log_set_level(!strcmp(lv, "debug") ? LOG_LVL_DEBUG : !strcmp(lv, "info") ? LOG_LVL_INFO
                  : !strcmp(lv, "error") ? LOG_LVL_ERROR : LOG_LVL_WARN);
    if (specd_bundle_load(pos[0], &cfg, NULL, &b, &err) || engine_start(b.eng, &err)) {
        fprintf(stderr, "specd generate: %s\n", err.msg);
        goto out;
    }
    if (g.chat) {
        chat_message msgs[2];
        size_t nm = 0;
        if (g.system) msgs[nm++] = (chat_message){.role = "system", .content = g.system};
        msgs[nm++] = (chat_message){.role = "user", .content = g.chat};
        chat_options opt = {.add_generation_prompt = true, .thinking = -1};
        if (tok_chat_encode(b.tok, msgs, nm, &opt, &ids, &n_ids, NULL, &err)) {
            fprintf(stderr, "specd generate: chat template: %s\n", err.msg);
            goto out;
        }
    } else if (tok_encode(b.tok, g.prompt, strlen(g.prompt), true, &ids, &n_ids, &err)) {
        fprintf(stderr, "specd generate: tokenize: %s\n", err.msg);
        goto out;
    }
    engine_request r = {0};
    sampling_params_init(&r.sp);
    r.sp.temperature = (float)g.temperature;
    r.sp.top_p = (float)g.top_p;
    r.sp.top_k = g.top_k;
    r.sp.min_p = (float)g.min_p;
    r.sp.presence_penalty = (float)g.presence_penalty;
    r.sp.frequency_penalty = (float)g.frequency_penalty;
    r.sp.repetition_penalty = (float)g.repetition_penalty;
    r.sp.has_seed = g.seed >= 0;
    r.sp.seed = (uint64_t)(g.seed >= 0 ? g.seed : 0);
    r.sp.min_tokens = g.min_tokens;
    r.sp.ignore_eos = g.ignore_eos;
    r.sp.skip_special_tokens = !g.no_skip_special;
    const char *stops[1] = {g.stop};
    if (g.stop) r.sp.stop = stops, r.sp.n_stop = 1;
    int64_t room = (int64_t)b.max_model_len - (int64_t)n_ids;
    if (room < 1) {
        fprintf(stderr, "specd generate: the prompt has %zu tokens; max-model-len is %d\n", n_ids, b.max_model_len);
        goto out;
    }
    r.sp.max_tokens = g.max_tokens < room ? g.max_tokens : (int32_t)room;
    r.prompt = ids;
    r.n_prompt = n_ids;
    r.request_id = "generate";
    engine_status st;
    double t0 = now_s(), t_first = -1, t_end = t0;
    s = engine_submit(b.eng, &r, NULL, NULL, &st, &err);
    if (!s) {
        fprintf(stderr, "specd generate: %s\n", err.msg);
        goto out;
    }
    int32_t n_completion = 0;
    finish_reason fin = FINISH_NONE;
    for (;;) {
        engine_output *o = NULL;
        if (engine_stream_wait(s, &o, -1.0) != 1) continue;
        if (t_first < 0 && o->n_tokens) t_first = now_s();
        if (o->text_len) {
            fwrite(o->text, 1, o->text_len, stdout);
            fflush(stdout);
        }
        n_completion = o->n_completion_tokens;
        fin = o->finish;
        if (fin == FINISH_ERROR) fprintf(stderr, "specd generate: %s\n", o->error);
        engine_output_free(o);
        if (fin != FINISH_NONE) break;
    }
    t_end = now_s();
    if (isatty(1)) fputc('\n', stdout);
    fflush(stdout);
    double ttft = t_first > 0 ? t_first - t0 : t_end - t0;
    double dec = t_end - (t_first > 0 ? t_first : t0);
    fprintf(stderr, "prompt: %zu tokens, %.1f tok/s; decode: %d tokens, %.1f tok/s; finish: %s\n", n_ids,
            ttft > 0 ? (double)n_ids / ttft : 0.0, n_completion,
            (n_completion > 1 && dec > 0) ? (double)(n_completion - 1) / dec : 0.0,
            oai_finish_str(fin) ? oai_finish_str(fin) : "?");
    engine_stats es;
    engine_get_stats(b.eng, &es);
    if (es.spec_num_drafts_total > 0) {
        /* acceptance length = 1 + accepted / drafts (REFERENCE §3, peer naming) */
        fprintf(stderr, "speculation: k=%d, %lld drafts, %lld draft tokens, %lld accepted; acceptance length %.2f, "
                        "acceptance rate %.3f; per position:", es.spec_max_k, (long long)es.spec_num_drafts_total,
                (long long)es.spec_num_draft_tokens_total, (long long)es.spec_num_accepted_tokens_total,
                1.0 + (double)es.spec_num_accepted_tokens_total / (double)es.spec_num_drafts_total,
                es.spec_num_draft_tokens_total ? (double)es.spec_num_accepted_tokens_total / (double)es.spec_num_draft_tokens_total : 0.0);
        for (int i = 0; i < es.spec_max_k && i < 16; i++)
            fprintf(stderr, " %.3f", (double)es.spec_accepted_per_pos_total[i] / (double)es.spec_num_drafts_total);
        fputc('\n', stderr);
        if (es.spec_verify_steps_total > 0)
            fprintf(stderr, "time split: draft %.1f ms/step, verify forward %.1f ms/step (%lld steps); draft extend "
                            "%.2f s, all forward passes %.2f s (prompt included)\n",
                    1e3 * es.spec_draft_propose_seconds_total / (double)es.spec_verify_steps_total,
                    1e3 * es.spec_verify_forward_seconds_total / (double)es.spec_verify_steps_total,
                    (long long)es.spec_verify_steps_total,
                    es.spec_draft_seconds_total - es.spec_draft_propose_seconds_total, es.forward_seconds_total);
    }
    rc = fin == FINISH_ERROR ? 1 : 0;
out:
    if (s) engine_stream_release(s);
    free(ids);
    specd_bundle_free(&b);
    cfg_free(t, 2);
    return rc;
}

/* ==== tokenize / detokenize ==== */
typedef struct tok_opts {
    char *model, *tokenizer, *text;
    bool no_special, skip_special;
} tok_opts;
#define T(f) offsetof(tok_opts, f)
static const cfg_option tok_options[] = {
    {"model", CFG_STR, NULL, NB, T(model), CFG_NOENV, NULL, "GGUF file or HF directory whose tokenizer to use"},
    {"tokenizer", CFG_STR, NULL, NB, T(tokenizer), CFG_NOENV, NULL, "a Hugging Face tokenizer.json"},
    {"text", CFG_STR, NULL, NB, T(text), CFG_NOENV, NULL, "text to tokenize (else the argument or stdin)"},
    {"no-special", CFG_BOOL, "false", NB, T(no_special), CFG_NOENV, NULL, "tokenize special-token strings as text"},
    {"skip-special", CFG_BOOL, "false", NB, T(skip_special), CFG_NOENV, NULL, "detokenize: drop special tokens"},
};
#undef T

static char *read_all(FILE *f, size_t *len) {
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    if (!buf) return NULL;
    for (;;) {
        if (n + 4096 > cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) return free(buf), NULL;
            buf = nb;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0) break;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static int tok_cmd(int argc, char **argv, bool detok) {
    tok_opts o;
    memset(&o, 0, sizeof o);
    cfg_table t = {.title = "options", .opts = tok_options, .n_opts = sizeof tok_options / sizeof tok_options[0],
                   .base = &o};
    specd_err err = {{0}};
    const char *pos[2];
    size_t n_pos = 0;
    bool help = false;
    int rc = 2;
    specd_bundle b;
    memset(&b, 0, sizeof b);
    char *input = NULL;
    size_t in_len = 0;
    if (cfg_defaults(&t, 1, &err) || cfg_parse_args(&t, 1, argc, argv, pos, 1, &n_pos, &help, &err)) {
        fprintf(stderr, "specd %s: %s\n", detok ? "detokenize" : "tokenize", err.msg);
        goto out;
    }
    if (help) {
        printf("usage: specd %s (--model MODEL | --tokenizer FILE) %s\n", detok ? "detokenize" : "tokenize",
               detok ? "[IDS-JSON | stdin]   ids as a JSON array -> text on stdout"
                     : "[--text TEXT | TEXT | stdin]   -> ids as a JSON array on stdout");
        cfg_print_help(stdout, &t, 1);
        rc = 0;
        goto out;
    }
    if (!o.model == !o.tokenizer) {
        fprintf(stderr, "specd %s: give exactly one of --model or --tokenizer\n", detok ? "detokenize" : "tokenize");
        goto out;
    }
    rc = 1;
    if (specd_tokenizer_load(o.model, o.tokenizer, &b, &err)) {
        fprintf(stderr, "specd: %s\n", err.msg);
        goto out;
    }
    if (o.text) input = strdup(o.text), in_len = strlen(o.text);
    else if (n_pos) input = strdup(pos[0]), in_len = strlen(pos[0]);
    else input = read_all(stdin, &in_len);
    if (!input) goto out;
    if (!detok) {
        int32_t *ids = NULL;
        size_t n = 0;
        if (tok_encode(b.tok, input, in_len, !o.no_special, &ids, &n, &err)) {
            fprintf(stderr, "specd tokenize: %s\n", err.msg);
            goto out;
        }
        putchar('[');
        for (size_t i = 0; i < n; i++) printf(i ? ", %d" : "%d", ids[i]);
        printf("]\n");
        free(ids);
    } else {
        json_error_t je;
        json_t *arr = json_loadb(input, in_len, 0, &je);
        if (!json_is_array(arr)) {
            fprintf(stderr, "specd detokenize: expected a JSON array of token ids\n");
            json_decref(arr);
            goto out;
        }
        size_t n = json_array_size(arr);
        int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
        for (size_t i = 0; ids && i < n; i++) {
            json_t *v = json_array_get(arr, i);
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= tok_vocab_size(b.tok)) {
                fprintf(stderr, "specd detokenize: element %zu is not a token id of this vocabulary\n", i);
                free(ids);
                json_decref(arr);
                goto out;
            }
            ids[i] = (int32_t)json_integer_value(v);
        }
        json_decref(arr);
        char *text = NULL;
        size_t len = 0;
        if (!ids || tok_decode(b.tok, ids, n, o.skip_special, &text, &len, &err)) {
            fprintf(stderr, "specd detokenize: %s\n", err.msg);
            free(ids);
            goto out;
        }
        fwrite(text, 1, len, stdout);
        if (isatty(1)) putchar('\n');
        free(text);
        free(ids);
    }
    rc = 0;
out:
    free(input);
    specd_bundle_free(&b);
    cfg_free(&t, 1);
    return rc;
}

int specd_tokenize_main(int argc, char **argv) { return tok_cmd(argc, argv, false); }
int specd_detokenize_main(int argc, char **argv) { return tok_cmd(argc, argv, true); }
