"""Text helpers of the public API: chat-template kwargs for ``--reasoning``, chat messages to
prompt token ids, and the incremental detokenizer that never prints half a character.
Re-exported by :mod:`dflash.api`.
"""

from __future__ import annotations

from typing import Any

from dflash.errors import InputError


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

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.printed = 0
        self.truncated_mid_character = False

    def feed(self, ids: list[int], final: bool = False) -> str:
        """Add token ids; return text that is complete (held back while it ends in U+FFFD)."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            if not final:
                return ""
            text, self.truncated_mid_character = split_incomplete_char(text)
        new, self.printed = text[self.printed :], len(text)
        return new


def encode_messages(tokenizer: Any, messages: list[dict], **template_kwargs: Any) -> list[int]:
    """Prompt token ids of chat ``messages``: the tokenizer's chat template with the generation
    prompt (no BOS added twice), or the contents joined by newlines when it has no template.
    Shared by :meth:`Pipeline.chat_prompt` and training-data regeneration. ``template_kwargs``
    go to the template; ``add_generation_prompt=False`` and ``continue_final_message=True``
    among them (a server's assistant prefill) replace the defaults.

    Raises:
        InputError: the template refuses the messages (e.g. a system message for a model
            whose template has no system role).
    """
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer("\n".join(str(m.get("content") or "") for m in messages))["input_ids"])
    try:
        options = {"add_generation_prompt": True, **template_kwargs}
        text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    except Exception as err:  # noqa: BLE001 - jinja2.TemplateError and what templates raise
        roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in messages))
        raise InputError(f"The model's chat template refuses these messages (roles: {roles}): {err}",
                         hint="a model without a system role needs prompts without a system message") from None  # fmt: skip
    bos = tokenizer.bos_token or ""
    return list(tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])
