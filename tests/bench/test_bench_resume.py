"""The benchmark harness on a scripted fake pipeline: JSONL records, resume after a killed run,
multi-turn feeding, parity reporting and the CLI's one-line errors. No model, no network."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from typer.testing import CliRunner

from dflash.bench import command, harness
from dflash.bench.harness import BenchConfig, ResultsLog, read_records, run_benchmark
from dflash.bench.metrics import summarize
from dflash.data import PromptItem
from dflash.errors import BackendError, DatasetError, InputError, ServerError
from tests.helpers.fakes import FakePipeline, make_app
from tests.helpers.paths import DATA_DIR, REPO


@pytest.fixture
def cli(monkeypatch):
    monkeypatch.setattr(command, "_load_pipeline", command._load_pipeline)  # restored afterwards

    def invoke(args, factory=FakePipeline):
        result = CliRunner().invoke(make_app(factory), args)
        return result

    return invoke


BENCH_ARGS = ["transformers", "--dataset", "gsm8k,mt-bench", "--max-samples", "4",
              "--data-dir", str(DATA_DIR), "--max-new-tokens", "16", "--check-parity"]  # fmt: skip


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def test_records_summary_and_multi_turn_feeding(tmp_path):
    fake = FakePipeline()
    items = {
        "toy": [PromptItem("a", ["first question"]), PromptItem("b", ["turn one", "turn two"])]
    }
    log = ResultsLog(tmp_path / "r.jsonl")
    config = BenchConfig(max_new_tokens=12, check_parity=True)
    results = run_benchmark(fake, items, config, log=log)
    records = results["toy"]
    assert [(r.id, r.turn) for r in records] == [("a", 0), ("b", 0), ("b", 1)]
    # warm-up (block 1 then 4, 12 tokens at most) comes first, then baseline before DFlash
    assert [bs for _, bs in fake.calls] == [1, 4] + [1, 4] * 3
    # turn two sees turn one and the DFlash answer to it
    assert fake.prompts[-1] == [
        {"role": "user", "content": "turn one"},
        {"role": "assistant", "content": records[1].text},
        {"role": "user", "content": "turn two"},
    ]
    assert records[1].text.endswith(" 4")  # the DFlash (block 4) answer, not the baseline's
    on_disk = read_records(tmp_path / "r.jsonl")
    assert [r.to_dict() for r in on_disk] == [r.to_dict() for r in records]
    for r in records:
        assert sum(r.acceptance_lengths) + 1 == r.dflash.new_tokens
        assert r.parity is True and r.config["block_size"] == 4
    assert summarize(records)["parity"] == {"checked": 3, "matched": 3, "near_tie": 0,
                                          "unexplained": 0, "mismatches": []}  # fmt: skip


def test_system_message_of_a_prompt_file_reaches_every_turn(tmp_path):
    fake = FakePipeline()
    items = {"toy": [PromptItem("s", ["turn one", "turn two"], system="be brief")]}
    records = run_benchmark(fake, items, BenchConfig(max_new_tokens=12))["toy"]
    system = {"role": "system", "content": "be brief"}
    assert fake.prompts[0] == [system, {"role": "user", "content": "turn one"}]  # the warm-up
    assert all(p[0] == system for p in fake.prompts)
    assert fake.prompts[-1] == [system, {"role": "user", "content": "turn one"},
                                {"role": "assistant", "content": records[0].text},
                                {"role": "user", "content": "turn two"}]  # fmt: skip


def test_resume_refuses_records_made_from_another_prompt(tmp_path):
    """--resume reuses a stored turn only when its messages are the same: a system message
    dropped or changed in the prompt file is a one-line InputError; the same prompts resume
    without measuring anything again, a file written before the fingerprint too."""
    path, config = tmp_path / "r.jsonl", BenchConfig(max_new_tokens=12)
    items = {"toy": [PromptItem("s", ["turn one", "turn two"], system="be brief")]}
    run_benchmark(FakePipeline(), items, config, log=ResultsLog(path))
    again = FakePipeline()
    run_benchmark(again, items, config, log=ResultsLog(path, resume=True))
    assert again.calls == [] and again.prompts == []  # nothing measured, nothing tokenized
    for changed in ([PromptItem("s", ["turn one", "turn two"])],  # the system message dropped
                    [PromptItem("s", ["turn one", "turn two"], system="be BRIEF")],
                    [PromptItem("s", ["turn one", "turn 2"], system="be brief")]):  # fmt: skip
        with pytest.raises(InputError, match=r"s turn \d made from other messages") as err:
            run_benchmark(FakePipeline(), {"toy": changed}, config, log=ResultsLog(path, resume=True))
        assert "\n" not in err.value.message
    # a file written before the fingerprint resumes as before
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "prompt_sha1": None}) + "\n" for r in lines))
    fake = FakePipeline()
    run_benchmark(fake, items, config, log=ResultsLog(path, resume=True))
    assert fake.calls == []


def test_parity_mismatch_is_reported_with_id_and_position(cli, tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"id": "bad", "prompt": "Janet"}\n{"prompt": "ok"}\n')

    def factory():
        return FakePipeline(diverge="Janet")

    out = cli(["transformers", "--dataset", str(prompts), "--max-new-tokens", "8",
               "--check-parity"], factory)  # fmt: skip
    assert out.exit_code == 0, out.output
    parity = last_json(out.stdout)["datasets"][str(prompts)]["parity"]
    assert parity["checked"] == 3 and parity["matched"] == 2
    assert parity["mismatches"] == [
        {"dataset": str(prompts), "id": "bad", "turn": 0, "first_mismatch": 2,
         "near_tie": None, "tie_gap": None}  # the fake has no backend to replay
    ]  # fmt: skip
    assert "parity mismatch:" in out.stdout and "bad turn 0 first differs at new token 2" in (
        " ".join(out.stdout.split())
    )


def test_cli_prints_tables_upstream_lines_and_a_final_json_line(cli, tmp_path):
    plot = tmp_path / "hist.png"
    out = cli([*BENCH_ARGS, "--plot", str(plot)])
    assert out.exit_code == 0, out.output
    assert "dflash benchmark: gsm8k" in out.stdout and "dflash benchmark: mt-bench" in out.stdout
    assert "Decoding speedup: 2.50" in out.stdout  # the fake decodes 2.5x faster per token
    assert "Acceptance length histogram: ['0.0%'," in out.stdout
    summary = last_json(out.stdout)
    assert summary["config"]["block_size"] == 4
    mt = summary["datasets"]["mt-bench"]
    assert mt["responses"] == 8 and mt["prompts"] == 4
    assert mt["speedup"] == pytest.approx(2.5)
    assert len(mt["histogram"]) == 4 and len(mt["per_position_acceptance"]) == 3
    assert plot.stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["openai", "--dataset", "gsm8k", "--base-url", "http://127.0.0.1:9"], ServerError),
        (["tpu", "--dataset", "gsm8k"], BackendError),
        (["transformers", "--dataset", "nope"], DatasetError),
        (
            ["transformers", "--dataset", "gsm8k", "--temperature", "0.7", "--check-parity"],
            InputError,
        ),  # fmt: skip
        (["transformers", "--dataset", "gsm8k", "--resume"], InputError),
        (["transformers", "--dataset", "gsm8k", "--max-new-tokens", "0"], InputError),
        (["transformers", "--dataset", "gsm8k", "--max-samples", "0"], InputError),
        (["transformers", "--dataset", "gsm8k", "--top-p", "0"], InputError),
        (["transformers", "--dataset", "gsm8k", "--plot", "hist.xyz"], InputError),  # no such format
        (["transformers", "--dataset", "gsm8k", "--plot", os.devnull + "/hist.png"], InputError),  # no folder
        (["openai", "--dataset", "gsm8k", "--base-url", "http://127.0.0.1:9", "--plot", "hist.xyz"], InputError),
    ],
)
def test_bad_input_raises_one_line_dflash_errors(cli, args, error):
    loaded = []

    def factory():
        loaded.append(1)
        return FakePipeline()

    out = cli([*args, "--data-dir", str(DATA_DIR)], factory)
    assert isinstance(out.exception, error), out.output
    assert "\n" not in out.exception.message
    assert not loaded  # rejected before any weights would load


def test_existing_output_needs_resume_and_same_settings(cli, tmp_path):
    out_file = tmp_path / "r.jsonl"
    args = ["transformers", "--dataset", "humaneval", "--max-samples", "2",
            "--data-dir", str(DATA_DIR), "--output", str(out_file)]  # fmt: skip
    assert cli(args).exit_code == 0
    again = cli(args)
    assert isinstance(again.exception, InputError) and "--resume" in again.exception.hint
    changed = cli([*args, "--resume", "--max-new-tokens", "7"])
    assert isinstance(changed.exception, InputError)
    assert "max_new_tokens: 2048 then 7" in changed.exception.message


def test_sweep_checks_every_file_first_resumes_each_and_plots_each(cli, tmp_path):
    """A block-size sweep: every value's results file is checked before anything loads, --resume
    continues each one (only the missing value runs again), and --plot writes one per value."""
    out_file, plot = tmp_path / "r.jsonl", tmp_path / "p.png"
    args = ["transformers", "--dataset", "humaneval", "--max-samples", "2", "--data-dir", str(DATA_DIR),
            "--block-size", "1,4", "--output", str(out_file), "--plot", str(plot)]  # fmt: skip
    fakes = []

    def factory():
        fakes.append(FakePipeline())
        return fakes[-1]

    first = cli(args, factory)
    assert first.exit_code == 0, first.output
    files = [tmp_path / f"{stem}.bs{bs}.{ext}" for stem, ext in (("r", "jsonl"), ("p", "png")) for bs in (1, 4)]
    assert all(f.stat().st_size > 0 for f in files)
    (tmp_path / "r.bs1.jsonl").unlink()
    again = cli(args, factory)  # r.bs4.jsonl holds results: refused before the model loads
    assert isinstance(again.exception, InputError) and "r.bs4.jsonl" in again.exception.message
    assert len(fakes) == 1
    resumed = cli([*args, "--resume"], factory)
    assert resumed.exit_code == 0, resumed.output
    assert len(fakes) == 2 and {bs for _, bs in fakes[1].calls} == {1}  # only block size 1 ran again
    assert len((tmp_path / "r.bs4.jsonl").read_text().splitlines()) == 2


def test_check_parity_on_resumed_unchecked_records_says_none_was_checked(cli, tmp_path):
    """--resume --check-parity over records made without it: the table says that no response
    was checked instead of leaving the parity row out (found by a user trial)."""
    out_file = tmp_path / "r.jsonl"
    args = ["transformers", "--dataset", "humaneval", "--max-samples", "2",
            "--data-dir", str(DATA_DIR), "--output", str(out_file)]  # fmt: skip
    assert cli(args).exit_code == 0
    resumed = cli([*args, "--resume", "--check-parity"])
    assert resumed.exit_code == 0, resumed.output
    assert "0/0 identical, 2 of 2 responses not checked" in " ".join(resumed.stdout.split())


def test_ctrl_c_says_where_the_results_are_and_how_to_continue(cli, tmp_path):
    """Ctrl-C during a benchmark keeps the finished records and says to rerun with --resume
    (found by a user trial: it printed nothing)."""

    out_file = tmp_path / "r.jsonl"

    class Interrupted(FakePipeline):
        def generate(self, prompt_ids, **kw):
            if out_file.exists() and out_file.read_text().count("\n") == 1:  # one response written
                raise KeyboardInterrupt
            return super().generate(prompt_ids, **kw)

    res = cli(["transformers", "--dataset", "humaneval", "--max-samples", "2", "--data-dir", str(DATA_DIR),
               "--output", str(out_file)], Interrupted)  # fmt: skip
    assert res.exit_code != 0
    assert f"the finished responses are in {out_file}; run the same command with --resume" in res.stderr
    assert len(read_records(out_file)) == 1


def test_torn_last_line_is_dropped_and_repaired(cli, tmp_path):
    out_file = tmp_path / "r.jsonl"
    args = ["transformers", "--dataset", "humaneval", "--max-samples", "3",
            "--data-dir", str(DATA_DIR), "--output", str(out_file)]  # fmt: skip
    full = cli(args)
    lines = out_file.read_text().splitlines(keepends=True)
    out_file.write_text(lines[0] + lines[1][: len(lines[1]) // 2])  # killed while writing line 2
    resumed = cli([*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert out_file.read_text().splitlines(keepends=True) == lines
    assert last_json(resumed.stdout) == last_json(full.stdout)
    out_file.write_text(lines[0] + "garbage\n" + lines[2])
    with pytest.raises(DatasetError, match=":2 is not a valid results record"):
        read_records(out_file)


SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from tests.helpers.fakes import FakePipeline, make_app

    make_app(lambda: FakePipeline(delay=float(sys.argv[1])))(sys.argv[2:], prog_name="dflash")
    """
)


def test_killed_run_resumes_without_loss_or_duplicates(cli, tmp_path):
    """Kill a real benchmark process mid-run (inside MT-Bench), resume, compare with a full run."""
    full = cli([*BENCH_ARGS, "--output", str(tmp_path / "full.jsonl")])
    assert full.exit_code == 0, full.output

    script = tmp_path / "run_bench.py"
    script.write_text(SCRIPT.format(repo=str(REPO)))
    out_file = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        [sys.executable, str(script), "0.1", *BENCH_ARGS, "--output", str(out_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        # 4 gsm8k records, then the first MT-Bench turn: the kill lands between two turns
        while (
            not out_file.exists() or out_file.read_text().count("\n") < 5
        ) and proc.poll() is None:
            assert time.monotonic() < deadline, "the benchmark subprocess made no progress"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    written = read_records(out_file)
    assert 5 <= len(written) < 12  # killed mid-run

    fakes: list[FakePipeline] = []
    resumed = cli([*BENCH_ARGS, "--output", str(out_file), "--resume"],
                  lambda: fakes.append(FakePipeline()) or fakes[-1])  # fmt: skip
    assert resumed.exit_code == 0, resumed.output
    # only the missing responses ran (2 warm-up calls, then baseline + DFlash per response)
    assert len(fakes[0].calls) == 2 + 2 * (12 - len(written))
    got = read_records(out_file)
    want = read_records(tmp_path / "full.jsonl")
    assert len({r.key for r in got}) == len(got) == len(want) == 12
    by_key = {r.key: r.to_dict() for r in want}
    assert {r.key: r.to_dict() for r in got} == by_key
    assert last_json(resumed.stdout) == last_json(full.stdout)


def test_rank_sharding_and_rank_files(tmp_path):
    items = [PromptItem(str(i), ["q"]) for i in range(7)]
    info = harness.DistInfo(rank=1, world=3)
    assert [i.id for i in harness.shard(items, info)] == ["1", "4"]
    log = ResultsLog(tmp_path / "r.jsonl", rank=1, world=3)
    assert log.write_path == tmp_path / "r.rank1.jsonl"
    assert harness.gather_records({"x": []}, harness.DistInfo()) == {"x": []}


def test_gathered_records_come_back_in_prompt_order():
    """Rank 0 gathers rank 0's items then rank 1's; the merge restores the prompt order one
    process runs (not the string order of the ids: '10' < '9')."""
    from dflash.bench.metrics import ResponseRecord, RunStats

    items = [PromptItem(i, ["q", "q2"]) for i in ("9", "10", "2")]
    rec = [ResponseRecord("d", i, t, 5, 4, RunStats(3, 0.1, 0.2))
           for i in ("9", "2", "10") for t in (1, 0)]  # fmt: skip
    got = harness.in_prompt_order({"d": rec}, {"d": items})
    assert [(r.id, r.turn) for r in got["d"]] == [(i, t) for i in ("9", "10", "2") for t in (0, 1)]


@pytest.mark.slow
def test_torchrun_ranks_share_the_work_and_rank_0_gathers(cli, tmp_path):
    """Two CPU processes under torchrun (gloo): same records and summary as one process."""
    pytest.importorskip("torch.distributed")
    single = cli([*BENCH_ARGS, "--output", str(tmp_path / "single.jsonl")])
    assert single.exit_code == 0, single.output
    script = tmp_path / "run_bench.py"
    script.write_text(SCRIPT.format(repo=str(REPO)))
    out_file = tmp_path / "multi.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), "0", *BENCH_ARGS, "--output", str(out_file)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout) == last_json(single.stdout)
    rank_files = [tmp_path / f"multi.rank{r}.jsonl" for r in range(2)]
    ranks = [{rec.key for rec in read_records(p)} for p in rank_files]
    assert ranks[0] and ranks[1] and not ranks[0] & ranks[1]  # every response ran once
    merged = [r.to_dict() for r in read_records(out_file)]  # same records, same order
    assert merged == [r.to_dict() for r in read_records(tmp_path / "single.jsonl")]


FAILING_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from tests.helpers.fakes import FakePipeline, make_app
    from dflash.cli import report_error
    from dflash.errors import BackendError, DflashError

    class Failing(FakePipeline):  # a prompt this pipeline cannot take (only one rank holds it)
        def generate(self, prompt_ids, **kw):
            if sys.argv[1] in self.prompts[-1][0]["content"]:
                raise BackendError("the prompt does not fit this target")
            return super().generate(prompt_ids, **kw)

    try:
        make_app(Failing)(sys.argv[2:], prog_name="dflash", standalone_mode=False)
    except DflashError as err:
        report_error(err)
        sys.exit(1)
    """
)


@pytest.mark.slow
def test_torchrun_failure_on_one_rank_ends_the_run_with_its_message(tmp_path):
    """A prompt that fails on rank 1 only: rank 1 joins the gather with its error, rank 0 says
    which rank failed and why, every process exits non-zero (no wait for a timeout)."""
    from dflash.bench.command import load_prompts, select

    pytest.importorskip("torch.distributed")
    bad = select(load_prompts("gsm8k", DATA_DIR), 4)[1].turns[0]  # rank 1 takes items 1::2
    script = tmp_path / "run_failing.py"
    script.write_text(FAILING_SCRIPT.format(repo=str(REPO)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_DIST_TIMEOUT": "600"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), bad[:60], *BENCH_ARGS, "--output", str(tmp_path / "multi.jsonl")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "error: rank 1 failed: the prompt does not fit this target" in proc.stderr, proc.stderr[-3000:]
    assert "error: rank 1: the prompt does not fit this target" in proc.stderr
    assert not (tmp_path / "multi.jsonl").exists()  # no merged file from a partial run
    share = {(n, item.id) for n in ("gsm8k", "mt-bench") for item in select(load_prompts(n, DATA_DIR), 4)[::2]}
    assert {(r.dataset, r.id) for r in read_records(tmp_path / "multi.rank0.jsonl")} == share
