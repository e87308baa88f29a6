"""RMSNorm inside an in-projection, its sums of squares written by the kernel before it.

:func:`~dflash.kernels.small_linear.small_linear_rn` runs an RMSNorm inside the projection
after it (the norm's weight folded into the projection's, the row factor
rsqrt(mean(x^2) + eps) applied to the float32 accumulator), and takes the rows' sums of squares
from the input tiles it streams (x x^T on the tensor cores). Over a K of 4,096 (Qwen3-8B) those
extra products cost more than the norm kernel they replace. Here the sums come from the kernel
that wrote x instead: every o_proj and down_proj (``small_linear`` with the residual add) is
followed by a norm, so each of its programs also writes its columns' share of each row's sum of
squares ([P, M] float32, P = its programs: :func:`small_linear_sq`), and the next in-projection
adds the P shares in one fixed order (:func:`small_linear_rnp`): no work per input tile, one
small read. The first layer's input norm (after the embedding) keeps its own kernel: the
squares form there (twentieth session, meant to make that norm the same at every width) made
torch 2.11's Inductor hang for minutes compiling the target forward on the H200 (a stack deep
in its IR's ``__str__``; ``bench_big`` and a real-pair run timed out at 150 and 200 s), and was
reverted.

``DFLASH_FUSE_NORM_FORM``: ``squares`` (unset: the default) or ``partials`` (this module; an
experiment until measured), where ``DFLASH_FUSE_NORM`` puts the norms inside the projections.
Deterministic (fixed orders) and the same maths per row at every width up to 16 rows, but the
first input norm (Inductor's kernel, compiled per width) lets block-1 decoding and a 16-row
verify differ on near-ties: H200, real demo pair, gsm8k 16, 4 identical + 12 near-ties, 0
unexplained (the default squares form: 16/16, and 32/32 in the twenty-first session). :func:`small_linear_sq_reference` and
:func:`small_linear_rnp_reference` are the maths in torch (CPU, tests); ``TRITON_INTERPRET=1``
runs the kernels on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.kernels.linear_settings import kernel_config
from dflash.kernels.small_linear import _launch, _on_cpu, _silu_times_up

FORM_ENV = "DFLASH_FUSE_NORM_FORM"


def norm_form() -> str:
    """``DFLASH_FUSE_NORM_FORM``: ``squares`` (unset; the sums of squares from the input tiles)
    or ``partials`` (from the previous kernel, this module).

    Raises:
        InputError: another value.
    """
    from dflash.errors import env_choice

    return env_choice(FORM_ENV, ("squares", "partials"))


def partial_columns(m: int, n: int, k: int) -> int:
    """Output columns per program of ``small_linear`` for an [m, k] x [n, k]^T product: each
    partial sum covers that many columns (the last one fewer)."""
    return kernel_config(m, n, k)[1]


@torch.library.custom_op("dflash::small_linear_sq", mutates_args=())
def _sq_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _launch(x, weight, bias, residual, sq_out=True)


@_sq_op.register_fake
def _(x, weight, bias, residual):
    m, (n, k) = x.shape[0], weight.shape
    p = -(-n // partial_columns(m, n, k))
    return x.new_empty(m, n), x.new_empty(p, m, dtype=torch.float32)


@torch.library.custom_op("dflash::small_linear_rnp", mutates_args=())
def _rnp_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sq: torch.Tensor, eps: float,
            glu: bool) -> torch.Tensor:  # fmt: skip
    return _launch(x, weight, bias, None, glu=glu, rn_eps=eps, sq=sq)


@_rnp_op.register_fake
def _(x, weight, bias, sq, eps, glu):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if glu else weight.shape[0])


def small_linear_sq_reference(x, weight, bias=None, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`small_linear_sq`'s maths in torch ops."""
    y = F.linear(x, weight, bias)
    y = y if residual is None else residual + y
    m, (n, k) = x.shape[0], weight.shape
    cols = partial_columns(m, n, k)
    p = -(-n // cols)
    sq = F.pad(y.float().pow(2), (0, p * cols - n)).view(m, p, cols).sum(-1)  # [M, P]
    return y, sq.t().contiguous()


def small_linear_sq(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``y = residual + linear(x, weight, bias)`` in one kernel (as
    :func:`~dflash.kernels.small_linear.small_linear`), and the partial sums of y's squares
    for the norm that follows (each program's output columns, in float32 from y's rounded
    values, as an RMSNorm squares them).

    Args:
        x: [M, K], unit last stride; M <= 32. weight: [N, K]; bias: [N] or None;
        residual: [M, N].
    Returns:
        y [M, N] in x's dtype and sq [P, M] float32 (P = ceil(N / the kernel's columns per
        program)); the references off CUDA (or without Triton, unless interpreting).
    """
    if _on_cpu(x):
        return small_linear_sq_reference(x, weight, bias, residual)
    return _sq_op(x, weight, bias, residual)


def small_linear_rnp_reference(x, weight, bias, sq, eps: float = 1e-6, glu: bool = False) -> torch.Tensor:
    """:func:`small_linear_rnp`'s maths in torch ops: the float32 product scaled by
    rsqrt(sum of the partial sums / K + eps), the bias added, rounded to x's dtype (``glu``:
    then SiLU(gate) * up in float32, rounded once)."""
    r = torch.rsqrt(sq.sum(0) / x.shape[1] + eps)[:, None]  # [M, 1]
    y = (F.linear(x.float(), weight.float()) * r + (bias.float() if bias is not None else 0.0)).to(x.dtype)
    return _silu_times_up(y) if glu else y


def small_linear_rnp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sq: torch.Tensor,
                     eps: float = 1e-6, glu: bool = False) -> torch.Tensor:  # fmt: skip
    """``linear(RMSNorm(x), W, bias)`` in one kernel, the norm's weight folded into ``weight``
    (:func:`~dflash.kernels.small_linear.fold_norm_weight`) and the rows' sums of squares
    from ``sq``, the partial sums :func:`small_linear_sq` wrote with x. As
    :func:`~dflash.kernels.small_linear.small_linear_rn` otherwise (roundings, ``glu``).

    Args:
        x: [M, K], unit last stride; M <= 32. weight: [N, K] (``glu``: [2N, K]); bias or None.
        sq: [P, M] float32 partial sums of x's squares (their sum over P: each row's sum), unit
            last stride.
        eps: the norm's epsilon.
    Returns:
        [M, N] in x's dtype.

    Raises:
        ValueError: shapes that do not fit.
    """
    if sq.dim() != 2 or sq.shape[1] != x.shape[0] or sq.dtype != torch.float32 or (sq.stride(1) != 1 and sq.shape[1] > 1):
        raise ValueError(f"small_linear_rnp: partial sums {tuple(sq.shape)} {sq.dtype} (strides {sq.stride()}) "
                         f"do not fit {x.shape[0]} rows")  # fmt: skip
    if glu and weight.shape[0] % 2:
        raise ValueError(f"small_linear: weight {tuple(weight.shape)} does not split into gate and up halves")
    if _on_cpu(x):
        return small_linear_rnp_reference(x, weight, bias, sq, eps, glu)
    return _rnp_op(x, weight, bias, sq, float(eps), glu)
