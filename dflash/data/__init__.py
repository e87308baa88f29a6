"""Prompt datasets for the benchmark and for draft training (see :mod:`dflash.data.datasets`)."""

from dflash.data.datasets import (
    BENCHMARK_NAMES,
    PromptItem,
    available_datasets,
    load_jsonl_prompts,
    load_prompts,
    select,
)

__all__ = [
    "BENCHMARK_NAMES",
    "PromptItem",
    "available_datasets",
    "load_jsonl_prompts",
    "load_prompts",
    "select",
]
