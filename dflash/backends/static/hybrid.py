"""GatedDeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.6) on the static (CUDA-graph) path.

These targets stack GatedDeltaNet (linear-attention) layers and gated full-attention layers
(3 : 1). The static forward here runs the HF model's own modules for norms, projections and
feed-forwards, and its own code where state is kept:

- full-attention layers: Qwen3.5's gated attention (q and an output gate from one projection,
  zero-centred q/k norms, partial RoPE) over the static path's position-indexed K/V buffers, as
  every static target (rollback free);
- GatedDeltaNet layers: the conv and the gated delta rule of :mod:`dflash.kernels.gdn` over
  fixed buffers, the committed state in slot 0 (:class:`HybridState`); a verify writes the state
  after each of its tokens into the other slots and commits nothing, and the rollback gathers the
  accepted prefix's state on the device (:func:`dflash.kernels.gdn.rollback`);
- feed-forwards: dense MLPs (gate and up fused) or Qwen3-MoE-style expert blocks
  (:func:`~dflash.backends.static.moe.moe_forward`) with the shared expert and its sigmoid gate.

A prefill runs the chunked delta rule from zero states. Everything a verify runs has fixed
shapes, so the verify is captured in CUDA graphs like the other static targets'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dflash.backends.static.fused import (
    FusedLinear,
    _in_proj,
    _mlp,
    _out_proj,
    _plain,
    attend,
    dense_mlp,
    fusable,
    fuse_linears,
)
from dflash.backends.static.moe import moe_block, moe_forward
from dflash.errors import BackendError
from dflash.kernels import gdn
from dflash.kernels.gdn_norms import centred_rms_norm, gated_rms_norm
from dflash.kernels.gdn_triton import fits as triton_fits
from dflash.kernels.gdn_triton import gdn_verify
from dflash.models.target_torch import layer_kinds

LINEAR = "linear_attention"
NORM_ROWS = 32  # forwards of up to this many tokens run the norms as kernels (when be.hybrid_norms)
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # text configs' model_type
QWEN35_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
NEXT_PROJ = ("in_proj_qkvz", "in_proj_ba")


def is_hybrid(config: Any) -> bool:
    """Whether the (text) config lists linear-attention layers."""
    return LINEAR in layer_kinds(config)


def _gdn_fits(m: Any) -> bool:
    conv = getattr(m, "conv1d", None)
    if (
        conv is None
        or getattr(conv, "weight", None) is None
        or conv.weight.dim() != 3
        or conv.weight.shape[1] != 1
    ):
        return False
    if not all(isinstance(getattr(m, n, None), torch.Tensor) for n in ("A_log", "dt_bias")):
        return False
    if getattr(m, "activation", None) not in ("silu", "swish") or not hasattr(m, "norm"):
        return False
    names = QWEN35_PROJ if hasattr(m, "in_proj_qkv") else NEXT_PROJ
    if names == NEXT_PROJ and not callable(getattr(m, "fix_query_key_value_ordering", None)):
        return False
    return fusable(*(getattr(m, n, None) for n in names)) and fusable(m.out_proj)


def _attn_fits(a: Any) -> bool:
    return (a is not None and fusable(a.q_proj, a.k_proj, a.v_proj) and hasattr(a, "q_norm")
            and a.q_proj.weight.shape[0] == 2 * a.config.num_attention_heads * a.head_dim)  # fmt: skip


def _mlp_fits(mlp: Any) -> bool:
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return fusable(mlp.gate_proj, mlp.up_proj)
    shared, gate = getattr(mlp, "shared_expert", None), getattr(mlp, "shared_expert_gate", None)
    return moe_block(mlp) and (shared is None) == (gate is None)


def hybrid_refusal(target: Any) -> str | None:
    """Why the static path cannot run this GatedDeltaNet hybrid (one phrase), or None: a
    Qwen3-Next / Qwen3.5 / Qwen3.5-MoE text model whose linear-attention layers have the layouts
    transformers 5.17-5.3x gives them, gated full-attention layers, default RoPE (partial
    allowed), and dense MLPs or top-k expert blocks with a gated shared expert."""
    cfg = target.config
    family = getattr(cfg, "model_type", None)
    if family not in HYBRID_TYPES:
        return f"{family} hybrids run on the plain path"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"RoPE type {rope.get('rope_type')!r} runs on the plain path"
    inner = getattr(target, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "the target's module layout is not Qwen3.5-like"
    kinds = layer_kinds(cfg)
    if len(inner.layers) != len(kinds) or any(k not in (LINEAR, "full_attention") for k in kinds):
        return f"layer kinds {sorted(set(kinds))} run on the plain path"
    for layer, kind in zip(inner.layers, kinds, strict=True):
        ok = _gdn_fits(getattr(layer, "linear_attn", None)) if kind == LINEAR else _attn_fits(
            getattr(layer, "self_attn", None))  # fmt: skip
        if not ok or not _mlp_fits(layer.mlp):
            return "its layers are not the GatedDeltaNet / gated attention / MLP layouts the static path runs"
    return None


class HybridState:
    """The static buffers of a hybrid target's GatedDeltaNet layers (see :mod:`dflash.kernels.gdn`).

    Attributes:
        index: target layer -> its row in ``conv`` / ``states``.
        conv: [L, C, K + W] (model dtype); states: [L, W + 1, Hv, Dk, Dv] float32.
        taps: [K] int64 ``arange(K)``; keep: [1] int64 tokens the last rollback kept.
        width: W, the widest verify.
    """

    def __init__(self, target: Any, width: int, dtype: torch.dtype, device: torch.device):
        kinds = layer_kinds(target.config)
        self.index = {i: n for n, i in enumerate(i for i, k in enumerate(kinds) if k == LINEAR)}
        m = target.model.layers[next(iter(self.index))].linear_attn
        c, k = m.conv1d.weight.shape[0], m.conv1d.weight.shape[-1]
        hv, dk, dv = m.num_v_heads, m.head_k_dim, m.head_v_dim
        n = len(self.index)
        self.width = width
        self.conv = torch.zeros(n, c, k + width, dtype=dtype, device=device)
        self.states = torch.zeros(n, width + 1, hv, dk, dv, dtype=torch.float32, device=device)
        self.taps = torch.arange(k, device=device)
        self.keep = torch.zeros(1, dtype=torch.long, device=device)
        self.triton = triton_fits(dk, dv, device)
        self.pending: tuple[int, int] | None = None  # (start, width) of a verify not settled yet
        self.length = 0  # positions the committed states hold

    def prefilled(self, length: int) -> None:
        """A prefill of ``length`` positions wrote the committed states."""
        self.pending, self.length = None, length

    def verifying(self, start: int, width: int) -> None:
        """Before a verify of ``width`` tokens at ``start``: settle the last verify at ``start``
        (:meth:`settle`), then remember this one."""
        self.settle(start)
        self.pending = (start, width)

    def settle(self, length: int) -> None:
        """Commit the states of the first ``length`` positions: within the last verify (a
        :meth:`rollback` to its accepted prefix), or the committed length itself.

        Raises:
            BackendError: ``length`` is outside the last verify, or (none pending) differs from
                the committed length.
        """
        pending, self.pending = self.pending, None
        if pending is None:
            if length != self.length:
                raise BackendError(f"Cannot roll the recurrent state back from {self.length} to {length} "
                                   "positions (only within the last verify).")  # fmt: skip
            return
        start, width = pending
        if not 0 <= length - start <= width:
            raise BackendError(f"Cannot roll the recurrent state back to {length} positions: the last "
                               f"verify covered {start}..{start + width}.")  # fmt: skip
        self.rollback(length - start)
        self.length = length

    def clear(self) -> None:
        """Zero states (a new request; the prefill starts from them)."""
        self.conv.zero_()
        self.states.zero_()

    def rollback(self, keep: torch.Tensor | int) -> None:
        """Commit the state after ``keep`` tokens of the last verify ([1] int64 on the device,
        or a host int written into :attr:`keep` without a sync)."""
        if isinstance(keep, int):
            self.keep.fill_(keep)
            keep = self.keep
        gdn.rollback(self.conv, self.states, keep, self.taps)

    def committed(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [C, K], recurrent [Hv, Dk, Dv]) committed for target layer ``layer`` (views)."""
        n, k = self.index[layer], self.taps.shape[0]
        return self.conv[n, :, :k], self.states[n, 0]


def linears_fit(target: Any, dtype: torch.dtype) -> bool:
    """Whether every out-projection (``o_proj`` / ``out_proj``) and dense ``down_proj`` of the
    hybrid is a dense row-major linear of ``dtype`` (what small_linear takes)."""
    for layer in target.model.layers:
        mixer = getattr(layer, "linear_attn", None)
        out = mixer.out_proj if mixer is not None else layer.self_attn.o_proj
        down = getattr(layer.mlp, "down_proj", None)
        if not _plain(out, dtype) or (down is not None and not _plain(down, dtype)):
            return False
    return True


def fuse_hybrid(target: Any) -> list[tuple[FusedLinear, FusedLinear | None]]:
    """Per layer (the token mixer's input projections fused, gate+up fused or None for an
    expert block)."""
    out = []
    for layer in target.model.layers:
        if hasattr(layer, "linear_attn"):
            m = layer.linear_attn
            mix = fuse_linears(
                [getattr(m, n) for n in (QWEN35_PROJ if hasattr(m, "in_proj_qkv") else NEXT_PROJ)]
            )
        else:
            a = layer.self_attn
            mix = fuse_linears((a.q_proj, a.k_proj, a.v_proj))
        mlp = layer.mlp
        out.append((mix, fuse_linears((mlp.gate_proj, mlp.up_proj)) if dense_mlp(layer) else None))
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial RoPE of x [1, H, T, D] with cos/sin [1, 1, T, R], R <= D (transformers' order)."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + turned * sin, rest), dim=-1)


def _attention(be, i: int, a: Any, mix: FusedLinear, h: torch.Tensor, pos: torch.Tensor, cos, sin,
               mask, lin_in: bool, kl) -> torch.Tensor:  # fmt: skip
    """Gated full attention of normed h [1, T, H] at ``pos`` [1, T]; writes K/V rows. -> the
    gated attention output [1, T, heads * D], before o_proj."""
    t, hd = h.shape[1], a.head_dim
    heads, kvh = be.heads, be.kv_heads
    qg, k, v = _in_proj(lin_in, mix, h, kl)
    q, gate = qg.view(1, t, heads, 2 * hd).chunk(2, dim=-1)
    gate = gate.reshape(1, t, heads * hd)
    nk = be.hybrid_norms and t <= NORM_ROWS
    q = (centred_rms_norm(a.q_norm, q) if nk else a.q_norm(q)).transpose(1, 2)  # [1, H, T, D]
    k = k.view(1, t, kvh, hd)
    k = (centred_rms_norm(a.k_norm, k) if nk else a.k_norm(k)).transpose(1, 2)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    be.k[i].index_copy_(2, pos[0], k)
    be.v[i].index_copy_(2, pos[0], v.view(1, t, kvh, hd).transpose(1, 2))
    o = attend(q, be.k[i], be.v[i], mask, a.scaling)  # [1, H, T, D]
    return o.transpose(1, 2).reshape(1, t, heads * hd) * torch.sigmoid(gate)


def _projections(m: Any, mix: FusedLinear, h: torch.Tensor, lin_in: bool, kl):
    """A GatedDeltaNet layer's projections of normed h [1, T, H]: (q|k|v rows [T, C], z
    [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
    t = h.shape[1]
    if hasattr(m, "in_proj_qkv"):  # Qwen3.5: four projections
        qkv, z, b, a = _in_proj(lin_in, mix, h, kl)
        return qkv[0], z[0].reshape(t, -1, m.head_v_dim), b[0], a[0]
    qkvz, ba = _in_proj(lin_in, mix, h, kl)  # Qwen3-Next: grouped per key head
    q, k, v, z, b, a = m.fix_query_key_value_ordering(qkvz, ba)
    rows = torch.cat((q.reshape(1, t, -1), k.reshape(1, t, -1), v.reshape(1, t, -1)), dim=-1)
    return rows[0], z[0], b[0], a[0]


def _linear_attention(st: HybridState, i: int, m: Any, mix: FusedLinear, h: torch.Tensor,
                      prefill: bool, kernel_norm: bool = False, lin_in: bool = False,
                      kl=None) -> torch.Tensor:  # fmt: skip
    """A GatedDeltaNet layer on normed h [1, T, H] -> its gated-norm output [1, T, Hv * Dv]
    (before out_proj): a prefill from zero states (committed slots written), or a verify from
    the committed slots (the others written)."""
    n, t = st.index[i], h.shape[1]
    rows, z, b, a = _projections(m, mix, h, lin_in, kl)
    weight = m.conv1d.weight[:, 0, :]  # [C, K]
    act = F.silu
    conv = (gdn.conv_prefill if prefill else gdn.conv_verify)(
        st.conv[n], rows, weight, m.conv1d.bias, act
    )
    if not prefill and st.triton:  # the inputs' preparation and the recurrence: one kernel
        o = gdn_verify(conv, a, b, m.A_log, m.dt_bias, st.states[n], m.num_k_heads)
    else:
        q, k, v = conv.split((m.key_dim, m.key_dim, m.value_dim), dim=-1)
        q, k, v, g, beta = gdn.prepare(q.view(t, -1, m.head_k_dim), k.view(t, -1, m.head_k_dim),
                                       v.view(t, -1, m.head_v_dim), a, b, m.A_log, m.dt_bias)  # fmt: skip
        if prefill:
            st.states[n, 0].zero_()  # a prompt starts from zero states
            o = gdn.chunked_prefill(q, k, v, g, beta, st.states[n, 0])
        else:
            o = gdn.recurrent_verify(q, k, v, g, beta, st.states[n])
    if kernel_norm:  # the gated norm in one kernel (dflash.kernels.gdn_norms)
        o = gated_rms_norm(m.norm, o, z)
    else:
        o = m.norm(o.to(h.dtype).reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return o.reshape(1, t, -1)


def _feed_forward(layer: Any, gate_up: FusedLinear | None, h: torch.Tensor, x: torch.Tensor, route: str,
                  lin: bool, lin_in: bool, glu: bool, kl) -> torch.Tensor:  # fmt: skip
    """x + the layer's MLP or expert block (with its gated shared expert) of normed h [1, T, H]
    (dense MLPs through :func:`~dflash.backends.static.fused._mlp`: small_linear when ``lin``)."""
    mlp = layer.mlp
    if gate_up is not None:
        return _mlp(lin, lin_in, gate_up, mlp.down_proj, mlp.act_fn, h, x, glu, kl)
    out = moe_forward(mlp, h, route)
    if getattr(mlp, "shared_expert", None) is not None:
        out = out + torch.sigmoid(mlp.shared_expert_gate(h)) * mlp.shared_expert(h)
    return x + out


def hybrid_forward(be, ids: torch.Tensor, pos: torch.Tensor, prefill: bool = False) -> torch.Tensor:
    """The static forward of a hybrid target. ids, pos [1, T] -> logits [T, V]; writes the
    full-attention layers' K/V and the features at ``pos``, and the GatedDeltaNet buffers
    (``be.gdn``: a prefill the committed slots, a verify the per-token slots)."""
    target = be.target
    x = F.embedding(ids, be.embed_weight)  # [1, T, H]
    rot = target.model.rotary_emb
    # Qwen3.5's text rotary takes multimodal positions [3, 1, T] (transformers 5.17 needs them;
    # later versions broadcast [1, T]): text positions are the same in all three sections
    rot_pos = pos.expand(3, -1, -1) if type(rot).__name__.startswith("Qwen3_5") else pos
    cos, sin = rot(x, rot_pos)  # [1, T, R]
    cos, sin = cos[:, None], sin[:, None]
    mask = (be.key_pos[None, :] <= pos[0, :, None])[None, None]  # [1, 1, T, S]
    slots: list[torch.Tensor] = [None] * len(be.layer_ids)  # type: ignore[list-item]
    t = ids.shape[1]
    nk = be.hybrid_norms and t <= NORM_ROWS  # the norms as kernels (verify widths)
    kl = be.launch["target"]
    lin = t <= NORM_ROWS and be.linear != "torch"  # small_linear: out-projections with the residual
    lin_in = lin and t <= be.linear_in  # the in-projections too

    def norm(module, x):
        return centred_rms_norm(module, x) if nk else module(x)

    for i, layer in enumerate(target.model.layers):
        mix, gate_up = be.fused_target[i]
        h = norm(layer.input_layernorm, x)
        if i in be.gdn.index:
            m = layer.linear_attn
            o = _linear_attention(be.gdn, i, m, mix, h, prefill, nk, lin_in, kl)
            x = _out_proj(lin, m.out_proj, o, x, kl)
        else:
            o = _attention(be, i, layer.self_attn, mix, h, pos, cos, sin, mask, lin_in, kl)
            x = _out_proj(lin, layer.self_attn.o_proj, o, x, kl)
        h = norm(layer.post_attention_layernorm, x)
        x = _feed_forward(layer, gate_up, h, x, be.moe_route, lin, lin_in, be.glu, kl)
        if i < be.n_layers - 1:
            for n in be.feature_layers.get(i, ()):
                slots[n] = x[0]
    x = norm(target.model.norm, x)
    for n in be.feature_layers.get(be.n_layers - 1, ()):
        slots[n] = x[0]
    if be.layer_ids:
        be.feats.index_copy_(0, pos[0], torch.cat(slots, dim=-1))
    return be.lm_head(x)[0]
