/* pcre2_split.c: split strings with a PCRE2 pattern, for tools/kimi/prove_pcre2.py.
 *
 * What it owns: nothing in specd links it. It is the independent "what PCRE2 actually does"
 * witness for the rewritten Kimi pre-tokenizer pattern: it compiles the pattern exactly as the
 * C tokenizer should (PCRE2_UTF | PCRE2_UCP, JIT off) and prints every match span.
 *
 * Usage: pcre2_split PATTERN_FILE CORPUS_FILE
 *   PATTERN_FILE: the pattern, one line (a final newline is stripped).
 *   CORPUS_FILE:  records "<decimal byte length>\n<bytes>"; one output line per record:
 *                 "start:end start:end ..." (byte offsets of successive matches, leftmost-first,
 *                 scanning from the end of the previous match; an empty match advances one
 *                 code point). Exit 1 on any error.
 * Threading: single-threaded.
 * Build: cc -O1 -o pcre2_split pcre2_split.c $(pkg-config --cflags --libs libpcre2-8)
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (!b || fread(b, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(b);
        return NULL;
    }
    fclose(f);
    b[n] = 0;
    *len = (size_t)n;
    return b;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s PATTERN_FILE CORPUS_FILE\n", argv[0]);
        return 1;
    }
    size_t plen, clen;
    char *pat = slurp(argv[1], &plen);
    char *cor = slurp(argv[2], &clen);
    if (!pat || !cor) {
        fprintf(stderr, "cannot read inputs\n");
        return 1;
    }
    while (plen && (pat[plen - 1] == '\n' || pat[plen - 1] == '\r'))
        pat[--plen] = 0;
    int err;
    PCRE2_SIZE eoff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, plen, PCRE2_UTF | PCRE2_UCP, &err, &eoff, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        fprintf(stderr, "compile error at %zu: %s\n", (size_t)eoff, msg);
        return 1;
    }
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    size_t pos = 0;
    while (pos < clen) {
        char *nl = memchr(cor + pos, '\n', clen - pos);
        if (!nl)
            break;
        size_t n = strtoul(cor + pos, NULL, 10);
        const char *s = nl + 1;
        size_t off = 0;
        int first = 1;
        while (off < n) {
            int rc = pcre2_match(re, (PCRE2_SPTR)s, n, off, 0, md, NULL);
            if (rc == PCRE2_ERROR_NOMATCH)
                break;
            if (rc < 0) {
                fprintf(stderr, "match error %d\n", rc);
                return 1;
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            printf(first ? "%zu:%zu" : " %zu:%zu", (size_t)ov[0], (size_t)ov[1]);
            first = 0;
            if (ov[1] == ov[0]) {              /* empty match: step one code point */
                off = ov[1] + 1;
                while (off < n && ((unsigned char)s[off] & 0xC0) == 0x80)
                    off++;
            } else {
                off = ov[1];
            }
        }
        printf("\n");
        pos = (size_t)(s - cor) + n;
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    free(pat);
    free(cor);
    return 0;
}
