"""test_train.py: pytest for the EAGLE-3 trainer on a tiny synthetic dump.

Needs torch (run with /work/venv-tools/bin/python -m pytest tools/train_eagle3);
not part of ctest/CI, which has no torch.  Checks:
  - the loss goes down (learnable synthetic target, make_synthetic_dump.py);
  - an interrupted run resumed from its checkpoint ends bit-identical to an
    uninterrupted one (same data order, RNG and optimiser state);
  - the export is a speculators-layout head that tools/eagle3/reference.py
    (an independent float64 implementation of the draft forward) loads, and
    its logits equal the trained model's (bf16-rounded) at every step-0 row
    and at a training-time-test step 1 row;
  - the vocabulary map loader refuses absolute d2t and an inconsistent t2d.
"""

import json
import os
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "eagle3")]
import make_synthetic_dump as msd  # noqa: E402
import reference as ref  # noqa: E402
import train as tr  # noqa: E402
from dump import DumpReader  # noqa: E402
from model import DraftConfig, Eagle3Train  # noqa: E402

STEPS = 24


def _args(syn, run, *extra):
    return ["--run", run, "--dump", os.path.join(syn, "dump"),
            "--vocab-map", os.path.join(syn, "vocab_map.safetensors"),
            "--target-config", os.path.join(syn, "target_config.json"),
            "--target-embed", os.path.join(syn, "embed.npy"),
            "--steps", str(STEPS), "--tokens-per-step", "96", "--warmup", "3",
            "--lr", "3e-3", "--ckpt-every", "8", "--log-every", "8", "--threads", "1",
            "--ttt", "3", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3train")
    syn = str(root / "syn")
    msd.make(syn, samples=24, length=48, seed=0)
    a, b = str(root / "runA"), str(root / "runB")
    tr.main(_args(syn, a, "--stop-after", "12"))
    assert sorted(os.listdir(os.path.join(a, "ckpt")))[-1] == "step_00000012.pt"
    tr.main(_args(syn, a))          # resumes at 12
    tr.main(_args(syn, b))          # uninterrupted
    return syn, a, b


def _log(run):
    with open(os.path.join(run, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_loss_decreases(runs):
    _, a, _ = runs
    log = _log(a)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    first = np.mean([r["loss"][0] for r in log[:3]])
    last = np.mean([r["loss"][0] for r in log[-3:]])
    print("step-0 loss first3", first, "last3", last)
    assert last < first - 0.5


def test_resume_is_exact(runs):
    _, a, b = runs
    ca = torch.load(os.path.join(a, "ckpt", f"step_{STEPS:08d}.pt"), weights_only=False)
    cb = torch.load(os.path.join(b, "ckpt", f"step_{STEPS:08d}.pt"), weights_only=False)
    assert ca["cursor"] == cb["cursor"]
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k


def test_export_matches_reference(runs):
    syn, a, _ = runs
    exp = os.path.join(a, "export")
    with open(os.path.join(exp, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["draft_vocab_size"] == msd.VD
    assert cfg["transformer_layer_config"]["vocab_size"] == msd.VT
    from safetensors import safe_open
    with safe_open(os.path.join(exp, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.int64
        assert f.get_tensor("t2d").dtype == torch.bool
        d2t_exp, t2d_exp = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert "layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    d2t, t2d = tr.load_vocab_map(os.path.join(syn, "vocab_map.safetensors"), msd.VT)
    assert torch.equal(d2t, d2t_exp) and torch.equal(t2d, t2d_exp)

    embed = np.load(os.path.join(syn, "embed.npy"))
    head = ref.Eagle3Head.load(exp, embed)
    # the trained model with its weights rounded as the export rounds them
    ck = torch.load(os.path.join(a, "ckpt", f"step_{STEPS:08d}.pt"), weights_only=False)
    model = Eagle3Train(DraftConfig(**ck["cfg"]), torch.from_numpy(embed), None)
    model.load_state_dict({k: v.to(torch.bfloat16).to(torch.float32) for k, v in ck["model"].items()},
                          strict=False)
    s = DumpReader(os.path.join(syn, "dump")).get(3)
    T = 20
    ids, aux = s["input_ids"][:T], s["aux_hidden"][:T]
    with torch.no_grad():
        hs = model.ttt_forward(aux, ids, 2)
        lg0 = model.logits(hs[0]).double()          # rows 0..T-3
        lg1 = model.logits(hs[1][-1:]).double()     # step 1, row T-3
    # reference: prefill over pairs t = 0..T-3, then one fed-back step for the
    # last row with the teacher-forced token ids[T-1] at position T-2
    out = ref.run_chain(head, aux[: T - 1].numpy(), ids[: T - 1].numpy(), 0)
    assert out["prefill_logits"].shape == lg0.shape
    scale = float(out["prefill_logits"].abs().max())
    d0 = float((out["prefill_logits"] - lg0).abs().max())
    cache = ref.DraftCache()
    h, _ = ref.draft_layer(head, torch.as_tensor(aux[: T - 2].numpy()), ids[1: T - 1],
                           torch.arange(T - 2), cache, True)
    _, l1 = ref.draft_layer(head, h[-1:], ids[T - 1: T], torch.tensor([T - 2]), cache, False)
    d1 = float((l1 - lg1).abs().max())
    print("export vs reference: step0", d0, "step1", d1, "scale", scale)
    assert d0 <= 1e-4 * scale and d1 <= 1e-4 * scale


def test_vocab_map_refusals(tmp_path):
    from safetensors.numpy import save_file
    used = np.array([1, 3, 4, 9], dtype=np.int64)
    t2d = np.zeros(12, dtype=bool)
    t2d[used] = True
    good = used - np.arange(4)
    p = str(tmp_path / "v.safetensors")
    save_file({"d2t": good, "t2d": t2d}, p)
    tr.load_vocab_map(p, 12)
    save_file({"d2t": used, "t2d": t2d}, p)           # absolute ids, not offsets
    with pytest.raises(ValueError):
        tr.load_vocab_map(p, 12)
    bad = t2d.copy()
    bad[used[0]], bad[0] = False, True                # t2d disagrees with d2t
    save_file({"d2t": good, "t2d": bad}, p)
    with pytest.raises(ValueError):
        tr.load_vocab_map(p, 12)


def test_dump_validate(runs, tmp_path):
    import dump
    syn, _, _ = runs
    assert dump.validate(os.path.join(syn, "dump")) == {"samples": 24, "tokens": 24 * 48,
                                                       "loss_tokens": 24 * 40}
    with pytest.raises(FileNotFoundError):          # no manifest = unfinished
        dump.DumpReader(str(tmp_path))


def test_tau_estimate_equals_greedy_chain(runs):
    """The trainer's acceptance-length estimate equals real greedy chain
    decoding (tools/eagle3/reference.py) on data that is greedy w.r.t. the
    target (ids[t+1] = argmax of the target at t)."""
    syn, a, _ = runs
    embed = np.load(os.path.join(syn, "embed.npy"))
    head = ref.Eagle3Head.load(os.path.join(a, "export"), embed)
    ck = torch.load(os.path.join(a, "ckpt", f"step_{STEPS:08d}.pt"), weights_only=False)
    model = Eagle3Train(DraftConfig(**ck["cfg"]), torch.from_numpy(embed), None)
    model.load_state_dict({k: v.to(torch.bfloat16).to(torch.float32) for k, v in ck["model"].items()},
                          strict=False)
    d2t, t2d = tr.load_vocab_map(os.path.join(syn, "vocab_map.safetensors"), msd.VT)
    T, K = 28, 3
    s = DumpReader(os.path.join(syn, "dump")).get(5)
    s = {k: v[:T] for k, v in s.items()}
    fa = (s["final_hidden"] @ torch.from_numpy(embed).T).argmax(-1)
    ids = s["input_ids"].clone()
    ids[1:] = fa[:-1]
    s["input_ids"] = ids
    with torch.no_grad():
        _, st = tr.sample_loss(model, s, d2t, t2d, torch.from_numpy(embed), K, 1.0, T, measure=True)
    mask = s["loss_mask"]
    rows = acc = 0
    for t in range(T - 2):
        if not mask[t + 2]:
            continue
        rows += 1
        o = ref.run_chain(head, s["aux_hidden"][: t + 2].numpy(), ids[: t + 2].numpy(), K - 1)
        for j in range(K):
            if t + 2 + j > T - 1 or not mask[t + 2 + j] or o["target_ids"][j] != int(fa[t + 1 + j]):
                break
            acc += 1
    print("tau rows", rows, "accepted", acc, "estimate", st["tau_sum"] - st["tau_rows"])
    assert acc > 0
    assert st["tau_rows"] == rows
    assert abs(st["tau_sum"] - (rows + acc)) <= 1     # an f32/f64 argmax near-tie at most


def test_frozen_lm_head_export_without_it(runs, tmp_path):
    """--freeze-lm-head keeps lm_head = target rows of the draft vocab, so the
    export may omit it (--no-export-lm-head) and a loader that falls back to
    the target's rows (reference.py, as specd's) gets the same logits."""
    syn, _, _ = runs
    run = str(tmp_path / "frozen")
    tr.main(_args(syn, run, "--freeze-lm-head", "--no-export-lm-head", "--steps", "4"))
    exp = os.path.join(run, "export")
    from safetensors import safe_open
    with safe_open(os.path.join(exp, "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    embed = np.load(os.path.join(syn, "embed.npy"))
    ck = torch.load(os.path.join(run, "ckpt", "step_00000004.pt"), weights_only=False)
    d2t, _ = tr.load_vocab_map(os.path.join(syn, "vocab_map.safetensors"), msd.VT)
    assert torch.equal(ck["model"]["lm_head.weight"], torch.from_numpy(embed)[torch.arange(msd.VD) + d2t])
    head = ref.Eagle3Head.load(exp, embed)
    model = Eagle3Train(DraftConfig(**ck["cfg"]), torch.from_numpy(embed), None)
    sd = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in ck["model"].items()}
    sd["lm_head.weight"] = ck["model"]["lm_head.weight"]        # not exported: stays f32
    model.load_state_dict(sd, strict=False)
    s = DumpReader(os.path.join(syn, "dump")).get(1)
    T = 16
    with torch.no_grad():
        lg = model.logits(model.ttt_forward(s["aux_hidden"][:T], s["input_ids"][:T], 1)[0]).double()
    out = ref.run_chain(head, s["aux_hidden"][: T - 1].numpy(), s["input_ids"][: T - 1].numpy(), 0)
    d = float((out["prefill_logits"] - lg).abs().max())
    assert d <= 1e-4 * float(out["prefill_logits"].abs().max()), d


def _toy_model(syn, seed=1):
    with open(os.path.join(syn, "target_config.json")) as f:
        tc = json.load(f)
    embed = torch.from_numpy(np.load(os.path.join(syn, "embed.npy")).astype(np.float32))
    d2t, t2d = tr.load_vocab_map(os.path.join(syn, "vocab_map.safetensors"), msd.VT)
    used = torch.arange(d2t.shape[0]) + d2t
    cfg = DraftConfig(hidden_size=tc["hidden_size"], target_hidden_size=tc["hidden_size"],
                      num_heads=tc["num_attention_heads"], num_kv_heads=tc["num_key_value_heads"],
                      head_dim=tc.get("head_dim", tc["hidden_size"] // tc["num_attention_heads"]),
                      intermediate_size=tc["intermediate_size"], rms_norm_eps=tc["rms_norm_eps"],
                      rope_theta=tc.get("rope_theta", 10000.0), draft_vocab_size=d2t.shape[0],
                      target_vocab_size=embed.shape[0])
    torch.manual_seed(seed)
    return Eagle3Train(cfg, embed, embed[used].clone()), embed, d2t, t2d


def test_candidate_loss_with_all_candidates_is_exact(runs):
    """--cand-topk Vd (every draft token a candidate) gives the exact
    objective's loss, gradients and measured acceptance."""
    syn, _, _ = runs
    model, embed, d2t, t2d = _toy_model(syn)
    s = DumpReader(os.path.join(syn, "dump")).get(7)
    out = []
    for k in (0, msd.VD):
        model.zero_grad()
        loss, st = tr.sample_loss(model, s, d2t, t2d, embed, 3, 0.8, 48, measure=True, cand_topk=k)
        loss.backward()
        out.append((float(loss.detach()), st, model.fc.weight.grad.clone()))
    (l0, s0, g0), (l1, s1, g1) = out
    print("exact", l0, "all-candidates", l1)
    assert abs(l0 - l1) <= 1e-5 * abs(l0)
    assert torch.allclose(g0, g1, rtol=1e-4, atol=1e-6)
    assert s0["rows"] == s1["rows"] and s0["tau_sum"] == s1["tau_sum"]


def test_candidate_training_learns(runs, tmp_path):
    """The candidate-set objective (top-8 of 256 + 16 random negatives)
    lowers the exact loss and raises full-vocabulary accuracy."""
    syn, _, _ = runs
    run = str(tmp_path / "cand")
    tr.main(_args(syn, run, "--cand-topk", "8", "--cand-random", "16"))
    log = _log(run)
    assert log[-1]["step"] == STEPS
    first = np.mean([r["loss"][0] for r in log[:3]])
    last = np.mean([r["loss"][0] for r in log[-3:]])
    print("candidate loss first3", first, "last3", last, "acc_full", log[-1]["acc_full"])
    assert last < first - 0.5
    assert log[-1]["acc_full"][0] > log[0]["acc_full"][0]


def test_multi_dump_concatenates(runs):
    from dump import MultiDump
    syn, _, _ = runs
    d = os.path.join(syn, "dump")
    one, two = DumpReader(d), MultiDump([d, d])
    assert len(two) == 2 * len(one)
    assert two.manifest["n_tokens"] == 2 * one.manifest["n_tokens"]
    a, b = one.get(3), two.get(len(one) + 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_row_subset_forward_is_exact(runs):
    """ttt_forward with need0/need1 (prompt rows give only keys/values)
    equals the all-rows forward on every row it computes."""
    syn, _, _ = runs
    model, embed, d2t, t2d = _toy_model(syn, seed=3)
    s = DumpReader(os.path.join(syn, "dump")).get(2)
    ids, aux, mask = s["input_ids"], s["aux_hidden"], s["loss_mask"].clone()
    T = ids.shape[0]
    R = T - 2
    mask[: T // 3] = False                       # a prompt
    mask[T // 2: T // 2 + 3] = False             # and a hole in the response
    need1 = torch.zeros(R, dtype=torch.bool)
    for j in range(1, 3):
        need1[:R - j] |= mask[2 + j:T]
    need0 = mask[2:T] | need1
    assert 0 < int(need0.sum()) < R and int(need1.sum()) < int(need0.sum())
    with torch.no_grad():
        full = model.ttt_forward(aux, ids, 3)
        sub = model.ttt_forward(aux, ids, 3, need0, need1)
    for j in range(3):
        rr = need0 if j == 0 else need1
        assert torch.allclose(full[j][rr], sub[j][rr], rtol=1e-5, atol=1e-5), j


def test_time_limit_checkpoints_and_exports(runs, tmp_path):
    """--time-limit: once the limit has passed (here at once, after step 2 of a
    resumed run) training stops at a step boundary, checkpoints that step and
    exports it; a later run without the limit resumes from there."""
    syn, _, _ = runs
    run = str(tmp_path / "tl")
    tr.main(_args(syn, run, "--stop-after", "2"))
    tr.main(_args(syn, run, "--time-limit", "1e-9"))
    ck = sorted(os.listdir(os.path.join(run, "ckpt")))
    assert ck[-1] == "step_00000002.pt", ck
    with open(os.path.join(run, "export", "README.md")) as f:
        assert "| steps | 2 |" in f.read()
    with open(os.path.join(run, "export", "config.json")) as f:
        json.load(f)
    tr.main(_args(syn, run, "--steps", "4"))
    assert sorted(os.listdir(os.path.join(run, "ckpt")))[-1] == "step_00000004.pt"


def test_init_from_warm_starts_a_new_run(runs, tmp_path):
    """--init-from: a NEW run starts from another run's trained weights (step 0,
    fresh optimiser): its first step's loss is the trained run's level, not a
    cold start's; lm_head is taken only under the same vocab map (another map
    keeps this run's target-row initialisation); a shape mismatch is refused."""
    syn, a, _ = runs
    warm, cold = str(tmp_path / "warm"), str(tmp_path / "cold")
    tr.main(_args(syn, warm, "--init-from", a, "--stop-after", "1", "--log-every", "1"))
    tr.main(_args(syn, cold, "--stop-after", "1", "--log-every", "1"))
    lw, lc, la = _log(warm)[0], _log(cold)[0], _log(a)
    assert lw["step"] == 1 and lw["lr"] == tr.lr_at(0, tr.parse_args(_args(syn, warm)))
    print("step-1 loss warm", lw["loss"][0], "cold", lc["loss"][0], "trained run last", la[-1]["loss"][0])
    assert lw["loss"][0] < lc["loss"][0] - 0.5
    assert lw["loss"][0] < la[0]["loss"][0] - 0.5

    src = torch.load(os.path.join(a, "ckpt", f"step_{STEPS:08d}.pt"), weights_only=False)
    args = tr.parse_args(_args(syn, str(tmp_path / "x")))
    layer_cfg, embed, lm_target = tr.load_target(args)
    d2t, t2d = tr.load_vocab_map(args.vocab_map, embed.shape[0])
    cfg = DraftConfig(**src["cfg"])

    def fresh(d2t_):
        used = torch.arange(d2t_.shape[0]) + d2t_
        return Eagle3Train(cfg, embed, lm_target[used].clone()), lm_target[used].clone()

    m, _ = fresh(d2t)
    tr.init_weights(m, a, cfg, d2t)
    for k, v in m.state_dict().items():
        assert torch.equal(v, src["model"][k]), k

    # another vocab map (same size, other ids): every weight but lm_head copied
    other = str(tmp_path / "other_map.safetensors")
    used = torch.arange(d2t.shape[0]) + d2t
    spare = torch.nonzero(~t2d).flatten()
    used2 = torch.sort(torch.cat([used[:-1], spare[:1]])).values
    from safetensors.torch import save_file
    t2d2 = torch.zeros_like(t2d)
    t2d2[used2] = True
    save_file({"d2t": used2 - torch.arange(used2.shape[0]), "t2d": t2d2}, other)
    d2t2, _ = tr.load_vocab_map(other, embed.shape[0])
    m2, lm2 = fresh(d2t2)
    tr.init_weights(m2, a, cfg, d2t2)
    for k, v in m2.state_dict().items():
        if k == "lm_head.weight":
            assert torch.equal(v, lm2), "lm_head must stay this map's target rows"
        else:
            assert torch.equal(v, src["model"][k]), k

    bad = dict(src)
    bad["model"] = dict(src["model"])
    bad["model"]["fc.weight"] = torch.zeros(3, 3)
    torch.save(bad, str(tmp_path / "bad.pt"))
    with pytest.raises(SystemExit, match="fc.weight has shape"):
        tr.init_weights(fresh(d2t)[0], str(tmp_path / "bad.pt"), cfg, d2t)
    with pytest.raises(SystemExit, match="no loadable checkpoint"):
        tr.init_weights(fresh(d2t)[0], str(tmp_path), cfg, d2t)


def test_init_from_exported_head(runs, tmp_path):
    """--init-from an exported head directory (model.safetensors, no ckpt/: a committed
    draft/heads/ head, whose run is gone): every non-lm_head weight is the checkpoint's,
    bf16-rounded as exported; lm_head is taken from the head only when it carries one
    under the same d2t; otherwise this run's target rows stay."""
    syn, a, _ = runs
    src = torch.load(os.path.join(a, "ckpt", f"step_{STEPS:08d}.pt"), weights_only=False)
    args = tr.parse_args(_args(syn, str(tmp_path / "x")))
    layer_cfg, embed, lm_target = tr.load_target(args)
    d2t, t2d = tr.load_vocab_map(args.vocab_map, embed.shape[0])
    cfg = DraftConfig(**src["cfg"])
    used = torch.arange(d2t.shape[0]) + d2t

    def fresh():
        return Eagle3Train(cfg, embed, lm_target[used].clone())

    trained = fresh()
    trained.load_state_dict(src["model"], strict=False)
    bf = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in src["model"].items()}
    for with_lm in (True, False):
        exp = str(tmp_path / f"exp{int(with_lm)}")
        tr.export_head(trained, layer_cfg, d2t, t2d, exp, {"ttt": 3}, include_lm_head=with_lm)
        m = fresh()
        tr.init_weights(m, exp, cfg, d2t)
        for k, v in m.state_dict().items():
            if k == "lm_head.weight" and not with_lm:
                assert torch.equal(v, lm_target[used]), "no lm_head in the head: this run's rows stay"
            else:
                assert torch.equal(v, bf[k]), k
        # another map: lm_head never taken
        d2t_other = d2t.clone()
        d2t_other[-1] += 1 if int(used[-1]) + 1 < embed.shape[0] else -1
        m2 = fresh()
        tr.init_weights(m2, exp, cfg, d2t_other)
        assert torch.equal(m2.state_dict()["lm_head.weight"], lm_target[used])
    # a directory with a broken model.safetensors is refused with its path
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SystemExit, match="cannot load model.safetensors"):
        tr.init_weights(fresh(), str(broken), cfg, d2t)
