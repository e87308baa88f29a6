"""scripts/gpu_check_dflash2.py on tiny shapes (CPU, no graphs): every check runs and passes."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers.paths import REPO
from tests.helpers.stats import one_torch_thread

SCRIPT = REPO / "scripts" / "gpu_check_dflash2.py"


@pytest.mark.slow
def test_gpu_check_dflash2_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check_dflash2", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with one_torch_thread():
        assert mod.main(["--tiny", "--out", str(tmp_path), "--new-tokens", "24"]) == 0
    report = json.loads((tmp_path / "gpu_check_dflash2.json").read_text())
    assert report["ok"] and report["exact"]["sampled"]["equal_plain"]
    assert all(
        r["ids_equal_hf_and_plain"] and r["accepted_equal_plain"] for r in report["exact"]["greedy"]
    )
    assert set(report["perf"]["speed"]) == {
        "dflash2_b16",
        "dflash_b16",
        "dflash_b1",
        "dflash2_b16_sampled",
    }
    assert report["perf"]["cost"]["selector_greedy_us"] > 0
