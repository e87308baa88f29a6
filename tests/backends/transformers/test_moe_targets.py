"""MoE targets on the transformers backend's plain path: Qwen3-MoE (full attention), gpt-oss
(alternating 8-token windows, attention sinks, top-2 of 4 experts) and Gemma 4 MoE (sliding and
full layers, per-layer inputs): a folder, ``init_draft`` and ``dflash.load`` as a user would,
greedy ids equal HF ``generate`` at block sizes 1, 3 and 16; the CUDA-graph path takes only
Mistral, windowed Qwen2 and Qwen3-MoE of ``tests/helpers/target_families.py``.
"""

from __future__ import annotations

import pytest

from tests.helpers.target_families import FAMILIES, N, build, greedy, load_family, prompt_ids


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma4_moe"])
def test_moe_init_draft_load_and_greedy_parity(tmp_path, family):
    pipe, model = load_family(tmp_path, family)
    assert type(pipe.backend).__name__ == "TransformersBackend"
    prompt = prompt_ids()
    truth = greedy(model, prompt, N)
    assert len(set(truth)) > 4
    for bs in (1, 3, 16):
        assert pipe.generate(prompt, block_size=bs, max_new_tokens=N, stop_ids=[]).token_ids == truth, bs


def test_gpt_oss_has_sinks_and_experts():
    """The tiny gpt-oss is the real thing: learned attention sinks and routed experts."""
    model = build("gpt_oss")
    layer = model.model.layers[0]
    assert layer.self_attn.sinks.shape == (4,) and model.config.num_local_experts == 4
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]


STATIC_FAMILIES = ("mistral", "qwen2_window", "qwen3_moe", "gpt_oss", "gemma3_text", "gemma4_text",
                   "gemma4_kv_shared", "gemma4_moe", "qwen3_5_text", "qwen3_5_moe",
                   "qwen3_next")  # the CUDA-graph path runs these too


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cuda_graph_path_takes_only_its_families(family):
    """``supports_static`` takes Mistral, Qwen2 with windows, Qwen3-MoE, gpt-oss, Gemma 3/4 text and the GatedDeltaNet hybrids
    (``tests/backends/static/``) and sends the others to the plain path."""
    from dflash.backends.static.support import supports_static

    assert supports_static(build(family)) == (family in STATIC_FAMILIES)
