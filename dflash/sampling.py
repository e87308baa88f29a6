"""Logits -> probabilities with temperature, top-k and top-p (brief §3.6), backend-free.

Works on numpy arrays (the backends hand over float32 logits when temperature > 0); the same
transform is applied to the target's and the draft's logits so rejection sampling stays exact.
"""

from __future__ import annotations

import numpy as np

from dflash.accept import accept_sampling, sample
from dflash.types import SamplingParams, TokenLogprob

__all__ = ["NumpySampler", "sample", "sampling_probs", "token_logprobs"]  # sample: in dflash.accept


def token_logprobs(logits: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-softmax (float32, natural log) of each row of logits [n, V] at tokens[i], with the
    ``top`` most likely ids of the row (ties: the lower id first). Masked entries (-inf) get
    -inf; ``top`` never lists them."""
    x = np.asarray(logits, dtype=np.float32).reshape(len(tokens), -1)
    peak = x.max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lp = x - (peak + np.log(np.exp(x - peak).sum(-1, keepdims=True)))
    out = []
    for row, tok in zip(lp, tokens, strict=True):
        best: list[tuple[int, float]] = []
        if top > 0:
            ids = np.argpartition(-row, min(top, row.shape[0] - 1))[:top]
            ids = sorted(ids.tolist(), key=lambda i: (-row[i], i))
            best = [(i, float(row[i])) for i in ids if np.isfinite(row[i])]
        out.append(TokenLogprob(int(tok), float(row[tok]), best))
    return out


def sampling_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Turn logits into the sampling distribution the target (or draft) draws from.

    Order: logits / T -> keep the top_k largest (0 = off) -> softmax -> keep the smallest
    prefix of tokens sorted by probability whose mass BEFORE each kept token is < top_p
    (the most likely token is always kept) -> renormalise.

    Args:
        logits: [..., V] float logits.
        params: temperature must be > 0 here (greedy never calls this).

    Returns:
        [..., V] float64 probabilities summing to 1 along the last axis.
    """
    assert params.temperature > 0, "sampling_probs is only for temperature > 0"
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k, axis=-1)[..., vocab - params.top_k, None]
        x = np.where(x >= kth, x, -np.inf)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        mass_before = np.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = mass_before < params.top_p
        keep_sorted[..., 0] = True
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


class NumpySampler:
    """Sampling + acceptance on the host (numpy, float64), for backends without a device
    sampler (see ``dflash.sampling_torch.TorchSampler`` for the torch one); same interface.

    Args:
        backend: the loop's backend (``to_list``/``to_numpy`` copy arrays to the host).
        params: sampling settings (temperature > 0).
    """

    def __init__(self, backend, params: SamplingParams):
        self.backend, self.params = backend, params
        self.rng = np.random.default_rng(params.seed)

    def first(self, logits) -> int:
        """Sample the token after prefill from logits [V]."""
        return sample(sampling_probs(self.backend.to_numpy(logits), self.params), self.rng)

    def accept(self, proposals, logits) -> tuple[int, int, list[int]]:
        """(a, bonus, proposals as a list) for proposals [n] (None: n = 0), logits [n + 1, V]."""
        props = self.backend.to_list(proposals)[0] if proposals is not None else []
        p_target = sampling_probs(self.backend.to_numpy(logits), self.params)
        return (*accept_sampling(props, p_target, None, self.rng), props)
