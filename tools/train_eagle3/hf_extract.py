#!/usr/bin/env python3
"""hf_extract.py: a Hugging Face transformers reference for `specd extract`.

What it owns: writing a hidden-state dump (FORMAT.md) for a JSONL of chat
conversations with transformers' LlamaForCausalLM loaded from the target GGUF
(float32).  It is the independent reference the C `specd extract` output can
be compared with (same token ids, loss mask, aux features and final hidden
states up to float error), and a stop-gap extractor for small experiments.

Per conversation: the chat template renders the whole conversation; a token
is in the loss mask iff it belongs to an assistant turn (its content and the
turn's end token, EOS; not the template text after it), found by rendering growing prefixes of the conversation
(the template must be prefix-stable, as ChatML is).  One forward pass with
pre-hooks on decoder layers records the residual stream ENTERING the layers of
--aux-layers (default {2, N/2, N-3}, "input" convention); a hook on the final
norm records final_hidden.

Input JSONL: one object per line with "messages": [{"role", "content"}...]
(the OpenAI chat shape).  Usage:
  hf_extract.py --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --input convs.jsonl --out DUMP [--max-samples N] [--max-len 2048]
Threading: none (torch intra-op threads: --threads; --device cuda runs the
forward passes on a GPU, the dump is written from host copies).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dump import DumpWriter  # noqa: E402


def render_with_mask(tok, messages):
    """-> (ids list, mask list): mask 1 on assistant-turn tokens."""
    ids, mask = [], []
    prev = []
    for i in range(len(messages)):
        cur = tok.apply_chat_template(messages[: i + 1], tokenize=True)
        if not isinstance(cur, list):
            cur = cur["input_ids"]
        if cur[: len(prev)] != prev:
            raise ValueError("chat template is not prefix-stable")
        new = cur[len(prev):]
        ids += new
        if messages[i]["role"] == "assistant":
            # the "<|im_start|>assistant\n" header is prompt, not response:
            hdr = tok.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True)
            if not isinstance(hdr, list):
                hdr = hdr["input_ids"]
            n_hdr = len(hdr) - len(prev)
            body = new[n_hdr:]
            # the response ends at the turn's end token (EOS); what the
            # template appends after it (ChatML's "\n") is not generated
            end = body.index(tok.eos_token_id) + 1 if tok.eos_token_id in body else len(body)
            mask += [0] * n_hdr + [1] * end + [0] * (len(body) - end)
        else:
            mask += [0] * len(new)
        prev = cur
    return ids, mask


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--aux-layers", default=None, help="comma list, input-to-layer ids")
    ap.add_argument("--aux-dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--samples-per-shard", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="torch device for the forward passes (cpu, cuda)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gp = os.path.realpath(a.gguf)
    d, f = os.path.dirname(gp), os.path.basename(gp)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval().to(a.device)
    N = model.config.num_hidden_layers
    aux_ids = [int(x) for x in a.aux_layers.split(",")] if a.aux_layers else [2, N // 2, N - 3]
    if len(aux_ids) != 3 or not all(0 <= i < N for i in aux_ids):
        sys.exit(f"hf_extract: --aux-layers needs 3 ids in [0, {N})")
    cap = {}
    hooks = [model.model.layers[i].register_forward_pre_hook(
        lambda m, args, kw, i=i: cap.__setitem__(i, (args[0] if args else kw["hidden_states"])[0].detach()),
        with_kwargs=True) for i in aux_ids]
    hooks.append(model.model.norm.register_forward_hook(
        lambda m, i, o: cap.__setitem__("final", o[0].detach())))
    w = DumpWriter(a.out, {"name": os.path.basename(gp), "n_layers": N,
                           "hidden_size": model.config.hidden_size,
                           "vocab_size": model.config.vocab_size},
                   aux_ids, aux_dtype=a.aux_dtype, samples_per_shard=a.samples_per_shard)
    n_tok, t0 = 0, time.time()
    with open(a.input) as fin, torch.no_grad():
        for k, line in enumerate(fin):
            if a.max_samples is not None and k >= a.max_samples:
                break
            ids, mask = render_with_mask(tok, json.loads(line)["messages"])
            ids, mask = ids[: a.max_len], mask[: a.max_len]
            cap.clear()
            model(input_ids=torch.tensor([ids], device=a.device))
            aux = torch.cat([cap[i] for i in aux_ids], -1).cpu()
            w.add(torch.tensor(ids), torch.tensor(mask), aux, cap["final"].cpu())
            n_tok += len(ids)
    w.close()
    for h in hooks:
        h.remove()
    dt = time.time() - t0
    print(f"hf_extract: {w.n_samples} samples, {n_tok} tokens, {w.n_loss} loss tokens, "
          f"{n_tok / max(dt, 1e-9):.0f} tok/s -> {a.out}")


if __name__ == "__main__":
    main()
