"""The RMSNorms of Qwen3.5 / Qwen3-Next hybrids in one Triton kernel each (static path, verify).

These targets scale by ``1 + weight`` (zero-centred RMSNorm: the layers' input and
post-attention norms, the final norm, the attention's q/k norms) and their GatedDeltaNet layers
end with a gated RMSNorm (``weight * norm(o)`` times ``silu(z)``). As torch ops each is 8-10
small kernels; in a graph of a verify step of Qwen3.5-9B's shape that is ~900 launches (~2 µs
each). Here each norm is one kernel, one program per row.

Maths as the transformers modules (``Qwen3_5RMSNorm``, ``Qwen3NextRMSNorm``; the ``...Gated``
ones), in float32 with their roundings: the centred norm ``(x * rsqrt(mean(x^2) + eps)) * (1 + w)``
rounded once; the gated norm rounds its input to the activations' dtype (the static forward's
float32 recurrence output, as the module receives it), the normed row again before the weight,
the product again, and the gated result once more. The sums of squares run in another order than
torch's, so a row can differ from the module's by a unit in the last place. Off CUDA (or without
Triton, unless ``TRITON_INTERPRET=1``) the caller runs the modules.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

CENTRED = frozenset({"Qwen3_5RMSNorm", "Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm"})
GATED = frozenset({"Qwen3_5RMSNormGated", "Qwen3NextRMSNormGated", "Qwen3_5MoeRMSNormGated"})
MAX_N = 16384  # one row in registers


def norms_fit(target, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether every norm of the hybrid ``target`` is one of :data:`CENTRED` / :data:`GATED`
    with a weight of ``dtype`` (bf16 or fp16; float32 runs the modules, the parity runs), and
    the kernels can run on ``device`` (CUDA, or the Triton interpreter)."""
    on = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if triton is None or not on or dtype not in (torch.bfloat16, torch.float16):
        return False
    norms = [target.model.norm]
    for layer in target.model.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        mixer = getattr(layer, "linear_attn", None)
        norms += (
            [mixer.norm] if mixer is not None else [layer.self_attn.q_norm, layer.self_attn.k_norm]
        )
    for n in norms:
        w = getattr(n, "weight", None)
        if (
            type(n).__name__ not in CENTRED | GATED
            or not isinstance(w, torch.Tensor)
            or w.dtype != dtype
        ):
            return False
        if w.dim() != 1 or w.numel() > MAX_N or w.stride(0) != 1:
            return False
    return True


def _eps(norm) -> float:
    return float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))


if triton is not None:

    @triton.jit
    def _centred_kernel(
        X, W, Y, s_t, s_h, eps, HEADS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(X + (row // HEADS) * s_t + (row % HEADS) * s_h + cols, mask=ok, other=0.0).to(
            tl.float32
        )
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, 0) / N + eps)
        tl.store(Y + row * N + cols, ((x * r) * (1.0 + w)).to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _gated_kernel(
        SRC, Z, W, Y, s_zt, eps, HEADS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        dt = Y.dtype.element_ty
        o = tl.load(SRC + row * N + cols, mask=ok, other=0.0).to(dt).to(tl.float32)
        z = tl.load(Z + (row // HEADS) * s_zt + (row % HEADS) * N + cols, mask=ok, other=0.0).to(
            tl.float32
        )
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(o * o, 0) / N + eps)
        h = (w * (o * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(Y + row * N + cols, (h * (z * tl.sigmoid(z))).to(dt), mask=ok)


@torch.library.custom_op("dflash::centred_rms_norm", mutates_args=())
def _centred_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int, s_t: int, s_h: int
) -> torch.Tensor:
    n = weight.shape[0]
    rows = x.numel() // n
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    _centred_kernel[(rows,)](x, weight, y, s_t, s_h, eps, HEADS=heads, N=n, BLOCK=block,
                             num_warps=8 if block >= 4096 else (4 if block >= 1024 else 1))  # fmt: skip
    return y


@_centred_op.register_fake
def _(x, weight, eps, heads, s_t, s_h):
    return x.new_empty(x.numel() // weight.shape[0], weight.shape[0])


@torch.library.custom_op("dflash::gated_rms_norm", mutates_args=())
def _gated_op(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, heads: int, s_zt: int
) -> torch.Tensor:
    n = weight.shape[0]
    rows = o.numel() // n
    y = torch.empty(rows, n, dtype=weight.dtype, device=o.device)
    block = triton.next_power_of_2(n)
    _gated_kernel[(rows,)](o, z, weight, y, s_zt, eps, HEADS=heads, N=n, BLOCK=block,
                           num_warps=4 if block >= 1024 else 1)  # fmt: skip
    return y


@_gated_op.register_fake
def _(o, z, weight, eps, heads, s_zt):
    return o.new_empty(o.numel() // weight.shape[0], weight.shape[0], dtype=weight.dtype)


def centred_rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` (a :data:`CENTRED` module) in one kernel.

    Args:
        norm: the module (its weight [N] and epsilon).
        x: [1, T, N] (rows of unit last stride, any row stride) or [1, T, H, N] (per-head rows:
            unit last stride, any token and head strides).

    Returns:
        x's shape, contiguous, in x's dtype.
    """
    n = norm.weight.shape[0]
    if x.stride(-1) != 1 or x.shape[-1] != n or x.shape[0] != 1:
        raise ValueError(
            f"centred_rms_norm: rows {tuple(x.shape)} (strides {x.stride()}) for a weight of {n}"
        )
    heads, s_t, s_h = (
        (1, x.stride(1), 0) if x.dim() == 3 else (x.shape[2], x.stride(1), x.stride(2))
    )
    return _centred_op(x, norm.weight, _eps(norm), heads, s_t, s_h).view(x.shape)


def gated_rms_norm(norm, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``norm(o.to(dtype), z)`` (a :data:`GATED` module) in one kernel.

    Args:
        norm: the module (its weight [D], in the activations' dtype, and epsilon).
        o: [T, H, D] float32 contiguous (the recurrence's output).
        z: [T, H, D] the gate (unit last stride, heads D apart, any token stride).

    Returns:
        [T * H, D] in the weight's dtype.
    """
    t, h, d = o.shape
    if not o.is_contiguous() or z.shape != o.shape or z.stride(-1) != 1 or z.stride(-2) != d:
        raise ValueError(
            f"gated_rms_norm: o {tuple(o.shape)}, z {tuple(z.shape)} (strides {z.stride()})"
        )
    return _gated_op(o, z, norm.weight, _eps(norm), h, z.stride(0))
