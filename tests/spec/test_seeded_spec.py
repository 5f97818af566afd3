"""Seeded sampling with speculation is reproducible (issue 20 item 4), through the real `specd serve`.

The draft samples its tokens (temperature > 0) and the target accepts or rejects them with random draws, so
a speculative server only reproduces a seeded request if BOTH streams are the request's own: the target's
sampler RNG (seeded from `seed`, as without speculation) and the draft's (the proposer's seed_seq, seeded by
the engine from the same `seed`). Before that, the draft's RNG was one per proposer: the same seeded request
drew different drafts depending on what ran before it and beside it, so its text changed.

Server: SmolLM2-135M Q4_1 with the committed head draft/heads/smollm2-135m-eagle3, k = 3, sampled drafts
(temperature 0.6, top_p 0.95), a GSM8K question (the head's domain: drafts are accepted AND rejected, checked
on /metrics, so both random streams are exercised). Each SERVERS entry is one configuration: fixed k, and
adaptive k (the default; a seeded sampling request's k then depends on its own acceptance only, nominal costs,
engine/runtime/spec_adapt.h):
  - the same seeded request twice, alone: same text; a different seed: different text (sampling is on);
  - the same request sent into a batch of seven other requests (other prompts, seeds, temperatures, one
    greedy), at two different moments: same text as alone;
  - n = 3: the three choices are reproduced by a second n = 3 call, and choice i equals the request alone
    with seed + i (the server's n > 1 convention), so choices do not depend on sharing a batch.
Needs $SPECD_BUILD_DIR/server/specd, the SmolLM2 GGUF, the committed head and the openai client; exits 77
otherwise.
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402

SRC, MODEL, SPECD = sp.SRC, sp.MODEL, sp.SPECD
HEAD = os.path.join(SRC, "draft", "heads", "smollm2-135m-eagle3")
if __name__ == "__main__":
    if not sp.have_specd_and_model() or not os.path.isdir(HEAD):
        print(f"skip: need {SPECD}, {MODEL} and {HEAD}")
        sys.exit(77)
    try:
        import openai  # noqa: F401
    except ImportError as e:
        print(f"skip: {e}")
        sys.exit(77)

import pytest  # noqa: E402

COMMON = ["--served-model-name", "m", "--max-model-len", "512", "--kv-cache-memory", "64M", "--threads", "1",
          "--max-num-seqs", "16", "--draft", HEAD, "--num-speculative-tokens", "3"]
SERVERS = {"fixed": ["--no-speculative-adaptive"], "adaptive": []}   # adaptive: the default
Q = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
     "How many clips did Natalia sell altogether in April and May?")
OTHERS = ["James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
          "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
          "How much did she earn?",
          "Write a haiku about the sea.",
          "Betty is saving money for a new wallet which costs $100. She has half of the money. How much is missing?",
          "List three uses of a paperclip.",
          "Julie is reading a 120-page book. Yesterday, she read 12 pages. How many pages are left?",
          "What is the capital of France? Answer in one sentence."]
MAX_TOKENS = 48


def ask(srv, seed, n=1, q=Q, temperature=0.6, max_tokens=MAX_TOKENS):
    r = srv.client().chat.completions.create(model="m", messages=[{"role": "user", "content": q}], n=n, seed=seed,
                                             temperature=temperature, top_p=0.95, max_tokens=max_tokens)
    return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]


def spec_counters(srv):
    m = srv.wait_idle()
    p = "specd_spec_decode_"
    return int(m[p + "num_draft_tokens_total"]), int(m[p + "num_accepted_tokens_total"])


@pytest.fixture(scope="module", params=sorted(SERVERS))
def server(request):
    s = sp.Server([*COMMON, *SERVERS[request.param]], log_prefix="specd_seeded_")
    try:
        yield s
    finally:
        rc = s.stop()
        assert rc == 0, s.read_log()


def test_repeated_alone(server):
    d0, a0 = spec_counters(server)
    first = ask(server, 1234)
    for _ in range(2):
        assert ask(server, 1234) == first
    d1, a1 = spec_counters(server)
    # speculation really ran on the sampled request: drafts both accepted and rejected
    assert 0 < a1 - a0 < d1 - d0, (d1 - d0, a1 - a0)
    assert ask(server, 1235) != first   # the seed matters: this is sampling


def under_load(srv, delay):
    """The seeded request sent DELAY seconds after seven others started (it joins their running batch)."""
    out, errs = {}, []

    def other(i):
        try:
            ask(srv, 500 + i, q=OTHERS[i], temperature=0.0 if i == 3 else 0.6 + 0.1 * (i % 4),
                max_tokens=24 + 8 * i)
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    ts = [threading.Thread(target=other, args=(i,)) for i in range(len(OTHERS))]
    for t in ts:
        t.start()
    time.sleep(delay)
    out["text"] = ask(srv, 1234)
    for t in ts:
        t.join()
    assert not errs, errs
    return out["text"]


def test_under_concurrent_load(server):
    alone = ask(server, 1234)
    for delay in (0.0, 0.7):
        assert under_load(server, delay) == alone, f"seeded request sent {delay} s into a batch of 7 changed"


def test_n3_choices_reproduce(server):
    three = ask(server, 77, n=3)
    assert len(three) == 3 and len(set(three)) > 1, three   # different seeds per choice
    assert ask(server, 77, n=3) == three
    for i in range(3):
        assert ask(server, 77 + i) == [three[i]], f"choice {i} differs from the request alone with seed {77 + i}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
