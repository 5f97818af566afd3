/*
 * dataset.h: the prompts a benchmark sends.
 *
 * Owns loading a workload into memory before the clock starts: JSONL prompt
 * files (MT-bench {question_id, category, turns} -> first turn; GSM8K
 * {question, answer} -> question; HumanEval {prompt}; generic "jsonl" taking
 * the first of prompt | question | text | turns[0], with an optional
 * per-line output_len), plain or gzip-compressed (name ending in .gz), and the
 * "random" workload: input and output lengths drawn uniformly from
 * [len * (1 - r), len * (1 + r)] (vLLM's --random-range-ratio) and text made
 * of words from a fixed list of common English words, chosen by the seeded
 * PRNG, so the same seed gives the same bytes everywhere. A common word is
 * one token in GPT-2-style BPE vocabularies (leading space included), so the
 * input length in words approximates tokens; the benchmark counts the real
 * number from the server's usage, never from this estimate.
 *
 * File prompts are used in file order; when --num-prompts exceeds the file,
 * the list wraps around. Threading: loaded once, then read-only.
 */
#ifndef SPECD_BENCH_DATASET_H
#define SPECD_BENCH_DATASET_H

#include <stddef.h>
#include <stdint.h>

#include "engine/util/err.h"

typedef struct bench_prompt {
    char *text;      /* owned, UTF-8, NUL-terminated */
    int output_len;  /* max_tokens for this request; -1 = the run's --max-tokens */
    int input_words; /* random workload: words generated (an input-length hint); else 0 */
} bench_prompt;

typedef struct bench_dataset {
    bench_prompt *p; /* owned array of n */
    size_t n;
} bench_dataset;

typedef struct bench_dataset_cfg {
    const char *name;   /* mt-bench | gsm8k | humaneval | jsonl | random */
    const char *path;   /* file for all but random */
    size_t num_prompts; /* prompts to produce (>= 1) */
    uint64_t seed;
    int random_input_len, random_output_len; /* random workload, in tokens (~words) */
    double random_range_ratio;               /* in [0, 1) */
} bench_dataset_cfg;

/* Builds the workload. Returns 0 and *out (destroy with bench_dataset_destroy),
 * or -1 with err set (unknown name, unreadable file, a line without a prompt
 * field, an empty file, bad random parameters). */
int bench_dataset_load(const bench_dataset_cfg *cfg, bench_dataset **out, specd_err *err);
void bench_dataset_destroy(bench_dataset *d);

/* Extracts the prompt of one JSONL line for a dataset kind. Returns a new
 * string (caller frees) or NULL with err set. *output_len gets the line's
 * output_len field or -1. */
char *bench_dataset_parse_line(const char *kind, const char *line, int *output_len, specd_err *err);

/* Appends `words` words generated from rng state `seed_stream` to a new
 * string (caller frees): the random workload's text. NULL on OOM. */
char *bench_dataset_random_text(uint64_t seed, size_t index, int words);

#endif
