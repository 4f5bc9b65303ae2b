"""Producing each unit's bytes: a rank's experts gathered from the source and laid out for the kernel
(the direct path, or chunked through :func:`transform.transform_experts`), non-expert shards and small files
copied. Each unit streams its one file in order, so memory is bounded by ``workers x chunk``."""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from megamoe_convert.convert.plan import Plan, Unit
from megamoe_convert.errors import (
    Cancelled,  # noqa: F401
)
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
    readv_into,
)

NON_EXPERT_SHARD_BYTES = 4 << 30
NON_EXPERT_METADATA = {"format": "pt"}
COPY_CHUNK_BYTES = 64 << 20


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


# --------------------------------------------------------------------------------------
# The CPU path: every source byte is read once, straight to its place in the output
# --------------------------------------------------------------------------------------
#
# transform.py states the transform as tensor operations (stack, pad, pack, interleave,
# transpose), each a full pass over memory. On the CPU the same bytes come with far less
# traffic: each weight row run lands at its final offset by one scatter read (``preadv``)
# per source tensor, so user code never touches weight bytes; scale bytes become int32
# words by a reinterpreting view (little-endian host) and are permuted by one gather and
# one transpose. The row orders are computed *by* the layout functions (applied to row
# numbers), so the two paths cannot drift apart, and the tests compare every output with
# ``transform.transform_experts``. Buffers are per thread and reused across chunks and files:
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
        order = transform.interleave_gate_up(order)
    if utccp:
        order = transform.transpose_sf_for_utccp(order)
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
    return tuple(sorted(((out, src, n) for out, src, n in runs), key=lambda r: r[1]))


def direct_path_supported(dims: Any, device: str) -> bool:
    """The direct path's assumptions: CPU, little-endian int32 words, no scale padding."""
    h, i, fmt = dims.hidden_size, dims.moe_intermediate_size, dims.format
    return (device == "cpu" and sys.byteorder == "little"
            and all(not fmt.scaled or fmt.scale_row_bytes(k) % scales.SCALES_PER_WORD == 0 for k in (h, i))
            and all(scales.tma_aligned_mn(mn) == mn and mn % transform.UTCCP_BLOCK_ROWS == 0 for mn in (h, 2 * i)))


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
            flat, base = buf.numpy().data, e * rows * cols
            bounds = (0, *splits, rows)
            iovecs = cache[rows, cols, splits, gate_up, e] = [
                [flat[base + o * cols:base + (o + n) * cols] for o, i, n in runs if lo <= i < hi]
                for lo, hi in itertools.pairwise(bounds)]
        for proj, views in zip(projs, iovecs, strict=True):
            entry = reader.ckpt.expert_entry(layer, expert, proj, "weight")
            readv_into(reader.files.fd(entry.path), views, entry.begin, entry.path)
    return out.view(len(experts), rows, cols)


def _direct_sf(reader: ExpertReader, layer: MoELayer, experts: Sequence[int], projs: Sequence[str],
               gate_up: bool, buf: torch.Tensor) -> torch.Tensor:
    """``int32 [E, packed_k, MN]``: the scale file storage (:func:`scales.sf_storage`) of the experts."""
    heights = [reader.ckpt.expert_entry(layer, 0, p, "scale").byte_shape[0] for p in projs]
    blocks = reader.ckpt.expert_entry(layer, 0, projs[0], "scale").byte_shape[1]
    mn, pk, count = sum(heights), blocks // scales.SCALES_PER_WORD, len(experts)
    size = count * mn * blocks
    staging, gathered, out = buf[:size], buf[size:2 * size], buf[2 * size:3 * size]
    flat = staging.numpy().data
    for e, expert in enumerate(experts):
        first = e * mn * blocks
        for proj, height in zip(projs, heights, strict=True):
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

    Each output tensor depends on one input only (see :func:`transform.transform_experts`), so
    the four tensors are produced one after another, each in expert chunks.
    """
    dims = reader.ckpt.dims
    group = max(1, chunk_bytes // max(1, dims.bytes_per_expert()))
    if dims.format.kernel == "sm90":
        yield from _sm90_chunks(reader, layer, logical_ids, group, cancelled)
    elif direct_path_supported(dims, reader.device):
        yield from direct_rank_shard_chunks(reader, layer, logical_ids, group, cancelled)
    else:
        yield from _routed_chunks(reader, layer, logical_ids, group, cancelled)
    yield from rank_extras.extra_chunks(reader.ckpt, reader.files, layer, logical_ids)


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
                file_size=len(encode_header(specs, metadata)) + sum(s.nbytes for s in specs))


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

        units.append(Unit(rel, sum(s.nbytes for s in specs), run, "non_expert",
                          file_size=len(encode_header(specs, NON_EXPERT_METADATA)) + sum(s.nbytes for s in specs)))
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
            return Unit(src.name, len(marked), write_marked, "small", content=marked, file_size=len(marked))

        def run() -> FileRecord:
            with AtomicWriter(plan.out / src.name, plan.out, fsync=plan.options.fsync) as w, open(src, "rb") as f:
                while block := f.read(COPY_CHUNK_BYTES):
                    w.write(block)
                return w.commit()
        size = src.stat().st_size
        return Unit(src.name, size, run, "small", file_size=size)
    return [unit(p) for p in plan.ckpt.small_files()]


