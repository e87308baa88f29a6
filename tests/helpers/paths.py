"""Where the test data lives. No test reads anything outside the repository."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = REPO / "tests" / "datasets"  # the --data-dir layout, a few rows each (see its README)
FIXTURES_DIR = REPO / "tests" / "fixtures"  # published draft configs, recorded server replies


def fixture_json(name: str) -> dict:
    """``tests/fixtures/<name>`` read as JSON."""
    return json.loads((FIXTURES_DIR / name).read_text())
