"""A scripted pipeline for ``dflash serve`` tests: a character-level tokenizer with a few
special tokens, a chat "template" that records what it was given, and a target whose reply is
chosen by a function of the messages, committed in steps of 1, 3 and 7 tokens (then the
end-of-sequence token). Used in-process through Starlette's TestClient, which the official
``openai`` package takes as its HTTP client."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from dflash.types import RoundResult

SPECIALS = ["<|eos|>", "<|python_tag|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>",
            "<|call|>", "<|constrain|>", "<|tool_call>", "<tool_call|>", '<|"|>']  # fmt: skip
BASE = 0x110000  # special token ids come after every character's
EOS = BASE


class CharTokenizer:
    """One token per character (its code point), plus ``SPECIALS`` (special tokens)."""

    def __init__(self, chat_template: str = ""):
        self.chat_template = chat_template
        self.bos_token = None
        self.rendered: list[dict] = []  # what apply_chat_template was given, newest last

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            hit = next((k for k, s in enumerate(SPECIALS) if text.startswith(s, i)), None)
            if hit is None:
                ids.append(ord(text[i]))
                i += 1
            else:
                ids.append(BASE + hit)
                i += len(SPECIALS[hit])
        return ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(SPECIALS[i - BASE] if i >= BASE else chr(i) for i in ids
                       if not (skip_special_tokens and i >= BASE))  # fmt: skip

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        self.rendered.append({"messages": messages, **kw})
        return json.dumps({"messages": messages, "tools": kw.get("tools")}) + "\nassistant:"


class _Backend:
    use_graphs = False
    max_context = 100_000
    vocab_size = BASE + len(SPECIALS)

    def describe(self) -> dict:
        return {"impl": "dynamic"}


class ScriptedPipe:
    """Stands in for ``dflash.api.Pipeline``: ``reply(messages)`` gives the text to generate."""

    block_size = 8
    stop_ids = [EOS]

    def __init__(self, reply: Callable[[list[dict]], str], chat_template: str = ""):
        self.reply, self.tokenizer, self.backend = reply, CharTokenizer(chat_template), _Backend()
        self.calls: list[dict] = []

    def resolve_block_size(self, value):
        return value or 8

    def calibrate(self):
        pass

    def chat_prompt(self, messages, template_kwargs=None):
        from dflash.text import encode_messages

        return encode_messages(self.tokenizer, messages, **(template_kwargs or {}))

    def check_prompt(self, ids):
        pass

    def stream(self, ids, block_size, max_new_tokens, sampling, stop_ids, **kw):
        self.calls.append({"ids": ids, "max_new_tokens": max_new_tokens, **kw})
        last = self.tokenizer.rendered[-1]["messages"] if self.tokenizer.rendered else []
        tokens = self.tokenizer.encode(self.reply(last)) + [EOS]
        tokens = tokens[:max_new_tokens]
        yield RoundResult(tokens=tokens[:1], accepted=None,
                          finish_reason="stop" if tokens[:1] == [EOS] else None)  # fmt: skip
        i, sizes = 1, [1, 3, 7]
        while i < len(tokens):
            step = tokens[i : i + sizes[i % 3]]
            i += len(step)
            finish = "stop" if step[-1] in stop_ids else ("length" if i >= len(tokens) else None)
            yield RoundResult(tokens=step, accepted=len(step), proposed=7, finish_reason=finish)


def client_for(pipe, names=("scripted",), block_size=None, **engine_kw):
    """A started TestClient over ``dflash serve``'s app around ``pipe`` (ready to answer);
    ``engine_kw`` are set on the Engine before it loads."""
    from starlette.testclient import TestClient

    from dflash.serve.engine import Engine
    from dflash.serve.server import build_app

    engine = Engine(lambda: pipe, list(names), block_size=block_size)
    for key, value in engine_kw.items():
        setattr(engine, key, value)
    client = TestClient(build_app(engine))
    client.__enter__()
    deadline = time.monotonic() + 300
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline and engine.error is None, engine.error
        time.sleep(0.02)
    client.engine = engine
    return client


# a get_weather call: its arguments, the answer after the tool message, and per tool-call
# format the text the scripted target emits for it
ARGS = {"city": "Paris", "days": 2}
ANSWER = "It is 22 C in Paris."

# format -> (a chat template naming it, the target's tool-call text)
FORMATS = {
    "hermes": ("... <tool_call> ... </tool_call>",
               'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>'),
    "qwen3_coder": ("<tool_call><function=...>",
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"),
    "llama3_json": ("{{ '<|python_tag|>' }} ipython",
                    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    "openai": ("<|channel|>",
               "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
               '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
               '{"city": "Paris", "days": 2}<|call|>'),
    "gemma4": ("<|tool_call>",
               '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'),
}  # fmt: skip
