"""The :class:`Pipeline` that :func:`dflash.api.load` returns: a target/draft pair with its
tokenizer (chat_prompt, stream, generate, warm_up, ``--block-size auto`` calibration), plus the
request argument checks and the package versions it reports. Re-exported by :mod:`dflash.api`.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable, Iterator
from typing import Any

from dflash.auto_block import (
    AcceptancePrior,
    BlockPolicy,
    CostTable,
    ladder,
    load_acceptance,
    load_or_measure_costs,
)
from dflash.errors import InputError
from dflash.loop import speculative_generate
from dflash.paths import key_path  # noqa: F401 - re-exported
from dflash.sampling import token_logprobs
from dflash.text import encode_messages, reasoning_kwargs, split_incomplete_char
from dflash.types import GenerationResult, RoundResult, SamplingParams, TokenLogprob


class Pipeline:
    """A target/draft pair with its tokenizer, ready to generate.

    Attributes:
        backend: the local backend (``LocalBackend`` protocol).
        tokenizer: the target's HF tokenizer.
        block_size: the draft's trained block size L (the largest verify width).
        stop_ids: ids that end generation (generation config EOS, else tokenizer EOS).
        draft_dir: the draft's folder (its ``acceptance.json`` seeds ``--block-size auto``).
        cost_key: what identifies measured costs in the cache (backend, device, dtype, model).
        last_policy: the ``--block-size auto`` policy of the latest request (its ``history``
            holds every step's choice), None after a fixed-block-size request.
        recalibrate: measure the ``--block-size auto`` costs again at the first calibration
            instead of reading the dflash cache (``--recalibrate``); the new table is cached.
    """

    def __init__(self, backend: Any, tokenizer: Any, stop_ids: list[int], name: str = "", *,
                 draft_dir: Any = None, cost_key: dict[str, Any] | None = None):  # fmt: skip
        self.backend = backend
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.block_size = backend.draft_block_size
        self.name = name
        self.draft_dir = draft_dir
        self.cost_key = cost_key or {"backend": type(backend).__name__, "name": name}
        self.costs: CostTable | None = None
        self.acceptance: AcceptancePrior | None = None
        self.last_policy: BlockPolicy | None = None
        self.recalibrate = False

    def calibrate(self) -> CostTable:
        """Time verify/draft forwards per width once (or read them from the dflash cache).

        Done on the first ``block_size="auto"`` request; a server calls it at startup so no
        request pays for it. About (widths x 6) verify and draft forwards: well under a second on
        a GPU, a minute or two for the demo pair on a 2-core CPU (one line on stderr says so).
        """
        if self.costs is None:
            widths = ladder(self.block_size, getattr(self.backend, "auto_widths", None))
            self.costs = load_or_measure_costs(self.backend, self.cost_key, widths, self.recalibrate)
        return self.costs

    def block_policy(self, repeatable: bool = False) -> BlockPolicy:
        """A fresh ``--block-size auto`` policy for one request (costs measured if needed).

        ``repeatable=True`` (a seeded sampled request): the policy prices widths with the
        calibrated table as measured (no online timing correction, none of earlier requests'
        corrections), so its choices depend only on the request's own acceptance, and the same
        seed gives the same text again (in one process, or across runs that read the same
        cached cost table). Otherwise steps are timed and correct the shared table online.
        """
        if self.acceptance is None:
            self.acceptance = load_acceptance(self.draft_dir, self.block_size)
        costs = self.calibrate()
        if repeatable:
            costs = dataclasses.replace(costs, scale={"plain": 1.0, "drafted": 1.0})
        # The costs are measured as the loop drafts: at the trained width, the head on L-1 rows.
        return BlockPolicy(costs, self.acceptance, self.block_size,
                           widths=getattr(self.backend, "auto_widths", None),
                           clock=None if repeatable else time.perf_counter)  # fmt: skip

    def chat_prompt(self, messages: list[dict], *, system: str | None = None,
                    reasoning: str | None = None,
                    template_kwargs: dict | None = None) -> list[int]:  # fmt: skip
        """Apply the chat template (generation prompt added) and return prompt token ids.

        ``template_kwargs`` are passed to the template as they are (a server's
        ``chat_template_kwargs``); a template ignores the ones it does not use.

        Raises:
            InputError: messages not a non-empty list of ``{"role", "content"}`` dicts, an empty user
                message, a bad ``reasoning`` value, or a prompt longer than the context.
        """
        if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise InputError("chat_prompt takes a list of chat messages.",
                             hint='e.g. pipe.chat_prompt([{"role": "user", "content": "Hi"}])')  # fmt: skip
        if not messages:
            raise InputError("chat_prompt got no messages.",
                             hint='pass at least one, e.g. [{"role": "user", "content": "Hi"}]')  # fmt: skip
        for m in messages:
            if m.get("role") == "user" and not str(m.get("content") or "").strip():
                raise InputError("The prompt is empty.", hint="pass a question or instruction")
        msgs = ([{"role": "system", "content": system}] if system else []) + list(messages)
        template = getattr(self.tokenizer, "chat_template", None)
        kwargs = reasoning_kwargs(template if isinstance(template, str) else None, reasoning)
        kwargs.update(template_kwargs or {})
        ids = encode_messages(self.tokenizer, msgs, **kwargs)
        self.check_prompt(ids)
        return ids

    def check_prompt(self, ids: list[int]) -> None:
        """Raise InputError unless ids is a non-empty list of in-vocabulary token ids that fits
        the target's context."""
        if isinstance(ids, str) or not all(isinstance(i, int) for i in ids):
            raise InputError("prompt_ids must be a list of token ids.",
                             hint="build them with pipe.chat_prompt(messages)")  # fmt: skip
        if not ids:
            raise InputError("The prompt is empty.")
        vocab = getattr(self.backend, "vocab_size", None)
        if vocab is not None and not all(0 <= i < vocab for i in ids):
            raise InputError(f"prompt_ids hold ids outside the vocabulary (size {vocab}).")
        limit = self.backend.max_context
        if len(ids) >= limit:
            raise InputError(f"The prompt has {len(ids)} tokens but the target's context is {limit}.",
                             hint="shorten the prompt")  # fmt: skip

    def resolve_block_size(self, block_size: int | str | None) -> int | str:
        """--block-size value: "auto" (also for None; plain 1 without a draft) or an int
        checked against the draft's trained size.

        Raises:
            InputError: not "auto" nor an integer in 1..trained block size.
        """
        bs = "auto" if block_size is None else block_size
        if isinstance(bs, bool) or not isinstance(bs, (numbers.Integral, str)):
            raise InputError(f"--block-size must be auto or an integer >= 1, got {bs!r}.",
                             hint="auto picks it per step; 1 decodes without a draft")  # fmt: skip
        if isinstance(bs, numbers.Integral):
            bs = int(bs)
        if isinstance(bs, str):
            text = bs.strip().lower()
            if text == "auto":
                return "auto" if self.block_size > 1 else 1
            if not text.isdigit():
                raise InputError(f"--block-size must be auto or an integer >= 1, got {bs!r}.",
                                 hint="auto picks it per step; 1 decodes without a draft")  # fmt: skip
            bs = int(text)
        if bs < 1:
            raise InputError(f"--block-size must be >= 1, got {bs}.", hint="auto picks it per step; 1 decodes without a draft")
        if bs > self.block_size:
            raise InputError(f"--block-size {bs} exceeds the draft's trained block size "
                             f"{self.block_size}.", hint=f"use --block-size {self.block_size} or less")  # fmt: skip
        return bs

    def stream(self, prompt_ids: list[int], *, block_size: int | str | None = "auto",
               max_new_tokens: int = 2048, sampling: SamplingParams = SamplingParams(),
               stop_ids: list[int] | None = None, logprobs: int | None = None,
               processor: Any = None) -> Iterator[RoundResult]:  # fmt: skip
        """Yield what each step commits (see ``dflash.loop.speculative_generate``, which also
        describes ``logprobs`` and ``processor``).

        Generation also ends at the target's context length (finish_reason "length").
        ``block_size="auto"`` (the default) picks L per step (see ``dflash.auto_block``); the
        choices are in ``self.last_policy.history``. A seeded sampled request (temperature > 0,
        ``sampling.seed`` set) chooses them without timing its steps (``block_policy(True)``),
        so the same seed gives the same tokens again.

        Raises:
            InputError: bad block size, budget < 1, ``sampling`` not a ``SamplingParams``, or a
                prompt too long for the context.
        """
        bs = self.resolve_block_size(block_size)
        check_run_args(max_new_tokens, sampling)
        self.check_prompt(prompt_ids)
        budget = self._budget(prompt_ids, max_new_tokens)
        # A seeded sample draws its random numbers per step, so the widths must not depend on
        # timings for the same seed to give the same text (greedy is the same at any width).
        repeatable = sampling.temperature > 0 and sampling.seed is not None
        # one token comes from the prefill alone: no step to choose a block size for
        policy = self.block_policy(repeatable) if bs == "auto" and budget > 1 else None
        self.last_policy = policy
        bs = self.block_size if bs == "auto" else bs
        stops = self.stop_ids if stop_ids is None else stop_ids
        yield from speculative_generate(self.backend, prompt_ids, block_size=bs,
                                        max_new_tokens=budget, sampling=sampling,
                                        stop_ids=stops, policy=policy, logprobs=logprobs,
                                        processor=processor)  # fmt: skip

    def prompt_logprobs(self, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
        """The target's log-probabilities of prompt tokens 1..T-1 (each given the tokens before
        it), with the ``top`` most likely alternatives: one forward over the prompt
        (``backend.score``), as the raw log-softmax that :meth:`stream` reports for generated
        tokens.

        Raises:
            InputError: a bad prompt, or a backend without ``score`` (the CUDA-graph path, mlx).
        """
        self.check_prompt(prompt_ids)
        score = getattr(self.backend, "score", None)
        if score is None:
            raise InputError("Prompt log-probabilities need the plain transformers path.",
                             hint="load with cuda_graphs=False (dflash serve --no-cuda-graphs)")  # fmt: skip
        if len(prompt_ids) < 2:
            return []
        logits = score(prompt_ids)  # [T, V]
        return token_logprobs(self.backend.to_numpy(logits[:-1]), prompt_ids[1:], top)

    def calibrate_for(self, prompt_ids: list[int], block_size: int | str | None, max_new_tokens: int) -> None:
        """Measure (or read) the ``auto`` costs when this request will use them: under
        ``block_size="auto"`` with room for more than one new token (the first comes from the
        prefill alone, with no step to choose a block size for). Callers run it before their
        clock starts.

        Raises:
            InputError: a bad block size.
        """
        if self.resolve_block_size(block_size) == "auto" and self._budget(prompt_ids, max_new_tokens) > 1:
            self.calibrate()

    def _budget(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        """New tokens a request can have: ``max_new_tokens`` capped by the context left."""
        return min(max_new_tokens, self.backend.max_context - len(prompt_ids))

    def warm_up(self, prompt_ids: list[int], *, max_new_tokens: int = 2048,
                sampling: SamplingParams = SamplingParams(), tokens: int = 64) -> float:  # fmt: skip
        """Untimed warm-up before a single timed request: ``tokens`` tokens of this request at
        the trained block size, then at block 1, no stop ids, output discarded.

        What the benchmark harness does before it measures. On the CUDA-graph path the graphs
        are captured before the first token, but the eager ops between them (acceptance,
        commit, sampling) load their kernels on first use and the GPU is still at idle clocks
        after compiling; both would land in the first request's decode time. The request's own
        prompt and budget are used so that the caches are sized as they will be (no
        re-allocation or re-capture afterwards; the wider pass first, so the narrower one never
        grows them). It costs two prefills of the prompt plus ``tokens`` plain steps and
        ``tokens`` / τ drafted ones (on the H200 demo pair about 0.1 s). Fixed block sizes
        only: the ``auto`` policy's online cost correction never sees these steps.

        Args:
            prompt_ids: the request's prompt token ids.
            max_new_tokens: the request's budget (tokens); sizes the caches.
            sampling: the request's sampling settings (their kernels are warmed too).
            tokens: tokens decoded per block size (0 skips the warm-up).

        Returns:
            Seconds spent (device-synced).

        Raises:
            InputError: as :meth:`stream`.
        """
        t0 = time.perf_counter()
        if tokens > 0:
            for bs in sorted({1, self.block_size}, reverse=True):
                done = 0
                steps = self.stream(prompt_ids, block_size=bs, max_new_tokens=max_new_tokens,
                                    sampling=sampling, stop_ids=[])  # fmt: skip
                for r in steps:
                    done += len(r.tokens)
                    if done >= tokens:
                        break
                steps.close()
            self.last_policy = None
            self.backend.synchronize()
        return time.perf_counter() - t0

    def generate(self, prompt_ids: list[int], *, on_step: Callable[[int, Any], None] | None = None,
                 **kwargs: Any) -> GenerationResult:  # fmt: skip
        """Run :meth:`stream` to the end and collect tokens, timings (s) and τ per step.

        ``ttft_s`` covers prefill and the first token; ``decode_s`` the rest (device-synced).
        A character cut by the budget is kept out of ``text`` (``truncated_mid_character``).
        Under ``block_size="auto"`` (the default) costs are measured before the clock starts.
        ``on_step(i, result)``: called after verify step i (1, 2, ...) with :meth:`stream`'s
        result for it (``accepted``, ``proposed``, ``tokens``), inside the timed decode.
        """
        bs = self.resolve_block_size(kwargs.get("block_size", "auto"))
        max_new_tokens = kwargs.get("max_new_tokens", 2048)
        check_run_args(max_new_tokens, kwargs.get("sampling", SamplingParams()))
        self.check_prompt(prompt_ids)  # bad input fails before the (slow) first calibration
        self.calibrate_for(prompt_ids, bs, max_new_tokens)
        tokens: list[int] = []
        accepted: list[int] = []
        proposed: list[int] = []
        finish = "length"
        self.backend.synchronize()
        t0 = time.perf_counter()
        t1 = t0
        for r in self.stream(prompt_ids, **kwargs):
            tokens.extend(r.tokens)
            if r.accepted is None:
                self.backend.synchronize()
                t1 = time.perf_counter()
            else:
                accepted.append(r.accepted)
                proposed.append(r.proposed)
                if on_step is not None:
                    on_step(len(accepted), r)
            finish = r.finish_reason or finish
        self.backend.synchronize()
        t2 = time.perf_counter()
        text, cut = split_incomplete_char(self.decode(tokens))
        return GenerationResult(
            token_ids=tokens, text=text, prompt_tokens=len(prompt_ids),
            acceptance_lengths=accepted, proposed=proposed, ttft_s=t1 - t0, decode_s=t2 - t1,
            finish_reason=finish, block_size=bs, truncated_mid_character=cut,
            block_policy=self.last_policy.summary() if bs == "auto" and self.last_policy else None,
        )  # fmt: skip

    def describe(self) -> dict[str, Any]:
        """What produces this pipeline's tokens: the backend's own description (impl, device,
        dtype, CUDA graphs, compile; on the transformers backend the resolved kernel settings,
        ``kernel_settings``) plus package versions; stored with benchmark records."""
        info = dict(getattr(self.backend, "describe", dict)())
        vocab = getattr(self.backend, "draft_vocab_size", None)
        if vocab is not None:  # draft_vocab.json in use (named only then: older records stay comparable)
            info["draft_vocab"] = vocab
        info["versions"] = package_versions()
        return info

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text, special tokens skipped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def check_run_args(max_new_tokens: Any, sampling: Any) -> None:
    """Raise InputError unless ``max_new_tokens`` is an integer >= 1 and ``sampling`` a
    ``SamplingParams`` (a dict is the common mistake)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise InputError(f"--max-new-tokens must be an integer, got {max_new_tokens!r}.",
                         hint="e.g. --max-new-tokens 256")  # fmt: skip
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {max_new_tokens}.", hint="e.g. --max-new-tokens 256")
    if not isinstance(sampling, SamplingParams):
        raise InputError(f"sampling must be a dflash.SamplingParams, got {type(sampling).__name__}.",
                         hint="e.g. sampling=dflash.SamplingParams(temperature=0.7, top_p=0.9)")  # fmt: skip


def package_versions() -> dict[str, str | None]:
    """Versions of dflash and the packages that shape its numerics (None when absent)."""
    from importlib import metadata

    from dflash._version import __version__

    out: dict[str, str | None] = {"dflash": __version__}
    for name in ("torch", "transformers", "mlx"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
