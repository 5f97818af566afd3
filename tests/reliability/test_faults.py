"""Fault tests (issue 10): broken model, draft and key files are refused at start.

Each case starts the real `specd serve` with one defect and asserts:
  - the process exits by itself, with a non-zero code, within the time limit;
  - stderr names the offending file (or the flag that points at it) and says
    what is wrong with it (a keyword of the problem: "truncated", "shape", ...);
  - nothing is left half-started: the server never reported "serving", /health
    never answered 200, and the port it was given is free again (bindable)
    once it has exited.

The broken inputs are copies of independent artefacts, made here:
  - the Kimi-K2.5 miniature (tools/kimi/make_mini.py --seed 0, numpy only):
    a missing shard, a truncated shard, a tensor whose shape was transposed in
    the header (byte size unchanged, so only a loader that checks shapes
    against config.json notices), an index that names a shard that is absent;
  - the SmolLM2 GGUF: truncated to half, bad magic, one tensor's dims
    transposed in the header (same element and byte count), one tensor
    renamed in the header (so a tensor the architecture needs is absent);
  - a random EAGLE-3 head (tools/eagle3/make_random_head.py --seed 1) edited
    to expect another target hidden size (config + fc.weight) or another
    target vocabulary (config + t2d, with a consistent map);
  - a draft head whose model.safetensors is truncated;
  - an API key file that does not exist, that is a directory, that is empty,
    that the server's user may not read (mode 000; as root the server is
    started as `nobody`, since root reads any file).
The control cases (the intact miniature gets past its weights; the intact
head serves) show that the refusals come from the defects.

Run: python tests/reliability/test_faults.py  (77 = skipped: no binary / model)
"""
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import relutil as R  # noqa: E402

if __name__ == "__main__" and not R.have_binary_and_model():
    print(f"skip: need {R.SPECD} and {R.MODEL}")
    sys.exit(77)

import pytest  # noqa: E402

COMMON = ["--max-model-len", "256", "--kv-cache-memory", "32M", "--threads", "1"]
TRUNCATED = ["truncated", "beyond", "past the end", "past the", "out of bounds", "outside", "short"]
EXIT_LIMIT_S = 300  # loading SmolLM2 under load takes ~10 s; generous for a loaded CI machine


def start_expect_fail(model, extra=(), limit=EXIT_LIMIT_S, preexec_fn=None):
    """Runs specd serve; returns (exit code, combined output, port). Polls /health while it runs."""
    port = R.free_port()
    args = [R.SPECD, "serve", model, "--port", str(port), *COMMON, *extra]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=preexec_fn)
    healthy = False
    deadline = time.time() + limit
    while p.poll() is None and time.time() < deadline:
        try:
            healthy |= R.sp.http_request(port, "GET", "/health", timeout=2)[0] == 200
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.2)
    if p.poll() is None:
        p.kill()
        out = p.communicate()[0].decode(errors="replace")
        raise AssertionError(f"specd did not exit within {limit} s: {out[-2000:]}")
    out = p.communicate()[0].decode(errors="replace")
    assert not healthy, "/health answered 200 before the refusal"
    assert "serving model" not in out, out[-2000:]
    assert R.port_is_free(port), f"port {port} still bound after exit"
    return p.returncode, out, port


def assert_refused(model, extra, must_name, keywords, preexec_fn=None):
    rc, out, _ = start_expect_fail(model, extra, preexec_fn=preexec_fn)
    assert rc != 0, f"exit code 0 for a broken input: {out[-2000:]}"
    last = "\n".join(ln for ln in out.splitlines() if "specd serve" in ln or "ERROR" in ln)
    assert must_name in last, f"message does not name {must_name!r}:\n{out[-2000:]}"
    low = last.lower()
    assert any(k in low for k in keywords), f"message does not say the problem ({keywords}):\n{out[-2000:]}"
    return last


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tmp():
    d = tempfile.mkdtemp(prefix="specd_faults_")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def kimi(tmp):
    out = os.path.join(tmp, "kimi")
    r = subprocess.run([R.PYTHON, os.path.join(R.SRC, "tools/kimi/make_mini.py"), "--seed", "0", "--out", out],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("make_mini.py failed: " + r.stderr[-300:])
    return out


def kimi_copy(kimi, tmp, name):
    d = os.path.join(tmp, name)
    shutil.copytree(kimi, d)
    return d


SHARD2 = "model-00002-of-00004.safetensors"
SHARD4 = "model-00004-of-00004.safetensors"


# ------------------------------------------------------------------ target model
def test_kimi_intact_gets_past_its_weights(kimi):
    """Control: the intact miniature's weights load. (specd serve does not yet read a tiktoken.model
    directory's tokenizer, so today it stops after the weights; once it does, the miniature serves.)"""
    try:
        s = R.Server(kimi, COMMON, ready_timeout=EXIT_LIMIT_S)
    except RuntimeError as e:
        assert f"model {kimi}" in str(e) and "6 layers" in str(e), str(e)[-2000:]
        assert "safetensors" not in str(e).split("ERROR", 1)[-1], str(e)[-2000:]
        return
    assert s.stop() == 0


def test_kimi_missing_shard(kimi, tmp):
    d = kimi_copy(kimi, tmp, "missing")
    os.unlink(os.path.join(d, SHARD2))
    assert_refused(d, [], SHARD2, ["no such file", "missing", "cannot open", "not found"])


def test_kimi_truncated_shard(kimi, tmp):
    d = kimi_copy(kimi, tmp, "truncated")
    p = os.path.join(d, SHARD4)
    os.truncate(p, os.path.getsize(p) // 2)
    assert_refused(d, [], SHARD4, TRUNCATED)


def test_kimi_wrong_shape_tensor(kimi, tmp):
    d = kimi_copy(kimi, tmp, "shape")
    p = os.path.join(d, SHARD2)
    tensors, meta = R.st_tensors(p)
    name = "language_model.model.layers.2.self_attn.q_a_proj.weight"
    dt, shape, raw = tensors[name]
    assert shape == [64, 128]
    tensors[name] = (dt, [128, 64], raw)  # same bytes, transposed shape
    R.st_write(p, tensors, meta)
    assert_refused(d, [], "q_a_proj", ["shape", "expected", "dims", "mismatch"])


def test_kimi_index_names_absent_shard(kimi, tmp):
    d = kimi_copy(kimi, tmp, "index")
    p = os.path.join(d, "model.safetensors.index.json")
    with open(p) as f:
        txt = f.read()
    with open(p, "w") as f:
        f.write(txt.replace(SHARD2, "model-00009-of-00004.safetensors"))
    assert_refused(d, [], "model-00009-of-00004.safetensors", ["no such file", "missing", "cannot open", "not found"])


def test_gguf_truncated(tmp):
    p = os.path.join(tmp, "trunc.gguf")
    with open(R.MODEL, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(os.path.getsize(R.MODEL) // 2))
    assert_refused(p, [], "trunc.gguf", TRUNCATED)


def test_gguf_bad_magic(tmp):
    p = os.path.join(tmp, "magic.gguf")
    with open(R.MODEL, "rb") as src, open(p, "wb") as dst:
        dst.write(b"GGML" + src.read(1 << 20)[4:])
    assert_refused(p, [], "magic.gguf", ["magic", "not a gguf"])


GGUF_K = "blk.2.attn_k.weight"  # SmolLM2: Q4_1 [576, 192] (ne0 = 576 = hidden, ne1 = 192 = 3 kv heads x 64)


def test_gguf_wrong_shape_tensor(tmp):
    """attn_k's dims transposed in the header: [192, 576] has the same element count and Q4_1 byte count
    (192 is a multiple of the 32-element block), so only a shape check against the metadata sees it."""
    p = os.path.join(tmp, "shape.gguf")
    old = R.gguf_copy_edited(R.MODEL, p, GGUF_K, dims=[192, 576])
    assert old == [576, 192], old
    msg = assert_refused(p, [], "shape.gguf", ["shape", "expected"])
    assert GGUF_K in msg and "[192, 576]" in msg and "[576, 192]" in msg, msg


def test_gguf_tensor_missing(tmp):
    """attn_k of layer 2 renamed (same length) in the header: the architecture needs a tensor that is absent."""
    p = os.path.join(tmp, "missing_tensor.gguf")
    R.gguf_copy_edited(R.MODEL, p, GGUF_K, new_name="blk.2.attn_x.weight")
    msg = assert_refused(p, [], "missing_tensor.gguf", ["missing", "not found", "absent"])
    assert GGUF_K in msg, msg


def test_model_path_absent(tmp):
    p = os.path.join(tmp, "nothing-here.gguf")
    assert_refused(p, [], "nothing-here.gguf", ["no such file", "not readable", "cannot open", "not found"])


# ------------------------------------------------------------------ draft head
@pytest.fixture(scope="module")
def head(tmp):
    out = os.path.join(tmp, "head")
    try:
        R.make_random_head(out, seed=1)
    except RuntimeError as e:
        pytest.skip(str(e))
    return out


def edit_head(head, tmp, name, config_edit, tensor_edit):
    d = os.path.join(tmp, name)
    shutil.copytree(head, d)
    import json
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    config_edit(c)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    p = os.path.join(d, "model.safetensors")
    tensors, meta = R.st_tensors(p)
    tensor_edit(tensors)
    R.st_write(p, tensors, meta)
    return d


def test_draft_intact_serves(head):
    s = R.Server(R.MODEL, [*COMMON, "--draft", head, "--num-speculative-tokens", "2"])
    try:
        st, data, _ = s.raw("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert st == 200, data
    finally:
        assert s.stop() == 0, s.read_log()


def test_draft_hidden_size_mismatch(head, tmp):
    """A head trained for a 960-wide target (SmolLM2-360M): config and fc.weight agree with each other, not with us."""
    def cfg(c):
        c["target_hidden_size"] = 960

    def ten(t):
        dt, shape, _ = t["fc.weight"]
        t["fc.weight"] = (dt, [576, 3 * 960], bytes(576 * 3 * 960 * 2))

    d = edit_head(head, tmp, "head_hidden", cfg, ten)
    msg = assert_refused(R.MODEL, ["--draft", d], "head_hidden", ["hidden", "960"])
    assert "960" in msg and "576" in msg, msg


def test_draft_vocab_mismatch(head, tmp):
    """A head for a 32768-token target: identity d2t onto ids 0..31999 and a matching t2d (valid on its own)."""
    V = 32768

    def cfg(c):
        c["transformer_layer_config"]["vocab_size"] = V

    def ten(t):
        t["d2t"] = ("I64", [32000], bytes(32000 * 8))
        t["t2d"] = ("BOOL", [V], b"\x01" * 32000 + b"\x00" * (V - 32000))

    d = edit_head(head, tmp, "head_vocab", cfg, ten)
    msg = assert_refused(R.MODEL, ["--draft", d], "head_vocab", ["vocab"])
    assert "32768" in msg and "49152" in msg, msg


def test_draft_truncated(head, tmp):
    d = os.path.join(tmp, "head_trunc")
    shutil.copytree(head, d)
    p = os.path.join(d, "model.safetensors")
    os.truncate(p, os.path.getsize(p) // 2)
    msg = assert_refused(R.MODEL, ["--draft", d], "model.safetensors", TRUNCATED)
    assert "head_trunc" in msg, msg


def test_draft_dir_absent(tmp):
    d = os.path.join(tmp, "no-head")
    assert_refused(R.MODEL, ["--draft", d], "no-head", ["no such", "not a directory", "cannot", "not found"])


# ------------------------------------------------------------------ API key file
def test_api_key_file_absent(tmp):
    p = os.path.join(tmp, "absent.key")
    assert_refused(R.MODEL, ["--api-key-file", p], "absent.key", ["no such file", "cannot", "not readable"])


def test_api_key_file_is_directory(tmp):
    p = os.path.join(tmp, "dir.key")
    os.mkdir(p)
    assert_refused(R.MODEL, ["--api-key-file", p], "dir.key", ["directory", "cannot", "not readable", "not a"])


def test_api_key_file_empty(tmp):
    p = os.path.join(tmp, "empty.key")
    open(p, "w").close()
    assert_refused(R.MODEL, ["--api-key-file", p], "empty.key", ["empty", "no key"])


def test_api_key_file_unreadable(tmp):
    """Mode 000. Root reads any file, so as root the server runs as nobody (the model and binary are
    world-readable in a normal checkout; the test skips if nobody cannot read them)."""
    d = os.path.join(tmp, "keys")
    os.mkdir(d)
    os.chmod(d, 0o755)
    p = os.path.join(d, "secret.key")
    with open(p, "w") as f:
        f.write("sk-unreadable\n")
    os.chmod(p, 0o000)
    preexec = None
    if os.geteuid() == 0:
        import pwd
        try:
            nobody = pwd.getpwnam("nobody")
        except KeyError:
            pytest.skip("root and no user 'nobody' to drop to")
        for need, bit in ((R.SPECD, 0o001), (R.MODEL, 0o004)):  # others may execute the binary, read the model
            parts = os.path.realpath(need).split(os.sep)
            for i in range(2, len(parts) + 1):
                m = os.stat(os.sep.join(parts[:i])).st_mode
                if not m & (0o001 if i < len(parts) else bit):  # every folder on the way searchable
                    pytest.skip(f"nobody cannot reach {need}")
        for parent in (tmp,):  # tmp is mkdtemp's 0700
            os.chmod(parent, 0o755)

        def preexec():
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
    msg = assert_refused(R.MODEL, ["--api-key-file", p], "secret.key", ["permission denied", "cannot open"],
                         preexec_fn=preexec)
    assert "permission denied" in msg.lower(), msg


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
