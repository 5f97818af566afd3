/*
 * extract.c: `specd extract`: one prefill pass per conversation that writes
 * what EAGLE-3 training needs (tools/train_eagle3/FORMAT.md, format
 * specd-eagle3-dump-v1): token ids, the assistant loss mask, the aux hidden
 * states (residual stream ENTERING the aux layers, concatenated low/mid/high)
 * and the final normed hidden state (target logits are recomputed by the
 * trainer from the tied LM head instead of storing 49K floats per token).
 *
 * Owns: the model, tokenizer and shard buffers of one run.
 * Invariants: samples are numbered in input order among accepted lines;
 * a shard is written to a temporary name and renamed into place, then the
 * manifest is rewritten: a crash loses at most the shard in progress and a
 * rerun resumes after the last complete shard (the manifest says how many).
 * Threading: single-threaded driver; the backend parallelises inside ops.
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "draft/extract_cli.h"
#include "engine/loader/safetensors.h"
#include "engine/model/model.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/util/log.h"

#define EX_CHUNK 256 /* tokens per forward pass (bounds the workspace) */

typedef struct ex_sample {
    int32_t *ids;   /* [T] */
    uint8_t *mask;  /* [T] */
    uint16_t *aux;  /* bf16 [T, n_aux*H] */
    float *fin;     /* f32 [T, H] */
    int64_t T;
} ex_sample;

typedef struct ex_run {
    const char *out_dir;
    model *m;
    tokenizer *tok;
    int32_t aux_layers[3];
    int64_t H;
    ex_sample *shard;           /* samples of the shard in progress */
    int n_shard, shard_cap;
    int64_t first_sample;       /* global index of shard[0] */
    json_t *shards;             /* manifest "shards" array */
    int64_t n_samples, n_tokens, n_loss;
} ex_run;

static void sample_free(ex_sample *s) {
    free(s->ids); free(s->mask); free(s->aux); free(s->fin);
}

static int write_manifest(ex_run *r, specd_err *err) {
    const model_config *c = model_get_config(r->m);
    json_t *man = json_pack("{s:s, s:{s:s, s:i, s:i, s:i}, s:[i,i,i], s:s, s:s, s:I, s:I, s:I, s:O}",
                            "format", "specd-eagle3-dump-v1", "target", "name", c->name, "n_layers", c->n_layers,
                            "hidden_size", c->hidden, "vocab_size", c->vocab, "aux_layer_ids", r->aux_layers[0],
                            r->aux_layers[1], r->aux_layers[2], "aux_layer_convention", "input", "aux_dtype", "bf16",
                            "n_samples", (json_int_t)r->n_samples, "n_tokens", (json_int_t)r->n_tokens,
                            "n_loss_tokens", (json_int_t)r->n_loss, "shards", r->shards);
    if (!man) return specd_err_set(err, "manifest: out of memory");
    char tmp[4096], fin[4096];
    snprintf(tmp, sizeof tmp, "%s/manifest.json.tmp", r->out_dir);
    snprintf(fin, sizeof fin, "%s/manifest.json", r->out_dir);
    int rc = json_dump_file(man, tmp, JSON_INDENT(1));
    json_decref(man);
    if (rc != 0 || rename(tmp, fin) != 0) return specd_err_set(err, "cannot write %s: %s", fin, strerror(errno));
    return 0;
}

static int flush_shard(ex_run *r, specd_err *err) {
    if (r->n_shard == 0) return 0;
    const int n = r->n_shard;
    st_write_tensor *t = calloc((size_t)n * 4, sizeof *t);
    int64_t *shapes = calloc((size_t)n * 8, sizeof *shapes);
    char (*names)[48] = calloc((size_t)n * 4, 48);
    int rc = -1;
    if (!t || !shapes || !names) { specd_err_set(err, "out of memory"); goto done; }
    int64_t ntok = 0;
    for (int i = 0; i < n; i++) {
        ex_sample *s = &r->shard[i];
        int64_t gi = r->first_sample + i, *sh = shapes + (size_t)i * 8;
        static const char *suffix[4] = {"input_ids", "loss_mask", "aux_hidden", "final_hidden"};
        for (int k = 0; k < 4; k++) snprintf(names[i * 4 + k], 48, "s%08lld.%s", (long long)gi, suffix[k]);
        sh[0] = s->T; sh[1] = s->T; sh[2] = s->T; sh[3] = 3 * r->H; sh[4] = s->T; sh[5] = r->H;
        t[i * 4 + 0] = (st_write_tensor){names[i * 4 + 0], ST_I32, 1, sh + 0, s->ids};
        t[i * 4 + 1] = (st_write_tensor){names[i * 4 + 1], ST_U8, 1, sh + 1, s->mask};
        t[i * 4 + 2] = (st_write_tensor){names[i * 4 + 2], ST_BF16, 2, sh + 2, s->aux};
        t[i * 4 + 3] = (st_write_tensor){names[i * 4 + 3], ST_F32, 2, sh + 4, s->fin};
        ntok += s->T;
    }
    int shard_idx = (int)json_array_size(r->shards);
    char file[64], path[4096], first[32], count[32];
    snprintf(file, sizeof file, "shard_%05d.safetensors", shard_idx);
    snprintf(path, sizeof path, "%s/%s", r->out_dir, file);
    snprintf(first, sizeof first, "%lld", (long long)r->first_sample);
    snprintf(count, sizeof count, "%d", n);
    const char *meta[] = {"format", "specd-eagle3-dump-v1", "first_sample", first, "n_samples", count, NULL};
    if (st_write(path, t, (size_t)n * 4, meta, err) < 0) goto done; /* st_write: temp file + rename */
    json_array_append_new(r->shards, json_pack("{s:s, s:I, s:i, s:I}", "file", file, "first_sample",
                                               (json_int_t)r->first_sample, "n_samples", n, "n_tokens", (json_int_t)ntok));
    if (write_manifest(r, err) < 0) goto done;
    for (int i = 0; i < n; i++) sample_free(&r->shard[i]);
    r->first_sample += n;
    r->n_shard = 0;
    rc = 0;
done:
    free(t); free(shapes); free(names);
    return rc;
}

/* Runs the target over ids [T] in chunks; fills aux (bf16) and fin (f32). */
static int run_sample(ex_run *r, ex_sample *s, specd_err *err) {
    const int64_t H = r->H, T = s->T;
    float *aux = malloc(sizeof(float) * EX_CHUNK * 3 * (size_t)H);
    int32_t *pos = malloc(sizeof(int32_t) * EX_CHUNK), *seq = calloc(EX_CHUNK, sizeof(int32_t));
    int32_t *oi = malloc(sizeof(int32_t) * EX_CHUNK);
    int32_t nb = model_kv_n_blocks(r->m);
    int32_t *bt = malloc(sizeof(int32_t) * (size_t)nb);
    int rc = -1;
    if (!aux || !pos || !seq || !oi || !bt) { specd_err_set(err, "out of memory"); goto done; }
    for (int32_t i = 0; i < nb; i++) bt[i] = i;
    const int32_t *bts[1] = {bt};
    for (int64_t c0 = 0; c0 < T; c0 += EX_CHUNK) {
        int32_t n = (int32_t)(T - c0 < EX_CHUNK ? T - c0 : EX_CHUNK);
        for (int32_t i = 0; i < n; i++) { pos[i] = (int32_t)(c0 + i); oi[i] = i; }
        model_batch b = {.n_tokens = n, .tokens = s->ids + c0, .pos = pos, .seq_of = seq, .n_seqs = 1,
                         .block_tables = bts, .n_out = n, .out_idx = oi, .final_hidden = s->fin + c0 * H,
                         .n_aux = 3, .aux_layers = r->aux_layers, .aux = aux};
        if (model_forward(r->m, &b, err) < 0) goto done;
        for (int64_t i = 0; i < (int64_t)n * 3 * H; i++) s->aux[c0 * 3 * H + i] = specd_f32_to_bf16(aux[i]);
    }
    rc = 0;
done:
    free(aux); free(pos); free(seq); free(oi); free(bt);
    return rc;
}

static void usage(void) {
    fprintf(stderr,
            "usage: specd extract --target MODEL.gguf|HF_DIR --data CONVS.jsonl [--data MORE.jsonl ...] --out DUMP_DIR\n"
            "         [--max-seq-len 2048] [--shard-samples 128] [--num-samples N] [--threads N]\n"
            "  One prefill pass per conversation ({\"messages\": [...]} lines, chat template applied);\n"
            "  writes token ids, the assistant loss mask, aux hidden states entering layers\n"
            "  {2, N/2, N-3} (bf16) and the final normed hidden state (f32) as safetensors shards\n"
            "  (tools/train_eagle3/FORMAT.md). Rerun the same command to resume.\n");
}

int extract_main(int argc, char **argv) {
    const char *target = NULL, *out = NULL, *datas[16];
    int n_data = 0;
    long max_len = 2048, shard_samples = 128, num_samples = -1, threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(); return 0; }
        if (!v) { usage(); return 2; }
        if (!strcmp(a, "--target")) target = v;
        else if (!strcmp(a, "--data")) {
            if (n_data == 16) { fprintf(stderr, "specd extract: at most 16 --data files\n"); return 2; }
            datas[n_data++] = v;
        }
        else if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--max-seq-len")) max_len = strtol(v, NULL, 10);
        else if (!strcmp(a, "--shard-samples")) shard_samples = strtol(v, NULL, 10);
        else if (!strcmp(a, "--num-samples")) num_samples = strtol(v, NULL, 10);
        else if (!strcmp(a, "--threads")) threads = strtol(v, NULL, 10);
        else { fprintf(stderr, "specd extract: unknown flag %s\n", a); usage(); return 2; }
        i++;
    }
    if (!target || !n_data || !out || max_len < 2 || max_len > (1 << 20) || shard_samples < 1) { usage(); return 2; }
    specd_err err = {{0}};
    backend *be = bk_cpu_create((int)threads);
    ex_run r = {.out_dir = out};
    FILE *f = NULL;
    int rc = 1;
    char *line = NULL;
    size_t cap = 0;
    if (mkdir(out, 0755) != 0 && errno != EEXIST) { fprintf(stderr, "specd extract: %s: %s\n", out, strerror(errno)); goto done; }
    model_load_opts mo = {.block_size = 16, .n_blocks = (int32_t)((max_len + 15) / 16)};
    if (!be || model_load(target, be, &mo, &r.m, &err) < 0 ||
        (model_gguf(r.m) ? tok_create_from_gguf(model_gguf(r.m), &r.tok, &err)
                         : tok_create_from_dir(target, &r.tok, &err)) < 0) { /* GGUF, or an HF directory */
        fprintf(stderr, "specd extract: %s\n", err.msg);
        goto done;
    }
    const model_config *c = model_get_config(r.m);
    r.H = c->hidden;
    r.aux_layers[0] = 2; r.aux_layers[1] = c->n_layers / 2; r.aux_layers[2] = c->n_layers - 3;
    r.shards = json_array();
    r.shard = calloc((size_t)shard_samples, sizeof *r.shard);
    r.shard_cap = (int)shard_samples;
    /* resume: the manifest lists complete shards */
    char mpath[4096];
    snprintf(mpath, sizeof mpath, "%s/manifest.json", out);
    int64_t skip = 0;
    json_t *old = json_load_file(mpath, 0, NULL);
    if (old) {
        json_t *sh = json_object_get(old, "shards");
        if (json_is_array(sh)) { json_decref(r.shards); r.shards = json_incref(sh); }
        r.n_samples = skip = json_integer_value(json_object_get(old, "n_samples"));
        r.n_tokens = json_integer_value(json_object_get(old, "n_tokens"));
        r.n_loss = json_integer_value(json_object_get(old, "n_loss_tokens"));
        r.first_sample = skip;
        json_decref(old);
        LOG_INFO("extract: resuming after %lld samples", (long long)skip);
    }
    int64_t lineno = 0, accepted = 0, skipped = 0, new_tokens = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    /* Files are read in the order given; samples are numbered across them, so a
     * resumed run must list the same files in the same order (files may grow). */
    for (int fi = 0; fi < n_data; fi++) {
    const char *data = datas[fi];
    if (f) fclose(f);
    lineno = 0;
    f = fopen(data, "r");
    if (!f) { fprintf(stderr, "specd extract: %s: %s\n", data, strerror(errno)); goto done; }
    while (getline(&line, &cap, f) > 0) {
        lineno++;
        if (num_samples >= 0 && accepted >= num_samples) break;
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        json_t *msgs = o ? json_object_get(o, "messages") : NULL;
        size_t nm = json_array_size(msgs);
        if (!o || !json_is_array(msgs) || nm == 0 || nm > 256) {
            fprintf(stderr, "specd extract: %s:%lld: not a {\"messages\": [...]} line, skipped\n", data, (long long)lineno);
            json_decref(o);
            skipped++;
            continue;
        }
        chat_message cm[256] = {{0}};
        int bad = 0;
        for (size_t i = 0; i < nm; i++) {
            json_t *mm = json_array_get(msgs, i);
            cm[i].role = json_string_value(json_object_get(mm, "role"));
            cm[i].content = json_string_value(json_object_get(mm, "content"));
            cm[i].name = NULL;
            if (!cm[i].role || !cm[i].content) bad = 1;
        }
        int32_t *ids = NULL;
        uint8_t *mask = NULL;
        size_t n = 0;
        chat_options co = {.add_generation_prompt = false, .thinking = -1, .default_system = NULL};
        if (bad || tok_chat_encode(r.tok, cm, nm, &co, &ids, &n, &mask, &err) < 0 || n < 2 || (long)n > max_len) {
            if (bad) fprintf(stderr, "specd extract: %s:%lld: message without role/content, skipped\n", data, (long long)lineno);
            else if ((long)n > max_len) fprintf(stderr, "specd extract: %s:%lld: %zu tokens > --max-seq-len, skipped\n", data, (long long)lineno, n);
            else fprintf(stderr, "specd extract: %s:%lld: %s\n", data, (long long)lineno, err.msg);
            free(ids); free(mask);
            json_decref(o);
            skipped++;
            continue;
        }
        json_decref(o);
        if (accepted++ < skip) { free(ids); free(mask); continue; } /* already in a complete shard */
        ex_sample s = {.ids = ids, .mask = mask, .T = (int64_t)n};
        s.aux = malloc(sizeof(uint16_t) * n * 3 * (size_t)r.H);
        s.fin = malloc(sizeof(float) * n * (size_t)r.H);
        if (!s.aux || !s.fin || run_sample(&r, &s, &err) < 0) {
            fprintf(stderr, "specd extract: %s:%lld: %s\n", data, (long long)lineno, err.msg[0] ? err.msg : "out of memory");
            sample_free(&s);
            goto done;
        }
        int64_t nl = 0;
        for (size_t i = 0; i < n; i++) nl += mask[i] != 0;
        r.shard[r.n_shard++] = s;
        r.n_samples++;
        r.n_tokens += (int64_t)n;
        r.n_loss += nl;
        new_tokens += (int64_t)n;
        if (r.n_shard == r.shard_cap) {
            if (flush_shard(&r, &err) < 0) { fprintf(stderr, "specd extract: %s\n", err.msg); goto done; }
            clock_gettime(CLOCK_MONOTONIC, &t1);
            double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
            LOG_INFO("extract: %lld samples, %lld tokens (%.0f tokens/s)", (long long)r.n_samples, (long long)r.n_tokens,
                     (double)new_tokens / dt);
        }
    }
    }
    if (flush_shard(&r, &err) < 0) { fprintf(stderr, "specd extract: %s\n", err.msg); goto done; }
    if (write_manifest(&r, &err) < 0) { fprintf(stderr, "specd extract: %s\n", err.msg); goto done; }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("extract: %lld samples (%lld skipped lines), %lld tokens, %lld loss tokens; this run %lld tokens in %.1f s "
           "(%.0f tokens/s)\n", (long long)r.n_samples, (long long)skipped, (long long)r.n_tokens, (long long)r.n_loss,
           (long long)new_tokens, dt, dt > 0 ? (double)new_tokens / dt : 0.0);
    rc = 0;
done:
    if (f) fclose(f);
    free(line);
    for (int i = 0; i < r.n_shard; i++) sample_free(&r.shard[i]);
    free(r.shard);
    json_decref(r.shards);
    tok_destroy(r.tok);
    model_destroy(r.m);
    bk_cpu_destroy(be);
    return rc;
}
