"""Installing a rank's experts into a vLLM model: vLLM's side of the install driver, and its contracts.

vLLM names a MegaMoE module by its prefix and builds it with its rank's EP numbers
(:mod:`.experts`); each module is matched to the first of :data:`CONTRACTS` (newest first) that
detects it, bound to the MoE block holding it, checked (EP numbers, then the contract's own
checks) and filled by :func:`megamoe_convert.engines.driver.install_layers`.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from megamoe_convert.engines import driver
from megamoe_convert.engines.contract import Contract, EngineModule
from megamoe_convert.engines.driver import Installed
from megamoe_convert.engines.vllm import finalize, kernel_layout
from megamoe_convert.engines.vllm.experts import (
    check_ep_numbers,
    current_ep_rank,
    layer_key,
    looks_like_megamoe_experts,
    module_placement,
)
from megamoe_convert.layout.placement import Placement
from megamoe_convert.serve.converted import ConvertedModel
from megamoe_convert.source.layers import MoELayer

#: vLLM's contracts, newest first.
CONTRACTS: tuple[Contract, ...] = (kernel_layout.CONTRACT, finalize.CONTRACT)


class VllmEngine:
    """vLLM's side of :func:`driver.install_layers`: modules by prefix, EP numbers checked first."""

    name = "vllm"

    def current_rank(self) -> int:
        return current_ep_rank()

    def classify(self, model: nn.Module) -> list[tuple[nn.Module, Contract]]:
        """Each experts module with its contract, bound to the module's owner (the MoE block
        holding it: vLLM 0.32 fuses the owner's shared MLP in ``finalize_weights``)."""
        found = driver.classify([m for m in model.modules() if looks_like_megamoe_experts(m)], CONTRACTS,
                                hint=" (is --moe-backend deep_gemm_mega_moe set, with --enable-expert-parallel?)")
        owners = {id(child): parent for parent in model.modules() for child in parent.children()}
        return [(m, c.bind(owners.get(id(m)))) for m, c in found]

    def prefix(self, module: EngineModule) -> str:
        return module.prefix

    def layer_key(self, module: EngineModule, converted: ConvertedModel) -> str:
        return layer_key(module.prefix, converted.num_hidden_layers)

    def placement(self, module: EngineModule, layer: MoELayer, converted: ConvertedModel, where: str) -> Placement:
        return module_placement(module, converted.manifest.dims.experts_of(layer), where)

    def check(self, module: EngineModule, contract: Contract, layer: MoELayer, converted: ConvertedModel,
              rank: int) -> None:
        check_ep_numbers(module, layer, converted, rank)
        contract.check(module, layer, converted, rank)


ENGINE = VllmEngine()


def install(model: nn.Module, out: Path | str, rank: int | None = None, *, verify: bool = False,
            probe: bool | None = None) -> int:
    """Load rank ``rank``'s MegaMoE experts from ``out`` into every MegaMoE module of ``model``.

    ``out`` is a converted directory (or a hub repo id: only this rank is pulled). ``rank=None``
    takes vLLM's current EP rank. Returns the number of layers installed. Every module is
    checked (contract, EP numbers, format, dtypes, shapes, strides) before any is changed; a
    mismatch raises :class:`~megamoe_convert.errors.InstallError` naming the layer and both values.
    Then vLLM's own loading code lays out one synthetic expert, which must be the conversion's bytes
    (``probe=False`` or ``MEGAMOE_LAYOUT_PROBE=0`` skips it, logged as unchecked).
    """
    return len(install_layers(model, out, rank, verify=verify, probe=probe).layers)


def install_layers(model: nn.Module, out: Path | str, rank: int | None = None, *, verify: bool = False,
                   serving: bool = False, probe: bool | None = None) -> Installed:
    """:func:`install`, saying which layers (and which of their fused shared experts) were
    installed: ``--load-format megamoe`` must not load those shared experts again (``serving``:
    it also refuses an ``--experts-only`` conversion, which has nothing else to load)."""
    return driver.install_layers(model, out, rank, ENGINE, verify=verify, serving=serving, probe=probe)
