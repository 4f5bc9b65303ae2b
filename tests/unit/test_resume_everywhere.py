"""A conversion (or a merge) stopped at any one of its writes resumes: the same command, rerun, finishes with the
bytes of a run that was never stopped.

The writes are found, not listed: a clean run records every point the fault hooks
(``megamoe_convert/faults.py``: each ``before_*`` hook, called with the file about to be written)
pass, and each point is then stopped at in turn, by a kill (nothing cleans up after it: the
complete temporary file stays) and by a full disk (the tool's own error path runs). A write point
added later is covered without touching this file.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import output_files

from megamoe_convert import faults
from megamoe_convert.convert.fleet import merge
from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.output.writer import partial_path


def converting(**options: Any) -> Callable[[Path, Path], None]:
    """``megamoe convert SRC ROOT/out`` with these options (one worker: the points come in one order)."""
    def run(src: Path, root: Path) -> None:
        convert(src, root / "out", ConvertOptions(**options, workers=1, fsync=False))
    return run


def merging(src: Path, root: Path) -> None:
    """``megamoe merge ROOT/out ROOT/part0 ROOT/part1``: the parts in folders of their own."""
    merge(root / "out", [root / "part0", root / "part1"], fsync=False)


def two_parts(src: Path, root: Path) -> None:
    """The two parts of the tiny preset's layer 0 for EP 2, each converted into its own folder."""
    for index in range(2):
        convert(src, root / f"part{index}", ConvertOptions(ep_size=2, layers="0", shard=(index, 2), fsync=False))


@dataclass(frozen=True)
class Command:
    """A command stopped in these tests (``run``), and what an earlier one left in its folder for it
    (``earlier``; ``None``: nothing). Both take the source and a folder, whose ``out`` is OUT."""

    run: Callable[[Path, Path], None]
    earlier: Callable[[Path, Path], None] | None = None


#: The commands stopped, on the tiny checkpoint: few files, and every kind of write (state, small
#: copies, non-expert shards, expert shards, index, manifest, journal, a merge's links).
COMMANDS: dict[str, Command] = {
    "per-rank": Command(converting(ep_size=2, layers="0")),
    "store": Command(converting(ep_size=None, layers="0")),
    # Part 0/2 is already in OUT: the stopped part is the last one, so it also merges both.
    "shard part": Command(converting(ep_size=2, layers="0,1", shard=(1, 2)),
                          converting(ep_size=2, layers="0,1", shard=(0, 2))),
    # OUT holds a conversion of more layers: cleared, then written anew.
    "overwrite": Command(converting(ep_size=2, layers="0", overwrite=True), converting(ep_size=2, layers="0,1")),
    "merge": Command(merging, two_parts),
}
STOPS = ("kill", "disk full")
#: Files a run creates that hold no content of its own (a lock is only ever locked).
CONTENTLESS = {"lock"}


class Stopped(BaseException):
    """Where a kill would end the process: nothing of the tool's catches it."""


@dataclass(frozen=True)
class Point:
    """One write: the hook passed, the file (relative to OUT), and how many times before this
    run passed that hook with that file (a state file is written more than once)."""

    hook: str
    path: str
    nth: int

    def __str__(self) -> str:
        return f"{self.hook}({self.path})#{self.nth}"


class Hooks:
    """Stands in for every ``faults.before_*`` hook: records the points a run passes, and stops
    the run at ``stop`` (by ``how``: a kill, or a full disk)."""

    def __init__(self, out: Path, stop: Point | None = None, how: str = "kill") -> None:
        self.out, self.stop, self.how = out, stop, how
        self.passed: list[Point] = []
        self.kept: tuple[Path, Path] | None = None  # (kept copy, temporary file) of a killed write
        self._lock = threading.Lock()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in write_hooks():
            monkeypatch.setattr(faults, name, self._hook(name))

    def _hook(self, name: str) -> Callable[[Path], None]:
        return lambda path: self._pass(name, Path(path))

    def _pass(self, hook: str, path: Path) -> None:
        rel = path.relative_to(self.out).as_posix()
        with self._lock:
            point = Point(hook, rel, sum(1 for p in self.passed if (p.hook, p.path) == (hook, rel)))
            self.passed.append(point)
        if point != self.stop:
            return
        if self.how == "disk full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        tmp = partial_path(path)
        if tmp.exists():  # a kill leaves the finished temporary file behind: keep it from the cleanup
            keep = tmp.with_name(tmp.name + ".kept")
            os.link(tmp, keep)
            self.kept = (keep, tmp)
        raise Stopped(str(point))

    def leave_what_a_kill_leaves(self) -> None:
        if self.kept is None:
            return
        keep, tmp = self.kept
        if tmp.exists():  # the tool's own clean-up did not remove it
            keep.unlink()
        else:
            os.replace(keep, tmp)


def write_hooks() -> list[str]:
    """The fault hooks called with a file about to be written: the named write points."""
    return sorted(name for name in dir(faults) if name.startswith("before_") and callable(getattr(faults, name)))


def run(command: str, src: Path, root: Path, hooks: Hooks, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        hooks.install(patch)
        COMMANDS[command].run(src, root)


@dataclass
class Clean:
    """A command's uninterrupted run: its folder before it, the points it passed, OUT's files after
    it, and which of them it wrote (created or replaced)."""

    before: Path
    points: list[Point]
    files: dict[str, bytes]
    written: set[str]


def identities(out: Path) -> dict[str, tuple[int, int]]:
    """Each file of OUT (state included) with its inode and mtime: a rewrite changes one of them."""
    if not out.exists():
        return {}
    return {p.relative_to(out).as_posix(): ((st := p.stat()).st_ino, st.st_mtime_ns) for p in out.rglob("*")
            if p.is_file() and p.name not in CONTENTLESS}


@pytest.fixture(scope="module")
def clean(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Clean]:
    results = {}
    patch = pytest.MonkeyPatch()
    try:
        for command, spec in COMMANDS.items():
            before = tmp_path_factory.mktemp("before")
            if spec.earlier is not None:
                spec.earlier(tiny_ckpt, before)
            root = tmp_path_factory.mktemp("clean")
            shutil.copytree(before, root, symlinks=True, dirs_exist_ok=True)
            earlier = identities(root / "out")
            hooks = Hooks(root / "out")
            run(command, tiny_ckpt, root, hooks, patch)
            written = {path for path, ident in identities(root / "out").items() if earlier.get(path) != ident}
            results[command] = Clean(before, hooks.passed, output_files(root / "out"), written)
    finally:
        patch.undo()
    return results


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_file_a_conversion_writes_passes_a_named_write_point(clean, command):
    """The stops below cover everything written: no file of OUT, its state included, is written
    without passing a hook that names it."""
    run = clean[command]
    named = {p.path for p in run.points}
    assert {"manifest.json", ".megamoe/journal.jsonl"} <= run.written
    assert run.written <= named, f"written past every hook: {sorted(run.written - named)}"


@pytest.mark.parametrize("how", STOPS)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_stop_at_any_write_resumes_with_the_same_command(tiny_ckpt, tmp_path, clean, monkeypatch, command, how):
    """Every point of the clean run, stopped at in turn; the rerun's files are the clean run's.
    Every point's outcome is reported, not only the first failure's."""
    expected = Stopped if how == "kill" else OSError
    failures = []
    for i, point in enumerate(clean[command].points):
        root = tmp_path / f"{i}"
        shutil.copytree(clean[command].before, root, symlinks=True)
        out = root / "out"
        stopper = Hooks(out, point, how)
        try:
            run(command, tiny_ckpt, root, stopper, monkeypatch)
            failures.append(f"{how} at {point}: the run passed it without stopping")
            continue
        except expected as e:
            if isinstance(e, OSError) and e.errno != errno.ENOSPC:
                failures.append(f"{how} at {point}: stopped by another error: {e}")
                continue
        stopper.leave_what_a_kill_leaves()
        try:
            run(command, tiny_ckpt, root, Hooks(out), monkeypatch)
        except Exception as e:  # noqa: BLE001 - reported with the point it followed
            failures.append(f"{how} at {point}: the rerun failed: {e}")
            continue
        if output_files(out) != clean[command].files:
            failures.append(f"{how} at {point}: the rerun's files differ from an uninterrupted run's")
        if list(out.rglob("*.partial")):
            failures.append(f"{how} at {point}: the rerun left temporary files")
    assert not failures, "\n".join(failures)
