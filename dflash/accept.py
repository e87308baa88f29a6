"""The acceptance rule of speculative decoding: the one definition, backend-free (numpy).

Every implementation on a device - :class:`dflash.sampling_torch.TorchSampler` (its candidate
variant :func:`dflash.sampling_torch.accept_candidates` too), the device
loop's commit (:func:`dflash.backends.static.device_loop.commit`), the host loop on MLX arrays - returns
exactly what these functions return for the same inputs (tests/core/test_accept_equivalence.py).

Greedy (paper §4 / brief §3.3): keep the longest prefix of draft proposals equal to the target's
argmax, then the target's argmax after it as the bonus token (:func:`accept_greedy`). A step's
verify width is the block size trimmed to the budget (:func:`verify_width`); its tokens end
after the first stop token among them (:func:`commit_tokens`); :func:`greedy_step` is the whole
greedy step.

Sampling: the lossless rule of Leviathan et al. (2023) / Chen et al. (2023): accept proposal d_i
when u_i * q_i(d_i) < p_i(d_i) (probability min(1, p/q)); on the first rejection draw the bonus
from the residual norm(max(p_i - q_i, 0)); when everything is accepted draw the bonus from the
target's next-position distribution (:func:`accept_sampling`, and
:func:`accept_sampling_candidates` for a draft that samples among k candidates, DFlash2).

Uniforms: the sampling rules take their uniforms in [0, 1) from ``rng``, either a numpy
``Generator`` (anything with ``random()``), drawn lazily: one per proposal tested, in order, up
to and including the first rejection, then one for the bonus; or :class:`Uniforms`, fixed
values: proposal i is tested with ``accept[i]`` and the bonus drawn with ``bonus``, so the
outcome is a deterministic function of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

# ------------------------------------------------------------------------------ greedy


def accept_greedy(proposals: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, int]:
    """Greedy acceptance.

    Args:
        proposals: the L-1 draft tokens d_0..d_{L-2}.
        target_argmax: L target argmax ids; row i is the target's choice after
            [anchor, d_0 .. d_{i-1}].

    Returns:
        (a, bonus): a = number of leading proposals equal to the target's choice
        (0..L-1); bonus = target_argmax[a]. The step commits a + 1 tokens.
    """
    a = 0
    while a < len(proposals) and proposals[a] == target_argmax[a]:
        a += 1
    return a, int(target_argmax[a])


def verify_width(block_size: int, generated: int, max_new_tokens: int) -> int:
    """L of the next step: the block size trimmed to the budget, so a step never verifies more
    proposals than the budget can take (it commits at most L tokens, bonus included).

    Args:
        block_size: the step's block size (verify width incl. the anchor, >= 1).
        generated: tokens generated so far (the token after prefill included).
        max_new_tokens: the request's budget (> generated).
    """
    return min(block_size, max_new_tokens - generated)


def commit_tokens(new: list[int], stops: set[int] | frozenset[int], generated: int,
                  max_new_tokens: int) -> tuple[list[int], int, str | None]:  # fmt: skip
    """What a step commits: its tokens cut after the first stop token among them.

    Args:
        new: the step's tokens (accepted proposals + bonus, or the token after prefill).
        stops: token ids that end generation (the stop token itself is emitted); only the
            step's own tokens are looked at.
        generated: tokens generated before this step.
        max_new_tokens: the request's budget.

    Returns:
        (tokens, generated + len(tokens), finish reason "stop" / "length" / None).
    """
    for i, tok in enumerate(new):
        if tok in stops:
            return new[: i + 1], generated + i + 1, "stop"
    generated += len(new)
    return new, generated, ("length" if generated >= max_new_tokens else None)


class GreedyStep(NamedTuple):
    """One greedy verify step's outcome (see :func:`greedy_step`)."""

    tokens: list[int]  # committed tokens, cut after a stop token
    accepted: int  # proposals accepted before the stop cut (0..proposed)
    proposed: int  # proposals verified: the trimmed width - 1
    generated: int  # tokens generated after this step
    finish: str | None  # "stop", "length" or None


def greedy_step(proposals: Sequence[int], target_argmax: Sequence[int], *, block_size: int,
                generated: int, max_new_tokens: int,
                stops: set[int] | frozenset[int] = frozenset()) -> GreedyStep:  # fmt: skip
    """The whole greedy step: width trimmed to the budget, acceptance, bonus, stop cut.

    Args:
        proposals: the draft's proposals, at least ``verify_width(...) - 1`` of them (a draft
            runs at its trained width; only the first L-1 are verified).
        target_argmax: the target's argmax ids of the rows [anchor, proposals...], at least L
            (row i depends on the tokens before it only, so extra rows change nothing).
        block_size: the step's block size (verify width incl. the anchor).
        generated: tokens generated so far; ``max_new_tokens``: the budget. A step with no
            budget left commits nothing.
        stops: stop token ids.
    """
    width = verify_width(block_size, generated, max_new_tokens)
    if width < 1:
        return GreedyStep([], 0, 0, generated, "length")
    a, bonus = accept_greedy(list(proposals[: width - 1]), list(target_argmax[:width]))
    tokens, n, finish = commit_tokens(list(proposals[:a]) + [bonus], stops, generated,
                                      max_new_tokens)  # fmt: skip
    return GreedyStep(tokens, a, width - 1, n, finish)


# ------------------------------------------------------------------------------ sampling


class Uniforms(NamedTuple):
    """Fixed uniforms in [0, 1) for the sampling rules: ``accept`` [n] (proposal i is tested
    with ``accept[i]``), ``bonus`` for the bonus draw."""

    accept: Sequence[float]
    bonus: float


def draw(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw of one token id from probs [V] (float, total > 0) with the uniform u in
    [0, 1): the first id whose cumulative mass exceeds u * total."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(probs) - 1))


def sample(probs: np.ndarray, rng) -> int:
    """Draw one token id from probs [V] (float, sums to 1) with one uniform of ``rng`` (anything
    with ``random()``, e.g. a numpy Generator)."""
    return draw(probs, rng.random())


def accept_sampling(proposals: Sequence[int], p_target: np.ndarray, q_draft: np.ndarray | None,
                    rng) -> tuple[int, int]:  # fmt: skip
    """Lossless rejection sampling over one block.

    Args:
        proposals: the n = L-1 draft tokens.
        p_target: [L, V] processed target probabilities; row i follows [anchor, d_0..d_{i-1}].
        q_draft: [L-1, V] the draft distributions the proposals were drawn from, or None when
            the proposals are deterministic (argmax): q is then one-hot at each proposal, so a
            proposal is accepted with probability p_target(d) and the residual is p_target
            with d removed (still exact; brief §3.5 note on PR #169).
        rng: the uniforms, a numpy Generator or :class:`Uniforms` (see the module docstring).

    Returns:
        (a, bonus): accepted proposal count and the bonus token; the emitted tokens
        d_0..d_{a-1}, bonus are distributed exactly as sequential target sampling.
    """
    if q_draft is None:
        def q_at(i: int, d: int) -> float:
            return 1.0

        def residual(i: int, d: int) -> np.ndarray:
            r = p_target[i].copy()
            r[d] = 0.0
            return r
    else:
        def q_at(i: int, d: int) -> float:
            return float(q_draft[i, d])

        def residual(i: int, d: int) -> np.ndarray:
            return np.maximum(p_target[i] - q_draft[i], 0.0)
    return _reject(proposals, p_target, q_at, residual, rng)


def accept_sampling_candidates(
    proposals: Sequence[int],
    p_target: np.ndarray,
    candidates: np.ndarray,
    q_draft: np.ndarray,
    rng,
) -> tuple[int, int]:
    """Lossless rejection sampling for a draft that samples among k candidates (DFlash2, §3.5).

    The draft distribution of position i is q_draft[i] over the ids candidates[i] (zero elsewhere);
    a repeated id counts with the sum of its slots. Same rule as :func:`accept_sampling` with
    that sparse q: accept d_i with probability min(1, p(d_i) / q_i(d_i)); on rejection draw the
    bonus from norm(max(p - q, 0)), q subtracted at the candidate ids only.

    Args:
        proposals: the L-1 draft tokens (each one of its position's candidates).
        p_target: [L, V] processed target probabilities.
        candidates: [L-1, k] candidate ids per position.
        q_draft: [L-1, k] the draft's probabilities of those candidates (rows sum to 1).
        rng: the uniforms, a numpy Generator or :class:`Uniforms`.

    Returns:
        (a, bonus) as :func:`accept_sampling`.
    """

    def q_at(i: int, d: int) -> float:
        return float(q_draft[i][candidates[i] == d].sum())

    def residual(i: int, d: int) -> np.ndarray:
        r = p_target[i].copy()
        np.subtract.at(r, candidates[i], q_draft[i])  # scatter: repeated ids subtract twice
        return np.maximum(r, 0.0)

    return _reject(proposals, p_target, q_at, residual, rng)


def _reject(proposals: Sequence[int], p_target: np.ndarray, q_at: Callable[[int, int], float],
            residual: Callable[[int, int], np.ndarray], rng) -> tuple[int, int]:  # fmt: skip
    """The rejection loop shared by both rules: q_at(i, d) = q_i(d); residual(i, d) [V] =
    max(p_i - q_i, 0) (unnormalised); on a residual without mass the bonus falls back to p_i
    (brief §3.5).

    Raises:
        ValueError: fixed :class:`Uniforms` with fewer accept values than proposals.
    """
    if isinstance(rng, Uniforms) and len(rng.accept) < len(proposals):
        raise ValueError(f"{len(proposals)} proposals need as many uniforms, got {len(rng.accept)}")
    tests, bonus_u = _uniforms(rng)
    for i, d in enumerate(proposals):
        if next(tests) * q_at(i, d) < p_target[i][d]:
            continue
        r = residual(i, d)
        total = r.sum()
        return i, draw(r / total if total > 0 else p_target[i], bonus_u())
    a = len(proposals)
    return a, draw(p_target[a], bonus_u())


def _uniforms(rng) -> tuple[Iterator[float], Callable[[], float]]:
    """(the accept tests' uniforms, the bonus uniform) of ``rng`` (see the module docstring)."""
    if isinstance(rng, Uniforms):
        return iter(rng.accept), lambda: rng.bonus
    return iter(rng.random, None), rng.random
