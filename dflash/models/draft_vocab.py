"""Draft vocabulary: the draft's LM head restricted to the target tokens it is likely to propose.

The draft shares the target's LM head, a [V, H] matrix read from memory at every draft call:
on the demo pair (V = 49,152, H = 576, bf16) that is 56.6 MB, about 15 us of the H200's
0.74 ms step, while the target's answers use a few thousand distinct tokens. A draft
vocabulary keeps the Vd most frequent tokens of the target's own regenerated answers (EAGLE-3
ships such a reduced draft vocabulary, ``draft_vocab_size``); the draft then scores only those
rows and proposes only those tokens.

Lossless by construction: the target verifies every proposal, so a token outside the draft
vocabulary is never proposed (at that position the draft's proposal is rejected and the target's
token committed as the bonus), and under sampling the draft's distribution q is zero outside it,
which rejection sampling (Leviathan et al. 2023) handles exactly: the residual max(p - q, 0)
carries the mass. Outputs are therefore those of the target, token for token (greedy) or in
distribution (sampling); only τ can drop, by about the share of committed tokens left out.

Stored as ``draft_vocab.json`` in the draft folder (beside ``acceptance.json``):
``{"token_ids": [...sorted target ids...], "source": ..., "coverage": ...}``. Every backend
uses it when present, unless the ``draft_vocab`` setting (``dflash.kernels.settings``) is off
(side-by-side measurements).
``dflash data vocab`` writes it from regenerated shards.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from dflash.errors import CheckpointError, InputError

VOCAB_FILE = "draft_vocab.json"
DEFAULT_SIZE = 16384  # covers > 99.9 % of the demo target's answer tokens (README, dflash data vocab)


def load_draft_vocab(folder: str | Path, vocab_size: int) -> list[int] | None:
    """The sorted target token ids of a draft folder's ``draft_vocab.json``, or None (no file).

    Args:
        folder: the draft folder; vocab_size: V, the target (and draft config) vocabulary.

    Raises:
        CheckpointError: a folder (or dangling link) of that name, an unreadable file, or ids that
            are not distinct integers in [0, V).
    """
    path = Path(folder) / VOCAB_FILE
    if not (path.exists() or path.is_symlink()):
        return None
    check_vocab_path(path)
    try:
        data = json.loads(path.read_text())
        ids = data["token_ids"] if isinstance(data, dict) else None
        if ids is None:
            raise KeyError("token_ids")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"Cannot read {path}: {type(e).__name__} {e}.",
                              hint="delete it to use the full vocabulary, or rewrite it with 'dflash data vocab'") from e  # fmt: skip
    check_ids(ids, vocab_size, path)
    return sorted(ids)


def check_vocab_path(path: Path) -> None:
    """Raise CheckpointError when ``path`` (a draft's ``draft_vocab.json``) exists but is not a
    file: a folder of that name would otherwise be skipped without a word."""
    if (path.exists() or path.is_symlink()) and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a readable file"
        raise CheckpointError(f"{path} is {kind}, not a draft vocabulary file.",
                              hint="remove it, then rewrite it with 'dflash data vocab' if you want one")  # fmt: skip


def check_not_shipped(folder: Path) -> None:
    """Raise InputError when ``folder`` lies inside the installed dflash package's ``assets``
    (the shipped demo draft): a shipped draft is never modified in place."""
    assets = Path(__file__).resolve().parent.parent / "assets"
    if Path(folder).resolve().is_relative_to(assets):
        raise InputError(f"--draft {folder} is a draft shipped inside the dflash package ({assets}); "
                         "it is not modified in place.",
                         hint=f"copy the draft folder elsewhere first, e.g. cp -r {folder} my-draft, "
                         "and pass --draft my-draft")  # fmt: skip


def check_ids(ids, vocab_size: int, where: str | Path = "draft vocabulary") -> None:
    """Raise CheckpointError unless ``ids`` is a non-empty list of distinct ints in [0, V)."""
    bad = None
    if not isinstance(ids, list) or not ids:
        bad = "an empty or missing list"
    else:
        wrong = [i for i in ids if type(i) is not int or not 0 <= i < vocab_size]
        if wrong:
            bad = f"{wrong[0]!r}"
        elif len(set(ids)) != len(ids):
            bad = f"{next(i for i in ids if ids.count(i) > 1)} twice"
    if bad is not None:
        raise CheckpointError(f"{where} must list distinct token ids in [0, {vocab_size}); it has {bad}.",
                              hint="rewrite it with 'dflash data vocab'")  # fmt: skip


def save_draft_vocab(folder: str | Path, token_ids: Iterable[int], **meta) -> Path:
    """Write ``draft_vocab.json`` (sorted ids plus ``meta``) into ``folder``; returns its path."""
    path = Path(folder) / VOCAB_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**meta, "size": len(ids := sorted(set(token_ids))), "token_ids": ids}))
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def count_tokens(samples: Iterable) -> Counter:
    """Counts of every response token id over regenerated samples (``Sample.response_ids``
    or dicts with ``response_ids``)."""
    counts: Counter = Counter()
    for s in samples:
        counts.update(s["response_ids"] if isinstance(s, dict) else s.response_ids)
    return counts


def check_counts(counts: Counter, vocab_size: int, where: str | Path) -> None:
    """Raise DatasetError when counted ids fall outside [0, V) (shards of another target)."""
    from dflash.errors import DatasetError

    bad = sorted(i for i in counts if not 0 <= i < vocab_size)
    if bad:
        raise DatasetError(f"{where} holds token ids outside the draft's vocabulary of {vocab_size} "
                           f"(e.g. {bad[0]}).", hint="regenerate the data with this draft's target")  # fmt: skip


def check_size(size: int, vocab_size: int) -> None:
    """Raise InputError unless 1 <= size < V (all V ids would change nothing)."""
    if not 1 <= size < vocab_size:
        raise InputError(f"--size {size} is outside 1..{vocab_size - 1}: a draft vocabulary keeps fewer "
                         f"tokens than the target's {vocab_size:,}.",
                         hint="use a smaller size, or --size 0 to remove one")  # fmt: skip


def choose(counts: Counter, size: int, vocab_size: int) -> list[int]:
    """The ``size`` most frequent ids of ``counts`` (ties by lower id), topped up with the lowest
    ids never counted when fewer were seen; sorted.

    Raises:
        InputError: ``size`` outside [1, V).
    """
    check_size(size, vocab_size)
    seen = sorted((i for i in counts if 0 <= i < vocab_size), key=lambda i: (-counts[i], i))[:size]
    if len(seen) < size:
        have = set(seen)
        seen += [i for i in range(vocab_size) if i not in have][: size - len(seen)]
    return sorted(seen)


def coverage(token_ids: Iterable[int], counts: Counter) -> float:
    """The share of counted tokens inside ``token_ids`` (1.0 when nothing was counted)."""
    total = sum(counts.values())
    keep = set(token_ids)
    return 1.0 if not total else sum(n for i, n in counts.items() if i in keep) / total
