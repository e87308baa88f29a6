"""scripts/truncate_draft.py: a shallower copy of a draft keeps the chosen layers' weights exactly
and still decodes losslessly."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dflash.loop import speculative_generate
from dflash.models.draft_torch import DFlashDraft
from tests.helpers.paths import REPO
from tests.helpers.tiny import PROMPT, greedy_reference, make_draft

SCRIPT = REPO / "scripts" / "truncate_draft.py"


def _script():
    spec = importlib.util.spec_from_file_location("truncate_draft", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cut_draft_keeps_the_chosen_layers_and_decodes_losslessly(tmp_path, tiny_target, monkeypatch, capsys):
    from dflash.backends.plain import TransformersBackend

    mod = _script()
    src, out = tmp_path / "src", tmp_path / "cut"
    full = make_draft(tiny_target, layers=3, seed=3)
    full.save(src)
    monkeypatch.setattr("sys.argv", ["truncate_draft.py", "--draft", str(src), "--keep-layers", "0,2",
                                     "--out", str(out)])  # fmt: skip
    assert mod.main() == 0
    assert "layers [0, 2]" in capsys.readouterr().out
    cut = DFlashDraft.load(out)
    assert cut.config.num_hidden_layers == 2 and len(cut.config.layer_types) == 2
    assert cut.config.target_layer_ids == full.config.target_layer_ids
    want = {f"layers.{j}.{k}": v for j, i in enumerate((0, 2))
            for k, v in full.layers[i].state_dict().items()}  # fmt: skip
    want.update({k: v for k, v in full.state_dict().items() if not k.startswith("layers.")})
    got = cut.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    be = TransformersBackend(tiny_target, cut.eval(), torch.device("cpu"))
    rounds = list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=40))
    assert [t for r in rounds for t in r.tokens] == greedy_reference(tiny_target, PROMPT, 40)


@pytest.mark.parametrize("text", ["", "0,0", "3", "-1", "a", "a,b", "2,0"])
def test_bad_layer_lists_are_refused(text):
    mod = _script()
    with pytest.raises(ValueError, match=r"--keep-layers must list layers of 0\.\.2 in increasing order"):
        mod.parse_layers(text, 3)


def test_refuses_a_non_empty_out_folder(tmp_path, tiny_target, monkeypatch, capsys):
    mod = _script()
    src = tmp_path / "src"
    make_draft(tiny_target, layers=2).save(src)
    monkeypatch.setattr("sys.argv", ["truncate_draft.py", "--draft", str(src), "--keep-layers", "0",
                                     "--out", str(src)])  # fmt: skip
    assert mod.main() == 1
    assert capsys.readouterr().err.startswith("error: ") and (src / "config.json").is_file()
