"""gpt-oss, Gemma 3 text and Gemma 4 text (dense, MoE, shared K/V, the multimodal wrapper) on
the static (CUDA-graph) path, eager on CPU (:mod:`dflash.backends.static.families`).

Tiny random float32 targets from ``tests/helpers/target_families.py`` (windows of 8, prompts of
40 tokens): greedy ids equal HF ``generate`` at block sizes 1, 3 and 16, through SDPA with
position masks (the sinks written out for gpt-oss) and through the split-KV kernel's algorithm
(its torch reference on CPU, sinks included); the target features the draft reads equal the
plain path's; scripted drafts with zero-accept steps and full blocks give plain greedy, and
after every step the K/V rows each layer can see are those of decoding one token at a time.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from dflash.backends.static.support import static_refusal
from tests.helpers.static_families import check_scripted_rows, run, static
from tests.helpers.target_families import WINDOW, build, greedy, prompt_ids

N = 32
FAMILIES = [
    "gpt_oss",
    "gemma3_text",
    "gemma4_text",
    "gemma4_moe",
    "gemma4_kv_shared",
    "gemma4_k_eq_v",
]


def make(family: str):
    """A tiny target of ``family``; ``gemma4_k_eq_v``: Gemma 4 whose global layers take v from the
    raw k projection (``attention_k_eq_v``, one global K/V head), as Gemma-4-31B."""
    if family != "gemma4_k_eq_v":
        return build(family)
    import transformers

    from tests.helpers.target_families import BASE, GEMMA4

    cfg = transformers.Gemma4TextConfig(**BASE, **GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1,
                                        initializer_range=0.02)  # fmt: skip
    torch.manual_seed(0)
    return transformers.Gemma4ForCausalLM(cfg).eval()


@functools.cache
def model_of(family: str):
    """(model, HF greedy ids) once per family per session."""
    model = make(family)
    return model, greedy(model, prompt_ids(), N + 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_runs_on_the_static_path(family):
    model, _ = model_of(family)
    assert static_refusal(model) is None
    be = static(model)
    info = be.describe()
    assert info["family"] == ("gpt_oss" if family == "gpt_oss" else family.split("_")[0] + "_text")
    assert info["sliding_windows"] == [WINDOW]
    assert ("moe_route" in info) == (family in ("gpt_oss", "gemma4_moe"))
    kinds = model.config.layer_types
    assert [s.window for s in be.family] == [
        WINDOW if k == "sliding_attention" else None for k in kinds
    ]
    if family == "gpt_oss":
        assert all(s.sinks is not None for s in be.family)
    if family.startswith("gemma4"):  # the global layers' own head dim
        assert {s.head_dim for s in be.family} == {16, 32}
    if family == "gemma4_k_eq_v":  # the global layers: no v_proj, one K/V head
        assert [s.kv_heads for s in be.family] == [2, 1] * 3
        assert all(layer.self_attn.v_proj is None for layer in model.model.layers[1::2])
    if family == "gemma4_kv_shared":  # the last two layers read earlier layers' buffers
        assert [s.src for s in be.family][-2:] == [2, 3]
        be.reset(64)
        assert be.k[4] is be.k[2] and be.v[5] is be.v[3]


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "split"])
@pytest.mark.parametrize("family", FAMILIES)
def test_static_greedy_equals_hf_generate(family, attention):
    model, truth = model_of(family)
    prompt = prompt_ids()
    assert len(prompt) > WINDOW and len(set(truth)) > 4
    be = static(model, attention)
    for block in (1, 3, 16):
        assert run(be, prompt, block, N) == truth[:N], (family, attention, block)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4_text"])
def test_features_equal_the_plain_paths(family):
    """The rows the draft reads (target layers' hidden states, the last final-normed) equal
    HF's ``hidden_states`` of the same prefill."""
    model, _ = model_of(family)
    be = static(model)
    prompt = prompt_ids()
    be.reset(len(prompt) + 32)
    logits, feats = be.prefill(prompt, True)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    want = torch.cat([out.hidden_states[i][0] for i in be.layer_ids], -1)
    torch.testing.assert_close(feats, want, rtol=1e-3, atol=1e-3)  # float32 rounding
    torch.testing.assert_close(logits, out.logits[0, -1], rtol=1e-4, atol=1e-4)


def test_gemma_final_logits_are_soft_capped():
    """With ``final_logit_softcapping`` the verify logits are cap * tanh(logits / cap), as HF's."""
    model = build("gemma4_text")
    model.config.final_logit_softcapping = 0.5
    with torch.no_grad():
        model.lm_head.weight.mul_(50)
    prompt = prompt_ids()
    be = static(model)
    be.reset(len(prompt) + 8)
    logits, _ = be.prefill(prompt, False)
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert want.abs().max() <= 0.5
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4_moe", "gemma4_kv_shared"])
def test_scripted_schedules_see_exactly_the_one_by_one_rows(family):
    check_scripted_rows(build(family), 40, [[15, 0, 3, 0, 0, 15], [0]])


def test_a_gemma4_wrapper_folder_runs_text_prompts(tmp_path):
    """A Gemma 4 multimodal wrapper folder loads as its text model (as the plain path loads it)
    and decodes HF generate's ids on the static path."""
    from dflash.backends.plain import load_target
    from tests.helpers.target_families import save_target

    wrapper = save_target(tmp_path / "wrapper", "gemma4_wrapper")  # the whole multimodal model
    target, _ = load_target(str(tmp_path / "wrapper"), torch.device("cpu"), torch.float32)
    assert target.config.model_type == "gemma4_text" and static_refusal(target) is None
    truth = greedy(wrapper, prompt_ids(), N)
    assert run(static(target), prompt_ids(), 16, N) == truth


def test_the_kernels_reference_counts_the_sinks():
    """The split-KV algorithm with sinks (several slices, one slice, a window) equals the
    softmax over the scores and the sink column written out."""
    from dflash.backends.static.families import attend_sinks
    from dflash.kernels.split_attention import split_attention_reference

    g = torch.Generator().manual_seed(0)
    h, hkv, t, d, cap = 8, 2, 5, 16, 512
    q, k, v = (
        torch.randn(1, h, t, d, generator=g),
        torch.randn(1, hkv, cap, d, generator=g),
        torch.randn(1, hkv, cap, d, generator=g),
    )
    sinks = torch.randn(h, generator=g) * 3
    pos = torch.arange(300, 300 + t)
    keys = torch.arange(cap)
    for window in (0, 8):
        mask = (keys[None] <= pos[:, None]) & (
            (keys[None] > pos[:, None] - window) if window else True
        )
        want = attend_sinks(q, k, v, mask[None, None], 0.25, sinks)
        for split, one in ((256, 0), (64, 0), (512, 0), (256, 448)):
            got = split_attention_reference(q, k, v, pos, 0.25, split, one, window, sinks)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(want.sum()))


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text", "gemma4_k_eq_v", "gemma4_moe"])
def test_the_kernel_wiring_keeps_greedy_ids(family):
    """The forward as CUDA runs it in bf16 (split-KV attention with every head dim, Gemma 4's
    global 32-wide heads included; the projections through small_linear, Gemma's GELU-tanh as
    the gate+up epilogue; q/k/v norms, RoPE and the cache writes as one kernel; their torch
    references on CPU, float32): HF generate's ids at
    blocks 1 and 16, and no position mask is built for a forward the kernel takes."""
    from dflash.backends.static import families

    model, truth = model_of(family)
    be = static(model, "split")
    # the kernels' references on CPU: RoPE, the norms (Gemma: the post-norm + residual + next
    # norm as one add_norm)
    be.linear, be.target_rope, be.norm_kernel = "auto", True, True
    calls = []
    real = families.small_linear_glu

    def glu(*args, **kwargs):
        calls.append(args[-1] if len(args) > 4 else kwargs.get("act"))
        return real(*args, **kwargs)

    families.small_linear_glu = glu
    try:
        for block in (1, 16):
            assert run(be, prompt_ids(), block, N) == truth[:N]
    finally:
        families.small_linear_glu = real
    assert (len(calls) > 0) == family.startswith("gemma")
    assert set(calls) <= {"gelu_tanh"}
    with torch.inference_mode():  # a 1-row forward of the kernel's widths: no [T, S] masks
        be.key_pos = None  # the masks read it; the kernel path never does
        be._target_forward(torch.tensor([[5]]), torch.tensor([[45]]))
