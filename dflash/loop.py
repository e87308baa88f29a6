"""THE speculative loop: draft -> verify -> accept -> commit -> rollback, as a generator.

Paper §4 / brief §3.3. One target verify forward per step over [anchor, L-1 proposals]; the
step commits the accepted proposals plus one bonus token. Block size 1 runs plain
autoregressive decoding through the same code (no draft call, verify width 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from dflash.accept import accept_greedy, accept_sampling
from dflash.backends.base import LocalBackend
from dflash.sampling import sample, sampling_probs
from dflash.types import RoundResult, SamplingParams

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

    Yields:
        RoundResult for the token sampled after prefill (accepted=None), then one per verify
        step with accepted = tokens committed including the bonus. The last result carries
        finish_reason "stop" or "length".
    """
    stops = set(stop_ids)
    rng = np.random.default_rng(sampling.seed)
    want_features = block_size > 1
    backend.reset(len(prompt_ids) + max_new_tokens + block_size)
    logits, context = backend.prefill(list(prompt_ids), want_features)
    if sampling.greedy:
        first = backend.to_list(backend.argmax(logits[None]))[0][0]  # sync: first token
    else:
        first = sample(sampling_probs(backend.to_numpy(logits), sampling), rng)
    n = 1
    finish = "stop" if first in stops else ("length" if n >= max_new_tokens else None)
    yield RoundResult(tokens=[first], accepted=None, finish_reason=finish)
    anchor, start = first, len(prompt_ids)  # anchor sits at position `start`, not yet in cache
    pending = [context]  # feature chunks the draft has not seen (several after L = 1 steps)
    drafted = False  # the draft has seen the prompt
    while finish is None:
        length = min(block_size, max_new_tokens - n)  # the last block shrinks to the budget
        if policy is not None:
            length = min(policy.choose(max_new_tokens - n), length)
        proposals_arr = None
        if length > 1:  # draft logits are unused: proposals are argmax, q one-hot
            context = pending[0] if len(pending) == 1 else pending
            proposals_arr, _draft_logits = backend.draft(anchor, context, start, length)
            pending, drafted = [], True
        keep = want_features and (policy is None or not drafted or policy.needs_features())
        logits, feats = backend.verify(anchor, proposals_arr, start, keep)
        if sampling.greedy:
            arrays = [backend.argmax(logits)] + ([proposals_arr] if length > 1 else [])
            lists = backend.to_list(*arrays)  # sync: the one host copy of this step
            target_ids, proposals = lists[0], (lists[1] if length > 1 else [])
            a, bonus = accept_greedy(proposals, target_ids)
        else:
            proposals = backend.to_list(proposals_arr)[0] if length > 1 else []
            p_target = sampling_probs(backend.to_numpy(logits), sampling)
            a, bonus = accept_sampling(proposals, p_target, None, rng)
        if policy is not None:
            policy.observe(a, length - 1)
        new = proposals[:a] + [bonus]
        for i, tok in enumerate(new):  # stop tokens are looked for among new tokens only
            if tok in stops:
                new, finish = new[: i + 1], "stop"
                break
        n += len(new)
        if finish is None and n >= max_new_tokens:
            finish = "length"
        if finish is None:
            produced = len(new)  # anchor + accepted proposals now sit in the target cache
            backend.rollback(start + produced)
            if keep:
                pending.append(feats[:produced])
            elif want_features:  # a gap: the draft gets only rows that end at its anchor
                pending = []
            anchor, start = new[-1], start + produced
        yield RoundResult(tokens=new, accepted=len(new), proposed=length - 1, finish_reason=finish)
