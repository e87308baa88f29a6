"""Training data: regeneration through the chat template, shards and resume, batching, the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dflash.errors import DatasetError, InputError
from dflash.train.data import (
    ShardWriter,
    collate,
    encode_chat,
    generation_order,
    make_batches,
    prepare,
    read_shards,
    regenerate,
)
from tests.helpers.paths import DATA_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPTS = [
    "What is 2 + 2?",
    "Name a colour.",
    "Say hello in French.",
    "Count to three.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def tiny_chat_target(tmp_path_factory) -> Path:
    """A 2-layer random Llama (hidden 32) with the demo target's tokenizer and chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dflash.models.target_torch import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target(None))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-chat")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture()
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": p} for p in PROMPTS[:3]]
    lines += [{"messages": [{"role": "user", "content": p}]} for p in PROMPTS[3:]]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_encode_chat_matches_the_pipeline(tiny_chat_target):
    from transformers import AutoTokenizer

    from dflash.api import Pipeline

    tok = AutoTokenizer.from_pretrained(tiny_chat_target)

    class _Backend:
        draft_block_size, max_context = 16, 1 << 20

    pipe = Pipeline(_Backend(), tok, [2])
    for p in PROMPTS:
        assert encode_chat(tok, p) == pipe.chat_prompt([{"role": "user", "content": p}])
        with_system = encode_chat(tok, p, "Answer briefly.")
        assert with_system == pipe.chat_prompt([{"role": "user", "content": p}],
                                               system="Answer briefly.")  # fmt: skip
        assert with_system != encode_chat(tok, p)
    # a template without a system role (Gemma-2's kind) refuses in one line, both ways
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")  # fmt: skip
    with pytest.raises(InputError, match="refuses these messages .roles: system, user.: System role"):
        encode_chat(tok, "q", "s")
    with pytest.raises(InputError, match="refuses these messages"):
        pipe.chat_prompt([{"role": "user", "content": "q"}], system="s")
    assert encode_chat(tok, "q") == pipe.chat_prompt([{"role": "user", "content": "q"}])


def test_regenerate_writes_responses_and_resumes_after_a_crash(
    tiny_chat_target, prompt_file, tmp_path, monkeypatch
):
    out = tmp_path / "data"
    calls = []

    def crash_after_first(done, total, new_tokens, seconds):
        calls.append(done)
        if len(calls) == 1:
            raise KeyboardInterrupt  # an interrupted run: one batch is on disk

    with pytest.raises(KeyboardInterrupt):
        regenerate(str(tiny_chat_target), [str(prompt_file)], out, max_new_tokens=6, batch_size=2,
                   device="cpu", on_batch=crash_after_first, engine="hf")  # fmt: skip
    assert json.loads((out / "progress.json").read_text())["done"] == 2
    with (out / "shard-00000.jsonl").open("a") as f:
        f.write('{"id": "half-writ')  # a line cut off after the cursor was saved
    res = regenerate(str(tiny_chat_target), [str(prompt_file)], out, max_new_tokens=6, batch_size=2,
                     device="cpu", engine="hf")  # fmt: skip
    assert res["finished"] and res["done"] == res["total"] == 5
    samples = read_shards(out)
    assert sorted(s.id for s in samples) == sorted(f"prompts/{i}" for i in range(1, 6))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_target)
    by_id = {s.id: s for s in samples}
    for i, p in enumerate(PROMPTS, 1):
        s = by_id[f"prompts/{i}"]
        assert s.prompt_ids == encode_chat(tok, p)
        assert 1 <= len(s.response_ids) <= 6
    # greedy responses equal single-prompt greedy decoding of the target (left padding is inert)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_target).eval()
    s = by_id["prompts/1"]
    with torch.no_grad():
        ref = model.generate(torch.tensor([s.prompt_ids]), max_new_tokens=6, do_sample=False,
                             eos_token_id=2, pad_token_id=2)[0, len(s.prompt_ids) :].tolist()  # fmt: skip
    assert s.response_ids == ref[: len(s.response_ids)]
    # a finished folder is not redone (the target is not even loaded), and other settings are
    # refused before the target loads
    import dflash.backends.plain as tb

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(tb, "load_target", no_load)
    again = regenerate(str(tiny_chat_target), [str(prompt_file)], out, max_new_tokens=6, batch_size=3,
                       device="cpu")  # fmt: skip
    assert again["tokens"] == 0 and again["done"] == 5 and again["finished"] and len(read_shards(out)) == 5
    with pytest.raises(InputError, match=r"other settings \(max_new_tokens 6 -> 7\)"):  # old -> new
        regenerate(str(tiny_chat_target), [str(prompt_file)], out, max_new_tokens=7, device="cpu")
    with pytest.raises(InputError, match="max_prompt_tokens"):  # it selects the prompts the cursor counts
        regenerate(str(tiny_chat_target), [str(prompt_file)], out, max_new_tokens=6, device="cpu",
                   max_prompt_tokens=12)  # fmt: skip


def test_read_shards_errors_and_gzip(tmp_path):
    import gzip

    with pytest.raises(DatasetError, match="does not exist"):
        read_shards(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no .jsonl"):
        read_shards(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "shard-00000.jsonl").write_text(
        '{"id": 1}\n{"id": "x", "prompt_ids": [1], "response_ids": [2]}\n'
    )
    with pytest.raises(DatasetError, match="not a training record"):
        read_shards(bad)
    gz = tmp_path / "gz"
    gz.mkdir()
    with gzip.open(gz / "shard-00000.jsonl.gz", "wt") as f:
        f.write('{"id": "a", "prompt_ids": [1, 2], "response_ids": [3, 4, 5]}\n')
    assert read_shards(gz)[0].response_ids == [3, 4, 5]


def test_shard_writer_rotates_and_keeps_order(tmp_path, monkeypatch):
    import dflash.train.shards as shards

    monkeypatch.setattr(shards, "RECORDS_PER_SHARD", 2)
    w = ShardWriter(tmp_path, {"k": 1})
    for i in range(5):
        w.append([{"id": str(i), "prompt_ids": [1], "response_ids": [2, 3]}], i + 1)
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [
        f"shard-0000{i}.jsonl" for i in range(3)
    ]
    assert [s.id for s in read_shards(tmp_path)] == ["0", "1", "2", "3", "4"]


def test_generation_order_does_not_depend_on_batch_size():
    lengths = [5, 9, 1, 7, 7, 3]
    order = generation_order(lengths)
    assert sorted(order) == list(range(6))
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)


def test_prepare_batches_and_collate():
    from dflash.train.data import Sample

    samples = [
        Sample("a", [1, 2, 3], [4, 5, 6, 7]),
        Sample("b", [1] * 9, [2]),
        Sample("c", [1], [2, 3]),
    ]
    seqs = prepare(samples, max_len=6)
    assert seqs == [([1, 2, 3, 4, 5, 6], 3), ([1, 2, 3], 1)]  # b has one response token: dropped
    lengths = [10, 30, 20, 40, 15, 25, 35, 5]
    b1 = make_batches(lengths, batch_tokens=60, seed=3, epoch=0)
    assert b1 == make_batches(lengths, batch_tokens=60, seed=3, epoch=0)
    assert b1 != make_batches(lengths, batch_tokens=60, seed=3, epoch=1)
    assert sorted(i for b in b1 for i in b) == list(range(8))
    for b in b1:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 60
    ids, att, loss_mask = collate(seqs, pad_id=0, multiple=4)
    assert ids.shape == (2, 8)
    assert ids[1].tolist() == [1, 2, 3, 0, 0, 0, 0, 0]
    assert att[1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert loss_mask[0].tolist() == [False] * 3 + [True] * 3 + [False] * 2
    assert loss_mask[1].tolist() == [False, True, True] + [False] * 5


def test_cli_train_and_regenerate(tiny_chat_target, prompt_file, tmp_path):
    from typer.testing import CliRunner

    from dflash.cli import app
    from dflash.models.draft_torch import DFlashDraft

    runner = CliRunner()
    data = tmp_path / "data"
    r = runner.invoke(app, ["data", "regenerate", "--target", str(tiny_chat_target), "--prompts",
                            str(prompt_file), "--out", str(data), "--max-new-tokens", "8",
                            "--device", "cpu"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "responses" in r.output and "already complete" not in r.output
    r = runner.invoke(app, ["data", "regenerate", "--target", str(tiny_chat_target), "--prompts",
                            str(prompt_file), "--out", str(data), "--max-new-tokens", "8",
                            "--device", "cpu"])  # fmt: skip
    assert r.exit_code == 0 and "5/5 responses, already complete" in " ".join(r.output.split()), r.output
    assert "regenerating" not in r.output  # no progress bar when there is nothing to do
    out = tmp_path / "draft"
    r = runner.invoke(app, ["train", "--target", str(tiny_chat_target), "--data", str(data), "--out",
                            str(out), "--layers", "1", "--block-size", "4", "--max-steps", "2",
                            "--device", "cpu"])  # fmt: skip
    assert r.exit_code == 0, r.output
    draft = DFlashDraft.load(out)
    assert draft.config.block_size == 4 and draft.config.num_hidden_layers == 1
    assert "step 2/2: loss " in r.output  # not a terminal: one log line per interval, no bar
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir() if f.is_file()}
    assert modes["model.safetensors"] == modes["config.json"]  # weights follow the umask too
    assert (out / "train_log.jsonl").is_file() and (out / "state" / "trainer_state.json").is_file()
    first = [line for line in r.output.splitlines() if line.startswith("step 2/2")][0]
    # a resume (a larger --max-steps) shows the last held-out τ until its next evaluation (the
    # last step's): step 3 of 4 logs no evaluation of its own
    r = runner.invoke(app, ["train", "--target", str(tiny_chat_target), "--data", str(data), "--out",
                            str(out), "--layers", "1", "--block-size", "4", "--max-steps", "4",
                            "--log-every", "1", "--device", "cpu"])  # fmt: skip
    assert r.exit_code == 0, r.output
    resumed = [line for line in r.output.splitlines() if line.startswith("step 3/4")][0]
    tau = first.split("held-out τ ")[1].split()[0]
    assert tau != "n/a" and resumed.split("held-out τ ")[1].split()[0] == tau, (first, resumed)
    r = runner.invoke(
        app, ["train", "--data", str(data), "--out", str(tmp_path / "x"), "--block-size", "1"]
    )
    assert isinstance(r.exception, InputError)


def test_batched_regenerate_resumes_without_loss_or_duplicates(
    tiny_chat_target, prompt_file, tmp_path
):
    """Continuous batching finishes jobs out of order; an interruption after any write, plus a
    half-written line, must leave every (prompt, sample) exactly once after the resume."""
    out, ref = tmp_path / "data", tmp_path / "ref"
    kw = dict(max_new_tokens=5, batch_size=2, device="cpu", samples=2, sample_temperature=0.9,
              engine="batched", flush_seconds=0.0)  # fmt: skip
    writes = []

    def crash_on_third(done, total, new_tokens, seconds):
        writes.append(done)
        if len(writes) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        regenerate(str(tiny_chat_target), [str(prompt_file)], out, on_batch=crash_on_third, **kw)
    assert len(read_shards(out)) == 3
    with (out / "shard-00000.jsonl").open("a") as f:
        f.write('{"id": "prompts/1", "prompt_ids": [1, 2')  # cut off after the cursor was saved
    res = regenerate(str(tiny_chat_target), [str(prompt_file)], out, **kw)
    assert res["finished"] and res["done"] == res["total"] == 10 and res["engine"] == "batched"
    got = read_shards(out)
    ids = [s.id for s in got]
    want = [f"prompts/{i}" for i in range(1, 6)] + [f"prompts/{i}#1" for i in range(1, 6)]
    assert sorted(ids) == sorted(want)  # nothing lost, nothing twice
    regenerate(str(tiny_chat_target), [str(prompt_file)], ref, **kw)
    greedy = {s.id: s.response_ids for s in read_shards(ref) if "#" not in s.id}
    assert {s.id: s.response_ids for s in got if "#" not in s.id} == greedy
    rows = [
        json.loads(x)
        for p in sorted(out.glob("shard-*.jsonl"))
        for x in p.read_text().split("\n")
        if x
    ]
    assert {r["sample"] for r in rows} == {0, 1} and {r["temperature"] for r in rows} == {0.0, 0.9}


def test_regenerate_refuses_benchmark_test_splits_without_eval_only(tiny_chat_target, tmp_path):
    for spec in ("gsm8k@4", "humaneval", "mbpp:test", "mt-bench@2", "math500"):
        with pytest.raises(InputError, match="benchmark test split"):
            regenerate(str(tiny_chat_target), [spec], tmp_path / "x", device="cpu")


@pytest.mark.parametrize("count", ["0", "x", "-2"])
def test_prompt_spec_bad_count_names_the_spec(count):
    from dflash.train.data import parse_prompt_spec

    with pytest.raises(InputError, match=f"'gsm8k:train@{count}' has a bad count"):
        parse_prompt_spec(f"gsm8k:train@{count}", DATA_DIR)


@pytest.mark.parametrize("bad", [["--batch-size", "0"], ["--samples", "0"], ["--engine", "foo"],
                                 ["--sample-temperature", "0"]])  # fmt: skip
def test_regenerate_refuses_bad_numbers_before_loading_anything(tmp_path, bad):
    """Bad numbers fail at once: no progress bar, no target load, no output folder."""
    from typer.testing import CliRunner

    from dflash.cli import app

    out = tmp_path / "data"
    r = CliRunner().invoke(app, ["data", "regenerate", "--target", str(tmp_path / "missing"),
                                 "--prompts", "gsm8k:train@2", "--out", str(out), *bad])  # fmt: skip
    assert isinstance(r.exception, InputError), r.output
    assert "regenerating" not in r.output and not out.exists()


@pytest.mark.parametrize("flag", ["max_new_tokens", "batch_size", "samples"])
def test_regenerate_names_the_count_that_is_below_one(flag):
    """The error named all three counts, leaving the user to guess (user trial)."""
    from dflash.train.data import check_regenerate_options

    values = {"max_new_tokens": 8, "batch_size": 4, "samples": 1, flag: 0}
    with pytest.raises(InputError) as err:
        check_regenerate_options(**values, temperature=0.0, sample_temperature=0.8, engine="auto")
    assert str(err.value).startswith(f"--{flag.replace('_', '-')} must be >= 1, got 0.")
