"""What long jobs report progress to: ``start`` per phase, then ``advance`` (``ui.ByteProgress`` on a
terminal, :class:`NoProgress` in library calls). At the bottom, so every stage can take it."""

from __future__ import annotations

from typing import Protocol


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
