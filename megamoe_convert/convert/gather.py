"""Producing each unit's bytes: a rank's experts gathered from the source and laid out for the kernel
(the direct path of ``direct.py``, or chunked through :func:`transform.transform_experts`), non-expert
shards and small files copied. Each unit streams its one file in order, so memory is bounded by
``workers x chunk``."""

from __future__ import annotations

import collections
import functools
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from megamoe_convert.convert.direct import PIECE_BYTES, direct_path_supported, direct_rank_shard_chunks
from megamoe_convert.convert.plan import Plan, Unit
from megamoe_convert.errors import Cancelled
from megamoe_convert.layout import scales, sm90, transform
from megamoe_convert.output import marker, rank_extras
from megamoe_convert.output.naming import rank_file, store_file
from megamoe_convert.output.shards import rank_shard_metadata, rank_shard_specs, store_metadata
from megamoe_convert.output.writer import AtomicWriter, FileRecord, write_safetensors
from megamoe_convert.source import formats
from megamoe_convert.source.checkpoint import CONFIG_NAME, Checkpoint
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import (
    FileCache,
    TensorEntry,
    TensorSpec,
    encode_header,
    read_into,
)

NON_EXPERT_SHARD_BYTES = 4 << 30
NON_EXPERT_METADATA = {"format": "pt"}
COPY_CHUNK_BYTES = 64 << 20


# --------------------------------------------------------------------------------------
# Units: rank shards
# --------------------------------------------------------------------------------------

class ExpertReader:
    """Reads and stacks the source bytes of a group of experts, one projection at a time."""

    def __init__(self, ckpt: Checkpoint, files: FileCache, device: str,
                 shared: SharedExpertCache | None = None) -> None:
        self.ckpt, self.files, self.device = ckpt, files, device
        self.shared = shared  # one layout of a layer's fused shared expert for all its rank files

    def stacked(self, layer: MoELayer, experts: Sequence[int], projs: Sequence[str], kind: str) -> torch.Tensor:
        """``uint8 [len(experts), sum of rows, cols]``: for ``("w1", "w3")`` that is w13's row order."""
        shapes = [self.ckpt.expert_entry(layer, 0, p, kind).byte_shape for p in projs]
        rows, cols = sum(s[0] for s in shapes), shapes[0][1]
        out = torch.empty((len(experts), rows, cols), dtype=torch.uint8)
        for i, expert in enumerate(experts):
            start = 0
            for proj, (n, _) in zip(projs, shapes, strict=True):
                self.files.read(self.ckpt.expert_entry(layer, expert, proj, kind), out[i, start:start + n])
                start += n
        return out.to(self.device, non_blocking=False) if self.device != "cpu" else out

    def fp32_scales(self, layer: MoELayer, experts: Sequence[int], projs: Sequence[str]) -> torch.Tensor:
        """``float32 [len(experts), block rows, blocks]``: FP32-encoded block scales in w13's row order,
        each tensor widened from the dtype it is stored in (``formats.fp32_block_scales``)."""
        out = torch.stack([torch.cat([formats.fp32_block_scales(self.files.read(entry), entry.dtype)
                                      for entry in (self.ckpt.expert_entry(layer, e, p, "scale") for p in projs)])
                           for e in experts])
        return out.to(self.device, non_blocking=False) if self.device != "cpu" else out


class _Layout:
    """One layer's shared-expert tensors, made by the first rank file of the layer (the others wait)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tensors: list[torch.Tensor] | None = None
        self.taken = 0

    def fill(self, make: Callable[[], Iterable[torch.Tensor]]) -> list[torch.Tensor]:
        with self.lock:
            if self.tensors is None:
                self.tensors = list(make())
            return self.tensors


class SharedExpertCache:
    """The fused shared expert's rank-file tensors, laid out once per layer for every rank file of it
    (the same bytes in each): read and laid out again per rank, it cost each file as much work as
    its routed experts at a few experts per rank. The first rank file of a layer lays it out as it
    starts (:meth:`begin`), so the others find it made when they reach it at their end. A layer goes
    once every rank file it serves has taken it; at most ``keep`` layers are held (a resume skips
    some rank files, a part of a split conversion holds some ranks)."""

    def __init__(self, uses: int, keep: int) -> None:
        self.uses, self.keep = uses, keep
        self._lock = threading.Lock()
        self._layers: collections.OrderedDict[str, _Layout] = collections.OrderedDict()

    @classmethod
    def for_plan(cls, plan: Plan) -> SharedExpertCache:
        """Rank files of one layer run side by side (units are layer-major): hold the layers that
        ``workers`` rank files span, and none for a store (one file per layer)."""
        ranks = 1 if plan.options.store else len(plan.ranks)
        return cls(ranks, 0 if ranks < 2 else plan.options.worker_count() // ranks + 2)

    def _entry(self, layer: MoELayer, take: bool) -> tuple[_Layout, bool]:
        """The layer's entry (and whether this call created it); ``take``: one more rank file has it."""
        with self._lock:
            entry = self._layers.get(layer.key)
            created = entry is None
            if entry is None:
                entry = self._layers[layer.key] = _Layout()
                while len(self._layers) > self.keep:
                    self._layers.popitem(last=False)
            if take:
                entry.taken += 1
                if entry.taken >= self.uses:
                    del self._layers[layer.key]
            return entry, created

    def begin(self, layer: MoELayer, make: Callable[[], Iterable[torch.Tensor]]) -> None:
        """At a rank file's start: the layer's first lays the shared expert out now."""
        if self.keep >= 1:
            entry, created = self._entry(layer, take=False)
            if created:
                entry.fill(make)

    def tensors(self, layer: MoELayer, make: Callable[[], Iterable[torch.Tensor]]) -> list[torch.Tensor]:
        """``make()``'s tensors for ``layer``, made once while the layer is held."""
        if self.keep < 1:
            return list(make())
        return self._entry(layer, take=True)[0].fill(make)


def _groups(items: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def rank_shard_chunks(reader: ExpertReader, layer: MoELayer, logical_ids: Sequence[int], chunk_bytes: int,
                      cancelled: threading.Event | None = None) -> Iterator[torch.Tensor | memoryview]:
    """The rank shard's data in file order, a few experts at a time.

    Each output tensor depends on one input only (see :func:`transform.transform_experts`), so
    the four tensors are produced one after another, each in expert chunks.
    """
    ckpt, dims = reader.ckpt, reader.ckpt.dims
    shared = reader.shared if dims.shared_intermediate_size else None
    make_shared = lambda: rank_extras.shared_expert_chunks(ckpt, reader.files, layer)  # noqa: E731
    if shared is not None:
        shared.begin(layer, make_shared)
    group = max(1, chunk_bytes // max(1, dims.bytes_per_expert()))
    if dims.format.kernel == "sm90":
        yield from _sm90_chunks(reader, layer, logical_ids, group, cancelled)
    elif direct_path_supported(dims, reader.device):
        yield from direct_rank_shard_chunks(ckpt, reader.files, layer, logical_ids, min(chunk_bytes, PIECE_BYTES),
                                            cancelled)
    else:
        yield from _routed_chunks(reader, layer, logical_ids, group, cancelled)
    yield from rank_extras.extra_chunks(ckpt, reader.files, layer, logical_ids,
                                        None if shared is None else shared.tensors(layer, make_shared))


def _routed_chunks(reader: ExpertReader, layer: MoELayer, logical_ids: Sequence[int], group: int,
                   cancelled: threading.Event | None) -> Iterator[torch.Tensor]:
    """The routed L1/L2 tensors by ``layout``'s tensor operations (any device, any dims)."""
    steps = [
        (("w1", "w3"), "weight", transform.l1_weight),
        (("w1", "w3"), "scale", lambda sf: scales.sf_storage(transform.l1_sf(sf))),
        (("w2",), "weight", transform.l2_weight),
        (("w2",), "scale", lambda sf: scales.sf_storage(transform.l2_sf(sf))),
    ]
    for projs, kind, lay_out in steps if reader.ckpt.dims.format.scaled else steps[::2]:
        for experts in _groups(logical_ids, group):
            if cancelled is not None and cancelled.is_set():
                raise Cancelled("cancelled")
            yield lay_out(reader.stacked(layer, experts, projs, kind))


def _sm90_chunks(reader: ExpertReader, layer: MoELayer, logical_ids: Sequence[int], group: int,
                 cancelled: threading.Event | None) -> Iterator[torch.Tensor]:
    """SGLang's SM90 FP8 layout (``sm90.sm90_l1_weight``): the L1 weight's gate/up rows interleaved,
    everything else (the L2 weight, both FP32 block scales) the checkpoint's bytes in w13 order."""
    steps = [(("w1", "w3"), "weight"), (("w1", "w3"), "scale"), (("w2",), "weight"), (("w2",), "scale")]
    for projs, kind in steps:
        for experts in _groups(logical_ids, group):
            if cancelled is not None and cancelled.is_set():
                raise Cancelled("cancelled")
            if kind == "scale":
                yield reader.fp32_scales(layer, experts, projs)
            else:
                stacked = reader.stacked(layer, experts, projs, kind)
                yield sm90.sm90_l1_weight(stacked) if projs == ("w1", "w3") else stacked


#: The same for every rank of a layer (a plan of 65536 ranks asks 65536 times per layer).
_shard_specs = functools.lru_cache(maxsize=256)(rank_shard_specs)


def rank_shard_unit(plan: Plan, reader_factory: Callable[[], ExpertReader], rank: int, layer: MoELayer,
                    cancelled: threading.Event) -> Unit:
    dims = plan.ckpt.dims
    ids = plan.placement_for(layer).rank_logical_ids(rank)
    specs = _shard_specs(layer, len(ids), dims)
    if plan.options.store:  # the layer's logical experts once, in order: a range of it is any rank's tensor
        rel, metadata = store_file(layer), store_metadata(layer, dims)
    else:
        rel = rank_file(rank, plan.placement.ep_size, layer)
        metadata = rank_shard_metadata(layer, rank, plan.placement.ep_size, dims)

    def run() -> FileRecord:
        chunks = rank_shard_chunks(reader_factory(), layer, ids, plan.options.chunk_bytes, cancelled)
        return write_safetensors(plan.out / rel, plan.out, specs, chunks, metadata, fsync=plan.options.fsync)

    return Unit(rel, sum(s.nbytes for s in specs), run, "experts", layer, rank,
                exact_size=functools.partial(_file_size, specs, metadata))


def _file_size(specs: list[TensorSpec], metadata: dict[str, str]) -> int:
    """A safetensors file's exact size: its header and its tensors' bytes."""
    return len(encode_header(specs, metadata)) + sum(s.nbytes for s in specs)


# --------------------------------------------------------------------------------------
# Units: non-expert shards and small files
# --------------------------------------------------------------------------------------

def _pack_non_expert(entries: list[TensorEntry], shard_bytes: int) -> list[list[TensorEntry]]:
    shards: list[list[TensorEntry]] = []
    size = shard_bytes
    for entry in entries:
        if size + entry.nbytes > shard_bytes and (not shards or shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return [s for s in shards if s]


def _copy_chunks(files: FileCache, entries: list[TensorEntry], cancelled: threading.Event) -> Iterator[torch.Tensor]:
    """Tensor bytes verbatim, in bounded chunks (an embedding can be GBs).

    One buffer serves every chunk (each is written before the next is read): fresh
    allocations would cost a page fault per 4 KiB.
    """
    largest = max((min(COPY_CHUNK_BYTES, e.nbytes) for e in entries), default=0)
    buf = torch.empty(largest, dtype=torch.uint8)
    for entry in entries:
        for start in range(entry.begin, entry.end, COPY_CHUNK_BYTES):
            if cancelled.is_set():
                raise Cancelled("cancelled")
            chunk = buf[:min(COPY_CHUNK_BYTES, entry.end - start)]
            read_into(files.fd(entry.path), start, chunk, entry.path)
            yield chunk


def non_expert_units(plan: Plan, files: FileCache, cancelled: threading.Event,
                     shard_bytes: int = NON_EXPERT_SHARD_BYTES) -> list[Unit]:
    shards = _pack_non_expert(plan.ckpt.non_expert_tensors(), shard_bytes)
    units = []
    for number, entries in enumerate(shards, start=1):
        rel = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        specs = [TensorSpec(e.name, e.dtype, e.shape, e.nbytes) for e in entries]
        plan.non_expert_index.update({e.name: rel for e in entries})

        def run(rel: str = rel, specs: list[TensorSpec] = specs, entries: list[TensorEntry] = entries) -> FileRecord:
            return write_safetensors(plan.out / rel, plan.out, specs, _copy_chunks(files, entries, cancelled),
                                     NON_EXPERT_METADATA, fsync=plan.options.fsync)

        units.append(Unit(rel, sum(s.nbytes for s in specs), run, "non_expert", exact_size=functools.partial(
            _file_size, specs, NON_EXPERT_METADATA)))
    return units


def small_file_units(plan: Plan) -> list[Unit]:
    """Small files copied verbatim, but ``config.json``: the source's with a marker architecture
    (``output/marker.py``), so that no engine without megamoe-convert serves the missing experts."""
    def unit(src: Path) -> Unit:
        if src.name == CONFIG_NAME:
            marked = marker.mark(src.read_bytes(), str(src))

            def write_marked() -> FileRecord:
                with AtomicWriter(plan.out / src.name, plan.out, fsync=plan.options.fsync) as w:
                    w.write(marked)
                    return w.commit()
            return Unit(src.name, len(marked), write_marked, "small", content=marked, exact_size=lambda: len(marked))

        def run() -> FileRecord:
            with AtomicWriter(plan.out / src.name, plan.out, fsync=plan.options.fsync) as w, open(src, "rb") as f:
                while block := f.read(COPY_CHUNK_BYTES):
                    w.write(block)
                return w.commit()
        size = src.stat().st_size
        return Unit(src.name, size, run, "small", exact_size=lambda: size)
    return [unit(p) for p in plan.ckpt.small_files()]


