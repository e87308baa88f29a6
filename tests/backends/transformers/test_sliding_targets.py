"""Sliding-window and interleaved targets on the transformers backend's plain path: exact.

Tiny random targets (``tests/helpers/target_families.py``: window 8, prompts of 40 tokens) made into
folders, given a draft by ``init_draft`` and loaded by ``dflash.load`` as a user would: greedy
ids equal HF ``generate`` at block sizes 1, 3 and 16. Scripted drafts with zero-accept steps and
full blocks: after every step each layer's cache holds exactly the K/V rows that decoding the
same tokens one at a time leaves (full layers every position, sliding layers the last
``window - 1``). Sampling at T > 0 emits the target's distribution after rollbacks. One CLI run
on a multimodal wrapper folder.
"""

from __future__ import annotations

import pytest
import torch

from dflash.loop import speculative_generate
from tests.helpers.target_families import (
    FAMILIES,
    WINDOW,
    N,
    ScriptedRollback,
    build,
    cached_keys,
    check_cli_generate_on_folder,
    check_sampling_after_rollbacks,
    greedy,
    load_family,
    one_by_one,
    prompt_ids,
    save_target,
)

PLAIN = [
    "mistral",
    "qwen2_window",
    "gemma3_text",
    "gemma4_text",
    "gemma4_kv_shared",
    "gemma4_wrapper",
    "muse_glimmer",
]


@pytest.mark.parametrize("family", PLAIN)
def test_init_draft_load_and_greedy_parity(tmp_path, family):
    """init-draft + load on a folder of the family; ids equal HF generate at L = 1, 3, 16."""
    pipe, model = load_family(tmp_path, family)
    prompt = prompt_ids()
    truth = greedy(model, prompt, N)
    be = pipe.backend
    assert type(be).__name__ == "TransformersBackend"  # the plain path
    assert len(prompt) > WINDOW and len(set(truth)) > 4  # the window slides over varied text
    for bs in (1, 3, 16):
        got = pipe.generate(prompt, block_size=bs, max_new_tokens=N, stop_ids=[]).token_ids
        assert got == truth, (family, bs)
    if family == "gemma4_wrapper":  # the text model alone, no vision tower in memory
        assert type(be.target).__name__ == "Gemma4ForCausalLM"
        assert not any("vision" in name for name, _ in be.target.named_parameters())


@pytest.mark.parametrize("family", ["mistral", "gemma4_text", "gemma4_kv_shared", "gpt_oss"])
@pytest.mark.parametrize("prompt_len", [40, 3])  # 3: the window fills while decoding
def test_scripted_schedule_keeps_exactly_the_one_by_one_rows(family, prompt_len):
    from dflash.backends.plain import TransformersBackend
    from tests.helpers.tiny import make_draft

    model = build(family)
    prompt = prompt_ids(prompt_len)
    truth = greedy(model, prompt, 60)
    ref = one_by_one(model, prompt + truth, prompt_len, cached_keys)
    inner = TransformersBackend(model, make_draft(model), torch.device("cpu"))
    for schedule in ([15, 0, 3, 0, 0, 15], [0]):
        be = ScriptedRollback(inner, truth, prompt_len, schedule)
        rounds = list(speculative_generate(be, prompt, block_size=16, max_new_tokens=56))
        assert [t for r in rounds for t in r.tokens] == truth[:56]
        accepted = [r.accepted for r in rounds[1:]]
        if schedule[0] == 15:
            assert accepted[:6] == [16, 1, 4, 1, 1, 16]  # full blocks and zero-accept steps
        assert len(be.snapshots) == len(rounds) - 2  # every step but the last rolls back
        for length, keys in be.snapshots:
            want = ref[length]
            assert len(keys) == len(want)
            for got, exp in zip(keys, want, strict=True):
                if exp is None:
                    assert got is None
                    continue
                assert got.shape == exp.shape, (length, got.shape, exp.shape)
                torch.testing.assert_close(got, exp, rtol=1e-3, atol=1e-3)  # float32 noise only
        # the window slid: sliding layers held window - 1 rows of a longer text
        assert any(
            k is not None and k.shape[2] == WINDOW - 1 < n for n, keys in be.snapshots for k in keys
        )


def test_sampling_emits_the_target_distribution_after_rollbacks():
    """At T > 0 on a sliding target: the probabilities the loop accepts against, after steps that
    rolled the window back, are the target's own (HF forward over the committed text, no cache),
    and the token emitted at the first position of a verify step follows them (TV < 0.01)."""
    check_sampling_after_rollbacks(build("mistral"), prompt_ids(), tol=1e-4)


@pytest.mark.slow  # two CLI processes: about a minute on a small shared CPU
def test_cli_generate_on_a_multimodal_wrapper_folder(tmp_path):
    """As a user: init-draft on a Gemma 4 wrapper folder, then ``dflash generate transformers
    --json``; the ids equal HF generate on the chat prompt (cut at the first stop token)."""
    ids = check_cli_generate_on_folder(tmp_path, "gemma4_wrapper", prompt_ids(), 3)
    assert len(ids) > WINDOW


def test_draft_sliding_layers_and_draft_window_keep_parity(tmp_path):
    """A draft with a sliding layer (window 4) and ``draft_window=6`` on a sliding target:
    the draft's cache holds at most 6 context rows, and the ids stay the target's."""
    from dflash.models.config import DraftConfig

    pipe, model = load_family(tmp_path, "gemma4_text")
    cfg = DraftConfig.load(tmp_path / "draft")
    cfg.layer_types, cfg.sliding_window = ["sliding_attention", "full_attention"], 4
    cfg.save(tmp_path / "draft")
    import dflash

    pipe = dflash.load(str(tmp_path / "target"), str(tmp_path / "draft"), device="cpu", dtype="float32",
                       draft_window=6)  # fmt: skip
    assert pipe.backend.draft_model.config.layer_window(0) == 4
    prompt = prompt_ids()
    truth = greedy(model, prompt, N)
    for bs in (3, 16):
        assert (
            pipe.generate(prompt, block_size=bs, max_new_tokens=N, stop_ids=[]).token_ids == truth
        )
        cache = pipe.backend.draft_cache
        assert cache.length == 6 and all(k.shape[2] == 6 for k in cache.keys)
    assert pipe.cost_key["draft_window"] == 6


def test_draft_window_sees_exactly_the_last_rows():
    """--draft-window N: the draft's block output equals that of an unwindowed draft given only
    the last N context rows (positions absolute), after several rounds of context."""
    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    cfg = draft_config_for(build("mistral").config, layers=2, block_size=8, mask_token_id=255,
                           vocab_rows=256)  # fmt: skip
    torch.manual_seed(0)
    draft = DFlashDraft(cfg).eval()
    feats = torch.randn(1, 30, draft.feature_width)
    emb = torch.randn(1, 8, cfg.hidden_size)
    draft.context_window = 5
    win = draft.new_cache()
    with torch.inference_mode():
        for lo, hi in ((0, 12), (12, 20), (20, 30)):  # three rounds of new context rows
            h = draft(
                emb,
                feats[:, lo:hi],
                torch.arange(hi, hi + 8)[None],
                torch.arange(lo, hi)[None],
                cache=win,
            )
        draft.context_window = None
        ref = draft(emb, feats[:, 25:30], torch.arange(30, 38)[None], torch.arange(25, 30)[None],
                    cache=draft.new_cache())  # fmt: skip
    assert win.positions.tolist() == [list(range(25, 30))]
    torch.testing.assert_close(h, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_init_draft_shapes_for_every_family(tmp_path, family):
    """init-draft takes width, heads and a rope it can compute from every family (Gemma 4: the
    first layer's head dim, default rope at the full layers' theta)."""
    from dflash.models.config import DraftConfig
    from dflash.models.init_draft import init_draft

    model = save_target(tmp_path / "t", family)
    depth = model.config.get_text_config().num_hidden_layers  # 6 (Muse-Glimmer 8: two 3:1 groups)
    cfg = DraftConfig.load(
        init_draft(str(tmp_path / "t"), tmp_path / "d", layers=2, dtype="float32")
    )
    assert cfg.hidden_size == 64 and cfg.num_target_layers == depth
    assert cfg.target_layer_ids == ([1, 3] if depth == 6 else [1, 5])
    assert cfg.rope.get("rope_type", "default") in ("default", "yarn")
    if family.startswith("gemma4"):
        assert cfg.head_dim == 16 and cfg.rope["rope_theta"] == 1_000_000.0


def test_a_wrapper_missing_text_weights_is_refused(tmp_path):
    """A wrapper whose checkpoint lacks a text tensor is refused in one sentence (transformers
    would otherwise leave that tensor random)."""
    import dflash
    from dflash.errors import CheckpointError
    from dflash.models.init_draft import init_draft
    from dflash.models.safetensors_io import read_safetensors, save_safetensors

    save_target(tmp_path / "t", "gemma4_wrapper")
    init_draft(str(tmp_path / "t"), tmp_path / "d", layers=2, dtype="float32")
    state = read_safetensors(tmp_path / "t")
    del state["model.language_model.norm.weight"]
    save_safetensors(state, tmp_path / "t" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.norm.weight missing") as err:
        dflash.load(str(tmp_path / "t"), str(tmp_path / "d"), device="cpu", dtype="float32")
    assert "\n" not in err.value.message and err.value.hint


def test_dflash2_draft_on_muse_glimmer_keeps_parity(tmp_path):
    """The DFlash2 showcase pair's shape: a DFlash2 draft (init-draft --arch dflash2) on a
    Muse-Glimmer wrapper with 3 sliding : 1 full layers, on the plain path."""
    import dflash
    from dflash.models.init_draft import init_draft

    model = save_target(tmp_path / "t", "muse_glimmer")
    init_draft(str(tmp_path / "t"), tmp_path / "d", layers=2, dtype="float32", arch="dflash2")
    pipe = dflash.load(str(tmp_path / "t"), str(tmp_path / "d"), device="cpu", dtype="float32")
    assert pipe.backend.draft_model.is_dflash2
    prompt = prompt_ids()
    truth = greedy(model, prompt, N)
    for bs in (3, 16):
        assert (
            pipe.generate(prompt, block_size=bs, max_new_tokens=N, stop_ids=[]).token_ids == truth
        )


def test_a_wrapper_text_model_ties_its_head_as_the_wrapper_does(tmp_path):
    """Mistral 3 ties its LM head by its own flag while its text config says untied: the text
    model loaded alone ties it too (else transformers would leave the head random), and decodes
    as the wrapper does."""
    import transformers

    from dflash.backends.plain import load_target
    from tests.helpers.target_families import BASE, save_tokenizer

    text = transformers.MistralConfig(**BASE, sliding_window=WINDOW, initializer_range=0.3)
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, head_dim=16)  # fmt: skip
    cfg = transformers.Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    torch.manual_seed(0)
    wrapper = transformers.AutoModelForImageTextToText.from_config(cfg).eval()
    assert cfg.tie_word_embeddings and not cfg.get_text_config().tie_word_embeddings
    wrapper.save_pretrained(str(tmp_path))
    save_tokenizer(tmp_path)
    model, _ = load_target(str(tmp_path), torch.device("cpu"), torch.float32)
    assert type(model).__name__ == "MistralForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = prompt_ids()
    assert greedy(model, prompt, 16) == greedy(wrapper, prompt, 16)


def test_draft_window_option_checks(tmp_path, tiny_target):
    """--draft-window on transformers: below 1 refused before loading; with --cuda-graphs refused
    (the CUDA-graph path keeps a fixed draft context); --draft-bits stays an mlx option."""
    import dflash
    from dflash.errors import BackendError, InputError
    from tests.helpers.tiny import make_draft

    make_draft(tiny_target).save(tmp_path / "d")
    with pytest.raises(InputError, match="--draft-window must be >= 1 token, got 0"):
        dflash.load("no/such-model", str(tmp_path / "d"), draft_window=0)
    with pytest.raises(BackendError, match="CUDA graphs do not support --draft-window") as err:
        dflash.load("no/such-model", str(tmp_path / "d"), cuda_graphs=True, draft_window=8)
    assert "drop --cuda-graphs" in err.value.hint
    with pytest.raises(InputError, match="--draft-bits is an option of the mlx backend"):
        dflash.load(None, None, draft_bits=4)
