"""DFlash2 candidate selector (brief §4.2) and lossless rejection sampling over its candidate
q (brief §3.5): analytic and brute-force walks, exact equivalence with the dense rule, TV bounds
on emitted tokens and the acceptance rate that only the real q gives."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash.accept import accept_sampling, accept_sampling_candidates
from dflash.backends.base import SelectorProposal
from dflash.loop import speculative_generate
from dflash.models.draft2_torch import CandidateSelector
from dflash.sampling import sample, sampling_probs
from dflash.types import SamplingParams
from tests.helpers.stats import tv

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread (tests/conftest.py)



# ----------------------------------------------------------------------------- selector


def hand_built_selector() -> CandidateSelector:
    """Vocab 5, rank 2, top-2; hidden projection = identity. Edges (see the test):
    anchor 0 -> token 2 scores +3; token 2 -> token 4 scores +2 at position 1."""
    sel = CandidateSelector(hidden=2, vocab=5, rank=2, top_k=2)
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.eye(2))
        sel.predecessor_codebook.weight.zero_()
        sel.successor_codebook.weight.zero_()
        sel.predecessor_codebook.weight[0] = torch.tensor([1.0, 0.0])
        sel.predecessor_codebook.weight[2] = torch.tensor([0.0, 2.0])
        sel.successor_codebook.weight[2] = torch.tensor([3.0, 0.0])
        sel.successor_codebook.weight[4] = torch.tensor([0.0, 1.0])
    return sel


SEL_HIDDEN = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # h'[0] = e0, h'[1] = e1
SEL_LOGITS = torch.tensor([[[-9.0, 2.0, 1.0, -9.0, -9.0], [-9.0, -9.0, -9.0, 1.0, 0.5]]])


def test_selector_greedy_walk_picks_the_analytic_argmax():
    """Position 0: candidates {1: 2.0, 2: 1.0}; edge(anchor 0 -> c) = pred[0]·h'0·succ[c] =
    0 for token 1, 1·1·3 = 3 for token 2 -> scores 2 vs 4 -> token 2 (the logits alone say 1).
    Position 1: candidates {3: 1.0, 4: 0.5}; edge(2 -> c) = pred[2]·h'1·succ[c] = 0 for token 3,
    2·1·1 = 2 for token 4 -> scores 1 vs 2.5 -> token 4 (the logits alone say 3)."""
    sel = hand_built_selector()
    tokens, cand, q = sel(SEL_HIDDEN, SEL_LOGITS, torch.tensor([0]))
    assert tokens.tolist() == [[2, 4]] and q is None
    assert cand.tolist() == [[[1, 2], [3, 4]]]
    # from anchor 1 (no edge weight) the walk follows the logits: [1, 3]
    assert sel(SEL_HIDDEN, SEL_LOGITS, torch.tensor([1]))[0].tolist() == [[1, 3]]


def test_selector_sampling_q_rows_are_conditional_softmaxes():
    sel = hand_built_selector()
    gen = torch.Generator().manual_seed(0)
    temp = 1.5
    firsts = np.zeros(2)
    n = 2000
    for _ in range(n):
        tokens, cand, q = sel(SEL_HIDDEN, SEL_LOGITS, torch.tensor([0]), temp, gen)
        q = q[0].double()
        torch.testing.assert_close(
            q[0], torch.softmax(torch.tensor([2.0, 4.0]) / temp, -1).double()
        )
        prev_is_2 = tokens[0, 0].item() == 2
        row1 = torch.tensor([1.0, 2.5] if prev_is_2 else [1.0, 0.5]) / temp
        torch.testing.assert_close(q[1], torch.softmax(row1, -1).double())
        firsts[int(prev_is_2)] += 1
    assert tv(firsts, torch.softmax(torch.tensor([2.0, 4.0]) / temp, -1).numpy()) < 0.03


def test_selector_matches_brute_force_trilinear_walk():
    torch.manual_seed(3)
    sel = CandidateSelector(hidden=6, vocab=30, rank=4, top_k=5)
    hidden, logits = torch.randn(1, 6, 6), torch.randn(1, 6, 30) * 2
    with torch.no_grad():
        tokens = sel(hidden, logits, torch.tensor([7]))[0][0].tolist()
        pred, succ = sel.predecessor_codebook.weight.clone(), sel.successor_codebook.weight.clone()
        hp = sel.hidden_projection(hidden)[0]
    prev, want = 7, []
    for i in range(6):
        best, best_tok = -math.inf, None
        for tok in torch.topk(logits[0, i], 5).indices.tolist():
            score = float(logits[0, i, tok]) + sum(
                float(pred[prev, r] * hp[i, r] * succ[tok, r]) for r in range(4)
            )
            if score > best:
                best, best_tok = score, tok
        want.append(best_tok)
        prev = best_tok
    assert tokens == want


# ----------------------------------------------------------------------------- acceptance


def test_candidate_rejection_equals_dense_rule_with_repeated_ids():
    """Sparse q with a repeated id (slots summed, subtracted twice) == the dense rule exactly."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        p = sampling_probs(
            rng.normal(0, 1.5, size=(3, 7)), SamplingParams(temperature=0.9, top_k=5)
        )
        cand = np.array([rng.choice(7, 3, replace=False) for _ in range(2)])
        cand[1, 2] = cand[1, 0]  # a repeated id
        q = rng.dirichlet(np.ones(3), size=2)
        dense = np.zeros((2, 7))
        for i in range(2):
            np.add.at(dense[i], cand[i], q[i])
        props = [int(cand[i, rng.integers(3)]) for i in range(2)]
        r1, r2 = np.random.default_rng(trial), np.random.default_rng(trial)
        assert accept_sampling_candidates(props, p, cand, q, r1) == accept_sampling(
            props, p, dense, r2
        )


def test_candidate_rejection_sampling_matches_target():
    """Proposals sampled from non-one-hot q over k=3 candidates, position 1's q depending on the
    position-0 pick: the emitted tokens follow the target exactly (TV, 50k draws, V=8; a correct
    sampler's expected TV is about 0.005)."""
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.95)
    p = sampling_probs(rng.normal(0, 1.5, size=(3, 8)), params)
    cand = np.array([[0, 2, 5], [1, 2, 7]])
    q0 = np.array([0.5, 0.3, 0.2])
    q1_given = {
        0: np.array([0.6, 0.2, 0.2]),
        1: np.array([0.1, 0.1, 0.8]),
        2: np.array([0.3, 0.4, 0.3]),
    }
    n = 50_000
    first, second = np.zeros(8), np.zeros(8)
    accepted0 = 0
    for _ in range(n):
        j0 = sample(q0, rng)
        q1 = q1_given[j0]
        props = [int(cand[0, j0]), int(cand[1, sample(q1, rng)])]
        a, bonus = accept_sampling_candidates(props, p, cand, np.stack([q0, q1]), rng)
        emitted = props[:a] + [bonus]
        first[emitted[0]] += 1
        if a >= 1:
            accepted0 += 1
            second[emitted[1]] += 1
    assert tv(first, p[0]) < 0.015
    assert tv(second, p[1]) < 0.015
    dense_q0 = np.zeros(8)
    dense_q0[cand[0]] = q0
    assert abs(accepted0 / n - np.minimum(p[0], dense_q0).sum()) < 0.015


class MarkovBackend:
    """A bigram target over a 3-token vocabulary and a real CandidateSelector draft (k = 2)."""

    vocab_size, mask_token_id, draft_block_size, max_context = 3, 2, 4, 1000
    draft_uses_sampling = True

    def __init__(self):
        rng = np.random.default_rng(5)
        self.table = torch.tensor(rng.normal(0, 1.2, size=(3, 3)), dtype=torch.float32)
        torch.manual_seed(5)
        self.sel = CandidateSelector(hidden=6, vocab=3, rank=3, top_k=2)
        with torch.no_grad():  # small edge scores: q rows far from one-hot
            self.sel.predecessor_codebook.weight.mul_(0.3)
            self.sel.successor_codebook.weight.mul_(0.3)
        self.hidden, self.logits = torch.randn(1, 3, 6), torch.randn(1, 3, 3) * 0.5
        self.gen = torch.Generator().manual_seed(5)
        self.seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # anchor, candidates, q

    def reset(self, max_positions=None):
        pass

    def prefill(self, prompt_ids, with_features):
        return self.table[prompt_ids[-1]], torch.zeros(len(prompt_ids), 1)

    def draft(self, anchor, context, start, length, sampling=None):
        with torch.no_grad():
            tokens, cand, q = self.sel(self.hidden[:, : length - 1], self.logits[:, : length - 1],
                                       torch.tensor([anchor]), sampling.temperature, self.gen)  # fmt: skip
        self.seen.append((anchor, cand[0], q[0]))
        return tokens[0], SelectorProposal(cand[0], q[0])

    def verify(self, anchor, proposals, start, with_features):
        ids = [anchor] + ([] if proposals is None else proposals.tolist())
        return self.table[ids], torch.zeros(len(ids), 1)

    def rollback(self, length):
        pass

    def argmax(self, logits):
        return logits.argmax(-1)

    def to_list(self, *arrays):
        return [a.reshape(-1).tolist() for a in arrays]

    def to_numpy(self, logits):
        return logits.float().numpy()

    def synchronize(self):
        pass


@pytest.mark.slow
def test_loop_with_selector_draft_is_lossless():
    """Through the loop: tokens 2-3 (a verify step of 2 sampled proposals) follow the target's
    bigram chain exactly; the first proposal is accepted at the rate sum_d min(p(d), q(d)) that
    only the draft's real q gives (about 0.73 here; a one-hot-q rule would give about 0.44); q is
    far from one-hot; accept and reject paths both occur."""
    be = MarkovBackend()
    params = SamplingParams(temperature=1.0, seed=11)
    p = sampling_probs(be.table.numpy(), params)  # [3, 3] next-token distribution per token
    n, counts = 4000, np.zeros((3, 3))
    accepted, expected_rate = [], []
    rng_seed = np.random.default_rng(11)
    for _ in range(n):
        sp = SamplingParams(temperature=1.0, seed=int(rng_seed.integers(2**62)))
        first_draft = len(be.seen)
        rounds = list(speculative_generate(be, [0], block_size=4, max_new_tokens=4, sampling=sp))
        toks = [t for r in rounds for t in r.tokens]
        counts[toks[1], toks[2]] += 1
        accepted.append(rounds[1].accepted)
        anchor, cand, q = be.seen[first_draft]
        expected_rate.append(
            sum(min(p[anchor][c], float(qq)) for c, qq in zip(cand[0].tolist(), q[0], strict=True))
        )
    # P(t1, t2) = sum_t0 p(t0 | 0) p(t1 | t0) p(t2 | t1)
    want = np.einsum("a,ab,bc->bc", p[0], p, p)
    assert tv(counts.ravel(), want.ravel()) < 0.04  # a correct sampler: about 0.015
    assert set(accepted) == {1, 2, 3}  # 2 proposals: both rejected, one or both accepted
    rate = np.mean([a >= 2 for a in accepted])
    assert abs(rate - np.mean(expected_rate)) < 0.03, (rate, np.mean(expected_rate))
    assert max(float(q.max()) for _, _, q in be.seen) < 0.9
