"""Which targets the transformers backend speculates on: full-attention causal LMs only.

Sliding-window and recurrent targets are refused from their config alone, before any weights
load (the folders here hold a config.json and nothing else), in ``load`` and in ``init-draft``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import transformers

from dflash.errors import BackendError
from dflash.models.target_torch import check_full_attention, layer_kinds

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def config(name: str, **kwargs):
    return getattr(transformers, name)(**{**SMALL, **kwargs})


REFUSED = [
    ("MistralConfig", {"sliding_window": 4096}, "4 sliding_attention"),
    ("MistralConfig", {}, "sliding_window 4096"),  # Mistral's default window
    ("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 2}, "2 sliding_attention"),
    ("Qwen3Config", {"use_sliding_window": True, "max_window_layers": 1}, "3 sliding_attention"),
    ("Gemma2Config", {}, "sliding_attention"),
    ("Gemma3TextConfig", {}, "sliding_attention"),
    ("Qwen3NextConfig", {}, "linear_attention"),
]
ACCEPTED = [
    ("LlamaConfig", {}),
    ("Qwen2Config", {}),
    ("Qwen3Config", {}),
    ("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 4}),  # window on no layer
    ("MistralConfig", {"sliding_window": None}),
]


@pytest.mark.parametrize(("name", "kwargs", "fragment"), REFUSED)
def test_sliding_window_and_recurrent_targets_are_refused(name, kwargs, fragment):
    cfg = config(name, **kwargs)
    with pytest.raises(BackendError, match="full-attention") as err:
        check_full_attention(cfg, "m")
    assert fragment in err.value.message and "\n" not in err.value.message


@pytest.mark.parametrize(("name", "kwargs"), ACCEPTED)
def test_full_attention_targets_pass(name, kwargs):
    cfg = config(name, **kwargs)
    check_full_attention(cfg, "m")
    assert layer_kinds(cfg) == ["full_attention"] * 4


@pytest.fixture
def mistral_config_only(tmp_path):
    """A Mistral target folder holding its config.json and no weights or tokenizer."""
    folder = tmp_path / "mistral"
    config("MistralConfig", sliding_window=16).save_pretrained(folder)
    return folder


def test_load_refuses_before_reading_weights(mistral_config_only, tmp_path, tiny_target):
    import dflash
    from tests.conftest import make_draft

    make_draft(tiny_target).save(tmp_path / "draft")
    with pytest.raises(BackendError, match="4 sliding_attention layers of 4 .sliding_window 16."):
        dflash.load(str(mistral_config_only), str(tmp_path / "draft"), device="cpu")


def test_init_draft_refuses_in_one_line(mistral_config_only, tmp_path):
    out = tmp_path / "d"
    p = subprocess.run([sys.executable, "-m", "dflash", "init-draft", "--target",
                        str(mistral_config_only), "--out", str(out)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                    "DFLASH_DEBUG": ""})  # fmt: skip
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[0].startswith("error: Target ") and "sliding_attention" in lines[0], p.stderr
    assert [ln[:5] for ln in lines[1:]] == ["hint:"]
    assert not out.exists()  # nothing written
