"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` on ``dflash serve``
(same request and response shapes), so clients need not download the tokenizer."""

from __future__ import annotations

from typing import Any

from dflash.serve.protocol import ApiError, parse_request


def tokenize(engine: Any, body: Any) -> dict[str, Any]:
    """``{"prompt": text}`` (``add_special_tokens`` default true) or chat ``{"messages": [...]}``
    (the chat template, with ``tools``, ``add_generation_prompt``, ``chat_template_kwargs``) ->
    ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
    ``return_token_strs``).

    Raises:
        ApiError: 400 for a malformed body or prompt.
    """
    from dflash.serve.tools import check_tools, history_message

    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", param="body")
    pipe = engine.pipe
    if "messages" in body:
        req = parse_request({k: v for k, v in body.items() if k not in ("add_special_tokens",
                                                                          "return_token_strs")},
                            chat=True)  # fmt: skip
        req.tools = check_tools(body)
        for i, m in enumerate(req.messages):
            m.update(history_message(m, f"messages[{i}]"))
        ids = engine.prompt_ids(req)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(
                400, "'prompt' must be a string (or send chat 'messages').", param="prompt"
            )
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise ApiError(
                400, "'add_special_tokens' must be true or false.", param="add_special_tokens"
            )
        ids = list(pipe.tokenizer(prompt, add_special_tokens=add)["input_ids"])
    strs = None
    if body.get("return_token_strs"):
        strs = list(pipe.tokenizer.convert_ids_to_tokens(ids))
    return {"count": len(ids), "max_model_len": pipe.backend.max_context, "tokens": ids,
            "token_strs": strs}  # fmt: skip


def detokenize(engine: Any, body: Any) -> dict[str, Any]:
    """``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens kept, as vLLM).

    Raises:
        ApiError: 400 unless ``tokens`` is a list of ids in the vocabulary.
    """
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = getattr(engine.pipe.backend, "vocab_size", None) or 2**62
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):  # fmt: skip
        raise ApiError(
            400, "'tokens' must be a list of token ids in the vocabulary.", param="tokens"
        )
    return {"prompt": engine.pipe.tokenizer.decode(tokens, skip_special_tokens=False)}


def tokenizer_info(engine: Any) -> dict[str, Any]:
    """vLLM's ``GET /tokenizer_info``: the tokenizer's configuration (what
    ``tokenizer_config.json`` holds: special tokens, ``added_tokens_decoder``, ...) with
    ``tokenizer_class`` and the ``chat_template`` this server applies, so a client can set up
    tokenization without downloading the tokenizer. Local file paths (``*_file`` keys) are left
    out; added tokens are given as their text; ``model_max_length`` is at most the served
    context length (as ``max_model_len`` of ``/tokenize``)."""
    tokenizer = engine.pipe.tokenizer
    config = {k: _plain(v) for k, v in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
              if not k.endswith("_file")}  # fmt: skip
    context = engine.pipe.backend.max_context
    length = config.get("model_max_length")
    config["model_max_length"] = min(length, context) if isinstance(length, int) else context
    config["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return config


def _plain(value: Any) -> Any:
    """``value`` as JSON can carry it: an added token as its text, dict keys as strings, other
    objects as their ``str``."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    content = getattr(value, "content", None)  # tokenizers.AddedToken
    return content if isinstance(content, str) else str(value)
