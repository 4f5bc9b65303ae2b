"""vLLM integration: a rank's pre-baked MegaMoE experts into vLLM's own modules.

The contracts live in :mod:`megamoe_convert.engines` (``vllm`` for >= 0.33's
``DeepGemmMegaMoEExperts``, ``vllm_legacy`` for 0.30-0.32's ``DeepseekV4MegaMoEExperts``);
each module of the model is matched to its contract by what it has, never by class name.
:func:`register` is the ``vllm.general_plugins`` entry point that adds ``--load-format megamoe``.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .engines import InstallError
from .engines import vllm as kernel_layout
from .engines import vllm_legacy as finalize
from .engines.driver import Installed
from .engines.vllm_common import install_layers as install_with, layer_key
from .engines.vllm_loader import LOAD_FORMAT, RANK_FILES_PATTERN, register

#: vLLM's contracts, newest first.
CONTRACTS = (kernel_layout.CONTRACT, finalize.CONTRACT)

__all__ = ["CONTRACTS", "InstallError", "Installed", "LOAD_FORMAT", "RANK_FILES_PATTERN", "install", "install_layers",
           "layer_key", "register"]


def install(model: nn.Module, out: Path | str, rank: int | None = None, *, verify: bool = False) -> int:
    """Load rank ``rank``'s MegaMoE experts from ``out`` into every MegaMoE module of ``model``.

    ``out`` is a converted directory (or a hub repo id: only this rank is pulled). ``rank=None``
    takes vLLM's current EP rank. Returns the number of layers installed. Every module is
    checked (contract, EP numbers, format, dtypes, shapes, strides) before any is changed; a
    mismatch raises :class:`InstallError` naming the layer and both values.
    """
    return len(install_layers(model, out, rank, verify=verify).layers)


def install_layers(model: nn.Module, out: Path | str, rank: int | None = None, *, verify: bool = False,
                   serving: bool = False) -> Installed:
    """:func:`install`, saying which layers (and which of their fused shared experts) were
    installed: ``--load-format megamoe`` must not load those shared experts again (``serving``:
    it also refuses an ``--experts-only`` conversion, which has nothing else to load)."""
    return install_with(model, out, rank, CONTRACTS, verify=verify, serving=serving)
