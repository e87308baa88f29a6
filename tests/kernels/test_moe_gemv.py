"""The expert GEMV kernels' references (dflash.kernels.moe_gemv) and the new RMSNorm modes'
(dflash.kernels.rms_norm) against the maths they stand for; the kernels themselves run on CUDA
(scripts/gpu_check_static_families.py) or under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from dflash.backends.static.moe import gpt_oss_forward, moe_forward
from dflash.kernels.moe_gemv import moe_gemv_reference, moe_glu_reference, usable
from dflash.kernels.rms_norm import LLAMA, ONE_PLUS, ROUND_ONCE, rms_norm_reference
from tests.helpers.target_families import build


def test_references_are_per_row_expert_matmuls():
    g = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(5, 24, generator=g),
        torch.randn(4, 16, 24, generator=g),
        torch.randn(4, 16, generator=g),
    )
    e = torch.tensor([3, 0, 3, 1, 2])
    want = torch.stack([w[e[p]] @ x[p] + b[e[p]] for p in range(5)])
    torch.testing.assert_close(moe_gemv_reference(x, w, e, b), want)
    torch.testing.assert_close(
        moe_gemv_reference(x, w.transpose(1, 2).contiguous(), e, b, transposed=True), want
    )
    g_, u = want.chunk(2, -1)
    torch.testing.assert_close(
        moe_glu_reference(x, w, e, b, "silu"), torch.nn.functional.silu(g_) * u
    )
    gi, ui = want[:, ::2].clamp(max=2.0), want[:, 1::2].clamp(-2.0, 2.0)
    torch.testing.assert_close(moe_glu_reference(x, w, e, b, "gpt_oss", True, False, 1.702, 2.0),
                               (ui + 1) * gi * torch.sigmoid(1.702 * gi))  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_gather_route_equals_transformers_block(family):
    """gpt-oss's block (router bias, softmax after top-k, clamped SwiGLU with the +1, expert
    biases) and Qwen3-MoE's through apply_experts' gather route equal transformers' own."""
    model = build(family)
    mlp = model.model.layers[0].mlp
    h = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = mlp(h)[0] if family == "gpt_oss" else mlp(h)
        got = gpt_oss_forward(mlp, h) if family == "gpt_oss" else moe_forward(mlp, h)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not usable(torch.device("cpu"), torch.float32)  # the kernel route is CUDA's


def test_rms_norm_modes_match_the_modules():
    """ROUND_ONCE is gpt-oss's and Gemma 4's norm, ONE_PLUS Gemma 3's, LLAMA Llama's."""
    import transformers

    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w = torch.randn(64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    cases = [(transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm(64, eps=1e-5), ROUND_ONCE),
             (transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm(64, eps=1e-6), ONE_PLUS),
             (transformers.models.gemma4.modeling_gemma4.Gemma4RMSNorm(64, eps=1e-6), ROUND_ONCE),
             (transformers.models.llama.modeling_llama.LlamaRMSNorm(64, eps=1e-6), LLAMA)]  # fmt: skip
    for norm, mode in cases:
        norm = norm.to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(w)
            want = norm(x)
        eps = getattr(norm, "eps", None) or norm.variance_epsilon
        torch.testing.assert_close(
            rms_norm_reference(x, norm.weight, eps, mode), want, rtol=1e-2, atol=1e-2
        )
