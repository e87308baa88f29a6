"""Explaining greedy-parity mismatches of ``--check-parity`` (issue: verifiable bf16 losslessness).

For a mismatch, the reference (block-size-1) run is replayed untimed up to the first divergence
and its logits there decide: a near-tie of the target (the token DFlash emitted is within
:data:`dflash.bench.metrics.NEAR_TIE_LOGIT_GAP` logits of the reference's top token), or
unexplained. Both counts are printed and stored per record in the JSONL.
"""

from __future__ import annotations

from typing import Any

from dflash.bench.metrics import ResponseRecord, classify_divergence, near_tie_threshold
from dflash.types import GenerationResult, SamplingParams


def reference_logits_at(pipeline: Any, prompt_ids: list[int], position: int,
                        sampling: SamplingParams, budget: int | None = None) -> Any | None:  # fmt: skip
    """Logits [V] of the reference (block-size-1) run at new-token ``position``, or None when
    the pipeline exposes no backend.

    Re-runs the baseline (untimed, deterministic: same kernels and widths as the timed run) with
    the timed run's token ``budget`` (static caches are sized from it, and a different capacity
    changes the attention reductions' rounding), stopping after ``position + 1`` tokens, with a
    recorder that keeps a copy of the last logits it saw.
    """
    backend = getattr(pipeline, "backend", None)
    if backend is None:
        return None
    seen: dict[str, Any] = {}

    class Recorder:
        def __getattr__(self, name):
            return getattr(backend, name)

        def prefill(self, *args):
            logits, feats = backend.prefill(*args)
            seen["logits"] = getattr(logits, "clone", lambda: logits)()
            return logits, feats

        def verify(self, *args):
            logits, feats = backend.verify(*args)
            seen["logits"] = getattr(logits[0], "clone", lambda: logits[0])()
            return logits, feats

    pipeline.backend = Recorder()
    try:
        made = 0
        for step in pipeline.stream(prompt_ids, block_size=1, sampling=sampling, stop_ids=[],
                                    max_new_tokens=max(budget or 0, position + 1)):  # fmt: skip
            made += len(step.tokens)
            if made >= position + 1:
                break
    finally:
        pipeline.backend = backend
    return backend.to_numpy(seen["logits"]) if "logits" in seen else None


def classify_mismatch(pipeline: Any, record: ResponseRecord, prompt_ids: list[int],
                      base: GenerationResult, fast: GenerationResult, sampling: SamplingParams,
                      dtype: str | None, budget: int | None = None) -> None:  # fmt: skip
    """Fill ``record.near_tie``/``tie_gap``/``top2_gap`` for a parity mismatch (see
    :func:`dflash.bench.metrics.classify_divergence`; threshold from the run's dtype; ``budget``:
    the timed runs' max_new_tokens, so the replay sizes its caches the same way)."""
    m = record.first_mismatch
    if m is None or m >= len(base.token_ids):  # the reference stopped first: not a tie
        record.near_tie = False
        return
    logits = reference_logits_at(pipeline, prompt_ids, m, sampling, budget)
    if logits is None:
        return
    other = fast.token_ids[m] if m < len(fast.token_ids) else None
    threshold = near_tie_threshold(dtype)
    verdict = classify_divergence(logits, base.token_ids[m], other, threshold)
    record.near_tie, record.tie_gap = verdict["near_tie"], verdict["tie_gap"]
    record.top2_gap = verdict["top2_gap"]
