"""THE speculative loop: draft -> verify -> accept -> commit -> rollback, as a generator.

Paper §4 / brief §3.3. One target verify forward per step over [anchor, L-1 proposals]; the
step commits the accepted proposals plus one bonus token. Block size 1 runs plain
autoregressive decoding through the same code (no draft call, verify width 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash.accept import accept_greedy, accept_sampling_candidates, commit_tokens, verify_width
from dflash.backends.base import LocalBackend, SelectorProposal
from dflash.sampling import NumpySampler, sampling_probs, token_logprobs
from dflash.types import RoundResult, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from dflash.auto_block import BlockPolicy


def speculative_generate(
    backend: LocalBackend,
    prompt_ids: list[int],
    *,
    block_size: int,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: list[int] | tuple[int, ...] = (),
    policy: BlockPolicy | None = None,
    logprobs: int | None = None,
    processor: Any = None,
) -> Iterator[RoundResult]:
    """Generate up to ``max_new_tokens`` tokens, yielding what each step commits.

    Args:
        backend: the target/draft pair (see ``dflash.backends.base.LocalBackend``).
        prompt_ids: prompt token ids (T >= 1).
        block_size: L, verify width including the anchor; 1 = autoregressive.
        max_new_tokens: exact budget unless a stop token comes first (>= 1).
        sampling: temperature 0 = greedy; > 0 = lossless rejection sampling.
        stop_ids: token ids that end generation; the stop token is emitted.
        policy: ``--block-size auto`` (dflash.auto_block.BlockPolicy): asked for L before each
            step (``choose(remaining)``, <= block_size) and told the outcome after its verify
            (``observe(accepted drafts, proposed)``); ``needs_features()`` says whether a
            step's target features are kept for later drafts. None = every step uses block_size.
        logprobs: None = off; k >= 0: each result carries the target's log-probabilities of
            its tokens (``RoundResult.logprobs``) with the k most likely alternatives, from the
            log-softmax of the same logits the step accepted with (the raw logits, after the
            processor's mask if any; before temperature/top-k/top-p), so they equal what plain
            decoding reports.
        processor: a constraint on the target's tokens (structured output), with
            ``mask(logits [R, V], tokens) -> logits``: row i masked for the state after
            ``tokens[:i]`` on top of what was committed; ``propose(proposals [n], draft_logits
            [n, V] | None) -> proposals``: the draft's proposals under the constraint;
            ``commit(tokens)``: advance by committed tokens. Acceptance then runs on the
            masked logits, so it stays exact with respect to the constrained target.

    Yields:
        RoundResult for the token sampled after prefill (accepted=None), then one per verify
        step with accepted = tokens committed including the bonus. The last result carries
        finish_reason "stop" or "length".
    """
    plain_steps = policy is None and logprobs is None and processor is None
    loop = getattr(backend, "device_loop", None)  # a wrapper that replaces the draft: host loop
    if (
        sampling.greedy
        and plain_steps
        and loop is not None
        and getattr(loop, "be", backend) is backend
    ):
        yield from _device_greedy(backend, prompt_ids, block_size, max_new_tokens, stop_ids)
        return
    stops = set(stop_ids)
    sampler = None  # T > 0: on the backend's device when it offers a sampler, else numpy
    if not sampling.greedy:
        make = getattr(backend, "sampler", None)
        sampler = make(sampling) if make is not None else NumpySampler(backend, sampling)
    want_features = block_size > 1
    sampled_draft = not sampling.greedy and getattr(backend, "draft_uses_sampling", False)
    draft_kwargs = {"sampling": sampling} if sampled_draft else {}  # DFlash2 samples its path
    trim_head = getattr(backend, "draft_head_rows", False) and not sampled_draft
    cand_rng = None  # DFlash2 candidate rejection: share the host sampler's stream if any
    if sampled_draft:
        cand_rng = getattr(sampler, "rng", None) or np.random.default_rng(sampling.seed)
    backend.reset(len(prompt_ids) + max_new_tokens + block_size)
    logits, context = backend.prefill(list(prompt_ids), want_features)
    if processor is not None:
        logits = processor.mask(logits[None], [])[0]
    if sampling.greedy:
        first = backend.to_list(backend.argmax(logits[None]))[0][0]  # sync: first token
    else:
        first = sampler.first(logits)
    _, n, finish = commit_tokens([first], stops, 0, max_new_tokens)
    if processor is not None:
        processor.commit([first])
    yield RoundResult(tokens=[first], accepted=None, finish_reason=finish,
                      logprobs=_logprobs(backend, logits[None], [first], logprobs))  # fmt: skip
    anchor, start = first, len(prompt_ids)  # anchor sits at position `start`, not yet in cache
    pending = [context]  # feature chunks the draft has not seen (several after L = 1 steps)
    draft_seen = False  # the draft has seen the prompt
    while finish is None:
        length = verify_width(block_size, n, max_new_tokens)  # trimmed to the budget
        if policy is not None:
            length = min(policy.choose(max_new_tokens - n), length)
        proposals_arr = drafted = None
        if length > 1:  # v1 draft logits are unused: proposals are argmax, q one-hot
            # The draft always runs at its trained width (its in-block attention is
            # bidirectional: a narrower block proposes other tokens); only the first
            # length-1 proposals are verified.
            width = max(block_size, backend.draft_block_size)
            context = pending[0] if len(pending) == 1 else pending
            rows = {"rows": length - 1} if trim_head else {}  # the head on the rows verified
            proposals_arr, drafted = backend.draft(anchor, context, start, width, **draft_kwargs,
                                                   **rows)  # fmt: skip
            proposals_arr = proposals_arr[: length - 1]
            if processor is not None:  # the draft's choice among the tokens the grammar allows
                draft_logits = None if isinstance(drafted, SelectorProposal) else drafted
                proposals_arr = processor.propose(proposals_arr, draft_logits)
            pending, draft_seen = [], True
        keep = want_features and (policy is None or not draft_seen or policy.needs_features())
        logits, feats = backend.verify(anchor, proposals_arr, start, keep)
        if processor is not None:
            logits = processor.mask(logits, proposals_arr if length > 1 else [])
        if sampling.greedy:
            arrays = [backend.argmax(logits)] + ([proposals_arr] if length > 1 else [])
            lists = backend.to_list(*arrays)  # sync: the one host copy of this step
            target_ids, proposals = lists[0], (lists[1] if length > 1 else [])
            a, bonus = accept_greedy(proposals, target_ids)
        elif (isinstance(drafted, SelectorProposal) and drafted.q is not None
              and hasattr(sampler, "accept_candidates")):  # on the device, one host copy  # fmt: skip
            rows = len(proposals_arr)
            a, bonus, proposals = sampler.accept_candidates(proposals_arr, logits, drafted.candidates[:rows],
                                                            drafted.q[:rows])  # fmt: skip
        elif isinstance(drafted, SelectorProposal) and drafted.q is not None:
            proposals, cand = backend.to_list(proposals_arr, drafted.candidates)
            p_target = sampling_probs(backend.to_numpy(logits), sampling)
            top_k = drafted.candidates.shape[-1]  # the path was drawn at the trained width
            cand = np.asarray(cand).reshape(-1, top_k)[: len(proposals)]
            q_draft = backend.to_numpy(drafted.q).reshape(-1, top_k)[: len(proposals)]
            a, bonus = accept_sampling_candidates(proposals, p_target, cand, q_draft, cand_rng)
        else:
            a, bonus, proposals = sampler.accept(proposals_arr, logits)  # sync: one host copy
        if policy is not None:
            policy.observe(a, length - 1)
        new, n, finish = commit_tokens(proposals[:a] + [bonus], stops, n, max_new_tokens)
        if processor is not None and finish is None:
            processor.commit(new)
        if finish is None:
            produced = len(new)  # anchor + accepted proposals now sit in the target cache
            backend.rollback(start + produced)
            if keep:
                pending.append(feats[:produced])
            elif want_features:  # a gap: the draft gets only rows that end at its anchor
                pending = []
            anchor, start = new[-1], start + produced
        yield RoundResult(tokens=new, accepted=len(new), proposed=length - 1, finish_reason=finish,
                          logprobs=_logprobs(backend, logits[: len(new)], new, logprobs))  # fmt: skip


def _logprobs(backend: LocalBackend, logits: Any, tokens: list[int],
              top: int | None) -> list[TokenLogprob] | None:  # fmt: skip
    """Log-probabilities of ``tokens`` under logits [n, V] (row i scores tokens[i]), None when
    not asked for (``top`` None). One device-to-host copy of the n rows."""
    if top is None:
        return None
    return token_logprobs(backend.to_numpy(logits), tokens, top)


def _device_greedy(backend, prompt_ids: list[int], block_size: int, max_new_tokens: int,
                   stop_ids) -> Iterator[RoundResult]:  # fmt: skip
    """:func:`speculative_generate` for greedy decoding at a fixed block size on a backend with
    a device loop (``backend.device_loop``, see :mod:`dflash.backends.static.device_loop`): acceptance
    and commit run on the device, and the host reads each step's committed tokens while the
    next step's draft (the ``queue_ahead`` setting ``step`` and block size 1: the whole next step) is
    already queued. Same tokens and results as the host loop."""
    loop = backend.device_loop
    stops = set(stop_ids)
    backend.reset(len(prompt_ids) + max_new_tokens + block_size)
    logits, _ = backend.prefill(list(prompt_ids), block_size > 1)
    first_dev = backend.argmax(logits[None])  # [1]
    first = backend.to_list(first_dev)[0][0]  # sync: the first token (TTFT)
    _, n, finish = commit_tokens([first], stops, 0, max_new_tokens)
    yield RoundResult(tokens=[first], accepted=None, finish_reason=finish)
    if finish is not None:
        return
    loop.begin(first_dev, len(prompt_ids), block_size, max_new_tokens)
    drafts_ahead = block_size > 1 and loop.ahead == "draft"  # else whole steps (block 1 too)
    in_flight = [loop.launch(block_size)]
    if drafts_ahead and n + 1 < max_new_tokens:
        loop.launch_draft()  # the next step's draft runs while the host reads this step
    while finish is None:
        if not drafts_ahead and len(in_flight) == 1 and n + 1 < max_new_tokens:  # the step in
            in_flight.append(loop.launch(block_size))  # flight may not be the last: queue the next
        length = verify_width(block_size, n, max_new_tokens)  # as the host loop trims it
        new = loop.read(in_flight.pop(0))  # sync: the one host copy of this step
        new, n, finish = commit_tokens(new, stops, n, max_new_tokens)
        if drafts_ahead and finish is None:  # its draft is queued: verify it, draft the next
            in_flight.append(loop.launch_verify(block_size))  # before the consumer runs
            if n + 1 < max_new_tokens:  # else that verify commits the last token
                loop.launch_draft()
        yield RoundResult(tokens=new, accepted=len(new), proposed=length - 1, finish_reason=finish)
