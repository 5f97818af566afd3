/*
 * bench_sampler.c: CPU time per sampled token of the sampler on a
 * SmolLM2-sized vocabulary (49152) for common parameter sets. Not a test
 * (ctest does not run it): build target runtime_bench_sampler, then
 *   ./build/tests/runtime/runtime_bench_sampler
 * CPU time (CLOCK_PROCESS_CPUTIME_ID) is reported because the development
 * machines are shared and wall time there mostly measures the neighbours.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/runtime/sampler.h"

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

void sampling_params_init(sampling_params *sp) { /* engine.c's defaults, without linking the engine */
    memset(sp, 0, sizeof *sp);
    sp->temperature = 1.0f;
    sp->top_p = 1.0f;
    sp->top_k = -1;
    sp->repetition_penalty = 1.0f;
    sp->max_tokens = 16;
    sp->logprobs = -1;
}

int main(void) {
    const int32_t V = 49152;
    float *l = malloc((size_t)V * sizeof *l);
    sampler_work *w = sampler_work_create(V);
    if (!l || !w) return 1;
    sampler_rng r;
    sampler_rng_seed(&r, 1);
    /* a spread of logits with a few hundred strong candidates */
    for (int32_t i = 0; i < V; i++) l[i] = (float)(sampler_rng_uniform(&r) * 10.0 - 5.0) + (i % 97 == 0 ? 8.0f : 0.0f);
    int32_t hist[64];
    for (int i = 0; i < 64; i++) hist[i] = i * 13;
    sampler_hist h = {hist, 64, hist, 32, NULL, 0};
    static const char *names[] = {"greedy", "temperature 0.8", "temperature 0.8, top_p 0.9",
                                  "temperature 0.8, top_k 50, top_p 0.9", "temperature 0.8, min_p 0.05, penalties"};
    for (int c = 0; c < 5; c++) {
        sampling_params sp;
        sampling_params_init(&sp);
        sp.temperature = c == 0 ? 0.0f : 0.8f;
        if (c == 2 || c == 3) sp.top_p = 0.9f;
        if (c == 3) sp.top_k = 50;
        if (c == 4) {
            sp.min_p = 0.05f;
            sp.repetition_penalty = 1.1f;
            sp.frequency_penalty = 0.5f;
        }
        const int n = 300;
        long sink = 0;
        double t0 = cpu_now();
        for (int i = 0; i < n; i++) sink += sampler_sample(w, &sp, &h, &r, l);
        double dt = (cpu_now() - t0) / n;
        printf("%-40s %.3f ms/token (checksum %ld)\n", names[c], dt * 1e3, sink);
    }
    sampler_work_destroy(w);
    free(l);
    return 0;
}
