"""init-draft on mlx-lm folders (nested text_config, quantized weights, types transformers lacks)
and the MLX backend on a quantized target."""

from __future__ import annotations

import json

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from dflash.models.config import DraftConfig  # noqa: E402
from dflash.models.init_draft import init_draft, target_config  # noqa: E402
from tests.helpers.mlx_models import build_target, greedy_reference, random_prompt  # noqa: E402


def test_init_draft_for_a_nested_text_config_target(tmp_path):
    import dflash

    target = build_target(tmp_path / "t", "qwen3_5")
    out = init_draft(str(target), tmp_path / "d", layers=1, block_size=8, dtype="float32")
    cfg = DraftConfig.load(out)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.block_size) == (64, 1000, 8)
    assert cfg.target_layer_ids == [2]  # a 4-layer target, one feature layer: the middle one
    assert cfg.mask_token_id != 3  # never the EOS id
    pipe = dflash.load(str(target), str(out), backend="mlx")
    prompt = random_prompt(8, seed=1)
    got = pipe.generate(prompt, max_new_tokens=20, stop_ids=[]).token_ids
    assert got == greedy_reference(target, prompt, 20)


def test_config_of_a_model_type_transformers_does_not_know(tmp_path):
    target = build_target(tmp_path / "t", "qwen3")
    cfg = json.loads((target / "config.json").read_text())
    cfg = {"model_type": "some_mlx_only_family", "text_config": cfg}
    (target / "config.json").write_text(json.dumps(cfg))
    t = target_config(str(target))
    assert (t.hidden_size, t.num_hidden_layers, t.vocab_size) == (64, 4, 1000)


def test_quantized_target_parity(tmp_path):
    """A 4-bit mlx-lm target (mlx_lm.convert -q) with a draft made by init-draft."""
    from mlx_lm import convert

    import dflash

    src = build_target(tmp_path / "t", "qwen3")
    q = tmp_path / "q"
    convert(str(src), mlx_path=str(q), quantize=True, q_group_size=32, q_bits=4)
    assert "quantization" in json.loads((q / "config.json").read_text())
    draft = init_draft(str(q), tmp_path / "d", layers=1, block_size=16, dtype="float32")
    pipe = dflash.load(str(q), str(draft), backend="mlx", draft_bits=8)
    prompt = random_prompt(8, seed=2)
    got = pipe.generate(prompt, max_new_tokens=24, stop_ids=[]).token_ids
    assert got == greedy_reference(q, prompt, 24)


def test_init_draft_without_torch_writes_a_checkpoint_torch_reads(tmp_path, monkeypatch):
    """On an mlx-only install the draft is written by MLX; the torch draft loads it unchanged."""
    import numpy as np

    from dflash.models import init_draft as module
    from dflash.models.draft_mlx import load_draft_mlx

    target = build_target(tmp_path / "t", "llama")
    monkeypatch.setattr(module, "_import_torch", lambda: None)
    out = init_draft(str(target), tmp_path / "d", layers=1, block_size=8, dtype="float32")
    torch = pytest.importorskip("torch")
    from dflash.models.draft_torch import DFlashDraft

    tdraft = DFlashDraft.load(out, dtype=torch.float32)
    mdraft = load_draft_mlx(out)
    w_t = tdraft.state_dict()["layers.0.mlp.up_proj.weight"].numpy()
    np.testing.assert_array_equal(w_t, np.array(mdraft.layers[0].mlp.up_proj.weight))
