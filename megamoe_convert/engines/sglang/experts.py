"""SGLang's MegaMoE experts modules (0.5.23): their names, and which logical expert each slot holds.

SGLang names a ``FusedMoE`` by its ``layer_name`` (``model.layers.7.mlp.experts``; the NextN draft
model's one MTP layer is ``model.decoder.mlp.experts``) and places logical experts on slots by its
expert-location table for layers that use one (``--init-expert-location``, EPLB's redundant
slots); DeepSeek-V4's NextN layer is built without one: slot ``p`` holds logical ``p`` (DeepSeek-V3's
uses the table, as a decoder layer does).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from megamoe_convert.engines.contract import EngineModule
from megamoe_convert.errors import InstallError, PlacementError
from megamoe_convert.layout.placement import Placement, counts_problem

if TYPE_CHECKING:
    from megamoe_convert.serve.converted import ConvertedModel
    from megamoe_convert.source.layers import MoELayer

#: ``model.layers.7.mlp.experts``; the NextN draft model's one MTP layer is ``model.decoder.mlp.experts``.
SGLANG_PREFIX = re.compile(r"^model\.(?:layers\.(?P<index>\d+)|(?P<mtp>decoder))\.mlp\.experts$")


def layer_key(prefix: str) -> str:
    """SGLang module prefix -> checkpoint layer key (``layers.7`` / ``mtp.0``)."""
    m = SGLANG_PREFIX.match(prefix)
    if m is None:
        raise InstallError(f"{prefix}: not a MegaMoE experts prefix (expected model.layers.N.mlp.experts or "
                           "model.decoder.mlp.experts)")
    return "mtp.0" if m["mtp"] else f"layers.{m['index']}"


def storage(module: EngineModule) -> tuple[int, int]:
    """``(rank, ep_size)`` whose slots the module holds: its own EP numbers, or for a rank that joined
    a running deployment (``--elastic-ep-join-mode scale``) its place in the grown world: SGLang stores
    its experts at ``_expert_storage_rank`` (the join offset plus its rank), of the offset plus its
    group's size."""
    rank = int(getattr(module, "_expert_storage_rank", module.moe_ep_rank))
    return rank, module.moe_ep_size + rank - module.moe_ep_rank


def module_logical_ids(module: EngineModule) -> tuple[int, ...]:
    """The logical expert SGLang loads into each local slot: from its expert-location table for
    layers that use one, else slot ``p`` holds logical ``p`` (the NextN layer, drafts)."""
    start = storage(module)[0] * module.num_local_experts
    if not module.uses_expert_location:
        return tuple(range(start, start + module.num_local_experts))
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    table = get_global_expert_location_metadata().physical_to_logical_map_cpu[module.layer_id]
    return tuple(int(x) for x in table[start:start + module.num_local_experts])


def module_placement(module: EngineModule, n_logical: int, where: str = "") -> Placement:
    """The placement SGLang built a module with over ``n_logical`` logical experts: its layer's row of
    the expert-location table (``--init-expert-location``, EPLB's redundant slots), or for a module
    without expert location (the NextN/MTP layer, no redundant experts) slot ``p`` holding ``p``.
    ``where`` leads a refusal."""
    if module.uses_expert_location:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        row = get_global_expert_location_metadata().physical_to_logical_map_cpu[module.layer_id]
        table = [int(x) for x in row]
    else:
        table = list(range(module.num_experts))
    ep_size = storage(module)[1]
    slots = module.num_experts if ep_size == module.moe_ep_size else module.num_local_experts * ep_size
    if len(table) != slots:
        raise PlacementError(f"{where}its expert-location table has {len(table)} slots, the module {slots}")
    if (problem := counts_problem(n_logical, ep_size)) is not None:
        raise PlacementError(f"{where}{problem}")
    return Placement.from_list(table, n_logical, ep_size, source=f"{where}SGLang's expert location")


def check_ep_numbers(module: EngineModule, where: str, layer: "MoELayer", converted: "ConvertedModel",
                     rank: int) -> None:
    """What every SGLang contract checks before any module changes: the module's EP numbers and dims are
    the conversion's, and it holds the logical experts the conversion placed on this rank."""
    placement, dims = converted.placement_for(layer), converted.manifest.dims
    expected = {"moe_ep_rank": rank, "moe_ep_size": placement.ep_size, "moe_tp_size": 1,
                "num_experts": placement.n_physical, "num_local_experts": placement.experts_per_rank,
                "hidden_size": dims.hidden_size, "intermediate_size_per_partition": dims.moe_intermediate_size}
    stored_rank, stored_size = storage(module)  # a scale-up joiner's: its place in the grown world
    numbers = {name: getattr(module, name) for name in expected}
    if (stored_rank, stored_size) != (module.moe_ep_rank, module.moe_ep_size):
        numbers.update(moe_ep_rank=stored_rank, moe_ep_size=stored_size,
                       num_experts=module.num_local_experts * stored_size)
    for attribute, want in expected.items():
        if numbers[attribute] != want:
            raise InstallError(f"{where}: {attribute} is {numbers[attribute]} in the model but {want} in "
                               f"{converted.path} ({layer.key}, rank {rank}, ep_size {placement.ep_size})")
    have, want_ids = module_logical_ids(module), placement.rank_logical_ids(rank)
    if have != want_ids:
        raise InstallError(f"{where}: SGLang places logical experts {list(have)} on rank {rank}, but "
                           f"{converted.path} holds {list(want_ids)} for {layer.key} (another "
                           "--init-expert-location or --ep-num-redundant-experts?)")
