"""SGLang's elastic-EP recovery of MegaMoE experts, from the conversion the model was served from (SGLang 0.5.23).

When ranks fail, SGLang's EPLB (``eplb_manager.update_expert_location_with_recovery``) moves every
expert to the new placement through its ``ExpertLocationUpdater``: receives from a failed rank are
dropped, yet the updater still copies its scratch buffers into the slots meant for those experts, and
returns them as missing. SGLang then reloads them from its expert DRAM backup or the checkpoint, both
into the loader-side layout and names; nothing rebuilds the MegaMoE tensors afterwards. For a
MegaMoE model that path serves garbage.

:func:`recovery_around` wraps that entry point (:mod:`.private_hooks` lists it). For a model whose
experts are MegaMoE modules, SGLang's own updater still runs (its moves between live ranks are
right); around it:

- before any byte moves, the experts this rank needs that lived only on failed ranks are worked out
  from the old and new placement; if there are any, the conversion the model was served from must
  hold them in the layout SGLang's own build makes (the layout probe, :mod:`..probe`), and every byte
  they need must be there: a store (a node's ranged pull of one: their ranges fetched from its repo
  first, :func:`megamoe_convert.hub.ranges.fetch_experts`), or a per-rank
  conversion with a rank file present holding each (any rank's, under the conversion's placement; a
  hub repo's: just the ranks holding them pulled first); otherwise recovery refuses in one line
  (:class:`InstallError`), nothing changed;
- after it, each slot the new placement gives a missing expert gets that expert's bytes, by byte
  ranges only (:func:`megamoe_convert.serve.store.load_slots`,
  :func:`megamoe_convert.serve.rank_slots.load_held_experts`), in every kernel tensor (weights, the
  UTCCP scales and the scales without UTCCP); no other slot is touched;
- SGLang is told nothing is missing, so neither its backup nor its checkpoint reload runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from megamoe_convert.engines import driver
from megamoe_convert.engines.contract import EngineModule
from megamoe_convert.engines.sglang import sm90_fp8
from megamoe_convert.engines.sglang.experts import SGLANG_PREFIX, layer_key
from megamoe_convert.engines.sglang.mega_moe import CONTRACT
from megamoe_convert.errors import InstallError, LoadError, MegamoeError
from megamoe_convert.hub.resolve import open_converted
from megamoe_convert.layout import inverse
from megamoe_convert.serve.converted import ConvertedModel, ExpertLayer
from megamoe_convert.serve.rank_slots import holders, load_held_experts, ranks_to_fetch
from megamoe_convert.serve.store import check_pulled, load_slots, rank_read_plan, slot_specs
from megamoe_convert.source.layers import MoELayer

log = logging.getLogger(__name__)

#: By layer id, the logical experts a rank needs that SGLang's updater cannot bring.
Lost = dict[int, list[int]]


# --------------------------------------------------------------------------------------
# The MegaMoE modules of a model, and which kernel tensor holds what
# --------------------------------------------------------------------------------------

def megamoe_modules(model: nn.Module) -> dict[int, EngineModule]:
    """The built MegaMoE experts modules EPLB moves (expert location on), by layer id."""
    found: dict[int, EngineModule] = {}
    module: EngineModule
    for module in model.modules():
        if not SGLANG_PREFIX.match(str(getattr(module, "layer_name", ""))):
            continue
        if getattr(module, "_mega_moe_weights_built", False) and getattr(module, "uses_expert_location", False):
            found[int(module.layer_id)] = module
    return found


def is_sm90(module: EngineModule) -> bool:
    return bool(getattr(module, "_mega_moe_sm90_fp8_weights", False))


def targets(module: EngineModule) -> dict[str, torch.Tensor]:
    """The module's tensors a conversion's per-slot tensors go into, by rank-file key, in the kernel's
    form (MN-major scales as the module holds them)."""
    if is_sm90(module):
        return {"l1_weight": module.w13_weight.data, "l1_sf": module.w13_weight_scale_inv.data,
                "l2_weight": module.w2_weight.data, "l2_sf": module.w2_weight_scale_inv.data}
    return {"l1_weight": module.w13_weight.data, "l1_sf": module.mega_w13_weight_scale_utccp.data,
            "l2_weight": module.w2_weight.data, "l2_sf": module.mega_w2_weight_scale_utccp.data}


def contract_of(module: EngineModule) -> Any:
    return sm90_fp8.CONTRACT if is_sm90(module) else CONTRACT


def write_slots(module: EngineModule, slots: Sequence[int], tensors: Mapping[str, torch.Tensor]) -> None:
    """Slots ``slots`` of every kernel tensor of ``module`` from ``tensors`` (kernel form, one expert per
    slot in order); SM100's scales without UTCCP (DeepEP's) are those bytes un-transposed, as SGLang's
    build leaves them."""
    index = torch.tensor(list(slots), dtype=torch.long, device=module.w13_weight.device)
    for key, dest in targets(module).items():
        dest.index_copy_(0, index, tensors[key].to(dest.device))
    if not is_sm90(module):
        for key, name in (("l1_sf", "w13_weight_scale_inv"), ("l2_sf", "w2_weight_scale_inv")):
            getattr(module, name).data.index_copy_(0, index, inverse.untranspose_sf_for_utccp(tensors[key]))


# --------------------------------------------------------------------------------------
# What is lost, and where it comes from
# --------------------------------------------------------------------------------------

def inactive_ranks() -> set[int]:
    """The ranks SGLang's elastic-EP state marks failed (none without elastic EP)."""
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

    state = ElasticEPStateManager.instance()
    if state is None or state.active_ranks_cpu is None:
        return set()
    return {rank for rank, active in enumerate(state.active_ranks_cpu.tolist()) if not active}


def lost_experts(old: Sequence[Sequence[int]], new: Sequence[Sequence[int]], layer_ids: Sequence[int], rank: int,
                 local: int, failed: set[int]) -> Lost:
    """By layer, the logical experts the new placement puts on ``rank`` that every old holder of lost
    (all on ``failed`` ranks) and this rank did not hold: what no live peer can send."""
    lost: Lost = {}
    for layer in layer_ids:
        before, after = list(old[layer]), list(new[layer])
        here = set(before[rank * local:(rank + 1) * local])
        for logical in after[rank * local:(rank + 1) * local]:
            holders = {p // local for p, held in enumerate(before) if held == logical}
            if logical not in here and holders <= failed and logical not in lost.get(layer, []):
                lost.setdefault(layer, []).append(logical)
    return lost


@dataclass
class Source:
    """The conversion the model was served from, checked against the model's modules."""

    converted: ConvertedModel
    layers: dict[int, MoELayer]  # by layer id

    def load(self, ids: Mapping[MoELayer, Sequence[int]], device: torch.device) -> dict[str, ExpertLayer]:
        """Each layer's logical experts ``ids[layer]``, one per slot: a store's blocks, or a per-rank
        conversion's, each from a rank file holding it."""
        if self.converted.manifest.store:
            return load_slots(self.converted, ids, device=device)
        return load_held_experts(self.converted, ids, device)


def describe(lost: Lost) -> str:
    return "; ".join(f"layer {layer}: {sorted(ids)}" for layer, ids in sorted(lost.items()))


def open_source(model: nn.Module, modules: Mapping[int, EngineModule], lost: Lost) -> Source:
    """The conversion to restore ``lost`` from, or a one-line refusal: none known, a layer it lacks, a
    per-rank conversion with no rank file present holding a lost expert, other dims, or a layout
    SGLang's own build does not make (the layout probe)."""
    from megamoe_convert.engines.sglang.model_classes import conversion_of

    head = (f"SGLang's EPLB recovery must restore MegaMoE experts that lived only on failed ranks ({describe(lost)}), "
            "which its own backup and checkpoint reload would write in the wrong layout")
    path = conversion_of(model)
    if path is None:
        raise InstallError(f"{head}, and the model was not served from a megamoe-convert conversion: refusing to "
                           "serve garbage; serve it from a store or a per-rank conversion")
    try:
        converted = open_converted(path, ())  # a hub repo: its manifest (a store: whole, as its install pulled it)
    except MegamoeError as e:
        raise InstallError(f"{head}: {e}") from e
    known = {layer.key: layer for layer in converted.manifest.layers}
    layers: dict[int, MoELayer] = {}
    for layer_id in lost:
        module = modules[layer_id]
        key = layer_key(module.layer_name)
        if key not in known:
            raise InstallError(f"{head}, but {converted.path} has no {key}")
        layers[layer_id] = known[key]
        check_dims(module, converted, known[key], head)
    planned = [(modules[i], contract_of(modules[i]), layers[i]) for i in lost]
    try:
        converted = check_held(path, converted, {layers[i]: ids for i, ids in lost.items()})
        driver.probe_layouts(planned, converted)
    except MegamoeError as e:
        raise InstallError(f"{head}: {e}") from e
    return Source(converted, layers)


def check_held(path: str, converted: ConvertedModel, wanted: Mapping[MoELayer, Sequence[int]]) -> ConvertedModel:
    """Every byte ``wanted`` needs is there before any byte moves: a store pulled by ranges holds the
    lost experts' ranges (fetched from its repo first where it lacks them); a per-rank conversion has
    a rank file present holding each (a hub repo's pulled first: just the ranks that hold them).
    Returns the conversion to read."""
    if converted.manifest.store:
        manifest = converted.manifest
        reads = {manifest.expert_file(layer): rank_read_plan(manifest, layer, ids) for layer, ids in wanted.items()}
        try:
            check_pulled(converted.path, reads)
        except LoadError as e:  # a node's ranged pull without them: their ranges from the repo it came from
            from megamoe_convert.hub.ranges import fetch_experts

            try:
                fetch_experts(converted.path, wanted)
            except MegamoeError as why:
                raise LoadError(f"{e}; {why}") from why
            check_pulled(converted.path, reads)
        return converted
    if not Path(path).is_dir() and (fetch := ranks_to_fetch(converted, wanted)):
        converted = open_converted(path, fetch)
    holders(converted, wanted)
    return converted


def check_dims(module: EngineModule, converted: ConvertedModel, layer: MoELayer, head: str) -> None:
    """Every kernel tensor of the module takes one conversion block per slot, as it is."""
    specs = slot_specs(converted.manifest, layer, 1)
    for key, dest in targets(module).items():
        spec = specs[key]
        shape = tuple(spec.shape[1:]) if not key.endswith("_sf") or is_sm90(module) \
            else (spec.shape[2], spec.shape[1])
        if tuple(dest.shape[1:]) != shape:
            raise InstallError(f"{head}, but {module.layer_name} holds {key} slots of {list(dest.shape[1:])} and "
                               f"{converted.path} ({layer.key}) of {list(shape)}")


def restore(source: Source, modules: Mapping[int, EngineModule], new: Sequence[Sequence[int]], missing: Lost,
            rank: int) -> int:
    """Each slot of ``rank`` the new placement gives a missing expert: its bytes from the conversion, in
    every kernel tensor. Returns the slots written."""
    plans: dict[int, list[int]] = {}
    ids: dict[MoELayer, list[int]] = {}
    for layer_id, logical in missing.items():
        module = modules[layer_id]
        local = int(module.num_local_experts)
        row = list(new[layer_id])[rank * local:(rank + 1) * local]
        plans[layer_id] = [slot for slot, held in enumerate(row) if held in logical]
        ids[source.layers[layer_id]] = [row[slot] for slot in plans[layer_id]]
    loaded = source.load(ids, next(iter({modules[i].w13_weight.device for i in missing})))
    for layer_id, slots in plans.items():
        write_slots(modules[layer_id], slots, loaded[source.layers[layer_id].prefix].tensors)
    return sum(len(s) for s in plans.values())


# --------------------------------------------------------------------------------------
# The hook
# --------------------------------------------------------------------------------------

class ConversionRecovery:
    """SGLang's ``ExpertLocationUpdater``, whose missing experts come from the conversion served."""

    def __init__(self, updater: Any, model: nn.Module, modules: dict[int, EngineModule]) -> None:
        self.updater, self.model, self.modules = updater, model, modules

    def update(self, routed_experts_weights_of_layer: Any, new_expert_location_metadata: Any,
               update_layer_ids: list[int], nnodes: int, rank: int, **kwargs: Any) -> dict[int, list[int]]:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        old = get_global_expert_location_metadata().physical_to_logical_map_cpu.tolist()
        new = new_expert_location_metadata.physical_to_logical_map_cpu.tolist()
        layer_ids = [i for i in update_layer_ids if i in self.modules]
        local = int(next(iter(self.modules.values())).num_local_experts)
        lost = lost_experts(old, new, layer_ids, rank, local, inactive_ranks())
        source = open_source(self.model, self.modules, lost) if lost else None  # refuse before any byte moves
        missing = self.updater.update(routed_experts_weights_of_layer, new_expert_location_metadata,
                                      update_layer_ids, nnodes, rank, **kwargs)
        missing = {layer: ids for layer, ids in missing.items() if ids}
        if not missing:
            return {}
        if others := sorted(set(missing) - set(self.modules)):
            raise InstallError(f"SGLang's EPLB recovery lost experts of layers {others}, which are not MegaMoE layers "
                               "megamoe-convert can restore")
        source = source or open_source(self.model, self.modules, missing)
        written = restore(source, self.modules, new, missing, rank)
        log.info("megamoe: EPLB recovery restored %d slots of EP rank %d from %s (%s)", written, rank,
                 source.converted.path, describe(missing))
        return {}


def recovery_around(update_with_recovery: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``AROUND`` hook of SGLang's recovery entry point: for a MegaMoE model, missing experts come from
    the conversion the model was served from (see the module docstring); any other model goes SGLang's
    own way."""
    modules = megamoe_modules(kwargs["model"])
    if modules:
        updater = kwargs["expert_location_updater"]
        kwargs["expert_location_updater"] = ConversionRecovery(updater, kwargs["model"], modules)
    return update_with_recovery(*args, **kwargs)
