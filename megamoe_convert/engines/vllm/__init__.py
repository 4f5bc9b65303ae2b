"""vLLM (0.30-0.33): a rank's pre-baked MegaMoE experts into vLLM's own modules, and every load
format's way to them.

- :mod:`.kernel_layout`: the >= 0.33 contract (``DeepGemmMegaMoEExperts``, parameters in the kernel layout);
- :mod:`.finalize`: the 0.30-0.32 contract (``DeepseekV4MegaMoEExperts``, ``finalize_weights`` transforms);
- :mod:`.experts`: what both contracts share (module prefixes, EP numbers, tensor checks);
- :mod:`.installing`: :func:`install` / :func:`install_layers` through the contracts;
- :mod:`.loader`: ``--load-format megamoe``;
- :mod:`.model_classes`: every other load format serves a conversion's experts or refuses;
- :mod:`.weight_cache`, :mod:`.preload`: the weight cache's key and ``ipc_cache`` loader; ``megamoe preload``;
- :mod:`.private_hooks`: the vLLM names used that are not its public extension API;
- :mod:`.plugin`: ``register()``, the ``vllm.general_plugins`` entry point, every registration in order.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Imported on first use: vLLM runs the plugin (:mod:`.plugin`) in every process, before any load,
#: and the install driver's modules cost it nothing until a conversion is loaded.
_PUBLIC = {name: "megamoe_convert.engines.vllm.installing" for name in ("CONTRACTS", "install", "install_layers")}
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'megamoe_convert.engines.vllm' has no attribute {name!r}")
