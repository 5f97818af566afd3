"""deploy_ops: the service as the unit starts it, with the shipped SmolLM2 env
file, run without systemd: the test plays systemd's part.

- Command lines: ExecStartPre and ExecStart are taken from deploy/specd.service
  (binary path -> the build, ${SPECD_MODEL} expanded) and run with exactly the
  variables of deploy/env/smollm2-cpu.env, except: the model (the test GGUF),
  the port (a free one), the API key file (a temporary one), the draft head
  (the committed draft/heads/<name>, else a random EAGLE-3 head, else none)
  and SPECD_THREADS=1 (CI shares 2 cores). systemd's own variables are set
  as it would: NOTIFY_SOCKET (a datagram socket this test reads),
  WATCHDOG_USEC (2 s instead of the unit's 60 s, to see pings in seconds),
  JOURNAL_STREAM.
- sd_notify: STATUS=loading, then STATUS=warming up, then READY=1; right
  after READY=1 /health is 200 and a completion succeeds; WATCHDOG=1 at least
  every WATCHDOG_USEC/2 (+ slack) while idle and while a long stream runs (the
  stream is verified to span the window); STOPPING=1 on SIGTERM while a
  stream is still running.
- SIGHUP (the unit's ExecReload): the old key gets 401, the new key 200, and a
  stream started with the old key before the reload keeps delivering chunks
  after the reload was observed and ends with finish_reason "length" and the
  exact token count requested.
- SIGTERM (the unit's KillSignal): /health and new requests 503, the running
  stream completes, exit status 0, well inside TimeoutStopSec.
- journald: with JOURNAL_STREAM set every log line starts with a syslog
  priority prefix "<N>"; the reload and serving lines are <6> (info).
Skips (77) without the binary, the model, or libsystemd in the binary.
"""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import deploy_common as dc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402

dc.need_specd()
if not os.path.exists(dc.MODEL):
    dc.skip(f"no model {dc.MODEL}")

WATCHDOG_S = 2.0
PING_GAP_MAX = WATCHDOG_S / 2 + 0.75  # pings every WatchdogSec/2; slack for a loaded CI machine


free_port = sp.free_port
sse = sp.sse_data


class Stream(threading.Thread):
    """A streaming completion read in the background; records (time, event)."""

    def __init__(self, port, key, max_tokens, prompt):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        self.conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
            headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, (self.resp.status, self.resp.read())
        self.events = []
        self.first = threading.Event()
        self.start()

    def run(self):
        for ev in sse(self.resp):
            self.events.append((time.time(), ev))
            self.first.set()
        self.first.set()
        self.conn.close()

    def result(self):
        self.join(600)
        assert not self.is_alive(), "stream did not end"
        evs = [e for _, e in self.events]
        assert evs and evs[-1] == "[DONE]", evs[-3:]
        chunks = [json.loads(e) for e in evs[:-1]]
        assert all("error" not in c for c in chunks), [c for c in chunks if "error" in c]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        return [f for f in finish if f][-1], usage[-1]["completion_tokens"] if usage else None

    def span(self):
        ts = [t for t, e in self.events if e != "[DONE]"]
        return ts[0], ts[-1]


def raw(port, method, path, key=None, body=None):
    """(status, body bytes) of one request (tests/pyutil/specd_server.py)."""
    return sp.http_request(port, method, path, body, key=key, timeout=120)[:2]


def pings_between(msgs, t0, t1):
    return [t for t, m in msgs if m == "WATCHDOG=1" and t0 <= t <= t1]


def assert_ping_gaps(msgs, t0, t1, what):
    ts = pings_between(msgs, t0, t1)
    gaps = [b - a for a, b in zip([t0] + ts, ts + [t1])]
    assert ts and max(gaps) <= PING_GAP_MAX, f"{what}: WATCHDOG=1 gaps {[round(g, 2) for g in gaps]} s"
    return len(ts)


def make_head(tmp, installed):
    name = os.path.basename(installed.rstrip("/"))
    committed = os.path.join(dc.SRC, "draft", "heads", name)
    if os.path.isdir(committed):
        return committed, "committed head " + name
    out = os.path.join(tmp, "head")
    py = os.environ.get("SPECD_PYTHON", sys.executable)
    mk = subprocess.run([py, os.path.join(dc.SRC, "tools/eagle3/make_random_head.py"), "--layout", "speculators",
                         "--out", out, "--seed", "1", "--rope-theta", "100000"], capture_output=True, text=True)
    return (out, "random EAGLE-3 head") if mk.returncode == 0 else (None, "no draft head")


def expand(cmdline, env):
    """systemd's ${VAR} expansion (one word each) for the simple lines of our unit."""
    words = cmdline.split()
    out = []
    for w in words:
        w = w.replace("/usr/local/bin/specd", os.path.abspath(dc.SPECD))
        m = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", w)
        out.append(env.get(m.group(1), "") if m else w)
    return out


def main():
    unit = dc.read_unit(dc.UNIT)
    exec_start = dc.unit_one(unit, "Service", "ExecStart")
    exec_pre = dc.unit_one(unit, "Service", "ExecStartPre")
    stop_timeout = dc.seconds(dc.unit_one(unit, "Service", "TimeoutStopSec"))
    assert dc.unit_one(unit, "Service", "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert dc.unit_one(unit, "Service", "KillSignal") == "SIGTERM"

    tmp = tempfile.mkdtemp(prefix="deploy_ops_")
    svc = dc.env_dict(os.path.join(dc.ENV_DIR, "smollm2-cpu.env"))
    port = free_port()
    key_path = os.path.join(tmp, "api-key")
    with open(key_path, "w") as f:
        f.write("old-key-0123\n")
    head, how = make_head(tmp, svc["SPECD_DRAFT"])
    svc.update(SPECD_MODEL=dc.MODEL, SPECD_PORT=str(port), SPECD_API_KEY_FILE=key_path, SPECD_THREADS="1")
    if head:
        svc["SPECD_DRAFT"] = head
    else:
        del svc["SPECD_DRAFT"], svc["SPECD_NUM_SPECULATIVE_TOKENS"]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECD_", "NOTIFY_", "WATCHDOG_", "JOURNAL_"))}
    base_env.update(svc)

    pre = subprocess.run(expand(exec_pre, svc), env=base_env, capture_output=True, text=True, timeout=300)
    assert pre.returncode == 0, f"ExecStartPre failed: {pre.stderr}"
    print(f"ExecStartPre ok ({how}): {pre.stdout.strip()}")

    sock_path = os.path.join(tmp, "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(0.1)
    msgs = []
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            try:
                data = sock.recv(65536)
            except socket.timeout:
                continue
            now = time.time()
            for line in data.decode().split("\n"):
                if line:
                    msgs.append((now, line))

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    env = dict(base_env, NOTIFY_SOCKET=sock_path, WATCHDOG_USEC=str(int(WATCHDOG_S * 1e6)), JOURNAL_STREAM="8:4242")
    log_path = os.path.join(tmp, "specd.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(expand(exec_start, svc), env=env, stdout=log, stderr=subprocess.STDOUT)

    def names():
        return [m for _, m in msgs]

    def when(msg):
        return next(t for t, m in msgs if m == msg)

    try:
        deadline = time.time() + 300
        while time.time() < deadline and "READY=1" not in names():
            assert proc.poll() is None, open(log_path).read()
            time.sleep(0.02)
        if not msgs:
            dc.skip("no sd_notify datagram arrived (binary built without libsystemd?)")
        assert "READY=1" in names(), names()
        t_ready = when("READY=1")
        # READY means servable: /health 200 and a completion right away
        assert raw(port, "GET", "/health")[0] == 200
        st, data = raw(port, "POST", "/v1/completions", "old-key-0123",
                       {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert st == 200 and json.loads(data)["usage"]["completion_tokens"] == 2, (st, data)
        n = names()
        i_load = next(i for i, m in enumerate(n) if m.startswith("STATUS=loading"))
        i_warm = n.index("STATUS=warming up")
        i_ready = n.index("READY=1")
        assert i_load < i_warm < i_ready, n[:i_ready + 2]
        assert any(m.startswith("STATUS=serving smollm2-135m-instruct") for m in n[i_ready:]), n
        print(f"READY=1 after {n[:i_ready].count('WATCHDOG=1')} pings while loading; servable at once")

        # size the streams by this machine's speed (CI shares 2 cores with other jobs): A should run
        # ~8 s, B ~2 s, so that both span their signal and B ends well inside SPECD_SHUTDOWN_TIMEOUT
        tr = time.time()
        st, data = raw(port, "POST", "/v1/completions", "old-key-0123",
                       {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 24, "temperature": 0,
                        "ignore_eos": True})
        assert st == 200, data
        rate = 24 / (time.time() - tr)
        n_a = max(40, min(1500, int(rate * 8)))
        n_b = max(10, min(200, int(rate * 2)))
        print(f"speed: {rate:.1f} tokens/s -> streams of {n_a} and {n_b} tokens")

        # idle
        t0 = time.time()
        time.sleep(3.2)
        n_idle = assert_ping_gaps(msgs, t0, time.time(), "idle")

        # busy + SIGHUP: a long stream with the old key spans the reload
        a = Stream(port, "old-key-0123", n_a, "The history of the printing press:")
        assert a.first.wait(120)
        time.sleep(0.5)
        with open(key_path, "w") as f:
            f.write("new-key-4567\n")
        t_hup = time.time()
        proc.send_signal(signal.SIGHUP)
        while time.time() < t_hup + 30 and raw(port, "GET", "/v1/models", "old-key-0123")[0] != 401:
            time.sleep(0.05)
        t_reloaded = time.time()
        assert raw(port, "GET", "/v1/models", "old-key-0123")[0] == 401
        assert raw(port, "GET", "/v1/models", "new-key-4567")[0] == 200
        assert raw(port, "GET", "/v1/models")[0] == 401
        n_before_reload = len(a.events)
        finish, tokens = a.result()
        after = [t for t, e in a.events if t > t_reloaded and e != "[DONE]"]
        assert after, f"the stream ended before the reload was observed ({n_before_reload} events)"
        assert finish == "length" and tokens == n_a, (finish, tokens)
        f0, f1 = a.span()
        n_more = n_a
        while f1 - f0 < 3.0 and n_more < 6000:  # faster than measured: a longer stream for the busy check
            n_more = min(6000, n_more * 3)
            print(f"stream of {f1 - f0:.1f} s is too short to show busy pings; {n_more} tokens")
            c = Stream(port, "new-key-4567", min(n_more, 1900), "The history of the printing press:")
            c.result()
            f0, f1 = c.span()
        assert f1 - f0 >= 3.0, f"no stream lasted 3 s ({f1 - f0:.1f} s)"
        n_busy = assert_ping_gaps(msgs, f0, f1, "busy")
        print(f"SIGHUP: old key 401 / new key 200 after {t_reloaded - t_hup:.2f} s; the old-key stream delivered "
              f"{len(after)} events after that and ended 'length' with {tokens} tokens")
        print(f"WATCHDOG=1: {n_idle} pings in 3.2 s idle, {n_busy} in {f1 - f0:.1f} s busy "
              f"(max gap {PING_GAP_MAX} s)")

        # SIGTERM drain with a stream in flight
        b = Stream(port, "new-key-4567", n_b, "Once upon a time")
        assert b.first.wait(120)
        t_term = time.time()
        proc.send_signal(signal.SIGTERM)
        while time.time() < t_term + 10 and "STOPPING=1" not in names():
            time.sleep(0.02)
        assert "STOPPING=1" in names(), names()[-5:]
        t_stopping = when("STOPPING=1")
        assert raw(port, "GET", "/health")[0] == 503
        st, data = raw(port, "POST", "/v1/completions", "new-key-4567",
                       {"model": "smollm2-135m-instruct", "prompt": "x", "max_tokens": 1})
        assert st == 503, (st, data)
        assert b.is_alive() or b.events[-1][0] > t_stopping, "the stream had ended before STOPPING=1"
        finish, tokens = b.result()
        assert finish == "length" and tokens == n_b, (finish, tokens)
        rc = proc.wait(timeout=stop_timeout)
        t_exit = time.time()
        assert rc == 0, (rc, open(log_path).read()[-2000:])
        assert any(m.startswith("STATUS=draining") for m in names())
        print(f"SIGTERM: STOPPING=1 after {t_stopping - t_term:.2f} s, stream finished 'length' ({tokens} tokens), "
              f"exit 0 after {t_exit - t_term:.1f} s (TimeoutStopSec {stop_timeout:g} s)")
        assert t_ready < t_stopping

        # journald format
        log.close()
        lines = [ln for ln in open(log_path).read().splitlines() if ln.strip()]
        bad = [ln for ln in lines if not re.match(r"^<[0-7]>", ln)]
        assert not bad, f"log lines without a priority prefix: {bad[:5]}"
        assert any(ln.startswith("<6>") and "SIGHUP" in ln and "reloaded" in ln for ln in lines), lines
        assert any(ln.startswith("<6>") and "serving model" in ln for ln in lines), lines
        print(f"journald: all {len(lines)} log lines carry <N> priority prefixes")
        print("deploy_ops: ok")
        return 0
    except BaseException:
        if os.path.exists(log_path):
            print("---- server log (tail) ----\n" + open(log_path).read()[-3000:])
        raise
    finally:
        stop.set()
        listener.join(5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if not log.closed:
            log.close()
        sock.close()
        for d, ds, fs in os.walk(tmp, topdown=False):
            for f in fs:
                os.unlink(os.path.join(d, f))
            for x in ds:
                os.rmdir(os.path.join(d, x))
        os.rmdir(tmp)


if __name__ == "__main__":
    sys.exit(main())
