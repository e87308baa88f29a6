"""The targets, drafts and runs of ``scripts/gpu_check_static_families.py``: tiny configs of each
family the static path runs (``tests/helpers/target_families.py``'s layouts: the device gets
``dflash/`` and ``scripts/`` only), published shapes, random builders, HF greedy and a scripted
draft that proposes the truth."""

from __future__ import annotations

import torch

WINDOW = 8
INTERLEAVED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
               "full_attention", "sliding_attention"]  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
TINY = {  # family -> (config class, arguments beyond tests/helpers/target_families.py's BASE)
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen3_interleaved": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                              layer_types=INTERLEAVED)),
    "qwen3_moe": ("Qwen3MoeConfig", MOE),
    "qwen3_moe_window": ("Qwen3MoeConfig", dict(MOE, use_sliding_window=True, sliding_window=WINDOW,
                                                mlp_only_layers=[1, 4])),
}  # fmt: skip
MISTRAL_7B = dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=256,
                  max_position_embeddings=32768, rope_theta=1000000.0)  # fmt: skip
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     max_position_embeddings=40960, rope_theta=1000000.0)  # 8 of 48 layers  # fmt: skip
BIG = {
    "mistral_7b_w256": ("MistralConfig", MISTRAL_7B),
    "qwen3_30b_a3b_8layers": ("Qwen3MoeConfig", QWEN3_30B_A3B),
}
# families with their own static forward (dflash.backends.static.families), tiny configs from
# tests/helpers/target_families.py (window 8, float32)
PERF_MOE_LAYERS = {  # one layer each, for the expert-block checks
    "gpt_oss": ("GptOssConfig", dict(vocab_size=1024, hidden_size=2880, intermediate_size=2880, num_hidden_layers=1,
                                     num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                     num_experts_per_tok=4, sliding_window=128, layer_types=["sliding_attention"])),
    "gemma4_moe": ("Gemma4TextConfig", dict(vocab_size=1024, hidden_size=2816, intermediate_size=2112,
                                            num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
                                            head_dim=256, enable_moe_block=True, num_experts=128, top_k_experts=8,
                                            moe_intermediate_size=704, hidden_size_per_layer_input=0,
                                            layer_types=["sliding_attention"])),
}  # fmt: skip
# tests/helpers/target_families.py's tiny layouts (the device gets dflash/ and scripts/ only)
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=1, bos_token_id=None, eos_token_id=3)  # fmt: skip
ALTERNATE = ["sliding_attention", "full_attention"] * 3
GEMMA4 = dict(head_dim=16, global_head_dim=32, sliding_window=WINDOW, layer_types=ALTERNATE,
              vocab_size_per_layer_input=256, hidden_size_per_layer_input=8)  # fmt: skip
FAMILY_CONFIGS = {  # family -> (config class, arguments beyond BASE, init range)
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
                0.3),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                             layer_types=ALTERNATE), 0.02),
    "gemma4_text": ("Gemma4TextConfig", GEMMA4, 0.02),
    "gemma4_moe": ("Gemma4TextConfig", dict(GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2,
                                            moe_intermediate_size=32), 0.02),
    "gemma4_kv_shared": ("Gemma4TextConfig", dict(GEMMA4, num_kv_shared_layers=2), 0.02),
    "gemma4_k_eq_v": ("Gemma4TextConfig", dict(GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1), 0.02),
}  # fmt: skip


def family_config(family: str):
    """The tiny transformers config of a :data:`FAMILY_CONFIGS` family."""
    import transformers

    cls, kwargs, init = FAMILY_CONFIGS[family]
    return getattr(transformers, cls)(**BASE, **kwargs, initializer_range=init)


FAMILY_TINY = [
    "gpt_oss",
    "gemma3_text",
    "gemma4_text",
    "gemma4_moe",
    "gemma4_kv_shared",
    "gemma4_k_eq_v",
]


def build_target(
    cls_name: str,
    kwargs: dict,
    dtype: torch.dtype,
    dev: torch.device,
    init: float,
    seed: int = 0,
    cfg=None,
):
    """A random target built on ``dev`` in ``dtype`` (eval mode); ``cfg``: this config instead."""
    import transformers

    if cfg is None:
        cfg = getattr(transformers, cls_name)(
            **kwargs, tie_word_embeddings=False, initializer_range=init
        )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    finally:
        torch.set_default_dtype(default)


def build_draft(target, dev: torch.device, seed: int = 0, layers: int = 2):
    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    cfg = target.config
    dcfg = draft_config_for(cfg, layers=layers, block_size=16, mask_token_id=cfg.vocab_size - 1,
                            vocab_rows=cfg.vocab_size)  # fmt: skip
    torch.manual_seed(seed)
    return DFlashDraft(dcfg).to(dev, target.dtype).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=1)  # fmt: skip
    return out[0, len(prompt) :].tolist()


class Scripted:
    """A backend whose draft proposes the true continuation (host side; full blocks)."""

    def __init__(self, inner, truth: list[int], prompt_len: int):
        self.inner, self.truth, self.prompt_len = inner, truth, prompt_len

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, anchor, context, start, length):
        true = self.truth[start - self.prompt_len + 1 :][: length - 1]
        true = true + [4] * (length - 1 - len(true))
        return torch.tensor(true, device=self.inner.device), None


def generate(be, prompt: list[int], block: int, n: int) -> list[int]:
    from dflash.loop import speculative_generate

    return [t for r in speculative_generate(be, prompt, block_size=block, max_new_tokens=n, stop_ids=[])
            for t in r.tokens]  # fmt: skip


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
