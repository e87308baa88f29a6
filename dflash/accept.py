"""Acceptance rules of speculative decoding, backend-free (brief §3.4-§3.5).

Greedy: keep the longest prefix of draft proposals equal to the target's argmax, then the
target's argmax after it as the bonus token. Sampling: the lossless rule of Leviathan et al.
(2023) / Chen et al. (2023): accept proposal d_i with probability min(1, p_target/q_draft);
on the first rejection draw the bonus from the residual norm(max(p_target - q_draft, 0)); when
everything is accepted draw the bonus from the target's next-position distribution.
"""

from __future__ import annotations

import numpy as np

from dflash.sampling import sample


def accept_greedy(proposals: list[int], target_argmax: list[int]) -> tuple[int, int]:
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


def accept_sampling(
    proposals: list[int],
    p_target: np.ndarray,
    q_draft: np.ndarray | None,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Lossless rejection sampling over one block.

    Args:
        proposals: the L-1 draft tokens.
        p_target: [L, V] processed target probabilities; row i follows [anchor, d_0..d_{i-1}].
        q_draft: [L-1, V] the draft distributions the proposals were drawn from, or None when
            the proposals are deterministic (argmax): q is then one-hot at each proposal, so a
            proposal is accepted with probability p_target(d) and the residual is p_target
            with d removed (still exact; brief §3.5 note on PR #169).
        rng: numpy generator used for the uniform draws and the bonus sample.

    Returns:
        (a, bonus): accepted proposal count and the bonus token; the emitted tokens
        d_0..d_{a-1}, bonus are distributed exactly as sequential target sampling.
    """
    for i, d in enumerate(proposals):
        p = p_target[i]
        q_d = 1.0 if q_draft is None else float(q_draft[i, d])
        if rng.random() * q_d < p[d]:
            continue
        if q_draft is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q_draft[i], 0.0)
        return i, _sample_residual(residual, p, rng)
    a = len(proposals)
    return a, sample(p_target[a], rng)


def accept_sampling_candidates(
    proposals: list[int],
    p_target: np.ndarray,
    candidates: np.ndarray,
    q_draft: np.ndarray,
    rng: np.random.Generator,
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
        rng: numpy generator for the uniform draws and the bonus sample.

    Returns:
        (a, bonus) as :func:`accept_sampling`.
    """
    for i, d in enumerate(proposals):
        p = p_target[i]
        q_d = float(q_draft[i][candidates[i] == d].sum())
        if rng.random() * q_d < p[d]:
            continue
        residual = p.copy()
        np.subtract.at(residual, candidates[i], q_draft[i])  # scatter: repeated ids subtract twice
        return i, _sample_residual(np.maximum(residual, 0.0), p, rng)
    a = len(proposals)
    return a, sample(p_target[a], rng)


def _sample_residual(residual: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw from the normalised residual; fall back to p when it has no mass (brief §3.5)."""
    total = residual.sum()
    return sample(residual / total if total > 0 else p, rng)
