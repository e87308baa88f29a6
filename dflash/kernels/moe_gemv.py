"""Expert GEMV for a few routed rows: out[p] = W[e_p] x_p (+ b[e_p]), reading each chosen
expert's weights in place (no gather copy, no sort), one launch per projection.

For the static path's MoE blocks at decode widths (T rows x top-K experts = P pairs, up to
:data:`MAX_PAIRS`): ``grouped_mm`` needs the pairs sorted by expert (argsort, counts, offsets,
a gather and a scatter back: about ten small kernels per layer) and the ``gather`` route copies
the chosen experts' weights before a batched matmul (three times the weight traffic). This
kernel takes the pairs as they come: program (p, n-block) loads expert e_p's rows
[n-block, :] (any strides: transformers' [E, N, K] ``F.linear`` layout or gpt-oss's [E, K, N])
and dots them with x_p in float32. Pairs that share an expert read its weights once each (the
L2 cache catches some); at block 1 every weight read is one the step needs.

Same maths as ``x @ W[e].T`` (+ bias) in float32 accumulation, rounded to the output dtype:
agrees with cuBLAS to float rounding. Needs CUDA and Triton (``TRITON_INTERPRET=1`` runs it on CPU).
"""

from __future__ import annotations

import torch

MAX_PAIRS = 64  # (row, expert) pairs up to which the MoE blocks use this kernel
BLOCK_N = 32  # output features per program
BLOCK_K = 128  # input features per iteration

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

_VERIFIED: dict = {}  # device -> whether the kernel ran and matched torch there


if triton is not None:

    @triton.jit
    def _moe_gemv_kernel(X, W, B, E, OUT, K, N, s_xp, s_we, s_wn, s_wk, s_be, s_op,
                         HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        p = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(E + p).to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        live_n = n < N
        acc = tl.zeros([BN], tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            live_k = k < K
            x = tl.load(X + p * s_xp + k, mask=live_k, other=0.0).to(tl.float32)
            w = tl.load(W + e * s_we + n[:, None] * s_wn + k[None, :] * s_wk,
                        mask=live_n[:, None] & live_k[None, :], other=0.0)  # fmt: skip
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
        if HAS_BIAS:
            acc += tl.load(B + e * s_be + n, mask=live_n, other=0.0).to(tl.float32)
        tl.store(OUT + p * s_op + n, acc.to(OUT.dtype.element_ty), mask=live_n)


def moe_gemv(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, bias: torch.Tensor | None = None,
             transposed: bool = False) -> torch.Tensor:  # fmt: skip
    """out[p] = x[p] @ W[experts[p]]^T (+ bias[experts[p]]).

    Args:
        x: [P, K] rows (unit last stride).
        w: [E, N, K] (``F.linear`` layout) or, with ``transposed``, [E, K, N] (``x @ W``).
        experts: [P] int64 expert of each row.
        bias: [E, N] or None.
    Returns:
        [P, N] in w's dtype.
    """
    x = x if x.stride(-1) == 1 else x.contiguous()
    p, k = x.shape
    if transposed:
        n, s_wn, s_wk = w.shape[2], w.stride(2), w.stride(1)
    else:
        n, s_wn, s_wk = w.shape[1], w.stride(1), w.stride(2)
    out = torch.empty(p, n, dtype=w.dtype, device=x.device)
    b = bias if bias is not None else out
    _moe_gemv_kernel[(p, triton.cdiv(n, BLOCK_N))](
        x, w, b, experts, out, k, n, x.stride(0), w.stride(0), s_wn, s_wk,
        b.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, BN=BLOCK_N, BK=BLOCK_K,
    )  # fmt: skip
    return out


def moe_gemv_reference(x, w, experts, bias=None, transposed: bool = False) -> torch.Tensor:
    """:func:`moe_gemv` in torch (float32 accumulation), for checks."""
    ws = w[experts].float()  # [P, N, K] or [P, K, N]
    out = (
        (ws @ x.float()[:, :, None])[..., 0]
        if not transposed
        else (x.float()[:, None, :] @ ws)[:, 0]
    )
    if bias is not None:
        out = out + bias[experts].float()
    return out.to(w.dtype)


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel runs and matches torch on ``device`` for ``dtype`` weights (checked
    once per device and dtype on small random inputs, outside any graph capture): CUDA with
    Triton only. A failure (compile error, resources, mismatch) means the caller keeps its
    other route."""
    if triton is None or device.type != "cuda":
        return False
    key = (str(device), dtype)
    if key not in _VERIFIED:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(5, 200, generator=g, device=device, dtype=dtype)
            ok = True
            for transposed in (False, True):
                w = torch.randn(7, 96, 200, generator=g, device=device, dtype=dtype)
                w = w.transpose(1, 2).contiguous() if transposed else w
                b = torch.randn(7, 96, generator=g, device=device, dtype=dtype)
                e = torch.tensor([3, 0, 6, 3, 1], device=device)
                got = moe_gemv(x, w, e, b, transposed).float()
                want = moe_gemv_reference(x, w, e, b, transposed).float()
                ok &= bool(((got - want).abs().max() <= 2e-2 * want.abs().max() + 1e-3).item())
            _VERIFIED[key] = ok
        except Exception:  # noqa: BLE001 - Triton raises many types
            _VERIFIED[key] = False
    return _VERIFIED[key]
