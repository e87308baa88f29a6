"""``--dataset long``: synthetic long prompts and τ/speedup by prompt length (issue 51)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash.bench.metrics import ResponseRecord, RunStats, by_prompt_length, summarize
from dflash.data.datasets import load_prompts, select
from dflash.data.long_context import lengths
from dflash.errors import DatasetError


def test_long_specs():
    assert lengths("long") == [1024, 2048, 4096, 8192, 16384, 32768]
    assert lengths("long:8k") == [8192]
    assert lengths("long:1k-8k") == [1024, 2048, 4096, 8192]
    for bad in ("long:0k", "long:8k-1k", "long:big", "long:1k-256k"):
        with pytest.raises(DatasetError):
            lengths(bad)


def test_long_prompts_grow_in_order_and_are_the_same_every_time():
    items = load_prompts("long:1k-4k")
    assert [i.id for i in items] == ["long/1k-0", "long/2k-0", "long/4k-0", "long/1k-1", "long/2k-1", "long/4k-1"]
    sizes = [len(i.turns[0]) for i in items]
    assert sizes[0] < sizes[1] < sizes[2] and sizes[3] < sizes[4] < sizes[5]
    for item, k in zip(items, (1, 2, 4, 1, 2, 4), strict=True):  # aimed at 1.4 k tokens of 4 characters
        assert 1.4 * k * 1024 * 4 <= len(item.turns[0]) <= 1.4 * k * 1024 * 4 + 6000
        assert item.turns[0].rstrip().endswith("step by step, and put the final answer within \\boxed{}.")
    assert items[0].turns[0] != items[3].turns[0]  # two different prompts per length
    assert [i.turns for i in load_prompts("long:1k-4k")] == [i.turns for i in items]
    assert [i.id for i in select(items, 2)] == ["long/1k-0", "long/2k-0"]  # no shuffle: a prefix


def rec(tokens: int, taus: list[int], base_s: float, fast_s: float) -> ResponseRecord:
    n = 1 + sum(taus)
    return ResponseRecord("long", f"p{tokens}", 0, tokens, 4, RunStats(n, 0.1, fast_s), RunStats(n, 0.1, base_s),
                          acceptance_lengths=taus, proposed=[3] * len(taus))  # fmt: skip


def test_tau_and_speedup_by_prompt_length():
    records = [rec(500, [4, 4], 0.8, 0.2), rec(1500, [2, 2], 0.4, 0.2), rec(1800, [4, 2], 0.6, 0.2),
               rec(9000, [1, 1], 0.2, 0.4)]  # fmt: skip
    rows = by_prompt_length(records)
    assert [(r["bucket"], r["responses"]) for r in rows] == [("<1k", 1), ("1k-2k", 2), ("8k-16k", 1)]
    assert rows[1]["prompt_tokens"] == 1650 and rows[1]["tau"] == 2.5
    assert rows[0]["speedup"] == pytest.approx(4.0) and rows[2]["speedup"] == pytest.approx(0.5)
    assert rows[1]["speedup"] == pytest.approx((0.4 / 4 + 0.6 / 6) / 2 / ((0.2 / 4 + 0.2 / 6) / 2))
    assert summarize(records)["by_prompt_length"] == rows
    assert "by_prompt_length" not in summarize(records[:1])  # short prompts only: no such table


def test_benchmark_long_prints_the_table_by_length(monkeypatch):
    """With the test pipeline (one token id per character) the prompts land in the buckets by
    their characters."""
    import typer

    from dflash.bench import command
    from tests.helpers.fakes import FakePipeline

    monkeypatch.setattr(command, "_load_pipeline", lambda *a, **k: FakePipeline())
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command()(command.benchmark)
    result = CliRunner().invoke(app, ["transformers", "--dataset", "long:1k-2k", "--max-samples", "2",
                                      "--max-new-tokens", "8"])  # fmt: skip
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "long:1k-2k: by prompt length (tokens)" in result.stdout
    rows = json.loads(result.stdout.strip().splitlines()[-1])["datasets"]["long:1k-2k"]["by_prompt_length"]
    assert [r["bucket"] for r in rows] == ["4k-8k", "8k-16k"] and all(r["responses"] == 1 for r in rows)
