"""``dflash models`` and ``--model X`` without ``--draft``: the published pairs (issue 51)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash.cli import app
from dflash.errors import CheckpointError
from dflash.registry import PAIRS, base_name, find
from tests.helpers.cli import ENV
from tests.helpers.paths import FIXTURES_DIR as FIXTURES


def hub_cache_with(tmp_path: Path, repo: str) -> Path:
    """A Hugging Face hub cache holding one snapshot of ``repo``: the published Qwen3-8B draft
    config (no weights), as ``snapshot_download`` leaves it; returns the cache folder."""
    cache = tmp_path / "hub"
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    shutil.copy(FIXTURES / "qwen3-8b-dflash-config.json", snap / "config.json")
    return cache


def test_models_lists_every_published_pair():
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["target"] for r in rows] == [p.target for p in PAIRS]
    by_target = {r["target"]: r for r in rows}
    qwen = by_target["Qwen/Qwen3-8B"]
    assert qwen["draft"] == "z-lab/Qwen3-8B-DFlash-b16" and qwen["block_size"] == 16
    assert qwen["runs"] == {"cuda_graphs": "yes", "transformers": "yes", "mlx": "yes"}
    moe = by_target["Qwen/Qwen3-Coder-30B-A3B-Instruct"]["runs"]
    assert (
        moe["cuda_graphs"] == "yes" and moe["transformers"] == "yes"
    )  # expert blocks in the graphs
    hybrid = by_target["Qwen/Qwen3.5-9B"]["runs"]
    assert hybrid["mlx"] == "yes" and hybrid["transformers"] == "yes"
    assert hybrid["cuda_graphs"].startswith("untested: GatedDeltaNet layers in the graphs")
    for sliding in ("openai/gpt-oss-20b", "google/gemma-4-31B-it", "meta-models/Muse-Glimmer-30B"):
        runs = by_target[sliding]["runs"]
        assert runs["transformers"] == "yes"
        graphs = runs["cuda_graphs"]  # gpt-oss and Gemma: dflash/backends/static/families.py
        assert (
            graphs == "yes"
            if "Muse" not in sliding
            else graphs.startswith("no: a multimodal wrapper")
        )
        # rotating caches roll back on mlx: gemma4 and gpt_oss tested, Muse-Glimmer not run
        want = "untested: rotating" if "Muse" in sliding else "yes"
        assert runs["mlx"].startswith(want), sliding
    table = CliRunner().invoke(app, ["models"])
    assert table.exit_code == 0 and "z-lab/Qwen3-8B-DFlash-b16" in table.stdout


@pytest.mark.parametrize("model,target,exact", [
    ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B", True),
    ("qwen/qwen3-8b", "Qwen/Qwen3-8B", True),
    ("mlx-community/Qwen3-8B-4bit", "Qwen/Qwen3-8B", False),
    ("/models/Qwen3-4B-MLX-bf16/", "Qwen/Qwen3-4B", False),
    ("Qwen3.5-9B-Q4_K_M.gguf", "Qwen/Qwen3.5-9B", False),
])  # fmt: skip
def test_a_target_matches_by_hub_id_or_by_name(model, target, exact):
    pair, how = find(model)
    assert (pair.target, how) == (target, exact)


def test_other_models_match_nothing():
    assert find("Qwen/Qwen3-8B-Base") is None and find("some/model") is None
    assert base_name("mlx-community/Qwen3-Coder-Next-8bit") == "qwen3-coder-next"


def test_a_registered_target_resolves_its_draft_offline(tmp_path):
    """The registered draft comes from the hub cache with the hub unreachable (a stand-in
    snapshot holding its config), and one stderr line says which draft and why."""
    cache = hub_cache_with(tmp_path, "z-lab/Qwen3-8B-DFlash-b16")
    code = (
        "from dflash.models.target_torch import resolve_draft\n"
        "print(resolve_draft(None, 'Qwen/Qwen3-8B'))\nprint(resolve_draft(None, 'Qwen/Qwen3-8B'))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**ENV, "HF_HUB_CACHE": str(cache)}, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    first, second = p.stdout.split()
    assert first == second and (Path(first) / "config.json").is_file()
    assert Path(first).is_relative_to(cache)
    notes = p.stderr.strip().splitlines()
    assert len(notes) == 1, p.stderr  # once per process
    assert notes[0].startswith("dflash: --draft not given; using z-lab/Qwen3-8B-DFlash-b16 "
                               "(the published draft for Qwen/Qwen3-8B")  # fmt: skip


def test_draft_overrides_the_registry(tmp_path, capsys):
    from dflash.models.target_torch import resolve_draft

    own = tmp_path / "mine"
    own.mkdir()
    assert resolve_draft(str(own), "Qwen/Qwen3-8B") == own
    assert capsys.readouterr().err == ""


def test_an_unregistered_target_still_needs_a_draft():
    from dflash.models.target_torch import resolve_draft

    with pytest.raises(CheckpointError, match="--draft is required") as err:
        resolve_draft(None, "some/model")
    assert "dflash models" in err.value.hint and "init-draft --target some/model" in err.value.hint


def test_local_draft_block_size_reads_only_what_is_here(tmp_path):
    """The trained block size a hint names before loading: a draft folder's, the demo draft's, a
    registered draft's from the hub cache; None for a draft not on this machine or unreadable,
    and never a stderr note or a download (the hub is unreachable here)."""
    cache = hub_cache_with(tmp_path, "z-lab/Qwen3-8B-DFlash-b16")
    snap = next((cache / "models--z-lab--Qwen3-8B-DFlash-b16" / "snapshots").iterdir())
    cfg = json.loads((snap / "config.json").read_text())
    (snap / "config.json").write_text(json.dumps({**cfg, "block_size": 10}))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text(json.dumps({**cfg, "block_size": 8}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    code = ("from dflash.models.target_torch import local_draft_block_size as f\n"
            f"print([f({str(tmp_path / 'mine')!r}, 'Qwen/Qwen3-8B'), f(None, None), f(None, 'Qwen/Qwen3-8B'),"
            f" f(None, 'some/model'), f('no-such/draft', None), f({str(tmp_path / 'broken')!r}, None),"
            f" f({str(tmp_path / 'missing')!r}, None)])")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**ENV, "HF_HUB_CACHE": str(cache)}, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[0] == "[8, 16, 10, None, None, None, None]"
    assert p.stderr == ""


def test_generate_says_which_draft_it_uses_before_loading(tmp_path):
    """`generate --model Qwen/Qwen3-8B` without --draft: the note, then (the target itself is
    not in the cache) one error line about the target, not "--draft is required"."""
    cache = hub_cache_with(tmp_path, "z-lab/Qwen3-8B-DFlash-b16")
    p = subprocess.run([sys.executable, "-m", "dflash", "generate", "transformers", "hi",
                        "--model", "Qwen/Qwen3-8B", "--device", "cpu"], capture_output=True, text=True,
                       env={**ENV, "HF_HUB_CACHE": str(cache)}, timeout=300)  # fmt: skip
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("dflash: --draft not given; using z-lab/Qwen3-8B-DFlash-b16"), (
        p.stderr
    )
    assert lines[1].startswith("error: ") and "Qwen/Qwen3-8B" in lines[1], p.stderr
    assert "--draft is required" not in p.stderr


def test_graph_path_column_follows_the_static_families():
    """Windows are masks on the CUDA-graph path: Mistral/Qwen with sliding layers and Qwen3-MoE
    run there, and Gemma and gpt-oss through their own forward; Muse-Glimmer stays on the plain path."""
    from dflash.registry import family_support

    for family in ("mistral", "qwen2", "qwen3"):
        runs = family_support(family, "sliding-window + full layers")
        assert runs["cuda_graphs"] == "yes" and runs["mlx"].startswith("untested: rotating"), family
    assert family_support("qwen3_moe", "MoE, full attention")["cuda_graphs"] == "yes"
    assert family_support("qwen3_moe", "MoE, sliding-window")["mlx"].startswith(
        "untested: rotating"
    )
    for family in ("gemma4", "gpt_oss", "gemma3_text"):
        assert family_support(family, "sliding-window + full layers")["cuda_graphs"] == "yes", (
            family
        )
    assert family_support("dense ?", "3:1 sliding + full layers")["cuda_graphs"].startswith("no:")
