"""``dflash benchmark --score``: answer extraction, code tests in a separate process, and a
scripted benchmark whose scores are known exactly (issue 51)."""

from __future__ import annotations

import gzip
import json

import pytest
import typer
from typer.testing import CliRunner

from dflash.bench import command, score
from dflash.bench.metrics import ResponseRecord, RunStats
from dflash.data.datasets import load_prompts
from dflash.types import GenerationResult, SamplingParams
from tests.helpers.paths import DATA_DIR


@pytest.mark.parametrize("text,answer", [
    ("so she makes 9 * 2 = $18.\n#### 18", "18"),
    ("The total is \\boxed{1,234} dollars. Check: 5", "1,234"),
    ("First 3 apples, then 4 more: 7 apples.", "7"),
    ("\\boxed{\\$42}", "42"),
    ("no number here", None),
])  # fmt: skip
def test_gsm8k_answer(text, answer):
    assert score.gsm8k_answer(text) == answer


def test_gsm8k_correct_compares_numbers():
    ref = "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
    assert score.gsm8k_correct("... so \\boxed{18.0}", ref)
    assert score.gsm8k_correct("The answer is $18.", ref)
    assert not score.gsm8k_correct("The answer is 19", ref)
    assert score.gsm8k_correct("\\boxed{1,000}", "#### 1000")


@pytest.mark.parametrize("got,want,same", [
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("(3,\\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\dfrac{14}{3}", "\\frac{14}{3}", True),
    ("\\frac14", "\\frac{1}{4}", True),
    ("x = 5", "5", True),
    ("5.0", "5", True),
    ("90^\\circ", "90", True),
    ("\\text{(C)}", "(C)", True),
    ("\\frac{14}{4}", "\\frac{14}{3}", False),
    ("p+q", "p - q", False),
])  # fmt: skip
def test_math_normalization(got, want, same):
    assert (score.normalize_math(got) == score.normalize_math(want)) is same


def test_math_correct_reads_the_last_boxed():
    assert score.last_boxed("a \\boxed{1} then \\boxed{\\frac{a}{b}} end") == "\\frac{a}{b}"
    assert score.last_boxed("\\boxed{unclosed") is None
    assert score.math_correct("So $p - q$ is \\boxed{p - q}.", "p - q")
    assert not score.math_correct("p - q", "p - q")  # no \boxed{}: no answer


def test_code_runs_in_a_separate_process_with_a_timeout(tmp_path):
    assert score.run_program("assert 1 + 1 == 2\n")
    assert not score.run_program("assert 1 + 1 == 3\n")
    assert not score.run_program("while True:\n    pass\n", timeout_s=1.0)
    marker = tmp_path / "written"
    score.run_program(f"open({str(marker)!r}, 'w').write('x')\nimport os\nassert os.listdir('.') == ['program.py']\n")
    assert marker.exists()  # it ran, in its own empty folder (its files are removed after)


def humaneval_rows():
    with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_humaneval_and_mbpp_programs_pass_with_the_reference_code():
    for row in humaneval_rows():
        ref = {k: row[k] for k in ("prompt", "test", "entry_point")}
        fenced = f"Here it is:\n```python\n{row['prompt']}{row['canonical_solution']}```\nDone."
        assert score.correct("humaneval", fenced, ref)
        assert score.correct("humaneval", row["canonical_solution"], ref)  # a bare body completes the prompt
        assert not score.correct("humaneval", f"```python\ndef {row['entry_point']}(*a):\n    return None\n```", ref)
    rows = json.loads((DATA_DIR / "mbpp" / "sanitized-mbpp.json").read_text())
    for row in rows:
        ref = {"test_list": row["test_list"], "test_imports": row["test_imports"]}
        assert score.correct("mbpp", f"```python\n{row['code']}\n```", ref)
        assert not score.correct("mbpp", "```python\nprint('no function')\n```", ref)


def record(i: str, text: str, base: str | None) -> ResponseRecord:
    return ResponseRecord("gsm8k", i, 0, 5, 4, RunStats(3, 0.1, 0.2), RunStats(3, 0.1, 0.3), text=text,
                          baseline_text=base)  # fmt: skip


def test_score_dataset_counts_exactly():
    refs = {"a": {"answer": "#### 1"}, "b": {"answer": "#### 2"}, "c": {"answer": "#### 3"}}
    recs = [record("a", "\\boxed{1}", "\\boxed{1}"), record("b", "\\boxed{2}", "\\boxed{5}"),
            record("c", "4", None), record("zz", "1", "1")]  # fmt: skip
    got = score.score_dataset("gsm8k", recs, refs)
    assert got == {"metric": "exact answer", "dflash": {"scored": 3, "correct": 2, "rate": 2 / 3},
                   "baseline": {"scored": 2, "correct": 1, "rate": 0.5}, "disagree": ["b"]}  # fmt: skip
    assert score.score_dataset("mt-bench", recs, refs) is None


class AnswerBook:
    """A pipeline stand-in that answers each prompt from a script: prompt text -> (baseline
    text, DFlash text)."""

    block_size = 4
    stop_ids = [0]

    def __init__(self, script: dict[str, tuple[str, str]]):
        self.script = script
        self.last = ""

    def chat_prompt(self, messages, *, system=None, reasoning=None):
        self.last = messages[-1]["content"]
        return [1, 2, 3]

    def generate(self, prompt_ids, *, block_size=None, max_new_tokens=2048, sampling=SamplingParams(), stop_ids=None):
        base, fast = self.script[self.last]
        text = base if block_size == 1 else fast
        return GenerationResult(token_ids=[5, 6, 7], text=text, prompt_tokens=3, acceptance_lengths=[2],
                                proposed=[3], ttft_s=0.01, decode_s=0.02, finish_reason="stop",
                                block_size=block_size or 4)  # fmt: skip


def test_benchmark_score_side_by_side(monkeypatch):
    """gsm8k (6 rows: 4 right, one of them wrong in the baseline), math500 (3 rows: 2 right) and
    mbpp (3 rows: 1 right) from tests/data; mt-bench is not scored."""
    items = {n: load_prompts(n, DATA_DIR) for n in ("gsm8k", "math500", "mbpp", "mt-bench")}
    script = {}
    for k, it in enumerate(items["gsm8k"]):
        right = f"\\boxed{{{it.reference['answer'].rsplit('####', 1)[1].strip()}}}"
        fast = right if k < 4 else "\\boxed{-1}"
        script[it.turns[0]] = ("\\boxed{-7}" if k == 0 else fast, fast)
    for k, it in enumerate(items["math500"]):
        boxed = "\\boxed{" + it.reference["answer"] + "}"
        script[it.turns[0]] = (boxed if k < 2 else "no idea",) * 2
    codes = {f"mbpp/{r['task_id']}": r["code"] for r in json.loads((DATA_DIR / "mbpp" / "sanitized-mbpp.json").read_text())}
    for k, it in enumerate(items["mbpp"]):
        script[it.turns[0]] = ((f"```python\n{codes[it.id]}\n```" if k == 0 else "pass"),) * 2
    for it in items["mt-bench"]:
        for turn in it.turns:
            script[turn] = ("sure", "sure")
    monkeypatch.setattr(command, "_load_pipeline", lambda *a, **k: AnswerBook(script))
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command()(command.benchmark)
    result = CliRunner().invoke(app, ["transformers", "--dataset", "gsm8k,math500,mbpp,mt-bench",
                                      "--data-dir", str(DATA_DIR), "--score"])  # fmt: skip
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    out = json.loads(result.stdout.strip().splitlines()[-1])["datasets"]
    gsm = out["gsm8k"]["score"]
    assert gsm["dflash"] == {"scored": 6, "correct": 4, "rate": 4 / 6}
    assert gsm["baseline"] == {"scored": 6, "correct": 3, "rate": 3 / 6}
    assert gsm["disagree"] == [items["gsm8k"][0].id]
    assert out["math500"]["score"]["dflash"]["correct"] == 2 == out["math500"]["score"]["baseline"]["correct"]
    assert out["mbpp"]["score"]["metric"] == "pass@1"
    assert out["mbpp"]["score"]["dflash"] == {"scored": 3, "correct": 1, "rate": 1 / 3}
    assert "score" not in out["mt-bench"]
    assert "gsm8k exact answer: baseline 3/6 (50.0%) | DFlash 4/6 (66.7%) | verdicts differ on 1" in result.stdout
    assert "mt-bench: not scored" in result.stdout


def test_score_refuses_a_sweep():
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command()(command.benchmark)
    result = CliRunner().invoke(app, ["transformers", "--dataset", "gsm8k", "--block-size", "1,4", "--score"])
    assert result.exit_code == 1 and "--score scores one run" in result.exception.message
