"""``--dataset long``: synthetic long prompts, for τ and speedup by prompt length.

Each prompt is a stack of numbered questions taken from the benchmark prompts shipped with
dflash (gsm8k, math500, MT-Bench first turns; MIT and Apache-2.0, see
``dflash/assets/datasets/NOTICE.md``), filled up to a length in characters, followed by the
request to answer the last one step by step. The target must attend to the whole context while
the draft predicts the answer: what long prompts do to acceptance and speed, without a
download. Deterministic: no randomness beyond the fixed order of the shipped rows.

    long            the buckets 1k-2k, 2k-4k, ... 32k-64k tokens, two prompts each (12)
    long:8k         two prompts in the 8k-16k bucket
    long:1k-8k      two prompts each in 1k-2k, 2k-4k, 4k-8k and 8k-16k

A prompt for bucket k-2k (k = 1024 tokens x 1, 2, 4, ...) is aimed at 1.4 k tokens with
:data:`CHARS_PER_TOKEN`, so it lands in its bucket for 2.8 to 5.6 characters per token; the
report buckets by the real prompt length in tokens. The order is ascending length (the first
prompt of each length, then the second), and ``--max-samples N`` keeps the first N of it.
"""

from __future__ import annotations

import re

from dflash.errors import DatasetError

CHARS_PER_TOKEN = 4.0  # English text in Llama/Qwen tokenizers: about 4 characters per token
LENGTHS_K = (1, 2, 4, 8, 16, 32)  # thousands of tokens
PROMPTS_PER_LENGTH = 2
ASK = ("\n\nAbove are {n} numbered questions. Answer only question {n}, the last one, step by step, "
       "and put the final answer within \\boxed{{}}.")  # fmt: skip


def lengths(spec: str) -> list[int]:
    """The buckets' lower ends in tokens (1024 per k) asked for by ``long``, ``long:8k`` or
    ``long:1k-8k``.

    Raises:
        DatasetError: another spelling, or a length outside 1k..128k.
    """
    m = re.fullmatch(r"long(?::(\d+)k(?:-(\d+)k)?)?", spec.strip().lower())
    if m is None:
        raise DatasetError(f"Unknown long-context dataset {spec!r}.", hint="use long, long:8k or long:1k-8k")
    lo = int(m.group(1)) if m.group(1) else LENGTHS_K[0]
    hi = int(m.group(2)) if m.group(2) else (lo if m.group(1) else LENGTHS_K[-1])
    if not 1 <= lo <= hi <= 128:
        raise DatasetError(f"{spec}: lengths must be 1k to 128k, the first no larger than the second.",
                           hint="e.g. long:1k-32k")  # fmt: skip
    out, k = [], lo
    while k <= hi:  # powers of two from lo
        out.append(k * 1024)
        k *= 2
    return out


def _questions() -> list[str]:
    """The shipped questions, interleaved across sets (gsm8k, math500, MT-Bench first turns)."""
    from dflash.data.offline import shipped_rows

    sets = [[r["question"] for r in shipped_rows("gsm8k")[0]],
            [r["problem"] for r in shipped_rows("math500")[0]],
            [r["turns"][0] for r in shipped_rows("mt-bench")[0]]]  # fmt: skip
    out = []
    for i in range(max(map(len, sets))):
        out += [s[i] for s in sets if i < len(s)]
    return out


def long_prompts(spec: str) -> list:
    """The prompt items of a ``long`` spec (see the module docstring), ids ``long/<k>k-<j>``.

    Raises:
        DatasetError: a bad spec.
    """
    from dflash.data.items import PromptItem
    from dflash.data.offline import ShippedPrompts

    wanted = lengths(spec)
    pool = _questions()
    items = []
    for j in range(PROMPTS_PER_LENGTH):
        for tokens in wanted:
            budget = 1.4 * tokens * CHARS_PER_TOKEN
            parts: list[str] = []
            size, i = 0, 7919 * j  # the second prompt starts elsewhere in the pool
            while size < budget or not parts:
                q = pool[i % len(pool)]
                parts.append(f"Question {len(parts) + 1}: {q}")
                size += len(parts[-1]) + 2
                i += 1
            text = "\n\n".join(parts) + ASK.format(n=len(parts))
            items.append(PromptItem(f"long/{tokens // 1024}k-{j}", [text]))
    return ShippedPrompts(items, len(items))
