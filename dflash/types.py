"""Plain dataclasses shared by the loop, the backends, the CLI and the benchmark harness.

Shapes use the project letters: L block size (anchor + L-1 proposals), V vocabulary,
F target-feature width (= len(target_layer_ids) x target hidden size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from dflash.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings applied identically to the target and the draft (brief §3.6).

    Attributes:
        temperature: 0 means greedy (argmax); > 0 enables lossless rejection sampling.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: nucleus mass in (0, 1]; 1.0 disables.
        seed: seed of the sampling RNG (None: nondeterministic).

    Raises:
        InputError: temperature negative or not finite, top_k < 0, top_p outside (0, 1],
            or a seed outside [0, 2^63).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.temperature < float("inf")):
            raise InputError(f"--temperature must be a finite number >= 0, got {self.temperature}.",
                             hint="0 decodes greedily; 0.6-1.0 samples")  # fmt: skip
        if self.top_k < 0:
            raise InputError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}.", hint="e.g. --top-k 50, or 0")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"--top-p must be in (0, 1], got {self.top_p}.", hint="e.g. --top-p 0.95; 1 disables it")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InputError(f"--seed must be an integer in [0, 2^63), got {self.seed}.")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0


class TokenLogprob(NamedTuple):
    """A committed token's log-probability under the target (natural log) and the ``top`` most
    likely tokens of the same distribution as (id, log-probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RoundResult:
    """What one step of the loop commits: the first token after prefill, then one verify step.

    Attributes:
        tokens: token ids committed in this step (1 for the prefill token, 1..L for a verify step).
        accepted: acceptance length τ of this verify step: the tokens it commits, bonus included,
            so always len(tokens) (1..L); a stop token inside the block ends the step there and
            the tokens after it are neither committed nor counted; the last block of a budget is
            narrowed to fit instead of cut. None for the token sampled after prefill.
        proposed: draft tokens proposed in this step (L-1, 0 for block size 1 and for prefill).
        finish_reason: None while running, "stop" after a stop token, "length" at the budget.
        logprobs: one :class:`TokenLogprob` per token when the generation was asked for them.
    """

    tokens: list[int]
    accepted: int | None
    proposed: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    """One finished generation with its statistics.

    Attributes:
        token_ids: new token ids (prompt excluded), at most max_new_tokens of them.
        text: the new tokens decoded with special tokens skipped.
        prompt_tokens: prompt length in tokens.
        acceptance_lengths: per verify step, tokens committed including the bonus (τ values, 1..L).
        proposed: per verify step, number of draft tokens proposed (L-1 for a full block).
        ttft_s: time to first token (prefill plus first sample), seconds.
        decode_s: wall time after the first token until the end, seconds.
        finish_reason: "stop" or "length".
        block_size: block size L used (1 = plain autoregressive decoding) or "auto".
        truncated_mid_character: the budget ended inside a multi-byte character; its bytes are
            kept out of ``text`` (``token_ids`` still hold every token).
        block_policy: under "auto", the policy's summary: step costs (ms), acceptance source
            and each step's chosen L with predicted τ and cost (``BlockPolicy.summary``).
    """

    token_ids: list[int]
    text: str
    prompt_tokens: int
    acceptance_lengths: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = "length"
    block_size: int | str = 1
    truncated_mid_character: bool = False
    block_policy: dict | None = None

    @property
    def num_new_tokens(self) -> int:
        """Number of generated tokens (the prefill token included)."""
        return len(self.token_ids)

    @property
    def verify_steps(self) -> int:
        """Number of target verify forwards after prefill."""
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float | None:
        """Mean τ over verify steps (bonus included), None when no step ran."""
        if not self.acceptance_lengths:
            return None
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @property
    def decode_tok_per_s(self) -> float | None:
        """Decode throughput in tok/s: tokens after the first one over decode time."""
        n = len(self.token_ids) - 1
        if n <= 0 or self.decode_s <= 0:
            return None
        return n / self.decode_s
