"""vLLM integration: a rank's pre-baked MegaMoE experts into vLLM's own modules.

The contracts live in :mod:`megamoe_convert.engines` (``vllm`` for >= 0.33's
``DeepGemmMegaMoEExperts``, ``vllm_legacy`` for 0.30-0.32's ``DeepseekV4MegaMoEExperts``);
each module of the model is matched to its contract by what it has, never by class name.
The public face of the vLLM side (kept where users and tools import it);
:func:`register` is the ``vllm.general_plugins`` entry point that adds ``--load-format megamoe`` (and,
vLLM >= 0.33, the weight cache's conversion-aware key and ``ipc_cache`` fallback).
"""

from __future__ import annotations

from megamoe_convert.engines import InstallError
from megamoe_convert.engines.driver import Installed
from megamoe_convert.engines.load_format import LOAD_FORMAT, RANK_FILES_PATTERN
from megamoe_convert.engines.vllm_common import layer_key
from megamoe_convert.engines.vllm_install import CONTRACTS, install, install_layers
from megamoe_convert.engines.vllm_preload import register

__all__ = ["CONTRACTS", "InstallError", "Installed", "LOAD_FORMAT", "RANK_FILES_PATTERN", "install", "install_layers",
           "layer_key", "register"]
