#!/usr/bin/env bash
# tools/demo.sh: build specd, serve SmolLM2-135M-Instruct with its EAGLE-3
# head on 127.0.0.1:8000, answer one real chat request with curl, print the
# speculative-decoding counters, and stop (or keep serving with --keep).
# Needs tools/setup.sh to have run (model in models/).
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=0; [[ "${1:-}" == "--keep" ]] && KEEP=1
PORT=${SPECD_PORT:-8000}
HEAD=draft/heads/smollm2-135m-eagle3
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -e $MODEL ]] || { echo "demo: $MODEL missing: run tools/setup.sh first" >&2; exit 1; }
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target specd >/dev/null
# k = 2 with the head's hot vocabulary (its lm_head cut to 4,096 frequent ids) and Q8_0 matrices:
# the fastest measured setting on a small CPU (draft/heads/smollm2-135m-eagle3/README.md)
build/server/specd serve "$MODEL" --port "$PORT" --served-model-name smollm2 \
    --draft "$HEAD" --num-speculative-tokens 2 --speculative-token-map "$HEAD/hot_vocab_4096" \
    --draft-quantization q8_0 --kv-cache-memory 512M &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null' EXIT
for _ in $(seq 1 240); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 0.5; done
echo "--- POST /v1/chat/completions"
curl -s -w '\n' "localhost:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2", "temperature": 0, "max_tokens": 96,
  "messages": [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"}]}'
echo; echo "--- speculative decoding counters (GET /metrics)"
curl -s "localhost:$PORT/metrics" | grep -E '^specd_spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total' |
  awk '{print} /num_drafts_total/ {d = $2} /num_accepted_tokens_total/ {a = $2}
    END { if (d > 0) printf "acceptance length (tokens per verify step, bonus included): %.2f\n", 1 + a / d }'
if ((KEEP)); then echo "demo: serving on http://127.0.0.1:$PORT (Ctrl-C to stop)"; wait $PID; fi
