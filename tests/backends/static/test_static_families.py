"""Sliding-window, interleaved and MoE targets on the static (CUDA-graph) path, eager on CPU.

Tiny random float32 targets (``tests/helpers/target_families.py`` and a few Qwen3 variants here: window
8, prompts of 40 tokens) on :class:`~dflash.backends.static.backend.StaticBackend`: greedy ids
equal HF ``generate`` at block sizes 1, 4 and 16, through SDPA with per-layer position masks and
through the split-KV attention's algorithm with a window (its torch reference here); scripted
drafts with zero-accept steps and full blocks give plain greedy, and after every step the K/V
rows each layer can still see are those of decoding one token at a time. Families the static
path does not run are refused with a reason and go to the plain path.
"""

from __future__ import annotations

import pytest
import torch

from dflash.backends.static.backend import (
    StaticBackend,
    layer_windows,
    static_refusal,
    supports_static,
)
from dflash.loop import speculative_generate
from tests.conftest import make_draft
from tests.helpers.target_families import BASE, WINDOW, ScriptedRollback, build, greedy, prompt_ids

N = 32  # new tokens per run
INTERLEAVED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
               "full_attention", "sliding_attention"]  # fmt: skip
QWEN3 = {  # Qwen3 variants: windows on the upper layers (use_sliding_window), interleaved, MoE
    "qwen3_window": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "qwen3_interleaved": dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=INTERLEAVED),
    "qwen3_moe_window": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                             use_sliding_window=True, sliding_window=WINDOW, mlp_only_layers=[1, 4]),
}  # fmt: skip
STATIC = ["mistral", "qwen2_window", "qwen3_moe", *QWEN3]


def make(family: str, seed: int = 0):
    """A random float32 target of ``family`` (tests/helpers/target_families.py or :data:`QWEN3`)."""
    if family not in QWEN3:
        return build(family, seed)
    import transformers

    moe = family.startswith("qwen3_moe")
    cls = transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config
    cfg = cls(**BASE, **QWEN3[family], tie_word_embeddings=False, initializer_range=0.3)
    torch.manual_seed(seed)
    auto = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    return auto(cfg).eval()


_MODELS: dict = {}


def model_of(family: str):
    """One model per family per test session (building them is most of the cost)."""
    if family not in _MODELS:
        model = make(family)
        _MODELS[family] = (model, greedy(model, prompt_ids(), N + 16))
    return _MODELS[family]


def static(model, attention: str = "sdpa") -> StaticBackend:
    be = StaticBackend(model, make_draft(model), torch.device("cpu"), use_graphs=False)
    be.attention = attention  # split: the split-KV kernel's algorithm (its torch reference on CPU)
    return be


@pytest.mark.parametrize("family", STATIC)
def test_static_path_runs_the_family_with_its_windows(family):
    model, _ = model_of(family)
    assert supports_static(model), static_refusal(model)
    windows = layer_windows(model.config)
    if family == "qwen3_moe":
        assert windows == [None] * 6
    elif family in (
        "mistral",
        "qwen3_moe_window",
    ):  # Qwen3-MoE has no layer_types: every layer slides
        assert windows == [WINDOW] * 6
    elif family == "qwen3_interleaved":
        assert windows == [WINDOW if k == "sliding_attention" else None for k in INTERLEAVED]
    else:  # use_sliding_window with max_window_layers=2: the layers from 2 on slide
        assert windows == [None, None] + [WINDOW] * 4
    be = static(model)
    assert be.windows == windows
    info = be.describe()  # benchmark records say what the forwards run
    assert info.get("sliding_windows") == ([WINDOW] if any(windows) else None)
    assert info.get("moe_route") == ("gather" if "moe" in family else None)
    if any(windows):  # the check can fail: the same target without its windows decodes other ids
        _, truth = model_of(family)
        be.windows = [None] * len(windows)
        got = [t for r in speculative_generate(be, prompt_ids(), block_size=16, max_new_tokens=N, stop_ids=[])
               for t in r.tokens]  # fmt: skip
        assert got != truth[:N]
        be.windows = windows
    if "moe" in family:
        assert any(gu is None for _, gu in be.fused_target)  # expert blocks
        assert (family == "qwen3_moe") == all(gu is None for _, gu in be.fused_target)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "split"])
@pytest.mark.parametrize("family", STATIC)
def test_static_greedy_equals_hf_generate(family, attention):
    """Prompts of 40 tokens over windows of 8: ids equal HF generate at L = 1, 4, 16 (and a
    second request on the same buffers)."""
    model, truth = model_of(family)
    prompt = prompt_ids()
    assert len(prompt) > WINDOW and len(set(truth)) > 4
    be = static(model, attention)
    for bs in (1, 4, 16, 16):
        got = [t for r in speculative_generate(be, prompt, block_size=bs, max_new_tokens=N, stop_ids=[])
               for t in r.tokens]  # fmt: skip
        assert got == truth[:N], (family, attention, bs)


def _one_by_one_kv(model, ids: list[int], prompt_len: int) -> dict[int, list[torch.Tensor]]:
    """Committed length n -> per layer the keys [1, Hkv, n, D] of every position < n, from a
    forward of the prompt and then one token at a time through a static HF cache (keeps all
    rows, so sliding layers' older rows are there too)."""
    from transformers import DynamicCache

    cache = DynamicCache()  # no config: full layers keep every row
    out = {}
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:prompt_len]]), past_key_values=cache, use_cache=True)
        out[prompt_len] = [layer.keys.clone() for layer in cache.layers]
        for i in range(prompt_len, len(ids)):
            model(input_ids=torch.tensor([[ids[i]]]), position_ids=torch.tensor([[i]]), past_key_values=cache,
                  use_cache=True)  # fmt: skip
            out[i + 1] = [layer.keys.clone() for layer in cache.layers]
    return out


class StaticSnapshots(ScriptedRollback):
    """ScriptedRollback over a static backend: after every rollback, per layer the K rows the
    next query (at the committed length n) can see: positions in (n - W, n) for a sliding
    layer of window W (the query's own row is written by its step), [0, n) for a full one."""

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)
        rows = []
        for i, w in enumerate(self.inner.windows):
            lo = 0 if w is None else max(0, length - w + 1)
            rows.append((lo, self.inner.k[i][:, :, lo:length].clone()))
        self.snapshots.append((length, rows))


@pytest.mark.parametrize("family", ["mistral", "qwen3_interleaved", "qwen3_moe_window"])
@pytest.mark.parametrize("prompt_len", [40, 3])  # 3: the window fills while decoding
def test_scripted_schedules_see_exactly_the_one_by_one_rows(family, prompt_len):
    model = make(family)
    prompt = prompt_ids(prompt_len)
    truth = greedy(model, prompt, 60)
    ref = _one_by_one_kv(model, prompt + truth, prompt_len)
    inner = static(model)
    for schedule in ([15, 0, 3, 0, 0, 15], [0], [15]):
        be = StaticSnapshots(inner, truth, prompt_len, schedule)
        rounds = list(
            speculative_generate(be, prompt, block_size=16, max_new_tokens=56, stop_ids=[])
        )
        assert [t for r in rounds for t in r.tokens] == truth[:56], schedule
        accepted = [r.accepted for r in rounds[1:]]
        if schedule[0] == 15 and len(schedule) > 1:
            assert accepted[:6] == [16, 1, 4, 1, 1, 16]  # full blocks and zero-accept steps
        elif schedule == [0]:
            assert set(accepted) == {1}
        assert be.snapshots
        for length, rows in be.snapshots:
            for (lo, got), want in zip(rows, ref[length], strict=True):
                torch.testing.assert_close(got, want[:, :, lo:length], rtol=1e-4, atol=1e-4)
        assert any(lo > 0 for n, rows in be.snapshots for lo, _ in rows)  # some window slid


def test_moe_routes_agree_and_follow_transformers():
    """The expert block: the gather route equals transformers' own block (float32 rounding),
    and the grouped_mm route equals the gather route, with norm_topk_prob on and off."""
    import torch.nn.functional as F

    from dflash.backends.static.moe import moe_block, moe_forward

    for norm in (True, False):
        model = make("qwen3_moe")
        model.config.norm_topk_prob = norm
        block = model.model.layers[0].mlp
        block.gate.norm_topk_prob = norm
        assert moe_block(block)
        h = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            want = block(h)
            got = moe_forward(block, h, "gather")
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # another summation order
            if hasattr(F, "grouped_mm"):
                torch.testing.assert_close(
                    moe_forward(block, h, "grouped"), got, rtol=1e-4, atol=1e-5
                )
    assert not moe_block(model.model.layers[0].self_attn)


@pytest.mark.parametrize("family", ["muse_glimmer"])  # gpt-oss and Gemma: test_static_gemma_gpt_oss.py
def test_other_families_are_refused_with_a_reason(family):
    model = build(family)
    why = static_refusal(model)
    assert why is not None and "plain path" in why
    with pytest.raises(Exception, match="cannot run this target"):
        StaticBackend(model, None, torch.device("cpu"), use_graphs=False)


def test_one_warning_line_when_cuda_falls_back():
    """On CUDA a target the static path refuses runs on the plain path after one stderr line
    naming why; nothing is said off CUDA, for supported targets, or with the flag given."""
    from dflash.backends.transformers import plain_path_note

    why = static_refusal(build("muse_glimmer"))
    note = plain_path_note("cuda", why, None)
    assert note == (f"dflash: the CUDA-graph path cannot run this target ({why}); using the plain path "
                    "(--no-cuda-graphs silences this).")  # fmt: skip
    assert "\n" not in note and "muse_glimmer targets run on the plain path" in note
    assert plain_path_note("cpu", why, None) is None
    assert plain_path_note("cuda", None, None) is None
    assert plain_path_note("cuda", why, False) is None
