/*
 * bench_tokenizer.c: encode throughput of the GGUF tokenizer on a file (not a
 * test; target tokenizer_bench).
 *   tokenizer_bench MODEL.gguf|tiktoken.model|DIR TEXT_FILE [REPEAT]
 * Prints MB/s and tokens/s for tok_encode (plain text, one call per file),
 * measured in process CPU time (the build machine is shared).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/loader/gguf.h"
#include "engine/tokenizer/tokenizer.h"

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf|tiktoken.model|DIR TEXT_FILE [REPEAT]\n", argv[0]);
        return 2;
    }
    int rep = argc > 3 ? atoi(argv[3]) : 3;
    FILE *f = fopen(argv[2], "rb");
    if (!f) return perror(argv[2]), 1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    if (fread(text, 1, (size_t)n, f) != (size_t)n) return 1;
    fclose(f);
    specd_err err = {0};
    gguf_file *g = NULL;
    tokenizer *t;
    size_t al = strlen(argv[1]);
    int rc;
    if (al > 5 && strcmp(argv[1] + al - 5, ".gguf") == 0)
        rc = gguf_open(argv[1], &g, &err) < 0 ? -1 : tok_create_from_gguf(g, &t, &err);
    else if (al > 6 && strcmp(argv[1] + al - 6, ".model") == 0)
        rc = tok_create_from_tiktoken(argv[1], NULL, &t, &err);
    else
        rc = tok_create_from_dir(argv[1], &t, &err);
    if (rc < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    double best = 1e30;
    size_t nt = 0;
    for (int r = 0; r < rep; r++) {
        struct timespec a, b;
        int32_t *ids;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
        if (tok_encode(t, text, (size_t)n, false, &ids, &nt, &err) < 0) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
        double s = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
        if (s < best) best = s;
        free(ids);
    }
    printf("%s: %.2f MB, %zu tokens, best of %d: %.3f s = %.1f MB/s, %.2f M tokens/s\n", argv[2], n / 1e6, nt, rep,
           best, n / 1e6 / best, nt / 1e6 / best);
    tok_destroy(t);
    gguf_close(g);
    free(text);
    return 0;
}
