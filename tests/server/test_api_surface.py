"""test_api_surface.py (server_api_surface): the OpenAI surface of issue 21 on SmolLM2 through the real
`specd serve` and the openai Python client.

  - logit_bias: -100 on the greedy token makes the runner-up (the second entry of that position's
    top_logprobs, read from the unbiased request) the output; +100 on a token makes every output token that
    token; both identical with speculation on (--draft the committed draft/heads/smollm2-135m-eagle3, k = 3;
    /metrics shows drafts were verified) and off, streamed and not;
  - refused fields: every case of point 5 (unimplemented fields, response_format other than text,
    best_of != n, suffix, parallel_tool_calls false, tools with a template that has no tool format,
    unknown fields) is a 400 whose `param` names the field and whose message says why;
    max_completion_tokens errors name max_completion_tokens; numbers out of range (even ones too large for
    a 64-bit integer) say "out of range";
  - GET /v1/models/{id} (client.models.retrieve), 404 for another id; system_fingerprint on every body and
    chunk;
  - logprobs: completions top_logprobs hold the top N plus the sampled token when it is not among them
    (N + 1 entries, as OpenAI's legacy API and vLLM); a token that is not valid UTF-8 alone is spelled
    "bytes:\\xNN" (chat: with its `bytes` field), so two partial tokens never collide as one U+FFFD key.
Run: python tests/server/test_api_surface.py (exit 77 = skipped: no binary / model).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402

HEAD = os.path.join(sp.SRC, "draft", "heads", "smollm2-135m-eagle3")
if __name__ == "__main__" and (not sp.have_specd_and_model() or not os.path.isdir(HEAD)):
    print(f"skip: need {sp.SPECD}, {sp.MODEL} and {HEAD}")
    sys.exit(77)

import openai  # noqa: E402
import pytest  # noqa: E402

COMMON = ["--served-model-name", "smol", "--max-model-len", "256", "--kv-cache-memory", "32M", "--threads", "1"]
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def plain():
    s = sp.Server(COMMON, env={"SPECD_TEST_FORCED_OUTPUT": "1"}, log_prefix="specd_surface_plain_")
    yield s
    assert s.stop() == 0, s.read_log()


@pytest.fixture(scope="module")
def spec():
    s = sp.Server(COMMON + ["--draft", HEAD, "--num-speculative-tokens", "3"], log_prefix="specd_surface_spec_")
    yield s
    assert s.stop() == 0, s.read_log()


def complete(srv, **kw):
    st, out = srv.post("/v1/completions", dict(dict(prompt=PROMPT, max_tokens=8, temperature=0), **kw))
    assert st == 200, out
    return out


def token_ids(srv, text):
    st, out = srv.post("/tokenize", {"prompt": text})
    assert st == 200
    return out["tokens"]


# ---------------------------------------------------------------- logit_bias
def test_logit_bias_runner_up_and_forced(plain, spec):
    base = complete(plain, logprobs=2)
    lp = base["choices"][0]["logprobs"]
    top0 = list(lp["top_logprobs"][0].items())
    greedy, runner = top0[0][0], top0[1][0]
    assert lp["tokens"][0] == greedy and top0[0][1] > top0[1][1]
    g_id, r_id = token_ids(plain, greedy), token_ids(plain, runner)
    assert len(g_id) == 1 and len(r_id) == 1, (greedy, runner)
    # -100 on the greedy token: the first token is the runner-up
    down = complete(plain, logprobs=2, logit_bias={str(g_id[0]): -100})
    assert down["choices"][0]["logprobs"]["tokens"][0] == runner
    assert down["choices"][0]["text"] != base["choices"][0]["text"]
    # +100 on a token far down the list: every token is that one
    banana = token_ids(plain, " banana")
    assert len(banana) == 1
    up = complete(plain, logit_bias={str(banana[0]): 100})
    assert up["choices"][0]["text"] == " banana" * 8, up
    # the same with speculation (greedy verification sees the bias; drafts that miss are rejected)
    for body in (dict(logprobs=2, logit_bias={str(g_id[0]): -100}), dict(logit_bias={str(banana[0]): 100}),
                 dict(logit_bias={str(g_id[0]): -100, str(r_id[0]): -3.5}, max_tokens=24), dict(max_tokens=24)):
        a, b = complete(plain, **body), complete(spec, **body)
        assert a["choices"][0]["text"] == b["choices"][0]["text"], body
        assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]
    m = spec.metrics()
    assert m["specd_spec_decode_num_draft_tokens_total"] > 0, m   # speculation really ran


def test_logit_bias_chat_stream_and_sampling(plain, spec):
    banana = token_ids(plain, " banana")[0]
    for srv in (plain, spec):
        c = srv.client()
        chunks = c.chat.completions.create(model="smol", messages=CHAT, max_tokens=6, temperature=0, stream=True,
                                           logit_bias={str(banana): 100})
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == " banana" * 6
        # sampling: +100 leaves the token with all of the mass
        r = c.chat.completions.create(model="smol", messages=CHAT, max_tokens=6, temperature=1.0, seed=3,
                                      logit_bias={str(banana): 100})
        assert r.choices[0].message.content == " banana" * 6


# ---------------------------------------------------------------- refusals
REFUSED = [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format",
     "not supported"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions", "not supported"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call", "not supported"),
    ("/v1/chat/completions", {"audio": {"voice": "x"}}, "audio", "not supported"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities", "not supported"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options", "not supported"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort", "not supported"),
    ("/v1/chat/completions", {"store": True}, "store", "must be false"),
    ("/v1/chat/completions", {"metadata": {"a": "b"}}, "metadata", "not supported"),
    ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier", "not supported"),
    ("/v1/chat/completions", {"parallel_tool_calls": False}, "parallel_tool_calls", "not supported"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "no tool-call format"),
    ("/v1/chat/completions", {"echo": True}, "echo", "completions field"),
    ("/v1/chat/completions", {"vendor_extra": 1}, "vendor_extra", "unknown field 'vendor_extra'"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens",
     "'max_completion_tokens' must be at least 1"),
    ("/v1/chat/completions", {"max_completion_tokens": 1000}, "max_completion_tokens", "max_completion_tokens"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias", "out of range"),
    ("/v1/chat/completions", {"logit_bias": {"5": "x"}}, "logit_bias", "must be a number"),
    ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("/v1/chat/completions", {"logit_bias": {"999999": 1}}, "logit_bias", "out of vocabulary"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "refusal": "no"}]}, "messages",
     "messages[0].refusal is not supported"),
    ("/v1/completions", {"suffix": "x"}, "suffix", "not supported"),
    ("/v1/completions", {"best_of": 2}, "best_of", "not supported"),
    ("/v1/completions", {"tools": []}, "tools", "chat field"),
    ("/v1/completions", {"temperature": 1e6 + 1}, "temperature", "out of range"),
    ("/v1/completions", {"top_p": 2}, "top_p", "out of range"),
    ("/v1/completions", {"n": 1000}, "n", "out of range"),
    ("/v1/completions", {"seed": 1e30}, "seed", "out of range"),
    ("/v1/completions", {"max_tokens": 100000000000000000000000}, "max_tokens", "out of range"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "at most 20"),
    ("/v1/completions", {"guided_json": {}}, "guided_json", "not supported"),
    ("/v1/completions", {"specd_test_forced_output": [1]}, "specd_test_forced_output", "SPECD_TEST_FORCED_OUTPUT"),
]


@pytest.mark.parametrize("path,body,param,msg", REFUSED, ids=[f"{r[0].split('/')[-1]}-{r[2]}-{i}"
                                                               for i, r in enumerate(REFUSED)])
def test_refused_fields(spec, path, body, param, msg):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    req = dict(base) if "max_completion_tokens" in body else dict(base, max_tokens=2)
    req.update(body)
    st, out = spec.post(path, req)
    assert st == 400, (body, out)
    e = out["error"]
    assert e["param"] == param and msg in e["message"] and e["type"] == "invalid_request_error", (body, e)


def test_accepted_forms(spec):
    """Fields accepted in the one form specd implements, and nulls (which clients send for unset fields)."""
    for body in ({"response_format": {"type": "text"}}, {"store": False}, {"modalities": ["text"]},
                 {"parallel_tool_calls": True}, {"tools": None, "tool_choice": None, "functions": None},
                 {"best_of": 1}, {"user": "u"}, {"logit_bias": {}}):
        st, out = spec.post("/v1/chat/completions", dict(messages=CHAT, max_tokens=2, **body))
        assert st == 200, (body, out)


# ---------------------------------------------------------------- models, fingerprint
def test_models_retrieve_and_fingerprint(spec):
    c = spec.client()
    m = c.models.retrieve("smol")
    assert m.id == "smol" and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    r = c.chat.completions.create(model="smol", messages=CHAT, max_tokens=2)
    assert r.system_fingerprint and r.system_fingerprint.startswith("fp_specd_")
    r2 = c.completions.create(model="smol", prompt=PROMPT, max_tokens=2)
    assert r2.system_fingerprint == r.system_fingerprint
    for ch in c.chat.completions.create(model="smol", messages=CHAT, max_tokens=2, stream=True,
                                        stream_options={"include_usage": True}):
        assert ch.system_fingerprint == r.system_fingerprint


# ---------------------------------------------------------------- logprobs
def test_top_logprobs_include_the_sampled_token(plain):
    base = complete(plain, logprobs=1)
    g = base["choices"][0]["logprobs"]["tokens"][0]
    gid = token_ids(plain, g)[0]
    out = complete(plain, logprobs=1, logit_bias={str(gid): -100}, max_tokens=1)
    lp = out["choices"][0]["logprobs"]
    sampled, top = lp["tokens"][0], lp["top_logprobs"][0]
    # raw logprobs: the greedy (unbiased) token is still the top-1; the sampled runner-up is added
    assert list(top)[0] == g and sampled != g and sampled in top and len(top) == 2
    assert top[sampled] == lp["token_logprobs"][0]


def test_partial_utf8_tokens_are_bytes(plain):
    ids = token_ids(plain, "🍕")
    assert len(ids) >= 2, ids   # the emoji is split into byte tokens by SmolLM2's BPE
    st, out = plain.post("/v1/completions", {"prompt": PROMPT, "max_tokens": len(ids), "logprobs": 0,
                                             "specd_test_forced_output": ids})
    assert st == 200, out
    toks = out["choices"][0]["logprobs"]["tokens"]
    raw = "🍕".encode()
    assert any(t.startswith("bytes:\\x") for t in toks), toks
    joined = b"".join(bytes(int(h, 16) for h in t[len("bytes:\\x"):].split("\\x")) if t.startswith("bytes:")
                      else t.encode() for t in toks)
    assert joined == raw and out["choices"][0]["text"] == "🍕"
    c = plain.client()
    r = c.chat.completions.create(model="smol", messages=CHAT, max_tokens=len(ids), logprobs=True, top_logprobs=2,
                                  extra_body={"specd_test_forced_output": ids})
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(x.bytes) for x in content) == raw
    assert all(x.token.startswith("bytes:\\x") == (bytes(x.bytes).decode("utf-8", "replace") != x.token)
               for x in content if x.token.startswith("bytes:"))


# ---------------------------------------------------------------- partial UTF-8 at the edges
def test_partial_utf8_edges(plain):
    """vLLM's DecodeStream semantics (docs/server.md): a prompt (ids) ending inside a character -> the token that
    completes it emits the whole character; max_tokens inside a character -> nothing for it; never U+FFFD."""
    emoji = token_ids(plain, "🍕")
    base = token_ids(plain, "Pizza:")
    assert len(emoji) >= 2
    for stream in (False, True):
        for cut in range(1, len(emoji)):
            body = {"prompt": base + emoji[:cut], "max_tokens": len(emoji) - cut, "stream": stream,
                    "specd_test_forced_output": emoji[cut:] + token_ids(plain, " yum")}
            text, finish = "", None
            if stream:
                kw = {k: v for k, v in body.items() if k != "specd_test_forced_output"}
                for ch in plain.client().completions.create(
                        model="smol", extra_body={"specd_test_forced_output": body["specd_test_forced_output"]}, **kw):
                    text += ch.choices[0].text
                    finish = ch.choices[0].finish_reason or finish
            else:
                st, out = plain.post("/v1/completions", body)
                assert st == 200, out
                text, finish = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
            assert text == "🍕" and finish == "length", (cut, stream, text)
            # the end edge: stop one token short of the character
            body.update(prompt=base, max_tokens=cut, specd_test_forced_output=emoji)
            st, out = plain.post("/v1/completions", dict(body, stream=False))
            assert out["choices"][0]["text"] == "" and out["choices"][0]["finish_reason"] == "length", out
            assert out["usage"]["completion_tokens"] == cut


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
