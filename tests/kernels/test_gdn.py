"""The GatedDeltaNet pieces of the static path (dflash.kernels.gdn, gdn_triton): the verify
recurrence with per-token states equals transformers' one-token decode step by step (float32,
bit for bit on the CPU), the chunked prefill equals the recurrence, the conv equals transformers'
conv update, the rollback gathers exactly the accepted prefix's state, and the Triton kernel
equals the torch reference under the interpreter."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dflash.kernels import gdn
from tests.helpers.kernels import run_interpreted

HK, HV, DK, DV = 2, 4, 16, 32


def inputs(t: int, seed: int = 0):
    """Random raw q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv], A_log, dt_bias [Hv]."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, HK, DK, generator=g), torch.randn(t, HK, DK, generator=g)
    v = torch.randn(t, HV, DV, generator=g)
    a, b = torch.randn(t, HV, generator=g), torch.randn(t, HV, generator=g)
    return q, k, v, a, b, torch.rand(HV, generator=g).log(), torch.rand(HV, generator=g)


def hf_step(q, k, v, a, b, a_log, dt_bias, state):
    """transformers' own one-token decode of the delta rule (Qwen3.5's modeling module)."""
    import torch.nn.functional as F
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    rep = v.shape[-2] // q.shape[-2]  # key heads repeated for the value heads, as the layer does
    q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=b.sigmoid()[None],
                                            initial_state=state, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)  # fmt: skip


def one_by_one(raw, start: torch.Tensor):
    """Decode the T tokens one at a time through transformers: (outputs [T, Hv, Dv], states
    after each token [T, Hv, Dk, Dv])."""
    state, outs, states = start[None], [], []
    for t in range(raw[0].shape[0]):
        o, state = hf_step(*(x[t : t + 1] for x in raw[:5]), *raw[5:], state)
        outs.append(o[0, 0])
        states.append(state[0])
    return torch.stack(outs), torch.stack(states)


def test_verify_equals_one_by_one_decoding_bit_for_bit():
    """The recurrence over 11 tokens equals 11 one-token decodes bit for bit. The inputs are
    prepared row by row here: torch's vectorized exp/sigmoid/softplus round a many-row tensor
    and a one-row tensor differently in the last bit (on the whole block: within 2e-7)."""
    w, t = 16, 11
    raw = inputs(t)
    slots = torch.zeros(w + 1, HV, DK, DV)
    slots[0] = torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(5))
    start = slots[0].clone()
    rows = [gdn.prepare(*(x[i : i + 1] for x in raw[:5]), *raw[5:]) for i in range(t)]
    o = gdn.recurrent_verify(*(torch.cat(parts) for parts in zip(*rows, strict=True)), slots)
    want_o, want_states = one_by_one(raw, start)
    assert torch.equal(o, want_o)
    assert torch.equal(slots[1 : t + 1], want_states)
    assert torch.equal(slots[0], start) and not slots[t + 1 :].any()  # committed slot untouched
    whole = slots.clone()
    torch.testing.assert_close(
        gdn.recurrent_verify(*gdn.prepare(*raw), whole), want_o, rtol=0, atol=2e-7
    )


def test_chunked_prefill_equals_the_recurrence():
    """Over 150 tokens (three chunks, the last partial) from a nonzero state: outputs and the
    final state as the token-by-token recurrence, to float32 rounding."""
    t = 150
    prepared = gdn.prepare(*inputs(t, seed=1))
    start = torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(2)) * 0.1
    slots = torch.zeros(t + 1, HV, DK, DV)
    slots[0] = start
    want = gdn.recurrent_verify(*prepared, slots)
    state = start.clone()
    got = gdn.chunked_prefill(*prepared, state)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, slots[t], rtol=1e-4, atol=1e-4)
    assert (
        state - slots[t - 1]
    ).abs().max() > 1e-2  # the tolerance tells neighbouring tokens apart


def test_conv_equals_transformers_conv_update():
    """The verify conv after a committed state equals transformers' causal_conv1d_update (which
    also leaves the last K rows as the new state); the prefill conv its causal_conv1d_fn."""
    import torch.nn.functional as F
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update

    c, k, w, t = 24, 4, 16, 5
    g = torch.Generator().manual_seed(3)
    weight, rows, state = (
        torch.randn(c, k, generator=g),
        torch.randn(t, c, generator=g),
        torch.randn(c, k, generator=g),
    )
    buf = torch.zeros(c, k + w)
    buf[:, :k] = state
    got = gdn.conv_verify(buf, rows, weight, None, F.silu)
    hf_state = state[None].clone()
    want = causal_conv1d_update(rows.T[None], hf_state, weight, None, activation="silu")[0].T
    assert torch.equal(got, want)
    assert torch.equal(
        buf[:, t : t + k], hf_state[0]
    )  # the state after the block: columns T..T+K-1
    buf2 = torch.zeros(c, k + w)
    got = gdn.conv_prefill(buf2, rows, weight, None, F.silu)
    torch.testing.assert_close(
        got, causal_conv1d_fn(rows.T[None], weight, None, activation="silu")[0].T
    )
    assert torch.equal(buf2[:, :k], F.pad(rows.T, (k - t, 0)) if t < k else rows.T[:, -k:])


def test_rollback_gathers_the_accepted_prefix():
    """After a verify of T tokens, keep = n makes slot n and conv columns n..n+K-1 committed, for
    every layer at once; keep = 0 leaves everything as it was."""
    layers, c, k, w = 3, 8, 4, 6
    g = torch.Generator().manual_seed(4)
    taps = torch.arange(k)
    for n in (0, 2, 6):
        conv, states = (
            torch.randn(layers, c, k + w, generator=g),
            torch.randn(layers, w + 1, HV, DK, DV, generator=g),
        )
        want_conv, want_state = conv[..., n : n + k].clone(), states[:, n].clone()
        gdn.rollback(conv, states, torch.tensor([n]), taps)
        assert torch.equal(conv[..., :k], want_conv) and torch.equal(states[:, 0], want_state)


KERNEL_CHECK = """
import torch
from dflash.kernels import gdn
from dflash.kernels.gdn_triton import fits, gdn_verify
from tests.kernels.test_gdn import inputs, HK, HV, DK, DV
assert fits(DK, DV, torch.device("cpu"))
for t, dtype in ((1, torch.float32), (7, torch.float32), (16, torch.float32)):
    q, k, v, a, b, a_log, dt_bias = inputs(t, seed=t)
    a[0, 0], a[-1, -1] = 30.0, -15.0  # softplus's branches
    x = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), -1).to(dtype).T.contiguous().T
    a, b = a.to(dtype), b.to(dtype)
    ref = torch.zeros(17, HV, DK, DV)
    ref[0] = torch.randn(HV, DK, DV) * 0.3
    got = ref.clone()
    xq, xk, xv = x.split((HK * DK, HK * DK, HV * DV), -1)
    prepared = gdn.prepare(xq.view(t, HK, DK), xk.view(t, HK, DK), xv.view(t, HV, DV), a, b, a_log, dt_bias)
    want = gdn.recurrent_verify(*prepared, ref)
    out = gdn_verify(x, a, b, a_log, dt_bias, got, HK)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], ref[0]) and not got[t + 1:].any()
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_equals_the_reference_interpreted():
    """The fused kernel (inputs' preparation and recurrence) equals prepare + recurrent_verify
    in float32, softplus's branches included (the interpreter rounds float32 to bf16 by
    truncation, unlike the GPU: bf16 is checked by scripts/gpu_check_hybrid.py)."""
    out = run_interpreted(KERNEL_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


NORMS_CHECK = """
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated
from dflash.kernels.gdn_norms import centred_rms_norm, gated_rms_norm
g = torch.Generator().manual_seed(0)
norm = Qwen3_5RMSNorm(48, eps=1e-6)
with torch.no_grad():
    norm.weight.copy_(torch.randn(48, generator=g) * 0.1)
wide = torch.randn(1, 5, 3 * 48 + 7, generator=g)
x = wide[..., 7 : 7 + 48]  # rows of a wider tensor
heads = wide[..., 7:].view(1, 5, 3, 48)  # per-head rows
with torch.no_grad():
    torch.testing.assert_close(centred_rms_norm(norm, x), norm(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(centred_rms_norm(norm, heads), norm(heads), rtol=1e-6, atol=1e-6)
gated = Qwen3_5RMSNormGated(16, eps=1e-6)
with torch.no_grad():
    gated.weight.copy_(torch.rand(16, generator=g) + 0.5)
o = torch.randn(5, 4, 16, generator=g)
z = torch.randn(5, 4 * 16 + 9, generator=g)[:, 9:].view(5, 4, 16)
with torch.no_grad():
    want = gated(o.reshape(-1, 16), z.reshape(-1, 16))
    torch.testing.assert_close(gated_rms_norm(gated, o, z), want, rtol=1e-6, atol=1e-6)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_hybrid_norm_kernels_equal_the_modules_interpreted():
    """The centred and gated RMSNorm kernels (dflash.kernels.gdn_norms) equal transformers'
    Qwen3.5 modules on rows of wider tensors and per-head rows (float32, interpreted)."""
    out = run_interpreted(NORMS_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
