"""Synthetic checkpoints for tests, demos and benchmarks: ``presets`` (the configs it writes, read with no
torch), ``tensors`` (DeepSeek-V4/V4.1 names, dtypes, shapes), ``kimi`` (Kimi-K3's), ``write`` (presets ->
files on disk).

:func:`synthesize` and :data:`PRESETS` are imported on first use, so that a module of this package
(``presets``: what ``megamoe synth -h`` lists) is imported without the writer and its torch.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module that defines it.
_PUBLIC = {
    "PRESETS": "megamoe_convert.synth.presets",
    "SynthError": "megamoe_convert.errors",
    "synthesize": "megamoe_convert.synth.write",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'megamoe_convert.synth' has no attribute {name!r}")
