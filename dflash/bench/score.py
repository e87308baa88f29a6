"""``dflash benchmark --score``: are the answers right, for the baseline and for DFlash.

- gsm8k: exact answer. The response's answer is its last ``\\boxed{...}`` (the prompt asks for
  one), else what follows its last ``####``, else its last number; the reference is what follows
  ``####`` in the dataset's answer. Numbers compare as numbers (``1,000`` = ``1000.0``).
- math500: exact answer. The response's last ``\\boxed{...}`` against the dataset's ``answer``,
  both normalized as usual for MATH (spaces, ``\\left``/``\\right``, ``\\dfrac``, ``\\text{}``,
  degrees, dollars, a leading ``x =``; numbers compare as numbers).
- humaneval, mbpp: pass@1 (one greedy sample). The last fenced code block of the response (else
  the whole response) with the dataset's tests, run by :func:`run_program` in a separate Python
  process (isolated mode, empty temporary folder, no stdin) with a timeout. This executes code
  the model wrote: it is why scoring is opt-in.
- mt-bench has no reference answers (it is judged by a model): not scored.

Under greedy decoding the baseline and DFlash texts are identical, so are their verdicts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any

CODE_TIMEOUT_S = 10.0  # per program: a test suite of HumanEval/MBPP runs in well under a second
SCORED = {"gsm8k": "exact answer", "math500": "exact answer", "humaneval": "pass@1", "mbpp": "pass@1"}
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, braces
    matched; None when there is none or it is not closed."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    i = start = starts[-1]
    depth = 1
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
        i += 1
    return None


def as_number(text: str) -> float | None:
    """``text`` as a number (commas, ``$``, ``%`` and a trailing period ignored), else None."""
    t = text.strip().replace(",", "").replace("\\$", "").replace("$", "").replace("\\%", "").rstrip("%.").strip()
    try:
        return float(t)
    except ValueError:
        return None


def gsm8k_answer(text: str) -> str | None:
    """A GSM8K response's final answer (see the module docstring), None when it has none."""
    boxed = last_boxed(text)
    if boxed is not None:
        numbers = NUMBER.findall(boxed)
        return numbers[-1] if numbers else boxed
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def gsm8k_correct(response: str, reference: str) -> bool:
    """Whether a GSM8K response's answer equals the reference's (``... #### 72``)."""
    got, want = gsm8k_answer(response), as_number(reference.rsplit("####", 1)[-1])
    value = None if got is None else as_number(got)
    return value is not None and want is not None and abs(value - want) < 1e-6


def normalize_math(answer: str) -> str:
    """A MATH answer in a canonical spelling for exact comparison."""
    s = answer.strip()
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""),
                     ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""),
                     ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""), ("degrees", "")):  # fmt: skip
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    if re.fullmatch(r"[a-zA-Z]\w?=.+", s):  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    s = s.rstrip(".")
    number = as_number(s)
    return repr(number) if number is not None else s


def math_correct(response: str, reference: str) -> bool:
    """Whether a MATH-500 response's last ``\\boxed{}`` equals the reference answer."""
    got = last_boxed(response)
    return got is not None and normalize_math(got) == normalize_math(reference)


def code_block(text: str, name: str | None) -> str:
    """The response's code: the last fenced block that defines ``name`` (the function the tests
    call), else the last fenced block, else the whole text."""
    blocks = re.findall(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)```", text, flags=re.DOTALL)
    if not blocks:
        return text
    defining = [b for b in blocks if name and re.search(rf"\bdef\s+{re.escape(name)}\s*\(", b)]
    return (defining or blocks)[-1]


def run_program(source: str, timeout_s: float = CODE_TIMEOUT_S) -> bool:
    """Run ``source`` in a separate Python process: isolated mode (no user site, no PYTHON*
    variables), an empty temporary working folder, no stdin, ``timeout_s`` seconds.

    Returns:
        True when it exits with status 0 within the time.
    """
    with tempfile.TemporaryDirectory(prefix="dflash-score-") as folder:
        path = os.path.join(folder, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        try:
            done = subprocess.run([sys.executable, "-I", path], cwd=folder, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s,
                                  env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"})  # fmt: skip
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0


def humaneval_program(response: str, ref: dict[str, Any]) -> str:
    """The program that tests a HumanEval response: the prompt's imports, the response's code,
    the dataset's ``check`` function and its call on the entry point."""
    entry = ref["entry_point"]
    code = code_block(response, entry)
    if not re.search(rf"\bdef\s+{re.escape(entry)}\s*\(", code):  # a bare body: complete the prompt
        code = ref["prompt"] + code
    imports = "\n".join(ln for ln in ref["prompt"].splitlines() if ln.startswith(("import ", "from ")))
    return f"{imports}\n{code}\n\n{ref['test']}\n\ncheck({entry})\n"


def mbpp_program(response: str, ref: dict[str, Any]) -> str:
    """The program that tests an MBPP response: the test imports, the code, the asserts."""
    called = re.search(r"assert\s+(?:not\s+)?\(?\s*(?:set\()?\s*(\w+)\s*\(", "\n".join(ref["test_list"]))
    code = code_block(response, called.group(1) if called else None)
    return "\n".join([*ref.get("test_imports", []), code, *ref["test_list"]]) + "\n"


def correct(dataset: str, response: str, ref: dict[str, Any]) -> bool:
    """The verdict on one response of a scored dataset (see :data:`SCORED`)."""
    if dataset == "gsm8k":
        return gsm8k_correct(response, ref["answer"])
    if dataset == "math500":
        return math_correct(response, ref["answer"])
    if dataset == "humaneval":
        return run_program(humaneval_program(response, ref))
    return run_program(mbpp_program(response, ref))


def score_dataset(dataset: str, records: list, references: dict[str, dict]) -> dict[str, Any] | None:
    """Score the responses of one dataset, baseline and DFlash side by side.

    Args:
        dataset: its name (``gsm8k``...); others (mt-bench, prompt files) return None.
        records: its :class:`~dflash.bench.metrics.ResponseRecord` list (``text``: DFlash,
            ``baseline_text``: the baseline, None when not kept).
        references: prompt id -> the item's ``reference`` (answer or tests).

    Returns:
        ``{"metric", "dflash": {"scored", "correct", "rate"}, "baseline": same or None,
        "disagree": [ids whose two verdicts differ]}``.
    """
    if dataset not in SCORED:
        return None
    sides: dict[str, list[bool]] = {"dflash": [], "baseline": []}
    disagree = []
    for r in records:
        ref = references.get(r.id)
        if ref is None:
            continue
        fast = correct(dataset, r.text, ref)
        sides["dflash"].append(fast)
        if r.baseline_text is not None:
            base = fast if r.baseline_text == r.text else correct(dataset, r.baseline_text, ref)
            sides["baseline"].append(base)
            if base != fast:
                disagree.append(r.id)

    def tally(verdicts: list[bool]) -> dict[str, Any] | None:
        n = len(verdicts)
        return {"scored": n, "correct": sum(verdicts), "rate": sum(verdicts) / n} if n else None

    return {"metric": SCORED[dataset], "dflash": tally(sides["dflash"]),
            "baseline": tally(sides["baseline"]), "disagree": disagree}  # fmt: skip


def add_scores(summaries: dict[str, dict], gathered: dict[str, list], selected: dict[str, list],
               console: Any) -> None:  # fmt: skip
    """Score every dataset of a benchmark run into its summary (``summary["score"]``) and
    print one line per dataset."""
    for name, records in gathered.items():
        refs = {item.id: item.reference for item in selected.get(name, []) if item.reference}
        result = score_dataset(name, records, refs)
        if result is None:
            console.print(f"{name}: not scored (--score knows {', '.join(SCORED)})")
            continue
        summaries[name]["score"] = result

        def show(side: dict | None) -> str:
            return "n/a" if side is None else f"{side['correct']}/{side['scored']} ({100 * side['rate']:.1f}%)"

        agree = "" if result["baseline"] is None else \
            f" | verdicts differ on {len(result['disagree'])}" + (f": {', '.join(result['disagree'][:5])}"
                                                                  if result["disagree"] else "")  # fmt: skip
        console.print(f"{name} {result['metric']}: baseline {show(result['baseline'])} | "
                      f"DFlash {show(result['dflash'])}{agree}")  # fmt: skip
