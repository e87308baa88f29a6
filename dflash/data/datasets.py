"""Prompt datasets shared by ``dflash benchmark`` and draft training.

    load_prompts("gsm8k")                       # benchmark split, prompts built as in brief §7.1
    load_prompts("mbpp:train", data_dir="../shared/datasets")
    load_prompts("my_prompts.jsonl")            # lines with "prompt", "turns" or "messages"
    load_prompts("my_prompts.txt")              # one prompt per non-empty line

Where rows come from: the ``data_dir`` argument, else ``$DFLASH_DATA_DIR``, else the Hugging Face
hub through ``datasets.load_dataset``, cached as JSONL under ``$DFLASH_CACHE/datasets`` (default
``~/.cache/dflash/datasets``). Local folders use the layout of ``tests/datasets`` in the repository
(:data:`DATA_DIR_FILES`).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash.data.items import PromptItem, open_text  # noqa: F401 - re-exported
from dflash.errors import DatasetError, InputError

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)
MBPP_TEST_IDS = range(11, 511)  # the MBPP test split is task ids 11..510
SELECT_SEED = 42


# ---------------------------------------------------------------------------------------------
# prompt construction, one function per source; each takes (row index, row in the local format)


def _gsm8k(split: str) -> Callable[[int, dict], PromptItem]:
    prefix = "gsm8k" if split == "test" else f"gsm8k-{split}"
    return lambda i, row: PromptItem(f"{prefix}/{i}", [_text(row, "question") + MATH_SUFFIX],
                                     reference=_pick(row, "answer"))  # fmt: skip


def _math500(i: int, row: dict) -> PromptItem:
    return PromptItem(f"math500/{i}", [_text(row, "problem") + MATH_SUFFIX], reference=_pick(row, "answer"))


def _humaneval(i: int, row: dict) -> PromptItem:
    rid = str(row.get("task_id", f"HumanEval/{i}"))
    return PromptItem(rid, [HUMANEVAL_TEMPLATE.format(prompt=_text(row, "prompt"))],
                      reference=_pick(row, "prompt", "test", "entry_point"))  # fmt: skip


def _mbpp(i: int, row: dict) -> PromptItem:
    return PromptItem(f"mbpp/{row['task_id']}", [_text(row, "prompt")],
                      reference=_pick(row, "test_list", "test_imports"))  # fmt: skip


def _pick(row: dict, *keys: str) -> dict | None:
    """The scoring fields of a row (:attr:`PromptItem.reference`); None when the first is missing."""
    return {k: row[k] for k in keys if k in row} if keys[0] in row else None


def _mt_bench(i: int, row: dict) -> PromptItem:
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise DatasetError(f"MT-Bench row {i} has no list of string 'turns'.")
    return PromptItem(f"mt-bench/{row.get('question_id', i)}", list(turns))


def format_mmlu(row: dict) -> str:
    """Turn an MMLU row (``question``, 4 ``choices``, ``subject``) into a natural prompt."""
    subject = str(row.get("subject", "")).replace("_", " ").strip()
    about = f" about {subject}" if subject else ""
    options = "\n".join(f"{letter}. {c}" for letter, c in zip("ABCD", row["choices"], strict=False))
    return (
        f"Answer the following multiple-choice question{about}.\n\n"
        f"{_text(row, 'question')}\n\n{options}\n\n"
        "Explain your reasoning briefly, then give the letter of the correct answer."
    )


def _mmlu(i: int, row: dict) -> PromptItem:
    return PromptItem(f"mmlu-{row.get('split', 'all')}/{i}", [format_mmlu(row)])


def _text(row: dict, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise DatasetError(f"A dataset row has no string field '{key}': {str(row)[:80]}.")
    return value


# ---------------------------------------------------------------------------------------------
# hub rows -> the local (tests/datasets layout) row format


def _mt_bench_from_hub(row: dict) -> dict:
    return {
        "question_id": row["prompt_id"],
        "category": row["category"],
        "turns": row["prompt"],
    }


def _mmlu_from_hub(split: str) -> Callable[[dict], dict]:
    def convert(row: dict) -> dict:
        answer = row["answer"]
        letter = "ABCD"[answer] if isinstance(answer, int) else str(answer)
        return {
            "subject": row["subject"],
            "split": split,
            "question": row["question"],
            "choices": list(row["choices"]),
            "answer": letter,
        }

    return convert


@dataclass(frozen=True)
class _Source:
    """Where one named source lives locally, on the hub and in the cache, and how to build items.

    Attributes:
        local: file under the data dir, in the tests/datasets layout.
        cache: JSONL file under the cache dir holding the hub rows in the local row format.
        hub: (repo, config, [(split, row converter or None), ...]) for ``datasets.load_dataset``.
        build: (row index among kept rows, row) -> PromptItem.
        keep: row filter (MBPP test ids, MMLU split); None keeps every row.
    """

    local: str
    cache: str
    hub: tuple[str, str | None, tuple[tuple[str, Callable[[dict], dict] | None], ...]]
    build: Callable[[int, dict], PromptItem]
    keep: Callable[[dict], bool] | None = None


_MBPP_HUB = (
    "google-research-datasets/mbpp",
    "sanitized",
    (("prompt", None), ("train", None), ("validation", None), ("test", None)),
)
_MMLU_HUB = (
    "cais/mmlu",
    "all",
    (("test", _mmlu_from_hub("test")), ("validation", _mmlu_from_hub("validation"))),
)

SOURCES: dict[str, _Source] = {
    "gsm8k": _Source(
        "gsm8k/test.jsonl",
        "gsm8k/test.jsonl",
        ("openai/gsm8k", "main", (("test", None),)),
        _gsm8k("test"),
    ),
    "math500": _Source(
        "math500/test.jsonl",
        "math500/test.jsonl",
        ("HuggingFaceH4/MATH-500", None, (("test", None),)),
        _math500,
    ),
    "humaneval": _Source(
        "humaneval/HumanEval.jsonl.gz",
        "humaneval/HumanEval.jsonl",
        ("openai/openai_humaneval", None, (("test", None),)),
        _humaneval,
    ),
    "mbpp": _Source(
        "mbpp/sanitized-mbpp.json",
        "mbpp/sanitized-mbpp.jsonl",
        _MBPP_HUB,
        _mbpp,
        keep=lambda row: row["task_id"] in MBPP_TEST_IDS,
    ),
    "mt-bench": _Source(
        "mt-bench/question.jsonl",
        "mt-bench/question.jsonl",
        ("HuggingFaceH4/mt_bench_prompts", None, (("train", _mt_bench_from_hub),)),
        _mt_bench,
    ),
    "gsm8k:train": _Source(
        "gsm8k/train.jsonl",
        "gsm8k/train.jsonl",
        ("openai/gsm8k", "main", (("train", None),)),
        _gsm8k("train"),
    ),
    "mbpp:train": _Source(
        "mbpp/sanitized-mbpp.json",
        "mbpp/sanitized-mbpp.jsonl",
        _MBPP_HUB,
        _mbpp,
        keep=lambda row: row["task_id"] not in MBPP_TEST_IDS,
    ),
    "mmlu": _Source("mmlu/mmlu.jsonl", "mmlu/mmlu.jsonl", _MMLU_HUB, _mmlu),
}
BENCHMARK_NAMES = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
ALIASES = {
    "gsm8k:test": "gsm8k",
    "math500:test": "math500",
    "humaneval:test": "humaneval",
    "mbpp:test": "mbpp",
    "mt-bench:test": "mt-bench",
    "mt_bench": "mt-bench",
    "mtbench": "mt-bench",
    "mmlu:all": "mmlu",
}


# the files a --data-dir holds (as tests/datasets in the repository does), one folder per dataset
DATA_DIR_FILES = tuple(sorted({source.local for source in SOURCES.values()}))
DATA_DIR_HINT = (f"point --data-dir (or DFLASH_DATA_DIR) at a folder laid out like tests/datasets in the dflash "
                 f"repository ({', '.join(DATA_DIR_FILES)}), or drop it to fetch the dataset from the Hugging Face hub")  # fmt: skip


def available_datasets() -> list[str]:
    """Names accepted by :func:`load_prompts` (besides a path to a ``.jsonl`` or ``.txt`` file)."""
    return list(SOURCES)


# ---------------------------------------------------------------------------------------------
# public entry points


def load_prompts(spec: str, data_dir: str | Path | None = None, offline: bool = False) -> list[PromptItem]:
    """Load the prompts of one dataset.

    Args:
        spec: a name from :func:`available_datasets` (``name`` or ``name:split``, e.g. ``gsm8k``,
            ``gsm8k:train``, ``mbpp:train``, ``mmlu``), or a path to a prompt file
            (:func:`dflash.data.prompt_files.load_prompt_file`): a ``.txt`` file holds one prompt
            per non-empty line; a ``.jsonl`` file's lines hold ``prompt`` (string), ``turns``
            (list of strings) or ``messages`` (chat list; the user turns are answered in order,
            the file's assistant turns are not used, and one leading system message is kept),
            plus an optional ``id`` and ``system`` (string).
        data_dir: folder laid out like ``tests/datasets``; None falls back to
            ``$DFLASH_DATA_DIR``, then to the hub (cached as JSONL, see module docstring).
        offline: never ask the hub: a benchmark set not in the cache comes from the copy
            shipped with dflash (:mod:`dflash.data.offline`), as it does when the hub is
            unreachable or ``HF_HUB_OFFLINE=1`` is set.

    Returns:
        The items in file order, ids unique within the dataset; for a shipped copy a
        :class:`~dflash.data.offline.ShippedPrompts` in the benchmark's selection order.

    Raises:
        DatasetError: unknown name, missing or malformed file, or the hub cannot be reached.
    """
    spec = spec.strip()
    key = ALIASES.get(spec.lower(), spec.lower())
    if key == "long" or key.startswith("long:"):  # synthetic long prompts, built from shipped rows
        from dflash.data.long_context import long_prompts

        return long_prompts(key)
    source = SOURCES.get(key)
    if source is None and _looks_like_path(spec):
        from dflash.data.prompt_files import load_prompt_file  # it imports PromptItem from here

        return load_prompt_file(spec)
    if source is None:
        raise DatasetError(
            f"Unknown dataset '{spec}'. Available: {', '.join(available_datasets())}, long (or long:1k-32k).",
            hint="or pass a .txt file (one prompt per line) or a .jsonl file with a 'prompt', "
            "'turns' or 'messages' field",
        )
    rows = _load_rows(key, source, data_dir, offline)
    if isinstance(rows, tuple):  # the shipped copy: kept rows already, in selection order
        from dflash.data.offline import ShippedPrompts

        shipped, total = rows
        return ShippedPrompts([source.build(row["_index"], row) for row in shipped], total)
    if source.keep is not None:
        rows = [row for row in rows if source.keep(row)]
    items = [source.build(i, row) for i, row in enumerate(rows)]
    if not items:
        raise DatasetError(f"Dataset '{spec}' has no rows.")
    return items


def select(items: list[PromptItem], max_samples: int | None) -> list[PromptItem]:
    """Pick the benchmark subset: shuffle indices with a dedicated ``random.Random(42)``, take N.

    The order is shuffled even when every item is kept, so a run with ``max_samples=N`` is a
    prefix of the full run. The global ``random`` state is left untouched.

    Args:
        items: all items of a dataset.
        max_samples: how many to keep; None keeps all.

    Raises:
        InputError: ``max_samples`` < 1.
    """
    if max_samples is not None and max_samples < 1:
        raise InputError(f"--max-samples must be >= 1, got {max_samples}.", hint="drop it to use every prompt")
    if getattr(items, "preselected", False):  # a shipped copy: the same order's first rows
        return list(items[:max_samples])
    order = list(range(len(items)))
    random.Random(SELECT_SEED).shuffle(order)
    if max_samples is not None:
        order = order[:max_samples]
    return [items[i] for i in order]


def _looks_like_path(spec: str) -> bool:
    lower = spec.lower()
    suffixes = (".jsonl", ".jsonl.gz", ".txt", ".txt.gz")
    return lower.endswith(suffixes) or os.sep in spec or Path(spec).is_file()


# ---------------------------------------------------------------------------------------------
# row loading: data dir > $DFLASH_DATA_DIR > cache > hub


def cache_dir() -> Path:
    """Folder of the JSONL copies of hub datasets: ``$DFLASH_CACHE/datasets`` or the default."""
    root = os.environ.get("DFLASH_CACHE")
    if root:
        return Path(root).expanduser() / "datasets"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dflash" / "datasets"


def _load_rows(name: str, source: _Source, data_dir: str | Path | None,
               offline: bool = False) -> list[dict] | tuple[list[dict], int]:  # fmt: skip
    """The rows of ``name``: from the data dir, the cache or the hub (a list), or the shipped
    copy when the hub is not to be asked or cannot be reached ((rows, full split size))."""
    if data_dir is None and os.environ.get("DFLASH_DATA_DIR"):
        data_dir = os.environ["DFLASH_DATA_DIR"]
    if data_dir is not None:
        path = Path(data_dir).expanduser() / source.local
        if not path.is_file():
            raise DatasetError(f"Dataset '{name}' is not in {data_dir}: {path} does not exist.", hint=DATA_DIR_HINT)
        return _read_rows(path)
    cached = cache_dir() / source.cache
    if cached.is_file():
        return _read_rows(cached)
    from dflash.data import offline as shipped
    from dflash.hub import unreachable_reason

    entry = shipped.shipped_index().get(name)
    why = "--offline" if offline else unreachable_reason()
    if why is None:
        try:
            rows = _download(name, source)
        except DatasetError as err:
            if entry is None:
                raise
            why = err.message.rstrip(".")
        else:
            _write_jsonl_atomic(cached, rows)
            return rows
    if entry is None:
        raise DatasetError(f"Dataset '{name}' is not in the cache and cannot be fetched ({why}); dflash "
                           f"ships only the test prompts of {', '.join(BENCHMARK_NAMES)}.",
                           hint="pass --data-dir DIR (or set DFLASH_DATA_DIR) to read a local copy")  # fmt: skip
    rows, total = shipped.shipped_rows(name)
    shipped.announce(name, why, len(rows), total)
    return rows, total


def _download(name: str, source: _Source) -> list[dict]:
    repo, config, splits = source.hub
    try:
        import datasets  # heavy import; only needed on a cache miss

        rows: list[dict] = []
        for split, convert in splits:
            for row in datasets.load_dataset(repo, config, split=split):
                rows.append(convert(dict(row)) if convert else dict(row))
    except DatasetError:
        raise
    except Exception as err:  # noqa: BLE001 - network, auth, offline: all one error to users
        reason = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        raise DatasetError(
            f"Could not load dataset '{name}' from the hub ({repo}): {reason}",
            hint="pass --data-dir DIR (or set DFLASH_DATA_DIR) to read a local copy",
        ) from None
    return rows


def _read_rows(path: Path) -> list[dict]:
    try:
        if path.name.endswith(".json"):
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise DatasetError(f"{path} should hold a JSON list of rows.")
            return data
        return [json.loads(line) for line in open_text(path) if line.strip()]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, EOFError) as err:
        raise DatasetError(f"Could not read {path}: {err}.") from None


def _write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(tmp, path)
