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
MAX_HEAD_ROWS = 1024  # rows of the other modes (per-head q/k norms: T * H rows)
LLAMA, ROUND_ONCE, ONE_PLUS = 0, 1, 2  # modes: (w * y.to(dt)), (w * y).to(dt), ((1 + w) * y).to(dt)
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
    def _rms_norm_kernel(X, W, Y, s_xm, s_ym, eps, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                         MODE: tl.constexpr = 0):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        w = tl.load(W + cols, mask=ok, other=0.0).to(
            tl.float32
        )  # written by no kernel: before the wait
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(X + row * s_xm + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, 0) / N + eps)
        dt = Y.dtype.element_ty
        if MODE == 0:  # Llama, Qwen: rounded, times the weight, rounded again
            y = (w * (x * r).to(dt).to(tl.float32)).to(dt)
        elif MODE == 1:  # gpt-oss, Gemma 4: times the weight in float32, rounded once
            y = (w * (x * r)).to(dt)
        else:  # Gemma 3 (and 2): times (1 + weight) in float32, rounded once
            y = ((1.0 + w) * (x * r)).to(dt)
        tl.store(Y + row * s_ym + cols, y, mask=ok)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool, mode: int = 0
) -> torch.Tensor:
    m, n = x.shape
    if (
        m > (MAX_ROWS if mode == LLAMA else MAX_HEAD_ROWS)
        or weight.shape != (n,)
        or weight.stride(0) != 1
        or x.stride(1) != 1
        or n > MAX_HIDDEN
    ):
        raise ValueError(f"rms_norm: rows {tuple(x.shape)} (strides {x.stride()}) do not fit weight "
                         f"{tuple(weight.shape)} (at most {MAX_ROWS} rows of {MAX_HIDDEN})")  # fmt: skip
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(m,)](x, weight, y, x.stride(0), y.stride(0), eps, N=n, BLOCK=block, PDL=pdl, MODE=mode,
                           num_warps=8 if block >= 4096 else 4, **({"launch_pdl": True} if pdl else {}))  # fmt: skip
    return y


@torch.library.custom_op("dflash::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool, mode: int = 0
) -> torch.Tensor:
    return _launch(x, weight, eps, pdl, mode)


@_rms_norm_op.register_fake
def _(x, weight, eps, pdl, mode=0):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int = 0
) -> torch.Tensor:
    """The transformers modules' maths in torch ops: [M, N] -> [M, N] in x's dtype (``mode``
    as :func:`rms_norm`'s)."""
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if mode == ROUND_ONCE:
        return (weight.float() * h).to(x.dtype)
    if mode == ONE_PLUS:
        return ((1.0 + weight.float()) * h).to(x.dtype)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool | None = None,
             mode: int = LLAMA) -> torch.Tensor:  # fmt: skip
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` per row, one program per row.

    Args:
        x: [M, N] rows (unit last stride), M <= :data:`MAX_ROWS` (other modes:
            :data:`MAX_HEAD_ROWS`), N <= :data:`MAX_HIDDEN`.
        weight: [N] the norm's weight (unit stride), x's dtype (other modes: any float dtype).
        eps: the norm's epsilon.
        pdl: launch with programmatic dependent launch; None = where the device supports it.
        mode: ``LLAMA`` (above); ``ROUND_ONCE``: ``(weight * x * rsqrt(...)).to(dtype)`` in float32
            (gpt-oss's and Gemma 4's norms); ``ONE_PLUS``: ``((1 + weight) * x * rsqrt(...)).to(dtype)``
            (Gemma 3's).
    Returns:
        [M, N] in x's dtype (contiguous). Off CUDA (or Triton absent and not interpreting)
        :func:`rms_norm_reference` runs instead.

    Raises:
        ValueError: shapes that do not fit.
    """
    if triton is None or (x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return rms_norm_reference(x, weight, eps, mode)
    return _rms_norm_op(
        x, weight, float(eps), pdl_supported(x.device) if pdl is None else pdl, mode
    )
