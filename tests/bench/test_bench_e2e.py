"""End to end: ``dflash benchmark transformers`` on the real demo target (SmolLM2-135M-Instruct)
with 2 samples of every benchmark dataset from ``tests/data``; greedy parity must be 100%.

The draft is an untrained one made by ``init-draft`` (block size 4), so acceptance is low, but
every verify step still runs and the outputs must equal plain greedy decoding token for token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dflash.bench.harness import read_records
from tests.helpers.paths import DATA_DIR

DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")


pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread (tests/conftest.py)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from dflash.models.init_draft import init_draft

    out = tmp_path_factory.mktemp("draft")
    return init_draft(None, out, layers=1, block_size=4, dtype="float32")


@pytest.mark.slow
def test_benchmark_on_the_demo_target_keeps_greedy_parity(draft_dir, tmp_path, monkeypatch):
    from dflash.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out_file = tmp_path / "results.jsonl"
    args = ["benchmark", "transformers", "--draft", str(draft_dir), "--device", "cpu",
            "--dtype", "float32", "--dataset", ",".join(DATASETS), "--max-samples", "1",
            "--max-new-tokens", "8", "--data-dir", str(DATA_DIR), "--check-parity",
            "--output", str(out_file)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["config"]["block_size"] == 4
    for name in DATASETS:
        s = summary["datasets"][name]
        expected = 2 if name == "mt-bench" else 1  # MT-Bench: two turns per prompt
        assert s["responses"] == expected and s["prompts"] == 1
        assert s["parity"] == {"checked": expected, "matched": expected, "near_tie": 0,
                               "unexplained": 0, "mismatches": []}  # fmt: skip
        assert s["dflash_tok_s"] > 0 and s["baseline_tok_s"] > 0
        assert 1.0 <= s["tau_mean_of_responses"] <= 4.0
    records = read_records(out_file)
    assert len(records) == 6 and len({r.key for r in records}) == 6
    for r in records:
        assert r.parity is True
        assert r.baseline.new_tokens == r.dflash.new_tokens <= 8
        assert sum(r.acceptance_lengths) + 1 == r.dflash.new_tokens
        assert all(p <= 3 for p in r.proposed)
    second_turns = [r for r in records if r.dataset == "mt-bench" and r.turn == 1]
    first_turns = {r.id: r for r in records if r.dataset == "mt-bench" and r.turn == 0}
    for r in second_turns:  # the second prompt holds the first turn and the model's answer
        assert r.prompt_tokens > first_turns[r.id].prompt_tokens + 5


def test_cli_reports_bad_input_as_one_error_line():
    proc = subprocess.run(
        [sys.executable, "-m", "dflash", "benchmark", "transformers", "--dataset", "gsm9k",
         "--data-dir", str(DATA_DIR)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "DFLASH_DEBUG": ""},
    )  # fmt: skip
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: Unknown dataset 'gsm9k'. Available: gsm8k, math500")
    assert all(line.startswith(("error:", "hint:")) for line in lines)
