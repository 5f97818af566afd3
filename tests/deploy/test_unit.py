"""deploy_unit: deploy/specd.service is a unit systemd accepts without a single
warning, and it carries the settings issue 9 requires.

- `systemd-analyze verify` on a temporary copy whose /usr/local/bin/specd is
  the built binary (verify refuses a command path that does not exist). verify
  exits 0 even for unknown keys or unparsable values (it only warns), so any
  line of its output that names the unit fails the test; a negative control
  (the same unit with a misspelt key and a bad time span) must produce such
  lines, which proves the check can fail.
- TimeoutStopSec stays above every env file's SPECD_SHUTDOWN_TIMEOUT (or the
  --help default) + 30 s: the drain must never be SIGKILLed.
- TimeoutStartSec covers a 595 GB checkpoint read at 500 MB/s with 2x margin.
- The settings of issue 9 are present with the intended values.
Skips (77) without systemd-analyze or the built binary.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import deploy_common as dc

dc.need_specd()
if not shutil.which("systemd-analyze"):
    dc.skip("systemd-analyze is not installed")


def verify(text, tmp, name="specd.service"):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(text)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", path], capture_output=True, text=True, timeout=60)
    out = (r.stdout + r.stderr).strip().splitlines()
    ours = [line for line in out if name in line or path in line]
    others = [line for line in out if line not in ours]
    return r.returncode, ours, others


def main():
    with open(dc.UNIT) as f:
        text = f.read()
    assert "/usr/local/bin/specd " in text, "ExecStart must name /usr/local/bin/specd (install.sh rewrites the prefix)"
    real = text.replace("/usr/local/bin/specd", os.path.abspath(dc.SPECD))
    with tempfile.TemporaryDirectory(prefix="deploy_unit_") as tmp:
        rc, ours, others = verify(real, tmp)
        for line in others:
            print("note (not about the unit):", line)
        assert rc == 0 and not ours, f"systemd-analyze verify: rc {rc}\n" + "\n".join(ours)
        print("systemd-analyze verify: clean")
        # negative control: the same check sees a misspelt key and a bad value
        bad = real.replace("KillSignal=SIGTERM", "KillSignl=SIGTERM").replace("WatchdogSec=", "WatchdogSec=sixty#")
        with tempfile.TemporaryDirectory(prefix="deploy_unit_bad_") as tmp2:
            rc2, ours2, _ = verify(bad, tmp2)
        assert any("KillSignl" in line for line in ours2), ours2
        assert any("sixty" in line for line in ours2), ours2
        # and a missing binary
        with tempfile.TemporaryDirectory(prefix="deploy_unit_nobin_") as tmp3:
            rc3, ours3, _ = verify(text.replace("/usr/local/bin/specd", "/nonexistent/specd"), tmp3)
        assert rc3 != 0 or ours3, "verify did not notice a missing ExecStart binary"
        print("negative controls: detected")

    u = dc.read_unit(dc.UNIT)
    S = "Service"
    want = {
        "Type": "notify", "NotifyAccess": "main", "EnvironmentFile": "/etc/specd/specd.env",
        "ExecReload": "/bin/kill -HUP $MAINPID", "Restart": "on-failure", "KillSignal": "SIGTERM",
        "User": "specd", "Group": "specd", "UMask": "0077", "LimitMEMLOCK": "infinity",
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectHome": "yes",
        "ProtectKernelTunables": "yes", "DevicePolicy": "closed", "SyslogLevel": "err",
    }
    for k, v in want.items():
        assert dc.unit_one(u, S, k) == v, f"{k}={dc.unit_one(u, S, k)}, want {v}"
    # ExecStart: the one positional argument is ${SPECD_MODEL} (a single word even with spaces);
    # every flag comes from SPECD_* variables, so no flag on the command line would shadow the env file
    assert dc.unit_one(u, S, "ExecStart") == "/usr/local/bin/specd serve ${SPECD_MODEL}"
    assert dc.unit_one(u, S, "ExecStartPre") == "/usr/local/bin/specd serve ${SPECD_MODEL} --check-config"
    assert int(dc.unit_one(u, S, "LimitNOFILE")) >= 4096
    assert dc.unit_get(u, S, "ReadWritePaths"), "ProtectSystem=strict needs explicit ReadWritePaths"
    fams = dc.unit_one(u, S, "RestrictAddressFamilies").split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(fams), fams  # sd_notify, HTTP
    assert dc.unit_get(u, S, "PrivateDevices") in ([], ["no"]), "PrivateDevices hides /dev/nvidia*"
    dev = " ".join(dc.unit_get(u, S, "DeviceAllow"))
    for g in ("char-nvidia-frontend rw", "char-nvidia-uvm rw"):
        assert g in dev, f"DeviceAllow lacks {g}"
    assert dc.unit_get(u, S, "MemoryDenyWriteExecute") in ([], ["no"]), "the CUDA driver needs W+X mappings"
    assert int(dc.unit_one(u, "Unit", "StartLimitBurst")) >= 1
    assert dc.seconds(dc.unit_one(u, "Unit", "StartLimitIntervalSec")) > 0

    wd = dc.seconds(dc.unit_one(u, S, "WatchdogSec"))
    # the server pings every WatchdogSec/2 while its loop ticked within max(WatchdogSec/2, 3 s)
    assert 6 <= wd <= 600, wd
    start = dc.seconds(dc.unit_one(u, S, "TimeoutStartSec"))
    assert start >= 2 * 595e9 / 500e6, f"TimeoutStartSec {start} s < 2 x (595 GB at 500 MB/s)"
    stop = dc.seconds(dc.unit_one(u, S, "TimeoutStopSec"))
    text_help = dc.help_text()
    default_sd = float(dc.help_default("shutdown-timeout", text_help))
    envs = sorted(f for f in os.listdir(dc.ENV_DIR) if f.endswith(".env"))
    assert envs, "no env files"
    for e in envs:
        sd = float(dc.env_dict(os.path.join(dc.ENV_DIR, e)).get("SPECD_SHUTDOWN_TIMEOUT", default_sd))
        assert stop >= sd + 30, f"TimeoutStopSec {stop} s < {e}: SPECD_SHUTDOWN_TIMEOUT {sd} + 30 s"
        print(f"{e}: shutdown timeout {sd:g} s, TimeoutStopSec {stop:g} s")
    print(f"deploy_unit: ok (WatchdogSec {wd:g} s, TimeoutStartSec {start:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
