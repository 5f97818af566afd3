/*
 * test_draft_config.c: EAGLE-3 config.json parsing in both layouts
 * (draft/eagle3_config.h): the fields, the defaults REFERENCE §2 pins
 * (norm_before_residual missing = false, rope_theta missing = 10000), the aux
 * layer id conventions, and the refusals (pickle-only heads, variants specd
 * does not implement, bad sizes).
 * The configs below follow the shapes written by SpecForge (a Llama config +
 * draft_vocab_size + eagle_config) and by speculators 0.9 (Eagle3SpeculatorConfig
 * serialised; see tools/eagle3/make_random_head.py, which writes the same).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>
#include <math.h>

#include "draft/eagle3_config.h"

static const char *SPECULATORS =
    "{\"architectures\": [\"Eagle3Speculator\"], \"speculators_model_type\": \"eagle3\","
    " \"speculators_version\": \"0.9.0\","
    " \"transformer_layer_config\": {\"model_type\": \"llama\", \"hidden_size\": 576, \"num_attention_heads\": 9,"
    "   \"num_key_value_heads\": 3, \"head_dim\": 64, \"intermediate_size\": 1536, \"num_hidden_layers\": 1,"
    "   \"hidden_act\": \"silu\", \"rms_norm_eps\": 1e-05, \"vocab_size\": 49152, \"max_position_embeddings\": 8192,"
    "   \"attention_bias\": false, \"mlp_bias\": false, \"rope_theta\": 100000.0},"
    " \"draft_vocab_size\": 32000, \"norm_before_residual\": true, \"target_hidden_size\": 576,"
    " \"eagle_aux_hidden_state_layer_ids\": [2, 15, 27],"
    " \"speculators_config\": {\"algorithm\": \"eagle3\", \"proposal_methods\": [{\"proposal_type\": \"greedy\","
    "   \"speculative_tokens\": 3}], \"default_proposal_method\": \"greedy\","
    "   \"verifier\": {\"name_or_path\": \"HuggingFaceTB/SmolLM2-135M-Instruct\", \"architectures\": [\"LlamaForCausalLM\"]}}}";

/* SpecForge-style: rope_theta and norm_before_residual absent, GQA 32/8, an
 * explicit head_dim, eagle_config ids in SpecForge's output convention. */
static const char *EAGLE =
    "{\"architectures\": [\"LlamaForCausalLMEagle3\"], \"model_type\": \"llama\", \"hidden_size\": 4096,"
    " \"num_attention_heads\": 32, \"num_key_value_heads\": 8, \"intermediate_size\": 14336,"
    " \"num_hidden_layers\": 1, \"rms_norm_eps\": 1e-05, \"vocab_size\": 128256, \"draft_vocab_size\": 32000,"
    " \"max_position_embeddings\": 2048, \"hidden_act\": \"silu\", \"tie_word_embeddings\": false,"
    " \"eagle_config\": {\"eagle_aux_hidden_state_layer_ids\": [1, 15, 28], \"use_aux_hidden_state\": true}}";

static void parse_ok(const char *js, eagle3_config *c) {
    specd_err err = {{0}};
    int rc = eagle3_config_parse(js, strlen(js), c, &err);
    if (rc != 0) fprintf(stderr, "unexpected error: %s\n", err.msg);
    assert_int_equal(rc, 0);
}

static void parse_fails(const char *js, const char *needle) {
    eagle3_config c;
    specd_err err = {{0}};
    assert_int_equal(eagle3_config_parse(js, strlen(js), &c, &err), -1);
    if (!strstr(err.msg, needle)) fprintf(stderr, "message '%s' lacks '%s'\n", err.msg, needle);
    assert_non_null(strstr(err.msg, needle));
}

static void test_speculators_layout(void **state) {
    (void)state;
    eagle3_config c;
    parse_ok(SPECULATORS, &c);
    assert_int_equal(c.layout, EAGLE3_LAYOUT_SPECULATORS);
    assert_int_equal(c.hidden, 576);
    assert_int_equal(c.target_hidden, 576);
    assert_int_equal(c.n_heads, 9);
    assert_int_equal(c.n_kv_heads, 3);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.ffn, 1536);
    assert_int_equal(c.draft_vocab, 32000);
    assert_int_equal(c.target_vocab, 49152);
    assert_true(c.rope_theta == 100000.0f);
    assert_false(c.rope_theta_defaulted);
    assert_true(c.rms_eps == 1e-5f);
    assert_true(c.norm_before_residual);
    assert_false(c.attention_bias);
    assert_int_equal(c.n_aux_ids, 3);
    assert_int_equal(c.aux_ids[1], 15);
    assert_int_equal(c.aux_ids_source, EAGLE3_AUX_INPUT);
    assert_string_equal(c.verifier, "HuggingFaceTB/SmolLM2-135M-Instruct");
}

static void test_eagle_layout_defaults(void **state) {
    (void)state;
    eagle3_config c;
    parse_ok(EAGLE, &c);
    assert_int_equal(c.layout, EAGLE3_LAYOUT_EAGLE);
    assert_int_equal(c.hidden, 4096);
    assert_int_equal(c.target_hidden, 4096);  /* target_hidden_size missing = hidden */
    assert_int_equal(c.n_kv_heads, 8);
    assert_int_equal(c.head_dim, 128);        /* head_dim missing = hidden / heads */
    assert_true(c.rope_theta == 10000.0f);    /* rope_theta missing = 10000 */
    assert_true(c.rope_theta_defaulted);
    assert_false(c.norm_before_residual);     /* missing = FALSE */
    assert_int_equal(c.target_vocab, 128256);
    assert_int_equal(c.n_aux_ids, 3);
    assert_int_equal(c.aux_ids_source, EAGLE3_AUX_OUTPUT);
}

static void test_speculators_nbr_missing_is_false(void **state) {
    (void)state;
    char *js = strdup(SPECULATORS);
    char *p = strstr(js, "\"norm_before_residual\": true,");
    assert_non_null(p);
    memset(p, ' ', strlen("\"norm_before_residual\": true,"));
    eagle3_config c;
    parse_ok(js, &c);
    assert_false(c.norm_before_residual);
    /* rope_theta from transformers v5 rope_parameters */
    free(js);
    const char *v5 = "{\"speculators_model_type\": \"eagle3\", \"draft_vocab_size\": 100, \"transformer_layer_config\": "
                     "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"intermediate_size\": 128, \"vocab_size\": 200,"
                     " \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 500000.0}}}";
    parse_ok(v5, &c);
    assert_true(c.rope_theta == 500000.0f);
    assert_int_equal(c.n_kv_heads, 4);
    assert_true(c.rms_eps == 1e-6f);
    assert_int_equal(c.n_aux_ids, 0);
}

static void test_aux_layer_conventions(void **state) {
    (void)state;
    eagle3_config c;
    int32_t ids[EAGLE3_MAX_AUX];
    specd_err err = {{0}};
    parse_ok(SPECULATORS, &c); /* top-level ids: input convention, used as is */
    assert_int_equal(eagle3_config_aux_layers(&c, 30, EAGLE3_AUX_AUTO, 3, ids, &err), 3);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 15);
    assert_int_equal(ids[2], 27);
    assert_int_equal(eagle3_config_aux_layers(&c, 30, EAGLE3_AUX_OUTPUT, 3, ids, &err), 3);
    assert_int_equal(ids[0], 3);
    assert_int_equal(ids[2], 28);
    parse_ok(EAGLE, &c); /* eagle_config ids: SpecForge/SGLang output convention -> +1 */
    assert_int_equal(eagle3_config_aux_layers(&c, 32, EAGLE3_AUX_AUTO, 3, ids, &err), 3);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 16);
    assert_int_equal(ids[2], 29);
    assert_int_equal(eagle3_config_aux_layers(&c, 32, EAGLE3_AUX_INPUT, 3, ids, &err), 3);
    assert_int_equal(ids[0], 1);
    /* defaults {2, N/2, N-3}: N = 61 -> 2, 30, 58 (REFERENCE §2) */
    c.n_aux_ids = 0;
    assert_int_equal(eagle3_config_aux_layers(&c, 61, EAGLE3_AUX_AUTO, 3, ids, &err), 3);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 30);
    assert_int_equal(ids[2], 58);
    /* out of range, count mismatch */
    parse_ok(SPECULATORS, &c);
    assert_int_equal(eagle3_config_aux_layers(&c, 28, EAGLE3_AUX_OUTPUT, 3, ids, &err), -1);
    assert_non_null(strstr(err.msg, "outside"));
    assert_int_equal(eagle3_config_aux_layers(&c, 30, EAGLE3_AUX_AUTO, 2, ids, &err), -1);
    assert_non_null(strstr(err.msg, "fc takes 2"));
}

static void test_refusals(void **state) {
    (void)state;
    parse_fails("[1, 2]", "not a JSON object");
    parse_fails("{\"hidden_size\": 64}", "neither an EAGLE-3 head");
    parse_fails("{\"speculators_model_type\": \"eagle\", \"draft_vocab_size\": 3}", "eagle3 only");
    parse_fails("{\"draft_vocab_size\": 100, \"hidden_size\": 64, \"num_attention_heads\": 4, \"intermediate_size\": 128}",
                "'vocab_size' is missing");
    parse_fails("{\"draft_vocab_size\": 300, \"hidden_size\": 64, \"num_attention_heads\": 4, \"intermediate_size\": 128,"
                " \"vocab_size\": 200}", "exceeds the target vocab_size");
    parse_fails("{\"draft_vocab_size\": 100, \"hidden_size\": 64, \"num_attention_heads\": 4, \"num_key_value_heads\": 3,"
                " \"intermediate_size\": 128, \"vocab_size\": 200}", "not a multiple");
    parse_fails("{\"draft_vocab_size\": 100, \"hidden_size\": 64, \"num_attention_heads\": 4, \"intermediate_size\": 128,"
                " \"vocab_size\": 200, \"norm_before_fc\": true}", "norm_before_fc");
    parse_fails("{\"draft_vocab_size\": 100, \"hidden_size\": 64, \"num_attention_heads\": 4, \"intermediate_size\": 128,"
                " \"vocab_size\": 200, \"norm_before_residual\": \"yes\"}", "must be true or false");
    parse_fails("{\"draft_vocab_size\": -5, \"hidden_size\": 64, \"num_attention_heads\": 4, \"intermediate_size\": 128,"
                " \"vocab_size\": 200}", "out of range");
    parse_fails("{\"draft_vocab_size\": 100, \"hidden_size\": 64, \"num_attention_heads\": 4, \"intermediate_size\": 128,"
                " \"vocab_size\": 200, \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}}", "yarn");
    /* fuzz finding: a linear rope_scaling with a huge original_max_position_embeddings overflowed int32 */
    parse_fails("{\"draft_vocab_size\": 100, \"hidden_size\": 64, \"num_attention_heads\": 4, \"intermediate_size\": 128,"
                " \"vocab_size\": 200, \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2,"
                " \"original_max_position_embeddings\": 8.1e93}}", "original_max_position_embeddings");
    parse_fails("{\"draft_vocab_size\": 100, \"hidden_size\": 64, \"num_attention_heads\": 4, \"intermediate_size\": 128,"
                " \"vocab_size\": 200, \"eagle_aux_hidden_state_layer_ids\": [1, -2, 3]}", "not a layer id");
    parse_fails("{\"draft_vocab_size\": 1, \"draft_vocab_size\": 2}", "invalid JSON");
}

static void test_pickle_only_dir_refused(void **state) {
    (void)state;
    char dir[] = "/tmp/specd_draft_cfg_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char p[256];
    snprintf(p, sizeof p, "%s/config.json", dir);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs(SPECULATORS, f);
    fclose(f);
    snprintf(p, sizeof p, "%s/pytorch_model.bin", dir);
    f = fopen(p, "w");
    assert_non_null(f);
    fputs("pickle", f);
    fclose(f);
    eagle3_config c;
    specd_err err = {{0}};
    assert_int_equal(eagle3_config_load(dir, &c, &err), -1);
    assert_non_null(strstr(err.msg, "safetensors only"));
    unlink(p);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    f = fopen(p, "w");
    assert_non_null(f);
    fclose(f);
    assert_int_equal(eagle3_config_load(dir, &c, &err), 0); /* the config itself parses */
    assert_int_equal(c.layout, EAGLE3_LAYOUT_SPECULATORS);
    unlink(p);
    snprintf(p, sizeof p, "%s/config.json", dir);
    unlink(p);
    rmdir(dir);
}

/* RoPE inverse frequencies vs transformers (tests/fixtures/draft/rope_inv_freq.json,
 * tools/gen_draft_fixtures.py): default theta (given / missing), linear and
 * Llama 3.1 "llama3" rope_scaling. */
static void test_rope_inv_freq_vs_transformers(void **state) {
    (void)state;
    char p[1024];
    const char *src = getenv("SPECD_SOURCE_DIR");
    snprintf(p, sizeof p, "%s/tests/fixtures/draft/rope_inv_freq.json", src ? src : ".");
    json_error_t je;
    json_t *fx = json_load_file(p, 0, &je);
    assert_non_null(fx);
    json_t *cases = json_object_get(fx, "cases");
    assert_int_equal(json_array_size(cases), 4);
    for (size_t i = 0; i < json_array_size(cases); i++) {
        json_t *cs = json_array_get(cases, i);
        json_t *cfg = json_deep_copy(json_object_get(cs, "config"));
        json_object_set_new(cfg, "draft_vocab_size", json_integer(100));
        json_object_set_new(cfg, "vocab_size", json_integer(1000));
        json_object_set_new(cfg, "intermediate_size", json_integer(128));
        char *text = json_dumps(cfg, 0);
        eagle3_config c;
        parse_ok(text, &c);
        json_t *ref = json_object_get(cs, "inv_freq");
        assert_int_equal(json_array_size(ref), c.head_dim / 2);
        float inv[512];
        eagle3_config_inv_freq(&c, inv);
        double worst = 0;
        for (int32_t k = 0; k < c.head_dim / 2; k++) {
            double r = json_number_value(json_array_get(ref, (size_t)k));
            worst = fmax(worst, fabs(inv[k] - r) / r);
        }
        if (worst > 1e-6) fprintf(stderr, "%s: worst relative diff %.3g\n", json_string_value(json_object_get(cs, "name")), worst);
        assert_true(worst <= 1e-6);
        free(text);
        json_decref(cfg);
    }
    json_decref(fx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_speculators_layout),
        cmocka_unit_test(test_eagle_layout_defaults),
        cmocka_unit_test(test_speculators_nbr_missing_is_false),
        cmocka_unit_test(test_aux_layer_conventions),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_pickle_only_dir_refused),
        cmocka_unit_test(test_rope_inv_freq_vs_transformers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
