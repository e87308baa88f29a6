"""Run a benchmark through any pipeline that has ``chat_prompt``/``generate``/``block_size``.

For every response (a prompt turn) the baseline (block size 1, same backend code) runs first,
then DFlash; both are timed inside ``Pipeline.generate`` (TTFT apart from decode, CUDA-synced).
Each finished response is appended to the results JSONL at once, so a killed run loses nothing
and ``resume`` skips what is done. Under torchrun, rank r takes samples r::world and rank 0
gathers the records.

The results file and its resume checks live in :mod:`dflash.bench.records`, the torchrun helpers
in :mod:`dflash.bench.distributed`; their names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from dflash.bench.distributed import (  # noqa: F401 - re-exported
    DIST_TIMEOUT_S,
    DistInfo,
    RankFailure,
    barrier,
    dist_timeout_s,
    finish_distributed,
    gather_records,
    in_prompt_order,
    init_distributed,
    once_per_machine,
    rank_device,
    shard,
)
from dflash.bench.metrics import ResponseRecord, RunStats, first_mismatch, prompt_fingerprint
from dflash.bench.records import (  # noqa: F401 - re-exported
    BenchConfig,
    Key,
    ResultsLog,
    _config_diff,
    check_resumable,
    read_records,
)
from dflash.data.datasets import PromptItem
from dflash.errors import DatasetError, InputError
from dflash.types import GenerationResult, SamplingParams

WARMUP_TOKENS = 64


class BenchPipeline(Protocol):
    """What the harness needs from ``dflash.api.Pipeline`` (any backend, or a test fake)."""

    block_size: int

    def chat_prompt(
        self, messages: list[dict], *, system: str | None = None, reasoning: str | None = None
    ) -> list[int]: ...

    def generate(
        self,
        prompt_ids: list[int],
        *,
        block_size: int | None = None,
        max_new_tokens: int = 2048,
        sampling: SamplingParams = ...,
        stop_ids: list[int] | None = None,
    ) -> GenerationResult: ...


# ---------------------------------------------------------------------------------------------
# measuring


def measure(
    pipeline: BenchPipeline, prompt_ids: list[int], block_size: int | str, config: BenchConfig
) -> tuple[GenerationResult | None, GenerationResult]:
    """Generate one response with the baseline (block size 1) and then with DFlash."""
    kwargs = {"max_new_tokens": config.max_new_tokens, "sampling": config.sampling}
    base = pipeline.generate(prompt_ids, block_size=1, **kwargs)
    fast = pipeline.generate(prompt_ids, block_size=block_size, **kwargs)
    return base, fast


def measure_reference(pipeline: BenchPipeline, prompt_ids: list[int], config: BenchConfig):
    """The backend's own generator on the same prompt (mlx: mlx_lm.stream_generate), or None."""
    reference = getattr(pipeline, "reference_generate", None)
    if reference is None:
        return None
    return reference(prompt_ids, max_new_tokens=config.max_new_tokens, sampling=config.sampling)


def make_record(
    dataset: str,
    item_id: str,
    turn: int,
    prompt_ids: list[int],
    base: GenerationResult | None,
    fast: GenerationResult,
    config: BenchConfig,
    block_size: int | str,
    fingerprint: str | None = None,
) -> ResponseRecord:
    """Turn two generation results into the record written to JSONL (``fingerprint``: the
    prompt's :func:`~dflash.bench.metrics.prompt_fingerprint`)."""

    def stats(g: GenerationResult) -> RunStats:
        return RunStats(len(g.token_ids), float(g.ttft_s), float(g.decode_s), g.finish_reason)

    parity = mismatch = None
    if config.check_parity and base is not None:
        mismatch = first_mismatch(list(base.token_ids), list(fast.token_ids))
        parity = mismatch is None
    return ResponseRecord(
        dataset=dataset,
        id=item_id,
        turn=turn,
        prompt_tokens=len(prompt_ids),
        block_size=block_size if isinstance(block_size, int) else 1 + max(fast.proposed, default=0),
        dflash=stats(fast),
        baseline=stats(base) if base is not None else None,
        acceptance_lengths=[int(a) for a in fast.acceptance_lengths],
        proposed=[int(p) for p in fast.proposed],
        parity=parity,
        first_mismatch=mismatch,
        text=fast.text,
        baseline_text=base.text if base is not None else None,
        config=config.record_config(block_size),
        prompt_sha1=fingerprint,
    )


def run_item(
    pipeline: BenchPipeline,
    dataset: str,
    item: PromptItem,
    config: BenchConfig,
    block_size: int | str,
    done: dict[Key, ResponseRecord],
) -> Iterator[tuple[ResponseRecord, bool]]:
    """Run every turn of one prompt; yields (record, measured_now).

    Turns are fed cumulatively: the DFlash answer of turn t is appended as the assistant message
    before turn t+1. A turn already in ``done`` is not measured again; its stored text is
    reused, after its messages are checked against the record's fingerprint (where stored).

    Raises:
        InputError: a stored turn was made with other settings or from another prompt.
    """
    messages: list[dict] = item.start_messages()
    for turn, text in enumerate(item.turns):
        messages.append({"role": "user", "content": text})
        record = done.get((dataset, item.id, turn))
        fresh = record is None
        fingerprint = prompt_fingerprint(messages, config.reasoning)
        if record is None:
            prompt_ids = pipeline.chat_prompt(messages, reasoning=config.reasoning)
            ref = measure_reference(pipeline, prompt_ids, config)
            base, fast = measure(pipeline, prompt_ids, block_size, config)
            record = make_record(dataset, item.id, turn, prompt_ids, base, fast, config, block_size, fingerprint)
            if record.parity is False and base is not None:
                from dflash.bench.parity import classify_mismatch

                classify_mismatch(pipeline, record, prompt_ids, base, fast, config.sampling,
                                  config.run_info.get("dtype"))  # fmt: skip
            if ref is not None:
                record.reference = RunStats(len(ref.token_ids), float(ref.ttft_s),
                                            float(ref.decode_s), ref.finish_reason)  # fmt: skip
                if record.parity is not None:  # parity also holds against the backend's own output
                    mismatch = first_mismatch(list(ref.token_ids), list(fast.token_ids))
                    if mismatch is not None and record.parity:
                        record.parity, record.first_mismatch = False, mismatch
        elif record.config != config.record_config(block_size):
            raise InputError(
                f"The results file holds {item.id} turn {turn} made with other settings "
                f"({_config_diff(record.config, config.record_config(block_size))}).",
                hint="resume with the same options, or choose another --output",
            )
        elif record.prompt_sha1 is not None and record.prompt_sha1 != fingerprint:
            raise InputError(
                f"The results file holds {item.id} turn {turn} made from other messages: the "
                "prompt or its system message changed.",
                hint="resume with the same prompts, or choose another --output",
            )
        yield record, fresh
        messages.append({"role": "assistant", "content": record.text})


def producer_info(pipeline: Any) -> dict[str, Any]:
    """What produces the tokens (backend impl, device, dtype, graphs, compile, versions), from
    ``pipeline.describe()`` when the pipeline has one; stored in every record's config."""
    describe = getattr(pipeline, "describe", None)
    return dict(describe()) if callable(describe) else {}


def warm_up(pipeline: BenchPipeline, item: PromptItem, config: BenchConfig, block_size: int | str):
    """Untimed warm-up on the first prompt: min(64, budget) tokens at block 1 and at L, no stops."""
    ids = pipeline.chat_prompt(item.first_messages(), reasoning=config.reasoning)
    n = min(WARMUP_TOKENS, config.max_new_tokens)
    reference = getattr(pipeline, "reference_generate", None)
    if reference is not None:
        reference(ids, max_new_tokens=n, sampling=config.sampling)
    for bs in (1, block_size):
        pipeline.generate(
            ids, block_size=bs, max_new_tokens=n, sampling=config.sampling, stop_ids=[]
        )


def run_benchmark(
    pipeline: BenchPipeline,
    datasets: dict[str, list[PromptItem]],
    config: BenchConfig,
    *,
    log: ResultsLog | None = None,
    on_record: Callable[[ResponseRecord], None] | None = None,
    on_dataset: Callable[[str, int], None] | None = None,
) -> dict[str, list[ResponseRecord]]:
    """Benchmark every item of every dataset; returns the records per dataset.

    Args:
        pipeline: a loaded pipeline (``dflash.api.Pipeline`` or anything alike).
        datasets: dataset name -> the items this process runs (already selected and sharded).
        config: run settings.
        log: results file; its ``done`` records are reused instead of measured again.
        on_record: called with each record as it is ready (resumed ones included), for progress.
        on_dataset: called with (name, number of responses) when a dataset starts.

    Returns:
        name -> records of that dataset's items, in run order.
    """
    log = log or ResultsLog(None)
    block_size = config.block_size or pipeline.block_size
    config.run_info.update(producer_info(pipeline))  # every record says what produced it
    check_resumable(log.done.values(), config.record_config(block_size))
    todo = [
        (name, item)
        for name, items in datasets.items()
        for item in items
        if any((name, item.id, t) not in log.done for t in range(len(item.turns)))
    ]
    if config.warmup and todo:
        warm_up(pipeline, todo[0][1], config, block_size)
    results: dict[str, list[ResponseRecord]] = {}
    for name, items in datasets.items():
        if on_dataset:
            on_dataset(name, sum(len(item.turns) for item in items))
        results[name] = []
        for item in items:
            for record, fresh in run_item(pipeline, name, item, config, block_size, log.done):
                if fresh:
                    log.append(record)
                results[name].append(record)
                if on_record:
                    on_record(record)
    return results


def check_dataset_names(names: list[str]) -> list[str]:
    """Split and de-duplicate a ``--dataset a,b`` value.

    Raises:
        DatasetError: nothing left after splitting.
    """
    out = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    if not out:
        raise DatasetError("--dataset is empty.", hint="e.g. --dataset gsm8k or --dataset a.jsonl")
    return out
