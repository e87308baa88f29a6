"""The rows of batched speculative decoding: a request (:class:`SpecJob`), what a row committed
in a step (:class:`RowStep`), and the draft's per-row context cache (:class:`DraftRows`), for
:mod:`dflash.backends.static.batched_spec`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflash.types import SamplingParams


@dataclass
class SpecJob:
    """One request: prompt ids, budget (tokens, the stop token included), stop ids, sampling."""

    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: Sequence[int] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class RowStep:
    """What one row committed in a step: ``tokens`` (after a stop cut), ``accepted`` proposals
    accepted (None for the prefill's token), ``proposed`` proposals verified, ``finish``
    ("stop", "length" or None)."""

    row: int
    tokens: list[int]
    accepted: int | None
    proposed: int
    finish: str | None


class DraftRows:
    """Draft context K/V [B, Hkv', S, D'] per layer, written at per-row positions.

    ``rows`` [R] and ``write_pos`` [R, Tc] say where :meth:`append` writes; it returns the
    first ``width`` slots of the rows (a view for rows 0..R-1, ``gather`` False, else a copy)."""

    def __init__(
        self, layers: int, b: int, kv_heads: int, slots: int, head_dim: int, dtype, device
    ):
        shape = (b, kv_heads, slots, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows: torch.Tensor | None = None
        self.write_pos: torch.Tensor | None = None
        self.width, self.gather = 0, False
        self.window = None

    @property
    def positions(self) -> None:
        """None: row validity comes from the caller's masks (as the static draft cache)."""
        return None

    @positions.setter
    def positions(self, _value) -> None:
        pass

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor):
        """k, v [R, Hkv', Tc, D'] -> written at (rows, write_pos); returns the rows' K/V."""
        r = self.rows[:, None]
        self.keys[i][r, :, self.write_pos] = k.transpose(1, 2)
        self.values[i][r, :, self.write_pos] = v.transpose(1, 2)
        if self.gather:
            return self.keys[i][:, :, : self.width][self.rows], self.values[i][:, :, : self.width][
                self.rows
            ]
        n = self.rows.shape[0]
        return self.keys[i][:n, :, : self.width], self.values[i][:n, :, : self.width]
