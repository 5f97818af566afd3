"""speculators_forward.py: run the `speculators` package's own Eagle3 model on
a head directory, on CPU, to cross-check tools/eagle3/reference.py.

What it owns: adapting one of our head directories (either layout) to
speculators' Eagle3DraftModel (v0.9.0) and recovering per-step logits from its
training-time-test forward.  speculators is not installed into any venv (it
pins torch <= 2.14 and pulls datasets/hs-connectors): pass the folder where its
wheel was unpacked; `datasets` and `hs_connectors`, imported only by its
training data module, are stubbed.  See NOTES.md for how the wheel was fetched.

How the chain is recovered from a teacher-forced TTT forward: speculators'
forward(hidden_states [1,T,3H], input_ids [1,T]) runs step 0 on all T pairs,
then for step j feeds index i the step j-1 output at i and the token
input_ids[i+j] (teacher forcing), attending to step-0 keys at indices <= i and
to its own earlier steps' keys at index i (diagonal).  For index i = N-2 (the
prompt's last pair) with input_ids = ids[1:] + [t_0, ..., t_{k-1}] (the target
ids the greedy chain fed back), step j at index N-2 is exactly chain step j.
The extra k rows' features are zeros; causality keeps them from touching
index <= N-2.  Logits are captured with a forward hook on lm_head.

Threading: none.  Needs torch + transformers (/work/venv-tools).
"""

import json
import os
import sys

import numpy as np
import torch


def _import_speculators(src: str):
    import tempfile
    shim = tempfile.mkdtemp(prefix="specd_spec_shim_")
    for name in ("datasets", "hs_connectors"):
        p = os.path.join(shim, name + ".py")
        if not os.path.exists(p):
            with open(p, "w") as f:
                f.write("# import-only stub for speculators' training data module\n"
                        "def __getattr__(n):\n    return type(n, (), {})\n")
    sys.path[:0] = [src, shim]
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    return Eagle3DraftModel, Eagle3SpeculatorConfig


def to_speculators_config(cfg: dict) -> dict:
    """An eagle-layout config.json -> the speculators shape (as speculators'
    own converter does: the Llama part becomes transformer_layer_config)."""
    if cfg.get("speculators_model_type") == "eagle3":
        return cfg
    lc = {k: v for k, v in cfg.items()
          if k not in ("draft_vocab_size", "target_hidden_size", "eagle_config",
                       "norm_before_residual", "architectures")}
    lc["architectures"] = ["LlamaForCausalLM"]
    lc["num_hidden_layers"] = 1
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": lc,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
        "target_hidden_size": cfg.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids":
            (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]},
        },
    }


def build_model(src: str, head_dir: str, target_embed: np.ndarray):
    """speculators Eagle3DraftModel in float64 with the head's weights, the
    target's embedding, and (when the head has none) the target's lm_head
    rows selected through d2t."""
    from safetensors import safe_open
    Model, Config = _import_speculators(src)
    with open(os.path.join(head_dir, "config.json")) as f:
        raw_cfg = json.load(f)
    sc = to_speculators_config(raw_cfg)
    sc = dict(sc)
    sc.pop("speculators_version", None)
    config = Config(**sc)
    config.transformer_layer_config._attn_implementation = "eager"
    model = Model(config=config)
    sd = {}
    with safe_open(os.path.join(head_dir, "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            sd[k.replace("midlayer.", "layers.0.")] = f.get_tensor(k)
    sd["embed_tokens.weight"] = torch.from_numpy(target_embed)
    if "lm_head.weight" not in sd:
        rows = torch.arange(config.draft_vocab_size) + sd["d2t"]
        sd["lm_head.weight"] = torch.from_numpy(target_embed)[rows]
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in sd.items()},
        strict=False)
    missing = [m for m in missing if not m.startswith("verifier_")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing} unexpected {unexpected}")
    model = model.to(torch.float64).eval()
    return model


@torch.no_grad()
def run_chain(model, feats, ids, chain_target_ids, position_base: int = 0):
    """Return (prefill_logits [N-1, Vd], step_logits [k, Vd]) from speculators.

    feats [N, 3H], ids [N] target ids, chain_target_ids [k]: the target ids
    the greedy chain fed back (from reference.run_chain's target_ids[:k]).
    position_base: 0 for specd's convention (pair (feat t, tok t+1) at
    position t); speculators' own training default is 1."""
    N = len(ids)
    k = len(chain_target_ids)
    T = N - 1 + k
    hs = torch.zeros(1, T, feats.shape[1], dtype=torch.float64)
    hs[0, : N - 1] = torch.as_tensor(np.asarray(feats[: N - 1]), dtype=torch.float64)
    inp = torch.tensor([list(np.asarray(ids[1:])) + list(chain_target_ids)], dtype=torch.long)
    pos = (position_base + torch.arange(T, dtype=torch.long)).unsqueeze(0)
    doc = torch.zeros(1, T, dtype=torch.long)
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o[0].clone()))
    try:
        model(hidden_states=hs, input_ids=inp, document_ids=doc, position_ids=pos,
              ttt_steps=k + 1)
    finally:
        hook.remove()
    prefill = captured[0][: N - 1]
    steps = torch.stack([captured[j][N - 2] for j in range(1, k + 1)]) if k else None
    return prefill, steps
