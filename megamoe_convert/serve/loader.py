"""Serving side: one rank's pre-laid-out experts, straight into the kernel's tensors.

:func:`load_rank` reads a rank's own files, or a store's slots for that rank (:mod:`.store`); what
it returns and fills is :mod:`.converted`'s.

On the CPU the tensors are zero-copy views of memory-mapped shard files: nothing is read
until touched. On a GPU, a small ring of pinned buffers is filled by parallel reads while
earlier buffers are copied to the device on a side stream (:mod:`.staging`), so disk/page-cache
reads and host-to-device copies overlap; each destination tensor is allocated once, in its final
strided form. Either way the result needs no transform: it is what ``finalize_weights``
would have produced.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Iterable, Mapping

import torch

from megamoe_convert.devices import usable_device
from megamoe_convert.errors import LoadError
from megamoe_convert.jsonio import one_line
from megamoe_convert.output import ranged
from megamoe_convert.output.compare import copied_family_problem
from megamoe_convert.output.manifest import read_manifest
from megamoe_convert.output.naming import MANIFEST_NAME
from megamoe_convert.output.writer import FileRecord
from megamoe_convert.serve import staging
from megamoe_convert.serve.converted import (
    ConvertedModel,
    Destinations,
    ExpertLayer,
    check_destinations,
    data_keys,
    kernel_form,
)
from megamoe_convert.serve.load_checks import (
    check_layout_identity,
    check_logical_ids,
    check_rank_files,
    check_shard,
    resolve_layers,
)
from megamoe_convert.source import formats
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import TensorEntry, read_header, read_into


def open_converted(out: "Path | str | ConvertedModel") -> ConvertedModel:
    """A local conversion or store, opened once (``hub.pull.open_converted`` also takes a hub repo id)."""
    if isinstance(out, ConvertedModel):
        return out
    path = Path(out)
    converted = ConvertedModel(path, read_manifest(path))
    if problem := copied_family_problem(path, converted.manifest):  # a relabelled family, even resealed
        raise LoadError(f"{path / MANIFEST_NAME}: {problem}")
    check_layout_identity(path, converted.manifest)  # a foreign layout: refused before any byte is read
    return converted


# --------------------------------------------------------------------------------------
# CPU: zero-copy memory maps
# --------------------------------------------------------------------------------------

def _mmap_tensor(mapped: mmap.mmap, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
    count = entry.nbytes // dtype.itemsize
    flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=entry.begin)
    return flat.view(entry.shape)


def _cpu_layer(path: Path, entries: dict[str, TensorEntry]) -> Destinations:
    with open(path, "rb") as f:
        # Private (copy-on-write) mapping: pages load lazily on first touch; writes never reach the file.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return {key: _mmap_tensor(mapped, entries[key], formats.torch_dtype(entries[key].dtype))
            for key in data_keys(entries)}


# --------------------------------------------------------------------------------------
# GPU: pipelined page cache -> pinned ring -> device
# --------------------------------------------------------------------------------------

def _empty_destinations(entries: dict[str, TensorEntry], device: torch.device) -> Destinations:
    return {key: torch.empty(entries[key].shape, dtype=formats.torch_dtype(entries[key].dtype), device=device)
            for key in data_keys(entries)}


def _read_cpu(fd: int, path: Path, entries: dict[str, TensorEntry], dests: Destinations) -> None:
    for key, dest in dests.items():
        read_into(fd, entries[key].begin, dest, path)


def _load_cuda(out: Path, files: dict[MoELayer, FileRecord], headers: dict[MoELayer, dict[str, TensorEntry]],
               dests: dict[MoELayer, Destinations], before_writes: staging.BeforeWrites) -> None:
    """Fill every destination (all on one CUDA device) through the pinned ring."""
    device = next(iter(next(iter(dests.values())).values())).device
    ranges: list[staging.Range] = []
    fds = []
    try:
        for layer, record in files.items():
            fd = os.open(out / record.path, os.O_RDONLY)
            fds.append(fd)
            ranges += [(fd, headers[layer][key].begin, dest.view(torch.uint8).reshape(-1))
                       for key, dest in dests[layer].items()]
        staging.fill_device(ranges, device, before_writes)
    finally:
        for fd in fds:
            os.close(fd)


def _fill(out: Path, records: dict[MoELayer, FileRecord], headers: dict[MoELayer, dict[str, TensorEntry]],
          dests: dict[MoELayer, Destinations], before_writes: staging.BeforeWrites = None) -> None:
    """Read every layer's file tensors into its destinations: CUDA ones through the pinned ring,
    CPU ones with one ``preadv`` each (``before_writes``: :data:`staging.BeforeWrites`)."""
    by_device: dict[torch.device, dict[MoELayer, Destinations]] = {}
    on_cpu: dict[MoELayer, Destinations] = {}
    for layer, d in dests.items():
        for key, t in d.items():
            part = by_device.setdefault(t.device, {}) if t.device.type == "cuda" else on_cpu
            part.setdefault(layer, {})[key] = t
    for group in by_device.values():
        _load_cuda(out, {layer: records[layer] for layer in group}, headers, group, before_writes)
    if on_cpu and before_writes is not None:
        before_writes()
    for layer, d in on_cpu.items():
        path = out / records[layer].path
        fd = os.open(path, os.O_RDONLY)
        try:
            _read_cpu(fd, path, headers[layer], d)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------

def load_rank(out: "Path | str | ConvertedModel", rank: int, device: str | torch.device = "cpu", *,
              layers: str | Iterable[str] | None = None, verify: bool = False,
              ep_size: int | None = None, into: Mapping[str, Destinations] | None = None,
              before_writes: staging.BeforeWrites = None) -> dict[str, ExpertLayer]:
    """Load one EP rank's MegaMoE expert tensors from a converted directory.

    Returns ``{"layers.7.ffn.experts": ExpertLayer, ...}`` keyed by the checkpoint's layer
    prefix. ``device="cpu"`` gives lazy memory-mapped tensors; a CUDA device gives device
    tensors. ``verify=True`` also checks every file's checksum before use. ``ep_size``, where
    given, must be the one converted for (a serving job states what it expects). A hub repo id
    goes through :func:`megamoe_convert.hub.pull.load_rank`, which pulls just this rank first.
    A store (``convert`` without ``--ep-size``) serves every EP size: ``ep_size`` names the one whose
    rank to load (the default placement of the engine that serves the store's family;
    :func:`.store.load_slots` takes any other); without it,
    its EP 1 view, rank 0: every logical expert in order.

    ``into`` (keyed like the result; implies those layers) names caller-owned tensors to fill,
    e.g. an engine's parameters: the bytes go straight there, on whatever device each lives,
    and no second copy of a layer is ever allocated. ``device`` is then ignored. ``before_writes``
    is called before the first byte lands in them, while the reads go ahead: what it raises stops
    the load with nothing written (an install's layout probe runs meanwhile).
    """
    for name, value in (("rank", rank), ("ep_size", 0 if ep_size is None else ep_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise LoadError(f"{name} must be an int, got {value!r}")
    device = usable_device(device)
    converted = open_converted(out)
    try:  # a file or folder that cannot be read (permissions, I/O error) is a LoadError too
        return _load_rank(converted, rank, device, layers, verify, ep_size, into, before_writes)
    except OSError as e:
        raise LoadError(one_line(f"{e.filename or converted.path}: cannot be read ({e.strerror or e})")) from None


def _load_store_rank(converted: ConvertedModel, rank: int, device: torch.device, layers: str | Iterable[str] | None,
                     verify: bool, ep_size: int | None, into: Mapping[str, Destinations] | None,
                     before_writes: staging.BeforeWrites) -> dict[str, ExpertLayer]:
    """Rank ``rank`` of EP ``ep_size`` from a store, placed with no redundant slots
    (:func:`.store.load_store_rank`; :func:`.store.load_slots` takes any other placement)."""
    out, manifest = converted.path, converted.manifest
    if ep_size is None:
        raise LoadError(f"{out} is a store (every logical expert once, for any EP size): name the EP size whose "
                        f"rank {rank} to load, load_rank({str(out)!r}, rank={rank}, ep_size=N)")
    if not 0 <= rank < ep_size:
        raise LoadError(f"rank {rank} is out of range for ep_size={ep_size} (ranks 0..{ep_size - 1})")
    chosen = resolve_layers(manifest, list(into) if into is not None else layers)
    from megamoe_convert.serve import store  # a store's reader: not imported where a rank's own files load

    return store.load_store_rank(converted, rank, ep_size, chosen, device, verify, into, before_writes)


def _load_rank(converted: ConvertedModel, rank: int, device: torch.device, layers: str | Iterable[str] | None,
               verify: bool, ep_size: int | None, into: Mapping[str, Destinations] | None,
               before_writes: staging.BeforeWrites = None) -> dict[str, ExpertLayer]:
    out, manifest = converted.path, converted.manifest
    if manifest.store and (ep_size not in (None, 1) or rank != 0):
        return _load_store_rank(converted, rank, device, layers, verify, ep_size, into, before_writes)
    if ep_size is not None and ep_size != manifest.ep_size:
        raise LoadError(f"{out} was converted for ep_size={manifest.ep_size}, not {ep_size}; "
                        f"convert again with --ep-size {ep_size} (or without --ep-size: a store serves every EP size)")
    chosen = resolve_layers(manifest, list(into) if into is not None else layers)
    records = check_rank_files(out, manifest, rank, chosen, verify)
    served = ranged.served_ranges(out, LoadError)  # a ranged pull: only its ranges are data, never its holes
    headers: dict[MoELayer, dict[str, TensorEntry]] = {}
    for layer, record in records.items():
        header = read_header(out / record.path)
        headers[layer] = check_shard(header, manifest, layer, rank)
        if served is not None:
            ranged.check_covered(out, {record.path: [(e.begin, e.nbytes, key) for key, e in headers[layer].items()]},
                                 LoadError, served)
        check_logical_ids(out / record.path, headers[layer]["logical_ids"],
                          manifest.placement_for(layer).rank_logical_ids(rank))
    if into is not None:
        by_prefix = {layer.prefix: layer for layer in records}
        dests = {by_prefix[prefix]: d for prefix, d in into.items()}
        for layer, d in dests.items():
            check_destinations(layer.prefix, d, headers[layer])
        _fill(out, records, headers, dests, before_writes)
    elif device.type == "cuda":
        dests = {layer: _empty_destinations(headers[layer], device) for layer in records}
        _fill(out, records, headers, dests)
    else:
        dests = {layer: _cpu_layer(out / rec.path, headers[layer]) for layer, rec in records.items()}
    placements = {layer: manifest.placement_for(layer) for layer in dests}
    return {layer.prefix: ExpertLayer(layer.key, kernel_form(d, manifest.dims.format),
                                      placements[layer].rank_logical_ids(rank),
                                      placements[layer].experts_start(rank)) for layer, d in dests.items()}
