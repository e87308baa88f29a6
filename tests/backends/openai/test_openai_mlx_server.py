"""The client against a real third-party OpenAI-compatible server: ``mlx_lm.server`` (runs on a
Linux CPU through ``mlx[cpu]``) serving a tiny random Qwen3 built here with a word-level
tokenizer. It reports no speculative statistics, which the client must say plainly."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(folder: Path) -> Path:
    """A 2-layer random Qwen3 (hidden 64) with a 300-word WordLevel tokenizer, mlx-lm format."""
    import mlx.core as mx
    from mlx_lm.models import qwen3
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    special = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = special + [f"w{i}" for i in range(280)] + ["hello", "world", "what", "is", "two"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(special)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "unk_token": "<unk>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
    }))  # fmt: skip
    cfg = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": len(words),
           "max_position_embeddings": 512, "tie_word_embeddings": True, "rope_theta": 10000.0,
           "eos_token_id": vocab["<|im_end|>"]}  # fmt: skip
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    save_model(folder, model)
    save_config(cfg, folder / "config.json")
    return folder


@pytest.fixture(scope="module")
def mlx_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx")
    model = build_tiny_model(root / "tiny-qwen3")
    (root / "hfcache").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("mlx_lm.server", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "mlx_lm.server"]
    cmd += ["--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "HF_HUB_CACHE": str(root / "hfcache"), "HF_HUB_OFFLINE": "1"}
    log = root / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "mlx_lm.server did not start:\n" + log.read_text()
            try:
                if httpx.get(url + "/v1/models", timeout=5).json().get("data"):
                    break
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def test_generate_against_mlx_lm_server(mlx_server):
    from dflash.cli import app

    args = ["generate", "openai", "--base-url", mlx_server, "--max-new-tokens", "8"]
    streamed = CliRunner().invoke(app, [*args, "hello world"])
    assert streamed.exit_code == 0, streamed.output
    assert "acceptance: not reported by server" in streamed.stderr
    whole = CliRunner().invoke(app, [*args, "--json", "hello world"])
    assert whole.exit_code == 0, whole.output
    got = json.loads(whole.stdout)
    assert got["text"] and streamed.stdout == got["text"] + "\n"  # greedy: same both ways
    assert got["mean_acceptance_length"] is None and got["meta_info"] is None
    assert 1 <= got["new_tokens"] <= 8


def test_benchmark_against_mlx_lm_server(mlx_server, tmp_path):
    from dflash.cli import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ("hello", "what is two", "world"))
    )
    out = tmp_path / "r.jsonl"
    args = ["benchmark", "openai", "--base-url", mlx_server + "/v1", "--dataset", str(prompts),
            "--concurrency", "2", "--max-new-tokens", "8", "--output", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    fast = next(iter(json.loads(res.stdout.strip().splitlines()[-1])["datasets"].values()))[
        "dflash"
    ]
    assert fast["ok"] == 3 and fast["errors"] == 0 and fast["output_tokens"] > 0
    assert fast["acceptance_source"] is None and fast["metrics_counters"] is None
    assert fast["ttft_s"]["p50"] > 0 and fast["e2e_s"]["p99"] >= fast["e2e_s"]["p50"]
    assert "acceptance statistics: not reported by server" in res.output
    assert len(out.read_text().splitlines()) == 3
