"""Capture planning of the CUDA-graph path: which widths are captured and how widths pad."""

from __future__ import annotations

import pytest

from dflash.backends.static.graph_plan import plan_graphs, resolve_compile


def test_plan_with_a_block_16_draft():
    plan = plan_graphs(16, has_draft=True)
    assert plan.verify_widths == (1, 16) and plan.draft_width == 16
    assert plan.keys() == [("verify", 1), ("verify", 16), ("draft", 16)]
    # every width a request can ask for maps onto a captured graph
    assert [plan.verify_width(w) for w in range(1, 17)] == [1] + [16] * 15
    assert {plan.verify_width(w) for w in range(1, 17)} <= set(plan.verify_widths)


def test_plan_without_draft_or_block_1():
    for plan in (plan_graphs(16, has_draft=False), plan_graphs(1, has_draft=True)):
        assert plan.verify_widths == (1,) and plan.draft_width == 0
        assert plan.keys() == [("verify", 1)]


def test_width_past_the_plan_is_kept_and_bad_width_raises():
    plan = plan_graphs(8, has_draft=True)
    assert plan.verify_width(12) == 12  # captured on first use (a loop driven past the draft)
    with pytest.raises(ValueError):
        plan.verify_width(0)


@pytest.mark.parametrize("flag,graphs,want", [(None, True, True), (None, False, False),
                                              (False, True, False), (True, True, True)])  # fmt: skip
def test_compile_default_follows_graphs(flag, graphs, want):
    assert resolve_compile(flag, graphs) is want


def test_uniform_plan_pads_block_1_decoding_to_the_block():
    plan = plan_graphs(16, has_draft=True, uniform=True)
    assert plan.verify_widths == (16,) and plan.keys() == [("verify", 16), ("draft", 16)]
    assert {plan.verify_width(w) for w in range(1, 17)} == {16}
    assert plan_graphs(16, has_draft=False, uniform=True).verify_widths == (1,)


def test_warm_replays_setting():
    from dflash.errors import InputError
    from dflash.kernels.settings import KernelSettings

    assert KernelSettings().graph_warm == 3
    for raw, want in (("0", 0), (" 5 ", 5), ("", 3)):
        assert KernelSettings.resolve(environ={"DFLASH_GRAPH_WARM": raw}).graph_warm == want
    for bad in ("-1", "three", "2.5"):
        with pytest.raises(InputError, match="DFLASH_GRAPH_WARM"):
            KernelSettings.resolve(environ={"DFLASH_GRAPH_WARM": bad})


def test_allow_recompiles_keeps_every_width_compiled():
    """Dynamo keeps one cache per code object: past its recompile limit (8) further widths run
    eagerly without a word. allow_recompiles raises the limit so every width stays compiled."""
    import torch._dynamo
    import torch._dynamo.config as dynamo_config

    from dflash.backends.static.graph_plan import RECOMPILE_LIMIT, allow_recompiles

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"

    def compiled_widths(n: int) -> int:
        graphs = []

        def backend(gm, inputs):
            graphs.append(gm)
            return gm.forward

        def step(x):
            return x * 2 + 1

        torch._dynamo.reset()
        fn = torch.compile(step, backend=backend, dynamic=False)
        for width in range(1, n + 1):
            assert torch.equal(fn(torch.ones(width)), torch.full((width,), 3.0))
        return len(graphs)

    with dynamo_config.patch(**{name: 8}):  # Dynamo's default; the config is restored after
        assert compiled_widths(12) == 8  # widths 9-12 ran eagerly
        assert allow_recompiles() == RECOMPILE_LIMIT
        assert compiled_widths(12) == 12
    with dynamo_config.patch(**{name: 100}):
        assert allow_recompiles() == 100  # never lowered
    torch._dynamo.reset()
