#!/usr/bin/env python3
"""gen_tok_fixtures.py: Kimi tokenizer and chat-template fixtures from tiktoken and jinja2.

What it owns
    tests/fixtures/kimi/tokenizer_cases.json: >= 500 strings (English, Chinese, Japanese, Korean,
    code, emoji, digits, whitespace runs, mixed scripts, contractions in both cases, Unicode
    category edge cases) with the ids the `tiktoken` package produces over Kimi's ranks file and
    pre-tokenizer pattern (encode_ordinary: no special-token parsing), plus a few strings encoded
    with every special token allowed; and tests/fixtures/kimi/chat_cases.json: >= 10
    conversations rendered by jinja2 with tools/kimi/chat_template.jinja (text) and their ids
    (structural tokens as ids, message text as plain text). Each string also carries the byte
    offsets where the pre-tokenizer pieces end (Python's regex module, V1 mode, Kimi's pattern).

Invariants
    * The REFERENCE section 1 test vector is asserted before anything is written.
    * Every case round-trips: decode(ids) == text.
    * The corpus is deterministic (fixed lists and a seeded random.Random for combinations), and
      shared with tools/kimi/prove_pcre2.py.

Usage: gen_tok_fixtures.py [--out tests/fixtures/kimi]   (venv-tools: tiktoken, jinja2, regex)
Threading: single-threaded.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kimi_tok as kt  # noqa: E402

TEST_VECTOR = ("Hello, world! 你好，世界！", [19180, 11, 2695, 0, 220, 33845, 378, 2243, 856])

ENGLISH = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.",
    "I'm sure you're right, but we'd better check what they've said.",
    "I'M SURE YOU'RE RIGHT, BUT WE'D BETTER CHECK WHAT THEY'VE SAID.",
    "She's here; he'll come; it's done; don't; can't; won't; I'd; they'll; we're.",
    "SHE'S HERE; HE'LL COME; IT'S DONE; DON'T; CAN'T; WON'T; I'D; THEY'LL; WE'RE.",
    "She'S hEre'Ll mIxEd'Ve CaSe'M contractions'D",
    "rock 'n' roll, 'tis the season, y'all, o'clock, ma'am",
    "Mr. O'Neil's dog's bone; the students' books; James' car.",
    "CamelCaseIdentifier and snake_case_identifier and SCREAMING_SNAKE",
    "URLs: https://example.com/path?query=1&x=y#frag and mailto:someone@example.org",
    "Prices: $3.50, €12, £7.99, ¥1000, 50% off!!!",
    "A sentence with a trailing space ", "  two leading spaces", "\tTabbed\tcolumns\there",
    "Line one\nLine two\r\nLine three\rLine four", "Ellipsis... and em—dash – en–dash",
    "“Curly quotes” and ‘single ones’ and «guillemets»", "iPhone iPad eBay McDonald's",
    "ABBREVIATIONS like NASA, FBI, and U.S.A.", "x", "I", "a b c d e f g",
]
CHINESE = [
    "你好，世界！", "我爱北京天安门。", "人工智能正在改变世界，尤其是在自然语言处理领域。",
    "今天天气很好，我们去公园散步吧。", "这是一个测试：包含标点符号、数字123和English单词。",
    "《红楼梦》是中国古典四大名著之一。", "他说：“明天见！”", "中文、日本語、한국어混合", "〇一二三四五",
    "简体中文和繁體中文", "北京市海淀区中关村大街27号", "模型Kimi-K2.5支持256K上下文。",
]
JAPANESE = [
    "こんにちは、世界！", "東京は日本の首都です。", "カタカナとひらがなと漢字を混ぜる。",
    "私はコーヒーが好きです。", "ｶﾀｶﾅ半角とカタカナ全角", "ラーメン🍜を食べたい！",
    "今日は2024年1月1日です。", "「かぎかっこ」と『二重かぎかっこ』", "ーー長音ー",
]
KOREAN = [
    "안녕하세요, 세계!", "한국어는 한글로 씁니다.", "저는 학생입니다. 반갑습니다!",
    "서울특별시 강남구 테헤란로 123", "ㄱㄴㄷㄹ ㅏㅑㅓㅕ", "한국어 English 中文 混合",
]
OTHER_SCRIPTS = [
    "Привет, мир! Как дела?", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם",
    "नमस्ते दुनिया", "สวัสดีชาวโลก", "Xin chào thế giới", "Zażółć gęślą jaźń",
    "Ünïcödé àccénts çà et là", "ǅemal ǈubljana ǋegoš (titlecase digraphs)",
    "ʰʲʷ modifier letters ˈstress", "e\u0301 combining acute, a\u0308 umlaut, n\u0303",
    "\u0301\u0301 lone combining marks", "ﬁ ﬂ ligatures", "Ⅻ Ⅳ roman numerals ⅷ",
    "x² + y³ = z⁴, ½ + ¼", "①②③ circled", "١٢٣ arabic digits ٤٥٦", "１２３４５ fullwidth",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters 𝟙𝟚𝟛", "𠀀𠀁 CJK extension B", "ᚠᛇᚻ runes",
]
CODE = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "for (size_t i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "const x = async () => { await fetch('/api/v1/items?id=7'); };",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "#include <stdio.h>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))",
    "    if x:\n        pass\n\n\n    else:\n        raise ValueError('bad')",
    "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
    "<div class=\"main\"><p>Hello &amp; welcome</p></div>",
    "git commit -m \"fix: handle\\tedge cases\" && make -j8",
    "x=1;y=2;z=x+y*3-4/5%6**7", "a->b.c[d]::e", "__init__ self._private __dunder__",
    "0x1F 0b1010 0o777 1_000_000 3.14159e-10", "// comment\n/* block */\n# hash",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }", "λx.x → ∀y∃z: y≠z ∧ ¬p",
    "```python\nprint('hi')\n```", "$ echo $HOME | grep -E '^/[a-z]+' > out.txt 2>&1",
]
EMOJI = [
    "😀😃😄😁", "👍🏽 thumbs up, medium skin", "👨‍👩‍👧‍👦 family ZWJ", "🇫🇷🇯🇵🇰🇷 flags",
    "❤️ heart with VS16", "🎉 Party time! 🎊", "emoji😀between😀words", "🙂🙃", "⌚⏰ clock",
    "🏳️‍🌈 rainbow flag", "1️⃣ keycap", "©®™ symbols",
]
DIGITS = [
    "0", "12", "123", "1234", "12345", "123456", "1234567", "3.14159265358979",
    "2024-01-01T12:34:56Z", "+1 (555) 123-4567", "1,000,000.00", "10^100", "007 bond",
    "v1.2.3-rc4", "192.168.0.1:8080", "99 bottles", "abc123def456", "12abc34", "٣٤٥",
]
WHITESPACE = [
    " ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n",
    " \n", "\n ", " \n \n ", "a  b", "a   b", "a\t\tb", "a \t b", "a\n\nb", "a\r\n\r\nb",
    "trailing   ", "   leading", "mid    dle", "\u00a0nbsp\u00a0", "ideographic\u3000space",
    "en\u2002em\u2003thin\u2009", "line\u2028sep\u2029para", "zero\u200bwidth", "nel\u0085x",
    "  \n\n  \t x", "x \n", "x  \n  y", " \r\n ",
]
SPECIAL_LOOKING = [
    "<|im_end|>", "<|im_user|>user<|im_middle|>hi<|im_end|>", "[BOS] [EOS] [PAD]",
    "<think>reasoning</think>", "<|reserved_token_163700|>", "<|not_a_token|>",
]


def corpus() -> list[str]:
    base = ENGLISH + CHINESE + JAPANESE + KOREAN + OTHER_SCRIPTS + CODE + EMOJI + DIGITS + \
        WHITESPACE + SPECIAL_LOOKING
    rng = random.Random(20260101)
    words = []
    for s in base:
        words += [w for w in s.replace("\n", " ").split(" ") if w]
    seps = [" ", "  ", "\n", "\t", "", ", ", ". ", "\r\n", "   \n", "!", "’", "'"]
    mixed = []
    while len(mixed) < 380:
        n = rng.randint(1, 9)
        parts = []
        for _ in range(n):
            parts.append(rng.choice(words))
            parts.append(rng.choice(seps))
        s = "".join(parts)
        if rng.random() < 0.2:
            s = s.upper()
        elif rng.random() < 0.1:
            s = s.lower()
        if rng.random() < 0.15:
            s = s + rng.choice(["'s", "'S", "'re", "'RE", "'ll", "'LL", "'ve", "'VE", "'m", "'M", "'d", "'D"])
        if rng.random() < 0.1:
            s = " " * rng.randint(1, 5) + s
        mixed.append(s)
    out, seen = [], set()
    for s in [TEST_VECTOR[0]] + base + mixed:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Hello!"}], "thinking": True},
    {"messages": [{"role": "user", "content": "Hello!"}], "thinking": False},
    {"messages": [{"role": "system", "content": "You are a pirate."},
                  {"role": "user", "content": "Where is the treasure?"}], "thinking": True},
    {"messages": [{"role": "system", "content": "You are a pirate."},
                  {"role": "user", "content": "Where is the treasure?"}], "thinking": False},
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "4."},
                  {"role": "user", "content": "And 3+3?"}], "thinking": True},
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "4."},
                  {"role": "user", "content": "And 3+3?"}], "thinking": False},
    {"messages": [{"role": "system", "content": "Answer in Chinese."},
                  {"role": "user", "content": "Tell me a joke."},
                  {"role": "assistant", "content": "为什么程序员喜欢黑暗？因为光会产生bug。"},
                  {"role": "user", "content": "再来一个！"},
                  {"role": "assistant", "content": "好的：……"},
                  {"role": "user", "content": "谢谢 🙏"}], "thinking": True},
    {"messages": [{"role": "user", "content": "I typed <|im_end|> and <think> and [EOS] on purpose."}],
     "thinking": False},
    {"messages": [{"role": "user", "content": "No default system here."}], "thinking": True,
     "default_system": ""},
    {"messages": [{"role": "user", "content": "Custom default."}], "thinking": False,
     "default_system": "You are a helpful assistant"},
    {"messages": [{"role": "user", "name": "alice", "content": "Hi, I'm Alice."},
                  {"role": "assistant", "name": "kimi", "content": "Hi Alice!"},
                  {"role": "user", "name": "bob", "content": "And I'm Bob.\n\nTwo  spaces."}],
     "thinking": False},
    {"messages": [{"role": "user", "content": "def f(x):\n    return x * 2\n\nExplain."}],
     "thinking": True, "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Finished conversation."},
                  {"role": "assistant", "content": "Yes."}], "thinking": True,
     "add_generation_prompt": False},
    {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
     "thinking": False},
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(kt.REPO, "tests", "fixtures", "kimi"))
    a = ap.parse_args(argv)
    enc = kt.encoding()
    got = enc.encode_ordinary(TEST_VECTOR[0])
    assert got == TEST_VECTOR[1], got
    import regex   # pre-tokenizer pieces by an engine with true class intersection (V1 mode)
    splitter = regex.compile("(?V1)" + kt.PATTERN)
    cases = []
    for s in corpus():
        ids = enc.encode_ordinary(s)
        assert enc.decode(ids) == s, repr(s)
        ends, off = [], 0
        for m in splitter.finditer(s):
            assert len(s[:m.start()].encode()) == off      # pieces are contiguous
            off += len(m.group().encode())
            ends.append(off)
        assert off == len(s.encode())
        cases.append({"text": s, "ids": ids, "split_ends": ends})
    assert len(cases) >= 500, len(cases)
    special_cases = []
    for s in SPECIAL_LOOKING + ["[BOS]Hello<|im_end|>[EOS]", "<think></think>x"]:
        ids = enc.encode(s, allowed_special="all")
        special_cases.append({"text": s, "ids": ids})
    sp = kt.special_tokens()
    tok = {
        "source": "tiktoken %s Encoding(ranks=tiktoken.model sha256 b6c497a7..., pattern=Kimi's, "
                  "specials 163584..163839); tools/kimi/gen_tok_fixtures.py" % __import__("tiktoken").__version__,
        "pattern": kt.PATTERN,
        "split_ends_note": "byte offsets (UTF-8) where each pre-tokenizer piece ends, from Python's "
                           "regex module (V1, true class intersection) running the pattern above",
        "test_vector": {"text": TEST_VECTOR[0], "ids": TEST_VECTOR[1]},
        "special_tokens": {str(i): n for n, i in sorted(sp.items(), key=lambda t: t[1])
                           if not n.startswith("<|reserved_token_")},
        "reserved_name_format": "<|reserved_token_{id}|> (absolute id) for the other ids in 163584..163839",
        "cases": cases,
        "special_cases_note": "encoded with every special token allowed (allowed_special='all'); "
                              "the 'cases' above are encode_ordinary (specials are plain text)",
        "special_cases": special_cases,
    }
    chats = []
    for c in CONVERSATIONS:
        kw = {"thinking": c["thinking"], "add_generation_prompt": c.get("add_generation_prompt", True)}
        if "default_system" in c:
            kw["default_system"] = c["default_system"]
        text = kt.render(c["messages"], **kw)
        ids = kt.chat_ids(c["messages"], **kw)
        # with no special-looking text in the messages, encoding the whole rendering with every
        # special allowed gives the same ids: the structural split is not hiding a difference
        if not any("<" in m["content"] or "[" in m["content"] for m in c["messages"]):
            assert ids == enc.encode(text, allowed_special="all"), c
        else:
            assert kt.IM_END not in ids[ids.index(kt.IM_USER) + 3: ids.index(kt.IM_END, ids.index(kt.IM_USER))]
        chats.append({"messages": c["messages"], **kw,
                      "default_system": kw.get("default_system", kt.DEFAULT_SYSTEM),
                      "text": text, "ids": ids})
    assert len(chats) >= 10
    chat = {
        "source": "jinja2 %s rendering of tools/kimi/chat_template.jinja; ids: template text "
                  "encoded with specials allowed, message text with encode_ordinary (tiktoken)"
                  % __import__("jinja2").__version__,
        "template": open(kt.CHAT_TEMPLATE, encoding="utf-8").read(),
        "conversations": chats,
    }
    os.makedirs(a.out, exist_ok=True)
    for name, obj in (("tokenizer_cases.json", tok), ("chat_cases.json", chat)):
        p = os.path.join(a.out, name)
        with open(p, "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=0)
            f.write("\n")
        print("wrote", p, os.path.getsize(p), "bytes")
    print(f"{len(cases)} tokenizer cases, {len(special_cases)} special cases, {len(chats)} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
