#!/usr/bin/env python3
"""train.py: train an EAGLE-3 draft head on a hidden-state dump (CPU, PyTorch).

What it owns: the training run directory RUN/ (ckpt/, log.jsonl, export/),
the objective, the schedule, checkpoint/resume and the export of the head in
the speculators layout (bf16, d2t/t2d inside, model card stub).

Objective (REFERENCE.md section 2, issue 6 step 4): training-time test
unrolled over `--ttt` draft steps (model.py).  Step j, row t predicts token
t+2+j; its soft target is the target's next-token distribution at position
t+1+j, `softmax(final_hidden @ lm_head_target^T)`, restricted to the draft
vocabulary (t2d) and renormalised; rows whose FULL-vocabulary target argmax is
outside t2d are masked (the draft cannot propose it, learning a substitute
only teaches it to be confidently wrong), as are rows with loss_mask[t+2+j] =
0.  Loss = sum_j decay^j * mean over the step's rows of
-sum_v p(v) log q(v) (soft cross-entropy; its gradient is that of
KL(p || q)).  lm_head starts as the target's rows of the draft vocabulary
(row i = lm_head_target[i + d2t[i]]); `--freeze-lm-head` keeps it there.
AdamW, linear warm-up then cosine decay to `--min-lr-ratio`, grad-norm clip.

`--cand-topk K` (CPU budgets): the same soft CE over a candidate set instead
of the whole draft vocabulary: each row's soft target is the target's top-K
draft tokens (renormalised), the draft's log-softmax runs over the union of
those candidates across the sample's rows (plus `--cand-random` uniform
negatives).  About 4x cheaper per token with a frozen 32K lm_head; measured
steps (every --log-every) still report full-vocabulary accuracy (acc_full)
and tau_est, which is what serving sees.  Target logits are computed only at
the positions some TTT step reads (loss_mask of the next token set).

Checkpoints: RUN/ckpt/step_XXXXXXXX.pt every `--ckpt-every` steps and at the
end (written to .tmp then renamed; the two newest kept).  A rerun with the
same RUN resumes from the newest loadable checkpoint: model, optimiser, step,
data cursor and RNG, so an interrupted session loses at most ckpt-every steps.
The data order is a seeded permutation per epoch, a pure function of
(seed, epoch), so resuming replays the same order.

Export: RUN/export/ (or --export-dir): config.json (speculators layout, the
target's Llama config as transformer_layer_config), model.safetensors (bf16;
d2t int64, t2d bool), README.md (model card stub with data, tokens, steps,
wall time, hyperparameters; acceptance figures are added by whoever
measures them).

Usage:
  train.py --dump DUMP --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --vocab-map VOCAB.safetensors --run RUN [--steps 2000] [--ttt 3] ...
  train.py --run RUN --export-only       (export the newest checkpoint)
  --dump may repeat (or be comma-separated): the dumps are read as one; a
  resumed run may name more or grown dumps (the epoch order then changes).
Target from --gguf (Llama metadata + token_embd, tied lm_head or output.weight)
or --target-config HF-config.json --target-embed embed.npy [--target-lm-head
lm_head.npy] (tests, other targets).

Threading: torch's intra-op threads only (set --threads; default 2; on a
busy 2-core machine --threads 1 is ~4x faster: small ops stall on thread sync).
"""

import argparse
import glob
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dump import DumpReader, MultiDump  # noqa: E402
from model import DraftConfig, Eagle3Train  # noqa: E402


# ---------------------------------------------------------------- target ---

def load_target(a):
    """-> (llama_cfg dict in HF names, embed f32 [V, H], lm_head f32 [V, H])."""
    if a.gguf:
        import gguf
        from gguf.quants import dequantize
        r = gguf.GGUFReader(a.gguf)

        def kv(name, default=None):
            f = r.fields.get(name)
            if f is None:
                return default
            v = f.parts[f.data[0]]
            return v.tobytes().decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()
        arch = kv("general.architecture")
        H = int(kv(f"{arch}.embedding_length"))
        nh = int(kv(f"{arch}.attention.head_count"))
        cfg = {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "hidden_size": H, "num_attention_heads": nh,
            "num_key_value_heads": int(kv(f"{arch}.attention.head_count_kv", nh)),
            "head_dim": int(kv(f"{arch}.attention.key_length", H // nh)),
            "intermediate_size": int(kv(f"{arch}.feed_forward_length")),
            "rms_norm_eps": float(kv(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(kv(f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(kv(f"{arch}.context_length", 8192)),
            "num_hidden_layers": int(kv(f"{arch}.block_count")),
        }
        tens = {t.name: t for t in r.tensors}

        def deq(name):
            t = tens[name]
            a_ = dequantize(t.data, t.tensor_type)
            return torch.from_numpy(np.asarray(a_, dtype=np.float32).reshape(int(t.shape[1]), int(t.shape[0])))
        embed = deq("token_embd.weight")
        lm = deq("output.weight") if "output.weight" in tens else embed
        cfg["vocab_size"] = embed.shape[0]
        cfg["tie_word_embeddings"] = "output.weight" not in tens
        return cfg, embed, lm
    with open(a.target_config) as f:
        cfg = json.load(f)
    embed = torch.from_numpy(np.load(a.target_embed).astype(np.float32))
    lm = torch.from_numpy(np.load(a.target_lm_head).astype(np.float32)) if a.target_lm_head else embed
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("rope_theta", 10000.0)
    return cfg, embed, lm


def load_vocab_map(path, target_vocab):
    """d2t int64 [Vd] (offsets), t2d bool [Vt] from a safetensors file with
    both tensors, or a directory with d2t.npy and t2d.npy.  Validated."""
    if os.path.isdir(path):
        d2t = np.load(os.path.join(path, "d2t.npy"))
        t2d = np.load(os.path.join(path, "t2d.npy"))
    else:
        from safetensors.numpy import load_file
        m = load_file(path)
        d2t, t2d = m["d2t"], m["t2d"]
    d2t = torch.from_numpy(np.asarray(d2t, dtype=np.int64))
    t2d = torch.from_numpy(np.asarray(t2d).astype(bool))
    used = torch.arange(d2t.shape[0]) + d2t
    if t2d.shape[0] != target_vocab:
        raise ValueError(f"t2d has {t2d.shape[0]} entries, target vocab is {target_vocab}")
    if int(t2d.sum()) != d2t.shape[0]:
        raise ValueError(f"t2d.sum() = {int(t2d.sum())} != draft vocab {d2t.shape[0]}")
    if used.min() < 0 or used.max() >= target_vocab or not bool((used[1:] > used[:-1]).all()):
        raise ValueError("d2t does not map to strictly increasing in-range target ids (absolute, not offsets?)")
    if not bool(t2d[used].all()):
        raise ValueError("t2d is inconsistent with d2t")
    return d2t, t2d


# ------------------------------------------------------------------ loss ---

def sample_loss(model, s, d2t, t2d, lm_target, ttt, decay, max_len, measure=False,
                cand_topk=0, cand_random=0, gen=None):
    """Loss of one dump sample; returns (loss tensor or None, stats dict).

    measure: also estimate the greedy acceptance length over the sample's
    response rows (stats tau_rows, tau_sum): chain step j of row t counts
    as accepted iff steps 0..j all proposed the target's argmax (a target
    argmax outside t2d is a rejection).  Conditional on the earlier steps
    being right, the teacher-forced token equals what serving would feed
    (for greedy self-distilled data), so this is k=ttt acceptance length.
    The estimate always uses the full draft vocabulary (stats acc_full:
    full-vocabulary argmax accuracy per step on the measured rows).

    cand_topk = 0: the exact objective (draft log-softmax over all Vd
    columns, soft targets over all of t2d).  cand_topk = K > 0: a
    candidate-set approximation for CPU budgets: the soft target of a row is
    its K most likely draft-vocabulary tokens under the target (renormalised;
    they hold almost all the mass), and the draft's log-softmax runs over the
    union C of those candidates over all rows of this sample and TTT step,
    plus `cand_random` draft ids drawn uniformly (negatives the target does
    not rank high).  With the lm_head frozen, the draft logits of C are
    |C|/Vd of the full cost (forward and backward), the dominant term."""
    dev = lm_target.device
    ids, mask = s["input_ids"][:max_len].to(dev), s["loss_mask"][:max_len].to(dev)
    aux, fin = s["aux_hidden"][:max_len].to(dev), s["final_hidden"][:max_len].to(dev)
    T = ids.shape[0]
    if T < 3:
        return None, {}
    Vd = d2t.shape[0]
    used = torch.arange(Vd, device=dev) + d2t
    with torch.no_grad():
        # target logits over the full vocabulary, only at the positions whose
        # distribution some TTT step reads (p with loss_mask[p+1] = 1): the
        # argmax-in-t2d mask, then the draft-vocabulary columns renormalised
        # = the soft targets (dense, or its top-K for the candidate loss).
        need = torch.zeros(T, dtype=torch.bool, device=dev)
        need[1:T - 1] = mask[2:T]
        pidx = need.nonzero().squeeze(1)
        slot = torch.full((T,), -1, dtype=torch.int64, device=dev)
        slot[pidx] = torch.arange(pidx.numel(), device=dev)
        in_t2d = torch.zeros(T, dtype=torch.bool, device=dev)
        full_arg = torch.full((T,), -1, dtype=torch.int64, device=dev)
        if cand_topk:
            top_i = torch.empty(pidx.numel(), cand_topk, dtype=torch.int64, device=dev)
            top_p = torch.empty(pidx.numel(), cand_topk, device=dev)
        else:
            p_all = torch.empty(pidx.numel(), Vd, device=dev)
        for c0 in range(0, pidx.numel(), 256):
            pp = pidx[c0:c0 + 256]
            full = fin[pp] @ lm_target.T                                  # [<=256, Vt]
            fa = full.argmax(-1)
            full_arg[pp] = fa
            in_t2d[pp] = t2d[fa]
            pd = torch.softmax(full[:, used], -1)
            if cand_topk:
                v, i = torch.topk(pd, cand_topk, -1)
                top_i[c0:c0 + 256] = i
                top_p[c0:c0 + 256] = v / v.sum(-1, keepdim=True)
            else:
                p_all[c0:c0 + 256] = pd
    R = T - 2
    # rows whose outputs are read: step 0 where token t+2 is in the loss,
    # steps >= 1 where some later token t+2+j is (prompt rows only give keys)
    need1 = torch.zeros(R, dtype=torch.bool, device=dev)
    for j in range(1, ttt):
        if R - j > 0:
            need1[:R - j] |= mask[2 + j:T]
    need0 = mask[2:T].clone() | need1
    hs = model.ttt_forward(aux, ids, ttt, need0, need1)
    rows = torch.arange(R, device=dev)
    total, stats = None, {"rows": [], "loss": [], "acc": []}
    for j, h in enumerate(hs):
        pos_t = rows + 1 + j                 # target distribution position
        ok = (rows + 2 + j <= T - 1)
        ok &= mask[(rows + 2 + j).clamp(max=T - 1)]
        ok &= in_t2d[pos_t.clamp(max=T - 1)]
        sel = rows[ok]
        if sel.numel() == 0:
            stats["rows"].append(0)
            stats["loss"].append(float("nan"))
            stats["acc"].append(float("nan"))
            continue
        sl = slot[sel + 1 + j]
        if cand_topk:
            ti, tp = top_i[sl], top_p[sl]                                 # [n, K]
            cand = ti.flatten()
            if cand_random:
                cand = torch.cat([cand, torch.randint(0, Vd, (cand_random,), generator=gen).to(dev)])
            C, inv = torch.unique(cand, return_inverse=True)
            inv = inv[:ti.numel()].view_as(ti)
            z = model.norm(h[sel])
            logq = torch.log_softmax(z @ model.lm_head.weight[C].T, -1)  # [n, |C|]
            l = -(tp * logq.gather(1, inv)).sum(-1).mean()
            hit = logq.argmax(-1) == inv[:, 0]
        else:
            p = p_all[sl]                                                 # [n, Vd]
            logq = torch.log_softmax(model.logits(h[sel]), -1)
            l = -(p * logq).sum(-1).mean()
            hit = logq.argmax(-1) == p.argmax(-1)
        total = l * decay ** j if total is None else total + l * decay ** j
        stats["rows"].append(int(sel.numel()))
        stats["loss"].append(float(l.detach()))
        stats["acc"].append(float(hit.float().mean()))
    if measure:
        with torch.no_grad():
            base = rows[(rows + 2 <= T - 1) & mask[(rows + 2).clamp(max=T - 1)]]
            cum = torch.ones(base.numel(), dtype=torch.bool, device=dev)
            accepted = 0
            stats["acc_full_rows"], stats["acc_full_hits"] = [], []
            for j, h in enumerate(hs):
                nxt = (base + 2 + j).clamp(max=T - 1)
                valid = (base + 2 + j <= T - 1) & mask[nxt]
                pred = used[model.logits(h[base]).argmax(-1)]
                right = pred == full_arg[(base + 1 + j).clamp(max=T - 1)]
                stats["acc_full_rows"].append(int(valid.sum()))
                stats["acc_full_hits"].append(int((valid & right).sum()))
                cum &= valid & right
                accepted += int(cum.sum())
        stats["tau_rows"] = int(base.numel())
        stats["tau_sum"] = int(base.numel()) + accepted
    return total, stats


# ------------------------------------------------------------ checkpoint ---

def latest_ckpt(run):
    for fn in sorted(glob.glob(os.path.join(run, "ckpt", "step_*.pt")), reverse=True):
        try:
            return torch.load(fn, map_location="cpu", weights_only=False), fn
        except Exception as e:  # a torn file from a killed session
            print(f"train: skipping unreadable checkpoint {fn}: {e}", file=sys.stderr)
    return None, None


def save_ckpt(run, state, keep=2):
    d = os.path.join(run, "ckpt")
    os.makedirs(d, exist_ok=True)
    fn = os.path.join(d, f"step_{state['step']:08d}.pt")
    torch.save(state, fn + ".tmp")
    os.replace(fn + ".tmp", fn)
    for old in sorted(glob.glob(os.path.join(d, "step_*.pt")))[:-keep]:
        os.remove(old)
    return fn


# ---------------------------------------------------------------- export ---

def f32_to_bf16(t):
    return t.detach().cpu().to(torch.float32).to(torch.bfloat16)


def export_head(model, layer_cfg, d2t, t2d, out, card: dict, include_lm_head=True,
                aux_layer_ids=None):
    """Write the speculators-layout head into `out`."""
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    c = model.cfg
    lc = dict(layer_cfg)
    lc.update({"num_hidden_layers": 1, "hidden_size": c.hidden_size,
               "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
               "head_dim": c.head_dim, "intermediate_size": c.intermediate_size,
               "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
               "vocab_size": c.target_vocab_size, "attention_bias": False,
               "mlp_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
               "torch_dtype": "bfloat16"})
    n_layers = layer_cfg.get("num_hidden_layers", 30)
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": lc,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": aux_layer_ids or [2, n_layers // 2, n_layers - 3],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": card.get("ttt", 3),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": card.get("target_name", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                         "architectures": layer_cfg.get("architectures", ["LlamaForCausalLM"])},
        },
    }
    t = {k: f32_to_bf16(v).contiguous() for k, v in model.export_tensors(include_lm_head).items()}
    t["d2t"] = d2t.to(torch.int64).contiguous()
    t["t2d"] = t2d.to(torch.bool).contiguous()
    save_file(t, os.path.join(out, "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(os.path.join(out, "model.safetensors.tmp"), os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(model_card(card))


def model_card(card):
    lines = [
        f"# EAGLE-3 draft head for {card.get('target_name', 'the target')}",
        "",
        "Speculators layout (`layers.0.*`), bf16, `d2t` (offsets) and `t2d` inside.",
        f"Draft vocabulary: {card.get('draft_vocab')} of {card.get('target_vocab')} target tokens.",
        "Trained with tools/train_eagle3/train.py (training-time test, soft targets from the",
        "target restricted to t2d, rows whose target argmax is outside t2d masked).",
        "",
        "| item | value |", "|---|---|",
    ]
    for k in ("dump", "samples", "tokens", "loss_tokens", "steps", "tokens_seen", "wall_time_s",
              "ttt", "ttt_decay", "lr", "min_lr_ratio", "warmup", "weight_decay", "grad_clip",
              "tokens_per_step", "max_len", "freeze_lm_head", "cand_topk", "cand_random", "seed",
              "final_loss", "final_acc", "final_acc_full_vocab",
              "final_tau_est_train",
              "command"):
        if k in card:
            lines.append(f"| {k} | {card[k]} |")
    lines += ["", "## Measured acceptance", "",
              "To be filled in by the measurement run (acceptance length at k = 1..5, greedy,",
              "chat template; gsm8k_test and MT-bench first turns).", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ main ---

def exported_as_ckpt(model, head_dir):
    """An exported head (speculators layout: `head_dir`/model.safetensors, as
    export_head writes it, e.g. a committed draft/heads/ directory) as the
    checkpoint dict init_weights reads: the model's parameter names
    (model.export_tensors names them in the speculators layout; bf16 values
    widened to f32), and its own d2t, so that lm_head is taken only under the
    same vocabulary map."""
    from safetensors.torch import load_file
    try:
        t = load_file(os.path.join(head_dir, "model.safetensors"))
    except Exception as e:   # noqa: BLE001 - any unreadable file is a refusal
        sys.exit(f"train: --init-from {head_dir}: cannot load model.safetensors: {e}")
    name_of = {p.data_ptr(): n for n, p in model.named_parameters()}
    sd = {}
    for k, v in model.export_tensors(True).items():
        if k in t:
            sd[name_of[v.data_ptr()]] = t[k].to(torch.float32)
    ck = {"model": sd, "step": "exported head", "args": {"vocab_map": None}}
    if "d2t" in t:
        ck["d2t"] = t["d2t"].to(torch.int64)
    return ck


def init_weights(model, src, cfg, d2t):
    """Warm start: copy the draft weights of checkpoint `src` (a .pt file, or a run
    directory whose newest checkpoint is used) into `model`.  Every tensor must
    match in name and shape (a different target or draft width is refused).
    lm_head is the exception: it is taken only when the source was trained
    against the same d2t; otherwise this run keeps its own initialisation (the
    target's rows of ITS draft vocabulary), since row i means a different
    token under another map.  The optimiser, step and schedule are not copied.
    `src` may also be an exported head directory (model.safetensors, no ckpt/):
    its bf16 weights start the run (exported_as_ckpt)."""
    if os.path.isdir(src) and not os.path.isdir(os.path.join(src, "ckpt")) and \
            os.path.exists(os.path.join(src, "model.safetensors")):
        ck, fn = exported_as_ckpt(model, src), os.path.join(src, "model.safetensors")
    elif os.path.isdir(src):
        ck, fn = latest_ckpt(src)
        if ck is None:
            sys.exit(f"train: --init-from {src}: no loadable checkpoint in {src}/ckpt")
    else:
        try:
            ck, fn = torch.load(src, map_location="cpu", weights_only=False), src
        except Exception as e:   # noqa: BLE001 - any unreadable file is a refusal
            sys.exit(f"train: --init-from {src}: cannot load: {e}")
    sd = ck.get("model") if isinstance(ck, dict) else None
    if not isinstance(sd, dict):
        sys.exit(f"train: --init-from {fn}: not a train.py checkpoint (no model state)")
    own = model.state_dict()
    src_cfg = ck.get("cfg", {})
    same_map = False
    try:
        src_map = ck["args"]["vocab_map"]
        src_d2t = ck["d2t"] if "d2t" in ck else load_vocab_map(src_map, cfg.target_vocab_size)[0]
        same_map = src_d2t.shape == d2t.shape and bool(torch.equal(src_d2t, d2t))
    except (KeyError, TypeError, OSError, SystemExit, RuntimeError, ValueError):
        same_map = False
    load = {}
    for k, v in sd.items():
        if k not in own:
            continue
        if tuple(v.shape) != tuple(own[k].shape):
            sys.exit(f"train: --init-from {fn}: {k} has shape {tuple(v.shape)}, this model {tuple(own[k].shape)}"
                     f" (source cfg {src_cfg})")
        if k == "lm_head.weight" and not same_map:
            continue
        load[k] = v
    missing = [k for k in own if k not in sd and k != "lm_head.weight"]
    if missing:
        sys.exit(f"train: --init-from {fn}: missing {missing}")
    model.load_state_dict(load, strict=False)   # copies onto the model's device
    print(f"train: initialised from {fn} (step {ck.get('step')}; {len(load)} tensors"
          f"{'' if same_map else ', lm_head from this run: another vocab map'})")


def lr_at(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    prog = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="train an EAGLE-3 head on a specd hidden-state dump")
    ap.add_argument("--run", required=True, help="run directory (checkpoints, log, export)")
    ap.add_argument("--dump", action="append",
                    help="dump directory; repeat (or comma-separate) to train on several")
    ap.add_argument("--vocab-map")
    ap.add_argument("--gguf")
    ap.add_argument("--target-config")
    ap.add_argument("--target-embed")
    ap.add_argument("--target-lm-head")
    ap.add_argument("--target-name", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--ttt-decay", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=0.5)
    ap.add_argument("--tokens-per-step", type=int, default=2048,
                    help="accumulate samples until this many tokens per optimiser step")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--freeze-lm-head", action="store_true")
    ap.add_argument("--cand-topk", type=int, default=0,
                    help="0: exact soft CE over the whole draft vocab; K: candidate-set CE over the "
                         "target's top-K per row (union over the sample) + --cand-random negatives")
    ap.add_argument("--cand-random", type=int, default=0)
    ap.add_argument("--norm-before-residual", action="store_true")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--export-dir")
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--no-export-lm-head", action="store_true",
                    help="omit lm_head from the export (only sensible with --freeze-lm-head)")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="seconds of training in this invocation (0: none); then checkpoint and export")
    ap.add_argument("--init-from", default=None,
                    help="warm start: a checkpoint file or run directory (its newest checkpoint) whose "
                         "draft weights start this NEW run (fresh optimiser, step 0, this run's schedule)")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop (after checkpointing) once this step is reached; for tests")
    return ap.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    os.makedirs(a.run, exist_ok=True)
    ck, ck_fn = latest_ckpt(a.run)
    if ck is not None:
        # a resumed run keeps the arguments that shape the model, the data and
        # the schedule; only --steps, --stop-after, --export-* and logging
        # options may change between sessions.
        keep = {"run", "steps", "stop_after", "time_limit", "export_dir", "export_only",
                "no_export_lm_head", "threads", "device", "log_every", "ckpt_every"}
        if a.dump:   # dumps may grow or be added between sessions (the epoch order then changes)
            keep.add("dump")
        for k, v in ck["args"].items():
            if k not in keep:
                setattr(a, k, v)
        print(f"train: resuming from {ck_fn} (step {ck['step']})")
    elif a.export_only:
        sys.exit(f"train: --export-only but no checkpoint in {a.run}/ckpt")
    if not a.dump or not a.vocab_map or not (a.gguf or a.target_config):
        sys.exit("train: need --dump, --vocab-map and --gguf or --target-config/--target-embed")

    layer_cfg, embed, lm_target = load_target(a)
    d2t, t2d = load_vocab_map(a.vocab_map, embed.shape[0])
    used = torch.arange(d2t.shape[0]) + d2t
    dumps = [d for x in a.dump for d in x.split(",") if d] if isinstance(a.dump, list) else a.dump.split(",")
    a.dump = dumps
    data = MultiDump(dumps) if len(dumps) > 1 else DumpReader(dumps[0])
    man = data.manifest
    if int(man["target"]["hidden_size"]) != layer_cfg["hidden_size"]:
        sys.exit("train: dump hidden size differs from the target's")
    cfg = DraftConfig(
        hidden_size=layer_cfg["hidden_size"], target_hidden_size=int(man["target"]["hidden_size"]),
        num_heads=layer_cfg["num_attention_heads"], num_kv_heads=layer_cfg["num_key_value_heads"],
        head_dim=layer_cfg["head_dim"], intermediate_size=layer_cfg["intermediate_size"],
        rms_norm_eps=layer_cfg["rms_norm_eps"], rope_theta=layer_cfg["rope_theta"],
        draft_vocab_size=d2t.shape[0], target_vocab_size=embed.shape[0],
        norm_before_residual=a.norm_before_residual)
    torch.manual_seed(a.seed)
    model = Eagle3Train(cfg, embed, lm_target[used].clone())
    dev = torch.device(a.device)
    model.to(dev)
    lm_target, d2t_dev, t2d_dev = lm_target.to(dev), d2t.to(dev), t2d.to(dev)
    model.lm_head.weight.requires_grad_(not a.freeze_lm_head)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay)
    step, cursor, tokens_seen, wall = 0, 0, 0, 0.0
    if ck is not None:
        model.load_state_dict(ck["model"], strict=False)   # copies onto dev
        opt.load_state_dict(ck["opt"])
        step, cursor, tokens_seen, wall = ck["step"], ck["cursor"], ck["tokens_seen"], ck["wall"]
        torch.set_rng_state(ck["torch_rng"])
    elif a.init_from:
        init_weights(model, a.init_from, cfg, d2t)
    n = len(data)
    perm_cache = {}

    def sample_at(c):
        ep = c // n
        if ep not in perm_cache:
            perm_cache.clear()
            perm_cache[ep] = np.random.Generator(np.random.PCG64(a.seed * 1000003 + ep)).permutation(n)
        return int(perm_cache[ep][c % n])

    card = {"target_name": a.target_name, "dump": a.dump, "samples": n,
            "tokens": man.get("n_tokens"), "loss_tokens": man.get("n_loss_tokens"),
            "draft_vocab": cfg.draft_vocab_size, "target_vocab": cfg.target_vocab_size,
            "ttt": a.ttt, "ttt_decay": a.ttt_decay, "lr": a.lr, "min_lr_ratio": a.min_lr_ratio,
            "warmup": a.warmup, "weight_decay": a.weight_decay, "grad_clip": a.grad_clip,
            "tokens_per_step": a.tokens_per_step, "max_len": a.max_len,
            "freeze_lm_head": a.freeze_lm_head, "seed": a.seed,
            "cand_topk": a.cand_topk, "cand_random": a.cand_random,
            "command": "tools/train_eagle3/train.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    export_dir = a.export_dir or os.path.join(a.run, "export")

    def state():
        return {"step": step, "cursor": cursor, "tokens_seen": tokens_seen, "wall": wall,
                "model": {k: v for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
                "torch_rng": torch.get_rng_state(), "args": vars(a), "cfg": cfg.to_dict()}

    log = open(os.path.join(a.run, "log.jsonl"), "a")
    last = {}
    t_session = time.time()
    while not a.export_only and step < a.steps:
        if a.time_limit and time.time() - t_session > a.time_limit:
            save_ckpt(a.run, state())
            print(f"train: --time-limit {a.time_limit:g} s reached at step {step}; checkpointed")
            break
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        opt.zero_grad(set_to_none=True)
        got, agg = 0, {"rows": [0] * a.ttt, "loss": [0.0] * a.ttt, "acc": [0.0] * a.ttt}
        measure = (step + 1) % a.log_every == 0 or step == 0
        tau_rows = tau_sum = 0
        af_rows, af_hits = [0] * a.ttt, [0] * a.ttt
        gen = torch.Generator().manual_seed(a.seed * 1000003 + step)
        while got < a.tokens_per_step:
            s = data.get(sample_at(cursor))
            cursor += 1
            T = min(a.max_len, s["input_ids"].shape[0])
            got += T
            loss, st = sample_loss(model, s, d2t_dev, t2d_dev, lm_target, a.ttt, a.ttt_decay,
                                   a.max_len, measure, cand_topk=a.cand_topk,
                                   cand_random=a.cand_random, gen=gen)
            tau_rows += st.get("tau_rows", 0)
            tau_sum += st.get("tau_sum", 0)
            for j, (r_, h_) in enumerate(zip(st.get("acc_full_rows", []), st.get("acc_full_hits", []))):
                af_rows[j] += r_
                af_hits[j] += h_
            if loss is None:
                continue
            # weight each sample by its tokens so the step averages per token
            (loss * T / a.tokens_per_step).backward()
            for j in range(a.ttt):
                r = st["rows"][j]
                if r:
                    agg["rows"][j] += r
                    agg["loss"][j] += st["loss"][j] * r
                    agg["acc"][j] += st["acc"][j] * r
        gn = float(torch.nn.utils.clip_grad_norm_(params, a.grad_clip))
        opt.step()
        step += 1
        tokens_seen += got
        wall += time.time() - t0
        last = {"step": step, "lr": lr_at(step - 1, a), "grad_norm": gn,
                "loss": [agg["loss"][j] / agg["rows"][j] if agg["rows"][j] else None for j in range(a.ttt)],
                "acc": [agg["acc"][j] / agg["rows"][j] if agg["rows"][j] else None for j in range(a.ttt)],
                "rows": agg["rows"], "tokens": got, "wall": round(wall, 2)}
        if tau_rows:
            last["tau_est"] = tau_sum / tau_rows
            last["acc_full"] = [h_ / r_ if r_ else None for h_, r_ in zip(af_hits, af_rows)]
        log.write(json.dumps(last) + "\n")
        log.flush()
        if step % a.log_every == 0 or step == 1:
            print(f"step {step} lr {last['lr']:.2e} loss {[round(x, 4) if x is not None else None for x in last['loss']]}"
                  f" acc {[round(x, 3) if x is not None else None for x in last['acc']]} gn {gn:.2f}"
                  f" tau_est {last.get('tau_est', float('nan')):.3f}"
                  f" acc_full {[round(x, 3) if x is not None else None for x in last.get('acc_full', [])]}"
                  f" {got / max(1e-9, time.time() - t0):.0f} tok/s", flush=True)
        if step % a.ckpt_every == 0 or step == a.steps:
            save_ckpt(a.run, state())
        if a.stop_after is not None and step >= a.stop_after:
            save_ckpt(a.run, state())
            print(f"train: stopped at step {step} (--stop-after)")
            return
    card.update({"steps": step, "tokens_seen": tokens_seen, "wall_time_s": round(wall, 1)})
    if last:
        card["final_loss"] = last["loss"]
        card["final_acc"] = last["acc"]
        if "acc_full" in last:
            card["final_acc_full_vocab"] = last["acc_full"]
        if "tau_est" in last:
            card["final_tau_est_train"] = round(last["tau_est"], 3)
    aux_ids = man.get("aux_layer_ids")
    if aux_ids and man.get("aux_layer_convention", "input") == "output":
        aux_ids = [i + 1 for i in aux_ids]   # speculators ids are "input to layer i"
    export_head(model, layer_cfg, d2t, t2d, export_dir, card,
                include_lm_head=not a.no_export_lm_head, aux_layer_ids=aux_ids)
    print(f"train: exported step {step} to {export_dir}")


if __name__ == "__main__":
    main()
