"""Hints for the mistakes of a first run (issue 51): a target passed as --draft, a hub target
with no network, and a ``hint:`` line under every one-line error."""

from __future__ import annotations

import json

import pytest

from dflash.errors import ConfigError, DflashError, InputError
from tests.helpers.cli import error_lines
from tests.helpers.cli import run as dflash_cli


def error_and_hint(p) -> tuple[str, str]:
    """The two stderr lines of a one-line error (``error:`` then ``hint:``), nothing else."""
    error, hint = error_lines(p)
    return error, hint


def target_folder(path, name="Qwen3-8B"):
    folder = path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
        "_name_or_path": "Qwen/Qwen3-8B"}))  # fmt: skip
    return folder


def test_a_target_passed_as_draft_is_named_a_target(tmp_path):
    from dflash.models.config import DraftConfig

    folder = target_folder(tmp_path)
    with pytest.raises(ConfigError) as err:
        DraftConfig.load(folder)
    assert err.value.message == (f"--draft {folder} looks like a target model (Qwen3ForCausalLM), not a "
                                 "DFlash draft: its config.json has no dflash_config.")  # fmt: skip
    assert err.value.hint.startswith("pass it as --model (its published draft: z-lab/Qwen3-8B-DFlash-b16);")
    assert "dflash models" in err.value.hint and f"dflash init-draft --target {folder}" in err.value.hint


def test_a_target_passed_as_draft_on_the_command_line(tmp_path):
    folder = target_folder(tmp_path, "my-llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], _name_or_path="my-llama")
    (folder / "config.json").write_text(json.dumps(cfg))
    error, hint = error_and_hint(dflash_cli("generate", "transformers", "hi", "--draft", str(folder)))
    assert "looks like a target model (LlamaForCausalLM), not a DFlash draft" in error
    assert hint.startswith("hint: pass it as --model;")  # no published draft for this one


def test_a_draft_config_that_only_lacks_fields_keeps_its_message():
    with pytest.raises(ConfigError, match="Draft config lacks mask_token_id"):
        from dflash.models.config import DraftConfig

        DraftConfig.from_dict({"architectures": ["DFlashDraftModel"], "hidden_size": 64})


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"},
                                 {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}])  # fmt: skip
def test_init_draft_with_a_hub_target_and_no_hub_is_one_error(env, tmp_path):
    """Offline (the variable, or a hub that refuses connections): one error line and a hint,
    where huggingface_hub printed a line per retry for about 40 s."""
    error, hint = error_and_hint(dflash_cli("init-draft", "--target", "Qwen/Qwen3-8B",
                                            "--out", str(tmp_path / "d"), **env))  # fmt: skip
    why = "HF_HUB_OFFLINE=1 is set" if env["HF_HUB_OFFLINE"] else "127.0.0.1:9: ConnectError"
    assert error.startswith("error: Target Qwen/Qwen3-8B is not in the hub cache, and the hub cannot be "
                            f"reached ({why}")  # fmt: skip
    assert hint == ("hint: connect to the network once to download it, or pass --target DIR (a local "
                    "folder) or a .gguf file")  # fmt: skip
    assert not (tmp_path / "d").exists()


def test_every_error_gets_a_hint_line():
    """An error raised without a hint gets its kind's general one."""
    error, hint = error_and_hint(dflash_cli("generate", "transformers", "hi", "--dtype", "float8"))
    assert error == "error: Unknown --dtype 'float8'; use auto, bfloat16, float16 or float32."
    assert hint == "hint: run 'dflash generate --help' for the options and their values"
    assert InputError("x").hint_for("benchmark") == "run 'dflash benchmark --help' for the options and their values"
    assert InputError("x", hint="do y").hint_for("benchmark") == "do y"
    assert "dflash doctor" in DflashError("x").hint_for("")
    assert "dflash init-draft" in ConfigError("x").hint_for("generate")
