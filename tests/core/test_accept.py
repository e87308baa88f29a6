"""Acceptance rules: greedy prefix and lossless rejection sampling (statistical checks).

With 100k draws over V=8 the empirical TV distance of a correct sampler is about 0.003; the
bound 0.01 is > 3 standard deviations away, and seeds are fixed, so a failure is a real bug.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash.accept import accept_greedy, accept_sampling
from dflash.sampling import sample, sampling_probs
from dflash.types import SamplingParams
from tests.helpers.stats import tv

N = 100_000
PARAMS = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)



@pytest.mark.parametrize(
    "proposals,target,expected",
    [([1, 2, 3], [1, 2, 3, 4], (3, 4)), ([1, 2, 3], [1, 9, 3, 4], (1, 9)),
     ([5], [6, 7], (0, 6)), ([], [8], (0, 8))],
)  # fmt: skip
def test_accept_greedy(proposals, target, expected):
    assert accept_greedy(proposals, target) == expected


def test_sampling_probs_transform():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    # top-3 keeps {0.5, 0.3, 0.15}; renormalised masses before each: 0, .526, .842 -> keep 2
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = sampling_probs(logits, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(p, [0.5, 0.3, 0.15, 0.05])
    p = sampling_probs(logits, SamplingParams(temperature=0.5, top_p=0.01))
    np.testing.assert_allclose(p, [1, 0, 0, 0])  # the top token is always kept


@pytest.fixture(scope="module")
def dists():
    rng = np.random.default_rng(0)
    target_logits = rng.normal(0, 1.5, size=(3, 8))
    draft_logits = target_logits + rng.normal(0, 1.0, size=(3, 8))  # related but different
    return sampling_probs(target_logits, PARAMS), sampling_probs(draft_logits, PARAMS)


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_matches_target(dists, one_hot):
    p_target, q_full = dists
    rng = np.random.default_rng(1 + one_hot)
    first = np.zeros(8)
    after_reject = np.zeros(8)  # the token emitted at position 1 after position 0 was accepted
    accepted0 = 0
    for _ in range(N):
        if one_hot:
            props = [int(np.argmax(q_full[0])), int(np.argmax(q_full[1]))]
            q = None
        else:
            props = [sample(q_full[0], rng), sample(q_full[1], rng)]
            q = q_full[:2]
        a, bonus = accept_sampling(props, p_target, q, rng)
        emitted = props[:a] + [bonus]
        first[emitted[0]] += 1
        if a >= 1:
            accepted0 += 1
            after_reject[emitted[1]] += 1
    assert tv(first, p_target[0]) < 0.01
    assert tv(after_reject, p_target[1]) < 0.01
    q0 = np.eye(8)[np.argmax(q_full[0])] if one_hot else q_full[0]
    expected_rate = np.minimum(p_target[0], q0).sum()
    assert abs(accepted0 / N - expected_rate) < 0.01


def test_rejection_identical_and_disjoint():
    rng = np.random.default_rng(2)
    p = np.array([[0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    same = sum(accept_sampling([sample(p[0], rng)], p, p[:1], rng)[0] for _ in range(2000))
    assert same == 2000  # q == p: always accepted
    q = np.array([[0, 0, 0.5, 0.5]])
    counts = np.zeros(4)
    for _ in range(20000):
        a, bonus = accept_sampling([sample(q[0], rng)], p, q, rng)
        assert a == 0
        counts[bonus] += 1
    assert tv(counts, p[0]) < 0.02
