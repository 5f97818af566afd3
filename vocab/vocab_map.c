/*
 * vocab_map.c: vocab_build (the selection rule of vocab_map.h) and
 * vocab_map_write (the three output files).
 *
 * Invariants of a built map: used strictly increasing, 0 <= used[i] <
 * n_target, d2t[i] == used[i] - i, t2d has exactly n_draft true entries, at
 * used[]. O(V log V) for the sort of the seen ids; no global state.
 * Threading: pure functions (vocab_map_write touches the file system only).
 */
#include "vocab/vocab_map.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/loader/safetensors.h"
#include "vocab/npy.h"

void vocab_map_free(vocab_map *m) {
    if (!m) return;
    free(m->used);
    free(m->d2t);
    free(m->t2d);
    memset(m, 0, sizeof *m);
}

typedef struct {
    int64_t count, id;
} ranked;

/* Most frequent first, ties by the lower id. */
static int cmp_ranked(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    if (x->count != y->count) return x->count > y->count ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

int vocab_build(const int64_t *freq, int64_t V, int64_t N, const int64_t *forced, size_t n_forced,
                const uint8_t *fill_avoid, vocab_map *out, vocab_build_report *rep, specd_err *err) {
    memset(out, 0, sizeof *out);
    vocab_build_report r = {.fill_first = -1, .fill_last = -1, .min_kept_count = -1};
    ranked *rk = NULL;
    uint8_t *kept = NULL;
    if (N < 1) return specd_err_set(err, "draft vocab size must be at least 1 (got %lld)", (long long)N);
    if (V < 2) return specd_err_set(err, "target vocab size %lld is too small", (long long)V);
    if (N >= V)
        return specd_err_set(err, "draft vocab size %lld must be smaller than the target vocab size %lld (with %s no "
                                  "token is dropped and no map is needed: use the identity)",
                             (long long)N, (long long)V, N == V ? "equal sizes" : "a larger draft");
    for (int64_t i = 0; i < V; i++) {
        if (freq[i] < 0)
            return specd_err_set(err, "token frequency vector: negative count %lld at id %lld", (long long)freq[i],
                                 (long long)i);
        if (freq[i] > INT64_MAX - r.total_count)
            return specd_err_set(err, "token frequency vector: counts overflow int64 at id %lld", (long long)i);
        r.total_count += freq[i];
        r.n_seen += freq[i] > 0;
    }
    if (!(kept = calloc((size_t)V, 1)) || !(rk = malloc(sizeof *rk * (size_t)(r.n_seen ? r.n_seen : 1)))) goto oom;
    for (size_t i = 0; i < n_forced; i++) {
        if (forced[i] < 0 || forced[i] >= V) {
            specd_err_set(err, "always-include id %lld is outside the target vocabulary [0, %lld)", (long long)forced[i],
                          (long long)V);
            goto fail;
        }
        if (!kept[forced[i]]) r.n_forced++;
        kept[forced[i]] = 1;
    }
    if (r.n_forced > N) {
        specd_err_set(err, "%lld distinct always-include ids do not fit in a draft vocab of %lld", (long long)r.n_forced,
                      (long long)N);
        goto fail;
    }
    int64_t n_rk = 0;
    for (int64_t i = 0; i < V; i++)
        if (freq[i] > 0) rk[n_rk++] = (ranked){freq[i], i};
    qsort(rk, (size_t)n_rk, sizeof *rk, cmp_ranked);
    /* forced ids that the frequency rule alone would not have kept */
    uint8_t *top = calloc((size_t)V, 1);
    if (!top) goto oom;
    for (int64_t k = 0; k < n_rk && k < N; k++) top[rk[k].id] = 1;
    for (int64_t i = 0; i < V; i++) r.n_forced_extra += kept[i] && !top[i];
    free(top);
    int64_t slots = N - r.n_forced;
    for (int64_t k = 0; k < n_rk && slots > 0; k++) {
        if (kept[rk[k].id]) continue;
        kept[rk[k].id] = 1;
        r.min_kept_count = rk[k].count;
        slots--;
    }
    for (int pass = fill_avoid ? 0 : 1; pass < 2; pass++) /* fill: lowest unused ids, avoided ones last */
        for (int64_t i = 0; i < V && slots > 0; i++) {
            if (kept[i] || (pass == 0 && fill_avoid[i])) continue;
            kept[i] = 1;
            if (r.fill_first < 0 || i < r.fill_first) r.fill_first = i;
            if (i > r.fill_last) r.fill_last = i;
            r.n_filled++;
            slots--;
        }
    out->n_draft = N;
    out->n_target = V;
    if (!(out->used = malloc(sizeof *out->used * (size_t)N)) || !(out->d2t = malloc(sizeof *out->d2t * (size_t)N)))
        goto oom;
    out->t2d = kept;
    kept = NULL;
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++) {
        if (!out->t2d[i]) continue;
        out->used[n] = i;
        out->d2t[n] = i - n;
        n++;
        r.covered_count += freq[i];
        r.n_seen_kept += freq[i] > 0;
    }
    if (n != N) { /* cannot happen: slots were filled from V > N ids */
        specd_err_set(err, "internal: kept %lld ids, expected %lld", (long long)n, (long long)N);
        goto fail;
    }
    r.lowest_id = out->used[0];
    r.highest_id = out->used[N - 1];
    if (rep) *rep = r;
    free(rk);
    return 0;
oom:
    specd_err_set(err, "vocab build: out of memory");
fail:
    free(rk);
    free(kept);
    vocab_map_free(out);
    return -1;
}

int vocab_freq_load(const char *path, int64_t expected_n, int64_t **freq, int64_t *n, specd_err *err) {
    if (npy_read_i64_vec(path, "token frequency vector", freq, n, err) < 0) return -1;
    const char *why = NULL;
    int64_t bad = -1;
    if (expected_n > 0 && *n != expected_n) why = "length";
    for (int64_t i = 0; !why && i < *n; i++)
        if ((*freq)[i] < 0) why = "negative", bad = i;
    if (!why) return 0;
    if (!strcmp(why, "length"))
        specd_err_set(err, "%s: the token frequency vector has %lld entries, the target vocab has %lld", path,
                      (long long)*n, (long long)expected_n);
    else
        specd_err_set(err, "%s: token frequency vector: negative count %lld at id %lld", path, (long long)(*freq)[bad],
                      (long long)bad);
    free(*freq);
    *freq = NULL;
    *n = 0;
    return -1;
}

/* mkdir -p */
static int make_dirs(const char *dir, specd_err *err) {
    char p[4096];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) return specd_err_set(err, "output path too long");
    for (char *s = p + 1;; s++) {
        if (*s == '/' || *s == '\0') {
            char c = *s;
            *s = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST) return specd_err_set(err, "%s: %s", p, strerror(errno));
            *s = c;
            if (!c) break;
        }
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) return specd_err_set(err, "%s: not a directory", dir);
    return 0;
}

int vocab_map_write(const char *dir, const vocab_map *m, specd_err *err) {
    char path[4096];
    if (make_dirs(dir, err) < 0) return -1;
    snprintf(path, sizeof path, "%s/d2t.npy", dir);
    if (npy_write_vec(path, "<i8", m->d2t, m->n_draft, err) < 0) return -1;
    snprintf(path, sizeof path, "%s/t2d.npy", dir);
    if (npy_write_vec(path, "|b1", m->t2d, m->n_target, err) < 0) return -1;
    char nd[32], nt[32];
    snprintf(nd, sizeof nd, "%lld", (long long)m->n_draft);
    snprintf(nt, sizeof nt, "%lld", (long long)m->n_target);
    const char *meta[] = {"format", "pt", "draft_vocab_size", nd, "target_vocab_size", nt,
                          "d2t_semantics", "offset: target_id = draft_id + d2t[draft_id]", NULL};
    int64_t sd[1] = {m->n_draft}, st_[1] = {m->n_target};
    st_write_tensor t[2] = {{"d2t", ST_I64, 1, sd, m->d2t}, {"t2d", ST_BOOL, 1, st_, m->t2d}};
    snprintf(path, sizeof path, "%s/vocab_map.safetensors", dir);
    return st_write(path, t, 2, meta, err);
}
