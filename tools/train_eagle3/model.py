"""model.py: the trainable EAGLE-3 draft head and its training-time-test forward.

What it owns: an nn.Module with exactly the parameters of an exported head
(fc, one decoder layer `layers.0.*` with 2H-input q/k/v, norms, lm_head over
the draft vocabulary) plus the target's frozen embedding, and the TTT
forward of EAGLE-3 (Li et al. 2025, "Training-Time Test") used for training.

The per-position math is REFERENCE.md section 2 (same as
tools/eagle3/reference.py, which the exported head is checked against):
  g = fc(aux) (step 0 only); residual = g or hidden_norm(g)
  (norm_before_residual); x = [input_layernorm(embed(tok)), hidden_norm(g)];
  GQA attention with NeoX RoPE; h = residual + o_proj(attn);
  h += mlp(post_attention_layernorm(h)); logits = lm_head(norm(h)).

Training-time test for one sample of T tokens, R = T-2 rows:
  step 0, row t: (aux[t], ids[t+1]) at position t, causal over step-0 rows.
  step j, row t: (h_{j-1}[t], ids[t+1+j]) at position t+j; attends to step-0
  keys of rows <= t plus its own keys of steps 1..j (a diagonal): exactly
  what row t's draft chain sees at serve time.  Rows past the end get token
  0 and are never read by valid rows (causality) and never enter the loss.

Threading: none.  Shapes are written as [rows, ...]; one sample at a time.
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftConfig:
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    draft_vocab_size: int
    target_vocab_size: int
    norm_before_residual: bool = False
    max_position_embeddings: int = 8192

    def to_dict(self):
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, pos, theta):
    """NeoX rotate_half RoPE; x [R, heads, D], pos int [R]."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)[:, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * torch.cos(ang) + torch.cat([-x2, x1], -1) * torch.sin(ang)


class Eagle3Train(nn.Module):
    def __init__(self, cfg: DraftConfig, embed: torch.Tensor, lm_head_init: torch.Tensor | None):
        super().__init__()
        self.cfg = cfg
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.register_buffer("embed", embed.to(torch.float32), persistent=False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        if lm_head_init is not None:
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head_init)

    # export names (speculators layout) -> parameters
    def export_tensors(self, include_lm_head=True) -> dict:
        p = "layers.0."
        t = {
            "fc.weight": self.fc.weight,
            p + "self_attn.q_proj.weight": self.q_proj.weight,
            p + "self_attn.k_proj.weight": self.k_proj.weight,
            p + "self_attn.v_proj.weight": self.v_proj.weight,
            p + "self_attn.o_proj.weight": self.o_proj.weight,
            p + "mlp.gate_proj.weight": self.gate_proj.weight,
            p + "mlp.up_proj.weight": self.up_proj.weight,
            p + "mlp.down_proj.weight": self.down_proj.weight,
            p + "input_layernorm.weight": self.input_layernorm.weight,
            p + "hidden_norm.weight": self.hidden_norm.weight,
            p + "post_attention_layernorm.weight": self.post_attention_layernorm.weight,
            "norm.weight": self.norm.weight,
        }
        if include_lm_head:
            t["lm_head.weight"] = self.lm_head.weight
        return {k: v.detach() for k, v in t.items()}

    def _qkv(self, g, tok, pos):
        c = self.cfg
        R = g.shape[0]
        gn = self.hidden_norm(g)
        residual = gn if c.norm_before_residual else g
        x = torch.cat([self.input_layernorm(self.embed[tok]), gn], -1)
        q = rope(self.q_proj(x).view(R, c.num_heads, c.head_dim), pos, c.rope_theta)
        k = rope(self.k_proj(x).view(R, c.num_kv_heads, c.head_dim), pos, c.rope_theta)
        v = self.v_proj(x).view(R, c.num_kv_heads, c.head_dim)
        return q, k, v, residual

    def _tail(self, a, residual):
        c = self.cfg
        h = residual + self.o_proj(a.reshape(a.shape[0], c.num_heads * c.head_dim))
        n = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))

    def ttt_forward(self, aux, ids, ttt: int, need0=None, need1=None):
        """aux f32 [T, 3H_t], ids int64 [T] -> list over steps j < ttt of
        pre-norm h_j [R, H] (R = T-2).  Logits are left to the caller (only
        the rows in the loss need the lm_head).

        need0 / need1 (bool [R], optional): the rows whose output is read at
        step 0 / at steps >= 1 (need1 must imply need0: a row's chain starts at
        step 0).  Other rows still give their step-0 keys and values (every
        later row attends to them) but skip the query, attention output, MLP
        and all later steps; their h rows are returned as zeros.  None = all
        rows (the reference behaviour).  Prompt rows are ~half of a chat
        sample and never in the loss, so this halves the layer's work."""
        c = self.cfg
        T = ids.shape[0]
        R = T - 2
        rep = c.num_heads // c.num_kv_heads
        dev = ids.device
        rows = torch.arange(R, device=dev)
        S0 = rows if need0 is None else rows[need0[:R]]
        S1 = S0 if need1 is None else rows[need1[:R]]
        if need1 is not None and need0 is not None and bool((need1[:R] & ~need0[:R]).any()):
            raise ValueError("need1 must imply need0")
        full0 = S0.numel() == R
        scale = 1.0 / math.sqrt(c.head_dim)
        H = c.hidden_size
        # step 0: k, v for every row; q, attention and the tail only for S0
        g = self.fc(aux[:R])
        tok0 = ids[1:R + 1]
        gn = self.hidden_norm(g)
        x = torch.cat([self.input_layernorm(self.embed[tok0]), gn], -1)
        k0 = rope(self.k_proj(x).view(R, c.num_kv_heads, c.head_dim), rows, c.rope_theta)
        v0 = self.v_proj(x).view(R, c.num_kv_heads, c.head_dim)
        K0 = k0.repeat_interleave(rep, 1)                              # [R, nh, D]
        V0 = v0.repeat_interleave(rep, 1)
        xs = x if full0 else x[S0]
        q = rope(self.q_proj(xs).view(-1, c.num_heads, c.head_dim), S0, c.rope_theta)
        residual = gn if c.norm_before_residual else g
        residual = residual if full0 else residual[S0]
        s0 = torch.einsum("rhd,shd->hrs", q, K0) * scale
        s0 = s0.masked_fill(~(rows[None, :] <= S0[:, None])[None], float("-inf"))
        a = torch.einsum("hrs,shd->rhd", torch.softmax(s0, -1), V0)
        h = self._tail(a, residual)                                    # [|S0|, H]
        hs = [h if full0 else torch.zeros(R, H, device=dev, dtype=h.dtype).index_copy(0, S0, h)]
        if ttt == 1:
            return hs
        # steps >= 1 over S1: g = the row's previous output
        if S1.numel() != S0.numel():
            pos_in_s0 = torch.full((R,), -1, dtype=torch.int64, device=dev)
            pos_in_s0[S0] = torch.arange(S0.numel(), device=dev)
            g = h[pos_in_s0[S1]]
        else:
            g = h
        causal1 = (rows[None, :] <= S1[:, None])[None]                 # [1, |S1|, R]
        diag_k, diag_v = [], []
        for j in range(1, ttt):
            tok = torch.where(S1 + 1 + j <= T - 1, ids[(S1 + 1 + j).clamp(max=T - 1)], torch.zeros_like(S1))
            q, k, v, residual = self._qkv(g, tok, S1 + j)
            diag_k.append(k)
            diag_v.append(v)
            s0 = torch.einsum("rhd,shd->hrs", q, K0) * scale
            s0 = s0.masked_fill(~causal1, float("-inf"))
            Kd = torch.stack(diag_k, 0).repeat_interleave(rep, 2)      # [j, |S1|, nh, D]
            Vd = torch.stack(diag_v, 0).repeat_interleave(rep, 2)
            sd = torch.einsum("rhd,jrhd->hrj", q, Kd) * scale         # [nh, |S1|, j]
            p = torch.softmax(torch.cat([s0, sd], -1), -1)
            a = torch.einsum("hrs,shd->rhd", p[..., :R], V0) + \
                torch.einsum("hrj,jrhd->rhd", p[..., R:], Vd)
            g = self._tail(a, residual)
            hs.append(g if S1.numel() == R else
                      torch.zeros(R, H, device=dev, dtype=g.dtype).index_copy(0, S1, g))
        return hs

    def logits(self, h):
        return self.lm_head(self.norm(h))
