#!/usr/bin/env python3
"""test_load_server.py: `specd serve` on the Kimi miniature (wide8) at --tensor-parallel-size 2 with
--load-threads 3 reports each rank's load in /metrics and in its start-up log line:

    specd_rank_load_read_bytes{rank}  == the bytes the rank's slices take in the files, counted from the
                                         safetensors headers here (test_load_bytes.py's rules)
    specd_rank_load_file_bytes{rank}  == the size of the checkpoint's files
    specd_rank_load_seconds{rank}     > 0
    log: "rank R/2: loaded X GB in Y s (Z GB/s), read A GB of B GB in files" for both ranks, A and B
         the same bytes (to the printed 3 decimals of a GB)

Needs the specd binary and the kimi_c_mini fixture; skips (77) without them.
"""
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "pyutil"))
sys.path.insert(0, HERE)
import specd_server as sp  # noqa: E402
import test_load_bytes as lb  # noqa: E402


def main():
    root = os.environ.get("KIMI_C_MINI_DIR")
    d = os.path.join(root or "(unset)", "wide8")
    if not os.path.isfile(sp.SPECD) or not os.path.isfile(os.path.join(d, "config.json")):
        print(f"SKIP: need {sp.SPECD} and the Kimi miniature at {d}")
        return 77
    cfg = __import__("json").load(open(os.path.join(d, "config.json")))
    t, total = lb.headers(d)
    want = lb.expected_dsv3(t, cfg, 2)
    s = sp.Server(["--device", "cpu", "--tensor-parallel-size", "2", "--load-threads", "3", "--threads", "1",
                   "--served-model-name", "kimi-mini", "--max-model-len", "256", "--kv-cache-memory", "32M"], model=d)
    fails = 0
    try:
        m = s.metrics()
        log = s.read_log(200000)
    finally:
        s.stop()
    for r in range(2):
        got = m.get(f'specd_rank_load_read_bytes{{rank="{r}"}}')
        files = m.get(f'specd_rank_load_file_bytes{{rank="{r}"}}')
        secs = m.get(f'specd_rank_load_seconds{{rank="{r}"}}')
        ok = got == want and files == total and secs is not None and secs > 0
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} rank {r}: /metrics read {got} (expected {want}), files {files} "
              f"({total}), {secs} s")
        line = re.search(rf"rank {r}/2: loaded ([0-9.]+) GB in ([0-9.]+) s \(([0-9.]+) GB/s\), read ([0-9.]+) GB "
                         rf"of ([0-9.]+) GB in files", log)
        ok = bool(line) and abs(float(line.group(4)) - want * 1e-9) < 6e-4 and abs(float(line.group(5)) - total * 1e-9) < 6e-4
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} rank {r} log: {line.group(0) if line else 'no load line'}")
    if fails:
        print(log[-3000:])
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
