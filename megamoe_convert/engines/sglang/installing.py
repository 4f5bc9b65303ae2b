"""Installing a rank's experts into an SGLang model: SGLang's side of the install driver."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from megamoe_convert.engines import driver
from megamoe_convert.engines.contract import Contract, EngineModule
from megamoe_convert.engines.sglang import sm90_fp8
from megamoe_convert.engines.sglang.experts import SGLANG_PREFIX, layer_key, module_placement
from megamoe_convert.engines.sglang.mega_moe import CONTRACT
from megamoe_convert.errors import InstallError
from megamoe_convert.layout.placement import Placement
from megamoe_convert.serve.converted import ConvertedModel
from megamoe_convert.source.layers import MoELayer

#: SGLang's contracts, newest first; a module is the first's that detects it (FP8 weights: the SM90 build's).
CONTRACTS: tuple[Contract, ...] = (sm90_fp8.CONTRACT, CONTRACT)


class SglangEngine:
    """SGLang's side of :func:`driver.install_layers`."""

    name = "sglang"

    def current_rank(self) -> int:
        try:
            from sglang.srt.runtime_context import get_parallel
        except ImportError as e:
            raise InstallError("rank=None needs SGLang's parallel context, but sglang is not importable; "
                               "pass rank=") from e
        parallel = get_parallel()  # a scale-up joiner's rank in the grown world: its join offset on
        return int(parallel.moe_ep_rank) + int(getattr(parallel, "ep_join_rank_offset", 0) or 0)

    def classify(self, model: nn.Module) -> list[tuple[nn.Module, Contract]]:
        candidates = [m for m in model.modules() if SGLANG_PREFIX.match(str(getattr(m, "layer_name", "")))]
        return driver.classify(candidates, CONTRACTS, prefix="layer_name",
                               hint=" (is --moe-a2a-backend megamoe set?)")

    def prefix(self, module: EngineModule) -> str:
        return module.layer_name

    def layer_key(self, module: EngineModule, converted: ConvertedModel) -> str:
        return layer_key(module.layer_name)

    def placement(self, module: EngineModule, layer: MoELayer, converted: ConvertedModel, where: str) -> Placement:
        return module_placement(module, converted.manifest.dims.experts_of(layer), where)

    def check(self, module: EngineModule, contract: Contract, layer: MoELayer, converted: ConvertedModel,
              rank: int) -> None:
        contract.check(module, layer, converted, rank)


ENGINE = SglangEngine()


def install_layers(model: nn.Module, out: Path | str, rank: int | None = None, *,
                   verify: bool = False, serving: bool = False, probe: bool | None = None) -> driver.Installed:
    """:func:`install`, saying which layers were installed (``--load-format megamoe`` reads it;
    ``serving`` as in :func:`driver.install_layers`)."""
    return driver.install_layers(model, out, rank, ENGINE, verify=verify, serving=serving, probe=probe)


def install(model: nn.Module, out: Path | str, rank: int | None = None, *, verify: bool = False,
            probe: bool | None = None) -> int:
    """Load rank ``rank``'s MegaMoE experts from ``out`` into every MegaMoE ``FusedMoE`` of an
    SGLang model, leaving them as SGLang's own post-processing would (so it skips its transform).

    ``rank=None`` takes SGLang's current MoE EP rank. Every module is checked (mode, EP numbers,
    placement, shapes) before any is changed; a mismatch raises :class:`InstallError`. Then SGLang's own
    MegaMoE build lays out one synthetic expert, which must be the conversion's bytes (``probe=False``
    or ``MEGAMOE_LAYOUT_PROBE=0`` skips it, logged as unchecked).
    """
    return len(install_layers(model, out, rank, verify=verify, probe=probe).layers)
