"""Messages a user trial found wrong or unclear: each case runs the real command line (a
subprocess, or typer's CliRunner over a fake pipeline) and asserts the exact words and exit code."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers.cli import ENV, error_lines
from tests.helpers.cli import run as dflash_cli
from tests.helpers.paths import DATA_DIR

# -- 1. one list of backends -------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "benchmark"])
def test_an_unknown_backend_lists_every_backend_openai_included(command):
    """`dflash generate tensorflow` listed 'transformers, mlx' and left out openai (user trial)."""
    args = ["hi"] if command == "generate" else ["--dataset", "gsm8k", "--base-url", "http://x"]
    assert error_lines(dflash_cli(command, "tensorflow", *args)) == [
        "error: Unknown backend 'tensorflow'; choose one of transformers, mlx or openai.",
        f"hint: the backend is the first argument: dflash {command} transformers ...",
    ]


def test_every_backend_list_comes_from_one_place():
    from dflash import api
    from dflash.backend_names import BACKENDS, LOCAL_BACKENDS, backend_help
    from dflash.bench import command

    assert BACKENDS == ("transformers", "mlx", "openai") and api.BACKENDS == LOCAL_BACKENDS
    assert all(f"{name} (" in backend_help() for name in BACKENDS)
    assert command.BACKENDS is BACKENDS


# -- 2. a --base-url that ends in an endpoint path ---------------------------------------------


@pytest.mark.parametrize("args, flag, given, base", [
    (["generate", "openai", "hi"], "--base-url", "/v1/chat/completions", "/v1"),
    (["generate", "openai", "--model", "m", "hi"], "--base-url", "/v1/completions/", "/v1"),
    (["benchmark", "openai", "--dataset", "gsm8k"], "--base-url", "/v1/models", "/v1"),
    (["benchmark", "openai", "--dataset", "gsm8k", "--base-url", "URL"], "--baseline-url", "/chat/completions", ""),
])  # fmt: skip
def test_a_base_url_ending_in_an_endpoint_is_refused_naming_the_base_url(args, flag, given, base):
    """`--base-url http://host:port/v1/chat/completions` was sent to .../chat/completions/v1/...
    and answered 404 with no hint (user trial); now no request is sent and the error names the
    base URL to pass, as openai-python's base_url expects it."""
    from tests.helpers.openai_replay import ReplayServer

    with ReplayServer({}) as srv:
        args = [srv.url + "/v1" if a == "URL" else a for a in args]
        lines = error_lines(dflash_cli(*args, flag, srv.url + given, "--data-dir", str(DATA_DIR))
                            if args[0] == "benchmark" else dflash_cli(*args, flag, srv.url + given))  # fmt: skip
        assert not srv.requests
    endpoint = given.rstrip("/").rsplit("/v1", 1)[-1]
    assert lines == [
        f"error: {flag} {srv.url}{given.rstrip('/')} ends in the endpoint path {endpoint}, which dflash adds itself.",
        f"hint: pass the server's base URL: {flag} {srv.url}{base}",
    ]


def test_the_base_url_check_keeps_paths_that_are_no_endpoint():
    from dflash.backends.openai import api_root

    for url, root in (("http://h:1/proxy", "http://h:1/proxy/v1"), ("http://h:1/models-api/v1/", "http://h:1/models-api/v1"),
                      ("http://h:1/v1", "http://h:1/v1"), ("http://completions:8000", "http://completions:8000/v1")):  # fmt: skip
        assert api_root(url) == root


def test_a_404_names_the_base_url_as_the_thing_to_check():
    """A server that answers 404 (a wrong path under --base-url, or a model it does not serve)
    gets a hint naming --base-url's form instead of none."""
    from tests.helpers.openai_replay import ReplayServer, json_reply

    gone = json_reply({"error": {"message": "The model `m` does not exist."}}, status=404)
    with ReplayServer({"POST /v1/chat/completions": [gone]}) as srv:
        wrong_path = error_lines(
            dflash_cli("generate", "openai", "--base-url", srv.url + "/api", "hi")
        )
        wrong_model = error_lines(
            dflash_cli("generate", "openai", "--base-url", srv.url, "--model", "m", "hi")
        )
    assert wrong_path == [
        f"error: {srv.url}/api/v1/models answered HTTP 404: no route GET /api/v1/models",
        "hint: check --base-url: the server's base URL, e.g. http://127.0.0.1:30000/v1",
    ]
    assert wrong_model == [
        f"error: {srv.url}/v1/chat/completions failed: HTTP 404: The model `m` does not exist.",
        "hint: check --base-url (the server's base URL, e.g. http://127.0.0.1:30000/v1) and --model",
    ]


# -- 3a. an output path under a file -----------------------------------------------------------


@pytest.mark.parametrize("backend, extra, flag, name", [
    ("transformers", [], "--output", "x.jsonl"),
    ("transformers", ["--block-size", "1,4"], "--output", "x.jsonl"),  # a sweep: the name given, not x.bs1.jsonl
    ("openai", ["--base-url", "http://127.0.0.1:9"], "--output", "x.jsonl"),
    ("transformers", [], "--plot", "x.png"),
])  # fmt: skip
def test_an_output_path_under_a_file_names_the_file_in_the_way(
    tmp_path, backend, extra, flag, name
):
    """`--output afile/x.jsonl` with afile a file printed a bare 'File exists' (user trial)."""
    (tmp_path / "afile").write_text("not a folder\n")
    p = dflash_cli("benchmark", backend, "--dataset", "gsm8k", "--data-dir", str(DATA_DIR), *extra,
                   flag, f"afile/sub/{name}", cwd=tmp_path)  # fmt: skip
    assert error_lines(p) == [
        f"error: {flag} afile/sub/{name} cannot be written: afile is a file, not a folder.",
        f"hint: write it elsewhere (e.g. {flag} {name}) or move the file afile away",
    ]


def test_any_other_folder_under_a_file_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """The CLI's last resort for an OSError: a folder made under a file says which file."""
    from dflash import cli

    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(cli, "app", lambda **kw: os.makedirs(tmp_path / "afile" / "q"))
    with pytest.raises(SystemExit) as end:
        cli.main()
    assert end.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path / 'afile' / 'q'} cannot be made: {tmp_path / 'afile'} is a file, not a folder.",
        f"hint: choose another path, or move the file {tmp_path / 'afile'} away",
    ]


# -- 3b. --block-size 0 ------------------------------------------------------------------------

RANGE = "use auto (picked per step) or 1 (no drafting) up to the draft's trained block size"


@pytest.mark.parametrize("args", [["generate", "transformers", "hi", "--block-size", "0"],
                                  ["generate", "mlx", "hi", "--block-size", "0"],
                                  ["benchmark", "transformers", "--dataset", "gsm8k", "--block-size", "0"],
                                  ["benchmark", "transformers", "--dataset", "gsm8k", "--block-size", "auto,4,0"]])  # fmt: skip
def test_block_size_zero_has_a_hint_with_the_valid_range(args):
    """`dflash benchmark ... --block-size 0` said 'must be >= 1' and nothing more (user trial);
    the hint names the demo draft's trained block size (its config.json, read before loading)."""
    assert error_lines(dflash_cli(*args)) == [
        "error: --block-size must be >= 1, got 0.",
        f"hint: {RANGE} (16)",
    ]


@pytest.mark.parametrize("command", [["generate", "transformers", "hi"],
                                     ["benchmark", "transformers", "--dataset", "gsm8k"]])  # fmt: skip
def test_the_block_size_hint_names_the_given_drafts_trained_size(tmp_path, command):
    """With --draft FOLDER the hint names that draft's trained block size (8 here), not the demo
    draft's; with a draft that is not on this machine it names no number."""
    import json

    from tests.helpers.paths import FIXTURES_DIR

    cfg = json.loads((FIXTURES_DIR / "qwen3-8b-dflash-config.json").read_text())
    cfg["block_size"] = 8
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    res = dflash_cli(
        *command, "--model", "some/target", "--draft", str(tmp_path / "d"), "--block-size", "0"
    )
    assert error_lines(res) == ["error: --block-size must be >= 1, got 0.", f"hint: {RANGE} (8)"]
    res = dflash_cli(
        *command, "--model", "some/target", "--draft", "no-such/draft", "--block-size", "0"
    )
    assert error_lines(res) == ["error: --block-size must be >= 1, got 0.", f"hint: {RANGE}"]


# -- 3c. no blank line before an error ---------------------------------------------------------


@pytest.mark.parametrize("args, message, hint", [
    (["--block-size", "100"], "--block-size 100 exceeds the draft's trained block size 16.", "use --block-size 16 or less"),
    (["--reasoning", "maybe"], "Unknown --reasoning level 'maybe' for this model's chat template.",
     "this template supports only --reasoning on/off, if any"),
])  # fmt: skip
def test_a_benchmark_error_before_the_first_dataset_has_no_blank_line_before_it(args, message, hint, monkeypatch,
                                                                                capsys):  # fmt: skip
    """`dflash benchmark ... --block-size 100 2>&1 | cat` printed an empty line, then the error:
    rich's progress display, stopped before any bar, rendered nothing plus a newline (user trial).
    The pipeline raises the error the real one raises in the warm-up."""
    from dflash import cli
    from dflash.bench import command
    from dflash.errors import InputError

    class Refusing:
        block_size = 16

        def chat_prompt(self, messages, **kw):
            raise InputError(message, hint=hint)

    monkeypatch.setattr(command, "_load_pipeline", lambda *a, **kw: Refusing())
    monkeypatch.setattr(sys, "argv", ["dflash", "benchmark", "transformers", "--dataset", "gsm8k",
                                      "--data-dir", str(DATA_DIR), *args])  # fmt: skip
    with pytest.raises(SystemExit) as end:
        cli.main()
    assert end.value.code == 1
    assert capsys.readouterr().err == f"error: {message}\nhint: {hint}\n"


# -- 3d. Ctrl-C during a block-size sweep ------------------------------------------------------


@pytest.mark.parametrize("stop_at", [1, 4])
def test_ctrl_c_in_a_sweep_names_the_real_files(tmp_path, monkeypatch, stop_at):
    """Ctrl-C during `--block-size 1,4 --output r.jsonl` printed 'r.bs<L>.jsonl', a template,
    instead of the files (user trial); it names the files of the values run so far."""
    from typer.testing import CliRunner

    from dflash.bench import command
    from dflash.bench.harness import read_records
    from tests.helpers.fakes import FakePipeline, make_app

    monkeypatch.setattr(command, "_load_pipeline", command._load_pipeline)  # restored afterwards
    out = tmp_path / "r.jsonl"
    running = tmp_path / f"r.bs{stop_at}.jsonl"

    class Interrupted(FakePipeline):
        def generate(self, prompt_ids, **kw):
            if (
                running.exists() and len(running.read_text().splitlines()) == 1
            ):  # one response written
                raise KeyboardInterrupt
            return super().generate(prompt_ids, **kw)

    res = CliRunner().invoke(make_app(Interrupted), [
        "transformers", "--dataset", "humaneval", "--max-samples", "2", "--data-dir", str(DATA_DIR),
        "--block-size", "1,4", "--output", str(out)])  # fmt: skip
    assert res.exit_code != 0
    files = " and ".join(str(tmp_path / f"r.bs{bs}.jsonl") for bs in (1, 4) if bs <= stop_at)
    assert res.stderr.splitlines()[-1] == (f"interrupted: the finished responses are in {files}; "
                                           "run the same command with --resume to continue.")  # fmt: skip
    assert len(read_records(running)) == 1


# -- 3e. --num-prompts and --max-samples -------------------------------------------------------


def test_num_prompts_and_max_samples_are_one_option_and_may_not_disagree(monkeypatch):
    """--num-prompts silently won over --max-samples when both were given (user trial): they
    are aliases on the openai backend, so different values are refused and equal ones run."""
    from typer.testing import CliRunner

    from dflash.bench import remote_command
    from dflash.cli import app

    p = dflash_cli("benchmark", "openai", "--dataset", "gsm8k", "--base-url", "http://127.0.0.1:9",
                   "--num-prompts", "8", "--max-samples", "4")  # fmt: skip
    assert error_lines(p) == [
        "error: --num-prompts 8 and --max-samples 4 disagree; they are the same option (prompts per dataset).",
        "hint: give one of them",
    ]
    asked = []
    monkeypatch.setattr(
        remote_command, "benchmark_openai", lambda **kw: asked.append(kw["num_prompts"])
    )
    for given in (
        ["--num-prompts", "3", "--max-samples", "3"],
        ["--max-samples", "3"],
        ["--num-prompts", "3"],
    ):
        res = CliRunner().invoke(app, ["benchmark", "openai", "--dataset", "gsm8k", *given])
        assert res.exit_code == 0, res.output
    assert asked == [3, 3, 3]
    help_text = " ".join(
        CliRunner().invoke(app, ["benchmark", "--help"], env={"COLUMNS": "200"}).stdout.split()
    )
    assert "alias of --max-samples: prompts per dataset" in help_text
    assert "giving both with different values is an error" in help_text


# -- 3f. the mlx backend's --device ------------------------------------------------------------

MLX_TAKES = (
    "the mlx backend takes --device auto (its default device), cpu or gpu (cuda and metal mean gpu)"
)


@pytest.mark.parametrize(
    "command", [["generate", "mlx", "hi"], ["benchmark", "mlx", "--dataset", "gsm8k"]]
)
def test_mlx_with_device_cuda_says_where_mlx_runs_and_what_it_takes(command):
    """`dflash generate mlx --device cuda` on a machine whose mlx has no GPU: the error says that
    mlx runs on its default device and which --device values the backend takes (user trial)."""
    mx = pytest.importorskip("mlx.core")
    if mx.metal.is_available() or mx.cuda.is_available():
        pytest.skip("this mlx build has a GPU")
    assert error_lines(dflash_cli(*command, "--device", "cuda", "--data-dir", str(DATA_DIR), "--max-samples", "1")
                       if command[0] == "benchmark" else dflash_cli(*command, "--device", "cuda")) == [
        "error: --device cuda needs a GPU, and this mlx build has none: mlx runs on its default device "
        "(the Metal GPU on Apple Silicon, the CPU on Linux).",
        f"hint: use --device auto or cpu; {MLX_TAKES}",
    ]  # fmt: skip


def test_mlx_with_device_cuda_n_names_the_values_it_takes():
    pytest.importorskip("mlx.core")
    assert error_lines(dflash_cli("generate", "mlx", "hi", "--device", "cuda:1")) == [
        "error: Unknown --device 'cuda:1' for the mlx backend; use auto, cpu or gpu.",
        f"hint: {MLX_TAKES}; cuda:N is for the transformers backend",
    ]


# -- 4a. the openai benchmark's bounds all carry a hint ----------------------------------------

CONCURRENCY_HINT = ("it is how many requests are in flight at once: use 1 (the default, one after another) "
                    "or more, e.g. --concurrency 8")  # fmt: skip


@pytest.mark.parametrize("flag, value, message, hint", [
    ("--num-prompts", "0", "--num-prompts must be >= 1, got 0.", "drop it to use every prompt"),
    ("--num-prompts", "-1", "--num-prompts must be >= 1, got -1.", "drop it to use every prompt"),
    ("--max-samples", "0", "--max-samples must be >= 1, got 0.", "drop it to use every prompt"),
    ("--concurrency", "0", "--concurrency must be >= 1, got 0.", CONCURRENCY_HINT),
    ("--concurrency", "-3", "--concurrency must be >= 1, got -3.", CONCURRENCY_HINT),
    ("--max-retries", "-1", "--max-retries must be >= 0, got -1.",
     "use 0 to send each request once, or more to retry a failed one (default 3)"),
    ("--timeout-s", "0", "--timeout-s must be > 0, got 0.0.", "it is the seconds to wait for one request, e.g. --timeout-s 600"),
])  # fmt: skip
def test_every_openai_benchmark_bound_has_a_hint(flag, value, message, hint):
    """`--num-prompts 0` and `--concurrency 0` said 'must be >= 1' and nothing more, while
    `--max-samples 0` had a hint (user trial)."""
    p = dflash_cli("benchmark", "openai", "--dataset", "gsm8k", "--base-url", "http://127.0.0.1:9",
                   "--data-dir", str(DATA_DIR), flag, value)  # fmt: skip
    assert error_lines(p) == [f"error: {message}", f"hint: {hint}"]


# -- 4b. --output or --plot naming a folder ----------------------------------------------------


@pytest.mark.parametrize("backend, flag, name, suffix", [
    ("transformers", "--output", "results.jsonl", ".jsonl"),
    ("openai", "--output", "results.jsonl", ".jsonl"),
    ("transformers", "--plot", "hist.png", ".png"),
    ("openai", "--plot", "hist.png", ".png"),
])  # fmt: skip
def test_an_output_folder_gets_a_hint_naming_a_file_in_it(tmp_path, backend, flag, name, suffix):
    """`--output /some/folder` said 'is a folder; pass a .jsonl file path.' with no hint (user
    trial); the hint names a file in that folder."""
    extra = ["--base-url", "http://127.0.0.1:9"] if backend == "openai" else []
    p = dflash_cli(
        "benchmark",
        backend,
        "--dataset",
        "gsm8k",
        "--data-dir",
        str(DATA_DIR),
        *extra,
        flag,
        str(tmp_path),
    )
    assert error_lines(p) == [
        f"error: {flag} {tmp_path} is a folder; pass a {suffix} file path.",
        f"hint: name a file in it, e.g. {flag} {tmp_path / name}",
    ]


# -- 4c. a --base-url without http:// -----------------------------------------------------------


@pytest.mark.parametrize("args, flag, given, suggested", [
    (["generate", "openai", "hi"], "--base-url", "127.0.0.1:30222", "http://127.0.0.1:30222"),
    (["generate", "openai", "hi"], "--base-url", "localhost:8000/v1/", "http://localhost:8000/v1"),
    (["generate", "openai", "hi"], "--base-url", "ftp://h:1", "http://h:1"),
    (["generate", "openai", "hi"], "--base-url", "http://", "http://127.0.0.1:30000"),
    (["benchmark", "openai", "--dataset", "gsm8k"], "--base-url", "127.0.0.1:30222", "http://127.0.0.1:30222"),
    (["benchmark", "openai", "--dataset", "gsm8k", "--base-url", "http://127.0.0.1:9"], "--baseline-url",
     "127.0.0.1:8000", "http://127.0.0.1:8000"),
])  # fmt: skip
def test_a_base_url_without_a_scheme_is_suggested_back_with_http(args, flag, given, suggested):
    """`--base-url 127.0.0.1:30222` got the hint 'e.g. --base-url http://127.0.0.1:30000', a
    port the user did not type (user trial); the hint is what was typed, after http://."""
    assert error_lines(dflash_cli(*args, flag, given, "--data-dir", str(DATA_DIR))
                       if args[0] == "benchmark" else dflash_cli(*args, flag, given)) == [
        f"error: {flag} {given!r} is not an http(s) URL.",
        f"hint: e.g. {flag} {suggested}",
    ]  # fmt: skip


# -- 4d. a --data-dir without the dataset ------------------------------------------------------

DATA_DIR_HINT = ("point --data-dir (or DFLASH_DATA_DIR) at a folder laid out like tests/datasets in the dflash "
                 "repository (gsm8k/test.jsonl, gsm8k/train.jsonl, humaneval/HumanEval.jsonl.gz, math500/test.jsonl, "
                 "mbpp/sanitized-mbpp.json, mmlu/mmlu.jsonl, mt-bench/question.jsonl), or drop it to fetch the "
                 "dataset from the Hugging Face hub")  # fmt: skip


@pytest.mark.parametrize("backend, dataset, file, by_env", [
    ("transformers", "gsm8k", "gsm8k/test.jsonl", False),
    ("openai", "mt-bench", "mt-bench/question.jsonl", False),
    ("openai", "humaneval", "humaneval/HumanEval.jsonl.gz", True),
])  # fmt: skip
def test_a_data_dir_without_the_dataset_names_the_documented_layout(tmp_path, monkeypatch, backend, dataset, file,
                                                                    by_env):  # fmt: skip
    """A bad --data-dir got the hint 'laid out like shared/datasets', a folder users do not have
    (user trial); the hint names tests/datasets, the layout the README documents, and its files."""
    if by_env:
        monkeypatch.setitem(ENV, "DFLASH_DATA_DIR", str(tmp_path))
    args = ["--base-url", "http://127.0.0.1:9"] if backend == "openai" else []
    args += [] if by_env else ["--data-dir", str(tmp_path)]
    assert error_lines(dflash_cli("benchmark", backend, "--dataset", dataset, *args)) == [
        f"error: Dataset '{dataset}' is not in {tmp_path}: {tmp_path / file} does not exist.",
        f"hint: {DATA_DIR_HINT}",
    ]


def test_the_data_dir_hint_lists_the_files_of_tests_data():
    """The layout the hint names is the one tests/datasets has: every file it lists is there, and
    every dataset file there is listed."""
    from dflash.data.datasets import DATA_DIR_FILES

    assert all((DATA_DIR / f).is_file() for f in DATA_DIR_FILES)
    held = {
        str(p.relative_to(DATA_DIR))
        for p in DATA_DIR.rglob("*")
        if p.is_file() and p.name != "README.md"
    }
    assert held == set(DATA_DIR_FILES)


# -- 4e. a request the server refuses with HTTP 400 --------------------------------------------

# the bodies vLLM, dflash serve and an option check answer with (status 400)
TOO_LONG = ("This model's maximum context length is 8192 tokens. However, you requested 100031 tokens (31 in the "
            "prompt, 100000 in the completion). Please reduce the length of the prompt or max_tokens.")  # fmt: skip
PROMPT_TOO_LONG = "The prompt has 9031 tokens but the target's context is 8192."
BAD_TOP_K = "top_k must be -1 (disable), or at least 1, got -5."
CONTEXT_HINT = ("lower --max-new-tokens or shorten the prompt: the prompt and the new tokens must fit in the model's "
                "context together")  # fmt: skip
REFUSED_HINT = ("the server refused the request as invalid: check the options sent with it (--model, "
                "--max-new-tokens, --temperature, --top-p, --top-k, --reasoning)")  # fmt: skip


@pytest.mark.parametrize("message, hint", [(TOO_LONG, CONTEXT_HINT), (PROMPT_TOO_LONG, CONTEXT_HINT),
                                           (BAD_TOP_K, REFUSED_HINT)])  # fmt: skip
def test_a_400_from_the_server_gets_a_hint_that_fits(message, hint):
    """`dflash generate openai --max-new-tokens 100000` showed the server's 400 (context length)
    with no hint (user trial); a context-length 400 says what to lower, any other 400 says the
    server refused the options."""
    from tests.helpers.openai_replay import ReplayServer, json_reply

    refused = json_reply(
        {"object": "error", "message": message, "type": "BadRequestError", "code": 400}, status=400
    )
    with ReplayServer({"POST /v1/chat/completions": [refused]}) as srv:
        lines = error_lines(dflash_cli("generate", "openai", "--base-url", srv.url, "--model", "m",
                                       "--max-new-tokens", "100000", "hi"))  # fmt: skip
        assert len(srv.requests) == 1  # a 400 is not retried
    assert lines == [
        f"error: {srv.url}/v1/chat/completions failed: HTTP 400: {message.rstrip('.')}.",
        f"hint: {hint}",
    ]


def test_a_benchmark_whose_every_request_is_too_long_says_to_lower_max_new_tokens():
    """The benchmark's 'Every request ... failed' gets the same hints; its prompts are the
    dataset's, so only --max-new-tokens is named."""
    from tests.helpers.openai_replay import ReplayServer, json_reply

    refused = json_reply(
        {"error": {"message": TOO_LONG, "code": "context_length_exceeded"}}, status=400
    )
    with ReplayServer({"POST /v1/chat/completions": [refused]}) as srv:
        p = dflash_cli("benchmark", "openai", "--base-url", srv.url, "--model", "m", "--dataset", "gsm8k",
                       "--data-dir", str(DATA_DIR), "--num-prompts", "1", "--max-new-tokens", "100000")  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert p.stderr.splitlines()[-2:] == [
        f"error: Every request to {srv.url} failed (first: HTTP 400: {TOO_LONG}).",
        "hint: lower --max-new-tokens: each prompt and its new tokens must fit in the model's context together",
    ]


@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_an_empty_prompt_is_refused_before_any_request(prompt):
    """`dflash generate openai ""` showed the server's 400 'The prompt is empty.' with no hint
    (user trial); it is refused before the request, with the local backends' message and hint."""
    from tests.helpers.openai_replay import ReplayServer

    with ReplayServer({}) as srv:
        lines = error_lines(
            dflash_cli("generate", "openai", "--base-url", srv.url, "--model", "m", prompt)
        )
        assert not srv.requests
    assert lines == [
        "error: The prompt is empty.",
        "hint: pass a question or instruction as PROMPT",
    ]


def test_generate_openai_timeout_zero_has_a_hint():
    assert error_lines(dflash_cli("generate", "openai", "--timeout-s", "0", "hi")) == [
        "error: --timeout-s must be > 0, got 0.0.",
        "hint: it is the seconds to wait for the reply, e.g. --timeout-s 600",
    ]
