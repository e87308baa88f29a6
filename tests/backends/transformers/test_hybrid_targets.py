"""GatedDeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE, the Qwen3.5 vision wrapper) on the
transformers backend's plain path, with the conv and recurrent states rolled back after every
verify (:mod:`dflash.backends.gdn_torch`).

Tiny random targets (``tests/helpers/target_families.py``: 3 linear-attention : 1 full layers) made into
folders, given a draft by ``init_draft`` and loaded by ``dflash.load`` as a user would; prompts
of 70 tokens, so that transformers' chunked prefill runs over two 64-token chunks. Greedy ids
equal HF ``generate`` at block sizes 1, 4 and 16. Scripted drafts with full, zero and partial
accepts: after every step each GatedDeltaNet layer's conv and recurrent state and each attention
layer's keys equal those of the same target decoding the committed tokens one at a time, to
float32 rounding (torch's CPU products round a 16-row and a 1-row forward differently in the
last bits; neighbouring prefixes differ by more than 1). Sampling emits the target's
distribution; ``init-draft`` and ``generate`` through the CLI.
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash.loop import speculative_generate
from tests.helpers.target_families import (
    HYBRID,
    ScriptedRollback,
    build,
    check_cli_generate_on_folder,
    check_sampling_after_rollbacks,
    greedy,
    load_family,
    one_by_one,
    prompt_ids,
)

N = 32  # new tokens per run
P = 70  # prompt tokens: more than one 64-token chunk of the prefill
GDN_LAYERS = [0, 1, 2, 4, 5]  # of 6: layer 3 is full attention


@pytest.mark.parametrize("family", HYBRID)
def test_init_draft_load_and_greedy_parity(tmp_path, family):
    """init-draft + load on a folder of the family; ids equal HF generate at L = 1, 4, 16."""
    pipe, model = load_family(tmp_path, family)
    be = pipe.backend
    assert type(be).__name__ == "TransformersBackend" and be.recurrent.indices == GDN_LAYERS
    prompt = prompt_ids(P)
    truth = greedy(model, prompt, N)
    assert len(set(truth)) > 8
    for bs in (1, 4, 16):
        got = pipe.generate(prompt, block_size=bs, max_new_tokens=N, stop_ids=[]).token_ids
        assert got == truth, (family, bs)
    if family == "qwen3_5_wrapper":  # the text model alone, no vision tower in memory
        assert type(be.target).__name__ == "Qwen3_5ForCausalLM"
        assert not any("visual" in name for name, _ in be.target.named_parameters())


def states(cache) -> list[tuple[torch.Tensor, ...]]:
    """Per cache layer: (conv [1, C, K], recurrent [1, Hv, Dk, Dv]) of a GatedDeltaNet layer or
    (keys [1, Hkv, S, D],) of an attention layer, cloned."""
    return [(layer.conv_states[0].clone(), layer.recurrent_states[0].clone()) if hasattr(layer, "recurrent_states")
            else (layer.keys.clone(),) for layer in cache.layers]  # fmt: skip


class Recording(ScriptedRollback):
    """The scripted draft, recording every layer's states after each rollback."""

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)
        self.snapshots.append((length, states(self.inner.cache)))


def worst(got: list, want: list) -> float:
    """The largest absolute difference over every state of every layer."""
    return max((a[..., : b.shape[-2], :] if a.dim() == 4 and a.shape[-2] != b.shape[-2] else a).sub(b).abs().max().item()
               for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_scripted_schedules_restore_the_one_by_one_states(family):
    from dflash.backends.plain import TransformersBackend
    from tests.conftest import make_draft

    model = build(family)
    prompt = prompt_ids(P)
    truth = greedy(model, prompt, 60)
    ref = one_by_one(model, prompt + truth, P, states)
    inner = TransformersBackend(model, make_draft(model), torch.device("cpu"))
    for schedule, first in (([15, 0, 3, 0, 0, 15], [16, 1, 4, 1, 1, 16]), ([0, 0, 0], [1, 1, 1]),
                            ([2, 7, 1, 11], [3, 8, 2, 12])):  # fmt: skip
        be = Recording(inner, truth, P, schedule)
        rounds = list(speculative_generate(be, prompt, block_size=16, max_new_tokens=56))
        assert [t for r in rounds for t in r.tokens] == truth[:56]
        assert [r.accepted for r in rounds[1:]][
            : len(first)
        ] == first  # full, zero, partial accepts
        assert len(be.snapshots) == len(rounds) - 2  # every step but the last rolls back
        for length, got in be.snapshots:
            want = ref[length]
            for i in GDN_LAYERS:
                assert got[i][0].shape == want[i][0].shape and got[i][1].dtype == torch.float32
            assert worst(got, want) < 1e-3, (schedule, length)  # float32 rounding only
            if length + 1 in ref:  # the tolerance tells neighbouring prefixes apart
                assert (
                    worst([got[i] for i in GDN_LAYERS], [ref[length + 1][i] for i in GDN_LAYERS])
                    > 1.0
                )


def test_a_rollback_outside_the_last_verify_is_refused():
    """The recurrent state is restorable within the last verify only: one sentence otherwise."""
    from dflash.backends.plain import TransformersBackend
    from dflash.errors import BackendError

    model = build("qwen3_next")
    be = TransformersBackend(model, None, torch.device("cpu"))
    be.reset()
    ids = prompt_ids(P + 4)
    be.prefill(ids[:P], False)
    be.verify(ids[P], torch.tensor(ids[P + 1 : P + 4]), P, False)
    with pytest.raises(BackendError, match="last verify covered 70..74"):
        be.rollback(P - 1)
    be.verify(ids[P], torch.tensor(ids[P + 1 : P + 4]), P, False)
    be.rollback(P + 2)
    with pytest.raises(BackendError, match="from 72 to 71 positions"):
        be.rollback(P + 1)


def test_an_uncovered_recurrent_layout_is_refused_at_load():
    """A linear-attention layer whose module the capture does not know is refused when the
    backend is built, before any generation, never silently drifting."""
    from dflash.backends.plain import TransformersBackend
    from dflash.errors import BackendError

    model = build("qwen3_5_text")
    model.model.layers[1].linear_attn = torch.nn.Identity()
    with pytest.raises(
        BackendError, match="layer 1 \\(Identity\\) cannot be rolled back exactly"
    ) as err:
        TransformersBackend(model, None, torch.device("cpu"))
    assert "Qwen3-Next and Qwen3.5" in err.value.hint


def test_sampling_emits_the_target_distribution_after_rollbacks():
    """At T > 0: the rows the loop accepts against, after steps that rolled the states back, are
    the target's own (HF forward over the committed text, no cache), and the token emitted at
    the first position of a verify step follows them (TV < 0.01)."""
    check_sampling_after_rollbacks(build("qwen3_5_text"), prompt_ids(P), tol=1e-3)


def test_the_cuda_graph_path_takes_the_hybrids_it_covers():
    """The CUDA-graph path runs the covered hybrid layouts (dflash.backends.static.hybrid); one it
    does not cover goes to the plain path, and ``--cuda-graphs`` says why in one sentence."""
    from dflash.backends.static.support import static_refusal, supports_static
    from dflash.backends.transformers import no_graphs_reason

    model = build("qwen3_next")
    assert supports_static(model)
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "yarn"}
    why = static_refusal(model)
    assert why is not None and not supports_static(model)
    msg = no_graphs_reason(model, why)
    assert "GatedDeltaNet" in msg and "plain path" in msg and why in msg and "\n" not in msg


@pytest.mark.slow  # two CLI processes: about a minute on a small shared CPU
def test_cli_init_draft_and_generate_on_a_hybrid_folder(tmp_path):
    """As a user: ``dflash init-draft`` on a Qwen3-Next folder, then ``dflash generate
    transformers --json``; the ids equal HF generate on the chat prompt (cut at a stop token)."""
    assert len(check_cli_generate_on_folder(tmp_path, "qwen3_next", prompt_ids(P), 4)) > 64


def mlx_readable(folder) -> None:
    """Copy ``rope_theta`` and ``partial_rotary_factor`` next to ``rope_parameters`` in a saved
    config.json: transformers 5 writes them only there, mlx-lm reads them beside it."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config", cfg)
    rope = text["rope_parameters"]
    text.update(
        rope_theta=rope["rope_theta"], partial_rotary_factor=rope.get("partial_rotary_factor", 0.25)
    )
    path.write_text(json.dumps(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_wrapper"])
def test_transformers_and_mlx_give_the_same_ids(tmp_path, family):
    """The same hybrid folder and draft on both backends (float32, CPU): the same greedy ids,
    those of HF generate, at L = 4 and 16."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    import dflash

    pipe, model = load_family(tmp_path, family)
    mlx_readable(tmp_path / "target")
    on_mlx = dflash.load(str(tmp_path / "target"), str(tmp_path / "draft"), backend="mlx")
    prompt = prompt_ids(P)
    truth = greedy(model, prompt, 24)
    for bs in (4, 16):
        ids = [
            p.generate(prompt, block_size=bs, max_new_tokens=24, stop_ids=[]).token_ids
            for p in (pipe, on_mlx)
        ]
        assert ids == [truth, truth], (family, bs)
