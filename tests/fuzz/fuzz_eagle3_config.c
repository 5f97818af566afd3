/*
 * fuzz_eagle3_config.c: libFuzzer harness for eagle3_config_parse, the reader
 * of a draft head's config.json (untrusted: downloaded with the weights).
 *
 * Oracle: a refused config leaves a non-empty message; an accepted one obeys
 * the invariants the loader relies on (the essay of draft/eagle3_config.h):
 * positive sizes, heads that divide, at most EAGLE3_MAX_AUX aux ids, a
 * NUL-terminated verifier name. The accepted config is then taken through
 * eagle3_config_aux_layers (with a 30-layer target, as SmolLM2) and
 * eagle3_config_inv_freq, the two consumers of its numbers.
 * Threading: single-threaded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "draft/eagle3_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    eagle3_config c;
    specd_err err = {{0}};
    if (eagle3_config_parse((const char *)data, size, &c, &err) != 0) {
        if (!err.msg[0]) abort();
        return 0;
    }
    if (c.hidden <= 0 || c.target_hidden <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 ||
        c.ffn <= 0 || c.draft_vocab <= 0 || c.target_vocab <= 0)
        abort();
    if (c.n_heads % c.n_kv_heads) abort();
    if (c.n_aux_ids < 0 || c.n_aux_ids > EAGLE3_MAX_AUX) abort();
    if (!memchr(c.verifier, 0, sizeof c.verifier)) abort();
    (void)eagle3_layout_name(c.layout);
    int32_t ids[EAGLE3_MAX_AUX];
    specd_err e2 = {{0}};
    int n = eagle3_config_aux_layers(&c, 30, EAGLE3_AUX_AUTO, 0, ids, &e2);
    if (n < 0 && !e2.msg[0]) abort();
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= 30) abort();
    if (c.head_dim % 2 == 0 && c.head_dim <= 4096) {
        float *f = malloc((size_t)c.head_dim / 2 * sizeof *f);
        if (f) {
            eagle3_config_inv_freq(&c, f);
            free(f);
        }
    }
    return 0;
}
