#!/usr/bin/env python3
"""Generate reference fixtures for the loader tests (tests/loader/).

Run with the tools venv (needs gguf, numpy, torch, safetensors):
    /work/venv-tools/bin/python tools/gen_loader_fixtures.py [path/to/SmolLM2.gguf]

Every expected value comes from an implementation independent of specd:
  * gguf.quants.dequantize (the `gguf` Python package of llama.cpp) for
    dequantized blocks, both of blocks read from the real SmolLM2 GGUF with
    gguf.GGUFReader and of blocks quantized here from seeded random data;
  * numpy's float16 cast and gguf's BF16 quantizer for scalar conversions;
  * gguf.GGUFReader for the metadata dump;
  * the `safetensors` package (torch API) for a safetensors file, whose
    expected tensor bytes come from torch.

Outputs (tests/fixtures/loader/), all small:
  deq_cases.txt          name ggml_type_id n_elements   (one line per case)
  deq_<name>.q / .f32    raw block bytes / expected float32 (little-endian)
  conv_f32.bin           float32 inputs; conv_f16.bin / conv_bf16.bin the
                         expected uint16 encodings (numpy / gguf BF16)
  model_cases.txt        tensor_name first_row n_rows file  (rows of the real file)
  model_<...>.f32        expected float32 rows
  model_meta.txt         key <TAB> kind <TAB> value  (see write_meta)
  st_ref.safetensors     written by safetensors.torch.save_file
  st_ref.txt             name dtype raw_file f32_file|-   (expected bytes)
  st_ref_<name>.raw/.f32
"""
import os
import sys

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "loader")


def write_deq_cases(rng):
    cases = []

    def add(name, qt, raw, n):
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        exp = dequantize(raw.copy(), qt).astype(np.float32).reshape(-1)
        assert exp.size == n, (name, exp.size, n)
        raw.tofile(os.path.join(OUT, f"deq_{name}.q"))
        exp.astype("<f4").tofile(os.path.join(OUT, f"deq_{name}.f32"))
        cases.append(f"{name} {int(qt)} {n}")

    # Quantized from random data with gguf.quants.quantize (types it can write).
    for qt, n in [(QT.F16, 96), (QT.BF16, 96), (QT.Q4_0, 128), (QT.Q4_1, 128), (QT.Q8_0, 128)]:
        x = (rng.standard_normal(n) * rng.uniform(0.01, 3.0)).astype(np.float32)
        x[5] = 0.0
        raw = quantize(x.reshape(1, -1), qt)
        add(qt.name.lower(), qt, raw, n)

    # Q4_K / Q6_K: gguf cannot quantize these, so the blocks are random bytes
    # with finite fp16 scales put in place, then dequantized by gguf.
    def f16(v):
        return np.array([v], dtype=np.float16).view(np.uint8)

    nblk = 3
    q4k = rng.integers(0, 256, size=(nblk, 144), dtype=np.uint8)
    for b in range(nblk):
        q4k[b, 0:2] = f16(rng.uniform(1e-4, 0.05))
        q4k[b, 2:4] = f16(rng.uniform(1e-4, 0.05))
    add("q4_k", QT.Q4_K, q4k, nblk * 256)
    q6k = rng.integers(0, 256, size=(nblk, 210), dtype=np.uint8)
    for b in range(nblk):
        q6k[b, 208:210] = f16(rng.uniform(1e-4, 0.05) * (1 if b % 2 else -1))
    add("q6_k", QT.Q6_K, q6k, nblk * 256)

    with open(os.path.join(OUT, "deq_cases.txt"), "w") as f:
        f.write("\n".join(cases) + "\n")


def write_conversions(rng):
    special = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 65536.0, 1e10, -1e10,
                        np.inf, -np.inf, 6.1035156e-05, 6.0e-05, 5.9604645e-08, 2.9802322e-08,
                        2.9802326e-08, 1e-9, 1.0009765625, 1.00048828125, 1.00146484375,
                        3.140625, 0.1, 1e-3], dtype=np.float32)
    # exact fp16 ties: halfway between two representable halves, both parities
    ties = (np.arange(1, 200, dtype=np.float32) * 2 + 1) * np.float32(2.0 ** -11) + 1
    sub_ties = (np.arange(1, 200, dtype=np.float32) * 2 + 1) * np.float32(2.0 ** -25)
    rand = np.concatenate([
        rng.standard_normal(2000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 2000).astype(np.float32),
        rng.integers(0, 2 ** 32, size=2000, dtype=np.uint64).astype(np.uint32).view(np.float32),
    ])
    x = np.concatenate([special, ties, -ties, sub_ties, rand]).astype(np.float32)
    x = x[~np.isnan(x)]  # NaN payload handling differs legitimately; tested in C separately
    x.astype("<f4").tofile(os.path.join(OUT, "conv_f32.bin"))
    with np.errstate(over="ignore"):
        x.astype(np.float16).view("<u2").tofile(os.path.join(OUT, "conv_f16.bin"))
    quantize(x.reshape(1, -1), QT.BF16).view("<u2").tofile(os.path.join(OUT, "conv_bf16.bin"))


def hexs(b):
    return b.hex() if b else "-"


def write_meta(reader):
    """One line per key: key, kind, value.
    kind: int|float|bool -> value as text; str -> hex bytes;
    arr:<elemtype> -> length, then first and last element (hex for strings)."""
    lines = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # reader-internal pseudo fields (version, counts)
        t = field.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            st = field.types[-1]
            n = len(field.data)
            if n == 0:
                lines.append(f"{name}\tarr:{st.name}\t0")
                continue
            if st == gguf.GGUFValueType.STRING:
                first = bytes(field.parts[field.data[0]].tobytes())
                last = bytes(field.parts[field.data[-1]].tobytes())
                lines.append(f"{name}\tarr:{st.name}\t{n}\t{hexs(first)}\t{hexs(last)}")
            else:
                first = field.parts[field.data[0]].tolist()[0]
                last = field.parts[field.data[-1]].tolist()[0]
                lines.append(f"{name}\tarr:{st.name}\t{n}\t{first!r}\t{last!r}")
        elif t == gguf.GGUFValueType.STRING:
            lines.append(f"{name}\tstr\t{hexs(bytes(field.parts[-1].tobytes()))}")
        elif t == gguf.GGUFValueType.BOOL:
            lines.append(f"{name}\tbool\t{int(field.parts[-1][0])}")
        elif t in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
            lines.append(f"{name}\tfloat\t{float(field.parts[-1][0])!r}")
        else:
            lines.append(f"{name}\tint\t{int(field.parts[-1][0])}")
    lines.append(f"#tensors\tint\t{len(reader.tensors)}")
    lines.append(f"#alignment\tint\t{reader.alignment}")
    lines.append(f"#data_offset\tint\t{reader.data_offset}")
    with open(os.path.join(OUT, "model_meta.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def write_model_rows(reader):
    by_name = {t.name: t for t in reader.tensors}
    picks = [
        ("token_embd.weight", 0, 2),
        ("token_embd.weight", 1000, 1),
        ("token_embd.weight", 49151, 1),
        ("blk.0.attn_q.weight", 0, 2),
        ("blk.0.attn_k.weight", 191, 1),
        ("blk.29.ffn_down.weight", 575, 1),
        ("blk.7.ffn_gate.weight", 1000, 1),
        ("output_norm.weight", 0, 1),
        ("blk.3.attn_norm.weight", 0, 1),
    ]
    lines = []
    for name, row, nrows in picks:
        t = by_name[name]
        data = t.data  # numpy view: [rows, row_bytes] for quantized, [rows, cols] for float
        if data.ndim == 1:
            data = data.reshape(1, -1)
        block = np.ascontiguousarray(data[row:row + nrows]).view(np.uint8).reshape(nrows, -1)
        exp = dequantize(block, t.tensor_type).astype("<f4").reshape(-1)
        fn = f"model_{name.replace('.', '_')}_{row}.f32"
        exp.tofile(os.path.join(OUT, fn))
        lines.append(f"{name} {row} {nrows} {fn}")
    with open(os.path.join(OUT, "model_cases.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def write_safetensors():
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1234)
    tensors = {
        "w.bf16": (torch.randn(3, 5, generator=g) * 7).to(torch.bfloat16),
        "w.f16": (torch.randn(4, 2, 3, generator=g) * 100).to(torch.float16),
        "w.f32": torch.randn(7, generator=g),
        "ids.i32": torch.randint(-2 ** 31, 2 ** 31 - 1, (2, 3), generator=g, dtype=torch.int32),
        "ids.i64": torch.tensor([-(2 ** 62), 2 ** 62 + 12345, -1, 0], dtype=torch.int64),
        "mask.bool": torch.tensor([[True, False, True], [False, False, True]]),
        "scalar.f32": torch.tensor(3.5),
    }
    save_file(tensors, os.path.join(OUT, "st_ref.safetensors"), metadata={"format": "pt", "note": "specd fixture"})
    lines = []
    for name, t in tensors.items():
        dt = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
              torch.int64: "I64", torch.bool: "BOOL"}[t.dtype]
        raw = f"st_ref_{name.replace('.', '_')}.raw"
        if t.dtype == torch.bfloat16:
            t.view(torch.int16).numpy().astype("<i2").tofile(os.path.join(OUT, raw))
        else:
            t.numpy().tofile(os.path.join(OUT, raw))
        f32 = "-"
        if t.is_floating_point():
            f32 = f"st_ref_{name.replace('.', '_')}.f32"
            t.float().numpy().astype("<f4").tofile(os.path.join(OUT, f32))
        shape = ",".join(str(s) for s in t.shape) or "scalar"
        lines.append(f"{name} {dt} {shape} {raw} {f32}")
    with open(os.path.join(OUT, "st_ref.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def write_fuzz_seeds(rng):
    """Small valid seeds for the libFuzzer harnesses (tests/fuzz/corpus_*)."""
    gdir = os.path.join(ROOT, "tests", "fuzz", "corpus_gguf")
    sdir = os.path.join(ROOT, "tests", "fuzz", "corpus_safetensors")
    os.makedirs(gdir, exist_ok=True)
    os.makedirs(sdir, exist_ok=True)
    w = gguf.GGUFWriter(os.path.join(gdir, "seed1.gguf"), "llama")
    w.add_block_count(2)
    w.add_uint32("x.u32", 7)
    w.add_float32("x.f", 1.5)
    w.add_bool("x.b", True)
    w.add_array("x.arr_s", ["a", "bc", "def"])
    w.add_array("x.arr_i", [1, 2, 3])
    w.add_array("x.arr_f", [1.0, 2.5])
    w.add_string("x.s", "hello")
    w.add_tensor("f32", rng.standard_normal((2, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4,)).astype(np.float16))
    for name, qt in [("q8", QT.Q8_0), ("q41", QT.Q4_1), ("q40", QT.Q4_0)]:
        q = quantize(rng.standard_normal((2, 32)).astype(np.float32), qt)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    import shutil
    shutil.copy(os.path.join(OUT, "st_ref.safetensors"), os.path.join(sdir, "seed1.safetensors"))


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20261129)
    write_deq_cases(rng)
    write_conversions(rng)
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    reader = gguf.GGUFReader(model)
    write_meta(reader)
    write_model_rows(reader)
    write_safetensors()
    write_fuzz_seeds(rng)
    print("wrote fixtures to", OUT)


if __name__ == "__main__":
    main()
