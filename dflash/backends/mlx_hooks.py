"""Taps into an mlx-lm target: layer outputs (draft features) and GatedDeltaNet rollback.

Layer outputs (brief §5.1): each decoder layer object whose output the draft reads gets a
subclass of its own class (``obj.__class__`` swap, parameters untouched) that stores its output
while a :class:`Tap` is active. The output of ``layers[L]`` is HF's ``hidden_states[L + 1]``;
for the last layer HF returns the final-normed state, so the backend applies the norm there.

GatedDeltaNet rollback (brief §5.3): linear-attention layers (mlx-lm ``qwen3_next``, ``qwen3_5``)
keep a conv state ``cache[0]`` (B, K-1, conv_dim) and a float32 recurrent state ``cache[1]``
(B, Hv, Dv, Dk) in an ``ArraysCache``, which cannot be trimmed. During verify the tap records,
per GatedDeltaNet layer, the conv input (the K-1 previous conv rows followed by this call's
rows) and the exact arguments of its ``gated_delta_update`` call, including the pre-verify
recurrent state. Restoring a prefix of n tokens re-runs the same update on the first n steps
from that state and takes conv rows n .. n+K-2: the state a one-token-at-a-time decode of those
n tokens would hold.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import mlx.core as mx

from dflash.errors import BackendError

COVERED = ("mlx_lm.models.qwen3_next", "mlx_lm.models.qwen3_5")  # qwen3_5_moe reuses qwen3_5's
_ACTIVE: Tap | None = None  # the tap recording the current forward, if any
_SUBCLASSES: dict[tuple[type, str], type] = {}


class Tap:
    """What one target forward recorded.

    Attributes:
        outputs: decoder-layer index -> output [B, T, H] of that layer.
        conv: cache index -> conv input [B, K-1+T, C] of that GatedDeltaNet layer.
        updates: cache index -> (update function, its bound arguments incl. the initial state).
        current: cache index of the GatedDeltaNet layer running now.
    """

    def __init__(self) -> None:
        self.outputs: dict[int, mx.array] = {}
        self.conv: dict[int, mx.array] = {}
        self.updates: dict[int, dict[str, Any]] = {}
        self.current: int | None = None

    def __enter__(self) -> Tap:
        global _ACTIVE
        self.outputs.clear()
        self.conv.clear()
        self.updates.clear()
        _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = None
        self.current = None


def _swap_class(obj: Any, kind: str) -> None:
    """Give ``obj`` a recording subclass of its own class (idempotent)."""
    base = type(obj)
    if getattr(base, "_dflash_kind", None) == kind:
        return
    key = (base, kind)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"DFlash{kind}{base.__name__}", (base,), {
            "_dflash_kind": kind, "__call__": _CALLS[kind], "__module__": base.__module__})  # fmt: skip
    obj.__class__ = _SUBCLASSES[key]


def _layer_call(self, *args, **kwargs):
    out = super(type(self), self).__call__(*args, **kwargs)
    if _ACTIVE is not None and self._dflash_index is not None:
        _ACTIVE.outputs[self._dflash_index] = out[0] if isinstance(out, tuple) else out
    return out


def _gdn_call(self, *args, **kwargs):
    if _ACTIVE is None:
        return super(type(self), self).__call__(*args, **kwargs)
    _ACTIVE.current = self._dflash_cache_index
    try:
        return super(type(self), self).__call__(*args, **kwargs)
    finally:
        _ACTIVE.current = None


def _conv_call(self, x):
    if _ACTIVE is not None and _ACTIVE.current is not None:
        _ACTIVE.conv[_ACTIVE.current] = x
    return super(type(self), self).__call__(x)


_CALLS = {"Layer": _layer_call, "GDN": _gdn_call, "Conv": _conv_call}


def hook_layers(layers: list, indices: list[int]) -> None:
    """Record the outputs of ``layers[i]`` for i in indices (other layers record nothing)."""
    for i in set(indices):
        _swap_class(layers[i], "Layer")
        layers[i]._dflash_index = i
    for i, layer in enumerate(layers):
        if i not in indices and getattr(type(layer), "_dflash_kind", None) == "Layer":
            layer._dflash_index = None


# ------------------------------------------------------------------ GatedDeltaNet


def find_gdn(layer: Any) -> Any | None:
    """The GatedDeltaNet-like submodule of a decoder layer, or None.

    It must come from one of the mlx-lm modules whose layout the capture was written and tested
    for (``COVERED``: one depthwise ``conv1d`` over [conv state; q|k|v rows], conv state in
    ``cache[0]``, the state of a module-global ``gated_delta_update`` call in ``cache[1]``) and
    have ``conv1d``, ``conv_kernel_size``, ``A_log`` and ``dt_bias``. Other GatedDeltaNet users
    (kimi_linear, olmo_hybrid, bailing_moe_v3, ...) lay out their state differently: not covered.
    """
    for child in layer.children().values():
        need = ("conv1d", "conv_kernel_size", "A_log", "dt_bias")
        if type(child).__module__ in COVERED and all(k in child or hasattr(child, k) for k in need):
            mod = sys.modules.get(type(child).__module__)
            if mod is not None and callable(getattr(mod, "gated_delta_update", None)):
                return child
    return None


def _wrap_update(module: Any) -> None:
    """Replace ``module.gated_delta_update`` by a recording wrapper (idempotent)."""
    original = module.gated_delta_update
    if getattr(original, "_dflash_original", None) is not None:
        return
    sig = inspect.signature(original)

    def recording_update(*args, **kwargs):
        if _ACTIVE is not None and _ACTIVE.current is not None:
            bound = sig.bind(*args, **kwargs)
            _ACTIVE.updates[_ACTIVE.current] = (original, dict(bound.arguments))
        return original(*args, **kwargs)

    recording_update._dflash_original = original
    module.gated_delta_update = recording_update


def hook_gdn(gdn: Any, cache_index: int) -> None:
    """Make one GatedDeltaNet layer record its conv input and state update under cache_index."""
    _swap_class(gdn, "GDN")
    gdn._dflash_cache_index = cache_index
    _swap_class(gdn.conv1d, "Conv")
    _wrap_update(sys.modules[type(gdn).__module__])


def restore_gdn(cache: Any, tap: Tap, index: int, keep: int, steps: int) -> None:
    """Set a GatedDeltaNet cache to its state after the first ``keep`` of ``steps`` verify tokens.

    Raises:
        BackendError: the verify forward did not record this layer (an uncovered layout).
    """
    if index not in tap.conv or index not in tap.updates:
        raise BackendError(f"The hybrid target's recurrent layer {index} was not captured during "
                           "verify, so its state cannot be rolled back.",
                           hint="this model layout is not supported by the mlx backend")  # fmt: skip
    conv_input = tap.conv[index]
    update, args = tap.updates[index]
    args = dict(args)
    k_minus_1 = conv_input.shape[1] - steps
    assert k_minus_1 == cache[0].shape[1], f"conv rows {cache[0].shape} vs {k_minus_1}"
    for name in ("q", "k", "v", "a", "b"):
        args[name] = args[name][:, :keep]
    if args.get("mask") is not None:
        args["mask"] = args["mask"][:, :keep]
    _y, state = update(**args)
    cache[1] = state
    cache[0] = mx.contiguous(conv_input[:, keep : keep + k_minus_1])
