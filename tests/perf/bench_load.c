/*
 * bench_load.c: how fast a rank reads its part of a safetensors checkpoint
 * (engine/loader/st_load.h), on this machine, and (--device cuda) how fast
 * the CUDA backend's pinned staging ring then puts it on the GPU.
 *
 * Writes a synthetic checkpoint of --gb GB under --dir (default /tmp): 4
 * shards of bf16 [4096, 4096] tensors (32 MiB each, values from a seeded
 * xorshift, --seed), with model.safetensors.index.json; deletes it at the
 * end unless --keep. Then, each line one measurement:
 *   read whole, 1/2/4/8 threads, cold and warm     st_prefetch of every tensor
 *   lazy mmap, 1 thread, cold                       the previous path: touching every page of the mapping
 *   TP 8 rank 0 column slices (rows), 8 threads     1/8 of every tensor, contiguous
 *   TP 8 rank 0 row slices: whole rows then slice   every tensor read whole, its 1/8 of the columns copied
 *   TP 8 rank 0 row slices: one pread per row       4096 preads of 1 KiB per tensor
 *   (--device cuda) weight_place of every tensor through the staging ring, page cache warm: GB/s to the
 *   device, and the same with the reads first (cold file -> device)
 * Cold: the files' pages are dropped from the page cache first with
 * posix_fadvise(POSIX_FADV_DONTNEED) after an fsync (no root needed) and the
 * residency left is measured with mincore and printed; warm: the previous
 * measurement's pages are still cached. A shared machine's figures vary:
 * run it twice.
 * Usage: bench_load [--gb G] [--dir D] [--seed S] [--threads 1,2,4,8] [--keep] [--device cpu|cuda]
 * (--threads: the reader counts, in the order run: on a VM whose host caches the disk, a later cold run
 * can be served by the host's cache; run 8,4,2,1 too)
 * Exit 77 with --device cuda and no usable GPU.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine/backend/backend.h"
#include "engine/backend/cuda_backend.h"
#include "engine/loader/safetensors.h"
#include "engine/loader/st_load.h"

#define ROWS 4096
#define COLS 4096
#define TBYTES ((size_t)ROWS * COLS * 2)
#define N_SHARDS 4

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static char g_dir[512];
static int g_per_shard;

static void shard_path(char *p, size_t cap, int k) {
    snprintf(p, cap, "%s/model-%05d-of-%05d.safetensors", g_dir, k + 1, N_SHARDS);
}

static int write_checkpoint(double gb, uint64_t seed) {
    const int n = (int)(gb * 1e9 / (double)TBYTES + 0.5);
    g_per_shard = n / N_SHARDS > 0 ? n / N_SHARDS : 1;
    uint16_t *buf = malloc(TBYTES * (size_t)g_per_shard);
    st_write_tensor *t = calloc((size_t)g_per_shard, sizeof *t);
    char (*names)[64] = calloc((size_t)g_per_shard, 64);
    static const int64_t shape[2] = {ROWS, COLS};
    if (!buf || !t || !names) return -1;
    FILE *idx = NULL;
    char p[700];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", g_dir);
    if (!(idx = fopen(p, "w"))) return -1;
    fprintf(idx, "{\"metadata\": {\"total_size\": %zu}, \"weight_map\": {", TBYTES * (size_t)g_per_shard * N_SHARDS);
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int k = 0; k < N_SHARDS; k++) {
        for (size_t i = 0; i < TBYTES / 2 * (size_t)g_per_shard; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            buf[i] = (uint16_t)(0x3C00 | ((x >> 40) & 0x03FF)); /* bf16 bit patterns of modest values */
        }
        for (int j = 0; j < g_per_shard; j++) {
            snprintf(names[j], 64, "model.layers.%d.mlp.w%d.weight", k, j);
            t[j] = (st_write_tensor){names[j], ST_BF16, 2, shape, buf + (size_t)j * TBYTES / 2};
            char fn[64];
            snprintf(fn, sizeof fn, "model-%05d-of-%05d.safetensors", k + 1, N_SHARDS);
            fprintf(idx, "%s\"%s\": \"%s\"", k || j ? ", " : "", names[j], fn);
        }
        shard_path(p, sizeof p, k);
        specd_err err = {{0}};
        if (st_write(p, t, (size_t)g_per_shard, NULL, &err) < 0) {
            fprintf(stderr, "%s\n", err.msg);
            return -1;
        }
    }
    fprintf(idx, "}}\n");
    fclose(idx);
    free(buf), free(t), free(names);
    return 0;
}

/* Drops the shards' pages from the page cache; returns the fraction still resident (mincore). */
static double evict(void) {
    size_t res = 0, tot = 0;
    const long pg = sysconf(_SC_PAGESIZE);
    for (int k = 0; k < N_SHARDS; k++) {
        char p[700];
        shard_path(p, sizeof p, k);
        int fd = open(p, O_RDONLY);
        if (fd < 0) continue;
        struct stat st;
        fstat(fd, &st);
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        const size_t np = ((size_t)st.st_size + (size_t)pg - 1) / (size_t)pg;
        unsigned char *v = malloc(np);
        if (m != MAP_FAILED && v && mincore(m, (size_t)st.st_size, v) == 0)
            for (size_t i = 0; i < np; i++) res += v[i] & 1;
        tot += np;
        free(v);
        if (m != MAP_FAILED) munmap(m, (size_t)st.st_size);
        close(fd);
    }
    return tot ? (double)res / (double)tot : 0;
}

static void report(const char *what, uint64_t bytes, double s, double resident) {
    printf("%-58s %7.3f GB in %7.3f s = %6.2f GB/s", what, (double)bytes * 1e-9, s, (double)bytes * 1e-9 / s);
    if (resident >= 0) printf("   (cold: %.1f %% resident before)", 100 * resident);
    printf("\n");
    fflush(stdout);
}

static int read_plan(const st_model *m, int threads, int slice, const char *what, double resident) {
    st_plan p = {0};
    specd_err err = {{0}};
    for (size_t i = 0; i < st_n_tensors(m); i++) {
        const st_tensor *t = st_tensor_at(m, i);
        if ((slice ? st_plan_rows(&p, m, t, 0, ROWS / 8, &err) : st_plan_whole(&p, m, t, &err)) < 0) return -1;
    }
    st_load_stats s;
    if (st_prefetch(m, &p, threads, &s, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    report(what, s.bytes_read, s.seconds, resident);
    st_plan_free(&p);
    return 0;
}

/* Row-parallel slice of rank 0 of 8 (the first eighth of every row of RB bytes: each tensor seen as
 * [TBYTES / RB, RB] bytes) by one pread per row, or whole then copied. RB = 8192: a bf16 [4096, 4096] o_proj-like
 * tensor (1 KiB per row kept); RB = 1024: an int4 expert down_proj's packed rows at Kimi's shape (128 B kept). */
static void row_slices(const st_model *m, int per_row, size_t RB, double resident) {
    const size_t cb = RB / 8, nrows = TBYTES / RB;
    uint8_t *whole = per_row ? NULL : malloc(TBYTES), *out = malloc(cb * nrows);
    int fds[N_SHARDS];
    for (int k = 0; k < st_n_shards(m); k++) fds[k] = open(st_shard_path(m, k), O_RDONLY);
    uint64_t bytes = 0;
    const double t0 = now_s();
    for (size_t i = 0; i < st_n_tensors(m); i++) {
        const st_tensor *t = st_tensor_at(m, i);
        const uint64_t off = st_tensor_file_offset(m, t);
        if (per_row) {
            for (size_t r = 0; r < nrows; r++)
                bytes += (uint64_t)pread(fds[t->shard], out + r * cb, cb, (off_t)(off + (uint64_t)(r * RB)));
        } else {
            for (size_t got = 0; got < TBYTES;) {
                const ssize_t n = pread(fds[t->shard], whole + got, TBYTES - got, (off_t)(off + got));
                if (n <= 0) break;
                got += (size_t)n, bytes += (uint64_t)n;
            }
            for (size_t r = 0; r < nrows; r++) memcpy(out + r * cb, whole + r * RB, cb);
        }
    }
    const double s = now_s() - t0;
    char what[96];
    snprintf(what, sizeof what, "row slices, %zu B of %zu B rows: %s", cb, RB, per_row ? "a pread per row" : "whole, sliced");
    report(what, bytes, s, resident);
    printf("%-58s %7.3f GB kept: %.2f GB/s of kept bytes%s\n", "", (double)(cb * nrows * st_n_tensors(m)) * 1e-9,
           (double)(cb * nrows * st_n_tensors(m)) * 1e-9 / s, resident < 0 ? " (warm)" : "");
    for (int k = 0; k < st_n_shards(m); k++) close(fds[k]);
    free(whole), free(out);
}

/* On a model of its own, closed after: pages touched through a mapping stay mapped (and so cached) until it goes. */
static void lazy_mmap(double resident) {
    st_model *m = NULL;
    specd_err err = {{0}};
    if (st_open(g_dir, &m, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return;
    }
    volatile uint64_t sum = 0;
    const long pg = sysconf(_SC_PAGESIZE);
    uint64_t bytes = 0;
    const double t0 = now_s();
    for (size_t i = 0; i < st_n_tensors(m); i++) {
        const st_tensor *t = st_tensor_at(m, i);
        for (uint64_t o = 0; o < t->nbytes; o += (uint64_t)pg) sum += ((const uint8_t *)t->data)[o];
        bytes += t->nbytes;
    }
    report("lazy mmap (touch every page, 1 thread)", bytes, now_s() - t0, resident);
    st_close(m);
}

static int cuda_place(const st_model *m, int cold) {
    size_t fr = 0, tot = 0;
    specd_err err = {{0}};
    if (bk_cuda_mem_info(0, &fr, &tot, &err) < 0) {
        printf("FAIL: %s\n", err.msg);
        return 1;
    }
    const size_t need = TBYTES * st_n_tensors(m) + ((size_t)512 << 20);
    bk_cuda_opts o = {.device = 0, .arena_bytes = need < fr * 9 / 10 ? need : fr * 9 / 10, .max_tokens = 16,
                      .max_seqs = 2, .max_len = 256, .block_size = 16, .max_heads = 8, .max_head_dim = 128};
    backend *be = bk_cuda_create(&o, &err);
    if (!be) {
        printf("FAIL: bk_cuda_create: %s\n", err.msg);
        return 1;
    }
    double resident = -1;
    if (cold) resident = evict();
    const double t0 = now_s();
    uint64_t bytes = 0;
    if (cold && read_plan(m, 0, 0, "  (reads for the cold placement, default threads)", -1) < 0) return 1;
    for (size_t i = 0; i < st_n_tensors(m); i++) {
        const st_tensor *t = st_tensor_at(m, i);
        const bk_weight w = {BK_W_BF16, ROWS, COLS, t->data, COLS * 2, NULL};
        bk_weight d;
        if (bytes + TBYTES > o.arena_bytes - ((size_t)256 << 20)) break; /* what fits */
        if (be->ops->weight_place(be->ctx, &w, &d) < 0) {
            printf("FAIL: weight_place %zu\n", i);
            return 1;
        }
        bytes += TBYTES;
    }
    float one;
    be->ops->download(be->ctx, &one, be->ops->buf_alloc(be->ctx, 4), 0); /* a stream sync: the copies are done */
    report(cold ? "cuda: file -> page cache -> pinned ring -> device (cold)" : "cuda: page cache -> pinned ring -> device (warm)",
           bytes, now_s() - t0, resident);
    bk_cuda_destroy(be);
    return 0;
}

int main(int argc, char **argv) {
    double gb = 3;
    uint64_t seed = 1;
    int keep = 0, cuda = 0, th[8] = {1, 2, 4, 8}, n_th = 4;
    snprintf(g_dir, sizeof g_dir, "/tmp");
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--gb") && i + 1 < argc) gb = atof(argv[++i]);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc) snprintf(g_dir, sizeof g_dir, "%s", argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--keep")) keep = 1;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) { /* the order matters on a VM whose host caches */
            n_th = 0;
            for (char *q = argv[++i]; *q && n_th < 8; q += *q == ',') th[n_th++] = (int)strtol(q, &q, 10);
        }
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) cuda = !strcmp(argv[++i], "cuda");
        else {
            fprintf(stderr, "usage: bench_load [--gb G] [--dir D] [--seed S] [--threads 1,2,4,8] [--keep] [--device cpu|cuda]\n");
            return 2;
        }
    }
    if (cuda) {
        char why[256];
        if (bk_cuda_probe(0, why, sizeof why) != 0) {
            printf("SKIP: --device cuda: %s\n", why);
            return 77;
        }
    }
    char base[512];
    snprintf(base, sizeof base, "%.480s/specd_bench_load_XXXXXX", g_dir);
    if (!mkdtemp(base)) {
        fprintf(stderr, "mkdtemp %s: %s\n", base, strerror(errno));
        return 1;
    }
    snprintf(g_dir, sizeof g_dir, "%s", base);
    const double tw = now_s();
    if (write_checkpoint(gb, seed) < 0) {
        fprintf(stderr, "cannot write the checkpoint under %s\n", g_dir);
        return 1;
    }
    st_model *m = NULL;
    specd_err err = {{0}};
    if (st_open(g_dir, &m, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    printf("checkpoint %s: %d shards x %d bf16 [%d, %d] tensors, %.3f GB, written in %.1f s; %ld cores\n", g_dir,
           N_SHARDS, g_per_shard, ROWS, COLS, (double)TBYTES * (double)st_n_tensors(m) * 1e-9, now_s() - tw,
           sysconf(_SC_NPROCESSORS_ONLN));
    int rc = 0;
    if (cuda) {
        if (read_plan(m, 8, 0, "read whole, 8 threads, cold", evict()) < 0) rc = 1;
        rc = rc ? rc : cuda_place(m, 0);
        if (!rc) rc = cuda_place(m, 1);
    } else {
        const int *TH = th;
        for (int i = 0; i < n_th; i++) {
            char what[96];
            const double res = evict();
            snprintf(what, sizeof what, "read whole, %d thread%s, cold", TH[i], TH[i] > 1 ? "s" : "");
            if (read_plan(m, TH[i], 0, what, res) < 0) rc = 1;
            snprintf(what, sizeof what, "read whole, %d thread%s, warm", TH[i], TH[i] > 1 ? "s" : "");
            if (read_plan(m, TH[i], 0, what, -1) < 0) rc = 1;
        }
        lazy_mmap(evict());
        if (read_plan(m, 8, 1, "TP 8 rank 0 column slices (1/8 of the rows), 8 threads, cold", evict()) < 0) rc = 1;
        static const size_t RB[] = {8192, 1024};
        for (int i = 0; i < 2; i++) {
            row_slices(m, 0, RB[i], evict());
            row_slices(m, 1, RB[i], evict());
            row_slices(m, 0, RB[i], -1);
            row_slices(m, 1, RB[i], -1);
        }
    }
    st_close(m);
    if (!keep) {
        char p[700];
        for (int k = 0; k < N_SHARDS; k++) shard_path(p, sizeof p, k), unlink(p);
        snprintf(p, sizeof p, "%s/model.safetensors.index.json", g_dir);
        unlink(p);
        rmdir(g_dir);
    } else {
        printf("kept %s\n", g_dir);
    }
    return rc;
}
