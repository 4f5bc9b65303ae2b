"""The install driver every engine shares: open the conversion once, check every module, run the
engine's own loading code on one synthetic expert (:mod:`.probe`: its bytes must be the conversion's
layout) beside the load's first reads, then put each layer's bytes straight into its module's
storage once the probe has passed.

An :class:`Engine` says how to find its MegaMoE modules, which checkpoint layer each one is,
what its own rank is and what it checks beyond the contract; the driver does the rest, so an
error in one module never leaves another half-installed.
"""

from __future__ import annotations

import logging
from concurrent.futures import wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol, Sequence

from torch import nn

from megamoe_convert.engines import probe as layout_probe
from megamoe_convert.engines.contract import Contract
from megamoe_convert.errors import InstallError
from megamoe_convert.hub.resolve import open_converted
from megamoe_convert.layout.placement import Placement
from megamoe_convert.serve.converted import ConvertedModel, ExpertLayer
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source.checkpoint import SHARED_PROJECTIONS
from megamoe_convert.source.layers import MoELayer

log = logging.getLogger(__name__)


class Engine(Protocol):
    """One serving engine's side of installing (see the module docstring)."""

    #: The manifest's ``engine``: whose per-layer placement a conversion must hold.
    name: str

    def current_rank(self) -> int: ...

    def classify(self, model: nn.Module) -> list[tuple[nn.Module, Contract]]:
        """Every MegaMoE experts module with its contract; refuses a model with none or an unknown one."""
        ...

    def prefix(self, module: nn.Module) -> str: ...

    def layer_key(self, module: nn.Module, converted: ConvertedModel) -> str:
        """The checkpoint layer (``layers.7`` / ``mtp.0``) a module holds."""
        ...

    def check(self, module: nn.Module, contract: Contract, layer: MoELayer, converted: ConvertedModel,
              rank: int) -> None: ...

    def placement(self, module: nn.Module, layer: MoELayer, converted: ConvertedModel, where: str) -> Placement:
        """Serving from a store: the placement the engine built ``module`` with (EP size, redundant
        slots, the logical expert of every physical slot), from its own module and configuration, over
        the store's logical experts of ``layer``. Refuses numbers that cannot be that, in a
        :class:`PlacementError` led by ``where`` (the module and the store)."""
        ...


def require_engine(converted: ConvertedModel, engine: str) -> None:
    """A conversion holds one engine's per-layer placement (``convert --engine``); another
    engine would read the wrong experts in the layers where the rules differ."""
    if converted.manifest.engine != engine:
        raise InstallError(f"{converted.path}: converted for {converted.manifest.engine}'s expert placement, "
                           f"not {engine}'s; convert with --engine {engine}")


@dataclass(frozen=True)
class Installed:
    """What :func:`install_layers` put in place, by checkpoint layer key (``layers.7`` / ``mtp.0``)."""

    layers: tuple[str, ...]
    #: Layers whose fused shared expert came from the rank files too.
    shared: tuple[str, ...] = ()
    #: The checkpoint tensors those installs put in place: the engine's load format skips them.
    skip: frozenset[str] = frozenset()


def install_layers(model: nn.Module, out: Path | str | ConvertedModel, rank: int | None, engine: Engine,
                   *, verify: bool = False, serving: bool = False, probe: bool | None = None) -> Installed:
    """Check every module, probe the engine's own layout, then put each layer's bytes straight into its
    module's storage. ``serving``: the engine's ``--load-format megamoe`` loads the rest from the same
    directory, so an ``--experts-only`` conversion is refused. ``probe``: :func:`layout_probe.enabled`."""
    rank = engine.current_rank() if rank is None else rank
    converted = open_converted(out, [rank])
    if not converted.manifest.store:
        require_engine(converted, engine.name)
    if serving and converted.manifest.experts_only:
        raise InstallError(f"{converted.path}: converted with --experts-only, so it holds no non-expert weights to "
                           "serve; convert without --experts-only for --load-format megamoe")
    layers = {layer.key: layer for layer in converted.manifest.layers}
    planned: list[tuple[nn.Module, Contract, MoELayer]] = []
    for module, contract in engine.classify(model):
        key = engine.layer_key(module, converted)
        if key not in layers:
            raise InstallError(f"{engine.prefix(module)}: layer {key} is not in {converted.path} "
                               f"(converted layers: {', '.join(sorted(layers))})")
        planned.append((module, contract, layers[key]))
    if converted.manifest.store:  # each layer's placement is the engine's own, read from its modules
        converted = replace(converted, placements=_engine_placements(engine, planned, converted, rank))
    for module, contract, layer in planned:
        engine.check(module, contract, layer, converted, rank)
    # The engine's own bytes, checked before any module changes: the probe (passed already where the
    # model build ran it: early_probe) runs beside the load's first reads, and no byte lands in a
    # module until it has passed.
    probing = layout_probe.in_background(lambda: probe_layouts(planned, converted, probe))
    try:
        loaded = _load(planned, converted, rank, verify, probing.result)
        probing.result()  # a load that wrote nothing still waits for the probe's word
    finally:
        wait([probing])
    kinds = {layer.key: contract.shared_kinds(module, converted) for module, contract, layer in planned}
    shared = tuple(key for key, k in kinds.items() if k)
    skip = frozenset(converted.names.shared(layer, proj, kind) for _, _, layer in planned
                     for kind in kinds[layer.key] for proj in SHARED_PROJECTIONS)
    for module, contract, layer in planned:
        contract.finish(module, loaded[layer.prefix])
    log.info("megamoe: installed %d MegaMoE layers (%d with their shared expert) for %s EP rank %d from %s",
             len(planned), len(shared), engine.name, rank, converted.path)
    return Installed(tuple(layer.key for _, _, layer in planned), shared, skip)


def _load(planned: list[tuple[nn.Module, Contract, MoELayer]], converted: ConvertedModel, rank: int, verify: bool,
          before_writes: Callable[[], None]) -> dict[str, ExpertLayer]:
    """Every layer in one pipelined read: the bytes go into each module's own storage, so no second
    copy of any layer is made, and the reads never drain between layers."""
    into = {layer.prefix: contract.destinations(module, converted) for module, contract, layer in planned}
    if not converted.manifest.store:
        return load_rank(converted, rank, verify=verify, into=into, before_writes=before_writes)
    from megamoe_convert.serve.store import load_slots  # a store's reader: not imported where a rank's own files load

    placements = converted.placements
    return load_slots(converted, {layer: placements[layer].rank_logical_ids(rank) for layer in placements},
                      starts={layer: p.experts_start(rank) for layer, p in placements.items()},
                      into={layer: into[layer.prefix] for layer in placements}, verify=verify,
                      before_writes=before_writes)


def _engine_placements(engine: Engine, planned: list[tuple[nn.Module, Contract, MoELayer]],
                       converted: ConvertedModel, rank: int) -> dict[MoELayer, Placement]:
    """Every module's placement (the engine's), checked against the store's layer dims and ``rank``."""
    placements: dict[MoELayer, Placement] = {}
    for module, _, layer in planned:
        where = (f"{engine.prefix(module)}: cannot be served from the store {converted.path} "
                 f"({layer.key}: {converted.manifest.dims.experts_of(layer)} logical experts): ")
        placement = engine.placement(module, layer, converted, where)
        placement.check_rank(rank, where)
        if placements.setdefault(layer, placement) != placement:
            raise InstallError(f"{engine.prefix(module)}: a second module of {layer.key} with another placement")
    return placements


def classify(modules: Sequence[nn.Module], contracts: Sequence[Contract], prefix: str = "prefix",
             hint: str = "") -> list[tuple[nn.Module, Contract]]:
    """Each candidate module with the first contract that detects it; one of none is refused,
    naming the closest contract and what it lacks."""
    found = []
    for module in modules:
        contract = next((c for c in contracts if c.detect(module)), None)
        if contract is None:
            closest = min(contracts, key=lambda c: len(c.missing(module)))
            raise InstallError(f"{getattr(module, prefix, '?')}: {type(module).__name__} is of no MegaMoE contract "
                               f"megamoe-convert knows; closest is {closest.name}, which needs "
                               f"{', '.join(closest.missing(module))}")
        found.append((module, contract))
    if not found:
        raise InstallError(f"no MegaMoE experts modules in the model{hint}")
    return found


def probe_layouts(planned: Sequence[tuple[nn.Module, Contract, MoELayer | None]], converted: ConvertedModel,
                  probe: bool | None = None) -> None:
    """The install driver's step between the checks and the first byte: every planned module's contract
    probed (:func:`layout_probe.check_layout`: once per process per engine and input, so a model's layers
    of one format and dims cost one probe), its shared expert included where the install pre-bakes it."""
    if not layout_probe.enabled(probe):
        layout_probe.skipped(f"{len(planned)} MegaMoE modules from {converted.path}")
        return
    dims = converted.manifest.dims
    recorded = converted.manifest.layout_record()["fingerprints"]
    for module, contract, _ in planned:
        shared = dims.shared_intermediate_size if contract.shared_kinds(module, converted) else 0
        layout_probe.check_layout(contract.layout_probe(module, converted), dims.format, dims.hidden_size,
                                  dims.moe_intermediate_size, shared, recorded)
