#!/usr/bin/env python3
"""specd-bench against tools/bench_fake_server.py over real sockets.

The fake server writes SSE in awkward pieces and several tokens per chunk
(like a speculative server) and counts what it emits in Prometheus counters.
Checked here, against the server's own counts (never against specd-bench's
own arithmetic): token totals equal the /metrics differences; acceptance
figures equal the counters' ratios; each request's chunk count is consistent
with its ITL list; latency floors that the server enforces by sleeping (TTFT
>= 40 ms) hold; failures are reported with reasons; chat and completions;
sweeps; --compare; plots when gnuplot exists.
"""
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util as bu  # noqa: E402


def counters(base):
    keys = ["generation_tokens_total", "prompt_tokens_total", "spec_decode_num_drafts_total",
            "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"]
    return {k: bu.metric_sum(base, k) for k in keys}


def main():
    src = os.environ.get("SPECD_SOURCE_DIR", ".")
    bu.bench_binary()
    port = bu.free_port()
    base = "http://127.0.0.1:%d" % port
    srv = subprocess.Popen([sys.executable, os.path.join(src, "tools", "bench_fake_server.py"),
                            "--port", str(port), "--ttft-ms", "40", "--step-ms", "5"])
    tmp = tempfile.mkdtemp(prefix="bench_fake_")
    try:
        bu.wait_health(base, srv, 30)
        # with warm-ups (chat) the test's own difference also holds the warm-up tokens,
        # which specd-bench must leave out of its figures
        for endpoint, warm in (("/v1/chat/completions", True), ("/v1/completions", False)):
            before = counters(base)
            out = os.path.join(tmp, "r%s.json" % endpoint.replace("/", "_"))
            p = bu.run_bench(["--base-url", base, "--endpoint", endpoint, "--dataset-name", "random",
                              "--random-input-len", "30", "--random-output-len", "40", "--random-range-ratio", "0.5",
                              "--num-prompts", "12", "--max-concurrency", "3", "--ignore-eos", "--seed", "7",
                              "--num-warmups", "2" if warm else "0",
                              "--save-result", "--result-filename", out, "--label", endpoint])
            assert p.returncode == 0, p.returncode
            after = counters(base)
            r = bu.load(out)
            d = {k: after[k] - before[k] for k in before}
            assert r["completed"] == 12 and r["failed"] == 0, r["failure_reasons"]
            assert r["server_generation_tokens"] == r["total_output_tokens"]
            assert r["server_prompt_tokens"] == r["total_input_tokens"]
            if warm:
                assert d["generation_tokens_total"] > r["total_output_tokens"], (r["total_output_tokens"], d)
            else:
                assert r["total_output_tokens"] == d["generation_tokens_total"], (r["total_output_tokens"], d)
                assert r["total_input_tokens"] == d["prompt_tokens_total"], (r["total_input_tokens"], d)
            # ignore_eos + random lengths: each request produced exactly its sampled length,
            # in [20, 60] for 40 +- 50%
            assert all(20 <= n <= 60 for n in r["output_lens"]), r["output_lens"]
            assert r["max_concurrent_requests"] <= 3
            if not warm:
                rate = d["spec_decode_num_accepted_tokens_total"] / d["spec_decode_num_draft_tokens_total"]
                alen = 1 + d["spec_decode_num_accepted_tokens_total"] / d["spec_decode_num_drafts_total"]
                assert abs(r["spec_decode_acceptance_rate"] - rate) < 1e-9, (r["spec_decode_acceptance_rate"], rate)
                assert abs(r["spec_decode_acceptance_length"] - alen) < 1e-9
            assert len(r["spec_decode_acceptance_per_position"]) == 3
            # fewer chunks than tokens (several tokens per chunk) and the ITL count is chunks - 1
            n_itl = sum(len(x) for x in r["itls"])
            assert n_itl + 12 < r["total_output_tokens"], (n_itl, r["total_output_tokens"])
            assert min(r["ttfts"]) >= 0.040, min(r["ttfts"])
            assert r["mean_ttft_ms"] >= 40 and r["p99_e2el_ms"] >= r["median_e2el_ms"] >= r["mean_ttft_ms"]
            for k in ("mean_tpot_ms", "median_itl_ms", "p90_ttft_ms", "std_e2el_ms", "request_throughput",
                      "output_throughput", "total_token_throughput", "duration"):
                assert k in r, k
            for k in ("git_commit", "machine", "seed", "server_cmd", "model_id"):
                assert k in r, k
            assert r["machine"]["nproc"] >= 1 and r["seed"] == 7 and r["model_id"] == "fake-model"

        # failures are counted with their reasons, and exit status 2 when all failed
        p = bu.run_bench(["--base-url", base, "--num-prompts", "3", "--random-input-len", "5", "--max-tokens", "4",
                          "--extra-body", '{"fake_fail": "no_usage"}', "--save-result",
                          "--result-filename", os.path.join(tmp, "fail.json")])
        assert p.returncode == 2, p.returncode
        r = bu.load(os.path.join(tmp, "fail.json"))
        assert r["failed"] == 3 and r["completed"] == 0
        assert r["endpoint"] == "/v1/completions" and r["backend"] == "openai"  # vLLM's default
        assert any("no usage" in k for k in r["failure_reasons"]), r["failure_reasons"]

        # a server that streams no usage (llama-cpp-python) is counted through its tokenize
        # endpoint only when asked; the fake tokenizes one token per word, so counts are exact
        before = counters(base)
        fb = os.path.join(tmp, "fallback.json")
        p = bu.run_bench(["--base-url", base, "--num-prompts", "4", "--random-input-len", "9", "--max-tokens", "10",
                          "--ignore-eos", "--backend", "openai-chat", "--extra-body", '{"fake_fail": "no_usage"}', "--tokenize-fallback",
                          "/extras/tokenize", "--save-result", "--result-filename", fb])
        assert p.returncode == 0, p.returncode
        after = counters(base)
        r = bu.load(fb)
        assert r["completed"] == 4 and r["retokenized_requests"] == 4
        assert r["endpoint"] == "/v1/chat/completions" and r["backend"] == "openai-chat"
        assert r["total_output_tokens"] == after["generation_tokens_total"] - before["generation_tokens_total"] == 40
        assert r["total_input_tokens"] == after["prompt_tokens_total"] - before["prompt_tokens_total"] == 36
        assert "re-tokenizing" in p.stdout

        # sweep + compare (+ plots)
        sw = os.path.join(tmp, "sweep.json")
        plots = os.path.join(tmp, "plots")
        args = ["--base-url", base, "--dataset-name", "random", "--random-input-len", "10", "--num-prompts", "6",
                "--max-tokens", "16", "--ignore-eos", "--sweep-concurrency", "1,3", "--save-result",
                "--result-filename", sw, "--label", "sweep"]
        have_gnuplot = shutil.which("gnuplot") is not None
        if have_gnuplot:
            args += ["--plot-dir", plots]
        p = bu.run_bench(args)
        assert p.returncode == 0
        r = bu.load(sw)
        assert [lv["max_concurrency"] for lv in r["sweep"]] == [1, 3]
        assert all(lv["total_output_tokens"] == 6 * 16 for lv in r["sweep"])
        if have_gnuplot:
            for png in ("latency_cdf.png", "throughput_vs_concurrency.png", "tpot_vs_concurrency.png",
                        "acceptance_per_position.png"):
                with open(os.path.join(plots, png), "rb") as f:
                    assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
        p = bu.run_bench(["--compare", sw, sw, "--compare-format", "markdown"])
        assert p.returncode == 0 and "| output token throughput (tok/s) |" in p.stdout and "1.00x" in p.stdout
        print("PASS")
    finally:
        srv.terminate()
        srv.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
