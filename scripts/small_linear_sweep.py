"""Time the fused few-row linear (dflash.backends.small_linear) against cuBLAS on the GPU.

    PYTHONPATH=. python3 scripts/small_linear_sweep.py [--out DIR] [--shapes smollm2,qwen3-8b]

For o_proj and down_proj (demo target and Qwen3-8B dims; ``*-in``: the fused qkv and gate+up
projections, without a residual) and M = 1 and 16 rows, times in CUDA
graphs of 50 back-to-back calls (so launch gaps count as they do in a decode step): ``F.linear``
alone (cuBLAS, without the residual add), the kernel with its residual add and the built-in
config, and a small sweep of configs. Writes small_linear_sweep.json
(incrementally) with the best config per shape. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash.backends import small_linear as sl
from scripts.split_attention_check import graph_time_us

SHAPES = {  # name -> (N, K): the projections followed by a residual add
    "smollm2": {"o": (576, 576), "down": (576, 1536)},
    "qwen3-8b": {"o": (4096, 4096), "down": (4096, 12288)},
    # the fused in-projections (no residual add): DFLASH_LINEAR=auto sends them to cuBLAS above
    # 8 MiB; this times whether some config would beat cuBLAS there (sixteenth session)
    "qwen3-8b-in": {"qkv": (6144, 4096), "gate_up": (24576, 4096)},
    "smollm2-in": {"qkv": (960, 576), "gate_up": (3072, 576)},
}
NO_RESIDUAL = ("qkv", "gate_up")
CONFIGS = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (128, 256, 512) for w, st in ((4, 2), (4, 4), (8, 3))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "sweep_out"))
    ap.add_argument("--shapes", default="smollm2,qwen3-8b")
    ap.add_argument("--rows", default="1,16")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(dev), "results": []}
    for shape in args.shapes.split(","):
        for name, (n, k) in SHAPES[shape].items():
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device=dev, dtype=dt)
                r = None if name in NO_RESIDUAL else torch.randn(m, n, device=dev, dtype=dt)
                call = functools.partial(sl._launch, x, w, None, r)
                row = {"shape": shape, "name": name, "m": m, "n": n, "k": k,
                       "cublas_us": graph_time_us(functools.partial(F.linear, x, w), 50)}  # fmt: skip
                os.environ.pop(sl.CONFIG_ENV, None)
                row["max_err"] = (call().float() - sl.small_linear_reference(x, w, None, r).float()).abs().max().item()
                row["default_cfg"] = sl.kernel_config(m, n, k)[1:]
                row["default_us"] = graph_time_us(call, 50)
                sweep = []
                for cfg in CONFIGS:
                    os.environ[sl.CONFIG_ENV] = ",".join(map(str, cfg))
                    try:
                        sweep.append((graph_time_us(call, 50), cfg))
                    except Exception as e:  # noqa: BLE001 - a config may not fit (registers, smem)
                        sweep.append((float("inf"), cfg))
                        print(f"{name} m={m} {cfg}: {type(e).__name__}", flush=True)
                os.environ.pop(sl.CONFIG_ENV, None)
                sweep.sort()
                row["best_us"], row["best_cfg"] = sweep[0]
                row["top5"] = sweep[:5]
                report["results"].append(row)
                print(json.dumps({kk: v for kk, v in row.items() if kk != "top5"}), flush=True)
                (out / "small_linear_sweep.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
