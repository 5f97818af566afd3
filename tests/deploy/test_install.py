"""deploy_install: deploy/install.sh and uninstall.sh in a temporary --root,
no root privileges needed (--root implies no user, no chown, no systemctl).

- --dry-run changes nothing: a snapshot (paths, modes, sizes, sha256, mtimes)
  of the root before and after is identical, for an empty root and for an
  installed one with an upgrade pending; the build directory it would build
  into is not created; every action is printed ("+ install ...", "+ cmake ...").
- A real install puts exactly the promised files in place: the binaries are
  byte copies of the build's and run; the unit and env file are the sources
  with /usr/local -> prefix; the API key is 64 hex digits, mode 0640.
- Idempotent: a second run changes nothing (snapshot equal, no "+" action);
  an edited /etc/specd/specd.env survives reinstalls.
- Upgrade keeps the replaced binary as *.prev; --rollback swaps them back;
  rolling back twice rolls forward.
- --prefix /opt/specd: the unit's ExecStart and the env file's head path follow.
- Both scripts pass `bash -n` (and shellcheck where installed).
- uninstall.sh --dry-run changes nothing; uninstall.sh leaves only
  /etc/specd/specd.env and /etc/specd/api-key (plus shared directories that
  existed: PREFIX/bin, etc/systemd/system ...); --purge leaves no file.
"""
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import deploy_common as dc

dc.need_specd()
if not os.access(dc.BENCH, os.X_OK):
    dc.skip(f"{dc.BENCH} is not built")
INSTALL = os.path.join(dc.DEPLOY, "install.sh")
UNINSTALL = os.path.join(dc.DEPLOY, "uninstall.sh")


def run(script, *args, ok=True):
    r = subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=300)
    if ok:
        assert r.returncode == 0, f"{os.path.basename(script)} {' '.join(args)}: rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def actions(out):
    return [ln for ln in out.splitlines() if ln.startswith("+ ")]


def read(p, mode="r"):
    with open(p, mode) as f:
        return f.read()


def files_under(root):
    out = set()
    for d, _, fs in os.walk(root):
        for f in fs:
            out.add(os.path.relpath(os.path.join(d, f), root))
    return out


def fake_build(tmp, tag):
    """A build dir whose binaries differ from the real ones (bytes appended to
    an ELF keep it runnable)."""
    b = os.path.join(tmp, "build-" + tag)
    for sub, src in (("server", dc.SPECD), ("bench", dc.BENCH)):
        os.makedirs(os.path.join(b, sub), exist_ok=True)
        dst = os.path.join(b, sub, os.path.basename(src))
        shutil.copy2(src, dst)
        with open(dst, "ab") as f:
            f.write(b"\0specd-test-" + tag.encode())
    return b


def lint():
    for script in (INSTALL, UNINSTALL):
        r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        if shutil.which("shellcheck"):
            r = subprocess.run(["shellcheck", script], capture_output=True, text=True)
            assert r.returncode == 0, r.stdout
    print("bash -n" + (" and shellcheck" if shutil.which("shellcheck") else " (no shellcheck here)") + ": clean")


def main():
    lint()
    build = os.path.abspath(dc.BUILD)
    tmp = tempfile.mkdtemp(prefix="deploy_install_")
    try:
        root = os.path.join(tmp, "root")
        os.mkdir(root)
        base = ["--root", root, "--no-build", "--build-dir", build]

        # ---- dry run on an empty root, and with the build step ----
        before = dc.snapshot(root)
        r = run(INSTALL, *base, "--dry-run")
        assert dc.snapshot(root) == before, dc.diff_snapshots(before, dc.snapshot(root))
        acts = actions(r.stdout)
        for want in ("/usr/local/bin/specd", "/usr/local/bin/specd-bench", "/etc/systemd/system/specd.service",
                     "/etc/specd/specd.env", "/etc/specd/api-key", "/var/lib/specd/models"):
            assert any(want in a for a in acts), f"dry run does not mention {want}:\n{r.stdout}"
        nb = os.path.join(tmp, "never-built")
        r = run(INSTALL, "--root", root, "--build-dir", nb, "--dry-run", "--jobs", "1")
        assert any(a.startswith("+ cmake -S") for a in actions(r.stdout)), r.stdout
        assert any(a.startswith("+ cmake --build") for a in actions(r.stdout)), r.stdout
        assert not os.path.exists(nb), "dry run built"
        assert dc.snapshot(root) == before
        print(f"dry run: {len(acts)} actions printed, nothing changed")

        # ---- real install ----
        r = run(INSTALL, *base)
        P = os.path.join(root, "usr/local")
        for b, src in (("specd", dc.SPECD), ("specd-bench", dc.BENCH)):
            p = os.path.join(P, "bin", b)
            assert read(p, "rb") == read(src, "rb"), b
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o755
            assert not os.path.exists(p + ".prev")
        v = subprocess.run([os.path.join(P, "bin/specd"), "--version"], capture_output=True, text=True)
        assert v.returncode == 0 and v.stdout.startswith("specd "), v
        unit = os.path.join(root, "etc/systemd/system/specd.service")
        assert read(unit) == read(dc.UNIT)
        env = os.path.join(root, "etc/specd/specd.env")
        assert read(env) == read(os.path.join(dc.ENV_DIR, "smollm2-cpu.env"))
        assert stat.S_IMODE(os.stat(env).st_mode) == 0o640
        key = os.path.join(root, "etc/specd/api-key")
        k = read(key)
        assert len(k) == 65 and k.endswith("\n") and all(c in "0123456789abcdef" for c in k[:64]), repr(k)
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o640
        for d, mode in (("etc/specd", 0o750), ("var/lib/specd", 0o750), ("var/lib/specd/models", 0o750)):
            assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == mode, d
        for e in os.listdir(dc.ENV_DIR):
            assert read(os.path.join(P, "share/specd/env", e)) == read(os.path.join(dc.ENV_DIR, e))
        assert read(os.path.join(P, "share/doc/specd/README.md")) == read(os.path.join(dc.DEPLOY, "README.md"))
        heads = os.path.join(dc.SRC, "draft", "heads")
        if os.path.isdir(heads):
            for f in files_under(heads):
                assert read(os.path.join(P, "share/specd/heads", f), "rb") == read(os.path.join(heads, f), "rb"), f
            print(f"draft heads installed: {len(files_under(heads))} files")
        print(f"install: {len(actions(r.stdout))} actions, files as promised")

        # ---- idempotent ----
        snap1 = dc.snapshot(root)
        r = run(INSTALL, *base)
        assert dc.snapshot(root) == snap1, dc.diff_snapshots(snap1, dc.snapshot(root))
        assert actions(r.stdout) == [], r.stdout
        # an edited env file and key survive
        with open(env, "a") as f:
            f.write("# edited by the operator\n")
        edited = read(env)
        run(INSTALL, *base)
        assert read(env) == edited and read(key) == k
        print("second install: no action, operator's env file kept")

        # ---- upgrade, dry run of it, rollback ----
        new = fake_build(tmp, "v2")
        snap2 = dc.snapshot(root)
        r = run(INSTALL, "--root", root, "--no-build", "--build-dir", new, "--dry-run")
        assert dc.snapshot(root) == snap2, dc.diff_snapshots(snap2, dc.snapshot(root))
        assert any("specd.prev" in a for a in actions(r.stdout)), r.stdout
        run(INSTALL, "--root", root, "--no-build", "--build-dir", new)
        old_b, new_b = read(dc.SPECD, "rb"), read(os.path.join(new, "server/specd"), "rb")
        assert read(os.path.join(P, "bin/specd"), "rb") == new_b
        assert read(os.path.join(P, "bin/specd.prev"), "rb") == old_b
        assert read(os.path.join(P, "bin/specd-bench.prev"), "rb") == read(dc.BENCH, "rb")
        v = subprocess.run([os.path.join(P, "bin/specd"), "--version"], capture_output=True, text=True)
        assert v.returncode == 0, v
        run(INSTALL, "--root", root, "--rollback")
        assert read(os.path.join(P, "bin/specd"), "rb") == old_b
        assert read(os.path.join(P, "bin/specd.prev"), "rb") == new_b
        run(INSTALL, "--root", root, "--rollback")
        assert read(os.path.join(P, "bin/specd"), "rb") == new_b
        print("upgrade kept specd.prev; rollback and roll-forward swap them")

        # ---- uninstall ----
        snap3 = dc.snapshot(root)
        r = run(UNINSTALL, "--root", root, "--dry-run")
        assert dc.snapshot(root) == snap3, dc.diff_snapshots(snap3, dc.snapshot(root))
        assert any("bin/specd" in a for a in actions(r.stdout)), r.stdout
        run(UNINSTALL, "--root", root)
        left = files_under(root)
        assert left == {"etc/specd/specd.env", "etc/specd/api-key"}, left
        assert read(env) == edited and read(key) == k
        shared = {".", "usr", "usr/local", "usr/local/bin", "usr/local/share", "usr/local/share/doc", "etc",
                  "etc/systemd", "etc/systemd/system", "etc/specd", "var", "var/lib"}
        dirs = {rel for rel, v in dc.snapshot(root).items() if v[0] == "dir"}
        assert dirs <= shared, dirs - shared
        print("uninstall: kept", sorted(left))
        # reinstall picks the kept configuration up, --purge removes everything
        run(INSTALL, *base)
        assert read(env) == edited and read(key) == k
        run(UNINSTALL, "--root", root, "--purge")
        assert files_under(root) == set(), files_under(root)
        dirs = {rel for rel, v in dc.snapshot(root).items() if v[0] == "dir"}
        assert dirs <= shared - {"etc/specd"}, dirs
        print("uninstall --purge: no file left")

        # ---- another prefix ----
        root2 = os.path.join(tmp, "root2")
        run(INSTALL, "--root", root2, "--prefix", "/opt/specd", "--no-build", "--build-dir", build,
            "--env", "kimi-k25-8gpu")
        u = dc.read_unit(os.path.join(root2, "etc/systemd/system/specd.service"))
        assert dc.unit_one(u, "Service", "ExecStart") == "/opt/specd/bin/specd serve ${SPECD_MODEL}"
        assert "/usr/local" not in read(os.path.join(root2, "etc/systemd/system/specd.service"))
        e2 = dc.env_dict(os.path.join(root2, "etc/specd/specd.env"))
        assert e2 == dc.env_dict(os.path.join(dc.ENV_DIR, "kimi-k25-8gpu.env")), "kimi env has no prefix paths"
        assert os.access(os.path.join(root2, "opt/specd/bin/specd"), os.X_OK)
        run(UNINSTALL, "--root", root2, "--prefix", "/opt/specd", "--purge")
        assert files_under(root2) == set(), files_under(root2)
        root3 = os.path.join(tmp, "root3")
        run(INSTALL, "--root", root3, "--prefix", "/opt/specd", "--no-build", "--build-dir", build)
        e3 = dc.env_dict(os.path.join(root3, "etc/specd/specd.env"))
        assert e3["SPECD_DRAFT"] == "/opt/specd/share/specd/heads/smollm2-135m-eagle3", e3["SPECD_DRAFT"]
        print("--prefix /opt/specd: unit and env file follow")

        # ---- refusals ----
        r = run(INSTALL, "--root", root3, "--env", "no-such-env", "--no-build", "--build-dir", build, ok=False)
        assert r.returncode == 2 and "no env file" in r.stderr, r
        r = run(INSTALL, "--root", os.path.join(tmp, "r4"), "--no-build", "--build-dir", nb, ok=False)
        assert r.returncode == 1 and "missing" in r.stderr, r
        r = run(INSTALL, "--root", root3, "--rollback", ok=False)
        assert r.returncode == 1 and "nothing to roll back" in r.stderr, r
        r = run(INSTALL, "--bogus", ok=False)
        assert r.returncode == 2, r
        print("deploy_install: ok")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
