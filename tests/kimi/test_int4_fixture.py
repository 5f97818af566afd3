#!/usr/bin/env python3
"""kimi_int4_fixture: make_mini's int4 packing and dequantization vs compressed-tensors' own output.

tests/fixtures/kimi/int4_dequant.json holds expert rows that compressed-tensors'
PackedQuantizationCompressor.decompress produced (tools/kimi/check_pack.py, torch side). Here,
with numpy only, the regenerated miniature's tensors must contain exactly those packed words and
scales, and make_mini's unpack/dequantize must reproduce compressed-tensors' int4 values and bf16
results bit for bit (the values a C int4 dequantizer must also produce).
"""
import json
import os
import sys

import numpy as np

ROOT = os.environ.get("SPECD_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tools", "kimi"))
import make_mini as mm  # noqa: E402


def main() -> int:
    fx = json.load(open(os.path.join(ROOT, "tests", "fixtures", "kimi", "int4_dequant.json")))
    rows = fx["rows"]
    assert len(rows) >= 6
    tensors = {}
    for shard, name, arr, dt in mm.build_tensors(fx["seed"]):
        if ".mlp.experts." in name:
            tensors[name] = arr
    for r in rows:
        name, i = r["tensor"], r["row"]
        base = name[: -len("weight_packed")]
        packed = tensors[name]
        sbits = tensors[base + "weight_scale"]
        shape = tensors[base + "weight_shape"].tolist()
        assert shape == r["shape"], name
        assert [int(x) & 0xFFFFFFFF for x in packed[i]] == r["packed_u32"], f"{name}[{i}] packed words"
        assert [int(x) for x in sbits[i]] == r["scale_bf16_bits"], f"{name}[{i}] scales"
        q = mm.unpack_int4(packed[i:i + 1], shape[1])[0]
        assert [int(x) for x in q] == r["q"], f"{name}[{i}] unpack"
        deq = mm.dequant_int4(packed[i:i + 1], sbits[i:i + 1], (1, shape[1]))[0]
        assert [int(x) for x in mm.f32_to_bf16_bits(deq)] == r["dequant_bf16_bits"], f"{name}[{i}] dequant"
        # and the packing itself, from the int4 values compressed-tensors reported
        assert mm.pack_int4(np.array([r["q"]], dtype=np.int8))[0].view(np.uint32).tolist() == r["packed_u32"]
    # the documented nibble order on one word
    assert int(mm.pack_int4(np.arange(-8, 0, dtype=np.int8).reshape(1, 8)).view(np.uint32)[0, 0]) == 0x76543210
    print("kimi int4: %d expert rows identical to compressed-tensors' unpacking" % len(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
