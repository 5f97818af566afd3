/*
 * vocab_data.h: chat data sets for counting and validation, read from JSONL.
 *
 * One JSON object per line, in any of these shapes:
 *   {"messages": [{"role": "...", "content": "..."}, ...]}   (OpenAI / HF chat)
 *   {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]} (ShareGPT)
 *   {"prompt": "...", "response": "..."}  (also "completion" for the response)
 *   {"question": "...", "answer": "..."}  (GSM8K: user question, assistant answer)
 *   {"turns": ["...", ...], "question_id": N, "category": "..."}  (MT-bench:
 *       user turns only; the assistant turns come from a responses file,
 *       matched by question_id, or the record has no responses)
 * A record may carry "category" (string): validation reports per category.
 * Responses files (vocab_data_add_responses), one object per line:
 *   {"question_id": N, "choices": [{"turns": ["...", ...]}]}   (FastChat answers)
 *   {"question_id": N, "turns": [...]} or {"question_id": N, "response": "..."}
 *
 * A line that is not such an object (bad JSON, a non-string content, no
 * usable field) is MALFORMED: it is reported with its file and line number
 * and skipped; the other lines are processed. Blank lines are ignored.
 *
 * Ownership: the dataset owns every string (copied out of the JSON).
 * Threading: built by one thread, read-only afterwards (safe to share).
 */
#ifndef SPECD_VOCAB_VOCAB_DATA_H
#define SPECD_VOCAB_VOCAB_DATA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/tokenizer/tokenizer.h"
#include "engine/util/err.h"

typedef struct vocab_record {
    chat_message *msgs;      /* the full conversation (assistant turns included when known) */
    size_t n_msgs;
    size_t n_assistant;      /* assistant messages in msgs (0: nothing to count) */
    char *system;            /* leading system message content, or NULL */
    char **turns;            /* user turns in order: the prompts for greedy generation */
    size_t n_turns;
    int32_t category;        /* index into the dataset's categories, -1 if none */
    int64_t question_id;     /* -1 if none */
    int32_t file;            /* index of the file it came from */
    int64_t line;            /* 1-based line number */
} vocab_record;

typedef struct vocab_dataset {
    vocab_record *rec;
    size_t n_rec;
    char **categories;
    size_t n_categories;
    int64_t n_lines;         /* non-blank lines read */
    int64_t n_malformed;
    char **problems;         /* "FILE:LINE: reason", the first VOCAB_DATA_MAX_PROBLEMS */
    size_t n_problems;
    int64_t n_responses_matched, n_responses_unmatched;
} vocab_dataset;

#define VOCAB_DATA_MAX_PROBLEMS 50

/* Appends the records of PATH (stopping once the dataset holds MAX_RECORDS
 * records; <= 0 = no limit). Returns 0, or -1 with err only for I/O errors
 * (malformed lines are counted in ds, not errors). */
int vocab_data_load(vocab_dataset *ds, const char *path, int64_t max_records, specd_err *err);
/* Fills the assistant turns of records that have user turns and no responses
 * from a responses file keyed by question_id. */
int vocab_data_add_responses(vocab_dataset *ds, const char *path, specd_err *err);
/* Parses one JSONL line (for tests): 0 ok (*rec filled, caller frees with
 * vocab_record_free), 1 blank, -1 malformed with the reason in err. */
int vocab_data_parse_line(vocab_dataset *ds, const char *line, size_t len, vocab_record *rec, specd_err *err);
void vocab_record_free(vocab_record *r);
void vocab_dataset_free(vocab_dataset *ds); /* NULL ok */

#endif
