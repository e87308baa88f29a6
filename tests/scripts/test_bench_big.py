"""scripts/bench_big.py on a miniature model (CPU): the scripted draft gives exact step counts."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.helpers.paths import REPO
from tests.helpers.stats import one_torch_thread

SCRIPT = REPO / "scripts" / "bench_big.py"


@pytest.mark.parametrize("extra", [[], ["--no-device-loop"], ["--profile"], ["--arch", "llama"]])
def test_bench_big_tiny_exact_steps(tmp_path, extra):
    spec = importlib.util.spec_from_file_location("bench_big", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with one_torch_thread():
        report = mod.main(["--tiny", "--out", str(tmp_path), "--steps", "2", "--prompt-len", "16",
                           "--blocks", "1,4,16", *extra])  # fmt: skip
    assert json.loads((tmp_path / "bench_big.json").read_text()) == report
    got = {(r["block_size"], r["k"]): r for r in report["results"]}
    assert set(got) == {(1, 0), (4, 0), (4, 3), (16, 0), (16, 15)}
    for (_block, k), r in got.items():
        assert r["steps"] == 2 and r["tau"] == k + 1, r  # exactly k of L-1 proposals right
        assert r["floor_ms"] > 0 and r["ms_per_step"] > 0
        assert r["diverged_at"] is None  # every run commits the block-1 truth
        assert ("busy_ms_per_step" in r) == ("--profile" in extra)
    assert report["device_loop"] == ("--no-device-loop" not in extra)
    assert report["arch"] == ("llama" if "llama" in extra else "qwen3")  # a Llama target: no q/k norms


def test_bench_big_arch_builds_that_model():
    """--arch llama builds a Llama target (no q/k norms), the default a Qwen3 one, same dims."""
    spec = importlib.util.spec_from_file_location("bench_big", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for arch, norms in (("llama", False), ("qwen3", True)):
        be = mod.build(True, torch.device("cpu"), torch.float32, False, (1,), "qwen3-8b", None, None, arch)
        attn = be.target.model.layers[0].self_attn
        assert hasattr(attn, "q_norm") == norms and be.target.config.hidden_size == mod.TINY["hidden_size"]
