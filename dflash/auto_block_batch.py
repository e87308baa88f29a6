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

from dflash.auto_block import EMA_ALPHA, PRIOR_RATE, PROBE_EVERY, expected_tau


def batch_rate(costs: Mapping[int, float], rates: Sequence[Sequence[float]], length: int,
               remaining: Sequence[int] | None = None) -> float:  # fmt: skip
    """Expected tokens per second of a width-``length`` step: Σ_r τ_r(min(L, m_r)) / c(L).

    Args:
        costs: width -> seconds of one step at this batch's rows bucket.
        rates: per row, per-position acceptance p_1 .. p_{L'-1}.
        length: L.
        remaining: per row, tokens of budget left (None: unbounded).
    """
    left = remaining if remaining is not None else [length] * len(rates)
    tokens = sum(
        expected_tau(list(r), min(length, max(m, 1))) for r, m in zip(rates, left, strict=True)
    )
    return tokens / costs[length]


def choose_batch_width(costs: Mapping[int, float], rates: Sequence[Sequence[float]],
                       remaining: Sequence[int] | None = None) -> int:  # fmt: skip
    """The width among ``costs``' keys (1 always allowed) maximising :func:`batch_rate`; ties
    (within 1e-9 relative) go to the smaller width. No rows: 1."""
    if not rates:
        return 1
    best, best_rate = 1, batch_rate(costs, rates, 1, remaining) if 1 in costs else 0.0
    for w in sorted(costs):
        if w == 1:
            continue
        rate = batch_rate(costs, rates, w, remaining)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = w, rate
    return best


@dataclass
class BatchCosts:
    """Seconds of one batched step by rows bucket and width: ``table[nb][L]``; a batch of B rows
    is priced at the smallest measured bucket >= B (the largest if none)."""

    table: dict[int, dict[int, float]] = field(default_factory=dict)

    def at(self, rows: int) -> dict[int, float]:
        """The width -> seconds table of the bucket that runs ``rows`` rows."""
        keys = sorted(self.table)
        return self.table[next((k for k in keys if k >= rows), keys[-1])]

    @classmethod
    def measure(cls, engine: Any, buckets: Sequence[int], widths: Sequence[int], *, context: int = 256,
                repeats: int = 5) -> BatchCosts:  # fmt: skip
        """Time ``engine.time_step(nb, L, context)`` (median of ``repeats``) for every bucket
        and width (a :class:`~dflash.backends.static.batched_spec.BatchedSpec`)."""
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
    """

    def __init__(self, costs: BatchCosts, max_width: int, prior: Sequence[float] | None = None, *,
                 probe_every: int = PROBE_EVERY, alpha: float = EMA_ALPHA):  # fmt: skip
        self.costs, self.max_width = costs, max_width
        self.prior = list(prior) if prior else [PRIOR_RATE] * (max_width - 1)
        self.prior = (self.prior + [self.prior[-1] if self.prior else PRIOR_RATE] * max_width)[
            : max_width - 1
        ]
        self.rates: dict[Any, list[float]] = {}
        self.probe_every, self.alpha = probe_every, alpha
        self.plain_run = 0
        self.history: list[int] = []

    def rates_of(self, key: Any) -> list[float]:
        """The per-position rates of row ``key`` (the prior for a new row)."""
        return self.rates.setdefault(key, list(self.prior))

    def forget(self, key: Any) -> None:
        """Drop a finished row's rates."""
        self.rates.pop(key, None)

    def choose(self, keys: Sequence[Any], remaining: Sequence[int] | None = None) -> int:
        """The width of the next step for the rows ``keys`` (``remaining``: their budgets)."""
        table = {w: c for w, c in self.costs.at(max(len(keys), 1)).items() if w <= self.max_width}
        rates = [self.rates_of(k) for k in keys]
        width = choose_batch_width(table, rates, remaining)
        if width == 1 and self.probe_every and len(table) > 1:
            # a probe re-measures rows whose rates fell; none where drafting would not pay even
            # at the prior's rates (the batch is compute-bound: the costs decide, not the rates)
            hopeful = [[max(a, b) for a, b in zip(r, self.prior, strict=True)] for r in rates]
            if choose_batch_width(table, hopeful, remaining) > 1:
                self.plain_run += 1
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
        for k in range(1, min(accepted + 1, proposed, len(rates)) + 1):
            rates[k - 1] += self.alpha * ((1.0 if accepted >= k else 0.0) - rates[k - 1])
