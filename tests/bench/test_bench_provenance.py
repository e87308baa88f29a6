"""Every benchmark record says what produced it, and --resume refuses another configuration."""

from __future__ import annotations

import pytest

from dflash.bench.harness import BenchConfig, ResultsLog, check_resumable, run_benchmark
from dflash.data import PromptItem
from dflash.errors import InputError
from tests.helpers.fakes import FakePipeline

ITEMS = {"toy": [PromptItem(id=f"p{i}", turns=[f"question {i}"]) for i in range(3)]}


class DescribedPipeline(FakePipeline):
    def __init__(self, dtype: str, compile: bool = False):
        super().__init__()
        self.info = {"impl": "static", "device": "cuda:0 (H200)", "dtype": dtype,
                     "cuda_graphs": True, "compile": compile,
                     "versions": {"dflash": "0.1.0", "torch": "2.11"}}  # fmt: skip

    def describe(self):
        return dict(self.info)


def test_records_carry_their_producer(tmp_path):
    out = tmp_path / "r.jsonl"
    run_benchmark(DescribedPipeline("float32"), ITEMS, BenchConfig(max_new_tokens=8),
                  log=ResultsLog(out))  # fmt: skip
    records = list(ResultsLog(out, resume=True).done.values())
    assert len(records) == 3
    for r in records:
        assert r.config["dtype"] == "float32" and r.config["impl"] == "static"
        assert r.config["versions"]["torch"] == "2.11" and r.config["block_size"] == 4
        assert r.config["temperature"] == 0.0


def test_resume_refuses_another_dtype_naming_it(tmp_path):
    out = tmp_path / "r.jsonl"
    first = {"toy": ITEMS["toy"][:2]}
    run_benchmark(DescribedPipeline("float32"), first, BenchConfig(max_new_tokens=8),
                  log=ResultsLog(out))  # fmt: skip
    with pytest.raises(InputError, match=r"dtype: 'float32' then 'bfloat16'") as err:
        run_benchmark(DescribedPipeline("bfloat16", compile=True), ITEMS,
                      BenchConfig(max_new_tokens=8), log=ResultsLog(out, resume=True))  # fmt: skip
    assert "compile: False then True" in str(err.value)
    assert len(out.read_text().splitlines()) == 2  # nothing appended
    # the same configuration resumes and completes
    run_benchmark(DescribedPipeline("float32"), ITEMS, BenchConfig(max_new_tokens=8),
                  log=ResultsLog(out, resume=True))  # fmt: skip
    assert len(out.read_text().splitlines()) == 3


def test_check_resumable_names_nested_versions():
    class R:
        config = {"dtype": "bfloat16", "versions": {"torch": "2.11"}}

    check_resumable([R()], {"dtype": "bfloat16", "versions": {"torch": "2.11"}})
    with pytest.raises(InputError, match=r"versions.torch: '2.11' then '2.13'"):
        check_resumable([R()], {"dtype": "bfloat16", "versions": {"torch": "2.13"}})
