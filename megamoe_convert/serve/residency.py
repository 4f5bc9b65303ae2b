"""Whether a load's bytes are in the page cache, asked without reading them: the GPU path sizes its
pinned ring (:func:`conversion_load`) and shapes a load's reader lanes (:func:`in_page_cache`) by it,
since a disk wants more reads in flight than memory does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import torch

_PROBE_BYTES = 4096
#: The conversion's files :func:`conversion_load` looks at, spread over its list.
_SAMPLED_FILES = 8


def in_page_cache(ranges: Iterable[tuple[int, int, torch.Tensor]]) -> bool:
    """Whether the first and last page of each of ``ranges`` (``(fd, offset, destination)``, the
    destination's size bytes) is in the page cache: a read that must not wait (``RWF_NOWAIT``) gets
    them. True where the kernel or file system cannot tell."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        return True
    probe = memoryview(bytearray(_PROBE_BYTES))
    for fd, offset, dest in ranges:
        n = min(_PROBE_BYTES, dest.numel())
        for at in sorted({offset, offset + dest.numel() - n}):
            try:
                if os.preadv(fd, [probe[:n]], at, nowait) < n:
                    return False
            except BlockingIOError:
                return False
            except OSError:  # RWF_NOWAIT not supported here: the warm shape, as before it existed
                return True
    return True


def file_cached(path: str | os.PathLike[str]) -> bool:
    """Whether a file's first and last page are in the page cache (:func:`in_page_cache`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        whole = torch.empty(os.fstat(fd).st_size, dtype=torch.uint8, device="meta")  # its size, no memory
        return in_page_cache([(fd, 0, whole)])
    finally:
        os.close(fd)


def conversion_load(conversion: str | os.PathLike[str]) -> tuple[bool, int]:
    """What loading a conversion will be like on this host: whether its files (a few, spread over its
    manifest's list: their first and last pages) are in the page cache, and about how many bytes a
    rank reads (its files over its EP size, or over the GPUs here where more: a store serves any EP
    size). ``(True, 0)`` where it cannot tell (no manifest, a file missing: the install says what is
    wrong)."""
    from megamoe_convert.errors import MegamoeError
    from megamoe_convert.output.manifest import read_manifest

    out = Path(conversion)
    try:
        manifest = read_manifest(out)
    except (MegamoeError, OSError, ValueError):
        return True, 0
    files = manifest.files
    share = sum(record.size for record in files) // max(1, manifest.ep_size, torch.cuda.device_count())
    for record in files[::max(1, -(-len(files) // _SAMPLED_FILES))]:
        try:
            if not file_cached(out / record.path):
                return False, share
        except OSError:
            return True, 0
    return True, share
