#!/usr/bin/env python3
"""check_pack.py: prove make_mini.py's int4 packing is byte-identical to compressed-tensors'.

What it owns
    The one-time proof (run with /work/venv-tools, which has torch + compressed-tensors) that
    the numpy packer/unpacker/dequantizer in make_mini.py match the compressed-tensors package
    exactly, on (a) every routed-expert tensor of a generated miniature and (b) synthetic
    matrices that put every value -8..7 in every nibble position. It also writes
    tests/fixtures/kimi/int4_dequant.json: a few expert rows dequantized BY compressed-tensors
    (bf16 bit patterns) plus their packed words and scales, so the C int4 dequantizer can be
    tested exactly without Python.

Findings (printed, and recorded in make_mini.py and docs/kimi-k2.5.md):
    nibble order: element k of a row -> int32 word k//8, bits 4*(k%8)..+3 (low nibble first);
    zero offset: stored unsigned as q + 8 (offset binary), q in [-8, 7];
    dequantize: bf16(q * scale), computed by compressed-tensors in the scale's dtype (bf16).

Usage: check_pack.py [--mini DIR] [--seed S] [--write-fixture]
Threading: single-threaded; keeps torch to 1 thread.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_mini as mm  # noqa: E402

torch.set_num_threads(1)
FIXTURES = os.path.join(mm.REPO, "tests", "fixtures", "kimi")


def scheme() -> QuantizationScheme:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=mm.GROUP)
    return QuantizationScheme(targets=["Linear"], weights=args)


def bf16_tensor(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def bits_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def check_one(q: np.ndarray, sbits: np.ndarray, packed: np.ndarray, label: str) -> None:
    """Assert every compressed-tensors route agrees with the numpy one for one matrix."""
    rows, cols = q.shape
    # 1. packing the same int8 values
    ct_packed = pack_to_int32(torch.from_numpy(q), 4).numpy()
    assert ct_packed.dtype == np.int32 and ct_packed.shape == packed.shape, label
    assert ct_packed.tobytes() == packed.tobytes(), f"{label}: pack_to_int32 differs"
    # 2. unpacking our words
    ct_q = unpack_from_int32(torch.from_numpy(packed), 4, torch.Size([rows, cols])).numpy()
    assert np.array_equal(ct_q, q), f"{label}: unpack_from_int32 differs"
    assert np.array_equal(mm.unpack_int4(packed, cols), q), f"{label}: our unpack differs"
    # 3. the full compressor: quantize(dequantized weight, our scale) + pack
    deq_ours = mm.dequant_int4(packed, sbits, (rows, cols))
    sd = {"weight": torch.from_numpy(deq_ours).to(torch.bfloat16), "weight_scale": bf16_tensor(sbits)}
    comp = PackedQuantizationCompressor.compress(sd, scheme())
    assert comp["weight_packed"].numpy().tobytes() == packed.tobytes(), f"{label}: compress differs"
    assert comp["weight_shape"].tolist() == [rows, cols], label
    # 4. the full decompressor on our tensors
    dec = PackedQuantizationCompressor.decompress(
        {"weight_packed": torch.from_numpy(packed), "weight_scale": bf16_tensor(sbits),
         "weight_shape": torch.tensor([rows, cols], dtype=torch.int32)}, scheme())
    w = dec["weight"]
    assert w.dtype == torch.bfloat16, f"{label}: decompress dtype {w.dtype}"
    assert np.array_equal(bits_of(w), mm.f32_to_bf16_bits(deq_ours)), f"{label}: dequant differs"


def synthetic(seed: int) -> None:
    """Every value -8..7 at every nibble position, plus random scales (normal, tiny, huge)."""
    rng = np.random.default_rng(seed)
    cols = 64
    base = np.arange(16, dtype=np.int8) - 8                      # -8..7
    rows = []
    for shift in range(16):                                       # each value at each position
        rows.append(np.roll(np.tile(base, cols // 16), shift))
    q = np.stack(rows).astype(np.int8)
    q = np.concatenate([q, rng.integers(-8, 8, size=(48, cols), dtype=np.int8)])
    sc = rng.standard_normal((q.shape[0], cols // mm.GROUP)).astype(np.float32)
    sc = np.abs(sc) * np.float32(10.0) ** rng.integers(-6, 3, size=sc.shape).astype(np.float32)
    sbits = mm.f32_to_bf16_bits(sc)
    check_one(q, sbits, mm.pack_int4(q), "synthetic")
    # nibble order, spelled out on one word: elements 0..7 = -8, -7, ..., -1
    w0 = int(mm.pack_int4(np.arange(-8, 0, dtype=np.int8).reshape(1, 8))[0, 0]) & 0xFFFFFFFF
    assert w0 == 0x76543210, hex(w0)
    ct0 = int(pack_to_int32(torch.arange(-8, 0, dtype=torch.int8).reshape(1, 8), 4)[0, 0]) & 0xFFFFFFFF
    assert ct0 == 0x76543210, hex(ct0)
    print("nibble order: [-8,-7,...,-1] packs to 0x%08X (compressed-tensors: 0x%08X): element k at"
          " bits 4k..4k+3, stored q+8" % (w0, ct0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mini", help="existing miniature dir (default: generate into a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-fixture", action="store_true")
    a = ap.parse_args(argv)
    synthetic(1234)
    tmp = None
    mini = a.mini
    if mini is None:
        tmp = tempfile.TemporaryDirectory()
        mini = tmp.name
        mm.make(a.seed, mini, tokenizer_files=False)
    index = json.load(open(os.path.join(mini, "model.safetensors.index.json")))["weight_map"]
    n = 0
    fixture_rows = []
    for name in sorted(index):
        if not name.endswith(".weight_packed"):
            continue
        base = name[: -len("weight_packed")]
        f = os.path.join(mini, index[name])
        packed = mm.read_tensor(f, name).copy()
        sbits = mm.read_tensor(os.path.join(mini, index[base + "weight_scale"]), base + "weight_scale")
        shape = mm.read_tensor(os.path.join(mini, index[base + "weight_shape"]), base + "weight_shape")
        q = mm.unpack_int4(packed, int(shape[1]))
        check_one(q, sbits, packed, name)
        # regenerate from the seed: quantize(values) must give exactly these words
        canon = "model." + base[base.index("layers."):] + "weight"
        w = mm.values(a.seed, canon, tuple(int(x) for x in shape), 1.0 / int(shape[1]) ** 0.5)
        q2, s2 = mm.quantize_int4(w)
        assert np.array_equal(q2, q) and np.array_equal(s2, sbits), f"{name}: not reproducible"
        n += 1
        if name.endswith(("layers.1.mlp.experts.0.gate_proj.weight_packed",
                          "layers.3.mlp.experts.7.up_proj.weight_packed",
                          "layers.5.mlp.experts.15.down_proj.weight_packed")):
            dec = PackedQuantizationCompressor.decompress(
                {"weight_packed": torch.from_numpy(packed), "weight_scale": bf16_tensor(sbits),
                 "weight_shape": torch.from_numpy(shape.copy())}, scheme())["weight"]
            for r in (0, 1, int(shape[0]) - 1):
                fixture_rows.append({
                    "tensor": name,
                    "row": r,
                    "shape": [int(shape[0]), int(shape[1])],
                    "packed_u32": [int(x) & 0xFFFFFFFF for x in packed[r]],
                    "scale_bf16_bits": [int(x) for x in sbits[r]],
                    "dequant_bf16_bits": [int(x) for x in bits_of(dec[r])],
                    "q": [int(x) for x in q[r]],
                })
    print(f"checked {n} expert tensors of the seed-{a.seed} miniature: packing, unpacking,"
          " compress() and decompress() byte-identical to compressed-tensors")
    if a.write_fixture:
        os.makedirs(FIXTURES, exist_ok=True)
        out = {
            "source": "compressed-tensors PackedQuantizationCompressor.decompress on the seed-%d "
                      "miniature (tools/kimi/check_pack.py)" % a.seed,
            "seed": a.seed,
            "nibble_order": "element k of a row -> word k//8, bits 4*(k%8)..4*(k%8)+3 (low nibble first)",
            "zero_offset": "stored unsigned q+8, q in [-8,7]",
            "dequant": "bf16(q * scale), round-to-nearest-even",
            "rows": fixture_rows,
        }
        p = os.path.join(FIXTURES, "int4_dequant.json")
        with open(p, "w") as fh:
            json.dump(out, fh, indent=1)
            fh.write("\n")
        print("wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
