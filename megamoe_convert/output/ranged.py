"""A ranged pull (``megamoe pull --ep-size``): its record, ``OUT/.megamoe/ranges.json``, and its
sparse store files. The rules every writer and every reader of such a folder keep.

A ranged pull is one transaction bound to one commit. Before it changes anything in OUT it writes
its record unfinished (the commit, and the ranges an earlier pull of that same commit left); its
store files are written like every other file, at their offsets (:class:`.writer.OutputFile`:
below OUT, never through a link, a new one under its temporary name then renamed, an error naming
the file); the finished record (every range, and the checksum of the ``manifest.json`` they belong
to) is written last. A store file's bytes
outside its recorded ranges are holes, which no reader may take for experts, so every reader asks
:func:`served_ranges` first: no record, a complete folder; an unfinished record, or one of another
manifest, nothing is served; else only the recorded ranges. Whatever rewrites OUT (a whole pull,
``convert``, ``merge``) removes the manifest, then the record
(:func:`.clearing.forget_ranged_pull`).
"""

from __future__ import annotations

import bisect
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, TypeVar

from megamoe_convert import jsonio
from megamoe_convert.errors import JsonError
from megamoe_convert.output.naming import MANIFEST_NAME, STATE_DIR, STORE_DIR, is_shard_path
from megamoe_convert.output.writer import file_checksum, make_dirs_inside, write_json_atomic

E = TypeVar("E", bound=Exception)

RANGES_NAME = "ranges.json"
_CHECKSUM = re.compile(r"[0-9a-f]{32}")
#: ``(offset, nbytes)`` runs of a store file, sorted, not touching.
Ranges = list[tuple[int, int]]


@dataclass
class RangedRecord:
    """What a ranged pull holds: the commit, the manifest's checksum (empty while unfinished), each
    store file's ranges, and the repo they came from (empty in a record of an older pull): where
    more of them can be fetched (:func:`megamoe_convert.hub.ranges.fetch_experts`)."""

    commit: str
    manifest: str = ""
    complete: bool = False
    files: dict[str, Ranges] = field(default_factory=dict)
    repo_id: str = ""

    def to_json(self) -> dict[str, object]:
        return {"commit": self.commit, "manifest": self.manifest, "complete": self.complete,
                **({"repo_id": self.repo_id} if self.repo_id else {}),
                "files": {rel: [list(r) for r in ranges] for rel, ranges in sorted(self.files.items())}}


def record_path(out: Path) -> Path:
    return out / STATE_DIR / RANGES_NAME


#: What every damaged record's error ends with.
REFETCH = ": rerun `megamoe pull --ep-size` to fetch the ranges again"


def _parse(data: object, where: Path, error: type[E]) -> RangedRecord:
    """The record's fields, each checked (``error`` names the first that is wrong)."""
    f = jsonio.Fields(where, error, REFETCH)
    f.obj(data, name="ranged pull record")
    record = RangedRecord(f.str(data, "commit"), f.str(data, "manifest"), f.bool(data, "complete"),
                          repo_id=f.str(data, "repo_id") if "repo_id" in f.obj(data) else "")
    if record.manifest and not _CHECKSUM.fullmatch(record.manifest):
        raise f.fail("manifest must be the manifest's checksum (32 hex digits)")
    files = f.obj(data, "files")
    for rel, ranges in files.items():
        if not (rel.startswith(f"{STORE_DIR}/") and is_shard_path(rel)) or not isinstance(ranges, list):
            raise f.fail(f"{rel!r} is not a store file with a list of ranges")
        pairs = []
        for item in ranges:
            if (not isinstance(item, list) or len(item) != 2 or any(isinstance(v, bool) or not isinstance(v, int)
                                                                   for v in item) or item[0] < 0 or item[1] < 1):
                raise f.fail(f"{rel}: range {str(item)[:40]} is not [offset >= 0, nbytes >= 1]")
            pairs.append((item[0], item[1]))
        record.files[rel] = merge(pairs)
    return record


def read_record(out: Path, error: type[E], damaged_ok: bool = False) -> RangedRecord | None:
    """OUT's record, or ``None`` where there is none. A record that is no regular file (a link, a
    FIFO...) or cannot be read is ``error``; a damaged one too, unless ``damaged_ok`` (a pull
    then starts over: ``None``, as if absent)."""
    path = record_path(out)
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        raise error(f"{path}: is a symbolic link; megamoe never reads or writes its state through a link: "
                    "remove it (a ranged pull then fetches its ranges again)")
    raw = jsonio.read_regular(path, error, "ranged pull record", jsonio.MAX_STATE_BYTES)
    try:
        return _parse(jsonio.parse(raw, path, error, REFETCH), path, error)
    except error:
        if damaged_ok:  # a damaged record: the pull starts over
            return None
        raise


def write_record(out: Path, record: RangedRecord, fsync: bool = True) -> None:
    make_dirs_inside(out, record_path(out).parent)
    write_json_atomic(record_path(out), json.dumps(record.to_json()), fsync=fsync, root=out)


def manifest_checksum(out: Path) -> str:
    """The checksum a finished record binds its ranges to ("" where OUT has no manifest)."""
    try:
        return file_checksum(out / MANIFEST_NAME)
    except FileNotFoundError:
        return ""


def served_ranges(out: Path, error: type[E]) -> dict[str, Ranges] | None:
    """The ranges of each store file a reader may read: ``None`` for a folder with no ranged pull
    (every listed byte is there); else those of a finished record of OUT's own manifest, or ``error``."""
    record = read_record(out, error)
    if record is None:
        return None
    path = record_path(out)
    if not record.complete:
        raise error(f"{out}: a `megamoe pull` of commit {record.commit[:12]} into it did not finish (see {path}): "
                    "nothing in it is served until the same pull is rerun")
    try:
        current = manifest_checksum(out)
    except OSError as e:
        raise error(f"{out / MANIFEST_NAME}: cannot be read ({e.strerror or e})") from None
    if record.manifest != current:
        raise error(f"{path}: records a ranged pull of another manifest.json than {out}'s (the folder changed "
                    "since): rerun `megamoe pull --ep-size` to fetch its ranges")
    return record.files


def record_problem(out: Path) -> str | None:
    """What ``verify`` says of OUT's record: nothing without one; a ranged pull is no complete
    conversion (its store files hold only their recorded ranges), and a stale record is named."""
    if not os.path.lexists(record_path(out)):
        return None
    try:
        served_ranges(out, JsonError)
    except JsonError as e:
        return str(e)
    return ("a ranged pull (`megamoe pull --ep-size`): its store files hold only the byte ranges recorded here, "
            "not a complete conversion")


def covered(ranges: Ranges, offset: int, nbytes: int) -> bool:
    """Whether ``[offset, offset + nbytes)`` lies inside one of ``ranges`` (sorted, merged)."""
    i = bisect.bisect_right(ranges, (offset, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= offset and offset + nbytes <= ranges[i][0] + ranges[i][1]


def check_covered(out: Path, wanted: Mapping[str, Iterable[tuple[int, int, str]]], error: type[E],
                  served: Mapping[str, Ranges] | None = None) -> None:
    """Every ``(offset, nbytes, what)`` of each store file must be pulled bytes, never a hole
    (``served``: :func:`served_ranges`, where the caller has it already)."""
    served = served_ranges(out, error) if served is None else served
    if served is None:
        return
    for rel, reads in wanted.items():
        have = served.get(rel, [])
        for offset, nbytes, what in reads:
            if not covered(have, offset, nbytes):
                raise error(f"{out / rel}: bytes {offset}..{offset + nbytes} ({what}) were not pulled (see "
                            f"{record_path(out)}): pull these ranks with `megamoe pull --ep-size`")


def merge(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """``(offset, nbytes)`` runs sorted, touching or overlapping ones merged."""
    merged: list[list[int]] = []
    for start, end in sorted((s, s + n) for s, n in ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]
