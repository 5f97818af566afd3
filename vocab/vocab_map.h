/*
 * vocab_map.h: building, writing and loading the draft vocabulary map of an
 * EAGLE-3 head (REFERENCE.md §2 "Vocabulary mapping").
 *
 *   used  int64 [draft_vocab]   target ids the draft can propose, strictly increasing
 *   d2t   int64 [draft_vocab]   OFFSETS: target_id = draft_id + d2t[draft_id] (d2t[i] = used[i] - i)
 *   t2d   bool  [target_vocab]  t2d[used[i]] = true, all other entries false
 *
 * Build rule (vocab_build), deterministic for a given input:
 *   1. forced ids (EOS, stop and chat-structure tokens, --always-include) are
 *      always kept, whatever their frequency;
 *   2. the remaining slots take the most frequent ids with freq > 0, ties
 *      broken by the lower id;
 *   3. if fewer distinct ids were seen than the slots left, the rest is FILLED
 *      with the lowest ids not already kept, skipping the ids marked in
 *      FILL_AVOID (the CLI marks the target's special tokens) unless nothing
 *      else is left (for a byte-level BPE the lowest plain ids are the
 *      single-byte tokens, which can spell any text); the report says how many
 *      and which range;
 *   4. the kept ids are sorted ascending: used[i] is the i-th smallest.
 * Refused: draft_vocab < 1, draft_vocab >= target_vocab (a map is pointless
 * when nothing is dropped), a negative count (with its index), a forced id out
 * of range, more distinct forced ids than draft slots.
 *
 * Ownership: a vocab_map owns its three arrays; vocab_map_free releases them.
 * Threading: pure functions (file I/O only where named).
 */
#ifndef SPECD_VOCAB_VOCAB_MAP_H
#define SPECD_VOCAB_VOCAB_MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/util/err.h"

typedef struct vocab_map {
    int64_t n_draft;     /* draft vocab size */
    int64_t n_target;    /* target vocab size */
    int64_t *used;       /* [n_draft] ascending target ids */
    int64_t *d2t;        /* [n_draft] offsets, used[i] - i */
    uint8_t *t2d;        /* [n_target] 0/1 */
} vocab_map;

void vocab_map_free(vocab_map *m); /* NULL ok; leaves a zeroed struct */

typedef struct vocab_build_report {
    int64_t total_count;      /* sum of freq (assistant tokens counted) */
    int64_t covered_count;    /* sum of freq over kept ids */
    int64_t n_seen;           /* ids with freq > 0 */
    int64_t n_seen_kept;      /* of those, kept */
    int64_t n_forced;         /* distinct forced ids */
    int64_t n_forced_extra;   /* forced ids the frequency rule alone would not have kept */
    int64_t n_filled;         /* ids added by the fill rule (step 3) */
    int64_t fill_first, fill_last; /* range of filled ids (-1 if none) */
    int64_t min_kept_count;   /* smallest freq among ids kept by frequency (-1 if none) */
    int64_t lowest_id, highest_id;
} vocab_build_report;

/* Builds the map from FREQ (int64 [n_target], counts >= 0) keeping N_DRAFT ids,
 * with FORCED (n_forced ids, duplicates allowed) always kept. FILL_AVOID
 * (bool [n_target] or NULL) marks ids the fill takes last. OUT is filled
 * (caller frees with vocab_map_free); REP (optional) gets the report.
 * Returns 0 or -1 with err (see the refusals above). */
int vocab_build(const int64_t *freq, int64_t n_target, int64_t n_draft, const int64_t *forced, size_t n_forced,
                const uint8_t *fill_avoid, vocab_map *out, vocab_build_report *rep, specd_err *err);

/* Reads a token frequency vector (int64 [n] .npy, C order). With
 * EXPECTED_N > 0 a vector of another length is refused; negative counts are
 * refused with their index; other dtypes are refused naming the dtype found.
 * *freq is malloc'd. Returns 0 or -1 with err. */
int vocab_freq_load(const char *path, int64_t expected_n, int64_t **freq, int64_t *n, specd_err *err);

/* Writes DIR/d2t.npy (int64 [n_draft]), DIR/t2d.npy (bool [n_target]) and
 * DIR/vocab_map.safetensors (tensors "d2t" I64 [n_draft], "t2d" BOOL
 * [n_target]; __metadata__ format=pt, draft_vocab_size, target_vocab_size,
 * d2t_semantics=offset). DIR is created if missing. */
int vocab_map_write(const char *dir, const vocab_map *m, specd_err *err);

/* A map as found on disk, before validation: either array may be absent. */
typedef struct vocab_map_raw {
    char source[4096];        /* what was read, for messages */
    int64_t *d2t;             /* [n_d2t] or NULL */
    int64_t n_d2t;
    uint8_t *t2d;             /* [n_t2d] or NULL */
    int64_t n_t2d;
    char d2t_dtype[16];       /* as stored ("I64", "<i8", ...) */
    char t2d_dtype[16];
    int64_t draft_vocab_cfg;  /* draft_vocab_size from a config.json or metadata, -1 if none */
    int64_t target_vocab_cfg; /* target vocab from config/metadata, -1 if none */
} vocab_map_raw;

/* Loads d2t / t2d from PATH: a .safetensors file, a .npy file (d2t.npy or
 * t2d.npy, with its sibling if present), a directory holding
 * vocab_map.safetensors, or d2t.npy / t2d.npy, or a draft head (one
 * *.safetensors or an index, + config.json for the sizes). Tensors must be
 * 1-D; d2t int64 (I64/<i8; I32 is widened and noted), t2d bool (BOOL/|b1; U8
 * with 0/1 values is accepted and noted). Returns 0 or -1 with err. */
int vocab_map_load_raw(const char *path, vocab_map_raw *out, specd_err *err);
void vocab_map_raw_free(vocab_map_raw *r); /* NULL ok */

/* Validates RAW with draft/eagle3_vocab (offsets, ordering, range, t2d
 * agreement, absolute-id detection) for a target of N_TARGET ids (-1: take it
 * from t2d or the config) and fills OUT. Returns 0 or -1 with err. */
int vocab_map_from_raw(const vocab_map_raw *raw, int64_t n_target, vocab_map *out, specd_err *err);

#endif
