/*
 * fuzz_eagle3_vocab.c: libFuzzer harness for eagle3_vocab_validate, the check
 * that stands between a draft head's d2t / t2d tensors (untrusted model
 * files) and the engine's id mapping.
 *
 * Input layout: byte 0 = flags (bit0: d2t present, bit1: t2d present, bit2:
 * d2t entries are raw little-endian int64 instead of small int8 offsets, so
 * both the near-valid and the extreme values are reached); bytes 1-2 = target
 * vocab V (1..4096); the rest feeds d2t (n = its entries, capped at V + 1)
 * and then t2d (V bytes, missing bytes read as 0).
 *
 * Oracle (independent of the validator's code): when it accepts, the mapped
 * ids it returns are exactly i + d2t[i], strictly increasing, inside [0, V),
 * and, with a t2d, t2d holds exactly those n ids. When it refuses, the message
 * is non-empty. Threading: single-threaded.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "draft/eagle3_vocab.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 3) return 0;
    uint8_t flags = data[0];
    int64_t V = 1 + ((data[1] | data[2] << 8) % 4096);
    data += 3;
    size -= 3;
    bool raw = flags & 4;
    size_t esz = raw ? 8 : 1;
    int64_t n = (int64_t)(size / esz);
    if (n > V + 1) n = V + 1;
    if (!(flags & 1) && n == 0) n = V; /* no d2t: draft vocab from the target's */
    if (n == 0) n = 1;
    int64_t *d2t = NULL;
    if (flags & 1) {
        d2t = calloc((size_t)n, sizeof *d2t);
        for (int64_t i = 0; i < n && (size_t)(i + 1) * esz <= size; i++) {
            if (raw) {
                uint64_t u = 0;
                for (int b = 0; b < 8; b++) u |= (uint64_t)data[i * 8 + b] << (8 * b);
                memcpy(&d2t[i], &u, sizeof u);
            } else {
                d2t[i] = (int8_t)data[i];
            }
        }
    }
    size_t used_bytes = (flags & 1) ? (size_t)n * esz : 0;
    uint8_t *t2d = NULL;
    if (flags & 2) {
        t2d = calloc((size_t)V, 1);
        for (int64_t j = 0; j < V && used_bytes + (size_t)j < size; j++) t2d[j] = data[used_bytes + (size_t)j] & 1;
    }
    int64_t *used = malloc((size_t)n * sizeof *used);
    eagle3_vocab_info info;
    specd_err err = {{0}};
    if (eagle3_vocab_validate(d2t, n, t2d, V, used, &info, &err) == 0) {
        for (int64_t i = 0; i < n; i++) {
            int64_t want = d2t ? i + d2t[i] : i;
            if (used[i] != want || used[i] < 0 || used[i] >= V) abort();
            if (i && used[i] <= used[i - 1]) abort();
            if (t2d && !t2d[used[i]]) abort();
        }
        if (t2d) {
            int64_t c = 0;
            for (int64_t j = 0; j < V; j++) c += t2d[j];
            if (c != n) abort();
        }
        char buf[512];
        eagle3_vocab_summary(&info, buf, sizeof buf);
    } else if (!err.msg[0]) {
        abort();
    }
    free(used);
    free(t2d);
    free(d2t);
    return 0;
}
