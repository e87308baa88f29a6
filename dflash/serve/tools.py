"""Tool calls of ``dflash serve``: checking ``tools``/``tool_choice``, and the parsers that turn
a model's tool-call text into OpenAI ``tool_calls``.

A parser is fed the reply's text as it streams and returns events: ``("content", text)`` for
text to show and ``("call", ToolCall)`` for each complete call. Text that may still become a
call is held back; a call that does not parse (bad JSON, an unknown layout) is given back as
plain content, never as half-parsed arguments. Formats (names as vLLM's/SGLang's
``--tool-call-parser``):

- ``hermes`` (aliases ``qwen25``, ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (Hermes, Qwen2.5, Qwen3).
- ``qwen3_coder`` (``qwen3_xml``): ``<tool_call><function=NAME><parameter=P>V</parameter>...
  </function></tool_call>``; values are converted to the types of the tool's JSON schema.
- ``llama3_json`` (``llama3``): the whole reply is ``{"name": ..., "parameters": {...}}``
  (several joined by ``;``), optionally after ``<|python_tag|>``; held until the reply ends.
- ``openai`` (``gpt_oss``, ``gpt-oss``): gpt-oss's harmony messages; a message addressed
  ``to=functions.NAME`` is a call, the ``final`` channel is the content, ``analysis`` is
  dropped. Needs the special tokens in the text; held until the reply ends.
- ``gemma4``: ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`` (Gemma 4's
  notation as publicly described; not checked against a real Gemma 4 checkpoint here). Reads
  the text with special tokens kept.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from dflash.serve.protocol import ApiError

ALIASES = {"hermes": "hermes", "qwen25": "hermes", "qwen": "hermes",
           "qwen3_coder": "qwen3_coder", "qwen3_xml": "qwen3_coder",
           "llama3_json": "llama3_json", "llama3": "llama3_json",
           "openai": "openai", "gpt_oss": "openai", "gpt-oss": "openai",
           "gemma4": "gemma4"}  # fmt: skip
PARSER_NAMES = sorted(ALIASES)


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON object string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (with ``index`` for a streamed delta)."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return out if index is None else {"index": index, **out}


@dataclass
class ToolSpec:
    """A request's checked tools: ``tools`` (as given, for the template), ``choice`` ("none",
    "auto", "required" or a function name) and each function's parameter schema by name."""

    tools: list[dict]
    choice: str
    schemas: dict[str, dict]


def check_tools(body: dict) -> ToolSpec | None:
    """Check ``tools`` and ``tool_choice`` of a chat request (the legacy ``functions`` and
    ``function_call`` too). None: no tools.

    Raises:
        ApiError: 400 naming the bad field.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None and body.get("functions") is not None:  # the legacy spelling
        tools = [{"type": "function", "function": f} for f in body["functions"]] \
            if isinstance(body["functions"], list) else body["functions"]  # fmt: skip
        choice = body.get("function_call") if choice is None else choice
        if isinstance(choice, dict) and "name" in choice:
            choice = {"type": "function", "function": {"name": choice["name"]}}
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of function tools.", param="tools")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:  # fmt: skip
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                           "{\"name\": ..., \"parameters\": {...}}}.", param="tools")  # fmt: skip
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object.",
                           param="tools")  # fmt: skip
        schemas[fn["name"]] = params
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tool_choice")  # fmt: skip
        if name not in schemas:
            raise ApiError(400, f"'tool_choice' names the function {name!r}, which is not among "
                           "'tools'.", param="tool_choice")  # fmt: skip
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or a named "
                       "function.", param="tool_choice")  # fmt: skip
    return ToolSpec(tools, choice if isinstance(choice, str) else "auto", schemas)


def history_message(m: dict, where: str) -> dict:
    """The template's view of an assistant message's ``tool_calls`` (arguments as objects, as
    chat templates read them) or a ``tool`` message's ``tool_call_id``/``name``.

    Raises:
        ApiError: 400 for a malformed call.
    """
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise ApiError(400, f"{where}.tool_calls must be a list.", param="messages")
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(400, f"{where}.tool_calls[{j}] needs a function with a name.",
                               param="messages")  # fmt: skip
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments is not valid "
                                   "JSON.", param="messages") from None  # fmt: skip
            entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
            if isinstance(call.get("id"), str):
                entry["id"] = call["id"]
            out["tool_calls"].append(entry)
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def detect_parser(template: str | None, model_type: str | None = None) -> str | None:
    """The parser for a chat template's tool-call format (None: no format recognised)."""
    text = template or ""
    if "<|tool_call>" in text or (model_type or "").startswith("gemma4"):
        return "gemma4"
    if "<tool_call>" in text:
        return "qwen3_coder" if "<function=" in text else "hermes"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    if "<|channel|>" in text or model_type == "gpt_oss":
        return "openai"
    return None


def make_parser(name: str, spec: ToolSpec) -> ToolParser:
    """A fresh parser of the format ``name`` (a key of ``ALIASES``) for one reply; "forced":
    the reply of a forced ``tool_choice`` (generated under a grammar, as vLLM does it): the
    named function's arguments object, or for "required" a JSON list of ``{"name",
    "parameters"}`` objects."""
    if name == "forced":
        return _WholeReply(lambda text: _parse_forced(text, spec.choice))
    kind = ALIASES[name]
    if kind == "hermes":
        return _Tagged("<tool_call>", "</tool_call>", _parse_json_calls)
    if kind == "qwen3_coder":
        return _Tagged("<tool_call>", "</tool_call>", lambda b: _parse_xml_call(b, spec.schemas))
    if kind == "gemma4":
        return _Tagged("<|tool_call>", "<tool_call|>", _parse_gemma4_call, special_tokens=True)
    if kind == "llama3_json":
        return _WholeReply(_parse_llama3)
    return _WholeReply(_parse_harmony, special_tokens=True)


class ToolParser:
    """Streams a reply's text into content and tool-call events (see the module docstring).

    ``special_tokens``: the parser reads the text with special tokens kept."""

    special_tokens = False

    def feed(self, text: str) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def finish(self) -> list[tuple[str, Any]]:
        raise NotImplementedError


def _content(text: str) -> list[tuple[str, Any]]:
    return [("content", text)] if text else []


class _Tagged(ToolParser):
    """Calls between a start and an end tag, anywhere in the reply; text outside is content."""

    def __init__(self, start: str, end: str, parse: Any, special_tokens: bool = False):
        self.start, self.end, self.parse, self.special_tokens = start, end, parse, special_tokens
        self.pending, self.inside = "", False

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.pending += text
        out: list[tuple[str, Any]] = []
        while True:
            if not self.inside:
                i = self.pending.find(self.start)
                if i < 0:  # keep back a tail that may begin the start tag
                    keep = next((k for k in range(min(len(self.start) - 1, len(self.pending)), 0, -1)
                                 if self.start.startswith(self.pending[-k:])), 0)  # fmt: skip
                    cut = len(self.pending) - keep
                    out += _content(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return out
                out += _content(self.pending[:i])
                self.pending, self.inside = self.pending[i + len(self.start) :], True
            j = self.pending.find(self.end)
            if j < 0:
                return out
            block, self.pending, self.inside = self.pending[:j], self.pending[j + len(self.end) :], False
            calls = self.parse(block)
            if calls is None:  # malformed: shown as it came
                out += _content(self.start + block + self.end)
            else:
                out += [("call", c) for c in calls]

    def finish(self) -> list[tuple[str, Any]]:
        rest = (self.start if self.inside else "") + self.pending
        self.pending, self.inside = "", False
        return _content(rest)


class _WholeReply(ToolParser):
    """Formats read from the whole reply (held back until it ends; plain content if no call)."""

    def __init__(self, parse: Any, special_tokens: bool = False):
        self.parse, self.special_tokens, self.text = parse, special_tokens, ""

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.text += text
        return []

    def finish(self) -> list[tuple[str, Any]]:
        return self.parse(self.text)


def _arguments(value: Any) -> str | None:
    """Arguments as a JSON object string (a string holding an object is accepted)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call_from(obj: Any, key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    text = _arguments(args)
    return None if text is None else ToolCall(obj["name"], text)


def _parse_json_calls(block: str) -> list[ToolCall] | None:
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    call = _call_from(obj)
    return None if call is None else [call]


def _convert(value: str, schema: dict | None) -> Any:
    """A qwen3_coder parameter's text as the type its schema names (the text if it does not fit)."""
    kind = (schema or {}).get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None or "string" in kinds:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _parse_xml_call(block: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
    m = re.fullmatch(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", block, re.DOTALL)
    if m is None:
        return None
    name, body = m.group(1), m.group(2)
    props = schemas.get(name, {}).get("properties", {})
    args: dict[str, Any] = {}
    rest = body
    for p in re.finditer(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", body, re.DOTALL):
        args[p.group(1)] = _convert(p.group(2), props.get(p.group(1)))
        rest = rest.replace(p.group(0), "", 1)
    if rest.strip():  # text outside any parameter: not a call we understand
        return None
    return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


def _parse_llama3(text: str) -> list[tuple[str, Any]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        return _content(text)
    calls, i, decoder = [], 0, json.JSONDecoder()
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return _content(text)
        call = _call_from(obj, "parameters")
        if call is None:
            return _content(text)
        calls.append(call)
        while i < len(body) and body[i] in " \t\n;":
            i += 1
    return [("call", c) for c in calls]


def _parse_forced(text: str, choice: str) -> list[tuple[str, Any]]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return _content(text)  # e.g. cut by the budget
    if choice != "required":
        args = _arguments(obj)
        return [("call", ToolCall(choice, args))] if args is not None else _content(text)
    calls = [_call_from(o, "parameters") for o in obj] if isinstance(obj, list) else [None]
    if not calls or any(c is None for c in calls):
        return _content(text)
    return [("call", c) for c in calls]


_HARMONY_END = re.compile(r"<\|(?:end|call|return)\|>")


def _parse_harmony(text: str) -> list[tuple[str, Any]]:
    if "<|message|>" not in text:
        return _content(_HARMONY_END.sub("", text))
    out: list[tuple[str, Any]] = []
    for part in re.split(r"<\|start\|>", text):
        head, sep, body = part.partition("<|message|>")
        if not sep:
            continue
        body = _HARMONY_END.split(body, maxsplit=1)[0]
        to = re.search(r"to=functions\.([^\s<]+)", head)
        channel = re.search(r"<\|channel\|>\s*(\w+)", head)
        if to is not None:
            args = _arguments(body.strip() or "{}")
            out += [("call", ToolCall(to.group(1), args))] if args is not None else _content(body)
        elif channel is None or channel.group(1) == "final":
            out += _content(body)
    return out


def _gemma4_value(s: str, i: int) -> tuple[Any, int]:
    """Parse one value of Gemma 4's argument notation at s[i:] -> (value, index after it)."""
    quote = '<|"|>'
    while i < len(s) and s[i].isspace():
        i += 1
    if s.startswith(quote, i):
        j = s.index(quote, i + len(quote))
        return s[i + len(quote) : j], j + len(quote)
    if s.startswith("{", i) or s.startswith("[", i):
        closing, is_obj = ("}", True) if s[i] == "{" else ("]", False)
        items: Any = {} if is_obj else []
        i += 1
        while True:
            while i < len(s) and s[i] in " \n\t,":
                i += 1
            if s.startswith(closing, i):
                return items, i + 1
            if is_obj:
                j = s.index(":", i)
                key = s[i:j].strip().strip('"')
                if s.startswith(quote, i):
                    key, j = s[i + len(quote) : s.index(quote, i + len(quote))], \
                        s.index(":", s.index(quote, i + len(quote)))  # fmt: skip
                items[key], i = _gemma4_value(s, j + 1)
            else:
                value, i = _gemma4_value(s, i)
                items.append(value)
    m = re.compile(r"[^,}\]]*").match(s, i)
    raw = m.group(0).strip()
    try:
        return json.loads(raw), m.end()
    except json.JSONDecodeError:
        return raw, m.end()


def _parse_gemma4_call(block: str) -> list[ToolCall] | None:
    m = re.fullmatch(r"\s*call:([\w.\-]+)\s*(\{.*\})\s*", block, re.DOTALL)
    if m is None:
        return None
    try:
        args, end = _gemma4_value(m.group(2), 0)
    except (ValueError, IndexError):
        return None
    if not isinstance(args, dict) or m.group(2)[end:].strip():
        return None
    return [ToolCall(m.group(1), json.dumps(args, ensure_ascii=False))]
