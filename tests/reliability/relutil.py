"""relutil.py: shared helpers of the reliability tests (tests/reliability/).

What it owns: starting `specd serve` as a child process on a free loopback
port, reading /metrics and /proc/PID/status, checking that a port is free,
and rewriting safetensors files and GGUF headers byte by byte (the tests
break model files on purpose; numpy cannot hold bf16, and the gguf package is
not in the CI venv, so both formats are handled as raw bytes here).
Threading: the Server object may be used from many client threads (every
request opens its own connection).
"""
import http.client
import json
import os
import signal
import socket
import struct
import subprocess
import tempfile
import time

BUILD = os.environ.get("SPECD_BUILD_DIR", "")
SRC = os.environ.get("SPECD_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODEL = os.environ.get("SPECD_MODEL_GGUF", os.path.join(SRC, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
SPECD = os.environ.get("SPECD_BIN", os.path.join(BUILD, "server", "specd"))
PYTHON = os.environ.get("SPECD_PYTHON", "python3")


def have_binary_and_model():
    return os.access(SPECD, os.X_OK) and os.path.exists(MODEL)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def port_is_free(port):
    """True when nothing listens on 127.0.0.1:port (a bind succeeds)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def make_random_head(out, seed=1, layout="speculators"):
    r = subprocess.run([PYTHON, os.path.join(SRC, "tools/eagle3/make_random_head.py"), "--layout", layout,
                        "--out", out, "--seed", str(seed)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("make_random_head.py failed: " + r.stderr[-500:])
    return out


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
class Server:
    """`specd serve` on a free port; waits for /health 200 (or for exit when expect_fail)."""

    def __init__(self, model, extra, env=None, ready_timeout=600, threads=1):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="specd_rel_", suffix=".log", delete=False)
        self.args = [SPECD, "serve", model, "--port", str(self.port), "--threads", str(threads), *extra]
        e = dict(os.environ, OMP_NUM_THREADS=str(threads))
        e.update(env or {})
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.time() + ready_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specd exited early ({self.proc.returncode}): {self.read_log()}")
            try:
                if self.raw("GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("specd did not become healthy: " + self.read_log())

    def read_log(self, tail=4000):
        with open(self.log.name, "r", errors="replace") as f:
            return f.read()[-tail:]

    def raw(self, method, path, body=None, headers=None, timeout=300):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode()
        try:
            c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            data = r.read()
            return r.status, data, dict(r.getheaders())
        finally:
            c.close()

    def metrics(self):
        st, data, _ = self.raw("GET", "/metrics")
        assert st == 200
        out = {}
        for line in data.decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, val = line.rsplit(" ", 1)
            out[name] = float(val)
        return out

    def wait_idle(self, timeout=120):
        """Waits until nothing runs or waits and every KV block (target and draft) is free; returns the metrics."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            idle = (m["specd_num_requests_running"] == 0 and m["specd_num_requests_waiting"] == 0
                    and m["specd_kv_blocks_free"] == m["specd_kv_blocks_total"]
                    and m.get("specd_draft_kv_blocks_free", 0) == m.get("specd_draft_kv_blocks_total", 0))
            if idle or time.time() > deadline:
                return m
            time.sleep(0.25)

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return -1

    def n_fds(self):
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self, timeout=120):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
