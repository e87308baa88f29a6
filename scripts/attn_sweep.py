"""Launch settings of the split-KV attention kernel, timed on the GPU: which ones are fastest.

    PYTHONPATH=. python3 scripts/attn_sweep.py [--out DIR] [--budget-s 240]

For the demo pair's head layout (target and draft: 9 query heads, 3 KV heads, head dim 64) and
Qwen3-8B's (32, 8, 128), 1 and 16 query rows, several filled lengths: the time of one
:func:`~dflash.kernels.split_attention.split_attention_kernel` call (CUDA graphs of 20 calls,
launch overhead excluded) for each keys-per-program split, query heads per program, keys per
inner iteration and num_warps, then num_stages for the best of each case. The 16-row draft call
(``non_causal``) gives every row the block's last position, as the draft does.
``--cases long`` times 1,500 and 3,500 keys instead (64/128 keys per iteration, 4/8 warps).
Splits timed: 256, 512, 1,024 and one slice of the 4,096-row cache. Each result is
checked against SDPA with the position mask (max abs error, bf16) and printed as one JSON line
as it comes, so a timeout loses nothing; ``attn_sweep.json`` in ``--out`` at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.split_attention_check import graph_time_us  # noqa: E402 - after the path fix

LAYOUTS = {"smollm2": (9, 3, 64), "qwen3-8b": (32, 8, 128)}  # heads, kv heads, head dim
CAPACITY = 4096


def cases(which: str = "short"):
    """(layout, T, filled, non_causal) to time. ``short``: the demo's verify/draft widths at
    gsm8k lengths, the 8B shape's block 1 at its bench_big prompt length (the sixteenth
    session's sweep); ``long``: the demo's 16-row calls and 1-row step and the 8B block 1 at
    1,500 and 3,500 keys (whether the sixteenth session's 1,024 keys per program for head dims
    <= 64 still held there: it did not, see the seventeenth session)."""
    if which == "long":
        for filled in (1500, 3500):
            yield "smollm2", 1, filled, False
            yield "smollm2", 16, filled, True
            yield "qwen3-8b", 1, filled, False
        return
    for filled in (160, 300, 460):
        yield "smollm2", 1, filled, False
        yield "smollm2", 16, filled, False
        yield "smollm2", 16, filled, True
    yield "qwen3-8b", 1, 512, False
    yield "qwen3-8b", 1, 1024, False


def main(argv=None) -> list[dict]:
    from dflash.kernels.split_attention import (
        default_one_slice,
        default_split,
        heads_per_program,
        split_attention_kernel,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this")
    ap.add_argument("--cases", choices=("short", "long"), default="short")
    args = ap.parse_args(argv)
    dev, t0, rows = torch.device("cuda"), time.time(), []
    for layout, t, filled, non_causal in cases(args.cases):
        if time.time() - t0 > args.budget_s:
            print(json.dumps({"skipped": [layout, t, filled, non_causal]}), flush=True)
            continue
        h, hkv, d = LAYOUTS[layout]
        groups = h // hkv
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, t, h, d, device=dev, generator=g).bfloat16().transpose(1, 2)
        k, v = (torch.randn(1, hkv, CAPACITY, d, device=dev, generator=g).bfloat16() for _ in range(2))
        pos = torch.arange(filled - t, filled, device=dev)
        qpos = pos[-1:] if non_causal else pos
        mask = (torch.arange(CAPACITY, device=dev)[None, :] <= qpos.expand(t)[:, None])[None, None]
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=d**-0.5,
                                             enable_gqa=True)  # fmt: skip
        best: dict = {}
        heads = [x for x in (1, 2, 4, groups) if groups % x == 0]
        splits = (256, 512, 1024, CAPACITY)  # 1024 < CAPACITY compiles the merge in (a real
        # cache of 1,024 rows would not), so the "new default" row is a little pessimistic
        blocks, warps_ = ((64, 128), (4, 8)) if args.cases == "long" else ((32, 64, 128), (2, 4, 8))
        for split, gp, block, warps in itertools.product(splits, sorted(set(heads)), blocks, warps_):
            a = (q, k, v, qpos, d**-0.5, split, gp, block, warps, 0)
            try:
                err = (split_attention_kernel(*a).float() - ref).abs().max().item()
                us = graph_time_us(lambda a=a: split_attention_kernel(*a), replays=20)
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result too
                err, us = None, None
                print(json.dumps({"error": f"{type(e).__name__}: {e}"[:200]}), flush=True)
            row = {"layout": layout, "T": t, "filled": filled, "non_causal": non_causal, "split": split,
                   "heads_per_program": gp, "block": block, "warps": warps, "stages": 0, "us": us,
                   "max_err": err}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            if us is not None and (not best or us < best["us"]):
                best = row
        for stages in (1, 2, 3, 4):  # the best setting with explicit pipelining depths
            if not best:
                break
            a = (q, k, v, qpos, d**-0.5, best["split"], best["heads_per_program"], best["block"], best["warps"], stages)
            try:
                us = graph_time_us(lambda a=a: split_attention_kernel(*a), replays=20)
            except Exception as e:  # noqa: BLE001
                us = None
                print(json.dumps({"error": f"{type(e).__name__}: {e}"[:200]}), flush=True)
            row = {**best, "stages": stages, "us": us}
            rows.append(row)
            print(json.dumps(row), flush=True)
        mine = [r for r in rows if r["layout"] == layout and r["T"] == t and r["filled"] == filled
                and r["non_causal"] == non_causal and r["warps"] == 4 and r["stages"] == 0]  # fmt: skip
        # the fifteenth session's launch (256 keys, one program per KV head, 64 per iteration)
        # and today's launch as it ships (default_split keys per program with the first program
        # alone up to default_one_slice filled keys; heads_per_program, 128 per iteration)
        old = next((r for r in mine if r["split"] == 256 and r["heads_per_program"] == groups
                    and r["block"] == 64), {})  # fmt: skip
        a = (q, k, v, qpos, d**-0.5, min(default_split(d), CAPACITY), heads_per_program(groups, t), 128)
        one = default_one_slice(d)
        new_us = graph_time_us(lambda a=a, one=one: split_attention_kernel(*a, one_slice=one), replays=20)
        print(json.dumps({"case": [layout, t, filled, non_causal], "default_us": old.get("us"),
                          "new_default_us": new_us, "best": best}), flush=True)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "attn_sweep.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
