/*
 * test_load.c (model_hf_load): an HF Llama directory's config.json mapped to
 * model_config (head_dim, GQA, tied embeddings, RoPE layout and scaling); the
 * matrices are views of the mapped safetensors in their stored dtype (no
 * copy); the parallel style of every HF tensor name; and refusals: broken
 * checkpoints written by tools/gen_llama_hf_mini.py (missing tensor, wrong
 * shapes, F64 dtype, a layer past num_hidden_layers, no lm_head when untied,
 * vocab_size disagreeing with the embedding, YaRN scaling, 4 heads over 3 kv
 * heads) and config.json texts, each refused with a message naming the
 * problem (tensor and file for tensors), none crashing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>

#include "engine/loader/safetensors.h"
#include "engine/model/hf_config.h"
#include "engine/model/model_internal.h"
#include "tests/model_hf/model_hf_util.h"

static backend *g_be;

static void test_config(void **s) {
    (void)s;
    model *m = mh_load(g_be, mh_dir("f32"));
    const model_config *c = model_get_config(m);
    assert_int_equal(c->arch, MODEL_ARCH_LLAMA);
    assert_int_equal(c->n_layers, 3);
    assert_int_equal(c->hidden, 64);
    assert_int_equal(c->n_heads, 4);
    assert_int_equal(c->n_kv_heads, 2);
    assert_int_equal(c->head_dim, 16);
    assert_int_equal(c->ffn, 176);
    assert_int_equal(c->vocab, 512);
    assert_int_equal(c->max_pos, 512);
    assert_false(c->tied_embeddings);
    assert_true(c->rope_neox);
    assert_true(fabsf(c->rms_eps - 1e-5f) < 1e-12f);
    assert_true(c->rope_theta == 10000.0f);
    assert_null(model_gguf(m));
    /* inv_freq = 10000^(-2i/16), no scaling */
    for (int i = 0; i < 8; i++) assert_true(fabs(m->inv_freq[i] - pow(10000.0, -2.0 * i / 16)) < 1e-7 * pow(10000.0, -2.0 * i / 16) + 1e-12);
    /* the matrices are views of the stored F32 bytes */
    st_model *st = NULL;
    specd_err err = {{0}};
    assert_int_equal(st_open(mh_dir("f32"), &st, &err), 0);
    const st_tensor *t = st_find(st, "model.layers.2.mlp.down_proj.weight");
    assert_non_null(t);
    const bk_weight *w = &m->layers[2].wdown;
    assert_int_equal(w->type, BK_W_F32);
    assert_int_equal(w->rows, 64);
    assert_int_equal(w->cols, 176);
    assert_memory_equal(w->data, t->data, t->nbytes);
    assert_ptr_not_equal(model_lm_head_weight(m)->data, model_embed_weight(m)->data);
    /* every linear's parallel style, by its HF name */
    for (size_t i = 0; i < st_n_tensors(st); i++) {
        const char *nm = st_tensor_at(st, i)->name;
        tp_style want = TP_REPLICATED;
        if (strstr(nm, ".q_proj.") || strstr(nm, ".k_proj.") || strstr(nm, ".v_proj.") || strstr(nm, ".gate_proj.") ||
            strstr(nm, ".up_proj."))
            want = TP_COLUMN;
        else if (strstr(nm, ".o_proj.") || strstr(nm, ".down_proj."))
            want = TP_ROW;
        if (model_linear_parallel(nm) != want) fail_msg("%s: parallel style %d, want %d", nm, model_linear_parallel(nm), want);
    }
    st_close(st);
    model_destroy(m);

    m = mh_load(g_be, mh_dir("bf16")); /* tied, head_dim 24 != 64 / 4 */
    c = model_get_config(m);
    assert_int_equal(c->head_dim, 24);
    assert_true(c->tied_embeddings);
    assert_int_equal(m->layers[0].wq.rows, 96);
    assert_int_equal(m->layers[0].wq.type, BK_W_BF16);
    assert_int_equal(m->layers[0].wo.cols, 96);
    assert_ptr_equal(model_lm_head_weight(m)->data, model_embed_weight(m)->data);
    model_destroy(m);

    m = mh_load(g_be, mh_dir("sharded")); /* F16 in 2 shards, llama3 scaling, 1 kv head */
    assert_int_equal(model_get_config(m)->n_kv_heads, 1);
    assert_int_equal(m->layers[1].wup.type, BK_W_F16);
    model_destroy(m);

    hf_config hc;
    assert_int_equal(hf_config_load(mh_dir("sharded"), &hc, &err), 0);
    assert_int_equal(hc.rope_kind, HF_ROPE_LLAMA3);
    assert_true(hc.rope_factor == 8.0 && hc.rope_low_freq == 1.0 && hc.rope_high_freq == 4.0);
    assert_int_equal(hc.rope_orig_max_pos, 64);
    assert_int_equal(hf_config_load(mh_dir("mistral"), &hc, &err), 0);
    assert_int_equal(hc.rope_kind, HF_ROPE_LINEAR);
    assert_true(hc.rope_factor == 2.0);
    assert_string_equal(hc.model_type, "mistral");
}

/* model_load(DIR) fails and the message holds every one of the NULL-terminated substrings. */
static void expect_refusal(const char *dir, const char *const *want) {
    model *m = NULL;
    specd_err err = {{0}};
    model_load_opts o = {.block_size = MH_BS, .n_blocks = 8};
    assert_int_equal(model_load(dir, g_be, &o, &m, &err), -1);
    assert_null(m);
    for (int i = 0; want[i]; i++)
        if (!strstr(err.msg, want[i])) fail_msg("%s: message lacks '%s': %s", dir, want[i], err.msg);
    printf("refused %s: %s\n", strrchr(dir, '/') + 1, err.msg);
}

static void test_refusals(void **s) {
    (void)s;
    static const struct { const char *dir; const char *want[5]; } CASES[] = {
        {"bad_missing", {"model.layers.1.mlp.up_proj.weight", "model.safetensors", "missing", NULL}},
        {"bad_shape", {"model.layers.0.self_attn.k_proj.weight", "model.safetensors", "[48, 64]", "expected [32, 64]"}},
        {"bad_norm_shape", {"model.norm.weight", "shape [64, 1], expected [64]", NULL}},
        {"bad_dtype", {"model.layers.2.self_attn.o_proj.weight", "F64", "not supported", NULL}},
        {"bad_extra_layer", {"model.layers.3.mlp.up_proj.weight", "unexpected tensor", NULL}},
        {"bad_no_lm_head", {"lm_head.weight", "missing", "tie_word_embeddings is false", NULL}},
        {"bad_vocab", {"model.embed_tokens.weight", "[512, 64]", "expected [500, 64]", NULL}},
        {"bad_rope", {"rope scaling type 'yarn'", "not supported", NULL}},
        {"bad_kv_heads", {"num_attention_heads 4", "num_key_value_heads 3", NULL}},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) expect_refusal(mh_dir(CASES[i].dir), CASES[i].want);
}

#define BASE "\"model_type\":\"llama\",\"vocab_size\":512,\"hidden_size\":64,\"intermediate_size\":128," \
             "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2"

static void test_config_refusals(void **s) {
    (void)s;
    hf_config c;
    specd_err err = {{0}};
    assert_int_equal(hf_config_parse("{" BASE "}", &c, &err), 0); /* defaults */
    assert_int_equal(c.head_dim, 16);
    assert_int_equal(c.max_pos, 2048);
    assert_true(c.rope_theta == 10000.0 && c.rms_eps == 1e-6 && !c.tie_embeddings);
    assert_int_equal(c.rope_kind, HF_ROPE_DEFAULT);
    assert_int_equal(hf_config_parse("{" BASE ",\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":5e5}}", &c, &err), 0);
    assert_true(c.rope_theta == 5e5);
    assert_int_equal(hf_config_parse("{\"model_type\":\"llama\",\"vocab_size\":512,\"hidden_size\":64,"
                                     "\"intermediate_size\":128,\"num_hidden_layers\":2,\"num_attention_heads\":4}", &c, &err), 0);
    assert_int_equal(c.n_kv_heads, 4); /* MHA default */
    static const char *const BAD[][2] = {
        {"{\"model_type\":\"qwen2\"}", "qwen2"},
        {"{\"model_type\":\"llama\",\"vocab_size\":512}", "'hidden_size' is missing"},
        {"{" BASE ",\"hidden_size\":\"64\"}", "duplicate"}, /* duplicate keys are rejected by the JSON reader */
        {"{\"model_type\":\"llama\",\"vocab_size\":512,\"hidden_size\":\"64\",\"intermediate_size\":128,"
         "\"num_hidden_layers\":2,\"num_attention_heads\":4}", "'hidden_size' must be an integer"},
        {"{" BASE ",\"head_dim\":15}", "head_dim 15 is odd"},
        {"{" BASE ",\"rms_norm_eps\":-1}", "'rms_norm_eps'"},
        {"{" BASE ",\"max_position_embeddings\":0}", "'max_position_embeddings' = 0"},
        {"{" BASE ",\"hidden_act\":\"gelu\"}", "hidden_act 'gelu'"},
        {"{" BASE ",\"attention_bias\":true}", "attention_bias"},
        {"{" BASE ",\"mlp_bias\":true}", "mlp_bias"},
        {"{" BASE ",\"sliding_window\":1024,\"max_position_embeddings\":4096}", "sliding_window 1024"},
        {"{" BASE ",\"rope_scaling\":{\"type\":\"dynamic\",\"factor\":2.0}}", "'dynamic'"},
        {"{" BASE ",\"rope_scaling\":{\"rope_type\":\"longrope\"}}", "'longrope'"},
        {"{" BASE ",\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0}}", "original_max_position_embeddings"},
        {"{" BASE ",\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0,\"low_freq_factor\":4,"
         "\"high_freq_factor\":1,\"original_max_position_embeddings\":8192}}", "low_freq_factor < high_freq_factor"},
        {"{" BASE ",\"rope_scaling\":{\"rope_type\":\"linear\"}}", "'factor' >= 1"},
        {"{" BASE ",\"rope_scaling\":[1]}", "must be an object"},
        {"{\"model_type\":\"llama\",\"vocab_size\":512,\"hidden_size\":64,\"intermediate_size\":128,"
         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":0}", "'num_key_value_heads' = 0"},
        {"{\"model_type\":\"mistral\",\"vocab_size\":512,\"hidden_size\":64,\"intermediate_size\":128,"
         "\"num_hidden_layers\":100000,\"num_attention_heads\":4}", "'num_hidden_layers' = 100000"},
        {"{" BASE ",\"tie_word_embeddings\":1}", "'tie_word_embeddings' must be true or false"},
    };
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        specd_err_clear(&err);
        if (hf_config_parse(BAD[i][0], &c, &err) != -1) fail_msg("accepted: %s", BAD[i][0]);
        if (!strstr(err.msg, BAD[i][1])) fail_msg("%s: message lacks '%s': %s", BAD[i][0], BAD[i][1], err.msg);
    }
    /* a quantized llama config parses but the loader refuses it */
    static const char QCFG[] = "{" BASE ",\"quantization_config\":{\"quant_method\":\"compressed-tensors\","
                               "\"format\":\"pack-quantized\",\"config_groups\":{\"g\":{\"weights\":{\"num_bits\":4,"
                               "\"group_size\":32,\"symmetric\":true,\"strategy\":\"group\",\"type\":\"int\"}}}}}";
    assert_int_equal(hf_config_parse(QCFG, &c, &err), 0);
    model m;
    memset(&m, 0, sizeof m);
    st_model *st = NULL;
    assert_int_equal(llama_load_hf(&m, &c, &st, &err), -1);
    assert_non_null(strstr(err.msg, "quantized"));
    assert_null(st);
}

int main(void) {
    mh_dir("f32");
    g_be = bk_cpu_create(2);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_config), cmocka_unit_test(test_refusals),
                                       cmocka_unit_test(test_config_refusals)};
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    bk_cpu_destroy(g_be);
    return rc;
}
