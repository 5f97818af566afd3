#!/usr/bin/env python3
"""specd-bench against the real specd server serving SmolLM2 (small counts).

Starts `$SPECD_BUILD_DIR/server/specd serve $SPECD_MODEL_GGUF --port <free>`,
waits for GET /health 200, runs specd-bench twice (chat and completions,
streaming, concurrency 2) with --save-result, and checks the numbers against
the server's own accounting, read from /metrics by this script with its own
parser: the benchmark's total output tokens (summed from usage) equal the
difference of the server's *generation_tokens_total counter over the run, and
its total input tokens equal the *prompt_tokens_total difference; with
ignore_eos every request produced exactly max_tokens tokens.

Exits 77 (skipped) while the specd binary or the model file does not exist.
"""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util as bu  # noqa: E402

N_PROMPTS = 4
MAX_TOKENS = 8


def main():
    specd, gguf = bu.sp.SPECD, bu.sp.MODEL
    if not os.path.exists(specd):
        bu.skip("the specd server binary %s does not exist yet (build target `specd`)" % specd)
    if not gguf or not os.path.exists(gguf):
        bu.skip("model %r not found (run tools/setup.sh)" % gguf)
    bu.bench_binary()
    tmp = tempfile.mkdtemp(prefix="bench_e2e_")
    # `specd serve MODEL --port P` with the server's defaults (no thread pinning); RuntimeError with the
    # log's tail when it does not become healthy
    srv = bu.sp.Server([], omp_threads=None, ready_timeout=300, log_prefix="bench_e2e_specd_")
    cmd, base = srv.args, srv.base_url
    try:
        for endpoint in ("/v1/chat/completions", "/v1/completions"):
            gen0 = bu.metric_sum(base, "generation_tokens_total")
            prm0 = bu.metric_sum(base, "prompt_tokens_total")
            assert gen0 is not None, "server /metrics has no *generation_tokens_total counter"
            out = os.path.join(tmp, "result%s.json" % endpoint.replace("/", "_"))
            p = bu.run_bench(["--base-url", base, "--endpoint", endpoint, "--dataset-name", "random",
                              "--random-input-len", "16", "--num-prompts", str(N_PROMPTS), "--max-tokens",
                              str(MAX_TOKENS), "--ignore-eos", "--max-concurrency", "2", "--seed", "3",
                              "--server-cmd", " ".join(cmd), "--save-result", "--result-filename", out],
                             timeout=600)
            assert p.returncode == 0, "specd-bench exited %d" % p.returncode
            r = bu.load(out)
            # /metrics is scraped, not transactional: allow the server a moment to publish
            # the counters of the last step after it sent the last usage chunk
            for attempt in range(100):
                gen1 = bu.metric_sum(base, "generation_tokens_total")
                prm1 = bu.metric_sum(base, "prompt_tokens_total")
                if gen1 - gen0 >= r["total_output_tokens"]:
                    break
                time.sleep(0.1)
            if attempt:
                print("note: /metrics lagged the last usage chunk by ~%d ms" % (attempt * 100))
            assert r["completed"] == N_PROMPTS and r["failed"] == 0, r["failure_reasons"]
            assert r["total_output_tokens"] == gen1 - gen0, (endpoint, r["total_output_tokens"], gen1 - gen0)
            if prm0 is not None:
                assert r["total_input_tokens"] == prm1 - prm0, (endpoint, r["total_input_tokens"], prm1 - prm0)
            assert r["output_lens"] == [MAX_TOKENS] * N_PROMPTS, r["output_lens"]
            assert r["server_generation_tokens"] == r["total_output_tokens"]
            assert r["server_cmd"] == " ".join(cmd)
            assert r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0 and r["output_throughput"] > 0
            print("%s: %d output tokens = server counter difference; %.1f tok/s, TPOT %.1f ms"
                  % (endpoint, r["total_output_tokens"], r["output_throughput"], r["mean_tpot_ms"]))
        print("PASS")
    finally:
        srv.stop(timeout=60)


if __name__ == "__main__":
    main()
