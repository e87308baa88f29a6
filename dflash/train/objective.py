"""What one training step computes: online target features, the draft forward over sampled
blocks, the decayed cross-entropy through the frozen LM head, and the acceptance estimate.

Brief §8: the target's embedding and LM head are shared and frozen (never stored in the draft);
features at ``target_layer_ids`` come from one no-grad target forward per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflash.train.masks import build_blocks, layer_masks

IGNORE = -100


class FrozenTarget:
    """The target as training sees it: features, a raw embedding lookup and the LM head.

    Args:
        model: HF causal LM (any dtype), put in eval mode with every parameter frozen.
        target_layer_ids: the draft's ``target_layer_ids`` (HF ``hidden_states[L + 1]``).
    """

    def __init__(self, model: Any, target_layer_ids: list[int]):
        self.model = model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.body = model.get_decoder() if hasattr(model, "get_decoder") else model
        self.embed = model.get_input_embeddings().weight  # [V, H]
        self.head = model.get_output_embeddings().weight  # [V, H] (tied or not)
        self.layer_ids = [i + 1 for i in target_layer_ids]

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Concatenated hidden states [B, S, F] (target dtype) of a right-padded batch."""
        out = self.body(input_ids=input_ids, attention_mask=attention_mask,
                        output_hidden_states=True, use_cache=False)  # fmt: skip
        return torch.cat([out.hidden_states[i] for i in self.layer_ids], dim=-1)


class _HeadCrossEntropy(torch.autograd.Function):
    """Weighted CE through a frozen head, chunked; the input gradient is formed in forward, so
    no [M, V] logits are kept for backward."""

    @staticmethod
    def forward(ctx, h, weight, labels, w, chunk: int):
        m = h.shape[0]
        need_grad = h.requires_grad
        grad = torch.empty_like(h) if need_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.empty(m, dtype=torch.bool, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for lo in range(0, m, chunk):
                hi = min(m, lo + chunk)
                loss -= _ce_chunk(h[lo:hi], weight, labels[lo:hi], w[lo:hi], correct[lo:hi],
                                  grad[lo:hi] if need_grad else None)  # fmt: skip
        ctx.save_for_backward(grad if need_grad else torch.empty(0))
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, g_loss, _g_correct):
        (grad,) = ctx.saved_tensors
        return grad * g_loss, None, None, None, None


def _ce_chunk(h, weight, labels, w, correct_out, grad_out) -> torch.Tensor:
    """One chunk of :class:`_HeadCrossEntropy` in fewer passes over the [c, V] logits: argmax of
    the head-dtype logits (the float32 copy has the same values), one fused float32
    log-softmax, the softmax from it in place, and the weighted gradient cast on the way out.
    Writes ``correct_out`` [c] and ``grad_out`` [c, H] (when given); returns -sum_i w_i
    log p_i(label_i) (float32 scalar)."""
    raw = h.to(weight.dtype) @ weight.T  # [c, V] in the head's dtype
    correct_out.copy_(raw.argmax(-1) == labels)
    logp = torch.log_softmax(raw, dim=-1, dtype=torch.float32)
    del raw
    picked = (logp.gather(1, labels[:, None]).squeeze(1) * w).sum()
    if grad_out is not None:
        p = logp.exp_()  # softmax
        p[torch.arange(p.shape[0], device=p.device), labels] -= 1.0
        pw = torch.empty(p.shape, dtype=weight.dtype, device=p.device)
        torch.mul(p, w[:, None], out=pw)
        del p, logp
        grad_out.copy_(pw @ weight)
    return picked


def head_cross_entropy(h: torch.Tensor, head: torch.Tensor, labels: torch.Tensor,
                       weights: torch.Tensor, chunk: int = 8192):  # fmt: skip
    """Loss = sum_i w_i CE(h_i @ head^T, label_i) / sum_i w_i, without storing [M, V] logits.

    Args:
        h: [M, H] draft outputs of supervised slots (any float dtype).
        head: [V, H] frozen LM head weight.
        labels: [M] int64 target tokens; weights: [M] float32 slot weights (> 0).
        chunk: rows per logits chunk (memory: chunk x V x 4 bytes, twice).

    Returns:
        (loss scalar float32, correct [M] bool = argmax equals label).
    """
    w = weights / weights.sum().clamp(min=1e-12)
    return _HeadCrossEntropy.apply(h, head, labels, w, chunk)


@dataclass
class StepOutput:
    """Loss and detached statistics of one batch (tensors stay on device until logged)."""

    loss: torch.Tensor
    accuracy: torch.Tensor  # weighted share of slots whose argmax equals the label
    accept: torch.Tensor  # mean over blocks of 1 + leading correct slots (a training tau proxy)
    blocks: torch.Tensor  # int64: kept blocks of this batch (this rank's part under data parallelism)
    weight: torch.Tensor | None = None  # float32 sum of the slot weights the loss averages over
    grad_norm: torch.Tensor | None = None  # total gradient norm before clipping (set by the step)
    selector: torch.Tensor | None = None  # DFlash2: the selector loss's part of ``loss`` (this rank's)


def draft_hidden(draft, target: FrozenTarget, input_ids, attention_mask, loss_mask, anchors,
                 keep, *, flex: bool = False, gamma: float | None = None, runner=None):  # fmt: skip
    """Run the draft over the blocks opened at ``anchors``.

    Args:
        input_ids, attention_mask: [B, S] int64 right-padded batch; loss_mask: [B, S] bool.
        anchors, keep: [B, N] (see :func:`dflash.train.masks.sample_anchors`).
        flex: use a FlexAttention BlockMask instead of a dense bool mask.
        runner: the module whose call runs the draft (e.g. its DistributedDataParallel
            wrapper, so that backward syncs gradients); None: ``draft`` itself.

    Returns:
        (h [B, N*L, H] final-normed draft states, blocks dict of :func:`build_blocks`).
    """
    cfg = draft.config
    b, s = input_ids.shape
    feats = target.features(input_ids, attention_mask)  # [B, S, F]
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, cfg.block_size,
                          cfg.mask_token_id, gamma)  # fmt: skip
    emb = target.embed[blocks["block_ids"]]  # [B, N*L, H] raw lookup (brief §1.4)
    if torch.is_autocast_enabled(emb.device.type):
        emb = emb.float()  # keep the residual stream in float32 under autocast
    ctx_pos = torch.arange(s, device=input_ids.device)[None].expand(b, s)
    masks = layer_masks(cfg, anchors, s, flex=flex)
    packed = {"packed": True} if getattr(draft, "is_dflash2", False) else {}  # block-wise convolutions
    h = (runner or draft)(emb, feats, blocks["q_pos"], ctx_pos, masks=masks, **packed)
    return h, blocks


def batch_loss(draft, target: FrozenTarget, batch: dict, *, flex: bool = False,
               gamma: float | None = None, chunk: int = 8192, runner=None,
               selector_weight: float = 1.0) -> StepOutput:  # fmt: skip
    """Forward one batch and return the weighted loss with its statistics (see StepOutput).

    A DFlash2 draft: the token loss is taken on its logits times ``output_multiplier`` (its soft
    cap, monotone, is left out), and ``selector_weight`` x :func:`selector_loss` is added.

    A batch whose ``keep`` is all False (a data-parallel rank without a sequence this step) gives
    loss 0 and weight 0, and backward still reaches every draft parameter (zero gradients).

    Args:
        batch: ``input_ids``, ``attention_mask``, ``loss_mask``, ``anchors``, ``keep`` tensors;
            optionally ``rows``: [M] int64 indices of the slots with weight > 0 in the flattened
            [B*N*L] layout (:func:`supervised_rows`), so that no host sync finds them.
        runner: see :func:`draft_hidden`.
    """
    h, blocks = draft_hidden(draft, target, batch["input_ids"], batch["attention_mask"],
                             batch["loss_mask"], batch["anchors"], batch["keep"], flex=flex,
                             gamma=gamma, runner=runner)  # fmt: skip
    lsz = draft.config.block_size
    w = blocks["weights"].reshape(-1)  # [B*N*L]
    sel = batch.get("rows")  # the supervised slots, found on the host (no device sync)
    if sel is None:
        sel = (w > 0).nonzero().squeeze(1)  # a host sync
    rows_h = h.reshape(-1, h.shape[-1])[sel]
    dflash2 = getattr(draft, "is_dflash2", False)
    scale = float(draft.config.dflash2.output_multiplier) if dflash2 else 1.0
    loss, correct = head_cross_entropy(rows_h * scale if scale != 1.0 else rows_h, target.head,
                                       blocks["labels"].reshape(-1)[sel], w[sel], chunk)  # fmt: skip
    part = None
    if dflash2:
        part = selector_loss(draft, target, rows_h, sel, batch["input_ids"], batch["anchors"],
                             blocks["labels"].reshape(-1)[sel], w[sel], chunk)  # fmt: skip
        loss = loss + selector_weight * part
    hit = torch.zeros_like(w, dtype=torch.bool)
    hit[sel] = correct
    hit = hit.view(-1, lsz)[:, 1:]  # [B*N, L-1]
    w_sel = w[sel]
    wsum = w_sel.sum().float()
    kept = batch["keep"].reshape(-1)
    lead = hit.int().cumprod(dim=1).sum(dim=1).float()  # leading correct slots per block
    accept = 1.0 + (lead * kept).sum() / kept.sum().clamp(min=1)
    acc = (correct.float() * w_sel).sum() / wsum.clamp(min=1e-12)
    return StepOutput(loss, acc.detach(), accept.detach(), kept.sum(), wsum.detach(),
                      selector=None if part is None else part.detach())  # fmt: skip


def selector_loss(draft, target: FrozenTarget, h: torch.Tensor, rows: torch.Tensor,
                  input_ids: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor,
                  weights: torch.Tensor, chunk: int = 8192) -> torch.Tensor:  # fmt: skip
    """The DFlash2 candidate selector's loss (brief §4.2), teacher-forced.

    For each supervised slot k of a block the selector scores, as at inference, the draft's
    top-k candidates of that slot (unary: the processed draft logits, not trained by this loss)
    plus the pairwise edge from the previous token, here the true token at anchor + k - 1 (the
    anchor itself for k = 1: the walk's previous pick whenever the slots before were right,
    the only case acceptance reaches). The loss is the cross-entropy of picking the label among
    the candidates, over the slots whose label is a candidate (the others add 0), averaged with
    the token loss's slot weights (so data-parallel steps equal one step of the global batch).
    Gradients reach the selector and, through its hidden projection, the draft.

    Args:
        h: [M, H] draft states of the supervised slots (rows of the flattened [B*N*L] layout).
        rows: [M] their indices in that layout; input_ids: [B, S]; anchors: [B, N].
        labels: [M] int64; weights: [M] float32 slot weights (> 0).
        chunk: rows per logits chunk of the candidates' top-k (no gradient).

    Returns:
        float32 scalar (0 without rows, with zero gradients for every selector weight).
    """
    sel = draft.candidate_selector
    lsz, n, s = draft.config.block_size, anchors.shape[1], input_ids.shape[1]
    blk, slot = rows // lsz, rows % lsz
    prev_pos = (anchors.reshape(-1)[blk] + slot - 1).clamp(max=s - 1)
    prev = input_ids[blk // n, prev_pos]  # [M] the true previous token
    with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
        parts = [torch.topk(draft.process_logits(h[lo : lo + chunk].to(target.head.dtype) @ target.head.T),
                            sel.top_k, dim=-1) for lo in range(0, max(h.shape[0], 1), chunk)]  # fmt: skip
        unary = torch.cat([p.values for p in parts]).float()  # [M, k]
        cand = torch.cat([p.indices for p in parts])  # [M, k]
    hit = cand == labels[:, None]  # [M, k]
    hp = sel.hidden_projection(h).float()  # [M, r]
    edge = torch.einsum("mr,mkr->mk", sel.predecessor_codebook(prev).float() * hp,
                        sel.successor_codebook(cand).float())  # fmt: skip
    ce = torch.nn.functional.cross_entropy(unary + edge, hit.float().argmax(-1), reduction="none")
    w = weights / weights.sum().clamp(min=1e-12)
    return (ce * w * hit.any(-1)).sum()


def supervised_rows(input_ids, loss_mask, anchors, keep, block_size: int,
                    gamma: float | None = None) -> torch.Tensor:  # fmt: skip
    """Indices [M] int64 of the block slots that carry a label (weight > 0), in the flattened
    [B*N*L] layout of :func:`dflash.train.masks.build_blocks`; computed where the tensors are
    (the host, before the batch moves), so the step needs no sync to select them.

    Args:
        input_ids: [B, S] int64; loss_mask: [B, S] bool; anchors: [B, N] int64; keep: [B, N]
            bool (as :func:`batch_loss` gets them).
        block_size: L; gamma: the loss decay the step uses (None: the default for L).

    Returns:
        [M] int64, ascending; equal to ``(weights.reshape(-1) > 0).nonzero()`` of the step.
    """
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, block_size, 0, gamma)
    return (blocks["weights"].reshape(-1) > 0).nonzero().squeeze(1)


# ------------------------------------------------------------------------- acceptance estimate


def walk_acceptance(
    matches: list[list[bool]], block_size: int
) -> tuple[list[int], list[int], list[int]]:
    """Replay greedy speculative decoding of one response from per-anchor draft matches.

    Args:
        matches: for each response position s (anchor), ``matches[s - start][k - 1]`` says whether
            the draft's slot-k token equals the response token at s + k (k = 1..). Its length is
            the number of response tokens after the first (the anchor of the first step).
        block_size: L.

    Returns:
        (tau per verify step, attempts [L], hits [L]) where attempts[k]/hits[k] count how often
        slot k was reached (all earlier slots accepted) and accepted.
    """
    n_after = len(matches)  # response tokens that follow the first anchor
    attempts, hits = [0] * block_size, [0] * block_size
    steps: list[int] = []
    s = 0
    while s < n_after:
        remaining = n_after - s
        m = min(block_size - 1, remaining)
        a = 0
        while a < m and matches[s][a]:
            a += 1
        for k in range(1, min(a + 1, m) + 1):
            attempts[k] += 1
            hits[k] += int(k <= a)
        commit = min(a + 1, remaining)  # the response ends: no bonus past its last token
        steps.append(commit)
        s += commit
    return steps, attempts, hits


@torch.no_grad()
def estimate_acceptance(draft, target: FrozenTarget, seqs: list[tuple[list[int], int]], *,
                        pad_id: int, flex: bool = False, batch_size: int = 8,
                        autocast_dtype: torch.dtype | None = None) -> dict:  # fmt: skip
    """Greedy acceptance length τ of the draft on target responses, without the decode loop.

    Every response position is an anchor in one batched forward; greedy decoding is then replayed
    from the matches (exact when the response is the target's own greedy output, up to numerics).

    Args:
        seqs: (token ids, response start) pairs; the first response token is the first anchor.
        pad_id: padding id for batching.

    Returns:
        dict: ``tau`` (mean of per-response means, the benchmark convention), ``tau_pooled``,
        ``per_position`` (list, slot k = 1..L-1: P(accept k | 1..k-1 accepted)), ``responses``.
    """
    from dflash.train.data import collate

    lsz = draft.config.block_size
    dev = target.embed.device
    was_training = draft.training
    draft.eval()
    means, pooled, attempts, hits = [], [], [0] * lsz, [0] * lsz
    for lo in range(0, len(seqs), batch_size):
        part = [sq for sq in seqs[lo : lo + batch_size] if len(sq[0]) - sq[1] >= 2]
        if not part:
            continue
        ids, att, loss_mask = collate(part, pad_id)
        n = max(len(x) - 1 - st for x, st in part)
        anchors = torch.zeros(len(part), n, dtype=torch.long)
        keep = torch.zeros(len(part), n, dtype=torch.bool)
        for r, (x, st) in enumerate(part):
            anchors[r, : len(x) - 1 - st] = torch.arange(st, len(x) - 1)
            keep[r, : len(x) - 1 - st] = True
        with torch.autocast(dev.type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):  # fmt: skip
            h, _ = draft_hidden(draft, target, ids.to(dev), att.to(dev), loss_mask.to(dev),
                                anchors.to(dev), keep.to(dev), flex=flex)  # fmt: skip
        h = h.view(len(part), n, lsz, -1)[:, :, 1:]  # [B, N, L-1, H]
        if getattr(draft, "is_dflash2", False):  # the selector's greedy walk from each anchor
            pred = _walk_proposals(draft, target, h, ids.to(dev).gather(1, anchors.to(dev))).cpu()
        else:
            pred = torch.stack(
                [(h[:, :, k].to(target.head.dtype) @ target.head.T).argmax(-1) for k in range(lsz - 1)],
                dim=-1,
            ).cpu()  # [B, N, L-1]; sync
        for r, (x, st) in enumerate(part):
            xt = torch.tensor(x)
            rows = []
            for j, a in enumerate(range(st, len(x) - 1)):
                upto = min(lsz - 1, len(x) - 1 - a)
                rows.append((pred[r, j, :upto] == xt[a + 1 : a + 1 + upto]).tolist())
            steps, att_k, hit_k = walk_acceptance(rows, lsz)
            means.append(sum(steps) / len(steps))
            pooled.extend(steps)
            attempts = [x + y for x, y in zip(attempts, att_k, strict=True)]
            hits = [x + y for x, y in zip(hits, hit_k, strict=True)]
    draft.train(was_training)
    if not means:
        return {"tau": float("nan"), "tau_pooled": float("nan"), "per_position": [], "responses": 0}
    return {
        "tau": sum(means) / len(means),
        "tau_pooled": sum(pooled) / len(pooled),
        "per_position": [hits[k] / attempts[k] if attempts[k] else None for k in range(1, lsz)],
        "responses": len(means),
        "steps": len(pooled),
        "attempts": attempts[1:],
        "hits": hits[1:],
    }


def _walk_proposals(draft, target: FrozenTarget, h: torch.Tensor, anchor_ids: torch.Tensor,
                    blocks: int = 256) -> torch.Tensor:  # fmt: skip
    """A DFlash2 draft's greedy proposals (the selector's walk, as at inference) of every block.

    Args:
        h: [B, N, L-1, H] draft states; anchor_ids: [B, N] the anchors' tokens.
        blocks: blocks per chunk (memory: blocks x (L-1) x V logits).

    Returns:
        [B, N, L-1] int64 token ids.
    """
    b, n, t, hid = h.shape
    flat, anchors = h.reshape(b * n, t, hid), anchor_ids.reshape(-1)
    w = target.head

    def head(x):
        return x.to(w.dtype) @ w.T

    out = [draft.propose(flat[lo : lo + blocks], anchors[lo : lo + blocks], head)[0]
           for lo in range(0, b * n, blocks)]  # fmt: skip
    return torch.cat(out).view(b, n, t)


def merge_acceptance(parts: list[dict]) -> dict:
    """Pool several :func:`estimate_acceptance` results (per dataset) into one overall result."""
    parts = [p for p in parts if p.get("responses")]
    if not parts:
        return {"tau": float("nan"), "tau_pooled": float("nan"), "per_position": [], "responses": 0}
    n = sum(p["responses"] for p in parts)
    steps = sum(p["steps"] for p in parts)
    att = [sum(x) for x in zip(*(p["attempts"] for p in parts), strict=True)]
    hit = [sum(x) for x in zip(*(p["hits"] for p in parts), strict=True)]
    return {
        "tau": sum(p["tau"] * p["responses"] for p in parts) / n,
        "tau_pooled": sum(p["tau_pooled"] * p["steps"] for p in parts) / steps,
        "per_position": [h / a if a else None for h, a in zip(hit, att, strict=True)],
        "responses": n,
        "steps": steps,
        "attempts": att,
        "hits": hit,
    }
