"""Structured output for ``dflash serve`` through llguidance (``pip install "dflash[serve]"``).

``response_format`` (``json_object``, ``json_schema``) and vLLM's ``guided_json``,
``guided_regex`` and ``guided_choice`` become one llguidance grammar per request; each choice
gets a fresh matcher, handed to the speculative loop as its ``processor``
(:func:`dflash.loop.speculative_generate`):

- the target's logits of every verify row are masked to the tokens the grammar allows after the
  committed tokens and the proposals before that row (-inf elsewhere), so greedy acceptance
  compares the proposals with the constrained argmax and sampling draws from the constrained
  distribution: the output is exactly what plain decoding under the grammar gives, at any
  block size. A proposal the grammar refuses is simply not accepted.
- the draft's proposals are chosen among the allowed tokens too (argmax of the draft's logits
  under the same masks, walked position by position), which keeps acceptance up; the masks of
  the verify rows are the ones computed for the proposals.
- committed tokens advance the matcher; with the grammar complete only the end-of-sequence
  tokens remain allowed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from dflash.serve.protocol import ApiError

_TOKENIZERS: dict[int, Any] = {}  # id(HF tokenizer) -> llguidance tokenizer (built once)


def _llg():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError:
        raise ApiError(400, "Structured output needs llguidance on the server "
                       "(pip install \"dflash[serve]\").", param="response_format") from None  # fmt: skip
    return llguidance


def spec_from(body: dict) -> tuple[str, str] | None:
    """(llguidance grammar, the field it came from) of a request, or None (free text).

    Raises:
        ApiError: 400 for a malformed ``response_format`` or ``guided_*`` value, or more than
            one of them.
    """
    asked = [k for k in ("guided_json", "guided_regex", "guided_choice") if body.get(k) is not None]
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        asked.append("response_format")
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(400, f"Send one structured-output field, not {' and '.join(asked)}.",
                       param=asked[1])  # fmt: skip
    key = asked[0]
    llg = _llg().LLMatcher
    if key == "response_format":
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            return llg.grammar_from_json_schema({"type": "object"}), key
        schema = (fmt.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
        if not isinstance(schema, dict):
            raise ApiError(400, "'response_format' must be {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": "
                           "{...}}}.", param=key)  # fmt: skip
        return _json_grammar(llg, schema, key), key
    value = body[key]
    if key == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = None
        if not isinstance(value, dict):
            raise ApiError(400, "'guided_json' must be a JSON schema object.", param=key)
        return _json_grammar(llg, value, key), key
    if key == "guided_regex":
        if not isinstance(value, str) or not value:
            raise ApiError(400, "'guided_regex' must be a non-empty regular expression.", param=key)
        return llg.grammar_from_regex(value), key
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise ApiError(400, "'guided_choice' must be a non-empty list of non-empty strings.", param=key)
    return llg.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value)), key


def _json_grammar(llg: Any, schema: dict, key: str) -> str:
    try:
        return llg.grammar_from_json_schema(schema)
    except ValueError as err:
        raise ApiError(400, f"'{key}' is not a usable JSON schema: {err}", param=key) from None


def tool_grammar(schemas: dict[str, dict], choice: str) -> str:
    """The grammar of a forced tool call (vLLM's way): ``tool_choice`` naming a function -> the
    arguments object of its schema; ``required`` -> a JSON list of one or more
    ``{"name", "parameters"}`` objects among the tools."""
    llg = _llg().LLMatcher
    if choice != "required":
        return _json_grammar(llg, schemas[choice], "tools")
    items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in schemas.items()]  # fmt: skip
    return _json_grammar(llg, {"type": "array", "minItems": 1, "items": {"anyOf": items}}, "tools")


class Grammar:
    """A request's checked grammar; :meth:`processor` gives a fresh matcher per choice.

    Args:
        grammar: llguidance grammar text.
        param: the request field it came from (named in errors).
    """

    def __init__(self, grammar: str, param: str):
        self.grammar, self.param = grammar, param

    def check(self, pipe: Any) -> None:
        """ApiError 400 when llguidance refuses the grammar for this tokenizer."""
        error = _llg().LLMatcher.validate_grammar(self.grammar, self.tokenizer(pipe))
        if error:
            raise ApiError(400, f"'{self.param}' cannot be used: {error}", param=self.param)

    @staticmethod
    def tokenizer(pipe: Any) -> Any:
        """The llguidance view of the pipeline's tokenizer (built once, ~1 s)."""
        key = id(pipe.tokenizer)
        if key not in _TOKENIZERS:
            llg = _llg()
            _TOKENIZERS[key] = llg.hf.from_tokenizer(pipe.tokenizer, n_vocab=pipe.backend.vocab_size,
                                                     eos_token=list(pipe.stop_ids))  # fmt: skip
        return _TOKENIZERS[key]

    def processor(self, pipe: Any) -> GrammarProcessor:
        """A fresh constraint for one choice (see :mod:`dflash.serve.grammar`)."""
        matcher = _llg().LLMatcher(self.tokenizer(pipe), self.grammar)
        return GrammarProcessor(matcher, pipe.backend.vocab_size, pipe.stop_ids)


class GrammarProcessor:
    """The loop's ``processor`` over an llguidance matcher (torch logits on any device).

    Args:
        matcher: an ``llguidance.LLMatcher`` at the start of the reply.
        vocab: V, the logits' width (rows past the tokenizer's ids are never allowed).
        stop_ids: end-of-sequence ids: never consumed while walking proposals (a matcher that
            consumed one cannot be rolled back; nothing follows one anyway).
    """

    def __init__(self, matcher: Any, vocab: int, stop_ids: list[int] | tuple[int, ...] = ()):
        self.matcher, self.vocab, self.stops = matcher, vocab, set(stop_ids)
        self.cached: tuple[tuple[int, ...], list[np.ndarray]] | None = None

    def _allowed(self) -> np.ndarray:
        """Bool [V]: the tokens allowed next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)[: self.vocab]
        if allowed.shape[0] < self.vocab:
            allowed = np.concatenate([allowed, np.zeros(self.vocab - allowed.shape[0], bool)])
        return allowed

    def _walk(self, tokens: list[int], rows: int) -> list[np.ndarray]:
        """Masks of rows 0..rows-1: row i after tokens[:i]; stops early at a refused token
        (later rows do not matter: acceptance ends there)."""
        masks, taken = [], 0
        for i in range(rows):
            if i > 0:
                tok = tokens[i - 1]
                if tok in self.stops or not masks[-1][tok] or not self.matcher.consume_token(tok):
                    break
                taken += 1
            masks.append(self._allowed())
        self.matcher.rollback(taken)
        return masks

    def mask(self, logits: Any, tokens: Any) -> Any:
        """logits [R, V] with row i limited to what the grammar allows after ``tokens[:i]``."""
        import torch

        ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if self.cached is not None and self.cached[0] == tuple(ids) and len(self.cached[1]) >= len(ids):
            masks = self.cached[1]
        else:
            masks = self._walk(ids, logits.shape[0])
        self.cached = None
        out = logits.clone()
        for i, allowed in enumerate(masks[: logits.shape[0]]):
            keep = torch.from_numpy(allowed).to(out.device)
            out[i] = out[i].masked_fill(~keep, float("-inf"))
        return out

    def propose(self, proposals: Any, draft_logits: Any) -> Any:
        """The draft's argmax among allowed tokens at each position (proposals unchanged when the
        draft gives no logits, e.g. DFlash2's selector); the masks are kept for :meth:`mask`."""
        if draft_logits is None or draft_logits.shape[-1] != self.vocab:
            return proposals
        import torch

        n, out, masks, taken = proposals.shape[0], proposals.clone(), [], 0
        for i in range(n + 1):
            allowed = self._allowed()
            masks.append(allowed)
            if i == n or not allowed.any():
                break
            keep = torch.from_numpy(allowed).to(draft_logits.device)
            pick = int(draft_logits[i].masked_fill(~keep, float("-inf")).argmax())
            out[i] = pick
            if pick in self.stops or not self.matcher.consume_token(pick):
                break
            taken += 1
        self.matcher.rollback(taken)
        self.cached = (tuple(out.tolist()), masks)
        return out

    def commit(self, tokens: list[int]) -> None:
        """Advance the matcher by committed tokens."""
        self.matcher.consume_tokens(list(tokens))
