"""Atomic, checksummed output files.

Every output file is written under a hidden temporary name in its final directory,
checksummed while it is written, flushed to disk and only then renamed into place: a
reader sees either nothing or the complete file, never a prefix of it. The same writer
writes a ranged pull's sparse store files at their offsets, new or in place.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Self, Sequence

import torch
import xxhash

from megamoe_convert import faults
from megamoe_convert.errors import LinkInOutput
from megamoe_convert.source.safetensors_io import TensorSpec, encode_header, tensor_bytes

CHECKSUM_ALGORITHM = "xxh3_128"
PARTIAL_SUFFIX = ".partial"
#: Data is hashed and written in blocks of up to this size: few calls (each lets go of the GIL and
#: takes it back, a queue at many workers) for many bytes, small enough to stay in the CPU's cache.
WRITE_BLOCK_BYTES = 4 << 20
#: With fsync on, dirty data is handed to the disk every this many bytes (see :func:`start_writeback`).
WRITEBACK_BYTES = 16 << 20


@dataclass(frozen=True)
class FileRecord:
    """A finished output file, as the manifest lists it (path relative to the output root)."""

    path: str
    size: int
    checksum: str

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size, "checksum": self.checksum}


def new_hasher() -> "xxhash.xxh3_128":
    return xxhash.xxh3_128()


def file_checksum(path: Path, chunk_bytes: int = 16 << 20) -> str:
    """Checksum of a whole file, read in large chunks (the hash runs at memory speed)."""
    hasher = new_hasher()
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
    return hasher.hexdigest()


def file_problem(path: Path, record: FileRecord, where: str, checksum: bool) -> str | None:
    """What is wrong with ``path`` against its manifest record (missing, size, checksum), or None.

    The one check behind loading, verifying, pulling and merging: callers raise their own errors.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"missing (listed in {where})"
    except OSError as e:  # a folder on the way that cannot be searched
        return f"cannot be read ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file (listed in {where} as one)"
    if st.st_size != record.size:
        return f"size {st.st_size} bytes, {where} records {record.size}"
    if checksum:
        try:
            actual = file_checksum(path)
        except OSError as e:
            return f"cannot be read ({e.strerror or e})"
        if actual != record.checksum:
            return f"checksum mismatch with {where} (file is corrupted or was modified)"
    return None


#: Files checksummed at once by :func:`file_problems`: one core each (the hash runs at memory speed).
CHECK_THREADS = max(1, min(8, os.cpu_count() or 1))


def file_problems(checks: Sequence[tuple[Path, FileRecord]], where: str, checksum: bool) -> Iterator[str | None]:
    """:func:`file_problem` of each ``(path, record)``, in order; checksums run on several threads."""
    if not checksum or len(checks) < 2 or CHECK_THREADS == 1:
        yield from (file_problem(path, record, where, checksum) for path, record in checks)
        return
    with ThreadPoolExecutor(min(CHECK_THREADS, len(checks))) as pool:
        yield from pool.map(lambda check: file_problem(check[0], check[1], where, True), checks)


def partial_path(final: Path) -> Path:
    """The hidden temporary name a file is written under before its rename."""
    return final.with_name(f".{final.name}{PARTIAL_SUFFIX}")


# --------------------------------------------------------------------------------------
# Where the tool writes: inside its root, never through a link
# --------------------------------------------------------------------------------------


def link_refusal(path: Path, why: str) -> LinkInOutput:
    return LinkInOutput(f"{path}: {why}; megamoe writes only inside its output directory and never through a "
                        "link: remove it (or choose another output directory)")


def make_dirs_inside(root: Path, folder: Path) -> None:
    """Create ``folder`` below ``root`` one level at a time; every level below ``root`` must be a
    real directory (never a symbolic link, whatever it points at). ``root`` itself is the user's
    choice and may be a link; it is created if missing."""
    try:
        rel = folder.relative_to(root)
    except ValueError:
        raise link_refusal(folder, f"not inside {root}") from None
    root.mkdir(parents=True, exist_ok=True)
    current = root
    for part in rel.parts:
        if part in ("", ".", ".."):
            raise link_refusal(folder, f"not a plain path inside {root}")
        current = current / part
        try:
            os.mkdir(current)
        except FileExistsError:
            pass
        check_real_folder(current)


def check_real_folder(path: Path) -> bool:
    """A level of a folder the tool writes below must be a real directory, never a symbolic link
    (whatever it points at) nor a file; False where nothing is there yet."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(mode):
        raise link_refusal(path, "is a symbolic link")
    if not stat.S_ISDIR(mode):
        raise link_refusal(path, "is not a directory")
    return True


def check_writable_name(path: Path) -> None:
    """A file the tool is about to (re)place must not be a link or a directory under its name."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise link_refusal(path, "is a symbolic link")
    if stat.S_ISDIR(mode):
        raise link_refusal(path, "is a directory where megamoe writes a file")


def open_new_file(path: Path) -> int:
    """A fresh file at ``path`` (a stale one of the tool's temporary name is replaced): created
    exclusively and never through a link, so nothing the name pointed at is truncated."""
    check_writable_name(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o644)


def _naming(e: OSError, path: Path) -> OSError:
    """``e`` naming ``path``: the final file, never the temporary name it was written under."""
    return OSError(e.errno, e.strerror, str(path))


class OutputFile:
    """A file the tool writes below ``root``; :meth:`finish` makes it durable.

    A new file is written under its temporary name and renamed into place by :meth:`finish`: a
    reader sees nothing or all of it. Given its ``size``, it is written at offsets (:meth:`write_at`;
    what is never written stays a hole, as a ranged pull's store files hold only their ranges), and
    ``in_place`` opens the tool's own earlier file of that size where it stands to write more of it
    (no temporary name, nothing renamed). ``final`` must lie below ``root`` with no symbolic link in
    between (:func:`make_dirs_inside`), and neither it nor its temporary name may be a link: nothing
    is ever written through one. Every error names ``final``; one before the rename leaves no
    temporary file.
    """

    def __init__(self, final: Path, root: Path, fsync: bool = True, size: int | None = None,
                 in_place: bool = False) -> None:
        if in_place and size is None:
            raise ValueError(f"{final}: written in place only as a file of known size")
        self.final, self.root, self.fsync, self.in_place = final, root, fsync, in_place
        self.tmp = final if in_place else partial_path(final)
        self._fd = -1
        make_dirs_inside(root, final.parent)
        check_writable_name(final)
        if not in_place:
            self._fd = open_new_file(self.tmp)
        try:
            if in_place:
                self._fd = os.open(final, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
                st = os.fstat(self._fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                    raise OSError(errno.EINVAL, f"not the {size}-byte file an earlier pull wrote")
            elif size is not None:
                os.ftruncate(self._fd, size)
        except OSError as e:
            self.abort()
            raise _naming(e, final) from None

    def write_at(self, data: memoryview | bytes, offset: int) -> None:
        """Write ``data`` at ``offset`` of a file of known size."""
        try:
            faults.wrote(len(data))
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError as e:
            raise _naming(e, self.final) from None

    def finish(self) -> None:
        """fsync, close and (a new file) rename into place, then fsync its folder. An error names
        the final path and, if it came before the rename, deletes the temporary file."""
        try:
            if self.fsync:
                os.fsync(self._fd)
            fd, self._fd = self._fd, -1
            os.close(fd)
            if not self.in_place:
                faults.before_rename(self.final)
                os.replace(self.tmp, self.final)
                if self.fsync:
                    fsync_dir(self.final.parent)
        except OSError as e:
            self.abort()
            raise _naming(e, self.final) from None

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if not self.in_place:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self._fd >= 0:
            self.abort()


class AtomicWriter(OutputFile):
    """A new :class:`OutputFile` written in order and checksummed as it is written; :meth:`commit`
    renames it into place and gives its record."""

    def __init__(self, final: Path, root: Path, fsync: bool = True) -> None:
        super().__init__(final, root, fsync)
        self._hasher = new_hasher()
        self.size = 0
        self._written_back = 0

    def write(self, data: memoryview | bytes) -> None:
        try:
            self._write(data)
        except OSError as e:
            raise _naming(e, self.final) from None

    def _write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        faults.wrote(len(view))
        # Hash and write block by block: the write then reads bytes the hash left in the CPU cache.
        for start in range(0, len(view), WRITE_BLOCK_BYTES):
            block = view[start:start + WRITE_BLOCK_BYTES]
            self._hasher.update(block)
            done = 0
            while done < len(block):
                done += os.write(self._fd, block[done:])
        self.size += len(view)
        if self.fsync and self.size - self._written_back >= WRITEBACK_BYTES:
            start_writeback(self._fd, self._written_back, self.size - self._written_back)
            self._written_back = self.size

    def commit(self) -> FileRecord:
        """:meth:`finish`, and the file's record."""
        self.finish()
        return FileRecord(self.final.relative_to(self.root).as_posix(), self.size, self._hasher.hexdigest())


def _libc_sync_file_range() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a range of dirty pages to disk, without waiting (Linux; elsewhere a no-op).

    The fsync before the rename then finds the file mostly on disk already: the disk works
    while the CPU produces the next chunk, instead of after the whole file is written.
    Only a hint: durability still comes from that fsync.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    """Make a rename durable: fsync the directory that holds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(final: Path, root: Path, specs: list[TensorSpec],
                      chunks: Iterable[torch.Tensor | memoryview | bytes],
                      metadata: dict[str, str] | None = None, fsync: bool = True) -> FileRecord:
    """Stream a safetensors file: header from ``specs``, then the data ``chunks`` in order.

    The chunks must add up to exactly the bytes the specs declare; anything else aborts
    the file (a short or long file must never be renamed into place).
    """
    expected = sum(s.nbytes for s in specs)
    with AtomicWriter(final, root, fsync=fsync) as out:
        header = encode_header(specs, metadata)
        out.write(header)
        for chunk in chunks:
            out.write(tensor_bytes(chunk) if isinstance(chunk, torch.Tensor) else chunk)
        if out.size - len(header) != expected:
            raise RuntimeError(f"{final}: wrote {out.size - len(header)} data bytes, header declares {expected}")
        return out.commit()


def write_json_atomic(final: Path, text: str, fsync: bool = True, root: Path | None = None) -> FileRecord:
    """Small JSON files (manifest, index, state) get the same temp-then-rename treatment
    (``root``: the folder below which no link may be passed; default ``final``'s own).
    Returns the file's record (path relative to its folder), for a manifest that lists it."""
    with AtomicWriter(final, root or final.parent, fsync=fsync) as out:
        out.write(text.encode())
        record = out.commit()
    return FileRecord(final.name, record.size, record.checksum)
