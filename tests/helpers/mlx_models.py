"""Tiny random mlx-lm targets (dense Qwen3/Llama, hybrid qwen3_next/qwen3_5, sliding-window
gemma3_text/gemma4_text/gpt_oss) and drafts for them, built in the test itself: hidden 64, a few layers, a 1000-word WordLevel tokenizer (mlx-facts §3).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from tests.helpers.tiny import ScriptedBackend

VOCAB = 1000
CHATML = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
BASE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "rope_theta": 10000.0}  # fmt: skip
CONFIGS = {
    "qwen3": {**BASE, "model_type": "qwen3", "num_hidden_layers": 4},
    "llama": {**BASE, "model_type": "llama", "num_hidden_layers": 4, "tie_word_embeddings": False},
    "qwen3_next": {**BASE, "model_type": "qwen3_next", "num_hidden_layers": 4,
                   "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 32, "linear_value_head_dim": 16,
                   "linear_conv_kernel_dim": 4, "num_experts": 0, "num_experts_per_tok": 1,
                   "decoder_sparse_step": 1, "shared_expert_intermediate_size": 128,
                   "mlp_only_layers": [], "moe_intermediate_size": 128,
                   "partial_rotary_factor": 0.5, "full_attention_interval": 4},
    "qwen3_5": {"model_type": "qwen3_5", "tie_word_embeddings": True,
                "text_config": {**BASE, "model_type": "qwen3_5_text", "num_hidden_layers": 4,
                                "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                                "linear_key_head_dim": 32, "linear_value_head_dim": 16,
                                "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                                "rope_parameters": {"type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.5}}},
    # sliding windows (rotating caches) shorter than the prompts and, for gemma3_text, than a block
    "gemma3_text": {**BASE, "model_type": "gemma3_text", "num_hidden_layers": 4,
                    "query_pre_attn_scalar": 16, "sliding_window": 8,
                    "sliding_window_pattern": 2, "rope_local_base_freq": 10000.0},
    "gemma4_text": {**BASE, "model_type": "gemma4_text", "num_hidden_layers": 6,
                    "global_head_dim": 32, "num_kv_shared_layers": 2,
                    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
                    "sliding_window": 12, "sliding_window_pattern": 3,
                    "layer_types": ["sliding_attention"] * 2 + ["full_attention"]
                    + ["sliding_attention"] * 2 + ["full_attention"],
                    "final_logit_softcapping": 30.0, "use_double_wide_mlp": True},
    # the multimodal wrapper of Gemma 4 31B / 26B-A4B: K = V on full layers, an MoE block
    "gemma4": {"model_type": "gemma4", "vocab_size": VOCAB, "tie_word_embeddings": True,
               "text_config": {**BASE, "model_type": "gemma4_text", "num_hidden_layers": 4,
                               "global_head_dim": 32, "num_kv_shared_layers": 0,
                               "hidden_size_per_layer_input": 0, "sliding_window": 8,
                               "sliding_window_pattern": 2, "attention_k_eq_v": True,
                               "layer_types": ["sliding_attention", "full_attention"] * 2,
                               "num_global_key_value_heads": 1, "enable_moe_block": True,
                               "num_experts": 4, "top_k_experts": 2,
                               "moe_intermediate_size": 32, "use_double_wide_mlp": False}},
    "gpt_oss": {**BASE, "model_type": "gpt_oss", "num_hidden_layers": 4, "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 24, "tie_word_embeddings": False,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
}  # fmt: skip
SLIDING = ("gemma3_text", "gemma4_text", "gemma4", "gpt_oss")
# weight scales other than 4: larger weights make these tiny gemma4 targets repeat one token
SCALES = {"gemma4_text": 0.5, "gemma4": 0.5}


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer: <unk>, <|endoftext|>, <|im_start|>, <|im_end|> (eos), w4..w999."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(4, VOCAB)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)  # fmt: skip
    fast.add_special_tokens({"additional_special_tokens": specials[1:3]})
    fast.save_pretrained(str(folder))


def build_target(folder: Path, kind: str, seed: int = 0, scale: float | None = None) -> Path:
    """Write a random mlx-lm model folder of family ``kind`` (see CONFIGS); returns it.

    Weights are the default init times ``scale`` (default 4, see SCALES: varied greedy
    continuations; the default init repeats one token).
    """
    import importlib

    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_config, save_model

    scale = SCALES.get(kind, 4.0) if scale is None else scale
    cfg = json.loads(json.dumps(CONFIGS[kind]))
    module = importlib.import_module(f"mlx_lm.models.{kind}")
    mx.random.seed(seed)  # before the model's own init: the same weights in every process
    model = module.Model(module.ModelArgs.from_dict(cfg))
    params = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight") or "A_log" in name or "dt_bias" in name:
            params.append((name, p))
        else:
            params.append((name, scale * p + 0.02 * mx.random.normal(p.shape)))
    model.load_weights(params)
    mx.eval(model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    save_config(cfg, folder / "config.json")
    save_tokenizer(folder)
    return folder


def build_draft(folder: Path, target_dir: Path, layers: int = 2, block_size: int = 16,
                seed: int = 0, std: float = 0.02) -> Path:  # fmt: skip
    """An untrained DFlash draft for a tiny target, written torch-free by the MLX draft code."""
    from dflash.models.draft_mlx import random_draft_mlx, save_draft_mlx
    from dflash.models.init_draft import draft_config_for

    cfg = json.loads((target_dir / "config.json").read_text())
    text = SimpleNamespace(**{**cfg, **cfg.get("text_config", {})})
    dcfg = draft_config_for(text, layers=layers, block_size=block_size, mask_token_id=1,
                            vocab_rows=VOCAB)  # fmt: skip
    return save_draft_mlx(random_draft_mlx(dcfg, seed=seed, std=std), folder, dtype="float32")


def greedy_reference(target_dir: Path, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy decoding (generate_step with argmax): n new token ids."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(target_dir))
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
    return out


def random_prompt(n: int, seed: int = 0) -> list[int]:
    """n token ids from the word range (no special tokens)."""
    return [int(i) for i in np.random.default_rng(seed).integers(4, VOCAB, size=n)]


class MlxScriptedBackend(ScriptedBackend):
    """The scripted draft (``tests.helpers.tiny.ScriptedBackend``) over an MLX backend: proposals
    as an ``mx.array``, wrong tokens modulo the 1000-word vocabulary."""

    vocab = VOCAB

    def as_array(self, ids: list[int]):
        return mx.array(ids)
