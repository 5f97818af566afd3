#!/usr/bin/env python3
"""test_tools_server.py (kimi_c_tools_server): tool calls and reasoning content through the real `specd serve`
on the Kimi miniature (issue 21), driven by the openai Python client.

Two model directories, the same weights and tiktoken ranks (the kimi_c_mini fixture's OUT/k25):
  K2   OUT/k25 with Kimi-K2-Instruct's tokenizer_config.json chat template (../shared/data/kimi-k2), no thinking;
  K25  OUT/k25 as built (specd's K2.5-style template, tools/kimi/chat_template.jinja: <think> on by default).

References, independent of specd:
  - prompts: the jinja2 rendering of the template (K2: the template inside tokenizer_config.k2-instruct.json,
    in the environment transformers' apply_chat_template builds: trim_blocks, lstrip_blocks, tojson =
    json.dumps(ensure_ascii=False)); the server's chat ids must equal its plain encoding of that text with
    specials parsed (id for id) and decode back to it (byte for byte);
  - outputs: the model is not trained to call tools, so the output is forced token by token with the
    test-only field specd_test_forced_output (honoured because the server runs with
    SPECD_TEST_FORCED_OUTPUT=1); the expected message comes from ref_parse below, a re-statement of vLLM's
    kimi_k2 tool parser and DeepSeek-R1 reasoning parser semantics in Python regexes.
Streamed answers are assembled the way the openai client's users do (content / reasoning_content
concatenated, tool_calls merged by index) and must equal the non-streamed message.

Needs $SPECD_BUILD_DIR/server/specd, the miniature (KIMI_C_MINI_DIR) with its tokenizer and jinja2; exits 77
without them.
"""
import json
import os
import re
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "pyutil"))
import specd_server as sp  # noqa: E402

MINI = os.environ.get("KIMI_C_MINI_DIR", "")
K25 = os.path.abspath(os.path.join(MINI, "k25"))
KIMI_DATA = os.environ.get("SPECD_KIMI_DATA", os.path.join(os.path.dirname(ROOT), "shared", "data", "kimi-k2"))
K2_CONFIG = os.path.join(KIMI_DATA, "tokenizer_config.k2-instruct.json")
K25_TEMPLATE = os.path.join(ROOT, "tools", "kimi", "chat_template.jinja")

if __name__ == "__main__":
    missing = [p for p in (sp.SPECD, os.path.join(K25, "tiktoken.model"), K2_CONFIG) if not os.path.exists(p)]
    try:
        import jinja2  # noqa: F401
        import openai  # noqa: F401
    except ImportError as e:
        missing.append(str(e))
    if missing:
        print(f"skip: need {missing}")
        sys.exit(77)

import jinja2  # noqa: E402
import pytest  # noqa: E402

IM_END = 163586
COMMON = ["--served-model-name", "kimi-mini", "--max-model-len", "512", "--kv-cache-memory", "32M", "--threads", "1"]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city, in °C (ünïcode \"quoted\")",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                                        "precision": {"type": "number", "default": 0.1,
                                                                      "examples": [1e-05, 2.5e20, 100.0, 123456.789,
                                                                                   -0.0, 1e16, 1e15, 0.30000000000000004,
                                                                                   -7, 5e-324, 1.7976931348623157e308,
                                                                                   True, None, "\u0001\t/<>&"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}}},
]


# ---------------------------------------------------------------- references
def hf_env():
    """The jinja2 environment transformers' apply_chat_template renders in (tojson without sorting / escaping)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.filters["tojson"] = tojson
    return env


def render(kind, messages, tools=None, add_generation_prompt=True, thinking=True):
    env = hf_env()
    if kind == "k2":
        tpl = json.load(open(K2_CONFIG, encoding="utf-8"))["chat_template"]
        return env.from_string(tpl).render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
    tpl = open(K25_TEMPLATE, encoding="utf-8").read()
    return env.from_string(tpl).render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                       thinking=thinking, default_system="")


CALL_RE = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>.+?:\d+)\s*<\|tool_call_argument_begin\|>\s*(?P<args>.*?)\s*"
                     r"<\|tool_call_end\|>", re.S)


def ref_parse(text, reasoning, tools, finish):
    """(reasoning_content, content, tool_calls, finish_reason) for generated TEXT (specials as text)."""
    rc = None
    if reasoning:
        body = text[len("<think>"):] if text.startswith("<think>") else text
        cut = [i for i in (body.find("</think>"), body.find("<|tool_calls_section_begin|>") if tools else -1) if i >= 0]
        if not cut:
            return (body or None), None, [], finish
        i = min(cut)
        rc = body[:i] or None
        text = body[i + len("</think>"):] if body.startswith("</think>", i) else body[i:]
    calls, content = [], text
    sec = text.find("<|tool_calls_section_begin|>") if tools else -1
    if sec >= 0:
        content = text[:sec]
        rest = text[sec + len("<|tool_calls_section_begin|>"):]
        pos = 0
        while True:
            ws = len(rest[pos:]) - len(rest[pos:].lstrip())
            at = pos + ws
            if rest.startswith("<|tool_calls_section_end|>", at):
                content += rest[at + len("<|tool_calls_section_end|>"):]  # text after a closed section
                break
            if at == len(rest):
                break
            m = CALL_RE.match(rest, at)
            ok = False
            if m and re.fullmatch(r"(functions\.)?[^\s:]+:\d+", m["id"].strip()) and not re.match(r"\S*\s", m["id"]):
                try:
                    ok = isinstance(json.loads(m["args"]), dict)
                except ValueError:
                    ok = False
            if not ok:  # malformed / truncated: raw text from the call (or the section) on
                content += rest[at:] if calls else text[sec:]
                break
            name = m["id"].rsplit(":", 1)[0]
            name = name[len("functions."):] if name.startswith("functions.") else name
            calls.append({"id": m["id"], "name": name, "arguments": m["args"]})
            pos = m.end()
    if content == "" and (calls or reasoning):
        content = None
    fr = "tool_calls" if calls and finish == "stop" else finish
    return rc, content, calls, fr


# ---------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def dirs():
    tmp = tempfile.mkdtemp(prefix="specd_k2_")
    for f in os.listdir(K25):
        if f not in ("tokenizer_config.json", "chat_template.jinja"):
            os.symlink(os.path.join(K25, f), os.path.join(tmp, f))
    cfg = json.load(open(os.path.join(K25, "tokenizer_config.json"), encoding="utf-8"))
    cfg["chat_template"] = json.load(open(K2_CONFIG, encoding="utf-8"))["chat_template"]
    json.dump(cfg, open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8"))
    yield {"k2": tmp, "k25": K25}
    shutil.rmtree(tmp)


@pytest.fixture(scope="module")
def servers(dirs):
    out = {}
    try:
        for k, d in dirs.items():
            out[k] = sp.Server(COMMON, model=d, env={"SPECD_TEST_FORCED_OUTPUT": "1"}, log_prefix=f"specd_tools_{k}_")
        yield out
    finally:
        for s in out.values():
            assert s.stop() == 0, s.read_log()


def ids_of(srv, text):
    st, out = srv.post("/tokenize", {"prompt": text})
    assert st == 200, out
    return out["tokens"]


def text_of(srv, ids):
    st, out = srv.post("/detokenize", {"tokens": ids})
    assert st == 200, out
    return out["prompt"]


# ---------------------------------------------------------------- prompts
CONVS = [
    ("tools only", [{"role": "user", "content": "Weather in Paris?"}], TOOLS),
    ("one call, no content", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "{\"temp\": 21.5, \"sky\": \"☀\"}"},
    ], TOOLS),
    ("two calls with content, escapes", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Compare Zürich and 東京, then search."},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": "{\"city\": \"Zürich\", \"days\": 2}"}},
            {"id": "b", "type": "function", "function": {"name": "search",
                                                         "arguments": "{\"q\": \"line1\\nline2 \\\"q\\\" \\\\ tab\\t\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "cold"},
        {"role": "tool", "tool_call_id": "functions.search:1", "content": "found nothing"},
        {"role": "assistant", "content": "Zürich is cold."},
        {"role": "user", "content": "Thanks"},
    ], TOOLS),
    ("no tools, tool history", [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.search:0", "content": "[]"},
    ], None),
]


@pytest.mark.parametrize("kind", ["k2", "k25"])
@pytest.mark.parametrize("name,msgs,tools", CONVS, ids=[c[0] for c in CONVS])
def test_prompt_equals_jinja(servers, kind, name, msgs, tools):
    srv = servers[kind]
    for thinking in ([True, False] if kind == "k25" else [True]):
        want = render(kind, msgs, tools, thinking=thinking)
        body = {"messages": msgs, "chat_template_kwargs": {"thinking": thinking}}
        if tools:
            body["tools"] = tools
        st, out = srv.post("/tokenize", body)
        assert st == 200, out
        assert text_of(srv, out["tokens"]) == want, (name, kind, thinking)           # byte for byte
        assert out["tokens"] == ids_of(srv, want), (name, kind, thinking)             # id for id
        # the same prompt reaches the engine: usage counts it
        st, resp = srv.post("/v1/chat/completions", dict(body, max_tokens=1, temperature=0))
        assert st == 200, resp
        assert resp["usage"]["prompt_tokens"] == len(out["tokens"])


def test_k2_tool_result_literal_backslash_n(servers):
    """K2's template prints "## Return of ID\\n" with a backslash and an n (a Jinja text literal), not a newline."""
    msgs = CONVS[1][1]
    st, out = servers["k2"].post("/tokenize", {"messages": msgs, "tools": TOOLS})
    text = text_of(servers["k2"], out["tokens"])
    assert "## Return of functions.get_weather:0\\n{" in text and "## Return of functions.get_weather:0\n" not in text


def test_special_token_ids(servers):
    """The markers are single special tokens with the ids of the K2-Instruct config (<think> / </think>: REFERENCE)."""
    cfg = {int(k): v["content"] for k, v in json.load(open(K2_CONFIG, encoding="utf-8"))["added_tokens_decoder"].items()}
    want = {"<|tool_calls_section_begin|>": 163595, "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
            "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_end|>": IM_END,
            "<|im_system|>": 163594, "<|im_middle|>": 163601, "<think>": 163606, "</think>": 163607}
    for marker, i in want.items():
        for srv in servers.values():
            assert ids_of(srv, marker) == [i], marker
        if i < 163606:
            assert cfg[i] == marker


# ---------------------------------------------------------------- outputs
def forced_chat(srv, forced_text, *, tools=TOOLS, stream=False, thinking=None, max_tokens=64, extra=None):
    forced = ids_of(srv, forced_text) + [IM_END]
    client = srv.client()
    kw = dict(model="kimi-mini", messages=[{"role": "user", "content": "go"}], max_tokens=max_tokens, temperature=0,
              extra_body={"specd_test_forced_output": forced, **({"chat_template_kwargs": {"thinking": thinking}}
                                                                  if thinking is not None else {})})
    if tools:
        kw["tools"] = tools
    kw.update(extra or {})
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        assert r.system_fingerprint and r.system_fingerprint.startswith("fp_specd")
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in (m.tool_calls or [])]
        assert all(c.type == "function" for c in (m.tool_calls or []))
        return getattr(m, "reasoning_content", None), m.content, calls, r.choices[0].finish_reason
    reasoning, content, calls, finish, n_chunks = "", "", {}, None, 0
    for ch in client.chat.completions.create(stream=True, **kw):
        n_chunks += 1
        assert ch.system_fingerprint and ch.system_fingerprint.startswith("fp_specd")
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += tc.id or ""
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    calls = [calls[i] for i in sorted(calls)]
    return reasoning or None, content or None, calls, finish


def generated_text(forced_text, max_tokens, srv):
    """What the engine emits (specials as text), cut at max_tokens tokens."""
    ids = ids_of(srv, forced_text)
    if len(ids) >= max_tokens:
        return text_of(srv, ids[:max_tokens]), "length"
    return forced_text, "stop"


CALL1 = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         "{\"city\": \"Paris\", \"days\": 3}<|tool_call_end|><|tool_calls_section_end|>")
CALL2 = ("Let me check both. <|tool_calls_section_begin|>\n<|tool_call_begin|> functions.get_weather:0 "
         "<|tool_call_argument_begin|> {\"city\": \"東京\"} <|tool_call_end|>\n<|tool_call_begin|>functions.search:1"
         "<|tool_call_argument_begin|>{\"q\": \"a \\\"b\\\"\", \"tags\": [\"x\"]}<|tool_call_end|>"
         "<|tool_calls_section_end|>")
OUTPUTS = [
    ("one call", CALL1, 64),
    ("content and two calls", CALL2, 64),
    ("plain text", "Just an answer, no tools.", 64),
    ("arguments not JSON", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                           "<|tool_call_argument_begin|>{city: Paris<|tool_call_end|><|tool_calls_section_end|>", 64),
    ("bad id", "<|tool_calls_section_begin|><|tool_call_begin|>get weather<|tool_call_argument_begin|>{}"
               "<|tool_call_end|><|tool_calls_section_end|>", 64),
    ("second call malformed", CALL1.replace("<|tool_calls_section_end|>", "") +
     "<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>[1, 2]<|tool_call_end|>", 64),
    ("text inside the section", "<|tool_calls_section_begin|>oops<|tool_call_begin|>functions.search:0"
                                "<|tool_call_argument_begin|>{}<|tool_call_end|>", 64),
    ("truncated in the arguments", CALL1, 12),
    ("truncated after one call of two", CALL2, 30),
]


@pytest.mark.parametrize("name,forced,max_tokens", OUTPUTS, ids=[o[0] for o in OUTPUTS])
@pytest.mark.parametrize("kind", ["k2", "k25"])
def test_tool_call_output(servers, kind, name, forced, max_tokens):
    srv = servers[kind]
    thinking = False if kind == "k25" else None   # reasoning is tested on its own below
    text, finish = generated_text(forced, max_tokens, srv)
    want = ref_parse(text, reasoning=False, tools=True, finish=finish)
    got = forced_chat(srv, forced, thinking=thinking, max_tokens=max_tokens)
    assert got == (None,) + want[1:], (name, got, want)
    streamed = forced_chat(srv, forced, thinking=thinking, max_tokens=max_tokens, stream=True)
    assert streamed == got, (name, streamed, got)


def test_expected_tool_calls_spelled_out(servers):
    """The reference parser itself is checked on the two main cases, by hand."""
    r, c, calls, fr = forced_chat(servers["k2"], CALL2)
    assert (r, c, fr) == (None, "Let me check both. ", "tool_calls")
    assert calls == [{"id": "functions.get_weather:0", "name": "get_weather", "arguments": "{\"city\": \"東京\"}"},
                     {"id": "functions.search:1", "name": "search",
                      "arguments": "{\"q\": \"a \\\"b\\\"\", \"tags\": [\"x\"]}"}]
    r, c, calls, fr = forced_chat(servers["k2"], CALL1, max_tokens=12)
    assert calls == [] and fr == "length" and c.startswith("<|tool_calls_section_begin|>")


def test_tool_choice_none_and_named(servers):
    srv = servers["k2"]
    # none: tools are still declared in the prompt, the output is content
    r, c, calls, fr = forced_chat(srv, CALL1, extra={"tool_choice": "none"})
    assert calls == [] and fr == "stop" and "Paris" in c
    # a named function: the prompt opens the call; the model writes only the arguments
    msgs = [{"role": "user", "content": "go"}]
    st, tk = srv.post("/tokenize", {"messages": msgs, "tools": TOOLS})
    opening = "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
    for stream in (False, True):
        forced = "{\"q\": \"kimi\"}<|tool_call_end|><|tool_calls_section_end|>"
        got = forced_chat(srv, forced, stream=stream,
                          extra={"tool_choice": {"type": "function", "function": {"name": "search"}}})
        assert got == (None, None, [{"id": "functions.search:0", "name": "search", "arguments": "{\"q\": \"kimi\"}"}],
                       "tool_calls"), got
    r = srv.client().chat.completions.create(
        model="kimi-mini", messages=msgs, tools=TOOLS, max_tokens=1, temperature=0,
        tool_choice={"type": "function", "function": {"name": "search"}})
    assert r.usage.prompt_tokens == len(tk["tokens"]) + len(ids_of(srv, opening))
    # required: the opening stops before the name
    got = forced_chat(srv, "get_weather:0<|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|>",
                      extra={"tool_choice": "required"})
    assert got[2] == [{"id": "functions.get_weather:0", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}]
    # refusals
    for body, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
                        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
                        ({"parallel_tool_calls": False, "tools": TOOLS}, "parallel_tool_calls"),
                        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
                        ({"tools": {"a": 1}}, "tools")):
        st, out = srv.post("/v1/chat/completions", dict(body, messages=msgs, max_tokens=1))
        assert st == 400 and out["error"]["param"] == param, (body, out)


def test_round_trip(servers):
    """A returned tool call sent back with its result renders as the template renders it."""
    srv = servers["k2"]
    _, c, calls, _ = forced_chat(srv, CALL2)
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": c, "tool_calls": [
                {"id": x["id"], "type": "function", "function": {"name": x["name"], "arguments": x["arguments"]}}
                for x in calls]}] + [{"role": "tool", "tool_call_id": x["id"], "content": "ok"} for x in calls]
    st, out = srv.post("/tokenize", {"messages": msgs, "tools": TOOLS})
    assert st == 200 and text_of(srv, out["tokens"]) == render("k2", msgs, TOOLS)


# ---------------------------------------------------------------- reasoning
REASONING = [
    ("think then answer", "Let me think: 2+2=4.</think>The answer is 4.", 64, None),
    ("leading <think>", "<think>hmm</think>ok", 64, None),
    ("never closed (max_tokens)", "A long chain of thought that never ends because", 6, None),
    ("stop string inside reasoning", "first second STOP third</think>answer", 64, "STOP"),
    ("reasoning then a tool call", "I need the weather.</think>" + CALL1, 64, None),
    ("tool call ends reasoning", "I need the weather." + CALL1, 64, None),
]


@pytest.mark.parametrize("name,forced,max_tokens,stop", REASONING, ids=[r[0] for r in REASONING])
def test_reasoning(servers, name, forced, max_tokens, stop):
    srv = servers["k25"]
    text, finish = generated_text(forced, max_tokens, srv)
    if stop:
        text, finish = text[:text.index(stop)], "stop"
    want = ref_parse(text, reasoning=True, tools=True, finish=finish)
    extra = {"stop": [stop]} if stop else {}
    for stream in (False, True):
        got = forced_chat(srv, forced, thinking=True, max_tokens=max_tokens, stream=stream, extra=extra)
        assert got == want, (name, stream, got, want)


def test_reasoning_off(servers):
    # thinking off on K2.5, and K2 (no thinking in its template): no reasoning_content, the text is content
    for kind, thinking in (("k25", False), ("k2", None)):
        srv = servers[kind]
        for stream in (False, True):
            r, c, calls, fr = forced_chat(srv, "plan</think>answer", tools=None, thinking=thinking, stream=stream)
            assert r is None and calls == [] and fr == "stop" and c == "plananswer", (kind, r, c)
    # the raw JSON has no reasoning_content key at all when reasoning is off
    st, out = servers["k25"].post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "go"}], "max_tokens": 3, "chat_template_kwargs": {"thinking": False},
        "specd_test_forced_output": ids_of(servers["k25"], "ab</think>c")})
    assert st == 200 and "reasoning_content" not in out["choices"][0]["message"]


def test_forced_output_needs_the_env(dirs):
    s = sp.Server(COMMON, model=dirs["k25"], env={"SPECD_TEST_FORCED_OUTPUT": None}, log_prefix="specd_tools_noenv_")
    try:
        st, out = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                  "specd_test_forced_output": [1, 2]})
        assert st == 400 and out["error"]["param"] == "specd_test_forced_output", out
    finally:
        assert s.stop() == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-x", "-p", "no:cacheprovider"]))
