"""Tiny random transformers targets of the families behind the published drafts, built in the
test itself: sliding-window and interleaved attention (Mistral, Qwen2 with ``use_sliding_window``,
Gemma 3, Gemma 4 with its per-layer inputs, KV sharing and MoE, gpt-oss with attention sinks and
MoE), a dense MoE (Qwen3-MoE), multimodal wrappers (Gemma 4; Muse-Glimmer, 3 sliding : 1 full
layers and no causal LM class for its text model), with windows of 8 tokens so that 40-token
prompts overflow them, and GatedDeltaNet hybrids (Qwen3-Next with MoE, Qwen3.5 dense and MoE, the
Qwen3.5 vision wrapper: 3 linear-attention : 1 full layers, 2 key and 4 value heads of 16). Hidden 64, 6 layers (Muse-Glimmer 8), vocabulary 256, float32, and a
256-word WordLevel tokenizer with a ChatML template for folders.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
WINDOW = 8
ALTERNATE = ["sliding_attention", "full_attention"] * 3
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            pad_token_id=1, bos_token_id=None, eos_token_id=3)  # fmt: skip
GDN = dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_num_key_heads=2, linear_num_value_heads=4)  # fmt: skip
GDN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)  # fmt: skip
GEMMA4 = dict(head_dim=16, global_head_dim=32, sliding_window=WINDOW, layer_types=ALTERNATE,
              vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)  # fmt: skip
# family -> (config class, its arguments, init range: wide enough for varied greedy text, and
# narrow for Gemma, whose scaled embeddings then repeat one token)
FAMILIES = {
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, tie_word_embeddings=False), 0.3),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                                         tie_word_embeddings=False), 0.3),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                             layer_types=ALTERNATE), 0.02),
    "gemma4_text": ("Gemma4TextConfig", GEMMA4, 0.02),
    "gemma4_kv_shared": ("Gemma4TextConfig", dict(GEMMA4, num_kv_shared_layers=2), 0.02),
    "gemma4_moe": ("Gemma4TextConfig", dict(GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2,
                                            moe_intermediate_size=32), 0.02),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                                     num_experts_per_tok=2), 0.3),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         tie_word_embeddings=False), 0.3),
    "gemma4_wrapper": ("Gemma4Config", {}, 0.02),
    "qwen3_next": ("Qwen3NextConfig", dict(GDN, **GDN_MOE), 0.3),  # every layer MoE, as published
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(GDN, tie_word_embeddings=False), 0.3),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(GDN, **GDN_MOE), 0.3),
    "qwen3_5_wrapper": ("Qwen3_5Config", {}, 0.3),  # vision tower + Qwen3.5 text model
    "muse_glimmer": ("MuseGlimmerConfig", {}, 0.02),  # 3 sliding : 1 full (NoPE), softcap; no text LM class
}  # fmt: skip
HYBRID = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_wrapper"]
SLIDING = [f for f in FAMILIES if f != "qwen3_moe" and f not in HYBRID]
CHATML = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def family_config(family: str):
    """The transformers config of a family (a multimodal wrapper: Gemma 4 text + a 1-layer
    vision tower)."""
    import transformers

    cls, kwargs, init = FAMILIES[family]
    if family == "muse_glimmer":
        text = transformers.MuseGlimmerTextConfig(**{**BASE, "num_hidden_layers": 8}, head_dim=16,
                                                  sliding_window=WINDOW, initializer_range=init)  # fmt: skip
        vision = transformers.MuseGlimmerVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2)  # fmt: skip
        return transformers.MuseGlimmerConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                              out_hidden_size=32, projector_hidden_size=32)  # fmt: skip
    if family == "qwen3_5_wrapper":
        text = transformers.Qwen3_5TextConfig(**BASE, **GDN, initializer_range=init)
        vision = dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64
        )
        return transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision,
                                          tie_word_embeddings=False)  # fmt: skip
    if family == "gemma4_wrapper":
        text = transformers.Gemma4TextConfig(**BASE, **GEMMA4, initializer_range=init)
        vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=2, head_dim=16)  # fmt: skip
        return transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                         audio_config=None)  # fmt: skip
    return getattr(transformers, cls)(**BASE, **kwargs, initializer_range=init)


def build(family: str, seed: int = 0):
    """A random float32 target of ``family`` in eval mode (a wrapper: the full multimodal model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    whole = family in ("muse_glimmer", "qwen3_5_wrapper")  # built whole (vision included)
    auto = AutoModelForImageTextToText if whole else AutoModelForCausalLM
    return auto.from_config(family_config(family), dtype=torch.float32).eval()


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer: <unk>, <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos, id 3),
    w4..w255."""
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


def save_target(folder: Path, family: str, seed: int = 0):
    """Write a random target folder (safetensors, config, tokenizer); returns the model."""
    model = build(family, seed)
    model.save_pretrained(str(folder))
    save_tokenizer(folder)
    return model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy token ids after ``prompt`` from HF ``generate`` (no stop token)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=1)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def prompt_ids(n: int = 40, seed: int = 1) -> list[int]:
    """n word ids (4..249): no special token, longer than the window when n > 8."""
    return torch.randint(4, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


N = 32  # new tokens per run


def load_family(tmp_path, family: str, **load_kwargs):
    """(pipeline over a saved folder of ``family`` with an init-draft draft, the in-memory model)."""
    import dflash
    from dflash.models.init_draft import init_draft

    model = save_target(tmp_path / "target", family)
    draft = init_draft(
        str(tmp_path / "target"), tmp_path / "draft", layers=2, block_size=16, dtype="float32"
    )
    pipe = dflash.load(
        str(tmp_path / "target"), str(draft), device="cpu", dtype="float32", **load_kwargs
    )
    return pipe, model


class ScriptedRollback:
    """A backend whose draft proposes the true continuation for k positions and then a wrong
    token (k from ``schedule``, cycled), recording each layer's cached keys after every
    rollback as (committed length, [keys [1, Hkv, rows, D] or None per cache layer])."""

    draft_head_rows = False

    def __init__(self, inner, truth: list[int], prompt_len: int, schedule: list[int]):
        self.inner, self.truth, self.prompt_len, self.schedule = inner, truth, prompt_len, schedule
        self.step, self.snapshots = 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, anchor, context, start, length):
        k = min(self.schedule[self.step % len(self.schedule)], length - 1)
        self.step += 1
        true = self.truth[start - self.prompt_len + 1 :][: length - 1]
        return torch.tensor(true[:k] + [(t + 1) % 256 for t in true[k:]]), None

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)
        self.snapshots.append((length, cached_keys(self.inner.cache)))


def cached_keys(cache) -> list:
    """Per cache layer the keys it holds [1, Hkv, rows, D] (cloned), None for a layer without."""
    return [None if layer.keys is None else layer.keys.clone() for layer in cache.layers]


def one_by_one(model, ids: list[int], prompt_len: int, snapshot, cache=None) -> dict[int, list]:
    """Plain decoding's cache, the prompt ``ids[:prompt_len]`` in one forward and then one token
    at a time: committed length -> ``snapshot(cache)`` after each forward (prompt_len up to
    len(ids)). ``cache``: the transformers cache to fill; default ``DynamicCache(config=...)``,
    whose sliding layers keep only their window (``DynamicCache()`` keeps every row)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if cache is None else cache
    out = {}
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:prompt_len]]), past_key_values=cache, use_cache=True)
        out[prompt_len] = snapshot(cache)
        for i in range(prompt_len, len(ids)):
            model(input_ids=torch.tensor([[ids[i]]]), position_ids=torch.tensor([[i]]),
                  past_key_values=cache, use_cache=True)  # fmt: skip
            out[i + 1] = snapshot(cache)
    return out


def check_cli_generate_on_folder(
    folder: Path, family: str, prompt: list[int], block_size: int
) -> list[int]:
    """As a user: ``dflash init-draft`` on a saved ``family`` folder at ``folder / "target"`` (the
    draft to ``folder / "d"``), then ``dflash generate transformers --json`` on the words of
    ``prompt`` at ``block_size``: the prompt is the chat template's and the ids equal HF
    generate's on it (24 tokens, cut at the first stop token). Returns the chat prompt's ids."""
    import json

    import dflash
    from tests.helpers.cli import run

    model = save_target(folder / "target", family)
    p = run("init-draft", "--target", str(folder / "target"), "--out", str(folder / "d"), "--layers", "2",
            "--dtype", "float32")  # fmt: skip
    assert p.returncode == 0, p.stderr
    words = " ".join(f"w{t}" for t in prompt)
    p = run("generate", "transformers", words, "--model", str(folder / "target"), "--draft", str(folder / "d"),
            "--json", "--device", "cpu", "--dtype", "float32", "--block-size", str(block_size),
            "--max-new-tokens", "24")  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    pipe = dflash.load(str(folder / "target"), str(folder / "d"), device="cpu", dtype="float32")
    ids = pipe.chat_prompt([{"role": "user", "content": words}])
    assert out["prompt_tokens"] == len(ids)
    truth = greedy(model, ids, 24)
    cut = next((i + 1 for i, t in enumerate(truth) if t in set(pipe.stop_ids)), 24)
    assert out["token_ids"] == truth[:cut]
    return ids


def check_sampling_after_rollbacks(model, prompt: list[int], tol: float) -> None:
    """At T > 0 over ``model`` on the plain path: the rows the loop accepts against, after steps
    that rolled the cache back, equal the target's own (an HF forward over the committed text, no
    cache; within ``tol``), and the token emitted at the first position of the last verify step
    follows them (TV < 0.01 over 50,000 draws)."""
    import numpy as np

    from dflash.accept import accept_sampling
    from dflash.backends.plain import TransformersBackend
    from dflash.loop import speculative_generate
    from dflash.sampling import sampling_probs
    from dflash.types import SamplingParams
    from tests.helpers.stats import tv
    from tests.helpers.tiny import make_draft

    inner = TransformersBackend(model, make_draft(model), torch.device("cpu"))
    steps = []

    class Recording:
        draft_head_rows = False

        def __getattr__(self, name):
            return getattr(inner, name)

        def verify(self, anchor, proposals, start, with_features):
            logits, feats = inner.verify(anchor, proposals, start, with_features)
            steps.append((anchor, start, logits[0].clone()))
            return logits, feats

    params = SamplingParams(temperature=0.8, top_k=8, seed=4)
    tokens = [t for r in speculative_generate(Recording(), prompt, block_size=4, max_new_tokens=24,
                                              sampling=params) for t in r.tokens]  # fmt: skip
    assert len(steps) >= 6
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([prompt + tokens])).logits[0]  # [T, V], no cache
    for anchor, start, row in steps:
        assert anchor == (prompt + tokens)[start]
        torch.testing.assert_close(row, full[start], rtol=tol, atol=tol)
    # the last step: its cache was rolled back several times before
    _, start, row = steps[-1]
    p_loop = sampling_probs(row[None].numpy(), params)  # [1, V] what the loop accepted against
    p_ref = sampling_probs(full[start][None].numpy(), params)[0]  # the target's own
    proposal = int(p_loop[0].argmax())  # a likely proposal: both the accept and residual branches
    table = np.concatenate([p_loop, p_loop])  # [2, V]; row 1 only draws the token after the first
    rng = np.random.default_rng(0)
    counts = np.zeros(p_ref.shape[-1])
    for _ in range(50_000):
        a, bonus = accept_sampling([proposal], table, None, rng)
        counts[proposal if a else bonus] += 1
    assert tv(counts, p_ref) < 0.01
