"""Sampling on the device (torch): the same transform as the numpy reference and exact
rejection sampling (statistical bounds as in tests/core/test_accept.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.sampling import sampling_probs
from dflash.sampling_torch import TorchSampler, sampling_probs_torch
from dflash.types import SamplingParams
from tests.helpers.stats import tv

PARAMS = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, seed=5)
N = 10_000  # E[TV] about 0.005 over the 3-token support; bounds are 4x that



@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.5, top_k=7),
                                    SamplingParams(temperature=1.3, top_p=0.6),
                                    SamplingParams(temperature=0.8, top_k=20, top_p=0.9)])  # fmt: skip
def test_transform_matches_numpy_reference(params):
    logits = np.random.default_rng(0).normal(0, 2.0, size=(5, 300)).astype(np.float32)
    ref = sampling_probs(logits, params)
    got = sampling_probs_torch(torch.from_numpy(logits), params).double().numpy()
    np.testing.assert_allclose(got, ref, atol=1e-6)
    assert ((got > 0) == (ref > 0)).all()  # the same support


def test_rejection_sampling_on_device_matches_target():
    """Proposals at the draft argmax (q one-hot): the first emitted token follows p_0 and the
    token after an accepted d_0 follows p_1; acceptance rate of d_0 is p_0(d_0)."""
    g = np.random.default_rng(0)
    logits = torch.from_numpy(g.normal(0, 1.5, size=(3, 8)))
    p = sampling_probs(logits.numpy(), PARAMS)
    props = torch.tensor([int(np.argsort(-p[0])[1]), int(np.argmax(p[1]))])  # d_0 not the mode
    sampler = TorchSampler(PARAMS, torch.device("cpu"))
    first, second, accepted0 = np.zeros(8), np.zeros(8), 0
    for _ in range(N):
        a, bonus, listed = sampler.accept(props, logits)
        assert listed == props.tolist()
        emitted = listed[:a] + [bonus]
        first[emitted[0]] += 1
        if a >= 1:
            accepted0 += 1
            second[emitted[1]] += 1
    assert tv(first, p[0]) < 0.02
    assert tv(second, p[1]) < 0.02
    assert abs(accepted0 / N - p[0][props[0]]) < 0.02


def test_seeded_and_no_proposals():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    a = [TorchSampler(PARAMS, torch.device("cpu")).accept(None, logits) for _ in range(3)]
    assert a[0] == a[1] == a[2] and a[0][0] == 0 and a[0][2] == []
    s1, s2 = TorchSampler(PARAMS, torch.device("cpu")), TorchSampler(PARAMS, torch.device("cpu"))
    assert [s1.first(logits[0]) for _ in range(20)] == [s2.first(logits[0]) for _ in range(20)]
