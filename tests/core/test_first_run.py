"""A first run that explains itself (issue 51): progress for the GGUF conversion and the cost
calibration, and where the ``--block-size auto`` cost table comes from."""

from __future__ import annotations

import json

import pytest

from dflash import auto_block_costs
from dflash.auto_block_costs import CALIBRATION_REPEATS, load_or_measure_costs
from dflash.errors import CheckpointError

WIDTHS = [1, 2, 4, 16]
KEY = {"backend": "tiny", "device": "cpu"}


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(auto_block_costs, "CALIBRATION_REPEATS", 1)  # a quick calibration
    monkeypatch.setattr(auto_block_costs, "load_per_core", lambda: 0.25)
    return tmp_path


def quick_measure(monkeypatch):
    real = auto_block_costs.measure_costs
    monkeypatch.setattr(auto_block_costs, "measure_costs",
                        lambda b, w, on_step=None: real(b, w, prompt_len=16, repeats=1, on_step=on_step))  # fmt: skip


def test_calibration_shows_progress_and_says_where_the_table_is(tiny_backend, cache, monkeypatch, capsys):
    quick_measure(monkeypatch)
    table = load_or_measure_costs(tiny_backend, KEY, WIDTHS)
    err = capsys.readouterr().err
    steps = (1 + 1) * len(WIDTHS)  # (repeats + 1) rounds of every width
    assert "dflash: measuring step costs at widths 1, 2, 4, 16" in err
    assert "calibrating --block-size auto" in err and f"{steps}/{steps}" in err
    files = list((cache / "costs").glob("*.json"))
    assert len(files) == 1 and table.path == str(files[0])
    prov = table.provenance()
    assert prov["source"] == "measured" and prov["path"] == str(files[0]) and prov["load_per_core"] == 0.25
    import platform

    assert prov["host"] == platform.node() and table.key["host"] == platform.node()
    assert table.describe() == f"cost table measured now, load 0.25 per core; saved to {files[0]}"

    again = load_or_measure_costs(tiny_backend, KEY, WIDTHS)
    assert again.source == "cache" and again.path == str(files[0])
    assert again.describe() == (f"cost table loaded from {files[0]} (measured {prov['at']} on "
                                f"{platform.node()}, load 0.25 per core)")  # fmt: skip
    assert capsys.readouterr().err == ""  # read from the cache under the same load: silent
    assert CALIBRATION_REPEATS >= 1


def test_another_machines_table_is_not_used(tiny_backend, cache, monkeypatch, capsys):
    quick_measure(monkeypatch)
    load_or_measure_costs(tiny_backend, KEY, WIDTHS)
    monkeypatch.setattr("platform.node", lambda: "another-machine")
    other = load_or_measure_costs(tiny_backend, KEY, WIDTHS)
    assert other.source == "measured" and other.key["host"] == "another-machine"
    assert len(list((cache / "costs").glob("*.json"))) == 2


def test_a_table_measured_under_another_load_is_named(tiny_backend, cache, monkeypatch, capsys):
    quick_measure(monkeypatch)
    load_or_measure_costs(tiny_backend, KEY, WIDTHS)
    capsys.readouterr()
    monkeypatch.setattr(auto_block_costs, "load_per_core", lambda: 1.5)
    table = load_or_measure_costs(tiny_backend, KEY, WIDTHS)
    assert table.source == "cache"
    assert capsys.readouterr().err.strip() == (
        "dflash: the --block-size auto cost table was measured under another load (0.25 per core then, "
        "1.50 now): its block sizes may suit that load; pass --recalibrate to measure again")  # fmt: skip


def test_json_and_verbose_carry_the_provenance(tiny_backend, cache, monkeypatch):
    """The policy summary (generate --json's block_policy) names the table's source and path."""
    from dflash.auto_block import BlockPolicy, load_acceptance

    quick_measure(monkeypatch)
    table = load_or_measure_costs(tiny_backend, KEY, WIDTHS)
    policy = BlockPolicy(table, load_acceptance(None, 16), 16)
    summary = json.loads(json.dumps(policy.summary()))
    assert summary["cost_source"] == "measured"
    assert summary["cost_table"]["path"] == table.path and summary["cost_table"]["source"] == "measured"


def test_gguf_conversion_shows_its_phases(tmp_path, monkeypatch, capsys):
    """A GGUF conversion says so and shows its phase on stderr (here it fails on a file that is
    not GGUF: the one-line error follows the progress)."""
    from dflash.models.target_torch import gguf_to_cached_folder

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(CheckpointError, match="Cannot read GGUF file"):
        gguf_to_cached_folder(bad)
    err = capsys.readouterr().err
    assert err.startswith(f"dflash: converting x.gguf to safetensors once (cached in {tmp_path / 'cache' / 'targets'})")
    assert "reading the tokenizer" in err


def test_the_tensor_bar_counts_transformers_tensors():
    """transformers' own tqdm over the GGUF tensors feeds dflash's bar: the total, then one unit
    per tensor."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from dflash.models.target_torch import _gguf_bar

    calls = []
    saved = gguf_utils.tqdm
    with _gguf_bar(lambda n=1, description=None, total=None: calls.append((n, description, total))):
        assert list(gguf_utils.tqdm(["a", "b", "c"], desc="Converting")) == ["a", "b", "c"]
    assert gguf_utils.tqdm is saved
    assert calls == [(0, "dequantizing tensors", 3), (1, None, None), (1, None, None), (1, None, None)]
