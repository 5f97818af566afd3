/*
 * hf_json.c: builds a tokenizer from a Hugging Face tokenizer.json.
 * (Being written: returns an error for now.)
 */
#include "engine/tokenizer/tok_internal.h"

int tok_create_from_hf(const char *tokenizer_json_path, tokenizer **out, specd_err *err) {
    *out = NULL;
    return specd_err_set(err, "tok_create_from_hf(%s): not implemented yet", tokenizer_json_path);
}
