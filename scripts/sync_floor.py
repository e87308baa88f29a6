"""What one dependent step costs on this GPU: a kernel boundary in a CUDA graph, with and
without PDL, against a grid barrier inside one persistent kernel.

    PYTHONPATH=. python3 scripts/sync_floor.py [--out sync_floor.json]

The demo draft's forward is a chain of about 41 dependent kernels of 2-4 us each, far above its
weights' HBM time (about 1.6 us a layer): what it pays is the boundaries. This measures the
floor of one boundary, so that a persistent draft kernel (one launch, grid barriers between its
phases) can be judged before it is built:

- ``hop``: a chain of ``--steps`` tiny kernels (``--programs`` programs each; every program
  reads a value another program wrote in the kernel before, adds one, writes), one CUDA graph,
  with PDL (``griddepcontrol``) and without;
- ``gemv``: a chain of ``small_linear`` kernels, 16 rows x 512 -> 512 (a draft projection's
  shape), distinct weights, the output of one the input of the next, one CUDA graph (PDL as
  ``DFLASH_PDL``);
- ``graph_boundary``: two graphs of ``steps / 2`` hops replayed back to back against one graph
  of ``steps`` hops (the extra microseconds: what a second graph per step costs);
- ``barrier_hop``: one persistent kernel doing the hops with a grid barrier (an atomic counter,
  release / acquire at GPU scope) between them;
- ``barrier_gemv``: one persistent kernel doing the GEMV chain (32 programs of 16 columns), each
  phase's weight tile loaded before the barrier, its input rows (bypassing L1) after it.

Each figure is microseconds per step: (time of ``steps`` - time of ``steps / 4``) divided by the
steps between, medians of ``--iters`` replays, so launch and graph costs cancel. The results are
checked (every hop count, every GEMV against the chain of ``small_linear`` kernels). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _hop_kernel(SRC, DST, G, PDL: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    v = tl.load(SRC + (pid + 1) % G)
    tl.store(DST + pid, v + 1)


@triton.jit
def _grid_sync(CNT, target):
    """Every program of the grid has arrived here ``target / grid`` times: the stores before it
    are visible to the loads after it (release on arrival, acquire while spinning)."""
    tl.debug_barrier()
    tl.atomic_add(CNT, 1, sem="release", scope="gpu")
    cur = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
    while cur < target:
        cur = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _barrier_hop_kernel(BUF, CNT, G, STEPS):
    pid = tl.program_id(0)
    for p in range(STEPS):
        src = BUF + (p % 2) * G
        dst = BUF + ((p + 1) % 2) * G
        v = tl.load(src + (pid + 1) % G, cache_modifier=".cg")
        tl.store(dst + pid, v + 1)
        _grid_sync(CNT, G * (p + 1))


@triton.jit
def _barrier_gemv_kernel(X, W, CNT, STEPS, G, M: tl.constexpr, K: tl.constexpr, BN: tl.constexpr):
    """X [2, M, K] ping-pong rows; W [STEPS, K, K] (out, in); phase p: X[(p+1)%2][:, cols] =
    X[p%2] @ W[p][cols]^T, this program's BN columns."""
    pid = tl.program_id(0)
    rm = tl.arange(0, M)
    rk = tl.arange(0, K)
    rn = pid * BN + tl.arange(0, BN)
    w = tl.load(W + rn[:, None] * K + rk[None, :])
    for p in range(STEPS):
        x = tl.load(X + (p % 2) * M * K + rm[:, None] * K + rk[None, :], cache_modifier=".cg")
        y = tl.dot(x, tl.trans(w)).to(X.dtype.element_ty)
        tl.store(X + ((p + 1) % 2) * M * K + rm[:, None] * K + rn[None, :], y)
        nxt = (p + 1) % STEPS
        w = tl.load(W + nxt * K * K + rn[:, None] * K + rk[None, :])  # before the barrier
        _grid_sync(CNT, G * (p + 1))


def _time_graph(fn, iters: int) -> float:
    """Median milliseconds of one replay of a graph capturing ``fn``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _capture(fn):
    """A CUDA graph of ``fn`` (run once on a side stream first: compiles, warms up)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _time_replays(graphs, iters: int) -> float:
    """Median milliseconds of replaying ``graphs`` back to back."""
    for _ in range(3):
        for g in graphs:
            g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for g in graphs:
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _per_step(make, steps: int, iters: int) -> tuple[float, float, float]:
    """(us per step, ms at ``steps``, ms at ``steps // 4``) for ``make(n)`` -> a graph body."""
    few = max(steps // 4, 1)
    t_many = _time_graph(make(steps), iters)
    t_few = _time_graph(make(few), iters)
    return (t_many - t_few) * 1e3 / (steps - few), t_many, t_few


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sync_floor.json")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--programs", type=int, nargs="+", default=[32, 66, 132])
    args = ap.parse_args(argv)
    from dflash.kernels.small_linear import small_linear

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out: dict = {"device": torch.cuda.get_device_name(dev), "sms": sms, "steps": args.steps,
                 "torch": torch.__version__, "triton": triton.__version__, "rows": []}  # fmt: skip

    def row(kind, programs, us, many, few, **extra):
        r = {"kind": kind, "programs": programs, "us_per_step": round(us, 3), "ms_many": round(many, 4),
             "ms_few": round(few, 4), **extra}  # fmt: skip
        out["rows"].append(r)
        print(json.dumps(r), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")  # a hang later keeps these

    for g in args.programs:
        if g > sms:
            continue
        bufs = [torch.zeros(g, dtype=torch.int32, device=dev) for _ in range(2)]
        for pdl in (False, True):

            def make(n, g=g, pdl=pdl, bufs=bufs):
                def body():
                    for i in range(n):
                        _hop_kernel[(g,)](bufs[i % 2], bufs[(i + 1) % 2], g, PDL=pdl,
                                          **({"launch_pdl": True} if pdl else {}))  # fmt: skip

                return body

            us, many, few = _per_step(make, args.steps, args.iters)
            row("hop", g, us, many, few, pdl=pdl)
            # a graph boundary: two graphs of steps/2 hops back to back against one of steps
            half = args.steps // 2
            one = _time_replays([_capture(make(2 * half))], args.iters)
            two = _time_replays([_capture(make(half)), _capture(make(half))], args.iters)
            row("graph_boundary", g, (two - one) * 1e3, two, one, pdl=pdl)
    m, k, bn = 16, 512, 16
    ws = [torch.randn(k, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for _ in range(args.steps)]
    wall = torch.stack(ws)
    x0 = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    xs = [torch.empty(m, k, device=dev, dtype=torch.bfloat16) for _ in range(2)]

    # the custom op allocates its output; chain through outputs instead (no copies)
    def make_chain(n):
        def body():
            y = x0
            for i in range(n):
                y = small_linear(y, ws[i])
            xs[1].copy_(y)

        return body

    us, many, few = _per_step(make_chain, args.steps, args.iters)
    make_chain(args.steps)()
    torch.cuda.synchronize()
    ref = xs[1].clone()
    row("gemv", k // bn, us, many, few)
    for g in args.programs:  # the persistent kernels last: a hang keeps the rows above
        if g > sms:
            continue
        buf = torch.zeros(2, g, dtype=torch.int32, device=dev)
        cnt = torch.zeros(1, dtype=torch.int32, device=dev)

        def make_b(n, g=g, buf=buf, cnt=cnt):
            def body():
                cnt.zero_()
                buf.zero_()
                _barrier_hop_kernel[(g,)](buf, cnt, g, n)

            return body

        us, many, few = _per_step(make_b, args.steps, args.iters)
        make_b(args.steps)()
        torch.cuda.synchronize()
        ok = bool((buf[args.steps % 2] == args.steps).all()) and int(cnt) == g * args.steps
        row("barrier_hop", g, us, many, few, correct=ok, counter=int(cnt))

    g = k // bn
    xb = torch.zeros(2, m, k, device=dev, dtype=torch.bfloat16)
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)

    def make_bg(n):
        def body():
            cnt.zero_()
            xb[0].copy_(x0)
            _barrier_gemv_kernel[(g,)](xb, wall, cnt, n, g, M=m, K=k, BN=bn, num_warps=4)

        return body

    us, many, few = _per_step(make_bg, args.steps, args.iters)
    make_bg(args.steps)()
    torch.cuda.synchronize()
    diff = (xb[args.steps % 2].float() - ref.float()).abs().max().item()
    row("barrier_gemv", g, us, many, few, max_abs_diff_vs_chain=diff, counter=int(cnt))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
