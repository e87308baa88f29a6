"""Install shape: the openai client path (``dflash generate openai``, ``dflash benchmark openai``)
runs with torch, transformers, mlx, fastapi and uvicorn made unimportable, as after a plain
``pip install dflash``. Each command runs in a subprocess whose import system refuses those
packages and logs every attempt; the log must stay empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.openai_replay import ReplayServer, json_reply, sse_reply
from tests.helpers.paths import REPO

BLOCKER = """
import os, sys

BLOCKED = {"torch", "transformers", "mlx", "mlx_lm", "fastapi", "uvicorn", "accelerate", "starlette"}


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            with open(os.environ["DFLASH_BLOCK_LOG"], "a") as f:
                f.write(name + "\\n")
            raise ImportError(f"{name} is blocked in this test")
        return None


sys.meta_path.insert(0, _Blocker())
"""


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]),
           "DFLASH_BLOCK_LOG": str(tmp_path / "blocked.log"), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    env.pop("OPENAI_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "dflash", *args], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_blocker_works(tmp_path):
    r = _run(["generate", "transformers", "hi"], tmp_path)
    assert r.returncode == 1 and "torch" in (tmp_path / "blocked.log").read_text()


def test_client_commands_import_no_torch_transformers_mlx_or_server_stack(tmp_path):
    models = json_reply({"object": "list", "data": [{"id": "m"}]})
    routes = {"GET /v1/models": [models],
              "POST /v1/chat/completions": lambda body: sse_reply("vllm_stream.txt", 7)}  # fmt: skip
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with ReplayServer(routes) as srv:
        gen = _run(
            ["generate", "openai", "--base-url", srv.url, "--max-new-tokens", "8", "hi"], tmp_path
        )
        bench = _run(["benchmark", "openai", "--base-url", srv.url, "--dataset", str(prompts),
                      "--num-prompts", "2", "--concurrency", "2", "--max-new-tokens", "8"], tmp_path)  # fmt: skip
        helps = [_run([*cmd, "--help"], tmp_path) for cmd in (["generate"], ["benchmark"])]
    assert gen.returncode == 0, gen.stderr
    assert "[reasoning]" in gen.stdout and "[answer]" in gen.stdout and "你好" in gen.stdout
    assert "acceptance: not reported by server" in gen.stderr
    assert bench.returncode == 0, bench.stderr
    summary = json.loads(bench.stdout.strip().splitlines()[-1])
    assert next(iter(summary["datasets"].values()))["dflash"]["ok"] == 2
    assert all(h.returncode == 0 for h in helps)
    log = tmp_path / "blocked.log"
    assert not log.exists() or log.read_text() == "", log.read_text()
