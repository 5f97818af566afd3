/*
 * test_load.c (kimi_c_load): loading DeepSeek-V3 / Kimi-K2.5 checkpoints.
 *   - config.json: the kimi_k25 top level with text_config model_type kimi_k2
 *     (k25) or deepseek_v3 (nomodel), a plain deepseek_v3 config (dsv3); the
 *     values REFERENCE section 1 / make_mini.py put there, YaRN, the
 *     compressed-tensors block; transformers 5's rope_parameters spelling;
 *     refusals of what specd does not run (softmax scoring, 8-bit or
 *     asymmetric quantization, other rope scalings, unknown model types).
 *   - the three tensor-name layouts (language_model.model.*, language_model.*,
 *     model.*) load and give bit-identical logits;
 *   - every tensor of the checkpoint has a declared parallel style, and the
 *     styles are REFERENCE section 1's;
 *   - a config that disagrees with the weights is refused naming the tensor;
 *   - vision-tower tensors in an extra shard are ignored (same logits);
 *   - the real Kimi-K2.5 config parses, with its YaRN numbers.
 */
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>
#include <cmocka.h>

#include "engine/model/deepseek_v3.h"
#include "tests/kimi_c/kimi_c_util.h"

static void test_configs(void **st) {
    (void)st;
    hf_config c;
    specd_err err = {{0}};
    assert_int_equal(hf_config_load(kc_mini_dir("k25"), &c, &err), 0);
    assert_string_equal(c.top_model_type, "kimi_k25");
    assert_string_equal(c.model_type, "kimi_k2");
    assert_true(c.has_vision);
    assert_int_equal(c.arch, MODEL_ARCH_DEEPSEEK_V3);
    assert_int_equal(c.vocab, 163840);
    assert_int_equal(c.hidden, 128);
    assert_int_equal(c.n_layers, 6);
    assert_int_equal(c.first_k_dense, 1);
    assert_int_equal(c.n_routed_experts, 16);
    assert_int_equal(c.n_experts_per_tok, 4);
    assert_int_equal(c.n_shared_experts, 1);
    assert_int_equal(c.q_lora_rank, 64);
    assert_int_equal(c.kv_lora_rank, 32);
    assert_int_equal(c.qk_nope, 32);
    assert_int_equal(c.qk_rope, 16);
    assert_int_equal(c.v_head, 32);
    assert_true(c.yarn && c.yarn_factor == 64 && c.yarn_orig_max_pos == 4096 && c.yarn_beta_fast == 32 &&
                c.yarn_beta_slow == 1 && c.yarn_mscale == 1 && c.yarn_mscale_all_dim == 1);
    assert_true(c.rope_theta == 50000 && fabs(c.routed_scaling - 2.827) < 1e-6 && c.norm_topk_prob);
    assert_true(c.rms_eps == 1e-5 && !c.tie_embeddings);
    assert_int_equal(c.bos_id, 163584);
    assert_int_equal(c.eos_id, 163585);
    assert_true(c.quant.present && c.quant.num_bits == 4 && c.quant.group_size == 32 && c.quant.symmetric);
    assert_string_equal(c.quant.format, "pack-quantized");
    assert_int_equal(hf_config_load(kc_mini_dir("nomodel"), &c, &err), 0);
    assert_string_equal(c.top_model_type, "kimi_k25");
    assert_string_equal(c.model_type, "deepseek_v3");
    assert_int_equal(hf_config_load(kc_mini_dir("dsv3"), &c, &err), 0);
    assert_string_equal(c.top_model_type, "deepseek_v3");
    assert_false(c.has_vision);
    assert_true(c.quant.present);
}

/* CORE lacks hidden_size, num_experts_per_tok and qk_rope_head_dim (the cases vary them) */
#define CORE                                                                                                       \
    "\"model_type\":\"deepseek_v3\",\"vocab_size\":1000,\"num_hidden_layers\":2,"                                  \
    "\"num_attention_heads\":2,\"intermediate_size\":128,\"moe_intermediate_size\":32,\"n_routed_experts\":8,"      \
    "\"kv_lora_rank\":32,\"qk_nope_head_dim\":16,\"v_head_dim\":16"
#define BASE CORE ",\"hidden_size\":64,\"num_experts_per_tok\":2,\"qk_rope_head_dim\":8"

static void test_config_variants_and_refusals(void **st) {
    (void)st;
    hf_config c;
    specd_err err = {{0}};
    /* transformers 5 spelling: rope_parameters with rope_type */
    assert_int_equal(hf_config_parse("{" BASE ",\"rope_parameters\":{\"rope_type\":\"yarn\",\"rope_theta\":50000,"
                                     "\"factor\":40,\"original_max_position_embeddings\":4096,\"mscale\":1,"
                                     "\"mscale_all_dim\":1}}", &c, &err), 0);
    assert_true(c.yarn && c.yarn_factor == 40 && c.rope_theta == 50000 && c.yarn_beta_fast == 32);
    /* no rope scaling, no quantization, defaults */
    assert_int_equal(hf_config_parse("{" BASE "}", &c, &err), 0);
    assert_false(c.yarn);
    assert_false(c.quant.present);
    assert_int_equal(c.n_group, 1);
    assert_int_equal(c.q_lora_rank, 0);
    /* kimi_k25 with a deepseek_v3 text_config */
    assert_int_equal(hf_config_parse("{\"model_type\":\"kimi_k25\",\"vision_config\":{},\"text_config\":{" BASE "}}",
                                     &c, &err), 0);
    assert_true(c.has_vision && c.arch == MODEL_ARCH_DEEPSEEK_V3);
    static const char *const BAD[][2] = {
        {"{" BASE ",\"scoring_func\":\"softmax\"}", "scoring_func"},
        {"{" BASE ",\"topk_method\":\"greedy\"}", "topk_method"},
        {"{" BASE ",\"rope_scaling\":{\"type\":\"linear\",\"factor\":2}}", "linear"},
        {"{" CORE ",\"hidden_size\":\"64\",\"num_experts_per_tok\":2,\"qk_rope_head_dim\":8}", "hidden_size"},
        {"{" CORE ",\"hidden_size\":64,\"num_experts_per_tok\":9,\"qk_rope_head_dim\":8}", "routing"},
        {"{" CORE ",\"hidden_size\":64,\"num_experts_per_tok\":2,\"qk_rope_head_dim\":7}", "odd"},
        {"{" BASE ",\"hidden_size\":64}", "duplicate"},
        {"{\"model_type\":\"kimi_k25\"}", "text_config"},
        {"{\"model_type\":\"qwen2\"}", "qwen2"},
        {"{" BASE ",\"quantization_config\":{\"quant_method\":\"compressed-tensors\",\"format\":\"pack-quantized\","
         "\"config_groups\":{\"g\":{\"weights\":{\"num_bits\":8,\"group_size\":32,\"symmetric\":true,"
         "\"strategy\":\"group\"}}}}}", "int4"},
        {"{" BASE ",\"quantization_config\":{\"quant_method\":\"compressed-tensors\",\"format\":\"pack-quantized\","
         "\"config_groups\":{\"g\":{\"weights\":{\"num_bits\":4,\"group_size\":32,\"symmetric\":false,"
         "\"strategy\":\"group\"}}}}}", "asymmetric"},
        {"{" BASE ",\"quantization_config\":{\"quant_method\":\"fp8\"}}", "fp8"},
        {"[1]", "object"},
    };
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        specd_err_clear(&err);
        assert_int_equal(hf_config_parse(BAD[i][0], &c, &err), -1);
        if (!strstr(err.msg, BAD[i][1])) fprintf(stderr, "case %zu: '%s' lacks '%s'\n", i, err.msg, BAD[i][1]);
        assert_non_null(strstr(err.msg, BAD[i][1]));
    }
}

static void test_layouts_identical(void **st) {
    (void)st;
    json_t *fx = kc_fixture("mini_logits.json");
    int n;
    int32_t *ids = kc_ids(json_object_get(json_array_get(json_object_get(fx, "prompts"), 1), "ids"), &n);
    backend *be = bk_cpu_create(0);
    static const char *const LAYOUTS[] = {"k25", "nomodel", "dsv3"};
    float *ref = NULL;
    int V = 0;
    for (int k = 0; k < 3; k++) {
        model *m = kc_load(be, kc_mini_dir(LAYOUTS[k]), 1);
        V = model_get_config(m)->vocab;
        float *lg = malloc(sizeof(float) * (size_t)n * V);
        assert_int_equal(kc_run(m, 0, ids, n, 0, lg, NULL, 0, NULL, NULL), 0);
        if (!ref) ref = lg;
        else {
            assert_memory_equal(ref, lg, sizeof(float) * (size_t)n * V);
            free(lg);
        }
        model_destroy(m);
    }
    printf("kimi_c_load: language_model.model.*, language_model.*, model.* layouts: logits bit-identical\n");
    free(ref);
    free(ids);
    bk_cpu_destroy(be);
    json_decref(fx);
}

static void test_parallel_styles(void **st) {
    (void)st;
    st_model *sm = NULL;
    specd_err err = {{0}};
    assert_int_equal(st_open(kc_mini_dir("k25"), &sm, &err), 0);
    for (size_t i = 0; i < st_n_tensors(sm); i++) {
        const char *nm = st_tensor_at(sm, i)->name;
        if (dsv3_tensor_parallel(nm) < 0) fprintf(stderr, "no parallel style for %s\n", nm);
        assert_true(dsv3_tensor_parallel(nm) >= 0);
    }
    printf("kimi_c_load: all %zu tensors have a parallel style\n", st_n_tensors(sm));
    st_close(sm);
    static const struct { const char *name; int style; } WANT[] = {
        {"language_model.model.layers.3.self_attn.q_a_proj.weight", TP_REPLICATED},
        {"language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight", TP_REPLICATED},
        {"language_model.model.layers.3.self_attn.q_b_proj.weight", TP_COLUMN},
        {"language_model.model.layers.3.self_attn.kv_b_proj.weight", TP_COLUMN},
        {"language_model.model.layers.3.self_attn.o_proj.weight", TP_ROW},
        {"language_model.model.layers.0.mlp.gate_proj.weight", TP_COLUMN},
        {"language_model.model.layers.0.mlp.down_proj.weight", TP_ROW},
        {"language_model.model.layers.3.mlp.gate.weight", TP_REPLICATED},
        {"language_model.model.layers.3.mlp.gate.e_score_correction_bias", TP_REPLICATED},
        {"language_model.model.layers.3.mlp.shared_experts.up_proj.weight", TP_COLUMN},
        {"language_model.model.layers.3.mlp.shared_experts.down_proj.weight", TP_ROW},
        {"language_model.model.layers.3.mlp.experts.5.gate_proj.weight_packed", TP_COLUMN},
        {"language_model.model.layers.3.mlp.experts.5.up_proj.weight_scale", TP_COLUMN},
        {"language_model.model.layers.3.mlp.experts.5.down_proj.weight_packed", TP_ROW},
        {"language_model.model.layers.3.input_layernorm.weight", TP_REPLICATED},
        {"language_model.lm_head.weight", TP_COLUMN},
        {"model.embed_tokens.weight", TP_COLUMN},
        {"vision_tower.encoder.blocks.0.wqkv.weight", -1},
        {"language_model.model.layers.3.self_attn.rotary_emb.inv_freq", -1},
    };
    for (size_t i = 0; i < sizeof WANT / sizeof WANT[0]; i++) assert_int_equal(dsv3_tensor_parallel(WANT[i].name), WANT[i].style);
}

static void test_mismatched_config_refused(void **st) {
    (void)st;
    const char *src = kc_mini_dir("dsv3");
    char dir[] = "/tmp/kimi_c_badcfg_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char a[1200], b[1200];
    static const char *const FILES[] = {"model.safetensors.index.json", "model-00001-of-00004.safetensors",
                                        "model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors",
                                        "model-00004-of-00004.safetensors"};
    for (int i = 0; i < 5; i++) {
        snprintf(a, sizeof a, "%s/%s", src, FILES[i]);
        snprintf(b, sizeof b, "%s/%s", dir, FILES[i]);
        assert_int_equal(symlink(a, b), 0);
    }
    snprintf(a, sizeof a, "%s/config.json", src);
    json_error_t je;
    json_t *cfg = json_load_file(a, 0, &je);
    assert_non_null(cfg);
    json_object_set_new(cfg, "kv_lora_rank", json_integer(16));
    snprintf(b, sizeof b, "%s/config.json", dir);
    assert_int_equal(json_dump_file(cfg, b, 0), 0);
    json_decref(cfg);
    backend *be = bk_cpu_create(1);
    model_load_opts o = {.block_size = 16, .n_blocks = 4};
    model *m = NULL;
    specd_err err = {{0}};
    assert_int_equal(model_load(dir, be, &o, &m, &err), -1);
    printf("refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "kv_a_proj_with_mqa"));
    bk_cpu_destroy(be);
    for (int i = 0; i < 5; i++) { snprintf(b, sizeof b, "%s/%s", dir, FILES[i]); unlink(b); }
    snprintf(b, sizeof b, "%s/config.json", dir);
    unlink(b);
    rmdir(dir);
}

/* The real Kimi-K2.5 config (tools/kimi/kimi_k25_config.json): parsed, and its YaRN
 * numbers as docs/kimi-k2.5.md gives them from transformers' formulas: ramp bounds
 * low 8 / high 20 over the 32 pairs, softmax scale 192^-0.5 * 1.41589^2 = 0.144680,
 * cos/sin factor 1. */
static void test_real_kimi_config(void **st) {
    (void)st;
    char dir[] = "/tmp/kimi_c_realcfg_XXXXXX", a[1200], b[1200];
    assert_non_null(mkdtemp(dir));
    snprintf(a, sizeof a, "%s/tools/kimi/kimi_k25_config.json", getenv("SPECD_SOURCE_DIR"));
    snprintf(b, sizeof b, "%s/config.json", dir);
    assert_int_equal(symlink(a, b), 0);
    hf_config c;
    specd_err err = {{0}};
    assert_int_equal(hf_config_load(dir, &c, &err), 0);
    unlink(b);
    rmdir(dir);
    assert_true(c.hidden == 7168 && c.n_layers == 61 && c.vocab == 163840 && c.n_heads == 64);
    assert_true(c.n_routed_experts == 384 && c.n_experts_per_tok == 8 && c.n_shared_experts == 1 &&
                c.first_k_dense == 1 && c.moe_intermediate == 2048 && c.intermediate == 18432);
    assert_true(c.q_lora_rank == 1536 && c.kv_lora_rank == 512 && c.qk_nope == 128 && c.qk_rope == 64 && c.v_head == 128);
    assert_true(c.quant.present && c.quant.group_size == 32);
    float inv[32], att, scale;
    dsv3_rope_params(&c, inv, &att, &scale);
    assert_true(fabs(scale - 0.144680) < 5e-7);
    assert_true(att == 1.0f);
    for (int i = 0; i < 32; i++) {
        const float extra = 1.0f / powf(50000.0f, (float)(2 * i) / 64.0f);
        if (i <= 8) assert_true(inv[i] == extra);                      /* ramp 0: extrapolation */
        else if (i >= 20) assert_true(inv[i] == 1.0f / (64.0f * powf(50000.0f, (float)(2 * i) / 64.0f)));
        else assert_true(inv[i] < extra && inv[i] > extra / 64);        /* blended */
    }
    printf("kimi_c_load: real Kimi-K2.5 config: softmax scale %.6f, YaRN ramp 8..20\n", (double)scale);
}

/* A checkpoint that also holds vision-tower tensors (an extra shard listed in the
 * index, as Kimi-K2.5 ships them) loads, ignores them, and computes the same logits. */
static void test_vision_tensors_ignored(void **st) {
    (void)st;
    const char *src = kc_mini_dir("k25");
    char dir[] = "/tmp/kimi_c_vision_XXXXXX", a[1200], b[1200];
    assert_non_null(mkdtemp(dir));
    static const char *const LINKS[] = {"config.json", "model-00001-of-00004.safetensors",
                                        "model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors",
                                        "model-00004-of-00004.safetensors"};
    for (int i = 0; i < 5; i++) {
        snprintf(a, sizeof a, "%s/%s", src, LINKS[i]);
        snprintf(b, sizeof b, "%s/%s", dir, LINKS[i]);
        assert_int_equal(symlink(a, b), 0);
    }
    uint16_t vw[16] = {0};
    const int64_t s44[2] = {4, 4}, s22[2] = {2, 2};
    const st_write_tensor vt[2] = {{"vision_tower.patch_embed.proj.weight", ST_BF16, 2, s44, vw},
                                   {"mm_projector.proj.0.weight", ST_BF16, 2, s22, vw}};
    specd_err err = {{0}};
    snprintf(b, sizeof b, "%s/model-vision.safetensors", dir);
    assert_int_equal(st_write(b, vt, 2, NULL, &err), 0);
    snprintf(a, sizeof a, "%s/model.safetensors.index.json", src);
    json_error_t je;
    json_t *idx = json_load_file(a, 0, &je);
    assert_non_null(idx);
    json_t *wm = json_object_get(idx, "weight_map");
    json_object_set_new(wm, vt[0].name, json_string("model-vision.safetensors"));
    json_object_set_new(wm, vt[1].name, json_string("model-vision.safetensors"));
    snprintf(b, sizeof b, "%s/model.safetensors.index.json", dir);
    assert_int_equal(json_dump_file(idx, b, 0), 0);
    json_decref(idx);
    json_t *fx = kc_fixture("mini_logits.json");
    int n;
    int32_t *ids = kc_ids(json_object_get(json_array_get(json_object_get(fx, "prompts"), 2), "ids"), &n);
    backend *be = bk_cpu_create(0);
    model *m1 = kc_load(be, src, 1), *m2 = kc_load(be, dir, 1);
    const int V = model_get_config(m1)->vocab;
    float *l1 = malloc(sizeof(float) * (size_t)n * V), *l2 = malloc(sizeof(float) * (size_t)n * V);
    assert_int_equal(kc_run(m1, 0, ids, n, 0, l1, NULL, 0, NULL, NULL), 0);
    assert_int_equal(kc_run(m2, 0, ids, n, 0, l2, NULL, 0, NULL, NULL), 0);
    assert_memory_equal(l1, l2, sizeof(float) * (size_t)n * V);
    model_destroy(m1);
    model_destroy(m2);
    bk_cpu_destroy(be);
    free(l1); free(l2); free(ids);
    json_decref(fx);
    for (int i = 0; i < 5; i++) { snprintf(b, sizeof b, "%s/%s", dir, LINKS[i]); unlink(b); }
    snprintf(b, sizeof b, "%s/model-vision.safetensors", dir);
    unlink(b);
    snprintf(b, sizeof b, "%s/model.safetensors.index.json", dir);
    unlink(b);
    rmdir(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_configs),
        cmocka_unit_test(test_config_variants_and_refusals),
        cmocka_unit_test(test_layouts_identical),
        cmocka_unit_test(test_parallel_styles),
        cmocka_unit_test(test_mismatched_config_refused),
        cmocka_unit_test(test_real_kimi_config),
        cmocka_unit_test(test_vision_tensors_ignored),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
