"""Fused QKV / gate+up projections of the static path: same logits and tokens as HF's forward
and the draft module's own forward."""

from __future__ import annotations

import pytest
import torch

from dflash.backends.static.backend import StaticBackend
from dflash.loop import speculative_generate
from tests.helpers.paths import REPO
from tests.helpers.tiny import PROMPT, greedy_reference, make_draft

CPU = torch.device("cpu")


def _tiny(kind: str):
    """A 3-layer random float32 target: Llama, Qwen2 (q/k/v bias, made non-zero) or Qwen3."""
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    cfg = getattr(transformers, f"{cls}Config")(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.3, **({"head_dim": 16} if kind == "qwen3" else {}))  # fmt: skip
    torch.manual_seed(1)
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and not torch.all(p == 1):  # biases (norm weights stay 1)
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request):
    """(HF target, fused backend, a second backend whose draft runs the module's own forward)
    sharing one target and draft."""
    target = _tiny(request.param)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        before = target(ids).logits[0]
    draft = make_draft(target, layers=2, block_size=8)
    fused = StaticBackend(target, draft, CPU, use_graphs=False)
    module = StaticBackend(target, draft, CPU, use_graphs=False)
    module.fused_draft = None  # the reference: DFlashDraft.forward over the static cache
    with torch.no_grad():  # fusing re-points the HF weights at the fused tensors: same forward
        assert torch.equal(target(ids).logits[0], before)
    return target, fused, module


def test_fused_weights_are_views_and_used(pair):
    target, fused, module = pair
    assert fused.fused_target is not None and fused.fused_draft is not None
    a = target.model.layers[1].self_attn
    qkv, gate_up = fused.fused_target[1]
    assert qkv.sizes == (a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features)
    assert a.k_proj.weight.data_ptr() == qkv.weight[qkv.sizes[0]:].data_ptr()  # no second copy
    assert module.fused_target[1][0].weight is qkv.weight  # a second backend reuses the fusion
    assert (qkv.bias is not None) == (a.q_proj.bias is not None)
    assert gate_up.weight.shape[0] == 2 * target.config.intermediate_size


def test_fused_target_logits_match_hf(pair):
    target, fused, _ = pair
    hf = target(torch.tensor([PROMPT + [5, 6, 7]])).logits[0].detach()
    with torch.inference_mode():
        fused.reset(64)
        last, _ = fused.prefill(PROMPT, True)
        step, _ = fused.verify(5, torch.tensor([6, 7]), len(PROMPT), True)
    # HF's own forward (other attention kernels, whole sequence at once) differs by ~1e-5
    torch.testing.assert_close(step, hf[len(PROMPT) :], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, hf[len(PROMPT) - 1], rtol=1e-4, atol=1e-4)


def test_fused_draft_logits_match_the_module_forward(pair):
    _, fused, module = pair
    out = {}
    with torch.inference_mode():
        for name, be in (("fused", fused), ("module", module)):
            be.reset(64)
            be.prefill(PROMPT, True)
            first = be.draft(3, None, len(PROMPT), 8)[1].clone()  # context = the whole prompt
            be.verify(3, torch.tensor([4, 5]), len(PROMPT), True)
            second = be.draft(9, None, len(PROMPT) + 3, 8)[1].clone()  # cached + 3 new rows
            out[name] = (first, second)
    for a, b in zip(out["fused"], out["module"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 8])
def test_fused_greedy_tokens_identical(pair, block_size):
    target, fused, module = pair
    truth = greedy_reference(target, PROMPT, 40)
    for be in (fused, module):
        runs = list(speculative_generate(be, PROMPT, block_size=block_size, max_new_tokens=40))
        assert [t for r in runs for t in r.tokens] == truth


def test_draft_save_after_fusing(tmp_path, tiny_target):
    """A fused draft still saves and reloads."""
    from dflash.models.draft_torch import DFlashDraft

    draft = make_draft(tiny_target, layers=1, block_size=4)
    be = StaticBackend(tiny_target, draft, CPU, use_graphs=False)
    assert be.fused_draft is not None
    back = DFlashDraft.load(draft.save(tmp_path / "d"))  # views of one tensor: saved as copies
    for (name, p), q in zip(draft.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_targets_without_plain_linears_take_the_plain_path(tiny_target):
    """The static forwards fuse every layer's projections: a target whose linears cannot be
    fused (quantized, custom) is not taken (the transformers load runs the plain path)."""
    import copy

    from dflash.backends.static.support import supports_static
    from dflash.errors import BackendError

    assert supports_static(tiny_target)
    odd = copy.deepcopy(tiny_target)

    class Custom(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x)

    old = odd.model.layers[0].mlp.up_proj
    odd.model.layers[0].mlp.up_proj = Custom(old.in_features, old.out_features, bias=False)
    assert not supports_static(odd)
    with pytest.raises(BackendError):
        StaticBackend(odd, None, CPU, use_graphs=False)


def test_kernel_count_script_tiny(tmp_path):
    """scripts/kernel_count.py on CPU: both variants measured, one row per op."""
    import importlib.util
    import json

    script = REPO / "scripts" / "kernel_count.py"
    spec = importlib.util.spec_from_file_location("kernel_count", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--tiny", "--prompt-len", "32", "--iters", "5", "--sequence", "--out", str(tmp_path / "k.json")])
    runs = json.loads((tmp_path / "k.json").read_text())["runs"]
    for label in ("verify-1", "verify-16", "draft-16"):
        for name in ("auto", "off"):
            assert runs[name][label]["kernels"] > 0, (name, label)
            assert len(runs[name][label]["sequence"]) == runs[name][label]["kernels"], label  # one row per op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 4096, 1000])  # 1000: not a multiple of 64, plain argmax
def test_row_argmax_is_argmax_with_ties(dtype, vocab):
    from dflash.backends.static.fused import row_argmax

    g = torch.Generator().manual_seed(vocab)
    for _ in range(20):
        x = torch.randint(0, 6, (16, vocab), generator=g).to(dtype)  # many tied maxima per row
        assert torch.equal(row_argmax(x), x.argmax(-1))
    x = torch.zeros(3, vocab, dtype=dtype)  # every entry tied: index 0
    x[1, -1] = 1.0  # the max in the last slice
    assert row_argmax(x).tolist() == [0, vocab - 1, 0]


def test_realized_is_an_identity_eager_and_compiled():
    """realized(): the same tensors outside torch.compile (no copy), equal values inside it
    (Inductor's force-stride-order prim, traced here without codegen)."""
    from dflash.backends.static.fused import realized

    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(4)
    assert all(x is y for x, y in zip(realized(a, b), (a, b), strict=True))

    def f(pos, x):
        q, = realized(pos + torch.arange(3))
        return q[-1:] * x, q * 2

    graphs = []

    def capture(gm, example_inputs):  # a Dynamo backend that keeps the traced graph
        graphs.append(gm.code)
        return gm.forward

    got = torch.compile(f, backend=capture, fullgraph=True)(b[:1], a)
    want = f(b[:1], a)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert len(graphs) == 1 and "inductor_force_stride_order" in graphs[0]  # one buffer for Inductor
