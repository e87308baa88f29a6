"""The benchmark harness behind ``dflash benchmark``, shared by every backend.

``metrics`` computes summaries from per-response records, ``harness`` runs a pipeline over
datasets and writes the records, ``report`` renders them, ``command`` is the CLI entry point.
"""

from dflash.bench.harness import BenchConfig, ResultsLog, read_records, run_benchmark
from dflash.bench.metrics import ResponseRecord, RunStats, summarize

__all__ = [
    "BenchConfig",
    "ResponseRecord",
    "ResultsLog",
    "RunStats",
    "read_records",
    "run_benchmark",
    "summarize",
]
