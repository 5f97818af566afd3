/*
 * results.h: reading result files back, comparing them, and plotting them.
 *
 * A result file (written by specd-bench --save-result) is either one run
 * (metrics at the top level, vLLM-style) or a concurrency sweep ("sweep": a
 * list of runs, each with its "max_concurrency"). Both are seen here as a
 * list of levels, so comparison and plots treat them alike.
 *
 * Comparison prints, for each metric, the value of every file and its ratio
 * to the first file's (same concurrency level when the files are sweeps).
 * Plots are PNGs drawn by gnuplot (pngcairo, else png) from data files and a
 * script that are left next to the images, so every figure can be redrawn.
 * Threading: single-threaded; spawns gnuplot and waits for it.
 */
#ifndef SPECD_BENCH_RESULTS_H
#define SPECD_BENCH_RESULTS_H

#include <jansson.h>
#include <stdio.h>

#include "engine/util/err.h"

typedef struct bench_result {
    char *label;   /* owned: the file's "label", else its base name */
    json_t *root;  /* owned reference */
    json_t **lvl;  /* borrowed pointers into root: the runs */
    size_t n_lvl;
} bench_result;

/* Loads a result file. Returns 0 or -1 with err set. */
int bench_result_load(const char *path, bench_result *r, specd_err *err);
/* Wraps an in-memory result (takes a new reference on root). */
int bench_result_wrap(json_t *root, const char *label, bench_result *r, specd_err *err);
void bench_result_free(bench_result *r);

/* Number of a level, NAN when absent or null. */
double bench_result_num(json_t *lvl, const char *key);

/* Prints the comparison table (markdown when md). Returns 0. */
int bench_compare_print(FILE *f, const bench_result *r, size_t n, int md);

/* Writes PNG plots into dir (created if missing): latency CDFs, throughput
 * and TPOT against concurrency (when any file is a sweep), and acceptance per
 * position (when any run has spec-decode metrics). Returns 0, or -1 with err
 * set when gnuplot fails or is missing. */
int bench_plot(const char *dir, const bench_result *r, size_t n, specd_err *err);

#endif
