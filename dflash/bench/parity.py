"""Explaining greedy-parity mismatches of ``--check-parity`` (issue: verifiable bf16 losslessness).

For a mismatch, the target is run untimed over the prompt plus the reference (block-size-1)
run's tokens up to the first divergence, and its logits there decide: a near-tie of the target
(both the reference's token and the one DFlash emitted lie within the dtype's threshold,
:func:`dflash.bench.metrics.near_tie_threshold`, of the top logit), or unexplained. Both counts are printed and stored per record in the JSONL.
"""

from __future__ import annotations

from typing import Any

from dflash.bench.metrics import ResponseRecord, classify_divergence, near_tie_threshold
from dflash.types import GenerationResult, SamplingParams


def reference_logits_at(pipeline: Any, prompt_ids: list[int], position: int,
                        reference_ids: list[int]) -> Any | None:  # fmt: skip
    """Logits [V] the target gives for new-token ``position`` after exactly the reference run's
    tokens before it, or None when the pipeline exposes no backend.

    Teacher-forced: one untimed prefill of ``prompt_ids + reference_ids[:position]``. Replaying
    the reference greedily instead could drift from the timed run (cache capacity and kernel
    widths change bf16 rounding) and then classify a different context. A prefill rounds
    differently from one-token decoding too, by far less than the near-tie threshold.
    """
    backend = getattr(pipeline, "backend", None)
    if backend is None:
        return None
    ids = list(prompt_ids) + list(reference_ids[:position])
    backend.reset(len(ids) + 1)
    logits, _ = backend.prefill(ids, False)
    return backend.to_numpy(logits)


def classify_mismatch(pipeline: Any, record: ResponseRecord, prompt_ids: list[int],
                      base: GenerationResult, fast: GenerationResult, sampling: SamplingParams,
                      dtype: str | None) -> None:  # fmt: skip
    """Fill ``record.near_tie``/``tie_gap``/``top2_gap`` for a parity mismatch (see
    :func:`dflash.bench.metrics.classify_divergence`; threshold from the run's dtype)."""
    m = record.first_mismatch
    if m is None or m >= len(base.token_ids):  # the reference stopped first: not a tie
        record.near_tie = False
        return
    logits = reference_logits_at(pipeline, prompt_ids, m, base.token_ids)
    if logits is None:
        return
    other = fast.token_ids[m] if m < len(fast.token_ids) else None
    threshold = near_tie_threshold(dtype)
    verdict = classify_divergence(logits, base.token_ids[m], other, threshold)
    record.near_tie, record.tie_gap = verdict["near_tie"], verdict["tie_gap"]
    record.top2_gap = verdict["top2_gap"]
