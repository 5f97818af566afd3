"""numpy_forward.py: the Kimi / DeepSeek-V3 forward pass exactly as docs/kimi-k2.5.md describes it.

What it owns
    An executable form of the doc's "reference forward pass" section, in numpy float32, for the
    miniature: the C model follows the doc, and tests/kimi/test_numpy_forward.py checks that the doc
    (through this file) reproduces the transformers fixture (tests/fixtures/kimi/mini_logits.json).
    So a disagreement between C and the fixture can be located: doc wrong (this test fails) or C
    wrong (this test passes). It also holds the absorbed-MLA form of decode attention on the latent
    cache and checks it against the naive form.

Invariants
    * Written from the doc, not from transformers' code: RoPE rotates adjacent pairs (2i, 2i+1) in
      place with float32 angles; YaRN inv_freq from the doc's formula; q_a/kv_a RMSNorm eps 1e-6,
      the others rms_norm_eps; softmax scale (n + r)^-0.5 * mscale^2; sigmoid routing with the bias
      for selection only; experts dequantized as bf16(q * scale).
    * numpy + make_mini.py only (runs in CI's venv).
    * latent_bf16=True: the latent cache (c_kv after its norm, k_pe after RoPE) is rounded to
      bf16, round to nearest even, before attention reads it, as specd's bf16 latent cache does
      (model_load_opts.latent_bf16); q and everything else stay f32. Used by
      gen_bf16_latent_fixture.py for the reference of that variant.
Threading: none.
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_mini as mm  # noqa: E402

F = np.float32


def load_weights(seed: int) -> dict:
    """Canonical-name -> float32 array (experts dequantized), from the generator in memory."""
    W, parts = {}, {}
    pre = "language_model.model."
    for _, name, arr, dt in mm.build_tensors(seed):
        name = "model." + name[len(pre):] if name.startswith(pre) else name.replace("language_model.", "")
        if ".mlp.experts." in name:
            base, leaf = name.rsplit(".", 1)
            parts.setdefault(base, {})[leaf] = arr
            if len(parts[base]) == 3:
                p = parts.pop(base)
                W[base] = mm.dequant_int4(p["weight_packed"], p["weight_scale"], p["weight_shape"])
            continue
        W[name] = mm.bf16_bits_to_f32(arr) if dt == "BF16" else arr.astype(F)
    return W


def yarn_inv_freq(c: dict) -> tuple[np.ndarray, float, float]:
    """(inv_freq [r/2] f32, cos/sin scaling, softmax scale) per the doc's formulas."""
    rs, d, b = c["rope_scaling"], c["qk_rope_head_dim"], c["rope_theta"]
    f, L0 = rs["factor"], rs["original_max_position_embeddings"]

    def corr(n):
        return d * math.log(L0 / (n * 2 * math.pi)) / (2 * math.log(b))
    low = max(math.floor(corr(rs["beta_fast"])), 0)
    high = min(math.ceil(corr(rs["beta_slow"])), d - 1)
    if low == high:
        high += 0.001
    i = np.arange(d // 2, dtype=F)
    extra = F(1.0) / (F(b) ** (np.arange(0, d, 2, dtype=F) / F(d)))
    inter = extra / F(f)
    ramp = np.clip((i - F(low)) / F(high - low), 0, 1).astype(F)
    inv = (inter * ramp + extra * (F(1) - ramp)).astype(F)

    def msc(m):
        return 0.1 * m * math.log(f) + 1.0 if f > 1 else 1.0
    att = msc(rs["mscale"]) / msc(rs["mscale_all_dim"])
    scale = (c["qk_nope_head_dim"] + d) ** -0.5 * msc(rs["mscale_all_dim"]) ** 2
    return inv, att, scale


def bf16_round(x):
    """float32 -> nearest bf16 (ties to even), returned as float32 (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=F).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(F).reshape(np.shape(x))


def rmsnorm(x, w, eps):
    x = x.astype(F)
    return (w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F(eps)))).astype(F)


def rope_pairs(x, pos, inv, att):
    """Rotate adjacent pairs (2i, 2i+1) of the last axis in place; x [..., T, (heads,) r]."""
    ang = pos.astype(F)[:, None] * inv[None, :]                 # float32, as transformers
    c, s = (np.cos(ang) * F(att)).astype(F), (np.sin(ang) * F(att)).astype(F)
    if x.ndim == 3:                                              # [T, H, r]
        c, s = c[:, None, :], s[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = b * c + a * s
    return out


def silu(x):
    return x / (F(1) + np.exp(-x))


def mlp(h, W, p):
    return (silu(h @ W[p + "gate_proj.weight"].T) * (h @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T


class Mini:
    def __init__(self, seed: int = 0, cfg: dict | None = None, latent_bf16: bool = False):
        self.c = dict(cfg or mm.MINI)
        self.latent_bf16 = latent_bf16
        self.W = load_weights(seed)
        self.inv, self.att, self.scale = yarn_inv_freq(self.c)
        self.routes = {}

    def attention(self, h, L, pos, absorbed_check=False):
        c, W = self.c, self.W
        p = f"model.layers.{L}.self_attn."
        H, n, r, v, kvr = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                           c["v_head_dim"], c["kv_lora_rank"])
        T = h.shape[0]
        q = rmsnorm(h @ W[p + "q_a_proj.weight"].T, W[p + "q_a_layernorm.weight"], 1e-6)
        q = (q @ W[p + "q_b_proj.weight"].T).reshape(T, H, n + r)
        q_nope, q_pe = q[..., :n], rope_pairs(q[..., n:], pos, self.inv, self.att)
        kv = h @ W[p + "kv_a_proj_with_mqa.weight"].T
        ckv = rmsnorm(kv[:, :kvr], W[p + "kv_a_layernorm.weight"], 1e-6)   # the latent cache: ckv, k_pe
        k_pe = rope_pairs(kv[:, kvr:], pos, self.inv, self.att)
        if self.latent_bf16:
            ckv, k_pe = bf16_round(ckv), bf16_round(k_pe)
        kvb = (ckv @ W[p + "kv_b_proj.weight"].T).reshape(T, H, n + v)
        k_nope, val = kvb[..., :n], kvb[..., n:]
        s = (np.einsum("thd,shd->hts", q_nope, k_nope) + np.einsum("thd,sd->hts", q_pe, k_pe)) * F(self.scale)
        s = s + np.triu(np.full((T, T), -np.inf, dtype=F), 1)[None]
        s = np.exp(s - s.max(-1, keepdims=True))
        pr = (s / s.sum(-1, keepdims=True)).astype(F)
        o = np.einsum("hts,shd->thd", pr, val).reshape(T, H * v)
        if absorbed_check:
            # absorbed decode for the last token, on the latent only: W_UK, W_UV per head from kv_b
            wkb = W[p + "kv_b_proj.weight"].reshape(H, n + v, kvr)
            w_uk, w_uv = wkb[:, :n, :], wkb[:, n:, :]
            q_lat = np.einsum("hd,hdk->hk", q_nope[-1], w_uk)                   # [H, kvr]
            sc = (q_lat @ ckv.T + q_pe[-1] @ k_pe.T) * F(self.scale)            # [H, T]
            e = np.exp(sc - sc.max(-1, keepdims=True))
            o_lat = (e / e.sum(-1, keepdims=True)) @ ckv                        # [H, kvr]
            o_abs = np.einsum("hk,hdk->hd", o_lat, w_uv).reshape(H * v)
            err = float(np.abs(o_abs - o[-1]).max() / max(np.abs(o[-1]).max(), 1e-30))
            assert err < 1e-4, f"absorbed MLA differs from naive: {err}"
            self.absorbed_err = max(getattr(self, "absorbed_err", 0.0), err)
        return o @ W[p + "o_proj.weight"].T

    def moe(self, h, L):
        c, W = self.c, self.W
        p = f"model.layers.{L}.mlp."
        logits = h @ W[p + "gate.weight"].T
        s = (F(1) / (F(1) + np.exp(-logits))).astype(F)
        choice = s + W[p + "gate.e_score_correction_bias"]
        k = c["num_experts_per_tok"]
        idx = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(s, idx, -1)
        w = w / (w.sum(-1, keepdims=True) + F(1e-20)) * F(c["routed_scaling_factor"])
        self.routes[L] = (idx, w)
        out = mlp(h, W, p + "shared_experts.")
        for e in np.unique(idx):                        # each routed expert once, on its tokens
            t, j = np.nonzero(idx == e)
            pe = f"{p}experts.{e}."
            y = (silu(h[t] @ W[pe + "gate_proj"].T) * (h[t] @ W[pe + "up_proj"].T)) @ W[pe + "down_proj"].T
            out[t] += w[t, j][:, None] * y
        return out

    def forward(self, ids, keep_states=False, last_only=False, absorbed_check=False):
        c, W = self.c, self.W
        ids = np.asarray(ids)
        pos = np.arange(len(ids))
        x = W["model.embed_tokens.weight"][ids].astype(F)
        states = [x.copy()]
        for L in range(c["num_hidden_layers"]):
            pl = f"model.layers.{L}."
            x = x + self.attention(rmsnorm(x, W[pl + "input_layernorm.weight"], c["rms_norm_eps"]), L, pos,
                                   absorbed_check)
            h = rmsnorm(x, W[pl + "post_attention_layernorm.weight"], c["rms_norm_eps"])
            x = x + (mlp(h, W, pl + "mlp.") if L < c["first_k_dense_replace"] else self.moe(h, L))
            states.append(x.copy())
        xn = rmsnorm(x[-1:] if last_only else x, W["model.norm.weight"], c["rms_norm_eps"])
        logits = xn @ W["lm_head.weight"].T
        return (logits, states) if keep_states else logits
