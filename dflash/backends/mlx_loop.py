"""The pipelined greedy step of the mlx backend: one host read per step, the next draft queued
before it.

The host loop (:func:`dflash.loop.speculative_generate`) drafts, verifies, reads the step's
tokens and only then builds the next draft's graph: while the host builds it (and the next
verify's), the accelerator idles, and while the accelerator runs, the host waits. Here greedy
requests at a fixed block size run through :func:`dflash.loop._device_greedy` instead, with
this object as its ``device_loop``:

- the acceptance runs on the device (:func:`accept_step`, ``mx.compile``'d: a fixed shape per
  verify width), giving the step's committed tokens, their count and the next anchor;
- the next block's draft is queued (``mx.async_eval``) right behind the verify, before the host
  reads anything: its anchor is the device's bonus token, its context the verify's W feature
  rows of which the first ``count`` (known on the device only) are visible
  (:meth:`dflash.models.draft_mlx.DFlashDraftMLX.ahead`);
- the host then makes its one read per step (:meth:`read`: ``tolist`` of [count, tokens...]),
  trims the target cache (and restores GatedDeltaNet states) to the committed prefix, drops
  the draft cache's rows of rejected proposals, and queues the next verify while the draft
  runs; the draft's LM head runs only on the L-1 rows that are verified.

Block size 1 queues the next one-token step before reading the current one, as mlx-lm's
``generate_step`` does. The committed tokens are exactly those of the host loop: the same
target forwards and the same greedy prefix rule (:func:`dflash.accept.accept_greedy`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from dflash.accept import verify_width


def accept_step(logits: mx.array, proposals: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy acceptance of one verify (paper §4 / brief §3.3), on the device.

    Args:
        logits: [W, V] target logits of the rows [anchor, proposals].
        proposals: [W-1] int32 draft proposals (any [0] array for W = 1).

    Returns:
        (row [1 + W] int32 = [count, committed tokens..., 0 padding], bonus [1] int32): count
        = accepted + 1 tokens committed: the longest prefix of proposals equal to the target's
        argmax, then the target's token after it (the next anchor).
    """
    target = mx.argmax(logits, axis=-1).astype(mx.int32)  # [W]
    width = target.shape[0]
    if width == 1:
        return mx.concatenate([mx.ones((1,), mx.int32), target]), target
    agree = (proposals == target[:-1]).astype(mx.int32)  # [W-1]
    accepted = mx.cumprod(agree).sum()  # [] the longest agreeing prefix
    bonus = mx.take(target, accepted)  # []
    idx = mx.arange(width, dtype=mx.int32)
    rows = mx.concatenate([proposals, mx.zeros((1,), mx.int32)])
    committed = mx.where(idx < accepted, rows, mx.where(idx == accepted, bonus, 0))
    return mx.concatenate([(accepted + 1).reshape(1).astype(mx.int32), committed]), bonus.reshape(1)


_ACCEPT = mx.compile(accept_step)


class MLXDeviceLoop:
    """Loop state of one :class:`~dflash.backends.mlx.MLXBackend` for
    :func:`dflash.loop._device_greedy` (the protocol of
    :class:`dflash.backends.static.device_loop.DeviceLoop`).

    State: ``tok`` [1] int32 the next anchor on the device; ``pos`` the host's position of the
    next verify's anchor; ``n`` tokens committed and read; ``props`` [<= L-1] the queued draft's
    proposals; ``steps`` the verifies not yet read (slot -> (row [1+W], W, anchor position,
    whether a draft appended its rows)).

    Args:
        be: the backend; its ``draft``/``verify``/``rollback`` pieces do the work.
    """

    ahead = "draft"  # block sizes > 1 queue the next draft; block size 1 the next step

    def __init__(self, be: Any):
        self.be = be
        self.launched = 0  # verifies queued (for tests and benchmarks)
        self.drafted = 0  # drafts queued
        self.reads = 0  # host reads (one per verify)
        self.steps: dict[int, list] = {}
        self.tok: mx.array | None = None
        self.pos = self.n = self.budget = self.block = 0
        self.props: mx.array | None = None
        self.last: int | None = None  # slot of the last verify queued

    def begin(self, first: mx.array, start: int, block_size: int, budget: int) -> None:
        """State after prefill: anchor ``first`` ([1] device token id) at position ``start``,
        one token committed, ``budget`` tokens allowed, verifies of up to ``block_size`` rows."""
        self.tok = first.reshape(1).astype(mx.int32)
        self.pos, self.n, self.budget, self.block = start, 1, budget, block_size
        self.props, self.last = None, None
        self.steps.clear()

    def launch(self, block_size: int) -> int:
        """Queue one whole step (draft when ``block_size`` > 1, then verify); its slot."""
        if block_size > 1:
            self.launch_draft()
        return self.launch_verify(block_size)

    def launch_draft(self) -> None:
        """Queue the next block's draft: from the prompt's features after prefill, else from
        the last verify's rows, with the count the device accepted (not read yet)."""
        be, rows = self.be, self.block - 1
        width = max(self.block, be.draft_block_size)
        step = self.steps.get(self.last) if self.last is not None else None
        if self.last is None:  # the first draft: the prompt's rows, all committed
            props, _ = be.draft(self.tok, be.prompt_features, self.pos, width, rows=rows)
        elif step is None:  # its verify was read already: the host knows the count
            raise AssertionError("the pipelined loop drafts before reading the verify it follows")
        else:
            feats, vstart = step[4], step[2]
            props = be.draft_ahead(self.tok, feats, vstart, step[0][0], width, rows)
            step[3] = True  # the draft cache holds this verify's W rows: drop the rejected ones
        anchor_pos = self.pos if self.last is None else step[2] + step[0][0]
        self.props = self.proposals_hook(props.astype(mx.int32), anchor_pos)
        mx.async_eval(self.props)
        self.drafted += 1

    def launch_verify(self, block_size: int) -> int:
        """Queue the verify of [anchor, proposals] and its acceptance; returns the slot to
        :meth:`read`. A verify wider than 1 needs every earlier one read (the target cache is
        trimmed to the committed prefix first)."""
        be = self.be
        in_flight = len(self.steps)
        width = verify_width(block_size, self.n + in_flight, self.budget)
        if width > 1:
            assert not self.steps, "a wide verify queued before the previous one was read"
            ids = mx.concatenate([self.tok, self.props[: width - 1]])
            props = self.props[: width - 1]
        else:
            ids, props = self.tok, mx.zeros((0,), mx.int32)
        assert self.pos == be.length, f"verify at {self.pos} but the target cache holds {be.length}"
        be.last_steps = width
        logits, feats = be._forward(ids, with_features=self.block > 1)
        row, bonus = _ACCEPT(logits, props)
        self.tok = bonus
        slot = self.launched
        self.launched += 1
        self.steps[slot] = [row, width, self.pos, False, feats]
        self.last = slot
        if width == 1:
            self.pos += 1  # a one-token step commits its token (the loop keeps the budget)
        mx.async_eval(row)
        return slot

    def read(self, slot: int) -> list[int]:
        """Tokens committed by the verify in ``slot``: the step's one host read; then the
        target cache is rolled back to the committed prefix and the draft cache loses the rows
        of rejected proposals."""
        row, width, vstart, drafted, _ = self.steps.pop(slot)
        values = self.host_read(row)
        count = values[0]
        if width > 1:
            self.be.rollback(vstart + count)
            self.pos = vstart + count
            if drafted:
                self.be.draft_cache.drop_tail(width - count)
        self.n += count
        return values[1 : 1 + count]

    def proposals_hook(self, proposals: mx.array, anchor_pos: int | mx.array) -> mx.array:
        """The draft's proposals [R] as verified (identity; a test may script them from the
        anchor's position, an int or a [] device array)."""
        return proposals

    def host_read(self, row: mx.array) -> list[int]:
        """The one device-to-host copy of a step (a test wraps it to count them)."""
        self.reads += 1
        return row.tolist()
