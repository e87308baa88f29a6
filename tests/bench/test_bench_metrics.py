"""Metric functions of the benchmark on synthetic records with hand-computed answers."""

from __future__ import annotations

import random

import pytest

from dflash.bench.metrics import (
    ResponseRecord,
    RunStats,
    acceptance_histogram,
    first_mismatch,
    histogram_fractions,
    mean_acceptance_length,
    parity_summary,
    per_position_acceptance,
    speedup,
    step_weighted_acceptance_length,
    summarize,
    throughput,
)
from dflash.errors import DatasetError


def rec(rid, taus, proposed, fast, base, *, block=4, parity=None, mismatch=None, turn=0):
    """A record; ``fast``/``base`` are (new_tokens, ttft_s, decode_s[, finish_reason])."""
    return ResponseRecord(
        dataset="synthetic",
        id=rid,
        turn=turn,
        prompt_tokens=10,
        block_size=block,
        dflash=RunStats(*fast),
        baseline=RunStats(*base) if base else None,
        acceptance_lengths=list(taus),
        proposed=list(proposed),
        parity=parity,
        first_mismatch=mismatch,
    )


@pytest.fixture
def records():
    # r1: three full blocks (L=4, 3 proposals each), τ = 4, 2, 1 -> 1 + 7 = 8 new tokens.
    #     DFlash TPOT 0.7 / 7 = 0.1 s, baseline TPOT 2.1 / 7 = 0.3 s.
    # r2: the second step ends at EOS: τ = 2 is what was committed (counted as recorded).
    #     1 + 5 = 6 tokens; DFlash TPOT 0.25 / 5 = 0.05 s, baseline 1.0 / 5 = 0.2 s.
    # r3: stopped on the prefill token: no verify step, no decode time -> left out of means.
    return [
        rec("r1", [4, 2, 1], [3, 3, 3], (8, 0.1, 0.7), (8, 0.1, 2.1), parity=True),
        rec("r2", [3, 2], [3, 3], (6, 0.2, 0.25, "stop"), (6, 0.2, 1.0, "stop"), parity=True),
        rec("r3", [], [], (1, 0.3, 0.0, "stop"), (1, 0.3, 0.0, "stop"), parity=True),
    ]


def test_throughput_and_speedup_are_per_response_tpot_means(records):
    # mean DFlash TPOT (0.1 + 0.05) / 2 = 0.075 s; baseline (0.3 + 0.2) / 2 = 0.25 s.
    assert throughput(records, "dflash") == pytest.approx(1 / 0.075)
    assert throughput(records, "baseline") == pytest.approx(4.0)
    assert speedup(records) == pytest.approx(0.25 / 0.075)


def test_tau_mean_of_response_means_and_step_weighted(records):
    # per-response means 7/3 and 5/2 (r3 has no steps); pooled 12 tokens / 5 steps.
    assert mean_acceptance_length(records) == pytest.approx((7 / 3 + 5 / 2) / 2)
    assert step_weighted_acceptance_length(records) == pytest.approx(12 / 5)
    assert mean_acceptance_length(records[2:]) is None
    assert step_weighted_acceptance_length([]) is None


def test_histogram_bins_one_to_block_size(records):
    # τ values 4, 2, 1, 3, 2 over bins 1..4.
    counts = acceptance_histogram(records)
    assert counts == [1, 2, 1, 1]
    assert histogram_fractions(counts) == pytest.approx([0.2, 0.4, 0.2, 0.2])
    assert acceptance_histogram(records, 6) == [1, 2, 1, 1, 0, 0]
    assert histogram_fractions([0, 0]) == [0.0, 0.0]
    with pytest.raises(DatasetError):
        acceptance_histogram(records, 3)  # τ = 4 does not fit in 1..3


def test_per_position_rates_count_the_eos_step_as_recorded(records):
    # accepted drafts per step (τ - 1): 3, 1, 0, 2, 1 (r2's EOS step: 1, its position 2 a miss)
    # k=1: 5 steps reach it, 4 accept -> 0.8
    # k=2: 4 steps had position 1 accepted (3, 1, 2, 1), 2 accept position 2 -> 0.5
    # k=3: 2 steps reach it (3, 2), 1 accepts -> 0.5
    assert per_position_acceptance(records) == pytest.approx([0.8, 0.5, 0.5])


def test_per_position_rates_skip_positions_a_budget_cut_block_did_not_propose():
    # the last block shrank to anchor + 1 proposal, which was accepted (τ = 2 with 1 proposal):
    # it reaches position 1 only, so it is no miss at position 2.
    r = rec("cut", [4, 2], [3, 1], (7, 0.1, 0.6), None)
    assert per_position_acceptance([r]) == pytest.approx([1.0, 1.0, 1.0])
    never = rec("never", [1], [3], (2, 0.1, 0.1), None)
    assert per_position_acceptance([never]) == [0.0, None, None]


def test_parity_summary_and_first_mismatch():
    ok = rec("a", [2], [3], (3, 0.1, 0.1), (3, 0.1, 0.2), parity=True)
    bad = rec("b", [1], [3], (2, 0.1, 0.1), (2, 0.1, 0.2), parity=False, mismatch=1, turn=1)
    unchecked = rec("c", [1], [3], (2, 0.1, 0.1), (2, 0.1, 0.2))
    summary = parity_summary([ok, bad, unchecked])
    assert summary["checked"] == 2 and summary["matched"] == 1
    assert summary["mismatches"] == [
        {"dataset": "synthetic", "id": "b", "turn": 1, "first_mismatch": 1,
         "near_tie": None, "tie_gap": None}
    ]  # fmt: skip
    assert summary["near_tie"] == 0 and summary["unexplained"] == 1
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def test_summary_is_independent_of_record_order_and_survives_json(records):
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    again = [ResponseRecord.from_dict(r.to_dict()) for r in shuffled]
    assert summarize(again) == summarize(records)
    s = summarize(records)
    assert s["responses"] == 3 and s["verify_steps"] == 5 and s["block_size"] == 4
    assert s["dflash_tokens"] == 15 and s["baseline_tokens"] == 15
    assert s["dflash_ttft_s"] == pytest.approx(0.2)
    assert s["parity"]["matched"] == 3


def test_malformed_record_is_a_dataset_error():
    with pytest.raises(DatasetError):
        ResponseRecord.from_dict({"dataset": "x", "id": "1"})
