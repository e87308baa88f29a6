"""The benchmark prompts shipped with dflash: used without the hub, in the benchmark's order."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import time

import pytest

from dflash.data import offline
from dflash.data.datasets import BENCHMARK_NAMES, SELECT_SEED, load_prompts, select
from dflash.errors import DatasetError
from tests.helpers.paths import DATA_DIR


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """An empty dflash cache (no dataset copies) and no data dir."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DFLASH_DATA_DIR", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def no_download(monkeypatch):
    """Fail the test if anything tries the hub's datasets."""
    import datasets

    def refuse(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(datasets, "load_dataset", refuse)


def test_every_benchmark_set_is_shipped_with_its_licence():
    index = offline.shipped_index()
    assert sorted(index) == sorted(BENCHMARK_NAMES)
    notice = (offline.OFFLINE_DIR / "NOTICE.md").read_text(encoding="utf-8")
    for name, licence in (("gsm8k", "MIT"), ("math500", "MIT"), ("humaneval", "MIT"),
                          ("mbpp", "CC-BY-4.0"), ("mt-bench", "Apache-2.0")):  # fmt: skip
        line = next(ln for ln in notice.splitlines() if ln.startswith(f"| `{name}.jsonl.gz`"))
        assert licence in line
        assert index[name]["rows"] == min(128, index[name]["of"])
    assert (index["gsm8k"]["of"], index["mt-bench"]["of"], index["mbpp"]["of"]) == (1319, 80, 257)


@pytest.mark.parametrize("name", BENCHMARK_NAMES)
def test_shipped_rows_are_the_benchmarks_first_picks_in_order(name):
    """Row i of a shipped file is the split's row order[i] of the Random(42) shuffle that
    select() applies to the full split."""
    rows, total = offline.shipped_rows(name)
    order = list(range(total))
    random.Random(SELECT_SEED).shuffle(order)
    assert [r["_index"] for r in rows] == order[: len(rows)]
    if name == "mt-bench":  # all 80 questions, ids 81..160 in split order
        assert [r["question_id"] for r in rows] == [81 + i for i in order]


def test_shipped_rows_are_verbatim(fresh_cache):
    """Where the tests' own rows (the first rows of each split) were picked, the shipped row
    holds the same fields and values."""
    shipped = {r["_index"]: r for r in offline.shipped_rows("gsm8k")[0]}
    with open(DATA_DIR / "gsm8k" / "test.jsonl", encoding="utf-8") as f:
        ours = [json.loads(line) for line in f]
    both = [i for i in range(len(ours)) if i in shipped]
    for i in both:
        assert {k: v for k, v in shipped[i].items() if k != "_index"} == ours[i]
    with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        he = {r["task_id"]: r for r in map(json.loads, f)}
    for r in offline.shipped_rows("humaneval")[0]:
        if r["task_id"] in he:
            assert {k: v for k, v in r.items() if k != "_index"} == he[r["task_id"]]


def test_offline_env_uses_the_shipped_prompts_without_asking(fresh_cache, no_download, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    items = load_prompts("gsm8k")
    assert isinstance(items, offline.ShippedPrompts) and len(items) == 128 and items.total == 1319
    err = capsys.readouterr().err
    assert err.strip() == ("dflash: gsm8k: HF_HUB_OFFLINE=1 is set; using the 128 test prompts shipped "
                           "with dflash (the first 128 of 1,319 in benchmark order; --data-dir DIR "
                           "reads a full copy)")  # fmt: skip
    two = select(items, 2)
    rows = offline.shipped_rows("gsm8k")[0]
    assert [i.id for i in two] == [f"gsm8k/{r['_index']}" for r in rows[:2]]
    assert two[0].turns[0].startswith(rows[0]["question"])
    assert select(items, 500) == list(items)  # more than shipped: all of them


def test_an_unreachable_hub_is_found_quickly_and_not_retried(fresh_cache, no_download, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    from dflash import hub

    hub._probe_once.cache_clear()
    t0 = time.monotonic()
    items = select(load_prompts("mt-bench"), 3)
    assert time.monotonic() - t0 < 10
    assert len(items) == 3 and items[0].id == "mt-bench/" + str(81 + _first_pick(80))
    assert "dflash: mt-bench: 127.0.0.1:9: ConnectError" in capsys.readouterr().err
    hub._probe_once.cache_clear()


def _first_pick(n: int) -> int:
    order = list(range(n))
    random.Random(SELECT_SEED).shuffle(order)
    return order[0]


def test_a_download_failure_falls_back_to_the_shipped_prompts(fresh_cache, monkeypatch, capsys):
    import datasets

    monkeypatch.setattr("dflash.hub.unreachable_reason", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("reset")))
    items = load_prompts("math500")
    assert len(items) == 128
    err = capsys.readouterr().err
    assert "dflash: math500: Could not load dataset 'math500' from the hub" in err and "reset" in err


def test_offline_flag_and_the_cache(fresh_cache, no_download, monkeypatch, capsys):
    """--offline never asks the hub; a cached hub copy still wins over the shipped one."""
    monkeypatch.setattr("dflash.hub.unreachable_reason", lambda: None)  # the hub would answer
    assert len(load_prompts("humaneval", offline=True)) == 128
    assert "humaneval: --offline; using" in capsys.readouterr().err
    cached = fresh_cache / "datasets" / "mt-bench" / "question.jsonl"
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps({"question_id": 7, "turns": ["a", "b"]}) + "\n")
    assert [i.id for i in load_prompts("mt-bench", offline=True)] == ["mt-bench/7"]


def test_a_set_that_is_not_shipped_fails_at_once_offline(fresh_cache, no_download, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetError, match="'gsm8k:train' is not in the cache and cannot be fetched "
                       r"\(HF_HUB_OFFLINE=1 is set\)") as err:  # fmt: skip
        load_prompts("gsm8k:train")
    assert "--data-dir" in err.value.hint


@pytest.mark.slow
def test_benchmark_runs_offline_without_a_data_dir(tmp_path):
    """`dflash benchmark transformers --dataset gsm8k --max-samples 2` with the hub offline and
    no --data-dir: two shipped prompts, demo pair. The converted demo target is shared with the
    default cache (a conversion costs a minute); the dataset cache is empty."""
    from dflash.models.target_torch import cache_root

    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("targets", "gguf-keys.json"):
        if (cache_root() / name).exists():
            (cache / name).symlink_to(cache_root() / name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DFLASH_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env.pop("DFLASH_DATA_DIR", None)
    p = subprocess.run([sys.executable, "-m", "dflash", "benchmark", "transformers", "--dataset", "gsm8k",
                        "--max-samples", "2", "--max-new-tokens", "4", "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "gsm8k: HF_HUB_OFFLINE=1 is set; using the 128 test prompts shipped with dflash" in p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["datasets"]["gsm8k"]["prompts"] == 2
    assert not (cache / "datasets").exists()
