"""Time the fused few-row linear (dflash.kernels.small_linear) against cuBLAS on the GPU.

    PYTHONPATH=. python3 scripts/small_linear_sweep.py [--out DIR] [--shapes smollm2,qwen3-8b|o=NxK,...]
        [--cold] [--configs small|wide|deep] [--compile-procs 8]

For o_proj and down_proj (demo target and Qwen3-8B dims; ``*-in``: the fused qkv and gate+up
projections, without a residual, gate+up with its SwiGLU epilogue as the static forwards run
it) and M = 1 and 16 rows, times in CUDA graphs of 50 back-to-back calls (so launch gaps count
as they do in a decode step): ``F.linear`` alone (cuBLAS, without the residual add), the kernel
with its residual add and the built-in config, and a sweep of configs. Writes
small_linear_sweep.json (incrementally) with the best config per shape, and best_config.env:
a ``DFLASH_LINEAR_CONFIG`` value naming each shape's best.

``--cold`` cycles the calls through enough copies of each weight to pass three times the L2
cache, as a decode step reads each layer's weights once: without it the weights of Qwen3-8B's
o_proj (33.5 MB) and qkv (50 MB) stay in the H200's L2 between calls and the times are those of
L2, not HBM. ``--compile-procs`` compiles the configs in that many
processes first (Triton's disk cache), so the timing process only loads them.

For a model of your own, name its projections' weight shapes (``--shapes
o=4096x4096,down=4096x14336,qkv=6144x4096,gate_up=28672x4096``) and run the sweep with
``--cold``; ``DFLASH_LINEAR_CONFIG=$(cat OUT/best_config.env)`` then runs its picks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash.kernels import small_linear as sl

SHAPES = {  # name -> (N, K): the projections followed by a residual add
    "smollm2": {"o": (576, 576), "down": (576, 1536)},
    "qwen3-8b": {"o": (4096, 4096), "down": (4096, 12288)},
    # the fused in-projections (no residual add): DFLASH_LINEAR=auto sends them to cuBLAS above
    # 8 MiB; this times whether some config would beat cuBLAS there
    "qwen3-8b-in": {"qkv": (6144, 4096), "gate_up": (24576, 4096)},
    "smollm2-in": {"qkv": (960, 576), "gate_up": (3072, 576)},
}
NO_RESIDUAL = ("qkv", "gate_up")
CONFIGS = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (128, 256, 512) for w, st in ((4, 2), (4, 4), (8, 3))]
WIDE = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (128, 256, 512)
        for w, st in ((2, 4), (4, 2), (4, 3), (4, 4), (4, 6), (8, 3), (8, 4))]  # fmt: skip
DEEP = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (128, 256)
        for w, st in ((2, 4), (2, 6), (2, 8), (4, 6), (4, 8), (8, 6))]  # fmt: skip


ROLES = ("o", "down", "qkv", "gate_up")  # o/down with a residual add, gate_up with its SwiGLU epilogue


def graph_time_us(fn, reps: int = 20, replays: int = 10) -> float:
    """Mean time of one ``fn()`` replayed inside a CUDA graph of ``reps`` calls, the graph
    replayed ``replays`` times (microseconds)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * reps)


def parse_shapes(text: str) -> dict[str, dict[str, tuple[int, int]]]:
    """``--shapes``: comma-separated names of :data:`SHAPES` and/or ``ROLE=NxK`` entries (ROLE one
    of :data:`ROLES`, N the weight's rows, K its columns) for a model of your own, e.g.
    ``o=4096x4096,down=4096x14336,qkv=6144x4096,gate_up=28672x4096`` (Llama-3-8B)."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item in SHAPES:
            out[item] = SHAPES[item]
            continue
        role, _, dims = item.partition("=")
        n, _, k = dims.lower().partition("x")
        if role not in ROLES or not (n.isdigit() and k.isdigit()):
            raise SystemExit(f"--shapes: {item!r} is neither one of {sorted(SHAPES)} nor ROLE=NxK "
                             f"with ROLE in {ROLES} (e.g. o=4096x4096)")  # fmt: skip
        out.setdefault("custom", {})[role] = (int(n), int(k))
    return out


CONFIG = [""]  # the tiles the calls take: a linear_config value ("" = the built-in choice)


def _call(name, x, ws, r):
    """One projection call as the static forwards make it (PDL where the GPU has it, the tiles
    of :data:`CONFIG`), cycling through the weight copies ``ws`` (a new copy each call, so a
    CUDA graph of calls reads them in turn)."""
    from dflash.kernels.pdl import pdl_supported

    cycle = itertools.cycle(ws)
    glu, pdl = name == "gate_up", pdl_supported(x.device)
    return lambda: sl._launch(x, next(cycle), None, r, glu=glu, pdl=pdl, config=CONFIG[0])


def _cublas_call(x, ws):
    """``F.linear`` alone (no residual, no epilogue), cycling through the weight copies."""
    cycle = itertools.cycle(ws)
    return lambda: F.linear(x, next(cycle))


def _compile_only(configs, shapes, chunk: int, chunks: int) -> None:
    """Launch every config of this chunk once on small inputs (fills Triton's disk cache)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    for i, cfg in enumerate(configs):
        if i % chunks != chunk:
            continue
        CONFIG[0] = ",".join(map(str, cfg))
        for name in sorted({name for names in shapes.values() for name in names}):
            n, k = 64, 1024
            x = torch.randn(1, k, device=dev, dtype=dt)
            w = torch.randn(2 * n if name == "gate_up" else n, k, device=dev, dtype=dt)
            r = None if name in NO_RESIDUAL else torch.randn(1, n, device=dev, dtype=dt)
            try:
                _call(name, x, [w], r)()
            except Exception:  # noqa: BLE001 - a config may not fit (registers, smem)
                pass
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "sweep_out"))
    ap.add_argument("--shapes", default="smollm2,qwen3-8b")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--cold", action="store_true", help="cycle through weight copies past the L2 cache")
    ap.add_argument("--configs", choices=("small", "wide", "deep"), default="small")
    ap.add_argument("--compile-procs", type=int, default=0, help="compile the configs in N processes first")
    ap.add_argument("--compile-chunk", default=None, help=argparse.SUPPRESS)  # "i/n": compile only
    args = ap.parse_args()
    configs = {"small": CONFIGS, "wide": WIDE, "deep": DEEP}[args.configs]
    shapes = parse_shapes(args.shapes)
    if args.compile_chunk:
        i, n = (int(v) for v in args.compile_chunk.split("/"))
        _compile_only(configs, shapes, i, n)
        return
    if args.compile_procs > 0:
        base = [sys.executable, __file__, "--shapes", args.shapes, "--configs", args.configs]
        procs = [subprocess.Popen([*base, "--compile-chunk", f"{i}/{args.compile_procs}"])
                 for i in range(args.compile_procs)]  # fmt: skip
        for p in procs:
            p.wait()
    dev, dt = torch.device("cuda"), torch.bfloat16
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(dev), "cold": args.cold, "l2_bytes": l2,
                    "configs": args.configs, "results": []}  # fmt: skip
    best: list[str] = []
    for shape, names in shapes.items():
        for name, (n, k) in names.items():
            rows = n  # weight rows (gate+up: [gate; up], n // 2 outputs after its SwiGLU epilogue)
            nbytes = rows * k * 2
            copies = max(2, math.ceil(3 * l2 / nbytes)) if args.cold else 1
            ws = [torch.randn(rows, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device=dev, dtype=dt)
                r = None if name in NO_RESIDUAL else torch.randn(m, n, device=dev, dtype=dt)
                call = _call(name, x, ws, r)
                row = {"shape": shape, "name": name, "m": m, "n": rows, "k": k, "copies": copies,
                       "cublas_us": graph_time_us(_cublas_call(x, ws), 50)}  # fmt: skip
                CONFIG[0] = ""
                if name == "gate_up":
                    ref = sl.small_linear_glu_reference(x, ws[0])
                    got = sl._launch(x, ws[0], None, None, glu=True)
                else:
                    ref = sl.small_linear_reference(x, ws[0], None, r)
                    got = sl._launch(x, ws[0], None, r)
                row["max_err"] = (got.float() - ref.float()).abs().max().item()
                row["default_cfg"] = sl.kernel_config(m, rows, k)[1:]
                row["default_us"] = graph_time_us(call, 50)
                row["GBps_default"] = nbytes / row["default_us"] / 1e3
                sweep = []
                for cfg in configs:
                    CONFIG[0] = ",".join(map(str, cfg))
                    try:
                        sweep.append((graph_time_us(call, 50), cfg))
                    except Exception as e:  # noqa: BLE001 - a config may not fit (registers, smem)
                        sweep.append((float("inf"), cfg))
                        print(f"{name} m={m} {cfg}: {type(e).__name__}", flush=True)
                CONFIG[0] = ""
                sweep.sort()
                row["best_us"], row["best_cfg"] = sweep[0]
                row["GBps_best"] = nbytes / row["best_us"] / 1e3
                row["top5"] = sweep[:5]
                report["results"].append(row)
                if sweep[0][1] != tuple(row["default_cfg"]):
                    best.append(f"{rows}x{k}@{m}=" + ",".join(map(str, sweep[0][1])))
                print(json.dumps({kk: v for kk, v in row.items() if kk != "top5"}), flush=True)
                (out / "small_linear_sweep.json").write_text(json.dumps(report, indent=2))
                (out / "best_config.env").write_text(";".join(best) + "\n")

if __name__ == "__main__":
    main()
