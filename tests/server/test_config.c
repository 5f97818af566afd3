/*
 * test_config.c: the flag table of `specd serve`: defaults, argv forms
 * (--x v, --x=v, booleans, --no-x), SPECD_* variables and their precedence,
 * bounds and type errors naming the flag and the source, byte sizes, the
 * --speculative-config resolution, and that the introspection JSON never
 * contains the API key.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "server/config.h"

static const char *fake_env[16][2];
static const char *fake_getenv(const char *name) {
    for (int i = 0; i < 16 && fake_env[i][0]; i++)
        if (!strcmp(fake_env[i][0], name)) return fake_env[i][1];
    return NULL;
}

static int parse(specd_config *c, int argc, char **argv, specd_err *err) {
    cfg_table t;
    memset(c, 0, sizeof *c);
    specd_config_table(c, &t);
    const char *pos[2];
    size_t n_pos;
    bool help;
    if (cfg_defaults(&t, 1, err)) return -1;
    if (cfg_apply_env(&t, 1, fake_getenv, err)) return -1;
    return cfg_parse_args(&t, 1, argc, argv, pos, 2, &n_pos, &help, err);
}

static void test_defaults(void **state) {
    (void)state;
    memset(fake_env, 0, sizeof fake_env);
    specd_config c;
    specd_err err = {{0}};
    assert_int_equal(parse(&c, 0, NULL, &err), 0);
    assert_string_equal(c.host, "127.0.0.1");
    assert_int_equal(c.port, 8000);
    assert_null(c.api_key);
    assert_int_equal(c.block_size, 16);
    assert_false(c.enable_prefix_caching);
    assert_int_equal(c.kv_cache_memory, 1024LL * 1024 * 1024);
    assert_int_equal(c.max_body_bytes, 8LL * 1024 * 1024);
    assert_string_equal(c.device, "auto");
    assert_true(c.gpu_memory_utilization == 0.9);
    assert_int_equal(c.num_speculative_tokens, -1);
    specd_config_free(&c);
}

static void test_argv_forms(void **state) {
    (void)state;
    memset(fake_env, 0, sizeof fake_env);
    char *argv[] = {"--port", "9001", "--host=0.0.0.0", "--enable-prefix-caching", "--kv-cache-memory", "512M",
                    "--shutdown-timeout=2.5", "--device", "cuda", "--max-model-len=4096"};
    specd_config c;
    specd_err err = {{0}};
    assert_int_equal(parse(&c, 10, argv, &err), 0);
    assert_int_equal(c.port, 9001);
    assert_string_equal(c.host, "0.0.0.0");
    assert_true(c.enable_prefix_caching);
    assert_int_equal(c.kv_cache_memory, 512LL * 1024 * 1024);
    assert_true(c.shutdown_timeout == 2.5);
    assert_string_equal(c.device, "cuda");
    assert_int_equal(c.max_model_len, 4096);
    specd_config_free(&c);

    char *argv2[] = {"--enable-prefix-caching", "--no-enable-prefix-caching"};
    assert_int_equal(parse(&c, 2, argv2, &err), 0);
    assert_false(c.enable_prefix_caching);
    specd_config_free(&c);
    char *argv3[] = {"--enable-prefix-caching=yes"};
    assert_int_equal(parse(&c, 1, argv3, &err), 0);
    assert_true(c.enable_prefix_caching);
    specd_config_free(&c);
}

static void test_errors(void **state) {
    (void)state;
    memset(fake_env, 0, sizeof fake_env);
    specd_config c;
    specd_err err = {{0}};
    char *a1[] = {"--port", "70000"};
    assert_int_equal(parse(&c, 2, a1, &err), -1);
    assert_non_null(strstr(err.msg, "--port 70000: above the maximum 65535"));
    specd_config_free(&c);
    char *a2[] = {"--port", "12ab"};
    assert_int_equal(parse(&c, 2, a2, &err), -1);
    assert_non_null(strstr(err.msg, "not an integer"));
    specd_config_free(&c);
    char *a3[] = {"--no-such-flag"};
    assert_int_equal(parse(&c, 1, a3, &err), -1);
    assert_non_null(strstr(err.msg, "unknown option '--no-such-flag'"));
    specd_config_free(&c);
    char *a4[] = {"--device", "tpu"};
    assert_int_equal(parse(&c, 2, a4, &err), -1);
    assert_non_null(strstr(err.msg, "must be one of auto|cpu|cuda"));
    specd_config_free(&c);
    char *a5[] = {"--kv-cache-memory", "lots"};
    assert_int_equal(parse(&c, 2, a5, &err), -1);
    assert_non_null(strstr(err.msg, "not a byte size"));
    specd_config_free(&c);
    char *a6[] = {"--port"};
    assert_int_equal(parse(&c, 1, a6, &err), -1);
    assert_non_null(strstr(err.msg, "--port needs a value"));
    specd_config_free(&c);
    char *a7[] = {"--block-size", "0"};
    assert_int_equal(parse(&c, 2, a7, &err), -1);
    assert_non_null(strstr(err.msg, "below the minimum 1"));
    specd_config_free(&c);
    /* the API key never appears in an error message */
    char *a8[] = {"--api-key"};
    assert_int_equal(parse(&c, 1, a8, &err), -1);
    specd_config_free(&c);
}

static void test_env_precedence(void **state) {
    (void)state;
    memset(fake_env, 0, sizeof fake_env);
    fake_env[0][0] = "SPECD_PORT", fake_env[0][1] = "7000";
    fake_env[1][0] = "SPECD_ENABLE_PREFIX_CACHING", fake_env[1][1] = "on";
    fake_env[2][0] = "SPECD_MAX_NUM_SEQS", fake_env[2][1] = "7";
    fake_env[3][0] = "SPECD_API_KEY", fake_env[3][1] = "sk-env";
    specd_config c;
    specd_err err = {{0}};
    char *argv[] = {"--port", "7100"};
    assert_int_equal(parse(&c, 2, argv, &err), 0);
    assert_int_equal(c.port, 7100);        /* argv beats env */
    assert_int_equal(c.max_num_seqs, 7);   /* env beats default */
    assert_true(c.enable_prefix_caching);
    assert_string_equal(c.api_key, "sk-env");
    specd_config_free(&c);

    fake_env[0][1] = "abc";
    assert_int_equal(parse(&c, 0, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "SPECD_PORT=abc: --port is not an integer"));
    specd_config_free(&c);
    /* --check-config is per invocation: no env var */
    memset(fake_env, 0, sizeof fake_env);
    fake_env[0][0] = "SPECD_CHECK_CONFIG", fake_env[0][1] = "1";
    assert_int_equal(parse(&c, 0, NULL, &err), 0);
    assert_false(c.check_config);
    specd_config_free(&c);
}

static void test_env_name_and_bytes(void **state) {
    (void)state;
    char buf[64];
    cfg_env_name("max-num-batched-tokens", buf, sizeof buf);
    assert_string_equal(buf, "SPECD_MAX_NUM_BATCHED_TOKENS");
    int64_t b;
    assert_int_equal(cfg_parse_bytes("1024", &b), 0);
    assert_int_equal(b, 1024);
    assert_int_equal(cfg_parse_bytes("4K", &b), 0);
    assert_int_equal(b, 4096);
    assert_int_equal(cfg_parse_bytes("1.5G", &b), 0);
    assert_int_equal(b, 1610612736LL);
    assert_int_equal(cfg_parse_bytes("2GiB", &b), 0);
    assert_int_equal(b, 2147483648LL);
    assert_int_equal(cfg_parse_bytes("3mb", &b), 0);
    assert_int_equal(b, 3145728);
    assert_int_equal(cfg_parse_bytes("-1", &b), -1);
    assert_int_equal(cfg_parse_bytes("12X", &b), -1);
    assert_int_equal(cfg_parse_bytes("", &b), -1);
}

static void test_json_redacts_key(void **state) {
    (void)state;
    memset(fake_env, 0, sizeof fake_env);
    specd_config c;
    specd_err err = {{0}};
    char *argv[] = {"--api-key", "sk-very-secret", "--port", "8123"};
    assert_int_equal(parse(&c, 4, argv, &err), 0);
    cfg_table t;
    specd_config_table(&c, &t);
    char *j = cfg_to_json(&t, 1);
    assert_non_null(j);
    assert_null(strstr(j, "sk-very-secret"));
    assert_non_null(strstr(j, "\"api_key_set\":true"));
    assert_non_null(strstr(j, "\"port\":8123"));
    assert_non_null(strstr(j, "\"max_model_len\":0"));
    free(j);
    specd_config_free(&c);
}

/* --cuda-graph-sizes: parsed the same on every device (specd_config_resolve refuses a bad value even with
 * --device cpu, where no graph is captured); the default buckets follow --max-num-seqs. */
static void test_graph_sizes(void **state) {
    (void)state;
    memset(fake_env, 0, sizeof fake_env);
    specd_config c;
    specd_err err = {{0}};
    specd_spec s;
    int32_t b[32];
    char *ok[] = {"--device", "cpu", "--max-num-seqs", "16", "--cuda-graph-sizes", "1,3,16"};
    assert_int_equal(parse(&c, 6, ok, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), 0);
    assert_int_equal(specd_config_graph_sizes(&c, b, 32, &err), 3);
    assert_int_equal(b[0], 1);
    assert_int_equal(b[1], 3);
    assert_int_equal(b[2], 16);
    specd_spec_free(&s);
    specd_config_free(&c);
    char *def[] = {"--max-num-seqs", "24"};
    assert_int_equal(parse(&c, 2, def, &err), 0);
    const int32_t want[] = {1, 2, 4, 8, 16, 24};
    assert_int_equal(specd_config_graph_sizes(&c, b, 32, &err), 6);
    for (int i = 0; i < 6; i++) assert_int_equal(b[i], want[i]);
    specd_config_free(&c);
    static const char *bad[][2] = {{"1,2,", "comma-separated integers"}, {"1,,2", "comma-separated integers"},
                                   {"a", "comma-separated integers"},    {"2,1", "ascending"},
                                   {"1,2,4,17", "[1, --max-num-seqs 16]"}, {"0", "ascending"},
                                   {"-1", "comma-separated integers"},  {"1 2", "comma-separated integers"},
                                   {"", "comma-separated integers"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *a[] = {"--device", "cpu", "--max-num-seqs", "16", "--cuda-graph-sizes", (char *)bad[i][0]};
        assert_int_equal(parse(&c, 6, a, &err), 0);
        if (specd_config_resolve(&c, &s, &err) != -1) fail_msg("--cuda-graph-sizes '%s' accepted", bad[i][0]);
        if (!strstr(err.msg, bad[i][1])) fail_msg("--cuda-graph-sizes '%s': %s", bad[i][0], err.msg);
        specd_config_free(&c);
    }
    /* with --enforce-eager no graph is captured: a bucket list is a contradiction, refused with the reason */
    char *eager[] = {"--max-num-seqs", "16", "--cuda-graph-sizes", "1,2", "--enforce-eager"};
    assert_int_equal(parse(&c, 5, eager, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), -1);
    assert_non_null(strstr(err.msg, "--cuda-graph-sizes 1,2 and --enforce-eager contradict"));
    specd_config_free(&c);
    /* device collectives with --device cpu: refused at resolve (so --check-config agrees with serve); shm and
     * auto pass, and so does cuda_ipc with --device auto (decided when the backend is chosen) */
    static const char *tpc[][3] = {{"cpu", "cuda_ipc", "-"}, {"cpu", "nccl", "-"}, {"cpu", "shm", "+"},
                                   {"cpu", "auto", "+"},     {"auto", "cuda_ipc", "+"}, {"cuda", "nccl", "+"}};
    for (size_t i = 0; i < sizeof tpc / sizeof tpc[0]; i++) {
        char *a[] = {"--device", (char *)tpc[i][0], "--tensor-parallel-size", "2", "--tp-comm", (char *)tpc[i][1]};
        assert_int_equal(parse(&c, 6, a, &err), 0);
        const int rc = specd_config_resolve(&c, &s, &err);
        if (tpc[i][2][0] == '+') {
            if (rc != 0) fail_msg("--device %s --tp-comm %s refused: %s", tpc[i][0], tpc[i][1], err.msg);
            specd_spec_free(&s);
        } else if (rc != -1 || !strstr(err.msg, "needs a GPU backend") || !strstr(err.msg, tpc[i][1])) {
            fail_msg("--device %s --tp-comm %s: rc %d (%s)", tpc[i][0], tpc[i][1], rc, rc ? err.msg : "accepted");
        }
        specd_config_free(&c);
    }
    char *eager_only[] = {"--max-num-seqs", "16", "--enforce-eager"};
    assert_int_equal(parse(&c, 3, eager_only, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), 0);
    specd_spec_free(&s);
    specd_config_free(&c);
}

static void test_spec_resolution(void **state) {
    (void)state;
    memset(fake_env, 0, sizeof fake_env);
    specd_config c;
    specd_err err = {{0}};
    specd_spec s;
    char *a1[] = {"--speculative-config", "{\"method\":\"eagle3\",\"model\":\"/d\",\"num_speculative_tokens\":4}"};
    assert_int_equal(parse(&c, 2, a1, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), 0);
    assert_true(s.enabled);
    assert_string_equal(s.method, "eagle3");
    assert_string_equal(s.model, "/d");
    assert_int_equal(s.k, 4);
    assert_true(s.adaptive); /* adaptive speculation by default */
    specd_spec_free(&s);
    specd_config_free(&c);

    char *a2[] = {"--draft", "/d"};
    assert_int_equal(parse(&c, 2, a2, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), 0);
    assert_int_equal(s.k, 3);
    assert_true(s.adaptive);
    specd_spec_free(&s);
    specd_config_free(&c);

    /* fixed k: the JSON key or the flag */
    char *a2b[] = {"--speculative-config", "{\"model\":\"/d\",\"adaptive\":false}"};
    assert_int_equal(parse(&c, 2, a2b, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), 0);
    assert_false(s.adaptive);
    specd_spec_free(&s);
    specd_config_free(&c);
    char *a2c[] = {"--draft", "/d", "--no-speculative-adaptive"};
    assert_int_equal(parse(&c, 3, a2c, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), 0);
    assert_false(s.adaptive);
    specd_spec_free(&s);
    specd_config_free(&c);
    char *a2d[] = {"--speculative-config", "{\"model\":\"/d\",\"adaptive\":1}"};
    assert_int_equal(parse(&c, 2, a2d, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), -1);
    assert_non_null(strstr(err.msg, "adaptive must be true or false"));
    specd_config_free(&c);

    char *a3[] = {"--speculative-config", "{\"model\":\"/d\",\"num_speculative_tokens\":4}", "--num-speculative-tokens",
                  "2"};
    assert_int_equal(parse(&c, 4, a3, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), -1);
    assert_non_null(strstr(err.msg, "disagrees"));
    specd_config_free(&c);

    char *a4[] = {"--speculative-config", "{\"method\":\"medusa\",\"model\":\"/d\"}"};
    assert_int_equal(parse(&c, 2, a4, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), -1);
    assert_non_null(strstr(err.msg, "method"));
    specd_config_free(&c);

    char *a5[] = {"--speculative-config", "[1]"};
    assert_int_equal(parse(&c, 2, a5, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), -1);
    specd_config_free(&c);

    char *a6[] = {"--num-speculative-tokens", "3"};
    assert_int_equal(parse(&c, 2, a6, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), -1);
    assert_non_null(strstr(err.msg, "needs a draft"));
    specd_config_free(&c);

    char *a7[] = {"--api-key", "x", "--api-key-file", "/f"};
    assert_int_equal(parse(&c, 4, a7, &err), 0);
    assert_int_equal(specd_config_resolve(&c, &s, &err), -1);
    assert_non_null(strstr(err.msg, "exclusive"));
    specd_config_free(&c);
}

static void test_engine_subset(void **state) {
    (void)state;
    /* `specd generate` sees only CFG_ENGINE rows of the table */
    specd_config c;
    memset(&c, 0, sizeof c);
    cfg_table t;
    specd_config_table(&c, &t);
    t.require = CFG_ENGINE;
    specd_err err = {{0}};
    assert_int_equal(cfg_defaults(&t, 1, &err), 0);
    const char *pos[1];
    size_t n;
    bool help;
    char *ok[] = {"--max-model-len", "64", "--threads", "2"};
    assert_int_equal(cfg_parse_args(&t, 1, 4, ok, pos, 1, &n, &help, &err), 0);
    assert_int_equal(c.max_model_len, 64);
    char *bad[] = {"--port", "1"};
    assert_int_equal(cfg_parse_args(&t, 1, 2, bad, pos, 1, &n, &help, &err), -1);
    specd_config_free(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),        cmocka_unit_test(test_argv_forms),
        cmocka_unit_test(test_errors),          cmocka_unit_test(test_env_precedence),
        cmocka_unit_test(test_env_name_and_bytes), cmocka_unit_test(test_json_redacts_key),
        cmocka_unit_test(test_spec_resolution), cmocka_unit_test(test_graph_sizes), cmocka_unit_test(test_engine_subset),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
