#!/usr/bin/env bash
# The demo pair's speed figures on one GPU (docs/benchmarks.md), in two device calls (a third is
# optional); the staging follows ../shared/gpu/FACTS.md.
# Prepare here (once):
#   ../shared/gpu/split-target.sh                        # .stage/target/{a,b}/part (2 x <= 50 MB)
#   mkdir -p .stage/data/gsm8k && cp ../shared/datasets/gsm8k/test.jsonl .stage/data/gsm8k/
#   pip download --no-deps -d .whl gguf                  # transformers reads GGUF with it
# Call 1 (stage half of the demo target, then the 8B-shaped loop benchmark, <= 9 min; partial
# results are kept if compiling 5 graphs of the 8B shape takes longer: BIG_ARGS=--no-compile):
#   bash scripts/gpu_speed.sh big         carry: .stage/target/a
# Call 2 (the demo pair; the machine must still be warm from call 1, <= 9 min): compiled
# benchmark (64 prompts, parity classified), one dflash generate, HF generate vs dflash in one
# process on the same 8 prompts:
#   bash scripts/gpu_speed.sh demo        carry: .stage/target/b .stage/data .whl
# Call 3 (optional, still warm): the same benchmark eager (graphs without compile), float32 parity
# on 16 prompts, and bf16 with --uniform-width (baseline at width L: bitwise parity and its cost):
#   bash scripts/gpu_speed.sh more        carry: .stage/target/b .stage/data .whl
# Everything lands in $OUT: bench_big.json, gsm8k-{compile,eager,uniform,fp32}.{jsonl,txt},
# generate.json, hf_baseline.json. Each step has its own timeout and failure message, so one
# failure does not lose the others.
set -uo pipefail
phase=${1:?usage: gpu_speed.sh big|demo|more}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DFLASH_CACHE=/tmp/dflash-cache PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/speed-out}; mkdir -p "$OUT"
GGUF=/tmp/smollm2.gguf
DRAFT=${DRAFT:-dflash/assets/smollm2-135m-instruct-dflash}
N=${N:-64} NEW=${NEW:-256}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
case $phase in
big)
  mkdir -p /tmp/stage && cp .stage/target/a/part /tmp/stage/a.part && ls -la /tmp/stage
  timeout "${BIG_S:-540}" python3 scripts/bench_big.py --out "$OUT" ${BIG_ARGS:-} \
    > "$OUT/bench_big.txt" 2>&1 || echo "bench_big failed or timed out (see bench_big.txt)"
  tail -12 "$OUT/bench_big.txt" ;;
demo|more)
  [ -f /tmp/site/gguf/__init__.py ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  [ -f "$GGUF" ] || cat /tmp/stage/a.part .stage/target/b/part > "$GGUF"
  sha256sum "$GGUF" | cut -c1-16
  common=(--model "$GGUF" --draft "$DRAFT" --dataset gsm8k --max-new-tokens "$NEW"
          --data-dir .stage/data --check-parity)
  if [ "$phase" = demo ]; then
    # 1. benchmark with torch.compile inside the graphs (the default); compiles 3 graphs first
    timeout "${COMPILE_S:-270}" python3 -m dflash benchmark transformers "${common[@]}" --max-samples "$N" \
      --compile --output "$OUT/gsm8k-compile.jsonl" > "$OUT/gsm8k-compile.txt" 2>&1 || echo "compiled benchmark failed"
    # 2. one dflash generate of 256 tokens (kernels now cached on disk; no capture while timed)
    timeout 120 python3 -m dflash generate transformers --model "$GGUF" --draft "$DRAFT" \
      "How many positive whole-number divisors does 196 have?" --max-new-tokens "$NEW" --json \
      > "$OUT/generate.json" 2> "$OUT/generate.err" || echo "generate failed"
    # 3. HF generate vs dflash in one process, same 8 prompts
    timeout 150 python3 scripts/hf_baseline.py --model "$GGUF" --draft "$DRAFT" --data-dir .stage/data \
      --n 8 --max-new-tokens "$NEW" --out "$OUT" > "$OUT/hf_baseline.txt" 2>&1 || echo "hf_baseline failed"
    runs="gsm8k-compile"
  else
    # 4. the same benchmark eager (graphs, no compile)
    timeout "${EAGER_S:-170}" python3 -m dflash benchmark transformers "${common[@]}" --max-samples "$N" \
      --no-compile --output "$OUT/gsm8k-eager.jsonl" > "$OUT/gsm8k-eager.txt" 2>&1 || echo "eager benchmark failed"
    # 5. float32 exactness on the GPU (16 prompts)
    timeout "${FP32_S:-120}" python3 -m dflash benchmark transformers "${common[@]}" --max-samples 16 \
      --dtype float32 --output "$OUT/gsm8k-fp32.jsonl" > "$OUT/gsm8k-fp32.txt" 2>&1 || echo "fp32 benchmark failed"
    # 6. bf16 with every verify at width L (bitwise parity option and its cost), 32 prompts
    timeout "${UNIFORM_S:-200}" python3 -m dflash benchmark transformers "${common[@]}" --max-samples 32 \
      --uniform-width --output "$OUT/gsm8k-uniform.jsonl" > "$OUT/gsm8k-uniform.txt" 2>&1 || echo "uniform benchmark failed"
    runs="gsm8k-eager gsm8k-fp32 gsm8k-uniform"
  fi
  for f in $runs; do echo "== $f"; grep -E "tok/s|speedup|parity|near-tie|τ" "$OUT/$f.txt" | head -12; tail -2 "$OUT/$f.txt" | cut -c1-300; done
  if [ "$phase" = demo ]; then
    python3 -c "import json;d=json.load(open('$OUT/generate.json'));print('generate', d['decode_tok_per_s'], d['mean_acceptance_length'])" || tail -3 "$OUT/generate.err"
    tail -1 "$OUT/hf_baseline.txt"
  fi ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
