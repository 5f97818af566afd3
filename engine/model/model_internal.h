/* model_internal.h: the model struct shared by model.c and the architecture
 * files (llama.c, later deepseek_v3.c). Not a public header. */
#ifndef SPECD_MODEL_INTERNAL_H
#define SPECD_MODEL_INTERNAL_H

#include "engine/model/model.h"

struct dsv3_state;                    /* deepseek_v3.h */

typedef struct llama_layer {
    float *attn_norm, *ffn_norm;      /* f32 [H] */
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
    float *out_norm;                  /* f32 [H] */
    llama_layer *layers;              /* [n_layers] */
    float *inv_freq;                  /* f32 [head_dim/2]: theta^(-2i/d) */
    void **owned;                     /* converted weight copies, freed at destroy */
    int n_owned;
    struct dsv3_state *ds;            /* DeepSeek-V3 weights and MLA state (NULL for llama) */
    /* Paged KV storage: per layer kv_planes planes (2: K then V; 1: the MLA latent,
     * used as both K and V), each [n_blocks, block_size, nkv, hd] f32. */
    int32_t kv_planes;
    float *kv;
    int32_t block_size, n_blocks;
    size_t kv_layer_elems;            /* elements of one layer's K (= of V) */
    /* grow-only activation workspace */
    float *ws;
    size_t ws_cap;
};

float *model_workspace(model *m, size_t n_floats);
bk_kv_layer model_kv_layer(model *m, int32_t layer);
/* Final norm + LM head for b->out_idx rows of the residual stream x [T, H]. */
int model_finish_outputs(model *m, const model_batch *b, const float *x, specd_err *err);
tp_style model_linear_parallel(const char *gguf_name);

int llama_load_gguf(model *m, specd_err *err);
int llama_forward(model *m, const model_batch *b, specd_err *err);

/* deepseek_v3.c: loads the HF directory m->path (config already parsed). */
struct hf_config;
int dsv3_load(model *m, const struct hf_config *hc, specd_err *err);
int dsv3_forward(model *m, const model_batch *b, specd_err *err);
void dsv3_free(struct dsv3_state *s); /* NULL ok */

#endif
