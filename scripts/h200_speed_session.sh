#!/usr/bin/env bash
# The demo pair's speed on one H200 (the `device` tool's nvidia-h200), in back-to-back calls.
#
# Prepare here (CPU), under the git-ignored .stage/ (see scripts/x2_session.sh):
#   .stage/t5/{aa..ae}/part (the demo GGUF cut in 20 MB parts), .stage/data, .stage/whl (gguf)
# Since the twentieth session the checkout (52.7 MB tracked) plus a 14.1 MB part and the wheel
# passes the 64 MiB a call may send: move benchmarks/results out of the working tree for the
# stage calls and the real-pair call (none of them reads it), and put it back afterwards.
# Calls (carry in brackets):
#   1 stage1 [lin]  [.stage/t5/aa .stage/whl]   (lin: bench_big with/without the fused linears too)
#   1' glue        [.stage/t5/aa]  stage1's copy, then smollm2 bench_big: glue compiled / eager / triton linear
#   attn           (no carry)  one-slice split-KV attention against the default, bench_big smollm2
#   merge          [.stage/old]  split-KV with the in-kernel merge against the previous tree
#   next           (no carry)  fp32 kernel time, 8B shape, split 512 vs 256 (the tenth session's first call)
#   pdl|pdl2|pdlprof|pdlk (no carry)  DFLASH_PDL and DFLASH_LINEAR=all experiments (tenth session)
#   pdlgraphs      (no carry)  per-graph replay times with and without DFLASH_PDL=1 (eleventh session)
#   pdlloop        (no carry)  the device loop's graphs, steps and host launch times, PDL off/on
#   benchpdl [VARIANTS] [.stage/t5/ae .stage/data] after stage1..ad: gsm8k 64, DFLASH_PDL 0/draft/1
#   pdldefault     (no carry)  PDL bit-for-bit check, 8B shape with PDL (the default since then) and without
#   seq            (no carry)  every kernel of the loop's graphs in launch order (the twelfth session's first call)
#   rope           (no carry)  DFLASH_ROPE=1 against 0: bf16 error, loop timings, 8B block 1 (twelfth session)
#   prefetch       (no carry)  DFLASH_PREFETCH: L2 check, 8B block 1 per budget (thirteenth session, unmeasured)
#   pdlpre         (no carry)  DFLASH_PDL_PREFETCH: 8B block 1 per budget, demo loop timings at prompt 300 (next session's first call)
#   k300           (no carry)  demo loop timings at prompt 300 and the 8B shape's block 1 (fifteenth session)
#   v16a [VARIANTS] [.stage/t6/aa .stage/whl]  stage1's copy, attn_sweep.py, demo loop timings at prompt 300 per variant
#   next17         (no carry)  8B blocks 1,16 default vs DFLASH_LINEAR=all (new tiles), demo loop timings, attn_sweep --cases long (next session's first call)
#   v16b [VARIANTS [8B VARIANTS]] [.stage/t6/aa .stage/whl]  stage1's copy, demo loop timings at prompt 300 and 8B block 1 per variant
#   v17a           [.stage/t7/aa .stage/whl]  stage1's copy, Qwen3-8B block 1 default (profiled) vs DFLASH_LINEAR=triton
#   v17b           [.stage/t7/aa .stage/whl]  stage1's copy, DFLASH_GLU on/off: demo loop timings, Qwen3-8B block 1
#   next18         [.stage/t7/aa .stage/whl]  stage1's copy, DFLASH_FUSE_NORM=1 against the default: demo loop timings, 8B block 1
#                  (run twice: the seventeenth session's partial-sums form, then the eighteenth's folded form)
#   v18rn          (no carry)  (measured, form removed) fma vs mma vs norm kernels: Qwen3-8B block 1, demo loop timings
#   v19a, benchcat (branch exp/draft-cat-rn) the draft's input norm inside its qkv kernel against the file before it
#   prefetchdemo   (no carry)  DFLASH_PREFETCH 0 against 8 MiB: demo-shape loop timings
#   benchvar "V1 V2" [.stage/t6/af .stage/data] after stage1..ae: gsm8k 64 per env variant (default, DFLASH_ATTN_SPLIT=128 ...)
#   exp13          (no carry)  default / DFLASH_STEP_COMPILE=1 / DFLASH_HEAD_ARGMAX=1 / DFLASH_PREFETCH=8 / all: loop timings
#   v23a           [.stage/t7/aa .stage/whl]  stage aa; DFLASH_QKV_ROPE on/off: demo loop timings at prompt 300, Qwen3-8B blocks 1,16
#   v23b           [.stage/t7/aa .stage/whl]  stage aa; DFLASH_QKV_ROPE (column pairs) on/off: demo loop timings, twice
#   v23d [VARS]    [.stage/t7/aa .stage/whl]  stage aa; demo loop timings at prompt 300 per variant (e.g. DFLASH_HEAD_ARGMAX=1)
#   v24a           (no carry)  small_linear sweep with cold weights (Qwen3-8B shapes), then Qwen3-8B blocks 1,16:
#                  default against the sweep's best configs (DFLASH_LINEAR_CONFIG from best_config.env), alternating
#   v24b           (no carry)  deeper cold sweep (8B), cold sweep of the demo's shapes (rows 1,16,32), Qwen3-8B
#                  blocks 1,16 with v24a's best, with it and DFLASH_ATTN_SPLIT=128, with the deeper sweep's best;
#                  demo loop timings at prompt 300, default against the demo sweep's best
#   v24c           (no carry)  Qwen3-8B blocks 1,16: new defaults (TUNED configs, 1-row split 128) against the old
#                  (as env) and against split 128 at every target width; block 1 at prompt 2000, 128 against 256
#   v25a           (no carry)  DFLASH_ATTN_EARLY 2 against 0 (then 1): Qwen3-8B blocks 1,16 alternating, demo loop
#                  timings at prompt 300 (2, the first K/V tile before the wait too, was removed after this run)
#   v25b           (no carry)  DFLASH_ATTN_EARLY 1 against 0, DFLASH_PDL_PREFETCH=<8|16|32>,attn (o_proj only; removed
#                  after this run): Qwen3-8B blocks 1,16, demo loop timings at prompt 300
#   v25c           (no carry)  DFLASH_NORM_KERNEL 1 against 0, then both it and DFLASH_ATTN_EARLY off: Qwen3-8B blocks 1,16
#   v26a           (no carry)  phase_overhead.py (kernel chain vs persistent kernel), the demo graphs' kernel sequence
#   v26c           (no carry)  the defaults after the review fixes: Qwen3-8B blocks 1,16 twice, demo loop timings
#   v26d           (no carry)  DFLASH_LINEAR_ONE_TILE=1 against the default: demo loop timings, alternating
#   2-4 stage ab|ac|ad [torch|triton]  [.stage/t5/<part>]  (with an 8B-shaped bench_big meanwhile)
#   5 bench      [.stage/t5/ae .stage/data]  gsm8k 64 (bf16, compile, parity) and one single generate;
#                results in $OUT (b-gsm8k.jsonl / .txt, generate.json, step_profile.json: GPU busy
#                against wall per step on 4 real requests, PROFILE=0 skips it)
set -u
phase=${1:?usage: h200_speed_session.sh stage1|glue|stage PART [torch|triton]|bench [full]|benchvar [VARIANTS]|kernels|attn|merge|next|pdl|pdl2|pdlprof|pdlk|pdlgraphs|pdlloop|benchpdl|pdldefault|seq|rope|prefetch|prefetchdemo|pdlpre|k300|v16a|v16b|next17|v17a|v17b|next18|v18rn|exp13|big8b}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DFLASH_CACHE=/tmp/dflash-cache
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
W=/tmp/demo; mkdir -p "$W/stage"
if [ ! -d /tmp/site/gguf ] && ls .stage/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
GGUF=$W/smollm2.gguf
# real_pair [t5|t6|t7]: the demo GGUF joined from the parts staged in $W/stage and the last part
# carried (t5: 5 parts of 20 MB, t6: 6 of 16.5 MB, t7: 7 of 14.1 MB; none given: the finest split
# carried), and the benchmark datasets copied to $W/datasets
real_pair() {
  local t=${1:-}
  if [ -z "$t" ]; then
    if [ -d .stage/t7/ag ]; then t=t7; elif [ -d .stage/t6/af ]; then t=t6; else t=t5; fi
  fi
  case $t in
  t7) cat "$W"/stage/{aa,ab,ac,ad,ae,af}.part .stage/t7/ag/part > "$GGUF" ;;
  t6) cat "$W"/stage/{aa,ab,ac,ad,ae}.part .stage/t6/af/part > "$GGUF" ;;
  t5) cat "$W"/stage/{aa,ab,ac,ad}.part .stage/t5/ae/part > "$GGUF" ;;
  esac
  rm -rf "$W/datasets" && cp -r .stage/data "$W/datasets"
}
# k300_variants STOP "V1 V2 ...": demo loop timings at prompt 300 (kernel_count.py, random target)
# once per env variant (a comma-separated list of VAR=value, or "default"), none started past STOP s
k300_variants() {
  local v f E
  for v in $2; do
    [ "$SECONDS" -gt "$1" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    E=(env); [ "$v" = default ] || E+=(${v//,/ }); f=${v//[=,]/-}
    "${E[@]}" timeout 140 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 300 \
      --out "$OUT/kernels-p300-$f.json" > "/tmp/k-$f.log" 2>&1; echo "$v rc $? at ${SECONDS}s"
    grep -v Warn "/tmp/k-$f.log" | grep -E "loop|draft-16|verify-1 " | cut -c1-100
  done
}
# q8b_block1 STOP TAG "V1 V2 ..." [profile]: Qwen3-8B block 1 (bench_big.py) once per env variant
# (as k300_variants), none started past STOP s, results in $OUT/bench_big-q8b-TAG-<variant>.json;
# "profile": the default variant with --profile
q8b_block1() {
  local v f E P
  for v in $3; do
    [ "$SECONDS" -gt "$1" ] && { echo "skip 8b $v at ${SECONDS}s"; continue; }
    E=(env); [ "$v" = default ] || E+=(${v//,/ }); f=${v//[=,]/-}; P=()
    [ "$v" = default ] && [ "${4:-}" = profile ] && P=(--profile)
    "${E[@]}" timeout 150 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1 --steps 16 "${P[@]}" \
      --out "/tmp/bb8-$f" > "/tmp/bb8-$f.log" 2>&1; echo "8b $v rc $? at ${SECONDS}s"
    cp "/tmp/bb8-$f/bench_big.json" "$OUT/bench_big-q8b-$2-$f.json"
    grep -o '"ms_per_step": [0-9.]*\|"x_floor": [0-9.]*\|"diverged_at": [0-9a-z]*' "/tmp/bb8-$f.log" | tr '\n' ' '; echo
  done
}
# q8b_named TAG NAME TIMEOUT [bench_big args]: Qwen3-8B bench_big under the caller's env prefix E
# (an array, e.g. E=(env VAR=value)), saved as $OUT/bench_big-q8b-TAG-NAME-<n>.json (n: next free)
q8b_named() {
  local tag=$1 v=$2 t=$3 n=1; shift 3
  rm -rf "/tmp/bb8-$v"
  "${E[@]}" timeout "$t" python3 scripts/bench_big.py --shape qwen3-8b --steps 16 "$@" \
    --out "/tmp/bb8-$v" > "/tmp/bb8-$v.log" 2>&1; echo "8b $v rc $? at ${SECONDS}s"
  while [ -e "$OUT/bench_big-q8b-$tag-$v-$n.json" ]; do n=$((n+1)); done
  cp "/tmp/bb8-$v/bench_big.json" "$OUT/bench_big-q8b-$tag-$v-$n.json"
  grep -o '"ms_per_step": [0-9.]*\|"x_floor": [0-9.]*\|"diverged_at": [0-9a-zN]*' "/tmp/bb8-$v.log" | tr '\n' ' '; echo
}
D=dflash/assets/smollm2-135m-instruct-dflash
case $phase in
stage1)
  for t in t5 t6 t7; do [ -d ".stage/$t/aa" ] && cp ".stage/$t/aa/part" "$W/stage/aa.part"; done
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  if [ "${2:-}" = lin ]; then  # the fused-linear kernels on/off on both random shapes meanwhile
    for shape in qwen3-8b smollm2; do
      BB=(python3 scripts/bench_big.py --shape "$shape" --blocks 1,16)
      [ "$shape" = smollm2 ] && BB+=(--prompt-len 160) || BB+=(--steps 16)
      DFLASH_LINEAR=triton timeout 200 "${BB[@]}" --out "/tmp/bb-$shape-lin" > "$OUT/bb-$shape-lin.log" 2>&1
      cp "/tmp/bb-$shape-lin/bench_big.json" "$OUT/bench_big-$shape-lin.json"; tail -n 2 "$OUT/bb-$shape-lin.log"
      if [ "$shape" = qwen3-8b ]; then
        DFLASH_LINEAR=torch timeout 170 "${BB[@]}" --out /tmp/bb8-torch > "$OUT/bb-$shape-torch.log" 2>&1
        cp /tmp/bb8-torch/bench_big.json "$OUT/bench_big-$shape-torch.json"; tail -n 2 "$OUT/bb-$shape-torch.log"
      fi
    done
  fi
  ;;
stage)  # optional: one 8B-shaped bench_big with DFLASH_LINEAR=$3 (torch|triton) meanwhile
  for t in t5 t6 t7; do [ -d ".stage/$t/$2" ] && cp ".stage/$t/$2/part" "$W/stage/$2.part"; done; ls -la "$W/stage"
  if [ -n "${3:-}" ]; then
    DFLASH_LINEAR=$3 timeout 250 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1,16 --steps 16 \
      --out "/tmp/bb8-$3" > "$OUT/bb-q8b-$3.log" 2>&1
    cp "/tmp/bb8-$3/bench_big.json" "$OUT/bench_big-q8b-$3.json"; tail -n 2 "$OUT/bb-q8b-$3.log"
  fi
  ;;
glue)  # random SmolLM2-shaped pair: compiled device-loop glue on/off, fused linears, side by side
  cp .stage/t5/aa/part "$W/stage/aa.part"
  BB=(python3 scripts/bench_big.py --shape smollm2 --prompt-len 160 --blocks 1,16)
  for v in on off lin; do
    case $v in on) E=(env) ;; off) E=(env DFLASH_COMPILE_GLUE=0) ;; lin) E=(env DFLASH_LINEAR=triton) ;; esac
    [ $v = on ] && P=(--profile) || P=()
    "${E[@]}" timeout 170 "${BB[@]}" "${P[@]}" --out "/tmp/bb-$v" > "$OUT/bb-smol-$v.log" 2>&1
    cp "/tmp/bb-$v/bench_big.json" "$OUT/bench_big-smol-$v.json"; grep ms_per_step "$OUT/bb-smol-$v.log" | cut -c1-90
  done
  ;;
bench)  # the last part carried: .stage/t5/ae (20 MB parts) or .stage/t6/af (16.5 MB parts, twelfth session)
  real_pair
  B=(python3 -m dflash benchmark transformers --model "$GGUF" --draft "$D" --max-new-tokens 256
     --data-dir "$W/datasets")
  timeout "${BENCH_S:-300}" "${B[@]}" --dataset gsm8k --max-samples 64 --block-size 16 --check-parity \
    --output "$OUT/b-gsm8k.jsonl" > "$OUT/b-gsm8k.txt" 2>&1
  tail -n 16 "$OUT/b-gsm8k.txt"
  P=$(python3 -c "from dflash.data.datasets import load_prompts, select; print(select(load_prompts('gsm8k', '$W/datasets'), 1)[0].turns[0])")
  timeout 90 python3 -m dflash generate transformers --model "$GGUF" --draft "$D" "$P" --block-size 16 \
    --max-new-tokens 256 --json > "$OUT/generate.json" 2> "$OUT/generate.err"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r[k] for k in ('decode_tok_per_s','decode_s','ttft_s','warmup_s','verify_steps','new_tokens')})" "$OUT/generate.json" || tail -n 3 "$OUT/generate.err"
  if [ "${PROFILE:-1}" = 1 ]; then  # real requests: GPU busy against wall per step (thirteenth session)
    timeout "${PROFILE_S:-150}" python3 scripts/step_profile.py --model "$GGUF" --draft "$D" --data-dir "$W/datasets" \
      --n 4 --out "$OUT/step_profile.json" 2>&1 | grep '^{' | cut -c1-230
  fi
  if [ "${2:-}" = full ]; then  # float32 parity on 16 prompts; HF generate in the same process
    timeout 150 "${B[@]}" --dataset gsm8k --max-samples 16 --block-size 16 --check-parity --dtype float32 \
      --output "$OUT/b-fp32.jsonl" > "$OUT/b-fp32.txt" 2>&1
    tail -n 6 "$OUT/b-fp32.txt"
    timeout 150 python3 scripts/hf_baseline.py --model "$GGUF" --draft "$D" --data-dir "$W/datasets" --n 4 \
      --out "$OUT" > /dev/null 2>&1; tail -c 600 "$OUT/hf_baseline.json"
  fi
  ;;
benchpdl)  # [.stage/t5/ae .stage/data] gsm8k 64 on the real pair with DFLASH_PDL 0, draft, 1
  # (each a whole benchmark run: its baseline and DFlash side by side); $2 = the variants
  real_pair t5
  B=(python3 -m dflash benchmark transformers --model "$GGUF" --draft "$D" --max-new-tokens 256
     --data-dir "$W/datasets" --dataset gsm8k --max-samples 64 --block-size 16 --check-parity)
  for v in ${2:-0 draft 1}; do
    [ "$SECONDS" -gt "${BENCH_STOP:-400}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    E=(env DFLASH_PDL=$v)
    "${E[@]}" timeout "${BENCH_S:-200}" "${B[@]}" --output "$OUT/b-gsm8k-pdl-$v.jsonl" > "$OUT/b-gsm8k-pdl-$v.txt" 2>&1
    echo "$v rc $? at ${SECONDS}s"; grep -E "tok/s|speedup|τ|unexplained" "$OUT/b-gsm8k-pdl-$v.txt" | grep -v "━" | cut -c1-80
  done
  ;;
benchvar)  # [.stage/t7/ag .stage/data] after stage1..af (t7: 14.1 MB parts, so that a part and the
  # 51 MB checkout fit a call's 64 MiB; t6's 16.5 MB parts no longer do): gsm8k 64 on the real pair once per
  # variant in $2 (space-separated; each a comma-separated list of VAR=value, "default" for none),
  # e.g. "default DFLASH_ATTN_SPLIT=128 DFLASH_ATTN_SPLIT=64" (fourteenth session's next step)
  real_pair
  B=(python3 -m dflash benchmark transformers --model "$GGUF" --draft "$D" --max-new-tokens 256
     --data-dir "$W/datasets" --dataset gsm8k --max-samples 64 --block-size 16 --check-parity)
  for v in ${2:-default DFLASH_ATTN_SPLIT=128 DFLASH_ATTN_SPLIT=64}; do
    [ "$SECONDS" -gt "${BENCH_STOP:-400}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    E=(env); [ "$v" = default ] || E+=(${v//,/ }); f=${v//[=,]/-}
    "${E[@]}" timeout "${BENCH_S:-200}" "${B[@]}" --output "$OUT/b-gsm8k-$f.jsonl" > "$OUT/b-gsm8k-$f.txt" 2>&1
    echo "$v rc $? at ${SECONDS}s"; grep -E "throughput|speedup:|unexplained" "$OUT/b-gsm8k-$f.txt" | grep -v "━" | cut -c1-80
  done
  ;;
kernels)  # random SmolLM2-shaped pair: fused linears on/off side by side, then the config sweep
  BB=(python3 scripts/bench_big.py --shape smollm2 --prompt-len 160 --blocks 1,16)
  DFLASH_LINEAR=triton timeout 200 "${BB[@]}" --profile --out /tmp/bb-lin > "$OUT/bb-smol-lin.log" 2>&1
  cp /tmp/bb-lin/bench_big.json "$OUT/bench_big-smol-lin.json"; tail -n 2 "$OUT/bb-smol-lin.log"
  DFLASH_LINEAR=torch timeout 150 "${BB[@]}" --out /tmp/bb-torch > "$OUT/bb-smol-torch.log" 2>&1
  cp /tmp/bb-torch/bench_big.json "$OUT/bench_big-smol-torch.json"; tail -n 2 "$OUT/bb-smol-torch.log"
  timeout "${SWEEP_S:-200}" python3 scripts/small_linear_sweep.py --out /tmp/sweep > "$OUT/sweep.log" 2>&1
  cp /tmp/sweep/small_linear_sweep.json "$OUT/"; tail -n 3 "$OUT/sweep.log"
  ;;
attn)  # random SmolLM2-shaped pair: default split-KV (256 keys/program, SDPA at width 1) against one
  # slice (no merge kernel) at widths >= 2 and at every width; profiled, then base/one again
  BB=(python3 scripts/bench_big.py --shape smollm2 --prompt-len 160 --blocks 1,16)
  for v in base one all base2 one2; do
    case ${v%2} in base) E=(env) ;; one) E=(env DFLASH_ATTN_SPLIT=8192) ;;
      all) E=(env DFLASH_ATTN=split DFLASH_ATTN_SPLIT=8192) ;; esac
    [ "$v" = "${v%2}" ] && P=(--profile) || P=()
    "${E[@]}" timeout 170 "${BB[@]}" "${P[@]}" --out "/tmp/bb-$v" > "/tmp/bb-attn-$v.log" 2>&1
    cp "/tmp/bb-$v/bench_big.json" "$OUT/bench_big-attn-$v.json"
    echo "$v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bb-attn-$v.log" | cut -d' ' -f2 | tr '\n' ' ')"
    tail -n 3 "/tmp/bb-attn-$v.log" | cut -c1-200
  done
  ;;
merge)  # random SmolLM2-shaped pair: split-KV with the merge inside the kernel (this tree) at
  # widths >= 2 (auto), at every width (256 and 128 keys/program, one slice), against the best
  # variant of the tree before it (carry .stage/old: git archive of that commit, one slice everywhere)
  BB=(scripts/bench_big.py --shape smollm2 --prompt-len 160 --blocks 1,16)
  for v in auto split s128 one old; do
    case $v in auto) E=(env) ;; split) E=(env DFLASH_ATTN=split) ;;
      s128) E=(env DFLASH_ATTN=split DFLASH_ATTN_SPLIT=128) ;;
      one|old) E=(env DFLASH_ATTN=split DFLASH_ATTN_SPLIT=8192) ;; esac
    [ $v = old ] && E+=(PYTHONPATH="/tmp/site:$PWD/.stage/old") && R=.stage/old || R=.
    [ $v = auto ] || [ $v = split ] && P=(--profile) || P=()
    (cd $R && "${E[@]}" timeout 170 python3 "${BB[@]}" "${P[@]}" --out "/tmp/bb-$v") > "/tmp/bb-merge-$v.log" 2>&1
    cp "/tmp/bb-$v/bench_big.json" "$OUT/bench_big-merge-$v.json"
    echo "$v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bb-merge-$v.log" | cut -d' ' -f2 | tr '\n' ' ')"
    grep -v '^{' "/tmp/bb-merge-$v.log" | tail -n 3 | cut -c1-300
  done
  ;;
next)  # no carry: the ninth session's open questions. float32 16-row kernel time (MERGE
  # constexpr), 8B shape with the split kernel at width 1, split 512 against 256 on the demo shape
  timeout 120 python3 scripts/split_attention_check.py --out "$OUT" > /tmp/sac.log 2>&1; tail -n 2 /tmp/sac.log
  timeout 200 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1,16 --steps 16 --out /tmp/bb8 \
    > /tmp/bb8.log 2>&1; cp /tmp/bb8/bench_big.json "$OUT/bench_big-q8b.json"; grep ms_per_step /tmp/bb8.log | cut -c1-120
  for v in 256 512; do
    DFLASH_ATTN_SPLIT=$v timeout 150 python3 scripts/bench_big.py --shape smollm2 --prompt-len 300 --blocks 1,16 \
      --out "/tmp/bb-s$v" > "/tmp/bb-s$v.log" 2>&1; cp "/tmp/bb-s$v/bench_big.json" "$OUT/bench_big-split$v.json"
    echo "split $v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bb-s$v.log" | cut -d' ' -f2 | tr '\n' ' ')"
  done
  ;;
pdl)  # no carry: programmatic dependent launch (DFLASH_PDL=1) and small_linear for every
  # projection (DFLASH_LINEAR=all), 8B shape at block 1 (profiled) and the demo shape at 1 and 16
  python3 -c "import torch._inductor.config as c; print('inductor enable_pdl:', hasattr(c.triton, 'enable_pdl'))"
  for v in base pdl pdlall; do
    case $v in base) E=(DFLASH_PDL=0);; pdl) E=(DFLASH_PDL=1);; pdlall) E=(DFLASH_PDL=1 DFLASH_LINEAR=all);; esac
    env "${E[@]}" timeout 125 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1 --steps 16 --profile \
      --out "/tmp/bb8-$v" > "/tmp/bb8-$v.log" 2>&1; cp "/tmp/bb8-$v/bench_big.json" "$OUT/bench_big-q8b-$v.json"
    echo "8b $v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bb8-$v.log" | cut -d' ' -f2 | tr '\n' ' ') $(tail -n 1 "/tmp/bb8-$v.log" | cut -c1-200)"
  done
  for v in base pdlall; do
    case $v in base) E=(DFLASH_PDL=0);; pdlall) E=(DFLASH_PDL=1 DFLASH_LINEAR=all);; esac
    env "${E[@]}" timeout 110 python3 scripts/bench_big.py --shape smollm2 --prompt-len 160 --blocks 1,16 \
      --out "/tmp/bbs-$v" > "/tmp/bbs-$v.log" 2>&1; cp "/tmp/bbs-$v/bench_big.json" "$OUT/bench_big-smol-$v.json"
    echo "smol $v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bbs-$v.log" | cut -d' ' -f2 | tr '\n' ' ') $(tail -n 1 "/tmp/bbs-$v.log" | cut -c1-200)"
  done
  ;;
pdl2)  # no carry: PDL on the demo shape (blocks 1 and 16, a hang shows as a timeout), and the
  # split size at block 1 on the 8B shape
  for v in base pdl; do
    case $v in base) E=(DFLASH_PDL=0);; pdl) E=(DFLASH_PDL=1);; esac
    env "${E[@]}" timeout 150 python3 scripts/bench_big.py --shape smollm2 --prompt-len 160 --blocks 1,16 \
      --out "/tmp/bbs-$v" > "/tmp/bbs-$v.log" 2>&1; echo "rc $?"; cp "/tmp/bbs-$v/bench_big.json" "$OUT/bench_big-smol-$v.json"
    echo "smol $v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bbs-$v.log" | cut -d' ' -f2 | tr '\n' ' ')"
  done
  for sp in 128 64; do
    DFLASH_ATTN_SPLIT=$sp timeout 110 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1 --steps 16 \
      --out "/tmp/bb8-s$sp" > "/tmp/bb8-s$sp.log" 2>&1; cp "/tmp/bb8-s$sp/bench_big.json" "$OUT/bench_big-q8b-split$sp.json"
    echo "8b split $sp $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bb8-s$sp.log" | cut -d' ' -f2 | tr '\n' ' ')"
  done
  ;;
pdlprof)  # no carry: where PDL loses at block 16 on the demo shape (profiled, side by side)
  for v in base pdl; do
    case $v in base) E=(DFLASH_PDL=0);; pdl) E=(DFLASH_PDL=1);; esac
    env "${E[@]}" timeout 140 python3 scripts/bench_big.py --shape smollm2 --prompt-len 160 --blocks 16 --steps 16 \
      --profile --out "/tmp/bbp-$v" > "/tmp/bbp-$v.log" 2>&1; cp "/tmp/bbp-$v/bench_big.json" "$OUT/bench_big-smol-prof-$v.json"
    echo "smol $v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bbp-$v.log" | cut -d' ' -f2 | tr '\n' ' ')"
  done
  ;;
pdlk)  # no carry: PDL for this project's kernels only (DFLASH_PDL=kernels), demo shape 1 and 16
  DFLASH_PDL=kernels timeout 150 python3 scripts/bench_big.py --shape smollm2 --prompt-len 160 --blocks 1,16 \
    --out /tmp/bbs-k > /tmp/bbs-k.log 2>&1; cp /tmp/bbs-k/bench_big.json "$OUT/bench_big-smol-pdlk.json"
  echo "smol kernels $(grep -o '"ms_per_step": [0-9.]*' /tmp/bbs-k.log | cut -d' ' -f2 | tr '\n' ' ')"
  ;;
pdlgraphs)  # no carry: which graph loses under DFLASH_PDL=1 at width 16 (the eleventh session's
  # first call): verify-1, verify-16 and draft-16 replay times and kernels, PDL off and on
  for v in base pdl; do
    case $v in base) E=(DFLASH_PDL=0);; pdl) E=(DFLASH_PDL=1);; esac
    env "${E[@]}" timeout 200 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 160 \
      --out "$OUT/kernels-pdl-$v.json" > "/tmp/kc-$v.log" 2>&1; echo "$v rc $?"; tail -n 6 "/tmp/kc-$v.log"
  done
  ;;
pdlloop)  # no carry: the device loop's graphs alone, a step's two replays, a whole loop step
  # (launch + late read) and the host time of the launches, PDL off and on (eleventh session)
  for v in base pdl; do
    case $v in base) E=(DFLASH_PDL=0);; pdl) E=(DFLASH_PDL=1);; esac
    env "${E[@]}" timeout 250 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 160 \
      --out "$OUT/kernels-loop-$v.json" > "/tmp/kl-$v.log" 2>&1; echo "$v rc $?"; grep -v Warn "/tmp/kl-$v.log" | tail -n 9
  done
  ;;
pdldefault)  # no carry: PDL on by default: the bit-for-bit PDL check of this project's kernels, then
  # the 8B shape with the default (PDL on) and with DFLASH_PDL=0, side by side
  timeout 150 python3 scripts/split_attention_check.py --pdl-only --out "$OUT" > /tmp/pdlc.log 2>&1; echo "check rc $?"; tail -n 2 /tmp/pdlc.log
  for v in on 0; do
    [ $v = on ] && E=(env) || E=(env DFLASH_PDL=0)
    "${E[@]}" timeout 200 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1,16 --steps 16 --out "/tmp/bb8-$v" \
      > "/tmp/bb8-$v.log" 2>&1; cp "/tmp/bb8-$v/bench_big.json" "$OUT/bench_big-q8b-pdl-$v.json"
    echo "$v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bb8-$v.log" | cut -d' ' -f2 | tr '\n' ' ')"; grep -o '"x_floor": [0-9.]*' "/tmp/bb8-$v.log" | tr '\n' ' '; echo
  done
  ;;
seq)  # no carry: every kernel of the device loop's graphs in launch order, PDL off (true
  # durations: with PDL a kernel's time includes its wait), to plan fusions in the draft
  DFLASH_PDL=0 timeout 250 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 160 \
    --sequence --out "$OUT/kernels-seq.json" > /tmp/kseq.log 2>&1; echo "rc $?"; grep -v Warn /tmp/kseq.log | tail -n 9
  ;;
prefetch)  # no carry: DFLASH_PREFETCH (L2 prefetch of a layer's weights after its qkv projection,
  # side stream): a GEMV after a prefetch against cold, then the 8B shape's block-1 step per budget
  timeout 150 python3 scripts/l2_prefetch_check.py --out "$OUT/l2_check.json" 2>&1 | grep -v Warn | tail -n 8
  for v in ${PREFETCH_MIB:-0 24 40 24,early}; do
    [ "$SECONDS" -gt "${PREFETCH_STOP:-440}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    f=${v/,/-}  # file names without commas
    DFLASH_PREFETCH=$v timeout 150 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1 --steps 16 --out "/tmp/bbp-$f" \
      > "/tmp/bbp-$f.log" 2>&1; echo "prefetch $v rc $? at ${SECONDS}s"; cp "/tmp/bbp-$f/bench_big.json" "$OUT/bench_big-q8b-prefetch-$f.json"
    echo "prefetch $v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bbp-$f.log" | cut -d' ' -f2 | tr '\n' ' ') $(grep -o '"x_floor": [0-9.]*' "/tmp/bbp-$f.log" | tr '\n' ' ')"
    grep -i "error\|failed" "/tmp/bbp-$f.log" | grep -v Warn | head -n 3
  done
  ;;
exp13)  # no carry: the thirteenth session's experiments on the demo shape's loop timings, side by
  # side: the default (with --sequence: the draft graph without the per-layer position copies
  # should have 59 kernels, was 64), DFLASH_STEP_COMPILE=1, DFLASH_HEAD_ARGMAX=1 (after a bf16
  # check of its ids), DFLASH_PREFETCH=8, all three
  python3 -c "
import torch, torch.nn.functional as F
from dflash.kernels.head_argmax import head_argmax
g = torch.Generator(device='cuda').manual_seed(0)
for m, n, k in ((1, 49152, 576), (16, 49152, 576), (15, 151936, 4096), (32, 151936, 4096)):
    x = torch.randn(m, k, device='cuda', generator=g).bfloat16()
    w = (torch.randn(n, k, device='cuda', generator=g) * 0.05).bfloat16()
    logits = F.linear(x, w).float()
    want, got = logits.argmax(-1), head_argmax(x, w)
    bad = (want != got).nonzero()[:, 0]
    print('head_argmax', (m, n, k), 'rows differing', bad.numel(), 'their cuBLAS logit gaps', (logits[bad, want[bad]] - logits[bad, got[bad]]).tolist()[:4])
"
  for v in ${EXP13:-base step head pf8 all}; do
    [ "$SECONDS" -gt "${EXP_STOP:-420}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    case $v in base) E=(env); Q=(--sequence) ;; step) E=(env DFLASH_STEP_COMPILE=1); Q=() ;;
      head) E=(env DFLASH_HEAD_ARGMAX=1); Q=(--sequence) ;; pf8) E=(env DFLASH_PREFETCH=8); Q=() ;;
      all) E=(env DFLASH_STEP_COMPILE=1 DFLASH_HEAD_ARGMAX=1 DFLASH_PREFETCH=8); Q=() ;; esac
    "${E[@]}" timeout 170 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 160 \
      "${Q[@]}" --out "$OUT/kernels-exp13-$v.json" > "/tmp/ke-$v.log" 2>&1; echo "$v rc $? at ${SECONDS}s"
    grep -v Warn "/tmp/ke-$v.log" | grep -E "verify|draft|loop|step|fall" | cut -c1-120
  done
  ;;
pdlpre)  # no carry: DFLASH_PDL_PREFETCH (small_linear sends its weight rows to L2 before its PDL
  # wait, fourteenth session, unmeasured): the 8B shape's block-1 step per budget, then the demo
  # shape's loop timings at prompt 300 (past the 256-key split, as real requests are) 0 against 8
  for v in ${PRE_MIB:-0 16 32 64}; do
    [ "$SECONDS" -gt "${PRE_STOP:-330}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    DFLASH_PDL_PREFETCH=$v timeout 150 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1 --steps 16 \
      --out "/tmp/bbq-$v" > "/tmp/bbq-$v.log" 2>&1; echo "pdl-prefetch $v rc $? at ${SECONDS}s"
    cp "/tmp/bbq-$v/bench_big.json" "$OUT/bench_big-q8b-pdlpre-$v.json"
    echo "pdl-prefetch $v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bbq-$v.log" | cut -d' ' -f2 | tr '\n' ' ') $(grep -o '"x_floor": [0-9.]*' "/tmp/bbq-$v.log" | tr '\n' ' ')"
  done
  for v in 0 8; do
    [ "$SECONDS" -gt "${PRE_STOP2:-440}" ] && { echo "skip demo $v at ${SECONDS}s"; continue; }
    DFLASH_PDL_PREFETCH=$v timeout 150 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 300 \
      --out "$OUT/kernels-pdlpre-$v.json" > "/tmp/kq-$v.log" 2>&1; echo "demo pdl-prefetch $v rc $?"
    grep -v Warn "/tmp/kq-$v.log" | grep -E "loop|draft-16|verify-1 " | cut -c1-100
  done
  ;;
k300)  # no carry (fifteenth session): demo-shape loop timings at prompt 300 (draft graph kernels
  # without the per-layer position/RoPE copies, fc through small_linear) and the 8B shape's block 1
  timeout 150 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 300 \
    --out "$OUT/kernels-v15-p300.json" > /tmp/k300.log 2>&1; echo "k300 rc $?"
  grep -v Warn /tmp/k300.log | grep -E "loop|draft-16|verify-1 " | cut -c1-100
  timeout 150 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1 --steps 16 --out /tmp/bbq-v15 > /tmp/bbq-v15.log 2>&1
  echo "8b rc $?"; cp /tmp/bbq-v15/bench_big.json "$OUT/bench_big-q8b-v15.json"
  grep -o '"ms_per_step": [0-9.]*\|"x_floor": [0-9.]*' /tmp/bbq-v15.log | tr '\n' ' '; echo
  ;;
v16a)  # [.stage/t6/aa .stage/whl] (sixteenth session's first call): stage1's copy, the split-KV
  # attention's launch settings swept, then demo loop timings at prompt 300 per env variant
  cp .stage/t6/aa/part "$W/stage/aa.part"
  timeout 230 python3 scripts/attn_sweep.py --budget-s 190 --out "$OUT" > /tmp/attn_sweep.log 2>&1
  echo "sweep rc $? at ${SECONDS}s"; grep '"case"' /tmp/attn_sweep.log | cut -c1-400
  k300_variants "${K_STOP:-480}" "${2:-default DFLASH_DRAFT_ATTN_SPLIT=1024 DFLASH_LINEAR=all}"
  ;;
v16b)  # [.stage/t6/aa .stage/whl] stage1's copy; demo loop timings at prompt 300 with the new split-KV
  # launch settings against the old ones and DFLASH_LINEAR=all; Qwen3-8B block 1 likewise
  cp .stage/t6/aa/part "$W/stage/aa.part"
  k300_variants "${K_STOP:-300}" "${2:-default DFLASH_ATTN_SPLIT=256,DFLASH_ATTN_BLOCK=64 DFLASH_LINEAR=all}"
  for v in ${3:-default DFLASH_LINEAR=all DFLASH_ATTN_BLOCK=64}; do
    [ "$SECONDS" -gt "${B_STOP:-470}" ] && { echo "skip 8b $v at ${SECONDS}s"; continue; }
    E=(env); [ "$v" = default ] || E+=(${v//,/ }); f=${v//[=,]/-}
    "${E[@]}" timeout 120 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1 --steps 16 --out "/tmp/bb8-$f" \
      > "/tmp/bb8-$f.log" 2>&1; echo "8b $v rc $? at ${SECONDS}s"; cp "/tmp/bb8-$f/bench_big.json" "$OUT/bench_big-q8b-$f.json"
    grep -o '"ms_per_step": [0-9.]*\|"x_floor": [0-9.]*' "/tmp/bb8-$f.log" | tr '\n' ' '; echo
  done
  ;;
next17)  # no carry (the next session's first call): Qwen3-8B blocks 1 and 16 under the default
  # (in-projections on cuBLAS) and DFLASH_LINEAR=all with the sixteenth session's tiles, then the
  # demo loop timings at prompt 300 (default)
  for v in default DFLASH_LINEAR=all; do
    f=${v//[=,]/-}; E=(env); [ "$v" = default ] || E+=($v)
    "${E[@]}" timeout 150 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1,16 --steps 16 --out "/tmp/bb8-$f" \
      > "/tmp/bb8-$f.log" 2>&1; echo "8b $v rc $? at ${SECONDS}s"; cp "/tmp/bb8-$f/bench_big.json" "$OUT/bench_big-q8b-$f.json"
    grep -o '"ms_per_step": [0-9.]*\|"x_floor": [0-9.]*\|"x_block1": [0-9.]*' "/tmp/bb8-$f.log" | tr '\n' ' '; echo
  done
  timeout 140 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 300 \
    --out "$OUT/kernels-p300.json" > /tmp/k17.log 2>&1; echo "k rc $?"; grep -v Warn /tmp/k17.log | grep -E "loop|draft-16|verify-1 " | cut -c1-100
  if [ "$SECONDS" -lt 420 ]; then  # long contexts: does 1,024 keys per program hold for head dim 64?
    timeout 160 python3 scripts/attn_sweep.py --cases long --budget-s 130 --out "$OUT" > /tmp/sweep17.log 2>&1
    echo "sweep rc $?"; grep '"case"' /tmp/sweep17.log | cut -c1-160
  fi
  ;;
v17a)  # [.stage/t7/aa .stage/whl] stage1's copy; Qwen3-8B block 1 under the default (large
  # in-projections through small_linear in 1-row steps since the seventeenth session, profiled)
  # against DFLASH_LINEAR=triton (cuBLAS in-projections, the rule before) on one machine
  cp .stage/t7/aa/part "$W/stage/aa.part"
  q8b_block1 9999 v17 "default DFLASH_LINEAR=triton" profile
  ;;
v17b)  # [.stage/t7/aa .stage/whl] stage1's copy; SiLU(gate) * up as the gate+up kernel's epilogue
  # (DFLASH_GLU, default on) against off: demo loop timings at prompt 300, then Qwen3-8B block 1
  cp .stage/t7/aa/part "$W/stage/aa.part"
  k300_variants "${K_STOP:-200}" "default DFLASH_GLU=0"
  q8b_block1 "${B_STOP:-300}" glu "default DFLASH_GLU=0"
  ;;
next18)  # [.stage/t7/aa .stage/whl] stage1's copy; the RMSNorms inside the in-projections
  # (DFLASH_FUSE_NORM=1, an experiment: the eighteenth session's folded form, small_linear_rn)
  # against the default: demo loop timings at prompt 300, then Qwen3-8B block 1
  cp .stage/t7/aa/part "$W/stage/aa.part"
  k300_variants "${K_STOP:-200}" "default DFLASH_FUSE_NORM=1"
  q8b_block1 "${B_STOP:-300}" norm "default DFLASH_FUSE_NORM=1"
  ;;
v18rn)  # measured in the nineteenth session (benchmarks/results/h200-v19/); the fma form is removed
  echo "v18rn: DFLASH_FUSE_NORM_SQUARES=fma was removed after its measurement; nothing to run" >&2; exit 2
  ;;
prefetchdemo)  # no carry: DFLASH_PREFETCH 0 against ${PREFETCH_MIB:-8} on the demo shape's loop timings
  for v in 0 ${PREFETCH_MIB:-8}; do
    DFLASH_PREFETCH=$v timeout 200 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 160 \
      --out "$OUT/kernels-prefetch-$v.json" > "/tmp/kp-$v.log" 2>&1; echo "prefetch $v rc $?"; grep -v Warn "/tmp/kp-$v.log" | tail -n 9
  done
  ;;
rope)  # no carry: DFLASH_ROPE (q/k norm + RoPE + cache writes in one kernel) 0 against 1: bf16
  # error against the torch ops, loop timings (demo shape, PDL default) with each graph's kernel
  # sequence, then the 8B shape's block-1 step
  python3 -c "
import torch
from dflash.kernels import rope_cache as rc
from tests.helpers.kernels import rope_case as _case
for args in ((32, 16, 9, 3, 64), (32, 16, 32, 8, 128), (16, 0, 32, 8, 128, 128, 0, False)):
    qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv = _case(*args) if len(args) > 5 else _case(*args, cap=128)
    qkv, cos, sin, pos, kc, vc = (t.cuda() for t in (qkv, cos, sin, pos, kc, vc))
    qkv, cos, sin, kc, vc = (t.bfloat16() for t in (qkv, cos, sin, kc, vc))
    if qn is not None:
        qn, kn = qn.cuda().bfloat16(), kn.cuda().bfloat16()
    kr, vr = kc.clone(), vc.clone()
    want = rc.rope_cache_reference(qkv, qn, kn, cos, sin, pos, kr, vr, tc, h, hkv)
    got = rc.rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv)
    print('rope', args, 'max err q', (got.float() - want.float()).abs().max().item(), 'k', (kc.float() - kr.float()).abs().max().item(), 'v equal', torch.equal(vc, vr), 'max |q|', want.float().abs().max().item())
"
  for v in 0 1; do
    DFLASH_ROPE=$v timeout 200 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 160 \
      --sequence --out "$OUT/kernels-rope-$v.json" > "/tmp/kr-$v.log" 2>&1; echo "rope $v rc $?"; grep -v Warn "/tmp/kr-$v.log" | tail -n 9
  done
  for v in 0 1; do
    DFLASH_ROPE=$v timeout 150 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1 --steps 16 --out "/tmp/bb8r-$v" \
      > "/tmp/bb8r-$v.log" 2>&1; cp "/tmp/bb8r-$v/bench_big.json" "$OUT/bench_big-q8b-rope-$v.json"
    echo "rope $v $(grep -o '"ms_per_step": [0-9.]*' "/tmp/bb8r-$v.log" | cut -d' ' -f2 | tr '\n' ' ') $(grep -o '"x_floor": [0-9.]*' "/tmp/bb8r-$v.log" | tr '\n' ' ')"
  done
  ;;
v20a)  # no carry: Qwen3-8B blocks 1,16 profiled without PDL (every kernel of one step in order), then wall
  BB=(python3 scripts/bench_big.py --shape qwen3-8b --blocks 1,16 --steps 16)
  DFLASH_PDL=0 BENCH_BIG_SEQUENCE=1 timeout 260 "${BB[@]}" --profile --out /tmp/bb8-seq > /tmp/bb8-seq.log 2>&1
  echo "seq rc $? at ${SECONDS}s"; cp /tmp/bb8-seq/bench_big.json "$OUT/bench_big-q8b-v20-pdl0-seq.json"
  timeout 200 "${BB[@]}" --out /tmp/bb8-def > /tmp/bb8-def.log 2>&1
  echo "default rc $? at ${SECONDS}s"; cp /tmp/bb8-def/bench_big.json "$OUT/bench_big-q8b-v20-default.json"
  grep -o '"ms_per_step": [0-9.]*' /tmp/bb8-seq.log /tmp/bb8-def.log
  [ "$SECONDS" -lt 420 ] && { DFLASH_LINEAR=all timeout 160 "${BB[@]}" --blocks 16 --out /tmp/bb8-all > /tmp/bb8-all.log 2>&1
    echo "all rc $? at ${SECONDS}s"; cp /tmp/bb8-all/bench_big.json "$OUT/bench_big-q8b-v20-LINEAR-all.json"; grep -o '"ms_per_step": [0-9.]*' /tmp/bb8-all.log; }
  tail -n 3 /tmp/bb8-seq.log | cut -c1-300
  ;;
v20b)  # no carry: Qwen3-8B blocks 1,16 per variant (VARS, comma-separated env per variant), one machine
  for v in ${VARS:-DFLASH_LINEAR=all default DFLASH_LINEAR=all,DFLASH_PDL=0 DFLASH_LINEAR=all}; do
    [ "$SECONDS" -gt "${STOP:-420}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    E=(env); [ "$v" = default ] || E+=(${v//,/ }); f=${v//[=,]/-}; P=()
    [ "${v/PDL=0/}" != "$v" ] && P=(--profile) && E+=(BENCH_BIG_SEQUENCE=1)
    rm -rf "/tmp/bb8-$f"  # a repeated variant that fails leaves no earlier file to copy
    "${E[@]}" timeout 150 python3 scripts/bench_big.py --shape qwen3-8b --blocks 1,16 --steps 16 "${P[@]}" \
      --out "/tmp/bb8-$f" > "/tmp/bb8-$f.log" 2>&1; echo "8b $v rc $? at ${SECONDS}s"
    n=1; while [ -e "$OUT/bench_big-q8b-v20-$f-$n.json" ]; do n=$((n+1)); done
    cp "/tmp/bb8-$f/bench_big.json" "$OUT/bench_big-q8b-v20-$f-$n.json"
    grep -o '"ms_per_step": [0-9.]*\|"x_block1": [0-9.]*' "/tmp/bb8-$f.log" | tr '\n' ' '; echo
  done
  ;;
v21a)  # no carry: Qwen3-8B, BLOCKS (default 1) per variant; VARS: space-separated, env joined by '+' (values may hold commas)
  for v in ${VARS:-default DFLASH_PREFETCH=16 DFLASH_PREFETCH=32 DFLASH_PREFETCH=16,lines default}; do
    [ "$SECONDS" -gt "${STOP:-480}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    E=(env); [ "$v" = default ] || E+=(${v//+/ }); f=${v//[=,+]/-}
    rm -rf "/tmp/bb8-$f"
    "${E[@]}" timeout 150 python3 scripts/bench_big.py --shape qwen3-8b --blocks "${BLOCKS:-1}" --steps 16 \
      --out "/tmp/bb8-$f" > "/tmp/bb8-$f.log" 2>&1; echo "8b $v rc $? at ${SECONDS}s"
    n=1; while [ -e "$OUT/bench_big-q8b-${TAG:-v21}-$f-$n.json" ]; do n=$((n+1)); done
    cp "/tmp/bb8-$f/bench_big.json" "$OUT/bench_big-q8b-${TAG:-v21}-$f-$n.json"
    grep -o '"ms_per_step": [0-9.]*\|"x_floor": [0-9.]*' "/tmp/bb8-$f.log" | tr '\n' ' '; echo
  done
  ;;
v20c)  # no carry: the norms' partial sums (DFLASH_FUSE_NORM_FORM=partials) on Qwen3-8B blocks 1,16, then the demo loop at prompt 300
  P8="DFLASH_FUSE_NORM=1,DFLASH_FUSE_NORM_FORM=partials"
  VARS="default $P8 default $P8" STOP=330 bash "$0" v20b
  k300_variants 480 "default DFLASH_FUSE_NORM_FORM=partials"
  ;;
v20d)  # no carry: demo loop timings at prompt 300, squares against partials, twice, alternating
  for r in 1 2; do
    for v in default DFLASH_FUSE_NORM_FORM=partials; do
      k300_variants 440 "$v"; f=${v//[=,]/-}; mv "$OUT/kernels-p300-$f.json" "$OUT/kernels-p300-$f-r$r.json"
    done
  done
  ;;
v20e)  # [.stage/t7/ag .stage/data] after stage aa..af: real pair, gsm8k 16 with parity, partials then default
  real_pair t7
  for v in DFLASH_FUSE_NORM_FORM=partials default; do
    E=(env); [ "$v" = default ] || E+=($v); f=${v//[=,]/-}
    "${E[@]}" timeout "${BENCH_S:-150}" python3 -m dflash benchmark transformers --model "$GGUF" --draft "$D" \
      --max-new-tokens 256 --data-dir "$W/datasets" --dataset gsm8k --max-samples "${NS:-16}" --block-size 16 --check-parity \
      --output "$OUT/b16-$f.jsonl" > "$OUT/b16-$f.txt" 2>&1; echo "$v rc $? at ${SECONDS}s"; tail -n 12 "$OUT/b16-$f.txt"
  done
  ;;
v23a)  # [.stage/t7/aa .stage/whl] stage aa, then DFLASH_QKV_ROPE: demo loop timings at prompt 300 (on by
  # default there) against 0, alternating, and Qwen3-8B blocks 1,16 (off by default there) against 1
  cp .stage/t7/aa/part "$W/stage/aa.part" 2>/dev/null && ls -la "$W/stage"
  k300_variants 60 "default"; mv "$OUT/kernels-p300-default.json" "$OUT/kernels-p300-default-r1.json"
  k300_variants 130 "DFLASH_QKV_ROPE=0"; mv "$OUT/kernels-p300-DFLASH_QKV_ROPE-0.json" "$OUT/kernels-p300-DFLASH_QKV_ROPE-0-r1.json"
  TAG=v23 VARS="default DFLASH_QKV_ROPE=1" BLOCKS=1,16 STOP=330 bash "$0" v21a
  k300_variants 420 "DFLASH_QKV_ROPE=0"; k300_variants 480 "default"
  ;;
v23b)  # [.stage/t7/aa .stage/whl] stage aa, then DFLASH_QKV_ROPE (column pairs without q/k norms, early
  # tables) against 0: demo loop timings at prompt 300, alternating, twice
  cp .stage/t7/aa/part "$W/stage/aa.part" 2>/dev/null && ls -la "$W/stage"
  for r in 1 2; do
    for v in default DFLASH_QKV_ROPE=0; do
      k300_variants "${STOP:-330}" "$v"; f=${v//[=,]/-}; mv "$OUT/kernels-p300-$f.json" "$OUT/kernels-p300-$f-r$r.json"
    done
  done
  ;;
v23c)  # [.stage/t7/ag .stage/data] after stage aa..af: real pair, gsm8k NS (16) with parity per variant (VARS)
  real_pair t7
  for v in ${VARS:-default DFLASH_QKV_ROPE=0}; do
    E=(env); [ "$v" = default ] || E+=(${v//,/ }); f=${v//[=,]/-}
    "${E[@]}" timeout "${BENCH_S:-150}" python3 -m dflash benchmark transformers --model "$GGUF" --draft "$D" \
      --max-new-tokens 256 --data-dir "$W/datasets" --dataset gsm8k --max-samples "${NS:-16}" --block-size 16 --check-parity \
      --output "$OUT/b16-$f.jsonl" > "$OUT/b16-$f.txt" 2>&1; echo "$v rc $? at ${SECONDS}s"; tail -n 12 "$OUT/b16-$f.txt"
  done
  ;;
v23d)  # [.stage/t7/aa .stage/whl] stage aa, then demo loop timings at prompt 300 per variant (VARS, in
  # order; a repeated variant gets -r2), none started past STOP (330) s
  cp .stage/t7/aa/part "$W/stage/aa.part" 2>/dev/null && ls -la "$W/stage"
  for v in ${VARS:-default DFLASH_HEAD_ARGMAX=1 default}; do  # (DFLASH_DRAFT_CTX_KV=0: at bef496b only)
    f=${v//[=,]/-}; r=1; while [ -e "$OUT/kernels-p300-$f-r$r.json" ]; do r=$((r+1)); done
    k300_variants "${STOP:-330}" "$v"; mv "$OUT/kernels-p300-$f.json" "$OUT/kernels-p300-$f-r$r.json" 2>/dev/null
  done
  ;;
v24a)  # no carry: cold-weight sweep of small_linear on Qwen3-8B's projections, then blocks 1,16 per config
  timeout "${SWEEP_S:-240}" python3 scripts/small_linear_sweep.py --shapes qwen3-8b,qwen3-8b-in --cold \
    --configs wide --compile-procs 8 --out /tmp/sweep > "$OUT/sweep.log" 2>&1; echo "sweep rc $? at ${SECONDS}s"
  cp /tmp/sweep/small_linear_sweep.json /tmp/sweep/best_config.env "$OUT/"
  grep -o '"name": "[a-z_]*", "m": [0-9]*\|"default_us": [0-9.]*\|"best_us": [0-9.]*\|"best_cfg": \[[0-9, ]*\]\|"cublas_us": [0-9.]*' "$OUT/sweep.log" | tr '\n' ' ' | sed 's/"name"/\n"name"/g'; echo
  BEST=$(head -n 1 /tmp/sweep/best_config.env); echo "best: $BEST"
  for v in default best default best; do
    [ "$SECONDS" -gt "${STOP:-470}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    E=(env); [ "$v" = best ] && E+=("DFLASH_LINEAR_CONFIG=$BEST")
    q8b_named "${TAG:-v24}" "$v" 150 --blocks 1,16
  done
  ;;
v24b)  # no carry: see the header
  timeout 150 python3 scripts/small_linear_sweep.py --shapes qwen3-8b,qwen3-8b-in --cold --rows 1,16 \
    --configs deep --compile-procs 8 --out /tmp/sweep2 > "$OUT/sweep2.log" 2>&1; echo "sweep2 rc $? at ${SECONDS}s"
  cp /tmp/sweep2/small_linear_sweep.json "$OUT/sweep2.json"; cp /tmp/sweep2/best_config.env "$OUT/best2.env"
  timeout 120 python3 scripts/small_linear_sweep.py --shapes smollm2,smollm2-in --cold --rows 1,16,32 \
    --configs wide --compile-procs 8 --out /tmp/sweepd > "$OUT/sweepd.log" 2>&1; echo "sweep demo rc $? at ${SECONDS}s"
  cp /tmp/sweepd/small_linear_sweep.json "$OUT/sweep-demo.json"; cp /tmp/sweepd/best_config.env "$OUT/best-demo.env"
  for f in sweep2 sweepd; do
    grep -o '"name": "[a-z_]*", "m": [0-9]*\|"default_us": [0-9.]*\|"best_us": [0-9.]*\|"best_cfg": \[[0-9, ]*\]' "$OUT/$f.log" | tr '\n' ' ' | sed 's/"name"/\n"name"/g'; echo
  done
  B1=$(head -n 1 benchmarks/results/h200-v24/1-cold-sweep/best_config.env); B2=$(head -n 1 /tmp/sweep2/best_config.env)
  BD=$(head -n 1 /tmp/sweepd/best_config.env); echo "best2: $B2"; echo "best demo: $BD"
  for v in best1 best1split128 best2 best1; do
    [ "$SECONDS" -gt "${STOP:-400}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    case $v in best1) E=(env "DFLASH_LINEAR_CONFIG=$B1");; best2) E=(env "DFLASH_LINEAR_CONFIG=$B2");;
      best1split128) E=(env "DFLASH_LINEAR_CONFIG=$B1" DFLASH_ATTN_SPLIT=128);; esac
    q8b_named v24 "$v" 120 --blocks 1,16
  done
  for v in default bestdemo; do
    [ "$SECONDS" -gt 500 ] && { echo "skip demo $v at ${SECONDS}s"; continue; }
    E=(env); [ $v = bestdemo ] && E+=("DFLASH_LINEAR_CONFIG=$BD")
    "${E[@]}" timeout 90 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 300 \
      --out "$OUT/kernels-p300-$v.json" > "/tmp/k-$v.log" 2>&1; echo "$v rc $? at ${SECONDS}s"
    grep -v Warn "/tmp/k-$v.log" | grep -E "loop|draft-16|verify-1 " | cut -c1-100
  done
  ;;
v24c)  # no carry: see the header
  OLD="4096x4096@1=32,256,4,4;4096x4096@16=32,256,4,4;4096x12288@1=32,512,4,4;4096x12288@16=32,512,4,4"
  OLD="$OLD;6144x4096@1=32,256,4,4;6144x4096@16=32,256,4,4;24576x4096@1=64,128,4,4;24576x4096@16=64,128,4,4"
  for v in new old t128 new old long-new long-256; do
    case $v in long*) stop=440; B=(--blocks 1 --prompt-len 2000);; *) stop=330; B=(--blocks 1,16);; esac
    [ "$SECONDS" -gt "$stop" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    case $v in *new) E=(env);; old) E=(env "DFLASH_LINEAR_CONFIG=$OLD" DFLASH_ATTN_SPLIT=256 DFLASH_ATTN_ONE_SLICE=448);;
      long-256) E=(env DFLASH_ATTN_SPLIT=256 DFLASH_ATTN_ONE_SLICE=448);;
      t128) E=(env DFLASH_ATTN_SPLIT=128 DFLASH_DRAFT_ATTN_SPLIT=256 DFLASH_ATTN_ONE_SLICE=448);; esac
    q8b_named v24c "$v" 120 "${B[@]}"
  done
  ;;
v25a)  # measured (benchmarks/results/h200-v25/1-early), then DFLASH_ATTN_EARLY=2 was removed
  echo "v25a: DFLASH_ATTN_EARLY=2 was removed after its measurement; v25c measures the defaults" >&2; exit 2
  ;;
v25b)  # measured (benchmarks/results/h200-v25/2-early-prefetch), then the ',attn' form was removed
  echo "v25b: DFLASH_PDL_PREFETCH=<MiB>,attn was removed after its measurement; nothing to run" >&2; exit 2
  ;;
v25c)  # no carry: the RMSNorm kernel (DFLASH_NORM_KERNEL, default 1) against Inductor's norms, Qwen3-8B blocks 1,16
  # alternating, then the session's start (both DFLASH_NORM_KERNEL=0 and DFLASH_ATTN_EARLY=0)
  for v in nk1 nk0 nk1 nk0 start; do
    [ "$SECONDS" -gt "${STOP:-300}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    case $v in nk*) E=(env "DFLASH_NORM_KERNEL=${v#nk}");; start) E=(env DFLASH_NORM_KERNEL=0 DFLASH_ATTN_EARLY=0);; esac
    q8b_named v25c "$v" 120 --blocks 1,16
  done
  ;;
big8b)  # Qwen3-8B-shaped pair: fused linears on/off
  BB=(python3 scripts/bench_big.py --shape qwen3-8b --blocks 1,16 --steps 16)
  DFLASH_LINEAR=triton timeout 280 "${BB[@]}" --profile --out /tmp/bb8-lin > "$OUT/bb-q8b-lin.log" 2>&1
  cp /tmp/bb8-lin/bench_big.json "$OUT/bench_big-q8b-lin.json"; tail -n 2 "$OUT/bb-q8b-lin.log"
  DFLASH_LINEAR=torch timeout 250 "${BB[@]}" --out /tmp/bb8-torch > "$OUT/bb-q8b-torch.log" 2>&1
  cp /tmp/bb8-torch/bench_big.json "$OUT/bench_big-q8b-torch.json"; tail -n 2 "$OUT/bb-q8b-torch.log"
  ;;
v26a)  # no carry: a dependent step's cost (scripts/phase_overhead.py: kernel chain, PDL chain, one
  # persistent kernel with grid barriers), then every kernel of the demo graphs in order
  timeout 200 python3 scripts/phase_overhead.py --out "$OUT/phase_overhead.json" 2>&1 | grep -v Warn | tail -12
  timeout 200 python3 scripts/kernel_count.py --random-target --variants fused --prompt-len 300 --sequence \
    --out "$OUT/kernels-p300-seq.json" > /tmp/k.log 2>&1; echo "seq rc $? at ${SECONDS}s"
  grep -E "loop|draft-16|verify-1 " /tmp/k.log | cut -c1-100
  ;;
v26b)  # measured (benchmarks/results/h200-v26/2-l2-keep), then removed
  echo "v26b: DFLASH_L2_KEEP (L2 eviction hints on small_linear's weights) was removed after its measurement" >&2; exit 2
  ;;
v26c)  # no carry: the defaults after the twenty-fifth session's review fixes: Qwen3-8B blocks 1,16 twice,
  # demo loop timings at prompt 300
  E=(env)
  for v in default default; do
    [ "$SECONDS" -gt "${STOP:-300}" ] && { echo "skip $v at ${SECONDS}s"; continue; }
    q8b_named v26c "$v" 120 --blocks 1,16
  done
  k300_variants "${STOP:-300}" default
  ;;
v26d)  # no carry: DFLASH_LINEAR_ONE_TILE on/off alternating, demo loop timings at prompt 300
  k300_variants "${STOP:-250}" "DFLASH_LINEAR_ONE_TILE=1 default DFLASH_LINEAR_ONE_TILE=1 default"
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
