"""Terminal output shared by the commands: progress bars on a TTY, plain lines otherwise."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from rich.console import Console, ConsoleDimensions
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

#: Width of a console that is not a terminal (a pipe, a CI log) when neither ``COLUMNS`` nor a terminal
#: on stderr or stdin says one: wide enough that rich never breaks a line; the reader's own viewer wraps.
PIPE_WIDTH = 1 << 14
#: Below this terminal width a progress bar drops the file being worked on, the elapsed time and
#: the speed, so that its line never wraps (an 80-column terminal's line garbles once it does).
WIDE_PROGRESS = 120
#: How far a command's continuation lines (after a trailing backslash) are indented past its first.
CONTINUATION_INDENT = "    "


def pipe_width() -> int:
    """The width of output that goes to no terminal: ``COLUMNS`` where it is set (a shell rarely
    exports it), else the width of the terminal the user reads stderr or types into
    (``megamoe inspect OUT | less``), else :data:`PIPE_WIDTH`."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    for stream in (sys.stderr, sys.stdin):
        try:
            if stream is not None and stream.isatty():
                return os.get_terminal_size(stream.fileno()).columns or PIPE_WIDTH
        except (AttributeError, OSError, ValueError):  # a replaced stream, or one closed already
            continue
    return PIPE_WIDTH


class StreamConsole(Console):
    """A console whose width and wrapping follow where its stream goes at each print: on a terminal,
    rich's own; to a pipe or a file, lines never soft-wrapped (a command stays whole) and tables as
    wide as :func:`pipe_width`. Read at each print, not once at import, so that a command run inside
    another program (a test, a notebook) honours the stream and ``COLUMNS`` it is given."""

    def __init__(self, stderr: bool) -> None:
        super().__init__(stderr=stderr)
        self._width = self._height = None  # rich reads COLUMNS once here: :attr:`size` reads it at each print

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        return dims if self.is_terminal else ConsoleDimensions(pipe_width(), dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size

    @property
    def soft_wrap(self) -> bool:
        return not self.is_terminal

    @soft_wrap.setter
    def soft_wrap(self, value: bool) -> None:
        """Ignored (rich's ``__init__`` sets it): whether lines wrap follows the stream."""


def make_console(stderr: bool) -> Console:
    """stderr's or stdout's console (:class:`StreamConsole`)."""
    return StreamConsole(stderr=stderr)


#: Status and progress go to stderr so that ``--json`` output on stdout stays clean.
err_console = make_console(stderr=True)
out_console = make_console(stderr=False)

_quiet = {"on": False}


def set_quiet(on: bool) -> None:
    """``-q/--quiet``: no progress and no status lines (errors and ``--json`` output still appear)."""
    _quiet["on"] = on


def is_quiet() -> bool:
    return _quiet["on"]


def status(text: str) -> None:
    """A status line on stderr (``done: ...``), unless ``--quiet``: never broken by rich, since it may
    end with a command to paste (the terminal wraps it, and a copy of it stays one line)."""
    if not is_quiet():
        err_console.print(text, soft_wrap=True)


def line(text: str) -> None:
    """A plain line on stdout that rich never breaks (it holds a command or a path to paste)."""
    out_console.print(text, markup=False, highlight=False, soft_wrap=True)


def say(text: str) -> None:
    """A plain line of prose on stdout: on a terminal, rich wraps it between words."""
    out_console.print(text, markup=False, highlight=False)


def command(text: str, indent: str = "  ", stderr: bool = False) -> None:
    """A shell command meant to be pasted, on a line of its own: whole on one line, or, on a terminal
    narrower than it, split between its arguments with a backslash ending each line but the last
    (rich's wrapping would break it with bare newlines, and the paste would run it cut short). On
    stderr it is a status line (``--quiet`` drops it)."""
    if stderr and is_quiet():
        return
    console = err_console if stderr else out_console
    lines = command_lines(text, console.width, indent) if console.is_terminal else [indent + text]
    for text_line in lines:
        console.print(text_line, markup=False, highlight=False, soft_wrap=True)


def command_lines(text: str, width: int, indent: str = "  ") -> list[str]:
    """``text`` indented, in lines of at most ``width`` with `` \\`` continuations, broken only
    between arguments (an option stays with its value); an argument longer than a line gets one
    of its own."""
    if len(indent) + len(text) <= width:
        return [indent + text]
    lines, current = [], indent
    for piece in (" ".join(group) for group in _option_groups(shell_words(text))):
        if current.strip() and len(current) + 1 + len(piece) + 2 > width:
            lines.append(current + " \\")
            current = indent + CONTINUATION_INDENT
        current += (" " if current.strip() else "") + piece
    return [*lines, current]


def shell_words(text: str) -> list[str]:
    """The words of a shell command as written (quotes and backslashes kept): split only at blanks
    outside quotes, so that re-joining them with blanks gives the same command."""
    words: list[str] = []
    word, quote, escaped = "", "", False
    for char in text:
        if escaped:
            word, escaped = word + char, False
        elif char == "\\" and quote != "'":  # escapes the next character, outside quotes or in double ones
            word, escaped = word + char, True
        elif quote and char != quote or not quote and char not in " \t'\"":
            word += char
        elif char in "'\"":  # opens a quote, or closes the one open
            word, quote = word + char, "" if quote else char
        elif word:  # a blank outside quotes ends a word
            words.append(word)
            word = ""
    return [*words, word] if word else words


def _option_groups(words: list[str]) -> list[list[str]]:
    """Each option with the value after it (``--ep-size 8``); every other word alone."""
    groups: list[list[str]] = []
    for word in words:
        last = groups[-1] if groups else []
        if len(last) == 1 and last[0].startswith("-") and "=" not in last[0] and not word.startswith("-"):
            last.append(word)
        else:
            groups.append([word])
    return groups


def is_interactive() -> bool:
    return err_console.is_terminal


class ByteProgress:
    """Per-phase progress: rich bars on a terminal, a line every few seconds otherwise.

    Implements the ``start``/``advance`` protocol the long-running jobs report to. Each phase
    (``start``) has its own unit: a phase that moves bytes (``in_bytes=True``: copying, hashing)
    gets one bar in bytes (speed and ETA come from bytes, the honest measure when files differ
    in size) with a ``done/total files`` column beside it; a compute-bound phase (``in_bytes=False``:
    numerics) counts its own steps, with its own speed and ETA. Files found already done
    (``skipped``) leave the phase's totals, so speed and ETA count only the work done now. A
    phase's end prints one line with its count, bytes and time, kept in :attr:`phases`.
    """

    def __init__(self, description: str, quiet: bool = False, plain_interval_s: float = 5.0) -> None:
        self.description = self.name = description
        self.quiet = quiet or is_quiet()
        self.plain_interval_s = plain_interval_s
        self._rich: Progress | None = None
        self._task: Any = None
        self.total_bytes = self.total_files = self.done_bytes = self.done_files = self.skipped = 0
        self.unit, self.in_bytes = "files", True
        self._last_line = self._started = 0.0
        self._open = False
        self._wide = True
        #: Every finished phase: description, unit, count, bytes and seconds.
        self.phases: list[dict[str, Any]] = []

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.finish()
        self._stop_bar()

    def _stop_bar(self) -> None:
        if self._rich is not None:
            self._rich.__exit__(None, None, None)
            self._rich = None

    def start(self, total_bytes: int, total_files: int, description: str | None = None, unit: str = "files",
              in_bytes: bool = True) -> None:
        """Begin a phase (a job with several phases calls this again, with a new ``description``
        and ``unit``: a new bar on a terminal, a new start line otherwise)."""
        self.finish()
        self.description = self.name = description or self.name
        self.unit, self.in_bytes = unit, in_bytes
        self.total_bytes, self.total_files = total_bytes, total_files
        self.done_bytes = self.done_files = self.skipped = 0
        self._last_line, self._started, self._open = 0.0, time.perf_counter(), True
        if self.quiet:
            return
        if is_interactive():
            self._wide = err_console.width >= WIDE_PROGRESS
            speed = (TransferSpeedColumn(),) if self._wide else ()
            amount = ((DownloadColumn(), *speed, TextColumn("{task.fields[files]}")) if in_bytes else
                      (MofNCompleteColumn(), TextColumn(unit)))
            elapsed = (TimeElapsedColumn(),) if self._wide else ()
            self._rich = Progress(TextColumn("{task.description}"), BarColumn(bar_width=None if self._wide else 16),
                                  TaskProgressColumn(), *amount, *elapsed, TimeRemainingColumn(), console=err_console,
                                  transient=False)
            self._rich.__enter__()
            self._task = self._rich.add_task(self.name, total=total_bytes if in_bytes else total_files,
                                             files=self._files_text())
        else:
            size = f", {total_bytes / 1e9:.3f} GB" if in_bytes else ""
            print(f"{self.name}: {total_files} {unit}{size}", file=sys.stderr, flush=True)

    def advance(self, nbytes: int, path: str, skipped: bool, files: int = 1) -> None:
        """``nbytes`` more done; ``files`` (default one) more finished. Writers that report
        inside a file pass ``files=0`` for the chunks and ``advance(0, path, False)`` at its end.
        A ``skipped`` file (already done) leaves the totals instead."""
        if skipped:
            self.skipped += files
            self.total_bytes -= nbytes
            self.total_files -= files
            if self._rich is not None:
                self._rich.update(self._task, total=self.total_bytes if self.in_bytes else self.total_files,
                                  files=self._files_text())
            return
        self.done_bytes += nbytes
        self.done_files += files
        if self._rich is not None:
            self._rich.update(self._task, advance=nbytes if self.in_bytes else files, files=self._files_text(),
                              description=f"{self.name} [dim]{path}[/dim]" if self._wide else self.name)
        elif not self.quiet:
            now = time.monotonic()
            finished = files and self.done_files == self.total_files
            if now - self._last_line >= self.plain_interval_s or finished:
                self._last_line = now
                print(f"{self.name}: {self._plain_amount()}{self._eta()}"
                      f"{f' ({self.skipped} already done)' if self.skipped else ''}", file=sys.stderr, flush=True)

    def finish(self) -> None:
        """End the current phase (``start`` and leaving the ``with`` block call it): one line with
        its count, bytes, time and rate."""
        if not self._open:
            return
        self._open = False
        seconds = time.perf_counter() - self._started
        phase = {"phase": self.name, "unit": self.unit, "count": self.done_files, "skipped": self.skipped,
                 "bytes": self.done_bytes if self.in_bytes else None, "seconds": round(seconds, 3)}
        self.phases.append(phase)
        self._stop_bar()
        if self.quiet:
            return
        if self.in_bytes:
            rate = f", {human_bytes(self.done_bytes / seconds)}/s" if seconds > 0 and self.done_bytes else ""
            amount = f"{self.done_files} {self.unit}, {human_bytes(self.done_bytes)}"
        else:
            rate = f", {self.done_files / seconds:.1f} {self.unit}/s" if seconds > 0 and self.done_files else ""
            amount = f"{self.done_files} {self.unit}"
        resumed = f" ({self.skipped} already done)" if self.skipped else ""
        print(f"{self.name}: finished {amount}{resumed} in {seconds:.1f} s{rate}", file=sys.stderr, flush=True)

    def _files_text(self) -> str:
        return f"{self.done_files}/{self.total_files} {self.unit}"

    def _plain_amount(self) -> str:
        """Files finished and, where the phase moves bytes, the bytes done: the percentage says
        whose it is (bytes move inside files long before the first file is finished)."""
        if not self.in_bytes:
            pct = 100.0 * self.done_files / self.total_files if self.total_files else 100.0
            return f"{self._files_text()} ({pct:.1f}%)"
        pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        return (f"{self._files_text()} finished, {human_bytes(self.done_bytes)} of "
                f"{human_bytes(self.total_bytes)} ({pct:.1f}% of the bytes)")

    def _eta(self) -> str:
        """``, about 3 min left``, from the pace so far (nothing before there is a pace)."""
        done, total = ((self.done_bytes, self.total_bytes) if self.in_bytes else (self.done_files, self.total_files))
        seconds = time.perf_counter() - self._started
        if not done or done >= total or seconds < 2:  # the first moments give no pace worth telling
            return ""
        left = seconds * (total - done) / done
        return f", about {max(left, 1):.0f} s left" if left < 120 else f", about {left / 60:.0f} min left"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"
