"""Check and time ``DFLASH_PDL_TILE`` (a wider first weight tile loaded before the PDL wait).

    PYTHONPATH=. python3 scripts/pdl_tile_check.py [--out DIR] [--tiles 0,32,64,128]

For each tile budget (KiB per program; 0 = one K tile, the default) and each projection of
the demo target and of Qwen3-8B's shape (one row and 16 rows, bf16):

- the largest difference from ``F.linear`` (+ residual) over random inputs, against the same
  figure for budget 0 (the summation order inside a wider dot may differ, by bf16 rounding);
- the time of a CUDA graph of 20 (split-KV attention, then o_proj with its residual add) pairs
  and of 20 (SiLU * up, then down_proj) pairs per layer shape, so the wider tile can stream
  while its predecessor runs, as in a decode step (per pair, us).

Writes pdl_tile_check.json (incrementally). Needs CUDA, Triton and a Hopper GPU for PDL.
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
from dflash.backends.split_attention import split_attention
from scripts.split_attention_check import graph_time_us

# name -> (hidden, heads, kv heads, head dim, intermediate, keys)
SHAPES = {"smollm2": (576, 9, 3, 64, 1536, 300), "qwen3-8b": (4096, 32, 8, 128, 12288, 512)}


def _attn_o(q, kc, vc, pos, w, res):
    """Split-KV attention, then o_proj with its residual add (the pair of a decode step)."""
    o = split_attention(q, kc, vc, pos, None)  # [1, H, T, D] laid out [1, T, H, D]
    return sl.small_linear(o.transpose(1, 2).reshape(q.shape[2], -1), w, None, res)


def _act_down(gu, w, res):
    """SiLU(gate) * up, then down_proj with its residual add."""
    g, u = gu.chunk(2, dim=-1)
    return sl.small_linear(F.silu(g) * u, w, None, res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiles", default="0,32,64,128")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the logic (TRITON_INTERPRET=1, float32, no timing)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    timed = graph_time_us if dev.type == "cuda" else (lambda fn: fn() is None or 0.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    report: dict = {"device": name, "pdl": sl.pdl_enabled(dev), "results": []}
    torch.manual_seed(0)
    for shape, (hid, heads, kvh, hd, inter, keys) in SHAPES.items():
        projs = {"o": (hid, heads * hd), "down": (hid, inter), "qkv": ((heads + 2 * kvh) * hd, hid),
                 "gate_up": (2 * inter, hid)}  # fmt: skip
        weights = {p: torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for p, (n, k) in projs.items()}
        cap = 1024
        kc = torch.randn(1, kvh, cap, hd, device=dev, dtype=dt)
        vc = torch.randn(1, kvh, cap, hd, device=dev, dtype=dt)
        for rows in (1, 16):
            xs = {p: torch.randn(rows, k, device=dev, dtype=dt) for p, (n, k) in projs.items()}
            res = torch.randn(rows, hid, device=dev, dtype=dt)
            q = torch.randn(1, heads, rows, hd, device=dev, dtype=dt)
            pos = torch.arange(keys - rows, keys, device=dev)
            gu = torch.randn(rows, 2 * inter, device=dev, dtype=dt)
            for tile in (int(t) for t in args.tiles.split(",")):  # KiB per program
                os.environ[sl.TILE_ENV] = str(tile)
                row: dict = {"shape": shape, "rows": rows, "tile_kib": tile, "err": {}}
                for p, w in weights.items():
                    r = res if p in ("o", "down") else None
                    y = sl.small_linear(xs[p], w, None, r).float()
                    ref = F.linear(xs[p], w).float() if r is None else (r + F.linear(xs[p], w)).float()
                    row["err"][p] = (y - ref).abs().max().item()
                    bn, bk = sl.kernel_config(rows, *w.shape)[1:3]
                    row.setdefault("bk0", {})[p] = sl.first_tile(w.shape[1], bn, bk, 2, sl.pdl_tile_bytes())

                attn_o = functools.partial(_attn_o, q, kc, vc, pos, weights["o"], res)
                act_down = functools.partial(_act_down, gu, weights["down"], res)
                qkv_only = functools.partial(sl.small_linear, xs["qkv"], weights["qkv"])
                row["attn_o_us"] = timed(attn_o)
                row["act_down_us"] = timed(act_down)
                row["qkv_us"] = timed(qkv_only)
                report["results"].append(row)
                print(json.dumps(row), flush=True)
                (out / "pdl_tile_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
