"""The CLI as a user runs it: subprocesses, one-line errors with exit code 1, JSON output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.cli import ENV, assert_one_line_error, run, run_many


def test_help_without_loading_torch():
    p = subprocess.run([sys.executable, "-c", "import sys; from dflash.cli import app; "
                        "assert 'torch' not in sys.modules, 'torch imported by the CLI module'"],
                       capture_output=True, text=True, env=ENV)  # fmt: skip
    assert p.returncode == 0, p.stderr
    p = run("--help")
    assert p.returncode == 0 and "generate" in p.stdout and "init-draft" in p.stdout


@pytest.mark.parametrize(
    "args,fragment",
    [(["--model", "some/model"], "--draft is required"),
     (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
     (["--top-p", "0"], "--top-p must be in (0, 1]"),
     (["--block-size", "0"], "--block-size must be >= 1"),
     (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
     (["--draft", "/nonexistent/draft"], "does not exist"),
     (["--dtype", "float8"], "Unknown --dtype")],
)  # fmt: skip
def test_cheap_errors(args, fragment):
    assert_one_line_error(run("generate", "transformers", "hi", *args), fragment)


NO_TORCH = ("import sys\nfrom dflash.cli import main\ntry:\n    main()\nfinally:\n"
            "    heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "    print(f'imported: {heavy}' if heavy else 'torch not imported', file=sys.stderr)")


@pytest.mark.parametrize(
    "args,fragment",
    [(["generate", "transformers", "hi", "--model", "some/model"], "--draft is required"),
     (["generate", "transformers", "hi", "--draft", "/nonexistent/draft"], "does not exist"),
     (["generate", "transformers", "hi", "--dtype", "float8"], "Unknown --dtype"),
     (["generate", "transformers", "hi", "--device", "gpu", "--draft", "org/not-downloaded"], "Unknown --device"),
     (["init-draft", "--out", "/tmp/dflash-never", "--arch", "eagle"], "--arch")],
)  # fmt: skip
def test_argument_errors_come_before_torch_is_imported(args, fragment):
    """Errors in the arguments are reported before torch and transformers are imported (seconds
    on a small CPU): the same one-line error, and torch absent from the process."""
    p = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, env=ENV)
    lines = p.stderr.strip().splitlines()
    assert lines[-1] == "torch not imported", p.stderr
    assert_one_line_error(subprocess.CompletedProcess(p.args, p.returncode, p.stdout, "\n".join(lines[:-1])),
                          fragment)  # fmt: skip


def test_unknown_backend():
    assert_one_line_error(run("generate", "tensorrt", "hi"), "Unknown backend")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_absent():
    assert_one_line_error(run("generate", "transformers", "hi", "--device", "cuda"), "no CUDA device")


def test_corrupt_draft_config(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    assert_one_line_error(run("generate", "transformers", "hi", "--model", "x", "--draft", str(tmp_path)),
                          "not valid JSON")  # fmt: skip


@pytest.fixture(scope="module")
def pair(demo_gguf, untrained_draft):
    return ["--model", str(demo_gguf), "--draft", str(untrained_draft)]


@pytest.fixture(scope="module")
def loaded_errors(pair, tmp_path_factory, tiny_target):
    """Errors found only once the pair is loaded, each from its own CLI run (run side by side)."""
    from tests.helpers.tiny import make_draft

    other = tmp_path_factory.mktemp("other") / "draft"
    make_draft(tiny_target).save(other)
    names = ("block_size", "reasoning", "long_prompt", "other_target")
    runs = run_many(["generate", "transformers", "hi", *pair, "--block-size", "17"],
                    ["generate", "transformers", "hi", *pair, "--reasoning", "on"],
                    ["generate", "transformers", "word " * 9000, *pair],
                    ["generate", "transformers", "hi", pair[0], pair[1], "--draft", str(other)])  # fmt: skip
    return dict(zip(names, runs, strict=True))


@pytest.mark.slow
def test_block_size_above_trained(loaded_errors):
    assert_one_line_error(loaded_errors["block_size"], "exceeds the draft's trained block size 16")


def test_reasoning_without_switch(loaded_errors):
    assert_one_line_error(loaded_errors["reasoning"], "no reasoning switch")


def test_prompt_longer_than_context(loaded_errors):
    assert_one_line_error(loaded_errors["long_prompt"], "context is 8192")


def test_draft_for_another_target(loaded_errors):
    assert_one_line_error(loaded_errors["other_target"], "hidden_size")


@pytest.mark.slow
def test_generate_json_and_stream(pair):
    args = ["generate", "transformers", "Name three primary colors.", *pair, "--max-new-tokens", "12"]
    p, p2, p3 = run_many([*args, "--json"], [*args, "--block-size", "16"],  # auto, then a fixed L: same text
                         [*args, "--json", "--verbose", "--block-size", "16"])  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["new_tokens"] == len(out["token_ids"]) <= 12
    assert out["finish_reason"] == "stop" or out["new_tokens"] == 12
    assert sum(out["acceptance_lengths"]) == out["new_tokens"] - 1
    assert out["text_truncated_mid_character"] is False  # 12 tokens of English end cleanly
    assert p2.returncode == 0, p2.stderr
    assert p2.stdout.strip() == out["text"].strip()
    assert "new tokens" in p2.stderr and "tok/s" in p2.stderr and "acceptance length" in p2.stderr
    # --json --verbose: one step line per verify step on stderr, the JSON alone on stdout
    assert p3.returncode == 0, p3.stderr
    out3 = json.loads(p3.stdout)
    steps = [line for line in p3.stderr.splitlines() if line.startswith("[step ")]
    assert len(steps) == out3["verify_steps"] == len(out3["acceptance_lengths"]) >= 1
    assert steps[0].endswith(f"committed {out3['acceptance_lengths'][0]}]"), steps[0]


@pytest.mark.slow
def test_init_draft_cli(tmp_path, demo_gguf):
    p = run("init-draft", "--target", str(demo_gguf), "--out", str(tmp_path / "d"), "--layers", "3",
            "--block-size", "8")  # fmt: skip
    assert p.returncode == 0, p.stderr
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflash_config"]["block_size"] == 8 and cfg["num_hidden_layers"] == 3
    assert len(cfg["dflash_config"]["target_layer_ids"]) == 3
    assert cfg["dflash_config"]["mask_token_id"] not in (2,)  # not the stop token
    bad = run("init-draft", "--target", str(demo_gguf), "--out", str(tmp_path / "e"), "--mask-token-id", "2")
    assert_one_line_error(bad, "stop token")


@pytest.mark.parametrize(
    "args,fragment",
    [(["--seed", "-1"], "--seed must be an integer"),
     (["--temperature", "inf"], "finite number"),
     (["--temperature", "nan"], "finite number")],
)  # fmt: skip
def test_sampling_values_rejected_before_loading(args, fragment):
    assert_one_line_error(run("generate", "transformers", "hi", *args), fragment)


def test_paths_that_are_files_or_folders(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    a, b, c, d = run_many(["init-draft", "--out", str(f)], ["init-draft", "--out", str(tmp_path / "d")],
                          ["benchmark", "transformers", "--dataset", "gsm8k", "--output", str(tmp_path)],
                          (["generate", "transformers", "hi"], {"DFLASH_CACHE": str(f)}))  # fmt: skip
    assert_one_line_error(a, "is a file")
    assert_one_line_error(b, "already holds a draft")
    assert_one_line_error(c, "is a folder")
    assert_one_line_error(d, "Cannot create the cache folder")


def test_init_draft_never_overwrites_a_model_folder(tmp_path):
    """init-draft --force replaces a draft, never a model's folder (found by a user trial)."""
    model = tmp_path / "model"
    model.mkdir()
    cfg = '{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}'
    (model / "config.json").write_text(cfg)
    (model / "model.safetensors").write_bytes(b"weights")
    res = run("init-draft", "--out", str(model), "--force")
    assert_one_line_error(res, "holds a model (LlamaForCausalLM), not a DFlash draft")
    assert (model / "config.json").read_text() == cfg and (model / "model.safetensors").read_bytes() == b"weights"


@pytest.mark.parametrize("args, flag", [
    (["generate", "openai", "--block-size", "4", "hi"], "--block-size"),
    (["generate", "openai", "--draft", "d", "hi"], "--draft"),
    (["generate", "openai", "--no-cuda-graphs", "hi"], "--cuda-graphs/--no-cuda-graphs"),
    (["generate", "transformers", "--base-url", "http://x", "hi"], "--base-url"),
    (["generate", "transformers", "--api-key", "k", "hi"], "--api-key"),
    (["generate", "transformers", "--draft-bits", "4", "hi"], "--draft-bits"),
    (["generate", "mlx", "--compile", "hi"], "--compile/--no-compile"),
    (["benchmark", "openai", "--dataset", "gsm8k", "--check-parity"], "--check-parity"),
    (["benchmark", "openai", "--dataset", "gsm8k", "--block-size", "4"], "--block-size"),
    (["benchmark", "openai", "--dataset", "gsm8k", "--resume"], "--resume"),
    (["benchmark", "transformers", "--dataset", "gsm8k", "--concurrency", "4"], "--concurrency"),
    (["benchmark", "mlx", "--dataset", "gsm8k", "--baseline-url", "http://x"], "--baseline-url"),
])
def test_options_of_another_backend_are_refused(args, flag):
    """An option the chosen backend would silently ignore is a one-line InputError naming it,
    before anything loads or connects (no model here, no server)."""
    from typer.testing import CliRunner

    from dflash.cli import app
    from dflash.errors import InputError

    res = CliRunner().invoke(app, args)
    assert isinstance(res.exception, InputError), (res.output, res.exception)
    assert res.exception.message.startswith(f"{flag} does not apply to the {args[1]} backend")
    assert "\n" not in res.exception.message and flag in res.exception.hint


@pytest.mark.parametrize("name, value", [("DFLASH_ATTN", "bogus"), ("DFLASH_PDL", "2"), ("DFLASH_ROPE", "x"),
                                         ("DFLASH_LINEAR", "cublas"), ("DFLASH_ATTN_SPLIT", "100"),
                                         ("DFLASH_GRAPH_WARM", "-1"), ("DFLASH_QUEUE_AHEAD", "verify"),
                                         ("DFLASH_ATTN_BLOCK", "96"), ("DFLASH_COMPILE_MODE", "fast")])  # fmt: skip
def test_cuda_path_settings_are_checked_on_every_device(name, value, monkeypatch):
    """A bad value of a kernel setting's override is a one-line InputError naming it when the
    transformers backend loads on a CPU too (before any weight loads), not first on the GPU
    machine."""
    import dflash
    from dflash.errors import InputError

    monkeypatch.setenv(name, value)
    with pytest.raises(InputError, match=name) as err:
        dflash.load(device="cpu")  # the demo pair: the settings are resolved before its weights load
    assert "\n" not in err.value.message


def test_version_flag_prints_the_package_version():
    from typer.testing import CliRunner

    import dflash
    from dflash.cli import app

    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.startswith(f"dflash {dflash.__version__} (this project")
    assert "the PyPI package 'dflash' is the DFlash authors' reference code" in res.stdout


def test_mlx_option_errors_come_before_importing_mlx():
    """A bad mlx option is refused before mlx/mlx-lm are imported (seconds); a fresh process shows
    neither in sys.modules after the error."""
    code = ("import sys, dflash\nfrom dflash.errors import InputError\n"
            "for kw in ({'device': 'tpu'}, {'dtype': 'int8'}, {'draft_bits': 3}, {'draft_window': 0}):\n"
            "    try:\n        dflash.load(backend='mlx', **kw)\n    except InputError as e:\n        print(e.message)\n"
            "print('imported', 'mlx_lm' in sys.modules or 'mlx.core' in sys.modules)\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and lines[-1] == "imported False", (out.stdout, out.stderr[-2000:])
    assert [ln.split()[0] for ln in lines[:-1]] == ["Unknown", "Unknown", "--draft-bits", "--draft-window"]


def test_context_notice_only_when_the_context_cuts_the_budget():
    """`dflash generate` says on stderr when --max-new-tokens is more than the context leaves
    (seen as a user: an 8,181-token prompt, --max-new-tokens 100, 11 new tokens, "length")."""
    from dflash.commands import context_notice

    line = context_notice(100, 8181, 8192)
    assert line is not None and "at most 11 new tokens" in line and "--max-new-tokens 100" in line
    assert context_notice(11, 8181, 8192) is None  # exactly what is left: nothing to say
    assert context_notice(100, 20, 8192) is None
    assert context_notice(100, 8192, 8192) is None  # a full context is an error elsewhere
