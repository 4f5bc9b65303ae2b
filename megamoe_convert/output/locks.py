"""Who may write OUT at once.

Whole-directory writers (``convert`` without ``--shard``, ``merge``, ``pull --local-dir``) hold
``OUT/.megamoe/lock``; each part of a split conversion holds ``OUT/.megamoe/part-I-of-N/lock``.
Parts run side by side, but never beside a whole-directory writer. The two sides check each other
in opposite order (a writer takes its lock, then looks at the parts' locks; a part takes its own
lock, then looks at the writers' lock), so two that start at the same moment cannot both go on.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from megamoe_convert.errors import ConvertError, OutputBusy
from megamoe_convert.output.naming import STATE_DIR
from megamoe_convert.output.writer import make_dirs_inside

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
    try:  # only the acquisition is turned into a refusal: the body's own errors pass through
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


@contextmanager
def hold_part(out: Path, part_dir: Path, name: str) -> Iterator[None]:
    """Hold one part's lock (``part_dir/lock``; ``name``: ``I/N``), then refuse if a
    whole-directory writer holds OUT."""
    lock = part_dir / WHOLE_LOCK
    make_dirs_inside(out, part_dir)
    with holding(lock, 0, f"{out}: part {name} is already being converted by another "
                          f"`megamoe convert` (lock {lock} is held)"):
        if held_elsewhere(out / STATE_DIR / WHOLE_LOCK, GLANCE_TIMEOUT_S):
            raise OutputBusy(f"{out}: a `megamoe convert` without --shard or a `megamoe merge` is writing "
                             f"this directory; part {name} cannot run beside it")
        yield


def busy_parts(out: Path) -> list[str]:
    """Names (``I/N``) of the parts whose lock someone holds right now."""
    busy = []
    for path in sorted((out / STATE_DIR).glob(PART_LOCK_GLOB)):
        if held_elsewhere(path):
            index, count = path.parent.name.removeprefix("part-").split("-of-")
            busy.append(f"{int(index)}/{int(count)}")
    return busy
