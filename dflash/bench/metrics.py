"""Benchmark records and the metrics computed from them; no backend, no device, no clock.

One :class:`ResponseRecord` is written per response (a prompt turn) as a JSONL line; every number
of the summary is recomputed from those lines alone, so a resumed run reports exactly what an
uninterrupted one would.

Conventions (brief §7.3): TPOT = decode seconds / tokens after the first one (TTFT excluded);
throughput = 1 / mean TPOT over responses; τ per verify step = tokens committed including the
bonus, 1..L. A step cut short by a stop token or by the token budget is counted as recorded: its
τ is what was committed, not what the draft and target agreed on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash.errors import DatasetError


@dataclass
class RunStats:
    """Timing and size of one generation (baseline or DFlash) of a response.

    Attributes:
        new_tokens: generated tokens, the first (prefill) token included.
        ttft_s: time to first token (prefill plus first sample), seconds.
        decode_s: wall time after the first token, seconds.
        finish_reason: "stop" or "length".
    """

    new_tokens: int
    ttft_s: float
    decode_s: float
    finish_reason: str = "length"

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first, None when nothing was decoded."""
        n = self.new_tokens - 1
        return self.decode_s / n if n > 0 and self.decode_s > 0 else None


@dataclass
class ResponseRecord:
    """Everything measured for one response; one line of ``--output`` JSONL.

    Attributes:
        dataset: dataset spec the prompt came from (e.g. ``gsm8k``).
        id: prompt id within the dataset.
        turn: 0-based turn index (MT-Bench has two turns).
        prompt_tokens: prompt length in tokens (chat template applied, earlier turns included).
        block_size: block size L of the DFlash run.
        dflash: stats of the DFlash run.
        baseline: stats of the block-size-1 run, None when no baseline ran.
        acceptance_lengths: per verify step of the DFlash run, tokens committed (bonus incl.), 1..L.
        proposed: per verify step, draft tokens proposed (L-1, fewer for a block cut by budget).
        parity: baseline and DFlash token ids identical; None when not checked.
        first_mismatch: first differing position (0-based, among new tokens) when parity failed.
        text: DFlash output text; the next MT-Bench turn is built from it when a run resumes.
        baseline_text: the baseline's output text (``--score`` scores both); None when no
            baseline ran, or in records written before it was kept.
        config: the run settings the record was made with (checked on ``--resume``).
        near_tie: for a parity mismatch, whether the first divergence is a near-tie of the
            target (see :func:`classify_divergence`); None when parity held or was not checked.
        tie_gap: at the divergence, the target's logit of the reference's token minus that of
            the token DFlash emitted there (logits); None alike.
        top2_gap: the reference run's top-1 minus top-2 logit at the divergence; None alike.
        reference: stats of the backend's own generator (mlx: ``mlx_lm.stream_generate``) on the
            same prompt, None when the backend has none.
        prompt_sha1: a fingerprint of the chat messages the prompt was made from (system
            message, earlier turns, this turn) and the reasoning switch
            (:func:`prompt_fingerprint`), compared on ``--resume`` so that prompts edited
            between runs are refused; None in records written before it. The messages, not the
            token ids: some chat templates print today's date.
    """

    dataset: str
    id: str
    turn: int
    prompt_tokens: int
    block_size: int
    dflash: RunStats
    baseline: RunStats | None = None
    acceptance_lengths: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    parity: bool | None = None
    first_mismatch: int | None = None
    text: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    near_tie: bool | None = None
    tie_gap: float | None = None
    top2_gap: float | None = None
    reference: RunStats | None = None
    prompt_sha1: str | None = None
    baseline_text: str | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        """Identity of the response across runs: (dataset, prompt id, turn)."""
        return (self.dataset, self.id, self.turn)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the JSONL line)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ResponseRecord:
        """Rebuild a record from its JSONL dict.

        Raises:
            DatasetError: a field is missing or has the wrong type.
        """
        try:
            values = dict(data)
            values["dflash"] = RunStats(**values["dflash"])
            for side in ("baseline", "reference"):
                if values.get(side) is not None:
                    values[side] = RunStats(**values[side])
            record = cls(**values)
            record.turn = int(record.turn)
            record.acceptance_lengths = [int(a) for a in record.acceptance_lengths]
            record.proposed = [int(p) for p in record.proposed]
        except (KeyError, TypeError, ValueError) as err:
            raise DatasetError(
                f"A results record is malformed ({err}): {str(data)[:80]}."
            ) from None
        return record


def prompt_fingerprint(messages: list[dict], reasoning: str | None) -> str:
    """First 16 hex digits of the SHA-1 of the chat ``messages`` (roles and contents, in order)
    and the ``--reasoning`` value, as sorted-key JSON."""
    text = json.dumps({"messages": messages, "reasoning": reasoning}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# throughput


def mean_tpot(records: list[ResponseRecord], side: str) -> float | None:
    """Mean seconds per output token over responses of one side ("baseline" or "dflash").

    Responses that decoded nothing after the first token are left out. None if none remain.
    """
    values = [s.tpot_s for r in records if (s := getattr(r, side)) is not None]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def throughput(records: list[ResponseRecord], side: str) -> float | None:
    """Decode throughput in tok/s as upstream reports it: 1 / mean per-response TPOT."""
    tpot = mean_tpot(records, side)
    return 1.0 / tpot if tpot else None


def speedup(records: list[ResponseRecord], side: str = "baseline") -> float | None:
    """Decoding speedup: mean ``side`` TPOT / mean DFlash TPOT (TTFT excluded on both sides)."""
    base, fast = mean_tpot(records, side), mean_tpot(records, "dflash")
    return base / fast if base and fast else None


def mean_ttft(records: list[ResponseRecord], side: str) -> float | None:
    """Mean time to first token of one side, seconds; None without records."""
    values = [s.ttft_s for r in records if (s := getattr(r, side)) is not None]
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------------------------------------
# acceptance


def mean_acceptance_length(records: list[ResponseRecord]) -> float | None:
    """τ as upstream reports it: mean over responses of each response's mean per-step τ.

    Responses without verify steps (e.g. one token generated) are left out; None if none remain.
    """
    means = [
        sum(r.acceptance_lengths) / len(r.acceptance_lengths)
        for r in records
        if r.acceptance_lengths
    ]
    return sum(means) / len(means) if means else None


def step_weighted_acceptance_length(records: list[ResponseRecord]) -> float | None:
    """τ pooled over verify steps: all committed tokens / all verify steps; None without steps."""
    steps = [a for r in records for a in r.acceptance_lengths]
    return sum(steps) / len(steps) if steps else None


def max_block_size(records: list[ResponseRecord]) -> int:
    """Largest block size among records (and among recorded τ values, for safety); 1 if none."""
    sizes = [r.block_size for r in records] + [a for r in records for a in r.acceptance_lengths]
    return max(sizes, default=1)


def acceptance_histogram(records: list[ResponseRecord], block_size: int | None = None) -> list[int]:
    """Counts of verify steps by acceptance length, pooled over all responses.

    Args:
        records: benchmark records.
        block_size: number of bins B; None uses :func:`max_block_size`.

    Returns:
        ``counts`` of length B where ``counts[b - 1]`` = number of steps with τ = b, b = 1..B.
    """
    size = block_size or max_block_size(records)
    counts = [0] * size
    for r in records:
        for a in r.acceptance_lengths:
            if not 1 <= a <= size:
                raise DatasetError(f"Acceptance length {a} of {r.id} is outside 1..{size}.")
            counts[a - 1] += 1
    return counts


def histogram_fractions(counts: list[int]) -> list[float]:
    """Counts turned into fractions of all steps (all zeros when there are no steps)."""
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def per_position_acceptance(
    records: list[ResponseRecord], block_size: int | None = None
) -> list[float | None]:
    """Conditional acceptance rate of each draft position, pooled over verify steps.

    For draft position k (1-based) the rate is P(position k accepted | positions < k accepted):
    the denominator counts steps that proposed at least k tokens and accepted at least k - 1 of
    them, the numerator those that accepted at least k. Accepted drafts of a step = τ - 1.

    Args:
        records: benchmark records (``proposed`` may be empty: then L - 1 is assumed per step).
        block_size: B; rates are returned for positions 1..B-1. None uses :func:`max_block_size`.

    Returns:
        ``rates[k - 1]`` for k = 1..B-1, None where no step reached position k.
    """
    size = block_size or max_block_size(records)
    reached = [0] * max(size - 1, 0)
    passed = [0] * max(size - 1, 0)
    for r in records:
        proposed = r.proposed or [r.block_size - 1] * len(r.acceptance_lengths)
        for a, p in zip(r.acceptance_lengths, proposed, strict=True):
            accepted = a - 1
            for k in range(1, min(p, size - 1) + 1):
                if accepted < k - 1:
                    break
                reached[k - 1] += 1
                passed[k - 1] += accepted >= k
    return [n / d if d else None for n, d in zip(passed, reached, strict=True)]


def mean_block_size(records: list[ResponseRecord]) -> float | None:
    """Mean verify width L (proposed + 1) over verify steps; differs from the block size under
    ``--block-size auto`` and where the budget cut the last block. None without steps."""
    steps = [p + 1 for r in records for p in r.proposed]
    return sum(steps) / len(steps) if steps else None


# ---------------------------------------------------------------------------------------------
# parity and the whole summary


# A mismatch is a near-tie when, in the reference (block-size-1) run, the token DFlash emitted
# at the first divergence is within this many logits of the reference's top token: a different
# kernel width (verify over L rows vs 1 row) legitimately reorders such tokens in low precision.
# bf16 has 8 significand bits: at |logit| ~ 16-32 one ulp is 0.125, and 30 layers of rounding
# move logits by a few ulps. Float32 ties are 1000x tighter.
NEAR_TIE_LOGIT_GAP = {"bfloat16": 0.5, "float16": 0.25, "float32": 0.01}
DEFAULT_NEAR_TIE_GAP = 0.5


def near_tie_threshold(dtype: str | None) -> float:
    """The documented near-tie threshold (logits) for a compute dtype name."""
    return NEAR_TIE_LOGIT_GAP.get(dtype or "", DEFAULT_NEAR_TIE_GAP)


def classify_divergence(
    ref_logits: Any, ref_token: int, other_token: int, threshold: float
) -> dict[str, Any]:
    """Classify the first divergence of a parity mismatch from the reference run's logits.

    Args:
        ref_logits: [V] logits of the reference (block-size-1) run at the divergence position.
        ref_token: the token the reference emitted there (its argmax).
        other_token: the token DFlash emitted there (None when DFlash stopped earlier).
        threshold: near-tie threshold in logits (:data:`NEAR_TIE_LOGIT_GAP`).

    Returns:
        {"near_tie": bool, "tie_gap": logit of ref_token - logit of other_token (None when
        None), "top2_gap": top-1 minus top-2 logit}. A near-tie needs both tokens within
        ``threshold`` logits of the replay's top logit; a replay whose top token is neither of
        the two (it diverged from the timed reference run) is not explained.
    """
    import numpy as np

    x = np.asarray(ref_logits, dtype=np.float64).reshape(-1)
    top = float(x[ref_token])
    two = np.partition(x, -2)[-2:]
    top2_gap = float(two[1] - two[0])
    if other_token is None:  # DFlash ended before the reference: nothing to tie with
        return {"near_tie": False, "tie_gap": None, "top2_gap": top2_gap}
    tie_gap = top - float(x[other_token])
    best = float(x.max())
    near = best - top <= threshold and best - float(x[other_token]) <= threshold
    return {"near_tie": bool(near), "tie_gap": tie_gap, "top2_gap": top2_gap}


def parity_summary(records: list[ResponseRecord]) -> dict[str, Any]:
    """Greedy-parity count: responses checked, matched, each mismatch with its position, and
    how many mismatches are near-ties of the target vs unexplained (not classified count as
    unexplained)."""
    checked = [r for r in records if r.parity is not None]
    bad = [r for r in checked if not r.parity]
    mismatches = [
        {"dataset": r.dataset, "id": r.id, "turn": r.turn, "first_mismatch": r.first_mismatch,
         "near_tie": r.near_tie, "tie_gap": r.tie_gap}
        for r in bad
    ]  # fmt: skip
    near = sum(1 for r in bad if r.near_tie)
    return {
        "checked": len(checked),
        "matched": len(checked) - len(mismatches),
        "near_tie": near,
        "unexplained": len(bad) - near,
        "mismatches": mismatches,
    }


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """First index where two token-id lists differ (a proper prefix differs at its end)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


LONG_PROMPT = 1024  # tokens: a summary with a prompt this long reports τ and speedup by length


def by_prompt_length(records: list[ResponseRecord]) -> list[dict[str, Any]]:
    """τ and speedup per prompt-length bucket (tokens: < 1k, 1k-2k, 2k-4k, ... doubling), the
    buckets that hold responses, shortest first: ``bucket``, ``responses``, ``prompt_tokens``
    (mean), ``tau`` (mean of responses), ``baseline_tok_s``, ``dflash_tok_s``, ``speedup``."""
    groups: dict[int, list[ResponseRecord]] = {}
    for r in records:
        low = 0 if r.prompt_tokens < 1024 else 1024 << max(0, (r.prompt_tokens // 1024).bit_length() - 1)
        groups.setdefault(low, []).append(r)

    def name(low: int) -> str:
        return "<1k" if low == 0 else f"{low // 1024}k-{2 * low // 1024}k"

    return [{"bucket": name(low), "responses": len(g),
             "prompt_tokens": sum(r.prompt_tokens for r in g) / len(g),
             "tau": mean_acceptance_length(g), "baseline_tok_s": throughput(g, "baseline"),
             "dflash_tok_s": throughput(g, "dflash"), "speedup": speedup(g)}
            for low, g in sorted(groups.items())]  # fmt: skip


def summarize(records: list[ResponseRecord]) -> dict[str, Any]:
    """All summary numbers of one dataset, JSON-ready; rates in 0..1, times in seconds.

    Records are sorted by key first, so the summary does not depend on completion order.
    """
    records = sorted(records, key=lambda r: r.key)
    size = max_block_size(records)
    counts = acceptance_histogram(records, size)
    extra: dict[str, Any] = {}
    if any(r.prompt_tokens >= LONG_PROMPT for r in records):
        extra["by_prompt_length"] = by_prompt_length(records)
    if any(r.reference is not None for r in records):  # mlx: mlx_lm.stream_generate
        extra |= {"reference_tok_s": throughput(records, "reference"),
                 "speedup_vs_reference": speedup(records, "reference"),
                 "reference_tokens": sum(r.reference.new_tokens for r in records if r.reference)}  # fmt: skip
    return {
        **extra,
        "responses": len(records),
        "prompts": len({(r.dataset, r.id) for r in records}),
        "block_size": size,
        "baseline_tok_s": throughput(records, "baseline"),
        "dflash_tok_s": throughput(records, "dflash"),
        "speedup": speedup(records),
        "tau_mean_of_responses": mean_acceptance_length(records),
        "tau_step_weighted": step_weighted_acceptance_length(records),
        "baseline_ttft_s": mean_ttft(records, "baseline"),
        "dflash_ttft_s": mean_ttft(records, "dflash"),
        "baseline_tokens": sum(r.baseline.new_tokens for r in records if r.baseline),
        "dflash_tokens": sum(r.dflash.new_tokens for r in records),
        "verify_steps": sum(counts),
        "histogram": counts,
        "histogram_fractions": histogram_fractions(counts),
        "per_position_acceptance": per_position_acceptance(records, size),
        "mean_block_size": mean_block_size(records),
        "parity": parity_summary(records),
    }
