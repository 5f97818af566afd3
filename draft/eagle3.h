/*
 * eagle3.h: the EAGLE-3 proposer (draft/ implements engine/runtime/proposer.h).
 *
 * server/main loads a head with eagle3_load() next to the target model and
 * hands the spec_proposer to engine_set_proposer(). The target model must
 * outlive the proposer (the head borrows its embedding, LM head and backend).
 *
 * CONTRACT WITH THE ENGINE (positions are absolute token positions of one
 * sequence; x_t is the token at t, f_t the target's aux features captured
 * while it processed x_t, i.e. the residual streams entering the layers
 * aux_layers() returns, concatenated in that order):
 *   - The draft pairs f_t with x_{t+1} (REFERENCE §2 "Alignment") and gives
 *     the pair rotary/cache position t.
 *   - extend(seq, tokens, n, pos0, aux): x_{pos0..pos0+n) are committed, and
 *     when aux != NULL, f_{pos0..pos0+n) too (rows [n, n_aux*Ht] f32). aux may
 *     be NULL to commit tokens whose features are not known yet: the token the
 *     engine just sampled (after prefill, or the bonus / corrected token after
 *     a verify) is passed this way, since the target has not processed it.
 *     Positions may overlap what the draft already has (re-sent tokens must be
 *     equal, else the draft rolls back to the first differing position);
 *     neither tokens nor features may leave a gap.
 *     Typical step:  prefill of P prompt tokens -> extend(prompt, 0, aux) then
 *     extend(&sampled, 1, P, NULL);  verify of [x_m, d_1..d_k] with a drafts
 *     accepted and bonus b -> extend([x_m, d_1..d_a], a+1, m, aux rows of those
 *     a+1 positions) then extend(&b, 1, m+a+1, NULL).
 *   - propose(seq_ids, k, ...): for a sequence that knows tokens [0, n_tok)
 *     and features [0, n_tok - 1), drafts the tokens at positions n_tok,
 *     n_tok+1, ..., n_tok+k-1: the last real pair (f_{n_tok-2}, x_{n_tok-1})
 *     gives the first draft; each further draft feeds back the previous step's
 *     pre-norm output with the previous draft token (mapped to its target id)
 *     at the next position. Drafts are TARGET ids (draft id + d2t). A sequence
 *     the draft cannot serve (fewer than 2 tokens, missing features, draft KV
 *     pool exhausted) gets -1 in its token slots and zero q rows; the engine
 *     verifies it with no drafts. Slots j >= k[i] are -1 / zero too.
 *     out_q[i, j, :] is the distribution the draft token was drawn from, over
 *     TARGET ids: temperature <= 0 (or opts.argmax_drafts): argmax and a
 *     one-hot q; temperature > 0: the token is SAMPLED from
 *     softmax(logits / temperature) and q is that distribution scattered to
 *     target ids (0 outside the draft vocab), as the acceptance rule
 *     min(1, p/q) requires (REFERENCE §3). With out_q == NULL the drafts are
 *     argmax whatever the temperature (q is then implicitly one-hot: accept
 *     with probability p(x), REFERENCE §3's reduction).
 *   - The draft's KV holds "real" entries (built from target features) at
 *     positions [0, n_tok - 1) and speculative entries (built from its own
 *     outputs) after them. Speculative entries are never counted as committed:
 *     the next propose/extend overwrites them with real pairs once verified
 *     tokens and their features arrive, so no rollback call is needed after a
 *     verify. truncate(seq, n) forgets tokens at positions >= n and features at
 *     >= n. The draft keeps the inputs of its last real pair (position
 *     n_tok - 2 at its last propose) and everything after; a truncate to n at
 *     or below that position (preemption) drops them: the features from
 *     position n - 1 on must then be re-sent with extend (re-sending from 0 is
 *     always fine: positions the draft already holds are skipped). Until they
 *     are, propose returns -1 for the sequence.
 *   - extend_slots (opts.feat_cache, the device feature cache): extend with
 *     the features in the pool row of each position's TARGET KV slot (the
 *     engine passes the sequence's block table). With features from the
 *     target's aux buffer they are written there first, for every position
 *     given (the cache fill does not depend on the draft's state); a
 *     prefix-cache hit passes aux_row0 = -1: the positions' features are
 *     already in the slots of the shared blocks. The draft's window then
 *     reads those rows until its pairs settle; the engine never frees a
 *     sequence's KV blocks without truncate / free_seq of that sequence in
 *     the same step (preemption, finish), and commits only positions whose
 *     blocks it keeps.
 *   - seed_seq(seq, seed): the sequence's sampled drafts draw with Philox
 *     keyed by SEED, counter = the drafted token's position (kernels/
 *     kn_philox.h; bk_ops.draw), so a seeded request's drafts are the same
 *     alone or in any batch, and on every backend.
 * Threading: engine thread only.
 */
#ifndef SPECD_DRAFT_EAGLE3_H
#define SPECD_DRAFT_EAGLE3_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "draft/eagle3_config.h"
#include "engine/comm/comm.h"
#include "engine/model/model.h"
#include "engine/runtime/proposer.h"
#include "engine/util/err.h"

typedef struct eagle3_opts {
    /* How explicit aux layer ids in the head's config are read (eagle3_config.h):
     * AUTO (0, default) by where the key is, INPUT, or OUTPUT. */
    eagle3_aux_convention aux_ids_convention;
    int32_t n_blocks;      /* draft KV blocks (block size = the target's); <= 0: target's n_blocks + 256 */
    int32_t max_rows;      /* rows per draft forward call (long prefills are chunked); <= 0: 512. On a
                            * device backend at most the backend's tokens per step */
    int32_t max_seqs;      /* sequences of one chained draft pass (the chain buffers' rows; a propose of
                            * more runs them in groups on a device backend, grows them on a host-visible
                            * one); <= 0: 64. On a device backend at most the backend's sequences per step */
    int32_t max_k;         /* drafts per sequence the chain buffers hold (<= 0: 16; a device backend refuses
                            * a propose with a larger k_max, a host-visible one grows) */
    bool argmax_drafts;    /* true: argmax drafts with one-hot q even at temperature > 0 */
    bool q8_0;             /* re-quantize the head's matrices to Q8_0 at load (CPU speed; eagle3_head.h) */
    const char *hot_vocab; /* NULL or a vocab map: score only those draft ids (eagle3_head.h); not owned */
    uint64_t seed;         /* draft sampling RNG seed of sequences the engine does not seed (proposer seed_seq) */
    int32_t aux_rows;      /* > 0, head on the target's device backend: reserve the target's fixed aux
                            * buffer for steps of up to this many tokens (model_aux_reserve; the bundle: the
                            * engine's --max-num-batched-tokens) so the features never leave the device
                            * (proposer extend_rows); 0: features come as host rows (extend) */
    int32_t feat_chunks;   /* device backends: chunks (of the KV block size in rows) of the feature pool the
                            * pending pairs' features wait in; <= 0: 2 (max_rows / bs + 1) + max_seqs
                            * (ceil((max_k + 2) / bs) + 1) */
    bool feat_cache;       /* device backends with aux_rows > 0: the feature pool is the device feature cache
                            * instead (proposer.h feat_cache_slots / extend_slots): one row per target KV
                            * slot (the target's n_blocks x block_size rows of n_aux x H f32, allocated here
                            * once; the bundle's plan counts it per KV token), so a prefix-cache hit feeds
                            * the draft the cached positions' features with no copy; feat_chunks is unused.
                            * Not with tensor parallelism (the mirror does not carry block tables) */
    backend *be;           /* backend the head computes on (not owned); NULL = the target's. On the
                            * target's device backend the head shares the target's placed embedding (and
                            * LM head when it uses it whole) and keeps weights, KV and buffers in device
                            * memory (docs/draft.md "On the GPU"). Another backend (a CPU one next to a
                            * device target: the fallback) reads the target's host views. */
    comm *tp_comm;         /* device tensor parallelism: set by eagle3_tp_load (eagle3_tp.h); NULL otherwise */
    const model_comm *tp_mc;
} eagle3_opts;

/* Loads the head in DIR for TARGET (shapes checked against it, d2t/t2d
 * validated, aux layers resolved) and returns a proposer. o may be NULL
 * (defaults). Returns 0, or -1 with err. */
int eagle3_load(const char *dir, model *target, const eagle3_opts *o, spec_proposer **out, specd_err *err);
/* The head alone, with the options eagle3_load gives it (a tensor-parallel
 * worker rank's copy, draft/eagle3_tp.h). */
struct eagle3_head;
int eagle3_head_load_for(const char *dir, model *target, const eagle3_opts *o, struct eagle3_head **out,
                         specd_err *err);
void eagle3_destroy(spec_proposer *p); /* NULL ok */

/* Checks the map at PATH alone for eagle3_opts.hot_vocab with a target of
 * TARGET_VOCAB ids (serve --check-config): a readable vocab map with d2t
 * int64 [n], 1 <= n <= TARGET_VOCAB, every i + d2t[i] inside the target, its
 * target_vocab_size metadata (if any) equal to TARGET_VOCAB. Whether it
 * shares ids with a head is checked when the head loads. Returns 0, or -1
 * with err. */
int eagle3_hot_vocab_check(const char *path, int64_t target_vocab, specd_err *err);

/* "auto" | "input" | "output" -> convention; -1 with err otherwise. */
int eagle3_aux_convention_parse(const char *s, eagle3_aux_convention *out, specd_err *err);

/* CUDA graphs of the chain draft loop (docs/engine.md "The chain draft loop
 * as CUDA graphs"), on a device backend with graph metadata slots. Per row
 * bucket (ascending, each <= max_seqs; the backend must hold bucket + 1
 * sequences), per step count k in 1 .. K and, for k >= 2, per length class
 * (model_graph_len_classes(max_len, len_floor): max_len, / 4, / 16, ... at
 * most 4; max_len 0: one class, the backend's bound), one graph of k steps
 * (LM head, argmax + d2t, and but after the last the layer fed the drafted
 * ids at metadata slot j + 1), captured now (at load, before the engine
 * reads the KV pools). A k = 1 graph has no layer call (no positions), so
 * one class serves every length.
 * Which propose replays: every chain row of the group greedy, the rows
 * fitting a bucket; it replays the graph of k_g = the LARGEST k among the
 * group's rows (not the call's k_max: a group whose rows all draft fewer
 * runs no step more than they need), in the smallest bucket B >= its rows
 * and the smallest class above the positions it writes. Its rows are padded
 * to B (padding rows at position 0 of one draft KV block held for them);
 * every row runs all k_g steps (the host keeps the first k of each; a row's
 * extra steps run at the last position of its own k drafts, L + k - 1, or
 * L + 1 at k = 1, so a sequence near the end of the context stays within the
 * backend's positions; their extra KV entries are speculative ones); one
 * metadata upload per slot, ONE graph launch, one download of the ids.
 * Anything else runs the eager chain. Returns 0, or -1 with err (nothing
 * kept). Logs what it captured (graphs, classes, capture time). */
typedef struct eagle3_graph_opts {
    const int32_t *buckets;   /* [n_buckets] rows per graph, ascending */
    int32_t n_buckets;
    int32_t k;                /* K: graphs for every k in 1 .. K (K <= min(15, max_k)) */
    int32_t max_len;          /* > 0: length classes below it (the target's --max-model-len); 0: none */
    int32_t len_floor;        /* the smallest class (<= 0: 2048, as the target's graphs) */
} eagle3_graph_opts;
int eagle3_graphs_capture(spec_proposer *p, const eagle3_graph_opts *o, specd_err *err);
void eagle3_graphs_release(spec_proposer *p); /* NULL ok; proposes run eagerly afterwards */
long eagle3_graph_replays(const spec_proposer *p); /* proposes (groups) served by a graph launch */

typedef struct eagle3_graph_stats {
    int32_t n_graphs;         /* captured */
    int32_t n_classes;        /* length classes of the k >= 2 graphs */
    int32_t classes[4];       /* their bounds, descending (0: the backend's bound) */
    long replays;             /* chain groups served by one graph launch */
    long replays_k[16];       /* of which by the graph of k steps */
    long short_replays;       /* of which in a class below the largest */
    long eager;               /* greedy chain groups that fit no graph (ran eagerly) */
    int32_t last_B, last_k;   /* the last replay's bucket and steps */
    int32_t last_L;           /* the class of the last replay of k >= 2 (0: the backend's bound) */
} eagle3_graph_stats;
void eagle3_graph_get_stats(const spec_proposer *p, eagle3_graph_stats *out); /* zeroes without graphs */
/* Kernel nodes the graphs of eagle3_graphs_capture hold, estimated for the memory plan (about 24 per step:
 * the layer, the LM head, argmax): per bucket sum over k = 1..K of 24 k, the k >= 2 ones per class. */
size_t eagle3_graphs_nodes(int32_t n_buckets, int32_t k, int32_t n_classes);

/* The head behind a proposer made by eagle3_load (introspection, tests). */
struct eagle3_head *eagle3_proposer_head(spec_proposer *p);

#endif
