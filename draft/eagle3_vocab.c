/*
 * eagle3_vocab.c: d2t / t2d validation (see eagle3_vocab.h for the rules and
 * the decisions taken on ambiguous maps).
 *
 * Every check reports the first offending draft index so a user can find the
 * bad entry with numpy. No allocation; O(draft_vocab + target_vocab).
 * Threading: pure functions.
 */
#include "draft/eagle3_vocab.h"

#include <stdio.h>
#include <string.h>

/* Offsets beyond this cannot be valid for any vocabulary that fits in memory;
 * bounding them first keeps i + d2t[i] free of overflow. */
#define D2T_ABS_MAX ((int64_t)1 << 40)

typedef struct {
    int64_t idx;       /* first offending draft index */
    int64_t value;     /* the target id it maps to */
    const char *why;   /* rule broken */
} vocab_fault;

static int64_t map_id(const int64_t *d2t, int64_t i, bool absolute) { return absolute ? d2t[i] : i + d2t[i]; }

/* Range and strict monotonicity of used[i] under one reading of d2t. */
static bool check_map(const int64_t *d2t, int64_t n, int64_t V, bool absolute, vocab_fault *f) {
    int64_t prev = -1;
    for (int64_t i = 0; i < n; i++) {
        if (d2t[i] < -D2T_ABS_MAX || d2t[i] > D2T_ABS_MAX) {
            *f = (vocab_fault){i, d2t[i], "is out of range"};
            return false;
        }
        int64_t u = map_id(d2t, i, absolute);
        if (u < 0 || u >= V) {
            *f = (vocab_fault){i, u, "maps outside the target vocabulary"};
            return false;
        }
        if (u <= prev) {
            *f = (vocab_fault){i, u, "breaks the strictly increasing order of mapped ids"};
            return false;
        }
        prev = u;
    }
    return true;
}

/* t2d agrees with the map: exactly n true entries, all at mapped ids. */
static bool check_t2d(const int64_t *d2t, int64_t n, const uint8_t *t2d, int64_t V, bool absolute, int64_t *count,
                      vocab_fault *f) {
    int64_t c = 0;
    for (int64_t j = 0; j < V; j++) c += t2d[j] != 0;
    *count = c;
    if (c != n) {
        *f = (vocab_fault){-1, c, "t2d count"};
        return false;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t u = d2t ? map_id(d2t, i, absolute) : i;
        if (!t2d[u]) {
            *f = (vocab_fault){i, u, "t2d is false at the mapped id"};
            return false;
        }
    }
    return true;
}

int eagle3_vocab_validate(const int64_t *d2t, int64_t n, const uint8_t *t2d, int64_t V, int64_t *used_out,
                          eagle3_vocab_info *info, specd_err *err) {
    eagle3_vocab_info tmp;
    if (!info) info = &tmp;
    memset(info, 0, sizeof *info);
    info->draft_vocab = n;
    info->target_vocab = V;
    info->has_d2t = d2t != NULL;
    info->has_t2d = t2d != NULL;
    if (n < 1 || V < 1) return specd_err_set(err, "vocab map: empty vocabulary (draft %lld, target %lld)", (long long)n, (long long)V);
    if (n > V)
        return specd_err_set(err, "vocab map: draft vocab %lld is larger than the target vocab %lld", (long long)n, (long long)V);
    vocab_fault f = {0};
    int64_t count = 0;
    if (!d2t) {
        if (n < V)
            return specd_err_set(err, "vocab map: draft vocab %lld < target vocab %lld but the head has no d2t: refusing "
                                      "(identity would send draft ids to target ids 0..%lld and acceptance collapses); "
                                      "add d2t (offsets, target = draft + d2t[draft])%s",
                                 (long long)n, (long long)V, (long long)n - 1, t2d ? " (it can be rebuilt from t2d)" : "");
        if (t2d && !check_t2d(NULL, n, t2d, V, false, &count, &f))
            return specd_err_set(err, "vocab map: t2d marks %lld of %lld target ids but the draft vocab equals the target's "
                                      "and there is no d2t", (long long)count, (long long)V);
    } else {
        bool ok = check_map(d2t, n, V, false, &f);
        vocab_fault ft = {0};
        bool t2d_ok = ok && (!t2d || check_t2d(d2t, n, t2d, V, false, &count, &ft));
        if (!ok || !t2d_ok) {
            /* Would the same numbers pass as absolute ids? Then they were written as such. */
            vocab_fault fa = {0}, fta = {0};
            int64_t ca = 0;
            bool abs_ok = check_map(d2t, n, V, true, &fa) && (!t2d || check_t2d(d2t, n, t2d, V, true, &ca, &fta));
            if (abs_ok)
                return specd_err_set(err, "vocab map: d2t looks like absolute ids, expected offsets (target = draft + "
                                          "d2t[draft]): d2t[%lld] = %lld would map to %lld; convert with d2t - arange(%lld)",
                                     (long long)(ok ? ft.idx : f.idx), (long long)d2t[ok ? ft.idx : f.idx],
                                     (long long)((ok ? ft.idx : f.idx) + d2t[ok ? ft.idx : f.idx]), (long long)n);
            if (!ok)
                return specd_err_set(err, "vocab map: d2t[%lld] = %lld %s (target id %lld, target vocab %lld)",
                                     (long long)f.idx, (long long)d2t[f.idx], f.why, (long long)f.value, (long long)V);
            if (ft.idx < 0)
                return specd_err_set(err, "vocab map: t2d is inconsistent with d2t: t2d marks %lld target ids, the draft "
                                          "vocab has %lld", (long long)count, (long long)n);
            return specd_err_set(err, "vocab map: t2d is inconsistent with d2t: draft id %lld maps to target id %lld but "
                                      "t2d[%lld] is false (d2t regenerated without the matching t2d or lm_head?)",
                                 (long long)ft.idx, (long long)ft.value, (long long)ft.value);
        }
    }
    bool identity = true;
    for (int64_t i = 0; i < n; i++) {
        int64_t u = d2t ? i + d2t[i] : i;
        if (u != i) identity = false;
        if (used_out) used_out[i] = u;
    }
    info->identity = identity;
    info->first_id = d2t ? d2t[0] : 0;
    info->last_id = d2t ? (n - 1) + d2t[n - 1] : n - 1;
    if (identity && n < V && !t2d) {
        info->warn_zero_d2t = true;
        snprintf(info->warning, sizeof info->warning,
                 "d2t is all zeros: the %lld draft ids map onto target ids 0..%lld of %lld (identity) and there is no t2d "
                 "to confirm it; a d2t that was never filled in looks exactly like this",
                 (long long)n, (long long)n - 1, (long long)V);
    }
    return 0;
}

void eagle3_vocab_summary(const eagle3_vocab_info *i, char *buf, size_t n) {
    snprintf(buf, n, "draft vocab %lld -> target vocab %lld via %s (ids %lld..%lld, %s), %s", (long long)i->draft_vocab,
             (long long)i->target_vocab, i->has_d2t ? "d2t offsets" : "no d2t", (long long)i->first_id,
             (long long)i->last_id, i->identity ? "identity" : "not identity",
             i->has_t2d ? "t2d consistent" : "no t2d");
}
