"""Every tensor of some safetensors files, read in large sequential chunks: a conversion's non-expert
shards handed to an engine's own ``load_weights``, through the same read path as the experts.

An engine's own safetensors iterator maps each file and hands out one tensor at a time, which its
weight loaders then copy to the device one pageable copy each. Here each file's data is cut into
chunks of whole tensors, in file order, of at most :data:`CHUNK_BYTES` (a tensor larger than that
is a chunk of its own), and each chunk is read with one read: on a GPU into one device buffer
through the pinned staging ring (:func:`.staging.fill_device`: many large reads in flight, their
host-to-device copies overlapping them), on the CPU into one host buffer. Every tensor is handed
out as a view of its chunk, with the dtype and shape its header gives: the bytes are the file's, so
what the engine's loading code makes of them is what it makes of its own iterator's.

Memory stays bounded: while the consumer holds one chunk's tensors, one thread reads the next
(two chunks alive at most, besides any tensor the consumer keeps); chunks are never reused, so a
tensor the consumer keeps stays valid.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from megamoe_convert.errors import LoadError
from megamoe_convert.jsonio import one_line
from megamoe_convert.serve import staging
from megamoe_convert.source.safetensors_io import TORCH_DTYPES, TensorEntry, read_header, read_into

#: Most bytes of one chunk (unless one tensor is larger): large enough to keep every reader lane of
#: the staging ring busy, small enough that two of them are a small part of any device's memory.
CHUNK_BYTES = 256 << 20
#: Each chunk buffer starts this far before a multiple of it in the file, so that a tensor aligned
#: in the file to its element size is aligned in its chunk too (a view of another dtype needs it).
ALIGN = 64

@dataclass(frozen=True)
class Chunk:
    """Consecutive tensors of one file, read with one read: file bytes ``[begin, end)``."""

    path: Path
    entries: tuple[TensorEntry, ...]

    @property
    def begin(self) -> int:
        return self.entries[0].begin

    @property
    def end(self) -> int:
        return self.entries[-1].end


def plan_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """``path``'s tensors in file order, cut into chunks of at most ``chunk_bytes`` (a larger tensor
    alone); the header is checked first (:func:`read_header`: one line naming the file), and every
    dtype must be one torch has."""
    entries = sorted(read_header(path).tensors.values(), key=lambda e: (e.begin, e.end))
    for e in entries:
        if e.dtype not in TORCH_DTYPES:
            raise LoadError(f"{path}: {e.name}: dtype {e.dtype} has no torch dtype to load it as")
    chunks: list[list[TensorEntry]] = []
    for e in entries:
        if chunks and e.end - chunks[-1][0].begin <= chunk_bytes:
            chunks[-1].append(e)
        else:
            chunks.append([e])
    return [Chunk(Path(path), tuple(c)) for c in chunks]


def _read_chunk(chunk: Chunk, fd: int, device: torch.device, stream: torch.cuda.Stream | None) -> torch.Tensor:
    """The chunk's bytes in a fresh buffer on ``device``, at offset ``begin % ALIGN`` of it; a read
    that fails is one line naming the chunk's file (its error names no file, or every one)."""
    try:
        return _read_chunk_into(chunk, fd, device, stream)
    except OSError as e:
        raise LoadError(one_line(f"{chunk.path}: cannot be read ({e.strerror or e})")) from None


def _read_chunk_into(chunk: Chunk, fd: int, device: torch.device, stream: torch.cuda.Stream | None) -> torch.Tensor:
    pad, size = chunk.begin % ALIGN, chunk.end - chunk.begin
    if device.type != "cuda":
        buffer = torch.empty(pad + size, dtype=torch.uint8)
        read_into(fd, chunk.begin, buffer[pad:], chunk.path)
        return buffer
    with torch.cuda.device(device), torch.cuda.stream(stream):  # the consumer's stream: its frees order our writes
        buffer = torch.empty(pad + size, dtype=torch.uint8, device=device)
        if size:
            staging.fill_device([(fd, chunk.begin, buffer[pad:])], device)
    return buffer


def _views(chunk: Chunk, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the chunk as a view of ``buffer`` (a copy where its bytes are not aligned to
    its element size, or it has none)."""
    base = chunk.begin - chunk.begin % ALIGN
    for e in chunk.entries:
        dtype = TORCH_DTYPES[e.dtype]
        if e.nbytes == 0:
            yield e.name, torch.empty(e.shape, dtype=dtype, device=buffer.device)
            continue
        flat = buffer[e.begin - base:e.end - base]
        if (e.begin - base) % dtype.itemsize:
            flat = flat.clone()
        yield e.name, flat.view(dtype).view(e.shape)


def stream_tensors(paths: Iterable[Path | str], device: torch.device | str = "cpu",
                   chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor of ``paths``, file by file in the order given and in file
    order within each, on ``device`` (see the module's docstring). Every header is read and checked
    before the first byte of data; a file that cannot be read is one line naming it."""
    device = torch.device(device)
    files = [Path(p) for p in paths]
    try:
        chunks = [c for path in files for c in plan_chunks(path, chunk_bytes)]
        yield from _stream(chunks, device)
    except OSError as e:
        raise LoadError(one_line(f"{e.filename or files}: cannot be read ({e.strerror or e})")) from None


def _stream(chunks: list[Chunk], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Each chunk's tensors, the next chunk read meanwhile by one thread of its own (never one of
    the staging ring's readers, which that read needs)."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    with contextlib.ExitStack() as stack:
        fds: dict[Path, int] = {}
        for path in dict.fromkeys(c.path for c in chunks):
            fds[path] = os.open(path, os.O_RDONLY)
            stack.callback(os.close, fds[path])
        ahead = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="megamoe-chunk"))

        def read(i: int) -> Future[torch.Tensor] | None:
            if i >= len(chunks):
                return None
            return ahead.submit(_read_chunk, chunks[i], fds[chunks[i].path], device, stream)

        pending = read(0)
        for i, chunk in enumerate(chunks):
            assert pending is not None
            buffer = pending.result()
            pending = read(i + 1)
            yield from _views(chunk, buffer)
            del buffer  # the consumer's views alone keep it
