"""Hybrid GatedDeltaNet targets (mlx-lm qwen3_next, qwen3_5) on the MLX backend.

After every verify step the recurrent state (B, Hv, Dv, Dk) float32 and the conv state
(B, K-1, conv_dim) of every GatedDeltaNet layer, and the attention layer's K/V, must equal those
of the same target that decoded the committed tokens one at a time: max abs difference 0.
This holds on the CPU build of mlx, whose reference BLAS accumulates every output element in the
same order whatever the number of rows (so a 16-token verify and a 1-token decode round alike);
on Metal, GEMM tiling differs with the row count, so states agree only to rounding (1e-3 there).
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from dflash.loop import speculative_generate  # noqa: E402
from tests.helpers.mlx_models import MlxScriptedBackend as ScriptedBackend  # noqa: E402
from tests.helpers.mlx_models import build_draft, build_target, greedy_reference, random_prompt  # noqa: E402

PROMPT = random_prompt(10, seed=3)
N = 48


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def hybrid(request, tmp_path_factory):
    import dflash

    root = tmp_path_factory.mktemp(request.param)
    target = build_target(root / "target", request.param)
    draft = build_draft(root / "draft", target)
    pipe = dflash.load(str(target), str(draft), backend="mlx")
    return pipe, target, greedy_reference(target, PROMPT, N + 20)


def test_layout_is_detected(hybrid):
    pipe, _, _ = hybrid
    assert pipe.backend.gdn_indices == [0, 1, 2]  # 3 GatedDeltaNet layers + 1 attention layer


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_untrained_draft_greedy_parity(hybrid, block_size):
    pipe, _, truth = hybrid
    assert (
        pipe.generate(PROMPT, block_size=block_size, max_new_tokens=N, stop_ids=[]).token_ids
        == truth[:N]
    )


class Reference:
    """The same target decoding committed tokens one at a time (prompt as mlx-lm prefills it)."""

    def __init__(self, target_dir):
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        self.model, _ = load(str(target_dir))
        self.cache = make_prompt_cache(self.model)
        self.model(mx.array([PROMPT[:-1]]), cache=self.cache)
        self.model(mx.array([PROMPT[-1:]]), cache=self.cache)
        self.length = len(PROMPT)

    def feed(self, tokens: list[int]) -> None:
        for t in tokens:
            self.model(mx.array([[t]]), cache=self.cache)
            self.length += 1


# CPU: bit-exact (see the module docstring); Metal: GEMM tiling depends on the row count, so a
# 16-row verify and 1-row decodes round differently; 1e-3 bounds that drift in these tiny models.
TOL = 0.0 if mx.default_device().type == mx.cpu else 1e-3


def assert_same_state(ours: list, ref: list, length: int) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if hasattr(a, "keys") and not isinstance(a.keys, type(None)) and hasattr(a, "offset"):
            assert a.offset == b.offset == length, (i, a.offset, b.offset, length)
            ka, kb = a.keys[..., :length, :], b.keys[..., :length, :]
            assert float(mx.abs(ka - kb).max()) <= TOL, f"layer {i} keys"
            continue
        for j, name in enumerate(("conv", "recurrent")):
            diff = float(mx.abs(a[j] - b[j]).max())
            assert a[j].shape == b[j].shape and diff <= TOL, (
                f"layer {i} {name} state differs by {diff}"
            )
        assert a[1].dtype == mx.float32


@pytest.mark.parametrize("schedule", [[15, 0, 3, 0, 0, 15], [0, 0, 0], [15], [2, 7, 1, 11]])
def test_scripted_schedules_restore_exact_states(hybrid, schedule):
    pipe, target, truth = hybrid
    be = ScriptedBackend(pipe.backend, truth, len(PROMPT), schedule)
    ref = Reference(target)
    committed: list[int] = []
    for r in speculative_generate(be, PROMPT, block_size=16, max_new_tokens=N):
        committed += r.tokens
        assert committed == truth[: len(committed)]
        if r.finish_reason is not None:
            break
        ref.feed(committed[ref.length - len(PROMPT) : -1])  # all but the anchor are in the cache
        assert pipe.backend.length == ref.length
        assert_same_state(pipe.backend.cache, ref.cache, ref.length)
    assert len(committed) == N


def test_uncovered_recurrent_layout_is_refused_at_load(hybrid):
    """A linear-attention layer the capture does not know (here: its GatedDeltaNet made
    unrecognisable) is refused before any generation, never silently drifting."""
    from dflash.backends.mlx import MLXBackend
    from dflash.errors import BackendError

    pipe, _, _ = hybrid
    be = pipe.backend
    layer = be.layers[1]
    name = "linear_attn" if "linear_attn" in layer else next(iter(layer.children()))
    gdn = layer[name]
    del layer[name]
    layer["mixer"] = {"unknown": gdn.A_log}  # recurrent layer of an unknown kind
    try:
        with pytest.raises(BackendError, match="cannot roll back exactly"):
            MLXBackend(be.target, be.draft_model)
    finally:
        del layer["mixer"]
        layer[name] = gdn
