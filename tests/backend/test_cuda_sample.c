/*
 * test_cuda_sample.c (label unit, no GPU): sampling on the device, end to end
 * through the engine, on the FAKE CUDA device (cuda_fake.c).
 *
 * The scenarios are tests/backend/engine_gen.h's (eg_scenarios). Two
 * engines over the HF Llama miniature ($MODEL_HF_MINI_DIR/f32, vocab 512):
 * the reference on the CPU backend (logits sampled on the host, zero copies,
 * the path every CPU test covers) and one on the fake device with
 * engine_runner.sample_be set, so the logits stay on the "device", the engine
 * describes each row (bk_sample_row, bk_verify_seq) and bk_ops.sample returns
 * only the ids and accepted counts. Checked, scenario by scenario, token for
 * token and logprob for logprob (bitwise): greedy; seeded sampling with
 * temperature, top-k, top-p, min-p, presence / frequency / repetition
 * penalties, logit_bias, min_tokens (EOS suppressed) at n = 2 (one prompt,
 * seeds s and s + 1, as the server expands n); logprobs (greedy and sampled);
 * speculative decoding (k = 3, an oracle proposer drafting the greedy
 * continuation with every third draft corrupted) with greedy chains verified
 * on the device and a sampling chain (the proposer gives q rows) verified on
 * the host beside them; and speculative greedy == plain greedy.
 * And, every step of the device engine, the bytes copied device -> host
 * (counted by the fake cudaMemcpyAsync) equal exactly what the design says
 * crosses the bus: the two int32 error flags, 4 bytes per sampled row, per
 * verified chain 4 * (k_max + 2) (its count and its k_max + 1 tokens), and a
 * full raw logits row (vocab * 4 bytes) ONLY for each row of a request that
 * asked for logprobs and each row of a chain verified on the host: no logits
 * otherwise.
 *
 * WHAT THIS DOES NOT TEST: the sampling numerics of the device. The fake
 * kn_sample / kn_spec_verify run the host sampler (engine/runtime/sampler.c)
 * on the staged inputs, so token equality here is partly by construction; it
 * proves the plumbing (which rows, parameters, histories, suppress and bias
 * lists, uniforms and chains are staged, how results are unpacked, how each
 * request's RNG advances, what is downloaded and when). The kernels'
 * numerics against sampler.c are tests/kernels/test_kn_sample.c (on a GPU or
 * under tools/kn_emu), and tests/kernels/test_cuda_backend.c runs this same
 * engine comparison on a real device. Skips (77) without the miniature.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/backend/cuda_fake/cuda_runtime_api.h" /* first: renames the CUDA backend's entry points */
#include "engine/backend/cuda_backend.h"
#define EG_EXACT 1 /* the fake device reproduces the CPU backend's logits bit for bit */
#include "tests/backend/engine_gen.h"
#include "engine/runtime/sampler.h"

/* bk_ops.sample called directly with plain rows and chains interleaved (greedy, and sampling with one-hot
 * drafts: the device path the engine takes once draft q rows live on the device), against the CPU's rule
 * with each request's RNG (sampler_sample / sampler_probs + sampler_accept, spec_verify_seq's loop), and the
 * bytes it moves device -> host: 4 per row, 4 * (k_max + 2) per chain. */
static void test_op_chains(backend *dev) {
    enum { V = 300, NR = 14 };
    const bk_ops *op = dev->ops;
    float *lg = malloc(sizeof(float) * NR * V);
    uint64_t x = 42;
    for (int i = 0; i < NR * V; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        lg[i] = (float)((int)(x >> 40) % 4096) / 512.0f - 4.0f;
    }
    /* rows: 0 plain sampling | 1..4 greedy chain (3 drafts) | 5 plain greedy | 6..8 sampling chain (2) |
     * 9..13 sampling chain (4) */
    static const int32_t r0[3] = {1, 6, 9}, nd[3] = {3, 2, 4};
    static const bool gr[3] = {true, false, false};
    int32_t hist[40], drafts[3][4];
    for (int i = 0; i < 40; i++) hist[i] = (int32_t)((i * 37 + 5) % V);
    for (int c = 0; c < 3; c++)
        for (int j = 0; j < nd[c]; j++) { /* a draft the row favours by 12 over its max (accepted), except the third (rejected) */
            drafts[c][j] = (int32_t)((c * 31 + j * 7 + 3) % V);
            float *row = lg + (size_t)(r0[c] + j) * V;
            if (j % 3 != 2) row[drafts[c][j]] = row[sampler_argmax(row, V)] + 12.0f;
        }
    sampling_params sp[NR];
    bk_sample_row rows[NR];
    sampler_rng rng[4]; /* one per request: plain row 0, chains B, C (greedy ones draw nothing) */
    for (int i = 0; i < 4; i++) sampler_rng_seed(&rng[i], 1000 + (uint64_t)i);
    double u[3][6];
    bk_verify_seq vs[3];
    for (int r = 0; r < NR; r++) {
        sampling_params_init(&sp[r]);
        const bool greedy = r == 5 || (r >= 1 && r <= 4);
        sp[r].temperature = greedy ? 0.0f : 0.9f;
        sp[r].top_k = 40, sp[r].repetition_penalty = 1.2f, sp[r].frequency_penalty = 0.5f;
        rows[r] = (bk_sample_row){.temperature = sp[r].temperature, .top_p = 1.0f, .top_k = 40,
                                  .repetition_penalty = 1.2f, .frequency_penalty = 0.5f, .forced = -1,
                                  .hist = hist, .n_prompt = 20, .n_output = 10};
    }
    sampler_rng work[4];
    memcpy(work, rng, sizeof rng);
    rows[0].u = sampler_rng_uniform(&work[0]);
    for (int c = 0; c < 3; c++) {
        sampler_rng peek = work[c + 1];
        for (int j = 0; j < nd[c] + 2; j++) u[c][j] = sampler_rng_uniform(&peek);
        vs[c] = (bk_verify_seq){.row0 = r0[c], .n_draft = nd[c], .draft = drafts[c], .greedy = gr[c], .u = u[c]};
    }
    float *d = op->buf_alloc(dev->ctx, sizeof(float) * NR * V);
    bk_tensor t = bk_wrap_f32(d, NR, V);
    int32_t ids[NR], acc[3], out[3 * 16];
    const size_t d0 = fake_d2h_bytes;
    EG_EXPECT(op->upload(dev->ctx, d, lg, sizeof(float) * NR * V) == 0, "upload");
    EG_EXPECT(op->sample(dev->ctx, &t, rows, NR, vs, 3, ids, acc, out) == 0, "sample op failed");
    EG_EXPECT(fake_d2h_bytes - d0 == 4 * (NR + 3 * (4 + 2)), "sample op: %zu bytes device -> host, expected %d",
              fake_d2h_bytes - d0, 4 * (NR + 3 * (4 + 2)));
    /* the CPU's rule */
    sampler_work *w = sampler_work_create(V);
    float *p = malloc(sizeof(float) * V);
    int32_t ref_hist[40];
    memcpy(ref_hist, hist, sizeof ref_hist);
    sampler_hist h = {ref_hist, 20, ref_hist + 20, 10, NULL, 0};
    EG_EXPECT(ids[0] == sampler_sample(w, &sp[0], &h, &rng[0], lg), "plain sampled row: %d", ids[0]);
    EG_EXPECT(ids[5] == sampler_sample(w, &sp[5], &h, NULL, lg + 5 * V), "plain greedy row: %d", ids[5]);
    int n_acc = 0, n_rej = 0;
    for (int c = 0; c < 3; c++) {
        /* a chain's rows see the drafts as outputs (spec_verify_seq appends accepted drafts); here every row
         * is given the same history, so the reference uses it too */
        int32_t a = 0, tok = -1;
        for (int j = 0; j <= nd[c]; j++) {
            const float *row = lg + (size_t)(r0[c] + j) * V;
            bool ok = false;
            if (j == nd[c] || gr[c]) {
                tok = sampler_sample(w, &sp[r0[c] + j], &h, &rng[c + 1], row);
                ok = j < nd[c] && tok == drafts[c][j];
            } else {
                sampler_probs(w, &sp[r0[c] + j], &h, row, p);
                ok = sampler_accept(p, NULL, V, drafts[c][j], &rng[c + 1], w, &tok) == 1;
            }
            if (!ok || j == nd[c]) break;
            a++;
        }
        n_acc += a, n_rej += a < nd[c];
        EG_EXPECT(acc[c] == a && out[c * 16 + a] == tok && memcmp(out + c * 16, drafts[c], (size_t)a * 4) == 0,
                  "chain %d: device accepted %d (last %d), the CPU's rule %d (last %d)", c, acc[c],
                  out[c * 16 + (acc[c] >= 0 && acc[c] <= 4 ? acc[c] : 0)], a, tok);
    }
    EG_EXPECT(n_acc >= 4 && n_rej == 2, "the chains exercise acceptance (%d), rejection (%d) and the bonus", n_acc,
              n_rej);
    printf("sample op: 2 plain rows + 3 chains (greedy, 2 sampling one-hot): the CPU rule's tokens and counts "
           "(%d drafts accepted, %d rejections), %d bytes device -> host\n", n_acc, n_rej, 4 * (NR + 3 * 6));
    sampler_work_destroy(w);
    free(p), free(lg);
    op->buf_free(dev->ctx, d);
}

/* bk_ops.sample with sampling chains whose q rows stay on the device (bk_verify_seq.q: one device pointer per
 * draft into a block of rows over a DRAFT vocabulary of VD = 120 of V = 300 ids, target id used[c] = (7 c +
 * 5) mod V, read through a device t2d map; one NULL row: a one-hot draft) beside a plain row and a greedy
 * chain, against the CPU's rule with each request's RNG over q scattered to target ids (sampler_probs +
 * sampler_accept, spec_verify_seq's loop), and the bytes device -> host: the ids and counts only, 4 per row
 * and 4 (k_max + 2) per chain; no q and no logits row. */
static void test_op_qdev(backend *dev) {
    enum { V = 300, VD = 120, NR = 11, NC = 3, K = 3 };
    const bk_ops *op = dev->ops;
    float *lg = malloc(sizeof(float) * NR * V);
    uint64_t x = 7;
    for (int i = 0; i < NR * V; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        lg[i] = (float)((int)(x >> 40) % 4096) / 512.0f - 4.0f;
    }
    int32_t used[VD], t2d[V];
    for (int i = 0; i < V; i++) t2d[i] = -1;
    for (int c = 0; c < VD; c++) used[c] = (7 * c + 5) % V, t2d[used[c]] = c;
    /* rows: 0..3 sampling chain A (3 drafts, dense q) | 4 plain sampling | 5..7 sampling chain B (2 drafts, the
     * second one-hot) | 8..10 greedy chain C (2 drafts) */
    static const int32_t r0[NC] = {0, 5, 8}, nd[NC] = {3, 2, 2};
    static const bool gr[NC] = {false, false, true};
    float qd[NC * K][VD], qfull[NC][K][V]; /* device block rows (chain c, draft j at row (NC K - 1) - (c K + j)) */
    memset(qfull, 0, sizeof qfull);
    int32_t drafts[NC][K];
    uint64_t y = 99;
    for (int c = 0; c < NC; c++)
        for (int j = 0; j < nd[c]; j++) {
            float *qr = qd[NC * K - 1 - (c * K + j)];
            double sum = 0;
            for (int i = 0; i < VD; i++) {
                y = y * 6364136223846793005ull + 1442695040888963407ull;
                qr[i] = (float)(1 + (y >> 59)), sum += qr[i];
            }
            for (int i = 0; i < VD; i++) qr[i] = (float)(qr[i] / sum);
            const bool onehot = c == 1 && j == 1;
            /* drafts from the draft vocabulary (the third of chain A outside it: q = 0 there) */
            drafts[c][j] = used[(c * 31 + j * 17 + 3) % VD];
            if (c == 0 && j == 2)
                for (drafts[c][j] = 13; t2d[drafts[c][j]] >= 0;) drafts[c][j]++;
            if (onehot) qfull[c][j][drafts[c][j]] = 1.0f;
            else
                for (int i = 0; i < VD; i++) qfull[c][j][used[i]] = qr[i];
            float *row = lg + (size_t)(r0[c] + j) * V; /* the first draft of each chain favoured (accepted) */
            if (j == 0) row[drafts[c][j]] = row[sampler_argmax(row, V)] + 12.0f;
        }
    sampling_params sp[NR];
    bk_sample_row rows[NR];
    int32_t hist[40];
    for (int i = 0; i < 40; i++) hist[i] = (int32_t)((i * 37 + 5) % V);
    for (int r = 0; r < NR; r++) {
        sampling_params_init(&sp[r]);
        const bool greedy = r >= 8;
        sp[r].temperature = greedy ? 0.0f : 1.3f;
        sp[r].top_k = 200, sp[r].repetition_penalty = 1.1f;
        rows[r] = (bk_sample_row){.temperature = sp[r].temperature, .top_p = 1.0f, .top_k = 200,
                                  .repetition_penalty = 1.1f, .forced = -1, .hist = hist, .n_prompt = 20,
                                  .n_output = 10};
    }
    sampler_rng rng[NC + 1], work[NC + 1]; /* chains A, B, C, plain row 4 */
    for (int i = 0; i <= NC; i++) sampler_rng_seed(&rng[i], 500 + (uint64_t)i);
    memcpy(work, rng, sizeof rng);
    rows[4].u = sampler_rng_uniform(&work[NC]);
    float *dqd = op->buf_alloc(dev->ctx, sizeof qd);
    int32_t *dt2d = op->buf_alloc(dev->ctx, sizeof t2d);
    EG_EXPECT(dqd && dt2d && op->upload(dev->ctx, dqd, qd, sizeof qd) == 0 &&
                  op->upload(dev->ctx, dt2d, t2d, sizeof t2d) == 0, "q rows / t2d on the device");
    const float *qp[NC][K];
    double u[NC][K + 2];
    bk_verify_seq vs[NC];
    for (int c = 0; c < NC; c++) {
        sampler_rng peek = work[c];
        for (int j = 0; j < nd[c] + 2; j++) u[c][j] = sampler_rng_uniform(&peek);
        for (int j = 0; j < K; j++) qp[c][j] = c == 1 && j == 1 ? NULL : dqd + (size_t)(NC * K - 1 - (c * K + j)) * VD;
        vs[c] = (bk_verify_seq){.row0 = r0[c], .n_draft = nd[c], .draft = drafts[c], .greedy = gr[c], .u = u[c],
                                .q = gr[c] ? NULL : qp[c], .q_vocab = VD, .t2d = dt2d};
    }
    float *d = op->buf_alloc(dev->ctx, sizeof(float) * NR * V);
    bk_tensor t = bk_wrap_f32(d, NR, V);
    int32_t ids[NR], acc[NC], out[NC * 16];
    EG_EXPECT(op->upload(dev->ctx, d, lg, sizeof(float) * NR * V) == 0, "upload");
    const size_t d0 = fake_d2h_bytes;
    const long q0 = fake_kn_spec_verify_q_rows;
    EG_EXPECT(op->sample(dev->ctx, &t, rows, NR, vs, NC, ids, acc, out) == 0, "sample op with device q failed");
    EG_EXPECT(fake_d2h_bytes - d0 == 4 * (NR + NC * (K + 2)),
              "sample op with device q: %zu bytes device -> host, expected %d (ids and counts only)",
              fake_d2h_bytes - d0, 4 * (NR + NC * (K + 2)));
    EG_EXPECT(fake_kn_spec_verify_q_rows > q0, "no draft was tested against its device q row");
    /* the CPU's rule over q scattered to target ids */
    sampler_work *w = sampler_work_create(V);
    float *p = malloc(sizeof(float) * V);
    sampler_hist h = {hist, 20, hist + 20, 10, NULL, 0};
    EG_EXPECT(ids[4] == sampler_sample(w, &sp[4], &h, &rng[NC], lg + 4 * V), "plain sampled row: %d", ids[4]);
    int n_acc = 0, n_rej = 0;
    for (int c = 0; c < NC; c++) {
        int32_t a = 0, tok = -1;
        for (int j = 0; j <= nd[c]; j++) {
            const float *row = lg + (size_t)(r0[c] + j) * V;
            bool ok = false;
            if (j == nd[c] || gr[c]) {
                tok = sampler_sample(w, &sp[r0[c] + j], &h, &rng[c], row);
                ok = j < nd[c] && tok == drafts[c][j];
            } else {
                sampler_probs(w, &sp[r0[c] + j], &h, row, p);
                ok = sampler_accept(p, qfull[c][j], V, drafts[c][j], &rng[c], w, &tok) == 1;
            }
            if (!ok || j == nd[c]) break;
            a++;
        }
        n_acc += a, n_rej += a < nd[c];
        EG_EXPECT(acc[c] == a && out[c * 16 + a] == tok && memcmp(out + c * 16, drafts[c], (size_t)a * 4) == 0,
                  "chain %d (device q): device accepted %d (last %d), the CPU's rule %d (last %d)", c, acc[c],
                  out[c * 16 + (acc[c] >= 0 && acc[c] <= K ? acc[c] : 0)], a, tok);
    }
    EG_EXPECT(n_acc >= 2 && n_rej >= 1, "the chains exercise acceptance (%d) and rejection (%d)", n_acc, n_rej);
    printf("sample op, device q over a %d-id draft vocabulary (t2d): a plain row + 3 chains as the CPU's rule over "
           "scattered q (%d drafts accepted, %d rejections), %d bytes device -> host, %ld q rows tested\n", VD, n_acc,
           n_rej, 4 * (NR + NC * (K + 2)), fake_kn_spec_verify_q_rows - q0);
    sampler_work_destroy(w);
    free(p), free(lg);
    op->buf_free(dev->ctx, d), op->buf_free(dev->ctx, dqd), op->buf_free(dev->ctx, dt2d);
}

/* A step whose staged inputs outgrow the staging carved at create (here: penalised histories of 3 x 500,000
 * ids = 6 MB against ~5 MB), on an arena with no room left (as after the KV pool took it): the op samples it
 * in parts (split between rows, never inside a chain) instead of growing the staging, so it succeeds and
 * the arena use does not change. Expected ids from the penalty arithmetic: every row's logits are 10 at
 * a(r), 9 at b(r), 0 elsewhere, and its history (prompt) holds a(r): repetition penalty 2 makes a(r) 5, so
 * the greedy pick is b(r); a staged history lost or misplaced picks a(r). The chain (rows 2..5, drafts
 * b(2), b(3), then a wrong one) accepts 2 and ends on b(4). Before the split, the step failed ("no arena
 * room for ... sampling inputs"). */
static void test_op_outgrown(void) {
    enum { V = 64, NR = 6, NH = 500000 };
    bk_cuda_opts o = {.device = 0, .max_tokens = 64, .max_seqs = 8, .max_len = 160, .block_size = EG_BS,
                      .max_heads = 4, .max_head_dim = 64, .sample_vocab = V};
    o.arena_bytes = bk_cuda_fixed_bytes(&o) + ((size_t)1 << 20);
    specd_err err = {{0}};
    backend *dev = bk_cuda_create(&o, &err);
    EG_EXPECT(dev != NULL, "backend: %s", err.msg);
    if (!dev) return;
    const bk_ops *op = dev->ops;
    void *bx = dev->ctx;
    float *lg = calloc((size_t)NR * V, sizeof *lg);
    int32_t *h0 = malloc(sizeof(int32_t) * NH), *h1 = malloc(sizeof(int32_t) * NH);
    int32_t *hc = malloc(sizeof(int32_t) * (NH + 3));
    float *d = op->buf_alloc(bx, sizeof(float) * NR * V);
    void *fill[512];
    int n_fill = 0;
    while (n_fill < 512 && (fill[n_fill] = op->buf_alloc(bx, (size_t)64 << 10))) n_fill++; /* the arena full */
    while (n_fill < 512 && (fill[n_fill] = op->buf_alloc(bx, 256))) n_fill++;
    const size_t used = bk_cuda_arena_used(dev);
#define A_(r) ((r) * 7 + 1)
#define B_(r) ((r) * 7 + 2)
    for (int r = 0; r < NR; r++) lg[(size_t)r * V + A_(r)] = 10.0f, lg[(size_t)r * V + B_(r)] = 9.0f;
    for (int i = 0; i < NH; i++) h0[i] = A_(0), h1[i] = A_(1), hc[i] = A_(2 + i % 4); /* the chain rows' a's */
    const int32_t drafts[3] = {B_(2), B_(3), A_(4)};
    memcpy(hc + NH, drafts, sizeof drafts); /* row 2 + j sees drafts 1..j as outputs */
    bk_sample_row rows[NR];
    for (int r = 0; r < NR; r++)
        rows[r] = (bk_sample_row){.temperature = 0.0f, .top_p = 1.0f, .repetition_penalty = 2.0f, .forced = -1,
                                  .hist = r == 0 ? h0 : r == 1 ? h1 : hc, .n_prompt = NH,
                                  .n_output = r < 2 ? 0 : r - 2};
    bk_verify_seq vs = {.row0 = 2, .n_draft = 3, .draft = drafts, .greedy = true};
    int32_t ids[NR], acc = -1, out[16];
    bk_tensor t = bk_wrap_f32(d, NR, V);
    EG_EXPECT(d && op->upload(bx, d, lg, sizeof(float) * NR * V) == 0, "upload");
    EG_EXPECT(op->sample(bx, &t, rows, NR, &vs, 1, ids, &acc, out) == 0,
              "a step of %d history ids on a full arena failed", 3 * NH + 3);
    EG_EXPECT(ids[0] == B_(0) && ids[1] == B_(1), "plain rows: %d %d, want %d %d", ids[0], ids[1], B_(0), B_(1));
    EG_EXPECT(acc == 2 && out[0] == B_(2) && out[1] == B_(3) && out[2] == B_(4),
              "chain: %d accepted (%d %d %d), want 2 (%d %d %d)", acc, out[0], out[1], out[2], B_(2), B_(3), B_(4));
    EG_EXPECT(bk_cuda_arena_used(dev) == used, "the arena use moved: %zu -> %zu", used, bk_cuda_arena_used(dev));
#undef A_
#undef B_
    if (!eg_fail)
        printf("sample op, staging outgrown on a full arena: %d history ids sampled in parts, ids and chain as "
               "the penalty arithmetic says\n", 3 * NH + 3);
    for (int i = 0; i < n_fill; i++) op->buf_free(bx, fill[i]);
    op->buf_free(bx, d);
    free(lg), free(h0), free(h1), free(hc);
    bk_cuda_destroy(dev);
}

/* Review finding F5: a device sampling failure reaches the request's error with the backend's own reason
 * (bk_ops.last_error), not a bare "failed". A backend whose sampler buffers are NOT carved at create
 * (sample_vocab 0) and whose arena is then filled (after a warm-up forward grew the model's workspace): the
 * first step that samples cannot stage its inputs, and the request finishes with FINISH_ERROR whose text
 * names the arena ("no arena room for ... sampling inputs"). */
static void test_engine_error(const char *path) {
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)64 << 20, .max_tokens = 64, .max_seqs = 4, .max_len = 160,
                      .block_size = EG_BS, .max_heads = 16, .max_head_dim = 128};
    specd_err err = {{0}};
    backend *dev = bk_cuda_create(&o, &err);
    model_load_opts mo = {.block_size = EG_BS, .n_blocks = 16};
    model *md = NULL;
    if (!dev || model_load(path, dev, &mo, &md, &err) < 0) {
        EG_EXPECT(0, "backend / model: %s", err.msg);
        bk_cuda_destroy(dev);
        return;
    }
    static const int32_t prompt[5] = {5, 9, 33, 7, 101};
    int32_t pos[5], seq[5] = {0}, out[5], table[1] = {0};
    for (int i = 0; i < 5; i++) pos[i] = i, out[i] = i;
    const int32_t *tables[1] = {table};
    float *lg = malloc(sizeof(float) * 5 * (size_t)model_get_config(md)->vocab);
    model_batch b = {.n_tokens = 5, .tokens = prompt, .pos = pos, .seq_of = seq, .n_seqs = 1, .block_tables = tables,
                     .n_out = 5, .out_idx = out, .logits = lg};
    EG_EXPECT(model_forward(md, &b, &err) == 0, "warm-up forward: %s", err.msg); /* workspaces at their size */
    void *fill[1024];
    int n_fill = 0;
    while (n_fill < 1024 && (fill[n_fill] = dev->ops->buf_alloc(dev->ctx, (size_t)64 << 10))) n_fill++;
    while (n_fill < 1024 && (fill[n_fill] = dev->ops->buf_alloc(dev->ctx, 256))) n_fill++;
    engine_runner r = {.ctx = md, .forward = eg_fwd, .vocab = model_get_config(md)->vocab,
                       .hidden = model_get_config(md)->hidden, .block_size = EG_BS, .n_blocks = model_kv_n_blocks(md),
                       .sample_be = dev};
    engine_detok d = {.stream_create = eg_dt_create, .stream_destroy = eg_dt_destroy, .push = eg_dt_push,
                      .flush = eg_dt_flush, .eos_ids = eg_eos, .n_eos = 1};
    engine_config cfg = {.max_model_len = 64, .max_num_seqs = 4, .max_num_batched_tokens = 64, .max_waiting = 4};
    engine *e = NULL;
    engine_request q;
    memset(&q, 0, sizeof q);
    sampling_params_init(&q.sp);
    q.sp.temperature = 0.0f, q.sp.max_tokens = 4;
    q.prompt = prompt, q.n_prompt = 5;
    engine_stream *st = NULL;
    if (engine_create_ex(&cfg, &r, &d, md, NULL, &e, &err) == 0) st = engine_submit(e, &q, NULL, NULL, NULL, &err);
    EG_EXPECT(st, "engine / submit: %s", err.msg);
    if (st) {
        specd_err se = {{0}};
        EG_EXPECT(engine_step(e, &se) < 0, "the step sampled without room for its inputs");
        engine_output *eo = NULL;
        EG_EXPECT(engine_stream_wait(st, &eo, 0.0) && eo && eo->finish == FINISH_ERROR, "the request did not fail");
        const char *want = "no arena room for";
        EG_EXPECT(eo && strstr(eo->error, want) && strstr(se.msg, want),
                  "the backend's reason ('%s ...') is not in the request's error '%s' / the step's '%s'", want,
                  eo ? eo->error : "", se.msg);
        if (eo && strstr(eo->error, want)) printf("device sampling failure: the request's error: %s\n", eo->error);
        engine_output_free(eo);
        engine_stream_release(st);
    }
    engine_destroy(e);
    for (int i = 0; i < n_fill; i++) dev->ops->buf_free(dev->ctx, fill[i]);
    free(lg);
    model_destroy(md);
    bk_cuda_destroy(dev);
}

int main(void) {
    const char *mini = getenv("MODEL_HF_MINI_DIR");
    char path[4096];
    struct stat stt;
    snprintf(path, sizeof path, "%s/f32", mini ? mini : "");
    if (!mini || stat(path, &stt) != 0) {
        printf("SKIP: the HF miniature is not at $MODEL_HF_MINI_DIR/f32\n");
        return 77;
    }
    specd_err err = {{0}};
    backend *cpu = bk_cpu_create(1);
    bk_cuda_opts o = {.device = 0, .arena_bytes = (size_t)256 << 20, .max_tokens = 256, .max_seqs = 8,
                      .max_len = 160, .block_size = EG_BS, .max_heads = 16, .max_head_dim = 128,
                      .sample_vocab = 512}; /* the sampler's buffers carved at create (the miniature's vocab) */
    backend *dev = bk_cuda_create(&o, &err);
    EG_EXPECT(dev && bk_cuda_arena_used(dev) == bk_cuda_fixed_bytes(&o),
              "the backend's own buffers, the sampler's included, are what bk_cuda_fixed_bytes says (%zu vs %zu)",
              dev ? bk_cuda_arena_used(dev) : 0, bk_cuda_fixed_bytes(&o));
    if (!cpu || !dev) { printf("FAIL: backends: %s\n", err.msg); return 1; }
    model_load_opts mo = {.block_size = EG_BS, .n_blocks = 64};
    model *mc = NULL, *md = NULL;
    if (model_load(path, cpu, &mo, &mc, &err) || model_load(path, dev, &mo, &md, &err)) {
        printf("FAIL: %s: %s\n", path, err.msg);
        return 1;
    }
    test_op_chains(dev);
    test_op_qdev(dev);
    test_op_outgrown();
    test_engine_error(path);
    eg_scenarios(mc, md, dev);
    EG_EXPECT(fake_violations == 0, "%d host pointers reached device ops", fake_violations);
    model_destroy(mc), model_destroy(md);
    bk_cuda_destroy(dev);
    bk_cpu_destroy(cpu);
    printf("%s\n", eg_fail ? "FAILED" : "OK");
    return eg_fail ? 1 : 0;
}
