"""Sampling at temperature > 0 on the backend's device (torch), seeded, one host sync per step.

The same transform and acceptance rule as :mod:`dflash.sampling` / :mod:`dflash.accept` (brief
§3.4-§3.6), written as torch ops so no full-vocabulary row leaves the device: temperature,
top-k, top-p, the acceptance test of each proposal (q one-hot at the draft's argmax proposals,
so proposal d_i is accepted with probability p_i(d_i)), and the residual draw on the first
rejection. Every uniform draw comes from one ``torch.Generator`` on the device seeded with
``SamplingParams.seed``. The numpy versions stay the reference the tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash.types import SamplingParams


def sampling_probs_torch(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> float32 probabilities [..., V] (same rule as ``sampling_probs``).

    Order: / T -> keep the top_k largest (ties kept) -> softmax -> keep the smallest prefix of
    tokens sorted by probability whose mass before each kept token is < top_p (the most likely
    token always kept) -> renormalise.
    """
    assert params.temperature > 0, "sampling_probs_torch is only for temperature > 0"
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
        keep_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < params.top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum(dim=-1, keepdim=True)
    return p


class TorchSampler:
    """Seeded sampling + lossless acceptance on one torch device.

    Args:
        params: sampling settings (temperature > 0).
        device: where logits live; the generator is created there.
    """

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device)
        if params.seed is None:
            self.gen.seed()
        else:
            self.gen.manual_seed(params.seed)

    def first(self, logits: torch.Tensor) -> int:
        """Sample the token after prefill from logits [V] (one host sync)."""
        p = sampling_probs_torch(logits, self.params)
        return int(torch.multinomial(p, 1, generator=self.gen).item())

    def accept(
        self, proposals: torch.Tensor | None, logits: torch.Tensor
    ) -> tuple[int, int, list[int]]:
        """Rejection sampling over one block (q one-hot at each proposal), one host sync.

        Args:
            proposals: [n] int64 draft tokens d_0..d_{n-1} (None or empty for n = 0).
            logits: [n + 1, V] target logits; row i follows [anchor, d_0 .. d_{i-1}].

        Returns:
            (a, bonus, proposals as a host list): a accepted proposals and the bonus token are
            distributed exactly as sequential sampling from the target (Leviathan et al. 2023;
            brief §3.5).
        """
        p = sampling_probs_torch(logits, self.params)  # [n+1, V]
        n = 0 if proposals is None else int(proposals.shape[0])
        props = (proposals if n else p.new_zeros(0)).to(device=p.device, dtype=torch.long)
        u = torch.rand(n, generator=self.gen, device=p.device, dtype=p.dtype) if n else None
        a, bonus = accept_one_hot(props, p, u, self._multinomial)
        host = torch.cat((a.view(1), bonus, props)).tolist()  # the one sync
        return int(host[0]), int(host[1]), host[2:]

    def accept_candidates(self, proposals: torch.Tensor, logits: torch.Tensor, candidates: torch.Tensor,
                          q: torch.Tensor) -> tuple[int, int, list[int]]:  # fmt: skip
        """Rejection sampling for a DFlash2 draft's proposals (q over its candidates), one host
        sync: :func:`accept_candidates` with the sampler's uniforms and draws.

        Args:
            proposals: [n] int64 (n >= 1); logits: [n + 1, V] target logits.
            candidates: [n, k] candidate ids; q: [n, k] the selector's probabilities of them.
        """
        p = sampling_probs_torch(logits, self.params)  # [n+1, V]
        n = int(proposals.shape[0])
        props = proposals.to(device=p.device, dtype=torch.long)
        u = torch.rand(n, generator=self.gen, device=p.device, dtype=p.dtype)
        a, bonus = accept_candidates(props, p, candidates.to(p.device), q.to(p.device, p.dtype), u,
                                     self._multinomial)  # fmt: skip
        host = torch.cat((a.view(1), bonus, props)).tolist()  # the one sync
        return int(host[0]), int(host[1]), host[2:]

    def _multinomial(self, weights: torch.Tensor) -> torch.Tensor:
        """One id [1] drawn from weights [V] (not normalised) with the sampler's generator."""
        return torch.multinomial(weights, 1, generator=self.gen)


def accept_one_hot(
    props: torch.Tensor, p: torch.Tensor, u: torch.Tensor | None,
    draw: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dflash.accept.accept_sampling` with q one-hot at each proposal, as device ops (no
    host sync): proposal d_i is accepted when u_i < p_i(d_i); on the first rejection the bonus
    is drawn from p_i with d_i removed (p_i itself when that has no mass), else from p_n.

    Args:
        props: [n] int64 draft tokens on p's device (n >= 0).
        p: [n + 1, V] processed target probabilities; row i follows [anchor, d_0 .. d_{i-1}].
        u: [n] the accept tests' uniforms in [0, 1), dtype of p (None when n = 0).
        draw: weights [V] (>= 0, mass > 0, not normalised) -> [1] int64 token id drawn from
            them: ``torch.multinomial`` with the sampler's generator, or a fixed draw in tests.

    Returns:
        (a, bonus): a [] int64 accepted proposals, bonus [1] int64 (device tensors).
    """
    n = int(props.shape[0])
    if n == 0:
        return torch.zeros((), dtype=torch.long, device=p.device), draw(p[0])
    p_d = p[:n].gather(1, props[:, None])[:, 0]  # [n] p_i(d_i)
    a = (u < p_d).to(torch.int64).cumprod(0).sum()  # leading accepts (device scalar)
    row = p.index_select(0, a.view(1))[0]  # [V] p_a
    d = torch.cat((props, props[:1])).index_select(0, a.view(1))  # d_a (unused when a = n)
    drop = torch.zeros_like(row).scatter(0, d, (a < n).to(row.dtype).view(1))
    residual = row * (1 - drop)  # p_a with d_a removed on a rejection
    residual = torch.where(residual.sum() > 0, residual, row)
    return a, draw(residual)


def accept_candidates(
    props: torch.Tensor, p: torch.Tensor, candidates: torch.Tensor, q: torch.Tensor,
    u: torch.Tensor, draw: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`dflash.accept.accept_sampling_candidates` as device ops (no host sync): proposal
    d_i is accepted when u_i * q_i(d_i) < p_i(d_i), q_i(d) summed over the candidate slots
    holding d; on the first rejection the bonus is drawn from max(p_i - q_i, 0), q subtracted
    at the candidate ids only (p_i itself when that has no mass), else from p_n.

    Args:
        props: [n] int64 proposals (n >= 1); p: [n + 1, V] processed target probabilities.
        candidates: [n, k] int64 candidate ids; q: [n, k] their probabilities (dtype of p).
        u: [n] the accept tests' uniforms in [0, 1); draw: as :func:`accept_one_hot`.

    Returns:
        (a, bonus): a [] int64 accepted proposals, bonus [1] int64 (device tensors).
    """
    n = int(props.shape[0])
    p_d = p[:n].gather(1, props[:, None])[:, 0]  # [n]
    q_d = (q * (candidates == props[:, None])).sum(-1)  # [n]
    a = (u * q_d < p_d).to(torch.int64).cumprod(0).sum()
    row = p.index_select(0, a.view(1))[0]  # [V] p_a
    at = a.clamp(max=n - 1).view(1)  # the rejected row (when a < n)
    q_a, c_a = q.index_select(0, at)[0], candidates.index_select(0, at)[0]  # [k]
    sub = torch.zeros_like(row).scatter_add(0, c_a, q_a * (a < n).to(row.dtype))
    residual = (row - sub).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, row)
    return a, draw(residual)
