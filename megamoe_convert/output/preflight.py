"""Checks made before a command writes anything: room on the disk, and no link on the way.

``convert`` and ``synth`` know every byte they will write before they write the first one; a
plan that cannot fit is refused in one line instead of filling the disk (a 2.6 MB checkpoint
once planned into ~0.5 TB with options inside their documented bounds). Links: every folder a
plan writes into must lie below its output directory with no symbolic link in between
(:func:`writer.make_dirs_inside` enforces it again at each write); checking them all first
means a refused run has changed nothing.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path
from typing import Any, Iterable, TypeVar

from megamoe_convert import faults, jsonio
from megamoe_convert.errors import ConvertError
from megamoe_convert.output.writer import check_real_folder

E = TypeVar("E", bound=Exception)

#: Kept free beyond the plan: the filesystem's own metadata, the journal, the manifest.
HEADROOM_BYTES = 16 << 20


def human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def free_bytes(target: Path) -> int:
    """Free bytes (for an unprivileged writer) on the filesystem that holds, or will hold, ``target``."""
    probe = Path(os.path.abspath(target))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return faults.free_bytes(shutil.disk_usage(probe).free)


def check_free_space(target: Path, need: int, what: str, hint: str, error: type[E]) -> None:
    """Refuse (``error``) when ``need`` bytes (plus a little headroom) do not fit where ``target`` lives."""
    free = free_bytes(target)
    if need + HEADROOM_BYTES > free:
        raise error(f"{target}: {what} needs {human(need)} of disk space but only {human(free)} is free there; "
                    f"nothing was written ({hint})")


def check_no_links(root: Path, paths: Iterable[str]) -> None:
    """Every existing level of the folder of each file ``paths`` names (relative to ``root``, ``/``
    separated) is a real directory (no symbolic link, no file in the way): raises
    :class:`~megamoe_convert.errors.LinkInOutput` naming the first that is not. Each level is looked at
    once, however many files share it (a plan of many ranks lists a folder per rank)."""
    seen: set[str] = set()
    for folder in sorted({posixpath.dirname(path) for path in paths}):
        current = ""
        for part in folder.split("/") if folder else ():
            current = posixpath.join(current, part)
            if current in seen:
                continue
            seen.add(current)
            if not check_real_folder(root / current):
                break


def check_before_converting(plan: Any, state: Any) -> None:
    """``convert``'s checks, before anything in OUT changes: an unreadable journal, a plan too large
    for a manifest, a link on the way to any file of the plan, a plan that does not fit on the disk
    (files already there with their journaled size count as kept)."""
    out = plan.out
    journal = state.journal()
    count = len(plan.all_paths or plan.units)
    if count > jsonio.MAX_PLAN_FILES:
        raise ConvertError(f"{out}: this conversion would write {count} files, more than a manifest can list "
                           f"({jsonio.MAX_PLAN_FILES}); convert fewer ranks or layers (--ranks, --layers)")
    check_no_links(out, (unit.path for unit in plan.units))
    need = 0
    for unit in plan.units:
        record = journal.get(unit.path)
        if record is None or not (path := out / unit.path).is_file() or path.stat().st_size != record.size:
            need += unit.nbytes
    check_free_space(out, need, "this conversion", "free space, or convert fewer ranks or layers: --ranks, --layers",
                     ConvertError)


__all__ = ["check_before_converting", "check_free_space", "check_no_links", "free_bytes", "human"]
