"""The journal: one line per file a run finished, so a rerun redoes only what is missing.

A line ``{path, size, checksum}`` is appended after the file is renamed into place (and fsynced
unless ``--no-fsync``). Every line is checked before it is trusted: a damaged one (a crash mid-line,
an edit, a flipped byte, a path outside the naming scheme) is skipped, so its file is redone,
never trusted; and a journaled file counts as done only while its size and checksum still match.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

from megamoe_convert import faults, jsonio
from megamoe_convert.errors import ConvertError, JsonError
from megamoe_convert.output.naming import STATE_DIR, is_own_path, owned_path
from megamoe_convert.output.writer import FileRecord, file_checksum

#: A run's journal, in ``OUT/.megamoe/`` (or in a part's folder there).
JOURNAL_NAME = "journal.jsonl"
#: The journal of a whole conversion that ``--shard --overwrite`` parts are replacing (``OUT/.megamoe/``).
REPLACED_JOURNAL = "replaced-journal.jsonl"
_CHECKSUM = re.compile(r"[0-9a-f]{32}")


def _journal_line(line: bytes) -> FileRecord | None:
    """One journal line as a record, or ``None`` where it is damaged (the file is then redone)."""
    try:
        data = jsonio.parse(line, "journal", JsonError)
        f = jsonio.Fields("journal", JsonError)
        record = FileRecord(f.str(data, "path"), f.int(data, "size"), f.str(data, "checksum"))
    except JsonError:
        return None
    return record if is_own_path(record.path) and _CHECKSUM.fullmatch(record.checksum) else None


def read_journal(path: Path) -> dict[str, FileRecord]:
    """The records of a journal file; damaged lines (a crash, an edit, a flipped byte) are skipped.
    A journal that cannot be read at all (unreadable, not a regular file, a link, larger than a
    journal can be) is a :class:`ConvertError`: callers read it before they change anything."""
    if not os.path.lexists(path):
        return {}
    if path.is_symlink():
        raise ConvertError(f"{path}: the journal is a symbolic link; remove it (the files it listed are then redone)")
    raw = jsonio.read_regular(path, ConvertError, "journal", jsonio.MAX_JOURNAL_BYTES,
                              "; nothing was changed: fix or remove it (the files it listed are then redone)")
    records = (_journal_line(line) for line in raw.splitlines() if line.strip())
    return {r.path: r for r in records if r is not None}


def read_journals(out: Path, *names: str) -> dict[str, FileRecord]:
    """The records of several journals in ``OUT/.megamoe/``, later ones winning."""
    records: dict[str, FileRecord] = {}
    for name in names:
        records.update(read_journal(out / STATE_DIR / name))
    return records


def is_done(out: Path, record: FileRecord | None) -> bool:
    """A journaled file counts as done only if its size and checksum still match."""
    if record is None or (path := owned_path(out, record.path)) is None:
        return False
    try:
        if path.stat().st_size != record.size:
            return False
    except FileNotFoundError:
        return False
    return file_checksum(path) == record.checksum


class JournalWriter:
    """Appends records to one journal file; safe to call from the writer threads of one run."""

    def __init__(self, path: Path, fsync: bool = True) -> None:
        self.path = path
        self.fsync = fsync  # --no-fsync: files are not durable, so neither need their journal lines be
        self._lock = threading.Lock()

    def append(self, record: FileRecord) -> None:
        try:
            with self._lock:
                faults.before_append(self.path)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                try:
                    os.write(fd, (json.dumps(record.to_json()) + "\n").encode())
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:  # name the journal in the one-line error (a full disk, say)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
