"""The device loop (greedy acceptance and commit on the device, steps read one late) gives
exactly the host loop's tokens and per-step acceptance; run eagerly on CPU through the same glue
the CUDA graphs capture."""

from __future__ import annotations

import pytest
import torch

from dflash.backends.static.backend import StaticBackend
from dflash.backends.static.device_loop import DeviceLoop
from dflash.loop import speculative_generate
from tests.helpers.tiny import PROMPT, greedy_reference, make_draft

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread (tests/conftest.py)


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


def _pair(tiny_target, device_loop, settings=None):
    return StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False,
                         device_loop=device_loop, settings=settings)  # fmt: skip


def _run(be, prompt, **kw):
    rounds = list(speculative_generate(be, prompt, **kw))
    return [t for r in rounds for t in r.tokens], [r.accepted for r in rounds[1:]], rounds


@pytest.fixture(scope="module")
def both(tiny_target):
    return _pair(tiny_target, False), _pair(tiny_target, True)


def test_default_is_off_without_graphs(tiny_target):
    from dflash.kernels.settings import KernelSettings

    assert _pair(tiny_target, None).device_loop is None  # CPU: no graphs, host loop
    assert KernelSettings().device_loop  # on with CUDA graphs unless the setting says 0
    assert not KernelSettings.resolve(environ={"DFLASH_DEVICE_LOOP": "0"}).device_loop


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


def _commit_case(seed: int, width: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(width, 4, generator=g)  # 4 ids: long accepted runs are common
    state = dict(props=torch.randint(0, 4, (15,), generator=g), tok=torch.tensor([3]),
                 pos=torch.tensor([40]), n=torch.tensor([7]),
                 budget=torch.randint(5, 30, (1,), generator=g), lim=torch.tensor([width - 1]),
                 last=torch.zeros(17, dtype=torch.long), arange=torch.arange(17))  # fmt: skip
    return logits, state


@pytest.mark.parametrize("width", [1, 16])
def test_commit_glue_is_greedy_acceptance(width):
    """The device loop's commit equals accept_greedy trimmed to the budget, on 50 random steps
    (budgets below, at and above the tokens committed so far)."""
    from dflash.accept import accept_greedy
    from dflash.backends.static.device_loop import commit

    for seed in range(50):
        logits, s = _commit_case(seed, width)
        before = {k: v.clone() for k, v in s.items()}
        commit(logits, **s)
        target = logits.argmax(-1).tolist()
        a, bonus = accept_greedy(before["props"][: width - 1].tolist(), target)
        left = int(before["budget"] - before["n"])
        a = min(a, max(left - 1, 0))
        new = (before["props"][:a].tolist() + [target[a]]) if left > 0 else []
        assert s["last"][0].item() == len(new) and s["last"][1 : 1 + len(new)].tolist() == new
        assert s["n"].item() == 7 + len(new) and s["pos"].item() == 40 + len(new)
        assert s["tok"].item() == (new[-1] if new else 3)


@pytest.mark.slow
def test_compiled_glue_equals_eager():
    """What the CUDA graphs run with --compile (Inductor; here its CPU backend): the same state
    after every step as the eager glue."""
    from dflash.backends.static.device_loop import commit, draft_inputs, verify_inputs

    try:
        compiled = torch.compile(commit, dynamic=False)
        compiled(*_commit_case(0, 1)[:1], **_commit_case(0, 1)[1])
    except Exception as e:  # noqa: BLE001 - no C++ compiler for Inductor's CPU backend
        pytest.skip(f"torch.compile unavailable here: {type(e).__name__}")
    for seed in range(20):
        width = (1, 16)[seed % 2]
        logits, s = _commit_case(seed, width)
        s2 = {k: v.clone() for k, v in s.items()}
        commit(logits, **s)
        compiled(logits, **s2)
        for key in s:
            assert torch.equal(s[key], s2[key]), (seed, key)
    tok, pos, arange = torch.tensor([5]), torch.tensor([9]), torch.arange(17)
    props, masks = torch.arange(100, 115), torch.full((15,), 7)
    for fn, args in ((verify_inputs, (tok, props, pos, arange, 16)), (draft_inputs, (tok, masks, pos, arange))):
        for x, y in zip(fn(*args), torch.compile(fn, dynamic=False)(*args), strict=True):
            assert torch.equal(x, y)
    from dflash.backends.static.fused import row_argmax  # its two-pass path (V >= 256), compiled

    fast = torch.compile(row_argmax, dynamic=False)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randint(0, 5, (16, 1024), generator=g).to(dtype)  # tied maxima in most rows
        assert torch.equal(fast(x), x.argmax(-1))


def _scripted_steps(k: int, budget: int, stop_at: int | None) -> list[int]:
    """Tokens each step commits when k proposals per step are right: k + 1, trimmed by the
    budget and cut after the stop token at new-token index ``stop_at``."""
    steps, n = [], 1  # the first token came from the prefill
    while n < budget and (stop_at is None or n <= stop_at):
        c = min(k + 1, budget - n)
        if stop_at is not None and n <= stop_at < n + c:
            c = stop_at - n + 1
        steps.append(c)
        n += c
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("ahead", ["draft", "step"])
@pytest.mark.parametrize("budget", [2, 3, 23, 40])
def test_queue_ahead_same_tokens_and_exact_waste(tiny_target, ahead, budget):
    """The queue_ahead setting draft (default) and step: with k = 5 right proposals per step (a verify
    reading another step's proposals would accept other counts) every step commits exactly what
    plain greedy decoding dictates, budget and stop token included, and so does the next
    request. A request launches one verify per step it reads plus, under ``step``, at most one
    more; under ``draft`` no extra verify and at most one extra draft."""
    from dflash.kernels.settings import KernelSettings

    settings = KernelSettings.resolve(environ={"DFLASH_QUEUE_AHEAD": ahead})
    k = 5
    truth = greedy_reference(tiny_target, PROMPT, budget + 40)
    stop = truth[11]
    for stops in ([], [stop]):
        be = _pair(tiny_target, True, settings)
        be.device_loop = lp = ScriptedLoop(be, truth, len(PROMPT), k)
        assert lp.ahead == ahead
        toks, accepted, _ = _run(be, PROMPT, block_size=16, max_new_tokens=budget, stop_ids=stops)
        stop_at = truth.index(stop) if stops and truth.index(stop) < budget else None
        assert toks == truth[: budget if stop_at is None else stop_at + 1]
        assert accepted == _scripted_steps(k, budget, stop_at)
        steps = len(accepted)
        if ahead == "draft":
            assert lp.launched == steps and lp.drafted in (steps, steps + 1)
        else:
            assert lp.launched in (steps, steps + 1) and lp.drafted == lp.launched
        toks, accepted, _ = _run(be, PROMPT, block_size=16, max_new_tokens=30)  # the next request
        assert toks == truth[:30] and accepted == _scripted_steps(k, 30, None)
