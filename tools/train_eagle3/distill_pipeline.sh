#!/usr/bin/env bash
# distill_pipeline.sh: the general-chat EAGLE-3 head, end to end, resumable (issue 20, item 2).
#
#   tools/train_eagle3/distill_pipeline.sh start  DATA_DIR   # in the background (setsid, nice 19), log DATA_DIR/logs/
#   tools/train_eagle3/distill_pipeline.sh stop   DATA_DIR   # SIGTERM to the whole job, waits for it
#   tools/train_eagle3/distill_pipeline.sh status DATA_DIR   # progress of every step
#   tools/train_eagle3/distill_pipeline.sh run    DATA_DIR   # in the foreground (what start runs)
#
# Steps, each skipped once DATA_DIR/state/STEP.done exists, each resumable when
# interrupted (rerun `start`: it continues where the last run stopped):
#   prompts        make_prompts.py: the target writes N_PROMPTS user requests (topics x tasks)
#   answers        prepare_data.py --prompts: greedy answers (MAX_TOKENS) to those prompts
#   gsm8k          prepare_data.py: greedy answers to NUM_GSM8K GSM8K train questions + HumanEval
#                  (the three above share one `specd serve`, started here, stopped after)
#   vocab          specd vocab count over GSM8K train + every response; vocab build: 32,000 (the
#                  head's map) and 4,096 (hot vocabulary for serving)
#   dump           specd extract over the responses (a shard per SHARD samples; resumes after the
#                  last complete shard), then dump.py validate
#   train          train.py warm-started from INIT_HEAD (the committed head), TRAIN_STEPS steps,
#                  checkpoint every 10 (resumes from the newest)
#   export         train.py --export-only --no-export-lm-head -> DATA_DIR/head (+ hot_vocab_4096)
#   eval           eval_acceptance.py at a fixed k = 3 (--no-adaptive): gsm8k_test (200) and MT-bench
#                  first turns (80)
# Nothing is committed: compare DATA_DIR/eval_*.json with the committed head's
# acceptance.json and copy DATA_DIR/head into draft/heads/ only if it is better.
#
# Environment (defaults): SPECD (build/server/specd of this checkout; built if missing), PY
# (/work/venv-tools/bin/python: torch, safetensors, gguf, numpy), MODEL, THREADS (2), NICE (19),
# PORT (8741), N_PROMPTS (7000), NUM_GSM8K (3000), MAX_TOKENS (512), GSM8K_MAX_TOKENS (384),
# CONCURRENCY (16), SHARD (32), TRAIN_STEPS (3000), TRAIN_ARGS (extra train.py flags),
# PROMPTS_ARGS (extra make_prompts.py flags), HUMANEVAL (1: the 164 HumanEval prompts too),
# INIT_HEAD (draft/heads/smollm2-135m-eagle3; empty = train from scratch), EVAL_N_GSM8K (200),
# EVAL_N_MTBENCH (80), EVAL_MAX_TOKENS (128), PROMPTS_DIR (../shared/data/prompts).
set -euo pipefail

# start runs a copy of this script (DATA_DIR/logs/pipeline.run.sh): bash reads a script as it
# runs, so editing the checkout's copy must not change a running job; DISTILL_HERE keeps the tools.
HERE=${DISTILL_HERE:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
ROOT=$(cd "$HERE/../.." && pwd)
CMD=${1:-}
DATA=${2:-}
if [[ -z "$CMD" || -z "$DATA" || ! "$CMD" =~ ^(start|stop|status|run)$ ]]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
mkdir -p "$DATA"
DATA=$(cd "$DATA" && pwd)
mkdir -p "$DATA/state" "$DATA/logs"

SPECD=${SPECD:-$ROOT/build/server/specd}
PY=${PY:-/work/venv-tools/bin/python}
MODEL=${MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
NICE=${NICE:-19}
PORT=${PORT:-8741}
N_PROMPTS=${N_PROMPTS:-7000}
NUM_GSM8K=${NUM_GSM8K:-3000}
MAX_TOKENS=${MAX_TOKENS:-512}
GSM8K_MAX_TOKENS=${GSM8K_MAX_TOKENS:-384}
CONCURRENCY=${CONCURRENCY:-16}
SHARD=${SHARD:-32}
TRAIN_STEPS=${TRAIN_STEPS:-3000}
TRAIN_ARGS=${TRAIN_ARGS:-}
PROMPTS_ARGS=${PROMPTS_ARGS:-}
HUMANEVAL=${HUMANEVAL:-1}
EVAL_N_GSM8K=${EVAL_N_GSM8K:-200}
EVAL_N_MTBENCH=${EVAL_N_MTBENCH:-80}
EVAL_MAX_TOKENS=${EVAL_MAX_TOKENS:-128}
INIT_HEAD=${INIT_HEAD-$ROOT/draft/heads/smollm2-135m-eagle3}
PROMPTS_DIR=${PROMPTS_DIR:-$ROOT/../shared/data/prompts}

log() { echo "$(date -u +%FT%TZ) pipeline: $*"; }

case "$CMD" in
start)
    if [[ -f "$DATA/pipeline.pid" ]] && kill -0 "$(cat "$DATA/pipeline.pid")" 2>/dev/null; then
        echo "already running: pid $(cat "$DATA/pipeline.pid") (log $DATA/logs/pipeline.log)"; exit 1
    fi
    # a new session (setsid): stop signals the whole process group, server and workers included
    cp "$0" "$DATA/logs/pipeline.run.sh"
    DISTILL_HERE=$HERE SPECD=$SPECD PY=$PY MODEL=$MODEL setsid nohup nice -n "$NICE" \
        bash "$DATA/logs/pipeline.run.sh" run "$DATA" >> "$DATA/logs/pipeline.log" 2>&1 < /dev/null &
    echo $! > "$DATA/pipeline.pid"
    echo "started: pid $! (process group), log $DATA/logs/pipeline.log; stop: $0 stop $DATA"
    exit 0 ;;
stop)
    [[ -f "$DATA/pipeline.pid" ]] || { echo "not running (no $DATA/pipeline.pid)"; exit 0; }
    pid=$(cat "$DATA/pipeline.pid")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        if kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null || true; fi
    fi
    rm -f "$DATA/pipeline.pid"
    echo "stopped (resume: $0 start $DATA)"
    exit 0 ;;
status)
    for s in prompts answers gsm8k vocab dump train export eval; do
        printf '%-8s %s\n' "$s" "$([[ -f "$DATA/state/$s.done" ]] && echo 'done' || echo '-')"
    done
    [[ -f "$DATA/prompts/prompts_stats.json" ]] && echo "prompts: $(cat "$DATA/prompts/prompts_stats.json" | tr -d '\n ')"
    for f in "$DATA"/responses_*.jsonl; do
        [[ -f "$f" ]] || continue
        python3 - "$f" <<'EOF'
import json, sys
n = toks = 0
for line in open(sys.argv[1]):
    try:
        toks += json.loads(line)["completion_tokens"]; n += 1
    except (ValueError, KeyError):
        pass
print(f"{sys.argv[1]}: {n} conversations, {toks} assistant tokens")
EOF
    done
    [[ -f "$DATA/dump/manifest.json" ]] && python3 -c "import json;m=json.load(open('$DATA/dump/manifest.json'));print('dump:', m['n_samples'], 'samples', m['n_tokens'], 'tokens')"
    [[ -f "$DATA/run/log.jsonl" ]] && echo "train: last step $(tail -1 "$DATA/run/log.jsonl" | python3 -c 'import json,sys;print(json.load(sys.stdin).get("step"))') of $TRAIN_STEPS"
    [[ -f "$DATA/pipeline.pid" ]] && kill -0 "$(cat "$DATA/pipeline.pid")" 2>/dev/null && echo "running: pid $(cat "$DATA/pipeline.pid")" || echo "not running"
    exit 0 ;;
esac

# ----------------------------------------------------------------- run ---
exec 9> "$DATA/pipeline.lock"
flock -n 9 || { log "another run holds $DATA/pipeline.lock"; exit 1; }
log "run: DATA=$DATA SPECD=$SPECD PY=$PY THREADS=$THREADS"
if [[ ! -x "$SPECD" ]]; then
    log "building $SPECD"
    cmake -S "$ROOT" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$ROOT/build" -j"$THREADS" --target specd >/dev/null
fi
"$PY" -c 'import torch, safetensors, numpy, gguf' || { log "$PY lacks torch/safetensors/numpy/gguf"; exit 1; }

SERVER_PID=
server_up() {
    [[ -n "$SERVER_PID" ]] && return 0
    "$SPECD" serve "$MODEL" --port "$PORT" --threads "$THREADS" --max-num-seqs "$CONCURRENCY" \
        --served-model-name smol --enable-prefix-caching --kv-cache-memory 1G \
        >> "$DATA/logs/server.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && { log "server up (pid $SERVER_PID)"; return 0; }
        kill -0 "$SERVER_PID" 2>/dev/null || { log "server exited: see $DATA/logs/server.log"; exit 1; }
        sleep 1
    done
    log "server not healthy after 300 s"; exit 1
}
server_down() {
    [[ -z "$SERVER_PID" ]] && return 0
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
}
trap 'server_down' EXIT
trap 'log "terminated"; exit 143' TERM INT

# step NAME CMD...: run CMD unless NAME is done; retry a failed CMD up to 3 times (a failed
# request is retried by the resumable tools themselves), then stop the pipeline.
step() {
    local name=$1; shift
    [[ -f "$DATA/state/$name.done" ]] && return 0
    for try in 1 2 3; do
        log "$name: start (try $try)"
        if "$@"; then touch "$DATA/state/$name.done"; log "$name: done"; return 0; fi
        log "$name: failed (exit $?)"
        sleep 10
    done
    log "$name: giving up; rerun to resume"; exit 1
}

B="http://127.0.0.1:$PORT"
if [[ ! -f "$DATA/state/prompts.done" || ! -f "$DATA/state/answers.done" || ! -f "$DATA/state/gsm8k.done" ]]; then
    server_up
fi
# shellcheck disable=SC2086  # PROMPTS_ARGS is a list of flags
step prompts "$PY" "$HERE/make_prompts.py" --base-url "$B" --out-dir "$DATA/prompts" --target "$N_PROMPTS" \
    --concurrency "$CONCURRENCY" --data-dir "$PROMPTS_DIR" $PROMPTS_ARGS
step answers "$PY" "$HERE/prepare_data.py" --base-url "$B" --out "$DATA/responses_selfgen.jsonl" --num-gsm8k 0 \
    --prompts "$DATA/prompts/prompts.jsonl" --max-tokens "$MAX_TOKENS" --concurrency "$CONCURRENCY" \
    --data-dir "$PROMPTS_DIR"
HE=()
[[ "$HUMANEVAL" == 1 ]] && HE=(--humaneval)
step gsm8k "$PY" "$HERE/prepare_data.py" --base-url "$B" --out "$DATA/responses_gsm8k.jsonl" --num-gsm8k "$NUM_GSM8K" \
    "${HE[@]}" --max-tokens "$GSM8K_MAX_TOKENS" --concurrency "$CONCURRENCY" --data-dir "$PROMPTS_DIR"
server_down

vocab() {
    "$SPECD" vocab count --target "$MODEL" --data "$PROMPTS_DIR/gsm8k_train.jsonl" \
        --data "$DATA/responses_selfgen.jsonl" --data "$DATA/responses_gsm8k.jsonl" \
        --threads "$THREADS" --output "$DATA/token_freq.npy" &&
    "$SPECD" vocab build --token-freq "$DATA/token_freq.npy" --draft-vocab-size 32000 --target "$MODEL" \
        --output-dir "$DATA/vocab32k" &&
    "$SPECD" vocab build --token-freq "$DATA/token_freq.npy" --draft-vocab-size 4096 --target "$MODEL" \
        --output-dir "$DATA/hot_vocab_4096"
}
step vocab vocab

dump() {
    "$SPECD" extract --target "$MODEL" --data "$DATA/responses_selfgen.jsonl" --data "$DATA/responses_gsm8k.jsonl" \
        --out "$DATA/dump" --shard-samples "$SHARD" --threads "$THREADS" &&
    "$PY" "$HERE/dump.py" validate "$DATA/dump"
}
step dump dump

INIT=()
[[ -n "$INIT_HEAD" ]] && INIT=(--init-from "$INIT_HEAD")
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of flags
step train "$PY" "$HERE/train.py" --run "$DATA/run" "${INIT[@]}" --dump "$DATA/dump" \
    --vocab-map "$DATA/vocab32k/vocab_map.safetensors" --gguf "$MODEL" \
    --steps "$TRAIN_STEPS" --ttt 3 --tokens-per-step 2048 --max-len 512 --lr 8e-4 --warmup 20 \
    --ckpt-every 10 --log-every 10 --freeze-lm-head --cand-topk 32 --cand-random 512 --threads "$THREADS" $TRAIN_ARGS

export_head() {
    "$PY" "$HERE/train.py" --run "$DATA/run" --export-only --no-export-lm-head --export-dir "$DATA/head" &&
    mkdir -p "$DATA/head/hot_vocab_4096" &&
    cp "$DATA/hot_vocab_4096/vocab_map.safetensors" "$DATA/head/hot_vocab_4096/"
}
step export export_head

evaluate() {
    python3 "$HERE/eval_acceptance.py" --head "$DATA/head" --binary "$SPECD" --model "$MODEL" --set gsm8k_test \
        --n "$EVAL_N_GSM8K" --ks 3 --no-adaptive --max-tokens "$EVAL_MAX_TOKENS" --concurrency 8 --threads "$THREADS" --out "$DATA/eval_gsm8k_test.json" &&
    python3 "$HERE/eval_acceptance.py" --head "$DATA/head" --binary "$SPECD" --model "$MODEL" --set mt_bench \
        --n "$EVAL_N_MTBENCH" --ks 3 --no-adaptive --max-tokens "$EVAL_MAX_TOKENS" --concurrency 8 --threads "$THREADS" --out "$DATA/eval_mt_bench.json"
}
step eval evaluate
log "all steps done: head in $DATA/head, acceptance in $DATA/eval_*.json"
