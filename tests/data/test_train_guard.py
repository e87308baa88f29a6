"""The no-benchmark-test-split guard and the offline prompt builders."""

from __future__ import annotations

import json

import pytest

from dflash.data.guard import benchmark_of, benchmark_texts, check_training_ids, text_overlap
from dflash.data.synthetic import code_prompts, math_prompts, writing_prompts
from dflash.errors import DatasetError


def test_benchmark_ids_are_recognised_and_training_ids_pass():
    assert benchmark_of("gsm8k/3") == "gsm8k" and benchmark_of("gsm8k/3#2") == "gsm8k"
    assert benchmark_of("HumanEval/7") == "humaneval" and benchmark_of("math500/1") == "math500"
    assert benchmark_of("mbpp/11") == "mbpp" and benchmark_of("mbpp/510") == "mbpp"
    assert benchmark_of("mt-bench/81") == "mt-bench"
    for ok in ("gsm8k-train/3", "mbpp/10", "mbpp/511", "mmlu-test/4", "stdlib/1", "mathgen/2"):
        assert benchmark_of(ok) is None
    check_training_ids(["gsm8k-train/1", "mbpp/600"], "data/")
    with pytest.raises(DatasetError, match="mbpp test split"):
        check_training_ids(["gsm8k-train/1", "mbpp/42#1"], "data/")


def test_text_overlap_finds_embedded_benchmark_passages():
    bench = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many "
             "clips in May. How many clips did Natalia sell altogether in April and May?", "Hi"]  # fmt: skip
    prompts = ["Answer this: natalia SOLD clips to 48 of her friends in April, and then she sold "
               "half as many clips in May. How many clips did Natalia sell altogether?",
               "A different question about clips sold in April and May by a friend of Natalia.",
               "hi!"]  # fmt: skip
    assert text_overlap(prompts, bench) == [prompts[0], prompts[2]]


def test_synthetic_prompts_are_deterministic_distinct_and_clean():
    a, b = math_prompts(300, seed=3), math_prompts(300, seed=3)
    assert a == b and len(set(a)) == 300 and a != math_prompts(300, seed=4)
    assert sum("\\boxed{}" in p for p in a) > 150
    code = code_prompts(seed=0)
    assert len(code) > 200 and any("```python\ndef " in p for p in code)
    assert any(p.startswith(("Write a", "Implement", "Create")) for p in code)
    w = writing_prompts(100, seed=0)
    assert len(set(w)) == 100
    assert not text_overlap(a[:50] + w[:50], ["Natalia sold clips to 48 of her friends in April, "
                                              "and then she sold half as many clips in May."])  # fmt: skip


def test_train_refuses_eval_only_and_benchmark_data(tmp_path):
    from dflash.train.data import ShardWriter, read_shards
    from dflash.train.train import _refuse_benchmark_data

    rec = {"id": "gsm8k/5", "prompt_ids": [1, 2], "response_ids": [3, 4, 5]}
    ShardWriter(tmp_path / "a", {"x": 1}).append([rec], 1)
    with pytest.raises(DatasetError, match="gsm8k test split"):
        _refuse_benchmark_data(str(tmp_path / "a"), read_shards(tmp_path / "a"))
    ShardWriter(tmp_path / "b", {"eval_only": True}).append([{**rec, "id": "x/1"}], 1)
    assert json.loads((tmp_path / "b" / "meta.json").read_text())["eval_only"]
    with pytest.raises(DatasetError, match="eval-only"):
        _refuse_benchmark_data(str(tmp_path / "b"), read_shards(tmp_path / "b"))


def test_task_and_chat_prompts_are_deterministic_distinct_and_clean(data_dir):
    from dflash.data.synthetic_tasks import TASKS, chat_prompts, compose_prompts, task_prompts

    t = task_prompts(800, seed=1)
    assert t == task_prompts(800, seed=1) and t != task_prompts(800, seed=2)
    assert len(t) == 800 and len(set(t)) == 800
    assert any("```python\ndef " in p for p in t) and any(p.startswith("Write a") for p in t)
    assert sum(any(name in p for name, _, _ in TASKS) for p in t) > 100  # named functions
    supply = task_prompts(10**6, seed=0)  # asks for more than exist: stops, all distinct
    assert 1000 < len(supply) < 10**6 and len(set(supply)) == len(supply)
    c = chat_prompts(500, seed=0)
    assert c == chat_prompts(500, seed=0) and len(set(c)) == 500
    assert any(p.startswith(("Pretend", "Act as", "Role-play", "Imagine")) for p in c)
    assert any("years old and lives in" in p for p in c)  # extraction texts
    w = compose_prompts(500, seed=0)
    assert w == compose_prompts(500, seed=0) and len(set(w)) == 500 and not set(w) & set(c)
    assert any("email" in p for p in w) and any("Use a humorous tone." in p for p in w)
    bench = benchmark_texts(str(data_dir))  # what the prompt builder checks against
    assert len(bench) > 5 and not text_overlap(t[:400] + c[:400] + w[:400], bench)
