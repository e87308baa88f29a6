"""A residual add after an RMSNorm, and the next RMSNorm, in one kernel (Gemma's sandwich norms).

Gemma 3 and 4 norm each sublayer's output before adding it to the residual stream
(``x = x + post_norm(out)``), and Gemma 4 then scales the stream by the layer's scalar; the
feed-forward's input is ``pre_norm(x)``. As stand-alone kernels that is a norm, an add, (a
multiply,) and the next norm per sublayer; this kernel does them in one launch, one row per
program: ``x' = (x + norm1(a)) [* s]`` and ``h = norm2(x')``.

Maths as the modules and torch's ops in the activations' dtype: each norm as
:func:`~dflash.kernels.rms_norm.rms_norm` in its ``mode`` (rounded as the module rounds), the add
of two rounded tensors rounded, the product with the scalar rounded; the sums of squares in
another order than torch's (a row can differ by a unit in the last place). Off CUDA (or without
Triton, unless ``TRITON_INTERPRET=1``) :func:`add_norm_reference` runs the same steps in torch.
"""

from __future__ import annotations

import os

import torch

from dflash.kernels.pdl import pdl_supported
from dflash.kernels.rms_norm import MAX_HIDDEN, MAX_ROWS, ONE_PLUS, ROUND_ONCE, rms_norm_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:

    @triton.jit
    def _normed(x, r, w, DT: tl.constexpr, MODE: tl.constexpr):
        """One row x [BLOCK] (float32) normed by its factor r, in ``MODE``, rounded to DT, back in
        float32 (modes as rms_norm's: 0 Llama, 1 round once, 2 (1 + w))."""
        if MODE == 0:
            y = (w * (x * r).to(DT).to(tl.float32)).to(DT)
        elif MODE == 1:
            y = (w * (x * r)).to(DT)
        else:
            y = ((1.0 + w) * (x * r)).to(DT)
        return y.to(tl.float32)

    @triton.jit
    def _add_norm_kernel(A, R, W1, W2, S, X, H, s_a, s_r, s_x, s_h, eps1, eps2, N: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr, MODE: tl.constexpr, HAS_SCALE: tl.constexpr,
                         HAS_W2: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        w1 = tl.load(W1 + cols, mask=ok, other=0.0).to(tl.float32)  # weights: before the PDL wait
        w2 = w1
        if HAS_W2:
            w2 = tl.load(W2 + cols, mask=ok, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        dt = X.dtype.element_ty
        a = tl.load(A + row * s_a + cols, mask=ok, other=0.0).to(tl.float32)
        y = _normed(a, tl.math.rsqrt(tl.sum(a * a, 0) / N + eps1), w1, dt, MODE)
        x = (
            (tl.load(R + row * s_r + cols, mask=ok, other=0.0).to(tl.float32) + y)
            .to(dt)
            .to(tl.float32)
        )
        if HAS_SCALE:
            x = (x * tl.load(S).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(X + row * s_x + cols, x.to(dt), mask=ok)
        if HAS_W2:
            h = _normed(x, tl.math.rsqrt(tl.sum(x * x, 0) / N + eps2), w2, dt, MODE)
            tl.store(H + row * s_h + cols, h.to(dt), mask=ok)


def add_norm_reference(
    a, residual, w1, eps1: float, mode: int, scale=None, w2=None, eps2: float = 0.0
):
    """:func:`add_norm` in torch ops: (x', h or None)."""
    x = residual + rms_norm_reference(a, w1, eps1, mode)
    if scale is not None:
        x = x * scale
    return x, (rms_norm_reference(x, w2, eps2, mode) if w2 is not None else None)


def add_norm_fits(hidden: int, dtype: torch.dtype, *weights) -> bool:
    """Whether :func:`add_norm` takes rows of ``hidden`` in ``dtype`` (a float type) with these
    norm weights (1-d, unit stride, ``hidden`` long). The forwards use it where they use the
    norm kernel (bf16/fp16 on CUDA)."""
    return (dtype in (torch.bfloat16, torch.float16, torch.float32) and hidden <= MAX_HIDDEN
            and all(isinstance(w, torch.Tensor) and w.shape == (hidden,) and w.stride(0) == 1 for w in weights))  # fmt: skip


def _launch(a, residual, w1, eps1, mode, scale, w2, eps2, pdl):
    m, n = a.shape
    if (
        m > MAX_ROWS
        or residual.shape != a.shape
        or a.stride(1) != 1
        or residual.stride(1) != 1
        or n > MAX_HIDDEN
    ):
        raise ValueError(f"add_norm: rows {tuple(a.shape)} / {tuple(residual.shape)} do not fit (at most "
                         f"{MAX_ROWS} rows of {MAX_HIDDEN}, unit last strides)")  # fmt: skip
    x = torch.empty_like(residual, memory_format=torch.contiguous_format)
    h = torch.empty_like(x) if w2 is not None else x
    block = triton.next_power_of_2(n)
    _add_norm_kernel[(m,)](a, residual, w1, w2 if w2 is not None else w1, scale if scale is not None else w1,
                           x, h, a.stride(0), residual.stride(0), x.stride(0), h.stride(0), eps1, eps2, N=n,
                           BLOCK=block, PDL=pdl, MODE=mode, HAS_SCALE=scale is not None, HAS_W2=w2 is not None,
                           num_warps=8 if block >= 4096 else 4, **({"launch_pdl": True} if pdl else {}))  # fmt: skip
    return x, h


@torch.library.custom_op("dflash::add_norm", mutates_args=())
def _add_norm_op(a: torch.Tensor, residual: torch.Tensor, w1: torch.Tensor, eps1: float, mode: int,
                 scale: torch.Tensor | None, pdl: bool) -> torch.Tensor:  # fmt: skip
    return _launch(a, residual, w1, eps1, mode, scale, None, 0.0, pdl)[0]


@_add_norm_op.register_fake
def _(a, residual, w1, eps1, mode, scale, pdl):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.custom_op("dflash::add_norm2", mutates_args=())
def _add_norm2_op(a: torch.Tensor, residual: torch.Tensor, w1: torch.Tensor, eps1: float, mode: int,
                  scale: torch.Tensor | None, w2: torch.Tensor, eps2: float,
                  pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _launch(a, residual, w1, eps1, mode, scale, w2, eps2, pdl)


@_add_norm2_op.register_fake
def _(a, residual, w1, eps1, mode, scale, w2, eps2, pdl):
    x = torch.empty_like(residual, memory_format=torch.contiguous_format)
    return x, torch.empty_like(x)


def add_norm(a: torch.Tensor, residual: torch.Tensor, w1: torch.Tensor, eps1: float, mode: int,
             scale: torch.Tensor | None = None, w2: torch.Tensor | None = None, eps2: float = 0.0,
             pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``x' = (residual + norm1(a)) [* scale]`` and ``h = norm2(x')`` per row, one launch.

    Args:
        a: [M, N] the sublayer's output (unit last stride), M <= 32; residual: [M, N].
        w1, eps1: the post-norm's weight [N] and epsilon; mode: both norms' maths
            (:data:`~dflash.kernels.rms_norm.ROUND_ONCE` Gemma 4, :data:`~dflash.kernels.rms_norm.ONE_PLUS`
            Gemma 3, ``LLAMA``).
        scale: a one-element tensor of the activations' dtype (Gemma 4's ``layer_scalar``), or None.
        w2, eps2: the next norm's weight and epsilon, or None (no ``h``).
        pdl: programmatic dependent launch; None = where the device supports it.
    Returns:
        (x' [M, N], h [M, N] or None) in the residual's dtype.
    """
    if triton is None or (a.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return add_norm_reference(a, residual, w1, eps1, mode, scale, w2, eps2)
    pdl = pdl_supported(a.device) if pdl is None else pdl
    if w2 is None:
        return _add_norm_op(a, residual, w1, float(eps1), mode, scale, pdl), None
    return _add_norm2_op(a, residual, w1, float(eps1), mode, scale, w2, float(eps2), pdl)


__all__ = ["ONE_PLUS", "ROUND_ONCE", "add_norm", "add_norm_fits", "add_norm_reference"]
