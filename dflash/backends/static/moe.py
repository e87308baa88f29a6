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
    capability 8.0 or more), else ``gather`` (CPU, float32: the parity runs)."""
    if device.type == "cuda" and dtype == torch.bfloat16 and hasattr(F, "grouped_mm"):
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return "grouped"
    return "gather"


def route(mlp: Any, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of ``mlp`` on rows h [T, H]: (weights [T, K] in the logits' dtype, experts
    [T, K] int64), as transformers' top-k router computes them."""
    gate = mlp.gate
    logits = F.linear(h, gate.weight)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, idx = torch.topk(probs, gate.top_k, dim=-1)
    if normalizes(gate):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), idx


def moe_forward(mlp: Any, h: torch.Tensor, how: str = "gather") -> torch.Tensor:
    """The expert block's output (no residual) for normed activations h [1, T, H] -> [1, T, H].

    Args:
        mlp: a block :func:`moe_block` accepts.
        h: [1, T, H] activations (the post-attention norm's output).
        how: ``gather`` or ``grouped`` (:func:`moe_route`).
    """
    x = h[0]  # [T, H]
    t, k = x.shape[0], mlp.gate.top_k
    weights, experts = route(mlp, x)  # [T, K]
    gu_w, down_w, act = mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.experts.act_fn
    flat = experts.reshape(-1)  # [T*K] expert of each (row, slot)
    if how == "grouped":
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        rows = torch.div(order, k, rounding_mode="floor")
        counts = torch.zeros(gu_w.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's group
        gu = F.grouped_mm(x[rows].to(gu_w.dtype), gu_w.transpose(-2, -1), offs=offs)  # [T*K, 2I]
        g, u = gu.chunk(2, dim=-1)
        y = F.grouped_mm(act(g) * u, down_w.transpose(-2, -1), offs=offs)  # [T*K, H], sorted
        y = torch.empty_like(y).index_copy_(0, order, y)  # back to (row, slot) order
    else:
        xs = x[:, None, :].expand(t, k, x.shape[1]).reshape(t * k, 1, x.shape[1])  # [T*K, 1, H]
        gu = torch.bmm(xs, gu_w[flat].transpose(1, 2))[:, 0]  # [T*K, 2I]
        g, u = gu.chunk(2, dim=-1)
        y = torch.bmm((act(g) * u)[:, None, :], down_w[flat].transpose(1, 2))[:, 0]  # [T*K, H]
    y = y.view(t, k, -1) * weights[..., None]
    return y.sum(1).to(h.dtype)[None]
