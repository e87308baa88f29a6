"""RMSNorm of a few rows in one Triton kernel (static path, the target's norms that run alone).

Where a target's norms do not run inside its projections (the ``fuse_norm`` setting: hidden
sizes over 1,024, such as Qwen3-8B's 4,096), each layer has two norm kernels of its own, and on
the H200 Inductor's took 1.8-2.0 us each in a Qwen3-8B block-1 step (a profile with PDL off): a looped reduction that reads the row twice, its weight after the wait for the kernel
before it. This kernel takes one row per program, the whole row in registers (one read), and
under PDL loads the norm's weight before waiting for the previous kernel (weights are written by
no kernel).

Maths as the transformers modules (``LlamaRMSNorm``, ``Qwen3RMSNorm`` ...): the row in float32,
``x * rsqrt(mean(x^2) + eps)`` rounded to the activations' dtype, times the weight, rounded
again (a bf16 product is exact in float32, so this is torch's rounding). The sum of squares is
summed in another order than torch's or Inductor's, so a row can differ from them by a unit in
the last place; each row is computed alone, so a block-1 step and a 16-row verify agree bit for
bit. Off CUDA (or without Triton, unless ``TRITON_INTERPRET=1``) :func:`rms_norm_reference` runs.
"""

from __future__ import annotations

import os

import torch

from dflash.kernels.pdl import pdl_supported

MAX_ROWS = 32  # rows the kernel takes (decode and verify); prefill runs the module
MAX_HIDDEN = 16384  # one row in registers

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    """Whether the Triton kernel can run (Triton importable)."""
    return triton is not None


# transformers' RMSNorm classes known to compute weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
# (others round once, or scale by 1 + weight: Gemma, Qwen3-Next, OLMo 2 ...)
KNOWN_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})


def rms_norm_fits(norm, dtype: torch.dtype) -> bool:
    """Whether ``norm`` is an RMSNorm the kernel computes exactly: one of :data:`KNOWN_NORMS`
    with a 1-d weight of ``dtype`` (bf16 or fp16) of at most :data:`MAX_HIDDEN` and an epsilon
    (``eps`` or ``variance_epsilon``)."""
    w = getattr(norm, "weight", None)
    return (type(norm).__name__ in KNOWN_NORMS and isinstance(w, torch.Tensor) and w.dim() == 1
            and w.dtype == dtype and dtype in (torch.bfloat16, torch.float16) and w.numel() <= MAX_HIDDEN
            and (hasattr(norm, "eps") or hasattr(norm, "variance_epsilon")))  # fmt: skip


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, W, Y, s_xm, s_ym, eps, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)  # written by no kernel: before the wait
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(X + row * s_xm + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, 0) / N + eps)
        dt = Y.dtype.element_ty
        y = (w * (x * r).to(dt).to(tl.float32)).to(dt)
        tl.store(Y + row * s_ym + cols, y, mask=ok)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool) -> torch.Tensor:
    m, n = x.shape
    if m > MAX_ROWS or weight.shape != (n,) or weight.stride(0) != 1 or x.stride(1) != 1 or n > MAX_HIDDEN:
        raise ValueError(f"rms_norm: rows {tuple(x.shape)} (strides {x.stride()}) do not fit weight "
                         f"{tuple(weight.shape)} (at most {MAX_ROWS} rows of {MAX_HIDDEN})")  # fmt: skip
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(m,)](x, weight, y, x.stride(0), y.stride(0), eps, N=n, BLOCK=block, PDL=pdl,
                           num_warps=8 if block >= 4096 else 4, **({"launch_pdl": True} if pdl else {}))  # fmt: skip
    return y


@torch.library.custom_op("dflash::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool) -> torch.Tensor:
    return _launch(x, weight, eps, pdl)


@_rms_norm_op.register_fake
def _(x, weight, eps, pdl):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The transformers modules' maths in torch ops: [M, N] -> [M, N] in x's dtype."""
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool | None = None) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` per row, one program per row.

    Args:
        x: [M, N] rows (unit last stride), M <= :data:`MAX_ROWS`, N <= :data:`MAX_HIDDEN`.
        weight: [N] the norm's weight (unit stride), x's dtype.
        eps: the norm's epsilon.
        pdl: launch with programmatic dependent launch; None = where the device supports it.
    Returns:
        [M, N] in x's dtype (contiguous). Off CUDA (or Triton absent and not interpreting)
        :func:`rms_norm_reference` runs instead.

    Raises:
        ValueError: shapes that do not fit.
    """
    if triton is None or (x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return rms_norm_reference(x, weight, eps)
    return _rms_norm_op(x, weight, float(eps), pdl_supported(x.device) if pdl is None else pdl)
