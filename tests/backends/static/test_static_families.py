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

import functools

import pytest
import torch

from dflash.backends.static.backend import StaticBackend
from dflash.backends.static.support import layer_windows, static_refusal, supports_static
from tests.helpers.static_families import check_scripted_rows, run, static
from tests.helpers.target_families import BASE, WINDOW, build, greedy, prompt_ids

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


@functools.cache
def model_of(family: str):
    """(model, HF greedy ids) once per family per test session (building them is most of the cost)."""
    model = make(family)
    return model, greedy(model, prompt_ids(), N + 16)


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
        assert run(be, prompt_ids(), 16, N) != truth[:N]
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
        assert run(be, prompt, bs, N) == truth[:N], (family, attention, bs)


@pytest.mark.parametrize("family", ["mistral", "qwen3_interleaved", "qwen3_moe_window"])
@pytest.mark.parametrize("prompt_len", [40, 3])  # 3: the window fills while decoding
def test_scripted_schedules_see_exactly_the_one_by_one_rows(family, prompt_len):
    check_scripted_rows(make(family), prompt_len, [[15, 0, 3, 0, 0, 15], [0], [15]])


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


@pytest.mark.parametrize(
    "family", ["muse_glimmer"]
)  # gpt-oss and Gemma: test_static_gemma_gpt_oss.py
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
