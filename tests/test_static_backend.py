"""The static-cache fast path (eager on CPU; CUDA graphs on GPU) gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from dflash.backends.static_torch import StaticBackend, supports_static
from dflash.loop import speculative_generate
from tests.conftest import make_draft
from tests.test_loop_scripted import PROMPT, greedy_reference


@pytest.fixture(scope="module")
def static_backend(tiny_target):
    assert supports_static(tiny_target)
    return StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_static_parity_tiny(static_backend, tiny_target, block_size):
    truth = greedy_reference(tiny_target, PROMPT, 60)
    for _ in range(2):  # a second request reuses the buffers: nothing leaks
        toks = [t for r in speculative_generate(static_backend, PROMPT, block_size=block_size,
                                                max_new_tokens=60) for t in r.tokens]  # fmt: skip
        assert toks == truth


def test_static_matches_dynamic_acceptance(static_backend, tiny_backend):
    """Same draft weights and context -> the same proposals, so identical τ per step."""
    static_backend.draft_model.load_state_dict(tiny_backend.draft_model.state_dict())
    a = [r.accepted for r in speculative_generate(static_backend, PROMPT, block_size=16, max_new_tokens=80)]
    b = [r.accepted for r in speculative_generate(tiny_backend, PROMPT, block_size=16, max_new_tokens=80)]
    assert a == b


def test_static_parity_real_target(demo_pipe):
    be = StaticBackend(demo_pipe.backend.target, demo_pipe.backend.draft_model, torch.device("cpu"),
                       use_graphs=False)  # fmt: skip
    ids = demo_pipe.chat_prompt([{"role": "user", "content": "Name three primary colors."}])
    ref = demo_pipe.generate(ids, block_size=8, max_new_tokens=48)
    toks = [t for r in speculative_generate(be, ids, block_size=8, max_new_tokens=48,
                                            stop_ids=demo_pipe.stop_ids) for t in r.tokens]  # fmt: skip
    assert toks == ref.token_ids
