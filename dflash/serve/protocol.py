"""Request checking and response shapes of ``dflash serve`` (no web framework here, so it is
testable on its own; the ``/metrics`` counters are :mod:`dflash.serve.metrics`).

Shapes follow the OpenAI API; ``meta_info`` follows SGLang (brief §7.5): ``spec_accept_length``
(τ, bonus included), ``spec_verify_ct`` (verify steps) and ``spec_correct_drafts_histogram``
(``[k]`` = verify steps that accepted k drafts, k = 0..L-1), plus two dflash lists that pair each
verify step's τ with its own number of proposals (``spec_accept_length_per_step``,
``spec_proposed_drafts_per_step``): under ``--block-size auto`` the width varies per step (1 = a
plain step that proposes nothing), so the histogram alone cannot tell how many drafts reached a
position.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from dflash.types import SamplingParams

ROLES = {"system", "user", "assistant", "developer", "tool"}


class ApiError(Exception):
    """An error answered as OpenAI error JSON.

    Args:
        status: HTTP status (400, 401, 404, 413, 500, 503).
        message: one sentence for the client.
        param: the offending request field, if any.
        code: machine-readable code (``model_not_found``, ``invalid_api_key``...).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        """``{"error": {message, type, param, code}}`` as OpenAI sends it."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


@dataclass
class GenRequest:
    """A checked request.

    Attributes:
        chat: True for /v1/chat/completions, False for /v1/completions.
        messages: chat messages (chat) with text content; prompt: the raw prompt (completions).
        max_tokens: budget in tokens (None: up to the context length).
        sampling: temperature/top-k/top-p/seed.
        stream, include_usage, return_meta_info: output switches.
        stop: stop strings (the text before the first match is returned).
        stop_token_ids: token ids that also end generation (vLLM's; the token is returned,
            its text too unless it is a special token).
        ignore_eos: True: the model's end-of-sequence tokens do not end generation (vLLM's).
        include_stop_str: vLLM's ``include_stop_str_in_output``: the text ends after the stop
            string instead of before it.
        skip_special_tokens: False: special tokens' text is kept in the output (vLLM's).
        continuous_usage: ``stream_options.continuous_usage_stats`` (vLLM's): every chunk
            carries the usage so far.
        reasoning_effort: OpenAI's ``reasoning_effort``, given to a chat template that has a
            reasoning-effort setting (None: not given).
        template_kwargs: ``chat_template_kwargs`` passed to the chat template, over the
            request's ``add_generation_prompt``/``continue_final_message`` when given.
        prompts: completions: every prompt, as text or token ids (``prompt`` is the first
            text one); answered in order, ``n`` choices each.
        n: choices per prompt (generated one after another; choice j of a seeded request
            uses seed + j).
        logprobs: None = off; k = the chosen token's log-probability and the k most likely
            alternatives (chat: ``top_logprobs``; completions: ``logprobs``).
        echo: completions: the prompt is returned before the completion (with its tokens'
            log-probabilities under ``logprobs``).
        tools: the checked tools (:class:`dflash.serve.tools.ToolSpec`, set by the server).
        grammar: the structured-output constraint (set by the server), or None.
    """

    chat: bool
    model: str | None
    messages: list[dict] = field(default_factory=list)
    prompt: str = ""
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    include_usage: bool = False
    return_meta_info: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    continuous_usage: bool = False
    reasoning_effort: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompts: list[str | list[int]] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    tools: Any = None
    grammar: Any = None


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _number(body: dict, key: str, default: float, lo: float, hi: float, *,
            lo_open: bool = False) -> float:  # fmt: skip
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"'{key}' must be a number.", key)
    if value < lo or value > hi or (lo_open and value == lo):
        raise _bad(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}.", key)
    return float(value)


def _integer(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 8.0 as 8, as vLLM's (pydantic's) lax integers take it
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{key}' must be an integer.", key)
    if value < lo or (hi is not None and value > hi):
        raise _bad(f"'{key}' must be >= {lo}" + (f" and <= {hi}" if hi is not None else "")
                   + f", got {value}.", key)  # fmt: skip
    return value


def _flag(body: dict, key: str, where: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        name = f"{where}.{key}" if where else key
        raise _bad(f"'{name}' must be true or false.", where or key)
    return value


# Options that change what is generated, each with the values that leave it unchanged: any
# other value is refused with 400 (README: unsupported options are refused, not ignored).
_OUTPUT_CHANGING: dict[str, tuple] = {
    "logit_bias": ({},),
    "min_tokens": (0,),
    "repetition_penalty": (1, 1.0),
    "min_p": (0, 0.0),
    "guided_grammar": (),
    "structured_outputs": (),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "prompt_logprobs": (0,),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "chat_template": (),
    "documents": (),
    "truncate_prompt_tokens": (),
    "logits_processors": (),
    "spaces_between_special_tokens": (True,),
    "verbosity": (),
    "typical_p": (1, 1.0),
    "mirostat": (0,),
    "tfs_z": (1, 1.0),
    "dry_multiplier": (0, 0.0),
    "xtc_probability": (0, 0.0),
    "top_a": (0, 0.0),
    "top_n_sigma": (),
}
# chat_template_kwargs that are apply_chat_template's own arguments, not the template's
_TEMPLATE_CALL_ARGS = {"conversation", "messages", "tokenize", "chat_template", "tools", "documents",
                       "return_dict", "return_tensors", "tokenizer_kwargs", "padding", "truncation",
                       "max_length", "return_assistant_tokens_mask", "sanitize_control_tokens"}  # fmt: skip


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _bad(f"{where}: only text content parts are supported.", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}: 'content' must be a string or a list of text parts.", "messages")


def parse_request(body: Any, chat: bool) -> GenRequest:
    """Check a request body; raises :class:`ApiError` (400) naming the bad field."""
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.", "body")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string.", "model")
    req = GenRequest(chat=chat, model=model)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list.", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise _bad(f"messages[{i}] needs a 'role' among {sorted(ROLES)}.", "messages")
            role = "system" if m["role"] == "developer" else m["role"]
            msg = {"role": role, "content": _text_content(m.get("content"), f"messages[{i}]")}
            for key in ("tool_calls", "tool_call_id", "name"):  # checked by the server (tools)
                if m.get(key) is not None:
                    msg[key] = m[key]
            req.messages.append(msg)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
        reserved = sorted(_TEMPLATE_CALL_ARGS & set(kwargs))
        if reserved:
            raise _bad(f"'chat_template_kwargs' cannot set {reserved[0]!r}: it is not a template "
                       "variable.", "chat_template_kwargs")  # fmt: skip
        template: dict[str, Any] = {}
        for key in ("add_generation_prompt", "continue_final_message"):  # vLLM's, as theirs
            if body.get(key) is not None:
                template[key] = _flag(body, key)
        template.update(kwargs)  # chat_template_kwargs win, as in vLLM
        add = template.get("add_generation_prompt", True)
        cont = template.get("continue_final_message", False)
        if add and cont:
            raise _bad("'continue_final_message' and 'add_generation_prompt' cannot both be true; "
                       "send \"add_generation_prompt\": false to continue the last message.",
                       "continue_final_message")  # fmt: skip
        if cont and req.messages[-1]["role"] != "assistant":
            raise _bad("'continue_final_message' needs the last message to be the assistant's.",
                       "continue_final_message")  # fmt: skip
        req.template_kwargs = template
        effort = body.get("reasoning_effort")
        if effort is not None and not (isinstance(effort, str) and effort):
            raise _bad("'reasoning_effort' must be a string such as \"low\".", "reasoning_effort")
        req.reasoning_effort = effort
    else:
        req.prompts = _prompts(body.get("prompt"))
        req.prompt = next((p for p in req.prompts if isinstance(p, str)), "")
        req.echo = _flag(body, "echo")
        if body.get("suffix"):
            raise _bad("'suffix' is not supported by dflash serve.", "suffix")
    req.max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(
        body, "max_tokens", 0 if req.echo else 1
    )
    req.n = _integer(body, "n", 1, MAX_N) or 1
    req.logprobs = _logprobs(body, chat)
    for key, neutral in _OUTPUT_CHANGING.items():
        value = body.get(key)
        if key == "logit_bias" and isinstance(value, dict) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0
                for v in value.values()):  # fmt: skip
            continue  # biases of 0 change nothing
        if value is not None and value not in neutral:
            raise _bad(f"'{key}' is not supported by dflash serve (it would change the output, "
                       "so it is refused rather than ignored).", key)  # fmt: skip
    if body.get("best_of") not in (None, 1):
        raise _bad("Only best_of=1 is supported.", "best_of")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, 0.0, -2.0, 2.0) != 0.0:
            raise _bad(f"'{key}' other than 0 is not supported by dflash serve.", key)
    top_k = _integer(body, "top_k", -1) or 0
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)  # vLLM's int64 range
    if seed is not None and seed < 0:
        seed %= 2**63  # a fixed seed, as in vLLM (some UIs send -1): taken modulo 2^63
    req.sampling = SamplingParams(temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
                                  top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                                  top_k=max(top_k, 0), seed=seed)  # fmt: skip
    stream = body.get("stream")
    stream = False if stream is None else stream  # null as absent, as OpenAI's API takes it
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false.", "stream")
    req.stream = stream
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object.", "stream_options")
        if not stream:  # as vLLM and OpenAI refuse it
            raise _bad("'stream_options' needs 'stream': true.", "stream_options")
        req.include_usage = _flag(options, "include_usage", "stream_options")
        req.continuous_usage = _flag(options, "continuous_usage_stats", "stream_options")
    req.return_meta_info = _flag(body, "return_meta_info")
    req.ignore_eos = _flag(body, "ignore_eos")
    req.include_stop_str = _flag(body, "include_stop_str_in_output")
    if body.get("skip_special_tokens") is not None:
        req.skip_special_tokens = _flag(body, "skip_special_tokens")
    ids = body.get("stop_token_ids")
    if ids is not None and not (
        isinstance(ids, list)
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise _bad(
            "'stop_token_ids' must be a list of token ids (integers >= 0).", "stop_token_ids"
        )
    req.stop_token_ids = list(ids or [])
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (
        isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
    ):
        raise _bad("'stop' must be a non-empty string or a list of them.", "stop")
    req.stop = list(stop or [])
    return req


MAX_N = 16  # choices per prompt (generated one after another)
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A completions ``prompt``: a string, token ids, or a list of either (answered in order).

    Raises:
        ApiError: 400 saying what was sent when it is none of those.
    """

    def is_ids(p: Any) -> bool:
        return (
            isinstance(p, list)
            and bool(p)
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p)
        )

    if isinstance(prompt, str) and prompt:
        return [prompt]
    if is_ids(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(
            (isinstance(p, str) and p) or is_ids(p) for p in prompt):  # fmt: skip
        return [p if isinstance(p, str) else list(p) for p in prompt]
    if isinstance(prompt, list) and not prompt:
        got = "an empty list"
    elif isinstance(prompt, list):
        kinds = sorted({"an empty string" if p == "" else "an empty list" if p == [] else
                        "a string" if isinstance(p, str) else "a list" if isinstance(p, list) else
                        type(p).__name__ for p in prompt})  # fmt: skip
        got = "a list holding " + ", ".join(kinds)
    else:
        got = (
            "an empty string"
            if prompt == ""
            else "null"
            if prompt is None
            else type(prompt).__name__
        )
    raise _bad("'prompt' must be a non-empty string, a list of token ids (integers >= 0), or a "
               f"list of those; got {got}.", "prompt")  # fmt: skip


def _logprobs(body: dict, chat: bool) -> int | None:
    """The number of alternatives asked per token (0: the chosen token's only), or None (off).
    Chat: ``logprobs`` true/false and ``top_logprobs``; completions: ``logprobs`` as a count."""
    if chat:
        on = _flag(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not on and top > 0:
            raise _bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        return (top or 0) if on else None
    if body.get("logprobs") is False:
        return None
    return _integer(body, "logprobs", 0, MAX_LOGPROBS)


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back text that may start one."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = stops
        self.include = (
            include  # the text ends after the stop string (vLLM's include_stop_str_in_output)
        )
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """Add text; return (text safe to send, stop string found)."""
        self.pending += text
        if self.stops:
            hits = [(i, -len(s)) for s in self.stops if (i := self.pending.find(s)) >= 0]
            if hits:
                start, neg_len = min(hits)  # the first match; of two at one place, the longer
                end = start - neg_len if self.include else start
                out, self.pending = self.pending[:end], ""
                return out, True
        if final or not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


def meta_info(accepted: list[int], proposed: list[int], block_size: int, prompt_tokens: int,
              completion_tokens: int, e2e_s: float) -> dict[str, Any]:  # fmt: skip
    """SGLang-style per-choice statistics of one generation.

    Args:
        accepted: τ per verify step (tokens committed, bonus included), 1..proposed + 1.
        proposed: draft tokens proposed per verify step (its width - 1; 0 for a plain step).
        block_size: L, the largest width (the draft's trained block size under auto).

    Returns:
        The SGLang fields (``spec_accept_length``, ``spec_verify_ct``, ``spec_accept_rate``,
        ``spec_num_correct_drafts``, ``spec_num_proposed_drafts``, the histogram under both of
        its names: L counts, ``[k]`` = steps that accepted k drafts), ``block_size``, token
        counts, ``e2e_latency`` (s), and ``spec_accept_length_per_step`` /
        ``spec_proposed_drafts_per_step``: ``accepted`` and ``proposed`` as given (one int per
        verify step each), so a client can compute per-position acceptance exactly when the
        width varies per step.
    """
    steps = len(accepted)
    correct = sum(a - 1 for a in accepted)
    total_proposed = sum(proposed)
    hist = [0] * max(block_size, 1)
    for a in accepted:
        hist[min(a - 1, len(hist) - 1)] += 1
    return {
        "spec_accept_length": sum(accepted) / steps if steps else None,
        "spec_verify_ct": steps,
        "spec_accept_rate": correct / total_proposed if total_proposed else None,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": total_proposed,
        "spec_correct_drafts_histogram": hist,
        "spec_accept_histogram": hist,
        "spec_accept_length_per_step": list(accepted),
        "spec_proposed_drafts_per_step": list(proposed),
        "block_size": block_size,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "e2e_latency": e2e_s,
    }


def completion_id(chat: bool) -> str:
    """``chatcmpl-<hex>`` or ``cmpl-<hex>``."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def chunk(rid: str, chat: bool, model: str, created: int, text: str | None,
          finish: str | None, *, role: bool = False, meta: dict | None = None) -> dict[str, Any]:  # fmt: skip
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``)."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}  # fmt: skip
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    if meta is not None:
        choice["meta_info"] = meta
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
