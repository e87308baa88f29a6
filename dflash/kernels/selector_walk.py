"""The DFlash2 candidate selector's walk in one Triton kernel (measured, not on by default).

:func:`dflash.models.draft2_torch.select_walk` runs the walk as a few small torch ops per draft
position (gather the previous pick's edge row, add, argmax; at T > 0 softmax and an inverse-CDF
draw), each position waiting for the one before: about 3 kernels a position eagerly, one or two
fused by Inductor. This kernel walks the whole block in one program per row, the k candidates
of a position in registers. ``scripts/gpu_check_dflash2.py`` times it next to the torch walk and
checks that it picks the same slots; the static path keeps the torch walk until that is seen on
a GPU.

Maths as :func:`~dflash.models.draft2_torch.select_walk`: greedy takes the first maximal slot;
sampling computes q = softmax(score / T) (float32, another summation order than torch's, so q
can differ in the last bits) and picks the number of slots whose cumulative mass is <= u * total,
capped at k - 1. Off CUDA (or without Triton, unless ``TRITON_INTERPRET=1``) the torch walk runs.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    """Whether the Triton kernel can run (Triton importable)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _walk_kernel(U, FIRST, TRANS, UNI, s_ub, TEMP, PICKS, Q, T: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                     SAMPLE: tl.constexpr):  # fmt: skip
        b = tl.program_id(0)
        j = tl.arange(0, KP)
        m = j < K
        score = tl.load(U + b * T * K + j, mask=m, other=float("-inf")) + tl.load(FIRST + b * K + j, mask=m,
                                                                                 other=0.0)  # fmt: skip
        prev = 0
        for i in range(T):
            if i > 0:
                edge = tl.load(
                    TRANS + ((b * (T - 1) + i - 1) * K + prev) * K + j, mask=m, other=0.0
                )
                score = tl.load(U + (b * T + i) * K + j, mask=m, other=float("-inf")) + edge
            if SAMPLE:
                x = score / tl.load(TEMP)
                x = tl.where(m, tl.exp(x - tl.max(x, 0)), 0.0)
                q = x / tl.sum(x, 0)
                cdf = tl.cumsum(q, 0)
                below = tl.sum(
                    tl.where(m & (cdf <= tl.load(UNI + b * s_ub + i) * tl.sum(q, 0)), 1, 0), 0
                )
                pick = tl.minimum(below, K - 1)
                tl.store(Q + (b * T + i) * K + j, q, mask=m)
            else:
                pick = tl.argmax(score, 0)
            tl.store(PICKS + b * T + i, pick.to(tl.int64))
            prev = pick


def walk_kernel(unary: torch.Tensor, first: torch.Tensor, trans: torch.Tensor,
                uniforms: torch.Tensor | None = None, temperature: torch.Tensor | None = None):  # fmt: skip
    """:func:`~dflash.models.draft2_torch.select_walk` in one kernel launch.

    Args:
        unary: [B, T, k] float32; first: [B, k] float32; trans: [B, T-1, k, k] float32.
        uniforms: [B, >= T] float32 uniforms (unit last stride); None = greedy.
        temperature: [1] float32 tensor (> 0), with ``uniforms``.

    Returns:
        (picks [B, T] int64, q [B, T, k] float32 or None when greedy).
    """
    from dflash.models.draft2_torch import select_walk

    on_cpu = unary.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    if triton is None or on_cpu:
        return select_walk(
            unary, first, trans, uniforms, 1.0 if temperature is None else temperature
        )
    b, t, k = unary.shape
    unary, first, trans = (
        unary.float().contiguous(),
        first.float().contiguous(),
        trans.float().contiguous(),
    )
    picks = torch.empty(b, t, dtype=torch.int64, device=unary.device)
    sample = uniforms is not None
    q = torch.empty(b, t, k, dtype=torch.float32, device=unary.device) if sample else picks
    uni = uniforms if sample else unary
    temp = temperature if sample else unary
    _walk_kernel[(b,)](unary, first, trans, uni, uni.stride(0) if sample else 0, temp, picks, q, T=t, K=k,
                       KP=triton.next_power_of_2(k), SAMPLE=sample)  # fmt: skip
    return picks, (q if sample else None)
