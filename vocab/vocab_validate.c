/*
 * vocab_validate.c: `specd vocab validate`: how much of what the target
 * actually says a draft vocabulary can propose.
 *
 *   1. held-out coverage: the assistant tokens (chat-template loss mask) of
 *      the data's conversations that have responses, share with t2d true;
 *   2. greedy coverage: the target's own greedy continuation of each
 *      conversation's user turns (multi-turn: turn k is asked after the
 *      target's own answers to turns < k), bounded by --num-samples and
 *      --max-new-tokens, share of generated tokens with t2d true, and the
 *      most frequent generated tokens the draft can never propose.
 * Both are reported per category when the data has a "category" field.
 *
 * The target runs through the engine API (engine_submit / engine_stream_wait,
 * temperature 0) on the CPU backend: the same path `specd generate` uses, so
 * these are the tokens a speculative server would have to verify.
 * Threading: main thread; the engine runs its own thread.
 */
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/backend/backend.h"
#include "engine/model/model.h"
#include "engine/runtime/engine.h"
#include "vocab/vocab_cli.h"
#include "vocab/vocab_count.h"
#include "vocab/vocab_data.h"
#include "vocab/vocab_map.h"
#include "vocab/vocab_target.h"

#define MAX_FILES 32

int vocab_cli_load_data(vocab_dataset *ds, char **files, int n_files, char **resp, int n_resp, int64_t max_records);

static void validate_usage(FILE *f) {
    fprintf(f, "usage: specd vocab validate --draft DIR|MAPFILE --target MODEL --data FILE [flags]\n"
               "Coverage of a draft vocabulary on held-out assistant tokens and on the target's own greedy\n"
               "outputs for the data's user turns (per category when the data has one).\n"
               "  --draft DIR|FILE      draft head directory, build output, vocab_map.safetensors or d2t.npy\n"
               "  --target MODEL        target .gguf or HF directory\n"
               "  --data FILE           JSONL data (repeatable; formats as for count)\n"
               "  --responses FILE      answers for {turns} records (repeatable)\n"
               "  --num-samples N       use the first N records (default 64)\n"
               "  --max-new-tokens N    greedy tokens per turn (default 256)\n"
               "  --per-category N      keep only the first N records of each category (bounded and balanced)\n"
               "  --max-turns N         greedy user turns per record (default: all)\n"
               "  --max-model-len N     context per sequence (default 2048)\n"
               "  --max-num-seqs N      sequences decoded together (default 8)\n"
               "  --threads N           CPU threads for the target (default 2)\n"
               "  --no-greedy           held-out coverage only (no model run)\n"
               "  --save-responses FILE write the greedy answers as FastChat-style JSONL\n");
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double pct(int64_t a, int64_t b) { return b ? 100.0 * (double)a / (double)b : 0.0; }

static const char *cat_name(const vocab_dataset *ds, size_t c) {
    return c < ds->n_categories ? ds->categories[c] : "(no category)";
}

typedef struct greedy_state {
    char **answers;   /* [n_rec * max_turns] answer text (malloc'd) or NULL */
    size_t max_turns;
    int64_t *gen_freq; /* [V] generated-token counts */
    int64_t *cat_gen, *cat_cov, *cat_samples; /* [n_cat] */
    int64_t gen_tokens, turns_run, turns_skipped;
    const uint8_t *t2d; /* [V] the map under test */
} greedy_state;

/* Runs one turn for every record that has it; returns -1 on an engine error. */
static int greedy_round(engine *eng, const vocab_target *tg, const vocab_dataset *ds, size_t turn, int32_t max_new,
                        int32_t max_len, greedy_state *gs) {
    size_t n = ds->n_rec;
    engine_stream **streams = calloc(n, sizeof *streams);
    chat_message *msgs = calloc(2 * gs->max_turns + 1, sizeof *msgs);
    if (!streams || !msgs) {
        free(streams);
        free(msgs);
        return -1;
    }
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        const vocab_record *r = &ds->rec[i];
        if (turn >= r->n_turns || turn >= gs->max_turns) continue;
        if (turn > 0 && !gs->answers[i * gs->max_turns + turn - 1]) continue; /* earlier turn skipped */
        size_t nm = 0;
        if (r->system) msgs[nm++] = (chat_message){.role = "system", .content = r->system};
        for (size_t k = 0; k <= turn; k++) {
            msgs[nm++] = (chat_message){.role = "user", .content = r->turns[k]};
            if (k < turn) msgs[nm++] = (chat_message){.role = "assistant", .content = gs->answers[i * gs->max_turns + k]};
        }
        int32_t *ids = NULL;
        size_t n_ids = 0;
        specd_err err = {0};
        chat_options opt = {.add_generation_prompt = true, .thinking = -1};
        if (tok_chat_encode(tg->tok, msgs, nm, &opt, &ids, &n_ids, NULL, &err) < 0 || (int64_t)n_ids + 1 >= max_len) {
            gs->turns_skipped++;
            free(ids);
            continue;
        }
        engine_request req = {0};
        sampling_params_init(&req.sp);
        req.sp.temperature = 0.0f;
        int64_t room = (int64_t)max_len - (int64_t)n_ids;
        req.sp.max_tokens = max_new < room ? max_new : (int32_t)room;
        req.prompt = ids;
        req.n_prompt = n_ids;
        req.request_id = "vocab-validate";
        engine_status st;
        streams[i] = engine_submit(eng, &req, NULL, NULL, &st, &err);
        free(ids);
        if (!streams[i]) {
            fprintf(stderr, "specd vocab validate: line %lld turn %zu: %s\n", (long long)r->line, turn + 1, err.msg);
            gs->turns_skipped++;
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (!streams[i]) continue;
        const vocab_record *r = &ds->rec[i];
        size_t cat = r->category >= 0 ? (size_t)r->category : ds->n_categories;
        char *text = NULL;
        size_t tl = 0;
        bool failed = false;
        for (;;) {
            engine_output *o = NULL;
            if (engine_stream_wait(streams[i], &o, -1.0) != 1) continue;
            for (size_t k = 0; k < o->n_tokens; k++) {
                int32_t id = o->token_ids[k];
                gs->gen_freq[id]++;
                gs->cat_gen[cat]++;
                gs->cat_cov[cat] += gs->t2d[id] != 0;
                gs->gen_tokens++;
            }
            if (o->text_len) {
                char *nt = realloc(text, tl + o->text_len + 1);
                if (nt) {
                    memcpy(nt + tl, o->text, o->text_len);
                    tl += o->text_len;
                    nt[tl] = '\0';
                    text = nt;
                }
            }
            finish_reason fin = o->finish;
            if (fin == FINISH_ERROR || fin == FINISH_ABORT) {
                fprintf(stderr, "specd vocab validate: line %lld: %s\n", (long long)r->line, o->error);
                failed = true;
            }
            engine_output_free(o);
            if (fin != FINISH_NONE) break;
        }
        engine_stream_release(streams[i]);
        if (failed) {
            rc = -1;
            free(text);
            continue;
        }
        if (!text) text = strdup("");
        gs->answers[i * gs->max_turns + turn] = text;
        gs->turns_run++;
        if (turn == 0) gs->cat_samples[cat]++;
    }
    free(streams);
    free(msgs);
    return rc;
}

static int save_responses(const char *path, const vocab_dataset *ds, const greedy_state *gs, specd_err *err) {
    FILE *f = fopen(path, "w");
    if (!f) return specd_err_set(err, "%s: cannot write", path);
    for (size_t i = 0; i < ds->n_rec; i++) {
        if (!gs->answers[i * gs->max_turns]) continue;
        json_t *turns = json_array();
        for (size_t k = 0; k < gs->max_turns && gs->answers[i * gs->max_turns + k]; k++)
            json_array_append_new(turns, json_string(gs->answers[i * gs->max_turns + k]));
        json_t *choice = json_pack("{s:i, s:o}", "index", 0, "turns", turns);
        json_t *o = json_pack("{s:I, s:s, s:[o]}", "question_id",
                              (json_int_t)(ds->rec[i].question_id >= 0 ? ds->rec[i].question_id : ds->rec[i].line),
                              "model_id", "specd-greedy", "choices", choice);
        char *s = o ? json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII) : NULL;
        if (s) fprintf(f, "%s\n", s);
        free(s);
        json_decref(o);
    }
    return fclose(f) == 0 ? 0 : specd_err_set(err, "%s: write failed", path);
}

typedef struct { int64_t count, id; } uncovered;
static int cmp_unc(const void *a, const void *b) {
    const uncovered *x = a, *y = b;
    if (x->count != y->count) return x->count > y->count ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The most frequent tokens in FREQ with t2d false. */
static void print_uncovered(const char *what, const int64_t *freq, const vocab_map *m, const tokenizer *tok) {
    int64_t n = 0, total = 0, distinct = 0;
    uncovered *u = malloc(sizeof *u * (size_t)m->n_target);
    if (!u) return;
    for (int64_t i = 0; i < m->n_target; i++)
        if (freq[i] > 0 && !m->t2d[i]) {
            u[n++] = (uncovered){freq[i], i};
            total += freq[i];
            distinct++;
        }
    qsort(u, (size_t)n, sizeof *u, cmp_unc);
    printf("%s: %lld distinct tokens the draft can never propose (%lld occurrences)%s\n", what, (long long)distinct,
           (long long)total, n ? "; most frequent:" : "");
    for (int64_t k = 0; k < n && k < 10; k++) {
        char b[64];
        vocab_token_display(tok, u[k].id, b, sizeof b);
        printf("  id %lld \"%s\" x%lld\n", (long long)u[k].id, b, (long long)u[k].count);
    }
    free(u);
}

int vocab_validate_main(int argc, char **argv) {
    static const struct option opts[] = {
        {"draft", 1, 0, 'D'},          {"target", 1, 0, 't'},        {"data", 1, 0, 'd'},
        {"responses", 1, 0, 'r'},      {"num-samples", 1, 0, 'n'},   {"max-new-tokens", 1, 0, 'g'},
        {"max-model-len", 1, 0, 'L'},  {"max-num-seqs", 1, 0, 'S'},  {"threads", 1, 0, 'j'},
        {"no-greedy", 0, 0, 'G'},      {"save-responses", 1, 0, 's'}, {"help", 0, 0, 'h'},
        {"per-category", 1, 0, 'P'},   {"max-turns", 1, 0, 'T'},
        {0, 0, 0, 0}};
    const char *draft = NULL, *target = NULL, *save = NULL;
    char *data[MAX_FILES], *resp[MAX_FILES];
    int n_data = 0, n_resp = 0;
    long num = 64, max_new = 256, max_len = 2048, max_seqs = 8, threads = 2, per_cat = 0, max_turns_opt = 0;
    bool greedy = true;
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        char *e = NULL;
        switch (c) {
        case 'D': draft = optarg; break;
        case 't': target = optarg; break;
        case 'd':
            if (n_data == MAX_FILES) return 2;
            data[n_data++] = optarg;
            break;
        case 'r':
            if (n_resp == MAX_FILES) return 2;
            resp[n_resp++] = optarg;
            break;
        case 'n': num = strtol(optarg, &e, 10); break;
        case 'g': max_new = strtol(optarg, &e, 10); break;
        case 'L': max_len = strtol(optarg, &e, 10); break;
        case 'S': max_seqs = strtol(optarg, &e, 10); break;
        case 'j': threads = strtol(optarg, &e, 10); break;
        case 'G': greedy = false; break;
        case 'P': per_cat = strtol(optarg, &e, 10); break;
        case 'T': max_turns_opt = strtol(optarg, &e, 10); break;
        case 's': save = optarg; break;
        case 'h': validate_usage(stdout); return 0;
        default: validate_usage(stderr); return 2;
        }
        if (e && (*e || e == optarg)) {
            fprintf(stderr, "specd vocab validate: %s is not an integer\n", optarg);
            return 2;
        }
    }
    if (!draft || !target || !n_data || optind < argc || num < 1 || max_new < 1 || max_new > 1 << 20 ||
        max_len < 16 || max_len > 1 << 20 || max_seqs < 1 || max_seqs > 256 || threads < 1 || threads > 256 || per_cat < 0 || max_turns_opt < 0) {
        fprintf(stderr, "specd vocab validate: --draft, --target and --data are required; numbers must be positive\n");
        validate_usage(stderr);
        return 2;
    }
    int rc = 1;
    specd_err err = {0};
    vocab_target tg = {0};
    vocab_map_raw raw = {0};
    vocab_map m = {0};
    vocab_dataset ds = {0};
    vocab_count_result cr = {0};
    greedy_state gs = {0};
    backend *be = NULL;
    model *mdl = NULL;
    engine *eng = NULL;
    if (vocab_target_open(target, &tg, &err) < 0 || vocab_map_load_raw(draft, &raw, &err) < 0 ||
        vocab_map_from_raw(&raw, tg.n_vocab, &m, &err) < 0) {
        fprintf(stderr, "specd vocab validate: %s\n", err.msg);
        goto out;
    }
    printf("map: %s: draft vocab %lld -> target vocab %lld (ids %lld..%lld)\n", raw.source, (long long)m.n_draft,
           (long long)m.n_target, (long long)m.used[0], (long long)m.used[m.n_draft - 1]);
    if (vocab_cli_load_data(&ds, data, n_data, resp, n_resp, per_cat ? 0 : num) < 0) goto out;
    if (per_cat) { /* first PER_CAT records of each category (and of "no category"), file order kept */
        int64_t *seen = calloc(ds.n_categories + 1, sizeof *seen);
        size_t w = 0;
        for (size_t i = 0; seen && i < ds.n_rec; i++) {
            size_t k = ds.rec[i].category >= 0 ? (size_t)ds.rec[i].category : ds.n_categories;
            if (seen[k]++ < per_cat && (int64_t)w < num) ds.rec[w++] = ds.rec[i];
            else vocab_record_free(&ds.rec[i]);
        }
        free(seen);
        ds.n_rec = w;
        printf("data: kept the first %ld records of each category: %zu records\n", per_cat, w);
    }

    /* 1. held-out assistant tokens */
    vocab_count_opts co = {.max_seq_len = 0, .n_threads = 2, .t2d = m.t2d};
    if (vocab_count(tg.tok, m.n_target, &ds, &co, &cr, &err) < 0) {
        fprintf(stderr, "specd vocab validate: %s\n", err.msg);
        goto out;
    }
    if (cr.n_processed) {
        int64_t cov = 0;
        for (size_t k = 0; k < cr.n_cat; k++) cov += cr.per_cat[k].covered_tokens;
        printf("held-out: %lld conversations, %lld assistant tokens, coverage %.4f%% (%lld not proposable)\n",
               (long long)cr.n_processed, (long long)cr.assistant_tokens, pct(cov, cr.assistant_tokens),
               (long long)(cr.assistant_tokens - cov));
        for (size_t k = 0; k < cr.n_cat && ds.n_categories; k++)
            if (cr.per_cat[k].samples)
                printf("  held-out %-14s %4lld conversations %8lld tokens  coverage %.4f%%\n", cat_name(&ds, k),
                       (long long)cr.per_cat[k].samples, (long long)cr.per_cat[k].assistant_tokens,
                       pct(cr.per_cat[k].covered_tokens, cr.per_cat[k].assistant_tokens));
        print_uncovered("held-out", cr.freq, &m, tg.tok);
    } else {
        printf("held-out: no conversation with an assistant response in the data (question-only file?)\n");
    }
    if (!greedy) {
        rc = 0;
        goto out;
    }

    /* 2. the target's own greedy outputs */
    size_t max_turns = 0;
    for (size_t i = 0; i < ds.n_rec; i++)
        if (ds.rec[i].n_turns > max_turns) max_turns = ds.rec[i].n_turns;
    if (max_turns_opt && (size_t)max_turns_opt < max_turns) max_turns = (size_t)max_turns_opt;
    size_t n_cat = ds.n_categories + 1;
    gs.max_turns = max_turns;
    gs.t2d = m.t2d;
    gs.answers = calloc(ds.n_rec * max_turns + 1, sizeof *gs.answers);
    gs.gen_freq = calloc((size_t)m.n_target, sizeof *gs.gen_freq);
    gs.cat_gen = calloc(n_cat, sizeof *gs.cat_gen);
    gs.cat_cov = calloc(n_cat, sizeof *gs.cat_cov);
    gs.cat_samples = calloc(n_cat, sizeof *gs.cat_samples);
    if (!gs.answers || !gs.gen_freq || !gs.cat_gen || !gs.cat_cov || !gs.cat_samples) goto out;
    if (!(be = bk_cpu_create((int)threads))) {
        fprintf(stderr, "specd vocab validate: cannot create the CPU backend\n");
        goto out;
    }
    model_load_opts mo = {.block_size = 16, .n_blocks = (int32_t)(max_seqs * ((max_len + 15) / 16) + 1)};
    if (model_load(target, be, &mo, &mdl, &err) < 0) {
        fprintf(stderr, "specd vocab validate: loading %s: %s\n", target, err.msg);
        goto out;
    }
    if (model_get_config(mdl)->vocab > m.n_target) {
        fprintf(stderr, "specd vocab validate: the model has %d logits, the map's target vocab is %lld\n",
                model_get_config(mdl)->vocab, (long long)m.n_target);
        goto out;
    }
    engine_config ec = {.max_model_len = (int32_t)max_len, .max_num_seqs = (int32_t)max_seqs,
                        .max_num_batched_tokens = 512, .max_waiting = 0, .enable_prefix_caching = true,
                        .num_speculative_tokens = 0};
    if (engine_create(&ec, mdl, tg.tok, &eng, &err) < 0 || engine_start(eng, &err) < 0) {
        fprintf(stderr, "specd vocab validate: engine: %s\n", err.msg);
        goto out;
    }
    double t0 = now_s();
    for (size_t turn = 0; turn < max_turns; turn++)
        if (greedy_round(eng, &tg, &ds, turn, (int32_t)max_new, (int32_t)max_len, &gs) < 0) goto out;
    double secs = now_s() - t0;
    /* covered share per category, from the per-token counts of each record's answers */
    int64_t gen_cov = 0;
    for (int64_t i = 0; i < m.n_target; i++) gen_cov += m.t2d[i] ? gs.gen_freq[i] : 0;
    printf("greedy: %lld turns generated (%lld skipped: prompt too long or refused), %lld tokens in %.1f s "
           "(%.1f tok/s), max %ld new tokens per turn\n",
           (long long)gs.turns_run, (long long)gs.turns_skipped, (long long)gs.gen_tokens, secs,
           secs > 0 ? (double)gs.gen_tokens / secs : 0.0, max_new);
    printf("greedy: coverage %.4f%% of the target's own greedy tokens (%lld of %lld not proposable)\n",
           pct(gen_cov, gs.gen_tokens), (long long)(gs.gen_tokens - gen_cov), (long long)gs.gen_tokens);
    for (size_t k = 0; k < n_cat && ds.n_categories; k++)
        if (gs.cat_samples[k])
            printf("  greedy %-14s %4lld samples %8lld tokens  coverage %.4f%%\n", cat_name(&ds, k),
                   (long long)gs.cat_samples[k], (long long)gs.cat_gen[k], pct(gs.cat_cov[k], gs.cat_gen[k]));
    print_uncovered("greedy", gs.gen_freq, &m, tg.tok);
    if (save && save_responses(save, &ds, &gs, &err) < 0) {
        fprintf(stderr, "specd vocab validate: %s\n", err.msg);
        goto out;
    }
    if (save) printf("wrote %s (greedy answers, FastChat-style JSONL)\n", save);
    rc = 0;
out:
    engine_destroy(eng);
    model_destroy(mdl);
    if (be) bk_cpu_destroy(be);
    if (gs.answers)
        for (size_t i = 0; i < ds.n_rec * gs.max_turns; i++) free(gs.answers[i]);
    free(gs.answers);
    free(gs.gen_freq);
    free(gs.cat_gen);
    free(gs.cat_cov);
    free(gs.cat_samples);
    vocab_count_result_free(&cr);
    vocab_dataset_free(&ds);
    vocab_map_free(&m);
    vocab_map_raw_free(&raw);
    vocab_target_close(&tg);
    return rc;
}
