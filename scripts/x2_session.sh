#!/usr/bin/env bash
# One lease of a 2 x H200 machine (device kind nvidia-h200-x2) for issues 10-13: the 8B-shaped
# loop cost, regenerate the demo draft's training data on both GPUs (new vs old generator side by
# side), 1-GPU training reference and training profile, train the draft further with torchrun
# (the first steps give the 2-GPU scaling), then benchmark it (gsm8k, other datasets, a single
# generate, fp32 parity, HF generate, block 16 vs auto). Issue each call within 30 s of the previous one: /tmp on
# the machine holds the target, the data and the state between calls only while it stays warm.
#
# Prepare here (CPU), under the git-ignored .stage/:
#   split -b 20000000 SmolLM2-135M-Instruct.Q4_1.gguf  -> .stage/t5/{aa..ae}/part
#   .stage/data/{gsm8k,math500,humaneval,mbpp,mt-bench}   (copies of ../shared/datasets)
#   .stage/prompts/half-{0,1}.jsonl.gz   (scripts/build_train_prompts.py output, rows r::2)
#   .stage/whl/gguf-0.19.0-*.whl
# Calls (carry in brackets):
#   1 stage1   [.stage/t5/aa .stage/data .stage/whl]  + 8B-shaped loop cost (bench_big)
#   2-4 stage ab|ac|ad  [.stage/t5/<part>]
#   5 prep     [.stage/t5/ae .stage/prompts]  assemble the target; regenerate on both GPUs
#                  (PROFILE=1: + profile both training paths; PREP_REF=1: + 1-GPU reference run
#                  and block 16 vs auto sweep)
#   6 train    []  torchrun on both GPUs for PAUSE s, the draft comes back in $OUT; 7 train again
#                  (exact resume) until TRAIN_LIMIT s of training are done
#   8 bench    []  benchmarks; logs in $OUT/bench.tgz
set -uo pipefail
phase=${1:?usage: x2_session.sh stage1|stage PART|prep|train|bench}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DFLASH_CACHE=/tmp/dflash-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/x2-out}; mkdir -p "$OUT"
W=/tmp/demo; mkdir -p "$W/logs" "$W/stage"
if [ ! -d /tmp/site/gguf ] && ls .stage/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
GGUF=$W/smollm2.gguf
V2=dflash/assets/smollm2-135m-instruct-dflash  # the shipped draft this segment resumes from
BASE=${BASE:-5134}               # steps of the shipped draft (v5; v5 itself: BASE=3230 from v4)
STEPS=${STEPS:-4000}             # cap on this segment's steps; --time-limit anneals the schedule
LR=${LR:-2.5e-4}
TRAIN_LIMIT=${TRAIN_LIMIT:-900}  # seconds of torchrun training (the cosine schedule fits them)
PAUSE=${PAUSE:-470}              # seconds of training per `train` call (run `train` again to resume)
PREP_REF=${PREP_REF:-0}          # 1: prep also runs the 1-GPU reference and the block 16 vs auto sweep
BENCH_FULL=${BENCH_FULL:-0}      # 1: bench also runs fp32 parity and HF generate
REGEN_ENV0=${REGEN_ENV0:-}        # environment of the GPU-0 regeneration
REGEN_ENV1=${REGEN_ENV1:-}        # GPU-1 (DFLASH_BATCHED_KV_LENGTHS=0: the previous dense path)
PROFILE_VARIANTS=${PROFILE_VARIANTS:-DFLASH_NONE=1}  # train_profile.py runs, one per environment
PROFILE=${PROFILE:-0}            # 1: prep profiles both training paths and picks one; 0: TRAIN_FAST
REGEN_SAMPLES=${REGEN_SAMPLES:-2} # responses per prompt: the greedy one, then sampled at 0.8
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 2)
train_args() {  # $1 = out folder; same data, seed and schedule in every run
  echo --target "$GGUF" --data "$W/data" --eval-data "$W/eval" --out "$1" --resume-from "$V2" \
    --block-size 16 --anchors 512 --epochs 40 --lr "$LR" --max-len 1024 --max-steps $((BASE + STEPS)) \
    --save-every 100000 --seed 0 --time-limit "$TRAIN_LIMIT"
}
t0=$SECONDS
log() { echo "[$((SECONDS - t0)) s] $*"; }

case $phase in
stage1)
  cp .stage/t5/aa/part "$W/stage/aa.part"
  rm -rf "$W/datasets" && cp -r .stage/data "$W/datasets"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.device_count(), 'transformers', transformers.__version__)"
  [ "${STAGE_BENCH:-0}" = 1 ] || { log "phase stage1 done"; exit 0; }
  log "GPU 0: bench_big (Qwen3-8B shape, random weights, CUDA graphs, no compile);" \
      "GPU 1: replay times of the demo shape, default compile vs max-autotune"
  CUDA_VISIBLE_DEVICES=0 timeout "${BIG_S:-170}" python3 scripts/bench_big.py --out "$OUT" ${BIG_ARGS:---no-compile} \
    > "$OUT/bench_big.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout "${KC_S:-200}" python3 scripts/kernel_count.py --random-target \
    --variants fused,autotune --out "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1 &
  wait
  tail -25 "$OUT/bench_big.txt"; grep -E "ms .*kernels" "$OUT/kernels.txt"
  ;;
stage)
  cp ".stage/t5/$2/part" "$W/stage/$2.part" && ls -la "$W/stage"
  if ls .stage/prompts/*.jsonl.gz >/dev/null 2>&1; then cp .stage/prompts/*.jsonl.gz "$W/"; fi
  ;;
prep)
  if ls .stage/prompts/*.jsonl.gz >/dev/null 2>&1; then cp .stage/prompts/*.jsonl.gz "$W/"; fi
  cat "$W"/stage/{aa,ab,ac,ad}.part .stage/t5/ae/part > "$GGUF"
  sha256sum "$GGUF" | cut -c1-16
  python3 -c "from pathlib import Path; from dflash.models.target_torch import gguf_to_cached_folder as g; print(g(Path('$GGUF')))"
  R=(python3 -m dflash data regenerate --target "$GGUF" --max-new-tokens 1024 --batch-size "${REGEN_B:-1024}"
     --samples "$REGEN_SAMPLES" --sample-temperature 0.8 --time-limit "${REGEN_S:-200}")
  log "regenerate: half 0 on GPU 0 ($REGEN_ENV0); eval set then half 1 on GPU 1 ($REGEN_ENV1)"
  env $REGEN_ENV0 CUDA_VISIBLE_DEVICES=0 "${R[@]}" --prompts "$W/half-0.jsonl.gz" --out "$W/data0" --seed 2 \
    > "$W/logs/regen0.txt" 2>&1 &
  (EV=gsm8k@16,math500@16,humaneval@16,mbpp@16,mt-bench@16
   DFLASH_BATCHED_KV_LENGTHS=0 CUDA_VISIBLE_DEVICES=1 python3 -m dflash data regenerate --target "$GGUF" --eval-only --prompts "$EV" \
     --out "$W/eval" --data-dir "$W/datasets" --max-new-tokens 256 --batch-size 128 > "$W/logs/regen-eval.txt" 2>&1
   env $REGEN_ENV1 CUDA_VISIBLE_DEVICES=1 "${R[@]}" --prompts "$W/half-1.jsonl.gz" --out "$W/data1" --seed 3 \
     > "$W/logs/regen1.txt" 2>&1) &
  wait
  tail -n 2 "$W"/logs/regen*.txt
  mkdir -p "$W/data" && cp "$W/data0/meta.json" "$W/data/"
  for r in 0 1; do for f in "$W/data$r"/shard-*.jsonl; do
    b=$(basename "$f"); cp "$f" "$W/data/r$r-$b"; done; done
  python3 - "$W/data" <<'EOF' | tee "$W/logs/data-stats.json"
import json, sys
from collections import Counter
from dflash.train.data import read_shards
s = read_shards(sys.argv[1]); src = Counter(x.id.split("/")[0] for x in s)
print(json.dumps({"records": len(s), "response_tokens": sum(len(x.response_ids) for x in s),
                  "prompts": len({x.id.split("#")[0] for x in s}), "by_source": src}))
EOF
  if [ "$PROFILE" != 1 ]; then
    echo "${TRAIN_FAST:-0}" > "$W/train_fast"; tar czf "$OUT/prep-logs.tgz" -C "$W" logs
    log "phase prep done (DFLASH_TRAIN_FAST=${TRAIN_FAST:-0}, no profile)"; exit 0
  fi
  log "training profile: old path (DFLASH_TRAIN_FAST=0) on GPU 0, new (=1) on GPU 1, side by side"
  for f in 0 1; do
    DFLASH_TRAIN_FAST=$f CUDA_VISIBLE_DEVICES=$f timeout 120 python3 scripts/train_profile.py --target "$GGUF" \
      --data "$W/data" --draft "$V2" --steps "${PROFILE_STEPS:-30}" --warmup 5 --out "$OUT/train_profile_fast$f.json" \
      > "$W/logs/profile-fast$f.txt" 2>&1 &
  done
  wait
  tail -n 4 "$W"/logs/profile-fast*.txt
  FAST=$(python3 scripts/pick_train_path.py "$OUT/train_profile_fast0.json" "$OUT/train_profile_fast1.json")
  echo "$FAST" > "$W/train_fast"; log "DFLASH_TRAIN_FAST=$FAST from here on"
  tar czf "$OUT/prep-logs.tgz" -C "$W" logs
  [ "$PREP_REF" = 1 ] || { log "phase prep done"; exit 0; }
  log "GPU 0: 1-GPU reference (a), 16,384 tokens a step; GPU 1: block 16 vs auto sweep (shipped draft)"
  DFLASH_TRAIN_FAST=$FAST CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m dflash train $(train_args "$W/run-a") \
    --batch-tokens 16384 --eval-every 100000 --pause-after "${A_S:-100}" > "$W/logs/train-a.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout "${SWEEP_S:-180}" python3 -m dflash benchmark transformers --model "$GGUF" \
    --draft "$V2" --max-new-tokens 256 --data-dir "$W/datasets" --dataset gsm8k --max-samples 64 \
    --block-size 16,auto --no-compile --output "$W/logs/b-sweep.jsonl" > "$W/logs/b-sweep.txt" 2>&1 &
  wait
  tail -n 3 "$W"/logs/train-a.txt; grep -E "│" "$W"/logs/b-sweep.txt | tail -4
  cp "$W/run-a/train_log.jsonl" "$OUT/train-a.jsonl"
  tar czf "$OUT/prep-logs.tgz" -C "$W" logs
  ;;
train)
  export DFLASH_TRAIN_FAST=$(cat "$W/train_fast" 2>/dev/null || echo 1)
  log "torchrun, 2 GPUs, 16,384 tokens a step per GPU, $TRAIN_LIMIT s, DFLASH_TRAIN_FAST=$DFLASH_TRAIN_FAST"
  timeout "${TRAIN_S:-580}" "${TORCHRUN[@]}" -m dflash train $(train_args "$W/draft") --batch-tokens 16384 \
    --eval-every 200 --pause-after "$PAUSE" >> "$W/logs/train-ddp.txt" 2>&1
  rc=$?; log "torchrun exit $rc"
  tail -n 25 "$W"/logs/train-ddp.txt
  cp "$W"/draft/*.safetensors "$OUT/" 2>/dev/null
  tar czf "$OUT/draft-small.tgz" -C "$W" $(cd "$W" && ls draft/*.json draft/*.jsonl draft/*.md 2>/dev/null) logs
  ;;
bench)
  D=$W/draft; [ -f "$D/config.json" ] || D=$V2
  B=(python3 -m dflash benchmark transformers --model "$GGUF" --draft "$D" --max-new-tokens 256
     --data-dir "$W/datasets")
  log "GPU 0: gsm8k 64 (compile), two single generates; GPU 1: other datasets (BENCH_FULL=1: + fp32 parity, HF)"
  (CUDA_VISIBLE_DEVICES=0 timeout 200 "${B[@]}" --dataset gsm8k --max-samples 64 --block-size 16 --check-parity \
     --output "$W/logs/b-gsm8k.jsonl" > "$W/logs/b-gsm8k.txt" 2>&1
   P=$(python3 -c "from dflash.data.datasets import load_prompts, select; print(select(load_prompts('gsm8k', '$W/datasets'), 1)[0].turns[0])")
   for i in 1 2 3; do  # 1: without generate's warm-up (the previous behaviour); 2, 3: with it
     [ $i = 1 ] && WU=0 || WU=64
     DFLASH_GENERATE_WARMUP=$WU CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m dflash generate transformers --model "$GGUF" --draft "$D" \
       "$P" --block-size 16 --max-new-tokens 256 --json > "$W/logs/generate-$i.json" 2> "$W/logs/generate-$i.err"
   done) &
  (CUDA_VISIBLE_DEVICES=1 timeout 190 "${B[@]}" --dataset math500,humaneval,mbpp,mt-bench --max-samples 32 \
     --block-size 16 --output "$W/logs/b-other.jsonl" > "$W/logs/b-other.txt" 2>&1
   if [ "$BENCH_FULL" = 1 ]; then
     CUDA_VISIBLE_DEVICES=1 timeout 75 "${B[@]}" --dataset gsm8k --max-samples 16 --block-size 16 --dtype float32 --no-compile \
       --check-parity --output "$W/logs/b-fp32.jsonl" > "$W/logs/b-fp32.txt" 2>&1
     CUDA_VISIBLE_DEVICES=1 timeout 200 python3 scripts/hf_baseline.py --model "$GGUF" --draft "$D" \
       --data-dir "$W/datasets" --n 8 --out "$W/logs" > "$W/logs/hf_baseline.txt" 2>&1
   fi) &
  wait
  tar czf "$OUT/bench.tgz" -C "$W" logs
  for f in "$W"/logs/b-*.txt "$W"/logs/hf_baseline.txt; do echo "== $f"; tail -n 14 "$f"; done
  for i in 1 2 3; do python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1][-15:], {k: r[k] for k in ('decode_tok_per_s','decode_s','ttft_s','verify_steps','new_tokens')})" "$W/logs/generate-$i.json" || tail -n 3 "$W/logs/generate-$i.err"; done
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
log "phase $phase done"
