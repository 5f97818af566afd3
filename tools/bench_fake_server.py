#!/usr/bin/env python3
"""A tiny fake OpenAI-compatible streaming server for developing and testing
specd-bench without a model (stdlib only).

It "generates" words, several per SSE chunk as a speculative server does
(each step drafts --k tokens and accepts a seeded-random number of them, plus
one bonus token), counts what it emits in Prometheus counters named like
vLLM's (prefix "fake:"), and writes its SSE bytes in awkward pieces: events
split at arbitrary byte positions and several events per write, so the
client's incremental parser is exercised over a real socket.

Usage: bench_fake_server.py --port P [--k 3] [--ttft-ms 40] [--step-ms 8]
Request extensions: ignore_eos (else the answer length depends on the prompt),
fake_fail: "400" | "500" | "no_usage" | "midstream" to produce failures.
"""
import argparse
import hashlib
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
COUNTERS = {"generation": 0, "prompt": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0, "requests": 0}
POS = []
ARGS = None


def metrics_text():
    with LOCK:
        c = dict(COUNTERS)
        pos = list(POS)
    lines = [
        "# HELP fake:generation_tokens_total Generated tokens.",
        "# TYPE fake:generation_tokens_total counter",
        'fake:generation_tokens_total{model_name="fake"} %d' % c["generation"],
        'fake:prompt_tokens_total{model_name="fake"} %d' % c["prompt"],
        'fake:request_success_total{model_name="fake"} %d' % c["requests"],
        "# TYPE fake:spec_decode_num_drafts_total counter",
        'fake:spec_decode_num_drafts_total{model_name="fake"} %d' % c["drafts"],
        'fake:spec_decode_num_draft_tokens_total{model_name="fake"} %d' % c["draft_tokens"],
        'fake:spec_decode_num_accepted_tokens_total{model_name="fake"} %d' % c["accepted"],
    ]
    for i, v in enumerate(pos):
        lines.append('fake:spec_decode_num_accepted_tokens_per_pos_total{model_name="fake",position="%d"} %d' % (i, v))
    return "\n".join(lines) + "\n"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # body ends when the connection closes

    def log_message(self, fmt, *args):
        pass

    def send_json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self.send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        elif self.path == "/metrics":
            body = metrics_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_json(404, {"error": {"message": "not found", "type": "not_found", "code": 404}})

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        try:
            req = json.loads(self.rfile.read(n))
        except ValueError:
            self.send_json(400, {"error": {"message": "invalid JSON", "type": "invalid_request_error"}})
            return
        if self.path == "/extras/tokenize":  # llama-cpp-python's shape; one token per word here
            self.send_json(200, {"tokens": list(range(len(req.get("input", "").split())))})
            return
        chat = self.path.endswith("/chat/completions")
        fail = req.get("fake_fail")
        if fail in ("400", "500"):
            self.send_json(int(fail), {"error": {"message": "fake failure %s" % fail, "type": "fake"}})
            return
        text = req["messages"][-1]["content"] if chat else req["prompt"]
        prompt_tokens = len(text.split())
        max_tokens = int(req.get("max_tokens") or 16)
        seed = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)
        rng = random.Random(seed)
        n_out = max_tokens if req.get("ignore_eos") else min(max_tokens, 3 + seed % 40)
        include_usage = (req.get("stream_options") or {}).get("include_usage") and fail != "no_usage"
        rid = "cmpl-%08x" % seed
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        pending = bytearray()

        def emit(obj, flush=False):
            pending.extend(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
            # write in awkward pieces: sometimes hold events back (several per write),
            # sometimes cut the buffer at a random byte
            if flush or rng.random() < 0.5:
                cut = rng.randrange(0, len(pending) + 1) if not flush else len(pending)
                self.wfile.write(bytes(pending[:cut]))
                self.wfile.flush()
                del pending[:cut]

        def chunk(content, finish=None):
            if chat:
                return {"id": rid, "object": "chat.completion.chunk", "model": req.get("model"),
                        "choices": [{"index": 0, "delta": {"content": content} if content is not None else {},
                                     "finish_reason": finish}]}
            return {"id": rid, "object": "text_completion", "model": req.get("model"),
                    "choices": [{"index": 0, "text": content or "", "finish_reason": finish}]}

        time.sleep(ARGS.ttft_ms / 1000.0)
        if chat:
            emit({"id": rid, "object": "chat.completion.chunk",
                  "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        emitted = drafts = draft_tokens = accepted = 0
        pos = [0] * ARGS.k
        first = True
        while emitted < n_out:
            if first:  # prefill produces exactly one token
                step = 1
                first = False
            else:
                time.sleep(ARGS.step_ms / 1000.0)
                acc = 0
                while acc < ARGS.k and rng.random() < 0.6:
                    pos[acc] += 1
                    acc += 1
                drafts += 1
                draft_tokens += ARGS.k
                accepted += acc
                step = min(acc + 1, n_out - emitted)
            words = " ".join("w%d" % (emitted + i) for i in range(step)) + " "
            emitted += step
            emit(chunk(words))
            if fail == "midstream" and emitted > 2:
                self.wfile.write(bytes(pending))
                self.wfile.flush()
                return  # connection closes without usage or [DONE]
        emit(chunk(None if chat else "", "length" if emitted == max_tokens else "stop"))
        if include_usage:
            emit({"id": rid, "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": emitted,
                                                      "total_tokens": prompt_tokens + emitted}})
        emit(b"[DONE]", flush=True)
        with LOCK:
            COUNTERS["generation"] += emitted
            COUNTERS["prompt"] += prompt_tokens
            COUNTERS["requests"] += 1
            COUNTERS["drafts"] += drafts
            COUNTERS["draft_tokens"] += draft_tokens
            COUNTERS["accepted"] += accepted
            while len(POS) < ARGS.k:
                POS.append(0)
            for i in range(ARGS.k):
                POS[i] += pos[i]


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--ttft-ms", type=float, default=40.0)
    ap.add_argument("--step-ms", type=float, default=8.0)
    ARGS = ap.parse_args()
    srv = ThreadingHTTPServer((ARGS.host, ARGS.port), Handler)
    srv.daemon_threads = True
    print("fake server on %s:%d" % (ARGS.host, ARGS.port), flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
