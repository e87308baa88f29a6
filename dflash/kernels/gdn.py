"""GatedDeltaNet pieces of the static (CUDA-graph) path in torch: capturable, and the reference.

A GatedDeltaNet layer (Qwen3-Next, Qwen3.5, Qwen3.6) keeps two states per sequence: a conv state
``[C, K]`` (the last K rows of the q|k|v projections before the depthwise causal conv, C = 2*Hk*Dk
+ Hv*Dv) and a float32 recurrent state ``[Hv, Dk, Dv]``. Per token t, with q, k L2-normalized,
q scaled by Dk**-0.5, decay ``g_t`` (log space, <= 0) and rate ``beta_t`` per value head:

    S <- S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S <- S + k_t delta^T;  o_t = S^T q_t

The static path keeps, per linear-attention layer, buffers of fixed shapes (W = the widest
verify):

- ``conv`` [C, K + W]: columns 0..K-1 the committed conv state, columns K.. the verify's rows;
- ``states`` [W + 1, Hv, Dk, Dv] float32: slot 0 the committed state, slot t the state after
  the verify's t-th token.

A verify (:func:`conv_verify`, :func:`recurrent_verify` or its Triton kernel in
:mod:`dflash.kernels.gdn_triton`) reads the committed slots and writes only the others, so it can
be replayed, padded or thrown away without touching what is committed; :func:`rollback` then
moves the state after n accepted tokens into the committed slots, with n a device tensor (a
gather, no host sync). A prefill (:func:`conv_prefill`, :func:`chunked_prefill`) writes the
committed slots from zero states.

The recurrence follows transformers' ``torch_recurrent_gated_delta_rule`` op for op (the one its
one-token decode runs), so in float32 on the CPU a verify's per-token states are those of decoding
the tokens one at a time. The chunked prefill computes the same states in chunks of 64 tokens
(a lower-triangular solve per chunk): equal to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # prefill tokens per chunk


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (transformers' and FLA's epsilon)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv_verify(conv: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                act) -> torch.Tensor:  # fmt: skip
    """Depthwise causal conv of a verify's rows after the committed conv state.

    Args:
        conv: [C, K + W] buffer; columns 0..K-1 read (the committed state), columns K..K+T-1
            written with ``rows``.
        rows: [T, C] the block's projections, T <= W.
        weight: [C, K] the conv's taps; bias: [C] or None; act: the activation (SiLU).

    Returns:
        [T, C] act(conv) in ``rows``' dtype (the conv in ``weight``'s dtype, as transformers).
    """
    t, k = rows.shape[0], weight.shape[1]
    conv[:, k : k + t].copy_(rows.transpose(0, 1))
    x = conv[:, : k + t].to(weight.dtype)[None]  # [1, C, K + T]
    out = F.conv1d(x, weight[:, None, :], bias, groups=weight.shape[0])[0, :, 1:]  # [C, T]
    return act(out).to(rows.dtype).transpose(0, 1)


def conv_prefill(conv: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 act) -> torch.Tensor:  # fmt: skip
    """Depthwise causal conv of a prompt's rows [T, C] from a zero state; writes the conv state
    (the last K rows, zero-padded) into ``conv[:, :K]``. Returns [T, C] as :func:`conv_verify`."""
    k = weight.shape[1]
    x = F.pad(rows.transpose(0, 1), (k, 0))  # [C, K + T]: zeros, then the rows
    conv[:, :k].copy_(x[:, -k:])
    out = F.conv1d(x.to(weight.dtype)[None], weight[:, None, :], bias, groups=weight.shape[0])[
        0, :, 1:
    ]
    return act(out).to(rows.dtype).transpose(0, 1)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            a_log: torch.Tensor, dt_bias: torch.Tensor):  # fmt: skip
    """The recurrence's float32 inputs from a layer's conv output and gates.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (Hv a multiple of Hk: each q/k head serves Hv/Hk
            consecutive value heads); a, b: [T, Hv] the decay and rate projections;
            a_log, dt_bias: [Hv] the layer's parameters.

    Returns:
        (q [T, Hv, Dk] normalized and scaled, k [T, Hv, Dk] normalized, v [T, Hv, Dv],
        g [T, Hv] log decay, beta [T, Hv]), float32.
    """
    rep = v.shape[1] // q.shape[1]
    beta = b.sigmoid().float()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    if rep != 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = l2norm(q.float()), l2norm(k.float()), v.float()
    return q / (q.shape[-1] ** 0.5), k, v, g, beta


def recurrent_verify(q, k, v, g, beta, states: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over a verify block, token by token (torch; capturable).

    Args:
        q, k: [T, Hv, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv] (float32, from :func:`prepare`).
        states: [W + 1, Hv, Dk, Dv] float32, T <= W: reads slot 0, writes slot t after token t.

    Returns:
        o [T, Hv, Dv] float32.
    """
    s = states[0]
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv = (s * k[t][:, :, None]).sum(dim=-2)
        delta = (v[t] - kv) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append((s * q[t][:, :, None]).sum(dim=-2))
        states[t + 1].copy_(s)
    return torch.stack(outs)


def chunked_prefill(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule over a prompt in chunks (eager; same states as the recurrence to
    float32 rounding).

    Within a chunk, with Gamma_t the decay accumulated from the chunk's start to t and S_0 the
    state before it, the rows u_t = beta_t (v_t - Gamma_t S_0^T k_t - sum_{s<t} Gamma_t/Gamma_s
    (k_t . k_s) u_s) solve one unit lower-triangular system; then o_t = Gamma_t S_0^T q_t +
    sum_{s<=t} Gamma_t/Gamma_s (q_t . k_s) u_s and the state after the chunk is
    Gamma_C S_0 + sum_s Gamma_C/Gamma_s k_s u_s^T.

    Args:
        q, k, v, g, beta: as :func:`recurrent_verify`, T any length.
        state: [Hv, Dk, Dv] float32, read (the state before the prompt) and overwritten with the
            state after it.

    Returns:
        o [T, Hv, Dv] float32.
    """
    s = state.clone()
    outs = []
    for lo in range(0, q.shape[0], chunk):
        qc, kc, vc = (x[lo : lo + chunk].transpose(0, 1) for x in (q, k, v))  # [H, C, D]
        gc, bc = g[lo : lo + chunk].transpose(0, 1), beta[lo : lo + chunk].transpose(0, 1)  # [H, C]
        n = qc.shape[1]
        cum = gc.cumsum(dim=-1)  # [H, C] log Gamma_t
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        ratio = (
            (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        )  # [H, C, C]
        gam = cum.exp()[:, :, None]  # [H, C, 1]
        strict = (kc @ kc.transpose(1, 2)) * ratio * bc[:, :, None]
        system = strict.masked_fill(
            lower.logical_not() | torch.eye(n, dtype=torch.bool, device=q.device), 0.0
        )
        system = system + torch.eye(n, dtype=q.dtype, device=q.device)
        rhs = bc[:, :, None] * (vc - gam * (kc @ s))  # [H, C, Dv]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outs.append((gam * (qc @ s) + ((qc @ kc.transpose(1, 2)) * ratio) @ u).transpose(0, 1))
        tail = (cum[:, -1:] - cum).exp()[:, :, None]  # [H, C, 1] Gamma_C / Gamma_s
        s = cum[:, -1].exp()[:, None, None] * s + (kc * tail).transpose(1, 2) @ u
    state.copy_(s)
    return torch.cat(outs)


def rollback(
    conv: torch.Tensor, states: torch.Tensor, keep: torch.Tensor, taps: torch.Tensor
) -> None:
    """Make the state after ``keep`` tokens of the last verify the committed one (in place).

    Args:
        conv: [L, C, K + W] every linear layer's conv buffer (``conv[..., :K]`` committed).
        states: [L, W + 1, Hv, Dk, Dv] every linear layer's recurrent slots (slot 0 committed).
        keep: [1] int64 on the device, 0 <= keep <= the verify's width (0: unchanged).
        taps: [K] int64 ``arange(K)`` on the device.

    Two gathers and two copies for all layers; no host sync.
    """
    k = taps.shape[0]
    conv[..., :k].copy_(conv.index_select(-1, keep + taps))
    states[:, 0].copy_(states.index_select(1, keep)[:, 0])
