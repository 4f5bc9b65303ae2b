"""``megamoe convert``: a checkpoint -> per-rank MegaMoE shards + non-expert shards + manifest.

The job is a list of *units*, each producing exactly one output file: a small file copy,
a non-expert shard, or one rank's shard of one MoE layer. Units run on a thread pool
(file I/O and torch kernels release the GIL); each streams its file in order, in chunks
of a few experts, so memory is bounded by ``workers x chunk`` whatever the checkpoint
size. Every file is written to a hidden temporary name and renamed when complete, then
recorded in a journal; a rerun skips journaled files whose size and checksum still match.
The manifest is written last and removed first: a directory without one is unfinished.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from . import faults, formats, layout, marker, rank_extras
from .checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, CheckpointError, ModelDims, MoELayer, parse_layer_spec
from .devices import DeviceError, usable_device
from .manifest import (FORMAT_VERSION, LAYOUT_VERSION, MANIFEST_NAME, Manifest, rank_file, rank_shard_metadata,
                       rank_shard_specs)
from .output_state import (MERGED_PARTS_DIR, ConvertError, OutputBusy, OutputState, PartState, SourceWatch,
                           check_output_dir, is_done, part_manifest_name, remove_named, stamp_files)
from .placement import Placement, PlacementError, layer_placement, parse_ranks
from .safetensors_io import FileCache, TensorEntry, TensorSpec, read_into, readv_into
from .writer import AtomicWriter, FileRecord, write_json_atomic, write_safetensors

__all__ = ["ConvertError", "OutputBusy", "MERGED_PARTS_DIR", "part_manifest_name", "rank_shard_specs"]  # re-exported

DEFAULT_CHUNK_BYTES = 32 << 20  # at least one expert; small chunks are still in the CPU cache when written
NON_EXPERT_SHARD_BYTES = 4 << 30
COPY_CHUNK_BYTES = 64 << 20


class Cancelled(ConvertError):
    pass


# --------------------------------------------------------------------------------------
# Options and plan
# --------------------------------------------------------------------------------------

@dataclass
class ConvertOptions:
    ep_size: int
    num_redundant_experts: int = 0
    placement_file: Path | None = None
    device: str = "cpu"
    workers: int = 0  # 0: one per CPU core, at most 8
    ranks: str | None = None
    layers: str | None = None
    experts_only: bool = False
    overwrite: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    fsync: bool = True
    #: ``(index, count)``: convert only part ``index`` (0-based) of ``count`` (see :func:`shard_units`).
    shard: tuple[int, int] | None = None
    shard_by: str = "layer"  # "layer" | "rank": what a part's expert shards are split by
    auto_merge: bool = True  # the last part to finish in a shared OUT merges all parts
    engine: str = "vllm"  # whose per-layer placement the ranks hold (placement.layer_placement)

    def worker_count(self) -> int:
        return self.workers if self.workers > 0 else min(8, os.cpu_count() or 1)


def select_layers(ckpt: Checkpoint, spec: str | None) -> list[MoELayer]:
    """``--layers``: ``"0-3,7,mtp"`` style (:func:`checkpoint.parse_layer_spec`)."""
    try:
        return parse_layer_spec(ckpt.layers, spec, ckpt.root)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None


def make_placement(ckpt: Checkpoint, options: ConvertOptions) -> Placement:
    family = ckpt.family
    assert family is not None
    if options.engine not in family.engines:
        raise ConvertError(f"{ckpt.root}: {family.title} conversions are for {', '.join(family.engines)} only, "
                           f"not {options.engine} ({family.engine_note}); drop --engine {options.engine}")
    if not family.redundant_experts and (options.num_redundant_experts or options.placement_file is not None):
        raise ConvertError(f"{ckpt.root}: vLLM builds {family.title}'s MegaMoE layers with its "
                           f"{ckpt.dims.n_routed_experts} experts and no redundant or re-placed ones; "
                           "drop --num-redundant-experts / --placement")
    n = ckpt.dims.n_routed_experts
    if options.placement_file is not None:
        if options.num_redundant_experts:
            raise PlacementError("give either --placement or --num-redundant-experts, not both")
        return Placement.from_file(options.placement_file, n, options.ep_size)
    return Placement.default(n, options.ep_size, options.num_redundant_experts)


@dataclass
class Unit:
    """One output file and how to produce it."""

    path: str  # relative to OUT
    nbytes: int  # approximate output size, for progress
    run: Callable[[], FileRecord]
    kind: str  # "small" | "non_expert" | "experts"
    layer: MoELayer | None = None  # for "experts": which layer and rank (used by --shard)
    rank: int | None = None
    #: The file's exact bytes when known up front (the marked config.json): a journaled file of
    #: other bytes (an older conversion's unmarked config) is redone.
    content: bytes | None = None


@dataclass
class Plan:
    ckpt: Checkpoint
    out: Path
    options: ConvertOptions
    placement: Placement
    ranks: list[int]
    layers: list[MoELayer]
    units: list[Unit] = field(default_factory=list)
    non_expert_index: dict[str, str] = field(default_factory=dict)
    all_paths: list[str] = field(default_factory=list)  # --shard: every file of the whole conversion, in order

    def fingerprint(self) -> dict[str, Any]:
        """Everything that determines the output bytes (not workers, device or verbosity)."""
        source = self.ckpt.source_record()
        return {"format_version": FORMAT_VERSION, "layout_version": LAYOUT_VERSION,
                "source_files": source["files"], "source_index_sha256": source["index_sha256"],
                "source_tensors_sha256": source["tensors_sha256"], "source_revision": source["revision"],
                "placement": list(self.placement.physical_to_logical), "ep_size": self.placement.ep_size,
                "ranks": self.ranks, "layers": [l.key for l in self.layers],
                "experts_only": self.options.experts_only, "engine": self.options.engine}

    def placement_for(self, layer: MoELayer) -> Placement:
        """The placement the engine builds ``layer`` with (SGLang's MTP layer, and MTP layers with
        an expert count of their own, have their own)."""
        try:
            return layer_placement(self.options.engine, self.placement, layer.is_mtp, self.ckpt.dims.experts_of(layer))
        except PlacementError as e:
            raise PlacementError(f"{layer.key}: {e}") from None

    def source_paths(self) -> dict[str, Path]:
        """Every source file read: shards and copied small files."""
        paths = {name: self.ckpt.root / name for name in self.ckpt.headers}
        paths.update((p.name, p) for p in self.ckpt.small_files())
        return paths

    def source_stamp(self) -> dict[str, list[int]]:
        """:func:`output_state.stamp_files` of the source. It is kept out of :meth:`fingerprint`,
        which machines with their own copies of the source share (``--shard``)."""
        return stamp_files(self.source_paths())

    def manifest(self, records: dict[str, FileRecord], extra: Sequence[FileRecord] = ()) -> Manifest:
        """The manifest of the finished run: every unit's file, then ``extra`` (the index)."""
        return Manifest(source=self.ckpt.source_record(), dims=self.ckpt.dims, placement=self.placement,
                        ranks=self.ranks, layers=self.layers, experts_only=self.options.experts_only,
                        files=[records[u.path] for u in self.units] + list(extra), engine=self.options.engine,
                        family=self.family)

    @property
    def family(self) -> str:
        assert self.ckpt.family is not None
        return self.ckpt.family.name


# --------------------------------------------------------------------------------------
# Units: rank shards
# --------------------------------------------------------------------------------------

class ExpertReader:
    """Reads and stacks the source bytes of a group of experts, one projection at a time."""

    def __init__(self, ckpt: Checkpoint, files: FileCache, device: str) -> None:
        self.ckpt, self.files, self.device = ckpt, files, device

    def stacked(self, layer: MoELayer, experts: Sequence[int], projs: Sequence[str], kind: str) -> torch.Tensor:
        """``uint8 [len(experts), sum of rows, cols]``: for ``("w1", "w3")`` that is w13's row order."""
        shapes = [self.ckpt.expert_entry(layer, 0, p, kind).byte_shape for p in projs]
        rows, cols = sum(s[0] for s in shapes), shapes[0][1]
        out = torch.empty((len(experts), rows, cols), dtype=torch.uint8)
        for i, expert in enumerate(experts):
            start = 0
            for proj, (n, _) in zip(projs, shapes):
                self.files.read(self.ckpt.expert_entry(layer, expert, proj, kind), out[i, start:start + n])
                start += n
        return out.to(self.device, non_blocking=False) if self.device != "cpu" else out


# --------------------------------------------------------------------------------------
# The CPU path: every source byte is read once, straight to its place in the output
# --------------------------------------------------------------------------------------
#
# layout.py states the transform as tensor operations (stack, pad, pack, interleave,
# transpose), each a full pass over memory. On the CPU the same bytes come with far less
# traffic: each weight row run lands at its final offset by one scatter read (``preadv``)
# per source tensor, so user code never touches weight bytes; scale bytes become int32
# words by a reinterpreting view (little-endian host) and are permuted by one gather and
# one transpose. The row orders are computed *by* the layout functions (applied to row
# numbers), so the two paths cannot drift apart, and the tests compare every output with
# ``layout.transform_experts``. Buffers are per thread and reused across chunks and files:
# a fresh multi-MB allocation costs a page fault per 4 KiB.

_thread_buffers = threading.local()


def _thread_buffer(nbytes: int) -> torch.Tensor:
    """A flat uint8 buffer of at least ``nbytes``, owned by (and reused within) this thread."""
    buf = getattr(_thread_buffers, "buf", None)
    if buf is None or buf.numel() < nbytes:
        _thread_buffers.buf = _thread_buffers.iovecs = None  # free the smaller one before taking the larger
        buf = _thread_buffers.buf = torch.empty(nbytes, dtype=torch.uint8)
        _thread_buffers.iovecs = {}  # scatter-read buffer lists into ``buf``, built once per shape
    return buf


@functools.lru_cache(maxsize=64)
def _row_order(rows: int, gate_up: bool, utccp: bool) -> torch.Tensor:
    """Output row ``r`` is input row ``order[r]``: the layout's row permutation, computed by it."""
    order = torch.arange(rows, dtype=torch.int64).view(1, rows, 1)
    if gate_up:
        order = layout.interleave_gate_up(order)
    if utccp:
        order = layout.transpose_sf_for_utccp(order)
    return order.view(rows)


@functools.lru_cache(maxsize=64)
def _row_runs(rows: int, gate_up: bool, splits: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """``(out_row, in_row, count)`` runs of consecutive rows of the weight row order, in input
    order; a run never crosses an input row in ``splits`` (where one source tensor ends)."""
    runs: list[list[int]] = []
    for out_row, in_row in enumerate(_row_order(rows, gate_up, False).tolist()):
        last = runs[-1] if runs else None
        if last and last[0] + last[2] == out_row and last[1] + last[2] == in_row and in_row not in splits:
            last[2] += 1
        else:
            runs.append([out_row, in_row, 1])
    return tuple(sorted((tuple(r) for r in runs), key=lambda r: r[1]))


def direct_path_supported(dims: Any, device: str) -> bool:
    """The direct path's assumptions: CPU, little-endian int32 words, no scale padding."""
    h, i, fmt = dims.hidden_size, dims.moe_intermediate_size, dims.format
    return (device == "cpu" and sys.byteorder == "little"
            and all(not fmt.scaled or fmt.scale_row_bytes(k) % layout.SCALES_PER_WORD == 0 for k in (h, i))
            and all(layout.tma_aligned_mn(mn) == mn and mn % layout.UTCCP_BLOCK_ROWS == 0 for mn in (h, 2 * i)))


def _direct_weight(reader: ExpertReader, layer: MoELayer, experts: Sequence[int], projs: Sequence[str],
                   gate_up: bool, buf: torch.Tensor) -> torch.Tensor:
    """``uint8 [E, rows, cols]``: the experts' weight rows in output order, read in place."""
    heights = [reader.ckpt.expert_entry(layer, 0, p, "weight").byte_shape[0] for p in projs]
    cols = reader.ckpt.expert_entry(layer, 0, projs[0], "weight").byte_shape[1]
    rows = sum(heights)
    splits = tuple(sum(heights[:n]) for n in range(1, len(heights)))
    runs = _row_runs(rows, gate_up, splits)
    out = buf[:len(experts) * rows * cols]
    cache = _thread_buffers.iovecs
    for e, expert in enumerate(experts):
        iovecs = cache.get((rows, cols, splits, gate_up, e))
        if iovecs is None:  # expert e's rows of each projection, in the file's order
            flat, base = memoryview(buf.numpy()), e * rows * cols
            bounds = (0, *splits, rows)
            iovecs = cache[rows, cols, splits, gate_up, e] = [
                [flat[base + o * cols:base + (o + n) * cols] for o, i, n in runs if lo <= i < hi]
                for lo, hi in zip(bounds, bounds[1:])]
        for proj, views in zip(projs, iovecs):
            entry = reader.ckpt.expert_entry(layer, expert, proj, "weight")
            readv_into(reader.files.fd(entry.path), views, entry.begin, entry.path)
    return out.view(len(experts), rows, cols)


def _direct_sf(reader: ExpertReader, layer: MoELayer, experts: Sequence[int], projs: Sequence[str],
               gate_up: bool, buf: torch.Tensor) -> torch.Tensor:
    """``int32 [E, packed_k, MN]``: the scale file storage (:func:`layout.sf_storage`) of the experts."""
    heights = [reader.ckpt.expert_entry(layer, 0, p, "scale").byte_shape[0] for p in projs]
    blocks = reader.ckpt.expert_entry(layer, 0, projs[0], "scale").byte_shape[1]
    mn, pk, count = sum(heights), blocks // layout.SCALES_PER_WORD, len(experts)
    size = count * mn * blocks
    staging, gathered, out = buf[:size], buf[size:2 * size], buf[2 * size:3 * size]
    flat = memoryview(staging.numpy())
    for e, expert in enumerate(experts):
        first = e * mn * blocks
        for proj, height in zip(projs, heights):
            entry = reader.ckpt.expert_entry(layer, expert, proj, "scale")
            readv_into(reader.files.fd(entry.path), [flat[first:first + height * blocks]], entry.begin,
                       entry.path)
            first += height * blocks
    words = staging.view(torch.int32).view(count, mn, pk)  # pack_ue8m0, as little-endian words
    rows = gathered.view(torch.int32).view(count, mn, pk)
    torch.index_select(words, 1, _row_order(mn, gate_up, True), out=rows)  # interleave + UTCCP rows
    storage = out.view(torch.int32).view(count, pk, mn)
    storage.copy_(rows.transpose(1, 2))  # MN-major: the contiguous [E, pk, MN] behind it
    return storage


def direct_rank_shard_chunks(reader: ExpertReader, layer: MoELayer, logical_ids: Sequence[int], group: int,
                             cancelled: threading.Event | None = None) -> Iterator[torch.Tensor]:
    """:func:`rank_shard_chunks`'s four tensors, produced by the direct path (same bytes).

    Every chunk is a view of this thread's buffer: valid until the next one is asked for.
    """
    dims = reader.ckpt.dims
    h, i, fmt = dims.hidden_size, dims.moe_intermediate_size, dims.format
    per_expert = max(2 * i * fmt.weight_row_bytes(h), h * fmt.weight_row_bytes(i),
                     3 * 2 * i * fmt.scale_row_bytes(h) if fmt.scaled else 0)
    buf = _thread_buffer(min(group, len(logical_ids)) * per_expert)
    for projs, gate_up in ((("w1", "w3"), True), (("w2",), False)):
        for produce in (_direct_weight, _direct_sf) if fmt.scaled else (_direct_weight,):
            for experts in _groups(logical_ids, group):
                if cancelled is not None and cancelled.is_set():
                    raise Cancelled("cancelled")
                yield produce(reader, layer, experts, projs, gate_up, buf)


def _groups(items: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def rank_shard_chunks(reader: ExpertReader, layer: MoELayer, logical_ids: Sequence[int], chunk_bytes: int,
                      cancelled: threading.Event | None = None) -> Iterator[torch.Tensor]:
    """The rank shard's data in file order, a few experts at a time.

    Each output tensor depends on one input only (see :func:`layout.transform_experts`), so
    the four tensors are produced one after another, each in expert chunks.
    """
    dims = reader.ckpt.dims
    group = max(1, chunk_bytes // max(1, dims.bytes_per_expert()))
    if direct_path_supported(dims, reader.device):
        yield from direct_rank_shard_chunks(reader, layer, logical_ids, group, cancelled)
    else:
        yield from _routed_chunks(reader, layer, logical_ids, group, cancelled)
    if dims.format.global_scales:
        yield from rank_extras.global_scale_chunks(reader.ckpt, reader.files, layer, logical_ids)
    yield torch.tensor(list(logical_ids), dtype=torch.int32)
    if dims.shared_intermediate_size:
        yield from rank_extras.shared_expert_chunks(reader.ckpt, reader.files, layer)


def _routed_chunks(reader: ExpertReader, layer: MoELayer, logical_ids: Sequence[int], group: int,
                   cancelled: threading.Event | None) -> Iterator[torch.Tensor]:
    """The routed L1/L2 tensors by ``layout``'s tensor operations (any device, any dims)."""
    steps = [
        (("w1", "w3"), "weight", layout.l1_weight),
        (("w1", "w3"), "scale", lambda sf: layout.sf_storage(layout.l1_sf(sf))),
        (("w2",), "weight", layout.l2_weight),
        (("w2",), "scale", lambda sf: layout.sf_storage(layout.l2_sf(sf))),
    ]
    for projs, kind, transform in steps if reader.ckpt.dims.format.scaled else steps[::2]:
        for experts in _groups(logical_ids, group):
            if cancelled is not None and cancelled.is_set():
                raise Cancelled("cancelled")
            yield transform(reader.stacked(layer, experts, projs, kind))


def rank_shard_unit(plan: Plan, reader_factory: Callable[[], ExpertReader], rank: int, layer: MoELayer,
                    cancelled: threading.Event) -> Unit:
    dims = plan.ckpt.dims
    ids = plan.placement_for(layer).rank_logical_ids(rank)
    specs = rank_shard_specs(layer, len(ids), dims)
    rel = rank_file(rank, plan.placement.ep_size, layer)
    metadata = rank_shard_metadata(layer, rank, plan.placement.ep_size, dims)

    def run() -> FileRecord:
        chunks = rank_shard_chunks(reader_factory(), layer, ids, plan.options.chunk_bytes, cancelled)
        return write_safetensors(plan.out / rel, plan.out, specs, chunks, metadata, fsync=plan.options.fsync)

    return Unit(rel, sum(s.nbytes for s in specs), run, "experts", layer, rank)


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
                                     {"format": "pt"}, fsync=plan.options.fsync)

        units.append(Unit(rel, sum(s.nbytes for s in specs), run, "non_expert"))
    return units


def small_file_units(plan: Plan) -> list[Unit]:
    """Small files copied verbatim, but ``config.json``: the source's with a marker architecture
    (:mod:`.marker`), so that no engine without megamoe-convert serves the directory's missing experts."""
    def unit(src: Path) -> Unit:
        if src.name == CONFIG_NAME:
            try:
                marked = marker.mark(src.read_bytes(), str(src))
            except marker.MarkerError as e:
                raise CheckpointError(str(e)) from None

            def write_marked() -> FileRecord:
                with AtomicWriter(plan.out / src.name, plan.out, fsync=plan.options.fsync) as w:
                    w.write(marked)
                    return w.commit()
            return Unit(src.name, len(marked), write_marked, "small", content=marked)

        def run() -> FileRecord:
            with AtomicWriter(plan.out / src.name, plan.out, fsync=plan.options.fsync) as w, open(src, "rb") as f:
                while block := f.read(COPY_CHUNK_BYTES):
                    w.write(block)
                return w.commit()
        return Unit(src.name, src.stat().st_size, run, "small")
    return [unit(p) for p in plan.ckpt.small_files()]


# --------------------------------------------------------------------------------------
# Splitting one conversion over machines (--shard I/N)
# --------------------------------------------------------------------------------------

SHARD_BY = ("layer", "rank")


def parse_shard(spec: str) -> tuple[int, int]:
    """``"2/8"`` -> ``(2, 8)``: part 2 of 8, numbered from 0 (a Kubernetes completion index)."""
    index, sep, count = spec.strip().partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise ConvertError(f"--shard: cannot parse {spec!r} (expected I/N, e.g. 0/8 for the first of 8 parts)") from None
    if not sep or n < 1 or not 0 <= i < n:
        raise ConvertError(f"--shard {spec}: need 0 <= I < N (parts are numbered from 0, e.g. 0/8 .. 7/8)")
    return i, n


def _block(items: Sequence[Any], index: int, count: int) -> Sequence[Any]:
    return items[index * len(items) // count:(index + 1) * len(items) // count]


def shard_units(plan: Plan, index: int, count: int, by: str = "layer") -> list[Unit]:
    """Part ``index`` of ``count`` of the plan's units; every unit lands in exactly one part.

    Rank shards are split into ``count`` contiguous, balanced blocks of MoE layers
    (``by="layer"``: each machine reads only its layers' source bytes) or of ranks
    (``by="rank"``); non-expert shards go round-robin from the last part, small files to
    part 0. The split depends only on the plan, so every machine computes the same one.
    """
    if by not in SHARD_BY:
        raise ConvertError(f"--shard-by {by!r}: expected one of {', '.join(SHARD_BY)}")
    mine = set(_block(plan.layers if by == "layer" else plan.ranks, index, count))
    non_expert = [u.path for u in plan.units if u.kind == "non_expert"]
    chosen = []
    for unit in plan.units:
        if unit.kind == "small":
            take = index == 0
        elif unit.kind == "non_expert":
            take = (count - 1 - non_expert.index(unit.path)) % count == index
        else:
            take = (unit.layer if by == "layer" else unit.rank) in mine
        if take:
            chosen.append(unit)
    return chosen


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------

class Progress(Protocol):
    """What long jobs report to (``ui.ByteProgress``): ``start`` per phase, then ``advance``."""

    def start(self, total_bytes: int, total_files: int, description: str | None = None,
              unit: str = "files") -> None: ...
    def advance(self, nbytes: int, path: str, skipped: bool) -> None: ...


class NoProgress:
    def start(self, total_bytes: int, total_files: int, description: str | None = None, unit: str = "files") -> None:
        pass

    def advance(self, nbytes: int, path: str, skipped: bool) -> None:
        pass


@dataclass
class Summary:
    out: str
    ep_size: int
    ranks: list[int]
    layers: list[str]
    files_written: int
    files_skipped: int
    bytes_written: int
    expert_bytes: int
    seconds: float
    shard: str | None = None  # "i/n" for a part of a split conversion
    merged: bool | None = None  # a part: whether it found all parts in OUT and merged them

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["gb_per_s"] = round(self.bytes_written / self.seconds / 1e9, 3) if self.seconds > 0 else None
        return data


def build_plan(src: Path, out: Path, options: ConvertOptions, files: FileCache,
               cancelled: threading.Event) -> Plan:
    ckpt = Checkpoint.open(src)
    placement = make_placement(ckpt, options)
    plan = Plan(ckpt, out, options, placement, parse_ranks(options.ranks, options.ep_size),
                select_layers(ckpt, options.layers))
    plan.units.extend(small_file_units(plan))
    if not options.experts_only:
        plan.units.extend(non_expert_units(plan, files, cancelled))
    reader_factory = lambda: ExpertReader(ckpt, files, options.device)  # noqa: E731
    for layer in plan.layers:  # layer-major: a layer's source bytes are read while hot
        for rank in plan.ranks:
            plan.units.append(rank_shard_unit(plan, reader_factory, rank, layer, cancelled))
    if options.shard is not None:
        plan.all_paths = [u.path for u in plan.units]
        plan.units = shard_units(plan, *options.shard, options.shard_by)
    return plan


def convert(src: Path | str, out: Path | str, options: ConvertOptions,
            progress: Progress | None = None) -> Summary:
    """Run (or resume) a conversion. Raises on any problem; OUT then has no manifest."""
    src, out = Path(src), Path(out)
    progress = progress or NoProgress()
    try:
        usable_device(options.device)
    except DeviceError as e:
        raise ConvertError(f"--device: {e}") from None
    cancelled = threading.Event()
    started = time.perf_counter()
    with FileCache() as files:
        plan = build_plan(src, out, options, files, cancelled)
        watch = SourceWatch(plan.source_paths(), {n: h.file_size for n, h in plan.ckpt.headers.items()})
        check_output_dir(out)
        state = make_state(plan)
        with state.locked():
            summary = _run_locked(plan, state, progress, cancelled, started, watch)
    if options.shard is not None and options.auto_merge:
        from .fleet import auto_merge  # the last part to finish in a shared OUT writes the manifest
        summary.merged = auto_merge(out, fsync=options.fsync)
    return summary


def make_state(plan: Plan) -> OutputState:
    if plan.options.shard is None:
        return OutputState(plan.out, plan.options.fsync)
    index, count = plan.options.shard
    shard = {"index": index, "count": count, "by": plan.options.shard_by}
    return PartState(plan.out, shard, [u.path for u in plan.units], plan.options.fsync)


def _run_locked(plan: Plan, state: OutputState, progress: Progress, cancelled: threading.Event,
                started: float, watch: SourceWatch) -> Summary:
    out = plan.out
    # Refuses (a different plan, a changed source) before anything is touched.
    state.prepare(plan.fingerprint(), plan.options.overwrite, plan.source_stamp())
    remove_named(out, [MANIFEST_NAME])  # from here on, OUT is visibly unfinished
    state.remove_partials()
    journal = state.journal()
    records: dict[str, FileRecord] = {}
    todo: list[Unit] = []
    progress.start(sum(u.nbytes for u in plan.units), len(plan.units))
    for unit in plan.units:
        if is_done(out, journal.get(unit.path)) and (unit.content is None
                                                     or (out / unit.path).read_bytes() == unit.content):
            records[unit.path] = journal[unit.path]
            progress.advance(unit.nbytes, unit.path, skipped=True)
        else:
            todo.append(unit)
    written = _run_units(todo, state, records, progress, cancelled, plan.options.worker_count())
    watch.check()  # every source byte was read: were they the bytes of one unchanged source?
    shard = plan.options.shard
    if shard is not None:  # a part: its own part manifest; `megamoe merge` writes index and manifest
        from .fleet import write_part_manifest
        write_part_manifest(plan, records)
    else:
        index = non_expert_index(plan)
        extra = [] if index is None else [write_json_atomic(out / INDEX_NAME, index_text(index), fsync=plan.options.fsync)]
        write_json_atomic(out / MANIFEST_NAME, plan.manifest(records, extra).dumps(), fsync=plan.options.fsync)
    return Summary(str(out), plan.placement.ep_size, plan.ranks, [l.key for l in plan.layers],
                   files_written=len(todo), files_skipped=len(plan.units) - len(todo), bytes_written=written,
                   expert_bytes=sum(u.nbytes for u in plan.units if u.kind == "experts"),
                   seconds=time.perf_counter() - started, shard=f"{shard[0]}/{shard[1]}" if shard else None)


def non_expert_index(plan: Plan) -> dict[str, Any] | None:
    """``model.safetensors.index.json`` of the non-expert shards (``None`` with ``--experts-only``)."""
    if plan.options.experts_only:
        return None
    return {"metadata": {"total_size": sum(e.nbytes for e in plan.ckpt.non_expert_tensors()),
                         "megamoe": "routed experts are in rank-*/ (see manifest.json)"},
            "weight_map": dict(sorted(plan.non_expert_index.items()))}


def index_text(index: dict[str, Any]) -> str:
    return json.dumps(index, indent=2)


def _run_units(units: list[Unit], state: OutputState, records: dict[str, FileRecord], progress: Progress,
               cancelled: threading.Event, workers: int) -> int:
    written = 0

    def run(unit: Unit) -> FileRecord:
        record = unit.run()
        state.record(record)
        faults.committed_file()
        return record

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megamoe")
    try:
        futures = {pool.submit(run, u): u for u in units}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION, timeout=0.5)
            for future in done:
                record = future.result()  # re-raises the first failure
                records[record.path] = record
                written += record.size
                progress.advance(futures[future].nbytes, record.path, skipped=False)
    except BaseException:
        cancelled.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return written
