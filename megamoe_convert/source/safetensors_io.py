"""Raw, streaming access to safetensors files.

The ``safetensors`` library reads whole tensors and writes whole files from memory. The
converter needs less and more: byte ranges of tensors whose dtype it only reinterprets
(F4, F8_E8M0, I8, U8 all become bytes), and output files written chunk by chunk with
bounded memory. The file format is tiny (8-byte length, JSON header, raw data), so this
module reads and writes it directly and the library stays the independent cross-check in
tests.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from megamoe_convert import jsonio
from megamoe_convert.errors import SafetensorsError

#: Bytes per element of each safetensors dtype (F4 packs two elements per byte).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


def _torch_dtypes(names: dict[str, str]) -> dict[str, torch.dtype]:
    """Each safetensors dtype's torch dtype, by torch's name for it, where the installed torch has it."""
    found = {key: getattr(torch, name, None) for key, name in names.items()}
    return {key: dtype for key, dtype in found.items() if isinstance(dtype, torch.dtype)}


#: torch's dtype of each safetensors dtype (those the installed torch lacks are left out).
TORCH_DTYPES: dict[str, torch.dtype] = _torch_dtypes({
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
    "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64",
    "U64": "uint64", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
})

#: A header larger than this is not a model shard (guards against a corrupted length).
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: Data of files we write starts at this alignment (page-aligned mmap, direct I/O friendly).
DATA_ALIGNMENT = 4096


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live: absolute ``[begin, end)`` in ``path``."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """Shape of the same bytes viewed as uint8 (F4's last dim counts elements, not bytes)."""
        bits = DTYPE_BITS[self.dtype]
        if not self.shape:
            return (self.nbytes,)
        last = self.shape[-1] * bits
        if last % 8:
            raise SafetensorsError(f"{self.path.name}: {self.name}: last dim {self.shape[-1]} of {self.dtype} "
                                   "does not fill whole bytes")
        return (*self.shape[:-1], last // 8)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    data_start: int
    file_size: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate a safetensors header; every error names the file."""
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open below forever
            raise SafetensorsError(f"{path}: not a regular file")
        file_size = st.st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise SafetensorsError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(MAX_HEADER_BYTES, file_size - 8):
                raise SafetensorsError(f"{path}: corrupted safetensors header (declares {header_len} header bytes "
                                       f"in a {file_size}-byte file)")
            raw = f.read(header_len)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read: {e.strerror or e}") from None
    fields = jsonio.Fields(path, SafetensorsError)
    corrupted = f"{path}: corrupted safetensors header"
    header = jsonio.Fields(corrupted, SafetensorsError).obj(jsonio.parse(raw, corrupted, SafetensorsError),
                                                            name="the header")
    data_start = 8 + header_len
    metadata = fields.obj(header.pop("__metadata__", None) or {}, name="__metadata__")
    for key in metadata:
        fields.str(metadata, key, f"__metadata__.{key}")
    tensors = {name: _parse_entry(fields, path, name, spec, data_start) for name, spec in header.items()}
    _check_coverage(path, tensors, data_start, file_size)
    return SafetensorsHeader(path, data_start, file_size, tensors, metadata)


def _parse_entry(f: jsonio.Fields, path: Path, name: str, spec: Any, data_start: int) -> TensorEntry:
    f.obj(spec, name=name)
    dtype = f.str(spec, "dtype", f"{name}.dtype")
    shape = tuple(f.ints(spec, "shape", name=f"{name}.shape", max_len=16))
    offsets = f.ints(spec, "data_offsets", name=f"{name}.data_offsets", max_len=2)
    if len(offsets) != 2:
        raise f.fail(f"{name}.data_offsets must be [begin, end], got {offsets}")
    begin, end = offsets
    if dtype not in DTYPE_BITS:
        raise SafetensorsError(f"{path}: {name}: unknown dtype {jsonio.short(dtype)}")
    numel = 1
    for d in shape:
        numel *= d
    if end < begin or (numel * DTYPE_BITS[dtype] + 7) // 8 != end - begin:
        raise SafetensorsError(f"{path}: {name}: data_offsets [{begin}, {end}) do not match {dtype}{list(shape)}")
    return TensorEntry(name, path, dtype, shape, data_start + begin, data_start + end)


def _check_coverage(path: Path, tensors: dict[str, TensorEntry], data_start: int, file_size: int) -> None:
    """Tensors must tile the data area without overlap, and the file must hold all of it."""
    cursor = data_start
    for entry in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != cursor:
            raise SafetensorsError(f"{path}: corrupted safetensors header ({entry.name} starts at "
                                   f"{entry.begin - data_start}, expected {cursor - data_start})")
        cursor = entry.end
    if cursor > file_size:
        raise SafetensorsError(f"{path}: truncated: header needs {cursor} bytes, file has {file_size}")
    if cursor < file_size:
        raise SafetensorsError(f"{path}: {file_size - cursor} unexpected bytes after the last tensor")


# --------------------------------------------------------------------------------------
# Reading bytes
# --------------------------------------------------------------------------------------

def _ended_early(source: object, at: int) -> SafetensorsError:
    return SafetensorsError(f"{source or 'file'}: unexpected end of file at byte {at} "
                            "(did it shrink while being read?)")


def read_into(fd: int, offset: int, out: torch.Tensor, source: object = None) -> None:
    """Fill a contiguous CPU tensor with file bytes at ``offset`` (``preadv``, GIL released).
    ``source`` names the file in errors."""
    view = out.view(torch.uint8).reshape(-1).numpy().data
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise _ended_early(source, offset + done)
        done += n


#: Most buffers one ``preadv`` call takes.
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def readv_into(fd: int, views: list[memoryview], offset: int, source: object = None) -> None:
    """Scatter read: consecutive file bytes from ``offset`` fill ``views`` in order.

    One ``preadv`` call (GIL released) puts each run of file bytes straight where it
    belongs, so a row permutation costs no copy of its own. Short reads are resumed.
    """
    while views:
        batch = views[:IOV_MAX]
        wanted = sum(map(len, batch))
        n = os.preadv(fd, batch, offset)
        offset += n
        if n == wanted:
            views = views[len(batch):]
            continue
        if n == 0:
            raise _ended_early(source, offset)
        full = 0
        while full < len(batch) and n >= len(batch[full]):
            n -= len(batch[full])
            full += 1
        views = views[full:]
        if n:
            views[0] = views[0][n:]


class FileCache:
    """Opened file descriptors shared by readers (opening thousands of times is not free)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds.setdefault(path, os.open(path, os.O_RDONLY))
        return fd

    def read(self, entry: TensorEntry, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's raw bytes as ``uint8`` of :attr:`TensorEntry.byte_shape`."""
        if out is None:
            out = torch.empty(entry.byte_shape, dtype=torch.uint8, device="cpu")
        if out.numel() != entry.nbytes:
            raise SafetensorsError(f"{entry.name}: buffer of {out.numel()} bytes for {entry.nbytes}")
        read_into(self.fd(entry.path), entry.begin, out, entry.path)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "FileCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, safetensors dtype, shape and size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def encode_header(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None,
                  alignment: int = DATA_ALIGNMENT) -> bytes:
    """The header bytes (length prefix included) for tensors laid out in the order given.

    The JSON is padded with spaces (as the format allows) so the data starts aligned.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(8 + len(body)) // alignment) * alignment - 8
    return struct.pack("<Q", padded) + body + b" " * (padded - len(body))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in memory order (moved to the CPU and made contiguous if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().data
