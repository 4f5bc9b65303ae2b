"""Fault injection for the reliability tests, driven by one environment variable.

``MEGAMOE_TEST_FAULTS`` holds one fault, read when a hook runs (:func:`megamoe_convert.settings.injected_fault`):
unset (always, in use) every hook is one look-up that finds nothing. The faults are the ones a
conversion must survive:

- ``kill-after-files=N``: SIGKILL the process once N output files are committed;
- ``kill-after-bytes=N``: SIGKILL once N bytes were written (in the middle of a file);
- ``kill-before-rename=NAME``: SIGKILL when a complete temp file named NAME (e.g.
  ``manifest.json``) is about to be renamed into place;
- ``kill-before-append=NAME``: SIGKILL when a line is about to be appended to the journal named
  NAME (``journal.jsonl``: its file is in place, not yet journaled);
- ``enospc-after-bytes=N``: fail writes with ENOSPC ("No space left on device") after N bytes;
- ``wait-after-files=N:PATH``: after N committed files, create ``PATH.waiting`` and wait until
  PATH exists (to hold a conversion in flight while a test starts a second one);
- ``free-bytes=N``: the pre-flight space check sees N free bytes (a nearly full disk).

The files and bytes counted so far belong to the fault read: another fault starts from zero, and
so does a new command (:func:`reset`).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path

from megamoe_convert import settings
from megamoe_convert.settings import Fault


class _Counts:
    """The files committed and bytes written so far under one fault."""

    def __init__(self, fault: Fault | None = None) -> None:
        self.fault, self.files, self.bytes = fault, 0, 0


_lock = threading.Lock()
_counts = _Counts()


def reset() -> None:
    """Count from zero again (a new command starts)."""
    global _counts
    with _lock:
        _counts = _Counts()


def _add(fault: Fault, files: int = 0, nbytes: int = 0) -> tuple[int, int]:
    """Count ``files`` and ``nbytes`` more under ``fault`` (from zero where another fault counted
    before); the files and bytes counted so far."""
    global _counts
    with _lock:
        if _counts.fault != fault:
            _counts = _Counts(fault)
        _counts.files += files
        _counts.bytes += nbytes
        return _counts.files, _counts.bytes


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def wrote(nbytes: int) -> None:
    """Called by the writer before it writes ``nbytes`` more bytes."""
    fault = settings.injected_fault()
    if fault is None or not fault.kind.endswith("after-bytes"):
        return
    if _add(fault, nbytes=nbytes)[1] <= fault.count:
        return
    if fault.kind == "kill-after-bytes":
        _kill()
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def committed_file() -> None:
    """Called after an output file is renamed into place and journaled."""
    fault = settings.injected_fault()
    if fault is None or not fault.kind.endswith("after-files"):
        return
    count = _add(fault, files=1)[0]
    if fault.kind == "kill-after-files" and count >= fault.count:
        _kill()
    if fault.kind == "wait-after-files" and count == fault.count:
        Path(fault.name + ".waiting").touch()  # tells the test this run now holds its locks
        while not Path(fault.name).exists():
            time.sleep(0.05)


def before_rename(final: Path) -> None:
    """Called with a complete temporary file, just before its rename into place."""
    fault = settings.injected_fault()
    if fault is not None and fault.kind == "kill-before-rename" and final.name == fault.name:
        _kill()


def before_append(journal: Path) -> None:
    """Called with a journal just before a line is appended to it (a write that renames nothing)."""
    fault = settings.injected_fault()
    if fault is not None and fault.kind == "kill-before-append" and journal.name == fault.name:
        _kill()


def free_bytes(actual: int) -> int:
    """The free space the pre-flight check sees: ``actual``, or the ``free-bytes`` fault's."""
    fault = settings.injected_fault()
    return fault.count if fault is not None and fault.kind == "free-bytes" else actual
