"""Does an L2 prefetch make a weight GEMV faster on this GPU? (``dflash.kernels.l2_prefetch``)

    PYTHONPATH=. python3 scripts/l2_prefetch_check.py [--out l2_check.json]

For weights of a few sizes (demo o_proj ... Qwen3-8B qkv), a one-row ``small_linear`` is timed
(CUDA events, median of ``--iters``) after L2 was flushed (a 1 GiB read), in three settings:
``cold``; ``prefetched`` (the prefetch kernel ran and a 20 us sleep let it land); ``overlap``
(prefetch on the side stream while the main stream sleeps ``--gap-us``, then the GEMV; the time
counted is sleep + GEMV, against sleep + GEMV without the prefetch: ``gap_only``). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="l2_check.json")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--gap-us", type=float, default=10.0)
    args = ap.parse_args(argv)
    from dflash.kernels import l2_prefetch as lp
    from dflash.kernels.small_linear import small_linear

    dev = torch.device("cuda")
    flush = torch.empty(1 << 29, dtype=torch.float16, device=dev)  # 1 GiB
    clock = torch.cuda.get_device_properties(dev).clock_rate * 1000 if hasattr(torch.cuda.get_device_properties(dev), "clock_rate") else 1.98e9
    cycles = int(args.gap_us * 1e-6 * clock)
    side = lp._side(dev)
    results = []
    shapes = {"demo o_proj": (576, 576), "demo gate_up": (3072, 576), "8b o_proj": (4096, 4096),
              "8b qkv": (6144, 4096), "8b down(part)": (4096, 6144)}  # fmt: skip
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        res = torch.zeros(1, n, device=dev, dtype=torch.bfloat16)
        small_linear(x, w, None, res)  # compile
        lp._launch([(w, w.numel())])
        torch.cuda.synchronize()
        row = {"name": name, "bytes": w.numel() * 2}
        for mode in ("cold", "prefetched", "gap_only", "overlap"):
            times = []
            for _ in range(args.iters):
                flush.sum()  # evicts the weight from L2
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if mode == "prefetched":
                    lp._launch([(w, w.numel())])
                    torch.cuda._sleep(int(20e-6 * clock))
                if mode in ("gap_only", "overlap"):
                    a.record()
                    if mode == "overlap":
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            lp._launch([(w, w.numel())])
                    torch.cuda._sleep(cycles)
                else:
                    a.record()
                small_linear(x, w, None, res)
                b.record()
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1000)
            row[mode + "_us"] = statistics.median(times)
        row["gbps_cold"] = row["bytes"] / row["cold_us"] / 1e3
        print(json.dumps(row), flush=True)
        results.append(row)
    report = {"device": torch.cuda.get_device_name(dev), "gap_us": args.gap_us, "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
