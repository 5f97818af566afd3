/*
 * vocab_count.h: counting the target tokens a draft head is trained to
 * predict: the ASSISTANT tokens of each conversation rendered with the
 * target's chat template (tok_chat_encode's loss mask: assistant content and
 * its closing end-of-turn token), never the system/user/structure tokens.
 *
 * Samples are tokenized by n_threads workers, each over an interleaved share
 * of the records with its own frequency vector; the vectors and counters are
 * summed at the end, so the result does not depend on the thread count.
 * Threading: vocab_count spawns and joins its workers; the tokenizer and the
 * dataset are only read.
 */
#ifndef SPECD_VOCAB_VOCAB_COUNT_H
#define SPECD_VOCAB_VOCAB_COUNT_H

#include <stddef.h>
#include <stdint.h>

#include "engine/tokenizer/tokenizer.h"
#include "engine/util/err.h"
#include "vocab/vocab_data.h"

typedef struct vocab_count_opts {
    int32_t max_seq_len;     /* whole rendered conversation, tokens; <= 0 = no limit (longer: skipped) */
    int n_threads;           /* workers, >= 1 */
    const uint8_t *t2d;      /* optional bool [n_vocab]: also count covered assistant tokens */
} vocab_count_opts;

typedef struct vocab_cat_stats {
    int64_t samples;           /* conversations counted */
    int64_t assistant_tokens;  /* loss-mask tokens */
    int64_t covered_tokens;    /* of them with t2d true (only with opts.t2d) */
} vocab_cat_stats;

typedef struct vocab_count_result {
    int64_t n_vocab;
    int64_t *freq;             /* int64 [n_vocab]: assistant-token counts */
    int64_t n_records;         /* records offered */
    int64_t n_processed;       /* counted */
    int64_t n_skipped_long;    /* longer than max_seq_len */
    int64_t n_no_response;     /* no assistant message: nothing to count */
    int64_t n_failed;          /* the template refused the conversation */
    int64_t total_tokens;      /* all tokens of the counted conversations */
    int64_t assistant_tokens;  /* sum of freq */
    int64_t distinct;          /* ids with freq > 0 */
    int64_t longest;           /* longest counted conversation, tokens */
    vocab_cat_stats *per_cat;  /* [n_cat]: dataset categories, then one for "no category" */
    size_t n_cat;
    double seconds;            /* wall time of the tokenize+count phase */
    double cpu_seconds;        /* process CPU time of that phase (all threads) */
    char first_failure[384];   /* "" or the first template error with its line */
} vocab_count_result;

/* Counts DS with tokenizer T into R (n_vocab >= tok_vocab_size(t)). Returns 0
 * or -1 with err (bad options, out of memory). Caller frees R. */
int vocab_count(const tokenizer *t, int64_t n_vocab, const vocab_dataset *ds, const vocab_count_opts *o,
                vocab_count_result *r, specd_err *err);
void vocab_count_result_free(vocab_count_result *r); /* NULL ok */

#endif
