"""``dflash benchmark openai``: load-test OpenAI-compatible servers with the harness's datasets.

    dflash benchmark openai --base-url http://127.0.0.1:30000 --dataset gsm8k \\
        --num-prompts 64 --concurrency 8 --baseline-url http://127.0.0.1:30001

Every request streams (SSE) and is timed on its own: TTFT = first delta of any kind (reasoning
included), TPOT = (end-to-end - TTFT) / (completion tokens - 1), end-to-end latency; a dataset's
output tok/s = its completion tokens / its wall time. Requests run at most ``concurrency`` at a
time (asyncio + one httpx.AsyncClient); ``concurrency`` warm-up requests of min(64, budget) tokens
go first, untimed. Failed requests (HTTP errors after bounded retries, timeouts, broken streams)
are counted and listed apart and never enter the speed figures. Acceptance comes from SGLang-style
``meta_info`` and/or vLLM ``/metrics`` counters scraped before and after each dataset
(brief §7.5); "not reported by server" when neither exists. Per-position acceptance is the
local benchmark's P(k accepted | 1..k-1 accepted), counted over the verify steps that proposed
draft k after accepting drafts 1..k-1; it is exact where the server says how many drafts each
step proposed (``dflash serve``, whose ``--block-size auto`` varies the width per step) and
assumes one width for every step otherwise (SGLang, vLLM). ``--baseline-url`` runs the same
prompts against a second server (speculation off) first, for a speedup.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dflash.backends.openai import (
    ChatResult,
    RetryPolicy,
    api_root,
    chat_body,
    chat_completion,
    first_model,
    scrape_metrics,
)
from dflash.backends.openai_stats import SpecCounters, meta_stats
from dflash.bench.metrics import (
    ResponseRecord,
    RunStats,
    histogram_fractions,
    per_position_acceptance,
)
from dflash.data.datasets import PromptItem
from dflash.errors import InputError
from dflash.paths import make_parent
from dflash.types import SamplingParams

WARMUP_TOKENS = 64


@dataclass
class Endpoint:
    """One server of the run: side "dflash" (speculative) or "baseline"."""

    side: str
    base_url: str
    model: str | None = None

    @property
    def root(self) -> str:
        return api_root(self.base_url)


@dataclass
class RemoteConfig:
    """Settings of one ``benchmark openai`` run (the API key is kept out of every record)."""

    max_new_tokens: int = 2048
    sampling: SamplingParams = field(default_factory=SamplingParams)
    reasoning: str | None = None
    concurrency: int = 1
    timeout_s: float = 3600.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    warmup: bool = True

    def record_config(self, endpoint: Endpoint) -> dict[str, Any]:
        s = self.sampling
        return {"backend": "openai", "side": endpoint.side, "base_url": endpoint.base_url,
                "model": endpoint.model, "max_new_tokens": self.max_new_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
                "reasoning": self.reasoning, "concurrency": self.concurrency}  # fmt: skip


@dataclass
class RemoteRecord:
    """One request of the run; one line of ``--output`` JSONL.

    Attributes:
        side: "dflash" (the --base-url server) or "baseline".
        ok / error / error_kind / status / attempts: outcome (see ``ChatResult``).
        new_tokens: completion tokens (usage), or deltas when ``usage_reported`` is False.
        ttft_s, e2e_s: seconds; tpot_s derived.
        tau, verify_ct, histogram: from the server's meta_info (None when not reported);
            ``histogram[k]`` = verify steps that accepted k drafts.
        accept_lengths, proposed: per verify step, τ (tokens committed, bonus included) and
            draft tokens proposed (0 for a plain step), from meta_info's
            ``spec_accept_length_per_step`` / ``spec_proposed_drafts_per_step`` (``dflash
            serve``); None when the server does not send them (SGLang, vLLM).
    """

    dataset: str
    id: str
    turn: int
    side: str
    ok: bool
    error: str | None = None
    error_kind: str | None = None
    status: int | None = None
    attempts: int = 1
    prompt_tokens: int | None = None
    new_tokens: int = 0
    usage_reported: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    finish_reason: str | None = None
    tau: float | None = None
    verify_ct: int | None = None
    histogram: list[int] | None = None
    accept_lengths: list[int] | None = None
    proposed: list[int] | None = None
    text: str = ""
    reasoning: str = ""
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first; None without a decode phase."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.new_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.new_tokens - 1)

    @classmethod
    def from_result(cls, dataset: str, item_id: str, turn: int, endpoint: Endpoint,
                    r: ChatResult, config: dict[str, Any]) -> RemoteRecord:  # fmt: skip
        stats = meta_stats(r.meta) if r.ok else None
        return cls(dataset=dataset, id=item_id, turn=turn, side=endpoint.side, ok=r.ok,
                   error=r.error, error_kind=r.error_kind, status=r.status, attempts=r.attempts,
                   prompt_tokens=r.prompt_tokens, new_tokens=r.new_tokens,
                   usage_reported=r.completion_tokens is not None, ttft_s=r.ttft_s, e2e_s=r.e2e_s,
                   finish_reason=r.finish_reason, tau=stats["tau"] if stats else None,
                   verify_ct=stats["verify_ct"] if stats else None,
                   histogram=stats["histogram"] if stats else None,
                   accept_lengths=stats["accept_lengths"] if stats else None,
                   proposed=stats["proposed"] if stats else None, text=r.text,
                   reasoning=r.reasoning, config=config)  # fmt: skip


class JsonlWriter:
    """Appends one flushed JSON line per record (None path: keep nothing).

    Raises:
        InputError: the file exists and is not empty (no resume for the openai backend).
    """

    def __init__(self, path: Path | None):
        self.path = path
        if path is not None:
            if path.is_file() and path.stat().st_size > 0:
                raise InputError(f"{path} already holds results.", hint="choose another --output")
            make_parent(path, "--output")

    def write(self, record: RemoteRecord) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
            f.flush()


def take_prompts(items: list[PromptItem], count: int | None, extra: int) -> tuple[list[PromptItem], list[PromptItem]]:  # fmt: skip
    """``count`` items (None: all) in the given order, wrapping around when count exceeds the
    dataset (repeats get ``#r`` id suffixes), plus ``extra`` more for the warm-up."""
    n = len(items) if count is None else count
    out = []
    for i in range(n + extra):
        item = items[i % len(items)]
        rounds = i // len(items)
        out.append(item if rounds == 0 else PromptItem(f"{item.id}#{rounds}", item.turns, item.system))
    return out[:n], out[n:]


async def _run_item(client: httpx.AsyncClient, endpoint: Endpoint, dataset: str,
                    item: PromptItem, cfg: RemoteConfig, api_key: str | None,
                    sem: asyncio.Semaphore, sink: Any) -> None:  # fmt: skip
    """All turns of one prompt in order (the server's answer feeds the next turn)."""
    async with sem:
        messages: list[dict] = item.start_messages()
        for turn, text in enumerate(item.turns):
            messages.append({"role": "user", "content": text})
            body = chat_body(endpoint.model or "", messages, cfg.max_new_tokens, cfg.sampling,
                             reasoning=cfg.reasoning)  # fmt: skip
            result = await chat_completion(client, endpoint.root, body, api_key=api_key,
                                           retry=cfg.retry)  # fmt: skip
            sink(RemoteRecord.from_result(dataset, item.id, turn, endpoint, result,
                                          cfg.record_config(endpoint)))  # fmt: skip
            if not result.ok:
                return
            messages.append({"role": "assistant", "content": result.text})


async def warm_up(client: httpx.AsyncClient, endpoint: Endpoint, items: list[PromptItem],
                  cfg: RemoteConfig, api_key: str | None) -> list[ChatResult]:  # fmt: skip
    """Untimed requests (first turns, min(64, budget) tokens), all at once."""
    n = min(WARMUP_TOKENS, cfg.max_new_tokens)

    async def one(item: PromptItem) -> ChatResult:
        body = chat_body(endpoint.model or "", item.first_messages(), n,
                         cfg.sampling, reasoning=cfg.reasoning)  # fmt: skip
        return await chat_completion(client, endpoint.root, body, api_key=api_key, retry=cfg.retry)

    return list(await asyncio.gather(*(one(i) for i in items)))


async def run_side(client: httpx.AsyncClient, endpoint: Endpoint,
                   datasets: dict[str, list[PromptItem]], warmup_items: list[PromptItem],
                   cfg: RemoteConfig, api_key: str | None, writer: JsonlWriter,
                   progress: Any = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Benchmark one server over every dataset.

    Returns:
        dataset -> {"records": [RemoteRecord], "wall_s": float, "counters": dict | None,
        "warmup_errors": int}.
    """
    import time

    if endpoint.model is None:
        flag = "--baseline-url" if endpoint.side == "baseline" else "--base-url"
        endpoint.model = await first_model(client, endpoint.root, api_key, flag)
    warm_errors = 0
    if cfg.warmup and warmup_items:
        warm_errors = sum(
            not r.ok for r in await warm_up(client, endpoint, warmup_items, cfg, api_key)
        )
    out: dict[str, dict[str, Any]] = {}
    for name, items in datasets.items():
        records: list[RemoteRecord] = []

        def sink(record: RemoteRecord, records: list[RemoteRecord] = records) -> None:
            records.append(record)
            writer.write(record)
            if progress is not None:
                progress(record)

        before = SpecCounters.from_text(await scrape_metrics(client, endpoint.base_url))
        sem = asyncio.Semaphore(cfg.concurrency)
        t0 = time.perf_counter()
        await asyncio.gather(*(_run_item(client, endpoint, name, item, cfg, api_key, sem, sink)
                               for item in items))  # fmt: skip
        wall = time.perf_counter() - t0
        after = SpecCounters.from_text(await scrape_metrics(client, endpoint.base_url))
        counters = after.minus(before).stats() if after is not None else None
        out[name] = {"records": records, "wall_s": wall, "counters": counters,
                     "warmup_errors": warm_errors}  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# summaries


def percentiles(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(values)

    def q(p: float) -> float:
        pos = (len(xs) - 1) * p
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": sum(xs) / len(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def _as_response_records(records: list[RemoteRecord]) -> list[ResponseRecord]:
    """Per-step τ and proposal lists of each record as local ``ResponseRecord``s, so the local
    metrics (histogram, :func:`per_position_acceptance`) apply unchanged.

    Where the server sent each step's τ and proposals (``accept_lengths`` / ``proposed``, from
    ``dflash serve``) they are used as they are: exact under ``--block-size auto``, whose steps
    have different widths (a plain step proposes 0 tokens and counts at no position). Otherwise
    the meta histogram is expanded and every step is assumed to have proposed
    ``len(histogram) - 1`` drafts: right for servers that draft at one fixed width (SGLang,
    vLLM; only a last step narrowed by the budget is miscounted), biased for varying widths.
    The block size of a record is ``len(histogram)`` (the server's L), at least the widest step.
    Records without a histogram or per-step lists are left out.
    """
    out = []
    for r in records:
        stats = RunStats(r.new_tokens, r.ttft_s or 0.0, 0.0)
        if r.accept_lengths is not None and r.proposed is not None:
            size = max([len(r.histogram or [])] + [p + 1 for p in r.proposed] + [1])
            out.append(ResponseRecord(r.dataset, r.id, r.turn, r.prompt_tokens or 0, size, stats,
                                      acceptance_lengths=list(r.accept_lengths),
                                      proposed=list(r.proposed)))  # fmt: skip
            continue
        if r.histogram is None:
            continue
        size = len(r.histogram)
        taus = [k + 1 for k, c in enumerate(r.histogram) for _ in range(c)]
        out.append(ResponseRecord(r.dataset, r.id, r.turn, r.prompt_tokens or 0, size, stats,
                                  acceptance_lengths=taus, proposed=[size - 1] * len(taus)))  # fmt: skip
    return out


def side_summary(run: dict[str, Any]) -> dict[str, Any]:
    """Speed and acceptance of one server on one dataset (JSON-ready; seconds, tok/s).

    ``per_position_acceptance[k-1]`` (k = 1..L-1) is P(draft k accepted | drafts 1..k-1
    accepted) pooled over the verify steps that proposed draft k: those that accepted k over
    those that accepted 1..k-1 (see :func:`_as_response_records`; None where no step proposed
    draft k after accepting 1..k-1), from meta_info, else from
    ``/metrics`` (:meth:`SpecCounters.stats`). ``histogram[k-1]`` counts verify steps of τ = k,
    plain steps (τ = 1) included.
    """
    records: list[RemoteRecord] = run["records"]
    ok = [r for r in records if r.ok]
    errors = [r for r in records if not r.ok]
    tokens = sum(r.new_tokens for r in ok)
    wall = run["wall_s"]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    taus = [r.tau for r in ok if r.tau is not None]
    weighted = [(r.tau, r.verify_ct) for r in ok if r.tau is not None and r.verify_ct]
    hist_records = _as_response_records(ok)
    size = max((rr.block_size for rr in hist_records), default=0)
    counts = [0] * size
    for rr in hist_records:
        for a in rr.acceptance_lengths:
            counts[a - 1] += 1
    counters = run["counters"]
    per_pos = per_position_acceptance(hist_records, size) if hist_records else []
    if not per_pos and counters and counters["drafts"]:
        per_pos = counters["per_position_acceptance"]
    sources = [s for s, present in (("meta_info", bool(taus)),
                                    ("/metrics", bool(counters and counters["drafts"]))) if present]  # fmt: skip
    return {
        "requests": len(records),
        "prompts": len({(r.dataset, r.id) for r in records}),  # a multi-turn prompt: one request a turn
        "ok": len(ok),
        "errors": len(errors),
        "error_kinds": {
            k: sum(r.error_kind == k for r in errors) for k in {r.error_kind for r in errors}
        },
        "warmup_errors": run["warmup_errors"],
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall if wall > 0 and ok else None,
        "requests_per_s": len(ok) / wall if wall > 0 and ok else None,
        "decode_tok_s": 1.0 / (sum(tpots) / len(tpots)) if tpots and sum(tpots) > 0 else None,
        "usage_reported": all(r.usage_reported for r in ok) if ok else None,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": percentiles(tpots),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "acceptance_source": " and ".join(sources) if sources else None,
        "tau_mean_of_responses": sum(taus) / len(taus) if taus else None,
        "tau_step_weighted": (
            sum(t * v for t, v in weighted) / sum(v for _, v in weighted) if weighted else None
        ),  # fmt: skip
        "verify_steps": sum(v for _, v in weighted) if weighted else None,
        "metrics_counters": counters,
        "block_size": size or None,
        "histogram": counts,
        "histogram_fractions": histogram_fractions(counts),
        "per_position_acceptance": per_pos,
    }


def dataset_summary(main: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """Both sides of one dataset plus the speedup (baseline / DFlash; None without baseline)."""
    fast = side_summary(main)
    slow = side_summary(base) if base is not None else None
    speed = None
    if slow is not None:

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a and b else None

        speed = {"decode": ratio(slow["tpot_s"]["mean"], fast["tpot_s"]["mean"]),
                 "output_tok_s": ratio(fast["output_tok_s"], slow["output_tok_s"]),
                 "e2e": ratio(slow["e2e_s"]["mean"], fast["e2e_s"]["mean"])}  # fmt: skip
    return {"dflash": fast, "baseline": slow, "speedup": speed,
            "histogram": fast["histogram"], "histogram_fractions": fast["histogram_fractions"],
            "per_position_acceptance": fast["per_position_acceptance"]}  # fmt: skip
