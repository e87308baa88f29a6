#!/usr/bin/env bash
# Trains the shipped demo draft (SmolLM2-135M-Instruct, 5 layers, block 16) on one H200 in three
# back-to-back device calls; /tmp on the machine carries state between them, $OUT brings files back.
# Prepare here first:  ../shared/gpu/split-target.sh   (target GGUF -> .stage/target/{a,b}/part)
#                      mkdir -p .stage/datasets && cp -r ../shared/datasets/{gsm8k,mbpp,mmlu} .stage/datasets/
#                      pip download gguf wheel into .whl/ (see /work/shared/gpu/FACTS.md)
#   call 1: bash scripts/demo_draft_job.sh stage   carry .stage/target/a .stage/datasets .whl
#   call 2: bash scripts/demo_draft_job.sh regen   carry .stage/target/b .whl
#   call 3: bash scripts/demo_draft_job.sh train   carry .whl
# Knobs (env): REGEN_S, GEN_BS, MAX_NEW, MMLU_N, TRAIN_TOTAL_S, TRAIN_PAUSE_S, BATCH_TOKENS,
# ANCHORS, REAL_S, DEVICE, TINY=1 (a CPU dry run with miniature settings).
set -euo pipefail
phase=${1:?usage: demo_draft_job.sh stage|regen|train}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DFLASH_CACHE=${DFLASH_CACHE:-/tmp/dflash-cache}
export DFLASH_DATA_DIR=${DFLASH_DATA_DIR:-/tmp/datasets}
OUT=${OUT:-/tmp/job-out}; mkdir -p "$OUT"
W=${WORK:-/tmp}  # machine-local work folder
if [ -z "${TINY:-}" ] && [ ! -d /tmp/site/gguf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
GGUF=$W/smollm2.gguf
REGEN_S=${REGEN_S:-300} GEN_BS=${GEN_BS:-512} MAX_NEW=${MAX_NEW:-384} MMLU_N=${MMLU_N:-6000}
TRAIN_TOTAL_S=${TRAIN_TOTAL_S:-600} TRAIN_PAUSE_S=${TRAIN_PAUSE_S:-100000}
BATCH_TOKENS=${BATCH_TOKENS:-16384} ANCHORS=${ANCHORS:-512} REAL_S=${REAL_S:-90} DEVICE=${DEVICE:-auto}
LAYERS=${LAYERS:-5} EVAL_N=${EVAL_N:-64} EVAL_EVERY=${EVAL_EVERY:-150}

train() {  # same settings in calls 2 and 3, so call 3 resumes the run of call 2
  python3 -m dflash train --target "$GGUF" --data "$W/data" --eval-data "$W/eval" --out "$W/draft" \
    --state-dir "$W/state" --layers "$LAYERS" --block-size 16 --anchors "$ANCHORS" --epochs 40 \
    --lr 6e-4 --max-len 1024 --batch-tokens "$BATCH_TOKENS" --time-limit "$TRAIN_TOTAL_S" \
    --eval-every "$EVAL_EVERY" --save-every 400 --device "$DEVICE" --pause-after "$1"
}

case $phase in
stage)
  mkdir -p "$W/stage" && cp .stage/target/a/part "$W/stage/a.part"
  rm -rf "$DFLASH_DATA_DIR" && cp -r .stage/datasets "$DFLASH_DATA_DIR"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python3 scripts/gpu_smoke.py ${TINY:+--tiny} --out "$OUT/smoke.json"
  ;;
regen)
  [ -f "$W/stage/a.part" ] || { echo "error: $W/stage/a.part is missing: run the stage call first"; exit 3; }
  [ -f "$GGUF" ] || cat "$W/stage/a.part" .stage/target/b/part > "$GGUF"
  python3 -m dflash data regenerate --target "$GGUF" --prompts "gsm8k@$EVAL_N" --out "$W/eval" \
    --max-new-tokens 256 --batch-size 64 --device "$DEVICE"
  python3 -m dflash data regenerate --target "$GGUF" --prompts gsm8k:train --prompts mbpp:train \
    --prompts "mmlu@$MMLU_N" --out "$W/data" --max-new-tokens "$MAX_NEW" --batch-size "$GEN_BS" \
    --time-limit "$REGEN_S" --device "$DEVICE"
  tar czf "$OUT/data.tar.gz" -C "$W" data eval
  train "$TRAIN_PAUSE_S"
  cp "$W/draft/train_log.jsonl" "$OUT/"
  ;;
train)
  [ -d "$W/state" ] || { echo "error: no training state in $W/state: the machine was replaced"; exit 3; }
  train "$TRAIN_PAUSE_S"
  mkdir -p "$OUT/draft" && cp "$W"/draft/*.json "$W"/draft/*.safetensors "$W/draft/train_log.jsonl" "$OUT/draft/"
  python3 scripts/eval_draft.py --target "$GGUF" --draft "$W/draft" --eval-data "$W/eval" \
    --prompts "gsm8k@$EVAL_N" --max-new-tokens 256 --block-size 16 --real-seconds "$REAL_S" \
    --device "$DEVICE" --out "$OUT/eval.json"
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
echo "phase $phase done"
