"""megamoe-convert: pre-bake Mixture-of-Experts weights into DeepGEMM's MegaMoE per-rank layout, once,
and install them at serving time with no work left.

The public face, imported on first use so that ``megamoe --version`` and an engine's plugin
discovery pay no torch import:

- :func:`load_rank` (``hub.resolve``): one EP rank's experts from a conversion, a store or a hub repo;
- :func:`load_slots` (``serve.store``): any placement's slots of a store;
- :func:`transform_experts` (``layout.transform``): the MegaMoE byte permutation of one rank's experts.

Each engine's ``install`` lives in its package (``megamoe_convert.engines.vllm``,
``megamoe_convert.engines.sglang``). The stages, one folder each, imports pointing down only:
``source/`` -> ``layout/`` -> ``output/`` -> ``convert/`` -> ``serve/``, ``hub/`` -> ``engines/`` ->
``cli/`` (``docs/architecture.md``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_PUBLIC = {
    "load_rank": "megamoe_convert.hub.resolve",
    "load_slots": "megamoe_convert.serve.store",
    "transform_experts": "megamoe_convert.layout.transform",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'megamoe_convert' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
