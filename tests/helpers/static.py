"""The static (CUDA-graph) path on a tiny Llama pair, run eagerly on the CPU: greedy parity with
a chosen set of kernels, and a draft's logits over two steps."""

from __future__ import annotations

from tests.helpers.tiny import PROMPT, greedy_reference, make_draft, tiny_llama


def assert_static_greedy(layers: int = 4, settings: dict | None = None, **attrs) -> None:
    """A tiny Llama pair on the static backend (device loop, no graphs; ``settings``: the
    environment overrides its KernelSettings resolve) with ``attrs`` set on the backend decodes
    exactly plain greedy at block 1 and 16 (the Triton kernels' interpreter checks run it with
    their path switched on)."""
    import torch

    from dflash.backends.static.backend import StaticBackend
    from dflash.kernels.settings import KernelSettings
    from dflash.loop import speculative_generate

    target = tiny_llama(num_hidden_layers=layers)
    be = StaticBackend(target, make_draft(target), torch.device("cpu"), use_graphs=False, device_loop=True,
                       settings=KernelSettings.resolve(environ=settings or {}))  # fmt: skip
    for name, value in attrs.items():
        setattr(be, name, value)
    if attrs.get("fuse_norm") or attrs.get(
        "draft_fuse_norm"
    ):  # the fuse_norm setting's folded weights
        from dflash.backends.static.fused import fold_norms

        be.folded_target = fold_norms(target.model.layers, be.fused_target)
        be.folded_draft = fold_norms(be.draft_model.layers, be.fused_draft, ("post",))
    truth = greedy_reference(target, PROMPT, 24)
    for block in (1, 16):
        toks = [t for r in speculative_generate(be, PROMPT, block_size=block, max_new_tokens=24)
                for t in r.tokens]  # fmt: skip
        assert toks == truth, (block, toks, truth)


def draft_twice(be, prompt: list[int]):
    """prefill -> draft -> verify -> keep 2 rows -> draft again; returns both draft logits
    ((block, vocab) each)."""
    import torch

    from dflash.backends.plain import TransformersBackend

    be.reset(len(prompt) + 64)
    with torch.inference_mode():
        _, ctx = be.prefill(prompt, True)
        start = len(prompt)
        props, first = be.draft(7, ctx, start, 16)
        _, feats = be.verify(7, props, start, True)
        be.rollback(start + 2)
        ctx2 = feats[:2] if isinstance(be, TransformersBackend) else None
        _, second = be.draft(int(props[1]), ctx2, start + 2, 16)
    return first.clone(), second.clone()
