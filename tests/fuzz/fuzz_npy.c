/*
 * fuzz_npy.c: libFuzzer harness for npy_parse_mem, the .npy reader behind
 * `specd vocab` and external d2t / t2d files (vocab/npy.h).
 *
 * Oracle (numpy's format rules, restated): an accepted file has 0..8 dims,
 * n_elements = the product of the shape, nbytes = n_elements * itemsize, and
 * that many bytes are readable at data (the last one is touched so ASan sees
 * an overrun); a refused one leaves a non-empty message. Threading: single.
 */
#include <stdint.h>
#include <stdlib.h>

#include "vocab/npy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    npy_array a;
    specd_err err = {{0}};
    if (npy_parse_mem(data, size, &a, &err) != 0) {
        if (!err.msg[0]) abort();
        return 0;
    }
    if (a.ndim < 0 || a.ndim > NPY_MAX_DIMS || a.itemsize == 0) abort();
    uint64_t prod = 1;
    for (int i = 0; i < a.ndim; i++) {
        if (a.shape[i] < 0) abort();
        prod *= (uint64_t)a.shape[i];
    }
    if (prod != a.n_elements || a.nbytes != a.n_elements * a.itemsize || a.nbytes > size) abort();
    volatile uint8_t sink = 0;
    if (a.nbytes) sink = ((const uint8_t *)a.data)[a.nbytes - 1];
    (void)sink;
    npy_array_free(&a);
    return 0;
}
