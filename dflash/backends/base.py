"""The small protocol between the speculative loop and a local backend (house style §5).

``dflash/loop.py`` calls only these methods. Arrays are the backend's own type (torch tensors,
mlx arrays); the loop never looks inside them except through ``to_list``/``to_numpy``.
Shapes: L block size, V vocabulary, F target-feature width, T tokens in a call.

Optional: ``sampler(params)`` returning an object with ``first(logits [V]) -> int`` and
``accept(proposals [n] | None, logits [n+1, V]) -> (a, bonus, proposals list)`` that samples at
temperature > 0 on the device (see ``dflash.sampling_torch``); without it the loop samples on the
host with ``dflash.sampling.NumpySampler``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass
class SelectorProposal:
    """What a DFlash2 draft returns in place of draft logits (brief §4.2, §3.5).

    Attributes:
        candidates: [L-1, k] integer array, the top-k candidate ids of each draft position.
        q: [L-1, k] float array, row i = the distribution over candidates that proposal i was
            sampled from (given proposals 0..i-1); None for greedy proposals.
    """

    candidates: Any
    q: Any | None = None


class LocalBackend(Protocol):
    """A target + draft pair the loop can drive.

    Attributes:
        vocab_size: V, shared by target and draft.
        mask_token_id: id fed at masked block positions.
        draft_block_size: the block size the draft was trained with (the default L).
        max_context: the target's context length in tokens (prompt + new tokens must fit).
        draft_uses_sampling: optional; True when ``draft`` takes a ``sampling`` keyword and
            samples its proposals itself (DFlash2). Absent or False: the loop never passes it.
        draft_head_rows: optional; True when ``draft`` takes a ``rows`` keyword: the draft
            still runs its layers at the full block width (the proposals do not change) but
            its LM head only on the first ``rows`` positions (on a CPU the head over 15 rows
            costs about half of the demo draft's forward). Absent or False: never passed.
    """

    vocab_size: int
    mask_token_id: int
    draft_block_size: int
    max_context: int

    def reset(self, max_positions: int | None = None) -> None:
        """Drop all cached state so the next request starts clean.

        Args:
            max_positions: upper bound on prompt + new tokens + block size of the request
                (lets static caches size their buffers once).
        """

    def prefill(self, prompt_ids: list[int], with_features: bool) -> tuple[Any, Any]:
        """Run the target over the prompt.

        Returns:
            (logits [V] of the last position, features [T, F] of every prompt position or
            None when ``with_features`` is False). Target cache then holds T positions.
        """

    def draft(self, anchor: int, context: Any, start: int, length: int) -> tuple[Any, Any]:
        """Propose the block after ``anchor`` in one draft forward.

        Args:
            anchor: last committed token, at absolute position ``start``.
            context: features [Tc, F] of the committed positions the draft has not seen yet
                (positions start - Tc .. start - 1); after plain (L = 1) steps of
                ``--block-size auto`` a list of such chunks in position order, to concatenate.
            length: width of the draft block (>= 2); the loop always passes the draft's
                trained block size and verifies only the first proposals it needs.
            sampling: keyword, passed only at temperature > 0 to backends that set
                ``draft_uses_sampling`` (their drafts draw proposals at that temperature).
            rows: keyword, passed only to backends that set ``draft_head_rows``: return just
                the first ``rows`` proposals (1 <= rows <= length - 1).

        Returns:
            (proposal ids [L-1] (or [rows]) as the backend's integer array, draft logits
            [L-1 or rows, V] (v1, unused by the loop) or a :class:`SelectorProposal` (DFlash2;
            its ``q`` is set when the proposals were sampled)).
        """

    def verify(self, anchor: int, proposals: Any, start: int, with_features: bool) -> tuple[Any, Any]:
        """Run the target over [anchor, proposals...] at positions start .. start+L-1.

        Returns:
            (logits [L, V], features [L, F] or None). The target cache grows by L positions.
        """

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` positions of the target cache."""

    def argmax(self, logits: Any) -> Any:
        """Row-wise argmax of logits [..., V] -> ids [...] (stays on the device)."""

    def to_list(self, *arrays: Any) -> list[list[int]]:
        """Copy integer arrays to host lists with one device sync."""

    def to_numpy(self, logits: Any) -> np.ndarray:
        """Copy logits [..., V] to a float32 numpy array."""

    def synchronize(self) -> None:
        """Wait for queued device work (before reading a clock)."""


def device_name(dev: Any) -> str:
    """A device's model name for the cost cache key (GPU name, or CPU model and core count)."""
    import os
    import platform

    if getattr(dev, "type", "cpu") == "cuda":
        import torch

        return f"{torch.cuda.get_device_name(dev)} x{torch.cuda.device_count()}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


@dataclass
class Loaded:
    """What a backend's ``load`` returns; :func:`dflash.api.load` wraps it in a Pipeline.

    Attributes:
        backend: the :class:`LocalBackend`; tokenizer: a HF tokenizer (encode/decode, chat
        template); stop_ids: EOS ids; name: what the user passed as the model ("demo" for none);
        draft_dir: the draft folder (its ``acceptance.json`` seeds ``--block-size auto``);
        cost_key: what keys the measured step costs (device, dtype, target, draft, ...);
        reference: optional ``(prompt_ids, *, max_new_tokens, sampling) -> GenerationResult``,
        the backend's own plain generator (mlx-lm's ``stream_generate``) for the benchmark.
    """

    backend: Any
    tokenizer: Any
    stop_ids: list[int]
    name: str
    draft_dir: Any
    cost_key: dict[str, Any]
    reference: Any = None
