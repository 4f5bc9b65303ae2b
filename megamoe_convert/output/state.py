"""What a writer of OUT keeps in ``OUT/.megamoe/``: locks, the plan, the source stamp, the journal;
and the only code that deletes anything in OUT.

``convert``, ``merge`` and ``pull --local-dir`` use this one interface:

* :func:`hold_whole_output` / :meth:`OutputState.locked`: who may write OUT at once;
* :meth:`OutputState.prepare`: refuse a differently-planned or stale OUT before touching it;
* :meth:`OutputState.record` / :meth:`OutputState.journal` / :meth:`OutputState.is_done`: what
  was written, and whether it is still there as written;
* :meth:`OutputState.clear` / :func:`remove_owned`: delete what this tool wrote, nothing else.

A deletion happens only for a path that the journal (or a manifest) records, that fits the
tool's naming scheme (:func:`manifest.is_own_path`), and that resolves inside OUT without
passing a symbolic link; a small copied file must also still have its recorded size and
checksum. Journal lines that are damaged are skipped: their files are redone, never trusted.
"""

from __future__ import annotations

import json
import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator
from megamoe_convert.errors import ConvertError, OutputBusy  # noqa: F401

import xxhash
from filelock import FileLock, Timeout

from megamoe_convert import jsonio
from megamoe_convert.output.manifest import MANIFEST_NAME, RANK_DIR, STATE_DIR, is_own_path, is_shard_path
from megamoe_convert.output.writer import (
    PARTIAL_SUFFIX,
    FileRecord,
    file_checksum,
    make_dirs_inside,
    partial_path,
    write_json_atomic,
)
from megamoe_convert.source.checkpoint import INDEX_NAME


#: The journal of a whole conversion that ``--shard --overwrite`` parts are replacing (``OUT/.megamoe/``).
REPLACED_JOURNAL = "replaced-journal.jsonl"
#: Where ``merge`` keeps the part manifests it consumed (relative to OUT), so merging is repeatable.
MERGED_PARTS_DIR = f"{STATE_DIR}/parts"
PART_GLOB = "manifest.part-*-of-*.json"
_PART_MANIFEST = re.compile(r"manifest\.part-[0-9]{5,}-of-[0-9]{5,}\.json")


def part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def part_manifest_name(index: int, count: int) -> str:
    """What a part writes instead of ``manifest.json`` (which only ``merge`` writes)."""
    return f"manifest.{part_name(index, count)}.json"


# --------------------------------------------------------------------------------------
# Paths: the only way anything in OUT is deleted
# --------------------------------------------------------------------------------------

def owned_path(out: Path, rel: str) -> Path | None:
    """``OUT/rel`` if ``rel`` fits the naming scheme and resolves inside OUT (no symlinked
    folder on the way); else ``None``."""
    if not is_own_path(rel):
        return None
    path = out / rel
    if path.parent.resolve() != out.resolve() / Path(rel).parent:
        return None
    return path


def remove_owned(out: Path, records: Iterable[FileRecord]) -> None:
    """Delete the files of ``records`` that are still what the tool wrote (see module doc),
    then the rank folders left empty."""
    dirs = set()
    for record in records:
        path = owned_path(out, record.path)
        if path is None or not path.is_file() or path.is_symlink():
            continue
        if path.stat().st_size != record.size or (not is_shard_path(record.path)
                                                  and file_checksum(path) != record.checksum):
            continue  # not the bytes the tool wrote there: someone else's now
        path.unlink()
        dirs.add(path.parent)
    for folder in dirs:
        if RANK_DIR.fullmatch(folder.name) and folder.parent == out and not any(folder.iterdir()):
            folder.rmdir()


def remove_named(out: Path, names: Iterable[str]) -> None:
    """Delete the tool's own top-level result files (manifest, index, part manifests) by name."""
    for name in names:
        if name in (MANIFEST_NAME, INDEX_NAME) or _PART_MANIFEST.fullmatch(name):
            (out / name).unlink(missing_ok=True)


def check_output_dir(out: Path) -> None:
    """OUT must be new, empty, or a previous megamoe output: never someone else's files."""
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory")
    if (out / STATE_DIR).is_symlink() or (out / STATE_DIR).exists() and not (out / STATE_DIR).is_dir():
        raise ConvertError(f"{out / STATE_DIR}: not a directory of its own (a link or a file); remove it by hand")
    if out.is_dir() and not (out / STATE_DIR).is_dir() and any(out.iterdir()):
        raise ConvertError(f"{out}: directory is not empty and is not a megamoe output; choose an empty directory")


# --------------------------------------------------------------------------------------
# The journal and state files: checked before they are trusted
# --------------------------------------------------------------------------------------

_CHECKSUM = re.compile(r"[0-9a-f]{32}")


def _journal_line(line: bytes) -> FileRecord | None:
    """One journal line as a record, or ``None`` where it is damaged (the file is then redone)."""
    try:
        data = jsonio.parse(line, "journal", jsonio.JsonError)
        f = jsonio.Fields("journal", jsonio.JsonError)
        record = FileRecord(f.str(data, "path"), f.int(data, "size"), f.str(data, "checksum"))
    except jsonio.JsonError:
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
    try:
        raw = jsonio.read_regular(path, ConvertError, "journal", jsonio.MAX_JOURNAL_BYTES)
    except ConvertError as e:
        raise ConvertError(f"{e}; nothing was changed: fix or remove it (the files it listed are then redone)") from None
    records = (_journal_line(line) for line in raw.splitlines() if line.strip())
    return {r.path: r for r in records if r is not None}


def read_state_json(path: Path) -> dict[str, Any] | None:
    """A state file's JSON object, or ``None`` where it is not one (cut short, edited, binary)."""
    try:
        data = jsonio.read(path, jsonio.JsonError, "state file", jsonio.MAX_STATE_BYTES)
    except jsonio.JsonError:
        return None
    return data if isinstance(data, dict) else None


def differing_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys where two plan fingerprints disagree (for errors that say what differs)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


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


# --------------------------------------------------------------------------------------
# Source stamps
# --------------------------------------------------------------------------------------

def stamp_files(paths: dict[str, Path]) -> dict[str, list[int]]:
    """``{name: [st_mtime_ns, st_ino, st_size]}``: changes when a file is rewritten, even in place.
    Compared between runs (a resume must not mix bytes of two sources)."""
    return {name: [(st := path.stat()).st_mtime_ns, st.st_ino, st.st_size] for name, path in sorted(paths.items())}


#: Blocks of each source file hashed before and after a run (:class:`SourceWatch`).
WATCH_BLOCKS, WATCH_BLOCK_BYTES = 8, 64 << 10


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


# --------------------------------------------------------------------------------------
# OUT/.megamoe/
# --------------------------------------------------------------------------------------

class OutputState:
    """The hidden ``OUT/.megamoe/`` folder: a lock, the plan fingerprint, the source stamp, the journal."""

    def __init__(self, out: Path, fsync: bool = True) -> None:
        self.out = out
        self.dir = out / STATE_DIR
        self.plan_path = self.dir / "plan.json"
        self.source_path = self.dir / "source.json"
        self.journal_path = self.dir / "journal.jsonl"
        self._journal_lock = threading.Lock()
        self.fsync = fsync  # --no-fsync: files are not durable, so neither need their journal lines be

    def locked(self) -> Any:
        """Hold OUT for a whole-directory writer (a conversion, or a merge): no other one, and
        no part of a split conversion, may write it meanwhile."""
        return hold_whole_output(self.out, timeout=0, who="`megamoe convert`")

    def prepare(self, fingerprint: dict[str, Any], overwrite: bool, source: dict[str, Any]) -> None:
        """Refuse foreign, differently-planned or stale output (source files changed since, or no
        record of the source at all), or state a crash or a person damaged; clear it when
        ``overwrite``. ``source``: :func:`stamp_files` of the source, plus its ``"path"``."""
        if self.plan_path.exists():
            problem = self._plan_problem(fingerprint) or self._source_problem(source)
            if problem:
                if not overwrite:
                    raise ConvertError(f"{self.out} {problem}; pass --overwrite to convert again")
                self.clear()
        elif overwrite:
            self.clear()
        self.write_state(fingerprint, source)

    def write_state(self, fingerprint: dict[str, Any], source: dict[str, Any] | None) -> None:
        write_json_atomic(self.plan_path, json.dumps(fingerprint, indent=1, sort_keys=True), fsync=self.fsync,
                          root=self.out)
        if source is not None:
            write_json_atomic(self.source_path, json.dumps(source, indent=1, sort_keys=True), fsync=self.fsync,
                              root=self.out)

    def _plan_problem(self, fingerprint: dict[str, Any]) -> str | None:
        previous = read_state_json(self.plan_path)
        if previous is None:
            return f"has an unreadable {self.plan_path.relative_to(self.out)} (not a JSON object)"
        changed = differing_keys(previous, fingerprint)
        return f"holds a conversion made with different options ({', '.join(changed)} differ)" if changed else None

    def _source_problem(self, source: dict[str, Any]) -> str | None:
        if not self.source_path.exists():
            return ("has no record of the source files it was converted from (made by `megamoe merge` or an older "
                    "version), so its files cannot be reused for this source")
        changed = self.changed_sources(source)
        if not changed:
            return None
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return f"was converted before these source files changed (or from others): {', '.join(changed[:3])}{more}"

    def changed_sources(self, source: dict[str, Any]) -> list[str]:
        """Source entries whose stamp differs from the previous run's (all of them where the record
        is unreadable, since nothing then says they are unchanged)."""
        previous = read_state_json(self.source_path)
        if previous is None:
            return sorted(source)
        return [name for name, stamp in source.items() if previous.get(name) != stamp]

    def clear(self) -> None:
        """Remove what a previous conversion (or merge) wrote, and nothing else: manifest, index,
        part manifests, the journaled files (see :func:`remove_owned`), merged parts, this state."""
        journal = self.journal()  # read first: an unreadable journal fails the run before anything goes
        remove_named(self.out, [MANIFEST_NAME, INDEX_NAME, *(p.name for p in self.out.glob(PART_GLOB))])
        remove_owned(self.out, journal.values())
        merged = self.out / MERGED_PARTS_DIR
        if merged.is_dir() and not merged.is_symlink():
            remove_named(merged, [p.name for p in merged.glob(PART_GLOB)])
            if not any(merged.iterdir()):
                merged.rmdir()
        self.journal_path.unlink(missing_ok=True)
        self.source_path.unlink(missing_ok=True)

    def journal(self, path: Path | None = None) -> dict[str, FileRecord]:
        """The committed files of the journal at ``path`` (default: this run's)."""
        return read_journal(path or self.journal_path)

    def record(self, rec: FileRecord) -> None:
        try:
            with self._journal_lock:
                fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o644)
                try:
                    os.write(fd, (json.dumps(rec.to_json()) + "\n").encode())
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:  # name the journal in the one-line error (a full disk, say)
            raise OSError(e.errno, e.strerror, str(self.journal_path)) from None

    def remove_partials(self) -> None:
        """The tool's own temporary files (``.NAME.partial``) at the top and in rank folders."""
        for folder in [self.out, *(d for d in self.out.iterdir() if RANK_DIR.fullmatch(d.name) and d.is_dir()
                                   and not d.is_symlink())]:
            for path in folder.glob(f".*{PARTIAL_SUFFIX}"):
                path.unlink(missing_ok=True)


class PartState(OutputState):
    """State of one part of a split conversion, in ``OUT/.megamoe/part-I-of-N/``.

    Parts may run at the same time into one shared OUT: each has its own lock, plan and
    journal, and touches only its own files (no directory-wide cleanup).
    """

    def __init__(self, out: Path, shard: dict[str, Any], paths: list[str], fsync: bool = True) -> None:
        super().__init__(out, fsync)
        index, count = shard["index"], shard["count"]
        self.root_plan_path, self.root_journal_path = self.plan_path, self.journal_path
        self.root_source_path = self.source_path
        self.shard = shard
        self.dir = out / STATE_DIR / part_name(index, count)
        self.plan_path = self.dir / "plan.json"
        self.source_path = self.dir / "source.json"
        self.journal_path = self.dir / "journal.jsonl"
        self.part_manifest = out / part_manifest_name(index, count)
        self.merged_part_manifest = out / MERGED_PARTS_DIR / part_manifest_name(index, count)
        self.paths = paths

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold this part's lock; refuse if another run holds it, or a whole-directory writer OUT."""
        name, lock = f"{self.shard['index']}/{self.shard['count']}", self.dir / "lock"
        make_dirs_inside(self.out, self.dir)
        with holding(lock, 0, f"{self.out}: part {name} is already being converted by another "
                              f"`megamoe convert` (lock {lock} is held)"):
            if held_elsewhere(self.out / STATE_DIR / WHOLE_LOCK, GLANCE_TIMEOUT_S):
                raise OutputBusy(f"{self.out}: a `megamoe convert` without --shard or a `megamoe merge` is writing "
                                 f"this directory; part {name} cannot run beside it")
            yield

    def prepare(self, fingerprint: dict[str, Any], overwrite: bool, source: dict[str, Any]) -> None:
        # A whole conversion already in OUT (single-machine or merged) must be of the same plan.
        if self.root_plan_path.exists() and read_state_json(self.root_plan_path) != fingerprint:
            if not overwrite:
                raise ConvertError(f"{self.out} holds a conversion made with different options; "
                                   "pass --overwrite (to every part) to replace it")
            self.root_plan_path.unlink(missing_ok=True)
            if self.root_journal_path.exists():  # kept for merge, to delete what the new plan does not write
                os.replace(self.root_journal_path, self.root_journal_path.with_name(REPLACED_JOURNAL))
            self.root_source_path.unlink(missing_ok=True)
        super().prepare(fingerprint | {"shard": self.shard}, overwrite, source)
        self.part_manifest.unlink(missing_ok=True)  # this part is not finished until it is rewritten
        self.merged_part_manifest.unlink(missing_ok=True)

    def clear(self) -> None:
        remove_owned(self.out, self.journal().values())
        self.journal_path.unlink(missing_ok=True)
        self.part_manifest.unlink(missing_ok=True)
        self.merged_part_manifest.unlink(missing_ok=True)

    def remove_partials(self) -> None:
        for rel in self.paths:  # only this part's: other parts may be writing theirs right now
            if (path := owned_path(self.out, rel)) is not None:
                partial_path(path).unlink(missing_ok=True)


def forget_replaced_conversion(out: Path, new_paths: set[str], has_index: bool) -> None:
    """Delete what the whole conversion in ``out`` before this merge wrote and this one does not
    (e.g. a full conversion replaced by ``--experts-only`` parts): the non-expert shards, the index.
    Only journaled files go (:func:`remove_owned`); anything else in ``out`` is left alone."""
    state = OutputState(out)
    previous = {**state.journal(state.dir / REPLACED_JOURNAL), **state.journal()}
    remove_owned(out, [record for path, record in previous.items() if path not in new_paths])
    if not has_index:
        remove_named(out, [INDEX_NAME])
    (state.dir / REPLACED_JOURNAL).unlink(missing_ok=True)


# --------------------------------------------------------------------------------------
# Locks
# --------------------------------------------------------------------------------------
# Who may write OUT at once: whole-directory writers (``convert`` without ``--shard``, ``merge``,
# ``pull --local-dir``) hold ``.megamoe/lock``; each part holds ``.megamoe/part-I-of-N/lock``. Parts
# run side by side, but never beside a whole-directory writer. The two sides check each other in
# opposite order (a writer takes its lock, then looks at the parts' locks; a part takes its own
# lock, then looks at the writers' lock), so two that start at the same moment cannot both go on.

WHOLE_LOCK = "lock"
PART_LOCK_GLOB = "part-*-of-*/lock"
#: How long a part waits on a whole-directory lock that may only be held for a glance by another part.
GLANCE_TIMEOUT_S = 2.0


@contextmanager
def holding(path: Path, timeout: float, refusal: str) -> Iterator[None]:
    """Hold the lock file ``path`` (``timeout``: 0 = fail at once, -1 = wait); raise
    :class:`OutputBusy` with ``refusal`` when someone else holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_lock_file(path)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=timeout)
    except Timeout:
        raise OutputBusy(refusal) from None
    try:  # only the acquisition is translated: the body's own errors pass through
        yield
    finally:
        lock.release()


def held_elsewhere(path: Path, timeout: float = 0) -> bool:
    """Whether someone holds the lock file ``path`` (a glance: taken and given back at once)."""
    _check_lock_file(path)
    try:
        with FileLock(path).acquire(timeout=timeout):
            return False
    except Timeout:
        return True


def _check_lock_file(path: Path) -> None:
    """A lock file is opened with O_TRUNC: one that is a link would truncate what it points at."""
    if path.is_symlink() or path.parent.is_symlink():
        raise ConvertError(f"{path if path.is_symlink() else path.parent}: is a symbolic link; megamoe never writes "
                           "through a link: remove it")


@contextmanager
def hold_whole_output(out: Path, *, timeout: float, who: str) -> Iterator[None]:
    """Hold ``OUT/.megamoe/lock``, then refuse if any part of a split conversion is being
    written into OUT."""
    lock = out / STATE_DIR / WHOLE_LOCK
    make_dirs_inside(out, lock.parent)
    with holding(lock, timeout, f"{out}: another `megamoe convert` or `megamoe merge` is writing this directory "
                                f"(lock {lock} is held); {who} cannot run beside it"):
        if busy := busy_parts(out):
            raise OutputBusy(f"{out}: part {busy[0]} of a split conversion is being written into this directory "
                             f"right now; {who} cannot run beside it")
        yield


def busy_parts(out: Path) -> list[str]:
    """Names (``I/N``) of the parts whose lock someone holds right now."""
    busy = []
    for path in sorted((out / STATE_DIR).glob(PART_LOCK_GLOB)):
        if held_elsewhere(path):
            index, count = path.parent.name.removeprefix("part-").split("-of-")
            busy.append(f"{int(index)}/{int(count)}")
    return busy
