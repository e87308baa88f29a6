"""Where a real request's decode time goes, step by step: GPU busy against wall time.

    PYTHONPATH=. python3 scripts/step_profile.py --model /tmp/demo/smollm2.gguf \
        --data-dir /tmp/demo/datasets --n 4 --out $OUT/step_profile.json

``kernel_count.py`` times the loop's graphs with the state held at one position; on the H200 a
block-16 loop step took 0.88 ms and a block-1 step 0.72 ms there, while the real benchmark
(gsm8k 64, twelfth session) ran 1.01 ms per DFlash step and 0.80 ms per baseline token. This
script runs real requests (the first ``--n`` gsm8k prompts, the benchmark's warm-up first) at
block 16 and block 1 under torch.profiler and reports per request: decode wall ms per step,
the GPU's busy ms per step (union of kernel intervals inside the decode window), kernels per
step, and the idle gaps between kernels (count, total, the largest with the kernels around
them). Busy close to wall: the kernels themselves cost more than in the held loop (longer
contexts, clocks); busy well below wall: the GPU waits for the host. Profiling adds a little
host time per launch (graph replays: two per step). On a CPU it runs (a smoke test) with no
kernels to count. JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def busy_and_gaps(events, t0_us: float, t1_us: float, top: int = 12) -> dict:
    """Union of kernel intervals within [t0, t1] (us) and the idle gaps between them."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.time_range.end > t0_us and e.time_range.start < t1_us)  # fmt: skip
    busy, gaps, end, prev = 0.0, [], t0_us, "(decode start)"
    for s, e, name in spans:
        s, e = max(s, t0_us), min(e, t1_us)
        if s > end:
            gaps.append((s - end, prev[:60], name[:60]))
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, prev = e, name
    if t1_us > end:
        gaps.append((t1_us - end, prev[:60], "(decode end)"))
    gaps.sort(key=lambda g: -g[0])
    return {"kernels": len(spans), "busy_us": busy, "gap_us": sum(g[0] for g in gaps), "gaps": len(gaps),
            "gaps_over_5us": sum(1 for g in gaps if g[0] > 5), "largest_gaps": [[round(g, 1), a, b] for g, a, b in gaps[:top]]}  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--blocks", default="16,1")
    ap.add_argument("--out", default="step_profile.json")
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from dflash.api import load
    from dflash.data.datasets import load_prompts, select

    pipe = load(args.model, args.draft)
    prompts = select(load_prompts(args.dataset, args.data_dir), args.n)
    ids = [pipe.chat_prompt(p.first_messages()) for p in prompts]
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "describe": pipe.backend.describe(), "runs": []}
    for block in (int(b) for b in args.blocks.split(",")):
        pipe.warm_up(ids[0], max_new_tokens=args.max_new_tokens)
        for i, prompt in enumerate(ids):
            sync()
            with profile(activities=acts) as prof:
                marks = {}
                steps = 0
                tokens = 0
                for r in pipe.stream(prompt, block_size=block, max_new_tokens=args.max_new_tokens):
                    tokens += len(r.tokens)
                    if r.accepted is None:
                        sync()
                        marks["t1"] = time.perf_counter()
                        if cuda:
                            torch.cuda._sleep(1000)  # a marker kernel at the decode's start
                    else:
                        steps += 1
                sync()
                marks["t2"] = time.perf_counter()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            sleeps = [e for e in kernels if "sleep" in e.name.lower()]
            t0 = sleeps[-1].time_range.end if sleeps else min((e.time_range.start for e in kernels), default=0.0)
            t1 = max((e.time_range.end for e in kernels), default=t0)
            wall_ms = (marks["t2"] - marks["t1"]) * 1000
            row = {"block": block, "prompt": i, "prompt_tokens": len(prompt), "new_tokens": tokens,
                   "steps": steps, "wall_ms": wall_ms, "wall_ms_per_step": wall_ms / max(steps, 1),
                   **busy_and_gaps([e for e in kernels if e not in sleeps], t0, t1)}  # fmt: skip
            row["busy_ms_per_step"] = row["busy_us"] / 1000 / max(steps, 1)
            row["kernels_per_step"] = row["kernels"] / max(steps, 1)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                              if k != "largest_gaps"}), flush=True)  # fmt: skip
            report["runs"].append(row)
            Path(args.out).write_text(json.dumps(report, indent=2))  # incremental
    return report


if __name__ == "__main__":
    main()
