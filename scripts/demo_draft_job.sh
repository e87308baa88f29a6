#!/usr/bin/env bash
# The whole recipe of the shipped demo draft (SmolLM2-135M-Instruct, 5 layers, block 16) on one
# H200, in back-to-back device calls: /tmp on the machine keeps the target, data and training
# state between calls while it stays warm; every call brings the latest draft back in $OUT.
#
# Prepare here (CPU), in the checkout the device tool sends, under the git-ignored .stage/:
#   PYTHONPATH=. python3 scripts/build_train_prompts.py --data-dir ../shared/datasets \
#       --out .stage/prompts/train-prompts.jsonl.gz          # ~35.8 k prompts, benchmark-checked
#   mkdir -p .stage/data && cp -r ../shared/datasets/{gsm8k,math500,humaneval,mbpp,mt-bench} .stage/data/
#   mkdir -p .stage/t5 && split -b 20000000 SmolLM2-135M-Instruct.Q4_1.gguf .stage/t5/x &&
#       for p in aa ab ac ad ae; do mkdir -p .stage/t5/$p && mv .stage/t5/x$p .stage/t5/$p/part; done
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .stage/whl gguf==0.19.0
#   rm -rf .stage/code && mkdir .stage/code && cp -r dflash scripts .stage/code/ &&
#       rm .stage/code/dflash/assets/*/*.safetensors     # the tracked tree carries them already
# GPU steps (run from .stage/code; the 64 MiB carry limit allows one 20 MB target chunk a call):
#   call 1: bash scripts/demo_draft_job.sh stage aa   carry .stage/code .stage/t5/aa .stage/whl .stage/data
#           (also checks and times the batched generator on a random SmolLM2-shaped model)
#   call 2: bash scripts/demo_draft_job.sh stage ab   carry .stage/code .stage/t5/ab .stage/prompts
#   call 3: bash scripts/demo_draft_job.sh stage ac   carry .stage/code .stage/t5/ac
#   call 4: bash scripts/demo_draft_job.sh stage ad   carry .stage/code .stage/t5/ad
#   call 5: bash scripts/demo_draft_job.sh regen      carry .stage/code .stage/t5/ae
#           (held-out eval data, training data, first training segment; draft back in $OUT)
#   call 6: bash scripts/demo_draft_job.sh train      carry .stage/code   (training to the end)
#   call 7: bash scripts/demo_draft_job.sh bench      carry .stage/code
#           (`dflash benchmark`: gsm8k 64 prompts, math500/humaneval/mbpp/mt-bench 32 each)
# Issue each call within 30 s of the last one: an idle machine is given back, /tmp with it.
# If it was replaced, stage again and continue from a draft folder with RESUME_FROM=DIR
# (weights only, fresh optimizer and schedule). Shipped v2 = v1 fine-tuned this way after the
# first machine was lost: calls 1-4 (stage, NO_SMOKE=1, call 1 also carrying .stage/prompts2),
# then one call: PROMPTS=/tmp/demo/ft-prompts.jsonl.gz REGEN_S=60 GEN_BS=1024 SAMPLES=1 \
#   TRAIN_TOTAL_S=180 CALL_BUDGET_S=330 LR=3e-4 RESUME_FROM=<repo>/dflash/assets/<v1 draft> \
#   bash scripts/demo_draft_job.sh regen && BENCH1_S=110 BENCH2_S=0 bash scripts/demo_draft_job.sh bench Knobs (env): REGEN_S, GEN_BS, SAMPLES, MAX_NEW, TRAIN_TOTAL_S,
# PAUSE_S, BATCH_TOKENS, ANCHORS, LAYERS, MAX_LEN, LR, PROMPTS, EVAL_N, EVAL_EVERY,
# CALL_BUDGET_S (train until this many seconds after the call began, then export), BENCH1_S,
# BENCH2_S (0 skips the four other datasets), NO_SMOKE=1, TINY=1 (a CPU dry run with a tiny
# random target and miniature settings), ARCH (dflash or dflash2: `dflash train --arch`; empty:
# the --resume-from draft's own, else dflash).
# A DFlash2 demo draft (docs/training.md#dflash2-drafts), the same data and budget as v6: the
# calls above with ARCH=dflash2 in every call (from scratch); or, to start from v6 instead,
# ARCH=dflash2 RESUME_FROM=<repo>/dflash/assets/<v6 draft> on the regen call. Its export is
# larger (the selector's two codebooks, 2 x 49152 x 256 in bf16: 50 MB, 4 more shards in $OUT).
set -euo pipefail
phase=${1:?usage: demo_draft_job.sh stage PART|regen|train|bench}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DFLASH_CACHE=${DFLASH_CACHE:-/tmp/dflash-cache}
STAGE=${STAGE:-$(cd .. && pwd)}  # the .stage folder (this script runs from .stage/code)
OUT=${OUT:-/tmp/job-out}; mkdir -p "$OUT"
W=${WORK:-/tmp/demo}; mkdir -p "$W"
if [ -z "${TINY:-}" ] && [ ! -d /tmp/site/gguf ] && ls "$STAGE"/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$STAGE"/whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
GGUF=${GGUF:-$W/smollm2.gguf}
REGEN_S=${REGEN_S:-200} GEN_BS=${GEN_BS:-512} SAMPLES=${SAMPLES:-3} MAX_NEW=${MAX_NEW:-1024}
TRAIN_TOTAL_S=${TRAIN_TOTAL_S:-600} PAUSE_S=${PAUSE_S:-100000} BATCH_TOKENS=${BATCH_TOKENS:-16384}
ANCHORS=${ANCHORS:-512} EVAL_N=${EVAL_N:-16} EVAL_EVERY=${EVAL_EVERY:-100} DEVICE=${DEVICE:-auto}
MAX_LEN=${MAX_LEN:-1024} LAYERS=${LAYERS:-5} LR=${LR:-6e-4} PROMPTS=${PROMPTS:-$W/train-prompts.jsonl.gz}
if [ -n "${TINY:-}" ]; then  # CPU dry run: a tiny random target with the demo tokenizer
  GGUF=$W/tiny-target DEVICE=cpu LAYERS=1
  [ -d "$GGUF" ] || python3 - "$GGUF" <<'EOF'
import sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from dflash.models.target_torch import resolve_target
tok = AutoTokenizer.from_pretrained(resolve_target(None)); torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1]); tok.save_pretrained(sys.argv[1])
EOF
fi

export_draft() {  # the draft's shards + a tarball of the small files: at most 8 files in $OUT
  cp "$W"/draft/*.safetensors "$OUT/"
  tar czf "$OUT/run-$1.tgz" -C "$W" $(cd "$W" && ls draft/*.json draft/*.jsonl logs/* 2>/dev/null)
}

pause_s() {  # train until CALL_BUDGET_S seconds after this call began, minus a reserve for export
  if [ -n "${CALL_BUDGET_S:-}" ]; then echo $(( CALL_BUDGET_S - SECONDS > 60 ? CALL_BUDGET_S - SECONDS : 60 )); else echo "$PAUSE_S"; fi
}

train() {  # same settings in every call, so a later call resumes the run exactly
  local from=()
  [ -n "${RESUME_FROM:-}" ] && from=(--resume-from "$RESUME_FROM")
  [ -n "${ARCH:-}" ] && from+=(--arch "$ARCH")
  python3 -m dflash train --target "$GGUF" --data "$W/data" --eval-data "$W/eval" --out "$W/draft" \
    --state-dir "$W/state" --layers "$LAYERS" --block-size 16 --anchors "$ANCHORS" --epochs 40 \
    --lr "$LR" --max-len "$MAX_LEN" --batch-tokens "$BATCH_TOKENS" --time-limit "$TRAIN_TOTAL_S" \
    --eval-every "$EVAL_EVERY" --save-every 200 --device "$DEVICE" --pause-after "$1" "${from[@]}"
}

mkdir -p "$W/logs"
case $phase in
stage)
  part=${2:?stage PART (aa..ad)}
  mkdir -p "$W/stage" && cp "$STAGE/t5/$part/part" "$W/stage/$part.part"
  [ -d "$STAGE/data" ] && rm -rf "$W/datasets" && cp -r "$STAGE/data" "$W/datasets"
  for d in "$STAGE"/prompts*; do [ -d "$d" ] && cp "$d"/*.jsonl.gz "$W/"; done
  ls -la "$W" "$W/stage"
  if [ "$part" = aa ] && [ -z "${NO_SMOKE:-}" ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    timeout 240 python3 scripts/gpu_gen_bench.py ${TINY:+--tiny --batches 8 --new 16} ${GEN_BENCH_ARGS:-} \
      --out "$OUT/gen_bench.json" || echo "gen bench failed"
  fi
  ;;
regen)
  if [ -z "${TINY:-}" ] && [ ! -f "$GGUF" ]; then
    cat "$W"/stage/aa.part "$W"/stage/ab.part "$W"/stage/ac.part "$W"/stage/ad.part \
      "$STAGE/t5/ae/part" > "$GGUF"
  fi
  sha256sum "$GGUF" 2>/dev/null | cut -c1-16 || true
  EV="gsm8k@$EVAL_N,math500@$EVAL_N,humaneval@$EVAL_N,mbpp@$EVAL_N,mt-bench@$EVAL_N"
  python3 -m dflash data regenerate --target "$GGUF" --eval-only --prompts "$EV" --out "$W/eval" \
    --data-dir "$W/datasets" --max-new-tokens 256 --batch-size 128 --device "$DEVICE" 2>&1 | tee "$W/logs/regen-eval.txt"
  python3 -m dflash data regenerate --target "$GGUF" --prompts "$PROMPTS" \
    --out "$W/data" --samples "$SAMPLES" --sample-temperature 0.8 --max-new-tokens "$MAX_NEW" \
    --batch-size "$GEN_BS" --time-limit "$REGEN_S" --device "$DEVICE" 2>&1 | tee "$W/logs/regen-train.txt"
  python3 - "$W/data" > "$W/logs/data-stats.json" <<'EOF'
import json, sys
from collections import Counter
from dflash.train.data import read_shards
s = read_shards(sys.argv[1]); src = Counter(x.id.split("/")[0] for x in s)
print(json.dumps({"records": len(s), "response_tokens": sum(len(x.response_ids) for x in s),
                  "prompts": len({x.id.split("#")[0] for x in s}), "by_source": src}))
EOF
  cat "$W/logs/data-stats.json"
  train "$(pause_s)" 2>&1 | tail -40 | tee "$W/logs/train-1.txt"
  export_draft 1
  ;;
train)
  train "$(pause_s)" 2>&1 | tail -40 | tee "$W/logs/train-2.txt"
  export_draft 2
  ;;
bench)
  B=(python3 -m dflash benchmark transformers --model "$GGUF" --draft "$W/draft" --block-size 16
     --max-new-tokens 256 --data-dir "$W/datasets")
  timeout "${BENCH1_S:-200}" "${B[@]}" --dataset gsm8k --max-samples 64 \
    --output "$W/logs/bench-gsm8k.jsonl" > "$W/logs/bench-gsm8k.txt" 2>&1 || echo "gsm8k bench failed"
  [ "${BENCH2_S:-280}" = 0 ] || timeout "${BENCH2_S:-280}" "${B[@]}" --dataset math500,humaneval,mbpp,mt-bench --max-samples 32 \
    --output "$W/logs/bench-other.jsonl" > "$W/logs/bench-other.txt" 2>&1 || echo "other bench failed"
  tar czf "$OUT/bench.tgz" -C "$W" logs
  tail -n 30 "$W"/logs/bench-*.txt
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
echo "phase $phase done"
