"""The CUDA-graph path's settings (dflash.kernels.settings): defaults, each environment override,
bad values as one-line errors, ``--kernels off``, the fall-back ladder, and where the resolved
settings are recorded (``generate --json``, benchmark records); ``--recalibrate`` and
``--warmup`` wired through the commands."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dflash.errors import InputError
from dflash.kernels.settings import ENV, LADDER, KernelSettings, fall_back

# (variable, value, field, resolved value): every override reaches its field
OVERRIDES = [
    ("DFLASH_ATTN", "split", "attention", "split"), ("DFLASH_ATTN_SPLIT", "512", "attn_split", 512),
    ("DFLASH_ATTN_ONE_SLICE", "0", "attn_one_slice", 0), ("DFLASH_ATTN_BLOCK", "64", "attn_block", 64),
    ("DFLASH_ATTN_EARLY", "0", "attn_early", False), ("DFLASH_LINEAR", "triton", "linear", "triton"),
    ("DFLASH_LINEAR_CONFIG", "32,128,4,3", "linear_config", "32,128,4,3"), ("DFLASH_GLU", "off", "glu", False),
    ("DFLASH_FUSE_NORM", "1", "fuse_norm", True), ("DFLASH_NORM_KERNEL", "0", "norm_kernel", False),
    ("DFLASH_ROPE", "draft", "rope_target", False), ("DFLASH_QKV_ROPE", "0", "qkv_rope", False),
    ("DFLASH_ROPE_TABLE", "0", "rope_table", False), ("DFLASH_PDL", "kernels", "pdl", "kernels"),
    ("DFLASH_DEVICE_LOOP", "false", "device_loop", False), ("DFLASH_QUEUE_AHEAD", "step", "queue_ahead", "step"),
    ("DFLASH_COMPILE_GLUE", "0", "compile_glue", False),
    ("DFLASH_COMPILE_MODE", "max-autotune-no-cudagraphs", "compile_mode", "max-autotune-no-cudagraphs"),
    ("DFLASH_GRAPH_WARM", "0", "graph_warm", 0), ("DFLASH_DRAFT_VOCAB", "0", "draft_vocab", False),
    ("DFLASH_BATCHED_KV_LENGTHS", "1", "batched_kv_lengths", True),
    ("DFLASH_BATCHED_COMPILE", "no", "batched_compile", False),
]  # fmt: skip

BAD = [("DFLASH_ATTN", "flash"), ("DFLASH_ATTN_SPLIT", "100"), ("DFLASH_ATTN_ONE_SLICE", "-1"),
       ("DFLASH_ATTN_BLOCK", "96"), ("DFLASH_ATTN_EARLY", "2"), ("DFLASH_LINEAR", "cublas"),
       ("DFLASH_LINEAR_CONFIG", "1,2"), ("DFLASH_GLU", "maybe"), ("DFLASH_FUSE_NORM", "auto"),
       ("DFLASH_NORM_KERNEL", "x"), ("DFLASH_ROPE", "target"), ("DFLASH_QKV_ROPE", "some"),
       ("DFLASH_ROPE_TABLE", "2"), ("DFLASH_PDL", "inductor"), ("DFLASH_DEVICE_LOOP", "host"),
       ("DFLASH_QUEUE_AHEAD", "verify"), ("DFLASH_COMPILE_GLUE", "x"), ("DFLASH_COMPILE_MODE", "fast"),
       ("DFLASH_GRAPH_WARM", "-1"), ("DFLASH_DRAFT_VOCAB", "maybe"), ("DFLASH_BATCHED_KV_LENGTHS", "x"),
       ("DFLASH_BATCHED_COMPILE", "x")]  # fmt: skip


def test_defaults_are_resolved_from_an_empty_environment():
    """The defaults the CUDA path ran before the settings object: resolve() of an empty
    environment gives them, and every field is JSON-ready."""
    s = KernelSettings.resolve(environ={})
    assert s == KernelSettings()
    assert (s.kernels, s.attention, s.attn_split, s.attn_one_slice, s.attn_block, s.attn_early) == (
        "auto", "auto", 256, None, 128, True)
    assert (s.linear, s.linear_config, s.glu, s.fuse_norm, s.norm_kernel) == ("auto", "", True, None, True)
    assert (s.rope_target, s.rope_draft, s.qkv_rope, s.rope_table, s.pdl) == (True, True, None, True, "1")
    assert (s.device_loop, s.queue_ahead, s.compile_glue, s.compile_mode, s.graph_warm) == (
        True, "draft", True, None, 3)
    assert (s.draft_vocab, s.batched_kv_lengths, s.batched_compile) == (True, None, None)
    assert json.loads(json.dumps(s.record())) == dataclasses.asdict(s)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.glu = False


def test_every_override_reaches_its_field():
    assert {var for var, *_ in OVERRIDES} == set(ENV.values())  # every override is covered here
    for var, raw, name, value in OVERRIDES:
        s = KernelSettings.resolve(environ={var: f" {raw} "})
        assert getattr(s, name) == value, var
        changed = {f.name for f in dataclasses.fields(s) if getattr(s, f.name) != getattr(KernelSettings(), f.name)}
        assert changed == {name} | ({"attn_one_slice"} if name == "attn_split" else set()), (var, changed)
    split = KernelSettings.resolve(environ={"DFLASH_ATTN_SPLIT": "512"})
    assert split.attn_one_slice == 0  # a split given is the split run (one slice off)


@pytest.mark.parametrize("var, raw", BAD)
def test_bad_values_are_one_line_errors_naming_the_variable(var, raw):
    with pytest.raises(InputError) as err:
        KernelSettings.resolve(environ={var: raw})
    assert err.value.message.startswith(f"{var} must be") and repr(raw) in err.value.message
    assert "\n" not in err.value.message and err.value.hint


def test_kernels_off_and_unknown_kernels():
    off = KernelSettings.resolve("off", {"DFLASH_ATTN": "split", "DFLASH_GRAPH_WARM": "1"})
    assert off.kernels == "off" and off.graph_warm == 1  # tuning kept, kernels off whatever asked
    assert (off.attention, off.linear, off.glu, off.fuse_norm, off.norm_kernel) == ("sdpa", "torch", False, False, False)
    assert (off.rope_target, off.rope_draft, off.qkv_rope, off.pdl) == (False, False, False, "0")
    with pytest.raises(InputError, match="--kernels must be auto or off"):
        KernelSettings.resolve("none", {})


def test_fall_back_ladder_order():
    """Each step turns off the first live piece, in the ladder's order; nothing live: None."""
    s, live, order = KernelSettings(), {piece for piece, *_ in LADDER}, []
    while (step := fall_back(s, live)) is not None:
        s, what, fix = step
        order.append(what)
        live.discard(next(piece for piece, w, *_ in LADDER if w == what))
        assert "--kernels off silences this" in fix
    assert order == [w for _, w, *_ in LADDER] and len(order) == 8
    assert (s.linear, s.attention, s.pdl, s.glu, s.norm_kernel) == ("torch", "sdpa", "0", False, False)
    assert fall_back(KernelSettings(), set()) is None


def test_settings_are_in_describe_and_benchmark_records(tiny_target):
    """Pipeline.describe() (what every benchmark record's config carries) names the resolved
    settings, on the plain path too (it reads draft_vocab)."""
    from dflash.backends.plain import TransformersBackend
    from dflash.bench.harness import producer_info
    from dflash.pipeline import Pipeline
    from tests.helpers.tiny import make_draft

    settings = KernelSettings.resolve(environ={"DFLASH_DRAFT_VOCAB": "0"})
    be = TransformersBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), settings)
    pipe = Pipeline(be, None, [])
    assert pipe.describe()["kernel_settings"] == settings.record()
    assert producer_info(pipe)["kernel_settings"]["draft_vocab"] is False


def test_generate_json_records_the_settings_and_passes_the_options(monkeypatch):
    """generate --json prints the resolved settings; --kernels reaches dflash.load and
    --recalibrate the pipeline."""
    from typer.testing import CliRunner

    import dflash
    from dflash.cli import app
    from dflash.types import GenerationResult
    from tests.helpers.fakes import WarmupPipe

    loaded = {}
    settings = KernelSettings().without_kernels()

    class Pipe(WarmupPipe):
        recalibrate = False

        def chat_prompt(self, messages, **kwargs):
            return [1, 2, 3]

        def generate(self, ids, **kwargs):
            return GenerationResult(token_ids=[7], text="x", prompt_tokens=3, acceptance_lengths=[1],
                                    proposed=[15], block_size=16)  # fmt: skip

    def load(*a, **kw):
        loaded.update(kw)
        pipe = Pipe(False)
        pipe.backend.settings = settings
        loaded["pipe"] = pipe
        return pipe

    monkeypatch.setattr(dflash, "load", load)
    res = CliRunner().invoke(app, ["generate", "transformers", "hi", "--json", "--kernels", "off", "--recalibrate"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["kernel_settings"] == settings.record() and loaded["kernels"] == "off"
    assert loaded["pipe"].recalibrate is True


@pytest.mark.parametrize("args, message", [
    (["generate", "transformers", "hi", "--block-size", "4", "--recalibrate"], "--recalibrate measures the costs"),
    (["generate", "openai", "hi", "--kernels", "off"], "--kernels does not apply to the openai backend"),
    (["generate", "mlx", "hi", "--warmup", "8"], "--warmup does not apply to the mlx backend"),
    (["generate", "transformers", "hi", "--warmup", "-1"], "--warmup must be a whole number"),
    (["benchmark", "mlx", "--dataset", "gsm8k", "--kernels", "off"], "--kernels does not apply to the mlx backend"),
    (["benchmark", "transformers", "--dataset", "gsm8k", "--block-size", "4,16", "--recalibrate"], "--recalibrate measures the costs"),
    (["benchmark", "transformers", "--dataset", "gsm8k", "--kernels", "none"], "--kernels must be auto or off"),
])  # fmt: skip
def test_options_refused_before_loading(args, message):
    from typer.testing import CliRunner

    from dflash.cli import app

    res = CliRunner().invoke(app, args)
    assert isinstance(res.exception, InputError), (res.output, res.exception)
    assert message in res.exception.message and "\n" not in res.exception.message


def test_recalibrate_measures_again_and_caches(tmp_path, monkeypatch):
    """--recalibrate (Pipeline.recalibrate) ignores the cached table, measures it again and
    caches the new one; without it the cache is read."""
    from dflash import auto_block_costs
    from dflash.auto_block import CostTable
    from dflash.pipeline import Pipeline

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    measured = []

    def measure(backend, widths, on_step=None):
        measured.append(list(widths))
        return CostTable(verify_s={w: 0.001 * (len(measured) + w) for w in widths},
                         draft_s={w: 0.0005 for w in widths if w > 1})  # fmt: skip

    monkeypatch.setattr(auto_block_costs, "measure_costs", measure)

    class Backend:
        draft_block_size = 4
        auto_widths = [1, 2, 4]

    def costs(recalibrate: bool) -> CostTable:
        pipe = Pipeline(Backend(), None, [], cost_key={"backend": "fake"})
        pipe.recalibrate = recalibrate
        return pipe.calibrate()

    first = costs(False)
    assert costs(False).verify_s == first.verify_s and len(measured) == 1  # read from the cache
    again = costs(True)
    assert len(measured) == 2 and again.verify_s != first.verify_s
    assert costs(False).verify_s == again.verify_s  # the new table was cached
