"""Device-resident greedy steps for the static path: acceptance and commit on the GPU.

On the CUDA-graph path a speculative step is two graph replays (draft, verify) that take about
2 ms on the demo pair; the host work between them - reading the committed tokens, running the
acceptance in Python, writing the next anchor and positions into the graphs' inputs - used to
leave the GPU idle for a sizeable part of each step. Here the loop state (anchor token, its
position, tokens committed, the budget) lives in device tensors, the greedy acceptance and the
commit are captured in the verify graph, and the draft graph reads its anchor and context rows
from that state. The host only launches steps and reads what each one committed (pinned memory,
one event per step) while more work is queued behind it: the next step's draft by default,
the whole next step under the ``queue_ahead`` setting ``step`` and at block size 1. So the one host sync
per step does not stall the GPU, as long as the host queues the next verify within a draft's
time (about 0.17 ms on the demo pair) after reading a step.

Used by :func:`dflash.loop.speculative_generate` for greedy requests at a fixed block size on a
:class:`~dflash.backends.static.backend.StaticBackend` that has it (CUDA graphs; the
``device_loop`` setting turns it off). The committed tokens are exactly those of the host loop: the same graphs'
forwards, the same greedy prefix rule (paper §4 / brief §3.3), the same budget trimming. One
difference in kernels: the step that has a single token of budget left verifies at the padded
width instead of width 1 (same argmax up to bf16 rounding of that row).

What is queued while the host reads a step (the ``queue_ahead`` setting): at
block sizes > 1, by default only the next step's draft; the host queues that step's verify as
soon as it has read the tokens, while the draft runs (about 0.17 ms on the demo pair, against
tens of microseconds of host work). A request's last step is then followed by one wasted draft,
not by a wasted draft and verify: on the demo pair that was one step of about 1 ms in every
request of about 47 steps, 2% of DFlash's decode time but 0.5% of the block-1 baseline's (about
200 steps). ``step`` queues the whole next step, as before; block size 1 always does (it has no
draft to overlap the host's work with).

Work launched after the request's end (at most one step or draft, when a stop token or the
budget ends it earlier than the host could know) commits nothing: a step with no budget left
does not move the state, a draft only writes proposals, and their K/V and feature writes land
past the committed length, where the position masks hide them and the next request overwrites
them.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from dflash.backends.static.fused import row_argmax

RING = 4  # pinned host slots: at most two steps are in flight


def verify_inputs(tok, props, pos, arange, width: int):
    """The verify forward's inputs: ids [1, W] = [anchor, props[:W-1]], positions [1, W]."""
    return torch.cat((tok, props[: width - 1]))[None], (pos + arange[:width])[None]


def draft_inputs(tok, mask_ids, pos, arange):
    """The draft's block [1, L] = [anchor, mask * (L-1)] and its default context rows [L]: the
    last L committed rows, clamped at 0 for short prompts."""
    length = mask_ids.shape[0] + 1
    return torch.cat((tok, mask_ids))[None], (pos - length + arange[:length]).clamp(min=0)


def commit(logits, props, tok, pos, n, budget, lim, last, arange) -> None:
    """Greedy acceptance and commit of one verify step, in place (paper §4 / brief §3.3).

    logits [W, V] of the rows [anchor, props[:W-1]] (or already their argmax ids [W]); the
    longest prefix of proposals equal to
    the target's argmax, capped by ``lim`` and the budget left, plus the bonus token. Writes
    ``last`` [1 + L] (count, tokens, zero-padded), moves ``tok``/``pos``/``n`` [1]; a step with
    no budget left commits nothing and moves nothing. The committed tokens are those of
    :func:`dflash.accept.greedy_step` before its stop cut (the host cuts them when it reads
    them); tests/core/test_accept_equivalence.py checks this on random steps."""
    width = logits.shape[0]
    target = row_argmax(logits) if logits.dim() == 2 else logits  # [W]
    remaining = budget - n  # [1] tokens still allowed
    if width > 1:
        drafted = props[: width - 1]
        run = (drafted == target[:-1]).long().cumprod(0).sum()[None]  # [1] accepted prefix
        accepted = torch.minimum(run, torch.minimum(lim, (remaining - 1).clamp(min=0)))  # [1]
        rows = torch.cat((drafted, drafted[-1:]))  # [W]; row a gets the bonus below
    else:
        accepted = torch.zeros_like(n)
        rows = target
    bonus = target.gather(0, accepted)  # [1]
    live = remaining > 0
    committed = torch.where(arange[:width] < accepted, rows, 0).scatter(0, accepted, bonus)  # [W]
    step = torch.where(live, accepted + 1, 0)  # [1] tokens committed by this step
    last[:1].copy_(step)
    last[1 : 1 + width].copy_(committed)
    tok.copy_(torch.where(live, bonus, tok))
    pos.add_(step)
    n.add_(step)


class DeviceLoop:
    """Loop state and greedy step glue of one :class:`StaticBackend` (static caches).

    State (device, int64): ``tok`` [1] anchor token, ``pos`` [1] its position, ``n`` [1] tokens
    committed (the first token included), ``budget`` [1] tokens allowed, ``lim`` [1] proposals
    that may be accepted per step (block size - 1). ``props`` [L-1] holds the draft's proposals
    and ``last`` [1 + L] what the last step committed: the count, then the tokens (zero-padded).

    Args:
        be: the backend (its forwards, caches, draft block size L and mask token).
    """

    def __init__(self, be: Any):
        self.be = be
        dev = be.device
        width = max(be.draft_block_size, 1)
        self.width = width
        z = dict(dtype=torch.long, device=dev)
        self.tok, self.pos, self.n = (torch.zeros(1, **z) for _ in range(3))
        self.budget, self.lim = torch.zeros(1, **z), torch.zeros(1, **z)
        self.props = torch.zeros(max(width - 1, 1), **z)
        self.last = torch.zeros(1 + width, **z)
        self.arange = torch.arange(width + 1, **z)
        self.mask_ids = torch.full((max(width - 1, 1),), int(be.mask_token_id or 0), **z)
        pin = dev.type == "cuda"
        self.host = [torch.zeros(1 + width, dtype=torch.long, pin_memory=pin) for _ in range(RING)]
        self.events = [torch.cuda.Event() for _ in range(RING)] if pin else None
        self.launched = 0  # verifies queued (slots used), for tests and benchmarks
        self.drafted = 0  # drafts queued
        self.ahead = be.settings.queue_ahead  # "draft" or "step"
        self._compiled: dict[str, Any] = {}

    # -- glue captured in the graphs --------------------------------------------------------
    def verify_step(self, width: int, verify_fn) -> None:
        """Verify [anchor, props[:width-1]] at ``pos``, accept the longest greedy prefix (capped
        by ``lim`` and the budget), commit it plus the bonus token; writes ``last`` and moves the
        state (a hybrid target's GatedDeltaNet states too). No host sync."""
        ids, pos = self._glue("verify_inputs", verify_inputs)(self.tok, self.props, self.pos, self.arange, width)
        logits = verify_fn(ids, pos)  # [W, V]
        self._glue("commit", commit)(logits, self.props, self.tok, self.pos, self.n, self.budget,
                                     self.lim, self.last, self.arange)  # fmt: skip
        if self.be.gdn is not None:  # hybrids: the committed tokens' GatedDeltaNet states (a gather)
            self.be.gdn.rollback(self.last[:1])

    def draft_step(self, draft_fn, ctx_pos: torch.Tensor | None = None) -> None:
        """Draft a block of width L at ``pos`` from the anchor ``tok``; proposals go to
        ``props``. The draft reads the context rows ``ctx_pos``, by default the last L committed
        rows (clamped at 0 for short prompts: a row written twice gets the same values)."""
        block, window = self._glue("draft_inputs", draft_inputs)(self.tok, self.mask_ids, self.pos, self.arange)
        proposals, _ = draft_fn(block, self.pos, window if ctx_pos is None else ctx_pos)
        self.props.copy_(self.proposals_hook(proposals))

    def _glue(self, name: str, fn):
        """``fn`` as it runs in the graphs: compiled with the backend's forwards (one or two
        fused kernels instead of about 25 small ones per step, ~2.5 us each in a graph), else
        eager. The ``compile_glue`` setting off keeps it eager (side-by-side timing)."""
        if not (self.be.compile and self.be.settings.compile_glue):
            return fn
        if name not in self._compiled:
            self._compiled[name] = torch.compile(fn, dynamic=False)
        return self._compiled[name]

    def proposals_hook(self, proposals: torch.Tensor) -> torch.Tensor:
        """The draft's proposals [L-1] as verified (identity; a benchmark may script them)."""
        return proposals

    # -- host side ------------------------------------------------------------------------
    def begin(self, first: torch.Tensor, start: int, block_size: int, budget: int) -> None:
        """Set the state after prefill: anchor ``first`` ([1] device token id) at ``start``, one
        token committed, ``budget`` tokens allowed, ``block_size - 1`` proposals per step."""
        self.tok.copy_(first.reshape(1))
        self.pos.fill_(start)
        self.n.fill_(1)
        self.budget.fill_(budget)
        self.lim.fill_(block_size - 1)

    def park(self) -> None:
        """A harmless state for capture and warm replays: no budget (nothing moves), anchor at
        the last rows of the caches, which no request reaches before overwriting them."""
        self.pos.fill_(self.be.capacity - 2 * self.width)
        self.n.zero_()
        self.budget.zero_()
        self.lim.zero_()

    def launch(self, block_size: int) -> int:
        """Queue one step (draft at L when ``block_size`` > 1, then verify and commit) and the
        copy of what it commits to pinned memory; returns the slot to :meth:`read`.

        The prefill wrote the prompt's draft context, so the first step too drafts from the
        last L rows only, in the same graph as every later step."""
        if block_size > 1:
            self.launch_draft()
        return self.launch_verify(block_size)

    def launch_draft(self) -> None:
        """Queue the draft of the next step (its proposals go to ``props``): the first half of
        :meth:`launch`, queued on its own while the host reads the step before."""
        be = self.be
        self.drafted += 1
        if be.use_graphs:
            be._device_graph("ddraft", self.width)[0].replay()
        else:
            with torch.inference_mode():
                self.draft_step(partial(be._draft_forward, logits=False))

    def launch_verify(self, block_size: int) -> int:
        """Queue the verify and commit of the step whose draft is queued (width 1 for
        ``block_size`` 1) and the copy of what it commits; returns the slot to :meth:`read`.

        The last step of a request may have no draft of its own queued (one token of budget
        left): it verifies the previous proposals, harmless, as the commit then accepts none of
        them and commits the bonus token only."""
        be = self.be
        width = be.plan.verify_width(block_size)
        if be.use_graphs:
            be._device_graph("dverify", width)[0].replay()
        else:
            with torch.inference_mode():
                self.verify_step(width, be._target_forward)
        slot = self.launched % RING
        self.launched += 1
        self.host[slot].copy_(self.last, non_blocking=self.events is not None)
        if self.events is not None:
            self.events[slot].record()
        return slot

    def read(self, slot: int) -> list[int]:
        """Tokens committed by the step in ``slot`` (waits for that step only)."""
        if self.events is not None:
            self.events[slot].synchronize()
        row = self.host[slot].tolist()
        return row[1 : 1 + row[0]]
