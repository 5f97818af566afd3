/*
 * st_load.h: reading one tensor-parallel rank's byte ranges of a (sharded)
 * safetensors checkpoint in parallel, and counting them.
 *
 * A rank never needs the whole checkpoint: the model layer (engine/model/
 * load_plan.c) lists the file byte ranges of its slices (an st_plan: a
 * column-parallel slice is a contiguous run of rows of a row-major tensor,
 * a row-parallel one is read as whole rows, a replicated tensor whole), and
 * st_prefetch reads exactly those ranges, merged and cut into chunks, with a
 * pool of threads issuing pread(2) on the shard files. The bytes land in the
 * page cache (through a per-thread scratch buffer), so that the model's
 * views of the read-only mapping (safetensors.h) then find them there
 * instead of faulting them in one page at a time on the loading thread;
 * with ST_OPEN_POISON (tests) they land in the shard's anonymous copy
 * instead, and every byte the plan did not read stays 0xA5.
 * Owns: nothing after a call returns (threads, descriptors and scratch live
 * for the call).
 * Invariants: a byte listed twice is read once (ranges are sorted and merged
 * per shard first); bytes_read is the exact number of bytes pread returned;
 * a range past a file's end, a file that shrank since it was opened (the
 * mapping would SIGBUS on it) or a read error fails the call with the file
 * named, and no thread outlives the call.
 * Threading: st_prefetch starts and joins its own threads; the st_model is
 * only read (a poisoned one's shard copies are written at disjoint ranges).
 */
#ifndef SPECD_LOADER_ST_LOAD_H
#define SPECD_LOADER_ST_LOAD_H

#include <stddef.h>
#include <stdint.h>

#include "engine/loader/safetensors.h"
#include "engine/util/err.h"

/* A byte range [off, off + len) of shard file `shard` (file offsets, the header included). */
typedef struct st_range {
    int32_t shard;
    uint64_t off, len;
} st_range;

/* A growing list of ranges. */
typedef struct st_plan {
    st_range *r;
    size_t n, cap;
} st_plan;

void st_plan_free(st_plan *p);
/* All of tensor T. */
int st_plan_whole(st_plan *p, const st_model *m, const st_tensor *t, specd_err *err);
/* Rows [row0, row0 + nrows) of T (its outermost dimension: a contiguous run for a row-major tensor). */
int st_plan_rows(st_plan *p, const st_model *m, const st_tensor *t, int64_t row0, int64_t nrows, specd_err *err);
/* The column-byte range [rb * part / n, rb * (part + 1) / n) of every row (rb = the bytes of a row, its
 * outermost index), one range per row: a row-parallel slice read as it is laid out. N must divide rb. */
int st_plan_row_parts(st_plan *p, const st_model *m, const st_tensor *t, int64_t part, int64_t n, specd_err *err);
/* Sum of the plan's lengths after merging (what st_prefetch will read); sorts and merges P in place. */
uint64_t st_plan_merge(st_plan *p);

typedef struct st_load_stats {
    double seconds;           /* wall time of the reads */
    uint64_t bytes_read;      /* bytes pread returned (each planned byte once) */
    uint64_t bytes_files;     /* size of every shard file of the checkpoint together */
    int32_t threads;          /* reader threads used */
    int32_t files_read;       /* shard files with at least one planned byte */
    size_t n_ranges;          /* ranges after merging */
} st_load_stats;

/* The default reader count: min(8, online cores), at least 1. */
int st_load_threads_default(void);
/* Reads P's ranges (merged first) of M's files with THREADS readers (<= 0: the default; at most 64).
 * STATS (may be NULL) gets the figures. -1 with the file named on any failure. */
int st_prefetch(const st_model *m, st_plan *p, int threads, st_load_stats *stats, specd_err *err);

#endif
