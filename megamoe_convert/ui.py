"""Terminal output shared by the commands: progress bars on a TTY, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

#: Status and progress go to stderr so that ``--json`` output on stdout stays clean.
err_console = Console(stderr=True)
out_console = Console()


def is_interactive() -> bool:
    return err_console.is_terminal


class ByteProgress:
    """Bytes + files progress: rich bars on a terminal, a line every few seconds otherwise.

    Implements the ``start``/``advance`` protocol the long-running jobs report to: one bar in bytes
    (speed and ETA come from bytes, the honest measure when files differ in size) with a
    ``done/total files`` column beside it.
    """

    def __init__(self, description: str, quiet: bool = False, plain_interval_s: float = 5.0) -> None:
        self.description = description
        self.quiet = quiet
        self.plain_interval_s = plain_interval_s
        self._rich: Progress | None = None
        self._task: Any = None
        self.total_bytes = self.total_files = self.done_bytes = self.done_files = self.skipped = 0
        self.unit = "files"
        self._last_line = 0.0

    def __enter__(self) -> "ByteProgress":
        if not self.quiet and is_interactive():
            self._rich = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                  DownloadColumn(), TransferSpeedColumn(), TextColumn("{task.fields[files]}"),
                                  TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, transient=False)
            self._rich.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)

    def start(self, total_bytes: int, total_files: int, description: str | None = None, unit: str = "files") -> None:
        """Begin a phase (a job with several phases calls this again, with a new ``description``
        and ``unit``: a new bar on a terminal, a new start line otherwise)."""
        self.description = description or self.description
        self.unit = unit
        self.total_bytes, self.total_files = total_bytes, total_files
        self.done_bytes = self.done_files = self.skipped = 0
        self._last_line = 0.0
        if self._rich is not None:
            self._task = self._rich.add_task(self.description, total=total_bytes, files=self._files_text())
        elif not self.quiet:
            print(f"{self.description}: {total_files} {unit}, {total_bytes / 1e9:.3f} GB", file=sys.stderr, flush=True)

    def advance(self, nbytes: int, path: str, skipped: bool, files: int = 1) -> None:
        """``nbytes`` more done; ``files`` (default one) more finished. Writers that report
        inside a file pass ``files=0`` for the chunks and ``advance(0, path, False)`` at its end."""
        self.done_bytes += nbytes
        self.done_files += files
        self.skipped += int(skipped)
        if self._rich is not None:
            self._rich.update(self._task, advance=nbytes, files=self._files_text(),
                              description=f"{self.description} [dim]{path}[/dim]")
        elif not self.quiet:
            now = time.monotonic()
            finished = files and self.done_files == self.total_files
            if now - self._last_line >= self.plain_interval_s or finished:
                self._last_line = now
                pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
                resumed = f" ({self.skipped} already done)" if self.skipped else ""
                print(f"{self.description}: {self._files_text()}, {pct:5.1f}%{resumed}", file=sys.stderr, flush=True)

    def _files_text(self) -> str:
        return f"{self.done_files}/{self.total_files} {self.unit}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"
