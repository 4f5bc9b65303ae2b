"""vLLM's contracts, newest first, and installing a rank's experts into a vLLM model through them."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from megamoe_convert.engines import vllm as kernel_layout
from megamoe_convert.engines import vllm_legacy as finalize
from megamoe_convert.engines.driver import Installed
from megamoe_convert.engines.vllm_common import install_layers as install_with

#: vLLM's contracts, newest first.
CONTRACTS = (kernel_layout.CONTRACT, finalize.CONTRACT)


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
