/*
 * bundle.c: see bundle.h. The order of construction is backend -> model ->
 * tokenizer -> engine; every step failing leaves the bundle freeable.
 */
#include "server/bundle.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>

#include "draft/eagle3.h"
#include "draft/eagle3_head.h"
#include "draft/eagle3_tp.h"
#include "engine/backend/cuda_backend.h"
#include "engine/model/hf_config.h"
#include "engine/util/log.h"
#include "server/auth.h"

static bool is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

void specd_model_name(const char *model_path, const specd_config *cfg, char *buf, size_t cap) {
    if (cfg && cfg->served_model_name) {
        snprintf(buf, cap, "%s", cfg->served_model_name);
        return;
    }
    size_t n = strlen(model_path);
    while (n > 1 && model_path[n - 1] == '/') n--;
    size_t b = n;
    while (b > 0 && model_path[b - 1] != '/') b--;
    size_t len = n - b;
    if (len > 5 && !strncmp(model_path + n - 5, ".gguf", 5)) len -= 5;
    snprintf(buf, cap, "%.*s", (int)len, model_path + b);
}

/* ------------------------------------------------------------ device selection
 *
 * --device cpu: the CPU backend. --device cuda: the CUDA backend or a refusal
 * at start (a configuration the GPU cannot run yet, cuda_unsupported: said
 * before the probe, which needs a GPU; then no usable GPU: kn_probe's
 * reason). --device auto
 * (default): cuda when both would hold, else cpu with one log line saying
 * why. A draft head runs on the same cuda backend as its target (weights,
 * KV and buffers in the arena, planned below; at TP > 1 split across the GPU
 * ranks, draft/eagle3_tp.h eagle3_tp_load); only a head the GPU cannot
 * run (head_dim beyond the attention kernel's) falls back to a CPU backend
 * of its own, with one log line saying why (specd_bundle_load).
 *
 * Sizing on cuda (vLLM's --gpu-memory-utilization): the process may use
 * util x total GPU memory, which must be free at start. Of that, a fixed
 * reserve (CUDA context, kernel images, driver allocations) stays outside the
 * backend's arena; the arena holds the weights (estimated from the files:
 * packed GGUF blocks / safetensors as stored, K-quants as f32), twice the
 * model workspace of a full step (model.c's grow-only buffers: a new one is
 * allocated before the old one is freed) and the backend's own buffers; the
 * KV cache gets the rest. The plan is one log line. */
#define BUNDLE_CUDA_RESERVE ((size_t)512 << 20)

/* CUDA graphs (engine/model/model_graph.c, docs/engine.md "CUDA graphs"): the
 * buckets are --cuda-graph-sizes or 1, 2, 4, 8, ... below --max-num-seqs
 * and --max-num-seqs itself (vLLM captures 1, 2, 4 and multiples of 8; powers
 * of two keep the count down: a step pads to at most twice its rows). Each
 * bucket is captured for decode (1 token per sequence) and, with a draft, for
 * verify (k + 1 tokens). The graphs' own device memory (the driver's copy of
 * each node's parameters and its bookkeeping; no allocation nodes) is kept
 * outside the arena by the plan, BUNDLE_CUDA_GRAPH_NODE bytes per kernel node,
 * before the KV cache gets the rest, so a capture cannot run out of memory
 * when the estimate holds; the capture logs what it really took. */
#define BUNDLE_CUDA_GRAPH_NODE ((size_t)16 << 10)
#define BUNDLE_CUDA_GRAPH_MIN ((size_t)64 << 20)

static int graph_buckets(const specd_config *cfg, int32_t *out, int cap, specd_err *err) {
    return cfg->enforce_eager ? 0 : specd_config_graph_sizes(cfg, out, cap, err);
}

typedef struct dev_dims {
    bool deepseek;
    int64_t hidden, n_heads, n_kv_heads, head_dim, ffn, vocab, n_layers, max_pos;
    /* DeepSeek-V3 / Kimi (deepseek): MLA and MoE shapes */
    int64_t q_lora, kv_lora, qk_nope, qk_rope, v_head, experts, top_k, moe_inter, shared_inter;
    int64_t experts_held; /* routed experts in this rank's memory: all (TP: each split inside), E/N (expert parallel) */
    int64_t weight_bytes; /* estimate of the bytes weight_place copies */
    int64_t replicated;   /* DeepSeek-V3: bytes of q_a / kv_a_proj_with_mqa / router every TP rank keeps whole */
} dev_dims;

static int64_t file_bytes(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 ? (int64_t)st.st_size : -1;
}

static int dims_gguf(const char *path, dev_dims *d, specd_err *err) {
    gguf_file *g = NULL;
    if (gguf_open(path, &g, err) < 0) return -1;
    const char *arch = NULL;
    size_t al = 0;
    int rc = -1;
    if (gguf_get_str(g, "general.architecture", &arch, &al, err) < 0) goto out;
    struct { const char *k; int64_t *v; } keys[] = {
        {"embedding_length", &d->hidden}, {"attention.head_count", &d->n_heads},
        {"attention.head_count_kv", &d->n_kv_heads}, {"feed_forward_length", &d->ffn},
        {"block_count", &d->n_layers}, {"context_length", &d->max_pos}};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        char key[160];
        snprintf(key, sizeof key, "%.*s.%s", (int)al, arch, keys[i].k);
        if (gguf_get_i64(g, key, keys[i].v, err) < 0) goto out;
    }
    const gguf_tensor *emb = gguf_find_tensor(g, "token_embd.weight");
    if (!emb || d->n_heads <= 0) {
        specd_err_set(err, "%s: no token_embd.weight / head count", path);
        goto out;
    }
    d->vocab = (int64_t)emb->ne[1];
    d->head_dim = d->hidden / d->n_heads;
    for (size_t i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        const bool packed = t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16 ||
                            t->type == GGML_TYPE_Q8_0 || t->type == GGML_TYPE_Q4_0 || t->type == GGML_TYPE_Q4_1;
        d->weight_bytes += packed ? (int64_t)t->nbytes : (int64_t)t->n_elements * 4;
    }
    rc = 0;
out:
    gguf_close(g);
    return rc;
}

static int dims_hf(const char *dir, dev_dims *d, specd_err *err) {
    hf_config hc;
    if (hf_config_load(dir, &hc, err) < 0) return -1;
    d->deepseek = hc.arch != MODEL_ARCH_LLAMA;
    d->hidden = hc.hidden;
    d->n_heads = hc.n_heads;
    d->n_kv_heads = hc.n_kv_heads;
    d->head_dim = hc.head_dim;
    d->ffn = hc.intermediate;
    d->vocab = hc.vocab;
    d->n_layers = hc.n_layers;
    d->max_pos = hc.max_pos;
    if (d->deepseek) { /* one latent "KV head" of kv_lora_rank + rope (deepseek_v3.c) */
        d->q_lora = hc.q_lora_rank, d->kv_lora = hc.kv_lora_rank, d->qk_nope = hc.qk_nope, d->qk_rope = hc.qk_rope;
        d->v_head = hc.v_head, d->experts = hc.n_routed_experts, d->top_k = hc.n_experts_per_tok;
        d->experts_held = d->experts;
        d->moe_inter = hc.moe_intermediate, d->shared_inter = (int64_t)hc.moe_intermediate * hc.n_shared_experts;
        d->n_kv_heads = 1, d->head_dim = hc.kv_lora_rank + hc.qk_rope;
        d->replicated = 2 * d->n_layers * d->hidden * ((hc.q_lora_rank > 0 ? hc.q_lora_rank : 0) + d->head_dim +
                                                       d->experts); /* bf16, a router on every layer at most */
    }
    DIR *dp = opendir(dir);
    if (!dp) return specd_err_set(err, "%s: cannot list", dir);
    struct dirent *e;
    while ((e = readdir(dp))) {
        size_t n = strlen(e->d_name);
        if (n > 12 && !strcmp(e->d_name + n - 12, ".safetensors")) {
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            int64_t fb = file_bytes(p);
            if (fb > 0) d->weight_bytes += fb;
        }
    }
    closedir(dp);
    return 0;
}

/* Why this configuration cannot run on the GPU today ("" if it can). DeepSeek-V3 / Kimi runs there
 * (deepseek_v3_fwd.c on device tensors) when kn_mla takes its latent, at any TP size whose shard the model
 * can cut (tp_shard.c refuses the rest at load with the reason: heads, MLP widths, int4 groups). */
static void cuda_unsupported(const specd_config *cfg, const dev_dims *d, char *why, size_t n) {
    why[0] = '\0';
    if (cfg->max_num_batched_tokens > BK_CUDA_MAX_STEP_TOKENS)
        snprintf(why, n, "--max-num-batched-tokens %d: a step on the CUDA backend carries at most %d tokens (the grid "
                 "limit of its row kernels)", cfg->max_num_batched_tokens, BK_CUDA_MAX_STEP_TOKENS);
    else if (d->deepseek && (d->kv_lora > BK_CUDA_MLA_MAX_KVL || d->kv_lora % 2 || d->qk_rope % 2 ||
                             d->head_dim > BK_CUDA_MAX_HEAD_DIM))
        snprintf(why, n, "MLA latent of kv_lora_rank %lld + rope %lld: the CUDA MLA kernel takes an even kv_lora_rank "
                 "<= %d, an even rope and a latent <= %d", (long long)d->kv_lora, (long long)d->qk_rope,
                 BK_CUDA_MLA_MAX_KVL, BK_CUDA_MAX_HEAD_DIM);
    else if (d->head_dim > BK_CUDA_MAX_HEAD_DIM)
        snprintf(why, n, "head_dim %lld exceeds the CUDA attention kernel's %d", (long long)d->head_dim,
                 BK_CUDA_MAX_HEAD_DIM);
}

/* The model's dims for the GPU plan (*d) and why this configuration cannot run on the GPU (why[0] != 0). */
static int dev_dims_check(const char *model_path, const specd_config *cfg, dev_dims *d, char *why, size_t n,
                          specd_err *err) {
    if ((is_dir(model_path) ? dims_hf(model_path, d, err) : dims_gguf(model_path, d, err)) < 0)
        return specd_err_wrap(err, "reading %s to plan GPU memory", model_path);
    cuda_unsupported(cfg, d, why, n);
    return 0;
}

/* The EAGLE-3 head next to a cuda target: whether it can run on the GPU
 * (why[0] != 0: no), the attention bounds it needs, and what it adds to the
 * arena: its weights (the files; a gathered LM head counted at f32), the
 * fixed part of its KV (the 256 blocks it has beyond the target's), its
 * workspace and the proposer's buffers for R rows / S sequences / k drafts
 * (fixed), and its KV per target token (its pool follows the target's).
 * With --enable-prefix-caching at TP 1 the head's feature pool is the device
 * feature cache (eagle3_opts.feat_cache: one row of n_aux x H f32 per target
 * KV slot, so prefix-cache hits of speculating sequences are taken): it is
 * counted per target KV token (feat_tok) instead of the fixed chunk pool. */
typedef struct draft_dims {
    char why[200];
    int64_t n_heads, head_dim;
    int64_t vocab; /* the draft vocabulary its device draws see (0: no part of the head on this rank) */
    size_t fixed, per_tok;
    size_t feat_tok; /* the device feature cache's bytes per target KV token (0: none) */
} draft_dims;

/* Whether the head on the target's device keeps the device feature cache (eagle3_opts.feat_cache): with prefix
 * caching and without tensor parallelism (the TP mirror of the proposer carries no block tables). */
static bool draft_feat_cache(const specd_config *cfg, int world) { return cfg->enable_prefix_caching && world <= 1; }

static int draft_plan(const specd_bundle *b, const specd_config *cfg, const dev_dims *d, int64_t R, int64_t S,
                      int32_t block, int rank, int world, draft_dims *dd, specd_err *err) {
    memset(dd, 0, sizeof *dd);
    eagle3_config ec;
    if (eagle3_config_load(b->spec.model, &ec, err)) return specd_err_wrap(err, "draft %s", b->spec.model);
    dd->n_heads = ec.n_heads;
    dd->head_dim = ec.head_dim;
    if (ec.head_dim > BK_CUDA_MAX_HEAD_DIM) { /* every rank decides this alike: it says whether eagle3_tp_load runs */
        snprintf(dd->why, sizeof dd->why, "its head_dim %d exceeds the CUDA attention kernel's %d", ec.head_dim,
                 BK_CUDA_MAX_HEAD_DIM);
        return 0;
    }
    /* at TP N on GPUs (draft/eagle3_tp.h eagle3_tp_load): a rank's shard when the head splits, else the whole
     * head on rank 0 and nothing on the workers */
    char nowhy[160];
    const bool q8 = cfg->draft_quantization && !strcmp(cfg->draft_quantization, "q8_0");
    const int64_t N = world > 1 && eagle3_tp_splits(&ec, world, q8, nowhy, sizeof nowhy) ? world : 1;
    if (world > 1 && N == 1 && rank > 0) return 0;
    int64_t files = 0;
    DIR *dp = opendir(b->spec.model);
    struct dirent *de;
    while (dp && (de = readdir(dp))) {
        const size_t n = strlen(de->d_name);
        char p[4096];
        if (n < 12 || strcmp(de->d_name + n - 12, ".safetensors")) continue;
        snprintf(p, sizeof p, "%s/%s", b->spec.model, de->d_name);
        const int64_t fb = file_bytes(p);
        files += fb > 0 ? fb : 0;
    }
    if (dp) closedir(dp);
    const int64_t nkv = N > 1 && ec.n_kv_heads % N ? 1 : ec.n_kv_heads / N;
    dd->n_heads = ec.n_heads / N;
    const int64_t H = ec.hidden, qd = dd->n_heads * ec.head_dim, kvd = nkv * ec.head_dim, I = ec.ffn / N;
    const int64_t Vd = ec.draft_vocab, featw = EAGLE3_MAX_AUX * d->hidden, rows = R > S ? R : S;
    /* the LM head's rows: 1/N when they divide (the logits then all-gathered: S x (1 + N) x Vd / N more) */
    const int64_t Vl = Vd % N ? Vd : Vd / N;
    const size_t kv_tok = 2 * (size_t)kvd * sizeof(float);
    const size_t ws = 4 * (size_t)rows * (size_t)(5 * H + 2 * qd + 2 * kvd + 2 * I) + 4096 +
                      (Vl < Vd ? 4 * (size_t)S * (size_t)(H + Vl * (1 + N)) : 0);
    /* this rank's matrices: 1/N of the files, plus the replicated fc; all of it when the LM head stays whole (an
     * upper bound: the head's other matrices are smaller than its LM head) */
    if (N > 1) files = Vl == Vd ? files : files / N + 2 * featw * H;
    /* + the feature pool (eagle3.h feat_chunks' default, chunks of `block` rows) the pending pairs' features wait in,
     * or the device feature cache: a row per target KV token (its aux layers' count, from the head's config) */
    int32_t aux_ids[EAGLE3_MAX_AUX];
    specd_err aerr = {{0}};
    const int32_t n_aux = eagle3_config_aux_layers(&ec, (int32_t)d->n_layers, EAGLE3_AUX_AUTO, 0, aux_ids, &aerr);
    if (draft_feat_cache(cfg, world))
        dd->feat_tok = 4 * (size_t)(n_aux > 0 ? n_aux : EAGLE3_MAX_AUX) * (size_t)d->hidden;
    const int64_t chunks = dd->feat_tok ? 0 : 2 * ((R + block - 1) / block + 1) + S * ((b->spec.k + 2 + block - 1) / block + 1);
    const size_t bufs = 4 * (size_t)R * (size_t)(featw + 2 * H + 2) + 4 * (size_t)S * (size_t)(2 * H + Vd + 1 + 17) +
                        4 * (size_t)(chunks * block) * (size_t)featw +
                        /* without TP: sampled drafts' q rows [k, S, Vd] kept for the device verifier, and t2d */
                        (N > 1 ? 0 : 4 * (size_t)(b->spec.k > 0 ? b->spec.k : 1) * (size_t)S * (size_t)Vd +
                                         4 * (size_t)d->vocab);
    dd->per_tok = kv_tok;
    dd->vocab = Vd;
    dd->fixed = (size_t)files + 4 * (size_t)Vl * (size_t)H + (size_t)(256 * block) * kv_tok + ws + bufs +
                4 * (size_t)Vd + ((size_t)4 << 20); /* + d2t, norms, alignment */
    return 0;
}

/* Chooses the backend (b->be, b->device) and, on cuda, the KV budget
 * (*kv_bytes) of tensor-parallel rank `rank` of `world` (0 of 1 without TP).
 *
 * At TP N on cuda every rank process runs this for itself: rank r opens
 * device r mod (the devices it sees; CUDA_VISIBLE_DEVICES applies), so K
 * ranks may share one GPU (how TP is tested on a one-GPU machine). The ranks
 * on one device split --gpu-memory-utilization's share of it evenly (each
 * plans util x total / K and keeps its own reserve: each process has its own
 * CUDA context); each plans its shard: weights / N plus the replicated
 * embedding (and DeepSeek-V3's replicated low-rank projections and routers),
 * its KV heads (MLA: the one latent, whole), its heads, its expert width.
 * The KV pools are then made equal (the smallest) by specd_tp_agree. CUDA graphs at TP > 1 with cuda_ipc or nccl
 * (bundle_tp_graphs), not with shm (host-staged collectives). A draft head is split like the target
 * (draft/eagle3_tp.h eagle3_tp_load): each rank plans its shard (its heads,
 * KV heads and MLP slice, its LM-head rows, its KV per token); when the
 * head's shapes do not divide, rank 0 plans the whole head and the workers
 * none. */
static int bundle_backend(const char *model_path, const specd_config *cfg, int rank, int world, specd_bundle *b,
                          int64_t *kv_bytes, specd_err *err) {
    const char *want = cfg->device ? cfg->device : "auto";
    const bool must = !strcmp(want, "cuda");
    char why[320] = "";
    /* fault injection (tests only): SPECD_FAULT_TP_DEVICE_FAIL=R makes rank R's device start fail here, on
     * any device, so the group's handling of a rank whose GPU does not start is testable without a GPU */
    const char *fault = getenv("SPECD_FAULT_TP_DEVICE_FAIL");
    if (world > 1 && fault && *fault && atoi(fault) == rank)
        return specd_err_set(err, "rank %d: device start failed (SPECD_FAULT_TP_DEVICE_FAIL)", rank);
    if (!strcmp(want, "cpu")) goto cpu;
    /* --device cuda: a configuration the GPU cannot run is refused before the probe (knowing it needs no GPU);
     * auto asks the GPU first, so a machine without one falls back without reading the model for a plan */
    dev_dims d = {0};
    if (must && dev_dims_check(model_path, cfg, &d, why, sizeof why, err) < 0) return -1;
    if (why[0]) return specd_err_set(err, "--device cuda: %s (use --device cpu)", why);
    const int n_dev = world > 1 ? bk_cuda_device_count() : 1;
    const int dev = n_dev > 0 ? rank % n_dev : 0;
    const int on_dev = n_dev > 0 ? world / n_dev + (dev < world % n_dev) : 1; /* ranks sharing this device */
    if (bk_cuda_probe(dev, why, sizeof why) != 0) {
        if (must)
            return world > 1 ? specd_err_set(err, "--device cuda: rank %d: no usable GPU (device %d): %s", rank, dev, why)
                             : specd_err_set(err, "--device cuda: no usable GPU: %s", why);
        LOG_INFO("device auto: cpu (no usable GPU: %s)", why);
        goto cpu;
    }
    if (!must) {
        if (dev_dims_check(model_path, cfg, &d, why, sizeof why, err) < 0) return -1;
        if (why[0]) {
            LOG_INFO("device auto: cpu (a GPU is usable, but %s)", why);
            goto cpu;
        }
    }
    size_t fr = 0, tot = 0;
    if (bk_cuda_mem_info(dev, &fr, &tot, err) < 0) return -1;
    const double util = cfg->gpu_memory_utilization > 0 ? cfg->gpu_memory_utilization : 0.9;
    const size_t budget = (size_t)(util * (double)tot) / (size_t)on_dev;
    if (budget > fr)
        return specd_err_set(err, "%s--gpu-memory-utilization %.2f asks for %.2f GiB%s, but only %.2f GiB of %.2f GiB "
                                  "are free on GPU %d (lower it, or free the GPU)",
                             world > 1 ? "rank " : "", util, (double)budget / (1 << 30),
                             on_dev > 1 ? " (its share of the GPU's ranks)" : "", (double)fr / (1 << 30),
                             (double)tot / (1 << 30), dev);
    if (world > 1) { /* this rank's shard (engine/model/tp_shard.c) */
        /* replicated on every rank: the embedding (f32 for a GGUF's K-quants; DeepSeek-V3's checkpoints are
         * bf16) and DeepSeek-V3's low-rank down-projections and routers (dev_dims.replicated) */
        const int64_t eb = d.vocab * d.hidden * (d.deepseek ? 2 : 4);
        const int64_t emb = eb + d.replicated < d.weight_bytes ? eb + d.replicated : d.weight_bytes;
        d.weight_bytes = (d.weight_bytes - emb) / world + emb;
        if (d.n_heads % world == 0) d.n_heads /= world;
        d.n_kv_heads = d.n_kv_heads % world == 0 ? d.n_kv_heads / world : 1; /* MLA: the one latent, replicated */
        if (d.ffn % world == 0) d.ffn /= world;
        if (d.deepseek) { /* every expert and the shared experts split inside (what tp_shard.c cannot cut it refuses) */
            /* expert parallel: E/N experts whole instead (moe_place holds E/N of width moe_inter; the weight bytes
             * above are the same files / N: the routed experts' share is (their bytes) / N either way) */
            if (cfg->enable_expert_parallel && d.experts % world == 0) d.experts_held /= world;
            else if (d.moe_inter % world == 0) d.moe_inter /= world;
            if (d.shared_inter % world == 0) d.shared_inter /= world;
        }
    }
    const int64_t max_len = cfg->max_model_len > 0 ? cfg->max_model_len : (d.max_pos > (1 << 24) ? 1 << 24 : d.max_pos);
    const int64_t T = cfg->max_num_batched_tokens, H = d.hidden, qd = d.n_heads * d.head_dim,
                  kvd = d.n_kv_heads * d.head_dim;
    int nb = graph_buckets(cfg, b->graph_buckets, 32, err);
    if (nb < 0) return -1;
    tp_comm_kind tk = TP_COMM_AUTO;
    if (world > 1 && nb > 0 && tp_comm_kind_parse(cfg->tp_comm, &tk, err) < 0) return -1;
    if (world > 1 && nb > 0 && tp_comm_kind_resolve(tk, false, world) == TP_COMM_SHM) {
        if (rank == 0)
            LOG_INFO("cuda graphs: off at --tensor-parallel-size %d with --tp-comm shm (its collectives are staged "
                     "through the host, which a graph cannot capture; cuda_ipc or nccl can): every step eager", world);
        nb = 0;
    }
    b->n_graph_buckets = nb;
    bk_cuda_opts o = {.device = dev,
                      .max_tokens = (int32_t)T,
                      .max_seqs = cfg->max_num_seqs + (nb ? 1 : 0), /* + the graphs' padding sequence */
                      .max_len = (int32_t)max_len,
                      .block_size = cfg->block_size > 0 ? cfg->block_size : 16,
                      .max_heads = (int32_t)d.n_heads,
                      .max_head_dim = (int32_t)d.head_dim,
                      .sample_vocab = (int32_t)d.vocab}; /* the device sampler's staging + scratch, carved at create */
    if (d.deepseek) { /* MLA scratch, the MoE routing + workspace for a full step: carved at create (fixed) */
        o.mla_kv_lora_rank = (int32_t)d.kv_lora;
        o.moe_experts = (int32_t)d.experts_held, o.moe_top_k = (int32_t)d.top_k;
        o.moe_hidden = (int32_t)H, o.moe_inter = (int32_t)d.moe_inter;
    }
    draft_dims dd = {0};
    b->draft_why[0] = '\0';
    if (b->spec.enabled) { /* the head shares the backend (at TP: this rank's shard): its bounds and memory join the plan */
        if (draft_plan(b, cfg, &d, T < 512 ? T : 512, cfg->max_num_seqs, o.block_size, rank, world, &dd, err) < 0)
            return -1;
        snprintf(b->draft_why, sizeof b->draft_why, "%s", dd.why);
        if (!dd.why[0]) {
            if (dd.n_heads > o.max_heads) o.max_heads = (int32_t)dd.n_heads;
            if (dd.head_dim > o.max_head_dim) o.max_head_dim = (int32_t)dd.head_dim;
            o.draw_vocab = (int32_t)dd.vocab; /* sampled drafts' draw scratch, carved at create */
        } else {
            dd.fixed = dd.per_tok = dd.feat_tok = 0;
        }
    }
    /* model.c: llama_forward's workspace and model_finish_outputs' ws_out for a full step, all rows output */
    /* DeepSeek-V3: deepseek_v3_fwd.c ds_ws_floats (the activations of MLA, the MoE's router logits and shared
     * expert, the row-gather index lists), per token */
    const int64_t dsw = d.ffn > d.shared_inter ? d.ffn : d.shared_inter, dD = d.kv_lora + d.qk_rope;
    const int64_t ds_tok = 4 * H + (d.q_lora > 0 ? d.q_lora : 1) + 2 * d.n_heads * (d.qk_nope + d.qk_rope) + dD +
                           2 * d.kv_lora + d.n_heads * (dD + 2 * d.kv_lora + d.v_head) + d.v_head + 2 * dsw +
                           d.experts + d.n_heads * (d.qk_nope + d.qk_rope + 1) + d.kv_lora + 2;
    const size_t ws = 4 * (size_t)T * (size_t)(d.deepseek ? ds_tok : 2 * H + 2 * qd + 2 * kvd + 2 * d.ffn + 1) +
                      4 * (size_t)T * (size_t)(1 + H + d.vocab) +
                      (b->spec.enabled ? 4 * (size_t)T * EAGLE3_MAX_AUX * (size_t)H : 0); /* aux capture */
    const size_t fixed = bk_cuda_fixed_bytes(&o), wb = (size_t)d.weight_bytes + ((size_t)d.weight_bytes >> 7) +
                                                       ((size_t)16 << 20); /* + norms, alignment */
    /* graphs: buckets x (decode, verify) x (per layer ~16 kernel nodes + the outputs') */
    int32_t len_classes[4];
    const size_t n_graphs = (size_t)nb * (b->spec.enabled ? 2 : 1) *
                            (size_t)model_graph_len_classes((int32_t)max_len, 0, len_classes); /* per length class */
    /* DeepSeek-V3: ~32 kernels per layer + 4 per head (the absorbed MLA's per-head GEMMs and copies) */
    const int64_t per_layer = d.deepseek ? 32 + 4 * d.n_heads : 16;
    size_t graphs = n_graphs * (size_t)(per_layer * d.n_layers + 8) * BUNDLE_CUDA_GRAPH_NODE;
    if (b->spec.enabled) /* the draft's chain graphs: per bucket one per k = 1..K (per length class for k >= 2) */
        graphs += eagle3_graphs_nodes(nb, b->spec.k > 0 ? b->spec.k : 1,
                                      model_graph_len_classes((int32_t)max_len, 0, len_classes)) *
                  BUNDLE_CUDA_GRAPH_NODE;
    if (nb && graphs < BUNDLE_CUDA_GRAPH_MIN) graphs = BUNDLE_CUDA_GRAPH_MIN;
    b->graph_reserve = graphs;
    const size_t need = BUNDLE_CUDA_RESERVE + graphs + wb + 2 * ws + fixed + dd.fixed;
    /* KV per token: K and V in f32; DeepSeek-V3's one latent plane in bf16 (model.c forces it on a device) */
    const size_t per_tok = (d.deepseek ? (size_t)d.n_layers * (size_t)kvd * 2 : (size_t)d.n_layers * 2 * (size_t)kvd * sizeof(float)) +
                           dd.per_tok + dd.feat_tok;
    if (!per_tok || d.n_heads <= 0 || d.head_dim <= 0 || H <= 0)
        return specd_err_set(err, "%s: layers %lld, heads %lld, head_dim %lld: cannot plan GPU memory", model_path,
                             (long long)d.n_layers, (long long)d.n_heads, (long long)d.head_dim);
    if (need >= budget || (budget - need) / per_tok < (size_t)max_len)
        return specd_err_set(err, "--gpu-memory-utilization %.2f (%.2f GiB) leaves %.2f GiB for the KV cache after "
                                  "weights %.2f GiB, workspace %.2f GiB and reserve %.2f GiB; %lld tokens of "
                                  "--max-model-len need %.2f GiB%s (raise the fraction, lower --max-model-len or "
                                  "--max-num-batched-tokens%s)",
                             util, (double)budget / (1 << 30), need >= budget ? 0.0 : (double)(budget - need) / (1 << 30),
                             (double)wb / (1 << 30), (double)(2 * ws + fixed) / (1 << 30),
                             (double)BUNDLE_CUDA_RESERVE / (1 << 30), (long long)max_len,
                             (double)per_tok * (double)max_len / (1 << 30),
                             dd.feat_tok ? ", the draft's device feature cache included (prefix caching)" : "",
                             dd.feat_tok ? ", or drop --enable-prefix-caching" : "");
    /* the KV tokens the rest holds; the target's pool gets its share, the head's (as many blocks + 256) the other */
    const int64_t kv_tokens = (int64_t)((budget - need) / per_tok);
    *kv_bytes = kv_tokens * (int64_t)(per_tok - dd.per_tok - dd.feat_tok);
    o.arena_bytes = budget - BUNDLE_CUDA_RESERVE - graphs;
    char who[96] = "";
    if (world > 1)
        snprintf(who, sizeof who, "rank %d/%d on GPU %d (%d rank%s there): ", rank, world, dev, on_dev,
                 on_dev > 1 ? "s share it" : "");
    LOG_INFO("%scuda plan: GPU %.2f GiB total, %.2f GiB free; --gpu-memory-utilization %.2f -> %.2f GiB%s: weights "
             "%.2f GiB (from the files%s), workspace %.2f GiB (%lld tokens/step, x2 for regrowth, + %.2f GiB metadata "
             "and attention scratch up to %lld positions), reserve %.2f GiB, graphs %.2f GiB (%zu: %s), draft head "
             "%.2f GiB + its KV %.2f GiB + its device feature cache %.2f GiB, KV %.2f GiB = %lld tokens",
             who, (double)tot / (1 << 30), (double)fr / (1 << 30), util, (double)budget / (1 << 30),
             on_dev > 1 ? " (this rank's share)" : "", (double)wb / (1 << 30), world > 1 ? ": this rank's shard" : "",
             (double)(2 * ws) / (1 << 30), (long long)T, (double)fixed / (1 << 30),
             (long long)max_len, (double)BUNDLE_CUDA_RESERVE / (1 << 30), (double)graphs / (1 << 30), n_graphs,
             nb ? "buckets x decode / verify" : world > 1 && !cfg->enforce_eager ? "TP shm: eager" : "--enforce-eager", (double)dd.fixed / (1 << 30),
             (double)kv_tokens * (double)dd.per_tok / (1 << 30), (double)kv_tokens * (double)dd.feat_tok / (1 << 30),
             (double)*kv_bytes / (1 << 30), (long long)kv_tokens);
    b->be = bk_cuda_create(&o, err);
    if (!b->be) return -1;
    b->device = "cuda";
    return 0;
cpu:
    b->be = bk_cpu_create(specd_tp_threads(cfg));
    if (!b->be) return specd_err_set(err, "cannot create the CPU backend");
    b->device = "cpu";
    *kv_bytes = cfg->kv_cache_memory;
    LOG_INFO("backend: %s", bk_cpu_describe(b->be));
    if (cfg->cuda_graph_sizes || cfg->enforce_eager)
        LOG_WARN("--%s has no effect on the cpu backend (every CPU step is eager)",
                 cfg->cuda_graph_sizes ? "cuda-graph-sizes" : "enforce-eager");
    return 0;
}

static void bundle_backend_destroy(backend *be) {
    if (!be) return;
    if (!strcmp(be->name, "cuda")) bk_cuda_destroy(be);
    else bk_cpu_destroy(be);
}

static int load_tokenizer(const char *model_path, const gguf_file *g, specd_bundle *b, specd_err *err) {
    if (g) return tok_create_from_gguf(g, &b->tok, err);
    /* HF directory: tokenizer.json, or a tiktoken ranks file (Kimi) */
    return tok_create_from_dir(model_path, &b->tok, err);
}

int specd_tokenizer_load(const char *model_path, const char *tokenizer_json, specd_bundle *b, specd_err *err) {
    memset(b, 0, sizeof *b);
    if (tokenizer_json) { /* tokenizer.json (HF), or a tiktoken ranks file (Kimi's tiktoken.model) */
        FILE *f = fopen(tokenizer_json, "rb");
        if (!f) return specd_err_set(err, "%s: cannot open", tokenizer_json);
        int c;
        while ((c = fgetc(f)) == ' ' || c == '\t' || c == '\n' || c == '\r') {}
        fclose(f);
        if (c == '{') return tok_create_from_hf(tokenizer_json, &b->tok, err);
        return tok_create_from_tiktoken(tokenizer_json, NULL, &b->tok, err);
    }
    if (is_dir(model_path)) return load_tokenizer(model_path, NULL, b, err);
    if (gguf_open(model_path, &b->tok_gguf, err)) return specd_err_wrap(err, "%s", model_path);
    return tok_create_from_gguf(b->tok_gguf, &b->tok, err);
}

/* After every rank chose its backend (a collective: rank 0 and the workers
 * call it at the same point of their start-up): all ranks must be on the
 * same kind of device (--device auto could resolve differently on a rank
 * whose GPU failed its probe), and on cuda the KV budget is the smallest
 * rank's (the scheduler's block ids are used on every rank, so every pool
 * must hold them; the ranks of a shared GPU or of GPUs of different sizes
 * plan different budgets). Then each rank opens its collectives on device
 * memory (--tp-comm; a collective over the host group for cuda_ipc / nccl)
 * and fills *mc. A rank that failed before this point has aborted the group,
 * so the others fail here with its reason instead of waiting. */
static int tp_agree(comm *c, const specd_config *cfg, backend *be, int64_t *kv_bytes, tp_dev_comm **dev,
                    model_comm *mc, specd_err *err) {
    const int world = comm_world(c), rank = comm_rank(c);
    const int64_t mine[2] = {be->host_visible ? 0 : 1, *kv_bytes};
    int64_t all[2 * COMM_MAX_WORLD];
    comm_set_timeout_ms(c, 0); /* ranks start at different speeds; a dead rank is still caught (monitor, pdeathsig) */
    int rc = comm_all_gather(c, mine, sizeof mine, all, err);
    comm_set_timeout_ms(c, comm_config_default().timeout_ms);
    if (rc < 0) return -1;
    for (int r = 0; r < world; r++) {
        if (all[2 * r] != all[0])
            return specd_err_set(err, "tensor parallel: rank %d runs on %s, rank 0 on %s (pass --device explicitly)", r,
                                 all[2 * r] ? "cuda" : "cpu", all[0] ? "cuda" : "cpu");
        if (all[0] && all[2 * r + 1] < *kv_bytes) *kv_bytes = all[2 * r + 1];
    }
    tp_comm_kind kind;
    if (tp_comm_kind_parse(cfg->tp_comm, &kind, err) < 0) return -1;
    if (tp_dev_comm_open(c, be, kind, dev, mc, err) < 0) return -1;
    if (rank == 0)
        LOG_INFO("tensor parallel: collectives %s (%s)%s", tp_comm_kind_name(tp_comm_kind_resolve(kind, be->host_visible, world)),
                 be->host_visible ? "host memory" : tp_dev_comm_kind(*dev) == TP_COMM_SHM ? "device memory staged through the host"
                                                                                        : "on device memory",
                 all[0] ? "; KV budget per rank: the smallest rank's" : "");
    return 0;
}

/* Every rank's weight bytes, KV bytes, KV blocks and block size
 * (TP_MEM_WORDS per rank), gathered after loading: workers call this at the
 * same point of their start-up (a collective). Ranks load at different
 * speeds, so no per-call timeout while it waits (a dead rank is still caught
 * by rank 0's monitor and PR_SET_PDEATHSIG). Every rank must have sized the
 * same KV pool: the scheduler's block ids are used on all of them. */
#define TP_MEM_WORDS SPECD_RANK_WORDS
static int tp_gather_memory(comm *c, const model *m, int64_t *out, specd_err *err) {
    model_shard_info si;
    model_get_shard(m, &si);
    model_load_info li;
    model_get_load_info(m, &li);
    int64_t mine[TP_MEM_WORDS] = {si.weight_bytes, si.kv_bytes, model_kv_n_blocks(m), model_kv_block_size(m),
                                  li.bytes_read, li.bytes_files, (int64_t)(li.seconds * 1e6), li.threads};
    if (!c) {
        memcpy(out, mine, sizeof mine);
        return 0;
    }
    comm_set_timeout_ms(c, 0);
    const int rc = comm_all_gather(c, mine, sizeof mine, out, err);
    comm_set_timeout_ms(c, comm_config_default().timeout_ms);
    if (rc < 0) return -1;
    for (int r = 1; r < comm_world(c); r++)
        if (out[TP_MEM_WORDS * r + 2] != out[2] || out[TP_MEM_WORDS * r + 3] != out[3])
            return specd_err_set(err, "tensor parallel: rank %d sized %lld KV blocks of %lld tokens, rank 0 %lld of %lld",
                                 r, (long long)out[TP_MEM_WORDS * r + 2], (long long)out[TP_MEM_WORDS * r + 3],
                                 (long long)out[2], (long long)out[3]);
    return 0;
}

/* The draft's options from the serve flags (rank 0 and the workers alike). */
static int draft_opts(const specd_config *cfg, eagle3_opts *eo, specd_err *err) {
    if (cfg->draft_aux_convention && eagle3_aux_convention_parse(cfg->draft_aux_convention, &eo->aux_ids_convention, err))
        return specd_err_wrap(err, "--draft-aux-convention");
    eo->q8_0 = cfg->draft_quantization && !strcmp(cfg->draft_quantization, "q8_0");
    eo->hot_vocab = cfg->speculative_token_map;
    return 0;
}

/* A worker's draft calls (draft/eagle3_tp.h): the CPU split's forward calls, or on GPU ranks the mirrored
 * proposer calls. */
static int worker_draft(void *ctx, const int32_t *msg, size_t n, specd_err *err) {
    return eagle3_tp_serve((eagle3_head *)ctx, msg, n, err);
}
typedef struct worker_prop {
    spec_proposer *p;
    model *m;
} worker_prop;
static int worker_mirror(void *ctx, const int32_t *msg, size_t n, specd_err *err) {
    const worker_prop *w = ctx;
    return eagle3_tp_serve_proposer(w->p, w->m, msg, n, err);
}

/* The options of a head on the target's device backend (rank 0 and the GPU workers alike: the buffers are
 * sized the same on every rank, so their proposers stay in step). */
static void draft_dev_opts(const specd_config *cfg, int32_t k, eagle3_opts *eo) {
    eo->max_rows = cfg->max_num_batched_tokens < 512 ? cfg->max_num_batched_tokens : 512;
    eo->max_seqs = cfg->max_num_seqs;
    eo->max_k = k;
    eo->aux_rows = cfg->max_num_batched_tokens; /* the target's aux stays on the device (counted in the ws) */
}

int specd_tp_threads(const specd_config *cfg) {
    if (cfg->threads > 0 || cfg->tensor_parallel_size <= 1) return cfg->threads;
    const long n = sysconf(_SC_NPROCESSORS_ONLN) / cfg->tensor_parallel_size;
    return n > 0 ? (int)n : 1; /* --threads 0 at TP N: the cores shared among the N ranks */
}

/* The largest step rank 0 can post (tp.h) for sequences of up to LEN
 * tokens: the token arrays and out_idx of a full token budget plus a block
 * table per running sequence (no tree mask: chain drafting). The channel is
 * sized at launch, before the model's context length is known (LEN = the
 * flag, else 2^17); once it is, specd_bundle_load refuses a configuration
 * whose steps would not fit. */
static size_t tp_step_bytes(const specd_config *cfg, int64_t len) {
    const int64_t bs = cfg->block_size > 0 ? cfg->block_size : 16;
    const int64_t words = 16 + 4 * (int64_t)cfg->max_num_batched_tokens + (int64_t)cfg->max_num_seqs * (len / bs + 2);
    return (size_t)words * 4;
}

static int tp_launch(const specd_config *cfg, const char *const *worker_argv, specd_bundle *b, specd_err *err) {
    const int N = cfg->tensor_parallel_size;
    if (!worker_argv) return specd_err_set(err, "--tensor-parallel-size %d: this command runs one process only", N);
    ranks_config rc = {.world = N, .worker_argv = worker_argv, .comm = comm_config_default(), .attach_timeout_ms = 60000};
    const size_t need = tp_step_bytes(cfg, cfg->max_model_len > 0 ? cfg->max_model_len : 1 << 17);
    rc.comm.step_max_bytes = need > (1 << 20) ? need : 1 << 20;
    if (ranks_launch(&rc, &b->rk, err) < 0) return specd_err_wrap(err, "starting %d tensor-parallel ranks", N);
    tp_model_comm_shm(ranks_comm(b->rk), &b->tp_comm);
    LOG_INFO("tensor parallel: %d ranks (rank 0 = this process, pid %d; workers started)", N, (int)getpid());
    return 0;
}

int specd_bundle_tp_shutdown(specd_bundle *b, specd_err *err) {
    if (!b->rk) return 0;
    engine_destroy(b->eng); /* no step may be posted once the workers are told to go */
    b->eng = NULL;
    const int rc = ranks_shutdown(b->rk, 10000, err);
    tp_dev_comm_close(b->tp_dev); /* its watchdog reads the host group: before that goes */
    b->tp_dev = NULL;
    ranks_destroy(b->rk);
    b->rk = NULL;
    return rc;
}

int specd_bundle_tp_failed(specd_bundle *b, char *why, size_t cap) {
    if (!b->rk) return 0;
    return comm_aborted(ranks_comm(b->rk), why, cap);
}

/* The target's graph options, the same on every TP rank (the same graphs in the same order: their collectives
 * pair up); q: [2] storage. aux (rank 0's draft features) only adds local copies to the graphs. */
static model_graph_opts bundle_graph_opts(const specd_config *cfg, const specd_spec *spec, const int32_t *buckets,
                                          int nb, int32_t max_len, int32_t n_aux, const int32_t *aux, int32_t *q) {
    q[0] = 1, q[1] = spec->enabled ? spec->k + 1 : 1;
    return (model_graph_opts){.buckets = buckets, .n_buckets = nb, .q = q, .n_q = spec->enabled && spec->k > 0 ? 2 : 1,
                              .n_aux = n_aux, .aux_layers = aux, .max_step_tokens = cfg->max_num_batched_tokens,
                              .max_seqs = cfg->max_num_seqs + 1, .max_tokens = cfg->max_num_batched_tokens,
                              .max_len = max_len}; /* length classes: short steps replay short grids (F8) */
}

/* TP > 1, every rank at the same point of its start-up (after the model and the draft): capture, then agree
 * (tp_graphs_agree). A capture failure on any rank leaves every rank eager with the reason logged: returns 0
 * (off), 1 (on), -1 only when the group failed. */
static int bundle_tp_graphs(comm *c, model *m, const model_graph_opts *go, int rank, specd_err *err) {
    specd_err ce = {{0}};
    const int ok = model_graphs_capture(m, go, &ce) == 0;
    char why[320];
    const int on = tp_graphs_agree(c, m, ok, ce.msg, why, sizeof why, err);
    if (on < 0) return specd_err_wrap(err, "agreeing on the CUDA graphs of the ranks");
    if (!on && rank == 0) LOG_WARN("cuda graphs: off on every rank (%s): every step eager", why);
    return on;
}

/* Captures the target's CUDA graphs (model_graphs_capture) once the model and its draft are loaded and
 * before the engine reads the KV pool (the padding block leaves it). A failure is a refusal to start at TP 1;
 * at TP > 1 it turns graphs off on every rank (bundle_tp_graphs). */
/* The target layers whose input a device draft (proposer `p`, NULL: none) reads: aux[0 .. return) (at most 8),
 * which the target's graphs must capture; -1 with the reason for a count out of range. */
static int32_t draft_graph_aux(const spec_proposer *p, int32_t aux[8], specd_err *err) {
    const int32_t n = p && p->ops->aux_layers ? p->ops->aux_layers(p->ctx, aux) : 0;
    if (n < 0 || n > 8) return specd_err_set(err, "draft: %d aux layers", n);
    return n;
}

static int bundle_graphs(const specd_config *cfg, specd_bundle *b, specd_err *err) {
    int32_t aux[8];
    const int32_t n_aux = draft_graph_aux(b->proposer, aux, err);
    if (n_aux < 0) return -1;
    int32_t q[2];
    model_graph_opts go = bundle_graph_opts(cfg, &b->spec, b->graph_buckets, b->n_graph_buckets, b->max_model_len,
                                            n_aux, aux, q);
    size_t f0 = 0, f1 = 0, tot = 0;
    if (bk_cuda_mem_info(0, &f0, &tot, err) < 0) return -1;
    if (b->rk) {
        const int on = bundle_tp_graphs(ranks_comm(b->rk), b->m, &go, 0, err);
        if (on <= 0) return on;
    } else if (model_graphs_capture(b->m, &go, err) < 0) {
        return specd_err_wrap(err, "capturing CUDA graphs (--enforce-eager runs without them)");
    }
    if (bk_cuda_mem_info(0, &f1, &tot, err) < 0) return -1;
    model_graph_stats st;
    model_graph_get_stats(b->m, &st);
    char list[256];
    size_t o = 0;
    for (int i = 0; i < b->n_graph_buckets && o < sizeof list; i++)
        o += (size_t)snprintf(list + o, sizeof list - o, "%s%d", i ? "," : "", b->graph_buckets[i]);
    LOG_INFO("cuda graphs: %d captured (buckets %s x %d token%s per sequence%s), %.1f MiB of device memory "
             "(planned %.1f MiB); KV pool %d blocks (1 kept for padding rows)",
             st.n_graphs, list, q[go.n_q - 1], go.n_q > 1 ? "s and 1" : "", n_aux ? ", with aux" : "",
             (double)(f0 > f1 ? f0 - f1 : 0) / (1 << 20), (double)b->graph_reserve / (1 << 20),
             model_kv_n_blocks(b->m));
    if (f0 > f1 && f0 - f1 > b->graph_reserve)
        LOG_WARN("cuda graphs took %.1f MiB, more than the %.1f MiB planned: lower --gpu-memory-utilization or "
                 "use --cuda-graph-sizes with fewer buckets", (double)(f0 - f1) / (1 << 20),
                 (double)b->graph_reserve / (1 << 20));
    const int64_t kv_tokens = (int64_t)model_kv_n_blocks(b->m) * model_kv_block_size(b->m);
    if (kv_tokens < b->max_model_len)
        return specd_err_set(err, "the KV pool holds %lld tokens after the graphs' padding block, fewer than "
                                  "--max-model-len %d", (long long)kv_tokens, b->max_model_len);
    /* the head's chain draft loop (on the target's device only): the same buckets, k steps; an optimisation, so
     * a failure leaves the eager chain with a warning */
    if (b->proposer && !b->draft_be && b->spec.k > 0 && !b->rk) {
        specd_err ge = {0};
        const eagle3_graph_opts dgo = {.buckets = b->graph_buckets, .n_buckets = b->n_graph_buckets, .k = b->spec.k,
                                       .max_len = b->max_model_len}; /* the target's length classes */
        size_t d0 = 0, d1 = 0;
        if (bk_cuda_mem_info(0, &d0, &tot, err) < 0) return -1;
        if (eagle3_graphs_capture(b->proposer, &dgo, &ge) < 0) {
            LOG_WARN("draft: the chain draft loop runs eagerly: %s", ge.msg);
        } else {
            if (bk_cuda_mem_info(0, &d1, &tot, err) < 0) return -1;
            eagle3_graph_stats ds;
            eagle3_graph_get_stats(b->proposer, &ds);
            LOG_INFO("draft: chain draft loop captured as %d CUDA graphs (buckets %s x k = 1..%d x %d length "
                     "class%s), %.1f MiB of device memory; greedy proposes of any k <= %d replay one",
                     ds.n_graphs, list, b->spec.k, ds.n_classes, ds.n_classes > 1 ? "es" : "",
                     (double)(d0 > d1 ? d0 - d1 : 0) / (1 << 20), b->spec.k);
        }
    }
    return 0;
}

/* --enable-expert-parallel needs TP > 1 and a mixture-of-experts model whose routed experts the ranks divide:
 * refused here, before any rank starts (the model's loader refuses the same at load: tp_shard.c). */
static int ep_check(const char *model_path, const specd_config *cfg, specd_err *err) {
    if (!cfg->enable_expert_parallel) return 0;
    const int N = cfg->tensor_parallel_size;
    if (N <= 1)
        return specd_err_set(err, "--enable-expert-parallel splits the routed experts across the tensor-parallel "
                                  "ranks: it needs --tensor-parallel-size > 1 (got %d)", N);
    if (!is_dir(model_path))
        return specd_err_set(err, "--enable-expert-parallel: %s is a GGUF file, loaded as a dense llama model; expert "
                                  "parallelism needs a mixture-of-experts model (DeepSeek-V3 / Kimi)", model_path);
    hf_config hc;
    if (hf_config_load(model_path, &hc, err) < 0) return specd_err_wrap(err, "--enable-expert-parallel");
    const int E = hc.arch != MODEL_ARCH_LLAMA && hc.first_k_dense < hc.n_layers ? hc.n_routed_experts : 0;
    if (E <= 0)
        return specd_err_set(err, "--enable-expert-parallel: %s has no routed experts (a dense %s model); expert "
                                  "parallelism needs a mixture-of-experts model (DeepSeek-V3 / Kimi)", model_path,
                             hc.model_type);
    if (E % N)
        return specd_err_set(err, "--enable-expert-parallel: --tensor-parallel-size %d does not divide the %d routed "
                                  "experts of %s (each rank holds E/N whole experts)", N, E, model_path);
    return 0;
}

int specd_bundle_load(const char *model_path, const specd_config *cfg, const char *const *worker_argv,
                      specd_bundle *b, specd_err *err) {
    memset(b, 0, sizeof *b);
    if (specd_config_resolve(cfg, &b->spec, err)) return -1;
    if (ep_check(model_path, cfg, err) < 0) return -1;
    if (cfg->tensor_parallel_size > 1 && tp_launch(cfg, worker_argv, b, err) < 0) goto fail;
    int64_t kv_bytes = cfg->kv_cache_memory;
    if (bundle_backend(model_path, cfg, 0, b->rk ? cfg->tensor_parallel_size : 1, b, &kv_bytes, err) < 0) goto fail;
    if (b->rk && tp_agree(ranks_comm(b->rk), cfg, b->be, &kv_bytes, &b->tp_dev, &b->tp_comm, err) < 0) goto fail;
    model_load_opts mo = {.block_size = cfg->block_size, .kv_bytes = kv_bytes, .n_blocks = 0,
                          .tp = b->rk ? &b->tp_comm : NULL, .load_threads = cfg->load_threads,
                          .expert_parallel = cfg->enable_expert_parallel};
    if (model_load(model_path, b->be, &mo, &b->m, err)) {
        specd_err_wrap(err, "loading %s", model_path);
        goto fail;
    }
    if (!strcmp(b->device, "cuda"))
        LOG_INFO("backend: %s after loading (%.2f GiB of the arena used)", bk_cuda_describe(b->be),
                 (double)bk_cuda_arena_used(b->be) / (1 << 30));
    b->n_ranks = b->rk ? cfg->tensor_parallel_size : 1;
    if (tp_gather_memory(b->rk ? ranks_comm(b->rk) : NULL, b->m, b->rank_mem, err) < 0) {
        specd_err_wrap(err, "gathering the ranks' memory");
        goto fail;
    }
    for (int r = 0; r < b->n_ranks; r++)
        LOG_INFO("rank %d memory: weights %.1f MiB, KV cache %.1f MiB", r,
                 (double)b->rank_mem[TP_MEM_WORDS * r] / (1 << 20), (double)b->rank_mem[TP_MEM_WORDS * r + 1] / (1 << 20));
    const model_config *mc = model_get_config(b->m);
    if (load_tokenizer(model_path, model_gguf(b->m), b, err)) {
        specd_err_wrap(err, "tokenizer of %s", model_path);
        goto fail;
    }
    b->max_model_len = cfg->max_model_len > 0 ? cfg->max_model_len : mc->max_pos;
    if (cfg->max_model_len > mc->max_pos)
        LOG_WARN("--max-model-len %d exceeds the model's trained context %d", cfg->max_model_len, mc->max_pos);
    int64_t kv_tokens = (int64_t)model_kv_n_blocks(b->m) * model_kv_block_size(b->m);
    if (kv_tokens < b->max_model_len) {
        specd_err_set(err,
                      "--kv-cache-memory %lld bytes holds %lld tokens, fewer than --max-model-len %d "
                      "(raise --kv-cache-memory or lower --max-model-len)",
                      (long long)cfg->kv_cache_memory, (long long)kv_tokens, b->max_model_len);
        goto fail;
    }
    LOG_INFO("max_model_len %d (KV pool holds %lld tokens)", b->max_model_len, (long long)kv_tokens);
    if (b->rk && tp_step_bytes(cfg, b->max_model_len) > comm_step_max_bytes(ranks_comm(b->rk))) {
        specd_err_set(err, "--tensor-parallel-size: a step of %d sequences of up to %d tokens would not fit the %zu-byte "
                           "step channel (set --max-model-len)", cfg->max_num_seqs, b->max_model_len,
                      comm_step_max_bytes(ranks_comm(b->rk)));
        goto fail;
    }
    if (b->spec.enabled) {
        eagle3_opts eo = {0};
        if (draft_opts(cfg, &eo, err) < 0) goto fail;
        if (!b->be->host_visible && b->draft_why[0]) {
            /* the fallback: a head the GPU cannot run computes on a CPU backend of its own; it reads the
             * target's embedding / LM head from their host views (engine/model model.h) */
            if (!(b->draft_be = bk_cpu_create(cfg->threads))) {
                specd_err_set(err, "cannot create the draft's CPU backend");
                goto fail;
            }
            eo.be = b->draft_be;
            LOG_INFO("draft: on the CPU backend (%s) next to the %s target, because %s", bk_cpu_describe(b->draft_be),
                     b->device, b->draft_why);
        } else if (!b->be->host_visible) {
            /* on the target's backend: weights, KV and buffers in the arena (planned in bundle_backend), the
             * target's placed embedding shared, argmax + d2t on the device, one download of ids per propose */
            draft_dev_opts(cfg, b->spec.k, &eo);
            /* with prefix caching: the feature pool is the device feature cache (planned per KV token in
             * bundle_backend), so prefix-cache hits of speculating sequences are taken; not at TP */
            eo.feat_cache = draft_feat_cache(cfg, b->rk ? cfg->tensor_parallel_size : 1);
            LOG_INFO("draft: on the %s backend with its target%s", b->device,
                     eo.feat_cache ? ", its feature pool the device feature cache (prefix caching)"
                     : cfg->enable_prefix_caching ? "; no device feature cache at tensor parallelism: prefix-cache "
                                                    "hits are not taken for speculating sequences"
                                                  : "");
        }
        if (b->rk && !b->be->host_visible && !b->draft_be) {
            /* every GPU rank loads its shard and runs the proposer on it, rank 0 mirroring the engine's calls
             * (draft/eagle3_tp.h eagle3_tp_load; a collective, as the workers' specd_tp_worker_main), or the
             * whole head on rank 0's GPU when its shapes do not divide */
            char why[160] = "";
            const int split = eagle3_tp_load(b->spec.model, b->m, &eo, ranks_comm(b->rk), &b->tp_comm, &b->proposer,
                                             why, sizeof why, err);
            if (split < 0) {
                specd_err_wrap(err, "draft %s", b->spec.model);
                goto fail;
            }
            if (split) LOG_INFO("draft head split across the %d GPU ranks (features on each rank's device)",
                                cfg->tensor_parallel_size);
            else LOG_INFO("draft head whole on rank 0's GPU (%s)", why);
        } else if (eagle3_load(b->spec.model, b->m, &eo, &b->proposer, err)) {
            specd_err_wrap(err, "draft %s", b->spec.model);
            goto fail;
        }
        LOG_INFO("draft: %s (%s), k = %d%s", b->spec.model, b->spec.method, b->spec.k,
                 b->spec.adaptive ? " at most (adaptive)" : " (fixed)");
        if (b->rk && b->be->host_visible) { /* split like the target, or whole on rank 0 when its shapes do not divide */
            char why[160] = "";
            const int split = eagle3_head_tp_shard(eagle3_proposer_head(b->proposer), ranks_comm(b->rk), &b->tp_comm,
                                                   why, sizeof why, err);
            if (split < 0) goto fail;
            if (!split) LOG_INFO("draft head whole on rank 0 (%s)", why);
        }
    } else {
        if (cfg->draft_aux_convention && strcmp(cfg->draft_aux_convention, "auto"))
            LOG_WARN("--draft-aux-convention %s has no effect without a draft", cfg->draft_aux_convention);
        if (cfg->draft_quantization && strcmp(cfg->draft_quantization, "none"))
            LOG_WARN("--draft-quantization %s has no effect without a draft", cfg->draft_quantization);
        if (cfg->speculative_token_map)
            LOG_WARN("--speculative-token-map %s has no effect without a draft", cfg->speculative_token_map);
    }
    if (!strcmp(b->device, "cuda") && b->n_graph_buckets > 0 && bundle_graphs(cfg, b, err) < 0) goto fail;
    engine_config ec = {.max_model_len = b->max_model_len,
                        .max_num_seqs = cfg->max_num_seqs,
                        .max_num_batched_tokens = cfg->max_num_batched_tokens,
                        .max_waiting = cfg->max_waiting,
                        .max_queue_time_s = cfg->max_queue_time,
                        .enable_prefix_caching = cfg->enable_prefix_caching,
                        .num_speculative_tokens = b->spec.enabled ? b->spec.k : 0,
                        .spec_adaptive = b->spec.enabled && b->spec.adaptive};
    if (b->rk) { /* rank 0 posts every step to the workers before running its own shard */
        b->tp_run = (tp_runner){b->m, ranks_comm(b->rk), b->tp_dev};
        ec.forward = tp_runner_forward;
        ec.forward_ctx = &b->tp_run;
        ec.forward_logits_dev = true; /* a device target samples on the device at TP too (logits gathered there) */
        ec.forward_aux_dev = true;    /* and its draft reads the aux rows each rank captures on its device */
    }
    if (engine_create(&ec, b->m, b->tok, &b->eng, err)) {
        specd_err_wrap(err, "engine");
        goto fail;
    }
    if (b->proposer && engine_set_proposer(b->eng, b->proposer, err)) goto fail;
    return 0;
fail:
    if (b->rk) { /* the workers stop at once, not after the drain timeout */
        tp_dev_comm_abort(b->tp_dev, err->msg);
        comm_abort(ranks_comm(b->rk), err->msg);
    }
    specd_bundle_free(b);
    return -1;
}

void specd_bundle_free(specd_bundle *b) {
    if (!b) return;
    engine_destroy(b->eng);
    if (b->rk) { /* drain the workers (they exit on the shutdown message) before the model goes */
        specd_err err = {{0}};
        if (ranks_shutdown(b->rk, 10000, &err) < 0) LOG_WARN("tensor parallel shutdown: %s", err.msg);
        /* after the workers are gone (no collective pending), before the host group (its watchdog reads it) */
        tp_dev_comm_close(b->tp_dev);
        b->tp_dev = NULL;
        ranks_destroy(b->rk);
        b->rk = NULL;
    }
    eagle3_destroy(b->proposer); /* after the engine (which calls it), before the model (which it borrows) */
    if (b->draft_be) bk_cpu_destroy(b->draft_be);
    tok_destroy(b->tok);
    gguf_close(b->tok_gguf);
    model_destroy(b->m);
    bundle_backend_destroy(b->be);
    specd_spec_free(&b->spec);
    memset(b, 0, sizeof *b);
}

int specd_check_config(const char *model_path, const specd_config *cfg, specd_err *err) {
    specd_spec spec;
    if (specd_config_resolve(cfg, &spec, err)) return -1;
    int rc = -1;
    auth *a = NULL;
    specd_bundle b;
    memset(&b, 0, sizeof b);
    if (cfg->device && !strcmp(cfg->device, "cuda")) { /* the GPU half of the start-up refusal (bundle_backend) */
        char why[320];
        if (bk_cuda_probe(0, why, sizeof why) != 0) {
            specd_err_set(err, "--device cuda: no usable GPU: %s", why);
            goto done;
        }
    }
    if (access(model_path, R_OK)) {
        specd_err_set(err, "model %s: not readable", model_path);
        goto done;
    }
    if (ep_check(model_path, cfg, err) < 0) goto done;
    if (auth_create(cfg->api_key, cfg->api_key_file, &a, err)) goto done;
    if (specd_tokenizer_load(model_path, NULL, &b, err)) {
        specd_err_wrap(err, "model %s", model_path);
        goto done;
    }
    if (b.tok_gguf) {
        int64_t ctx = 0;
        char key[160];
        const char *arch = NULL;
        size_t al = 0;
        if (gguf_get_str(b.tok_gguf, "general.architecture", &arch, &al, err)) goto done;
        snprintf(key, sizeof key, "%.*s.context_length", (int)al, arch);
        if (!gguf_get_i64(b.tok_gguf, key, &ctx, NULL) && cfg->max_model_len > ctx)
            LOG_WARN("--max-model-len %d exceeds the model's trained context %lld", cfg->max_model_len, (long long)ctx);
    }
    if (spec.model) {
        char p[4096];
        snprintf(p, sizeof p, "%s/config.json", spec.model);
        if (!is_dir(spec.model) || access(p, R_OK)) {
            specd_err_set(err, "draft %s: not a directory with a readable config.json", spec.model);
            goto done;
        }
        /* pairing: the head must read this target's hidden states and vocabulary */
        eagle3_config ec;
        if (eagle3_config_load(spec.model, &ec, err)) {
            specd_err_wrap(err, "draft %s", spec.model);
            goto done;
        }
        if (ec.target_vocab != tok_vocab_size(b.tok)) {
            specd_err_set(err, "draft %s expects a target vocabulary of %d tokens, the model has %d", spec.model,
                          ec.target_vocab, tok_vocab_size(b.tok));
            goto done;
        }
        if (cfg->speculative_token_map && eagle3_hot_vocab_check(cfg->speculative_token_map, tok_vocab_size(b.tok), err)) {
            specd_err_wrap(err, "--speculative-token-map");
            goto done;
        }
        if (b.tok_gguf) {
            const char *arch = NULL;
            size_t al = 0;
            int64_t hidden = 0, layers = 0;
            char key[160];
            if (!gguf_get_str(b.tok_gguf, "general.architecture", &arch, &al, NULL)) {
                snprintf(key, sizeof key, "%.*s.embedding_length", (int)al, arch);
                if (!gguf_get_i64(b.tok_gguf, key, &hidden, NULL) && hidden != ec.target_hidden) {
                    specd_err_set(err, "draft %s expects target hidden size %d, the model has %lld", spec.model,
                                  ec.target_hidden, (long long)hidden);
                    goto done;
                }
                snprintf(key, sizeof key, "%.*s.block_count", (int)al, arch);
                int32_t aux[8];
                eagle3_aux_convention conv = EAGLE3_AUX_AUTO;
                if (cfg->draft_aux_convention &&
                    eagle3_aux_convention_parse(cfg->draft_aux_convention, &conv, err) != 0) {
                    specd_err_wrap(err, "--draft-aux-convention");
                    goto done;
                }
                if (!gguf_get_i64(b.tok_gguf, key, &layers, NULL)) {
                    int n = eagle3_config_aux_layers(&ec, (int32_t)layers, conv, 0, aux, err);
                    if (n < 0) {
                        specd_err_wrap(err, "draft %s vs a %lld-layer target", spec.model, (long long)layers);
                        goto done;
                    }
                    char ids[96];
                    int o = 0;
                    for (int i = 0; i < n && o < (int)sizeof ids - 12; i++)
                        o += snprintf(ids + o, sizeof ids - (size_t)o, "%s%d", i ? ", " : "", aux[i]);
                    LOG_INFO("draft %s: aux layers {%s} (input convention)", spec.model, ids);
                }
            }
        }
    }
    if (cfg->max_num_batched_tokens < cfg->max_num_seqs)
        LOG_WARN("--max-num-batched-tokens %d < --max-num-seqs %d: not every running sequence fits in one step",
                 cfg->max_num_batched_tokens, cfg->max_num_seqs);
    rc = 0;
done:
    auth_destroy(a);
    tok_destroy(b.tok);
    gguf_close(b.tok_gguf);
    specd_spec_free(&spec);
    return rc;
}

/* ------------------------------------------------------------ tensor-parallel worker */

int specd_tp_worker_main(int argc, char **argv) {
    ranks_worker w;
    specd_err err = {{0}};
    if (ranks_worker_detect(argc, argv, &w, &err) != 1) {
        fprintf(stderr, "specd worker: %s\n", err.msg[0] ? err.msg : "not a worker command line");
        return 2;
    }
    /* systemd and a terminal signal the whole group: a worker stops only when
     * rank 0 drains it (or dies: PR_SET_PDEATHSIG, ranks.h) */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    /* rank 0's argv: specd serve MODEL flags... without the comm arguments */
    char **args = calloc((size_t)argc + 1, sizeof *args);
    int n = 0;
    for (int i = 2; i < argc; i++)
        if (strncmp(argv[i], "--specd-comm-", 13)) args[n++] = argv[i];
    specd_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg_table t;
    specd_config_table(&cfg, &t);
    const char *pos[2];
    size_t n_pos = 0;
    bool help = false;
    comm *c = NULL;
    specd_bundle wb; /* this rank's backend (bundle_backend's fields) */
    memset(&wb, 0, sizeof wb);
    tp_dev_comm *dev = NULL;
    model *m = NULL;
    eagle3_head *head = NULL;
    spec_proposer *dprop = NULL; /* GPU ranks: this rank's mirrored proposer (eagle3_tp_load) */
    worker_prop wp = {0};
    int rc = 1;
    if (!args || argc < 2 || strcmp(argv[1], "serve") || cfg_defaults(&t, 1, &err) ||
        cfg_apply_env(&t, 1, NULL, &err) || cfg_parse_args(&t, 1, n, args, pos, 2, &n_pos, &help, &err) ||
        n_pos != 1) {
        fprintf(stderr, "specd worker rank %d: bad command line: %s\n", w.rank, err.msg);
        goto out;
    }
    if (ranks_worker_attach(&w, &c, &err) < 0) {
        fprintf(stderr, "specd worker rank %d: %s\n", w.rank, err.msg);
        goto out;
    }
    if (cfg.log_level)
        log_set_level(!strcmp(cfg.log_level, "debug") ? LOG_LVL_DEBUG
                      : !strcmp(cfg.log_level, "warn") ? LOG_LVL_WARN
                      : !strcmp(cfg.log_level, "error") ? LOG_LVL_ERROR
                                                        : LOG_LVL_INFO);
    /* the same backend choice and plan as rank 0's for this rank (device rank mod the GPUs seen), then the
     * agreement on the device kind and the KV pool, and the collectives (tp_agree: a collective) */
    model_comm mc;
    int64_t kv_bytes = cfg.kv_cache_memory;
    if (specd_config_resolve(&cfg, &wb.spec, &err) < 0 ||
        bundle_backend(pos[0], &cfg, w.rank, w.world, &wb, &kv_bytes, &err) < 0 ||
        tp_agree(c, &cfg, wb.be, &kv_bytes, &dev, &mc, &err) < 0) {
        LOG_ERROR("specd worker rank %d: %s", w.rank, err.msg);
        comm_abort(c, err.msg); /* the group's reason: "rank R: ..." */
        goto out;
    }
    model_load_opts mo = {.block_size = cfg.block_size, .kv_bytes = kv_bytes, .tp = &mc, .load_threads = cfg.load_threads,
                          .expert_parallel = cfg.enable_expert_parallel};
    if (model_load(pos[0], wb.be, &mo, &m, &err) < 0) {
        char why[COMM_REASON_MAX];
        snprintf(why, sizeof why, "loading the shard: %.200s", err.msg);
        LOG_ERROR("specd worker rank %d: %s", w.rank, why);
        tp_dev_comm_abort(dev, why);
        comm_abort(c, why);
        goto out;
    }
    int64_t all_mem[TP_MEM_WORDS * 64];
    if (tp_gather_memory(c, m, all_mem, &err) < 0) {
        LOG_ERROR("specd worker rank %d: %s", w.rank, err.msg);
        goto out;
    }
    LOG_INFO("tensor parallel rank %d/%d (pid %d): serving on %s", w.rank, w.world, (int)getpid(), wb.device);
    /* the draft head's shard: loaded and split exactly as rank 0 does (eagle3_tp.h), or none (the shapes do
     * not divide: whole on rank 0; a head the GPU cannot run: on rank 0's CPU, bundle_backend's draft_why) */
    specd_spec spec;
    memset(&spec, 0, sizeof spec);
    if (specd_config_resolve(&cfg, &spec, &err) < 0) goto fail_worker;
    if (spec.enabled && !wb.be->host_visible && !wb.draft_why[0]) { /* GPU ranks: the mirrored proposer */
        eagle3_opts eo = {0};
        char why[160] = "";
        if (draft_opts(&cfg, &eo, &err) < 0) goto fail_worker;
        draft_dev_opts(&cfg, wb.spec.k, &eo);
        if (eagle3_tp_load(spec.model, m, &eo, c, &mc, &dprop, why, sizeof why, &err) < 0) goto fail_worker;
    } else if (spec.enabled && wb.be->host_visible) {
        eagle3_opts eo = {0};
        char why[160] = "";
        if (draft_opts(&cfg, &eo, &err) < 0 || eagle3_head_load_for(spec.model, m, &eo, &head, &err) < 0) goto fail_worker;
        const int split = eagle3_head_tp_shard(head, c, &mc, why, sizeof why, &err);
        if (split < 0) goto fail_worker;
        if (!split) { /* whole on rank 0: this rank has no part in it */
            eagle3_head_destroy(head);
            head = NULL;
        }
    }
    specd_spec_free(&spec);
    if (!strcmp(wb.device, "cuda") && wb.n_graph_buckets > 0) { /* rank 0's bundle_graphs at the same point */
        /* a device draft shard reads the aux rows from this rank's own buffer: its graphs capture them too */
        int32_t aux[8];
        const int32_t n_aux = draft_graph_aux(dprop, aux, &err);
        if (n_aux < 0) { /* the group's reason, as rank 0's bundle_graphs refuses */
            LOG_ERROR("specd worker rank %d: %s", w.rank, err.msg);
            comm_abort(c, err.msg);
            goto out;
        }
        int32_t q[2];
        const int32_t max_len = cfg.max_model_len > 0 ? cfg.max_model_len : model_get_config(m)->max_pos;
        const model_graph_opts go = bundle_graph_opts(&cfg, &wb.spec, wb.graph_buckets, wb.n_graph_buckets, max_len,
                                                      n_aux, n_aux ? aux : NULL, q);
        if (bundle_tp_graphs(c, m, &go, w.rank, &err) < 0) {
            LOG_ERROR("specd worker rank %d: %s", w.rank, err.msg);
            goto out;
        }
    }
    if (dprop) wp = (worker_prop){dprop, m};
    if (tp_worker_run_dev(c, m, dev, head ? worker_draft : dprop ? worker_mirror : NULL, head ? (void *)head : &wp,
                          &err) == 0)
        rc = 0;
    else LOG_ERROR("specd worker rank %d: %s", w.rank, err.msg);
    goto out;
fail_worker:
    specd_spec_free(&spec);
    LOG_ERROR("specd worker rank %d: draft head: %s", w.rank, err.msg);
    comm_abort(c, err.msg);
out:
    eagle3_head_destroy(head);
    eagle3_destroy(dprop); /* before the model it borrows */
    model_destroy(m);
    tp_dev_comm_close(dev);
    bundle_backend_destroy(wb.be);
    specd_spec_free(&wb.spec);
    comm_destroy(c);
    specd_config_free(&cfg);
    free(args);
    return rc;
}
