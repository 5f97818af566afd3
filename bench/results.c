/*
 * results.c: result files as lists of levels, the comparison table, and the
 * gnuplot figures (see results.h).
 */
#include "bench/results.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bench/stats.h"

/* ---- loading --------------------------------------------------------------------- */

static int fill_levels(bench_result *r, specd_err *err) {
    json_t *sw = json_object_get(r->root, "sweep");
    if (json_is_array(sw) && json_array_size(sw) > 0) {
        r->n_lvl = json_array_size(sw);
        r->lvl = calloc(r->n_lvl, sizeof *r->lvl);
        if (!r->lvl) return specd_err_set(err, "out of memory");
        for (size_t i = 0; i < r->n_lvl; i++) r->lvl[i] = json_array_get(sw, i);
    } else {
        if (!json_object_get(r->root, "output_throughput"))
            return specd_err_set(err, "%s: not a specd-bench result (no output_throughput, no sweep)", r->label);
        r->n_lvl = 1;
        r->lvl = calloc(1, sizeof *r->lvl);
        if (!r->lvl) return specd_err_set(err, "out of memory");
        r->lvl[0] = r->root;
    }
    return 0;
}

int bench_result_wrap(json_t *root, const char *label, bench_result *r, specd_err *err) {
    memset(r, 0, sizeof *r);
    r->root = json_incref(root);
    r->label = strdup(label ? label : "run");
    if (!r->label) return specd_err_set(err, "out of memory");
    return fill_levels(r, err);
}

int bench_result_load(const char *path, bench_result *r, specd_err *err) {
    memset(r, 0, sizeof *r);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) return specd_err_set(err, "%s: %s (line %d)", path, jerr.text, jerr.line);
    const char *label = json_string_value(json_object_get(root, "label"));
    const char *base = strrchr(path, '/');
    int rc = bench_result_wrap(root, label ? label : (base ? base + 1 : path), r, err);
    json_decref(root);
    return rc;
}

void bench_result_free(bench_result *r) {
    if (!r) return;
    json_decref(r->root);
    free(r->label);
    free(r->lvl);
    memset(r, 0, sizeof *r);
}

double bench_result_num(json_t *lvl, const char *key) {
    json_t *v = json_object_get(lvl, key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

/* max_concurrency of a level; 0 for unlimited/absent. */
static double level_conc(json_t *lvl) {
    double c = bench_result_num(lvl, "max_concurrency");
    return isnan(c) ? 0 : c;
}

static json_t *find_level(const bench_result *r, double conc) {
    for (size_t i = 0; i < r->n_lvl; i++)
        if (level_conc(r->lvl[i]) == conc) return r->lvl[i];
    return r->n_lvl == 1 ? r->lvl[0] : NULL;
}

/* ---- comparison ---------------------------------------------------------------------- */

static const char *const ROWS[][2] = {
    {"completed", "successful requests"},
    {"failed", "failed requests"},
    {"request_throughput", "request throughput (req/s)"},
    {"output_throughput", "output token throughput (tok/s)"},
    {"total_token_throughput", "total token throughput (tok/s)"},
    {"mean_ttft_ms", "mean TTFT (ms)"},      {"median_ttft_ms", "median TTFT (ms)"},
    {"p90_ttft_ms", "P90 TTFT (ms)"},        {"p99_ttft_ms", "P99 TTFT (ms)"},
    {"mean_tpot_ms", "mean TPOT (ms)"},      {"median_tpot_ms", "median TPOT (ms)"},
    {"p90_tpot_ms", "P90 TPOT (ms)"},        {"p99_tpot_ms", "P99 TPOT (ms)"},
    {"mean_itl_ms", "mean ITL (ms)"},        {"median_itl_ms", "median ITL (ms)"},
    {"p90_itl_ms", "P90 ITL (ms)"},          {"p99_itl_ms", "P99 ITL (ms)"},
    {"mean_e2el_ms", "mean E2EL (ms)"},      {"median_e2el_ms", "median E2EL (ms)"},
    {"p90_e2el_ms", "P90 E2EL (ms)"},        {"p99_e2el_ms", "P99 E2EL (ms)"},
    {"spec_decode_acceptance_rate", "acceptance rate"},
    {"spec_decode_acceptance_length", "acceptance length"},
};
#define N_ROWS (sizeof ROWS / sizeof ROWS[0])

int bench_compare_print(FILE *f, const bench_result *r, size_t n, int md) {
    for (size_t l = 0; l < r[0].n_lvl; l++) {
        double conc = level_conc(r[0].lvl[l]);
        if (conc > 0) fprintf(f, md ? "\n**max concurrency %g**\n\n" : "\n== max concurrency %g ==\n", conc);
        else fprintf(f, md ? "\n**unlimited concurrency**\n\n" : "\n== unlimited concurrency ==\n");
        if (md) {
            fprintf(f, "| metric | %s |", r[0].label);
            for (size_t i = 1; i < n; i++) fprintf(f, " %s | ratio |", r[i].label);
            fprintf(f, "\n|---|---:|");
            for (size_t i = 1; i < n; i++) fprintf(f, "---:|---:|");
            fputc('\n', f);
        } else {
            fprintf(f, "%-34s %14.14s", "metric", r[0].label);
            for (size_t i = 1; i < n; i++) fprintf(f, " %14.14s %8s", r[i].label, "ratio");
            fputc('\n', f);
        }
        json_t *base = r[0].lvl[l];
        for (size_t k = 0; k < N_ROWS; k++) {
            double b = bench_result_num(base, ROWS[k][0]);
            int any = !isnan(b);
            for (size_t i = 1; i < n && !any; i++) {
                json_t *o = find_level(&r[i], conc);
                any = o && !isnan(bench_result_num(o, ROWS[k][0]));
            }
            if (!any) continue;
            int prec = k < 2 ? 0 : strstr(ROWS[k][0], "acceptance") ? 3 : 2;
            char bs[32] = "-";
            if (!isnan(b)) snprintf(bs, sizeof bs, "%.*f", prec, b);
            if (md) fprintf(f, "| %s | %s |", ROWS[k][1], bs);
            else fprintf(f, "%-34s %14s", ROWS[k][1], bs);
            for (size_t i = 1; i < n; i++) {
                json_t *o = find_level(&r[i], conc);
                double v = o ? bench_result_num(o, ROWS[k][0]) : NAN;
                char vs[32] = "-", rs[32] = "-";
                if (!isnan(v)) snprintf(vs, sizeof vs, "%.*f", prec, v);
                if (!isnan(v) && !isnan(b) && b != 0) snprintf(rs, sizeof rs, "%.2fx", v / b);
                if (md) fprintf(f, " %s | %s |", vs, rs);
                else fprintf(f, " %14s %8s", vs, rs);
            }
            fputc('\n', f);
        }
    }
    return 0;
}

/* ---- plots ------------------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Per-request values of one latency metric in ms, successful requests only. */
static size_t level_values(json_t *lvl, const char *metric, double **out) {
    json_t *tt = json_object_get(lvl, "ttfts"), *e2 = json_object_get(lvl, "e2els"),
           *it = json_object_get(lvl, "itls"), *ol = json_object_get(lvl, "output_lens"),
           *er = json_object_get(lvl, "errors");
    size_t n = json_array_size(e2), cap = 16, k = 0;
    for (size_t i = 0; i < json_array_size(it); i++) cap += json_array_size(json_array_get(it, i));
    double *v = malloc(cap * sizeof *v);
    *out = v;
    if (!v) return 0;
    for (size_t i = 0; i < n; i++) {
        const char *e = json_string_value(json_array_get(er, i));
        if (e && *e) continue;
        double t = json_number_value(json_array_get(tt, i)), l = json_number_value(json_array_get(e2, i));
        json_int_t o = json_integer_value(json_array_get(ol, i));
        int have_t = json_is_number(json_array_get(tt, i));
        if (!strcmp(metric, "ttft") && have_t) v[k++] = t * 1e3;
        else if (!strcmp(metric, "e2el")) v[k++] = l * 1e3;
        else if (!strcmp(metric, "tpot") && have_t && o > 1) v[k++] = (l - t) / (double)(o - 1) * 1e3;
        else if (!strcmp(metric, "itl")) {
            json_t *li = json_array_get(it, i);
            for (size_t j = 0; j < json_array_size(li); j++) v[k++] = json_number_value(json_array_get(li, j)) * 1e3;
        }
    }
    qsort(v, k, sizeof *v, cmp_double);
    return k;
}

static void curve_title(const bench_result *r, size_t l, char *buf, size_t cap) {
    double c = level_conc(r->lvl[l]);
    size_t j = 0;
    char t[256];
    if (r->n_lvl > 1 || c > 0) snprintf(t, sizeof t, "%s c=%g", r->label, c);
    else snprintf(t, sizeof t, "%s", r->label);
    for (size_t i = 0; t[i] && j + 2 < cap; i++) { /* gnuplot string: escape quotes */
        if (t[i] == '"' || t[i] == '\\') buf[j++] = '\\';
        buf[j++] = t[i];
    }
    buf[j] = '\0';
}

static int write_script(const char *dir, const bench_result *r, size_t n, const char *term, specd_err *err) {
    char path[1200];
    snprintf(path, sizeof path, "%s/plots.gp", dir);
    FILE *g = fopen(path, "w");
    if (!g) return specd_err_set(err, "cannot write %s: %s", path, strerror(errno));
    fprintf(g, "# written by specd-bench: gnuplot %s/plots.gp redraws the figures\n", dir);
    fprintf(g, "set terminal %s size 1200,900 noenhanced\nset grid\nset key bottom right\n", term);

    /* 1. latency CDFs, one panel per metric */
    static const char *const MET[4][2] = {
        {"ttft", "TTFT (ms)"}, {"tpot", "TPOT (ms)"}, {"itl", "ITL (ms)"}, {"e2el", "E2E latency (ms)"}};
    fprintf(g, "set output '%s/latency_cdf.png'\nset multiplot layout 2,2 title 'latency CDFs'\n", dir);
    for (int m = 0; m < 4; m++) {
        fprintf(g, "set xlabel '%s'\nset ylabel 'fraction of samples'\nset yrange [0:1]\n", MET[m][1]);
        int first = 1;
        for (size_t i = 0; i < n; i++)
            for (size_t l = 0; l < r[i].n_lvl; l++) {
                double *v;
                size_t k = level_values(r[i].lvl[l], MET[m][0], &v);
                if (k == 0) {
                    free(v);
                    continue;
                }
                char dat[1300], title[300];
                snprintf(dat, sizeof dat, "%s/cdf_%s_%zu_%zu.dat", dir, MET[m][0], i, l);
                FILE *d = fopen(dat, "w");
                if (!d) {
                    free(v);
                    fclose(g);
                    return specd_err_set(err, "cannot write %s", dat);
                }
                for (size_t j = 0; j < k; j++) fprintf(d, "%.6f %.6f\n", v[j], (double)(j + 1) / (double)k);
                fclose(d);
                free(v);
                curve_title(&r[i], l, title, sizeof title);
                fprintf(g, "%s '%s' using 1:2 with steps lw 2 title \"%s\"", first ? "plot" : ", \\\n    ", dat, title);
                first = 0;
            }
        if (first) fprintf(g, "set label 1 'no samples' at graph 0.4,0.5\nplot NaN notitle\nunset label 1");
        fputc('\n', g);
    }
    fprintf(g, "unset multiplot\nset yrange [*:*]\n");

    /* 2. throughput and TPOT against concurrency */
    int any_multi = 0;
    for (size_t i = 0; i < n; i++) {
        size_t with_c = 0;
        for (size_t l = 0; l < r[i].n_lvl; l++) with_c += level_conc(r[i].lvl[l]) > 0;
        any_multi |= with_c >= 2;
    }
    if (any_multi) {
        static const char *const SW[2][3] = {{"output_throughput", "output tokens/s", "throughput_vs_concurrency"},
                                             {"median_tpot_ms", "median TPOT (ms)", "tpot_vs_concurrency"}};
        for (int s = 0; s < 2; s++) {
            fprintf(g, "set terminal %s size 900,600 noenhanced\nset output '%s/%s.png'\n", term, dir, SW[s][2]);
            fprintf(g, "set xlabel 'max concurrency'\nset ylabel '%s'\nset logscale x 2\nset key top left\n", SW[s][1]);
            int first = 1;
            for (size_t i = 0; i < n; i++) {
                char dat[1300], title[300];
                snprintf(dat, sizeof dat, "%s/sweep_%s_%zu.dat", dir, SW[s][0], i);
                FILE *d = fopen(dat, "w");
                if (!d) {
                    fclose(g);
                    return specd_err_set(err, "cannot write %s", dat);
                }
                size_t pts = 0;
                for (size_t l = 0; l < r[i].n_lvl; l++) {
                    double c = level_conc(r[i].lvl[l]), v = bench_result_num(r[i].lvl[l], SW[s][0]);
                    if (c > 0 && !isnan(v)) fprintf(d, "%g %.6f\n", c, v), pts++;
                }
                fclose(d);
                if (!pts) continue;
                snprintf(title, sizeof title, "%s", r[i].label);
                fprintf(g, "%s '%s' using 1:2 with linespoints lw 2 pt 7 title \"%s\"", first ? "plot" : ", \\\n    ", dat, title);
                first = 0;
            }
            fprintf(g, "\nunset logscale x\n");
        }
    }

    /* 3. acceptance per draft position */
    int any_spec = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t l = 0; l < r[i].n_lvl; l++)
            any_spec |= json_array_size(json_object_get(r[i].lvl[l], "spec_decode_acceptance_per_position")) > 0;
    if (any_spec) {
        fprintf(g, "set terminal %s size 900,600 noenhanced\nset output '%s/acceptance_per_position.png'\n", term, dir);
        fprintf(g, "set xlabel 'draft position (0 = first drafted token)'\nset ylabel 'accepted / drafts'\n"
                   "set yrange [0:1]\nset xtics 1\nset key top right\n");
        int first = 1;
        for (size_t i = 0; i < n; i++)
            for (size_t l = 0; l < r[i].n_lvl; l++) {
                json_t *pp = json_object_get(r[i].lvl[l], "spec_decode_acceptance_per_position");
                if (!json_array_size(pp)) continue;
                char dat[1300], title[300];
                snprintf(dat, sizeof dat, "%s/accept_%zu_%zu.dat", dir, i, l);
                FILE *d = fopen(dat, "w");
                if (!d) {
                    fclose(g);
                    return specd_err_set(err, "cannot write %s", dat);
                }
                for (size_t j = 0; j < json_array_size(pp); j++)
                    fprintf(d, "%zu %.6f\n", j, json_number_value(json_array_get(pp, j)));
                fclose(d);
                curve_title(&r[i], l, title, sizeof title);
                fprintf(g, "%s '%s' using 1:2 with linespoints lw 2 pt 7 title \"%s\"", first ? "plot" : ", \\\n    ", dat, title);
                first = 0;
            }
        fprintf(g, "\nset yrange [*:*]\n");
    }
    fclose(g);
    return 0;
}

int bench_plot(const char *dir, const bench_result *r, size_t n, specd_err *err) {
    if (mkdir(dir, 0755) && errno != EEXIST) return specd_err_set(err, "cannot create %s: %s", dir, strerror(errno));
    if (system("command -v gnuplot >/dev/null 2>&1") != 0)
        return specd_err_set(err, "gnuplot not found (install gnuplot-nox)");
    static const char *const TERMS[] = {"pngcairo", "png"};
    char cmd[1400];
    for (size_t t = 0; t < 2; t++) {
        if (write_script(dir, r, n, TERMS[t], err)) return -1;
        snprintf(cmd, sizeof cmd, "gnuplot '%s/plots.gp' 2>'%s/gnuplot.log'", dir, dir);
        if (system(cmd) == 0) return 0;
    }
    return specd_err_set(err, "gnuplot failed, see %s/gnuplot.log", dir);
}
