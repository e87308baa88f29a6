"""The benchmark's summary table (dflash.bench.report)."""

from __future__ import annotations

import pytest
from rich.console import Console

from dflash.bench.metrics import summarize
from dflash.bench.report import summary_table


@pytest.mark.parametrize("requested, shown", [("auto", "auto (widest 9)"), (9, "9"), (None, "9")])
def test_block_size_row_says_auto_when_auto_was_asked(requested, shown):
    """Under --block-size auto the row showed the widest block used (9) as if 9 were fixed."""
    console = Console(width=120, record=True)
    console.print(summary_table("gsm8k", {**summarize([]), "block_size": 9}, requested=requested))
    row = next(line for line in console.export_text().splitlines() if "block size" in line)
    assert row.split("│")[2].strip() == shown
