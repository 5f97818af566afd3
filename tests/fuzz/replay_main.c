/*
 * replay_main.c: runs a libFuzzer harness's LLVMFuzzerTestOneInput over
 * files and directories without libFuzzer, so the committed seed corpora and
 * every crash input kept in tests/fuzz/regressions/<harness>/ run as plain
 * ctest tests (fuzz_replay_*) in any build, gcc or clang, and under ASan +
 * UBSan in the sanitizer build (tools/ci_sanitize.sh).
 *
 * Usage: fuzz_replay_X PATH...   (a directory: every regular file in it)
 * Calls LLVMFuzzerInitialize first when the harness defines one (weak
 * reference). A harness reports a finding by aborting, so a non-zero exit or
 * a signal fails the test. Each input is read into an exactly-sized heap
 * buffer, so an overread is caught by ASan as it is under libFuzzer.
 * Threading: single-threaded.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return -1;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
    if (!buf || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        fclose(f);
        free(buf);
        return -1;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    return 0;
}

int main(int argc, char **argv) {
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    int n = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) continue; /* an absent regressions folder is fine */
        if (!S_ISDIR(st.st_mode)) {
            if (run_file(argv[i])) return 1;
            n++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        if (!d) return 1;
        struct dirent *e;
        while ((e = readdir(d))) {
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", argv[i], e->d_name);
            if (stat(p, &st) != 0 || !S_ISREG(st.st_mode)) continue;
            if (run_file(p)) {
                closedir(d);
                return 1;
            }
            n++;
        }
        closedir(d);
    }
    printf("replay: %d inputs, no finding\n", n);
    return n > 0 ? 0 : 77;
}
