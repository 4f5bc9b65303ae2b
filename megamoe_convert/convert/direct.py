"""The CPU path of a rank file's routed experts: every source byte read once, straight to its place.

``transform.py`` states the layout as tensor operations (stack, pad, pack, interleave, transpose),
each a full pass over memory. On the CPU the same bytes come with far less traffic: each run of
weight rows lands at its final offset by one scatter read (``preadv``) per source tensor, so no
user code touches weight bytes; scale bytes become int32 words by a reinterpreting view
(little-endian host), permuted by one gather and one transpose in numpy (one thread per call,
the GIL released: torch's intra-op threads, a team for every worker thread, oversubscribe the
cores). The row orders are computed *by* the layout functions (applied to row numbers), so the two
paths cannot drift apart, and the tests compare every output with ``transform.transform_experts``.

Output comes in pieces of at most :data:`PIECE_BYTES` (an expert's rows, or a part of them), each in
its thread's one reusable buffer: small enough to be hashed and written while still in the CPU's
cache, and memory stays ``workers x buffer`` whatever the model's dims.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from megamoe_convert.errors import Cancelled
from megamoe_convert.layout import scales, transform
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import FileCache, readv_into

#: Largest piece of weight rows read and handed to the writer at once: few calls (each lets go of
#: the GIL and takes it back, a queue at many workers) for many bytes, still in the CPU's cache.
PIECE_BYTES = 4 << 20
#: Output rows of a piece are a multiple of this (one gate/up block: 8 gate rows, 8 up rows).
PIECE_ROW_ALIGN = 2 * transform.GATE_UP_GRANULARITY

#: ``(source tensor, its first row read, ((buffer offset, bytes), ...))``: one scatter read.
Scatter = tuple[int, int, tuple[tuple[int, int], ...]]

_thread_buffers = threading.local()


def _thread_buffer(nbytes: int) -> np.ndarray:
    """A flat uint8 buffer of at least ``nbytes``, owned by (and reused within) this thread: a fresh
    multi-MB allocation costs a page fault per 4 KiB."""
    buf = getattr(_thread_buffers, "buf", None)
    if buf is None or buf.size < nbytes:
        _thread_buffers.buf = _thread_buffers.iovecs = None  # free the smaller one before taking the larger
        buf = _thread_buffers.buf = np.empty(nbytes, dtype=np.uint8)
        _thread_buffers.iovecs = {}  # scatter-read buffer lists into ``buf``, built once per piece shape
    return buf


@functools.lru_cache(maxsize=64)
def _row_order(rows: int, gate_up: bool, utccp: bool) -> np.ndarray:
    """Output row ``r`` is input row ``order[r]``: the layout's row permutation, computed by it."""
    order = torch.arange(rows, dtype=torch.int64).view(1, rows, 1)
    if gate_up:
        order = transform.interleave_gate_up(order)
    if utccp:
        order = transform.transpose_sf_for_utccp(order)
    result = order.reshape(rows).numpy().astype(np.intp)
    result.flags.writeable = False  # shared by every thread
    return result


def _piece_rows(rows: int, cols: int, piece_bytes: int) -> int:
    """Output rows per piece: as many as fit ``piece_bytes``, whole gate/up blocks where possible."""
    fit = max(1, piece_bytes // cols)
    return min(rows, max(fit // PIECE_ROW_ALIGN * PIECE_ROW_ALIGN, min(fit, PIECE_ROW_ALIGN), 1))


@functools.lru_cache(maxsize=256)
def _weight_pieces(rows: int, cols: int, gate_up: bool, splits: tuple[int, ...],
                   piece_rows: int) -> tuple[tuple[Scatter, ...], ...]:
    """For each piece of ``piece_rows`` output rows, the scatter reads that fill it (offsets from the
    piece's start). A read covers consecutive rows of one source tensor (``splits``: the input rows
    where one ends and the next begins) and sends each run of them to its output rows."""
    order = _row_order(rows, gate_up, False).tolist()
    bounds = (0, *splits, rows)
    pieces = []
    for first in range(0, rows, piece_rows):
        # (input row, output row) in input order: consecutive pairs on both sides are one run
        pairs = sorted((order[out], out) for out in range(first, min(first + piece_rows, rows)))
        reads: list[list[Any]] = []
        for src, out in pairs:
            tensor = next(t for t in range(len(bounds) - 1) if bounds[t] <= src < bounds[t + 1])
            last = reads[-1] if reads else None
            if last and last[0] == tensor and last[1] + last[2] == src:
                last[2] += 1  # the next source row: same read
                offset, size = last[3][-1]
                if offset + size == (out - first) * cols:
                    last[3][-1] = (offset, size + cols)  # ... and the next output row: same run
                else:
                    last[3].append(((out - first) * cols, cols))
            else:
                reads.append([tensor, src, 1, [((out - first) * cols, cols)]])
        pieces.append(tuple((t, src - bounds[t], tuple(runs)) for t, src, _, runs in reads))
    return tuple(pieces)


def _iovecs(buf: np.ndarray, key: tuple[Any, ...], runs: tuple[tuple[int, int], ...]) -> list[memoryview]:
    """``runs`` as views of this thread's buffer, built once per buffer."""
    cache = _thread_buffers.iovecs
    views = cache.get(key)
    if views is None:
        flat = buf.data
        views = cache[key] = [flat[offset:offset + size] for offset, size in runs]
    return views


def direct_path_supported(dims: Any, device: str) -> bool:
    """The direct path's assumptions: CPU, little-endian int32 words, no scale padding."""
    h, i, fmt = dims.hidden_size, dims.moe_intermediate_size, dims.format
    return (device == "cpu" and sys.byteorder == "little"
            and all(not fmt.scaled or fmt.scale_row_bytes(k) % scales.SCALES_PER_WORD == 0 for k in (h, i))
            and all(scales.tma_aligned_mn(mn) == mn and mn % transform.UTCCP_BLOCK_ROWS == 0 for mn in (h, 2 * i)))


def _weights(ckpt: Checkpoint, files: FileCache, layer: MoELayer, experts: Sequence[int], projs: Sequence[str],
             gate_up: bool, piece_bytes: int, cancelled: threading.Event | None) -> Iterator[memoryview]:
    """``uint8 [E, rows, cols]`` in output order, one piece of one expert at a time, read in place."""
    heights = [ckpt.expert_entry(layer, 0, p, "weight").byte_shape[0] for p in projs]
    cols = ckpt.expert_entry(layer, 0, projs[0], "weight").byte_shape[1]
    rows = sum(heights)
    splits = tuple(itertools.accumulate(heights[:-1]))
    piece_rows = _piece_rows(rows, cols, piece_bytes)
    pieces = _weight_pieces(rows, cols, gate_up, splits, piece_rows)
    buf = _thread_buffer(piece_rows * cols)
    for expert in experts:
        _check(cancelled)
        entries = [ckpt.expert_entry(layer, expert, p, "weight") for p in projs]
        for number, reads in enumerate(pieces):
            for tensor, src_row, runs in reads:
                entry = entries[tensor]
                views = _iovecs(buf, (rows, cols, gate_up, splits, piece_rows, number, tensor, src_row), runs)
                readv_into(files.fd(entry.path), views, entry.begin + src_row * cols, entry.path)
            yield buf.data[:min(piece_rows, rows - number * piece_rows) * cols]


def _scales(ckpt: Checkpoint, files: FileCache, layer: MoELayer, experts: Sequence[int], projs: Sequence[str],
            gate_up: bool, cancelled: threading.Event | None) -> Iterator[memoryview]:
    """``int32 [E, packed_k, MN]``, the scale file storage (:func:`scales.sf_storage`), one expert at a time."""
    heights = [ckpt.expert_entry(layer, 0, p, "scale").byte_shape[0] for p in projs]
    blocks = ckpt.expert_entry(layer, 0, projs[0], "scale").byte_shape[1]
    mn, pk = sum(heights), blocks // scales.SCALES_PER_WORD
    size = mn * blocks
    buf = _thread_buffer(3 * size)
    staging, gathered, out = buf[:size], buf[size:2 * size], buf[2 * size:3 * size]
    words = staging.view(np.int32).reshape(mn, pk)  # pack_ue8m0, as little-endian words
    rows = gathered.view(np.int32).reshape(mn, pk)
    storage = out.view(np.int32).reshape(pk, mn)  # MN-major: the contiguous [pk, MN] behind it
    order = _row_order(mn, gate_up, True)  # interleave + UTCCP rows
    for expert in experts:
        _check(cancelled)
        first = 0
        for proj, height in zip(projs, heights, strict=True):
            entry = ckpt.expert_entry(layer, expert, proj, "scale")
            readv_into(files.fd(entry.path), [staging.data[first:first + height * blocks]], entry.begin, entry.path)
            first += height * blocks
        np.take(words, order, axis=0, out=rows, mode="clip")  # every index is in range: clip only skips a copy
        np.copyto(storage, rows.T)
        yield out.data


def direct_rank_shard_chunks(ckpt: Checkpoint, files: FileCache, layer: MoELayer, logical_ids: Sequence[int],
                             piece_bytes: int = PIECE_BYTES,
                             cancelled: threading.Event | None = None) -> Iterator[memoryview]:
    """A rank file's routed L1/L2 tensors in file order (the bytes of ``transform.transform_experts``).

    Every piece is a view of this thread's buffer: valid until the next one is asked for.
    """
    scaled = ckpt.dims.format.scaled
    for projs, gate_up in ((("w1", "w3"), True), (("w2",), False)):
        yield from _weights(ckpt, files, layer, logical_ids, projs, gate_up, piece_bytes, cancelled)
        if scaled:
            yield from _scales(ckpt, files, layer, logical_ids, projs, gate_up, cancelled)


def _check(cancelled: threading.Event | None) -> None:
    if cancelled is not None and cancelled.is_set():
        raise Cancelled("cancelled")
