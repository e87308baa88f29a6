"""User prompt files for ``dflash benchmark --dataset`` and ``dflash data regenerate --prompts``.

    load_prompt_file("prompts.txt")     # one prompt per non-empty line
    load_prompt_file("prompts.jsonl")   # one JSON object per line: prompt, turns or messages

:func:`dflash.data.datasets.load_prompts` reads a path through :func:`load_prompt_file`.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.data.items import PromptItem, open_text
from dflash.errors import DatasetError

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


def load_prompt_file(path: str | Path) -> list[PromptItem]:
    """Read a user prompt file, by its name: ``.txt`` (or ``.txt.gz``) holds one prompt per
    non-empty line, ``.jsonl`` (or ``.jsonl.gz``) one JSON object per line. Another name is read
    as JSONL when its first non-empty line starts with ``{`` or ``[``, and refused otherwise.

    Raises:
        DatasetError: a missing file, a bad line (named), or a name that says neither format.
    """
    path = _existing(path)
    name = path.name.lower()
    if name.endswith(TEXT_SUFFIXES):
        return load_text_prompts(path)
    if name.endswith(JSONL_SUFFIXES):
        return load_jsonl_prompts(path)
    first = next((line.strip() for line in open_text(path) if line.strip()), "")
    if first.startswith(("{", "[")):  # JSON-looking: parsed as JSONL, a bad line is named
        return load_jsonl_prompts(path)
    raise DatasetError(f"Prompt file {path} is neither .txt nor .jsonl, and its first line is not JSON.",
                       hint="name it .txt for one prompt per line, or .jsonl for one JSON object per line")  # fmt: skip


def load_text_prompts(path: str | Path) -> list[PromptItem]:
    """Read a text prompt file: each non-empty line is one single-turn prompt, taken as written
    (surrounding whitespace stripped); ids are ``<file stem>/<line number>``.

    Raises:
        DatasetError: the file is missing or holds no prompt, or a line is not UTF-8.
    """
    path = _existing(path)
    stem = Path(path.name.removesuffix(".gz")).stem
    items = [PromptItem(f"{stem}/{lineno}", [line.strip()])
             for lineno, line in enumerate(open_text(path), start=1) if line.strip()]  # fmt: skip
    if not items:
        hint = "write one prompt per line"
        raise DatasetError(f"Prompt file {path} holds no prompts.", hint=hint)
    return items


def _existing(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"Prompt file {path} does not exist.")
    return path


def load_jsonl_prompts(path: str | Path) -> list[PromptItem]:
    """Read a JSONL prompt file: one JSON object per line (see :func:`load_prompt_file`).

    Raises:
        DatasetError: the file is missing, a line is not JSON or has none of the prompt fields
            or an empty one, or two lines share an ``id``.
    """
    path = _existing(path)
    items: list[PromptItem] = []
    seen: set[str] = set()
    for lineno, line in enumerate(open_text(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{lineno} is not valid JSON ({err.msg}).",
                               hint="write one JSON object per line, or name a file of plain prompts .txt") from None  # fmt: skip
        turns = _turns_of(row)
        if turns is None:
            raise DatasetError(
                f"{path}:{lineno} has no 'prompt' string, 'turns' list or 'messages' list.",
                hint='write one object per line, e.g. {"prompt": "Hello"}',
            )
        if not all(turn.strip() for turn in turns):
            raise DatasetError(f"{path}:{lineno} has an empty prompt.")
        system = _system_of(row, f"{path}:{lineno}")
        rid = str(row["id"]) if isinstance(row.get("id"), (str, int)) else f"{path.stem}/{lineno}"
        if rid in seen:
            raise DatasetError(f"{path}:{lineno} repeats the id '{rid}'.")
        seen.add(rid)
        items.append(PromptItem(rid, turns, system))
    if not items:
        raise DatasetError(f"Prompt file {path} holds no prompts.")
    return items


def _plain_turns(row: dict) -> list[str] | None:
    """The turns of a ``prompt`` string or a ``turns`` list (these win over ``messages``)."""
    if isinstance(row.get("prompt"), str):
        return [row["prompt"]]
    turns = row.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
        return list(turns)
    return None


def _turns_of(row: object) -> list[str] | None:
    if not isinstance(row, dict):
        return None
    turns = _plain_turns(row)
    if turns is not None:
        return turns
    messages = row.get("messages")
    if isinstance(messages, list):
        user = [
            m["content"]
            for m in messages
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)
        ]
        return user or None
    return None


def _system_of(row: dict, where: str) -> str | None:
    """A row's system message: a ``system`` string, or one ``system`` message leading
    ``messages``. Any other system or developer message in ``messages`` is refused, never
    dropped (``messages`` is not read at all when the row has ``prompt`` or ``turns``)."""
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise DatasetError(f"{where} has a 'system' field that is not a string.")
    messages = row.get("messages")
    if isinstance(messages, list) and not _plain_turns(row):
        roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
        if "developer" in roles:
            raise DatasetError(f"{where} has a 'developer' message; chat templates know 'system'.",
                               hint="rename its role to system (first message)")  # fmt: skip
        where_sys = [i for i, r in enumerate(roles) if r == "system"]
        if where_sys:
            if where_sys != [0] or not isinstance(messages[0].get("content"), str):
                raise DatasetError(
                    f"{where} has a system message that is not the first message, or several.",
                    hint="keep one system message with string content, first in 'messages'",
                )
            if system is not None:
                raise DatasetError(f"{where} has both a 'system' field and a system message.")
            system = messages[0]["content"]
    if system is not None and not system.strip():
        raise DatasetError(f"{where} has an empty system message.", hint="remove it or fill it")
    return system
