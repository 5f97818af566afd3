/*
 * eagle3_vocab.h: validation of an EAGLE-3 head's vocabulary map (d2t / t2d),
 * usable by draft/ at load and by vocab/ (`specd vocab validate`).
 *
 * Semantics (REFERENCE.md §2 "Vocabulary mapping"):
 *   d2t int64 [draft_vocab] is an OFFSET: target_id = draft_id + d2t[draft_id].
 *   t2d bool [target_vocab]: true for the draft_vocab target ids kept.
 *   used[i] = i + d2t[i] must be strictly increasing, in [0, target_vocab),
 *   and t2d.sum() == draft_vocab with t2d[used[i]] true for every i.
 *
 * Decisions (pinned by tests/draft/test_draft_vocab.c):
 *   - no d2t and draft_vocab == target_vocab: identity, accepted;
 *   - no d2t and draft_vocab <  target_vocab: REFUSED (identity would map the
 *     draft's rows onto target ids 0..N-1: the field failure where acceptance
 *     silently collapses);
 *   - all-zeros d2t with draft_vocab < target_vocab: maps onto ids 0..N-1.
 *     With a t2d present it must agree (else refused as inconsistent); without
 *     one it is ACCEPTED WITH A WARNING (a head could legitimately keep the
 *     lowest N ids, but a never-filled d2t looks exactly like this);
 *   - a d2t whose offsets fail (out of range / not increasing / contradicting
 *     t2d) but which, read as absolute ids, would pass: refused with
 *     "d2t looks like absolute ids, expected offsets".
 * Threading: pure functions.
 */
#ifndef SPECD_DRAFT_EAGLE3_VOCAB_H
#define SPECD_DRAFT_EAGLE3_VOCAB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/util/err.h"

typedef struct eagle3_vocab_info {
    int64_t draft_vocab;
    int64_t target_vocab;
    bool has_d2t, has_t2d;
    bool identity;          /* used[i] == i for all i */
    int64_t first_id;       /* used[0] */
    int64_t last_id;        /* used[draft_vocab - 1] */
    bool warn_zero_d2t;     /* all-zeros d2t with draft_vocab < target_vocab and no t2d */
    char warning[256];      /* "" or the warning to log */
} eagle3_vocab_info;

/* Validates the map. d2t: [n_draft] offsets or NULL (absent); t2d:
 * [n_target] bytes (0 = false) or NULL (absent). used_out (optional):
 * [n_draft] target ids filled on success. info (optional) gets the summary.
 * Returns 0, or -1 with a message that names the rule and the first offending
 * index. */
int eagle3_vocab_validate(const int64_t *d2t, int64_t n_draft, const uint8_t *t2d, int64_t n_target,
                          int64_t *used_out, eagle3_vocab_info *info, specd_err *err);

/* One-line summary for the log, e.g. "draft vocab 32000 -> target 49152 via d2t
 * offsets (ids 3..49150, not identity), t2d consistent". */
void eagle3_vocab_summary(const eagle3_vocab_info *info, char *buf, size_t n);

#endif
