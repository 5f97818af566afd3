"""test_distill_data.py: pytest for the self-distillation data steps (stdlib tools, no torch).

make_prompts.py: cleaning and every filter on hand-made requests, exact and
near-duplicate removal (a Jaccard computed by hand), the evaluation-overlap
check, a deterministic schedule, and generation against a fake OpenAI server
on localhost (no network): it stops at --target, resumes after failed
requests to exactly the output of an uninterrupted run, and refuses another
topic list in the same directory.
prepare_data.py: the prompts-file mode (ids, sources, messages), resume by id,
a torn last line, HTTP 4xx recorded as skipped and never retried, 5xx retried
on the next run (exit status 1 meanwhile), bad prompts files refused, and the
GSM8K mode unchanged.

Run: python3 -m pytest -q tools/train_eagle3/test_distill_data.py (any python with pytest).
"""
import gzip
import http.server
import json
import os
import re
import sys
import threading

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_prompts as mp  # noqa: E402
import prepare_data as pdm  # noqa: E402


# ------------------------------------------------------------ filters ---

def test_clean_unwraps_and_strips():
    assert mp.clean('  Request: "How do volcanoes form?"  ') == "How do volcanoes form?"
    # quotes inside are kept (not a single wrapping pair)
    assert mp.clean('"a" or "b" for dinner?') == '"a" or "b" for dinner?'


@pytest.mark.parametrize("text,fin,why", [
    ("How do volcanoes form, and why do some of them explode?", "stop", ""),
    ("How do volcanoes form, and why do some of them explode?", "length", "truncated"),
    ("Volcano?", "stop", "length"),
    ("x " * 800, "stop", "length"),
    ("Sure! Here is a request about volcanoes for you to answer.", "stop", "meta"),
    ("Topic: volcanoes\nTask: explain\nRequest: why?", "stop", "meta"),
    ("As an AI, I cannot tell you how volcanoes form in the world.", "stop", "meta"),
    ("Write a letter to [your friend's name] about the volcano trip.", "stop", "meta"),
    ("I'm ready to help with your volcano questions, what do you need?", "stop", "meta"),
    ("Почему вулканы извергаются и как они образуются на земле?", "stop", "language"),
    ("Volcano lava magma crater eruption ash plume vent basalt rock.", "stop", "language"),
    ("the volcano is hot " * 6, "stop", "repetitive"),
])
def test_check_reasons(text, fin, why):
    ok, reason = mp.check(mp.clean(text), fin, "volcanoes")
    assert reason == why and ok == (why == "")


def test_check_code_request_is_english():
    req = ("My function should add two numbers but it returns the wrong value. What is wrong?\n\n"
           "def add(a, b):\n    return a - b")
    assert mp.check(req, "stop", "Python programming") == (True, "")


def test_topic_is_optional_and_recorded():
    off = "What are the best ways to save money on groceries every week?"
    assert mp.check(off, "stop", "volcanoes") == (True, "")
    assert mp.check(off, "stop", "volcanoes", require_topic=True) == (False, "off_topic")
    assert mp.on_topic("Why do volcanoes erupt?", "volcanoes")
    assert mp.on_topic("Tell me about a volcanic island.", "volcanoes")   # 5-letter prefix "volca"
    assert not mp.on_topic(off, "volcanoes")
    assert mp.on_topic(off, "C++")   # no usable topic word: passes


def test_shingles_and_jaccard_by_hand():
    a = mp.shingles(mp.normalise("How do I bake a loaf of bread at home?"))
    b = mp.shingles(mp.normalise("How do I bake a loaf of rye bread at home?"))
    # a: 8 shingles of 10 words, b: 9 of 11; shared: "how do i","do i bake","i bake a","bake a loaf",
    # "a loaf of","bread at home" = 6 -> 6 / (8 + 9 - 6)
    assert len(a) == 8 and len(b) == 9 and len(a & b) == 6
    idx = mp.ShingleIndex()
    idx.add(a)
    assert idx.max_jaccard(b) == pytest.approx(6 / 11)
    assert idx.max_jaccard(mp.shingles("something else entirely different here")) == 0.0


def _raw(pos, text, topic="baking bread", fin="stop"):
    return {"pos": pos, "topic": topic, "task": "t", "seed": pos, "text": text, "finish_reason": fin}


def test_finalize_dedup_order_and_eval_overlap():
    recs = [
        _raw(3, "How do I bake a loaf of bread at home without a bread machine?"),   # near-dup of pos 0
        _raw(0, "How do I bake a loaf of bread at home without a machine?"),
        _raw(1, "how do i bake a loaf of bread at HOME without a machine"),          # exact after normalising
        _raw(2, "Sure, here is one: bake bread"),                                    # meta
        _raw(4, "What is the best flour for baking sourdough bread and why?"),
        _raw(5, "Write a short poem about the first snow of winter in the mountains."),
        _raw(6, "Write a short poem about the first snow of the winter in the mountains."),
    ]
    eval_texts = ["What is the best flour for baking sourdough bread, and why?"]
    kept, stats = mp.finalize(recs, eval_texts)
    assert [k["id"] for k in kept] == ["selfgen:0", "selfgen:5"]
    assert stats["rejected"] == {"duplicate": 1, "eval_overlap": 1, "meta": 1, "near_duplicate": 2}
    assert stats["kept"] == 2 and stats["attempts"] == 7
    # position order decides which copy is kept, whatever order the lines came in
    kept2, _ = mp.finalize(list(reversed(recs)), eval_texts)
    assert kept2 == kept
    # the eval check is what removed pos 4
    kept3, _ = mp.finalize(recs, [])
    assert [k["id"] for k in kept3] == ["selfgen:0", "selfgen:4", "selfgen:5"]


def test_schedule_covers_every_pair_per_pass():
    s = mp.schedule(5, 4, seed=3, n_passes=2)
    assert len(s) == 40
    for p in (0, 1):
        assert sorted((t, k) for q, t, k in s if q == p) == [(t, k) for t in range(5) for k in range(4)]
    assert s == mp.schedule(5, 4, seed=3, n_passes=2)
    assert s[:20] != s[20:] and s != mp.schedule(5, 4, seed=4, n_passes=2)


# ------------------------------------------------------- fake server ---

class FakeServer:
    """OpenAI-ish endpoints on 127.0.0.1: /v1/models, /v1/completions (a request written from the
    prompt's topic and the seed), /v1/chat/completions (an answer echoing the question)."""

    def __init__(self):
        self.fail = {}       # text in the request's tail -> HTTP status to answer with (until removed)
        self.calls = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                b = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(b)))
                self.end_headers()
                self.wfile.write(b)

            def do_GET(self):
                self._send(200, {"data": [{"id": "fake"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body.get("prompt") or body["messages"][-1]["content"]
                outer.calls.append(body)
                for key, code in list(outer.fail.items()):
                    if key in text[-200:]:
                        return self._send(code, {"error": {"message": f"fake {code}"}})
                if self.path == "/v1/completions":
                    topic = re.findall(r"Topic: (.*)\nTask: (.*)\nRequest:$", text)[-1]
                    s = body["seed"]
                    out = (f" Please explain {topic[0]} to me, case {s % 9}, in a few words." if s % 4
                           else " Sure! Here is a request.")
                    return self._send(200, {"choices": [{"text": out, "finish_reason": "stop"}],
                                            "usage": {"completion_tokens": 12}})
                return self._send(200, {"choices": [{"message": {"content": "answer: " + text},
                                                     "finish_reason": "stop"}],
                                        "usage": {"prompt_tokens": 7, "completion_tokens": 3}})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def _topics(tmp_path, names):
    p = tmp_path / "topics.txt"
    p.write_text("# comment\n" + "\n".join(names) + "\n")
    return str(p)


def _mp_args(server, out, topics, *extra):
    return ["--base-url", server.url, "--out-dir", str(out), "--topics", topics, "--data-dir", "/nonexistent",
            "--chunk", "16", "--concurrency", "4", *extra]


def _lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def test_make_prompts_generation_resume_and_target(server, tmp_path):
    topics = _topics(tmp_path, ["volcanoes", "baking bread", "chess"])
    n_pairs = 3 * len(mp.TASKS)
    # reference: uninterrupted, one pass over every pair
    ref = tmp_path / "ref"
    assert mp.main(_mp_args(server, ref, topics, "--target", "100000", "--max-passes", "1")) == 0
    raw = _lines(ref / "raw.jsonl")
    assert sorted(r["pos"] for r in raw) == list(range(n_pairs))
    kept = _lines(ref / "prompts.jsonl")
    # seeds = position (seed 0): every 4th position answers with meta text; case s % 9 makes
    # at most 9 distinct texts per topic, the rest are exact duplicates
    stats = json.load(open(ref / "prompts_stats.json"))
    assert stats["rejected"]["meta"] == len([p for p in range(n_pairs) if p % 4 == 0])
    assert len(kept) == len({k["prompt"] for k in kept}) <= 27
    assert all(k["prompt"].startswith("Please explain ") for k in kept)
    assert all(k["seed"] == int(k["id"].split(":")[1]) for k in kept)

    # interrupted: two positions fail with a 500 on the first run, then a rerun completes them
    part = tmp_path / "part"
    sched = mp.schedule(3, len(mp.TASKS), 0, 1)
    topics_list = mp.read_topics(topics)
    for pos in (5, 40):
        p, t, k = sched[pos]
        server.fail[f"Topic: {topics_list[t]}\nTask: {mp.TASKS[k]}\nRequest:"] = 500
    assert mp.main(_mp_args(server, part, topics, "--target", "100000", "--max-passes", "1")) == 1
    assert len(_lines(part / "raw.jsonl")) == n_pairs - 2
    server.fail.clear()
    # a torn last line (killed mid-write) is dropped, then the run resumes
    with open(part / "raw.jsonl", "a") as f:
        f.write('{"pos": 7, "text": "tor')
    n_calls = len(server.calls)
    assert mp.main(_mp_args(server, part, topics, "--target", "100000", "--max-passes", "1")) == 0
    assert len(server.calls) - n_calls == 2            # only the two failed positions were asked again
    assert _lines(part / "prompts.jsonl") == kept

    # --target: stops after the first chunk that reaches it
    small = tmp_path / "small"
    assert mp.main(_mp_args(server, small, topics, "--target", "5", "--max-passes", "1")) == 0
    assert len(_lines(small / "raw.jsonl")) == 16 and len(_lines(small / "prompts.jsonl")) >= 5

    # another topic list in the same directory is refused
    other = _topics(tmp_path, ["volcanoes", "chess"])
    with pytest.raises(SystemExit):
        mp.main(_mp_args(server, small, other, "--target", "5"))


# ------------------------------------------------------- prepare_data ---

def _prompts_file(tmp_path, items, name="prompts.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(o) + "\n" for o in items))
    return str(p)


def test_prepare_prompts_mode(server, tmp_path):
    pf = _prompts_file(tmp_path, [{"id": "selfgen:3", "prompt": "How do tides work?"},
                                  {"id": "selfgen:9", "prompt": "Write a haiku about tea."},
                                  {"id": "extra:1", "prompt": "Name a prime.", "source": "mine"},
                                  {"id": "selfgen:11", "prompt": "REFUSE this one"},
                                  {"id": "selfgen:12", "prompt": "FLAKY this one"}])
    out = str(tmp_path / "resp.jsonl")
    server.fail = {"REFUSE": 400, "FLAKY": 503}
    args = ["--base-url", server.url, "--out", out, "--num-gsm8k", "0", "--prompts", pf, "--concurrency", "2",
            "--max-tokens", "33"]
    assert pdm.main(args) == 1                      # the 503 is a failure: rerun
    recs = {r["id"]: r for r in _lines(out)}
    assert set(recs) == {"selfgen:3", "selfgen:9", "extra:1"}
    assert recs["selfgen:3"]["messages"] == [{"role": "user", "content": "How do tides work?"},
                                             {"role": "assistant", "content": "answer: How do tides work?"}]
    assert recs["selfgen:3"]["source"] == "selfgen" and recs["extra:1"]["source"] == "mine"
    assert recs["selfgen:9"]["completion_tokens"] == 3 and recs["selfgen:9"]["finish_reason"] == "stop"
    assert all(c["max_tokens"] == 33 and c["temperature"] == 0 for c in server.calls)
    assert [r["id"] for r in _lines(out + ".skipped")] == ["selfgen:11"]
    # rerun: only the flaky one is asked (the refused one is not retried); a torn tail is dropped
    with open(out, "a") as f:
        f.write('{"id": "selfgen:3", "mess')
    server.calls.clear()
    server.fail = {"REFUSE": 400}
    assert pdm.main(args) == 0
    assert [c["messages"][0]["content"] for c in server.calls] == ["FLAKY this one"]
    ids = [r["id"] for r in _lines(out)]
    assert sorted(ids) == sorted(["selfgen:3", "selfgen:9", "extra:1", "selfgen:12"])
    server.calls.clear()
    assert pdm.main(args) == 0 and server.calls == []


@pytest.mark.parametrize("lines,msg", [
    (['{"id": "a:1", "prompt": "x"}', '{"id": "a:1", "prompt": "y"}'], "repeated"),
    (['{"id": "a:1"}'], "not a"),
    (['not json'], "not a"),
    (['{"id": "a:1", "prompt": "   "}'], "non-empty"),
])
def test_prepare_bad_prompts_file(server, tmp_path, lines, msg):
    pf = tmp_path / "bad.jsonl"
    pf.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as e:
        pdm.main(["--base-url", server.url, "--out", str(tmp_path / "o.jsonl"), "--num-gsm8k", "0",
                  "--prompts", str(pf)])
    assert msg in str(e.value)


def test_prepare_gsm8k_mode_unchanged(server, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "gsm8k_train.jsonl").write_text("".join(json.dumps({"question": f"Q{i}?", "answer": "#### 1"}) + "\n"
                                                 for i in range(5)))
    with gzip.open(d / "humaneval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    out = str(tmp_path / "g.jsonl")
    assert pdm.main(["--base-url", server.url, "--out", out, "--data-dir", str(d), "--num-gsm8k", "3",
                     "--humaneval"]) == 0
    recs = {r["id"]: r for r in _lines(out)}
    assert set(recs) == {"gsm8k_train:0", "gsm8k_train:1", "gsm8k_train:2", "humaneval:HumanEval/0"}
    assert recs["gsm8k_train:2"]["messages"][0]["content"] == "Q2?"
    assert recs["humaneval:HumanEval/0"]["messages"][0]["content"] == "Complete this Python function.\n\ndef f():\n"
