/*
 * fuzz_tok_hf.c: libFuzzer harness for tok_create_from_hf, the reader of a
 * Hugging Face tokenizer.json and the tokenizer_config.json /
 * chat_template.jinja beside it (untrusted: downloaded with the weights).
 *
 * Input: tokenizer.json [NUL tokenizer_config.json [NUL chat_template.jinja]]
 * (fuzz_tok_common.h), written to a scratch folder, then loaded. A refusal
 * must carry a message; a tokenizer that loads must pass the checks of
 * fuzz_tok_common.h (ids inside the vocabulary, decode(encode(x)) = x minus
 * token-less bytes, well-formed streamed UTF-8, chat render or a message).
 * Seeds: tests/fuzz/corpus_tok_hf (tools/gen_fuzz_tok_seeds.py: tokenizers
 * written by the HF `tokenizers` package).
 * Threading: single-threaded.
 */
#include "tests/fuzz/fuzz_tok_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[3];
    size_t len[3];
    fz_split(data, size, part, len);
    char pj[128], pc[128], pt[128];
    fz_put("tokenizer.json", part[0], len[0], pj, sizeof pj);
    fz_put("tokenizer_config.json", part[1], len[1], pc, sizeof pc);
    fz_put("chat_template.jinja", part[2], len[2], pt, sizeof pt);
    tokenizer *t = NULL;
    specd_err err = {{0}};
    if (tok_create_from_hf(pj, &t, &err) < 0) {
        if (t || !err.msg[0]) abort();
        return 0;
    }
    fz_check_tokenizer(t, data, size);
    return 0;
}
