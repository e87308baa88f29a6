"""The LM head and the greedy argmax of a few rows in one pass over the head's weight.

The device loop (:mod:`dflash.backends.static.device_loop`) needs only the argmax of the target's
logits (to accept and commit) and of the draft's (its proposals). The LM head is the largest
single matmul of a step on the demo pair (49,152 x 576, 57 MB in bf16: about 17 us on the H200
with cuBLAS, against about 13 us to stream the weight), and the argmax after it took two more
kernels (``row_argmax``). Here each program computes ``BN`` logits of every row (rounded to the
activations' dtype, as the unfused head's output is) and writes each row's largest value in its
slice and the first column holding it; a small reduction over the slices then picks the first
slice holding the row's maximum. Same index as ``argmax`` over the logits this kernel computes
(fp32 sums rounded to the activations' dtype; the first maximal column, ties included). cuBLAS
sums in another order, so on a near-tie (logits a rounding step apart) the two heads can pick
different tokens, as any two GEMM kernels can; NaN logits are not handled (torch's argmax picks
a NaN).

``DFLASH_HEAD_ARGMAX=1`` (experiment, off by default until measured on a GPU) uses it in the
device loop's graphs (CUDA with Triton; rows <= :data:`MAX_ROWS`); the host loop's graphs keep
the logits (sampling needs them). :func:`head_argmax_reference` is the unfused maths in torch
(CPU, tests); ``TRITON_INTERPRET=1`` runs the kernel on CPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dflash.kernels.linear_settings import kernel_config
from dflash.kernels.pdl import pdl_enabled

HEAD_ENV = "DFLASH_HEAD_ARGMAX"
MAX_ROWS = 32

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def head_argmax_default() -> bool:
    """``DFLASH_HEAD_ARGMAX``: ``1`` fuses the LM head and the greedy argmax in the device loop's
    graphs; unset or ``0``: off (the default until measured).

    Raises:
        InputError: another value.
    """
    raw = os.environ.get(HEAD_ENV, "").strip().lower()
    if raw not in ("", "0", "1"):
        from dflash.errors import InputError

        raise InputError(f"{HEAD_ENV} must be 0 or 1, got {raw!r}.", hint="unset it for the default (0)")
    return raw == "1"


def head_fits(head, dtype: torch.dtype) -> bool:
    """Whether ``head`` (the target's output embeddings) can run through the kernel: a plain
    dense row-major weight of ``dtype``, no bias."""
    w = getattr(head, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == dtype and w.stride(-1) == 1
            and getattr(head, "bias", None) is None and type(head).forward is torch.nn.Linear.forward)  # fmt: skip


if triton is not None:
    from dflash.kernels.small_linear import _rows_times_weight

    @triton.jit
    def _head_argmax_kernel(X, W, PV, PI, M, N, K, s_xm, s_wn, s_pm, IEEE: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        rn = pid * BN + tl.arange(0, BN)  # this program's columns (vocabulary ids)
        rm = tl.arange(0, BM)
        m_ok = rm < M
        n_ok = rn < N
        acc = _rows_times_weight(X, W, rm, rn, m_ok, n_ok, K, s_xm, s_wn, IEEE, BM, BN, BK, PDL, 0, 64)
        y = acc.to(X.dtype.element_ty).to(tl.float32)  # the logits as the unfused head rounds them
        y = tl.where(n_ok[None, :], y, float("-inf"))
        best = tl.max(y, 1)  # [BM]
        where = tl.argmax(y, 1, tie_break_left=True)  # [BM] first column of the slice holding it
        tl.store(PV + rm * s_pm + pid, best, mask=m_ok)
        tl.store(PI + rm * s_pm + pid, pid * BN + where, mask=m_ok)


def _launch(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slice maxima [M, P] (float32) and their first columns [M, P] (int32)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1 or m > MAX_ROWS:
        raise ValueError(f"head_argmax: input {tuple(x.shape)} (strides {x.stride()}) does not fit "
                         f"weight {tuple(weight.shape)} or has over {MAX_ROWS} rows")  # fmt: skip
    bm, bn, bk, warps, stages = kernel_config(m, n, k, weight.element_size())
    slices = triton.cdiv(n, bn)
    pv = torch.empty(m, slices, dtype=torch.float32, device=x.device)
    pi = torch.empty(m, slices, dtype=torch.int32, device=x.device)
    pdl = pdl_enabled(x.device)
    _head_argmax_kernel[(slices,)](
        x, weight, pv, pi, m, n, k, x.stride(0), weight.stride(0), pv.stride(0), IEEE=x.dtype == torch.float32,
        BM=bm, BN=bn, BK=bk, PDL=pdl, num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return pv, pi


@torch.library.custom_op("dflash::head_argmax_slices", mutates_args=())
def _slices_op(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, weight)


@_slices_op.register_fake
def _(x, weight):
    slices = -(-weight.shape[0] // kernel_config(x.shape[0], weight.shape[0], x.shape[1], weight.element_size())[1])
    return (x.new_empty(x.shape[0], slices, dtype=torch.float32),
            x.new_empty(x.shape[0], slices, dtype=torch.int32))  # fmt: skip


def head_argmax_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``argmax(x @ weight^T)`` per row in torch ops: [M] int64."""
    return F.linear(x, weight).argmax(-1)


def head_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row: ``argmax(x @ weight^T, -1)`` without writing the logits.

    Args:
        x: [M, K] activations (unit last stride), M <= :data:`MAX_ROWS`.
        weight: [V, K] the LM head's weight (row major).
    Returns:
        [M] int64 vocabulary ids (the first maximal column of the logits rounded to x's dtype).
        Off CUDA (or without Triton, unless interpreting) :func:`head_argmax_reference`.

    Raises:
        ValueError: shapes that do not fit, or more than MAX_ROWS rows (before the launch).
    """
    if triton is None or (x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return head_argmax_reference(x, weight)
    pv, pi = _slices_op(x, weight)
    pick = pv.argmax(-1, keepdim=True)  # [M, 1] the first slice holding the row's maximum
    return pi.gather(1, pick)[:, 0].long()
