"""Mixture-of-experts feed-forward for the static forwards (Qwen3-MoE style), CUDA-graph safe.

transformers' expert loop (``Qwen3MoeExperts.forward``) finds the experts a batch hits with
``nonzero`` and runs one matmul per hit expert: data-dependent shapes and host syncs, which a
CUDA graph cannot hold. Here every shape is fixed by the number of rows T and the router's
top-k K, whatever the routing:

- router: logits = h W_r^T [T, E]; softmax in float32; top-K; divided by their sum when the
  config's ``norm_topk_prob`` is set; cast back to the logits' dtype (transformers' order);
- experts, one of two routes (:func:`moe_route`):
  ``gather``: the T*K chosen experts' weights are gathered ([T*K, 2I, H] and [T*K, H, I])
  and applied with batched matmuls (any device and dtype; reads and copies each chosen
  expert once per (row, slot): fine for tests and tiny models, slow for big ones);
  ``grouped``: the T*K (row, slot) pairs sorted by expert, and ``torch.nn.functional.grouped_mm``
  over all experts with per-expert offsets (bf16 on CUDA): only the experts hit are read;
- each pair's output times its routing weight, the K slots of a row summed in slot order
  (no atomics: the same order on every run).

Same maths as transformers' loop (act(gate) * up, down, weighted sum); the sum over a row's
experts runs in another order, so results agree to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dflash.kernels.moe_gemv import MAX_EXPERTS, MAX_PAIRS, moe_combine, moe_gemv, moe_glu, moe_topk
from dflash.kernels.moe_gemv import usable as moe_gemv_usable

# routers without a ``norm_topk_prob`` flag that always divide the top-k weights by their sum
ALWAYS_NORMALIZED = frozenset({"Qwen3_5MoeTopKRouter"})


def normalizes(gate: Any) -> bool:
    """Whether the router divides its top-k weights by their sum (``norm_topk_prob``, or always
    for :data:`ALWAYS_NORMALIZED` routers)."""
    return bool(getattr(gate, "norm_topk_prob", True))


def moe_block(mlp: Any) -> bool:
    """Whether ``mlp`` is a top-k routed expert block this module runs: a router ``gate`` with
    a [E, H] ``weight``, ``top_k`` and ``norm_topk_prob``, and ``experts`` holding [E, 2I, H]
    ``gate_up_proj`` and [E, H, I] ``down_proj`` tensors, no biases, and an ``act_fn``
    (transformers' Qwen3-MoE layout)."""
    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    if (
        gate is None
        or experts is None
        or not hasattr(gate, "top_k")
        or not (hasattr(gate, "norm_topk_prob") or type(gate).__name__ in ALWAYS_NORMALIZED)
    ):
        return False
    w, gu, down = (getattr(gate, "weight", None), getattr(experts, "gate_up_proj", None),
                   getattr(experts, "down_proj", None))  # fmt: skip
    if (
        not all(isinstance(t, torch.Tensor) for t in (w, gu, down))
        or w.dim() != 2
        or gu.dim() != 3
        or down.dim() != 3
    ):
        return False
    e, hidden = w.shape
    inter = down.shape[2]
    if gu.shape != (e, 2 * inter, hidden) or down.shape != (e, hidden, inter):
        return False
    if any(getattr(m, b, None) is not None for m in (gate, experts) for b in ("bias", "gate_up_proj_bias",
                                                                                "down_proj_bias")):  # fmt: skip
        return False
    return callable(getattr(experts, "act_fn", None)) and not getattr(
        experts, "is_transposed", False
    )


def moe_route(device: torch.device, dtype: torch.dtype) -> str:
    """``grouped`` on CUDA with bf16 weights where this torch has ``F.grouped_mm`` (compute
    capability 8.0 or more), else ``gather`` (CPU, float32: the parity runs); ``fused`` where,
    besides, the expert GEMV kernel (:mod:`dflash.kernels.moe_gemv`) runs and matches torch on
    this device: forwards of up to :data:`~dflash.kernels.moe_gemv.MAX_PAIRS` (row, expert)
    pairs, and at most half as many as there are experts, run it; others ``grouped``."""
    if device.type == "cuda" and dtype == torch.bfloat16 and hasattr(F, "grouped_mm"):
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return "fused" if moe_gemv_usable(device, dtype) else "grouped"
    return "gather"


def _kernel_topk(how: str, logits: torch.Tensor) -> bool:
    """Whether the ``fused`` route's router kernel (:func:`~dflash.kernels.moe_gemv.moe_topk`)
    takes these [T, E] logits (the rows a fused expert step runs)."""
    return how == "fused" and logits.shape[-1] <= MAX_EXPERTS and logits.shape[0] <= MAX_PAIRS


def route(mlp: Any, h: torch.Tensor, how: str = "gather") -> tuple[torch.Tensor, torch.Tensor]:
    """The router of ``mlp`` on rows h [T, H]: (weights [T, K] in the logits' dtype, experts
    [T, K] int64), as transformers' top-k router computes them (the ``fused`` route: softmax,
    top-k and the division in one kernel)."""
    gate = mlp.gate
    logits = F.linear(h, gate.weight)  # [T, E]
    if _kernel_topk(how, logits):
        return moe_topk(logits, gate.top_k, True, normalizes(gate))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, idx = torch.topk(probs, gate.top_k, dim=-1)
    if normalizes(gate):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), idx


def moe_forward(
    mlp: Any, h: torch.Tensor, how: str = "gather", residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The expert block's output for normed activations h [1, T, H] -> [1, T, H].

    Args:
        mlp: a block :func:`moe_block` accepts.
        h: [1, T, H] activations (the post-attention norm's output).
        how: ``gather``, ``grouped`` or ``fused`` (:func:`moe_route`).
        residual: [1, T, H] added to the output (``residual + out``, rounded as torch's add of
            two tensors of its dtype; the ``fused`` route adds it in the slot-sum kernel), or None.
    """
    x = h[0]  # [T, H]
    weights, experts = route(mlp, x, how)  # [T, K]
    ex = mlp.experts
    act = ex.act_fn

    def glu(gu: torch.Tensor) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        return act(g) * u

    name = kernel_act(act)
    fused_glu = (name, False, 1.0, 0.0) if name else None
    y = apply_experts(x, weights, experts, ex.gate_up_proj, ex.down_proj, glu, how, kernel_glu=fused_glu,
                      residual=None if residual is None else residual[0])  # fmt: skip
    return (y if residual is not None else y.to(h.dtype))[None]


def apply_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gu_w: torch.Tensor,
                  down_w: torch.Tensor, glu, how: str = "gather", gu_b: torch.Tensor | None = None,
                  down_b: torch.Tensor | None = None, transposed: bool = False,
                  kernel_glu: tuple | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """sum_k weights[t, k] * down_e(glu(gate_up_e(x[t]))) over the K experts e = experts[t, k]
    of each row, with fixed shapes (CUDA-graph safe).

    Args:
        x: [T, H] rows; weights: [T, K] routing weights; experts: [T, K] int64 expert ids.
        gu_w, down_w: [E, 2I, H] and [E, H, I] (``F.linear`` layout), or with ``transposed``
            [E, H, 2I] and [E, I, H] (``x @ W``, gpt-oss).
        glu: [N, 2I] -> [N, I], the gated activation (which half is the gate is the family's).
        how: ``gather``, ``grouped`` or ``fused`` (:func:`moe_route`).
        gu_b, down_b: [E, 2I] and [E, H] per-expert biases, or None.
        kernel_glu: ``glu`` as the ``fused`` route's gate+up epilogue
            (:func:`~dflash.kernels.moe_gemv.moe_glu`): (act, interleaved, alpha, limit); None:
            ``glu`` runs as torch ops between two GEMV kernels.
        residual: [T, H] rows to add, or None.
    Returns:
        [T, H] in the product's dtype (float32 when the weights are), the K slots summed in
        slot order; with ``residual``, ``residual + that.to(residual.dtype)`` (in the ``fused``
        route one kernel sums the slots, rounds and adds).
    """
    y, combined = _experts(x, weights, experts, gu_w, down_w, glu, how, gu_b, down_b, transposed, kernel_glu,
                           residual)  # fmt: skip
    return y if residual is None or combined else residual + y.to(residual.dtype)


def _experts(
    x, weights, experts, gu_w, down_w, glu, how, gu_b, down_b, transposed, kernel_glu, residual
):
    """:func:`apply_experts`'s body: (rows, whether the residual is already added in)."""
    t, k = experts.shape
    flat = experts.reshape(-1)  # [T*K] expert of each (row, slot)
    gu_t = gu_w if transposed else gu_w.transpose(-2, -1)  # [E, H, 2I] views
    down_t = down_w if transposed else down_w.transpose(-2, -1)  # [E, I, H]
    # the fused route while pairs are few next to the experts: each pair reads its expert's weights
    # (a shared expert once per pair), where grouped_mm reads each hit expert once
    if how == "fused" and t * k <= MAX_PAIRS and 2 * t * k <= gu_w.shape[0]:
        if kernel_glu is not None:  # pair p reads row p // K
            act, inter = kernel_glu[:2]
            a = moe_glu(
                x.to(gu_w.dtype), gu_w, flat, gu_b, act, inter, transposed, *kernel_glu[2:], x_div=k
            )
        else:
            xs = x[:, None, :].expand(t, k, x.shape[1]).reshape(t * k, x.shape[1]).to(gu_w.dtype)
            a = glu(moe_gemv(xs, gu_w, flat, gu_b, transposed))  # [T*K, I]
        # the routing weights in the down kernel's epilogue; float32 out, the K slots summed here
        y = moe_gemv(a, down_w, flat, down_b, transposed, weights.reshape(-1), torch.float32)
        if residual is not None:  # the slot sum, the cast and the residual add: one kernel
            return moe_combine(y, k, residual), True
        return y.view(t, k, -1).sum(1), False  # [T, H]
    elif how in ("grouped", "fused"):
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        rows = torch.div(order, k, rounding_mode="floor")
        counts = torch.zeros(gu_w.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's group
        sorted_e = flat[order]
        gu = F.grouped_mm(x[rows].to(gu_w.dtype), gu_t, offs=offs)  # [T*K, 2I]
        if gu_b is not None:
            gu = gu + gu_b[sorted_e]
        y = F.grouped_mm(glu(gu), down_t, offs=offs)  # [T*K, H], sorted
        if down_b is not None:
            y = y + down_b[sorted_e]
        y = torch.empty_like(y).index_copy_(0, order, y)  # back to (row, slot) order
    else:
        xs = x[:, None, :].expand(t, k, x.shape[1]).reshape(t * k, 1, x.shape[1])  # [T*K, 1, H]
        gu = torch.bmm(xs.to(gu_w.dtype), gu_t[flat])[:, 0]  # [T*K, 2I]
        if gu_b is not None:
            gu = gu + gu_b[flat]
        y = torch.bmm(glu(gu)[:, None, :], down_t[flat])[:, 0]  # [T*K, H]
        if down_b is not None:
            y = y + down_b[flat]
    return (y.view(t, k, -1) * weights[..., None]).sum(1), False


def kernel_act(act: Any) -> str | None:
    """The :func:`~dflash.kernels.moe_gemv.moe_glu` name of a transformers activation module
    (SiLU, GELU with the tanh approximation), or None."""
    name = type(act).__name__
    if name in ("SiLUActivation", "SiLU"):
        return "silu"
    return "gelu_tanh" if name in ("GELUTanh", "PytorchGELUTanh") else None


def gpt_oss_block(mlp: Any) -> bool:
    """Whether ``mlp`` is a gpt-oss expert block (transformers' ``GptOssMLP``): a ``router``
    with a [E, H] ``weight``, an [E] ``bias`` and ``top_k``; ``experts`` with [E, H, 2I]
    ``gate_up_proj`` (gate and up interleaved), [E, 2I] ``gate_up_proj_bias``, [E, I, H]
    ``down_proj``, [E, H] ``down_proj_bias``, ``alpha`` and ``limit``."""
    router, ex = getattr(mlp, "router", None), getattr(mlp, "experts", None)
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    if (
        router is None
        or ex is None
        or not hasattr(router, "top_k")
        or not all(hasattr(ex, n) for n in names)
    ):
        return False
    w, b = getattr(router, "weight", None), getattr(router, "bias", None)
    gu, gub, down, downb = (getattr(ex, n) for n in names)
    if not all(isinstance(x, torch.Tensor) for x in (w, b, gu, gub, down, downb)) or w.dim() != 2:
        return False
    e, hidden = w.shape
    inter = down.shape[1] if down.dim() == 3 else -1
    return (gu.shape == (e, hidden, 2 * inter) and down.shape == (e, inter, hidden) and gub.shape == (e, 2 * inter)
            and downb.shape == (e, hidden) and b.shape == (e,)
            and isinstance(getattr(ex, "alpha", None), (int, float))
            and isinstance(getattr(ex, "limit", None), (int, float)))  # fmt: skip


def gpt_oss_forward(
    mlp: Any, h: torch.Tensor, how: str = "gather", residual: torch.Tensor | None = None
) -> torch.Tensor:
    """A gpt-oss expert block (:func:`gpt_oss_block`) on normed activations h [1, T, H] ->
    [1, T, H], as transformers computes it: router logits h W^T + b, top-K of the logits, a
    softmax over those K (in the logits' dtype); per expert gate_up = x W + b, gate and up
    interleaved (even and odd columns), gate clamped to <= limit and up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate), then down = . W + b. ``residual``: as
    :func:`moe_forward`'s."""
    x = h[0]
    router, ex = mlp.router, mlp.experts
    logits = F.linear(x, router.weight, router.bias)  # [T, E]
    if _kernel_topk(how, logits):  # top-k and the softmax over it: one kernel
        weights, idx = moe_topk(logits, router.top_k, False)
    else:
        top, idx = torch.topk(logits, router.top_k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
    alpha, limit = float(ex.alpha), float(ex.limit)

    def glu(gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu[..., ::2].clamp(max=limit), gu[..., 1::2].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    y = apply_experts(x, weights, idx, ex.gate_up_proj, ex.down_proj, glu, how, ex.gate_up_proj_bias,
                      ex.down_proj_bias, transposed=True, kernel_glu=("gpt_oss", True, alpha, limit),
                      residual=None if residual is None else residual[0])  # fmt: skip
    return (y if residual is not None else y.to(h.dtype))[None]


def gemma4_block(layer: Any) -> bool:
    """Whether a Gemma 4 decoder layer has an expert block this module runs (transformers'
    ``Gemma4TextRouter`` and ``Gemma4TextExperts``: [E, 2I, H] ``gate_up_proj``, [E, H, I]
    ``down_proj``, no biases)."""
    router, ex = getattr(layer, "router", None), getattr(layer, "experts", None)
    if router is None or ex is None:
        return False
    need = (getattr(router, "proj", None), getattr(router, "scale", None), getattr(router, "per_expert_scale", None),
            getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None))  # fmt: skip
    if not all(isinstance(getattr(n, "weight", n), torch.Tensor) for n in need):
        return False
    e = router.proj.weight.shape[0]
    return (ex.gate_up_proj.dim() == 3 and ex.gate_up_proj.shape[0] == e and ex.down_proj.dim() == 3
            and callable(getattr(ex, "act_fn", None)) and callable(getattr(router, "norm", None))
            and isinstance(getattr(getattr(router, "config", None), "top_k_experts", None), int))  # fmt: skip


def gemma4_moe_forward(layer: Any, residual: torch.Tensor, how: str = "gather") -> torch.Tensor:
    """A Gemma 4 layer's expert branch on its un-normed input rows residual [1, T, H] ->
    [1, T, H] (before ``post_feedforward_layernorm_2``), as transformers computes it: the
    router on norm(x) * scale * H^-1/2, a float32 softmax over all experts, top-K, renormalised,
    times the chosen experts' ``per_expert_scale``; the experts on
    ``pre_feedforward_layernorm_2(x)``: down(act(gate) * up)."""
    x = residual[0]
    router, ex = layer.router, layer.experts
    hs = router.norm(x) * router.scale * router.scalar_root_size
    probs = torch.softmax(router.proj(hs), dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, router.config.top_k_experts, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    top = top * router.per_expert_scale[idx]
    act = ex.act_fn

    def glu(gu: torch.Tensor) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        return act(g) * u

    h2 = layer.pre_feedforward_layernorm_2(x)
    name = kernel_act(act)
    fused_glu = (name, False, 1.0, 0.0) if name else None
    y = apply_experts(h2, top, idx, ex.gate_up_proj, ex.down_proj, glu, how, kernel_glu=fused_glu)
    return y.to(residual.dtype)[None]
