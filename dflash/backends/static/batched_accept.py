"""The per-row acceptance and commit of a batched speculative step, on the device (graphable).

The rule is :mod:`dflash.accept`'s, applied to every row of a batch at once: greedy rows keep the
longest prefix of proposals equal to the target's argmax plus the bonus token
(:func:`~dflash.accept.greedy_step`); sampled rows accept proposal d_i with probability p_i(d_i)
(the draft's proposals are its argmax, so q is one-hot) and on the first rejection draw the bonus
from p_i with d_i removed (:func:`~dflash.accept.accept_sampling` with ``q_draft=None``). Each
row's verify width is the step's width trimmed to its budget (:func:`~dflash.accept.verify_width`),
and its tokens end after the first stop token (:func:`~dflash.accept.commit_tokens`).
Uniforms come from the caller (each row's own seeded generator), ``W + 1`` per row: one per
proposal tested, then the bonus draw's, as :class:`~dflash.accept.Uniforms`.
"""

from __future__ import annotations

import torch


def row_probs(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor | None = None,
              top_p: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Float32 probabilities [R, V] of logits [R, V] under each row's temperature [R] (> 0 where
    used), top-k [R] (0 = off, ties kept) and top-p [R] (1 = off): the order and rule of
    :func:`dflash.sampling_torch.sampling_probs_torch`, one setting per row."""
    x = logits.float() / temp.clamp(min=1e-6)[:, None]
    vocab = x.shape[-1]
    if top_k is not None:
        k = top_k.clamp(min=1, max=vocab)
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])  # [R, 1]
        x = torch.where((top_k[:, None] > 0) & (x < kth), float("-inf"), x)
    p = torch.softmax(x, dim=-1)
    if top_p is not None:
        sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
        keep_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p[:, None]
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def accept_rows(logits: torch.Tensor, props: torch.Tensor, lim: torch.Tensor,
                sampled: dict | None = None, best: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Accepted proposals and bonus token of every row.

    Args:
        logits: [R, W, V] target logits of the rows [anchor, props[:, :W-1]].
        props: [R, >= W-1] int64 proposals.
        lim: [R] int64 proposals that may be accepted (the row's trimmed width - 1, >= 0).
        sampled: None (every row greedy) or {"temp" [R] (0 = greedy row), "unif" [R, W + 1]
            uniforms in [0, 1), "top_k" [R] | None, "top_p" [R] | None}.
        best: [R, W] the greedy rows' target ids (None: ``logits.argmax(-1)``).

    Returns:
        (accepted [R] int64 in 0..lim, bonus [R] int64 token ids).
    """
    r, w, v = logits.shape
    best = logits.argmax(-1) if best is None else best  # [R, W]
    if w > 1:
        run = (props[:, : w - 1] == best[:, :-1]).long().cumprod(1).sum(1)
    else:
        run = torch.zeros(r, dtype=torch.long, device=logits.device)
    g_acc = torch.minimum(run, lim)
    g_bonus = best.gather(1, g_acc[:, None])[:, 0]
    if sampled is None:
        return g_acc, g_bonus
    temp, unif = sampled["temp"], sampled["unif"]
    tk, tp = sampled.get("top_k"), sampled.get("top_p")
    rep = lambda x: None if x is None else x.repeat_interleave(w)  # noqa: E731 - [R] -> [R * W]
    p = row_probs(logits.reshape(r * w, v), rep(temp), rep(tk), rep(tp)).view(r, w, v)
    if w > 1:
        pd = p[:, :-1].gather(2, props[:, : w - 1, None])[..., 0]  # [R, W-1] p_i(d_i)
        ok = (unif[:, : w - 1] < pd).long().cumprod(1).sum(1)
    else:
        ok = torch.zeros(r, dtype=torch.long, device=logits.device)
    s_acc = torch.minimum(ok, lim)
    row = p.gather(1, s_acc[:, None, None].expand(r, 1, v))[:, 0]  # [R, V] p_a
    rejected = s_acc < lim
    if w > 1:
        d = props[:, : w - 1].gather(1, s_acc.clamp(max=w - 2)[:, None])  # [R, 1]
        residual = torch.where(rejected[:, None], row.scatter(1, d, 0.0), row)
    else:
        residual = row
    total = residual.sum(1, keepdim=True)
    residual = torch.where(total > 0, residual, row)  # a residual without mass: p_a (accept.py)
    cdf = torch.cumsum(residual, 1)
    u = unif.gather(1, torch.full_like(lim, w)[:, None]) * cdf[:, -1:]
    s_bonus = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=v - 1)
    on = temp > 0
    return torch.where(on, s_acc, g_acc), torch.where(on, s_bonus, g_bonus)


def commit_rows(accepted: torch.Tensor, bonus: torch.Tensor, props: torch.Tensor, width: int,
                state: dict) -> None:  # fmt: skip
    """Commit each row's step in place (no host sync).

    Args:
        accepted, bonus: [R] from :func:`accept_rows`.
        props: [R, >= width-1] the proposals verified.
        width: W, the step's verify width.
        state: the rows' tensors, [R] int64 unless noted: ``tok`` anchor token, ``pos`` its
            position, ``n`` tokens generated, ``limit`` budget, ``live``/``done`` bool [R],
            ``stops`` [R, S] each row's stop ids (-1 = none), ``last`` [R, 1 + W'] (W' >= W) written with the
            step's count then its tokens (zero-padded). A row not live, done or out of budget
            commits nothing and moves nothing.
    """
    tok, pos, n, limit, live, done = (
        state[k] for k in ("tok", "pos", "n", "limit", "live", "done")
    )
    r = accepted.shape[0]
    ar = torch.arange(width, device=accepted.device)[None]  # [1, W]
    if width > 1:
        ext = torch.cat((props[:, : width - 1], props[:, :1]), 1)  # [R, W]
    else:
        ext = torch.zeros(r, 1, dtype=torch.long, device=accepted.device)
    committed = torch.where(ar < accepted[:, None], ext, 0).scatter(
        1, accepted[:, None], bonus[:, None]
    )
    is_stop = (committed[:, :, None] == state["stops"][:, None, :]).any(-1) & (
        ar <= accepted[:, None]
    )
    any_stop = is_stop.any(1)
    first = torch.where(any_stop, is_stop.float().argmax(1), width)
    count = torch.minimum(accepted + 1, first + 1)
    act = live & ~done & (limit > n)
    count = torch.where(act, count, 0)
    last = state["last"]
    last[:, :1].copy_(count[:, None])
    last[:, 1 : 1 + width].copy_(committed)
    tok.copy_(torch.where(act, bonus, tok))
    pos.add_(count)
    n.add_(count)
    done.copy_(done | (act & (any_stop | (n >= limit))))
