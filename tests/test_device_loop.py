"""The device loop (greedy acceptance and commit on the device, steps read one late) gives
exactly the host loop's tokens and per-step acceptance; run eagerly on CPU through the same glue
the CUDA graphs capture."""

from __future__ import annotations

import pytest
import torch

from dflash.backends.static_loop import DeviceLoop, device_loop_default
from dflash.backends.static_torch import StaticBackend
from dflash.loop import speculative_generate
from tests.conftest import make_draft
from tests.test_loop_scripted import PROMPT, greedy_reference


class ScriptedLoop(DeviceLoop):
    """Proposals = the greedy truth for the first ``k`` rows, a wrong token after (on device)."""

    def __init__(self, be, truth: list[int], prompt_len: int, k: int):
        super().__init__(be)
        self.truth = torch.tensor(truth + [0] * 32)
        self.prompt_len, self.k = prompt_len, k

    def proposals_hook(self, proposals):
        i0 = self.pos - self.prompt_len + 1  # [1] truth index of the token after the anchor
        scripted = self.truth[i0 + self.arange[: proposals.shape[0]]]
        wrong = (scripted + 1) % self.be.vocab_size
        return torch.where(self.arange[: proposals.shape[0]] < self.k, scripted, wrong)


def _pair(tiny_target, device_loop):
    return StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False,
                         device_loop=device_loop)  # fmt: skip


def _run(be, prompt, **kw):
    rounds = list(speculative_generate(be, prompt, **kw))
    return [t for r in rounds for t in r.tokens], [r.accepted for r in rounds[1:]], rounds


@pytest.fixture(scope="module")
def both(tiny_target):
    return _pair(tiny_target, False), _pair(tiny_target, True)


def test_default_is_off_without_graphs(tiny_target, monkeypatch):
    assert _pair(tiny_target, None).device_loop is None  # CPU: no graphs, host loop
    monkeypatch.setenv("DFLASH_DEVICE_LOOP", "0")
    assert not device_loop_default()
    monkeypatch.setenv("DFLASH_DEVICE_LOOP", "1")
    assert device_loop_default()


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("budget", [1, 2, 23, 40])
def test_same_tokens_and_steps_as_host_loop(both, tiny_target, block_size, budget):
    host, dev = both
    truth = greedy_reference(tiny_target, PROMPT, budget)
    for _ in range(2):  # a second request starts from fresh state
        a, acc_a, ra = _run(host, PROMPT, block_size=block_size, max_new_tokens=budget)
        b, acc_b, rb = _run(dev, PROMPT, block_size=block_size, max_new_tokens=budget)
        assert b == a == truth
        assert acc_b == acc_a
        assert [r.proposed for r in rb] == [r.proposed for r in ra]
        assert [r.finish_reason for r in rb] == [r.finish_reason for r in ra]


@pytest.mark.parametrize("k", [0, 5, 15])
def test_scripted_acceptance_counts(tiny_target, k):
    """k right proposals per step -> every full step commits exactly k + 1 tokens, the budget
    trims the last one, and the tokens are plain greedy decoding's."""
    budget = 50
    truth = greedy_reference(tiny_target, PROMPT, budget + 20)
    be = _pair(tiny_target, True)
    be.device_loop = ScriptedLoop(be, truth, len(PROMPT), k)
    toks, accepted, _ = _run(be, PROMPT, block_size=16, max_new_tokens=budget)
    assert toks == truth[:budget]
    full, last = divmod(budget - 1, k + 1)
    assert accepted == [k + 1] * full + ([last] if last else [])


def test_block_size_caps_acceptance(tiny_target):
    """--block-size 4 with a 16-wide draft: at most 3 proposals accepted per step."""
    truth = greedy_reference(tiny_target, PROMPT, 40)
    be = _pair(tiny_target, True)
    be.device_loop = ScriptedLoop(be, truth, len(PROMPT), 15)
    toks, accepted, _ = _run(be, PROMPT, block_size=4, max_new_tokens=40)
    assert toks == truth
    assert accepted == [4] * 9 + [3]


def test_stop_token_ends_mid_block(both, tiny_target):
    host, dev = both
    truth = greedy_reference(tiny_target, PROMPT, 30)
    stop = truth[11]
    first = truth.index(stop)
    for be in both:
        toks, _, rounds = _run(be, PROMPT, block_size=16, max_new_tokens=30, stop_ids=[stop])
        assert toks == truth[: first + 1]
        assert rounds[-1].finish_reason == "stop"
    # the next request is unaffected by the step launched past the stop
    assert _run(dev, PROMPT, block_size=16, max_new_tokens=30)[0] == truth


def test_sampling_and_auto_use_the_host_loop(both):
    """The device loop is greedy at a fixed block size only; sampling still runs (host loop)."""
    from dflash.types import SamplingParams

    _, dev = both
    launched = dev.device_loop.launched
    toks, _, _ = _run(dev, PROMPT, block_size=16, max_new_tokens=12,
                      sampling=SamplingParams(temperature=0.8, seed=3))  # fmt: skip
    assert len(toks) == 12 and dev.device_loop.launched == launched
