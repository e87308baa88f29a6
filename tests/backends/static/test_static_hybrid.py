"""GatedDeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) on the static (CUDA-graph) path,
eager on the CPU (:mod:`dflash.backends.static.hybrid`).

Tiny random float32 targets (``tests/helpers/target_families.py``: 3 linear-attention : 1 full
layers, prompts of 70 tokens, so the chunked prefill runs two chunks): greedy ids equal HF
``generate`` at block sizes 1, 3 and 16 (and a second request on the same buffers). Scripted
drafts with full, zero and partial accepts: after every rollback each GatedDeltaNet layer's
committed conv and recurrent state equals that of the same target decoding the committed tokens
one at a time through transformers, and that of the plain path under the same schedule, to
float32 rounding (torch's CPU products and vectorized exp/sigmoid round a 16-row and a 1-row
forward differently in the last bits; neighbouring prefixes differ by more than 1).
"""

from __future__ import annotations

import pytest
import torch

from dflash.backends.static.backend import StaticBackend
from dflash.backends.static.hybrid import hybrid_refusal
from dflash.backends.static.support import static_refusal
from dflash.loop import speculative_generate
from tests.conftest import make_draft
from tests.helpers.target_families import ScriptedRollback, build, greedy, prompt_ids

N = 32  # new tokens per run
P = 70  # prompt tokens: two chunks of the prefill
GDN_LAYERS = [0, 1, 2, 4, 5]  # of 6: layer 3 is full attention
FAMILIES = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe"]
_MODELS: dict = {}


def model_of(family: str):
    """One model and its greedy continuation per family per test session."""
    if family not in _MODELS:
        model = build(family)
        _MODELS[family] = (model, greedy(model, prompt_ids(P), 60))
    return _MODELS[family]


def static(model) -> StaticBackend:
    return StaticBackend(model, make_draft(model), torch.device("cpu"), use_graphs=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_greedy_equals_hf_generate(family):
    model, truth = model_of(family)
    assert static_refusal(model) is None
    be = static(model)
    info = be.describe()
    assert info["gdn_layers"] == len(GDN_LAYERS) and info["gdn_recurrence"] == "torch"
    assert ("moe_route" in info) == (family != "qwen3_5_text")
    assert len(set(truth[:N])) > 8
    for bs in (1, 3, 16, 16):
        got = [t for r in speculative_generate(be, prompt_ids(P), block_size=bs, max_new_tokens=N, stop_ids=[])
               for t in r.tokens]  # fmt: skip
        assert got == truth[:N], (family, bs)
    assert sorted(be.gdn.index) == GDN_LAYERS and all(be.k[i] is None for i in GDN_LAYERS)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_device_loop_commits_the_states_on_the_device(family):
    """The device loop (acceptance, commit and the GatedDeltaNet rollback on the device, run
    eagerly here through the glue the graphs capture): the same ids as HF generate, with
    scripted proposals right for 0, 5 and all 15 rows."""
    from tests.backends.static.test_device_loop import ScriptedLoop

    model, truth = model_of(family)
    for k in (0, 5, 15):
        be = StaticBackend(
            model, make_draft(model), torch.device("cpu"), use_graphs=False, device_loop=True
        )
        be.device_loop = ScriptedLoop(be, truth, P, k)
        rounds = list(
            speculative_generate(be, prompt_ids(P), block_size=16, max_new_tokens=N, stop_ids=[])
        )
        assert [t for r in rounds for t in r.tokens] == truth[:N], (family, k)
        assert {r.accepted for r in rounds[1:-1]} == {k + 1}


def gdn_states(layers, get) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per GatedDeltaNet layer (conv [C, K], recurrent [Hv, Dk, Dv]), cloned, from ``get(i)``."""
    return [tuple(x.clone() for x in get(i)) for i in layers]


def one_by_one(model, ids: list[int]) -> dict[int, list]:
    """transformers decoding the prompt in one forward, then one token at a time: committed
    length -> :func:`gdn_states`."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)

    def get(i):
        return cache.layers[i].conv_states[0][0], cache.layers[i].recurrent_states[0][0]

    out = {}
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:P]]), past_key_values=cache, use_cache=True)
        out[P] = gdn_states(GDN_LAYERS, get)
        for i in range(P, len(ids)):
            model(input_ids=torch.tensor([[ids[i]]]), position_ids=torch.tensor([[i]]), past_key_values=cache,
                  use_cache=True)  # fmt: skip
            out[i + 1] = gdn_states(GDN_LAYERS, get)
    return out


class Recording(ScriptedRollback):
    """The scripted draft, recording every GatedDeltaNet layer's committed states after each
    rollback (the static backend's slots, or the plain path's cache)."""

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)
        inner = self.inner
        if isinstance(inner, StaticBackend):
            get = inner.gdn.committed
        else:

            def get(i):
                return inner.cache.layers[i].conv_states[0][0], inner.cache.layers[
                    i
                ].recurrent_states[0][0]

        self.snapshots.append((length, gdn_states(GDN_LAYERS, get)))


def worst(got: list, want: list) -> float:
    return max(
        (a - b).abs().max().item()
        for x, y in zip(got, want, strict=True)
        for a, b in zip(x, y, strict=True)
    )


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_scripted_schedules_commit_the_one_by_one_states(family):
    from dflash.backends.plain import TransformersBackend

    model, truth = model_of(family)
    prompt = prompt_ids(P)
    ref = one_by_one(model, prompt + truth)
    fast, plain = static(model), TransformersBackend(model, make_draft(model), torch.device("cpu"))
    for schedule, first in (([15, 0, 3, 0, 0, 15], [16, 1, 4, 1, 1, 16]), ([0, 0, 0], [1, 1, 1])):
        runs = []
        for inner in (fast, plain):
            be = Recording(inner, truth, P, schedule)
            rounds = list(
                speculative_generate(be, prompt, block_size=16, max_new_tokens=56, stop_ids=[])
            )
            assert [t for r in rounds for t in r.tokens] == truth[:56]
            assert [r.accepted for r in rounds[1:]][
                : len(first)
            ] == first  # full, zero, partial accepts
            assert len(be.snapshots) == len(rounds) - 2  # every step but the last rolls back
            runs.append(be.snapshots)
        for (length, got), (length2, plain_got) in zip(*runs, strict=True):
            assert length == length2
            assert got[0][1].dtype == torch.float32 and got[0][0].shape == ref[length][0][0].shape
            assert worst(got, ref[length]) < 1e-3, (schedule, length)  # float32 rounding only
            assert worst(got, plain_got) < 1e-3, (schedule, length)
            if length + 1 in ref:  # the tolerance tells neighbouring prefixes apart
                assert worst(got, ref[length + 1]) > 1.0


def test_a_rollback_outside_the_last_verify_is_refused():
    from dflash.errors import BackendError

    model, _ = model_of("qwen3_5_text")
    be = static(model)
    be.reset()
    ids = prompt_ids(P + 4)
    be.prefill(ids[:P], False)
    with pytest.raises(BackendError, match="from 70 to 69 positions"):
        be.rollback(P - 1)
    be.verify(ids[P], torch.tensor(ids[P + 1 : P + 4]), P, False)
    with pytest.raises(BackendError, match="last verify covered 70..74"):
        be.rollback(P + 5)
    be.verify(
        ids[P], torch.tensor(ids[P + 1 : P + 4]), P, False
    )  # a verify: reads the committed state
    be.rollback(P + 2)
    with pytest.raises(BackendError, match="from 72 to 71 positions"):
        be.rollback(P + 1)


def test_layouts_it_does_not_cover_are_refused_with_a_reason():
    """A hybrid with another RoPE, or a GatedDeltaNet layer missing its projections, goes to the
    plain path with one phrase saying why; the vision wrapper's text model runs."""
    model = build("qwen3_5_text")
    assert hybrid_refusal(model) is None
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "yarn"}
    assert "RoPE type 'yarn'" in static_refusal(model)
    model = build("qwen3_5_text")
    del model.model.layers[1].linear_attn.in_proj_z
    assert "layouts the static path runs" in static_refusal(model)
    with pytest.raises(Exception, match="cannot run this target"):
        StaticBackend(model, None, torch.device("cpu"), use_graphs=False)
