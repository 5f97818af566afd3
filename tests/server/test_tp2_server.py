"""End-to-end tests of `specd serve --tensor-parallel-size 2` (issue 18: "SIGTERM drains at TP 2", and a worker
killed mid-stream at TP 2). SmolLM2 has 9 heads, so TP 2 is refused on it (tests/server/test_tp_server.py checks
that); the model here is the tiny HF Llama "f32" of tools/gen_llama_hf_mini.py (3 layers, 4 heads / 2 KV heads,
its tiny tokenizer; the model_hf_setup fixture writes it), split over 2 rank processes.

The tiny model makes a token in ~0.1 ms, faster than a test can react, so a request is held mid-stream with the
engine's fault injection SPECD_FAULT_ENGINE_STALL_FILE (engine/runtime/engine_loop.c: while the file exists the
engine thread takes no step). The reader thread creates the file as soon as the stream's first token arrives;
an attempt where the whole stream was out before the stall took hold is retried with a new request (at most
ATTEMPTS), so a fast machine cannot make the test vacuous: every assertion below runs on a stream that was
mid-way (open, no finish_reason yet, not advancing) when the signal / the kill came.

  - SIGTERM drains: with a stream held mid-way, SIGTERM; then /health answers 503 and a new completion 503 (the
    stream still open); the stall is lifted; the stream ends with finish_reason "length", usage = max_tokens
    completion tokens and the literal `data: [DONE]`; the server exits 0 within DRAIN_BOUND_S of the lift;
    the worker rank process is gone;
  - a worker killed: with a stream held mid-way and a non-streamed request queued, SIGKILL to rank 1, the
    stall lifted: the stream ends without completing, with an error event (or the connection cut); the queued
    request gets a 5xx; their messages name rank 1 whether the next step failed or rank 0 noticed the group's
    failure first (its monitor aborts the group at once; the requests are then aborted with "the request was
    aborted: tensor parallel group failed: rank 1 (pid P) exited (signal 9)", also in the log, which is
    checked); a new request gets a 5xx or no answer;
    the server exits non-zero within KILL_BOUND_S of the kill and no rank process is left.
Run: python tests/server/test_tp2_server.py (exit 77 = skipped: no binary / no miniature).
"""
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402

MINI = os.path.join(os.environ.get("MODEL_HF_MINI_DIR", ""), "f32")
if __name__ == "__main__" and not (os.access(sp.SPECD, os.X_OK) and os.path.exists(os.path.join(MINI, "tokenizer.json"))):
    print(f"SKIP: need {sp.SPECD} and {MINI}/tokenizer.json (model_hf_setup)")
    sys.exit(77)

import pytest  # noqa: E402

COMMON = ["--device", "cpu", "--max-model-len", "512", "--kv-cache-memory", "8M", "--threads", "1", "--served-model-name", "mini",
          "--shutdown-timeout", "60", "--tensor-parallel-size", "2"]
MAX_TOK = 400
ATTEMPTS = 5
DRAIN_BOUND_S = 10.0
KILL_BOUND_S = 5.0


def worker_pids(server):
    """{rank: pid} of SERVER's worker rank processes (children started with --specd-comm-rank=R)."""
    out = subprocess.run(["pgrep", "-P", str(server.proc.pid), "-f", "specd-comm-rank"], capture_output=True, text=True)
    ranks = {}
    for p in out.stdout.split():
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                for a in f.read().split(b"\0"):
                    if a.startswith(b"--specd-comm-rank="):
                        ranks[int(a.split(b"=")[1])] = int(p)
        except FileNotFoundError:
            pass
    return ranks


def gone(pid):
    """The process no longer exists (or is a zombie no one has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class HeldStream:
    """A raw streamed /v1/completions of MAX_TOK tokens (greedy, ignore_eos) in a thread; on its first token
    the stall file is created, holding the engine. Records every data payload."""

    def __init__(self, server, stall):
        self.server, self.stall = server, stall
        self.events, self.tokens, self.error = [], 0, None  # tokens: text chunks (a chunk may hold several)
        self.first = threading.Event()
        self.t = threading.Thread(target=self.run)
        self.t.start()

    def run(self):
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=120)
            c.request("POST", "/v1/completions", body=json.dumps(
                {"model": "mini", "prompt": "hello there", "max_tokens": MAX_TOK, "temperature": 0,
                 "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
                headers={"Content-Type": "application/json"})
            r = c.getresponse()
            self.status = r.status
            for d in sp.sse_data(r):
                self.events.append(d)
                if d != "[DONE]":
                    j = json.loads(d)
                    if j.get("choices") and j["choices"][0].get("text") is not None:
                        self.tokens += 1
                if not self.first.is_set():
                    open(self.stall, "w").close()
                    self.first.set()
        except Exception as e:  # noqa: BLE001 - a cut connection is an observation here
            self.error = e
        finally:
            self.first.set()

    def finish(self):
        for d in self.events:
            if d != "[DONE]":
                j = json.loads(d)
                if j.get("choices") and j["choices"][0].get("finish_reason"):
                    return j["choices"][0]["finish_reason"]
        return None

    def usage(self):
        for d in self.events:
            if d != "[DONE]" and json.loads(d).get("usage"):
                return json.loads(d)["usage"]
        return None


def hold_mid_stream(server, stall):
    """A stream held by the stall before its finish_reason (no new chunk for 1 s; the step in flight when
    the file appeared may still land); retries when the whole stream outran the stall."""
    for attempt in range(ATTEMPTS):
        h = HeldStream(server, stall)
        assert h.first.wait(120), "no first token within 120 s"
        n, since, deadline = h.tokens, time.time(), time.time() + 20
        while h.t.is_alive() and h.finish() is None and time.time() < deadline:
            time.sleep(0.05)
            if h.tokens != n:
                n, since = h.tokens, time.time()
            elif time.time() - since > 1.0:
                print(f"attempt {attempt + 1}: stream held after {n} text chunks of {MAX_TOK} tokens")
                return h
        assert time.time() < deadline, "the engine kept stepping with the stall file present"
        os.unlink(stall)  # the whole stream came out first: again
        h.t.join(60)
    pytest.fail(f"the stream outran the stall {ATTEMPTS} times")


def new_server(stall):
    s = sp.Server(COMMON, model=MINI, env={"SPECD_FAULT_ENGINE_STALL_FILE": stall})
    w = worker_pids(s)
    assert sorted(w) == [1], w
    return s, w


def test_sigterm_drains_tp2():
    stall = tempfile.mktemp(prefix="specd_stall_")
    s, workers = new_server(stall)
    try:
        h = hold_mid_stream(s, stall)
        held = h.tokens
        s.proc.send_signal(signal.SIGTERM)
        # draining: /health and new requests 503 while the held stream is still open
        deadline, health = time.time() + 10, None
        while time.time() < deadline:
            health = s.raw("GET", "/health", auth=False, timeout=10)[0]
            if health == 503:
                break
            time.sleep(0.05)
        assert health == 503, health
        st, body = s.post("/v1/completions", {"model": "mini", "prompt": "hi", "max_tokens": 4}, timeout=30)
        assert st == 503, (st, body)
        assert h.t.is_alive() and h.tokens == held, "the held stream moved or ended during the stall"
        t_lift = time.time()
        os.unlink(stall)
        h.t.join(timeout=120)
        assert h.error is None, h.error
        assert h.status == 200
        assert h.events and h.events[-1] == "[DONE]", h.events[-3:]
        assert h.finish() == "length", h.finish()
        assert h.usage()["completion_tokens"] == MAX_TOK, h.usage()
        rc = s.proc.wait(timeout=60)
        dt = time.time() - t_lift
        assert rc == 0, s.read_log()
        assert dt < DRAIN_BOUND_S, dt
        for w in workers.values():
            assert gone(w), f"worker {w} still there after the drain"
        print(f"SIGTERM at TP 2 after {held} text chunks of {MAX_TOK} tokens: /health 503, new request 503, the stream "
              f"completed ({h.usage()['completion_tokens']} tokens, [DONE]), exit 0 {dt:.2f} s after the stall was lifted")
    finally:
        if os.path.exists(stall):
            os.unlink(stall)
        if s.proc.poll() is None:
            s.proc.kill()


def reason_ok(msg):
    """A failed request's message names rank 1: the failed step's reason, or, when rank 0 noticed the group's
    failure between two steps (its monitor aborts the group at once; the engine was stalled), the abort of
    every request with the group's reason (server/serve.c http_set_draining_why)."""
    return "rank 1" in msg


def test_worker_killed_mid_stream_tp2():
    stall = tempfile.mktemp(prefix="specd_stall_")
    s, workers = new_server(stall)
    try:
        h = hold_mid_stream(s, stall)
        held = h.tokens
        queued = {}
        tq = threading.Thread(target=lambda: queued.update(r=s.post(
            "/v1/completions", {"model": "mini", "prompt": "hi", "max_tokens": 50}, timeout=60)))
        tq.start()  # a non-streamed request in flight (waiting for the stalled engine)
        time.sleep(0.3)
        t_kill = time.time()
        os.kill(workers[1], signal.SIGKILL)
        os.unlink(stall)
        h.t.join(timeout=60)
        tq.join(timeout=60)
        assert not h.t.is_alive(), "the stream did not end after the worker died"
        assert h.finish() != "length", "the stream completed"
        errs = [json.loads(d)["error"]["message"] for d in h.events if d != "[DONE]" and "error" in json.loads(d)]
        assert errs or h.error is not None, ("the stream ended without an error event or a cut", h.events[-3:])
        for m in errs:
            assert reason_ok(m), m
        st, body = queued["r"]
        assert 500 <= st < 600, (st, body)
        assert reason_ok(body["error"]["message"]), body
        try:
            st2, _ = s.post("/v1/completions", {"model": "mini", "prompt": "hi", "max_tokens": 4}, timeout=10)
            assert 500 <= st2 < 600, st2
        except (OSError, http.client.HTTPException):
            pass  # already gone: no answer is the other acceptable outcome
        rc = s.proc.wait(timeout=KILL_BOUND_S + 5)
        dt = time.time() - t_kill
        assert rc not in (0, None), rc
        assert dt < KILL_BOUND_S, dt
        log = s.read_log(1 << 20)
        assert f"rank 1 (pid {workers[1]}) exited (signal 9)" in log, log[-2000:]
        time.sleep(0.2)
        assert all(gone(w) for w in workers.values())
        print(f"worker killed at TP 2 after {held} text chunks of {MAX_TOK} tokens: the stream ended after "
              f"{h.tokens} chunks ({errs[0] if errs else h.error}), the queued request {st} "
              f"({body['error']['message']}), server exit {rc} {dt:.2f} s after the kill")
    finally:
        if os.path.exists(stall):
            os.unlink(stall)
        if s.proc.poll() is None:
            s.proc.kill()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s", "-p", "no:cacheprovider"]))
