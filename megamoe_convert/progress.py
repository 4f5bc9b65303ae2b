"""What long jobs report progress to: ``start`` per phase, then ``advance`` (``ui.ByteProgress`` on a
terminal, :class:`NoProgress` in library calls). At the bottom, so every stage can take it."""

from __future__ import annotations

import time
from typing import Any, Protocol


class Progress(Protocol):
    """What long jobs report to (``ui.ByteProgress``): ``start`` per phase, then ``advance``."""

    def start(self, total_bytes: int, total_files: int, description: str | None = None,
              unit: str = "files", in_bytes: bool = True) -> None: ...
    def advance(self, nbytes: int, path: str, skipped: bool, files: int = 1) -> None: ...


class NoProgress:
    def start(self, total_bytes: int, total_files: int, description: str | None = None, unit: str = "files",
              in_bytes: bool = True) -> None:
        pass

    def advance(self, nbytes: int, path: str, skipped: bool, files: int = 1) -> None:
        pass


class Phases:
    """A :class:`Progress` that passes everything on and records each phase's unit, count, bytes and
    seconds in ``timings`` (``verify``'s report: hashing, the comparison with the source, numerics)."""

    def __init__(self, progress: Progress, timings: dict[str, dict[str, Any]]) -> None:
        self.progress, self.timings = progress, timings
        self.name: str | None = None
        self.started = 0.0

    def start(self, total_bytes: int, total_files: int, description: str | None = None, unit: str = "files",
              in_bytes: bool = True) -> None:
        self.end()
        description = description or "verify"
        self.name, self.started = description.removeprefix("verify: ").replace(" ", "_"), time.perf_counter()
        self.progress.start(total_bytes, total_files, description=description, unit=unit, in_bytes=in_bytes)
        self.timings[self.name] = {"unit": unit, "count": total_files,
                                         "bytes": total_bytes if in_bytes else None, "seconds": 0.0}

    def advance(self, nbytes: int, path: str, skipped: bool, files: int = 1) -> None:
        self.progress.advance(nbytes, path, skipped, files)

    def end(self) -> None:
        if self.name is not None:
            self.timings[self.name]["seconds"] = round(time.perf_counter() - self.started, 3)
            self.name = None
