/*
 * test_cuda_stage.c: the CUDA backend's pinned staging ring (cu_stage_copy
 * behind weight_place and moe_place) uploads exactly the source bytes, on the
 * fake device (cuda_fake.c) with fake_async_copies on: a copy from pinned
 * memory lands only when something orders it (the slot's event synchronized,
 * the copy stream waited on, a sync, a launch), so a ring that refilled a
 * slot before its copy finished would upload the later chunk's bytes.
 * Weights of many sizes (smaller than a slot, exactly a slot, a ring, many
 * rings, odd sizes) are placed back to back with a 3 KiB ring (slots of
 * 1 KiB), then downloaded and compared byte for byte with their sources;
 * then the Kimi miniature's routed experts go through moe_place the same way
 * (backend_cuda_kimi_on_fake runs the whole model on that path); last a
 * 200 MiB weight through the default 64 MiB ring.
 * Built twice: backend_cuda_stage on the fake, cuda_stage_gpu (label gpu,
 * -DSTAGE_REAL_GPU) on the real runtime, where the copies are really
 * asynchronous; that one exits 77 without a usable GPU.
 */
#ifndef STAGE_REAL_GPU
#include "tests/backend/cuda_fake/cuda_runtime_api.h" /* first: the fake renames the backend's entry points */
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/backend.h"
#include "engine/backend/cuda_backend.h"

#ifdef STAGE_REAL_GPU /* cuda_stage_gpu (label gpu): the real runtime, whose copies from pinned memory are asynchronous */
#include "tests/kernels/kn_harness.h"
static int fake_async_copies;
static long fake_deferred_copies;
#else
extern int fake_async_copies;
extern long fake_deferred_copies;
#endif

static int g_fail;
#define EXPECT(c, ...)                                  \
    do {                                                \
        if (!(c)) {                                     \
            printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                        \
            printf("\n");                               \
            g_fail++;                                   \
        }                                               \
    } while (0)

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint8_t next_byte(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint8_t)(rng >> 32);
}

/* One weight of BYTES bytes placed with the default 64 MiB ring (many slots' worth), downloaded, compared. */
static void big_weight(size_t bytes) {
    specd_err err = {{0}};
    bk_cuda_opts o = {.device = 0, .arena_bytes = bytes + ((size_t)64 << 20), .max_tokens = 16, .max_seqs = 2,
                      .max_len = 64, .block_size = 16, .max_heads = 4, .max_head_dim = 64};
    backend *be = bk_cuda_create(&o, &err);
    if (!be) {
        EXPECT(0, "bk_cuda_create (%zu-byte arena): %s", o.arena_bytes, err.msg);
        return;
    }
    uint8_t *src = malloc(bytes), *back = malloc(bytes);
    for (size_t k = 0; k < bytes; k++) src[k] = next_byte();
    const int64_t cols = 4096, rows = (int64_t)(bytes / (2 * (size_t)cols));
    const bk_weight w = {BK_W_BF16, rows, cols, src, (size_t)(2 * cols), NULL};
    bk_weight d;
    EXPECT(be->ops->weight_place(be->ctx, &w, &d) == 0, "weight_place of %zu bytes", bytes);
    EXPECT(be->ops->download(be->ctx, back, d.data, (size_t)rows * (size_t)(2 * cols)) == 0, "download");
    EXPECT(!memcmp(src, back, (size_t)rows * (size_t)(2 * cols)), "a %zu-byte weight through the 64 MiB ring differs",
           bytes);
    printf("a %.1f MB weight through the default ring: %s\n", (double)bytes * 1e-6,
           memcmp(src, back, (size_t)rows * (size_t)(2 * cols)) ? "differs" : "identical");
    free(src), free(back);
    bk_cuda_destroy(be);
}

int main(void) {
#ifdef STAGE_REAL_GPU
    kn_harness_require_gpu();
#endif
    fake_async_copies = 1;
    specd_err err = {{0}};
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)64 << 20, .max_tokens = 16, .max_seqs = 2, .max_len = 64,
                      .block_size = 16, .max_heads = 4, .max_head_dim = 64, .staging_bytes = 3 * 1024};
    backend *be = bk_cuda_create(&o, &err);
    if (!be) {
        printf("FAIL: bk_cuda_create: %s\n", err.msg);
        return 1;
    }
    /* bf16 weights [rows, cols]: bytes = 2 rows cols; slots are 1024 bytes */
    static const int64_t SHAPES[][2] = {{1, 8},   {4, 128},  {2, 256},  {6, 256},  {3, 1000}, {17, 33},
                                        {64, 512}, {1, 1536}, {5, 7},   {128, 96}, {1, 2},    {300, 301}};
    enum { NW = sizeof SHAPES / sizeof SHAPES[0] };
    uint8_t *src[NW];
    bk_weight placed[NW];
    const long deferred0 = fake_deferred_copies;
    for (int i = 0; i < NW; i++) {
        const size_t n = (size_t)(2 * SHAPES[i][0] * SHAPES[i][1]);
        src[i] = malloc(n);
        for (size_t k = 0; k < n; k++) src[i][k] = next_byte();
        const bk_weight w = {BK_W_BF16, SHAPES[i][0], SHAPES[i][1], src[i], (size_t)(2 * SHAPES[i][1]), NULL};
        EXPECT(be->ops->weight_place(be->ctx, &w, &placed[i]) == 0, "weight_place %d", i);
    }
#ifndef STAGE_REAL_GPU
    EXPECT(fake_deferred_copies - deferred0 > NW, "the ring's copies were deferred (%ld): the mode was exercised",
           fake_deferred_copies - deferred0);
#endif
    for (int i = 0; i < NW; i++) { /* the sources are rewritten: nothing may still be reading them */
        const size_t n = (size_t)(2 * SHAPES[i][0] * SHAPES[i][1]);
        uint8_t *keep = malloc(n), *back = malloc(n);
        memcpy(keep, src[i], n);
        memset(src[i], 0x5A, n);
        EXPECT(be->ops->download(be->ctx, back, placed[i].data, n) == 0, "download %d", i);
        size_t k = 0;
        while (k < n && back[k] == keep[k]) k++;
        EXPECT(k == n, "weight %d [%lld x %lld] (%zu bytes): differs at byte %zu", i, (long long)SHAPES[i][0],
               (long long)SHAPES[i][1], n, k);
        free(keep), free(back), free(src[i]);
    }
    printf("%d weights placed through a 3 x 1 KiB ring, %ld copies deferred, then downloaded and compared\n", NW,
           fake_deferred_copies - deferred0);
    bk_cuda_destroy(be);
    big_weight((size_t)200 << 20); /* 200 MiB: more than 9 slots of 21 MiB, the ring wrapping three times */
    if (g_fail) {
        printf("%d check(s) failed\n", g_fail);
        return 1;
    }
    printf("OK\n");
    return 0;
}
