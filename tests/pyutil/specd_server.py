"""specd_server.py: the one copy of what the Python end-to-end tests need to
run the real `specd serve` binary and talk raw HTTP to it.

Used by tests/server (test_e2e.py, test_notify.py), tests/spec
(test_spec_server.py), tests/reliability (relutil.py and through it the
fault, hostile and soak tests), tests/bench (test_bench_e2e.py, bench_util.py)
and tests/deploy (test_ops.py). Import it with

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
    import specd_server as sp

What it owns:
  - where things are: SRC, BUILD, MODEL, SPECD, PYTHON from the ctest
    environment (SPECD_SOURCE_DIR, SPECD_BUILD_DIR, SPECD_MODEL_GGUF,
    SPECD_PYTHON; SPECD_BIN overrides the binary), with checkout-relative
    defaults for a run by hand;
  - loopback ports (free_port, port_is_free);
  - one raw HTTP request (http_request: status, body bytes, headers) with an
    optional bearer key, /metrics text parsing (parse_metrics), SSE data
    events of a streaming response (sse_data);
  - Server: `specd serve MODEL --port P ARGS...` as a child process with its
    output in a log file, started and (unless wait=False) polled until
    /health is 200, failing fast with the log when the process exits first;
    raw / post / metrics / wait_idle / rss_kib / n_fds / stop (SIGTERM, then
    kill after a timeout; returns the exit code).
It asserts nothing about the server's behaviour: each test keeps its own
assertions. Only the standard library is imported at module load (openai is
imported inside Server.client), so it also serves scripts run without it.
Threading: a Server may be used from many client threads at once (every
request opens its own connection); start and stop belong to one thread.
"""
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time

SRC = os.environ.get("SPECD_SOURCE_DIR") or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("SPECD_BUILD_DIR", "")
MODEL = os.environ.get("SPECD_MODEL_GGUF") or os.path.join(SRC, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
SPECD = os.environ.get("SPECD_BIN") or os.path.join(BUILD, "server", "specd")
PYTHON = os.environ.get("SPECD_PYTHON", "python3")
SKIP = 77


def have_specd_and_model():
    return os.access(SPECD, os.X_OK) and os.path.exists(MODEL)


def free_port():
    """A loopback TCP port nothing listens on right now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def http_request(port, method, path, body=None, headers=None, key=None, timeout=300, host="127.0.0.1"):
    """One request on a fresh connection. BODY: dict/list (sent as JSON), str or bytes. KEY: a bearer token
    (Authorization header) or None. Returns (status, body bytes, headers dict); raises OSError /
    http.client.HTTPException on a connection failure."""
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = "Bearer " + key
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


def parse_metrics(text):
    """Prometheus text -> {sample name with its labels, as written: float value} (an optional timestamp after
    the value is ignored; a label value may hold spaces)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#") or not line:
            continue
        if "{" in line:
            end = line.rindex("}") + 1
            name, rest = line[:end], line[end:].split()
        else:
            name, *rest = line.split()
        out[name] = float(rest[0])
    return out


def sse_data(resp):
    """Yields the `data:` payloads (str) of a streaming http.client response, in order, until EOF."""
    buf = b""
    while True:
        chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1)
        if not chunk:
            return
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            for line in ev.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:].decode()


def wait_health(port, proc=None, timeout=300, poll=0.3, log=None):
    """Polls GET /health until 200. Raises RuntimeError when PROC (a Popen) exits first or TIMEOUT passes;
    LOG (a callable returning text) is appended to the message."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"specd exited early ({proc.returncode}): {log() if log else ''}")
        try:
            st = http_request(port, "GET", "/health", timeout=5)[0]
            if st == 200:
                return
            last = f"status {st}"
        except (OSError, http.client.HTTPException) as e:
            last = e
        time.sleep(poll)
    raise RuntimeError(f"no 200 from /health on port {port} within {timeout} s (last: {last}): "
                       f"{log() if log else ''}")


def make_random_head(out, seed=1, layout="speculators", rope_theta=None):
    """A random EAGLE-3 head for SmolLM2 (tools/eagle3/make_random_head.py) in OUT; RuntimeError on failure."""
    args = [PYTHON, os.path.join(SRC, "tools/eagle3/make_random_head.py"), "--layout", layout, "--out", out,
            "--seed", str(seed)]
    if rope_theta is not None:
        args += ["--rope-theta", str(rope_theta)]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("make_random_head.py failed: " + r.stderr[-500:])
    return out


class Server:
    """`specd serve MODEL --port P *ARGS` on a free port.

    args: the flags after --port; model: default MODEL; key: the bearer key raw() sends by default (None:
    none); env: extra environment, a None value removing the variable (OMP_NUM_THREADS defaults to
    omp_threads when that is not None); wait:
    poll /health until 200 (RuntimeError with the log's tail when the process exits first or
    ready_timeout passes; the process is stopped then); preexec_fn: passed to Popen."""

    def __init__(self, args=(), model=None, key=None, env=None, ready_timeout=300, poll=0.3, wait=True,
                 omp_threads=1, log_prefix="specd_", preexec_fn=None):
        self.port = free_port()
        self.key = key
        self.log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log", delete=False)
        self.args = [SPECD, "serve", model or MODEL, "--port", str(self.port), *args]
        e = dict(os.environ)
        if omp_threads is not None:
            e["OMP_NUM_THREADS"] = str(omp_threads)
        for k, v in (env or {}).items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = v
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=e,
                                     preexec_fn=preexec_fn)
        if wait:
            try:
                wait_health(self.port, self.proc, ready_timeout, poll, self.read_log)
            except RuntimeError:
                self.stop()
                raise

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}"

    def read_log(self, tail=4000):
        with open(self.log.name, "r", errors="replace") as f:
            return f.read()[-tail:]

    def raw(self, method, path, body=None, headers=None, auth=True, key=None, timeout=300):
        """http_request to this server; sends KEY (default: the server's key) unless auth is False."""
        return http_request(self.port, method, path, body, headers, (key or self.key) if auth else None, timeout)

    def post(self, path, obj, **kw):
        """POST a JSON body; returns (status, parsed JSON or None for an empty body)."""
        st, data, _ = self.raw("POST", path, obj, **kw)
        return st, json.loads(data) if data else None

    def client(self, key=None):
        import openai
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=key or self.key or "none", max_retries=0,
                             timeout=600)

    def metrics(self):
        st, data, _ = self.raw("GET", "/metrics", auth=False)
        assert st == 200, (st, data[:200])
        return parse_metrics(data.decode())

    def is_idle(self, m, draft=True):
        """Nothing running or waiting and every KV block free (and every draft KV block, when DRAFT)."""
        return (m["specd_num_requests_running"] == 0 and m["specd_num_requests_waiting"] == 0
                and m["specd_kv_blocks_free"] == m["specd_kv_blocks_total"]
                and (not draft or m.get("specd_draft_kv_blocks_free", 0) == m.get("specd_draft_kv_blocks_total", 0)))

    def wait_idle(self, timeout=120, draft=True):
        """Polls /metrics until is_idle or TIMEOUT; returns the last metrics (the caller asserts)."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if self.is_idle(m, draft) or time.time() > deadline:
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
        """SIGTERM (drain), then SIGKILL after TIMEOUT s; returns the exit code (negative: killed by a signal)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
