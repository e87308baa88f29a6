"""The per-step verify width of a batch (``--block-size auto`` for batched speculative decoding).

A batched step of width L costs c_B(L) seconds at B rows (one draft forward over the B blocks
for L > 1, one verify forward of B x L tokens) and row r commits τ_r(min(L, m_r)) tokens in
expectation (:func:`dflash.auto_block.expected_tau` with the row's per-position acceptance, m_r
the row's remaining budget). The batch decodes Σ_r τ_r / c_B(L) tokens per second, so each step
takes the width maximising it (ties go to the smaller L); L = 1 is plain batched decoding
(τ = 1 for every row) and wins where verifying B x L tokens is compute-bound and the draft's
extra tokens do not pay for it, so the batch never decodes slower than plain batched decoding
would by the cost table.

:func:`choose_batch_width` is the pure rule; :class:`BatchPolicy` holds the cost table (seconds
per step by rows bucket and width, timed on the engine: :meth:`BatchCosts.measure`) and each
row's acceptance (its draft's prior, then an exponential moving average of its own steps), and
probes a drafted step after ``PROBE_EVERY`` plain steps in a row (plain steps teach nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash.auto_block import EMA_ALPHA, PRIOR_RATE, PROBE_EVERY


def row_taus(rates: Any, length: int) -> np.ndarray:
    """τ_r(j) for every row r and width j = 1..``length``: [R, length] float64.

    Args:
        rates: [R, >= length - 1] per-row, per-position acceptance p_1 .. (array or lists).
        length: the widest width priced.

    τ_r(j) = 1 + Σ_{i<j} Π_{k<=i} p_k (:func:`dflash.auto_block.expected_tau`), vectorised:
    the chooser runs before every step, for every row."""
    p = np.asarray(rates, dtype=np.float64).reshape(len(rates), -1)[:, : max(length - 1, 0)]
    out = np.ones((p.shape[0], length))
    if length > 1:
        out[:, 1:] += np.cumsum(np.cumprod(p, axis=1), axis=1)
    return out


def batch_tokens(
    rates: Any, widths: Sequence[int], remaining: Sequence[int] | None = None
) -> np.ndarray:
    """Expected tokens of the whole batch per step at each width: Σ_r τ_r(min(L, m_r)) [len(widths)].

    Args:
        rates: [R, L' - 1] per-row acceptance (L' >= max(widths)).
        widths: the widths L to price.
        remaining: per row, tokens of budget left (None: unbounded)."""
    n = len(rates)
    if not n:
        return np.zeros(len(widths))
    top = max(widths)
    taus = row_taus(rates, top)  # [R, top]
    left = np.full(n, top) if remaining is None else np.clip(np.asarray(remaining), 1, top)
    idx = np.minimum(np.asarray(widths)[None, :], left[:, None]) - 1  # [R, W]
    return np.take_along_axis(taus, idx, axis=1).sum(0)


def batch_rate(costs: Mapping[int, float], rates: Any, length: int,
               remaining: Sequence[int] | None = None) -> float:  # fmt: skip
    """Expected tokens per second of a width-``length`` step: Σ_r τ_r(min(L, m_r)) / c(L).

    Args:
        costs: width -> seconds of one step at this batch's rows bucket.
        rates: per row, per-position acceptance p_1 .. p_{L'-1}.
        length: L.
        remaining: per row, tokens of budget left (None: unbounded).
    """
    return float(batch_tokens(rates, [length], remaining)[0]) / costs[length]


def choose_batch_width(costs: Mapping[int, float], rates: Any,
                       remaining: Sequence[int] | None = None) -> int:  # fmt: skip
    """The width among ``costs``' keys (1 always allowed) maximising :func:`batch_rate`; ties
    (within 1e-9 relative) go to the smaller width. No rows: 1."""
    if not len(rates):
        return 1
    widths = sorted(set(costs) | {1})
    tokens = batch_tokens(rates, widths, remaining)
    best, best_rate = 1, float(tokens[0]) / costs[1] if 1 in costs else 0.0
    for w, t in zip(widths[1:], tokens[1:], strict=True):
        rate = float(t) / costs[w]
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = w, rate
    return best


@dataclass
class BatchCosts:
    """Seconds of one batched step by rows bucket and width: ``table[nb][L]``; a batch of B rows
    is priced at the smallest measured bucket >= B. Nothing is extrapolated: a step wider than
    every measured bucket is refused (measure up to the engine's rows)."""

    table: dict[int, dict[int, float]] = field(default_factory=dict)

    def at(self, rows: int) -> dict[int, float]:
        """The width -> seconds table of the bucket that runs ``rows`` rows.

        Raises:
            ValueError: ``rows`` above the largest measured bucket."""
        keys = sorted(self.table)
        got = next((k for k in keys if k >= rows), None)
        if got is None:
            raise ValueError(f"no step costs measured for {rows} rows (largest bucket {keys[-1:]})")
        return self.table[got]

    @classmethod
    def measure(cls, engine: Any, buckets: Sequence[int], widths: Sequence[int], *, context: int = 256,
                repeats: int = 5) -> BatchCosts:  # fmt: skip
        """Time ``engine.time_step(nb, L, context)`` (median of ``repeats``) for every bucket
        and width (a :class:`~dflash.backends.static.batched_spec.BatchedSpec`; its width-1
        time is per plain step of a call of ``plain_steps``, host sync included)."""
        table: dict[int, dict[int, float]] = {}
        for nb in buckets:
            row: dict[int, float] = {}
            for w in widths:
                engine.time_step(nb, w, context)  # warm-up / capture
                times = sorted(engine.time_step(nb, w, context) for _ in range(repeats))
                row[w] = times[len(times) // 2]
            table[nb] = row
        return cls(table)


class BatchPolicy:
    """Chooses the width of each batched step and learns each row's acceptance.

    Args:
        costs: the step costs.
        prior: per-position acceptance a new row starts from (p_1 .. p_{L'-1}); default the
            conservative 0.5 everywhere.
        max_width: L' (the draft's trained block size).
        probe_every: plain steps in a row before one drafted step re-measures acceptance (0: never).
        alpha: EMA weight of one step.
        plain_steps: plain steps the engine runs per width-1 choice (its ``plain_steps``).
    """

    def __init__(self, costs: BatchCosts, max_width: int, prior: Sequence[float] | None = None, *,
                 probe_every: int = PROBE_EVERY, alpha: float = EMA_ALPHA,
                 plain_steps: int = 1):  # fmt: skip
        self.costs, self.max_width = costs, max_width
        self.prior = list(prior) if prior else [PRIOR_RATE] * (max_width - 1)
        self.prior = (self.prior + [self.prior[-1] if self.prior else PRIOR_RATE] * max_width)[
            : max_width - 1
        ]
        self.rates: dict[Any, np.ndarray] = {}
        self.probe_every, self.alpha = probe_every, alpha
        self.plain_run, self.plain_steps = 0, max(1, plain_steps)
        self.history: list[int] = []

    def rates_of(self, key: Any) -> np.ndarray:
        """The per-position rates [L' - 1] of row ``key`` (the prior for a new row; updated in
        place by :meth:`observe`)."""
        got = self.rates.get(key)
        if got is None:
            got = self.rates[key] = np.array(self.prior, dtype=np.float64)
        return got

    def forget(self, key: Any) -> None:
        """Drop a finished row's rates."""
        self.rates.pop(key, None)

    def choose(self, keys: Sequence[Any], remaining: Sequence[int] | None = None,
               rows: int | None = None) -> int:  # fmt: skip
        """The width of the next step for the rows ``keys`` (``remaining``: their budgets).

        Args:
            rows: the rows bucket the step runs at (the engine's ``nb``: it covers the highest
                busy row, so it may exceed ``len(keys)``); None = ``len(keys)``. Its costs are
                those measured at the smallest measured bucket >= it.
        """
        table = {w: c for w, c in self.costs.at(max(rows or len(keys), 1)).items()
                 if w <= self.max_width}  # fmt: skip
        if not keys or len(table) == 1:
            width = 1
        else:
            rates = np.stack([self.rates_of(k) for k in keys])  # [R, L' - 1]
            width = choose_batch_width(table, rates, remaining)
        if width == 1 and keys and self.probe_every and len(table) > 1:
            # a probe re-measures rows whose rates fell; none where drafting would not pay even
            # at the prior's rates (the batch is compute-bound: the costs decide, not the rates)
            hopeful = np.maximum(rates, np.asarray(self.prior)[None])
            if choose_batch_width(table, hopeful, remaining) > 1:
                self.plain_run += self.plain_steps
            if self.plain_run >= self.probe_every:  # one drafted step: the best drafted width
                drafted = {w: c for w, c in table.items() if w > 1}
                width = choose_batch_width(drafted, rates, remaining) if drafted else 1
                width = width if width > 1 else max(drafted, default=1)
        if width > 1:
            self.plain_run = 0
        self.history.append(width)
        return width

    def observe(self, key: Any, accepted: int, proposed: int) -> None:
        """One row's step: ``accepted`` of ``proposed`` proposals matched (positions
        1..min(accepted + 1, proposed) reached, those <= accepted passed)."""
        rates = self.rates_of(key)
        n = min(accepted + 1, proposed, len(rates))
        if n > 0:
            hit = (np.arange(1, n + 1) <= accepted).astype(np.float64)
            rates[:n] += self.alpha * (hit - rates[:n])
