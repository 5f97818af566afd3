/*
 * test_bench_dataset.c: prompt extraction per dataset format (shapes of
 * ../shared/data/prompts: MT-bench turns[0], GSM8K question, HumanEval
 * prompt), plain and .gz reading including a 200 KB line, corrupt .gz,
 * wrap-around when --num-prompts exceeds the file, and the random workload's
 * determinism and lengths (uniform in [len(1-r), len(1+r)]).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/dataset.h"

static void test_parse_line(void **state) {
    (void)state;
    int ol;
    char *t = bench_dataset_parse_line(
        "mt-bench", "{\"question_id\": 81, \"category\": \"writing\", \"turns\": [\"First turn\", \"Second\"]}", &ol, NULL);
    assert_string_equal(t, "First turn");
    assert_int_equal(ol, -1);
    free(t);
    t = bench_dataset_parse_line("gsm8k", "{\"question\": \"How many?\", \"answer\": \"#### 4\"}", &ol, NULL);
    assert_string_equal(t, "How many?");
    free(t);
    t = bench_dataset_parse_line("humaneval", "{\"task_id\": \"x\", \"prompt\": \"def f():\\n\"}", &ol, NULL);
    assert_string_equal(t, "def f():\n");
    free(t);
    t = bench_dataset_parse_line("jsonl", "{\"text\": \"hi\", \"output_len\": 17}", &ol, NULL);
    assert_string_equal(t, "hi");
    assert_int_equal(ol, 17);
    free(t);
    specd_err err = {{0}};
    assert_null(bench_dataset_parse_line("gsm8k", "{\"prompt\": \"wrong field\"}", &ol, &err));
    assert_non_null(strstr(err.msg, "no prompt field"));
    assert_null(bench_dataset_parse_line("jsonl", "[1,2]", &ol, &err));
}

static void check_file(const char *path, const char *long_prompt) {
    bench_dataset_cfg cfg = {.name = "humaneval", .path = path, .num_prompts = 7};
    bench_dataset *d = NULL;
    specd_err err = {{0}};
    if (bench_dataset_load(&cfg, &d, &err)) fprintf(stderr, "%s\n", err.msg);
    assert_non_null(d);
    assert_int_equal(d->n, 7);
    assert_string_equal(d->p[0].text, "one");
    assert_string_equal(d->p[1].text, long_prompt);
    assert_string_equal(d->p[2].text, "three");
    assert_string_equal(d->p[3].text, "one"); /* wrapped */
    assert_string_equal(d->p[6].text, "one");
    bench_dataset_destroy(d);
}

static void test_plain_gzip_and_wrap(void **state) {
    (void)state;
    char path[] = "/tmp/bench_ds_XXXXXX.jsonl";
    int fd = mkstemps(path, 6);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    size_t big = 200000; /* longer than any fixed read buffer */
    char *long_prompt = malloc(big + 1);
    memset(long_prompt, 'a', big);
    long_prompt[big] = '\0';
    fprintf(f, "{\"prompt\": \"one\"}\n\n{\"prompt\": \"%s\"}\r\n{\"prompt\": \"three\"}", long_prompt);
    fclose(f); /* the last line has no newline */
    check_file(path, long_prompt);
    char gz[64], cmd[200];
    snprintf(gz, sizeof gz, "%s.gz", path);
    snprintf(cmd, sizeof cmd, "gzip -c '%s' > '%s'", path, gz);
    if (system(cmd) == 0) {
        check_file(gz, long_prompt);
        /* a corrupt .gz is an error, not a short dataset */
        FILE *g = fopen(gz, "r+b");
        fseek(g, 20, SEEK_SET);
        fwrite("garbagegarbage", 1, 14, g);
        fclose(g);
        bench_dataset_cfg cfg = {.name = "humaneval", .path = gz, .num_prompts = 2};
        bench_dataset *d = NULL;
        assert_int_equal(bench_dataset_load(&cfg, &d, NULL), -1);
        unlink(gz);
    } else {
        fprintf(stderr, "gzip not available: .gz reading not tested\n");
    }
    free(long_prompt);
    unlink(path);
    bench_dataset_cfg cfg = {.name = "humaneval", .path = "/nonexistent/file.jsonl", .num_prompts = 1};
    bench_dataset *d = NULL;
    specd_err err = {{0}};
    assert_int_equal(bench_dataset_load(&cfg, &d, &err), -1);
    cfg.name = "sharegpt";
    assert_int_equal(bench_dataset_load(&cfg, &d, &err), -1);
    assert_non_null(strstr(err.msg, "unknown"));
}

static size_t count_words(const char *s) {
    size_t n = *s ? 1 : 0;
    for (; *s; s++) n += *s == ' ';
    return n;
}

static void test_random(void **state) {
    (void)state;
    bench_dataset_cfg cfg = {.name = "random", .num_prompts = 200, .seed = 5, .random_input_len = 100,
                             .random_output_len = 40, .random_range_ratio = 0.25};
    bench_dataset *a = NULL, *b = NULL, *c = NULL;
    assert_int_equal(bench_dataset_load(&cfg, &a, NULL), 0);
    assert_int_equal(bench_dataset_load(&cfg, &b, NULL), 0);
    cfg.seed = 6;
    assert_int_equal(bench_dataset_load(&cfg, &c, NULL), 0);
    int min_in = 1000, max_in = 0, min_out = 1000, max_out = 0, differs = 0;
    for (size_t i = 0; i < a->n; i++) {
        assert_string_equal(a->p[i].text, b->p[i].text);
        assert_int_equal(a->p[i].output_len, b->p[i].output_len);
        differs |= strcmp(a->p[i].text, c->p[i].text) != 0;
        int w = (int)count_words(a->p[i].text);
        assert_int_equal(w, a->p[i].input_words);
        if (w < min_in) min_in = w;
        if (w > max_in) max_in = w;
        if (a->p[i].output_len < min_out) min_out = a->p[i].output_len;
        if (a->p[i].output_len > max_out) max_out = a->p[i].output_len;
    }
    assert_true(differs);
    /* [75, 125] and [30, 50]; with 200 draws both ends are reached or nearly */
    assert_true(min_in >= 75 && max_in <= 125 && min_in <= 78 && max_in >= 122);
    assert_true(min_out >= 30 && max_out <= 50 && min_out <= 31 && max_out >= 49);
    bench_dataset_destroy(a);
    bench_dataset_destroy(b);
    bench_dataset_destroy(c);
    cfg.random_range_ratio = 1.0;
    assert_int_equal(bench_dataset_load(&cfg, &a, NULL), -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_line),
        cmocka_unit_test(test_plain_gzip_and_wrap),
        cmocka_unit_test(test_random),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
