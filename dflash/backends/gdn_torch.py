"""GatedDeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.6) on the plain path: exact state rollback.

transformers keeps, per linear-attention layer of these targets, a conv state ``[B, C, K]`` (the
last K rows of the q|k|v projections before the depthwise causal conv, C = 2*Hk*Dk + Hv*Dv)
and a float32 recurrent state ``[B, Hv, Dk, Dv]`` in its ``DynamicCache``. ``crop()`` cannot
put the recurrent state back (transformers 5.17 leaves it at the end of the verified block), so
this module records, during a verify forward of T tokens, what restores any prefix of the block:

- the state before the verify (a copy of both tensors: restores a prefix of 0 tokens);
- for T > 1, the conv input ``[B, C, K + T]`` (the K previous rows and the block's rows): the
  conv state after n tokens is its columns ``n .. n + K - 1``;
- for T > 1, the recurrent state after each token: the gated delta rule runs token by token
  (transformers' own recurrent kernel, the one its one-token decode calls) instead of the
  chunked kernel, so the verify's outputs and states are those of decoding the block one token
  at a time from the same inputs; the recurrent state after n tokens is the n-th of them.

For T = 1 transformers runs its decode path, which updates both states in place. After the
acceptance, :meth:`GatedDeltaRollback.restore` writes the states of the committed prefix into
the cache (in place: the cache keeps its tensors). Full-attention layers roll back as before
(:func:`dflash.backends.plain.rollback_cache`).

Exactness: the restored states are the ones the verify computed for that prefix, through the
kernels decoding uses, so the states after every step are those of one-by-one decoding up to
the rounding of the projections: torch's CPU matrix products (and its vectorized exp/sigmoid)
round a T-row forward and a 1-row forward differently, in the last bits (measured below 1e-4
in float32 on the tiny test targets, against > 1 between neighbouring prefixes). Greedy ids
equal transformers' ``generate``.

The capture wraps two module-level functions of the covered modeling modules
(``torch_chunk_gated_delta_rule``, calling the module's ``torch_recurrent_gated_delta_rule`` in
its place, and ``causal_conv1d_fn``; both stay pass-through outside a verify) and hooks each
GatedDeltaNet module to know which layer runs. A layout it does not know is refused at load, and a verify that did not record a
layer raises rather than continue with a state it cannot restore.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

import torch

from dflash.errors import BackendError

# The transformers modeling modules whose GatedDeltaNet layout the capture was written and
# tested for (Qwen3.5's MoE module is a copy of Qwen3.5's); names each must define.
COVERED = ("transformers.models.qwen3_next.modeling_qwen3_next",
           "transformers.models.qwen3_5.modeling_qwen3_5",
           "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")  # fmt: skip
NEEDED = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn")
LINEAR = "linear_attention"
_ACTIVE: _Record | None = None  # the verify being recorded, if any


class _Record:
    """What one verify forward recorded.

    Attributes:
        start: position of the verify's first token; steps: T, its width.
        pre: cache layer index -> (conv [B, C, K], recurrent [B, Hv, Dk, Dv]) before the verify.
        conv: layer -> conv input [B, C, K + T] (T > 1).
        states: layer -> recurrent state after each of the T tokens (T > 1).
        current: the layer whose GatedDeltaNet runs now.
    """

    def __init__(self, start: int, steps: int, pre: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.start, self.steps, self.pre = start, steps, pre
        self.conv: dict[int, torch.Tensor] = {}
        self.states: dict[int, list[torch.Tensor]] = {}
        self.current: int | None = None


def _wrap(module: Any) -> None:
    """Replace the module's chunked delta rule and its causal conv by recording wrappers
    (idempotent; pass-through outside a verify)."""
    chunk, conv = module.torch_chunk_gated_delta_rule, module.causal_conv1d_fn
    if getattr(chunk, "_dflash_original", None) is not None:
        return

    @functools.wraps(chunk)
    def recording_chunk(query, key, value, *args, **kwargs):
        rec = _ACTIVE
        if rec is None or rec.current is None or args:
            return chunk(query, key, value, *args, **kwargs)
        kwargs.pop("chunk_size", None)
        want_final = kwargs.pop("output_final_state", False)
        g, beta, state = kwargs.pop("g"), kwargs.pop("beta"), kwargs.pop("initial_state", None)
        step = module.torch_recurrent_gated_delta_rule  # what transformers' decode calls
        outs, states = [], []
        for t in range(query.shape[1]):  # [B, T, H, D]: one token at a time, as decoding does
            out, state = step(query[:, t : t + 1], key[:, t : t + 1], value[:, t : t + 1],
                              g=g[:, t : t + 1], beta=beta[:, t : t + 1], initial_state=state,
                              output_final_state=True, **kwargs)  # fmt: skip
            outs.append(out)
            states.append(state)
        rec.states[rec.current] = states
        return torch.cat(outs, dim=1), (state if want_final else None)

    @functools.wraps(conv)
    def recording_conv(hidden_states, *args, **kwargs):
        rec = _ACTIVE
        if rec is not None and rec.current is not None:
            rec.conv[rec.current] = hidden_states  # [B, C, K + T]: previous rows, then the block's
        return conv(hidden_states, *args, **kwargs)

    recording_chunk._dflash_original = chunk
    recording_conv._dflash_original = conv
    module.torch_chunk_gated_delta_rule, module.causal_conv1d_fn = recording_chunk, recording_conv


def _enter(index: int):
    def hook(_module, _args):
        if _ACTIVE is not None:
            _ACTIVE.current = index

    return hook


def _leave(_module, _args, _out):
    if _ACTIVE is not None:
        _ACTIVE.current = None


def decoder_layers(model: Any) -> Any:
    """The decoder layers of a causal LM (``model.model.layers``), or None."""
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)
    return getattr(inner, "layers", None)


class GatedDeltaRollback:
    """Records and restores the GatedDeltaNet states of a transformers hybrid target.

    Args:
        model: a loaded causal LM whose text config lists ``layer_types``.

    Attributes:
        indices: the linear-attention layers (their cache layer indices).
        length: positions the recurrent states hold once the pending verify is settled.

    Raises:
        BackendError: a linear-attention layer whose module is not a covered GatedDeltaNet.
    """

    def __init__(self, model: Any):
        text = model.config.get_text_config()
        kinds = list(getattr(text, "layer_types", None) or [])
        layers = decoder_layers(model)
        self.indices = [i for i, k in enumerate(kinds) if k == LINEAR]
        for i in self.indices:
            gdn = getattr(layers[i], "linear_attn", None) if layers is not None else None
            mod = sys.modules.get(type(gdn).__module__) if gdn is not None else None
            if (
                mod is None
                or mod.__name__ not in COVERED
                or not all(callable(getattr(mod, n, None)) for n in NEEDED)
            ):
                raise BackendError(f"The target's linear-attention layer {i} ({type(gdn).__name__}) cannot be "
                                   "rolled back exactly on the transformers backend.",
                                   hint="GatedDeltaNet hybrids of Qwen3-Next and Qwen3.5 run here; "
                                   "install transformers>=5.17,<5.40")  # fmt: skip
            _wrap(mod)
            if not getattr(gdn, "_dflash_hooked", False):
                gdn.register_forward_pre_hook(_enter(i))
                gdn.register_forward_hook(_leave)
                gdn._dflash_hooked = True
        self.length = 0
        self.pending: _Record | None = None

    @classmethod
    def for_target(cls, model: Any) -> GatedDeltaRollback | None:
        """The rollback of a target with linear-attention layers; None for one without."""
        text = model.config.get_text_config()
        return cls(model) if LINEAR in (getattr(text, "layer_types", None) or []) else None

    def reset(self) -> None:
        """A new, empty cache: no state yet, nothing pending."""
        self.length, self.pending = 0, None

    @contextlib.contextmanager
    def recording(self, cache: Any, start: int, steps: int):
        """Record the forward of ``steps`` tokens at ``start`` (the states must hold ``start``
        positions: call :meth:`restore` first). A forward on a cache without linear states yet
        (a prefill) records nothing and cannot be rolled back into.

        Memory: the per-token recurrent states, T x (linear layers) x Hv*Dk*Dv x 4 bytes (Qwen3.5-9B
        at T = 16: 24 x 32 x 128 x 128 x 4 x 16 = 768 MiB), held until the next restore.

        Raises:
            BackendError: the forward did not go through the recorded kernels for some layer.
        """
        global _ACTIVE
        layers = (
            [cache.layers[i] for i in self.indices] if len(cache.layers) > max(self.indices) else []
        )
        ready = bool(layers) and all(_has_state(layer) for layer in layers)
        if not ready:
            yield
            self.length = start + steps
            return
        pre = {i: (layer.conv_states[0].clone(), layer.recurrent_states[0].clone())
               for i, layer in zip(self.indices, layers, strict=True)}  # fmt: skip
        rec = _Record(start, steps, pre)
        _ACTIVE = rec
        try:
            yield
        finally:
            _ACTIVE = None
        missing = [
            i
            for i in self.indices
            if steps > 1 and (len(rec.states.get(i, ())) != steps or i not in rec.conv)
        ]
        if missing:
            raise BackendError(f"The hybrid target's GatedDeltaNet layer {missing[0]} was not recorded during "
                               "verify, so its state cannot be rolled back exactly.",
                               hint="this transformers release runs it through other kernels; "
                               "install transformers>=5.17,<5.40")  # fmt: skip
        self.pending, self.length = rec, start + steps

    def restore(self, cache: Any, length: int) -> None:
        """Set every GatedDeltaNet layer to its state after the first ``length`` positions.

        Raises:
            BackendError: ``length`` is outside the last verify (its start .. its end), or,
                without a pending verify, differs from the positions the states hold.
        """
        rec = self.pending
        if rec is None:
            if length != self.length:
                raise BackendError(f"Cannot roll the recurrent state back from {self.length} to {length} "
                                   "positions (only within the last verify).")  # fmt: skip
            return
        keep = length - rec.start
        if not 0 <= keep <= rec.steps:
            raise BackendError(f"Cannot roll the recurrent state back to {length} positions: the last "
                               f"verify covered {rec.start}..{rec.start + rec.steps}.")  # fmt: skip
        self.pending, self.length = None, length
        if keep == rec.steps:
            return  # the forward left the cache there
        with torch.inference_mode():  # the cache's tensors were made in inference mode
            self._write(cache, rec, keep, length)

    def _write(self, cache: Any, rec: _Record, keep: int, length: int) -> None:
        for i in self.indices:
            layer = cache.layers[i]
            conv, state = layer.conv_states[0], layer.recurrent_states[0]
            if keep == 0:
                new_conv, new_state = rec.pre[i]
            else:
                width = conv.shape[-1]
                full = rec.conv[i]
                if full.shape[-1] != width + rec.steps:
                    raise BackendError(f"GatedDeltaNet layer {i}: conv input of {full.shape[-1]} rows for "
                                       f"{rec.steps} tokens and a {width}-row state.",
                                       hint="install transformers>=5.17,<5.40")  # fmt: skip
                new_conv, new_state = full[..., keep : keep + width], rec.states[i][keep - 1]
            conv.copy_(new_conv)
            state.copy_(new_state)
            count = getattr(layer, "cumulative_length_linear", None)  # transformers >= 5.2x
            if isinstance(count, torch.Tensor):
                count.fill_(length)


def _has_state(layer: Any) -> bool:
    """Whether a cache layer holds a conv and a recurrent state (after its first forward)."""
    try:
        return bool(layer.has_previous_state[0]) and layer.recurrent_states[0] is not None
    except (AttributeError, KeyError, TypeError):
        return False
