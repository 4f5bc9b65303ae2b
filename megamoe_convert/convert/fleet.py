"""One conversion spread over many machines: part manifests and ``megamoe merge``.

``megamoe convert ... --shard I/N`` converts part I of N (see :func:`.convert.shard_units`)
and, instead of ``manifest.json``, writes ``manifest.part-0000I-of-0000N.json``: the whole
plan (fingerprint, manifest skeleton, every file's path, the non-expert index) plus the
size and checksum of the files this part wrote. A part is never loadable on its own.

:func:`merge` gathers the N parts (from one shared OUT, or from N separate directories),
checks that they are the same plan and cover it exactly once, brings every file into OUT
(hard link where possible, else copy) re-checking sizes and checksums, then writes the
non-expert index and, last, ``manifest.json``: byte for byte what a single-machine
``megamoe convert`` writes. In a shared OUT the last part to finish merges automatically
(:func:`auto_merge`).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from megamoe_convert import faults, jsonio
from megamoe_convert.convert.plan import index_text, non_expert_index
from megamoe_convert.errors import MergeError, OutputBusy
from megamoe_convert.output.clearing import forget_replaced_conversion, remove_named
from megamoe_convert.output.locks import hold_whole_output
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.output.naming import MANIFEST_NAME, MERGED_PARTS_DIR, PART_GLOB, is_own_path, part_manifest_name
from megamoe_convert.output.preflight import check_free_space, check_no_links
from megamoe_convert.output.resume import OutputState, check_output_dir, differing_keys
from megamoe_convert.output.stamps import sample_hash
from megamoe_convert.output.writer import (
    AtomicWriter,
    FileRecord,
    check_writable_name,
    file_checksum,
    file_problem,
    fsync_dir,
    make_dirs_inside,
    new_hasher,
    partial_path,
    write_json_atomic,
)
from megamoe_convert.progress import NoProgress, Progress
from megamoe_convert.source.checkpoint import INDEX_NAME

if TYPE_CHECKING:
    from megamoe_convert.convert.plan import Plan

PART_FORMAT = "megamoe-convert-part"
PART_FORMAT_VERSION = 1
COPY_CHUNK_BYTES = 64 << 20


# --------------------------------------------------------------------------------------
# Part manifests
# --------------------------------------------------------------------------------------

def write_part_manifest(plan: "Plan", records: dict[str, FileRecord]) -> Path:
    """Written by a part when all its files are done (in place of ``manifest.json``)."""
    assert plan.options.shard is not None
    index, count = plan.options.shard
    skeleton = Manifest(
        source=plan.ckpt.source_record(), dims=plan.ckpt.dims, placement=plan.placement, ranks=plan.ranks,
        layers=plan.layers, experts_only=plan.options.experts_only, files=[], complete=False,
        engine=plan.engine, family=plan.family, store=plan.options.store,
        source_layers=[layer.key for layer in plan.ckpt.layers])
    data = {
        "format": PART_FORMAT, "format_version": PART_FORMAT_VERSION,
        "shard": {"index": index, "count": count, "by": plan.options.shard_by},
        "fingerprint": plan.fingerprint(),
        "manifest": skeleton.to_json(),
        "plan_files": plan.all_paths,
        "index": non_expert_index(plan),
        "files": [records[u.path].to_json() for u in plan.units],
        "source_stamp": plan.source_stamp(),
        # sampled bytes of every source shard: parts of two sources with one structure cannot merge
        "source_sample": {name: f"{sample_hash(path):016x}" for name, path in sorted(plan.source_paths().items())},
    }
    path = plan.out / part_manifest_name(index, count)
    write_json_atomic(path, json.dumps(data, indent=1) + "\n", fsync=plan.options.fsync)
    return path


@dataclass
class Part:
    """A finished part, as read from its part manifest."""

    dir: Path
    path: Path
    index: int
    count: int
    by: str
    fingerprint: dict[str, Any]
    manifest: dict[str, Any]
    plan_files: list[str]
    index_json: dict[str, Any] | None
    files: list[FileRecord]
    source_stamp: dict[str, Any]  # the source files' stamps as the part's machine saw them
    source_sample: dict[str, Any]  # sampled bytes of each source file

    @property
    def name(self) -> str:
        return f"part {self.index}/{self.count} ({self.path})"


def read_part(path: Path, root: Path | None = None) -> Part:
    """A part manifest, every field checked (paths must be ones the tool writes, inside OUT)."""
    data = jsonio.read(path, MergeError, "part manifest", jsonio.MAX_JSON_BYTES)
    f = jsonio.Fields(path, MergeError)
    if f.obj(data, name="part manifest").get("format") != PART_FORMAT:
        raise f.fail(f"not a megamoe part manifest (format={jsonio.short(data.get('format'))})")
    if (version := f.int(data, "format_version")) != PART_FORMAT_VERSION:
        raise f.fail(f"part format_version {version} is not {PART_FORMAT_VERSION}, the one this megamoe-convert "
                     "reads; convert the part again with this megamoe-convert")
    shard = f.obj(data, "shard")
    files = f.each(f.list(data, "files"), lambda x, label: _record(f, x, label), "files")
    plan_files = [f.str(p, name="plan_files[]") for p in f.list(data, "plan_files")]
    for rel in plan_files:
        if not is_own_path(rel):
            raise f.fail(f"file path {rel!r} is not a file this tool writes")
    index = None if data.get("index") is None else f.obj(data, "index")
    stamp, sample = f.obj(data, "source_stamp"), f.obj(data, "source_sample")
    count = f.int(shard, "count", lo=1, hi=1 << 16, name="shard.count")
    return Part(root or path.parent, path, f.int(shard, "index", hi=count - 1, name="shard.index"), count,
                f.str(shard, "by", name="shard.by"), f.obj(data, "fingerprint"), f.obj(data, "manifest"),
                plan_files, index, files, stamp, sample)


def check_one_source(parts: Sequence[Part]) -> None:
    """Every part converted from the same source bytes (as far as sampled blocks of each source file
    tell: two checkpoints of one structure have the same plan fingerprint)."""
    first = parts[0]
    for part in parts[1:]:
        differ = sorted(k for k in set(first.source_sample) | set(part.source_sample)
                        if first.source_sample.get(k) != part.source_sample.get(k))
        if differ:
            raise MergeError(f"{first.name} and {part.name} were converted from different sources ({differ[0]} "
                             f"holds other bytes); convert every part from the same checkpoint")


def _record(f: jsonio.Fields, item: Any, label: str) -> FileRecord:
    path = f.str(item, "path", f"{label}.path")
    if not is_own_path(path):
        raise f.fail(f"{label}.path {path!r} is not a file this tool writes")
    return FileRecord(path, f.int(item, "size", name=f"{label}.size"), f.str(item, "checksum", f"{label}.checksum"))


def find_parts(dirs: Iterable[Path]) -> list[Part]:
    """Every part manifest in ``dirs``, finished (top level) or already merged (kept in
    ``.megamoe/parts/``); each file once, however often its directory is named."""
    seen: set[Path] = set()
    parts = []
    for d in dirs:
        if not d.is_dir():
            raise MergeError(f"{d}: no such directory")
        for path in sorted(d.glob(PART_GLOB)) + sorted((d / MERGED_PARTS_DIR).glob(PART_GLOB)):
            if path.resolve() not in seen:
                seen.add(path.resolve())
                parts.append(read_part(path, d))
    return parts


def select_parts(parts: Sequence[Part], prefer: Path | None = None) -> tuple[list[Part] | None, str]:
    """The one complete set of parts (all of 0..N-1, one plan), or ``None`` and why not.

    Where a part is found twice (e.g. in OUT and in its own directory) with the same files,
    the copy under ``prefer`` (OUT) is used.
    """
    if not parts:
        return None, "no part manifests (manifest.part-*-of-*.json) found; run `megamoe convert --shard I/N` first"
    groups: dict[str, list[Part]] = {}
    for part in parts:
        key = json.dumps([part.count, part.fingerprint], sort_keys=True)
        groups.setdefault(key, []).append(part)
    complete, reasons = [], []
    for group in groups.values():
        count = group[0].count
        by_index: dict[int, Part] = {}
        for part in sorted(group, key=lambda p: prefer is not None and p.dir.resolve() != prefer.resolve()):
            other = by_index.get(part.index)
            if other is None:
                by_index[part.index] = part
            elif other.files != part.files:
                return None, f"{part.name} and {other.name} are the same part with different files"
        missing = [i for i in range(count) if i not in by_index]
        if missing:
            reasons.append(f"{len(missing)} of {count} parts missing (part {_ranges(missing)} not found; "
                           f"found {', '.join(str(p.path) for p in by_index.values())})")
        else:
            complete.append([by_index[i] for i in range(count)])
    if len(complete) > 1:
        return None, (f"{len(complete)} complete sets of parts of different conversions found; "
                      "merge them from separate directories")
    if not complete:
        if len(groups) == 1:
            return None, "; ".join(reasons)
        first, second = (group[0] for group in list(groups.values())[:2])
        keys = differing_keys(first.fingerprint, second.fingerprint)
        differ = f" ({', '.join(keys)} differ)" if keys else " (--shard N differs)"
        return None, (f"parts of {len(groups)} different conversions found{differ}, none complete: "
                      + "; ".join(reasons))
    return complete[0], ""


def _ranges(values: list[int]) -> str:
    from megamoe_convert.source.layer_spec import _ranges as ranges
    return ranges(values)


def check_coverage(parts: Sequence[Part]) -> list[tuple[Part, FileRecord]]:
    """Every file of the plan from exactly one part, in the plan's order."""
    plan_files = parts[0].plan_files
    owner: dict[str, tuple[Part, FileRecord]] = {}
    for part in parts:
        for record in part.files:
            if record.path in owner:
                raise MergeError(f"{record.path} was written by both {owner[record.path][0].name} and {part.name}")
            owner[record.path] = (part, record)
    missing = [p for p in plan_files if p not in owner]
    extra = sorted(set(owner) - set(plan_files))
    if missing or extra:
        what = f"{missing[0]} is in no part" if missing else f"{extra[0]} is not in the plan"
        raise MergeError(f"the parts do not cover the conversion exactly ({what})")
    return [owner[p] for p in plan_files]


# --------------------------------------------------------------------------------------
# Bringing files into OUT
# --------------------------------------------------------------------------------------

def _check(path: Path, record: FileRecord, where: str, verify: bool) -> None:
    problem = file_problem(path, record, where, checksum=verify)
    if problem:
        raise MergeError(f"{path}: {problem}")


def _copy(src: Path, dst: Path, out: Path, record: FileRecord, where: str, fsync: bool) -> None:
    """Copy under a temporary name, checking size and checksum before the rename."""
    hasher = new_hasher()
    with AtomicWriter(dst, out, fsync=fsync) as w, open(src, "rb") as f:
        while block := f.read(COPY_CHUNK_BYTES):
            hasher.update(block)
            w.write(block)
        if w.size != record.size:
            raise MergeError(f"{src}: size {w.size} bytes, {where} records {record.size}")
        if hasher.hexdigest() != record.checksum:
            raise MergeError(f"{src}: checksum mismatch with {where} (file is corrupted or was modified)")
        w.commit()


def place_file(part: Part, record: FileRecord, out: Path, verify: bool, fsync: bool) -> str:
    """Make ``OUT/record.path`` the part's file, checked; returns how: in_place/present/linked/copied."""
    src, dst = part.dir / record.path, out / record.path
    where = str(part.path)
    if not src.exists():
        raise MergeError(f"{src}: missing (listed in {where})")
    make_dirs_inside(out, dst.parent)  # never into a linked rank folder
    check_writable_name(dst)
    if dst.exists() and os.path.samefile(src, dst):
        _check(dst, record, where, verify)
        return "in_place"
    if dst.is_file() and dst.stat().st_size == record.size and (not verify or file_checksum(dst) == record.checksum):
        return "present"  # an earlier merge already brought it (sizes and checksum match)
    tmp = partial_path(dst)
    check_writable_name(tmp)
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # another filesystem, or no hard links: copy (and check while copying)
        _copy(src, dst, out, record, where, fsync)
        return "copied"
    try:
        _check(tmp, record, where, verify)
        faults.before_rename(dst)
        os.replace(tmp, dst)
        if fsync:
            fsync_dir(dst.parent)  # the rename itself, durable like AtomicWriter's
    finally:
        tmp.unlink(missing_ok=True)
    return "linked"


# --------------------------------------------------------------------------------------
# Merge
# --------------------------------------------------------------------------------------

def merge(out: Path | str, parts: Sequence[Path | str] = (), *, verify: bool = True, fsync: bool = True,
          workers: int = 0, wait: bool = False, if_needed: bool = False,
          progress: Progress | None = None) -> dict[str, Any]:
    """Merge the parts of a split conversion into ``out``; returns a summary.

    ``parts``: directories holding part outputs (``out`` itself is always searched too, so
    ``merge(out)`` merges parts written into one shared directory). ``verify=False`` checks
    sizes only. ``wait``: wait for a concurrent merge into ``out`` instead of failing.
    ``if_needed``: do nothing if ``out`` already holds the merge of every part found.
    """
    out = Path(out)
    dirs = ([out] if out.is_dir() else []) + [Path(p) for p in parts]
    chosen, reason = select_parts(find_parts(dirs), prefer=out)
    if chosen is None:
        raise MergeError(f"cannot merge into {out}: {reason}")
    check_output_dir(out)
    with hold_whole_output(out, timeout=-1 if wait else 0, who="`megamoe merge`"):
        return _merge_locked(out, dirs, verify, fsync, workers, if_needed, progress or NoProgress())


def _merge_locked(out: Path, dirs: list[Path], verify: bool, fsync: bool, workers: int, if_needed: bool,
                  progress: Progress) -> dict[str, Any]:
    started = time.perf_counter()
    all_parts = find_parts(dirs)  # again, under the lock
    chosen, reason = select_parts(all_parts, prefer=out)
    if chosen is None:
        raise MergeError(f"cannot merge into {out}: {reason}")
    if if_needed and (out / MANIFEST_NAME).exists() and all(p.path.parent.resolve() != out.resolve() for p in chosen):
        return {"out": str(out), "parts": len(chosen), "already_merged": True}
    files = check_coverage(chosen)
    check_one_source(chosen)
    check_no_links(out, (r.path for _, r in files))  # refused before anything changes
    check_free_space(out, copied_bytes(out, files), "this merge", "free space, or merge on the filesystem that holds "
                     "the parts: hard links there take none", MergeError)
    remove_named(out, [MANIFEST_NAME])  # from here on, OUT is visibly unfinished
    forget_replaced_conversion(out, {r.path for _, r in files}, has_index=chosen[0].index_json is not None)
    progress.start(sum(r.size for _, r in files), len(files))
    how: dict[str, int] = {}
    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
        placed = pool.map(lambda item: place_file(item[0], item[1], out, verify, fsync), files)
        for (_, record), kind in zip(files, placed, strict=True):  # in order; the first failure is raised here
            how[kind] = how.get(kind, 0) + 1
            progress.advance(record.size, record.path, skipped=kind in ("in_place", "present"))
    first = chosen[0]
    listed = [r for _, r in files]
    if first.index_json is not None:
        listed.append(write_json_atomic(out / INDEX_NAME, index_text(first.index_json), fsync=fsync))
    # The whole-conversion state, as a single-machine run leaves it: a rerun of the same
    # `megamoe convert` (without --shard) into OUT then finds every file done.
    state = OutputState(out, fsync)
    state.source_path.unlink(missing_ok=True)
    state.write_state(first.fingerprint, shared_source_stamp(chosen))
    write_json_atomic(state.journal_path, "".join(json.dumps(r.to_json()) + "\n" for _, r in files), fsync=fsync,
                      root=out)
    data = dict(first.manifest, complete=True, files=[r.to_json() for r in listed])
    manifest = Manifest.from_json(data, str(first.path), sealed=False)
    write_json_atomic(out / MANIFEST_NAME, manifest.dumps(), fsync=fsync)
    make_dirs_inside(out, out / MERGED_PARTS_DIR)
    for part in chosen:  # consumed: OUT is now the whole conversion; kept out of sight for a re-merge
        if part.dir.resolve() == out.resolve() and part.path.parent.resolve() == out.resolve():
            faults.before_rename(out / MERGED_PARTS_DIR / part.path.name)
            os.replace(part.path, out / MERGED_PARTS_DIR / part.path.name)
    used = {p.path.resolve() for p in chosen}
    return {"out": str(out), "parts": len(chosen), "shard_by": first.by, "files": len(files),
            "bytes": sum(r.size for _, r in files), "verified": "checksum" if verify else "size",
            **{k: how.get(k, 0) for k in ("linked", "copied", "in_place", "present")},
            "ignored_part_manifests": [str(p.path) for p in all_parts if p.path.resolve() not in used],
            "seconds": round(time.perf_counter() - started, 3)}


def copied_bytes(out: Path, files: Sequence[tuple[Part, FileRecord]]) -> int:
    """Bytes a merge copies into ``out``: the files not already there whose part lies on another
    filesystem (a hard link, on the same one, takes no space)."""
    device = os.stat(out).st_dev
    need = 0
    for part, record in files:
        dst, src = out / record.path, part.dir / record.path
        if dst.is_file() and dst.stat().st_size == record.size:
            continue  # in place, or brought by an earlier merge
        if src.exists() and os.stat(src).st_dev != device:
            need += record.size
    return need


def shared_source_stamp(parts: Sequence[Part]) -> dict[str, Any] | None:
    """The source stamp every part recorded, where they agree (one source, read on one machine);
    else ``None``: a rerun of ``convert`` into OUT then cannot reuse the files without --overwrite."""
    stamps = [p.source_stamp for p in parts]
    return stamps[0] if all(s == stamps[0] for s in stamps) else None


def auto_merge(out: Path, fsync: bool = True) -> bool:
    """After a part finishes: if every part is now in ``out``, merge them (once, under a lock).

    Returns whether ``out`` holds the merged conversion. Parts elsewhere are left to an
    explicit ``megamoe merge``.
    """
    chosen, _ = select_parts(find_parts([out]), prefer=out)
    if chosen is None:
        return False
    try:  # once, if parts finish at the same time
        merge(out, verify=True, fsync=fsync, wait=True, if_needed=True)
    except OutputBusy:
        return False  # a part is (re)running: it merges when it finishes
    return True
