"""Serving side: one rank's pre-laid-out experts, straight into the kernel's tensors.

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
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from megamoe_convert import jsonio
from megamoe_convert.devices import usable_device
from megamoe_convert.errors import LoadError
from megamoe_convert.jsonio import Fields, one_line
from megamoe_convert.layout import scales
from megamoe_convert.layout.placement import Placement
from megamoe_convert.layout.transform import KernelWeights
from megamoe_convert.output import ranged
from megamoe_convert.output.compare import copied_family_problem
from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.output.naming import MANIFEST_NAME
from megamoe_convert.output.writer import FileRecord
from megamoe_convert.serve import staging
from megamoe_convert.serve.load_checks import check_logical_ids, check_rank_files, check_shard, resolve_layers
from megamoe_convert.source import families, formats
from megamoe_convert.source.families import ModelFamily, TensorNames
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import TensorEntry, read_header, read_into

#: The GPU path's knobs and staging live in :mod:`.staging`; these names stay importable from here.
RING_BUFFERS, RING_BUFFER_BYTES, READ_THREADS = staging.RING_BUFFERS, staging.RING_BUFFER_BYTES, staging.READ_THREADS
PinnedRing, shared_ring, shared_readers = staging.PinnedRing, staging.shared_ring, staging.shared_readers
prepare_gpu_staging, copy_pieces_to_device = staging.prepare_gpu_staging, staging.copy_pieces_to_device


@dataclass
class ExpertLayer:
    """One MoE layer of one rank, as the fused kernel takes it."""

    key: str  # "layers.7" / "mtp.0"
    #: Every loaded tensor by its key (:data:`formats.FILE_NAMES`), scales (``*_sf``) in the kernel's
    #: MN-major view: ``l1_weight`` (MXFP4: int8 [E, 2I, H/2]), ``l1_sf`` (int32 [E, 2I, H/128]), ...
    tensors: dict[str, torch.Tensor]
    logical_ids: tuple[int, ...]  # logical expert of each local slot
    experts_start_idx: int  # first physical slot of this rank

    def _operand(self, name: str) -> KernelWeights:
        return KernelWeights(self.tensors[f"{name}_weight"], self.tensors.get(f"{name}_sf"))

    @property
    def l1(self) -> KernelWeights:
        """``(weight, MN-major scales)``; the scales are ``None`` for an unscaled format (BF16)."""
        return self._operand("l1")

    @property
    def l2(self) -> KernelWeights:
        return self._operand("l2")

    @property
    def shared(self) -> tuple[KernelWeights, KernelWeights] | None:
        """The pre-baked fused shared expert's ``(l1, l2)``, if converted and loaded."""
        return (self._operand("shared_l1"), self._operand("shared_l2")) if "shared_l1_weight" in self.tensors else None

    @property
    def num_local_experts(self) -> int:
        return len(self.logical_ids)


@dataclass
class ConvertedModel:
    """A converted directory opened once: its manifest read and validated, passed on from there."""

    path: Path
    manifest: Manifest
    #: Serving from a store: each layer's placement as the engine built it (the install driver's).
    placements: dict[MoELayer, Placement] = field(default_factory=dict)

    def placement_for(self, layer: MoELayer) -> Placement:
        """The placement ``layer`` is served with: the engine's (a store), else the conversion's."""
        return self.placements.get(layer) or self.manifest.placement_for(layer)

    @property
    def weight_format(self) -> str:
        """The routed experts' MegaMoE weight format, as the manifest records it (``formats.FORMATS``)."""
        return self.manifest.dims.weight_format

    @cached_property
    def family(self) -> ModelFamily:
        """The model family the manifest records (``families.py``)."""
        return families.by_name(self.manifest.family)

    @cached_property
    def num_hidden_layers(self) -> int:
        """Decoder layers of the model, from the copied ``config.json`` (engines number MTP
        blocks after them)."""
        where = self.path / "config.json"
        text = self.family.text(jsonio.read(where, LoadError, "config.json", jsonio.MAX_CONFIG_BYTES), where)
        return Fields(where, LoadError).int(text, self.family.keys["layers"], 0, 1 << 20)

    @cached_property
    def names(self) -> TensorNames:
        """The source checkpoint's tensor names (its family's naming)."""
        return self.family.names(self.num_hidden_layers)


def open_converted(out: "Path | str | ConvertedModel") -> ConvertedModel:
    """A local conversion or store, opened once (``hub.pull.open_converted`` also takes a hub repo id)."""
    if isinstance(out, ConvertedModel):
        return out
    path = Path(out)
    converted = ConvertedModel(path, read_manifest(path))
    if problem := copied_family_problem(path, converted.manifest):  # a relabelled family, even resealed
        raise LoadError(f"{path / MANIFEST_NAME}: {problem}")
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
            for key in _data_keys(entries)}


# --------------------------------------------------------------------------------------
# GPU: pipelined page cache -> pinned ring -> device
# --------------------------------------------------------------------------------------

#: ``{"l1_weight": t, "l1_sf": t, ...}`` (keys of :data:`formats.FILE_NAMES`): where a layer's file
#: tensors go, scales in their storage form (``scales.sf_storage`` of the kernel's MN-major view).
Destinations = dict[str, torch.Tensor]


def _data_keys(entries: dict[str, TensorEntry]) -> list[str]:
    """The keys of a shard's tensors that are loaded (all but the placement check's logical ids)."""
    return [key for key in entries if key != "logical_ids"]


def _empty_destinations(entries: dict[str, TensorEntry], device: torch.device) -> Destinations:
    return {key: torch.empty(entries[key].shape, dtype=formats.torch_dtype(entries[key].dtype), device=device)
            for key in _data_keys(entries)}


def check_destinations(where: str, dests: Destinations, entries: dict[str, TensorEntry]) -> None:
    """Caller-owned tensors must take the file bytes as they are: same bytes, shape and a
    contiguous layout (a scale's storage form is contiguous in the kernel layout)."""
    for key, dest in dests.items():
        entry = entries.get(key)
        if entry is None:
            raise LoadError(f"{where}: the conversion has no {key} (its tensors: {', '.join(_data_keys(entries))})")
        want = formats.torch_dtype(entry.dtype)
        if dest.dtype.itemsize != want.itemsize or tuple(dest.shape) != tuple(entry.shape) or not dest.is_contiguous():
            raise LoadError(f"{where}: {key} destination is {dest.dtype}{list(dest.shape)} with strides "
                            f"{list(dest.stride())}, but {entry.name} is a contiguous {want}{list(entry.shape)}")


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


def _kernel_form(d: Destinations, fmt: formats.WeightFormat) -> dict[str, torch.Tensor]:
    """File tensors -> the kernel's views (scales MN-major; an SM90 format's routed scales as stored)."""
    return {key: t if not key.endswith("_sf") else scales.sf_kernel_view(fmt, t) if key in formats.ROUTED_KEYS
            else scales.sf_from_storage(t) for key, t in d.items()}


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
    rank to load (vLLM's default placement; :func:`.store.load_slots` takes any other); without it,
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


#: Reads rank R of EP N out of a store: ``serve.store`` registers it (the store builds on this module,
#: and the serving package imports it, so it is set whenever this module is usable).
STORE_RANK_READER: Callable[..., dict[str, ExpertLayer]] | None = None


def _load_store_rank(converted: ConvertedModel, rank: int, device: torch.device, layers: str | Iterable[str] | None,
                     verify: bool, ep_size: int | None, into: Mapping[str, Destinations] | None,
                     before_writes: staging.BeforeWrites) -> dict[str, ExpertLayer]:
    """Rank ``rank`` of EP ``ep_size`` from a store, with vLLM's default placement (no redundant slots):
    its slots' experts read out of the store (``serve.store.load_slots`` takes any other placement)."""
    out, manifest = converted.path, converted.manifest
    if ep_size is None:
        raise LoadError(f"{out} is a store (every logical expert once, for any EP size): name the EP size whose "
                        f"rank {rank} to load, load_rank({str(out)!r}, rank={rank}, ep_size=N)")
    if not 0 <= rank < ep_size:
        raise LoadError(f"rank {rank} is out of range for ep_size={ep_size} (ranks 0..{ep_size - 1})")
    assert STORE_RANK_READER is not None, "megamoe_convert.serve.store registers the store reader"
    chosen = resolve_layers(manifest, list(into) if into is not None else layers)
    return STORE_RANK_READER(converted, rank, ep_size, chosen, device, verify, into, before_writes)


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
    return {layer.prefix: ExpertLayer(layer.key, _kernel_form(d, manifest.dims.format),
                                      placements[layer].rank_logical_ids(rank),
                                      placements[layer].experts_start(rank)) for layer, d in dests.items()}
