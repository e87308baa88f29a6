"""Prompt datasets: local copies in the ``--data-dir`` layout (``tests/data``: a few real rows of
each dataset), prompt construction, selection, JSONL and text prompt files, and the hub path (with
``datasets.load_dataset`` replaced; no network)."""

from __future__ import annotations

import json
import random

import pytest

from dflash.data import datasets as ds
from dflash.data import load_prompts, select
from dflash.errors import DatasetError, InputError
from tests.helpers.paths import DATA_DIR


@pytest.mark.parametrize(
    ("name", "count", "first_id"),
    [
        ("gsm8k", 6, "gsm8k/0"),
        ("math500", 3, "math500/0"),
        ("humaneval", 3, "HumanEval/0"),
        ("mbpp", 3, "mbpp/11"),
        ("mt-bench", 4, "mt-bench/81"),
        ("gsm8k:train", 3, "gsm8k-train/0"),
    ],
)
def test_benchmark_sets_load_with_unique_ids(name, count, first_id):
    items = load_prompts(name, DATA_DIR)
    assert len(items) == count
    assert items[0].id == first_id
    assert len({i.id for i in items}) == count


def test_prompt_construction_follows_the_brief():
    gsm = load_prompts("gsm8k", DATA_DIR)[0].turns
    assert gsm[0].startswith("Janet")
    assert gsm[0].endswith(
        "\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    math = load_prompts("math500", DATA_DIR)[0].turns[0]
    assert math.startswith("Convert the point") and math.endswith("within \\boxed{}.")
    he = load_prompts("humaneval", DATA_DIR)[0].turns[0]
    assert he.startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\nfrom typing import List"
    )
    assert he.endswith("\n```")
    rows = json.loads((DATA_DIR / "mbpp" / "sanitized-mbpp.json").read_text())
    first_test = min((r for r in rows if 11 <= r["task_id"] <= 510), key=lambda r: r["task_id"])
    assert load_prompts("mbpp", DATA_DIR)[0].turns == [first_test["prompt"]]  # verbatim
    mt = load_prompts("mt-bench", DATA_DIR)
    assert all(len(item.turns) == 2 for item in mt)
    assert mt[0].turns[1].startswith("Rewrite your previous response")


def test_mbpp_train_is_the_sanitized_rows_outside_the_test_ids():
    test_ids = {i.id for i in load_prompts("mbpp", DATA_DIR)}
    train = load_prompts("mbpp:train", DATA_DIR)
    assert [i.id for i in train] == ["mbpp/2", "mbpp/3", "mbpp/554"]  # tests/data keeps 6 rows
    assert not test_ids & {i.id for i in train}
    assert all(not 11 <= int(i.id.split("/")[1]) <= 510 for i in train)


def test_mmlu_is_formatted_with_its_four_choices():
    items = load_prompts("mmlu", DATA_DIR)
    assert len(items) == 5
    text = items[0].turns[0]
    assert "abstract algebra" in text
    assert "Find the degree for the given field extension" in text
    assert "\nA. 0\nB. 4\nC. 2\nD. 6\n" in text
    assert [i.id for i in items if i.id.startswith("mmlu-validation/")] == [
        "mmlu-validation/3",
        "mmlu-validation/4",
    ]


def test_unknown_name_is_one_line_listing_the_names():
    with pytest.raises(DatasetError) as err:
        load_prompts("gsm9k", DATA_DIR)
    message = err.value.message
    assert "\n" not in message
    for name in ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "mmlu", "mbpp:train"):
        assert name in message


def test_data_dir_argument_beats_env_and_env_beats_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_DATA_DIR", str(tmp_path / "nowhere"))
    assert len(load_prompts("mt-bench", DATA_DIR)) == 4  # the argument wins
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts("mt-bench")  # the env folder is used, and it lacks the file
    monkeypatch.setenv("DFLASH_DATA_DIR", str(DATA_DIR))
    assert len(load_prompts("mt-bench")) == 4


def test_select_is_a_dedicated_seeded_shuffle():
    items = load_prompts("humaneval", DATA_DIR)
    state = random.getstate()
    everything = select(items, None)
    assert random.getstate() == state  # the global RNG is not touched
    assert sorted(i.id for i in everything) == sorted(i.id for i in items)
    assert [i.id for i in everything] != [i.id for i in items]
    assert select(items, 5) == everything[:5]
    assert select(items, 5) == select(items, 5)
    assert select(items, 10_000) == everything
    order = list(range(len(items)))
    random.Random(42).shuffle(order)
    assert [i.id for i in select(items, 3)] == [items[k].id for k in order[:3]]
    with pytest.raises(InputError):
        select(items, 0)


def test_jsonl_prompt_files(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"prompt": "Hello"},
        {"id": "two", "turns": ["a", "b"]},
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "q2"},
            ]
        },
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    items = load_prompts(str(path))
    assert [(i.id, i.turns, i.system) for i in items] == [
        ("mine/1", ["Hello"], None),
        ("two", ["a", "b"], None),
        ("mine/3", ["q1", "q2"], "be brief"),
    ]
    assert items[2].first_messages() == [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "q1"}]  # fmt: skip
    assert items[0].first_messages() == [{"role": "user", "content": "Hello"}]


def test_jsonl_system_field(tmp_path):
    path = tmp_path / "sys.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "system": "You are terse."}) + "\n"
                    + json.dumps({"turns": ["a", "b"], "system": "S"}) + "\n")  # fmt: skip
    items = load_prompts(str(path))
    assert [(i.turns, i.system) for i in items] == [(["Hi"], "You are terse."), (["a", "b"], "S")]
    assert items[1].start_messages() == [{"role": "system", "content": "S"}]


def test_a_jsonl_file_that_is_not_utf8_names_the_line(tmp_path):
    """A non-UTF-8 byte raised a UnicodeDecodeError traceback; now a DatasetError with the line."""
    path = tmp_path / "mine.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "Hi \xff"}\n')
    with pytest.raises(DatasetError, match=r"mine.jsonl:2 is not valid UTF-8 \(byte 0xff\)"):
        load_prompts(str(path))
    path.write_bytes(b'{"prompt": "a"}\r\n{"prompt": "b"}\r\n')  # CRLF lines still read
    assert [i.turns for i in load_prompts(str(path))] == [["a"], ["b"]]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"prompt": "a"}\nnot json\n', "mine.jsonl:2 is not valid JSON"),
        ('{"text": "a"}\n', "no 'prompt' string"),
        ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "repeats the id"),
        ("\n", "holds no prompts"),
        ('{"prompt": "a", "system": 3}\n', "'system' field that is not a string"),
        ('{"prompt": "a", "system": " "}\n', "empty system message"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}\n',
         "system message that is not the first"),
        ('{"messages": [{"role": "system", "content": "s"}, {"role": "system", "content": "t"},'
         ' {"role": "user", "content": "q"}]}\n', "or several"),
        ('{"system": "s", "messages": [{"role": "system", "content": "t"},'
         ' {"role": "user", "content": "q"}]}\n', "both a 'system' field"),
        ('{"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}]}\n',
         "'developer' message"),
    ],
)
def test_bad_jsonl_files_raise_dataset_errors(tmp_path, content, match):
    path = tmp_path / "mine.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=match):
        load_prompts(str(path))
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_txt_prompt_files_hold_one_prompt_per_line(tmp_path, monkeypatch):
    """A .txt file was read as JSONL ("prompts.txt:1 is not valid JSON"); a user means one
    prompt per non-empty line, taken as written, JSON-looking or not."""
    import gzip

    text = 'What is 2+2?\r\n\n  Name a colour.  \n{"prompt": "literal"}\n   \n'
    (tmp_path / "prompts.txt").write_text(text)
    monkeypatch.chdir(tmp_path)  # a bare file name, no path separator
    items = load_prompts("prompts.txt")
    assert [(i.id, i.turns, i.system) for i in items] == [
        ("prompts/1", ["What is 2+2?"], None),
        ("prompts/3", ["Name a colour."], None),
        ("prompts/4", ['{"prompt": "literal"}'], None),
    ]
    (tmp_path / "p.txt.gz").write_bytes(gzip.compress(text.encode()))
    assert [i.id for i in load_prompts("p.txt.gz")] == ["p/1", "p/3", "p/4"]
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(DatasetError, match="empty.txt holds no prompts"):
        load_prompts("empty.txt")
    with pytest.raises(DatasetError, match="missing.txt does not exist"):
        load_prompts("missing.txt")
    (tmp_path / "bad.txt").write_bytes(b"ok\nHi \xff\n")
    with pytest.raises(DatasetError, match=r"bad.txt:2 is not valid UTF-8"):
        load_prompts("bad.txt")


def test_other_file_names_are_jsonl_only_when_they_look_like_json(tmp_path):
    """A file that is neither .txt nor .jsonl: JSONL when its first line starts with { or [
    (a bad line is named), refused otherwise (it was parsed as JSONL and failed at line 1)."""
    path = tmp_path / "prompts"
    path.write_text('\n{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [i.turns for i in load_prompts(str(path))] == [["a"], ["b"]]
    path.write_text('{"prompt": "a"}\n{bad\n')
    with pytest.raises(DatasetError, match="prompts:2 is not valid JSON") as err:
        load_prompts(str(path))
    assert "one JSON object per line" in err.value.hint
    (tmp_path / "notes.md").write_text("hello\n")
    with pytest.raises(DatasetError, match="neither .txt nor .jsonl") as err:
        load_prompts(str(tmp_path / "notes.md"))
    assert ".txt for one prompt per line" in err.value.hint


def test_benchmark_cli_reads_a_txt_file_and_names_a_bad_json_line(tmp_path):
    from tests.helpers.cli import assert_one_line_error, run

    (tmp_path / "p.json").write_text('{"prompt": "a"}\n{"prompt": \n')
    bad = run("benchmark", "transformers", "--dataset", str(tmp_path / "p.json"))
    assert_one_line_error(bad, "p.json:2 is not valid JSON")
    (tmp_path / "q.txt").write_text("Hi\n")  # read (no JSON error), then --max-samples 0 refused
    ok = run("benchmark", "transformers", "--dataset", str(tmp_path / "q.txt"), "--max-samples", "0")  # fmt: skip
    assert_one_line_error(ok, "--max-samples must be >= 1")


class FakeHub:
    """Stands in for ``datasets.load_dataset``; records calls, serves canned hub-format rows."""

    ROWS = {
        ("HuggingFaceH4/mt_bench_prompts", "train"): [
            {"prompt": ["t1", "t2"], "prompt_id": 81, "category": "writing"}
        ],
        ("cais/mmlu", "test"): [
            {"question": "2+2?", "subject": "math", "choices": ["1", "2", "3", "4"], "answer": 3}
        ],
        ("cais/mmlu", "validation"): [],
    }

    def __init__(self):
        self.calls = []

    def __call__(self, repo, config=None, *, split):
        self.calls.append((repo, config, split))
        if (repo, split) not in self.ROWS:
            raise ConnectionError("offline")
        return list(self.ROWS[(repo, split)])


@pytest.fixture
def hub(monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets")
    fake = FakeHub()
    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.setattr("dflash.hub.unreachable_reason", lambda: None)  # the hub answers
    monkeypatch.delenv("DFLASH_DATA_DIR", raising=False)
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    return fake


def test_hub_rows_are_cached_as_jsonl_in_the_local_format(hub, tmp_path):
    items = load_prompts("mt-bench")
    assert [(i.id, i.turns) for i in items] == [("mt-bench/81", ["t1", "t2"])]
    cached = tmp_path / "cache" / "datasets" / "mt-bench" / "question.jsonl"
    assert json.loads(cached.read_text().splitlines()[0])["turns"] == ["t1", "t2"]
    assert load_prompts("mt-bench") == items
    assert len(hub.calls) == 1  # the second load read the cache

    mmlu = load_prompts("mmlu")
    assert "\nD. 4\n" in mmlu[0].turns[0]
    row = json.loads((tmp_path / "cache" / "datasets" / "mmlu" / "mmlu.jsonl").read_text())
    assert row["answer"] == "D" and row["split"] == "test"
    assert ds.cache_dir() == tmp_path / "cache" / "datasets"


def test_hub_failure_is_a_dataset_error_with_a_hint(hub):
    """(A benchmark set falls back to the copy shipped with dflash: tests/data/test_offline_data.py.)"""
    with pytest.raises(DatasetError, match="Could not load dataset 'gsm8k:train'") as err:
        load_prompts("gsm8k:train")
    assert "--data-dir" in err.value.hint
