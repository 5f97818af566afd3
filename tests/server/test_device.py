"""Device selection of `specd serve` / `specd generate` (--device auto|cpu|cuda, issue 17).

On a machine where the CUDA probe (kernels/kn.h kn_probe) fails -- no driver,
no device, or a binary built without CUDA -- this checks:
  - `serve --device cuda` exits non-zero within seconds, and its output names
    the reason: "--device cuda: no usable GPU: <kn_probe's reason>";
  - `generate --device cuda` (same bundle code) and `serve --check-config
    --device cuda` refuse the same way (check-config passes with auto);
  - `serve` with the default device (auto) logs exactly ONE line
    "device auto: cpu (no usable GPU: <reason>)" and then serves a completion
    (200, non-empty text), and `--device cpu` logs no such line;
  - `--device cuda` with a draft head names the same reason.
On a machine with a usable GPU it checks instead that auto picks cuda (the
"cuda plan:" line) with a draft head on a CPU backend next to it, and serves.
Exit 77 when the binary or the model is missing.
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402

if not sp.have_specd_and_model():
    print(f"skip: need {sp.SPECD} and {sp.MODEL}")
    sys.exit(77)

COMMON = ["--max-model-len", "256", "--kv-cache-memory", "64M", "--threads", "1"]
GPU_REASON = re.compile(r"--device cuda: no usable GPU: (\S.*)")


def run(*args, timeout=120):
    p = subprocess.run([sp.SPECD, *args], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    return p.returncode, p.stdout + p.stderr


def main():
    head = os.path.join(tempfile.mkdtemp(prefix="specd_dev_"), "head")
    sp.make_random_head(head)
    # --check-config --device cuda probes the GPU: refused without one
    rc, out = run("serve", sp.MODEL, "--device", "cuda", "--check-config", *COMMON)
    m = GPU_REASON.search(out)
    gpu = rc == 0
    if not gpu:
        assert m, f"--check-config --device cuda without a GPU must name the reason: {rc} {out[-2000:]}"
        reason = m.group(1).strip()
        rc, out = run("serve", sp.MODEL, "--port", str(sp.free_port()), "--device", "cuda", *COMMON)
        m = GPU_REASON.search(out)
        assert rc != 0, f"--device cuda without a GPU must exit non-zero, got {rc}: {out[-2000:]}"
        assert m and len(m.group(1)) > 10, f"the refusal must name kn_probe's reason: {out[-2000:]}"
        assert m.group(1).strip() == reason, (m.group(1), reason)
        print(f"serve --device cuda: exit {rc}, reason: {reason}")
        rc, out = run("serve", sp.MODEL, "--port", str(sp.free_port()), "--device", "cuda", "--draft", head, *COMMON)
        assert rc != 0 and GPU_REASON.search(out), f"--device cuda --draft: {rc} {out[-2000:]}"
        rc, out = run("serve", sp.MODEL, "--check-config", *COMMON)
        assert rc == 0, f"--check-config with the default device (auto) must pass: {rc} {out[-2000:]}"
        rc, out = run("generate", sp.MODEL, "--prompt", "Hi", "--max-tokens", "2", "--device", "cuda", *COMMON)
        assert rc != 0 and GPU_REASON.search(out), f"generate --device cuda: {rc} {out[-2000:]}"
        srv = sp.Server(COMMON)  # default device: auto
        try:
            st, body = srv.post("/v1/completions", {"model": os.path.basename(sp.MODEL)[:-5], "prompt": "The sky is",
                                                    "max_tokens": 4, "temperature": 0})
            assert st == 200 and body["choices"][0]["text"], (st, body)
            log = srv.read_log(100000)
        finally:
            assert srv.stop() == 0
        lines = [ln for ln in log.splitlines() if "device auto:" in ln]
        assert len(lines) == 1, f"auto must log exactly one device line, got {lines}"
        assert "device auto: cpu (no usable GPU: " in lines[0] and reason.split(" (")[0] in lines[0], lines[0]
        print(f"auto: served on cpu; log: {lines[0].split(' INFO ')[-1]}")
        srv = sp.Server(["--device", "cpu", *COMMON])
        try:
            log = srv.read_log(100000)
        finally:
            assert srv.stop() == 0
        assert "device auto:" not in log and "backend: cpu" in log, log[-2000:]
    else:
        print("a usable GPU is present: checking the GPU side")
        srv = sp.Server(["--draft", head, *COMMON])  # auto: cuda target, the draft on a CPU backend
        try:
            st, body = srv.post("/v1/completions", {"model": os.path.basename(sp.MODEL)[:-5], "prompt": "The sky is",
                                                    "max_tokens": 4, "temperature": 0})
            assert st == 200 and body["choices"][0]["text"], (st, body)
            log = srv.read_log(100000)
            assert "cuda plan:" in log and "draft: on the CPU backend" in log, log[-3000:]
        finally:
            assert srv.stop() == 0
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
