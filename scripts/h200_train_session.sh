#!/usr/bin/env bash
# Train a shallower demo draft on one H200 (the `device` tool's nvidia-h200) in back-to-back calls,
# then benchmark it beside the shipped draft in one run. Issue each call within 30 s of the previous
# one: /tmp on the machine holds the target, the data and the training state only while it is warm
# (the twenty-seventh session lost it between `train` and `bench` and staged again; see `bench`).
#
# Prepare here (CPU), under the git-ignored .stage/:
#   .stage/t5/{aa..ae}/part   the demo GGUF cut in 20 MB parts (split -b 20000000)
#   .stage/data/{gsm8k,math500,humaneval,mbpp,mt-bench}   copies of ../shared/datasets
#   .stage/prompts/train-prompts.jsonl.gz   scripts/build_train_prompts.py output
#   .stage/whl/gguf-0.19.0-*.whl
# Move benchmarks/results out of the working tree for calls 1-5 (the 64 MiB a call may send).
# Calls (carry in brackets):
#   1 stage1   [.stage/t5/aa .stage/whl .stage/data]
#   2-4 stage ab|ac|ad   [.stage/t5/<part>]
#   5 prep     [.stage/t5/ae .stage/prompts]  assemble the target, regenerate REGEN_S seconds of
#              training answers and the held-out set, cut the shipped draft to KEEP layers
#              (INIT=DIR: start from that draft instead, e.g. the last session's result carried
#              in .stage/newdraft: carry it in a call of its own, copy it to /tmp there and pass
#              that path, as the 64 MiB carry limit leaves no room beside ae and the prompts)
#   6 train    []  `dflash train --resume-from` the cut draft for PAUSE s (run again to resume,
#              up to TRAIN_LIMIT s in all); the draft comes back in $OUT
#   7 bench    []  gsm8k 64: the new draft (--check-parity), then the shipped one, same process
#              settings; a single generate with the new draft (ONE_TILE=1: the new draft again
#              under DFLASH_LINEAR_ONE_TILE=1, parity checked)
#   8 bench2   []  the shipped draft with a draft vocabulary (`train` writes both drafts' from
#              the regenerated answers, VOCAB=16384 tokens; 0: none), the new one without its own
# Continuing a draft (twenty-eighth session): after stage ad, `init` [.stage/newdraft], then
# `INIT=/tmp/demo/newinit prep` [.stage/t5/ae .stage/prompts].
set -uo pipefail
phase=${1:?usage: h200_train_session.sh stage1|stage PART|init|prep|train|bench|bench2}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DFLASH_CACHE=/tmp/dflash-cache
OUT=${OUT:-/tmp/train-out}; mkdir -p "$OUT"
W=/tmp/demo; mkdir -p "$W/logs" "$W/stage"
if [ ! -d /tmp/site/gguf ] && ls .stage/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
GGUF=$W/smollm2.gguf
SHIPPED=dflash/assets/smollm2-135m-instruct-dflash
KEEP=${KEEP:-0,1,4}              # layers of the shipped draft the new one starts from
LR=${LR:-5e-4}
STEPS=${STEPS:-6000}             # cap on steps; --time-limit anneals the schedule first
TRAIN_LIMIT=${TRAIN_LIMIT:-800}  # seconds of training in all (the cosine schedule fits them)
PAUSE=${PAUSE:-540}              # seconds of training per `train` call
REGEN_S=${REGEN_S:-180}          # seconds of regeneration of training answers
train_args() {  # same data, seed and schedule in every call
  echo --target "$GGUF" --data "$W/data" --eval-data "$W/eval" --out "$W/draft" --resume-from "$W/init" \
    --block-size 16 --anchors 512 --epochs 40 --lr "$LR" --max-len 1024 --max-steps "$STEPS" \
    --save-every 100000 --seed 0 --time-limit "$TRAIN_LIMIT" --batch-tokens 16384 --eval-every 400
}
t0=$SECONDS
log() { echo "[$((SECONDS - t0)) s] $*"; }

case $phase in
stage1)
  cp .stage/t5/aa/part "$W/stage/aa.part"
  rm -rf "$W/datasets" && cp -r .stage/data "$W/datasets"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  ;;
stage)
  cp ".stage/t5/$2/part" "$W/stage/$2.part" && ls -la "$W/stage"
  ;;
prep)
  cat "$W"/stage/{aa,ab,ac,ad}.part .stage/t5/ae/part > "$GGUF" || exit 1
  sha256sum "$GGUF" | cut -c1-16
  cp .stage/prompts/train-prompts.jsonl.gz "$W/" || exit 1
  if [ -n "${INIT:-}" ]; then  # continue a draft carried in (e.g. .stage/newdraft, a `train` result)
    rm -rf "$W/init" && cp -r "$INIT" "$W/init" || exit 1
  else
    rm -rf "$W/init" && python3 scripts/truncate_draft.py --draft "$SHIPPED" --keep-layers "$KEEP" --out "$W/init" || exit 1
  fi
  python3 -m dflash data regenerate --target "$GGUF" --eval-only \
    --prompts gsm8k@16,math500@16,humaneval@16,mbpp@16,mt-bench@16 --out "$W/eval" --data-dir "$W/datasets" \
    --max-new-tokens 256 --batch-size 128 > "$W/logs/regen-eval.txt" 2>&1
  tail -n 2 "$W/logs/regen-eval.txt"
  python3 -m dflash data regenerate --target "$GGUF" --prompts "$W/train-prompts.jsonl.gz" --out "$W/data" \
    --max-new-tokens 1024 --batch-size 1024 --samples 2 --sample-temperature 0.8 --seed 2 \
    --time-limit "$REGEN_S" > "$W/logs/regen.txt" 2>&1
  tail -n 2 "$W/logs/regen.txt"
  ;;
train)
  log "dflash train, 1 GPU, 16,384 tokens a step, $PAUSE s of $TRAIN_LIMIT s, from layers $KEEP"
  timeout "${TRAIN_S:-590}" python3 -m dflash train $(train_args) --pause-after "$PAUSE" >> "$W/logs/train.txt" 2>&1
  log "train exit $?"
  grep -v '^\s*$' "$W/logs/train.txt" | tail -n 12
  if [ "${VOCAB:-16384}" != 0 ]; then  # draft vocabularies from the target's regenerated answers
    python3 -m dflash data vocab --data "$W/data" --eval-data "$W/eval" --draft "$W/draft" --size "${VOCAB:-16384}"
    rm -rf "$W/v6vocab" && cp -r "$SHIPPED" "$W/v6vocab" && rm -f "$W/v6vocab/README.md"
    python3 -m dflash data vocab --data "$W/data" --eval-data "$W/eval" --draft "$W/v6vocab" --size "${VOCAB:-16384}"
  fi
  cp "$W"/draft/*.safetensors "$W"/draft/*.json "$OUT/" 2>/dev/null
  cp "$W/draft/train_log.jsonl" "$OUT/" 2>/dev/null
  ;;
init)  # carry .stage/newdraft (a draft `train` returned) in a call of its own; prep INIT=/tmp/demo/newinit
  rm -rf "$W/newinit" && cp -r .stage/newdraft "$W/newinit" && ls "$W/newinit"
  ;;
bench2)  # the shipped draft with the same draft vocabulary, and the new one without its own
  B=(python3 -m dflash benchmark transformers --model "$GGUF" --max-new-tokens 256 --data-dir "$W/datasets"
     --dataset gsm8k --max-samples 64 --block-size 16)
  timeout "${BENCH_S:-170}" "${B[@]}" --draft "$W/v6vocab" --output "$OUT/b-shipped-vocab.jsonl" > "$OUT/b-shipped-vocab.txt" 2>&1
  tail -n 6 "$OUT/b-shipped-vocab.txt"
  DFLASH_DRAFT_VOCAB=0 timeout "${BENCH_S:-170}" "${B[@]}" --draft "$W/draft" --output "$OUT/b-new-novocab.jsonl" \
    > "$OUT/b-new-novocab.txt" 2>&1
  tail -n 6 "$OUT/b-new-novocab.txt"
  ;;
bench)  # a machine lost since `train`: re-stage (1-4, prep's cat only) and carry .stage/newdraft
  D=$W/draft   # (the draft `train` returned in $OUT, 24 MB for 3 layers) in a call of its own
  if [ -d .stage/newdraft ]; then mkdir -p "$D" && cp .stage/newdraft/* "$D/"; fi
  [ -f "$GGUF" ] || cat "$W"/stage/{aa,ab,ac,ad}.part .stage/t5/ae/part > "$GGUF"
  B=(python3 -m dflash benchmark transformers --model "$GGUF" --max-new-tokens 256 --data-dir "$W/datasets"
     --dataset gsm8k --max-samples 64 --block-size 16)
  timeout "${BENCH_S:-170}" "${B[@]}" --draft "$D" --check-parity --output "$OUT/b-new.jsonl" > "$OUT/b-new.txt" 2>&1
  tail -n 6 "$OUT/b-new.txt"
  timeout "${BENCH_S:-170}" "${B[@]}" --draft "$SHIPPED" --output "$OUT/b-shipped.jsonl" > "$OUT/b-shipped.txt" 2>&1
  tail -n 6 "$OUT/b-shipped.txt"
  if [ "${ONE_TILE:-0}" = 1 ]; then  # the same, DFLASH_LINEAR_ONE_TILE=1 (parity under it)
    DFLASH_LINEAR_ONE_TILE=1 timeout "${BENCH_S:-170}" "${B[@]}" --draft "$D" --check-parity \
      --output "$OUT/b-new-onetile.jsonl" > "$OUT/b-new-onetile.txt" 2>&1
    tail -n 6 "$OUT/b-new-onetile.txt"
  fi
  P=$(python3 -c "from dflash.data.datasets import load_prompts, select; print(select(load_prompts('gsm8k', '$W/datasets'), 1)[0].turns[0])")
  timeout 60 python3 -m dflash generate transformers --model "$GGUF" --draft "$D" "$P" --block-size 16 \
    --max-new-tokens 256 --json > "$OUT/generate.json" 2> "$OUT/generate.err"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r[k] for k in ('decode_tok_per_s','ttft_s','verify_steps','new_tokens')})" "$OUT/generate.json" || tail -n 3 "$OUT/generate.err"
  ;;
restage)  # a fresh machine after `train`: `stage ae` too, then this [.stage/newdraft] assembles the
  # target and puts the trained draft in place for `vbench`
  cat "$W"/stage/{aa,ab,ac,ad,ae}.part > "$GGUF" && sha256sum "$GGUF" | cut -c1-16
  rm -rf "$W/draft" && cp -r .stage/newdraft "$W/draft" && ls "$W/draft"
  ;;
vbench)  # gsm8k 64: the new draft (its draft vocabulary; --check-parity), the shipped one with the
  # same vocabulary, the shipped one as is; BENCH_S seconds at most each
  rm -rf "$W/v6vocab" && cp -r "$SHIPPED" "$W/v6vocab" && cp "$W/draft/draft_vocab.json" "$W/v6vocab/"
  B=(python3 -m dflash benchmark transformers --model "$GGUF" --max-new-tokens 256 --data-dir "$W/datasets"
     --dataset gsm8k --max-samples 64 --block-size 16)
  for run in new:$W/draft v6vocab:$W/v6vocab shipped:$SHIPPED; do
    name=${run%%:*}; extra=(); [ "$name" = new ] && extra=(--check-parity)
    timeout "${BENCH_S:-170}" "${B[@]}" --draft "${run#*:}" "${extra[@]}" --output "$OUT/b-$name.jsonl" > "$OUT/b-$name.txt" 2>&1
    log "$name exit $?"; grep -E "DFlash decode|baseline decode|τ|parity" "$OUT/b-$name.txt" | head -8
  done
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
log "phase $phase done"
