"""deploy_common.py: helpers shared by the tests of deploy/ (issue 9).

Owns: locating the source tree and the built binaries, reading a systemd unit
file and an EnvironmentFile the way systemd does for the subset deploy/ uses
(sections, repeated keys, line continuations; KEY=VALUE lines with optional
quotes), systemd time spans, the SPECD_* names `specd serve --help` prints, and
a snapshot of a directory tree for before/after comparisons.

Python stdlib only (CI runs these with the project venv). Tests that cannot
run print why and exit 77.
"""
import hashlib
import os
import re
import subprocess
import sys

SRC = os.environ.get("SPECD_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("SPECD_BUILD_DIR", "")
SPECD = os.path.join(BUILD, "server", "specd")
BENCH = os.path.join(BUILD, "bench", "specd-bench")
MODEL = os.environ.get("SPECD_MODEL_GGUF", "")
DEPLOY = os.path.join(SRC, "deploy")
UNIT = os.path.join(DEPLOY, "specd.service")
ENV_DIR = os.path.join(DEPLOY, "env")


def skip(reason):
    print("skip:", reason)
    sys.exit(77)


def need_specd():
    if not os.access(SPECD, os.X_OK):
        skip(f"{SPECD} is not built")


def read_unit(path):
    """Returns {section: [(key, value), ...]} in file order (keys may repeat)."""
    out, sec, pending = {}, None, ""
    with open(path) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if pending:
                line = pending + line.lstrip()
                pending = ""
            s = line.strip()
            if not s or s[0] in "#;":
                continue
            if s.endswith("\\"):
                pending = s[:-1] + " "
                continue
            if s.startswith("[") and s.endswith("]"):
                sec = s[1:-1]
                out.setdefault(sec, [])
                continue
            k, _, v = s.partition("=")
            out.setdefault(sec, []).append((k.strip(), v.strip()))
    return out


def unit_get(unit, section, key):
    """All values of KEY in SECTION, in order."""
    return [v for k, v in unit.get(section, []) if k == key]


def unit_one(unit, section, key):
    vals = unit_get(unit, section, key)
    assert len(vals) == 1, f"[{section}] {key}: expected one value, got {vals}"
    return vals[0]


_SPAN = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1, "sec": 1, "second": 1, "seconds": 1,
         "m": 60, "min": 60, "minute": 60, "minutes": 60, "h": 3600, "hr": 3600, "hour": 3600, "hours": 3600,
         "d": 86400, "day": 86400, "days": 86400}


def seconds(span):
    """systemd time span ("180", "15s", "2h", "1h 30min") in seconds."""
    span = span.strip()
    if re.fullmatch(r"\d+(\.\d+)?", span):
        return float(span)
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", span):
        assert unit in _SPAN, f"unknown time unit in {span!r}"
        total += float(num) * _SPAN[unit]
    assert total > 0, f"cannot parse time span {span!r}"
    return total


ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
COMMENTED_ASSIGN = re.compile(r"^#\s*([A-Z_][A-Z0-9_]*)=(.*)$")


def read_env(path):
    """The active KEY=VALUE lines of an EnvironmentFile: [(key, value, lineno)].
    Quotes around a whole value are removed as systemd does."""
    out = []
    with open(path) as f:
        for i, raw in enumerate(f, 1):
            s = raw.strip()
            if not s or s[0] in "#;":
                continue
            m = ASSIGN.match(s)
            assert m, f"{path}:{i}: not KEY=VALUE: {s!r}"
            v = m.group(2)
            if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
                v = v[1:-1]
            out.append((m.group(1), v, i))
    return out


def env_dict(path):
    return {k: v for k, v, _ in read_env(path)}


def help_text():
    r = subprocess.run([SPECD, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def help_env_names(text=None):
    """SPECD_* variables `specd serve --help` lists ([env: SPECD_X])."""
    names = set(re.findall(r"\[env: (SPECD_[A-Z0-9_]+)\]", text or help_text()))
    assert len(names) >= 10, f"--help lists too few env names: {names}"
    return names


def help_flags(text=None):
    return set(re.findall(r"^\s+--([a-z0-9-]+)", text or help_text(), re.M))


def help_default(name, text=None):
    """Default of --NAME as --help prints it, or None."""
    for line in (text or help_text()).splitlines():
        if re.match(rf"^\s+--{re.escape(name)}\b", line):
            m = re.search(r"\[default: ([^\]]*)\]", line)
            return m.group(1) if m else None
    return None


def snapshot(root):
    """{relpath: (kind, mode, size, sha256, mtime_ns)} of every entry under root
    (directories: their mode only, plus the sorted entry list)."""
    snap = {}
    if not os.path.exists(root):
        return snap
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        st = os.lstat(dirpath)
        snap[rel] = ("dir", st.st_mode, tuple(sorted(dirnames + filenames)))
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            st = os.lstat(p)
            h = ""
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    h = hashlib.sha256(f.read()).hexdigest()
            snap[os.path.relpath(p, root)] = ("file", st.st_mode, st.st_size, h, st.st_mtime_ns)
    return snap


def diff_snapshots(a, b):
    lines = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            lines.append(f"{k}: {a.get(k)} -> {b.get(k)}")
    return lines
