"""Which targets the transformers backend speculates on: full-attention and sliding-window causal
LMs (dense or MoE) and the GatedDeltaNet hybrids Qwen3-Next and Qwen3.5; chunked attention and
other recurrent layers are refused.

Refusals come from the config alone, before any weights load (the folders here hold a
config.json and nothing else), in ``load`` and in ``init-draft``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import transformers

from dflash.errors import BackendError
from dflash.models.target_torch import check_target_layers, layer_kinds

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def config(name: str, **kwargs):
    return getattr(transformers, name)(**{**SMALL, **kwargs})


REFUSED = [
    ("KimiLinearConfig", {}, "4 linear_attention layers of 4", "Qwen3-Next or Qwen3.5"),
    ("Llama4TextConfig", {"attention_chunk_size": 16}, "3 chunked_attention layers of 4",
     "full-attention or sliding-window"),
    ("Qwen3Config", {"layer_types": ["sliding_attention"] * 4}, "no positive sliding_window",
     "set sliding_window"),
]  # fmt: skip
ACCEPTED = [
    ("LlamaConfig", {}, ["full_attention"] * 4),
    ("Qwen2Config", {}, ["full_attention"] * 4),
    ("Qwen3Config", {}, ["full_attention"] * 4),
    ("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 4}, ["full_attention"] * 4),
    ("MistralConfig", {"sliding_window": None}, ["full_attention"] * 4),
    ("MistralConfig", {"sliding_window": 4096}, ["sliding_attention"] * 4),
    ("MistralConfig", {}, ["sliding_attention"] * 4),  # Mistral's default window
    ("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 2},
     ["full_attention"] * 2 + ["sliding_attention"] * 2),
    ("Gemma2Config", {}, ["sliding_attention", "full_attention"] * 2),
    ("Gemma3TextConfig", {}, ["sliding_attention"] * 4),  # 5 sliding : 1 full, from layer 6
    ("GptOssConfig", {}, ["sliding_attention", "full_attention"] * 2),
    ("Qwen3MoeConfig", {}, ["full_attention"] * 4),
    ("Qwen3NextConfig", {}, ["linear_attention"] * 3 + ["full_attention"]),
    ("Qwen3_5TextConfig", {}, ["linear_attention"] * 3 + ["full_attention"]),
    ("Qwen3_5MoeTextConfig", {}, ["linear_attention"] * 3 + ["full_attention"]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "kwargs", "fragment", "hint"), REFUSED)
def test_chunked_and_recurrent_targets_are_refused(name, kwargs, fragment, hint):
    cfg = config(name, **kwargs)
    with pytest.raises(BackendError) as err:
        check_target_layers(cfg, "m")
    assert fragment in err.value.message and "\n" not in err.value.message
    assert hint in err.value.hint


@pytest.mark.parametrize(("name", "kwargs", "kinds"), ACCEPTED)
def test_full_and_sliding_targets_pass(name, kwargs, kinds):
    cfg = config(name, **kwargs)
    check_target_layers(cfg, "m")
    assert layer_kinds(cfg) == kinds


@pytest.fixture
def chunked_config_only(tmp_path):
    """A Llama 4 text target folder (chunked attention) holding its config.json and no weights
    or tokenizer."""
    folder = tmp_path / "llama4"
    config("Llama4TextConfig", attention_chunk_size=16).save_pretrained(folder)
    return folder


def test_load_refuses_before_reading_weights(chunked_config_only, tmp_path, tiny_target):
    import dflash
    from tests.helpers.tiny import make_draft

    make_draft(tiny_target).save(tmp_path / "draft")
    with pytest.raises(BackendError, match="3 chunked_attention layers of 4"):
        dflash.load(str(chunked_config_only), str(tmp_path / "draft"), device="cpu")


def test_init_draft_refuses_in_one_line(chunked_config_only, tmp_path):
    out = tmp_path / "d"
    p = subprocess.run([sys.executable, "-m", "dflash", "init-draft", "--target",
                        str(chunked_config_only), "--out", str(out)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                    "DFLASH_DEBUG": ""})  # fmt: skip
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[0].startswith("error: Target ") and "chunked_attention" in lines[0], p.stderr
    assert [ln[:5] for ln in lines[1:]] == ["hint:"]
    assert not out.exists()  # nothing written


def test_a_hybrid_multimodal_wrapper_passes_by_its_text_layers():
    """Qwen3.5 as published (a vision wrapper over GatedDeltaNet + attention layers): its text
    model's type names the hybrid the plain path rolls back."""
    cfg = transformers.Qwen3_5Config(text_config=SMALL)
    check_target_layers(cfg, "m")
    assert layer_kinds(cfg) == ["linear_attention"] * 3 + ["full_attention"]
