/*
 * fuzz_tok_tiktoken.c: libFuzzer harness for tok_create_from_tiktoken, the
 * reader of a tiktoken ranks file ("base64 rank" lines; Kimi K2/K2.5's
 * tiktoken.model) and the optional tokenizer_config.json beside it
 * (untrusted: downloaded with the weights).
 *
 * Input: tiktoken.model [NUL tokenizer_config.json] (fuzz_tok_common.h),
 * written to a scratch folder; the config path is passed only when the part
 * is present. A refusal must carry a message; a tokenizer that loads must
 * pass the checks of fuzz_tok_common.h, and its vocabulary must be the
 * highest rank + 1 plus the 256 reserved specials.
 * Seeds: tests/fuzz/corpus_tok_tiktoken (tools/gen_fuzz_tok_seeds.py: ranks
 * files written by the `tiktoken` package's own dump_tiktoken_bpe).
 * Threading: single-threaded.
 */
#include "tests/fuzz/fuzz_tok_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[3];
    size_t len[3];
    fz_split(data, size, part, len);
    char pr[128], pc[128];
    fz_put("tiktoken.model", part[0], len[0], pr, sizeof pr);
    fz_put("tokenizer_config.json", part[1], len[1], pc, sizeof pc);
    tokenizer *t = NULL;
    specd_err err = {{0}};
    if (tok_create_from_tiktoken(pr, part[1] ? pc : NULL, &t, &err) < 0) {
        if (t || !err.msg[0]) abort();
        return 0;
    }
    /* vocabulary = ranks (highest + 1, at least 256) + 256 specials, all specials special */
    int32_t nv = tok_vocab_size(t);
    if (nv < 512) abort();
    for (int32_t id = nv - 256; id < nv; id++)
        if (!tok_is_special(t, id)) abort();
    fz_check_tokenizer(t, data, size);
    return 0;
}
