"""Command-line option checks shared by every command (``generate``, ``benchmark``, ``serve``):
which backend reads which option, ``--block-size`` parsing, ``--warmup`` and ``--recalibrate``."""

from __future__ import annotations

from dflash.errors import InputError

# options that only some backends read: option -> (backends that read it, what it does there)
SERVER_SIDE = ("--block-size", "--draft", "--device", "--dtype", "--cuda-graphs/--no-cuda-graphs")


def refuse_foreign_options(
    backend: str, given: dict[str, bool], readers: dict[str, tuple[str, ...]]
) -> None:
    """Refuse an option the chosen backend would silently ignore (``--block-size`` on ``openai``:
    the server picks its own; ``--base-url`` on a local backend), naming the option.

    Args:
        backend: the chosen backend.
        given: option flag (e.g. ``"--block-size"``) -> whether the user set it (not its default).
        readers: option flag -> the backends that read it.

    Raises:
        InputError: the first option set that ``backend`` does not read.
    """
    for flag, was_set in given.items():
        if was_set and backend not in readers[flag]:
            many = len(readers[flag]) > 1
            where = " and ".join(readers[flag]) + (" backends read" if many else " backend reads")
            server = backend == "openai" and flag in SERVER_SIDE  # a setting of the server's
            raise InputError(f"{flag} does not apply to the {backend} backend; only the {where} it.",
                             hint=f"drop {flag}" + (" (the server decodes with its own settings: give it "
                                                    "to the server, e.g. dflash serve)" if server else ""))  # fmt: skip


def block_size_range(trained: int | None = None) -> str:
    """The hint of every out-of-range ``--block-size`` error (generate, benchmark, serve): the
    valid values, naming the draft's trained block size ``trained`` when it is known."""
    size = f" ({trained})" if trained else ""
    return (
        f"use auto (picked per step) or 1 (no drafting) up to the draft's trained block size{size}"
    )


def parse_block_size(value: str | int | None, trained: int | None = None) -> int | str:
    """``--block-size``: "auto" or an integer >= 1 (a list only for ``benchmark``); ``trained``:
    the draft's trained block size when known, for the hint (:func:`block_size_range`).

    Raises:
        InputError: anything else.
    """
    text = str("auto" if value is None else value).strip().lower()
    if text == "auto":
        return "auto"
    if not text.lstrip("-").isdigit():
        raise InputError(f"--block-size must be auto or an integer >= 1, got {value!r}.",
                         hint="auto picks it per step; 1 decodes without a draft; the draft's trained size drafts most")  # fmt: skip
    if int(text) < 1:
        raise InputError(
            f"--block-size must be >= 1, got {int(text)}.", hint=block_size_range(trained)
        )
    return int(text)


WARMUP_DEFAULT = 64  # --warmup: untimed warm-up tokens per block size (generate, serve)


def check_warmup(tokens: int) -> None:
    """Refuse a negative ``--warmup`` (generate, serve).

    Raises:
        InputError: tokens < 0.
    """
    if tokens < 0:
        raise InputError(f"--warmup must be a whole number of tokens >= 0, got {tokens}.",
                         hint=f"the default is {WARMUP_DEFAULT}; 0 skips the warm-up")  # fmt: skip


def check_recalibrate(recalibrate: bool, block_sizes: list) -> None:
    """Refuse ``--recalibrate`` where no request uses ``--block-size auto`` (nothing would read
    the costs it measures).

    Raises:
        InputError: ``recalibrate`` without "auto" among ``block_sizes``.
    """
    if recalibrate and "auto" not in block_sizes:
        raise InputError("--recalibrate measures the costs that --block-size auto reads; this run uses a "
                         "fixed block size.", hint="drop --recalibrate, or add --block-size auto")  # fmt: skip
