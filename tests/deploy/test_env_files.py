"""deploy_env_files: the env files in deploy/env/ speak the server's language.

Against the real `specd serve --help` (parsed, not a copy):
- every active SPECD_* variable is one --help lists ([env: SPECD_X]), or
  SPECD_MODEL (the unit's positional argument); other variables only for the
  libraries (CUDA_*, NCCL_*); never the secret SPECD_API_KEY;
- every SPECD_* name mentioned anywhere, comments included, is listed too,
  except those on commented-out lines of a paragraph saying "not yet
  supported", and those must NOT be listed: once the server gains the flag,
  this fails so that the env file switches it on;
- every variable has a comment paragraph, no variable is set twice, values are
  plain words (no quotes, no spaces: the same under systemd and `. file`);
- the values pass the server's own parser and bounds: `specd serve MODEL
  --check-config` under exactly that environment. SmolLM2: with the test GGUF,
  a temporary key file and the committed head (draft/heads/...) or else a
  random EAGLE-3 head, it must succeed (pairing checked too). Kimi-K2.5: the
  model is absent here, so it must fail on the model path only, after every
  SPECD_* value was accepted.
- the SmolLM2 head path is where install.sh puts draft/heads/<name>.
"""
import os
import re
import subprocess
import sys
import tempfile

import deploy_common as dc

dc.need_specd()
HELP = dc.help_text()
NAMES = dc.help_env_names(HELP)
LIB_PREFIXES = ("CUDA_", "NCCL_", "OMP_")


def paragraphs(path):
    """Blocks of consecutive non-blank lines: [(first lineno, [lines])]."""
    out, cur, start = [], [], 0
    with open(path) as f:
        for i, raw in enumerate(f, 1):
            s = raw.rstrip("\n")
            if s.strip():
                if not cur:
                    start = i
                cur.append(s)
            elif cur:
                out.append((start, cur))
                cur = []
    if cur:
        out.append((start, cur))
    return out


def check_file(path):
    name = os.path.basename(path)
    assigns = dc.read_env(path)
    keys = [k for k, _, _ in assigns]
    dup = {k for k in keys if keys.count(k) > 1}
    assert not dup, f"{name}: set twice: {dup}"
    assert "SPECD_MODEL" in keys, f"{name}: SPECD_MODEL (the unit's ExecStart argument) is missing"
    assert "SPECD_API_KEY" not in keys, f"{name}: never put the key itself in the env file (use SPECD_API_KEY_FILE)"
    for k, v, ln in assigns:
        if k.startswith("SPECD_"):
            assert k == "SPECD_MODEL" or k in NAMES, f"{name}:{ln}: {k} is not an env name of `specd serve --help`"
        else:
            assert k.startswith(LIB_PREFIXES), f"{name}:{ln}: {k}: neither SPECD_* nor a library variable"
        assert re.fullmatch(r"[^\s'\"\\$`]+", v), f"{name}:{ln}: value {v!r} needs quoting; keep values plain"

    unsupported = set()
    for start, lines in paragraphs(path):
        body = "\n".join(lines)
        active = [ln for ln in lines if dc.ASSIGN.match(ln.strip())]
        for ln in active:
            assert lines[0].lstrip().startswith("#"), f"{name}:{start}: {ln.split('=')[0]} has no comment above it"
        commented = [dc.COMMENTED_ASSIGN.match(ln.strip()) for ln in lines]
        commented = [m.group(1) for m in commented if m and m.group(1).startswith("SPECD_")]
        if commented and "not yet supported" in body.lower():
            unsupported.update(commented)
    for u in sorted(unsupported):
        assert u not in NAMES, (f"{name}: {u} is marked 'not yet supported' but `specd serve --help` now lists it: "
                                f"switch it on in the env file")
    with open(path) as f:
        mentioned = set(re.findall(r"\bSPECD_[A-Z0-9_]+", f.read()))
    unknown = mentioned - NAMES - {"SPECD_MODEL"} - unsupported
    assert not unknown, f"{name}: mentions names `specd serve --help` does not list: {sorted(unknown)}"
    print(f"{name}: {len(assigns)} variables, all known; not yet supported: {sorted(unsupported) or 'none'}")
    return dict((k, v) for k, v, _ in assigns), unsupported


def check_config(env_vars, model, expect_ok):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_") or k in ("SPECD_SOURCE_DIR",)}
    env.update(env_vars)
    r = subprocess.run([dc.SPECD, "serve", model, "--check-config"], env=env, capture_output=True, text=True,
                       timeout=300)
    if expect_ok:
        assert r.returncode == 0, f"--check-config failed: {r.stderr}"
        assert "ok" in r.stdout
    else:
        assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
        assert "SPECD_" not in r.stderr, f"an env value was refused: {r.stderr}"
        assert "not readable" in r.stderr, r.stderr
    return r


def head_for_smollm2(tmp, installed_path):
    """The committed head if present, else a random one; None if neither can be had."""
    name = os.path.basename(installed_path.rstrip("/"))
    committed = os.path.join(dc.SRC, "draft", "heads", name)
    if os.path.isdir(committed):
        return committed, "committed head draft/heads/" + name
    py = os.environ.get("SPECD_PYTHON", sys.executable)
    out = os.path.join(tmp, "head")
    mk = subprocess.run([py, os.path.join(dc.SRC, "tools/eagle3/make_random_head.py"), "--layout", "speculators",
                         "--out", out, "--seed", "1", "--rope-theta", "100000"], capture_output=True, text=True)
    if mk.returncode == 0:
        return out, "random EAGLE-3 head (draft/heads/%s not committed yet)" % name
    print("note: no head could be made:", mk.stderr[-300:])
    return None, "no head"


def main():
    files = sorted(os.path.join(dc.ENV_DIR, f) for f in os.listdir(dc.ENV_DIR) if f.endswith(".env"))
    names = [os.path.basename(f) for f in files]
    assert "smollm2-cpu.env" in names and "kimi-k25-8gpu.env" in names, names
    parsed = {os.path.basename(f): check_file(f) for f in files}

    # the SmolLM2 head is where install.sh installs draft/heads/<name>
    sm, _ = parsed["smollm2-cpu.env"]
    assert sm["SPECD_DRAFT"].startswith("/usr/local/share/specd/heads/"), sm["SPECD_DRAFT"]
    kimi, kimi_unsup = parsed["kimi-k25-8gpu.env"]
    # the 8-GPU example takes the GPUs when the target can run there: auto (cuda would refuse to start while
    # DeepSeek-V3 has no CUDA path) or cuda
    assert kimi["SPECD_DEVICE"] in ("auto", "cuda") and kimi["SPECD_NUM_SPECULATIVE_TOKENS"] == "3", kimi
    assert kimi["SPECD_TENSOR_PARALLEL_SIZE"] == "8", kimi
    assert "SPECD_DRAFT" in kimi or "SPECD_SPECULATIVE_CONFIG" in kimi
    tp_on = kimi.get("SPECD_TENSOR_PARALLEL_SIZE") == "8"
    assert tp_on or "SPECD_TENSOR_PARALLEL_SIZE" in kimi_unsup, "Kimi needs tensor-parallel 8 (or the marker)"

    if not os.path.exists(dc.MODEL):
        dc.skip(f"names checked; value check needs the model {dc.MODEL}")
    with tempfile.TemporaryDirectory(prefix="deploy_env_") as tmp:
        key = os.path.join(tmp, "api-key")
        with open(key, "w") as f:
            f.write("k" * 64 + "\n")
        env = dict(sm, SPECD_API_KEY_FILE=key)
        env.pop("SPECD_MODEL")
        head, how = head_for_smollm2(tmp, sm["SPECD_DRAFT"])
        if head:
            env["SPECD_DRAFT"] = head
        else:
            env.pop("SPECD_DRAFT")
            env.pop("SPECD_NUM_SPECULATIVE_TOKENS", None)
        check_config(env, dc.MODEL, True)
        print(f"smollm2-cpu.env: --check-config ok with the test model and {how}")
        # the same check refuses a bad value (the harness can fail)
        r = subprocess.run([dc.SPECD, "serve", dc.MODEL, "--check-config"],
                           env={**os.environ, **env, "SPECD_KV_CACHE_MEMORY": "lots"}, capture_output=True, text=True)
        assert r.returncode == 1 and "SPECD_KV_CACHE_MEMORY=lots" in r.stderr, r.stderr

        env = dict(kimi, SPECD_API_KEY_FILE=key)
        model = env.pop("SPECD_MODEL")
        check_config(env, model, False)
        print("kimi-k25-8gpu.env: every SPECD_* value accepted; refused only for the absent model", model)
    print("deploy_env_files: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
