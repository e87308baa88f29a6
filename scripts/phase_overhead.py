"""What a dependent step costs on the GPU: a chain of kernels in a CUDA graph against one
persistent kernel whose programs meet at a grid barrier between steps.

    PYTHONPATH=. python3 scripts/phase_overhead.py --out $OUT/phase_overhead.json

The draft's forward is about 46 dependent kernels of a few microseconds each (0.144 ms on the
H200, twenty-fifth session). This measures the floor of that form: each step reads the whole
previous step's output (like a projection's input), a slice of fresh weights per program
(``--weight-kib`` per step in all, loaded before the wait as the real kernels do) and writes its
own slice of the output. Forms, each ``--steps`` steps, ``--programs`` programs:

- ``chain``: one kernel per step in a CUDA graph, plain launches;
- ``chain-pdl``: the same with programmatic dependent launch (the static path's default);
- ``persistent``: one kernel, the steps separated by a grid barrier (an atomic counter in
  global memory, release/acquire at GPU scope); the next step's weight slice is loaded before
  the barrier. Needs every program resident at once (``--programs`` <= the SM count).

Every form computes the same numbers; the script checks them against each other before timing.
JSON: microseconds per step of each form, per (programs, weight KiB) case.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def _step_kernel(x_ptr, y_ptr, w_ptr, D, DP: tl.constexpr, CH: tl.constexpr, WN: tl.constexpr,
                 PDL: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    ws = 0.0
    if WN > 0:  # this step's weights: independent of x, loaded before the wait
        ws = tl.sum(tl.load(w_ptr + pid * WN + tl.arange(0, WN)).to(tl.float32))
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.arange(0, DP)
    x = tl.load(x_ptr + cols, mask=cols < D, other=0.0)
    s = tl.sum(x) * 1e-3 + ws * 1e-6
    offs = pid * CH + tl.arange(0, CH)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) * 0.5 + s)


@triton.jit
def _persistent_kernel(buf_ptr, w_ptr, cnt_ptr, epoch_ptr, steps, nprog, D, DP: tl.constexpr,
                       CH: tl.constexpr, WN: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    base = tl.load(epoch_ptr) * steps * nprog  # launches so far (program 0 bumps it at the end)
    cols = tl.arange(0, DP)
    offs = pid * CH + tl.arange(0, CH)
    ws = 0.0
    if WN > 0:
        ws = tl.sum(tl.load(w_ptr + pid * WN + tl.arange(0, WN)).to(tl.float32))
    for p in range(steps):
        src = buf_ptr + (p % 2) * DP
        dst = buf_ptr + ((p + 1) % 2) * DP
        x = tl.load(src + cols, mask=cols < D, other=0.0, cache_modifier=".cg")
        s = tl.sum(x) * 1e-3 + ws * 1e-6
        tl.store(dst + offs, tl.load(src + offs, cache_modifier=".cg") * 0.5 + s)
        if WN > 0:  # the next step's weights before the barrier
            nxt = tl.minimum(p + 1, steps - 1)
            ws = tl.sum(tl.load(w_ptr + (nxt * nprog + pid) * WN + tl.arange(0, WN)).to(tl.float32))
        tl.debug_barrier()  # every thread's stores before the release below
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
        goal = base + (p + 1) * nprog
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        while seen < goal:
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
    if pid == 0:
        tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)


def graph_time(fn, iters: int) -> float:
    """Mean ms of one replay of ``fn`` captured in a CUDA graph (after 3 warm-up calls)."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(10):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters, g


def run_case(nprog: int, weight_kib: int, steps: int, iters: int, ch: int = 8) -> dict:
    dev = torch.device("cuda")
    d = nprog * ch
    dp = triton.next_power_of_2(d)
    wn = 0 if weight_kib == 0 else triton.next_power_of_2(max(weight_kib * 1024 // 2 // nprog, 16))
    w = torch.randn(steps * nprog * max(wn, 1), device=dev, dtype=torch.bfloat16)
    x0 = torch.randn(dp, device=dev)
    x0[d:] = 0
    # chain: buffers per step so the graph's kernels depend through memory as the real ones do
    bufs = [x0.clone()] + [torch.zeros(dp, device=dev) for _ in range(steps)]

    def chain(pdl: bool):
        def fn():
            for p in range(steps):
                _step_kernel[(nprog,)](bufs[p], bufs[p + 1], w[p * nprog * max(wn, 1):], d, DP=dp, CH=ch, WN=wn,
                                       PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))  # fmt: skip

        return fn

    pbuf = torch.zeros(2, dp, device=dev)
    cnt = torch.zeros(1, device=dev, dtype=torch.int32)
    epoch = torch.zeros(1, device=dev, dtype=torch.int32)

    def persistent():
        pbuf[0].copy_(x0)
        _persistent_kernel[(nprog,)](
            pbuf, w, cnt, epoch, steps, nprog, d, DP=dp, CH=ch, WN=wn, num_warps=4
        )

    # correctness: one eager run of each form gives the same output
    chain(False)()
    persistent()
    torch.cuda.synchronize()
    ref, got = bufs[steps][:d], pbuf[steps % 2][:d]
    err = (ref - got).abs().max().item()
    out = {"programs": nprog, "weight_kib_per_step": weight_kib, "steps": steps, "max_abs_diff": err,
           "counter": int(cnt.item()), "epoch": int(epoch.item())}  # fmt: skip
    have_pdl = hasattr(tl.extra.cuda, "gdc_wait") and torch.cuda.get_device_capability()[0] >= 9
    for name, fn in (("chain", chain(False)), ("chain-pdl", chain(True) if have_pdl else None),
                     ("persistent", persistent)):  # fmt: skip
        if fn is None:
            continue
        ms, _ = graph_time(fn, iters)
        out[name + "_us_per_step"] = round(ms * 1000 / steps, 3)
    # the persistent graph also holds a copy (the input reset): time that alone to subtract
    ms, _ = graph_time(lambda: pbuf[0].copy_(x0), iters)
    out["persistent_reset_us"] = round(ms * 1000, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=46)
    ap.add_argument("--programs", default="132,66,33")
    ap.add_argument("--weight-kib", default="0,1024")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="phase_overhead.json")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {
        "device": torch.cuda.get_device_name(0),
        "sms": sms,
        "triton": triton.__version__,
        "cases": [],
    }
    for nprog in (int(v) for v in args.programs.split(",")):
        if nprog > sms:
            print(f"skip {nprog} programs: more than {sms} SMs")
            continue
        for kib in (int(v) for v in args.weight_kib.split(",")):
            case = run_case(nprog, kib, args.steps, args.iters)
            print(json.dumps(case), flush=True)
            res["cases"].append(case)
            Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
