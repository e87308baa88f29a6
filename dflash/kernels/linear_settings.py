"""Host-side settings of the few-row projection kernel (:mod:`dflash.kernels.small_linear`,
which re-exports every name here): ``DFLASH_LINEAR`` (:func:`linear_mode`), ``DFLASH_GLU``
(:func:`glu_setting`), ``DFLASH_FUSE_NORM`` (:func:`fuse_norm_setting`,
:func:`fuse_norm_auto`), ``DFLASH_PDL_PREFETCH`` (:func:`preload_bytes`,
:func:`preload_columns`) and the tiles, ``DFLASH_LINEAR_CONFIG`` included
(:func:`kernel_config`).
"""

from __future__ import annotations

import os

import torch

LINEAR_ENV = "DFLASH_LINEAR"
CONFIG_ENV = "DFLASH_LINEAR_CONFIG"  # "BN,BK,warps,stages" for every shape (benchmark sweeps)
PRELOAD_ENV = "DFLASH_PDL_PREFETCH"  # MiB of a projection's weight sent to L2 before its PDL wait
SMEM_BUDGET = 200 * 1024  # bytes of shared memory the pipelined tiles may take

try:
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None


GLU_ENV = "DFLASH_GLU"
FUSE_NORM_ENV = "DFLASH_FUSE_NORM"
FUSE_NORM_AUTO_MAX_K = 1024  # DFLASH_FUSE_NORM unset: on for hidden sizes up to this (bf16/fp16)


def fuse_norm_setting() -> bool | None:
    """``DFLASH_FUSE_NORM``: whether each RMSNorm in front of a ``small_linear`` in-projection
    (the target's input and post-attention norms before qkv and gate+up, the draft's
    post-attention norm) runs inside that projection's kernel (:func:`small_linear_rn`: the
    norm's weight folded into a copy of the projection's weight, its row factor applied to the
    accumulator): one kernel less per norm, and the same per-row maths at every width, so that
    block-1 decoding and verify agree bit for bit in bf16. ``1`` on, ``0`` off, unset: None,
    the default of :func:`fuse_norm_auto`.

    H200, eighteenth session (``benchmarks/results/h200-v18``): the demo's verify-1 graph 0.646
    -> 0.592 ms, block-16 loop step 0.831 -> 0.795 ms, draft graph 0.147 -> 0.144 ms; real demo
    pair (gsm8k 64, one machine, side by side) DFlash 4,948.8 -> 5,164.8 tok/s, baseline 1,550.0
    -> 1,679.4, greedy parity 53 + 11 near-ties -> 64/64 identical. Qwen3-8B's block-1 step
    4.230 -> 4.709 ms: the x x^T products cost more than the saved kernels over a K of 4,096
    (16-32 tiles a program). The seventeenth session's first form (partial sums of squares
    written by the previous kernel, the norm applied to each input tile) made the demo's
    verify-1 graph 0.645 -> 0.691 ms and Qwen3-8B's block 1 4.233 -> 4.329 ms; replaced.

    Raises:
        InputError: another value.
    """
    raw = os.environ.get(FUSE_NORM_ENV, "").strip()
    if raw not in ("", "0", "1"):
        from dflash.errors import InputError

        raise InputError(f"{FUSE_NORM_ENV} must be 0 or 1, got {raw!r}.",
                         hint="unset it for the default (on for hidden sizes <= 1024 in bf16/fp16)")  # fmt: skip
    return None if raw == "" else raw == "1"


def fuse_norm_auto(hidden: int, dtype: torch.dtype) -> bool:
    """:func:`fuse_norm_setting`'s default for a model of this hidden size (the projections' K)
    and dtype: on up to :data:`FUSE_NORM_AUTO_MAX_K` in bf16/fp16 (measured faster at 576,
    slower at 4,096; sizes in between unmeasured), off in float32 (the reference dtype keeps
    the modules' roundings). The static backend also asks that the in-projections run this
    kernel at every width (``linear_in`` = :data:`MAX_ROWS`, as measured; ``DFLASH_LINEAR=auto``
    and ``all`` do)."""
    return hidden <= FUSE_NORM_AUTO_MAX_K and dtype in (torch.bfloat16, torch.float16)


def glu_setting() -> bool:
    """``DFLASH_GLU``: unset or ``1`` (default) runs SiLU(gate) * up as the epilogue of the
    gate+up projection where that projection runs this kernel (:func:`small_linear_glu`: one
    kernel and one [M, 2N] intermediate less per layer); ``0`` keeps the activation as its own
    (Inductor) kernel.

    Raises:
        InputError: another value.
    """
    raw = os.environ.get(GLU_ENV, "").strip()
    if raw not in ("", "0", "1"):
        from dflash.errors import InputError

        raise InputError(f"{GLU_ENV} must be 0 or 1, got {raw!r}.", hint="unset it for the default (1)")
    return raw != "0"


def linear_mode(device: torch.device) -> str:
    """``DFLASH_LINEAR``: which projections of forwards of <= MAX_ROWS rows run this kernel.

    - ``auto`` (default) or ``all``: every one, o_proj and down_proj (with their residual adds)
      and the fused qkv and gate+up projections, at every width up to :data:`MAX_ROWS` rows;
    - ``triton``: o_proj and down_proj only (the default before the sixteenth session);
    - ``torch``: cuBLAS for all.

    Without CUDA or Triton it is always ``torch``. H200 (2026-12-02), real demo pair (qkv 1.1 MB,
    gate+up 3.5 MB), gsm8k 64, one machine: ``all`` 4,615.0 / 1,426.4 tok/s (DFlash / block-1
    baseline) against 4,366.2 / 1,316.6 with ``triton``. Qwen3-8B's shape (50 and 201 MB
    weights; ``scripts/bench_big.py``, twentieth session, one machine, two runs): a 16-row step
    5.370 / 5.382 ms against 5.539 ms when, as ``auto`` did from the seventeenth to the
    nineteenth session, in-projections over 8 MiB ran this kernel in 1-row steps only (cuBLAS in
    wider forwards); the block-1 step runs the same kernels either way (4.238 / 4.243 against
    4.245 ms).

    Raises:
        InputError: another value.
    """
    from dflash.errors import env_choice

    raw = env_choice(LINEAR_ENV, ("auto", "torch", "triton", "all"))
    return raw if device.type == "cuda" and triton is not None else "torch"


def preload_bytes() -> int:
    """``DFLASH_PDL_PREFETCH``: MiB of each ``small_linear`` call's weight (every program its own
    rows, from the second K tile on, up to this total) that the kernel sends to L2 with PTX
    ``prefetch.global.L2`` before it waits for the previous kernel under PDL. The weights do not
    depend on that kernel, so the bytes stream in while it (attention, an activation) still runs.
    Default 0 (off); nothing without PDL. Measured on the H200: every projection (fourteenth
    session) made Qwen3-8B's block 1 1.225x -> 1.238x / 1.250x / 1.279x the HBM floor at 16 / 32 /
    64 MiB; o_proj alone, the projection after the attention, which leaves HBM idle for ~8 us a
    layer there (twenty-fifth session, ``benchmarks/results/h200-v25/2-early-prefetch``, one
    machine): 4.122 / 4.138 / 4.145 ms at 8 / 16 / 32 MiB against 4.121 / 4.122 ms without, so
    that form was removed.

    Raises:
        InputError: not a whole number >= 0.
    """
    raw = os.environ.get(PRELOAD_ENV, "").strip()
    if raw and not (raw.isascii() and raw.isdigit()):
        from dflash.errors import InputError

        raise InputError(f"{PRELOAD_ENV} must be a whole number of MiB (0 = off), got {raw!r}.",
                         hint="unset it for the default (0)")  # fmt: skip
    return int(raw or 0) << 20


def preload_columns(n: int, k: int, bk: int, elem: int, budget: int) -> int:
    """The K column up to which each of the ``n`` weight rows is prefetched (a multiple of a
    128-byte line past the first ``bk`` tile, at most ``k``): ``budget`` bytes spread over the
    rows. 0 when the budget is 0 or covers no line past the first tile."""
    line = 128 // elem
    cols = (budget // (n * elem)) // line * line
    return min(k, bk + cols) if budget and cols else 0


# (weight rows, K) -> (BN, BK, warps, stages) up to 16 rows: Qwen3-8B's projections, from a sweep
# with the weights cycled past the L2 cache as a decode step reads them
# (``scripts/small_linear_sweep.py --cold``, H200, twenty-fourth session, ``benchmarks/results/
# h200-v24``); the earlier sweeps reused one weight, which stays in the 60 MB L2 for o_proj and
# qkv. One call, cold, 1 row, us (rule -> this): o_proj 11.26 -> 10.62, down 25.90 -> 25.86,
# qkv 15.13 -> 14.42, gate+up 48.11 -> 47.83. One config for 1 and 16 rows, so that block-1
# decoding and a verify sum in one order (gate+up's best at 1 row, 64,256,4,2, was within the
# sweeps' spread of this one). Whole steps of the Qwen3-8B-shaped pair: see ``h200-v24``.
TUNED = {
    (4096, 4096): (32, 256, 4, 6),  # o_proj
    (4096, 12288): (32, 256, 4, 6),  # down_proj
    (6144, 4096): (32, 256, 2, 4),  # fused qkv (32 + 2 x 8 heads of 128)
    (24576, 4096): (64, 128, 2, 4),  # fused gate+up (its SwiGLU epilogue)
}


def kernel_config(m: int, n: int, k: int, elem: int = 2) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for an [m, k] x [n, k]^T product (n output columns)
    of ``elem``-byte elements.

    From sweeps on the H200 (``scripts/small_linear_sweep.py``): 16 columns per program up to
    1,024 columns, 32 up to 8,192, 64 beyond; K tiles of 128 up to K = 1,024, 512 beyond 4,096,
    and in between as many as keep a tile at 8,192 weights (2026-12-02, one row: Qwen3-8B's
    o_proj 7.49 against 7.83 us with 512, its fused qkv 12.92 against 17.73 us and gate+up 46.97
    against 56.80 us, cuBLAS 14.57 and 47.45 us; the demo's shapes keep their configs). Shapes
    in :data:`TUNED` (Qwen3-8B's, timed with cold weights) take their own up to 16 rows in
    2-byte dtypes (their deeper pipelines would not fit shared memory in float32).
    ``DFLASH_LINEAR_CONFIG="BN,BK,warps,stages"`` overrides all but BM for every shape;
    ``"NxK=BN,BK,warps,stages;..."`` (``NxK@M=...`` for m rows only) for the shapes named
    (n = weight rows), the built-in choice for the others.

    Raises:
        InputError: a malformed ``DFLASH_LINEAR_CONFIG``.
    """
    bm = 16 if m <= 16 else 32
    raw = os.environ.get(CONFIG_ENV, "").strip()
    if raw:
        picked = _config_override(raw, m, n, k)
        if picked is not None:
            return (bm, *picked)
    tuned = TUNED.get((n, k))
    if tuned is not None and m <= 16 and elem == 2:
        return (bm, *tuned)
    bn = 16 if n <= 1024 else (32 if n <= 8192 else 64)  # best in the H200 sweeps (2026-12-01/02)
    bk = 128 if k <= 1024 else (512 if k > 4096 else max(128, min(512, 8192 // bn)))
    # pipelined stages of the x and weight tiles must fit shared memory (~227 KiB on Hopper):
    # 32 rows x 512 of K would take 256 KiB at 4 stages
    stages = max(2, min(4, SMEM_BUDGET // ((bm + bn) * bk * 2)))
    return bm, bn, bk, 4, stages


def _config_override(raw: str, m: int, n: int, k: int) -> tuple[int, int, int, int] | None:
    """(BN, BK, warps, stages) that ``DFLASH_LINEAR_CONFIG`` gives an [m, k] x [n, k]^T
    product, None where it names other shapes (see :func:`kernel_config`).

    Raises:
        InputError: a malformed value.
    """
    from dflash.errors import InputError

    def numbers(text: str) -> tuple[int, int, int, int]:
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 4 or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
            raise InputError(f"{CONFIG_ENV} must be BN,BK,warps,stages or NxK=BN,BK,warps,stages;..., got {raw!r}.",
                             hint="e.g. 32,256,4,3 or 4096x4096=16,512,4,4; unset it for the built-in choice")  # fmt: skip
        return tuple(int(p) for p in parts)  # type: ignore[return-value]

    if "=" not in raw:
        return numbers(raw)
    for entry in filter(None, (e.strip() for e in raw.split(";"))):
        shape, _, cfg = entry.partition("=")
        shape, _, rows = shape.strip().partition("@")
        dims = shape.lower().split("x")
        if len(dims) != 2 or not all(d.strip().isdigit() for d in dims) or (rows and not rows.strip().isdigit()):
            numbers("")  # raises with the format
        if (int(dims[0]), int(dims[1])) == (n, k) and (not rows or int(rows) == m):
            return numbers(cfg)
        numbers(cfg)  # every entry well formed, even those not used
    return None
