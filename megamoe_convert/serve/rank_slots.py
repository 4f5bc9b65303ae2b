"""Single experts of a per-rank conversion, read by byte ranges from whichever rank file holds them.

A per-rank conversion (``megamoe convert --ep-size N``) holds each rank's slots of each MoE layer in
a file of its own, expert-major like a store file: every per-slot tensor is one block per local slot.
Its manifest's placement says which slot of which rank holds which logical expert, so any logical
expert can be read from any rank file holding it, a rank that is not this process's included
(elastic EP's recovery of experts that lived only on a failed rank). :func:`holders` picks, for each
expert asked for, a present rank file holding it, or refuses naming the expert, the layer and the
files that would hold it; :func:`load_held_experts` reads just those slots' blocks of the per-slot
tensors, through :func:`.store.fill` (the store's reader: ``preadv`` on the CPU, the pinned ring on a
GPU). No transform: the bytes are the kernel's. Each file's header and its ``logical_ids`` are
checked against the manifest before any expert byte is read.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import torch

from megamoe_convert.errors import LoadError
from megamoe_convert.output import ranged
from megamoe_convert.output.naming import MANIFEST_NAME
from megamoe_convert.output.writer import file_problem
from megamoe_convert.serve import store
from megamoe_convert.serve.converted import ConvertedModel, Destinations, ExpertLayer, kernel_form
from megamoe_convert.serve.load_checks import check_logical_ids, check_shard
from megamoe_convert.source import formats
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import TensorEntry, read_header

#: ``(rank, local slot)`` of a rank file slot holding an expert.
Holder = tuple[int, int]


def _each_expert(converted: ConvertedModel, wanted: Mapping[MoELayer, Sequence[int]],
                 ) -> Iterator[tuple[MoELayer, int, list[Holder], dict[int, str | None]]]:
    """Each wanted expert with the ``(rank, local slot)`` of every slot holding it under the manifest's
    placement, and by rank what keeps that rank's file from serving it (``None``: present)."""
    out, manifest = converted.path, converted.manifest
    if manifest.store:
        raise LoadError(f"{out} is a store: read its experts with store.load_slots")
    listed = {record.path: record for record in manifest.files}
    present: dict[str, str | None] = {}  # rank file -> its problem, or None

    def problem(rank: int, layer: MoELayer) -> str | None:
        rel = manifest.expert_file(layer, rank)
        if rank not in manifest.ranks:
            return "its rank was not converted"
        if rel not in present:
            record = listed.get(rel)
            present[rel] = "not listed in the manifest" if record is None \
                else file_problem(out / rel, record, MANIFEST_NAME, False)
        return present[rel]

    for layer, ids in wanted.items():
        placement = manifest.placement_for(layer)
        local = placement.experts_per_rank
        for logical in store.check_ids(f"{out}: {layer.key}", ids, manifest.dims.experts_of(layer)):
            slots = [(p // local, p % local) for p, held in enumerate(placement.physical_to_logical) if held == logical]
            yield layer, logical, slots, {rank: problem(rank, layer) for rank, _ in slots}


def holders(converted: ConvertedModel, wanted: Mapping[MoELayer, Sequence[int]]) -> dict[MoELayer, list[Holder]]:
    """For each layer, a ``(rank, local slot)`` per logical expert of ``wanted[layer]``, in order: the
    lowest rank whose file is present (converted, listed, of its recorded size) and holds it under
    the manifest's placement; an expert in no present file is refused in one line."""
    chosen: dict[MoELayer, list[Holder]] = {layer: [] for layer in wanted}
    for layer, logical, slots, absent in _each_expert(converted, wanted):
        found = [(rank, slot) for rank, slot in slots if absent[rank] is None]
        if not found:
            raise LoadError(f"{converted.path}: expert {logical} of {layer.key} is in no rank file present: "
                            + "; ".join(f"{converted.manifest.expert_file(layer, rank)} ({why})"
                                        for rank, why in absent.items()))
        chosen[layer].append(found[0])
    return chosen


def ranks_to_fetch(converted: ConvertedModel, wanted: Mapping[MoELayer, Sequence[int]]) -> list[int]:
    """The ranks whose files a partial copy (a hub pull of some ranks) lacks to serve ``wanted``: for
    each expert in no rank file present, the lowest converted rank holding it."""
    fetch = set()
    for _, _, slots, absent in _each_expert(converted, wanted):
        converted_ranks = [rank for rank, _ in slots if rank in converted.manifest.ranks]
        if converted_ranks and all(why is not None for why in absent.values()):
            fetch.add(min(converted_ranks))
    return sorted(fetch)


def _checked_entries(converted: ConvertedModel, layer: MoELayer, rank: int) -> dict[str, TensorEntry]:
    """The rank file's tensors, its header and ``logical_ids`` checked against the manifest."""
    manifest = converted.manifest
    path = converted.path / manifest.expert_file(layer, rank)
    entries = check_shard(read_header(path), manifest, layer, rank)
    check_logical_ids(path, entries["logical_ids"], manifest.placement_for(layer).rank_logical_ids(rank))
    return entries


def load_held_experts(converted: ConvertedModel, wanted: Mapping[MoELayer, Sequence[int]],
                      device: str | torch.device = "cpu") -> dict[str, ExpertLayer]:
    """Each layer's logical experts ``wanted[layer]``, one per slot in order, on ``device``: the per-slot
    tensors only (what moves with an expert), each slot's blocks read from a rank file holding it
    (:func:`holders`). Returns ``{prefix: ExpertLayer}`` like :func:`.store.load_slots`."""
    out, manifest = converted.path, converted.manifest
    chosen = holders(converted, wanted)
    served = ranged.served_ranges(out, LoadError)  # an unfinished pull into OUT serves nothing
    dests: dict[MoELayer, Destinations] = {}
    by_rank: dict[int, dict[MoELayer, list[tuple[int, int]]]] = {}
    for layer, found in chosen.items():
        specs = store.slot_specs(manifest, layer, len(found))
        dests[layer] = {key: torch.empty(spec.shape, dtype=formats.torch_dtype(spec.dtype), device=device)
                        for key, spec in specs.items() if key in formats.PER_SLOT_KEYS}
        for dest, (rank, slot) in enumerate(found):
            by_rank.setdefault(rank, {}).setdefault(layer, []).append((slot, dest))
    for rank, layers in sorted(by_rank.items()):
        entries = {layer: _checked_entries(converted, layer, rank) for layer in layers}
        local = {layer: manifest.placement_for(layer).experts_per_rank for layer in layers}
        reads = {layer: store.plan_reads(entries[layer], local[layer], [s for s, _ in pairs], list(dests[layer]),
                                         [d for _, d in pairs]) for layer, pairs in layers.items()}
        paths = {layer: out / manifest.expert_file(layer, rank) for layer in layers}
        if served is not None:
            store.check_pulled(out, {manifest.expert_file(layer, rank): r for layer, r in reads.items()}, served)
        store.fill(paths, reads, {layer: dests[layer] for layer in layers})
    return {layer.prefix: ExpertLayer(layer.key, kernel_form(dests[layer], manifest.dims.format),
                                      tuple(wanted[layer]), 0) for layer in chosen}

