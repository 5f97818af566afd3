/*
 * prom.c: Prometheus text format parser and spec-decode counter extraction
 * (see prom.h for the format subset and the derived-metric definitions).
 */
#include "bench/prom.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- parser ---------------------------------------------------------------- */

static void sample_free(bench_prom_sample *s) {
    free(s->name);
    for (size_t i = 0; i < s->n_labels; i++) {
        free(s->labels[i].name);
        free(s->labels[i].value);
    }
    free(s->labels);
}

void bench_prom_destroy(bench_prom *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n_samples; i++) sample_free(&p->samples[i]);
    free(p->samples);
    free(p);
}

static int is_name_start(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
}
static int is_name_char(char c) { return is_name_start(c) || (c >= '0' && c <= '9'); }

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

static const char *skip_ws(const char *s, const char *end) {
    while (s < end && (*s == ' ' || *s == '\t')) s++;
    return s;
}

/* Parses a value token: strtod accepts NaN/Inf in any case, which covers the
 * format's "NaN", "+Inf", "-Inf". Returns the end of the token or NULL. */
static const char *parse_value(const char *s, const char *end, double *v) {
    char tmp[64];
    size_t n = 0;
    while (s + n < end && s[n] != ' ' && s[n] != '\t' && n < sizeof tmp - 1) {
        tmp[n] = s[n];
        n++;
    }
    if (n == 0 || n == sizeof tmp - 1) return NULL;
    tmp[n] = '\0';
    char *e;
    *v = strtod(tmp, &e);
    if (*e != '\0') return NULL;
    return s + n;
}

/* Parses one sample line [s, end) into out. Returns 1 parsed, 0 malformed,
 * -1 out of memory. */
static int parse_sample(const char *s, const char *end, bench_prom_sample *out) {
    memset(out, 0, sizeof *out);
    const char *p = s;
    if (p >= end || !is_name_start(*p)) return 0;
    while (p < end && is_name_char(*p)) p++;
    if (!(out->name = dup_n(s, (size_t)(p - s)))) return -1;
    p = skip_ws(p, end);
    if (p < end && *p == '{') {
        p++;
        for (;;) {
            p = skip_ws(p, end);
            if (p < end && *p == '}') {
                p++;
                break;
            }
            const char *ln = p;
            while (p < end && is_name_char(*p)) p++;
            size_t ln_len = (size_t)(p - ln);
            p = skip_ws(p, end);
            if (ln_len == 0 || p >= end || *p != '=') goto bad;
            p = skip_ws(p + 1, end);
            if (p >= end || *p != '"') goto bad;
            p++;
            char *val = malloc((size_t)(end - p) + 1);
            if (!val) goto oom;
            size_t vn = 0;
            while (p < end && *p != '"') {
                if (*p == '\\' && p + 1 < end) {
                    p++;
                    val[vn++] = *p == 'n' ? '\n' : *p;
                } else {
                    val[vn++] = *p;
                }
                p++;
            }
            val[vn] = '\0';
            if (p >= end) {
                free(val);
                goto bad;
            }
            p++; /* closing quote */
            bench_prom_label *nl = realloc(out->labels, (out->n_labels + 1) * sizeof *nl);
            if (!nl) {
                free(val);
                goto oom;
            }
            out->labels = nl;
            nl[out->n_labels].value = val;
            if (!(nl[out->n_labels].name = dup_n(ln, ln_len))) {
                free(val);
                goto oom;
            }
            out->n_labels++;
            p = skip_ws(p, end);
            if (p < end && *p == ',') p++;
            else if (p < end && *p == '}') continue;
            else goto bad;
        }
    }
    p = skip_ws(p, end);
    p = parse_value(p, end, &out->value);
    if (!p) goto bad;
    p = skip_ws(p, end);
    if (p < end) { /* optional integer timestamp (ms) */
        double ts;
        const char *q = parse_value(p, end, &ts);
        if (!q || skip_ws(q, end) != end) goto bad;
    }
    return 1;
bad:
    sample_free(out);
    memset(out, 0, sizeof *out);
    return 0;
oom:
    sample_free(out);
    memset(out, 0, sizeof *out);
    return -1;
}

int bench_prom_parse(const char *text, size_t len, bench_prom **out, specd_err *err) {
    *out = NULL;
    bench_prom *p = calloc(1, sizeof *p);
    if (!p) return specd_err_set(err, "metrics: out of memory");
    const char *s = text, *end = text + len;
    while (s < end) {
        const char *eol = memchr(s, '\n', (size_t)(end - s));
        if (!eol) eol = end;
        const char *le = eol;
        if (le > s && le[-1] == '\r') le--;
        const char *b = skip_ws(s, le);
        if (b < le && *b != '#') {
            bench_prom_sample smp;
            int rc = parse_sample(b, le, &smp);
            if (rc < 0) goto oom;
            if (rc == 0) {
                p->n_bad_lines++;
            } else {
                if (p->n_samples == p->cap) {
                    size_t nc = p->cap ? p->cap * 2 : 64;
                    bench_prom_sample *ns = realloc(p->samples, nc * sizeof *ns);
                    if (!ns) {
                        sample_free(&smp);
                        goto oom;
                    }
                    p->samples = ns;
                    p->cap = nc;
                }
                p->samples[p->n_samples++] = smp;
            }
        }
        s = eol + 1;
    }
    *out = p;
    return 0;
oom:
    bench_prom_destroy(p);
    return specd_err_set(err, "metrics: out of memory");
}

const char *bench_prom_label_get(const bench_prom_sample *s, const char *name) {
    for (size_t i = 0; i < s->n_labels; i++)
        if (strcmp(s->labels[i].name, name) == 0) return s->labels[i].value;
    return NULL;
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && memcmp(s + n - m, suffix, m) == 0;
}

double bench_prom_sum_suffix(const bench_prom *p, const char *suffix, const char *label,
                             const char *value, size_t *found) {
    double sum = 0;
    size_t k = 0;
    for (size_t i = 0; i < p->n_samples; i++) {
        const bench_prom_sample *s = &p->samples[i];
        if (!ends_with(s->name, suffix)) continue;
        if (label) {
            const char *v = bench_prom_label_get(s, label);
            if (!v || strcmp(v, value) != 0) continue;
        }
        sum += s->value;
        k++;
    }
    if (found) *found = k;
    return sum;
}

/* ---- spec-decode counters ------------------------------------------------ */

void bench_spec_from_prom(const bench_prom *p, bench_spec_counters *c) {
    memset(c, 0, sizeof *c);
    size_t f1, f2, f3, fg;
    c->drafts = bench_prom_sum_suffix(p, "spec_decode_num_drafts_total", NULL, NULL, &f1);
    c->draft_tokens = bench_prom_sum_suffix(p, "spec_decode_num_draft_tokens_total", NULL, NULL, &f2);
    c->accepted = bench_prom_sum_suffix(p, "spec_decode_num_accepted_tokens_total", NULL, NULL, &f3);
    c->has_spec = f1 > 0 && f2 > 0 && f3 > 0;
    for (size_t i = 0; i < p->n_samples; i++) {
        const bench_prom_sample *s = &p->samples[i];
        if (!ends_with(s->name, "spec_decode_num_accepted_tokens_per_pos_total")) continue;
        const char *pos = bench_prom_label_get(s, "position");
        if (!pos) continue;
        char *e;
        long k = strtol(pos, &e, 10);
        if (*e != '\0' || k < 0 || k >= BENCH_SPEC_MAX_POS) continue;
        c->accepted_pos[k] += s->value;
        if ((size_t)k + 1 > c->n_pos) c->n_pos = (size_t)k + 1;
    }
    c->generation_tokens = bench_prom_sum_suffix(p, "generation_tokens_total", NULL, NULL, &fg);
    c->has_tokens = fg > 0;
    c->prompt_tokens = bench_prom_sum_suffix(p, "prompt_tokens_total", NULL, NULL, NULL);
}

void bench_spec_diff(const bench_spec_counters *a, const bench_spec_counters *b,
                     bench_spec_counters *d) {
    memset(d, 0, sizeof *d);
    d->has_spec = a->has_spec && b->has_spec && a->drafts > b->drafts; /* no drafts: nothing to report */
    d->drafts = a->drafts - b->drafts;
    d->draft_tokens = a->draft_tokens - b->draft_tokens;
    d->accepted = a->accepted - b->accepted;
    d->n_pos = a->n_pos > b->n_pos ? a->n_pos : b->n_pos;
    for (size_t i = 0; i < d->n_pos; i++) d->accepted_pos[i] = a->accepted_pos[i] - b->accepted_pos[i];
    d->has_tokens = a->has_tokens && b->has_tokens;
    d->generation_tokens = a->generation_tokens - b->generation_tokens;
    d->prompt_tokens = a->prompt_tokens - b->prompt_tokens;
}

double bench_spec_acceptance_rate(const bench_spec_counters *d) {
    return d->draft_tokens > 0 ? d->accepted / d->draft_tokens : NAN;
}

double bench_spec_acceptance_length(const bench_spec_counters *d) {
    return d->drafts > 0 ? 1.0 + d->accepted / d->drafts : NAN;
}

double bench_spec_pos_rate(const bench_spec_counters *d, size_t pos) {
    return pos < d->n_pos && d->drafts > 0 ? d->accepted_pos[pos] / d->drafts : NAN;
}
