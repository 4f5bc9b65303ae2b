"""Fault injection for the reliability tests, driven by one environment variable.

``MEGAMOE_FAULT`` holds one fault; unset (always, in production) every hook is a single
``None`` check. The faults are the ones a conversion must survive:

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
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path

ENV = "MEGAMOE_FAULT"


class _Fault:
    def __init__(self, spec: str) -> None:
        kind, _, arg = spec.partition("=")
        self.kind, self.arg = kind.strip(), arg.strip()
        self.files = 0
        self.bytes = 0
        self.lock = threading.Lock()
        known = ("kill-after-files", "kill-after-bytes", "kill-before-rename", "kill-before-append",
                 "enospc-after-bytes", "wait-after-files", "free-bytes")
        if self.kind not in known:
            raise ValueError(f"{ENV}={spec!r}: unknown fault (known: {', '.join(known)})")


def _load() -> _Fault | None:
    spec = os.environ.get(ENV)
    return _Fault(spec) if spec else None


_fault = _load()


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def wrote(nbytes: int) -> None:
    """Called by the writer before it writes ``nbytes`` more bytes."""
    if _fault is None or not _fault.kind.endswith("after-bytes"):
        return
    with _fault.lock:
        _fault.bytes += nbytes
        tripped = _fault.bytes > int(_fault.arg)
    if tripped and _fault.kind == "kill-after-bytes":
        _kill()
    if tripped:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def committed_file() -> None:
    """Called after an output file is renamed into place and journaled."""
    if _fault is None or not _fault.kind.endswith("after-files"):
        return
    with _fault.lock:
        _fault.files += 1
        count = _fault.files
    if _fault.kind == "kill-after-files" and count >= int(_fault.arg):
        _kill()
    if _fault.kind == "wait-after-files":
        threshold, _, release = _fault.arg.partition(":")
        if count == int(threshold):
            Path(release + ".waiting").touch()  # tells the test this run now holds its locks
            while not Path(release).exists():
                time.sleep(0.05)


def before_rename(final: Path) -> None:
    """Called with a complete temporary file, just before its rename into place."""
    if _fault is not None and _fault.kind == "kill-before-rename" and final.name == _fault.arg:
        _kill()


def before_append(journal: Path) -> None:
    """Called with a journal just before a line is appended to it (a write that renames nothing)."""
    if _fault is not None and _fault.kind == "kill-before-append" and journal.name == _fault.arg:
        _kill()


def free_bytes(actual: int) -> int:
    """The free space the pre-flight check sees: ``actual``, or the ``free-bytes`` fault's."""
    return int(_fault.arg) if _fault is not None and _fault.kind == "free-bytes" else actual
