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

    def ttt_forward(self, aux, ids, ttt: int):
        """aux f32 [T, 3H_t], ids int64 [T] -> list over steps j < ttt of
        pre-norm h_j [R, H] (R = T-2).  Logits are left to the caller (only
        the rows in the loss need the lm_head)."""
        c = self.cfg
        T = ids.shape[0]
        R = T - 2
        rep = c.num_heads // c.num_kv_heads
        rows = torch.arange(R, device=ids.device)
        scale = 1.0 / math.sqrt(c.head_dim)
        causal = rows[None, :] <= rows[:, None]                       # [R, R]
        g = self.fc(aux[:R])
        hs, diag_k, diag_v = [], [], []
        k0 = v0 = None
        for j in range(ttt):
            tok_idx = (rows + 1 + j).clamp(max=T - 1)
            tok = torch.where(rows + 1 + j <= T - 1, ids[tok_idx], torch.zeros_like(rows))
            q, k, v, residual = self._qkv(g, tok, rows + j)
            if j == 0:
                k0, v0 = k, v
            else:
                diag_k.append(k)
                diag_v.append(v)
            K0 = k0.repeat_interleave(rep, 1)                          # [R, nh, D]
            V0 = v0.repeat_interleave(rep, 1)
            s0 = torch.einsum("rhd,shd->hrs", q, K0) * scale
            s0 = s0.masked_fill(~causal[None], float("-inf"))
            if diag_k:
                Kd = torch.stack(diag_k, 0).repeat_interleave(rep, 2)  # [j, R, nh, D]
                Vd = torch.stack(diag_v, 0).repeat_interleave(rep, 2)
                sd = torch.einsum("rhd,jrhd->hrj", q, Kd) * scale     # [nh, R, j]
                p = torch.softmax(torch.cat([s0, sd], -1), -1)
                a = torch.einsum("hrs,shd->rhd", p[..., :R], V0) + \
                    torch.einsum("hrj,jrhd->rhd", p[..., R:], Vd)
            else:
                p = torch.softmax(s0, -1)
                a = torch.einsum("hrs,shd->rhd", p, V0)
            h = self._tail(a, residual)
            hs.append(h)
            g = h
        return hs

    def logits(self, h):
        return self.lm_head(self.norm(h))
