"""Draft config loading and validation: published configs (tests/fixtures), round trips and every
bad input."""

from __future__ import annotations

import json

import pytest
import torch

from dflash.errors import CheckpointError, ConfigError
from dflash.models.config import DraftConfig, default_target_layer_ids
from dflash.models.draft_torch import DFlashDraft


def load_fixture(fixtures_dir, name):
    return json.loads((fixtures_dir / name).read_text())


@pytest.mark.parametrize("name,ids,bs", [("qwen3-8b-dflash-config.json", [1, 9, 17, 25, 33], 16),
                                         ("qwen2.5-0.5b-dflash-config.json", [1, 6, 11, 16, 21], 16)])  # fmt: skip
def test_published_configs_load(fixtures_dir, name, ids, bs):
    d = load_fixture(fixtures_dir, name)
    cfg = DraftConfig.from_dict(d)
    assert cfg.target_layer_ids == ids and cfg.block_size == bs
    assert cfg.mask_token_id == d["dflash_config"]["mask_token_id"]
    assert cfg.rope["rope_theta"] == d["rope_theta"]
    assert cfg.layer_types == ["full_attention"] * 5 and not any(cfg.layer_is_causal(i) for i in range(5))
    again = DraftConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    assert "auto_map" not in cfg.to_dict()  # we never point at remote code


def test_published_shapes_scaled_down_build_and_run(fixtures_dir):
    """The Qwen2.5-0.5B fixture's layout at a quarter of the width builds and runs a block."""
    d = load_fixture(fixtures_dir, "qwen2.5-0.5b-dflash-config.json")
    d.update(hidden_size=224, intermediate_size=448, num_attention_heads=7, num_key_value_heads=1,
             head_dim=32, vocab_size=1000, dflash_config={**d["dflash_config"], "mask_token_id": 999})  # fmt: skip
    model = DFlashDraft(DraftConfig.from_dict(d)).eval()
    assert model.fc.in_features == 5 * 224
    cache = model.new_cache()
    h = model(torch.randn(1, 16, 224), torch.randn(1, 7, 5 * 224), torch.arange(7, 23)[None],
              torch.arange(0, 7)[None], cache=cache)  # fmt: skip
    assert h.shape == (1, 16, 224) and cache.length == 7


def test_nested_and_flat_block_size():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 100,
            "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2]}}  # fmt: skip
    assert DraftConfig.from_dict({**base, "block_size": 8}).block_size == 8
    nested = {**base, "block_size": 8, "dflash_config": {**base["dflash_config"], "block_size": 10}}
    assert DraftConfig.from_dict(nested).block_size == 10
    assert DraftConfig.from_dict(base).block_size == 16


def test_sliding_layers_are_causal_and_windowed():
    d = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 100, "sliding_window": 4,
         "layer_types": ["sliding_attention", "full_attention"],
         "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2]}}  # fmt: skip
    model = DFlashDraft(DraftConfig.from_dict(d))
    q = torch.arange(10, 14)[None]
    k = torch.cat((torch.arange(0, 10), torch.arange(10, 14)))[None]
    masks = model.inference_masks(q, k)
    assert masks["full_attention"] is None
    m = masks["sliding_attention"][0, 0]
    brute = torch.tensor([[0 <= int(qq) - int(kk) < 4 for kk in k[0]] for qq in q[0]])
    assert torch.equal(m, brute)


@pytest.mark.parametrize(
    "patch,msg",
    [({"layer_types": ["full_attention"]}, "layer_types"),
     ({"layer_types": ["full_attention", "weird"]}, "unknown layer_types"),
     ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
     ({"dflash_config": {"target_layer_ids": [1, 2]}}, "mask_token_id"),
     ({"dflash_config": {"mask_token_id": 5}}, "target_layer_ids"),
     ({"dflash_config": {"mask_token_id": 100, "target_layer_ids": [1]}}, "outside the vocabulary"),
     ({"architectures": ["DFlash2DraftModel"], "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2],
                                                                "conv_group_size": 6}}, "conv_group_size"),
     ({"block_size": 0}, "block_size")],
)  # fmt: skip
def test_bad_configs(patch, msg):
    d = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 100,
         "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2]}}  # fmt: skip
    d.update(patch)
    with pytest.raises(ConfigError, match=msg):
        DraftConfig.from_dict(d)


def test_default_target_layer_ids_match_published():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(52, 5) == [1, 13, 25, 37, 49]
    assert default_target_layer_ids(24, 1) == [12]


def test_save_load_round_trip_sharded(tmp_path, tiny_target):
    from tests.helpers.tiny import make_draft

    draft = make_draft(tiny_target, layers=2)
    draft.save(tmp_path / "d", max_shard_bytes=50_000)
    assert len(list((tmp_path / "d").glob("*.safetensors"))) > 1
    assert (tmp_path / "d" / "model.safetensors.index.json").is_file()
    again = DFlashDraft.load(tmp_path / "d")
    x, ctx = torch.randn(1, 16, 64), torch.randn(1, 5, draft.feature_width)
    q, c = torch.arange(5, 21)[None], torch.arange(0, 5)[None]
    with torch.no_grad():
        assert torch.equal(draft(x, ctx, q, c), again(x, ctx, q, c))


def test_missing_and_corrupt_checkpoints(tmp_path, tiny_target):
    from tests.helpers.tiny import make_draft

    with pytest.raises(CheckpointError, match="No config.json"):
        DFlashDraft.load(tmp_path)
    make_draft(tiny_target).save(tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="Cannot read draft weights"):
        DFlashDraft.load(tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="No .safetensors"):
        DFlashDraft.load(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        DFlashDraft.load(tmp_path / "d")


def test_fc_width_mismatch(tmp_path, tiny_target):
    from tests.helpers.tiny import make_draft

    make_draft(tiny_target, layers=2).save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 2, 3]  # 3 features but fc was built for 2
    cfg["num_hidden_layers"] = 2
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="fc.weight"):
        DFlashDraft.load(tmp_path / "d")


def test_check_pair(tiny_target):
    from dflash.backends.plain import check_pair
    from tests.helpers.tiny import make_draft

    cfg = make_draft(tiny_target).config
    check_pair(cfg, tiny_target.config, 256, [2])
    bad_ids = DraftConfig.from_dict({**cfg.to_dict(), "dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 6]}})
    with pytest.raises(ConfigError, match="reach past"):
        check_pair(bad_ids, tiny_target.config, 256, [2])
    with pytest.raises(ConfigError, match="vocab_size"):
        check_pair(cfg, tiny_target.config, 300, [2])
    with pytest.raises(ConfigError, match="stop token"):
        check_pair(cfg, tiny_target.config, 256, [255])


@pytest.mark.parametrize("scaling", [{"type": "linear", "factor": 4.0},
                                     {"rope_type": "linear", "factor": 4.0}])  # fmt: skip
def test_legacy_rope_scaling_survives_a_resave(tmp_path, scaling):
    """``rope_scaling: {"type": ...}`` (legacy form) keeps its scaling through save + reload."""
    d = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 64,
         "rope_theta": 10000.0, "rope_scaling": scaling,
         "dflash_config": {"mask_token_id": 63, "target_layer_ids": [0], "block_size": 8}}  # fmt: skip
    cfg = DraftConfig.from_dict(d)
    assert cfg.rope["rope_type"] == "linear" and "type" not in cfg.rope
    cfg.save(tmp_path)
    again = DraftConfig.load(tmp_path)
    assert again.rope["rope_type"] == "linear" and again.rope["factor"] == 4.0
    base = DraftConfig.from_dict({**d, "rope_scaling": None})
    ref = DFlashDraft(base).inv_freq
    torch.testing.assert_close(DFlashDraft(again).inv_freq, ref / 4.0)  # linear: positions / 4
