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


def test_gguf_conversion_parses_the_file_once(tmp_path):
    """During a conversion, readers of one GGUF file and gguf's tensor-name maps are shared
    (transformers parses the file once per step otherwise), and both are restored after."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from dflash.models.target_torch import _gguf_read_once

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_read_once():
        a, b = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert a is b and isinstance(a, reader_cls)
        assert [t.name for t in a.tensors] == ["token_embd.weight"]
        m1 = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert m1 is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert m1 is not gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3)
    assert gguf.GGUFReader is reader_cls and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_gguf_key_is_hashed_once_per_file_version(tmp_path, monkeypatch):
    """A GGUF file's cache key is its SHA-256 prefix, hashed once per file version: a second
    lookup reads the index; a rewritten file is hashed again, also at the same size with its
    modification time put back; a stored value that is not a key and a corrupt index are
    ignored."""
    import hashlib
    import os

    from dflash.models import target_torch

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    hashed = []
    real = target_torch._sha256
    monkeypatch.setattr(target_torch, "_sha256", lambda p: hashed.append(p) or real(p))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF one")
    want = hashlib.sha256(b"GGUF one").hexdigest()[:16]
    assert target_torch.gguf_key(f) == want and target_torch.gguf_key(f) == want
    assert len(hashed) == 1
    kept = f.stat().st_mtime_ns
    f.write_bytes(b"GGUF 2nd")  # the same size, the modification time put back (cp -p)
    os.utime(f, ns=(kept, kept))
    assert target_torch.gguf_key(f) == hashlib.sha256(b"GGUF 2nd").hexdigest()[:16]
    assert len(hashed) == 2
    f.write_bytes(b"GGUF two, longer")
    assert target_torch.gguf_key(f) == hashlib.sha256(b"GGUF two, longer").hexdigest()[:16]
    assert len(hashed) == 3
    index = tmp_path / "cache" / "gguf-keys.json"
    index.write_text(index.read_text().replace(target_torch.gguf_key(f), "../../escape"))  # not a key
    assert target_torch.gguf_key(f) == hashlib.sha256(b"GGUF two, longer").hexdigest()[:16]
    index.write_text("[not an index")
    assert target_torch.gguf_key(f) == hashlib.sha256(b"GGUF two, longer").hexdigest()[:16]
    assert len(hashed) == 5 and [p.name for p in index.parent.iterdir()] == ["gguf-keys.json"]  # no temp left
