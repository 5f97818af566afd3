/*
 * test_draft_load.c: eagle3_head_load refuses broken heads with a clear
 * message, end to end on real files. Each case starts from the regenerated
 * random head spec_s1 (draft vocab 32000 < SmolLM2's 49152) and rewrites its
 * safetensors / config.json with one fault, the field failures REFERENCE §2
 * lists among them:
 *   d2t missing (would silently be identity), d2t written as absolute ids,
 *   t2d contradicting d2t, a projection of the wrong shape, fc missing,
 *   target_hidden_size not the target's, aux ids outside the target, a second
 *   decoder layer (multi-layer drafts are not implemented).
 * The unmodified head loads (control), and with lm_head removed it loads with
 * the target's rows gathered through d2t. A hot vocabulary (eagle3_head_opts
 * .hot_vocab, serve --speculative-token-map) cuts the draft's logits to its
 * ids, bit-identical to the full head's rows; bad maps are refused.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "draft/eagle3_head.h"
#include "tests/draft/draft_test_util.h"

static backend *g_be;
static model *g_model;
static char g_src[64];

typedef enum { F_NONE, F_DROP_D2T, F_ABS_D2T, F_T2D_FLIP, F_Q_SHAPE, F_DROP_FC, F_DROP_LM, F_TWO_LAYERS } fault;

/* Copies the head with FAULT applied (and config.json with FROM -> TO replaced)
 * into a new directory (written to dir). */
static void make_variant(fault f, const char *from, const char *to, char *dir) {
    strcpy(dir, "/tmp/specd_draft_bad_XXXXXX");
    assert_non_null(mkdtemp(dir));
    char p[256];
    snprintf(p, sizeof p, "%s/model.safetensors", g_src);
    st_model *m = NULL;
    specd_err err = {{0}};
    assert_int_equal(st_open(p, &m, &err), 0);
    size_t n = st_n_tensors(m), k = 0;
    st_write_tensor *w = calloc(n + 1, sizeof *w);
    int64_t *abs_ids = NULL;
    uint8_t *t2d = NULL;
    for (size_t i = 0; i < n; i++) {
        const st_tensor *t = st_tensor_at(m, i);
        if ((f == F_DROP_D2T && !strcmp(t->name, "d2t")) || (f == F_DROP_FC && !strcmp(t->name, "fc.weight")) ||
            (f == F_DROP_LM && !strcmp(t->name, "lm_head.weight")))
            continue;
        w[k] = (st_write_tensor){t->name, t->dtype, t->n_dims, t->shape, t->data};
        if (f == F_ABS_D2T && !strcmp(t->name, "d2t")) { /* used[i] = i + d2t[i], written as is */
            abs_ids = malloc(t->nbytes);
            memcpy(abs_ids, t->data, t->nbytes);
            for (uint64_t j = 0; j < t->n_elements; j++) abs_ids[j] += (int64_t)j;
            w[k].data = abs_ids;
        }
        if (f == F_T2D_FLIP && !strcmp(t->name, "t2d")) { /* move one kept id to a dropped one */
            t2d = malloc(t->nbytes);
            memcpy(t2d, t->data, t->nbytes);
            uint64_t on = 0, off = 0;
            while (!t2d[on]) on++;
            while (t2d[off]) off++;
            t2d[on] = 0;
            t2d[off] = 1;
            w[k].data = t2d;
        }
        if (f == F_Q_SHAPE && strstr(t->name, "q_proj.weight")) { /* k_proj's [192, 1152] in q_proj's place */
            const st_tensor *kp = st_find(m, "layers.0.self_attn.k_proj.weight");
            w[k] = (st_write_tensor){t->name, kp->dtype, kp->n_dims, kp->shape, kp->data};
        }
        k++;
    }
    if (f == F_TWO_LAYERS) { /* a second decoder layer */
        const st_tensor *q = st_find(m, "layers.0.self_attn.q_proj.weight");
        w[k++] = (st_write_tensor){"layers.1.self_attn.q_proj.weight", q->dtype, q->n_dims, q->shape, q->data};
    }
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    assert_int_equal(st_write(p, w, k, NULL, &err), 0);
    free(w), free(abs_ids), free(t2d);
    st_close(m);
    /* config.json, with one replacement */
    snprintf(p, sizeof p, "%s/config.json", g_src);
    FILE *fi = fopen(p, "rb");
    char buf[8192];
    size_t len = fread(buf, 1, sizeof buf - 1, fi);
    fclose(fi);
    buf[len] = 0;
    char out[8192];
    char *at = from ? strstr(buf, from) : NULL;
    if (from) assert_non_null(at);
    if (at) snprintf(out, sizeof out, "%.*s%s%s", (int)(at - buf), buf, to, at + strlen(from));
    else snprintf(out, sizeof out, "%s", buf);
    snprintf(p, sizeof p, "%s/config.json", dir);
    FILE *fo = fopen(p, "wb");
    fputs(out, fo);
    fclose(fo);
}

static int try_load(const char *dir, specd_err *err, eagle3_head **out) {
    const model_config *mc = model_get_config(g_model);
    eagle3_target t = {g_be, model_embed_weight(g_model), model_lm_head_weight(g_model), mc->hidden, mc->vocab,
                       mc->n_layers, NULL, NULL};
    eagle3_head_opts o = {EAGLE3_AUX_AUTO, 16, 4, false, NULL, 0, 0, NULL, NULL};
    return eagle3_head_load(dir, &t, &o, out, err);
}

static void expect(fault f, const char *from, const char *to, const char *needle) {
    char dir[64];
    make_variant(f, from, to, dir);
    specd_err err = {{0}};
    eagle3_head *h = NULL;
    int rc = try_load(dir, &err, &h);
    if (needle) {
        if (rc == 0 || !strstr(err.msg, needle)) fprintf(stderr, "rc %d, message '%s' lacks '%s'\n", rc, err.msg, needle);
        assert_int_equal(rc, -1);
        assert_non_null(strstr(err.msg, needle));
        assert_null(h);
    } else {
        if (rc) fprintf(stderr, "%s\n", err.msg);
        assert_int_equal(rc, 0);
        if (f == F_DROP_LM) { /* lm_head gathered from the target: row i = target row used[i] */
            const eagle3_config *c = eagle3_head_config(h);
            assert_int_equal(c->draft_vocab, 32000);
        }
        eagle3_head_destroy(h);
    }
    dt_rm_head(dir);
}

static void test_control_loads(void **state) {
    (void)state;
    expect(F_NONE, NULL, NULL, NULL);
    expect(F_DROP_LM, NULL, NULL, NULL);
}
static void test_no_d2t(void **state) { (void)state; expect(F_DROP_D2T, NULL, NULL, "has no d2t"); }
static void test_absolute_d2t(void **state) {
    (void)state;
    expect(F_ABS_D2T, NULL, NULL, "d2t looks like absolute ids, expected offsets");
}
static void test_t2d_inconsistent(void **state) { (void)state; expect(F_T2D_FLIP, NULL, NULL, "t2d is inconsistent with d2t"); }
static void test_bad_shape(void **state) { (void)state; expect(F_Q_SHAPE, NULL, NULL, "q_proj.weight has shape [192, 1152]"); }
static void test_no_fc(void **state) { (void)state; expect(F_DROP_FC, NULL, NULL, "fc.weight is missing"); }
static void test_two_layers(void **state) { (void)state; expect(F_TWO_LAYERS, NULL, NULL, "more than one decoder layer"); }
static void test_target_hidden(void **state) {
    (void)state;
    expect(F_NONE, "\"target_hidden_size\": 576", "\"target_hidden_size\": 512", "does not match the target's hidden size 576");
}
static void test_aux_ids_out_of_range(void **state) {
    (void)state;
    expect(F_NONE, "\"eagle_aux_hidden_state_layer_ids\": [\n    2,\n    15,\n    27\n  ]",
           "\"eagle_aux_hidden_state_layer_ids\": [2, 15, 30]", "outside the 30-layer target");
}

/* Writes a vocab map (d2t only, as `specd vocab build` writes it: target id =
 * i + d2t[i], ascending) holding the n target ids ids[] into a new directory. */
static void write_map(const int64_t *ids, int64_t n, char *dir) {
    strcpy(dir, "/tmp/specd_hot_XXXXXX");
    assert_non_null(mkdtemp(dir));
    int64_t *d2t = malloc(sizeof(int64_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) d2t[i] = ids[i] - i;
    const int64_t shape[1] = {n};
    st_write_tensor w = {"d2t", ST_I64, 1, shape, d2t};
    char p[256];
    snprintf(p, sizeof p, "%s/vocab_map.safetensors", dir);
    specd_err err = {{0}};
    assert_int_equal(st_write(p, &w, 1, NULL, &err), 0);
    free(d2t);
}

static void rm_map(const char *dir) {
    char p[256];
    snprintf(p, sizeof p, "%s/vocab_map.safetensors", dir);
    assert_int_equal(remove(p), 0);
    assert_int_equal(rmdir(dir), 0);
}

static int load_hot(const char *dir, const char *hot, specd_err *err, eagle3_head **out) {
    const model_config *mc = model_get_config(g_model);
    eagle3_target t = {g_be, model_embed_weight(g_model), model_lm_head_weight(g_model), mc->hidden, mc->vocab,
                       mc->n_layers, NULL, NULL};
    eagle3_head_opts o = {EAGLE3_AUX_AUTO, 16, 4, false, hot, 0, 0, NULL, NULL};
    return eagle3_head_load(dir, &t, &o, out, err);
}

/* --speculative-token-map: the draft scores only the hot ids, in draft-id
 * order, with the very same logits as the full head at those rows; a map
 * pointing outside the target, or sharing no id with the head, is refused. */
static void hot_case(fault f) {
    char dir[64], map[64];
    make_variant(f, NULL, NULL, dir);
    specd_err err = {{0}};
    eagle3_head *full = NULL, *hot = NULL;
    assert_int_equal(try_load(dir, &err, &full), 0);
    const int32_t Vd = eagle3_head_n_scored(full), Vt = model_get_config(g_model)->vocab, H = eagle3_head_config(full)->hidden;
    assert_int_equal(Vd, 32000);
    const int64_t *used = eagle3_head_used(full);
    /* hot set: every third draft id's target id, plus every target id >= 49000 the head lacks */
    uint8_t *in_draft = calloc((size_t)Vt, 1), *want = calloc((size_t)Vt, 1);
    for (int32_t d = 0; d < Vd; d++) in_draft[used[d]] = 1;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)Vt), n = 0, n_expect = 0, n_outside = 0;
    for (int32_t d = 0; d < Vd; d += 3) want[used[d]] = 1, n_expect++;
    for (int64_t t = 49000; t < Vt; t++)
        if (!in_draft[t]) want[t] = 1, n_outside++;
    assert_true(n_outside > 0);
    for (int64_t t = 0; t < Vt; t++)
        if (want[t]) ids[n++] = t;
    write_map(ids, n, map);
    if (load_hot(dir, map, &err, &hot)) fprintf(stderr, "%s\n", err.msg);
    assert_non_null(hot);
    assert_int_equal(eagle3_head_n_scored(hot), n_expect);
    const int64_t *hused = eagle3_head_used(hot);
    for (int64_t j = 0; j < n_expect; j++) assert_int_equal(hused[j], used[3 * j]);
    float *x = malloc(sizeof(float) * 2 * (size_t)H), *lf = malloc(sizeof(float) * 2 * (size_t)Vd),
          *lh = malloc(sizeof(float) * 2 * (size_t)n_expect);
    for (int32_t i = 0; i < 2 * H; i++) x[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
    assert_int_equal(eagle3_logits(full, x, 2, lf, &err), 0);
    assert_int_equal(eagle3_logits(hot, x, 2, lh, &err), 0);
    for (int r = 0; r < 2; r++)
        for (int64_t j = 0; j < n_expect; j++)
            assert_memory_equal(&lh[r * n_expect + j], &lf[(size_t)r * Vd + 3 * (size_t)j], sizeof(float));
    eagle3_head_destroy(hot);
    rm_map(map);
    /* no overlap: only the ids the head lacks */
    n = 0;
    for (int64_t t = 49000; t < Vt; t++)
        if (!in_draft[t]) ids[n++] = t;
    write_map(ids, n, map);
    hot = NULL;
    assert_int_equal(load_hot(dir, map, &err, &hot), -1);
    assert_non_null(strstr(err.msg, "none of the hot vocabulary's ids is in the head's draft vocabulary"));
    assert_null(hot);
    rm_map(map);
    /* an id past the target vocabulary */
    ids[0] = 7, ids[1] = Vt + 5;
    write_map(ids, 2, map);
    assert_int_equal(load_hot(dir, map, &err, &hot), -1);
    assert_non_null(strstr(err.msg, "maps outside the target vocabulary"));
    rm_map(map);
    /* d2t of the wrong dtype, and a map built for another target vocabulary */
    {
        char d2[64];
        strcpy(d2, "/tmp/specd_hot_XXXXXX");
        assert_non_null(mkdtemp(d2));
        int32_t d2t32[2] = {7, 8};
        const int64_t shape[1] = {2};
        st_write_tensor w = {"d2t", ST_I32, 1, shape, d2t32};
        char p[256];
        snprintf(p, sizeof p, "%s/vocab_map.safetensors", d2);
        assert_int_equal(st_write(p, &w, 1, NULL, &err), 0);
        assert_int_equal(load_hot(dir, d2, &err, &hot), -1);
        assert_non_null(strstr(err.msg, "needs d2t, int64 [n]"));
        int64_t d2t64[2] = {7, 7};
        w = (st_write_tensor){"d2t", ST_I64, 1, shape, d2t64};
        const char *meta[] = {"target_vocab_size", "32000", NULL};
        assert_int_equal(st_write(p, &w, 1, meta, &err), 0);
        assert_int_equal(load_hot(dir, d2, &err, &hot), -1);
        assert_non_null(strstr(err.msg, "was built for a target vocabulary of 32000 ids, this target has 49152"));
        rm_map(d2);
    }
    /* no such file */
    assert_int_equal(load_hot(dir, "/nonexistent/vocab_map", &err, &hot), -1);
    assert_non_null(strstr(err.msg, "hot vocabulary /nonexistent/vocab_map"));
    free(in_draft), free(want), free(ids), free(x), free(lf), free(lh);
    eagle3_head_destroy(full);
    dt_rm_head(dir);
}
static void test_hot_vocab_head_lm(void **state) { (void)state; hot_case(F_NONE); }
static void test_hot_vocab_target_rows(void **state) { (void)state; hot_case(F_DROP_LM); }

int main(void) {
    g_be = bk_cpu_create(0);
    g_model = dt_model(g_be, 4);
    json_t *fx = dt_fixtures();
    dt_make_head(fx, "spec_s1", NULL, g_src);
    json_decref(fx);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_control_loads), cmocka_unit_test(test_no_d2t),    cmocka_unit_test(test_absolute_d2t),
        cmocka_unit_test(test_t2d_inconsistent), cmocka_unit_test(test_bad_shape), cmocka_unit_test(test_no_fc),
        cmocka_unit_test(test_target_hidden),  cmocka_unit_test(test_aux_ids_out_of_range),
        cmocka_unit_test(test_two_layers),     cmocka_unit_test(test_hot_vocab_head_lm),
        cmocka_unit_test(test_hot_vocab_target_rows),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    dt_rm_head(g_src);
    model_destroy(g_model);
    bk_cpu_destroy(g_be);
    return rc;
}
