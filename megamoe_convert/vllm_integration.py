"""vLLM integration: a rank's pre-baked MegaMoE experts into vLLM's own modules.

The public face of the vLLM side, kept where users and tools import it; the code lives in
:mod:`megamoe_convert.engines.vllm` (its contracts, install, loader, doors and weight cache).
:func:`register` is what the ``vllm.general_plugins`` entry point runs
(:func:`megamoe_convert.engines.vllm.plugin.register`): ``--load-format megamoe``, every other
load format serving a conversion's experts, and the weight cache's conversion-aware key and
``ipc_cache`` fallback.
"""

from __future__ import annotations

from megamoe_convert.engines.driver import Installed
from megamoe_convert.engines.shared_doors import LOAD_FORMAT, RANK_FILES_PATTERN
from megamoe_convert.engines.vllm.experts import layer_key
from megamoe_convert.engines.vllm.install import CONTRACTS, install, install_layers
from megamoe_convert.engines.vllm.plugin import register
from megamoe_convert.errors import InstallError

__all__ = ["CONTRACTS", "InstallError", "Installed", "LOAD_FORMAT", "RANK_FILES_PATTERN", "install", "install_layers",
           "layer_key", "register"]
