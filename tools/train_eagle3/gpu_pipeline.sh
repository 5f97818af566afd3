#!/bin/bash
# gpu_pipeline.sh: steps 3-5 of the draft pipeline (README.md) on one CUDA GPU.
#
#   gpu_pipeline.sh GGUF CONVS_JSONL VOCAB_MAP WORK_DIR EXPORT_DIR [STEPS] [TRAIN_SECONDS] [TTT]
#
# 1. hf_extract.py --device cuda: the hidden-state dump of every conversation in
#    CONVS_JSONL (transformers on the target GGUF, float32; the independent
#    reference of `specd extract`, same ids / loss mask / aux convention);
# 2. train.py --device cuda from scratch (or resumed from WORK_DIR/run), the
#    hyper-parameters of the committed head (draft/heads/smollm2-135m-eagle3/
#    README.md, except the exact loss on a GPU) with STEPS (default 900) and TTT (default 4) steps; when
#    TRAIN_SECONDS > 0 training stops after the step that passes that many
#    seconds (train.py --time-limit: checkpoint, then export);
# 3. export to EXPORT_DIR without lm_head (the target's rows are used).
# Resumable: an existing dump and run are reused. Needs python3 with torch,
# transformers, gguf, safetensors, numpy (PY overrides the interpreter; DEVICE=cpu
# THREADS=2 runs the same steps on the CPU, for trying it out).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-python3}
G=${1:?GGUF}; C=${2:?CONVS_JSONL}; VM=${3:?VOCAB_MAP}; W=${4:?WORK_DIR}; EXP=${5:?EXPORT_DIR}
STEPS=${6:-900}; TL=${7:-0}; TTT=${8:-4}
DEV=${DEVICE:-cuda}; THR=${THREADS:-8}
# the exact objective (softmax over the whole draft vocabulary) on a GPU; the
# candidate-set approximation (train.py --cand-topk) on a CPU
[ "$DEV" = cpu ] && CAND="--cand-topk 32 --cand-random 512" || CAND="--cand-topk 0 --cand-random 0"
mkdir -p "$W"
t0=$(date +%s)
if [ ! -e "$W/dump/manifest.json" ]; then
    "$PY" "$HERE/hf_extract.py" --gguf "$G" --input "$C" --out "$W/dump" --max-len 512 --device "$DEV" --threads "$THR"
fi
echo "gpu_pipeline: dump ready after $(( $(date +%s) - t0 )) s"
ARGS=(--run "$W/run" --dump "$W/dump" --vocab-map "$VM" --gguf "$G" --device "$DEV" --threads "$THR"
      --steps "$STEPS" --ttt "$TTT" --tokens-per-step 1536 --max-len 512 --lr 1e-3 --warmup 20
      --ckpt-every 50 --log-every 25 --freeze-lm-head $CAND
      --time-limit "$TL" --no-export-lm-head --export-dir "$EXP")
"$PY" "$HERE/train.py" "${ARGS[@]}"
echo "gpu_pipeline: trained and exported after $(( $(date +%s) - t0 )) s"
