"""scripts/gpu_check_batched_spec.py on the CPU (tiny shapes): its exactness checks pass and the
speed section reports every run with the fields the GPU report reads."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers.paths import REPO
from tests.helpers.stats import one_torch_thread

SCRIPT = REPO / "scripts" / "gpu_check_batched_spec.py"


@pytest.mark.slow
def test_gpu_check_batched_spec_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check_batched_spec", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with one_torch_thread():
        rc = mod.main(
            [
                "--device",
                "cpu",
                "--shapes",
                "tiny",
                "--levels",
                "2",
                "--new",
                "6",
                "--out",
                str(tmp_path),
            ]
        )
    out = json.loads((tmp_path / "gpu_check_batched_spec.json").read_text())
    assert rc == 0, out
    assert all(
        v
        for k, v in out["exact"].items()
        if k.endswith("equals_alone") or k.endswith("equals_plain")
    )
    level = out["speed"]["tiny"]["2"]
    for run in ("plain", "auto", "fixed16"):
        assert level[run]["tokens"] == 4 * 6 and level[run]["ttft_ms"] and level[run]["itl_ms"]
        assert run == "plain" or level[run]["ids_equal_plain"] == 1.0  # forced: the truth
    assert level["fixed16"]["tokens_per_drafted_row_step"] > 1  # scripted acceptance took effect
    assert level["plain"]["catch_ups"] == 0  # plain runs never write the draft's context
    assert (
        level["generator"]["tokens"] == 4 * 6
        and level["generator"]["engine_plain_vs_generator"] > 0
    )
    assert set(level["costs_ms"]) == {"1", "2"}  # every rows bucket up to c measured
