/*
 * kn_mla_bench.c: kn_mla_attention (CUDA cores) and kn_mla_attention_mma
 * (tensor cores) (kernels/kn_mla.h) at Kimi-K2.5's TP-8
 * rank shape: 8 query heads over the bf16 latent cache of kv_lora_rank 512 +
 * rope 64 (1,152 bytes per token per layer), blocks of 64 slots. A benchmark
 * (tools/gpu_check.sh runs it), not a test: it asserts nothing.
 *
 *   kn_mla_bench [--json PATH] [--iters N]
 *
 * Cases: decode (1 token per sequence) and verify (4 tokens per sequence: 3
 * drafts + 1, causal) at batch 1, 4, 16, 32 and context 1K, 4K, 32K (the
 * tokens of the step sit at positions ctx .. ctx + q - 1), each variant. Per case: the time
 * of one kn_mla_attention call (both kernels: partial + merge), mean over N
 * calls after a warm-up, each call timed by CUDA events with a 256 MiB memset
 * in between (outside the timing) so the latent comes from HBM, not from the
 * 60 MB L2; latent bytes = the rows a step must read at least once (batch x
 * (ctx + q) x 1,152); GB/s = those bytes / time, and its fraction of the
 * measured device-to-device copy bandwidth (read + write). One JSON object per
 * line per case in PATH (and a first line with the device and the copy
 * bandwidth). Values in the cache do not matter to the speed (a constant bf16
 * pattern; q = 0). Exits 77 without a usable GPU.
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kn_mla.h"
#include "tests/kernels/kn_harness.h"
#include "tests/perf/kn_bench_util.h"


#define HEADS 8
#define KVL 512
#define ROPE 64
#define BS 64
#define ROW_BYTES ((KVL + ROPE) * 2)
#define SCALE 0.144680f

static const int BATCHES[] = {1, 4, 16, 32};
static const int CTXS[] = {1024, 4096, 32768};
static const int QLENS[] = {1, 4}; /* decode, verify of 4 tokens */
#define N_ARR(a) ((int)(sizeof a / sizeof a[0]))

int main(int argc, char **argv) {
    const char *json = NULL;
    int iters = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--json PATH] [--iters N]\n", argv[0]);
            return 2;
        }
    }
    if (iters < 1) iters = 1;
    kn_harness_require_gpu();
    struct cudaDeviceProp prop;
    KN_CK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t st;
    KN_CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    KN_CK(cudaEventCreate(&e0));
    KN_CK(cudaEventCreate(&e1));

    /* copy bandwidth (read + write), the reference for every fraction below */
    const double copy_gbps = kn_bench_copy_gbps(st, 5);
    const size_t flush_bytes = (size_t)256 << 20;
    void *flush;
    KN_CK(cudaMalloc(&flush, flush_bytes));

    /* the largest case sizes every buffer: 32 sequences x (32K + 4) positions */
    const int bmax = BATCHES[N_ARR(BATCHES) - 1], cmax = CTXS[N_ARR(CTXS) - 1], qmax = QLENS[N_ARR(QLENS) - 1];
    const int max_len = cmax + qmax, nb_seq = (max_len + BS - 1) / BS;
    const int n_blocks = bmax * nb_seq, tmax = bmax * qmax;
    uint16_t *lat;
    KN_CK(cudaMalloc((void **)&lat, (size_t)n_blocks * BS * ROW_BYTES));
    KN_CK(cudaMemsetAsync(lat, 0x3c, (size_t)n_blocks * BS * ROW_BYTES, st)); /* bf16 0x3c3c = 0.0115 */
    int32_t *bt = malloc((size_t)bmax * nb_seq * sizeof *bt);
    int32_t *pos = malloc((size_t)tmax * sizeof *pos), *seq = malloc((size_t)tmax * sizeof *seq);
    if (!bt || !pos || !seq) { fprintf(stderr, "out of memory\n"); return 1; }
    for (int s = 0; s < bmax; s++) /* sequences' blocks interleaved over the pool, as a paged allocator leaves them */
        for (int j = 0; j < nb_seq; j++) bt[s * nb_seq + j] = j * bmax + s;
    int32_t *d_bt, *d_pos, *d_seq;
    float *d_q, *d_out;
    KN_CK(cudaMalloc((void **)&d_bt, (size_t)bmax * nb_seq * sizeof(int32_t)));
    KN_CK(cudaMemcpy(d_bt, bt, (size_t)bmax * nb_seq * sizeof(int32_t), cudaMemcpyHostToDevice));
    KN_CK(cudaMalloc((void **)&d_pos, (size_t)tmax * sizeof(int32_t)));
    KN_CK(cudaMalloc((void **)&d_seq, (size_t)tmax * sizeof(int32_t)));
    KN_CK(cudaMalloc((void **)&d_q, (size_t)tmax * HEADS * (KVL + ROPE) * sizeof(float)));
    KN_CK(cudaMemsetAsync(d_q, 0, (size_t)tmax * HEADS * (KVL + ROPE) * sizeof(float), st));
    KN_CK(cudaMalloc((void **)&d_out, (size_t)tmax * HEADS * KVL * sizeof(float)));
    const size_t scratch_bytes = kn_mla_scratch_bytes(tmax, HEADS, max_len, KVL);
    void *scratch;
    KN_CK(cudaMalloc(&scratch, scratch_bytes));
    const kn_mla_cache cache = {lat, BS, KVL, ROPE, n_blocks};

    FILE *jf = json ? fopen(json, "w") : NULL;
    if (json && !jf) { fprintf(stderr, "cannot write %s\n", json); return 1; }
    printf("device: %s, %d SMs, L2 %d MiB; copy D2D (read + write) %.1f GB/s\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20, copy_gbps);
    if (jf)
        fprintf(jf, "{\"bench\": \"kn_mla\", \"device\": \"%s\", \"sms\": %d, \"copy_gbps\": %.1f, \"iters\": %d, "
                    "\"heads\": %d, \"kv_lora_rank\": %d, \"rope\": %d, \"block_size\": %d, \"split\": %d}\n",
                prop.name, prop.multiProcessorCount, copy_gbps, iters, HEADS, KVL, ROPE, BS, KN_MLA_SPLIT);
    printf("%-11s %-7s %5s %6s %10s %12s %8s %6s\n", "variant", "form", "batch", "ctx", "us", "latent MB", "GB/s",
           "frac");
    for (int mma = 0; mma < 2; mma++) {
        for (int qi = 0; qi < N_ARR(QLENS); qi++)
            for (int ci = 0; ci < N_ARR(CTXS); ci++)
                for (int bi = 0; bi < N_ARR(BATCHES); bi++) {
                    const int q = QLENS[qi], ctx = CTXS[ci], B = BATCHES[bi], T = B * q;
                    for (int s = 0; s < B; s++)
                        for (int j = 0; j < q; j++) seq[s * q + j] = s, pos[s * q + j] = ctx + j;
                    KN_CK(cudaMemcpyAsync(d_pos, pos, (size_t)T * sizeof(int32_t), cudaMemcpyHostToDevice, st));
                    KN_CK(cudaMemcpyAsync(d_seq, seq, (size_t)T * sizeof(int32_t), cudaMemcpyHostToDevice, st));
                    const kn_attn_batch b = {T, d_pos, d_seq, d_bt, nb_seq, bmax, NULL, ctx + q};
                    double acc = 0;
                    for (int it = -1; it < iters; it++) { /* it = -1: warm-up */
                        KN_CK(cudaMemsetAsync(flush, it & 0xff, flush_bytes, st));
                        KN_CK(cudaEventRecord(e0, st));
                        KN_CK((mma ? kn_mla_attention_mma : kn_mla_attention)(&cache, &b, d_q, HEADS, SCALE, d_out,
                                                                            scratch, scratch_bytes, st));
                        KN_CK(cudaEventRecord(e1, st));
                        KN_CK(cudaEventSynchronize(e1));
                        float m = 0;
                        KN_CK(cudaEventElapsedTime(&m, e0, e1));
                        if (it >= 0) acc += m;
                    }
                    const double us = acc / iters * 1e3;
                    const double bytes = (double)B * (ctx + q) * ROW_BYTES;
                    const double gbps = bytes / (us * 1e-6) / 1e9;
                    const char *form = q == 1 ? "decode" : "verify", *variant = mma ? "mma" : "cuda_cores";
                    printf("%-11s %-7s %5d %6d %10.1f %12.2f %8.0f %6.3f\n", variant, form, B, ctx, us,
                           bytes / 1e6, gbps, gbps / copy_gbps);
                    if (jf)
                        fprintf(jf, "{\"bench\": \"kn_mla\", \"variant\": \"%s\", \"form\": \"%s\", \"q_len\": %d, "
                                    "\"batch\": %d, \"ctx\": %d, \"kernels\": 2, \"us\": %.2f, \"latent_bytes\": %.0f, "
                                    "\"gbps\": %.1f, \"frac_copy\": %.3f}\n",
                                variant, form, q, B, ctx, us, bytes, gbps, gbps / copy_gbps);
                }
    }
    if (jf) fclose(jf);
    KN_CK(cudaFree(lat));
    KN_CK(cudaFree(d_bt));
    KN_CK(cudaFree(d_pos));
    KN_CK(cudaFree(d_seq));
    KN_CK(cudaFree(d_q));
    KN_CK(cudaFree(d_out));
    KN_CK(cudaFree(scratch));
    KN_CK(cudaFree(flush));
    free(bt), free(pos), free(seq);
    return 0;
}
