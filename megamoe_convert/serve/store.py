"""Serving from a store: any rank's experts, straight from the store's bytes.

A store (``megamoe convert`` without ``--ep-size``) holds each MoE layer's logical experts once,
in the kernel layout, expert-major: every per-slot tensor (:data:`formats.PER_SLOT_KEYS`) is
``E`` blocks of equal size, logical expert ``l``'s block at ``begin + l * block``. A rank whose
local slots hold logical experts ``ids`` takes, per tensor, the blocks of ``ids`` in slot order:
one read per run of consecutive logical ids (vLLM's default placement ``p % n``: one run, two
where it wraps; an explicit placement: a read per slot, adjacent ones coalesced), written at the
run's slot offset in the destination. No transform: the bytes are the kernel's. The per-layer
tensors (NVFP4's ``l2_input_scale_all``, the fused shared expert) are read whole.

Reads go where the destinations live: CUDA ones through the same pinned ring as
:mod:`.loader`, CPU ones with one ``preadv`` each. Nothing but the rank's slots' bytes and
the headers is read (``verify=True`` adds a checksum of each file, which reads it whole).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from megamoe_convert.errors import LoadError
from megamoe_convert.layout.placement import Placement, layer_placement
from megamoe_convert.layout.serving import serving_refusal
from megamoe_convert.output import ranged
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.output.naming import store_file
from megamoe_convert.output.shards import rank_shard_specs, store_metadata
from megamoe_convert.output.writer import file_problems
from megamoe_convert.serve import staging
from megamoe_convert.serve.converted import ConvertedModel, Destinations, ExpertLayer, check_destinations, kernel_form
from megamoe_convert.serve.load_checks import expected_tensors
from megamoe_convert.source import families, formats
from megamoe_convert.source.engines_table import resolve_engine
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import (
    TensorEntry,
    TensorSpec,
    encode_header,
    read_header,
    read_into,
)

#: ``OUT/.megamoe/ranges.json``: a ranged hub pull's record of the store ranges it fetched
#: (:mod:`.hub_ranges`, :mod:`megamoe_convert.output.ranged`); where it exists, a load reads nothing outside them.
RANGES_NAME = ranged.RANGES_NAME


@dataclass(frozen=True)
class Read:
    """One range of a store file into one destination tensor."""

    key: str  # :data:`formats.FILE_NAMES` key
    file_offset: int
    dest_offset: int  # bytes into the destination tensor
    nbytes: int


def slot_runs(ids: Sequence[int], slots: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """``(first slot, first logical id, count)`` of each run of slots holding consecutive logical experts
    (slot ``slots[i]`` holds ``ids[i]``; by default slot ``i``, every slot in a run)."""
    runs: list[list[int]] = []
    for slot, logical in zip(range(len(ids)) if slots is None else slots, ids, strict=True):
        if runs and runs[-1][1] + runs[-1][2] == logical and runs[-1][0] + runs[-1][2] == slot:
            runs[-1][2] += 1
        else:
            runs.append([slot, logical, 1])
    return [(s, layer, n) for s, layer, n in runs]


def plan_reads(entries: Mapping[str, TensorEntry], n_logical: int, ids: Sequence[int],
               keys: Sequence[str], slots: Sequence[int] | None = None) -> list[Read]:
    """The reads that fill ``keys``' destinations from a file's ``entries`` of ``n_logical`` blocks per
    per-slot tensor: block ``ids[i]`` into slot ``slots[i]`` (by default slot ``i``, ``len(ids)`` slots)."""
    reads = []
    runs = slot_runs(ids, slots)
    for key in keys:
        entry = entries[key]
        if key not in formats.PER_SLOT_KEYS:
            reads.append(Read(key, entry.begin, 0, entry.nbytes))
            continue
        block = entry.nbytes // n_logical
        reads += [Read(key, entry.begin + logical * block, slot * block, count * block)
                  for slot, logical, count in runs]
    return reads


def written_header(manifest: Manifest, layer: MoELayer, path: Path) -> tuple[bytes, dict[str, TensorEntry]]:
    """The header bytes the writer gives ``layer``'s store file under the manifest's dims, and the
    entries by key that header declares (``path`` named in them): from the manifest alone."""
    ordered = rank_shard_specs(layer, manifest.dims.experts_of(layer), manifest.dims)
    header = encode_header(ordered, store_metadata(layer, manifest.dims))
    entries, at = {}, len(header)
    for key, spec in formats.spec_keys(ordered, layer.prefix).items():
        entries[key] = TensorEntry(spec.name, path, spec.dtype, spec.shape, at, at + spec.nbytes)
        at += spec.nbytes
    return header, entries


def rank_read_plan(manifest: Manifest, layer: MoELayer, ids: Sequence[int], keys: Sequence[str] | None = None,
                   ) -> list[Read]:
    """:func:`plan_reads` from the manifest's dims alone (``inspect`` / ``plan``: no file opened).
    ``keys=None``: every tensor a rank takes (all but ``logical_ids``)."""
    _, entries = written_header(manifest, layer, Path(store_file(layer)))
    keys = [k for k in entries if k != "logical_ids"] if keys is None else keys
    return plan_reads(entries, manifest.dims.experts_of(layer), ids, keys)


# --------------------------------------------------------------------------------------
# Checks before any byte is read
# --------------------------------------------------------------------------------------

def check_store_file(path: Path, manifest: Manifest, layer: MoELayer) -> dict[str, TensorEntry]:
    """The store file must hold exactly the layer's logical experts in the manifest's dims.

    A first call pays this check per layer before any byte moves, so the common case is one read
    and one comparison: a file that starts with the very header the writer gives these dims has
    every name, dtype, shape, offset and metadata value right. Anything else is parsed, to accept
    an equivalent header or name what is wrong."""
    expected, entries = written_header(manifest, layer, path)
    if _starts_with(path, expected):
        return entries
    header = read_header(path)
    n = manifest.dims.experts_of(layer)
    entries = expected_tensors(header, manifest, layer, n, f"{n} logical experts, {manifest.dims.weight_format}")
    meta = header.metadata
    if meta.get("store") != "logical-experts" or meta.get("layout_version") != str(manifest.layout_version) \
            or meta.get("layer") != layer.key:
        raise LoadError(f"{path}: metadata (store={meta.get('store')}, layer={meta.get('layer')}, layout_version="
                        f"{meta.get('layout_version')}) is not the store file of {layer.key}, layout_version "
                        f"{manifest.layout_version}")
    return entries


def _starts_with(path: Path, prefix: bytes) -> bool:
    """Whether the file at ``path`` (a regular file: :func:`file_problems` checked) begins with ``prefix``."""
    try:
        with open(path, "rb") as f:
            return f.read(len(prefix)) == prefix
    except OSError:
        return False  # the parse that follows names the problem


def slot_specs(manifest: Manifest, layer: MoELayer, slots: int) -> dict[str, TensorSpec]:
    """What a rank of ``slots`` local experts takes of ``layer`` (all but ``logical_ids``), by key."""
    specs = formats.spec_keys(rank_shard_specs(layer, slots, manifest.dims), layer.prefix)
    return {key: spec for key, spec in specs.items() if key != "logical_ids"}


def check_ids(where: str, ids: Sequence[int], n_logical: int) -> tuple[int, ...]:
    ids = tuple(ids)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_logical for i in ids):
        raise LoadError(f"{where}: slots must hold logical experts 0..{n_logical - 1} (the store's), got "
                        f"{list(ids)[:16]}")
    return ids


# --------------------------------------------------------------------------------------
# Filling
# --------------------------------------------------------------------------------------

def check_pulled(out: Path, reads: Mapping[str, Sequence[Read]],
                 served: Mapping[str, ranged.Ranges] | None = None) -> None:
    """A store pulled by ranges (``pull --ep-size``) holds only them: every read must lie inside
    one of a finished record of this very manifest (:func:`.ranged.served_ranges`)."""
    ranged.check_covered(out, {rel: [(r.file_offset, r.nbytes, r.key) for r in file_reads]
                               for rel, file_reads in reads.items()}, LoadError, served)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1)


def _fill_cuda(jobs: list[tuple[int, list[Read], Destinations]], before_writes: staging.BeforeWrites) -> None:
    """Every read into CUDA destinations (one device) through the process's pinned ring."""
    device = next(iter(jobs[0][2].values())).device
    ranges: list[staging.Range] = []
    for fd, reads, dests in jobs:
        ranges += [(fd, r.file_offset, _flat(dests[r.key])[r.dest_offset:r.dest_offset + r.nbytes]) for r in reads]
    staging.fill_device(ranges, device, before_writes)


def fill(path_of: Mapping[MoELayer, Path], reads: Mapping[MoELayer, list[Read]],
         dests: Mapping[MoELayer, Destinations], before_writes: staging.BeforeWrites = None) -> None:
    """Every read of each layer's file (``path_of``) into that layer's destinations (CPU ones with one
    ``preadv`` each, CUDA ones through the pinned ring): a store's slots, or a rank file's
    (:mod:`.rank_slots`)."""
    fds: dict[MoELayer, int] = {}
    try:
        cuda: dict[torch.device, list[tuple[int, list[Read], Destinations]]] = {}
        for layer, layer_reads in reads.items():
            fd = fds[layer] = os.open(path_of[layer], os.O_RDONLY)
            on_cpu = [r for r in layer_reads if dests[layer][r.key].device.type != "cuda"]
            if on_cpu and before_writes is not None:
                before_writes()
            for read in on_cpu:
                dest = _flat(dests[layer][read.key])[read.dest_offset:read.dest_offset + read.nbytes]
                read_into(fd, read.file_offset, dest, path_of[layer])
            for read in layer_reads:
                if dests[layer][read.key].device.type == "cuda":
                    cuda.setdefault(dests[layer][read.key].device, []).append((fd, [read], dests[layer]))
        for jobs in cuda.values():
            _fill_cuda(jobs, before_writes)
    finally:
        for fd in fds.values():
            os.close(fd)


def load_slots(converted: ConvertedModel, slots: Mapping[MoELayer, Sequence[int]], *, starts: Mapping[MoELayer, int]
               | None = None, device: str | torch.device = "cpu", into: Mapping[MoELayer, Destinations] | None = None,
               verify: bool = False, before_writes: staging.BeforeWrites = None) -> dict[str, ExpertLayer]:
    """Fill each layer's destinations for local slots holding logical experts ``slots[layer]`` from a store.

    ``into``: caller-owned tensors (an engine's), in the rank-file form (scales' storage), of
    ``len(slots[layer])`` experts; without it, new tensors on ``device``. ``starts``: each layer's
    first physical slot, for the result. ``before_writes``: as :func:`.loader.load_rank`'s. Returns
    ``{prefix: ExpertLayer}`` like :func:`.loader.load_rank`.
    """
    out, manifest = converted.path, converted.manifest
    if not manifest.store:
        raise LoadError(f"{out} is a per-rank conversion (ep_size={manifest.ep_size}), not a store; load it with "
                        "load_rank, or convert without --ep-size")
    served = ranged.served_ranges(out, LoadError)  # a ranged pull: finished, of this manifest, or nothing
    known = {layer.key: layer for layer in manifest.layers}
    records = {}
    for layer in slots:
        if layer.key not in known:
            raise LoadError(f"layer {layer.key} is not in {out} (layers: {', '.join(known)})")
        records[layer] = manifest.file(manifest.expert_file(layer))
    checks = [(out / r.path, r) for r in records.values()]
    for (path, _), problem in zip(checks, file_problems(checks, "manifest.json", verify), strict=True):
        if problem:
            raise LoadError(f"{path}: {problem}")
    ids = {layer: check_ids(f"{out}: {layer.key}", s, manifest.dims.experts_of(layer)) for layer, s in slots.items()}
    entries = {layer: check_store_file(out / records[layer].path, manifest, layer) for layer in slots}
    dests: dict[MoELayer, Destinations] = {}
    for layer in slots:
        specs = slot_specs(manifest, layer, len(ids[layer]))
        if into is not None:
            dests[layer] = dict(into[layer])
            check_destinations(layer.prefix, dests[layer], specs)  # type: ignore[arg-type]
        else:
            dests[layer] = {key: torch.empty(spec.shape, dtype=formats.torch_dtype(spec.dtype), device=device)
                            for key, spec in specs.items()}
    reads = {layer: plan_reads(entries[layer], manifest.dims.experts_of(layer), ids[layer], list(dests[layer]))
             for layer in slots}
    if served is not None:
        check_pulled(out, {manifest.expert_file(layer): r for layer, r in reads.items()}, served)
    fill({layer: out / records[layer].path for layer in slots}, reads, dests, before_writes)
    return {layer.prefix: ExpertLayer(layer.key, kernel_form(dests[layer], manifest.dims.format), ids[layer],
                                      (starts or {}).get(layer, 0)) for layer in slots}


# --------------------------------------------------------------------------------------
# What a rank reads (inspect / plan, hub pulls): from the manifest alone
# --------------------------------------------------------------------------------------

def merged_ranges(reads: Sequence[Read]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of the file ranges ``reads`` cover, sorted, touching/overlapping ones merged
    (a redundant slot's block is one range however many slots re-read it)."""
    ranges: list[list[int]] = []
    for start, end in sorted((r.file_offset, r.file_offset + r.nbytes) for r in reads):
        if ranges and start <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], end)
        else:
            ranges.append([start, end])
    return [(start, end - start) for start, end in ranges]


def store_placements(manifest: Manifest, ep_size: int, num_redundant: int = 0, placement_file: Path | None = None,
                     engine: str | None = None, where: object = "store", error: type[Exception] = LoadError,
                     ) -> dict[MoELayer, Placement]:
    """Each layer's placement at ``ep_size`` under the engine's rule (``inspect`` / ``plan`` / ``pull
    --ep-size``; ``engine=None``: the engine that serves the store's family), refused where the store's
    family and the engine cannot serve it, in the words a checkpoint's ``plan`` uses
    (:func:`serving.serving_refusal`)."""
    family = families.by_name(manifest.family)
    n = manifest.dims.n_routed_experts
    if problem := serving_refusal(family, engine, n, num_redundant=num_redundant, placement_file=placement_file):
        raise error(f"{where}: {problem}")
    engine = resolve_engine(family, engine)
    placement = (Placement.from_file(placement_file, n, ep_size) if placement_file is not None
                 else Placement.default(n, ep_size, num_redundant))
    if problem := serving_refusal(family, engine, n, placement_file=placement_file, placement=placement):
        raise error(f"{where}: {problem}")
    return {layer: layer_placement(engine, placement, layer.is_mtp, manifest.dims.experts_of(layer),
                                   family.sglang_mtp_like_decoder) for layer in manifest.layers}


def placement_groups(manifest: Manifest, placements: Mapping[MoELayer, Placement],
                     ) -> list[tuple[list[MoELayer], Placement]]:
    """The layers that every rank reads alike (one expert count, one placement), each group once:
    a store plan costs a few groups, not one pass per layer."""
    default: dict[int, bool] = {}
    groups: dict[tuple[object, ...], tuple[list[MoELayer], Placement]] = {}
    for layer, placement in placements.items():
        if id(placement) not in default:
            default[id(placement)] = placement.is_default()
        kind: object = (placement.n_physical, placement.ep_size) if default[id(placement)] else id(placement)
        groups.setdefault((manifest.dims.experts_of(layer), kind), ([], placement))[0].append(layer)
    return list(groups.values())


def rank_reads(manifest: Manifest, placements: Mapping[MoELayer, Placement], ranks: Sequence[int],
               ) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """What each of ``ranks`` reads of a store under ``placements`` (each layer's): bytes read
    (redundant slots re-read their expert's block), reads issued, distinct file ranges and their
    bytes, in all and per layer of each group of :func:`placement_groups` (returned beside)."""
    groups = placement_groups(manifest, placements)
    described, plans = [], []
    for layers, placement in groups:
        _, entries = written_header(manifest, layers[0], Path(store_file(layers[0])))
        plans.append((entries, [k for k in entries if k != "logical_ids"], manifest.dims.experts_of(layers[0])))
        described.append({"layers": [layer.key for layer in layers], "experts": manifest.dims.experts_of(layers[0]),
                          "experts_per_rank": placement.experts_per_rank, "default": placement.is_default()})
    seen: dict[tuple[int, tuple[int, ...]], dict[str, int]] = {}
    rows = []
    for rank in ranks:
        per_group = []
        for g, (_, placement) in enumerate(groups):
            ids = placement.rank_logical_ids(rank)
            if (g, ids) not in seen:
                entries, keys, n = plans[g]
                reads = plan_reads(entries, n, ids, keys)
                ranges = merged_ranges(reads)
                seen[(g, ids)] = {"read_bytes": sum(r.nbytes for r in reads), "reads": len(reads),
                                  "ranges": len(ranges), "range_bytes": sum(n for _, n in ranges)}
            per_group.append(seen[(g, ids)])
        row: dict[str, object] = {"rank": rank}
        for key in ("read_bytes", "reads", "ranges", "range_bytes"):
            row[key] = sum(stats[key] * len(layers) for stats, (layers, _) in zip(per_group, groups, strict=True))
        row["per_layer"] = per_group
        rows.append(row)
    return rows, described


def load_store_rank(converted: ConvertedModel, rank: int, ep_size: int, layers: Sequence[MoELayer],
                    device: torch.device, verify: bool, into: Mapping[str, Destinations] | None,
                    before_writes: staging.BeforeWrites = None) -> dict[str, ExpertLayer]:
    """``load_rank(store, rank, ep_size=N)``: the rank's slots as the engine that serves the store's family
    places them with no redundant experts and no explicit placement (vLLM's and SGLang's default alike:
    slot ``p`` holds logical ``p``), each layer by that engine's rule."""
    placements = store_placements(converted.manifest, ep_size, where=converted.path, error=LoadError)
    by_prefix = {layer.prefix: layer for layer in layers}
    return load_slots(converted, {layer: placements[layer].rank_logical_ids(rank) for layer in layers},
                      starts={layer: placements[layer].experts_start(rank) for layer in layers},
                      device=device, verify=verify, before_writes=before_writes,
                      into=None if into is None else {by_prefix[p]: d for p, d in into.items()})
