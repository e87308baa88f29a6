"""Every implementation of the acceptance rule returns exactly what :mod:`dflash.accept` returns.

Randomized (seeded) property tests over the same inputs: the torch sampler's device ops
(:func:`dflash.sampling_torch.accept_one_hot`) with fixed uniforms, the device loop's commit
(:func:`dflash.backends.static.device_loop.commit`, on CPU tensors) and the host loop driving MLX arrays
(and torch arrays), over random proposals, target argmaxes with ties, probability tables, stop
tokens inside a block, budget trims, block sizes 1..16 and the DFlash2 candidate restriction.

Probability tables are dyadic (multiples of 1/64, rows summing to exactly 1) and uniforms are
multiples of 2**-16, so float32 and float64 arithmetic is exact on both sides and equality is
exact, not approximate.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.accept import (
    Uniforms,
    accept_greedy,
    accept_sampling,
    accept_sampling_candidates,
    commit_tokens,
    draw,
    greedy_step,
    verify_width,
)
from dflash.backends.base import SelectorProposal
from dflash.backends.static.device_loop import commit
from dflash.loop import speculative_generate
from dflash.sampling import sampling_probs
from dflash.sampling_torch import (
    TorchSampler,
    accept_candidates,
    accept_one_hot,
    sampling_probs_torch,
)
from dflash.types import SamplingParams

DRAFT_WIDTH = 16  # the draft's trained block size: proposals come 15 at a time


def dyadic_table(rng, rows: int, vocab: int) -> np.ndarray:
    """[rows, V] probabilities, multiples of 1/64 summing to exactly 1, with zeros and some
    one-hot rows."""
    out = np.zeros((rows, vocab))
    for r in range(rows):
        if rng.random() < 0.15:
            out[r, rng.integers(vocab)] = 1.0
            continue
        support = rng.choice(vocab, size=int(rng.integers(1, vocab + 1)), replace=False)
        out[r, support] = rng.multinomial(64, np.full(len(support), 1 / len(support))) / 64
    return out


def uniforms(rng, n: int) -> list[float]:
    return [float(k) / 2**16 for k in rng.integers(0, 2**16, n)]


def propose(rng, target: list[int], n: int, vocab: int) -> list[int]:
    """n proposals: the target's ids for a random prefix, random ids after (some right anyway)."""
    k = int(rng.integers(0, n + 1))
    return [int(t) for t in target[:k]] + [int(x) for x in rng.integers(0, vocab, n - k)]


# ------------------------------------------------------------------------- the rule itself


@pytest.mark.parametrize(
    "props,target,block,n,budget,stops,expected",
    [([1, 2, 3], [1, 2, 3, 4], 4, 1, 99, (), ([1, 2, 3, 4], 3, 3, 5, None)),
     ([1, 2, 3], [1, 2, 3, 4], 4, 1, 3, (), ([1, 2], 1, 1, 3, "length")),  # budget trims
     ([1, 2, 3], [1, 2, 3, 4], 4, 1, 99, (2,), ([1, 2], 3, 3, 3, "stop")),  # stop inside
     ([1, 2, 3], [1, 9, 3, 4], 4, 1, 99, (4,), ([1, 9], 1, 3, 3, None)),  # stop not reached
     ([1, 2, 3], [1, 2, 3, 4], 2, 5, 99, (), ([1, 2], 1, 1, 7, None)),  # block caps a
     ([5], [6, 7], 1, 0, 10, (), ([6], 0, 0, 1, None)),  # block 1: no proposal verified
     ([5], [6, 7], 4, 10, 10, (), ([], 0, 0, 10, "length"))],  # no budget left: nothing
)  # fmt: skip
def test_greedy_step(props, target, block, n, budget, stops, expected):
    got = greedy_step(props, target, block_size=block, generated=n, max_new_tokens=budget,
                      stops=set(stops))  # fmt: skip
    assert tuple(got) == expected


def test_fixed_uniforms_decide_the_outcome():
    p = np.array([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5], [0.0, 0.0, 1.0]])
    assert accept_sampling([1, 2], p, None, Uniforms([0.4, 0.49], 0.0)) == (2, 2)
    assert accept_sampling([1, 2], p, None, Uniforms([0.4, 0.5], 0.99)) == (1, 1)  # u == p: no
    assert accept_sampling([1, 2], p, None, Uniforms([0.5, 0.0], 0.99)) == (0, 0)  # only id 0
    with pytest.raises(ValueError, match="2 proposals need as many uniforms"):
        accept_sampling([1, 2], p, None, Uniforms([0.1], 0.0))


def test_generator_draws_lazily():
    """A numpy Generator gives the same outcome as fixed uniforms holding its draws: one per
    proposal tested up to the first rejection, then the bonus."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, vocab = int(rng.integers(0, 8)), int(rng.integers(2, 9))
        p, props = dyadic_table(rng, n + 1, vocab), [int(x) for x in rng.integers(0, vocab, n)]
        seed = int(rng.integers(1 << 30))
        a, bonus = accept_sampling(props, p, None, np.random.default_rng(seed))
        u = np.random.default_rng(seed).random(a + 2 if a < n else n + 1).tolist()
        assert accept_sampling(props, p, None, Uniforms(u[: a + 1] + [0] * n, u[-1])) == (a, bonus)


# ------------------------------------------------------------------------- torch sampler


def fixed_draw(u: float):
    """A torch draw from weights w (not normalised) with the fixed uniform u, as accept.py draws:
    inverse CDF over w / sum(w)."""

    def run(w: torch.Tensor) -> torch.Tensor:
        x = w.double().numpy()
        return torch.tensor([draw(x / x.sum(), u)])

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_sampler_ops_equal_accept_sampling(dtype):
    """accept_one_hot (TorchSampler's device ops) == accept_sampling with q one-hot, for the
    same probability table and uniforms: 600 random blocks of 0..15 proposals."""
    rng = np.random.default_rng(1)
    for _ in range(600):
        n, vocab = int(rng.integers(0, 16)), int(rng.integers(2, 40))
        p = dyadic_table(rng, n + 1, vocab)
        target = p.argmax(-1).tolist()
        props = propose(rng, target, n, vocab)
        u, u_bonus = uniforms(rng, n), float(rng.integers(0, 2**16)) / 2**16
        if n and rng.random() < 0.2:
            u[0] = float(p[0, props[0]]) if p[0, props[0]] < 1 else u[0]  # u == p: a rejection
        want = accept_sampling(props, p, None, Uniforms(u, u_bonus))
        u_t = torch.tensor(u, dtype=dtype) if n else None
        a, bonus = accept_one_hot(torch.tensor(props, dtype=torch.long),
                                  torch.tensor(p, dtype=dtype), u_t, fixed_draw(u_bonus))  # fmt: skip
        assert (int(a), int(bonus.item())) == want, (props, p, u, u_bonus)


def test_torch_sampler_runs_those_ops():
    """TorchSampler.accept is accept_one_hot on its processed probabilities with the uniforms its
    generator draws: the accepted count equals accept.py's for those uniforms, and the bonus
    has mass where accept.py would draw it."""
    params = SamplingParams(temperature=0.9, top_k=6, seed=11)
    rng = np.random.default_rng(2)
    sampler = TorchSampler(params, torch.device("cpu"))
    for _ in range(200):
        n, vocab = int(rng.integers(0, 16)), int(rng.integers(2, 12))
        logits = torch.from_numpy(rng.normal(0, 1.5, size=(n + 1, vocab)).astype(np.float32))
        p = sampling_probs_torch(logits, params)
        props = propose(rng, p.argmax(-1).tolist(), n, vocab)
        state = sampler.gen.get_state()
        a, bonus, listed = sampler.accept(torch.tensor(props) if n else None, logits)
        assert listed == props
        replay = torch.Generator().set_state(state)
        u = torch.rand(n, generator=replay, dtype=p.dtype).tolist() if n else []
        pd = p.double().numpy()
        assert accept_sampling(props, pd, None, Uniforms(u, 0.0))[0] == a
        assert pd[a, bonus] > 0 and (a == n or bonus != props[a])  # residual: p_a minus d_a


# ------------------------------------------------------------------------- DFlash2 candidates


def test_candidate_restriction_equals_dense_rule():
    """accept_sampling_candidates == accept_sampling with q densified (repeated ids summed), and
    with one candidate of mass 1 == the one-hot rule (q_draft None), for fixed uniforms."""
    rng = np.random.default_rng(3)
    for _ in range(600):
        n, vocab, k = int(rng.integers(0, 16)), int(rng.integers(2, 30)), int(rng.integers(1, 5))
        p = dyadic_table(rng, n + 1, vocab)
        cand = rng.integers(0, vocab, (n, k))
        q = dyadic_table(rng, n, k) if k > 1 else np.ones((n, 1))
        props = [int(cand[i, rng.integers(k)]) for i in range(n)]
        if n:  # some proposals the target would pick anyway
            hit = rng.random(n) < 0.5
            cand[hit, 0] = p[:n].argmax(-1)[hit]
            props = [int(cand[i, 0]) if hit[i] else props[i] for i in range(n)]
        dense = np.zeros((n, vocab))
        for i in range(n):
            np.add.at(dense[i], cand[i], q[i])
        fixed = Uniforms(uniforms(rng, n), float(rng.integers(0, 2**16)) / 2**16)
        got = accept_sampling_candidates(props, p, cand, q, fixed)
        assert got == accept_sampling(props, p, dense, fixed)
        if k == 1:
            assert got == accept_sampling(props, p, None, fixed)


def test_torch_candidate_ops_equal_accept_sampling_candidates():
    """accept_candidates (TorchSampler's device ops for DFlash2 proposals) ==
    accept_sampling_candidates for the same fixed uniforms: repeated candidate ids, proposals
    outside the target's support, residuals without mass."""
    rng = np.random.default_rng(4)
    for _ in range(600):
        n, vocab, k = int(rng.integers(1, 16)), int(rng.integers(2, 30)), int(rng.integers(1, 5))
        p = dyadic_table(rng, n + 1, vocab)
        cand = rng.integers(0, vocab, (n, k))
        q = dyadic_table(rng, n, k) if k > 1 else np.ones((n, 1))
        hit = rng.random(n) < 0.5  # some proposals the target would pick anyway
        cand[hit, 0] = p[:n].argmax(-1)[hit]
        props = [int(cand[i, 0]) if hit[i] else int(cand[i, rng.integers(k)]) for i in range(n)]
        u, u_bonus = uniforms(rng, n), float(rng.integers(0, 2**16)) / 2**16
        want = accept_sampling_candidates(props, p, cand, q, Uniforms(u, u_bonus))
        a, bonus = accept_candidates(torch.tensor(props), torch.tensor(p), torch.tensor(cand),
                                     torch.tensor(q), torch.tensor(u, dtype=torch.float64),
                                     fixed_draw(u_bonus))  # fmt: skip
        assert (int(a), int(bonus)) == want


# ------------------------------------------------------------------------- device loop commit


def _commit_case(rng, block: int, width: int, form: str):
    """Inputs of one device-loop commit: the verify's logits (or argmax ids) [W], the draft's
    proposals [15], the state; and the target's argmax ids (numpy: the first maximum)."""
    vocab = {"ids": 8, "small": 6, "wide": 256}[form]
    logits = rng.integers(0, 4, size=(width, vocab)).astype(np.float32)  # ties in most rows
    target = logits.argmax(-1).tolist()
    props = propose(rng, target, DRAFT_WIDTH - 1, vocab)
    n = int(rng.integers(1, 40))
    budget = n + int(rng.integers(-2, 20))
    verified = torch.tensor(target) if form == "ids" else torch.from_numpy(logits)
    state = dict(props=torch.tensor(props), tok=torch.tensor([7]), pos=torch.tensor([100]),
                 n=torch.tensor([n]), budget=torch.tensor([budget]), lim=torch.tensor([block - 1]),
                 last=torch.zeros(DRAFT_WIDTH + 1, dtype=torch.long),
                 arange=torch.arange(DRAFT_WIDTH + 1))  # fmt: skip
    return verified, state, target, props, n, budget


@pytest.mark.parametrize("form", ["ids", "small", "wide"])
def test_device_commit_equals_greedy_step(form):
    """The device loop's commit (what the verify graph captures) and the host's stop cut of the
    tokens it read == greedy_step: block sizes 1..16, verify widths padded up to 16, budgets
    below / at / above the tokens generated, stop tokens inside the block. ``wide`` runs the
    two-pass row argmax (V = 256) on rows with tied maxima."""
    rng = np.random.default_rng({"ids": 4, "small": 5, "wide": 6}[form])
    for _ in range(400):
        block = int(rng.integers(1, DRAFT_WIDTH + 1))
        width = int(rng.integers(block, DRAFT_WIDTH + 1))  # the captured width, >= block size
        verified, s, target, props, n, budget = _commit_case(rng, block, width, form)
        stops = set(rng.choice(target + props, size=int(rng.integers(0, 3))).tolist())
        want = greedy_step(props, target, block_size=block, generated=n, max_new_tokens=budget,
                           stops=stops)  # fmt: skip
        commit(verified, **s)
        row = s["last"].tolist()
        raw = row[1 : 1 + row[0]]
        assert s["n"].item() == n + len(raw) and s["pos"].item() == 100 + len(raw)
        assert s["tok"].item() == (raw[-1] if raw else 7)
        if budget - n <= 0:
            assert raw == [] and want.tokens == []
            continue
        assert raw[: want.accepted + 1] == props[: want.accepted] + [target[want.accepted]]
        assert commit_tokens(raw, stops, n, budget) == (want.tokens, want.generated, want.finish)
        assert len(raw) - 1 == min(accept_greedy(props[: block - 1], target)[0], budget - n - 1)


# ------------------------------------------------------------------------- the host loop


class ScriptedArrays:
    """A backend over a random scripted world, on torch or MLX arrays. Each draft returns 15
    proposals (the coming verify's argmax for a random prefix, random after) and fixes the
    coming verify's logits (integer-valued, with ties); it records what each step saw."""

    draft_head_rows = False

    def __init__(self, seed: int, vocab: int, as_array, candidates: bool = False):
        self.rng, self.vocab, self.as_array = np.random.default_rng(seed), vocab, as_array
        self.vocab_size, self.mask_token_id, self.draft_block_size = vocab, vocab - 1, DRAFT_WIDTH
        self.draft_uses_sampling = candidates
        self.steps: list[dict] = []
        self.coming = None

    def _logits(self, rows: int) -> np.ndarray:
        return self.rng.integers(0, 5, size=(rows, self.vocab)).astype(np.float32)

    def reset(self, max_positions=None):
        self.steps = []

    def prefill(self, prompt_ids, with_features):
        self.first_logits = self._logits(1)[0]
        return self.as_array(self.first_logits), np.zeros((len(prompt_ids), 1))

    def draft(self, anchor, context, start, length, sampling=None, **_):
        logits = self._logits(length)
        props = propose(self.rng, logits.argmax(-1).tolist(), length - 1, self.vocab)
        self.coming = dict(logits=logits, draft=props)
        if not self.draft_uses_sampling:
            return self.as_array(np.array(props)), None
        k = 3
        cand = self.rng.integers(0, self.vocab, (length - 1, k))
        q = dyadic_table(self.rng, length - 1, k)
        cand[np.arange(length - 1), q.argmax(-1)] = props  # each proposal has mass in q
        self.coming.update(cand=cand, q=q)
        return self.as_array(np.array(props)), SelectorProposal(self.as_array(cand),
                                                                self.as_array(q.astype(np.float32)))

    def verify(self, anchor, proposals, start, with_features):
        step = self.coming if proposals is not None else dict(logits=self._logits(1), draft=[])
        self.coming = None
        rows = 1 + (0 if proposals is None else int(proposals.shape[0]))
        step["logits"] = step["logits"][:rows]
        self.steps.append(step)
        return self.as_array(step["logits"]), np.zeros((rows, 1))  # features: unused rows

    def rollback(self, length):
        pass


def _reference(be: ScriptedArrays, block, budget, stops, sampling: SamplingParams):
    """What accept.py dictates for the steps the backend recorded, as RoundResult fields."""
    rng = np.random.default_rng(sampling.seed)
    if sampling.greedy:
        first = int(be.first_logits.argmax())
    else:
        first = draw(sampling_probs(be.first_logits, sampling), rng.random())
    out = [(*commit_tokens([first], stops, 0, budget)[::2], None, 0)]  # tokens, finish, τ, n
    n = len(out[0][0])
    for step in be.steps:
        if sampling.greedy:
            target = step["logits"].argmax(-1).tolist()
            g = greedy_step(step["draft"], target, block_size=block, generated=n,
                            max_new_tokens=budget, stops=stops)  # fmt: skip
            toks, n, finish, proposed = g.tokens, g.generated, g.finish, g.proposed
        else:
            proposed = verify_width(block, n, budget) - 1
            props, p = step["draft"][:proposed], sampling_probs(step["logits"], sampling)
            if "cand" in step:
                a, bonus = accept_sampling_candidates(props, p, step["cand"][:proposed],
                                                      step["q"][:proposed], rng)  # fmt: skip
            else:
                a, bonus = accept_sampling(props, p, None, rng)
            toks, n, finish = commit_tokens(props[:a] + [bonus], stops, n, budget)
        out.append((toks, finish, len(toks), proposed))
    return out


def _host_loop_cases(backend_cls, as_array, sampler_free: bool) -> None:
    """Run the host loop on 60 random scripted worlds (block sizes 1..16, budgets 1..39, a stop
    token or none); compare every RoundResult with what accept.py dictates. ``sampler_free``:
    the backend has no device sampler (the numpy one samples), so T > 0 runs too."""
    rng = np.random.default_rng(7)
    for seed in range(60):
        mode = ("greedy", "sampled", "candidates")[seed % 3] if sampler_free else "greedy"
        block = int(rng.integers(1, DRAFT_WIDTH + 1))
        budget = int(rng.integers(1, 40))
        vocab = int(rng.integers(4, 12))
        stops = set(rng.choice(vocab, size=int(rng.integers(0, 2))).tolist())
        sampling = (SamplingParams() if mode == "greedy"
                    else SamplingParams(temperature=0.9, top_k=5, seed=seed))  # fmt: skip
        be = backend_cls(seed, vocab, as_array, candidates=mode == "candidates")
        rounds = list(speculative_generate(be, [1, 2, 3], block_size=block, max_new_tokens=budget,
                                           sampling=sampling, stop_ids=sorted(stops)))  # fmt: skip
        got = [(r.tokens, r.finish_reason, r.accepted, r.proposed) for r in rounds]
        assert got == _reference(be, block, budget, stops, sampling), (seed, mode, block, budget)


def test_host_loop_on_mlx_arrays_equals_accept():
    """The MLX path (the host loop with MLXBackend's argmax / to_list / to_numpy and the numpy
    sampler): greedy, rejection sampling and DFlash2 candidates, step by step."""
    mx = pytest.importorskip("mlx.core")
    from dflash.backends.mlx import MLXBackend

    class OnMLX(ScriptedArrays):
        argmax, to_list, to_numpy = MLXBackend.argmax, MLXBackend.to_list, MLXBackend.to_numpy

    def as_mx(x):
        x = np.asarray(x)
        return mx.array(x.astype(np.int32) if x.dtype.kind == "i" else x)

    _host_loop_cases(OnMLX, as_mx, sampler_free=True)


def test_host_loop_on_torch_arrays_equals_accept():
    """The transformers backend's host path (torch argmax / to_list), greedy, step by step."""
    from dflash.backends.plain import TransformersBackend

    class OnTorch(ScriptedArrays):
        argmax, to_list = TransformersBackend.argmax, TransformersBackend.to_list
        to_numpy = TransformersBackend.to_numpy

    _host_loop_cases(OnTorch, lambda x: torch.from_numpy(np.asarray(x)), sampler_free=False)
