#!/usr/bin/env bash
# Data-parallel training scaling on 2 GPUs (issue 12): samples/s of 2 GPUs vs 1 at the same
# per-GPU batch, and the loss curve of 2 GPUs vs 1 GPU at the same global batch.
#
#   TARGET=/tmp/target.gguf DATA=.stage/train-data DRAFT=.stage/draft-init \
#     bash scripts/ddp_scaling.sh [a|b|c|d|summary|all]      (default: all)
#
#   a: 1 GPU,  --max-steps 60,  --batch-tokens 16384 (log every 10)           -> $OUT/a.train_log.jsonl
#   b: 2 GPUs, --max-steps 60,  --batch-tokens 16384 per rank (log every 10)  -> $OUT/b.train_log.jsonl
#   c: 1 GPU,  --max-steps 100, --batch-tokens 32768 (log every step)         -> $OUT/c.train_log.jsonl
#   d: 2 GPUs, --max-steps 100, --batch-tokens 16384 per rank (every step)    -> $OUT/d.train_log.jsonl
#      (c and d see the same global batches and anchors: same seed, 2 x 16384 = 32768)
#   summary: $OUT/summary.json: samples/s of a and b and their ratio (records after step 10, so
#            the compile warm-up is left out), max |loss difference| between c and d per step.
# Each phase has its own timeout (PHASE_S, default 540 s) and keeps going after a failure; the
# console output of each run is in $OUT/<phase>.txt. Settings: SEED, LR, MAX_LEN, LAYERS/BLOCK
# come from the draft in $DRAFT (--init). NVLink multicast stays off (the machine's notes).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DFLASH_CACHE=${DFLASH_CACHE:-/tmp/dflash-cache}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
TARGET=${TARGET:?set TARGET to the target .gguf (or model folder)}
DATA=${DATA:?set DATA to the regenerated training data folder}
DRAFT=${DRAFT:?set DRAFT to the draft folder to start from (--init)}
OUT=${OUT:-/tmp/ddp-scaling}; mkdir -p "$OUT"
SEED=${SEED:-0} LR=${LR:-6e-4} MAX_LEN=${MAX_LEN:-2048} PHASE_S=${PHASE_S:-540} PY=${PY:-python3}
TOKENS=${TOKENS:-16384} STEPS_AB=${STEPS_AB:-60} STEPS_CD=${STEPS_CD:-100}  # smaller for a CPU smoke run
if command -v torchrun >/dev/null; then TORCHRUN=(torchrun); else TORCHRUN=("$PY" -m torch.distributed.run); fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true

common=(--target "$TARGET" --data "$DATA" --init "$DRAFT" --seed "$SEED" --lr "$LR"
        --max-len "$MAX_LEN" --epochs 1 --eval-every 100000 --save-every 100000)

run() {  # run <phase> <gpus> <steps> <batch tokens per process> <log every>
  local phase=$1 gpus=$2 steps=$3 tokens=$4 every=$5
  rm -rf "${OUT:?}/$phase"
  local args=(train "${common[@]}" --out "$OUT/$phase" --max-steps "$steps" --batch-tokens "$tokens"
              --log-every "$every")
  echo "== $phase: $gpus GPU(s), $steps steps, --batch-tokens $tokens per process"
  if [ "$gpus" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout "$PHASE_S" "$PY" -m dflash "${args[@]}" > "$OUT/$phase.txt" 2>&1
  else
    timeout "$PHASE_S" "${TORCHRUN[@]}" --standalone --nproc-per-node "$gpus" -m dflash "${args[@]}" \
      > "$OUT/$phase.txt" 2>&1
  fi
  local rc=$?
  [ $rc = 0 ] || echo "$phase failed or timed out (rc $rc, see $OUT/$phase.txt)"
  tail -3 "$OUT/$phase.txt"
  # the log lives in the output folder; keep a flat copy next to the summary
  [ -f "$OUT/$phase/train_log.jsonl" ] && cp "$OUT/$phase/train_log.jsonl" "$OUT/$phase.train_log.jsonl"
  rm -rf "$OUT/$phase/state"  # float32 weights and moments: not needed for the figures
}

summary() {
  "$PY" - "$OUT" <<'EOF'
import json, math, sys
from pathlib import Path

out = Path(sys.argv[1])

def records(phase):
    p = out / f"{phase}.train_log.jsonl"
    if not p.is_file():
        return []
    return [r for r in map(json.loads, p.read_text().splitlines()) if "loss" in r]

def rate(recs):  # over the records after the warm-up (step > 10: compile, first batches)
    rs = [r for r in recs if r["step"] > 10 and r.get("train_s")]
    if not rs:
        return None, None
    secs = sum(r["train_s"] for r in rs)
    samples = sum(r["samples"] for r in rs)
    tokens = sum(r["tokens_per_s"] * r["train_s"] for r in rs)
    return samples / secs, tokens / secs

a, b, c, d = (records(p) for p in "abcd")
res = {"phases": {p: len(r) for p, r in zip("abcd", (a, b, c, d))}}
for name, recs in (("a_1gpu", a), ("b_2gpu", b)):
    sps, tps = rate(recs)
    res[name] = {"samples_per_s": sps, "tokens_per_s": tps}
if res["a_1gpu"]["samples_per_s"] and res["b_2gpu"]["samples_per_s"]:
    res["samples_per_s_ratio_2gpu_vs_1gpu"] = res["b_2gpu"]["samples_per_s"] / res["a_1gpu"]["samples_per_s"]
lc, ld = {r["step"]: r["loss"] for r in c}, {r["step"]: r["loss"] for r in d}
common = sorted(set(lc) & set(ld))
if common:
    diffs = [abs(lc[s] - ld[s]) for s in common if s <= 100]
    res["loss_c_vs_d"] = {"steps_compared": len(diffs), "max_abs_diff": max(diffs),
                          "mean_abs_diff": sum(diffs) / len(diffs),
                          "first_step_abs_diff": abs(lc[common[0]] - ld[common[0]]),
                          "loss_c_first_last": [lc[common[0]], lc[common[-1]]],
                          "loss_d_first_last": [ld[common[0]], ld[common[-1]]],
                          "step_to_step_noise_c": sum(abs(lc[s] - lc[t]) for s, t in zip(common, common[1:]))
                                                  / max(1, len(common) - 1)}
(out / "summary.json").write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(res, indent=1))
EOF
}

phase=${1:-all}
case $phase in
  a) run a 1 "$STEPS_AB" "$TOKENS" 10 ;;
  b) run b 2 "$STEPS_AB" "$TOKENS" 10 ;;
  c) run c 1 "$STEPS_CD" $((2 * TOKENS)) 1 ;;
  d) run d 2 "$STEPS_CD" "$TOKENS" 1 ;;
  summary) ;;
  all) run a 1 "$STEPS_AB" "$TOKENS" 10; run b 2 "$STEPS_AB" "$TOKENS" 10
       run c 1 "$STEPS_CD" $((2 * TOKENS)) 1; run d 2 "$STEPS_CD" "$TOKENS" 1 ;;
  *) echo "usage: ddp_scaling.sh [a|b|c|d|summary|all]"; exit 2 ;;
esac
summary
