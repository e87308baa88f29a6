"""The tiny random Llama target and DFlash draft most tests run on, HF greedy references, and
the scripted draft: a backend wrapper whose proposals are right for exactly k positions."""

from __future__ import annotations

PROMPT = [
    5,
    17,
    42,
    7,
    99,
    3,
    64,
    128,
]  # its 4th greedy token on the tiny target is new (stop tests)


def tiny_llama(seed: int = 0, **changes):
    """A random Llama in float32, eval mode: 6 layers, hidden 64, 4 heads (2 KV), vocabulary
    256, untied, ``changes`` replacing any config field. The wide init (0.3) gives sharp, varied
    greedy continuations (a 0.02 init repeats 2-4 tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**kw, **changes})).eval()


def make_draft(
    target, layers: int = 2, block_size: int = 16, mask_token_id: int = 255, seed: int = 0
):
    """A random DFlash draft shaped for ``target``."""
    import torch

    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    cfg = draft_config_for(target.config, layers=layers, block_size=block_size,
                           mask_token_id=mask_token_id, vocab_rows=target.config.vocab_size)  # fmt: skip
    torch.manual_seed(seed)
    return DFlashDraft(cfg).eval()


def train_target(seed: int = 0):
    """The training tests' target: ``tiny_llama`` with a 192-word vocabulary and 256 positions."""
    return tiny_llama(seed, vocab_size=192, max_position_embeddings=256)


def write_draft(target, folder, layers: int = 2, block_size: int = 8, seed: int = 0):
    """A random draft for ``target`` saved in float32 to ``folder`` (mask id = the last
    vocabulary row); returns ``folder``."""
    make_draft(
        target, layers, block_size, mask_token_id=target.config.vocab_size - 1, seed=seed
    ).save(folder)
    return folder


def custom_draft(target, seed: int = 0, **changes):
    """A random draft for ``target`` with config fields replaced (layer types, layer ids...)."""
    import dataclasses

    import torch

    from dflash.models.draft_torch import DFlashDraft

    cfg = dataclasses.replace(make_draft(target).config, **changes)
    torch.manual_seed(seed)
    return DFlashDraft(cfg).eval()


def greedy_reference(target, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with HF generate: exactly ``n`` new token ids (no stop token)."""
    import torch

    out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


class ScriptedBackend:
    """Wraps a backend; its draft proposes the true greedy continuation (``truth``, the tokens
    after a prompt of ``prompt_len``) for k positions and then wrong tokens ((t + 1) mod
    ``vocab``), with k taken from ``schedule`` step by step (cycled). ``expected_k`` records
    each step's k."""

    draft_head_rows = False  # the wrapped draft returns its whole block
    vocab = 256

    def __init__(self, inner, truth: list[int], prompt_len: int, schedule: list[int]):
        self.inner, self.truth, self.prompt_len, self.schedule = inner, truth, prompt_len, schedule
        self.step = 0
        self.expected_k: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def as_array(self, ids: list[int]):
        """The proposals as the backend's array type (a torch long tensor)."""
        import torch

        return torch.tensor(ids, dtype=torch.long)

    def draft(self, anchor, context, start, length):
        k = min(self.schedule[self.step % len(self.schedule)], length - 1)
        self.step += 1
        self.expected_k.append(k)
        i0 = start - self.prompt_len + 1  # index in `truth` of the token after the anchor
        true = self.truth[i0 : i0 + length - 1]
        return self.as_array(list(true[:k]) + [(t + 1) % self.vocab for t in true[k:]]), None


class FakeTokenizer:
    """Decodes ids as their numbers joined by spaces (for a Pipeline over a tiny target)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))
