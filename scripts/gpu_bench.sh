#!/usr/bin/env bash
# Measures the demo pair on one H200 in two back-to-back device calls (see ../shared/gpu/FACTS.md).
# Prepare here:  split the GGUF into 20 MB chunks .stage/t5/{aa..ae}/part (split -b 20000000) so
#                that a chunk plus the tracked tree (the 38 MB shipped draft) stays under the
#                64 MiB carry limit; copy the benchmark datasets to .stage/data; download the gguf
#                wheel into .whl/.
#   calls 1-4: bash scripts/gpu_bench.sh stage aa|ab|ac|ad   carry .stage/t5/<part> (.whl once)
#   call 5:    bash scripts/gpu_bench.sh bench               carry .stage/t5/ae .whl .stage/data
# Results (JSON/JSONL) are written to $OUT.
set -euo pipefail
phase=${1:?usage: gpu_bench.sh stage|bench}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DFLASH_CACHE=/tmp/dflash-cache
OUT=${OUT:-/tmp/bench-out}; mkdir -p "$OUT"
GGUF=/tmp/smollm2.gguf
DRAFT=${DRAFT:-dflash/assets/smollm2-135m-instruct-dflash}
N=${N:-64} NEW=${NEW:-256} LIMIT_S=${LIMIT_S:-400}
case $phase in
stage)
  part=${2:?stage a|b}
  mkdir -p /tmp/stage && cp ".stage/t5/$part/part" "/tmp/stage/$part.part" && ls -la /tmp/stage ;;
bench)
  [ -f /tmp/site/gguf/__init__.py ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  [ -f "$GGUF" ] || cat /tmp/stage/aa.part /tmp/stage/ab.part /tmp/stage/ac.part /tmp/stage/ad.part .stage/t5/ae/part > "$GGUF"
  sha256sum "$GGUF" | cut -c1-16
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  P="How many positive whole-number divisors does 196 have?"
  for g in --cuda-graphs --no-cuda-graphs; do  # smoke: both paths, same ids expected
    python3 -m dflash generate transformers --model "$GGUF" --draft "$DRAFT" "$P" \
      --max-new-tokens 256 --json $g > "$OUT/generate${g#--}.json" || echo "generate $g failed"
  done
  timeout "$LIMIT_S" python3 -m dflash benchmark transformers --model "$GGUF" --draft "$DRAFT" \
    --dataset gsm8k --max-samples "$N" --max-new-tokens "$NEW" --data-dir .stage/data \
    --check-parity --output "$OUT/gsm8k.jsonl" > "$OUT/bench.txt" 2> "$OUT/bench.err" || echo "bf16 benchmark failed"
  # float32: the exactness contract (greedy parity) on the GPU
  timeout "${LIMIT32_S:-100}" python3 -m dflash benchmark transformers --model "$GGUF" --draft "$DRAFT" \
    --dataset gsm8k --max-samples "${N32:-16}" --max-new-tokens "$NEW" --data-dir .stage/data \
    --dtype float32 --check-parity --output "$OUT/gsm8k-fp32.jsonl" > "$OUT/bench-fp32.txt" 2>&1 || echo "fp32 benchmark failed"
  tail -3 "$OUT/bench-fp32.txt"
  tail -25 "$OUT/bench.txt" ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
