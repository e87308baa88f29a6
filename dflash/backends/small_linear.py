"""Linear layers over a few rows (decode and verify, M <= 32) with their neighbours fused in.

A block-1 step of the demo target on the H200 ran about 13 kernels per layer, and a cuBLAS GEMV
over a 1 MB weight took ~3.8 us while the weight itself streams in ~0.3 us: at these sizes every
step is a chain of kernel latencies. This Triton kernel computes

    y = residual + (prologue(x) @ W^T + bias)

in one launch, where the prologue is either nothing, the RMSNorm that precedes the projection
(LlamaRMSNorm/Qwen3RMSNorm maths: float32 variance, ``weight * (x * rstd).to(dtype)``), or the
SwiGLU gate ``silu(g) * u`` of a fused gate+up output. A decoder layer's four projections then
absorb its two RMSNorms, the SwiGLU product and both residual adds, and the final norm goes into
the LM head. Each program owns ``BN`` output columns and streams their weight rows along K (row
major, coalesced); the few input rows are padded to a 16-row tensor-core tile.

Rounding follows the unfused torch ops step by step (each intermediate rounded to the input
dtype where torch rounds it), so results equal the reference up to the summation order of the
dot products; float32 inputs use exact fp32 dots (no TF32).

``DFLASH_LINEAR=torch`` turns it off (cuBLAS plus Inductor's fused elementwise kernels);
``auto`` (default) uses it for forwards of at most :data:`MAX_ROWS` rows on CUDA with Triton.
:func:`small_linear_reference` is the same maths in torch (CPU, tests); ``TRITON_INTERPRET=1``
runs the kernel on CPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

LINEAR_ENV = "DFLASH_LINEAR"
CONFIG_ENV = "DFLASH_LINEAR_CONFIG"  # "BN,BK,warps,stages" for every shape (benchmark sweeps)
MAX_ROWS = 32  # rows (M) the kernel takes; longer forwards (prefill) use torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def linear_mode(device: torch.device) -> str:
    """``DFLASH_LINEAR``: ``auto`` (default; the kernel for forwards of <= MAX_ROWS rows) or
    ``torch`` (never). Without CUDA or Triton it is always ``torch``.

    Raises:
        InputError: another value.
    """
    from dflash.errors import InputError

    raw = os.environ.get(LINEAR_ENV, "").strip().lower() or "auto"
    if raw not in ("auto", "torch"):
        raise InputError(f"{LINEAR_ENV} must be auto or torch, got {raw!r}.",
                         hint="unset it for the default (auto)")  # fmt: skip
    return raw if device.type == "cuda" and triton is not None else "torch"


def _pow2_floor(n: int) -> int:
    return 1 << max(n.bit_length() - 1, 0)


def kernel_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for an [m, k] x [n, k]^T product.

    BN aims at about two programs per H200 SM on wide layers (16..64 columns each), BK at few
    K iterations for small K; ``DFLASH_LINEAR_CONFIG="BN,BK,warps,stages"`` overrides all but BM.

    Raises:
        InputError: a malformed ``DFLASH_LINEAR_CONFIG``.
    """
    bm = 16 if m <= 16 else 32
    raw = os.environ.get(CONFIG_ENV, "").strip()
    if raw:
        from dflash.errors import InputError

        parts = raw.split(",")
        if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
            raise InputError(f"{CONFIG_ENV} must be BN,BK,warps,stages, got {raw!r}.",
                             hint="e.g. 32,256,4,3; unset it for the built-in choice")  # fmt: skip
        bn, bk, warps, stages = (int(p) for p in parts)
        return bm, bn, bk, warps, stages
    bn = min(64, max(16, _pow2_floor(n // 256)))
    bk = 256 if k >= 256 else max(16, triton.next_power_of_2(k) if triton is not None else 64)
    return bm, bn, bk, 4, 3


if triton is not None:

    @triton.jit
    def _small_linear_kernel(X, W, B, NW, RES, Y, M, N, K, eps, s_xm, s_wn, s_rm, s_ym,
                             HAS_NORM: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                             HAS_RES: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        m_ok = rm < M
        n_ok = rn < N
        dtype = Y.dtype.element_ty
        if HAS_NORM:  # pass 1: each row's mean square (the rows are tiny; L2-resident)
            ss = tl.zeros([BM], tl.float32)
            for k0 in range(0, K, BK):
                rk = k0 + tl.arange(0, BK)
                xs = tl.load(X + rm[:, None] * s_xm + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :],
                             other=0.0).to(tl.float32)  # fmt: skip
                ss += tl.sum(xs * xs, 1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            xm = m_ok[:, None] & k_ok[None, :]
            if GLU:  # X is [M, 2K]: gate then up; torch rounds silu(g) and the product
                g = tl.load(X + rm[:, None] * s_xm + rk[None, :], mask=xm, other=0.0).to(tl.float32)
                u = tl.load(X + rm[:, None] * s_xm + K + rk[None, :], mask=xm, other=0.0).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
                x = (a * u).to(dtype)
            else:
                x = tl.load(X + rm[:, None] * s_xm + rk[None, :], mask=xm, other=0.0)
            if HAS_NORM:
                nw = tl.load(NW + rk, mask=k_ok, other=0.0).to(tl.float32)
                xn = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
                x = (nw[None, :] * xn).to(dtype)
            w = tl.load(W + rn[:, None] * s_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dtype)
        ym = m_ok[:, None] & n_ok[None, :]
        if HAS_RES:  # torch: residual + linear(...) adds two rounded tensors
            r = tl.load(RES + rm[:, None] * s_rm + rn[None, :], mask=ym, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(Y + rm[:, None] * s_ym + rn[None, :], y, mask=ym)


def _launch(x, weight, bias, norm_weight, residual, eps: float, glu: bool) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = kernel_config(m, n, k)
    dummy = y  # never read when its flag is off
    _small_linear_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else dummy, norm_weight if norm_weight is not None else dummy,
        residual if residual is not None else dummy, y, m, n, k, eps,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        HAS_NORM=norm_weight is not None, GLU=glu, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, IEEE=x.dtype == torch.float32, BM=bm, BN=bn, BK=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


@torch.library.custom_op("dflash::small_linear", mutates_args=())
def _small_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     norm_weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float,
                     glu: bool) -> torch.Tensor:  # fmt: skip
    return _launch(x, weight, bias, norm_weight, residual, eps, glu)


@_small_linear_op.register_fake
def _(x, weight, bias, norm_weight, residual, eps, glu):
    return x.new_empty(x.shape[0], weight.shape[0])


def small_linear_reference(x, weight, bias=None, norm_weight=None, residual=None, eps: float = 1e-6,
                           glu: bool = False) -> torch.Tensor:  # fmt: skip
    """The kernel's maths with torch ops (the unfused modules' rounding); args as
    :func:`small_linear`."""
    if glu:
        g, u = x.chunk(2, dim=-1)
        x = F.silu(g) * u
    if norm_weight is not None:
        xf = x.float()
        x = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 eps: float = 1e-6, glu: bool = False) -> torch.Tensor:  # fmt: skip
    """``residual + linear(prologue(x), weight, bias)`` in one kernel.

    Args:
        x: [M, K] (or [M, 2K] with ``glu``), unit last stride; M <= :data:`MAX_ROWS`.
        weight: [N, K] contiguous (an ``nn.Linear`` weight); bias: [N] or None.
        norm_weight: [K] RMSNorm weight applied to x first (epsilon ``eps``), or None.
        residual: [M, N] added to the result, or None.
        glu: x holds (gate, up) halves; the input is ``silu(gate) * up``.
    Returns:
        [M, N] in x's dtype. Off CUDA (or Triton absent and not interpreting) the torch
        reference runs instead.
    """
    if triton is None or (x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return small_linear_reference(x, weight, bias, norm_weight, residual, eps, glu)
    return _small_linear_op(x, weight, bias, norm_weight, residual, float(eps), glu)
