/*
 * test_vocab_npy_data.c: the .npy header parser on valid and hostile input
 * (it is untrusted: every refusal below must be an error, never a read past
 * the buffer), and the JSONL data reader: all record shapes, malformed lines
 * reported with their line numbers while the rest is processed, responses
 * matched by question_id.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vocab/npy.h"
#include "vocab/vocab_data.h"

/* A .npy image: preamble (version 1.0) + DICT padded to 64 + DATA. */
static size_t make_npy(unsigned char *buf, const char *dict, const void *data, size_t n) {
    size_t dl = strlen(dict), hl = (10 + dl + 1 + 63) / 64 * 64 - 10;
    memcpy(buf, "\x93NUMPY\x01\x00", 8);
    buf[8] = (unsigned char)(hl & 0xff);
    buf[9] = (unsigned char)(hl >> 8);
    memcpy(buf + 10, dict, dl);
    memset(buf + 10 + dl, ' ', hl - dl - 1);
    buf[10 + hl - 1] = '\n';
    memcpy(buf + 10 + hl, data, n);
    return 10 + hl + n;
}

static void expect_bad(const unsigned char *b, size_t n, const char *needle) {
    npy_array a;
    specd_err err = {0};
    assert_int_equal(npy_parse_mem(b, n, &a, &err), -1);
    if (!strstr(err.msg, needle)) fail_msg("expected \"%s\" in \"%s\"", needle, err.msg);
    assert_null(a.data);
}

static void test_npy_parse(void **s) {
    (void)s;
    unsigned char b[512];
    const int64_t v[3] = {7, -1, 1LL << 40};
    /* numpy's own spelling, and variants Python's literal syntax allows */
    const char *ok[] = {"{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }",
                        "{\"descr\":\"<i8\",\"fortran_order\":False,\"shape\":(3,)}",
                        "{'shape': (3, ), 'fortran_order': True, 'descr': '=i8'}",
                        "{'descr': '<i8', 'fortran_order': False, 'shape': (3L,), }"};
    for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) {
        size_t n = make_npy(b, ok[k], v, sizeof v);
        npy_array a;
        specd_err err = {0};
        assert_int_equal(npy_parse_mem(b, n, &a, &err), 0);
        assert_int_equal(a.ndim, 1);
        assert_int_equal(a.shape[0], 3);
        assert_int_equal(a.itemsize, 8);
        assert_memory_equal(a.data, v, sizeof v);
        npy_array_free(&a);
    }
    /* 2-D and scalar shapes parse (the vector readers refuse them later) */
    size_t n = make_npy(b, "{'descr': '<i8', 'fortran_order': False, 'shape': (1, 3), }", v, sizeof v);
    npy_array a;
    specd_err err = {0};
    assert_int_equal(npy_parse_mem(b, n, &a, &err), 0);
    assert_int_equal(a.ndim, 2);
    npy_array_free(&a);
    n = make_npy(b, "{'descr': '<i8', 'fortran_order': False, 'shape': (), }", v, 8);
    assert_int_equal(npy_parse_mem(b, n, &a, &err), 0);
    assert_int_equal(a.ndim, 0);
    assert_int_equal(a.n_elements, 1);
    npy_array_free(&a);

    /* refusals */
    expect_bad((const unsigned char *)"\x93NUMPZ\x01\x00\x00\x00", 10, "bad magic");
    expect_bad((const unsigned char *)"\x93NUMPY", 6, "bad magic");
    n = make_npy(b, "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }", v, sizeof v);
    expect_bad(b, n - 1, "needs 24 bytes of data, the file has 23");          /* short data */
    b[n] = 0;
    expect_bad(b, n + 1, "needs 24 bytes of data, the file has 25");          /* trailing byte */
    unsigned char h[16];
    memcpy(h, b, 16);
    b[8] = 0xff, b[9] = 0xff;                                                   /* header longer than the file */
    expect_bad(b, n, "exceeds the file");
    memcpy(b, h, 16);
    b[6] = 4;
    expect_bad(b, n, "unsupported format version 4");
    struct {
        const char *dict, *msg;
    } bad[] = {
        {"{'descr': '>i8', 'fortran_order': False, 'shape': (3,), }", "unsupported dtype '>i8'"},
        {"{'descr': '<c16', 'fortran_order': False, 'shape': (3,), }", "unsupported dtype"},
        {"{'descr': '|i8', 'fortran_order': False, 'shape': (3,), }", "unsupported dtype"},
        {"{'descr': '<i8', 'fortran_order': Maybe, 'shape': (3,), }", "True or False"},
        {"{'descr': '<i8', 'fortran_order': False, 'shape': (-3,), }", "'shape'"},
        {"{'descr': '<i8', 'fortran_order': False, 'shape': [3], }", "'shape'"},
        {"{'descr': '<i8', 'fortran_order': False, 'shape': (3,3,3,3,3,3,3,3,3), }", "'shape'"},
        {"{'descr': '<i8', 'fortran_order': False, 'shape': (99999999999999999999,), }", "'shape'"},
        {"{'descr': '<i8', 'fortran_order': False, 'shape': (1099511627776, 1099511627776), }", "overflows"},
        {"{'descr': '<i8', 'fortran_order': False, }", "missing key (shape)"},
        {"{'descr': '<i8', 'descr': '<i8', 'fortran_order': False, 'shape': (3,), }", "repeated 'descr'"},
        {"{'descr': '<i8', 'fortran_order': False, 'shape': (3,), 'extra': 1}", "unexpected key 'extra'"},
        {"{'descr': '<i\\8', 'fortran_order': False, 'shape': (3,), }", "'descr'"},
        {"{'descr': '<i8', 'fortran_order': False, 'shape': (3,) ", "expected ',' or '}'"},
        {"{'descr': '<i8', 'fortran_order': False, 'shape': (3,)} x", "unexpected bytes after"},
        {"['descr']", "expected a '{'"},
        {"{'descr: '<i8'}", "malformed"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        n = make_npy(b, bad[k].dict, v, sizeof v);
        expect_bad(b, n, bad[k].msg);
    }
    /* a header cut inside a string literal: the cursor stops at the header's end */
    n = make_npy(b, "{'descr': '<i8", v, 0);
    b[10 + strlen("{'descr': '<i8")] = 'x'; /* no closing quote anywhere before the pad */
    expect_bad(b, n, "'descr'");
}

static char tmpfile_path[64];

static const char *write_tmp(const char *text) {
    snprintf(tmpfile_path, sizeof tmpfile_path, "/tmp/specd_vocab_data_XXXXXX");
    int fd = mkstemp(tmpfile_path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs(text, f);
    fclose(f);
    return tmpfile_path;
}

static void test_data_shapes_and_malformed(void **s) {
    (void)s;
    const char *text =
        "{\"question\": \"Q1\", \"answer\": \"A1\"}\n"                                           /* 1 ok */
        "{\"question\": \"Q2\", \"answer\": \n"                                                 /* 2 bad JSON */
        "\n"                                                                                   /* 3 blank */
        "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"U\"},"
        " {\"role\": \"assistant\", \"content\": \"A\"}], \"category\": \"math\"}\n"           /* 4 ok */
        "{\"messages\": [{\"role\": \"user\", \"content\": null}]}\n"                           /* 5 bad content */
        "[1, 2]\n"                                                                             /* 6 not an object */
        "{\"prompt\": \"P\", \"response\": \"R\", \"category\": \"writing\"}\n"                 /* 7 ok */
        "{\"text\": \"no chat here\"}\n"                                                       /* 8 no field */
        "{\"conversations\": [{\"from\": \"human\", \"value\": \"H\"}, {\"from\": \"gpt\", \"value\": \"G\"}]}\n" /* 9 */
        "{\"turns\": [\"T1\", \"T2\"], \"question_id\": 81, \"category\": \"math\"}\n"        /* 10 ok, no answers */
        "{\"messages\": [{\"role\": \"assistant\", \"content\": \"only\"}]}\n"                  /* 11 no user */
        "{\"question\": \"Q3\", \"answer\": \"A3\"}";                                          /* 12 ok, no newline */
    const char *p = write_tmp(text);
    vocab_dataset ds = {0};
    specd_err err = {0};
    assert_int_equal(vocab_data_load(&ds, p, 0, &err), 0);
    assert_int_equal(ds.n_rec, 6);
    assert_int_equal(ds.n_malformed, 5);
    assert_int_equal(ds.n_lines, 11);
    const int bad_lines[5] = {2, 5, 6, 8, 11};
    for (int k = 0; k < 5; k++) {
        char want[96];
        snprintf(want, sizeof want, "%s:%d: ", p, bad_lines[k]);
        assert_true(k < (int)ds.n_problems);
        if (strncmp(ds.problems[k], want, strlen(want))) fail_msg("problem %d: %s", k, ds.problems[k]);
    }
    assert_non_null(strstr(ds.problems[0], "invalid JSON"));
    assert_non_null(strstr(ds.problems[1], "message 0: \"content\" is not a string"));
    assert_non_null(strstr(ds.problems[2], "not a JSON object"));
    assert_non_null(strstr(ds.problems[3], "no \"messages\""));
    assert_non_null(strstr(ds.problems[4], "no user message"));
    const int64_t lines[6] = {1, 4, 7, 9, 10, 12};
    for (int k = 0; k < 6; k++) assert_int_equal(ds.rec[k].line, lines[k]);
    /* gsm8k: user + assistant */
    assert_int_equal(ds.rec[0].n_msgs, 2);
    assert_string_equal(ds.rec[0].msgs[0].role, "user");
    assert_string_equal(ds.rec[0].msgs[1].content, "A1");
    assert_int_equal(ds.rec[0].n_assistant, 1);
    /* messages with a system prompt and a category */
    assert_int_equal(ds.rec[1].n_msgs, 3);
    assert_string_equal(ds.rec[1].system, "S");
    assert_int_equal(ds.rec[1].n_turns, 1);
    assert_string_equal(ds.categories[ds.rec[1].category], "math");
    assert_string_equal(ds.categories[ds.rec[2].category], "writing");
    assert_string_equal(ds.rec[3].msgs[1].role, "assistant"); /* ShareGPT gpt -> assistant */
    /* turns only: prompts, no assistant */
    assert_int_equal(ds.rec[4].n_assistant, 0);
    assert_int_equal(ds.rec[4].n_turns, 2);
    assert_int_equal(ds.rec[4].question_id, 81);
    assert_int_equal(ds.rec[4].category, ds.rec[1].category);
    assert_int_equal(ds.n_categories, 2);
    remove(p);

    /* responses matched by question_id (FastChat answer format) */
    p = write_tmp("{\"question_id\": 81, \"model_id\": \"m\", \"choices\": [{\"index\": 0, \"turns\": [\"R1\", \"R2\"]}]}\n"
                  "{\"question_id\": 99, \"turns\": [\"x\"]}\n"
                  "{\"no\": 1}\n");
    int64_t bad_before = ds.n_malformed;
    assert_int_equal(vocab_data_add_responses(&ds, p, &err), 0);
    assert_int_equal(ds.n_responses_matched, 1);
    assert_int_equal(ds.n_responses_unmatched, 1);
    assert_int_equal(ds.n_malformed, bad_before + 1);
    const vocab_record *r = &ds.rec[4];
    assert_int_equal(r->n_msgs, 4);
    assert_int_equal(r->n_assistant, 2);
    const char *want[4][2] = {{"user", "T1"}, {"assistant", "R1"}, {"user", "T2"}, {"assistant", "R2"}};
    for (int k = 0; k < 4; k++) {
        assert_string_equal(r->msgs[k].role, want[k][0]);
        assert_string_equal(r->msgs[k].content, want[k][1]);
    }
    assert_int_equal(r->line, 10);
    remove(p);
    vocab_dataset_free(&ds);

    /* max_records stops reading */
    p = write_tmp("{\"question\": \"a\", \"answer\": \"b\"}\n{\"question\": \"c\", \"answer\": \"d\"}\n"
                  "{\"question\": \"e\", \"answer\": \"f\"}\n");
    assert_int_equal(vocab_data_load(&ds, p, 2, &err), 0);
    assert_int_equal(ds.n_rec, 2);
    vocab_dataset_free(&ds);
    remove(p);
    assert_int_equal(vocab_data_load(&ds, "/nonexistent/x.jsonl", 0, &err), -1);
    assert_non_null(strstr(err.msg, "/nonexistent/x.jsonl"));
    vocab_dataset_free(&ds);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_npy_parse),
        cmocka_unit_test(test_data_shapes_and_malformed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
