/*
 * load_plan.c: which bytes of a Hugging Face safetensors checkpoint one
 * tensor-parallel rank reads, and reading them (st_load.h) before the
 * architecture loader builds its views.
 *
 * The plan follows the slicing of tp_shard.c / dsv3_tp_slice exactly, from
 * each tensor's declared parallel style (model_linear_parallel for Llama,
 * dsv3_tensor_parallel for DeepSeek-V3 / Kimi) and the rank's place
 * (rank r of N):
 *   column  rows [r R/N, (r+1) R/N) of the [R, C] row-major tensor: one
 *           contiguous byte range (q/k/v, gate/up, q_b, kv_b, the shared
 *           experts' and every routed expert's gate/up with their int4
 *           group scales); Llama k/v with fewer KV heads than ranks: the
 *           rows of the one KV head the rank uses; the LM head when N
 *           divides the vocabulary (else whole, as tp_shard.c keeps it)
 *   row     (o_proj, down_proj, every expert's down) the rank's columns of
 *           every row, one pread each, when that part is at least
 *           m->load_row_min bytes (default MODEL_LOAD_ROW_MIN = 1 KiB); else
 *           the whole tensor in large reads, and model_slice_cols copies
 *           the columns in memory. Measured (tests/perf/bench_load,
 *           docs/kimi-k2.5.md "Loading at scale"): 1 KiB of 8 KiB rows reads
 *           1.2-1.5x (cold) and 2.4-3x (cached) faster per row; 128 B of 1 KiB
 *           rows (Kimi's int4 expert down_proj at TP 8) no faster cold and
 *           3.5-4x slower cached, a syscall per 128 bytes
 *   replicated  whole (norms, the latent down-projections, the router,
 *           the embedding: every rank looks up any token id)
 *   expert parallel (model_load_opts.expert_parallel): a routed expert's
 *           tensors whole when the rank holds it ([ex0, ex0 + ex_n),
 *           model_ep_range), not at all otherwise: a rank reads E/N whole
 *           experts (their packed words, scales and shapes are contiguous
 *           tensors) instead of 1/N of every expert with the down_proj
 *           read whole
 *   not read: tensors with no role (vision tower), layers past
 *           num_hidden_layers (an MTP module), a tied lm_head.weight,
 *           other ranks' experts under expert parallelism.
 * At TP 1 that is every tensor the model uses, whole.
 * The reads put the bytes in the page cache, where the read-only mapping's
 * views (and model_slice_cols, and a device backend's weight_place staging)
 * then find them; with the test aid ST_OPEN_POISON they go into the
 * anonymous shard copies, so a byte the model uses that the plan missed
 * shows up as 0xA5 in the weights (tests/loader/test_load_rank.c).
 * Threading: load time, the loading thread (st_prefetch runs its readers).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/loader/st_load.h"
#include "engine/model/deepseek_v3.h"
#include "engine/model/hf_config.h"
#include "engine/model/model_internal.h"
#include "engine/util/log.h"

/* The layer index of "...layers.N....", or -1. */
static long layer_of(const char *name) {
    const char *p = strstr(name, "layers.");
    if (!p) return -1;
    char *end;
    const long l = strtol(p + 7, &end, 10);
    return end != p + 7 && *end == '.' ? l : -1;
}

static bool has_suffix(const char *s, const char *suf) {
    const size_t a = strlen(s), b = strlen(suf);
    return a >= b && memcmp(s + a - b, suf, b) == 0;
}

/* Rows [r R/N, (r+1) R/N) when N divides R, else the whole tensor (tp_shard.c refuses such a size later). */
static int plan_column(st_plan *p, const st_model *st, const st_tensor *t, int32_t r, int32_t N, specd_err *err) {
    if (N <= 1 || t->n_dims < 1 || t->shape[0] % N) return st_plan_whole(p, st, t, err);
    const int64_t n = t->shape[0] / N;
    return st_plan_rows(p, st, t, (int64_t)r * n, n, err);
}

/* A row-parallel tensor: the rank's columns row by row when they are at least ROW_MIN bytes a row, else whole. */
static int plan_row(st_plan *p, const st_model *st, const st_tensor *t, int32_t r, int32_t N, int64_t row_min,
                    specd_err *err) {
    const uint64_t rb = t->n_dims == 2 && t->shape[0] > 0 ? t->nbytes / (uint64_t)t->shape[0] : 0;
    if (N > 1 && rb && t->shape[1] % N == 0 && rb % (uint64_t)N == 0 && rb / (uint64_t)N >= (uint64_t)row_min)
        return st_plan_row_parts(p, st, t, r, N, err);
    return st_plan_whole(p, st, t, err);
}

static int plan_llama(st_plan *p, const st_model *st, const hf_config *hc, int32_t r, int32_t N, int64_t row_min,
                      specd_err *err) {
    for (size_t i = 0; i < st_n_tensors(st); i++) {
        const st_tensor *t = st_tensor_at(st, i);
        const char *nm = t->name;
        if (!strcmp(nm, "lm_head.weight")) {
            if (hc->tie_embeddings) continue; /* ignored: the head is the embedding */
            if (plan_column(p, st, t, r, hc->vocab % N == 0 ? N : 1, err) < 0) return -1;
            continue;
        }
        const bool kv = has_suffix(nm, "self_attn.k_proj.weight") || has_suffix(nm, "self_attn.v_proj.weight");
        if (kv && N > 1 && hc->n_kv_heads % N && N % hc->n_kv_heads == 0) {
            /* fewer KV heads than ranks: the one head this rank's q heads use (tp_shard.c kv_h0). Only when the
             * header's shape is the [n_kv_heads * head_dim, hidden] the config implies; else the tensor is read
             * whole and the loader refuses its shape with the file named (a plan error would name neither) */
            const int64_t h0 = r / (N / hc->n_kv_heads);
            const bool fits = t->n_dims == 2 && t->shape[0] == (int64_t)hc->n_kv_heads * hc->head_dim;
            if ((fits ? st_plan_rows(p, st, t, h0 * hc->head_dim, hc->head_dim, err) : st_plan_whole(p, st, t, err)) < 0)
                return -1;
            continue;
        }
        const tp_style s = model_linear_parallel(nm);
        const bool embed = strstr(nm, "embed_tokens") != NULL;
        const int rc = s == TP_COLUMN && !embed ? plan_column(p, st, t, r, N, err)
                       : s == TP_ROW          ? plan_row(p, st, t, r, N, row_min, err)
                                              : st_plan_whole(p, st, t, err);
        if (rc < 0) return -1;
    }
    return 0;
}

/* The routed expert index of "...mlp.experts.E....", or -1 (the shared experts are "shared_experts."). */
static long expert_of(const char *name) {
    const char *p = strstr(name, ".mlp.experts.");
    if (!p) return -1;
    char *end;
    const long e = strtol(p + 13, &end, 10);
    return end != p + 13 && *end == '.' ? e : -1;
}

/* ex0, ex_n: the routed experts the rank holds (model_ep_range); ep: held whole (expert parallel) */
static int plan_dsv3(st_plan *p, const st_model *st, const hf_config *hc, int32_t r, int32_t N, int64_t row_min,
                     bool ep, int32_t ex0, int32_t ex_n, specd_err *err) {
    for (size_t i = 0; i < st_n_tensors(st); i++) {
        const st_tensor *t = st_tensor_at(st, i);
        const char *nm = t->name;
        const int s = dsv3_tensor_parallel(nm);
        const long l = layer_of(nm), e = expert_of(nm);
        if (s < 0 || l >= hc->n_layers) continue; /* no role (vision tower), or an MTP layer: never loaded */
        if (e >= 0 && (e < ex0 || e >= (long)ex0 + ex_n)) continue; /* another rank's expert (expert parallel) */
        int rc;
        if (e >= 0 && ep) {
            rc = st_plan_whole(p, st, t, err); /* this rank's expert, whole: contiguous in the shard */
        } else if (has_suffix(nm, "embed_tokens.weight")) {
            rc = st_plan_whole(p, st, t, err); /* replicated in the model (any rank embeds any id) */
        } else if (has_suffix(nm, "lm_head.weight")) {
            if (hc->tie_embeddings) continue;
            rc = plan_column(p, st, t, r, hc->vocab % N == 0 ? N : 1, err);
        } else {
            rc = s == TP_COLUMN ? plan_column(p, st, t, r, N, err)
                 : s == TP_ROW  ? plan_row(p, st, t, r, N, row_min, err)
                                : st_plan_whole(p, st, t, err);
        }
        if (rc < 0) return -1;
    }
    return 0;
}

/* This rank's plan over ST (merged): what model_st_open reads. */
static int plan_rank(st_plan *p, const st_model *st, const hf_config *hc, const model *m, int32_t r, int32_t N,
                     specd_err *err) {
    const int64_t row_min = m->load_row_min > 0 ? m->load_row_min : MODEL_LOAD_ROW_MIN;
    return hc->arch == MODEL_ARCH_LLAMA ? plan_llama(p, st, hc, r, N, row_min, err)
                                        : plan_dsv3(p, st, hc, r, N, row_min, m->ep, m->ex0, m->ex_n, err);
}

int model_plan_rank_bytes(const char *dir, int32_t N, int32_t r, bool expert_parallel, int32_t row_min,
                          int64_t *bytes, int64_t *files, specd_err *err) {
    hf_config hc;
    if (hf_config_load(dir, &hc, err) < 0) return -1;
    model m = {0};
    model_comm mc = {.rank = r, .size = N};
    m.tp = N > 1 ? &mc : NULL;
    m.ep = expert_parallel;
    m.load_row_min = row_min;
    if (N < 1 || r < 0 || r >= N) return specd_err_set(err, "bad tensor-parallel rank %d of %d", r, N);
    if (hc.arch == MODEL_ARCH_LLAMA && m.ep)
        return specd_err_set(err, "expert parallelism needs a mixture-of-experts model (DeepSeek-V3 / Kimi)");
    if (hc.arch != MODEL_ARCH_LLAMA &&
        model_ep_range(&m, hc.first_k_dense < hc.n_layers ? hc.n_routed_experts : 0, err) < 0)
        return -1;
    st_model *st = NULL;
    if (st_open_ex(dir, 0, &st, err) < 0) return -1;
    st_plan p = {0};
    const int rc = plan_rank(&p, st, &hc, &m, r, N, err);
    *bytes = rc < 0 ? 0 : (int64_t)st_plan_merge(&p);
    *files = 0;
    for (int s = 0; s < st_n_shards(st); s++) *files += (int64_t)st_shard_size(st, s);
    st_plan_free(&p);
    st_close(st);
    return rc;
}

int model_st_open(model *m, const hf_config *hc, st_model **out, specd_err *err) {
    if (st_open_ex(m->path, m->load_st_flags, out, err) < 0) return -1;
    const double t0 = model_now_s();
    const int32_t N = m->tp ? m->tp->size : 1, r = m->tp ? m->tp->rank : 0;
    m->load_info.bytes_files = 0;
    for (int s = 0; s < st_n_shards(*out); s++) m->load_info.bytes_files += (int64_t)st_shard_size(*out, s);
    if (m->load_lazy && !(m->load_st_flags & ST_OPEN_POISON)) return 0; /* the mapping faults pages in as used */
    if (N < 1 || r < 0 || r >= N) return specd_err_set(err, "bad tensor-parallel rank %d of %d", r, N);
    st_plan p = {0};
    st_load_stats s;
    const int rc = plan_rank(&p, *out, hc, m, r, N, err);
    if (rc < 0 || st_prefetch(*out, &p, m->load_threads, &s, err) < 0) {
        st_plan_free(&p);
        return -1;
    }
    st_plan_free(&p);
    m->load_info.bytes_read = (int64_t)s.bytes_read;
    m->load_info.threads = s.threads;
    m->load_info.read_seconds = model_now_s() - t0;
    LOG_INFO("rank %d/%d: read %.3f GB of the %.3f GB in %d files (%d of them touched, %zu ranges) in %.2f s with %d "
             "threads (%.2f GB/s)",
             r, N, (double)s.bytes_read * 1e-9, (double)s.bytes_files * 1e-9, st_n_shards(*out), s.files_read,
             s.n_ranges, s.seconds, s.threads, s.seconds > 0 ? (double)s.bytes_read * 1e-9 / s.seconds : 0.0);
    return 0;
}
