"""The batch width chooser: the analytic optimum of Σ τ_r(L) / c_B(L) on synthetic cost and
acceptance tables, plain decoding where verifying B x L tokens does not pay, per-row learning."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash.auto_block import expected_tau
from dflash.auto_block_batch import (
    BatchCosts,
    BatchPolicy,
    batch_rate,
    batch_tokens,
    choose_batch_width,
    row_taus,
)

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)


def costs_at(
    rows: int, launch: float = 1.0, per_token: float = 0.004, draft: float = 0.3
) -> dict[int, float]:
    """A synthetic step cost (ms): fixed launch time, then compute-bound in the B x L tokens
    verified, plus a draft forward (flat in L: the draft runs at its trained width)."""
    return {
        w: launch + per_token * rows * w + (draft * (1 + 0.01 * rows) if w > 1 else 0.0)
        for w in WIDTHS
    }


def tau(p: float, length: int) -> float:
    """Closed form of 1 + p + ... + p^(L-1) (constant per-position acceptance p)."""
    return float(length) if p == 1 else (1 - p**length) / (1 - p)


def optimum(costs: dict[int, float], ps: list[float], remaining=None) -> int:
    """argmax_L Σ_r τ(p_r, min(L, m_r)) / c(L), smallest L on ties, in closed form."""
    left = remaining or [10**9] * len(ps)
    rate = {
        w: sum(tau(p, min(w, m)) for p, m in zip(ps, left, strict=True)) / c
        for w, c in costs.items()
    }
    top = max(rate.values())
    return min(w for w, r in rate.items() if r >= top * (1 - 1e-9))


@pytest.mark.parametrize("rows", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("p", [0.0, 0.3, 0.6, 0.8, 0.9, 0.97])
def test_picks_the_analytic_optimum(rows, p):
    costs = costs_at(rows)
    ps = [p] * rows
    got = choose_batch_width(costs, [[p] * 15] * rows)
    assert got == optimum(costs, ps)
    assert batch_rate(costs, [[p] * 15] * rows, got) >= batch_rate(
        costs, [[p] * 15] * rows, 1
    )  # never below plain


def test_mixed_rows_budgets_and_extremes():
    for rows, (a, b) in itertools.product([2, 8, 32], [(0.9, 0.1), (0.7, 0.5), (0.95, 0.0)]):
        ps = [a, b] * (rows // 2)
        costs = costs_at(rows)
        assert choose_batch_width(costs, [[p] * 15 for p in ps]) == optimum(costs, ps)
        rem = [1 + (i % 5) for i in range(rows)]  # budgets trim each row's width
        assert choose_batch_width(costs, [[p] * 15 for p in ps], rem) == optimum(costs, ps, rem)
    flat = {w: 1.0 for w in WIDTHS}
    assert choose_batch_width(flat, [[1.0] * 15] * 3) == 16  # free verify, perfect draft: widest
    assert choose_batch_width(flat, [[0.0] * 15] * 3) == 1  # nothing accepted: tie -> plain
    assert (
        choose_batch_width(costs_at(512, per_token=0.05), [[0.8] * 15] * 512) == 1
    )  # compute-bound
    assert choose_batch_width(costs_at(1), [[0.8] * 15]) > 1
    assert choose_batch_width(costs_at(4), []) == 1


def test_costs_bucket_and_policy_learning():
    costs = BatchCosts({4: costs_at(4), 16: costs_at(16), 64: costs_at(64)})
    assert (
        costs.at(3) == costs.at(4) and costs.at(5) == costs.at(16) and costs.at(64) == costs.at(64)
    )
    with pytest.raises(ValueError, match="no step costs measured for 65 rows"):
        costs.at(65)  # nothing extrapolated past the largest measured bucket
    pol = BatchPolicy(costs, 16, [0.9] * 15, probe_every=5)
    assert pol.choose(["a", "b"]) == optimum(costs.at(2), [0.9, 0.9])
    # priced at the bucket the step runs at (it covers the highest busy row), not at len(keys)
    assert pol.choose(["a", "b"], rows=64) == optimum(costs.at(64), [0.9, 0.9])
    assert optimum(costs.at(64), [0.9, 0.9]) != optimum(costs.at(2), [0.9, 0.9])
    for _ in range(40):  # row "b" rejects everything: its rates fall, row "a" keeps 0.9
        pol.observe("b", 0, 15)
    assert pol.rates_of("b")[0] < 0.01 and pol.rates_of("b")[5] == 0.9  # positions not reached kept
    pol.forget("b")
    assert list(pol.rates_of("b")) == [0.9] * 15
    bad = BatchPolicy(BatchCosts({1: costs_at(1)}), 16, [0.9] * 15, probe_every=5)
    for _ in range(60):  # the row's draft turned out useless: plain steps, a probe every 5
        bad.observe(0, 0, 15)
    widths = [bad.choose([0]) for _ in range(12)]
    assert widths[:4] == [1] * 4 and widths[4] > 1 and widths[9] > 1  # a probe every 5 plain steps
    assert sum(w > 1 for w in widths) == 2
    multi = BatchPolicy(BatchCosts({1: costs_at(1)}), 16, [0.9] * 15, probe_every=8, plain_steps=4)
    for _ in range(60):  # a width-1 choice runs 4 plain steps: a probe after 2 of them
        multi.observe(0, 0, 15)
    assert [multi.choose([0]) > 1 for _ in range(6)] == [False, True] * 3
    # compute-bound: drafting would not pay even at the prior's rates, so no probe ever
    busy = BatchPolicy(
        BatchCosts({512: costs_at(512, per_token=0.05)}), 16, [0.8] * 15, probe_every=5
    )
    assert [busy.choose(list(range(512))) for _ in range(12)] == [1] * 12


def test_vectorised_taus_equal_the_scalar_rule():
    """row_taus / batch_tokens (numpy, every row at once) equal expected_tau row by row, with
    per-position rates that differ and budgets that trim the width."""
    rng = np.random.default_rng(0)
    rates = rng.random((9, 15))
    taus = row_taus(rates, 16)
    for r in range(9):
        for j in range(1, 17):
            assert taus[r, j - 1] == pytest.approx(expected_tau(list(rates[r]), j), rel=1e-12)
    rem = [1, 2, 3, 5, 8, 13, 21, 34, 100]
    widths = [1, 2, 4, 8, 16]
    want = [sum(expected_tau(list(rates[r]), min(w, rem[r])) for r in range(9)) for w in widths]
    np.testing.assert_allclose(batch_tokens(rates, widths, rem), want, rtol=1e-12)


def test_policy_chooses_fast_at_high_concurrency():
    """The chooser runs before every step: 256 rows x 5 widths in well under a millisecond of
    numpy (the per-row Python loop it replaced took ~8 ms here), so picking costs no step time."""
    import time

    pol = BatchPolicy(BatchCosts({256: costs_at(256)}), 16, [0.7] * 15)
    keys, rem = list(range(256)), [100] * 256
    pol.choose(keys, rem)
    t0 = time.perf_counter()
    for _ in range(20):
        pol.choose(keys, rem)
    assert (time.perf_counter() - t0) / 20 < 2e-3
