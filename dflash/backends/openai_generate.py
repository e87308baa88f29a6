"""``dflash generate openai``: one chat completion against an OpenAI-compatible server.

Streams the reply over SSE and prints it as it arrives: reasoning content (when the server splits
it out) under a ``[reasoning]`` label, then the answer under ``[answer]``; without reasoning only
the answer is printed, unlabelled. A one-line summary goes to stderr. No torch/mlx import.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx

from dflash.backends.openai import (
    ChatResult,
    RetryPolicy,
    api_root,
    chat_body,
    chat_completion,
    chat_error_hint,
    first_model,
)
from dflash.backends.openai_stats import meta_stats
from dflash.errors import InputError, ServerError
from dflash.types import SamplingParams


class _Printer:
    """Writes deltas to stdout, labelling reasoning and answer when both appear."""

    def __init__(self) -> None:
        self.section: str | None = None

    def __call__(self, kind: str, text: str) -> None:
        if kind == "reasoning" and self.section != "reasoning":
            sys.stdout.write("[reasoning]\n")
        elif kind == "content" and self.section == "reasoning":
            sys.stdout.write("\n[answer]\n")
        self.section = kind
        sys.stdout.write(text)
        sys.stdout.flush()


def generate_openai(
    prompt: str,
    *,
    base_url: str,
    model: str | None,
    api_key: str | None,
    timeout_s: float,
    max_new_tokens: int,
    sampling: SamplingParams,
    reasoning: str | None,
    system: str | None,
    json_out: bool,
    max_retries: int = 3,
) -> ChatResult:
    """Ask the server once and print the reply (streamed, or one JSON object with ``json_out``).

    Raises:
        InputError: bad URL, budget or timeout.
        ServerError: the server cannot be reached or answers with an error.
    """
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {max_new_tokens}.", hint="e.g. --max-new-tokens 256")
    if not timeout_s > 0:
        raise InputError(f"--timeout-s must be > 0, got {timeout_s}.",
                         hint="it is the seconds to wait for the reply, e.g. --timeout-s 600")  # fmt: skip
    root = api_root(base_url)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return asyncio.run(_run(root, messages, model, api_key, timeout_s, max_new_tokens, sampling,
                            reasoning, json_out, max_retries))  # fmt: skip


async def _run(root: str, messages: list[dict], model: str | None, api_key: str | None,
               timeout_s: float, max_new_tokens: int, sampling: SamplingParams,
               reasoning: str | None, json_out: bool, max_retries: int) -> ChatResult:  # fmt: skip
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        name = model or await first_model(client, root, api_key)
        body = chat_body(name, messages, max_new_tokens, sampling, reasoning=reasoning,
                         stream=not json_out)  # fmt: skip
        printer = None if json_out else _Printer()
        result = await chat_completion(client, root, body, api_key=api_key,
                                       retry=RetryPolicy(max_retries=max_retries),
                                       on_delta=printer)  # fmt: skip
    if not result.ok:
        if printer is not None and printer.section is not None:
            sys.stdout.write("\n")
        hint = "raise --timeout-s" if result.error_kind == "timeout" else chat_error_hint(result.status, result.error)
        raise ServerError(f"{root}/chat/completions failed: {result.error.rstrip('.')}.", hint=hint)
    stats = meta_stats(result.meta)
    if json_out:
        print(json.dumps(_as_json(name, root, result, stats, reasoning), ensure_ascii=False))
        return result
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(_summary(name, result, stats), file=sys.stderr)
    return result


def _as_json(model: str, root: str, r: ChatResult, stats: dict | None,
             reasoning: str | None) -> dict[str, Any]:  # fmt: skip
    return {
        "text": r.text, "reasoning": r.reasoning, "finish_reason": r.finish_reason,
        "model": model, "base_url": root, "prompt_tokens": r.prompt_tokens,
        "new_tokens": r.completion_tokens, "e2e_s": r.e2e_s, "reasoning_setting": reasoning,
        "mean_acceptance_length": stats["tau"] if stats else None,
        "verify_steps": stats["verify_ct"] if stats else None,
        "acceptance_histogram": stats["histogram"] if stats else None,
        "meta_info": r.meta,
    }  # fmt: skip


def _summary(model: str, r: ChatResult, stats: dict | None) -> str:
    n = r.new_tokens
    unit = "new tokens" if r.completion_tokens is not None else "chunks (no usage reported)"
    parts = [f"{n} {unit}"]
    if r.ttft_s is not None and r.e2e_s is not None:
        decode = r.e2e_s - r.ttft_s
        if n > 1 and decode > 0:
            parts.append(f"decode {(n - 1) / decode:.1f} tok/s")
        parts.append(f"TTFT {r.ttft_s * 1000:.0f} ms")
    if stats:
        steps = f" | {stats['verify_ct']} verify steps" if stats["verify_ct"] is not None else ""
        parts.append(f"mean acceptance length τ {stats['tau']:.2f}{steps}")
    else:
        parts.append("acceptance: not reported by server")
    parts.append(f"model {model}")
    return "[" + " | ".join(parts) + "]"
