"""--check-parity: near-tie vs unexplained classification of the first divergence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.bench.metrics import (
    ResponseRecord,
    RunStats,
    classify_divergence,
    near_tie_threshold,
    parity_summary,
)
from dflash.types import GenerationResult


def test_classifier_on_synthetic_logits():
    logits = np.full(10, -5.0)
    logits[[3, 7, 1]] = [10.0, 9.8, 9.0]
    thr = near_tie_threshold("bfloat16")
    tie = classify_divergence(logits, 3, 7, thr)
    assert tie["near_tie"] and tie["tie_gap"] == pytest.approx(0.2)
    assert tie["top2_gap"] == pytest.approx(0.2)
    far = classify_divergence(logits, 3, 1, thr)  # third choice, 1.0 below: not a tie in bf16
    assert not far["near_tie"] and far["tie_gap"] == pytest.approx(1.0)
    assert far["top2_gap"] == pytest.approx(0.2)  # the top-2 gap alone would have excused it
    assert not classify_divergence(logits, 3, 7, near_tie_threshold("float32"))["near_tie"]
    assert classify_divergence(logits, 3, None, thr) == {
        "near_tie": False, "tie_gap": None, "top2_gap": pytest.approx(0.2)}  # fmt: skip


def _record(i, parity, near=None):
    return ResponseRecord(dataset="d", id=f"p{i}", turn=0, prompt_tokens=3, block_size=4,
                          dflash=RunStats(5, 0.1, 0.1), parity=parity,
                          first_mismatch=None if parity else 2, near_tie=near)  # fmt: skip


def test_summary_counts_near_ties_and_unexplained():
    recs = [_record(0, True), _record(1, False, True), _record(2, False, False),
            _record(3, False, True), _record(4, False, None)]  # fmt: skip
    s = parity_summary(recs)
    assert (s["checked"], s["matched"], s["near_tie"], s["unexplained"]) == (5, 1, 2, 2)
    again = ResponseRecord.from_dict(recs[1].to_dict())
    assert again.near_tie is True  # stored in (and read back from) the JSONL line


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_replayed_reference_logits_are_the_baselines(tiny_backend, tiny_target):
    """The classifier replays the block-1 run: its logits at the divergence equal a plain
    forward over prompt + reference prefix, and a second-choice token is a tie of exactly the
    top-2 gap."""
    from dflash.api import Pipeline
    from dflash.bench.parity import classify_mismatch
    from tests.helpers.tiny import PROMPT

    pipe = Pipeline(tiny_backend, _Tok(), stop_ids=[])
    base = pipe.generate(PROMPT, block_size=1, max_new_tokens=12)
    m = 7
    with torch.no_grad():
        ref = tiny_target(torch.tensor([PROMPT + base.token_ids[:m]])).logits[0, -1].numpy()
    second = int(np.argsort(-ref)[1])
    fast = GenerationResult(token_ids=base.token_ids[:m] + [second] + base.token_ids[m + 1 :],
                            text="", prompt_tokens=len(PROMPT))  # fmt: skip
    rec = _record(0, False)
    rec.first_mismatch = m
    classify_mismatch(pipe, rec, PROMPT, base, fast, base_sampling(), "float32")
    top2 = float(np.sort(ref)[-1] - np.sort(ref)[-2])
    assert rec.tie_gap == pytest.approx(top2, abs=1e-4) and rec.top2_gap == pytest.approx(top2, abs=1e-4)
    assert rec.near_tie == (top2 <= near_tie_threshold("float32"))
    assert pipe.backend is tiny_backend  # the recorder is removed again


def base_sampling():
    from dflash.types import SamplingParams

    return SamplingParams()


def test_a_replay_that_favours_the_other_token_strongly_is_not_a_near_tie():
    """If the replayed reference puts the DFlash token far above its own token (the replay did
    not reproduce the timed run), the mismatch is not explained: a negative gap is no tie."""
    logits = np.zeros(10)
    logits[3], logits[7] = 1.0, 9.75  # reference emitted 3, DFlash 7, replay prefers 7 by 8.75
    v = classify_divergence(logits, 3, 7, near_tie_threshold("bfloat16"))
    assert v["tie_gap"] == -8.75 and not v["near_tie"]
