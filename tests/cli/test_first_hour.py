"""Rough edges a new user hit in the first hour (issue 9), one test per kind of fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from typer.testing import CliRunner

from dflash.errors import CheckpointError, InputError
from tests.helpers.cli import ENV
from tests.helpers.cli import assert_one_line_error as one_error_line
from tests.helpers.cli import run as dflash_cli
from tests.helpers.paths import DATA_DIR

# -- paths and prompts -------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["./no/such/model", "/no/such/model", "~/no-such-model",
                                   "a/b/c", "missing.gguf"])  # fmt: skip
def test_a_missing_local_model_path_is_no_such_file(value):
    from dflash.models.target_torch import check_model_path

    with pytest.raises(CheckpointError, match="no such file or folder"):
        check_model_path(value)


def test_hub_ids_and_existing_paths_pass_the_path_check(tmp_path):
    from dflash.models.target_torch import check_model_path

    for value in (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "gpt2",
        "Qwen/Qwen2.5-0.5B",
        str(tmp_path),
    ):
        check_model_path(value)


def test_generate_with_a_missing_model_folder_says_so(tmp_path):
    line = one_error_line(dflash_cli("generate", "transformers", "hi", "--model",
                                     str(tmp_path / "nope"), "--draft", str(tmp_path)))  # fmt: skip
    assert line == f"error: --model {tmp_path / 'nope'}: no such file or folder."


@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_an_empty_prompt_is_refused_before_loading(prompt):
    assert (
        one_error_line(dflash_cli("generate", "transformers", prompt))
        == "error: The prompt is empty."
    )


@pytest.mark.parametrize("backend, extra", [("transformers", []), ("openai", ["--base-url", "http://127.0.0.1:9"])])
@pytest.mark.parametrize("where", ["PROMPT", "--system"])
def test_text_that_is_not_utf8_is_refused_before_loading(backend, extra, where):
    """Bytes that are not UTF-8 on the command line (Python keeps them as lone surrogates)
    made the tokenizer or httpx raise a traceback after the model had loaded."""
    bad = b"Hi \xff there"
    text = [bad] if where == "PROMPT" else ["--system", bad, "hi"]
    p = subprocess.run([sys.executable, "-m", "dflash", "generate", backend, *extra, *text],
                       capture_output=True, text=True, env=ENV, timeout=300)  # fmt: skip
    assert one_error_line(p) == f"error: {where} is not valid UTF-8 (byte 0xff at character 3)."


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [["generate", "transformers"], ["generate", "mlx"], ["init-draft", "--out", "unused"]])
def test_a_draft_passed_as_the_target_is_named_a_draft(cmd, tmp_path):
    """--model <a draft folder> said its layer ids reach past the target's 5 layers (and
    init-draft wrote a draft of the draft)."""
    from dflash.models.target_torch import DEMO_DRAFT_DIR

    args = [*cmd, "--model" if cmd[0] == "generate" else "--target", str(DEMO_DRAFT_DIR)]
    if cmd[0] == "generate":
        args += ["--draft", str(DEMO_DRAFT_DIR), "hi"]
    else:
        args[2] = str(tmp_path / "out")
    line = one_error_line(dflash_cli(*args))
    flag = "--model" if cmd[0] == "generate" else "--target"  # the option the command has
    assert line == f"error: {flag} {DEMO_DRAFT_DIR} is a DFlash draft, not a target."
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cmd", [["init-draft", "--out", "OUT"], ["train", "--data", "DATA", "--out", "OUT"],
                                 ["data", "regenerate", "--prompts", "gsm8k:train", "--out", "OUT"]])  # fmt: skip
def test_a_missing_target_is_named_by_the_commands_own_option(cmd, tmp_path):
    """init-draft, train and data regenerate take --target; their errors said --model (user trial)."""
    (tmp_path / "data").mkdir()
    args = [str(tmp_path / "out") if a == "OUT" else str(tmp_path / "data") if a == "DATA" else a for a in cmd]
    args += ["--target", str(tmp_path / "nope")] + (["--data-dir", str(DATA_DIR)] if cmd[0] == "data" else [])
    line = one_error_line(dflash_cli(*args))
    assert line == f"error: --target {tmp_path / 'nope'}: no such file or folder."


@pytest.mark.slow
@pytest.mark.parametrize("device", ["gpu", "cuda", "metal"])
def test_mlx_without_a_gpu_names_the_device_asked_for(device):
    """`--device cuda` was reported as '--device gpu was asked for'."""
    mx = pytest.importorskip("mlx.core")
    if mx.metal.is_available() or mx.cuda.is_available():
        pytest.skip("this mlx build has a GPU")
    line = one_error_line(dflash_cli("generate", "mlx", "--device", device, "hi"))
    assert line == (f"error: --device {device} needs a GPU, and this mlx build has none: mlx runs on its default "
                    "device (the Metal GPU on Apple Silicon, the CPU on Linux).")  # fmt: skip


def test_benchmark_openai_refuses_zero_prompts():
    """--num-prompts 0 was read as 'not given' and ran the whole dataset."""
    line = one_error_line(dflash_cli("benchmark", "openai", "--base-url", "http://127.0.0.1:9",
                                     "--dataset", "gsm8k", "--num-prompts", "0"))  # fmt: skip
    assert line == "error: --num-prompts must be >= 1, got 0."


def test_the_api_refuses_an_empty_user_message(demo_pipe):
    with pytest.raises(InputError, match="The prompt is empty"):
        demo_pipe.chat_prompt([{"role": "user", "content": " "}])


def test_a_prompt_file_with_an_empty_prompt_is_refused(tmp_path):
    from dflash.data import load_prompts
    from dflash.errors import DatasetError

    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": ""}\n')
    with pytest.raises(DatasetError, match="mine.jsonl:2 has an empty prompt"):
        load_prompts(str(path))


# -- the generate summary and text ---------------------------------------------------------------


def test_summary_line_counts_and_never_prints_nan():
    from dflash.commands import summary_line

    assert summary_line(1, [], 0.0, 0.0504) == (
        "[1 new token | decode n/a | mean acceptance length τ n/a | 0 verify steps | TTFT 50 ms]"
    )
    assert summary_line(3, [2], 0.5, 0.01) == (
        "[3 new tokens | decode 4.0 tok/s | mean acceptance length τ 2.00 | 1 verify step | TTFT 10 ms]"
    )


def test_verbose_notes_start_a_line_only_where_they_share_the_text_screen(tmp_path):
    """--verbose step notes go to stderr; where stderr and stdout are one file or terminal
    (2>&1, a console) a note that follows text mid-line starts on a new line."""
    import io

    from dflash.commands import same_stream

    with open(tmp_path / "a", "w") as a, open(tmp_path / "a", "a") as a2, open(tmp_path / "b", "w") as b:
        assert same_stream(a, a2) and not same_stream(a, b)
    assert not same_stream(io.StringIO(), io.StringIO())


@pytest.mark.slow
def test_generate_one_token_summary(demo_gguf, untrained_draft):
    p = dflash_cli("generate", "transformers", "Hi", "--model", str(demo_gguf), "--draft",
                   str(untrained_draft), "--max-new-tokens", "1")  # fmt: skip
    assert p.returncode == 0, p.stderr
    summary = p.stderr.strip().splitlines()[-1]
    assert summary.startswith(
        "[1 new token | decode n/a | mean acceptance length τ n/a | 0 verify steps"
    )
    assert "nan" not in summary


class CharTokenizer:
    """Token ids are UTF-8 bytes; decoding an unfinished character gives U+FFFD (as HF does)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_stream_drops_a_character_the_budget_cut():
    from dflash.api import TextStream

    ids = list("ok 🙂".encode())  # the emoji is 4 bytes
    stream = TextStream(CharTokenizer())
    printed = [stream.feed([i], final=k == len(ids) - 2) for k, i in enumerate(ids[:-1])]
    assert "".join(printed) == "ok " and stream.truncated_mid_character
    whole = TextStream(CharTokenizer())
    assert "".join(whole.feed([i], final=k == len(ids) - 1) for k, i in enumerate(ids)) == "ok 🙂"
    assert not whole.truncated_mid_character


def test_generate_result_keeps_a_cut_character_out_of_text(tiny_target):
    """A budget that ends inside a character: text holds whole characters only, the flag says it
    was cut, and token_ids still hold every token."""
    from dflash.api import Pipeline
    from dflash.backends.plain import TransformersBackend
    from tests.helpers.tiny import make_draft

    backend = TransformersBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"))
    pipe = Pipeline(backend, CharTokenizer(), stop_ids=[])
    prompt = [5, 17, 42]
    full = pipe.generate(prompt, max_new_tokens=40).token_ids
    decode = CharTokenizer().decode
    cut = [k for k in range(2, 41) if decode(full[:k]).endswith("\ufffd")]
    whole = [k for k in range(2, 41) if not decode(full[:k]).endswith("\ufffd")]
    assert cut and whole, "the random target should end both inside and between characters"
    r = pipe.generate(prompt, max_new_tokens=cut[0])
    assert r.token_ids == full[: cut[0]] and r.truncated_mid_character
    assert r.text == decode(full[: cut[0]]).rstrip("\ufffd") and not r.text.endswith("\ufffd")
    r = pipe.generate(prompt, max_new_tokens=whole[0])
    assert r.text == decode(full[: whole[0]]) and not r.truncated_mid_character


# -- files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_draft_weights_follow_the_umask_like_config_json(tmp_path, tiny_target, umask):
    from tests.helpers.tiny import make_draft

    old = os.umask(umask)
    try:
        make_draft(tiny_target).save(tmp_path / "one")
        make_draft(tiny_target).save(tmp_path / "shards", max_shard_bytes=50_000)
    finally:
        os.umask(old)
    files = list((tmp_path / "one").iterdir()) + list((tmp_path / "shards").iterdir())
    assert len(files) > 4 and any(f.suffix == ".safetensors" for f in files)
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {
        f.name: oct(0o666 & ~umask) for f in files
    }


# -- versions ---------------------------------------------------------------------------------


def test_the_target_forward_uses_no_deprecated_keyword(tiny_backend):
    """transformers >= 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns and goes
    away in 5.40); the oldest supported release only knows the old name. Both must run quietly."""
    from dflash.loop import speculative_generate

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        rounds = list(
            speculative_generate(tiny_backend, [5, 17, 42], block_size=4, max_new_tokens=9)
        )
    assert sum(len(r.tokens) for r in rounds) == 9


# -- benchmark --------------------------------------------------------------------------------


def test_benchmark_help_groups_the_openai_only_options():
    from dflash.cli import app

    out = CliRunner().invoke(
        app, ["benchmark", "--help"], env={"COLUMNS": "160"}, terminal_width=160
    )
    assert out.exit_code == 0, out.output
    text = out.output
    panel = text.index("openai backend only")
    for opt in ("--base-url", "--num-prompts", "--concurrency", "--timeout-s"):
        assert text.index(opt) > panel, opt
    for opt in ("--dataset", "--max-new-tokens", "--check-parity", "--output"):
        assert text.index(opt) < panel, opt


@pytest.fixture
def bench(monkeypatch):
    """Run ``benchmark`` with a fake pipeline; returns (invoke, number of pipeline loads)."""
    from dflash.bench import command
    from tests.helpers.fakes import FakePipeline, make_app

    monkeypatch.setattr(command, "_load_pipeline", command._load_pipeline)  # restored afterwards
    loads: list[int] = []

    def factory():
        loads.append(1)
        return FakePipeline()

    def invoke(*args):
        return CliRunner().invoke(make_app(factory), ["transformers", "--data-dir", str(DATA_DIR),
                                                      "--dataset", "humaneval", *args])  # fmt: skip

    return invoke, loads


def test_benchmark_refuses_an_unwritable_output_before_loading(bench, tmp_path):
    invoke, loads = bench
    link = tmp_path / "r.jsonl"
    link.symlink_to(tmp_path / "gone" / "r.jsonl")  # a dangling link: no file can be made there
    out = invoke("--output", str(link))
    assert isinstance(out.exception, InputError), out.output
    assert "cannot be written" in out.exception.message and not loads


def test_benchmark_checks_resume_settings_before_loading(bench, tmp_path):
    invoke, loads = bench
    out_file = tmp_path / "r.jsonl"
    assert invoke("--max-samples", "1", "--output", str(out_file)).exit_code == 0
    loads.clear()
    changed = invoke("--max-samples", "2", "--output", str(out_file), "--resume", "--top-k", "5")
    assert isinstance(changed.exception, InputError), changed.output
    assert "top_k: 0 then 5" in changed.exception.message and not loads


def test_resumed_parity_says_how_many_responses_were_not_checked(bench, tmp_path):
    invoke, _ = bench
    out_file = tmp_path / "r.jsonl"
    assert invoke("--max-samples", "1", "--output", str(out_file)).exit_code == 0
    out = invoke("--max-samples", "3", "--output", str(out_file), "--resume", "--check-parity")
    assert out.exit_code == 0, out.output
    assert "2/2 identical, 1 of 3 responses not checked" in out.stdout
    summary = json.loads(out.stdout.strip().splitlines()[-1])["datasets"]["humaneval"]
    assert summary["responses"] == 3 and summary["parity"]["checked"] == 2


@pytest.mark.parametrize("backend, words", [("openai", "the openai backend is a client of a server"),
                                            ("vllm", "Unknown backend 'vllm'; dflash.load runs transformers or mlx (openai is a client")])  # fmt: skip
def test_the_python_api_names_the_backends_it_loads(backend, words):
    """dflash.load(backend="vllm") listed openai, and backend="openai" then said it was not in
    this version although `dflash generate openai` works (user trial)."""
    import dflash
    from dflash.errors import BackendError

    with pytest.raises(BackendError) as err:
        dflash.load(backend=backend)
    assert words in str(err.value)


def test_the_demo_gguf_as_model_gets_the_shipped_draft(demo_gguf, tmp_path):
    """`--model <the demo .gguf>` without --draft said --draft is required, although the shipped
    draft was trained for exactly that file (user trial); another .gguf still needs --draft."""
    from dflash.models.target_torch import DEMO_DRAFT_DIR, resolve_draft

    assert resolve_draft(None, str(demo_gguf)) == DEMO_DRAFT_DIR
    other = tmp_path / "other.gguf"
    other.write_bytes(demo_gguf.read_bytes()[:64])
    with pytest.raises(CheckpointError, match="--draft is required"):
        resolve_draft(None, str(other))
