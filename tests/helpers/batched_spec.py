"""The scripted batched engine of ``scripts/batched_spec_scripted.py`` (:class:`ScriptedSpec`,
:class:`ScriptedJob`), loaded for the tests (scripts/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys

from tests.helpers.paths import REPO

_NAME = "batched_spec_scripted"
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, REPO / "scripts" / f"{_NAME}.py")
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _mod  # before running it: its dataclasses look their module up
    _spec.loader.exec_module(_mod)
ScriptedJob = sys.modules[_NAME].ScriptedJob
ScriptedSpec = sys.modules[_NAME].ScriptedSpec

__all__ = ["ScriptedJob", "ScriptedSpec"]
