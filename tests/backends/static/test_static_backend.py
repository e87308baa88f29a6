"""The static-cache fast path (eager on CPU; CUDA graphs on GPU) gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from dflash.backends.static.backend import StaticBackend
from dflash.backends.static.support import supports_static
from dflash.loop import speculative_generate
from tests.helpers.static import draft_twice
from tests.helpers.tiny import PROMPT, custom_draft, greedy_reference, make_draft


@pytest.fixture(scope="module")
def static_backend(tiny_target):
    assert supports_static(tiny_target)
    return StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_static_parity_tiny(static_backend, tiny_target, block_size):
    truth = greedy_reference(tiny_target, PROMPT, 60)
    for _ in range(2):  # a second request reuses the buffers: nothing leaks
        toks = [t for r in speculative_generate(static_backend, PROMPT, block_size=block_size,
                                                max_new_tokens=60) for t in r.tokens]  # fmt: skip
        assert toks == truth


def test_static_matches_dynamic_acceptance(static_backend, tiny_backend):
    """Same draft weights and context -> the same proposals, so identical τ per step."""
    static_backend.draft_model.load_state_dict(tiny_backend.draft_model.state_dict())
    a = [r.accepted for r in speculative_generate(static_backend, PROMPT, block_size=16, max_new_tokens=80)]
    b = [r.accepted for r in speculative_generate(tiny_backend, PROMPT, block_size=16, max_new_tokens=80)]
    assert a == b


def test_static_parity_real_target(demo_pipe):
    be = StaticBackend(demo_pipe.backend.target, demo_pipe.backend.draft_model, torch.device("cpu"),
                       use_graphs=False)  # fmt: skip
    ids = demo_pipe.chat_prompt([{"role": "user", "content": "Name three primary colors."}])
    ref = demo_pipe.generate(ids, block_size=8, max_new_tokens=48)
    toks = [t for r in speculative_generate(be, ids, block_size=8, max_new_tokens=48,
                                            stop_ids=demo_pipe.stop_ids) for t in r.tokens]  # fmt: skip
    assert toks == ref.token_ids


def test_static_honours_sliding_and_causal_draft_layers(tiny_target):
    """A draft with a sliding-window layer and causal blocks: static == plain path, and the
    result differs from the same weights run all-visible (so the check can fail)."""
    from dflash.backends.plain import TransformersBackend

    prompt = PROMPT * 3  # 24 rows: longer than the window
    kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5, is_causal=True)
    draft = custom_draft(tiny_target, **kw)
    static = StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False)
    plain = TransformersBackend(tiny_target, draft, torch.device("cpu"))
    for a, b in zip(draft_twice(static, prompt), draft_twice(plain, prompt), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    full = custom_draft(tiny_target)  # same seed -> same weights, all-visible layers
    full.load_state_dict(draft.state_dict())
    unwindowed = draft_twice(StaticBackend(tiny_target, full, torch.device("cpu"), use_graphs=False), prompt)
    assert (unwindowed[0] - draft_twice(plain, prompt)[0]).abs().max() > 1e-2


def test_last_layer_features_are_final_normed_like_hf(tiny_target):
    """target_layer_ids holding the last layer: static features == HF hidden_states[N]."""
    from dflash.backends.plain import TransformersBackend

    n = tiny_target.config.num_hidden_layers
    with torch.no_grad():  # a non-trivial final norm, so raw and normed outputs differ
        tiny_target.model.norm.weight.copy_(torch.linspace(0.5, 2.0, tiny_target.config.hidden_size))
    try:
        draft = custom_draft(tiny_target, target_layer_ids=[1, n - 1])
        static = StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False)
        plain = TransformersBackend(tiny_target, draft, torch.device("cpu"))
        for be in (static, plain):
            be.reset(64)
        with torch.inference_mode():
            logits, fs = static.prefill(PROMPT, True)
            _, fp = plain.prefill(PROMPT, True)
            torch.testing.assert_close(fs, fp, rtol=1e-4, atol=1e-4)
            h = tiny_target.config.hidden_size  # the last slot is what the LM head reads
            torch.testing.assert_close(tiny_target.lm_head(fs[-1, h:]), logits, rtol=1e-4, atol=1e-4)
    finally:
        with torch.no_grad():
            tiny_target.model.norm.weight.fill_(1.0)


class _FakeGraph:
    """CPU stand-in for a CUDA graph: replay re-runs the function on the static inputs and
    copies the results into the outputs captured once (as a graph replay updates them)."""

    def __init__(self, fn, inputs, out):
        self.fn, self.inputs, self.out = fn, inputs, out

    def replay(self):
        with torch.inference_mode():
            new = self.fn(*self.inputs)
        for dst, src in zip(self.out if isinstance(self.out, tuple) else (self.out,),
                            new if isinstance(new, tuple) else (new,), strict=True):  # fmt: skip
            dst.copy_(src)


@pytest.mark.parametrize("block_size,uniform", [(1, False), (3, False), (16, False), (1, True)])
def test_graph_path_plan_padding_and_no_capture_while_decoding(tiny_target, block_size, uniform):
    """The graph code path (static inputs, padding to captured widths, replays) on CPU with a
    fake graph: greedy parity, exactly the planned graphs, none captured after prefill."""
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False,
                       uniform_width=uniform)  # fmt: skip
    be.use_graphs = True
    events: list[str] = []

    def fake_graph(kind, width, make_inputs):
        key = (kind, width)
        if key not in be.graphs:
            events.append(f"capture {kind} {width}")
            inputs = make_inputs()
            fn = be._target_forward if kind == "verify" else be._draft_forward
            with torch.inference_mode():
                out = fn(*inputs)
            out = tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()
            be.graphs[key] = (_FakeGraph(fn, inputs, out), out, inputs)
        return be.graphs[key]

    be._graph = fake_graph
    prefill = be.prefill

    def marked_prefill(*args):
        events.append("prefill")
        return prefill(*args)

    be.prefill = marked_prefill
    truth = greedy_reference(tiny_target, PROMPT, 45)
    for budget in (45, 30):  # the last block is cut short by the budget
        toks = [t for r in speculative_generate(be, PROMPT, block_size=block_size,
                                                max_new_tokens=budget) for t in r.tokens]  # fmt: skip
        assert toks == truth[:budget]
    want = {("verify", 16), ("draft", 16)} | (set() if uniform else {("verify", 1)})
    assert set(be.graphs) == want
    first_prefill = events.index("prefill")
    assert all(not e.startswith("capture") for e in events[first_prefill:]), events


def test_capture_failures_fall_back_one_piece_at_a_time(tiny_target, capsys, gpu_like):
    """A failed capture turns off the next live kernel (the qkv + RoPE kernel, the SiLU * up
    epilogue, the RoPE kernel, the Triton projections, the split-KV kernel), then compile, one
    warning line each, and captures again with new settings; with nothing left it raises."""
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    be.compile = True
    assert be.live_kernels() == {"qkv_rope", "glu", "rope", "linear", "attention"}
    seen = []

    def capture_fails_with_triton_linear(fn, inputs):
        seen.append((be.linear, be.attention, be.compile))
        if be.linear != "torch":
            raise RuntimeError("triton: out of resources\nmore detail")
        return "graph", "out", inputs

    be._capture = capture_fails_with_triton_linear
    assert be._graph("verify", 1, lambda: ("ids", "pos"))[1] == "out"
    assert seen == [("auto", "auto", True)] * 4 + [("torch", "auto", True)]
    assert (be.linear, be.draft_linear, be.attention, be.compile) == ("torch", False, "auto", True)
    assert be.settings.linear == "torch" and not (be.settings.glu or be.settings.rope_target or be.settings.qkv_rope)
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" failed")[0] for line in err] == [
        "dflash: the qkv + RoPE kernel", "dflash: the SiLU * up epilogue", "dflash: the RoPE + cache-write kernel",
        "dflash: the Triton projection kernel"]
    assert err[-1] == ("dflash: the Triton projection kernel failed (RuntimeError: triton: out of resources); "
                       "continuing with cuBLAS (DFLASH_LINEAR=torch or --kernels off silences this).")

    def always_fails(fn, inputs):
        raise RuntimeError("boom")

    be._capture = always_fails
    with pytest.raises(RuntimeError, match="boom"):
        be._graph("verify", 16, lambda: ("ids", "pos"))
    assert (be.linear, be.attention, be.compile) == ("torch", "sdpa", False)
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" failed")[0] for line in err] == ["dflash: the split-KV attention kernel", "dflash: torch.compile"]
    assert not be.graphs  # every graph is captured again with the new settings


def test_a_fall_back_drops_the_graphs_captured_before(tiny_target, gpu_like):
    """Graphs captured with the old settings are dropped after a fall-back, so every graph of
    the plan runs the same settings: capture_all captures them all again."""
    import dataclasses

    from dflash.kernels.settings import KernelSettings

    settings = dataclasses.replace(KernelSettings(), qkv_rope=False, glu=False, rope_target=False,
                                   rope_draft=False, linear="torch", graph_warm=0)  # fmt: skip
    be = StaticBackend(tiny_target, make_draft(tiny_target, block_size=4), torch.device("cpu"), use_graphs=False,
                       settings=settings, device_loop=False)  # fmt: skip
    assert be.live_kernels() == {"attention"}
    captured = []

    def fails_on_draft(fn, inputs):  # the first graph (verify 1) captures, the second fails once
        if be.attention != "sdpa" and captured:
            raise RuntimeError("draft graph failed")
        captured.append(be.attention)
        return "graph", "out", inputs

    be._capture = fails_on_draft
    be._allocate(64)
    be.capture_all()
    # verify 1, then verify 4 (after the fall-back), draft 4, and verify 1 again
    assert captured == ["auto", "sdpa", "sdpa", "sdpa"]
    assert set(be.graphs) == {("verify", 1), ("verify", 4), ("draft", 4)}


def test_capture_failure_with_pdl_turns_pdl_off_first(tiny_target, capsys, monkeypatch):
    """PDL on (as on a Hopper GPU): the first fall-back after a failed capture is plain launches
    (one line naming it), the compiled forwards are dropped so they compile again, and the
    kernels launch without PDL afterwards."""
    import dflash.backends.static.backend as sb

    monkeypatch.setattr(sb, "pdl_supported", lambda device: True)  # as on a GPU
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    assert be.launch["target"].pdl and be.launch["draft"].pdl and be.live_kernels() == {"pdl"}
    be._compiled["verify"] = "stale"
    tries = []

    def fails_once(fn, inputs):
        tries.append(be.launch["target"].pdl)
        if len(tries) == 1:
            raise RuntimeError("CUDA error: launch failed")
        return "graph", "out", inputs

    be._capture = fails_once
    assert be._graph("verify", 1, lambda: ("ids", "pos"))[1] == "out"
    assert tries == [True, False] and "verify" not in be._compiled
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dflash: programmatic dependent launch failed (RuntimeError: CUDA error: launch failed); "
                   "continuing with plain launches (DFLASH_PDL=0 or --kernels off silences this)."]  # fmt: skip
    assert be.settings.pdl == "0" and not be.pdl_on("target", inductor=True)  # off for good


def test_pdl_draft_only_in_the_draft_graphs(tiny_target, monkeypatch):
    """The pdl setting ``draft``: this project's kernels and Inductor's launch with PDL in the
    draft's forward only; each capture sets Inductor's PDL for the forward it captures."""
    import dataclasses
    from contextlib import contextmanager

    import dflash.backends.static.backend as sb
    import dflash.backends.static.capture as cap
    from dflash.kernels.settings import KernelSettings

    monkeypatch.setattr(sb, "pdl_supported", lambda device: True)  # as on a GPU
    seen = []

    @contextmanager
    def record(on, device):
        seen.append(on)
        yield

    monkeypatch.setattr(cap, "inductor_pdl", record)
    settings = dataclasses.replace(KernelSettings(), pdl="draft")
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False, settings=settings)
    assert not be.launch["target"].pdl and be.launch["draft"].pdl
    be._capture = lambda fn, inputs: ("graph", "out", inputs)
    for n, kind in enumerate(("verify", "draft", "verify")):
        be._graph(kind, n + 1, lambda: ())
    assert seen == [False, True, False]
    kernels = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False,
                            settings=dataclasses.replace(settings, pdl="kernels"))  # fmt: skip
    assert kernels.launch["target"].pdl and not kernels.pdl_on("target", inductor=True)


def test_inductor_pdl_setting_is_restored_after_each_capture():
    """Inductor's process-wide PDL setting is set for one capture only and restored after it,
    also when the capture raises; off CUDA it is never touched."""
    import torch._inductor.config as inductor_config

    from dflash.backends.static.capture import inductor_pdl as _inductor_pdl

    if not hasattr(inductor_config.triton, "enable_pdl"):
        pytest.skip("this torch has no Inductor PDL setting")
    before = inductor_config.triton.enable_pdl
    with _inductor_pdl(not before, torch.device("cpu")):
        assert inductor_config.triton.enable_pdl == before
    with pytest.raises(RuntimeError), _inductor_pdl(not before, torch.device("cuda")):
        assert inductor_config.triton.enable_pdl == (not before)
        raise RuntimeError("capture failed")
    assert inductor_config.triton.enable_pdl == before


def test_capture_failure_with_draft_rope_turns_it_off_first(tiny_target, capsys, gpu_like):
    """The rope settings: with the qkv kernel and the SiLU epilogue off, the first fall-back
    after a failed capture is the torch q/k norm + RoPE ops (draft and target), the Triton
    projections stay on."""
    import dataclasses

    from dflash.kernels.settings import KernelSettings

    settings = dataclasses.replace(KernelSettings(), qkv_rope=False, glu=False)
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False, settings=settings)
    assert be.draft_rope and be.target_rope and be.draft_linear
    seen = []

    def fails_with_rope(fn, inputs):
        seen.append((be.draft_rope, be.linear))
        if be.draft_rope:
            raise RuntimeError("rope kernel failed")
        return "graph", "out", inputs

    be._capture = fails_with_rope
    assert be._graph("draft", 16, lambda: ("ids", "pos"))[1] == "out"
    assert seen == [(True, "auto"), (False, "auto")] and be.draft_linear and not be.target_rope
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dflash: the RoPE + cache-write kernel failed (RuntimeError: rope kernel failed); "
                   "continuing with torch ops (DFLASH_ROPE=0 or --kernels off silences this)."]  # fmt: skip


def test_kernels_off_runs_torch_ops_in_the_graphs(tiny_target, gpu_like):
    """--kernels off: where the kernels would run (gpu_like), the forwards take torch ops: no
    Triton projection, no split-KV attention, no RoPE, norm or qkv kernel, no PDL."""
    from dflash.kernels.settings import KernelSettings

    on = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    off = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False,
                        settings=KernelSettings.resolve("off", {}))  # fmt: skip
    assert on.live_kernels() and not off.live_kernels()
    assert (off.attention, off.linear, off.draft_linear, off.glu, off.target_rope, off.draft_rope) == (
        "sdpa", "torch", False, False, False, False)
    assert off.describe()["kernel_settings"]["kernels"] == "off"
    with torch.inference_mode():  # the torch ops give the plain greedy tokens
        runs = list(speculative_generate(off, PROMPT, block_size=16, max_new_tokens=20))
    assert [t for r in runs for t in r.tokens] == greedy_reference(tiny_target, PROMPT, 20)


def test_draft_weights_that_do_not_fit_their_config_give_one_line(tiny_target, tmp_path):
    """A draft whose config.json was edited (intermediate_size) fails with one line naming the
    first mismatch and a count, not torch's multi-line state-dict report (found by a user trial)."""
    import json

    from dflash.backends.plain import load_draft
    from dflash.errors import CheckpointError
    from tests.helpers.tiny import make_draft

    folder = make_draft(tiny_target).save(tmp_path / "d")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] + 32}))
    with pytest.raises(CheckpointError, match=r"size mismatch for layers\.0\.mlp\.\w+\.weight.*\(and \d+ more\)") as err:
        load_draft(folder, torch.device("cpu"), torch.float32)
    assert "\n" not in err.value.message and "config.json" in err.value.hint
