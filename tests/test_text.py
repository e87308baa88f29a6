"""Incremental detokenization and reasoning switches (no model weights needed)."""

from __future__ import annotations

import pytest

from dflash.api import TextStream, reasoning_kwargs
from dflash.errors import InputError


@pytest.fixture(scope="module")
def tokenizer(demo_gguf):
    from transformers import AutoTokenizer

    from dflash.models.target_torch import gguf_to_cached_folder

    return AutoTokenizer.from_pretrained(str(gguf_to_cached_folder(demo_gguf)))


def test_stream_never_prints_broken_characters(tokenizer):
    text = "Héllo wörld 🙂🚀 世界 — naïve café ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # multi-byte characters span several byte tokens
    stream = TextStream(tokenizer)
    chunks = [stream.feed([i], final=(k == len(ids) - 1)) for k, i in enumerate(ids)]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_reasoning_kwargs():
    qwen = "{% if enable_thinking is defined and enable_thinking is false %}...{% endif %}"
    assert reasoning_kwargs(qwen, None) == {}
    assert reasoning_kwargs(qwen, "on") == {"enable_thinking": True}
    assert reasoning_kwargs(qwen, "OFF") == {"enable_thinking": False}
    assert reasoning_kwargs("{{ reasoning_effort }}", "high") == {"reasoning_effort": "high"}
    assert reasoning_kwargs("{{ reasoning_strength }} {{ reasoning_effort }}", "low") == {"reasoning_strength": "low"}
    with pytest.raises(InputError, match="no reasoning switch"):
        reasoning_kwargs("plain template", "on")
    with pytest.raises(InputError, match="Unknown --reasoning level"):
        reasoning_kwargs(qwen, "turbo")
