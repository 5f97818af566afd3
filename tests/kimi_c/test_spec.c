/*
 * test_spec.c (kimi_c_spec): speculative decoding through the engine on the
 * Kimi miniature (MLA + MoE + int4 experts as the target) is lossless: greedy
 * output identical to plain greedy, token for token.
 * Reference: each prompt decoded ALONE by a direct model_forward loop (whole
 * prompt, then one token per step, argmax), no scheduler, no proposer.
 *   - the miniature's EAGLE-3 head (OUT/kimi_head, written by the
 *     kimi_c_head_setup fixture: draft vocabulary 32,000 from `specd vocab`
 *     on GSM8K train tokenized with the Kimi tokenizer, checked there against
 *     tiktoken + jinja2; weights from tools/kimi/make_head.py, seed 0; aux ids
 *     [0, 2, 4] explicit in eagle_config) loaded by the real loader
 *     (eagle3_load) against the miniature and set on the engine with
 *     engine_set_proposer, as server/bundle.c does. k = 3, batch 1, then 8
 *     concurrent requests with chunked prefill. Checked on the way: the head
 *     asks for the residual stream entering layers {1, 3, 5}, and every draft
 *     token the proposer hands the engine is inside the map (t2d true).
 *     Without ../shared/data (no tokenizer, no GSM8K) the fixture skips and
 *     the random head of make_minis.py (OUT/head, random map) is used instead.
 *     The engine gets a stub detokenizer (engine_create_ex), not the Kimi
 *     tokenizer: loading that under the CI sanitizer stage's
 *     strict_string_checks takes minutes (tiktoken.c's strtol). The whole
 *     server path, real tokenizer included, is kimi_c_spec_server's;
 *   - heads that do not fit the miniature (wrong target hidden size, DeepSeek-V3's
 *     vocabulary, absolute d2t, no map, inconsistent t2d, an aux id past the
 *     last layer; tools/kimi/make_head.py BAD) are refused by eagle3_load with
 *     the expected reason;
 *   - an oracle proposer that drafts the reference continuation with every
 *     third draft corrupted, k = 3, 8 requests: verify batches accept, reject
 *     and correct (a random-weight head accepts almost nothing; this covers
 *     acceptance on the MLA/MoE target).
 * After each run every KV block is back in the pool.
 * Built a second time as kimi_c_spec_on_fake (tests/backend/cuda_fake.c):
 * target AND head on the fake CUDA device (the target's forward on device
 * tensors, its latent cache in bf16, the head's weights / KV / buffers in the
 * arena); the reference is plain greedy by the same device model, run
 * eagerly, and the engine's steps then replay CUDA graphs (buckets 1, 2, 4,
 * 8 x 1 and 4 tokens, with the head's aux layers), so speculative through
 * graphs == eager plain holds whatever the device's arithmetic as long as it
 * is batch-invariant (issue 19).
 * And a third time as the GPU test cuda_kimi_spec (label gpu, KC_SPEC_CUDA:
 * the same on the real CUDA backend; exits 77 without a GPU; with the random
 * head OUT/head where the built one is absent, as on the GPU machine).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "draft/eagle3.h"
#include "engine/loader/safetensors.h"
#include "engine/runtime/engine_ex.h"
#include "engine/runtime/proposer.h"
#include "tests/kimi_c/kimi_c_util.h"
#if defined(bk_cuda_create) || defined(KC_SPEC_CUDA) /* the fake device (cuda_fake renamed the backend), or a GPU */
#include "engine/backend/cuda_backend.h"
#define KC_ON_DEVICE 1
#else
#define KC_ON_DEVICE 0
#endif
#ifdef bk_cuda_create
extern int fake_violations;
#endif

#define NREQ 8
#define MAX_NEW 16
#define BS 16
#define NBLK 96

static backend *g_be;
static model *g_model;
static int V;
static int32_t g_prompts[NREQ][64], g_len[NREQ], g_ref[NREQ][MAX_NEW];

static int real_forward(void *ctx, const model_batch *b, specd_err *err) { return model_forward(ctx, b, err); }

/* a detokenizer writing "t" per token (the token stream is under test) */
static void *dt_create(void *ctx, bool skip) { (void)ctx, (void)skip; return malloc(1); }
static void dt_destroy(void *s) { free(s); }
static int dt_push(void *s, int32_t id, char **o, size_t *l, size_t *c) {
    (void)s;
    if (id < 0) return -1;
    if (*l + 2 > *c) {
        char *nb = realloc(*o, *c + 64);
        if (!nb) return -1;
        *o = nb;
        *c += 64;
    }
    (*o)[(*l)++] = 't';
    (*o)[*l] = 0;
    return 0;
}
static int dt_flush(void *s, char **o, size_t *l, size_t *c) { (void)s, (void)o, (void)l, (void)c; return 0; }

static void reference_decode(int r) {
    int32_t tok[128];
    memcpy(tok, g_prompts[r], sizeof(int32_t) * (size_t)g_len[r]);
    float *lg = malloc(sizeof(float) * (size_t)g_len[r] * V);
    assert_int_equal(kc_run(g_model, 0, tok, g_len[r], 0, lg, NULL, 0, NULL, NULL), 0);
    int32_t next = kc_argmax(lg + (size_t)(g_len[r] - 1) * V, V);
    for (int s = 0; s < MAX_NEW; s++) {
        g_ref[r][s] = next;
        assert_int_equal(kc_run(g_model, 0, &next, 1, g_len[r] + s, lg, NULL, 0, NULL, NULL), 0);
        next = kc_argmax(lg, V);
    }
    free(lg);
}

/* ---- oracle proposer (reference continuation, every third draft corrupted) ---- */
static int32_t or_tok[64][256], or_n[64];
static uint64_t mix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}
static int or_extend(void *ctx, int64_t id, const int32_t *t, int32_t n, int32_t pos0, const float *aux, specd_err *err) {
    (void)ctx, (void)aux, (void)err;
    for (int32_t i = 0; i < n && pos0 + i < 256; i++) or_tok[id % 64][pos0 + i] = t[i];
    or_n[id % 64] = pos0 + n;
    return 0;
}
static int or_propose(void *ctx, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                      int32_t *out, float *q, specd_err *err) {
    (void)ctx, (void)temps, (void)q, (void)err;
    for (int32_t i = 0; i < n; i++) {
        const int64_t id = ids[i] % 64;
        int best = -1;
        for (int r = 0; r < NREQ; r++)
            if (or_n[id] >= g_len[r] && !memcmp(or_tok[id], g_prompts[r], sizeof(int32_t) * (size_t)g_len[r]) &&
                (best < 0 || g_len[r] > g_len[best]))
                best = r;
        for (int32_t j = 0; j < k_max; j++) {
            const int32_t gi = best < 0 ? -1 : or_n[id] - g_len[best] + j;
            int32_t d = j < k[i] && gi >= 0 && gi < MAX_NEW ? g_ref[best][gi] : -1;
            if (d >= 0 && mix((uint64_t)ids[i] * 7919u + (uint64_t)or_n[id] * 31u + (uint64_t)j) % 3 == 0)
                d = (d + 1) % V;
            out[i * k_max + j] = d;
        }
    }
    return 0;
}
static void or_free(void *ctx, int64_t id) { (void)ctx, or_n[id % 64] = 0; }
static void or_trunc(void *ctx, int64_t id, int32_t n) { (void)ctx; if (or_n[id % 64] > n) or_n[id % 64] = n; }
static const spec_proposer_ops or_ops = {.extend = or_extend, .propose = or_propose, .truncate = or_trunc, .free_seq = or_free};
static spec_proposer g_oracle = {.ops = &or_ops, .ctx = NULL};

/* ---- checking wrapper: forwards to the EAGLE-3 proposer, checks its drafts against t2d ---- */
typedef struct chk {
    spec_proposer *in;
    const uint8_t *t2d;      /* [V] the head's map, NULL = no check */
    long drafts, outside;
} chk;
static int ck_aux(void *c, int32_t *l) { return ((chk *)c)->in->ops->aux_layers(((chk *)c)->in->ctx, l); }
static int ck_extend(void *c, int64_t id, const int32_t *t, int32_t n, int32_t pos0, const float *aux, specd_err *err) {
    return ((chk *)c)->in->ops->extend(((chk *)c)->in->ctx, id, t, n, pos0, aux, err);
}
static int ck_propose(void *c, const int64_t *ids, const int32_t *k, int32_t n, int32_t k_max, const float *temps,
                      int32_t *out, float *q, specd_err *err) {
    chk *C = c;
    int rc = C->in->ops->propose(C->in->ctx, ids, k, n, k_max, temps, out, q, err);
    if (rc == 0 && C->t2d)
        for (int32_t i = 0; i < n; i++)
            for (int32_t j = 0; j < k[i]; j++) {
                const int32_t d = out[i * k_max + j];
                C->drafts++;
                if (d < 0 || d >= V || !C->t2d[d]) C->outside++;
            }
    return rc;
}
static void ck_trunc(void *c, int64_t id, int32_t n) { ((chk *)c)->in->ops->truncate(((chk *)c)->in->ctx, id, n); }
static void ck_free(void *c, int64_t id) { ((chk *)c)->in->ops->free_seq(((chk *)c)->in->ctx, id); }
static void ck_kv(void *c, int64_t *t, int64_t *f) {
    chk *C = c;
    if (C->in->ops->kv_usage) C->in->ops->kv_usage(C->in->ctx, t, f);
    else *t = *f = 0;
}
static const spec_proposer_ops ck_ops = {.aux_layers = ck_aux, .extend = ck_extend, .propose = ck_propose,
                                         .truncate = ck_trunc, .free_seq = ck_free, .kv_usage = ck_kv};

/* Runs requests [0, nreq) through an engine with proposer p (k drafts); checks
 * every output against the reference and the pool against leaks. */
static void run(spec_proposer *p, int nreq, int32_t k, engine_stats *st) {
    engine_runner rn = {.ctx = g_model, .forward = real_forward, .vocab = V, .hidden = model_get_config(g_model)->hidden,
                        .block_size = BS, .n_blocks = model_kv_n_blocks(g_model)}; /* less the graphs' padding block */
    engine_detok d = {.stream_create = dt_create, .stream_destroy = dt_destroy, .push = dt_push, .flush = dt_flush};
    engine_config cfg = {.max_model_len = 128, .max_num_seqs = 8, .max_num_batched_tokens = 48, .max_waiting = 64,
                         .num_speculative_tokens = k};
    engine *e = NULL;
    specd_err err = {{0}};
    if (engine_create_ex(&cfg, &rn, &d, g_model, NULL, &e, &err) != 0) fail_msg("%s", err.msg);
    memset(or_n, 0, sizeof or_n);
    if (engine_set_proposer(e, p, &err) != 0 || engine_start(e, &err) != 0) fail_msg("%s", err.msg);
    engine_stream *s[NREQ];
    for (int r = 0; r < nreq; r++) {
        engine_request rq;
        memset(&rq, 0, sizeof rq);
        sampling_params_init(&rq.sp);
        rq.sp.temperature = 0.0f;
        rq.sp.max_tokens = MAX_NEW;
        rq.sp.ignore_eos = true;
        rq.prompt = g_prompts[r];
        rq.n_prompt = (size_t)g_len[r];
        s[r] = engine_submit(e, &rq, NULL, NULL, NULL, &err);
        if (!s[r]) fail_msg("submit: %s", err.msg);
    }
    for (int r = 0; r < nreq; r++) {
        int32_t got[MAX_NEW + 4];
        int n = 0;
        finish_reason fin = FINISH_NONE;
        engine_output *o;
        while (fin == FINISH_NONE && engine_stream_wait(s[r], &o, 300.0)) {
            for (size_t i = 0; i < o->n_tokens && n < MAX_NEW + 4; i++) got[n++] = o->token_ids[i];
            fin = o->finish;
            engine_output_free(o);
        }
        assert_int_equal(fin, FINISH_LENGTH);
        assert_int_equal(n, MAX_NEW);
        for (int i = 0; i < MAX_NEW; i++)
            if (got[i] != g_ref[r][i]) fail_msg("request %d token %d: speculative %d, plain %d", r, i, got[i], g_ref[r][i]);
        engine_stream_release(s[r]);
    }
    assert_int_equal(engine_wait_idle(e, 60.0), 0);
    engine_get_stats(e, st);
    assert_int_equal(st->kv_blocks_free, st->kv_blocks_total);
    engine_destroy(e);
}

static void report(const char *what, const engine_stats *st) {
    printf("kimi_c_spec: %s: drafts %lld, draft tokens %lld, accepted %lld, %lld steps for %lld tokens\n", what,
           (long long)st->spec_num_drafts_total, (long long)st->spec_num_draft_tokens_total,
           (long long)st->spec_num_accepted_tokens_total, (long long)st->steps_total,
           (long long)st->generation_tokens_total);
}

static void test_eagle3_head(void **stt) {
    (void)stt;
    char head[1100], path[1200];
    snprintf(head, sizeof head, "%s/../kimi_head", kc_mini_dir("k25"));
    snprintf(path, sizeof path, "%s/config.json", head);
    struct stat sb;
    const bool built = stat(path, &sb) == 0;
    st_model *hw = NULL;
    const uint8_t *t2d = NULL;
    specd_err err = {{0}};
    if (built) {
        snprintf(path, sizeof path, "%s/model.safetensors", head);
        if (st_open(path, &hw, &err) != 0) fail_msg("%s", err.msg);
        const st_tensor *t = st_find(hw, "t2d");
        assert_non_null(t);
        assert_int_equal(t->dtype, ST_BOOL);
        assert_int_equal(t->n_elements, (uint64_t)V);
        t2d = t->data;
        printf("kimi_c_spec: the miniature's EAGLE-3 head %s (draft vocab from specd vocab)\n", head);
    } else {
        snprintf(head, sizeof head, "%s/../head", kc_mini_dir("k25"));
        printf("kimi_c_spec: NOTE: no built head (kimi_c_head_setup skipped: no ../shared/data?): random head %s\n",
               head);
    }
    const char *what[2] = {built ? "EAGLE-3 head (specd vocab map), k=3, batch 1" : "EAGLE-3 random head, k=3, batch 1",
                           built ? "EAGLE-3 head (specd vocab map), k=3, 8 concurrent"
                                 : "EAGLE-3 random head, k=3, 8 concurrent"};
    for (int b = 0; b < 2; b++) {
        eagle3_opts o = {0};
        if (KC_ON_DEVICE) o.max_rows = 48, o.max_seqs = 8, o.max_k = 3; /* the head's buffers on the device */
        spec_proposer *p = NULL;
        if (eagle3_load(head, g_model, &o, &p, &err) != 0) fail_msg("eagle3_load: %s", err.msg);
        int32_t layers[8];
        assert_int_equal(p->ops->aux_layers(p->ctx, layers), 3);
        assert_int_equal(layers[0], 1); /* eagle_config ids [0, 2, 4] = outputs of 0, 2, 4 = inputs of 1, 3, 5 */
        assert_int_equal(layers[1], 3);
        assert_int_equal(layers[2], 5);
        chk c = {.in = p, .t2d = t2d};
        spec_proposer w = {.ops = &ck_ops, .ctx = &c};
        engine_stats st;
        const int nreq = b == 0 ? 1 : NREQ;
        run(&w, nreq, 3, &st);
        report(what[b], &st);
        assert_true(st.spec_num_draft_tokens_total > 0);
        assert_int_equal(st.generation_tokens_total, nreq * MAX_NEW);
        if (t2d) {
            printf("kimi_c_spec: %ld draft tokens checked against t2d, %ld outside the draft vocabulary\n", c.drafts,
                   c.outside);
            assert_true(c.drafts > 0);
            assert_int_equal(c.outside, 0);
        }
        eagle3_destroy(p);
    }
    st_close(hw);
}

/* The loader refuses heads that do not fit the miniature (make_head.BAD, written by kimi_c_head_setup
 * with the phrase each refusal must contain in kimi_head_bad.json). */
static void test_refusals(void **stt) {
    (void)stt;
    char path[1100];
    snprintf(path, sizeof path, "%s/../kimi_head_bad.json", kc_mini_dir("k25"));
    json_error_t je;
    json_t *want = json_load_file(path, 0, &je);
    if (!want) {
        printf("kimi_c_spec: NOTE: %s absent (kimi_c_head_setup skipped): no refusal checks\n", path);
        return;
    }
    const char *mode;
    json_t *phrase;
    int n = 0;
    json_object_foreach(want, mode, phrase) {
        char dir[1200];
        snprintf(dir, sizeof dir, "%s/../kimi_head_bad/%s", kc_mini_dir("k25"), mode);
        eagle3_opts o = {0};
        spec_proposer *p = NULL;
        specd_err err = {{0}};
        if (eagle3_load(dir, g_model, &o, &p, &err) == 0) {
            eagle3_destroy(p);
            fail_msg("head %s loaded against the miniature; expected a refusal with '%s'", mode,
                     json_string_value(phrase));
        }
        assert_null(p);
        if (!strstr(err.msg, json_string_value(phrase)))
            fail_msg("head %s refused with '%s', expected '%s'", mode, err.msg, json_string_value(phrase));
        printf("kimi_c_spec: refused %s: %s\n", mode, err.msg);
        n++;
    }
    assert_true(n >= 6);
    json_decref(want);
}

static void test_oracle(void **stt) {
    (void)stt;
    engine_stats st;
    run(&g_oracle, NREQ, 3, &st);
    report("oracle drafts (1/3 corrupted), k=3, 8 concurrent", &st);
    assert_true(st.spec_num_accepted_tokens_total > 0);
    assert_true(st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total);
}

int main(void) {
    const char *dir = kc_mini_dir("k25");
#if KC_ON_DEVICE
    char why[256];
    if (bk_cuda_probe(0, why, sizeof why) != 0) {
        printf("SKIP: no usable GPU: %s\n", why);
        return 77;
    }
    const bk_cuda_opts co = {.device = 0, .arena_bytes = (size_t)512 << 20, .max_tokens = 64, .max_seqs = 9,
                             .max_len = 128, .block_size = BS, .max_heads = 4, .max_head_dim = 48,
                             .mla_kv_lora_rank = 32, .moe_experts = 16, .moe_top_k = 4, .moe_hidden = 128,
                             .moe_inter = 64};
    specd_err cerr = {{0}};
    g_be = bk_cuda_create(&co, &cerr);
    if (!g_be) {
        fprintf(stderr, "fake cuda backend: %s\n", cerr.msg);
        return 1;
    }
#else
    g_be = bk_cpu_create(0);
#endif
    model_load_opts lo = {.block_size = BS, .n_blocks = NBLK};
    specd_err err = {{0}};
    if (model_load(dir, g_be, &lo, &g_model, &err) != 0) {
        fprintf(stderr, "model_load: %s\n", err.msg);
        return 1;
    }
    V = model_get_config(g_model)->vocab;
    /* prompts: the 4 fixture prompts, then 4 pseudo-random ones of other lengths */
    json_t *fx = kc_fixture("mini_logits.json");
    const json_t *pr = json_object_get(fx, "prompts");
    uint64_t x = 0x9e3779b9ull;
    for (int r = 0; r < NREQ; r++) {
        if (r < 4) {
            int n;
            int32_t *ids = kc_ids(json_object_get(json_array_get(pr, (size_t)r), "ids"), &n);
            g_len[r] = n;
            memcpy(g_prompts[r], ids, sizeof(int32_t) * (size_t)n);
            free(ids);
        } else {
            g_len[r] = 5 + 11 * (r - 4);
            for (int i = 0; i < g_len[r]; i++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                g_prompts[r][i] = 100 + (int32_t)((x >> 33) % 163000);
            }
        }
        reference_decode(r);
    }
    json_decref(fx);
#if KC_ON_DEVICE
    /* the engine's steps as CUDA graphs (model_graph.c; the aux of the head's layers {1, 3, 5} captured): the
     * references above ran eagerly, so speculative greedy through the graphs == eager plain greedy */
    const int32_t buckets[4] = {1, 2, 4, 8}, qs[2] = {1, 4}, aux_layers[3] = {1, 3, 5};
    const model_graph_opts go = {.buckets = buckets, .n_buckets = 4, .q = qs, .n_q = 2, .n_aux = 3,
                                 .aux_layers = aux_layers, .max_step_tokens = 64, .max_seqs = 9, .max_tokens = 48};
    if (model_graphs_capture(g_model, &go, &err) != 0) {
        fprintf(stderr, "graph capture: %s\n", err.msg);
        return 1;
    }
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_eagle3_head),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_oracle),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
#if KC_ON_DEVICE
    model_graph_stats gst;
    model_graph_get_stats(g_model, &gst);
    printf("kimi_c_spec: CUDA graphs: %d captured, %ld steps replayed (%ld padding rows), %ld eager\n", gst.n_graphs,
           gst.replays, gst.padded_rows, gst.eager);
    if (gst.n_graphs != 8 || gst.replays == 0) {
        fprintf(stderr, "expected 8 graphs and replayed steps\n");
        rc = 1;
    }
#endif
    model_destroy(g_model);
#if KC_ON_DEVICE
    bk_cuda_destroy(g_be);
#ifdef bk_cuda_create
    if (fake_violations) {
        fprintf(stderr, "%d host pointers reached the fake kernels\n", fake_violations);
        rc = 1;
    }
#endif
#else
    bk_cpu_destroy(g_be);
#endif
    return rc;
}
