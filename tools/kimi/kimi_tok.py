"""kimi_tok.py: the Kimi tokenizer and chat template as the `tiktoken` package and jinja2 see them.

What it owns
    The reference side of the Kimi tokenizer used by the fixture scripts in tools/kimi/:
    the pre-tokenizer pattern exactly as Kimi ships it (Rust-regex syntax, with `&&` class
    intersections), the special-token table, a tiktoken.Encoding built from the ranks file,
    and chat rendering through jinja2 with tools/kimi/chat_template.jinja, turned into ids with
    structural tokens as ids and message text encoded as plain text (never parsed for specials).

Invariants
    * Special ids 163584..163839: names from tokenizer_config.json's added_tokens_decoder, the
      K2.5 names REFERENCE section 1 lists on top (<think>, </think>, media tokens), and
      `<|reserved_token_{ID}|>` (absolute id) for the rest, as tokenization_kimi.py does.
    * Message text is wrapped in two private-use sentinels (U+F0000/U+F0001, which no test text
      uses) before rendering; the rendered text is split on them and the inside is encoded
      with encode_ordinary. Outside the sentinels only template text exists.

Threading: none (module-level caches are filled on first use).
Needs: tiktoken, jinja2 (fixture generation only; CI tests read the committed fixtures).
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_mini import K25_EXTRA_SPECIALS  # noqa: E402  (the K2.5 names: one definition)

REPO = os.path.dirname(os.path.dirname(HERE))
KIMI_DATA = os.environ.get("SPECD_KIMI_DATA",
                           os.path.join(os.path.dirname(REPO), "shared", "data", "kimi-k2"))
TIKTOKEN_MODEL = os.path.join(KIMI_DATA, "tiktoken.model")
TOKENIZER_CONFIG = os.path.join(KIMI_DATA, "tokenizer_config.k2-instruct.json")
CHAT_TEMPLATE = os.path.join(HERE, "chat_template.jinja")

# Kimi's pre-tokenizer alternatives (REFERENCE section 1), joined by "|". Rust-regex syntax.
PAT_PARTS = [
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
]
PATTERN = "|".join(PAT_PARTS)

N_BASE = 163584
N_SPECIAL = 256
BOS, EOS, IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE = (
    163584, 163585, 163586, 163587, 163588, 163594, 163601)
THINK, THINK_END = 163606, 163607
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

S_OPEN, S_CLOSE = "\U000F0000", "\U000F0001"

_enc = None


def special_tokens() -> dict[str, int]:
    cfg = json.load(open(TOKENIZER_CONFIG, encoding="utf-8"))
    named = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
    for i, n in K25_EXTRA_SPECIALS.items():
        named.setdefault(i, n)
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(N_BASE, N_BASE + N_SPECIAL)}


def encoding(pattern: str = PATTERN):
    """tiktoken.Encoding over the Kimi ranks with `pattern` (default: Kimi's own)."""
    global _enc
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    if pattern == PATTERN and _enc is not None:
        return _enc
    ranks = load_tiktoken_bpe(TIKTOKEN_MODEL)
    assert len(ranks) == N_BASE, len(ranks)
    enc = tiktoken.Encoding(name="kimi-k2.5", pat_str=pattern, mergeable_ranks=ranks,
                            special_tokens=special_tokens())
    if pattern == PATTERN:
        _enc = enc
    return enc


def template():
    import jinja2
    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False, keep_trailing_newline=False,
                             undefined=jinja2.StrictUndefined)
    return env.from_string(open(CHAT_TEMPLATE, encoding="utf-8").read())


def render(messages, add_generation_prompt=True, thinking=True, default_system=DEFAULT_SYSTEM,
           mark=False) -> str:
    """Render with jinja2. mark=True wraps every message content in the sentinels."""
    msgs = []
    for m in messages:
        m = dict(m)
        if mark:
            m["content"] = S_OPEN + m["content"] + S_CLOSE
        msgs.append(m)
    ds = default_system
    if mark and ds:
        ds = S_OPEN + ds + S_CLOSE
    return template().render(messages=msgs, add_generation_prompt=add_generation_prompt,
                             thinking=thinking, default_system=ds)


def chat_ids(messages, **kw) -> list[int]:
    """ids of a rendered conversation: template text with specials as ids, content as plain text."""
    enc = encoding()
    text = render(messages, mark=True, **kw)
    ids, rest = [], text
    while rest:
        a = rest.find(S_OPEN)
        if a < 0:
            ids += enc.encode(rest, allowed_special="all")
            break
        ids += enc.encode(rest[:a], allowed_special="all")
        b = rest.index(S_CLOSE, a)
        ids += enc.encode_ordinary(rest[a + 1:b])
        rest = rest[b + 1:]
    return ids
