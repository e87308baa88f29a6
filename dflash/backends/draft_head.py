"""The draft's LM head in torch, over the full vocabulary or a draft vocabulary.

See :mod:`dflash.models.draft_vocab` for what a draft vocabulary is and why it is lossless.
With one, the head's weight is a gathered copy of the Vd kept rows of the target's LM head
([Vd, H], made once when the backend is built), proposals map back to target ids, and logits
for sampling are scattered into a full [R, V] row of -inf (q = 0 outside the draft vocabulary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DraftHead:
    """The draft's LM head: ``logits`` and ``propose`` over rows of draft hidden states.

    Args:
        lm_head: the target's output embeddings (``nn.Linear``-like: ``weight`` [V, H], optional
            ``bias`` [V]).
        token_ids: the draft vocabulary (sorted target ids), or None for the full vocabulary.
    """

    def __init__(self, lm_head, token_ids: list[int] | None):
        self.lm_head = lm_head
        self.vocab = lm_head.weight.shape[0]
        self.ids = None
        self.folded: torch.Tensor | None = None  # see fold_norm
        if token_ids is not None:
            w = lm_head.weight
            self.ids = torch.tensor(token_ids, dtype=torch.long, device=w.device)  # [Vd]
            self.weight = w.detach().index_select(0, self.ids).contiguous()  # [Vd, H]
            b = getattr(lm_head, "bias", None)
            self.bias = None if b is None else b.detach().index_select(0, self.ids).contiguous()

    FOLD_MAX_BYTES = 256 << 20  # a folded copy of a larger head is not kept (memory)

    def fold_norm(self, norm_weight: torch.Tensor) -> None:
        """Keep ``folded`` [Vd, H]: the head's weight times a final RMSNorm's weight [H], so that
        :meth:`argmax_folded` takes rows *before* that norm: argmax(norm(h) W^T) =
        argmax(h (W * w)^T), as the norm only adds a positive per-row scale (rounding aside, so
        a near-tie may go either way: the target verifies). Not for a head with a bias, nor one
        whose copy would exceed :attr:`FOLD_MAX_BYTES`."""
        w = self.lm_head.weight if self.ids is None else self.weight
        if getattr(self.lm_head, "bias", None) is not None or w.numel() * w.element_size() > self.FOLD_MAX_BYTES:
            return
        self.folded = (w.detach().float() * norm_weight.detach().float()).to(w.dtype).contiguous()

    def argmax_folded(self, h: torch.Tensor, argmax) -> torch.Tensor:
        """Un-normed rows h [R, H] -> greedy proposals [R] (target ids) through ``folded``;
        ``argmax`` is the row argmax to use ([R, Vd] -> [R])."""
        return self.to_target(argmax(F.linear(h, self.folded)))

    @classmethod
    def for_draft(cls, lm_head, draft, use_vocab: bool = True) -> DraftHead:
        """The head for ``draft``: its ``draft_vocab`` (set by ``DFlashDraft.load``) when
        ``use_vocab`` (the ``draft_vocab`` setting of
        :class:`~dflash.kernels.settings.KernelSettings`)."""
        ids = getattr(draft, "draft_vocab", None)
        return cls(lm_head, ids if ids is not None and use_vocab else None)

    @property
    def size(self) -> int:
        """Vd: the rows the head scores (V without a draft vocabulary)."""
        return self.vocab if self.ids is None else self.ids.shape[0]

    def small_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> logits [..., Vd] over the draft vocabulary (the full head without one)."""
        if self.ids is None:
            return self.lm_head(h)
        return F.linear(h, self.weight, self.bias)

    def to_target(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary -> target token ids (same shape)."""
        return idx if self.ids is None else self.ids[idx]

    def widen(self, small: torch.Tensor) -> torch.Tensor:
        """logits [R, Vd] -> [R, V]: -inf outside the draft vocabulary (q = 0 there)."""
        if self.ids is None:
            return small
        full = small.new_full((small.shape[0], self.vocab), float("-inf"))
        return full.index_copy_(1, self.ids, small)

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [R, H] -> (greedy proposals [R] target ids, logits [R, V])."""
        small = self.small_logits(h)
        return self.to_target(small.argmax(-1)), self.widen(small)
