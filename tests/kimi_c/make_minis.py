#!/usr/bin/env python3
"""make_minis.py: the kimi_c_mini_setup fixture: regenerates the seed-0 Kimi miniature (numpy only,
tools/kimi/make_mini.py) in the three tensor-name layouts the C loader accepts, under OUT:

    OUT/k25      language_model.model.* + language_model.lm_head (Kimi-K2.5), tokenizer files
    OUT/nomodel  language_model.* (re-exports without ".model"), text_config model_type deepseek_v3
    OUT/dsv3     plain DeepseekV3 config and model.* / lm_head.weight names
    OUT/wide8    the same generator with 8 MLA heads, dense MLP 512 and experts of width 256 (seed 0,
                 tokenizer files as k25): a shape every tensor-parallel size up to 8 can split (1 head and 32
                 int4 columns of every expert per rank at TP 8); tests/kimi_c/test_tp.c checks TP 2, 4 and 8
                 against TP 1 and against transformers on it (tests/fixtures/kimi/mini_wide8_logits.json), kimi_c_spec_server_tp4 serves it at TP 4
    OUT/head     a random-weight EAGLE-3 head for the miniature (tools/eagle3/make_random_head.py
                 with the miniature's sizes: hidden 128, 4 heads of 32, intermediate 256, target
                 vocab 163840, draft vocab 32000 with a random vocabulary map, aux ids [0, 2, 4] (layer outputs),
                 "eagle" layout, seed 0): lossless speculative decoding needs a head, not a good one

All three hold the same numbers (values depend only on seed and canonical name). A stamp with the
sha256 of make_mini.py skips regeneration when nothing changed. Exits 77 (skip) without numpy.
"""
import hashlib
import json
import os
import sys

ROOT = os.environ.get("SPECD_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def make_head(out: str) -> None:
    """The random EAGLE-3 head, sized for the miniature (module constants overridden)."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "eagle3"))
    import make_random_head as mrh
    mrh.H, mrh.HEADS, mrh.KV_HEADS, mrh.HEAD_DIM, mrh.INTER = 128, 4, 4, 32, 256
    mrh.TARGET_VOCAB, mrh.DRAFT_VOCAB, mrh.N_LAYERS = 163840, 32000, 6
    mrh.AUX_IDS = [1, 3, 5]    # inputs of layers 1, 3, 5
    mrh.write_head(out, "eagle", 0)
    # the ids written explicitly, whatever convention the generator's version writes:
    # eagle_config ids are layer OUTPUTS (SpecForge/SGLang; docs/draft.md): 0, 2, 4
    path = os.path.join(out, "config.json")
    cfg = json.load(open(path))
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 4]
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def main() -> int:
    out = sys.argv[1]
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("SKIP: numpy not available to regenerate the Kimi miniature")
        return 77
    sys.path.insert(0, os.path.join(ROOT, "tools", "kimi"))
    import make_mini as mm
    gen = os.path.join(ROOT, "tools", "kimi", "make_mini.py")
    head_gen = os.path.join(ROOT, "tools", "eagle3", "make_random_head.py")
    h = hashlib.sha256(open(gen, "rb").read() + open(head_gen, "rb").read()).hexdigest()
    stamp_text = h + " seed 0 v5\n"
    stamp = os.path.join(out, "stamp")
    if os.path.exists(stamp) and open(stamp).read() == stamp_text:
        print(f"miniatures in {out} are current")
        return 0
    os.makedirs(out, exist_ok=True)
    if os.path.exists(stamp):
        os.remove(stamp)
    have_tok = os.path.exists(os.path.join(mm.KIMI_DATA, "tiktoken.model"))
    if not have_tok:
        print(f"note: {mm.KIMI_DATA}/tiktoken.model missing: the miniature gets no tokenizer files")
    mm.make(0, os.path.join(out, "k25"), "kimi_k2", "kimi_k25", have_tok)
    mm.make(0, os.path.join(out, "nomodel"), "deepseek_v3", "kimi_k25_nomodel", False)
    mm.make(0, os.path.join(out, "dsv3"), "deepseek_v3", "deepseek_v3", False)
    saved = dict(mm.MINI)
    mm.MINI.update(num_attention_heads=8, num_key_value_heads=8, intermediate_size=512, moe_intermediate_size=256)
    try:
        mm.make(0, os.path.join(out, "wide8"), "kimi_k2", "kimi_k25", have_tok)
    finally:
        mm.MINI.clear()
        mm.MINI.update(saved)
    make_head(os.path.join(out, "head"))
    with open(stamp, "w") as f:
        f.write(stamp_text)
    print(f"wrote the seed-0 miniature in 3 layouts under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
