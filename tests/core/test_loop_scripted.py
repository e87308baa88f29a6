"""Loop semantics with a scripted draft on a tiny random target: parity and exact statistics."""

from __future__ import annotations

import pytest
import torch

from dflash.loop import speculative_generate
from dflash.types import SamplingParams
from tests.helpers.tiny import PROMPT, ScriptedBackend

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread (tests/conftest.py)


@pytest.mark.parametrize("schedule", [[15, 0, 7, 14, 3], [0], [15], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_scripted_schedule_parity_and_stats(tiny_backend, truth, schedule):
    be = ScriptedBackend(tiny_backend, truth, len(PROMPT), schedule)
    rounds = list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=100))
    tokens = [t for r in rounds for t in r.tokens]
    assert tokens == truth[:100]
    steps = [r for r in rounds if r.accepted is not None]
    drafted = [r for r in steps if r.proposed > 0]
    assert len(drafted) == len(be.expected_k)
    ks = iter(be.expected_k)
    n = 1
    for r in steps:
        remaining = 100 - n
        k = next(ks) if r.proposed > 0 else 0  # a 1-wide last step has no draft
        assert r.accepted == min(k + 1, remaining), (r.accepted, k, remaining)
        assert r.accepted == len(r.tokens)
        n += r.accepted
    assert n == 100 and rounds[-1].finish_reason == "length"


@pytest.mark.parametrize("max_new", [1, 2, 5, 15, 16, 17])
def test_exact_budget_with_full_acceptance(tiny_backend, truth, max_new):
    be = ScriptedBackend(tiny_backend, truth, len(PROMPT), [15])
    rounds = list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=max_new))
    tokens = [t for r in rounds for t in r.tokens]
    assert len(tokens) == max_new and tokens == truth[:max_new]
    assert rounds[-1].finish_reason == "length"


def test_eos_fourth_token_inside_a_block(tiny_backend, truth):
    stop = truth[3]
    assert stop not in truth[:3], "pick a prompt whose 4th greedy token is new"
    be = ScriptedBackend(tiny_backend, truth, len(PROMPT), [15])
    rounds = list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=64, stop_ids=[stop]))
    tokens = [t for r in rounds for t in r.tokens]
    assert tokens == truth[:4]
    assert rounds[-1].finish_reason == "stop"
    assert [r.accepted for r in rounds] == [None, 3]
    assert rounds[1].accepted == len(rounds[1].tokens)  # the stop ends the step; τ counts to it


def test_eos_as_first_token_ends_at_once(tiny_backend, truth):
    rounds = list(speculative_generate(tiny_backend, PROMPT, block_size=16, max_new_tokens=64,
                                       stop_ids=[truth[0]]))  # fmt: skip
    assert [r.tokens for r in rounds] == [[truth[0]]] and rounds[0].finish_reason == "stop"


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_random_draft_parity(tiny_backend, truth, block_size):
    """The (random, untrained) draft itself: output equals greedy for any block size."""
    rounds = list(speculative_generate(tiny_backend, PROMPT, block_size=block_size, max_new_tokens=40))
    assert [t for r in rounds for t in r.tokens] == truth[:40]
    if block_size == 1:
        assert all(r.accepted in (None, 1) and r.proposed == 0 for r in rounds)


def test_mask_token_output_is_kept(tiny_target, truth):
    """A generated token equal to the mask id stays in the output (positional, never filtered)."""
    from dflash.backends.plain import TransformersBackend
    from tests.helpers.tiny import make_draft

    mask = truth[2]
    be = TransformersBackend(tiny_target, make_draft(tiny_target, mask_token_id=mask), torch.device("cpu"))
    tokens = [t for r in speculative_generate(be, PROMPT, block_size=8, max_new_tokens=20) for t in r.tokens]
    assert tokens == truth[:20] and mask in tokens


def test_sampling_is_seeded_and_block_size_independent_in_distribution(tiny_backend):
    """Same seed -> same sample; temperature > 0 runs through rejection sampling."""
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3)
    a = [t for r in speculative_generate(tiny_backend, PROMPT, block_size=8, max_new_tokens=30, sampling=sp) for t in r.tokens]
    b = [t for r in speculative_generate(tiny_backend, PROMPT, block_size=8, max_new_tokens=30, sampling=sp) for t in r.tokens]
    assert a == b and len(a) == 30
