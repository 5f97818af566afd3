/* model_internal.h: the model struct shared by model.c and the architecture
 * files (llama.c, later deepseek_v3.c). Not a public header. */
#ifndef SPECD_MODEL_INTERNAL_H
#define SPECD_MODEL_INTERNAL_H

#include "engine/model/model.h"

struct dsv3_state;                    /* deepseek_v3.h */

typedef struct llama_layer {
    float *attn_norm, *ffn_norm;      /* f32 [H], host (load) */
    bk_tensor attn_norm_t, ffn_norm_t; /* the same in backend memory [1, H] (model_place) */
    bk_weight wq, wk, wv, wo;         /* [nh*hd, H], [nkv*hd, H] x2, [H, nh*hd] */
    bk_weight wgate, wup, wdown;      /* [ffn, H] x2, [H, ffn] */
} llama_layer;

struct model {
    model_config cfg;
    char path[1024];
    backend *be;
    gguf_file *gguf;                  /* owned, NULL for HF directories */
    bk_weight embed;                  /* [vocab, H] */
    bk_weight lm_head;                /* [vocab, H] (== embed when tied) */
    float *out_norm;                  /* f32 [H], host (load) */
    bk_tensor out_norm_t;             /* [1, H] backend memory (model_place) */
    llama_layer *layers;              /* [n_layers] */
    float *inv_freq;                  /* f32 [rot_dim/2]: theta^(-2i/d) (or YaRN), host */
    bk_tensor inv_freq_t;             /* [1, rot_dim/2] backend memory */
    bk_tensor *placed;                /* backend copies made by model_place (freed at destroy) */
    int n_placed;
    void **owned;                     /* converted weight copies, freed at destroy */
    int n_owned;
    struct dsv3_state *ds;            /* DeepSeek-V3 weights and MLA state (NULL for llama) */
    /* Paged KV storage in backend memory: per layer kv_planes planes (2: K then
     * V; 1: the MLA latent, used as both K and V), each [n_blocks, block_size,
     * nkv, hd] f32. */
    int32_t kv_planes;
    bool kv_bf16;                     /* the planes hold bf16 (DeepSeek-V3's latent by default), else f32 */
    float *kv;
    int32_t block_size, n_blocks;
    size_t kv_layer_elems;            /* elements of one layer's K (= of V) */
    /* Activation workspace in backend memory, f32: grow-only (the largest
     * step seen so far; after the first steps of the largest size nothing is
     * allocated). A backend that must not allocate during steps (CUDA graphs)
     * sizes it by running its largest step before serving. */
    float *ws;
    size_t ws_cap;                    /* floats */
    float *ws_out;                    /* model_finish_outputs' own region, grow-only */
    size_t ws_out_cap;
    /* Tensor parallelism (tp_shard.c). TP 1: tp == NULL, the local sizes equal the config's. */
    const model_comm *tp;
    int32_t tp_rank, tp_size;
    int32_t nh_l, nkv_l, kv_h0;       /* local q heads, local KV heads, first global KV head held */
    int32_t ffn_l;                    /* local MLP width */
    int32_t vocab_l;                  /* LM-head rows held (vocab / size when split, else vocab) */
    bool vocab_split;                 /* LM head vocabulary-parallel (logits all-gathered) */
    bool ep;                          /* expert parallelism asked (model_load_opts.expert_parallel) */
    int32_t ex0, ex_n;                /* DeepSeek-V3: routed experts this rank holds, [ex0, ex0 + ex_n) (model_ep_range) */
    int32_t ex_w;                     /* their width held (moe_intermediate, or / N when split inside) */
    bk_weight lm_head_full;           /* the whole LM head as loaded (a view), for a draft that shares it */
    bk_weight embed_host, lm_head_host; /* embed / lm_head as loaded (host views), kept by model_place for a
                                          draft head on a host backend next to a device target */
    int64_t weight_bytes;             /* this rank's weight bytes (after slicing) */
    /* CUDA graphs (model_graph.c): the captured steps, NULL when none. A graph
     * step runs llama_forward in three phases (MODEL_PH_*): the uploads, the
     * kernels (captured once, replayed after), the downloads; eager steps run
     * all three in one call (ph == 0). */
    struct model_graphs *gr;
    int ph;                           /* MODEL_PH_* bits of the current call; 0 = all */
    void *ph_dev;                     /* the backend's step metadata, kept from the upload phase to the download */
    int32_t ph_rows_down;             /* download phase of a graph step: rows of aux / logits that are real */
    int32_t kv_pad_blocks;            /* KV blocks past n_blocks kept for graph padding rows (model_graph.c) */
    /* The EAGLE-3 aux capture's fixed device buffer (model_aux_reserve): F32 [rows, aux_n * H], data NULL
     * when none (host-visible backends: the caller's host array is written in place). */
    bk_tensor aux_dev;
    int32_t aux_n;
    int32_t aux_layers[8];
    /* Loading (model_load, load_plan.c): the options and this rank's figures. */
    unsigned load_st_flags;           /* st_open_ex flags (the test aid ST_OPEN_POISON) */
    int32_t load_threads;             /* reader threads (0: st_load_threads_default) */
    bool load_lazy;                   /* no reads up front: the mapping faults pages in as the views are used */
    int32_t load_row_min;             /* model_load_opts.load_row_min */
    model_load_info load_info;
};

#define MODEL_PH_UP 1   /* ids, step metadata, output indices to the backend */
#define MODEL_PH_RUN 2  /* the ops (what a graph captures) */
#define MODEL_PH_DOWN 4 /* aux, logits to the host; the metadata released */
#define MODEL_PH_ALL 7

/* A graph step instead of the eager forward: 0 done, -1 failed, 1 = no
 * captured graph fits b (run it eagerly). model_graph.c. */
int model_graph_forward(model *m, const model_batch *b, specd_err *err);

/* Workspace of at least n_floats floats in backend memory (grow-only; NULL on
 * allocation failure). Earlier contents are not kept when it grows. */
float *model_workspace(model *m, size_t n_floats);
/* The same for model_finish_outputs' region (ws_out). */
float *model_workspace_out(model *m, size_t n_floats);

/* Makes the loaded weights, norms and RoPE frequencies backend-resident
 * (weight_place; norms wrapped on host-visible backends, uploaded otherwise).
 * Called once by model_load after the architecture loader. */
int model_place(model *m, specd_err *err);
/* A backend tensor [1, n] of host floats: a zero-copy wrap on host-visible
 * backends, else an upload (owned by the model). */
int model_vec_place(model *m, float *host, int64_t n, bk_tensor *out, specd_err *err);
bk_kv_layer model_kv_layer(model *m, int32_t layer);
/* Final norm + LM head for b->out_idx rows of the residual stream x [T, H]
 * (backend memory); writes b->logits / b->final_hidden (host). */
int model_finish_outputs(model *m, const model_batch *b, const bk_tensor *x, specd_err *err);
/* The batch's token ids [T, 1] as a backend tensor (zero copy on
 * host-visible backends; else uploaded into ids_buf, I32 backend memory of at
 * least T entries). */
bk_tensor model_ids(model *m, const model_batch *b, int32_t *ids_buf);

/* The step's attention metadata for phase ph (model_graph.c's MODEL_PH_* bits): the upload phase
 * meta_uploads b's positions, sequence index, block tables and tree mask for T tokens and records
 * the device copy in m->ph_dev; a later phase of the same step reuses that copy. am is filled
 * either way. -1 with the reason when the upload fails. */
int model_step_meta(model *m, const model_batch *b, int32_t T, int ph, bk_attn_meta *am, specd_err *err);
tp_style model_linear_parallel(const char *gguf_name);

int llama_load_gguf(model *m, specd_err *err);
/* A zeroed host allocation freed with the model (converted weight copies). */
void *model_own(model *m, size_t bytes);

/* tp_shard.c: plans this rank's share from the config (refusing TP sizes
 * that do not divide what must be divided, with the reason) and slices the
 * loaded Llama weights to it; TP 1 just fills the local sizes. Called by
 * model_load after the architecture loader, before the KV pool is sized. */
int model_tp_shard(model *m, specd_err *err);
/* Column-parallel slice: rows [r0, r0 + n) of w (a view; I4G32 scales follow). */
void model_slice_rows(bk_weight *w, int64_t r0, int64_t n);
/* Row-parallel slice: input columns [c0, c0 + n) of every row, an owned copy
 * (I4G32: packed words and group scales); refused (with WHAT and the TP size
 * in the message) when a 32-value block would be cut. The source's pages of
 * the mapped file are released. */
int model_slice_cols(model *m, const char *what, bk_weight *w, int64_t c0, int64_t n, specd_err *err);
/* deepseek_v3.c: slices every layer to this rank (m->tp_rank of m->tp_size):
 * q_b / kv_b by heads (and the absorbed per-head blocks), o_proj by its input
 * columns, dense MLP and shared experts column/row, each routed expert split
 * inside (gate/up rows, down columns); latent path, router and norms
 * replicated. Refuses sizes that do not divide with the reason. */
int dsv3_tp_slice(model *m, specd_err *err);
/* Bytes of this rank's DeepSeek-V3 layer weights (int4 group scales included). */
int64_t dsv3_weight_bytes(const model *m);
/* Sum of x over the ranks (after a row-parallel linear); no-op at TP 1. */
int model_tp_all_reduce(model *m, bk_tensor *x, specd_err *err);
/* tp_shard.c: the routed experts rank m->tp of N holds, from E experts, into m->ex0 / m->ex_n: with
 * expert parallelism [r E/N, (r+1) E/N) (refused, -1 with the reason, when E is 0 or N does not divide it),
 * else all of them. Called by the DeepSeek-V3 loader and the load plan before any expert is read. */
int model_ep_range(model *m, int32_t E, specd_err *err);
int llama_forward(model *m, const model_batch *b, specd_err *err);
/* Whether b's aux capture goes to the reserved buffer m->aux_dev (same layers, rows enough). */
bool model_aux_fixed(const model *m, const model_batch *b);

/* load_plan.c: opens m->path's safetensors (st_open_ex with m->load_st_flags) for an architecture loader
 * and, unless m->load_lazy, reads this rank's byte ranges of it with m->load_threads readers first
 * (filling m->load_info's read figures). -1 with the file named when a read fails. */
struct st_model;
struct hf_config;
int model_st_open(model *m, const struct hf_config *hc, struct st_model **out, specd_err *err);
double model_now_s(void); /* CLOCK_MONOTONIC seconds */

/* deepseek_v3.c: loads the HF directory m->path (config already parsed). */
struct hf_config;
int dsv3_load(model *m, const struct hf_config *hc, specd_err *err);
int dsv3_forward(model *m, const model_batch *b, specd_err *err);
/* Workspace floats dsv3_forward takes for a T-token step with n_aux aux layers on a device backend (the
 * graphs' pre-sizing: model_graph.c). */
size_t dsv3_workspace_floats(const model *m, int32_t T, int32_t n_aux);
void dsv3_free(struct dsv3_state *s); /* NULL ok */
/* deepseek_v3.c: makes the layers' weights, norms and router biases backend-resident (model_place's
 * DeepSeek-V3 part; the routed experts through moe_place where the backend has it). */
int dsv3_place(model *m, specd_err *err);
void dsv3_unplace(model *m); /* frees what moe_place put in backend memory (model_destroy) */
int32_t dsv3_rope_dim(const struct dsv3_state *s); /* qk_rope_head_dim: the rotated dims per head */

#endif
