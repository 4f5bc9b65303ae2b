"""Source stamps: a resumed or a running conversion never mixes the bytes of two sources.

:func:`stamp_files` records each source file's identity between runs (a resume of a source that
changed since is refused); :class:`SourceWatch` fails a run whose source changed while it was
read; :func:`sample_hash` identifies a file's content alike on every machine holding a copy
(the parts of a split conversion are checked against each other with it).
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from megamoe_convert.errors import ConvertError

#: Blocks of each source file hashed before and after a run (:class:`SourceWatch`).
WATCH_BLOCKS, WATCH_BLOCK_BYTES = 8, 64 << 10


def stamp_files(paths: dict[str, Path]) -> dict[str, list[int]]:
    """``{name: [st_mtime_ns, st_ino, st_size]}``: changes when a file is rewritten, even in place.
    Compared between runs (a resume must not mix bytes of two sources)."""
    return {name: [(st := path.stat()).st_mtime_ns, st.st_ino, st.st_size] for name, path in sorted(paths.items())}


def sample_hash(path: Path) -> int:
    """xxh3 of :data:`WATCH_BLOCKS` spread-out blocks of a file: its content, sampled cheaply (the
    same on every machine holding a copy, unlike a stamp)."""
    size = path.stat().st_size
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as f:
        for i in range(WATCH_BLOCKS):
            f.seek(size * i // WATCH_BLOCKS)
            hasher.update(f.read(WATCH_BLOCK_BYTES))
    return hasher.intdigest()


def _look(path: Path) -> tuple[int, ...]:
    """Size, mtime, ctime, inode and a hash of a few spread-out blocks of one file. ctime cannot be
    set back (``utime`` itself moves it), so an in-place rewrite always changes this."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, sample_hash(path)


class SourceWatch:
    """The source files as they were when a run started; :meth:`check` (before the manifest is
    written) fails the run if any changed while it was read."""

    def __init__(self, paths: dict[str, Path], sizes: dict[str, int]) -> None:
        self.paths = paths
        self.before = {name: _look(path) for name, path in paths.items()}
        self.grown = [name for name, size in sizes.items() if self.before[name][0] != size]

    def check(self) -> None:
        changed = self.grown + [name for name, path in self.paths.items()
                                if not path.exists() or _look(path) != self.before[name]]
        if changed:
            raise ConvertError(f"{self.paths[changed[0]]}: source file changed while it was being converted "
                               f"({len(changed)} file(s)); nothing was finished: rerun once the source is stable")
