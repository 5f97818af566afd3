#!/usr/bin/env bash
# tools/fuzz.sh: builds the libFuzzer harnesses (clang) and runs each for a
# given time on a scratch copy of its committed seed corpus.
#
# Usage: tools/fuzz.sh [SECONDS] [HARNESS...]      (default 60 s, all harnesses)
#   FUZZ_BUILD_DIR  build folder (default build-fuzz)
#   FUZZ_OUT        where new corpus entries and crash inputs go (default a temp dir, kept on failure)
#   FUZZ_JOBS       harnesses run at once (default 1; CI on 2 cores: 1, each fuzzer is one process)
# Harnesses: gguf safetensors oai tokenizer chat_template eagle3_config eagle3_vocab npy tok_hf tok_tiktoken
# Exit status: 0 when every harness ran its time without a finding; 1 otherwise,
# with the crash input's path and the one-line reproduction printed.
# A crash input becomes a regression test by copying it to
# tests/fuzz/regressions/<harness>/ (ctest fuzz_replay_<harness> runs it in
# the normal and the ASan build).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
shift || true
ALL=(gguf safetensors oai tokenizer chat_template eagle3_config eagle3_vocab npy tok_hf tok_tiktoken)
NAMES=("$@")
((${#NAMES[@]})) || NAMES=("${ALL[@]}")
B=${FUZZ_BUILD_DIR:-build-fuzz}
export SPECD_MODEL_GGUF=${SPECD_MODEL_GGUF:-$PWD/models/SmolLM2-135M-Instruct.Q4_1.gguf}

declare -A DIR=([gguf]=tests/fuzz [safetensors]=tests/fuzz [oai]=tests/server [tokenizer]=tests/tokenizer
  [chat_template]=tests/fuzz [eagle3_config]=tests/fuzz [eagle3_vocab]=tests/fuzz [npy]=tests/fuzz
  [tok_hf]=tests/fuzz [tok_tiktoken]=tests/fuzz)
declare -A SEEDS=([oai]=tests/server/corpus_oai)
declare -A MAXLEN=([gguf]=4096 [safetensors]=4096 [tokenizer]=2048 [chat_template]=4096)
# a largest single allocation per harness (MiB; libFuzzer's default is the RSS limit, 2048): the tokenizer
# loaders once allocated 1 GiB hash tables for a 3 KB ranks file naming one rank near 2^24
declare -A MALLOC=([tok_hf]=512 [tok_tiktoken]=512)

cmake -S . -B "$B" -DCMAKE_C_COMPILER=clang -DSPECD_FUZZ=ON -DSPECD_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$B" -j "${FUZZ_JOBS:-2}" --target $(printf 'fuzz_%s ' "${NAMES[@]}") >/dev/null

OUT=${FUZZ_OUT:-$(mktemp -d -t specd_fuzz.XXXXXX)}
mkdir -p "$OUT"
fail=0
run_one() {
  local n=$1 bin="$B/${DIR[$1]}/fuzz_$1" seeds=${SEEDS[$1]:-tests/fuzz/corpus_$1}
  local work="$OUT/$n" ml=${MAXLEN[$1]:-8192}
  mkdir -p "$work/corpus" "$work/artifacts"
  [[ -d "$seeds" ]] && cp -r "$seeds/." "$work/corpus/"
  [[ -d tests/fuzz/regressions/$n ]] && cp -r "tests/fuzz/regressions/$n/." "$work/corpus/"
  local t0=$SECONDS
  if "$bin" -max_total_time="$SECS" -max_len="$ml" -timeout=25 -rss_limit_mb=2048 -malloc_limit_mb="${MALLOC[$1]:-2048}" -print_final_stats=1 \
      -artifact_prefix="$work/artifacts/" "$work/corpus" >"$work/log" 2>&1; then
    echo "fuzz $n: ok, $((SECONDS - t0)) s, $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/log" | grep -o '[0-9]*$') runs, corpus $(ls "$work/corpus" | wc -l) inputs"
  else
    echo "fuzz $n: FINDING (log $work/log)"
    grep -E '^(==[0-9]+==ERROR|SUMMARY|.*runtime error)' "$work/log" | head -5 || true
    for a in "$work"/artifacts/*; do
      [[ -e "$a" ]] && echo "  input: $a   reproduce: SPECD_MODEL_GGUF=$SPECD_MODEL_GGUF $bin $a"
    done
    return 1
  fi
}
pids=()
for n in "${NAMES[@]}"; do
  [[ -n "${DIR[$n]:-}" ]] || { echo "fuzz: unknown harness $n (known: ${ALL[*]})" >&2; exit 2; }
  if [[ ${FUZZ_JOBS:-1} -gt 1 ]]; then
    run_one "$n" & pids+=($!)
    if ((${#pids[@]} >= FUZZ_JOBS)); then wait "${pids[0]}" || fail=1; pids=("${pids[@]:1}"); fi
  else
    run_one "$n" || fail=1
  fi
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if ((fail)); then echo "fuzz: findings kept in $OUT"; exit 1; fi
[[ -z "${FUZZ_OUT:-}" ]] && rm -rf "$OUT"
echo "fuzz: all clear (${#NAMES[@]} harnesses x ${SECS} s)"
