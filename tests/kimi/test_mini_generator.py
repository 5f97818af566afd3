#!/usr/bin/env python3
"""kimi_mini_generator: the Kimi miniature regenerates byte-identically from its seed, torch-free.

Regenerates the seed-0 checkpoint (tools/kimi/make_mini.py, numpy + stdlib only) into a temp dir
and compares the sha256 of every file with tests/fixtures/kimi/mini_seed0_sha256.json, which was
written when tools/kimi/reference.py produced the transformers fixtures from that checkpoint: a
drift here means the committed reference logits no longer describe what CI generates. Also checks
the checkpoint's structure the C loader relies on (config keys, names, dtypes, shapes, sharding).
"""
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.environ.get("SPECD_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tools", "kimi"))
import make_mini as mm  # noqa: E402

FIX = os.path.join(ROOT, "tests", "fixtures", "kimi")


def check_structure(d: str) -> None:
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["model_type"] == "kimi_k25"
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (163584, 163585, 163839)
    tc = cfg["text_config"]
    assert tc["model_type"] == "kimi_k2" and tc["vocab_size"] == 163840
    for q in (cfg["quantization_config"], tc["quantization_config"]):
        w = q["config_groups"]["group_0"]["weights"]
        assert q["format"] == "pack-quantized" and q["quant_method"] == "compressed-tensors"
        assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"]) == (4, 32, True, "group")
    idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    files = sorted(set(idx["weight_map"].values()))
    assert len(files) >= 3, files
    seen, total = {}, 0
    for f in files:
        hdr, base = mm.read_safetensors_header(os.path.join(d, f))
        size = os.path.getsize(os.path.join(d, f))
        end = 0
        for k, e in hdr.items():
            if k == "__metadata__":
                continue
            a, b = e["data_offsets"]
            item = {"BF16": 2, "F32": 4, "I32": 4}[e["dtype"]]
            assert b - a == item * int(np.prod(e["shape"])), k
            assert (base + a) % item == 0, f"{k} misaligned"
            assert idx["weight_map"][k] == f, k
            seen[k] = e
            end = max(end, b)
            total += b - a
        assert base + end == size, f
    assert set(seen) == set(idx["weight_map"]) and total == idx["metadata"]["total_size"]
    P = "language_model.model."
    H, V = 128, 163840
    assert seen[P + "embed_tokens.weight"] == {**seen[P + "embed_tokens.weight"], "dtype": "BF16", "shape": [V, H]}
    assert seen["language_model.lm_head.weight"]["shape"] == [V, H]
    assert seen[P + "layers.0.mlp.gate_proj.weight"]["shape"] == [256, H]
    assert seen[P + "layers.0.self_attn.kv_a_proj_with_mqa.weight"]["shape"] == [48, H]
    assert seen[P + "layers.0.self_attn.q_b_proj.weight"]["shape"] == [4 * 48, 64]
    assert seen[P + "layers.0.self_attn.kv_b_proj.weight"]["shape"] == [4 * 64, 32]
    assert seen[P + "layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"
    e = P + "layers.5.mlp.experts.15."
    assert seen[e + "gate_proj.weight_packed"] == {**seen[e + "gate_proj.weight_packed"], "dtype": "I32", "shape": [64, 16]}
    assert seen[e + "gate_proj.weight_scale"]["dtype"] == "BF16" and seen[e + "gate_proj.weight_scale"]["shape"] == [64, 4]
    assert seen[e + "down_proj.weight_packed"]["shape"] == [128, 8]
    assert seen[e + "down_proj.weight_shape"]["dtype"] == "I32"
    assert mm.read_tensor(os.path.join(d, idx["weight_map"][e + "down_proj.weight_shape"]),
                          e + "down_proj.weight_shape").tolist() == [128, 64]
    assert not any(k.startswith(P + "layers.0.mlp.experts") for k in seen)


def main() -> int:
    want = json.load(open(os.path.join(FIX, "mini_seed0_sha256.json")))
    with tempfile.TemporaryDirectory() as d:
        got = mm.make(want["seed"], d, want["text_model_type"], want["layout"], tokenizer_files=False)
        check_structure(d)
        bad = {f: (got.get(f), s) for f, s in want["sha256"].items() if got.get(f) != s}
        assert not bad, f"miniature drifted from the committed fixture: {bad}"
        assert set(got) == set(want["sha256"]), sorted(set(got) ^ set(want["sha256"]))
        # the deepseek_v3 text_config variant differs only in that one config value
        d2 = os.path.join(d, "v3")
        mm.make(want["seed"], d2, "deepseek_v3", want["layout"], tokenizer_files=False)
        c1 = json.load(open(os.path.join(d, "config.json")))
        c2 = json.load(open(os.path.join(d2, "config.json")))
        assert c2["text_config"].pop("model_type") == "deepseek_v3"
        c1["text_config"].pop("model_type")
        assert c1 == c2
        assert mm.sha256_file(os.path.join(d2, "model-00002-of-00004.safetensors")) == \
            want["sha256"]["model-00002-of-00004.safetensors"]
    print("kimi miniature: %d files byte-identical to the seed-%d fixture" % (len(got), want["seed"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
