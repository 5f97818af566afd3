#!/usr/bin/env bash
# tools/bench_report.sh: regenerates docs/benchmarks.md and its plots in one run
# on one machine: specd without speculation, specd with an EAGLE-3 head, and
# llama.cpp's OpenAI server (llama-cpp-python[server]), same GGUF, same thread
# count, MT-bench prompts (first turns), 128 output tokens, greedy, chat
# endpoint, max concurrency 1 and 8, all measured by specd-bench.
#
# Usage: tools/bench_report.sh [--draft DIR] [--k N] [--gguf FILE] [--threads N]
#          [--num-prompts N] [--build-dir DIR] [--llamacpp-venv DIR]
#          [--prompts FILE] [--results DIR] [--docs DIR] [--skip NAME,...]
#   --draft DIR         EAGLE-3 head for the speculative run (skipped without it)
#   --k N               draft tokens per step for that run [3]
#   --llamacpp-venv DIR venv holding llama-cpp-python[server] [/work/venv-llamacpp]
#   --skip NAME,...     leave out some of: specd, specd-eagle3, llamacpp
#   --max-tokens N, --concurrency LIST, --warmups N  for quick checks only; the
#                       report's definition is 128, 1,8 and 2
# Result JSONs (large: per-request timings) go to --results (default
# BUILD/bench-report); only docs/benchmarks.md and docs/benchmarks/*.png are
# meant to be committed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

DRAFT="" K=3 GGUF="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf" THREADS=$(nproc) NPROMPTS=80
BUILD="$ROOT/build" LLVENV=/work/venv-llamacpp PROMPTS="$ROOT/../shared/data/prompts/mt_bench.jsonl"
RESULTS="" DOCS="$ROOT/docs" SKIP="" MAXTOK=128 CONC=1,8 WARMUPS=2
# llama-cpp-python ignores the vLLM field ignore_eos; to get the same 128 tokens
# its EOS tokens are banned instead (SmolLM2: 0 <|endoftext|>, 2 <|im_end|>).
LL_EXTRA='{"logit_bias": {"0": -100, "2": -100}}'
while (($#)); do
  case "$1" in
    --draft) DRAFT=$2; shift 2 ;;
    --k) K=$2; shift 2 ;;
    --gguf) GGUF=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --num-prompts) NPROMPTS=$2; shift 2 ;;
    --build-dir) BUILD=$2; shift 2 ;;
    --llamacpp-venv) LLVENV=$2; shift 2 ;;
    --prompts) PROMPTS=$2; shift 2 ;;
    --results) RESULTS=$2; shift 2 ;;
    --docs) DOCS=$2; shift 2 ;;
    --skip) SKIP=$2; shift 2 ;;
    --max-tokens) MAXTOK=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --warmups) WARMUPS=$2; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "bench_report: unknown argument $1" >&2; exit 1 ;;
  esac
done
RESULTS=${RESULTS:-$BUILD/bench-report}
SPECD="$BUILD/server/specd" BENCH="$BUILD/bench/specd-bench"
for f in "$BENCH" "$GGUF" "$PROMPTS"; do
  [[ -e "$f" ]] || { echo "bench_report: missing $f" >&2; exit 1; }
done
mkdir -p "$RESULTS/logs" "$DOCS/benchmarks"
skipped() { [[ ",$SKIP," == *",$1,"* ]]; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

SRV_PID=""
stop_server() {
  if [[ -n "$SRV_PID" ]] && kill -0 "$SRV_PID" 2>/dev/null; then
    kill -TERM "$SRV_PID"
    for _ in $(seq 60); do kill -0 "$SRV_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$SRV_PID" 2>/dev/null && kill -KILL "$SRV_PID"
    wait "$SRV_PID" 2>/dev/null || true
  fi
  SRV_PID=""
}
trap stop_server EXIT

# BARGS=(extra bench args); run NAME server command...
BARGS=()
run() {
  local name=$1; shift
  local port; port=$(free_port)
  local cmd=("$@" --port "$port")
  echo "== $name: ${cmd[*]}"
  OMP_NUM_THREADS=$THREADS "${cmd[@]}" >"$RESULTS/logs/$name.log" 2>&1 &
  SRV_PID=$!
  local ok=0
  for _ in $(seq 600); do
    # ready = GET /health 200 (specd answers 503 while loading); a server without
    # /health (llama-cpp-python: 404) is ready when GET /v1/models answers 200
    local code; code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health" || true)
    if [[ $code == 200 ]]; then ok=1; break; fi
    if [[ $code == 404 ]] && curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1; then ok=1; break; fi
    kill -0 "$SRV_PID" 2>/dev/null || break
    sleep 0.5
  done
  if ((!ok)); then
    echo "bench_report: $name did not come up, see $RESULTS/logs/$name.log" >&2
    tail -20 "$RESULTS/logs/$name.log" >&2
    stop_server
    return 1
  fi
  "$BENCH" --base-url "http://127.0.0.1:$port" --endpoint /v1/chat/completions \
    --dataset-name mt-bench --dataset-path "$PROMPTS" --num-prompts "$NPROMPTS" \
    --max-tokens "$MAXTOK" --temperature 0 --sweep-concurrency "$CONC" --num-warmups "$WARMUPS" \
    --seed 0 --label "$name" --server-cmd "${cmd[*]}" \
    --save-result --result-filename "$RESULTS/$name.json" "${BARGS[@]}" \
    | tee "$RESULTS/logs/$name.bench.txt"
  local rc=${PIPESTATUS[0]}
  stop_server
  if ((rc)); then echo "bench_report: specd-bench failed ($rc) against $name" >&2; fi
  return "$rc"
}

START=$(date -u +%FT%TZ)
FILES=()
if ! skipped specd; then
  [[ -x "$SPECD" ]] || { echo "bench_report: $SPECD not built" >&2; exit 1; }
  BARGS=(--ignore-eos)
  run specd "$SPECD" serve "$GGUF" --threads "$THREADS" && FILES+=("$RESULTS/specd.json")
fi
if ! skipped specd-eagle3; then
  if [[ -n "$DRAFT" ]]; then
    BARGS=(--ignore-eos)
    run specd-eagle3 "$SPECD" serve "$GGUF" --threads "$THREADS" \
      --draft "$DRAFT" --num-speculative-tokens "$K" && FILES+=("$RESULTS/specd-eagle3.json")
  else
    echo "== specd-eagle3: skipped (no --draft DIR)"
  fi
fi
LLVER=""
if ! skipped llamacpp; then
  if [[ -x "$LLVENV/bin/python" ]] && "$LLVENV/bin/python" -c 'import llama_cpp.server' 2>/dev/null; then
    LLVER=$("$LLVENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)')
    BARGS=(--extra-body "$LL_EXTRA" --tokenize-fallback /extras/tokenize)
    run llamacpp "$LLVENV/bin/python" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 \
      --n_threads "$THREADS" --n_threads_batch "$THREADS" --n_ctx 2048 --interrupt_requests False \
      && FILES+=("$RESULTS/llamacpp.json")
  else
    echo "== llamacpp: skipped (no llama-cpp-python[server] in $LLVENV)"
  fi
fi
END=$(date -u +%FT%TZ)
((${#FILES[@]})) || { echo "bench_report: nothing measured" >&2; exit 1; }

"$BENCH" --compare "${FILES[@]}" --compare-format markdown >"$RESULTS/compare.md"
rm -rf "$RESULTS/plots"
"$BENCH" --compare "${FILES[@]}" --plot-dir "$RESULTS/plots" >/dev/null
rm -f "$DOCS"/benchmarks/*.png
cp "$RESULTS"/plots/*.png "$DOCS/benchmarks/"

python3 - "$DOCS/benchmarks.md" "$RESULTS/compare.md" "$START" "$END" "$LLVER" "$THREADS" "$NPROMPTS" \
  "$K" "$DRAFT" "$GGUF" "$MAXTOK" "$CONC" "$WARMUPS" "${FILES[@]}" <<'PY'
import json, os, sys
out, cmp_md, start, end, llver, threads, nprompts, k, draft, gguf, maxtok, conc, warm = sys.argv[1:14]
files = sys.argv[14:]
res = [json.load(open(f)) for f in files]
m = res[0]["machine"]
names = [r["label"] for r in res]
lines = []
w = lines.append
w("# Benchmarks\n")
w("Generated by `tools/bench_report.sh` (do not edit by hand) from %s to %s, commit `%s`.\n"
  % (start, end, res[0].get("git_commit") or "unknown"))
w("## Setup\n")
w("- Machine: %s, %s logical CPUs, %s; `%s`." % (m.get("cpu_model"), m.get("nproc"), m.get("mem_total"), m.get("uname")))
w("- Model: `%s` (SmolLM2-135M-Instruct, Q4_1), %s compute threads for every server." % (os.path.basename(gguf), threads))
w("- Workload: MT-bench first turns (%s prompts), chat endpoint, greedy (temperature 0), %s output tokens per "
  "request, streaming, all requests released at once, max concurrency %s (one run per level), %s warm-up requests; "
  "measured by `specd-bench` (tokens from `usage`, TTFT/ITL/TPOT/E2EL as in vLLM's `bench serve`)."
  % (nprompts, maxtok, conc.replace(",", ", "), warm))
w("- Servers (exact command lines):")
for r in res:
    w("  - **%s**: `%s`" % (r["label"], r.get("server_cmd")))
if "llamacpp" in names:
    w("  - llama-cpp-python version %s (PyPI, compiled locally, same GGUF)." % llver)
if "specd-eagle3" in names:
    w("  - EAGLE-3 head: `%s`, %s draft tokens per step." % (draft, k))
w("")
w("## Results (ratios against %s)\n" % names[0])
w(open(cmp_md).read().strip() + "\n")
spec = [r for r in res if any("spec_decode_acceptance_length" in lv for lv in r.get("sweep", [r]))]
if spec:
    w("## Speculative decoding\n")
    w("| run | concurrency | acceptance rate | acceptance length | per-position acceptance |")
    w("|---|---:|---:|---:|---|")
    for r in spec:
        for lv in r.get("sweep", [r]):
            if "spec_decode_acceptance_length" not in lv:
                continue
            pp = ", ".join("%.2f" % x for x in lv.get("spec_decode_acceptance_per_position", []))
            w("| %s | %s | %.3f | %.2f | %s |" % (r["label"], lv.get("max_concurrency"),
              lv["spec_decode_acceptance_rate"], lv["spec_decode_acceptance_length"], pp))
    w("")
w("## Plots\n")
for png, title in (("latency_cdf.png", "Latency CDFs (TTFT, TPOT, ITL, E2E)"),
                   ("throughput_vs_concurrency.png", "Output throughput against max concurrency"),
                   ("tpot_vs_concurrency.png", "Median TPOT against max concurrency"),
                   ("acceptance_per_position.png", "Acceptance per draft position")):
    if os.path.exists(os.path.join(os.path.dirname(out), "benchmarks", png)):
        w("### %s\n\n![%s](benchmarks/%s)\n" % (title, title, png))
w("## What could make this comparison unfair\n")
w("- One small machine, shared: the benchmark client runs on the same cores as the server and competes with it, "
  "and other processes on the machine add noise. One run per configuration, no repetitions or confidence intervals.")
w("- A 135M-parameter model is tiny: per-token work is small, so HTTP, JSON and scheduling overheads weigh far more "
  "than they would for a large model; speculation helps most when a decode step is bound by reading weights.")
if "llamacpp" in names:
    w("- llama-cpp-python's server runs one request at a time (no continuous batching): at concurrency 8 requests "
      "queue (it runs with `--interrupt_requests False`; by default a new request cuts the running stream off), "
      "which shows up in TTFT and E2E latency, not in TPOT. Its HTTP layer is Python (FastAPI/uvicorn).")
    w("- llama-cpp-python streams no `usage`, so its token counts come from re-tokenizing the generated text and the "
      "raw prompt through its `/extras/tokenize` endpoint (`--tokenize-fallback`): prompt counts exclude the chat "
      "template, and re-tokenized output counts can differ slightly from the tokens actually generated.")
    w("- It ignores `ignore_eos`; its EOS tokens are banned with `logit_bias` instead, so after the point where the "
      "model would stop, its continuation differs from specd's (same number of tokens, different text).")
    w("- Kernels differ: llama.cpp computes Q4_1 dot products on quantized activations with its own SIMD kernels; "
      "specd's CPU backend has its own kernels and numerics (batch-invariant by design), so greedy outputs may "
      "diverge between the two servers.")
if "specd-eagle3" in names:
    w("- The speedup of the EAGLE-3 run depends on the quality of that head (how and on what it was trained); "
      "acceptance on MT-bench is reported above so the speedup can be read against it.")
w("")
w("Regenerate: `tools/bench_report.sh --draft <EAGLE-3 dir> [--threads N]` (see the script's header).")
open(out, "w").write("\n".join(lines) + "\n")
print("wrote", out)
PY
echo "bench_report: done; results in $RESULTS"
