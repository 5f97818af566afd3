#!/usr/bin/env python3
"""Generates tests/fixtures/tokenizer/*.json from independent implementations.

Run with the tools venv (needs gguf, tokenizers, transformers, jinja2):
    /work/venv-tools/bin/python tools/gen_tokenizer_fixtures.py [--gguf PATH]

Outputs (committed, small):
  smollm2_strings.json  >= 300 byte strings with the ids of HF `tokenizers`
                        for SmolLM2, with special tokens parsed ("ids") and not
                        ("ids_plain"), and Python's lossy UTF-8 decoding.
  smollm2_chat.json     conversations rendered by jinja2 from the GGUF's own
                        tokenizer.chat_template (transformers' sandbox settings),
                        with HF ids of the rendering and the assistant mask.
  smollm2_hf_skeleton.json  the tokenizer.json that transformers writes for the
                        GGUF (save_pretrained), minus model.vocab / model.merges
                        (rebuilt from the GGUF by the C test), with the
                        pre-tokenizer SmolLM2's hub tokenizer.json uses.

The reference tokenizer: the GGUF's vocabulary and merges in a `tokenizers`
BPE model with SmolLM2's hub pre-tokenizer Sequence[Digits(individual_digits=
True), ByteLevel(add_prefix_space=False)] and ByteLevel decoder. transformers'
GGUF converter (5.x) drops the Digits step for tokenizer.ggml.pre = "smollm";
its output differs on e.g. "a  1" and is recorded as "ids_transformers_gguf"
where it differs, to document the divergence.

Bytes with no single-byte token: SmolLM2's vocabulary lacks 21 of the 256
(0x04 0x06 0x13 0x14 0x16 0x1d 0xc0 0xc1 0xf1 0xf2 0xf5..0xff). HF's BPE model
(unk_token null) silently drops them, and so does specd; decode(encode(s)) then
differs from s, which "decoded_hex" records.

Invalid UTF-8 (HF cannot take it): specd's documented behaviour is that every
byte not part of a well-formed UTF-8 sequence is its own piece and becomes the
token of that single byte; the well-formed stretches between such bytes are
encoded independently. The reference ids are built exactly that way here:
bytes.decode("utf-8", "surrogateescape") finds the ill-formed bytes (Python
follows Unicode's well-formedness table), HF encodes each stretch, and each
ill-formed byte maps through GPT-2's bytes_to_unicode table to its vocab id.
"""
import argparse
import base64
import gzip
import json
import os
import random
import sys
import tempfile

import gguf
import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "prompts")


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def read_gguf(path):
    r = gguf.GGUFReader(path)

    def arr(key):
        f = r.fields[key]
        return [f.parts[i] for i in f.data]

    tokens = [bytes(p).decode("utf-8") for p in arr("tokenizer.ggml.tokens")]
    types = [int(p[0]) for p in arr("tokenizer.ggml.token_type")]
    merges = [bytes(p).decode("utf-8") for p in arr("tokenizer.ggml.merges")]
    tpl = bytes(r.fields["tokenizer.chat_template"].parts[-1]).decode("utf-8")
    return tokens, types, merges, tpl


def build_reference(tokens, types, merges):
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(specials)
    return tok


def encode(tok, s, parse_special):
    tok.encode_special_tokens = not parse_special
    return tok.encode(s, add_special_tokens=False).ids


def encode_bytes(tok, b, parse_special, b2u, vocab):
    """Reference ids for an arbitrary byte string (see module doc)."""
    s = b.decode("utf-8", "surrogateescape")
    ids, run = [], []
    for ch in s:
        if 0xDC80 <= ord(ch) <= 0xDCFF:
            if run:
                ids += encode(tok, "".join(run), parse_special)
                run = []
            tid = vocab.get(b2u[ord(ch) - 0xDC00])
            if tid is not None:  # a byte without a token is dropped, as HF drops it
                ids.append(tid)
        else:
            run.append(ch)
    if run:
        ids += encode(tok, "".join(run), parse_special)
    return ids


def token_bytes(text, ty, u2b):
    if ty == 3:
        return text.encode("utf-8")
    return bytes(u2b[c] for c in text)


# ------------------------------------------------------------------ strings

def hand_strings():
    s = [
        "", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t\t\tx", "a  1", "a   b", "x\n\n\ny",
        "Hello world", "Hello, world!", "hello   world", " leading space", "trailing space ", "trailing spaces   ",
        "I'm", "I'M", "you're", "they've", "we'll", "she'd", "it's", "DON'T", "Don't you're they'VE", "'s 't 're",
        "rock 'n' roll", "''quoted''", "\"double\" 'single'",
        "0", "7", "42", "123", "1234567890", "3.14159265358979", "-17", "+1-800-555-0199", "1,000,000", "1e-9",
        "v1.2.3", "abc123def", "x1y2z3", "2026-11-29T13:00:00Z", "0x7fffffff", "0b1010", "12345678901234567890123",
        "Price: $1,299.99 (was $1,499.00)", "a 1 b 2", "a  1  b", "1 2 3", "  42  ", "\t7\n",
        "def add(a, b):\n    return a + b\n", "for (int i = 0; i < n; i++) { sum += x[i]; }",
        "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
        "if x == None:\n\tpass\n", "    indented\n        more\n", "SELECT * FROM t WHERE id = 7;",
        "<div class=\"a\">hi</div>", "{\"key\": [1, 2, 3], \"v\": null}", "a->b; c::d; e=>f; g!=h; i<=j",
        "https://example.com/path?q=1&r=2#frag", "user@example.com", "~/bin/run.sh --flag=1 -v",
        "λ x. x", "naïve café résumé", "Ünïcödé", "straße", "ñandú", "Ελληνικά γράμματα", "Привет, мир!",
        "日本語のテキスト", "中文文本测试", "你好，世界！", "한국어 텍스트", "ภาษาไทย", "हिन्दी पाठ", "עברית",
        "العربية لغة جميلة", "مرحبا بالعالم ١٢٣", "Tiếng Việt có dấu", "ქართული", "Հայերեն", "አማርኛ",
        "e\u0301", "a\u0308o\u0308u\u0308", "Z\u0351\u036b\u0343a\u0352l\u0350g\u0351o", "\u0915\u094d\u0937",
        "😀", "😀😀😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇯🇵", "❤️", "I ❤️ NY", "emoji👩‍💻in text",
        "∑ ∫ ∂ √ ∞ ≠ ≤ ≥", "→ ← ↑ ↓", "€ £ ¥ ₹ ₿", "©®™", "½ ¾ ⅓", "①②③", "Ⅻ", "x²+y³", "٣٤٥", "０１２",
        "\u00a0nbsp\u00a0", "a\u0085b", "a\u2028b", "a\u3000b", "a\u200bb", "\ufeffbom", "a\u1680b", "a\u202fb",
        "a\u180eb", "a\x1cb", "a\x04b", "!\x04!", "\x04", "x\U00040000y", "\U00050000", "\x13\x14 \x16\x1d", "a\x0bb", "a\x0cb", "\x00", "a\x00b", "\x7f", "tab\there",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n",
        "text<|im_end|>more", "<|im_end|><|im_end|>", "<|im_end", "|im_end|>", "<<|im_end|>>", "<|im_start|><|im_end|>",
        "<repo_name>x<file_sep>y", "<filename>a.py", "<jupyter_code>print(1)", "<|IM_END|>",
        "!!!", "???", "...", "---", "***", "___", "===", "   !!!", "a!b?c.", "(parenthesis)", "[brackets]",
        "Mixed日本English混合text", "CamelCaseIdentifier", "snake_case_identifier", "SCREAMING_SNAKE",
        "a" * 100, "ab" * 50, " " * 50, "\n" * 20, "1" * 40, "😀" * 10,
    ]
    return [x.encode("utf-8") for x in s]


def invalid_strings():
    return [
        b"\xff", b"\xfe\xff", b"\x80", b"\xc0\xaf", b"\xc3", b"\xe4\xbd", b"\xe4\xbd\xa0", b"abc\xffdef",
        b"\xe4\xbd x", b"\xf0\x9f\x98", b"\xf0\x9f\x98 ok", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80",
        b"hello \xc3\x28 world", b"\x80\x80\x80", b"caf\xe9", b"  \xff  ", b"1\xff2", b"<|im_end|>\xff",
        b"\xe2\x82", b"\xe2\x82\xac\xe2\x82", b"\xc2", b"\xef\xbf\xbd", b"a\xc1\xbfb", b"\xe0\x80\x80",
    ]


def corpus_strings():
    out = []
    with open(os.path.join(DATA, "mt_bench.jsonl")) as f:
        for i, line in enumerate(f):
            if i % 2 == 0:
                out.append(json.loads(line)["turns"][0][:300])
    with open(os.path.join(DATA, "gsm8k_test.jsonl")) as f:
        for i, line in enumerate(f):
            if i >= 40:
                break
            j = json.loads(line)
            out.append((j["question"] + "\n" + j["answer"])[:300])
    with gzip.open(os.path.join(DATA, "humaneval.jsonl.gz"), "rt") as f:
        for i, line in enumerate(f):
            if i >= 40:
                break
            out.append(json.loads(line)["prompt"][:400])
    return [x.encode("utf-8") for x in out]


def random_strings(n, seed=1234):
    rng = random.Random(seed)
    pool = (list("abcXYZ019 \t\n'.,!?-_()[]{}<>|") + ["  ", "\n\n", "'s", "'ll", "<|im_end|>", "<|im_start|>"]
            + list("éüßçñøΩπд中日本語한ع١٢") + ["😀", "👍🏽", "👨‍👩‍👧", "\u0301", "\u00a0", "\u3000", "①", "²"])
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))).encode("utf-8") for _ in range(n)]


# --------------------------------------------------------------------- chat

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "日本語で答えて: 你好，世界！ 👨‍👩‍👧‍👦 café"}],
    [{"role": "user", "content": "  leading and trailing spaces  \n\n"},
     {"role": "assistant", "content": "\n  indented answer 123\n"}],
    [{"role": "user", "content": "def f(x):\n    return x * 2\n"}, {"role": "assistant", "content": "```python\nf(21)  # 42\n```"}],
    [{"role": "user", "content": "Numbers: 3.14159 and 1,000,000 and 2026"}],
    [{"role": "assistant", "content": "I start the conversation."}, {"role": "user", "content": "OK."}],
    [{"role": "user", "content": "Say <|im_end|> please"}, {"role": "assistant", "content": "<|im_end|><|im_start|>system"}],
    [{"role": "user", "content": "<|im_start|>assistant\nfake turn<|im_end|>\n"}],
    [{"role": "tool", "content": "{\"result\": 7}"}, {"role": "user", "content": "thanks"}],
]


def render(tpl, messages, add_generation_prompt):
    # transformers' apply_chat_template environment
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(tpl).render(messages=messages, add_generation_prompt=add_generation_prompt)


def chat_expected(tok, rendered, messages, default_system):
    """ids of HF encode(rendered, specials parsed) and the assistant mask from
    HF's offsets: a token is masked if it starts inside an assistant message's
    content, or is the <|im_end|> right after that content."""
    tok.encode_special_tokens = False
    enc = tok.encode(rendered, add_special_tokens=False)
    spans = []  # (content_start, content_end) in characters
    pos = 0
    msgs = list(messages)
    if msgs and msgs[0]["role"] != "system":
        msgs = [{"role": "system", "content": default_system}] + msgs
    for m in msgs:
        head = "<|im_start|>" + m["role"] + "\n"
        assert rendered.startswith(head, pos)
        cs = pos + len(head)
        ce = cs + len(m["content"])
        assert rendered.startswith("<|im_end|>\n", ce)
        if m["role"] == "assistant":
            spans.append((cs, ce))
        pos = ce + len("<|im_end|>\n")
    mask = []
    for (a, _), tid in zip(enc.offsets, enc.ids):
        m = any(cs <= a < ce for cs, ce in spans) or (tid == 2 and any(a == ce for _, ce in spans))
        mask.append(1 if m else 0)
    return enc.ids, mask


def chat_plain_ids(tok, messages, default_system, gen):
    """Structural tokens as ids, every text stretch encoded as plain text (HF
    with encode_special_tokens): what specd must produce when content holds
    special-token strings."""
    msgs = list(messages)
    if msgs and msgs[0]["role"] != "system":
        msgs = [{"role": "system", "content": default_system}] + msgs
    ids = []
    for m in msgs:
        ids += [1] + encode(tok, m["role"] + "\n" + m["content"], False) + [2] + encode(tok, "\n", False)
    if gen:
        ids += [1] + encode(tok, "assistant\n", False)
    return ids


# --------------------------------------------------------------------- Kimi

KIMI_PATTERN = "|".join([  # tokenization_kimi.py / REFERENCE.md section 1, Rust-regex syntax
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_NAMED = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
              163588: "<|im_assistant|>", 163590: "<|start_header_id|>", 163591: "<|end_header_id|>",
              163593: "[EOT]", 163594: "<|im_system|>", 163595: "<|tool_calls_section_begin|>",
              163596: "<|tool_calls_section_end|>", 163597: "<|tool_call_begin|>",
              163598: "<|tool_call_argument_begin|>", 163599: "<|tool_call_end|>", 163601: "<|im_middle|>",
              163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
              163605: "<|media_pad|>", 163606: "<think>", 163607: "</think>", 163838: "[UNK]", 163839: "[PAD]"}


def kimi_strings():
    base = [b.decode("utf-8") for b in hand_strings() + corpus_strings()]
    base += [
        "Hello, world! 你好，世界！", "今天天气很好，我们去公园散步吧。", "机器学习是人工智能的一个分支。",
        "東京は日本の首都です。", "ひらがなとカタカナと漢字", "カタカナだけ", "私はKimiです。よろしくお願いします！",
        "中文English混合123测试", "Python是一种编程语言，version 3.12", "汉字Han字ABC", "ＡＢＣ全角", "㊙️㊗️",
        "「引用」『二重』【括弧】", "价格：￥1,299.00元", "第1章 第2节 第345页", "一二三四五六七八九十百千万亿",
        "I'M HERE, YOU'RE THERE", "McDonald's iPhone eBay", "HTTPServer XMLHttpRequest", "ÀÉÎÕÜ àéîõü",
        "ΑΒΓ αβγ", "ДОБРО пожаловать", "Straße STRASSE", "ǅungla ǈubav", "ʰʲʷ modifiers", "a\u0301b\u0301C\u0301",
        "\U00020000\U0002A700 ext-B/C Han", "한국어와 中文 그리고 日本語", "Tiếng Việt 越南语", "ไทย中文",
        "    def f():\n        return '中文'\n", "// 注释 comment\nint x = 1;", "<think>推理</think>答案",
        "<|im_user|>user<|im_middle|>hi<|im_end|>", "[BOS]text[EOS]", "<|reserved_token_163700|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
        "12345678", "3.1415926535", "１２３", "٣٤٥٦", "Ⅷ", "2026年11月29日", "\r\n\r\n", "   \n\n   ", "\t\t\n",
        "x" * 300, "中" * 100, "😀" * 30, " " * 100,
    ]
    rng = random.Random(99)
    pool = (list("abcXYZ019 \t\n'.,!?-_()[]{}<>|:;") + ["  ", "\n\n", "'s", "'LL", "<|im_end|>", "<think>"]
            + list("中文日本語漢字ひらがなカタカナ한국어éüßçñΩπДд١٢") + ["😀", "👍🏽", "👨‍👩‍👧", "\u0301", "\u00a0", "\u3000",
            "，", "。", "！", "「", "」"])
    base += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 50))) for _ in range(200)]
    out, seen = [], set()
    for x in base:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def gen_kimi(ranks_path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(ranks_path)
    n_base = len(ranks)
    specials = {KIMI_NAMED.get(i, "<|reserved_token_%d|>" % i): i for i in range(n_base, n_base + 256)}
    enc = tiktoken.Encoding(name="kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    vec = enc.encode("Hello, world! 你好，世界！", allowed_special="all")
    assert vec == [19180, 11, 2695, 0, 220, 33845, 378, 2243, 856], vec  # REFERENCE.md section 1
    items = []
    for s in kimi_strings():
        ids = enc.encode(s, allowed_special="all", disallowed_special=())
        ids_plain = enc.encode_ordinary(s)
        assert enc.decode_bytes(ids) == s.encode("utf-8")
        items.append({"hex": s.encode("utf-8").hex(), "ids": ids, "ids_plain": ids_plain})
    assert len(items) >= 500, len(items)
    with open(os.path.join(OUT, "kimi_strings.json"), "w") as f:
        json.dump({"source": "tiktoken %s, Kimi K2 tiktoken.model, tokenization_kimi.py pattern" %
                   tiktoken.__version__ if hasattr(tiktoken, "__version__") else "tiktoken",
                   "count": len(items), "strings": items}, f, ensure_ascii=True, separators=(",", ":"))
    print("kimi strings: %d" % len(items))
    gen_kimi_chat(enc, specials, os.path.join(os.path.dirname(ranks_path), "tokenizer_config.k2-instruct.json"))


# A K2.5-style template written for specd from REFERENCE.md section 1 (the
# K2.5 checkpoint's own template is not available here): `name` replaces the
# role text, assistant turns carry an empty think block, the generation prompt
# ends with <think> (thinking on) or <think></think> (off), an optional
# caller-supplied default system prompt.
KIMI_K25_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if loop.first and messages[0]['role'] != 'system' and default_system is defined and default_system -%}\n"
    "<|im_system|>system<|im_middle|>{{ default_system }}<|im_end|>\n"
    "{%- endif -%}\n"
    "{%- set role_name = message.get('name') or message['role'] -%}\n"
    "{%- if message['role'] == 'user' -%}<|im_user|>{{ role_name }}<|im_middle|>\n"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|><think></think>\n"
    "{%- else -%}<|im_system|>{{ role_name }}<|im_middle|>\n"
    "{%- endif -%}\n"
    "{{ message['content'] }}<|im_end|>\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "<|im_assistant|>assistant<|im_middle|>{% if thinking is defined and not thinking %}<think></think>{% else %}<think>{% endif %}\n"
    "{%- endif -%}")

KIMI_CONVERSATIONS = [
    [{"role": "user", "content": "Hello, world! 你好，世界！"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "讲个笑话。"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "  spaces  \n\n"}, {"role": "assistant", "content": "\n  indented 123\n"}],
    [{"role": "user", "content": "def f(x):\n    return x * 2\n", "name": "alice"},
     {"role": "assistant", "content": "```python\nf(21)  # 42\n```", "name": "kimi"}],
    [{"role": "user", "content": "東京は日本の首都です。😀👨‍👩‍👧"}],
    [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "OK."}],
    [{"role": "user", "content": "Say <|im_end|> please <think>"}, {"role": "assistant", "content": "<|im_end|><|im_user|>"}],
    [{"role": "user", "content": "[EOS] and </think> typed"}],
]


def render_kimi(tpl, msgs, gen, **kw):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(tpl).render(messages=msgs, add_generation_prompt=gen, **kw)


def kimi_chat_case(enc, specials, tpl, msgs, gen, **kw):
    import re
    text = render_kimi(tpl, msgs, gen, **kw)
    injected = any(any(n in m["content"] for n in specials) for m in msgs)
    c = {"messages": msgs, "add_generation_prompt": gen, "rendered": text, "injected_specials": injected}
    c.update({k: v for k, v in kw.items()})
    # plain-content ids: render with markers in place of the contents, split
    # the marked rendering at special tokens (now only structural ones), put
    # the contents back, encode each text stretch as ordinary text
    marked = [dict(m, content="\x00%d\x00" % i) for i, m in enumerate(msgs)]
    mtext = render_kimi(tpl, marked, gen, **kw)
    pat = "(" + "|".join(re.escape(n) for n in sorted(specials, key=len, reverse=True)) + ")"
    ids_plain = []
    for part in re.split(pat, mtext):
        if not part:
            continue
        if part in specials:
            ids_plain.append(specials[part])
        else:
            part = re.sub("\x00(\\d+)\x00", lambda mm: msgs[int(mm.group(1))]["content"], part)
            ids_plain += enc.encode_ordinary(part)
    c["ids_plain"] = ids_plain
    if not injected:
        ids = enc.encode(text, allowed_special="all")
        assert ids == ids_plain
        # mask from tiktoken's offsets: assistant content, and its <|im_end|>
        # content spans in the real rendering: walk it in step with the marked one
        spans = []
        real_pos, mpos = 0, 0
        for i, m in enumerate(marked):
            at = mtext.index(m["content"], mpos)
            real_at = real_pos + (at - mpos)
            if msgs[i]["role"] == "assistant":
                spans.append((real_at, real_at + len(msgs[i]["content"])))
            real_pos = real_at + len(msgs[i]["content"])
            mpos = at + len(m["content"])
        assert all(text[a:b] == msgs[i]["content"] for (a, b), i in
                   zip(spans, [k for k, m in enumerate(msgs) if m["role"] == "assistant"]))
        _, offs = enc.decode_with_offsets(ids)
        im_end = specials["<|im_end|>"]
        c["ids"] = ids
        c["mask"] = [1 if any(a <= o < b for a, b in spans) or (t == im_end and any(o == b for _, b in spans)) else 0
                     for o, t in zip(offs, ids)]
    return c


def gen_kimi_chat(enc, specials, k2_config):
    with open(k2_config) as f:
        k2_tpl = json.load(f)["chat_template"]
    k2 = [kimi_chat_case(enc, specials, k2_tpl, m, g) for m in KIMI_CONVERSATIONS for g in (False, True)]
    k25 = []
    for m in KIMI_CONVERSATIONS:
        for g, th in ((False, None), (True, None), (True, True), (True, False)):
            kw = {} if th is None else {"thinking": th}
            k25.append(kimi_chat_case(enc, specials, KIMI_K25_TEMPLATE, m, g, **kw))
    kimi_sys = "You are Kimi, an AI assistant created by Moonshot AI."
    for m in KIMI_CONVERSATIONS[:3]:
        k25.append(kimi_chat_case(enc, specials, KIMI_K25_TEMPLATE, m, True, default_system=kimi_sys))
    with open(os.path.join(OUT, "kimi_chat.json"), "w") as f:
        json.dump({"k2": {"template": k2_tpl, "default_system": "You are a helpful assistant", "conversations": k2},
                   "k25": {"template": KIMI_K25_TEMPLATE, "conversations": k25}}, f, ensure_ascii=True,
                  separators=(",", ":"))
    print("kimi conversations: K2 %d, K2.5-style %d" % (len(k2), len(k25)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--kimi-ranks", default=os.path.join(os.path.dirname(ROOT), "shared", "data", "kimi-k2",
                                                         "tiktoken.model"))
    ap.add_argument("--only", choices=["smollm2", "kimi"])
    a = ap.parse_args()
    if a.only != "smollm2":
        gen_kimi(a.kimi_ranks)
    if a.only == "kimi":
        return 0
    tokens, types, merges, tpl = read_gguf(a.gguf)
    assert tokens[1] == "<|im_start|>" and tokens[2] == "<|im_end|>"
    tok = build_reference(tokens, types, merges)
    b2u = bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(tokens)}
    u2b = {c: b for b, c in b2u.items()}

    # transformers' own conversion of the GGUF (ByteLevel only, no Digits)
    from transformers import AutoTokenizer
    d = os.path.dirname(os.path.realpath(a.gguf))
    tf = AutoTokenizer.from_pretrained(d, gguf_file=os.path.basename(os.path.realpath(a.gguf)))
    with tempfile.TemporaryDirectory() as tmp:
        tf.save_pretrained(tmp)
        with open(os.path.join(tmp, "tokenizer.json")) as f:
            tj = json.load(f)
        with open(os.path.join(tmp, "tokenizer_config.json")) as f:
            tcfg = f.read()  # verbatim: model_max_length is a 31-digit integer the C loader must accept
        jinja_path = os.path.join(tmp, "chat_template.jinja")
        tjinja = open(jinja_path).read() if os.path.exists(jinja_path) else None
    tftok = Tokenizer.from_str(json.dumps(tj))
    # the C test rebuilds vocab/merges from the GGUF: check that this
    # reconstruction is exactly what transformers wrote
    assert tj["model"]["vocab"] == {t: i for i, t in enumerate(tokens)}, "vocab reconstruction differs"
    assert [list(m) if isinstance(m, list) else m.split(" ", 1) for m in tj["model"]["merges"]] == \
        [m.split(" ", 1) for m in merges], "merges reconstruction differs"
    skel = dict(tj)
    skel["model"] = {k: v for k, v in tj["model"].items() if k not in ("vocab", "merges")}
    skel_tf = json.loads(json.dumps(skel))
    skel["pre_tokenizer"] = json.loads(tok.to_str())["pre_tokenizer"]

    # -------- strings
    allb = hand_strings() + invalid_strings() + corpus_strings() + random_strings(110)
    seen, items = set(), []
    n_diff_tf = 0
    for b in allb:
        if b in seen:
            continue
        seen.add(b)
        valid = True
        try:
            s = b.decode("utf-8")
        except UnicodeDecodeError:
            valid = False
        ids = encode_bytes(tok, b, True, b2u, vocab)
        ids_plain = encode_bytes(tok, b, False, b2u, vocab)
        it = {"hex": b.hex(), "valid_utf8": valid, "ids": ids, "ids_plain": ids_plain}
        dec = b"".join(token_bytes(tokens[i], types[i], u2b) for i in ids)
        if dec != b:
            it["decoded_hex"] = dec.hex()
        if dec != b or not valid:  # what a UTF-8-safe detokenizer must finally print
            it["lossy"] = dec.decode("utf-8", "replace")
        if valid:
            assert tok.decode(ids, skip_special_tokens=False) == dec.decode("utf-8", "replace"), repr(s)
            tftok.encode_special_tokens = False
            tids = tftok.encode(s, add_special_tokens=False).ids
            if tids != ids:
                it["ids_transformers_gguf"] = tids
                n_diff_tf += 1
        items.append(it)
    assert len(items) >= 300, len(items)
    strings = {"source": "HF tokenizers %s, SmolLM2 GGUF vocab+merges, Digits+ByteLevel pre-tokenizer" %
               __import__("tokenizers").__version__, "count": len(items), "strings": items}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "smollm2_strings.json"), "w") as f:
        json.dump(strings, f, ensure_ascii=True, separators=(",", ":"))

    # -------- chat
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert default_system in tpl
    convs = []
    for msgs in CONVERSATIONS:
        for gen in (False, True):
            text = render(tpl, msgs, gen)
            injected = any("<|im_" in m["content"] for m in msgs)
            c = {"messages": msgs, "add_generation_prompt": gen, "rendered": text, "injected_specials": injected,
                 "ids_plain": chat_plain_ids(tok, msgs, default_system, gen)}
            if not injected:
                c["ids"], c["mask"] = chat_expected(tok, text, msgs, default_system)
                assert c["ids"] == c["ids_plain"]
            convs.append(c)
    # a caller-chosen default system prompt: the same template with its
    # default text replaced, rendered by jinja2
    custom = "Custom system prompt, with <|im_end|> inside."
    tpl_custom = tpl.replace(default_system, custom)
    assert tpl_custom != tpl
    custom_cases = [{"messages": m, "add_generation_prompt": True, "default_system": custom,
                     "rendered": render(tpl_custom, m, True)} for m in CONVERSATIONS[:3]]
    chat = {"template": tpl, "default_system": default_system, "conversations": convs,
            "custom_system": custom_cases}
    with open(os.path.join(OUT, "smollm2_chat.json"), "w") as f:
        json.dump(chat, f, ensure_ascii=True, indent=None, separators=(",", ":"))

    with open(os.path.join(OUT, "smollm2_hf_skeleton.json"), "w") as f:
        json.dump({"smollm2": skel, "transformers_gguf": skel_tf, "tokenizer_config_text": tcfg,
                   "chat_template_jinja": tjinja}, f, ensure_ascii=True, indent=1)
    print("strings: %d (%d where transformers' GGUF conversion differs), conversations: %d" %
          (len(items), n_diff_tf, len(convs)))


if __name__ == "__main__":
    sys.exit(main())
