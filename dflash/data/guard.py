"""The no-benchmark-test-split rule for training data, checked by id and by text.

Training prompts must never come from a benchmark's test split (gsm8k test, math500, humaneval,
mbpp task ids 11-510, mt-bench). Regenerating such prompts is allowed only for held-out
evaluation (``dflash data regenerate --eval-only``), and ``dflash train`` refuses such a folder
as ``--data``. Prompt files built elsewhere are checked against the benchmark texts with
:func:`text_overlap`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from dflash.errors import DatasetError

BENCHMARK_ID_PREFIXES = ("gsm8k/", "math500/", "HumanEval/", "mt-bench/")


def benchmark_of(record_id: str) -> str | None:
    """The benchmark test split a record id belongs to, or None.

    Ids are those of ``dflash.data.datasets`` (``gsm8k/12``, ``math500/3``, ``HumanEval/7``,
    ``mbpp/42``, ``mt-bench/81``), optionally followed by ``#k`` (the k-th sampled response).
    MBPP ids count only for task ids 11..510 (the test split).
    """
    rid = record_id.split("#", 1)[0]
    for prefix in BENCHMARK_ID_PREFIXES:
        if rid.startswith(prefix):
            return prefix.rstrip("/").lower()
    m = re.fullmatch(r"mbpp/(\d+)", rid)
    if m and 11 <= int(m.group(1)) <= 510:
        return "mbpp"
    return None


def check_training_ids(ids: Iterable[str], where: str) -> None:
    """Raise if any id belongs to a benchmark test split.

    Raises:
        DatasetError: naming the first offending id and its benchmark.
    """
    for rid in ids:
        bench = benchmark_of(rid)
        if bench is not None:
            raise DatasetError(f"{where} holds '{rid}' from the {bench} test split; never train on it.",
                               hint="regenerate training data from training splits only "
                                    "(gsm8k:train, mbpp:train, mmlu, your own prompts)")  # fmt: skip


BENCHMARKS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")


def benchmark_texts(data_dir: str | None = None) -> list[str]:
    """Every turn of the five benchmarks' test prompts, for :func:`text_overlap`; a turn that
    wraps code in a ```python fence (the HumanEval template) gives only the code, so the shared
    instruction around it does not flag every templated coding prompt.

    Args:
        data_dir: local dataset copies (``--data-dir`` layout); None: the default lookup.
    """
    from dflash.data.datasets import load_prompts  # the datasets module is heavier

    texts: list[str] = []
    for name in BENCHMARKS:
        for it in load_prompts(name, data_dir=data_dir):
            texts += [t.split("```python\n", 1)[-1].rsplit("```", 1)[0] for t in it.turns]
    return texts


def normalize(text: str) -> str:
    """Lower-case alphanumerics only, for a text comparison that ignores layout."""
    return re.sub(r"[^a-z0-9]+", "", text.lower())


def text_overlap(prompts: Iterable[str], benchmark_texts: Iterable[str],
                 window: int = 60) -> list[str]:  # fmt: skip
    """Prompts that share a benchmark text's core passage.

    Each benchmark text (a question, a problem, a function stub) gives two cores: its first and
    its middle ``window`` normalized characters (the middle one skips boilerplate such as
    imports). A prompt is flagged when any ``window``-character stretch of it equals a core.
    Texts shorter than ``window`` normalized characters are compared whole.

    Returns:
        the offending prompts (empty list when clean).
    """
    cores: set[str] = set()
    whole: set[str] = set()
    for b in benchmark_texts:
        n = normalize(b)
        if len(n) < window:
            whole.add(n)
            continue
        mid = len(n) // 2 - window // 2
        cores.update((n[:window], n[mid : mid + window]))
    bad = []
    for p in prompts:
        n = normalize(p)
        if n in whole or any(
            n[i : i + window] in cores for i in range(max(1, len(n) - window + 1))
        ):
            bad.append(p)
    return bad
