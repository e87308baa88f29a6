"""Whether the Hugging Face hub can be reached, asked once per process and quickly.

``datasets`` and ``huggingface_hub`` retry a dead connection for tens of seconds before they give
up (26 s for one benchmark dataset, measured); dflash asks first, in at most a few seconds:

- ``HF_HUB_OFFLINE`` (or ``HF_DATASETS_OFFLINE``) set to 1/true/yes/on: offline, no request;
- else one ``HEAD`` request to the hub endpoint (``HF_ENDPOINT``, default huggingface.co) through
  httpx (which honours the ``HTTPS_PROXY`` variables), bounded by a thread so a hanging name
  lookup cannot outlast the timeout either.
"""

from __future__ import annotations

import functools
import os
import threading

PROBE_TIMEOUT_S = 3.0
TRUE = ("1", "true", "yes", "on")


def endpoint() -> str:
    """The hub's URL: ``$HF_ENDPOINT`` or https://huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline_variable() -> str | None:
    """The variable that puts the hub offline (``HF_HUB_OFFLINE=1``), or None."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in TRUE:
            return f"{name}={os.environ[name].strip()}"
    return None


def _probe(url: str, timeout_s: float) -> str | None:
    """None when ``url`` answers a HEAD request (any HTTP status) within ``timeout_s``
    seconds, else the reason (one short phrase)."""
    result: list[str | None] = []

    def ask() -> None:
        try:
            import httpx

            httpx.head(url, timeout=timeout_s, follow_redirects=False)
            result.append(None)
        except Exception as err:  # noqa: BLE001 - any failure means "not reachable"
            text = str(err).splitlines()[0][:80] if str(err) else ""
            result.append(f"{type(err).__name__}{': ' + text if text else ''}")

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout_s + 0.5)
    return result[0] if result else f"no answer within {timeout_s:g} s"


@functools.lru_cache(maxsize=4)
def _probe_once(url: str, timeout_s: float) -> str | None:
    return _probe(url, timeout_s)


_WENT_OFFLINE: list[str] = []  # the reason cache_only() switched this process offline, if it did


def unreachable_reason(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub cannot be used now (``HF_HUB_OFFLINE=1 is set``, ``huggingface.co: ConnectError:
    ...``), or None when it answers. The network is asked once per process and endpoint."""
    if _WENT_OFFLINE:
        return _WENT_OFFLINE[0]
    var = offline_variable()
    if var:
        return f"{var} is set"
    url = endpoint()
    reason = _probe_once(url, timeout_s)
    return None if reason is None else f"{url.split('://', 1)[-1]}: {reason}"


def cache_only() -> str | None:
    """When the hub cannot be reached, put huggingface_hub (and so transformers and mlx-lm) in
    its offline mode for the rest of this process: a cached model then loads at once and a
    missing one fails at once, where each file request would otherwise retry for about 40 s and
    print a line per retry. Returns the reason, or None when the hub answers."""
    reason = unreachable_reason()
    if reason is not None and offline_variable() is None:
        _WENT_OFFLINE.append(reason)
        os.environ["HF_HUB_OFFLINE"] = "1"
        try:
            from huggingface_hub import constants

            constants.HF_HUB_OFFLINE = True
        except ImportError:  # pragma: no cover - a dependency of dflash
            pass
    return reason


def is_cache_miss(err: BaseException) -> bool:
    """Whether a hub library's error means "not in the cache, and the hub was not reached"."""
    text = f"{type(err).__name__} {err}".lower()
    return any(k in text for k in ("localentrynotfound", "offlinemodeisenabled", "couldn't connect",
                                   "offline mode", "outgoing traffic has been disabled"))  # fmt: skip


def cache_miss(what: str, repo: str, alternative: str):
    """The error for hub id ``repo`` missing from the cache while the hub cannot be reached
    (``what``: ``Target``, ``Draft``; ``alternative``: what to pass instead, in the hint).

    Returns:
        CheckpointError (to raise).
    """
    from dflash.errors import CheckpointError

    reason = unreachable_reason() or "the download failed"
    return CheckpointError(f"{what} {repo} is not in the hub cache, and the hub cannot be reached ({reason}).",
                           hint=f"connect to the network once to download it, or pass {alternative}")  # fmt: skip
