"""EAGLE-3 draft head: an independent PyTorch reference forward (float64).

What it owns: loading an EAGLE-3 head directory in either checkpoint layout
(SafeAILab/SpecForge `midlayer.*`, speculators `layers.0.*`), and the draft
forward of REFERENCE.md section 2 / the EAGLE-3 paper (Li et al. 2025,
"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"), in float64 so that it is the ground truth the C draft
(f32 compute, bf16 weights) is compared against.  Written only from the paper
and REFERENCE.md section 2; tools/eagle3/NOTES.md records how it was checked
against the `speculators` package.

The forward of the single draft layer, per position (H = draft hidden):
  1. g = fc(concat(h_low, h_mid, h_high))   only for target features; fc has
     no bias, [H, 3*H_target].  A fed-back draft output skips this step.
  2. residual = g, or hidden_norm(g) when config norm_before_residual is true
     (missing key = false).
  3. x = concat(input_layernorm(embed(token)), hidden_norm(g))   [2H],
     the EMBEDDING half first.
  4. q/k/v = x @ W^T (+ bias when attention_bias; o_proj then has one too,
     as in HF Llama) from 2H; GQA; NeoX
     rotate_half RoPE with rope_theta (default 10000 when absent); causal
     attention over the draft's own KV cache; o_proj heads*head_dim -> H.
  5. h = residual + attn;  h = h + down(silu(gate(n)) * up(n)), n =
     post_attention_layernorm(h).
  6. h (pre-norm) is the next step's g.
  7. logits = lm_head(norm(h))  [draft_vocab_size].

Alignment (the convention specd uses, documented in NOTES.md): the draft
consumes pairs (target feature at position t, token at t+1) and the pair is
given rotary position t.  A fed-back step for the pair (draft output at
position p, sampled token) gets position p+1.

Vocabulary: d2t int64 [draft_vocab] is an OFFSET, target_id = draft_id +
d2t[draft_id]; the token fed back to the embedding is the TARGET id.

Threading: none; pure functions over tensors.  Not used by CI (needs torch).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

DTYPE = torch.float64


# ---------------------------------------------------------------- config ---

@dataclass
class Eagle3Config:
    """Everything the forward needs, normalised from either layout."""
    layout: str                 # "speculators" | "eagle"
    hidden_size: int            # H, the draft's hidden size
    target_hidden_size: int     # H_target (fc input is 3 * this)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float           # 10000.0 when the config has none
    attention_bias: bool
    norm_before_residual: bool  # missing = False
    draft_vocab_size: int
    target_vocab_size: int
    aux_layer_ids: list = field(default_factory=list)


def _rope_theta(layer_cfg: dict) -> float:
    """rope_theta from a Llama config: top level, else transformers-v5
    `rope_parameters.rope_theta`, else the Llama default 10000."""
    if layer_cfg.get("rope_theta") is not None:
        return float(layer_cfg["rope_theta"])
    rp = layer_cfg.get("rope_parameters")
    if isinstance(rp, dict) and rp.get("rope_theta") is not None:
        return float(rp["rope_theta"])
    return 10000.0


def parse_config(cfg: dict) -> Eagle3Config:
    """Normalise a head's config.json (either layout) into Eagle3Config."""
    if cfg.get("speculators_model_type") == "eagle3":
        layout = "speculators"
        lc = cfg["transformer_layer_config"]
        top = cfg
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or []
    else:
        layout = "eagle"
        lc = cfg
        top = cfg
        aux = (cfg.get("eagle_aux_hidden_state_layer_ids")
               or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
               or [])
    H = int(lc["hidden_size"])
    nh = int(lc["num_attention_heads"])
    nkv = int(lc.get("num_key_value_heads") or nh)
    hd = int(lc.get("head_dim") or H // nh)
    return Eagle3Config(
        layout=layout,
        hidden_size=H,
        target_hidden_size=int(top.get("target_hidden_size") or H),
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=int(lc["intermediate_size"]),
        rms_norm_eps=float(lc.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(lc),
        attention_bias=bool(lc.get("attention_bias", False)),
        norm_before_residual=bool(top.get("norm_before_residual", False)),
        draft_vocab_size=int(top["draft_vocab_size"]),
        target_vocab_size=int(lc["vocab_size"]),
        aux_layer_ids=list(aux),
    )


# --------------------------------------------------------------- weights ---

LAYER_KEYS = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "hidden_norm.weight",
    "post_attention_layernorm.weight",
]
# attention_bias (HF Llama semantics): q, k, v AND o_proj carry a bias.
BIAS_KEYS = ["self_attn.q_proj.bias", "self_attn.k_proj.bias",
             "self_attn.v_proj.bias", "self_attn.o_proj.bias"]


class Eagle3Head:
    """A loaded head: config + float64 tensors under layout-neutral names
    (`layer.<key>`, `fc`, `norm`, `lm_head`, `embed`, `d2t`, `t2d`)."""

    def __init__(self, cfg: Eagle3Config, w: dict):
        self.cfg = cfg
        self.w = w

    @staticmethod
    def load(path: str, target_embed: np.ndarray | None = None) -> "Eagle3Head":
        """Load `path`/config.json + `path`/*.safetensors.

        target_embed: f32/f64 [target_vocab, H] used when the head has no
        `embed_tokens.weight`, and (rows selected through d2t) when it has no
        `lm_head.weight` (SmolLM2 ties lm_head to the embedding)."""
        from safetensors.numpy import load_file
        with open(os.path.join(path, "config.json")) as f:
            cfg = parse_config(json.load(f))
        raw = {}
        for fn in sorted(os.listdir(path)):
            if fn.endswith(".safetensors"):
                raw.update(_load_st(os.path.join(path, fn)))
        prefix = "layers.0." if cfg.layout == "speculators" else "midlayer."
        w = {}
        for k in LAYER_KEYS:
            w["layer." + k] = _f64(raw[prefix + k])
        if cfg.attention_bias:
            for k in BIAS_KEYS:
                w["layer." + k] = _f64(raw[prefix + k])
        w["fc"] = _f64(raw["fc.weight"])
        w["norm"] = _f64(raw["norm.weight"])
        d2t = raw.get("d2t")
        if d2t is None:
            d2t = np.zeros(cfg.draft_vocab_size, dtype=np.int64)
        w["d2t"] = torch.from_numpy(np.asarray(d2t, dtype=np.int64))
        if "t2d" in raw:
            w["t2d"] = torch.from_numpy(np.asarray(raw["t2d"], dtype=bool))
        emb = raw.get("embed_tokens.weight")
        if emb is None:
            if target_embed is None:
                raise ValueError("head has no embed_tokens.weight: pass target_embed")
            emb = target_embed
        w["embed"] = _f64(emb)
        if "lm_head.weight" in raw:
            w["lm_head"] = _f64(raw["lm_head.weight"])
        else:
            if target_embed is None:
                raise ValueError("head has no lm_head.weight: pass target_embed (tied)")
            rows = torch.arange(cfg.draft_vocab_size) + w["d2t"]
            w["lm_head"] = _f64(target_embed)[rows]
        return Eagle3Head(cfg, w)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """target_id = draft_id + d2t[draft_id] (offset semantics)."""
        return draft_ids + self.w["d2t"][draft_ids]


def _load_st(fn: str) -> dict:
    """safetensors -> numpy, bf16 widened to f32 exactly (numpy has no bf16)."""
    from safetensors import safe_open
    out = {}
    with safe_open(fn, framework="pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            if t.dtype == torch.bfloat16:
                t = t.to(torch.float32)
            out[k] = t.numpy()
    return out


def _f64(a) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.to(DTYPE)
    return torch.from_numpy(np.asarray(a)).to(DTYPE)


# --------------------------------------------------------------- forward ---

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * w  (Llama RMSNorm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_neox(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX / rotate_half RoPE.  x [T, heads, D], pos int [T].
    inv_freq[i] = theta^(-2i/D), i < D/2; angle = pos * inv_freq, duplicated
    over both halves; out = x*cos + rotate_half(x)*sin, rotate_half(x) =
    concat(-x[D/2:], x[:D/2])."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=DTYPE) / D))
    ang = pos.to(DTYPE)[:, None] * inv[None, :]            # [T, D/2]
    ang = torch.cat([ang, ang], dim=-1)[:, None, :]        # [T, 1, D]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * torch.cos(ang) + rot * torch.sin(ang)


class DraftCache:
    """The draft's own KV cache: keys/values after RoPE with their positions."""

    def __init__(self):
        self.k = None    # [S, n_kv, D]
        self.v = None    # [S, n_kv, D]
        self.pos = None  # [S] int64

    def truncate(self, n_pos: int):
        """Drop every entry at position >= n_pos (rollback of rejected
        draft positions before "draft extend" rewrites them)."""
        if self.k is not None:
            keep = self.pos < n_pos
            self.k, self.v, self.pos = self.k[keep], self.v[keep], self.pos[keep]

    def append(self, k, v, pos):
        if self.k is None:
            self.k, self.v, self.pos = k, v, pos.clone()
        else:
            self.k = torch.cat([self.k, k])
            self.v = torch.cat([self.v, v])
            self.pos = torch.cat([self.pos, pos])


def draft_layer(head: Eagle3Head, g: torch.Tensor, tokens: torch.Tensor,
                pos: torch.Tensor, cache: DraftCache, from_target: bool):
    """One draft forward over T positions.

    g: [T, 3*H_target] target features (from_target=True, fc applied) or
       [T, H] fed-back pre-norm draft outputs (from_target=False).
    tokens: int64 [T] TARGET vocabulary ids (embedding lookup).
    pos: int64 [T] rotary positions; causality is by position: a query at p
       sees every cached key with position <= p (the cache gets these T
       entries appended first).
    Returns (h [T, H] pre-norm output, logits [T, draft_vocab])."""
    c, w = head.cfg, head.w
    eps = c.rms_norm_eps
    L = lambda k: w["layer." + k]
    if from_target:
        g = g.to(DTYPE) @ w["fc"].T                                  # step 1
    g_n = rms_norm(g, L("hidden_norm.weight"), eps)
    residual = g_n if c.norm_before_residual else g                # step 2
    e = w["embed"][tokens]
    x = torch.cat([rms_norm(e, L("input_layernorm.weight"), eps), g_n], -1)  # step 3
    T = x.shape[0]
    q = x @ L("self_attn.q_proj.weight").T
    k = x @ L("self_attn.k_proj.weight").T
    v = x @ L("self_attn.v_proj.weight").T
    if c.attention_bias:
        q = q + L("self_attn.q_proj.bias")
        k = k + L("self_attn.k_proj.bias")
        v = v + L("self_attn.v_proj.bias")
    q = rope_neox(q.view(T, c.num_heads, c.head_dim), pos, c.rope_theta)
    k = rope_neox(k.view(T, c.num_kv_heads, c.head_dim), pos, c.rope_theta)
    v = v.view(T, c.num_kv_heads, c.head_dim)
    cache.append(k, v, pos)
    rep = c.num_heads // c.num_kv_heads
    K = cache.k.repeat_interleave(rep, dim=1)                      # [S, nh, D]
    V = cache.v.repeat_interleave(rep, dim=1)
    s = torch.einsum("thd,shd->hts", q, K) / math.sqrt(c.head_dim)
    mask = cache.pos[None, :] <= pos[:, None]                      # [T, S]
    s = s.masked_fill(~mask[None], float("-inf"))
    a = torch.einsum("hts,shd->thd", torch.softmax(s, -1), V)
    attn = a.reshape(T, c.num_heads * c.head_dim) @ L("self_attn.o_proj.weight").T
    if c.attention_bias:
        attn = attn + L("self_attn.o_proj.bias")
    h = residual + attn                                            # step 5
    n = rms_norm(h, L("post_attention_layernorm.weight"), eps)
    m = torch.nn.functional.silu(n @ L("mlp.gate_proj.weight").T) * (n @ L("mlp.up_proj.weight").T)
    h = h + m @ L("mlp.down_proj.weight").T
    logits = rms_norm(h, w["norm"], eps) @ w["lm_head"].T          # step 7
    return h, logits


def run_chain(head: Eagle3Head, feats, ids, k: int):
    """Prefill-like pass then k chained draft steps (greedy).

    feats: [N, 3*H_target] target features of positions 0..N-1.
    ids:   int [N] target token ids; ids[t+1] pairs with feats[t].  Step 0 consumes the N-1 pairs (feats[t], ids[t+1]) at
           positions t = 0..N-2; its logits[t] predict ids[t+2].
    Then draft step j = 1..k: g = h of the previous step's last position,
    token = d2t-mapped argmax of the previous logits, position N-2+j.
    Returns dict: prefill_h [N-1,H], prefill_logits [N-1,Vd],
    step_h [k,H], step_logits [k,Vd], draft_ids [k+1] (argmax draft ids: the
    first from the prefill's last row), target_ids [k+1] (mapped)."""
    feats = torch.as_tensor(np.asarray(feats), dtype=DTYPE)
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
    N = ids.shape[0]
    cache = DraftCache()
    pos = torch.arange(N - 1, dtype=torch.int64)
    h, logits = draft_layer(head, feats[: N - 1], ids[1:], pos, cache, True)
    out = {"prefill_h": h, "prefill_logits": logits}
    d = int(torch.argmax(logits[-1]))
    draft_ids, target_ids = [d], [int(head.draft_to_target(torch.tensor(d)))]
    g = h[-1:]
    sh, sl = [], []
    for j in range(1, k + 1):
        p = torch.tensor([N - 2 + j], dtype=torch.int64)
        tok = torch.tensor([target_ids[-1]], dtype=torch.int64)
        g, lg = draft_layer(head, g, tok, p, cache, False)
        sh.append(g[0])
        sl.append(lg[0])
        d = int(torch.argmax(lg[0]))
        draft_ids.append(d)
        target_ids.append(int(head.draft_to_target(torch.tensor(d))))
    out["step_h"] = torch.stack(sh) if sh else torch.zeros(0, head.cfg.hidden_size, dtype=DTYPE)
    out["step_logits"] = torch.stack(sl) if sl else torch.zeros(0, head.cfg.draft_vocab_size, dtype=DTYPE)
    out["draft_ids"] = draft_ids
    out["target_ids"] = target_ids
    return out


def gguf_token_embd(gguf_path: str) -> np.ndarray:
    """The target's token embedding [vocab, H] f32, dequantised from the GGUF
    with the `gguf` package (Q8_0 dequantisation is exact in f32)."""
    import gguf
    r = gguf.GGUFReader(gguf_path)
    for t in r.tensors:
        if t.name == "token_embd.weight":
            from gguf.quants import dequantize
            a = dequantize(t.data, t.tensor_type)
            return np.asarray(a, dtype=np.float32).reshape(int(t.shape[1]), int(t.shape[0]))
    raise KeyError("token_embd.weight not in " + gguf_path)
