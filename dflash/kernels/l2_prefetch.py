"""Weights streamed into the GPU's L2 cache on a side stream while latency-bound kernels run.

A block-1 step of a large target is a chain of weight GEMVs near the HBM bandwidth with small
kernels between them that read almost nothing: after each layer's qkv projection come the q/k
norm + RoPE + cache write and the attention over the few hundred filled KV rows (about 11 us per
layer on the H200 for a Qwen3-8B shape, ``scripts/bench_big.py``), while HBM idles. Here the
static forwards fork a side stream right after the qkv projection and issue PTX
``prefetch.global.L2`` for the next weights of the layer (o_proj, then gate+up, then down_proj, up
to a byte budget), so the following GEMVs find their first bytes in L2. The prefetch kernel
holds no data (fire-and-forget prefetches) and the main stream never waits for it: a join
after the last layer's output (CUDA graph capture needs every fork joined) brings the side
stream back long after it ended. Tokens do not change: a prefetch reads weights and writes nothing.

``DFLASH_PREFETCH``: the byte budget per layer in MiB (default :data:`DEFAULT_MIB`; ``0`` turns
it off); ``<MiB>,early`` forks the target's prefetch before the qkv projection instead. CUDA with Triton only; a failed capture turns it off first (see
:meth:`~dflash.backends.static.backend.StaticBackend._fall_back`).

How the prefetch is issued: on Hopper and newer (compute capability >= 9) with PTX
``cp.async.bulk.prefetch.L2`` (the TMA unit fetches :data:`CHUNK` bytes per instruction: a few
programs, a few instructions each); ``,lines`` (and older GPUs) with one ``prefetch.global.L2``
per 128-byte line (hundreds of programs for an 8B layer's o_proj, competing for the SMs).
"""

from __future__ import annotations

import os

import torch

PREFETCH_ENV = "DFLASH_PREFETCH"
DEFAULT_MIB = 0  # off until measured
LINE = 128  # bytes per prefetch (one L2 line)
BLOCK = 1024  # prefetches per program
CHUNK = 16384  # bytes per bulk prefetch (a multiple of 16)
BULK_BLOCK = 64  # bulk prefetches per program (1 MiB)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def prefetch_setting(device: torch.device) -> tuple[int, bool]:
    """``DFLASH_PREFETCH``: (bytes of a layer's weights to prefetch into L2, early). The variable
    holds MiB (default :data:`DEFAULT_MIB`), optionally followed by ``,early``: the target's
    layers then fork the prefetch before their qkv projection instead of after it (HBM has room
    beside cuBLAS's qkv GEMV on an 8B shape). (0, False) off CUDA or without Triton.

    Raises:
        InputError: not a whole number >= 0, optionally with ``,early``.
    """
    mib, flags = _parse()
    if device.type != "cuda" or triton is None:
        return 0, False
    return (int(mib) if mib else DEFAULT_MIB) << 20, "early" in flags


def _parse() -> tuple[str, set[str]]:
    raw = os.environ.get(PREFETCH_ENV, "").strip().lower()
    mib, *rest = raw.split(",")
    flags = set(rest)
    if (mib and not mib.isdigit()) or not flags <= {"early", "lines"} or len(flags) != len(rest):
        from dflash.errors import InputError

        raise InputError(f"{PREFETCH_ENV} must be a whole number of MiB (0 = off), optionally with "
                         f"',early' and/or ',lines', got {raw!r}.",
                         hint=f"unset it for the default ({DEFAULT_MIB})")  # fmt: skip
    return mib, flags


def uses_bulk(device: torch.device) -> bool:
    """Whether prefetches go out as ``cp.async.bulk.prefetch.L2`` (compute capability >= 9 and no
    ``,lines`` in ``DFLASH_PREFETCH``) rather than one ``prefetch.global.L2`` per line."""
    if "lines" in _parse()[1] or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_budget(device: torch.device) -> int:
    """Bytes per layer of :func:`prefetch_setting` (0 = off)."""
    return prefetch_setting(device)[0]


def plan(weights, budget: int) -> list[tuple[torch.Tensor, int]]:
    """(weight, elements) to prefetch: ``weights`` in order, whole while the budget (bytes)
    lasts, the last one cut to what is left; at most three."""
    out: list[tuple[torch.Tensor, int]] = []
    left = budget
    for w in weights:
        if left <= 0 or len(out) == 3:
            break
        n = min(w.numel(), left // w.element_size())
        if n > 0:
            out.append((w, n))
            left -= n * w.element_size()
    return out


_STREAMS: dict = {}  # device -> the side stream


def _side(device: torch.device) -> torch.cuda.Stream:
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device)
    return _STREAMS[key]


if triton is not None:

    @triton.jit
    def _issue(P, N, STEP: tl.constexpr, BLOCK: tl.constexpr):
        i = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)) * STEP  # one element per L2 line
        if tl.program_id(0) * BLOCK * STEP < N:
            ptr = P + tl.minimum(i, N - 1)  # past the end: the last line again (harmless)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptr],
                                      dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip

    @triton.jit
    def _prefetch_kernel(A, B, C, NA, NB, NC, STEP: tl.constexpr, BLOCK: tl.constexpr):
        seg = tl.program_id(1)
        if seg == 0:
            _issue(A, NA, STEP, BLOCK)
        elif seg == 1:
            _issue(B, NB, STEP, BLOCK)
        else:
            _issue(C, NC, STEP, BLOCK)


    @triton.jit
    def _issue_bulk(P, N, CHUNK_E: tl.constexpr, ELEM: tl.constexpr, BLOCK: tl.constexpr):
        start = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)) * CHUNK_E  # elements
        ok = start < N
        size = tl.where(ok, (tl.minimum(N - start, CHUNK_E) * ELEM) // 16 * 16, 0)  # bytes, whole 16s
        ptr = P + tl.where(ok, start, 0)
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $2, 0; "
                                  "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                                  "=r,l,r", [ptr, size.to(tl.uint32)], dtype=tl.int32, is_pure=False,
                                  pack=1)  # fmt: skip

    @triton.jit
    def _bulk_kernel(A, B, C, NA, NB, NC, CHUNK_E: tl.constexpr, ELEM: tl.constexpr, BLOCK: tl.constexpr):
        seg = tl.program_id(1)
        if seg == 0:
            _issue_bulk(A, NA, CHUNK_E, ELEM, BLOCK)
        elif seg == 1:
            _issue_bulk(B, NB, CHUNK_E, ELEM, BLOCK)
        else:
            _issue_bulk(C, NC, CHUNK_E, ELEM, BLOCK)


def _launch(parts: list[tuple[torch.Tensor, int]]) -> None:
    """Prefetch ``parts`` (weight, elements from its start), all of one dtype, in one launch."""
    ws = [w for w, _ in parts]
    ns = [n for _, n in parts]
    while len(ws) < 3:
        ws.append(ws[0])
        ns.append(0)
    elem = ws[0].element_size()
    if uses_bulk(ws[0].device) and all(w.data_ptr() % 16 == 0 for w in ws):
        chunk = CHUNK // elem
        grid = (triton.cdiv(max(ns), chunk * BULK_BLOCK), 3)
        _bulk_kernel[grid](ws[0], ws[1], ws[2], ns[0], ns[1], ns[2], CHUNK_E=chunk, ELEM=elem, BLOCK=BULK_BLOCK,
                           num_warps=1)  # fmt: skip
        return
    step = max(1, LINE // ws[0].element_size())
    lines = max(-(-n // step) for n in ns)
    grid = (triton.cdiv(lines, BLOCK), 3)
    _prefetch_kernel[grid](ws[0], ws[1], ws[2], ns[0], ns[1], ns[2], STEP=step, BLOCK=BLOCK, num_warps=4)


@torch.library.custom_op("dflash::l2_prefetch", mutates_args=("sink",))
def _prefetch_op(sink: torch.Tensor, after: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 na: int, nb: int, nc: int) -> None:  # fmt: skip
    cur = torch.cuda.current_stream(after.device)
    side = _side(after.device)
    side.wait_stream(cur)  # after everything queued so far (the qkv projection)
    with torch.cuda.stream(side):
        _launch([(a, na), (b, nb), (c, nc)])


@_prefetch_op.register_fake
def _(sink, after, a, b, c, na, nb, nc):
    return None


@torch.library.custom_op("dflash::l2_join", mutates_args=("sink",))
def _join_op(sink: torch.Tensor, after: torch.Tensor) -> None:
    cur, side = torch.cuda.current_stream(sink.device), _side(sink.device)
    side.wait_stream(cur)  # fork first: a join with no prefetch forked meanwhile is still legal
    cur.wait_stream(side)  # under CUDA graph capture (no event from outside the capture)


@_join_op.register_fake
def _(sink, after):
    return None


def prefetch(sink: torch.Tensor, after: torch.Tensor, weights, budget: int) -> None:
    """Queue an L2 prefetch of ``weights`` (in order, up to ``budget`` bytes) on the side
    stream, after the work queued so far on the current stream (``after``: a tensor that work
    produced, so a compiler keeps the order). ``sink``: a small tensor of the caller's, the
    token that orders prefetches before :func:`join`. Nothing when the budget or plan is empty
    or the weights are not all of one dtype on CUDA."""
    parts = plan(weights, budget)
    if not parts or len({w.dtype for w, _ in parts}) != 1 or after.device.type != "cuda":
        return
    ws = [w for w, _ in parts] + [parts[0][0]] * (3 - len(parts))
    ns = [n for _, n in parts] + [0] * (3 - len(parts))
    _prefetch_op(sink, after, ws[0], ws[1], ws[2], ns[0], ns[1], ns[2])


def join(sink: torch.Tensor, after: torch.Tensor) -> None:
    """Make the current stream wait for the side stream's prefetches; a CUDA graph capture must
    end joined. ``after``: a tensor of the forward's last layer (its output), so a compiler
    keeps the join at the end: with ``sink`` alone Inductor ran it right after the last
    prefetch, and the last layer's main stream waited for its own prefetch."""
    if sink.device.type == "cuda":
        _join_op(sink, after)
