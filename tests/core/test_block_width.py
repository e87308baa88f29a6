"""The draft always runs at its trained block size; the last block is trimmed, not shrunk.

A draft's in-block attention is bidirectional, so a 7-slot block proposes other tokens than a
16-slot block from the same state. The scripted draft below models exactly that (right only at
the trained width); the real demo pair checks the same property end to end.
"""

from __future__ import annotations

import torch

from dflash.loop import speculative_generate
from tests.helpers.stats import one_torch_thread
from tests.helpers.tiny import PROMPT, ScriptedBackend, greedy_reference


class WidthSensitiveBackend(ScriptedBackend):
    """Scripted draft that is right (k positions) only when run at the trained width."""

    widths: list[int]

    def draft(self, anchor, context, start, length):
        self.widths = getattr(self, "widths", []) + [length]
        props, logits = super().draft(anchor, context, start, length)
        if length != self.inner.draft_block_size:
            props = (props + 1) % 256
        return props, logits


def _accepts(backend, budget, block_size=16):
    rounds = speculative_generate(backend, PROMPT, block_size=block_size, max_new_tokens=budget)
    return [r.accepted for r in rounds if r.accepted is not None]


def _check_prefix(short, long, budget):
    assert short[:-1] == long[: len(short) - 1]
    remaining = budget - 1 - sum(short[:-1])
    assert short[-1] == min(long[len(short) - 1], remaining)


def test_budgets_23_and_40_accept_alike_scripted(tiny_backend, tiny_target):
    truth = greedy_reference(tiny_target, PROMPT, 60)
    runs = {}
    for budget in (23, 40):
        be = WidthSensitiveBackend(tiny_backend, truth, len(PROMPT), [5, 9, 15, 3])
        runs[budget] = _accepts(be, budget)
        assert set(be.widths) == {16}, be.widths  # always the trained width
    _check_prefix(runs[23], runs[40], 23)


def test_smaller_block_size_drafts_at_trained_width(tiny_backend, tiny_target):
    truth = greedy_reference(tiny_target, PROMPT, 60)
    be = WidthSensitiveBackend(tiny_backend, truth, len(PROMPT), [15])
    acc = _accepts(be, 30, block_size=5)
    assert set(be.widths) == {16} and acc[:-1] == [5] * (len(acc) - 1)


def test_budgets_23_and_40_accept_alike_demo_pair(demo_pipe):
    """The shipped (trained) demo draft on its target (float32, CPU): identical τ per step."""
    from dflash.backends.plain import TransformersBackend
    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.target_torch import DEMO_DRAFT_DIR

    target = demo_pipe.backend.target
    draft = DFlashDraft.load(DEMO_DRAFT_DIR, dtype=torch.float32).eval()
    be = TransformersBackend(target, draft, torch.device("cpu"))
    ids = demo_pipe.chat_prompt([{"role": "user", "content": "What is 17 times 23?"}])
    runs = {}
    with one_torch_thread():  # a shared 2-core CI box: oversubscribed threads cost 8x here
        for budget in (23, 40):
            rounds = speculative_generate(be, ids, block_size=16, max_new_tokens=budget)
            runs[budget] = [r.accepted for r in rounds if r.accepted is not None]
    assert max(runs[40]) > 1  # the trained draft gets proposals accepted
    _check_prefix(runs[23], runs[40], 23)
