"""DFlash2 drafts on the static (CUDA-graph) path, run eagerly on the CPU: greedy ids equal HF
``generate`` (host loop and device loop), the same proposals as the plain path, seeded sampling
identical to the plain path's, and the sampled walk on the device lossless (TV)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.accept import accept_sampling_candidates
from dflash.backends.plain import TransformersBackend
from dflash.backends.static.backend import StaticBackend
from dflash.loop import speculative_generate
from dflash.sampling import sampling_probs
from dflash.types import SamplingParams
from tests.helpers.dflash2 import make_draft2
from tests.helpers.stats import tv
from tests.helpers.tiny import PROMPT

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread (tests/conftest.py)

CPU = torch.device("cpu")


def tokens(be, block_size: int, n: int, sampling: SamplingParams | None = None) -> list[int]:
    kw = {} if sampling is None else {"sampling": sampling}
    return [t for r in speculative_generate(be, PROMPT, block_size=block_size, max_new_tokens=n, **kw)
            for t in r.tokens]  # fmt: skip


@pytest.mark.parametrize(("draft_block", "block_size"), [(4, 4), (16, 16), (16, 4)])
@pytest.mark.parametrize("device_loop", [False, True])
def test_greedy_ids_equal_hf_generate(tiny_target, truth, draft_block, block_size, device_loop):
    """An untrained DFlash2 draft: the host loop (selector walk in the draft forward) and the
    device loop (walk, acceptance and commit on the device) decode exactly HF's greedy ids."""
    be = StaticBackend(tiny_target, make_draft2(tiny_target, block_size=draft_block), CPU,
                       use_graphs=False, device_loop=device_loop)  # fmt: skip
    assert be.fused_draft is not None and (be.device_loop is not None) == device_loop
    for _ in range(2):  # a second request reuses the buffers
        assert tokens(be, block_size, 40) == truth[:40]


def test_same_proposals_as_the_plain_path(tiny_target):
    """Same draft, same context: the static path's on-device walk proposes what the plain
    path's selector proposes, so every step accepts the same count (and some steps accept)."""
    draft = make_draft2(tiny_target, block_size=8)
    static = StaticBackend(tiny_target, draft, CPU, use_graphs=False)
    plain = TransformersBackend(tiny_target, draft, CPU)
    a = [r.accepted for r in speculative_generate(static, PROMPT, block_size=8, max_new_tokens=60)]
    b = [r.accepted for r in speculative_generate(plain, PROMPT, block_size=8, max_new_tokens=60)]
    assert a == b
    static.reset(64)
    plain.reset(64)
    with torch.inference_mode():
        _, ctx = static.prefill(PROMPT, True)
        _, ctx_p = plain.prefill(PROMPT, True)
        ps, sel_s = static.draft(PROMPT[-1], ctx, len(PROMPT), 8)
        pp, sel_p = plain.draft(PROMPT[-1], ctx_p, len(PROMPT), 8)
    assert ps.tolist() == pp.tolist() and sel_s.q is None
    assert torch.equal(sel_s.candidates, sel_p.candidates)


def test_sampling_equals_the_plain_path_for_a_seed(tiny_target):
    """Seeded sampling: the static path draws the walk's uniforms from the same generator as the
    plain path and accepts with the same candidate rule, so the tokens are identical; another
    seed gives other tokens."""
    draft = make_draft2(tiny_target, block_size=8)
    static = StaticBackend(tiny_target, draft, CPU, use_graphs=False)
    plain = TransformersBackend(tiny_target, draft, CPU)
    sp = SamplingParams(temperature=0.9, top_k=30, seed=5)
    runs = [tokens(static, 8, 40, sp) for _ in range(2)]
    assert runs[0] == runs[1] == tokens(plain, 8, 40, sp)
    assert tokens(static, 8, 40, SamplingParams(temperature=0.9, top_k=30, seed=6)) != runs[0]
    static.sel_u = torch.zeros(1, 3)  # a walk longer than the uniforms buffer gets a new one
    assert tokens(static, 8, 40, sp) == runs[0] and static.sel_u.shape == (1, 7)


def test_sampled_walk_on_the_device_is_lossless(tiny_target):
    """The static path's sampled walk (``_select``, as captured in the ``sdraft`` graph) with
    the shared candidate acceptance: the first emitted token follows the target's p0 and, when
    the first proposal d is accepted, the second follows p1 given d (TV < 0.01 / 0.02; 60k
    walks of one block in one batch). The walk is fed the target's own final hidden states
    (after the anchor, and after d for position 1) so that its candidates overlap the target's
    tokens and both the accept and the residual branches run."""
    draft = make_draft2(tiny_target, block_size=4, selector_top_k=6)
    with torch.no_grad():  # milder random edges: the pairwise term still moves q
        for cb in (
            draft.candidate_selector.predecessor_codebook,
            draft.candidate_selector.successor_codebook,
        ):
            cb.weight.mul_(0.3)
    be = StaticBackend(tiny_target, draft, CPU, use_graphs=False)
    params = SamplingParams(temperature=1.0, top_k=8)
    with torch.inference_mode():
        anchor = int(tiny_target(torch.tensor([PROMPT])).logits[0, -1].argmax())
        out = tiny_target(torch.tensor([PROMPT + [anchor]]), output_hidden_states=True)
        p0 = sampling_probs(out.logits[0, -1:].numpy(), params)[0]
        d = int(out.logits[0, -1].argmax())  # position 1's hidden state follows d
        out1 = tiny_target(torch.tensor([PROMPT + [anchor, d]]), output_hidden_states=True)
        p1 = sampling_probs(out1.logits[0, -1:].numpy(), params)[0]
        hidden = torch.stack((out.hidden_states[-1][0, -1], out1.hidden_states[-1][0, -1],
                              out1.hidden_states[-1][0, -1]))  # fmt: skip
        n = 60_000
        be.sel_u = torch.rand(n, 3, generator=torch.Generator().manual_seed(1))
        be.sel_temp.fill_(params.temperature)
        props, cand, q = be._select(
            hidden[None].expand(n, -1, -1), torch.full((n,), anchor), sample=True
        )
    assert torch.allclose(q.sum(-1), torch.ones(n, 3)) and d in cand[0, 0].tolist()
    rng = np.random.default_rng(2)
    first, second = np.zeros_like(p0), np.zeros_like(p0)
    props, cand, q = props.numpy(), cand.numpy(), q.numpy()
    for i in range(n):
        d0, d1 = int(props[i, 0]), int(props[i, 1])
        p_rows = np.stack([p0, p1 if d0 == d else p0, p0])  # row 1 only matters after d
        a, bonus = accept_sampling_candidates([d0, d1], p_rows, cand[i, :2], q[i, :2], rng)
        emitted = [d0, d1][:a] + [bonus]
        first[emitted[0]] += 1
        if a >= 1 and d0 == d:
            second[emitted[1]] += 1
    assert tv(first, p0) < 0.01
    assert second.sum() > 10_000
    assert tv(second, p1) < 0.02
