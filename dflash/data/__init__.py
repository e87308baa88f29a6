"""Prompt datasets for the benchmark and for draft training (see :mod:`dflash.data.datasets`)."""

from dflash.data.datasets import (
    BENCHMARK_NAMES,
    PromptItem,
    available_datasets,
    load_prompts,
    select,
)
from dflash.data.prompt_files import load_jsonl_prompts, load_prompt_file, load_text_prompts

__all__ = [
    "BENCHMARK_NAMES",
    "PromptItem",
    "available_datasets",
    "load_jsonl_prompts",
    "load_prompt_file",
    "load_prompts",
    "load_text_prompts",
    "select",
]
