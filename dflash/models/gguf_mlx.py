"""Convert a llama-architecture GGUF file into an mlx-lm folder, torch-free (mlx-facts §4 route B).

``mx.load`` reads GGUF: Q4_0/Q4_1/Q8_0 tensors come back as MLX affine-quantized triples
(``weight`` uint32, ``scales``, ``biases``; group size 32), which are kept as they are. The
converter renames llama.cpp tensor names to mlx-lm's, undoes llama.cpp's rotary row permutation of
the Q and K projections (a row permutation, so it applies to packed weights, scales and biases
alike), casts float16 scales/biases/weights to float32 (fast on CPU; float16 activations are
pathologically slow there), and writes ``config.json`` with a top-level ``rope_theta`` (mlx-lm's
llama loader ignores transformers 5's ``rope_parameters``) and a per-layer ``quantization`` map.
The tokenizer is transformers' GGUF tokenizer (needs the ``gguf`` package).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

from dflash.errors import BackendError, CheckpointError
from dflash.models.target_torch import cache_root, gguf_key

GROUP = 32  # every GGUF block format mx.load keeps quantized uses 32-element groups
NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}  # fmt: skip


def _scalar(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    return v.item() if isinstance(v, mx.array) else v


def _mlx_name(name: str) -> str | None:
    """llama.cpp tensor name -> mlx-lm llama name (None for tensors mlx-lm does not use)."""
    base, _, suffix = name.rpartition(".")
    if base == "token_embd":
        return f"model.embed_tokens.{suffix}"
    if base == "output_norm":
        return f"model.norm.{suffix}"
    if base == "output":
        return f"lm_head.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in NAMES:
        return f"model.layers.{parts[1]}.{NAMES[parts[2]]}.{suffix}"
    return None


def _unpermute(x: mx.array, heads: int) -> mx.array:
    """Invert llama.cpp's rope permutation of Q/K rows (first axis), any trailing shape."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def convert_weights(weights: dict[str, mx.array], heads: int, kv_heads: int):
    """Rename, un-permute and cast; returns (mlx-lm weights, per-tensor (bits, group) map)."""
    out: dict[str, mx.array] = {}
    quant: dict[str, dict[str, int]] = {}
    for name, x in weights.items():
        new = _mlx_name(name)
        if new is None:
            continue
        if ".attn_q." in name:
            x = _unpermute(x, heads)
        elif ".attn_k." in name:
            x = _unpermute(x, kv_heads)
        if x.dtype in (mx.float16, mx.bfloat16):
            x = x.astype(mx.float32)
        out[new] = x
    for new, x in out.items():
        if new.endswith(".scales"):
            module = new[: -len(".scales")]
            packed = out[f"{module}.weight"].shape[-1]
            in_features = x.shape[-1] * GROUP
            quant[module] = {"group_size": GROUP, "bits": packed * 32 // in_features}
    return out, quant


def config_from_metadata(meta: dict, weights: dict[str, mx.array], vocab: int) -> dict:
    """An mlx-lm llama config.json from GGUF metadata.

    Raises:
        CheckpointError: the file is not a llama-architecture model.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"The mlx backend converts llama-architecture GGUF files only "
                              f"(this one is {arch!r}).", hint="convert it with mlx_lm.convert "
                              "from the original checkpoint")  # fmt: skip
    heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_scalar(meta, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(
            f"{_scalar(meta, 'llama.attention.layer_norm_rms_epsilon', 1e-5):.6g}"
        ),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base", 10000.0)),  # top level!
        "max_position_embeddings": int(_scalar(meta, "llama.context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in weights,
    }
    for key, meta_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):  # fmt: skip
        if meta_key in meta:
            cfg[key] = int(_scalar(meta, meta_key))
    return cfg


def gguf_to_mlx_folder(gguf: Path) -> Path:
    """Convert a GGUF file once into an mlx-lm folder under ``cache_root()/mlx/<sha256[:16]>``.

    Raises:
        CheckpointError: missing or unreadable file, or a non-llama architecture.
        BackendError: transformers or gguf (needed for the tokenizer) is not installed.
    """
    gguf = Path(gguf)
    if not gguf.is_file():
        raise CheckpointError(f"GGUF file {gguf} does not exist.")
    folder = cache_root() / "mlx" / gguf_key(gguf)
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    import sys

    from dflash.progress import step_progress

    print(f"dflash: converting {gguf.name} to an mlx-lm folder once (cached in {folder.parent})",
          file=sys.stderr, flush=True)  # fmt: skip
    with step_progress("reading the weights", None) as advance:
        _convert(gguf, folder, advance)
    return folder


def _convert(gguf: Path, folder: Path, advance) -> None:
    """Write the mlx-lm folder of ``gguf`` (weights, config, tokenizer), reporting each phase
    to ``advance``.

    Raises:
        CheckpointError, BackendError: as :func:`gguf_to_mlx_folder`.
    """
    try:
        weights, meta = mx.load(str(gguf), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise CheckpointError(f"mlx cannot read GGUF file {gguf}: {e}.",
                              hint="mlx reads F32/F16/Q4_0/Q4_1/Q8_0 and some K-quants") from e  # fmt: skip
    vocab = int(weights["token_embd.weight"].shape[0])
    cfg = config_from_metadata(meta, weights, vocab)
    out, quant = convert_weights(weights, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    if quant:
        common = max(quant.values(), key=list(quant.values()).count)
        cfg["quantization"] = {**common, **{k: v for k, v in quant.items() if v != common}}
    advance(0, description="writing the mlx-lm folder")
    tmp = folder.with_name(folder.name + ".tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"Cannot create the cache folder {tmp}: {e.strerror}.",
                              hint="set DFLASH_CACHE to a writable folder") from e  # fmt: skip
    _save_tokenizer(gguf, tmp)
    mx.save_safetensors(str(tmp / "model.safetensors"), out, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (tmp / "dflash_source.json").write_text(json.dumps({"gguf": str(gguf)}))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)


def _save_tokenizer(gguf: Path, out: Path) -> None:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError as e:
        raise BackendError(f"Reading the GGUF tokenizer needs an extra package: {e}.",
                           hint="pip install transformers gguf") from e  # fmt: skip
    except Exception as e:  # transformers raises many types for a bad file
        raise CheckpointError(f"Cannot read the tokenizer of {gguf}: {e}.") from e
    tok.save_pretrained(str(out))
