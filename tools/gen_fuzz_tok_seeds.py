#!/usr/bin/env python3
"""Seed corpora for the tokenizer-loader fuzzers (tests/fuzz/fuzz_tok_hf.c,
tests/fuzz/fuzz_tok_tiktoken.c), written by the reference libraries so the
seeds are files real models ship:

  tests/fuzz/corpus_tok_hf/        tokenizer.json files from the HF `tokenizers`
                                   package (a byte-level BPE trained here on a
                                   short text, in the three pre-tokenizer shapes
                                   specd reads: ByteLevel; Sequence[Digits,
                                   ByteLevel] (SmolLM2); Sequence[Split(Llama-3
                                   regex), ByteLevel(use_regex=false)]), some
                                   with a tokenizer_config.json and a
                                   chat_template.jinja appended after NUL bytes;
  tests/fuzz/corpus_tok_tiktoken/  ranks files (256 single bytes + a few
                                   merges) in tiktoken's format, checked by
                                   reading them back with tiktoken's own
                                   load_tiktoken_bpe (its writer needs
                                   blobfile); one with a tokenizer_config.json
                                   (Kimi special names, bos/eos) appended, one
                                   with CRLF line ends.

Input layout (fuzz_tok_common.h): FILE0 [NUL FILE1 [NUL FILE2]]. Each seed is
kept under ~8 KiB (the fuzzers' -max_len). Run with the tools venv:
    /work/venv-tools/bin/python tools/gen_fuzz_tok_seeds.py
"""
import json
import os
import tempfile

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
import base64

from tiktoken.load import load_tiktoken_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we'll see 12345 numbers.",
    "Once upon a time there was a tokenizer that split words into pieces, then merged them again.",
    "def main():\n    return 42\n\n\tindent\r\nwindows line",
    "caf\u00e9, na\u00efve, \u4e2d\u6587, \U0001F600 emoji and more text for the merges to learn from.",
]
LLAMA3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
          "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def bpe(pre, vocab_size, specials=(), ignore_merges=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, tr)
    return json.loads(tok.to_str())


def compact(obj):
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def write(d, name, parts):
    os.makedirs(d, exist_ok=True)
    data = b"\0".join(parts)
    assert len(data) <= 8192, (name, len(data))
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)
    print(f"{d}/{name}: {len(data)} bytes")


def main():
    hf = os.path.join(ROOT, "tests", "fuzz", "corpus_tok_hf")
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False)
    write(hf, "bytelevel", [compact(bpe(bl, 290))])
    smol = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])
    cfg = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "chat_template": CHATML,
           "model_max_length": 1e30}
    write(hf, "smollm_style_config", [compact(bpe(smol, 285, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])),
                                      compact(cfg)])
    llama = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    j = bpe(llama, 280, ["<|begin_of_text|>", "<|im_end|>"], ignore_merges=True)
    write(hf, "llama3_style_jinja", [compact(j), compact({"eos_token": "<|im_end|>"}), CHATML.encode()])
    # merges written as "a b" strings (older tokenizers) instead of pairs
    j = bpe(bl, 275)
    j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
    write(hf, "string_merges", [compact(j)])

    tk = os.path.join(ROOT, "tests", "fuzz", "corpus_tok_tiktoken")
    ranks = {bytes([b]): b for b in range(256)}
    for m in [b"th", b"he", b" t", b"the", b" the", b"in", b"ing", b"er", b" a", b"an", b"and", b" and", b"\n\n",
              b"  ", b"    ", b"\xe4\xb8", b"12", b"123"]:
        ranks[m] = len(ranks)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "tiktoken.model")
        model = b"".join(base64.b64encode(k) + b" " + str(v).encode() + b"\n"
                         for k, v in sorted(ranks.items(), key=lambda kv: kv[1]))
        with open(p, "wb") as f:
            f.write(model)
        assert load_tiktoken_bpe(p) == ranks
    write(tk, "bytes_merges", [model])
    nb = len(ranks)
    names = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>",
             17: "<|im_middle|>"}
    cfg = {"added_tokens_decoder": {str(nb + k): {"content": v, "special": True} for k, v in names.items()},
           "bos_token": "[BOS]", "eos_token": "[EOS]", "model_max_length": 1e30}
    write(tk, "kimi_names_config", [model, compact(cfg)])
    write(tk, "crlf", [model.replace(b"\n", b"\r\n")])


if __name__ == "__main__":
    main()
