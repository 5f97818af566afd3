#!/usr/bin/env python3
"""reference.py: Hugging Face transformers' DeepseekV3 on the Kimi miniature -> tests/fixtures/kimi/.

What it owns
    The model-side reference outputs the C DeepSeek-V3 / Kimi implementation is tested against:
    logits at chosen positions, greedy continuations, per-layer hidden states and MoE routing
    of prompt 0, and the RoPE/YaRN numbers transformers uses. Nothing here is computed by specd.

How the reference is built (independent of specd)
    * config: the checkpoint's text_config mapped onto transformers.DeepseekV3Config
      (rope_scaling -> rope_parameters with rope_type "yarn"; rope_interleave True, the
      DeepSeek/Kimi default; num_nextn_predict_layers 0 -> no MTP layers).
    * weights: read with the `safetensors` package (safe_open, torch); the `language_model.`
      prefix stripped; bf16 tensors upcast to float32; each routed expert dequantized by
      compressed-tensors' own PackedQuantizationCompressor.decompress (bf16 result, upcast),
      then gate/up stacked into transformers' fused experts.gate_up_proj [E, 2*I, H] (gate
      first) and down into experts.down_proj [E, H, I]. load_state_dict(strict=True).
    * compute: float32, attn_implementation "eager", torch 1 thread.

Usage: reference.py --mini DIR [--out tests/fixtures/kimi] [--name mini_logits.json]
    (generate DIR with make_mini.py --seed 0; the wide8 variant: tests/kimi_c/make_minis.py OUT, then
    --mini OUT/wide8 --name mini_wide8_logits.json)
Threading: single-threaded.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from safetensors import safe_open
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check_pack  # noqa: E402
import kimi_tok as kt  # noqa: E402
import make_mini as mm  # noqa: E402

torch.set_num_threads(1)
N_GREEDY = 32
SEL_STRIDE = 2560            # 64 fixed vocabulary ids: 7 + k * 2560, k = 0..63
SEL_IDS = [7 + k * SEL_STRIDE for k in range(64)]

PROMPTS = [
    {"kind": "chat", "thinking": False,
     "messages": [{"role": "user", "content": "What is the capital of France? Answer briefly."}]},
    {"kind": "text", "text": "Hello, world! 你好，世界！ The quick brown fox jumps over 13 lazy dogs."},
    {"kind": "text", "text": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"},
    {"kind": "chat", "thinking": True,
     "messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "東京は日本の首都です。한국어도 조금 할 수 있어요? 🙂"}]},
]


def hf_config(text_cfg: dict) -> DeepseekV3Config:
    rs = text_cfg["rope_scaling"]
    rope = {"rope_type": rs.get("type", rs.get("rope_type")), "rope_theta": text_cfg["rope_theta"],
            "factor": rs["factor"], "original_max_position_embeddings": rs["original_max_position_embeddings"],
            "beta_fast": rs["beta_fast"], "beta_slow": rs["beta_slow"], "mscale": rs["mscale"],
            "mscale_all_dim": rs["mscale_all_dim"]}
    keys = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_shared_experts",
            "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
            "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
            "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
            "bos_token_id", "eos_token_id", "pad_token_id"]
    assert text_cfg["scoring_func"] == "sigmoid" and text_cfg["topk_method"] == "noaux_tc"
    assert text_cfg.get("moe_layer_freq", 1) == 1
    cfg = DeepseekV3Config(**{k: text_cfg[k] for k in keys}, rope_parameters=rope,
                           rope_interleave=True, num_mtp_layers=text_cfg.get("num_nextn_predict_layers", 0))
    cfg._attn_implementation = "eager"
    return cfg


def load_state(mini: str, cfg: DeepseekV3Config) -> dict:
    index = json.load(open(os.path.join(mini, "model.safetensors.index.json")))["weight_map"]
    raw = {}
    for fname in sorted(set(index.values())):
        with safe_open(os.path.join(mini, fname), framework="pt") as f:
            for k in f.keys():
                raw[k] = f.get_tensor(k)
    sd, experts = {}, {}
    for k, t in raw.items():
        name = k[len("language_model."):] if k.startswith("language_model.") else k
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name                         # the language_model.layers.* variant
        if ".mlp.experts." in name:
            base, leaf = name.rsplit(".", 1)               # ...experts.E.gate_proj, weight_packed
            experts.setdefault(base, {})[leaf] = t
            continue
        sd[name] = t.to(torch.float32)
    E, L = cfg.n_routed_experts, cfg.num_hidden_layers
    per = {}
    for base, parts in experts.items():
        w = PackedQuantizationCompressor.decompress(parts, check_pack.scheme())["weight"]
        assert w.dtype == torch.bfloat16
        per[base] = w.to(torch.float32)
    for layer in range(cfg.first_k_dense_replace, L):
        p = f"model.layers.{layer}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.stack(
            [torch.cat([per[f"{p}{e}.gate_proj"], per[f"{p}{e}.up_proj"]], 0) for e in range(E)])
        sd[p + "down_proj"] = torch.stack([per[f"{p}{e}.down_proj"] for e in range(E)])
    return sd


def f32list(t) -> list:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().numpy()
    return [float(x) for x in np.asarray(t, dtype=np.float32).reshape(-1)]


def prompt_ids(p) -> list[int]:
    if p["kind"] == "chat":
        return kt.chat_ids(p["messages"], thinking=p["thinking"])
    return kt.encoding().encode_ordinary(p["text"])


def logit_record(row: torch.Tensor, pos: int) -> dict:
    v, i = torch.topk(row, 5)
    return {"pos": pos, "top1": int(i[0]), "top5_ids": [int(x) for x in i],
            "top5_logits": f32list(v), "margin_top1_top2": float(v[0] - v[1]),
            "max_abs_logit": float(row.abs().max()), "logsumexp": float(torch.logsumexp(row, 0)),
            "sel_logits": f32list(row[SEL_IDS])}


def greedy_nocache(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    cur, out, margins = list(ids), [], []
    for _ in range(n):
        with torch.no_grad():
            lg = model(torch.tensor([cur]), use_cache=False, logits_to_keep=1).logits[0, -1]
        v, i = torch.topk(lg, 2)
        out.append(int(i[0]))
        margins.append(float(v[0] - v[1]))
        cur.append(int(i[0]))
    return out, margins


def rope_facts(model, cfg) -> dict:
    """What transformers computes for RoPE/YaRN, and a numeric check of the pairwise form."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    re_ = model.model.rotary_emb
    attn = model.model.layers[0].self_attn
    d = cfg.qk_rope_head_dim
    pos = torch.tensor([[0, 1, 5, 17, 100, 4095, 70000]])
    x = torch.zeros(1, d)
    cos, sin = re_(x, pos)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, pos.shape[1], d, generator=g)
    k = torch.randn(1, 1, pos.shape[1], d, generator=g)
    qh, kh = apply_rotary_pos_emb_interleave(q, k, cos, sin)
    # the pairwise ("GPT-J") form: rotate (x[2i], x[2i+1]) in place by pos * inv_freq[i]
    # angles exactly as transformers forms them: float32 position times float32 inv_freq
    ang = pos[0, :, None].float() * re_.inv_freq.float()[None, :]
    c = (torch.cos(ang) * re_.attention_scaling).double()
    s = (torch.sin(ang) * re_.attention_scaling).double()

    def pairwise(t):
        t = t[0, 0].double()
        a, b = t[:, 0::2], t[:, 1::2]
        o = torch.empty_like(t)
        o[:, 0::2] = a * c - b * s
        o[:, 1::2] = b * c + a * s
        return o
    qp, kp = pairwise(q), pairwise(k)
    # transformers' output is the pairwise output de-interleaved: [evens..., odds...]
    perm = list(range(0, d, 2)) + list(range(1, d, 2))
    err_layout = float((qh[0, 0].double() - qp[:, perm]).abs().max())
    dots_hf = (qh[0, 0].double() @ kh[0, 0].double().T)
    dots_pw = qp @ kp.T
    err_dot = float((dots_hf - dots_pw).abs().max())
    assert err_layout < 1e-5 and err_dot < 1e-4, (err_layout, err_dot)
    ang64 = pos[0, :, None].double() * re_.inv_freq.double()[None, :]
    err_f32_angle = float((ang.double() - ang64).abs().max())
    rs = cfg.rope_parameters
    mscale = 0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1.0 if rs["factor"] > 1 else 1.0
    assert abs(attn.scaling - (cfg.qk_nope_head_dim + d) ** -0.5 * mscale * mscale) < 1e-12
    return {
        "rope_parameters": {k: rs[k] for k in sorted(rs)},
        "inv_freq": f32list(re_.inv_freq),
        "attention_scaling_cos_sin": float(re_.attention_scaling),
        "softmax_scale": float(attn.scaling),
        "check_positions": [int(p) for p in pos[0]],
        "pairwise_vs_hf_max_abs_err": err_layout,
        "pairwise_vs_hf_dot_max_abs_err": err_dot,
        "f32_angle_vs_f64_max_abs_err": err_f32_angle,
        "example_q": f32list(q[0, 0]),
        "example_q_rotated_hf_layout": f32list(qh[0, 0]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mini", required=True)
    ap.add_argument("--out", default=os.path.join(mm.REPO, "tests", "fixtures", "kimi"))
    ap.add_argument("--name", default="mini_logits.json",
                    help="output file name (mini_wide8_logits.json for the wide8 variant of make_minis.py)")
    a = ap.parse_args(argv)
    top = json.load(open(os.path.join(a.mini, "config.json")))
    text_cfg = top.get("text_config", top)
    cfg = hf_config(text_cfg)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    sd = load_state(a.mini, cfg)
    missing = model.load_state_dict(sd, strict=True, assign=True)
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)   # buffers were on meta
    model = model.float().eval()
    for n, b in model.named_buffers():
        assert b.device.type == "cpu", n

    # routing capture
    routes = {}

    def hook(layer):
        def f(mod, inp, out):
            routes[layer] = (out[2].clone(), out[1].clone())   # topk indices, weights
        return f
    for L in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        model.model.layers[L].mlp.gate.register_forward_hook(hook(L))
    torch.set_grad_enabled(False)

    layer_out = {}

    def keep(key):
        def f(mod, inp, out):
            layer_out[key] = (out[0] if isinstance(out, tuple) else out).clone()
        return f
    model.model.embed_tokens.register_forward_hook(keep("embed"))
    for L in range(cfg.num_hidden_layers):
        model.model.layers[L].register_forward_hook(keep(L))

    prompts_out = []
    for pi, p in enumerate(PROMPTS):
        ids = prompt_ids(p)
        n = len(ids)
        positions = sorted(set([0, 1, n // 2, n - 2, n - 1]))
        with torch.no_grad():
            o = model(torch.tensor([ids]), use_cache=False)
        snap, rsnap = dict(layer_out), dict(routes)      # later forwards overwrite the hooks' dicts
        logits = o.logits[0]
        rec = {"prompt": p, "ids": ids,
               "logits": [logit_record(logits[q], q) for q in positions]}
        gen_nc, margins = greedy_nocache(model, ids, N_GREEDY)
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, n, dtype=torch.long),
                               max_new_tokens=N_GREEDY, do_sample=False, min_new_tokens=N_GREEDY,
                               eos_token_id=None, pad_token_id=mm.PAD)
        gen_cache = [int(x) for x in g[0, n:]]
        assert gen_cache == gen_nc, (gen_cache, gen_nc)
        rec["greedy"] = gen_nc
        rec["greedy_margins"] = margins
        rec["greedy_text"] = kt.encoding().decode(gen_nc)
        if pi == 0:
            hs = [snap["embed"]] + [snap[L] for L in range(cfg.num_hidden_layers)]
            re_logits = model.lm_head(model.model.norm(hs[-1]))[0]
            assert torch.allclose(re_logits, logits, atol=1e-5), "captured states are not the stream"
            hpos = [0, n - 1]
            rec["hidden_states"] = {
                "note": "states[0] = token embedding; states[l] = residual stream leaving decoder "
                        "layer l-1 (l = 1..num_layers), before the final norm; final_norm = "
                        "model.norm(states[-1]) (what lm_head sees)",
                "positions": hpos,
                "states": [[f32list(h[0, q]) for q in hpos] for h in hs],
                "final_norm": [f32list(model.model.norm(hs[-1])[0, q]) for q in hpos],
            }
            rec["routing"] = {str(L): {"positions": hpos,
                                       "topk_ids": [[int(x) for x in rsnap[L][0][q]] for q in hpos],
                                       "topk_weights": [f32list(rsnap[L][1][q]) for q in hpos]}
                              for L in sorted(rsnap)}
        prompts_out.append(rec)
        print(f"prompt {pi}: {n} tokens, top1 at {positions}: "
              f"{[r['top1'] for r in rec['logits']]}, min greedy margin {min(margins):.4f}")

    out = {
        "source": "transformers %s DeepseekV3ForCausalLM, float32 eager, on the seed-0 miniature "
                  "(tools/kimi/make_mini.py); experts dequantized by compressed-tensors" % __import__(
                      "transformers").__version__,
        "torch": torch.__version__,
        "mini_dir": os.path.basename(os.path.normpath(a.mini)),   # k25, or wide8 (tests/kimi_c/make_minis.py)
        "sel_ids": SEL_IDS,
        "rope": rope_facts(model, cfg),
        "rms_norm_eps": {   # transformers builds the q_a/kv_a norms without passing rms_norm_eps
            "input_layernorm": model.model.layers[0].input_layernorm.variance_epsilon,
            "post_attention_layernorm": model.model.layers[0].post_attention_layernorm.variance_epsilon,
            "final_norm": model.model.norm.variance_epsilon,
            "q_a_layernorm": model.model.layers[0].self_attn.q_a_layernorm.variance_epsilon,
            "kv_a_layernorm": model.model.layers[0].self_attn.kv_a_layernorm.variance_epsilon,
        },
        "prompts": prompts_out,
    }
    os.makedirs(a.out, exist_ok=True)
    p = os.path.join(a.out, a.name)
    with open(p, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("wrote", p, os.path.getsize(p), "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
