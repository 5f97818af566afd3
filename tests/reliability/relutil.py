"""relutil.py: shared helpers of the reliability tests (tests/reliability/).

What it owns: the reliability tests' view of the shared server helper
(tests/pyutil/specd_server.py: starting `specd serve` on a free loopback
port, /metrics, /proc/PID/status, free ports), and rewriting safetensors
files and GGUF headers byte by byte (the tests break model files on purpose;
numpy cannot hold bf16, and the gguf package is not in the CI venv, so both
formats are handled as raw bytes here).
Threading: the Server object may be used from many client threads (every
request opens its own connection).
"""
import json
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402
from specd_server import (BUILD, MODEL, PYTHON, SPECD, SRC, free_port, make_random_head,  # noqa: E402,F401
                          port_is_free)


def have_binary_and_model():
    return sp.have_specd_and_model()


# ------------------------------------------------------------ safetensors
def st_read(path):
    """(header dict, data bytes) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def st_write(path, tensors, metadata=None):
    """tensors: {name: (dtype, shape, raw bytes)} written in name order."""
    header = {"__metadata__": metadata or {"format": "pt"}}
    blobs, off = [], 0
    for name in sorted(tensors):
        dt, shape, raw = tensors[name]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def st_tensors(path):
    header, data = st_read(path)
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = (v["dtype"], v["shape"], data[a:b])
    return out, header.get("__metadata__")


# ------------------------------------------------------------ GGUF header
# GGUF v2/v3 (ggml docs/gguf.md): "GGUF", u32 version, u64 n_tensors, u64 n_kv,
# n_kv x (string key, u32 type, value), n_tensors x (string name, u32 n_dims,
# u64 dims[n_dims] (innermost first), u32 ggml type, u64 offset). Strings are
# u64 length + bytes. Value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32,
# 6 f32, 7 bool, 8 string, 9 array (u32 elem type, u64 n, elems), 10 u64,
# 11 i64, 12 f64.
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_skip_value(buf, off, vtype):
    if vtype in _GGUF_SCALAR:
        return off + _GGUF_SCALAR[vtype]
    if vtype == 8:
        return off + 8 + struct.unpack_from("<Q", buf, off)[0]
    if vtype == 9:
        et, n = struct.unpack_from("<IQ", buf, off)
        off += 12
        if et in _GGUF_SCALAR:
            return off + n * _GGUF_SCALAR[et]
        for _ in range(n):
            off = _gguf_skip_value(buf, off, et)
        return off
    raise ValueError(f"GGUF value type {vtype}")


def gguf_tensor_infos(buf):
    """[(name, name offset, dims offset, dims list, ggml type)] of a GGUF file's header bytes."""
    if buf[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    _, n_t, n_kv = struct.unpack_from("<IQQ", buf, 4)
    off = 24
    for _ in range(n_kv):
        off += 8 + struct.unpack_from("<Q", buf, off)[0]
        vtype = struct.unpack_from("<I", buf, off)[0]
        off = _gguf_skip_value(buf, off + 4, vtype)
    out = []
    for _ in range(n_t):
        nl = struct.unpack_from("<Q", buf, off)[0]
        name = bytes(buf[off + 8:off + 8 + nl]).decode()
        name_off = off + 8
        off += 8 + nl
        nd = struct.unpack_from("<I", buf, off)[0]
        dims = list(struct.unpack_from(f"<{nd}Q", buf, off + 4))
        out.append((name, name_off, off + 4, dims, struct.unpack_from("<I", buf, off + 4 + 8 * nd)[0]))
        off += 4 + 8 * nd + 4 + 8
    return out


def gguf_copy_edited(src, dst, tensor, dims=None, new_name=None):
    """Copies the GGUF SRC to DST with TENSOR's dims replaced by DIMS (same count) and/or its name replaced
    by NEW_NAME (same length): the header stays the same size, so every offset and byte stays valid."""
    with open(src, "rb") as f:
        buf = bytearray(f.read())
    hit = [t for t in gguf_tensor_infos(buf[:16 << 20]) if t[0] == tensor]
    if not hit:
        raise KeyError(tensor)
    name, name_off, dims_off, old, _ = hit[0]
    if dims is not None:
        assert len(dims) == len(old), (dims, old)
        struct.pack_into(f"<{len(dims)}Q", buf, dims_off, *dims)
    if new_name is not None:
        assert len(new_name) == len(name)
        buf[name_off:name_off + len(name)] = new_name.encode()
    with open(dst, "wb") as f:
        f.write(buf)
    return old


# ------------------------------------------------------------ the server
class Server(sp.Server):
    """`specd serve MODEL --port P --threads T EXTRA...` (tests/pyutil/specd_server.py), ready when /health
    is 200; no API key. wait_idle counts the draft KV blocks too."""

    def __init__(self, model, extra, env=None, ready_timeout=600, threads=1):
        super().__init__(["--threads", str(threads), *extra], model=model, env=env, ready_timeout=ready_timeout,
                         poll=0.5, omp_threads=threads, log_prefix="specd_rel_")
