"""Output paths given on the command line: make their folder, or say in one line why not.

``--output afile/x.jsonl`` where ``afile`` is a file made ``mkdir`` fail with a bare
"File exists" (user trial); these helpers name the file that is in the way instead.
"""

from __future__ import annotations

from pathlib import Path

from dflash.errors import InputError


def file_in_the_way(path: str | Path) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is a file (not a folder), else None:
    the reason a folder cannot be made there."""
    for parent in Path(path).parents:
        if parent.exists():
            return None if parent.is_dir() else parent
        if parent.is_symlink():  # a dangling link: no folder can be made through it
            return parent
    return None


def make_parent(path: str | Path, flag: str) -> None:
    """Create the folder of an output file (and its parents), as ``mkdir -p`` does.

    Args:
        path: the file the option names.
        flag: the option (``--output``, ``--plot``), named in the error.

    Raises:
        InputError: one line naming the path, what blocks it and the fix.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = file_in_the_way(path)
        if blocker is not None:
            raise InputError(f"{flag} {path} cannot be written: {blocker} is a file, not a folder.",
                             hint=f"write it elsewhere (e.g. {flag} {blocker.parent / path.name}) "
                             f"or move the file {blocker} away") from None  # fmt: skip
        raise InputError(f"{flag} {path} cannot be written: {e.strerror or e}.",
                         hint=f"choose a writable {flag} file") from None  # fmt: skip


def refuse_folder(path: str | Path, flag: str, name: str) -> None:
    """Refuse an output option that names a folder: the error asks for a file path and the hint
    names one inside that folder (``--output runs/`` -> ``--output runs/results.jsonl``).

    Args:
        path: what the option was given.
        flag: the option (``--output``, ``--plot``), named in the error.
        name: the example file name in the hint; its suffix is the kind of file asked for.

    Raises:
        InputError: ``path`` is an existing folder or ends in a path separator.
    """
    if Path(path).is_dir() or str(path).endswith(("/", "\\")):
        raise InputError(f"{flag} {path} is a folder; pass a {Path(name).suffix} file path.",
                         hint=f"name a file in it, e.g. {flag} {Path(path) / name}")  # fmt: skip


def key_path(path) -> str:
    """A cost-cache key's path: absolute for a local file or folder (two folders both named
    ``draft`` in different places are different drafts), as given otherwise (a hub id)."""
    from pathlib import Path

    p = Path(str(path))
    return str(p.resolve()) if p.exists() else str(path)
